"""Content-aware execution stamps (scripts/stamps.py): what makes a chapter's outputs stale, and what does not."""

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
spec = importlib.util.spec_from_file_location("check_notebooks", ROOT / "scripts" / "check_notebooks.py")
check_notebooks = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_notebooks)
stamps = check_notebooks.stamps

ENV_OUTPUT = "GPU     1 x NVIDIA H200, 140.4 GiB each\nprofile             full (set GPUBOOK_PROFILE=tiny|full to override)"
NO_ALLOWANCES = {"require_stamp": [], "allow": {}}

HELPERS = {
    "__init__.py": '"""The package."""\n\n__version__ = "0.1.0"\n',
    "measure.py": (
        '"""Memory readers."""\n\nimport torch\n\nMIB = 2**20\n\n\n'
        'def peak():\n    """Peak memory."""\n    return torch.cuda.max_memory_allocated() / MIB  # in MiB\n\n\n'
        'def unused():\n    return 1\n'),
    "timing.py": (
        '"""Timers."""\n\nfrom dataclasses import dataclass\n\nfrom helpers import measure\n\n\n'
        '@dataclass\nclass Timed:\n    median_s: float\n\n    def phrase(self):\n        return f"{self.median_s:.3f} s"\n\n\n'
        'def time_it(fn, repeat=10):\n    return Timed(_median([fn() for _ in range(repeat)]))\n\n\n'
        'def _median(values):\n    return sorted(values)[len(values) // 2]\n\n\n'
        'def compare(a, b):\n    return measure.peak() - a + b\n'),
    "plan/__init__.py": '"""The planner."""\n\nfrom helpers.plan.core import predict\n',
    "plan/core.py": ('"""Predictions."""\n\nfrom helpers.measure import MIB\n\n\n'
                     'def predict(n):\n    return n * MIB\n\n\ndef explain(n):\n    return str(n)\n'),
    "lonely.py": '"""Imported by no chapter."""\n\n\ndef f():\n    return 1\n',
}
CELLS = [
    ("c01", "import os\nfrom helpers import measure, timing\nfrom helpers.plan import predict"),
    ("c02", "seq = prof.pick(tiny=16, full=256)  # tiny: CI's CPU run\nprint(seq)"),
    ("c03", "t = timing.time_it(lambda: 1)\nprint(t.phrase(), predict(2))"),
    ("c04", 'def show():\n    """Show the peak."""\n    print(measure.peak())\n\n\nshow()'),
    ("c05", 'launch("scripts/train.py", 2)'),
]


@pytest.fixture
def repo(tmp_path):
    """A checkout: helpers/ (with a plan/ package), notebooks/01_test.ipynb stamped as executed, a script."""
    for name, text in HELPERS.items():
        (tmp_path / "helpers" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "helpers" / name).write_text(text)
    scripts = tmp_path / "notebooks" / "scripts"
    scripts.mkdir(parents=True)
    (scripts / "train.py").write_text("from helpers import timing\n\nprint(timing.compare(1, 2))\n")
    (scripts / "other.py").write_text("print('not launched by this chapter')\n")
    nb = nbformat.v4.new_notebook()
    env = nbformat.v4.new_code_cell("env.report(prof)")
    env.id, env.execution_count = "env", 1
    env.outputs = [nbformat.v4.new_output("execute_result", data={"text/plain": ENV_OUTPUT}, execution_count=1)]
    nb.cells = [nbformat.v4.new_markdown_cell("# 1. A chapter"), env]
    for i, (cell_id, source) in enumerate(CELLS, start=2):
        cell = nbformat.v4.new_code_cell(source)
        cell.id, cell.execution_count = cell_id, i
        nb.cells.append(cell)
    path = tmp_path / "notebooks" / "01_test.ipynb"
    nbformat.write(nb, path)
    stamp_as_executed(tmp_path)
    return tmp_path


def stamp_as_executed(repo):
    """Stamp the notebook as scripts/execute_notebooks.py does, from the sources on disk now."""
    path = repo / "notebooks" / "01_test.ipynb"
    nb = json.loads(path.read_text())
    hashes = stamps.fingerprint(stamps.code_cells(nb), stamps.Sources.from_dirs(repo / "helpers", path.parent / "scripts"))
    nb["metadata"]["gpubook"] = {"execution": {"stamp_format": stamps.FORMAT, "commit": "0123456", **hashes,
                                               "gpu": "NVIDIA H100 80GB HBM3", "date": "2026-11-27T00:00:00Z"}}
    path.write_text(stamps.dumps_notebook(nb))
    return hashes


