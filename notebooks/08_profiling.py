# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     notebook_metadata_filter: -jupytext.text_representation.jupytext_version
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 8. Profiling: where the time goes
#
# Chapters 1 to 7 measured memory to the byte. Time is harder to measure, because a GPU runs
# *asynchronously*: a Python line that launches a kernel returns long before the kernel ends, so a
# clock read in Python measures the CPU, not the GPU, unless you are careful. A careless timing does
# not only give a wrong number; it gives a wrong *explanation*. A step that takes as long at batch 1 as
# at batch 16 looks like "small kernels are inefficient", when in fact the GPU sat idle, waiting for
# Python to hand it the next kernel. This chapter builds the instruments that tell these cases apart and
# uses them on the book's two models. From here on, every speed number in the book comes from them.
#
# **What you will learn**
#
# - why `time.time()` around GPU code lies, and how to time correctly: synchronise or use CUDA events,
#   warm up, repeat at least ten times and show the spread;
# - how to compare two versions of a step so that the verdict survives a re-run: interleaved rounds, the
#   median per-round speed-up with its 95% interval, and a ±3% threshold for "faster" or "slower";
# - how to read `torch.profiler`: a category table (GEMM, attention, element-wise, optimizer, ...),
#   the **[GPU-busy](https://gpu-efficient-training.github.io/book/book/glossary.html#gpu-busy) fraction** of a step, kernel launches, the per-phase split, a timeline picture and a
#   trace file for Perfetto;
# - the three regimes a training step can be in ([host-bound](https://gpu-efficient-training.github.io/book/book/glossary.html#host-bound), memory-bandwidth-bound, compute-bound),
#   measured on real workloads, with the fixes for the first two measured before and after (the
#   compute-bound regime's levers are chapters 4 and 5);
# - how to watch memory over time with PyTorch's allocator history, find a planted leak with it, and
#   read a real out-of-memory message;
# - what the [caching allocator](https://gpu-efficient-training.github.io/book/book/glossary.html#caching-allocator) does with variable-length batches, and what `expandable_segments` changes.
#
# **Prerequisites:** chapter 1 (the phases of a training step and their memory), chapter 3 (batch size)
# and chapter 5 ([mixed precision](https://gpu-efficient-training.github.io/book/book/glossary.html#mixed-precision), fused optimizers). A CUDA GPU for the timing sections; on a CPU the
# notebook runs with tiny models and skips the GPU-only steps, saying so.

# %%
import sys

if "google.colab" in sys.modules:  # Colab only. pip adds what Colab lacks (bitsandbytes, the book's helpers)
    # and upgrades transformers to the 5.x the book needs: nothing has imported it yet in this kernel, so no
    # restart is needed. Colab's torch already meets the book's floor and is kept (see the setup page).
    # %pip install -q --no-warn-conflicts "gpu-efficient-training @ git+https://github.com/gpu-efficient-training/book"

from helpers import env

env.quiet()  # warnings without file paths, no progress bars: outputs that read the same everywhere

import json
import os
import shutil
import subprocess
import textwrap
import time
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
from IPython.display import display

from helpers import (
    accounting,
    batching,
    cleanup,
    flops,
    gpus,
    measure,
    memsnap,
    models,
    profiler,
    prose,
    run_profile,
    steps,
    timing,
)
from helpers.measure import GIB, MIB

prof = env.start()  # plot style, number format, run profile; the table below names hardware and versions
pd.options.display.max_colwidth = None  # row labels and kernel names printed whole, not cut at 50 characters
dev = prof.device

# %% [markdown]
# The first cell that touches the GPU notes what PyTorch has allocated before any experiment (nothing),
# so that the last cell can check that the chapter gave everything back. It also decides the 16-bit type
# for [autocast](https://gpu-efficient-training.github.io/book/book/glossary.html#autocast): bf16 where the GPU's [tensor cores](https://gpu-efficient-training.github.io/book/book/glossary.html#tensor-cores) support it (compute capability 8.0 and newer), fp16 on
# older GPUs such as Colab's T4.

# %%
cap = gpus.capability()
AMP = gpus.amp_dtype()
baseline_mib = torch.cuda.memory_allocated() / MIB if prof.on_gpu else 0.0
if cap is not None:
    print(f"{cap.name}: compute capability {cap.major}.{cap.minor}; autocast uses {AMP}")
    if not cap.bf16:
        print("this GPU has no bf16 tensor cores: autocast runs in fp16 here")
else:
    print("CPU run: the models are tiny and autocast is off")

# %% [markdown]
# ## 8.1 Timing a GPU correctly
#
# **The GPU runs behind the CPU.** When Python calls `a @ b` on CUDA tensors, PyTorch checks the
# arguments, picks a kernel and puts it in the GPU's queue (a *stream*); then the call returns, and Python
# goes on while the GPU computes. A clock read right after the call measures how long it took to *queue*
# the work. Here are three ways to time the same large matrix product: the clock alone, the clock with
# `torch.cuda.synchronize()` (wait until the queue is empty) before reading it, and CUDA events, which
# the GPU itself timestamps when it reaches them in its queue. The last column converts each time into
# the FLOP rate it implies; one of them is faster than the GPU can possibly be.

# %%
n = prof.pick(tiny=512, full=8192)
mm_dtype = AMP if prof.on_gpu else torch.float32
gen = torch.Generator(device=dev).manual_seed(0)
a = torch.randn(n, n, device=dev, dtype=mm_dtype, generator=gen)
b = torch.randn(n, n, device=dev, dtype=mm_dtype, generator=gen)
matmul_flop = 2 * n**3


def per_call(k, sync):
    """Seconds per call of ``a @ b`` over ``k`` calls, reading the clock with or without synchronising."""
    measure.synchronize(dev)
    start = time.perf_counter()
    for _ in range(k):
        a @ b
    if sync:
        measure.synchronize(dev)
    elapsed = (time.perf_counter() - start) / k
    measure.synchronize(dev)  # never leave work in the queue for the next measurement
    return elapsed


first_call_s = per_call(1, sync=True)  # the first product: cuBLAS starts up, kernels load
second_call_s = per_call(1, sync=True)
mm = timing.time_it(lambda: a @ b, device=dev, warmup=3, repeat=10)
clocks = {
    "first call (synchronised)": first_call_s,
    "second call (synchronised)": second_call_s,
    "clock only, no synchronise (median of 10)": float(np.median([per_call(1, sync=False) for _ in range(10)])),
    "clock + synchronise (time_it, median of 10)": mm.wall.median,
}
if prof.on_gpu:
    clocks["CUDA events (time_it, median of 10)"] = mm.gpu.median
clock_table = pd.DataFrame({"time per call (ms)": {k: v * 1e3 for k, v in clocks.items()}})
clock_table["implied TFLOP/s"] = matmul_flop / pd.Series(clocks) / 1e12
peak = None
if prof.on_gpu:
    try:
        peak = gpus.peak_tflops(torch.cuda.get_device_name(), mm_dtype)
    except ValueError:  # a GPU the table does not know
        peak = None
clock_table

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title What the three clocks said about one n x n product
def clocks_text(n, nosync_s, t, first_s, peak_tflops, flop):
    """What the three clocks said about one n x n product (``t``: its ``time_it`` result)."""
    peak_txt = f"this GPU's datasheet peak is {peak_tflops:,.0f} TFLOP/s" if peak_tflops else "no GPU reaches that"
    wall, events = t.wall.median, t.gpu.median
    gap = 1 - events / wall
    events_txt = (f"the CUDA events give {prose.ms(events)}, {prose.pct(gap)} below the synchronised clock, which also "
                  f"counts the launch and the synchronisation" if gap >= 0.005 else
                  f"the CUDA events give {prose.ms(events)}, within 0.5% of the synchronised clock")
    return (f"Without synchronising, one product of two {n} x {n} matrices seems to take {nosync_s * 1e3:.3f} ms, "
            f"which would mean {flop / nosync_s / 1e12:,.0f} TFLOP/s; {peak_txt}. That number is the time to *queue* "
            f"the kernel. Synchronised, the product takes {prose.ms(wall)} ({flop / wall / 1e12:,.0f} TFLOP/s), and "
            f"{events_txt}. The very first product took {first_s * 1e3:.1f} ms, {first_s / wall:.0f} times the steady "
            f"state. A first call typically pays for one-time work: cuBLAS creating its handle and workspace, CUDA "
            f"loading the kernel's code on first use (lazy loading), a library choosing its algorithm. Never time a "
            f"first call.")


if prof.on_gpu:
    prose.say(clocks_text(n, clocks["clock only, no synchronise (median of 10)"], mm, first_call_s, peak, matmul_flop))
else:
    print("skipped on CPU: a CPU computes synchronously, so the clock alone is right there")


# %% [markdown]
# **One helper for every timing.** `timing.time_it(fn, device=...)` does it right once: `warmup` untimed
# calls, then `repeat` (default 10) timed calls, each with three clocks:
#
# - *wall*: start of the call to the end of the GPU's work (the clock plus `synchronize`);
# - *GPU*: CUDA events recorded before and after the call;
# - *[host enqueue](https://gpu-efficient-training.github.io/book/book/glossary.html#host-enqueue)*: start of the call until it returns, before synchronising: how long the CPU needs to
#   issue the work.
#
# It reports the median, the interquartile range (IQR, the middle half of the samples) and the extremes.
# Then, after one more warm-up call, three calls run under the profiler; the median of their GPU busy time
# over the median wall time is the **GPU-busy fraction**: the share of the wall time in which some kernel
# was running. The key lines, without the bookkeeping:
#
# ```python
# start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
# t0 = time.perf_counter()
# start_ev.record()
# fn()
# host = time.perf_counter() - t0          # the CPU is done issuing the work
# end_ev.record()
# torch.cuda.synchronize()
# wall = time.perf_counter() - t0          # the GPU is done too
# gpu = start_ev.elapsed_time(end_ev) / 1e3
# ```
#
# If the host needed about as long to *issue* the work as the whole call took, and the GPU was busy only a
# small part of the time, the GPU was waiting for the CPU: the call is **host-bound** (also called
# launch-bound or overhead-bound). If the GPU was busy nearly all the time, it is **[GPU-bound](https://gpu-efficient-training.github.io/book/book/glossary.html#gpu-bound)**.
# `timing.verdict` draws the lines: GPU-bound from 90% busy; host-bound when the GPU was busy less than 70%
# of the time and the host issued work for longer than the GPU ran; **mixed** in between, where both sides
# matter (the 20-point band also keeps a step whose busy fraction moves by a few points between two runs
# from jumping from one word to the other). Two extreme cases show both verdicts: 200 additions on a 64 x 64 matrix (tiny kernels) and the large matrix
# product from above.

