"""Golden tests: the helpers' CPU arithmetic against the numbers the book printed from a GPU run.

The fixtures in ``tests/golden/`` are read out of the committed notebook outputs (H100 runs) by
``scripts/golden_extract.py``, which records each number's notebook, cell id and run date; refresh them
with it after a GPU re-run. These tests never read a notebook and never need a GPU: they recompute each
number with the helpers (the planner, the rules, the ZeRO formula) and compare it with the printed one, so a
silent change of a formula (a dropped term, an off-by-one, a wrong byte count) fails here, on a CPU.

Tolerances follow the printed precision: a number printed with two decimals is matched to two decimals. The
planner's validation rows (chapter 10) keep the planner as accurate as it was on the GPU: each row's
|error| may not exceed max(its committed |error|, 0.5%) + 0.25 percentage points.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from helpers import estimates, plan

GOLDEN = Path(__file__).parent / "golden"
GIB, MIB = 2**30, 2**20


def golden(name: str) -> dict:
    return json.loads((GOLDEN / name).read_text())


def test_every_fixture_names_its_gpu_run():
    for path in sorted(GOLDEN.glob("*.json")):
        for src in json.loads(path.read_text())["sources"]:
            assert src["notebook"].startswith("notebooks/") and src["cell_id"], path.name
            assert src["profile"] == "full" and src["gpu"] and src["run_date"], path.name


# --------------------------------------------------------------------------------------------------------
# Chapter 10, section 10.2: the planner against 35 peaks measured on an H100

CH10 = golden("ch10_planner_validation.json")
MEASURED = [r for r in CH10["rows"] if r.get("measured_bytes")]  # rows that ran (not out of time or memory)


def test_the_validation_table_is_the_planners_setup_list():
    assert len(CH10["rows"]) == len(plan.VALIDATION_SETUPS)
    assert [r["setup"] for r in CH10["rows"]] == [s.label() for s in plan.VALIDATION_SETUPS]
    assert len(MEASURED) >= 30, "the committed run measured fewer than 30 rows: refresh after a full GPU run"


@pytest.mark.parametrize("row", MEASURED, ids=[f"row{r['row']}" for r in MEASURED])
def test_planner_stays_as_accurate_as_on_the_gpu(row):
    s = plan.VALIDATION_SETUPS[row["row"] - 1]
    assert s.label() == row["setup"]
    err = 100 * (plan.predict(s).peak_bytes / row["measured_bytes"] - 1)
    allowed = max(abs(row["error_pct"]), 0.5) + 0.25
    assert abs(err) <= allowed, (
        f"row {row['row']} ({row['setup']}): the planner is now {err:+.2f}% off the H100's "
        f"{row['measured_gib']:.2f} GiB, against {row['error_pct']:+.2f}% in the committed run (allowed ±{allowed:.2f})")


def test_planner_median_error_over_the_validation_rows():
    errs = sorted(abs(100 * (plan.predict(plan.VALIDATION_SETUPS[r["row"] - 1]).peak_bytes / r["measured_bytes"] - 1))
                  for r in MEASURED)
    committed = sorted(abs(r["error_pct"]) for r in MEASURED)
    median = errs[len(errs) // 2]
    assert median <= committed[len(committed) // 2] + 0.1


# --------------------------------------------------------------------------------------------------------
# Chapter 1: bytes of bert-large and of the 1.3B model

CH1 = golden("ch01_bytes.json")


def test_bert_large_parameters_and_weight_bytes():
    s = plan.Setup(model="bert-large", precision="fp32", optimizer="adamw")
    assert plan.shape(s).n_params == CH1["bert_large"]["params"]
    assert round(plan.weight_bytes(s) / MIB) == CH1["bert_large"]["weights_mib"]


def test_fp32_adamw_bytes_per_parameter_rule_and_count():
    bpp = CH1["fp32_adamw_bytes_per_param"]
    rule = estimates.BYTES_PER_PARAM["fp32_adamw"]
    for part, key in (("weights", "weights"), ("gradients", "gradients"), ("optimizer states", "optimizer_states")):
        assert rule[key] == bpp[part]["rule"]
    assert sum(rule.values()) == bpp["total"]["rule"]
    s = plan.Setup(model="bert-large", precision="fp32", optimizer="adamw")
    n = plan.shape(s).n_params
    counted = {"weights": plan.weight_bytes(s), "gradients": plan.gradient_bytes(s),
               "optimizer states": plan.optimizer_state_bytes(s)}
    for part, b in counted.items():
        assert round(b / n, 2) == bpp[part]["counted"], part
    assert round(sum(counted.values()) / n, 2) == bpp["total"]["counted"]


@pytest.mark.parametrize("batch", sorted(CH1["gpt_neox_1_3b_fp16_adamw_gib"]))
def test_fp16_adamw_model_states_of_the_1_3b_model(batch):
    """The LLM book's recipe (chapter 1, section 1.5): weights, gradients and both AdamW states in fp16."""
    printed = CH1["gpt_neox_1_3b_fp16_adamw_gib"][batch]
    s = plan.Setup(model="gpt-neox-1.3b", batch=int(batch), seq=256, precision="fp16", optimizer="adamw",
                   attention="eager")
    assert round(plan.weight_bytes(s) / GIB, 2) == printed["model (GiB)"]
    assert round(plan.gradient_bytes(s) / GIB, 2) == printed["gradients (GiB)"]
    assert round(plan.optimizer_state_bytes(s) / GIB, 2) == printed["optimizer (GiB)"]
    rule = estimates.model_state_bytes(plan.shape(s).n_params, "fp16_adamw")
    assert round(rule["weights"] / GIB, 2) == printed["model (GiB)"]
    assert round(rule["optimizer_states"] / GIB, 2) == printed["optimizer (GiB)"]