def problems(repo, allowances=NO_ALLOWANCES):
    """The stale-output problems the hygiene check reports for the notebook."""
    check_notebooks._SOURCES.clear()  # the check caches today's sources per process
    path = repo / "notebooks" / "01_test.ipynb"
    return check_notebooks.stamp_status(path, json.loads(path.read_text()), repo / "helpers", allowances)[0]


def edit_helper(repo, name, old, new):
    path = repo / "helpers" / name
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))


def edit_cell(repo, cell_id, old, new):
    path = repo / "notebooks" / "01_test.ipynb"
    nb = nbformat.read(path, as_version=4)
    (cell,) = [c for c in nb.cells if c.get("id") == cell_id]
    assert old in cell.source
    cell.source = cell.source.replace(old, new)
    nbformat.write(nb, path)


def test_the_stamp_holds_only_what_the_chapter_reaches(repo):
    nb = json.loads((repo / "notebooks" / "01_test.ipynb").read_text())
    stamp = nb["metadata"]["gpubook"]["execution"]
    assert sorted(stamp["cells"]) == ["c01", "c02", "c03", "c04", "c05", "env"]
    reached = set(stamp["helpers"])
    assert {"measure.peak", "measure.MIB", "timing.time_it", "timing.Timed", "timing._median",
            "plan.__init__.predict", "plan.core.predict", "timing.compare"} <= reached  # compare: via the script
    assert not {"measure.unused", "plan.core.explain", "lonely", "lonely.f"} & reached
    assert stamp["scripts"] == {"train.py": stamps.sha256((repo / "notebooks/scripts/train.py").read_bytes())}
    assert problems(repo) == []


def test_a_docstring_or_comment_edit_is_not_stale(repo):
    edit_helper(repo, "measure.py", '"""Peak memory."""', '"""Peak allocated memory, in MiB."""')
    edit_helper(repo, "measure.py", "# in MiB", "# MiB: binary units")
    edit_helper(repo, "__init__.py", '"""The package."""', '"""The package: a module map."""')
    edit_cell(repo, "c04", '"""Show the peak."""', '"""Print the peak."""')
    edit_cell(repo, "c02", "# tiny: CI's CPU run", "# the tiny value keeps CI short")
    assert problems(repo) == []


def test_a_code_edit_in_a_reached_function_is_stale(repo):
    edit_helper(repo, "timing.py", "return sorted(values)[len(values) // 2]", "return sorted(values)[0]")
    (problem,) = problems(repo)
    assert "helpers timing._median changed" in problem and '"helpers": "timing._median"' in problem


def test_a_code_edit_reached_through_a_package_reexport_is_stale(repo):
    edit_helper(repo, "plan/core.py", "return n * MIB", "return n * MIB * 2")
    assert any("helpers plan.core.predict changed" in p for p in problems(repo))


def test_an_edit_to_an_unreached_function_or_unimported_module_or_a_new_one_is_not_stale(repo):
    edit_helper(repo, "measure.py", "def unused():\n    return 1", "def unused():\n    return 2")
    edit_helper(repo, "plan/core.py", "return str(n)", "return repr(n)")
    edit_helper(repo, "lonely.py", "return 1", "return 3")
    edit_helper(repo, "timing.py", "def compare(", "def difference(a, b):\n    return a - b\n\n\ndef compare(")
    (repo / "helpers" / "brand_new.py").write_text("def g():\n    return 0\n")
    (repo / "helpers" / "plan" / "check.py").write_text("def error_table():\n    return []\n")
    assert problems(repo) == []


def test_a_tiny_only_edit_is_not_stale_and_a_full_value_edit_is(repo):
    edit_cell(repo, "c02", "tiny=16", "tiny=8")
    assert problems(repo) == []
    edit_cell(repo, "c02", "full=256", "full=512")
    (problem,) = problems(repo)
    assert "code cell c02 changed" in problem and '"cell_id": "c02"' in problem


