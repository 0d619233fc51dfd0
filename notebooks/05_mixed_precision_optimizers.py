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
# # 5. Mixed precision, optimizers and tensor-core shapes
#
# Chapter 1 counted 16 bytes of model states per parameter for fp32 training with AdamW: 4 for the weights, 4 for
# the gradients, 8 for the optimizer. The activations came on top. This chapter changes the arithmetic of a
# training step in three ways: the precision the matrix products run in, the optimizer and the bytes it keeps, and
# the shapes of the matrices, which decide whether the GPU's tensor cores run at full speed. Each change is
# measured on the same model, against the rule that is supposed to predict it.
#
# **What you will learn**
#
# - how `torch.autocast` and `GradScaler` change a training step in fp32, TF32, fp16 and bf16: time, peak memory,
#   and the loss curve;
# - how many gradients an fp16 backward pass loses without loss scaling;
# - what stays in fp32 under mixed precision, and what the 16- and 18-byte rules count;
# - when mixed precision *raises* the peak memory instead of lowering it;
# - the state bytes per parameter of AdamW (foreach and fused), SGD with momentum, Adafactor, and the 8-bit and
#   paged 8-bit AdamW of bitsandbytes, with their step times and loss curves;
# - how a matrix product is cut into tiles, why matrix sizes that are multiples of 64 run faster, and how far the
#   measured matmul ceiling is from the datasheet.
#
# **Prerequisites:** [chapter 1](01_memory_anatomy.ipynb) (the memory components and the four memory numbers) and
# [chapter 2](02_dtypes_quantization.ipynb) (number formats, block-wise quantization).
# On a CPU this notebook runs tiny versions of the models; the numbers in the text come from the full-size run on the
# GPU named in the first output below.

# %%
import sys

if "google.colab" in sys.modules:  # Colab only. pip adds what Colab lacks (bitsandbytes, the book's helpers)
    # and upgrades transformers to the 5.x the book needs: nothing has imported it yet in this kernel, so no
    # restart is needed. Colab's torch already meets the book's floor and is kept (see the setup page).
    # %pip install -q --no-warn-conflicts "gpu-efficient-training @ git+https://github.com/gpu-efficient-training/book"

from helpers import env

env.quiet()  # warnings without file paths, no progress bars: outputs that read the same everywhere

import itertools
import time

import matplotlib.pyplot as plt
import pandas as pd
import torch

from helpers import accounting, cleanup, data, estimates, flops, measure, models, plots, profiles, train
from helpers.glue import glue
from helpers.measure import GIB, MIB

plots.use_style()
pd.options.display.float_format = "{:,.2f}".format
prof = profiles.get()
dev = prof.device
env.report(prof)

# %% [markdown]
# ## 5.1 One training step, four precisions
#
# [Chapter 2](02_dtypes_quantization.ipynb) took the formats apart: fp32 has 8 exponent and 23 mantissa bits; fp16
# keeps 10 mantissa bits but only 5 exponent bits, so it overflows past 65,504 and flushes values below
# $2^{-24} \approx 6 \times 10^{-8}$ to zero; bf16 {cite:p}`kalamkar2019bfloat16` keeps fp32's 8 exponent bits and
# 7 mantissa bits, fp32's range with less precision. TF32 is not a storage format: it is how NVIDIA's tensor cores
# (since the A100) multiply fp32 matrices, reading 10 of the 23 mantissa bits and accumulating in fp32. Here we
# train with them.
#
# *Mixed precision* in PyTorch is `torch.autocast`: the weights stay in fp32, and inside the autocast region each
# operation runs in the dtype that suits it. Matrix products (linear layers, attention) cast their inputs to 16
# bits and run on the tensor cores; operations that need range or accumulate many values (softmax, layer norm, the
# loss, sums) run in fp32. The backward pass follows the same dtypes, the gradients arrive in fp32 because the
# weights are fp32, and the optimizer updates the fp32 weights: the *master weights* of
# {cite:t}`micikevicius2018mixed`. With fp16, a `GradScaler` does their *loss scaling*: it multiplies the loss by a
# scale $S$ before `backward()`, so that small gradients stay inside fp16's range on their way back, divides the
# gradients by $S$ before the step, skips the step when a gradient overflowed to inf, and adapts $S$ as it goes.
#
# Four recipes on bert-large (seed 0, the same initial weights and batches for each): fp32; TF32 (the same code
# with `torch.backends.cuda.matmul.allow_tf32 = True`, off by default in PyTorch); fp16 autocast with `GradScaler`;
# bf16 autocast. The task is `data.keyword_dataset`: label 1 when a keyword token occurs in the sequence. Short
# sequences (16 tokens, 64 per batch) make it learnable from random weights in a short run: the loss sits at
# $\ln 2 \approx 0.69$ nats (guessing) until the model finds the keyword, then falls. The loop is the lesson, so here
# it is in full; every recipe runs the same lines, and the ones that do not apply are switched off by
# `enabled=False`.

# %%
RECIPES = {"fp32": None, "tf32": None, "fp16": torch.float16, "bf16": torch.bfloat16}
kw_seq, kw_batch = 16, prof.pick(tiny=16, full=64)
# bert-large diverges at lr 1e-4; a probe of 1e-5 to 1e-4 on the H200 found 2e-5 with 20 warm-up steps learns the
# task in about 50 steps (the tiny twin needs a larger rate to move at all in its 12 steps)
kw_steps, warmup_steps, kw_lr = prof.pick(tiny=12, full=120), 20, prof.pick(tiny=1e-4, full=2e-5)
ds_kw = data.keyword_dataset(kw_steps * kw_batch, kw_seq, seed=0)
tiny_input = {"input_ids": ds_kw[:1]["input_ids"][:, :8].to(dev), "labels": ds_kw[:1]["labels"].to(dev)}


def learned_at(losses, threshold=0.1, window=5):
    """The first step at which the mean loss of the last ``window`` steps is below ``threshold`` (NaN: never)."""
    smooth = pd.Series(losses).rolling(window).mean()
    below = smooth[smooth < threshold]
    return float(below.index[0] + 1) if len(below) else float("nan")


