"""scripts/chapter_order.py and `make notebooks`: every chapter still runs under nbval, longest first, two workers."""

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("chapter_order", ROOT / "scripts" / "chapter_order.py")
chapter_order = importlib.util.module_from_spec(spec)
spec.loader.exec_module(chapter_order)


def recipe(target):
    """The recipe lines of one Makefile target, continuation lines joined."""
    make = (ROOT / "Makefile").read_text()
    text = make[make.index(f"\n{target}:"):]
    text = text[: text.index("\n\n")].replace("\\\n", " ")
    return " ".join(text.split())


def test_the_order_is_every_notebook_pytest_collects_each_once():
    """Ordering the chapters must not drop one: the list equals what `pytest notebooks` collects today."""
    pytest.importorskip("nbval")
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "--nbval-lax", "-p", "no:cacheprovider",
                           "-p", "no:xdist", "notebooks"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    collected = {line.split("::")[0] for line in done.stdout.splitlines() if "::" in line}
    ordered = [str(p.relative_to(ROOT)) for p in chapter_order.order(ROOT / "notebooks")]
    assert len(ordered) == len(set(ordered))
    assert set(ordered) == collected
    assert len(collected) >= 10


def test_the_longest_chapter_comes_first_and_one_without_a_time_before_all(tmp_path):
    (tmp_path / "chapters.json").write_text(json.dumps({"chapters": [
        {"file": "01_a.ipynb", "gpus": 1, "minutes": {"CPU tiny": 0.3}},
        {"file": "02_b.ipynb", "gpus": 1, "minutes": {"CPU tiny": 0.9}},
        {"file": "03_c.ipynb", "gpus": 1, "minutes": {"CPU tiny": None}},
        {"file": "04_d.ipynb", "gpus": 2, "minutes": {"CPU tiny": 0.3}},
    ]}))
    for name in ["01_a", "02_b", "03_c", "04_d", "05_new", ".ipynb_checkpoints/01_a-checkpoint"]:
        path = tmp_path / f"{name}.ipynb"
        path.parent.mkdir(exist_ok=True)
        path.write_text("{}")
    names = [p.name for p in chapter_order.order(tmp_path)]
    assert names == ["03_c.ipynb", "05_new.ipynb", "02_b.ipynb", "01_a.ipynb", "04_d.ipynb"]


def test_the_real_order_follows_the_cpu_minutes_of_chapters_json():
    minutes = chapter_order.cpu_minutes(ROOT / "notebooks")
    times = [minutes.get(p.name, float("inf")) for p in chapter_order.order(ROOT / "notebooks")]
    assert times == sorted(times, reverse=True)


def test_the_script_prints_one_path_a_line_and_fails_on_an_empty_folder(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "chapter_order.py"), "notebooks"], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0
    assert done.stdout.split() == [str(p.relative_to(ROOT)) for p in chapter_order.order(ROOT / "notebooks")]
    lines = done.stdout.split("\n")
    assert lines[-1] == "" and all(line.startswith("notebooks/") and line.endswith(".ipynb") for line in lines[:-1])
    empty = subprocess.run([sys.executable, str(ROOT / "scripts" / "chapter_order.py"), str(tmp_path)],
                           capture_output=True, text=True)
    assert empty.returncode == 1 and "no notebooks" in empty.stderr


def test_make_notebooks_keeps_the_nbval_run_and_spreads_it_over_workers_by_file():
    line = recipe("notebooks")
    for flag in ["GPUBOOK_PROFILE=tiny", "MPLBACKEND=Agg", "-m pytest", "--nbval-lax", "--nbval-current-env",
                 "-n $(WORKERS)", "--dist loadfile", "--no-loadscope-reorder", "scripts/chapter_order.py notebooks",
                 "OMP_NUM_THREADS=$(THREADS)"]:
        assert flag in line, flag
    # The list of files feeds pytest only if the script succeeded (an empty list would collect the whole repository).
    assert re.search(r"files=\$\$\(\S+ scripts/chapter_order.py notebooks\) && ", line)
    assert "--dist loadfile" in recipe("unit") and "OMP_NUM_THREADS=$(THREADS)" in recipe("unit")
    # Two workers on CI's two cores, one torch thread each (two threads each ran 10-40x slower there).
    make = (ROOT / "Makefile").read_text()
    assert re.search(r"^WORKERS \?= 2$", make, flags=re.M) and re.search(r"^THREADS \?= 1$", make, flags=re.M)


def test_pytest_xdist_is_pinned_with_the_test_dependencies():
    dev = re.search(r"^dev = \[(.*?)^\]", (ROOT / "pyproject.toml").read_text(), flags=re.M | re.S).group(1)
    assert re.search(r'"pytest-xdist>=3\.8,<\d+"', dev)
