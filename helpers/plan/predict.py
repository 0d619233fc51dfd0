"""The prediction: walk a steady-state training step phase by phase and find its peak (``predict``, ``Plan``).

The phases are those of the book's loop (``loss = model(**batch).loss``, ``loss.backward()``,
``optimizer.step()``, ``zero_grad(set_to_none=True)``). Each phase adds up the terms of
``helpers.plan.terms`` that are alive at its peak moment; the backward pass is walked block by block.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from helpers.plan.setup import Setup, Shape, _shape, validate
from helpers.plan.terms import (
    COMPONENTS,
    SOURCES,
    _checkpointed_layers,
    _pclass,
    _trainable,
    _weight_dtype_bytes,
    _zero_share,
    autocast_copy_bytes,
    gradient_bytes,
    kv_cache_bytes,
    layer_activation_bytes,
    lora_trainable_params,
    optimizer_state_bytes,
    other_activation_bytes,
    weight_bytes,
)

GIB = 2**30

# The phases of a training step, in the order they run.
PHASES = ("forward", "backward", "optimizer step")

# The margin the command line keeps above the predicted *allocated* peak before it says "fits": what the
# caching allocator reserves beyond what is allocated (its rounding to 512-byte blocks and 2 MiB / 20 MiB
# segments, and fragmentation) is not in the prediction, and an out-of-memory error is decided on reserved
# memory. Chapter 8 measured 0.35 GiB of slack over an 8.42 GiB peak (4%) with expandable_segments, and
# 3.31 GiB (39%) with the default allocator on a workload of changing shapes; a fixed-shape training loop
# sits near the first. 5% is a stated choice, not a measurement: ``--margin-pct`` changes it.
RESERVED_MARGIN_PCT = 5.0


@dataclass
class Plan:
    """A prediction: bytes by component at the peak, bytes by phase, and the whole-step totals.

    ``components`` are what is alive at the peak moment (they sum to ``peak_bytes``); ``totals`` are
    the full sizes of each term (all activations, all gradients); ``phases`` the peak of each phase.

    Introduced in chapter 10, section 10.1.
    """

    setup: Setup
    components: dict[str, int]
    phases: dict[str, int]
    phase_components: dict[str, dict[str, int]]
    totals: dict[str, int]
    notes: list[str] = field(default_factory=list)

    @property
    def peak_bytes(self) -> int:
        return max(self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda k: self.phases[k])

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GIB

    def fits(self, budget_gib: float, margin_pct: float = 0.0) -> bool:
        """True when the predicted peak allocated memory, plus ``margin_pct`` percent, is at most ``budget_gib``.

        The command line uses ``RESERVED_MARGIN_PCT`` (the allocator reserves more than it allocates).
        """
        return self.peak_bytes * (1 + margin_pct / 100) <= budget_gib * GIB

    def table(self) -> pd.DataFrame:
        """One row per component: bytes and GiB at the peak, the whole-step total, and its source.

        The last row is the peak; its whole-step total is empty (NaN), so print the table with
        ``to_string(na_rep="—")`` as the command line does.
        """
        rows = [
            {"component": c, "bytes": self.components.get(c, 0), "GiB": self.components.get(c, 0) / GIB,
             "total (GiB)": self.totals.get(c, 0) / GIB, "source": SOURCES[c]}
            for c in COMPONENTS
        ]
        rows.append({"component": f"peak ({self.peak_phase})", "bytes": self.peak_bytes, "GiB": self.peak_gib,
                     "total (GiB)": float("nan"), "source": ""})
        return pd.DataFrame(rows).set_index("component")

    def explain(self) -> str:
        """A few lines: the setup, each phase's peak, and what the peak is made of."""
        lines = [f"setup: {self.setup.label()}"]
        lines += [f"  {ph:15s} {b / GIB:8.2f} GiB" + ("  <- peak" if ph == self.peak_phase else "")
                  for ph, b in self.phases.items()]
        parts = ", ".join(f"{c} {b / GIB:.2f}" for c, b in self.components.items() if b)
        lines.append(f"peak {self.peak_gib:.2f} GiB in the {self.peak_phase}: {parts} (GiB)")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _loss_bytes(s: Setup, shape: Shape) -> tuple[int, int]:
    """(forward, backward) transient bytes of a language-model loss: logits and their gradients."""
    if shape.head != "causal-lm":
        return 0, 0
    tv = s.batch * s.seq * shape.vocab
    fwd = 4 * tv if _pclass(s) == "fp32" else 6 * tv  # the logits (+ their fp32 copy) next to the log-softmax
    bwd = 8 * tv  # the fp32 gradients of the log-softmax and of the logits (chapter 4, section 4.3)
    return fwd, bwd


