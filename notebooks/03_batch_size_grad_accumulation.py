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
# # 3. Batch size and gradient accumulation
#
# Chapter 1 ended with a 1.3-billion-parameter model that trains at batch 8 on a 15 GB card and runs out
# of memory at batch 16. The batch size is the first knob anyone turns, in both directions: up for
# throughput, down to fit. This chapter measures what the batch size buys and costs, finds the largest
# batch that fits without crashing the notebook, and then shows how to train with a batch that does *not*
# fit: [gradient accumulation](https://gpu-efficient-training.github.io/book/book/glossary.html#gradient-accumulation), which adds up the gradients of several small batches before one optimizer
# step. We prove that it computes the same update as the large batch, measure what it costs, and end
# with the case where the usual way of writing it is wrong.
#
# **What you will learn**
#
# - how training memory splits into a fixed part (weights, [optimizer states](https://gpu-efficient-training.github.io/book/book/glossary.html#optimizer-states)) and a part per sample
#   ([activations](https://gpu-efficient-training.github.io/book/book/glossary.html#activations)), measured and fitted on two models, and how far throughput grows with the batch;
# - how to search for the largest batch that fits: try, catch `torch.OutOfMemoryError`, free, back off,
#   and check that nothing leaked;
# - how to write gradient accumulation, and how to check that it is right: gradients and a whole training
#   run compared against the large batch, as assertions;
# - what accumulation costs in time and memory (the Hugging Face guide's rows, on our GPU), and how the
#   `Trainer`'s `gradient_accumulation_steps` compares with the hand-written loop;
# - why averaging per-micro-batch losses is wrong for sequences of different lengths, and the fix.
#
# **Prerequisites:** chapter 1 (the four memory numbers, activations, the [emulated T4](https://gpu-efficient-training.github.io/book/book/glossary.html#emulated-t4)). The
# [setup page](https://gpu-efficient-training.github.io/book/book/setup.html) explains the run profiles. Sentences that quote numbers are written by the
# notebook from its own run (the first output names the GPU).

# %%
import sys

if "google.colab" in sys.modules:  # Colab only. pip adds what Colab lacks (bitsandbytes, the book's helpers)
    # and upgrades transformers to the 5.x the book needs: nothing has imported it yet in this kernel, so no
    # restart is needed. Colab's torch already meets the book's floor and is kept (see the setup page).
    # %pip install -q --no-warn-conflicts "gpu-efficient-training @ git+https://github.com/gpu-efficient-training/book"

from helpers import env

env.quiet()  # warnings without file paths, no progress bars: outputs that read the same everywhere

import contextlib
import functools
import io
import time
from contextlib import nullcontext

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from transformers import Trainer, TrainingArguments

from helpers import (
    accounting,
    batching,
    cleanup,
    data,
    flops,
    measure,
    models,
    plots,
    profiler,
    run_profile,
    steps,
)
from helpers.measure import GIB, MIB

prof = env.start()  # plot style, number format, run profile; the table below names hardware and versions

# %% [markdown]
# Some experiments emulate Colab's T4 on a larger card, as in chapter 1: `measure.t4_budget` caps PyTorch's
# allocator at the T4's 14.75 GiB minus what this process's [CUDA context](https://gpu-efficient-training.github.io/book/book/glossary.html#cuda-context) takes, which the allocator never
# sees. We measure the context now, before anything else is on the card, after one matrix product in each
# dtype so that cuBLAS is loaded. The allocated memory at this point is the chapter's baseline: the last cell
# checks that the chapter gives everything back. Speed is measured with chapter 8's `timing.time_it` (warm-up,
# at least ten repeats with their spread, wall, host and GPU clocks, and the fraction of the time the GPU was
# busy), which this chapter uses before chapter 8 explains it in full. Where the text calls one configuration
# faster or slower than another, the two ran with `timing.interleaved`, in alternating rounds (A, B, B, A, ...) so
# that a drifting host moves both alike: the speed-up is the median of the per-round ratios, and it counts only when
# its whole 95% interval lies beyond ±3%. Later chapters compare the same way.

# %%
from IPython.display import Markdown, display

from helpers import prose, timing

t4_budget_gib, chapter_baseline_mib = None, 0.0
if run_profile.cuda_or_skip("emulating a T4 needs a GPU"):
    budget, chapter_baseline_mib = measure.t4_start()  # the context with cuBLAS loaded; the chapter's baseline
    t4_budget_gib = budget.budget_gib
    print(f"emulated T4: {budget.describe()}")
    print(f"allocated at the start (the chapter's baseline): {chapter_baseline_mib:,.1f} MiB")

# %% [markdown]
# ## 3.1 What a larger batch costs and buys
#
# Two models, each with the setup of the source it comes from: `bert-large-uncased` for classification in
# fp32 at 512 tokens, as in the Hugging Face guide, and the GPT-NeoX shape of `polyglot-ko-1.3b` as a causal
# language model with fp16 weights and [eager attention](https://gpu-efficient-training.github.io/book/book/glossary.html#eager-attention) at 256 tokens, as in the LLM book (chapter 1 showed
# that pure fp16 AdamW breaks training; for memory and time it is the LLM book's setup, so we keep it). The data
# are random token ids: memory and time do not depend on them.
#
# Two small functions carry the whole chapter, both from the book's `helpers.steps`: `steps.batch_for` builds a
# batch of random sequences on the device (`make_batch` below only picks the task and length of each model),
# and `steps.train_step` is one plain training step:
#
# ```python
# def train_step(model, optimizer, batch):
#     try:
#         model(**batch).loss.backward()
#         optimizer.step()
#     finally:
#         optimizer.zero_grad(set_to_none=True)
# ```
#
# Its `finally` clause matters later: a step that fails half-way must not leave gradients behind.

# %%
SETUPS = steps.two_models(prof)  # bert-large at 512 tokens in fp32, the 1.3B GPT-NeoX at 256 in fp16
build = functools.partial(steps.build, SETUPS)  # build(name, seed=0): the model and a plain AdamW
make_batch = functools.partial(steps.batch_of, SETUPS, device=prof.device)  # make_batch(name, batch_size, seed=0)


# %% [markdown]
# For each batch size we time the training step with `timing.time_it` (its warm-up step also creates AdamW's
# states) and then run one more step phase by phase. After the forward pass,
# allocated memory is the fixed part (weights and optimizer states; the gradients were dropped by the last
# `zero_grad`) plus the activations of this batch. `SavedTensorMeter` counts those activations independently
# of the device, and the peak over the three phases is what the card must hold. Each batch size runs through
# `batching.try_batch`, which turns an out-of-memory error into a row of the table instead of a crash.
#
# The sweep doubles the batch until throughput stops growing (two doublings in a row that each add less than
# 5%), memory runs out (shown as a marker), the batch reaches the sweep's largest, or the next point would
# overrun the section's time budget. The one comparison the text draws, batch 1 against batch 4, is timed again
# with `timing.interleaved`.

# %%
def measure_batch(name, model, optimizer, batch_size):
    """Step time, throughput and memory of one batch size (memory columns are NaN on a CPU)."""
    batch = make_batch(name, batch_size)
    seq_len = SETUPS[name]["seq_len"]
    timed = timing.time_it(lambda: steps.train_step(model, optimizer, batch), device=prof.device, warmup=1, repeat=10,
                           profile_steps=1)
    rec = measure.PhaseRecorder(prof.device)
    try:
        with rec.phase("forward"), accounting.SavedTensorMeter(model) as saved:
            loss = model(**batch).loss
        with rec.phase("backward"):
            loss.backward()
        with rec.phase("step"):
            optimizer.step()
    finally:
        optimizer.zero_grad(set_to_none=True)
    phases = rec.to_frame()
    fixed = accounting.param_bytes(model) + accounting.optimizer_state_bytes(optimizer)
    return {
        "step time (s)": timed.median_s,
        "step IQR (ms)": timed.wall.iqr * 1e3,
        **{k.replace("_per_s", "/s"): v for k, v in flops.throughput(batch_size, seq_len, timed.median_s).items()},
        "host enqueue (s)": timed.host.median if prof.on_gpu else float("nan"),
        "GPU busy": timed.gpu_busy if timed.gpu_busy is not None else float("nan"),
        "verdict": timed.verdict,
        "weights + optimizer states (GiB)": fixed / GIB,
        "saved activations (GiB)": saved.total_bytes / GIB,
        "allocated after forward (GiB)": phases.loc["forward", "allocated_mib"] * MIB / GIB,
        "peak of the step (GiB)": phases["peak_allocated_mib"].max() * MIB / GIB,
    }, timed


