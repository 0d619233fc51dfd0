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
# the gradients, 8 for the optimizer. The [activations](https://gpu-efficient-training.github.io/book/book/glossary.html#activations) came on top. This chapter changes the arithmetic of a
# training step in three ways: the precision the matrix products run in, the optimizer and the bytes it keeps, and
# the shapes of the matrices, which decide whether the GPU's [tensor cores](https://gpu-efficient-training.github.io/book/book/glossary.html#tensor-cores) run at full speed. Each change is
# measured on the same model, against the rule that is supposed to predict it.
#
# **What you will learn**
#
# - how `torch.autocast` and `GradScaler` change a training step in fp32, TF32, fp16 and bf16: time, peak memory,
#   and whether it changes what the model learns, over several seeds;
# - how many gradients an fp16 backward pass loses without [loss scaling](https://gpu-efficient-training.github.io/book/book/glossary.html#loss-scaling);
# - what stays in fp32 under [mixed precision](https://gpu-efficient-training.github.io/book/book/glossary.html#mixed-precision), and what the 16- and 18-byte rules count;
# - when mixed precision *raises* the peak memory instead of lowering it;
# - the state bytes per parameter of AdamW (foreach and fused), SGD with momentum, Adafactor, and the 8-bit and
#   paged 8-bit AdamW of bitsandbytes, with their step times and whether they learn alike;
# - how a matrix product is cut into tiles, why misaligned matrix sizes run slower, and how far the measured
#   matmul ceiling is from the datasheet.
#
# **Prerequisites:** [chapter 1](https://gpu-efficient-training.github.io/book/notebooks/01_memory_anatomy.html) (the memory components and the four memory numbers) and
# [chapter 2](https://gpu-efficient-training.github.io/book/notebooks/02_dtypes_quantization.html) (number formats, block-wise quantization); [chapter
# 8](https://gpu-efficient-training.github.io/book/notebooks/08_profiling.html) explains the timing method ([GPU-busy](https://gpu-efficient-training.github.io/book/book/glossary.html#gpu-busy) fraction, [host enqueue](https://gpu-efficient-training.github.io/book/book/glossary.html#host-enqueue) time) used here.
# Every sentence that quotes a number is computed from this notebook's own run, on the machine named in the first
# output below. On a CPU the notebook runs tiny versions of the models, and the sentences about speed say they were
# skipped; on a GPU older than the A100 (compute capability below 8.0, such as Colab's T4) the TF32 and bf16 parts
# are replaced by fp16 or skipped, with one line that says so.

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

from helpers import accounting, cleanup, data, estimates, flops, gpus, measure, models, plan, run_profile
from helpers.measure import GIB, MIB

prof = env.start()  # plot style, number format, run profile; the table below names hardware and versions
dev = prof.device

# %% [markdown]
# The first cell that touches the GPU notes what PyTorch has allocated before any experiment, so that the last
# cell can check that the chapter gave everything back, and asks the GPU what its tensor cores support: bf16 and
# TF32 need compute capability 8.0 (the A100 and later), and where they are missing [autocast](https://gpu-efficient-training.github.io/book/book/glossary.html#autocast) uses fp16.

# %%
import math

from IPython.display import Markdown, display

from helpers import prose, steps, timing

cap = gpus.capability()  # None on a CPU
AMP = gpus.amp_dtype()  # bf16 on a CPU and on GPUs of compute capability >= 8.0, fp16 below
AMP_NAME = {torch.bfloat16: "bf16", torch.float16: "fp16"}[AMP]
baseline_mib = torch.cuda.memory_allocated() / MIB if prof.on_gpu else 0.0
if cap is not None:
    print(f"{cap.name}: compute capability {cap.major}.{cap.minor}; bf16 tensor cores: {cap.bf16}, "
          f"TF32: {cap.tf32}; autocast uses {AMP_NAME}")
else:
    print("CPU run: tiny models; autocast runs on the CPU in bf16 and fp16, and no timing here means much")

# %% [markdown]
# ## 5.1 One training step, four precisions
#
# [Chapter 2](https://gpu-efficient-training.github.io/book/notebooks/02_dtypes_quantization.html) took the formats apart: fp32 has 8 exponent and 23 mantissa bits; fp16
# keeps 10 mantissa bits but only 5 exponent bits, so it overflows past 65,504 and has nothing between 0 and its
# smallest subnormal, $2^{-24} \approx 6 \times 10^{-8}$; bf16 ([Kalamkar et al. (2019)](https://gpu-efficient-training.github.io/book/book/references.html))
# keeps fp32's 8 exponent bits and 7 mantissa bits, fp32's range with less precision. TF32 is not a storage format:
# it is how NVIDIA's tensor cores (since the A100) multiply fp32 matrices, reading 10 of the 23 mantissa bits and
# accumulating in fp32. Here we train with them.
#
# *Mixed precision* in PyTorch is `torch.autocast`: the weights stay in fp32, and inside the autocast region each
# operation runs in the dtype that suits it. Matrix products (linear layers, attention) cast their inputs to 16
# bits and run on the tensor cores; operations that need range or accumulate many values (softmax, layer norm, the
# loss, sums) run in fp32. The backward pass follows the same dtypes: the gradient of each weight is computed by a
# 16-bit matrix product and then cast to fp32, the dtype of the weight it belongs to, and the optimizer updates
# the fp32 weights, the *master weights* of [Micikevicius et al. (2018)](https://gpu-efficient-training.github.io/book/book/references.html). With fp16, a
# `GradScaler` does their *loss scaling*: it multiplies the loss by a scale $S$ before `backward()`, so that small
# gradients stay inside fp16's range on their way back, divides the gradients by $S$ before the step, skips the step
# when a gradient overflowed to inf (and then halves $S$), and doubles $S$ after a run of steps without overflow.
#
# Four recipes: fp32; TF32 (the same code with `torch.backends.cuda.matmul.allow_tf32 = True`, off by default in
# PyTorch); fp16 autocast with `GradScaler`; bf16 autocast. On a GPU without bf16 and TF32 tensor cores (a T4) only
# fp32 and fp16 run. This section asks two questions of them. First, what does one training step of bert-large cost
# in each recipe: its time, its peak memory, and what stays in fp32. Each recipe trains a fresh bert-large (seed 0)
# for three steps of `data.keyword_dataset` (label 1 when a keyword token occurs in a sequence of 16 tokens, 64
# sequences per batch; the first step creates AdamW's states), and the same function runs the checks. Second, does
# the recipe change what the model *learns*? One loss curve per recipe cannot say, because two runs of one recipe
# differ too; that question gets its own experiment after the table, with several seeds per recipe.
#
# Each recipe's step is timed with `timing.time_it` (chapter 8: ten timed steps after two or
# three warm-up steps, wall and host-enqueue time, and the GPU-busy fraction from a profiled run) at two sizes: the
# training batch (64 x 16 = 1,024 tokens) and a realistic one of 512-token sequences. Its batch is the largest of
# 64, 32, 16, 8 and 4 sequences whose fp32 step fits the GPU's free memory by the prediction of `plan.predict`, the
# memory planner of [chapter 10](https://gpu-efficient-training.github.io/book/notebooks/10_capstone.html): 64 (32,768 tokens, about 54 GiB in fp32) on an 80 GB GPU, 32 on a
# 40 GB one, 8 on a 15 GB T4. It is that large so that even the 16-bit steps keep the GPU busy: at 32 x 512 an H100
# finishes a bf16 step's kernels in about the time the host needs to issue them, and its GPU-busy fraction landed on
# either side of the 90% line from one run to the next. The tiny CPU profile uses 2 x 64.

# %%
RECIPES = {"fp32": None, "tf32": None, "fp16": torch.float16, "bf16": torch.bfloat16}
if cap is None:  # kept so that the tables have the same rows everywhere; the CPU has no TF32 mode
    print("CPU run: the tf32 recipe runs as plain fp32 here (TF32 is a tensor-core mode)")
elif not cap.bf16:
    RECIPES = {"fp32": None, "fp16": torch.float16}
    print(f"skipped on {cap.name}: the TF32 and bf16 recipes need compute capability 8.0 (this GPU has "
          f"{cap.major}.{cap.minor}); fp32 and fp16 run")
HALF = "bf16" if "bf16" in RECIPES else "fp16"  # the 16-bit recipe the text compares with fp32
kw_seq, kw_batch = 16, prof.pick(tiny=16, full=64)
kw_steps, kw_lr = 3, 2e-5  # three steps per recipe: enough for AdamW's states and the peak; what it learns comes later
big_seq, big_batch, big_plan_gib = prof.pick(tiny=64, full=512), 2, float("nan")  # the realistic step
if prof.on_gpu:  # the largest batch whose fp32 step (AdamW, the peak recipe) the planner predicts to fit
    free_gib = torch.cuda.mem_get_info()[0] / GIB - gpus.CONTEXT_RESERVE_GIB
    big_plans = {b: plan.predict(plan.Setup(model="bert-large", batch=b, seq=big_seq, precision="fp32",
                                            optimizer="adamw")) for b in (64, 32, 16, 8, 4)}
    big_batch = next((b for b, p in big_plans.items() if p.fits(free_gib)), 4)
    big_plan_gib = big_plans[big_batch].peak_gib
    if big_batch < 64:
        print(f"realistic step at {big_batch} x {big_seq} on {cap.name}: 64 x {big_seq} in fp32 needs about "
              f"{big_plans[64].peak_gib:.0f} GiB (planner), more than the {free_gib:.1f} GiB free (less a reserve)")
ds_kw = data.keyword_dataset(8 * kw_batch, kw_seq, seed=0)
ds_big = data.keyword_dataset(big_batch, big_seq, seed=1)
tiny_input = {"input_ids": ds_kw[:1]["input_ids"][:, :8].to(dev), "labels": ds_kw[:1]["labels"].to(dev)}


class SavedByDtype:
    """Bytes saved for backward during a forward pass, by dtype (each storage once, parameters left out)."""

    def __init__(self, model):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.seen, self.bytes = set(), {}
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda saved: saved)

    def pack(self, t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.params and ptr not in self.seen:
            self.seen.add(ptr)
            name = str(t.dtype).removeprefix("torch.")
            self.bytes[name] = self.bytes.get(name, 0) + t.untyped_storage().nbytes()
        return t.detach()  # an alias without grad_fn: keeping t would tie an op's output to its own node

    def __enter__(self):
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)


from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402


def linear_grad_dtypes(model, batch, half):
    """The dtypes in which the gradients of the nn.Linear weights are computed, seen by the dispatcher.

    A TorchDispatchMode sees every operation the backward pass runs (on the GPU too: autograd carries the
    mode to its own thread; FlopCounterMode works the same way). We record the dtype of each matrix product
    whose result has the shape of a Linear weight: the weight gradients. Under autocast they come out in 16
    bits and are cast to fp32 only when stored in `.grad`.
    """
    shapes = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    gemms = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}

    class WeightGradDtypes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in gemms and isinstance(out, torch.Tensor) and tuple(out.shape) in shapes:
                self.seen.add(out.dtype)
            return out

    with torch.autocast(dev, dtype=half, enabled=half is not None):
        loss = model(**batch).loss
    with WeightGradDtypes() as mode:
        loss.backward()  # leaves the gradients in .grad: the state count below includes them
    return {str(d).removeprefix("torch.") for d in mode.seen}


def step_recipe(recipe, steps=kw_steps, lr=kw_lr):
    """Train a fresh bert-large for `steps` steps in one recipe; memory, dtypes and timings of its step."""
    half = RECIPES[recipe]
    torch.backends.cuda.matmul.allow_tf32 = recipe == "tf32"  # a GPU switch; a CPU ignores it
    model = models.build("bert-large-uncased", head="sequence-classification", seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, foreach=True)
    scaler = torch.amp.GradScaler(dev, enabled=recipe == "fp16")

    def step(batch):
        with torch.autocast(dev, dtype=half, enabled=half is not None):
            loss = model(**batch).loss
        scaler.scale(loss).backward()  # fp16: backward of S * loss; otherwise plain backward
        scaler.step(optimizer)  # fp16: unscale the gradients, skip the step if one is inf or nan
        scaler.update()  # fp16: halve S after an overflow, double it after 2000 clean steps
        optimizer.zero_grad(set_to_none=True)
        return loss

    measure.reset_peak(dev)
    for batch in itertools.islice(data.batches(ds_kw, kw_batch, seed=0), steps):
        batch = {k: v.to(dev) for k, v in batch.items()}
        step(batch)
    peak = measure.allocator_mib()["peak_allocated_mib"] * MIB / GIB if prof.on_gpu else float("nan")
    # Time the step at the training size and at the realistic size (time_it: warm-up, 10 repeats, GPU-busy).
    t_small = timing.time_it(lambda: step(batch), device=dev, warmup=3, repeat=10)
    big = {k: v.to(dev) for k, v in ds_big[:].items()}
    measure.reset_peak(dev)
    try:
        t_big = timing.time_it(lambda: step(big), device=dev, warmup=2, repeat=10)
        big_peak = measure.allocator_mib()["peak_allocated_mib"] * MIB / GIB if prof.on_gpu else float("nan")
    except torch.OutOfMemoryError:
        t_big, big_peak = None, float("nan")  # too large for this GPU: reported as out of memory
    optimizer.zero_grad(set_to_none=True)
    # By construction, not a measurement: a .grad always has its parameter's dtype, and autocast never changes
    # the dtype of the weights or of AdamW's states.
    assert all(p.dtype == torch.float32 for p in model.parameters())
    # A check that can fail: in which dtype were the Linear weights' gradients computed?
    grad_dtypes = linear_grad_dtypes(model, batch, half)
    assert grad_dtypes == {str(half or torch.float32).removeprefix("torch.")}, grad_dtypes
    states = accounting.model_state_bytes(model, optimizer)
    # The 16-bit weight copies autocast keeps for backward: saved bytes of an 8-token input (activations ~ 0).
    with accounting.SavedTensorMeter(model) as copies, torch.autocast(dev, dtype=half, enabled=half is not None):
        model(**tiny_input)
    with SavedByDtype(model) as saved, torch.autocast(dev, dtype=half, enabled=half is not None):
        model(**batch)
    n = models.n_params(model)
    return {
        "recipe": recipe, "t_small": t_small,
        "t_big": t_big, "peak_gib": peak, "big_peak_gib": big_peak, "n_matmul": flops.matmul_params(model),
        "n_layers": model.config.num_hidden_layers, "hidden": model.config.hidden_size,
        "saved_by_dtype": saved.bytes, "saved_gib": sum(saved.bytes.values()) / GIB, "grad_dtypes": grad_dtypes,
        "weights_bpp": states["weights"] / n, "gradients_bpp": states["gradients"] / n,
        "optimizer_bpp": states["optimizer_states"] / n, "copies_bpp": copies.total_bytes / n, "n_params": n,
    }


