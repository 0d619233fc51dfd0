#!/usr/bin/env python3
"""Write book/status.md: where each chapter's committed outputs come from, and how long the run took.

    python scripts/status_page.py            # rewrite book/status.md
    python scripts/status_page.py --check    # exit 1 if book/status.md is not what it would write

For each chapter in notebooks/chapters.json: the GPU, NVIDIA driver, CUDA, torch and transformers versions
from the chapter's first code cell (the environment report), the date of the run (the first cell's
timestamp), its run time, the GPUs it needs, and whether it carries an execution stamp. The run time
is the one notebooks/execution_times.json records for that run (written by scripts/execute_notebooks.py)
when there is one, with the record's note, if any (e.g. that the machine was shared with another run); otherwise it is measured from the notebook's cell timestamps (first cell's start
to the last cell's end, kernel start excluded). Standard library only; the output depends only on the
committed files, so a test can compare it with the committed page.
"""

from __future__ import annotations

import datetime
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
PAGE = ROOT / "book" / "status.md"
REPORT_KEYS = {"GPU": "GPU", "NVIDIA driver": "driver", "CUDA (torch build)": "CUDA", "torch": "torch",
               "transformers": "transformers"}

HEADER = """# Status: where the outputs come from

Every chapter is committed with the outputs of one top-to-bottom run in the full profile on a GPU. This
page, written by `scripts/status_page.py` from the committed notebooks (and checked against them by the
tests), shows for each chapter the machine and versions behind its numbers, as its first cell reported
them, the date of that run (UTC) and how long it took. Chapter order, GPU needs and run times on other
GPUs are in `notebooks/chapters.json`; a run's wall time is also recorded in
`notebooks/execution_times.json` when the chapter is executed with `scripts/execute_notebooks.py`.
"""

FOOTER = """
**Run time** is the chapter's wall time {source_note}. **Tiny profile on a CPU** is one chapter under
`make notebooks` (pytest with nbval, kernel start included) on the machine named in `notebooks/chapters.json`.

**Stamp**: a chapter executed by `scripts/execute_notebooks.py` records in its metadata the git commit, a
hash of `helpers/` and of its code cells, the GPU and the date; the notebook hygiene check then fails if
the code or `helpers` changed since that run (see the README). "not stamped" marks outputs from runs
made before this record existed.
"""


def _timestamp(value: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))


def chapter_facts(path: Path, times: dict) -> dict:
    """The status row of one chapter, from its committed notebook (and the recorded wall time, if any)."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    cells = nb["cells"]
    heading = next(("".join(c["source"]).lstrip("# ").splitlines()[0] for c in cells
                    if c["cell_type"] == "markdown" and "".join(c["source"]).startswith("# ")), path.stem)
    code = [c for c in cells if c["cell_type"] == "code"]
    report = {}
    for out in code[0].get("outputs", []):
        text = out.get("data", {}).get("text/plain") or out.get("text") or ""
        for line in ("".join(text) if isinstance(text, list) else text).splitlines():
            parts = re.split(r"\s{2,}", line.strip(), maxsplit=1)
            if len(parts) == 2 and parts[0] in REPORT_KEYS:
                report[REPORT_KEYS[parts[0]]] = parts[1].strip()
    stamps = [_timestamp(c["metadata"]["execution"][k]) for c in code
              for k in ("iopub.execute_input", "shell.execute_reply") if k in c.get("metadata", {}).get("execution", {})]
    stamp = nb.get("metadata", {}).get("gpubook", {}).get("execution")
    recorded = times.get(path.stem)
    if recorded and stamp and recorded.get("date") == stamp.get("date"):
        wall_s, source = recorded["wall_s"], "recorded"
    elif stamps:
        wall_s, source = (max(stamps) - min(stamps)).total_seconds(), "cells"
    else:
        wall_s, source = None, None
    return {"file": path.name, "title": heading, **report,
            "date": min(stamps).strftime("%Y-%m-%d %H:%M") if stamps else "unknown",
            "wall_s": wall_s, "source": source,
            "note": recorded.get("note") if source == "recorded" else None,
            "stamp": f"commit {stamp.get('commit', '?')[:10]}" if stamp else "not stamped"}


def render(notebooks: Path = NOTEBOOKS) -> str:
    chapters = json.loads((notebooks / "chapters.json").read_text(encoding="utf-8"))["chapters"]
    times_file = notebooks / "execution_times.json"
    times = json.loads(times_file.read_text(encoding="utf-8"))["chapters"] if times_file.exists() else {}
    rows = [dict(chapter_facts(notebooks / c["file"], times), gpus=c["gpus"], cpu=c["minutes"].get("CPU tiny"))
            for c in chapters]
    lines = [HEADER,
             "| Chapter | GPUs needed | GPU of the committed run | NVIDIA driver | CUDA | torch | transformers "
             "| Run (UTC) | Run time | Stamp | Tiny profile on a CPU |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        run_time = "unknown" if r["wall_s"] is None else f"{r['wall_s'] / 60:.1f} min ({r['source']})"
        cpu = "not measured" if r["cpu"] is None else f"{r['cpu']:.1f} min"
        link = f"[{r['title'].split(':')[0]}](../notebooks/{r['file']})"
        lines.append(f"| {link} | {r['gpus']} | {r.get('GPU', 'unknown')} | {r.get('driver', 'unknown')} "
                     f"| {r.get('CUDA', 'unknown')} | {r.get('torch', 'unknown')} | {r.get('transformers', 'unknown')} "
                     f"| {r['date']} | {run_time} | {r['stamp']} "
                     f"| {cpu} |")
    notes = [f"- {r['title'].split(':')[0]}: {r['note']}." for r in rows if r.get("note")]
    if notes:
        lines += ["", "How a run was made, where its record says more than the table:", "", *notes]
    note = ("as recorded by the execution script (\"recorded\") or, where no time was recorded for that run, "
            "measured from the notebook's cell timestamps (\"cells\": first cell's start to the last cell's end, "
            "kernel start excluded)")
    return "\n".join(lines) + "\n" + FOOTER.format(source_note=note)


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if PAGE.read_text(encoding="utf-8") != text:
            print(f"{PAGE} is out of date: run python scripts/status_page.py")
            return 1
        print(f"{PAGE} is up to date")
        return 0
    PAGE.write_text(text, encoding="utf-8")
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
