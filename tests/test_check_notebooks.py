"""The notebook hygiene check (scripts/check_notebooks.py) catches what it promises to catch."""

import importlib.util
from pathlib import Path

import nbformat
import pytest

spec = importlib.util.spec_from_file_location("check_notebooks", Path(__file__).parents[1] / "scripts" / "check_notebooks.py")
check_notebooks = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_notebooks)

ENV_OUTPUT = "GPU     1 x NVIDIA H200, 140.4 GiB each\nprofile             full (set GPUBOOK_PROFILE=tiny|full to override)"


def notebook(tmp_path, cells):
    """Write a notebook whose code cells are (source, outputs) pairs, executed 1, 2, ..."""
    nb = nbformat.v4.new_notebook()
    for i, (source, outputs) in enumerate(cells, start=1):
        cell = nbformat.v4.new_code_cell(source)
        cell.execution_count = i
        cell.outputs = outputs
        nb.cells.append(cell)
    path = tmp_path / "01_test.ipynb"
    nbformat.write(nb, path)
    return path


def stream(text):
    return nbformat.v4.new_output("stream", name="stdout", text=text)


def env_cell():
    return ("env.report(prof)", [nbformat.v4.new_output("execute_result", data={"text/plain": ENV_OUTPUT}, execution_count=1)])


def test_clean_notebook_passes(tmp_path):
    assert check_notebooks.check(notebook(tmp_path, [env_cell(), ("# NBVAL_CHECK_OUTPUT\nprint(2)", [stream("2\n")])])) == []


@pytest.mark.parametrize(
    ("cell", "problem"),
    [
        (("1/0", [nbformat.v4.new_output("error", ename="ZeroDivisionError", evalue="division by zero", traceback=[])]), "error output"),
        (("x", [stream("Traceback (most recent call last):\n  ...")]), "a traceback"),
        (("x", [stream("saved to /home/alice/ckpt\n")]), "machine-local path"),
        (("# NBVAL_CHECK_OUTPUT  (checked)\nprint(2)", [stream("2\n")]), "nbval ignores this marker"),
    ],
)
def test_each_problem_is_reported(tmp_path, cell, problem):
    problems = check_notebooks.check(notebook(tmp_path, [env_cell(), cell]))
    assert any(problem in p for p in problems), problems


def test_out_of_order_execution_and_cpu_environment_are_reported(tmp_path):
    path = notebook(tmp_path, [("env.report(prof)", [stream("GPU  none (CPU run)\nprofile  tiny\n")]), ("x", [])])
    nb = nbformat.read(path, as_version=4)
    nb.cells[1].execution_count = 5
    nbformat.write(nb, path)
    problems = check_notebooks.check(path)
    assert any("execution counts" in p for p in problems)
    assert any("names no NVIDIA GPU" in p for p in problems)
    assert any("full profile" in p for p in problems)
