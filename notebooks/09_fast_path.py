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
# # 9. The fast path: attention kernels, packing, `torch.compile`, CUDA graphs and data loading
#
# Guides and blog posts promise speed from a handful of switches: fused attention, compilation, CUDA
# graphs, more data-loader workers, a fused optimizer. Each of them pays on some models and GPUs and not
# on others, and some cost something (compile time, memory, recompilations). This chapter measures every
# switch on the book's two models with chapter 8's instruments, each against its own baseline in alternating
# rounds of the same run, and reports the speed-up *with its 95% interval*: a difference that the interval does
# not put beyond ±3% is called *no practical difference*. Each switch is measured where its effect is physical: a change on
# the GPU's side at a size that keeps the GPU busy, with the GPU's own kernel time beside the wall clock; a change
# on the host's side where the host is the limit, saying what this machine's CPU costs per launch. Where a
# switch made a step slower, the chapter says so and shows what the profiler recorded for both.
#
# **What you will learn**
#
# - which `scaled_dot_product_attention` kernel runs on your GPU (flash, memory-efficient, cuDNN, math),
#   how to choose one with `torch.nn.attention.sdpa_kernel`, and what each costs in time and memory as
#   sequences grow, set against chapter 1's activation formula;
# - how much compute padding wastes on documents of different lengths, and how length grouping and
#   *packing* (several documents per row, with position ids that keep them apart) recover it, checked for
#   correctness;
# - what `torch.compile` costs (compile time, recompilations when shapes change) and buys on bert-large
#   and on the 1.3B GPT-NeoX, in its `default` and `reduce-overhead` modes, compiled per layer (the optimizer
#   step stays eager), and what
#   compiling or capturing a whole model can do to the attention kernel;
# - how a [CUDA graph](https://gpu-efficient-training.github.io/book/book/glossary.html#cuda-graph) removes the launch overhead of a [host-bound](https://gpu-efficient-training.github.io/book/book/glossary.html#host-bound) step, and which attention kernel runs
#   inside one;
# - how to find and remove an input-pipeline stall (`num_workers`, `pin_memory`, `non_blocking`);
# - a table of one-line "free wins" (fused AdamW, `set_to_none`, TF32, aligned shapes), each measured at a size
#   where the GPU, not the host, sets the pace.
#
# **Prerequisites:** chapter 8 (`timing.time_it`, `timing.interleaved`, the [GPU-busy](https://gpu-efficient-training.github.io/book/book/glossary.html#gpu-busy) fraction, the profiler's
# category table, host-bound steps), chapter 1 (activation memory), chapters 3 and 5 (batches of variable length,
# [mixed precision](https://gpu-efficient-training.github.io/book/book/glossary.html#mixed-precision) and fused optimizers). A CUDA GPU for the timing sections; on a CPU the notebook runs
# with tiny models and skips what only means something on a GPU, saying so.

# %%
import sys

if "google.colab" in sys.modules:  # Colab only. pip adds what Colab lacks (bitsandbytes, the book's helpers)
    # and upgrades transformers to the 5.x the book needs: nothing has imported it yet in this kernel, so no
    # restart is needed. Colab's torch already meets the book's floor and is kept (see the setup page).
    # %pip install -q --no-warn-conflicts "gpu-efficient-training @ git+https://github.com/gpu-efficient-training/book"

from helpers import env

env.quiet()  # warnings without file paths, no progress bars: outputs that read the same everywhere

import gc
import math
import os
import tempfile
import time
import warnings

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
import transformers
from IPython.display import display
from torch.nn.attention import SDPBackend, sdpa_kernel

from helpers import (
    accounting,
    batching,
    cleanup,
    data,
    estimates,
    gpus,
    measure,
    models,
    packing,
    profiler,
    prose,
    run_profile,
    steps,
    timing,
)
from helpers.measure import MIB

prof = env.start()  # plot style, number format, run profile; the table below names hardware and versions
dev = prof.device

# %% [markdown]
# As in chapter 8, the first cell that touches the GPU notes the allocated memory (nothing yet) for the
# final check, and picks [autocast](https://gpu-efficient-training.github.io/book/book/glossary.html#autocast)'s 16-bit type from the GPU's compute capability. It also keeps a time
# budget: the whole chapter is meant to run in a few minutes on one GPU, so the experiments charge their computing
# time to it, and the most expensive ones (the compilations) check what is left before they start.
#
# **How this chapter compares two ways of doing the same work** (chapter 8, section 8.1): `compare` below calls
# `timing.interleaved`, which times the baseline and the candidate in alternating rounds (A, B, B, A, …; 15 rounds
# after warm-up on a GPU), takes the speed-up of each round (the baseline's time over the candidate's: above 1, the
# candidate is faster) and reports their median with a 95% interval. A change counts as *faster* or *slower* only
# when the whole interval lies beyond ±3%; otherwise the verdict is *no practical difference*. Two samples of
# one round run milliseconds apart, so a host whose speed drifts (other processes, clocks) moves both alike: the
# ratio keeps what separate blocks of timings lose. Each comparison also profiles a few calls of each side for the
# GPU-busy fraction and the *kernel-time* speed-up, the ratio of the GPU's own work, which a change on the GPU side
# (precision, fused kernels, padding) alters whatever the host does.

# %%
cap = gpus.capability()
AMP = gpus.amp_dtype()
baseline_mib = torch.cuda.memory_allocated() / MIB if prof.on_gpu else 0.0
ROUNDS = prof.pick(tiny=10, full=timing.ROUNDS)  # rounds per comparison: 15 on a GPU, the minimum of 10 on a CPU
REPEAT = prof.pick(tiny=3, full=10)  # timed repeats of a single measurement: 10 on a GPU; a CPU run only checks the code
WARMUP = prof.pick(tiny=1, full=3)
BIG_GPU = prof.on_gpu and torch.cuda.get_device_properties(0).total_memory > 40 * 2**30  # room for larger batches
# Inductor's on-disk caches (FX graphs, Triton kernels) start empty in this process, so a machine that compiled
# these layers before does not report a shorter time than a reader's first run. The first compile below is cold;
# later ones may reuse kernels that earlier compiles built, and their rows say so.
os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-cache-")

# The chapter's time budget: the most expensive experiments (compilations) start only if the experiments before them
# left enough of it. It counts the seconds spent computing inside `charged()` blocks, not the time a reader spends
# between cells, so reading at human speed skips nothing; a slow GPU or CPU can skip rows, and the text says which.
budget = timing.Budget(260)
charged, seconds_left = budget.charged, budget.seconds_left  # the two calls the sections below make


findings, finding_cmps = [], []  # one row per comparison, and the comparison: the closing table of section 9.7


def kernel_verdict(c):
    """The ±3% rule applied to the kernel-time speed-up (the GPU's own work), for a change judged by GPU time.

    Used where the change is on the GPU's side but the step is not GPU-bound (section 9.2's padding): there the
    wall-clock ratio is the host's as much as the change's, and its verdict would follow the host from run to run.
    Falls back to the wall-clock verdict where no kernel time was profiled (a CPU run).
    """
    kr = c.kernel_ratio
    return timing.ratio_verdict(kr, kr) if kr is not None else c.verdict


def note_finding(technique, model, c, judged_on="wall time"):
    """Add one interleaved comparison (``timing.interleaved``) to the chapter's closing table; return it.

    ``judged_on``: ``"wall time"`` (the interval's verdict) or ``"kernel time"`` (``kernel_verdict``).
    """
    verdict = kernel_verdict(c) if judged_on == "kernel time" else c.verdict
    findings.append({"technique": technique, "model": model, "baseline": c.a_name, "candidate": c.b_name,
                     "baseline (ms)": c.a.wall.median * 1e3, "candidate (ms)": c.b.wall.median * 1e3,
                     "speed-up": c.speedup, "95% interval": f"{c.lo:.2f}–{c.hi:.2f}",
                     "kernel-time speed-up": c.kernel_ratio, "baseline GPU busy": c.a.gpu_busy, "verdict": verdict,
                     "judged on": judged_on})
    finding_cmps.append(c)
    return c


def plot_speedups(ax, comparisons, title, verdicts=None):
    """Speed-ups as points with their 95% intervals as whiskers; the band around 1 is the ±3% threshold.

    Points, not bars: on a log axis a bar would start at the axis' edge, not at 1. ``verdicts`` (label -> word)
    colours a point by another verdict than its wall-clock one (``kernel_verdict``).
    """
    labels = list(comparisons)
    y = np.arange(len(labels))
    cs = [comparisons[k] for k in labels]
    colors = {"faster": "C2", "slower": "C3", timing.NO_DIFFERENCE: "C7"}
    words = [(verdicts or {}).get(k, c.verdict) for k, c in zip(labels, cs, strict=True)]
    for yi, c, word in zip(y, cs, words, strict=True):
        ax.errorbar(c.speedup, yi, xerr=[[c.speedup - c.lo], [c.hi - c.speedup]], fmt="o", color=colors[word],
                    markersize=7, capsize=3)
    ax.axvspan(1 / (1 + timing.PRACTICAL_THRESHOLD), 1 + timing.PRACTICAL_THRESHOLD, color="0.85", zorder=0)
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_yticks(y, labels)
    ax.set_ylim(len(labels) - 0.5, -0.5)
    ax.set_xlabel("speed-up (baseline time / candidate time; whiskers: 95% interval; grey: ±3%)")
    ax.set_title(title)


def compare(fa, fb, names, **kw):
    """The chapter's comparison: ``fa`` (baseline) and ``fb`` (candidate) in alternating rounds (chapter 8)."""
    kw = {"rounds": ROUNDS, "warmup": WARMUP, **kw}
    return timing.interleaved(fa, fb, device=dev, names=names, **kw)


if cap is not None:
    print(f"{cap.name}: compute capability {cap.major}.{cap.minor}; autocast uses {AMP}; "
          f"FlashAttention {'supported' if cap.flash_attention else 'not supported (needs 8.0)'}")
else:
    print("CPU run: the models are tiny and autocast is off")