FLAT_GAIN = 1.05  # a doubling of the batch that adds less than 5% samples/s
FLAT_RUN = 2  # that many such doublings in a row: throughput has flattened
max_batch, sweep_budget_s = prof.pick(tiny=8, full=256), prof.pick(tiny=10.0, full=35.0)
CALLS_PER_POINT = 14  # time_it's 1 warm-up + 10 timed + 2 profiled steps, and the phase-by-phase step
FLAT_K = 4  # batch 1 against batch 4, interleaved
sweep, sweep_timed, sweep_stop, flat_cmp = {}, {}, {}, {}
for name in SETUPS:
    model, optimizer = build(name)
    rows, bs, start, small_gains = {}, 1, time.perf_counter(), 0
    while True:
        attempt = batching.try_batch(lambda b, n=name, m=model, o=optimizer: measure_batch(n, m, o, b), bs)
        if not attempt.fits:
            rows[bs] = {"result": f"out of memory ({attempt.error})"}
            sweep_stop[name] = ("out of memory", bs)
            break
        row, sweep_timed[(name, bs)] = attempt.value
        rows[bs] = {"result": "fits", **row}
        gain = row["samples/s"] / rows[bs // 2]["samples/s"] if bs > 1 else float("inf")
        next_cost_s = 2 * row["step time (s)"] * CALLS_PER_POINT  # about twice this point's time
        small_gains = small_gains + 1 if gain < FLAT_GAIN else 0
        if small_gains >= FLAT_RUN:
            sweep_stop[name] = ("flat", bs)
        elif 2 * bs > max_batch:
            sweep_stop[name] = ("largest batch of the sweep", bs)
        elif time.perf_counter() - start + next_cost_s > sweep_budget_s:
            sweep_stop[name] = ("time budget", bs)
        else:
            bs *= 2
            continue
        break
    k = max(b for b in rows if b <= FLAT_K and rows[b]["result"] == "fits") if rows[1]["result"] == "fits" else 1
    if k > 1:
        one, more = make_batch(name, 1), make_batch(name, k)
        flat_cmp[name] = timing.interleaved(lambda m=model, o=optimizer, b=one: steps.train_step(m, o, b),
                                            lambda m=model, o=optimizer, b=more: steps.train_step(m, o, b),
                                            device=prof.device,
                                            names=("batch 1", f"batch {k}"), rounds=prof.pick(tiny=10, full=15),
                                            warmup=1, profile_steps=1)
    sweep[name] = pd.DataFrame.from_dict(rows, orient="index").rename_axis("batch")
    cleanup.free(globals(), "model", "optimizer", "attempt", "row", "one", "more")
sweep["bert-large-uncased"].drop(columns="verdict", errors="ignore")  # a row's regime: its GPU-busy column (the text names the clear ones)

# %%
sweep["polyglot-ko-1.3b"].drop(columns="verdict", errors="ignore")

# %% [markdown]
# **The fixed part and the part per sample.** Memory after the forward pass should be a straight line in the
# batch size: its intercept is what the model costs before it sees any data, its slope what one more sample
# costs. We fit it (least squares) and hold both numbers against the accounting: the bytes of weights and
# optimizer states, and the saved activations per sample. (On a CPU there is no allocator; the fit then uses
# the accounted bytes themselves.)

# %%
fit_rows = {}
for name, df in sweep.items():
    ok = df.dropna(subset=["step time (s)"])
    y = ok["allocated after forward (GiB)"] if prof.on_gpu else (
        ok["weights + optimizer states (GiB)"] + ok["saved activations (GiB)"])
    slope, intercept = np.polyfit(ok.index.to_numpy(float), y.to_numpy(float), 1)
    best = ok["samples/s"].max()
    fit_rows[name] = {
        "fixed part, fitted (GiB)": intercept,
        "weights + optimizer states (GiB)": ok["weights + optimizer states (GiB)"].iloc[0],
        "per sample, fitted (MiB)": slope * GIB / MIB,
        "saved activations per sample (MiB)": (ok["saved activations (GiB)"] / ok.index).median() * GIB / MIB,
        "batch reaching 95% of best samples/s": int(ok.index[ok["samples/s"] >= 0.95 * best].min()),
        "best samples/s": best,
        "sweep stopped": f"{sweep_stop[name][0]} at batch {sweep_stop[name][1]}",
    }
fit = pd.DataFrame(fit_rows).T.infer_objects()
fit

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
for ax, (name, df) in zip(axes, sweep.items()):
    ok = df.dropna(subset=["step time (s)"])
    measured = ok["allocated after forward (GiB)"] if prof.on_gpu else (
        ok["weights + optimizer states (GiB)"] + ok["saved activations (GiB)"])
    ax.plot(ok.index, measured, "o", label="after the forward pass" if prof.on_gpu else "accounted: states + activations")
    fixed, per_gib = fit.loc[name, "fixed part, fitted (GiB)"], fit.loc[name, "per sample, fitted (MiB)"] * MIB / GIB
    xs = np.array([0, df.index.max()])
    ax.plot(xs, fixed + per_gib * xs, "k--", label="fit: fixed + per sample x batch")
    if prof.on_gpu:
        ax.plot(ok.index, ok["peak of the step (GiB)"], "s", label="peak of the step")
        ax.axhline(t4_budget_gib, color="grey", linestyle=":", label="emulated T4 budget")
    ax.axhline(fit.loc[name, "weights + optimizer states (GiB)"], color="C2", linewidth=1, label="weights + optimizer states")
    if sweep_stop[name][0] == "out of memory":
        b_oom = sweep_stop[name][1]
        ax.plot([b_oom], [fixed + per_gib * b_oom], "x", color="C3", markersize=10, markeredgewidth=2,
                label="out of memory (fit's prediction)")
    ax.set_xlim(left=0)  # a linear axis: the fit is a straight line
    ax.set_ylim(bottom=0)
    ax.set_title(f"{name}, seq {SETUPS[name]['seq_len']}: {fixed:.1f} GiB + {per_gib * GIB / MIB:,.0f} MiB per sample",
                 fontsize=10)
    ax.set_xlabel("batch size (samples)")
    ax.set_ylabel("memory (GiB)")
handles = {lab: h for ax in axes for h, lab in zip(*ax.get_legend_handles_labels())}
fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=3, fontsize=8)
fig.suptitle("Memory is a fixed part plus a part per sample: a straight line in the batch size")
fig.tight_layout(rect=(0, 0.1, 1, 1))

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (3.1 What a larger batch costs and buys)
if prof.on_gpu:
    lines = []
    for name, bytes_rule in (("bert-large-uncased", "fp32 weights and AdamW states, 12 bytes per parameter"),
                             ("polyglot-ko-1.3b", "weights and AdamW states in pure fp16, 6 bytes per parameter")):
        r, df = fit.loc[name], sweep[name].dropna(subset=["step time (s)"])
        b0 = df.index[0]
        line_b0 = r["fixed part, fitted (GiB)"] + r["per sample, fitted (MiB)"] * MIB / GIB * b0
        peak_gap = df.loc[b0, "peak of the step (GiB)"] - line_b0
        lines.append(
            f"- **{name}** at {SETUPS[name]['seq_len']} tokens: the fit's intercept is {r['fixed part, fitted (GiB)']:.2f} GiB "
            f"against {r['weights + optimizer states (GiB)']:.2f} GiB of {bytes_rule}; each sample adds "
            f"{r['per sample, fitted (MiB)']:,.0f} MiB, of which {r['saved activations per sample (MiB)']:,.0f} MiB are "
            f"saved for backward. At batch {b0} the step's peak lies "
            + (f"{peak_gap:.2f} GiB above the line: the peak is then not in the forward pass but in the backward pass "
               f"or the optimizer step, where gradients and temporary buffers join the fixed part (chapter 1, "
               f"section 1.5)." if peak_gap > 0.05 else f"within {abs(peak_gap):.2f} GiB of the line."))
    display(Markdown("\n".join(lines)))
else:
    print("skipped on CPU: without an allocator the fit is made of the accounted bytes, so it matches the accounting "
          "by construction")

# %% [markdown]
# Now what the memory buys. The figure labels each point with the [GPU-busy](https://gpu-efficient-training.github.io/book/book/glossary.html#gpu-busy) fraction that `time_it` measured.

# %% [markdown]
# A step is *[host-bound](https://gpu-efficient-training.github.io/book/book/glossary.html#host-bound)* when the CPU needs longer to issue its kernels than the GPU needs to run them:
# Python, the dispatcher and a few thousand kernel launches per step set the time, and a larger batch makes
# each kernel longer without adding many launches. That is why the step time can stay flat while the batch grows,
# and why throughput then grows almost in proportion. Once the GPU is busy nearly all the time, more samples
# per step cost proportionally more time and throughput flattens. Chapter 8 profiles this regime in detail.
# Below the flat part, gradient accumulation cannot help either: it runs the small batch's kernels several
# times, as section 3.4 shows.
#
# How to read the sentences under the figure: *[host enqueue](https://gpu-efficient-training.github.io/book/book/glossary.html#host-enqueue)* includes the CPU's waiting for the GPU, so where it
# grows with the batch although the number of operations per step does not, that growth is waiting, not issuing;
# where the GPU is busy most of the time, it is the GPU-busy fraction that says what limits the step. "95% of the best"
# is measured against the largest batch the sweep ran.

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
for ax, (name, df) in zip(axes, sweep.items()):
    ok = df.dropna(subset=["step time (s)"])
    best, sat = fit.loc[name, "best samples/s"], int(fit.loc[name, "batch reaching 95% of best samples/s"])
    ax.plot(ok.index, ok["samples/s"], "o-", label="measured (median of 10 steps)")
    if prof.on_gpu:
        for b, row in ok.iterrows():
            ax.annotate(f"{row['GPU busy']:.0%}", (b, row["samples/s"]), textcoords="offset points", xytext=(0, 6),
                        ha="center", fontsize=7)
    ax.axhline(0.95 * best, color="grey", linestyle=":", label="95% of the best measured")
    why, b_stop = sweep_stop[name]
    if why == "out of memory":
        ax.plot([b_stop], [0.02 * best], "x", color="C3", markersize=10, markeredgewidth=2, clip_on=False,
                label="out of memory")
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(df.index), [str(b) for b in df.index])
    ax.set_ylim(bottom=0, top=1.15 * best)
    last_gain = (ok["samples/s"].iloc[-1] / ok["samples/s"].iloc[-2] - 1) if len(ok) > 1 else float("nan")
    if why == "flat":
        title = f"{name}: flat from batch {sat}"
    elif why == "out of memory":
        title = f"{name}: out of memory at batch {b_stop}"
    elif last_gain >= FLAT_GAIN - 1:
        title = f"{name}: still rising at batch {ok.index.max()} ({why})"
    else:
        title = f"{name}: up to batch {ok.index.max()} ({why})"
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("batch size (samples)")
    ax.set_ylabel("throughput (samples/s)")
