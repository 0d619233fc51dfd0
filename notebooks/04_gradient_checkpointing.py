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
# Chapter 3 showed that activations are the part of training memory that grows with the batch, and that
# gradient accumulation keeps them small by keeping the batch small. Gradient checkpointing attacks them
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
#   and why $k = \sqrt{N}$ is the sweet spot of {cite:t}`chen2016training`;
# - what `torch.utils.checkpoint` does, and a check that it gives the same gradients as plain autograd;
# - the measured memory and time of checkpointing in transformers models, against the "one extra forward
#   pass" that theory predicts;
# - two refinements beyond the seeds: checkpointing only part of a block (after {cite:t}`korthikanti2022reducing`),
#   and moving saved activations to the CPU instead of recomputing them.
#
# **Prerequisites:** chapter 1 (activations, `SavedTensorMeter`, the emulated T4) and chapter 3 (the batch
# sweep, `helpers.batching`). The [setup page](../book/setup.md) explains the run profiles; numbers quoted in
# the text come from the full-size run on the GPU named in the first output below.

# %%
import sys

if "google.colab" in sys.modules:  # Colab only. pip adds what Colab lacks (bitsandbytes, the book's helpers)
    # and upgrades transformers to the 5.x the book needs: nothing has imported it yet in this kernel, so no
    # restart is needed. Colab's torch already meets the book's floor and is kept (see the setup page).
    # %pip install -q --no-warn-conflicts "gpu-efficient-training @ git+https://github.com/gpu-efficient-training/book"

from helpers import env

env.quiet()  # warnings without file paths, no progress bars: outputs that read the same everywhere

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

from helpers import accounting, batching, cleanup, data, measure, models, plots, profiles
from helpers.glue import glue
from helpers.measure import GIB, MIB

plots.use_style()
pd.options.display.float_format = "{:,.2f}".format
prof = profiles.get()
env.report(prof)

# %% [markdown]
# As in chapter 3, we measure this process's CUDA context first, so that section 4.3 can emulate a T4 (14.75
# GiB minus the context) on a larger card.

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
if prof.is_full:
    glue("chain_n", n_layers)
    glue("chain_sqrt_n", int(math.isqrt(n_layers)))
    glue("chain_store_all", int(three.loc["stored (layer outputs)", "(a) store everything"]))
    glue("chain_sqrt_store", int(check["measured"].min()))
    glue("chain_recompute_calls", int(three.loc["layer forwards", "(b) recompute from the start"]))
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

# %% [markdown]
# With $N$ = {glue:text}`chain_n` layers, storing everything keeps {glue:text}`chain_store_all` layer outputs;
# a checkpoint every {glue:text}`chain_sqrt_n` layers keeps {glue:text}`chain_sqrt_store` at most, and pays for it
# with one extra forward pass; recomputing from the start keeps two but needs {glue:text}`chain_recompute_calls`
# layer forwards instead of {glue:text}`chain_n`. This is the result of {cite:t}`chen2016training`:
# $O(\sqrt{N})$ memory for one extra forward pass (recursing on the segments brings memory down to
# $O(\log N)$ at more recomputation). In practice the segments are not chosen by $\sqrt{N}$: frameworks
# checkpoint at the boundary of every transformer layer, so a model of $L$ layers keeps $L$ layer inputs
# plus the full activations of the one layer being recomputed. That is close to the optimum: in the units of the
# chain, a transformer layer is a segment of about 17 (chapter 1: 34 or more $sbh$ bytes inside a layer, 2 at its
# input), so 24 layers make $N \approx 400$ and $\sqrt{N} \approx 20$, about one layer.

# %%
freed = cleanup.free(globals(), "chain", "chain_input", "strategies", "grads_a")


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
        y = F.scaled_dot_product_attention(q, k, v)  # fused: no s x s matrix is stored
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
if prof.is_full:
    glue("block_input_mib", block_x.numel() * block_x.element_size() / MIB)
    glue("block_plain_saved_mib", block_check.iloc[0, 0])
    glue("block_ckpt_saved_mib", block_check.iloc[1, 0])
    glue("block_ckpt_grad_diff", block_check.iloc[1, 2])
    glue("block_norng_grad_diff", block_check.iloc[2, 2])
    if prof.on_gpu:
        glue("block_plain_peak_mib", block_check.iloc[0, 1])
        glue("block_ckpt_peak_mib", block_check.iloc[1, 1])