def predict(s: Setup, *, backend: str = "cuda", kv_cache: bool = True) -> Plan:
    """Predict the peak allocated memory of a steady-state training step of ``s`` (per rank).

    The phases are those of the book's loop (``loss = model(**batch).loss``, ``loss.backward()``,
    ``optimizer.step()``, ``zero_grad(set_to_none=True)``): the forward pass of step 2 holds the weights,
    the optimizer states and the activations; the backward pass frees activations as it creates
    gradients (the planner walks it layer by layer); the optimizer step holds weights, gradients, states
    and the step's temporaries. Under gradient accumulation the gradients are alive from the second
    micro-batch on. The forward pass also holds the fp32 key/value cache of ``kv_cache_bytes`` (as
    temporaries); ``kv_cache=False`` leaves it out, as the planner did before chapter 10's GPU run
    showed the gap.

    Introduced in chapter 10, section 10.1.
    """
    notes = validate(s)
    shape = _shape(s)
    pc = _pclass(s)
    fw, fg, fo = _zero_share(s)
    L = shape.layers
    W = int(weight_bytes(s) * fw)
    G_full = gradient_bytes(s)
    G = int(G_full * fg)
    O_full = optimizer_state_bytes(s)
    Ost = int(O_full * fo)
    if s.optimizer == "paged-adamw8bit":
        notes.append("paged 8-bit AdamW keeps its states in CUDA unified memory, outside torch's allocator")
    C_all = autocast_copy_bytes(s)
    C_layer = (C_all - 2 * shape.head_linear_numel() - 2 * lora_trainable_params(s)) // L if C_all else 0
    C_layer = max(C_layer, 0) + (2 * lora_trainable_params(s) // L if C_all else 0)
    C_head = C_all - C_layer * L
    A_layer = layer_activation_bytes(s, backend=backend)
    A_other = other_activation_bytes(s, backend=backend)
    ck = _checkpointed_layers(s, L)
    if (any(ck) or s.use_cache is False) and shape.family == "gpt_neox" and s.attention == "sdpa":
        # Checkpointing turns the KV cache off, as use_cache=False does: the value tensor SDPA saves is then
        # a view of the fused QKV output, which keeps all three projections alive (+2 of them), instead of
        # the cache's copy. Counted with SavedTensorMeter on CPU: +8 (fp32) / +4 (16-bit) bytes per s*b*h.
        # (Llama's separate projections save the same bytes with the cache on or off.)
        A_layer += (8 if pc == "fp32" else 4) * s.batch * s.seq * shape.hidden
    e_res = 4 if (pc in ("fp32", "amp") and s.precision not in ("bf16", "fp16")) or s.qlora else 2
    inp = e_res * s.batch * s.seq * shape.hidden  # a checkpointed block keeps only its input
    stored = [inp if c else A_layer for c in ck]
    stored_copies = [0 if c else C_layer for c in ck]
    loss_fwd, loss_bwd = _loss_bytes(s, shape)
    wide = (4 if pc == "fp32" else 2) * s.batch * s.seq * shape.intermediate
    T_layer = wide  # the gradient of a block's widest tensor while it runs backward

    # gradients per block and outside the blocks (head first, embeddings last)
    tr = _trainable(s, shape)
    if s.lora_rank:
        g_per_layer = G_full // L
        g_head = 0
    else:
        g_layers = sum(p.numel for p in shape.params if ".layers." in p.name or ".layer." in p.name)
        g_per_layer = g_layers * _weight_dtype_bytes(s) // L
        # a tied head's gradient is the embedding's, and it arrives with the head's backward
        g_head = (sum(p.numel for p in shape.params if p.kind == "head") + shape.tied_head_numel()) \
            * _weight_dtype_bytes(s)
    g_per_layer, g_head = int(g_per_layer * fg), int(g_head * fg)
    G_acc = G if s.grad_accum > 1 else 0
    gathered = 0
    if s.zero_stage >= 3 and s.world_size > 1:  # ZeRO-3 gathers one block's weights at a time
        gathered = shape.layer_linear_numel() * _weight_dtype_bytes(s)

    # forward (step 2: states exist): the larger of two moments, the last block running (a checkpointed
    # block holds its activations until it returns) and the loss (logits next to the log-softmax).
    # Autocast's copies stay cached until the forward pass ends, also under checkpointing.
    any_ck = any(ck)
    kv = kv_cache_bytes(s) if kv_cache else 0  # alive through the forward pass, dropped before backward
    in_last = {"weights": W + gathered, "gradients": G_acc, "optimizer_states": Ost,
               "activations": sum(stored[:-1]) + A_layer, "autocast_copies": C_all - C_head, "temporaries": kv}
    at_loss = {"weights": W + gathered, "gradients": G_acc, "optimizer_states": Ost,
               "activations": sum(stored) + A_other, "autocast_copies": C_all, "temporaries": loss_fwd + kv}
    forward = at_loss if sum(at_loss.values()) >= sum(in_last.values()) else in_last

    # backward: start (loss gradients) then block by block from the top
    best: dict[str, int] = {}
    saved_copies_total = sum(stored_copies) + C_head
    start = {"weights": W + gathered, "gradients": G_acc, "optimizer_states": Ost,
             "activations": sum(stored) + A_other, "autocast_copies": saved_copies_total, "temporaries": loss_bwd}
    best = start
    if loss_bwd:  # the LM head's backward: the log-softmax is gone, the logits' gradient and the head's arrive
        tv = s.batch * s.seq * shape.vocab
        head_tmp = (4 if pc == "fp32" else 2) * tv + (2 * shape.head_linear_numel() if C_head and not s.lora_rank else 0)
        head = {"weights": W + gathered, "gradients": max(G_acc, g_head), "optimizer_states": Ost,
                "activations": sum(stored) + A_other - 4 * tv, "autocast_copies": saved_copies_total,
                "temporaries": head_tmp}
        if sum(head.values()) > sum(best.values()):
            best = head
    for i in reversed(range(L)):
        done = g_head + (L - i) * g_per_layer
        below = sum(stored[:i])
        here = A_layer
        copies = sum(stored_copies[:i]) + C_layer
        cur = {"weights": W + gathered, "gradients": max(G_acc, done), "optimizer_states": Ost,
               "activations": below + here + A_other - (4 * s.batch * s.seq * shape.vocab if loss_fwd else 0),
               "autocast_copies": copies, "temporaries": T_layer}
        if sum(cur.values()) > sum(best.values()):
            best = cur
    end = {"weights": W, "gradients": G, "optimizer_states": Ost, "activations": 0, "autocast_copies": 0,
           "temporaries": 0}
    if sum(end.values()) > sum(best.values()):
        best = end
    backward = best

    # optimizer step
    T_opt = 0
    if s.optimizer == "adamw":
        T_opt = Ost // 2  # the multi-tensor step's sqrt(v): one copy of a state (chapter 1, section 1.5)
    elif s.optimizer == "adafactor":
        # per tensor: the update and the factored estimate (fp32); for 16-bit tensors also fp32 copies of
        # the gradient and the weight
        largest = max((n * 4 for n, _, _ in tr), default=0)
        T_opt = (2 if _weight_dtype_bytes(s) == 4 or s.lora_rank else 4) * largest
    step = {"weights": W, "gradients": G, "optimizer_states": Ost, "activations": 0, "autocast_copies": 0,
            "temporaries": T_opt}
    phase_components = {"forward": forward, "backward": backward, "optimizer step": step}
    phases = {k: int(sum(v.values())) for k, v in phase_components.items()}
    peak = max(phases, key=lambda k: phases[k])
    totals = {"weights": W, "gradients": G, "optimizer_states": Ost,
              "activations": L * A_layer + A_other if not any_ck else sum(stored) + A_other,
              "autocast_copies": C_all, "temporaries": max(T_opt, loss_bwd, T_layer, loss_fwd + kv)}
    return Plan(setup=s, components={k: int(v) for k, v in phase_components[peak].items()}, phases=phases,
                phase_components=phase_components, totals=totals, notes=notes)