LM = "polyglot-ko-1.3b"  # sections 9.2 and 9.3 train it; a GPU too small for its states gets fewer of its layers
lm_layers = models.config(LM).num_hidden_layers
if prof.on_gpu:
    lm_meta = models.build(LM, head="causal-lm", device="meta")  # the structure only, to count parameters
    n_all, n_layer = models.n_params(lm_meta), models.n_params(lm_meta.gpt_neox.layers[0])
    per_param = sum(estimates.model_state_bytes(1, "fp32_adamw").values())  # weights, gradients, AdamW's moments
    room = 0.6 * torch.cuda.get_device_properties(0).total_memory  # the rest for activations and the allocator
    if per_param * n_all > room:
        lm_layers = max(1, int((room / per_param - (n_all - lm_layers * n_layer)) // n_layer))
        print(f"{LM}'s fp32 training states ({per_param * n_all / 1e9:.1f} GB) do not fit 60% of this GPU's memory: "
              f"sections 9.2 and 9.3 train the same architecture with {lm_layers} of its "
              f"{models.config(LM).num_hidden_layers} layers")
    del lm_meta
full_layers = models.config(LM).num_hidden_layers
LM_NAME = LM if lm_layers == full_layers else f"{LM} ({lm_layers} of {full_layers} layers)"  # tables' model column
LM_SHORT = "1.3B GPT-NeoX" if lm_layers == full_layers else f"GPT-NeoX ({lm_layers} of the 1.3B model's layers)"

# %% [markdown]
# ## 9.1 Attention kernels
#
# Attention computes `softmax(Q Kᵀ / √d) V` for every head. Written out in PyTorch, it materialises the
# score matrix `Q Kᵀ`, of size *s* × *s* per head and sequence, and keeps it (or the softmax of it) for the
# backward pass. This is what `attn_implementation="eager"` in transformers does, and it is the term
# `5·a·s²·b` bytes per layer of chapter 1's activation formula (Korthikanti et al. (2022), [references](https://gpu-efficient-training.github.io/book/book/references.html)):
# per score element, the softmax output (2 bytes, kept for the softmax's backward), its dropout mask (1 byte) and
# the dropout output (2 bytes, kept for the product with V). The scores themselves are not kept.
#
# ```python
# def eager_attention(q, k, v):                      # q, k, v: batch x heads x s x d
#     s = q.shape[-2]
#     scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
#     causal = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
#     probs = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1, dtype=torch.float32)
#     return probs.to(q.dtype) @ v
# ```
#
# A **fused** attention kernel computes the same result tile by tile in the GPU's on-chip memory and never
# writes the *s* × *s* matrix to GPU memory; the backward pass recomputes the tiles it needs from Q, K, V
# and one number per row (the softmax's log-sum-exp). This is FlashAttention (Dao et al. (2022); versions 2
# and 3, Dao (2024) and Shah et al. (2024), [references](https://gpu-efficient-training.github.io/book/book/references.html)), whose papers claim
# memory linear in *s* and a speed-up of several times over the written-out version. PyTorch's
# `F.scaled_dot_product_attention` ([SDPA](https://gpu-efficient-training.github.io/book/book/glossary.html#sdpa)) has four implementations ("backends"): flash, memory-efficient
# (from xFormers), cuDNN, and math (the written-out version in C++, which since PyTorch 2.5 computes 16-bit inputs
# in fp32 unless `torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)` is set, so it is slower than the
# 16-bit version written in Python). It takes the first in a priority list that
# supports the inputs; the list depends on the PyTorch version and the GPU (recent versions put cuDNN first
# on Hopper GPUs such as the H100; section 9.4 reads which kernel actually ran from the profiler).
# `torch.nn.attention.sdpa_kernel` restricts the choice:
#
# ```python
# from torch.nn.attention import SDPBackend, sdpa_kernel
# with sdpa_kernel(SDPBackend.FLASH_ATTENTION):       # raises if flash cannot run these inputs
#     out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
# ```
#
# **Which backend runs where.** We try each backend with each data type on a small input (forward and
# backward). The last column is what the backends' documented requirements say for Colab's T4 (compute
# capability 7.5).

# %%
SDPA_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "memory-efficient": SDPBackend.EFFICIENT_ATTENTION,
                 "cuDNN": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
REQUIREMENTS = {
    "flash": ("compute capability 8.0 or newer; fp16 and bf16 only; no arbitrary mask", "no"),
    "memory-efficient": ("compute capability 5.0 or newer; fp32, fp16 (bf16 from 8.0); arbitrary masks", "fp16 and fp32"),
    "cuDNN": ("compute capability 8.0 or newer and a recent cuDNN; fp16 and bf16", "no"),
    "math": ("any device and data type; stores the s x s matrix", "yes (the fallback)"),
}


def eager_attention(q, k, v):
    """Attention written out, as transformers' eager implementation does it (causal, softmax in fp32)."""
    s = q.shape[-2]
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    causal = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    probs = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1, dtype=torch.float32)
    return probs.to(q.dtype) @ v


def attention(impl):
    """The attention function of ``impl``: "eager" or one SDPA backend, forced with sdpa_kernel."""
    if impl == "eager":
        return eager_attention

    def sdpa(q, k, v):
        with sdpa_kernel(SDPA_BACKENDS[impl]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    return sdpa


def qkv(batch, heads, seq_len, head_dim, dtype, seed=0):
    gen = torch.Generator(device=dev).manual_seed(seed)
    return [torch.randn(batch, heads, seq_len, head_dim, device=dev, dtype=dtype, generator=gen).requires_grad_()
            for _ in range(3)]


def runs(impl, dtype):
    """Does ``impl`` run a small causal attention forward and backward in ``dtype`` here?"""
    q, k, v = qkv(1, 2, 64, 64, dtype)
    try:
        with warnings.catch_warnings():  # a backend that cannot run warns why, then raises
            warnings.simplefilter("ignore")
            attention(impl)(q, k, v).sum().backward()
        return "runs"
    except RuntimeError as err:
        return "not available" if "No available kernel" in str(err) or "not implemented" in str(err).lower() else str(err)[:60]


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
capability_table = pd.DataFrame({
    impl: {**{f"{name} here": runs(impl, dt) for name, dt in DTYPES.items()},
           "documented requirement": REQUIREMENTS[impl][0], "on a T4 (7.5)": REQUIREMENTS[impl][1]}
    for impl in SDPA_BACKENDS}).T.rename_axis(f"SDPA backend on {cap.name if cap else 'this CPU'}")
capability_table

# %% [markdown]
# **Time and memory against sequence length.** The sweep below keeps the tokens per batch fixed (batch ×
# sequence length constant), as a training run with a token budget per step does, and uses the 1.3B
# model's attention shape: 16 heads of dimension 128, causal (the tiny profile: 4 heads of 32). For each backend and length it times a forward
# and backward pass (`time_it`, 10 repeats on a GPU: one configuration's time, not yet a comparison), records the
# [peak allocated](https://gpu-efficient-training.github.io/book/book/glossary.html#peak-allocated-memory) memory above the inputs, and counts the bytes autograd saves for backward (chapter 1's
# `SavedTensorMeter`). The TFLOP/s column counts the causal product's useful work, 7·b·a·s²·d floating-point
# operations for forward and backward (the unmasked half of the two products, backward 2.5 times forward, the
# convention of the FlashAttention papers' benchmarks). A backend that cannot run is a "not available" row; one
# that runs out of memory is marked, not dropped. The comparisons the text quotes are then timed interleaved.

# %%
HEADS, HEAD_DIM = prof.pick(tiny=(4, 32), full=(16, 128))
TOKENS = prof.pick(tiny=256, full=16384)
SEQ_LENS = prof.pick(tiny=[32, 64, 128], full=[256, 512, 1024, 2048, 4096, 8192])
IMPLS = ["eager", *SDPA_BACKENDS]


def attention_flops(seq_len):
    """Useful FLOPs of a causal attention forward + backward at ``seq_len`` (batch = TOKENS // seq_len)."""
    return 7 * (TOKENS // seq_len) * HEADS * seq_len**2 * HEAD_DIM


def attention_call(impl, seq_len, dtype):
    """A forward + backward of ``impl`` at ``seq_len`` (batch = TOKENS // seq_len), or None if it cannot run.

    The callable's ``forward`` attribute runs the forward pass alone (for the saved-bytes meter)."""
    q, k, v = qkv(TOKENS // seq_len, HEADS, seq_len, HEAD_DIM, dtype)
    grad = torch.randn_like(q)
    fn = attention(impl)

    def fwd_bwd():
        q.grad = k.grad = v.grad = None
        fn(q, k, v).backward(grad)

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fwd_bwd()
    except RuntimeError as err:
        if measure.is_out_of_memory(err):
            raise
        return None
    q.grad = k.grad = v.grad = None
    fwd_bwd.forward = lambda: fn(q, k, v)
    return fwd_bwd


def attention_case(impl, seq_len, dtype):
    """Forward + backward of ``impl`` at ``seq_len``: time, TFLOP/s, peak, saved bytes."""
    fwd_bwd = attention_call(impl, seq_len, dtype)
    if fwd_bwd is None:
        return {"status": "not available"}
    meter = accounting.SavedTensorMeter()
    with meter:
        out = fwd_bwd.forward()
    del out
    peak_mib = np.nan
    if prof.on_gpu:
        measure.synchronize(dev)
        before = torch.cuda.memory_allocated()
        measure.reset_peak(dev)
        fwd_bwd()
        measure.synchronize(dev)
        peak_mib = (torch.cuda.max_memory_allocated() - before) / MIB
    t = timing.time_it(fwd_bwd, device=dev, warmup=WARMUP, repeat=REPEAT, busy=False)
    return {"status": "ok", "fwd+bwd median (ms)": t.wall.median * 1e3, "IQR (ms)": t.wall.iqr * 1e3, "repeats": REPEAT,
            "TFLOP/s": attention_flops(seq_len) / t.wall.median / 1e12,
            "peak above inputs (MiB)": peak_mib, "saved for backward (MiB)": meter.total_bytes / MIB}


def sweep(dtype, seq_lens, impls):
    rows = {}
    for impl in impls:
        for s in seq_lens:
            attempt = batching.try_batch(lambda _, impl=impl, s=s: attention_case(impl, s, dtype), 1)
            rows[(impl, s)] = attempt.value if attempt.fits else {"status": "out of memory"}
    return pd.DataFrame(rows).T.rename_axis(["implementation", "seq len"])


with charged():
    attn_table = sweep(AMP if prof.on_gpu else torch.float32, SEQ_LENS, IMPLS)
attn_table

# %%
fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.3))
mem_col = "peak above inputs (MiB)" if prof.on_gpu else "saved for backward (MiB)"
for i, impl in enumerate(IMPLS):
    rows = attn_table.loc[impl]
    ok = rows[rows["status"] == "ok"]
    label = impl if len(ok) else f"{impl} (not available here)"
    if len(ok):
        ax_t.plot(ok.index, ok["fwd+bwd median (ms)"].astype(float), "o-", color=f"C{i}", label=label)
        ax_m.plot(ok.index, ok[mem_col].astype(float), "o-", color=f"C{i}", label=label)
    oom = rows[rows["status"] == "out of memory"]
    for s in oom.index:
        ax_m.plot([s], [ax_m.get_ylim()[1] if len(ok) else 1], "x", color=f"C{i}", markersize=10, mew=2,
                  label=f"{impl}: out of memory")
b_of = {s: TOKENS // s for s in SEQ_LENS}
formula = [estimates.korthikanti_activation_bytes(s, b_of[s], HEADS * HEAD_DIM, HEADS)
           - estimates.korthikanti_activation_bytes(s, b_of[s], HEADS * HEAD_DIM, HEADS, attention="flash")
           for s in SEQ_LENS]
ax_m.plot(SEQ_LENS, np.array(formula) / MIB, "k--", label="formula's 5·a·s²·b term (one layer)")
for ax in (ax_t, ax_m):
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(SEQ_LENS, [str(s) for s in SEQ_LENS])
    ax.set_xlabel(f"sequence length (batch × length = {TOKENS:,} tokens)")
ax_t.set_ylabel("forward + backward time (ms, median of 10)")
ax_m.set_ylabel(("peak allocated above the inputs" if prof.on_gpu else "saved for backward") + " (MiB)")
slowest = attn_table[attn_table["status"] == "ok"]["fwd+bwd median (ms)"].astype(float).idxmax()
ax_t.set_title(f"time: slowest is {slowest[0]} at s = {slowest[1]}")
ax_m.set_title("memory at a fixed token count: an s x s term grows linearly in s")
ax_m.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1))
fig.suptitle(f"attention, {HEADS} heads of {HEAD_DIM}, causal, "
             + ("bf16" if AMP == torch.bfloat16 and prof.on_gpu else "fp16" if prof.on_gpu else "fp32 (CPU)"))
fig.tight_layout()

# %% [markdown]
# The plot's medians are single measurements, one configuration after another. The two comparisons the text
# below rests on are timed interleaved: written-out attention against the fastest fused kernel at the shortest
# length and at the longest length that written-out attention reached.

# %%
def fastest_fused(s_):
    """The fused backend with the smallest median at length ``s_`` (math and eager excluded), or None."""
    at = attn_table.xs(s_, level="seq len")
    ok = at[(at["status"] == "ok") & ~at.index.isin(["eager", "math"])]
    return ok["fwd+bwd median (ms)"].astype(float).idxmin() if len(ok) else None


attn_cmp = {}  # length -> Comparison of eager (baseline) against the fastest fused kernel there
eager_ok = [s_ for s_ in SEQ_LENS if attn_table.loc[("eager", s_), "status"] == "ok"]
if prof.on_gpu and eager_ok:
    with charged():
        for s_ in sorted({eager_ok[0], eager_ok[-1]}):
            best_ = fastest_fused(s_)
            if best_ is not None:
                fa, fb = attention_call("eager", s_, AMP), attention_call(best_, s_, AMP)
                attn_cmp[s_] = note_finding(f"fused attention ({best_}), forward + backward", f"attention, s = {s_:,}",
                                            compare(fa, fb, ("eager", best_)))
                del fa, fb
    display(timing.comparisons_table(attn_cmp).rename_axis("seq len"))
else:
    print("skipped on CPU: the comparisons of attention kernels are a GPU matter")


# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title The sentences under the attention sweep, from its table and the interleaved comparisons
def attention_text(table, cmp, mem_col, formula_mib, seq_lens, on_gpu=True):
    """The sentences under the attention sweep, from its table and the interleaved comparisons."""
    ok = table[table["status"] == "ok"]
    s_max = max(s_ for (_, s_) in ok.index)
    at_max = ok.xs(s_max, level="seq len")
    best = at_max["fwd+bwd median (ms)"].astype(float).idxmin()
    text = [f"At {s_max:,} tokens per sequence the fastest implementation is **{best}** "
            f"({at_max.loc[best, 'fwd+bwd median (ms)']:.1f} ms for a forward and backward pass, "
            f"{at_max.loc[best, 'TFLOP/s']:.0f} TFLOP/s)."]
    if "eager" not in at_max.index:
        reached = [s_ for (i, s_) in ok.index if i == "eager"]
        text.append(f"Written-out attention did not reach {s_max:,} ({table.loc[('eager', s_max), 'status']}"
                    + (f"; its longest length here is {max(reached):,}" if reached else "") + ").")
    lens = sorted(cmp)
    for s_ in lens:
        c = cmp[s_]
        text.append(f"At {s_:,}, {c.b_name} against written-out attention: {c.phrase(what='than eager')}.")
    if len(lens) == 2:
        lo_c, hi_c = cmp[lens[0]], cmp[lens[1]]
        tf_lo = ok.loc[(lo_c.b_name, lens[0]), "TFLOP/s"]
        tf_hi = ok.loc[(hi_c.b_name, lens[1]), "TFLOP/s"]
        if hi_c.lo > lo_c.hi:
            text.append(f"The advantage grows with the length, and not because eager's work grows faster: at a fixed "
                        f"token count the score elements, b·s² = tokens·s, grow linearly in s for every implementation "
                        f"alike. The fused kernels are inefficient at short lengths ({lo_c.b_name} runs at {tf_lo:.0f} "
                        f"TFLOP/s at {lens[0]:,}, {hi_c.b_name} at {tf_hi:.0f} TFLOP/s at {lens[1]:,}: the TFLOP/s "
                        f"column), and written-out attention moves the s x s matrix through memory several times.")
        elif hi_c.hi < lo_c.lo:
            text.append(f"The advantage shrinks with the length here ({lo_c.speedup:.1f}× at {lens[0]:,}, "
                        f"{hi_c.speedup:.1f}× at {lens[1]:,}).")
        else:
            text.append("The two intervals overlap: the advantage does not change with the length beyond the noise.")
    eager_rows = [s_ for (i, s_) in ok.index if i == "eager"]
    fused = [i for i in ok.index.get_level_values(0).unique() if i not in ("eager", "math")]
    if eager_rows and fused and on_gpu:
        s_m = max(eager_rows)
        at = ok.xs(s_m, level="seq len")
        mem_e = at.loc["eager", mem_col]
        term = formula_mib[seq_lens.index(s_m)]
        fused_mem = [at.loc[f, mem_col] for f in fused if f in at.index]
        text.append(f"Memory tells the clearer story. With the batch shrinking as the length grows, the fused "
                    f"kernels' peak stays flat ({min(fused_mem):,.0f} to {max(fused_mem):,.0f} MiB at {s_m:,} across "
                    f"{prose.listing(f for f in fused if f in at.index)}), while the written-out version's grows with "
                    f"the length ({mem_e:,.0f} MiB at {s_m:,}). The formula's s x s term for one layer is {term:,.0f} "
                    f"MiB at this length"
                    + (f"; the measured peak is {mem_e / term:.1f} times that, because this implementation keeps its "
                       f"softmax in fp32 (next cell) and its backward pass allocates further s x s temporaries, which "
                       f"the formula (bytes kept for backward) does not count." if mem_e > 1.5 * term else "."))
    return " ".join(text)


if prof.on_gpu and (attn_table["status"] == "ok").any():
    prose.say(attention_text(attn_table, attn_cmp, mem_col, [f / MIB for f in formula], SEQ_LENS))
else:
    print("skipped on CPU: kernel times and allocator peaks need a GPU (the table shows CPU times and saved bytes)")

# %% [markdown]
# **The saved bytes, element by element.** The "saved for backward" column is device-independent, so it
# can be checked against the formula exactly. The fused kernels save Q, K, V, the output and one log-sum-exp
# per row and head: no *s* × *s* term at all. The written-out version saves tensors of the size of the
# `b·a·s²` score matrix for its softmax and the product with V; per score element, how many bytes?

# %%
s_chk = SEQ_LENS[-2]
saved = attn_table.xs(s_chk, level="seq len")["saved for backward (MiB)"]
elements = TOKENS // s_chk * HEADS * s_chk**2
saved_ref = next((r for r in ("flash", "memory-efficient", "cuDNN") if r in saved and pd.notna(saved[r])), None)
per_element = {impl: (saved[impl] - saved[saved_ref]) * MIB / elements
               for impl in ("eager", "math") if saved_ref and impl in saved and pd.notna(saved[impl])}
pd.Series(per_element, name=f"extra bytes saved per score element, s = {s_chk}, vs {saved_ref}").to_frame()


# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title The saved-bytes sentence
def saved_bytes_text(per_element, ref, s_chk, sweep_dtype):
    """The saved-bytes sentence: measured bytes per score element against the formula and this implementation."""
    pe = per_element["eager"]
    text = (f"Written-out attention saves {pe:.2f} extra bytes per score element over {ref} at s = {s_chk}. Korthikanti "
            f"et al.'s formula counts 5: a 16-bit softmax output (2), its dropout mask (1) and the dropout output (2). ")
    if sweep_dtype != torch.float32:  # the GPU sweep: 16-bit inputs, softmax in fp32, then a 16-bit copy
        copy = torch.tensor([], dtype=sweep_dtype).element_size()
        expected = 4 + copy
        text += (f"This implementation has no dropout and keeps its softmax output in fp32 for the softmax's backward "
                 f"(4 bytes) and a {copy}-byte copy of it in the input's type for the product with V: {expected} bytes "
                 f"in all" + (", as measured. " if abs(pe - expected) < 0.25 else
                              f"; the measured {pe:.2f} differs from that by what the implementation keeps besides. "))
    text += ("The exact number depends on the implementation's types, but the term is real and grows as b·a·s²; the "
             "fused kernels remove it.")
    if "math" in per_element:
        text += f" The math backend saves {per_element['math']:.2f} extra bytes per element: it stores the matrix too."
    return text


if "eager" in per_element:
    prose.say(saved_bytes_text(per_element, saved_ref, s_chk, AMP if prof.on_gpu else torch.float32))
else:
    print("the comparison needs the eager row and a fused kernel's row; one of them did not run here")

# %% [markdown]
# **fp16 against bf16.** Both are 16-bit types with the same tensor-core speed on GPUs that have both; the
# kernels should not care. Each implementation at two lengths, bf16 against fp16 interleaved, checks that.

# %%
dtype_cmp = {}
if run_profile.cuda_or_skip("fp16 and bf16 attention kernels are a GPU matter") and cap.bf16:
    with charged():
        for impl in IMPLS:
            for s_ in (1024, 4096):
                fa = batching.try_batch(lambda _, i=impl, n=s_: attention_call(i, n, torch.bfloat16), 1)
                fb = batching.try_batch(lambda _, i=impl, n=s_: attention_call(i, n, torch.float16), 1)
                if fa.fits and fb.fits and fa.value is not None and fb.value is not None:
                    dtype_cmp[(impl, s_)] = compare(fa.value, fb.value, ("bf16", "fp16"), busy=False)
                del fa, fb
    if dtype_cmp:
        display(timing.comparisons_table(dtype_cmp).rename_axis(["implementation", "seq len"]))
elif prof.on_gpu:
    print("skipped: this GPU has no bf16 tensor cores, so the sweep above already ran in fp16")


# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title fp16 against bf16, from the interleaved comparisons
def dtype_text(cmp):
    """fp16 against bf16, from the interleaved comparisons: which cases differ beyond the noise."""
    differ = [f"{impl} at s = {s_} ({c.phrase()})" for (impl, s_), c in cmp.items() if c.verdict != timing.NO_DIFFERENCE]
    same = [k for k, c in cmp.items() if c.verdict == timing.NO_DIFFERENCE]
    lo = min(c.speedup for c in cmp.values())
    hi = max(c.speedup for c in cmp.values())
    if not differ:
        return (f"In every case that ran, fp16 and bf16 take the same time within the noise (speed-ups of fp16 over bf16 "
                f"between {lo:.2f} and {hi:.2f}, each interval within ±3%): the choice between them is about range and "
                f"loss scaling (chapter 5), not attention speed.")
    return (f"fp16 and bf16 show no practical difference in {len(same)} of the {len(cmp)} cases; fp16 differs in "
            f"these: {'; '.join(differ)}. Only {prose.listing(sorted({impl for (impl, _), c in cmp.items() if c.verdict != timing.NO_DIFFERENCE}))} "
            f"showed a difference here, so measure your own kernel and length before choosing on speed; the argument "
            f"from range and loss scaling (chapter 5) holds either way.")


if dtype_cmp:
    prose.say(dtype_text(dtype_cmp))

# %%
cleanup.collect()

# %% [markdown]
# ## 9.2 Padding, length grouping and packing
#
# Real documents have different lengths. A batch of them must be rectangular, so the simplest collator
# pads every document to the longest one in its batch; the model then computes on padding tokens and throws
# the results away. Two fixes:
#
# - **length grouping**: sort (or bucket) the documents by length before batching, so each batch holds
#   similar lengths (the Hugging Face `Trainer`'s `TrainingArguments(train_sampling_strategy="group_by_length")`;
#   in releases before the train-sampler unification, transformers PR #43138 in early 2026, the option was
#   `group_by_length=True`);
# - **packing**: concatenate several documents into one row of fixed length, so there is (almost) no padding.
#   Packing must keep the documents apart: a token may attend only to earlier tokens *of its own document*,
#   its position must count from its document's start, and the first token of a document must not be a
#   training target of the previous one.
#
# `helpers.packing` builds all three kinds of batches. Its packing gives each document position ids that
# restart at 0 and sets the first label of each document to -100:
#
# ```python
# for d in row:
#     ids += d
#     pos += list(range(len(d)))            # positions restart: the model sees each document from 0
#     labels += [-100] + d[1:]              # nothing predicts a document's first token
# batch = {"input_ids": ..., "position_ids": ..., "labels": ...}   # and no attention_mask
# loss = model(**batch, use_cache=False).loss
# ```
#
# transformers reads a restart in `position_ids`, when no `attention_mask` is given, as a document
# boundary and builds a block-diagonal causal mask for SDPA. Before trusting it, we check it: a tiny
# GPT-NeoX in fp32 on the CPU, three documents, each run alone and then packed into one row. If the
# boundaries leak, the logits of the second and third documents differ from their own. Three packed runs:
# with `use_cache=False`; with the model's defaults; and a naive concatenation whose positions do not
# restart, which shows that the check can fail.

# %%
tiny_lm = models.build("polyglot-ko-1.3b", profile="tiny", head="causal-lm", device="cpu").eval()
gen = np.random.default_rng(0)
check_docs = [gen.integers(100, 1000, size=n).tolist() for n in (7, 12, 5)]
packed = packing.pack_rows(check_docs, row_len=32, rows_per_batch=1)[0]
starts = np.cumsum([0] + [len(d) for d in check_docs])


def worst_difference(logits):
    """Largest |logit difference| between the packed row's documents and each document run alone."""
    return max((logits[a:b] - ref).abs().max().item() for a, b, ref in zip(starts, starts[1:], alone))


with torch.no_grad():
    alone = [tiny_lm(input_ids=torch.tensor([d]), use_cache=False).logits[0] for d in check_docs]
    ids, pos = packed["input_ids"], packed["position_ids"]
    leak = {
        "packed, use_cache=False": worst_difference(tiny_lm(input_ids=ids, position_ids=pos, use_cache=False).logits[0]),
        "packed, the model's defaults": worst_difference(tiny_lm(input_ids=ids, position_ids=pos).logits[0]),
        "naive concatenation (positions do not restart)": worst_difference(tiny_lm(input_ids=ids, use_cache=False).logits[0]),
    }
assert leak["packed, use_cache=False"] < 1e-4, "packed logits differ from the documents' own: the boundaries leak"
assert leak["naive concatenation (positions do not restart)"] > 1e-2, "the naive row should differ, or the check cannot fail"
pd.Series(leak, name="largest |logit difference| to each document run alone").to_frame()

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (9.2 Padding, length grouping and packing)
if leak["packed, the model's defaults"] > 1e-2:
    prose.say(
        "With `use_cache=False` the packed row reproduces every document's logits to float rounding: the boundaries "
        "hold. **With the model's defaults they do not**: the config's `use_cache=True` makes the model create a "
        "key-value cache for this forward pass (an evaluation pass here; transformers' masking code checks for a cache "
        "whatever the mode, so a training pass is no different), and it looks for packed documents in the position "
        "ids only when there is no cache. The documents then attend to each other and the logits differ as much as "
        "in the naive concatenation. Pass `use_cache=False` (or set `model.config.use_cache = False`) when training "
        "on packed rows, and check it as here: the failure is silent."
    )
else:
    prose.say(
        "The packed row reproduces every document's logits to float rounding, with `use_cache=False` and with the "
        "model's defaults: in this transformers version the boundaries hold either way. Passing `use_cache=False` "
        "for training costs nothing and protects against versions in which a cache disables the check."
    )

# %% [markdown]
# **The loss pitfall of chapter 3, again.** A packed row's loss is the mean over its labelled tokens, so a
# long document weighs more than a short one: it is the *token-weighted* mean, not the mean of the
# documents' own losses. Chapter 3 met the same difference with [gradient accumulation](https://gpu-efficient-training.github.io/book/book/glossary.html#gradient-accumulation). Neither is wrong, but
# switching from padded batches of one document (the per-document mean, if the loss is averaged per sample)
# to packing changes what is optimised.

# %%
with torch.no_grad():
    packed_loss = tiny_lm(**packed, use_cache=False).loss.item()
    per_doc = [tiny_lm(input_ids=torch.tensor([d]), labels=torch.tensor([d]), use_cache=False).loss.item()
               for d in check_docs]
weights = np.array([len(d) - 1 for d in check_docs])
token_weighted = float(np.dot(per_doc, weights) / weights.sum())
assert abs(packed_loss - token_weighted) < 1e-5, "the packed loss should be the token-weighted mean"
pd.Series({"packed row's loss": packed_loss, "token-weighted mean of the documents' losses": token_weighted,
           "plain mean of the documents' losses": float(np.mean(per_doc))}, name="loss (nats per token)").to_frame()

# %% [markdown]
# **What padding costs.** Now the three batchings of the same documents (lengths drawn from a long-tailed
# distribution, as real text is, up to 1,024 tokens; short ones in the tiny profile) through the 1.3B model (on a
# GPU too small for its training states, as many of its layers as fit: the setup cell prints how many), forward and
# backward in 16-bit autocast (bf16, or fp16 on a GPU without bf16). A pass over all the batches of one batching is
# one timed call. Two things are held equal so that only the padding differs: the **tokens** (every batching holds
# the same documents, so the ratio of two passes' times is the ratio of their *useful tokens per second*: document
# tokens, not padding, per second) and the **number of batches** (three each: `packing.pack_into` spreads the packed
# rows over as many batches as the padded set has). With fewer batches, packing would also save a call's fixed cost
# (launches, the host's work), which is not what padding costs. The padded pass is the baseline of two interleaved
# comparisons, against length grouping and against packing; the profiled calls also say which attention kernel ran.

# %%
def attention_kernels(p):
    """Which attention implementation a profile's kernels show: cuDNN, flash, memory-efficient or none."""
    names = " ".join(p.gpu_events["name"].unique())
    for label, pattern in (("cuDNN", r"cudnn"), ("flash", r"flash"), ("memory-efficient", r"fmha|efficient|mem_eff")):
        if pd.Series([names]).str.contains(pattern, case=False).iloc[0]:
            return label
    return "none (math: batched GEMMs and softmax)"


ROW = prof.pick(tiny=32, full=1024)
DOCS_PER_BATCH, N_BATCHES = prof.pick(tiny=4, full=8), 3
doc_lens = np.clip(np.random.default_rng(1).lognormal(math.log(ROW / 5), 0.9, size=DOCS_PER_BATCH * N_BATCHES)
                   .astype(int), 8, ROW)
docs = [np.random.default_rng(i).integers(100, 30000, size=n).tolist() for i, n in enumerate(doc_lens)]
pad_label, group_label = f"padded ({DOCS_PER_BATCH} documents per batch)", f"length-grouped ({DOCS_PER_BATCH} per batch)"
pack_label = f"packed (rows of {ROW})"
batchings = {pad_label: packing.pad_batches(docs, DOCS_PER_BATCH),
             group_label: packing.pad_batches(docs, DOCS_PER_BATCH, group_by_length=True),
             pack_label: packing.pack_into(docs, ROW, N_BATCHES)}
n_useful = int(doc_lens.sum())


def pass_over(model, batches):
    """One timed call: forward and backward over every batch of one batching."""
    batches = [{k: v.to(dev) for k, v in b.items()} for b in batches]

    def one_pass():
        for b in batches:
            with torch.autocast(dev, dtype=AMP, enabled=prof.on_gpu):
                loss = model(**b, use_cache=False).loss
            loss.backward()
        model.zero_grad(set_to_none=True)

    return one_pass


lm = models.build(LM, head="causal-lm", num_hidden_layers=lm_layers).train()
passes = {label: pass_over(lm, b) for label, b in batchings.items()}
pack_cmp = {}
with charged():
    for label in (group_label, pack_label) if prof.on_gpu else (pack_label,):  # a CPU run checks the code once
        attempt = batching.try_batch(
            lambda _, label=label: compare(passes[pad_label], passes[label], (pad_label, label), warmup=1), 1)
        if attempt.fits:
            pack_cmp[label] = note_finding(label.split(" (")[0], LM_NAME, attempt.value, judged_on="kernel time")
        else:
            print(f"{label}: out of memory on this GPU ({attempt.error})")
cleanup.free(globals(), "lm", "passes")
pack_rows_ = {}
for label, batches in batchings.items():
    if label == pad_label:
        t = next(iter(pack_cmp.values())).a if pack_cmp else None
    else:
        t = pack_cmp[label].b if label in pack_cmp else None
    pack_rows_[label] = {"batches": len(batches), "token slots": packing.slots(batches),
                         "padding (%)": 100 * (1 - n_useful / packing.slots(batches)),
                         "time per pass (ms)": t.wall.median * 1e3 if t else np.nan,
                         "ms per 1M document tokens": t.wall.median * 1e9 / n_useful if t else np.nan,
                         "useful tokens/s": n_useful / t.wall.median if t else np.nan,
                         "GPU busy": t.gpu_busy if t else None,
                         "GPU kernel time (ms)": t.kernel_s * 1e3 if t and t.kernel_s else None,
                         "attention kernel": attention_kernels(t.profile) if t and t.profile is not None else None}
pack_table = pd.DataFrame(pack_rows_).T
display(pack_table)
if pack_cmp:  # judged by the GPU's own work (kernel time); the wall clock's interval stands beside it
    display(timing.comparisons_table(pack_cmp).drop(columns="verdict")
            .assign(**{"verdict (kernel time)": [kernel_verdict(c) for c in pack_cmp.values()]})
            .rename_axis("against the padded batches"))

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 3.2), gridspec_kw={"width_ratios": [1.2, 1]})
y = np.arange(len(pack_table))
ax1.barh(y, pack_table["useful tokens/s"].astype(float).fillna(0) / 1e3, color=["C0", "C1", "C2"])
for yi, (_, row) in zip(y, pack_table.iterrows(), strict=True):
    ax1.text(np.nan_to_num(float(row["useful tokens/s"])) / 1e3, yi, f"  {row['padding (%)']:.0f}% padding", va="center")