block_check.assign(**{"gradients: max rel. difference": block_check.iloc[:, 2].map("{:.1e}".format)})

# %% [markdown]
# Without checkpointing the block keeps {glue:text}`block_plain_saved_mib:.0f` MiB for backward; checkpointed, it
# keeps {glue:text}`block_ckpt_saved_mib:.0f` MiB, its input ({glue:text}`block_input_mib:.0f` MiB), which
# `checkpoint` saves so that it can run the block again. The gradients agree to
# {glue:text}`block_ckpt_grad_diff:.1e`. Without restoring the generator's state they are off by
# {glue:text}`block_norng_grad_diff:.2f`: dropout drew other masks in the recomputation, so the backward pass
# differentiated a different function than the forward pass computed, silently.
#
# On the GPU the peak above the starting point is {glue:text}`block_plain_peak_mib:.0f` MiB without checkpointing
# and {glue:text}`block_ckpt_peak_mib:.0f` MiB with it. For a single block, checkpointing moves the activations
# from the forward pass to the backward pass rather than removing them: the recomputation rebuilds all of them
# before the block's backward can run. In a stack of $L$ blocks only one block is rebuilt at a time, so the peak
# holds one block's activations instead of $L$; that is where the savings of section 4.3 come from.

# %%
freed = cleanup.free(globals(), "block", "block_x", "plain_grads", "ckpt_grads", "norng_grads")

# %% [markdown]
# ## 4.3 In practice: `gradient_checkpointing_enable()`
#
# Transformers models implement the layer-boundary version: `model.gradient_checkpointing_enable()` wraps every
# transformer layer's call in `torch.utils.checkpoint`, so each layer keeps only its input. (Newer transformers
# releases, 5.23 for one, call it `activation_checkpointing_enable` and keep the old name as a deprecated alias; the function
# below uses whichever exists, with the non-reentrant checkpoint.) We measure the two models of chapter 3 in the
# seeds' setups: bert-large in fp32 at 512 tokens, and the 1.3B GPT-NeoX with fp16 weights, eager attention and
# 256 tokens. For each batch size, with and without checkpointing: the peak allocated memory of a training step
# and its time (median of three after a warm-up step). To compare with theory we also time the forward pass
# alone: recomputing every layer once should cost about one forward pass.

# %%
SETUPS = {
    "bert-large-uncased": dict(head="sequence-classification", dtype=torch.float32, attn_implementation="sdpa",
                               seq_len=prof.pick(tiny=64, full=512)),
    "polyglot-ko-1.3b": dict(head="causal-lm", dtype=prof.pick(tiny=torch.float32, full=torch.float16),
                             attn_implementation="eager", seq_len=prof.pick(tiny=64, full=256)),
}  # (the tiny profile keeps the 1.3B model's twin in fp32: CPUs are slow at fp16)


def build(name, seed=0):
    setup = SETUPS[name]
    model = models.build(name, head=setup["head"], dtype=setup["dtype"],
                         attn_implementation=setup["attn_implementation"], seed=seed).train()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)


def make_batch(name, batch_size, seed=0):
    task = "classification" if SETUPS[name]["head"] == "sequence-classification" else "causal-lm"
    ds = data.dummy_dataset(batch_size, SETUPS[name]["seq_len"], task=task, seed=seed)
    return {k: v.to(prof.device) for k, v in ds[:].items()}


def train_step(model, optimizer, batch):
    try:
        model(**batch).loss.backward()
        optimizer.step()
    finally:
        optimizer.zero_grad(set_to_none=True)


