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
# # 4. Gradient checkpointing: trading compute for memory
#
# Chapter 3 showed that [activations](https://gpu-efficient-training.github.io/book/book/glossary.html#activations) are the part of training memory that grows with the batch, and that
# [gradient accumulation](https://gpu-efficient-training.github.io/book/book/glossary.html#gradient-accumulation) keeps them small by keeping the batch small. Gradient checkpointing attacks them
# directly: the forward pass keeps only a few of the tensors the backward pass will need and recomputes the
# others when they are needed. This chapter builds the idea from scratch on a chain of layers, counts what
# each strategy stores and recomputes, checks PyTorch's implementation against plain autograd, and then
# measures what `gradient_checkpointing_enable()` does to bert-large and to the 1.3B GPT-NeoX: how much
# memory it saves, what it costs in time, and whether the LLM book's batch that did not fit a T4 fits now.
#
# **What you will learn**
#
# - three ways to get gradients through a chain of $N$ layers (store everything, store nothing and recompute
#   from the start, store a checkpoint every $k$ layers), with their stored bytes and recomputations counted,
#   and why $k = \sqrt{N}$ is the sweet spot of [Chen et al. (2016)](https://gpu-efficient-training.github.io/book/book/references.html);
# - what `torch.utils.checkpoint` does, and a check that it gives the same gradients as plain autograd;
# - the measured memory and time of checkpointing in transformers models, against the "one extra forward
#   pass" that theory predicts;
# - two refinements beyond the sources: checkpointing only part of a block (after
#   [Korthikanti et al. (2022)](https://gpu-efficient-training.github.io/book/book/references.html)), and moving saved activations to the CPU instead of recomputing them.
#
# **Prerequisites:** chapter 1 (activations, `SavedTensorMeter`, the emulated T4) and chapter 3 (the batch
# sweep, `helpers.batching`). The [setup page](https://gpu-efficient-training.github.io/book/book/setup.html) explains the run profiles. Sentences that quote
# numbers are written by the notebook from its own run.

# %%
import sys

if "google.colab" in sys.modules:  # Colab only. pip adds what Colab lacks (bitsandbytes, the book's helpers)
    # and upgrades transformers to the 5.x the book needs: nothing has imported it yet in this kernel, so no
    # restart is needed. Colab's torch already meets the book's floor and is kept (see the setup page).
    # %pip install -q --no-warn-conflicts "gpu-efficient-training @ git+https://github.com/gpu-efficient-training/book"

from helpers import env

env.quiet()  # warnings without file paths, no progress bars: outputs that read the same everywhere

import functools
import math
import weakref
from contextlib import nullcontext

import matplotlib.pyplot as plt
import matplotlib.ticker as mticker
import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from helpers import accounting, batching, cleanup, gpus, measure, run_profile, steps
from helpers.measure import GIB, MIB

prof = env.start()  # plot style, number format, run profile; the table below names hardware and versions

# %% [markdown]
# As in chapter 3, we measure this process's [CUDA context](https://gpu-efficient-training.github.io/book/book/glossary.html#cuda-context) first, so that section 4.3 can emulate a T4 (14.75
# GiB minus the context) on a larger card, and note the allocated memory after this warm-up: the chapter's
# baseline, which the last cell checks. We also ask what this GPU can do: fused attention kernels and bf16
# [tensor cores](https://gpu-efficient-training.github.io/book/book/glossary.html#tensor-cores) need compute capability 8.0 or newer (`gpus.capability()`), and section 4.4 picks its
# 16-bit type with `gpus.amp_dtype()` (bf16 there, fp16 on older GPUs such as the T4). Times come from
# chapter 8's `timing.time_it` (with the [GPU-busy](https://gpu-efficient-training.github.io/book/book/glossary.html#gpu-busy) fraction) and comparisons from `timing.interleaved`,
# as in chapter 3.

# %%
from IPython.display import Markdown, display

from helpers import flops, prose, timing

cap = gpus.capability()
t4_budget_gib, chapter_baseline_mib = None, 0.0
if run_profile.cuda_or_skip("emulating a T4 needs a GPU"):
    budget, chapter_baseline_mib = measure.t4_start()  # the context with cuBLAS loaded; the chapter's baseline
    t4_budget_gib = budget.budget_gib
    print(f"emulated T4: {budget.describe()}")
    print(f"{cap.name}: compute capability {cap.major}.{cap.minor}; FlashAttention and bf16 tensor cores: "
          f"{'yes' if cap.flash_attention else 'no'}; 16-bit type for section 4.4: {gpus.amp_dtype()}")
    print(f"allocated at the start (the chapter's baseline): {chapter_baseline_mib:,.1f} MiB")


# %% [markdown]
# ## 4.1 Three strategies, as code
#
# The LLM book draws the problem as a chain of nodes: the forward pass runs left to right, the backward pass
# right to left, and the backward step at node $i$ needs the value node $i$ had in the forward pass. It then
# compares three strategies: (a) keep every node's value until the backward pass has used it; (b) keep
# nothing but the input and, whenever the backward pass needs a value, recompute it from the start; (c) keep a
# few nodes as *checkpoints* and recompute from the nearest one. We write all three for a chain of $N$ layers
# (each a linear layer and a tanh), and count two things:
#
# - **stored bytes**: everything kept for the backward pass, at its peak. The tensors autograd saves pass
#   through `torch.autograd.graph.saved_tensors_hooks`; our pack hook wraps each in a small handle and counts
#   its bytes until autograd lets go of the handle (after the backward step that used it), once per storage as
#   in chapter 1. Checkpoints that our own code keeps are counted through the same handles.
# - **forward computations**: calls of a layer's forward, counted by a forward pre-hook.

# %%
class _Handle:
    """What the pack hook returns instead of the tensor: when autograd drops it, the bytes are released."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


class LiveBytes:
    """Bytes kept for backward right now (``now``) and at most (``peak``), each storage counted once."""

    def __init__(self, params):
        self.skip = {p.untyped_storage().data_ptr() for p in params}  # weights are not activations
        self.users = {}  # storage -> [number of live handles, bytes]
        self.now = self.peak = 0

    def hold(self, tensor):
        handle = _Handle(tensor)
        key = tensor.untyped_storage().data_ptr()
        if key not in self.skip:
            entry = self.users.setdefault(key, [0, tensor.untyped_storage().nbytes()])
            if entry[0] == 0:
                self.now += entry[1]
                self.peak = max(self.peak, self.now)
            entry[0] += 1
            weakref.finalize(handle, self._release, key)
        return handle

    def _release(self, key):
        entry = self.users[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.now -= entry[1]
            del self.users[key]

    def saved_tensors(self):
        """Context manager: count what autograd saves for backward while it is active."""
        return torch.autograd.graph.saved_tensors_hooks(lambda t: self.hold(t.detach()), lambda h: h.tensor)


# %% [markdown]
# The chain, and the three strategies. Each computes the gradients of the same loss for every layer's
# weights; only what is kept, and what is recomputed, differs.

# %%
n_layers, width, chain_batch = prof.pick(tiny=16, full=64), prof.pick(tiny=64, full=1024), prof.pick(tiny=32, full=256)
torch.manual_seed(0)
chain = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(n_layers)]).to(prof.device)
chain_input = torch.randn(chain_batch, width, device=prof.device)
forward_calls = [0]
for layer in chain:
    layer.register_forward_pre_hook(lambda module, args: forward_calls.__setitem__(0, forward_calls[0] + 1))


def loss_of(output):
    return output.square().mean()


def store_everything(meter):
    """(a) Plain autograd: every layer's output is saved for backward."""
    with meter.saved_tensors():
        h = chain_input
        for layer in chain:
            h = layer(h)
        loss = loss_of(h)
    loss.backward()


def recompute_from_start(meter):
    """(b) Keep only the input; for layer i, recompute layers 0..i-1 without saving, then backprop layer i."""
    grad = None
    for i in reversed(range(n_layers)):
        with torch.no_grad():
            h = chain_input
            for layer in chain[:i]:
                h = layer(h)
        h_in = h.detach().requires_grad_()
        with meter.saved_tensors():
            out = chain[i](h_in)
            if i == n_layers - 1:
                out = loss_of(out)
        out.backward(grad)  # grad is None for the loss
        grad = h_in.grad


def checkpoint_every(meter, k):
    """(c) Keep the input of every k-th layer; in backward, recompute one segment of k layers at a time."""
    checkpoints = []
    h = chain_input
    with torch.no_grad():
        for start in range(0, n_layers, k):
            checkpoints.append(meter.hold(h))  # a checkpoint: kept until its segment's backward
            for layer in chain[start:start + k]:
                h = layer(h)
    out = h.requires_grad_()
    with meter.saved_tensors():
        loss = loss_of(out)
    loss.backward()
    grad = out.grad
    del loss, out, h
    for start in reversed(range(0, n_layers, k)):
        h_in = checkpoints.pop().tensor.detach().requires_grad_()  # the handle goes: the checkpoint is used up
        with meter.saved_tensors():
            h = h_in
            for layer in chain[start:start + k]:
                h = layer(h)
        h.backward(grad)
        grad = h_in.grad
        del h, h_in


# %% [markdown]
# We run each strategy from zero gradients, and for (c) every $k$ that divides $N$. The unit of memory is one
# layer's output, $b \times d$ fp32 numbers. The assertions check the two things that must hold: every strategy
# computes the same gradients as plain autograd, and the counted bytes of strategy (a) equal what chapter 1's
# `SavedTensorMeter` counts for the same forward pass.

# %%
def run(strategy, *args):
    chain.zero_grad(set_to_none=True)
    forward_calls[0] = 0
    meter = LiveBytes(chain.parameters())
    strategy(meter, *args)
    assert meter.now == 0, "something saved for backward was never released"
    grads = [p.grad.detach().clone() for p in chain.parameters()]
    return meter.peak, forward_calls[0], grads


unit = chain_batch * width * 4
peak_a, calls_a, grads_a = run(store_everything)
with accounting.SavedTensorMeter(chain) as saved:
    loss_of(chain(chain_input))
assert peak_a == saved.total_bytes, "the live count disagrees with SavedTensorMeter"

strategies = {"(a) store everything": (peak_a, calls_a, grads_a),
              "(b) recompute from the start": run(recompute_from_start)}
divisors = [k for k in range(1, n_layers + 1) if n_layers % k == 0]
for k in divisors:
    strategies[f"(c) checkpoint every {k}"] = run(checkpoint_every, k)
rows = {}
for label, (peak, calls, grads) in strategies.items():
    for g, g_ref in zip(grads, grads_a):
        torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-5 * g_ref.abs().max().item())  # to fp32 rounding
    rows[label] = {"stored (layer outputs)": peak / unit, "stored (MiB)": peak / MIB,
                   "layer forwards": calls, "extra forwards (x N)": calls / n_layers - 1}
three = pd.DataFrame(rows)
three.T

