"""CPU tests of the planner's held-out set (helpers/plan/heldout.py) and of the chapter's held-out sentences."""

from __future__ import annotations

import hashlib
import json
import math

import pytest
import torch

from helpers import plan
from helpers.plan import check
from helpers.plan.heldout import CONFIGS, HELDOUT

# The digest of the frozen set as committed (bb5b1b8). A change of a row or a config changes it: add rows
# instead of editing them, and say so in chapter 10.
FROZEN_SHA256 = "263369c09df00f20597565259ba9c36eaca9619f1b63cfea9a96d28c87d5e28b"


def test_the_heldout_set_is_frozen():
    digest = hashlib.sha256(json.dumps({"configs": CONFIGS, "rows": HELDOUT}, sort_keys=True).encode()).hexdigest()
    assert digest == FROZEN_SHA256, "helpers/plan/heldout.py changed: add rows, do not edit them"


def test_the_heldout_set_covers_what_the_issue_asks():
    rows = plan.heldout_setups()
    assert len(rows) >= 15 and len({r["name"] for r, _ in rows}) == len(rows)
    assert len({r["family"] for r, _ in rows}) >= 3
    in_sample = {plan.shape(s).family for s in plan.VALIDATION_SETUPS}
    assert not {r["family"] for r, _ in rows} & in_sample  # no BERT, no GPT-NeoX
    setups = [s for _, s in rows]
    assert all(plan.shape(s).family == "llama" for s in setups)  # Llama, Mistral, Qwen2 share the planner's terms
    cfgs = [s.model for s in setups]
    assert all(c.num_key_value_heads < c.num_attention_heads for c in cfgs)  # grouped-query attention everywhere
    assert {s.use_cache for s in setups} >= {None, False}
    assert max(s.seq for s in setups) == 4096
    assert any(s.qlora and s.checkpointing == "full" for s in setups)  # peft's standard QLoRA recipe
    assert {"adamw8bit", "paged-adamw8bit", "adafactor"} <= {s.optimizer for s in setups}
    assert any(s.grad_accum > 1 for s in setups) and any(s.attention == "eager" for s in setups)
    assert all(plan.predict(s).peak_gib < 60 for s in setups)  # every row fits an H100 with room


def test_heldout_configs_have_the_real_shapes():
    cfg = plan.heldout_config("llama3-8b-shape-2l")
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (4096, 32, 8, 128256)
    tiny = plan.heldout_config("qwen2.5-0.5b-shape", "tiny")
    assert tiny.num_attention_heads // tiny.num_key_value_heads == 4  # 14/2 has 7 query heads per group; 4/1 the nearest
    assert plan.heldout_config("llama3-8b-shape-2l", "tiny").num_key_value_heads == 1
    with pytest.raises(ValueError, match="profile"):
        plan.heldout_config("llama3-8b-shape-2l", "medium")


@pytest.mark.parametrize("name", ["l8b-amp-nocache", "q05-amp-cache"])
def test_heldout_rows_run_on_cpu_in_the_tiny_profile(name):
    row, s = next((r, s) for r, s in plan.heldout_setups("tiny") if r["name"] == name)
    m = plan.measure(s, device="cpu", steps=1)
    assert m["status"] == "ok" and m["accounted_bytes"]["weights"] == plan.weight_bytes(s)


def test_qlora_rows_go_through_peft_prepare_model_for_kbit_training():
    pytest.importorskip("bitsandbytes")
    _, s = next((r, s) for r, s in plan.heldout_setups("tiny") if r["name"] == "q15-qlora-peft-recipe")
    model = check._build_model(s, torch.device("cpu"))
    frozen = {p.dtype for n, p in model.named_parameters() if "lora_" not in n}
    assert frozen == {torch.float32, torch.uint8}  # the 4-bit weights and peft's fp32 upcasts, nothing 16-bit
    assert all(("lora_" in n) == p.requires_grad for n, p in model.named_parameters())


def test_use_cache_is_a_setup_field_that_the_label_shows():
    s = plan.Setup(model="gpt-neox-1.3b")
    assert "cache" not in s.label()
    assert s.replace(use_cache=False).label().endswith("no-cache")
    with pytest.raises(ValueError, match="use_cache"):
        plan.validate(s.replace(use_cache="no"))


# --- the chapter's sentences, every branch, with fabricated measurements ----------------------------------


def _table(errors: dict[str, float | str]):
    """A held-out table where row ``name`` measured its prediction / (1 + error); a string is a status."""
    rows = []
    for row, s in plan.heldout_setups():
        e = errors.get(row["name"], "not measured (CPU)")
        if isinstance(e, str):
            rows.append((row, s, {"status": e, "peak_allocated_bytes": None}))
        else:
            p = plan.predict(s)
            rows.append((row, s, {"status": "ok", "peak_allocated_bytes": int(p.peak_bytes / (1 + e / 100)),
                                  "peak_phase": p.peak_phase}))
    return plan.heldout_table(rows)


NAMES = [r["name"] for r in HELDOUT]


def test_sentence_when_nothing_was_measured():
    text = plan.describe_heldout(_table({}))
    assert text.startswith(f"None of the {len(NAMES)} held-out setups was measured")
    assert "not measured (CPU)" in text
    sm = plan.heldout_summary(_table({}))
    assert sm["measured"] == 0 and math.isnan(sm["median_abs_pct"]) and math.isnan(sm["max_abs_pct"])


def test_sentence_when_the_goal_is_met():
    table = _table({n: 1.0 + 0.1 * i for i, n in enumerate(NAMES)})
    text = plan.describe_heldout(table)
    assert f"On the {len(NAMES)} held-out setups measured, setups" in text
    assert "That meets the held-out goal" in text and "It under-predicts none of them." in text
    assert "over-prediction, the safe side" in text and "By family:" in text
    assert "not measured" not in text and "indications" not in text and "ran out of memory" not in text
    sm = plan.heldout_summary(table)
    assert sm["max_abs_pct"] == pytest.approx(1.0 + 0.1 * (len(NAMES) - 1), rel=1e-3)


def test_sentence_when_the_worst_row_is_an_under_prediction_beyond_the_maximum():
    errs = {n: 0.5 for n in NAMES}
    errs["m7b-qlora-peft-recipe"] = -16.0
    text = plan.describe_heldout(_table(errs))
    assert "*m7b-qlora-peft-recipe*" in text and "(-16.0%), an under-prediction" in text
    assert "misses the held-out goal" in text and "the maximum is above 8%" in text
    assert "the median is above" not in text and "more than half" not in text
    assert "It under-predicts 1 of the 19 rows." in text


def test_sentence_when_every_part_of_the_goal_is_missed():
    text = plan.describe_heldout(_table({n: -4.0 - i for i, n in enumerate(NAMES)}))
    for part in ("the median is above 3%", "the maximum is above 8%", "more than half of the rows are under-predicted"):
        assert part in text


def test_sentence_with_few_rows_one_family_and_an_oom():
    table = _table({"l8b-amp-cache": 2.0, "l8b-amp-nocache": -1.0, "l1b-amp-nocache": "oom",
                    "l1b-bf16-accum": "failed: RuntimeError: x"})
    text = plan.describe_heldout(table)
    assert "On the 2 held-out setups measured (of 19; not measured:" in text
    assert "1 oom" in text and "1 failed" in text
    assert "read these as indications" in text and "By family" not in text
    assert "1 held-out run ran out of memory on this GPU: *l1b-amp-nocache*." in text
    one = plan.describe_heldout(_table({"l8b-amp-cache": 2.0}))
    assert "On the 1 held-out setup measured" in one and "It under-predicts none of them." in one
