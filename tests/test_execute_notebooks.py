"""scripts/execute_notebooks.py: runs chapters in a fresh kernel with the chosen profile, installs only what is missing."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("execute_notebooks", ROOT / "scripts" / "execute_notebooks.py")
execute_notebooks = importlib.util.module_from_spec(spec)
spec.loader.exec_module(execute_notebooks)


def test_wheel_names_map_to_distributions():
    assert execute_notebooks._dist_name(Path("nvidia_ml_py-12.575.51-py3-none-any.whl")) == "nvidia-ml-py"
    assert execute_notebooks._dist_name(Path("torch-2.13.0-cp311-cp311-linux_x86_64.whl")) == "torch"


def test_only_missing_wheels_are_installed(tmp_path, monkeypatch):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for name in ("torch-2.13.0-cp311-none-any.whl", "surely_missing_pkg_xyz-1.0-py3-none-any.whl"):
        (wheels / name).write_bytes(b"")
    calls = []
    monkeypatch.setattr(execute_notebooks.subprocess, "run", lambda argv, check: calls.append(argv))
    added = execute_notebooks.install_missing(wheels, tmp_path / "site")
    assert added == ["surely-missing-pkg-xyz"]  # torch is installed here: never reinstalled
    (argv,) = calls
    assert "--no-index" in argv and "--no-deps" in argv
    assert [a for a in argv if a.endswith(".whl")] == [str(wheels / "surely_missing_pkg_xyz-1.0-py3-none-any.whl")]


@pytest.mark.skipif(importlib.util.find_spec("nbclient") is None, reason="needs nbclient")
def test_a_notebook_runs_in_a_fresh_kernel_with_the_profile_and_this_checkout(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(
        "import os, helpers\nprint(os.environ['GPUBOOK_PROFILE'])\nprint(os.path.dirname(os.path.dirname(helpers.__file__)))")]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    source = tmp_path / "01_probe.ipynb"
    nbformat.write(nb, source)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "execute_notebooks.py"), str(source),
                           "--out", str(out), "--profile", "tiny", "--timeout", "120"],
                          capture_output=True, text=True, timeout=300)
    assert "01_probe.ipynb: executed" in proc.stdout, proc.stdout + proc.stderr
    assert proc.returncode != 0  # the hygiene check then rejects a CPU run, as it must
    executed = nbformat.read(out / "01_probe.ipynb", as_version=4)
    profile, package_root = executed.cells[0].outputs[0]["text"].split()
    assert profile == "tiny" and Path(package_root) == ROOT
    assert executed.cells[0].execution_count == 1
    assert not source.with_name("01_probe.ipynb").read_text().count('"outputs": [\n     {')  # source untouched