# %%
small = torch.zeros(64, 64, device=dev)
regimes_demo = {
    "200 tiny additions (64 x 64)": timing.time_it(lambda: [small.add_(1) for _ in range(200)], device=dev),
    f"one {n} x {n} matrix product": mm,
}
demo_table = pd.DataFrame({k: t.summary() for k, t in regimes_demo.items()}).T
demo_table

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title The two extremes
def regimes_text(tiny_t, mm_t, launches=200):
    """The two extremes: ``launches`` tiny additions (host-bound) against one large product (GPU-bound)."""
    return (f"The tiny additions keep the GPU busy {prose.pct(tiny_t.gpu_busy)} of the time: each kernel runs for "
            f"{tiny_t.kernel_s / launches * 1e6:.1f} µs, but launching it costs the CPU "
            f"{tiny_t.host.median / launches * 1e6:.1f} µs. The CUDA events ({tiny_t.gpu.median * 1e3:.2f} ms) say "
            f"nearly the same as the wall clock ({tiny_t.wall.median * 1e3:.2f} ms) and the host "
            f"({tiny_t.host.median * 1e3:.2f} ms): on an idle stream the first event completes as soon as it is "
            f"recorded, so the events span the whole call, the host's launches and the GPU's idle gaps included. On "
            f"their own they cannot tell a busy GPU from a waiting one; the GPU-busy fraction can. The matrix product "
            f"keeps the GPU busy {prose.pct(mm_t.gpu_busy)} of the time, and the CPU needed only "
            f"{mm_t.host.median * 1e6:.0f} µs to issue it.")


if prof.on_gpu:
    prose.say(regimes_text(regimes_demo["200 tiny additions (64 x 64)"], mm))
else:
    print("skipped on CPU: GPU-busy and host enqueue time need a GPU (the table shows wall time only)")

# %% [markdown]
# **Spread, and comparing two versions.** The IQR column is the noise *within* one block of samples. It says
# nothing about what happens *between* blocks: a host-bound call is timed on the CPU, and the CPU's speed
# drifts with everything else that runs on the machine (other processes, clock boosts, caches). So "time
# version A ten times, then version B ten times, and compare the medians against the IQRs" can call
# identical work faster or slower: the drift between the two blocks lands in the difference of the
# medians, and the IQRs, measured within each block, do not contain it.
#
# The book therefore compares two versions **interleaved**: after a warm-up, it times one call of A and one
# of B in each round (A, B in one round, B, A in the next, so neither always goes first), for at least ten
# rounds (15 by default). Both samples of a round run within milliseconds of each other, so a drift moves
# both alike and their ratio stays. The result is the **median of the per-round ratios** (A's time over B's:
# above 1, B is faster), with a 95% interval for it taken from the order statistics of the rounds (no
# assumption about the distribution). B is called *faster* or *slower* only when the whole interval lies
# beyond ±3% (`timing.PRACTICAL_THRESHOLD`); otherwise the verdict is *no practical difference*: either the
# interval includes 1 (the noise cannot tell A from B) or it lies within ±3% (a real difference, too small to matter).
# `timing.interleaved(a, b, device=...)` does this, and every comparison of the book from here on comes
# from it:
#
# ```python
# for r in range(rounds):
#     for side in ((a, b) if r % 2 == 0 else (b, a)):
#         times[side].append(timed_call(side))      # synchronised, as in time_it
# ratios = [ta / tb for ta, tb in zip(times[a], times[b])]
# speedup, (lo, hi) = median(ratios), median_interval(ratios)
# ```
#
# To see why, we time **the same work on both sides**, the 200 tiny additions (a host-bound call, the kind
# whose time the CPU decides), once interleaved and in five pairs of blocks of ten (`timing.blocks`: the old
# method, medians against the larger IQR). Whatever either method says, there is nothing to find.

# %%
def tiny_adds():
    for _ in range(200):
        small.add_(1)


same_work = timing.interleaved(tiny_adds, tiny_adds, device=dev, names=("A", "A again"), busy=False)
block_tries = [timing.blocks(tiny_adds, tiny_adds, device=dev, repeat=10) for _ in range(5)]
method_rows = {f"two blocks of 10, try {i + 1}": {"speed-up (A's time / A again's)": r["speed-up"],
                                                   "verdict": r["verdict"]} for i, r in enumerate(block_tries)}
round_ratios = timing.Spread.of(same_work.ratios)
method_rows[f"interleaved, {same_work.rounds} rounds"] = {
    "speed-up (A's time / A again's)": same_work.speedup, "95% low": same_work.lo, "95% high": same_work.hi,
    "per-round ratios, min": round_ratios.min, "per-round ratios, max": round_ratios.max,
    "verdict": same_work.verdict}
method_table = pd.DataFrame(method_rows).T[list(method_rows[f"interleaved, {same_work.rounds} rounds"])]
method_table = method_table.rename_axis("identical work, method")
method_table

# %%
fig, ax = plt.subplots(figsize=(8, 3.2))
band = 1 + timing.PRACTICAL_THRESHOLD
ax.axhspan(1 / band, band, color="0.9", label="±3%: no practical difference")
ax.plot(np.zeros(same_work.rounds), same_work.ratios, "o", alpha=0.6, label="interleaved: one ratio per round")
ax.errorbar([0.25], [same_work.speedup], yerr=[[same_work.speedup - same_work.lo], [same_work.hi - same_work.speedup]],
            fmt="s", color="C0", capsize=4, label="interleaved: median, 95% interval")
ax.plot(np.ones(len(block_tries)), [r["speed-up"] for r in block_tries], "x", color="C3", ms=9,
        label="two blocks: ratio of medians, each try")
ax.set_xticks([0.12, 1], ["interleaved", "blocks"])
ax.set_xlim(-0.5, 1.5)
ax.set_yscale("log")  # ratios: 2x and 1/2x equally far from 1
y_lo, y_hi = ax.get_ylim()
ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%.2f") if y_hi / y_lo < 2  # label the fine ticks
                             else matplotlib.ticker.NullFormatter())                          # only on a narrow axis
ax.set_ylabel("speed-up (time ratio, log scale)")
ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
ax.set_title("identical work on both sides: what each method reports")
fig.tight_layout()

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title What the block method and the interleaved rounds reported for identical work on both sides
def methods_text(block_rows, c):
    """What the block method and the interleaved rounds reported for identical work on both sides."""
    words = [r["verdict"] for r in block_rows]
    ratios = [r["speed-up"] for r in block_rows]
    called = sum(w in ("faster", "slower") for w in words)  # counted, not named: the words change from run to run
    if called:
        blocks_txt = (f"In this run, the block method declared a difference between identical pieces of work in {called} "
                      f"of {len(words)} tries (ratios of medians {min(ratios):.3f} to {max(ratios):.3f}; the table "
                      f"says which way): the drift between two blocks was larger than the IQR within them.")
    else:
        blocks_txt = (f"In this run, none of the {len(words)} block comparisons declared a difference (ratios of "
                      f"medians {min(ratios):.3f} to {max(ratios):.3f}): identical work still differed by up to "
                      f"{max(abs(r - 1) for r in ratios):.1%} between blocks, but each time less than the blocks' IQR, "
                      f"which is all the block method checks. When the host drifts more than that between two blocks, "
                      f"the block method declares a difference where there is none.")
    spread = timing.Spread.of(c.ratios)
    if timing.within_threshold(c):
        inside = "its whole interval lies inside ±3%"
    elif c.verdict == timing.NO_DIFFERENCE:
        inside = "its interval reaches beyond ±3%: these rounds were too noisy to rule out a 3% difference"
    else:
        inside = ("for identical work that is a false alarm, rare when the whole 95% interval must clear ±3%, "
                  "but possible")
    return (f"{blocks_txt} Interleaved, the same work gave {c.phrase()}; {inside}. The per-round ratios spread from "
            f"{spread.min:.3f} to {spread.max:.3f} (middle half {spread.q1:.3f} to {spread.q3:.3f}): single rounds "
            f"are noisy too, but their median is not pulled by a drift that affects both sides of every round.")


prose.say(methods_text(block_tries, same_work))

# %%
freed = cleanup.free(globals(), "a", "b", "small")
if prof.on_gpu:
    print(f"allocated after freeing the matrices: {freed.allocated_after_mib:.0f} MiB "
          f"(cuBLAS keeps a workspace; the last cell of the chapter gives it back)")

# %% [markdown]
# ## 8.2 `torch.profiler` on the book's models
#
# A timing says how long; a profile says *where*. `profiler.profile(step, device=...)` runs a training
# step under `torch.profiler` with CPU and CUDA activities (a warm-up step, then the profiled ones), writes
# the trace to a file, and reduces it to a few tables. The step marks its phases with `record_function`,
# so every kernel can be assigned to the phase in which the CPU launched it. The book's step,
# `steps.make_step(model, optimizer, batch, amp=...)`, is these lines (plus a loss scaler for fp16):
#
# ```python
# with record_function("forward"), torch.autocast("cuda", dtype=torch.bfloat16):
#     loss = model(**batch).loss
# with record_function("backward"):
#     loss.backward()
# with record_function("optimizer"):
#     optimizer.step()
#     optimizer.zero_grad(set_to_none=True)
# ```
#
# Under the hood it is the standard recipe, `torch.profiler.profile(activities=[CPU, CUDA],
# schedule=schedule(wait=0, warmup=1, active=3), on_trace_ready=...)` with `prof.step()` after each step.
#
# The two models of the book, each at a small and a larger batch: `bert-large-uncased` (classification, 512
# tokens) and the GPT-NeoX shape of `polyglot-ko-1.3b` (causal LM, 256 tokens), with fp32 weights, 16-bit
# autocast (bf16; fp16 with a loss scaler on GPUs without bf16) and `torch.optim.AdamW` with its default
# (`foreach`) implementation. A configuration that does
# not fit the GPU becomes a row that says so: the 1.3B model's weights, gradients and AdamW states take 16
# bytes per parameter, about 20 GiB, more than a T4 has.

# %%
BIG_GPU = prof.on_gpu and torch.cuda.get_device_properties(0).total_memory > 40 * 2**30  # room for bert-large at 64 x 512
SETUPS = {
    "bert-large-uncased": dict(head="sequence-classification", task="classification",
                               seq_len=prof.pick(tiny=64, full=512),
                               # 64 where it fits: at 32 x 512 an H100's bf16 step sits at the edge (GPU busy 95% in
                               # one run, under 90% in another), at 64 the GPU is the limit
                               batches=prof.pick(tiny=(2, 8), full=(4, 64 if BIG_GPU else 32))),
    "polyglot-ko-1.3b": dict(head="causal-lm", task="causal-lm",
                             seq_len=prof.pick(tiny=64, full=256), batches=prof.pick(tiny=(2, 8), full=(1, 32))),
}
TRACES = Path("traces")  # trace files land next to the notebook (open them in https://ui.perfetto.dev)
TRACES.mkdir(exist_ok=True)


