"""scripts/gpu_check.py (make gpu-test): its comparison policy, on synthetic notebooks (no GPU needed)."""

import copy
import importlib.util
import json
import os
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)
SANITIZERS = gpu_check.load_sanitizers(ROOT / "notebooks" / "sanitize.cfg")


def run(env, memory, timing, figure_text):
    """A chapter's code cells as one GPU run printed them."""
    nb = nbformat.v4.new_notebook()
    outputs = [
        [nbformat.v4.new_output("stream", name="stdout", text=env)],
        [nbformat.v4.new_output("execute_result", execution_count=2, data={"text/plain": memory})],
        [nbformat.v4.new_output("stream", name="stdout", text=timing)],
        [nbformat.v4.new_output("display_data", data={"text/plain": figure_text, "image/png": "iVBORw0KGgo="})],
    ]
    nb.cells = [nbformat.v4.new_markdown_cell("# 1. A chapter")]
    for i, outs in enumerate(outputs, start=1):
        cell = nbformat.v4.new_code_cell(f"cell_{i}()")
        cell.outputs, cell.execution_count, cell.id = outs, i, f"cell{i}"
        nb.cells.append(cell)
    return nbformat.from_dict(copy.deepcopy(nb))


H200 = run("GPU  1 x NVIDIA H200, 140.4 GiB each\nNVIDIA driver  580.159.04\n2026-11-22T23:16:22Z",
           "               peak allocated (MiB)\nfp32 AdamW                 5,120.00\nbf16 AdamW                 3,840.50",
           "step 41.2 ms, 97.1 samples/s, peak 5,120 MiB",
           "<Figure size 640x480 with 1 Axes>")
H100 = run("GPU  1 x NVIDIA H100 80GB HBM3, 79.6 GiB each\nNVIDIA driver  570.86.15\n2026-12-01T08:00:00Z",
           "               peak allocated (MiB)\nfp32 AdamW                 5,120.00\nbf16 AdamW                 3,840.50",
           "step 44.9 ms, 89.0 samples/s, peak 5,120 MiB",
           "<Figure size 640x480 with 1 Axes>")
IGNORE = {"cell3": "timings beside the memory numbers"}  # by cell id


def test_the_plan_ignores_the_environment_and_listed_cells_and_checks_memory_outputs():
    assert [v for v, _ in gpu_check.plan(H200, IGNORE)] == ["ignored", "checked", "ignored", "not compared"]
    assert [v for v, _ in gpu_check.plan(H200, {})][2] == "checked"  # unlisted: its MiB number is compared


def test_a_rerun_on_another_gpu_of_the_family_passes():
    counts, mismatches = gpu_check.compare(H200, H100, IGNORE, SANITIZERS)
    assert mismatches == []
    assert counts == {"checked": 1, "ignored": 2, "not compared": 1}


def test_a_deliberate_change_to_a_memory_number_fails():
    changed = copy.deepcopy(H100)
    out = changed.cells[2].outputs[0]
    out["data"]["text/plain"] = out["data"]["text/plain"].replace("3,840.50", "3,840.75")
    counts, mismatches = gpu_check.compare(H200, changed, IGNORE, SANITIZERS)
    (mismatch,) = mismatches
    assert "code cell 2 differs" in mismatch and "3,840.75" in mismatch


def test_timings_in_a_checked_cell_are_sanitized_but_memory_is_not():
    counts, mismatches = gpu_check.compare(H200, H100, {}, SANITIZERS)  # cell 3 now checked
    assert mismatches == [] and counts["checked"] == 2
    changed = copy.deepcopy(H100)
    changed.cells[3].outputs[0]["text"] = "step 44.9 ms, 89.0 samples/s, peak 5,121 MiB"
    assert gpu_check.compare(H200, changed, {}, SANITIZERS)[1]


def test_the_sanitizers_keep_memory_numbers_and_remove_the_machine():
    text = "after the first CUDA call  1,235.88 MiB  617.56\nNVIDIA driver  580.159.04\nNVIDIA H100 80GB HBM3, 79.6 GiB each"
    clean = gpu_check.sanitize(text, SANITIZERS)
    assert "1,235.88 MiB  617.56" in clean
    assert "580.159.04" not in clean and "H100" not in clean and "79.6" not in clean


