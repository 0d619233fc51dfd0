"""Check your answer to a chapter's exercise: right, close, or a nudge, never the answer itself.

Not used in a chapter's code: an exercise that asks for a number names the one line to run, for example

>>> from helpers import exercises
>>> exercises.check("2.2", 0.5)
✓ 2.2 — right (within ±1% of the book's value). ...

Every reference answer is computed here from the same formulas and model configs the chapter uses (nothing
is typed in), and none depends on your GPU: they are counts of bytes, ratios, formula values. Where an
exercise has inputs you may change (a LoRA rank, a number of micro-batches), pass them as keywords:
``exercises.check("6.1", answer, r=16)``. ``exercises.keys()`` lists what can be checked and
``exercises.question(key)`` says what each number is, with its unit.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from helpers import models

GIB, MIB = 2**30, 2**20


# ----- the facts the answers are computed from --------------------------------------------------------------
@functools.cache
def _polyglot() -> dict[str, int]:
    """Parameter counts of the 1.3B GPT-NeoX, built on the meta device (no memory, no download)."""
    import torch

    meta = models.build("polyglot-ko-1.3b", profile="full", head="causal-lm", device="meta")
    head = meta.get_output_embeddings()
    linear = sum(m.weight.numel() for m in meta.modules() if isinstance(m, torch.nn.Linear) and m is not head)
    cfg = models.config("polyglot-ko-1.3b", profile="full")
    return {"params": models.n_params(meta), "quantized_linear": linear, "hidden": cfg.hidden_size,
            "layers": cfg.num_hidden_layers}


@functools.cache
def _outlier_step_shrink(old: float = 50.0, new: float = 5.0) -> float:
    """Section 2.4's data: how much the absmax step shrinks when the outliers go from ``old`` to ``new``."""
    import torch

    normal = torch.randn(1 << 20, generator=torch.Generator().manual_seed(0))  # the chapter's (a) data
    bulk = normal.abs().max().item()
    return max(old, bulk) / max(new, bulk)


@functools.cache
def _e4m3_product_error(n: int = 512) -> float:
    """Relative error of a product of two N(0, 1) matrices whose inputs were rounded to fp8 e4m3 (fp64 product)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, dtype=torch.float64, generator=gen) for _ in range(2))
    exact = a @ b
    rounded = a.to(torch.float8_e4m3fn).double() @ b.to(torch.float8_e4m3fn).double()
    return ((rounded - exact).norm() / exact.norm()).item()


def _checkpoint_best(n_layers: int) -> tuple[int, int]:
    """Chapter 4, section 4.1: the k that minimises N/k + k (k divides N), and that minimum."""
    return min(((k, n_layers // k + k) for k in range(1, n_layers + 1) if n_layers % k == 0), key=lambda t: t[1])


def _zero_gpus(stage: int, psi: float = 7.5e9, budget_gib: float = 14.75, k: int = 12) -> int:
    """Chapter 7: the fewest GPUs whose share of mixed-precision Adam's states fits ``budget_gib`` each."""
    budget = budget_gib * GIB
    if stage == 3:
        return math.ceil((2 + 2 + k) * psi / budget)
    if stage == 2:
        return math.ceil((2 + k) * psi / (budget - 2 * psi))
    raise ValueError(f"stage must be 2 or 3, not {stage!r}")


# ----- the registry -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Trap:
    """A typical wrong answer: the reference times ``factor``, and what to say to someone who gave it.

    ``units`` limits a trap to answers in those units (a GB-for-GiB slip needs a memory size).
    Not used in a chapter's code (``grade`` tries them on every wrong answer).
    """

    factor: float
    nudge: str
    units: tuple[str, ...] = ()


_MEMORY = ("GiB", "MiB", "bytes per value")
_FRACTION = ("fraction", "ratio")
COMMON_TRAPS = (
    Trap(2.0, "You are off by a factor of 2: check how many copies, bytes or tails you counted."),
    Trap(0.5, "You are off by a factor of 2: check how many copies, bytes or tails you counted."),
    Trap(1024.0, "You are off by a factor of 1,024: a unit slipped (MiB against GiB, or KiB against MiB).", _MEMORY),
    Trap(1 / 1024, "You are off by a factor of 1,024: a unit slipped (MiB against GiB, or KiB against MiB).", _MEMORY),
    Trap(GIB / 1e9, "You are about 7% high: that is GB (10⁹ bytes) against GiB (2³⁰ bytes); the book uses GiB.",
         _MEMORY),
    Trap(1e9 / GIB, "You are about 7% low: that is GB (10⁹ bytes) against GiB (2³⁰ bytes); check the divisor.",
         _MEMORY),
    Trap(8.0, "You are off by a factor of 8: bits against bytes?", _MEMORY),
    Trap(1 / 8, "You are off by a factor of 8: bits against bytes?", _MEMORY),
    Trap(100.0, "You are off by a factor of 100: a percentage where a fraction is asked?", _FRACTION),
)