def build(name, **optimizer_kwargs):
    """Model ``name`` (fp32 weights, seeded) and an AdamW for it."""
    model = models.build(name, head=SETUPS[name]["head"], dtype=torch.float32).train()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-5, **optimizer_kwargs)


def batch_of(name, batch_size):
    """A batch of random tokens for model ``name``'s task and length (``steps.batch_for``), on the device."""
    return steps.batch_for(SETUPS[name]["task"], batch_size, SETUPS[name]["seq_len"], dev)


AMP_STEP = AMP if prof.on_gpu else None  # 16-bit autocast on GPUs; the CPU run keeps fp32


def run_config(name, batch_size):
    """Time one configuration (10 repeats; 3 in the tiny profile) and profile it (3 steps); a table row and the profile."""
    model, optimizer = build(name)  # freed when the function returns (or by try_batch after an OOM)
    step = steps.make_step(model, optimizer, batch_of(name, batch_size), amp=AMP_STEP)
    trace = TRACES / f"{name}_bs{batch_size}.json.gz"
    t = timing.time_it(step, device=dev, warmup=prof.pick(tiny=1, full=3), repeat=prof.pick(tiny=3, full=10),
                       trace_path=trace)  # tiny: CI's CPU run
    p = t.profile if t.profile is not None else profiler.profile(step, device=dev, active=3, trace_path=trace)
    tokens = batch_size * SETUPS[name]["seq_len"]
    row = {
        "tokens/s": tokens / t.wall.median,
        "wall median (ms)": t.wall.median * 1e3,
        "wall IQR (ms)": t.wall.iqr * 1e3,
        "host enqueue (ms)": t.host.median * 1e3,
        "GPU kernel time (ms)": p.gpu_ms if p.on_gpu else np.nan,
        "GPU busy": t.gpu_busy if p.on_gpu else np.nan,
        "verdict": t.verdict,
        "host µs per GPU op": timing.us_per_launch(t) if p.on_gpu else np.nan,
        "wall under the profiler (ms)": p.wall_ms,
        "GPU ops/step": p.kernels_per_step,
        "launch calls/step": p.launches_per_step,
    }
    return row, p


rows, profiles_by_config = {}, {}
for name, setup in SETUPS.items():
    for bs in setup["batches"]:
        attempt = batching.try_batch(lambda bs, name=name: run_config(name, bs), bs)
        key = (name, bs)
        if attempt.fits:
            rows[key], profiles_by_config[key] = attempt.value
        else:
            rows[key] = {"tokens/s": np.nan, "note": f"out of memory ({attempt.error})"}
step_table = pd.DataFrame(rows).T.rename_axis(["model", "batch"])
step_table

# %% [markdown]
# Where does the time go? The category table of each configuration (shares of its GPU time; on a CPU, of
# the CPU operators' self time), the split by phase, and the kernels that took the longest in one of them.

# %%
categories = pd.DataFrame({f"{m} bs{b}": p.categories()["share"] * 100 for (m, b), p in profiles_by_config.items()})
categories.rename_axis("% of the GPU time" if prof.on_gpu else "% of the CPU operators' self time")

# %%
phase_table = pd.concat({f"{m} bs{b}": p.phases() for (m, b), p in profiles_by_config.items()}, names=["config"])
phase_table

# %%
big_bert = ("bert-large-uncased", SETUPS["bert-large-uncased"]["batches"][-1])
top = profiles_by_config[big_bert].top_kernels(10, width=70) if big_bert in profiles_by_config else None
top

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title The regime of each configuration
def regime_lines(r):
    """The regime of each configuration: one bullet per model (busy, step time, host enqueue, verdict) and one
    on the host-bound rows; ``r``: the step table's rows of the configurations that fit, indexed by (model, batch)."""
    lines = []
    for name in dict.fromkeys(m for m, _ in r.index):
        lines.append(f"- **{name}**, " + "; ".join(
            f"batch {b}: GPU busy {prose.pct(row['GPU busy'])} of a {row['wall median (ms)']:.0f} ms step, host "
            f"enqueue {row['host enqueue (ms)']:.0f} ms, *{row['verdict']}*" for (m, b), row in r.iterrows() if m == name)
            + ".")
    host_bound = [(m, b) for (m, b), row in r.iterrows() if row["verdict"] == "host-bound"]
    us = r["host µs per GPU op"].astype(float)
    if host_bound:
        lines.append(
            f"- **Host-bound: {prose.listing(f'{m} at batch {b}' for m, b in host_bound)}.** There the CPU needs longer "
            f"to issue the step's {min(r.loc[k, 'GPU ops/step'] for k in host_bound):,} or more GPU operations than the "
            f"GPU needs to run them, and the GPU waits. There this host spends "
            f"{us[host_bound].min():.0f} to {us[host_bound].max():.0f} µs per operation (host enqueue time over GPU "
            f"operations; in a GPU-bound step that time also counts the CPU waiting on a full launch queue, so it is "
            f"no launch cost): which configurations land on this side is decided by "
            f"the CPU as much as by the GPU, and a faster host moves the line to smaller batches.")
    else:
        lines.append(
            f"- **No configuration is host-bound here** (this host spends {us.min():.0f} to {us.max():.0f} µs per GPU "
            f"operation): by the verdicts above, at every batch that fit the CPU issues the work at least about as fast "
            f"as the GPU runs it.")
    return lines


if prof.on_gpu and profiles_by_config:
    r = step_table.loc[list(profiles_by_config)]
    lines = regime_lines(r)
    l_keys = [k for k in profiles_by_config if k[0] == "polyglot-ko-1.3b"]
    if len(l_keys) == 2 and r.loc[l_keys[0], "verdict"] == "host-bound":
        (_, l0), (_, l1) = l_keys
        lines.append(
            f"  The 1.3B model took {r.loc[l_keys[0], 'wall median (ms)']:.0f} ms at batch {l0} and "
            f"{r.loc[l_keys[1], 'wall median (ms)']:.0f} ms at batch {l1}, {l1 // l0} times the tokens: not inefficient "
            f"small kernels, but a GPU waiting for its work.")
    if len(l_keys) == 2:
        (_, l0), (_, l1) = l_keys
        cat_l0 = profiles_by_config[l_keys[0]].categories()["share"]
        lines.append(
            f"- **What the GPU does when it works.** At batch {l0} the optimizer's kernels are {cat_l0['optimizer']:.0%} "
            f"of the 1.3B model's GPU time: AdamW reads and writes 28 bytes per parameter (section 8.3), whatever the "
            f"batch.")
    if big_bert in profiles_by_config:
        pb = profiles_by_config[big_bert]
        cat_b = pb.categories()["share"]
        ev = pb.gpu_events
        ew = ev[[profiler.kernel_category(n, cat=c, phase=ph) == "element-wise / normalisation"
                 for n, c, ph in zip(ev["name"], ev["cat"], ev["phase"])]]
        copies = ew[ew["name"].str.contains("copy_kernel")]
        fwd_share = copies.loc[copies["phase"] == "forward", "dur_us"].sum() / copies["dur_us"].sum()
        lines.append(
            ("  " if len(l_keys) == 2 else "- **What the GPU does when it works.** ")
            + f"At batch {big_bert[1]}, bert-large spends {cat_b['GEMM']:.0%} of its GPU time in matrix products, "
            f"{cat_b['attention']:.0%} in attention and {cat_b['element-wise / normalisation']:.0%} in element-wise and "
            f"normalisation kernels. {copies['dur_us'].sum() / ew['dur_us'].sum():.0%} of the latter are copy kernels "
            f"(`direct_copy`, `bfloat16_copy`): dtype conversions and layout copies, autocast's casts to 16 bits among "
            f"them; {fwd_share:.0%} of their time is in the forward pass.")
    prose.say("\n".join(lines))
elif prof.on_gpu:
    print("no configuration fit this GPU")
else:
    print("skipped on CPU: GPU-busy and kernel counts need a GPU (the tables above show CPU operator time)")

# %% [markdown]
# GPU busy is the GPU's busy time in the profiled steps divided by the *unprofiled* median wall time: the
# profiler slows the host (compare the last-but-two column with the wall median), which would make a
# host-bound step look idler than it is.
#
# **The timeline.** The same information as a picture: one profiled step of bert-large at each batch size,
# drawn from the trace. The top rows are the CPU (the phases, then the operators it dispatched on the main
# thread and on the autograd engine's thread); then the GPU's stream, every kernel drawn at its true width
# and coloured by category (microsecond kernels are thin lines); the last row shows, slice by slice, the
# fraction of time the GPU was busy. White space there is time in which the GPU had nothing to do. These are
# profiled steps: the profiler slows the CPU, so they are longer than the timed ones.

# %%
bert_keys = [k for k in profiles_by_config if k[0] == "bert-large-uncased"]
fig, axes = plt.subplots(len(bert_keys), 1, figsize=(11, 3.4 * len(bert_keys)))
for ax, key in zip(np.atleast_1d(axes), bert_keys):
    p = profiles_by_config[key]
    start_us, end_us = p.windows_us[0]
    busy = f", GPU busy {p.busy_us_per_step()[0] / (end_us - start_us):.0%}" if p.on_gpu else " (CPU run: no GPU rows)"
    profiler.timeline(p, ax=ax, title=f"bert-large, batch {key[1]}: one profiled step, {(end_us - start_us) / 1e3:.0f} ms{busy}")
fig.tight_layout()

# %% [markdown]
# The trace files are in `notebooks/traces/` (not part of the repository: run the notebook to make them).
# Open one at [ui.perfetto.dev](https://ui.perfetto.dev) (or `chrome://tracing`) to zoom into single
# kernels, see their launch arrows from the CPU, and read each kernel's grid size and duration.

# %%
sorted(str(p.trace_path) for p in profiles_by_config.values())

# %% [markdown]
# ## 8.3 The three regimes, and the fix for each
#
# A training step is limited by one of three things, and each has its own fix:
#
# | regime | symptom | fix |
# |---|---|---|
# | **host-bound** (launch-bound) | GPU busy ≪ 100%; host enqueue ≈ wall time; step time flat in the batch size | more work per kernel (larger batch), fewer launches (fused kernels, CUDA graphs, `torch.compile`) |
# | **memory-bandwidth-bound** | GPU busy; kernels move many bytes per FLOP (element-wise, normalisation, optimizer) | fewer passes over memory: fused kernels (fused AdamW, fused attention) |
# | **compute-bound** | GPU busy; time in large GEMMs near the measured matmul ceiling | less arithmetic (no recomputation), lower precision, better shapes |
#
# ### Host-bound: step time against batch size
#
# Chapter 3 trained the 1.3B model with fp16 weights, eager attention and 256 tokens and found a step time
# that barely changed with the batch size. Here is that setup again, timed with `time_it` (10 repeats,
# spread shown) with the GPU-busy fraction at each batch size. Each synchronised call starts with an idle
# GPU, which a training loop does not: there the CPU issues step n+1 while the GPU finishes step n. So
# `time_it(..., loop=3)` also times three steps back to back with one synchronisation (10 repeats), and
# the throughput column comes from that.
#
# A warning before reading the numbers: a host-bound step is timed on the CPU, and on a shared machine the
# CPU's speed changes from minute to minute. Compare the IQRs of the small batches with those of the large,
# GPU-bound ones, and expect the small batches' times to move between runs. The sweep therefore asks no
# "is batch 8 slower than batch 1?" of these separate blocks of samples (section 8.1 showed why that
# question needs interleaving); it reads, at each batch, two quantities that do not drift with each other:
# the host's enqueue time and the GPU's kernel time. While the first is the longer, the host sets the step's
# pace.

