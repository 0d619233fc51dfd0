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
# # 6. LoRA and QLoRA
#
# Full fine-tuning of the 1.3-billion-parameter GPT-NeoX of chapter 1 with fp32 AdamW keeps 16 bytes per parameter
# of model states: about 20 GiB before a single activation, more than a 15 GB T4 holds. Low-rank adaptation (LoRA,
# {cite:t}`hu2022lora`) freezes the model and trains a few million new parameters beside it; QLoRA
# ({cite:t}`dettmers2023qlora`) also stores the frozen model in 4 bits. This chapter writes a LoRA layer by hand,
# checks it against the `peft` library, and measures what the two methods save, what they cost, and whether the
# model still learns.
#
# **What you will learn**
#
# - what a LoRA layer computes, and why the adapted model starts out identical to the base model;
# - how many parameters LoRA trains: $r\,(d_\text{in} + d_\text{out})$ per adapted layer, checked;
# - how `peft`'s `LoraConfig`, `merge_and_unload` and adapter checkpoints relate to the hand-written layer;
# - the peak memory and step time of full fine-tuning, LoRA and QLoRA on the 1.3B model, as a breakdown, and
#   which of them fit a T4;
# - what the LoRA rank costs, and whether LoRA and QLoRA learn as well as full fine-tuning on a learnable task;
# - the headline numbers of both papers, recomputed from byte counts.
#
# **Prerequisites:** [chapter 1](01_memory_anatomy.ipynb) (memory components) and
# [chapter 5](05_mixed_precision_optimizers.ipynb) (mixed precision, 8-bit and paged optimizers). Chapter 2 explains
# block-wise quantization and the NF4 format that QLoRA uses. On a CPU this notebook runs a tiny GPT-NeoX; the numbers
# in the text come from the full-size run on the GPU named in the first output below.

# %%
import sys

if "google.colab" in sys.modules:  # Colab only. pip adds what Colab lacks (bitsandbytes, the book's helpers)
    # and upgrades transformers to the 5.x the book needs: nothing has imported it yet in this kernel, so no
    # restart is needed. Colab's torch already meets the book's floor and is kept (see the setup page).
    # %pip install -q --no-warn-conflicts "gpu-efficient-training @ git+https://github.com/gpu-efficient-training/book"

from helpers import env

env.quiet()  # warnings without file paths, no progress bars: outputs that read the same everywhere

import contextlib
import itertools
import math
import shutil
import time
import warnings
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import torch
from torch import nn
from transformers.utils import logging as hf_logging

from helpers import accounting, cleanup, data, estimates, measure, models, plots, profiles, train
from helpers.glue import glue
from helpers.measure import GIB, MIB

hf_logging.disable_progress_bar()  # from_pretrained and save_pretrained draw no progress bars
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")  # a deprecation between libraries
plots.use_style()
pd.options.display.float_format = "{:,.2f}".format
prof = profiles.get()
dev = prof.device
nvml_before_cuda = measure.nvml_used_mib() if prof.on_gpu else None  # section 6.3 needs the CUDA context's size
env.report(prof)


# %% [markdown]
# ## 6.1 LoRA by hand
#
# A linear layer computes $h = W x$ with a weight $W$ of $d_\text{out} \times d_\text{in}$ values. Fine-tuning
# learns a change $\Delta W$ of the same size. LoRA's bet is that the change has low rank: it writes
# $\Delta W = B A$ with $A$ of size $r \times d_\text{in}$ and $B$ of size $d_\text{out} \times r$, for a small rank
# $r$, freezes $W$ and trains only $A$ and $B$:
#
# $$ h = W x + \frac{\alpha}{r}\, B A\, x . $$
#
# $A$ starts random and $B$ starts at zero, so $\Delta W = 0$ and the adapted model computes exactly what the base
# model computes until the first update. The factor $\alpha / r$ keeps the size of the update roughly independent of
# the rank, so a learning rate found for one $r$ carries over to another. Dropout on the adapter's input regularises
# it. The layer, written out, with the adapter in fp32 whatever the base's dtype (trainable weights stay in fp32, the
# rule of mixed precision):