handles = {lab: h for ax in axes for h, lab in zip(*ax.get_legend_handles_labels())}
fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=3, fontsize=8)
fig.suptitle("Throughput against the batch size" + (" (labels: GPU busy)" if prof.on_gpu else ""))
fig.tight_layout(rect=(0, 0.08, 1, 1))

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Batch 1 against batch k, interleaved
def flat_sentence(c):
    """Batch 1 against batch k, interleaved: how much of the larger batch's samples came for free."""
    k = int(c.b_name.split()[-1])
    x, lo_x, hi_x = 1 / c.speedup, 1 / c.hi, 1 / c.lo  # batch k's step time over batch 1's
    head = (f" Batch {k} carries {k} times the samples, and its step took {x:.2f} times batch 1's time (95% interval "
            f"{lo_x:.2f}–{hi_x:.2f}, {c.rounds} interleaved rounds): throughput grew {k / x:.1f}-fold")
    if hi_x < k / (1 + c.threshold):
        launch = timing.us_per_launch(c.a)
        cpu = (f" At batch 1 this host spends about {launch:.0f} µs per GPU operation issuing the step: the reader's "
               "CPU decides how far this part of the curve reaches." if launch else "")
        return head + ", because the extra samples ride on kernels the GPU was waiting to run." + cpu
    return head + ": the step time grows with the batch from the start, so the GPU was the limit already at batch 1."