# %%
def ch3_step(batch_size):
    """Chapter 3's 1.3B setup: fp16 weights (fp32 on a CPU), eager attention, plain AdamW."""
    dtype = torch.float16 if prof.on_gpu else torch.float32
    model = models.build("polyglot-ko-1.3b", head="causal-lm", dtype=dtype, attn_implementation="eager").train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    batch = batch_of("polyglot-ko-1.3b", batch_size)
    return timing.time_it(lambda: steps.train_step(model, optimizer, batch), device=dev, warmup=prof.pick(tiny=1, full=2), repeat=prof.pick(tiny=3, full=10), loop=3)


sweep = {}
for bs in prof.pick(tiny=[1, 2, 4], full=[1, 2, 4, 8, 16, 32, 64]):
    attempt = batching.try_batch(ch3_step, bs)
    if not attempt.fits:
        sweep[bs] = {"note": f"out of memory ({attempt.error})"}
        break  # larger batches will not fit either
    t = attempt.value
    sweep[bs] = {**t.summary(), "host µs per GPU op": timing.us_per_launch(t),
                 "tokens/s": bs * SETUPS["polyglot-ko-1.3b"]["seq_len"] / t.loop.median}
sweep_table = pd.DataFrame(sweep).T.rename_axis("batch")
sweep_table.drop(columns="verdict", errors="ignore")  # a row's regime: its GPU-busy column; the crossover is a number, not a word

# %%
ok = sweep_table.dropna(subset=["wall median (ms)"])
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
x = ok.index.to_numpy(float)
lo = ok["wall median (ms)"] - ok["wall min (ms)"]
hi = ok["wall max (ms)"] - ok["wall median (ms)"]
seq_sweep = SETUPS["polyglot-ko-1.3b"]["seq_len"]
ax1.errorbar(x, ok["wall median (ms)"], yerr=[lo, hi], fmt="o-", capsize=3, label="wall time, synchronised (median, min-max)")
ax1.plot(x, ok["back to back, per call (ms)"], "d-", label="back to back, per step (median)")
if prof.on_gpu:
    ax1.plot(x, ok["host enqueue median (ms)"], "s--", label="host enqueue (median)")
    ax1.plot(x, ok["GPU kernel time (ms)"], "^:", label="GPU kernel time")
ax1.set_xscale("log", base=2)
ax1.set_xticks(x, [str(int(v)) for v in x])
ax1.set_xlabel(f"batch size (sequences of {seq_sweep} tokens)")
ax1.set_ylabel("time per step (ms)")
ax1.set_ylim(bottom=0)
ax1.legend()
ax1.set_title("step time against batch size")
if prof.on_gpu:
    ax2.plot(x, ok["GPU busy"].astype(float) * 100, "o-", color="C2")
    ax2.set_ylim(0, 105)
    ax2.set_ylabel("GPU busy (% of the step)")
else:
    ax2.text(0.5, 0.5, "GPU busy needs a GPU", ha="center", va="center", transform=ax2.transAxes)
ax2.set_xscale("log", base=2)
ax2.set_xticks(x, [str(int(v)) for v in x])
ax2.set_xlabel(f"batch size (sequences of {seq_sweep} tokens)")
ax2.set_title("GPU busy against batch size")
fig.suptitle(prof.pick(tiny="the 1.3B model's tiny twin (CPU run)", full="1.3B GPT-NeoX")
             + ", chapter 3's setup (fp16 weights on a GPU, eager attention)")
fig.tight_layout()

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title The sweep read by host enqueue against GPU kernel time (no block comparisons)
def sweep_text(ok):
    """The sweep read by host enqueue against GPU kernel time (no block comparisons); ``ok``: the rows that fit."""
    b0, bl = ok.index[0], ok.index[-1]
    first, last = ok.loc[b0], ok.loc[bl]
    host, kern, wall = (ok[c].astype(float) for c in ("host enqueue median (ms)", "GPU kernel time (ms)",
                                                      "wall median (ms)"))
    text = [f"At batch {b0} the host needs {host[b0]:.0f} ms to issue a step's {int(first['GPU ops per call']):,} GPU "
            f"operations ({first['host µs per GPU op']:.0f} µs each on this machine's CPU), the GPU's kernels run for "
            f"{kern[b0]:.0f} ms, and the GPU is busy {prose.pct(first['GPU busy'])} of the {wall[b0]:.0f} ms step: "
            f"*{first['verdict']}*."]
    gpu_longer = [b for b in ok.index if kern[b] > host[b]]
    if not gpu_longer:
        text.append(f"At no batch up to {bl} does the GPU's kernel time pass the host's enqueue time: on this machine the "
                    f"host sets the step's pace throughout the sweep, from {wall[b0]:.0f} ms at batch {b0} to "
                    f"{wall[bl]:.0f} ms at batch {bl}, {bl // b0} times the tokens.")
    elif gpu_longer[0] == b0:
        text.append(f"Already at batch {b0} the GPU's kernel time is the longer one: on this machine the GPU, not the host, "
                    f"sets the pace at every batch of the sweep.")
    else:
        cross = gpu_longer[0]
        before = ok.index[list(ok.index).index(cross) - 1]
        text.append(f"Up to batch {before} the host's enqueue time is longer than the GPU's kernel time, so the step "
                    f"takes about as long as the host needs ({wall[b0]:.0f} ms at batch {b0}, {wall[before]:.0f} ms at "
                    f"batch {before}, {before // b0} times the tokens). At batch {cross} the GPU's kernels first take "
                    f"longer than the launches ({kern[cross]:.0f} against {host[cross]:.0f} ms), and from there the step "
                    f"time follows the GPU's work: {wall[bl]:.0f} ms at batch {bl}, GPU busy {prose.pct(last['GPU busy'])}, "
                    f"{last['tokens/s'] / first['tokens/s']:.1f} times batch {b0}'s throughput.")
    tail = wall[b0] - host[b0]
    text.append(f"Back to back, a step at batch {b0} takes {first['back to back, per call (ms)']:.0f} ms (IQR "
                f"{first['back to back IQR (ms)']:.0f}) against {wall[b0]:.0f} ms synchronised. Overlapping steps can save "
                f"at most the GPU's tail after the host has issued the step, wall minus host enqueue: {tail:.0f} ms here"
                + (f", no more than the spread of the synchronised samples (IQR {first['wall IQR (ms)']:.0f} ms), so "
                   f"this run cannot show it." if tail <= first["wall IQR (ms)"] else "."))
    if bl != b0 and host[bl] > 1.2 * host[b0]:
        text.append(f"The host's enqueue time grows with the batch too ({host[bl]:.0f} ms at batch {bl}, for "
                    f"{last['GPU ops per call'] / first['GPU ops per call']:.2f} times batch {b0}'s operations). Enqueue "
                    f"time counts every wait inside the call as well as the launches, and a CPU running ahead of a busy GPU "
                    f"can end up waiting (for room in the launch queue, or in an allocator call that synchronises); these "
                    f"numbers alone do not say which.")
    if first["verdict"] == "host-bound":
        text.append("**The first fix for a host-bound step is a larger batch**: until the GPU's kernel time catches up "
                    "with the host's enqueue time, the extra work costs little time. Where that happens depends on this "
                    "machine's CPU as much as on its GPU.")
    return " ".join(text)


if prof.on_gpu and len(ok) >= 3:
    prose.say(sweep_text(ok))
else:
    print("skipped on CPU: the host/GPU split needs a GPU")


# %% [markdown]
# ### Host-bound: CUDA graphs
#
# When the batch cannot grow (memory, or the optimisation needs small batches), the other fix is to make
# the launches cheaper. A **[CUDA graph](https://gpu-efficient-training.github.io/book/book/glossary.html#cuda-graph)** records a whole sequence of kernels once and replays it with a
# single launch: the CPU no longer dispatches each operator. Its price: everything must be static (same
# shapes, same memory addresses; new data is *copied into* the captured input tensors), no operation in
# the step may synchronise with the CPU, and the optimizer must keep its step counter on the GPU
# (`capturable=True`). The recipe from PyTorch's documentation, for a whole training step:
#
# ```python
# optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, capturable=True)
# static_batch = {k: v.clone() for k, v in batch.items()}
# side = torch.cuda.Stream()                     # warm up on a side stream, as the docs require
# side.wait_stream(torch.cuda.current_stream())
# with torch.cuda.stream(side):
#     for _ in range(3):
#         train_step(static_batch)
# torch.cuda.current_stream().wait_stream(side)
# graph = torch.cuda.CUDAGraph()
# optimizer.zero_grad(set_to_none=True)          # the graph allocates the gradients itself
# with torch.cuda.graph(graph):
#     with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
#         loss = model(**static_batch).loss
#     loss.backward()
#     optimizer.step()
# # each training step: copy the new batch into static_batch, then graph.replay()
# ```
#
# Below, bert-large at its smaller batch of section 8.2 (host-bound there, on that machine), in two
# interleaved comparisons, each against the ordinary eager step (default AdamW): the same eager step with a
# capturable AdamW, which the graph needs, and the captured step replayed. Each sample is three steps back to
# back with one synchronisation at the end, as a training loop runs them, so the eager side gets the overlap
# between steps that a loop allows.
#
# One detail decides what the graph replays. The batch has no padding, and eager transformers drops an all-ones
# `attention_mask` so that [SDPA](https://gpu-efficient-training.github.io/book/book/glossary.html#sdpa) can pick its fused attention kernel. While capturing, transformers (5.17, the
# version this chapter was run with) treats the capture like `torch.compile`'s tracing: called with no mask, it builds
# an expanded all-True mask that the fused kernels cannot take, and attention falls back to SDPA's *math* path,
# batched matrix products and a softmax that upcast 16-bit inputs to fp32. Passing the batch's all-ones mask
# explicitly keeps a fused attention kernel, though not necessarily the one the eager step runs. Chapter 9 (section
# 9.4) probes this; here the batch carries its mask, and the category table below shows whether the replay still
# ran attention kernels, and for how long.

# %%
GRAPH_LOOP = 3  # steps back to back in every timed sample, as a training loop runs them


