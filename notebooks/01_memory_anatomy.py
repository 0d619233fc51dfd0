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
# # 1. Memory anatomy: where a GPU's memory goes in training
#
# A 335-million-parameter BERT is 1.25 GiB of weights, yet training it with a batch of four takes several
# times that: the Hugging Face guide's run of it filled almost all of a 16 GB V100. Before any technique in this book can win memory back, we need to know where it went.
# This chapter measures it, piece by piece, on one model and one GPU, and holds each piece against the
# rule of thumb that is supposed to predict it.
#
# **What you will learn**
#
# - the four memory numbers a GPU gives you ([NVML](https://gpu-efficient-training.github.io/book/book/glossary.html#nvml) *used*, torch *reserved*, *allocated* and *peak
#   allocated*) and why they differ;
# - what the [CUDA context](https://gpu-efficient-training.github.io/book/book/glossary.html#cuda-context) costs before your first tensor;
# - the components of training memory (weights, gradients, [optimizer states](https://gpu-efficient-training.github.io/book/book/glossary.html#optimizer-states), [activations](https://gpu-efficient-training.github.io/book/book/glossary.html#activations), temporary
#   buffers) measured phase by phase, and the memory that belongs to the runtime (CUDA context, library
#   workspaces, the allocator's cache);
# - how far the popular rules (16 or 18 bytes per parameter, "training takes 4x the model") are from
#   measured memory, and why;
# - how activation memory grows with batch size and sequence length, against the formula of
#   [Korthikanti et al. (2022)](https://gpu-efficient-training.github.io/book/book/references.html);
# - where the peak of a training step really is, and what an out-of-memory error on a 15 GB card looks
#   like and how to recover from it.
#
# **Prerequisites:** PyTorch basics (a model, a loss, `backward()`, an optimizer). The [setup page](https://gpu-efficient-training.github.io/book/book/setup.html)
# explains the run profiles: on a CPU this notebook runs tiny versions of the same models in seconds; the
# sentences that quote numbers are written by the notebook from its own run, so they describe the machine
# named in the first output below (on the website: the full-size GPU run).

# %%
import sys

if "google.colab" in sys.modules:  # Colab only. pip adds what Colab lacks (bitsandbytes, the book's helpers)
    # and upgrades transformers to the 5.x the book needs: nothing has imported it yet in this kernel, so no
    # restart is needed. Colab's torch already meets the book's floor and is kept (see the setup page).
    # %pip install -q --no-warn-conflicts "gpu-efficient-training @ git+https://github.com/gpu-efficient-training/book"

from helpers import env

env.quiet()  # warnings without file paths, no progress bars: outputs that read the same everywhere

import math

import matplotlib.pyplot as plt
import pandas as pd
import torch
from IPython.display import Markdown, display
from transformers import Trainer, TrainingArguments

from helpers import accounting, cleanup, data, estimates, gpus, measure, models, plots, run_profile, timing
from helpers.measure import GIB, MIB

prof = env.start()  # plot style, number format, run profile; the table below names hardware and versions

# %% [markdown]
# ## 1.1 An empty GPU, the CUDA context, and the weights
#
# `nvidia-smi` and NVML (the library behind it, `import pynvml`) report the memory *used* on the whole
# card. Before this process has touched CUDA, that is what the driver and any other process hold. The
# first CUDA call creates a *CUDA context*: the driver's state for this process, with the GPU code
# (kernels) of PyTorch and its libraries. It costs memory that PyTorch's allocator never sees.

# %%
nvml_used = {}  # NVML "used" at each moment, MiB
if run_profile.cuda_or_skip("NVML reads an NVIDIA GPU's memory"):
    nvml_used["before any CUDA call"] = measure.nvml_used_mib()
    torch.ones(1, device="cuda")  # the first CUDA call creates this process's CUDA context
    baseline_mib = torch.cuda.memory_allocated() / MIB  # the chapter's baseline, checked in the last cell
    nvml_used["after the first CUDA call"] = measure.nvml_used_mib()
    torch.ones(64, 64, device="cuda") @ torch.ones(64, 64, device="cuda")  # loads cuBLAS
    nvml_used["after the first matmul"] = measure.nvml_used_mib()

# %% [markdown]
# Now the Hugging Face guide's model, `bert-large-uncased` with a two-class head, built from its configuration with
# random weights (memory does not depend on the values). Its weights in fp32 take 4 bytes per parameter.

# %%
model = models.build("bert-large-uncased", head="sequence-classification")
n_bert = models.n_params(model)
bert_weights_mib = accounting.param_bytes(model) / MIB
print(f"{n_bert:,} parameters -> {bert_weights_mib:,.0f} MiB of fp32 weights on {prof.device}")

# %%
if run_profile.cuda_or_skip("NVML reads an NVIDIA GPU's memory"):
    nvml_used["after loading bert-large"] = measure.nvml_used_mib()
    steps = pd.DataFrame({"NVML used (MiB)": nvml_used})
    steps["increase (MiB)"] = steps["NVML used (MiB)"].diff()
    alloc = measure.allocator_mib()
    context_mib, cublas_mib = steps.iloc[1, 1], steps.iloc[2, 1]
    workspace_mib = alloc["allocated_mib"] - bert_weights_mib
    display(steps)
    print(f"torch allocated {alloc['allocated_mib']:,.0f} MiB, reserved {alloc['reserved_mib']:,.0f} MiB")

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (1.1 An empty GPU, the CUDA context, and the weights)
if prof.on_gpu:
    display(Markdown(
        f"On the GPU of this run the card showed {steps.iloc[0, 0]:,.0f} MiB used before this process did "
        f"anything: memory the driver and any other process hold. The first CUDA call added {context_mib:,.0f} MiB, "
        f"and the first matrix product {cublas_mib:,.0f} MiB more as cuBLAS loaded its kernels and workspace. "
        "The Hugging Face guide puts this start-up cost at 1-2 GB; today PyTorch turns on CUDA's lazy module "
        "loading (kernels are loaded when first used), and the cost differs from card to card and driver to "
        "driver, so measure it on yours. "
        f"The weights then added {steps.iloc[3, 1]:,.0f} MiB by NVML, against the {bert_weights_mib:,.0f} MiB that "
        f"4 bytes x {n_bert / 1e6:,.0f} M parameters predict (NVML counts whole segments the allocator reserved). "
        f"Torch counts {alloc['allocated_mib']:,.0f} MiB allocated: the weights and {workspace_mib:.0f} MiB that "
        "cuBLAS took, through PyTorch's allocator, as workspace at the first matrix product. NVML is the number "
        "that decides whether you run out of memory; the allocator's numbers say which tensors own it."
    ))
else:
    print("skipped on CPU: the CUDA context and NVML exist only on an NVIDIA GPU")

# %% [markdown]
# ## 1.2 The guide's baseline: one epoch with the Trainer
#
# The Hugging Face guide (*Model training anatomy*) trains this model on 512 random sequences of 512
# tokens, batch size 4, one epoch, no optimisation at all, and reports time, samples per second and NVML
# memory. We do the same (the tiny profile shrinks the data), twice: with the attention transformers 5 builds
# BERT with by default, PyTorch's `scaled_dot_product_attention` ([SDPA](https://gpu-efficient-training.github.io/book/book/glossary.html#sdpa)), and with the plain [`eager` attention](https://gpu-efficient-training.github.io/book/book/glossary.html#eager-attention)
# that BERT had when the guide was written (transformers added SDPA to BERT in 2024). Between the two runs the
# first model and its Trainer are freed and the allocator's cache emptied, so each NVML reading is one run's.

# %%
seq_len, n_samples = prof.pick(tiny=64, full=512), prof.pick(tiny=64, full=512)
ds = data.dummy_dataset(n_samples, seq_len, seed=0)


