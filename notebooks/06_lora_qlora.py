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
# of model states: about 20 GiB before a single [activation](https://gpu-efficient-training.github.io/book/book/glossary.html#activations), more than a 15 GB T4 holds. Low-rank adaptation ([LoRA](https://gpu-efficient-training.github.io/book/book/glossary.html#lora),
# [Hu et al. (2022)](https://gpu-efficient-training.github.io/book/book/references.html)) freezes the model and trains a few million new parameters beside it;
# [QLoRA](https://gpu-efficient-training.github.io/book/book/glossary.html#qlora) ([Dettmers et al. (2023)](https://gpu-efficient-training.github.io/book/book/references.html)) also stores the frozen model in 4 bits. This chapter
# writes a LoRA layer by hand, checks it against the `peft` library, and measures what the two methods save, what
# they cost, and whether the model still learns.
#
# **What you will learn**
#
# - what a LoRA layer computes, and why the adapted model starts out identical to the base model;
# - how many parameters LoRA trains: $r\,(d_\text{in} + d_\text{out})$ per adapted layer, checked;
# - how `peft`'s `LoraConfig`, `merge_and_unload`, rank-stabilised scaling and [adapter](https://gpu-efficient-training.github.io/book/book/glossary.html#adapter) checkpoints relate to the
#   hand-written layer;
# - the peak memory and step time of full fine-tuning, LoRA and QLoRA on the 1.3B model, as a breakdown, and
#   which of them fit a T4; what the 4-bit base and the 8-bit optimizer each contribute;
# - what the LoRA rank costs, and whether LoRA and QLoRA learn as well as full fine-tuning on a learnable task;
# - the headline numbers of both papers, recomputed from byte counts.
#
# **Prerequisites:** [chapter 1](https://gpu-efficient-training.github.io/book/notebooks/01_memory_anatomy.html) (memory components) and
# [chapter 5](https://gpu-efficient-training.github.io/book/notebooks/05_mixed_precision_optimizers.html) ([mixed precision](https://gpu-efficient-training.github.io/book/book/glossary.html#mixed-precision), 8-bit and paged optimizers). Chapter 2 explains
# block-wise quantization and the [NF4](https://gpu-efficient-training.github.io/book/book/glossary.html#nf4) format that QLoRA uses; [chapter 8](https://gpu-efficient-training.github.io/book/notebooks/08_profiling.html) the timing method.
# Every sentence that quotes a number is computed from this notebook's own run, on the machine named in the first
# output below. On a CPU this notebook runs a tiny GPT-NeoX and skips the GPU-only measurements, saying so; on a
# GPU without bf16 [tensor cores](https://gpu-efficient-training.github.io/book/book/glossary.html#tensor-cores) (compute capability below 8.0, such as Colab's T4) the 16-bit parts run in fp16.

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
import textwrap
import time
import warnings
from pathlib import Path

import matplotlib.pyplot as plt
import matplotlib.ticker as mticker
import pandas as pd
import torch
from torch import nn
from transformers.utils import logging as hf_logging

from helpers import accounting, cleanup, data, estimates, gpus, measure, models, plots, run_profile
from helpers.measure import GIB, MIB

hf_logging.disable_progress_bar()  # from_pretrained and save_pretrained draw no progress bars
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")  # a deprecation between libraries
prof = env.start()  # plot style, number format, run profile; the table below names hardware and versions
dev = prof.device
nvml_before_cuda = measure.nvml_used_mib() if prof.on_gpu else None  # section 6.3 needs the CUDA context's size

# %% [markdown]
# The first cell that touches the GPU notes what PyTorch has allocated before any experiment, so that the last
# cell can check that the chapter gave everything back, and picks the 16-bit type: bf16 where the GPU's tensor cores
# support it (compute capability 8.0 and newer, and on a CPU), fp16 on older GPUs such as the T4.

# %%
from IPython.display import Markdown, display

from helpers import prose, steps, timing

cap = gpus.capability()  # None on a CPU
AMP = gpus.amp_dtype()
AMP_NAME = {torch.bfloat16: "bf16", torch.float16: "fp16"}[AMP]
baseline_mib = torch.cuda.memory_allocated() / MIB if prof.on_gpu else 0.0
if cap is not None:
    print(f"{cap.name}: compute capability {cap.major}.{cap.minor}; the base models and autocast use {AMP_NAME}")
else:
    print(f"CPU run: a tiny GPT-NeoX; the base models and autocast use {AMP_NAME}")


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
# model computes until the first update. Hu et al. chose the factor $\alpha / r$ so that changing $r$ needs little
# retuning of $\alpha$. [Kalajdzievski (2023)](https://gpu-efficient-training.github.io/book/book/references.html) showed that it overcorrects: with
# $\alpha / r$ the updates shrink as $r$ grows, and learning at large ranks slows down until a larger rank brings
# no gain. His *rank-stabilised* LoRA (rsLoRA) scales by $\alpha / \sqrt{r}$ instead, which keeps the updates'
# size independent of the rank; peft offers it as `LoraConfig(use_rslora=True)` (section 6.2 checks the factor).
# Dropout on the adapter's input regularises it. The layer, written out, with the adapter in fp32 whatever the base's dtype (trainable weights stay in fp32, the
# rule of mixed precision):

