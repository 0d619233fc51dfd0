"""CPU tests of chapter 7's and chapter 10's rendered-sentence functions, fed fabricated GPU results.

The functions live in the chapters' hidden cells; these tests execute those cells' definitions (from the jupytext
twins) and call every branch with made-up ``timing`` objects, so that a GPU-only branch cannot first fail on a GPU.
"""

import random
import statistics
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from helpers import estimates, prose, timing

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def _definitions(twin: str, markers: tuple[str, ...], ns: dict) -> dict:
    cells = (NOTEBOOKS / twin).read_text().split("# %%")
    for marker in markers:
        (cell,) = [c for c in cells if marker in c]
        exec(cell.split("\n", 1)[1].split("\nif prof.on_gpu")[0], ns)
    return ns


def _samples(rng, median, spread=0.002):
    return tuple(median + rng.gauss(0, spread) for _ in range(10))


@pytest.fixture
def ch7():
    ns = dict(timing=timing, estimates=estimates, prose=prose, statistics=statistics, pd=pd)
    return _definitions("07_distributed_zero.py",
                        ("def launch_words", "def scaling_sentence", "def growth_attribution"), ns)


def _ch7_inputs(medians):
    rng = random.Random(0)
    samples = {}
    for st, (m1, m2) in medians.items():
        samples[(1, st)], samples[(2, st)] = _samples(rng, m1), _samples(rng, m2)
    scale = {st: timing.unpaired(samples[(1, st)], samples[(2, st)]) for st in estimates.STAGES}
    overlap = pd.DataFrame({"exposed (ms)": [1.5, 18.1, 10.8, 21.9],
                            "traced step, first to last kernel (ms)": [250, 260, 255, 298.7]},
                           index=[estimates.COMM_LABELS[s] for s in estimates.STAGES])
    return samples, scale, overlap


def test_ch7_sentences_every_branch(ch7):
    samples, scale, overlap = _ch7_inputs({"ddp": (0.23, 0.25), "zero1": (0.23, 0.24), "zero2": (0.24, 0.24),
                                           "zero3": (0.26, 0.25)})
    text = ch7["scaling_sentence"](scale)
    assert "(DDP)" in text and "(ZeRO-3)" in text and "separate launches" in text
    assert "No engine's step on two GPUs is longer" in text and "(P_os" not in text
    growth = ch7["growth_attribution"](samples, overlap)
    assert "| DDP | " in growth and growth.count("\n| ") == 4 and "| engine |" in growth
    assert "for DDP the exposed communication lies below" in growth and "](../" not in growth
    assert len(growth.split("\n\n")[-1].split(". ")) == 1  # the table and one sentence

    samples, scale, overlap = _ch7_inputs({st: (0.23, 0.30) for st in estimates.STAGES})
    assert "For all four engines the step on two GPUs is longer" in ch7["scaling_sentence"](scale)
    samples, scale, overlap = _ch7_inputs({"ddp": (0.23, 0.23), "zero1": (0.30, 0.23), "zero2": (0.24, 0.24),
                                           "zero3": (0.26, 0.25)})
    text = ch7["scaling_sentence"](scale)
    assert "beyond even the 10% margin" in text and "includes 100%" in text
    assert "lies above the whole range" in ch7["growth_attribution"](samples, overlap)
    samples, scale, overlap = _ch7_inputs({st: (0.23, 0.2301) for st in estimates.STAGES})
    overlap["exposed (ms)"] = 0.1  # inside every range: the sentence without an attribution
    growth = ch7["growth_attribution"](samples, overlap)
    assert growth.endswith("ms here).") and "lies" not in growth
    assert ch7["launch_words"]("slower", "than DDP").startswith("slower than DDP beyond the 10% margin")
    assert ch7["launch_words"](timing.NO_DIFFERENCE).startswith("no difference beyond the 10% margin")


def _timed(rng, ms, busy):
    wall = tuple(ms / 1e3 * (1 + rng.gauss(0, 0.01)) for _ in range(10))
    return timing.Timed(wall_s=wall, host_s=tuple(x * 0.5 for x in wall), gpu_s=wall, gpu_busy=busy,
                        kernels_per_call=3000, device="cuda", kernel_s=ms / 1e3 * busy)


