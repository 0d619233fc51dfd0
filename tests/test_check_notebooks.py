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


# Stale outputs: the execution stamp against today's code cells and helpers (details: tests/test_stamps.py).

def stamped(tmp_path, helpers):
    """A clean notebook stamped the way scripts/execute_notebooks.py stamps it, and its helpers folder."""
    path = notebook(tmp_path, [env_cell(), ("from helpers import measure\nx = measure.peak()  # a comment", [])])
    nb = json.loads(path.read_text())
    hashes = check_notebooks.stamps.fingerprint(check_notebooks.stamps.code_cells(nb),
                                                check_notebooks.stamps.Sources.from_dirs(helpers, None))
    nb["metadata"]["gpubook"] = {"execution": {
        "stamp_format": 2, "commit": "0123456789abcdef", "gpu": "NVIDIA H100 80GB HBM3", "date": "2026-11-23T15:00:00Z",
        **hashes}}
    path.write_text(check_notebooks.stamps.dumps_notebook(nb))
    check_notebooks._SOURCES.clear()
    return path


@pytest.fixture
def helpers(tmp_path):
    folder = tmp_path / "helpers"
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    (folder / "measure.py").write_text('def peak():\n    """Peak memory."""\n    return 1\n')
    return folder


NO_ALLOWANCES = {"require_stamp": [], "allow": {}}


def code_id(path, n=2):
    nb = nbformat.read(path, as_version=4)
    return [c for c in nb.cells if c.cell_type == "code"][n - 1].id


def edit_cell(path, source):
    nb = nbformat.read(path, as_version=4)
    nb.cells[1].source = source
    nbformat.write(nb, path)
    check_notebooks._SOURCES.clear()


def edit_helper(helpers, text):
    (helpers / "measure.py").write_text(text)
    check_notebooks._SOURCES.clear()


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


def test_a_changed_code_cell_makes_the_outputs_stale_a_comment_does_not(tmp_path, helpers):
    path = stamped(tmp_path, helpers)
    edit_cell(path, "from helpers import measure\nx = measure.peak()  # another comment")
    assert check_notebooks.check(path, helpers, NO_ALLOWANCES) == []
    edit_cell(path, "from helpers import measure\nx = 2 * measure.peak()  # a comment")
    (problem,) = check_notebooks.check(path, helpers, NO_ALLOWANCES)
    assert f"code cell {code_id(path)} changed" in problem


def test_an_added_cell_makes_the_outputs_stale(tmp_path, helpers):
    path = stamped(tmp_path, helpers)
    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell("y = 3"))
    nb.cells[-1].execution_count = 3
    nbformat.write(nb, path)
    assert any(f"code cell {nb.cells[-1].id} added" in p for p in check_notebooks.check(path, helpers, NO_ALLOWANCES))


def test_a_changed_helper_the_chapter_calls_makes_the_outputs_stale_a_docstring_or_new_file_does_not(tmp_path, helpers):
    path = stamped(tmp_path, helpers)
    edit_helper(helpers, 'def peak():\n    """Peak allocated memory, in MiB."""\n    return 1\n')
    (helpers / "new.py").write_text("def f():\n    return 1\n")
    assert check_notebooks.check(path, helpers, NO_ALLOWANCES) == []
    edit_helper(helpers, 'def peak():\n    """Peak memory."""\n    return 2\n')
    (problem,) = check_notebooks.check(path, helpers, NO_ALLOWANCES)
    assert "helpers measure.peak changed" in problem


def test_an_allowance_covers_exactly_the_change_it_names(tmp_path, helpers):
    path = stamped(tmp_path, helpers)
    edit_cell(path, "from helpers import measure\nx = measure.peak() + 0")
    edit_helper(helpers, 'def peak():\n    """Peak memory."""\n    return 1 + 0\n')
    cell_sha = check_notebooks.stamps.cell_hash("from helpers import measure\nx = measure.peak() + 0")
    unit_sha = check_notebooks.stamps.Package({"measure.py": (helpers / "measure.py").read_text()}).unit_hash(
        "measure.peak")
    allow = {"require_stamp": [], "allow": {
        path.name: [{"cell_id": code_id(path), "sha256": cell_sha, "reason": "adds zero"}],
        "*": [{"helpers": "measure.peak", "sha256": unit_sha, "reason": "adds zero"}]}}
    problems, note = check_notebooks.check_with_note(path, helpers, allow)
    assert problems == [] and "2 change(s) allowed" in note
    # A later edit is not covered by the allowance written for the earlier one ...
    edit_cell(path, "from helpers import measure\nx = measure.peak() + 5")
    assert any(f"code cell {code_id(path)} changed" in p for p in check_notebooks.check(path, helpers, allow))
    # ... and an allowance without a reason covers nothing.
    edit_cell(path, "from helpers import measure\nx = measure.peak() + 0")
    allow["allow"][path.name][0]["reason"] = ""
    assert any(f"code cell {code_id(path)} changed" in p for p in check_notebooks.check(path, helpers, allow))


def test_the_allowances_file_is_read_beside_the_notebooks(tmp_path, helpers):
    path = stamped(tmp_path, helpers)
    edit_cell(path, "from helpers import measure\nx = measure.peak() + 0")
    assert check_notebooks.check(path, helpers)  # no stale_ok.json: stale
    (tmp_path / "stale_ok.json").write_text(json.dumps({"allow": {path.name: [
        {"cell_id": code_id(path), "sha256": check_notebooks.stamps.cell_hash("from helpers import measure\n"
                                                                              "x = measure.peak() + 0"),
         "reason": "adds zero"}]}}))
    assert check_notebooks.check(path, helpers) == []


def test_the_committed_allowances_are_few_and_each_covers_a_change():
    folder = Path(__file__).parents[1] / "notebooks"
    used: set = set()
    names = set()
    for path in sorted(folder.glob("[0-9][0-9]_*.ipynb")):
        check_notebooks.check_with_note(path, used=used)
        names.add(path.name)
    assert check_notebooks.unused_allowances(folder, used, names) == []
    entries = check_notebooks.load_allowances(folder)["allow"]
    assert sum(len(v) for v in entries.values()) <= 7  # 25 before content-aware stamps; each expires at a re-run


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


@pytest.mark.parametrize("where", ["markdown", "rendered", "code"])
def test_relative_links_to_pages_fail_absolute_ones_and_code_calls_pass(tmp_path, where):
    bad = "([Hu et al. (2022)](../book/references.md#hu))"
    good = "([Hu et al. (2022)](https://gpu-efficient-training.github.io/book/book/references.html#hu))"
    md = nbformat.v4.new_output("display_data", data={"text/markdown": bad})
    cells = [env_cell(), ("f(x)[0](y)", [])]  # a call on an indexed value is not a link
    if where == "rendered":
        cells.append(("display(Markdown(text))", [md]))
    elif where == "code":
        cells.append((f'text = "{bad}"', []))
    path = notebook(tmp_path, cells)
    if where == "markdown":
        _with_markdown(path, f"See {bad} and the [next chapter](02_dtypes.ipynb#section).")
    problems = check_notebooks.check(path)
    assert any("relative link (../book/references.md#hu)" in p for p in problems), problems
    if where == "markdown":
        assert any("relative link (02_dtypes.ipynb#section)" in p for p in problems)
        assert any("relative link (setup.md)" in p for p in check_notebooks.check(
            _with_markdown(notebook(tmp_path, [env_cell()]), "The [setup](setup.md) (first) page.")))
    clean = notebook(tmp_path, [env_cell(), (f'text = "{good}"', [])])
    assert check_notebooks.check(_with_markdown(clean, f"See {good}.")) == []