@dataclass(frozen=True)
class Exercise:
    """One checkable number: what is asked (with its unit), how the book computes it, how close counts.

    Not used in a chapter's code (``EXERCISES`` holds one per checkable exercise).
    """

    key: str
    question: str
    unit: str
    compute: Callable[..., float]
    hint: str
    rtol: float = 0.02
    integer: bool = False
    traps: tuple[tuple[Callable[..., float], str], ...] = ()
    defaults: dict[str, float] = field(default_factory=dict)

    def reference(self, **inputs: float) -> float:
        unknown = set(inputs) - set(self.defaults)
        if unknown:
            accepted = ", ".join(sorted(self.defaults)) or "none"
            raise ValueError(f"exercise {self.key} takes no input {sorted(unknown)}; accepted inputs: {accepted}")
        return float(self.compute(**{**self.defaults, **inputs}))


def _e(key, question, unit, compute, hint, **kw) -> Exercise:
    return Exercise(key, question, unit, compute, hint, **kw)


EXERCISES: dict[str, Exercise] = {e.key: e for e in [
    # chapter 1
    _e("1.1", "factor by which the activation bar grows from batch 4 to batch 8", "times",
       lambda old=4, new=8: new / old,
       "Every tensor saved for backward has the batch as one of its dimensions.",
       rtol=0.05, defaults={"old": 4, "new": 8}),
    _e("1.2", "per-layer saved bytes with 12 layers divided by those with 24 layers", "ratio",
       lambda: 1.0,
       "`saved_per_layer` reports one layer's bytes; ask what in that layer depends on how many layers follow it.",
       rtol=0.001),
    _e("1.3", "one copy of the 1.3B model's weights in fp16", "GiB",
       lambda: _polyglot()["params"] * 2 / GIB,
       "Parameters times 2 bytes, divided by 2³⁰.", rtol=0.02),
    _e("1.4", "the 34·s·b·h bytes of 16-bit activations over all 24 layers at s = 256, b = 16 (1.3B model)", "GiB",
       lambda s=256, b=16: 34 * s * b * _polyglot()["hidden"] * _polyglot()["layers"] / GIB,
       "34·s·b·h is already in bytes for one layer (h = 2048); multiply by the layers, divide by 2³⁰.",
       rtol=0.03, defaults={"s": 256, "b": 16}),
    # chapter 2
    _e("2.1", "factor by which per-tensor absmax's step (its scale) shrinks when the outliers go from 50 to 5", "times",
       _outlier_step_shrink,
       "The step is the largest magnitude divided by 127; what is the largest magnitude once the outliers are 5?",
       rtol=0.03,
       traps=((lambda r: r * r, "That is the factor for the mean squared error, which goes with the step squared; "
                                "the question asks for the step."),)),
    _e("2.2", "scale bytes per stored value with blocks of 8 and one fp32 scale per block", "bytes per value",
       lambda block=8: 4 / block,
       "An fp32 scale is 4 bytes, shared by every value of its block.", rtol=0.01, defaults={"block": 8}),
    _e("2.3", "relative error of A·B when A and B are rounded to fp8 e4m3 first", "fraction",
       _e4m3_product_error,
       "One element's rounding error is at most 2⁻⁴ of it, often less; in a sum of many products the errors "
       "partly cancel, so the product's relative error is near the elements' typical (RMS) error, not the worst "
       "case.",
       rtol=0.15,
       traps=((lambda r: 2**-3, "2⁻³ is twice the worst case of one element; measure the product instead."),
              (lambda r: 2**-4, "2⁻⁴ is the worst case of one element; the product's error is an average, "
                                "smaller than that."))),
    _e("2.4", "tokens per ordinary input column (N(0, 1), 4,096 tokens) whose magnitude reaches threshold 3",
       "tokens per column",
       lambda tokens=4096, threshold=3.0: tokens * math.erfc(threshold / math.sqrt(2)),
       "P(|z| ≥ 3) for a standard normal, both tails, times the number of tokens.",
       rtol=0.05, defaults={"tokens": 4096, "threshold": 3.0}),
    # chapter 3
    _e("3.2", "share of a 1.3B-model layer's activation bytes that eager attention's s × s matrices take at s = 256",
       "fraction",
       lambda a=16, s=256, h=2048: 5 * a * s / (34 * h + 5 * a * s),
       "Per layer and sample, 34·s·h bytes plus 5·a·s² for the s × s matrices; divide the second by the sum "
       "(the s of one factor cancels).",
       rtol=0.03, defaults={"a": 16, "s": 256, "h": 2048}),
    # chapter 4
    _e("4.1a", "the best checkpoint interval k for N = 256 layers", "layers",
       lambda n_layers=256: _checkpoint_best(int(n_layers))[0],
       "Minimise N/k + k.", integer=True, defaults={"n_layers": 256}),
    _e("4.1b", "layer outputs stored at that best k for N = 256", "layer outputs",
       lambda n_layers=256: _checkpoint_best(int(n_layers))[1],
       "N/k checkpoints plus the k outputs of the segment being recomputed.", integer=True,
       defaults={"n_layers": 256}),
    _e("4.1c", "layer forwards that strategy (b) computes for N = 256", "layer forwards",
       lambda n_layers=256: int(n_layers) * (int(n_layers) + 1) // 2,
       "For layer i, (b) runs layers 1 … i again: add that up over all layers.", integer=True,
       defaults={"n_layers": 256}),
    _e("4.3", "time overhead of checkpointing every other block, as a fraction of a plain step, GPU-bound", "fraction",
       lambda share=0.5: share * 1 / (1 + 2),
       "A plain step is one forward and a backward of twice its cost; recomputation re-runs the checkpointed "
       "blocks' forward once.",
       rtol=0.05, defaults={"share": 0.5}),
    # chapter 8
    _e("8.3", "bytes of GPU memory one leaked scalar loss keeps after its backward pass", "bytes",
       lambda: 512,
       "A 0-dimensional fp32 tensor holds 4 bytes, but PyTorch's caching allocator hands out no block smaller "
       "than its minimum size.", integer=True),
    # chapter 6
    _e("6.1", "trainable LoRA parameters of the whole 1.3B model with all four linear layers adapted", "parameters",
       lambda r=8: 16 * r * _polyglot()["hidden"] * _polyglot()["layers"],
       "Per block r·(d_in + d_out) for each adapted layer: d→3d, d→d, d→4d and 4d→d; then all 24 blocks.",
       rtol=0.001, defaults={"r": 8},
       traps=((lambda r: r / _polyglot()["layers"], "That is one block; the question asks for all of them."),
              (lambda r: r * 6 / 16, "That is the two attention layers only: add the MLP's two."))),
    _e("6.2", "growth of the 4-bit weights without double quantization", "MiB",
       lambda: _polyglot()["quantized_linear"] * (32 / 64 - 8 / 64 - 32 / (64 * 256)) / 8 / MIB,
       "Bits saved per quantized weight times the weights of the quantized linear layers (not the embeddings "
       "or the output head), then bits to bytes to MiB.",
       rtol=0.03,
       traps=((lambda r: r * _polyglot()["params"] / _polyglot()["quantized_linear"],
               "Close, but you counted every parameter: the embeddings and the output head are not quantized."),)),
    # chapter 7
    _e("7.1", "peak growth of DDP without bucket views on the 1.3B model: one copy of the fp32 gradients", "GiB",
       lambda: 4 * _polyglot()["params"] / GIB,
       "4 bytes per parameter, divided by 2³⁰.", rtol=0.02),
    _e("7.2", "bf16 copies of the weights that autocast keeps under DDP, 1.3B model", "GiB",
       lambda: 2 * _polyglot()["params"] / GIB,
       "One 16-bit copy of every weight.", rtol=0.02),
    _e("7.3", "GPipe bubble fraction with p = 4 stages and m = 8 micro-batches when t_b = t_f", "fraction",
       lambda p=4, m=8: (p - 1) / (m + p - 1),
       "Count the fill and drain slots against the whole schedule.", rtol=0.01, defaults={"p": 4, "m": 8}),
    _e("7.4a", "GPUs ZeRO-3 needs to hold the 7.5B model's states in 14.75 GiB each", "GPUs",
       lambda: _zero_gpus(3), "(2 + 2 + K)·Ψ / N_d must fit; GPUs come whole, so round up.", integer=True),
    _e("7.4b", "GPUs ZeRO-2 needs for the same", "GPUs",
       lambda: _zero_gpus(2), "The 2Ψ of 16-bit weights is not sharded: subtract it from each GPU's budget first.",
       integer=True),
]}