def _ladder(rng, busy0, kept):
    labels = ["0 vanilla: fp32, eager, AdamW for-loop", "1 + batch 32", "2 + bf16 autocast", "3 + SDPA attention",
              "4 + fused AdamW", "5 + batch 64 (the largest tried)",
              "6 + torch.compile (regional)" + ("" if kept else ", not kept")]
    ts = [_timed(rng, ms, b) for ms, b in ((150, busy0), (900, 0.97), (890, 0.97), (250, 0.85), (200, 0.95),
                                             (380, 0.98), (300, 0.99))]
    speedups = [None, 1.3, 1.01, 3.5, 1.25, 1.05, 1.27 if kept else 1.01]
    comps = {}
    for i in range(1, 7):
        r = tuple(speedups[i] * (1 + rng.gauss(0, 0.01)) for _ in range(10))
        comps[labels[i]] = timing.Comparison("rung before", "this rung", ts[i - 1], ts[i], r, r)
    table = pd.DataFrame({label: {"batch": b, "tokens/s": 1000.0 * (i + 1), "MFU vs datasheet (%)": 3.0 + 6 * i,
                                  "MFU vs matmul ceiling (%)": 4.0 + 7 * i, "MFU, 6N only (%)": 2.5 + 5 * i,
                                  "MFU, causal attention at half (%)": 2.8 + 5 * i,
                                  "GPU-time speed-up per sample": np.nan if i == 0 else 1.1 * i}
                          for i, (label, b) in enumerate(zip(labels, [4, 32, 32, 32, 32, 64, 64], strict=True))}).T
    notes = {"model": "bert-large-uncased", "vanilla": ts[0], "comparisons": comps, "ladder_batch": 32,
             "compile": {"kept": kept, "first_step_s": 14.2, "comparison": comps[labels[6]]}}
    return labels, table, dict(zip(labels, ts, strict=True)), notes


def test_ch10_ladder_sentences_every_branch():
    ns = dict(np=np, pd=pd, prose=prose, timing=timing,
              LADDER={"bert-large-uncased": dict(head="sequence-classification")})
    _definitions("10_capstone.py", ("def ladder_sentences",), ns)
    rng = random.Random(1)
    labels, table, timed, notes = _ladder(rng, 0.76, kept=True)
    text = ns["ladder_sentences"]("bert-large", table, timed, notes, labels[6], 35)
    assert "keeps the GPU busy only 76%" in text and "µs each" in text and "it is kept." in text
    assert "this process had compiled nothing before" in text
    notes["compile"] = {**notes["compile"], "compiled_before": ["bert-large-uncased"]}
    again = ns["ladder_sentences"]("x", table, timed, notes, labels[6], 45)
    assert "this process compiled bert-large-uncased's layers before, and Inductor may reuse" in again
    assert "short of the 10 times" in text  # the products of the interval ends lie below 10
    assert text.count("*+ SDPA attention*") == 2  # once in the rung list, once among the rungs below 90% busy
    assert "7.0 times as many" in text and "timed on its own" in text
    labels, table, timed, notes = _ladder(rng, 0.98, kept=False)
    text = ns["ladder_sentences"]("bert-large", table, timed, notes, labels[5], 35)
    assert "already keeps the GPU busy" in text and "it is not kept." in text
    notes["compile"] = "skipped: 10 s of the chapter's time budget left"
    assert ns["ladder_sentences"]("x", table, timed, notes, labels[5], 35).endswith("time budget left.")
    notes["comparisons"] = {}
    text = ns["ladder_sentences"]("x", table.iloc[:1], {labels[0]: timed[labels[0]]}, notes, labels[0], 35)
    assert "Both sides of every judged rung" not in text and "Rung by rung" in text
    assert "Rung 1's batch of 32 did not fit this GPU" in text
    assert ns["climb_product"]({}, labels[0]) == (1.0, 1.0, 1.0)


def test_budget_charges_computing_time_only():
    """timing.Budget (chapters 9 and 10): charged blocks count, nested ones once; time between cells does not."""
    import time

    budget = timing.Budget(100.0)
    time.sleep(0.05)  # a reader between cells: not charged
    assert budget.seconds_left() == 100.0
    with budget.charged():
        time.sleep(0.05)
        with budget.charged():  # nested: counted once, by the outer block
            time.sleep(0.05)
        inside = budget.seconds_left()
        assert 99.85 < inside <= 99.9  # the running block counts while it runs
    assert 0.1 <= budget.spent_s < 0.15 and budget._since is None
    with pytest.raises(RuntimeError), budget.charged():
        raise RuntimeError("a failing experiment is charged too")
    assert budget._since is None and budget.spent_s >= 0.1
    with pytest.raises(ValueError):
        timing.Budget(-1)
    src = (NOTEBOOKS / "09_fast_path.py").read_text() + (NOTEBOOKS / "10_capstone.py").read_text()
    assert src.count("timing.Budget(") == 2 and "spent_s +=" not in src  # both chapters use the one budget


