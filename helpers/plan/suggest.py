"""Suggestions: the cheapest changes of a setup (one or two at a time) whose predicted peak fits a budget."""

from __future__ import annotations

import dataclasses
import itertools
import math

from helpers.plan.predict import Plan, predict
from helpers.plan.setup import Setup, _shape, validate

# Relative step-time cost of each change (1.0 = no slower): rough factors from the book's measurements, not a
# model of this setup's step. Checkpointing recomputes the forward pass: chapter 4 measured 1.7-2.1x at small
# batches (full) and about half that overhead for every 2nd block; 8-bit AdamW and Adafactor slow the step
# (chapter 5.4); LoRA is not free either (the frozen base still runs its forward and the input gradients, the
# adapters add small kernels: about 1.3x a full step was measured on the 1.3B model at small batches), and
# QLoRA dequantizes every matmul on top (chapter 6.3: about 1.8x LoRA); accumulation only adds launches.
_CHANGES: list[tuple[str, dict, float]] = [
    ("fused AdamW (no temporary copy)", {"optimizer": "adamw-fused"}, 1.0),
    ("SDPA attention", {"attention": "sdpa"}, 1.0),
    ("bf16 autocast", {"precision": "bf16-autocast"}, 1.0),
    ("8-bit AdamW", {"optimizer": "adamw8bit"}, 1.05),
    ("paged 8-bit AdamW", {"optimizer": "paged-adamw8bit"}, 1.07),
    ("checkpoint every 2nd block", {"checkpointing": 2}, 1.35),
    ("full gradient checkpointing", {"checkpointing": "full"}, 1.7),
    ("LoRA r=8 on all block linears, bf16 base", {"lora_rank": 8, "lora_targets": "all", "precision": "bf16"}, 1.3),
    ("QLoRA r=8 (NF4 base)", {"lora_rank": 8, "lora_targets": "all", "qlora": True, "precision": "bf16"}, 2.3),
    ("Adafactor", {"optimizer": "adafactor"}, 1.7),
]

# How many ways of splitting the batch into micro-batches ``suggest`` tries (the smallest factors first).
_MAX_SPLITS = 6


def _all_targets(s: Setup) -> tuple[str, ...]:
    return tuple(n.split(".")[-1] if s.model not in ("bert-large", "bert-large-uncased") else n
                 for n, _, _ in _shape(s).layer_linears)


def suggest(s: Setup, budget_gib: float, *, max_changes: int = 2, half: str = "bf16") -> list[tuple[str, Setup, Plan, float]]:
    """Changes of ``s`` (one or two at a time, plus halving the batch with accumulation) that fit.

    Returns ``(description, setup, plan, relative_time_cost)`` for every candidate whose predicted peak
    is at most ``budget_gib``, cheapest first (ties: smaller peak first). The cost is a rough factor on
    the step time from the chapters' measurements, not a prediction for this setup. No change alters the
    effective batch: micro-batches are only tried at sizes that divide the batch (a prime batch can only
    become micro-batch 1), so batch x accumulation stays what it was. ``half``: the 16-bit type the
    changes may switch to (``"fp16"`` for GPUs without bf16 tensor cores, the T4 and the V100).

    Introduced in chapter 10, section 10.4.
    """
    if half not in ("bf16", "fp16"):
        raise ValueError(f"half must be 'bf16' or 'fp16', got {half!r}")
    singles: list[tuple[str, dict, float]] = []
    for desc, change, cost in _CHANGES:
        ch = dict(change)
        if "precision" in ch:  # GPUs without bf16 (T4, V100) get fp16
            ch["precision"] = ch["precision"].replace("bf16", half)
            desc = desc.replace("bf16", half)
        if ch.get("lora_targets") == "all":
            ch["lora_targets"] = _all_targets(s)
        if all(getattr(s, k) == v for k, v in ch.items()):
            continue
        if s.lora_rank and "lora_rank" in ch and not ch.get("qlora"):
            continue
        singles.append((desc, ch, cost))
    # micro-batches that divide the batch exactly, so that the effective batch (batch x accumulation) stays
    factors = sorted({d for i in range(1, math.isqrt(s.batch) + 1) if s.batch % i == 0 for d in (i, s.batch // i)}
                     - {1})
    if len(factors) > _MAX_SPLITS:
        factors = factors[: _MAX_SPLITS - 1] + [s.batch]  # the smallest splits, and micro-batch 1
    for f in factors:
        b, ga = s.batch // f, s.grad_accum * f
        singles.append((f"micro-batch {b} x {ga} accumulation steps (effective batch {b * ga} kept)",
                        {"batch": b, "grad_accum": ga}, 1.0 + 0.05 * math.log2(f)))
    out = []
    seen = set()
    fitting: set[int] = set()  # single changes that fit alone: no combination needs to add to them
    for k in range(1, max_changes + 1):
        for idx in itertools.combinations(range(len(singles)), k):
            combo = [singles[i] for i in idx]
            keys = [set(c[1]) for c in combo]
            if any(a & b_ for a, b_ in itertools.combinations(keys, 2)):
                continue
            if k > 1 and any(i in fitting for i in idx):
                continue
            change: dict = {}
            for c in combo:
                change.update(c[1])
            try:
                cand = s.replace(**change)
                validate(cand)
                p = predict(cand)
            except (ValueError, KeyError):
                continue
            key = tuple(getattr(cand, f.name) for f in dataclasses.fields(cand) if f.name != "model")
            if key in seen or not p.fits(budget_gib):
                continue
            seen.add(key)
            if k == 1:
                fitting.add(idx[0])
            cost = math.prod(c[2] for c in combo)
            out.append((" + ".join(c[0] for c in combo), cand, p, cost))
    out.sort(key=lambda r: (r[3], r[2].peak_bytes))
    return out