# %%
class LoRALinear(nn.Module):
    """A frozen nn.Linear plus a trainable low-rank update: base(x) + (alpha / r) * B(A(dropout(x)))."""

    def __init__(self, base: nn.Linear, r: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_A = nn.Linear(base.in_features, r, bias=False, device=base.weight.device, dtype=torch.float32)
        self.lora_B = nn.Linear(r, base.out_features, bias=False, device=base.weight.device, dtype=torch.float32)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # as nn.Linear's default, peft and the paper's
        # reference code (the paper's text says Gaussian)
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
# The model is the polyglot-ko-1.3b-shaped GPT-NeoX of chapter 1, in bf16 (fp16 on a GPU without bf16). Before we change it, we save it as a
# local checkpoint (section 6.3 loads it back in 4 bits, and 6.2 compares checkpoint sizes). In each of its 24
# layers, attention has two projections: `query_key_value` ($d \to 3d$, the three projections fused) and `dense`
# ($d \to d$, the output). We adapt both with $r = 8$, $\alpha = 16$.

# %%
R, ALPHA, DROPOUT, TARGETS = 8, 16, 0.05, ("query_key_value", "dense")
lm_seq, lm_batch = prof.pick(tiny=16, full=256), 4  # tiny: a CPU without bf16 instructions is slow at bf16
ds_lm = data.markov_lm_dataset(lm_batch * 100, lm_seq, seed=0)
check = {k: v.to(dev) for k, v in ds_lm[:2].items()}

model = models.build("polyglot-ko-1.3b", head="causal-lm", dtype=AMP, seed=0).eval()
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
lora_counts

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (6.1 LoRA by hand)
display(Markdown(
    f"Both assertions passed: the adapted model's logits equal the base model's bit for bit, and the trainable count "
    f"is exactly r (d_in + d_out) summed over the {len(adapted)} adapted layers, "
    f"{n_layers} · r · 6d here: {trainable:,} parameters, {100 * trainable / n_base:.2f}% of the "
    f"{n_base / 1e9:.2f} billion. One training step shows what moves:"
))

# %%
w_before = adapted[0].base.weight.detach().clone()
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
model.train()
with torch.autocast(dev, dtype=AMP):
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
# **$\alpha / r$ or $\alpha / \sqrt{r}$.** peft stores each adapted layer's factor in `scaling`. With the default
# configuration it is $\alpha / r$, as in `LoRALinear`; with `use_rslora=True` it is rsLoRA's $\alpha / \sqrt{r}$.
# On a small model (the factor does not depend on the model's size), for three ranks at $\alpha = 16$:

# %%
# NBVAL_CHECK_OUTPUT
# (scaling factors of a configuration: identical on every machine; printed as text)
rs_rows = {}
for r in (8, 64, 256):
    row = {}
    for name, rslora in (("LoRA: alpha / r", False), ("rsLoRA: alpha / sqrt(r)", True)):
        small = models.build("polyglot-ko-1.3b", profile="tiny", head="causal-lm", device="cpu")
        cfg_r = LoraConfig(r=r, lora_alpha=ALPHA, target_modules=["dense"], use_rslora=rslora, task_type="CAUSAL_LM")
        layer = next(m for m in get_peft_model(small, cfg_r).modules() if isinstance(m, LoraLayer))
        row[name] = layer.scaling["default"]
    assert math.isclose(row["LoRA: alpha / r"], ALPHA / r) and math.isclose(row["rsLoRA: alpha / sqrt(r)"], ALPHA / math.sqrt(r))
    rs_rows[r] = row
rs_table = pd.DataFrame(rs_rows).T.rename_axis("r")
print(rs_table.round(3).to_string())
freed = cleanup.free(globals(), "small", "layer")

# %% [markdown]
# At $r = 256$ the default factor is 0.06 and rsLoRA's 1.0: sixteen times apart. Both train the same parameters
# and cost the same memory; what differs is how far a step of the optimizer moves the adapted layer. With $\alpha/r$,
# a sweep of the *loss* over ranks at one learning rate compares ranks whose effective learning rates differ by the
# ratio of the ranks' square roots, so it says little about what a larger rank could learn at its best learning
# rate. (Section 6.3's rank sweep measures memory and time, which the factor does not change.)

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

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (6.2 The same with peft)
display(Markdown(
    f"The merged model agrees with the adapter model to {merge_diff:.1e} in the logits, fp32 rounding of a different "
    f"order of operations, while the adapters themselves changed the logits by up to {moved:.2f}: the check would "
    f"notice a wrong merge. On disk:"
))

# %%
def dir_bytes(path):
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


sizes = pd.Series({
    f"full checkpoint, {AMP_NAME} (MiB)": dir_bytes(ckpt_dir) / MIB,
    "LoRA adapter, fp32 (MiB)": dir_bytes(adapter_dir) / MIB,
    "adapter weights by formula: 4 bytes x trainable (MiB)": 4 * trainable / MIB,
})
sizes["full / adapter"] = sizes.iloc[0] / sizes.iloc[1]
sizes

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (6.2 The same with peft)
display(Markdown(
    f"The adapter is {sizes.iloc[1]:.1f} MiB (its fp32 weights, a JSON config and a short README) against "
    f"{sizes.iloc[0]:,.0f} MiB for the full model in {AMP_NAME}, {sizes.iloc[3]:,.0f} times smaller. One base model "
    f"can serve many tasks, each a small adapter loaded on top (`PeftModel.from_pretrained`)."
))

# %%
freed = cleanup.free(globals(), "model", "peft_model", "merged", "peft_layer", "ours", "x",
                     "logits_base", "logits_peft", "logits_adapter", "logits_merged")
if prof.on_gpu:
    print(f"freed {freed.allocated_freed_mib:,.0f} MiB; allocated now {freed.allocated_after_mib:,.0f} MiB")

# %% [markdown]
# ## 6.3 Memory and speed: full fine-tuning, LoRA, QLoRA
#
# Five ways to train the 1.3B model, each for a few steps at batch 4 and 256 tokens (the setting of the Korean LLM
# book's chapter 5):
#
# - **full fine-tuning, fp32**: every parameter trains, fp32 weights, AdamW (`fused=True`, the Trainer's default);
# - **full fine-tuning, [autocast](https://gpu-efficient-training.github.io/book/book/glossary.html#autocast)**: the same with mixed precision (chapter 5);
# - **LoRA**: the base in bf16 (fp16 without bf16 tensor cores), frozen; fp32 adapters with $r = 8$ on every linear
#   layer of the 24 blocks (the two attention projections and the MLP's `dense_h_to_4h` and `dense_4h_to_h`), AdamW;
#   autocast;
# - **LoRA with the 8-bit optimizer**: the same, with the paged 8-bit AdamW of bitsandbytes, the optimizer our
#   QLoRA configuration uses (the QLoRA paper's own runs used its paged AdamW with 32-bit states, section 6.5);
# - **QLoRA**: the base loaded from the local checkpoint in 4-bit NF4 with [double quantization](https://gpu-efficient-training.github.io/book/book/glossary.html#double-quantization) through
#   `BitsAndBytesConfig`, prepared with peft's `prepare_model_for_kbit_training`, the same adapters and the same
#   paged 8-bit AdamW; autocast.
#
# QLoRA differs from LoRA in two things, the 4-bit base and the 8-bit optimizer. The middle configuration changes
# one at a time: against LoRA, only the optimizer; against QLoRA, only the base.
#
# Sections 6.1 and 6.2 adapted attention only, as the LoRA paper did for GPT-3. Here the adapters go on every linear
# layer, as in the QLoRA paper, which found that adapting all of them is what it takes to match full fine-tuning
# ([Dettmers et al. (2023)](https://gpu-efficient-training.github.io/book/book/references.html)). Per block that is $r(4d + 2d + 5d + 5d) = 16rd$ trainable
# parameters.
#
# `prepare_model_for_kbit_training` freezes the base and casts the parameters that are not quantized (embeddings,
# LM head, layer norms) to fp32 for stability; by default it also turns on [gradient checkpointing](https://gpu-efficient-training.github.io/book/book/glossary.html#gradient-checkpointing), which we switch off
# here so that the runs keep the same [activations](https://gpu-efficient-training.github.io/book/book/glossary.html#activations) (chapter 4 measures checkpointing). Model states follow from byte
# counts: full fine-tuning in fp32 keeps 16 bytes per parameter, which no T4 can hold for this model. On a larger GPU
# we first **emulate a T4**, as chapter 1 does: `measure.t4_budget` computes the T4's 14.75 GiB minus this process's
# [CUDA context](https://gpu-efficient-training.github.io/book/book/glossary.html#cuda-context), and `measure.gpu_budget` caps PyTorch's allocator there. A run that runs out of memory there is
# repeated on the whole GPU, and its numbers are labelled as such; on a real T4 it stays out of memory, and the rest
# of the chapter shows it as such.

# %%
import bitsandbytes as bnb
from peft import prepare_model_for_kbit_training
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

LR_FULL, LR_LORA = 1e-4, 1e-3
ALL_LINEAR = ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h")  # every linear layer of the blocks
PAGING_MIN_VALUES = 100_000  # bitsandbytes (Optimizer8bit.get_state_buffer) pages only tensors this large or larger
paged_ok = run_profile.cuda_or_skip("paged optimizers need CUDA unified memory; the 8-bit runs use the non-paged AdamW8bit")
Optim8bit = bnb.optim.PagedAdamW8bit if paged_ok else bnb.optim.AdamW8bit
print(f"16 bytes per parameter of model states for full fine-tuning: {16 * n_base / GIB:.1f} GiB")


def full_finetuning(half):
    model = models.build("polyglot-ko-1.3b", head="causal-lm", dtype=torch.float32, seed=0)
    return model, torch.optim.AdamW(model.parameters(), lr=LR_FULL, fused=True), half


def lora(r=R, eight_bit=False):
    model = models.build("polyglot-ko-1.3b", head="causal-lm", dtype=AMP, seed=0)
    model = get_peft_model(model, lora_config(r, ALL_LINEAR))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = Optim8bit(params, lr=LR_LORA) if eight_bit else torch.optim.AdamW(params, lr=LR_LORA, fused=True)
    return model, optimizer, AMP


def qlora():
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=AMP)
    model = AutoModelForCausalLM.from_pretrained(ckpt_dir, quantization_config=quant, dtype=AMP,
                                                 device_map=dev, attn_implementation="sdpa")
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    model = get_peft_model(model, lora_config(R, ALL_LINEAR))
    params = [p for p in model.parameters() if p.requires_grad]
    return model, Optim8bit(params, lr=LR_LORA), AMP


# %% [markdown]
# One function trains any of them: it builds the model and optimizer, runs the steps, and records the model states
# by accounting (all weights and the trainable ones, gradients after `backward()`, [optimizer states](https://gpu-efficient-training.github.io/book/book/glossary.html#optimizer-states) after `step()`),
# the bytes saved for backward in step 2 (`SavedTensorMeter`) and the autocast weight copies among them, the peak
# allocated memory over the whole run, the loss of every step, and how many of the optimizer's state tensors bitsandbytes paged. After training, `time_it` times
# ten more steps on one batch (after three warm-up steps; on a CPU, three after one), with the [GPU-busy](https://gpu-efficient-training.github.io/book/book/glossary.html#gpu-busy) fraction. An out-of-memory error is
# caught and reported with the phase it happened in.