def graph_vs_eager(name, batch_size):
    """The eager step (default AdamW) against the eager step with a capturable AdamW, and against the CUDA graph
    of the capturable step: two interleaved comparisons on one model. Returns the comparisons by name."""
    model, optimizer = build(name)
    batch = batch_of(name, batch_size)
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])  # explicit: see above
    eager_step = steps.make_step(model, optimizer, batch, amp=AMP_STEP)
    cap_optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, capturable=True)
    cap_step = steps.make_step(model, cap_optimizer, batch, amp=AMP_STEP)
    # the capturable optimizer's cost is the smaller effect of the two: more rounds narrow its interval
    out = {"eager, capturable AdamW": timing.interleaved(eager_step, cap_step, device=dev, loop=GRAPH_LOOP, rounds=21,
                                                         names=("eager", "eager, capturable AdamW"))}
    # The eager steps above created the parameters' gradient-accumulation nodes on the default stream; the warm-up
    # and capture below run on a side stream that waits for it, so the mismatch autograd warns about is intended.
    warn = getattr(torch.autograd.graph, "set_warn_on_accumulate_grad_stream_mismatch", None)
    if warn is not None:
        warn(False)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            cap_step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    cap_optimizer.zero_grad(set_to_none=True)
    try:
        with torch.cuda.graph(graph):
            with torch.autocast("cuda", dtype=AMP, cache_enabled=False):
                loss = model(**batch).loss
            loss.backward()  # (in fp16 a real run would also scale the loss; here only the speed matters)
            cap_optimizer.step()
    except RuntimeError as err:  # an operation that cannot be captured
        return {**out, "capture failed": str(err).splitlines()[0]}
    out["CUDA graph"] = timing.interleaved(eager_step, graph.replay, device=dev, loop=GRAPH_LOOP,
                                           names=("eager", "CUDA graph"))
    return out


def graph_vs_eager_quiet(name, batch_size):
    """``graph_vs_eager`` with autograd's stream-mismatch warning off (see the comment there), then back on."""
    try:
        return graph_vs_eager(name, batch_size)
    finally:
        warn = getattr(torch.autograd.graph, "set_warn_on_accumulate_grad_stream_mismatch", None)
        if warn is not None:
            warn(True)


graph_result, graph_cats = None, None
if run_profile.cuda_or_skip("CUDA graphs need a GPU"):
    graph_bs = SETUPS["bert-large-uncased"]["batches"][0]
    attempt = batching.try_batch(lambda bs: graph_vs_eager_quiet("bert-large-uncased", bs), graph_bs)
    graph_result = attempt.value if attempt.fits else None
    if not attempt.fits:
        print(f"batch {graph_bs}: out of memory ({attempt.error})")
    elif "capture failed" in graph_result:
        print("capture failed:", graph_result["capture failed"])
    comps = {k: c for k, c in (graph_result or {}).items() if isinstance(c, timing.Comparison)}
    if comps:
        # (no verdict column: the capturable row is a host-bound side comparison, the sentence below gives its
        # interval; the graph's verdict is in the sentence too)
        graph_table = pd.DataFrame({k: {**c.row(), "candidate host enqueue (ms)": c.b.host.median * 1e3,
                                        "candidate launch calls per step": c.b.profile.launches_per_step}
                                    for k, c in comps.items()}).T.drop(columns="verdict").rename_axis(
                                        f"against the eager step, bert-large, batch {graph_bs}")
        display(graph_table)
        sides = {"eager": comps["eager, capturable AdamW"].a.profile, **{k: c.b.profile for k, c in comps.items()}}
        graph_cats = pd.DataFrame({k: p_.categories(use_phases=False)["GPU time (ms/step)"] for k, p_ in sides.items()})
        # Without phase marks (a replay has none) the optimizer's kernels cannot be told apart by name: they are in
        # the element-wise row, so the optimizer row (always 0 here) is left out.
        graph_cats = graph_cats.drop(index="optimizer")
        display(graph_cats.rename_axis("GPU time per step (ms), by kernel name (optimizer kernels in element-wise)"))
    if "CUDA graph" in comps:
        display(comps["CUDA graph"].b.profile.top_kernels(6, width=70).rename_axis("kernels of the replay"))

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title The CUDA graph and the capturable AdamW, each against the ordinary eager step
def graph_text(cap_c, graph_c, cats, loop):
    """The CUDA graph and the capturable AdamW, each against the ordinary eager step; the attention kernel's
    time is read from ``cats`` (GPU ms per step by category; columns eager, CUDA graph)."""
    e, g = graph_c.a, graph_c.b
    us = timing.us_per_launch(e)
    text = [f"Timed interleaved against the ordinary eager step ({loop} steps back to back per sample), the replayed "
            f"graph runs at {graph_c.phrase(what='than the eager step')}: {prose.ms(g.wall.median)} per step against "
            f"{prose.ms(e.wall.median)}. The graph issues a step with {g.profile.launches_per_step} launch call(s) in "
            f"{g.host.median * 1e3:.2f} ms of host time, where the eager step needs {e.profile.launches_per_step:,} "
            f"launches and {prose.ms(e.host.median)}: {us:.0f} µs per launch on this machine's CPU. The GPU is busy "
            f"{prose.pct(g.gpu_busy)} of the replay's time against {prose.pct(e.gpu_busy)} of the eager step's."]
    kr = graph_c.kernel_ratio
    if graph_c.verdict == "faster":
        text.append("The gain is the launch time the graph removes, so its size is set by the host: a faster CPU "
                    "issues the eager step sooner and gains less from the graph, a slower one gains more.")
    elif g.kernel_s > 1.1 * e.kernel_s:
        text.append(f"Here the graph brought no gain: its GPU work ({prose.ms(g.kernel_s)} of kernel time per replayed "
                    f"step against {prose.ms(e.kernel_s)} eager) outweighs the launch time it saves on this machine.")
    else:
        text.append(f"Here the graph brought no gain: on this machine the eager step was not waiting for its launches "
                    f"(GPU busy {prose.pct(e.gpu_busy)}), so there was little launch time to remove.")
    attn_e, attn_g = cats.loc["attention", "eager"], cats.loc["attention", "CUDA graph"]
    if attn_g < 0.2 * attn_e:
        text.append(f"No kernel of the replay has an attention kernel's name (eager: {attn_e:.1f} ms per step): under "
                    f"capture, attention ran on SDPA's math path, batched matrix products and a softmax in fp32, and the "
                    f"replay's kernels take {1 / kr:.2f} times the eager step's time. Section 9.4 finds the cause.")
    else:
        text.append(f"The replay still runs attention kernels, as the eager step does ({attn_g:.1f} against "
                    f"{attn_e:.1f} ms per step), and its kernels take {1 / kr:.2f} times the eager step's kernel time (the capturable "
                    f"optimizer's extra kernels included): the graph changes how the work is launched, not the work.")
    c = cap_c.b
    # no verdict word here: this side comparison is host-bound (GPU busy about a quarter of the step), where two
    # runs put its interval on either side of the -3% line; the launches and the kernel time are what it shows
    kernel_x = f", and {1 / cap_c.kernel_ratio:.2f} times the kernel time" if cap_c.kernel_ratio else ""
    text.append(f"A capturable AdamW keeps its step counters on the GPU and launches more kernels "
                f"({c.profile.launches_per_step:,} launch calls per step instead of "
                f"{cap_c.a.profile.launches_per_step:,}{kernel_x}); alone, the eager step with it took "
                f"{1 / cap_c.speedup:.2f} times as long as with the default AdamW (95% interval {1 / cap_c.hi:.2f}–"
                f"{1 / cap_c.lo:.2f}, {cap_c.rounds} rounds; the GPU was busy {cap_c.a.gpu_busy:.0%} of the eager step, "
                f"so the reader's CPU sets this number)"
                + (", and the graph's gain comes despite those extra launches. " if graph_c.verdict == "faster" else ". ")
                + "Chapter 9 gets a graph's effect with less ceremony, from `torch.compile(mode=\"reduce-overhead\")`.")
    return " ".join(text)


if graph_result and "CUDA graph" in graph_result:
    prose.say(graph_text(graph_result["eager, capturable AdamW"], graph_result["CUDA graph"], graph_cats, GRAPH_LOOP))
elif graph_result:
    print("the capture failed on this setup; see the message above")


# %% [markdown]
# ### Memory-bandwidth-bound: the optimizer step and element-wise kernels
#
# An element-wise kernel does a few FLOPs per byte it reads and writes, so its speed is set by memory
# bandwidth. The yardstick is a plain device-to-device copy, the fastest any kernel can stream through
# memory. AdamW is such a kernel: for each fp32 parameter it must read the parameter, its gradient and the
# two moments (16 bytes) and write back the parameter and the moments (12 bytes), at least **28 bytes per
# parameter**. PyTorch's default `foreach` implementation does this in several passes (one per arithmetic
# step, each over whole lists of tensors); `fused=True` does it in one pass over the states (a few
# multi-tensor launches, each over a chunk of the tensor list). Timed on bert-large's parameters (random
# gradients), against the copy; the two AdamW implementations are compared interleaved, one step of each
# per round, with their kernel time beside the wall time (this is a change on the GPU's side: kernel time is
# where it acts, and it does not move with the host):

# %%
def bandwidth_gib_s(nbytes, t):
    return nbytes / GIB / t.wall.median


bw_rows = {}
copy_elems = prof.pick(tiny=2**22, full=2**28)  # 1 GiB of fp32 on the GPU
src = torch.randn(copy_elems, device=dev)
dst = torch.empty_like(src)
t = timing.time_it(lambda: dst.copy_(src), device=dev)
bw_rows["device-to-device copy"] = {"bytes moved (GiB)": 2 * src.nbytes / GIB, **t.summary()}
x16 = src.to(AMP if prof.on_gpu else torch.float32)
t = timing.time_it(lambda: torch.nn.functional.gelu(x16), device=dev)
bw_rows["GeLU (16-bit)"] = {"bytes moved (GiB)": 2 * x16.nbytes / GIB, **t.summary()}
cleanup.free(globals(), "src", "dst", "x16")

model = build("bert-large-uncased")[0]
params = list(model.parameters())
for param in params:
    param.grad = torch.randn_like(param) * 1e-3
n_params = sum(param.numel() for param in params)
optimizers = {impl: torch.optim.AdamW(params, lr=1e-5, **{impl: True}) for impl in ("foreach", "fused")}
adam_cmp = timing.interleaved(optimizers["foreach"].step, optimizers["fused"].step, device=dev,
                              names=("foreach", "fused"))
for impl, t in (("foreach", adam_cmp.a), ("fused", adam_cmp.b)):
    bw_rows[f"AdamW step ({impl})"] = {"bytes moved (GiB)": 28 * n_params / GIB, **t.summary()}