ax1.set_yticks(y, pack_table.index)
ax1.invert_yaxis()
ax1.set_xlabel("useful tokens per second (thousands; forward + backward)")
ax1.set_xlim(right=ax1.get_xlim()[1] * 1.3)
ax1.set_title("same documents, same number of batches")
if pack_cmp:
    plot_speedups(ax2, {k.split(" (")[0]: c for k, c in pack_cmp.items()},
                  "wall clock against the padded batches\n(colour: the kernel-time verdict)",
                  verdicts={k.split(" (")[0]: kernel_verdict(c) for k, c in pack_cmp.items()})
fig.suptitle(prof.pick(tiny="tiny GPT-NeoX (CPU)", full=LM_SHORT) + ": what padding costs")
fig.tight_layout()


# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title What padding costs, from the table and the two interleaved comparisons
def packing_text(table, cmp, pad, group, pack):
    """What padding costs, from the table and the two interleaved comparisons."""
    base = next(iter(cmp.values())).a
    text = [f"Padding to the longest document of each batch wastes {table.loc[pad, 'padding (%)']:.0f}% of the token "
            f"slots; with length grouping the share is {table.loc[group, 'padding (%)']:.0f}%, with packing "
            f"{table.loc[pack, 'padding (%)']:.0f}%. At equal tokens and an equal number of batches, in useful tokens per "
            f"second:"]
    for label, c in cmp.items():
        slots_ratio = table.loc[pad, "token slots"] / table.loc[label, "token slots"]
        text.append(f"{label.split(' (')[0]}: the GPU's own work (kernel time) {c.kernel_ratio:.2f}× smaller, "
                    f"{kernel_verdict(c)}, for {slots_ratio:.2f} times fewer token slots; the wall clock "
                    f"{c.speedup:.2f}× (95% interval {c.lo:.2f}–{c.hi:.2f}×, {c.rounds} rounds).")
    text.append(f"The padded pass kept the GPU busy {prose.pct(base.gpu_busy)} of the time, with "
                f"{timing.us_per_launch(base):.0f} µs of host time per GPU operation; "
                + prose.listing(f"the {lbl.split(' (')[0]} pass {prose.pct(c.b.gpu_busy)}" for lbl, c in cmp.items())
                + ". The wall clock passes on the kernel-time saving only in the share of the pass where the GPU "
                "works; the launches, which do not shrink with the padding, fill the rest, and how much they fill "
                "depends on the CPU, so the wall-clock ratio moves with the host from run to run. This section therefore "
                "judges padding by kernel time, what removing it saves the GPU on any host; the wall clock gains most "
                "where the GPU is the limit (longer documents, larger batches, a slower GPU).")
    kernels = table["attention kernel"].dropna()
    if len(kernels):
        text.append("SDPA ran " + prose.listing(f"**{k}** for the {lbl.split(' (')[0]} batches" for lbl, k in kernels.items())
                    + ". Every batching hands it a mask (the padded ones their padding, the packed one the block-diagonal "
                      "mask transformers builds from the restarting position ids), and SDPA's flash backend takes no "
                      "arbitrary mask; FlashAttention's variable-length interface "
                      "(`attn_implementation=\"flash_attention_2\"` with the `flash-attn` package, not installed here) "
                      "skips the mask entirely.")
    text.append("Length grouping needs no change to the model, but makes batches less random: the `Trainer` groups "
                "within shuffled mega-batches for that reason.")
    return " ".join(text)


