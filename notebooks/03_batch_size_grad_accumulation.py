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
# fit: gradient accumulation, which adds up the gradients of several small batches before one optimizer
# step. We prove that it computes the same update as the large batch, measure what it costs, and end
# with the case where the usual way of writing it is wrong.
#
# **What you will learn**
#
# - how training memory splits into a fixed part (weights, optimizer states) and a part per sample
#   (activations), measured and fitted on two models, and where throughput stops growing with the batch;
# - how to search for the largest batch that fits: try, catch `torch.OutOfMemoryError`, free, back off,
#   and check that nothing leaked;
# - how to write gradient accumulation, and how to check that it is right: gradients and a whole training
#   run compared against the large batch, as assertions;
# - what accumulation costs in time and memory (the Hugging Face guide's rows, on our GPU), and how the
#   `Trainer`'s `gradient_accumulation_steps` compares with the hand-written loop;
# - why averaging per-micro-batch losses is wrong for sequences of different lengths, and the fix.
#
# **Prerequisites:** chapter 1 (the four memory numbers, activations, the emulated T4). The
# [setup page](../book/setup.md) explains the run profiles; numbers quoted in the text come from the
# full-size run on the GPU named in the first output below.

# %%
import sys

if "google.colab" in sys.modules:  # Colab only. pip adds what Colab lacks (bitsandbytes, the book's helpers)
    # and upgrades transformers to the 5.x the book needs: nothing has imported it yet in this kernel, so no
    # restart is needed. Colab's torch already meets the book's floor and is kept (see the setup page).
    # %pip install -q --no-warn-conflicts "gpu-efficient-training @ git+https://github.com/gpu-efficient-training/book"

from helpers import env

env.quiet()  # warnings without file paths, no progress bars: outputs that read the same everywhere

import time
from contextlib import nullcontext

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from transformers import Trainer, TrainingArguments

from helpers import accounting, batching, cleanup, data, flops, measure, models, plots, profiles, train
from helpers.glue import glue
from helpers.measure import GIB, MIB

plots.use_style()
pd.options.display.float_format = "{:,.2f}".format
prof = profiles.get()
env.report(prof)

# %% [markdown]
# Some experiments emulate Colab's T4 on a larger card, as in chapter 1: PyTorch's allocator is capped at
# the T4's 14.75 GiB minus what this process's CUDA context takes, which the allocator never sees. We
# measure the context now, before anything else is on the card, after one matrix product in each dtype so
# that cuBLAS is loaded.

# %%
t4_budget_gib = None
if profiles.cuda_or_skip("emulating a T4 needs a GPU"):
    nvml_before = measure.nvml_used_mib()
    for dtype in (torch.float32, torch.float16):
        torch.ones(256, 256, device="cuda", dtype=dtype) @ torch.ones(256, 256, device="cuda", dtype=dtype)
    context_gib = (measure.nvml_used_mib() - nvml_before) * MIB / GIB - torch.cuda.memory_reserved() / GIB
    t4_budget_gib = measure.T4_MEMORY_GIB - context_gib
    glue("t4_budget_gib", t4_budget_gib)
    print(f"emulated T4: allocator capped at {t4_budget_gib:.2f} GiB = 14.75 GiB - {context_gib:.2f} GiB (CUDA context)")

# %% [markdown]
# ## 3.1 What a larger batch costs and buys
#
# Two models, each with the setup of the source it comes from: `bert-large-uncased` for classification in
# fp32 at 512 tokens, as in the Hugging Face guide, and the GPT-NeoX shape of `polyglot-ko-1.3b` as a causal
# language model with fp16 weights and eager attention at 256 tokens, as in the LLM book (chapter 1 showed
# that pure fp16 AdamW breaks training; for memory and time it is the seeds' setup, so we keep it). The data
# are random token ids: memory and time do not depend on them.
#
# Two small functions carry the whole chapter. `make_batch` builds a batch; `train_step` is one plain
# training step. Its `finally` clause matters later: a step that fails half-way must not leave gradients
# behind.

# %%
SETUPS = {
    "bert-large-uncased": dict(head="sequence-classification", dtype=torch.float32, attn_implementation="sdpa",
                               seq_len=prof.pick(tiny=64, full=512)),
    "polyglot-ko-1.3b": dict(head="causal-lm", dtype=prof.pick(tiny=torch.float32, full=torch.float16),
                             attn_implementation="eager", seq_len=prof.pick(tiny=64, full=256)),
}  # (the tiny profile keeps the 1.3B model's twin in fp32: CPUs are slow at fp16)


