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
# # 10. Capstone: will it fit, and how fast can it go?
#
# Every reader of this book eventually asks two questions about their own run: *will my training fit on
# this GPU*, and *how fast can it go*? The popular tools answer the first one badly. The "four times the
# model size" rule and `accelerate estimate-memory` leave the [activations](https://gpu-efficient-training.github.io/book/book/glossary.html#activations) out, DeepSpeed's estimator counts
# only the model states, and the transformer-math and Ultra-Scale Playbook formulas count the model states and
# the activations but not the temporaries of the loss and of the optimizer step. None
# of them, as far as we know, publishes its error against measured training steps (accelerate's documentation
# checks its estimate for loading a model only). This chapter puts the book's nine chapters into one
# tool, a **memory planner** that predicts the peak of a training step term by term, and then does what
# the others do not: it measures its predictions on the GPU, first on setups it was never fitted to, and
# publishes the error. The second half
# climbs a **speed ladder**, one measured rung at a time, from the Hugging Face guide's plain setup to
# the fastest recipe of this ladder, on bert-large and on the 1.3B GPT-NeoX model, and ends with a
# recipe for fine-tuning the 1.3B model on Colab's free T4.
#
# **What you will learn**
#
# - how to predict the peak memory of a training step before running it, which phase holds it, and which
#   change makes it fit (`helpers.plan`, in Python and from the command line);
# - how far such a prediction is from the allocator's measured peak on setups the planner was never fitted
#   to (Llama-, Mistral- and Qwen2-shaped models), then on the thirty-five it was corrected on, and how far
#   five published estimators are;
# - how much each speed technique of the book buys, stacked rung by rung, in samples/s, tokens/s, model
#   FLOP utilisation ([MFU](https://gpu-efficient-training.github.io/book/book/glossary.html#mfu)), memory and [GPU-busy](https://gpu-efficient-training.github.io/book/book/glossary.html#gpu-busy) time, and where the time goes once the ladder ends;
# - a checklist that sends an out-of-memory error or a slow step to the chapter that fixes it.
#
# **Prerequisites:** chapters 1 to 8; chapter 9 for the fast-path techniques. A CUDA GPU for the
# measurements; on a CPU the notebook runs the planner (pure arithmetic) and tiny versions of the ladder,
# and skips the GPU-only steps, saying so.

# %%
import sys

if "google.colab" in sys.modules:  # Colab only. pip adds what Colab lacks (bitsandbytes, the book's helpers)
    # and upgrades transformers to the 5.x the book needs: nothing has imported it yet in this kernel, so no
    # restart is needed. Colab's torch already meets the book's floor and is kept (see the setup page).
    # %pip install -q --no-warn-conflicts "gpu-efficient-training @ git+https://github.com/gpu-efficient-training/book"

from helpers import env

env.quiet()  # warnings without file paths, no progress bars: outputs that read the same everywhere

import logging
import re
import time

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
from IPython.display import Markdown, display

from helpers import (
    batching,
    cleanup,
    flops,
    gpus,
    measure,
    models,
    plan,
    prose,
    run_profile,
    steps,
    timing,
)
from helpers.measure import GIB, MIB

prof = env.start()  # plot style, number format, run profile; the table below names hardware and versions
dev = prof.device

# %% [markdown]
# Before anything touches the GPU we read [NVML](https://gpu-efficient-training.github.io/book/book/glossary.html#nvml)'s *used* memory, so that the [CUDA context](https://gpu-efficient-training.github.io/book/book/glossary.html#cuda-context) can be measured
# for the T4 emulation of section 10.4 (chapter 1, section 1.5). Then one matrix product loads cuBLAS, and
# we note what PyTorch has allocated: the last cell checks that the chapter gives everything back. The
# chapter's full run is meant to take a few minutes on an H100: its experiments charge their computing time to a
# budget (not the time a reader spends between cells, so reading at human speed skips nothing), and on a slower GPU
# the optional rungs (`torch.compile`) skip themselves, saying so.

# %%
CHAPTER_BUDGET_S = prof.pick(tiny=600.0, full=620.0)
LADDER_RESERVE_S = prof.pick(tiny=150.0, full=400.0)  # section 10.3's speed ladder, its two compile rungs included
MFU_GOAL = {"bert-large-uncased": 42, "polyglot-ko-1.3b": 45}  # the ladder's goals (% MFU), set before it ran
# the experiments charge their computing time to the budget (timing.Budget): reading between cells is not charged
budget = timing.Budget(CHAPTER_BUDGET_S)
charged, seconds_left = budget.charged, budget.seconds_left  # the two calls the sections below make