# %% [markdown]
# (a) stores $N + 1$ layer outputs (the input and each layer's output) and computes each layer once. (b) stores
# two at any time but computes $N(N+1)/2$ layer forwards: the extra work grows with the square of the depth. (c)
# stores its $N/k$ checkpoints plus the $k$ outputs of the one segment being recomputed, $N/k + k$ in all, for
# exactly one extra forward pass whatever $k$ is. That sum is smallest at $k = \sqrt{N}$, where it is $2\sqrt{N}$:

# %%
ks = np.array(divisors)
check = pd.DataFrame({"k": ks, "measured": [three[f"(c) checkpoint every {k}"]["stored (layer outputs)"] for k in ks],
                      "N/k + k": n_layers / ks + ks}).set_index("k")
assert (check["measured"] == check["N/k + k"]).all()
check.astype(int)

# %%
fig, (ax_mem, ax_cost) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 2]})
ax_mem.plot(ks, check["measured"], "o", label="(c) measured")
k_fine = np.linspace(1, n_layers, 200)
ax_mem.plot(k_fine, n_layers / k_fine + k_fine, "k--", linewidth=1, label="N/k + k")
ax_mem.axhline(three.loc["stored (layer outputs)", "(a) store everything"], color="C3", label="(a) store everything")
ax_mem.axhline(three.loc["stored (layer outputs)", "(b) recompute from the start"], color="C2", label="(b) recompute from the start")
ax_mem.axvline(math.sqrt(n_layers), color="grey", linestyle=":", label="k = √N")
ax_mem.set_xscale("log", base=2)
ax_mem.set_xlabel("checkpoint every k layers")
ax_mem.set_ylabel(f"peak stored (layer outputs of {unit / MIB:g} MiB)" if unit >= MIB else "peak stored (layer outputs)")
ax_mem.legend(fontsize=8)
cost = three.loc["layer forwards", ["(a) store everything", "(c) checkpoint every 1", "(b) recompute from the start"]]
bars = ax_cost.bar(["(a)", "(c), any k", "(b)"], cost.to_numpy(), color=["C3", "C0", "C2"])
ax_cost.bar_label(bars, fmt="%d")
ax_cost.set_yscale("log")
ax_cost.set_ylim(1, cost.max() * 3)
ax_cost.yaxis.set_major_formatter(mticker.FuncFormatter(lambda v, _: f"{v:g}"))
ax_cost.yaxis.set_minor_formatter(mticker.NullFormatter())
ax_cost.set_ylabel("layer forward computations per step")
fig.suptitle(f"A chain of N = {n_layers} layers: a checkpoint every √N layers stores 2√N outputs for one extra forward pass")
fig.tight_layout()

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (4.1 Three strategies, as code)
display(Markdown(
    f"With $N$ = {n_layers} layers, storing everything keeps "
    f"{int(three.loc['stored (layer outputs)', '(a) store everything'])} layer outputs; a checkpoint every "
    f"{math.isqrt(n_layers)} layers keeps {int(check['measured'].min())} at most (at $k$ = "
    f"{int(check['measured'].idxmin())}), and pays for it with one extra forward pass; recomputing from the start "
    f"keeps {int(three.loc['stored (layer outputs)', '(b) recompute from the start'])} but needs "
    f"{int(three.loc['layer forwards', '(b) recompute from the start']):,} layer forwards instead of {n_layers}."))

# %% [markdown]
# This is the result of [Chen et al. (2016)](https://gpu-efficient-training.github.io/book/book/references.html): $O(\sqrt{N})$ memory for one extra forward pass (recursing on the segments brings memory down to
# $O(\log N)$ at more recomputation). In practice the segments are not chosen by $\sqrt{N}$: frameworks
# checkpoint at the boundary of every transformer layer, so a model of $L$ layers keeps $L$ layer inputs
# plus the full activations of the one layer being recomputed. That is close to the optimum: in the units of the
# chain, a transformer layer is a segment of about 17 (chapter 1: 34 or more $sbh$ bytes inside a layer, 2 at its
# input), so 24 layers make $N \approx 400$ and $\sqrt{N} \approx 20$, about one layer.

# %%
freed = cleanup.free(globals(), "chain", "chain_input", "strategies", "grads_a", "grads", "g", "g_ref", "layer",
                     "saved")


# %% [markdown]
# ## 4.2 `torch.utils.checkpoint` on one transformer block
#
# PyTorch packages strategy (c): `checkpoint(fn, *inputs, use_reentrant=False)` runs `fn` without keeping
# what it would save for backward, keeps only its inputs, and when the backward pass reaches it, runs `fn`
# again to rebuild those tensors. (The non-reentrant version, recommended by PyTorch, works through the same
# saved-tensor hooks we used above; the older reentrant one is a custom autograd function with restrictions.)
# Two details make the recomputation exact: it restores the random-number generator's state, so dropout draws
# the same masks again (`preserve_rng_state=True`, the default), and it checks that the recomputed tensors have
# the shapes and dtypes of the first run.
#
# Our test subject is a pre-LayerNorm transformer block with bert-large's sizes (hidden 1024, 16 heads, a 4x MLP,
# dropout 0.1), written so that either half, or the whole block, can be recomputed. Section 4.4 stacks it.

# %%
class Block(nn.Module):
    """A pre-LayerNorm transformer block; ``recompute`` picks what to checkpoint: nothing, attention, mlp, block."""

    def __init__(self, hidden, heads, dropout=0.1):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)
        self.drop = nn.Dropout(dropout)
        self.recompute, self.preserve_rng_state = "nothing", True

    def attention(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v)  # a fused kernel stores no s x s matrix; the math fallback does
        return self.drop(self.proj(y.transpose(1, 2).reshape(b, s, h)))

    def mlp(self, x):
        return self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))

    def layer(self, x):
        x = x + self._maybe_checkpoint(self.attention, x, "attention")
        return x + self._maybe_checkpoint(self.mlp, x, "mlp")

    def forward(self, x):
        return self._maybe_checkpoint(self.layer, x, "block")

    def _maybe_checkpoint(self, fn, x, part):
        if self.recompute == part:
            return checkpoint(fn, x, use_reentrant=False, preserve_rng_state=self.preserve_rng_state)
        return fn(x)


# %% [markdown]
# One block in fp32, batch 4 of 512 tokens. For each setting we seed the generator, run forward and backward, and
# keep the gradients of the weights and of the input; `SavedTensorMeter` counts what the forward pass kept, and
# on a GPU the allocator's peak during forward and backward (minus what was allocated before) adds what the
# recomputation needs while it runs. The assertion: checkpointing the whole block gives the gradients of plain
# autograd to within $10^{-5}$ of the largest gradient (on a CPU they are bit for bit equal; on a GPU some fused
# attention kernels accumulate in a nondeterministic order). The control without `preserve_rng_state` shows why
# the generator's state matters.

# %%
hidden, heads = prof.pick(tiny=128, full=1024), prof.pick(tiny=4, full=16)
block_batch, block_seq = 4, prof.pick(tiny=64, full=512)
torch.manual_seed(0)
block = Block(hidden, heads).to(prof.device).train()
block_x = torch.randn(block_batch, block_seq, hidden, device=prof.device, requires_grad=True)


def max_rel_diff(grads, reference):
    """max over tensors of max|grads - reference| / max|reference|."""
    return max(((g - r).abs().max() / r.abs().max()).item() for g, r in zip(grads, reference))


def block_pass(recompute, preserve_rng_state=True):
    block.recompute, block.preserve_rng_state = recompute, preserve_rng_state
    block.zero_grad(set_to_none=True)
    block_x.grad = None
    torch.manual_seed(1)  # the same dropout masks in every run
    measure.synchronize(prof.device)
    measure.reset_peak(prof.device)
    before = torch.cuda.memory_allocated() if prof.on_gpu else 0
    with accounting.SavedTensorMeter(block) as saved:
        out = block(block_x)
    out.square().mean().backward()
    peak = (torch.cuda.max_memory_allocated() - before) / MIB if prof.on_gpu else float("nan")
    grads = [p.grad.detach().clone() for p in block.parameters()] + [block_x.grad.detach().clone()]
    return {"saved by forward (MiB)": saved.total_bytes / MIB, "peak above start (MiB)": peak}, grads


plain_row, plain_grads = block_pass("nothing")
ckpt_row, ckpt_grads = block_pass("block")
norng_row, norng_grads = block_pass("block", preserve_rng_state=False)
block_check = pd.DataFrame({"no checkpoint": plain_row, "checkpointed block": ckpt_row,
                            "checkpointed, RNG not restored": norng_row}).T
block_check["gradients: max rel. difference"] = [0.0, max_rel_diff(ckpt_grads, plain_grads),
                                                  max_rel_diff(norng_grads, plain_grads)]
assert block_check.iloc[1, 2] < 1e-5, "checkpointing changed the gradients"
assert block_check.iloc[2, 2] > 1e-2, "without the RNG state, dropout should draw new masks"
block_check.assign(**{"gradients: max rel. difference": block_check.iloc[:, 2].map("{:.1e}".format)})

# %% [markdown]
# Whether the attention stored its $s \times s$ matrix depends on the kernel [SDPA](https://gpu-efficient-training.github.io/book/book/glossary.html#sdpa) picked. The flash and
# memory-efficient kernels never store it (they rebuild it block by block in the backward pass); the math
# fallback, which SDPA uses when neither supports the inputs (for example bf16 below compute capability 8.0), stores
# it like eager attention. `fused_sdpa_runs` asks SDPA to run with the fused kernels only, which fails if none fits.

