"""scripts/execute_notebooks.py: runs chapters in a fresh kernel with the chosen profile, installs only what is missing."""

import importlib.util
import json
import os
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
        "import os, helpers\nprint(os.environ['GPUBOOK_PROFILE'])\nprint(os.path.dirname(os.path.dirname(helpers.__file__)))"
        "\nprint(os.environ.get('MPLBACKEND', 'inline'))")]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    source = tmp_path / "01_probe.ipynb"
    nbformat.write(nb, source)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "execute_notebooks.py"), str(source),
                           "--out", str(out), "--profile", "tiny", "--timeout", "120"],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "MPLBACKEND": "Agg"})  # set for CPU nbval; it must not reach the kernel
    assert "01_probe.ipynb: executed" in proc.stdout, proc.stdout + proc.stderr
    assert "MPLBACKEND=Agg unset" in proc.stdout
    assert proc.returncode != 0  # the hygiene check then rejects a CPU run, as it must
    executed = nbformat.read(out / "01_probe.ipynb", as_version=4)
    profile, package_root, backend = executed.cells[0].outputs[0]["text"].split()
    assert profile == "tiny" and Path(package_root) == ROOT
    assert "inline" in backend  # with MPLBACKEND=Agg a kernel drops every figure from the outputs
    assert executed.cells[0].execution_count == 1
    assert not source.with_name("01_probe.ipynb").read_text().count('"outputs": [\n     {')  # source untouched


spec_c = importlib.util.spec_from_file_location("check_notebooks", ROOT / "scripts" / "check_notebooks.py")
check_notebooks = importlib.util.module_from_spec(spec_c)
spec_c.loader.exec_module(check_notebooks)


def tiny_notebook(path, *sources):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(s) for s in sources]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return path


def test_the_full_profile_is_refused_without_a_gpu(tmp_path, monkeypatch, capsys):
    path = tiny_notebook(tmp_path / "01_probe.ipynb", "print(1)")
    before = path.read_bytes()
    monkeypatch.setattr(execute_notebooks, "gpus", lambda: (0, None))
    monkeypatch.setattr(execute_notebooks, "execute", lambda *a, **k: pytest.fail("must not execute"))
    assert execute_notebooks.main([str(path), "--profile", "full"]) == 2
    assert "refusing to run the full profile without a CUDA GPU" in capsys.readouterr().err
    assert path.read_bytes() == before


def test_a_chapter_needing_more_gpus_than_the_machine_has_is_skipped(tmp_path, monkeypatch, capsys):
    chapters = tmp_path / "chapters.json"
    chapters.write_text(json.dumps({"chapters": [{"file": "01_a.ipynb", "gpus": 1}, {"file": "07_b.ipynb", "gpus": 2}]}))
    for name in ("GPUBOOK_PROFILE", "PYTHONPATH", "MPLBACKEND"):  # main() sets them: restored after the test
        monkeypatch.setenv(name, os.environ.get(name, ""))
    monkeypatch.setattr(execute_notebooks, "provenance", lambda paths, commit, root: ("abc", []))
    ran = []
    monkeypatch.setattr(execute_notebooks, "gpus", lambda: (1, "NVIDIA H100 80GB HBM3"))
    monkeypatch.setattr(execute_notebooks, "chapter_order", lambda: execute_notebooks.json.loads(chapters.read_text())["chapters"])

    def execute(path, *args, **kwargs):
        ran.append(path.name)
        raise RuntimeError("not executed in this test")

    monkeypatch.setattr(execute_notebooks, "execute", execute)
    assert execute_notebooks.main([]) == 1
    assert ran == ["01_a.ipynb"]
    assert "07_b.ipynb: SKIPPED: needs 2 GPUs, this machine has 1" in capsys.readouterr().out