def one_line(err):
    """An exception as one short line, without file paths (for a table cell or a sentence)."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return re.sub(r"(/[\w.\-]+)+", "<path>", f"{type(err).__name__}: {text}")[:160]




cap = gpus.capability()
AMP = gpus.amp_dtype()
AMP_NAME = {torch.bfloat16: "bf16", torch.float16: "fp16"}[AMP]
t4 = None
ON_T4 = prof.on_gpu and gpus.gpu_key(torch.cuda.get_device_name()) == "T4"  # a real T4: nothing to emulate
if run_profile.cuda_or_skip("the T4 budget and the allocator's baseline need a GPU"):
    nvml_before = measure.nvml_used_mib()
    torch.ones(256, 256, device="cuda") @ torch.ones(256, 256, device="cuda")
    t4 = measure.t4_budget(nvml_before)
    print(f"{cap.name}: compute capability {cap.major}.{cap.minor}; autocast uses {AMP_NAME}")
    print(f"{'T4 budget' if ON_T4 else 'emulated T4'}: {t4.describe()}")
baseline_mib = torch.cuda.memory_allocated() / MIB if prof.on_gpu else 0.0
T4_BUDGET_GIB = t4.budget_gib if t4 else gpus.GPU_MEMORY_GIB["T4"] - gpus.CONTEXT_RESERVE_GIB  # the CLI's T4 budget

# %% [markdown]
# ## 10.1 The planner: predict before you run
#
# `helpers.plan` turns a *setup* (a model from the book's registry or any Hugging Face `config.json`, the
# batch and sequence length, precision, optimizer, accumulation, checkpointing, attention kernel, [LoRA](https://gpu-efficient-training.github.io/book/book/glossary.html#lora) or
# [QLoRA](https://gpu-efficient-training.github.io/book/book/glossary.html#qlora), [ZeRO](https://gpu-efficient-training.github.io/book/book/glossary.html#zero) stage and world size) into a predicted **[peak allocated](https://gpu-efficient-training.github.io/book/book/glossary.html#peak-allocated-memory) memory** of one training step. Each
# term is counted exactly on a CPU (bytes per parameter; the tensors autograd saves, counted on small models of
# each family) and, for BERT and GPT-NeoX, checked against the GPU measurements of the chapters named here
# (the ZeRO shards are chapter 7's formula, not a measurement): weights, gradients and [optimizer states](https://gpu-efficient-training.github.io/book/book/glossary.html#optimizer-states) at their bytes per parameter
# (chapters 1, 2 and 5), the activations the backward pass keeps (chapter 1's formula, minus what
# checkpointing recomputes, chapter 4), [autocast](https://gpu-efficient-training.github.io/book/book/glossary.html#autocast)'s 16-bit copies of the weights (chapter 5), the
# temporaries of the loss, the optimizer step and checkpointing's recomputation (chapters 1 and 4), adapters
# and 4-bit weights (chapter 6) and the ZeRO shards (chapter 7). It also says in which phase the peak falls: the
# forward pass, the backward pass or the optimizer step. Here it is for the 1.3B model, batch 4, 256
# tokens, bf16 autocast and AdamW:

# %%
# NBVAL_CHECK_OUTPUT
# (arithmetic only: the same on every machine, so CI compares it with the GPU run's; printed as text, which
# unlike pandas' HTML does not change between versions)
example = plan.Setup(model="gpt-neox-1.3b", batch=4, seq=256, precision="bf16-autocast", optimizer="adamw")
example_plan = plan.predict(example)
print(example_plan.table().to_string(float_format="{:,.2f}".format, na_rep="—"))

# %% [markdown]
# The table lists what is alive at the peak (*GiB*) and each term's size over the step (*total*), with the
# chapter that measured it. *Total* counts all the weights, gradients and optimizer states, the activations the
# forward pass keeps for the backward pass (under checkpointing only the checkpoints) and the largest of the
# temporaries; so under checkpointing the block being recomputed sits in the peak's activations but not in their
# total, and a peak value can exceed its total. `explain()` says the same per phase:

# %%
# NBVAL_CHECK_OUTPUT
print(example_plan.explain())

# %% [markdown]
# The same from a terminal: `python -m helpers.plan --model gpt-neox-1.3b --batch 4 --seq 256 --gpu T4`
# prints the breakdown, the verdict for the GPU's budget and, when the setup does not fit, the cheapest
# changes that make it fit, ranked by a rough time factor taken from the book's measurements (not a prediction
# of this setup's step time). In a notebook the same command runs
# through the module's `main`:

# %%
# NBVAL_CHECK_OUTPUT
exit_code = plan.main(["--model", "gpt-neox-1.3b", "--batch", "4", "--seq", "256", "--gpu", "T4"])

# %% [markdown]
# ## 10.2 The planner against measurements
#
# A prediction is worth what its error is, and an error measured on the setups a tool was corrected on says
# little about the next setup. This section therefore measures two sets, with the same code (`plan.measure`
# builds the model, runs two real training steps, reads the allocator's peak and frees everything), and
# reports them separately, held-out first:
#
# - **held-out** (`plan.heldout_setups()`, frozen in `helpers/plan/heldout.py` before the planner learned
#   grouped-query attention, a `use_cache` setting or a reserved-memory margin, and before any of them ran):
#   19 setups shaped after Llama-3-8B, Llama-3.2-1B, TinyLlama, Mistral-7B and Qwen2.5 (0.5B and 1.5B), built
#   from their configs with random weights (the 7B/8B shapes keep 2 or 4 of their blocks, so their vocabulary
#   matrices weigh far more in them than in the real models, and so do the loss and head terms), families on which
#   none of the planner's terms was corrected or fitted: their terms were counted exactly on tiny models on a
#   CPU, and never checked against a GPU measurement before these rows ran. They cover grouped-query attention, the
#   generation cache on and off, up to 4096 tokens, peft's standard QLoRA recipe
#   (`prepare_model_for_kbit_training`), 8-bit, paged 8-bit and Adafactor states, accumulation,
#   checkpointing and fp16 autocast. The goal, written down before they ran: a median |error| of at most 3%,
#   a maximum of at most 8%, and at most half of the rows under-predicted. `torch.compile` is not among
#   them: the planner does not model it, and would over-predict a compiled step whose peak compilation lowers
#   (section 10.3's ladder gives the peak of each rung, compiled and not).
# - **in-sample** (`plan.VALIDATION_SETUPS`): bert-large and the 1.3B GPT-NeoX, the rows the planner's
#   terms were checked and corrected on.
#
# The error of a row is (predicted − measured) / measured: negative means the planner promises memory the
# run does not have. A row counts as under-predicted at any negative error, however small; the size of each
# miss is in the table's error column, and the largest negative one is what a safety margin has to cover.

# %%
heldout = plan.heldout_setups(prof.pick(tiny="tiny", full="full"))  # tiny: the same recipes on CPU-sized twins
if not prof.on_gpu:
    print("skipped on CPU: the allocator's peak needs a GPU; the table holds the predictions only")
heldout_runs = []
for row, setup in heldout:
    if not prof.on_gpu:
        measured = {"status": "not measured (CPU)"}
    elif seconds_left() < LADDER_RESERVE_S:  # leave the time the speed ladder needs
        measured = {"status": "not measured (time budget)"}
    else:
        try:
            with charged():
                measured = plan.measure(setup, device=dev, steps=2)  # the in-sample rows' code: 2 steps, then freed
        except Exception as err:  # one failed setup must not end the chapter: the row says what happened
            measured = {"status": f"failed: {one_line(err)}"}
        cleanup.collect()
    heldout_runs.append((row, setup, measured))
heldout_errors = plan.heldout_table(heldout_runs)
heldout_summary = plan.heldout_summary(heldout_errors)
planner_heldout_median_err_pct = heldout_summary["median_abs_pct"]  # NaN when nothing was measured
planner_heldout_max_err_pct = heldout_summary["max_abs_pct"]
under_txt = (f", {heldout_summary['under']} under-predicted ({heldout_summary['under_share']:.0%})"
             if heldout_summary["measured"] else "")
print(f"planner_heldout_median_err_pct = {planner_heldout_median_err_pct:.2f}, "
      f"planner_heldout_max_err_pct = {planner_heldout_max_err_pct:.2f} "
      f"({heldout_summary['measured']} of {heldout_summary['rows']} held-out rows measured{under_txt})")
heldout_errors.drop(columns=["why", "status"]).set_index("name")

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (10.2 The planner against measurements)
display(Markdown(plan.describe_heldout(heldout_errors)))

# %% [markdown]
# ### In-sample: the rows the planner was corrected on
#
# For every setup in `plan.VALIDATION_SETUPS` (both model families;
# fp32, bf16 and fp16; AdamW, fused AdamW, SGD, Adafactor and 8-bit AdamW; accumulation; checkpointing;
# eager and [SDPA](https://gpu-efficient-training.github.io/book/book/glossary.html#sdpa) attention; LoRA and QLoRA) the notebook runs a few real training steps and reads the
# allocator's peak (`plan.measure`, which frees everything before it returns), and sets the planner's
# prediction beside it. (ZeRO is planned with chapter 7's formula and not measured here: it needs several
# processes.) Five other estimators predict the same rows:
#
# - **4 × model size**: the Hugging Face model-memory calculator's rule of thumb for training with Adam
#   ([Hugging Face Accelerate team (2023)](https://gpu-efficient-training.github.io/book/book/references.html)): four times the weights' bytes in the training dtype;
# - **accelerate estimate-memory**: the same tool's command line. For training with Adam it works out four
#   terms for a batch of one (the weights, the gradients, Adam's states, the optimizer step) and prints the
#   *largest* of them, not their sum: four times the fp32 weights in fp32, and in [mixed precision](https://gpu-efficient-training.github.io/book/book/glossary.html#mixed-precision) Adam's
#   states alone, twice the fp32 weights. Nothing that grows with the batch is counted;
# - **ZeRO model states**: the ZeRO paper's 16 bytes per parameter for mixed-precision Adam (2 + 2 + 12),
#   divided by the world size per stage ([Rajbhandari et al. (2020)](https://gpu-efficient-training.github.io/book/book/references.html));
# - **transformer math**: model states plus the activation formula of [Korthikanti et al. (2022)](https://gpu-efficient-training.github.io/book/book/references.html), as in
#   EleutherAI's *Transformer Math 101* ([Anthony et al. (2023)](https://gpu-efficient-training.github.io/book/book/references.html)). The column uses the post's
#   mixed-precision AdamW states (16 bytes per parameter) and its no-recomputation activation formula (16-bit
#   activations) on every row; the post also gives bytes per parameter for other optimizers and a formula for
#   fully recomputed activations, which this column does not use. With SDPA it drops the formula's
#   attention-score term, which a fused attention kernel never stores;
# - **Ultra-Scale Playbook**: Hugging Face's *Ultra-Scale Playbook* ([Tazi et al. (2025)](https://gpu-efficient-training.github.io/book/book/references.html),
#   "Memory usage in Transformers"): in mixed precision $m_{params} = 2N$, $m_{grad} = 2N$,
#   $m_{params\_fp32} = 4N$ and $m_{opt} = (4+4)N$ bytes for $N$ parameters (16 bytes per parameter; "some
#   libraries store grads in FP32", 4 bytes more, which this column leaves out), plus its activations "in mixed
#   precision", $m_{act} = L \cdot seq \cdot bs \cdot h \cdot (34 + 5 \cdot n_{heads} \cdot seq / h)$ bytes
#   (after Korthikanti et al.). The column applies that formula as printed, on every attention kernel: the
#   Playbook notes that FlashAttention already recomputes the attention scores but gives no formula without
#   them, and the transformer-math column above is exactly that formula with the term dropped. It counts no
#   temporaries, no key/value cache and no logits (`plan.playbook_bytes`).
#
# The other estimators describe full-parameter, mixed-precision training with Adam on one GPU: 16-bit copies of
# fp32 master weights, and (Korthikanti's formula) 16-bit activations without recomputation
# (`plan.baseline_domains` says, row by row, whether a setup lies inside each one's domain). Rows with adapters,
# other optimizers, checkpointing, fp32 or pure 16-bit weights are outside what they claim to cover, and their
# errors there say as much about the domain as about the formula; the rows inside it are the autocast AdamW
# rows without adapters or checkpointing (#5–7, 18–20 and 29), the ones to read for a fair comparison. On
# those rows the weights are fp32, so four times their bytes is 16 bytes per parameter: there the
# *4 × model size* and *ZeRO model states* columns are the same number, and five estimators give four
# distinct predictions.

# %%
validation_setups = plan.VALIDATION_SETUPS
if not prof.on_gpu:
    print("skipped on CPU: the allocator's peak needs a GPU; the table holds the predictions only")
rows = {}
for i, setup in enumerate(validation_setups, 1):
    predicted = plan.predict(setup)
    row = {"setup": setup.label(), "predicted peak (GiB)": predicted.peak_gib, "predicted phase": predicted.peak_phase}
    if not prof.on_gpu:
        measured = {"status": "not measured (CPU)"}
    elif seconds_left() < LADDER_RESERVE_S:  # leave the time the speed ladder needs
        measured = {"status": "not measured (time budget)"}
    else:
        try:
            with charged():
                measured = plan.measure(setup, device=dev, steps=2)  # builds, runs 2 steps, frees everything
        except Exception as err:  # one failed setup must not end the chapter: the row says what happened
            measured = {"status": f"failed: {one_line(err)}"}
        cleanup.collect()
    ok_run = measured["status"] == "ok"
    row["measured peak (GiB)"] = measured["peak_allocated_bytes"] / GIB if ok_run else np.nan
    row["measured phase"] = measured["peak_phase"] if ok_run else measured["status"]
    for name, bytes_ in plan.baselines(setup).items():
        row[f"{name} (GiB)"] = bytes_ / GIB
    rows[i] = row
validation = pd.DataFrame(rows).T.rename_axis("#")
gib_cols = [c for c in validation.columns if c.endswith("(GiB)")]
validation[gib_cols] = validation[gib_cols].astype(float)
validation["planner error (%)"] = (validation["predicted peak (GiB)"] / validation["measured peak (GiB)"] - 1) * 100
validation[["setup", "predicted peak (GiB)", "measured peak (GiB)", "planner error (%)", "predicted phase", "measured phase"]]

# %%
BASELINES = [c[: -len(" (GiB)")] for c in validation.columns
             if c.endswith("(GiB)") and c not in ("predicted peak (GiB)", "measured peak (GiB)")]
errors = pd.DataFrame({"the planner": validation["planner error (%)"]})
for name in BASELINES:
    errors[name] = (validation[f"{name} (GiB)"] / validation["measured peak (GiB)"] - 1) * 100
measured_ok = validation["measured peak (GiB)"].notna()
error_summary = pd.DataFrame({
    "median |error| (%)": errors[measured_ok].abs().median(),
    "max |error| (%)": errors[measured_ok].abs().max(),
    "rows under-predicted": (errors[measured_ok] < 0).sum(),
    "rows measured": measured_ok.sum(),
}).rename_axis("estimator")
# The domain each other estimator claims (plan.baseline_domains): full-parameter, mixed-precision (autocast)
# AdamW on one GPU, no checkpointing. Each is judged on the rows of its own domain; the planner on the rows
# that lie in all of them.
domains = pd.DataFrame({i: plan.baseline_domains(s_) for i, s_ in enumerate(validation_setups, 1)}).T
domains = domains.reindex(columns=BASELINES, fill_value=False).astype(bool)
in_domain = domains.all(axis=1)
in_domain_ok = measured_ok & in_domain
DOMAIN_MEDIAN, DOMAIN_MAX = "median |error|, rows of its domain (%)", "max |error|, rows of its domain (%)"
DOMAIN_ROWS = "rows of its domain measured"
own = pd.DataFrame({"the planner": in_domain_ok, **{name: measured_ok & domains[name] for name in BASELINES}})
error_summary[DOMAIN_MEDIAN] = pd.Series({c: errors.loc[own[c], c].abs().median() for c in errors.columns})
error_summary[DOMAIN_MAX] = pd.Series({c: errors.loc[own[c], c].abs().max() for c in errors.columns})
error_summary[DOMAIN_ROWS] = own.sum()
planner_median_err_pct = float(error_summary.loc["the planner", "median |error| (%)"])
planner_max_err_pct = float(error_summary.loc["the planner", "max |error| (%)"])
error_summary

# %%
fig, ax = plt.subplots(figsize=(10, 6.5))
ok = validation[measured_ok]
if len(ok):
    plotted = ok[[c for c in ok.columns if c.endswith("(GiB)")]].to_numpy(float)
    lo, hi = np.nanmin(plotted[plotted > 0]) / 1.3, np.nanmax(plotted) * 1.3
    ax.fill_between([lo, hi], [lo * 0.9, hi * 0.9], [lo * 1.1, hi * 1.1], color="0.9", label="±10%")
    ax.plot([lo, hi], [lo, hi], "k-", lw=1, label="predicted = measured")
    for name, marker in zip(BASELINES, ["s", "^", "v", "D", "P"]):
        ax.scatter(ok["measured peak (GiB)"], ok[f"{name} (GiB)"], marker=marker, s=22, alpha=0.6, label=name)
    ax.scatter(ok["measured peak (GiB)"], ok["predicted peak (GiB)"], marker="o", s=40, color="k",
               label="the planner", zorder=5)
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), aspect="equal")
    for axis in (ax.xaxis, ax.yaxis):  # plain numbers on the log axes: 1, 2, 5, 10, 20, ...
        axis.set_major_locator(plt.matplotlib.ticker.LogLocator(subs=(1, 2, 5)))
        axis.set_major_formatter(plt.matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        axis.set_minor_formatter(plt.matplotlib.ticker.NullFormatter())
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1), fontsize=8)
    others = error_summary.drop("the planner")[DOMAIN_MEDIAN].dropna()
    others_txt = (f"on the {int(in_domain_ok.sum())} rows of their domain the other {len(others)} estimators by "
                  f"{others.min():.0f}% to {others.max():.0f}%" if len(others) else
                  "no measured row lies in the other estimators' domain")
    ax.set_title(f"{len(ok)} in-sample setups: the planner is off by a median of {planner_median_err_pct:.1f}%; "
                 f"{others_txt}", fontsize=10)
else:
    ax.text(0.5, 0.5, "measured peaks need a GPU", ha="center", va="center", transform=ax.transAxes)
ax.set_xlabel("measured peak allocated (GiB)")
ax.set_ylabel("predicted peak (GiB)")
fig.tight_layout()

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (In-sample)
WHAT_IT_COUNTS = {
    "4x": "it counts four times the weights and nothing that grows with the batch",
    "accelerate": "it prints the largest of its terms for a batch of one (weights, gradients, Adam's states, the "
                  "step), not their sum, and nothing that grows with the batch",
    "ZeRO": "it counts the model states only (16 bytes per parameter), nothing that grows with the batch",
    "transformer": "the column applies the post's mixed-precision AdamW states (16 bytes per parameter) and its "
                   "activations without recomputation to every row (the post also gives other optimizers' bytes and "
                   "2·s·b·h·L for full recomputation), and counts no adapters or temporaries",
    "Ultra-Scale": "it counts the Playbook's mixed-precision states (16 bytes per parameter) and its m_act as printed, "
                   "the attention-score term included on every kernel, and no adapters, temporaries, cache or logits",
}
def domain_words(name):  # the estimator's error on the measured rows of its claimed domain, or why there is none
    n_rows = int(error_summary.loc[name, DOMAIN_ROWS])
    if n_rows == 0:
        return "none of the measured rows lies in the domain it claims"
    rows = "row" if n_rows == 1 else "rows"
    return (f"on the {n_rows} measured {rows} of the domain it claims: median "
            f"{error_summary.loc[name, DOMAIN_MEDIAN]:.0f}%, max {error_summary.loc[name, DOMAIN_MAX]:.0f}%")


if measured_ok.sum() >= 3:
    sm = error_summary
    worst = errors.loc[measured_ok, "the planner"].abs().idxmax()
    wrow = validation.loc[worst]
    heldout_txt = (f"on the held-out rows above it was {planner_heldout_median_err_pct:.1f}% and "
                   f"{planner_heldout_max_err_pct:.1f}%" if heldout_summary["measured"] else
                   "the held-out rows above were not measured in this run")
    lines = [
        f"Over the {int(sm.loc['the planner', 'rows measured'])} measured in-sample setups, the rows its terms were "
        f"checked and corrected on, the planner is off by a median of {planner_median_err_pct:.1f}% and at most "
        f"{planner_max_err_pct:.1f}% ({heldout_txt}). "
        f"Its worst row is #{worst}, *{wrow['setup']}*: predicted {wrow['predicted peak (GiB)']:.2f} GiB, measured "
        f"{wrow['measured peak (GiB)']:.2f} GiB.\n",
        "The other estimators, on every measured row and on the rows of the domain each claims (full-parameter "
        "mixed-precision AdamW on one GPU, without adapters or checkpointing):\n",
    ]
    for name in BASELINES:
        median_signed = errors.loc[measured_ok, name].median()
        counts = next(v for k, v in WHAT_IT_COUNTS.items() if name.startswith(k))
        lines.append(
            f"- **{name}**: median |error| {sm.loc[name, 'median |error| (%)']:.0f}%, max {sm.loc[name, 'max |error| (%)']:.0f}% "
            f"({domain_words(name)}); "
            f"it predicts less than the measured peak in {int(sm.loc[name, 'rows under-predicted'])} of "
            f"{int(sm.loc[name, 'rows measured'])} rows (median signed error {median_signed:+.0f}%): {counts}.")
    phase_match = (ok["predicted phase"] == ok["measured phase"]).mean()
    lines.append(f"\nThe planner names the phase that holds the peak correctly in {phase_match:.0%} of the rows.")
    display(Markdown("\n".join(lines)))
else:
    print("skipped on CPU: the errors need measured peaks" if not prof.on_gpu
          else "too few setups were measured for an error summary")

# %% [markdown]
# A reading of the sentences above: the *rows under-predicted* column says how often each estimator
# promises memory the run does not have. The planner's error here is an in-sample error: these are the rows
# its terms were checked and corrected on (the key/value-cache term below was added after the book's first
# run of this table). For a setup of your own, the held-out error above is the better guide. When a plan
# comes close to the budget, leave a margin of at least the planner's largest held-out *under*-prediction (an
# over-prediction wastes memory but does not run out of it), plus the
# allocator's fragmentation (reserved minus allocated, chapter 8), which a peak of *allocated* memory does
# not include: the command line keeps a stated 5% above the predicted peak before it says "fits"
# (`--margin-pct` changes it; chapter 8, section 8.5, measures that slack with and without `expandable_segments`).

# %% [markdown]
# **Which term is off?** Each row switches some terms on (eager attention's s × s matrices, checkpointing's
# recomputed layer, LoRA's adapters, QLoRA's 4-bit weights, an optimizer's states, autocast over an fp32
# residual stream). A mean error per feature can blame a feature for one bad row, so the sentence below
# starts from the rows instead: it takes the rows that are off by clearly more than the rest and says
# what they share (family, precision, checkpointing, and the phase that holds the measured peak against
# the predicted one), and whether the other rows with the same features are fine. The table groups the
# signed error by each feature, with the median beside the mean so that one row cannot carry a group.

# %%
def features(setup, measured_phase, predicted_phase):
    family = "BERT" if "bert" in setup.label() else "GPT-NeoX"
    return {
        "family": family,
        "precision": setup.precision + (" (QLoRA)" if setup.qlora else ""),
        "attention": setup.attention,
        "checkpointing": "none" if setup.checkpointing in ("none", None) else "on",
        "autocast over": ("no autocast" if not (setup.precision.endswith("autocast") or setup.qlora or setup.lora_rank)
                          else "fp32 stream" if setup.qlora or setup.precision.endswith("autocast")
                          else "16-bit stream"),
        "adapters": "QLoRA" if setup.qlora else ("LoRA" if setup.lora_rank else "none"),
        "optimizer": setup.optimizer,
        "accumulation": "yes" if setup.grad_accum > 1 else "no",
        "peak phase (measured / predicted)": f"{measured_phase} / {predicted_phase}",
    }


feat = pd.DataFrame([features(s_, validation.loc[i, "measured phase"], validation.loc[i, "predicted phase"])
                     for i, s_ in enumerate(validation_setups, 1)], index=validation.index)
feat["error"] = validation["planner error (%)"].astype(float)
by_feature = pd.concat(
    {col: feat[measured_ok].groupby(col)["error"].agg(rows="size", mean_error_pct="mean", median_error_pct="median",
                                                      max_abs_error_pct=lambda e: e.abs().max())
     for col in feat.columns.drop("error")}, names=["feature", "value"])
by_feature.rename(columns={"mean_error_pct": "mean error (%)", "median_error_pct": "median error (%)",
                           "max_abs_error_pct": "max |error| (%)"})

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (In-sample)
if measured_ok.sum() >= 3:
    err_ok = feat.loc[measured_ok, "error"]
    threshold = max(1.0, 3 * err_ok.abs().median())  # "clearly more than the rest"
    worst_sign = np.sign(err_ok.loc[err_ok.abs().idxmax()])
    large = err_ok[(err_ok.abs() > threshold) & (np.sign(err_ok) == worst_sign)].sort_values(key=abs, ascending=False)
    direction = "under" if worst_sign < 0 else "over"
    parts = [f"The planner's median signed error over the measured rows is {err_ok.median():+.2f}%."]
    if large.empty:
        parts.append(f"No row is off by more than {threshold:.1f}% (three times the median |error|, at least 1%): "
                     "no single term stands out.")
    else:
        parts.append(f"The largest error is an {direction}-prediction; {len(large)} row{'s are' if len(large) > 1 else ' is'} "
                     f"{direction}-predicted by more than {threshold:.1f}% (three times the median |error|, at least 1%): "
                     + ", ".join(f"#{i} ({e:+.1f}%)" for i, e in large.items()) + ".")
        # greedily, the feature values that together still hold at least 80% of these rows
        common, covered = {}, large.index
        if len(large) > 1:
            for col in feat.columns.drop("error"):
                counts = feat.loc[covered, col].value_counts()
                if counts.iloc[0] >= 0.8 * len(large):
                    common[col] = counts.index[0]
                    covered = covered[feat.loc[covered, col] == counts.index[0]]
        if common:
            held = feat[measured_ok]
            for col, val in common.items():
                held = held[held[col] == val]
            others = held.drop(index=covered)
            parts.append(f"{len(covered)} of them share " + "; ".join(f"{col} *{val}*" for col, val in common.items()) + ". "
                         + (f"The {len(others)} other row{'s' if len(others) > 1 else ''} with all of these features "
                            f"{'are' if len(others) > 1 else 'is'} off by at most {others['error'].abs().max():.1f}%."
                            if len(others) else "No other row has all of these features: they mark the term to suspect."))
            ph = common.get("peak phase (measured / predicted)", "")
            measured_ph, _, predicted_ph = ph.partition(" / ")
            if ph and measured_ph != predicted_ph:
                said = {"forward": "forward pass", "backward": "backward pass"}
                measured_ph, predicted_ph = said.get(measured_ph, measured_ph), said.get(predicted_ph, predicted_ph)
                parts.append(f"The measured peak is in the {measured_ph} where the planner puts it in the {predicted_ph}: "
                             f"the term to suspect is what these rows hold during the {measured_ph}.")
        elif len(large) > 1:
            parts.append("No feature is shared by most of them: no single term stands out.")
    display(Markdown(" ".join(parts)))
else:
    print("skipped on CPU: the errors need measured peaks" if not prof.on_gpu
          else "too few setups were measured for an error summary")

# %% [markdown]
# One term of the planner comes from this table itself: the **key/value cache**. Unless you turn it off
# (`use_cache=False`, or Hugging Face's own `gradient_checkpointing_enable`, which does so), a Hugging Face
# causal LM builds a generation cache even in training: every block appends its keys and values to a cache
# that lives in the model's output until the loop drops it, after the forward pass. Under autocast from an
# fp32 residual stream (fp32 weights, or QLoRA's fp32 stream) the rotary embedding's fp32 tables promote the
# keys to fp32, and the cache's concatenation promotes the values too. Attention saves 16-bit casts
# instead, so the cache's 8 bytes per token, hidden unit and layer are not shared with any saved tensor and
# no count of saved tensors sees them. Before this term was added, the planner under-predicted the forward
# peaks of these rows (GPT-NeoX, autocast over fp32, no checkpointing), and the rows in the table above are
# the ones it was corrected on: read its error as an in-sample error. `plan.kv_cache_bytes` counts the cache
# in the forward pass (`plan.predict(setup, kv_cache=False)` leaves it out). The cache is waste in training:
# for the 1.3B model at batch 8 and 2048 tokens it is 6 GiB. A loop that passes `use_cache=False` does not
# pay it, but it is not what `kv_cache=False` predicts: without the cache, GPT-NeoX's SDPA saves a view of
# the fused query/key/value output instead of a copy (4 more bytes per token and hidden unit in 16 bits).
# `plan.Setup(..., use_cache=False)` (`--no-cache` on the command line) plans that loop, and with
# grouped-query attention (Llama-3, Mistral, Qwen2) the cache and the saved keys and values are as narrow as
# the key/value heads: both were added after the held-out set was frozen. The held-out rows test the narrow
# saved keys and values, which are alive at a backward-pass peak. The cache itself lives only through the
# forward pass (the loop drops the model's output before `backward()`), so a row tests the cache term only
# when its peak falls in the forward pass: the phase columns of the held-out table say which rows do.

# %% [markdown]
# For the three rows with the largest errors, the predicted breakdown (GiB) beside the measured peak:

# %%
worst_rows = errors.loc[measured_ok, "the planner"].abs().sort_values(ascending=False).head(3).index
term_table = pd.DataFrame({
    f"#{i}": {**{k: v / GIB for k, v in plan.predict(validation_setups[i - 1]).components.items()},
              "predicted peak": validation.loc[i, "predicted peak (GiB)"],
              "measured peak": validation.loc[i, "measured peak (GiB)"]}
    for i in worst_rows
}).rename_axis("GiB")
term_table if len(worst_rows) else print("skipped on CPU: no measured rows" if not prof.on_gpu else "no measured rows")

# %% [markdown]
# ## 10.3 The speed ladder
#
# Now the second question: how fast? We start from the setup of the Hugging Face guide *Model training
# anatomy* ([Hugging Face (2024)](https://gpu-efficient-training.github.io/book/book/references.html)), written when these were the defaults: fp32
# weights and arithmetic, eager attention, batch 4, and an AdamW that steps one parameter at a time
# (`Trainer`'s `adamw_hf` then; here `torch.optim.AdamW(foreach=False)`, the slowest of PyTorch's three
# AdamW implementations). Recent transformers versions load models with SDPA attention, and recent `Trainer`
# versions default to fused AdamW with torch 2.8 or newer: two rungs of this ladder. We add the book's
# techniques **one at a time, keeping each**, on the same model in the same run:
#
# 1. the batch (chapter 3): from the guide's to one meant to let the GPU, not the CPU's kernel launches, set
#    the step's length; every later rung is judged at this batch, where a change to the GPU's work shows. The
#    GPU-busy column says how far it gets: until fused AdamW replaces the for-loop optimizer, that optimizer's
#    thousands of launches can still leave the GPU idle for part of the step;
# 2. 16-bit autocast (chapter 5): matrix products on the [tensor cores](https://gpu-efficient-training.github.io/book/book/glossary.html#tensor-cores);
# 3. SDPA attention (chapter 1): one fused attention kernel, no stored s × s matrix;
# 4. fused AdamW (chapters 5 and 8): the optimizer step in a few kernels. It comes after the two rungs that
#    shorten the forward and backward passes: the optimizer step costs the same at any batch, so its share of
#    the step, and what fusing it saves, is largest once the rest has become fast (in fp32 at batch 32 it is a
#    few per cent of bert-large's step, which is too close to the ±3% threshold to give a verdict that holds);
# 5. a batch twice as large again (chapter 3), the largest the ladder tries;
# 6. `torch.compile` (chapter 9), kept only if it is faster beyond ±3% (its whole interval above 1.03).
#
# A padding check (chapter 5: matrix dimensions in multiples of 8) comes with it; it needs no rung here. The
# first rung, the guide's setup at the guide's batch, is timed on its own with `timing.time_it` (warm-up steps,
# 10 timed ones, the spread, and profiled steps for the GPU-busy fraction). Each later rung is *compared* with
# the one before it, interleaved in one process (`timing.interleaved`, next cells), with the batch already on the
# GPU. The order matters: at the guide's batch a step can be [host-bound](https://gpu-efficient-training.github.io/book/book/glossary.html#host-bound), and there a rung that shrinks the GPU's
# work may not shorten the step at all; judged at a batch meant to keep the GPU busy, each rung shows what it
# does to the GPU's work (the text under the tables names any rung where one side of the rounds kept the GPU
# busy less than 90% of its step). The ladder ends with the fastest recipe *of this ladder*, not the fastest the book can build
# (CUDA graphs, a fused cross-entropy or other attention backends are not on it). The causal LM trains without
# Hugging Face's generation cache (`use_cache = False`), which a training step never reads (section 10.2).
#
# **MFU, the one convention of the book.** Model FLOPs per token are 6 × (the parameters of every matrix
# product, the output projection included, embedding lookups excluded) + 12 · L · h · s for attention
# (`flops.flops_per_token`; [Chowdhery et al. (2022)](https://gpu-efficient-training.github.io/book/book/references.html), appendix B), with no credit for recomputation.
# The attention term counts the full s × s score matrix, as PaLM does, even for the causal 1.3B model, whose
# fused kernel skips about half of it: the 1.3B's MFU is higher under this convention than under one that
# counts causal attention at half. The table below also gives MFU under two other conventions (6N alone,
# and causal attention at half), so that a number from a paper can be set beside the one that matches it.
# (bert-large's pooler and classifier run on one token per sequence; counting their parameters for every
# token, as this convention does, adds a fraction of a per cent to its FLOPs.)
#
# **What to expect.** The chapter aims for 10 times the vanilla throughput, and for an MFU of 42% on
# bert-large and 45% on the 1.3B model: targets of this book, not published results. For scale, the
# published numbers are for far larger models trained on many accelerators with hand-tuned kernels: PaLM
# 540B ran at 46.2% MFU on 6,144 TPU v4 chips ([Chowdhery et al. (2022)](https://gpu-efficient-training.github.io/book/book/references.html)), and
# Megatron-LM's 530B GPT at 54.2% on 2,240 A100s with selective recomputation
# ([Korthikanti et al. (2022)](https://gpu-efficient-training.github.io/book/book/references.html)). In such models the matrix products dwarf everything
# else. A 0.3B or 1.3B model in plain PyTorch spends a larger share of its step in element-wise kernels,
# normalisation and the loss, and on an H100 or H200 this share weighs more than on an A100: the datasheet
# tensor-core peak grew about 3.2 times from the A100 to the H100, the memory bandwidth only about 1.6
# (H100) to 2.4 (H200) times (against the 80 GB A100). So expect a lower MFU than these papers report.
#
# MFU is the achieved model FLOP/s over the GPU's datasheet dense 16-bit peak (bf16, or fp16 on a GPU without
# bf16 tensor cores: 989 TFLOP/s on an H100 or H200 SXM, 65 on a T4; `gpus.PEAK_TFLOPS`). The fp32 rungs
# are measured against the same 16-bit peak, so that all rungs share one yardstick. We also give MFU against
# the **measured matmul ceiling**: the rate of one large 16-bit matrix product on this GPU, which is what the
# tensor cores really deliver. Each step is timed on its own and ends with a synchronisation, so a training
# loop, where the CPU queues step n+1 while the GPU runs step n, can be slightly faster on a host-bound rung.
# Peak memory is the allocator's peak over one more step after the timed ones.

# %%
n_mm = prof.pick(tiny=512, full=8192)
mm_dtype = AMP if prof.on_gpu else torch.float32
gen = torch.Generator(device=dev).manual_seed(0)
a = torch.randn(n_mm, n_mm, device=dev, dtype=mm_dtype, generator=gen)
b = torch.randn(n_mm, n_mm, device=dev, dtype=mm_dtype, generator=gen)
mm = timing.time_it(lambda: a @ b, device=dev, warmup=3, repeat=10)
ceiling_tflops = 2 * n_mm**3 / (mm.kernel_s if mm.kernel_s else mm.wall.median) / 1e12
try:
    peak_tflops = gpus.peak_tflops(torch.cuda.get_device_name(), AMP) if prof.on_gpu else None  # fp16 on a T4
except ValueError:  # a GPU the table does not know
    peak_tflops = None
cleanup.free(globals(), "a", "b", "gen")
pd.Series({
    f"measured matmul ceiling, {n_mm} x {n_mm} (TFLOP/s)": ceiling_tflops,
    f"datasheet dense {AMP_NAME} peak (TFLOP/s)": peak_tflops if peak_tflops else np.nan,
}, name="value").to_frame()

# %% [markdown]
# The ladder's code. The step is the book's (`steps.make_step`: forward under autocast, backward, optimizer, with
# its phases marked for the profiler); each rung changes the batch, the optimizer, the precision, the attention
# kernel or the compilation, and nothing else. The causal LM's generation cache is off (`use_cache = False`):
# training never reads it. Rung *k* is judged against rung *k* − 1 by `timing.interleaved`: the two steps run in
# alternating rounds (10 after warm-up) on the same model, and each round gives a ratio of their times, per sample
# where the batch changes (`timing.per_sample`). The speed-up is the median of those ratios, with its 95% interval;
# it is "faster" only when the whole interval lies above 1.03, "slower" only when it lies below 1/1.03, else "no
# practical difference" (chapter 8, section 8.1). The two sides of a round run milliseconds apart, so a host whose speed drifts
# moves both alike. The attention kernel belongs to the model, so each side sets its own before each sample
# (untimed). A rung that does not fit the GPU becomes a row that says so.

# %%
LADDER = {
    "bert-large-uncased": dict(head="sequence-classification", task="classification",
                               seq_len=prof.pick(tiny=32, full=512), batch=prof.pick(tiny=2, full=4),
                               ladder_batch=prof.pick(tiny=4, full=32), big_batch=prof.pick(tiny=8, full=64)),
    "polyglot-ko-1.3b": dict(head="causal-lm", task="causal-lm", seq_len=prof.pick(tiny=32, full=2048),
                             batch=1, ladder_batch=prof.pick(tiny=2, full=4), big_batch=prof.pick(tiny=4, full=8)),
}
ROUNDS, WARMUP, REPEAT = 10, prof.pick(tiny=1, full=2), 10


def make_optimizer(model, kind):
    if kind == "for-loop":  # the guide's adamw_hf stepped one parameter at a time; foreach=False does the same
        return torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=False)
    return torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)


def set_attention(model, kind):
    """Switch the attention kernel of a built model ("eager" or "sdpa")."""
    if getattr(model.config, "_attn_implementation", None) == kind:
        return
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(kind)
    else:  # older transformers: the layers read the config at each call
        model.config._attn_implementation = kind


def rung_step(model, name, rung, optimizers):
    """One rung's step and its switch (the attention kernel, set before each call). Rungs with the same optimizer
    share it: two AdamW objects on one model hold two sets of states, which only the optimizer rung needs (``judge``
    drops the rung before's once its rounds are over)."""
    if rung["optimizer"] not in optimizers:
        optimizers[rung["optimizer"]] = make_optimizer(model, rung["optimizer"])
    cfg = LADDER[name]
    batch = steps.batch_for(cfg["task"], rung["batch"], cfg["seq_len"], dev)
    return (steps.make_step(model, optimizers[rung["optimizer"]], batch, amp=rung["amp"]),
            lambda: set_attention(model, rung["attention"]))


def steady_peak_gib(step, switch):
    """The allocator's peak over one more step, after the timed ones (optimizer states exist by then)."""
    if not prof.on_gpu:
        return np.nan
    switch()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / GIB


def judge(model, name, prev, cur, optimizers, stances=None):
    """Rung ``cur`` against rung ``prev``, interleaved, per sample; its peak (GiB) after the timed rounds.
    ``stances``: torch.compile stances of the two sides (the compile rung runs one model compiled and not)."""
    (fa, sa), (fb, sb) = rung_step(model, name, prev, optimizers), rung_step(model, name, cur, optimizers)
    if stances:
        sa = lambda f=sa: (f(), torch.compiler.set_stance(stances[0]))  # noqa: E731
        sb = lambda f=sb: (f(), torch.compiler.set_stance(stances[1]))  # noqa: E731
    c = timing.interleaved(fa, fb, device=dev, names=("rung before", "this rung"), rounds=ROUNDS, warmup=WARMUP,
                           profile_steps=1, setup_a=sa, setup_b=sb)
    del fa
    for kind in [k for k in optimizers if k != cur["optimizer"]]:
        del optimizers[kind]  # the rung before's optimizer and its states are not part of this rung's peak
    return timing.per_sample(c, prev["batch"], cur["batch"]), steady_peak_gib(fb, sb)

# %% [markdown]
# One row per rung: throughput from the median step time of the rung's side of the interleaved rounds, MFU
# against both ceilings (and under the two other conventions), the speed-up over the rung before with its
# interval and verdict, the memory and the profiler's evidence (the GPU-busy fraction, and the GPU time: the
# summed kernel time of a profiled step). The table is shown in two parts: the climb, then the evidence.
# Each row's throughput comes from the rounds that judged that rung; its speed-up from the same rounds. A
# rung is also timed a second time, as "the rung before" in the next rung's rounds, and where it is
# host-bound (GPU busy well under 90%) the CPU can run it at another speed there. So the ratio of two rows'
# tokens/s can differ from the speed-up column: the speed-up and its interval, measured side by side in one
# set of rounds, are the comparison; the tokens/s column is each rung's own level.

# %%
CLIMB_COLUMNS = ["batch", "attention", "precision", "AdamW", "compiled", "tokens/s", "MFU vs datasheet (%)",
                 "speed-up per sample", "95% interval", "verdict"]
EVIDENCE_COLUMNS = ["samples/s", "MFU vs matmul ceiling (%)", "MFU, 6N only (%)", "MFU, causal attention at half (%)",
                    "peak allocated (GiB)", "GPU busy", "step median (ms)", "GPU time (ms)",
                    "GPU-time speed-up per sample", "note"]


def rung_row(name, model, rung, t, peak_gib, c=None, prev_batch=None):
    seq = LADDER[name]["seq_len"]
    n_params, n_layers, hidden = flops.matmul_params(model), model.config.num_hidden_layers, model.config.hidden_size
    per_token = flops.flops_per_token(n_params, n_layers, hidden, seq)  # 6N + 12·L·h·s, the book's convention
    attention = 12 * n_layers * hidden * seq
    per_token_causal = per_token - attention / 2 if LADDER[name]["head"] == "causal-lm" else per_token
    tok_s = rung["batch"] * seq / t.wall.median
    gpu_speedup = np.nan
    if c is not None and c.a.kernel_s and c.b.kernel_s:  # kernel time per sample, the rung before over this one
        gpu_speedup = (c.a.kernel_s / prev_batch) / (c.b.kernel_s / rung["batch"])
    return {
        "batch": rung["batch"], "attention": rung["attention"],
        "precision": f"{AMP_NAME} autocast" if rung["amp"] else "fp32",
        "AdamW": rung["optimizer"], "compiled": rung.get("compiled", False),
        "tokens/s": tok_s,
        "MFU vs datasheet (%)": flops.mfu(tok_s, per_token, peak_tflops) * 100 if peak_tflops else np.nan,
        "speed-up per sample": c.speedup if c else np.nan,
        "95% interval": f"{c.lo:.2f}–{c.hi:.2f}" if c else "",
        "verdict": c.verdict if c else "the starting point",
        "samples/s": rung["batch"] / t.wall.median,
        "MFU vs matmul ceiling (%)": flops.mfu(tok_s, per_token, ceiling_tflops) * 100,
        "MFU, 6N only (%)": flops.mfu(tok_s, 6 * n_params, peak_tflops) * 100 if peak_tflops else np.nan,
        "MFU, causal attention at half (%)": flops.mfu(tok_s, per_token_causal, peak_tflops) * 100 if peak_tflops else np.nan,
        "peak allocated (GiB)": peak_gib,
        "GPU busy": t.gpu_busy if t.gpu_busy is not None else np.nan,
        "step median (ms)": t.wall.median * 1e3,
        "GPU time (ms)": t.kernel_s * 1e3 if t.kernel_s is not None else np.nan,  # summed kernel time per step
        "GPU-time speed-up per sample": gpu_speedup,
        "note": "",
    }


def show_ladder(table):
    """The ladder in two tables: the climb (what each rung changed and bought), then the evidence."""
    display(table.reindex(columns=CLIMB_COLUMNS))
    display(table.reindex(columns=EVIDENCE_COLUMNS))

# %% [markdown]
# The climb, for one model. Rung 0 is the guide's setup at the guide's batch, timed on its own: the starting
# point. Rung 1 moves to the *ladder batch* (32 sequences for bert-large, 4 for the 1.3B model, in the full
# profile), chosen so that the GPU's work, not the CPU's kernel launches, makes most of the step; every later
# rung is judged there, where a change to the GPU's work shows in the step time (the GPU-busy column says how
# busy each rung kept the GPU). Rungs 2 to 4 change one setting each:
# 16-bit autocast, then SDPA attention, then fused AdamW. Rung 5 doubles the batch once more (the largest this
# ladder tries, not a measured knee: a larger batch, where it fits, may be faster still). Rung 6 compiles each
# transformer layer and is kept only when it is faster beyond ±3%. This is *regional* compilation, as
# PyTorch's tutorial on it recommends ([PyTorch (2024)](https://gpu-efficient-training.github.io/book/book/references.html)): the layers are identical, so the
# code compiled for one serves all of them, and the compile time is that of one layer rather than of the whole
# model. Its rounds alternate the same model with compilation on and off (`torch.compiler.set_stance`).

# %%
def layers_of(model):
    return model.bert.encoder.layer if hasattr(model, "bert") else model.gpt_neox.layers


def matmul_dims(model, name):
    """The dimensions of ``model``'s matrix products; the vocabulary only where an LM head multiplies by it."""
    c = model.config
    dims = {"hidden": c.hidden_size, "intermediate": c.intermediate_size,
            "head dim": c.hidden_size // c.num_attention_heads}
    if LADDER[name]["head"] == "causal-lm":
        dims["vocabulary"] = c.vocab_size
    return dims


def padding_check(model, name):
    """The matrix-product dimensions of ``model`` that are not multiples of 8 (chapter 5: tensor-core tiles)."""
    return {k: v for k, v in matmul_dims(model, name).items() if v % 8}


def climb_rung(model, name, label, prev, cur, optimizers, rows, timed, comps, **kw):
    """Judge rung ``cur`` against ``prev``; record its rows; return the rung the ladder continues from."""
    attempt = batching.try_batch(lambda bs: judge(model, name, prev, {**cur, "batch": bs}, optimizers, **kw),
                                 cur["batch"])
    if not attempt.fits:
        model.zero_grad(set_to_none=True)  # a step that ran out of memory can leave gradients behind
        rows[label] = {"batch": cur["batch"], "verdict": "out of memory", "note": f"out of memory ({attempt.error})"}
        return prev
    c, peak = attempt.value
    timed[label], comps[label] = c.b, c
    rows[label] = rung_row(name, model, cur, c.b, peak, c, prev["batch"])
    return cur


COMPILED_IN_PROCESS = []  # models whose layers a compile rung compiled: Inductor keeps their kernels in this process


def compile_rung(model, name, rung, optimizers, rows, timed, comps, notes, compile_min_s):
    """Rung 6: compile each layer, time the first compiled step, then judge compiled against eager."""
    if not prof.on_gpu:
        return "skipped on CPU: torch.compile's GPU kernels (Triton) need a GPU"
    if seconds_left() < compile_min_s:
        return f"skipped: {seconds_left():.0f} s of the chapter's time budget left, compiling needs about {compile_min_s:.0f}"
    torch._logging.set_logs(dynamo=logging.ERROR, inductor=logging.ERROR)  # no compiler chatter in the output
    label = "6 + torch.compile (regional)"
    try:
        for layer in layers_of(model):
            layer.compile()
        step, switch = rung_step(model, name, rung, optimizers)
        switch()
        start = time.perf_counter()
        step()  # the first compiled step: compilation happens here
        torch.cuda.synchronize()
        first_s = time.perf_counter() - start
        cur = climb_rung(model, name, label, rung, {**rung, "compiled": True}, optimizers, rows, timed, comps,
                         stances=("force_eager", "default"))
    except Exception as err:  # a compiler error must not end the chapter: report it in one line
        return f"torch.compile failed here: {one_line(err)}"
    finally:
        torch.compiler.set_stance("default")
        torch.compiler.reset()  # drop the compiled code and its guards, which can keep the model alive
    before = list(COMPILED_IN_PROCESS)  # the models whose layers this process compiled before this rung
    COMPILED_IN_PROCESS.append(name)
    if not cur.get("compiled"):
        return rows[label]["note"]
    c = comps[label]
    kept = c.verdict == "faster"
    if not kept:
        rows[f"{label}, not kept"] = rows.pop(label)
        timed[f"{label}, not kept"], comps[f"{label}, not kept"] = timed.pop(label), comps.pop(label)
    rows[label if kept else f"{label}, not kept"]["note"] = f"first compiled step {first_s:.0f} s"
    return {"kept": kept, "first_step_s": first_s, "comparison": c, "compiled_before": before}


def climb(name, compile_min_s):
    cfg = LADDER[name]
    model = models.build(name, head=cfg["head"], dtype=torch.float32).train()
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False  # training never reads the generation cache (section 10.2)
    rows, timed, comps, optimizers = {}, {}, {}, {}
    rung = dict(batch=cfg["batch"], attention="eager", amp=None, optimizer="for-loop")
    label0 = "0 vanilla: fp32, eager, AdamW for-loop"
    step, switch = rung_step(model, name, rung, optimizers)
    switch()
    t0 = timing.time_it(step, device=dev, warmup=WARMUP, repeat=REPEAT, profile_steps=2)
    timed[label0] = t0
    rows[label0] = rung_row(name, model, rung, t0, steady_peak_gib(step, switch))
    del step
    big = cfg["big_batch"]
    for label, change in [(f"1 + batch {cfg['ladder_batch']}", dict(batch=cfg["ladder_batch"])),
                          (f"2 + {AMP_NAME} autocast" + ("" if prof.on_gpu else " (off on a CPU)"),
                           dict(amp=AMP if prof.on_gpu else None)),
                          ("3 + SDPA attention", dict(attention="sdpa")),
                          ("4 + fused AdamW", dict(optimizer="fused")),
                          (f"5 + batch {big} (the largest tried)", dict(batch=big))]:
        rung = climb_rung(model, name, label, rung, {**rung, **change}, optimizers, rows, timed, comps)
    notes = {"model": name, "padding": padding_check(model, name), "matmul_params": flops.matmul_params(model),
             "vanilla": t0, "comparisons": comps, "ladder_batch": cfg["ladder_batch"]}
    lookup_only = ("" if "vocabulary" in matmul_dims(model, name) else
                   f" (the vocabulary, {model.config.vocab_size:,}, is used only in the embedding lookup)")
    notes["padding_text"] = (
        "not needed: " + ", ".join(f"{k} {v}" for k, v in matmul_dims(model, name).items()) + " are multiples of 8"
        + lookup_only if not notes["padding"] else "needed for " + ", ".join(notes["padding"]) + " (see the text)")
    notes["compile"] = compile_rung(model, name, rung, optimizers, rows, timed, comps, notes, compile_min_s)
    if isinstance(notes["compile"], str):
        rows["6 + torch.compile (regional)"] = {"batch": rung["batch"], "verdict": "not run", "note": notes["compile"]}
    table = pd.DataFrame(rows).T.rename_axis(f"{name}, {cfg['seq_len']} tokens")
    return table, timed, notes  # the model goes with this function's frame; the next cell collects it

# %% [markdown]
# ### bert-large, 512 tokens

# %%
with charged():
    bert_table, bert_timed, bert_notes = climb("bert-large-uncased", compile_min_s=prof.pick(tiny=0, full=250))
cleanup.collect()
print(f"padding to multiples of 8 (chapter 5): {bert_notes['padding_text']}")
show_ladder(bert_table)

# %% [markdown]
# The padding check compares the shapes of the matrix products with chapter 5's rule (multiples of 8, better 64). In
# bert-large the only dimension that is not a multiple of 8 is the vocabulary, 30,522; but a classification
# model uses the vocabulary only in the embedding lookup, which is not a matrix product, so padding it would
# buy nothing. Its hidden size (1,024), MLP width (4,096) and head size (64) are multiples of 64 already, and
# so are the 1.3B model's (2,048, 8,192, 128), vocabulary (30,080) included: padding changes nothing here, and the
# ladder has no rung for it.

# %% [markdown]
# ### The 1.3B GPT-NeoX, 2048 tokens
#
# The same ladder on the LLM book's model at its full context. Its vanilla rung runs at the guide's batch of 1;
# rung 1 moves to batch 4, still in fp32 with eager attention, whose stored s × s attention matrices grow quickly
# with the batch (chapter 1, section 1.4): the planner puts that setup at the peak printed below (with the
# generation cache, which this plan counts, `plan.Setup`'s default being `use_cache=True`, and the ladder turns
# off). On a GPU smaller than the planner's
# peak for the lightest setup of any rung (a T4), the climb is skipped with one line that says so.

# %%
vanilla_b4 = plan.predict(plan.Setup(model="gpt-neox-1.3b", batch=4, seq=LADDER["polyglot-ko-1.3b"]["seq_len"],
                                     precision="fp32", optimizer="adamw", attention="eager",
                                     profile=prof.name))
print(f"vanilla setup at batch 4: predicted peak {vanilla_b4.peak_gib:.1f} GiB ({vanilla_b4.peak_phase})")
lightest = plan.predict(vanilla_b4.setup.replace(  # no rung needs less: batch 1, SDPA, autocast, fused AdamW
    batch=1, attention="sdpa", precision=f"{AMP_NAME}-autocast", optimizer="adamw-fused"))
total_gib = torch.cuda.get_device_properties(0).total_memory / GIB if prof.on_gpu else float("inf")
if lightest.peak_gib > total_gib:  # a T4: fp32 weights, gradients and AdamW states alone are 16 bytes per parameter
    llm_table, llm_timed, llm_notes = pd.DataFrame(), {}, {"skipped": (
        f"skipped: its lightest rung needs a predicted {lightest.peak_gib:.1f} GiB (fp32 weights, gradients and AdamW "
        f"states alone are 16 bytes per parameter), and this GPU has {total_gib:.1f} GiB; section 10.4 plans the 1.3B "
        f"model for this budget")}
    print(llm_notes["skipped"])
else:
    with charged():
        llm_table, llm_timed, llm_notes = climb("polyglot-ko-1.3b", compile_min_s=prof.pick(tiny=0, full=60))
cleanup.collect()
if len(llm_table):
    show_ladder(llm_table)

# %%
def best_label(timed, table):
    """The fastest rung that was kept (a compile rung marked 'not kept' is not); None if no rung ran."""
    kept = [k for k in timed if "not kept" not in k]
    return max(kept, key=lambda k: table.loc[k, "tokens/s"]) if kept else None


best_bert, best_llm = best_label(bert_timed, bert_table), best_label(llm_timed, llm_table)
fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
metric = "MFU vs datasheet (%)" if prof.on_gpu and peak_tflops else "MFU vs matmul ceiling (%)"
for ax, (title, table, timed, notes, goal) in zip(axes, [
        (f"bert-large, {LADDER['bert-large-uncased']['seq_len']} tokens", bert_table, bert_timed, bert_notes, MFU_GOAL["bert-large-uncased"]),
        (f"1.3B GPT-NeoX, {LADDER['polyglot-ko-1.3b']['seq_len']} tokens", llm_table, llm_timed, llm_notes, MFU_GOAL["polyglot-ko-1.3b"])]):
    ax.set_title(title)
    done = table.dropna(subset=["tokens/s"]) if "tokens/s" in table else table.iloc[:0]
    if done.empty:  # every rung out of memory, or the climb skipped
        ax.text(0.5, 0.5, "skipped: too little GPU memory" if "skipped" in notes else "no rung fit this GPU",
                ha="center", va="center", transform=ax.transAxes)
        ax.set_yticks([])
        continue
    y = np.arange(len(done))[::-1]
    values = done[metric].astype(float)
    # the spread: MFU is inversely proportional to the step time, so the IQR's quartiles give the error bar
    spread = np.array([[v - v * timed[k].wall.median / timed[k].wall.q3, v * timed[k].wall.median / timed[k].wall.q1 - v]
                       for k, v in values.items()]).T
    ax.barh(y, values, xerr=spread, capsize=2, color=["C1" if "not kept" in k else "C0" for k in done.index])
    for i, (yi, tok_s) in enumerate(zip(y, done["tokens/s"].astype(float))):
        ax.text(values.iloc[i] + spread[1][i] + 0.5, yi, f"{tok_s:,.0f} tok/s", va="center", fontsize=8)
    ax.set_yticks(y, [k.split(" ", 1)[1] for k in done.index])
    if metric == "MFU vs datasheet (%)":
        ax.axvline(goal, color="grey", linestyle="--", label=f"goal: {goal}% MFU")
        ax.legend(loc="upper right")
    ax.set_xlabel(metric.replace("(%)", "(%, bars with the IQR) and tokens/s (labels)"))
    ax.set_xlim(0, max(60, float(values.max()) * 1.35))


def first_and_best(table, best):
    """MFU of the first rung that ran (and whether it is the vanilla one) and of the best rung."""
    ran = table[metric].astype(float).dropna()
    return ran.iloc[0], ran.index[0] == table.index[0], float(table.loc[best, metric])


first_last = {n: first_and_best(t, best) for n, t, best in (("bert-large", bert_table, best_bert),
                                                           ("1.3B", llm_table, best_llm)) if best}
fig.suptitle("the speed ladder: " + ("; ".join(
    f"{n} from {v0:.1f}%{'' if vanilla_ran else ' (first rung that fit)'} to {v1:.1f}% MFU"
    for n, (v0, vanilla_ran, v1) in first_last.items()) or "no rung fit this GPU")
             + ("" if metric == "MFU vs datasheet (%)" else " (CPU run: against the CPU's matmul rate)" if not prof.on_gpu
                else " (against the measured matmul ceiling: no datasheet peak for this GPU)"))
fig.tight_layout()

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (10.3 The speed ladder, both models)
# Sentences from this run's numbers (10.3 The speed ladder, both models)
def short(label):
    # a rung's label without its number, "2 + bf16 autocast" → "+ bf16 autocast"
    return label.split(" ", 1)[1]


def climb_product(comps, best):
    """The per-sample speed-ups of the rungs kept up to ``best``, multiplied, with the product of their interval
    ends: the climb from the vanilla rung, each factor measured against the rung before in the same rounds."""
    labels = list(comps)
    kept = [k for k in labels[:labels.index(best) + 1] if "not kept" not in k] if best in comps else []
    prod = lo = hi = 1.0
    for k in kept:
        prod, lo, hi = prod * comps[k].speedup, lo * comps[k].lo, hi * comps[k].hi
    return prod, lo, hi


def busy_pct(t):
    return "n/a" if t.gpu_busy is None else prose.pct(t.gpu_busy)


def ladder_sentences(name, table, timed, notes, best, goal):
    comps, t0 = notes["comparisons"], notes["vanilla"]
    first, b = table.iloc[0], table.loc[best]
    prod, lo, hi = climb_product(comps, best)
    aim = ("at least" if lo >= 10 else "short of" if hi < 10 else "a range that includes")
    text = (f"**{name}.** From {first['tokens/s']:,.0f} to {b['tokens/s']:,.0f} tokens/s, "
            f"{b['tokens/s'] / first['tokens/s']:.1f} times as many. The rungs' speed-ups per "
            f"sample multiply to {prod:.1f} times the vanilla setup's throughput (the products of their interval ends: "
            f"{lo:.1f} to {hi:.1f}), {aim} the 10 times this chapter aimed for; the two numbers differ because the "
            f"vanilla rung was timed on its own while each factor of the product comes from rounds interleaved with "
            f"the rung before. ")
    mfu = b["MFU vs datasheet (%)"]
    if np.isnan(mfu):
        text += "The best rung, *" + short(best) + "*, runs (this GPU has no datasheet peak in the book's table) "
    else:
        reach = f"reaching the goal of {goal}%" if mfu >= goal else f"short of the goal of {goal}%"
        text += f"The best rung, *{short(best)}*, runs at {mfu:.1f}% MFU against the datasheet, {reach}, and "
    text += (f"at {b['MFU vs matmul ceiling (%)']:.0f}% of the measured matmul ceiling; the GPU is busy "
             f"{busy_pct(timed[best])} of its step.")
    if not np.isnan(b["MFU, 6N only (%)"]):
        text += f" Under the 6N convention (no attention term) the same step is {b['MFU, 6N only (%)']:.1f}% MFU"
        text += (f", and with causal attention counted at half {b['MFU, causal attention at half (%)']:.1f}%."
                 if LADDER[notes["model"]]["head"] == "causal-lm" else ".")
    b0, us = int(first["batch"]), timing.us_per_launch(t0)
    launches = (f": its {t0.kernels_per_call:,} kernel launches per step cost this machine's CPU {us:.0f} µs each, "
                f"so a reader's CPU decides much of this rung's time" if us else "")
    if not any(k.startswith("1 ") for k in comps):
        text += (f"\n\nRung 1's batch of {notes['ladder_batch']} did not fit this GPU, so the later rungs are judged "
                 f"at the guide's batch of {b0}, where the vanilla step keeps the GPU busy {busy_pct(t0)} of its "
                 f"step{launches}.")
    elif t0.gpu_busy is not None and t0.gpu_busy < 0.9:
        text += (f"\n\nAt the guide's batch of {b0} the vanilla step keeps the GPU busy only {busy_pct(t0)} of its "
                 f"step{launches}. That is why rung 1 raises the batch to {notes['ladder_batch']} first.")
    else:
        text += (f"\n\nAt the guide's batch of {b0} the vanilla step already keeps the GPU busy ({busy_pct(t0)}); "
                 f"rung 1 raises the batch to {notes['ladder_batch']}, where the 16-bit rungs keep it busy too.")
    steps_txt = []
    for k, c in comps.items():
        g = table.loc[k, "GPU-time speed-up per sample"]
        steps_txt.append(f"*{short(k)}* {c.phrase()}" + ("" if pd.isna(g) else f"; GPU time {g:.2f}×"))
    text += (" Rung by rung, per sample against the rung before, interleaved (wall time, then the profiler's kernel "
             "time): " + "; ".join(steps_txt) + ".")
    low = [short(k) for k, c in comps.items()
           if any(x is not None and x < 0.9 for x in (c.a.gpu_busy, c.b.gpu_busy))]
    if low:
        text += (f" On {prose.listing(f'*{m}*' for m in low)} one side of the rounds kept the GPU busy less than 90% "
                 f"of its step: part of that step waits on the CPU's launches, so the ratio there depends on the host "
                 f"as well as on the GPU.")
    elif comps:
        text += " Both sides of every judged rung kept the GPU busy at least 90% of their steps."
    c = notes["compile"]
    if isinstance(c, dict):
        cache = (f"this process compiled {prose.listing(c['compiled_before'])}'s layers before, and Inductor may "
                 f"reuse kernels it cached then" if c.get("compiled_before") else
                 "this process had compiled nothing before; inductor's on-disk cache may hold kernels from an earlier "
                 "run on this machine")
        text += (f" `torch.compile`: the first compiled step took {c['first_step_s']:.0f} s, compilation included ("
                 f"{cache}; a cold first compile is longer); compiled against eager, the step is "
                 f"{c['comparison'].phrase()}; it is " + ("kept." if c["kept"] else "not kept."))
    elif c:
        text += f" The compile rung: {c}."
    return text


if prof.on_gpu:
    prose.say("\n\n".join(
        ladder_sentences(*args) if args[4] else f"**{args[0]}**: {args[3].get('skipped', 'no rung fit this GPU')}."
        for args in (("bert-large", bert_table, bert_timed, bert_notes, best_bert, MFU_GOAL["bert-large-uncased"]),
                     ("The 1.3B GPT-NeoX", llm_table, llm_timed, llm_notes, best_llm, MFU_GOAL["polyglot-ko-1.3b"]))))
else:
    print("skipped on CPU: MFU and GPU-busy need a GPU (the tiny models' CPU times say nothing about a GPU)")

# %% [markdown]
# **Where the rest goes.** The category table of the best rung of each model (shares of the GPU time of the
# profiled steps, chapter 8's categories), with the GPU's idle time as one more row: what separates the MFU
# from 100%. Matrix products run below the datasheet peak even when they fill the GPU; attention kernels do
# model FLOPs too (the convention's 12 · L · h · s term), at a rate of their own; the other rows are time in
# which the tensor cores did no model FLOPs at all.

# %%
def where_time_goes(t):
    cats = t.profile.categories() if t.profile is not None else None
    if cats is None:
        return pd.Series(dtype=float)
    share = cats["share"] * (t.gpu_busy if t.gpu_busy is not None else 1.0)
    return pd.concat([share, pd.Series({"GPU idle": 1 - t.gpu_busy})]) * 100 if t.gpu_busy is not None else share * 100


rest = pd.DataFrame({col: where_time_goes(timed[best]) for col, timed, best in (
    ("bert-large", bert_timed, best_bert), ("1.3B GPT-NeoX", llm_timed, best_llm)) if best})
rest.rename_axis("% of the step's wall time" if prof.on_gpu else "% of the CPU operators' self time")

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (The 1.3B GPT-NeoX, 2048 tokens)
if prof.on_gpu and len(rest):
    parts = []
    for col, best, table, timed, notes in (("bert-large", best_bert, bert_table, bert_timed, bert_notes),
                                            ("1.3B GPT-NeoX", best_llm, llm_table, llm_timed, llm_notes)):
        if not best:
            continue
        r = rest[col].drop(["GPU idle", "GEMM"], errors="ignore").sort_values(ascending=False)
        gemm_ms = timed[best].profile.categories().loc["GEMM", "GPU time (ms/step)"]
        tokens = table.loc[best, "batch"] * LADDER["bert-large-uncased" if col == "bert-large" else "polyglot-ko-1.3b"]["seq_len"]
        gemm_tflops = 6 * notes["matmul_params"] * tokens / (gemm_ms / 1e3) / 1e12 if gemm_ms > 0 else float("nan")
        parts.append(
            f"- **{col}** (*{best.split(' ', 1)[1]}*): matrix products take {rest.loc['GEMM', col]:.0f}% of the step, and "
            f"while they run they reach {gemm_tflops:,.0f} TFLOP/s (the weights' 6 FLOPs per parameter and token over the "
            f"GEMM kernels' time), {gemm_tflops / ceiling_tflops:.0%} of the measured matmul ceiling. The largest other "
            f"rows: " + ", ".join(f"{k} {v:.0f}%" for k, v in r.head(3).items())
            + f"; the GPU is idle {rest.loc['GPU idle', col]:.0f}% of the step.")
        labels = list(timed)
        prev = labels[labels.index(best) - 1] if "torch.compile" in best and labels.index(best) > 0 else None
        if prev and timed[prev].profile is not None:  # what compilation changed, in GPU ms per step
            ms0, ms1 = (timed[k].profile.categories()["GPU time (ms/step)"] for k in (prev, best))
            parts[-1] += (" Against the rung before it, compilation took the element-wise / normalisation kernels from "
                          + " and the GEMM kernels from ".join(
                              f"{ms0.get(cat, 0.0):.1f} to {ms1.get(cat, 0.0):.1f} ms"
                              for cat in ("element-wise / normalisation", "GEMM"))
                          + " of GPU time per step.")
    display(Markdown("\n".join(parts) + "\n\nThese are the levers that are left: the element-wise and normalisation "
                     "rows shrink with fusion (compilation, fused kernels, a fused cross-entropy), the attention row "
                     "with a faster attention kernel than the one SDPA picked here (the kernel names in the profile say which ran; "
                     "FlashAttention-3 is written for the H100), idle time with fewer launches "
                     "and overlap, and the GEMM row only with better shapes or a lower precision (fp8). The category "
                     "shares come from a profiled step or two, with no spread of their own."))
else:
    print("skipped on CPU: the categories of a GPU step need a GPU")

# %% [markdown]
# ## 10.4 The T4 recipe: the 1.3B model on 15 GB
#
# The LLM book fine-tunes the 1.3B model on Colab's free T4. Chapter 1 showed the plain setup running out
# of memory there. Here the planner chooses: we ask it for the cheapest changes that make a full
# fine-tuning setup (batch 8, 512 tokens, fp16 autocast as a T4 needs, AdamW) fit the T4's budget, with
# `plan.suggest(..., half="fp16")` so that any 16-bit base it proposes is fp16 (a T4, compute capability
# 7.5, has no bf16 tensor cores), as the command line does for `--gpu T4` (section 10.1). Then we run the
# cheapest suggestion that keeps *full* fine-tuning (every weight trained: the LLM book's setting, so
# LoRA and QLoRA are listed but not run) on this GPU with the allocator capped at the T4's budget
# (chapter 1's emulation: the T4's 15 GB less this process's CUDA context, `measure.t4_budget`), and
# compare the measured peak and throughput with the plan. (The command line's T4 budget in section 10.1 is a
# little different: it cannot measure a context, so it subtracts a fixed reserve, `gpus.CONTEXT_RESERVE_GIB`.
# A real T4's context under Colab's CUDA build differs from both.) *Paged* optimizer states are set aside too: they
# live in CUDA managed memory outside PyTorch's allocator, where the emulated cap cannot check them.

# %%
t4_start = plan.Setup(model="gpt-neox-1.3b", batch=8, seq=512, precision="fp16-autocast", optimizer="adamw")
print(plan.predict(t4_start).explain())
print(f"budget: {T4_BUDGET_GIB:.2f} GiB")
suggestions = plan.suggest(t4_start, T4_BUDGET_GIB, half="fp16")  # a T4 has no bf16


def runs_on_a_t4(setup):
    """No bf16 (a T4 has none), no paged states (outside the allocator, so the emulated cap cannot check them)."""
    return not setup.precision.startswith("bf16") and not setup.optimizer.startswith("paged")


def full_fine_tuning(setup):
    """Every weight is trained: no adapters, no 4-bit base."""
    return not setup.lora_rank and not setup.qlora


t4_options = [option for option in suggestions if runs_on_a_t4(option[1]) and full_fine_tuning(option[1])]
suggestion_table = pd.DataFrame([{"change": d, "predicted peak (GiB)": p.peak_gib, "peak phase": p.peak_phase,
                                  "relative time cost": c, "runs on a T4 (emulated)": runs_on_a_t4(s_),
                                  "full fine-tuning": full_fine_tuning(s_)}
                                 for d, s_, p, c in suggestions]).rename_axis("rank")
# the eight cheapest, and every full fine-tuning plan below them (exercise 2 asks about those)
suggestion_table[(suggestion_table.index < 8) | suggestion_table["full fine-tuning"]]

# %%
recipe_run = None
if not t4_options:
    print(f"no change of one or two settings that keeps full fine-tuning and a T4 can run fits {T4_BUDGET_GIB:.2f} GiB: "
          "nothing to run")
elif run_profile.cuda_or_skip("running the recipe needs a GPU (the plan above is pure arithmetic)"):
    recipe_desc, recipe, recipe_plan, recipe_cost = t4_options[0]
    try:
        with measure.gpu_budget(T4_BUDGET_GIB):
            recipe_run = plan.measure(recipe, device=dev, steps=12)  # 12 optimizer steps, each synchronised
    except Exception as err:  # report a failure in one line rather than end the chapter
        recipe_run = {"status": f"failed: {one_line(err)}"}
    cleanup.collect()
    ran = recipe_run["status"] == "ok"
    tokens_per_step = recipe.batch * recipe.grad_accum * recipe.seq
    recipe_table = pd.Series({
        "recipe": recipe_desc,
        "setup": recipe.label(),
        "budget (GiB)": T4_BUDGET_GIB,
        "predicted peak (GiB)": recipe_plan.peak_gib,
        "predicted phase": recipe_plan.peak_phase,
        "measured peak (GiB)": recipe_run["peak_allocated_bytes"] / GIB if ran else np.nan,
        "measured phase": recipe_run["peak_phase"] if ran else recipe_run["status"],
        "step, median of 12 (ms)": recipe_run["step_s"] * 1e3 if ran else np.nan,
        "tokens/s": tokens_per_step / recipe_run["step_s"] if ran else np.nan,
    }, name="value").to_frame()
    display(recipe_table)

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (10.4 The T4 recipe)
# Sentences from this run's numbers (10.4 The T4 recipe)
def t4_fraction():
    # this GPU's dense 16-bit FLOP/s and bandwidth over a T4's, from helpers.gpus' datasheet tables
    name = torch.cuda.get_device_name()
    try:
        return (gpus.peak_tflops(name, AMP) / gpus.PEAK_TFLOPS["T4"]["fp16"],
                gpus.peak_bandwidth_gb_s(name) / gpus.PEAK_BANDWIDTH_GB_S["T4"])
    except ValueError:  # a GPU the tables do not know
        return None


if recipe_run is not None:
    head = (f"The planner's cheapest change that keeps full fine-tuning and a T4 can run, *{recipe_desc}* "
            f"(predicted time cost {recipe_cost:.2f}x), ")
    if recipe_run["status"] == "ok":
        m_gib = recipe_run["peak_allocated_bytes"] / GIB
        err = (recipe_plan.peak_gib / m_gib - 1) * 100
        fits_txt = (f"fits, with {T4_BUDGET_GIB - m_gib:.2f} GiB to spare" if m_gib <= T4_BUDGET_GIB else "does not fit")
        ratio = None if ON_T4 else t4_fraction()  # on a real T4 the run's own speed is the T4's
        speed_txt = (f" This GPU has {ratio[0]:.0f} times a T4's dense 16-bit FLOP/s and {ratio[1]:.0f} times its memory "
                     f"bandwidth, so expect the T4 to be about that many times slower; the memory is what this emulation "
                     f"checks." if ratio else "")
        display(Markdown(
            head + f"predicted a peak of {recipe_plan.peak_gib:.2f} GiB in the {recipe_plan.peak_phase}; the run measured "
            f"{m_gib:.2f} GiB in the {recipe_run['peak_phase']} ({err:+.1f}%) under "
            f"{'a budget' if ON_T4 else 'a cap'} of {T4_BUDGET_GIB:.2f} GiB, so it "
            f"{fits_txt}. It trains at {tokens_per_step / recipe_run['step_s']:,.0f} tokens/s on this "
            f"{'T4' if ON_T4 else 'GPU'}." + speed_txt))
    elif recipe_run["status"] == "oom":
        display(Markdown(head + f"ran out of memory under the T4 cap of {T4_BUDGET_GIB:.2f} GiB: the plan was wrong for "
                         f"this setup, and section 10.2's error table says by how much its predictions can miss."))
    else:
        display(Markdown(head + f"did not run here ({recipe_run['status']}), so this run cannot check it."))

# %% [markdown]
# What this run checks is the memory: the predicted and measured peaks above. The time cost beside the
# recipe is the planner's rough factor from earlier chapters, not measured here (the setup it changes was
# not timed beside it), and the slowdown on a real T4 is a datasheet ratio: a T4, at 70 W, usually runs its
# matrix products well below its datasheet peak, so expect it to be slower still.

# %% [markdown]
# ## 10.5 A decision checklist
#
# **Out of memory?** First ask the planner (or measure, chapter 1) *which phase* holds the peak, then pick
# the technique that shrinks what that phase holds:
#
# | the peak is in ... | because of ... | try, cheapest first | chapter |
# |---|---|---|---|
# | every phase | weights, gradients, optimizer states (16 bytes per parameter with AdamW) | 8-bit or factored optimizer states; LoRA, QLoRA; ZeRO/FSDP across GPUs | [5](https://gpu-efficient-training.github.io/book/notebooks/05_mixed_precision_optimizers.html), [6](https://gpu-efficient-training.github.io/book/notebooks/06_lora_qlora.html), [7](https://gpu-efficient-training.github.io/book/notebooks/07_distributed_zero.html) |
# | the forward or backward pass | activations (grow with batch × sequence) | SDPA attention; a smaller [micro-batch](https://gpu-efficient-training.github.io/book/book/glossary.html#micro-batch) with accumulation; checkpointing | [1](https://gpu-efficient-training.github.io/book/notebooks/01_memory_anatomy.html), [3](https://gpu-efficient-training.github.io/book/notebooks/03_batch_size_grad_accumulation.html), [4](https://gpu-efficient-training.github.io/book/notebooks/04_gradient_checkpointing.html) |
# | the optimizer step | the optimizer's temporaries on top of the gradients | fused or 8-bit AdamW; the optimizer step inside backward (a `register_post_accumulate_grad_hook` per parameter, PyTorch's tutorial), so each gradient is freed as soon as it is used | [5](https://gpu-efficient-training.github.io/book/notebooks/05_mixed_precision_optimizers.html), [8](https://gpu-efficient-training.github.io/book/notebooks/08_profiling.html) |
# | nowhere clear: reserved ≫ allocated | fragmentation, variable shapes | `expandable_segments`; fixed or bucketed lengths | [8](https://gpu-efficient-training.github.io/book/notebooks/08_profiling.html) |
# | the loss (language models) | logits of a large vocabulary, and their fp32 gradients | a chunked or fused linear cross-entropy (Liger, Cut Cross-Entropy), or a smaller micro-batch with accumulation | [3](https://gpu-efficient-training.github.io/book/notebooks/03_batch_size_grad_accumulation.html), [4](https://gpu-efficient-training.github.io/book/notebooks/04_gradient_checkpointing.html) |
#
# **Slow?** Time it properly first (≥ 10 steps, the spread), then read the GPU-busy fraction:
#
# | GPU busy | the step is ... | try | chapter |
# |---|---|---|---|
# | low, [host enqueue](https://gpu-efficient-training.github.io/book/book/glossary.html#host-enqueue) ≈ step | host-bound | a larger batch; fused optimizer; CUDA graphs or `torch.compile` | [3](https://gpu-efficient-training.github.io/book/notebooks/03_batch_size_grad_accumulation.html), [8](https://gpu-efficient-training.github.io/book/notebooks/08_profiling.html), [9](https://gpu-efficient-training.github.io/book/notebooks/09_fast_path.html) |
# | low, host idle too | waiting (data loading, synchronisations) | more loader workers, pinned memory; no `.item()` in the loop | [8](https://gpu-efficient-training.github.io/book/notebooks/08_profiling.html), [9](https://gpu-efficient-training.github.io/book/notebooks/09_fast_path.html) |
# | high, element-wise and optimizer rows large | memory-bound | fused kernels (fused AdamW, SDPA), `torch.compile` | [5](https://gpu-efficient-training.github.io/book/notebooks/05_mixed_precision_optimizers.html), [8](https://gpu-efficient-training.github.io/book/notebooks/08_profiling.html), [9](https://gpu-efficient-training.github.io/book/notebooks/09_fast_path.html) |
# | high, GEMM row large | compute-bound | 16-bit autocast; shapes in multiples of 64; no recomputation you do not need | [5](https://gpu-efficient-training.github.io/book/notebooks/05_mixed_precision_optimizers.html), [4](https://gpu-efficient-training.github.io/book/notebooks/04_gradient_checkpointing.html) |
#
# The page [Which technique do I need?](https://gpu-efficient-training.github.io/book/book/which_technique.html) expands both lists with links to the
# sections.
#
# ## Summary
#
# - A planner that adds up the terms the book counts and measures predicts a training step's peak memory; section
#   10.2 publishes its error on held-out setups of three model families it was never fitted to, then on the
#   in-sample rows, beside five published estimators that leave out the activations or the temporaries.
# - In this ladder the largest factors were 16-bit autocast and SDPA attention; a larger batch paid where the
#   guide's batch left the GPU waiting for the CPU (bert-large), hardly where one sequence of 2,048 tokens
#   already kept it busy (the 1.3B model). What a rung buys depends on what limits the step when it is added: on
#   a host-bound step a change to the GPU's work can leave the step as long as it was, so the ladder judges each
#   rung at a batch meant to keep the GPU busy, against the rung before it, in interleaved rounds. Compilation
#   comes last and is kept only when measured faster.
# - MFU against the datasheet hides two gaps: the matmul ceiling (what the tensor cores really deliver) and
#   the time outside the matrix products; the profiler's category table shows the second.
# - Plan, then measure: the planner says which change makes a run fit, the measurement says whether it did.
#
# ### Use it in your own script
#
# ```python
# import torch
# from transformers import AutoModelForCausalLM
#
# model = AutoModelForCausalLM.from_pretrained(  # transformers 5 loads the checkpoint's dtype unless told:
#     name, dtype=torch.float32, attn_implementation="sdpa").cuda().train()  # fp32 master weights, dropout on
# model.config.use_cache = False          # no generation cache in training (section 10.2)
# optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5, fused=True)
# for layer in model.model.layers:        # regional compilation (Llama-style; GPT-NeoX: model.gpt_neox.layers)
#     layer.compile()
# for batch in loader:                    # a batch that keeps the GPU busy (chapter 3)
#     batch = {k: v.to("cuda", non_blocking=True) for k, v in batch.items()}
#     with torch.autocast("cuda", dtype=torch.bfloat16):
#         loss = model(**batch).loss
#     loss.backward()
#     optimizer.step()
#     optimizer.zero_grad(set_to_none=True)
# ```
#
# And before the first run, the same recipe for the planner (here for a 24 GB L4; a T4 has no bf16, so plan it
# with `--precision fp16-autocast`): `python -m helpers.plan --model path/to/config.json --batch 8 --seq 1024
# --precision bf16-autocast --optimizer adamw-fused --no-cache --gpu L4` (exit status 0: fits with the stated
# margin, 1: does not fit, 2: bad input). It does not model `torch.compile`, which in section 10.3 lowered the
# peak or left it unchanged.
#
# ## Exercises
#
# 1. **Plan, then measure, a model of your choice.** Write a `config.json` (or take one from a model you
#    use), predict its peak with `plan.predict` for your batch and sequence length, then measure it with
#    `plan.measure`. How far apart are they, and which term does the gap belong to?
#    <details><summary>Hint</summary><code>plan.Setup(model="path/to/config.json", ...)</code>; compare
#    <code>plan.predict(s).components</code> with the measured peak, and move one setting at a time (batch,
#    then sequence length) to see which term scales with the gap.</details>
#    <details><summary>Answer</summary>Expect an error of the size of section 10.2's held-out table for the
#    families it covers (Llama-, Mistral- and Qwen2-shaped models; BERT and GPT-NeoX in-sample); a family the
#    planner does not know is refused. A gap that grows with batch × sequence is in the activation term; a
#    constant gap is in a fixed term (workspaces, the optimizer's temporaries).</details>
# 2. **Make the 1.3B recipe faster on the T4.** Ask `plan.suggest` for all the plans that fit and pick the
#    one with the lowest time cost that keeps full fine-tuning. What does it give up?
#    <details><summary>Hint</summary>Print every suggestion with its relative time cost; checkpointing
#    recomputes the forward pass, about a third more compute and, at small batches, more time than that
#    (chapter 4); 8-bit states cost little time (chapter 5).</details>
#    <details><summary>Answer</summary>Every full fine-tuning plan that fits needs 8-bit (or factored)
#    optimizer states *and* one more saving: micro-batches with accumulation, or checkpointing, which costs
#    the most time. The micro-batch plan needs paged 8-bit states, which the emulated cap cannot check (section
#    10.4), or factored (Adafactor) states, which cost more time. LoRA fits with no other change but trains a small fraction of the parameters; on a T4 its base
#    must be fp16, which is why section 10.4 asks <code>plan.suggest(setup, budget, half="fp16")</code>.</details>
# 3. **One more rung.** Add CUDA graphs (chapter 8, section 8.3) to the bert-large ladder at batch 4. Does it
#    pay at the ladder's batch (32), too?
#    <details><summary>Hint</summary>Capture the whole step with <code>torch.cuda.graph</code> and a
#    <code>capturable=True</code> fused AdamW; time the replay with <code>time_it</code>.</details>
#    <details><summary>Answer</summary>Compare with <code>timing.interleaved</code>, as the ladder does. Expect
#    graphs to pay where the step is host-bound (batch 4: the launches go, the GPU's work stays); at the ladder's
#    batch the GPU is already busy most of the step, so at most the idle share of the profiler's table can go. This
#    chapter did not measure it: your rounds decide.</details>
#
# ## References
#
# - Hugging Face, *Model training anatomy* and *Efficient training on a single GPU* (the ladder's starting
#   point and its rungs); the *Model Memory Calculator* and `accelerate estimate-memory`.
# - [Rajbhandari et al. (2020)](https://gpu-efficient-training.github.io/book/book/references.html), *ZeRO*: the model-state formula. [Korthikanti et al. (2022)](https://gpu-efficient-training.github.io/book/book/references.html): the activation
#   formula, and a published MFU. [Anthony et al. (2023)](https://gpu-efficient-training.github.io/book/book/references.html), *Transformer Math 101*.
#   [Tazi et al. (2025)](https://gpu-efficient-training.github.io/book/book/references.html), *The Ultra-Scale Playbook*: its memory formulas.
# - [Chowdhery et al. (2022)](https://gpu-efficient-training.github.io/book/book/references.html), *PaLM*, appendix B: the MFU convention and a published MFU. [Dao et al. (2022)](https://gpu-efficient-training.github.io/book/book/references.html), *FlashAttention*.
# - [Ansel et al. (2024)](https://gpu-efficient-training.github.io/book/book/references.html), *PyTorch 2*: `torch.compile`; [PyTorch (2024)](https://gpu-efficient-training.github.io/book/book/references.html), the tutorial on regional compilation.
# - [Heo (2024)](https://gpu-efficient-training.github.io/book/book/references.html), the LLM book's chapter 5: the 1.3B model on a T4.
#
# All the works the book cites are on the [references page](https://gpu-efficient-training.github.io/book/book/references.html).

# %% [markdown]
# Every experiment freed what it made. The last cell releases cuBLAS's workspaces (chapter 8 explains why
# they are held) and checks that the chapter ends where it began:

# %%
cleanup.collect()
if prof.on_gpu:  # cleanup.back_at_baseline: collect, release cuBLAS's workspaces, compare; LeakError if not back
    display(pd.Series(cleanup.back_at_baseline(baseline_mib)).to_frame("value"))
else:
    print("skipped on CPU: no GPU memory to check")