def build(name, seed=0):
    """The model of ``SETUPS[name]`` and a plain AdamW (weight decay off, lr irrelevant for memory)."""
    setup = SETUPS[name]
    model = models.build(name, head=setup["head"], dtype=setup["dtype"],
                         attn_implementation=setup["attn_implementation"], seed=seed).train()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)


def make_batch(name, batch_size, seed=0):
    """``batch_size`` random sequences for model ``name``, on the profile's device."""
    task = "classification" if SETUPS[name]["head"] == "sequence-classification" else "causal-lm"
    ds = data.dummy_dataset(batch_size, SETUPS[name]["seq_len"], task=task, seed=seed)
    return {k: v.to(prof.device) for k, v in ds[:].items()}


def train_step(model, optimizer, batch):
    """forward, backward, optimizer step; the gradients are dropped even when the step fails."""
    try:
        model(**batch).loss.backward()
        optimizer.step()
    finally:
        optimizer.zero_grad(set_to_none=True)


# %% [markdown]
# For each batch size we time the training step (median of three after a warm-up step, which also creates
# AdamW's states) and then run one more step phase by phase. After the forward pass, allocated memory is
# the fixed part (weights and optimizer states; the gradients were dropped by the last `zero_grad`) plus the
# activations of this batch. `SavedTensorMeter` counts those activations independently of the device, and
# the peak over the three phases is what the card must hold. Each batch size runs through
# `batching.try_batch`, which turns an out-of-memory error into a row of the table instead of a crash (on
# a T4 the larger batches of this sweep do not fit; on the GPU of this run they all do).

# %%
def measure_batch(name, model, optimizer, batch_size):
    """Step time, throughput and memory of one batch size (memory columns are NaN on a CPU)."""
    batch = make_batch(name, batch_size)
    seq_len = SETUPS[name]["seq_len"]
    timing = measure.time_fn(lambda: train_step(model, optimizer, batch), device=prof.device, warmup=1, repeat=3)
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
        "step time (s)": timing.median_s,
        **{k.replace("_per_s", "/s"): v for k, v in flops.throughput(batch_size, seq_len, timing.median_s).items()},
        "weights + optimizer states (GiB)": fixed / GIB,
        "saved activations (GiB)": saved.total_bytes / GIB,
        "allocated after forward (GiB)": phases.loc["forward", "allocated_mib"] * MIB / GIB,
        "peak of the step (GiB)": phases["peak_allocated_mib"].max() * MIB / GIB,
    }


batch_sizes = prof.pick(tiny=[1, 2, 4, 8], full=[1, 2, 4, 8, 16, 32])
sweep = {}
for name in SETUPS:
    model, optimizer = build(name)
    rows = {}
    for bs in batch_sizes:
        attempt = batching.try_batch(lambda b, n=name, m=model, o=optimizer: measure_batch(n, m, o, b), bs)
        rows[bs] = attempt.value if attempt.fits else {"result": f"out of memory ({attempt.error})"}
    sweep[name] = pd.DataFrame.from_dict(rows, orient="index").rename_axis("batch")
    cleanup.free(globals(), "model", "optimizer")
sweep["bert-large-uncased"]

# %%
sweep["polyglot-ko-1.3b"]

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
    }
fit = pd.DataFrame(fit_rows).T
if prof.is_full and prof.on_gpu:
    for key, name in (("bert", "bert-large-uncased"), ("llm", "polyglot-ko-1.3b")):
        glue(f"{key}_fixed_fit_gib", fit.loc[name, "fixed part, fitted (GiB)"])
        glue(f"{key}_fixed_acc_gib", fit.loc[name, "weights + optimizer states (GiB)"])
        glue(f"{key}_per_sample_mib", fit.loc[name, "per sample, fitted (MiB)"])
        glue(f"{key}_saved_per_sample_mib", fit.loc[name, "saved activations per sample (MiB)"])
        glue(f"{key}_sat_batch", int(fit.loc[name, "batch reaching 95% of best samples/s"]))
        glue(f"{key}_best_samples_s", fit.loc[name, "best samples/s"])
        df = sweep[name]
        glue(f"{key}_samples_s_1", df.loc[1, "samples/s"])