cleanup.free(globals(), "model", "params", "param", "optimizers")
# (no verdict column: for calls of a millisecond or less the GPU-busy fraction is set by the synchronisation around
# each call, and two runs put the copy on either side of the 90% line; the bandwidths are this table's lesson)
bw_table = pd.DataFrame(bw_rows).T.drop(columns="verdict", errors="ignore")
bw_table["achieved, by wall time (GiB/s)"] = bw_table["bytes moved (GiB)"] / (bw_table["wall median (ms)"] / 1e3)
if prof.on_gpu:
    bw_table["achieved, by kernel time (GiB/s)"] = bw_table["bytes moved (GiB)"] / (bw_table["GPU kernel time (ms)"] / 1e3)
bw_table

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title The copy and GeLU against the memory's speed, and fused against foreach AdamW
def bandwidth_text(bw, c, sheet_gib_s=None):
    """The copy and GeLU against the memory's speed, and fused against ``foreach`` AdamW (``c``: interleaved)."""
    wall_bw, kern_bw = bw["achieved, by wall time (GiB/s)"], bw["achieved, by kernel time (GiB/s)"]
    copy_bw, copy_kbw = wall_bw["device-to-device copy"], kern_bw["device-to-device copy"]
    fe, fu = bw.loc["AdamW step (foreach)"], bw.loc["AdamW step (fused)"]
    sheet_txt = f", {copy_kbw / sheet_gib_s:.0%} of the datasheet's {sheet_gib_s:,.0f} GiB/s" if sheet_gib_s else ""
    kernel_txt = (f"by kernel time fused needs {1 / c.kernel_ratio:.2f} times `foreach`'s "
                  f"({fu['GPU kernel time (ms)']:.1f} against {fe['GPU kernel time (ms)']:.1f} ms)")
    wall_txt = f"by wall time, interleaved, fused runs at {c.phrase(what='than foreach')}"
    return (
        f"The copy streams {copy_bw:,.0f} GiB/s by wall time and {copy_kbw:,.0f} GiB/s by kernel time{sheet_txt} (bytes "
        f"read plus bytes written). GeLU reaches {kern_bw['GeLU (16-bit)'] / copy_kbw:.0%} of the copy's kernel-time "
        f"rate: an element-wise kernel is as fast as memory lets it be, and its FLOPs do not matter.\n\n"
        f"The fused AdamW step runs {int(fu['GPU ops per call'])} GPU operations, `foreach` {int(fe['GPU ops per call'])}; "
        f"{kernel_txt}, and {wall_txt}. On the GPU, the fused kernels move the 28 bytes per parameter at "
        f"{kern_bw['AdamW step (fused)']:,.0f} GiB/s of kernel time ({kern_bw['AdamW step (fused)'] / copy_kbw:.0%} of "
        f"the copy's), while `foreach`'s kernels reach an *effective* {kern_bw['AdamW step (foreach)']:,.0f} GiB/s, "
        f"because they read and write the states several times. Neither keeps the GPU fully busy "
        f"({prose.pct(fe['GPU busy'])} and {prose.pct(fu['GPU busy'])}): the CPU needs "
        f"{fe['host enqueue median (ms)']:.1f} and {fu['host enqueue median (ms)']:.1f} ms to issue them, so the wall-time "
        f"ratio also depends on the host. **The fix for a memory-bound step is fewer passes over memory**, and fewer "
        f"passes also mean fewer launches.")


if prof.on_gpu:
    try:
        sheet = gpus.peak_bandwidth_gb_s(torch.cuda.get_device_name()) * 1e9 / GIB
    except ValueError:  # a GPU without a datasheet entry
        sheet = None
    prose.say(bandwidth_text(bw_table, adam_cmp, sheet))
else:
    print("skipped on CPU: bandwidth numbers need a GPU")

# %% [markdown]
# ### Compute-bound: how close do the matrix products get?
#
# The matrix products are the only part of a transformer whose arithmetic matters. Two ceilings: the
# datasheet's dense peak, and the rate a large square product reaches on this GPU (section 8.1). From the
# bert-large profile at the larger batch we can also compute what the GEMM kernels achieved *inside* the
# model: the model's matrix-product FLOPs per step (six per weight per token, chapter 5's rule, without the
# attention term, which runs in the attention kernels) over the GPU time of the GEMM category.

# %%
ceiling_rows = {}
if prof.on_gpu:
    ceiling_rows[f"{n} x {n} product, by wall time"] = matmul_flop / mm.wall.median / 1e12
    ceiling_rows[f"{n} x {n} product, by kernel time"] = matmul_flop / mm.kernel_s / 1e12
    if peak:
        ceiling_rows["datasheet dense peak"] = peak
    if big_bert in profiles_by_config:
        meta = models.build("bert-large-uncased", head="sequence-classification", device="meta")
        tokens = big_bert[1] * SETUPS["bert-large-uncased"]["seq_len"]
        gemm_flop = 6 * flops.matmul_params(meta) * tokens
        gemm_s = profiles_by_config[big_bert].categories().loc["GEMM", "GPU time (ms/step)"] / 1e3
        ceiling_rows[f"GEMM kernels inside bert-large, batch {big_bert[1]}, by kernel time"] = gemm_flop / gemm_s / 1e12
        del meta
    ceiling = pd.Series(ceiling_rows, name="TFLOP/s").to_frame()
    display(ceiling)
else:
    print("skipped on CPU: tensor-core rates need a GPU")

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (Compute-bound)
if prof.on_gpu and len(ceiling_rows) >= 2:
    inside = ceiling_rows.get(f"GEMM kernels inside bert-large, batch {big_bert[1]}, by kernel time")
    measured = ceiling_rows[f"{n} x {n} product, by wall time"]
    measured_k = ceiling_rows[f"{n} x {n} product, by kernel time"]
    text = (f"The {n} x {n} product reaches {measured:,.0f} TFLOP/s by wall time, {measured_k:,.0f} by kernel time"
            + (f" ({measured_k / peak:.0%} of the datasheet's {peak:,.0f})" if peak else "") + ". ")
    if inside:
        tokens_b = big_bert[1] * SETUPS["bert-large-uncased"]["seq_len"]
        text += (f"Inside bert-large at batch {big_bert[1]} the GEMM kernels achieve {inside:,.0f} TFLOP/s of kernel "
                 f"time, {inside / measured_k:.0%} of the large product's kernel-time rate: with {tokens_b:,} tokens per step, its products "
                 f"({tokens_b:,} x 1024 x 4096 and the like) are large enough for the tensor cores. The time of such a "
                 f"step is then set by everything *around* the GEMMs: the element-wise kernels and the casts "
                 f"(section 8.2's table) and the optimizer. When a step is GPU-bound and its time is in GEMMs, the "
                 f"remaining levers are less arithmetic (no recomputation, chapter 4), lower precision (chapter 5) and "
                 f"shapes the tensor cores like (chapter 5).")
    prose.say(text)

# %% [markdown]
# ## 8.4 Memory over time
#
# Chapter 1 measured memory phase by phase with `reset_peak_memory_stats`. PyTorch can also record *every*
# allocation and free, with the Python stack that made it: `torch.cuda.memory._record_memory_history()`
# and `torch.cuda.memory._snapshot()`, the data behind PyTorch's interactive viewer at
# [pytorch.org/memory_viz](https://pytorch.org/memory_viz). `memsnap.record()` wraps both, and
# `memsnap.plot` draws the timeline as stacked areas, coloured by where each allocation was made: in a
# module's `forward`, in the autograd engine (`backward`), in `torch.optim` (`optimizer`), or before
# recording began (the weights and [optimizer states](https://gpu-efficient-training.github.io/book/book/glossary.html#optimizer-states)).

# %%
snap = None
if run_profile.cuda_or_skip("the allocator's history is CUDA-only"):
    snap_bs = SETUPS["bert-large-uncased"]["batches"][0]
    model, optimizer = build("bert-large-uncased")
    step = steps.make_step(model, optimizer, batch_of("bert-large-uncased", snap_bs), amp=AMP_STEP)
    step()  # AdamW creates its states in the first step: record a later one
    torch.cuda.reset_peak_memory_stats()
    with memsnap.record() as snap:
        step()
    allocator_peak = torch.cuda.max_memory_allocated()
    fig = memsnap.plot(snap, title=f"one bert-large training step (batch {snap_bs}): allocated memory, event by event")
    states_gib = (accounting.param_bytes(model) + accounting.optimizer_state_bytes(optimizer)) / GIB
    memsnap.save_html(snap, TRACES / "bert_step_memory.html")
    snap_check = pd.Series({
        "peak in the recorded history (GiB)": memsnap.peak_bytes(snap) / GIB,
        "allocator's peak, max_memory_allocated (GiB)": allocator_peak / GIB,
        "before the step (GiB)": snap.baseline_bytes / GIB,
    })
    assert abs(memsnap.peak_bytes(snap) - allocator_peak) <= MIB, "the history and the allocator disagree"
    display(snap_check.to_frame("value"))

# %% [markdown]
# Read it left to right. The forward pass (blue) rises as each layer saves its [activations](https://gpu-efficient-training.github.io/book/book/glossary.html#activations); the backward
# pass frees them layer by layer (blue shrinks) while the gradients it produces grow (orange); then the
# optimizer allocates its temporaries (green) on top of the gradients, and `zero_grad(set_to_none=True)`
# gives the gradients back. The interactive page (`traces/bert_step_memory.html`, with the raw snapshot
# beside it) shows the same history with every block's stack trace.

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (8.4 Memory over time)
if snap is not None:
    at_peak = memsnap.peak_event(snap)
    origin_at_peak = at_peak["event"].split(" ", 1)[1]
    others = {c: at_peak[c] / GIB for c in ("forward", "backward", "optimizer") if at_peak[c] > 0}
    timeline_df = memsnap.timeline(snap)
    opt_max = timeline_df["optimizer"].max() / GIB
    prose.say(
        f"Here the peak, {at_peak['total'] / GIB:.2f} GiB, is reached by an allocation of the **{origin_at_peak}** "
        f"phase; at that moment the step holds "
        + ", ".join(f"{v:.2f} GiB from the {k}" for k, v in others.items())
        + f" on top of the {at_peak['before recording'] / GIB:.2f} GiB allocated before the step ({states_gib:.2f} GiB of "
        f"weights and optimizer states, the rest cuBLAS workspaces). The "
        f"optimizer's temporaries reach {opt_max:.2f} GiB at their highest. Which of the two spikes is higher depends "
        f"on the batch and the model: activations grow with the batch, the optimizer's temporaries do not (chapter 1 "
        f"found the peak in the backward pass for bert-large and at the optimizer step for the 1.3B model)."
    )

# %% [markdown]
# **Finding a leak.** A common bug: a forward hook that stores each layer's output "for analysis" and is
# never removed. Every step then keeps 24 more tensors alive. The allocated memory after each step grows,
# and `memsnap.survivors` lists the allocations made during the recording that are still alive at its end,
# grouped by the code that made them: the innermost frame (*allocated in*) and the innermost frame of our
# own code (*called from*).