# %%
def fused_sdpa_runs(dtype, seq=None):
    """Whether SDPA has a fused kernel (flash or memory-efficient) for this chapter's attention shapes in ``dtype``."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, heads, seq or block_seq, hidden // heads, device=prof.device, dtype=dtype)
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
            F.scaled_dot_product_attention(q, q, q)
        return True
    except RuntimeError:  # "No available kernel": SDPA would fall back to the math kernel
        return False


block_fused = fused_sdpa_runs(block_x.dtype)
scores_mib = block_batch * heads * block_seq**2 * block_x.element_size() / MIB  # one s x s matrix per head
print(f"fused SDPA kernel for {block_x.dtype}: {block_fused}; one s x s matrix for the block would take {scores_mib:.0f} MiB")

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (4.2 torch.utils.checkpoint on one transformer block)
input_mib = block_x.numel() * block_x.element_size() / MIB
text = (f"Without checkpointing the block keeps {block_check.iloc[0, 0]:.0f} MiB for backward"
        + (f" (a fused SDPA kernel ran, so none of it is the {scores_mib:.0f} MiB $s \\times s$ matrix)" if block_fused
           else f", the {scores_mib:.0f} MiB $s \\times s$ matrix of the math fallback included")
        + f"; checkpointed, it keeps {block_check.iloc[1, 0]:.0f} MiB, "
        + (f"its input ({input_mib:.0f} MiB), which `checkpoint` saves so that it can run the block again. "
           if abs(block_check.iloc[1, 0] - input_mib) < 1 else f"against its input's {input_mib:.0f} MiB. ")
        + f"The gradients agree to {block_check.iloc[1, 2]:.1e}. Without restoring the generator's state they are off "
        f"by {block_check.iloc[2, 2]:.2f}: dropout drew other masks in the recomputation, so the backward pass "
        f"differentiated a different function than the forward pass computed, silently.")
if prof.on_gpu:
    text += (f"\n\nOn the GPU the peak above the starting point is {block_check.iloc[0, 1]:.0f} MiB without "
             f"checkpointing and {block_check.iloc[1, 1]:.0f} MiB with it: for a single block, checkpointing moves "
             f"the activations from the forward pass to the backward pass rather than removing them, because the "
             f"recomputation rebuilds all of them before the block's backward can run.")
display(Markdown(text))

# %% [markdown]
# In a stack of $L$ blocks only one block is rebuilt at a time, so the peak
# holds one block's activations instead of $L$; that is where the savings of section 4.3 come from.

# %%
freed = cleanup.free(globals(), "block", "block_x", "plain_grads", "ckpt_grads", "norng_grads")

# %% [markdown]
# ## 4.3 In practice: `gradient_checkpointing_enable()`
#
# Transformers models implement the layer-boundary version: `model.gradient_checkpointing_enable()` wraps every
# transformer layer's call in `torch.utils.checkpoint`, so each layer keeps only its input. (Newer transformers
# releases, 5.23 for one, also call it `activation_checkpointing_enable`; older ones know only the first name. The
# function below uses whichever the installed version has, with the non-reentrant checkpoint, and the cell prints
# which.) We measure the two models of
# chapter 3 in the sources' setups: bert-large in fp32 at 512 tokens, and the 1.3B GPT-NeoX with fp16 weights,
# eager attention and 256 tokens: bert-large at batches 8 to 32, the 1.3B model at 4 to 32. The 1.3B model's small
# batches are host-bound on purpose (chapter 3's picture of a host-bound step); bert-large's batch 4 is left out
# because its checkpointed step sits at the edge between host-bound and [GPU-bound](https://gpu-efficient-training.github.io/book/book/glossary.html#gpu-bound), where the host's speed, not
# checkpointing, would decide the cost. For each batch size, with and without checkpointing: the [peak allocated](https://gpu-efficient-training.github.io/book/book/glossary.html#peak-allocated-memory)
# memory of a training step and its time, with `time_it` (ten steps after a warm-up step, their spread, the GPU
# kernel time and the GPU-busy fraction from two profiled steps). What checkpointing costs is then measured with
# `timing.interleaved`: the plain and the checkpointed step in alternating rounds on the same model and batch, the
# switch flipped (untimed) before each.
#
# To compare with theory we also time the forward pass alone. Checkpointing recomputes the transformer layers,
# not the embeddings, the output head or the loss, so for the 1.3B model we also time the forward pass of its
# layers without the head and the loss (`model.base_model`). The prediction is the GPU kernel time of the layers'
# forward pass, as a share of the plain step's time: what recomputing them adds where the GPU is the limit.

# %%
import transformers

SETUPS = steps.two_models(prof)  # bert-large at 512 tokens in fp32, the 1.3B GPT-NeoX at 256 in fp16
build = functools.partial(steps.build, SETUPS)  # build(name, seed=0): the model and a plain AdamW
make_batch = functools.partial(steps.batch_of, SETUPS, device=prof.device)  # make_batch(name, batch_size, seed=0)


RENAMED = hasattr(transformers.PreTrainedModel, "activation_checkpointing_enable")
print(f"transformers {transformers.__version__}: "
      + ("activation_checkpointing_enable (gradient_checkpointing_enable kept as the old name)" if RENAMED
         else "gradient_checkpointing_enable"))


def set_checkpointing(model, on):
    """Turn the model's gradient (activation) checkpointing on or off, non-reentrant."""
    if on:
        (model.activation_checkpointing_enable if RENAMED else model.gradient_checkpointing_enable)({"use_reentrant": False})
    else:
        (model.activation_checkpointing_disable if RENAMED else model.gradient_checkpointing_disable)()


def kernel_s(timed):
    """GPU kernel time per call (s); the wall time on a CPU, where there is no GPU."""
    return timed.kernel_s if timed.kernel_s is not None else timed.median_s


def measure_step(name, model, optimizer, batch_size, time_forward, key):
    batch = make_batch(name, batch_size)
    try:  # warm-up step (AdamW's states on first use), counting what the forward pass keeps
        with accounting.SavedTensorMeter(model) as saved:
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
    finally:
        optimizer.zero_grad(set_to_none=True)
    del loss
    measure.reset_peak(prof.device)
    step = timing.time_it(lambda: steps.train_step(model, optimizer, batch), device=prof.device, warmup=0, repeat=10,
                          profile_steps=2)
    gc_timed[key] = step
    row = {"step time (s)": step.median_s, "step IQR (s)": step.wall.iqr, "step GPU kernel time (s)": kernel_s(step),
           "GPU busy": step.gpu_busy if step.gpu_busy is not None else float("nan"), "verdict": step.verdict,
           "samples/s": batch_size / step.median_s, "saved for backward (GiB)": saved.total_bytes / GIB,
           "peak allocated (GiB)": torch.cuda.max_memory_allocated() / GIB if prof.on_gpu else float("nan")}
    if time_forward:
        fwd = timing.time_it(lambda: model(**batch).loss, device=prof.device, warmup=1, repeat=10, profile_steps=1)
        row["forward time (s)"], row["forward GPU kernel time (s)"] = fwd.median_s, kernel_s(fwd)
        row["layer forward GPU kernel time (s)"] = kernel_s(fwd)  # bert's classifier head: one tiny matmul
        if SETUPS[name]["head"] == "causal-lm":
            body = timing.time_it(lambda: model.base_model(input_ids=batch["input_ids"]).last_hidden_state,
                                  device=prof.device, warmup=1, repeat=10, profile_steps=1)
            row["layer forward GPU kernel time (s)"] = kernel_s(body)
    return row


# bert-large from batch 8: at batch 4 its checkpointed step sits where the host starts to matter (two H100 runs kept
# the GPU busy 81% and 98% of it), so its cost there would be the host's; the 1.3B model's small batches show that
# host-bound case on purpose.
batch_sizes = {name: prof.pick(tiny=[2, 4], full=[4, 8, 16, 32] if SETUPS[name]["head"] == "causal-lm" else [8, 16, 32])
               for name in SETUPS}
gc_rows, gc_timed, gc_cmp, model_shape = [], {}, {}, {}
for name in SETUPS:
    model, optimizer = build(name)
    head = model.get_output_embeddings()
    model_shape[name] = {"layers": model.config.num_hidden_layers, "hidden": model.config.hidden_size,
                         "vocab": model.config.vocab_size,
                         "forward FLOPs per token": flops.flops_per_token(
                             flops.matmul_params(model), model.config.num_hidden_layers, model.config.hidden_size,
                             SETUPS[name]["seq_len"], training=False),
                         "head FLOPs per token": 2 * head.weight.numel() if head is not None else 0}
    del head
    for on in (False, True):
        set_checkpointing(model, on)
        for bs in batch_sizes[name]:
            attempt = batching.try_batch(
                lambda b, n=name, m=model, o=optimizer, t=not on: measure_step(n, m, o, b, t, (n, b, t)), bs)
            gc_rows.append({"model": name, "checkpointing": on, "batch": bs,
                            **(attempt.value if attempt.fits else {"result": f"out of memory ({attempt.error})"})})
    for bs in batch_sizes[name]:  # keys: (model, batch, forward timed), and the forward was timed without checkpointing
        if (name, bs, True) in gc_timed and (name, bs, False) in gc_timed:
            batch = make_batch(name, bs)
            gc_cmp[(name, bs)] = timing.interleaved(
                lambda m=model, o=optimizer, b=batch: steps.train_step(m, o, b),
                lambda m=model, o=optimizer, b=batch: steps.train_step(m, o, b), device=prof.device,
                names=("plain", "checkpointed"), setup_a=lambda m=model: set_checkpointing(m, False),
                setup_b=lambda m=model: set_checkpointing(m, True), rounds=20, warmup=1, profile_steps=1)
    freed = cleanup.free(globals(), "model", "optimizer", "attempt", "batch")
gc_table = pd.DataFrame(gc_rows).set_index(["model", "batch", "checkpointing"]).sort_index()
shapes = pd.DataFrame(model_shape).T
shapes["head share of forward FLOPs"] = shapes["head FLOPs per token"] / shapes["forward FLOPs per token"]
gc_table.drop(columns="verdict", errors="ignore")  # a row's regime: its GPU-busy column (the text names the clear ones)

# %%
def overhead_columns(summary, cmps, tolerance=5.0):
    """Add the interleaved overhead (median and 95% interval, %), its verdict and the agreement with the prediction."""
    def col(f):
        return [f(cmps[k]) if k in cmps else np.nan for k in summary.index]

    summary["time overhead (%)"] = col(lambda c: 100 * (1 / c.speedup - 1))
    summary["overhead 95% low (%)"] = col(lambda c: 100 * (1 / c.hi - 1))
    summary["overhead 95% high (%)"] = col(lambda c: 100 * (1 / c.lo - 1))
    summary["checkpointed vs plain"] = [cmps[k].verdict if k in cmps else "—" for k in summary.index]
    if prof.on_gpu:  # the GPU-busy fractions measured in the same interleaved run
        summary["GPU busy, plain"] = col(lambda c: c.a.gpu_busy)
        summary["GPU busy, checkpointed"] = col(lambda c: c.b.gpu_busy)
        summary["verdict, checkpointed"] = [cmps[k].b.verdict if k in cmps else "—" for k in summary.index]
    pred = summary["predicted: layer forward / step (%)"]
    summary["measured vs predicted"] = np.where(
        summary["overhead 95% low (%)"] - tolerance > pred, "costs more",
        np.where(summary["overhead 95% high (%)"] + tolerance < pred, "costs less", "agrees"))
    summary.loc[summary["time overhead (%)"].isna() | pred.isna(), "measured vs predicted"] = "—"
    return summary


# %% [markdown]
# Every configuration ran on the whole card (through `batching.try_batch`, so that on a smaller GPU the ones
# that do not fit become rows that say so). Which would fit the emulated T4, and what did checkpointing save and
# cost? The time overhead is the interleaved comparison's: the median of the per-round ratios, checkpointed over
# plain, with its 95% interval. A prediction that lies within 5 points of that interval counts as agreement (the
# prediction itself is only good to a few points); "checkpointed vs plain" is the comparison's verdict, which says
# slower or faster only when the whole interval lies beyond ±3%. The two GPU-busy columns of this table come from the
# alternating rounds' own profiled steps, so they can differ by a few points from the table above, where `time_it`
# measured each configuration on its own.