runs = {}
for recipe in RECIPES:
    runs[recipe] = step_recipe(recipe)
    cleanup.free(globals())  # the function's model and optimizer are gone; empty the allocator's cache
torch.backends.cuda.matmul.allow_tf32 = False
print(f"{len(runs)} recipes x {kw_steps} steps, batch {kw_batch} x {kw_seq} tokens; "
      f"Linear weight gradients computed in: " + ", ".join(f"{r} {sorted(v['grad_dtypes'])[0]}" for r, v in runs.items()))

# %% [markdown]
# Every recipe passed the checks inside the function. One of them holds by construction (autocast leaves the
# weights in fp32, and a gradient always has its weight's dtype), so it is labelled as such; the one that could fail
# watches the backward pass's matrix products (a `TorchDispatchMode` sees each operation and its dtype): under fp16
# and bf16 autocast, the gradient of every linear layer's weight is computed by a 16-bit matrix product and only
# cast to fp32 on its way into `.grad`. The table gives the median step time of ten timed steps at the training
# size, the [peak allocated](https://gpu-efficient-training.github.io/book/book/glossary.html#peak-allocated-memory) memory over the three training steps (GPU only) and the bytes saved for backward by one
# forward pass of a training batch. Its last column divides fp32's median by each recipe's: two blocks of steps
# timed one after the other, which chapter 8 (section 8.1) shows can differ by more than their spread when the host
# sets the pace, as it does at this size. It is a reading of the blocks, not a comparison; the comparison of the
# recipes' speed comes after the seeds, from alternating rounds.

# %%
mp = pd.DataFrame({
    r: {"step (ms)": v["t_small"].wall.median * 1e3, "step IQR (ms)": v["t_small"].wall.iqr * 1e3,
        "samples/s": kw_batch / v["t_small"].wall.median,
        "tokens/s": kw_batch * kw_seq / v["t_small"].wall.median, "peak allocated (GiB)": v["peak_gib"],
        "saved for backward (GiB)": v["saved_gib"]}
    for r, v in runs.items()
}).T
mp["speed-up vs fp32"] = mp.loc["fp32", "step (ms)"] / mp["step (ms)"]
mp

# %% [markdown]
# **Does the precision change what the model learns?** Two runs of one recipe differ too: in their random initial
# weights, in the order of their batches and in their dropout masks. So a difference between two single runs says
# nothing about the recipes until it is larger than the difference between seeds of one recipe. Here each recipe
# trains a smaller model of bert's architecture (4 layers of hidden size 256 instead of 24 of 1024; the tiny CPU
# profile uses its 2 layers of 128) on the keyword task, once for each of three seeds. The seed decides all three
# sources of randomness, and nothing else does:
#
# - the initial weights: `models.build(..., seed=seed)` draws them from its own generator and gives the caller's
#   random state back untouched;
# - the order of the batches: `data.batches(..., seed=seed)` shuffles with a generator of its own;
# - the dropout masks: they come from PyTorch's global generators, so each run calls `torch.manual_seed(seed)` first.
#
# Runs with the same seed therefore differ only in the recipe. The loss sits at $\ln 2 \approx 0.69$ nats (guessing)
# until the model finds the keyword, then falls. The learning rate (5e-4 after 10 warm-up steps, for 60 steps of 32
# sequences; the tiny profile 2e-3 after 5, for 60 steps of 16 over 1,000 token ids) is set so that the model leaves
# that plateau well inside the run: at much smaller rates a run can sit on it for all of its steps, and then whether
# it leaves is decided by the seed, not by the recipe. A run has *learned* when its five-step mean loss fell below 0.1 and the mean
# of its last ten steps is below 0.1 too. A recipe counts as learning differently from fp32 only when the difference
# holds across seeds: its first crossing of 0.1 comes later (or earlier) than fp32's in every seed, and the two
# medians are further apart than the spread between seeds (the widest range of first crossings of any one recipe).
# Anything less is "no difference across seeds". The loop is the lesson, so here it is in full; every recipe runs the same lines, and the ones that
# do not apply are switched off by `enabled=False`.

# %%
CONV_MODEL = prof.pick(tiny=dict(vocab_size=1024), full=dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                                                             intermediate_size=1024))  # tiny: 2 layers of 128
CONV_DATA = prof.pick(tiny=dict(high=1000, keyword=500), full={})  # tiny: 1,000 token ids, a small embedding on a CPU
conv_batch, conv_steps, conv_warmup = prof.pick(tiny=16, full=32), 60, prof.pick(tiny=5, full=10)
conv_lr = prof.pick(tiny=2e-3, full=5e-4)
SEEDS = (0, 1, 2)
ds_conv = data.keyword_dataset(conv_steps * conv_batch, kw_seq, seed=2, **CONV_DATA)


def adamw(params, lr):
    return torch.optim.AdamW(params, lr=lr, foreach=True)


def train_seed(seed, amp=None, tf32=False, make_optimizer=adamw, lr=conv_lr):
    """One run of the small model with everything random drawn from `seed`: its losses and loss scales."""
    torch.backends.cuda.matmul.allow_tf32 = tf32  # a GPU switch; a CPU ignores it
    torch.manual_seed(seed)  # the dropout masks: PyTorch's global generators, on the CPU and on every GPU
    model = models.build("bert-large-uncased", head="sequence-classification", seed=seed, **CONV_MODEL)  # weights
    optimizer = make_optimizer(model.parameters(), lr)
    scaler = torch.amp.GradScaler(dev, enabled=amp == torch.float16)
    losses, scales = [], [scaler.get_scale() if scaler.is_enabled() else float("nan")]  # S before the first step
    for i, batch in enumerate(itertools.islice(data.batches(ds_conv, conv_batch, seed=seed), conv_steps)):  # order
        batch = {k: v.to(dev) for k, v in batch.items()}
        for group in optimizer.param_groups:  # linear warm-up of the learning rate
            group["lr"] = lr * min(1.0, (i + 1) / conv_warmup)
        with torch.autocast(dev, dtype=amp or torch.float32, enabled=amp is not None):
            loss = model(**batch).loss
        scaler.scale(loss).backward()  # fp16: backward of S * loss; otherwise plain backward
        scaler.step(optimizer)  # fp16: unscale the gradients, skip the step if one is inf or nan
        scaler.update()  # fp16: halve S after an overflow, double it after 2000 clean steps
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        scales.append(scaler.get_scale() if scaler.is_enabled() else float("nan"))
    torch.backends.cuda.matmul.allow_tf32 = False
    return {"losses": losses, "scales": scales}


conv = {r: [train_seed(s, amp=RECIPES[r], tf32=r == "tf32") for s in SEEDS] for r in RECIPES}
conv_params = models.n_params(models.build("bert-large-uncased", head="sequence-classification", device="meta",
                                           **CONV_MODEL))
print(f"{len(RECIPES)} recipes x {len(SEEDS)} seeds x {conv_steps} steps of a {conv_params / 1e6:.1f}M-parameter "
      f"model, batch {conv_batch} x {kw_seq} tokens, peak learning rate {conv_lr:g}")

# %% [markdown]
# Per recipe, the table gives how many seeds learned, the step at which each seed's five-step mean loss first fell
# below 0.1 (in the order of the seeds), the range of those steps, and the range of the final losses (the mean of
# each run's last ten steps).

# %%
def learned_at(losses, threshold=0.1, window=5):
    """The first step at which the mean loss of the last ``window`` steps is below ``threshold`` (NaN: never)."""
    smooth = pd.Series(losses).rolling(window).mean()
    below = smooth[smooth < threshold]
    return float(below.index[0] + 1) if len(below) else float("nan")


def outcome(losses, threshold=0.1, last=10):
    """How a run ended: "learned" (crossed ``threshold`` and its last ``last`` steps average below it), "diverged"
    (crossed it, then its last steps average back above half of chance, ln 2 / 2), "unsettled" (crossed, ended in
    between) or "never"."""
    final = float(pd.Series(losses[-last:]).mean())
    if pd.isna(learned_at(losses, threshold)):
        return "never"
    if final < threshold:
        return "learned"
    return "diverged" if final > math.log(2) / 2 else "unsettled"


def seed_table(results):
    """One row per recipe (or optimizer) of runs over seeds: seeds learned, first crossings of 0.1, final losses."""
    rows = {}
    for name, seeded in results.items():
        first = [learned_at(r["losses"]) for r in seeded]
        final = [float(pd.Series(r["losses"][-10:]).mean()) for r in seeded]
        crossed = [x for x in first if pd.notna(x)]
        rows[name] = {
            "seeds learned": f"{[outcome(r['losses']) for r in seeded].count('learned')} of {len(seeded)}",
            "loss < 0.1 from step, per seed": ", ".join("never" if pd.isna(x) else f"{x:.0f}" for x in first),
            "range of those steps": f"{min(crossed):.0f}–{max(crossed):.0f}" if crossed else "never",
            "final loss, range (nats)": f"{min(final):.1e} – {max(final):.1e}"}
    return pd.DataFrame(rows).T


conv_table = seed_table(conv)
conv_table

# %%
def plot_seeds(results, title, ncols):
    """Each seed's five-step mean loss, one panel per recipe, on shared log axes."""
    nrows = math.ceil(len(results) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.2 * ncols, 2.8 * nrows + 0.6), sharex=True, sharey=True,
                             squeeze=False)
    for ax, (name, seeded) in zip(axes.flat, results.items()):
        for seed, run, style in zip(SEEDS, seeded, ["-", "--", ":"]):
            smooth = pd.Series(run["losses"]).rolling(5, min_periods=1).mean()
            ax.plot(smooth.index + 1, smooth, style, label=f"seed {seed}")
        ax.axhline(math.log(2), color="grey", lw=0.8)
        ax.axhline(0.1, color="grey", lw=0.8, ls=":")
        ax.set_yscale("log")
        ax.set_title(name, fontsize=10)
    for ax in axes.flat[len(results):]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel("training step")
    for ax in axes[:, 0]:
        ax.set_ylabel("loss, 5-step mean (nats)")
    axes.flat[0].legend(fontsize=8, loc="lower left")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


all_learned = all(outcome(r["losses"]) == "learned" for seeded in conv.values() for r in seeded)
fig = plot_seeds(conv, f"small bert, keyword task, {len(SEEDS)} seeds per recipe: "
                 + ("every precision learned in every seed" if all_learned else "loss by precision and seed")
                 + " (grey: ln 2 and 0.1)", ncols=len(conv))

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title First crossings of 0.1 over seeds
def versus(ref_steps, steps, horizon, spread=0.0):
    """First crossings of 0.1 over seeds (NaN: never) against a reference's, conservatively.

    "later" or "earlier" only when every seed of one lies beyond every seed of the other and the medians differ by
    more than the spread between seeds (the larger of the two sides' ranges, or ``spread`` if that is larger: the
    widest range of any setting in the experiment); otherwise "no difference across seeds". A run that never crossed
    counts as crossing at ``horizon + 1``.
    """
    if min(len(ref_steps), len(steps)) < 3:
        raise ValueError("a comparison across seeds needs at least 3 seeds on each side")
    a = pd.Series([horizon + 1 if pd.isna(x) else x for x in ref_steps], dtype=float)
    b = pd.Series([horizon + 1 if pd.isna(x) else x for x in steps], dtype=float)
    spread = max(a.max() - a.min(), b.max() - b.min(), spread)
    gap = b.median() - a.median()
    if b.min() > a.max() and gap > spread:
        return "later"
    if b.max() < a.min() and -gap > spread:
        return "earlier"
    return "no difference across seeds"


