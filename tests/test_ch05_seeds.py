"""Chapter 5's convergence runs over seeds: the verdict rule, the rendered sentences and the seeding itself.

Sections 5.1 and 5.4 train a small model once per seed and setting, and call a difference only when it holds across
seeds. The functions live in the chapter (its text twin); these tests load them and call every branch with
fabricated loss curves, so that a branch the committed GPU run did not take cannot first fail on a GPU. The last
test trains the chapter's own loop twice on the CPU and checks that one seed gives one run, to the bit.
"""

from __future__ import annotations

import ast
import itertools
import math
import re
from pathlib import Path

import matplotlib
import pandas as pd
import pytest
import torch

from helpers import data, models, prose

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STEM = "05_mixed_precision_optimizers"
NAMES = ("learned_at", "outcome", "seed_table", "versus", "seeds_text", "scaler_text", "repeat_runs_text",
         "plot_seeds", "adamw", "train_seed")
HORIZON = 60


def chapter(namespace: dict | None = None) -> dict:
    """The chapter's convergence functions, executed in a namespace with the names they use."""
    lines = (Path(__file__).resolve().parents[1] / "notebooks" / f"{STEM}.py").read_text().split("\n")
    src = "\n".join(re.sub(r"^(\s*)# %(pip|%).*", r"\1pass", line) for line in lines)
    found = [n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name in NAMES]
    assert {n.name for n in found} == set(NAMES), set(NAMES) - {n.name for n in found}
    ns = {"pd": pd, "math": math, "prose": prose, "plt": plt, "torch": torch, "itertools": itertools,
          "data": data, "models": models, "SEEDS": (0, 1, 2), "conv_lr": 1e-3, **(namespace or {})}
    exec(compile(ast.Module(body=found, type_ignores=[]), STEM, "exec"), ns)  # noqa: S102
    return ns


def curve(cross: int | None, *, steps: int = HORIZON, end: float = 0.002, spike: float | None = None) -> dict:
    """A fabricated run: on the plateau (0.69) until ``cross``, then down to ``end``; None never leaves it."""
    losses = [0.69] * steps
    if cross is not None:
        for i in range(cross - 5, steps):  # the five-step mean falls below 0.1 at step ``cross``
            losses[i] = end
    if spike is not None:
        losses[-10:] = [spike] * 10
    return {"losses": losses, "scales": [float("nan")] * (steps + 1)}


F = chapter()


def test_learned_at_and_outcome_on_fabricated_curves():
    assert F["learned_at"](curve(30)["losses"]) == 30
    assert math.isnan(F["learned_at"](curve(None)["losses"]))
    assert F["outcome"](curve(30)["losses"]) == "learned"
    assert F["outcome"](curve(None)["losses"]) == "never"
    assert F["outcome"](curve(30, spike=0.6)["losses"]) == "diverged"
    assert F["outcome"](curve(30, spike=0.2)["losses"]) == "unsettled"


@pytest.mark.parametrize(("ref", "cand", "verdict"), [
    ([25, 28, 31], [26, 30, 27], "no difference across seeds"),  # overlapping seeds
    ([25, 28, 31], [33, 34, 35], "no difference across seeds"),  # beyond every seed, but by less than the spread
    ([25, 26, 27], [40, 41, 45], "later"),  # beyond every seed, by more than the spread
    ([40, 41, 45], [25, 26, 27], "earlier"),
    ([25, 26, 27], [float("nan")] * 3, "later"),  # never crossed in any seed
    ([float("nan")] * 3, [float("nan")] * 3, "no difference across seeds"),
    ([25, 26, 27], [26, float("nan"), float("nan")], "no difference across seeds"),  # one seed crossed early
])
def test_versus_calls_a_difference_only_across_seeds(ref, cand, verdict):
    assert F["versus"](ref, cand, HORIZON) == verdict


def test_versus_takes_the_experiments_widest_spread():
    assert F["versus"]([25, 26, 27], [33, 34, 35], HORIZON) == "later"
    assert F["versus"]([25, 26, 27], [33, 34, 35], HORIZON, spread=10) == "no difference across seeds"


def test_versus_needs_three_seeds():
    with pytest.raises(ValueError, match="at least 3 seeds"):
        F["versus"]([25, 26], [27, 28], HORIZON)