if prof.on_gpu and len(pack_cmp) == 2:
    prose.say(packing_text(pack_table, pack_cmp, pad_label, group_label, pack_label))
else:
    print("skipped on CPU: tokens per second of a tiny model on a CPU say little about a GPU")

# %% [markdown]
# ## 9.3 `torch.compile`
#
# `torch.compile(model)` traces the Python code of `forward` into graphs (TorchDynamo), derives the backward
# graph ahead of time (AOTAutograd), and generates fused kernels for the element-wise and normalisation
# parts with Triton (TorchInductor); matrix products still go to cuBLAS, and attention is meant to stay in
# the SDPA kernels (the category table below checks that it did, and section 9.4 probes a case where it does not).
# What it can buy: fewer passes over memory (fusion) and fewer kernel launches. What it costs: the
# compilation itself, at the first call and again whenever a guard fails (a new shape, a new dtype), and
# sometimes memory. Two modes are measured here (each starts only if the chapter's time budget allows it):
#
# - `default`: fusion only;
# - `reduce-overhead`: fusion, then the whole compiled graph is recorded as a CUDA graph and replayed,
#   which removes launch overhead (section 9.4 does the same by hand).
#
# `max-autotune` benchmarks several kernel variants per matrix product and, like `reduce-overhead`, replays
# CUDA graphs; it takes minutes per model,
# more than this chapter's budget, so it is left to an exercise.
#
# Both models use **regional compilation**: compile each transformer layer (`torch.compile(layer)`) instead of
# the whole model. All the layers of either model (24 each) run the same code, so TorchDynamo can compile it once and
# reuse it, as long as nothing that differs between layers is guarded on. A key-value cache is such a thing:
# with the config's default `use_cache=True`, the GPT-NeoX model builds a cache even in a training step and
# hands each layer its own entry, and every layer then recompiles. Training needs no cache, so `build` sets
# `model.config.use_cache = False`, and `compile_runs` asserts that the layers compiled fewer times than there
# are layers and never again while timed. Compile time is then that of one layer, and the embeddings, the
# masks, the final norm, the loss and the optimizer step stay eager: no row of this section compiles the whole
# training step (model and optimizer together), and `reduce-overhead` graphs only the layers.
#
# Each compile mode gets its own eager baseline, timed interleaved with it on the same weights, optimizer and
# batch: before each sample the model's layer list is set to the eager layers or to their compiled wrappers (which
# share the same parameters). Compile time is the first compiled step's time minus an eager step's. Inductor's
# on-disk caches are empty when the chapter starts (setup cell), so the first compile below is cold; a later one
# may reuse kernels that the compiles before it built, and its row names them. `reduce-overhead` runs first on bert-large, because it also removes launch
# overhead, which matters wherever the GPU waits for the host (the GPU-busy columns show how often it does).

# %%
SETUPS = {
    "bert-large-uncased": dict(head="sequence-classification", task="classification",
                               seq_len=prof.pick(tiny=64, full=512), batch=prof.pick(tiny=4, full=16)),
    "polyglot-ko-1.3b": dict(head="causal-lm", task="causal-lm",
                             seq_len=prof.pick(tiny=64, full=256), batch=prof.pick(tiny=4, full=8)),
}
STEP_AMP = AMP if prof.on_gpu else None  # autocast's type for the training steps (none on a CPU)


def build(name, **optimizer_kwargs):
    """Model ``name`` (fp32 weights, seeded) and an AdamW for it."""
    model = models.build(name, head=SETUPS[name]["head"], dtype=torch.float32,
                         **({"num_hidden_layers": lm_layers} if name == LM else {})).train()
    model.config.use_cache = False  # a training step needs no key-value cache (and a cache breaks regional compile)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-5, **optimizer_kwargs)


def make_batch(name, batch_size, seq_len=None):
    return steps.batch_for(SETUPS[name]["task"], batch_size, seq_len or SETUPS[name]["seq_len"], dev)


RECOMPILE_LIMIT = torch._dynamo.config.recompile_limit  # recompilations of one code object before it runs eagerly


def layers_of(model):
    """The transformer layers of a BERT or GPT-NeoX model: the unit of regional compilation."""
    return model.gpt_neox.layers if hasattr(model, "gpt_neox") else model.bert.encoder.layer


def set_layers(model, layers):
    """Put ``layers`` (the eager ones, or compiled wrappers of the same modules) in the model's layer list."""
    if hasattr(model, "gpt_neox"):
        model.gpt_neox.layers = layers
    else:
        model.bert.encoder.layer = layers


compiles_before = []  # the compiles this process ran before: Inductor keeps their kernels (section 9.3's rows)


def compile_runs(name, modes, budget_s):
    """Each compile mode against its own eager baseline (interleaved), on one model; compile costs and counters."""
    from torch._dynamo.utils import counters

    model, optimizer = build(name)
    batch = make_batch(name, SETUPS[name]["batch"])
    eager_layers = layers_of(model)
    eager_step = steps.make_step(model, optimizer, batch, amp=STEP_AMP)
    measure.reset_peak(dev)
    for _ in range(WARMUP):
        eager_step()
    measure.synchronize(dev)
    t0 = time.perf_counter()
    eager_step()
    measure.synchronize(dev)
    eager_s = time.perf_counter() - t0
    info = {"eager": {"peak allocated (GiB)": torch.cuda.max_memory_allocated() / 2**30}}
    results = {}
    for mode in modes:
        label = f"compiled ({mode})"
        if seconds_left() < budget_s[mode]:
            info[label] = {"note": f"skipped: {max(seconds_left(), 0):.0f} s of the chapter's time budget left, "
                                   f"{budget_s[mode]} s needed (the earlier sections used the rest)"}
            continue
        torch._dynamo.reset()  # each mode traces afresh; Inductor's kernel caches of earlier compiles stay
        counters.clear()
        caches = ("cold caches" if not compiles_before else
                  f"after {prose.listing(compiles_before)} in this process, whose kernels Inductor may reuse")
        compiled_layers = torch.nn.ModuleList(torch.compile(layer, mode=mode) for layer in eager_layers)
        compiled_step = steps.make_step(model, optimizer, batch, amp=STEP_AMP, new_graph_step=mode == "reduce-overhead")
        try:
            set_layers(model, compiled_layers)
            measure.synchronize(dev)
            t0 = time.perf_counter()
            compiled_step()
            measure.synchronize(dev)
            first_s = time.perf_counter() - t0
            compilations = counters["frames"]["ok"]  # TorchDynamo compilations: each code object, plus each recompile
            c = compare(eager_step, compiled_step, ("eager", label),
                        setup_a=lambda: set_layers(model, eager_layers),
                        setup_b=lambda layers=compiled_layers: set_layers(model, layers))
            set_layers(model, compiled_layers)
            gc.collect()
            torch.cuda.empty_cache()  # the reserved peak below is then this step's, not the earlier modes' leftovers
            measure.reset_peak(dev)
            compiled_step()  # one more compiled step alone, for its peak (the comparison mixed both sides)
            measure.synchronize(dev)
        except Exception as err:  # a compile that fails is a result too
            info[label] = {"note": f"failed: {type(err).__name__}: {str(err).splitlines()[0][:120]}"}
            continue
        finally:
            set_layers(model, eager_layers)
        results[label] = c
        compiles_before.append(f"{name}'s {mode} compile")
        info[label] = {"caches": caches, "peak allocated (GiB)": torch.cuda.max_memory_allocated() / 2**30,
                       "peak reserved (GiB)": torch.cuda.max_memory_reserved() / 2**30,
                       "compile time (s)": first_s - eager_s,
                       "compilations (first step)": compilations,
                       "recompilations while timed": counters["frames"]["ok"] - compilations,
                       "graph breaks": sum(counters["graph_break"].values())}
        n_layers = len(eager_layers)  # all layers run one code object: compiled once, not once per layer
        assert compilations < min(n_layers, RECOMPILE_LIMIT), (
            f"{name}: {compilations} compilations for {n_layers} layers (recompile limit {RECOMPILE_LIMIT}): a guard "
            f"differs between layers, and layers past the limit ran eagerly (TORCH_LOGS=recompiles names the guard)")
        assert info[label]["recompilations while timed"] == 0, f"{name}: recompiled during the timed steps"
        del compiled_layers, compiled_step
    return results, info


compiled = {}
if prof.on_gpu:
    with charged():
        compiled["bert-large-uncased"] = compile_runs("bert-large-uncased", ["reduce-overhead", "default"],
                                                      {"reduce-overhead": 40, "default": 30})
else:
    print("skipped on CPU: compiling takes minutes on a small CPU and its speed-ups are a GPU matter")

# %%
if prof.on_gpu:
    with charged():
        compiled["polyglot-ko-1.3b"] = compile_runs("polyglot-ko-1.3b", ["default"], {"default": 25})


def model_label(name):
    return LM_NAME if name == LM else name


def compile_table(results):
    rows = {}
    for name, (cmps, info) in results.items():
        for label, extra in info.items():
            if label == "eager":
                continue
            row = {}
            if label in cmps:
                c = cmps[label]
                row.update({"eager (ms)": c.a.wall.median * 1e3, "compiled (ms)": c.b.wall.median * 1e3,
                            "speed-up": c.speedup, "95% low": c.lo, "95% high": c.hi,
                            "verdict (kernel time)": kernel_verdict(c),
                            "kernel-time speed-up": c.kernel_ratio, "GPU busy eager": c.a.gpu_busy,
                            "GPU busy compiled": c.b.gpu_busy, "host enqueue eager (ms)": c.a.host.median * 1e3,
                            "host enqueue compiled (ms)": c.b.host.median * 1e3,
                            "kernels per step eager": c.a.kernels_per_call, "kernels per step compiled": c.b.kernels_per_call,
                            "peak eager (GiB)": info["eager"]["peak allocated (GiB)"]})
            row.update(extra)
            rows[(model_label(name), label)] = row
    return pd.DataFrame(rows).T.rename_axis(["model", "variant"])


if compiled:
    for name, (cmps, _) in compiled.items():
        for label, c in cmps.items():
            note_finding(f"torch.compile per layer, {label.split('(')[1].rstrip(')')}", model_label(name), c,
                         judged_on="kernel time")
    compile_tab = compile_table(compiled)
    torch._dynamo.reset()  # compiled code can keep its model alive; the results are all in the tables now
    cleanup.collect()
    with pd.option_context("display.max_columns", None):
        display(compile_tab)

# %% [markdown]
# Where did the time go? The profiler's category table of each side (GPU time per step, milliseconds):

# %%
if compiled and any(cmps for cmps, _ in compiled.values()):
    cat_frames = {}
    for name, (cmps, _) in compiled.items():
        for label, c in cmps.items():
            mode = label.split("(")[1].rstrip(")")
            cat_frames[(name[:10], f"eager (vs {mode})")] = c.a.profile.categories().iloc[:, 0]
            cat_frames[(name[:10], mode)] = c.b.profile.categories().iloc[:, 0]
    compile_cats = pd.DataFrame(cat_frames).fillna(0.0)
    display(compile_cats.rename_axis("GPU time per step (ms)"))

# %%
compile_cmp = {f"{name.split('-')[0]}, {label.split('(')[1].rstrip(')')}": c
               for name, (cmps, _) in compiled.items() for label, c in cmps.items()}
if compile_cmp:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 3.8))
    plot_speedups(ax1, compile_cmp, "wall clock, compiled step against eager\n(colour: the kernel-time verdict)",
                  verdicts={k: kernel_verdict(c) for k, c in compile_cmp.items()})
    y = np.arange(len(compile_cmp))
    ax2.barh(y - 0.2, [c.a.gpu_busy * 100 for c in compile_cmp.values()], height=0.4, color="C0", label="eager")
    ax2.barh(y + 0.2, [c.b.gpu_busy * 100 for c in compile_cmp.values()], height=0.4, color="C1", label="compiled")
    ax2.set_yticks(y, list(compile_cmp))
    ax2.invert_yaxis()
    ax2.set_xlim(0, 105)
    ax2.set_xlabel("GPU busy (% of the step)")
    ax2.set_title("how much of the step the GPU worked")
    ax2.legend(loc="lower right")
    fig.suptitle(f"torch.compile per layer, {'bf16' if AMP == torch.bfloat16 else 'fp16'} autocast: bert-large (batch "
                 f"{SETUPS['bert-large-uncased']['batch']} x {SETUPS['bert-large-uncased']['seq_len']}), {LM_SHORT} "
                 f"(batch {SETUPS['polyglot-ko-1.3b']['batch']} x {SETUPS['polyglot-ko-1.3b']['seq_len']})")
    fig.tight_layout()


# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title The bullet of one compiled row
def compile_lines(model, label, c, row, cats_e, cats_c, eager_peak):
    """The bullet of one compiled row: cost, the GPU's own work (the verdict), the wall clock beside it, and why.

    Compilation fuses kernels: the change is on the GPU's side, so the row is judged by kernel time. The wall clock's
    ratio is given with its interval but no verdict word: these steps keep the GPU busy between about half and nine
    tenths of the time, a share that moved by 10 to 20 points between two runs on one kind of host, and the wall
    clock follows the host's launches in the rest.
    """
    ew = "element-wise / normalisation"
    kr = c.kernel_ratio
    host_ratio = c.a.host.median / c.b.host.median
    lines = [
        f"- **{model}, {label}**: compiling took {row['compile time (s)']:.0f} s ({row.get('caches', 'cold caches')}). "
        f"The GPU's own work (kernel time) is {kr:.2f}× smaller, {kernel_verdict(c)} (element-wise and normalisation "
        f"kernels {cats_c.get(ew, 0):.1f} ms against {cats_e.get(ew, 0):.1f} ms); by the wall clock, "
        f"{prose.ms(c.b.wall.median)} a step against {prose.ms(c.a.wall.median)}, {c.speedup:.2f}× (95% interval "
        f"{c.lo:.2f}–{c.hi:.2f}×, {c.rounds} rounds). GPU busy {prose.pct(c.b.gpu_busy)} (eager "
        f"{prose.pct(c.a.gpu_busy)}); {c.b.kernels_per_call:,} GPU operations per step (eager "
        f"{c.a.kernels_per_call:,}); "
        + (f"peak allocated {row['peak allocated (GiB)']:.2f} GiB outside the CUDA graphs' private memory pool, which "
           f"holds the replayed step's activations and which this reading leaves out (peak reserved "
           f"{row.get('peak reserved (GiB)', float('nan')):.2f} GiB; eager allocated {eager_peak:.2f} GiB); "
           if "reduce-overhead" in label else
           f"peak {row['peak allocated (GiB)']:.2f} GiB (eager {eager_peak:.2f} GiB); ")
        + f"{row['compilations (first step)']} TorchDynamo compilation(s) for the first step, "
        f"{row['recompilations while timed']} while timed, {row['graph breaks']} graph break(s)."]
    att_e, att_c = cats_e.get("attention", 0.0), cats_c.get("attention", 0.0)
    gemm_e, gemm_c = cats_e.get("GEMM", 0.0), cats_c.get("GEMM", 0.0)
    if att_e > 0.5 and att_c < 0.05 * att_e:
        lines.append(
            f"  **Attention fell back to matrix products**: attention kernels took {att_e:.1f} ms eager and "
            f"{att_c:.1f} ms compiled, while the GEMM time went from {gemm_e:.1f} to {gemm_c:.1f} ms. The compiled "
            f"step computes attention as batched products and a softmax, the slow path of section 9.1 (section "
            f"9.4 probes why).")
    elif kernel_verdict(c) != "faster":
        lines.append(
            f"  Its kernels take about as long as eager's (GEMM {gemm_e:.1f} against {gemm_c:.1f} ms, attention "
            f"{att_e:.1f} against {att_c:.1f} ms): the time is in matrix products and attention kernels, which "
            f"compilation does not replace.")
    else:
        graph = (" Replaying the compiled code from a CUDA graph removes the per-kernel launches, which is why this "
                 "mode's host time falls furthest." if "reduce-overhead" in label else
                 " Replaying the compiled code from a CUDA graph (`reduce-overhead`) would remove those launches too.")
        lines.append(
            f"  The wall clock mixes two savings: the GPU's work ({kr:.2f}×) and the host's, whose enqueue time fell "
            f"{host_ratio:.2f}× ({prose.ms(c.a.host.median)} to {prose.ms(c.b.host.median)}, with fewer GPU operations). "
            f"In the share of the step where the GPU is busy the first one shows, in the rest the second, so the "
            f"reader's CPU decides how much of the kernel saving reaches the wall clock." + graph)
    opt_ms = cats_c.get("optimizer", 0.0)
    if opt_ms > 0:
        lines.append(
            f"  The optimizer step is not compiled here (only the layers are): its kernels took {opt_ms:.1f} ms "
            f"of GPU time per step ({opt_ms / max(cats_c.sum(), 1e-9):.0%} of the compiled step's kernel time), "
            f"as in eager mode ({cats_e.get('optimizer', 0.0):.1f} ms).")
    return lines