def seeds_text(results, ref, horizon, what):
    """What the seeded runs show: seeds learned and first crossings per name, each name against ``ref``."""
    first = {n: [learned_at(r["losses"]) for r in seeded] for n, seeded in results.items()}
    ends = {n: [outcome(r["losses"]) for r in seeded] for n, seeded in results.items()}
    n_seeds = len(first[ref])

    def crossings(n):
        xs = [x for x in first[n] if pd.notna(x)]
        if not xs:
            return ""
        return f" (first below 0.1 at step {xs[0]:.0f})" if min(xs) == max(xs) else \
            f" (first below 0.1 at steps {min(xs):.0f}–{max(xs):.0f})"

    text = (f"Runs that learned, of {n_seeds} seeds each, within {horizon} steps: "
            + "; ".join(f"{n} {ends[n].count('learned')} of {n_seeds}{crossings(n)}" for n in results) + ". ")
    partial = [n for n in results if 0 < ends[n].count("learned") < n_seeds]
    others = [n for n in results if n != ref and n not in partial]
    med = {n: pd.Series([horizon + 1 if pd.isna(x) else x for x in first[n]]).median() for n in results}
    spread = max(pd.Series([horizon + 1 if pd.isna(x) else x for x in first[n]]).agg(lambda s: s.max() - s.min())
                 for n in results)  # the widest range between the seeds of any one setting: the seeds' noise here
    verdicts = {n: versus(first[ref], first[n], horizon, spread) for n in others}
    same = [n for n in others if verdicts[n] == "no difference across seeds"]
    if same:
        gap = max(abs(med[n] - med[ref]) for n in same)
        near = (f"the same median first crossing as {ref}'s" if gap == 0 else
                f"median first crossings at most {gap:.0f} step{'' if gap == 1 else 's'} from {ref}'s")
        text += (f"{prose.listing(same)} against {ref}: no difference across seeds ({near}; between the seeds of "
                 f"one {what} the first crossings spread over up to {spread:.0f} steps). ")
    for word in ("later", "earlier"):
        names = [n for n in others if verdicts[n] == word]
        never = [n for n in names if ends[n].count("never") == n_seeds]
        if never:
            text += (f"{prose.listing(never)} did not leave the plateau in any seed, while {ref} learned in "
                     f"{ends[ref].count('learned')} of {n_seeds}: a difference that holds across seeds. ")
        crossed = [n for n in names if n not in never]
        if crossed:
            text += (f"{prose.listing(crossed)} crossed 0.1 {word} than {ref} in every seed, by "
                     + ", ".join(f"{abs(med[n] - med[ref]):.0f} steps ({n})" for n in crossed)
                     + f" at the median, more than the spread between seeds ({spread:.0f} steps): a difference that "
                     f"holds across seeds. ")
    if partial:
        text += (f"{prose.listing(partial)} learned in some seeds and not in others ("
                 + "; ".join(f"{n}: " + ", ".join(ends[n]) for n in partial)
                 + f"): the seed decided, so this is not evidence that the {what} learns worse. ")
    if ends[ref].count("learned") == n_seeds and len(same) == len(results) - 1:
        text += f"In these runs the {what} did not change what the model learned. "
    return text


def scaler_text(seeded, steps):
    """The fp16 GradScaler over the seeded runs: halvings (skipped steps) and doublings of its scale S."""
    halvings = doublings = 0
    for run in seeded:
        sc = pd.Series(run["scales"])  # S before step 1, then after each step
        halvings += int((sc.diff() < 0).sum())
        doublings += int((sc.diff() > 0).sum())
    s0 = seeded[0]["scales"][0]
    if halvings == 0 and doublings == 0:
        return (f"The fp16 `GradScaler` never changed its scale in any of the {len(seeded)} runs: *S* stayed at its "
                f"initial value, {s0:,.0f} (2^{math.log2(s0):.0f}), for all {steps} steps. No scaled gradient "
                f"overflowed, so it never halved *S* or skipped a step, and it doubles *S* only after 2,000 clean "
                f"steps (its `growth_interval`), more than these runs have. So these runs do not show the scaler "
                f"searching for a scale; they show that 2^{math.log2(s0):.0f} was small enough not to overflow.")
    return (f"Over the {len(seeded)} fp16 runs, the `GradScaler` halved its scale {halvings} times in all (each time "
            f"skipping that step, because a scaled gradient overflowed) and doubled it {doublings} times, starting "
            f"from {s0:,.0f} before the first step; the runs ended at "
            + ", ".join(f"{run['scales'][-1]:,.0f}" for run in seeded) + ".")


text = seeds_text(conv, "fp32", conv_steps, "precision")
if "fp16" in conv:
    text += scaler_text(conv["fp16"], conv_steps)
display(Markdown(text))

# %% [markdown]
# **Speed, and what limits it.** The table below is `time_it`'s reading of each recipe at both sizes: the median
# wall time of a step and its interquartile range (IQR), the host enqueue time (how long the CPU needed to issue the
# step's work), the GPU-busy fraction (the share of the wall time in which some kernel ran), the number of GPU
# operations per step, their total GPU kernel time, the GPU time of the copy kernels, which include every dtype cast
# autocast makes, and the peak allocated memory at each size (GPU only). It gives the GPU-busy share without a
# host-bound/GPU-bound word: a row near a band's edge (fp32's small step lands near the 90% line) would
# change its word from one run to the next, while the share says what it is. Those rows were timed one recipe after the
# other, as separate blocks. The comparisons the text draws come from `timing.interleaved` (chapter 8) instead: one
# fp32 bert-large and its AdamW, each recipe's step (`steps.make_step`, with the autocast dtype and, for fp16, a
# `GradScaler`; TF32 switched on, untimed, before each of its samples) alternating with fp32's in rounds, and the
# median of the per-round ratios with its 95% interval. A recipe counts as faster or slower only when the whole
# interval lies beyond ±3%. Precision is a change on the GPU, so it is judged at the realistic size, where the GPU
# is busy; the small training step shows something else, the host. The GPU-busy fractions that the sentences below
# quote belong to the alternating rounds (each side's profiled kernel time over its median time in the rounds); a
# step that runs beside another in rounds need not take as long as it did alone, so at the small size they can
# differ from the table's, which `time_it` measured on each recipe alone.

# %%
speed_rows = {}
for r, v in runs.items():
    for size, t, peak_gib in ((f"{kw_batch} x {kw_seq}", v["t_small"], v["peak_gib"]),
                              (f"{big_batch} x {big_seq}", v["t_big"], v["big_peak_gib"])):
        if t is None:
            speed_rows[(size, r)] = {"note": "out of memory"}
            continue
        row = t.summary() | {"peak allocated (GiB)": peak_gib}
        if t.profile is not None:
            g = t.profile.gpu_events
            row["copy and cast kernels (ms)"] = g.loc[g["name"].str.contains("copy", case=False), "dur_us"].sum() / t.profile.steps / 1e3
        speed_rows[(size, r)] = row
speed = pd.DataFrame(speed_rows).T
speed_cols = [c for c in ("wall median (ms)", "wall IQR (ms)", "host enqueue median (ms)", "GPU busy", "GPU ops per call",
                          "GPU kernel time (ms)", "copy and cast kernels (ms)", "peak allocated (GiB)", "note")
              if c in speed.columns]
speed[speed_cols]

# %%
def tf32(on):
    return lambda: setattr(torch.backends.cuda.matmul, "allow_tf32", on)


model = models.build("bert-large-uncased", head="sequence-classification", seed=0)
optimizer = torch.optim.AdamW(model.parameters(), lr=kw_lr)
small = {k: v.to(dev) for k, v in next(iter(data.batches(ds_kw, kw_batch, seed=0))).items()}
big = {k: v.to(dev) for k, v in ds_big[:].items()}
cmp_small = {HALF: timing.interleaved(steps.make_step(model, optimizer, small),
                                      steps.make_step(model, optimizer, small, amp=RECIPES[HALF]), device=dev,
                                      names=("fp32", HALF), setup_a=tf32(False), setup_b=tf32(False))}
cmp_big = None
if all(v["t_big"] is not None for v in runs.values()):
    cmp_big = {r: timing.interleaved(steps.make_step(model, optimizer, big),
                                     steps.make_step(model, optimizer, big, amp=RECIPES[r]), device=dev,
                                     names=("fp32", r), setup_a=tf32(False), setup_b=tf32(r == "tf32"),
                                     rounds=10, warmup=1, profile_steps=1)
               for r in RECIPES if r != "fp32"}
torch.backends.cuda.matmul.allow_tf32 = False
cleanup.free(globals(), "model", "optimizer", "small", "big")
pd.DataFrame({(size, r): c.row() for size, cmps in (("small", cmp_small), ("realistic", cmp_big or {}))
              for r, c in cmps.items()}).T

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title The small training step, fp32 against 16-bit autocast (interleaved)
def small_step_text(c, half, tokens, cast_ms, n_cast):
    """The small training step, fp32 against 16-bit autocast (interleaved): the host lesson."""
    ts, t32 = c.b, c.a
    launch = timing.us_per_launch(ts)
    text = (f"At {tokens:,} tokens per step, {half} autocast against fp32, in alternating rounds: "
            f"{c.phrase(what='than fp32')}. The {half} step kept the GPU busy {ts.gpu_busy:.0%} of its wall time and "
            f"needed {ts.host.median * 1e3:.1f} ms of host time to issue {ts.kernels_per_call:,} GPU operations, about "
            f"{launch:.0f} µs each on this host (fp32: busy {t32.gpu_busy:.0%}, {t32.kernels_per_call:,} operations); "
            f"its verdict is *{ts.verdict}*. Casting the {n_cast / 1e6:,.0f} million weights of the linear layers to 16 "
            f"bits reads 4 and writes 2 bytes each, {6 * n_cast / GIB:.1f} GiB per forward pass; all copy kernels of "
            f"the step together, every cast among them, ran for {cast_ms:.2f} ms of GPU time. ")
    if ts.verdict == "host-bound":
        return text + ("So this step's time is the CPU's time to issue work, not the GPU's arithmetic: autocast adds a "
                       "cast operator in front of every matrix product, each a trip through the dispatcher and a kernel "
                       f"launch, {ts.kernels_per_call - t32.kernels_per_call:,} more operations per step, and the faster "
                       "16-bit products cannot shorten a step whose GPU is waiting for Python. How this comparison "
                       "comes out is decided by the reader's CPU (the µs per launch), not by the GPU; it says nothing "
                       "about precision, which the realistic step below does. ")
    return text + "The step is not host-bound here, so the GPU's own work decides its time. "


def big_step_text(cmps, half, tokens):
    """The realistic step, each 16-bit or TF32 recipe against fp32 (interleaved): the precision lesson."""
    cb = cmps[half]
    text = (f"At {tokens:,} tokens the picture changes: the GPU was busy {cb.b.gpu_busy:.0%} of the {half} step "
            f"(*{cb.b.verdict}*) and {cb.a.gpu_busy:.0%} of fp32's; {half} ran at "
            f"{cb.phrase(what='than fp32')}, and on GPU time alone at {cb.gpu_ratio:.1f}×")
    others = [f"{r} at {c.speedup:.2f}× fp32's speed (95% interval {c.lo:.2f}–{c.hi:.2f}×)" + (
        " with its `GradScaler`" if r == "fp16" else "") for r, c in cmps.items() if r != half]
    if others:
        text += "; " + prose.listing(others)
    text += ". Mixed precision pays where the matrix products keep the GPU busy. "
    if "fp16" in cmps and half != "fp16":
        c16 = cmps["fp16"]
        if abs(c16.b.kernel_s / cb.b.kernel_s - 1) < 0.05 and c16.b.gpu_busy < cb.b.gpu_busy - 0.05:
            text += (f"fp16's kernels ran for about as long as {half}'s ({c16.b.kernel_s * 1e3:.0f} against "
                     f"{cb.b.kernel_s * 1e3:.0f} ms), but the GPU was busy {c16.b.gpu_busy:.0%} of its step against "
                     f"{cb.b.gpu_busy:.0%}: `GradScaler.step` reads its inf check back to the CPU (`.item()`) before "
                     f"every optimizer step, so the GPU waits there while the host issues the optimizer's work. ")
    return text


if prof.on_gpu:
    cast = speed.loc[(f"{kw_batch} x {kw_seq}", HALF), "copy and cast kernels (ms)"]
    text = small_step_text(cmp_small[HALF], HALF, kw_batch * kw_seq, cast, runs["fp32"]["n_matmul"])
    if cmp_big is not None:
        text += big_step_text(cmp_big, HALF, big_batch * big_seq)
        text += (f"The realistic step's peak allocated memory was {runs['fp32']['big_peak_gib']:.1f} GiB in fp32 (the "
                 f"planner predicted {big_plan_gib:.1f} GiB) and {runs[HALF]['big_peak_gib']:.1f} GiB in {HALF}. ")
    else:
        oom = [r for r, v in runs.items() if v["t_big"] is None]
        text += (f"At {big_batch} x {big_seq} tokens the step ran out of memory on this GPU for "
                 f"{', '.join(oom)}, so the realistic comparison is missing here.")
    display(Markdown(text))
else:
    print("skipped on CPU: GPU-busy, host enqueue time and tensor-core speed-ups need a GPU")

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (5.1 One training step, four precisions)
if prof.on_gpu:
    display(Markdown(
        f"Memory: the peak allocated memory of the three training steps was {mp.loc['fp32', 'peak allocated (GiB)']:.2f} "
        f"GiB in fp32 and {mp.loc[HALF, 'peak allocated (GiB)']:.2f} GiB with {HALF} autocast. At this small batch "
        f"the peak is the optimizer step (weights, gradients, both states and the multi-tensor step's temporary "
        f"buffer, chapter 1), which mixed precision does not touch; the model states under it, "
        f"{16 * runs['fp32']['n_params'] / GIB:.2f} GiB, are the same in every recipe. Section 5.3 looks at the "
        f"peak more closely."
    ))
