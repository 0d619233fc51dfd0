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
# # 7. Beyond one GPU: data, tensor and pipeline parallelism, ZeRO and FSDP
#
# Chapter 1 counted 16 bytes per parameter for training in fp32 with AdamW: weights, gradients and two
# [optimizer states](https://gpu-efficient-training.github.io/book/book/glossary.html#optimizer-states). For the 1.33-billion-parameter GPT-NeoX of this book that is $16 \times 1.33 \times 10^9$
# bytes, about 20 GiB, before a single [activation](https://gpu-efficient-training.github.io/book/book/glossary.html#activations), more than a T4 holds, and the 7.5-billion-parameter model of
# the [ZeRO](https://gpu-efficient-training.github.io/book/book/glossary.html#zero) paper needs $16 \times 7.5 \times 10^9$ bytes = 120 GB in [mixed precision](https://gpu-efficient-training.github.io/book/book/glossary.html#mixed-precision).
# When the model states no longer fit one GPU, or when one GPU is too slow, training is split over several.
# This chapter runs the ways of splitting it, with PyTorch's own engines, on two GPUs, and holds each against
# the arithmetic that predicts it.
#
# **What you will learn**
#
# - what [data parallelism](https://gpu-efficient-training.github.io/book/book/glossary.html#data-parallelism) does to gradients, written as a manual [all-reduce](https://gpu-efficient-training.github.io/book/book/glossary.html#all-reduce) and then with
#   `DistributedDataParallel`, and checked against one process on the whole batch;
# - how [tensor parallelism](https://gpu-efficient-training.github.io/book/book/glossary.html#tensor-parallelism) splits a matrix product by columns and by rows, an MLP block and attention by
#   heads, and what each split must communicate; how [pipeline parallelism](https://gpu-efficient-training.github.io/book/book/glossary.html#pipeline-parallelism) leaves GPUs idle (the bubble);
# - the ZeRO formula for per-GPU memory of model states ([Rajbhandari et al. (2020)](https://gpu-efficient-training.github.io/book/book/references.html)), reproducing the
#   paper's 7.5B example;
# - ZeRO for real: the same model trained under [DDP](https://gpu-efficient-training.github.io/book/book/glossary.html#ddp), `ZeroRedundancyOptimizer` (ZeRO-1) and [FSDP](https://gpu-efficient-training.github.io/book/book/glossary.html#fsdp)
#   (ZeRO-2-like and ZeRO-3), launched with `torchrun`, measured per rank, and compared with the formula;
#   the throughput that a second GPU adds, per engine;
# - the same through `accelerate launch` with an FSDP config, without changing the training script;
# - what the collectives cost: bus bandwidth against message size and the link's nominal bandwidth, and
#   each engine's bytes per step, from the formula and from a profiler trace.
#
# **Prerequisites:** chapter 1 (the 16 bytes per parameter). The numbers quoted in the text come from the
# machine in the first output below (two GPUs, [NCCL](https://gpu-efficient-training.github.io/book/book/glossary.html#nccl)). On a CPU the notebook runs the same scripts as two
# processes that talk through the `gloo` backend, with the tiny twin of the model, in about a minute. On one
# GPU the sections that need two say so in one line, and where the GPU is too small for the 1.3B model's
# fp32 states (a T4's 15 GB), section 7.4 trains the same architecture with fewer transformer blocks and
# prints how many.

# %%
import sys

if "google.colab" in sys.modules:  # Colab only. This chapter launches scripts from the repository: clone it,
    # then install it from the clone, not editable (an editable install needs a kernel restart before it can be
    # imported). pip adds what Colab lacks and upgrades transformers to 5.x, which nothing has imported yet;
    # Colab's torch is kept (see the setup page).
    # !git clone -q --depth 1 https://github.com/gpu-efficient-training/book /content/book
    # %pip install -q --no-warn-conflicts /content/book
    # %cd /content/book/notebooks

from helpers import env

env.quiet()  # warnings without file paths, no progress bars: outputs that read the same everywhere

import importlib.util
import inspect
import math
import shutil
import statistics
from pathlib import Path

import matplotlib.patches as mpatches
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from IPython.display import Code, Markdown, display

from helpers import (
    cleanup,
    collectives,
    estimates,
    launching,
    models,
    plots,
    profiler,
    prose,
    run_profile,
    timing,
)
from helpers.gpus import T4_MEMORY_GIB
from helpers.measure import GIB, MIB

prof = env.start()  # plot style, number format, run profile; the table below names hardware and versions
SCRIPTS = Path("scripts")  # the launched scripts, next to this notebook
WORK = Path("trainer_tmp_ch7")  # the launched processes write their results here; removed at the end
chapter_baseline_mib = torch.cuda.memory_allocated() / MIB if prof.on_gpu else 0.0  # this process's; checked at the end

# %% [markdown]
# ## 7.1 Data parallelism: every GPU a replica, gradients averaged
#
# In data parallelism each of $N$ processes (one per GPU, called *ranks*; $N$ is the *world size*) holds a
# full copy of the model and takes $1/N$ of every batch. Each computes the loss of its share and its
# gradients; then the gradients are averaged over the ranks with an **all-reduce** (every rank sends its
# gradients and receives the sum), and every rank takes the same optimizer step, so the replicas stay
# identical. Why is the average right? The loss is a mean over the tokens of the batch. With equal shares,
# the mean of the $N$ shares' means is the mean over the whole batch, and a gradient is linear in the loss:
# the averaged gradient *is* the gradient of the whole batch.
#
# The launched script `scripts/ddp_grads.py` does this twice: by hand, with `torch.distributed.all_reduce` on
# every parameter's gradient, and with `DistributedDataParallel` (DDP), which does the same all-reduce in
# buckets of gradients while the backward pass is still running. Its two key functions:

# %%
grads_script = launching.load_script(SCRIPTS / "ddp_grads.py")  # import it, to show and reuse its code
Code(inspect.getsource(grads_script.manual_allreduce) + "\n\n" + inspect.getsource(grads_script.with_ddp),
     language="python")

# %% [markdown]
# `torchrun` starts the processes: it gives each one its `RANK`, `LOCAL_RANK` and `WORLD_SIZE` in the
# environment and a rendezvous point where they find each other; `torch.distributed.init_process_group` then
# connects them, with NCCL between GPUs or gloo between CPU processes. `launching.run` launches the command
# shown, with the environment of this notebook (plus three settings that keep NCCL off NVLink multicast), and
# waits for it. The model is the tiny GPT-NeoX twin in float64 on every machine: correctness does not depend
# on the size, and float64 keeps rounding far below the tolerance of the check.

# %%
n_dev = torch.cuda.device_count() if prof.on_gpu else 2  # GPUs here, or CPU processes in the tiny profile
shutil.rmtree(WORK, ignore_errors=True)
launch = launching.torchrun(SCRIPTS / "ddp_grads.py", 2, ["--out", WORK / "grads"])
print(launch.text)
if n_dev >= 2:
    done = launching.run(launch)
    print(f"finished in {done.seconds:.0f} s")
else:
    print(f"skipped: data parallelism needs 2 processes, one per GPU; this machine has {n_dev} GPU")

# %% [markdown]
# Now the reference: one process, the whole global batch, the same loss function, no communication. Each
# rank saved three sets of gradients: its own shard's alone (`local`), after the manual all-reduce
# (`manual`) and under DDP (`ddp`). The first two checks are the equivalences; the third shows the check can
# fail: a rank's gradient on its own shard is *not* the full batch's.

# %%
ref_model = grads_script.build(prof.device)
grads_script.lm_loss(ref_model, grads_script.global_batch().to(prof.device)).backward()
reference = grads_script.grads(ref_model)


def max_rel_diff(got, want):
    """Largest |difference| over all gradients, relative to the largest |gradient| of that tensor."""
    return max(((got[k] - want[k]).abs().max() / want[k].abs().max()).item() for k in want)


ranks = [torch.load(p) for p in sorted((WORK / "grads").glob("grads_rank*.pt"))] if n_dev >= 2 else []
tol = dict(rtol=1e-9, atol=1e-12)  # float64: a factor ~1e6 above rounding, far below any real error
for r in ranks:
    for name in reference:
        torch.testing.assert_close(r["manual"][name], reference[name], **tol)
        torch.testing.assert_close(r["ddp"][name], reference[name], **tol)
    assert max_rel_diff(r["local"], reference) > 1e-3, "one shard alone should not give the batch's gradient"
dp_check = pd.DataFrame(
    {v: [max_rel_diff(r[v], reference) for r in ranks] for v in ("manual", "ddp", "local")},
    index=pd.Index([r["rank"] for r in ranks], name="rank"),
).rename(columns=lambda v: f"{v}: max relative difference")
dp_check.map("{:.1e}".format)

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (7.1 Data parallelism)
if ranks:
    display(Markdown(
        f"Both data-parallel gradients match the single process's on every rank: the largest difference is "
        f"{dp_check.iloc[:, :2].to_numpy().max():.1e} of a tensor's largest gradient, which is float64 rounding "
        f"(the sums run in a different order). A rank's own shard alone misses by "
        f"{dp_check.iloc[:, 2].min():.0%} or more."))
else:
    print("skipped: one GPU here, so no data-parallel gradients to compare")

# %% [markdown]
# The all-reduce runs once per step on every gradient. A bandwidth-optimal way to all-reduce large messages, and one
# that NCCL uses, is a *ring*: the ranks pass chunks of $1/N$ of the buffer around a ring, $N-1$ steps to sum them (a
# reduce-scatter) and $N-1$ steps to hand the sums to everyone (an all-gather), so each rank sends, and
# receives, $2(N-1)/N$ times the gradient bytes: exactly the gradients on 2 GPUs, almost twice them on many.
# The manual loop starts the all-reduce after the backward pass has finished; DDP starts each bucket's
# all-reduce as soon as its gradients are ready, while the backward pass goes on with earlier layers.