# %%
def run(build, steps, busy=True):
    """Build a model and optimizer, train `steps` steps; model states, activations, timing, peak, losses."""
    where = "loading the model"
    losses, rec, timed = [], {}, None
    start = time.perf_counter()
    try:
        measure.reset_peak(dev)
        model, optimizer, half = build()
        scaler = torch.amp.GradScaler(dev, enabled=half == torch.float16)  # fp16 (a T4) needs loss scaling
        base_lrs = [g["lr"] for g in optimizer.param_groups]
        model.train()

        def step(batch, meter=None):
            with meter or contextlib.nullcontext(), torch.autocast(dev, dtype=half, enabled=half is not None):
                loss = model(**batch).loss
            scaler.scale(loss).backward()
            grads = accounting.grad_bytes(model) if meter is not None else None  # step 2 only: not in timed steps
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            return loss, grads

        for i, batch in enumerate(itertools.islice(data.batches(ds_lm, lm_batch, seed=0), steps)):
            where = f"step {i + 1}"
            batch = {k: v.to(dev) for k, v in batch.items()}
            for group, lr in zip(optimizer.param_groups, base_lrs):  # linear warm-up over 10 steps
                group["lr"] = lr * min(1.0, (i + 1) / 10)
            meter = accounting.SavedTensorMeter(model) if i == 1 else None  # step 2 only
            loss, grads = step(batch, meter)
            if i == 1:
                rec |= {"gradients": grads, "activations": meter.total_bytes}
            losses.append(loss.item())
        # The 16-bit weight copies autocast keeps for backward (chapter 5): saved bytes of an 8-token input, whose
        # own activations are negligible; zero without autocast, and small where the base is already 16-bit.
        with accounting.SavedTensorMeter(model) as copies, torch.autocast(dev, dtype=half, enabled=half is not None):
            model(**{k: v[:1, :8] for k, v in batch.items()})
        rec["weight copies"] = copies.total_bytes
        states = [t for st in accounting.inner_optimizer(optimizer).state.values() for t in st.values()
                  if torch.is_tensor(t)]
        rec |= {"weights": accounting.param_bytes(model),
                "trainable weights": accounting.param_bytes(model, trainable_only=True),
                "optimizer states": accounting.optimizer_state_bytes(optimizer),
                "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
                "largest trainable tensor": max(p.numel() for p in model.parameters() if p.requires_grad),
                "paged": sum(bool(getattr(t, "is_paged", False)) for t in states), "state tensors": len(states)}
        if prof.on_gpu:
            rec["peak"] = measure.allocator_mib()["peak_allocated_mib"] * MIB / GIB
        where = "timing"
        timed = timing.time_it(lambda: step(batch), device=dev, busy=busy,
                               warmup=prof.pick(tiny=1, full=3), repeat=prof.pick(tiny=3, full=10))
    except torch.OutOfMemoryError:
        return {"result": f"out of memory ({where})"}, losses, None
    row = {"result": "ok", "trainable parameters": rec["trainable"],
           **{part: rec[part] / GIB for part in ("weights", "trainable weights", "gradients", "optimizer states",
                                                 "activations", "weight copies")},
           "step (ms)": 1e3 * timed.wall.median, "step IQR (ms)": 1e3 * timed.wall.iqr,
           "tokens/s": lm_batch * lm_seq / timed.wall.median, "GPU busy": timed.gpu_busy, "verdict": timed.verdict,
           "paged state tensors": f"{rec['paged']} of {rec['state tensors']}",
           "largest trainable tensor": rec["largest trainable tensor"], "run (s)": time.perf_counter() - start}
    if prof.on_gpu:
        row["peak allocated"] = rec["peak"]
    return row, losses, timed


# %% [markdown]
# The five runs. Full fine-tuning in fp32 runs 4 steps; the others run a longer curve, and section 6.4 uses their
# loss curves. Memory columns are in GiB.

# %%
curve_steps = prof.pick(tiny=10, full=100)
budget = None
if run_profile.cuda_or_skip("emulating the T4's memory needs a GPU; on a CPU the runs are not capped"):
    cleanup.free(globals())
    budget = measure.t4_budget(nvml_before_cuda)
    print(budget.describe())

FT32, FTMIX = "full fine-tuning (fp32)", f"full fine-tuning ({AMP_NAME} autocast)"
LORA = f"LoRA r={R} ({AMP_NAME} base)"
LORA8 = f"LoRA r={R} ({AMP_NAME} base + 8-bit AdamW)"
QLORA = f"QLoRA r={R} (NF4 base + 8-bit AdamW)"
CONFIGS = {
    FT32: (lambda: full_finetuning(None), 4),
    FTMIX: (lambda: full_finetuning(AMP), curve_steps),
    LORA: (lora, curve_steps),
    LORA8: (lambda: lora(eight_bit=True), curve_steps),
    QLORA: (qlora, curve_steps),
}
results, curves, timings = {}, {}, {}
for name, (build, n_steps) in CONFIGS.items():
    if budget is not None:
        with measure.gpu_budget(budget.budget_gib):
            row, losses, timed = run(build, n_steps)
        on_t4 = row["result"]
        if on_t4 != "ok":  # it does not fit a T4: measure it on the whole GPU, and say so
            cleanup.free(globals())
            row, losses, timed = run(build, n_steps)
        row = {"emulated T4": on_t4, "measured on": "T4 budget" if on_t4 == "ok" else "whole GPU", **row}
    else:
        row, losses, timed = run(build, n_steps)
    results[name], curves[name] = row, losses
    if timed is not None:
        timings[name] = timed
    cleanup.free(globals())
    if prof.on_gpu:
        print(f"{name}: '{row['emulated T4']}' on the T4 budget, '{row['result']}' as measured; allocated afterwards "
              f"{torch.cuda.memory_allocated() / MIB:,.0f} MiB")
ft = pd.DataFrame(results).T
ok_rows = ft[ft["result"] == "ok"].index
ft.drop(columns=["run (s)"])

# %%
short = {FT32: "full FT\nfp32", FTMIX: f"full FT\n{AMP_NAME} autocast", LORA: f"LoRA\n{AMP_NAME} base",
         LORA8: f"LoRA\n{AMP_NAME} base\n8-bit AdamW", QLORA: "QLoRA\nNF4 base\n8-bit AdamW"}
parts = ["frozen weights", "trainable weights", "gradients", "optimizer states", "activations & temporaries"]
breakdown = pd.DataFrame(0.0, index=ft.index, columns=parts)
for n in ok_rows:
    r = ft.loc[n]
    breakdown.loc[n, ["trainable weights", "gradients", "optimizer states"]] = [
        float(r["trainable weights"]), float(r["gradients"]), float(r["optimizer states"])]
    breakdown.loc[n, "frozen weights"] = float(r["weights"]) - float(r["trainable weights"])
    if prof.on_gpu:  # the bar is the measured peak; what the model states do not explain is activations and temporaries
        breakdown.loc[n, "activations & temporaries"] = max(0.0, float(r["peak allocated"]) - breakdown.loc[n].sum())
    else:  # no allocator: the accounted parts, with the bytes saved for backward
        breakdown.loc[n, "activations & temporaries"] = float(r["activations"])
fits = [n for n in ok_rows if ft.loc[n].get("emulated T4", "ok") == "ok"]
what = "peak allocated memory" if prof.on_gpu else "accounted memory"
title = (f"1.3B GPT-NeoX, batch {lm_batch} x {lm_seq}: {what}; "
         + (f"{len(fits)} of {len(ft)} fit the T4 budget" if budget is not None else "no T4 budget on a CPU"))
fig = plots.stacked_bar(breakdown, title=title, ylabel="memory (GiB)",
                        colors={"frozen weights": "#8C8C8C", "trainable weights": "#4C72B0",
                                "activations & temporaries": "#C44E52"})
ax = fig.axes[0]
labels = []
for i, n in enumerate(ft.index):
    label = short[n]
    if n not in ok_rows:  # out of memory even on the whole GPU: a marker, not a missing bar
        ax.plot(i, 0.3, "x", color="black", ms=12, mew=3)
        ax.annotate("out of\nmemory", (i, 0.6), ha="center", va="bottom", fontsize=8)
    elif budget is not None and ft.loc[n, "measured on"] != "T4 budget":
        label += " *"
    labels.append(label)