def test_a_different_number_of_cells_fails():
    shorter = copy.deepcopy(H100)
    shorter.cells.pop()
    assert gpu_check.compare(H200, shorter, IGNORE, SANITIZERS)[1] == ["4 code cells committed, 3 executed"]


def test_compare_an_executed_folder_from_the_command_line(tmp_path, capsys):
    executed = tmp_path / "executed"
    executed.mkdir()
    for chapter in ("01_memory_anatomy.ipynb",):
        (executed / chapter).write_bytes((ROOT / "notebooks" / chapter).read_bytes())
    assert gpu_check.main(["--executed", str(executed), "01_memory_anatomy.ipynb"]) == 0
    assert "01_memory_anatomy.ipynb: ok: checked" in capsys.readouterr().out


def test_the_config_names_existing_chapters_and_cells_with_reasons():
    config = gpu_check.json.loads((ROOT / "notebooks" / "gpu_check.json").read_text())["ignore"]
    for name, cells in config.items():
        ids = [c["id"] for c in gpu_check.code_cells(gpu_check.json.loads((ROOT / "notebooks" / name).read_text()))]
        assert all(i in ids[1:] and reason.strip() for i, reason in cells.items()), name  # ids of code cells 2, 3, ...


def test_a_figure_is_not_compared_even_through_its_text_repr():
    table = {"output_type": "stream", "name": "stdout", "text": "peak 1,024.00 MiB\n"}
    figure = {"output_type": "display_data", "data": {"image/png": "iVBOR", "text/plain": "<Figure size 700x400 with 2 Axes>"}}
    with_fig = {"cell_type": "code", "outputs": [table, figure]}
    without = {"cell_type": "code", "outputs": [table]}
    assert gpu_check.output_text(with_fig) == gpu_check.output_text(without) == "peak 1,024.00 MiB\n"


def test_stdout_split_into_chunks_by_a_flush_compares_equal_to_one_chunk():
    # Chapter 10's planner printout came back from an H100 re-run as one chunk where the committed run had two:
    # joining chunks with a newline had added a blank line and made the same output differ.
    def stdout(text):
        return {"output_type": "stream", "name": "stdout", "text": text}

    warning = {"output_type": "stream", "name": "stderr", "text": "UserWarning: ...\n"}
    two = {"cell_type": "code", "outputs": [stdout("verdict: fits\n"), warning, stdout("cheapest changes:\n  x1.00\n")]}
    one = {"cell_type": "code", "outputs": [stdout("verdict: fits\ncheapest changes:\n  x1.00\n")]}
    assert gpu_check.output_text(two) == gpu_check.output_text(one) == "verdict: fits\ncheapest changes:\n  x1.00\n"
    table = {"output_type": "execute_result", "data": {"text/plain": "peak  1.00 GiB"}}
    after = {"cell_type": "code", "outputs": [stdout("a\n"), table, stdout("b\n")]}
    assert gpu_check.output_text(after) == "a\n\npeak  1.00 GiB\nb\n"