# %%
plain = gc_table.xs(False, level="checkpointing")
ckpt = gc_table.xs(True, level="checkpointing")
summary = pd.DataFrame({
    "peak, plain (GiB)": plain["peak allocated (GiB)"],
    "peak, checkpointed (GiB)": ckpt["peak allocated (GiB)"],
    "memory saved (%)": (100 * (1 - ckpt["peak allocated (GiB)"] / plain["peak allocated (GiB)"])).round(2) + 0.0,
    "predicted: layer forward / step (%)": 100 * plain["layer forward GPU kernel time (s)"] / plain["step time (s)"],
    "GPU work added (ms)": 1e3 * (ckpt["step GPU kernel time (s)"] - plain["step GPU kernel time (s)"]),
    "layer forward GPU work (ms)": 1e3 * plain["layer forward GPU kernel time (s)"],
    "head + loss share of forward GPU time": 1 - plain["layer forward GPU kernel time (s)"]
    / plain["forward GPU kernel time (s)"],
    "GPU busy, plain": plain["GPU busy"],
    "GPU busy, checkpointed": ckpt["GPU busy"],
    "verdict, checkpointed": ckpt["verdict"],
})
overhead_columns(summary, gc_cmp, tolerance=5.0)  # (percentage points)
# recomputation cannot make a step faster: such a row measured the host's noise, not checkpointing's cost
summary.loc[summary["checkpointed vs plain"] == "faster", "measured vs predicted"] = "faster than plain"
if prof.on_gpu:
    summary["fits T4 plain"] = summary["peak, plain (GiB)"] <= t4_budget_gib
    summary["fits T4 checkpointed"] = summary["peak, checkpointed (GiB)"] <= t4_budget_gib
summary.drop(columns=["verdict, checkpointed"]).style.format(precision=2, na_rep="—")

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
for ax, name in zip(axes, SETUPS):
    part = gc_table.loc[name]
    column = "peak allocated (GiB)" if prof.on_gpu else "saved for backward (GiB)"  # no allocator on a CPU
    for on, style, label in ((False, "o-", "without checkpointing"), (True, "s-", "with checkpointing")):
        rows = part.xs(on, level="checkpointing")
        ok = rows.dropna(subset=["step time (s)"])
        line, = ax.plot(ok.index, ok[column], style, label=label)
        failed = rows.index[rows["step time (s)"].isna()]
        if len(failed):  # a cross on the axis: no memory number exists for a step that failed
            ax.plot(failed, [0] * len(failed), "x", color=line.get_color(), markersize=10, markeredgewidth=2,
                    clip_on=False, label=f"{label}: out of memory")
    if prof.on_gpu:
        ax.axhline(t4_budget_gib, color="grey", linestyle=":", label="emulated T4 budget")
    ax.set_xscale("log", base=2)
    ax.set_xticks(batch_sizes[name], [str(b) for b in batch_sizes[name]])
    ax.set_ylim(bottom=0)
    saved_pct = summary.loc[name, "memory saved (%)"] if prof.on_gpu else None
    ax.set_title(f"{name}, seq {SETUPS[name]['seq_len']}" + (
        f": {saved_pct.max():.0f}% less at batch {int(saved_pct.idxmax())}" if saved_pct is not None
        and saved_pct.notna().any() else ""), fontsize=10)
    ax.set_xlabel("batch size (samples)")
    ax.set_ylabel(column.replace("(GiB)", "of a step (GiB)") if prof.on_gpu else column)
handles = {lab: h for ax in axes for h, lab in zip(*ax.get_legend_handles_labels())}
fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=3, fontsize=8)
fig.suptitle("Checkpointing every layer flattens the memory's growth with the batch")
fig.tight_layout(rect=(0, 0.1, 1, 1))

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (4.3 In practice)
if prof.on_gpu:
    lines = []
    for name in SETUPS:
        part = summary.loc[name].dropna(subset=["memory saved (%)"])
        top = part.index.max()
        little = [int(b) for b in part.index if part.loc[b, "memory saved (%)"] < 2]
        lo_saved = part["memory saved (%)"].min()
        lo_txt = "no saving" if round(lo_saved) == 0 else f"{lo_saved:.0f}%"  # "-0%" is rounding, not a cost
        text = (f"- **{name}**: checkpointing cut the peak by between {lo_txt} and "
                f"{part['memory saved (%)'].max():.0f}%, at batch {top} from {part.loc[top, 'peak, plain (GiB)']:.1f} to "
                f"{part.loc[top, 'peak, checkpointed (GiB)']:.1f} GiB.")
        if little:
            text += (f" At batch {', '.join(map(str, little))} it saves (almost) nothing: the peak there is not in the "
                     f"forward pass but in the backward pass or the optimizer step (weights, gradients, both AdamW states "
                     f"and the step's temporary buffer, chapter 1), where there are no layer activations to drop.")
        fits_p = [int(b) for b in part.index if part.loc[b, "fits T4 plain"]]
        fits_c = [int(b) for b in part.index if part.loc[b, "fits T4 checkpointed"]]
        text += (f" Under the emulated T4 it fits up to batch {max(fits_p) if fits_p else 'none'} of those measured "
                 f"without checkpointing and {max(fits_c) if fits_c else 'none'} with it.")
        lines.append(text)
    display(Markdown("\n".join(lines) + "\n\nThe fixed part (weights, gradients, optimizer states) does not move; "
                     "the saving grows with the batch, as the activations' share of the peak does."))
else:
    print("skipped on CPU: peak memory and the T4 budget need a GPU (the figure shows the bytes saved for backward)")

# %% [markdown]
# **The price.** Recomputing every layer once should cost one more forward pass of the layers: a third of their
# forward and backward time (the backward pass does two matrix products for each one of the forward pass,
# chapter 1). The optimizer step, the embeddings, the output head and the loss are not repeated, so by this
# count the whole step slows down by a third at most. Real backward passes are not exactly twice their forward
# pass (kernels differ in efficiency: a fused attention kernel's backward, for one, recomputes its score tiles), so
# the layers' forward pass can measure a little more or a little less than a third of a step. The prediction of
# each configuration is therefore its own measured forward pass of the layers.
#
# That prediction is an upper bound, and for one of our two models it overshoots. PyTorch's non-reentrant checkpoint
# stops recomputing a layer as soon as it has rebuilt every tensor the layer saved for backward (its *early stop*,
# on by default; a forward pass run inside `with torch.utils.checkpoint.set_checkpoint_early_stop(False):` turns it
# off), and an operation saves its inputs before it runs. A BERT layer ends in a LayerNorm, which also saves two of
# its own outputs (the mean and the inverse standard deviation), so the whole layer runs again. The GPT-NeoX layer
# (parallel residual) ends, after its attention half, with the MLP's output product, which saves only its input:
# recomputation stops just before that product, $8h^2$ of the layer's $24h^2 + 4sh$ matrix-product FLOPs per token,
# about a third at the 1.3B model's sizes. A count of every matrix product in the backward pass (a PyTorch dispatch
# mode, on a CPU, with two of the 1.3B model's layers) agrees: with the early stop the recomputation redoes two
# thirds of the layers' forward products, without it all of them; for bert-large all of them either way. So for the
# 1.3B model expect checkpointing to add about two thirds to three quarters of its layers' forward GPU work (the
# element-wise kernels before that product are all rerun), not a whole forward pass:

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 4.6), sharey=True)
for ax, name in zip(axes, SETUPS):
    part = summary.loc[name]
    x = np.arange(len(part))
    measured = part["time overhead (%)"].to_numpy()
    err = [np.nan_to_num(measured - part["overhead 95% low (%)"].to_numpy()),
           np.nan_to_num(part["overhead 95% high (%)"].to_numpy() - measured)]
    ax.bar(x - 0.2, np.nan_to_num(measured), width=0.4, yerr=err, capsize=3,
           label="measured: checkpointed / plain - 1 (error bar: 95% interval, interleaved)")
    ax.bar(x + 0.2, part["predicted: layer forward / step (%)"].fillna(0).to_numpy(), width=0.4,
           label="predicted: one more forward pass of the layers")
    oom = np.isnan(measured)
    if oom.any():  # (an empty plot with clip_on=False upsets tight_layout)
        ax.plot(x[oom] - 0.2, [0] * int(oom.sum()), "x", color="k", markersize=10, markeredgewidth=2, clip_on=False,
                label="out of memory")
    ax.axhline(100 / 3, color="grey", linestyle=":", label="33%: a forward is 1/3 of forward + backward")
    ax.set_xticks(x, [str(b) for b in part.index])
    agree = int((part["measured vs predicted"] == "agrees").sum())
    ax.set_title(f"{name}\nmeasured = predicted at {agree} of {int((~oom).sum())} batch sizes", fontsize=9)
    ax.set_xlabel("batch size (samples)")
axes[0].set_ylabel("slower step (%)")
handles = {lab: h for ax in axes for h, lab in zip(*ax.get_legend_handles_labels())}
fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=2, fontsize=8)
agree_all = int((summary["measured vs predicted"] == "agrees").sum())
fig.suptitle("Checkpointing's cost against one more forward pass of the layers" + (
    ": they agree" if agree_all == int(summary["time overhead (%)"].notna().sum()) else ""))