def test_seeds_text_every_branch():
    alike = {"fp32": [curve(25), curve(28), curve(31)], "bf16": [curve(27), curve(26), curve(30)],
             "fp16": [curve(24), curve(29), curve(31)]}
    text = F["seeds_text"](alike, "fp32", HORIZON, "precision")
    assert "fp32 3 of 3 (first below 0.1 at steps 25–31)" in text
    assert "bf16 and fp16 against fp32: no difference across seeds" in text
    assert "spread over up to 7 steps" in text and "did not change what the model learned" in text
    assert "median first crossings at most 1 step from fp32's" in text
    same = {"fp32": alike["fp32"], "bf16": alike["fp32"], "fp16": alike["fp32"]}
    assert "the same median first crossing as fp32's" in F["seeds_text"](same, "fp32", HORIZON, "precision")

    later = alike | {"tf32": [curve(50), curve(52), curve(55)], "bf16": [curve(None)] * 3}
    text = F["seeds_text"](later, "fp32", HORIZON, "precision")
    assert "bf16 did not leave the plateau in any seed, while fp32 learned in 3 of 3" in text
    assert "tf32 crossed 0.1 later than fp32 in every seed, by 24 steps (tf32) at the median" in text
    assert "did not change" not in text

    earlier = {"ref": [curve(50), curve(52), curve(55)], "new": [curve(20), curve(21), curve(22)]}
    assert "new crossed 0.1 earlier than ref in every seed" in F["seeds_text"](earlier, "ref", HORIZON, "optimizer")

    partial = alike | {"bf16": [curve(27), curve(None), curve(30, spike=0.2)]}
    text = F["seeds_text"](partial, "fp32", HORIZON, "precision")
    assert "bf16 learned in some seeds and not in others (bf16: learned, never, unsettled)" in text
    assert "not evidence that the precision learns worse" in text and "did not change" not in text
    assert "bf16 1 of 3 (first below 0.1 at steps 27–30)" in text


def test_seeds_text_never_uses_the_speed_verdict_words():
    """The convergence sentences must not add speed verdicts that scripts/verdicts.py would track."""
    verdicts = re.compile(r"(?<![\w-])(faster|slower|mixed|host-bound|GPU-bound|within the noise)(?![\w-])")
    runs = {"fp32": [curve(25), curve(28), curve(31)], "bf16": [curve(None)] * 3, "fp16": [curve(50)] * 3,
            "tf32": [curve(27), curve(None), curve(30)]}
    assert not verdicts.search(F["seeds_text"](runs, "fp32", HORIZON, "precision"))


def test_scaler_text_with_and_without_changes():
    still = [{"losses": [], "scales": [65536.0] * 61} for _ in range(3)]
    text = F["scaler_text"](still, 60)
    assert "never changed its scale in any of the 3 runs" in text and "65,536 (2^16)" in text
    moved = [{"losses": [], "scales": [65536.0, 32768.0] + [32768.0] * 59}, *still[1:]]
    text = F["scaler_text"](moved, 60)
    assert "halved its scale 1 times in all" in text and "ended at 32,768, 65,536, 65,536" in text


def test_repeat_runs_text_identical_and_not():
    first = [curve(25), curve(28), curve(31)]
    assert "identical to the bit" in F["repeat_runs_text"](first, first, "section 5.1's bf16 runs")
    again = [curve(25, end=0.003), curve(28), curve(31)]
    text = F["repeat_runs_text"](first, again, "section 5.1's bf16 runs")
    assert "differ by up to 0.001 nats" in text and "were the same for every seed" in text
    text = F["repeat_runs_text"](first, [curve(None), curve(28), curve(31)], "section 5.1's bf16 runs")
    assert "differed (learned, learned, learned there; never, learned, learned here)" in text


def test_seed_table_and_plot():
    runs = {"fp32": [curve(25), curve(28), curve(31)], "bf16": [curve(27), curve(None), curve(30)]}
    table = F["seed_table"](runs)
    assert table.loc["fp32", "seeds learned"] == "3 of 3" and table.loc["bf16", "seeds learned"] == "2 of 3"
    assert table.loc["bf16", "loss < 0.1 from step, per seed"] == "27, never, 30"
    assert table.loc["bf16", "range of those steps"] == "27–30"
    fig = F["plot_seeds"](runs | {"fp16": runs["fp32"], "tf32": runs["fp32"]}, "title", ncols=3)  # 2 x 3, one hidden
    assert sum(ax.get_visible() for ax in fig.axes) == 4
    plt.close(fig)


def test_one_seed_gives_one_run_on_the_cpu():
    """The chapter's own loop, twice per seed: seeded weights, batch order and dropout make the runs identical."""
    steps = 4
    ns = chapter({"dev": "cpu", "CONV_MODEL": {}, "conv_batch": 4, "conv_steps": steps, "conv_warmup": 2,
                  "conv_lr": 1e-3, "ds_conv": data.keyword_dataset(steps * 4, 16, seed=2)})

    def run(seed):
        return ns["train_seed"](seed)["losses"]

    torch.manual_seed(123)  # whatever state the notebook left: the run must not depend on it
    first = run(0)
    torch.rand(1000)
    assert run(0) == first
    assert run(1) != first  # another seed, another run