else:
    print("skipped on CPU: peak allocated memory needs a GPU")

# %% [markdown]
# **What the 16- and 18-byte rules count.** The Hugging Face guide
# ([Hugging Face, model training anatomy](https://gpu-efficient-training.github.io/book/book/references.html)) counts mixed precision as 18 bytes per parameter:
# 6 for the weights (an fp32 copy and a 16-bit copy), 4 for the gradients and 8 for AdamW. The same function
# measured each part, per parameter, after training:

# %%
# NBVAL_CHECK_OUTPUT
# (byte counts of the model states: identical on every machine; printed as text, identical across pandas versions)
rules = {r: sum(estimates.BYTES_PER_PARAM["fp32_adamw" if RECIPES[r] is None else "mixed_adamw"].values()) for r in runs}
bpp = pd.DataFrame({
    r: {"weights (fp32)": v["weights_bpp"], "gradients (fp32)": v["gradients_bpp"],
        "AdamW states (fp32)": v["optimizer_bpp"], "persistent total": v["weights_bpp"] + v["gradients_bpp"] + v["optimizer_bpp"],
        "rule (bytes/param)": rules[r]}
    for r, v in runs.items()
}).T
print(bpp.round(2).to_string())

# %% [markdown]
# Sixteen persistent bytes in every recipe. The 16-bit weight copies of the rule are real, but transient:
# autocast casts each weight when a layer first uses it, keeps the copy for the rest of the forward pass (the
# backward pass needs it) and frees it during backward. [Chapter 1](https://gpu-efficient-training.github.io/book/notebooks/01_memory_anatomy.html) measured them at just
# under 2 bytes per parameter (embeddings and layer norms are not cast). Here, for each recipe:

# %%
copies = pd.Series({r: v["copies_bpp"] for r, v in runs.items()}, name="saved for backward, 8-token input (bytes/param)")
copies

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (5.1 One training step, four precisions)
display(Markdown(
    f"With 8 tokens the activations are negligible: fp32 saves {copies['fp32']:.2f} bytes per parameter and keeps "
    f"no weight copies" + (" (nor does TF32, which rounds inside the tensor core, not in memory)" if "tf32" in copies else "")
    + f"; {HALF} autocast saves {copies[HALF]:.2f} bytes per parameter, nearly all of it 16-bit weight copies. "
    f"So the 18-byte rule is an upper bound of the model states during the forward pass, and 16 bytes is what stays."
))

# %% [markdown]
# Which operations run in which dtype? Forward hooks on a one-layer bert-large record the dtype of each module's
# output under autocast (bf16, or fp16 on a GPU without bf16):

# %%
probe = models.build("bert-large-uncased", head="sequence-classification", num_hidden_layers=1)
out_dtypes = {}


def record_dtype(module, args, output):
    out = output[0] if isinstance(output, tuple) else output
    if torch.is_tensor(out):
        out_dtypes.setdefault(type(module).__name__, set()).add(str(out.dtype).removeprefix("torch."))


hooks = [m.register_forward_hook(record_dtype) for m in probe.modules()]
with torch.autocast(dev, dtype=AMP):
    probe_out = probe(**tiny_input)
for h in hooks:
    h.remove()
assert out_dtypes["Linear"] == {str(AMP).removeprefix("torch.")} and out_dtypes["LayerNorm"] == {"float32"}
assert probe_out.loss.dtype == torch.float32
pd.Series({k: ", ".join(sorted(v)) for k, v in out_dtypes.items() if k in
           ("Embedding", "Linear", "GELUActivation", "LayerNorm", "BertSelfAttention", "BertLayer")} |
          {"loss (cross-entropy)": str(probe_out.loss.dtype).removeprefix("torch.")}, name=f"output dtype under {AMP_NAME} autocast")

# %% [markdown]
# Linear layers and attention produce 16-bit outputs; the embedding lookup, layer norm and the loss produce fp32,
# and so does the residual stream after each layer norm. Autocast keeps lists of which operation runs in which
# dtype; the ones that reduce over many values (norms, softmax, sums, the loss) are on the fp32 list.
#
# That decides how much autocast saves on activations. Each operation saves for backward what its gradient needs,
# in the dtype it ran in: a linear layer saves its 16-bit input, but a layer norm saves its fp32 input, the loss its
# fp32 logits, and dropout a mask of one byte per value whatever the precision. The training batch's saved bytes,
# by dtype (the 16-bit row includes the weight copies):

# %%
by_dtype = pd.DataFrame({r: v["saved_by_dtype"] for r, v in runs.items() if r in ("fp32", HALF)}).fillna(0) / GIB
by_dtype.loc["total"] = by_dtype.sum()
copies_gib = copies[HALF] * runs[HALF]["n_params"] / GIB
by_dtype.loc["total less weight copies"] = by_dtype.loc["total"] - pd.Series({"fp32": 0.0, HALF: copies_gib})
by_dtype.columns = [f"{c} (GiB)" for c in by_dtype.columns]
act_ratio = by_dtype.iloc[-1, 1] / by_dtype.iloc[-1, 0]
by_dtype

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (5.1 One training step, four precisions)
half_dt = str(RECIPES[HALF]).removeprefix("torch.")
fp32_left = by_dtype.loc["float32"].iloc[1] if "float32" in by_dtype.index else 0.0
bool_gib = by_dtype.loc["bool"].iloc[1] if "bool" in by_dtype.index else 0.0
display(Markdown(
    f"Without the weight copies, {HALF} autocast saved {by_dtype.iloc[-1, 1]:.2f} GiB for backward against fp32's "
    f"{by_dtype.iloc[-1, 0]:.2f} GiB: {act_ratio:.0%} of it, not the half a rule of thumb assumes. Of the "
    f"{HALF} run's saved bytes, {fp32_left:.2f} GiB stayed in fp32 (layer-norm inputs, that is the residual "
    f"stream, attention's fp32 log-sum-exp statistics and the loss's inputs) and {bool_gib:.2f} GiB are one-byte "
    f"dropout masks, the same size in both recipes; only the "
    f"{by_dtype.loc[half_dt].iloc[1] - copies_gib if half_dt in by_dtype.index else float('nan'):.2f} GiB of "
    f"16-bit activations are the halved ones. Section 5.3 uses this ratio."
))

# %%
freed = cleanup.free(globals(), "probe", "probe_out", "hooks")

# %% [markdown]
# ## 5.2 Loss scaling: gradients underflow in an fp16 backward pass
#
# Chapter 2 counted the fp32 gradients of bert-large that fp16 *would* flush to zero. Under autocast the question is
# different: the weights are fp32, but their gradients are computed by fp16 matrix products from the fp16 gradients
# of the activations (section 5.1 saw those products run in 16 bits), and only then stored as fp32. An fp16 result
# is rounded to the nearest fp16 value, and the smallest one above zero is the subnormal $2^{-24}$: a value below
# half of it, $2^{-25}$, rounds to zero (at exactly $2^{-25}$ the tie goes to the even neighbour, zero). So the
# share of gradients an fp16 backward loses should be close to the share of true gradients below $2^{-25}$, not
# below $2^{-24}$. We run it: the gradients of bert-large for one batch, three times, with dropout off so that the
# three passes compute the same function: in fp32 (the reference), under fp16 autocast without scaling, and under
# fp16 autocast with the loss multiplied by $2^{16}$ and the gradients divided by it afterwards, which is what
# `GradScaler` does.

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
below = {"below 2^-25 (rounds to 0 in fp16)": 2.0**-25, "below 2^-24 (fp16's smallest subnormal)": 2.0**-24,
         "below 2^-14 (fp16 subnormal range)": 2.0**-14}
share_below = pd.Series({k: 100 * ((g_ref.abs() < v) & nonzero).sum().item() / n_nonzero for k, v in below.items()},
                        name="share of non-zero fp32 gradients (%)")
# A check that can fail: rounding the fp32 reference to fp16 zeroes exactly the values at or below 2^-25.
cast_zero = 100 * ((g_ref.half() == 0) & nonzero).sum().item() / n_nonzero
at_or_below = 100 * ((g_ref.abs() <= 2.0**-25) & nonzero).sum().item() / n_nonzero
assert abs(cast_zero - at_or_below) < 1e-9, (cast_zero, at_or_below)
share_below["reference cast to fp16 is 0 (check: at or below 2^-25)"] = cast_zero
lost_mask = (g_fp16 == 0) & nonzero
lost_norm_pct = 100 * (g_ref[lost_mask].norm() / g_ref.norm()).item()  # how much of the gradient the lost values carry
display(share_below.to_frame())
scaling

# %%
log2 = g_ref[nonzero].abs_().log2_()  # in place: these vectors have one entry per weight
lo, hi = int(log2.min().floor()), int(log2.max().ceil())
counts = torch.histc(log2, bins=hi - lo, min=lo, max=hi).cpu()  # one bin per power of two, on the device
fig, ax = plt.subplots(figsize=(8, 4))
ax.stairs(counts.numpy(), range(lo, hi + 1), fill=True, color="#4C72B0")
ax.axvline(-25, color="#C44E52", linestyle="--", label="2^-25: below it, fp16 rounds to 0")
ax.axvline(-14, color="#DD8452", linestyle=":", label="2^-14: fp16's smallest normal")
ax.axvline(-25 - 16, color="grey", linestyle="-.", label="2^-41: rounds to 0 with loss scale 2^16")
ax.set_yscale("log")
lost_pct = share_below.iloc[0]
ax.set_title(f"bert-large weight gradients (fp32): {lost_pct:.2g}% lie below fp16's rounding limit"
             if lost_pct > 0 else "bert-large weight gradients (fp32): none lies below fp16's rounding limit")
ax.set_xlabel("log2 |gradient| (one bin per power of two)")
ax.set_ylabel("number of weights (log scale)")
ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
fig.tight_layout()

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (5.2 Loss scaling)
lost, lost_scaled = scaling.iloc[0, 0], scaling.iloc[1, 0]
err, err_scaled = scaling.iloc[0, 1], scaling.iloc[1, 1]
near = abs(lost - lost_pct) <= 0.25 * max(lost_pct, 1e-3)
display(Markdown(
    f"In fp32, {share_below.iloc[0]:.3f}% of this batch's non-zero weight gradients are smaller than 2^-25, "
    f"{share_below.iloc[1]:.3f}% smaller than 2^-24 and {share_below.iloc[2]:.1f}% smaller than 2^-14. "
    f"Under fp16 autocast without scaling, {lost:.3f}% of the gradients came out exactly zero although the fp32 "
    f"reference is not, and the gradient vector is {err:.2f}% away from the reference. "
    + ("The lost share is close to the share below 2^-25, as round-to-nearest predicts: a weight gradient "
       "is lost when the fp16 matrix product that computes it rounds its result to zero. "
       if near else
       f"The lost share is not the share below 2^-25 ({lost_pct:.3f}%): the fp16 backward computes the "
       f"gradients from fp16 activation gradients, which are themselves rounded and can underflow earlier, so its "
       f"small values are not the reference's. ")
    + (f"The lost values carry {lost_norm_pct:.1e}% of the reference gradient's norm, far too little to explain "
       f"the {err:.2f}% error. A likely source, which this section does not measure, is upstream: activation "
       f"gradients that fall into fp16's subnormal range (below 2^-14) keep fewer significant bits, and pass "
       f"that rounding on to the weight gradients computed from them; scaling lifts them out of that range. "
       if lost_norm_pct < 0.1 * err else
       f"The lost values carry {lost_norm_pct:.2f}% of the reference gradient's norm, a visible part of the "
       f"{err:.2f}% error. ")
    + f"With the loss scaled by 2^16, {lost_scaled:.3f}% are lost and the error is {err_scaled:.2f}%: what "
    f"remains is the rounding of 16-bit products, which no scaling removes. The histogram's log axis shows the "
    f"tail that matters here. bf16 autocast needs none of this: its range is fp32's, which is why it is the usual "
    f"choice on GPUs that support it (A100, H100 and later; a T4 has no bf16 tensor cores, so on Colab's free GPU "
    f"fp16 with a scaler is the fast option)."
))

# %%
freed = cleanup.free(globals(), "model", "g_ref", "g_fp16", "g_scaled", "nonzero", "lost_mask", "log2")

# %% [markdown]
# ## 5.3 When mixed precision raises the peak
#
# The Hugging Face guide's table of single-GPU techniques gives mixed precision's effect on memory as "depends", and
# its text warns that mixed precision can *increase* memory, especially at small batch sizes, because the model is
# then on the GPU in both 16 and 32 bits; at a large batch, smaller activations save memory. Section 5.1 shows why
# either can happen: autocast adds about 2 bytes per parameter of weight copies and shrinks the activations (to the ratio
# measured there, not to half). Which wins depends on what else is alive when the copies are. If the gradients of
# the previous step are freed (`zero_grad(set_to_none=True)`, PyTorch's default), the copies are gone before the
# gradients are complete, so at small batches the peak (weights, gradients and [optimizer states](https://gpu-efficient-training.github.io/book/book/glossary.html#optimizer-states) at the end of
# backward) is the same with or without autocast. If the gradients stay allocated through the forward pass (with
# `set_to_none=False`, and during every [micro-batch](https://gpu-efficient-training.github.io/book/book/glossary.html#micro-batch) after the first under [gradient accumulation](https://gpu-efficient-training.github.io/book/book/glossary.html#gradient-accumulation), chapter 3), the
# copies come on top of all 16 bytes.
#
# We measure the peak of one training iteration (after a first one that created AdamW's states) for fp32 and
# autocast at several batch sizes, with gradients freed and kept. The optimizer is `AdamW(fused=True)`, whose step
# needs no temporary copy of the weights (the default multi-tensor step would set the peak at small batches, chapter
# 1). On a CPU there is no allocator to ask; the cell reports what the accounting can see at the end of the forward
# pass (weights, gradients, optimizer states and the bytes saved for backward) instead.