# %% [markdown]
# ## 7.2 Tensor parallelism by hand: splitting the matrix products
#
# Data parallelism copies the model. Model parallelism splits it: **tensor parallelism** splits each layer's
# weight matrices over GPUs ([Shoeybi et al. (2019)](https://gpu-efficient-training.github.io/book/book/references.html), Megatron-LM), **pipeline parallelism** gives
# each GPU a range of layers. A matrix product $Y = XA$ can be split two ways:
#
# - by **columns**: $A = [A_1, A_2]$, so $Y = [XA_1, XA_2]$. Each GPU needs all of $X$ and produces a slice of
#   $Y$'s columns;
# - by **rows**: $A = \begin{bmatrix} A_1 \\ A_2 \end{bmatrix}$ and $X = [X_1, X_2]$, so $Y = X_1A_1 + X_2A_2$.
#   Each GPU produces a partial sum of the whole $Y$, and an all-reduce adds them.
#
# Two "GPUs" here are two halves of the weights in one process; the sums are what an all-reduce would compute.

# %%
gen = torch.Generator().manual_seed(0)
X = torch.randn(8, 64, generator=gen)  # 8 tokens, hidden size 64
A = torch.randn(64, 256, generator=gen)
Y = X @ A
A1, A2 = A.chunk(2, dim=1)  # column split: each GPU owns half of the output features
torch.testing.assert_close(torch.cat([X @ A1, X @ A2], dim=1), Y)
A1, A2 = A.chunk(2, dim=0)  # row split: each GPU owns half of the input features ...
X1, X2 = X.chunk(2, dim=1)  # ... and the matching half of X
torch.testing.assert_close(X1 @ A1 + X2 @ A2, Y)  # the sum is the all-reduce
print("column split and row split both equal the unsplit product (float32, default tolerances)")

# %% [markdown]
# A transformer's MLP block is two products with an element-wise activation between them:
# $\mathrm{GeLU}(XA)\,B$. Megatron-LM splits $A$ by columns and $B$ by rows. Each GPU then holds whole columns
# of $XA$, so it can apply the GeLU to its slice on its own (an element-wise function needs no neighbours),
# and its slice is exactly the row-slice of the input that its half of $B$ needs: **one all-reduce** at the
# end, and the bias of the second layer is added once, after it. We split the first MLP block of the tiny
# GPT-NeoX this way (`nn.Linear` stores its weight as output x input features, so "columns of $A$" are rows
# of `weight`).

# %%
tiny = models.build("polyglot-ko-1.3b", profile="tiny", head="causal-lm", device="cpu")
mlp = tiny.gpt_neox.layers[0].mlp  # dense_h_to_4h -> GeLU -> dense_4h_to_h
x = torch.randn(2, 16, tiny.config.hidden_size, generator=gen)
with torch.no_grad():
    full = mlp(x)
    up_w, up_b = mlp.dense_h_to_4h.weight.chunk(2, dim=0), mlp.dense_h_to_4h.bias.chunk(2)
    down_w = mlp.dense_4h_to_h.weight.chunk(2, dim=1)
    partial = [F.linear(mlp.act(F.linear(x, up_w[g], up_b[g])), down_w[g]) for g in range(2)]  # per GPU
    split = sum(partial) + mlp.dense_4h_to_h.bias  # all-reduce, then the bias once
torch.testing.assert_close(split, full)
print(f"MLP block split over 2: {tuple(up_w[0].shape)} and {tuple(down_w[0].shape)} weights per GPU, "
      "one all-reduce; equals the unsplit block")


# %% [markdown]
# Attention splits the same way, by heads. The query, key and value projections are split by columns, a
# group of whole heads per GPU, so each GPU computes its heads' attention with no communication at all; the
# output projection is split by rows, and one all-reduce adds the partial outputs. A plain causal multi-head
# attention (the rotary embeddings of GPT-NeoX act within each head and change nothing here):

# %%
def attention(x, wq, wk, wv, wo, n_heads):
    """Causal multi-head attention; w* are (hidden, width) matrices, ``width`` = heads x head size."""
    b, s, _ = x.shape
    q, k, v = (t.view(b, s, n_heads, -1).transpose(1, 2) for t in (x @ wq, x @ wk, x @ wv))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, heads, s, head size)
    return out.transpose(1, 2).reshape(b, s, -1) @ wo


h, heads = 64, 8
x = torch.randn(2, 16, h, generator=gen)
wq, wk, wv = (torch.randn(h, h, generator=gen) / h**0.5 for _ in range(3))
wo = torch.randn(h, h, generator=gen) / h**0.5
full = attention(x, wq, wk, wv, wo, heads)
cols = [w.chunk(2, dim=1) for w in (wq, wk, wv)]  # columns = heads 0-3 | heads 4-7
rows = wo.chunk(2, dim=0)
split = sum(attention(x, cols[0][g], cols[1][g], cols[2][g], rows[g], heads // 2) for g in range(2))
torch.testing.assert_close(split, full)
print(f"attention with {heads} heads split over 2 GPUs ({heads // 2} heads each), one all-reduce; "
      "equals the unsplit attention")

# %% [markdown]
# **What it costs.** A tensor-parallel transformer layer all-reduces its $b \times s \times h$ output twice in
# the forward pass (after attention and after the MLP) and twice in the backward pass (the gradients with
# respect to the inputs), every layer, every step. Data parallelism all-reduces each gradient once per step.
# For this book's 1.3B model at batch 4, sequence 256, with 16-bit [activations](https://gpu-efficient-training.github.io/book/book/glossary.html#activations) and fp32 gradients, the sizes
# of the all-reduced buffers (with a ring on $N$ GPUs each rank sends $2(N-1)/N$ times these: as much on 2
# GPUs, nearly twice as much on many; the factor is the same for both kinds, so the comparison holds):

# %%
# NBVAL_CHECK_OUTPUT
# (arithmetic on the model's configuration: the same everywhere; printed as text, identical across pandas versions)
cfg = models.config("polyglot-ko-1.3b", profile="full")
n_full = models.n_params(models.build("polyglot-ko-1.3b", profile="full", head="causal-lm", device="meta"))
b, s = 4, 256
tp_bytes_layer = 4 * b * s * cfg.hidden_size * 2  # 2 forward + 2 backward all-reduces, bf16
comm = pd.DataFrame({
    "what is all-reduced": ["activations, per layer", "activations, whole model", "fp32 gradients, once"],
    "per step (MiB)": [tp_bytes_layer / MIB, tp_bytes_layer * cfg.num_hidden_layers / MIB, 4 * n_full / MIB],
}, index=["tensor parallel", "tensor parallel", "data parallel"])
print(comm.to_string(float_format="{:,.2f}".format))

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (7.2 Tensor parallelism by hand)
tp_mib, dp_mib = tp_bytes_layer * cfg.num_hidden_layers / MIB, 4 * n_full / MIB
display(Markdown(
    f"Tensor parallelism all-reduces {'less' if tp_mib < dp_mib else 'more'} here ({tp_mib:,.0f} MiB against "
    f"{dp_mib:,.0f} MiB), but as {4 * cfg.num_hidden_layers} all-reduces per step that sit *between* the layers' "
    f"computations: every layer waits for its messages."))


# %% [markdown]
# Gradient all-reduces can overlap with
# the rest of the backward pass. That is why tensor parallelism is kept inside one machine, on NVLink, and data
# parallelism goes between machines ([Narayanan et al. (2021)](https://gpu-efficient-training.github.io/book/book/references.html)).
#
# **Pipeline parallelism** gives each of $p$ GPUs a consecutive range of layers (a *stage*). Activations flow
# forward from stage to stage and gradients flow back: the communication is small, one activation tensor per
# stage boundary. The cost is idle time. With one batch, stage 2 waits for stage 1's forward, and stage 1 for
# stage 2's backward. GPipe ([Huang et al. (2019)](https://gpu-efficient-training.github.io/book/book/references.html)) cuts the batch into $m$ *[micro-batches](https://gpu-efficient-training.github.io/book/book/glossary.html#micro-batch)* that follow
# each other through the pipeline. The schedule below is computed, not measured: each stage runs its tasks in
# order (all forwards, then all backwards), each as soon as its input is ready, with a backward taking twice
# as long as a forward (chapter 1).

# %%
def gpipe_schedule(p, m, t_f=1.0, t_b=2.0):
    """Start and end of every forward (F) and backward (B) of m micro-batches on p stages."""
    end, rows = {}, []
    for i in range(p):  # forwards: stage i, micro-batch j after stage i-1 and after its own j-1
        for j in range(m):
            start = max(end.get(("F", i - 1, j), 0.0), end.get(("F", i, j - 1), 0.0))
            end["F", i, j] = start + t_f
            rows.append(("F", i, j, start, start + t_f))
    for i in reversed(range(p)):  # backwards: from the last stage to the first
        for j in range(m):
            ready = end["F", p - 1, m - 1] if i == p - 1 else end["B", i + 1, j]
            start = max(ready, end.get(("B", i, j - 1), end["F", i, m - 1]))
            end["B", i, j] = start + t_b
            rows.append(("B", i, j, start, start + t_b))
    return pd.DataFrame(rows, columns=["kind", "stage", "micro", "start", "end"])


def bubble(schedule, p):
    """Fraction of the p stages' time spent idle."""
    busy = (schedule["end"] - schedule["start"]).sum()
    return 1 - busy / (p * schedule["end"].max())


p = 4
bubbles = {m: bubble(gpipe_schedule(p, m), p) for m in (1, 2, 4, 8, 16, 32)}
for m, frac in bubbles.items():
    assert math.isclose(frac, (p - 1) / (m + p - 1)), (m, frac)  # GPipe's bubble: (p-1)/(m+p-1)

# %% [markdown]
# The simulated idle fraction equals GPipe's formula $(p-1)/(m+p-1)$ for every $m$ (asserted above). Drawn for
# $p = 4$ stages:

# %%
fig, axes = plt.subplots(2, 1, figsize=(8, 4.5), sharex=False)
for ax, m in zip(axes, (1, 8)):
    sched = gpipe_schedule(p, m)
    for kind, color in (("F", "#4C72B0"), ("B", "#DD8452")):
        part = sched[sched.kind == kind]
        for _, row in part.iterrows():
            ax.barh(row.stage, row.end - row.start, left=row.start, color=color, edgecolor="white")
    ax.set_yticks(range(p), [f"GPU {i}" for i in range(p)])
    ax.invert_yaxis()
    ax.set_title(f"{m} micro-batch{'es' if m > 1 else ''}: {bubble(sched, p):.0%} of GPU time idle")
    ax.set_xlabel("time (forward passes of one micro-batch)")
axes[0].legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in ("#4C72B0", "#DD8452")],
               labels=["forward", "backward"], loc="lower left")