def test_a_moved_cell_is_not_stale_an_added_or_removed_one_is(repo):
    path = repo / "notebooks" / "01_test.ipynb"
    nb = nbformat.read(path, as_version=4)
    nb.cells[3], nb.cells[4] = nb.cells[4], nb.cells[3]  # c02 and c03 swap places
    nbformat.write(nb, path)
    assert problems(repo) == []
    nb.cells.append(nbformat.v4.new_markdown_cell("Prose changes nothing."))
    nbformat.write(nb, path)
    assert problems(repo) == []
    removed = nb.cells.pop(5)
    extra = nbformat.v4.new_code_cell("print(1)")
    extra.id = "c99"
    nb.cells.append(extra)
    nbformat.write(nb, path)
    found = problems(repo)
    assert any(f"code cell {removed.id} removed" in p for p in found)
    assert any("code cell c99 added" in p for p in found)


def test_keyword_order_and_layout_do_not_count(repo):
    edit_cell(repo, "c03", "t = timing.time_it(lambda: 1)", "t = timing.time_it(\n    lambda: 1,\n)")
    assert problems(repo) == []
    assert stamps.cell_hash("f(a=1, b=2)") == stamps.cell_hash("f(b=2,  a=1)") != stamps.cell_hash("f(a=2, b=1)")


def test_a_changed_launched_script_is_stale_an_unnamed_one_is_not(repo):
    (repo / "notebooks/scripts/other.py").write_text("print('changed')\n")
    assert problems(repo) == []
    (repo / "notebooks/scripts/train.py").write_text("from helpers import timing\n\nprint(timing.compare(2, 1))\n")
    assert any("scripts/train.py changed" in p for p in problems(repo))


def test_a_helper_the_launched_script_reaches_counts(repo):
    edit_helper(repo, "timing.py", "return measure.peak() - a + b", "return measure.peak() + a - b")
    assert any("helpers timing.compare changed" in p for p in problems(repo))


def test_local_imports_bare_module_use_and_import_side_effects_are_followed():
    package = stamps.Package({
        "__init__.py": "",
        "a.py": "def f():\n    from helpers import b\n    return b.g()\n\n\ndef h():\n    return 0\n",
        "b.py": "X = 1\n\n\ndef g():\n    return X\n\n\ndef k():\n    return 2\n",
        "c.py": "import helpers.b\n\n\ndef whole():\n    return helpers.b\n",
        "d.py": "from helpers import b\n\nb.REGISTRY = {}\n",
    })
    reach = stamps.Reach(package)
    reach.root(stamps.parse_cell("from helpers import a\na.f()"))
    assert {"a.f", "b.g", "b.X"} <= reach.reached and not {"a.h", "b.k"} & reach.reached
    reach = stamps.Reach(package)
    reach.root(stamps.parse_cell("from helpers import c\nc.whole()"))
    assert {"b.g", "b.k", "b.X"} <= reach.reached  # the module is returned as a value: all of it may run
    reach = stamps.Reach(package)
    reach.root(stamps.parse_cell("import helpers.d"))
    assert "d" in reach.reached and "b" in reach.reached  # importing runs top-level code, its imports' too


def test_a_data_file_counts_where_its_package_is_imported_and_dash_m_runs_main(repo):
    (repo / "helpers" / "plan" / "gpus.json").write_text('{"T4": 15}')
    (repo / "helpers" / "lonely_data").mkdir()
    (repo / "helpers" / "lonely_data" / "x.csv").write_text("a,b\n")
    stamp_as_executed(repo)
    (repo / "helpers" / "lonely_data" / "x.csv").write_text("a,c\n")  # no chapter imports that package
    assert problems(repo) == []
    (repo / "helpers" / "plan" / "gpus.json").write_text('{"T4": 14.75}')
    assert any("helpers plan/gpus.json changed" in p for p in problems(repo))
    package = stamps.Package({"__init__.py": "", "cli/__init__.py": "", "cli/__main__.py": "def main():\n    pass\n"})
    reach = stamps.Reach(package)
    reach.root(stamps.parse_cell('subprocess.run(f"{sys.executable} -m helpers.cli --x 1", shell=True)'))
    assert "cli.__main__.main" in reach.reached