if prof.on_gpu:
    lines = []
    for name in SETUPS:
        df = sweep[name].dropna(subset=["step time (s)"])
        b0 = df.index[0]
        r0, t0 = df.loc[b0], sweep_timed[(name, b0)]
        regime = (f"the step's Python call returns after {r0['host enqueue (s)'] * 1e3:.0f} ms, an upper bound on "
                  f"what issuing its {t0.kernels_per_call:,} GPU operations costs the CPU (the call also waits "
                  f"when the launch queue is full), and the GPU is busy {r0['GPU busy']:.0%} of the time"
                  # the share, not a regime word: at batch 1 the busy fraction sits where two runs of the same
                  # step (61% and 75% on one H100 host) fall on either side of the 70% line between the words
                  + (": most of the step, the GPU waits for the host" if r0["GPU busy"] < timing.HOST_BOUND_BUSY else
                     ": for the rest of the step, the GPU waits" if r0["GPU busy"] < timing.GPU_BOUND_BUSY else ""))
        flat = flat_sentence(flat_cmp[name]) if name in flat_cmp else ""
        why, b_stop = sweep_stop[name]
        best, sat = fit.loc[name, "best samples/s"], int(fit.loc[name, "batch reaching 95% of best samples/s"])
        last = df.index[-1]
        gain = df.loc[last, "samples/s"] / df.loc[last // 2, "samples/s"] - 1 if last > b0 else float("nan")
        prev = (df.loc[last // 2, "samples/s"] / df.loc[last // 4, "samples/s"] - 1
                if last // 4 >= b0 else float("nan"))
        if why == "flat":
            end = (f" Throughput reaches 95% of its best measured ({best:,.1f} samples/s) at batch {sat}; the last "
                   f"two doublings added {prev:.1%} and {gain:.1%} (to batch {last}, GPU busy "
                   f"{df.loc[last, 'GPU busy']:.0%}), both under 5%, so the sweep stopped: beyond this point a "
                   f"larger batch is a question of optimisation, not of speed.")
        elif why == "out of memory":
            end = (f" Throughput changed by {gain:+.1%} in the last doubling that fitted (to batch {last}, GPU busy "
                   f"{df.loc[last, 'GPU busy']:.0%}), and batch {b_stop} ran out of memory: the best measured, "
                   f"{best:,.1f} samples/s, is where this card's memory ends; the sweep cannot tell whether "
                   f"throughput had reached a plateau.")
        else:
            end = (f" Throughput changed by {gain:+.1%} in the last doubling, to batch {last} (GPU busy "
                   f"{df.loc[last, 'GPU busy']:.0%}); the sweep stopped there ({why}), so the best measured, "
                   f"{best:,.1f} samples/s, is a lower bound of the plateau.")
        lines.append(f"- **{name}**: at batch {b0} a step takes {r0['step time (s)'] * 1e3:.0f} ms (IQR "
                     f"{r0['step IQR (ms)']:.1f} ms); {regime}.{flat}{end}")
    display(Markdown("\n".join(lines)))
else:
    print("skipped on CPU: GPU-busy and host enqueue time need a GPU, and a CPU's throughput says nothing about a GPU's")

# %% [markdown]
# ### A picture of host-bound
#
# The same idea as a picture, the one later chapters point back to. We profile one training step of the 1.3B
# model at batch 1 and at batch 32 (`profiler.profile`, chapter 8 explains it) and draw each as lanes in time:
# the CPU on top (the phases of the step, then every operator the Python code dispatches), the GPU below (every
# kernel at its true width, coloured by kind), and at the bottom, slice by slice, how much of the time the GPU
# was busy. At batch 1 the kernels are short and the GPU waits between them for the CPU to launch the next:
# white gaps. At batch 32 about as many launches carry 32 times the work, each kernel runs longer than it takes
# the CPU to launch the next one, a queue builds up and the GPU runs back to back. (Profiled steps are slower
# than timed ones: the profiler slows the CPU, so the gaps are wider here than in the timed step.)

# %%
host_pictures = {}
if prof.on_gpu:
    name = "polyglot-ko-1.3b"
    model, optimizer = build(name)
    for bs in (1, 32):
        attempt = batching.try_batch(lambda b, m=model, o=optimizer: profiler.profile(
            steps.make_step(m, o, make_batch(name, b)), device=prof.device, warmup=2, active=1), bs)
        host_pictures[bs] = attempt.value if attempt.fits else f"out of memory ({attempt.error})"
    cleanup.free(globals(), "model", "optimizer", "attempt")
    drawn = {b: p for b, p in host_pictures.items() if not isinstance(p, str)}
    if drawn:
        fig, axes = plt.subplots(len(drawn), 1, figsize=(11, 3.3 * len(drawn)))
        for ax, (b, p) in zip(np.atleast_1d(axes), drawn.items()):
            start_us, end_us = p.windows_us[0]
            profiler.timeline(p, ax=ax, title=f"{name}, batch {b}: one profiled step, {(end_us - start_us) / 1e3:.0f} ms, "
                                              f"GPU busy {p.busy_us_per_step()[0] / (end_us - start_us):.0%}, "
                                              f"{p.kernels_per_step:,} GPU operations")
        fig.tight_layout()
    for b, p in host_pictures.items():
        if isinstance(p, str):
            print(f"batch {b}: {p}")
else:
    print("skipped on CPU: the picture is of a GPU waiting for the CPU")


# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title One sentence per drawn step
def host_picture_text(pictures):
    """One sentence per drawn step: its length, the GPU's busy share, and the CPU's time per GPU operation."""
    parts = []
    for b, p in pictures.items():
        if isinstance(p, str):
            continue
        start_us, end_us = p.windows_us[0]
        ms, ops = (end_us - start_us) / 1e3, p.kernels_per_step
        parts.append(f"at batch {b} the profiled step took {ms:.0f} ms for {ops:,} GPU operations, "
                     f"{ms * 1e3 / ops:.0f} µs of step per operation, and the GPU was busy "
                     f"{p.busy_us_per_step()[0] / (end_us - start_us):.0%} of it")
    if len(parts) < 2:
        return ""
    return ("In the pictures above, " + "; ".join(parts) + ". The number of operations hardly changes with the "
            "batch: what changes is how long each one runs on the GPU against how long the CPU needs to issue it. "
            "How many microseconds a launch costs depends on the CPU, so on a slower CPU than this one the crossover "
            "comes at a larger batch.")


if prof.on_gpu and host_picture_text(host_pictures):
    prose.say(host_picture_text(host_pictures))

# %% [markdown]
# ## 3.2 Finding the largest batch that fits
#
# The sweep tried fixed sizes. To find the limit, `helpers.batching` searches: `largest_batch(step)` calls
# `step(batch_size)` at 1, 2, 4, ... until one fails with `torch.OutOfMemoryError`, then bisects between the
# last size that fitted and the first that failed. Each try goes through `try_batch`, whose key lines are:
#
# ```python
# try:
#     value = step(batch_size)
# except torch.OutOfMemoryError as err:
#     error = short_error(str(err))
# release()                      # gc.collect() and torch.cuda.empty_cache(), *after* the except block
# return Attempt(batch_size, error is None, memory_mib(), ...)
# ```
#
# The order matters. While an exception is being handled, its traceback keeps every frame of the failed call
# alive, and with them every tensor the step had made: freeing memory inside the `except` block frees
# nothing. Once the block ends, Python drops the exception, and `release()` can give the memory back. (The
# helper's unit tests check exactly this.) Then the allocated memory is read, so every attempt shows
# whether something leaked.
#
# We search with the 1.3B model, first under the emulated T4 budget, then on the whole card. The step is
# `steps.train_step` above; one step at batch 1 first creates AdamW's states, so that every attempt sees the
# memory a real training step sees from its second iteration on.

# %%
name = "polyglot-ko-1.3b"
model, optimizer = build(name)
steps.train_step(model, optimizer, make_batch(name, 1))  # AdamW's states exist from here on
cleanup.collect()
baseline_mib = measure.allocator_mib()["allocated_mib"]


def polyglot_step(batch_size):
    steps.train_step(model, optimizer, make_batch(name, batch_size))


if run_profile.cuda_or_skip("a real out-of-memory error needs a GPU; on a CPU the search runs against a simulated limit"):
    print(f"allocated before the search: {baseline_mib:,.0f} MiB (weights + AdamW states)")
    with measure.gpu_budget(t4_budget_gib):
        t4_search = batching.largest_batch(polyglot_step)
    full_search = batching.largest_batch(polyglot_step, start=8, multiple_of=8)
else:
    def simulated_step(batch_size):  # a CPU has no allocator limit: pretend the card holds 12 samples
        if batch_size > 12:
            raise torch.OutOfMemoryError(f"simulated out of memory: {batch_size} samples > 12")
        polyglot_step(batch_size)

    t4_search = batching.largest_batch(simulated_step)
    full_search = batching.largest_batch(simulated_step, start=4, multiple_of=4)
t4_search.to_frame()

# %%
full_search.to_frame()

# %% [markdown]
# After every attempt, the failed ones included, allocated memory must be back at the baseline: the weights
# and AdamW's states. The check below asserts it (a step whose tensors leaked would hold hundreds of MiB).

# %%
if prof.on_gpu:
    after = pd.concat([t4_search.to_frame(), full_search.to_frame()])["allocated after cleanup (MiB)"]
    deviation_mib = (after - baseline_mib).abs().max()
    assert deviation_mib < 32, f"memory leaked: {deviation_mib:.1f} MiB"  # a leaked step would hold hundreds
    print(f"every attempt left {after.min():,.1f} to {after.max():,.1f} MiB allocated (baseline {baseline_mib:,.1f})")
freed = cleanup.free(globals(), "model", "optimizer")

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (3.2 Finding the largest batch that fits)
if prof.on_gpu:
    t4_16 = next((a for a in t4_search.attempts if a.batch_size == 16), None)
    sixteen = ("batch 16 fails, as in the LLM book and in chapter 1" if t4_16 is not None and not t4_16.fits else
               "batch 16 fits here, unlike in the LLM book and chapter 1" if t4_16 is not None else
               "batch 16 was not tried")
    display(Markdown(
        f"Under the T4 budget ({t4_budget_gib:.2f} GiB for the allocator) the largest batch is {t4_search.largest}, "
        f"found in {len(t4_search.attempts)} attempts; {sixteen}. The whole card takes {full_search.largest} "
        f"sequences of {SETUPS[name]['seq_len']} tokens (to a multiple of 8, in {len(full_search.attempts)} attempts). "
        f"After every attempt allocated memory was within {deviation_mib:.1f} MiB of the baseline of "
        f"{baseline_mib:,.0f} MiB, the weights and AdamW's states."))
else:
    print("skipped on CPU: the search ran against a simulated limit of 12 samples, so its result is that limit")


# %% [markdown]
# The largest batch that fits is not automatically the one to train with: once the GPU is busy nearly all the
# time (section 3.1), a larger batch buys little speed, and beyond that the batch size is a question of
# optimisation. A search like this answers a different question: how much headroom a setup has, and
# whether a batch size found on one card will survive on another. (Leave some room: a real dataset's
# longest sequences, or a different allocator state, can need more than random data of fixed length.)
# Accelerate offers the same idea as a decorator, `accelerate.utils.find_executable_batch_size`, which starts
# high and shrinks the batch after each failure (by 10% each time in accelerate 1.15).

# %% [markdown]
# ## 3.3 Gradient accumulation, written out
#
# The loss of a batch is the mean of its samples' losses, so its gradient is the mean of their gradients.
# Split a batch of $B \times N$ samples into $N$ micro-batches of $B$: the mean over all of them is the sum,
# over the micro-batches, of each [micro-batch](https://gpu-efficient-training.github.io/book/book/glossary.html#micro-batch)'s mean divided by $N$. `backward()` *adds* into `.grad`, so
# calling it on `loss / N` for each micro-batch builds exactly that sum, and the optimizer steps once every
# $N$ micro-batches. Only one micro-batch's activations exist at any time. The whole technique is this loop:

# %%
def train_accumulating(model, optimizer, batches, accumulation_steps):
    """Train on ``batches``, stepping the optimizer once every ``accumulation_steps`` micro-batches.

    Returns the loss of each optimizer step (the mean over its micro-batches).
    """
    losses, step_loss = [], 0.0
    for i, batch in enumerate(batches, start=1):
        loss = model(**batch).loss / accumulation_steps  # N of these add up to the mean over B x N samples
        loss.backward()                                  # .grad += this micro-batch's share
        step_loss = step_loss + loss.detach()
        if i % accumulation_steps == 0:
            optimizer.step()                             # one update per N micro-batches
            optimizer.zero_grad(set_to_none=True)        # the next sum starts from nothing
            losses.append(float(step_loss))
            step_loss = 0.0
    return losses


# %% [markdown]
# Is it right? Two checks, on a task where the loss means something: a small GPT-NeoX (the 1.3B model's
# architecture, a few layers, trained in fp32 so that rounding is small) learns sequences from a random Markov
# chain in which every token has 4 equally likely successors, so the best possible loss is $\ln 4$ per token
# (`data.markov_lm_dataset`). All sequences have the same length here; section 3.5 shows what changes when
# they do not.
#
# **Check 1: the gradients.** One backward pass over $B \times N$ sequences against $N$ accumulated
# micro-batches of $B$, from the same weights. We report, over all parameter tensors, the largest difference
# relative to the largest gradient of that tensor, and assert that it is below $10^{-4}$: fp32 carries about 7
# significant digits (machine epsilon $1.2 \times 10^{-7}$), and a different order of summation changes the last
# ones; any mistake in the loop changes far more. As a control, the same comparison for a loop that forgets the
# division by $N$.

# %%
SMALL = prof.pick(
    tiny=dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=256, vocab_size=256),
    full=dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=4, intermediate_size=1024, vocab_size=256),
)
micro_bs, n_accum, small_seq = prof.pick(tiny=4, full=8), 4, prof.pick(tiny=64, full=128)
n_steps, small_lr = prof.pick(tiny=40, full=60), prof.pick(tiny=1e-2, full=3e-3)
markov = data.markov_lm_dataset(micro_bs * n_accum * n_steps, small_seq, seed=0)


def build_small(seed=0):
    return models.build("polyglot-ko-1.3b", head="causal-lm", dtype=torch.float32, seed=seed, **SMALL).train()


def to_device(batch):
    return {k: v.to(prof.device) for k, v in batch.items()}


def gradients(model, micro_batches, divide=True):
    """The .grad of every parameter after backward over ``micro_batches`` (losses divided by N or not)."""
    model.zero_grad(set_to_none=True)
    for mb in micro_batches:
        loss = model(**mb).loss
        (loss / len(micro_batches) if divide else loss).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def max_rel_diff(grads, reference):
    """max over tensors of max|grads - reference| / max|reference|."""
    return max(((grads[n] - reference[n]).abs().max() / reference[n].abs().max()).item()
               for n in reference if reference[n].abs().max() > 0)


small = build_small()
big_batch = to_device(markov[: micro_bs * n_accum])
micro_batches = [to_device(markov[i * micro_bs:(i + 1) * micro_bs]) for i in range(n_accum)]
g_big = gradients(small, [big_batch])
grad_check = pd.Series({
    f"{n_accum} micro-batches of {micro_bs}, loss / {n_accum}": max_rel_diff(gradients(small, micro_batches), g_big),
    f"{n_accum} micro-batches of {micro_bs}, loss not divided (a bug)": max_rel_diff(
        gradients(small, micro_batches, divide=False), g_big),
    "fp32 machine epsilon": torch.finfo(torch.float32).eps,
}, name=f"max relative difference to one batch of {micro_bs * n_accum}")
assert grad_check.iloc[0] < 1e-4, "accumulated gradients differ from the large batch's"
assert grad_check.iloc[1] > 1.0, "the control should be off by a factor of N"
grad_check.to_frame().map("{:.2e}".format)

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (3.3 Gradient accumulation, written out)
display(Markdown(
    f"The accumulated gradients agree with the large batch's to {grad_check.iloc[0]:.1e} of the largest gradient, "
    f"{grad_check.iloc[0] / grad_check.iloc[2]:.0f} times fp32's machine epsilon: the last digits fp32 keeps, "
    f"summed in another order. Without the division they are off by {grad_check.iloc[1]:.2f} of the largest "
    f"gradient, the factor $N - 1 = {n_accum - 1}$."))

# %% [markdown]
# Note that AdamW would hide the missing division: it divides each update by a running estimate of the gradient's size,
# so a constant factor on all gradients barely changes its steps (SGD, gradient clipping and the reported
# loss would all be off).
#
# **Check 2: the training run.** Two copies of the same initial model train for several steps on the same
# sequences, in the same order: one with batches of $B \times N$, one with $N$ accumulated micro-batches of $B$
# (the loop above, with `accumulation_steps=1` for the first).

# %%
runs = {}
for label, bs, steps_per_update in [(f"batch {micro_bs * n_accum}", micro_bs * n_accum, 1),
                                    (f"{n_accum} accumulated micro-batches of {micro_bs}", micro_bs, n_accum)]:
    model_run = build_small()
    optimizer = torch.optim.AdamW(model_run.parameters(), lr=small_lr)
    batches = [to_device(b) for b in data.batches(markov, bs, shuffle=False)]
    runs[label] = (train_accumulating(model_run, optimizer, batches, steps_per_update), model_run)
(loss_big, model_big), (loss_acc, model_acc) = runs.values()
curves = pd.DataFrame({label: losses for label, (losses, _) in runs.items()})
torch.testing.assert_close(torch.tensor(loss_acc), torch.tensor(loss_big), rtol=1e-4, atol=1e-5)
param_diff = (sum((p - q).square().sum() for p, q in zip(model_acc.parameters(), model_big.parameters())).sqrt()
              / sum(p.square().sum() for p in model_big.parameters()).sqrt()).item()
assert param_diff < 1e-4, f"the two runs' weights drifted apart: {param_diff:.1e}"
fig = plots.lines(curves.reset_index().assign(step=lambda d: d["index"] + 1), x="step", ys=list(curves.columns),
                  styles=["-", "o"], title="Accumulated micro-batches follow the large batch's training run step for step",
                  xlabel="optimizer step", ylabel="loss (nats per token)")
fig.axes[0].lines[1].set_markersize(3)
fig.axes[0].axhline(data.markov_loss_floor(4), color="grey", linestyle=":", label="best possible: ln 4")
fig.axes[0].legend(loc="upper right")
fig.tight_layout()

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (3.3 Gradient accumulation, written out)
learned = loss_acc[-1] < 1.2 * data.markov_loss_floor(4)
display(Markdown(
    f"The curves lie on top of each other for all {n_steps} steps: the largest difference between the two runs' "
    f"losses is {float((curves.iloc[:, 0] - curves.iloc[:, 1]).abs().max()):.1e} nats, and after the last step their "
    f"weights differ by {param_diff:.1e} of their norm. "
    + (f"Both learn the chain (final loss {loss_acc[-1]:.2f}, floor $\\ln 4 = 1.39$). " if learned else
       f"Neither has learned the chain yet (final loss {loss_acc[-1]:.2f}, floor $\\ln 4 = 1.39$): the profile's run "
       f"is short, but the two runs still agree. ")
    + "The assertions above would fail for any loop that steps too often, forgets `zero_grad` or drops a micro-batch."))

# %% [markdown]
# Two things are not equivalent in general. Layers that compute statistics *across the batch*, BatchNorm
# above all, see only a micro-batch: their normalisation and their running averages follow the micro-batch
# size, not the effective one (transformers use LayerNorm, which works per token, so they are unaffected).
# And dropout draws different masks, which changes nothing on average but makes runs differ bit for bit.

# %%
freed = cleanup.free(globals(), "model_run", "model_big", "runs", "small", "g_big")


# %% [markdown]
# ## 3.4 What accumulation costs
#
# The Hugging Face guide trains bert-large (fp32, 512 tokens) at batch 4 and then with batch 1 and 4 steps of
# accumulation, and reports that memory fell and time rose. We measure those two rows and two more, batch 16
# and batch 4 x 4 (the same 16 samples per update, accumulated), on our GPU under the emulated T4 budget, so
# that a configuration that does not fit a 15 GB card fails here too. Time is per optimizer step (`time_it`, as
# in section 3.1); throughput counts the samples of the effective batch. The two comparisons the text draws,
# batch 1 x 4 against batch 4 and batch 4 x 4 against a real batch 16 (on the whole card), are timed again with
# `timing.interleaved`. The guide's memory column is [NVML](https://gpu-efficient-training.github.io/book/book/glossary.html#nvml) *used*, from a run with eager attention and
# transformers' own AdamW (chapter 1, section 1.2); ours runs SDPA and PyTorch's AdamW, and the text under the figure
# divides [peak allocated](https://gpu-efficient-training.github.io/book/book/glossary.html#peak-allocated-memory) memory. With SDPA the activations are a smaller part of the peak, so a smaller
# micro-batch saves a smaller share of it than in the guide: compare the direction, not the ratio (the table also
# gives NVML *used*).

# %%
def update_fn(name, model, optimizer, micro_size, steps_per_update):
    """One optimizer step over ``steps_per_update`` micro-batches of ``micro_size``, as a callable."""
    micro = [make_batch(name, micro_size, seed=i) for i in range(steps_per_update)]

    def one_update():
        try:
            train_accumulating(model, optimizer, micro, steps_per_update)
        finally:
            optimizer.zero_grad(set_to_none=True)

    return one_update


def accumulation_cost(name, model, optimizer, micro_size, steps_per_update):
    """Time, throughput and memory of one optimizer step over ``steps_per_update`` micro-batches."""
    one_update = update_fn(name, model, optimizer, micro_size, steps_per_update)
    one_update()  # warm-up; creates AdamW's states on first use
    measure.reset_peak(prof.device)
    timed = timing.time_it(one_update, device=prof.device, warmup=0, repeat=10, profile_steps=1)
    cost_timed[(micro_size, steps_per_update)] = timed
    samples = micro_size * steps_per_update
    row = {"effective batch": samples, "step time (s)": timed.median_s, "step IQR (ms)": timed.wall.iqr * 1e3,
           "samples/s": samples / timed.median_s,
           "GPU busy": timed.gpu_busy if timed.gpu_busy is not None else float("nan")}
    if prof.on_gpu:
        row["peak allocated (GiB)"] = torch.cuda.max_memory_allocated() / GIB
        row["NVML used (MiB)"] = measure.nvml_used_mib()
    return row


def t4_or_nothing():
    """The emulated T4 on a GPU; no limit on a CPU."""
    return measure.gpu_budget(t4_budget_gib) if prof.on_gpu else nullcontext()


HF_ROWS = {"bs 4": (4, 1), "bs 1 x ga 4": (1, 4), "bs 16": (16, 1), "bs 4 x ga 4": (4, 4)}
name = "bert-large-uncased"
model, optimizer = build(name)
cost_rows, cost_timed = {}, {}
for label, (micro_size, steps_per_update) in HF_ROWS.items():
    with t4_or_nothing():
        attempt = batching.try_batch(
            lambda m, s=steps_per_update: accumulation_cost(name, model, optimizer, m, s), micro_size)
    cost_rows[label] = attempt.value if attempt.fits else {"result": f"out of memory ({attempt.error})"}
if run_profile.cuda_or_skip("the whole card differs from the T4 only on a larger GPU"):
    attempt = batching.try_batch(lambda m: accumulation_cost(name, model, optimizer, m, 1), 16)
    cost_rows["bs 16, whole card"] = attempt.value if attempt.fits else {"result": f"out of memory ({attempt.error})"}
bert_grad_gib = accounting.param_bytes(model) / GIB  # fp32 gradients: one per weight, the weights' size
acc_cmp = {}  # interleaved, on the whole card: (baseline row, candidate row) -> Comparison
for base, cand in (("bs 4", "bs 1 x ga 4"), ("bs 16, whole card", "bs 4 x ga 4")):
    if all(r in cost_rows and "result" not in cost_rows[r] for r in (base, cand)):
        shapes = {"bs 4": (4, 1), "bs 1 x ga 4": (1, 4), "bs 16, whole card": (16, 1), "bs 4 x ga 4": (4, 4)}
        acc_cmp[(base, cand)] = timing.interleaved(
            update_fn(name, model, optimizer, *shapes[base]), update_fn(name, model, optimizer, *shapes[cand]),
            device=prof.device, names=(base, cand), rounds=prof.pick(tiny=10, full=15), warmup=1, profile_steps=1)
cleanup.free(globals(), "model", "optimizer", "attempt")
hf_docs = pd.DataFrame({  # the guide's printout for 512 samples of 512 tokens on a 16 GB V100
    "HF docs V100: time (s)": {"bs 4": 57.82, "bs 1 x ga 4": 66.03},
    "HF docs V100: samples/s": {"bs 4": 8.86, "bs 1 x ga 4": 7.75},
    "HF docs V100: NVML used (MiB)": {"bs 4": 14949, "bs 1 x ga 4": 8681},
})
cost = pd.DataFrame.from_dict(cost_rows, orient="index").join(hf_docs)
cost

# %%
fig, (ax_mem, ax_speed) = plt.subplots(1, 2, figsize=(11, 4.4))
x = np.arange(len(cost))
fits = cost["step time (s)"].notna().to_numpy()
if prof.on_gpu:
    ax_mem.bar(x[fits], cost["peak allocated (GiB)"].to_numpy()[fits], color="C3", label="peak allocated")
    ax_mem.axhline(t4_budget_gib, color="grey", linestyle=":", label="emulated T4 budget")
    ax_mem.plot(x[~fits], [t4_budget_gib] * int((~fits).sum()), "x", color="k", markersize=10, markeredgewidth=2,
                label="out of memory (under the T4 budget)")
else:
    ax_mem.text(0.5, 0.5, "peak memory is measured on a GPU", ha="center", va="center", transform=ax_mem.transAxes)
ax_mem.set_ylabel("peak allocated (GiB)")
ax_speed.bar(x[fits], cost["samples/s"].to_numpy()[fits], color="C0", label="throughput (median of 10 updates)")
if (~fits).any():  # (an empty plot with clip_on=False upsets tight_layout)
    ax_speed.plot(x[~fits], [0] * int((~fits).sum()), "x", color="k", markersize=10, markeredgewidth=2, clip_on=False)
ax_speed.set_ylabel("throughput (samples/s)")
for ax in (ax_mem, ax_speed):
    ax.set_xticks(x, cost.index, rotation=20)
    ax.set_ylim(bottom=0)
if prof.on_gpu and "bs 16, whole card" in cost.index and pd.notna(cost.loc["bs 16, whole card", "step time (s)"]):
    same_peak = cost.loc["bs 4 x ga 4", "peak allocated (GiB)"] < cost.loc["bs 16, whole card", "peak allocated (GiB)"]
    ax_mem.set_title("peak: set by the micro-batch" if same_peak else "peak: not lowered by accumulation", fontsize=10)
slower = cost.loc["bs 1 x ga 4", "samples/s"] < cost.loc["bs 4", "samples/s"]
ax_speed.set_title("throughput: lower with the smaller micro-batch" if slower else
                   "throughput: not lowered by the smaller micro-batch", fontsize=10)
handles = {lab: h for ax in (ax_mem, ax_speed) for h, lab in zip(*ax.get_legend_handles_labels())}
fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=4, fontsize=8)
fig.suptitle("bert-large, fp32, 512 tokens: gradient accumulation against larger batches")
fig.tight_layout(rect=(0, 0.08, 1, 1))

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Batch 4 x 4 (candidate) against a real batch 16 (baseline), interleaved
def accumulated_vs_large(c):
    """Batch 4 x 4 (candidate) against a real batch 16 (baseline), interleaved: the same 16 samples per update."""
    busy = f"The GPU is busy {prose.pct(c.b.gpu_busy)} of the time at batch 4 x 4, {prose.pct(c.a.gpu_busy)} at batch 16."
    text = (f"Speed: batch 4 x 4 against a real batch 16 (on the whole card), the same 16 samples per update: "
            f"{c.phrase(what='than batch 16')}. {busy} ")
    if c.verdict != "slower":
        return text + "At batch 4 this GPU is already busy enough that four small steps cost what one large one does. "
    if min(c.a.gpu_busy, c.b.gpu_busy) >= 0.9:
        return text + ("Busy almost all the time in both, the GPU is not waiting: batch 4 x 4 runs "
                       "four times as many kernels, each a quarter the size, and small kernels do less work per second "
                       "than large ones (section 3.1's sweep shows the same between batch 4 and batch 16). ")
    return text + "At batch 4 the GPU waits part of the time, and four such steps pay that wait four times. "


