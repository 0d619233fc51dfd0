"""scripts/check_workflows.py: workflow files parse and run only Makefile targets that exist."""

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("yaml")
ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("check_workflows", ROOT / "scripts" / "check_workflows.py")
check_workflows = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_workflows)

TARGETS = {"test", "gpu-test", "book"}
GOOD = """
on:
  pull_request:
jobs:
  test:
    runs-on: ubuntu-latest
    steps:
      - uses: actions/checkout@v4
      - run: make VAR=1 test
"""


def problems(tmp_path, text):
    path = tmp_path / "w.yml"
    path.write_text(text)
    return check_workflows.check(path, TARGETS)


def test_a_good_workflow_passes(tmp_path):
    assert problems(tmp_path, GOOD) == []


@pytest.mark.parametrize(("edit", "problem"), [
    (("make VAR=1 test", "make tset"), "no target 'tset'"),
    (("make VAR=1 test", "pytest tests"), "call no Makefile target"),
    (("actions/checkout@v4", "actions/checkout"), "not pinned"),
    (("    runs-on: ubuntu-latest\n", ""), "no runs-on"),
    (("on:\n  pull_request:\n", ""), "no trigger"),
    (("      - run: make VAR=1 test", "      - run: make test\n     bad: [indent"), "not valid YAML"),
])
def test_each_problem_is_reported(tmp_path, edit, problem):
    found = problems(tmp_path, GOOD.replace(*edit))
    assert any(problem in p for p in found), found


def test_the_makefile_targets_are_read(tmp_path):
    makefile = tmp_path / "Makefile"
    makefile.write_text("VAR := 1\nX ?= 2\n.PHONY: a\na: b\n\techo\nb:\n\techo\n")
    assert check_workflows.makefile_targets(makefile) >= {"a", "b"}
    assert "VAR" not in check_workflows.makefile_targets(makefile)
    assert {"test", "gpu-test", "linkcheck", "colab-like", "book"} <= check_workflows.makefile_targets(ROOT / "Makefile")