fit

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 4))
for ax, (name, df) in zip(axes, sweep.items()):
    ok = df.dropna(subset=["step time (s)"])
    measured = ok["allocated after forward (GiB)"] if prof.on_gpu else (
        ok["weights + optimizer states (GiB)"] + ok["saved activations (GiB)"])
    ax.plot(ok.index, measured, "o", label="after the forward pass" if prof.on_gpu else "accounted: states + activations")
    line = fit.loc[name, "fixed part, fitted (GiB)"] + fit.loc[name, "per sample, fitted (MiB)"] * MIB / GIB * ok.index
    ax.plot(ok.index, line, "k--", label="fit: fixed + per sample x batch")
    if prof.on_gpu:
        ax.plot(ok.index, ok["peak of the step (GiB)"], "s", label="peak of the step")
        ax.axhline(t4_budget_gib, color="grey", linestyle=":", label="emulated T4 budget")
    ax.axhline(fit.loc[name, "weights + optimizer states (GiB)"], color="C2", linewidth=1, label="weights + optimizer states")
    ax.set_xlim(left=0)  # a linear axis: the fit is a straight line
    ax.set_title(f"{name}, seq {SETUPS[name]['seq_len']}")
    ax.set_xlabel("batch size (samples)")
    ax.set_ylabel("memory (GiB)")
axes[0].legend()
fig.suptitle("Memory = a fixed part + activations per sample: a straight line in the batch size")
fig.tight_layout()

# %% [markdown]
# The fit's intercept is {glue:text}`bert_fixed_fit_gib:.2f` GiB for bert-large, against
# {glue:text}`bert_fixed_acc_gib:.2f` GiB of fp32 weights and AdamW states (12 bytes per parameter), and
# {glue:text}`llm_fixed_fit_gib:.2f` GiB for the 1.3B model, against {glue:text}`llm_fixed_acc_gib:.2f` GiB
# (6 bytes per parameter in pure fp16). Each sample adds {glue:text}`bert_per_sample_mib:,.0f` MiB to
# bert-large at 512 tokens ({glue:text}`bert_saved_per_sample_mib:,.0f` MiB of it saved for backward) and
# {glue:text}`llm_per_sample_mib:,.0f` MiB to the 1.3B model at 256 tokens
# ({glue:text}`llm_saved_per_sample_mib:,.0f` MiB saved). What the fit does not see is the step's peak
# (squares): at small batches it lies above the line, because the peak is then not in the forward pass but in
# the optimizer step or the backward pass, where gradients and temporary buffers join the fixed part
# (chapter 1, section 1.5).
#
# Now what the memory buys:

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 4))
for ax, (name, df) in zip(axes, sweep.items()):
    ok = df.dropna(subset=["step time (s)"])
    ax.plot(ok.index, ok["samples/s"], "o-")
    ax.axhline(0.95 * ok["samples/s"].max(), color="grey", linestyle=":", label="95% of the best")
    ax.set_xscale("log", base=2)
    ax.set_ylim(bottom=0)
    ax.set_title(f"{name}, seq {SETUPS[name]['seq_len']}")
    ax.set_xlabel("batch size (samples)")
    ax.set_ylabel("throughput (samples/s)")
    ax.legend(loc="lower right")
fig.suptitle("Throughput grows with the batch until the GPU is busy, then stays flat")
fig.tight_layout()

# %% [markdown]
# bert-large reaches 95% of its best throughput ({glue:text}`bert_best_samples_s:.1f` samples/s) at batch
# {glue:text}`bert_sat_batch`; at batch 1 it manages {glue:text}`bert_samples_s_1:.1f`. The 1.3B model reaches
# 95% of its best ({glue:text}`llm_best_samples_s:.1f` samples/s) at batch {glue:text}`llm_sat_batch`, from
# {glue:text}`llm_samples_s_1:.1f` at batch 1. A small batch leaves the GPU waiting: each kernel has too little
# work to fill the card, and the launch overhead of hundreds of small kernels and the optimizer step, which
# costs the same at any batch size, are paid per step. Once the matrix products are large enough to keep
# the card busy, more samples per step only cost proportionally more time. Beyond that point a larger batch
# is a question of optimisation (how many samples each update should average), not of speed; below it,
# gradient accumulation cannot help either, as section 3.4 shows.

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
# `train_step` above; one step at batch 1 first creates AdamW's states, so that every attempt sees the
# memory a real training step sees from its second iteration on.

# %%
name = "polyglot-ko-1.3b"
model, optimizer = build(name)
train_step(model, optimizer, make_batch(name, 1))  # AdamW's states exist from here on
batching.release()
baseline_mib = batching.allocated_mib()


def polyglot_step(batch_size):
    train_step(model, optimizer, make_batch(name, batch_size))


