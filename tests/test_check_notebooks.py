"""The notebook hygiene check (scripts/check_notebooks.py) catches what it promises to catch."""

import importlib.util
import json
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


# Stale outputs: the execution stamp against today's code cells and helpers.

def stamped(tmp_path, helpers):
    """A clean notebook stamped the way scripts/execute_notebooks.py stamps it, and its helpers folder."""
    path = notebook(tmp_path, [env_cell(), ("x = 1  # a comment", [])])
    nb = nbformat.read(path, as_version=4)
    nb.metadata["gpubook"] = {"execution": {
        "commit": "0123456789abcdef", "gpu": "NVIDIA H100 80GB HBM3", "date": "2026-11-23T15:00:00Z",
        **check_notebooks.code_fingerprint(nb), **check_notebooks.helpers_fingerprint(helpers)}}
    nbformat.write(nb, path)
    return path


@pytest.fixture
def helpers(tmp_path):
    folder = tmp_path / "helpers"
    folder.mkdir()
    (folder / "measure.py").write_text('def peak():\n    """Peak memory."""\n    return 1\n')
    return folder


NO_ALLOWANCES = {"require_stamp": [], "allow": {}}


def edit_cell(path, source):
    nb = nbformat.read(path, as_version=4)
    nb.cells[1].source = source
    nbformat.write(nb, path)


def test_an_unchanged_stamped_notebook_passes(tmp_path, helpers):
    problems, note = check_notebooks.check_with_note(stamped(tmp_path, helpers), helpers, NO_ALLOWANCES)
    assert problems == [] and note.startswith("stamped: NVIDIA H100")


def test_an_unstamped_notebook_passes_unless_a_stamp_is_required(tmp_path, helpers):
    path = notebook(tmp_path, [env_cell()])
    problems, note = check_notebooks.check_with_note(path, helpers, NO_ALLOWANCES)
    assert problems == [] and note == "not stamped (executed before stamping)"
    required = {"require_stamp": [path.name], "allow": {}}
    assert any("requires one" in p for p in check_notebooks.check(path, helpers, required))
    everyone = {"require_stamp": ["*"], "allow": {}}
    assert any("requires one" in p for p in check_notebooks.check(path, helpers, everyone))
    others = {"require_stamp": ["01_other.ipynb"], "allow": {}}
    assert check_notebooks.check(path, helpers, others) == []


def test_a_changed_code_cell_makes_the_outputs_stale(tmp_path, helpers):
    path = stamped(tmp_path, helpers)
    edit_cell(path, "x = 2  # a comment")
    (problem,) = check_notebooks.check(path, helpers, NO_ALLOWANCES)
    assert "code cell 2 changed" in problem


def test_an_added_cell_makes_the_outputs_stale(tmp_path, helpers):
    path = stamped(tmp_path, helpers)
    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell("y = 3"))
    nb.cells[-1].execution_count = 3
    nbformat.write(nb, path)
    assert any("3 code cells now, 2 when executed" in p for p in check_notebooks.check(path, helpers, NO_ALLOWANCES))


def test_a_changed_or_added_helpers_file_makes_the_outputs_stale(tmp_path, helpers):
    path = stamped(tmp_path, helpers)
    (helpers / "measure.py").write_text('def peak():\n    """Peak memory."""\n    return 2\n')
    (helpers / "new.py").write_text("")
    problems = check_notebooks.check(path, helpers, NO_ALLOWANCES)
    assert any("helpers/measure.py changed" in p for p in problems)
    assert any("helpers/new.py added" in p for p in problems)


def test_an_allowance_covers_exactly_the_change_it_names(tmp_path, helpers):
    path = stamped(tmp_path, helpers)
    edit_cell(path, "x = 1  # a better comment")
    (helpers / "measure.py").write_text('def peak():\n    """Peak allocated memory, in bytes."""\n    return 1\n')
    cell_sha = check_notebooks.sha256("x = 1  # a better comment")
    file_sha = check_notebooks.sha256((helpers / "measure.py").read_bytes())
    allow = {"require_stamp": [], "allow": {
        path.name: [{"cell": 2, "sha256": cell_sha, "reason": "comment reworded"}],
        "*": [{"helpers": "measure.py", "sha256": file_sha, "reason": "docstring"}]}}
    problems, note = check_notebooks.check_with_note(path, helpers, allow)
    assert problems == [] and "2 change(s) allowed" in note
    # A later edit is not covered by the allowance written for the earlier one ...
    edit_cell(path, "x = 5  # a better comment")
    assert any("code cell 2 changed" in p for p in check_notebooks.check(path, helpers, allow))
    # ... and an allowance without a reason covers nothing.
    edit_cell(path, "x = 1  # a better comment")
    allow["allow"][path.name][0]["reason"] = ""
    assert any("code cell 2 changed" in p for p in check_notebooks.check(path, helpers, allow))


def test_the_allowances_file_is_read_beside_the_notebooks(tmp_path, helpers):
    path = stamped(tmp_path, helpers)
    edit_cell(path, "x = 1  # reworded")
    assert check_notebooks.check(path, helpers)  # no stale_ok.json: stale
    (tmp_path / "stale_ok.json").write_text(json.dumps({"allow": {path.name: [
        {"cell": 2, "sha256": check_notebooks.sha256("x = 1  # reworded"), "reason": "comment"}]}}))
    assert check_notebooks.check(path, helpers) == []


def _with_markdown(path, text):
    nb = nbformat.read(path, as_version=4)
    nb.cells.insert(0, nbformat.v4.new_markdown_cell(text))
    nbformat.write(nb, path)
    return path


def test_raw_myst_roles_in_markdown_fail_unless_allowed(tmp_path):
    path = _with_markdown(notebook(tmp_path, [env_cell()]),
                          "Peak {glue:text}`peak_gib:.2f` GiB, as {cite:p}`korthikanti2022reducing` predicts.")
    problems = check_notebooks.check(path)
    assert any("2 raw MyST roles in markdown (allowed: 0)" in p for p in problems)
    (tmp_path / "raw_roles.json").write_text(json.dumps({"allowed": {"01_test.ipynb": 2}}))
    assert check_notebooks.check(path) == []
    (tmp_path / "raw_roles.json").write_text(json.dumps({"allowed": {"01_test.ipynb": 1}}))  # the ratchet
    assert any("(allowed: 1)" in p for p in check_notebooks.check(path))


def test_roles_in_code_cells_and_plain_braces_are_not_counted(tmp_path):
    path = _with_markdown(notebook(tmp_path, [env_cell(), ('glue("x", 1)  # {glue:text}`x`', [])]),
                          "A set {a, b} and `code`, rendered by a code cell.")
    assert check_notebooks.check(path) == []


def test_the_committed_allowances_match_the_chapters():
    """Every allowance is exactly the chapter's count: a chapter that lost roles must lower its number."""
    folder = Path(__file__).parents[1] / "notebooks"
    allowed = check_notebooks.raw_roles_allowed(folder)
    for name, n in allowed.items():
        assert check_notebooks.raw_roles(json.loads((folder / name).read_text())) == n, name
    assert "08_profiling.ipynb" not in allowed