def test_a_helper_whose_source_the_chapter_shows_is_stale_on_a_docstring_edit(repo):
    path = repo / "notebooks" / "01_test.ipynb"
    nb = nbformat.read(path, as_version=4)
    shown = nbformat.v4.new_code_cell("import inspect\nprint(inspect.getsource(measure.peak))\nhelp(timing)")
    shown.id = "c06"
    nb.cells.append(shown)
    nbformat.write(nb, path)
    stamp_as_executed(repo)
    edit_helper(repo, "measure.py", "# in MiB", "# MiB")  # a comment of a shown function: in the output
    assert any("helpers measure.peak#source changed" in p for p in problems(repo))
    stamp_as_executed(repo)
    edit_helper(repo, "timing.py", '"""Timers."""', '"""Timers, honest ones."""')  # help(module) shows it
    assert any("helpers timing#source changed" in p for p in problems(repo))
    stamp_as_executed(repo)
    edit_helper(repo, "plan/core.py", '"""Predictions."""', '"""Predictions!"""')  # not shown: no change
    assert problems(repo) == []


def test_a_long_call_chain_does_not_exhaust_the_stack():
    chain = "".join(f"def f{i}():\n    return f{i + 1}()\n\n\n" for i in range(3000)) + "def f3000():\n    return 0\n"
    reach = stamps.Reach(stamps.Package({"__init__.py": "", "deep.py": chain}))
    reach.root(stamps.parse_cell("from helpers import deep\ndeep.f0()"))
    assert "deep.f3000" in reach.reached


def test_the_serialisation_ignores_what_python_versions_add():
    import ast

    tree = ast.parse("def f(x):\n    return x\n")
    text = stamps.canon(tree)
    assert "lineno" not in text and "type_params" not in text and "type_comment" not in text
    tree.body[0].type_params = []  # Python 3.12 adds this (empty) field; 3.13's ast.dump omits empty fields
    assert stamps.canon(tree) == text


def test_magics_hash_as_text_and_a_cell_that_does_not_parse_counts_whole():
    assert stamps.cell_hash("if x:\n    %pip install a") != stamps.cell_hash("if x:\n    %pip install b")
    assert stamps.parse_cell("%%bash\necho hi") is None
    package = stamps.Package({"__init__.py": "", "m.py": "def f():\n    return 1\n"})
    reach = stamps.Reach(package)
    reach.root(None)
    assert "m.f" in reach.reached


def test_an_allowance_covers_exactly_the_change_it_names_and_unused_ones_are_reported(repo):
    edit_helper(repo, "timing.py", "return sorted(values)[len(values) // 2]", "return sorted(values)[0]")
    (problem,) = problems(repo)
    sha = problem.split('"sha256": "')[1].split('"')[0]
    allow = {"require_stamp": [], "allow": {"*": [{"helpers": "timing._median", "sha256": sha, "reason": "x"}]}}
    assert problems(repo, allow) == []
    allow["allow"]["*"][0]["reason"] = ""
    assert problems(repo, allow)  # no reason, no allowance
    (repo / "notebooks" / "stale_ok.json").write_text(json.dumps({"allow": {"01_test.ipynb": [
        {"cell_id": "c02", "sha256": "0" * 64, "reason": "an old edit"}]}}))
    used = set()
    path = repo / "notebooks" / "01_test.ipynb"
    check_notebooks.check_with_note(path, repo / "helpers", used=used)
    (unused,) = check_notebooks.unused_allowances(path.parent, used, {path.name})
    assert '"cell_id": "c02"' in unused and "covers no change" in unused


def test_an_old_format_stamp_is_reported(repo):
    path = repo / "notebooks" / "01_test.ipynb"
    nb = json.loads(path.read_text())
    nb["metadata"]["gpubook"]["execution"] = {"commit": "abc", "code_cells_sha256": [], "helpers_files_sha256": {}}
    path.write_text(json.dumps(nb))
    (problem,) = problems(repo)
    assert "old format" in problem and "--migrate-stamps" in problem


# Migration of a format-1 stamp, and provenance, in a real git repository.

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def git(repo, *args):
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                          capture_output=True, text=True).stdout.strip()


