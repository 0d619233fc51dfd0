"""The chapters' Colab install lines (scripts/colab_install.py reads them; `make colab-like` runs them)."""

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))

spec = importlib.util.spec_from_file_location("colab_install", ROOT / "scripts" / "colab_install.py")
colab_install = importlib.util.module_from_spec(spec)
spec.loader.exec_module(colab_install)


@pytest.mark.parametrize("notebook", CHAPTERS, ids=lambda p: p.stem)
def test_install_line_is_quiet_keeps_torch_and_needs_no_restart(notebook):
    """Quiet (-q), no resolver warning box (--no-warn-conflicts), no torch, and no editable install: an
    editable install is importable only after a kernel restart."""
    args = colab_install.install_line(notebook)
    assert "-q" in args and "--no-warn-conflicts" in args, args
    assert "-e" not in args and "--editable" not in args, args
    assert not any(re.match(r"torch\b", a) for a in args if not a.startswith("-")), args


def test_install_line_refuses_torch(tmp_path):
    nb = tmp_path / "nb.ipynb"
    nb.write_text('{"cells": [{"cell_type": "code", "source": ["%pip install -q torch helpers"]}]}')
    with pytest.raises(ValueError, match="names torch"):
        colab_install.install_line(nb)


def test_no_dependency_floor_would_replace_colabs_kernel_packages():
    """torch and IPython are imported by Colab's running kernel: their floors must stay at or below what Colab
    ships (torch 2.6 is far below it; IPython 7.34 is what Colab's kernel runs)."""
    deps = re.search(r"^dependencies = \[(.*?)^\]", (ROOT / "pyproject.toml").read_text(), flags=re.M | re.S).group(1)
    pins = dict(re.findall(r'"(torch|ipython)([^"]*)"', deps))
    assert pins["torch"] == ">=2.6" and pins["ipython"] == ">=7.34", pins


def test_source_replaces_the_repository_with_the_checkout_and_keeps_the_flags(tmp_path):
    args = colab_install.install_line(CHAPTERS[0])
    local = colab_install.from_source(args, tmp_path)
    assert local == [str(tmp_path.resolve()) if "git+" in a else a for a in args]
    assert "-q" in local and "--no-warn-conflicts" in local and str(tmp_path.resolve()) in local
    with pytest.raises(ValueError, match="no git"):
        colab_install.from_source(["-q", "peft"], tmp_path)


COLAB_PINS = ROOT / "constraints" / "colab.txt"


def _colab_pins() -> dict[str, str]:
    pins = {}
    for line in COLAB_PINS.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pins[name.lower().replace("_", "-")] = version
    return pins


def test_the_colab_image_is_the_one_that_broke_the_install():
    """constraints/colab.txt holds Colab's late-2025 image: peft 0.17.x with transformers 4.x, the combination
    under which the old floors kept peft and `from transformers import Trainer` failed (issue 25)."""
    pins = _colab_pins()
    assert pins["peft"].startswith("0.17.") and pins["transformers"].startswith("4.")
    assert {"torch", "accelerate", "ipython", "ipykernel"} <= set(pins)
    assert all(re.fullmatch(r"\d+(\.\d+)+", v) for v in pins.values()), pins  # exact versions, no local labels


def test_the_book_floors_make_pip_upgrade_what_colab_has_that_is_too_old():
    """Every pyproject floor above Colab's version is an upgrade pip will make in the reader's kernel: only
    packages nothing has imported yet may be among them (transformers, peft, accelerate, ...), never torch
    or IPython, which the running kernel has loaded."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    deps = re.search(r"^dependencies = \[(.*?)^\]", (ROOT / "pyproject.toml").read_text(), flags=re.M | re.S).group(1)
    pins = _colab_pins()
    upgraded = set()
    for spec in re.findall(r'^\s*"([^"]+)"', deps, flags=re.M):
        req = Requirement(spec)
        name = req.name.lower()
        if name in pins and not req.specifier.contains(Version(pins[name])):
            upgraded.add(name)
    assert "peft" in upgraded and "transformers" in upgraded  # the fix for Colab's first failure
    assert not upgraded & {"torch", "ipython", "ipykernel", "numpy"}, upgraded


def test_make_colab_like_installs_colabs_packages_first_then_the_install_line_then_chapters_1_and_6():
    make = (ROOT / "Makefile").read_text()
    recipe = make[make.index("\ncolab-like:"):]
    recipe = recipe[: recipe.index("\n\n")]
    steps = [line.strip() for line in recipe.splitlines()[1:]]
    first = next(i for i, s in enumerate(steps) if "constraints/colab.txt" in s)
    install = next(i for i, s in enumerate(steps) if "scripts/colab_install.py" in s)
    tests = next(i for i, s in enumerate(steps) if "nbval" in s and "pytest" in s and "GPUBOOK_PROFILE=tiny" in s)
    assert first < install < tests
    chapters = re.search(r"^COLAB_CHAPTERS \?= (.*)$", make, flags=re.M).group(1).split()
    assert chapters == ["01_memory_anatomy.ipynb", "06_lora_qlora.ipynb"]
    assert all((ROOT / "notebooks" / c).exists() for c in chapters)