# ----- grading ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Grade:
    """The verdict on one answer: ``"right"``, ``"close"`` or ``"wrong"``, and the message shown to the reader.

    Not used in a chapter's code (``grade`` returns it, ``check`` prints its message).
    """

    key: str
    verdict: str
    message: str

    @property
    def ok(self) -> bool:
        return self.verdict == "right"


def _normalise(key: str) -> str:
    k = str(key).strip().lower().removeprefix("ch").removeprefix("exercise").strip(" .")
    chapter, _, rest = k.partition(".")
    return f"{int(chapter)}.{rest}" if chapter.isdigit() and rest else k


def _exercise(key: str) -> Exercise:
    k = _normalise(key)
    if k not in EXERCISES:
        raise ValueError(f"no checkable exercise {key!r}; accepted: {', '.join(EXERCISES)}")
    return EXERCISES[k]


def keys() -> list[str]:
    """The exercises that can be checked, as ``"chapter.number"``.

    Not used in a chapter's code (the exercises name it).
    """
    return list(EXERCISES)


def question(key: str) -> str:
    """What number exercise ``key`` asks for, with its unit.

    Not used in a chapter's code (the exercises name it).
    """
    ex = _exercise(key)
    return f"{ex.key}: {ex.question} (in {ex.unit})"