def _cell(twin: str, marker: str) -> str:
    cells = (NOTEBOOKS / twin).read_text().split("# %%")
    (cell,) = [c for c in cells if marker in c]
    return cell.split("\n", 1)[1]


def _comparison(measured_rows, factor=1.02):
    """Chapter 10's comparison cells (error summary, figure, sentences) run on CPU over fabricated peaks.

    ``measured_rows``: the validation rows (1-based) given a measured peak of ``factor`` x the prediction; the
    others stay unmeasured (NaN), as when a run failed or the budget ran out.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from helpers import plan

    shown = []
    setups = plan.VALIDATION_SETUPS
    rows = {}
    for i, s in enumerate(setups, 1):
        p = plan.predict(s)
        row = {"setup": s.label(), "predicted peak (GiB)": p.peak_gib, "predicted phase": p.peak_phase,
               "measured peak (GiB)": p.peak_gib * (factor + 0.001 * (i % 3)) if i in measured_rows else np.nan,
               "measured phase": p.peak_phase if i in measured_rows else "not measured (CPU)"}
        for name, b in plan.baselines(s).items():
            row[f"{name} (GiB)"] = b / plan.GIB
        rows[i] = row
    validation = pd.DataFrame(rows).T.rename_axis("#")
    gib_cols = [c for c in validation.columns if c.endswith("(GiB)")]
    validation[gib_cols] = validation[gib_cols].astype(float)
    validation["planner error (%)"] = (validation["predicted peak (GiB)"] / validation["measured peak (GiB)"] - 1) * 100
    ns = dict(np=np, pd=pd, plt=plt, plan=plan, validation=validation, validation_setups=setups,
              prof=type("P", (), {"on_gpu": True})(), display=shown.append, Markdown=lambda s: s,
              heldout_summary={"measured": 0}, planner_heldout_median_err_pct=float("nan"),
              planner_heldout_max_err_pct=float("nan"))
    for marker in ("BASELINES = [c[", "fig, ax = plt.subplots(figsize=(10, 6.5))", "def domain_words"):
        exec(_cell("10_capstone.py", marker), ns)  # noqa: S102
    ns["title"] = ns["ax"].get_title()
    plt.close("all")
    return ns, shown


def test_ch10_comparison_with_the_playbook_every_branch():
    from helpers import plan

    everything = set(range(1, 36))
    ns, shown = _comparison(everything)
    sm = ns["error_summary"]
    assert list(ns["BASELINES"]) == list(plan.BASELINE_NAMES) and plan.PLAYBOOK in sm.index
    # each estimator judged on the rows of its own domain: the seven mixed-precision AdamW rows
    assert (sm[ns["DOMAIN_ROWS"]] == 7).all()
    rows = [5, 6, 7, 18, 19, 20, 29]
    v = ns["validation"]
    want = ((v.loc[rows, f"{plan.PLAYBOOK} (GiB)"] / v.loc[rows, "measured peak (GiB)"] - 1) * 100).abs()
    assert sm.loc[plan.PLAYBOOK, ns["DOMAIN_MEDIAN"]] == pytest.approx(want.median())
    assert sm.loc[plan.PLAYBOOK, ns["DOMAIN_MAX"]] == pytest.approx(want.max())
    (text,) = shown
    assert f"- **{plan.PLAYBOOK}**: median |error|" in text
    assert "its m_act as printed" in text and text.count("on the 7 measured rows of the domain it claims") == 5
    assert "the planner is off by a median of" in text and "(full-parameter mixed-precision AdamW on one GPU" in text
    assert "on the 7 rows of their domain the other 5 estimators by" in ns["title"]
    assert ns["ax"].get_legend_handles_labels()[1][-6:-1] == list(plan.BASELINE_NAMES)
    # one measured row in the domain, and none
    ns, (text,) = _comparison({1, 2, 3, 5})
    assert text.count("on the 1 measured row of the domain it claims") == 5
    ns, (text,) = _comparison({1, 2, 3, 4})
    assert text.count("none of the measured rows lies in the domain it claims") == 5 and "nan%" not in text
    assert (ns["error_summary"][ns["DOMAIN_ROWS"]] == 0).all()
    assert ns["title"].endswith("no measured row lies in the other estimators' domain") and "nan" not in ns["title"]
    # too few measured rows: no sentences
    ns, shown = _comparison({1, 2})
    assert shown == []