def test_restamp_after_a_reproduced_run_refreshes_the_stamp_and_nothing_else(tmp_path, monkeypatch, capsys):
    """The --restamp branch of a GPU run, on a CPU: torch's CUDA answers and the execution are faked."""
    import json
    import shutil

    import torch

    notebooks = tmp_path / "notebooks"
    (notebooks / "scripts").mkdir(parents=True)
    for name in ("chapters.json", "sanitize.cfg", "gpu_check.json", "01_memory_anatomy.ipynb",
                 "02_dtypes_quantization.ipynb"):
        shutil.copy(ROOT / "notebooks" / name, notebooks / name)
    shutil.copytree(ROOT / "helpers", tmp_path / "helpers", ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(gpu_check, "ROOT", tmp_path)
    monkeypatch.setattr(gpu_check, "NOTEBOOKS", notebooks)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(gpu_check.stamps, "provenance", lambda paths, commit, root: ("feedc0de", []))
    one, two = notebooks / "01_memory_anatomy.ipynb", notebooks / "02_dtypes_quantization.ipynb"
    before = {p: json.loads(p.read_text()) for p in (one, two)}

    def execute(path, out_dir, timeout_s):  # chapter 1 reproduces; chapter 2 prints another memory number
        nb = json.loads(path.read_text())
        if path.name.startswith("02"):
            cell = next(c for c, (v, _) in zip(gpu_check.code_cells(nb), gpu_check.plan(nb, {}), strict=True)
                        if v == "checked")
            cell["outputs"] = [{"output_type": "stream", "name": "stdout", "text": "1,234.00 MiB\n"}]
        return nb

    monkeypatch.setattr(gpu_check, "execute", execute)
    for name in ("GPUBOOK_PROFILE", "PYTHONPATH"):  # main() sets them: restored after the test
        monkeypatch.setenv(name, os.environ.get(name, ""))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    assert gpu_check.main(["--restamp", one.name, two.name]) == 1  # chapter 2's mismatch fails the check
    out = capsys.readouterr().out
    assert "re-stamped: 01_memory_anatomy.ipynb" in out and "re-stamped: 02" not in out
    assert json.loads(two.read_text()) == before[two]  # not reproduced: untouched
    after = json.loads(one.read_text())
    stamp = after["metadata"]["gpubook"].pop("execution")
    old = before[one]["metadata"]["gpubook"].pop("execution")
    assert after == before[one]  # outputs and everything else as they were
    assert stamp["verified_by"] == "scripts/gpu_check.py" and stamp["commit"] == "feedc0de"
    assert stamp["gpu"] == "NVIDIA H100 80GB HBM3" and stamp["outputs_from"]["date"] == old["date"]
    assert stamp["verified"]["checked"] > 0
    # The fresh stamp holds today's hashes: the hygiene check finds nothing stale in chapter 1.
    spec_c = importlib.util.spec_from_file_location("check_notebooks", ROOT / "scripts" / "check_notebooks.py")
    check_notebooks = importlib.util.module_from_spec(spec_c)
    spec_c.loader.exec_module(check_notebooks)
    problems, note = check_notebooks.stamp_status(one, json.loads(one.read_text()), tmp_path / "helpers",
                                                  {"require_stamp": [], "allow": {}})
    assert problems == [] and "verified by scripts/gpu_check.py" in note


def test_restamp_is_refused_without_a_run_that_executes():
    assert gpu_check.main(["--restamp", "--plan"]) == 2


def test_a_dirty_tree_is_compared_but_not_restamped(tmp_path, monkeypatch, capsys):
    import json

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(gpu_check.stamps, "provenance", lambda paths, commit, root: ("abc", ["helpers/plan.py"]))
    monkeypatch.setattr(gpu_check, "execute", lambda path, out_dir, timeout_s: json.loads(path.read_text()))
    monkeypatch.setattr(gpu_check, "restamp", lambda *a: pytest.fail("must not re-stamp"))
    for name in ("GPUBOOK_PROFILE", "PYTHONPATH"):  # main() sets them: restored after the test
        monkeypatch.setenv(name, os.environ.get(name, ""))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    assert gpu_check.main(["--restamp", "01_memory_anatomy.ipynb"]) == 0
    captured = capsys.readouterr()
    assert "not re-stamping" in captured.err and "01_memory_anatomy.ipynb: ok" in captured.out


def test_a_verdict_that_flips_in_the_rerun_fails_the_check(tmp_path, capsys):
    """Speed conclusions must survive a re-run: one changed verdict word in a rendered sentence fails the check."""
    executed = tmp_path / "executed"
    executed.mkdir()
    name = "01_memory_anatomy.ipynb"
    nb = json.loads((ROOT / "notebooks" / name).read_text())
    nb["cells"].append({"cell_type": "code", "id": "flipcell", "metadata": {}, "execution_count": None, "source": "",
                        "outputs": [{"output_type": "display_data", "metadata": {},
                                     "data": {"text/markdown": "fused AdamW: 1.20×, faster", "text/plain": "x"}}]})
    committed = tmp_path / "committed"
    committed.mkdir()
    (committed / name).write_text(json.dumps(nb))
    nb["cells"][-1]["outputs"][0]["data"]["text/markdown"] = "fused AdamW: 1.01×, no difference beyond the noise"
    (executed / name).write_text(json.dumps(nb))
    report = tmp_path / "report.json"
    assert gpu_check.main(["--executed", str(executed), "--report", str(report), name],
                          committed_dir=committed) == 1
    out = capsys.readouterr().out
    assert "1 flipped (1 not declared noise-sensitive)" in out and "verdict flip: cell flipcell" in out
    assert json.loads(report.read_text())[name]["undeclared_flips"] == 1
    (executed / name).write_text((committed / name).read_text())
    assert gpu_check.main(["--executed", str(executed), name], committed_dir=committed) == 0