if compiled:
    lines = []
    for name, (cmps, info) in compiled.items():
        for label, row in info.items():
            if label == "eager":
                continue
            if label not in cmps:
                lines.append(f"- **{model_label(name)}, {label}**: {row['note']}.")
                continue
            mode = label.split("(")[1].rstrip(")")
            lines += compile_lines(model_label(name), label, cmps[label], row,
                                   compile_cats[(name[:10], f"eager (vs {mode})")], compile_cats[(name[:10], mode)],
                                   info["eager"]["peak allocated (GiB)"])
    prose.say("\n".join(lines))
else:
    print("skipped on CPU: no compilation ran")

# %% [markdown]
# *Why per layer, and not the whole model.* Compiling bert-large whole also traces transformers' code that
# builds the attention mask. In the transformers version of this book's run (the setup cell prints it), that code drops the mask (so
# that SDPA may pick any fused kernel) only when it is *not* tracing, and it counts `torch.compile` and
# CUDA-graph capture as tracing (`transformers.utils.import_utils.is_tracing`): under tracing it hands SDPA a
# mask even for a batch without padding, and for a call with no `attention_mask` at all it builds that mask as an
# expanded view that the fused kernels cannot take (section 9.4 prints its strides). Other transformers versions
# may build the mask differently; section 9.4's probe shows what yours does. Compiled per layer, the mask is built
# eagerly, outside the compiled region, in every version. Section 9.4 tests, on a bare SDPA call and on a small BERT, whether a mask under
# compilation or capture is what costs the fused kernel.
#
# *What was not compiled.* In every compiled row only the transformer layers are compiled: the embeddings, the
# loss and `optimizer.step()` run eagerly (the rendered lines above give the optimizer's kernel time). This
# chapter does not measure compiling the whole training step, forward, backward and optimizer in one compiled
# function; exercise 2 starts on it.

# %% [markdown]
# **Recompilation when the sequence length changes.** A compiled graph is specialised to its input shapes
# and protected by *guards*; a call whose shapes fail the guards compiles again. With `dynamic=False` every
# new sequence length compiles a new graph; by default (`dynamic=None`) the first change triggers one
# recompilation that marks the changed dimension as symbolic ("automatic dynamic shapes"), and later lengths
# reuse it; `dynamic=True` compiles a symbolic graph from the start. Counted here on one bert-large layer
# (forward only, to keep compile times short) with TorchDynamo's compile counter:
#
# ```python
# counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
# layer_c = torch.compile(layer, backend=counter, dynamic=False)
# ... counter.frame_count   # graphs compiled since the reset: each compilation of the layer adds one or more graphs
# ```
#
# The table's "compiled a graph" column is what counts as a (re)compilation; the cumulative count of graphs grows
# by more than one per compilation when the layer's code is split into several graphs, and
# `torch._dynamo.explain(layer)(x)`, printed under the table, says into how many and why (this forward-only call
# on a bare `BertLayer` is not the training step of the rows above, whose counters are in their table).

# %%
recompiles = None
if not prof.on_gpu:
    print("skipped on CPU: compiling takes minutes on a small CPU")
elif seconds_left() < 30:
    print(f"skipped: {max(seconds_left(), 0):.0f} s of the chapter's time budget left, 30 s needed for six more "
          f"compilations (the earlier sections used the rest)")
else:
    from torch._dynamo.testing import CompileCounterWithBackend
    from transformers.models.bert.modeling_bert import BertLayer

    layer_cfg = models.config("bert-large-uncased")
    layer = BertLayer(layer_cfg).to(dev).eval()
    rows, explained = {}, None
    with charged():
        try:
            for dynamic in (False, None, True):
                torch._dynamo.reset()
                counter = CompileCounterWithBackend("inductor")
                layer_c = torch.compile(layer, backend=counter, dynamic=dynamic)
                for s in (128, 256, 512):
                    x = torch.randn(8, s, layer_cfg.hidden_size, device=dev)
                    with torch.no_grad(), torch.autocast("cuda", dtype=AMP):
                        before = counter.frame_count
                        measure.synchronize(dev)
                        t0 = time.perf_counter()
                        layer_c(x)
                        measure.synchronize(dev)
                    rows[(f"dynamic={dynamic}", s)] = {"compiled a graph": counter.frame_count > before,
                                                       "first call (s)": time.perf_counter() - t0,
                                                       "graphs compiled for this setting": counter.frame_count}
            recompiles = pd.DataFrame(rows).T.rename_axis(["setting", "seq len"])
            torch._dynamo.reset()
            with torch.no_grad(), torch.autocast("cuda", dtype=AMP):
                explained = torch._dynamo.explain(layer)(torch.randn(8, 512, layer_cfg.hidden_size, device=dev))
        except Exception as err:  # a compiler that cannot run here is a result too
            print(f"compilation failed: {type(err).__name__}: {str(err).splitlines()[0][:120]}")
    torch._dynamo.reset()
    cleanup.free(globals(), "layer", "layer_c", "x")
    if recompiles is not None:
        display(recompiles)
    if explained is not None:
        reasons = list(dict.fromkeys(str(getattr(r, "reason", r)).splitlines()[0][:100] for r in explained.break_reasons))
        print(f"torch._dynamo.explain, one call at 512 tokens: {explained.graph_count} graph(s), "
              f"{explained.graph_break_count} graph break(s)" + (": " + "; ".join(reasons[:3]) if reasons else ""))

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (9.3 torch.compile)
if recompiles is not None:
    n = recompiles["compiled a graph"].astype(bool).groupby(level="setting").sum()
    cost = recompiles.loc[recompiles["compiled a graph"].astype(bool), "first call (s)"].astype(float)
    prose.say(
        f"Of the three lengths, {n['dynamic=False']} triggered a compilation with `dynamic=False`, {n['dynamic=None']} by "
        f"default and {n['dynamic=True']} with `dynamic=True`; a call that compiled took {cost.min():.1f} to "
        f"{cost.max():.1f} s, one that did not a fraction of a second (a shape that an earlier setting already compiled "
        f"can be served from Inductor's on-disk cache and take less). With variable-length "
        f"batches, either pad to a few fixed lengths (buckets) and accept one compilation per bucket, or let "
        f"automatic dynamic shapes settle after the first change. "
        f"`TORCH_LOGS=recompiles` prints the failing guard of every recompilation, and TorchDynamo stops "
        f"recompiling a function (a code object) after `torch._dynamo.config.recompile_limit` recompilations "
        f"({RECOMPILE_LIMIT} in this PyTorch; `cache_size_limit` is its older name) and runs it eagerly from then on, "
        f"slower, with one warning in the log that is easy to miss: with 24 layers sharing one code object, that "
        f"limit is how a per-layer compile can end up compiling only some of its layers."
    )

# %% [markdown]
# ## 9.4 CUDA graphs for a host-bound step
#
# Chapter 8 found bert-large at batch 4 host-bound: the CPU needs longer to launch the step's thousands of
# kernels than the GPU needs to run them. A CUDA graph records the step once and replays it with one launch
# (chapter 8 showed the recipe: a capturable AdamW, static inputs, warm-up on a side stream). Chapter 8 passed
# the batch's all-ones attention mask, and its replay kept a fused attention kernel. Here we ask which SDPA backend runs inside
# a captured step, by reading the kernel names in the profile, first on a bare SDPA call (bert-large's
# attention shape: batch 4, 16 heads, 512 tokens, head dimension 64) with and without dropout, then on the
# model.

