"""Chapter 9's rendered sentences, on CPU, from fabricated comparisons: every branch of every sentence function.

The functions live in the chapter's text twin (``notebooks/09_fast_path.py``); they run on a GPU only, so a crash
in one would be found only there. Here they are read from the twin with ``ast`` and called with ``Comparison`` and
``Timed`` objects built by hand, in the regimes each branch is written for (GPU-bound and host-bound baselines,
faster / slower / no difference, fused attention kept or lost).
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from helpers import packing, prose, timing  # noqa: E402

TWIN = Path(__file__).resolve().parents[1] / "notebooks" / "09_fast_path.py"
FUNCTIONS = ("attention_kernels", "attention_text", "saved_bytes_text", "dtype_text", "packing_text", "compile_lines",
             "graph_text", "loader_text", "wins_text", "closing_text", "plot_speedups", "note_finding", "kernel_verdict")


class FakeProfile:
    def __init__(self, kernel: str) -> None:
        self.gpu_events = pd.DataFrame({"name": [kernel, "ampere_bf16_gemm", "elementwise_kernel"]})


def timed(ms: float, *, busy: float = 0.95, kernels: int = 500, kernel_ms: float | None = None, host_ms: float | None = None,
          attn: str = "cudnn_sdpa_fwd") -> timing.Timed:
    wall = tuple(ms / 1e3 * f for f in np.linspace(0.99, 1.01, 15))
    host = tuple((host_ms if host_ms is not None else ms * 0.4) / 1e3 for _ in wall)
    return timing.Timed(wall_s=wall, host_s=host, gpu_s=wall, gpu_busy=busy, kernels_per_call=kernels, device="cuda",
                        kernel_s=(kernel_ms if kernel_ms is not None else ms * busy) / 1e3, profile=FakeProfile(attn))


def comparison(names, speedup: float, *, spread: float = 0.005, a: timing.Timed | None = None,
               b: timing.Timed | None = None) -> timing.Comparison:
    ratios = tuple(speedup * f for f in np.linspace(1 - spread, 1 + spread, 15))
    a = a or timed(100.0)
    b = b or timed(100.0 / speedup)
    return timing.Comparison(names[0], names[1], a, b, ratios, ratios)


FASTER, SAME, SLOWER = 1.5, 1.0, 0.7


@pytest.fixture(scope="module")
def ns():
    source = TWIN.read_text().replace("    # %pip", "    pass  # %pip")  # the Colab cell's magic is a comment here
    tree = ast.parse(source)
    wanted = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in FUNCTIONS]
    assert {n.name for n in wanted} == set(FUNCTIONS), "a sentence function was renamed or removed"
    namespace = {"timing": timing, "prose": prose, "packing": packing, "np": np, "pd": pd, "torch": torch,
                 "transformers": transformers, "os": os, "plt": plt,
                 "STAGED": "batches already on the GPU (no loader)", "W0": "num_workers=0", "WN": "num_workers=4",
                 "WN_PIN": "num_workers=4, pin_memory, non_blocking", "TF32_BATCH": 8, "LOAD_BATCH": 64,
                 "model_label": lambda name: name, "findings": [], "finding_cmps": []}
    exec(compile(ast.Module(body=wanted, type_ignores=[]), str(TWIN), "exec"), namespace)
    return namespace


def clean(text: str) -> str:
    for bad in ("nan", "None", "{", "}"):
        assert bad not in text, f"{bad!r} in: {text}"
    return text


def attn_table(eager_lengths):
    rows = {}
    for impl in ("eager", "flash", "memory-efficient", "cuDNN", "math"):
        for s in (256, 1024, 8192):
            if impl == "eager" and s not in eager_lengths:
                rows[(impl, s)] = {"status": "out of memory"}
                continue
            rows[(impl, s)] = {"status": "ok", "fwd+bwd median (ms)": {"eager": 40.0, "math": 50.0, "cuDNN": 1.5}.get(impl, 2.0) * s / 256,
                               "TFLOP/s": 100.0 if impl not in ("eager", "math") else 20.0,
                               "peak above inputs (MiB)": 5000.0 * s / 256 if impl in ("eager", "math") else 100.0}
    return pd.DataFrame(rows).T.rename_axis(["implementation", "seq len"])


@pytest.mark.parametrize("grow", [3.0, 1.0, 0.2])
def test_attention_text_branches(ns, grow):
    table = attn_table({256, 1024, 8192})
    cmp = {256: comparison(("eager", "cuDNN"), 2.0), 8192: comparison(("eager", "cuDNN"), 2.0 * grow)}
    text = clean(ns["attention_text"](table, cmp, "peak above inputs (MiB)", [10.0, 100.0, 1000.0], [256, 1024, 8192]))
    assert "fastest implementation is **cuDNN**" in text
    assert {3.0: "grows with the length", 1.0: "overlap", 0.2: "shrinks"}[grow] in text
    assert "Memory tells the clearer story" in text


def test_attention_text_when_eager_runs_out_of_memory(ns):
    table = attn_table({256, 1024})
    cmp = {256: comparison(("eager", "flash"), 2.0), 1024: comparison(("eager", "flash"), 4.0)}
    text = clean(ns["attention_text"](table, cmp, "peak above inputs (MiB)", [10.0, 100.0, 1000.0], [256, 1024, 8192]))
    assert "did not reach 8,192 (out of memory; its longest length here is 1,024)" in text
    assert "at 1,024" in text


@pytest.mark.parametrize("dtype, pe, expected", [(torch.bfloat16, 5.95, "as measured"), (torch.float32, 2.0, "types"),
                                                  (torch.bfloat16, 9.0, "differs"), (torch.float16, 6.0, "as measured")])
def test_saved_bytes_text(ns, dtype, pe, expected):
    text = clean(ns["saved_bytes_text"]({"eager": pe, "math": 12.0}, "memory-efficient", 4096, dtype))
    assert expected in text and "memory-efficient" in text and "math backend" in text


def test_dtype_text_both_branches(ns):
    same = {("flash", 1024): comparison(("bf16", "fp16"), 1.0), ("eager", 4096): comparison(("bf16", "fp16"), 1.01)}
    assert "same time within the noise" in clean(ns["dtype_text"](same))
    differ = {**same, ("eager", 1024): comparison(("bf16", "fp16"), 1.3)}
    text = clean(ns["dtype_text"](differ))
    assert "eager at s = 1024 (1.30×, faster" in text and "2 of the 3 cases" in text


@pytest.mark.parametrize("busy", [0.95, 0.6])
def test_packing_text(ns, busy):
    pad, group, pack = "padded (8 documents per batch)", "length-grouped (8 per batch)", "packed (rows of 1024)"
    table = pd.DataFrame({pad: {"token slots": 11752, "padding (%)": 40.0, "attention kernel": "memory-efficient"},
                          group: {"token slots": 8816, "padding (%)": 20.0, "attention kernel": "memory-efficient"},
                          pack: {"token slots": 7168, "padding (%)": 2.0, "attention kernel": "memory-efficient"}}).T
    a = timed(300.0, busy=busy, kernels=3000)
    cmp = {group: comparison((pad, group), 1.2, a=a, b=timed(250.0, kernel_ms=230.0)),
           pack: comparison((pad, pack), 1.5, a=a, b=timed(200.0, kernel_ms=180.0))}
    text = clean(ns["packing_text"](table, cmp, pad, group, pack))
    # judged by kernel time (300 x busy / 230 ms and / 180 ms), the wall clock's ratio beside it without a verdict word
    kr_group = 300.0 * busy / 230.0
    expect_group = "faster" if kr_group >= 1.03 else ("slower" if kr_group <= 1 / 1.03 else timing.NO_DIFFERENCE)
    assert f"length-grouped: the GPU's own work (kernel time) {kr_group:.2f}× smaller, {expect_group}" in text
    assert "the wall clock 1.20× (95% interval" in text and "than the padded batches" not in text
    # one sentence whatever the busy fraction (no branch on a threshold the busy number may cross between runs)
    assert f"busy {busy:.0%} of the time, with" in text and "µs of host time" in text and "pays in full" not in text
    assert "the length-grouped pass 95% and the packed pass 95%" in text
    assert "**memory-efficient** for the padded batches" in text


def test_kernel_verdict_and_judged_on(ns):
    wall_noise = comparison(("padded", "packed"), 1.09, spread=0.15, a=timed(340.0, busy=0.8, kernel_ms=280.0),
                            b=timed(310.0, busy=0.6, kernel_ms=196.0))
    assert wall_noise.verdict == timing.NO_DIFFERENCE and ns["kernel_verdict"](wall_noise) == "faster"
    cpu = timing.Comparison("a", "b", timing.Timed((1.0,) * 10, (1.0,) * 10, None, None, None, "cpu"),
                            timing.Timed((0.5,) * 10, (0.5,) * 10, None, None, None, "cpu"), (2.0,) * 10, None)
    assert ns["kernel_verdict"](cpu) == "faster"  # no kernel time on a CPU: the wall-clock verdict
    ns["findings"].clear()
    ns["finding_cmps"].clear()
    ns["note_finding"]("packed", "lm", wall_noise, judged_on="kernel time")
    assert ns["findings"][-1]["verdict"] == "faster" and ns["findings"][-1]["judged on"] == "kernel time"


def cats(element, attention=7.6, gemm=20.8, optimizer=9.8):
    return pd.Series({"GEMM": gemm, "attention": attention, "element-wise / normalisation": element, "optimizer": optimizer})


ROW = {"compile time (s)": 12.3, "peak allocated (GiB)": 10.1, "compilations (first step)": 2,
       "recompilations while timed": 0, "graph breaks": 0}


@pytest.mark.parametrize("case, speedup, busy_b, kernel_b, att_c, expect", [
    ("fell back", 0.8, 0.95, 60.0, 0.0, "Attention fell back"),
    ("gpu-bound, no gain", 1.0, 0.95, 64.0, 7.6, "which compilation does not replace"),
    ("host-limited", 1.0, 0.64, 50.0, 7.6, "The wall clock mixes two savings"),
    ("faster, GPU waits less", 1.44, 0.94, 50.0, 7.6, "The wall clock mixes two savings"),
    ("faster, host-paced", 1.14, 0.7, 50.0, 7.6, "The wall clock mixes two savings"),
])
def test_compile_lines(ns, case, speedup, busy_b, kernel_b, att_c, expect):
    a = timed(80.8, busy=0.8, kernels=2431, kernel_ms=64.0)
    b = timed(80.8 / speedup, busy=busy_b, kernels=1927, kernel_ms=kernel_b)
    c = comparison(("eager", "compiled (default)"), speedup, a=a, b=b)
    lines = ns["compile_lines"]("bert-large-uncased", "compiled (default)", c, ROW, cats(26.4),
                                cats(14.1, attention=att_c), 9.0)
    text = clean("\n".join(lines))
    assert expect in text and "compiling took 12 s (cold caches)" in text and "optimizer step is not compiled" in text
    # judged by kernel time; the wall clock's ratio carries no verdict word, whatever the host did
    kr = 64.0 / kernel_b
    word = "faster" if kr >= 1.03 else ("slower" if kr <= 1 / 1.03 else timing.NO_DIFFERENCE)
    assert f"The GPU's own work (kernel time) is {kr:.2f}× smaller, {word}" in text
    wall = text.split("by the wall clock, ")[1].split(". GPU busy")[0]
    assert not any(w in wall for w in ("faster", "slower", timing.NO_DIFFERENCE)), wall


@pytest.mark.parametrize("graph_kernel, masked_kernel, dropout0, verdict_speedup", [
    ("none-math", "cudnn_sdpa", "none-math", 1.9),
    ("none-math", "none-math", "flash_fwd", 1.9),
    ("cudnn_sdpa", "cudnn_sdpa", "cudnn_sdpa", 1.0),
    ("none-math", "cudnn_sdpa", "none-math", 0.9),
])
def test_graph_text(ns, graph_kernel, masked_kernel, dropout0, verdict_speedup):
    eager = timed(70.0, busy=0.45, kernels=2325, host_ms=66.0, attn="cudnn_sdpa")
    result = {"CUDA graph": comparison(("eager", "CUDA graph"), verdict_speedup, a=eager,
                                       b=timed(70.0 / verdict_speedup, busy=0.95, kernels=2325, attn=graph_kernel)),
              "CUDA graph, all-ones attention_mask": comparison(("eager", "CUDA graph, all-ones attention_mask"), 2.1,
                                                                a=eager, b=timed(33.0, attn=masked_kernel)),
              "CUDA graph, attention dropout 0": ns["attention_kernels"](FakeProfile(dropout0))}
    probe = pd.Series({(0.0, "eager"): "cuDNN", (0.0, "CUDA graph"): "cuDNN", (0.1, "eager"): "cuDNN",
                       (0.1, "CUDA graph"): "none (math: batched GEMMs and softmax)"})
    text = clean(ns["graph_text"](result, probe))
    assert "µs per GPU operation" in text and "check the kernel names" in text
    if graph_kernel.startswith("none") and verdict_speedup > 1.03:
        assert "removing launch overhead" in text
    if graph_kernel.startswith("none") and verdict_speedup < 1:
        assert "ate the saving" in text
    text2 = clean(ns["graph_text"]({"CUDA graph": result["CUDA graph"]}, None))
    assert "Replayed from a graph" in text2


@pytest.mark.parametrize("stall, floor, copy_a", [(0.6, 1.0, 0.2), (1.0, 0.8, 0.2), (0.6, 1.2, 0.05)])
def test_loader_text(ns, stall, floor, copy_a):
    S, W0, WN, WN_PIN = ns["STAGED"], ns["W0"], ns["WN"], ns["WN_PIN"]
    cmp = {(S, W0): comparison((S, W0), stall, a=timed(100.0, busy=0.9), b=timed(100 / stall, busy=0.5)),
           (W0, WN): comparison((W0, WN), 1.6), (S, WN_PIN): comparison((S, WN_PIN), floor)}
    copy = comparison(("pageable, blocking", "pinned, non_blocking"), copy_a / 0.1, a=timed(copy_a), b=timed(0.1))
    tokenise_s = 0.05 if floor == 1.2 else 0.14  # below and above the 66 ms gap of a 0.6 speed-up
    text = clean(ns["loader_text"](cmp, copy, {"fresh workers": 0.9, "persistent workers": 0.15}, tokenise_s, 4))
    if stall < 1:
        assert ("of which about" in text) == (tokenise_s < 0.066) and ("less than the" in text) == (tokenise_s > 0.066)
    assert ("is the stall" in text) == (stall < 1)
    assert "the reference is" not in text
    assert {1.0: "hide the loading within ±3%", 0.8: "do not hide all", 1.2: "host's variation"}[floor] in text
    assert "host-bound" not in text and "GPU-bound" not in text  # the step's regime is no conclusion here
    if copy_a > 0.1:
        assert "faster than from pageable memory" in text and "0.10 ms a step, 0.10% of this step" in text
    else:
        assert "nothing here" in text


@pytest.mark.parametrize("busy", [0.95, 0.45])
def test_wins_text(ns, busy):
    base = timed(120.0, busy=busy, kernels=2500)
    cmp = {"AdamW fused": comparison(("AdamW foreach (default)", "AdamW fused"), 1.06, a=base, b=timed(113.0, kernels=2100)),
           "AdamW for-loop, optimizer step alone": comparison(("AdamW foreach, optimizer step alone", "AdamW for-loop"),
                                                              0.45, a=timed(10.0, kernels=200),
                                                              b=timed(22.0, busy=0.5, kernels=3200, host_ms=21.0)),
           "zero_grad(set_to_none=True) (default)": comparison(("zero_grad(set_to_none=False)", "zero_grad(...)"), 1.0),
           "fp32 step, TF32 on": comparison(("fp32 step, TF32 off", "fp32 step, TF32 on"), 2.1),
           "aligned vocabulary": comparison(("vocabulary 30,522", "vocabulary 30,528"), 1.8)}
    text = clean(ns["wins_text"](cmp))
    assert "3,000 more GPU operations" in text and "reader's CPU decides" in text
    assert f"busy {busy:.0%} of the time, with" in text and "follows the GPU's work in that share" in text
    assert clean(ns["wins_text"]({"aligned vocabulary": cmp["aligned vocabulary"]})).startswith("The vocabulary padded")


def test_note_finding_closing_text_and_plot(ns):
    ns["findings"].clear()
    ns["finding_cmps"].clear()
    ns["note_finding"]("AdamW fused", "bert", comparison(("foreach", "fused"), 1.06))
    ns["note_finding"]("for-loop", "bert", comparison(("foreach", "loop"), 0.7, a=timed(100.0, busy=0.4)))
    ns["note_finding"]("set_to_none", "bert", comparison(("False", "True"), 1.0))
    table = pd.DataFrame(ns["findings"]).set_index(["technique", "model"])
    info = {"bert-large-uncased": {"eager": {}, "compiled (default)": ROW,
                                   "compiled (reduce-overhead)": {"note": "skipped: 3 s of the chapter's time budget left"}}}
    text = clean(ns["closing_text"](table, info))
    assert "Of the 3 comparisons, 1 made the work faster" in text and "1 made it slower: for-loop on bert (0.70×)" in text
    assert "(for-loop (bert)): there the host's speed" in text and "Not measured in this run" in text
    assert "(cold caches)" in text  # a row without its cache state reads as the first compile
    info["bert-large-uncased"]["compiled (default)"] = {**ROW, "caches": "after x in this process"}
    assert "s (after x in this process)" in clean(ns["closing_text"](table, info))
    fig, ax = plt.subplots()
    ns["plot_speedups"](ax, dict(zip(["a", "b", "c"], ns["finding_cmps"], strict=True)), "t")
    plt.close(fig)


def test_comparisons_table_has_fixed_columns():
    table = timing.comparisons_table({("x", 1): comparison(("eager", "flash"), 2.0),
                                      ("y", 2): comparison(("num_workers=0", "num_workers=4"), 1.0)})
    assert list(table["baseline"]) == ["eager", "num_workers=0"]
    assert table.loc[("x", 1), "verdict"] == "faster" and table.loc[("y", 2), "verdict"] == timing.NO_DIFFERENCE
    assert table.index.nlevels == 2
    with pytest.raises(ValueError, match="at least one"):
        timing.comparisons_table({})
    with pytest.raises(ValueError, match="not a timing.Comparison"):
        timing.comparisons_table({"a": "fast"})


def test_pack_into_spreads_rows_over_exact_batches():
    docs = [[1] * n for n in (10, 20, 30, 25, 5, 31, 12)]
    batches = packing.pack_into(docs, 32, 3)
    assert len(batches) == 3
    rows = [b["input_ids"].shape[0] for b in batches]
    assert max(rows) - min(rows) <= 1 and sum(rows) == len(packing.pack_rows(docs, 32, 1))
    assert sum(int((b["position_ids"] == 0).sum()) for b in batches) >= len(docs)
    with pytest.raises(ValueError, match="cannot fill"):
        packing.pack_into(docs, 32, 50)
    with pytest.raises(ValueError, match="at least 1"):
        packing.pack_into(docs, 32, 0)


def test_compile_lines_for_a_graphed_mode_say_what_the_peak_leaves_out(ns):
    a = timed(113.0, busy=0.57, kernels=2431, kernel_ms=64.0)
    c = comparison(("eager", "compiled (reduce-overhead)"), 1.93, a=a, b=timed(57.5, busy=0.9, kernels=1977, kernel_ms=51.0))
    row = dict(ROW, **{"peak reserved (GiB)": 14.2})
    text = clean("\n".join(ns["compile_lines"]("bert-large-uncased", "compiled (reduce-overhead)", c, row, cats(26.4),
                                               cats(14.1), 12.45)))
    assert "outside the CUDA graphs' private memory pool" in text and "peak reserved 14.20 GiB" in text


def test_dtype_text_names_only_the_implementations_that_differ(ns):
    cmp = {("eager", 1024): comparison(("bf16", "fp16"), 1.19), ("eager", 4096): comparison(("bf16", "fp16"), 1.17),
           ("flash", 1024): comparison(("bf16", "fp16"), 1.0), ("cuDNN", 4096): comparison(("bf16", "fp16"), 1.0)}
    text = clean(ns["dtype_text"](cmp))
    assert "in 2 of the 4 cases" in text and "Only eager showed a difference here" in text