if profiles.cuda_or_skip("a real out-of-memory error needs a GPU; on a CPU the search runs against a simulated limit"):
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
# Under the T4 budget ({glue:text}`t4_budget_gib:.2f` GiB for the allocator) the largest batch is {glue:text}`search_t4_largest`, found in
# {glue:text}`search_t4_attempts` attempts; batch 16 fails, as in the LLM book and in chapter 1. The whole card
# takes {glue:text}`search_full_largest` sequences of 256 tokens (to a multiple of 8, in
# {glue:text}`search_full_attempts` attempts). After every attempt, the failed ones included, allocated memory
# is back at the baseline of {glue:text}`search_baseline_mib:,.0f` MiB, the weights and AdamW's states; the
# largest deviation is {glue:text}`search_max_dev_mib:.1f` MiB. The check below asserts it (a step whose tensors
# leaked would hold hundreds of MiB).

# %%
if prof.on_gpu:
    after = pd.concat([t4_search.to_frame(), full_search.to_frame()])["allocated after cleanup (MiB)"]
    deviation_mib = (after - baseline_mib).abs().max()
    assert deviation_mib < 32, f"memory leaked: {deviation_mib:.1f} MiB"  # a leaked step would hold hundreds
    print(f"every attempt left {after.min():,.1f} to {after.max():,.1f} MiB allocated (baseline {baseline_mib:,.1f})")
    if prof.is_full:
        glue("search_t4_largest", t4_search.largest)
        glue("search_t4_attempts", len(t4_search.attempts))
        glue("search_full_largest", full_search.largest)
        glue("search_full_attempts", len(full_search.attempts))
        glue("search_baseline_mib", baseline_mib)
        glue("search_max_dev_mib", deviation_mib)
freed = cleanup.free(globals(), "model", "optimizer")


# %% [markdown]
# The largest batch that fits is rarely the one to train with: section 3.1 showed that throughput stopped
# growing long before. A search like this answers a different question: how much headroom a setup has, and
# whether a batch size found on one card will survive on another. (Leave some room: a real dataset's
# longest sequences, or a different allocator state, can need more than random data of fixed length.)
# Accelerate offers the same idea as a decorator, `accelerate.utils.find_executable_batch_size`, which starts
# high and shrinks the batch after each failure (by 10% each time in accelerate 1.15).

# %% [markdown]
# ## 3.3 Gradient accumulation, written out
#
# The loss of a batch is the mean of its samples' losses, so its gradient is the mean of their gradients.
# Split a batch of $B \times N$ samples into $N$ micro-batches of $B$: the mean over all of them is the sum,
# over the micro-batches, of each micro-batch's mean divided by $N$. `backward()` *adds* into `.grad`, so
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
if prof.is_full:
    glue("grad_rel_diff", grad_check.iloc[0])
grad_check.to_frame().map("{:.2e}".format)

# %% [markdown]
# The accumulated gradients agree with the large batch's to {glue:text}`grad_rel_diff:.1e` of the largest
# gradient, a few units of the last digit fp32 keeps. Without the division they are $N$ times too large.
# Note that AdamW would hide that bug: it divides each update by a running estimate of the gradient's size,
# so a constant factor on all gradients barely changes its steps (SGD, gradient clipping and the reported
# loss would all be off).
#
# **Check 2: the training run.** Two copies of the same initial model train for several steps on the same
# sequences, in the same order: one with batches of $B \times N$, one with $N$ accumulated micro-batches of $B$
# (the loop above, with `accumulation_steps=1` for the first).

# %%
runs = {}
for label, bs, steps_per_update in [(f"batch {micro_bs * n_accum}", micro_bs * n_accum, 1),
                                    (f"{n_accum} x {micro_bs}, accumulated", micro_bs, n_accum)]:
    model_run = build_small()
    optimizer = torch.optim.AdamW(model_run.parameters(), lr=small_lr)
    batches = [to_device(b) for b in train.batches(markov, bs, shuffle=False)]
    runs[label] = (train_accumulating(model_run, optimizer, batches, steps_per_update), model_run)
(loss_big, model_big), (loss_acc, model_acc) = runs.values()
curves = pd.DataFrame({label: losses for label, (losses, _) in runs.items()})
torch.testing.assert_close(torch.tensor(loss_acc), torch.tensor(loss_big), rtol=1e-4, atol=1e-5)
param_diff = (sum((p - q).square().sum() for p, q in zip(model_acc.parameters(), model_big.parameters())).sqrt()
              / sum(p.square().sum() for p in model_big.parameters()).sqrt()).item()
assert param_diff < 1e-4, f"the two runs' weights drifted apart: {param_diff:.1e}"
if prof.is_full:
    glue("traj_max_loss_diff", float((curves.iloc[:, 0] - curves.iloc[:, 1]).abs().max()))
    glue("traj_param_diff", param_diff)
    glue("traj_final_loss", loss_acc[-1])
    glue("traj_steps", n_steps)