# --------------------------------------------------------------------------------------------------------
# Chapter 5: model-state bytes per recipe, optimizer-state bytes per optimizer (bert-large, fp32 weights)

CH5 = golden("ch05_optimizer_states.json")
RECIPE_RULE = {"fp32": "fp32_adamw", "tf32": "fp32_adamw", "fp16": "mixed_adamw", "bf16": "mixed_adamw"}
RECIPE_PRECISION = {"fp32": "fp32", "tf32": "fp32", "fp16": "fp16-autocast", "bf16": "bf16-autocast"}


@pytest.mark.parametrize("recipe", sorted(CH5["model_states_by_recipe"]))
def test_model_states_per_recipe_rule_and_planner(recipe):
    printed = CH5["model_states_by_recipe"][recipe]
    assert sum(estimates.BYTES_PER_PARAM[RECIPE_RULE[recipe]].values()) == printed["rule (bytes/param)"]
    s = plan.Setup(model="bert-large", precision=RECIPE_PRECISION[recipe], optimizer="adamw")
    n = plan.shape(s).n_params
    assert round(plan.weight_bytes(s) / n, 2) == printed["weights (fp32)"]
    assert round(plan.gradient_bytes(s) / n, 2) == printed["gradients (fp32)"]
    assert round(plan.optimizer_state_bytes(s) / n, 2) == printed["AdamW states (fp32)"]


CH5_OPTIMIZERS = {"AdamW (foreach)": "adamw", "AdamW (fused)": "adamw-fused", "SGD + momentum": "sgd-momentum",
                  "Adafactor": "adafactor", "8-bit AdamW (bnb)": "adamw8bit"}
# "paged 8-bit AdamW (bnb)": its states live in CUDA unified memory; the planner counts 0 bytes on the device


@pytest.mark.parametrize("name", sorted(CH5_OPTIMIZERS))
def test_optimizer_state_bytes_per_parameter(name):
    """Section 5.4's states per parameter (printed with 3 significant digits) from the planner's formula."""
    printed = CH5["optimizer_state_bytes_per_param"][name]
    s = plan.Setup(model="bert-large", batch=64, seq=128, precision="bf16-autocast", optimizer=CH5_OPTIMIZERS[name])
    bpp = plan.optimizer_state_bytes(s) / plan.shape(s).n_params
    assert float(f"{bpp:.3g}") == printed["sentence"]
    assert round(bpp, 2) == printed["table"]


# --------------------------------------------------------------------------------------------------------
# Chapter 7: the ZeRO formula (the paper's 7.5B example) and the per-rank bytes of the launched runs