def trainer_epoch(model):
    """The guide's run: one epoch of the Trainer, batch 4; time, throughput and memory at its end."""
    args = TrainingArguments(
        output_dir="trainer_tmp", per_device_train_batch_size=4, num_train_epochs=1, seed=0,
        logging_strategy="no", save_strategy="no", report_to="none", disable_tqdm=True,
    )
    if prof.on_gpu:
        measure.reset_peak("cuda")
    try:
        result = Trainer(model=model, args=args, train_dataset=ds).train()
    except torch.OutOfMemoryError:  # possible on a 15 GB T4 with eager attention; the frames go with the return
        return {"result": "out of memory"}
    row = {"result": "ok", "time (s)": result.metrics["train_runtime"],
           "samples/s": result.metrics["train_samples_per_second"]}
    if prof.on_gpu:
        row["NVML used (MiB)"] = measure.nvml_used_mib()
        row["peak allocated (MiB)"] = measure.allocator_mib()["peak_allocated_mib"]
    return row


trainer_rows = {"SDPA attention (default)": trainer_epoch(model)}
cleanup.free(globals(), "model")  # the Trainer went with the function; this empties the allocator's cache
eager_model = models.build("bert-large-uncased", head="sequence-classification", attn_implementation="eager")
trainer_rows["eager attention"] = trainer_epoch(eager_model)
baseline = trainer_rows["SDPA attention (default)"]
pd.DataFrame(trainer_rows).style.format(precision=2, na_rep="—")

# %% [markdown]
# The guide ran this on a 16 GB V100 and printed `Time: 57.82`, `Samples/second: 8.86` and `GPU memory
# occupied: 14949 MB`. Its "MB" is `used // 1024**2`, so it is MiB, the unit of this book.

# %%
hf_docs_v100 = {"time (s)": 57.82, "samples/s": 8.86, "NVML used (MiB)": 14949}
comparison = pd.DataFrame({"HF docs, V100 16 GB": hf_docs_v100}
                          | {f"this run, {k} ({prof.name} profile)": v for k, v in trainer_rows.items()})