# %%
class LoRALinear(nn.Module):
    """A frozen nn.Linear plus a trainable low-rank update: base(x) + (alpha / r) * B(A(dropout(x)))."""

    def __init__(self, base: nn.Linear, r: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_A = nn.Linear(base.in_features, r, bias=False, device=base.weight.device, dtype=torch.float32)
        self.lora_B = nn.Linear(r, base.out_features, bias=False, device=base.weight.device, dtype=torch.float32)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # as nn.Linear's default, and as the paper
        nn.init.zeros_(self.lora_B.weight)  # B = 0: the update starts at zero
        self.scaling = alpha / r
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        result = self.base(x)
        update = self.lora_B(self.lora_A(self.dropout(x.to(self.lora_A.weight.dtype)))) * self.scaling
        return (result + update).to(result.dtype)


def add_lora(model, targets, r, alpha, dropout=0.0):
    """Freeze `model` and replace every nn.Linear whose attribute name is in `targets` by a LoRALinear."""
    model.requires_grad_(False)
    adapted = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if name in targets and isinstance(child, nn.Linear):
                setattr(parent, name, LoRALinear(child, r, alpha, dropout))
                adapted.append(getattr(parent, name))
    return adapted


# %% [markdown]
# The model is the polyglot-ko-1.3b-shaped GPT-NeoX of chapter 1, in bf16. Before we change it, we save it as a
# local checkpoint (section 6.3 loads it back in 4 bits, and 6.2 compares checkpoint sizes). In each of its 24
# layers, attention has two projections: `query_key_value` ($d \to 3d$, the three projections fused) and `dense`
# ($d \to d$, the output). We adapt both with $r = 8$, $\alpha = 16$.

# %%
R, ALPHA, DROPOUT, TARGETS = 8, 16, 0.05, ("query_key_value", "dense")
lm_seq, lm_batch = prof.pick(tiny=64, full=256), 4
ds_lm = data.markov_lm_dataset(lm_batch * 100, lm_seq, seed=0)
check = {k: v.to(dev) for k, v in ds_lm[:2].items()}

model = models.build("polyglot-ko-1.3b", head="causal-lm", dtype=torch.bfloat16, seed=0).eval()
n_base = models.n_params(model)
cfg = model.config
ckpt_dir = models.save_checkpoint(model, "ckpt_ch6/base-bf16")
with torch.no_grad():
    logits_base = model(input_ids=check["input_ids"]).logits

adapted = add_lora(model, TARGETS, R, ALPHA, DROPOUT)
model.eval()  # the new layers start in training mode; eval turns their dropout off
with torch.no_grad():
    logits_lora = model(input_ids=check["input_ids"]).logits
assert torch.equal(logits_lora, logits_base), "with B = 0 the adapted model must compute exactly the base model"

trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
by_formula = sum(R * (m.base.in_features + m.base.out_features) for m in adapted)
h, n_layers = cfg.hidden_size, cfg.num_hidden_layers
assert trainable == by_formula == n_layers * R * ((h + 3 * h) + (h + h))
print(model.gpt_neox.layers[0].attention)
lora_counts = pd.Series({
    "base parameters (frozen)": f"{n_base:,}", "adapted layers": f"{len(adapted)}",
    "trainable parameters": f"{trainable:,}", "by formula: sum of r (d_in + d_out)": f"{by_formula:,}",
    "trainable share": f"{100 * trainable / n_base:.3f} %",
})
if prof.is_full:
    glue("lora_trainable", trainable)
    glue("lora_adapted", len(adapted))
    glue("lora_share_pct", 100 * trainable / n_base)
    glue("base_params_b", n_base / 1e9)
lora_counts

# %% [markdown]
# Both assertions passed: the adapted model's logits equal the base model's bit for bit, and the trainable count is
# exactly $r\,(d_\text{in} + d_\text{out})$ summed over the {glue:text}`lora_adapted` adapted layers,
# $24 \cdot r \cdot 6d$ here: {glue:text}`lora_trainable:,` parameters, {glue:text}`lora_share_pct:.2f`% of the
# {glue:text}`base_params_b:.2f` billion. One training step shows what moves:

# %%
w_before = adapted[0].base.weight.detach().clone()
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
model.train()
with torch.autocast(dev, dtype=torch.bfloat16):
    loss = model(**check).loss
loss.backward()
optimizer.step()
model.eval()
with torch.no_grad():
    logits_after = model(input_ids=check["input_ids"]).logits
assert torch.equal(adapted[0].base.weight, w_before), "the base weights are frozen"
assert all(m.lora_B.weight.abs().sum() > 0 for m in adapted), "every B has left zero"
assert all(p.grad is None for n, p in model.named_parameters() if "lora_" not in n), "no gradient for the base"
print(f"after one step: base weights unchanged, every B non-zero, logits moved by up to "
      f"{(logits_after.float() - logits_base.float()).abs().max().item():.3g}")

# %%
freed = cleanup.free(globals(), "model", "adapted", "optimizer", "loss", "logits_base", "logits_lora", "logits_after",
                     "w_before")
if prof.on_gpu:
    print(f"freed {freed.allocated_freed_mib:,.0f} MiB; allocated now {freed.allocated_after_mib:,.0f} MiB")

# %% [markdown]
# ## 6.2 The same with peft
#
# The `peft` library does the same with a configuration: `LoraConfig` names the rank, $\alpha$, the dropout and the
# target modules, and `get_peft_model` wraps them. We check three things, in fp32 so that the tolerances measure the
# method and not bf16's rounding: the trainable count equals the hand-written one; the wrapped model starts out
# identical to the base; and one adapted layer of peft computes what our `LoRALinear` computes with the same $A$ and
# $B$.

# %%
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import LoraLayer


def lora_config(r=R, targets=TARGETS):
    return LoraConfig(r=r, lora_alpha=ALPHA, lora_dropout=DROPOUT, target_modules=list(targets), task_type="CAUSAL_LM")


model = models.build("polyglot-ko-1.3b", head="causal-lm", dtype=torch.float32, seed=0).eval()
with torch.no_grad():
    logits_base = model(input_ids=check["input_ids"]).logits
peft_model = get_peft_model(model, lora_config()).eval()
trainable_peft, total_peft = peft_model.get_nb_trainable_parameters()
assert trainable_peft == trainable, f"peft trains {trainable_peft:,}, the hand-written LoRA {trainable:,}"
with torch.no_grad():
    logits_peft = peft_model(input_ids=check["input_ids"]).logits
assert torch.equal(logits_peft, logits_base)

gen = torch.Generator(device=dev).manual_seed(0)
for layer in peft_model.modules():  # give every B random values, as training would
    if isinstance(layer, LoraLayer):
        nn.init.normal_(layer.lora_B["default"].weight, std=0.1, generator=gen)
peft_layer = peft_model.base_model.model.gpt_neox.layers[0].attention.query_key_value
ours = LoRALinear(peft_layer.base_layer, R, ALPHA).eval()
ours.lora_A.weight.data.copy_(peft_layer.lora_A["default"].weight)
ours.lora_B.weight.data.copy_(peft_layer.lora_B["default"].weight)
x = torch.randn(2, 16, h, device=dev, generator=gen)
with torch.no_grad():
    torch.testing.assert_close(ours(x), peft_layer(x), rtol=1e-6, atol=1e-6)
print(f"peft trains {trainable_peft:,} of {total_peft:,} parameters, as many as the hand-written LoRA; "
      "its adapted layer equals LoRALinear (rtol = atol = 1e-6)")

# %% [markdown]
# **Merging.** After training, $W + \frac{\alpha}{r} B A$ is just another $d_\text{out} \times d_\text{in}$ matrix.
# `merge_and_unload` computes it, writes it into the base layer and removes the adapters: the merged model has the
# base model's size and speed, and its outputs must equal the adapter model's up to rounding. Before merging we save
# the adapter alone, which is what one shares after LoRA training.

# %%
with torch.no_grad():
    logits_adapter = peft_model(input_ids=check["input_ids"]).logits
adapter_dir = Path("ckpt_ch6/adapter")
peft_model.save_pretrained(adapter_dir, save_embedding_layers=False)  # only the adapters
merged = peft_model.merge_and_unload()
assert not any(isinstance(m, LoraLayer) for m in merged.modules()) and models.n_params(merged) == n_base
with torch.no_grad():
    logits_merged = merged(input_ids=check["input_ids"]).logits
merge_diff = (logits_merged - logits_adapter).abs().max().item()
logit_scale = logits_adapter.abs().max().item()
torch.testing.assert_close(logits_merged, logits_adapter, rtol=1e-4, atol=1e-4 * logit_scale)
moved = (logits_adapter - logits_base).abs().max().item()
print(f"merged vs adapter model: max |difference| {merge_diff:.2e} (logits up to {logit_scale:.2f}; "
      f"tolerance rtol = 1e-4, atol = 1e-4 x {logit_scale:.2f}); the adapters moved the logits by up to {moved:.2f}")
if prof.is_full:
    glue("merge_diff", merge_diff)
    glue("merge_moved", moved)


# %% [markdown]
# The merged model agrees with the adapter model to {glue:text}`merge_diff:.1e` in the logits, fp32 rounding of a
# different order of operations, while the adapters themselves changed the logits by up to
# {glue:text}`merge_moved:.2f`: the check would notice a wrong merge. On disk:

# %%
def dir_bytes(path):
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


sizes = pd.Series({
    "full checkpoint, bf16 (MiB)": dir_bytes(ckpt_dir) / MIB,
    "LoRA adapter, fp32 (MiB)": dir_bytes(adapter_dir) / MIB,
    "adapter weights by formula: 4 bytes x trainable (MiB)": 4 * trainable / MIB,
})
sizes["full / adapter"] = sizes.iloc[0] / sizes.iloc[1]
if prof.is_full:
    glue("ckpt_full_mib", sizes.iloc[0])
    glue("ckpt_adapter_mib", sizes.iloc[1])
    glue("ckpt_ratio", sizes.iloc[3])
sizes

# %% [markdown]
# The adapter is {glue:text}`ckpt_adapter_mib:.1f` MiB (its fp32 weights, a JSON config and a short README) against
# {glue:text}`ckpt_full_mib:,.0f` MiB for the full model in bf16, {glue:text}`ckpt_ratio:,.0f` times smaller.
# One base model can serve many tasks, each a small adapter loaded on top (`PeftModel.from_pretrained`).

# %%
freed = cleanup.free(globals(), "model", "peft_model", "merged", "peft_layer", "ours", "x",
                     "logits_base", "logits_peft", "logits_adapter", "logits_merged")
if prof.on_gpu:
    print(f"freed {freed.allocated_freed_mib:,.0f} MiB; allocated now {freed.allocated_after_mib:,.0f} MiB")

# %% [markdown]
# ## 6.3 Memory and speed: full fine-tuning, LoRA, QLoRA
#
# Four ways to train the 1.3B model, each for a few steps at batch 4 and 256 tokens (the LLM book's setting):
#
# - **full fine-tuning, fp32**: every parameter trains, fp32 weights, AdamW (`fused=True`, the Trainer's default);
# - **full fine-tuning, bf16 autocast**: the same with mixed precision (chapter 5);
# - **LoRA**: the base in bf16, frozen; fp32 adapters with $r = 8$ on every linear layer of the 24 blocks (the two
#   attention projections and the MLP's `dense_h_to_4h` and `dense_4h_to_h`), AdamW; bf16 autocast;
# - **QLoRA**: the base loaded from the local checkpoint in 4-bit NF4 with double quantization through
#   `BitsAndBytesConfig`, prepared with peft's `prepare_model_for_kbit_training`, the same adapters, the paged
#   8-bit AdamW of bitsandbytes; bf16 autocast.
#
# Sections 6.1 and 6.2 adapted attention only, as the LoRA paper did for GPT-3. Here the adapters go on every linear
# layer, as in the QLoRA paper, which found that adapting all of them is what it takes to match full fine-tuning
# {cite:p}`dettmers2023qlora`. Per block that is $r\,(4d + 2d + 5d + 5d) = 16\,r\,d$ trainable parameters.
#
# `prepare_model_for_kbit_training` freezes the base and casts the parameters that are not quantized (embeddings,
# LM head, layer norms) to fp32 for stability; by default it also turns on gradient checkpointing, which we switch off
# here so that the four runs keep the same activations (chapter 4 measures checkpointing). Model states follow from
# byte counts: full fine-tuning in fp32 keeps $16 \times$ {glue:text}`base_params_b:.2f` billion bytes, about
# {glue:text}`full_states_gib:.0f` GiB, which no T4 can hold. On a larger GPU we first **emulate a T4**, as chapter 1
# does: `measure.gpu_budget` caps PyTorch's allocator at the T4's 14.75 GiB minus this process's CUDA context. A run
# that runs out of memory there is repeated on the whole GPU, and its numbers are labelled as such.

# %%
import bitsandbytes as bnb
from peft import prepare_model_for_kbit_training
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

LR_FULL, LR_LORA = 1e-4, 1e-3
ALL_LINEAR = ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h")  # every linear layer of the blocks
if prof.is_full:
    glue("full_states_gib", 16 * n_base / GIB)
paged_ok = profiles.cuda_or_skip("paged optimizers need CUDA unified memory; QLoRA uses the non-paged AdamW8bit")


def full_finetuning(half):
    model = models.build("polyglot-ko-1.3b", head="causal-lm", dtype=torch.float32, seed=0)
    return model, torch.optim.AdamW(model.parameters(), lr=LR_FULL, fused=True), half


def lora(r=R):
    model = models.build("polyglot-ko-1.3b", head="causal-lm", dtype=torch.bfloat16, seed=0)
    model = get_peft_model(model, lora_config(r, ALL_LINEAR))
    params = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(params, lr=LR_LORA, fused=True), torch.bfloat16


def qlora():
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(ckpt_dir, quantization_config=quant, dtype=torch.bfloat16,
                                                 device_map=dev, attn_implementation="sdpa")
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    model = get_peft_model(model, lora_config(R, ALL_LINEAR))
    params = [p for p in model.parameters() if p.requires_grad]
    make = bnb.optim.PagedAdamW8bit if paged_ok else bnb.optim.AdamW8bit
    return model, make(params, lr=LR_LORA), torch.bfloat16


# %% [markdown]
# One function trains any of them: it builds the model and optimizer, runs the steps, and records the model states
# by accounting (weights, gradients after `backward()`, optimizer states after `step()`), the bytes saved for
# backward in step 2 (`SavedTensorMeter`), the median time of steps 3 and later, the peak allocated memory over the
# whole run, and the loss of every step. An out-of-memory error is caught and reported with the phase it happened in.

# %%
def run(build, steps):
    """Build a model and optimizer, train `steps` steps; model states, activations, time, peak, losses."""
    where = "loading the model"
    losses, times, rec = [], [], {}
    try:
        measure.reset_peak(dev)
        model, optimizer, half = build()
        base_lrs = [g["lr"] for g in optimizer.param_groups]
        model.train()
        for i, batch in enumerate(itertools.islice(train.batches(ds_lm, lm_batch, seed=0), steps)):
            where = f"step {i + 1}"
            batch = {k: v.to(dev) for k, v in batch.items()}
            for group, lr in zip(optimizer.param_groups, base_lrs):  # linear warm-up over 10 steps
                group["lr"] = lr * min(1.0, (i + 1) / 10)
            meter = accounting.SavedTensorMeter(model) if i == 1 else contextlib.nullcontext()  # step 2 only
            measure.synchronize(dev)
            start = time.perf_counter()
            with meter, torch.autocast(dev, dtype=half, enabled=half is not None):
                loss = model(**batch).loss
            loss.backward()
            if i == 1:
                rec |= {"gradients": accounting.grad_bytes(model), "activations": meter.total_bytes}
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            measure.synchronize(dev)
            times.append(time.perf_counter() - start)
            losses.append(loss.item())
        rec |= {"weights": accounting.param_bytes(model), "optimizer states": accounting.optimizer_state_bytes(optimizer),
                "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}
    except torch.OutOfMemoryError:
        return {"result": f"out of memory ({where})"}, losses
    median_s = pd.Series(times[2:]).median()
    row = {"result": "ok", "trainable parameters": rec["trainable"],
           **{part: rec[part] / GIB for part in ("weights", "gradients", "optimizer states", "activations")},
           "step (ms)": 1e3 * median_s, "tokens/s": lm_batch * lm_seq / median_s}
    if prof.on_gpu:
        row["peak allocated"] = measure.allocator_mib()["peak_allocated_mib"] * MIB / GIB
    return row, losses


# %% [markdown]
# The four runs. Full fine-tuning in fp32 runs 4 steps; the other three run {glue:text}`curve_steps` steps, and
# section 6.4 uses their loss curves. Memory columns are in GiB.

# %%
curve_steps = prof.pick(tiny=20, full=100)
if prof.is_full:
    glue("curve_steps", curve_steps)
if profiles.cuda_or_skip("emulating the T4's memory needs a GPU; on a CPU the runs are not capped"):
    cleanup.free(globals())
    context_gib = (measure.nvml_used_mib() - nvml_before_cuda) * MIB / GIB - torch.cuda.memory_reserved() / GIB
    t4_budget_gib = measure.T4_MEMORY_GIB - context_gib
    glue("t4_budget_gib", t4_budget_gib)
    print(f"allocator capped at {t4_budget_gib:.2f} GiB = 14.75 GiB (T4) - {context_gib:.2f} GiB (CUDA context)")

CONFIGS = {
    "full fine-tuning, fp32": (lambda: full_finetuning(None), 4),
    "full fine-tuning, bf16 autocast": (lambda: full_finetuning(torch.bfloat16), curve_steps),
    "LoRA r=8, bf16 base": (lora, curve_steps),
    "QLoRA r=8, NF4 base": (qlora, curve_steps),
}
results, curves = {}, {}
for name, (build, steps) in CONFIGS.items():
    if prof.on_gpu:
        with measure.gpu_budget(t4_budget_gib):
            row, losses = run(build, steps)
        on_t4 = row["result"]
        if on_t4 != "ok":  # it does not fit a T4: measure it on the whole GPU, and say so
            cleanup.free(globals())
            row, losses = run(build, steps)
        row = {"emulated T4": on_t4, "measured on": "T4 budget" if on_t4 == "ok" else "whole GPU", **row}
    else:
        row, losses = run(build, steps)
    results[name], curves[name] = row, losses
    cleanup.free(globals())
    if prof.on_gpu:
        print(f"{name}: '{row['emulated T4']}' on the T4 budget; allocated afterwards "
              f"{torch.cuda.memory_allocated() / MIB:,.0f} MiB")
ft = pd.DataFrame(results).T
ft

# %%
states = ["weights", "gradients", "optimizer states"]
ok = ft[ft["result"] == "ok"]
breakdown = ok[states].astype(float)
if prof.on_gpu:  # the bar is the measured peak; what the model states do not explain is activations and temporaries
    breakdown["activations & temporaries"] = (ok["peak allocated"].astype(float) - breakdown.sum(axis=1)).clip(lower=0)
    breakdown.index = [f"{n} *" if ok.loc[n, "measured on"] != "T4 budget" else n for n in ok.index]
    title = f"1.3B GPT-NeoX, batch {lm_batch} x {lm_seq} tokens: peak allocated memory"
else:  # no allocator: the accounted parts, with the bytes saved for backward
    breakdown["activations & temporaries"] = ok["activations"].astype(float)
    title = f"1.3B GPT-NeoX, batch {lm_batch} x {lm_seq} tokens: accounted memory"
fig = plots.stacked_bar(breakdown, title=title, ylabel="memory (GiB)", colors={"activations & temporaries": "#C44E52"})
ax = fig.axes[0]
short = {"full fine-tuning, fp32": "full FT\nfp32", "full fine-tuning, bf16 autocast": "full FT\nbf16 autocast",
         "LoRA r=8, bf16 base": "LoRA r=8\nbf16 base", "QLoRA r=8, NF4 base": "QLoRA r=8\nNF4 base"}
ax.set_xticks(range(len(breakdown)), [short.get(n.rstrip(" *"), n) + (" *" if n.endswith("*") else "")
                                      for n in breakdown.index], rotation=0, ha="center")
if prof.on_gpu:
    ax.axhline(t4_budget_gib, color="grey", linestyle="--", label="emulated T4 budget")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_xlabel("* does not fit the T4 budget: measured on the whole GPU")
fig.tight_layout()

# %%
if prof.is_full and prof.on_gpu:
    for key, name in [("fp32", "full fine-tuning, fp32"), ("mixed", "full fine-tuning, bf16 autocast"),
                      ("lora", "LoRA r=8, bf16 base"), ("qlora", "QLoRA r=8, NF4 base")]:
        glue(f"ft_{key}_peak", ft.loc[name, "peak allocated"])
        glue(f"ft_{key}_ms", ft.loc[name, "step (ms)"])
        glue(f"ft_{key}_weights", ft.loc[name, "weights"])
        glue(f"ft_{key}_acts", ft.loc[name, "activations"])
        glue(f"ft_{key}_t4", ft.loc[name, "emulated T4"])
    glue("ft_qlora_states_mib", ft.loc["QLoRA r=8, NF4 base", "optimizer states"] * GIB / MIB)
    glue("ft_lora_states_mib", ft.loc["LoRA r=8, bf16 base", "optimizer states"] * GIB / MIB)
    glue("ft_lora_trainable", ft.loc["LoRA r=8, bf16 base", "trainable parameters"])
    glue("ft_nf4_weights_bits", 8 * ft.loc["QLoRA r=8, NF4 base", "weights"] * GIB / n_base)
n_embed = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
if prof.is_full:
    glue("embed_share_pct", 100 * n_embed / n_base)

# %% [markdown]
# Under the emulated T4 ({glue:text}`t4_budget_gib:.2f` GiB for tensors), full fine-tuning failed in both
# precisions ("{glue:text}`ft_fp32_t4`" in fp32, "{glue:text}`ft_mixed_t4`" with autocast): the model states alone,
# 16 bytes per parameter, are {glue:text}`full_states_gib:.1f` GiB. On the whole GPU, full fine-tuning
# peaked at {glue:text}`ft_fp32_peak:.1f` GiB in fp32 and {glue:text}`ft_mixed_peak:.1f` GiB with bf16 autocast
# (the bars marked * are numbers from the large GPU, not from a T4). LoRA peaked at {glue:text}`ft_lora_peak:.2f` GiB
# and QLoRA at {glue:text}`ft_qlora_peak:.2f` GiB, both inside the T4 budget.
#
# Where the memory went:
#
# - **Weights.** {glue:text}`ft_lora_weights:.2f` GiB for LoRA's bf16 base, {glue:text}`ft_qlora_weights:.2f` GiB
#   for QLoRA's: {glue:text}`ft_nf4_weights_bits:.1f` bits per parameter on average, not 4. The embeddings and the
#   LM head ({glue:text}`embed_share_pct:.0f`% of this model's parameters: its vocabulary is large for its size) are
#   not quantized, and `prepare_model_for_kbit_training` casts them to fp32. In LLaMA-65B (section 6.5) they are
#   {glue:text}`llama_embed_pct:.1f`% of the parameters.
# - **Gradients and optimizer states** nearly vanish: only the {glue:text}`ft_lora_trainable:,` adapter parameters
#   have them. AdamW's states for LoRA take {glue:text}`ft_lora_states_mib:.1f` MiB, the 8-bit states for QLoRA
#   {glue:text}`ft_qlora_states_mib:.1f` MiB.
# - **Activations** do not go away: the backward pass still runs through every frozen layer to reach the adapters
#   below it, and the inputs of the adapted layers are saved. The bytes saved for backward were
#   {glue:text}`ft_mixed_acts:.2f` GiB for full fine-tuning with autocast, {glue:text}`ft_lora_acts:.2f` GiB for LoRA
#   and {glue:text}`ft_qlora_acts:.2f` GiB for QLoRA (whose fp32 embeddings and layer norms, left by
#   `prepare_model_for_kbit_training`, put part of the residual stream in fp32). At long sequences the activations
#   dominate, which is why QLoRA is usually combined with gradient checkpointing (chapter 4).
#
# Speed: a full fine-tuning step with autocast took {glue:text}`ft_mixed_ms:.0f` ms, LoRA
# {glue:text}`ft_lora_ms:.0f` ms and QLoRA {glue:text}`ft_qlora_ms:.0f` ms. LoRA skips the weight gradients of the
# frozen layers (a third of the FLOPs) and nearly all of the optimizer's work, and still its step was not faster
# here. At 1,024 tokens per step this GPU is far from busy (chapter 3: the 1.3B model's throughput was still
# climbing steeply at this batch), so a step's time goes to launching kernels rather than to arithmetic, and each of
# the 96 adapted layers adds kernels of its own (the two adapter products, dropout, casts, in the forward and the
# backward pass). The FLOPs LoRA saves show at batches large enough to keep the GPU busy. QLoRA pays, in addition,
# to dequantize every weight from 4 bits, in the forward pass and again in the backward pass.

# %% [markdown]
# **The rank.** How do trainable parameters and memory grow with $r$? LoRA with $r$ from 4 to 256 on the same four
# layers per block, three steps each, under the T4 budget:

# %%
ranks = prof.pick(tiny=[4, 8, 16, 32], full=[4, 8, 16, 32, 64, 128, 256])
rank_rows = []
for r in ranks:
    if prof.on_gpu:
        with measure.gpu_budget(t4_budget_gib):
            row, _ = run(lambda r=r: lora(r), 3)
    else:
        row, _ = run(lambda r=r: lora(r), 3)
    # r (d_in + d_out) per adapted layer: (d + 3d) + (d + d) + (d + 4d) + (4d + d) = 16d per block
    assert row["trainable parameters"] == n_layers * r * 16 * h
    rank_rows.append({"r": r, **row})
    cleanup.free(globals())
rank_sweep = pd.DataFrame(rank_rows).set_index("r")
rank_sweep["trainable (M)"] = rank_sweep["trainable parameters"] / 1e6
rank_sweep[[c for c in rank_sweep.columns if c not in ("result", "trainable parameters", "tokens/s")]]

# %%
mem_col = "peak allocated" if prof.on_gpu else "activations"
fig, (ax_p, ax_m) = plt.subplots(1, 2, figsize=(10, 4))
ax_p.plot(rank_sweep.index, rank_sweep["trainable (M)"], "o-")
ax_p.set_ylabel("trainable parameters (millions)")
ax_p.set_title("trainable parameters: linear in r")
ax_m.plot(rank_sweep.index, rank_sweep[mem_col].astype(float), "o-",
          label="peak allocated" if prof.on_gpu else "saved for backward")
ax_m.plot(rank_sweep.index, rank_sweep[["weights", "gradients", "optimizer states"]].astype(float).sum(axis=1), "s--",
          label="weights + gradients + optimizer states")
ax_m.set_ylabel("memory (GiB)")
ax_m.set_ylim(bottom=0)
ax_m.set_title("memory: the frozen base dominates")
ax_m.legend()
for ax in (ax_p, ax_m):
    ax.set_xscale("log", base=2)
    ax.set_xlabel("LoRA rank r")
fig.suptitle("LoRA on every linear layer of the 1.3B model: what the rank costs")
fig.tight_layout()

# %%
if prof.is_full and prof.on_gpu:
    glue("rank_lo", ranks[0])
    glue("rank_hi", ranks[-1])
    glue("rank_lo_m", rank_sweep["trainable (M)"].iloc[0])
    glue("rank_hi_m", rank_sweep["trainable (M)"].iloc[-1])
    glue("rank_lo_peak", rank_sweep["peak allocated"].iloc[0])
    glue("rank_hi_peak", rank_sweep["peak allocated"].iloc[-1])
    glue("rank_hi_adapter_gib", 16 * rank_sweep["trainable parameters"].iloc[-1] / GIB)

# %% [markdown]
# From $r$ = {glue:text}`rank_lo` to {glue:text}`rank_hi` the trainable parameters grow from
# {glue:text}`rank_lo_m:.2f` to {glue:text}`rank_hi_m:.1f` million, in proportion to $r$ (the figure's rank axis
# doubles at each step, which is why a straight proportion looks like a curve there), and the peak from
# {glue:text}`rank_lo_peak:.2f` to {glue:text}`rank_hi_peak:.2f` GiB. Each trainable parameter costs 16 bytes (fp32
# weight and gradient, two AdamW states): {glue:text}`rank_hi_adapter_gib:.2f` GiB at $r$ =
# {glue:text}`rank_hi`, small next to the frozen base and the activations. Memory is not what limits the rank; the
# LoRA paper found small ranks sufficient for the tasks it studied {cite:p}`hu2022lora`.

# %% [markdown]
# ## 6.4 Does it learn?
#
# The runs of section 6.3 trained on `data.markov_lm_dataset`: sequences from a fixed random chain in which each of
# 64 tokens has 4 equally likely successors, so the best possible loss is $\ln 4$ = {glue:text}`markov_floor:.3f`
# nats per token. The same batches in the same order, the same number of steps; learning rates typical for each
# method ({glue:text}`lr_full` for full fine-tuning, {glue:text}`lr_lora` for the adapters, both with 10 warm-up
# steps).

# %%
floor = data.markov_loss_floor(4)
glue("markov_floor", floor)
glue("lr_full", f"{LR_FULL:g}", display_value=False)
glue("lr_lora", f"{LR_LORA:g}", display_value=False)
learn = {n: c for n, c in curves.items() if len(c) == curve_steps}
fig, ax = plt.subplots()
for (name, losses), style in zip(learn.items(), ["-", "--", "-."]):
    ax.plot(range(1, len(losses) + 1), pd.Series(losses).rolling(5, min_periods=1).mean(), style, label=name)
ax.axhline(floor, color="grey", linestyle=":", label="best possible: ln 4")
ax.set_ylim(bottom=0)
ax.set_title("1.3B GPT-NeoX from random weights, Markov task (mean of 5 steps)")
ax.set_xlabel(f"training step (batch {lm_batch} x {lm_seq} tokens)")
ax.set_ylabel("training loss (nats)")
ax.legend()
fig.tight_layout()
final = pd.Series({n: pd.Series(c[-10:]).mean() for n, c in learn.items()}, name="loss, last 10 steps (nats)")
if prof.is_full:
    for key, name in [("mixed", "full fine-tuning, bf16 autocast"), ("lora", "LoRA r=8, bf16 base"),
                      ("qlora", "QLoRA r=8, NF4 base")]:
        glue(f"learn_{key}", final[name])
final

# %% [markdown]
# After {glue:text}`curve_steps` steps the mean loss of the last ten steps was {glue:text}`learn_mixed:.3f` nats for
# full fine-tuning, {glue:text}`learn_lora:.3f` for LoRA and {glue:text}`learn_qlora:.3f` for QLoRA, against the
# floor of {glue:text}`markov_floor:.3f`. LoRA and QLoRA follow each other: the 4-bit base computes nearly the same
# function as the bf16 one, the finding behind QLoRA {cite:p}`dettmers2023qlora`.
#
# Read the comparison with full fine-tuning with care. The base model here has random weights, so LoRA must solve
# the task through rank-8 changes inside a network that knows nothing, with a frozen random LM head. Fine-tuning in
# practice starts
# from a pretrained model that already represents most of what the task needs; there the LoRA paper finds it on par
# with full fine-tuning on GPT-3 and RoBERTa {cite:p}`hu2022lora`. What this experiment does show is the machinery
# working end to end: gradients reach the adapters through frozen bf16 and 4-bit layers, and the loss falls.

# %%
freed = cleanup.free(globals())
shutil.rmtree("ckpt_ch6", ignore_errors=True)  # the local checkpoint and adapter are no longer needed
if prof.on_gpu:
    print(f"allocated at the end of the experiments: {torch.cuda.memory_allocated() / MIB:,.0f} MiB")

# %% [markdown]
# ## 6.5 The papers' numbers by formula
#
# **LoRA on GPT-3 175B.** {cite:t}`hu2022lora` report that LoRA cut the GPU memory of training GPT-3 175B from
# 1.2 TB to 350 GB, and the checkpoint from 350 GB to 35 MB, with $r = 4$ on the query and value projections of all
# 96 layers. We build a GPT-3-shaped model on PyTorch's `meta` device (shapes, no memory) to count its parameters,
# count the adapters with the formula, and turn both into bytes with the book's per-parameter rules
# (`estimates.BYTES_PER_PARAM`). The paper writes GB and TB; we give decimal and binary units.

# %%
# NBVAL_CHECK_OUTPUT
# (arithmetic on shapes: identical on every machine; printed as text, identical across pandas versions)
from transformers import GPT2Config, LlamaConfig


def on_meta(config):
    """A model of any size, with shapes but no memory."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def state_bytes(n, recipe):
    return sum(estimates.model_state_bytes(n, recipe).values())


UNITS = {"TB": (1e12, 2**40, "TiB"), "GB": (1e9, GIB, "GiB"), "MB": (1e6, MIB, "MiB")}


def both_units(n_bytes, unit):
    """The same amount in decimal units (as papers write) and in binary units (as this book does)."""
    decimal, binary, binary_name = UNITS[unit]
    return f"{n_bytes / decimal:,.2f} {unit}", f"{n_bytes / binary:,.2f} {binary_name}"


gpt3 = on_meta(GPT2Config(n_embd=12288, n_layer=96, n_head=96, n_positions=2048, vocab_size=50257))
n_gpt3 = models.n_params(gpt3)
d, L = gpt3.config.n_embd, gpt3.config.n_layer
n_lora_gpt3 = L * 2 * 4 * (d + d)  # r = 4 on W_q and W_v (d x d each) in every layer
lora_rows = {
    "training, full: fp16 weights, gradients, Adam states (8 B/param)": ("1.2 TB", state_bytes(n_gpt3, "fp16_adamw"), "TB"),
    "training, full: fp32 AdamW (16 B/param)": ("", state_bytes(n_gpt3, "fp32_adamw"), "TB"),
    "training, LoRA: frozen fp16 weights + adapters at 18 B/param": (
        "350 GB", state_bytes(n_gpt3, "half_inference") + state_bytes(n_lora_gpt3, "mixed_adamw"), "GB"),
    "checkpoint, full model in fp16": ("350 GB", 2 * n_gpt3, "GB"),
    "checkpoint, LoRA adapters in fp16": ("35 MB", 2 * n_lora_gpt3, "MB"),
}
lora_paper = pd.DataFrame(
    {k: {"paper": paper, "by formula": both_units(b, u)[0], "by formula, binary": both_units(b, u)[1]}
     for k, (paper, b, u) in lora_rows.items()}).T
print(f"GPT-3-shaped model: {n_gpt3 / 1e9:.1f} B parameters; LoRA r = 4 on W_q, W_v: {n_lora_gpt3:,} trainable")
print(lora_paper.to_string())

# %%
if prof.is_full:
    glue("gpt3_full8_tib", state_bytes(n_gpt3, "fp16_adamw") / 2**40)
    glue("gpt3_full8_tb", state_bytes(n_gpt3, "fp16_adamw") / 1e12)
    glue("gpt3_lora_gb", (state_bytes(n_gpt3, "half_inference") + state_bytes(n_lora_gpt3, "mixed_adamw")) / 1e9)
    glue("gpt3_adapter_mb", 2 * n_lora_gpt3 / 1e6)
    glue("gpt3_adapter_mib", 2 * n_lora_gpt3 / MIB)

# %% [markdown]
# The LoRA side of the paper's claim is pure weight storage: 2 bytes for each of the 175 billion frozen parameters
# make {glue:text}`gpt3_lora_gb:.0f` GB, and the adapters, even at 18 bytes per trainable parameter, add a fraction
# of a GB. The checkpoint of $r = 4$ adapters on $W_q$ and $W_v$ is {glue:text}`gpt3_adapter_mb:.1f` MB in fp16
# ({glue:text}`gpt3_adapter_mib:.1f` MiB), the paper's "35 MB" give or take the units. For full fine-tuning the paper
# does not say how it counted. No per-parameter rule gives exactly 1.2 TB: 8 bytes per parameter (fp16 weights,
# gradients and both Adam states, the LLM book's recipe of chapter 1) gives {glue:text}`gpt3_full8_tb:.2f` TB,
# which is {glue:text}`gpt3_full8_tib:.2f` TiB in binary units, the closest reading; fp32 AdamW would need twice
# that. Either way the ratio, three to four times less memory, is the point.
#
# **QLoRA on a 65B model.** {cite:t}`dettmers2023qlora` fine-tune LLaMA-65B on one 48 GB GPU, where 16-bit full
# fine-tuning needs "more than 780 GB". Their setting: NF4 weights with double quantization, LoRA with $r = 64$ on
# every linear layer, adapters in bf16, a paged AdamW with 32-bit states, gradient checkpointing. The NF4 weights
# cost 4 bits plus their quantization constants: one fp32 scale per block of 64 weights is 0.5 bits per weight;
# double quantization stores those scales in 8 bits with one fp32 scale per 256 of them, $8/64 + 32/(64 \cdot 256)$
# = 0.127 bits.

# %%
# NBVAL_CHECK_OUTPUT
# (arithmetic on shapes: identical on every machine; printed as text, identical across pandas versions)
llama = on_meta(LlamaConfig(hidden_size=8192, intermediate_size=22016, num_hidden_layers=80, num_attention_heads=64,
                            vocab_size=32000))
n_llama = models.n_params(llama)
linears = [m for name, m in llama.named_modules() if isinstance(m, nn.Linear) and name != "lm_head"]
n_quantized = sum(m.weight.numel() for m in linears)
n_lora_llama = sum(64 * (m.in_features + m.out_features) for m in linears)  # r = 64 on every linear layer
nf4_bits = 4 + 8 / 64 + 32 / (64 * 256)  # 4-bit codes + double-quantized block scales
full16 = estimates.model_state_bytes(n_llama, "fp16_adamw")
full16["optimizer_states"] = estimates.model_state_bytes(n_llama, "fp32_adamw")["optimizer_states"]  # fp32 Adam
qlora_bytes = {
    "base: NF4 linear layers": n_quantized * nf4_bits / 8,
    "base: embeddings, LM head, norms (bf16)": 2 * (n_llama - n_quantized),
    "adapters: bf16 weights and gradients, fp32 Adam states (12 B/param)": 12 * n_lora_llama,
}
qlora_paper = pd.DataFrame({
    "full fine-tuning, 16-bit weights and gradients, fp32 Adam (12 B/param)": {
        "paper": "> 780 GB", "by formula": f"{sum(full16.values()) / 1e9:,.0f} GB"},
    **{part: {"paper": "", "by formula": f"{b / 1e9:,.1f} GB"} for part, b in qlora_bytes.items()},
    "QLoRA model states, total": {"paper": "< 48 GB (one GPU)", "by formula": f"{sum(qlora_bytes.values()) / 1e9:,.1f} GB"},
}).T
print(f"LLaMA-65B shape: {n_llama / 1e9:.2f} B parameters, {n_quantized / 1e9:.2f} B in linear layers; "
      f"LoRA r = 64 on all {len(linears)} of them: {n_lora_llama / 1e6:,.0f} M trainable; NF4: {nf4_bits:.3f} bits/weight")
print(qlora_paper.to_string())

# %%
if prof.is_full:
    glue("llama_full_gb", sum(full16.values()) / 1e9)
    glue("llama_qlora_gb", sum(qlora_bytes.values()) / 1e9)
    glue("llama_room_gb", 48 - sum(qlora_bytes.values()) / 1e9)
    glue("llama_nf4_gb", qlora_bytes["base: NF4 linear layers"] / 1e9)
    glue("llama_embed_pct", 100 * (n_llama - n_quantized) / n_llama)

# %% [markdown]
# 16-bit full fine-tuning needs {glue:text}`llama_full_gb:,.0f` GB of model states, the paper's "more than 780 GB".
# QLoRA's model states add up to {glue:text}`llama_qlora_gb:.1f` GB, of which {glue:text}`llama_nf4_gb:.1f` GB is
# the 4-bit base. That leaves {glue:text}`llama_room_gb:.1f` GB of a 48 GB card for activations, which is why the
# paper needs gradient checkpointing, and for the paged optimizer to absorb the spikes of long sequences by moving
# its states to CPU memory. The formula reproduces both claims; the 1.3B measurements of section 6.3 show the same
# structure at small scale, where the unquantized embeddings and the activations weigh more.

# %% [markdown]
# ## Summary
#
# The peak memory of one training step of the 1.3B model (batch 4 x 256 tokens), as measured in section 6.3:

# %%
summary_cols = [c for c in ("emulated T4", "measured on", "trainable parameters", "peak allocated", "step (ms)") if c in ft.columns]
ft[summary_cols]

# %% [markdown]
# - A LoRA layer adds $\frac{\alpha}{r} B A x$ to a frozen $W x$; with $B = 0$ at the start the adapted model is the
#   base model, bit for bit (checked), and it trains $r\,(d_\text{in} + d_\text{out})$ parameters per adapted layer:
#   {glue:text}`lora_trainable:,` here, {glue:text}`lora_share_pct:.2f`% of the model (checked against the formula
#   and against peft).
# - `merge_and_unload` folds the adapters into the weights with the same outputs (checked to fp32 rounding); an
#   adapter checkpoint is {glue:text}`ckpt_ratio:,.0f` times smaller than the model's.
# - Full fine-tuning of the 1.3B model with AdamW does not fit a T4, in fp32 or with autocast: 16 bytes per
#   parameter of model states (it peaked at {glue:text}`ft_fp32_peak:.1f` GiB in fp32 and
#   {glue:text}`ft_mixed_peak:.1f` GiB with autocast on the large GPU). LoRA peaked at
#   {glue:text}`ft_lora_peak:.2f` GiB and QLoRA at {glue:text}`ft_qlora_peak:.2f` GiB: gradients and optimizer states
#   vanish, QLoRA shrinks the weights, and the activations stay.
# - The rank is cheap in memory; from the papers' byte counts, LoRA's 1.2 TB to 350 GB for GPT-3 and QLoRA's
#   65B model on a 48 GB card follow from bytes per parameter alone.
#
# ## Use it in your own script
#
# LoRA and QLoRA with peft and transformers; the module names are those of GPT-NeoX (print `model` to find
# yours).
#
# ```python
# import torch
# from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
# from transformers import AutoModelForCausalLM, BitsAndBytesConfig
#
# qlora = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
#                            bnb_4bit_compute_dtype=torch.bfloat16)
# model = AutoModelForCausalLM.from_pretrained(checkpoint_dir, quantization_config=qlora)  # omit for LoRA
# model = prepare_model_for_kbit_training(model)                                          # QLoRA only
# config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules=["query_key_value"],
#                     task_type="CAUSAL_LM")
# model = get_peft_model(model, config)
# model.print_trainable_parameters()
# ```
#
# ## Exercises
#
# Each exercise has a hint and an answer (or the range to expect) behind a click.
#
# 1. Add the MLP's `dense_h_to_4h` and `dense_4h_to_h` to `TARGETS` in section 6.1 and change the assertion to
#    $16\,r\,d$ per block, the count of section 6.3. Does the step-0 identity still hold?
#
#    <details><summary>Hint</summary>
#
#    Per block: `query_key_value` maps $d \to 3d$, `dense` $d \to d$, `dense_h_to_4h` $d \to 4d$, `dense_4h_to_h` $4d \to d$; each adds $r\,(d_\text{in} + d_\text{out})$.
#
#    </details>
#
#    <details><summary>Answer</summary>
#
#    $r\,(4d + 2d + 5d + 5d) = 16\,r\,d$ per block. The step-0 identity still holds: every $B$ starts at zero, whatever layers are adapted.
#
#    </details>
#
# 2. In `qlora()`, set `bnb_4bit_use_double_quant=False`. By how many MiB should the weights grow (0.373 bits per
#    quantized weight)? Check against the weights column.
#
#    <details><summary>Hint</summary>
#
#    Double quantization stores the per-block scales in 8 bits: 0.373 fewer bits for each quantized weight.
#
#    </details>
#
#    <details><summary>Answer</summary>
#
#    About 54 MiB more: $0.373 / 8$ bytes times the roughly 1.2 billion quantized weights (the embeddings and the head stay in 16 bits).
#
#    </details>
#
# 3. In `qlora()`, pass `use_gradient_checkpointing=True` to `prepare_model_for_kbit_training`. How much do the
#    activations and the peak fall, and what does the step cost in time?
#
#    <details><summary>Hint</summary>
#
#    It enables gradient checkpointing on the 4-bit model (chapter 4): block inputs are kept, the rest is recomputed.
#
#    </details>
#
#    <details><summary>Answer</summary>
#
#    The activations fall by most of their size and the peak with them (the activation part of section 6.3's breakdown); the step costs about one more forward pass, around a third more time, a little more with 4-bit dequantization in the recomputation.
#
#    </details>
#
# 4. Run section 6.4 with `LR_LORA = 1e-4`, the same learning rate as full fine-tuning. Why do adapters usually
#    need a larger learning rate than full fine-tuning?
#
#    <details><summary>Hint</summary>
#
#    LoRA's $B$ starts at zero and its update is scaled by $\alpha / r$; a few million parameters must move the model's function as far as a full update does.
#
#    </details>
#
#    <details><summary>Answer</summary>
#
#    The adapters learn more slowly at full fine-tuning's rate: their loss curve lags the one with the chapter's larger `LR_LORA`. Adapters usually take learning rates several times larger (1e-4 to 3e-4 for LoRA against 1e-5 to 5e-5 for full fine-tuning).
#
#    </details>
#
# ## References
#
# - {cite:t}`hu2022lora`: LoRA, its initialisation and scaling, the GPT-3 175B numbers.
# - {cite:t}`dettmers2023qlora`: QLoRA, NF4, double quantization, paged optimizers, the 65B model on 48 GB.
# - {cite:t}`dettmers2022optimizers`: the 8-bit optimizers used by QLoRA's paged AdamW.
# - {cite:t}`heo2024llm`, chapter 5: LoRA and QLoRA on polyglot-ko-1.3b, the model of this chapter.