fig.tight_layout(rect=(0, 0.12, 1, 1))

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title The rendered lines for one model
def price_lines(name, part, step_s):
    """The rendered lines for one model: each batch's overhead against the prediction, and what explains a gap.

    ``part``: the model's rows of ``summary`` that were measured; ``step_s``: the plain step's time per batch (s).
    """
    items = [f"batch {b}: {r['time overhead (%)']:+.0f}% (95% interval {r['overhead 95% low (%)']:+.0f} to "
             f"{r['overhead 95% high (%)']:+.0f}%, {r['checkpointed vs plain']}), predicted "
             f"{r['predicted: layer forward / step (%)']:.0f}%, *{r['measured vs predicted']}*, GPU busy "
             f"{r['GPU busy, plain']:.0%} plain" for b, r in part.iterrows()]
    lines = [f"- **{name}**: " + "; ".join(items) + "."]
    more = part[part["measured vs predicted"] == "costs more"]
    host = (more["verdict, checkpointed"] == "host-bound") | (more["GPU busy, plain"] < timing.HOST_BOUND_BUSY)
    for group, is_host in ((more[host], True), (more[~host], False)):
        if not len(group):
            continue
        b = group.index[0]
        r = group.loc[b]
        matches = abs(r["GPU work added (ms)"] - r["layer forward GPU work (ms)"]) < 0.3 * r["layer forward GPU work (ms)"]
        text = (f"  Where it costs more than predicted (batch {', '.join(map(str, group.index))}), the GPU work it "
                f"adds is {r['GPU work added (ms)']:.1f} ms at batch {b}, against "
                f"{r['layer forward GPU work (ms)']:.1f} ms for the layers' forward pass: ")
        if is_host:  # host-bound first: the GPU work added (about a pass, or less) does not set the step's time
            text += (f"the GPU does {r['GPU work added (ms)'] / r['layer forward GPU work (ms)']:.0%} of one more "
                     "forward pass (theory: one whole pass), but the step is host-bound (GPU busy "
                     f"{r['GPU busy, checkpointed']:.0%} with checkpointing), so what sets its time is the CPU, and the "
                     "recomputation launches every layer's kernels a second time and runs the checkpoint's Python "
                     "hooks for each layer.")
        elif matches:
            gap = r["time overhead (%)"] - r["predicted: layer forward / step (%)"]
            half = (r["overhead 95% high (%)"] - r["overhead 95% low (%)"]) / 2
            text += (f"the GPU does about one forward pass more, and the step is not host-bound (GPU busy "
                     f"{r['GPU busy, plain']:.0%} plain, {r['GPU busy, checkpointed']:.0%} with checkpointing). The "
                     f"measured cost lies {gap:.0f} points above the prediction, "
                     + (f"{gap / half:.1f} times the half-width of its 95% interval (±{half:.1f} points)"
                        if half > 0 else "outside its 95% interval")
                     + (": the GPU waits more of the time with checkpointing, and that waiting is part of the cost."
                        if r["GPU busy, checkpointed"] < r["GPU busy, plain"] - 0.05 else "."))
        else:
            text += ("the extra GPU work itself is not one forward pass of the layers; the profile kept in "
                     "`gc_cmp` (`.b.profile.categories()`) shows where it goes.")
        lines.append(text)
    faster = part[part["checkpointed vs plain"] == "faster"]
    if len(faster):
        lines.append(
            f"  At batch {', '.join(map(str, faster.index))} the checkpointed step measured *faster* than the plain "
            f"one ({', '.join(f'{v:+.0f}%' for v in faster['time overhead (%)'])}), which recomputation cannot "
            f"cause: the plain step kept the GPU busy only "
            f"{', '.join(f'{v:.0%}' for v in faster['GPU busy, plain'])} of the time, so both times were the host's. "
            f"Such a row says nothing about checkpointing's cost.")
    less = part[part["measured vs predicted"] == "costs less"]
    if len(less):
        b = less.index[-1]
        r = less.loc[b]
        added, fwd = r["GPU work added (ms)"], r["layer forward GPU work (ms)"]
        busier = r["GPU busy, checkpointed"] > r["GPU busy, plain"] + 0.05
        grew_ms = 1e3 * step_s[b] * r["time overhead (%)"] / 100
        lines.append(
            f"  Where it costs less than predicted (batch {', '.join(map(str, less.index))}), the GPU work added at "
            f"batch {b} is {added:.1f} ms against {fwd:.1f} ms for the layers' forward pass timed on its own"
            + (": the recomputed forward cost the GPU less than a separate forward pass (one profiled step each; "
               "why is not measured here)" if added < 0.9 * fwd else "")
            + (f", and the GPU busy fraction rose from {r['GPU busy, plain']:.0%} to "
               f"{r['GPU busy, checkpointed']:.0%}: part of the recomputation's kernels ran where the GPU would "
               f"otherwise have waited for the host." if busier else
               f"; the GPU was busy {r['GPU busy, plain']:.0%} of the step without checkpointing and "
               f"{r['GPU busy, checkpointed']:.0%} with it, so little recomputation can have hidden in idle time: the "
               f"step grew by {grew_ms:.1f} ms" + (", about that added kernel time." if abs(grew_ms - added) <= 0.25 * added
                                                   else f", against {added:.1f} ms of added kernel time.")))
    return lines


def gpu_limit_sentence(summary):
    """The overhead where the GPU is the limit: busy at least GPU_BOUND_BUSY in both, and not idler when checkpointed."""
    rows = summary[(summary["GPU busy, plain"] >= timing.GPU_BOUND_BUSY)
                   & (summary["GPU busy, checkpointed"] >= timing.GPU_BOUND_BUSY)
                   & (summary["GPU busy, checkpointed"] >= summary["GPU busy, plain"] - 0.05)
                   & summary["time overhead (%)"].notna() & (summary["checkpointed vs plain"] != "faster")]
    if not len(rows):
        return ("None of these configurations kept the GPU busy most of the time, so none tests the Hugging Face "
                "guide's rule of thumb (about 20% slower) for GPU-bound steps.")
    lo, hi = rows["time overhead (%)"].min(), rows["time overhead (%)"].max()
    span = f"{lo:.0f}%" if round(lo) == round(hi) else f"{lo:.0f} to {hi:.0f}%"
    return (f"Where the GPU is the limit (busy {timing.GPU_BOUND_BUSY:.0%} or more both with and without checkpointing, "
            f"and no idler with it: {len(rows)} of the rows above), checkpointing cost {span} here; the Hugging Face "
            f"guide's rule of thumb is about 20%. Measure where your own batch sits.")


if prof.on_gpu:
    lines = []
    for name in SETUPS:
        part = summary.loc[name].dropna(subset=["time overhead (%)"])
        lines += price_lines(name, part, plain.loc[name, "step time (s)"])
    s = shapes.loc["polyglot-ko-1.3b"]
    head_time = summary.loc["polyglot-ko-1.3b", "head + loss share of forward GPU time"]
    lines.append(
        f"\nThe 1.3B model's output head and loss are a small part of its forward pass: "
        f"{s['head share of forward FLOPs']:.1%} of its FLOPs (a {int(s['vocab']):,}-word vocabulary at hidden size "
        f"{int(s['hidden']):,}, against {int(s['layers'])} layers) and "
        + (f"{head_time.min():.0%} to {head_time.max():.0%}" if round(100 * head_time.min()) != round(100 * head_time.max())
           else f"{head_time.max():.0%}")
        + " of its forward GPU time; the prediction above already leaves them out, so they do not explain a gap "
        "between measured and predicted cost.")
    lines.append(gpu_limit_sentence(summary))
    display(Markdown("\n".join(lines)))
else:
    print("skipped on CPU: GPU kernel time and GPU-busy need a GPU, and a CPU's timings say nothing about a GPU's")


# %% [markdown]
# **The LLM book's case.** The book's 1.3B model ran out of memory at batch 16 on a T4 (chapters 1 and 3) and,
# with `gradient_checkpointing=True`, trained at batch 16 with 10.29 GB allocated (read, like its other numbers,
# with `torch.cuda.memory_allocated()` right after the first optimizer step, and in GiB). The same two runs under
# the emulated T4, with the same reading and the peak:

# %%
def llm_book_run(batch_size, checkpointing, updates=2):
    model, optimizer = build("polyglot-ko-1.3b")
    set_checkpointing(model, checkpointing)
    measure.reset_peak(prof.device)
    first_step_gib = float("nan")
    for i in range(updates):
        model(**make_batch("polyglot-ko-1.3b", batch_size, seed=i)).loss.backward()
        optimizer.step()
        if i == 0 and prof.on_gpu:
            first_step_gib = torch.cuda.memory_allocated() / GIB  # where the book reads it
        optimizer.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated() / GIB if prof.on_gpu else float("nan")
    return {"allocated after 1st step (GiB)": first_step_gib, "peak allocated (GiB)": peak}


book_rows = {}
for label, on in (("bs 16", False), ("bs 16 + checkpointing", True)):
    with measure.gpu_budget(t4_budget_gib) if prof.on_gpu else nullcontext():  # no limit on a CPU
        attempt = batching.try_batch(lambda b, c=on: llm_book_run(b, c), 16)
    book_rows[label] = attempt.value if attempt.fits else {"result": f"out of memory ({attempt.error})"}
book = pd.DataFrame.from_dict(book_rows, orient="index")
book["LLM book, T4"] = ["out of memory", "10.29 GiB after 1st step"]
book


# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (4.3 In practice)
if prof.on_gpu:
    r0, r1 = book_rows["bs 16"], book_rows["bs 16 + checkpointing"]
    text = (f"Without checkpointing, batch 16 fails again ({r0['result']}). " if "result" in r0 else
            f"Without checkpointing, batch 16 fits here (peak {r0['peak allocated (GiB)']:.2f} GiB), unlike on the "
            f"book's T4. ")
    text += (f"With it, the run does not fit either ({r1['result']})." if "result" in r1 else
             f"With it, the run fits, and read where the book reads it, memory is "
             f"{r1['allocated after 1st step (GiB)']:.2f} GiB against the book's 10.29: the 9.92 GiB of fp16 weights, "
             f"gradients and AdamW states, plus what is alive at that moment. The peak of the run is "
             f"{r1['peak allocated (GiB)']:.2f} GiB, under the T4's budget of {t4_budget_gib:.2f} GiB.")
    display(Markdown(text))
else:
    print("skipped on CPU: the book's numbers are GPU memory readings under a T4's budget")

# %% [markdown]
# **The Hugging Face guide's rows.** The guide adds checkpointing to bert-large at batch 1 with 4 accumulation
# steps (on a V100: 66.03 s and 8,681 MiB without, 85.47 s and 6,775 MiB with, for 512 samples). The same pair
# here, with chapter 3's accumulation loop, time per optimizer step (the table: `time_it` for each; the
# comparison: `timing.interleaved`; the GPU-busy fractions in the sentence under the table come from its
# alternating rounds, not from the table's separate runs, and need not match them):

# %%
def accumulate(model, optimizer, micro_batches):
    """Chapter 3's loop for one update: backward on loss / N for each micro-batch, then one optimizer step."""
    try:
        for mb in micro_batches:
            (model(**mb).loss / len(micro_batches)).backward()
        optimizer.step()
    finally:
        optimizer.zero_grad(set_to_none=True)


name = "bert-large-uncased"
model, optimizer = build(name)
micro = [make_batch(name, 1, seed=i) for i in range(4)]
hf_rows, hf_timed = {}, {}
for on in (False, True):
    label = "bs 1 x ga 4" + (" + checkpointing" if on else "")
    set_checkpointing(model, on)
    accumulate(model, optimizer, micro)  # warm-up
    measure.reset_peak(prof.device)
    hf_timed[label] = t = timing.time_it(lambda: accumulate(model, optimizer, micro), device=prof.device, warmup=0,
                                         repeat=10, profile_steps=1)
    hf_rows[label] = {
        "step time (s)": t.median_s, "step IQR (s)": t.wall.iqr, "samples/s": 4 / t.median_s,
        "GPU busy": t.gpu_busy if t.gpu_busy is not None else float("nan"),
        "peak allocated (GiB)": torch.cuda.max_memory_allocated() / GIB if prof.on_gpu else float("nan")}
hf_cmp = timing.interleaved(lambda: accumulate(model, optimizer, micro), lambda: accumulate(model, optimizer, micro),
                            device=prof.device, names=("bs 1 x ga 4", "bs 1 x ga 4 + checkpointing"),
                            setup_a=lambda: set_checkpointing(model, False), setup_b=lambda: set_checkpointing(model, True),
                            warmup=1, profile_steps=1)