def test_the_committed_chapter_order_lists_every_chapter_once():
    files = [c["file"] for c in execute_notebooks.chapter_order()]
    assert files == sorted(p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    assert all(c["gpus"] in (1, 2) for c in execute_notebooks.chapter_order())


@pytest.mark.skipif(importlib.util.find_spec("nbclient") is None, reason="needs nbclient")
def test_a_failed_run_leaves_the_notebook_untouched_and_a_good_one_is_stamped_and_timed(tmp_path):
    bad = tiny_notebook(tmp_path / "01_bad.ipynb", "x = 1", "1 / 0")
    before = bad.read_bytes()
    with pytest.raises(Exception, match="ZeroDivisionError"):
        execute_notebooks.execute(bad, bad, timeout_s=120, gpu=None, profile="tiny")
    assert bad.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["01_bad.ipynb"]  # no temporary file left behind

    good = tiny_notebook(tmp_path / "02_good.ipynb", "print(6 * 7)")
    record = execute_notebooks.execute(good, good, timeout_s=120, gpu="NVIDIA H100 80GB HBM3", profile="tiny")
    execute_notebooks.record_time(tmp_path / "execution_times.json", good.stem, record)
    executed = nbformat.read(good, as_version=4)
    assert executed.cells[0].outputs[0]["text"] == "42\n"
    stamp = executed.metadata["gpubook"]["execution"]
    assert stamp == record and stamp["gpu"] == "NVIDIA H100 80GB HBM3" and stamp["wall_s"] >= 0
    assert stamp["stamp_format"] == 2 and list(stamp["cells"]) == [executed.cells[0].id]
    # The stamp is what the hygiene check compares against: an unchanged notebook is not stale.
    assert check_notebooks.stamp_status(good, json.loads(good.read_text()))[0] == []
    times = json.loads((tmp_path / "execution_times.json").read_text())
    assert times["chapters"]["02_good"]["wall_s"] == record["wall_s"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["01_bad.ipynb", "02_good.ipynb", "execution_times.json"]


def test_a_full_run_from_a_dirty_tree_is_refused(tmp_path, monkeypatch, capsys):
    path = tiny_notebook(tmp_path / "01_probe.ipynb", "print(1)")
    for name in ("GPUBOOK_PROFILE", "PYTHONPATH", "MPLBACKEND"):
        monkeypatch.setenv(name, os.environ.get(name, ""))
    monkeypatch.setattr(execute_notebooks, "gpus", lambda: (1, "NVIDIA H100 80GB HBM3"))
    monkeypatch.setattr(execute_notebooks, "provenance", lambda paths, commit, root: ("abc", ["helpers/measure.py"]))
    monkeypatch.setattr(execute_notebooks, "execute", lambda *a, **k: pytest.fail("must not execute"))
    assert execute_notebooks.main([str(path)]) == 2
    assert "refusing to stamp outputs from sources that are not in git" in capsys.readouterr().err


def test_a_full_run_without_git_records_the_given_commit(tmp_path, monkeypatch, capsys):
    """The GPU branch of main() on a CPU: a fake GPU, a fake execution, the real provenance (no git here)."""
    path = tiny_notebook(tmp_path / "01_probe.ipynb", "print(1)")
    for name in ("GPUBOOK_PROFILE", "PYTHONPATH", "MPLBACKEND"):  # main() sets them: restored after the test
        monkeypatch.setenv(name, os.environ.get(name, ""))
    monkeypatch.setattr(execute_notebooks, "gpus", lambda: (1, "NVIDIA H100 80GB HBM3"))
    monkeypatch.setattr(execute_notebooks, "ROOT", tmp_path)  # a copied tree: no .git
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    ran = []

    def execute(path, out, timeout_s, gpu, profile, commit):
        ran.append((path.name, gpu, profile, commit))
        return {"wall_s": 1.0, "gpu": gpu, "torch": "2.13.0", "profile": profile, "date": "d", "commit": commit}

    monkeypatch.setattr(execute_notebooks, "execute", execute)
    execute_notebooks.main([str(path), "--commit", "c0ffee1"])  # (its hygiene check then fails: no real run)
    assert ran == [("01_probe.ipynb", "NVIDIA H100 80GB HBM3", "full", "c0ffee1")]
    monkeypatch.delenv("GPUBOOK_COMMIT", raising=False)
    ran.clear()
    execute_notebooks.main([str(path)])
    assert ran[0][3] == "unknown" and "no git here and no --commit" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("nbclient") is None, reason="needs nbclient")
def test_sources_edited_during_the_run_are_not_stamped(tmp_path):
    path = tiny_notebook(tmp_path / "01_edit.ipynb", "import json, pathlib\n"
                         "p = pathlib.Path('01_edit.ipynb')\n"
                         "nb = json.loads(p.read_text())\n"
                         "nb['cells'][0]['source'] = 'print(2)'\n"
                         "p.write_text(json.dumps(nb))")
    out = tmp_path / "out.ipynb"
    with pytest.raises(RuntimeError, match="changed during the run"):
        execute_notebooks.execute(path, out, timeout_s=120, gpu=None, profile="tiny", commit="abc")
    assert not out.exists()