ax.set_xticks(range(len(ft.index)), labels, rotation=0, ha="center", fontsize=8)
if budget is not None:
    ax.axhline(budget.budget_gib, color="grey", linestyle="--", label="emulated T4 budget")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    if any(label.endswith(" *") for label in labels):
        ax.set_xlabel("* does not fit the T4 budget: measured on the whole GPU")
fig.set_size_inches(10, 4.5)
fig.tight_layout()

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title A number of the table with its unit, or "out of memory" where the run ran out of memory
n_embed = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)


def gib(name, col, fmt=".2f", unit=" GiB"):
    """A number of the table with its unit, or "out of memory" where the run ran out of memory."""
    return f"{format(float(ft.loc[name, col]), fmt)}{unit}" if name in ok_rows else "out of memory"


def mib(name, col):
    return f"{float(ft.loc[name, col]) * GIB / MIB:,.1f} MiB" if name in ok_rows else "out of memory"


def listing(items):
    """'a', 'a and b', 'a, b and c' (the items contain no commas)."""
    items = list(items)
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


if prof.on_gpu:
    failed_t4 = [n for n in ft.index if ft.loc[n, "emulated T4"] != "ok"]
    fit_t4 = [n for n in ft.index if ft.loc[n, "emulated T4"] == "ok"]
    text = (f"Under the emulated T4 ({budget.budget_gib:.2f} GiB for tensors), "
            + (f"{listing(failed_t4)} failed" if failed_t4 else "every configuration fit")
            + (f"; {listing(fit_t4)} fit" if failed_t4 and fit_t4 else "") + ". ")
    big = [n for n in failed_t4 if n in ok_rows]
    if big:
        text += ("On the whole GPU (the bars marked *, numbers from this larger GPU, not from a T4) the peaks were "
                 + listing(f"{gib(n, 'peak allocated', '.1f')} for {n}" for n in big) + ". ")
    oom = [n for n in ft.index if n not in ok_rows]
    if oom:
        oom_txt = listing(oom)
        text += f"{oom_txt[0].upper() + oom_txt[1:]} ran out of memory on this GPU even without the cap. "
    others = [n for n in ok_rows if n not in big]
    if others:
        text += ("Peaks of the others: " + listing(f"{gib(n, 'peak allocated')} for {n}" for n in others) + ".")
    if FTMIX in ok_rows:
        states = sum(float(ft.loc[FTMIX, c]) for c in ("weights", "gradients", "optimizer states"))
        rest = float(ft.loc[FTMIX, "peak allocated"]) - states
        if rest < 0.5 * float(ft.loc[FTMIX, "activations"]):
            text += (f" Full fine-tuning's peak ({gib(FTMIX, 'peak allocated')}) is hardly more than its model states "
                     f"({states:.2f} GiB): they all exist at once only after backward has produced every gradient, "
                     f"by which time the {gib(FTMIX, 'activations')} saved for backward have been freed, so its red "
                     f"slice is thin.")
            if LORA in ok_rows:
                lora_rest = float(ft.loc[LORA, "peak allocated"]) - sum(
                    float(ft.loc[LORA, c]) for c in ("weights", "gradients", "optimizer states"))
                if lora_rest >= 0.8 * float(ft.loc[LORA, "activations"]):
                    text += (f" LoRA's peak exceeds its model states by {lora_rest:.2f} GiB, against "
                             f"{gib(LORA, 'activations')} saved for backward: it comes while the activations are "
                             f"still held.")
            if FT32 in ok_rows:
                text += (f" Autocast does not lower the peak ({gib(FT32, 'peak allocated')} in fp32): the fp32 "
                         f"master weights, gradients and AdamW states are the same 16 bytes per parameter.")
    display(Markdown(text))
else:
    print("skipped on CPU: peaks and the T4 budget need a GPU (the figure shows the accounted parts)")

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (6.3 Memory and speed)
lines = []
if LORA in ok_rows and QLORA in ok_rows:
    nf4_bits = 8 * (float(ft.loc[QLORA, "weights"]) - float(ft.loc[QLORA, "trainable weights"])) * GIB / n_base
    lines.append(
        f"- **Weights.** {gib(LORA, 'weights')} for LoRA's {AMP_NAME} base and adapters, {gib(QLORA, 'weights')} "
        f"for QLoRA's: the frozen part of QLoRA's is {nf4_bits:.1f} bits per parameter on average, not 4. The "
        f"embeddings and the LM head ({100 * n_embed / n_base:.0f}% of this model's parameters: its vocabulary is "
        f"large for its size) are not quantized, and `prepare_model_for_kbit_training` casts them to fp32.")
    lines.append(
        f"- **Gradients and optimizer states** nearly vanish: only the {int(ft.loc[LORA, 'trainable parameters']):,} "
        f"adapter parameters have them. AdamW's states for LoRA take {mib(LORA, 'optimizer states')}, the 8-bit "
        f"states {mib(LORA8, 'optimizer states')} with the {AMP_NAME} base and {mib(QLORA, 'optimizer states')} "
        f"with QLoRA's.")
    lines.append(
        "- **Activations** do not go away: the backward pass still runs through every frozen layer to reach the "
        "adapters below it, and the inputs of the adapted layers are saved. The bytes saved for backward were "
        + (f"{gib(FTMIX, 'activations')} for full fine-tuning with autocast, " if FTMIX in ok_rows else "")
        + f"{gib(LORA, 'activations')} for LoRA and {gib(QLORA, 'activations')} for QLoRA (whose fp32 embeddings "
        f"and layer norms, left by `prepare_model_for_kbit_training`, put part of the residual stream in fp32). At "
        f"long sequences the activations dominate, which is why QLoRA is usually combined with gradient "
        f"checkpointing (chapter 4).")
    if FTMIX in ok_rows:
        ft_acts = float(ft.loc[FTMIX, "activations"]) - float(ft.loc[FTMIX, "weight copies"])
        lora_acts = float(ft.loc[LORA, "activations"]) - float(ft.loc[LORA, "weight copies"])
        lines.append(
            f"  Full fine-tuning's figure is not activations alone: autocast keeps a 16-bit copy of every weight it "
            f"casts until the backward pass (chapter 5), {gib(FTMIX, 'weight copies')} here (the bytes an "
            f"8-token forward pass saves). Without them full fine-tuning saved {ft_acts:.2f} GiB, against "
            f"{lora_acts:.2f} GiB for LoRA, whose base is already 16-bit ({mib(LORA, 'weight copies')} of copies) "
            + ("but whose adapters save tensors of their own, such as the dropped-out inputs of the adapter products."
               if lora_acts > ft_acts else "and whose adapters add only a little to what the frozen layers save."))
    if prof.on_gpu and LORA8 in ok_rows:
        d_opt = float(ft.loc[LORA, "peak allocated"]) - float(ft.loc[LORA8, "peak allocated"])
        d_base = float(ft.loc[LORA8, "peak allocated"]) - float(ft.loc[QLORA, "peak allocated"])
        lines.append(
            f"- **One variable at a time.** Replacing AdamW by the 8-bit optimizer (LoRA against LoRA with 8-bit "
            f"AdamW) lowered the peak by {d_opt * GIB / MIB:,.0f} MiB; replacing the {AMP_NAME} base by the 4-bit one "
            f"(LoRA with 8-bit AdamW against QLoRA) by {d_base * GIB / MIB:,.0f} MiB. "
            + ("Nearly all of QLoRA's saving is the 4-bit base: the adapters' optimizer states were small to begin with."
               if abs(d_opt) < 0.1 * abs(d_base) else "Both changes matter here."))
        d_w = float(ft.loc[LORA8, "weights"]) - float(ft.loc[QLORA, "weights"])
        d_act = float(ft.loc[QLORA, "activations"]) - float(ft.loc[LORA8, "activations"])
        d_copies = float(ft.loc[QLORA, "weight copies"]) - float(ft.loc[LORA8, "weight copies"])
        if d_w > d_base and d_act > 0:
            lines[-1] += (
                f" The weights alone fell by {d_w * GIB / MIB:,.0f} MiB; the peak fell less because QLoRA's step "
                f"saved {d_act * GIB / MIB:,.0f} MiB more for backward, from the layers "
                f"`prepare_model_for_kbit_training` left in fp32"
                + (f" ({d_copies * GIB / MIB:,.0f} MiB of it autocast's 16-bit copies of their weights)."
                   if d_copies > 0 else "."))
    largest = int(ft.loc[QLORA, "largest trainable tensor"])
    paged = ft.loc[QLORA, "paged state tensors"]
    if not paged_ok:
        lines.append("- **Paging** is skipped on a CPU: the 8-bit runs used the non-paged optimizer.")
    elif paged.startswith("0 of"):
        paged_peak = max(float(ft.loc[n, "peak allocated"]) for n in (LORA8, QLORA) if n in ok_rows)
        card_gib = float(env.gpu_info()["memory_gib"])  # NVML's total, the number the environment table gives
        lines.append(
            f"- **Paging.** The paged 8-bit AdamW paged nothing here ({paged} state tensors, block scales and "
            f"quantization maps included): bitsandbytes allocates a state in unified memory only for a tensor of at "
            f"least {PAGING_MIN_VALUES:,} values, and the largest adapter matrix has {largest:,} (at "
            f"r = {math.ceil(PAGING_MIN_VALUES / (4 * h))} and above the {4 * h:,} x r matrices of the MLP would cross "
            f"it). So QLoRA's optimizer behaved as the non-paged `AdamW8bit` (plus one more synchronisation per step). "
            f"Chapter 5's bert-large, whose weight matrices are far larger, shows a paged optimizer's states placed in "
            f"unified memory. Even paged states move to the CPU only when the GPU runs out of memory: the 8-bit runs "
            f"here peaked at {paged_peak:.2f} GiB of the GPU's {card_gib:.1f} GiB, and the T4 emulation could not "
            f"force it either, since its cap applies to PyTorch's allocator, not to unified memory.")
    else:
        lines.append(
            f"- **Paging.** The paged 8-bit AdamW paged {paged} state tensors (those of adapter tensors with at least "
            f"{PAGING_MIN_VALUES:,} values; the largest has {largest:,}); their bytes live in unified memory, outside "
            f"PyTorch's allocator.")