# %%
if snap is not None:
    kept = []
    hooks = [layer.register_forward_hook(lambda mod, args, out: kept.append(out[0] if isinstance(out, tuple) else out))
             for layer in model.bert.encoder.layer]
    after_step_mib = {}
    with memsnap.record() as leak_rec:
        for i in range(3):
            step()
            after_step_mib[f"after step {i + 1}"] = torch.cuda.memory_allocated() / MIB
    display(pd.Series(after_step_mib, name="allocated (MiB)").to_frame())
    display(memsnap.survivors(leak_rec, top=3))

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (8.4 Memory over time)
if snap is not None:
    growth = np.diff(list(after_step_mib.values()))
    leaks = memsnap.survivors(leak_rec, top=3)
    (top_in, top_from), top_row = leaks.index[0], leaks.iloc[0]
    prose.say(
        f"Allocated memory grows by {growth.mean():.0f} MiB per step. The largest survivors, {top_row['allocations']:.0f} "
        f"allocations and {top_row['MiB']:.0f} MiB, were made in `{top_in}` called from `{top_from}`: "
        f"{top_row['allocations'] / 3:.0f} tensors per step, one per layer. Something keeps every layer's output "
        f"alive: the hook. Removing the hooks and the list gives the memory back:"
    )

# %%
if snap is not None:
    for h in hooks:
        h.remove()
    kept.clear()
    cleanup.collect()
    print(f"allocated after removing the hooks: {torch.cuda.memory_allocated() / MIB:,.0f} MiB "
          f"(before the leak: {snap.baseline_bytes / MIB:,.0f} MiB)")

# %% [markdown]
# **Reading an out-of-memory message.** When an allocation fails, PyTorch's message says more than "out of
# memory". Here we cap the allocator at 1 GiB above what is allocated now (`measure.gpu_budget`, as in
# chapter 1's T4 emulation) and ask for 2 GiB:

# %%
oom_message = None
if snap is not None:
    budget_gib = torch.cuda.memory_allocated() / GIB + 1.0
    with measure.gpu_budget(budget_gib):
        try:
            torch.empty(2 * GIB, dtype=torch.uint8, device="cuda")
        except torch.OutOfMemoryError as err:
            oom_message = str(err)
    print(textwrap.fill(oom_message, 110))
    oom_numbers = {"cap (GiB)": budget_gib, "allocated before the request (GiB)": torch.cuda.memory_allocated() / GIB,
                   "reserved before the request (GiB)": torch.cuda.memory_reserved() / GIB, "request (GiB)": 2.0}

# %% [markdown]
# Its parts, in order:
#
# - **Tried to allocate**: the one request that failed, not the total the program needs;
# - **total capacity ... of which ... is free**: the card as the driver sees it (here the card is much
#   larger than the cap we set, so the failure is PyTorch's own limit, standing in for what a smaller card's
#   memory would refuse);
# - **this process has ... memory in use**: everything this process holds, the [CUDA context](https://gpu-efficient-training.github.io/book/book/glossary.html#cuda-context) included;
#   **... allowed**: the cap, when one was set with `set_per_process_memory_fraction`. It limits what the
#   allocator *reserves* from the driver, so cached blocks that no tensor uses count against it too;
# - **allocated by PyTorch**: live tensors (of which some may sit in *private pools*, the memory CUDA
#   graphs keep for themselves); **reserved by PyTorch but unallocated**: cached blocks that no tensor
#   uses. When that last number is large, memory exists but in pieces too small for the request
#   (fragmentation), which is what the `expandable_segments` hint is about (section 8.5).
#
# The first number tells you what to shrink; the last two tell you whether shrinking is needed at all. On
# the way to this message the allocator has already handed its unused cached segments back to the driver
# and retried, so the "reserved but unallocated" memory it reports is what it could not give back: free
# pieces inside segments that still hold live tensors.

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (8.4 Memory over time)
if oom_message:
    o = oom_numbers
    prose.say(
        f"Here: the cap was {o['cap (GiB)']:.2f} GiB, {o['allocated before the request (GiB)']:.2f} GiB were allocated, "
        f"so at most {o['cap (GiB)'] - o['allocated before the request (GiB)']:.2f} GiB were left for a request of "
        f"{o['request (GiB)']:.0f} GiB. The difference between the process's memory in use and PyTorch's reserved "
        f"memory in the message is the CUDA context and the libraries' own memory, which PyTorch's allocator never sees."
    )

# %%
if snap is not None:
    cleanup.free(globals(), "model", "optimizer", "step", "kept", "hooks")

# %% [markdown]
# ## 8.5 The caching allocator
#
# `cudaMalloc` and `cudaFree` are slow (and `cudaFree` synchronises the device), so PyTorch keeps freed blocks in a
# cache and reuses them (chapter 1's *reserved* memory). With fixed shapes this works perfectly: every step
# asks for the same sizes. With **variable-length batches** (chapter 3's padded and unpadded batches), each
# step asks for different sizes; a cached block may be split to serve a smaller request, and the pieces
# may not fit the next larger one, so the allocator must `cudaMalloc` more. Reserved memory then grows
# above what is really used. When the card is full, the allocator first hands its unused cached segments
# back and retries (`num_alloc_retries` counts this, and each retry costs synchronising `cudaFree` and
# `cudaMalloc` calls); what it cannot hand back are free pieces inside segments that still hold live
# tensors (*inactive split* blocks), and that fragmentation can make an allocation fail while memory is free.
#
# `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` changes the allocator's strategy: instead of many
# separately allocated segments, it reserves a large virtual address range per stream and maps physical
# memory into it as needed, in pages of 20 MiB for large blocks (2 MiB for small ones), so a segment grows by
# pages instead of leaving slivers at the ends of many segments. Freed pages stay mapped (and count as reserved)
# until the allocator runs out of memory or `empty_cache` is called; then the empty ones are unmapped and can be
# mapped again where they are needed. It must be set before CUDA starts, so we run the same workload twice
# in fresh processes (`scripts/alloc_churn.py`, next to this notebook in the book's repository): bert-large,
# batch 8, a random length between 32 and 512 tokens each step, 40 steps.

# %%
churn = {}
CHURN_SCRIPT = Path("scripts/alloc_churn.py")
if not CHURN_SCRIPT.exists() and prof.on_gpu:  # e.g. Colab, where only the helpers package is installed
    print(f"skipped: {CHURN_SCRIPT} is not here (run the notebook from the book's notebooks/ folder to see this part)")
elif run_profile.cuda_or_skip("the caching allocator is CUDA's"):
    for label, conf in (("default", ""), ("expandable_segments", "expandable_segments:True")):
        out = TRACES / f"churn_{label}.json"
        env_vars = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
        if conf:
            env_vars["PYTORCH_CUDA_ALLOC_CONF"] = conf
        proc = subprocess.run([sys.executable, str(CHURN_SCRIPT), "--out", str(out)], env=env_vars,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"alloc_churn.py failed:\n{proc.stderr[-3000:]}")
        churn[label] = json.loads(out.read_text())
    counters = pd.DataFrame({k: v["counters"] for k, v in churn.items()})
    display(counters)

# %%
if churn:
    d = {k: pd.DataFrame(v["steps"]) for k, v in churn.items()}
    slack = {k: (df["reserved_mib"].max() - df["peak_allocated_mib"].max()) / 1024 for k, df in d.items()}
    fig, ax = plt.subplots(figsize=(9, 4))
    for i, (label, result) in enumerate(churn.items()):
        steps_df = pd.DataFrame(result["steps"])
        ax.plot(steps_df["step"], steps_df["reserved_mib"] / 1024, "-", color=f"C{i}", label=f"reserved, {label}")
        ax.plot(steps_df["step"], steps_df["peak_allocated_mib"] / 1024, ":", color=f"C{i}",
                label=f"peak allocated, {label}")
    ax.set_xlabel("training step (random sequence length each step)")
    ax.set_ylabel("memory (GiB)")
    ax.set_ylim(bottom=0)
    ax.legend(loc="lower right", ncol=2)
    ax.set_title(f"random lengths: reserved ends {slack['default']:.2f} GiB above the largest peak by default, "
                 f"{slack['expandable_segments']:.2f} GiB with expandable_segments")
    fig.tight_layout()

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title The two allocators on the same random-length steps
def churn_text(d, counters, slack):
    """The two allocators on the same random-length steps (``d``: per-step frames, ``counters``: the table)."""
    retries = counters.loc["retries after flushing the cache (num_alloc_retries)"]
    split_mib = counters.loc["inactive split blocks at the end (MiB)", "default"]
    if retries.max() == 0:
        retry_txt = (f"No step ran out of memory, so the allocator never had to retry (both retry counters are 0); on a "
                     f"full card the default allocator's slack would have been given back at the price of retries, and "
                     f"its {split_mib:.0f} MiB of inactive split blocks could not.")
    else:
        retry_txt = (f"This card filled up: the allocator flushed its cache and retried {retries['default']:.0f} times "
                     f"by default and {retries['expandable_segments']:.0f} times with expandable segments, each time "
                     f"paying synchronising `cudaFree` and `cudaMalloc` calls; the default allocator still ended with "
                     f"{split_mib:.0f} MiB of inactive split blocks that no flush can give back.")
    return (
        f"The steps needed at most {d['default']['peak_allocated_mib'].max() / 1024:.2f} GiB by default and "
        f"{d['expandable_segments']['peak_allocated_mib'].max() / 1024:.2f} GiB with expandable segments. The tensors "
        f"are the same; the small difference is rounding, since *allocated* counts the blocks the allocator hands out, "
        f"and a block cut from a cached segment can be larger than the request. With the default allocator, reserved "
        f"memory ended {slack['default']:.2f} GiB above the largest peak, after "
        f"{counters.loc['device allocations (num_device_alloc)', 'default']:.0f} device allocations; with "
        f"`expandable_segments` the slack was {slack['expandable_segments']:.2f} GiB, what is left of the 20 MiB pages "
        f"that the large blocks are mapped in. {retry_txt} (With expandable segments the counters mean slightly "
        f"different things: memory is mapped in pages into a growing range, not allocated as segments.)")


if churn:
    prose.say(churn_text(d, counters, slack))

# %% [markdown]
# **`empty_cache`** hands the cached blocks back to the driver. It does not free a single tensor, and the
# next step has to `cudaMalloc` everything again. Its cost, on bert-large at the larger batch, timed
# interleaved against the plain step; since the price is paid by the step *after* the call, every sample of
# the plain step starts from a warm cache and every sample of the other side from an empty one, as in their
# own training loops:

# %%
def time_empty_cache(batch_size):
    """The bert-large step against the step followed by ``torch.cuda.empty_cache()``, interleaved.

    Emptying the cache costs the *next* step, which must ``cudaMalloc`` its blocks again. So each sample of the
    plain step starts from a warm cache (one untimed step before it), and each sample of the other side from an
    empty one (``empty_cache`` before it): every sample is what that side's training loop would see."""
    model, optimizer = build("bert-large-uncased")
    step = steps.make_step(model, optimizer, batch_of("bert-large-uncased", batch_size), amp=AMP_STEP)

    def step_and_empty():
        step()
        torch.cuda.empty_cache()

    return timing.interleaved(step, step_and_empty, device=dev, names=("step", "step + empty_cache"), busy=False,
                              setup_a=step, setup_b=torch.cuda.empty_cache)


