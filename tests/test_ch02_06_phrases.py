"""The rendered speed sentences of chapters 2-6, called on a CPU with fabricated comparisons.

The chapters build each sentence that quotes a speed comparison in a small function defined in a hidden cell.
On a CPU those cells' GPU branches never run, so a crash there would surface only on the GPU run; these tests
load the functions from the chapters' text twins and call every branch with fabricated ``timing.Comparison``
and ``timing.Timed`` objects.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pandas as pd
import pytest

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
    assert "NF4 against bf16: 1.00×, no practical difference" in f["layer_speed_sentence"](cmps, "bf16", 64, 256)


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


# --- chapter 4 -----------------------------------------------------------------------------------------------
def ch04_summary(f, cases):
    """A section-4.3 summary for one model from ``cases``: batch -> (speed-up, busy plain, busy ckpt, predicted %)."""
    import numpy as np

    index = pd.MultiIndex.from_tuples([("m", b) for b in cases], names=["model", "batch"])
    summary = pd.DataFrame({
        "predicted: layer forward / step (%)": [v[3] for v in cases.values()],
        "GPU work added (ms)": [30.0] * len(cases), "layer forward GPU work (ms)": [32.0] * len(cases),
        "GPU busy, plain": np.nan, "GPU busy, checkpointed": np.nan, "verdict, checkpointed": "—",
    }, index=index)
    cmps = {("m", b): comparison(v[0], names=("plain", "checkpointed"), busy_a=v[1], busy_b=v[2],
                                 host_share=0.9 if v[2] < 0.5 else 0.3) for b, v in cases.items()}
    return f["overhead_columns"](summary, cmps)


def test_ch04_price_lines_every_branch():
    class Prof:
        on_gpu = True

    f = chapter_functions("04_gradient_checkpointing", "overhead_columns", "price_lines", "gpu_limit_sentence",
                          prof=Prof(), np=__import__("numpy"))
    cases = {4: (1 / 1.47, 0.96, 0.86, 29.0),   # costs more, not host-bound, idler with checkpointing
             8: (1 / 1.30, 0.98, 0.98, 30.0),   # agrees
             16: (1 / 1.60, 0.40, 0.30, 30.0),  # costs more, host-bound
             32: (1 / 1.10, 0.90, 0.97, 30.0),  # costs less, busier
             64: (1.2, 0.40, 0.45, 30.0)}       # faster: host noise
    summary = ch04_summary(f, cases)
    assert list(summary["measured vs predicted"]) == ["costs more", "agrees", "costs more", "costs less", "costs less"]
    summary.loc[summary["checkpointed vs plain"] == "faster", "measured vs predicted"] = "faster than plain"
    text = "\n".join(f["price_lines"]("m", summary.loc["m"], pd.Series(0.1, index=list(cases))))
    assert "times the half-width of its 95% interval" in text and "that waiting is part of the cost" in text
    assert "host-bound (GPU busy 30% with checkpointing)" in text
    assert "measured *faster*" in text and "rose from 90% to 97%" in text
    # a host-bound row whose added GPU work is well short of one forward pass still gets the host explanation
    part = summary.loc["m"].copy()
    part.loc[16, "GPU work added (ms)"] = 0.69 * part.loc[16, "layer forward GPU work (ms)"]
    text = "\n".join(f["price_lines"]("m", part, pd.Series(0.1, index=list(cases))))
    assert "69% of one more forward pass" in text and "host-bound (GPU busy 30% with checkpointing)" in text
    assert "2 of the rows above), checkpointing cost 10 to 30% here" in f["gpu_limit_sentence"](summary)  # batch 4 idles
    assert "None of these" in f["gpu_limit_sentence"](summary.iloc[2:3])


def test_ch04_guide_pair_stack_and_offload():
    f = chapter_functions("04_gradient_checkpointing", "guide_pair_sentence", "fastest_title", "halves_sentence",
                          "whole_block_sentence", "offload_sentence", "offload_step_phrase", MIB=2**20)
    host = comparison(1 / 1.64, names=("plain", "ckpt"), busy_a=0.45, busy_b=0.37, host_share=0.95)
    text = f["guide_pair_sentence"](host, 1.0, "H100")
    assert "1.64 times as slow" in text and "µs of this host's time" in text and "faster CPU" in text
    assert "no practical difference" in f["guide_pair_sentence"](comparison(1.0), 0.8, "H100")
    cmps = {k: comparison(1 / r, names=("store everything", k)) for k, r in
            [("recompute attention", 1.13), ("recompute MLP", 1.17), ("recompute whole block", 1.33),
             ("offload to CPU (save_on_cpu)", 5.0)]}
    assert f["fastest_title"](cmps).endswith(": recompute attention")
    kept = {"recompute attention": 736.0, "recompute MLP": 482.0, "recompute whole block": 64.0}
    # the FLOPs predict (3 + 0.62) / (3 + 0.38) = 1.071: 1.05 and 1.10 agree within 5%, 1.01 and 1.15 do not
    for ratio, words in ((1.05, "within 5% of that prediction"), (1.10, "within 5% of that prediction"),
                         (1.01, "less, relative to attention, than its FLOPs predict"),
                         (1.15, "more, relative to attention, than its FLOPs predict")):
        halves = comparison(1 / ratio, names=("recompute attention", "recompute MLP"))
        text = f["halves_sentence"](kept, halves, 0.38, 0.62, 64)
        assert words in text and "predict 1.07" in text, (ratio, text)
        assert not any(w in text for w in ("faster", "slower", timing.NO_DIFFERENCE))  # no ±3% verdict to flip
    assert "are what the prediction counts" in f["whole_block_sentence"](kept, cmps["recompute whole block"])
    assert "clearly more" in f["whole_block_sentence"](kept, comparison(1 / 1.99))
    idle = comparison(1 / 1.99, busy_a=0.48, busy_b=0.31, host_share=0.9)
    assert "cannot test the 1.33" in f["whole_block_sentence"](kept, idle)
    off = pd.Series({"peak above weights (MiB)": 368.0, "stored at the timing batch (MiB)": 8728.0})
    assert "GB/s or more" in f["offload_sentence"](0.0, off, cmps["offload to CPU (save_on_cpu)"], 64, 8)
    slow = comparison(1 / 1.1, names=("checkpointing", "checkpointing + offload"), busy_a=0.95, busy_b=0.8)
    assert "waits for the copies" in f["offload_step_phrase"](slow)
    assert "waits" not in f["offload_step_phrase"](comparison(1.0))


# --- chapter 5 -----------------------------------------------------------------------------------------------
def test_ch05_precision_sentences():
    f = chapter_functions("05_mixed_precision_optimizers", "small_step_text", "big_step_text", GIB=2**30)
    host = comparison(0.65, names=("fp32", "bf16"), busy_a=0.83, busy_b=0.2, host_share=0.99)
    text = f["small_step_text"](host, "bf16", 1024, 3.1, 303e6)
    assert "0.65×, slower than fp32" in text and "µs each on this host" in text and "reader's CPU" in text
    gpu = comparison(1.0, names=("fp32", "bf16"))
    assert "not host-bound here" in f["small_step_text"](gpu, "bf16", 1024, 3.1, 303e6)
    cmps = {"tf32": comparison(2.8, names=("fp32", "tf32")), "fp16": comparison(5.6, names=("fp32", "fp16"),
                                                                                busy_b=0.80),
            "bf16": comparison(5.8, names=("fp32", "bf16"), busy_b=0.88)}
    c16 = cmps["fp16"]  # fp16's kernels as long as bf16's, its GPU idler: the GradScaler's sync
    cmps["fp16"] = timing.Comparison(c16.a_name, c16.b_name, c16.a,
                                     dataclasses.replace(c16.b, kernel_s=cmps["bf16"].b.kernel_s), c16.ratios,
                                     c16.gpu_ratios)
    text = f["big_step_text"](cmps, "bf16", 16384)
    assert "5.80×, faster than fp32" in text and "tf32 at 2.80×" in text and "fp16 at 5.60×" in text
    assert "`GradScaler.step` reads" in text


def test_ch05_optimizers_repeat_and_empty_cache():
    f = chapter_functions("05_mixed_precision_optimizers", "optimizer_speed_text", "repeat_text", "empty_cache_cost")
    cmps = {"AdamW (foreach)": comparison(0.46, names=("AdamW (fused)", "AdamW (foreach)")),
            "SGD + momentum": comparison(1.03, names=("AdamW (fused)", "SGD + momentum"), spread=0.05),
            "8-bit AdamW (bnb)": comparison(0.2, names=("AdamW (fused)", "8-bit AdamW (bnb)"), busy_b=0.3,
                                            host_share=0.9)}
    cmps["8-bit AdamW (bnb)"] = dataclasses.replace(cmps["8-bit AdamW (bnb)"], b=dataclasses.replace(
        cmps["8-bit AdamW (bnb)"].b, kernels_per_call=600))
    text = f["optimizer_speed_text"](cmps, 600)
    assert "AdamW (foreach) 21.7 ms, 2.17 times fused AdamW's time" in text
    assert "SGD + momentum 9.71 ms, within 10% of fused AdamW's time" in text
    wide = {"SGD + momentum": comparison(1.0, names=("AdamW (fused)", "SGD + momentum"), spread=0.3)}
    assert "does not place within or beyond 10%" in f["optimizer_speed_text"](wide, 600)
    assert "600 GPU operations at about" in text and "8-bit AdamW (bnb) issue at least one GPU operation" in text
    assert "kept the GPU busy 30% of their step" in text
    two = dict(cmps, **{"Adafactor": dataclasses.replace(cmps["8-bit AdamW (bnb)"], b=dataclasses.replace(
        cmps["8-bit AdamW (bnb)"].b, gpu_busy=0.15))})
    assert "kept the GPU busy between 15% and 30% of their step" in f["optimizer_speed_text"](two, 600)
    assert text.count("GPU operations at about") == 1  # 500 launches < 600 tensors: not per tensor
    assert not any(w in text for w in ("host-bound", "mixed", "GPU-bound"))  # busy numbers, not band words
    busy = dataclasses.replace(cmps["8-bit AdamW (bnb)"], b=dataclasses.replace(cmps["8-bit AdamW (bnb)"].b,
                                                                                   gpu_busy=0.6))
    assert "on a slower CPU" in f["optimizer_speed_text"]({"8-bit AdamW (bnb)": busy}, 600)
    assert "times the larger IQR" in f["repeat_text"](timed(113.0), timed(102.0), "bf16")
    for c, words in ((comparison(1 / 1.04), "costs less than that"), (comparison(1 / 1.2), "costs more than that"),
                     (comparison(1 / 1.1, spread=0.1), "consistent with")):
        assert words in f["empty_cache_cost"](c)


# --- chapter 6 -----------------------------------------------------------------------------------------------
def test_ch06_lora_speed_and_ranks():
    names = {"FTMIX": "full fine-tuning (bf16 autocast)", "LORA": "LoRA r=8 (bf16 base)",
             "LORA8": "LoRA r=8 (bf16 base + 8-bit AdamW)", "QLORA": "QLoRA r=8 (NF4 base + 8-bit AdamW)"}
    f = chapter_functions("06_lora_qlora", "lora_speed_text", "rank_times_text", **names)
    ft, lo, l8, q = names["FTMIX"], names["LORA"], names["LORA8"], names["QLORA"]
    host = dict(busy_a=0.2, busy_b=0.15, host_share=0.95)
    cmps = {(ft, lo): comparison(0.77, names=(ft, lo), **host),
            (lo, l8): comparison(0.8, names=(lo, l8), **host),
            (l8, q): comparison(0.66, names=(l8, q), **host)}
    text = f["lora_speed_text"](cmps, 24, 1024)
    assert "0.77×, slower than full fine-tuning" in text and "µs per operation" in text
    assert "one at a time" in text and "the 4-bit base's cost is host time" in text
    gpu_bound = {(lo, l8): comparison(1.0, names=(lo, l8)), (l8, q): comparison(0.7, names=(l8, q), busy_b=0.99)}
    text = f["lora_speed_text"](gpu_bound, 24, 1024)
    assert "did not fit this GPU together" in text and "the dequantization kernels themselves" in text
    ms = pd.Series([140.0, 184.0, 154.0], index=[32, 128, 256])
    assert "do not follow the order" in f["rank_times_text"](ms, timed(138.0).wall, timed(154.0).wall, 8)
    assert "grow with the rank" in f["rank_times_text"](ms.sort_values(), timed(138.0).wall, timed(140.0).wall, 8)


def test_ch05_padding():
    f = chapter_functions("05_mixed_precision_optimizers", "padding_text")["padding_text"]
    lh = pd.DataFrame({"time (ms)": [3.0, 2.5, 2.6, 2.8], "TFLOP/s": [500.0, 600.0, 580.0, 450.0]},
                      index=[30522, 30528, 30536, 32000])
    cmps = {(30522, 30528): comparison(1.2), (30522, 30536): comparison(1.15), (30536, 30528): comparison(1.04)}
    text = f(lh, cmps, 8192, 2048, "bf16")
    assert "within 10% of each other" in text and "wave quantization" in text and text.endswith("within a few percent of it):")
    cmps[(30536, 30528)] = comparison(1.3)
    assert "the one to use" in f(lh, cmps, 8192, 2048, "bf16")


@pytest.mark.parametrize("stem", ["02_dtypes_quantization", "03_batch_size_grad_accumulation",
                                  "04_gradient_checkpointing", "05_mixed_precision_optimizers", "06_lora_qlora"])
def test_chapters_compare_interleaved_without_notes(stem):
    """Chapters 2-6: no block comparison (timing.compare / timing.difference), no glue, no committed-run note."""
    src = (NOTEBOOKS / f"{stem}.py").read_text()
    assert "timing.compare(" not in src and "timing.difference(" not in src
    assert "glue(" not in src
    assert "committed run" not in src.lower()


def test_ch06_one_seed_losses_makes_no_noise_inference():
    text = chapter_functions("06_lora_qlora", "one_seed_losses")["one_seed_losses"](0.014, -0.007)
    assert "+0.014 nats" in text and "-0.007" in text and "cannot separate" in text
    assert "twice that noise" not in text and "](../" not in text
    assert "](https://gpu-efficient-training.github.io/book/book/references.html)" in text


def test_ch06_ch07_code_cells_link_absolutely():
    for stem in ("06_lora_qlora", "07_distributed_zero"):
        assert "](../" not in (NOTEBOOKS / f"{stem}.py").read_text(), stem