# %%
sweep_seq = prof.pick(tiny=32, full=128)
sweep_batches = prof.pick(tiny=[1, 2, 4, 8], full=[1, 2, 4, 8, 16])
sweep_rows = []
for recipe, half in (("fp32", None), (AMP_NAME, AMP)):
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
                           "peak allocated (GiB)": peak, "accounted at forward end (GiB)": forward_end / GIB,
                           "saved for backward (GiB)": saved.total_bytes / GIB})
    del model, optimizer, loss, saved
    cleanup.free(globals())
sweep = pd.DataFrame(sweep_rows)
metric = "peak allocated (GiB)" if prof.on_gpu else "accounted at forward end (GiB)"
pk = sweep.pivot_table(index="batch", columns=["gradients", "recipe"], values=metric)
pk

# %%
diff_mib = {g: (pk[(g, AMP_NAME)] - pk[(g, "fp32")]) * GIB / MIB for g in ("freed", "kept")}
fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
for ax, grads_mode in zip(axes, ("freed", "kept")):
    for recipe, style in (("fp32", "o-"), (AMP_NAME, "s--")):
        part = sweep[(sweep.recipe == recipe) & (sweep.gradients == grads_mode)]
        ax.plot(part.batch, part[metric], style, label=recipe + (" autocast" if recipe != "fp32" else ""))
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"batch size (sequences of {sweep_seq} tokens)")
    ax.set_title(f"gradients {grads_mode} between steps")
axes[0].set_ylabel(metric)
axes[1].legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
costs = diff_mib["kept"].iloc[0] > 0 and diff_mib["freed"].iloc[0] <= diff_mib["kept"].iloc[0]
fig.suptitle(f"bert-large, fused AdamW: autocast {'costs memory at small batches when gradients are kept' if costs else 'against fp32, gradients freed and kept'}")
fig.tight_layout()

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (5.3 When mixed precision raises the peak)
b_lo, b_hi = sweep_batches[0], sweep_batches[-1]
unit = "peak allocated memory" if prof.on_gpu else "accounted memory at the end of the forward pass (CPU: no allocator)"
kept_lo, kept_hi = diff_mib["kept"].loc[b_lo], diff_mib["kept"].loc[b_hi]
freed_lo, freed_hi = diff_mib["freed"].loc[b_lo], diff_mib["freed"].loc[b_hi]
n_bert = runs["fp32"]["n_params"]
text = (f"Measured as {unit}: with gradients kept, {AMP_NAME} autocast is {kept_lo:+,.0f} MiB away from fp32 at batch "
        f"{b_lo} (a positive number is a cost) and {kept_hi:+,.0f} MiB at batch {b_hi}; with gradients freed the "
        f"differences are {freed_lo:+,.0f} MiB and {freed_hi:+,.0f} MiB. ")
if kept_lo > 0 and kept_hi < kept_lo:
    text += ("The guide's warning holds in one common setting: a large model trained at a small batch with gradient "
             "accumulation. Then the weight copies outweigh the smaller activations, until the batch grows enough "
             "that the activations win. ")
elif kept_lo > 0:
    text += "Autocast costs memory at every batch of this sweep when the gradients are kept. "
else:
    text += "In this run autocast did not raise the peak even with the gradients kept. "
c_bpp, keep = copies[HALF], act_ratio
fp32_act_mib = (sweep[(sweep.recipe == "fp32") & (sweep.gradients == "kept")]
                .set_index("batch")["saved for backward (GiB)"] * GIB / MIB)
pred = c_bpp * runs[HALF]["n_params"] / MIB - (1 - keep) * fp32_act_mib  # predicted cost of autocast (MiB)
text += (f"A rule for a model of *N* parameters whose gradients are alive during the forward pass: the weight copies "
         f"cost *cN* bytes, with *c* = {c_bpp:.2f} measured in section 5.1 (below 2: embeddings and layer norms are "
         f"not cast), and autocast keeps {keep:.0%} of the fp32 activations (measured at {kw_seq}-token sequences), "
         f"so it saves 1 - {keep:.2f} of them (not half: layer-norm inputs, the residual stream and the loss's inputs "
         f"stay fp32, and dropout masks are one byte in both). So autocast raises the peak while the fp32 activations "
         f"of a micro-batch are smaller than about *cN* / (1 - {keep:.2f}) ≈ {c_bpp / max(1 - keep, 1e-6):.1f} *N* "
         f"bytes; with *c* = 2 and activations that halve, the same rule would say 4*N*. Checked against this sweep "
         f"with gradients kept (the fp32 activations are the bytes fp32 saved for backward at each batch), it "
         f"predicts {pred.loc[b_lo]:+,.0f} MiB at batch {b_lo} and {pred.loc[b_hi]:+,.0f} MiB at batch {b_hi}, "
         f"against the measured {kept_lo:+,.0f} and {kept_hi:+,.0f} MiB.")
display(Markdown(text))

# %% [markdown]
# ## 5.4 Optimizers: state bytes, step time and convergence
#
# The optimizer states are the largest part of the 16 bytes. The rules of the Hugging Face guide
# ([Hugging Face, efficient training on one GPU](https://gpu-efficient-training.github.io/book/book/references.html)): AdamW keeps 8 bytes per parameter (two
# fp32 states), SGD with momentum 4 (one), and an 8-bit optimizer 2. Adafactor
# ([Shazeer and Stern (2018)](https://gpu-efficient-training.github.io/book/book/references.html)) keeps, for each weight matrix, only running averages of the row
# and column sums of the squared gradients (and no first moment in the Trainer's setting), so its states are almost
# nothing. The 8-bit AdamW of bitsandbytes ([Dettmers et al. (2022)](https://gpu-efficient-training.github.io/book/book/references.html)) stores both states in 8
# bits with one fp32 scale per block of 256 values (block-wise quantization, as in chapter 2; the paper's blocks
# held 2,048 values, the library's optimizers use 256); tensors smaller than 4,096 values
# (biases, layer norms) keep fp32 states. The paged variant allocates the states of tensors with at least 100,000
# values in CUDA unified memory, which the driver can move to the CPU's RAM when the GPU runs out, instead of
# failing; smaller tensors get ordinary GPU tensors.
#
# Each optimizer trains a fresh bert-large (seed 0, with section 5.1's batches and autocast) for three steps, at one
# small learning rate (neither the bytes nor the time depend on it); then `time_it` times `optimizer.step()` alone and
# the whole training step. The table's last column is the name that selects the same optimizer in the Trainer,
# `TrainingArguments(optim=...)`. The comparison of the optimizers' speed comes after the table: every optimizer's
# `step()` on one model's gradients, in alternating rounds with fused AdamW's (`timing.interleaved`). Whether they
# learn alike is, as for the precisions, a question for several seeds of section 5.1's small model; that comes last.

# %%
import bitsandbytes as bnb
from transformers.optimization import Adafactor
from transformers.training_args import OptimizerNames

OPTIMIZERS = {  # name: (constructor, Trainer's optim=)
    "AdamW (foreach)": (adamw, "adamw_torch"),  # section 5.1's optimizer
    "AdamW (fused)": (lambda p, lr: torch.optim.AdamW(p, lr=lr, fused=True), "adamw_torch_fused"),
    "SGD + momentum": (lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.9), "sgd"),
    "Adafactor": (lambda p, lr: Adafactor(p, lr=lr, scale_parameter=False, relative_step=False), "adafactor"),
    "8-bit AdamW (bnb)": (lambda p, lr: bnb.optim.AdamW8bit(p, lr=lr), "adamw_bnb_8bit"),
    "paged 8-bit AdamW (bnb)": (lambda p, lr: bnb.optim.PagedAdamW8bit(p, lr=lr), "paged_adamw_8bit"),
}
# A check that can fail (on another transformers version): every Trainer name we print exists.
assert all(trainer_name in {o.value for o in OptimizerNames} for _, trainer_name in OPTIMIZERS.values())


def train_optimizer(name, steps=kw_steps, lr=kw_lr):
    """Train a fresh bert-large with one optimizer (autocast) for a few steps; state bytes and timings."""
    make = OPTIMIZERS[name][0]
    model = models.build("bert-large-uncased", head="sequence-classification", seed=0)
    allocated_model = torch.cuda.memory_allocated() if prof.on_gpu else 0
    optimizer = make(model.parameters(), lr)
    scaler = torch.amp.GradScaler(dev, enabled=AMP == torch.float16)  # fp16 (a T4) needs loss scaling

    def forward_backward(batch):
        with torch.autocast(dev, dtype=AMP):
            loss = model(**batch).loss
        scaler.scale(loss).backward()
        return loss

    def training_step(batch):
        loss = forward_backward(batch)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        return loss

    measure.reset_peak(dev)
    for batch in itertools.islice(data.batches(ds_kw, kw_batch, seed=0), steps):
        batch = {k: v.to(dev) for k, v in batch.items()}
        training_step(batch)
    n = models.n_params(model)
    row = {"optimizer": name, "state (bytes/param)": accounting.optimizer_state_bytes(optimizer) / n}
    if prof.on_gpu:
        row["state in torch's allocator (bytes/param)"] = (torch.cuda.memory_allocated() - allocated_model) / n
        row["peak allocated (GiB)"] = measure.allocator_mib()["peak_allocated_mib"] * MIB / GIB
    states = [t for st in accounting.inner_optimizer(optimizer).state.values() for t in st.values() if torch.is_tensor(t)]
    row["paged state tensors"] = sum(bool(getattr(t, "is_paged", False)) for t in states)
    reps = dict(warmup=prof.pick(tiny=1, full=3), repeat=prof.pick(tiny=3, full=10))  # tiny: CI's CPU run
    t_step = timing.time_it(lambda: training_step(batch), device=dev, busy=False, **reps)
    forward_backward(batch)  # gradients for the optimizer-only timing; each timed call reuses them
    t_opt = timing.time_it(optimizer.step, device=dev, **reps)
    optimizer.zero_grad(set_to_none=True)
    row |= {"optimizer.step (ms)": t_opt.wall.median * 1e3, "optimizer.step IQR (ms)": t_opt.wall.iqr * 1e3,
            "optimizer.step verdict": t_opt.verdict, "training step (ms)": t_step.wall.median * 1e3,
            "training step IQR (ms)": t_step.wall.iqr * 1e3, "Trainer optim=": OPTIMIZERS[name][1]}
    return row, t_opt, t_step


opt_rows, opt_timed, opt_step_t = [], {}, {}
for name in OPTIMIZERS:
    if name.startswith("paged") and not run_profile.cuda_or_skip("paged optimizers allocate CUDA unified memory"):
        continue
    row, opt_timed[name], opt_step_t[name] = train_optimizer(name)
    opt_rows.append(row)
    cleanup.free(globals())
optim_table = pd.DataFrame(opt_rows).set_index("optimizer")
optim_table

# %%
model = models.build("bert-large-uncased", head="sequence-classification", seed=0)
opt_batch = {k: v.to(dev) for k, v in next(iter(data.batches(ds_kw, kw_batch, seed=0))).items()}
with torch.autocast(dev, dtype=AMP):
    model(**opt_batch).loss.backward()  # gradients that every optimizer below steps on (each step reuses them)
reference = OPTIMIZERS["AdamW (fused)"][0](model.parameters(), kw_lr)
opt_cmp = {}
for name in opt_timed:
    if name == "AdamW (fused)":
        continue
    candidate = OPTIMIZERS[name][0](model.parameters(), kw_lr)
    opt_cmp[name] = timing.interleaved(reference.step, candidate.step, device=dev, names=("AdamW (fused)", name),
                                       warmup=2, profile_steps=1)  # the warm-up steps create each one's states
    cleanup.free(globals(), "candidate")