fig.suptitle("GPipe on 4 stages: micro-batches shrink the pipeline bubble")
fig.tight_layout()

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (7.2 Tensor parallelism by hand)
display(Markdown(
    f"With one micro-batch, {bubbles[1]:.0%} of the GPUs' time is idle: each GPU waits while the others work. "
    f"Eight micro-batches bring it to {bubbles[8]:.0%}, 32 to {bubbles[32]:.0%}."))

# %% [markdown]
# More micro-batches cost memory: GPipe keeps every [micro-batch](https://gpu-efficient-training.github.io/book/book/glossary.html#micro-batch)'s activations until its backward pass. The
# "one forward, one backward" (1F1B) schedule of [Narayanan et al. (2021)](https://gpu-efficient-training.github.io/book/book/references.html) has the same bubble but
# starts backward passes early, so a stage holds at most $p$ micro-batches' activations.

# %% [markdown]
# ## 7.3 ZeRO by formula
#
# Data parallelism copies everything to every GPU: parameters, gradients and optimizer states, the *model
# states*. ZeRO ([Rajbhandari et al. (2020)](https://gpu-efficient-training.github.io/book/book/references.html), "Zero Redundancy Optimizer") removes the copies in three
# stages: each of the $N_d$ GPUs keeps $1/N_d$ of the optimizer states (stage 1, $P_{os}$), then also of the
# gradients (stage 2, $P_{os+g}$), then also of the parameters (stage 3, $P_{os+g+p}$), and fetches what it
# needs when it needs it. With $\Psi$ parameters, mixed precision with Adam keeps fp16 parameters and
# gradients ($2\Psi + 2\Psi$ bytes) and $K\Psi$ bytes of optimizer states, $K = 12$: an fp32 master copy of
# the weights, momentum and variance. Per GPU:
#
# | | parameters | gradients | optimizer states |
# |---|---|---|---|
# | data parallel | $2\Psi$ | $2\Psi$ | $K\Psi$ |
# | ZeRO-1 | $2\Psi$ | $2\Psi$ | $K\Psi/N_d$ |
# | ZeRO-2 | $2\Psi$ | $2\Psi/N_d$ | $K\Psi/N_d$ |
# | ZeRO-3 | $2\Psi/N_d$ | $2\Psi/N_d$ | $K\Psi/N_d$ |
#
# `estimates.zero_model_state_bytes` is this table. The paper's figure 1 prints it for $\Psi$ = 7.5 billion
# and $N_d = 64$, in GB of $10^9$ bytes (120 GB is exactly $16 \times 7.5 \times 10^9$ bytes):

# %%
# NBVAL_CHECK_OUTPUT
# (pure arithmetic; printed as text)
psi, n_d = 7.5e9, 64
paper = pd.DataFrame({
    "paper (GB)": estimates.PAPER_7_5B_GB,
    "formula (GB)": {s: estimates.zero_model_state_bytes(psi, n_d, s)["total"] / 1e9 for s in estimates.STAGES},
    "formula (GiB)": {s: estimates.zero_model_state_bytes(psi, n_d, s)["total"] / GIB for s in estimates.STAGES},
}).rename(index=estimates.STAGE_LABELS)
assert (paper["formula (GB)"].round(1) == paper["paper (GB)"]).all()  # the paper's numbers, to its precision
print(paper.to_string(float_format="{:,.2f}".format))

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (7.3 ZeRO by formula)
gb = paper["formula (GB)"].to_numpy()
display(Markdown(
    f"The formula gives the paper's {gb[0]:.0f}, {gb[1]:.1f}, {gb[2]:.1f} and {gb[3]:.1f} GB, which the paper rounds "
    f"to one decimal (the last column converts them to the binary GiB of this book)."))

# %% [markdown]
# How they fall with the number of GPUs:

# %%
n_gpus = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
curve = (estimates.zero_table(psi, n_gpus) / GIB).rename(columns=estimates.STAGE_LABELS).reset_index()
fig = plots.lines(curve, x="GPUs", ys=list(estimates.STAGE_LABELS.values()), logx=True, logy=True,
                  title="7.5B parameters, mixed-precision Adam (K = 12): model states per GPU",
                  xlabel="data-parallel GPUs $N_d$", ylabel="model states per GPU (GiB)")
fig.axes[0].axhline(T4_MEMORY_GIB, color="grey", linestyle="--", label="a T4's 14.75 GiB")
fig.axes[0].legend()
fig.tight_layout()

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (7.3 ZeRO by formula)
display(Markdown(
    f"ZeRO-1 and ZeRO-2 level off: however many GPUs, each keeps the full fp16 parameters and (ZeRO-1) gradients, "
    f"$4\\Psi$ = {4 * psi / GIB:.1f} GiB and $2\\Psi$ = {2 * psi / GIB:.1f} GiB."))

# %% [markdown]
# Only ZeRO-3 keeps falling as $1/N_d$. The price is communication, which the paper counts per GPU and step
# (its section 7, for many GPUs): plain data parallelism moves $2\Psi$ elements, since its all-reduce is a
# reduce-scatter followed by an all-gather (with a ring, $2(N_d-1)/N_d \cdot \Psi$ from each GPU: this
# chapter's section 7.1). The paper's stages 1 and 2 move the same $2\Psi$: they reduce-scatter the gradients, each GPU updates its share of the
# parameters, and an all-gather of the updated parameters replaces the all-reduce's second half. Stage 3
# also gathers every layer's parameters in the forward pass and again in the backward pass: $3\Psi$, 1.5
# times data parallelism. Implementations differ: the ZeRO-1 that PyTorch offers (next section) keeps DDP's
# whole all-reduce and then broadcasts the updated parameters, about 1.5 times DDP's bytes as well.

# %% [markdown]
# ## 7.4 ZeRO for real: DDP, ZeroRedundancyOptimizer and FSDP, launched with torchrun
#
# PyTorch ships each stage as an engine:
#
# - **DDP** (`DistributedDataParallel`): everything replicated; gradients all-reduced in buckets during
#   backward. With `gradient_as_bucket_view=True` the gradients *are* the buckets; without it DDP keeps a
#   second, gradient-sized copy for communication.
# - **ZeRO-1**: DDP plus `torch.distributed.optim.ZeroRedundancyOptimizer`, which gives each rank the
#   optimizer (and its states) for a share of the parameters, and broadcasts the updated parameters after
#   the step. It sends DDP's all-reduce *plus* those broadcasts: per rank $2(N-1)/N$ times the gradient
#   bytes and $(N-1)/N$ times the parameter bytes, about 1.5 times DDP's traffic when both are fp32 (the
#   paper's ZeRO-1 reduce-scatters the gradients instead and sends no more than DDP).
# - **FSDP** ([Zhao et al. (2023)](https://gpu-efficient-training.github.io/book/book/references.html)), here FSDP2's `fully_shard`, applied to every transformer block and
#   then to the whole model: parameters, gradients and optimizer states are sharded *at rest*. A block's
#   parameters are all-gathered just before it runs and its gradients reduce-scattered right after its
#   backward. With `reshard_after_forward=True` the gathered parameters are freed after each block's forward
#   and gathered again for its backward: **ZeRO-3**. With `False` they are kept from forward to backward,
#   which saves the second all-gather: the memory of **ZeRO-2** during the computation (whole parameters,
#   sharded gradients and states), and what FSDP1 calls `SHARD_GRAD_OP`.
#
# The launched script, `scripts/train_zero.py`, builds the same model on every rank and passes it to one of
# these engines; the training loop after that is the same for all of them:

# %%
zero_script = launching.load_script(SCRIPTS / "train_zero.py")
Code(inspect.getsource(zero_script.wrap), language="python")

# %% [markdown]
# Training is in **fp32**: fp32 weights, fp32 gradients and AdamW's two fp32 states, $4 + 4 + 8 = 16$ bytes
# per parameter, so the formula takes 4-byte parameters and gradients and $K = 8$ (there is no separate
# master copy: the fp32 weights are the master). For each strategy every rank trains a few steps on its own
# random batches and records the bytes it holds, counted by `accounting.model_state_bytes` (FSDP
# turns each tensor into a `DTensor` whose `numel()` is the global size; each rank counts its local shard),
# the bytes of whole parameters it holds right after the forward pass (*gathered*), its [peak allocated](https://gpu-efficient-training.github.io/book/book/glossary.html#peak-allocated-memory)
# memory (GPU only) and the time of each of its timed steps (after untimed warm-up steps). The full profile
# trains the 1.3B GPT-NeoX at batch 4 per rank, sequence 256; we launch it on 1 GPU and on 2, and 4 GPUs would
# be next. On the world size of 2, each rank also trains one more step, which rank 0 records with the profiler,
# for section 7.7.
#
# The runs on one GPU hold everything: 16 bytes per parameter, FSDP's gathered copy beside its shards (4 more),
# the optimizer step's temporary buffers and the activations. Where the GPU's free memory is smaller than that
# estimate (with a 10% margin), the cell below keeps the architecture and drops transformer blocks until it
# fits, and says so; the numbers then describe that smaller model.

# %%
size = prof.pick(tiny=dict(batch=2, seq=32, warmup=1, steps=3), full=dict(batch=4, seq=256, warmup=2, steps=10))
recipe = dict(param_bytes=4, grad_bytes=4, optimizer_bytes=8)  # fp32 AdamW: K = 8, no separate master copy


def one_gpu_need_bytes(n_layers):
    """Estimated peak of the 1-GPU runs: states + FSDP's gathered copy + optimizer temporaries + activations."""
    psi = models.n_params(models.build("polyglot-ko-1.3b", profile="full", head="causal-lm", device="meta",
                                       num_hidden_layers=n_layers))
    states = estimates.zero_model_state_bytes(psi, 1, "ddp", **recipe)["total"]  # 16 bytes per parameter
    acts = 2 * estimates.korthikanti_activation_bytes(size["seq"], size["batch"], cfg.hidden_size,
                                                      cfg.num_attention_heads, layers=n_layers, attention="flash")
    logits = 3 * 4 * size["batch"] * size["seq"] * cfg.vocab_size  # fp32 logits, their softmax and gradient
    return states + 4 * psi + 4 * psi + acts + logits  # fp32 activations: twice the 16-bit formula