def train_recipe(recipe, steps=kw_steps, lr=kw_lr):
    """Train a fresh bert-large for `steps` steps in one recipe; return losses, step times and memory."""
    half = RECIPES[recipe]
    torch.backends.cuda.matmul.allow_tf32 = recipe == "tf32"  # a GPU switch; a CPU ignores it
    model = models.build("bert-large-uncased", head="sequence-classification", seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler(dev, enabled=recipe == "fp16")
    losses, times, skipped = [], [], 0
    measure.reset_peak(dev)
    for i, batch in enumerate(itertools.islice(train.batches(ds_kw, kw_batch, seed=0), steps)):
        batch = {k: v.to(dev) for k, v in batch.items()}
        for group in optimizer.param_groups:  # linear warm-up of the learning rate
            group["lr"] = lr * min(1.0, (i + 1) / warmup_steps)
        scale_before = scaler.get_scale()
        measure.synchronize(dev)
        start = time.perf_counter()
        with torch.autocast(dev, dtype=half, enabled=half is not None):
            loss = model(**batch).loss
        scaler.scale(loss).backward()  # fp16: backward of S * loss; otherwise plain backward
        scaler.step(optimizer)  # fp16: unscale the gradients, skip the step if one is inf or nan
        scaler.update()  # fp16: halve S after an overflow, double it after 2000 clean steps
        optimizer.zero_grad(set_to_none=True)
        measure.synchronize(dev)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
        skipped += scaler.get_scale() < scale_before
    peak = measure.allocator_mib()["peak_allocated_mib"] * MIB / GIB if prof.on_gpu else float("nan")
    # What stays in fp32: the weights, their gradients and AdamW's two states.
    with torch.autocast(dev, dtype=half, enabled=half is not None):
        model(**batch).loss.backward()
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
    assert all(s.dtype == torch.float32 for st in optimizer.state.values() for s in st.values() if s.dim() > 0)
    states = accounting.model_state_bytes(model, optimizer)
    # The 16-bit weight copies autocast keeps for backward: saved bytes of an 8-token input (activations ~ 0).
    with accounting.SavedTensorMeter(model) as copies, torch.autocast(dev, dtype=half, enabled=half is not None):
        model(**tiny_input)
    with accounting.SavedTensorMeter(model) as saved, torch.autocast(dev, dtype=half, enabled=half is not None):
        model(**batch)
    n = models.n_params(model)
    return {
        "recipe": recipe, "losses": losses, "step_s": pd.Series(times[3:]).median(), "peak_gib": peak,
        "saved_gib": saved.total_bytes / GIB, "fp16_skipped": skipped, "final_scale": scaler.get_scale(),
        "weights_bpp": states["weights"] / n, "gradients_bpp": states["gradients"] / n,
        "optimizer_bpp": states["optimizer_states"] / n, "copies_bpp": copies.total_bytes / n, "n_params": n,
    }


runs = {}
for recipe in RECIPES:
    runs[recipe] = train_recipe(recipe)
    cleanup.free(globals())  # the function's model and optimizer are gone; empty the allocator's cache
torch.backends.cuda.matmul.allow_tf32 = False
print(f"{len(runs)} recipes x {kw_steps} steps, batch {kw_batch} x {kw_seq} tokens")

# %% [markdown]
# Every recipe passed the assertions inside the function: after training, the weights, their gradients and
# AdamW's states are all fp32. The table gives the median step time after three warm-up steps, the peak allocated
# memory over the run (GPU only), the bytes saved for backward by one forward pass of a training batch, and the mean
# loss of the last ten steps.

# %%
mp = pd.DataFrame({
    r: {"step (ms)": v["step_s"] * 1e3, "samples/s": kw_batch / v["step_s"],
        "tokens/s": kw_batch * kw_seq / v["step_s"], "peak allocated (GiB)": v["peak_gib"],
        "saved for backward (GiB)": v["saved_gib"], "loss, last 10 steps": pd.Series(v["losses"][-10:]).mean(),
        "loss < 0.1 from step": learned_at(v["losses"]),
        "fp16 steps skipped": v["fp16_skipped"]}
    for r, v in runs.items()
}).T
mp["speed-up vs fp32"] = mp.loc["fp32", "step (ms)"] / mp["step (ms)"]
if prof.is_full and prof.on_gpu:
    for r in RECIPES:
        glue(f"mp_{r}_ms", mp.loc[r, "step (ms)"])
        glue(f"mp_{r}_peak", mp.loc[r, "peak allocated (GiB)"])
        glue(f"mp_{r}_saved", mp.loc[r, "saved for backward (GiB)"])
        glue(f"mp_{r}_loss", mp.loc[r, "loss, last 10 steps"])
        glue(f"mp_{r}_speedup", mp.loc[r, "speed-up vs fp32"])
        glue(f"mp_{r}_learned", mp.loc[r, "loss < 0.1 from step"])
    glue("mp_fp16_skipped", int(mp.loc["fp16", "fp16 steps skipped"]))
    glue("mp_fp16_scale", runs["fp16"]["final_scale"])
    glue("mp_loss0", runs["fp32"]["losses"][0])
    glue("mp_states_gib", 16 * runs["fp32"]["n_params"] / GIB)
mp

# %%
curves = pd.DataFrame({r: v["losses"] for r, v in runs.items()})
fig, ax = plt.subplots()
for r, style in zip(RECIPES, ["-", "--", "-.", ":"]):
    ax.plot(curves.index + 1, curves[r].rolling(5, min_periods=1).mean(), style, label=r)
ax.set_title("bert-large, keyword task: the four precisions learn alike (mean of 5 steps)")
ax.set_xlabel("training step")
ax.set_ylabel("training loss (nats)")
ax.legend()
fig.tight_layout()

# %% [markdown]
# On this GPU a step took {glue:text}`mp_fp32_ms:.0f` ms in fp32, {glue:text}`mp_tf32_ms:.0f` ms with TF32
# ({glue:text}`mp_tf32_speedup:.1f` times fp32's speed, for one line of code), {glue:text}`mp_fp16_ms:.0f` ms with
# fp16 autocast and {glue:text}`mp_bf16_ms:.0f` ms with bf16 autocast ({glue:text}`mp_bf16_speedup:.1f` times fp32's
# speed). That autocast is not faster here is a property of this workload: 64 sequences of 16 tokens are 1,024
# tokens per step, the matrix products are small, and autocast adds a cast of every weight to 16 bits in every
# forward pass; the casts cost more than the faster products save. TF32 speeds up the same products without any
# cast. Section 5.5 measures what the tensor cores give where matrix products are large. The
# loss curves follow each other: starting from {glue:text}`mp_loss0:.2f` nats, each recipe left the plateau and
# its five-step mean fell below 0.1 at step {glue:text}`mp_fp32_learned:.0f` (fp32), {glue:text}`mp_tf32_learned:.0f`
# (TF32), {glue:text}`mp_fp16_learned:.0f` (fp16) and {glue:text}`mp_bf16_learned:.0f` (bf16); the last ten steps
# averaged {glue:text}`mp_fp32_loss:.1e`, {glue:text}`mp_tf32_loss:.1e`, {glue:text}`mp_fp16_loss:.1e` and
# {glue:text}`mp_bf16_loss:.1e` nats. The `GradScaler` skipped {glue:text}`mp_fp16_skipped` of the fp16
# steps because a scaled gradient overflowed, and ended at $S$ = {glue:text}`mp_fp16_scale:,.0f`: this is how it
# finds the largest scale that does not overflow.
#
# Memory: the bytes saved for backward were {glue:text}`mp_fp32_saved:.2f` GiB in fp32 and
# {glue:text}`mp_bf16_saved:.2f` GiB with bf16 autocast, whose activations take half the space but which also keeps
# the 16-bit weight copies described below. The peak allocated memory was {glue:text}`mp_fp32_peak:.2f` GiB in fp32
# and {glue:text}`mp_bf16_peak:.2f` GiB with bf16: at this small batch the peak is the optimizer step (weights,
# gradients, both states and the multi-tensor step's temporary buffer, chapter 1), which mixed precision does not
# touch; the model states under it, {glue:text}`mp_states_gib:.2f` GiB, are the same in every recipe. Section 5.3
# looks at the peak more closely.
#
# **What the 16- and 18-byte rules count.** The Hugging Face guide {cite:p}`hf_training_anatomy` counts mixed
# precision as 18 bytes per parameter: 6 for the weights (an fp32 copy and a 16-bit copy), 4 for the gradients and 8
# for AdamW. The same function measured each part, per parameter, after training:

# %%
# NBVAL_CHECK_OUTPUT
# (byte counts of the model states: identical on every machine; printed as text, identical across pandas versions)
rules = {r: sum(estimates.BYTES_PER_PARAM["fp32_adamw" if RECIPES[r] is None else "mixed_adamw"].values()) for r in RECIPES}
bpp = pd.DataFrame({
    r: {"weights (fp32)": v["weights_bpp"], "gradients (fp32)": v["gradients_bpp"],
        "AdamW states (fp32)": v["optimizer_bpp"], "persistent total": v["weights_bpp"] + v["gradients_bpp"] + v["optimizer_bpp"],
        "rule (bytes/param)": rules[r]}
    for r, v in runs.items()
}).T
print(bpp.round(2).to_string())

# %% [markdown]
# Sixteen persistent bytes in all four recipes. The 16-bit weight copies of the rule are real, but transient:
# autocast casts each weight when a layer first uses it, keeps the copy for the rest of the forward pass (the
# backward pass needs it) and frees it during backward. [Chapter 1](01_memory_anatomy.ipynb) measured them at just
# under 2 bytes per parameter (embeddings and layer norms are not cast). Here, for each recipe:

# %%
copies = pd.Series({r: v["copies_bpp"] for r, v in runs.items()}, name="saved for backward, 8-token input (bytes/param)")
if prof.is_full:
    glue("copies_bf16_bpp", copies["bf16"])
    glue("copies_fp32_bpp", copies["fp32"])
copies

# %% [markdown]
# With 8 tokens the activations are negligible: fp32 and TF32 save {glue:text}`copies_fp32_bpp:.2f` bytes per
# parameter, and keep no weight copies (TF32 rounds inside the tensor core, not in memory); fp16 and bf16 save
# {glue:text}`copies_bf16_bpp:.2f` bytes per parameter, nearly all of it 16-bit weight copies. So the
# 18-byte rule is an upper bound of the model states during the forward pass, and 16 bytes is what stays.
#
# Which operations run in which dtype? Forward hooks on a one-layer bert-large record the dtype of each module's
# output under bf16 autocast:

# %%
probe = models.build("bert-large-uncased", head="sequence-classification", num_hidden_layers=1)
out_dtypes = {}


def record_dtype(module, args, output):
    out = output[0] if isinstance(output, tuple) else output
    if torch.is_tensor(out):
        out_dtypes.setdefault(type(module).__name__, set()).add(str(out.dtype).removeprefix("torch."))


hooks = [m.register_forward_hook(record_dtype) for m in probe.modules()]
with torch.autocast(dev, dtype=torch.bfloat16):
    probe_out = probe(**tiny_input)
for h in hooks:
    h.remove()
assert out_dtypes["Linear"] == {"bfloat16"} and out_dtypes["LayerNorm"] == {"float32"}
assert probe_out.loss.dtype == torch.float32
pd.Series({k: ", ".join(sorted(v)) for k, v in out_dtypes.items() if k in
           ("Embedding", "Linear", "GELUActivation", "LayerNorm", "BertSelfAttention", "BertLayer")} |
          {"loss (cross-entropy)": str(probe_out.loss.dtype).removeprefix("torch.")}, name="output dtype under bf16 autocast")

# %% [markdown]
# Linear layers and attention produce bf16; the embedding lookup, layer norm and the loss produce fp32, and so
# does the residual stream after each layer norm. Autocast keeps lists of which operation runs in which dtype; the
# ones that reduce over many values (norms, softmax, sums, the loss) are on the fp32 list.

# %%
freed = cleanup.free(globals(), "probe", "probe_out", "hooks")

# %% [markdown]
# ## 5.2 Loss scaling: gradients underflow in an fp16 backward pass
#
# Chapter 2 counted the fp32 gradients of bert-large that fp16 *would* flush to zero. Under autocast the question is
# subtler: the weights and their gradients are fp32, but the gradients of the activations flow back through fp16
# matrix products, and each weight gradient is summed from them. So we run it: the gradients of bert-large for one
# batch, three times, with dropout off so that the three passes compute the same function: in fp32 (the
# reference), under fp16 autocast without scaling, and under fp16 autocast with the loss multiplied by $2^{16}$ and
# the gradients divided by it afterwards, which is what `GradScaler` does.

# %%
model = models.build("bert-large-uncased", head="sequence-classification", seed=0).eval()
batch = {k: v.to(dev) for k, v in ds_kw[:kw_batch].items()}


def weight_grads(model, batch, half=None, scale=1.0):
    """All weight gradients of one batch as one fp32 vector, computed under `half` autocast with loss x `scale`."""
    model.zero_grad(set_to_none=True)
    with torch.autocast(dev, dtype=half, enabled=half is not None):
        loss = model(**batch).loss
    (loss * scale).backward()
    return torch.cat([p.grad.flatten() / scale for p in model.parameters() if p.grad is not None])


g_ref = weight_grads(model, batch)
g_fp16 = weight_grads(model, batch, torch.float16)
g_scaled = weight_grads(model, batch, torch.float16, scale=2.0**16)
nonzero = g_ref != 0
n_nonzero = nonzero.sum().item()
scaling = pd.DataFrame({
    name: {"gradients lost: zero, reference not (%)": 100 * ((g == 0) & nonzero).sum().item() / n_nonzero,
           "relative error vs fp32 (%)": 100 * ((g - g_ref).norm() / g_ref.norm()).item()}
    for name, g in {"fp16 autocast, no scaling": g_fp16, "fp16 autocast, loss x 2^16": g_scaled}.items()
}).T
below = {"below 2^-24 (fp16 underflows to 0)": 2.0**-24, "below 2^-14 (fp16 subnormal)": 2.0**-14}
share_below = pd.Series({k: 100 * ((g_ref.abs() < v) & nonzero).sum().item() / n_nonzero for k, v in below.items()},
                        name="share of non-zero fp32 gradients (%)")
if prof.is_full:
    glue("ls_lost_noscale", scaling.iloc[0, 0])
    glue("ls_lost_scaled", scaling.iloc[1, 0])
    glue("ls_err_noscale", scaling.iloc[0, 1])
    glue("ls_err_scaled", scaling.iloc[1, 1])
    glue("ls_below24", share_below.iloc[0])
    glue("ls_below14", share_below.iloc[1])
display(share_below.to_frame())
scaling

# %%
log2 = g_ref[nonzero].abs_().log2_()  # in place: these vectors have one entry per weight
lo, hi = int(log2.min().floor()), int(log2.max().ceil())
counts = torch.histc(log2, bins=hi - lo, min=lo, max=hi).cpu()  # one bin per power of two, on the device
fig, ax = plt.subplots()
ax.stairs(counts.numpy(), range(lo, hi + 1), fill=True, color="#4C72B0")
ax.axvline(-24, color="#C44E52", linestyle="--", label="fp16 smallest subnormal, 2^-24")
ax.axvline(-14, color="#DD8452", linestyle=":", label="fp16 smallest normal, 2^-14")
ax.axvline(-24 - 16, color="grey", linestyle="-.", label="reachable with loss scale 2^16")
ax.set_title("bert-large weight gradients (fp32): a share lies below fp16's range")
ax.set_xlabel("log2 |gradient| (one bin per power of two)")
ax.set_ylabel("number of weights")
ax.legend()
fig.tight_layout()

# %% [markdown]
# In fp32, {glue:text}`ls_below24:.2f`% of this batch's non-zero weight gradients are smaller than $2^{-24}$ and
# {glue:text}`ls_below14:.2f`% smaller than $2^{-14}$. Under fp16 autocast without scaling,
# {glue:text}`ls_lost_noscale:.2f`% of the gradients came out exactly zero although the fp32 reference is not, and
# the gradient vector is {glue:text}`ls_err_noscale:.2f`% away from the reference. (The loss of small values happens
# inside the backward pass, in the fp16 gradients of the activations that each weight gradient is summed from, so
# the two shares need not be equal.) With the loss scaled by $2^{16}$, {glue:text}`ls_lost_scaled:.2f`% are lost
# and the error is {glue:text}`ls_err_scaled:.2f`%: what remains is the rounding of 16-bit products, which no
# scaling removes. bf16 autocast
# needs none of this: its range is fp32's, which is why it is the default choice on GPUs that support it (A100,
# H100 and later; a T4 has no bf16 tensor cores, so on Colab's free GPU fp16 with a scaler is the fast option).

# %%
freed = cleanup.free(globals(), "model", "g_ref", "g_fp16", "g_scaled", "nonzero", "log2")

# %% [markdown]
# ## 5.3 When mixed precision raises the peak
#
# The seed notes warn that mixed precision can *increase* memory for a large model at a small batch, and save
# memory for a small model at a large batch. Section 5.1 shows why either can happen: autocast adds about 2 bytes
# per parameter of weight copies and halves the activations. Which wins depends on what else is alive when the
# copies are. If the gradients of the previous step are freed (`zero_grad(set_to_none=True)`, PyTorch's default),
# the copies are gone before the gradients are complete, so at small batches the peak (weights, gradients and
# optimizer states at the end of backward) is the same with or without autocast. If the gradients stay allocated
# through the forward pass (with
# `set_to_none=False`, and during every micro-batch after the first under gradient accumulation, chapter 3), the
# copies come on top of all 16 bytes.
#
# We measure the peak of one training iteration (after a first one that created AdamW's states) for fp32 and bf16
# autocast at several batch sizes, with gradients freed and kept. The optimizer is `AdamW(fused=True)`, whose step
# needs no temporary copy of the weights (the default multi-tensor step would set the peak at small batches, chapter
# 1). On a CPU there is no allocator to ask; the cell reports what the accounting can see at the end of the forward
# pass (weights, gradients, optimizer states and the bytes saved for backward) instead.

# %%
sweep_seq = prof.pick(tiny=32, full=128)
sweep_batches = prof.pick(tiny=[1, 2, 4, 8], full=[1, 2, 4, 8, 16])
sweep_rows = []
for recipe in ("fp32", "bf16"):
    half = RECIPES[recipe]
    model = models.build("bert-large-uncased", head="sequence-classification", seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    for keep_grads, b in itertools.product((False, True), sweep_batches):
        batch = {k: v.to(dev) for k, v in data.keyword_dataset(b, sweep_seq, seed=3)[:].items()}
        optimizer.zero_grad(set_to_none=not keep_grads)
        for _ in range(2):  # the first iteration creates the states (and, if kept, the gradients); measure the second
            measure.reset_peak(dev)
            with accounting.SavedTensorMeter(model) as saved, torch.autocast(dev, dtype=half, enabled=half is not None):
                loss = model(**batch).loss
            forward_end = (accounting.param_bytes(model) + accounting.grad_bytes(model)
                           + accounting.optimizer_state_bytes(optimizer) + saved.total_bytes)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=not keep_grads)
        peak = measure.allocator_mib()["peak_allocated_mib"] * MIB / GIB if prof.on_gpu else float("nan")
        sweep_rows.append({"recipe": recipe, "gradients": "kept" if keep_grads else "freed", "batch": b,
                           "peak allocated (GiB)": peak, "accounted at forward end (GiB)": forward_end / GIB})
    del model, optimizer, loss, saved
    cleanup.free(globals())
sweep = pd.DataFrame(sweep_rows)
metric = "peak allocated (GiB)" if prof.on_gpu else "accounted at forward end (GiB)"
sweep.pivot_table(index="batch", columns=["gradients", "recipe"], values=metric)

# %%
fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
for ax, grads_mode in zip(axes, ("freed", "kept")):
    for recipe, style in (("fp32", "o-"), ("bf16", "s--")):
        part = sweep[(sweep.recipe == recipe) & (sweep.gradients == grads_mode)]
        ax.plot(part.batch, part[metric], style, label=f"{recipe}" + (" autocast" if recipe == "bf16" else ""))
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"batch size (sequences of {sweep_seq} tokens)")
    ax.set_title(f"gradients {grads_mode} between steps")