if lines:
    display(Markdown("Where the memory went:\n\n" + "\n".join(lines)))
else:
    print("skipped: LoRA or QLoRA did not run on this machine")

# %% [markdown]
# **Speed.** LoRA skips the weight gradients of the frozen layers (a third of the FLOPs) and nearly all of the
# optimizer's work; QLoRA, in addition, dequantizes every weight from 4 bits, in the forward pass and again in the
# backward pass, and uses bitsandbytes' 8-bit optimizer instead of fused AdamW. Whether any of that shows in the
# step time depends on what limits the step; the middle configuration again separates the two changes.
# The table has `time_it`'s medians, spreads and verdicts from the runs above, with the GPU kernel time beside them.
# The comparisons come from `timing.interleaved` (as in chapter 3), one change at a time, with both configurations
# alive on the whole GPU: LoRA against full fine-tuning with autocast (where that does not fit, as on a real T4, the
# pair is skipped), the 8-bit optimizer against fused AdamW on the same LoRA model, and the 4-bit base against the
# 16-bit one, both with the 8-bit optimizer:

# %%
speed_cols = ["step (ms)", "step IQR (ms)", "tokens/s", "GPU busy", "verdict"]
speed = ft.loc[ok_rows, [c for c in speed_cols if c in ft.columns]].copy()
speed["GPU kernel time (ms)"] = [1e3 * timings[n].kernel_s if n in timings and timings[n].kernel_s is not None
                                 else float("nan") for n in speed.index]
speed["GPU ops per step"] = [timings[n].kernels_per_call if n in timings else None for n in speed.index]
display(speed)

lm_first = {k: v.to(dev) for k, v in next(iter(data.batches(ds_lm, lm_batch, seed=0))).items()}
speed_cmp = {}


def interleave(name_a, a, name_b, b):
    """Two (model, optimizer, autocast dtype) configurations' steps on one batch, in alternating rounds."""
    return timing.interleaved(steps.make_step(a[0], a[1], lm_first, amp=a[2]),
                              steps.make_step(b[0], b[1], lm_first, amp=b[2]), device=dev, names=(name_a, name_b),
                              rounds=prof.pick(tiny=10, full=15), warmup=3, profile_steps=1)


lora_cfg = lora()
try:
    full_cfg = full_finetuning(AMP)
    speed_cmp[(FTMIX, LORA)] = interleave(FTMIX, full_cfg, LORA, lora_cfg)
except torch.OutOfMemoryError:
    print(f"{FTMIX} and {LORA} do not fit this GPU together: that pair is skipped")
cleanup.free(globals(), "full_cfg")
eight_bit = Optim8bit([p for p in lora_cfg[0].parameters() if p.requires_grad], lr=LR_LORA)  # the same adapters
speed_cmp[(LORA, LORA8)] = interleave(LORA, lora_cfg, LORA8, (lora_cfg[0], eight_bit, AMP))
qlora_cfg = qlora()
speed_cmp[(LORA8, QLORA)] = interleave(LORA8, (lora_cfg[0], eight_bit, AMP), QLORA, qlora_cfg)
cleanup.free(globals(), "lora_cfg", "qlora_cfg", "eight_bit", "lm_first")
pd.DataFrame({f"{b} vs {a}": c.row() for (a, b), c in speed_cmp.items()}).T

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title LoRA against full fine-tuning, then one change at a time (8-bit optimizer, 4-bit base)…
def lora_speed_text(cmps, n_layers, tokens):
    """LoRA against full fine-tuning, then one change at a time (8-bit optimizer, 4-bit base), all interleaved."""
    text = ""
    full = next((c for (a, b), c in cmps.items() if b == LORA), None)
    if full is not None:
        lo, ref = full.b, full.a
        text += (f"A LoRA step against a step of {full.a_name}: {full.phrase(what=f'than {full.a_name}')}. The LoRA "
                 f"step kept the GPU busy {lo.gpu_busy:.0%} of the time, its kernels ran for {prose.ms(lo.kernel_s)} of "
                 f"{prose.ms(lo.wall.median)}, and it ran {lo.kernels_per_call:,} GPU operations (*{lo.verdict}*); "
                 f"{full.a_name}: busy {ref.gpu_busy:.0%}, {prose.ms(ref.kernel_s)} of kernels, "
                 f"{ref.kernels_per_call:,} operations (*{ref.verdict}*). ")
        if lo.verdict == "host-bound":
            text += (f"At {tokens:,} tokens per step the LoRA step is host-bound: its time is the CPU's time to issue "
                     f"kernels, about {timing.us_per_launch(lo):.0f} µs per operation on this host, and each of the "
                     f"{4 * n_layers} adapted layers adds kernels of its own (the two adapter products, dropout, casts "
                     f"and the scaling, in the forward and the backward pass). "
                     + ("The FLOPs LoRA saves show in the kernel time, not in the step's; " if lo.kernel_s < ref.kernel_s
                        else "")
                     + "chapter 4 times this model's step at batches from 4 to 32 and shows where it turns GPU-bound. ")
        else:
            text += "The step is not host-bound here, so the FLOPs LoRA saves can show in its time. "
    else:
        text += "Full fine-tuning and LoRA did not fit this GPU together, so there is no full step to compare. "
    opt, base = cmps[(LORA, LORA8)], cmps[(LORA8, QLORA)]
    text += (f"One change at a time. The 8-bit optimizer, against fused AdamW on the same adapters: "
             f"{opt.phrase(what='than fused AdamW')}, with {opt.b.kernels_per_call - opt.a.kernels_per_call:+,} GPU "
             f"operations per step. ")
    if opt.verdict == "slower":
        text += ("bitsandbytes' 8-bit optimizer updates the adapter tensors one at a time, a few launches each, where "
                 "fused AdamW updates them all in a few multi-tensor launches. ")
    extra_wall = base.b.wall.median - base.a.wall.median
    extra_kernel = base.b.kernel_s - base.a.kernel_s
    text += (f"The 4-bit base, against the 16-bit one: {base.phrase(what='than the 16-bit base')}; it adds "
             f"{base.b.kernels_per_call - base.a.kernels_per_call:+,} GPU operations per step (each quantized layer "
             f"dequantizes its weight in the forward pass and again in the backward pass, through bitsandbytes' "
             f"Python code), which raise the GPU's kernel time by {prose.ms(extra_kernel)} and the step's wall time by "
             f"{prose.ms(extra_wall)}. ")
    if base.verdict == "slower" and extra_wall > 0 and extra_kernel < 0.5 * extra_wall:
        text += (f"So {max(extra_wall - extra_kernel, 0) / extra_wall:.0%} of the extra time is not the GPU "
                 f"running the dequantization but the host issuing it: the 4-bit base's cost is host time, and the "
                 f"reader's CPU decides how large it is.")
    elif base.verdict == "slower":
        text += "Most of the extra time is the GPU's: the dequantization kernels themselves."
    return text