n_layers = cfg.num_hidden_layers  # the model's own 24 blocks
if prof.is_full and prof.on_gpu:
    free_bytes = torch.cuda.mem_get_info(0)[0] - GIB  # keep 1 GiB for the launched process's CUDA context
    fits = next((n for n in range(cfg.num_hidden_layers, 0, -1) if 1.1 * one_gpu_need_bytes(n) <= free_bytes), None)
    if fits is None:
        raise RuntimeError(f"even one block needs about {1.1 * one_gpu_need_bytes(1) / GIB:.1f} GiB; this GPU has "
                           f"{free_bytes / GIB:.1f} GiB free: run the tiny profile (GPUBOOK_PROFILE=tiny)")
    n_layers = fits
    if n_layers < cfg.num_hidden_layers:
        print(f"this GPU has {free_bytes / GIB:.1f} GiB free; the 1-GPU runs of the {cfg.num_hidden_layers}-block model "
              f"need about {1.1 * one_gpu_need_bytes(cfg.num_hidden_layers) / GIB:.0f} GiB: training {n_layers} blocks instead")
train_args = ["--profile", prof.name] + [a for k, v in size.items() for a in (f"--{k}", str(v))]
if prof.is_full and n_layers < cfg.num_hidden_layers:
    train_args += ["--layers", str(n_layers)]
runs = []
world_sizes = [ws for ws in (1, 2, 4) if ws <= n_dev]
skipped = [w for w in (1, 2, 4) if w > n_dev]
if skipped:
    print(f"world size{'s' if len(skipped) > 1 else ''} {' and '.join(map(str, skipped))}: formula only ("
          + (f"this machine has {n_dev} GPU{'s' if n_dev > 1 else ''})" if prof.on_gpu
             else "the tiny profile launches at most 2 CPU processes)"))
for ws in world_sizes:
    extra = ["--trace", WORK / "traces"] if ws == 2 else []  # one profiled step per strategy, rank 0
    launch = launching.torchrun(SCRIPTS / "train_zero.py", ws, ["--out", WORK / f"ws{ws}", *train_args, *extra])
    print(launch.text)
    done = launching.run(launch)
    print(f"  finished in {done.seconds:.0f} s")
    runs.append(launching.read_results(WORK / f"ws{ws}"))
results = pd.concat(runs, ignore_index=True)
assert (results["status"] == "ok").all(), (
    "a configuration ran out of GPU memory (use bigger GPUs, or GPUBOOK_PROFILE=tiny):\n"
    + results[["world_size", "strategy", "rank", "status"]].to_string())

# %% [markdown]
# One row per world size and strategy; where the ranks differ (ZeRO-1 splits the optimizer by whole
# parameters, so its shares need not be equal) the row shows the rank that holds the most. On a GPU,
# *allocated at start* is what was still allocated when the strategy began, in the process that had just run
# the previous one: 0 when everything was given back, or some tens of MiB when the previous strategy's matrix
# products left their cuBLAS workspaces behind (see the end of this chapter, and chapter 4). Beside it, the
# formula for the same $\Psi$, with 4-byte parameters and gradients and $K = 8$:

# %%
unit, unit_name = prof.pick(tiny=(MIB, "MiB"), full=(GIB, "GiB"))
psi_run = int(results["n_params"].iloc[0])
model_size = f"GPT-NeoX, {psi_run / 1e9:.2f}B parameters" if psi_run >= 1e9 else f"GPT-NeoX, {psi_run / 1e6:.1f}M parameters"
parts = {"params_mib": "parameters", "gathered_params_mib": "gathered parameters", "grads_mib": "gradients",
         "optimizer_states_mib": "optimizer states"}
per_rank = results.assign(states_mib=results[list(parts)].sum(axis=1))
top = per_rank.loc[per_rank.groupby(["world_size", "strategy"])["states_mib"].idxmax()]
table = top.set_index(["world_size", "strategy"])[[*parts, "states_mib"]] * MIB / unit
table.columns = [f"{parts.get(c, 'model states')} ({unit_name})" for c in table.columns]
table[f"formula ({unit_name})"] = [
    estimates.zero_model_state_bytes(psi_run, ws, st, **recipe)["total"] / unit for ws, st in table.index
]
table["measured / formula"] = table[f"model states ({unit_name})"] / table[f"formula ({unit_name})"]
if prof.on_gpu:
    table["peak allocated (GiB)"] = top.set_index(["world_size", "strategy"])["peak_allocated_mib"] * MIB / GIB
    table["allocated at start (MiB)"] = top.set_index(["world_size", "strategy"])["allocated_before_mib"]
step_samples = {key: tuple(t) for key, t in
                top.set_index(["world_size", "strategy"])["step_times_s"].items()}  # the rank holding the most
steps = {key: timing.Spread.of(t) for key, t in step_samples.items()}
table["step time, median (s)"] = [steps[k].median for k in table.index]
table["step time, IQR (s)"] = [steps[k].iqr for k in table.index]
table

# %% [markdown]
# How to read it, stage by stage (all per rank, $N$ ranks):
#
# - **DDP** holds the 16 bytes per parameter of chapter 1 whatever $N$ is: measured and formula agree exactly.
# - **ZeRO-1** keeps whole parameters and gradients and about $1/N$ of the optimizer states.
# - **FSDP, both settings**, holds only its shard of everything at rest, $16\Psi/N$. The difference between
#   them is the *gathered* column: with `reshard_after_forward=False` (ZeRO-2) each rank also holds every
#   layer's whole parameters from the forward pass to the backward pass; with `True` (ZeRO-3) none are left
#   after the forward pass. The paper's ZeRO-2 keeps whole parameters instead of shards; FSDP keeps the
#   shards *and* gathers, so its ZeRO-2 row exceeds the formula by one parameter shard, $4\Psi/N$.
# - On one GPU, FSDP shards nothing, and with `reshard_after_forward=False` it still gathers a second, whole
#   copy of the parameters: on one GPU it only costs (in memory held from forward to backward; whether the peak
#   shows it depends on where in the step the peak falls).
#
# The accounting counts tensors; the allocator (on a GPU) counts everything: activations, the gathered
# parameters of the layer being computed, the optimizer's temporary buffers. The figure shows what each rank
# holds, with the formula as a black mark; the 4-GPU column is the formula alone.

# %%
colors = {"parameters": plots.COMPONENT_COLORS["weights"], "gathered parameters": "#A6BDDB",
          "gradients": plots.COMPONENT_COLORS["gradients"], "optimizer states": plots.COMPONENT_COLORS["optimizer states"]}
labels = [estimates.STAGE_LABELS[s].replace(" (", "\n(") for s in estimates.STAGES]
fig, axes = plt.subplots(1, 3, figsize=(11, 4), sharey=True)
for ax, ws in zip(axes, (1, 2, 4)):
    formula = [estimates.zero_model_state_bytes(psi_run, ws, s, **recipe) for s in estimates.STAGES]
    measured = ws in set(table.index.get_level_values(0))
    bottom = np.zeros(len(estimates.STAGES))
    for part, color in colors.items():
        if measured:
            vals = np.array([table.loc[(ws, s), f"{part} ({unit_name})"] for s in estimates.STAGES])
        else:
            key = {"parameters": "weights", "gradients": "gradients", "optimizer states": "optimizer_states"}.get(part)
            vals = np.array([f[key] / unit if key else 0.0 for f in formula])
        ax.bar(labels, vals, bottom=bottom, color=color, label=part, hatch=None if measured else "//",
               edgecolor="white")
        bottom += vals
    ax.scatter(labels, [f["total"] / unit for f in formula], color="black", marker="_", s=900, zorder=3,
               label="formula")
    who = ("GPU", "GPUs") if prof.on_gpu else ("process", "processes")
    ax.set_title(f"{ws} {who[ws > 1]}{'' if measured else ': formula only'}")
    ax.tick_params(axis="x", labelsize=8)
axes[0].set_ylabel(f"model states per rank ({unit_name})")
handles, _ = axes[0].get_legend_handles_labels()  # the 1-GPU panel, always measured: solid swatches
handles.append(mpatches.Patch(facecolor="white", edgecolor="grey", hatch="//", label="formula only (not run)"))
axes[-1].legend(handles=handles, loc="upper right")
fig.suptitle(f"{model_size}, fp32 AdamW: each ZeRO stage holds less per rank")
fig.tight_layout()

# %% [markdown]
# On the GPUs, the peak allocated memory of each rank, the number that decides whether a run fits:

# %%
if run_profile.cuda_or_skip("peak allocated memory is an allocator statistic"):
    peak = table["peak allocated (GiB)"].unstack("world_size").reindex(estimates.STAGES)
    peak.index = labels
    ax = peak.plot.bar(rot=0, figsize=(8, 4), color=["#8C8C8C", "#4C72B0"][-len(peak.columns):])
    t4_line = ax.axhline(T4_MEMORY_GIB, color="grey", linestyle="--")
    ax.legend([*ax.containers, t4_line], [f"{c} GPU{'s' if c > 1 else ''}" for c in peak.columns] + ["a T4's 14.75 GiB"],
              loc="upper left", bbox_to_anchor=(1.0, 1.0))  # beside the axes: inside, it covered the tallest bar
    ax.set_ylabel("peak allocated per rank (GiB)")
    ax.set_xlabel("")
    ax.set_title(f"{model_size}, fp32 AdamW, batch {size['batch']} x {size['seq']}: peak memory per rank")
    ax.figure.tight_layout()

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title The verdict of timing.unpaired in words
def launch_words(verdict, what=""):
    """The verdict of ``timing.unpaired`` in words: a difference only beyond its 10% margin for separate runs."""
    if verdict == timing.NO_DIFFERENCE:
        return "no difference beyond the 10% margin that two separately timed runs need"
    return f"{verdict}{' ' + what if what else ''} beyond the 10% margin that two separately timed runs need"