def set_checkpointing(model, on):
    """Turn the model's gradient (activation) checkpointing on or off, non-reentrant."""
    renamed = hasattr(model, "activation_checkpointing_enable")
    if on:
        (model.activation_checkpointing_enable if renamed else model.gradient_checkpointing_enable)({"use_reentrant": False})
    else:
        (model.activation_checkpointing_disable if renamed else model.gradient_checkpointing_disable)()


def measure_step(name, model, optimizer, batch_size, time_forward):
    batch = make_batch(name, batch_size)
    try:  # warm-up step (AdamW's states on first use), counting what the forward pass keeps
        with accounting.SavedTensorMeter(model) as saved:
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
    finally:
        optimizer.zero_grad(set_to_none=True)
    measure.reset_peak(prof.device)
    timing = measure.time_fn(lambda: train_step(model, optimizer, batch), device=prof.device, warmup=0, repeat=3)
    row = {"step time (s)": timing.median_s, "samples/s": batch_size / timing.median_s,
           "saved for backward (GiB)": saved.total_bytes / GIB,
           "peak allocated (GiB)": torch.cuda.max_memory_allocated() / GIB if prof.on_gpu else float("nan")}
    if time_forward:
        row["forward time (s)"] = measure.time_fn(lambda: model(**batch).loss, device=prof.device,
                                                  warmup=1, repeat=3).median_s
    return row


batch_sizes = prof.pick(tiny=[2, 4, 8], full=[4, 8, 16, 32])
gc_rows = []
for name in SETUPS:
    model, optimizer = build(name)
    for on in (False, True):
        set_checkpointing(model, on)
        for bs in batch_sizes:
            attempt = batching.try_batch(
                lambda b, n=name, m=model, o=optimizer, t=not on: measure_step(n, m, o, b, t), bs)
            gc_rows.append({"model": name, "checkpointing": on, "batch": bs,
                            **(attempt.value if attempt.fits else {"result": f"out of memory ({attempt.error})"})})
    freed = cleanup.free(globals(), "model", "optimizer")
gc_table = pd.DataFrame(gc_rows).set_index(["model", "batch", "checkpointing"]).sort_index()
gc_table

# %% [markdown]
# Every configuration ran on the whole card (through `batching.try_batch`, so that on a T4 the ones that do not
# fit become rows that say so). Which would fit the emulated T4, and what did checkpointing save and cost?

# %%
wide = gc_table[["saved for backward (GiB)", "peak allocated (GiB)", "step time (s)"]].unstack("checkpointing")
summary = pd.DataFrame({
    "saved, plain (GiB)": wide[("saved for backward (GiB)", False)],
    "saved, checkpointed (GiB)": wide[("saved for backward (GiB)", True)],
    "peak, plain (GiB)": wide[("peak allocated (GiB)", False)],
    "peak, checkpointed (GiB)": wide[("peak allocated (GiB)", True)],
    "memory saved (%)": 100 * (1 - wide[("peak allocated (GiB)", True)] / wide[("peak allocated (GiB)", False)]),
    "time overhead (%)": 100 * (wide[("step time (s)", True)] / wide[("step time (s)", False)] - 1),
    "predicted: forward / step (%)": 100 * gc_table.xs(False, level="checkpointing")["forward time (s)"]
    / wide[("step time (s)", False)],
})
if prof.on_gpu:
    summary["fits T4 plain"] = summary["peak, plain (GiB)"] <= t4_budget_gib
    summary["fits T4 checkpointed"] = summary["peak, checkpointed (GiB)"] <= t4_budget_gib
if prof.is_full and prof.on_gpu:
    for key, name in (("bert", "bert-large-uncased"), ("llm", "polyglot-ko-1.3b")):
        part = summary.loc[name]
        glue(f"{key}_saved_pct_max", part["memory saved (%)"].max())
        glue(f"{key}_saved_pct_min", part["memory saved (%)"].min())
        glue(f"{key}_overhead_pct_mean", part["time overhead (%)"].mean())
        glue(f"{key}_predicted_pct_mean", part["predicted: forward / step (%)"].mean())
        for b in (part.index.min(), part.index.max()):
            glue(f"{key}_overhead_pct_b{b}", part.loc[b, "time overhead (%)"])
            glue(f"{key}_predicted_pct_b{b}", part.loc[b, "predicted: forward / step (%)"])
        glue(f"{key}_peak_plain_32", part.loc[32, "peak, plain (GiB)"])
        glue(f"{key}_peak_ckpt_32", part.loc[32, "peak, checkpointed (GiB)"])
        for col, suffix in (("fits T4 plain", "plain"), ("fits T4 checkpointed", "ckpt")):
            fitting = part.index[part[col].to_numpy()]
            glue(f"{key}_t4_max_{suffix}", int(fitting.max()) if len(fitting) else 0)