def guide_row(c, peak_ratio):
    """The guide's comparison, batch 1 x 4 (candidate) against batch 4 (baseline), interleaved."""
    launch = timing.us_per_launch(c.b)
    text = (f"The guide's row, batch 1 x 4 against batch 4: here it needs {peak_ratio:.2f} times the peak memory, "
            f"and its throughput is {c.phrase(what='than batch 4')}, with the GPU busy {prose.pct(c.b.gpu_busy)} of the "
            f"time at batch 1 and {prose.pct(c.a.gpu_busy)} at batch 4. The guide measured {8681 / 14949:.2f} times the NVML memory and "
            f"{7.75 / 8.86:.2f} times the throughput on a V100. Accumulation saves only the activations of the samples "
            "that are no longer in the micro-batch; weights, gradients and optimizer states stay, so the peak does not "
            "fall below them. ")
    if c.verdict == "slower":
        return text + ("A micro-batch below the point where throughput flattens (section 3.1) costs speed: each of the "
                       "four batch-1 steps issues the whole step's kernels"
                       + (f", at about {launch:.0f} µs of this host's time per operation" if launch else "")
                       + ", for a quarter of the work. Hence the guide's advice, to keep the micro-batch as large as "
                       "fits and accumulate the rest (batch 4 x 16 rather than 1 x 64 for 64 samples).")
    return text + ("Here the smaller micro-batch cost no speed beyond the noise; the guide's advice, to keep the "
                   "micro-batch as large as fits and accumulate the rest, still holds wherever the small batch is "
                   "host-bound (section 3.1): the reader's CPU decides where that is.")