n_weight_tensors = sum(1 for _ in model.parameters())
cleanup.free(globals(), "model", "opt_batch", "reference")
# (no verdict column: the sentence below judges these steps against a 10% margin, not the ±3% of one step's changes)
pd.DataFrame({name: c.row() for name, c in opt_cmp.items()}).T.drop(columns="verdict")

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title optimizer.step() of each optimizer against fused AdamW's, interleaved
def optimizer_speed_text(cmps, n_tensors, margin=0.10):
    """optimizer.step() of each optimizer against fused AdamW's, interleaved.

    An optimizer is called faster or slower only when the whole 95% interval lies beyond ``margin`` (10%): the
    optimizers' steps differ by multiples, and a few percent between two of them depends on the host. What limits
    each is told by its GPU-busy fraction and, for the optimizers that launch at least one GPU operation per weight
    tensor (``n_tensors`` of them), its launches: a structural fact, where a regime word from a busy fraction
    between 50% and 70% would change from run to run.
    """
    ref = next(iter(cmps.values())).a
    parts, per_tensor = [], []
    for name, c in cmps.items():
        x = 1 / c.speedup  # its time over fused AdamW's
        if c.lo > 1 + margin or c.hi < 1 - margin:
            how = f"{x:.2f} times fused AdamW's time (95% interval {1 / c.hi:.2f}–{1 / c.lo:.2f})"
        elif 1 / c.hi >= 1 - margin and 1 / c.lo <= 1 + margin:
            how = f"within {margin:.0%} of fused AdamW's time ({x:.2f} times, 95% interval {1 / c.hi:.2f}–{1 / c.lo:.2f})"
        else:
            how = (f"{x:.2f} times fused AdamW's time (95% interval {1 / c.hi:.2f}–{1 / c.lo:.2f}, which this "
                   f"measurement does not place within or beyond {margin:.0%})")
        part = f"{name} {prose.ms(c.b.wall.median)}, {how}, GPU busy {c.b.gpu_busy:.0%}"
        launch = timing.us_per_launch(c.b)
        if c.b.kernels_per_call and c.b.kernels_per_call >= n_tensors and launch:
            per_tensor.append(name)
            part += f", {c.b.kernels_per_call:,} GPU operations at about {launch:.0f} µs of host time each"
        parts.append(part)
    text = (f"Time of `optimizer.step()` against fused AdamW ({prose.ms(ref.wall.median)}, GPU busy "
            f"{ref.gpu_busy:.0%}, {ref.kernels_per_call:,} GPU operations), interleaved on one model's gradients: "
            + "; ".join(parts) + ". ")
    if per_tensor:
        busy = [cmps[n].b.gpu_busy for n in per_tensor]
        share = f"{min(busy):.0%}" if f"{min(busy):.0%}" == f"{max(busy):.0%}" else f"between {min(busy):.0%} and {max(busy):.0%}"
        text += (f"{prose.listing(per_tensor)} issue at least one GPU operation (or a Python loop iteration) per "
                 f"weight tensor, {n_tensors:,} of them in bert-large"
                 + (f", and kept the GPU busy {share} of their step: their time is mostly the host's launches, so the "
                    "reader's CPU decides it as much as the GPU. " if max(busy) < timing.HOST_BOUND_BUSY else
                    "; on a slower CPU than this one their launches would set their time. "))
    return text


def repeat_text(t51, t54, half):
    """The same training step timed twice in one notebook (sections 5.1 and 5.4), as two separate blocks."""
    a, b = t51.wall, t54.wall
    gap = abs(b.median - a.median)
    return (f"AdamW (foreach) repeats section 5.1's {half} recipe, and its whole training step took "
            f"{b.median * 1e3:.1f} ms (IQR {b.iqr * 1e3:.1f}) here against {a.median * 1e3:.1f} ms "
            f"(IQR {a.iqr * 1e3:.1f}) there, where `time_it` called it *{t51.verdict}*: the same work, timed as two "
            f"separate blocks in one notebook, {gap / min(a.median, b.median):.0%} apart, "
            f"{gap / max(a.iqr, b.iqr, 1e-9):.1f} times the larger IQR. Ten consecutive steps show the spread "
            "within one block, not the drift between blocks; that is why every comparison in this book alternates "
            "its two sides in rounds. ")


ot = optim_table
bpp_txt = ", ".join(f"{ot.loc[n, 'state (bytes/param)']:.3g} bytes for {n}" for n in ot.index)
text = (f"The measured states per parameter: {bpp_txt}. The rules hold; the 8-bit optimizers sit a little above 2 "
        f"bytes because of their per-block scales and the fp32 states of the small tensors. ")
alloc_col = "state in torch's allocator (bytes/param)"
if "paged 8-bit AdamW (bnb)" in ot.index:
    paged = ot.loc["paged 8-bit AdamW (bnb)"]
    text += (f"The paged optimizer paged {int(paged['paged state tensors'])} of its state tensors (those of weights "
             f"with at least 100,000 values), and so only {paged[alloc_col]:.2f} bytes per parameter of its states "
             f"are in PyTorch's allocator, against {ot.loc['8-bit AdamW (bnb)', alloc_col]:.2f} for the plain 8-bit "
             f"AdamW: `torch.cuda.memory_allocated` does not see unified memory, which the CUDA driver manages outside "
             f"PyTorch's allocator. Measuring a paged optimizer with the allocator's numbers alone under-reports it. ")
if prof.on_gpu:
    text += optimizer_speed_text(opt_cmp, n_weight_tensors)
    text += repeat_text(runs[HALF]["t_small"], opt_step_t["AdamW (foreach)"], HALF)
else:
    text += "Optimizer step times are skipped on CPU: they need a GPU to mean anything. "
display(Markdown(text))

# %% [markdown]
# **Do they learn alike?** As for the precisions, one run per optimizer could not say. Each optimizer trains section
# 5.1's small model once for each of the same three seeds, with `train_seed`: the same weights, batches and dropout
# masks per seed, autocast in bf16 (fp16 with its scaler on a GPU without bf16), and section 5.1's learning rate and
# warm-up for all of them. Adafactor runs without its relative step size, as the Trainer sets it up, so it takes the
# same rate. SGD with momentum is left out: its steps are not normalised by the gradients' size, so it needs a
# learning rate tuned to each model, and at an untuned one a comparison would say nothing about SGD. AdamW (foreach)
# is section 5.1's optimizer, and with the same autocast its runs repeat section 5.1's 16-bit runs exactly: the same
# seeds, settings and lines of code. They show what a repeat of identical settings gives.

# %%
LEARNERS = [n for n in opt_timed if n != "SGD + momentum"]
opt_conv = {n: [train_seed(s, amp=AMP, make_optimizer=OPTIMIZERS[n][0]) for s in SEEDS] for n in LEARNERS}
opt_conv_table = seed_table(opt_conv)
opt_conv_table

# %%
all_learned = all(outcome(r["losses"]) == "learned" for seeded in opt_conv.values() for r in seeded)
fig = plot_seeds(opt_conv, f"small bert, keyword task, {AMP_NAME} autocast, {len(SEEDS)} seeds per optimizer: "
                 + ("every optimizer learned in every seed" if all_learned else "loss by optimizer and seed"),
                 ncols=3)

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Runs repeated with identical settings and seeds
def repeat_runs_text(first, again, label):
    """Runs repeated with identical settings and seeds: how far apart their losses are."""
    gaps = [max(abs(x - y) for x, y in zip(a["losses"], b["losses"])) for a, b in zip(first, again)]
    if max(gaps) == 0:
        return (f"AdamW (foreach) repeated {label} with the same seeds and settings, and every loss of every run came "
                f"out identical to the bit: with the seed fixed, nothing random is left. ")
    ends_a = [outcome(r["losses"]) for r in first]
    ends_b = [outcome(r["losses"]) for r in again]
    return (f"AdamW (foreach) repeated {label} with the same seeds and settings; the losses of the two runs of one "
            f"seed differ by up to {max(gaps):.2g} nats, although nothing random is left: some GPU kernels add "
            f"with atomic operations, in whatever order their threads finish (PyTorch's notes on reproducibility "
            f"list them), and a training run carries those last-bit differences forward. The outcomes "
            + ("were the same for every seed. " if ends_a == ends_b else
               f"differed ({', '.join(ends_a)} there; {', '.join(ends_b)} here). "))


text = seeds_text(opt_conv, "AdamW (foreach)", conv_steps, "optimizer")
if HALF in conv and AMP == RECIPES[HALF]:
    text += repeat_runs_text(conv[HALF], opt_conv["AdamW (foreach)"], f"section 5.1's {HALF} runs")
eight = [n for n in ("8-bit AdamW (bnb)", "paged 8-bit AdamW (bnb)") if n in opt_conv]
if eight and all(outcome(r["losses"]) == "learned" for n in eight for r in opt_conv[n]):
    text += (f"{prose.listing(eight)} learned in every seed with a quarter of AdamW's optimizer state (the table "
             f"above), as Dettmers et al. (2022) report for 8-bit states on far longer runs. ")
display(Markdown(text))

# %% [markdown]
# ## 5.5 Tiles and tensor cores
#
# A matrix product $C = AB$ with $A$ of size $m \times k$ and $B$ of size $k \times n$ does $2mkn$ floating-point
# operations (a multiply and an add per term) on $mk + kn$ inputs. Computed naively, element by element, every
# output reads a whole row of $A$ and a whole column of $B$ from memory: $2mkn$ reads, two per multiply-add, and
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
# needs that kind of reuse: the H100 and H200 both do about 1,000 dense bf16 TFLOP/s (their datasheets) but read their
# memory at 3.35 and 4.8 TB/s, so a kernel that does fewer than about 200 to 300 FLOPs per byte leaves the tensor cores
# waiting. cuBLAS tiles at
# several levels (the L2 cache, each multiprocessor's shared memory, its registers), and tensor cores compute small
# fixed-size tile products in one instruction. When a matrix dimension is not a multiple of the tile
# size, the last tiles are partly empty, and when it is not a multiple of 8 (16 bytes of bf16), the rows are not
# aligned for the wide loads the fastest kernels use. NVIDIA's guide
# ([NVIDIA, matrix multiplication performance guide](https://gpu-efficient-training.github.io/book/book/references.html)) therefore asks for dimensions that are
# multiples of 16 bytes at least (8 bf16 or fp16 values, 4 TF32 values), and larger multiples (64 bf16 values
# on the A100, more for 8-bit types) to be safe.
#
# We measure `torch.matmul` of square $n \times n$ matrices, in TFLOP/s ($2n^3$ divided by the median time), in
# fp32, TF32 and bf16 (on a GPU without TF32 and bf16 tensor cores: fp32 and fp16): first over a wide range of $n$,
# then for every $n$ from 4032 to 4160. Each timing is `time_it`'s median of ten repeats of a few back-to-back
# products, after warm-up.

# %%
MODES = {"fp32": torch.float32}
if run_profile.cuda_or_skip("TF32 and 16-bit tensor-core matmuls need an NVIDIA GPU; the CPU sweep is fp32 at small sizes"):
    if cap.tf32:
        MODES["tf32"] = torch.float32
    else:
        print(f"skipped on {cap.name}: TF32 needs compute capability 8.0")
    MODES[AMP_NAME] = AMP
RATE_GUESS = {"fp32": 50e12, "tf32": 300e12, "bf16": 700e12, "fp16": 700e12}  # FLOP/s, only to size the timed calls


def matmul_tflops(n, mode):
    """Measured TFLOP/s of an n x n by n x n product in one mode (median of 10 timed repeats)."""
    torch.backends.cuda.matmul.allow_tf32 = mode == "tf32"
    x = torch.randn(n, n, device=dev, dtype=MODES[mode])
    y = torch.randn(n, n, device=dev, dtype=MODES[mode])
    out = torch.empty(n, n, device=dev, dtype=MODES[mode])
    reps = min(200, max(1, round(RATE_GUESS[mode] * 2e-3 / (2 * n**3)))) if prof.on_gpu else 1  # ~2 ms per call

    def products():
        for _ in range(reps):
            torch.matmul(x, y, out=out)

    t = timing.time_it(products, device=dev, warmup=1, repeat=10, busy=False)  # a GPU-bound call: no profile needed
    return 2 * n**3 * reps / t.wall.median / 1e12


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
        peaks[m] = gpus.peak_tflops(gpu_name, m)
    except ValueError:  # a GPU or dtype that is not in the table
        peaks[m] = float("nan")
