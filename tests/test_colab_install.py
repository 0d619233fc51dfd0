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