if prof.on_gpu:
    t, gib = table, f"model states ({unit_name})"
    text = (f"On one GPU, DDP holds {t.loc[(1, 'ddp'), gib]:.1f} {unit_name} of model states and peaks at "
            f"{t.loc[(1, 'ddp'), 'peak allocated (GiB)']:.1f} GiB: on top of the model states come the activations "
            f"and the optimizer step's temporary buffers. Every strategy started from "
            f"{t['allocated at start (MiB)'].max():.0f} MiB allocated or less.")
    if 2 in world_sizes:
        cmp3 = timing.unpaired(step_samples[(2, "ddp")], step_samples[(2, "zero3")])  # timed one after the other
        text += (f" On two GPUs, ZeRO-3 holds {t.loc[(2, 'zero3'), gib]:.1f} {unit_name} at rest and peaks at "
                 f"{t.loc[(2, 'zero3'), 'peak allocated (GiB)']:.1f} GiB per rank, against "
                 f"{t.loc[(2, 'ddp'), 'peak allocated (GiB)']:.1f} GiB for DDP. The step times on two GPUs (medians of "
                 f"{size['steps']} steps: {steps[(2, 'ddp')].median:.3f} s for DDP, IQR {steps[(2, 'ddp')].iqr * 1e3:.1f} ms; "
                 f"{steps[(2, 'zero3')].median:.3f} s for ZeRO-3, IQR {steps[(2, 'zero3')].iqr * 1e3:.1f} ms; DDP's "
                 f"median over ZeRO-3's is {cmp3.phrase()}, {launch_words(cmp3.verdict, 'than DDP')}) include the "
                 f"communication between two GPUs of one machine; section 7.6 says what changes over a network.")
    display(Markdown(text))
else:
    print("skipped on CPU: memory peaks and step times of CPU processes say nothing about GPUs")

# %% [markdown]
# **Scaling from 1 to 2 GPUs.** Each rank trains the same number of sequences per step, so two GPUs train
# twice the samples of one in each step, and the throughput ratio is $2 \times t_1 / t_2$ for step times $t_1$
# on one GPU and $t_2$ on two; the *[scaling efficiency](https://gpu-efficient-training.github.io/book/book/glossary.html#scaling-efficiency)* is that ratio over 2, $t_1 / t_2$. The two step times come
# from **separate launches** (one `torchrun` with one process, then one with two), so they cannot be interleaved
# as chapter 8 compares two steps in one process. `timing.unpaired` takes the ratio of the two medians, with an
# interval from each median's own 97.5% interval (order statistics over the launch's timed steps; together at
# least 95%). That interval covers the spread of the steps *within* each launch, not what differs between two
# launches (GPU clocks, the host's other work, NCCL's set-up), so the verdict column asks more than chapter 8's
# ±3%: a difference only when the whole interval lies beyond ±10% (`timing.LAUNCH_THRESHOLD`).

# %%
if prof.on_gpu and 2 in world_sizes:
    scale = {st: timing.unpaired(step_samples[(1, st)], step_samples[(2, st)], names=("1 GPU", "2 GPUs"))
             for st in estimates.STAGES}  # 1-GPU step over 2-GPU step: the scaling efficiency
    scaling = pd.DataFrame([{
        "1 GPU: step (s)": steps[(1, stage)].median, "2 GPUs: step (s)": steps[(2, stage)].median,
        "throughput 2 vs 1": 2 * scale[stage].ratio,
        "95% interval": f"{2 * scale[stage].lo:.2f} to {2 * scale[stage].hi:.2f}",
        "efficiency": f"{scale[stage].ratio:.0%}",
        "2-GPU step vs 1-GPU step": scale[stage].verdict,
    } for stage in estimates.STAGES], index=[estimates.STAGE_LABELS[s] for s in estimates.STAGES])
    display(scaling)
else:
    print("skipped: scaling needs 2 GPUs" + ("" if prof.on_gpu else " (CPU processes share one CPU's cores)"))

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title The 1-to-2-GPU sentence from timing.unpaired results per engine
SHORT = {"ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3"}  # for names inside parentheses


def scaling_sentence(scale):
    """The 1-to-2-GPU sentence from ``timing.unpaired`` results per engine (keys: ``estimates.STAGES``)."""
    eff = {st: u.ratio for st, u in scale.items()}
    lo_st, hi_st = min(eff, key=eff.get), max(eff, key=eff.get)
    text = (f"From 1 to 2 GPUs the throughput grows {2 * eff[lo_st]:.2f} to {2 * eff[hi_st]:.2f} times across the "
            f"four engines, a scaling efficiency of {eff[lo_st]:.0%} ({SHORT[lo_st]}) to {eff[hi_st]:.0%} "
            f"({SHORT[hi_st]}); the 1-GPU and 2-GPU steps come from separate launches. ")
    slower = [SHORT[st] for st, u in scale.items() if u.verdict == "slower"]
    if slower:
        text += (f"For {'all four engines' if len(slower) == len(scale) else prose.listing(slower)} the step on two "
                 f"GPUs is longer than on one beyond the 10% margin of separate launches; section 7.7 holds the growth "
                 f"against the communication time that the computation does not hide. ")
    else:
        text += ("No engine's step on two GPUs is longer than on one beyond the 10% margin of separate launches: the "
                 "communication hides largely behind the computation here, or costs less than two launches can "
                 "resolve (section 7.7 measures how much of it is exposed). ")
    above = {st: u for st, u in scale.items() if u.ratio > 1}
    for st, u in above.items():
        if u.lo <= 1:
            text += (f"{SHORT[st]}'s efficiency above 100% does not show that a second GPU did more than double the "
                     f"throughput: its interval ({u.lo:.0%} to {u.hi:.0%}) includes 100%. ")
        else:
            margin = ("beyond even" if u.lo >= 1 + timing.LAUNCH_THRESHOLD else "though within")
            text += (f"{SHORT[st]}'s efficiency lies above 100% over its whole interval ({u.lo:.0%} to {u.hi:.0%}), "
                     f"{margin} the 10% margin of separate launches. ")
    if any(u.lo > 1 for u in above.values()):
        text += ("Were such a gain real, it could come from the optimizer step, which on two GPUs updates only each "
                 "rank's share of the parameters under ZeRO-2 and ZeRO-3; these runs do not time it separately. ")
    return text + "Differences between the engines' ratios smaller than their intervals are not established by these runs."


if prof.on_gpu and 2 in world_sizes:
    prose.say(scaling_sentence(scale))
else:
    print("skipped: no 2-GPU run to compare with" if prof.on_gpu
          else "skipped on CPU: step times of CPU processes say nothing about GPUs")


# %% [markdown]
# The engines change where the states live, not the arithmetic: on each world size, rank 0's losses are the
# same under all four (they differ only by the order in which gradients were summed).

# %%
losses = results[results["rank"] == 0].set_index(["world_size", "strategy"])["losses"]
loss_table = pd.DataFrame(losses.tolist(), index=losses.index).rename(columns=lambda i: f"step {i}")
LOSS_RTOL = 2e-5  # about 2e-4 nats at a loss near 10.7; one step of training moves it by ~1e-2
ddp_rows = loss_table.xs("ddp", level="strategy").reindex(loss_table.index.get_level_values(0))
rel_diff = ((loss_table - ddp_rows.to_numpy()).abs() / ddp_rows.abs().to_numpy()).to_numpy().max()
rel_move = ((loss_table.sub(loss_table["step 0"], axis=0)).abs().div(loss_table["step 0"], axis=0)).to_numpy().max()
print(f"largest relative difference from DDP's loss at the same step: {rel_diff:.1e} (tolerance {LOSS_RTOL:.0e}); "
      f"largest relative move of a loss from its step 0: {rel_move:.1e}")
for ws in loss_table.index.get_level_values(0).unique():
    for stage in estimates.STAGES:
        np.testing.assert_allclose(loss_table.loc[(ws, stage)], loss_table.loc[(ws, "ddp")], rtol=LOSS_RTOL)
loss_table.map("{:.4f}".format)

# %% [markdown]
# ## 7.5 The same through accelerate
#
# Hugging Face's `accelerate launch` starts the same processes as `torchrun` and passes a configuration to
# them; in the script, `Accelerator().prepare(model, optimizer)` wraps model and optimizer as the
# configuration says. This YAML file asks for FSDP2, one unit per `GPTNeoXLayer`, fully sharded:

# %%
Code((SCRIPTS / "accelerate_fsdp.yaml").read_text(), language="yaml")

# %% [markdown]
# `mixed_precision: "no"` is accelerate's own setting (the config key, or `--mixed_precision` on the
# command line; choices `no`, `fp16`, `bf16`, `fp8`): the run trains in fp32, like every other run of this
# chapter. `bf16` would make accelerate wrap the forward pass in bf16 [autocast](https://gpu-efficient-training.github.io/book/book/glossary.html#autocast) and, under FSDP, also gather
# parameters and reduce gradients in bf16 (an FSDP mixed-precision policy); the script's own `--bf16` flag
# (exercise 2) turns on autocast only.
#
# The training script stays as it is. Its `accelerate` strategy (shown above in `wrap`) hands model and
# optimizer to `Accelerator.prepare` and returns `accelerator.backward`; the loop, the measurements and the
# results are the same code as for the other strategies. accelerate applies an FSDP configuration only on
# GPUs: on a CPU (the tiny profile) we tell it so (`ACCELERATE_USE_CPU=true`), and it falls back to DDP over
# gloo.

# %%
nproc = min(2, n_dev)
acc_launch = launching.accelerate_launch(SCRIPTS / "accelerate_fsdp.yaml", SCRIPTS / "train_zero.py", nproc,
                                           ["--strategies", "accelerate", "--out", WORK / "accelerate", *train_args])
print(acc_launch.text)
acc_env = launching.launch_env()
if not prof.on_gpu:
    acc_env["ACCELERATE_USE_CPU"] = "true"
done = launching.run(acc_launch, env=acc_env)
print(f"  finished in {done.seconds:.0f} s")
acc = launching.read_results(WORK / "accelerate")
engine = "zero3" if acc["wrapped_as"].iloc[0].startswith("FSDP") else "ddp"  # what accelerate applied
mine = results[(results.world_size == nproc) & (results.strategy == engine)].set_index("rank")
held = ["params_mib", "grads_mib", "optimizer_states_mib"]
np.testing.assert_allclose(acc.set_index("rank")[held], mine[held])  # same engine, same bytes per rank
print(f"accelerate wrapped the model as {acc['wrapped_as'].iloc[0]}: per rank the same parameters, gradients "
      f"and optimizer states as the hand-made '{engine}' run")
acc_cols = ["rank", *held, "gathered_params_mib", "peak_allocated_mib", "step_time_s"]
acc[acc_cols]

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (7.5 The same through accelerate)
if engine == "zero3":
    gathered_mib = acc["gathered_params_mib"].max()
    display(Markdown(
        "accelerate's FSDP holds, per rank, exactly the shards of our hand-made ZeRO-3 (asserted above). "
        + (f"One difference shows in the gathered column, {gathered_mib:,.0f} MiB: accelerate puts the final layer "
           "norm and the output head in a unit of their own that stays gathered from the end of the forward pass to "
           "the start of the backward pass, since the backward pass needs them first."
           if gathered_mib > 0 else "Its gathered column is 0, like ZeRO-3's.")))