n_mid = fine_sizes[len(fine_sizes) // 2]  # 4096 on the GPU
f = fine.set_index("n")
relative = f / f.loc[n_mid]
top = list(MODES)[-1]  # the fastest mode: bf16 (fp16 on a T4; fp32 on a CPU)
not64 = f.index[f.index % 64 != 0]
# per mode: median throughput of the odd sizes, and of the multiples of 8 that are not of 64, over that of 64's
share = {(m, k): f.loc[not64, m][sel].median() / f.loc[f.index % 64 == 0, m].median()
         for m in MODES for k, sel in (("odd", not64 % 2 == 1), ("mult8", not64 % 8 == 0))}
fig, (ax_w, ax_f) = plt.subplots(1, 2, figsize=(11, 4))
for (m, style), color in zip([(m, s) for m, s in zip(MODES, ["o-", "s-", "^-"])], ["#4C72B0", "#DD8452", "#55A868"]):
    ax_w.plot(wide.n, wide[m], style, color=color, label=f"{m}, measured")
    ax_f.plot(relative.index, relative[m], "-", color=color, lw=1, label=m)
    if m in peaks:
        ax_w.axhline(peaks[m], color=color, linestyle=":", label=f"{m}, datasheet peak")
mult8 = relative[relative.index % 8 == 0]
for m in MODES:
    ax_f.plot(mult8.index, mult8[m], "k.", ms=6)
ax_w.set_xscale("log", base=2)
ax_w.set_yscale("log")
ax_w.set_xlabel("matrix size n (n x n by n x n)")
ax_w.set_ylabel("TFLOP/s (log scale)")
ax_w.set_title("Large matrices approach the ceiling")
ax_w.legend(fontsize=8, loc="upper left", bbox_to_anchor=(0.0, -0.18), ncol=2)
ax_f.set_xlabel("matrix size n (black dots: multiples of 8)")
ax_f.set_ylabel(f"throughput relative to n = {n_mid}")
ax_f.set_title(f"Near n = {n_mid}: " + ("misaligned sizes run slower" if share[(top, "odd")] < 0.8 else "throughput by size"))
ax_f.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
fig.suptitle(f"torch.matmul throughput on {gpu_name or 'this CPU'}")
fig.tight_layout()

# %%
pick = [n for n in (n_mid + d for d in (-8, -1, 0, 1, 8)) if n in f.index]
shapes = f.loc[pick]
shapes.index = [f"{n} (n % 64 = {n % 64}, n % 8 = {n % 8})" for n in pick]
shapes

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (5.5 Tiles and tensor cores)
if prof.on_gpu:
    lines = []
    for m in MODES:
        frac = wide[m].max() / peaks[m]
        lines.append(f"{wide[m].max():,.1f} TFLOP/s in {m} against a datasheet peak of {peaks[m]:,.1f} ({frac:.0%})"
                     if pd.notna(peaks[m]) else f"{wide[m].max():,.1f} TFLOP/s in {m} (no datasheet peak in the table)")
    display(Markdown(
        "The wide sweep shows the ramp: small matrices leave most of the GPU idle, and throughput climbs until the "
        "matrices fill every streaming multiprocessor. The best measured throughput was " + "; ".join(lines) + ". "
        "The datasheet numbers assume the boost clock and no memory traffic; a real GEMM's ceiling is lower, and this "
        "measured ceiling, not the datasheet, is the honest denominator for a utilisation figure (chapter 8 uses both)."
    ))
    m8, odd = share[(top, "mult8")], share[(top, "odd")]
    text = (f"The fine sweep is the lesson of this section. In {top}, n = {n_mid} ran at {f.loc[n_mid, top]:.0f} "
            f"TFLOP/s, n = {n_mid - 1} at {f.loc[n_mid - 1, top]:.0f} and n = {n_mid + 1} at "
            f"{f.loc[n_mid + 1, top]:.0f}; n = {n_mid - 8}, a multiple of 8 but not of 64, at "
            f"{f.loc[n_mid - 8, top]:.0f}. Over the whole range, odd sizes reached {odd:.0%} of the median throughput "
            f"of the multiples of 64, and multiples of 8 that are not multiples of 64 reached {m8:.0%}. ")
    if m8 >= 0.9 and odd < 0.8:
        text += (f"So in {top} the rule the data support is alignment: in this square sweep a multiple of 8 "
                 f"recovered {m8:.0%} of a multiple of 64's median throughput. ")
    elif m8 < 0.9:
        text += f"In {top} even multiples of 8 fall clearly short of multiples of 64 on this GPU, so padding further pays. "
    if "tf32" in MODES:
        t8, t_odd = share[("tf32", "mult8")], share[("tf32", "odd")]
        text += (f"In TF32, odd sizes reached {t_odd:.0%} of the multiples of 64 ({f.loc[n_mid - 1, 'tf32']:.0f} "
                 f"TFLOP/s at n = {n_mid - 1} against {f.loc[n_mid, 'tf32']:.0f} at {n_mid}), and multiples of 8 that "
                 f"are not multiples of 64 reached {t8:.0%} (n = {n_mid + 8}: {f.loc[n_mid + 8, 'tf32']:.0f} TFLOP/s)"
                 + (": for TF32, padding to a multiple of 64 pays. " if t8 < 0.9 else ". "))
    text += (f"Plain fp32, which does not use tensor cores, cares less ({f.loc[n_mid, 'fp32']:.1f} against "
             f"{f.loc[n_mid - 1, 'fp32']:.1f}).")
    display(Markdown(text))
    if cmp_big is not None:  # back to section 5.1's realistic step: its FLOP rate against these ceilings
        r0 = runs["fp32"]
        step_flop = (flops.flops_per_token(r0["n_matmul"], r0["n_layers"], r0["hidden"], big_seq)
                     * big_batch * big_seq)
        got = {r: step_flop / runs[r]["t_big"].wall.median / 1e12 for r in runs if r in wide.columns}
        parts = [f"{got[r]:.0f} TFLOP/s in {r} ({got[r] / wide[r].max():.0%} of its measured ceiling)" for r in got]
        cast_big = speed.loc[(f"{big_batch} x {big_seq}", HALF), "copy and cast kernels (ms)"]
        display(Markdown(
            f"Back to section 5.1's realistic step ({big_batch} x {big_seq} tokens, {step_flop / 1e12:.1f} TFLOP by "
            f"6*N* + 12*Lds* FLOPs per token, the [glossary's FLOPs entry](https://gpu-efficient-training.github.io/book/book/glossary.html#flops)): " + "; ".join(parts) + f". A step made only of matrix products "
            f"running at these ceilings would gain {wide[HALF].max() / wide['fp32'].max():.1f} times from {HALF}, the "
            f"ratio of the ceilings; the step gained {cmp_big[HALF].speedup:.1f} times. Three things keep it "
            f"lower: the step's other GPU work (normalisations, activations, dropout, the casts, the optimizer), "
            f"which tensor cores do not speed up (the copy and cast kernels alone ran for {cast_big:.1f} ms of the "
            f"{HALF} step's {runs[HALF]['t_big'].kernel_s * 1e3:.0f} ms of kernel time), matrix products whose "
            f"shapes run below the square-matrix ceiling, attention's among them (this profile does not separate "
            f"those two), and the wall time these rates divide by, in which the GPU was not always busy: the {HALF} "
            f"step kept it busy {runs[HALF]['t_big'].gpu_busy:.0%} of the time "
            f"({runs[HALF]['t_big'].kernel_s * 1e3:.0f} ms of kernel time in a "
            f"{runs[HALF]['t_big'].wall.median * 1e3:.0f} ms step), fp32's {runs['fp32']['t_big'].gpu_busy:.0%}."
        ))
else:
    print("skipped on CPU: tensor-core alignment effects need a GPU (the CPU sweep is fp32 only)")

# %% [markdown]
# **The practical rule: pad to a multiple of 8 at least.** In a transformer the dimensions that are free to choose
# are the hidden size (always a nice number in published models) and the vocabulary, which comes from a tokenizer:
# bert-large has 30,522 tokens. The LM head, a `hidden x vocab` matrix product over every token of the batch, is
# one of the largest GEMMs of a language model. We time its forward and backward pass in 16 bits for a batch of
# tokens at several vocabulary sizes: bert's 30,522, the same padded to 30,528 (the next multiple of 64) and to
# 30,536 (a multiple of 8 that is not one of 64), polyglot-ko's 30,080 (a multiple of 128, chosen by its authors)
# and neighbours of each.

# %%
def lm_head_pass(vocab, hidden, tokens, dtype):
    """A callable: forward and backward of an LM head (hidden -> vocab) over `tokens` tokens."""
    head = torch.nn.Linear(hidden, vocab, bias=False, device=dev, dtype=dtype)
    x = torch.randn(tokens, hidden, device=dev, dtype=dtype, requires_grad=True)
    grad_out = torch.randn(tokens, vocab, device=dev, dtype=dtype)

    def fwd_bwd():
        head(x).backward(grad_out)
        head.weight.grad = x.grad = None

    return fwd_bwd


def lm_head_tflops(vocab, hidden, tokens, dtype):
    """Forward + backward TFLOP/s of an LM head (hidden -> vocab) over `tokens` tokens (median of 10 repeats)."""
    t = timing.time_it(lm_head_pass(vocab, hidden, tokens, dtype), device=dev, warmup=2, repeat=10, busy=False)
    return {"vocab": vocab, "vocab % 64": vocab % 64, "vocab % 8": vocab % 8, "time (ms)": t.wall.median * 1e3,
            "IQR (ms)": t.wall.iqr * 1e3, "TFLOP/s": 3 * 2 * tokens * hidden * vocab / t.wall.median / 1e12}


head_hidden, head_tokens = prof.pick(tiny=128, full=2048), prof.pick(tiny=64, full=8192)
head_dtype = AMP if prof.on_gpu else torch.float32
vocabs = [30079, 30080, 30521, 30522, 30528, 30536, 32000]
lm_head = pd.DataFrame([lm_head_tflops(v, head_hidden, head_tokens, head_dtype) for v in vocabs]).set_index("vocab")
head_pass = {v: lm_head_pass(v, head_hidden, head_tokens, head_dtype) for v in (30522, 30528, 30536)}
pad_cmp = {(a, b): timing.interleaved(head_pass[a], head_pass[b], device=dev, names=(f"vocab {a:,}", f"vocab {b:,}"),
                                      loop=prof.pick(tiny=1, full=3), busy=False)  # full: 3 passes back to back
           for a, b in ((30522, 30528), (30522, 30536), (30536, 30528))}
cleanup.free(globals(), "head_pass")
lm_head

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title bert's vocabulary against its padded sizes (interleaved)
def padding_text(lh, cmps, tokens, hidden, dtype_name, margin=0.10):
    """bert's vocabulary against its padded sizes (interleaved); 64 against 8 is called only beyond ``margin``."""
    c64, c8, c8_64 = cmps[(30522, 30528)], cmps[(30522, 30536)], cmps[(30536, 30528)]
    text = (f"Over {tokens:,} tokens with hidden size {hidden} in {dtype_name}, bert's vocabulary of 30,522 took "
            f"{lh.loc[30522, 'time (ms)']:.2f} ms ({lh.loc[30522, 'TFLOP/s']:.0f} TFLOP/s). In alternating rounds, "
            f"padded with six unused rows to 30,528 it ran at {c64.phrase(what='than 30,522')}, for 0.02% more "
            f"parameters; padded to 30,536, a multiple of 8 only, at {c8.phrase(what='than 30,522')}. ")
    if c8_64.lo > 1 + margin:
        text += (f"Here the multiple of 64 is {c8_64.speedup:.2f} times as fast as the multiple of 8 (95% interval "
                 f"{c8_64.lo:.2f}–{c8_64.hi:.2f}). ")
        advice = " (64, the common choice, is the one to use):"
    elif c8_64.lo >= 1 / (1 + margin) and c8_64.hi <= 1 + margin:
        text += (f"The multiple of 64 against the multiple of 8: {c8_64.speedup:.2f}× (95% interval "
                 f"{c8_64.lo:.2f}–{c8_64.hi:.2f}), within {margin:.0%} of each other. ")
        advice = " (64 is the common choice; here a multiple of 8 came within a few percent of it):"
    else:
        text += (f"The multiple of 64 against the multiple of 8: {c8_64.speedup:.2f}× (95% interval "
                 f"{c8_64.lo:.2f}–{c8_64.hi:.2f}), which this measurement does not place within or beyond "
                 f"{margin:.0%}. ")
        advice = " (64 is the common choice):"
    x32k = lh.loc[32000, "TFLOP/s"] / lh.loc[30528, "TFLOP/s"]
    if x32k < 0.9:
        text += (f"Alignment is not the only effect of the shape: 32,000, a multiple of 64 and of 128, ran at "
                 f"{lh.loc[32000, 'TFLOP/s']:.0f} TFLOP/s against {lh.loc[30528, 'TFLOP/s']:.0f} for 30,528 (NVIDIA's "
                 f"guide describes others, such as wave quantization: the last round of tiles leaves part of the GPU "
                 f"idle); this run does not separate them. ")
    return text + "transformers does the padding in one call; the extra rows are tokens the tokenizer never produces" + advice


if prof.on_gpu:
    display(Markdown(padding_text(lm_head, pad_cmp, head_tokens, head_hidden, AMP_NAME)))
else:
    print("skipped on CPU: the padding speed-up needs tensor cores")

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
# The Hugging Face guide's table of single-GPU techniques lists two more that are quick to try.
#
# **`torch_empty_cache_steps`** makes the Trainer call `torch.cuda.empty_cache()` every $N$ steps, after the
# forward pass. PyTorch's [caching allocator](https://gpu-efficient-training.github.io/book/book/glossary.html#caching-allocator) keeps freed blocks for reuse (the gap between *reserved* and
# *allocated*, chapter 1); emptying the cache returns them to the driver, which lowers what [NVML](https://gpu-efficient-training.github.io/book/book/glossary.html#nvml) sees and can undo
# fragmentation, at the price of fresh `cudaMalloc` calls afterwards. The Trainer's documentation promises a lower
# peak "at a cost of about 10% slower performance". We train bert-large with the guide's Trainer setup (fp32, batch
# 4, 512 tokens) with and without it, timing each step with a callback (the device synchronised at both ends, 30
# steps, the first three left out) and reading the allocator's peaks. Those two runs are two separate blocks of
# steps; the comparison of their speed comes from `timing.interleaved`, with the same step written out (the
# `empty_cache()` call where the Trainer makes it, after the forward pass) and the two versions in alternating rounds.
# After the forward pass the activations are still alive and hold most of the step's blocks, so less is handed back
# than after a whole step. Chapter 8 (section 8.5) empties the cache after the whole step instead, when every
# activation block is free and the next step must `cudaMalloc` all of them again, and measures that cost.

# %%
from transformers import Trainer, TrainerCallback, TrainingArguments


class StepClock(TrainerCallback):
    """Step times, with the device synchronised at both ends of every step."""

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
ec_rows, ec_times = [], []
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
    steps_ms = 1e3 * pd.Series(clock.times[3:])
    ec_times.append(tuple(clock.times[3:]))
    row = {"torch_empty_cache_steps": str(every), "step (ms)": steps_ms.median(),
           "step IQR (ms)": steps_ms.quantile(0.75) - steps_ms.quantile(0.25), "steps timed": len(steps_ms)}
    if prof.on_gpu:
        row["peak allocated (GiB)"] = torch.cuda.max_memory_allocated() / GIB
        row["peak reserved (GiB)"] = torch.cuda.max_memory_reserved() / GIB
    ec_rows.append(row)
    del model
    cleanup.free(globals())
empty_cache = pd.DataFrame(ec_rows).set_index("torch_empty_cache_steps")
model = models.build("bert-large-uncased", head="sequence-classification", seed=0)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
ec_batch = {k: v.to(dev) for k, v in ds_dummy[:4].items()}


def ec_step(empty):
    def step():
        loss = model(**ec_batch).loss
        if empty:
            torch.cuda.empty_cache()  # where the Trainer calls it: after the forward pass (a no-op without CUDA)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


ec_cmp = timing.interleaved(ec_step(False), ec_step(True), device=dev, names=("as is", "empty_cache() every step"),
                            rounds=prof.pick(tiny=10, full=15), warmup=2, profile_steps=1)
cleanup.free(globals(), "model", "optimizer", "ec_batch")
empty_cache

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title The cost of empty_cache() after each forward pass, interleaved, against the documented 10%
def empty_cache_cost(c, documented=0.10):
    """The cost of empty_cache() after each forward pass, interleaved, against the documented 10%."""
    cost, lo, hi = 1 / c.speedup - 1, 1 / c.hi - 1, 1 / c.lo - 1
    text = (f"Emptying the cache after every forward pass changed the step time by {cost:+.1%} (95% interval "
            f"{lo:+.1%} to {hi:+.1%}, {c.rounds} interleaved rounds of bert-large's step at batch 4, "
            f"{prose.ms(c.a.wall.median)} as is); the Trainer's documentation puts the cost at about {documented:.0%}. ")
    if hi < documented:
        text += f"Here it costs less than that: the whole interval lies below {documented:.0%}. "
    elif lo > documented:
        text += f"Here it costs more than that: the whole interval lies above {documented:.0%}. "
    else:
        text += f"That is consistent with the documentation's {documented:.0%}. "
    return text


if prof.on_gpu:
    ec = empty_cache
    res0, res1 = ec["peak reserved (GiB)"].iloc[0], ec["peak reserved (GiB)"].iloc[1]
    text = empty_cache_cost(ec_cmp)
    text += ("The lower peak it promises did not appear here: peak *reserved* memory was "
             f"{res0:.2f} GiB without it and {res1:.2f} GiB with it. Every batch of this run has the same shape, so "
             f"each step can reuse the cached blocks of the step before, and there is little slack to give back. "
             if res0 - res1 < 0.05 else
             f"Peak *reserved* memory fell from {res0:.2f} to {res1:.2f} GiB. ")
    text += (f"The peak *allocated* memory, the tensors themselves, was {ec['peak allocated (GiB)'].iloc[0]:.2f} and "
             f"{ec['peak allocated (GiB)'].iloc[1]:.2f} GiB: emptying the cache cannot shrink what a step needs, only "
             f"the allocator's slack around it. When the reserved memory keeps growing because variable sequence lengths "
             f"fragment the cache, chapter 8's `expandable_segments` is the tool; `empty_cache` helps when another "
             f"process must share the GPU.")
    display(Markdown(text))
else:
    print("skipped on CPU: the allocator's peaks and the cost of cudaMalloc need a GPU")

# %% [markdown]
# **Pinned memory.** A batch travels from the CPU's memory to the GPU by DMA, which needs page-locked ("pinned")
# host memory. From ordinary pageable memory, the driver first copies the data into a pinned staging buffer, and the
# copy cannot overlap with computation. `DataLoader(pin_memory=True)` (the Trainer's `dataloader_pin_memory`, on by
# default) allocates batches in pinned memory; `tensor.to("cuda", non_blocking=True)` then returns at once and
# overlaps the copy with GPU work. The bandwidth of one 256 MiB copy (median of ten):

# %%
if run_profile.cuda_or_skip("host-to-GPU copies need a GPU"):
    host = torch.randn(64 * 2**20)  # 256 MiB of fp32
    pinned = host.pin_memory()
    copy_gib_s = {}
    for name, src, non_blocking in (("pageable", host, False), ("pinned", pinned, True)):
        t = timing.time_it(lambda src=src, nb=non_blocking: src.to(dev, non_blocking=nb), device=dev, warmup=2,
                           repeat=10, busy=False)
        copy_gib_s[name] = host.numel() * 4 / GIB / t.wall.median
    cleanup.free(globals(), "host", "pinned")
    display(pd.Series(copy_gib_s, name="host-to-GPU copy (GiB/s)"))

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (5.6 Two more knobs)
if prof.on_gpu:
    display(Markdown(
        f"Pinned memory copied at {copy_gib_s['pinned']:.1f} GiB/s, pageable at {copy_gib_s['pageable']:.1f} GiB/s. "
        f"A batch of token ids is tiny (4 x 512 int64 values are 16 KiB), so for the models of this book the copy is "
        f"never the bottleneck; the preparation of the data can be. `dataloader_num_workers` lets worker processes "
        f"prepare the next batches while the GPU computes."
    ))
else:
    print("skipped on CPU: copy bandwidths need a GPU")

# %% [markdown]
# ## Summary
#
# The closing tables: the precisions on bert-large (the step at the training batch and, where it ran, at the
# realistic size), and the optimizers.

# %%
closing = mp[["step (ms)", "samples/s", "peak allocated (GiB)", "saved for backward (GiB)"]].copy()
closing["small model: seeds learned"] = conv_table["seeds learned"]
closing = closing.rename(columns={"step (ms)": f"step, {kw_batch} x {kw_seq} (ms)"})
if cmp_big is not None:
    closing.insert(1, f"step, {big_batch} x {big_seq} (ms)", [runs[r]["t_big"].wall.median * 1e3 for r in closing.index])
display(closing)
optim_table[[c for c in optim_table.columns if c in ("state (bytes/param)", "optimizer.step (ms)", "peak allocated (GiB)", "Trainer optim=")]]

# %% [markdown]
# - Autocast runs matrix products in 16 bits, weight gradients included, and keeps weights, gradients and
#   optimizer states in fp32: 16 persistent bytes per parameter in every recipe. The 18-byte rule adds the 16-bit
#   weight copies, which live only from the forward pass to the backward pass.
# - A small step can be [host-bound](https://gpu-efficient-training.github.io/book/book/glossary.html#host-bound): its time is then the CPU's time to issue kernels, and autocast's extra
#   operators can make it slower than fp32, whose slower matrix products may still keep the GPU busy. Mixed
#   precision and TF32 pay off where the matrix products keep the GPU busy; section 5.1 measured both sizes.
# - fp16 needs loss scaling: without it, the gradients below $2^{-25}$ round to zero. bf16 has fp32's range and
#   needs none, but needs a GPU of compute capability 8.0 or newer.
# - Mixed precision does not always save memory: autocast's activations are not half of fp32's (layer-norm inputs,
#   the residual stream and the loss stay fp32), and when gradients are alive during the forward pass (gradient
#   accumulation) the weight copies can cost more than the smaller activations save.
# - Optimizer states per parameter: AdamW 8 bytes, SGD with momentum 4, Adafactor almost none, 8-bit AdamW about
#   2; a paged optimizer's large states are outside PyTorch's allocator.
# - One loss curve per setting cannot rank precisions or optimizers: two runs of one setting differ too. Seed the
#   initial weights, the batch order and the dropout masks, train every setting over several seeds, and call a
#   difference only when it holds across them (sections 5.1 and 5.4 do this on a small model).
# - Tensor cores want aligned dimensions: odd sizes lose most of the speed, multiples of 8 recover most of it, and
#   multiples of 64 can still be faster, by a few percent or by much more depending on the dtype and the shape
#   (section 5.5 has this GPU's numbers); padding a vocabulary is one call.

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (Summary)
if prof.on_gpu:
    parts = [f"{HALF} autocast ran at {cmp_small[HALF].speedup:.2f}× fp32's speed at {kw_batch * kw_seq:,} tokens "
             f"per step (*{cmp_small[HALF].b.verdict}*: the host's number)"]
    if cmp_big is not None:
        parts.append(f"at {cmp_big[HALF].speedup:.1f}× at {big_batch * big_seq:,} tokens (95% interval "
                     f"{cmp_big[HALF].lo:.1f}–{cmp_big[HALF].hi:.1f}×, *{cmp_big[HALF].b.verdict}*)")
    display(Markdown(f"In this run, {' and '.join(parts)}; without loss scaling, {scaling.iloc[0, 0]:.3f}% of "
                     f"bert-large's gradients vanished."))
else:
    print("skipped on CPU: the speed-ups need a GPU")

# %% [markdown]
# ## Use it in your own script
#
# Mixed precision, TF32 and a fused optimizer in a plain training step; bf16 where the GPU has it (compute
# capability 8.0), fp16 with a loss scaler elsewhere.
#
# ```python
# import torch
#
# if hasattr(torch.backends.cuda.matmul, "fp32_precision"):  # torch >= 2.9: the new switch
#     torch.backends.cuda.matmul.fp32_precision = "tf32"     # fp32 matrix products on tensor cores (cc >= 8.0)
# else:
#     torch.backends.cuda.matmul.allow_tf32 = True
# dtype = torch.bfloat16 if torch.cuda.get_device_capability() >= (8, 0) else torch.float16
# scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)
# optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5, fused=True)
# with torch.autocast("cuda", dtype=dtype):
#     loss = model(**batch).loss
# scaler.scale(loss).backward()
# scaler.step(optimizer)
# scaler.update()
# optimizer.zero_grad(set_to_none=True)
# # shapes: tokenizer(..., pad_to_multiple_of=8); model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=64)
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
# 2. In section 5.1's `train_seed`, create the scaler with `torch.amp.GradScaler(dev, init_scale=1.0, enabled=...)`,
#    and then with `enabled=False`, and train the fp16 recipe for the three seeds. How many steps are skipped, and how
#    do the runs compare with the fp16 rows of the table?
#
#    <details><summary>Hint</summary>
#
#    The scaler only skips a step when it finds inf or NaN gradients, and it grows the scale by 2 only after 2,000 clean steps.
#
#    </details>
#
#    <details><summary>Answer</summary>
#
#    No step is skipped: at scale 1 nothing overflows, and the scale never grows (that takes 2,000 clean steps), so the gradients that round to zero in fp16 are lost, exactly as with `enabled=False`: both runs compute the same thing. Section 5.2 measured that share for bert-large, well under 1% of the gradients. Compare each seed's first crossing of 0.1 with the fp16 row of section 5.1's table, and call a difference only if it holds across the three seeds, as the section does; a difference in one seed alone is the seeds' spread, not harm from the lost gradients.
#
#    </details>
#
# 3. Change `head_hidden` in section 5.5 from 2048 to 2047 and to 2056 (a multiple of 8, not of 64). Which matters
#    more for the LM head, the hidden size or the vocabulary?
#
#    <details><summary>Hint</summary>
#
#    The LM head multiplies (tokens × hidden) by (hidden × vocabulary): the hidden size is the reduction dimension, the vocabulary an output dimension.
#
#    </details>
#
#    <details><summary>Answer</summary>
#
#    Both matter: 2047 is odd, so every row of x and of the weight is misaligned, and you should expect a slowdown like the odd vocabularies of section 5.5's table (30,079 and 30,521), several times slower than the aligned sizes; 2056, a multiple of 8, should run close to 2048's speed, like the multiple-of-8 vocabulary 30,536.
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
# - [Micikevicius et al. (2018)](https://gpu-efficient-training.github.io/book/book/references.html): mixed-precision training, fp32 master weights and loss scaling.
# - [Kalamkar et al. (2019)](https://gpu-efficient-training.github.io/book/book/references.html): bf16 for training.
# - [Dettmers et al. (2022), 8-bit optimizers](https://gpu-efficient-training.github.io/book/book/references.html): 8-bit optimizers with block-wise quantization.
# - [Shazeer and Stern (2018)](https://gpu-efficient-training.github.io/book/book/references.html): Adafactor's factored second moments.
# - [NVIDIA](https://gpu-efficient-training.github.io/book/book/references.html), *Matrix Multiplication Background User's Guide*: tiles, tensor cores and dimension rules for GEMMs.
# - [Hugging Face](https://gpu-efficient-training.github.io/book/book/references.html), *Model training anatomy* and *Efficient training on a single GPU*: the 16/18-byte rules, the
#   optimizer rules and the table of single-GPU techniques this chapter follows.
#
# All the works the book cites are on the [references page](https://gpu-efficient-training.github.io/book/book/references.html).

# %% [markdown]
# Every experiment freed what it made. cuBLAS keeps a workspace for each handle and stream on which it ran a matrix
# product (chapter 8); we release them, and check that the chapter ends where it began:

# %%
freed = cleanup.free(globals(), "tiny_input", "batch")
if prof.on_gpu:  # cleanup.back_at_baseline: collect, release cuBLAS's workspaces, compare; LeakError if not back
    display(pd.Series(cleanup.back_at_baseline(baseline_mib)).to_frame("value"))
else:
    print("skipped on CPU: no GPU memory to check")