summary

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 4))
for ax, name in zip(axes, SETUPS):
    part = gc_table.loc[name]
    column = "peak allocated (GiB)" if prof.on_gpu else "saved for backward (GiB)"  # no allocator on a CPU
    for on, style, label in ((False, "o-", "without checkpointing"), (True, "s-", "with checkpointing")):
        rows = part.xs(on, level="checkpointing").dropna(subset=["step time (s)"])
        ax.plot(rows.index, rows[column], style, label=label)
    if prof.on_gpu:
        ax.axhline(t4_budget_gib, color="grey", linestyle=":", label="emulated T4 budget")
    ax.set_xscale("log", base=2)
    ax.set_ylim(bottom=0)
    ax.set_title(f"{name}, seq {SETUPS[name]['seq_len']}")
    ax.set_xlabel("batch size (samples)")
    ax.set_ylabel(column.replace("(GiB)", "of a step (GiB)") if prof.on_gpu else column)
axes[0].legend()
fig.suptitle("Checkpointing every layer flattens the memory's growth with the batch")
fig.tight_layout()

# %% [markdown]
# Checkpointing cut the peak by {glue:text}`bert_saved_pct_min:.0f` to {glue:text}`bert_saved_pct_max:.0f`% for
# bert-large and by up to {glue:text}`llm_saved_pct_max:.0f`% for the 1.3B model, more at larger batches, where
# activations are a larger share of the total (at batch 32: from {glue:text}`bert_peak_plain_32:.1f` to
# {glue:text}`bert_peak_ckpt_32:.1f` GiB, and from {glue:text}`llm_peak_plain_32:.1f` to
# {glue:text}`llm_peak_ckpt_32:.1f` GiB). The fixed part, weights, gradients and optimizer states, does not move.
# For the 1.3B model at batches 4 and 8 checkpointing saves nothing at all: its peak there is the optimizer step
# (weights, gradients, both states and the step's temporary buffer, chapter 1), which has no activations to
# drop. Under the emulated T4, bert-large fits up to batch {glue:text}`bert_t4_max_plain` of those measured
# without checkpointing and {glue:text}`bert_t4_max_ckpt` with it; the 1.3B model up to
# {glue:text}`llm_t4_max_plain` and {glue:text}`llm_t4_max_ckpt`.
#
# **The price.** Recomputing every layer once should cost one more forward pass. A forward pass is about a third
# of forward plus backward (the backward pass does two matrix products for each one of the forward pass,
# chapter 1), so the rule of thumb is 33% of the forward-backward time; the optimizer step is not repeated, so
# the whole step slows down less. We predict each configuration's overhead from its own timed forward pass. For
# bert-large the prediction holds: {glue:text}`bert_overhead_pct_mean:.0f`% slower on average, against
# {glue:text}`bert_predicted_pct_mean:.0f`% predicted. For the 1.3B model it does not, in either direction. At
# batch 4 the step became {glue:text}`llm_overhead_pct_b4:.0f`% slower where the forward pass predicts
# {glue:text}`llm_predicted_pct_b4:.0f`%: at that size the GPU is not busy (chapter 3: throughput was still
# climbing steeply), each step's time is set by launching thousands of small kernels and by Python, and the
# recomputation launches the layers' kernels again and adds the checkpoint's own hooks for each of the 24 layers.
# At batch 32 it cost {glue:text}`llm_overhead_pct_b32:.0f`% against {glue:text}`llm_predicted_pct_b32:.0f`%:
# the timed forward pass includes the output head and the loss over a 30,080-word vocabulary, a large share of
# this model's forward work, which checkpointing does not recompute (only the transformer layers are
# checkpointed). The Hugging Face guide's rule of thumb, about 20%, is for the second regime; measure where your
# own batch sits.

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
for ax, name in zip(axes, SETUPS):
    part = summary.loc[name]
    x = np.arange(len(part))
    ax.bar(x - 0.2, part["time overhead (%)"], width=0.4, label="measured: checkpointed / plain - 1")
    ax.bar(x + 0.2, part["predicted: forward / step (%)"], width=0.4, label="predicted: one more forward pass")
    ax.axhline(100 / 3, color="grey", linestyle=":", label="33%: a forward is 1/3 of forward + backward")
    ax.set_xticks(x, [str(b) for b in part.index])
    ax.set_title(name)
    ax.set_xlabel("batch size (samples)")