axes[0].set_ylabel(metric)
axes[0].legend()
fig.suptitle("bert-large, fused AdamW: autocast costs memory at small batches when gradients are kept")
fig.tight_layout()

# %%
if prof.is_full and prof.on_gpu:
    pk = sweep.pivot_table(index="batch", columns=["gradients", "recipe"], values="peak allocated (GiB)")
    b_lo, b_hi = sweep_batches[0], sweep_batches[-1]
    glue("cav_kept_lo_diff_mib", (pk.loc[b_lo, ("kept", "bf16")] - pk.loc[b_lo, ("kept", "fp32")]) * GIB / MIB)
    glue("cav_kept_hi_diff_mib", (pk.loc[b_hi, ("kept", "bf16")] - pk.loc[b_hi, ("kept", "fp32")]) * GIB / MIB)
    glue("cav_freed_lo_diff_mib", (pk.loc[b_lo, ("freed", "bf16")] - pk.loc[b_lo, ("freed", "fp32")]) * GIB / MIB)
    glue("cav_freed_hi_diff_mib", (pk.loc[b_hi, ("freed", "bf16")] - pk.loc[b_hi, ("freed", "fp32")]) * GIB / MIB)
    glue("cav_b_lo", b_lo)
    glue("cav_b_hi", b_hi)