freed = cleanup.free(globals(), "model", "optimizer", "micro", "t")
hf = pd.DataFrame(hf_rows).T
hf["HF docs V100: samples/s"] = [7.75, 5.99]
hf["HF docs V100: NVML used (MiB)"] = [8681, 6775]
hf

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title bs 1 x ga 4 with checkpointing (candidate) against without (baseline), interleaved
def guide_pair_sentence(c, mem_ratio, gpu_name):
    """bs 1 x ga 4 with checkpointing (candidate) against without (baseline), interleaved."""
    ratio, lo, hi = 1 / c.speedup, 1 / c.hi, 1 / c.lo  # checkpointed time over plain
    guide = f"the guide measured {85.47 / 66.03:.2f} times on its V100"
    if c.verdict == timing.NO_DIFFERENCE:
        text = (f"Checkpointing makes no practical difference to this configuration's step time here ({c.phrase()}), "
                f"where {guide}. ")
    else:
        text = (f"Checkpointing makes this configuration {ratio:.2f} times as slow here (95% interval {lo:.2f}–{hi:.2f}, "
                f"{c.rounds} interleaved rounds); {guide}. ")
    text += (f"The peak does not fall (ratio {mem_ratio:.2f}), where the guide's NVML reading fell to "
             f"{6775 / 8681:.2f}: at batch 1 our peak is the optimizer step, weights, gradients, AdamW's states and the "
             f"step's temporary buffer, none of which checkpointing touches (NVML, which the guide read, also counts "
             f"the allocator's cache and the CUDA context, which this peak of allocated memory leaves out). " if mem_ratio > 0.97 else
             f"The peak falls to {mem_ratio:.2f} of the plain one (the guide's NVML reading: {6775 / 8681:.2f}). ")
    busy, busy_ckpt = c.a.gpu_busy, c.b.gpu_busy
    if min(busy, busy_ckpt) < timing.HOST_BOUND_BUSY:
        launch = timing.us_per_launch(c.b)
        text += (f"A batch of one sequence keeps this GPU ({gpu_name}) busy {busy:.0%} of the plain step and "
                 f"{busy_ckpt:.0%} of the checkpointed one: the GPU waits for the CPU for much of the time, and the "
                 f"recomputation adds host work (each layer's kernels are launched again"
                 + (f", at about {launch:.0f} µs of this host's time per operation," if launch else "")
                 + " and the checkpoint runs its per-layer Python code)"
                 + (", which is why the step slows by more than the one extra forward pass of GPU work would (about "
                    "1.33 times); a faster CPU would narrow the gap. " if lo > 1.33 * (1 + c.threshold) else ". "))
    return text + "At batch 1 checkpointing buys little; it pays at the other end, where a batch does not fit at all."


if prof.on_gpu:
    mem_ratio = hf["peak allocated (GiB)"].iloc[1] / hf["peak allocated (GiB)"].iloc[0]
    display(Markdown(guide_pair_sentence(hf_cmp, mem_ratio, cap.name)))
else:
    print("skipped on CPU: peak memory and GPU-busy need a GPU")


# %% [markdown]
# ## 4.4 Beyond the sources: checkpoint less, or move the activations away
#
# Checkpointing whole layers recomputes everything. Two refinements trade differently.
#
# **Selective checkpointing.** [Korthikanti et al. (2022)](https://gpu-efficient-training.github.io/book/book/references.html) observe that the parts of a transformer layer
# that store the most are not the parts that compute the most: the attention matrix, its softmax and dropout (the
# $5as^2b$ bytes of chapter 1's formula) cost few FLOPs and many bytes. They recompute only those. A fused
# attention kernel already does exactly that: FlashAttention of [Dao et al. (2022)](https://gpu-efficient-training.github.io/book/book/references.html) and PyTorch's SDPA with its
# flash or memory-efficient kernel never store the matrix and rebuild it in the backward pass. SDPA's math
# fallback, which it uses when no fused kernel supports the inputs (bf16 below compute capability 8.0, for
# one), stores it like eager attention; the stack below uses `gpus.amp_dtype()` (fp16 on such GPUs) and checks
# that a fused kernel runs. With a fused kernel, the remaining choice is coarser: recompute the attention half of
# the block or the MLP half. Our `Block` can do either; we stack several and measure.
#
# **Offloading.** Instead of recomputing activations, keep them in the CPU's memory:
# `torch.autograd.graph.save_on_cpu(pin_memory=True)` is a saved-tensor hook pair that copies every saved tensor
# to pinned host memory in the forward pass and back in the backward pass. It costs no FLOPs, only transfers over
# the PCIe bus, which PyTorch issues on the same stream as the computation, so they add to the step's time
# instead of hiding behind it.
#
# Each mode below runs forward and backward (no optimizer) on a stack of blocks in `gpus.amp_dtype()` (bf16
# on GPUs of compute capability 8.0 and newer, fp16 below; fp32 in the tiny profile). Memory is measured at batch 8
# of 512 tokens: bytes kept for backward on the device (`SavedTensorMeter`, entered inside `save_on_cpu`: it sees
# every saved tensor, lets `save_on_cpu` move it, and counts what stays on the device) and the peak allocated
# memory above the weights (GPU). At batch 8 such a short pass keeps the GPU busy only part of the time (the
# column *GPU busy, batch 8*), so its wall time says nothing about recomputed FLOPs; the time is measured at batch
# 64, where the recomputation's cost is physical (the activations, and with them every mode's kept bytes, grow in
# proportion), interleaved against storing everything. The last column is the
# share of the forward FLOPs that is recomputed (matrix products only: $8h^2 + 4sh$ per token for attention,
# $16h^2$ for the MLP).

# %%
n_blocks, stack_batch = prof.pick(tiny=2, full=8), prof.pick(tiny=4, full=8)
stack_dtype = prof.pick(tiny=torch.float32, full=gpus.amp_dtype())
stack_fused = fused_sdpa_runs(stack_dtype)
print(f"stack in {stack_dtype}; fused SDPA kernel (no s x s matrix stored): {stack_fused}")
torch.manual_seed(0)
stack = nn.Sequential(*[Block(hidden, heads) for _ in range(n_blocks)]).to(prof.device, stack_dtype).train()
stack_x = torch.randn(stack_batch, block_seq, hidden, device=prof.device, dtype=stack_dtype)
attn_flops, mlp_flops = 8 * hidden**2 + 4 * block_seq * hidden, 16 * hidden**2
MODES = {  # label: (what each block recomputes, offload saved tensors to the CPU, recomputed share of forward FLOPs)
    "store everything": ("nothing", False, 0.0),
    "recompute attention": ("attention", False, attn_flops / (attn_flops + mlp_flops)),
    "recompute MLP": ("mlp", False, mlp_flops / (attn_flops + mlp_flops)),
    "recompute whole block": ("block", False, 1.0),
    "offload to CPU (save_on_cpu)": ("nothing", True, 0.0),
}


def stack_pass(recompute, offload, count=False, x=None):
    """Forward and backward through the stack; with ``count``, return the bytes kept for backward on the device.

    The meter sits inside ``save_on_cpu`` (a saved-tensor hook must be entered last to see the tensors): it
    counts every saved tensor, hands it on to ``save_on_cpu``, and reports what stays on the device.

    Counting runs a Python hook for every saved tensor, so the timed passes run without it.
    """
    for blk in stack:
        blk.recompute = recompute
    offloading = torch.autograd.graph.save_on_cpu(pin_memory=prof.on_gpu) if offload else nullcontext()
    meter = accounting.SavedTensorMeter(stack) if count else nullcontext()
    try:
        with offloading, meter:
            out = stack(stack_x if x is None else x)
        out.float().square().mean().backward()
    finally:
        stack.zero_grad(set_to_none=True)
    return meter.kept_bytes(prof.device) if count else None


stack_rows = {}
for label, (recompute, offload, _) in MODES.items():
    kept = stack_pass(recompute, offload, count=True)  # warm-up, and the count
    measure.reset_peak(prof.device)
    before = torch.cuda.memory_allocated() if prof.on_gpu else 0
    t = timing.time_it(lambda r=recompute, o=offload: stack_pass(r, o), device=prof.device, warmup=1, repeat=10,
                       profile_steps=1)
    stack_rows[label] = {
        "kept on device (MiB)": kept / MIB,
        "peak above weights (MiB)": (torch.cuda.max_memory_allocated() - before) / MIB if prof.on_gpu else float("nan"),
        f"GPU busy, batch {stack_batch}": t.gpu_busy if t.gpu_busy is not None else float("nan"),
    }
del t
time_batch = prof.pick(tiny=4, full=64)
time_x = torch.randn(time_batch, block_seq, hidden, device=prof.device, dtype=stack_dtype)


def mode_pass(label):
    recompute, offload, _ = MODES[label]
    return lambda: stack_pass(recompute, offload, x=time_x)


stack_cmp = {label: timing.interleaved(mode_pass("store everything"), mode_pass(label), device=prof.device,
                                       names=("store everything", label), warmup=1, profile_steps=1)
             for label in MODES if label != "store everything"}
cmp_halves = timing.interleaved(mode_pass("recompute attention"), mode_pass("recompute MLP"), device=prof.device,
                                names=("recompute attention", "recompute MLP"), warmup=1, profile_steps=1)
stack_table = pd.DataFrame(stack_rows).T
base = next(iter(stack_cmp.values())).a
stack_table[f"batch {time_batch}: time (ms)"] = [1e3 * (stack_cmp[k].b if k in stack_cmp else base).wall.median
                                                 for k in stack_table.index]
stack_table["time vs store everything"] = [1 / stack_cmp[k].speedup if k in stack_cmp else 1.0 for k in stack_table.index]
stack_table["95% low"] = [1 / stack_cmp[k].hi if k in stack_cmp else 1.0 for k in stack_table.index]
stack_table["95% high"] = [1 / stack_cmp[k].lo if k in stack_cmp else 1.0 for k in stack_table.index]
stack_table["vs store everything"] = [stack_cmp[k].verdict if k in stack_cmp else "—" for k in stack_table.index]
stack_table[f"GPU busy, batch {time_batch}"] = [(stack_cmp[k].b if k in stack_cmp else base).gpu_busy
                                                for k in stack_table.index]
stack_table["recomputed share of forward FLOPs"] = [MODES[k][2] for k in stack_table.index]
stack_table

# %%
def fastest_title(cmps):
    """The fastest memory-saving mode (the smallest median time against storing everything)."""
    return f"fastest of the modes that save memory: {max(cmps, key=lambda k: cmps[k].speedup)}"


fig, ax = plt.subplots(figsize=(8, 4.6))
palette = {"store everything": "C3", "recompute attention": "C1", "recompute MLP": "C4",
           "recompute whole block": "C0", "offload to CPU (save_on_cpu)": "C2"}
memory_col = "peak above weights (MiB)" if prof.on_gpu else "kept on device (MiB)"
for label, row in stack_table.iterrows():
    r = row["time vs store everything"]
    ax.errorbar(r, row[memory_col], xerr=[[r - row["95% low"]], [row["95% high"] - r]], fmt="o", markersize=8,
                color=palette[label], label=label)