ec = None
if run_profile.cuda_or_skip("empty_cache only matters on a GPU"):
    for bs_ec in reversed(SETUPS["bert-large-uncased"]["batches"]):  # the larger batch, else the smaller one
        attempt = batching.try_batch(time_empty_cache, bs_ec)
        if attempt.fits:
            ec = attempt.value
            break
        print(f"batch {bs_ec}: out of memory ({attempt.error})")
    if ec:
        display(pd.Series(ec.row(), name=f"bert-large, batch {bs_ec}").to_frame())

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (8.5 The caching allocator)
if ec:
    extra_ms = (ec.b.wall.median - ec.a.wall.median) * 1e3
    prose.say(
        f"Emptying the cache after every step takes the step from {prose.ms(ec.a.wall.median)} to "
        f"{prose.ms(ec.b.wall.median)} ({extra_ms:+.0f} ms; interleaved, it runs at "
        f"{ec.phrase(what='than the plain step')}): every block of the next step is `cudaMalloc`ed again, and `empty_cache`'s own `cudaFree` "
        f"calls synchronise the device. Use it when another process must get the memory, not as a habit inside a "
        f"training loop."
    )

# %% [markdown]
# ## 8.6 Tools beyond PyTorch
#
# - **NVTX and Nsight Systems.** `torch.profiler` sees what PyTorch launches. NVIDIA's Nsight Systems
#   (`nsys`) sees the whole process, including other libraries, CPU threads, the operating system and
#   several GPUs, with low overhead. Mark the phases with NVTX ranges (they cost little when no tool
#   listens), then profile from the command line:
#
#   ```python
#   with torch.cuda.nvtx.range("forward"):
#       loss = model(**batch).loss
#   ```
#
#   ```bash
#   nsys profile --trace=cuda,nvtx,osrt --capture-range=cudaProfilerApi -o step python train.py
#   # with torch.cuda.profiler.start() / stop() around the steps to capture
#   ```
#
#   It answers the same questions as this chapter (GPU idle gaps, launch overhead, which kernels), across
#   processes, and for long runs.
# - **`nvidia-smi dmon -s u`** prints the GPU's utilisation once a second. "Utilisation" there is the share
#   of time in which *any* kernel was running: the GPU-busy fraction, coarsely sampled. It cannot tell a
#   GPU-bound step from a slow kernel that keeps one SM busy; 100% utilisation is not 100% of the GPU's
#   FLOP/s. Use it to spot an idle GPU (a data-loading stall, a host-bound loop), not to rate efficiency.
# - **Nsight Compute (`ncu`)** profiles single kernels (achieved bandwidth, occupancy, tensor-core use):
#   the next step when one kernel dominates the category table.
#
# Which of them this machine has:

# %%
pd.Series({tool: "found" if shutil.which(tool) else "not on PATH" for tool in ("nsys", "ncu", "nvidia-smi")},
          name="on this machine").to_frame()

# %% [markdown]
# ## Summary
#
# - Time GPU code with `synchronize` or CUDA events, after a warm-up, at least ten times, and quote the
#   spread. A clock without `synchronize` measures the CPU's queueing; a first call measures start-up.
# - Compare two versions interleaved (A, B, B, A, ... for at least ten rounds): the median per-round ratio
#   with its 95% interval, and "faster" or "slower" only when the whole interval lies beyond ±3%. Two
#   separate blocks of samples absorb the host's drift between them and can call identical work faster.
# - The GPU-busy fraction and the host-enqueue time tell *why* a step takes its time. A step whose GPU
#   waits for Python and the dispatcher is **host-bound**; where chapter 3's step time was flat in the batch
#   size, this is why. Which steps are host-bound depends on the CPU as much as on the GPU: the µs per
#   launch of this run are in sections 8.2 and 8.3, and the verdicts below.
# - Fixes by regime: host-bound → larger batch, CUDA graphs (or `torch.compile`, chapter 9);
#   memory-bound → fused kernels (fused AdamW); compute-bound → less arithmetic, lower precision, better
#   shapes.
# - `memsnap` shows memory over time by origin; a leak is an allocation that survives a step.
# - Variable shapes fragment the caching allocator; `expandable_segments` reduces the slack.

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (Summary)
if prof.on_gpu and len(step_table.dropna(subset=["GPU busy"])):
    lines = [f"- {m}, batch {b}: GPU busy {row['GPU busy']:.0%}, {row['host µs per GPU op']:.0f} µs of host time per GPU "
             f"operation, *{timing.verdict(row['GPU busy'], row['host enqueue (ms)'] / row['wall median (ms)'])}*"
             for (m, b), row in step_table.dropna(subset=["GPU busy"]).iterrows()]
    prose.say(f"Verdicts of this run (section 8.2, {str(AMP).removeprefix('torch.')} autocast):\n\n" + "\n".join(lines))
else:
    print("skipped on CPU: the verdicts need a GPU")

# %% [markdown]
# ### A "slow step" checklist
#
# 1. Time it properly (`time_it`): median and IQR of ≥ 10 steps after warm-up.
# 2. Is the GPU busy? If the GPU-busy fraction is low and host enqueue ≈ wall: **host-bound**. Grow the
#    batch, cut launches (fused optimizer, CUDA graphs, `torch.compile`), move work off the Python path.
#    If the GPU is idle but the host is not issuing work either: look for synchronisations (`.item()`,
#    printing, `nonzero`) and data-loading waits.
# 3. If the GPU is busy, read the category table. GEMM-dominated: compare with the matmul ceiling,
#    then precision and shapes. Element-wise or optimizer-dominated: fuse.
# 4. Check the result: time the change against the old version interleaved (`timing.interleaved`), and
#    call it faster only when the whole 95% interval of the speed-up lies above 1.03.
#
# ### Use it in your own script
#
# ```python
# import torch
# from torch.profiler import ProfilerActivity, profile, record_function, schedule
#
# with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
#              schedule=schedule(wait=1, warmup=1, active=3),
#              on_trace_ready=lambda p: p.export_chrome_trace("trace.json")) as prof:
#     for step, batch in zip(range(5), loader):
#         with record_function("forward"):
#             loss = model(**batch).loss
#         with record_function("backward"):
#             loss.backward()
#         with record_function("optimizer"):
#             optimizer.step(); optimizer.zero_grad(set_to_none=True)
#         prof.step()  # no synchronize here: it would hide the CPU/GPU overlap the trace should show
# print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=15))
# ```
#
# ## Exercises
#
# 1. Run the host-bound sweep (section 8.3) for bert-large instead of the 1.3B model. At which batch size
#    does the GPU-busy fraction pass 90%?
#    <details><summary>Hint</summary>In <code>ch3_step</code>, build
#    <code>models.build("bert-large-uncased", head="sequence-classification", dtype=torch.float16)</code> and take
#    its batch from <code>batch_of("bert-large-uncased", batch_size)</code> (512 tokens); keep the rest.
#    </details>
#    <details><summary>Answer</summary>Expect the crossover between the two bert-large batch sizes of section
#    8.2 (one host-bound, the other GPU-bound there, with 16-bit autocast). A sequence of bert-large carries twice
#    the tokens of the sweep's, but its model is a quarter of the size, so its GPU work per sequence is lower
#    and the crossover comes at a similar or larger batch. On a slower GPU such as a T4 the same work takes
#    the GPU longer while the CPU's share stays the same, so the crossover comes at a smaller batch.</details>
# 2. Turn the optimizer of section 8.2 to `fused=True` and profile again. Which category shrinks, and does
#    the step get faster?
#    <details><summary>Hint</summary>Compare the optimizer row of the category table and the kernels per
#    step.</details>
#    <details><summary>Answer</summary>The optimizer's kernel time falls to about a third and its GPU
#    operations from over a hundred (bert-large) or several hundred (the 1.3B model) to a few dozen (section
#    8.3 measured both on bert-large's parameters), but while the step is host-bound the wall time falls only
#    by the host time saved on launches: look at host enqueue, not only at GPU time.</details>
# 3. Plant a different leak: append `loss` (not `loss.item()`) to a list every step. How much memory does it
#    keep per step, and why so little?
#    <details><summary>Hint</summary>After `backward()` the graph's saved tensors are freed; what is left of
#    a scalar loss? Check your number of bytes per step: `from helpers import exercises;
#    exercises.check("8.3", your_bytes)`.</details>
#    <details><summary>Answer</summary>One scalar tensor per step (512 bytes, the allocator's smallest
#    block) plus its graph nodes on the CPU: such a leak shows up only after many thousands of steps, which is
#    why it survives in real code.</details>
#
# ## References
#
# - PyTorch documentation: *PyTorch Profiler*, *Understanding CUDA Memory Usage* (the memory snapshot),
#   *CUDA semantics* (asynchronous execution, CUDA graphs, the caching allocator and
#   `PYTORCH_CUDA_ALLOC_CONF`).
# - Hugging Face, *Efficient training on a single GPU* (the source of the book's fused-optimizer and
#   batch-size advice) and the *model training anatomy* guide, whose step timings this chapter explains.
# - Horace He, *Making Deep Learning Go Brrrr From First Principles* (2022): the three regimes
#   (overhead, bandwidth, compute).
# - NVIDIA, *Nsight Systems User Guide* and *nvidia-smi* documentation.
#
# All the works the book cites are on the [references page](https://gpu-efficient-training.github.io/book/book/references.html).

# %% [markdown]
# Every experiment freed what it made. One library keeps memory on purpose: cuBLAS holds a *workspace* for
# each (handle, stream) pair on which it ran a matrix product until it is told to let go. Each CPU thread
# that runs matrix products has its own handle (the main thread and the autograd engine's thread), and
# section 8.3 added a side stream and a graph-capture stream to the default one. We release the workspaces explicitly, show what they
# held, and check that the chapter ends where it began:

# %%
if prof.on_gpu:  # releases the workspaces, then asserts that allocated memory is back at the start
    rows = cleanup.back_at_baseline(baseline_mib)
    in_pools_mib = sum(
        b["size"] for seg in torch.cuda.memory._snapshot()["segments"]
        if tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0)
        for b in seg["blocks"] if b["state"] == "active_allocated") / MIB
    end_rows = {}
    for k, v in rows.items():  # the pools row goes right below the row it is a part of
        end_rows[k] = v
        if k == "allocated at the end (MiB)":
            end_rows["of which in CUDA-graph private pools at the end (MiB)"] = in_pools_mib
    display(pd.Series(end_rows).to_frame("value"))
else:
    print("skipped on CPU: no GPU memory to check")