axes[0].set_ylabel("slower step (%)")
fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=8)
fig.suptitle("Checkpointing costs about one extra forward pass per step")
fig.tight_layout(rect=(0, 0.08, 1, 1))


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
if prof.is_full and prof.on_gpu:
    glue("book_ckpt_first_gib", book.loc["bs 16 + checkpointing", "allocated after 1st step (GiB)"])
    glue("book_ckpt_peak_gib", book.loc["bs 16 + checkpointing", "peak allocated (GiB)"])
    glue("book_plain_result", book_rows["bs 16"].get("result", "fits"))
book


# %% [markdown]
# Without checkpointing, batch 16 fails again ("{glue:text}`book_plain_result`"). With it, the run fits, and
# read where the book reads it, memory is {glue:text}`book_ckpt_first_gib:.2f` GiB against the book's 10.29: the
# 9.92 GiB of fp16 weights, gradients and AdamW states, plus what is alive at that moment. The peak of the run is
# {glue:text}`book_ckpt_peak_gib:.2f` GiB, under the T4's budget.
#
# **The Hugging Face guide's rows.** The guide adds checkpointing to bert-large at batch 1 with 4 accumulation
# steps (on a V100: 66.03 s and 8,681 MiB without, 85.47 s and 6,775 MiB with, for 512 samples). The same pair
# here, with chapter 3's accumulation loop, time per optimizer step:

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
hf_rows = {}
for on in (False, True):
    set_checkpointing(model, on)
    accumulate(model, optimizer, micro)  # warm-up
    measure.reset_peak(prof.device)
    timing = measure.time_fn(lambda: accumulate(model, optimizer, micro), device=prof.device, warmup=0, repeat=3)
    hf_rows["bs 1 x ga 4" + (" + checkpointing" if on else "")] = {
        "step time (s)": timing.median_s, "samples/s": 4 / timing.median_s,
        "peak allocated (GiB)": torch.cuda.max_memory_allocated() / GIB if prof.on_gpu else float("nan")}
freed = cleanup.free(globals(), "model", "optimizer", "micro")
hf = pd.DataFrame(hf_rows).T
hf["HF docs V100: samples/s"] = [7.75, 5.99]
hf["HF docs V100: NVML used (MiB)"] = [8681, 6775]
time_ratio = hf["step time (s)"].iloc[1] / hf["step time (s)"].iloc[0]
if prof.is_full and prof.on_gpu:
    glue("hf_time_ratio", time_ratio)
    glue("hf_docs_time_ratio", 85.47 / 66.03)
    glue("hf_mem_ratio", hf["peak allocated (GiB)"].iloc[1] / hf["peak allocated (GiB)"].iloc[0])
    glue("hf_docs_mem_ratio", 6775 / 8681)
hf

# %% [markdown]
# Checkpointing makes this configuration {glue:text}`hf_time_ratio:.2f` times slower here; the guide measured
# {glue:text}`hf_docs_time_ratio:.2f` times on its V100. The peak does not fall at all (ratio
# {glue:text}`hf_mem_ratio:.2f`), where the guide's NVML reading fell to {glue:text}`hf_docs_mem_ratio:.2f`: at
# batch 1 our peak is the optimizer step, weights, gradients, AdamW's states and the step's temporary buffer,
# none of which checkpointing touches (NVML, which the guide read, also counts the allocator's cache, which does
# shrink). And the time is worse than on the V100 because on the H200 a batch of one sequence leaves the GPU
# idle most of the step: the step's time is launching kernels, and the recomputation launches the forward
# pass's kernels again. At batch 1 checkpointing buys nothing and costs the most; it pays at the other end,
# where a batch does not fit at all.