# %%
def captured(fn, warmup=3, before_capture=None):
    """Capture ``fn`` into a CUDA graph after a side-stream warm-up (chapter 8's recipe); return the graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    if before_capture is not None:
        before_capture()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


sdpa_probe = None
if run_profile.cuda_or_skip("CUDA graphs need a GPU"):
    q, k, v = qkv(4, 16, 512, 64, AMP)
    rows = {}
    for p_drop in (0.0, 0.1):
        def fwd_bwd(p_drop=p_drop):
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=p_drop)
            out.backward(torch.ones_like(out))
        rows[(p_drop, "eager")] = attention_kernels(profiler.profile(fwd_bwd, device=dev))
        try:
            graph = captured(fwd_bwd)
            rows[(p_drop, "CUDA graph")] = attention_kernels(profiler.profile(graph.replay, device=dev))
            del graph
        except RuntimeError as err:
            rows[(p_drop, "CUDA graph")] = f"capture failed: {str(err).splitlines()[0][:80]}"
    sdpa_probe = pd.Series(rows, name="attention kernel seen").to_frame().rename_axis(["dropout", "run"])
    cleanup.free(globals(), "q", "k", "v")
    display(sdpa_probe)

# %% [markdown]
# **Does a mask cost the fused kernel under compilation or capture?** Section 9.3 explained why a compiled or
# captured BERT may hand SDPA a mask even when nothing is padded. Two probes separate the possible causes, reading the
# kernel names as above. First the bare SDPA call (same shape, no dropout) with no mask, an all-True boolean
# mask of shape [b, 1, s, s] and an all-zero additive mask of that shape, each eager, compiled
# (`torch.compile` of the call) and captured in a CUDA graph. Then the forward pass of a two-layer BERT with
# bert-large's layer shape (the attention path is the same in every layer), called with `attention_mask=None`,
# with an all-ones padding mask and with a real padding mask (the last 64 tokens padded), eager, compiled whole
# and captured.

# %%
mask_probe = None
if run_profile.cuda_or_skip("the kernel names under compilation and capture need a GPU"):
    pb, ps = 4, 512
    q, k, v = qkv(pb, 16, ps, 64, AMP)
    sdpa_masks = {"no mask": None,
                  "all-True boolean [b,1,s,s]": torch.ones(pb, 1, ps, ps, dtype=torch.bool, device=dev),
                  "all-zero additive [b,1,s,s]": torch.zeros(pb, 1, ps, ps, dtype=AMP, device=dev)}

    def sdpa_call(q, k, v, m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m)

    sdpa_compiled = torch.compile(sdpa_call, dynamic=False)
    rows = {}

    def kernel_after_warmup(fn):
        fn()  # compiles, where the function is compiled, outside the profile
        measure.synchronize(dev)
        return attention_kernels(profiler.profile(fn, device=dev))

    def kernel_captured(fn):
        try:
            graph = captured(fn)
            found = attention_kernels(profiler.profile(graph.replay, device=dev))
            del graph
            return found
        except RuntimeError as err:
            return f"capture failed: {str(err).splitlines()[0][:80]}"

    for mname, m in sdpa_masks.items():
        def fwd_bwd(fn=sdpa_call, m=m):
            out = fn(q, k, v, m)
            out.backward(torch.ones_like(out))
        rows[("bare SDPA, fwd+bwd", mname, "eager")] = kernel_after_warmup(fwd_bwd)
        rows[("bare SDPA, fwd+bwd", mname, "compiled")] = kernel_after_warmup(lambda m=m: fwd_bwd(sdpa_compiled, m))
        rows[("bare SDPA, fwd+bwd", mname, "CUDA graph")] = kernel_captured(fwd_bwd)
    cleanup.free(globals(), "q", "k", "v")

    small_bert = models.build("bert-large-uncased", num_hidden_layers=2, device=dev).eval()
    small_compiled = torch.compile(small_bert, dynamic=False)
    probe_ids = torch.randint(1000, 2000, (pb, ps), device=dev)
    padded = torch.ones(pb, ps, dtype=torch.long, device=dev)
    padded[:, -64:] = 0
    bert_masks = {"attention_mask=None": None, "all-ones padding mask": torch.ones_like(probe_ids),
                  "padding mask (last 64 tokens padded)": padded}
    for mname, m in bert_masks.items():
        def bert_fwd(mod=small_bert, m=m):
            with torch.no_grad(), torch.autocast("cuda", dtype=AMP, cache_enabled=False):
                return mod(input_ids=probe_ids, attention_mask=m).last_hidden_state
        rows[("2-layer BERT, forward", mname, "eager")] = kernel_after_warmup(bert_fwd)
        rows[("2-layer BERT, forward", mname, "compiled")] = kernel_after_warmup(lambda m=m: bert_fwd(small_compiled, m))
        rows[("2-layer BERT, forward", mname, "CUDA graph")] = kernel_captured(bert_fwd)

    # The evidence for the why: the mask the first attention layer receives, eager and while captured (transformers
    # counts capture as tracing, as it counts compilation). Not hooked while compiled: a hook would change the graph.
    seen_masks, current = {}, [None]

    def record_mask(module, args, kwargs):
        m_ = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        run = "CUDA graph (capture)" if torch.cuda.is_current_stream_capturing() else "eager"
        seen_masks[(current[0], run)] = ("None" if m_ is None else f"{tuple(m_.shape)}, strides {tuple(m_.stride())}, "
                                         f"{str(m_.dtype).replace('torch.', '')}")

    first_attn = next(mod for mod in small_bert.modules() if type(mod).__name__.endswith("SelfAttention"))
    handle = first_attn.register_forward_pre_hook(record_mask, with_kwargs=True)
    try:
        for mname, m in bert_masks.items():
            current[0] = mname
            kernel_captured(lambda m=m: bert_fwd(small_bert, m))  # eager warm-up calls, then the capture
    finally:
        handle.remove()
    mask_strides = (pd.Series(seen_masks, name="mask the first attention layer receives").unstack()
                    .rename_axis("attention_mask passed")) if seen_masks else None
    torch._dynamo.reset()
    freed = cleanup.free(globals(), "small_bert", "small_compiled", "sdpa_compiled", "probe_ids", "padded",
                         "sdpa_masks", "bert_masks", "bert_fwd", "fwd_bwd", "kernel_captured", "kernel_after_warmup",
                         "sdpa_call", "m", "first_attn", "handle", "record_mask")
    assert not freed.still_alive, f"still held elsewhere: {freed.still_alive}"
    mask_probe = (pd.Series(rows, name="attention kernel seen").unstack(-1)[["eager", "compiled", "CUDA graph"]]
                  .rename_axis(["call", "mask"]))
    display(mask_probe)
    if mask_strides is not None:
        with pd.option_context("display.max_colwidth", None):  # shape, strides and dtype whole, not cut at 50 characters
            display(mask_strides)

# %% [markdown]
# *Reading the second table.* A [b, 1, s, s] mask laid out in memory has the strides (s·s, s·s, s, 1), here
# 262144 = 512 × 512, then 512 and 1. A stride of 0 means an expanded view: one row repeated without being stored,
# which the fused kernels refuse (they need the last dimension contiguous). Where no fused kernel runs, SDPA's math
# path does, and it computes 16-bit inputs in fp32 (section 9.1): that fp32 matrix product is also why Inductor may
# warn above that TF32 is not enabled.

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (9.4 CUDA graphs for a host-bound step)
if mask_probe is not None:
    def is_fused(label):
        return not (label.startswith("none") or label.startswith("capture failed"))  # a failed capture: no evidence

    failed = [f"{call} with {mask}" for (call, mask), row in mask_probe.iterrows() for run, v in row.items()
              if v.startswith("capture failed")]
    lost = [f"{call} with {mask}, {run}" for (call, mask), row in mask_probe.iterrows() for run, v in row.items()
            if v.startswith("none")]
    text = [("No fused attention kernel ran in: " + "; ".join(lost) + ". Every other case ran a fused kernel"
             + (" or failed to capture." if failed else "."))
            if lost else "No case that ran lacked a fused attention kernel."]
    if failed:
        text.append("The capture failed for: " + "; ".join(failed) + " (the table gives the error).")
    bare = mask_probe.loc["bare SDPA, fwd+bwd"]
    bare_nomask_ok = all(is_fused(v) for v in bare.loc["no mask"])
    bare_mask_lost = [m for m in bare.index if m != "no mask" and any(v.startswith("none") for v in bare.loc[m])]
    if bare_nomask_ok and bare_mask_lost:
        text.append("On the bare call, the mask is what matters: without one every run keeps a fused kernel, with "
                    f"{' and '.join(bare_mask_lost)} some run does not.")
    elif bare_nomask_ok and not bare_mask_lost:
        text.append("On the bare call an all-ones mask keeps a fused kernel eager, compiled and captured, so a mask as "
                    "such is not the cause at the level of SDPA.")
    bert = mask_probe.loc["2-layer BERT, forward"]
    none_ok = all(is_fused(bert.loc["attention_mask=None", r]) for r in ("compiled", "CUDA graph"))
    ones_lost = [r for r in ("compiled", "CUDA graph") if bert.loc["all-ones padding mask", r].startswith("none")]
    if none_ok and ones_lost:
        text.append(f"In BERT, `attention_mask=None` keeps a fused kernel compiled and captured, while an all-ones "
                    f"padding mask loses it ({', '.join(ones_lost)}): the mask that transformers keeps while tracing is "
                    f"the route to the slow path. A batch without padding can be called with no mask, or the model compiled "
                    f"per layer (section 9.3), where transformers builds the mask eagerly and drops an all-ones one.")
    elif any(bert.loc["attention_mask=None", r].startswith("none") for r in ("compiled", "CUDA graph")):
        none_lost = [r for r in ("compiled", "CUDA graph") if bert.loc["attention_mask=None", r].startswith("none")]
        ones_kept = [r for r in none_lost if is_fused(bert.loc["all-ones padding mask", r])]
        if ones_kept:
            text.append(f"In BERT it is the other way round: `attention_mask=None` loses the fused kernel "
                        f"({', '.join(none_lost)}), while an explicit all-ones padding mask keeps it "
                        f"({', '.join(ones_kept)}). That is a property of transformers {transformers.__version__}, not of "
                        f"SDPA: the second table shows the mask the attention layer receives. Where a mask is given "
                        f"while capturing although none was passed, transformers has built an all-True one instead of "
                        f"dropping it; a stride of 0 in its last dimension means an expanded view, not a tensor in "
                        f"memory, and the fused kernels need that dimension contiguous. Other transformers versions "
                        f"may return no mask in this case, and there passing an all-ones mask would only add one. So "
                        f"with your version, read the kernel names, as here, before choosing; the CUDA-graph step below "
                        f"tests the explicit mask on a full training step.")
        else:
            text.append("In BERT, both `attention_mask=None` and an explicit all-ones mask lose the fused kernel "
                        "under compilation or capture, so the mask is not the whole cause there.")
    prose.say(" ".join(text))

# %% [markdown]
# Now the whole bert-large step at batch 4: eager, against the same step replayed from a CUDA graph. Here the host
# *is* the lesson: the graph removes the CPU's launches, so its gain depends on how fast this machine's CPU launches
# kernels (the text below gives the µs per launch). The batch has no padding and, like the batches of
# sections 9.3 and 9.6, no `attention_mask`. Two more captures test the probes: the same graph with the batch's
# all-ones `attention_mask` passed explicitly (also timed against eager), and the graph without a mask but with the
# attention dropout set to 0 while capturing (`attention_probs_dropout_prob`; the other dropouts stay), read for
# its kernel names only. Each captured graph is compared with the eager step in alternating rounds; both update
# the same weights, the eager step with its own AdamW and the graph with a capturable one.

# %%
def graph_runs(batch_size):
    model, optimizer = build("bert-large-uncased")
    batch = make_batch("bert-large-uncased", batch_size)
    eager_step = steps.make_step(model, optimizer, batch, amp=STEP_AMP)
    graph_opt = torch.optim.AdamW(model.parameters(), lr=1e-5, capturable=True)
    inputs = batch
    attn_dropouts = [m.dropout for m in model.modules() if type(m).__name__ == "BertSelfAttention"]

    def step_for_graph():
        with torch.autocast("cuda", dtype=AMP, cache_enabled=False):
            loss = model(**inputs).loss
        loss.backward()
        graph_opt.step()

    masked = {**batch, "attention_mask": torch.ones_like(batch["input_ids"])}
    out = {}
    for label, p_attn, feed, timed in (("CUDA graph", None, batch, True),
                                       ("CUDA graph, all-ones attention_mask", None, masked, True),
                                       ("CUDA graph, attention dropout 0", 0.0, batch, False)):
        inputs = feed  # what step_for_graph reads (and the graph records)
        p_before = [d.p for d in attn_dropouts]
        if p_attn is not None:  # read as a number while capturing: the graph keeps it, the eager step does not
            for d in attn_dropouts:
                d.p = p_attn
        try:  # the graph allocates the gradients itself: drop the warm-up's before capturing
            graph = captured(step_for_graph, before_capture=lambda: graph_opt.zero_grad(set_to_none=True))
        except RuntimeError as err:
            out[label] = f"capture failed: {str(err).splitlines()[0][:100]}"
            continue
        finally:
            for d, p_ in zip(attn_dropouts, p_before):
                d.p = p_
        if timed:
            out[label] = compare(eager_step, graph.replay, ("eager", label))
        else:
            out[label] = attention_kernels(profiler.profile(graph.replay, device=dev))
        del graph
    return out


graph_result = None
if run_profile.cuda_or_skip("CUDA graphs need a GPU"):
    with charged():
        graph_result = graph_runs(4)
    g_cmp = {k: v for k, v in graph_result.items() if isinstance(v, timing.Comparison)}
    for k, c in g_cmp.items():
        note_finding(k, "bert-large-uncased (batch 4)", c)
    graph_table = timing.comparisons_table(g_cmp).rename_axis("against the eager step")
    graph_table["host µs per launch, eager"] = [timing.us_per_launch(c.a) for c in g_cmp.values()]
    graph_table["attention kernel, eager"] = [attention_kernels(c.a.profile) for c in g_cmp.values()]
    graph_table["attention kernel, graph"] = [attention_kernels(c.b.profile) for c in g_cmp.values()]
    with pd.option_context("display.max_columns", None):
        display(graph_table)
    for k, v in graph_result.items():
        if isinstance(v, str):
            print(f"{k}: {v}")


# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title The CUDA-graph sentences
def graph_text(result, probe):
    """The CUDA-graph sentences: the gain and its host dependence, the kernels, and what the probes showed."""
    c = result["CUDA graph"]
    att_e, att_g = attention_kernels(c.a.profile), attention_kernels(c.b.profile)
    text = [f"Replayed from a graph ({prose.ms(c.b.wall.median)} a step, against {prose.ms(c.a.wall.median)} eager), the "
            f"step is {c.phrase(what='than eager')}; the GPU is busy {prose.pct(c.b.gpu_busy)} of the time instead of "
            f"{prose.pct(c.a.gpu_busy)} (kernel-time speed-up {c.kernel_ratio:.2f}×). The eager step's host "
            f"spends {timing.us_per_launch(c.a):.0f} µs per GPU operation ({c.a.kernels_per_call:,} of them; Python, the "
            f"dispatcher, autograd and the launch itself): that is what the graph saves, so a faster CPU gains less and a "
            f"slower one more. Eager, attention runs in the "
            f"**{att_e}** kernel; inside the graph, **{att_g}**."]
    if probe is not None:
        drop_changes = probe[(0.1, "CUDA graph")] != probe[(0.1, "eager")]
        nodrop_same = probe[(0.0, "CUDA graph")] == probe[(0.0, "eager")]
        if drop_changes and nodrop_same:
            text.append("The bare SDPA call shows why: without dropout, the captured call uses the same kernel as the "
                        "eager one; with dropout, capture changes the kernel. In this PyTorch, the fused kernels' "
                        "dropout is not used under graph capture here, and SDPA falls back.")
        elif not drop_changes and nodrop_same:
            text.append("The bare SDPA call uses the same kernel eager and captured, with and without dropout.")
    att_0 = result.get("CUDA graph, attention dropout 0")
    if isinstance(att_0, str) and not att_0.startswith("capture failed"):
        text.append(f"With the attention dropout at 0 while capturing, the graph uses **{att_0}**.")
        if att_g.startswith("none"):
            text.append("Setting the attention dropout to 0 did not bring a fused kernel back, so dropout is not the "
                        "cause." if att_0.startswith("none") else
                        "Setting the attention dropout to 0 brought a fused kernel back: here dropout was the cause.")
    cm = result.get("CUDA graph, all-ones attention_mask")
    if isinstance(cm, timing.Comparison):
        att_m = attention_kernels(cm.b.profile)
        text.append(f"With the batch's all-ones `attention_mask` passed explicitly, the captured step uses **{att_m}** "
                    f"and is {cm.phrase(what='than eager')}.")
        if att_g.startswith("none") and not att_m.startswith("none"):
            text.append(f"The explicit mask brought the fused kernel back, as the mask probe predicted for "
                        f"transformers {transformers.__version__}: its kernel-time speed-up over eager is "
                        f"{cm.kernel_ratio:.2f}×, against {c.kernel_ratio:.2f}× for the graph without a mask.")
        elif att_g.startswith("none"):
            text.append("The explicit mask did not bring a fused kernel back in the full training step either.")
    if att_g.startswith("none") and not att_e.startswith("none") and c.verdict == "faster":
        text.append("The graph without a mask therefore gains by removing launch overhead (the GPU-busy fraction) "
                    "while attention runs on the math path, in fp32 (section 9.1), which also stores the s x s matrix.")
    elif att_g.startswith("none") and c.verdict != "faster":
        text.append("Without a mask the graph removed the launches but moved attention to the math path, in fp32 "
                    "(section 9.1): on this GPU and CPU the extra GPU work ate the saving.")
    text.append("Whatever the cause on your setup, check the kernel names after capturing, as here.")
    return " ".join(text)


if graph_result and "CUDA graph" in g_cmp:
    prose.say(graph_text(graph_result, sdpa_probe["attention kernel seen"] if sdpa_probe is not None else None))
elif graph_result:
    print("the capture failed on this setup; see the message above")

# %%
cleanup.collect()

# %% [markdown]
# ## 9.5 Data loading
#
# Everything so far fed the model a batch that was already on the GPU. A real input pipeline reads,
# tokenises and collates on the CPU, and by default (`num_workers=0`) it does so in the training process,
# between steps, while the GPU waits. The symptom is the one chapter 8 taught: a GPU-busy fraction below
# what the step alone reaches. The fixes:
#
# - `num_workers=N`: N worker processes prepare batches in parallel with training, each keeping
#   `prefetch_factor` (default 2) batches ready;
# - `pin_memory=True`: batches are copied into page-locked host memory, from which the GPU can copy
#   asynchronously, so `tensor.to("cuda", non_blocking=True)` returns at once and the copy overlaps;
# - `persistent_workers=True`: the workers survive the end of an epoch instead of being started again.
#
# `data.TokenizingDataset` does real CPU work per sample: it builds a pseudo-text and tokenises it with a
# pure-Python greedy sub-word matcher, as an on-the-fly tokenizer would. A stall is easiest to read when the
# step itself is long enough to hide the loader's work behind it, so the step here is bert-large at batch 64 of 128 tokens (8,192 tokens, as
# many as section 9.3's bert-large step of 16 x 512), and the text length (`words`) is calibrated on this CPU so that
# tokenising one batch takes about `LOAD_TARGET_MS` milliseconds, of the order of the step itself (the first row
# of the table below says how busy the step keeps the GPU on your machine: on a host shared with other work it can
# be host-bound itself, and then the loader's workers and the step compete for the same CPU cores). Here the host
# *is* the lesson, so the comparisons below depend on this machine's CPU, and the text says how:

# %%
LOAD_BATCH = prof.pick(tiny=8, full=64)
LOAD_TARGET_MS = prof.pick(tiny=20, full=150)  # CPU time to tokenise one batch
words0 = prof.pick(tiny=50, full=300)
probe_ds = data.TokenizingDataset(1, seq_len=128, words=words0)  # built once: the lexicon is not the per-sample cost
t_probe = timing.time_it(lambda: probe_ds[0], device="cpu", warmup=2, repeat=10)
words = max(10, round(words0 * LOAD_TARGET_MS / 1e3 / (LOAD_BATCH * t_probe.wall.median)))
tok_ds = data.TokenizingDataset(LOAD_BATCH * 26, seq_len=128, words=words)  # 26 batches: enough for one comparison
t_sample = timing.time_it(lambda: tok_ds[0], device="cpu", warmup=2, repeat=10)
print(f"{words} words per sample; one sample: {t_sample.wall.median * 1e3:.2f} ms (IQR {t_sample.wall.iqr * 1e3:.2f}) "
      f"of CPU time; a batch of {LOAD_BATCH}: about {LOAD_BATCH * t_sample.wall.median * 1e3:.0f} ms")

# %% [markdown]
# Each timed call fetches the next batch from the loader, copies it to the GPU and runs the step. Three
# comparisons of steps, each interleaved, and one of copies answer four questions. Is there a stall? The baseline that no loader setting can
# beat is the same step fed from batches already on the GPU, against `num_workers=0`. Do workers remove it?
# `num_workers=0` against `WORKERS` workers (four, or as many as this machine has cores). Do they reach the floor?
# The batches on the GPU against the workers with pinned memory. Does pinning help? Pinning changes one thing,
# the copy of each batch to the GPU, so that copy is what is compared, interleaved: from pageable memory with a
# blocking copy against pinned memory with a `non_blocking` one. (A whole step with and without pinning differs
# by a fraction of a millisecond in a step of tens, far inside the variation that the worker processes add to
# a step, so a step-level verdict would be a verdict on that variation.) `persistent_workers` changes nothing within an epoch; it acts between epochs,
# so it is measured there: the wait for the next epoch's first batch, once with fresh workers and once with
# persistent ones.

# %%
WORKERS = min(4, os.cpu_count() or 1)  # no more workers than cores (DataLoader warns beyond that)
W0, WN = "num_workers=0", f"num_workers={WORKERS}"
WN_PIN = f"{WN}, pin_memory, non_blocking"
STAGED = "batches already on the GPU (no loader)"
LOADERS = {W0: dict(num_workers=0), WN: dict(num_workers=WORKERS),
           WN_PIN: dict(num_workers=WORKERS, pin_memory=True)}


def staged_side(model, optimizer, n_batches=16):
    """The reference: the same step on batches already on the GPU (no loader in the timed call)."""
    loader = torch.utils.data.DataLoader(tok_ds, batch_size=LOAD_BATCH, num_workers=WORKERS)
    staged = [{k: v.to(dev) for k, v in b.items()} for _, b in zip(range(n_batches), loader)]
    slot = {}
    step = steps.make_step(model, optimizer, slot, amp=STEP_AMP)
    state = {"i": 0}

    def step_staged():
        slot.update(staged[state["i"] % n_batches])
        state["i"] += 1
        step()

    return step_staged


def loader_side(model, optimizer, kwargs):
    """Fetch the next batch from a fresh loader of ``tok_ds``, copy it to the GPU, run the step."""
    loader = torch.utils.data.DataLoader(tok_ds, batch_size=LOAD_BATCH, **kwargs)
    pinned = kwargs.get("pin_memory", False)
    it = iter(loader)
    slot = {}
    step = steps.make_step(model, optimizer, slot, amp=STEP_AMP)

    def fetch_and_step():
        slot.update({k: v.to(dev, non_blocking=pinned) for k, v in next(it).items()})
        step()

    return fetch_and_step


def next_epoch_wait(kwargs):
    """Seconds until the first batch of a second epoch (the first epoch is run to its end, untimed)."""
    loader = torch.utils.data.DataLoader(tok_ds, batch_size=LOAD_BATCH, **kwargs)
    for _ in loader:
        pass
    t0 = time.perf_counter()
    next(iter(loader))
    return time.perf_counter() - t0


def side(label, model, optimizer):
    return staged_side(model, optimizer) if label == STAGED else loader_side(model, optimizer, LOADERS[label])


load_cmp, first_batch_s, copy_cmp = {}, {}, None
if run_profile.cuda_or_skip("an input stall means a GPU waiting; on a CPU the workers compete with the model"):
    model, optimizer = build("bert-large-uncased")
    with charged():
        for base, cand in ((STAGED, W0), (W0, WN), (STAGED, WN_PIN)):
            load_cmp[(base, cand)] = compare(side(base, model, optimizer), side(cand, model, optimizer), (base, cand))
        first_batch_s = {"fresh workers": next_epoch_wait(LOADERS[WN_PIN]),
                         "persistent workers": next_epoch_wait({**LOADERS[WN_PIN], "persistent_workers": True})}
    cleanup.free(globals(), "model", "optimizer")
    sample = next(iter(torch.utils.data.DataLoader(tok_ds, batch_size=LOAD_BATCH)))  # what pinning could speed up
    sample_pinned = {k: v.pin_memory() for k, v in sample.items()}
    copy_cmp = compare(lambda: [v.to(dev) for v in sample.values()],
                       lambda: [v.to(dev, non_blocking=True) for v in sample_pinned.values()],
                       ("pageable, blocking", "pinned, non_blocking"), busy=False)
    print(f"copying one batch ({', '.join(sample)}) to the GPU, medians of {copy_cmp.rounds} interleaved rounds: "
          f"from pageable memory {copy_cmp.a.wall.median * 1e3:.3f} ms, from pinned memory "
          f"{copy_cmp.b.wall.median * 1e3:.3f} ms (each until the copy has finished)")
    del sample, sample_pinned
    for (base, cand), c in load_cmp.items():
        note_finding(f"data loading: {cand}" if base != STAGED else f"data loading: {cand}, against batches on the GPU",
                     f"bert-large-uncased (batch {LOAD_BATCH} x 128)", c)
    load_table = timing.comparisons_table({f"{cand} against {base}": c for (base, cand), c in load_cmp.items()})
    with pd.option_context("display.max_columns", None):
        display(load_table)
    print("next epoch's first batch (one wait each): "
          + "; ".join(f"{k} {v * 1e3:.0f} ms" for k, v in first_batch_s.items()))

# %%
if load_cmp:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 3.6))
    plot_speedups(ax1, {f"{cand}\nvs {base.split(' (')[0]}": c for (base, cand), c in load_cmp.items()},
                  "each pair interleaved")
    busy = {STAGED.split(" (")[0]: load_cmp[(STAGED, W0)].a.gpu_busy, W0: load_cmp[(STAGED, W0)].b.gpu_busy,
            WN: load_cmp[(W0, WN)].b.gpu_busy, WN_PIN: load_cmp[(STAGED, WN_PIN)].b.gpu_busy}
    y = np.arange(len(busy))
    ax2.barh(y, [v * 100 for v in busy.values()], color="C2")
    ax2.set_yticks(y, list(busy))
    ax2.invert_yaxis()
    ax2.set_xlim(0, 105)
    ax2.set_xlabel("GPU busy (% of the step)")
    ax2.set_title("GPU busy, by loader setting")
    fig.suptitle(f"bert-large, batch {LOAD_BATCH} x 128, tokenised on the fly")
    fig.tight_layout()


# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title The data-loading sentences, from the three interleaved step comparisons, the copy…
def loader_text(cmp, copy_cmp, waits, tokenise_s, workers):
    """The data-loading sentences, from the three interleaved step comparisons, the copy comparison and the two waits."""
    stall, more, floor = (cmp[(STAGED, W0)], cmp[(W0, WN)], cmp[(STAGED, WN_PIN)])
    text = [f"Fed from batches already on the GPU, the step takes {prose.ms(stall.a.wall.median)} and the GPU is busy "
            f"{prose.pct(stall.a.gpu_busy)} of it. With the loader in the training process "
            f"(`num_workers=0`) the step is {stall.phrase(what='than with batches already on the GPU')}, and the GPU is "
            f"busy {prose.pct(stall.b.gpu_busy)}."]
    gap = stall.b.wall.median - stall.a.wall.median
    if stall.verdict == "slower" and gap >= tokenise_s:
        text.append(f"The difference of the medians, {prose.ms(gap)}, is the stall, of which about "
                    f"{prose.ms(tokenise_s)} is tokenising; the rest is collation, the copy and the host's variation.")
    elif stall.verdict == "slower":
        text.append(f"The difference of the medians, {prose.ms(gap)}, is the stall: less than the estimated "
                    f"{prose.ms(tokenise_s)} of tokenising a batch ({LOAD_BATCH} times one sample's time, measured "
                    f"apart), so read both as approximate: they come from different timings of a host whose speed "
                    f"varies.")
    else:
        text.append("So the loader does not stall this step beyond the noise, and the worker rows cannot improve on it.")
    text.append(f"With {workers} worker(s) against none, the step is {more.phrase(what='than `num_workers=0`')}, GPU busy "
                f"{prose.pct(more.b.gpu_busy)}. Against the batches already on the GPU, {workers} worker(s) with pinned "
                f"memory are {floor.phrase(what='than the batches on the GPU')}"
                + (": the workers hide the loading within ±3%." if timing.within_threshold(floor) else
                   f": no cost of the loading shows at this precision (the interval allows up to {1 / floor.lo - 1:.0%})."
                   if floor.verdict == timing.NO_DIFFERENCE else
                   ": the workers do not hide all of the loading here; they share this machine's "
                   f"{os.cpu_count()} CPU cores with the training process, which launches the step's kernels."
                   if floor.verdict == "slower" else
                   ": faster than a step with no loading at all cannot be a loader's doing; read it as the host's "
                   "variation."))
    saved_ms = (copy_cmp.a.wall.median - copy_cmp.b.wall.median) * 1e3
    text.append(f"Copying one batch to the GPU from pinned memory with `non_blocking`, against pageable memory: "
                f"{copy_cmp.phrase(what='than from pageable memory')} ({copy_cmp.a.wall.median * 1e3:.3f} against "
                f"{copy_cmp.b.wall.median * 1e3:.3f} ms, each until the copy has finished). So pinning saves at most "
                f"about {max(saved_ms, 0):.2f} ms a step, "
                + (f"{saved_ms / stall.a.wall.median / 1e3:.2%} of this step: worth having (it costs nothing), but too "
                   "little to matter here; it matters where copies are large against the step (big inputs, small "
                   "models) and where a `non_blocking` copy can overlap with GPU work." if saved_ms > 0 else
                   "nothing here: the copy is as fast from pageable memory in this run."))
    text.append(f"After an epoch has ended, the next one waits {prose.ms(waits['fresh workers'])} for its first batch "
                f"with fresh workers and {prose.ms(waits['persistent workers'])} with persistent ones (one wait each; "
                f"tokenising one batch was estimated apart at about {prose.ms(tokenise_s)}): persistent workers save the workers' "
                f"start-up once per epoch, and nothing within one. **Rule of thumb**: time the step on batches already "
                f"on the GPU; if the loader's step is slower, the pipeline is the bottleneck: add workers until the step "
                f"stops getting faster, and no more than the CPU cores free of other work. How many that is depends on "
                f"the CPU and on what each sample costs it.")
    return " ".join(text)


if load_cmp:
    prose.say(loader_text(load_cmp, copy_cmp, first_batch_s, LOAD_BATCH * t_sample.wall.median, WORKERS))

# %%
_ = cleanup.free(globals(), "tok_ds", "probe_ds")

# %% [markdown]
# ## 9.6 The free wins, measured
#
# The one-line changes that the guides recommend (the Hugging Face single-GPU guide, the "simple ways to
# speed up PyTorch" post), each timed interleaved against its own baseline on the same model, bert-large with
# 512-token sequences in 16-bit autocast (bf16, or fp16 on a GPU without bf16). These are changes on the GPU's side,
# so they are measured where the GPU, not the host, sets the pace: at batch 32 on a GPU with room for it (a step
# that keeps an H100 busy most of the time; the closing table gives each row's baseline GPU-busy fraction), at
# batch 8 on a smaller one (which is slower, and so
# busy at batch 8 already). Each row also gives the kernel-time speed-up, the change in the GPU's own work, which
# does not depend on the host. Fused AdamW and `set_to_none` change a few percent of a step, close to the ±3%
# threshold, so they get 30 rounds instead of 15: a narrower interval, and a verdict that does not change between runs.
#
# - **AdamW implementation**: `foreach` (PyTorch's default on GPUs: one kernel per operation over lists of
#   tensors) against `fused=True` (the whole update in one pass, a few multi-tensor launches; chapters 5 and 8)
#   and against a plain loop over the parameters (`foreach=False`, several kernels per tensor). The loop's cost is
#   on the host's side (its launches), so it is timed where that is the lesson: on the optimizer step alone;
# - **`zero_grad(set_to_none=True)`**, the default: drops the gradients instead of writing zeros into them
#   (`set_to_none=False`), which saves a memset per parameter and lets the backward pass allocate afresh; the
#   baseline of this row is the old setting, the candidate the recommended one;
# - **TF32**: `torch.backends.cuda.matmul.allow_tf32 = True` runs fp32 matrix products on the [tensor cores](https://gpu-efficient-training.github.io/book/book/glossary.html#tensor-cores)
#   with a 10-bit mantissa (compute capability 8.0 and newer; `torch.set_float32_matmul_precision("high")` says
#   the same). It changes nothing for products that autocast already runs in 16 bits, so it is measured on an fp32
#   step at batch 8; the two sides flip the switch before each sample, and it is restored afterwards;
# - **aligned shapes**: the masked-LM head of BERT maps hidden states to the 30,522-word vocabulary. A bf16 row
#   of 30,522 elements is 61,044 bytes, not a multiple of 16, so cuBLAS cannot use its aligned tensor-core paths
#   for the product; any multiple of 8 elements fixes that, and multiples of 64 or 128 add a few percent through
#   tile and wave quantisation at most. Padding the vocabulary to 30,528 (a multiple of 64) does both. Timed as
#   that product, forward and backward.

# %%
WINS_BATCH = prof.pick(tiny=2, full=32 if BIG_GPU else 8)  # a GPU-bound step: 32 x 512 on a large GPU
TF32_BATCH = prof.pick(tiny=2, full=8)
WINS_MODEL = f"bert-large-uncased (batch {WINS_BATCH} x {SETUPS['bert-large-uncased']['seq_len']})"


def zero_grad_step(model, optimizer, batch, set_to_none):
    """The book's step, written out, with the gradients dropped or zeroed at its end."""
    def step():
        with torch.autocast(dev, dtype=AMP, enabled=prof.on_gpu):
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)

    return step