CH7 = golden("ch07_zero.json")
STAGE_OF = {v: k for k, v in estimates.STAGE_LABELS.items()}
FP32_ADAMW = dict(param_bytes=4, grad_bytes=4, optimizer_bytes=8)


@pytest.mark.parametrize("label", sorted(CH7["paper_7_5b"]), ids=lambda label: label.split(" ")[0])
def test_zero_formula_against_the_paper_as_printed(label):
    printed = CH7["paper_7_5b"][label]
    total = estimates.zero_model_state_bytes(7.5e9, 64, STAGE_OF[label])["total"]
    assert round(total / 1e9, 2) == printed["formula (GB)"]
    assert round(total / GIB, 2) == printed["formula (GiB)"]
    assert round(total / 1e9, 1) == printed["paper (GB)"]


def _psi() -> int:
    return plan.shape(plan.Setup(model="gpt-neox-1.3b")).n_params


@pytest.mark.parametrize("row", CH7["per_rank"], ids=[f"{r['world_size']}x{r['strategy']}" for r in CH7["per_rank"]])
def test_zero_formula_per_rank_as_printed(row):
    f = estimates.zero_model_state_bytes(_psi(), row["world_size"], row["strategy"], **FP32_ADAMW)
    assert round(f["total"] / GIB, 2) == row["formula (GiB)"]


@pytest.mark.parametrize("row", CH7["per_rank"], ids=[f"{r['world_size']}x{r['strategy']}" for r in CH7["per_rank"]])
def test_planner_per_rank_model_states_against_the_runs(row):
    """The planner's ZeRO shares (the paper's stages) against the bytes each rank held in chapter 7's runs.

    FSDP2 as "ZeRO-2" keeps its parameters sharded at rest and gathered between forward and backward
    (``reshard_after_forward=False``), which the paper's stage 2 does not: that row is checked against the
    formula column only.
    """
    stage = estimates.STAGES.index(row["strategy"])
    s = plan.Setup(model="gpt-neox-1.3b", batch=4, seq=256, precision="fp32", optimizer="adamw",
                   zero_stage=stage, world_size=row["world_size"])
    at_step = plan.predict(s).phase_components["optimizer step"]
    states = at_step["weights"] + at_step["gradients"] + at_step["optimizer_states"]
    assert round(states / GIB, 2) == row["formula (GiB)"]
    if row["strategy"] == "zero2":
        return
    assert round(at_step["weights"] / GIB, 2) == row["parameters (GiB)"]
    assert round(at_step["gradients"] / GIB, 2) == row["gradients (GiB)"]
    assert round(at_step["optimizer_states"] / GIB, 2) == row["optimizer states (GiB)"]
    assert round(states / GIB, 2) == row["model states (GiB)"]


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_planner_peak_per_rank_against_the_two_gpu_runs(strategy):
    """DDP and ZeRO-3 on two H100s: the planner within 1% of the peak each rank reached."""
    row = next(r for r in CH7["per_rank"] if r["world_size"] == 2 and r["strategy"] == strategy)
    s = plan.Setup(model="gpt-neox-1.3b", batch=4, seq=256, precision="fp32", optimizer="adamw",
                   zero_stage=estimates.STAGES.index(strategy), world_size=2)
    assert abs(plan.predict(s).peak_gib / row["peak allocated (GiB)"] - 1) < 0.01


# --------------------------------------------------------------------------------------------------------
# Chapter 4, section 4.1: checkpointing every k layers of a chain

CH4 = golden("ch04_checkpoint_every_k.json")


def test_chain_checkpointed_every_k_stores_n_over_k_plus_k():
    """The chain keeps the input of layers 0, k, 2k, ... (N/k checkpoints) plus one segment of k outputs."""
    n = CH4["n_layers"]
    assert CH4["store_everything"] == n + 1
    for k, row in CH4["checkpoint_every"].items():
        k = int(k)
        checkpoints = len(range(0, n, k))  # the convention the planner follows for checkpointing="k"
        assert row["stored"] == checkpoints + k == n / k + k
        assert row["forwards"] == 2 * n


def test_fixture_numbers_are_finite():
    for r in CH10["rows"]:
        assert r["predicted_gib"] > 0 and (r["measured_gib"] is None or math.isfinite(r["measured_gib"]))