ax.set_xlabel(f"forward + backward time at batch {time_batch}, relative to storing everything (bars: 95% interval)")
ax.set_ylabel(f"{memory_col.replace(' (MiB)', '')} at batch {stack_batch} (MiB)")
ax.set_ylim(bottom=0)
fig.legend(loc="lower center", ncol=3, fontsize=8)
ax.set_title(f"{n_blocks} blocks, hidden {hidden}, {block_seq} tokens: every mode trades time for memory\n"
             + fastest_title(stack_cmp), fontsize=9)
fig.tight_layout(rect=(0, 0.12, 1, 1))


# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title The attention half against the MLP half
def halves_sentence(kept, halves, attn_share, mlp_share, time_batch, tolerance=0.05):
    """The attention half against the MLP half: bytes kept (batch 8) and time (interleaved, the timing batch).

    The time ratio is held against the FLOP prediction ``(3 + mlp_share) / (3 + attn_share)``: it agrees when the
    median ratio lies within ``tolerance`` (5%) of it.
    """
    text = (f"Recomputing the attention half keeps {kept['recompute attention']:,.0f} MiB for {attn_share:.0%} of the "
            f"forward FLOPs again; recomputing the MLP half keeps {kept['recompute MLP']:,.0f} MiB for {mlp_share:.0%}. ")
    text += ("The MLP half holds more bytes (its 4h-wide intermediate and GeLU input) and has more FLOPs to redo. "
             if kept["recompute MLP"] < kept["recompute attention"] else
             "Here the attention half holds more bytes, though the MLP half has more FLOPs to redo. ")
    predicted = (3 + mlp_share) / (3 + attn_share)  # forward + backward (3 forwards) + the recomputed share
    ratio, lo, hi = 1 / halves.speedup, 1 / halves.hi, 1 / halves.lo  # MLP pass time over attention pass time
    text += (f"At batch {time_batch}, with the GPU busy {halves.a.gpu_busy:.0%} and {halves.b.gpu_busy:.0%} of the two "
             f"passes, the pass that recomputes the MLP half takes {ratio:.2f} times as long as the one that recomputes "
             f"attention (95% interval {lo:.2f}–{hi:.2f}, {halves.rounds} interleaved rounds); their FLOPs predict "
             f"{predicted:.2f}. " if halves.a.gpu_busy is not None else
             f"The pass that recomputes the MLP half takes {ratio:.2f} times as long as the one that recomputes "
             f"attention (95% interval {lo:.2f}–{hi:.2f}); their FLOPs predict {predicted:.2f}. ")
    # Judged against the FLOP prediction, not against "no difference": the two passes differ by the prediction's few
    # percent, so a ±3% verdict would sit on its own threshold and flip between runs.
    off = ratio / predicted - 1
    if abs(off) <= tolerance:
        text += (f"The measurement is within {tolerance:.0%} of that prediction: the MLP half costs "
                 f"{'more' if predicted > 1 else 'less'} time by about what its extra FLOPs say. ")
    elif off < 0:
        text += ("The MLP half costs less, relative to attention, than its FLOPs predict: attention's kernels do less "
                 "work per second than the MLP's matrix products. ")
    else:
        text += ("The MLP half costs more, relative to attention, than its FLOPs predict: its element-wise work "
                 "(the GeLU and the 4h-wide tensors it reads and writes) adds time the FLOP count leaves out. ")
    return text


def whole_block_sentence(kept, c):
    """Whole-block recomputation against storing everything (interleaved), and the 1.33 of one extra forward pass."""
    ratio, lo, hi = 1 / c.speedup, 1 / c.hi, 1 / c.lo
    text = (f"Recomputing whole blocks keeps {kept['recompute whole block']:,.0f} MiB, one input per block, and takes "
            f"{ratio:.2f} times as long as storing everything (95% interval {lo:.2f}–{hi:.2f}); one extra forward "
            f"pass predicts about 1.33. ")
    if c.a.gpu_busy is None:
        return text
    if min(c.a.gpu_busy, c.b.gpu_busy) < timing.HOST_BOUND_BUSY:
        return text + (f"The GPU is busy only {c.a.gpu_busy:.0%} and {c.b.gpu_busy:.0%} of the two passes, so their "
                       "wall time is the host's: this pass cannot test the 1.33. ")
    if lo > 1.33 * 1.1:
        return text + (f"It costs clearly more than the FLOPs predict: checkpointing adds GPU work "
                       f"({(c.b.kernel_s - c.a.kernel_s) * 1e3:.1f} ms of kernels against {c.a.kernel_s * 1e3:.1f} ms) "
                       f"and per-call costs: the checkpoint's hooks run in Python, it saves and restores the random "
                       f"generator's state, and its recomputation launches the block's kernels a second time. ")
    return text + (f"The kernels it adds, {(c.b.kernel_s - c.a.kernel_s) * 1e3:.1f} ms against "
                   f"{c.a.kernel_s * 1e3:.1f} ms for the pass that stores everything, are what the prediction counts. ")


def offload_sentence(kept_mib, off, c, time_batch, stack_batch):
    """save_on_cpu against storing everything (interleaved), and the bandwidth its extra time implies."""
    ratio, lo, hi = 1 / c.speedup, 1 / c.hi, 1 / c.lo
    text = (f"Offloading keeps {kept_mib:,.0f} MiB for backward on the GPU (peak {off['peak above weights (MiB)']:,.0f} "
            f"MiB above the weights at batch {stack_batch}), and at batch {time_batch} the pass takes {ratio:.1f} times "
            f"as long as storing everything (95% interval {lo:.1f}–{hi:.1f}). ")
    moved_gb = off["stored at the timing batch (MiB)"] * MIB / 1e9
    extra_s = c.b.wall.median - c.a.wall.median
    if c.verdict == "slower" and extra_s > 0:
        text += (f"The {moved_gb:.1f} GB of activations (at least: `save_on_cpu` copies a tensor each time an "
                 f"operation saves it, shared or not) cross the bus twice, which the extra time puts at "
                 f"{2 * moved_gb / extra_s:.0f} GB/s or more. Here the blocks compute little per byte they save, so the "
                 f"transfers dominate; offloading pays off where compute per activation byte is high (wide layers) or "
                 f"the copies overlap with computation on a separate stream, which `save_on_cpu` does not do.")
    return text


st = stack_table
attn_share, mlp_share = MODES["recompute attention"][2], MODES["recompute MLP"][2]
kept = {k: st.loc[k, "kept on device (MiB)"] for k in st.index}
text = (f"Storing everything keeps {kept['store everything']:,.0f} MiB for backward at batch {stack_batch}"
        + ("" if stack_fused else ", the $s \\times s$ matrices of SDPA's math fallback included") + ". "
        + halves_sentence(kept, cmp_halves, attn_share, mlp_share, time_batch)
        + whole_block_sentence(kept, stack_cmp["recompute whole block"]))
if prof.on_gpu:
    block = st.loc["recompute whole block"]
    text += (f"The peak, which includes the weights' gradients and the rebuilt activations of one block during its "
             f"backward pass, falls less than the kept bytes: from {st.loc['store everything', 'peak above weights (MiB)']:,.0f} "
             f"to {block['peak above weights (MiB)']:,.0f} MiB for whole blocks.")
    off = st.loc["offload to CPU (save_on_cpu)"].copy()
    off["stored at the timing batch (MiB)"] = kept["store everything"] * time_batch / stack_batch
    text += "\n\n" + offload_sentence(kept["offload to CPU (save_on_cpu)"], off,
                                        stack_cmp["offload to CPU (save_on_cpu)"], time_batch, stack_batch)
else:
    text += "\n\n(On a CPU there is no device memory to offload to and no GPU time: the GPU run's numbers differ.)"
display(Markdown(text))


# %% [markdown]
# Transformers can combine the two ideas: in releases whose checkpointing switch takes `offload=True`
# (`gradient_checkpointing_enable`, or its newer name `activation_checkpointing_enable` where the release has it), each layer is
# checkpointed and its input, the only tensor it keeps, goes to pinned host memory. The cell below tries the
# installed version's switch with `offload=True` and, where it is accepted, measures it on bert-large against
# plain checkpointing.

# %%
def offload_switch(model):
    """The model's checkpointing switch if it accepts ``offload=True`` (tried, not guessed), else None."""
    for method in ("activation_checkpointing_enable", "gradient_checkpointing_enable"):
        enable = getattr(model, method, None)
        if enable is None:
            continue
        try:
            enable({"use_reentrant": False}, offload=True)
        except TypeError:  # this release's switch has no offload argument
            continue
        set_checkpointing(model, False)
        return enable
    return None


offload_rows, offload_timed, offload_api = {}, {}, None
if prof.on_gpu:
    name = "bert-large-uncased"
    model, optimizer = build(name)
    batch = make_batch(name, 8)
    enable = offload_switch(model)
    offload_api = enable.__name__ if enable is not None else None
    for label, kwargs in (("checkpointing", {}), ("checkpointing + offload", {"offload": True})) if enable else ():
        enable({"use_reentrant": False}, **kwargs)
        steps.train_step(model, optimizer, batch)  # warm-up (AdamW's states on first use)
        measure.reset_peak(prof.device)
        offload_timed[label] = timing.time_it(lambda m=model, o=optimizer, b=batch: steps.train_step(m, o, b),
                                              device=prof.device, warmup=0, repeat=10, profile_steps=1)
        offload_rows[label] = {"step time (s)": offload_timed[label].median_s,
                               "IQR (ms)": offload_timed[label].wall.iqr * 1e3,
                               "peak allocated (GiB)": torch.cuda.max_memory_allocated() / GIB}
        set_checkpointing(model, False)
    if enable:  # the comparison: the two in alternating rounds, the switch set (untimed) before each
        cmp_off = timing.interleaved(
            lambda m=model, o=optimizer, b=batch: steps.train_step(m, o, b),
            lambda m=model, o=optimizer, b=batch: steps.train_step(m, o, b), device=prof.device,
            names=("checkpointing", "checkpointing + offload"), setup_a=lambda: enable({"use_reentrant": False}),
            setup_b=lambda: enable({"use_reentrant": False}, offload=True), warmup=1, profile_steps=1)
        set_checkpointing(model, False)
    freed = cleanup.free(globals(), "model", "optimizer", "batch", "enable")
pd.DataFrame(offload_rows).T if offload_rows else None

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Checkpointing + offload (candidate) against checkpointing alone (baseline), interleaved
def offload_step_phrase(c):
    """Checkpointing + offload (candidate) against checkpointing alone (baseline), interleaved."""
    text = (f"The step took {prose.ms(c.b.wall.median)} with offloading and {prose.ms(c.a.wall.median)} without; in "
            f"alternating rounds its speed is {c.phrase(what='than checkpointing alone')}")
    if c.verdict == "slower" and c.b.gpu_busy is not None and c.b.gpu_busy < c.a.gpu_busy - 0.05:
        text += (f", and the GPU is busy {c.b.gpu_busy:.0%} of the offloading step against {c.a.gpu_busy:.0%}: it waits "
                 "for the copies, which run on the computation's stream")
    return text + ". "


if not prof.on_gpu:
    print("skipped on CPU: offloading moves activations off a GPU")