# %% [markdown]
# With gradients kept, bf16 autocast's peak at batch {glue:text}`cav_b_lo` is
# {glue:text}`cav_kept_lo_diff_mib:+,.0f` MiB away from fp32's (a positive number is a cost), and at batch
# {glue:text}`cav_b_hi` {glue:text}`cav_kept_hi_diff_mib:+,.0f` MiB. With gradients freed the differences are
# {glue:text}`cav_freed_lo_diff_mib:+,.0f` MiB and {glue:text}`cav_freed_hi_diff_mib:+,.0f` MiB. The seed's warning
# is right in one setting, which is common: a large model trained at a small batch with gradient accumulation.
# Then the weight copies (about 2 bytes per parameter) outweigh the halved activations, until the batch grows enough
# that the activations win. The rule for a model of $N$ parameters whose gradients are alive during the forward
# pass: autocast raises the peak while the fp32 activations of a micro-batch take less than about $4N$ bytes
# (twice the copies' 2 bytes per parameter, since autocast halves the activations).

# %% [markdown]
# ## 5.4 Optimizers: state bytes, step time and convergence
#
# The optimizer states are the largest part of the 16 bytes. The rules of the Hugging Face guide
# {cite:p}`hf_perf_train_gpu_one`: AdamW keeps 8 bytes per parameter (two fp32 states), SGD with momentum 4 (one),
# and an 8-bit optimizer 2. Adafactor {cite:p}`shazeer2018adafactor` keeps, for each weight matrix, only the row and
# column sums of the squared gradients (and no first moment in the Trainer's setting), so its states are almost
# nothing. The 8-bit AdamW of bitsandbytes {cite:p}`dettmers2022optimizers` stores both states in 8 bits with one
# fp32 scale per block of 256 values (block-wise quantization, as in chapter 2); tensors smaller than 4,096 values
# (biases, layer norms) keep fp32 states. The paged variant allocates its states in CUDA unified memory, which the
# driver can move to the CPU's RAM when the GPU runs out, instead of failing.
#
# Each optimizer trains a fresh bert-large (same seed, batches and bf16 autocast as in section 5.1) for the same
# number of steps, with the learning rate of section 5.1 for the adaptive ones and 0.01 for SGD, whose steps are not
# normalised by the gradients' size. The table's last column is the name that selects the same optimizer in the
# Trainer, `TrainingArguments(optim=...)`.

# %%
import bitsandbytes as bnb
from transformers.optimization import Adafactor
from transformers.training_args import OptimizerNames

OPTIMIZERS = {  # name: (constructor, learning rate, Trainer's optim=)
    "AdamW (foreach)": (lambda p, lr: torch.optim.AdamW(p, lr=lr, foreach=True), kw_lr, "adamw_torch"),
    "AdamW (fused)": (lambda p, lr: torch.optim.AdamW(p, lr=lr, fused=True), kw_lr, "adamw_torch_fused"),
    "SGD + momentum": (lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.9), 1e-2, "sgd"),
    "Adafactor": (lambda p, lr: Adafactor(p, lr=lr, scale_parameter=False, relative_step=False), kw_lr, "adafactor"),
    "8-bit AdamW (bnb)": (lambda p, lr: bnb.optim.AdamW8bit(p, lr=lr), kw_lr, "adamw_bnb_8bit"),
    "paged 8-bit AdamW (bnb)": (lambda p, lr: bnb.optim.PagedAdamW8bit(p, lr=lr), kw_lr, "paged_adamw_8bit"),
}
assert all(trainer_name in {o.value for o in OptimizerNames} for _, _, trainer_name in OPTIMIZERS.values())


