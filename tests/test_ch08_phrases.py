"""Chapter 8's rendered sentences, every branch, on fabricated measurements (CPU only).

The sentence builders live in the chapter (``notebooks/08_profiling.py``, the jupytext twin) next to the cells
that call them; here they are taken from it by name and fed numbers shaped like an H100 run, a T4 run and a
quiet host, so that a GPU-only branch that would crash, or a sentence that contradicts its own numbers, fails
on a CPU first.
"""

from __future__ import annotations

import ast
import types
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from helpers import prose, timing

TWIN = Path(__file__).resolve().parents[1] / "notebooks" / "08_profiling.py"
NAMES = ("clocks_text", "regimes_text", "methods_text", "regime_lines", "sweep_text", "graph_text", "bandwidth_text",
         "churn_text")


@pytest.fixture(scope="module")
def ch8():
    defs = []
    for cell in TWIN.read_text().split("\n# %%"):  # cell by cell: the setup cell's Colab branch is not plain Python
        if any(f"def {name}(" in cell for name in NAMES):
            body = cell.split("\n", 1)[1]  # drop the rest of the "# %% tags=..." marker line
            defs += [node for node in ast.parse(body).body if isinstance(node, ast.FunctionDef) and node.name in NAMES]
    assert sorted(d.name for d in defs) == sorted(NAMES)
    namespace = {"timing": timing, "prose": prose, "np": np, "pd": pd}
    exec(compile(ast.Module(body=defs, type_ignores=[]), str(TWIN), "exec"), namespace)
    return types.SimpleNamespace(**{name: namespace[name] for name in NAMES})