def free_wins():
    """Each free win against its baseline, interleaved; an out-of-memory row is a note, not a crash."""
    cmps, notes = {}, {}
    model = build("bert-large-uncased")[0]
    batch = make_batch("bert-large-uncased", WINS_BATCH)
    base_opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    base_step = steps.make_step(model, base_opt, batch, amp=STEP_AMP)

    def run(label, make_candidate, baseline=("AdamW foreach (default)", base_step), **kw):
        def attempt(_):
            fb, names = make_candidate(), (baseline[0], label)
            return compare(baseline[1], fb, names, **kw)
        a = batching.try_batch(attempt, WINS_BATCH)
        if a.fits:
            cmps[label] = a.value
        else:
            notes[label] = f"out of memory on this GPU ({a.error})"

    # fused AdamW and set_to_none change a few percent of a step: 30 rounds narrow the interval that their verdicts,
    # a few points from the ±3% threshold, rest on
    small_effect = {"rounds": prof.pick(tiny=10, full=30)}
    run("AdamW fused", lambda: steps.make_step(model, torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True),
                                               batch, amp=STEP_AMP), **small_effect)
    # The for-loop's cost is the host's: several launches per tensor. Measured where that is the lesson, on the
    # optimizer step alone (the gradients of one backward pass stay in place; both optimizers update the same weights).
    with torch.autocast(dev, dtype=AMP, enabled=prof.on_gpu):
        loss = model(**batch).loss
    loss.backward()
    del loss
    run("AdamW for-loop, optimizer step alone",
        lambda: torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=False).step,
        baseline=("AdamW foreach, optimizer step alone", base_opt.step))
    base_opt.zero_grad(set_to_none=True)
    if prof.on_gpu:  # a CPU run checks the code of each kind of row once, to save CI time
        run("zero_grad(set_to_none=True) (default)", lambda: zero_grad_step(model, base_opt, batch, True),
            baseline=("zero_grad(set_to_none=False)", zero_grad_step(model, base_opt, batch, False)), **small_effect)
    if cap is None or cap.tf32:  # on a CPU the switch does nothing: the row only checks the code
        old = torch.backends.cuda.matmul.allow_tf32
        fp32_step = steps.make_step(model, base_opt, make_batch("bert-large-uncased", TF32_BATCH))
        try:
            run("fp32 step, TF32 on", lambda: fp32_step, baseline=("fp32 step, TF32 off", fp32_step),
                setup_a=lambda: setattr(torch.backends.cuda.matmul, "allow_tf32", False),
                setup_b=lambda: setattr(torch.backends.cuda.matmul, "allow_tf32", True))
        finally:
            torch.backends.cuda.matmul.allow_tf32 = old
    else:
        notes["TF32"] = "skipped: TF32 needs compute capability 8.0 or newer"
    return cmps, notes


VOCABS = prof.pick(tiny=(2042, 2048), full=(30522, 30528))  # the real vocabulary and the next multiple of 64


def aligned_shapes():
    """The masked-LM head's product, forward and backward, with the real and a padded vocabulary, interleaved."""
    tokens = WINS_BATCH * SETUPS["bert-large-uncased"]["seq_len"]
    dt = AMP if prof.on_gpu else torch.float32
    hidden = models.config("bert-large-uncased").hidden_size
    x = torch.randn(tokens, hidden, device=dev, dtype=dt, requires_grad=True)
    w_real, w_pad = (torch.randn(v, hidden, device=dev, dtype=dt, requires_grad=True) for v in VOCABS)
    return compare(lambda: (x @ w_real.T).sum().backward(), lambda: (x @ w_pad.T).sum().backward(),
                   (f"vocabulary {VOCABS[0]:,}", f"vocabulary {VOCABS[1]:,}"))


with charged():
    wins_cmp, wins_notes = free_wins()
    wins_cmp["aligned vocabulary"] = aligned_shapes()
for label, c in wins_cmp.items():
    note_finding(label, WINS_MODEL if not label.startswith("fp32") else WINS_MODEL.replace(
        f"batch {WINS_BATCH}", f"batch {TF32_BATCH}"), c)