if prof.on_gpu:
    c = cost
    bs16 = cost_rows["bs 16"]
    if "result" in bs16:
        text = f"Under the T4 budget batch 16 does not fit ({bs16['result']}); "
    else:
        text = f"Under the T4 budget batch 16 fits here (peak {bs16['peak allocated (GiB)']:.2f} GiB); "
    extra = c.loc["bs 4 x ga 4", "peak allocated (GiB)"] - c.loc["bs 4", "peak allocated (GiB)"]
    text += (f"batch 4 x 4 accumulates the same 16 samples per update at a peak of "
             f"{c.loc['bs 4 x ga 4', 'peak allocated (GiB)']:.2f} GiB, against batch 4's "
             f"{c.loc['bs 4', 'peak allocated (GiB)']:.2f} GiB. The difference, {extra:.2f} GiB, ")
    text += ("is close to the " if abs(extra - bert_grad_gib) < 0.25 * bert_grad_gib else "is not simply the ")
    text += (f"{bert_grad_gib:.2f} GiB of gradients: from the second micro-batch on, the forward pass runs while the "
             f"gradients accumulated so far are held, where a plain step has just freed them. ")
    if ("bs 16, whole card", "bs 4 x ga 4") in acc_cmp:
        text += accumulated_vs_large(acc_cmp[("bs 16, whole card", "bs 4 x ga 4")])
    if ("bs 4", "bs 1 x ga 4") in acc_cmp:
        peak_ratio = c.loc["bs 1 x ga 4", "peak allocated (GiB)"] / c.loc["bs 4", "peak allocated (GiB)"]
        text += "\n\n" + guide_row(acc_cmp[("bs 4", "bs 1 x ga 4")], peak_ratio)
    display(Markdown(text))
else:
    print("skipped on CPU: the T4 budget, peak memory and GPU-busy need a GPU")


# %% [markdown]
# **The LLM book's case.** The book trains the 1.3B model (fp16, AdamW, 256 tokens) on a T4: batch 16 runs out
# of memory, batch 4 with 4 accumulation steps runs, and `torch.cuda.memory_allocated()` read right after the
# first optimizer step shows 10.586 GB (the book divides by 1024³: GiB). The same two runs, under the emulated
# T4, with the same reading:

# %%
def llm_book_accumulation(micro_size, steps_per_update, updates=2):
    """The book's loop and its memory reading, right after the first optimizer step."""
    model, optimizer = build("polyglot-ko-1.3b")
    batches = [make_batch("polyglot-ko-1.3b", micro_size, seed=i) for i in range(steps_per_update * updates)]
    measure.reset_peak(prof.device)
    first_step_gib = float("nan")
    for i, batch in enumerate(batches, start=1):
        (model(**batch).loss / steps_per_update).backward()
        if i % steps_per_update == 0:
            optimizer.step()
            if i == steps_per_update and prof.on_gpu:
                first_step_gib = torch.cuda.memory_allocated() / GIB  # where the book reads it
            optimizer.zero_grad(set_to_none=True)
    peak_gib = torch.cuda.max_memory_allocated() / GIB if prof.on_gpu else float("nan")
    return {"effective batch": micro_size * steps_per_update, "allocated after 1st step (GiB)": first_step_gib,
            "peak allocated (GiB)": peak_gib}


book_rows = {}
for label, (micro_size, steps_per_update) in {"bs 16": (16, 1), "bs 4 x ga 4": (4, 4)}.items():
    with t4_or_nothing():
        attempt = batching.try_batch(lambda m, s=steps_per_update: llm_book_accumulation(m, s), micro_size)
    book_rows[label] = attempt.value if attempt.fits else {"result": f"out of memory ({attempt.error})"}
book = pd.DataFrame.from_dict(book_rows, orient="index")
book["LLM book, T4"] = {"bs 16": "out of memory", "bs 4 x ga 4": "10.586 GiB after 1st step"}
book

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (3.4 What accumulation costs)
if prof.on_gpu:
    r16, r44 = book_rows["bs 16"], book_rows["bs 4 x ga 4"]
    if "result" in r44:
        display(Markdown(f"Under the emulated T4 batch 4 x 4 did not fit either ({r44['result']}), unlike in the book."))
    else:
        first = r44["allocated after 1st step (GiB)"]
        display(Markdown(
            (f"As in the book, batch 16 fails ({r16['result']})" if "result" in r16 else
             f"Unlike in the book, batch 16 fits here (peak {r16['peak allocated (GiB)']:.2f} GiB)")
            + f" and batch 4 x 4 runs. Read where the book reads it, memory is {first:.2f} GiB: the fp16 weights, their "
            f"gradients and AdamW's two states, 9.92 GiB together, plus the last micro-batch's leftovers. The book's "
            f"10.586 is {10.586 - first:+.2f} GiB away. Part of a gap is known: the book's model, loaded from the real "
            f"checkpoint, already took 2.599 GiB against our 2.48, and its loop keeps the model's last output (the "
            f"logits) alive at that moment; the rest cannot be seen from outside. The peak, which decides whether a "
            f"step fits, is higher: {r44['peak allocated (GiB)']:.2f} GiB (chapter 1 found it in the optimizer step)."))
else:
    print("skipped on CPU: the book's numbers are GPU memory readings")

# %% [markdown]
# **The Trainer.** `TrainingArguments(gradient_accumulation_steps=4)` runs the same loop inside the
# `Trainer`. We train bert-large on 16 samples at batch 4 x 4 both ways (one update), with the same optimizer
# (PyTorch's AdamW, constant learning rate, no gradient clipping: the Trainer clips at 1.0 by default), ten
# times each after a warm-up run, and compare time and peak memory. Each `Trainer.train()` call builds its data
# loader again and reuses the optimizer it created in the first call, as the hand-written loop reuses its own;
# the loop's optimizer is deleted before the `Trainer` runs, so that each peak holds one set of AdamW states.
# The comparison in the text comes from `timing.interleaved` afterwards (the loop again with an optimizer of its
# own).

# %%
n_epoch = prof.pick(tiny=16, full=16)
epoch_data = data.dummy_dataset(n_epoch, SETUPS[name]["seq_len"], seed=0)
args = TrainingArguments(
    output_dir="trainer_tmp", per_device_train_batch_size=4, gradient_accumulation_steps=4, num_train_epochs=1,
    learning_rate=1e-5, weight_decay=0.0, optim="adamw_torch", lr_scheduler_type="constant", max_grad_norm=0.0,
    seed=0, logging_strategy="no", save_strategy="no", report_to="none", disable_tqdm=True,
    dataloader_pin_memory=prof.on_gpu,
)
epoch_timed, epoch_rows = {}, {}


