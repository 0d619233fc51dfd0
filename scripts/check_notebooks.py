#!/usr/bin/env python3
"""Notebook hygiene check, run in CI on the committed notebooks.

A committed chapter must be one fresh top-to-bottom GPU run: every code cell executed, execution
counts 1, 2, 3, ...; no error output and no traceback; no machine-local absolute path; no huge
output (each image under 300 KB, the notebook under 2 MB); and its first code cell (the
environment report) names an NVIDIA GPU and the full profile. nbval markers must be written exactly
(``# NBVAL_CHECK_OUTPUT`` alone on its line), or nbval silently ignores them.

Usage: python scripts/check_notebooks.py notebooks [more paths]   (exit 1 on any problem)
Only the standard library is used, so this runs on any Python.
"""

from __future__ import annotations

import base64
import json
import re
import sys
from pathlib import Path

MAX_NOTEBOOK_BYTES = 2_000_000
MAX_IMAGE_BYTES = 300_000
LOCAL_PATH = re.compile(r"(/home/|/root/|/Users/|/tmp/|/work/|/opt/|/usr/|/private/var/|site-packages|[A-Za-z]:\\Users)")
TRACEBACK = "Traceback (most recent call last)"
# nbval recognises a marker only when the comment line is exactly "# NBVAL_..."; anything else is silently
# ignored, so a decorated marker would disable the check it was meant to enable.
NBVAL_MARKERS = {"NBVAL_CHECK_OUTPUT", "NBVAL_IGNORE_OUTPUT", "NBVAL_SKIP", "NBVAL_RAISES_EXCEPTION"}


def _text_of(output: dict) -> str:
    if output.get("output_type") == "stream":
        text = output.get("text", "")
        return "".join(text) if isinstance(text, list) else text
    parts = []
    for mime, value in output.get("data", {}).items():
        if mime.startswith("text") or mime.endswith("plain"):
            parts.append("".join(value) if isinstance(value, list) else str(value))
    return "\n".join(parts)


def check(path: Path) -> list[str]:
    """Return the hygiene problems of one notebook (empty when it is clean)."""
    problems: list[str] = []
    size = path.stat().st_size
    if size > MAX_NOTEBOOK_BYTES:
        problems.append(f"notebook is {size / 1e6:.1f} MB (limit {MAX_NOTEBOOK_BYTES / 1e6:.0f} MB)")
    nb = json.loads(path.read_text(encoding="utf-8"))
    code = [c for c in nb.get("cells", []) if c.get("cell_type") == "code"]
    if not code:
        return problems + ["no code cells"]
    counts = [c.get("execution_count") for c in code]
    if counts != list(range(1, len(code) + 1)):
        problems.append(f"execution counts are not 1..{len(code)} in order (not one fresh run): {counts}")
    for i, cell in enumerate(code, start=1):
        source = "".join(cell.get("source", ""))
        for line in source.splitlines():
            comment = line.strip().lstrip("#").strip()
            if line.strip().startswith("#") and "NBVAL_" in comment and comment not in NBVAL_MARKERS:
                problems.append(f"code cell {i}: nbval ignores this marker line (it must be exactly one of "
                                f"{', '.join(sorted(NBVAL_MARKERS))}): {line.strip()[:80]}")
        for out in cell.get("outputs", []):
            text = _text_of(out)
            if out.get("output_type") == "error":
                problems.append(f"code cell {i}: error output {out.get('ename')}: {out.get('evalue')}")
            if TRACEBACK in text:
                problems.append(f"code cell {i}: a traceback in the output")
            match = LOCAL_PATH.search(text)
            if match:
                line = next(ln for ln in text.splitlines() if match.group(0) in ln)
                problems.append(f"code cell {i}: machine-local path in the output: {line.strip()[:120]}")
            for mime, value in out.get("data", {}).items():
                if mime.startswith("image/") and mime != "image/svg+xml":
                    raw = base64.b64decode("".join(value) if isinstance(value, list) else value)
                    if len(raw) > MAX_IMAGE_BYTES:
                        problems.append(f"code cell {i}: {mime} of {len(raw) / 1e3:.0f} KB (limit 300 KB)")
    first = "\n".join(_text_of(o) for o in code[0].get("outputs", []))
    if "NVIDIA" not in first and "Tesla" not in first:
        problems.append("the first code cell's output (environment report) names no NVIDIA GPU")
    if not re.search(r"profile\s+full\b", first):
        problems.append("the first code cell's output does not show the full profile")
    return problems


def main(argv: list[str]) -> int:
    paths: list[Path] = []
    for arg in argv or ["notebooks"]:
        p = Path(arg)
        paths.extend(sorted(p.glob("[0-9][0-9]_*.ipynb")) if p.is_dir() else [p])
    if not paths:
        print("no notebooks found")
        return 1
    failed = 0
    for path in paths:
        problems = check(path)
        status = "ok" if not problems else f"{len(problems)} problem(s)"
        print(f"{path}: {status}")
        for problem in problems:
            print(f"  - {problem}")
        failed += bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