comparison.style.format(precision=2, thousands=",", na_rep="—")

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (1.2 The guide's baseline)
if prof.is_full and prof.on_gpu and baseline["result"] == "ok":
    eager = trainer_rows["eager attention"]
    guide_mib, sdpa_mib = hf_docs_v100["NVML used (MiB)"], baseline["NVML used (MiB)"]
    gap_mib = guide_mib - sdpa_mib
    eager_extra_mib = eager["NVML used (MiB)"] - sdpa_mib if eager["result"] == "ok" else float("nan")
    runtime_mib = context_mib + cublas_mib
    if eager["result"] != "ok":
        gap_text = (f"The guide's {guide_mib:,} MiB is {gap_mib:,.0f} MiB more. With eager attention, as in the guide's "
                    "day, the epoch ran out of memory on this card: the attention matrices that SDPA's fused kernel "
                    "does not store no longer fit beside the rest.")
    elif gap_mib <= 0:
        gap_text = (f"That is already at or above the guide's {guide_mib:,} MiB, so there is no gap to explain; "
                    f"eager attention adds {eager_extra_mib:,.0f} MiB more.")
    elif eager_extra_mib >= gap_mib:
        gap_text = (f"The guide's {guide_mib:,} MiB is {gap_mib:,.0f} MiB more. Eager attention alone adds "
                    f"{eager_extra_mib:,.0f} MiB, as much as the whole gap or more: the attention matrix that SDPA's "
                    "fused kernel does not store explains it.")
    else:
        rest_mib = gap_mib - eager_extra_mib
        gap_text = (
            f"The guide's {guide_mib:,} MiB is {gap_mib:,.0f} MiB more. Eager attention, as in the guide's day, "
            f"adds {eager_extra_mib:,.0f} MiB ({eager_extra_mib / gap_mib:.0%} of that gap): the $s \\times s$ "
            f"attention matrices that SDPA's fused kernel does not store. The remaining {rest_mib:,.0f} MiB is memory "
            "this run does not hold at all. A V100 with 2022's software cannot be re-measured here, so its owner is an "
            "informed guess, mostly the runtime: here the CUDA context and cuBLAS took "
            f"{runtime_mib:,.0f} MiB (section 1.1), with CUDA's lazy loading, while in 2022 a context loaded all of "
            "PyTorch's kernels at start-up (1-2 GB, as the guide says); library workspaces, the allocator's cache "
            "and the optimizer's implementation (transformers' own AdamW then, PyTorch's now) also differ between "
            "versions and cards."
        )
    before_mib = nvml_used["before any CUDA call"]
    display(Markdown(
        f"Here the epoch took {baseline['time (s)']:.1f} s at {baseline['samples/s']:.1f} samples/s, "
        f"{baseline['samples/s'] / hf_docs_v100['samples/s']:.1f} times the V100's throughput. With SDPA the card "
        f"showed {sdpa_mib:,.0f} MiB ({sdpa_mib * MIB / GIB:.1f} GiB) used by NVML at the end, {before_mib:,.0f} MiB "
        "of it already there before this process started (section 1.1; NVML's *used* is the whole card's). Of the "
        f"rest, at most {baseline['peak allocated (MiB)']:,.0f} MiB were ever in live tensors; the remainder is this "
        "process's CUDA context and the allocator's cache: freed blocks that PyTorch keeps for reuse instead of "
        "returning them to the driver. "
        f"{gap_text} Either way, the live tensors alone peaked at "
        f"{baseline['peak allocated (MiB)'] / bert_weights_mib:.1f} times the model's {bert_weights_mib:,.0f} MiB "
        "of weights, at a batch of four. The rest of the chapter finds out why."
    ))
elif prof.on_gpu:
    print("the SDPA epoch ran out of memory on this GPU, so there is no comparison with the guide's V100")
else:
    print("skipped on CPU: NVML memory and the comparison with the guide's V100 need the full-size run on a GPU")

# %% [markdown]
# The same readings as a picture: what NVML's *used* holds at the end of each epoch, split into what was on the
# card before this process started, this process's CUDA context and libraries (section 1.1), the peak of live
# tensors, and the rest (the allocator's cache, and kernels loaded after section 1.1). The guide printed one
# number, so its bar is not split.

# %%
if run_profile.cuda_or_skip("NVML reads an NVIDIA GPU's memory") and prof.is_full:
    nvml_split, ok_rows = {}, {k: r for k, r in trainer_rows.items() if r["result"] == "ok"}
    for label, r in ok_rows.items():
        known = {"before this process": nvml_used["before any CUDA call"],
                 "CUDA context and libraries": context_mib + cublas_mib,
                 "peak of live tensors": r["peak allocated (MiB)"]}
        rest = max(r["NVML used (MiB)"] - sum(known.values()), 0.0)  # the allocator's cache, kernels loaded later
        nvml_split[f"{label.split()[0]}, this run"] = known | {"cache and the rest": rest}
    nvml_split["the guide's V100"] = {"not split": float(hf_docs_v100["NVML used (MiB)"])}
    nvml_split = pd.DataFrame(nvml_split).T.fillna(0.0) * MIB / GIB
    live_share = [f"{v['peak of live tensors'] / v.sum():.0%} ({k.split(',')[0]})"
                  for k, v in nvml_split.iterrows() if v["not split"] == 0]
    fig = plots.stacked_bar(
        nvml_split, ylabel="NVML used at the end of the epoch (GiB)",
        title="bert-large, batch 4, one epoch:\nlive tensors are "
              + (" and ".join(live_share) if live_share else "not measured (no epoch completed)") + " of NVML's used",
        colors={"before this process": "#C7C7C7", "CUDA context and libraries": "#937860",
                "peak of live tensors": "#4C72B0", "cache and the rest": "#DD8452", "not split": "#8C8C8C"})

# %% [markdown]
# First we give the memory back. `cleanup.free` deletes the names, runs the garbage collector and empties
# the allocator's cache; what it reports is what came back.

# %%
freed = cleanup.free(globals(), "eager_model")
if run_profile.cuda_or_skip("the allocator's numbers exist only on a GPU"):
    print(f"freed {freed.allocated_freed_mib:,.0f} MiB allocated, {freed.reserved_freed_mib:,.0f} MiB reserved; "
          f"now allocated: {freed.allocated_after_mib:,.0f} MiB, NVML used: {measure.nvml_used_mib():,.0f} MiB")

# %% [markdown]
# ## 1.3 The six components, phase by phase
#
# The guide lists six things that share the memory during training:
#
# 1. **weights**, the parameters;
# 2. **gradients**, one per parameter, written by `backward()`;
# 3. **optimizer states**: AdamW keeps two per parameter (the running mean and the running squared mean
#    of the gradients);
# 4. **activations**: tensors the forward pass saves because the backward pass needs them;
# 5. **[temporary buffers](https://gpu-efficient-training.github.io/book/book/glossary.html#temporary-buffers)**: intermediate results that live for one operation and go;
# 6. **functionality-specific memory**: what a particular feature needs on top, for example the copies of
#    inputs and outputs that beam search keeps while generating text. Plain training, as here, has none.
#
# Beside these, the runtime holds memory that is in no tensor of the model: the CUDA context (section 1.1),
# library workspaces (cuBLAS's, allocated through PyTorch), and the allocator's cache of freed blocks. The
# guide's list does not count it; NVML does.
#
# A plain PyTorch loop shows them appear. We run two training iterations of the same model and batch as
# above, split into phases: load, forward, backward, optimizer step, `zero_grad`. Around each phase
# `measure.PhaseRecorder` resets the allocator's peak counter and, after it, records what is allocated and
# what the peak was. Independently of the device, `accounting` counts the bytes of parameters, gradients
# and optimizer states, and a `SavedTensorMeter` counts the tensors saved for backward, through
# `torch.autograd.graph.saved_tensors_hooks`: each stored tensor passes through a hook that notes its
# storage once, skipping the model's own parameters.

# %%
batch = {k: v.to(prof.device) for k, v in ds[:4].items()}
rec = measure.PhaseRecorder(prof.device)
accounted = {}  # bytes we can name, at the end of each phase


def account(phase, activations=0):
    accounted[phase] = {**accounting.model_state_bytes(model, optimizer), "activations": activations}


with rec.phase("load"):
    model = models.build("bert-large-uncased", head="sequence-classification")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
account("load")

for it in (1, 2):
    with rec.phase(f"{it}: forward"), accounting.SavedTensorMeter(model) as saved:
        loss = model(**batch).loss
    account(f"{it}: forward", saved.total_bytes)
    with rec.phase(f"{it}: backward"):
        loss.backward()
    account(f"{it}: backward")
    with rec.phase(f"{it}: step"):
        optimizer.step()
    account(f"{it}: step")
    with rec.phase(f"{it}: zero_grad"):
        optimizer.zero_grad(set_to_none=True)  # frees the gradients
    account(f"{it}: zero_grad")

# %% [markdown]
# The accounting gives the named components at the end of each phase. On a GPU the allocator adds two
# more: *transient*, how far the phase's peak rose above what stayed allocated after it (memory that lived
# and died inside the phase), and *other*, live memory the accounting cannot name (the batch, the logits,
# library workspaces). A bar's height is the phase's [peak allocated](https://gpu-efficient-training.github.io/book/book/glossary.html#peak-allocated-memory) memory; the `zero_grad` phases, which only
# free, are in the table and not in the figure.

# %%
breakdown = pd.DataFrame(accounted).T.rename(
    columns={"optimizer_states": "optimizer states"}
)[["weights", "gradients", "optimizer states", "activations"]] / GIB
phases = rec.to_frame()
if prof.on_gpu:
    breakdown["other"] = phases["allocated_mib"] * MIB / GIB - breakdown.sum(axis=1)
    breakdown["transient"] = (phases["peak_allocated_mib"] - phases["allocated_mib"]) * MIB / GIB
    check = pd.DataFrame({
        "accounted (GiB)": breakdown[["weights", "gradients", "optimizer states", "activations"]].sum(axis=1),
        "allocated (GiB)": phases["allocated_mib"] * MIB / GIB,
        "peak allocated (GiB)": phases["peak_allocated_mib"] * MIB / GIB,
        "time (s)": phases["time_s"],
    })
    peak_phase = check["peak allocated (GiB)"].idxmax()
    display(check)
if prof.on_gpu:
    anat_title = f"bert-large, fp32 AdamW, batch 4: the highest peak is phase '{peak_phase}'"
else:
    anat_title = "bert-large (tiny), fp32 AdamW, batch 4: counted bytes only (no allocator on a CPU)"
fig = plots.stacked_bar(breakdown[~breakdown.index.str.endswith("zero_grad")], title=anat_title, ylabel="memory (GiB)",
                        colors={"other": "#8C8C8C"})  # grey: live memory no model state owns

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (1.3 The six components, phase by phase)
if prof.on_gpu:
    act_gib, w_gib = breakdown.loc["2: forward", "activations"], breakdown.loc["load", "weights"]
    display(Markdown(
        "Read the bars left to right. Loading puts the weights on the card. The first forward pass adds the "
        f"activations ({act_gib:.2f} GiB at this batch and sequence length, {act_gib / w_gib:.1f} times the weights). "
        "The backward pass turns them into gradients: each saved tensor is freed once its layer's gradients are "
        "computed, so at the end only gradients remain, and the transient slice "
        f"({breakdown.loc['1: backward', 'transient']:.2f} GiB) is the activations that were still alive when the "
        "gradients began to appear. The first optimizer step creates AdamW's two states and, while it runs, "
        f"{breakdown.loc['1: step', 'transient']:.2f} GiB of true temporary buffers: PyTorch's default multi-tensor "
        "(\"foreach\") AdamW computes intermediate results for many parameters at once. From the second iteration "
        f"on, the optimizer states stay under everything else. The highest bar is {check['peak allocated (GiB)'].max():.2f} "
        f"GiB, in phase \"{peak_phase}\". The \"other\" slice at the end of a forward pass "
        f"({breakdown.loc['2: forward', 'other']:.2f} GiB) is the batch, the logits, the loss and cuBLAS's "
        "workspaces: live, but not saved for backward."
    ))
else:
    print("skipped on CPU: the peaks, transient and other slices are allocator statistics of a GPU")

# %% [markdown]
# The accounting counts the model states from the tensors' sizes. Bytes per parameter:

# %%
# NBVAL_CHECK_OUTPUT
# (the bytes are exact on every machine, so CI compares this table with the GPU run's; printed as text,
# because pandas' HTML differs between versions)
states = accounted["2: step"]
rule = estimates.BYTES_PER_PARAM["fp32_adamw"]
bpp = pd.DataFrame({
    "rule (bytes/param)": [float(rule[k]) for k in ("weights", "gradients", "optimizer_states")],
    "counted (bytes/param)": [states[k] / n_bert for k in ("weights", "gradients", "optimizer_states")],
}, index=["weights", "gradients", "optimizer states"])
bpp.loc["total"] = bpp.sum()
print(bpp.to_string(float_format="{:.2f}".format))

# %% [markdown]
# Counted, it is 16 bytes per parameter for fp32 training with AdamW, as the rule says; that holds by
# construction (fp32 weights and gradients, two fp32 states per parameter), so the table checks the
# counting code, not the GPU. The measurement is the allocator's: after the second optimizer step, what is
# allocated must be those counted bytes plus only a little that belongs to no model state (the batch, the
# loss, cuBLAS's workspaces). If the counting missed a state, or the optimizer kept a copy we did not count,
# this check fails:

# %%
if run_profile.cuda_or_skip("the allocator's numbers exist only on a GPU"):
    counted_mib = sum(states[k] for k in accounting.MODEL_STATES) / MIB
    allocated_mib = phases.loc["2: step", "allocated_mib"]
    print(f"allocated after the second step: {allocated_mib:,.1f} MiB; counted model states: {counted_mib:,.1f} MiB; "
          f"not in a model state: {allocated_mib - counted_mib:,.1f} MiB")
    assert 0 <= allocated_mib - counted_mib < 256, "the allocator disagrees with the counted model states"

# %% [markdown]
# The Hugging Face guide
# gives two more rules: **18 bytes** for mixed-precision training ("6 bytes of weights: an fp32 copy and a
# 16-bit copy") and **6 bytes** for mixed-precision inference. In PyTorch, [mixed precision](https://gpu-efficient-training.github.io/book/book/glossary.html#mixed-precision) means
# `torch.autocast`: the weights stay fp32 and each matrix multiplication casts them to 16 bits on the fly.
# Where do the two extra bytes live then? We count, with a single short sequence so that activations are
# negligible, what [autocast](https://gpu-efficient-training.github.io/book/book/glossary.html#autocast) saves for backward, and what an fp32 and a 16-bit model need for inference.
# The 16-bit type is `gpus.amp_dtype()`: [bf16](https://gpu-efficient-training.github.io/book/book/glossary.html#bf16) on a CPU and on GPUs of [compute capability](https://gpu-efficient-training.github.io/book/book/glossary.html#compute-capability) 8.0 or newer,
# [fp16](https://gpu-efficient-training.github.io/book/book/glossary.html#fp16) on older ones such as the T4, which has no bf16 [tensor cores](https://gpu-efficient-training.github.io/book/book/glossary.html#tensor-cores).

# %%
autocast_device = "cuda" if prof.on_gpu else "cpu"
amp = gpus.amp_dtype()
amp_name = {torch.bfloat16: "bf16", torch.float16: "fp16"}[amp]
tiny_batch = {"input_ids": batch["input_ids"][:1, :8], "labels": batch["labels"][:1]}
with accounting.SavedTensorMeter(model) as saved_fp32:
    model(**tiny_batch).loss
with accounting.SavedTensorMeter(model) as saved_amp, torch.autocast(autocast_device, dtype=amp):
    model(**tiny_batch).loss
amp_saved_bpp = saved_amp.total_bytes / n_bert
mp_rows = {
    "fp32 training: saved for backward": saved_fp32.total_bytes / n_bert,
    f"{amp_name} autocast training: saved for backward": amp_saved_bpp,
}
pd.Series(mp_rows, name="bytes per parameter")

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (1.3 The six components, phase by phase)
near_two = 1.5 < amp_saved_bpp < 2.0
display(Markdown(
    f"With {amp_name} autocast, the forward pass of this run saved {amp_saved_bpp:.2f} bytes per parameter for an "
    "8-token input. "
    + ("That is the 16-bit copies of the weights, which autocast caches for the duration of the forward pass "
       "and which the backward pass needs (the weights of embeddings and layer norms are not cast, hence a little "
       "under 2). So the guide's 18 bytes are real, but they are not a permanent part of the model state: they "
       "are 16 persistent bytes plus 2 bytes that appear in the forward pass and are gone after backward, counted "
       "here as activations."
       if near_two else
       "That is not the 2 bytes of 16-bit weight copies that the guide's 18-byte rule expects: autocast on this "
       f"device ({autocast_device}) did not keep a 16-bit copy of every weight for the backward pass, so the rule's "
       "extra 2 bytes did not appear as such.")
    + " What about inference, under `torch.no_grad()`? The measurement below (GPU only) takes the peak of one "
    "forward pass, weights included, for four ways of running it."
))

# %%
if run_profile.cuda_or_skip("peak allocated memory is an allocator statistic"):
    cleanup.free(globals(), "optimizer", "loss", "saved", "saved_fp32", "saved_amp")


    def inference_peak_bpp(autocast_dtype=None):
        """Peak bytes per parameter of one no-grad forward pass: weights + whatever it adds."""
        measure.reset_peak("cuda")
        base = torch.cuda.memory_allocated()
        with torch.no_grad(), torch.autocast("cuda", dtype=autocast_dtype, enabled=autocast_dtype is not None):
            model(**tiny_batch)
        return (torch.cuda.max_memory_allocated() - base + accounting.param_bytes(model)) / n_bert


    infer = {"fp32 weights": inference_peak_bpp(),
             f"fp32 weights, {amp_name} autocast": inference_peak_bpp(amp)}
    model.requires_grad_(False)  # frozen: autocast no longer caches its casts
    infer[f"fp32 weights, frozen, {amp_name} autocast"] = inference_peak_bpp(amp)
    model.to(amp)
    infer[f"{amp_name} weights"] = inference_peak_bpp()
    display(pd.Series(infer, name="peak bytes per parameter, inference"))

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (1.3 The six components, phase by phase)
if prof.on_gpu:
    amp_bpp, frozen_bpp = infer[f"fp32 weights, {amp_name} autocast"], infer[f"fp32 weights, frozen, {amp_name} autocast"]
    verdict_6 = ("close to the guide's 6 bytes" if abs(amp_bpp - 6) < 0.5 else
                 f"{'above' if amp_bpp > 6 else 'below'} the guide's 6 bytes")
    display(Markdown(
        f"Mixed-precision inference with fp32 weights peaked at {amp_bpp:.2f} bytes per parameter, {verdict_6}. "
        "The reason is the same cache: autocast keeps the 16-bit copy of every weight that *requires grad* until "
        "the autocast region ends, even under `torch.no_grad()`. With the weights frozen "
        f"(`model.requires_grad_(False)`) the peak was {frozen_bpp:.2f} bytes per parameter"
        + (", because autocast then casts them one at a time instead." if frozen_bpp < amp_bpp - 0.5 else
           ": freezing made little difference in this run.")
        + f" Simpler still, load the model in {amp_name} for inference: "
        f"{infer[f'{amp_name} weights']:.2f} bytes per parameter here, no autocast needed. The rules are useful upper "
        "bounds; the measurements say what PyTorch actually keeps, and when."
    ))

# %% [markdown]
# ## 1.4 Activations: batch size, sequence length, and the attention matrix
#
# Model states do not depend on the batch; activations grow with it.
# [Korthikanti et al. (2022)](https://gpu-efficient-training.github.io/book/book/references.html) count the bytes one transformer layer saves with 16-bit activations as
#
# $$ s\,b\,h\,\Bigl(34 + 5\,\frac{a\,s}{h}\Bigr) $$
#
# for sequence length $s$, batch size $b$, hidden size $h$ and $a$ attention heads. The $34\,sbh$ part is
# linear in everything: the inputs of every linear layer, the GeLU input, layer norms, dropout masks.
# The $5\,a s^2 b$ part is the attention matrix: softmax output, its dropout mask and dropout output, all
# $s \times s$ per head. A fused attention kernel ([FlashAttention](https://gpu-efficient-training.github.io/book/book/glossary.html#flashattention), or the memory-efficient kernel, two of the
# backends of PyTorch's SDPA) never stores that matrix, which leaves $34\,sbh$. SDPA does not always get a
# fused kernel: where none supports the inputs (for example bf16 on a GPU below compute capability 8.0, such
# as the T4) it falls back to its *math* backend, which computes and stores the $s \times s$ matrix like
# eager attention.
#
# We measure it: bert-large in 16 bits (bf16, or fp16 on a GPU below compute capability 8.0, where fp16 is
# what the fused kernels take), training mode (dropout on), one forward pass, with the saved bytes
# attributed to the layer whose forward was running (`SavedTensorMeter(group=...)`). All 24 layers are
# identical, so we report one. Two attention implementations: `eager` (plain matmuls and softmax) and
# `sdpa` (`torch.nn.functional.scaled_dot_product_attention`, which picks a backend for the inputs it gets).

# %%
cfg = models.config("bert-large-uncased")
h, a = cfg.hidden_size, cfg.num_attention_heads


def saved_per_layer(model, batch_size, seq_len):
    layers = {f"layer {i}": layer for i, layer in enumerate(model.bert.encoder.layer)}
    batch = {k: v.to(prof.device) for k, v in data.dummy_dataset(batch_size, seq_len, seed=1)[:].items()}
    with accounting.SavedTensorMeter(model, group=layers) as meter:
        model(**batch)
    return meter.bytes_by_group["layer 1"]


act_rows = []
for attn in ("eager", "sdpa"):
    act_model = models.build("bert-large-uncased", head="sequence-classification", dtype=amp,
                             attn_implementation=attn).train()
    for b, s in ([(1, 512), (2, 512), (4, 512), (8, 512), (4, 64), (4, 128), (4, 256), (4, 384)] if prof.is_full else
                 [(1, 64), (2, 64), (4, 64), (4, 16), (4, 32)]):
        act_rows.append({"attention": attn, "batch": b, "seq": s,
                         "measured (MiB/layer)": saved_per_layer(act_model, b, s) / MIB})
    del act_model
acts = pd.DataFrame(act_rows)
acts["Korthikanti, eager (MiB/layer)"] = [estimates.korthikanti_activation_bytes(s, b, h, a) / MIB for b, s in zip(acts.batch, acts.seq, strict=True)]
acts["Korthikanti, no s² term (MiB/layer)"] = [estimates.korthikanti_activation_bytes(s, b, h, a, attention="flash") / MIB for b, s in zip(acts.batch, acts.seq, strict=True)]
acts["measured / sbh"] = acts["measured (MiB/layer)"] * MIB / (acts.seq * acts.batch * h)
acts["formula / sbh"] = 34 + 5 * a * acts.seq / h
acts

# %%
s_max = acts.seq.max()
fig, (ax_b, ax_s) = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
by_b = acts[acts.seq == s_max].sort_values("batch")
by_s = acts[acts.batch == 4].sort_values("seq")
for ax, frame, x, label in [(ax_b, by_b, "batch", f"batch size (seq {s_max})"), (ax_s, by_s, "seq", "sequence length (batch 4)")]:
    for attn, style in [("eager", "o-"), ("sdpa", "s-")]:
        part = frame[frame.attention == attn]
        ax.plot(part[x], part["measured (MiB/layer)"], style, label=f"measured, {attn}", zorder=2, alpha=0.8)
    ref = frame[frame.attention == "eager"]
    ax.plot(ref[x], ref["Korthikanti, eager (MiB/layer)"], "k--", label="formula, with s² term", zorder=1)
    ax.plot(ref[x], ref["Korthikanti, no s² term (MiB/layer)"], "k:", label="formula, 34·sbh", zorder=1)
    ax.set_xlabel(label)
ax_b.set_ylabel("saved for backward (MiB per layer)")
growth = {attn: by_s[by_s.attention == attn]["measured (MiB/layer)"].iloc[-1]
          / by_s[by_s.attention == attn]["measured (MiB/layer)"].iloc[0] for attn in ("eager", "sdpa")}
seq_growth = by_s.seq.max() / by_s.seq.min()
act_title = (f"bert-large, {amp_name}, one layer: linear in batch; in sequence length eager grows "
             f"{growth['eager'] / seq_growth:.1f}x faster than linear, SDPA {growth['sdpa'] / seq_growth:.1f}x")
fig.suptitle(act_title)
fig.legend(*ax_b.get_legend_handles_labels(), loc="lower center", ncols=4, bbox_to_anchor=(0.5, 0.0))
fig.tight_layout(rect=(0, 0.08, 1, 1))

# %%
if prof.is_full:
    row = acts[(acts.batch == 4) & (acts.seq == 512)].set_index("attention")

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (1.4 Activations)
if prof.is_full:
    eager_rows, sdpa_rows = acts[acts.attention == "eager"], acts[acts.attention == "sdpa"]
    eager_dev = ((eager_rows["measured / sbh"] - eager_rows["formula / sbh"]).abs() / eager_rows["formula / sbh"]).max()
    sdpa_fused = bool((sdpa_rows["measured / sbh"] < (34 + sdpa_rows["formula / sbh"]) / 2).all())
    e, f, sd = row.loc["eager"], 34 + 5 * a * 512 / h, row.loc["sdpa"]
    text = (
        f"At batch 4 and 512 tokens one layer saves {e['measured (MiB/layer)']:.1f} MiB with eager attention; the "
        f"formula says {e['Korthikanti, eager (MiB/layer)']:.1f} MiB. In units of $sbh$ that is "
        f"{e['measured / sbh']:.2f} against {f:.0f}, and over all rows of the table eager attention is within "
        f"{eager_dev:.1%} of the formula. "
        + ("The paper's count holds; the remainder, $16/h = 0.016\\,sbh$, is the two layer norms' per-token mean and "
           "inverse standard deviation (2 x 2 x 4 bytes per token), which the formula leaves out. "
           if eager_dev < 0.01 else
           "That is further from the paper's count than the layer norms' statistics explain; the GPU kernels of "
           "this PyTorch save other intermediates than the formula assumes. ")
    )
    if sdpa_fused:
        text += (f"With SDPA the layer saves {sd['measured (MiB/layer)']:.1f} MiB ({sd['measured / sbh']:.2f} $sbh$, "
                 "against 34 without the attention matrix): a fused kernel ran and stored no $s \\times s$ matrix, only "
                 f"its output and a 4-byte log-sum-exp per head and token ($4a/h = {4 * a / h:.4g}\\,sbh$ here), and "
                 "growth in sequence length became linear. ")
    else:
        text += (f"With SDPA the layer saves {sd['measured (MiB/layer)']:.1f} MiB ({sd['measured / sbh']:.2f} $sbh$): "
                 "closer to eager attention than to 34, so SDPA fell back to its math backend on this GPU and stored "
                 "the $s \\times s$ matrix; a fused kernel needs other dtypes or a newer GPU. ")
    text += (f"Over {cfg.num_hidden_layers} layers, eager attention at batch 4 keeps "
             f"{e['measured (MiB/layer)'] * cfg.num_hidden_layers * MIB / GIB:.1f} GiB for backward.")
    display(Markdown(text))
else:
    print("skipped on CPU: the tiny profile's CPU kernels save other intermediates than the GPU kernels the "
          "formula describes, so its numbers are not compared with it")

# %% [markdown]
# ## 1.5 The LLM book's experiment: a 1.3B model on a 15 GB card
#
# Chapter 5 of the Korean LLM book that this course learns from trains `EleutherAI/polyglot-ko-1.3b` in
# fp16 with AdamW on random sequences of 256 tokens, at batch sizes 4, 8 and 16, on Colab's T4, and prints
# the memory of the model, the gradients, the optimizer states and the total. Batch 16 runs out of memory.
#
# We repeat it with the same architecture (GPT-NeoX, 24 layers, hidden 2048: 1,331,810,304 parameters,
# built offline), eager attention as in the book's transformers version, three training steps per batch
# size. On a GPU larger than a T4 we **emulate the T4**: `measure.gpu_budget` caps PyTorch's allocator with
# `torch.cuda.set_per_process_memory_fraction`, at the T4's 14.75 GiB minus the CUDA context this process
# already holds (`measure.t4_budget` computes it from the NVML reading of section 1.1), so an allocation past
# it fails where it would on the smaller card, give or take what the cap does not model (a T4's own context and
# kernels, and how the allocator's blocks fragment on a smaller card). On a real T4 the cap is the whole card and
# changes nothing.

# %%
def llm_book_step_memory(batch_size, seq_len, steps=3):
    """The book's loop: fp16 model, AdamW, a few steps; memory after each phase, in GiB."""
    where = {"phase": "load"}
    rows = []
    model = models.build("polyglot-ko-1.3b", head="causal-lm", dtype=torch.float16, attn_implementation="eager")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ds = data.dummy_dataset(batch_size * steps, seq_len, task="causal-lm", high=30000, seed=2)
    rec = measure.PhaseRecorder(prof.device)
    try:
        for it in range(1, steps + 1):
            batch = {k: v.to(prof.device) for k, v in ds[(it - 1) * batch_size:it * batch_size].items()}
            for phase in ("forward", "backward", "optimizer step"):
                where["phase"] = f"{it}: {phase}"
                with rec.phase(where["phase"]):
                    if phase == "forward":
                        loss = model(**batch).loss
                    elif phase == "backward":
                        loss.backward()
                        grads = accounting.grad_bytes(model)
                    else:
                        optimizer.step()
                        optimizer.zero_grad()
            rows.append({
                "batch": batch_size, "model (GiB)": accounting.param_bytes(model) / GIB,
                "gradients (GiB)": grads / GIB,
                "optimizer (GiB)": accounting.optimizer_state_bytes(optimizer) / GIB,
            })
    except torch.OutOfMemoryError as err:  # only its text is kept: the exception and its frames go
        said = str(err).split(". ")
        return {"batch": batch_size, "result": f"out of memory ({where['phase']})",
                "error": ". ".join(said[:2]) + ("." if len(said) > 2 else "")}, rec.to_frame()
    phases = rec.to_frame()
    out = rows[-1] | {"result": "ok"}
    if prof.on_gpu:
        out["allocated after step (GiB)"] = phases["allocated_mib"].iloc[-1] * MIB / GIB
        out["peak (GiB)"] = phases["peak_allocated_mib"].max() * MIB / GIB
        out["peak phase"] = phases["peak_allocated_mib"].idxmax()
    return out, phases


# %%
llm_seq = prof.pick(tiny=16, full=256)  # tiny: a CPU is slow at fp16, and CI runs this on a CPU
llm_rows, llm_phases = [], {}
cleanup.free(globals(), "model")  # bert-large is done; start from an empty allocator
if prof.on_gpu:
    print(f"allocated before the experiment: {torch.cuda.memory_allocated() / MIB:,.0f} MiB")
if run_profile.cuda_or_skip("emulating the T4's memory needs a GPU; the tiny models run without a cap"):
    budget = measure.t4_budget(nvml_used["before any CUDA call"])
    t4_budget_gib = budget.budget_gib
    print(budget.describe())
for bs in (4, 8, 16):
    if prof.on_gpu:
        with measure.gpu_budget(t4_budget_gib):
            row, llm_phases[bs] = llm_book_step_memory(bs, llm_seq)
    else:
        row, llm_phases[bs] = llm_book_step_memory(bs, llm_seq)
    error = row.pop("error", None)  # the start of the real message, printed below rather than put in the table
    llm_rows.append(row)
    freed = cleanup.free(globals())  # the function's model and optimizer are already out of scope
    if prof.on_gpu:
        print(f"batch {bs}: {row['result']}; allocated now {torch.cuda.memory_allocated() / MIB:,.0f} MiB")
        if error:
            print(f"  the error began: {error} (chapter 8 reads the whole message)")
llm = pd.DataFrame(llm_rows).set_index("batch")
llm.style.format(precision=2, na_rep="—")

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (1.5 The LLM book's experiment)
if prof.on_gpu:
    fits = [bs for bs in llm.index if llm.loc[bs, "result"] == "ok"]
    oom = [bs for bs in llm.index if llm.loc[bs, "result"] != "ok"]
    ok = llm.loc[fits]
    text = ""
    if fits:
        text += (
            f"The model takes {ok['model (GiB)'].iloc[0]:.2f} GiB (2 bytes x 1.33 B parameters), the gradients as "
            f"much, and the two fp16 AdamW states twice that: {ok['optimizer (GiB)'].iloc[0]:.2f} GiB. As in the book, "
            "these three do not change with the batch size; only the total does. (The book printed 2.599 \"GB\", in "
            "fact GiB, after loading the real checkpoint; our weights are exactly 2 bytes per parameter.)\n\n")
    fit_txt = " and ".join(f"batch {bs}" for bs in fits) or "no batch size"
    text += f"Under the emulated T4 ({t4_budget_gib:.2f} GiB for the allocator), {fit_txt} fit"
    if oom:
        text += ("; " + ", ".join(f"batch {bs} fails with \"{llm.loc[bs, 'result']}\"" for bs in oom)
                 + (", as in the book." if oom == [16] else "."))
        if any(str(llm.loc[bs, "result"]).startswith("out of memory (2:") for bs in oom):
            text += (" Note where: the first iteration fits, because AdamW creates its states lazily, in the first "
                     "`optimizer.step()`. From then on the states sit under every forward pass, and the second "
                     "forward pass's activations no longer fit.")
    else:
        text += ", batch 16 included: unlike the book's run, nothing ran out of memory here."
    text += (f" After each run, the failed ones included, allocated memory was back to "
             f"{torch.cuda.memory_allocated() / MIB:.0f} MiB. Recovering from an out-of-memory error needs only that "
             "nothing keeps a reference to the failed step's tensors; the `except` clause inside the function lets "
             "the exception, and the stack frames it holds, go before `cleanup.free` empties the cache.")
    if 4 in fits:
        phase4 = llm.loc[4, "peak phase"]
        text += (f"\n\n**Where is the peak?** The table's last column names the phase. At batch 4 it is \"{phase4}\", "
                 f"at {llm.loc[4, 'peak (GiB)']:.2f} GiB, against {t4_budget_gib:.2f} GiB allowed"
                 + (": not the activations, but the optimizer step, where weights, gradients, both states and the "
                    "step's temporary buffers are alive at once." if "optimizer" in phase4 else
                    ": the activations of a forward or backward pass, more than the optimizer step's buffers.")
                 + " The per-phase record of batch 4:")
    display(Markdown(text))
else:
    print("skipped on CPU: the peaks and the out-of-memory limit are allocator statistics of a GPU")

# %%
if prof.on_gpu:
    llm_ok = llm[llm.result == "ok"]
if run_profile.cuda_or_skip("the per-phase peak is an allocator statistic"):
    ph4 = (llm_phases[4][["peak_allocated_mib", "allocated_mib"]] * MIB / GIB).rename(
        columns={"peak_allocated_mib": "peak during the phase", "allocated_mib": "allocated after the phase"})
    fig = plots.lines(ph4.reset_index(drop=True).reset_index(), x="index", ys=list(ph4.columns),
                      title=f"1.3B GPT-NeoX, fp16 AdamW, batch 4, seq 256: the peak is phase "
                            f"'{ph4['peak during the phase'].idxmax()}'",
                      xlabel="iteration: phase", ylabel="memory (GiB)")
    ax = fig.axes[0]
    ax.axhline(t4_budget_gib, color="grey", linestyle="--", label="emulated T4 budget")
    ax.set_ylim(bottom=0)
    ax.set_xticks(range(len(ph4)), ph4.index, rotation=35, ha="right")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (1.5 The LLM book's experiment)
if prof.on_gpu and 8 in llm.index and llm.loc[8, "result"] == "ok":
    step_peak_8 = "optimizer" in llm.loc[8, "peak phase"]
    display(Markdown(
        "The forward passes climb from iteration 1 to 2 by the optimizer states; each optimizer step adds "
        "temporary buffers on top of weights, gradients and states (PyTorch's default multi-tensor AdamW computes "
        f"intermediate results for many parameters at once). Batch 8 peaks at {llm.loc[8, 'peak (GiB)']:.2f} GiB, in "
        f"phase \"{llm.loc[8, 'peak phase']}\": "
        + ("at this sequence length its activations still stay under the step's peak." if step_peak_8 else
           "at this batch the activations, not the step, set the peak.")
    ))
elif prof.on_gpu:
    print("batch 8 did not fit in this run, so there is no batch-8 peak to read")
else:
    print("skipped on CPU: the per-phase peaks are allocator statistics of a GPU")

# %% [markdown]
# **A warning about the book's recipe.** Training with the weights *and* AdamW's states in fp16 halves
# the optimizer memory, but fp16 cannot hold what AdamW stores. Its second state is a running mean of
# squared gradients, and on the first step it is $(1-\beta_2)\,g^2$ with $\beta_2 = 0.999$: a thousandth of
# the squared gradient. Anything below half of fp16's smallest positive number, $2^{-24} \approx 6 \times 10^{-8}$,
# rounds to 0, and AdamW's `eps` (1e-8) is also 0 in fp16. The update then divides by
# $\sqrt{v} + \epsilon = 0$. One step on four weights with four gradients:

# %%
grads = torch.tensor([1e-2, 1e-3, 1e-4, 1e-5])
beta2 = 0.999
updates = {}
for dtype in (torch.float32, torch.float16):
    p = torch.zeros(4, dtype=dtype, requires_grad=True)
    opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, beta2), weight_decay=0.0)
    p.grad = grads.to(dtype)
    opt.step()
    updates[str(dtype)] = {"exp_avg_sq": opt.state[p]["exp_avg_sq"].float().tolist(), "new weight": p.detach().float().tolist()}
fp16_tiny = torch.finfo(torch.float16).tiny * torch.finfo(torch.float16).eps  # 2**-24, smallest subnormal
adam_fp16 = pd.DataFrame({
    "(1 - beta2) g², exact": ((1 - beta2) * grads.double() ** 2).tolist(),
    "exp_avg_sq, fp16": updates["torch.float16"]["exp_avg_sq"],
    "new weight, fp32": updates["torch.float32"]["new weight"],
    "new weight, fp16": updates["torch.float16"]["new weight"],
}, index=[f"{g:.0e}" for g in grads.tolist()]).rename_axis("gradient")
adam_fp16.map("{:.4g}".format)

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (1.5 The LLM book's experiment)
broken = adam_fp16[~adam_fp16["new weight, fp16"].map(math.isfinite)]
below = adam_fp16[adam_fp16["(1 - beta2) g², exact"] < fp16_tiny / 2]
fp32_moves = adam_fp16["new weight, fp32"].abs().between(0.9e-3, 1.1e-3).all()
display(Markdown(
    ("In fp32 every weight moved by the learning rate (Adam's first step is lr times the sign of the gradient). "
     if fp32_moves else "In fp32 the weights moved by different amounts. ")
    + (f"In fp16, the gradients {', '.join(broken.index)} gave the weights "
       f"{', '.join(f'{w:g}' for w in broken['new weight, fp16'])}: their $(1-\\beta_2)\\,g^2$ fell below "
       f"$2^{{-24}}$ and the stored state is 0 for {len(below)} of the 4 gradients"
       + (", a gradient of 1e-3 included, although $g^2 = 10^{-6}$ itself fits in fp16." if "1e-03" in broken.index
          else ".")
       + " One step, and the model is broken." if len(broken) else
       "In fp16, no weight became non-finite in this run's PyTorch: its AdamW must keep the state in a wider type.")
    + " Mixed precision (chapter 5) keeps the weights and states in fp32 and computes in 16 bits; 8-bit "
    "optimizers (chapters 2 and 5) shrink the states safely with per-block scales."
))

# %% [markdown]
# ## 1.6 "Training takes 4 x the model": the calculator's rule
#
# Hugging Face's model-memory calculator estimates training with Adam as four times the model's size (the
# Korean LLM book quotes it as 2.37 GB and 9.49 GB for polyglot-ko-1.3b in fp16). The factor 4 is weights + gradients +
# two optimizer states, all in the model's dtype, exactly the book's fp16 recipe; activations,
# temporary buffers and the CUDA context are not in it. Against our measured peaks:

# %%
calc_meta = models.build("polyglot-ko-1.3b", head="causal-lm", device="meta")
calc_params = models.n_params(calc_meta)
calc_head = calc_meta.get_output_embeddings().weight  # 30,080 x 2,048 at full size
model_gib = calc_params * 2 / GIB
no_head_gib = (calc_params - calc_head.numel()) * 2 / GIB
del calc_meta
rule_gib = estimates.hf_calculator_training_bytes(int(model_gib * GIB)) / GIB
calc = {
    "model, fp16 (GiB)": f"{model_gib:.2f}", "calculator: 4 x model (GiB)": f"{rule_gib:.2f}",
    "the LLM book's calculator numbers (GB)": "2.37 / 9.49",
}
if prof.on_gpu:
    for bs in llm.index:
        ok = llm.loc[bs, "result"] == "ok"
        calc[f"measured peak, batch {bs} (GiB)"] = f"{llm.loc[bs, 'peak (GiB)']:.2f}" if ok else llm.loc[bs, "result"]
pd.Series(calc, name="value").to_frame()

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (1.6 "Training takes 4 x the model": the calculator's rule)
if prof.on_gpu and llm.loc[4, "result"] == "ok":
    ratio4 = llm.loc[4, "peak (GiB)"] / rule_gib
    display(Markdown(
        f"The rule gives {rule_gib:.2f} GiB. The measured peak at batch 4 is {ratio4:.2f} times that, before "
        "counting the CUDA context"
        + (": the optimizer's temporary buffers and the activations are real memory the rule leaves out. "
           if ratio4 > 1 else ", so at this batch the rule was not exceeded. ")
        + f"The calculator's model size, 2.37, is also smaller than the {model_gib:.2f} GiB that 2 bytes x "
        f"{calc_params:,} parameters occupy"
        + (f". It matches, to the digits printed, the model without its {calc_head.shape[0]:,} x "
           f"{calc_head.shape[1]:,} output head: {no_head_gib:.2f} GiB. So the likely explanation is a count that "
           "leaves the head out (the calculator does not say how it counts). " if round(no_head_gib, 2) == 2.37 else
           "; how it counts cannot be seen from its output. ")
        + "Treat its numbers as a lower bound."
    ))
else:
    print("skipped on CPU: the measured peaks are allocator statistics of a GPU")

# %% [markdown]
# ## 1.7 Is the backward pass twice the forward?
#
# A linear layer's backward pass computes two products (the gradient with respect to the input and the one
# with respect to the weight) where the forward pass computes one, so the backward pass should take about
# twice as long. We time bert-large at batch 4, fp32, with `timing.time_it` (chapter 8 explains it): three
# [warm-up](https://gpu-efficient-training.github.io/book/book/glossary.html#warm-up) calls, then ten timed calls with the device synchronised, reported as the median with its
# interquartile range (IQR) and, on a GPU, the share of the time some kernel was running ([GPU-busy](https://gpu-efficient-training.github.io/book/book/glossary.html#gpu-busy)) and the
# kernels' own time from a few profiled calls. The backward pass is the difference of the two. The rule is about
# the GPU's arithmetic, so we test it on kernel time, which the host's speed at launching kernels does not enter,
# and give the wall times beside it.

# %%
timing_model = models.build("bert-large-uncased", head="sequence-classification")
timing_model.train()
fwd = timing.time_it(lambda: timing_model(**batch).loss, device=prof.device, warmup=3, repeat=10)


def forward_backward():
    timing_model(**batch).loss.backward()


fwd_bwd = timing.time_it(forward_backward, device=prof.device, warmup=3, repeat=10)
bwd_s = fwd_bwd.median_s - fwd.median_s
bwd_fwd_ratio = bwd_s / fwd.median_s
pd.DataFrame({"forward": fwd.summary(), "forward + backward": fwd_bwd.summary()}).T.drop(columns="verdict")

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (1.7 Is the backward pass twice the forward?)
if prof.on_gpu:
    # The rule is about the GPU's arithmetic, so it is tested on kernel time (the profiled calls' GPU work), which
    # the host's speed at launching kernels does not enter; the wall times are given beside it.
    bwd_kernel_s = fwd_bwd.kernel_s - fwd.kernel_s
    kernel_ratio = bwd_kernel_s / fwd.kernel_s
    if abs(kernel_ratio - 2) <= 0.25:
        rule_txt = "close to the rule's 2, which holds for a model whose time is dominated by matrix products."
    else:
        rule_txt = f"{'above' if kernel_ratio > 2 else 'below'} the rule's 2 by more than a quarter."
    display(Markdown(
        f"On this GPU the backward pass's kernels ran for {bwd_kernel_s * 1e3:.1f} ms, {kernel_ratio:.2f} times the "
        f"forward pass's {fwd.kernel_s * 1e3:.1f} ms of kernels: {rule_txt} (Kernel time is the GPU's own work, which "
        f"the host's speed at launching kernels does not enter. By the wall clock the backward pass took "
        f"{bwd_s * 1e3:.1f} ms, {bwd_fwd_ratio:.2f} times the forward pass's {fwd.median_s * 1e3:.1f} ms; "
        f"{fwd_bwd.evidence} for forward and backward together.) "
        "Element-wise operations (dropout, GeLU, layer norm) are bound by memory bandwidth instead, and their "
        "backward pass reads more tensors than their forward pass did; where they weigh more (small hidden sizes, "
        "long sequences with eager attention) the ratio moves away from 2. Chapter 8 profiles where the time goes, "
        "operator by operator."
    ))
else:
    print("skipped on CPU: the tiny model's CPU times say nothing about the GPU kernels the rule is about")

# %% [markdown]
# The chapter ends where it began: every model, optimizer and batch is freed. cuBLAS keeps a workspace for
# each thread that ran a matrix product (the main one and the autograd engine's) until told to let go; we
# release them with PyTorch's own private call, then check that allocated memory is back at the baseline of
# section 1.1.

# %%
cleanup.free(globals(), "timing_model", "model", "optimizer", "batch", "tiny_batch", "ds", "fwd", "fwd_bwd", "loss",
             "saved", "saved_fp32", "saved_amp")
if prof.on_gpu:  # cleanup.back_at_baseline: collect, release cuBLAS's workspaces, compare; LeakError if not back
    display(pd.Series(cleanup.back_at_baseline(baseline_mib)).to_frame("value"))
else:
    print("skipped on CPU: no GPU memory to check")

# %% [markdown]
# ## Summary
#
# - NVML's *used* counts everything on the card (driver, CUDA context, the allocator's cache); torch's
#   *allocated* counts live tensors. Out-of-memory is decided by the first; the second says who owns it.
# - Training memory = weights + gradients + optimizer states (16 bytes per parameter for fp32 AdamW, exactly) +
#   activations (linear in batch size, quadratic in sequence length with eager attention, or with SDPA when it
#   falls back to its math kernel) + temporary buffers; beside them, the runtime's own memory (CUDA context,
#   library workspaces, the allocator's cache), which the guide's six components do not list.
# - Autocast's 16-bit weight copies exist only between forward and backward; the "18 bytes" rule counts them
#   as permanent, the "4 x model" rule ignores activations and temporaries altogether.
# - At small batch the peak can be the optimizer step, not the activations.
# - Pure fp16 AdamW halves the optimizer's memory and breaks training: its squared-gradient state underflows.
#
# ## Use it in your own script
#
# The few lines that apply this chapter to any training loop, without `helpers`: measure the peak of one step
# and compare it with the bytes-per-parameter rule.
#
# ```python
# import torch
#
# n_params = sum(p.numel() for p in model.parameters())
# print(f"model states, fp32 AdamW: {16 * n_params / 2**30:.2f} GiB (16 bytes per parameter)")
# torch.cuda.reset_peak_memory_stats()
# loss = model(**batch).loss
# loss.backward()
# optimizer.step()
# optimizer.zero_grad(set_to_none=True)
# print(f"peak allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB, "
#       f"reserved {torch.cuda.memory_reserved() / 2**30:.2f} GiB")
# ```
#
# ## Exercises
#
# Each exercise has a hint and an answer (or the range to expect) behind a click. Where an exercise asks for a
# number, the line under it checks yours without giving the answer away (it says right, close, or what to look at).
#
# 1. In section 1.3, change the batch from 4 to 8 sequences. Which bars grow, and by what factor? Predict it from
#    the activation table of section 1.4 first. `from helpers import exercises; exercises.check("1.1", your_factor)`
#
#    <details><summary>Hint</summary>
#
#    Only the activations (and the temporaries that scale with them) depend on the batch; weights, gradients and optimizer states do not.
#
#    </details>
#
#    <details><summary>Answer</summary>
#
#    The activation bar about doubles (twice the per-sample bytes of the table in section 1.4, times the number of layers); the weight, gradient and optimizer-state bars do not move. The measured per-layer bytes are in section 1.4's table.
#
#    </details>
#
# 2. Build the activation model of section 1.4 with `num_hidden_layers=12` (pass it to `models.build`). The
#    bytes per layer should not change. Do they? Divide the new per-layer bytes by the old ones:
#    `from helpers import exercises; exercises.check("1.2", your_ratio)`
#
#    <details><summary>Hint</summary>
#
#    The bytes a layer saves depend on batch, sequence, hidden size and heads, not on how many layers there are.
#
#    </details>
#
#    <details><summary>Answer</summary>
#
#    Yes, exactly: `saved_per_layer` reports the bytes that layer 1 saves, and nothing in a layer's saved tensors depends on how many layers there are (the embeddings and the head belong to no layer). The ratio is 1; the total grows with the number of layers.
#
#    </details>
#
# 3. In section 1.5, pass `foreach=False` to `torch.optim.AdamW`. The step's temporary buffers should
#    shrink to one parameter at a time: how much lower is the peak at batch 4, and what does the step cost in
#    time? First, the upper bound: how many GiB is one copy of the 1.3B model's weights in fp16?
#    `from helpers import exercises; exercises.check("1.3", your_gib)`
#
#    <details><summary>Hint</summary>
#
#    The multi-tensor ("foreach") step keeps about one model-sized copy of intermediates; the per-parameter loop keeps one parameter's worth at a time.
#
#    </details>
#
#    <details><summary>Answer</summary>
#
#    If the optimizer step is where the peak is (section 1.5's phase plot shows which phase peaks), the peak falls by up to one copy of the weights in the model's dtype: about 2.5 GiB for 1.33B parameters in fp16. The step gets slower, since it launches several kernels per parameter instead of a few per group.
#
#    </details>
#
# 4. Rerun section 1.5 with `attn_implementation="sdpa"`. Does batch 16 fit on the emulated T4 now? Predict it
#    first: how many GiB do the $34\,sbh$ bytes of all 24 layers take at $s = 256$ and $b = 16$ ($h = 2048$)?
#    `from helpers import exercises; exercises.check("1.4", your_gib)`
#
#    <details><summary>Hint</summary>
#
#    Eager attention stores the $s \times s$ scores and probabilities per head and layer, about $5 a s^2 b$ bytes per layer in 16 bits ([Korthikanti et al. (2022)](https://gpu-efficient-training.github.io/book/book/references.html)); SDPA's fused kernels (flash or memory-efficient) store none of them, its math fallback does.
#
#    </details>
#
#    <details><summary>Answer</summary>
#
#    Most likely not, but only just. At $s = 256$, 16 heads and batch 16, SDPA with a fused kernel saves about 2 GiB over 24 layers ($5 a s^2 b$ bytes per layer). Batch 16 failed in the *second* forward pass, where the gradients are gone (`zero_grad()` set them to `None`) and the weights and AdamW's two states hold 7.4 GiB (2 + 4 bytes per parameter). The $34\,sbh$ part adds 6.4 GiB: 13.8 GiB against the allocator's emulated budget of about 14.0 GiB that section 1.5 printed (the T4's 14.75 GiB minus this process's CUDA context), before the logits ($16 \times 256 \times 30{,}080$ values: 0.23 GiB in fp16, twice that for each fp32 copy the loss makes) and before the backward pass's first gradients. Too close to call by arithmetic: run it. Gradient checkpointing (chapter 4) is what makes batch 16 fit with room to spare.
#
#    </details>
#
# ## References
#
# - [Hugging Face (2024)](https://gpu-efficient-training.github.io/book/book/references.html), *Model training anatomy* and *Methods and tools for efficient training on a single
#   GPU*: the Trainer baseline, the six components, the 16/18/6 bytes-per-parameter rules.
# - [Heo (2024)](https://gpu-efficient-training.github.io/book/book/references.html), chapter 5 (in Korean): the polyglot-ko-1.3b experiment of section 1.5.
# - [Korthikanti et al. (2022)](https://gpu-efficient-training.github.io/book/book/references.html): activation memory per layer.
# - [Hugging Face Accelerate team (2023)](https://gpu-efficient-training.github.io/book/book/references.html), *Model Memory Calculator*: the "4 x model size" training estimate.
# - [Micikevicius et al. (2018)](https://gpu-efficient-training.github.io/book/book/references.html): mixed precision, fp32 master weights and [loss scaling](https://gpu-efficient-training.github.io/book/book/glossary.html#loss-scaling).
# - [Ivanov et al. (2021)](https://gpu-efficient-training.github.io/book/book/references.html): where time goes in transformer training, operator by operator.
#
# All of them, with links, are on the [references page](https://gpu-efficient-training.github.io/book/book/references.html).
