#!/usr/bin/env python3
"""Check that every chapter notebook and its jupytext text twin say the same thing.

Each ``notebooks/NN_slug.ipynb`` is paired (notebook metadata ``jupytext: formats: ipynb,py:percent``)
with ``notebooks/NN_slug.py``, a percent-format text twin that reviews read. The ``.ipynb`` keeps the
GPU outputs. A pair is in sync when the twin is, byte for byte, what jupytext writes from the notebook.
This check only reads: to bring a pair back in sync, run ``jupytext --sync notebooks/NN_slug.ipynb``
(the newer file of the pair wins), then check the diff.

Usage: python scripts/check_twins.py [notebooks]   (exit 1 on any pair out of sync)
"""

from __future__ import annotations

import difflib
import sys
from pathlib import Path

FORMATS = "ipynb,py:percent"


def twin_problems(notebook: Path) -> list[str]:
    """What is wrong with one notebook's pairing (empty when the pair is in sync)."""
    import jupytext
    import nbformat

    twin = notebook.with_suffix(".py")
    nb = nbformat.read(notebook, as_version=4)
    formats = nb.metadata.get("jupytext", {}).get("formats")
    problems = []
    if formats != FORMATS:
        problems.append(f"notebook metadata jupytext.formats is {formats!r}, expected {FORMATS!r}")
    if not twin.exists():
        return problems + [f"no text twin {twin.name} (create it: jupytext --set-formats {FORMATS} {notebook})"]
    expected = jupytext.writes(nb, fmt="py:percent")
    actual = twin.read_text(encoding="utf-8")
    if actual != expected:
        diff = list(difflib.unified_diff(expected.splitlines(), actual.splitlines(),
                                         f"{twin.name} as written from {notebook.name}", twin.name, lineterm="", n=1))
        shown = "\n      ".join(diff[:12]) + ("\n      ..." if len(diff) > 12 else "")
        problems.append(f"{twin.name} is out of sync with {notebook.name} (run: jupytext --sync {notebook}):\n"
                        f"      {shown}")
    return problems


def main(argv: list[str]) -> int:
    folder = Path(argv[0]) if argv else Path("notebooks")
    notebooks = sorted(folder.glob("[0-9][0-9]_*.ipynb"))
    orphans = [p for p in sorted(folder.glob("[0-9][0-9]_*.py")) if not p.with_suffix(".ipynb").exists()]
    if not notebooks:
        print(f"no notebooks in {folder}")
        return 1
    failed = 0
    for path in notebooks:
        problems = twin_problems(path)
        print(f"{path} <-> {path.with_suffix('.py').name}: {'in sync' if not problems else 'OUT OF SYNC'}")
        for problem in problems:
            print(f"  - {problem}")
        failed += bool(problems)
    for path in orphans:
        print(f"{path}: a text twin without its notebook")
        failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
