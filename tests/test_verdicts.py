"""scripts/verdicts.py: the verdict words of rendered outputs and the flips between two executions."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import verdicts  # noqa: E402


def md(text):
    return {"output_type": "display_data", "data": {"text/markdown": text, "text/plain": "<IPython.core.display.Markdown object>"}}


def cell(cid, *outputs):
    return {"cell_type": "code", "id": cid, "source": "", "outputs": list(outputs)}


def nb(*cells):
    return {"cells": list(cells)}


def test_extract_reads_markdown_streams_and_tables_in_order():
    c = cell("a", md("Fused AdamW: 1.20×, faster (95% interval 1.1–1.3×); the step is GPU-bound."),
             {"output_type": "stream", "name": "stdout", "text": ["TF32: no difference beyond the noise\n"]},
             {"output_type": "execute_result", "data": {"text/plain": "change  verdict\nfused   slower\nloop    within the noise",
                                                         "text/html": "<td>faster</td>"}})
    assert verdicts.extract(c) == ["faster", "GPU-bound", "no difference beyond the noise", "slower", "within the noise"]


def test_extract_matches_whole_words_only():
    c = cell("a", md("The **Faster** path; slower-moving; host-bound-ish; nothing mixedup; mixed."))
    assert verdicts.extract(c) == ["mixed"]


def test_extract_reads_one_form_of_a_rich_output():
    c = cell("a", {"output_type": "display_data", "data": {"text/markdown": "faster", "text/plain": "faster"}})
    assert verdicts.extract(c) == ["faster"]


def test_compare_finds_flips_by_cell_id_and_honours_declarations():
    old = nb(cell("x", md("1.6×, faster")), cell("y", md("GPU-bound")), cell("z", md("no verdict here")))
    new = nb(cell("y", md("GPU-bound")), cell("x", md("0.96×, no difference beyond the noise")))
    compared, flips = verdicts.compare(old, new, {"x": "declared for the test"})
    assert compared == 2
    assert [(f.cell, f.committed, f.executed, f.declared) for f in flips] == [
        ("x", ("faster",), ("no difference beyond the noise",), "declared for the test")]


def test_a_verdict_that_appears_or_vanishes_is_a_flip():
    _, flips = verdicts.compare(nb(cell("x", md("faster"))), nb(cell("x", md("1.01×"))))
    assert len(flips) == 1 and flips[0].executed == ()


def test_identical_runs_have_no_flips():
    a = nb(cell("x", md("slower and host-bound")))
    assert verdicts.compare(a, json.loads(json.dumps(a))) == (1, [])


def test_at_most_three_noise_sensitive_cells(tmp_path):
    policy = tmp_path / "gpu_check.json"
    policy.write_text(json.dumps({"noise_sensitive": {"a.ipynb": {"1": "r", "2": "r"}, "b.ipynb": {"3": "r", "4": "r"}}}))
    with pytest.raises(ValueError, match="at most 3"):
        verdicts.load_noise_sensitive(policy)
    policy.write_text(json.dumps({"noise_sensitive": {"a.ipynb": {"1": " "}}}))
    with pytest.raises(ValueError, match="needs a reason"):
        verdicts.load_noise_sensitive(policy)


def test_the_books_policy_declares_few_enough():
    verdicts.load_noise_sensitive(ROOT / "notebooks" / "gpu_check.json")


def test_main_exit_codes(tmp_path, capsys):
    a, b = tmp_path / "a.ipynb", tmp_path / "b.ipynb"
    a.write_text(json.dumps(nb(cell("x", md("faster")))))
    b.write_text(json.dumps(nb(cell("x", md("slower")))))
    assert verdicts.main([str(a), str(a)]) == 0
    assert verdicts.main([str(a), str(b)]) == 1
    assert "1 flipped" in capsys.readouterr().out
