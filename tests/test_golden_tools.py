"""scripts/golden_extract.py (reads the printed numbers) and scripts/mutants.py (plants bugs): their parts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pandas as pd
import pytest

SCRIPTS = Path(__file__).parents[1] / "scripts"


def _load(name):
    spec = importlib.util.spec_from_file_location(f"_script_{name}", SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[f"_script_{name}"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


extract = _load("golden_extract")
mutants = _load("mutants")


def test_html_table_reads_a_multiindex_frame_as_pandas_writes_it():
    df = pd.DataFrame({"a (GiB)": [4.96, 2.48, 1.0], "b": ["x", "y", "z"]},
                      index=pd.MultiIndex.from_tuples([(1, "ddp"), (1, "zero3"), (2, "ddp")], names=["ws", "strategy"]))
    rows = extract.html_table(df.to_html(float_format="{:.2f}".format))
    assert [r[""] for r in rows] == ["1 | ddp", "1 | zero3", "2 | ddp"]
    assert [extract.number(r["a (GiB)"]) for r in rows] == [4.96, 2.48, 1.0]


def test_html_table_reads_a_styler():
    pytest.importorskip("jinja2")
    df = pd.DataFrame({"model (GiB)": [2.48, float("nan")], "result": ["ok", "out of memory"]}, index=[4, 16])
    rows = extract.html_table(df.style.format(precision=2, na_rep="—").to_html())
    assert rows[0] == {"": "4", "model (GiB)": "2.48", "result": "ok"}
    assert rows[1]["result"] == "out of memory" and extract.nan_to_none(extract.number(rows[1]["model (GiB)"])) is None


def test_text_table_reads_to_string_with_multiword_labels():
    text = pd.DataFrame({"paper (GB)": [120.0, 1.9], "formula (GB)": [120.0, 1.88]},
                        index=["DDP (replicated)", "ZeRO-3 (P_os+g+p)"]).to_string(float_format="{:,.2f}".format)
    rows = extract.text_table(text)
    assert rows == [{"": "DDP (replicated)", "paper (GB)": 120.0, "formula (GB)": 120.0},
                    {"": "ZeRO-3 (P_os+g+p)", "paper (GB)": 1.9, "formula (GB)": 1.88}]


def test_a_cpu_run_is_never_a_golden_source():
    nb = {"metadata": {"gpubook": {"execution": {"profile": "tiny", "gpu": None, "date": "2026-11-27"}}}}
    with pytest.raises(extract.ExtractError, match="not a full-profile GPU run"):
        extract.run_info(nb, "01_x.ipynb")


def test_a_cell_that_did_not_run_is_refused():
    nb = {"cells": [{"id": "c1", "cell_type": "code", "outputs": []}]}
    with pytest.raises(extract.ExtractError, match="no outputs"):
        extract.cell(nb, "01_x.ipynb", "c1")
    with pytest.raises(extract.ExtractError, match="found 0"):
        extract.cell(nb, "01_x.ipynb", "c2")


def test_mutant_search_strings_must_occur_exactly_once(tmp_path):
    (tmp_path / "helpers" / "plan").mkdir(parents=True)
    (tmp_path / "helpers" / "a.py").write_text("x = 1\ny = 2\n")
    (tmp_path / "helpers" / "plan" / "b.py").write_text("z = 3\ny = 2\n")
    once = mutants.Mutant("T1", "kind", "what", "z = 3", "z = 4", ())
    assert mutants.locate(tmp_path, once) == tmp_path / "helpers" / "plan" / "b.py"
    for find, count in (("y = 2", 2), ("w = 0", 0)):
        with pytest.raises(mutants.MutantError, match=f"found {count}"):
            mutants.locate(tmp_path, mutants.Mutant("T2", "kind", "what", find, "", ()))


def test_every_mutant_is_found_once_in_todays_helpers():
    root = Path(__file__).parents[1]
    for m in mutants.MUTANTS:
        assert mutants.locate(root, m).suffix == ".py"
        assert m.find != m.replace and all((root / t).exists() for t in m.tests), m.id
    assert len({m.id for m in mutants.MUTANTS}) == len(mutants.MUTANTS)