def _tol(rtol: float) -> str:
    return f"±{rtol:.0%}" if rtol >= 0.01 else f"±{rtol:.1%}"


def _near(value: float, target: float, rtol: float) -> bool:
    return abs(value - target) <= rtol * abs(target) if target else abs(value) <= rtol


def grade(key: str, answer: float, **inputs: float) -> Grade:
    """Grade ``answer`` to exercise ``key`` against the book's computed value; returns a ``Grade``, prints nothing.

    Not used in a chapter's code (the exercises name ``check``, which prints this grade).
    """
    ex = _exercise(key)
    try:
        value = float(answer)
    except (TypeError, ValueError):
        raise ValueError(f"exercise {ex.key} wants a number (in {ex.unit}), not {answer!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"exercise {ex.key} wants a finite number (in {ex.unit}), not {answer!r}")
    ref = ex.reference(**inputs)
    head = f"{ex.key} — {ex.question}"
    if ex.integer:
        if value == round(ref):
            return Grade(ex.key, "right", f"✓ {ex.key} — right (exactly). Well done.")
        if abs(value - ref) <= 1:
            return Grade(ex.key, "close", f"≈ {head}: close, one off. {ex.hint}")
        side = "too high" if value > ref else "too low"
        return Grade(ex.key, "wrong", f"✗ {head}: not yet, {side}. Hint: {ex.hint}")
    if _near(value, ref, ex.rtol):
        return Grade(ex.key, "right", f"✓ {ex.key} — right (within {_tol(ex.rtol)} of the book's value). Well done.")
    for wrong, nudge in ex.traps:
        if _near(value, wrong(ref), min(ex.rtol, 0.02)):
            return Grade(ex.key, "wrong", f"✗ {head}: not yet. {nudge}")
    for trap in COMMON_TRAPS:
        if (not trap.units or ex.unit in trap.units) and _near(value, ref * trap.factor, min(ex.rtol, 0.02)):
            return Grade(ex.key, "wrong", f"✗ {head}: not yet. {trap.nudge}")
    if _near(value, ref, max(3 * ex.rtol, 0.1)):
        return Grade(ex.key, "close", f"≈ {head}: close, but outside {_tol(ex.rtol)}. Check a rounding or a "
                                      f"count. Hint: {ex.hint}")
    side = "too high" if value > ref else "too low"
    return Grade(ex.key, "wrong", f"✗ {head}: not yet, {side}. Hint: {ex.hint}")


def check(key: str, answer: float, **inputs: float) -> None:
    """Print whether ``answer`` to exercise ``key`` is right, close or wrong, with a nudge (never the answer).

    Not used in a chapter's code: an exercise names the line to run, e.g. ``exercises.check("2.2", 0.5)``.
    Inputs the exercise lets you change go as keywords: ``exercises.check("6.1", answer, r=16)``.
    """
    print(grade(key, answer, **inputs).message)