def time_epoch(label, fn):
    measure.reset_peak(prof.device)
    epoch_timed[label] = timing.time_it(fn, device=prof.device, warmup=1, repeat=10, busy=False)
    epoch_rows[label] = {"time (s)": epoch_timed[label].median_s, "IQR (ms)": epoch_timed[label].wall.iqr * 1e3,
                         "samples/s": n_epoch / epoch_timed[label].median_s}
    if prof.on_gpu:
        epoch_rows[label]["peak allocated (GiB)"] = torch.cuda.max_memory_allocated() / GIB


model, optimizer = build(name)
time_epoch("hand-written loop", lambda: train_accumulating(
    model, optimizer, (to_device(b) for b in data.batches(epoch_data, 4, shuffle=False)), 4))
cleanup.free(globals(), "optimizer")  # its AdamW states go; the Trainer makes its own
trainer = Trainer(model=model, args=args, train_dataset=epoch_data)
trainer_own = []  # the Trainer's own clock: train_samples_per_second from each train() call's metrics
time_epoch("Trainer", lambda: trainer_own.append(trainer.train().metrics["train_samples_per_second"]))
trainer_own = trainer_own[-10:]  # the timed calls (time_it's warm-up call first)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)  # the loop's own again, for speed only
with contextlib.redirect_stdout(io.StringIO()):  # (each train() call prints its metrics)
    cmp_tr = timing.interleaved(
        lambda: train_accumulating(model, optimizer, (to_device(b) for b in data.batches(epoch_data, 4, shuffle=False)),
                                   4),
        trainer.train, device=prof.device, names=("hand-written loop", "Trainer"), rounds=prof.pick(tiny=10, full=15),
        warmup=1, busy=False)
cleanup.free(globals(), "trainer", "model", "optimizer")
epoch = pd.DataFrame(epoch_rows).T
epoch

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title The Trainer (candidate) against the hand-written loop (baseline), interleaved, with the…
def trainer_sentence(c, own_samples_s, n_samples, peaks=""):
    """The Trainer (candidate) against the hand-written loop (baseline), interleaved, with the Trainer's own clock."""
    own = pd.Series(own_samples_s)
    t_loop, t_call, t_own = c.a.wall.median, c.b.wall.median, n_samples / own.median()
    text = (f"Timed around the whole `trainer.train()` call, one update of {n_samples} samples took "
            f"{prose.ms(t_call)} in the `Trainer` and {prose.ms(t_loop)} in the hand-written loop{peaks}; in "
            f"alternating rounds the Trainer's speed against the loop's is {c.phrase(what='than the loop')}. "
            f"The Trainer's own clock (`train_samples_per_second` in the metrics each `train()` call returns, which "
            f"starts after the call has set itself up and stops before it cleans up) gives {own.median():.1f} "
            f"samples/s (median of {len(own)} calls, {own.min():.1f} to {own.max():.1f}), {prose.ms(t_own)} per update. ")
    if c.verdict == "slower" and t_call > t_loop:
        outside = min(max((t_call - t_own) / (t_call - t_loop), 0.0), 1.0)
        return text + (f"So about {outside:.0%} of the gap lies outside the Trainer's own clock: a fixed cost of each "
                       "`train()` call, paid once per call (here once per update, over an epoch once per epoch). The "
                       "rest is inside it, where it also contains work each call does once (starting the data "
                       "loader's iteration, the callbacks at the start and end of training); this run does not split "
                       "it further.")
    if c.verdict == timing.NO_DIFFERENCE:
        return text + ("With the same optimizer the two do the same arithmetic, and neither the per-call set-up nor "
                       "the per-step bookkeeping is large enough to measure here.")
    return text + "The Trainer was the faster of the two in this run; the interval above says by how much."


if prof.on_gpu:
    peaks = (f", with peaks of {epoch.loc['Trainer', 'peak allocated (GiB)']:.2f} GiB (Trainer) and "
             f"{epoch.loc['hand-written loop', 'peak allocated (GiB)']:.2f} GiB (loop)")
    display(Markdown(trainer_sentence(cmp_tr, trainer_own, n_epoch, peaks)))
else:
    print("skipped on CPU: CPU time and memory say nothing about the Trainer's overhead on a GPU")

# %% [markdown]
# What the fixed cost of a `train()` call contains: in transformers 5.x the set-up starts with accelerate's
# `free_memory()`, which runs `gc.collect()` and `torch.cuda.empty_cache()` (the allocator then requests its
# blocks from the driver again), and goes on to build the data loader and prepare the model and optimizer; which
# of these costs most was not measured here.
#
# Two of the `Trainer`'s defaults, switched off above to compare like with like, would change the comparison
# if left on (not measured here):

# %%
defaults = TrainingArguments(output_dir="trainer_tmp", report_to="none")
pd.Series({"optim": str(defaults.optim.value), "max_grad_norm": defaults.max_grad_norm,
           "lr_scheduler_type": str(defaults.lr_scheduler_type.value)}, name="TrainingArguments defaults")

# %% [markdown]
# Gradient clipping (`max_grad_norm`) computes the norm of all gradients once per update. The default optimizer,
# `adamw_torch_fused` in the table above, is PyTorch's fused AdamW: it updates all parameters in a few kernels
# without the multi-tensor version's temporary buffers (chapter 1 shows those buffers; chapter 5 measures the
# fused step), which lowers the optimizer step's peak. (A transformers release with another default prints it
# in the table.)

# %% [markdown]
# ## 3.5 The pitfall: sequences of different lengths
#
# The proof in section 3.3 used sequences of equal length. A language model's loss is the mean over *tokens*,
# and micro-batches of real text hold different numbers of tokens (padding carries the label -100, which the
# loss ignores). Then the mean of the micro-batches' means is not the mean over all tokens: every micro-batch
# gets the same weight, whatever its number of tokens, so the tokens of short micro-batches count more.
#
# We take the model trained in section 3.3, give its sequences random lengths, sort them by length (as a
# length-grouping sampler does, which makes the effect large) and split them into micro-batches. Three losses
# and their gradients against the reference, one pass over the whole padded batch:
#
# - **naive**: each micro-batch's mean loss divided by $N$, as in section 3.3;
# - **fixed by hand**: each micro-batch's *sum* of token losses divided by the number of tokens in the whole
#   accumulated batch, counted before the first micro-batch;
# - **fixed by transformers**: the model's own loss with `num_items_in_batch` set to that count.