elif not offload_api:
    display(Markdown(f"The installed transformers {transformers.__version__} takes no `offload=True` in "
                     f"`gradient_checkpointing_enable` or `activation_checkpointing_enable`: skipped."))
else:
    a, b = offload_rows["checkpointing"], offload_rows["checkpointing + offload"]
    pa, pb = a["peak allocated (GiB)"], b["peak allocated (GiB)"]
    text = (f"With transformers {transformers.__version__} (`{offload_api}(offload=True)`), bert-large at batch 8: "
            + (f"offloading the checkpoints left the peak at {pa:.2f} GiB" if abs(pa - pb) < 0.01 else
               f"offloading the checkpoints moved the peak from {pa:.2f} to {pb:.2f} GiB")
            + ". " + offload_step_phrase(cmp_off))
    ckpt_peaks = summary.loc["bert-large-uncased", "peak, checkpointed (GiB)"].dropna()
    if pb > 0.9 * pa:
        text += ("With checkpointing, the layers' inputs are all that is left to offload, and at this batch they are "
                 "not what sets the peak")
        if len(ckpt_peaks) > 1 and ckpt_peaks.max() - ckpt_peaks.min() < 0.05:
            text += (f": section 4.3's checkpointed bert-large steps peak at {ckpt_peaks.max():.2f} GiB at every batch "
                     f"it measured ({', '.join(map(str, ckpt_peaks.index))}), so the peak falls where the weights, "
                     f"gradients and AdamW's states are allocated, around the optimizer step, not while the inputs "
                     f"are held")
        text += (". What offloading costs is copying those inputs to pinned host memory and back; the option pays at "
                 "long sequences, where they grow with the sequence. ")
    else:
        text += f"Offloading the layers' inputs saved {pa - pb:.2f} GiB of the peak here. "
    display(Markdown(text))


# %%
freed = cleanup.free(globals(), "stack", "stack_x", "time_x", "stack_pass", "mode_pass")
if prof.on_gpu:
    print(f"allocated after the last experiment: {torch.cuda.memory_allocated() / MIB:,.1f} MiB")

# %% [markdown]
# ## Summary
#
# The measured rows of section 4.3, beside the sources' numbers:

# %%
SOURCES = {"bs 16": "LLM book, T4: out of memory",
           "bs 16 + checkpointing": "LLM book, T4: 10.29 GiB after 1st step",
           "bs 1 x ga 4": "HF docs, V100: 7.75 samples/s, 8,681 MiB NVML",
           "bs 1 x ga 4 + checkpointing": "HF docs, V100: 5.99 samples/s, 6,775 MiB NVML"}
closing_rows = [{"model": model_label, "configuration": label, "result": row.get("result", "fits"),
                 **{k: v for k, v in row.items() if k != "result"}}
                for model_label, rows in (("1.3B GPT-NeoX, fp16, seq 256, T4 budget", book_rows),
                                          ("bert-large, fp32, seq 512", hf_rows))
                for label, row in rows.items()]
closing = pd.DataFrame(closing_rows).set_index(["model", "configuration"])
closing["source's number"] = [SOURCES[cfg] for _, cfg in closing.index]
closing

# %% [markdown]
# - Storing every activation costs memory linear in depth; recomputing everything costs compute quadratic in depth;
#   a checkpoint every $\sqrt{N}$ layers needs $2\sqrt{N}$ stored outputs for one extra forward pass, measured
#   exactly on section 4.1's chain.
# - `torch.utils.checkpoint` (non-reentrant) keeps a block's input and gives the same gradients as plain autograd,
#   dropout included, because it restores the random generator's state for the recomputation.

# %% cellView="form" jupyter={"source_hidden": true} tags=["remove-input"]
# @title Sentences from this run's numbers (Summary)
if prof.on_gpu:
    parts = []
    for name, short in (("bert-large-uncased", "bert-large"), ("polyglot-ko-1.3b", "the 1.3B model")):
        part = summary.loc[name].dropna(subset=["time overhead (%)"])
        verdicts = part["measured vs predicted"]
        against = {"agrees": "as predicted by", "costs more": "more than", "costs less": "less than",
                   "faster than plain": "faster than without it, a host-bound measurement: section 4.3;"}
        how = ("about one extra forward pass of its layers at every batch size" if (verdicts == "agrees").all() else
               "; ".join(f"{r['time overhead (%)']:+.0f}% at batch {b} ({against[r['measured vs predicted']]} one "
                         f"forward pass of its layers, {r['predicted: layer forward / step (%)']:.0f}%)"
                         for b, r in part.iterrows()))
        parts.append(f"{short}'s peak by up to {part['memory saved (%)'].max():.0f}%, and cost {how}")
    r1 = book_rows["bs 16 + checkpointing"]
    display(Markdown(
        f"- `gradient_checkpointing_enable()` cut {parts[0]}. It cut {parts[1]}. "
        + ("The LLM book's batch 16 fits the T4's budget with it." if "result" not in r1 else
           "The LLM book's batch 16 did not fit the emulated T4 even with it here.")))
else:
    print("skipped on CPU: the memory and time of section 4.3 are measured on a GPU")

# %% [markdown]
# - Checkpointing part of a block, or offloading activations to the CPU, are other trades (partial checkpointing
#   keeps more memory to recompute less, which pays only where the GPU is the limit; offloading swaps recomputation
#   for bus transfers): measure them on your model, because which one wins depends on how much each part stores and computes, and on the bus.
#
# ## Use it in your own script
#
# Checkpointing in transformers, and in your own module (non-reentrant, the recommended mode).
#
# ```python
# from torch.utils.checkpoint import checkpoint
#
# model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
# # (transformers releases that have activation_checkpointing_enable(...), 5.23 for one, keep this name as a
# # deprecated alias that warns; there: model.activation_checkpointing_enable({"use_reentrant": False}))
# model.config.use_cache = False  # generation caches are useless, and in the way, during training
#
# # in your own nn.Module's forward:
# for block in self.blocks:
#     h = checkpoint(block, h, use_reentrant=False)
# ```
#
# ## Exercises
#
# Each exercise has a hint and an answer (or the range to expect) behind a click. Where an exercise asks for a
# number, the line under it checks yours without giving the answer away (it says right, close, or what to look at).
#
# 1. In section 4.1, set `n_layers = 256` (and `width = 256` to keep it quick). Predict the best $k$ and the
#    stored outputs before running. What does strategy (b) cost now, in layer forwards?
#    `from helpers import exercises; exercises.check("4.1a", your_k)`, then
#    `exercises.check("4.1b", your_stored_outputs)` and `exercises.check("4.1c", your_layer_forwards)`.
#
#    <details><summary>Hint</summary>
#
#    With a checkpoint every $k$ layers, the peak stores $N/k + k$ layer outputs; recomputing from the start re-runs the prefix for every layer.
#
#    </details>
#
#    <details><summary>Answer</summary>
#
#    Best $k = \sqrt{256} = 16$, storing $256/16 + 16 = 32$ outputs instead of 257 ($N + 1$, the input included, as in section 4.1's table). Strategy (b) stores almost nothing but computes $N(N+1)/2 = 32{,}896$ layer forwards, against 256 plain: quadratic.
#
#    </details>
#
# 2. In section 4.3, give the 1.3B model `attn_implementation="sdpa"`. Its activations shrink (with a fused SDPA kernel, no $s \times s$
#    matrix); does checkpointing still save as large a share of the peak?
#
#    <details><summary>Hint</summary>
#
#    Checkpointing removes the activations inside a block, not the model states; fused attention already removed the biggest activations.
#
#    </details>
#
#    <details><summary>Answer</summary>
#
#    It still saves memory, but a smaller share of the peak than the eager rows of section 4.3, because activations are now a smaller part of it.
#
#    </details>
#
# 3. In section 4.4, checkpoint only every other block (set `recompute` per block). Where does that land between
#    "store everything" and "recompute whole block", in memory and in time? Where the GPU is the limit, what
#    fraction of a plain step should it add? `from helpers import exercises; exercises.check("4.3", your_fraction)`
#
#    <details><summary>Hint</summary>
#
#    Half the blocks keep their activations and half recompute. (For a transformers model, releases whose
#    `activation_checkpointing_enable` takes `every_n_layers`, 5.23 for one, do the same with `every_n_layers=2`.)
#
#    </details>
#
#    <details><summary>Answer</summary>
#
#    About halfway in both: roughly half of the memory saving of full-block recomputation, at roughly half of its time overhead. Where the GPU is the limit that is half of one extra forward pass (about a sixth of a forward and backward pass instead of a third); section 4.4 times its stack at a batch where the GPU is busy nearly all the time, so expect about half of the overhead it measured there for whole blocks. (The checker asks for the FLOP rule's sixth; half of the measured whole-block overhead can come out a little lower, where the backward pass costs more than two forward passes, as a fused attention kernel's does.) At a small, [host-bound](https://gpu-efficient-training.github.io/book/book/glossary.html#host-bound) batch the overhead of either would be larger than the FLOPs say (section 4.3's 1.3B rows), and so would its half.
#
#    </details>
#
# 4. In section 4.2, make `block_x` not require gradients and call `checkpoint(..., use_reentrant=True)`. What
#    happens to the weights' gradients, and why does the non-reentrant version not have this problem?
#
#    <details><summary>Hint</summary>
#
#    The reentrant implementation runs the block under `torch.no_grad()` and connects it to the graph only through inputs that require gradients.
#
#    </details>
#
#    <details><summary>Answer</summary>
#
#    With the reentrant version the checkpointed output does not require gradients: PyTorch warns "None of the inputs have requires_grad=True. Gradients will be None". With the whole block checkpointed, as in section 4.2, nothing in the loss requires gradients, and `backward()` fails with "element 0 of tensors does not require grad and does not have a grad_fn". With only the attention half checkpointed (`recompute = "attention"`), the step runs, but the attention weights silently get no gradients (`.grad` stays `None`) while the MLP's are computed. The non-reentrant version records the graph through the weights themselves, so their gradients are computed in every case.
#
#    </details>
#
# ## References
#
# - [Chen et al. (2016)](https://gpu-efficient-training.github.io/book/book/references.html): checkpointing every $\sqrt{N}$ layers, sublinear memory for one extra forward pass.
# - [Korthikanti et al. (2022)](https://gpu-efficient-training.github.io/book/book/references.html): activation memory per layer and selective recomputation.
# - [Dao et al. (2022)](https://gpu-efficient-training.github.io/book/book/references.html): attention that recomputes its score matrix in the backward pass.
# - [Hugging Face (2024)](https://gpu-efficient-training.github.io/book/book/references.html), *Methods and tools for efficient training on a single GPU*: [gradient checkpointing](https://gpu-efficient-training.github.io/book/book/glossary.html#gradient-checkpointing)
#   with the Trainer, the V100 rows of section 4.3.
# - [Heo (2024)](https://gpu-efficient-training.github.io/book/book/references.html), chapter 5: the polyglot-ko-1.3b experiment, batch 16 with checkpointing on a T4.
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