if prof.on_gpu:
    display(Markdown(lora_speed_text(speed_cmp, n_layers, lm_batch * lm_seq)))
else:
    print("skipped on CPU: step times and GPU-busy fractions need a GPU")


# %% [markdown]
# **The rank.** How do trainable parameters and memory grow with $r$? LoRA with $r$ from 4 to 256 on the same four
# layers per block, three steps each (and ten timed ones, with the GPU-busy fraction), under the T4 budget. The
# adapter states are the adapters' fp32 weights, gradients and AdamW states and the 16-bit copies of the adapter
# weights that autocast saves for backward (`autocast copies`, also shown on their own); the activations are the
# bytes saved for backward less those copies.

# %%
ranks = prof.pick(tiny=[4, 8, 16, 32], full=[4, 8, 16, 32, 64, 128, 256])
rank_rows, rank_timed = [], {}
for r in ranks:
    with measure.gpu_budget(budget.budget_gib) if budget is not None else contextlib.nullcontext():
        row, _, timed = run(lambda r=r: lora(r), 3)  # with the GPU-busy fraction of each rank
    if timed is not None:
        rank_timed[r] = timed
    if row["result"] == "ok":
        # r (d_in + d_out) per adapted layer: (d + 3d) + (d + d) + (d + 4d) + (4d + d) = 16d per block
        assert row["trainable parameters"] == n_layers * r * 16 * h
    rank_rows.append({"r": r, **row})
    cleanup.free(globals())
rank_sweep = pd.DataFrame(rank_rows).set_index("r")
rank_ok = rank_sweep[rank_sweep["result"] == "ok"].copy()
rank_ok["trainable (M)"] = rank_ok["trainable parameters"].astype(float) / 1e6
rank_ok["frozen base"] = rank_ok["weights"].astype(float) - rank_ok["trainable weights"].astype(float)
rank_ok["adapter states"] = rank_ok[["trainable weights", "gradients", "optimizer states"]].astype(float).sum(axis=1)
rank_ok["autocast copies"] = rank_ok["weight copies"].astype(float)
rank_ok["activations"] = rank_ok["activations"].astype(float) - rank_ok["autocast copies"]
rank_ok["adapter states"] = rank_ok["adapter states"] + rank_ok["autocast copies"]
rank_cols = ["trainable (M)", "frozen base", "adapter states", "autocast copies", "activations", "peak allocated",
             "step (ms)", "step IQR (ms)", "GPU busy"]
rank_sweep[["result"]].join(rank_ok[[c for c in rank_cols if c in rank_ok.columns]])

# %%
fig, (ax_p, ax_m) = plt.subplots(1, 2, figsize=(11, 4))
ax_p.plot(rank_ok.index, rank_ok["trainable (M)"], "o-")
ax_p.set_yscale("log", base=2)  # log-log: a proportion is a straight line
ax_p.set_ylabel("trainable parameters (millions)")
ax_p.set_title("trainable parameters: proportional to r", fontsize=10)
series = {"frozen base": ("s-", "#8C8C8C"), "adapter states": ("o-", "#4C72B0"), "activations": ("^-", "#C44E52")}
if prof.on_gpu:
    series["peak allocated"] = ("d--", "black")
legend = {"adapter states": "adapter states (18 B/param)",
          "activations": "activations (saved for backward,\nless weight copies)"}
for col, (style, color) in series.items():
    ax_m.plot(rank_ok.index, rank_ok[col].astype(float), style, color=color, label=legend.get(col, col))
r_top = rank_ok.index[-1] if len(rank_ok) else None
if r_top is not None:
    top_row = rank_ok.loc[r_top]
    bigger = [c for c in ("frozen base", "activations") if top_row["adapter states"] > float(top_row[c])]
    rank_title = (f"memory at {lm_batch} x {lm_seq} tokens: at r = {r_top} the adapter states exceed the "
                  + " and the ".join(bigger) if bigger else
                  f"memory at {lm_batch} x {lm_seq} tokens: the frozen base and the activations dominate")
else:
    rank_title = "memory by rank"
ax_m.set_ylabel("memory (GiB)")
ax_m.set_ylim(bottom=0)
ax_m.set_title(textwrap.fill(rank_title, 40), fontsize=10)  # wrapped: a long title overlaps its neighbour
ax_m.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
for ax in (ax_p, ax_m):
    ax.set_xscale("log", base=2)
    ax.set_xlabel("LoRA rank r")
fig.suptitle("LoRA on every linear layer of the 1.3B model: what the rank costs")
fig.tight_layout()

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title The ranks' step times (separate blocks of steps) and the same configuration timed twice…
def rank_times_text(steps_ms, same, here, r):
    """The ranks' step times (separate blocks of steps) and the same configuration timed twice, as numbers only."""
    order = ("grow with the rank" if steps_ms.is_monotonic_increasing else
             "do not follow the order of the rank")
    gap = abs(here.median - same.median)
    return (f"The step times {order}; each rank was timed as its own block of steps, and blocks can drift apart on a "
            f"host-bound step by more than the IQR of ten consecutive steps shows. The same configuration, r = {r}, "
            f"took {here.median * 1e3:.0f} ms (IQR {here.iqr * 1e3:.1f}) here and {same.median * 1e3:.0f} ms (IQR "
            f"{same.iqr * 1e3:.1f}) in section 6.3's run, {gap / min(here.median, same.median):.0%} apart: a measure "
            f"of that drift, not a cost of the rank. ")


# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (6.3 Memory and speed)
if len(rank_ok) >= 2:
    lo_r, hi_r = rank_ok.index[0], rank_ok.index[-1]
    a, b = rank_ok.loc[lo_r], rank_ok.loc[hi_r]
    text = (f"From r = {lo_r} to {hi_r} the trainable parameters grow from {a['trainable (M)']:.2f} to "
            f"{b['trainable (M)']:.1f} million, in proportion to r. Each trainable parameter costs 18 bytes (fp32 "
            f"weight and gradient, two AdamW states, and the 16-bit copy autocast saves for backward): "
            f"{b['adapter states']:.2f} GiB at r = {hi_r}, against {b['frozen base']:.2f} GiB of frozen base and "
            f"{float(b['activations']):.2f} GiB of activations (the bytes saved for backward less the weight copies, "
            f"{float(a['activations']):.2f} GiB at r = {lo_r}). ")
    if bigger:
        text += (f"So at the largest rank the adapters' states are no longer small: they exceed the "
                 f"{' and the '.join(bigger)} at this batch of {lm_batch * lm_seq:,} tokens (the activations grow "
                 f"with the tokens, the adapter states do not). ")
        small_r = [r for r in rank_ok.index if rank_ok.loc[r, "adapter states"] < 0.1 * rank_ok.loc[r, "frozen base"]]
        if small_r:
            text += f"Up to r = {max(small_r)} they are under a tenth of the frozen base. "
    else:
        text += "Even at the largest rank the adapters' states stay below the frozen base and the activations. "
    if prof.on_gpu:
        text += f"The peak grew from {float(a['peak allocated']):.2f} to {float(b['peak allocated']):.2f} GiB. "
    if prof.on_gpu and R in rank_timed and LORA in timings:
        steps_ms = rank_ok["step (ms)"].astype(float)
        busy = [t.gpu_busy for t in rank_timed.values() if t.gpu_busy is not None]
        verdicts = sorted({t.verdict for t in rank_timed.values()})
        same, here = timings[LORA].wall, rank_timed[R].wall
        text += (f"Step times ranged from {steps_ms.min():.0f} ms (r = {steps_ms.idxmin()}) to {steps_ms.max():.0f} ms "
                 f"(r = {steps_ms.idxmax()}) across the ranks, with IQRs up to "
                 f"{rank_ok['step IQR (ms)'].astype(float).max():.0f} ms")
        if busy:
            busy_range = {f"{min(busy):.0%}", f"{max(busy):.0%}"}
            text += (f" and the GPU busy {min(busy):.0%} to {max(busy):.0%} of the time" if len(busy_range) == 2
                     else f" and the GPU busy {min(busy):.0%} of the time")
        text += f" (verdicts: {listing(verdicts)})"
        text += (": a host-bound step, whose time is set by launching its kernels, whose number the rank does not "
                 "change, only their size. " if verdicts == ["host-bound"] else ". ")
        text += rank_times_text(steps_ms, same, here, R)
    text += ("The LoRA paper found small ranks sufficient for the tasks it studied "
             "([Hu et al. (2022)](https://gpu-efficient-training.github.io/book/book/references.html)), with the α/r scaling that section 6.1 discussed; "
             "with rsLoRA's scaling, larger ranks keep improving the fine-tuned model "
             "([Kalajdzievski (2023)](https://gpu-efficient-training.github.io/book/book/references.html)), and memory, as measured here, then limits the rank.")
    display(Markdown(text))