fig = plots.lines(curves.reset_index().assign(step=lambda d: d["index"] + 1), x="step", ys=list(curves.columns),
                  styles=["-", "o"], title="Accumulated micro-batches follow the large batch's training run step for step",
                  xlabel="optimizer step", ylabel="loss (nats per token)")
fig.axes[0].lines[1].set_markersize(3)
fig.axes[0].axhline(data.markov_loss_floor(4), color="grey", linestyle=":", label="best possible: ln 4")
fig.axes[0].legend()
fig.tight_layout()

# %% [markdown]
# The curves lie on top of each other for all {glue:text}`traj_steps` steps: the largest difference between
# the two runs' losses is {glue:text}`traj_max_loss_diff:.1e` nats, and after the last step their weights
# differ by {glue:text}`traj_param_diff:.1e` of their norm. Both learn the chain (final loss
# {glue:text}`traj_final_loss:.2f`, floor $\ln 4 = 1.39$). The assertions above would fail for any loop that
# steps too often, forgets `zero_grad` or drops a micro-batch.
#
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
# that a configuration that does not fit a 15 GB card fails here too. Time is per optimizer step, the median of
# three after a warm-up step; throughput counts the samples of the effective batch.

# %%
def accumulation_cost(name, model, optimizer, micro_size, steps_per_update):
    """Time, throughput and memory of one optimizer step over ``steps_per_update`` micro-batches."""
    micro = [make_batch(name, micro_size, seed=i) for i in range(steps_per_update)]

    def one_update():
        try:
            train_accumulating(model, optimizer, micro, steps_per_update)
        finally:
            optimizer.zero_grad(set_to_none=True)

    one_update()  # warm-up; creates AdamW's states on first use
    measure.reset_peak(prof.device)
    timing = measure.time_fn(one_update, device=prof.device, warmup=0, repeat=3)
    samples = micro_size * steps_per_update
    row = {"effective batch": samples, "step time (s)": timing.median_s, "samples/s": samples / timing.median_s}
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
cost_rows = {}
for label, (micro_size, steps_per_update) in HF_ROWS.items():
    with t4_or_nothing():
        attempt = batching.try_batch(
            lambda m, s=steps_per_update: accumulation_cost(name, model, optimizer, m, s), micro_size)
    cost_rows[label] = attempt.value if attempt.fits else {"result": f"out of memory ({attempt.error})"}
if profiles.cuda_or_skip("the whole card differs from the T4 only on a larger GPU"):
    attempt = batching.try_batch(lambda m: accumulation_cost(name, model, optimizer, m, 1), 16)
    cost_rows["bs 16, whole card"] = attempt.value if attempt.fits else {"result": f"out of memory ({attempt.error})"}
bert_grad_gib = accounting.param_bytes(model) / GIB  # fp32 gradients: one per weight, the weights' size
cleanup.free(globals(), "model", "optimizer")
hf_docs = pd.DataFrame({  # the guide's printout for 512 samples of 512 tokens on a 16 GB V100
    "HF docs V100: time (s)": {"bs 4": 57.82, "bs 1 x ga 4": 66.03},
    "HF docs V100: samples/s": {"bs 4": 8.86, "bs 1 x ga 4": 7.75},
    "HF docs V100: NVML used (MiB)": {"bs 4": 14949, "bs 1 x ga 4": 8681},
})
cost = pd.DataFrame.from_dict(cost_rows, orient="index").join(hf_docs)
cost

# %%
if prof.is_full and prof.on_gpu:
    for label, key in (("bs 4", "bs4"), ("bs 1 x ga 4", "bs1ga4"), ("bs 4 x ga 4", "bs4ga4"), ("bs 16, whole card", "bs16full")):
        glue(f"cost_{key}_peak_gib", cost.loc[label, "peak allocated (GiB)"])
        glue(f"cost_{key}_samples_s", cost.loc[label, "samples/s"])
        glue(f"cost_{key}_step_s", cost.loc[label, "step time (s)"])
    glue("cost_bs16_result", cost_rows["bs 16"].get("result", "fits"))
    glue("cost_bs4ga4_extra_gib", cost.loc["bs 4 x ga 4", "peak allocated (GiB)"] - cost.loc["bs 4", "peak allocated (GiB)"])
    glue("bert_grads_gib", bert_grad_gib)
    glue("cost_bs1ga4_speed_ratio", cost.loc["bs 1 x ga 4", "samples/s"] / cost.loc["bs 4", "samples/s"])
    glue("cost_bs1ga4_mem_ratio", cost.loc["bs 1 x ga 4", "peak allocated (GiB)"] / cost.loc["bs 4", "peak allocated (GiB)"])
    glue("cost_bs4ga4_vs_bs16", cost.loc["bs 4 x ga 4", "samples/s"] / cost.loc["bs 16, whole card", "samples/s"])
    glue("hf_speed_ratio", 7.75 / 8.86)
    glue("hf_mem_ratio", 8681 / 14949)
