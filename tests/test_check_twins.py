"""scripts/check_twins.py: a chapter and its jupytext text twin must say the same thing."""

import importlib.util
from pathlib import Path

import nbformat
import pytest

jupytext = pytest.importorskip("jupytext")
spec = importlib.util.spec_from_file_location("check_twins", Path(__file__).parents[1] / "scripts" / "check_twins.py")
check_twins = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_twins)

# The chapters' setup cell: a Colab-only %pip inside an if block, which the twin holds as a comment.
SETUP = ('import sys\n\nif "google.colab" in sys.modules:  # Colab only\n'
         '    %pip install -q "gpu-efficient-training @ git+https://example.org/book"\n\nimport math\nmath.pi')


def paired(tmp_path, write_twin=True):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["jupytext"] = {"formats": check_twins.FORMATS,
                               "notebook_metadata_filter": "-jupytext.text_representation.jupytext_version"}
    cell = nbformat.v4.new_code_cell(SETUP)
    cell.outputs = [nbformat.v4.new_output("execute_result", data={"text/plain": "3.14"}, execution_count=1)]
    nb.cells = [nbformat.v4.new_markdown_cell("# 1. A chapter\n\nProse."), cell,
                nbformat.v4.new_code_cell("print(1)", metadata={"tags": ["remove-input"]})]
    path = tmp_path / "01_chapter.ipynb"
    nbformat.write(nb, path)
    if write_twin:
        path.with_suffix(".py").write_text(jupytext.writes(nb, fmt="py:percent"))
    return path


def test_a_pair_written_by_jupytext_is_in_sync_and_round_trips_the_setup_cell(tmp_path):
    path = paired(tmp_path)
    assert check_twins.twin_problems(path) == []
    text = path.with_suffix(".py").read_text()
    assert '    # %pip install' in text  # the magic is commented, its indentation kept
    back = jupytext.reads(text, fmt="py:percent")
    original = nbformat.read(path, as_version=4)
    assert [(c.cell_type, c.source, c.metadata.get("tags")) for c in back.cells] == \
           [(c.cell_type, c.source, c.metadata.get("tags")) for c in original.cells]


def test_an_edited_twin_or_notebook_is_out_of_sync(tmp_path):
    path = paired(tmp_path)
    twin = path.with_suffix(".py")
    twin.write_text(twin.read_text().replace("print(1)", "print(2)"))
    (problem,) = check_twins.twin_problems(path)
    assert "out of sync" in problem and "print(2)" in problem
    twin.unlink()
    assert "no text twin" in check_twins.twin_problems(path)[0]
    assert check_twins.main([str(tmp_path)]) == 1


def test_unpaired_notebook_and_orphan_twin_are_reported(tmp_path, capsys):
    path = paired(tmp_path)
    nb = nbformat.read(path, as_version=4)
    del nb.metadata["jupytext"]
    nbformat.write(nb, path)
    assert any("jupytext.formats" in p for p in check_twins.twin_problems(path))
    (tmp_path / "02_orphan.py").write_text("# %%\n")
    assert check_twins.main([str(tmp_path)]) == 1
    assert "without its notebook" in capsys.readouterr().out


def test_the_execution_stamp_and_outputs_do_not_touch_the_twin(tmp_path):
    path = paired(tmp_path)
    nb = nbformat.read(path, as_version=4)
    nb.metadata["gpubook"] = {"execution": {"gpu": "NVIDIA H100 80GB HBM3"}}
    nb.cells[2].outputs = [nbformat.v4.new_output("stream", name="stdout", text="1\n")]
    nb.cells[2].execution_count = 2
    nbformat.write(nb, path)
    assert check_twins.twin_problems(path) == []