# %% [markdown]
# ## 4.4 Beyond the seeds: checkpoint less, or move the activations away
#
# Checkpointing whole layers recomputes everything. Two refinements trade differently.
#
# **Selective checkpointing.** {cite:t}`korthikanti2022reducing` observe that the parts of a transformer layer
# that store the most are not the parts that compute the most: the attention matrix, its softmax and dropout (the
# $5as^2b$ bytes of chapter 1's formula) cost few FLOPs and many bytes. They recompute only those. A fused
# attention kernel already does exactly that: FlashAttention {cite:p}`dao2022flashattention` and PyTorch's SDPA
# never store the matrix and rebuild it in the backward pass. With SDPA, the remaining choice is coarser: recompute
# the attention half of the block or the MLP half. Our `Block` can do either; we stack several and measure.
#
# **Offloading.** Instead of recomputing activations, keep them in the CPU's memory:
# `torch.autograd.graph.save_on_cpu(pin_memory=True)` is a saved-tensor hook pair that copies every saved tensor
# to pinned host memory in the forward pass and back in the backward pass. It costs no FLOPs, only transfers over
# the PCIe bus, which PyTorch issues on the same stream as the computation, so they add to the step's time
# instead of hiding behind it.
#
# Each mode below runs forward and backward (no optimizer) on a stack of blocks in bf16 (fp32 in the tiny
# profile), batch 8 of 512 tokens. Columns: bytes kept for backward on the device (`SavedTensorMeter`, entered inside `save_on_cpu`: it
# sees every saved tensor, lets `save_on_cpu` move it, and counts what stays on the device), the peak allocated memory
# above the weights (GPU), the time, and the share of the forward FLOPs that is recomputed (matrix products only:
# $8h^2 + 4sh$ per token for attention, $16h^2$ for the MLP).

# %%
n_blocks, stack_batch = prof.pick(tiny=2, full=8), prof.pick(tiny=4, full=8)
stack_dtype = prof.pick(tiny=torch.float32, full=torch.bfloat16)
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


def stack_pass(recompute, offload, count=False):
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
            out = stack(stack_x)
        out.float().square().mean().backward()
    finally:
        stack.zero_grad(set_to_none=True)
    return meter.kept_bytes(prof.device) if count else None


stack_rows = {}
for label, (recompute, offload, share) in MODES.items():
    kept = stack_pass(recompute, offload, count=True)  # warm-up, and the count
    measure.reset_peak(prof.device)
    before = torch.cuda.memory_allocated() if prof.on_gpu else 0
    timing = measure.time_fn(lambda r=recompute, o=offload: stack_pass(r, o), device=prof.device, warmup=1, repeat=prof.pick(tiny=3, full=10))
    stack_rows[label] = {
        "kept on device (MiB)": kept / MIB,
        "peak above weights (MiB)": (torch.cuda.max_memory_allocated() - before) / MIB if prof.on_gpu else float("nan"),
        "forward + backward (ms)": 1e3 * timing.median_s,
        "recomputed share of forward FLOPs": share,
    }