ok = cost.dropna(subset=["step time (s)"])
fig, (ax_mem, ax_speed) = plt.subplots(1, 2, figsize=(11, 4))
if prof.on_gpu:
    ax_mem.bar(ok.index, ok["peak allocated (GiB)"], color="C3")
    ax_mem.axhline(t4_budget_gib, color="grey", linestyle=":", label="emulated T4 budget")
    ax_mem.legend(loc="upper left")
else:
    ax_mem.text(0.5, 0.5, "peak memory is measured on a GPU", ha="center", va="center", transform=ax_mem.transAxes)
    ax_mem.set_xticks([])
ax_mem.set_ylabel("peak allocated (GiB)")
ax_mem.set_title("memory: set by the micro-batch")
ax_speed.bar(ok.index, ok["samples/s"], color="C0")
ax_speed.set_ylabel("throughput (samples/s)")
ax_speed.set_title("throughput: set by the micro-batch too")
for ax in (ax_mem, ax_speed):
    ax.tick_params(axis="x", labelrotation=20)
fig.suptitle("bert-large, fp32, 512 tokens: memory and speed follow the micro-batch, not the effective batch")
fig.tight_layout()


# %% [markdown]
# Under the T4 budget batch 16 does not fit ("{glue:text}`cost_bs16_result`"); batch 4 x 4 accumulates the
# same 16 samples per update at a peak of {glue:text}`cost_bs4ga4_peak_gib:.2f` GiB, against batch 4's
# {glue:text}`cost_bs4_peak_gib:.2f` GiB. The difference, {glue:text}`cost_bs4ga4_extra_gib:.2f` GiB, is close to
# the {glue:text}`bert_grads_gib:.2f` GiB of gradients: from the second micro-batch on, the forward pass runs
# while the gradients accumulated so far are held, where a plain step has just freed them. Speed follows the
# micro-batch too: batch 4 x 4 runs at {glue:text}`cost_bs4ga4_vs_bs16:.2f` times the throughput of a real batch
# 16 (measured on the whole card), because it runs batch 4's kernels four times.
#
# The guide's row, batch 1 x 4 against batch 4: here it needs {glue:text}`cost_bs1ga4_mem_ratio:.2f` times the
# peak memory and runs at {glue:text}`cost_bs1ga4_speed_ratio:.2f` times the throughput; the guide measured
# {glue:text}`hf_mem_ratio:.2f` times the NVML memory and {glue:text}`hf_speed_ratio:.2f` times the throughput on
# a V100. Accumulation saves only the activations of the samples that are no longer in the micro-batch;
# weights, gradients and optimizer states stay (the peak does not fall below them), and every micro-batch
# smaller than the point where throughput saturates (section 3.1) costs speed. Hence the guide's advice, which
# the measurement supports: to reach a large effective batch, keep the micro-batch as large as fits and
# accumulate the rest (batch 4 x 16 rather than 1 x 64 for 64 samples).
#
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
if prof.is_full and prof.on_gpu:
    glue("book_bs4ga4_first_gib", book.loc["bs 4 x ga 4", "allocated after 1st step (GiB)"])
    glue("book_bs4ga4_gap_gib", 10.586 - book.loc["bs 4 x ga 4", "allocated after 1st step (GiB)"])
    glue("book_bs4ga4_peak_gib", book.loc["bs 4 x ga 4", "peak allocated (GiB)"])
    glue("book_bs16_result", book.loc["bs 16", "result"])
book

# %% [markdown]
# As in the book, batch 16 fails ("{glue:text}`book_bs16_result`") and batch 4 x 4 runs. Read where the book
# reads it, memory is {glue:text}`book_bs4ga4_first_gib:.2f` GiB: the fp16 weights, their gradients and AdamW's
# two states, 9.92 GiB together, plus the last micro-batch's leftovers. The book's 10.586 is
# {glue:text}`book_bs4ga4_gap_gib:.2f` GiB more. Part of the gap is known: its model, loaded from the real
# checkpoint, already took 2.599 GiB against our 2.48, and its loop keeps the model's last output (the logits)
# alive at that moment; the rest cannot be seen from outside. The peak, which
# decides whether a step fits, is higher: {glue:text}`book_bs4ga4_peak_gib:.2f` GiB (chapter 1 found it in the
# optimizer step).
#
# **The Trainer.** `TrainingArguments(gradient_accumulation_steps=4)` runs the same loop inside the
# `Trainer`. We train bert-large for one epoch at batch 4 x 4 both ways, with the same optimizer (PyTorch's
# AdamW, constant learning rate, no gradient clipping: the Trainer clips at 1.0 by default), and compare time
# and peak memory for the whole epoch, first step included.