else:
    print("skipped: fewer than two ranks ran")

# %% [markdown]
# ## 6.4 Does it learn?
#
# The runs of section 6.3 trained on `data.markov_lm_dataset`: sequences from a fixed random chain in which each of
# 64 tokens has 4 equally likely successors, so the best possible loss is $\ln 4 \approx 1.386$ nats per token. The
# same batches in the same order, the same number of steps; learning rates ten times apart, as is usual between the
# two methods (1e-4 for full fine-tuning, 1e-3 for the adapters, both with 10 warm-up steps). Both are about ten
# times the usual values for a pretrained model (exercise 4), because this model starts from random weights. A run
# that ran out of memory has no curve; the table shows it as "—".

# %%
floor = data.markov_loss_floor(4)
assert math.isclose(floor, math.log(4))
learn_names = [n for n, (_, n_steps) in CONFIGS.items() if n_steps == curve_steps]
learn = {n: curves[n] for n in learn_names if len(curves[n]) == curve_steps}
final = pd.Series({n: pd.Series(learn[n][-10:]).mean() if n in learn else float("nan") for n in learn_names},
                  name="loss, last 10 steps (nats)")
fig, ax = plt.subplots(figsize=(9, 4))
for (name, losses), style in zip(learn.items(), ["-", "--", "-.", ":"]):
    ax.plot(range(1, len(losses) + 1), pd.Series(losses).rolling(5, min_periods=1).mean(), style, label=name)
for name in learn_names:
    if name not in learn:  # out of memory: say so in the legend instead of leaving the run out silently
        ax.plot([], [], " ", label=f"{name}: out of memory, no curve")
ax.axhline(floor, color="grey", linestyle=":", label="best possible: ln 4")
ax.set_yscale("log")  # the start near ln(vocabulary) and the tail near ln 4 on one axis
ax.set_ylim(bottom=0.9 * floor)
for axis_formatter in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
    axis_formatter(mticker.FuncFormatter(lambda v, _: f"{v:g}"))  # "2, 3, 4" rather than "2x10^0"
ended = final.dropna()
loss_title = (f"Markov task from random weights, mean of 5 steps: after {curve_steps} steps the runs end within "
              f"{ended.max() - ended.min():.2f} nats of each other, {ended.min() - floor:.2f} or more above ln 4"
              if len(ended) >= 2 else "Markov task from random weights (mean of 5 steps)")
ax.set_title(textwrap.fill(loss_title, 80), fontsize=10)
ax.set_xlabel(f"training step (batch {lm_batch} x {lm_seq} tokens)")
ax.set_ylabel("training loss (nats, log scale)")
ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
fig.tight_layout()
final.map(lambda v: "—" if pd.isna(v) else f"{v:.3f}").to_frame()

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (6.4 Does it learn?)
def loss_txt(name):
    return f"{final[name]:.3f}" if pd.notna(final.get(name, float("nan"))) else "— (out of memory)"


def one_seed_losses(d_opt, d_base):
    """The one-change-at-a-time loss differences (nats) of one seed per configuration, as a sentence."""
    return (f"One change at a time: the 8-bit optimizer moved the final loss by {d_opt:+.3f} nats, the 4-bit base by "
            f"{d_base:+.3f}. One seed per configuration cannot separate differences this small from the "
            "variation between seeds (which the step-to-step noise within one run does not measure; chapter 5 runs "
            "three seeds per recipe for this reason), so this run neither confirms nor contradicts what QLoRA's authors found for NF4 against 16-bit bases and "
            "8-bit against 32-bit optimizer states ([Dettmers et al. (2023)]"
            "(https://gpu-efficient-training.github.io/book/book/references.html)): no loss of quality. ")


text = (f"After {curve_steps} steps the mean loss of the last ten steps was "
        + listing(f"{loss_txt(n)} for {n}" for n in learn_names) + f", against the floor of {floor:.3f}. ")
if all(n in learn for n in (LORA, LORA8, QLORA)):
    d_opt, d_base = final[LORA8] - final[LORA], final[QLORA] - final[LORA8]
    text += one_seed_losses(d_opt, d_base)
    smooth = pd.DataFrame({n: pd.Series(learn[n]).rolling(5, min_periods=1).mean() for n in (LORA, LORA8, QLORA)})
    apart = smooth.max(axis=1) - smooth.min(axis=1)
    if apart.idxmax() + 1 <= curve_steps - 10:
        text += (f"The three curves are furthest apart at step {apart.idxmax() + 1} ({apart.max():.2f} nats apart "
                 f"in the five-step mean), before the last ten steps; a single seed says little about such a difference "
                 f"on the way.")
display(Markdown(text))

# %% [markdown]
# Read the comparison with full fine-tuning with care. The base model here has random weights, so LoRA must solve
# the task through rank-8 changes inside a network that knows nothing, with a frozen random LM head. Fine-tuning in
# practice starts from a pretrained model that already represents most of what the task needs; there the LoRA paper
# finds it on par with full fine-tuning on GPT-3 and RoBERTa ([Hu et al. (2022)](https://gpu-efficient-training.github.io/book/book/references.html)). What this
# experiment does show is the machinery working end to end: gradients reach the adapters through frozen 16-bit and
# 4-bit layers, and the loss falls.

# %%
freed = cleanup.free(globals())
shutil.rmtree("ckpt_ch6", ignore_errors=True)  # the local checkpoint and adapter are no longer needed
if prof.on_gpu:
    print(f"allocated at the end of the experiments: {torch.cuda.memory_allocated() / MIB:,.0f} MiB")

