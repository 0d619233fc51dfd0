"""The rendered speed sentences of chapters 2-6, called on a CPU with fabricated comparisons.

The chapters build each sentence that quotes a speed comparison in a small function defined in a hidden cell.
On a CPU those cells' GPU branches never run, so a crash there would surface only on the GPU run; these tests
load the functions from the chapters' text twins and call every branch with fabricated ``timing.Comparison``
and ``timing.Timed`` objects.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pandas as pd

from helpers import prose, timing

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def chapter_functions(stem: str, *names: str, **namespace: object) -> dict[str, object]:
    """The top-level functions ``names`` of ``notebooks/<stem>.py``, executed in ``namespace``."""
    lines = (NOTEBOOKS / f"{stem}.py").read_text().split("\n")
    src = "\n".join(re.sub(r"^(\s*)# %(pip|%).*", r"\1pass", line) for line in lines)
    tree = ast.parse(src)
    found = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in names}
    missing = set(names) - set(found)
    assert not missing, f"{stem} defines no function {missing}"
    ns: dict[str, object] = {"timing": timing, "prose": prose, "pd": pd, **namespace}
    exec(compile(ast.Module(body=list(found.values()), type_ignores=[]), stem, "exec"), ns)  # noqa: S102
    return {name: ns[name] for name in names}


def timed(ms: float, *, busy: float | None = 0.95, kernels: int | None = 500, host_share: float = 0.3,
          n: int = 15) -> timing.Timed:
    wall = tuple(ms / 1e3 * (1 + 0.002 * (i - n // 2)) for i in range(n))
    return timing.Timed(wall_s=wall, host_s=tuple(w * host_share for w in wall), gpu_s=wall, gpu_busy=busy,
                        kernels_per_call=kernels, device="cuda", kernel_s=ms / 1e3 * (busy or 0.5))


def comparison(speedup: float, *, names: tuple[str, str] = ("baseline", "candidate"), a_ms: float = 10.0,
               spread: float = 0.01, busy_a: float | None = 0.95, busy_b: float | None = 0.95,
               kernels: int | None = 500, host_share: float = 0.3) -> timing.Comparison:
    """A comparison whose per-round speed-ups spread ``spread`` around ``speedup``."""
    ratios = tuple(speedup * (1 + spread * (i - 7) / 7) for i in range(15))
    return timing.Comparison(names[0], names[1], timed(a_ms, busy=busy_a, kernels=kernels, host_share=host_share),
                             timed(a_ms / speedup, busy=busy_b, kernels=kernels, host_share=host_share),
                             ratios, ratios)


def test_fabricated_comparisons_give_each_verdict():
    assert comparison(1.5).verdict == "faster"
    assert comparison(0.5).verdict == "slower"
    assert comparison(1.0).verdict == timing.NO_DIFFERENCE


# --- chapter 2 -----------------------------------------------------------------------------------------------
def test_ch02_quantile_time_and_layer_speed():
    f = chapter_functions("02_dtypes_quantization", "times", "times_as_long", "layer_speed_sentence")
    slow = comparison(1 / 758, names=("absmax", "quantile"))
    assert "758 times as long as absmax" in f["times_as_long"](slow)
    assert "about as long as absmax" in f["times_as_long"](comparison(1.0, names=("absmax", "quantile")))
    cmps = {name: comparison(r, names=("bf16", name)) for name, r in
            [("LLM.int8(), threshold 6", 1 / 2.6), ("NF4", 1 / 1.23), ("FP4", 1.0)]}
    text = f["layer_speed_sentence"](cmps, "bf16", 4096, 4096)
    assert "LLM.int8(), threshold 6 takes 2.60 times as long as bf16 (95% interval" in text and "NF4 takes 1.23 times" in text
    assert "GPU-bound" in text and "kernels' own costs" in text
    cmps["NF4"] = comparison(1.0, names=("bf16", "NF4"))
    assert "NF4 against bf16: 1.00×, no difference beyond the noise" in f["layer_speed_sentence"](cmps, "bf16", 64, 256)


# --- chapter 3 -----------------------------------------------------------------------------------------------
def test_ch03_flat_curve_is_host_time():
    f = chapter_functions("03_batch_size_grad_accumulation", "flat_sentence")["flat_sentence"]
    host_bound = comparison(1 / 1.1, names=("batch 1", "batch 4"), busy_a=0.3, host_share=0.95)
    text = f(host_bound)
    assert "took 1.10 times batch 1's time" in text and "ride on kernels" in text and "µs per GPU operation" in text
    gpu_bound = comparison(1 / 3.9, names=("batch 1", "batch 4"), spread=0.02)
    assert "the GPU was the limit already at batch 1" in f(gpu_bound)
    no_profile = comparison(1.0, names=("batch 1", "batch 4"), kernels=None)
    assert "µs" not in f(no_profile)


def test_ch03_accumulation_and_trainer():
    f = chapter_functions("03_batch_size_grad_accumulation", "accumulated_vs_large", "guide_row", "trainer_sentence")
    busy = comparison(0.9, names=("bs 16, whole card", "bs 4 x ga 4"), busy_a=0.99, busy_b=0.97)
    assert "the GPU is not waiting" in f["accumulated_vs_large"](busy)
    waits = comparison(0.8, names=("bs 16, whole card", "bs 4 x ga 4"), busy_a=0.99, busy_b=0.7)
    assert "waits part of the time" in f["accumulated_vs_large"](waits)
    same = comparison(1.0, names=("bs 16, whole card", "bs 4 x ga 4"))
    assert "cost what one large one does" in f["accumulated_vs_large"](same)
    slow = comparison(0.45, names=("bs 4", "bs 1 x ga 4"), busy_b=0.6, host_share=0.9)
    assert "µs of this host's time per operation" in f["guide_row"](slow, 0.9)
    assert "the reader's CPU decides" in f["guide_row"](comparison(1.0, names=("bs 4", "bs 1 x ga 4")), 0.9)
    trainer = comparison(0.47, names=("hand-written loop", "Trainer"), a_ms=430.0, busy_a=None, busy_b=None)
    text = f["trainer_sentence"](trainer, [31.9, 30.3, 33.9], 16, ", with peaks")
    assert "of the gap lies outside" in text and "0.47×, slower than the loop" in text
    assert "large enough to measure" in f["trainer_sentence"](comparison(1.0, names=("loop", "Trainer")), [30.0], 16)
    assert "faster of the two" in f["trainer_sentence"](comparison(1.2, names=("loop", "Trainer")), [30.0], 16)


def test_ch02_layer_speed_host_share():
    f = chapter_functions("02_dtypes_quantization", "layer_speed_sentence")["layer_speed_sentence"]
    cmps = {"NF4": comparison(1 / 1.2, names=("bf16", "NF4"), busy_a=0.6, host_share=0.7)}
    assert "part of these times is the host's" in f(cmps, "bf16", 64, 256)