# %%
n_epoch = prof.pick(tiny=32, full=128)
epoch_data = data.dummy_dataset(n_epoch, SETUPS[name]["seq_len"], seed=0)
epoch_rows = {}

model, optimizer = build(name)
measure.reset_peak(prof.device)
measure.synchronize(prof.device)
start = time.perf_counter()
train_accumulating(model, optimizer, (to_device(b) for b in train.batches(epoch_data, 4, shuffle=False)), 4)
measure.synchronize(prof.device)
epoch_rows["hand-written loop"] = {"time (s)": time.perf_counter() - start}
if prof.on_gpu:
    epoch_rows["hand-written loop"]["peak allocated (GiB)"] = torch.cuda.max_memory_allocated() / GIB
cleanup.free(globals(), "model", "optimizer")

model, _ = build(name)
args = TrainingArguments(
    output_dir="trainer_tmp", per_device_train_batch_size=4, gradient_accumulation_steps=4, num_train_epochs=1,
    learning_rate=1e-5, weight_decay=0.0, optim="adamw_torch", lr_scheduler_type="constant", max_grad_norm=0.0,
    seed=0, logging_strategy="no", save_strategy="no", report_to="none", disable_tqdm=True,
    dataloader_pin_memory=prof.on_gpu,
)
measure.reset_peak(prof.device)
result = Trainer(model=model, args=args, train_dataset=epoch_data).train()
epoch_rows["Trainer"] = {"time (s)": result.metrics["train_runtime"]}
if prof.on_gpu:
    epoch_rows["Trainer"]["peak allocated (GiB)"] = torch.cuda.max_memory_allocated() / GIB
cleanup.free(globals(), "model", "result")
epoch = pd.DataFrame(epoch_rows).T
epoch["samples/s"] = n_epoch / epoch["time (s)"]
if prof.is_full and prof.on_gpu:
    glue("trainer_samples_s", epoch.loc["Trainer", "samples/s"])
    glue("hand_samples_s", epoch.loc["hand-written loop", "samples/s"])
    glue("trainer_peak_gib", epoch.loc["Trainer", "peak allocated (GiB)"])
    glue("hand_peak_gib", epoch.loc["hand-written loop", "peak allocated (GiB)"])
epoch

# %% [markdown]
# The `Trainer` processed {glue:text}`trainer_samples_s:.1f` samples/s with a peak of
# {glue:text}`trainer_peak_gib:.2f` GiB; the hand-written loop {glue:text}`hand_samples_s:.1f` samples/s and
# {glue:text}`hand_peak_gib:.2f` GiB. With the same optimizer they do the same arithmetic; what differs is the
# `Trainer`'s bookkeeping around it (its data loader, learning-rate scheduler and logging). Two of its defaults,
# switched off above to compare like with like, change the picture when left on:

# %%
defaults = TrainingArguments(output_dir="trainer_tmp", report_to="none")
pd.Series({"optim": str(defaults.optim.value), "max_grad_norm": defaults.max_grad_norm,
           "lr_scheduler_type": str(defaults.lr_scheduler_type.value)}, name="TrainingArguments defaults")

# %% [markdown]
# Gradient clipping (`max_grad_norm`) computes the norm of all gradients once per update. If the default
# optimizer is `adamw_torch_fused`, PyTorch's fused AdamW updates all parameters in a few kernels without the
# multi-tensor version's temporary buffers (chapter 1), which lowers the optimizer step's peak.

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
if prof.is_full:
    glue("pit_tokens", ", ".join(str(n_tokens(p)) for p in parts))
    glue("pit_ref_loss", pitfall.iloc[0, 0])
    glue("pit_naive_loss", naive.iloc[0])
    glue("pit_naive_grad", naive.iloc[1])
    glue("pit_fixed_grad", max(by_hand.iloc[1], by_hf.iloc[1]))
print(f"tokens per micro-batch: {[n_tokens(p) for p in parts]}, total {total_tokens}")
pitfall.assign(**{"loss (nats/token)": pitfall["loss (nats/token)"].map("{:.4f}".format),
                  "gradient: max relative difference": pitfall["gradient: max relative difference"].map("{:.1e}".format)})