stack_table = pd.DataFrame(stack_rows).T
base_ms = stack_table.loc["store everything", "forward + backward (ms)"]
stack_table["time vs store everything"] = stack_table["forward + backward (ms)"] / base_ms
if prof.is_full and prof.on_gpu:
    for label, key in (("store everything", "none"), ("recompute attention", "attn"), ("recompute MLP", "mlp"),
                       ("recompute whole block", "block"), ("offload to CPU (save_on_cpu)", "offload")):
        glue(f"stack_{key}_kept_mib", stack_table.loc[label, "kept on device (MiB)"])
        glue(f"stack_{key}_peak_mib", stack_table.loc[label, "peak above weights (MiB)"])
        glue(f"stack_{key}_time_ratio", stack_table.loc[label, "time vs store everything"])
    glue("stack_attn_share", MODES["recompute attention"][2])
    glue("stack_mlp_share", MODES["recompute MLP"][2])
    moved_gb = stack_table.loc["store everything", "kept on device (MiB)"] * MIB / 1e9
    extra_s = (stack_table.loc["offload to CPU (save_on_cpu)", "forward + backward (ms)"] - base_ms) / 1e3
    glue("stack_moved_gb", moved_gb)
    glue("stack_offload_gbps", 2 * moved_gb / extra_s if extra_s > 0 else float("nan"))
stack_table

# %%
fig, ax = plt.subplots()
palette = {"store everything": "C3", "recompute attention": "C1", "recompute MLP": "C4",
           "recompute whole block": "C0", "offload to CPU (save_on_cpu)": "C2"}
memory_col = "peak above weights (MiB)" if prof.on_gpu else "kept on device (MiB)"
for label, row in stack_table.iterrows():
    ax.scatter(row["time vs store everything"], row[memory_col], s=60, color=palette[label], label=label)
ax.set_xlabel("forward + backward time, relative to storing everything")
ax.set_ylabel(f"{memory_col.replace(' (MiB)', '')} (MiB)")
ax.set_ylim(bottom=0)
ax.legend(fontsize=8)
ax.set_title(f"{n_blocks} blocks, hidden {hidden}, batch {stack_batch} x {block_seq}: each mode buys memory with time")
fig.tight_layout()

# %% [markdown]
# Storing everything keeps {glue:text}`stack_none_kept_mib:,.0f` MiB for backward. Recomputing the attention half
# keeps {glue:text}`stack_attn_kept_mib:,.0f` MiB for {glue:text}`stack_attn_share:.0%` of the forward FLOPs again,
# and recomputing the MLP half keeps {glue:text}`stack_mlp_kept_mib:,.0f` MiB for
# {glue:text}`stack_mlp_share:.0%`: the MLP holds more bytes (its 4h-wide intermediate and GeLU input) and costs
# more to redo. Recomputing whole blocks keeps {glue:text}`stack_block_kept_mib:,.0f` MiB, one input per block.
# Measured time relative to storing everything: {glue:text}`stack_attn_time_ratio:.2f` (attention),
# {glue:text}`stack_mlp_time_ratio:.2f` (MLP), {glue:text}`stack_block_time_ratio:.2f` (whole block). That is far
# more than the recomputed FLOPs predict (one extra forward pass would make the whole-block ratio about 1.33), and
# it is not the arithmetic: one pass through this stack takes a few milliseconds (the table's first row), and each
# checkpointed call adds a fixed cost that so short a pass cannot hide: its hooks run in Python, it saves and
# restores the random generator's state, and its recomputation launches the block's kernels a second time. Section
# 4.3 showed the other end: on bert-large, with far more work per call, checkpointing cost what the FLOPs predict.
# Measure on your own model before choosing. The peak,
# which includes the weights' gradients and the rebuilt activations of one block during its backward pass, falls
# less than the kept bytes: from {glue:text}`stack_none_peak_mib:,.0f` to
# {glue:text}`stack_block_peak_mib:,.0f` MiB for whole blocks.
#
# Offloading keeps nothing for backward on the GPU (peak {glue:text}`stack_offload_peak_mib:,.0f` MiB above the
# weights), but the step takes {glue:text}`stack_offload_time_ratio:.1f` times as long: the
# {glue:text}`stack_moved_gb:.1f` GB of activations (at least: `save_on_cpu` copies a tensor each time an
# operation saves it, shared or not) cross the bus twice, which the extra time puts at
# {glue:text}`stack_offload_gbps:.0f` GB/s or more. Here the blocks compute little per byte they save, so the transfers
# dominate; offloading pays off where compute per activation byte is high (wide layers) or the copies can be
# overlapped with computation on a separate stream, which `save_on_cpu` does not do. Newer transformers releases
# (5.23, for one) combine the two ideas: `activation_checkpointing_enable(offload=True)` checkpoints each layer and
# keeps only its input, in pinned host memory.

