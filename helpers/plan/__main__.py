"""The planner's command line: ``python -m helpers.plan --model gpt-neox-1.3b --batch 4 --seq 256 --gpu T4``.

Prints the breakdown by term, each phase's peak, the verdict against a GPU's memory (``helpers.gpus``) or
a budget, and, when the setup does not fit, the cheapest changes that make it fit.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from typing import Any

import pandas as pd

from helpers.gpus import CONTEXT_RESERVE_GIB, GPU_MEMORY_GIB, NO_BF16_GPUS
from helpers.plan.predict import RESERVED_MARGIN_PCT, predict
from helpers.plan.setup import (
    ALIASES,
    ATTENTIONS,
    DEFAULT_LORA_TARGETS,
    OPTIMIZERS,
    PRECISIONS,
    Setup,
    _shape,
)
from helpers.plan.suggest import suggest


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {v}")
    return v


def _checkpointing(text: str) -> Any:
    if text in ("none", "full"):
        return text
    return _positive_int(text)


class _Parser(argparse.ArgumentParser):
    """argparse, with errors in one line (no usage block): ``python -m helpers.plan: error: ...``, exit 2."""

    def error(self, message: str):  # noqa: D401 - argparse's name
        self.exit(2, f"{self.prog}: error: {' '.join(str(message).split())}\n")


def _non_negative_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(v) and v >= 0):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return v


def _parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="python -m helpers.plan",
                 description="Predict the peak GPU memory of a training step and whether it fits. Exit status: "
                             "0 fits (or no budget given), 1 does not fit, 2 bad input.")
    ap.add_argument("--model", required=True, help=f"registry name ({', '.join(ALIASES)}) or a config.json path")
    ap.add_argument("--profile", default="full", choices=("full", "tiny"),
                    help="full: the registry model's real shape; tiny: its CPU twin")
    ap.add_argument("--batch", type=_positive_int, default=4, help="micro-batch size (sequences)")
    ap.add_argument("--seq", type=_positive_int, default=256, help="sequence length (tokens)")
    ap.add_argument("--precision", default="bf16-autocast", choices=PRECISIONS)
    ap.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS)
    ap.add_argument("--grad-accum", type=_positive_int, default=1, help="accumulation steps per optimizer step")
    ap.add_argument("--checkpointing", type=_checkpointing, default="none", help="none | full | k (every k-th block)")
    ap.add_argument("--attention", default="sdpa", choices=ATTENTIONS)
    ap.add_argument("--no-cache", action="store_true",
                    help="the loop passes use_cache=False (causal LMs: no generation cache in training)")
    ap.add_argument("--lora-rank", type=_positive_int, default=None)
    ap.add_argument("--lora-targets", default=None,
                    help="comma-separated module names (default: the attention's query and value projections)")
    ap.add_argument("--qlora", action="store_true", help="NF4 base (needs --lora-rank)")
    ap.add_argument("--no-double-quant", action="store_true")
    ap.add_argument("--zero-stage", type=int, default=0, choices=(0, 1, 2, 3))
    ap.add_argument("--world-size", type=_positive_int, default=1)
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--gpu", choices=sorted(GPU_MEMORY_GIB), help="compare with this GPU's memory")
    group.add_argument("--budget-gib", type=float, help="compare with this budget (GiB of allocatable memory)")
    ap.add_argument("--margin-pct", type=_non_negative_float, default=RESERVED_MARGIN_PCT,
                    help=f"reserve this much above the predicted allocated peak for the allocator's rounding and "
                         f"fragmentation before saying 'fits' (default {RESERVED_MARGIN_PCT:g})")
    ap.add_argument("--top", type=_positive_int, default=5, help="how many suggestions to print")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: print the breakdown, the peak phase, the verdict and, if needed, suggestions.

    Exits with status 2 and a message for unknown models, impossible settings and bad numbers; 1 when
    the setup does not fit the budget; 0 when it fits (or no budget was given).

    Introduced in chapter 10, section 10.1.
    """
    ap = _parser()
    args = ap.parse_args(argv)
    if args.budget_gib is not None and not (args.budget_gib > 0 and math.isfinite(args.budget_gib)):
        ap.error(f"--budget-gib must be a positive number, got {args.budget_gib}")
    if args.world_size > 1 and args.zero_stage == 0:
        ap.error("--world-size > 1 needs --zero-stage 1, 2 or 3: the planner does not model DDP's gradient buckets "
                 "or NCCL's buffers (plan one GPU with --world-size 1)")
    s = Setup(model=args.model, batch=args.batch, seq=args.seq, precision=args.precision, optimizer=args.optimizer,
              grad_accum=args.grad_accum, checkpointing=args.checkpointing, attention=args.attention,
              lora_rank=args.lora_rank, lora_targets=tuple(t for t in (args.lora_targets or "").split(",") if t),
              qlora=args.qlora, double_quant=not args.no_double_quant, zero_stage=args.zero_stage,
              world_size=args.world_size, profile=args.profile, use_cache=False if args.no_cache else None)
    try:
        family = _shape(s).family
    except (ValueError, TypeError, KeyError) as exc:
        ap.error(str(exc))
    if args.lora_targets is None:
        s = s.replace(lora_targets=DEFAULT_LORA_TARGETS[family])
    needs_bnb = s.qlora or s.optimizer in ("adamw8bit", "paged-adamw8bit")
    if needs_bnb:
        try:
            import bitsandbytes  # noqa: F401
        except Exception as exc:  # pragma: no cover - depends on the installation
            ap.error(f"QLoRA and 8-bit optimizers need bitsandbytes, which cannot be imported here ({exc})")
    try:
        p = predict(s)
    except (ValueError, TypeError, KeyError) as exc:
        ap.error(str(exc))
    with pd.option_context("display.float_format", "{:,.2f}".format, "display.width", 160):
        print(p.table().drop(columns=["bytes"]).to_string(na_rep="—"))
    print(p.explain())
    budget = GPU_MEMORY_GIB[args.gpu] - CONTEXT_RESERVE_GIB if args.gpu else args.budget_gib
    half = "fp16" if args.gpu in NO_BF16_GPUS else "bf16"
    if args.gpu in NO_BF16_GPUS and "bf16" in s.precision:
        print(f"note: the {args.gpu} has no bf16 tensor cores (compute capability < 8.0): use fp16 there")
    if budget is None:
        return 0
    margin = args.margin_pct / 100
    where = f"{args.gpu} ({budget:.2f} GiB allocatable)" if args.gpu else f"the budget of {budget:.2f} GiB"
    with_margin = p.peak_gib * (1 + margin)
    stated = f"predicted peak {p.peak_gib:.2f} GiB allocated, {with_margin:.2f} GiB with the {args.margin_pct:g}% margin"
    if with_margin <= budget:
        print(f"verdict: fits {where}: {stated}")
        return 0
    if p.peak_gib <= budget:
        print(f"verdict: does NOT fit {where} with the {args.margin_pct:g}% margin for the allocator "
              f"(reserved > allocated): {stated}; it fits only if fragmentation stays under "
              f"{budget - p.peak_gib:.2f} GiB (try PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, or --margin-pct 0)")
    else:
        print(f"verdict: does NOT fit {where}: {stated}")
    options = suggest(s, budget / (1 + margin), half=half)
    if not options:
        print("no change of one or two settings makes it fit; try a smaller batch or sequence, or more GPUs")
        return 1
    print("cheapest changes that fit with the margin (relative step time, a rough factor from the book's "
          "measurements; predicted peak):")
    for desc, _, plan_, cost in options[: args.top]:
        print(f"  x{cost:.2f}  {plan_.peak_gib:6.2f} GiB  {desc}")
        for note in plan_.notes:
            print(f"           note: {note}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