# %% [markdown]
# The micro-batches hold {glue:text}`pit_tokens` tokens. Over all tokens the loss is
# {glue:text}`pit_ref_loss:.4f` nats per token; the mean of the micro-batch means is
# {glue:text}`pit_naive_loss:.4f`. The two are close here because every token of this chain is as hard to
# predict as any other, wherever it sits; in real text, where later tokens have more context to go on, short and
# long sequences differ more. The gradient shows what is wrong: it is off by {glue:text}`pit_naive_grad:.2f` of
# the largest gradient, not rounding but a different objective, in which each token of the shortest
# micro-batch weighs several times as much as one of the longest. Both fixes agree with the reference to
# {glue:text}`pit_fixed_grad:.1e`. The rule: divide the *sum* of the token losses by the number of tokens in the
# whole accumulated batch, which must be counted before the first micro-batch runs.
#
# This was a real bug in the Hugging Face `Trainer` until October 2024: it divided each micro-batch's mean loss
# by the number of accumulation steps, exactly the naive line above, so runs with accumulation did not match
# runs with the same effective batch. Transformers 4.46 changed it: the `Trainer` now counts the label tokens of
# all micro-batches of an update and passes that count to the model's loss as `num_items_in_batch`, and the
# models' built-in losses sum the token losses and divide by it (the last row of the table; custom losses must
# take the argument themselves). Releases after 4.46 fixed further corner cases of the same accounting, so use
# a recent version, and check, as here, when you write your own loop.

# %%
cleanup.free(globals(), "model_acc", "pitfall_grads", "reference", "whole", "parts", "markov")
if prof.on_gpu:
    print(f"allocated at the end: {torch.cuda.memory_allocated() / MIB:,.0f} MiB")

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
#   activations that grow linearly
#   with the batch: {glue:text}`bert_per_sample_mib:,.0f` MiB per sample for bert-large at 512 tokens,
#   {glue:text}`llm_per_sample_mib:,.0f` MiB for the 1.3B model at 256. Throughput stops growing once the GPU is
#   busy; past that point a larger batch is an optimisation choice, not a speed-up.
# - The largest batch that fits can be found safely: catch `torch.OutOfMemoryError`, let the `except` block end,
#   then free; memory returns to its baseline after every failure.
# - Gradient accumulation with `loss / N` gives the large batch's gradients to fp32 rounding and the same
#   training run, at the micro-batch's memory and the micro-batch's speed.
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
# 1. In section 3.1, add batch 64 to `batch_sizes` for bert-large. Predict its memory from the fit before you
#    run it. Does throughput still move?
#
#    <details><summary>Hint</summary>
#
#    The fit of section 3.1 gives memory = fixed + per sample × batch.
#
#    </details>
#
#    <details><summary>Answer</summary>
#
#    Fixed part plus 64 times bert-large's per-sample cost from section 3.1's fit table; on a large GPU it fits, and throughput stays within a few percent of its plateau: the GPU is already busy.
#
#    </details>
#
# 2. In section 3.2, search with `SETUPS["polyglot-ko-1.3b"]["attn_implementation"] = "sdpa"`. The fused
#    attention stores no $s \times s$ matrix: how much larger is the largest batch under the T4 budget?
#
#    <details><summary>Hint</summary>
#
#    Eager attention's per-sample activations include about $5 a s^2$ bytes per layer for the $s \times s$ matrices; SDPA stores none.
#
#    </details>
#
#    <details><summary>Answer</summary>
#
#    At 256 tokens, 16 heads and hidden size 2048 the $s^2$ term is roughly a quarter of a layer's activation bytes, so the per-sample cost falls by about that much and the largest batch grows by roughly a third.
#
#    </details>
#
# 3. In section 3.3, replace AdamW with `torch.optim.SGD(lr=0.1)` and run the training check with the buggy
#    loop (no division by $N$). Does the assertion catch it now? Why did AdamW hide it?
#
#    <details><summary>Hint</summary>
#
#    AdamW divides the update by the square root of the second moment: multiplying every gradient by $N$ leaves its update almost unchanged.
#
#    </details>
#
#    <details><summary>Answer</summary>
#
#    Yes: with SGD the update is $N$ times too large, so gradients and losses leave the large batch's run and the assertion fails. AdamW is nearly invariant to a constant gradient scale (only $\epsilon$ breaks it), which hid the bug.
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
# - {cite:t}`hf_perf_train_gpu_one`: batch size and gradient accumulation on one GPU, the V100 rows of
#   section 3.4.
# - {cite:t}`heo2024llm`, chapter 5: the polyglot-ko-1.3b experiment, batch 16 against batch 4 x 4 on a T4.
# - {cite:t}`hf_gradient_accumulation_fix`: the loss normalisation fix of transformers 4.46.
# - {cite:t}`korthikanti2022reducing`: activation memory per sample (chapter 1, section 1.4).