wins_table = timing.comparisons_table(wins_cmp).rename_axis("change")
for k, v in wins_notes.items():
    print(f"{k}: {v}")
if prof.on_gpu:
    with pd.option_context("display.max_columns", None):
        display(wins_table)
else:
    print(f"skipped on CPU: each comparison ran {ROUNDS} rounds to check the code; their speed-ups are GPU matters")


# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title The free-wins sentences
def wins_text(cmp):
    """The free-wins sentences: each row's ratio and interval, and what decides it (the GPU, or the reader's CPU)."""
    text = []
    fused = cmp.get("AdamW fused")
    if fused is not None:
        base = fused.a
        text.append(f"Fused AdamW against the default `foreach`: {fused.phrase(what='than foreach')}; kernel-time "
                    f"speed-up {fused.kernel_ratio:.2f}× (the GPU's own work), and the host's enqueue time went from "
                    f"{prose.ms(fused.a.host.median)} to {prose.ms(fused.b.host.median)} per step.")
        text.append(f"The baseline step keeps the GPU busy {prose.pct(base.gpu_busy)} of the time, with "
                    f"{timing.us_per_launch(base):.0f} µs of host time per GPU operation: the wall clock follows the "
                    f"GPU's work in that share of the step, where the fused update's kernel saving shows, and the host's "
                    f"launches in the rest. In a host-bound step (a smaller batch, or a slower CPU than this one) the "
                    f"launches the fused update saves decide instead, and there the reader's CPU decides.")
    loop = cmp.get("AdamW for-loop, optimizer step alone")
    if loop is not None:
        extra = loop.b.kernels_per_call - loop.a.kernels_per_call
        text.append(f"A plain loop over the parameters (`foreach=False`) against `foreach`, on the optimizer step "
                    f"alone: {loop.phrase(what='than foreach')}. The loop launches {extra:,} more GPU operations per "
                    f"update ({loop.b.kernels_per_call:,} against {loop.a.kernels_per_call:,}), and its host needs "
                    f"{prose.ms(loop.b.host.median)} to issue them ({timing.us_per_launch(loop.b):.0f} µs per launch on "
                    f"this host) while the GPU is busy {prose.pct(loop.b.gpu_busy)} of the update: a cost on the host's "
                    f"side, so the reader's CPU decides this number. Inside a training step whose GPU is still finishing "
                    f"the backward pass, the host can hide part of it.")
    ztn = cmp.get("zero_grad(set_to_none=True) (default)")
    if ztn is not None:
        text.append(f"Dropping the gradients (`set_to_none=True`, the default) against writing zeros into them: "
                    f"{ztn.phrase(what='than zeroing')}, with a kernel-time speed-up of {ztn.kernel_ratio:.2f}×: a "
                    f"memset per parameter is a small share of a step; the default also frees the gradients' memory "
                    f"between steps.")
    tf32 = cmp.get("fp32 step, TF32 on")
    if tf32 is not None:
        text.append(f"TF32 on an fp32 step (batch {TF32_BATCH}): {tf32.phrase(what='than full fp32')}, kernel-time "
                    f"speed-up {tf32.kernel_ratio:.2f}×; the step keeps the GPU busy {prose.pct(tf32.a.gpu_busy)} of the "
                    f"time without it, so this is the matrix products' own speed.")
    voc = cmp.get("aligned vocabulary")
    if voc is not None:
        text.append(f"The vocabulary padded to a multiple of 64, the head's product forward and backward: "
                    f"{voc.phrase(what='than the 30,522-word vocabulary')}.")
    return " ".join(text)


if prof.on_gpu and wins_cmp:
    prose.say(wins_text(wins_cmp))
else:
    print("skipped on CPU: no GPU timings to compare")

# %% [markdown]
# ## 9.7 Summary: the fast path
#
# Every comparison of this chapter, each timed interleaved against its own baseline: the median per-round
# speed-up with its 95% interval, the kernel-time speed-up (the GPU's own work), how busy the baseline kept the
# GPU and what limited it, and the verdict (*faster* or *slower* only when the whole interval lies beyond ±3%;
# section 9.2's padding rows and section 9.3's compile rows are judged by their kernel-time speed-up, as the
# column "judged on" says). The kernel-time speed-up has no interval: it is the ratio of the two sides' kernel time
# per call, from a few profiled calls of each, which leaves out the host's gaps, and the ±3% rule is applied to that
# one ratio. So where the sentence under the chart counts the rows that were faster "beyond ±3%", a row judged on
# kernel time counts by its kernel time; its wall-clock interval, in the "95% interval" column, can still
# include 1.
# A row whose baseline is host-bound measures the host as much as the technique: on another CPU its number differs.
# In the chart under the table, a point's colour is the row's verdict (green faster, red slower, grey no practical
# difference), and for the rows judged on kernel time (padding and compilation) that is the kernel-time verdict,
# while the point and its whiskers are the wall clock's: a green point can sit at 1×. On this log axis the grey ±3% band can be too narrow to see.

# %%
closing = pd.DataFrame(findings).set_index(["technique", "model"]) if findings else pd.DataFrame()
with pd.option_context("display.max_columns", None, "display.max_colwidth", 60):
    display(closing)


# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title The closing paragraph
def closing_text(table, compiled_info):
    """The closing paragraph: how many comparisons went which way, which depend on the host, compile costs, skips."""
    by = {v: table[table["verdict"] == v] for v in ("faster", timing.NO_DIFFERENCE, "slower")}
    text = [f"Of the {len(table)} comparisons, {len(by['faster'])} made the work faster beyond ±3%, "
            f"{len(by[timing.NO_DIFFERENCE])} showed no practical difference and {len(by['slower'])} made it slower"
            + (": " + "; ".join(f"{t} on {m} ({r['speed-up']:.2f}×)" for (t, m), r in by["slower"].iterrows())
               if len(by["slower"]) else "") + "."]
    busy = table["baseline GPU busy"].astype(float)
    host = table[busy < 0.9]
    if len(host):
        text.append(f"{len(host)} of them had a baseline that kept the GPU busy less than 90% of the time ("
                    + "; ".join(f"{t} ({m.split(' (')[0]})" for t, m in host.index)
                    + "): there the host's speed is part of the result, and the reader's CPU decides the number.")
    ctimes, skipped = [], []
    for name, info in compiled_info.items():
        for label, row in info.items():
            if "compile time (s)" in row:
                ctimes.append(f"{model_label(name)}, {label}: {row['compile time (s)']:.0f} s "
                              f"({row.get('caches', 'cold caches')})")
            elif "note" in row:
                skipped.append(f"{model_label(name)}, {label} ({row['note'].split(':')[0]})")
    if ctimes:
        text.append(f"Compile times: {'; '.join(ctimes)}.")
    if skipped:
        text.append(f"Not measured in this run: {'; '.join(skipped)}; section 9.3 says why.")
    return " ".join(text)


if prof.on_gpu and len(closing):
    prose.say(closing_text(closing, {name: info for name, (_, info) in compiled.items()}))
else:
    print("skipped on CPU: the closing comparison needs GPU timings")

# %%
if findings:
    fig, ax = plt.subplots(figsize=(10, 0.32 * len(findings) + 1.5))
    labels = [f"{f['technique']} ({f['model'].split(' (')[0]})" + (" *" if (f["baseline GPU busy"] or 1) < 0.9 else "")
              for f in findings]
    plot_speedups(ax, dict(zip(labels, finding_cmps, strict=True)),
                  "every comparison of the chapter (* baseline busy < 90%: the host is part of the result)",
                  verdicts={lab: f["verdict"] for lab, f in zip(labels, findings, strict=True)})
    ax.set_xscale("log", base=2)  # speed-ups from 0.3× to 20×: a factor reads the same everywhere on the axis
    ax.set_xlabel("speed-up, log scale (baseline time / candidate time; whiskers: 95% interval; grey: ±3%)")
    fig.tight_layout()

# %% [markdown]
# *What the table above does not hold.* Fused attention is measured on the attention call alone (section 9.1),
# not as a training-step comparison; a compile mode that the chapter's time budget skipped has no row (section
# 9.3's table says which ran), and `torch.compile` is measured per layer only, with the optimizer step eager in
# every row (exercise 2 compiles the optimizer); CUDA graphs, data loading and the free wins were measured on
# bert-large only. The attention kernel can also differ between rows: sections 9.3 and 9.4 show which kernel each
# compiled or captured step ran. Rows that name the same baseline (the two CUDA-graph rows; the two data-loading
# rows against the batches already on the GPU) timed it separately, each in its own alternating rounds: on a host
# whose speed drifts, the two baselines' medians can differ, so compare such rows through the candidates' own
# times or a comparison of the two candidates, not by dividing their speed-ups.

# %% [markdown]
# ### The checklist, in the order to try things
#
# 1. **Measure first** (chapter 8): median and IQR of ≥ 10 steps, GPU-busy fraction, category table; compare two
#    settings interleaved (`timing.interleaved`), never as two separate blocks of timings.
# 2. **GPU idle between steps?** Look at the input pipeline: `num_workers` > 0, `pin_memory=True` with
#    `non_blocking=True`, persistent workers (section 9.5).
# 3. **Fused attention**: `attn_implementation="sdpa"` (the default in transformers); check which backend
#    runs on your GPU and dtype (section 9.1), and check it again after compiling or capturing the model:
#    whether a mask is passed can decide between a fused kernel and the math path there (sections 9.3 and
#    9.4 read the kernel names). On long sequences this is also the largest memory saving.
# 4. **Stop computing padding**: length grouping, or packing with restarting position ids (section 9.2).
# 5. **Free wins**: fused AdamW, 16-bit autocast (TF32 for any fp32 products), shapes in multiples of 8 (64)
#    (section 9.6); keep those that measure faster.
# 6. **Host-bound?** A larger batch first (chapter 3); then CUDA graphs, by hand or through
#    `torch.compile(mode="reduce-overhead")` (sections 9.3, 9.4).
# 7. **`torch.compile`** last, because it costs compile time and recompiles on new shapes: measure the
#    steady state *and* the compile time against the length of your run; compile per layer to cut the
#    compile time, with `use_cache=False`, and check in the profile that attention still runs in a fused
#    kernel (section 9.3).
#
# ### Use it in your own script
#
# ```python
# import torch
# from torch.nn.attention import SDPBackend, sdpa_kernel
# from transformers import AutoModelForCausalLM
#
# model = AutoModelForCausalLM.from_pretrained(      # fp32 master weights (transformers 5 loads the checkpoint's
#     path, dtype=torch.float32, attn_implementation="sdpa").cuda().train()  # dtype unless told), dropout on
# loader = torch.utils.data.DataLoader(ds, batch_size=32, num_workers=4, pin_memory=True,
#                                      persistent_workers=True)
# optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
# torch.backends.cuda.matmul.allow_tf32 = True              # fp32 products on tensor cores (Ampere+)
# model.config.use_cache = False                           # no KV cache in training (packing, regional compile)
# for layer in model.model.layers:  # regional compilation (Llama-style; GPT-NeoX: model.gpt_neox.layers)
#     layer.compile()
# for batch in loader:
#     batch = {k: v.to("cuda", non_blocking=True) for k, v in batch.items()}
#     with torch.autocast("cuda", dtype=torch.bfloat16):
#         loss = model(**batch).loss
#     loss.backward()
#     optimizer.step()
#     optimizer.zero_grad(set_to_none=True)
#
# with sdpa_kernel(SDPBackend.FLASH_ATTENTION):             # insist on a backend (raises if it cannot run)
#     out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
# ```
#
# For packing, the Hugging Face `DataCollatorWithFlattening` builds rows with restarting position ids like
# section 9.2's; call the model with `use_cache=False` and check the boundaries once, as section 9.2 does.
#
# ## Exercises
#
# 1. Run section 9.1's sweep with `TOKENS` four times larger. Which implementation runs out of memory first,
#    and at which length?
#    <details><summary>Hint</summary>The written-out version keeps about 6 bytes per score element, and there
#    are batch x heads x s² of them.</details>
#    <details><summary>Answer</summary>The eager and math rows grow linearly in s at a fixed token count; with
#    four times the tokens their peak is four times larger and they hit the card's limit first (on an 80 GB
#    card, expect it near s = 8192; on a T4, far earlier). The fused rows stay flat and small.</details>
# 2. Compile the optimizer step too: `opt_step = torch.compile(optimizer.step)` and call it in the step of
#    section 9.3 on the 1.3B model. Does the optimizer's share of the category table shrink, and is the compile
#    time worth it?
#    <details><summary>Hint</summary>Compare with `fused=True` (section 9.6), which needs no compilation.</details>
#    <details><summary>Answer</summary>The compiled step fuses the AdamW arithmetic into a few Triton kernels and
#    approaches the fused implementation's speed; it adds tens of seconds of compile time and a recompilation
#    when the learning rate is a Python float that changes (use a tensor learning rate).</details>
# 3. Try `mode="max-autotune"` on bert-large. How long does it compile, and does the step beat `default`?
#    <details><summary>Hint</summary>Set a timer around the first step; autotuning benchmarks several kernel
#    configurations per matrix product.</details>
#    <details><summary>Answer</summary>Expect minutes of compilation. `max-autotune` also replays the compiled
#    code from CUDA graphs, as `reduce-overhead` does, so wherever the `default` step leaves the GPU idle (section
#    9.3's GPU-busy column) it gains what `reduce-overhead` gained; compare it with `reduce-overhead`, not only with
#    `default`, to see what the autotuning itself adds. That part can only speed up the matrix products and the
#    generated kernels, and cuBLAS already runs the products well, so expect it to be small next to the spread;
#    autotuning pays when the same shapes run for many hours.</details>
# 4. In section 9.5, make the tokenisation cheaper (`LOAD_TARGET_MS = 20`). At which `num_workers` does the
#    step stop getting faster?
#    <details><summary>Hint</summary>The reference row (batches already on the GPU) is the floor no loader
#    setting can beat. Compare the per-batch tokenising time (the cell that times one sample, times the batch)
#    with it.</details>
#    <details><summary>Answer</summary>Once the per-batch CPU time divided by the workers is well below the
#    step's own time (GPU time, or the host's launch time when the step is host-bound, as the reference row's
#    verdict says whether it is), more workers
#    change nothing: with cheap samples, two workers or even none may suffice. Compare each setting with the
#    reference interleaved, as the section does; a speed-up whose interval reaches inside ±3% does not
#    count.</details>
#
# ## References
#
# - Dao et al. (2022), *FlashAttention*; Dao (2024), *FlashAttention-2*; Shah et al. (2024), *FlashAttention-3*;
#   Korthikanti et al. (2022) for the activation formula. All on the [references page](https://gpu-efficient-training.github.io/book/book/references.html).
# - PyTorch documentation: `torch.nn.functional.scaled_dot_product_attention`, `torch.nn.attention.sdpa_kernel`,
#   the `torch.compile` tutorials (including regional compilation), *CUDA semantics* (CUDA graphs), and
#   `torch.utils.data` (workers, pinned memory).
# - Hugging Face, *Efficient training on a single GPU* and the `DataCollatorWithFlattening` documentation
#   (packing with position ids).
# - "Simple ways to speed up your PyTorch model training", Towards Data Science (2024): the source of the data
#   loading and compile advice measured here.

# %% [markdown]
# The chapter ends as it began: every model, graph and compiled function is gone, TorchDynamo's caches and
# CUDA-graph pools are reset, cuBLAS's workspaces released (chapter 8 explains them), and the allocated
# memory is back at its baseline.

# %%
if prof.on_gpu:
    torch._dynamo.reset()  # compiled graphs hold their own buffers; then release the workspaces and assert
    display(pd.Series(cleanup.back_at_baseline(baseline_mib)).to_frame("value"))
else:
    print("skipped on CPU: no GPU memory to check")