# %% [markdown]
# ## 6.5 The papers' numbers by formula
#
# **LoRA on GPT-3 175B.** [Hu et al. (2022)](https://gpu-efficient-training.github.io/book/book/references.html) report that LoRA cut the GPU memory of training
# GPT-3 175B from 1.2 TB to 350 GB, and the checkpoint from 350 GB to 35 MB, with $r = 4$ on the query and value
# projections of all 96 layers. We build a GPT-3-shaped model on PyTorch's `meta` device (shapes, no memory) to count
# its parameters, count the adapters with the formula, and turn both into bytes with the book's per-parameter rules
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

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (6.5 The papers' numbers by formula)
full8 = state_bytes(n_gpt3, "fp16_adamw")
display(Markdown(
    f"The LoRA side of the paper's claim is pure weight storage: 2 bytes for each of the 175 billion frozen "
    f"parameters make {(state_bytes(n_gpt3, 'half_inference') + state_bytes(n_lora_gpt3, 'mixed_adamw')) / 1e9:.0f} "
    f"GB, and the adapters, even at 18 bytes per trainable parameter, add a fraction of a GB. The checkpoint of "
    f"r = 4 adapters on W_q and W_v is {2 * n_lora_gpt3 / 1e6:.1f} MB in fp16 ({2 * n_lora_gpt3 / MIB:.1f} "
    f"MiB), the paper's \"35 MB\" give or take the units. For full fine-tuning the paper does not say how it "
    f"counted. No per-parameter rule gives exactly 1.2 TB: 8 bytes per parameter (fp16 weights, gradients and both "
    f"Adam states, the LLM book's recipe of chapter 1) gives {full8 / 1e12:.2f} TB, which is {full8 / 2**40:.2f} "
    f"TiB in binary units, the closest reading; fp32 AdamW would need twice that. Either way the ratio, three to "
    f"four times less memory, is the point."
))

# %% [markdown]
# **QLoRA on a 65B model.** [Dettmers et al. (2023)](https://gpu-efficient-training.github.io/book/book/references.html) fine-tune LLaMA-65B on one 48 GB GPU, where 16-bit full
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

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (6.5 The papers' numbers by formula)
q_gb = sum(qlora_bytes.values()) / 1e9
display(Markdown(
    f"16-bit full fine-tuning needs {sum(full16.values()) / 1e9:,.0f} GB of model states, the paper's \"more than "
    f"780 GB\". QLoRA's model states add up to {q_gb:.1f} GB, of which "
    f"{qlora_bytes['base: NF4 linear layers'] / 1e9:.1f} GB is the 4-bit base. That leaves {48 - q_gb:.1f} GB of a "
    f"48 GB card for activations, which is why the paper needs gradient checkpointing, and for the paged optimizer "
    f"to absorb the spikes of long sequences by moving its states to CPU memory. The formula reproduces both claims. "
    f"The embeddings and LM head are {100 * (n_llama - n_quantized) / n_llama:.1f}% of LLaMA-65B's parameters, "
    f"against {100 * n_embed / n_base:.0f}% of this chapter's model, whose measurements in section 6.3 show the same "
    f"structure at small scale, where the unquantized embeddings and the activations weigh more."
))

# %% [markdown]
# ## Summary
#
# The peak memory of one training step of the 1.3B model (batch 4 x 256 tokens), as measured in section 6.3:

# %%
summary_cols = [c for c in ("emulated T4", "measured on", "trainable parameters", "peak allocated", "step (ms)",
                            "verdict") if c in ft.columns]
ft[summary_cols].astype(object).where(ft[summary_cols].notna(), "—")

# %% [markdown]
# - A LoRA layer adds $\frac{\alpha}{r} B A x$ to a frozen $W x$; with $B = 0$ at the start the adapted model is the
#   base model, bit for bit (checked), and it trains $r(d_\text{in} + d_\text{out})$ parameters per adapted layer
#   (checked against the formula and against peft). rsLoRA scales by $\alpha / \sqrt{r}$ instead, so that large
#   ranks are not slowed down.
# - `merge_and_unload` folds the adapters into the weights with the same outputs (checked to fp32 rounding); an
#   adapter checkpoint is a few MiB.
# - Full fine-tuning of the 1.3B model with AdamW does not fit a T4, in fp32 or with autocast: 16 bytes per
#   parameter of model states. LoRA and QLoRA fit: gradients and optimizer states nearly vanish, QLoRA's 4-bit base
#   shrinks the weights (most of its saving over LoRA), and the activations stay.
# - At small ranks the adapters cost little memory; at the largest ranks their states (16 bytes per trainable
#   parameter, 18 with autocast's 16-bit copies) rival the frozen base and, at this chapter's 1,024 tokens per step,
#   the activations.
# - From bytes per parameter alone, LoRA's 350 GB and 35 MB for GPT-3, QLoRA's "more than 780 GB" and its 65B model
#   on a 48 GB card follow; the paper's 1.2 TB for full fine-tuning of GPT-3 is matched only approximately, and only
#   by an unrealistic count: 8 bytes per parameter (fp16 weights, gradients and Adam states with no fp32 master copy,
#   the recipe that chapter 1 showed breaks training) give 1.27 TiB, while mixed-precision Adam's 16 bytes give twice
#   that.

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (Summary)
if prof.on_gpu:
    peaks = "; ".join(f"{n}: {gib(n, 'peak allocated')}" for n in ft.index)
    display(Markdown(f"In this run: {trainable:,} trainable parameters in section 6.1 ({100 * trainable / n_base:.2f}% "
                     f"of the model), an adapter checkpoint {sizes.iloc[3]:,.0f} times smaller than the model's, "
                     f"and these peaks: {peaks}."))
else:
    print("skipped on CPU: the peaks need a GPU")

# %% [markdown]
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
#                            bnb_4bit_compute_dtype=torch.bfloat16)   # torch.float16 on a T4
# model = AutoModelForCausalLM.from_pretrained(checkpoint_dir, quantization_config=qlora)  # omit for LoRA
# model = prepare_model_for_kbit_training(model)   # QLoRA only; turns on gradient checkpointing by default
# config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules="all-linear",  # every linear layer
#                     task_type="CAUSAL_LM")   # but the output head, as in section 6.3; use_rslora=True: alpha / sqrt(r)
# # all-linear on GPT-NeoX = ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"]
# model = get_peft_model(model, config)
# model.print_trainable_parameters()
# ```
#
# ## Exercises
#
# Each exercise has a hint and an answer (or the range to expect) behind a click. Where an exercise asks for a
# number, the line under it checks yours without giving the answer away (it says right, close, or what to look at).
#
# 1. Add the MLP's `dense_h_to_4h` and `dense_4h_to_h` to `TARGETS` in section 6.1 and change the assertion to
#    $16\,r\,d$ per block, the count of section 6.3. Does the step-0 identity still hold? And how many trainable
#    parameters do the adapters of the whole 1.3B model then have ($r = 8$, $d = 2048$, 24 blocks)?
#    `from helpers import exercises; exercises.check("6.1", your_count)` (another rank: add `r=16`)
#
#    <details><summary>Hint</summary>
#
#    Per block: `query_key_value` maps $d \to 3d$, `dense` $d \to d$, `dense_h_to_4h` $d \to 4d$, `dense_4h_to_h` $4d \to d$; each adds $r\,(d_\text{in} + d_\text{out})$.
#
#    </details>
#
#    <details><summary>Answer</summary>
#
#    $r\,(4d + 2d + 5d + 5d) = 16\,r\,d$ per block, so $16 \cdot 8 \cdot 2048 \cdot 24 = 6{,}291{,}456$ for the whole model at $r = 8$. The step-0 identity still holds: every $B$ starts at zero, whatever layers are adapted.
#
#    </details>
#
# 2. In `qlora()`, set `bnb_4bit_use_double_quant=False`. By how many MiB should the weights grow (0.373 bits per
#    quantized weight)? Check against the weights column, and your prediction here:
#    `from helpers import exercises; exercises.check("6.2", your_mib)`
#
#    <details><summary>Hint</summary>
#
#    Double quantization stores the per-block scales in 8 bits: 0.373 fewer bits for each quantized weight.
#
#    </details>
#
#    <details><summary>Answer</summary>
#
#    About 54 MiB more: $0.373 / 8$ bytes times the roughly 1.2 billion quantized weights (the embeddings and the head are not quantized).
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
#    The activations fall by most of their size and the peak with them (the activation part of section 6.3's breakdown). The GPU does about one more forward pass of work, plus the 4-bit dequantization again in the recomputation; where the GPU is the limit that is around a third more time. At section 6.3's batch the QLoRA step is [host-bound](https://gpu-efficient-training.github.io/book/book/glossary.html#host-bound), and chapter 4 measured the 1.3B model at batch 4 paying far more than a third there, because the recomputation issues every layer's kernels a second time.
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
# - [Hu et al. (2022)](https://gpu-efficient-training.github.io/book/book/references.html): LoRA, its initialisation and scaling, the GPT-3 175B numbers.
# - [Kalajdzievski (2023)](https://gpu-efficient-training.github.io/book/book/references.html): rank-stabilised LoRA, the $\alpha / \sqrt{r}$ scaling.
# - [Dettmers et al. (2023)](https://gpu-efficient-training.github.io/book/book/references.html): QLoRA, NF4, double quantization, paged optimizers, the 65B model on 48 GB.
# - [Dettmers et al. (2022), 8-bit optimizers](https://gpu-efficient-training.github.io/book/book/references.html): the 8-bit optimizers used by QLoRA's paged AdamW.
# - [Heo (2024)](https://gpu-efficient-training.github.io/book/book/references.html), chapter 5: LoRA and QLoRA on polyglot-ko-1.3b, the model of this chapter.
#
# All the works the book cites are on the [references page](https://gpu-efficient-training.github.io/book/book/references.html).

# %% [markdown]
# Every experiment freed what it made. cuBLAS keeps a workspace for each handle and stream on which it ran a matrix
# product (chapter 8); we release them, and check that the chapter ends where it began:

# %%
freed = cleanup.free(globals(), "check")
if prof.on_gpu:  # cleanup.back_at_baseline: collect, release cuBLAS's workspaces, compare; LeakError if not back
    display(pd.Series(cleanup.back_at_baseline(baseline_mib)).to_frame("value"))
else:
    print("skipped on CPU: no GPU memory to check")
