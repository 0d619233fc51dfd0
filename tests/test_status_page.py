"""scripts/status_page.py: the committed status page is what the committed notebooks say."""

import importlib.util
import json
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("status_page", ROOT / "scripts" / "status_page.py")
status_page = importlib.util.module_from_spec(spec)
spec.loader.exec_module(status_page)

REPORT = ("                            value\nGPU     1 x NVIDIA H100 80GB HBM3, 79.6 GiB each\n"
          "NVIDIA driver          580.159.04\nCUDA (torch build)     13.0\ntorch      2.11.0\ntransformers     5.17.0")


def test_the_committed_status_page_is_current():
    assert (ROOT / "book" / "status.md").read_text() == status_page.render(), \
        "book/status.md is out of date: run python scripts/status_page.py"
    toc = (ROOT / "_toc.yml").read_text()
    assert "file: book/status" in toc


def chapter(folder, stamp=None):
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("env.report(prof)")
    cell.outputs = [nbformat.v4.new_output("execute_result", data={"text/plain": REPORT}, execution_count=1)]
    cell.metadata["execution"] = {"iopub.execute_input": "2026-11-23T15:00:00.000000Z",
                                  "shell.execute_reply": "2026-11-23T15:01:30.000000Z"}
    nb.cells = [nbformat.v4.new_markdown_cell("# 9. A chapter: subtitle\n\nProse."), cell]
    if stamp:
        nb.metadata["gpubook"] = {"execution": stamp}
    nbformat.write(nb, folder / "09_a.ipynb")
    (folder / "chapters.json").write_text(json.dumps(
        {"chapters": [{"file": "09_a.ipynb", "gpus": 1, "minutes": {"CPU tiny": 0.4}}]}))


def test_a_row_reads_the_environment_report_and_the_cell_timestamps(tmp_path):
    chapter(tmp_path)
    row = [ln for ln in status_page.render(tmp_path).splitlines() if ln.startswith("| [9. A chapter]")][0]
    assert row == ("| [9. A chapter](../notebooks/09_a.ipynb) | 1 | 1 x NVIDIA H100 80GB HBM3, 79.6 GiB each | 580.159.04 "
                   "| 13.0 | 2.11.0 | 5.17.0 | 2026-11-23 15:00 | 1.5 min (cells) | not stamped | 0.4 min |")


def test_the_recorded_wall_time_of_the_stamped_run_is_preferred(tmp_path):
    stamp = {"commit": "0123456789abcdef", "date": "2026-11-23T15:02:00Z", "wall_s": 120.0}
    chapter(tmp_path, stamp)
    times = {"chapters": {"09_a": {"wall_s": 120.0, "date": "2026-11-23T15:02:00Z"}}}
    (tmp_path / "execution_times.json").write_text(json.dumps(times))
    assert "| 2.0 min (recorded) | commit 0123456789 |" in status_page.render(tmp_path)
    times["chapters"]["09_a"]["date"] = "2026-12-01T00:00:00Z"  # a later run written elsewhere: not this one's
    (tmp_path / "execution_times.json").write_text(json.dumps(times))
    assert "| 1.5 min (cells) |" in status_page.render(tmp_path)


def test_a_recorded_note_about_the_run_is_shown_only_for_that_run(tmp_path):
    stamp = {"commit": "0123456789abcdef", "date": "2026-11-23T15:02:00Z", "wall_s": 120.0}
    chapter(tmp_path, stamp)
    times = {"chapters": {"09_a": {"wall_s": 120.0, "date": "2026-11-23T15:02:00Z",
                                   "note": "executed while another chapter ran on the second GPU"}}}
    (tmp_path / "execution_times.json").write_text(json.dumps(times))
    assert "- 9. A chapter: executed while another chapter ran on the second GPU." in status_page.render(tmp_path)
    times["chapters"]["09_a"]["date"] = "2026-12-01T00:00:00Z"  # the note belongs to another run
    (tmp_path / "execution_times.json").write_text(json.dumps(times))
    assert "another chapter" not in status_page.render(tmp_path)