# %%
rng = np.random.default_rng(0)
n_seq = micro_bs * n_accum
lengths = np.sort(rng.integers(4, small_seq + 1, size=n_seq))
ids = data.markov_lm_dataset(n_seq, small_seq, seed=0)[:]["input_ids"]  # the chain of section 3.3, new samples
mask = (torch.arange(small_seq)[None, :] < torch.as_tensor(lengths)[:, None]).long()
whole = to_device({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
parts = [{k: v[i * micro_bs:(i + 1) * micro_bs] for k, v in whole.items()} for i in range(n_accum)]


def n_tokens(batch):
    """Tokens the causal LM loss counts: every label after the first that is not -100."""
    return int((batch["labels"][:, 1:] != -100).sum())


def token_loss_sum(model, batch):
    """Sum (not mean) of the next-token cross-entropies of ``batch``."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch["labels"][:, 1:].flatten(),
                           ignore_index=-100, reduction="sum")


total_tokens = sum(n_tokens(p) for p in parts)
ways = {
    "one pass over all tokens (reference)": lambda b: model_acc(**b).loss,
    "naive: mean per micro-batch / N": lambda b: model_acc(**b).loss / n_accum,
    "fixed by hand: token sum / all tokens": lambda b: token_loss_sum(model_acc, b) / total_tokens,
    "fixed by transformers: num_items_in_batch": lambda b: model_acc(
        **b, num_items_in_batch=torch.tensor(total_tokens, device=prof.device)).loss,
}
pitfall_rows, pitfall_grads = {}, {}
for label, loss_fn in ways.items():
    model_acc.zero_grad(set_to_none=True)
    total = 0.0
    for batch in ([whole] if "reference" in label else parts):
        loss = loss_fn(batch)
        loss.backward()
        total += loss.item()
    pitfall_grads[label] = {n: p.grad.detach().clone() for n, p in model_acc.named_parameters()}
    pitfall_rows[label] = {"loss (nats/token)": total}
reference = pitfall_grads["one pass over all tokens (reference)"]
for label in ways:
    pitfall_rows[label]["gradient: max relative difference"] = max_rel_diff(pitfall_grads[label], reference)
pitfall = pd.DataFrame(pitfall_rows).T
naive, by_hand, by_hf = pitfall.iloc[1], pitfall.iloc[2], pitfall.iloc[3]
assert naive["gradient: max relative difference"] > 1e-2, "with these lengths the naive loop should be visibly wrong"
assert by_hand["gradient: max relative difference"] < 1e-4 and by_hf["gradient: max relative difference"] < 1e-4
print(f"tokens per micro-batch: {[n_tokens(p) for p in parts]}, total {total_tokens}")
pitfall.assign(**{"loss (nats/token)": pitfall["loss (nats/token)"].map("{:.4f}".format),
                  "gradient: max relative difference": pitfall["gradient: max relative difference"].map("{:.1e}".format)})

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (3.5 The pitfall)
counts = [n_tokens(p) for p in parts]
display(Markdown(
    f"The micro-batches hold {', '.join(map(str, counts))} tokens. Over all tokens the loss is "
    f"{pitfall.iloc[0, 0]:.4f} nats per token; the mean of the micro-batch means is {naive.iloc[0]:.4f}. "
    + ("The two are close here because every token of this chain is as hard to predict as any other, wherever it "
       "sits; in real text, where later tokens have more context to go on, short and long sequences differ more. "
       if abs(naive.iloc[0] - pitfall.iloc[0, 0]) < 0.05 * pitfall.iloc[0, 0] else "")
    + f"The gradient shows what is wrong: it is off by {naive.iloc[1]:.2f} of the largest gradient, not rounding but "
    f"a different objective, in which each token of the shortest micro-batch weighs {max(counts) / min(counts):.1f} "
    f"times as much as one of the longest. Both fixes agree with the reference to "
    f"{max(by_hand.iloc[1], by_hf.iloc[1]):.1e}."))

# %% [markdown]
# The rule: divide the *sum* of the token losses by the number of tokens in the whole accumulated batch, which
# must be counted before the first micro-batch runs.
#
# This was a real bug in the Hugging Face `Trainer` until October 2024: it divided each micro-batch's mean loss
# by the number of accumulation steps, exactly the naive line above, so runs with accumulation did not match
# runs with the same effective batch. Transformers 4.46 changed it: the `Trainer` now counts the label tokens of
# all micro-batches of an update and passes that count to the model's loss as `num_items_in_batch`, and the
# models' built-in losses sum the token losses and divide by it (the last row of the table; custom losses must
# take the argument themselves). Releases after 4.46 fixed further corner cases of the same accounting, so use
# a recent version, and check, as here, when you write your own loop.

# %%
cleanup.free(globals(), "model_acc", "pitfall_grads", "reference", "whole", "parts", "markov", "batch", "loss",
             "batches", "optimizer", "big_batch", "micro_batches", "ids", "mask")
if prof.on_gpu:
    print(f"allocated after the last experiment: {torch.cuda.memory_allocated() / MIB:,.1f} MiB")

# %% [markdown]
# ## Summary
#
# The measured rows of section 3.4, beside the sources' numbers:

# %%
SOURCES = {("bert", "bs 4"): "HF docs, V100: 8.86 samples/s, 14,949 MiB NVML",
           ("bert", "bs 1 x ga 4"): "HF docs, V100: 7.75 samples/s, 8,681 MiB NVML",
           ("llm", "bs 16"): "LLM book, T4: out of memory",
           ("llm", "bs 4 x ga 4"): "LLM book, T4: 10.586 GiB after 1st step"}
closing_rows = []
for key, model_label, rows in (("bert", "bert-large, fp32, seq 512", cost_rows),
                               ("llm", "1.3B GPT-NeoX, fp16, seq 256", book_rows)):
    for label, row in rows.items():
        budget = "whole card" if "whole card" in label else ("T4 budget" if prof.on_gpu else "none (CPU)")
        closing_rows.append({"model": model_label, "configuration": label.replace(", whole card", ""),
                             "memory limit": budget, "result": row.get("result", "fits"),
                             **{k: v for k, v in row.items() if k != "result" and k != "NVML used (MiB)"},
                             "source's number": SOURCES.get((key, label), "")})
closing = pd.DataFrame(closing_rows).set_index(["model", "configuration", "memory limit"])
order = ["result", "effective batch", "step time (s)", "samples/s", "peak allocated (GiB)",
         "allocated after 1st step (GiB)", "source's number"]
closing[[c for c in order if c in closing.columns]]

# %% [markdown]
# - Training memory is a fixed part (weights, optimizer states, and gradients from the backward pass on) plus
#   activations that grow linearly with the batch (section 3.1's fit). Where a small batch leaves the GPU idle
#   (the 1.3B model's smallest batches), the step is host-bound: its time is the CPU's time to issue it, so
#   throughput grows almost with the batch. Once the GPU is busy nearly all the time (section 3.1's figure
#   labels every batch with its GPU-busy fraction) each doubling gains less, and past that point a larger batch
#   is an optimisation choice, not a speed-up.
# - The largest batch that fits can be found safely: catch `torch.OutOfMemoryError`, let the `except` block end,
#   then free; memory returns to its baseline after every failure.
# - Gradient accumulation with `loss / N` gives the large batch's gradients to fp32 rounding and the same
#   training run, at the micro-batch's memory plus one set of gradients (held between micro-batches), and at
#   about the micro-batch's speed per sample, not the large batch's.
# - With sequences of different lengths, divide the summed token losses by the tokens of the whole accumulated
#   batch; the mean of micro-batch means is a different objective (fixed in transformers 4.46).
#
# ## Use it in your own script
#
# Gradient accumulation in plain PyTorch, normalised by the tokens of the whole accumulated batch (correct for
# sequences of different lengths). With the `Trainer`, set `gradient_accumulation_steps` instead.
#
# ```python
# import torch.nn.functional as F
#
# accum = 4
# micro_batches = [next(batches) for _ in range(accum)]
# n_tokens = sum((mb["labels"][:, 1:] != -100).sum() for mb in micro_batches)
# for mb in micro_batches:
#     logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits
#     loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), mb["labels"][:, 1:].flatten(),
#                            ignore_index=-100, reduction="sum")
#     (loss / n_tokens).backward()
# optimizer.step()
# optimizer.zero_grad(set_to_none=True)
# ```
#
# ## Exercises
#
# Each exercise has a hint and an answer (or the range to expect) behind a click.
#
# 1. In section 3.1, run bert-large at twice the largest batch its sweep measured (`measure_batch` with a model
#    and optimizer from `build`). Predict its memory from the fit before you run it. Does throughput still move?
#
#    <details><summary>Hint</summary>
#
#    The fit of section 3.1 gives memory = fixed + per sample × batch.
#
#    </details>
#
#    <details><summary>Answer</summary>
#
#    The fixed part plus the batch times bert-large's per-sample cost from section 3.1's fit table. Where the sweep stopped because throughput was flat, it stays within a few percent: the GPU is already busy. Where it stopped for time or memory, it may still rise a little, or run out of memory.
#
#    </details>
#
# 2. In section 3.2, search with `SETUPS["polyglot-ko-1.3b"]["attn_implementation"] = "sdpa"`. When [SDPA](https://gpu-efficient-training.github.io/book/book/glossary.html#sdpa) runs a
#    fused kernel (flash or memory-efficient) it stores no $s \times s$ matrix: how much larger is the largest
#    batch under the T4 budget?
#
#    <details><summary>Hint</summary>
#
#    Eager attention's per-sample activations include about $5 a s^2$ bytes per layer for the $s \times s$ matrices; SDPA with a fused kernel stores none (its math fallback, used for example for bf16 below compute capability 8.0, stores them too). Work out the share of a layer's bytes these matrices take, then check it: `from helpers import exercises; exercises.check("3.2", your_share)`.
#
#    </details>
#
#    <details><summary>Answer</summary>
#
#    At 256 tokens, 16 heads and hidden size 2048 the $s^2$ term is roughly a quarter of a layer's activation bytes ($5as/(34h + 5as) \approx 0.23$), so the layers' per-sample cost falls by about that much and the largest batch grows by roughly a quarter to a third (less where the logits and the loss, which SDPA does not touch, take a larger part of a sample's bytes).
#
#    </details>
#
# 3. In section 3.3, replace AdamW with `torch.optim.SGD(lr=0.1)` and run the training check with the buggy
#    loop (no division by $N$). The loss assertion fails with either optimizer, because the loop's reported loss
#    is then $N$ times the mean. Look at the weights instead (`param_diff`): how far apart are they with SGD, and
#    with AdamW?
#
#    <details><summary>Hint</summary>
#
#    AdamW divides the update by the square root of the second moment: multiplying every gradient by $N$ leaves its update almost unchanged.
#
#    </details>
#
#    <details><summary>Answer</summary>
#
#    With SGD the update is $N$ times too large, so the weights leave the large batch's run within a few steps (a large fraction of their norm apart). With AdamW they stay close (small differences, from $\epsilon$ alone): AdamW is nearly invariant to a constant gradient scale, so the missing division hides in the weights and shows only in the reported loss, in gradient clipping and in SGD-like optimizers.
#
#    </details>
#
# 4. In section 3.5, shuffle `lengths` instead of sorting them. How far apart are the naive and the correct loss
#    now? When does the naive loop happen to be right?
#
#    <details><summary>Hint</summary>
#
#    The naive loss is the mean of micro-batch means; the correct one is all token losses over all tokens.
#
#    </details>
#
#    <details><summary>Answer</summary>
#
#    Shuffled micro-batches hold similar numbers of tokens on average, so the two losses come closer, but they still differ; the naive loop is right exactly when every micro-batch has the same number of non-padding tokens.
#
#    </details>
#
# ## References
#
# - [Hugging Face (2024)](https://gpu-efficient-training.github.io/book/book/references.html), *Methods and tools for efficient training on a single GPU*: batch size and
#   gradient accumulation on one GPU, the V100 rows of section 3.4.
# - [Heo (2024)](https://gpu-efficient-training.github.io/book/book/references.html), chapter 5: the polyglot-ko-1.3b experiment, batch 16 against batch 4 x 4 on a T4.
# - [Hugging Face (2024)](https://gpu-efficient-training.github.io/book/book/references.html), *Fixing Gradient Accumulation*: the loss normalisation fix of transformers 4.46.
# - [Korthikanti et al. (2022)](https://gpu-efficient-training.github.io/book/book/references.html): activation memory per sample (chapter 1, section 1.4).
#
# All the works the book cites are on the [references page](https://gpu-efficient-training.github.io/book/book/references.html).

# %% [markdown]
# ## Memory back at the baseline
#
# Every experiment freed what it made. cuBLAS keeps a *workspace* for each (handle, stream) pair on which it ran a
# matrix product (the autograd engine's thread has its own handle), until it is told to let go; we release them,
# then check that the chapter ends where it began, after the setup's warm-up:

# %%
if prof.on_gpu:  # releases the workspaces, then asserts that allocated memory is back at the start
    display(pd.Series(cleanup.back_at_baseline(chapter_baseline_mib)).to_frame("value"))
else:
    print("skipped on CPU: no GPU memory to check")
