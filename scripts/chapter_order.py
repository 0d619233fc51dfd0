#!/usr/bin/env python3
"""Print the notebooks under a folder in the order `make notebooks` hands them to its pytest-xdist workers.

`make notebooks` runs the chapters under nbval on two workers (``-n 2 --dist loadfile``: each notebook whole,
in one kernel, on one worker). A worker takes the next notebook in line when it is nearly done with its own,
so the run ends soonest when the longest chapters start first and the short ones fill in at the end
(longest processing time first). The lengths are the ``"CPU tiny"`` minutes of ``notebooks/chapters.json``
(the tiny profile under nbval on a 2-core CPU machine). A notebook with no such number there (a new chapter)
comes first, as if it were the longest, so it cannot be left to run alone at the end.

Every ``.ipynb`` that ``pytest FOLDER`` collects is printed, once (notebooks in hidden folders such as
``.ipynb_checkpoints`` are not collected by pytest and are not printed); ``tests/test_chapter_order.py``
holds this list to what pytest collects, so that ordering the notebooks never drops one.

Usage: python scripts/chapter_order.py [notebooks]   (one path a line, longest first)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# pytest's default norecursedirs that could name a folder of notebooks; "." folders are skipped as well.
SKIPPED_DIRS = {"build", "dist", "node_modules", "venv", "CVS", "_darcs", "{arch}"}


def notebooks(folder: Path) -> list[Path]:
    """Every notebook ``pytest folder`` collects, in path order."""
    found = []
    for path in sorted(folder.rglob("*.ipynb")):
        parts = path.relative_to(folder).parts[:-1]
        if any(p.startswith(".") or p in SKIPPED_DIRS or p.endswith(".egg") for p in parts):
            continue
        found.append(path)
    return found


def cpu_minutes(folder: Path) -> dict[str, float]:
    """File name -> "CPU tiny" minutes from ``folder/chapters.json`` (missing file or number: left out)."""
    path = folder / "chapters.json"
    if not path.exists():
        return {}
    chapters = json.loads(path.read_text(encoding="utf-8"))["chapters"]
    minutes = {}
    for c in chapters:
        value = c.get("minutes", {}).get("CPU tiny")
        if isinstance(value, (int, float)):
            minutes[c["file"]] = float(value)
    return minutes


def order(folder: Path) -> list[Path]:
    """The notebooks of ``folder``: those without a CPU time first, then the longest first; ties by path."""
    minutes = cpu_minutes(folder)
    unknown = float("inf")
    return sorted(notebooks(folder), key=lambda p: (-minutes.get(p.name, unknown), str(p)))


def main(argv: list[str]) -> int:
    folder = Path(argv[0] if argv else "notebooks")
    paths = order(folder)
    if not paths:
        print(f"chapter_order.py: no notebooks under {folder}", file=sys.stderr)
        return 1
    print("\n".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