else:
    print("skipped on CPU: accelerate applies an FSDP config only on GPUs; here it ran DDP, asserted equal to ours")

# %% [markdown]
# DeepSpeed's ZeRO is configured the same way, with `distributed_type: DEEPSPEED` and a `deepspeed_config`
# (`zero_stage: 1`, `2` or `3`) in the YAML file; it is not tried here:

# %%
deepspeed_found = importlib.util.find_spec("deepspeed") is not None
print("DeepSpeed is installed, but this chapter runs only the FSDP config" if deepspeed_found
      else "skipped: DeepSpeed is not installed here (pip install deepspeed), so only the FSDP config runs")

# %% [markdown]
# ## 7.6 What changes across machines
#
# Everything above ran on the GPUs of one machine, where NCCL moves data over NVLink. Between machines it
# goes over the network (InfiniBand or Ethernet), with far less bandwidth per GPU, and that decides which
# parallelism goes where: tensor parallelism, which communicates inside every layer, stays within a machine;
# pipeline stages and data parallelism (with ZeRO) span machines. ZeRO-3 trades memory for traffic (1.5
# times DDP's), and so does PyTorch's ZeRO-1 (DDP's all-reduce plus the parameters' broadcast); across a slow
# network, ZeRO-2 (DDP's bytes), a ZeRO-1 that reduce-scatters the gradients as the paper describes, or FSDP's
# hybrid [sharding](https://gpu-efficient-training.github.io/book/book/glossary.html#sharding) (shard within a machine, replicate across machines) may train faster.
#
# The script itself does not change. `torchrun` is started once on every machine, with the number of
# machines, this machine's index and one address where they all meet:
#
# ```bash
# # on each of 2 machines with 8 GPUs; node 0 is reachable as host0
# torchrun --nnodes=2 --nproc_per_node=8 --node_rank=0 \
#          --rdzv_backend=c10d --rdzv_endpoint=host0:29500 scripts/train_zero.py --out results
# ```
#
# (`--node_rank=1` on the second machine.) `accelerate launch` takes the same information as
# `--num_machines`, `--machine_rank`, `--main_process_ip` and `--main_process_port`. Setting
# `NCCL_DEBUG=INFO` shows which transport NCCL chose between each pair of GPUs. Two practical notes from
# this chapter's runs: every rank builds the whole model before FSDP shards it, which a model larger than one
# GPU does not allow (build it on the `meta` device, shard it, then initialise the shards: FSDP2's documented
# way); and `launching.launch_env` turns NVLink multicast off (`NCCL_NVLS_ENABLE=0` and two related
# variables), as the GPU machines of this book require; elsewhere NCCL's defaults are fine.

# %% [markdown]
# ## 7.7 Communication, measured
#
# How fast are the collectives themselves? `scripts/collectives_bench.py` times all-reduce, reduce-scatter,
# all-gather and broadcast on every GPU this process sees (`CUDA_VISIBLE_DEVICES` can hide others), from 1 MiB to 4 GiB (in the tiny profile: two CPU
# processes with gloo, 64 KiB to 4 MiB). It follows the definitions of NVIDIA's `nccl-tests`
# ([NVIDIA (2024)](https://gpu-efficient-training.github.io/book/book/references.html), its doc/PERFORMANCE.md): for a collective on $S$ bytes that takes $t$
# seconds on $n$ ranks, the *algorithm bandwidth* is $S/t$ and the *bus bandwidth* multiplies it by what a
# ring moves over each link: $2(n-1)/n$ for all-reduce (the ring of section 7.1), $(n-1)/n$ for
# reduce-scatter and all-gather, 1 for broadcast. The bus bandwidth does not depend on $n$ for an ideal
# ring, and nccl-tests compares it with the hardware's peak bandwidth *per direction* of the link. Every
# size is timed 20 times after 5 warm-up calls (10 after 2 in the tiny profile; each call starts after a
# barrier and a synchronisation, and its time is the slowest rank's); the table keeps the median, the IQR
# and the fastest call.

# %%
if n_dev >= 2:
    bench_args = prof.pick(tiny=dict(min_bytes=2**16, max_bytes=2**22, warmup=2, repeat=10),
                           full=dict(min_bytes=2**20, max_bytes=2**32, warmup=5, repeat=20))
    launch = launching.torchrun(SCRIPTS / "collectives_bench.py", n_dev,
                                ["--out", WORK / "bandwidth"] + [a for k, v in bench_args.items()
                                                                 for a in (f"--{k.replace('_', '-')}", str(v))])
    print(launch.text)
    done = launching.run(launch)
    print(f"  finished in {done.seconds:.0f} s: {done.stdout.strip()}")
    bw = launching.read_results(WORK / "bandwidth")
    bandwidth = collectives.bandwidth_table(bw)
    display(bandwidth)
else:
    bw = None
    print(f"skipped: collectives need 2 GPUs; this machine has {n_dev}")

# %% [markdown]
# The link's nominal bandwidth: `nvidia-smi nvlink -s` lists each NVLink of a GPU with the speed the driver
# reports for it. NVIDIA's datasheets for the H100 SXM and the H200 (the latter: [NVIDIA (2024)](https://gpu-efficient-training.github.io/book/book/references.html))
# give 900 GB/s of NVLink
# bandwidth per GPU, counted in both directions together: 450 GB/s each way, the number a bus bandwidth is held
# against (the H100 SXM has the same fourth-generation NVLink, 18 links per GPU, so the same figure holds for it). The driver's per-link figures, summed, need not equal the datasheet's exactly; both are drawn where
# found, and the text below uses the datasheet's where it knows the GPU. Neither is reachable in practice: NCCL's
# maintainer puts NCCL's protocol overhead on NVLink at about 20%, which leaves an effective 370 GB/s of the
# H100's 450 GB/s line rate, the bus bandwidth to expect from a ring ([Jeaugey (2024)](https://gpu-efficient-training.github.io/book/book/references.html),
# on an H100; the H200 has the same NVLink 4).

# %%
H200_NVLINK_PER_DIRECTION_GB_S = 450.0  # NVIDIA H200 datasheet: 900 GB/s NVLink, both directions together
NCCL_EFFECTIVE_NVLINK4_GB_S = 370.0  # Jeaugey (2024), nccl-tests issue 212: line rate less ~20% protocol overhead
nominal = {}  # label -> GB/s per direction, drawn as lines
if run_profile.cuda_or_skip("no NVLink between CPU processes (gloo moves data through the host)"):
    gpu_name = torch.cuda.get_device_name(0)
    found = env.nvlink_status()
    links = found[1].get(0, []) if found else []
    if found is None:
        print("nvidia-smi nvlink -s is missing or failed here: the link's nominal bandwidth is unknown")
    elif not links:
        print(f"nvidia-smi reports no active NVLink on GPU 0 ({gpu_name}): the GPUs talk over PCIe; "
              "its nominal bandwidth is not read here")
    else:
        nominal[f"nvidia-smi: {len(links)} links, sum"] = sum(links)
        print(f"nvidia-smi nvlink -s, GPU 0 ({gpu_name}): {len(links)} active links, "
              f"{', '.join(sorted({f'{v:g} GB/s' for v in links}))} each, {sum(links):.0f} GB/s together")
    if len(links) == 18 and ("H200" in gpu_name or "H100" in gpu_name):  # the SXM parts: 18 NVLink 4 links
        nominal["H200/H100 datasheet, per direction"] = H200_NVLINK_PER_DIRECTION_GB_S
        nominal["NCCL's effective NVLink 4 bandwidth"] = NCCL_EFFECTIVE_NVLINK4_GB_S

# %%
if bw is not None:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for coll in estimates.COLLECTIVES:
        part = bandwidth.loc[coll]
        ax.plot(part.index * MIB, part["busbw (GB/s)"], marker="o", label=coll.replace("_", "-"))
    for (label, gb_s), style in zip(nominal.items(), ("--", ":", "-.")):
        ax.axhline(gb_s, color="grey", linestyle=style, label=f"{label}: {gb_s:.0f} GB/s")
    ax.set_xscale("log", base=2)
    ticks = sorted(set(bw["size_bytes"]))
    ax.set_xticks(ticks, [f"{t / GIB:g} GiB" if t >= GIB else f"{t / MIB:g} MiB" if t >= MIB else f"{t // 1024} KiB"
                          for t in ticks], rotation=30, ha="right")  # seven sizes: upright labels overlapped
    ax.set_xlabel("message size S")
    ax.set_ylabel("bus bandwidth (GB/s, median)")
    where = f"{n_dev} GPUs, NCCL" if prof.on_gpu else "2 CPU processes, gloo"
    ax.set_title(f"{where}: bus bandwidth grows with the message size"
                 + ("" if nominal else " (no nominal link bandwidth known)"))
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (7.7 Communication, measured)
if prof.on_gpu and bw is not None:
    big_mib, small_mib = bandwidth.index.get_level_values(1).max(), bandwidth.index.get_level_values(1).min()
    big, small = bandwidth.xs(big_mib, level=1), bandwidth.xs(small_mib, level=1)
    ar = big.loc["all_reduce", "busbw (GB/s)"]
    text = (f"At {big_mib:,.0f} MiB, all-reduce reaches {ar:,.0f} GB/s of bus "
            f"bandwidth (reduce-scatter {big.loc['reduce_scatter', 'busbw (GB/s)']:,.0f}, all-gather "
            f"{big.loc['all_gather', 'busbw (GB/s)']:,.0f}, broadcast {big.loc['broadcast', 'busbw (GB/s)']:,.0f}); at "
            f"{small_mib:g} MiB, {small.loc['all_reduce', 'busbw (GB/s)']:,.1f} GB/s, because a small message's time is mostly "
            f"fixed cost (launch, synchronisation), not transfer.")
    ref = nominal.get("H200/H100 datasheet, per direction") or next(iter(nominal.values()), None)
    practical = nominal.get("NCCL's effective NVLink 4 bandwidth")
    bw_curve = {c: bandwidth.loc[c, "busbw (GB/s)"] for c in estimates.COLLECTIVES}
    bw_rising = {c: bw_curve[c].iloc[-1] > 1.03 * bw_curve[c].iloc[-2] for c in bw_curve}  # +3% over the sweep's last step
    bw_name = {c: c.replace("_", "-") for c in bw_curve}
    if ref:
        text += f" All-reduce's {ar:,.0f} GB/s is {ar / ref:.0%} of the {ref:.0f} GB/s per direction the link is rated for."
        if practical:
            bw_share = {c: big.loc[c, "busbw (GB/s)"] / practical for c in bw_curve}
            bw_at = [bw_name[c] for c in bw_curve if bw_share[c] >= 0.9]
            bw_below = [c for c in bw_curve if bw_share[c] < 0.9]
            text += (f" NCCL's protocol overhead leaves {practical:.0f} GB/s of it, a figure NCCL's maintainer gives for "
                     f"broadcast-like operations ([Jeaugey (2024)](https://gpu-efficient-training.github.io/book/book/references.html)); against it, at {big_mib:,.0f} MiB: "
                     + ", ".join(f"{bw_name[c]} {bw_share[c]:.0%}" + (" (still rising)" if bw_rising[c] else "") for c in bw_curve)
                     + ". ")
            if bw_at:
                text += f"Within a tenth of that ceiling: {', '.join(bw_at)}. "
            if bw_below:
                text += (f"Below it: {', '.join(bw_name[c] for c in bw_below)}; "
                         + ("their curves still rise at the largest message, so larger ones would get closer. "
                            if all(bw_rising[c] for c in bw_below) else
                            "where a curve has flattened, the rest of the gap is not the message size, and this "
                            "sweep does not show what it is. ")
                         + ("With NVLink multicast (NVLS) off, as on this book's machines, NCCL cannot use the switch's "
                            "in-network reduction, which the same source credits with a higher all-reduce bus "
                            "bandwidth." if "all_reduce" in bw_below else ""))
    else:
        text += " The link's nominal bandwidth is unknown here, so there is nothing to hold it against."
    display(Markdown(text))