def timed(wall_ms, host_ms=None, *, busy=0.9, kernels=100, kernel_ms=None, launches=None, gpu_ms=None, n=15):
    wall = tuple(wall_ms / 1e3 * (1 + 0.001 * (i - n // 2)) for i in range(n))
    host = tuple((host_ms if host_ms is not None else 0.1 * wall_ms) / 1e3 for _ in range(n))
    gpu = tuple((gpu_ms if gpu_ms is not None else wall_ms * 0.97) / 1e3 for _ in range(n))
    profile = types.SimpleNamespace(launches_per_step=launches if launches is not None else kernels)
    return timing.Timed(wall, host, gpu, busy, kernels, "cuda",
                        kernel_ms / 1e3 if kernel_ms is not None else busy * wall_ms / 1e3, None, profile)


def comparison(a, b, ratio, spread=0.01, n=15):
    ratios = tuple(ratio * (1 + spread * (i - n // 2) / n) for i in range(n))
    return timing.Comparison("a", "b", a, b, ratios, ratios)


def test_clocks_text(ch8):
    mm = timed(1.52, 0.14, gpu_ms=1.45)
    text = ch8.clocks_text(8192, 0.083e-3, mm, 0.156, 989.4, 2 * 8192**3)
    assert "5% below the synchronised clock" in text and "989 TFLOP/s" in text
    same = ch8.clocks_text(8192, 0.083e-3, timed(1.52, gpu_ms=1.52), 0.156, None, 2 * 8192**3)
    assert "within 0.5%" in same and "no GPU reaches that" in same


def test_regimes_text(ch8):
    text = ch8.regimes_text(timed(2.93, 2.82, busy=0.07, kernels=200, kernel_ms=0.21), timed(1.52, 0.14))
    assert "7% of the time" in text and "14.1 µs" in text


@pytest.mark.parametrize("words, expect", [
    (("within the noise",) * 5, "none of the 5 block comparisons declared a difference"),
    (("faster", "within the noise", "slower", "slower", "within the noise"), "a difference between identical pieces "
                                                                              "of work in 3 of 5 tries"),
])
def test_methods_text_blocks(ch8, words, expect):
    rows = [{"speed-up": 1.0 + 0.01 * i, "verdict": w} for i, w in enumerate(words)]
    c = comparison(timed(3), timed(3), 1.0, spread=0.01)
    text = ch8.methods_text(rows, c)
    assert expect in text
    assert "no practical difference" in text and "whole interval lies inside ±3%" in text
    assert "faster" not in text and "slower" not in text  # the block method's words vary from run to run


def test_methods_text_interleaved_branches(ch8):
    rows = [{"speed-up": 1.0, "verdict": "within the noise"}] * 5
    wide = comparison(timed(3), timed(3), 1.0, spread=0.2)
    assert "too noisy to rule out" in ch8.methods_text(rows, wide)
    false_alarm = comparison(timed(3), timed(3), 1.1, spread=0.01)
    assert "false alarm" in ch8.methods_text(rows, false_alarm)


def step_rows(verdicts):
    index = pd.MultiIndex.from_tuples([("bert-large-uncased", 4), ("bert-large-uncased", 32),
                                       ("polyglot-ko-1.3b", 1), ("polyglot-ko-1.3b", 16)][:len(verdicts)])
    return pd.DataFrame({"GPU busy": [0.4, 0.96, 0.42, 0.84][:len(verdicts)],
                         "wall median (ms)": [68.7, 117.9, 136.4, 154.4][:len(verdicts)],
                         "host enqueue (ms)": [66.7, 92.6, 104.5, 124.8][:len(verdicts)],
                         "verdict": list(verdicts),
                         "host µs per GPU op": [28.7, 34.7, 30.9, 34.8][:len(verdicts)],
                         "GPU ops/step": [2325, 2671, 3386, 3584][:len(verdicts)]}, index=index).astype(object)


def test_regime_lines(ch8):
    lines = ch8.regime_lines(step_rows(["host-bound", "GPU-bound", "host-bound", "GPU-bound"]))
    assert len(lines) == 3
    assert "bert-large-uncased at batch 4 and polyglot-ko-1.3b at batch 1" in lines[2]
    assert "2,325 or more" in lines[2] and "29 to 31 µs" in lines[2]  # the host-bound rows only, not 35 of GPU-bound
    t4 = ch8.regime_lines(step_rows(["GPU-bound", "GPU-bound"]))  # a T4: the 1.3B rows did not fit
    assert len(t4) == 2 and "No configuration is host-bound" in t4[1]


def sweep(kernel, host, verdict0="host-bound"):
    batches = [1, 2, 4, 8, 16, 32, 64][:len(kernel)]
    wall = [max(k, h) + 15 for k, h in zip(kernel, host, strict=True)]
    return pd.DataFrame({
        "wall median (ms)": wall, "wall IQR (ms)": [15.0] * len(batches),
        "back to back, per call (ms)": [w - 5 for w in wall], "back to back IQR (ms)": [30.0] * len(batches),
        "host enqueue median (ms)": host, "GPU kernel time (ms)": kernel,
        "GPU busy": [min(0.99, k / w) for k, w in zip(kernel, wall, strict=True)],
        "GPU ops per call": [3386 + 10 * i for i in range(len(batches))],
        "host µs per GPU op": [h * 1e3 / 3386 for h in host],
        "tokens/s": [b * 256 / (w / 1e3) for b, w in zip(batches, wall, strict=True)],
        "verdict": [verdict0] + ["GPU-bound"] * (len(batches) - 1),
    }, index=pd.Index(batches, name="batch"))


def test_sweep_text_crossing(ch8):
    text = ch8.sweep_text(sweep([30, 40, 60, 90, 120, 170, 315], [84, 70, 100, 110, 100, 130, 250]))
    assert "Up to batch 8" in text and "At batch 16 the GPU's kernels first take longer" in text
    assert "cannot show it" in text  # tail 15 ms, IQR 15 ms
    assert "The host's enqueue time grows" in text and "larger batch" in text
    for word in ("faster", "slower", "within the noise"):
        assert word not in text


def test_sweep_text_other_regimes(ch8):
    t4 = ch8.sweep_text(sweep([150, 300, 600], [100, 100, 100], verdict0="GPU-bound"))
    assert "Already at batch 1" in t4 and "larger batch" not in t4
    host_only = ch8.sweep_text(sweep([10, 20, 30], [100, 100, 100]))
    assert "At no batch up to 4" in host_only


def graph_cats(attn_graph):
    return pd.DataFrame({"eager": [6.3, 2.0, 19.1, 0.15], "eager, capturable AdamW": [6.3, 2.0, 22.0, 0.15],
                         "CUDA graph": [6.3, attn_graph, 22.0, 0.15]},
                        index=["GEMM", "attention", "element-wise / normalisation", "memcpy / memset"])


@pytest.mark.parametrize("ratio, kernel_graph, attn, expect", [
    (2.2, 30.0, 2.0, "its size is set by the host"),
    (1.0, 53.0, 0.0, "its GPU work"),
    (0.99, 30.0, 2.0, "was not waiting for its launches"),
])
def test_graph_text(ch8, ratio, kernel_graph, attn, expect):
    eager = timed(70, 67, busy=0.4, kernels=2325, kernel_ms=27.5)
    cap = timed(85, 82, busy=0.35, kernels=3136, kernel_ms=30.4)
    graph = timed(70 / ratio, 2.2, busy=0.97, kernels=3224, kernel_ms=kernel_graph, launches=3)
    text = ch8.graph_text(comparison(eager, cap, 0.82), comparison(eager, graph, ratio), graph_cats(attn), 3)
    assert expect in text
    assert "took 1.22 times as long as with the default AdamW (95% interval" in text and "3,136 launch calls" in text
    assert "1.11 times the kernel time" in text and "the GPU was busy 40% of the eager step" in text
    assert "slower" not in text.split("A capturable AdamW")[1]  # a host-bound side comparison: no verdict word
    assert ("math path" in text) == (attn == 0.0)
    assert "29 µs per launch" in text


def test_bandwidth_text(ch8):
    bw = pd.DataFrame({"GPU ops per call": [1, 1, 136, 21], "GPU kernel time (ms)": [0.71, 0.38, 9.81, 3.52],
                       "GPU busy": [0.88, 0.86, 0.81, 0.61], "host enqueue median (ms)": [0.09, 0.06, 6.29, 2.72],
                       "achieved, by wall time (GiB/s)": [2480.0, 2241.0, 718.0, 1507.0],
                       "achieved, by kernel time (GiB/s)": [2818.0, 2620.0, 891.0, 2481.0]},
                      index=["device-to-device copy", "GeLU (16-bit)", "AdamW step (foreach)", "AdamW step (fused)"])
    c = comparison(timed(12.2, kernel_ms=9.81), timed(5.8, kernel_ms=3.52), 2.1)
    text = ch8.bandwidth_text(bw, c, 3120.0)
    assert "fused needs 0.36 times" in text and "2.10×, faster than foreach" in text and "3,120 GiB/s" in text
    assert "datasheet" not in ch8.bandwidth_text(bw, c, None)


def test_churn_text(ch8):
    d = {k: pd.DataFrame({"peak_allocated_mib": [8000.0, 8622.0], "reserved_mib": [9000.0, 12000.0]})
         for k in ("default", "expandable_segments")}
    counters = pd.DataFrame({"default": [626.0, 0.0, 0.0, 626.0, 215.9], "expandable_segments": [478.0, 0.0, 0.0, 0.0, 0.0]},
                            index=["device allocations (num_device_alloc)", "device frees (num_device_free)",
                                   "retries after flushing the cache (num_alloc_retries)",
                                   "segments at the end (segment.all.current)", "inactive split blocks at the end (MiB)"])
    slack = {"default": 3.31, "expandable_segments": 0.35}
    assert "No step ran out of memory" in ch8.churn_text(d, counters, slack)
    counters.loc["retries after flushing the cache (num_alloc_retries)"] = [4.0, 1.0]
    full = ch8.churn_text(d, counters, slack)
    assert "retried 4 times by default and 1 times" in full and "No step ran out" not in full