def old_stamp(repo, nb):
    """The format-1 stamp scripts/execute_notebooks.py wrote before content hashes."""
    cells = [stamps.sha256(source) for _, source in stamps.code_cells(nb)]
    files = {p.relative_to(repo / "helpers").as_posix(): stamps.sha256(p.read_bytes())
             for p in sorted((repo / "helpers").rglob("*.py"))}  # (format 1 knew no subpackages: top-level names)
    return {"commit": git(repo, "rev-parse", "HEAD"), "code_cells_sha256": cells, "helpers_files_sha256": files,
            "gpu": "NVIDIA H100 80GB HBM3", "date": "2026-11-20T00:00:00Z", "wall_s": 60.0}


@needs_git
def test_migration_recomputes_the_hashes_from_the_stamps_commit(repo):
    path = repo / "notebooks" / "01_test.ipynb"
    nb = json.loads(path.read_text())
    del nb["metadata"]["gpubook"]
    path.write_text(stamps.dumps_notebook(nb))
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "executed")
    nb["metadata"]["gpubook"] = {"execution": old_stamp(repo, nb)}
    path.write_text(stamps.dumps_notebook(nb))
    # Since that run: a docstring (old stamps: stale), a tiny-only edit (old: stale), a real edit to one cell.
    edit_helper(repo, "measure.py", '"""Peak memory."""', '"""Peak allocated memory."""')
    edit_cell(repo, "c02", "tiny=16", "tiny=4")
    edit_cell(repo, "c03", "predict(2)", "predict(3)")
    git(repo, "commit", "-qam", "later edits")
    assert "migrated 6 of 6 code cells and 5 of 5 helpers files" in stamps.migrate(path, repo)
    stamp = json.loads(path.read_text())["metadata"]["gpubook"]["execution"]
    assert stamp["stamp_format"] == stamps.FORMAT and stamp["wall_s"] == 60.0 and "migrated" in stamp
    (problem,) = problems(repo)
    assert "code cell c03 changed" in problem
    assert stamps.migrate(path, repo) == "already in the content-hash format"


@needs_git
def test_migration_leaves_what_the_commit_cannot_vouch_for_unverified(repo):
    path = repo / "notebooks" / "01_test.ipynb"
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "sources")
    edit_helper(repo, "timing.py", "repeat=10", "repeat=20")  # run from an uncommitted tree
    nb = json.loads(path.read_text())
    nb["metadata"]["gpubook"] = {"execution": {**old_stamp(repo, nb), "commit": git(repo, "rev-parse", "HEAD")
                                               + "+uncommitted"}}
    path.write_text(stamps.dumps_notebook(nb))
    assert "4 of 5 helpers files" in stamps.migrate(path, repo)
    found = problems(repo)
    assert any("helpers/timing.py: the sources the chapter ran with are not in git" in p for p in found)


@needs_git
def test_provenance_names_what_differs_from_head(repo):
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "sources")
    head = git(repo, "rev-parse", "HEAD")
    notebook = repo / "notebooks" / "01_test.ipynb"
    assert stamps.provenance([notebook], None, repo) == (head, [])
    edit_helper(repo, "measure.py", "return 1", "return 2")
    commit, dirty = stamps.provenance([notebook], None, repo)
    assert commit == head and dirty == ["helpers/measure.py"]
    assert stamps.provenance([notebook], "fffffff", repo)[1][0].startswith("--commit fffffff is not HEAD")


def test_provenance_without_git_takes_the_given_commit(tmp_path, monkeypatch):
    monkeypatch.delenv("GPUBOOK_COMMIT", raising=False)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert stamps.provenance([], "abc1234", tmp_path) == ("abc1234", [])
    monkeypatch.setenv("GPUBOOK_COMMIT", "def5678")
    assert stamps.provenance([], None, tmp_path) == ("def5678", [])
    monkeypatch.delenv("GPUBOOK_COMMIT")
    assert stamps.provenance([], None, tmp_path) == ("unknown", [])


def test_the_committed_chapters_stamps_are_current_and_cells_keyed_by_id():
    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        stamp = json.loads(path.read_text())["metadata"]["gpubook"]["execution"]
        assert stamps.is_current(stamp), path.name
        ids = [key for key, _ in stamps.code_cells(json.loads(path.read_text()))]
        assert len(set(ids)) == len(ids) and not any(k.startswith("code-") for k in ids), path.name