else:
    print("skipped on CPU: gloo's bandwidth between CPU processes says nothing about a GPU link"
          if not prof.on_gpu else "skipped: no collectives measured on one GPU")


# %% [markdown]
# ### Each engine's bytes per step: formula and profiler
#
# `estimates.communication_table` lists the collectives of one training step per engine, with $S$ summed
# over the step ($\Psi$ fp32 parameters and gradients; section 7.3): DDP all-reduces the gradients; ZeRO-1 as
# PyTorch runs it adds a broadcast of the parameters; FSDP's ZeRO-2 all-gathers the parameters once and
# reduce-scatters the gradients; ZeRO-3 all-gathers them twice. The 2-GPU run of section 7.4 recorded one step
# per engine with the profiler on rank 0; `profiler.communication_from_trace` sums the communication
# kernels it finds there, by collective, and `profiler.communication_overlap` splits their time into the
# part that ran while a compute kernel ran on the same GPU (*hidden*) and the rest (*exposed*). An NCCL
# kernel starts when its rank arrives and ends when all ranks are done, so *exposed* also counts waiting for
# the other rank. Two cautions for setting these times against section 7.4's growth from 1 to 2 GPUs: the traced
# step is one extra, profiled step, not one of the timed ones; and the growth compares two separate launches, so
# part of it, or all of it, can be what differs between two launches on the same host (its other work, the GPU's
# clocks) rather than anything the second GPU adds.

# %%
formula = estimates.communication_table(psi_run, 2)
formula_mib = formula.groupby(["engine", "collective"], sort=False)["S (bytes)"].sum() / MIB
traces = WORK / "traces"
if prof.on_gpu and 2 in world_sizes:
    rows, overlap = [], {}
    for engine_name in estimates.STAGES:
        path = traces / f"{engine_name}.json.gz"
        measured = profiler.communication_from_trace(path)
        kinds = sorted(set(measured.index) | set(formula_mib.loc[engine_name].index))
        for kind in kinds:
            got = measured.loc[kind] if kind in measured.index else None
            rows.append({"engine": estimates.COMM_LABELS[engine_name], "collective": kind,
                         "formula S (MiB)": formula_mib.get((engine_name, kind), 0.0),
                         "profiler S (MiB)": got["S (MiB)"] if got is not None else 0.0,
                         "calls": int(got["calls"]) if got is not None else 0,
                         "kernel time (ms)": got["kernel time (ms)"] if got is not None else 0.0})
        overlap[estimates.COMM_LABELS[engine_name]] = profiler.communication_overlap(path)
    comm_bytes = pd.DataFrame(rows).set_index(["engine", "collective"])
    assert (comm_bytes["calls"] > 0).any(), f"no NCCL kernels in the traces of {traces}: were they recorded on a GPU?"
    display(comm_bytes)
    overlap_table = pd.DataFrame(overlap).T
    overlap_table = pd.DataFrame({
        "communication (ms)": overlap_table["communication_s"] * 1e3,
        "hidden (ms)": overlap_table["hidden_s"] * 1e3, "exposed (ms)": overlap_table["exposed_s"] * 1e3,
        "hidden share": overlap_table["hidden_fraction"].map("{:.0%}".format),
        "traced step, first to last kernel (ms)": overlap_table["span_s"] * 1e3,
    })
    display(overlap_table)
else:
    print("skipped on CPU: gloo runs collectives on CPU threads, so a trace has no communication kernels to count; "
          "the formula for 2 ranks, in MiB per step:" if not prof.on_gpu else "skipped: no 2-GPU run to trace")
    display(formula_mib.rename("formula S (MiB)").to_frame())

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Each engine's step growth from 1 to 2 GPUs (two separate launches) beside the traced…
def growth_attribution(samples, overlap):
    """Each engine's step growth from 1 to 2 GPUs (two separate launches) beside the traced step's exposed
    communication, as a table and one sentence. ``samples``: step times per (world size, strategy);
    ``overlap``: section 7.7's table, by ``estimates.COMM_LABELS``."""
    rows, below, above = [], [], []
    for st in estimates.STAGES:
        e, one, two = estimates.COMM_LABELS[st], samples[(1, st)], samples[(2, st)]
        (lo1, hi1), (lo2, hi2) = timing.median_interval(one, 0.975), timing.median_interval(two, 0.975)
        g = (statistics.median(two) - statistics.median(one)) * 1e3
        g_lo, g_hi = (lo2 - hi1) * 1e3, (hi2 - lo1) * 1e3
        exposed, span = overlap.loc[e, "exposed (ms)"], overlap.loc[e, "traced step, first to last kernel (ms)"]
        rows.append(f"| {SHORT[st]} | {g:+.1f} ({g_lo:+.1f} to {g_hi:+.1f}) | {exposed:.1f} | {span:.1f} |")
        (below if exposed < g_lo else above if exposed > g_hi else []).append(SHORT[st])
    table = ("| engine | step growth, 1 to 2 GPUs (ms; range of the 97.5% intervals) | exposed communication (ms) "
             "| traced step, first to last kernel (ms) |\n|---|---|---|---|\n" + "\n".join(rows))
    text = ("Read the growth and the exposed communication as orders of magnitude (the two cautions above; section "
            f"7.4's 10% margin is about {0.1 * statistics.median(samples[(1, 'ddp')]) * 1e3:.0f} ms here)")
    if below or above:
        text += ("; " + "; ".join(
            ([f"for {prose.listing(below)} the exposed communication lies below the whole range of the growth, so "
              "the rest of it is not waiting for the link"] if below else [])
            + ([f"for {prose.listing(above)} it lies above the whole range (a sharded engine's rank updates only its "
                "share of the parameters, or the traced step was slower than the timed ones)"] if above else []))
            + "; one traced step per engine cannot say more")
    return table + "\n\n" + text + "."


# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (Each engine's bytes per step)
if prof.on_gpu and 2 in world_sizes:
    per_engine = comm_bytes.groupby(level="engine", sort=False)[["formula S (MiB)", "profiler S (MiB)"]].sum()
    ratio = per_engine["profiler S (MiB)"] / per_engine["formula S (MiB)"]
    close = ratio.between(0.95, 1.05)
    lines = [f"- {e}: {per_engine.loc[e, 'profiler S (MiB)']:,.0f} MiB measured against {per_engine.loc[e, 'formula S (MiB)']:,.0f} "
             f"MiB by the formula ({ratio[e]:.2f} times); {overlap_table.loc[e, 'hidden share']} of its "
             f"{overlap_table.loc[e, 'communication (ms)']:.1f} ms of communication kernels ran beside compute kernels."
             for e in per_engine.index]
    note = ("The profiler's bytes agree with the formula within 5% for every engine." if close.all() else
            f"The profiler's bytes differ from the formula by more than 5% for {', '.join(ratio.index[~close])}: "
            "the table above shows in which collective (for FSDP's ZeRO-3 the root unit stays gathered from forward "
            "to backward, so it all-gathers less than the formula's second pass; DDP also broadcasts its buffers).")
    if ratio.isna().any():
        note = ("The trace carried no message sizes for some collectives (NaN above); their bytes could not be "
                "compared. " + note)
    note += "\n\n" + growth_attribution(step_samples, overlap_table)
    display(Markdown("Per step and rank 0, summed over collectives:\n\n" + "\n".join(lines) + "\n\n" + note))
else:
    print("skipped on CPU: no communication kernels to hold against the formula" if not prof.on_gpu
          else "skipped: no 2-GPU run to trace")


# %% [markdown]
# Reading the *calls* column: DDP all-reduces its gradients in buckets (one call per bucket) and, before
# each forward pass, broadcasts its buffers from rank 0 (a few bytes here, hence DDP's single small broadcast).
# `ZeroRedundancyOptimizer` broadcasts every parameter tensor after the step from the rank that updated it,
# one call per tensor, which is why ZeRO-1 shows one broadcast per parameter tensor plus DDP's. FSDP
# gathers and reduces one wrapped unit (here one transformer block, plus the root) per call, once for ZeRO-2
# and twice (forward and backward) for ZeRO-3's all-gathers.
#
# Reading the *S* columns: $S$ is the size of the messages, not the bytes a rank sends. With a ring on $N$ ranks
# a rank sends $2(N-1)/N \cdot S$ for an all-reduce and $(N-1)/N \cdot S$ for an all-gather or a reduce-scatter
# (section 7.7), so FSDP's ZeRO-2, with twice DDP's $S$ split over two such collectives, sends what DDP sends, and
# ZeRO-3, with three times DDP's $S$, sends 1.5 times as much, as the summary says. A broadcast sends its $S$ once
# from the rank that owns it, so ZeRO-1's broadcasts add half of DDP's traffic on two ranks.