# %%
freed = cleanup.free(globals(), "stack", "stack_x")
if prof.on_gpu:
    print(f"allocated at the end: {torch.cuda.memory_allocated() / MIB:,.0f} MiB")

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
#   exactly on a chain of {glue:text}`chain_n` layers.
# - `torch.utils.checkpoint` (non-reentrant) keeps a block's input and gives the same gradients as plain autograd,
#   dropout included, because it restores the random generator's state for the recomputation.
# - `gradient_checkpointing_enable()` cut bert-large's peak by up to {glue:text}`bert_saved_pct_max:.0f`% and the
#   1.3B model's by up to {glue:text}`llm_saved_pct_max:.0f`%. It cost bert-large one extra forward pass
#   ({glue:text}`bert_overhead_pct_mean:.0f`% slower, as predicted) and the 1.3B model from
#   {glue:text}`llm_overhead_pct_b32:.0f`% at batch 32 to {glue:text}`llm_overhead_pct_b4:.0f`% at batch 4, where
#   the GPU is idle and launches dominate. The LLM book's batch 16 fits the T4 with it.
# - Checkpointing part of a block, or offloading activations to the CPU, are finer trades: measure them on your
#   model, because which one wins depends on how much each part stores and computes, and on the bus.
#
# ## Use it in your own script
#
# Checkpointing in transformers, and in your own module (non-reentrant, the recommended mode).
#
# ```python
# from torch.utils.checkpoint import checkpoint
#
# model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
# model.config.use_cache = False  # generation caches are useless, and in the way, during training
#
# # in your own nn.Module's forward:
# for block in self.blocks:
#     h = checkpoint(block, h, use_reentrant=False)
# ```
#
# ## Exercises
#
# Each exercise has a hint and an answer (or the range to expect) behind a click.
#
# 1. In section 4.1, set `n_layers = 256` (and `width = 256` to keep it quick). Predict the best $k$ and the
#    stored outputs before running. What does strategy (b) cost now?
#
#    <details><summary>Hint</summary>
#
#    With a checkpoint every $k$ layers, the peak stores $N/k + k$ layer outputs; recomputing from the start re-runs the prefix for every layer.
#
#    </details>
#
#    <details><summary>Answer</summary>
#
#    Best $k = \sqrt{256} = 16$, storing $256/16 + 16 = 32$ outputs instead of 256. Strategy (b) stores almost nothing but recomputes about $N^2/2 \approx 33{,}000$ layer forwards, against 256 plain: quadratic.
#
#    </details>
#
# 2. In section 4.3, give the 1.3B model `attn_implementation="sdpa"`. Its activations shrink (no $s \times s$
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
#    "store everything" and "recompute whole block", in memory and in time?
#
#    <details><summary>Hint</summary>
#
#    Half the blocks keep their activations and half recompute.
#
#    </details>
#
#    <details><summary>Answer</summary>
#
#    About halfway in both: roughly half of the memory saving of full-block recomputation, at roughly half its time overhead (about one sixth of a step instead of one third).
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
#    With the reentrant version the output does not require gradients (PyTorch warns that none of the inputs have `requires_grad=True`) and the block's weights get no gradients at all. The non-reentrant version records the graph through the weights themselves, so their gradients are computed.
#
#    </details>
#
# ## References
#
# - {cite:t}`chen2016training`: checkpointing every $\sqrt{N}$ layers, sublinear memory for one extra forward pass.
# - {cite:t}`korthikanti2022reducing`: activation memory per layer and selective recomputation.
# - {cite:t}`dao2022flashattention`: attention that recomputes its score matrix in the backward pass.
# - {cite:t}`hf_perf_train_gpu_one`: gradient checkpointing with the Trainer, the V100 rows of section 4.3.
# - {cite:t}`heo2024llm`, chapter 5: the polyglot-ko-1.3b experiment, batch 16 with checkpointing on a T4.