def train_optimizer(name, steps=kw_steps):
    """Train a fresh bert-large with one optimizer (bf16 autocast); state bytes, step times, losses."""
    make, lr, _ = OPTIMIZERS[name]
    model = models.build("bert-large-uncased", head="sequence-classification", seed=0)
    allocated_model = torch.cuda.memory_allocated() if prof.on_gpu else 0
    optimizer = make(model.parameters(), lr)
    losses, step_times, total_times = [], [], []
    measure.reset_peak(dev)
    for i, batch in enumerate(itertools.islice(train.batches(ds_kw, kw_batch, seed=0), steps)):
        batch = {k: v.to(dev) for k, v in batch.items()}
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1.0, (i + 1) / warmup_steps)
        measure.synchronize(dev)
        start = time.perf_counter()
        with torch.autocast(dev, dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        measure.synchronize(dev)
        before_step = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        measure.synchronize(dev)
        step_times.append(time.perf_counter() - before_step)
        total_times.append(time.perf_counter() - start)
        losses.append(loss.item())
    n = models.n_params(model)
    row = {"optimizer": name, "state (bytes/param)": accounting.optimizer_state_bytes(optimizer) / n,
           "optimizer.step (ms)": 1e3 * pd.Series(step_times[3:]).median(),
           "training step (ms)": 1e3 * pd.Series(total_times[3:]).median(),
           "loss, last 10 steps": pd.Series(losses[-10:]).mean(), "loss < 0.1 from step": learned_at(losses)}
    if prof.on_gpu:
        row["state in torch's allocator (bytes/param)"] = (torch.cuda.memory_allocated() - allocated_model) / n
        row["peak allocated (GiB)"] = measure.allocator_mib()["peak_allocated_mib"] * MIB / GIB
    row["Trainer optim="] = OPTIMIZERS[name][2]
    return row, losses


opt_rows, opt_losses = [], {}
for name in OPTIMIZERS:
    if name.startswith("paged") and not profiles.cuda_or_skip("paged optimizers allocate CUDA unified memory"):
        continue
    row, opt_losses[name] = train_optimizer(name)
    opt_rows.append(row)
    cleanup.free(globals())
optim_table = pd.DataFrame(opt_rows).set_index("optimizer")
optim_table

# %%
fig, ax = plt.subplots()
for (name, losses), style in zip(opt_losses.items(), ["-", "--", "-.", ":", "-", "--"]):
    ax.plot(range(1, len(losses) + 1), pd.Series(losses).rolling(5, min_periods=1).mean(), style, label=name)
ax.set_title("bert-large, keyword task, bf16 autocast: loss by optimizer (mean of 5 steps)")
ax.set_xlabel("training step")
ax.set_ylabel("training loss (nats)")
ax.legend()
fig.tight_layout()

# %%
if prof.is_full and prof.on_gpu:
    ot = optim_table
    for key, name in [("foreach", "AdamW (foreach)"), ("fused", "AdamW (fused)"), ("sgd", "SGD + momentum"),
                      ("adafactor", "Adafactor"), ("bnb8", "8-bit AdamW (bnb)"), ("paged8", "paged 8-bit AdamW (bnb)")]:
        glue(f"opt_{key}_bpp", ot.loc[name, "state (bytes/param)"])
        glue(f"opt_{key}_step_ms", ot.loc[name, "optimizer.step (ms)"])
        glue(f"opt_{key}_peak", ot.loc[name, "peak allocated (GiB)"])
        glue(f"opt_{key}_loss", ot.loc[name, "loss, last 10 steps"])
        glue(f"opt_{key}_learned", ot.loc[name, "loss < 0.1 from step"])
    glue("opt_paged8_alloc_bpp", ot.loc["paged 8-bit AdamW (bnb)", "state in torch's allocator (bytes/param)"])
    glue("opt_steps", kw_steps)
    glue("opt_bnb8_alloc_bpp", ot.loc["8-bit AdamW (bnb)", "state in torch's allocator (bytes/param)"])


# %% [markdown]
# The measured states per parameter: {glue:text}`opt_foreach_bpp:.2f` bytes for AdamW with the multi-tensor
# (foreach) step and {glue:text}`opt_fused_bpp:.2f` with the fused step, {glue:text}`opt_sgd_bpp:.2f` for SGD with
# momentum, {glue:text}`opt_adafactor_bpp:.3f` for Adafactor, {glue:text}`opt_bnb8_bpp:.2f` for the 8-bit AdamW and
# {glue:text}`opt_paged8_bpp:.2f` for the paged one. The rules hold; the 8-bit optimizers sit a little above 2 bytes
# because of their per-block scales and the fp32 states of the small tensors.
#
# The paged optimizer differs where the allocator is concerned: of its states, only
# {glue:text}`opt_paged8_alloc_bpp:.2f` bytes per parameter are in PyTorch's allocator (against
# {glue:text}`opt_bnb8_alloc_bpp:.2f` for the plain 8-bit AdamW). bitsandbytes allocates the states of tensors with
# at least 100,000 values itself, in unified memory, so `torch.cuda.memory_allocated` does not see them, while
# NVML does as long as they reside on the GPU. Measuring a paged optimizer with the allocator's numbers alone
# under-reports it.
#
# Time: `optimizer.step()` took {glue:text}`opt_foreach_step_ms:.1f` ms (foreach AdamW),
# {glue:text}`opt_fused_step_ms:.1f` ms (fused AdamW), {glue:text}`opt_sgd_step_ms:.1f` ms (SGD),
# {glue:text}`opt_adafactor_step_ms:.1f` ms (Adafactor, a Python loop over the parameters) and
# {glue:text}`opt_bnb8_step_ms:.1f` ms (8-bit AdamW). Convergence, as the step at which the five-step mean loss
# first fell below 0.1 ("nan": never, in {glue:text}`opt_steps` steps): {glue:text}`opt_foreach_learned:.0f` with
# AdamW, {glue:text}`opt_bnb8_learned:.0f` with the 8-bit AdamW, {glue:text}`opt_adafactor_learned:.0f` with
# Adafactor and {glue:text}`opt_sgd_learned:.0f` with SGD and momentum. AdamW and its 8-bit version learned the
# task in step with each other, as {cite:t}`dettmers2022optimizers` report for 8-bit states. SGD with momentum (at
# a learning rate of 0.01) and Adafactor (at AdamW's learning rate, without a first moment, as the Trainer sets it
# up) did not leave the plateau in this short run. That says more about these learning rates than about the
# optimizers: each needs its own tuning, which this section does not do.

# %% [markdown]
# ## 5.5 Tiles and tensor cores
#
# A matrix product $C = AB$ with $A$ of size $m \times k$ and $B$ of size $k \times n$ does $2mkn$ floating-point
# operations (a multiply and an add per term) on $mk + kn$ inputs. Computed naively, element by element, every
# output reads a whole row of $A$ and a whole column of $B$ from memory: $2mkn$ reads, one per multiply-add, and
# the GPU would wait for memory all the time. GEMM libraries (cuBLAS) instead cut the matrices into *tiles*: a
# $T \times T$ tile of $C$ is accumulated from products of $T \times T$ tiles of $A$ and $B$ held in fast on-chip
# memory, so each value read from main memory is used $T$ times. Here is the idea in PyTorch, with a counter of
# the values read:

# %%
def blocked_matmul(a, b, tile):
    """C = A @ B computed tile by tile, accumulating in fp32; also returns how many values were read."""
    m, k = a.shape
    k2, n = b.shape
    assert k == k2, "inner dimensions differ"
    c = torch.empty(m, n, dtype=a.dtype)
    reads = 0
    for i in range(0, m, tile):
        for j in range(0, n, tile):
            acc = torch.zeros(min(tile, m - i), min(tile, n - j))  # one tile of C, kept "on chip"
            for p in range(0, k, tile):
                a_tile, b_tile = a[i:i + tile, p:p + tile], b[p:p + tile, j:j + tile]
                reads += a_tile.numel() + b_tile.numel()
                acc += a_tile.float() @ b_tile.float()
            c[i:i + tile, j:j + tile] = acc
    return c, reads


gen = torch.Generator().manual_seed(0)
a, b = torch.randn(250, 260, generator=gen), torch.randn(260, 270, generator=gen)  # sizes that are not tile multiples
for tile in (16, 64):
    c, reads = blocked_matmul(a, b, tile)
    torch.testing.assert_close(c, a @ b, rtol=1e-4, atol=1e-4)
print("blocked_matmul equals torch.matmul (rtol = atol = 1e-4) for tiles of 16 and 64")

# %% [markdown]
# The tile products are summed in a different order than `torch.matmul` sums, so the results agree to fp32
# rounding, not bit for bit; hence the tolerance. For $n \times n$ matrices and a tile size $T$ that divides $n$,
# each of the $(n/T)^2$ output tiles needs $n/T$ pairs of input tiles of $T^2$ values: $2n^3/T$ values read. Counted:

# %%
# NBVAL_CHECK_OUTPUT
# (counts of a fixed computation; printed as text, identical across pandas versions)
sq = torch.randn(256, 256, generator=gen)
reads_table = pd.DataFrame([
    {"tile T": t, "values read (counted)": blocked_matmul(sq, sq, t)[1], "formula 2n^3/T": 2 * 256**3 // t}
    for t in (8, 32, 128)
]).set_index("tile T")
reads_table["multiply-adds per value read"] = 256**3 / reads_table["values read (counted)"]
assert (reads_table["values read (counted)"] == reads_table["formula 2n^3/T"]).all()
print(reads_table.to_string())

# %% [markdown]
# Each value read takes part in $T$ multiply-adds, and each multiply-add reads two values: $T/2$ multiply-adds per
# value read. With tiles of 128 and bf16 values (2 bytes) that is 64 FLOPs per byte read from main memory. A GPU
# needs that kind of reuse: an H200 does about 1,000 dense bf16 TFLOP/s (its datasheet) but reads its memory at
# 4.8 TB/s, so a kernel that does fewer than about 200 FLOPs per byte leaves the tensor cores waiting. cuBLAS tiles at
# several levels (the L2 cache, each multiprocessor's shared memory, its registers), and tensor cores compute small
# fixed-size tile products in one instruction. When a matrix dimension is not a multiple of the tile
# size, the last tiles are partly empty, and when it is not a multiple of 8 (16 bytes of bf16), the rows are not
# aligned for the wide loads the fastest kernels use. NVIDIA's guide {cite:p}`nvidia_matmul_guide` therefore asks
# for dimensions that are multiples of 8 at least, and of 64 or more to be safe.
#
# We measure `torch.matmul` of square $n \times n$ matrices, in TFLOP/s ($2n^3$ divided by the median time), in
# fp32, TF32 and bf16: first over a wide range of $n$, then for every $n$ from 4032 to 4160. Each timing is the
# median of five repeats of a few back-to-back products, after warm-up.

# %%
MODES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16}
RATE_GUESS = {"fp32": 50e12, "tf32": 300e12, "bf16": 700e12}  # FLOP/s, only to size the timed calls
if not profiles.cuda_or_skip("TF32 and bf16 tensor-core matmuls need an NVIDIA GPU; the CPU sweep is fp32 at small sizes"):
    MODES = {"fp32": torch.float32}


def matmul_tflops(n, mode):
    """Measured TFLOP/s of an n x n by n x n product in one mode (median of 5 timed repeats)."""
    torch.backends.cuda.matmul.allow_tf32 = mode == "tf32"
    x = torch.randn(n, n, device=dev, dtype=MODES[mode])
    y = torch.randn(n, n, device=dev, dtype=MODES[mode])
    out = torch.empty(n, n, device=dev, dtype=MODES[mode])
    reps = min(200, max(1, round(RATE_GUESS[mode] * 2e-3 / (2 * n**3)))) if prof.on_gpu else 1  # ~2 ms per call

    def products():
        for _ in range(reps):
            torch.matmul(x, y, out=out)

    timing = measure.time_fn(products, device=dev, warmup=1, repeat=5)
    return 2 * n**3 * reps / timing.median_s / 1e12


wide_sizes = prof.pick(tiny=[32, 64, 128, 256, 512], full=[256, 512, 1024, 2048, 4096, 8192, 16384])
fine_sizes = prof.pick(tiny=list(range(120, 137)), full=list(range(4032, 4161)))
wide = pd.DataFrame([{"n": n, **{m: matmul_tflops(n, m) for m in MODES}} for n in wide_sizes])
fine = pd.DataFrame([{"n": n, **{m: matmul_tflops(n, m) for m in MODES}} for n in fine_sizes])
torch.backends.cuda.matmul.allow_tf32 = False
wide.set_index("n")

# %%
gpu_name = torch.cuda.get_device_name() if prof.on_gpu else ""
peaks = {}
for m in MODES if prof.on_gpu else ():
    try:
        peaks[m] = flops.peak_tflops(gpu_name, m)
    except ValueError:  # a GPU or dtype that is not in the table (a T4 has no TF32 or bf16 tensor cores)
        peaks[m] = float("nan")
n_mid = fine_sizes[len(fine_sizes) // 2]  # 4096 on the GPU
relative = fine.set_index("n") / fine.set_index("n").loc[n_mid]
fig, (ax_w, ax_f) = plt.subplots(1, 2, figsize=(11, 4))
for (m, style), color in zip([("fp32", "o-"), ("tf32", "s-"), ("bf16", "^-")], ["#4C72B0", "#DD8452", "#55A868"]):
    if m not in MODES:
        continue
    ax_w.plot(wide.n, wide[m], style, color=color, label=f"{m}, measured")
    ax_f.plot(relative.index, relative[m], "-", color=color, lw=1, label=m)
    if m in peaks:
        ax_w.axhline(peaks[m], color=color, linestyle=":", label=f"{m}, datasheet peak")
mult64 = relative[relative.index % 64 == 0]
for m in MODES:
    ax_f.plot(mult64.index, mult64[m], "k.", ms=8)
ax_w.set_xscale("log", base=2)
ax_w.set_yscale("log")
ax_w.set_xlabel("matrix size n (n x n by n x n)")
ax_w.set_ylabel("TFLOP/s (log scale)")
ax_w.set_title("Large matrices approach the ceiling")
ax_w.legend(fontsize=8)
ax_f.set_xlabel("matrix size n (black dots: multiples of 64)")
ax_f.set_ylabel(f"throughput relative to n = {n_mid}")
ax_f.set_title(f"Near n = {n_mid}: multiples of 64 run fastest")
ax_f.legend(fontsize=8)
fig.suptitle(f"torch.matmul throughput on {gpu_name or 'this CPU'}")
fig.tight_layout()

# %%
pick = [n for n in (fine_sizes[len(fine_sizes) // 2] + d for d in (-8, -1, 0, 1, 8)) if n in set(fine.n)]
shapes = fine.set_index("n").loc[pick]
shapes.index = [f"{n} (n % 64 = {n % 64}, n % 8 = {n % 8})" for n in pick]
if prof.is_full and prof.on_gpu:
    f = fine.set_index("n")
    glue("tc_bf16_4096", f.loc[4096, "bf16"])
    glue("tc_bf16_4095", f.loc[4095, "bf16"])
    glue("tc_bf16_4097", f.loc[4097, "bf16"])
    glue("tc_bf16_4088", f.loc[4088, "bf16"])
    glue("tc_tf32_4096", f.loc[4096, "tf32"])
    glue("tc_tf32_4095", f.loc[4095, "tf32"])
    glue("tc_fp32_4096", f.loc[4096, "fp32"])
    glue("tc_fp32_4095", f.loc[4095, "fp32"])
    glue("tc_odd_share_bf16", (f.loc[f.index % 2 == 1, "bf16"].median() / f.loc[f.index % 64 == 0, "bf16"].median()))
    for m in MODES:
        glue(f"tc_{m}_max", wide[m].max())
        glue(f"tc_{m}_peak", peaks[m])
        glue(f"tc_{m}_frac", wide[m].max() / peaks[m])
shapes


# %% [markdown]
# The wide sweep shows the ramp: small matrices leave most of the GPU idle, and throughput climbs until the
# matrices fill every streaming multiprocessor. The best measured throughput was {glue:text}`tc_bf16_max:.0f`
# TFLOP/s in bf16 against a datasheet peak of {glue:text}`tc_bf16_peak:.0f` ({glue:text}`tc_bf16_frac:.0%`),
# {glue:text}`tc_tf32_max:.0f` TFLOP/s in TF32 (datasheet {glue:text}`tc_tf32_peak:.0f`,
# {glue:text}`tc_tf32_frac:.0%`) and {glue:text}`tc_fp32_max:.1f` TFLOP/s in plain fp32 (datasheet
# {glue:text}`tc_fp32_peak:.1f`, {glue:text}`tc_fp32_frac:.0%`). The datasheet numbers assume the boost clock and
# no memory traffic; a real GEMM's ceiling is lower, and this measured ceiling, not the datasheet, is the honest
# denominator for a utilisation figure (chapter 8 uses both).
#
# The fine sweep is the lesson of this section. In bf16, $n = 4096$ ran at {glue:text}`tc_bf16_4096:.0f` TFLOP/s,
# $n = 4095$ at {glue:text}`tc_bf16_4095:.0f` and $n = 4097$ at {glue:text}`tc_bf16_4097:.0f`; $n = 4088$, a
# multiple of 8 but not of 64, at {glue:text}`tc_bf16_4088:.0f`. Over the whole range, odd sizes reached
# {glue:text}`tc_odd_share_bf16:.0%` of the median throughput of the multiples of 64. TF32 shows the same pattern
# ({glue:text}`tc_tf32_4096:.0f` against {glue:text}`tc_tf32_4095:.0f` TFLOP/s); plain fp32, which does not use
# tensor cores, barely cares ({glue:text}`tc_fp32_4096:.1f` against {glue:text}`tc_fp32_4095:.1f`).
#
# **The practical rule: pad to multiples of 64.** In a transformer the dimensions that are free to choose are the
# hidden size (always a nice number in published models) and the vocabulary, which comes from a tokenizer:
# bert-large has 30,522 tokens. The LM head, a `hidden x vocab` matrix product over every token of the batch, is
# one of the largest GEMMs of a language model. We time its forward and backward pass in bf16 for a batch of tokens
# at several vocabulary sizes: bert's 30,522, the same padded to 30,528 (the next multiple of 64), polyglot-ko's
# 30,080 (a multiple of 128, chosen by its authors) and neighbours of each.

# %%
def lm_head_tflops(vocab, hidden, tokens, dtype):
    """Forward + backward TFLOP/s of an LM head (hidden -> vocab) over `tokens` tokens."""
    head = torch.nn.Linear(hidden, vocab, bias=False, device=dev, dtype=dtype)
    x = torch.randn(tokens, hidden, device=dev, dtype=dtype, requires_grad=True)
    grad_out = torch.randn(tokens, vocab, device=dev, dtype=dtype)

    def fwd_bwd():
        head(x).backward(grad_out)
        head.weight.grad = x.grad = None

    timing = measure.time_fn(fwd_bwd, device=dev, warmup=2, repeat=5)
    return {"vocab": vocab, "vocab % 64": vocab % 64, "time (ms)": timing.median_s * 1e3,
            "TFLOP/s": 3 * 2 * tokens * hidden * vocab / timing.median_s / 1e12}


head_hidden, head_tokens = prof.pick(tiny=128, full=2048), prof.pick(tiny=64, full=8192)
head_dtype = torch.bfloat16 if prof.on_gpu else torch.float32
vocabs = [30079, 30080, 30521, 30522, 30528, 32000]
lm_head = pd.DataFrame([lm_head_tflops(v, head_hidden, head_tokens, head_dtype) for v in vocabs]).set_index("vocab")
if prof.is_full and prof.on_gpu:
    glue("vh_30522_ms", lm_head.loc[30522, "time (ms)"])
    glue("vh_30528_ms", lm_head.loc[30528, "time (ms)"])
    glue("vh_30522_tf", lm_head.loc[30522, "TFLOP/s"])
    glue("vh_30528_tf", lm_head.loc[30528, "TFLOP/s"])
    glue("vh_speedup", lm_head.loc[30522, "time (ms)"] / lm_head.loc[30528, "time (ms)"])
    glue("vh_tokens", head_tokens)
lm_head

# %% [markdown]
# Over {glue:text}`vh_tokens:,` tokens with hidden size 2048, bert's vocabulary of 30,522 took
# {glue:text}`vh_30522_ms:.2f` ms ({glue:text}`vh_30522_tf:.0f` TFLOP/s); padded with six unused rows to 30,528 it
# took {glue:text}`vh_30528_ms:.2f` ms ({glue:text}`vh_30528_tf:.0f` TFLOP/s): {glue:text}`vh_speedup:.2f` times
# the speed, for 0.02% more parameters. transformers does the padding in one call; the extra rows are tokens the
# tokenizer never produces:

# %%
# NBVAL_CHECK_OUTPUT
# (vocabulary sizes: identical on every machine; printed as text, identical across pandas versions)
small_bert = models.build("bert-large-uncased", profile="tiny", head="sequence-classification", device="cpu")
before = small_bert.get_input_embeddings().weight.shape[0]
small_bert.resize_token_embeddings(before, pad_to_multiple_of=64, mean_resizing=False)
after = small_bert.get_input_embeddings().weight.shape[0]
assert after % 64 == 0 and 0 <= after - before < 64
print(f"embedding rows: {before:,} -> {after:,} (resize_token_embeddings(..., pad_to_multiple_of=64))")
freed = cleanup.free(globals(), "small_bert")

# %% [markdown]
# ## 5.6 Two more knobs: emptying the cache, pinned memory
#
# The seeds' table of single-GPU techniques lists two more that are quick to try.
#
# **`torch_empty_cache_steps`** makes the Trainer call `torch.cuda.empty_cache()` every $N$ steps, after the
# forward pass. PyTorch's caching allocator keeps freed blocks for reuse (the gap between *reserved* and
# *allocated*, chapter 1); emptying the cache returns them to the driver, which lowers what NVML sees and can undo
# fragmentation, at the price of fresh `cudaMalloc` calls afterwards. The Trainer's documentation promises a lower
# peak "at a cost of about 10% slower performance". We train bert-large with the seeds' Trainer setup (fp32, batch
# 4, 512 tokens) with and without it, timing each step with a callback and reading the allocator's peaks.

# %%
from transformers import Trainer, TrainerCallback, TrainingArguments


class StepClock(TrainerCallback):
    """Median step time, with the device synchronised at both ends of every step."""

    def __init__(self):
        self.times = []

    def on_step_begin(self, args, state, control, **kwargs):
        measure.synchronize(dev)
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        measure.synchronize(dev)
        self.times.append(time.perf_counter() - self.start)


ec_seq, ec_steps = prof.pick(tiny=64, full=512), prof.pick(tiny=6, full=30)
ds_dummy = data.dummy_dataset(4 * ec_steps, ec_seq, seed=0)
ec_rows = []
for every in (None, 1):
    model = models.build("bert-large-uncased", head="sequence-classification", seed=0)
    clock = StepClock()
    args = TrainingArguments(
        output_dir="trainer_tmp", per_device_train_batch_size=4, max_steps=ec_steps, torch_empty_cache_steps=every,
        logging_strategy="no", save_strategy="no", report_to="none", disable_tqdm=True, seed=0,
        dataloader_pin_memory=prof.on_gpu,
    )
    measure.reset_peak(dev)
    Trainer(model=model, args=args, train_dataset=ds_dummy, callbacks=[clock]).train()
    row = {"torch_empty_cache_steps": str(every), "step (ms)": 1e3 * pd.Series(clock.times[3:]).median()}
    if prof.on_gpu:
        row["peak allocated (GiB)"] = torch.cuda.max_memory_allocated() / GIB
        row["peak reserved (GiB)"] = torch.cuda.max_memory_reserved() / GIB
    ec_rows.append(row)
    del model
    cleanup.free(globals())
empty_cache = pd.DataFrame(ec_rows).set_index("torch_empty_cache_steps")
if prof.is_full and prof.on_gpu:
    glue("ec_slowdown", empty_cache["step (ms)"].iloc[1] / empty_cache["step (ms)"].iloc[0] - 1)
    glue("ec_reserved_none", empty_cache["peak reserved (GiB)"].iloc[0])
    glue("ec_reserved_1", empty_cache["peak reserved (GiB)"].iloc[1])
    glue("ec_alloc_none", empty_cache["peak allocated (GiB)"].iloc[0])
    glue("ec_alloc_1", empty_cache["peak allocated (GiB)"].iloc[1])
empty_cache

# %% [markdown]
# Emptying the cache every step changed the step time by {glue:text}`ec_slowdown:+.0%` and the peak *reserved*
# memory from {glue:text}`ec_reserved_none:.2f` GiB to {glue:text}`ec_reserved_1:.2f` GiB; the peak *allocated*
# memory, the tensors themselves, stayed at {glue:text}`ec_alloc_none:.2f` and {glue:text}`ec_alloc_1:.2f` GiB. It
# cannot shrink what a step needs, only the allocator's slack around it. Reach for it when the reserved memory
# keeps growing (variable sequence lengths fragment the cache), or when another process must share the GPU.
#
# **Pinned memory.** A batch travels from the CPU's memory to the GPU by DMA, which needs page-locked ("pinned")
# host memory. From ordinary pageable memory, the driver first copies the data into a pinned staging buffer, and the
# copy cannot overlap with computation. `DataLoader(pin_memory=True)` (the Trainer's `dataloader_pin_memory`, on by
# default) allocates batches in pinned memory; `tensor.to("cuda", non_blocking=True)` then returns at once and
# overlaps the copy with GPU work. The bandwidth of one 256 MiB copy:

# %%
if profiles.cuda_or_skip("host-to-GPU copies need a GPU"):
    host = torch.randn(64 * 2**20)  # 256 MiB of fp32
    pinned = host.pin_memory()
    copy_gib_s = {}
    for name, src, non_blocking in (("pageable", host, False), ("pinned", pinned, True)):
        t = measure.time_fn(lambda src=src, nb=non_blocking: src.to(dev, non_blocking=nb), device=dev, warmup=2, repeat=5)
        copy_gib_s[name] = host.numel() * 4 / GIB / t.median_s
    glue("pin_pageable", copy_gib_s["pageable"])
    glue("pin_pinned", copy_gib_s["pinned"])
    display(pd.Series(copy_gib_s, name="host-to-GPU copy (GiB/s)"))
    cleanup.free(globals(), "host", "pinned")

# %% [markdown]
# Pinned memory copied at {glue:text}`pin_pinned:.1f` GiB/s, pageable at {glue:text}`pin_pageable:.1f` GiB/s. A
# batch of token ids is tiny (4 x 512 int64 values are 16 KiB), so for the models of this book the copy is never
# the bottleneck; the preparation of the data can be. `dataloader_num_workers` lets worker processes prepare the
# next batches while the GPU computes. Chapter 9 measures data loading properly.

# %% [markdown]
# ## Summary
#
# The closing tables: the four precisions on bert-large, and the optimizers.

# %%
display(mp[["step (ms)", "samples/s", "peak allocated (GiB)", "saved for backward (GiB)", "loss, last 10 steps"]])
optim_table[[c for c in optim_table.columns if c in ("state (bytes/param)", "optimizer.step (ms)", "peak allocated (GiB)", "Trainer optim=")]]

# %% [markdown]
# - Autocast runs matrix products in 16 bits and keeps weights, gradients and optimizer states in fp32: 16
#   persistent bytes per parameter in every recipe. The 18-byte rule adds the 16-bit weight copies, which live
#   only from the forward pass to the backward pass. All four precisions learned the task alike. On this short
#   workload (1,024 tokens per step) bf16 autocast ran at {glue:text}`mp_bf16_speedup:.1f` times fp32's speed and
#   TF32 at {glue:text}`mp_tf32_speedup:.1f` times: autocast pays off where the matrix products are large.
# - fp16 needs loss scaling: without it, {glue:text}`ls_lost_noscale:.2f`% of bert-large's gradients vanished.
#   bf16 has fp32's range and needs none.
# - Mixed precision does not always save memory: when gradients are alive during the forward pass (gradient
#   accumulation), the weight copies cost more than the halved activations save at small batches.
# - Optimizer states per parameter: AdamW {glue:text}`opt_fused_bpp:.1f` bytes, SGD with momentum
#   {glue:text}`opt_sgd_bpp:.1f`, Adafactor {glue:text}`opt_adafactor_bpp:.3f`, 8-bit AdamW
#   {glue:text}`opt_bnb8_bpp:.2f`; a paged optimizer's states are outside PyTorch's allocator.
# - Tensor cores want dimensions that are multiples of 64: bf16 at $n = 4095$ ran at
#   {glue:text}`tc_bf16_4095:.0f` TFLOP/s against {glue:text}`tc_bf16_4096:.0f` at 4096, and padding bert's
#   vocabulary to 30,528 ran its LM head at {glue:text}`vh_speedup:.2f` times the speed.
#
# ## Use it in your own script
#
# Mixed precision, TF32 and a fused optimizer in a plain training step; bf16 where the GPU has it (compute
# capability 8.0), fp16 with a loss scaler elsewhere.
#
# ```python
# import torch
#
# torch.backends.cuda.matmul.allow_tf32 = True           # fp32 matrix products on tensor cores
# dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
# scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)
# optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5, fused=True)
# with torch.autocast("cuda", dtype=dtype):
#     loss = model(**batch).loss
# scaler.scale(loss).backward()
# scaler.step(optimizer)
# scaler.update()
# optimizer.zero_grad(set_to_none=True)
# # shapes: tokenizer(..., pad_to_multiple_of=64); model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=64)
# ```
#
# ## Exercises
#
# Each exercise has a hint and an answer (or the range to expect) behind a click.
#
# 1. In section 5.3, construct the optimizer with `foreach=True` instead of `fused=True`. The multi-tensor step
#    needs a temporary copy of the weights (chapter 1): predict which of the four curves it lifts at small batch
#    sizes, and check.
#
#    <details><summary>Hint</summary>
#
#    Chapter 1: the multi-tensor step holds about one copy of the parameters as intermediates; the fused step does not.
#
#    </details>
#
#    <details><summary>Answer</summary>
#
#    It lifts the curves at small batches, where the optimizer step is the peak, by up to one fp32 copy of the parameters (about 1.25 GiB for bert-large's 335M); at large batches the activations set the peak and the curves do not move.
#
#    </details>
#
# 2. Train the fp16 recipe of section 5.1 with `torch.amp.GradScaler(dev, init_scale=1.0)`, and then with
#    `enabled=False`. How many steps are skipped, and how do the loss curves compare?
#
#    <details><summary>Hint</summary>
#
#    The scaler only skips a step when it finds inf or NaN gradients, and it grows the scale by 2 only after 2,000 clean steps.
#
#    </details>
#
#    <details><summary>Answer</summary>
#
#    No step is skipped: at scale 1 nothing overflows, but the gradients below fp16's range (the share measured in section 5.2) are lost, exactly as with `enabled=False`. Both loss curves stay close to the scaled run on this short task; the loss of gradients shows up as noise more than as divergence.
#
#    </details>
#
# 3. Change `head_hidden` in section 5.5 from 2048 to 2047 and to 2112 (a multiple of 64). Which matters more
#    for the LM head, the hidden size or the vocabulary?
#
#    <details><summary>Hint</summary>
#
#    The LM head multiplies (tokens × hidden) by (hidden × vocabulary): the hidden size is the reduction dimension, the vocabulary an output dimension.
#
#    </details>
#
#    <details><summary>Answer</summary>
#
#    Both matter: 2047 misaligns every tile along the reduction and costs about as much as the unpadded vocabulary; 2112 runs at full speed. The measured ratios of section 5.5's table are the reference.
#
#    </details>
#
# 4. In section 5.4, set `min_8bit_size=0` for the 8-bit AdamW (`bnb.optim.AdamW8bit(p, lr=lr, min_8bit_size=0)`)
#    so that even the biases get 8-bit states. How close to 2 bytes per parameter does it get?
#
#    <details><summary>Hint</summary>
#
#    bitsandbytes keeps 32-bit states for tensors smaller than `min_8bit_size` (4,096 elements by default): the biases and layer norms.
#
#    </details>
#
#    <details><summary>Answer</summary>
#
#    Close to 2 bytes per parameter: two 1-byte states plus a 4-byte scale per block of 256, about 2.03, against the value measured in section 5.4.
#
#    </details>
#
# ## References
#
# - {cite:t}`micikevicius2018mixed`: mixed-precision training, fp32 master weights and loss scaling.
# - {cite:t}`kalamkar2019bfloat16`: bf16 for training.
# - {cite:t}`dettmers2022optimizers`: 8-bit optimizers with block-wise quantization.
# - {cite:t}`shazeer2018adafactor`: Adafactor's factored second moments.
# - {cite:t}`nvidia_matmul_guide`: tiles, tensor cores and dimension rules for GEMMs.
# - {cite:t}`hf_training_anatomy` and {cite:t}`hf_perf_train_gpu_one`: the 16/18-byte rules, the optimizer
#   rules and the table of single-GPU techniques the seed notes follow.