# %%
shutil.rmtree(WORK, ignore_errors=True)  # the launched processes' results, no longer needed
freed = cleanup.free(globals(), "ref_model", "reference", "ranks", "r")  # section 7.1's single-process reference
assert not freed.still_alive, f"still held elsewhere: {freed.still_alive}"

# %% [markdown]
# ## Summary

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (Summary)
states_col, summary = f"model states ({unit_name})", {}
for stage in estimates.STAGES:
    row = {}
    for ws in (1, 2, 4):
        who = f"{ws} GPU{'s' if ws > 1 else ''}" if prof.on_gpu else f"{ws} process{'es' if ws > 1 else ''}"
        if ws in world_sizes:
            row[f"{who}: states"] = table.loc[(ws, stage), states_col]
        row[f"{who}: formula"] = estimates.zero_model_state_bytes(psi_run, ws, stage, **recipe)["total"] / unit
        if ws in world_sizes and prof.on_gpu:
            row[f"{who}: peak"] = table.loc[(ws, stage), "peak allocated (GiB)"]
    summary[estimates.STAGE_LABELS[stage]] = row
display(Markdown(
    f"Measured on the machine of the first output, per rank, for the "
    f"{f'{psi_run / 1e9:.2f}B' if psi_run >= 1e9 else f'{psi_run / 1e6:.1f}M'}-parameter GPT-NeoX in fp32 with AdamW (model "
    f"states counted tensor by tensor{'; peak from the allocator' if prof.on_gpu else ''}; formula with 4-byte "
    f"parameters and gradients and $K = 8$), all in {unit_name}; *states* includes the parameters gathered between "
    f"forward and backward:"))
pd.DataFrame(summary).T

# %% [markdown]
# - Data parallelism averages gradients with an all-reduce; the result equals one process's gradient on the
#   whole batch (checked, by hand and with DDP). A ring all-reduce sends $2(N-1)/N$ of the gradient bytes per
#   rank; PyTorch's ZeRO-1 adds a broadcast of the parameters (about 1.5 times DDP's traffic), FSDP's ZeRO-2
#   sends what DDP sends and ZeRO-3 1.5 times as much.
# - Tensor parallelism splits weight matrices by columns and rows; an MLP block or an attention layer needs
#   one all-reduce in each direction, inside every layer. Pipeline parallelism splits layers and pays with
#   idle time, $(p-1)/(m+p-1)$ with GPipe.
# - ZeRO removes data parallelism's copies in three stages; its formula predicts what PyTorch's engines hold
#   per rank, except where FSDP keeps shards and gathered parameters side by side.
# - `accelerate launch` with an FSDP config gives the same shards with an unchanged script.
# - The collectives' bus bandwidth grows with the message size towards the link's per-direction bandwidth;
#   a profiler trace of one rank shows each engine's bytes per step (against the formula) and how much of its
#   communication ran beside computation.
#
# ## Use it in your own script
#
# A script that trains with ZeRO-3 (FSDP2) or DDP, launched on every GPU of a machine with
# `torchrun --nproc_per_node=NUM_GPUS train.py`.
#
# ```python
# import os
#
# import torch
# import torch.distributed as dist
# from torch.distributed.fsdp import fully_shard  # FSDP2 (torch >= 2.6)
#
# dist.init_process_group("nccl")
# local_rank = int(os.environ["LOCAL_RANK"])
# torch.cuda.set_device(local_rank)
# model = build_model().cuda()
# for block in model.gpt_neox.layers:  # ZeRO-3: shard block by block, then the rest
#     fully_shard(block)
# fully_shard(model)
# # DDP instead: model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])
# optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
# ```
#
# ## Exercises
#
# Each exercise has a hint and an answer (or the range to expect) behind a click. Where an exercise asks for a
# number, the line under it checks yours without giving the answer away (it says right, close, or what to look at).
#
# 1. In `scripts/train_zero.py`, set `gradient_as_bucket_view=False` for DDP and rerun section 7.4. The
#    peak should grow by one copy of the gradients ($4\Psi$ bytes). How many GiB is that for the 1.3B model, and
#    does the peak grow by it? `from helpers import exercises; exercises.check("7.1", your_gib)`
#
#    <details><summary>Hint</summary>
#
#    With bucket views, the gradients live inside DDP's communication buckets; without them, DDP keeps a second copy.
#
#    </details>
#
#    <details><summary>Answer</summary>
#
#    Yes: the peak grows by about one copy of the fp32 gradients, $4\Psi$ bytes, about 5 GiB for the 1.33B model (compare the DDP rows of the table above).
#
#    </details>
#
# 2. Add `--bf16` to `train_args` (bf16 autocast, fp32 weights). The model states do not change; do the peaks?
#    Chapter 1 found that autocast keeps a 16-bit copy of every weight until backward: how many GiB is that copy
#    for the 1.3B model, and how does it behave under ZeRO-3, which gathers and frees weights layer by layer?
#    `from helpers import exercises; exercises.check("7.2", your_gib)`
#
#    <details><summary>Hint</summary>
#
#    Chapter 1 counted those copies with `SavedTensorMeter`: they are tensors *saved for backward* (each linear layer keeps the 16-bit weight it multiplied with), not only entries of autocast's cache. ZeRO-3 gathers each layer's fp32 weights and frees them after use; ask whether it can free a copy that autocast made of them.
#
#    </details>
#
#    <details><summary>Answer</summary>
#
#    The copy is $2\Psi$ bytes, 2.48 GiB for the 1.33B model, and it lives from the forward pass to the backward pass. Whether a peak moves depends on where the peak is. DDP's peak here is the optimizer step (19.85 GiB of states plus one fp32 copy of the weights in the multi-tensor step's temporaries, about 24.8 GiB, against 24.88 measured), when the copies are already gone: expect no change there, as chapter 5 found for freed gradients (section 5.3). The sharded engines peak nearer the turn from forward to backward, where the copies add to what is held. Under ZeRO-3 they are whole, not shards: each linear layer saves the bf16 copy of its *gathered* weight for its backward pass, and FSDP frees only its own gathered fp32 parameters, not autocast's copies, so every rank can hold up to all $2\Psi$ of them, as much as its whole parameter shard on two GPUs. FSDP's own mixed-precision policy (`MixedPrecisionPolicy(param_dtype=torch.bfloat16)`) avoids it: it gathers the weights in bf16, no extra copy is made, and the gathered weights are freed after each layer and gathered again for its backward.
#
#    </details>
#
# 3. In the pipeline schedule, make a backward pass as long as a forward pass (`t_b=1.0`). Does the bubble
#    fraction change? Why not? What is it for $p = 4$ and $m = 8$?
#    `from helpers import exercises; exercises.check("7.3", your_fraction)` (other sizes: add `p=..., m=...`)
#
#    <details><summary>Hint</summary>
#
#    The bubble is the fill and drain time of the pipeline, in units of one micro-batch's time through a stage.
#
#    </details>
#
#    <details><summary>Answer</summary>
#
#    No: with GPipe both the forward and the backward phase fill and drain the pipeline, and longer backward passes stretch the busy and the idle time alike; the fraction stays $(p-1)/(m+p-1)$.
#
#    </details>
#
# 4. With the formula: how many GPUs does ZeRO-3 need to hold the 7.5B model's states in a T4's 14.75 GiB?
#    And ZeRO-2? `from helpers import exercises; exercises.check("7.4a", your_zero3_gpus)`, then
#    `exercises.check("7.4b", your_zero2_gpus)`.
#
#    <details><summary>Hint</summary>
#
#    Mixed-precision Adam: ZeRO-3 holds $(2 + 2 + K)\Psi / N_d$ bytes per GPU, ZeRO-2 holds $2\Psi + (2 + K)\Psi / N_d$, with $K = 12$ and $\Psi = 7.5 \times 10^9$; 14.75 GiB is about $15.8 \times 10^9$ bytes.
#
#    </details>
#
#    <details><summary>Answer</summary>
#
#    ZeRO-3: $120 \times 10^9 / N_d \le 15.8 \times 10^9$, so 8 GPUs (with nothing left for activations; more in practice). ZeRO-2: the unsharded 16-bit weights alone take $15 \times 10^9$ bytes, so it needs about 126 GPUs: not a realistic option.
#
#    </details>
#
# ## References
#
# - [Rajbhandari et al. (2020)](https://gpu-efficient-training.github.io/book/book/references.html): ZeRO's three stages, the memory formula and figure 1, the
#   communication volumes (section 7).
# - [Shoeybi et al. (2019)](https://gpu-efficient-training.github.io/book/book/references.html): tensor parallelism of the MLP block and of attention.
# - [Zhao et al. (2023)](https://gpu-efficient-training.github.io/book/book/references.html): PyTorch FSDP.
# - [Huang et al. (2019)](https://gpu-efficient-training.github.io/book/book/references.html) and [Narayanan et al. (2021)](https://gpu-efficient-training.github.io/book/book/references.html): pipeline schedules and their bubble.
# - [Heo (2024)](https://gpu-efficient-training.github.io/book/book/references.html), chapter 5: data, pipeline and tensor parallelism and ZeRO, in pictures.
# - [NVIDIA (2024)](https://gpu-efficient-training.github.io/book/book/references.html), nccl-tests' doc/PERFORMANCE.md: algorithm and bus bandwidth.
# - [NVIDIA (2024)](https://gpu-efficient-training.github.io/book/book/references.html), H200 datasheet: NVLink bandwidth, 900 GB/s in both directions together.
# - Hugging Face accelerate documentation: the `accelerate launch` options and the config file's keys
#   (`mixed_precision`, `fsdp_config`).

# %% [markdown]
# ## Memory back at the baseline
#
# The launched processes gave their GPUs back when they exited; this notebook's own process held only section 7.1's
# single-process reference model, freed above, and the cuBLAS workspaces its matrix products left (one per handle and
# stream, the autograd engine's thread included; chapter 4 explains them). We release those too, then check that
# the chapter ends where it began:

# %%
if prof.on_gpu:  # releases the workspaces, then asserts that allocated memory is back at the start
    display(pd.Series(cleanup.back_at_baseline(chapter_baseline_mib)).to_frame("value"))
else:
    print("skipped on CPU: no GPU memory to check")
