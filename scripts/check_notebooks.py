#!/usr/bin/env python3
"""Notebook hygiene check, run in CI on the committed notebooks.

A committed chapter must be one fresh top-to-bottom GPU run: every code cell executed, execution
counts 1, 2, 3, ...; no error output and no traceback; no machine-local absolute path; no huge
output (each image under 300 KB, the notebook under 2 MB); and its first code cell (the
environment report) names an NVIDIA GPU and the full profile. nbval markers must be written exactly
(``# NBVAL_CHECK_OUTPUT`` alone on its line), or nbval silently ignores them.

Stale outputs. scripts/execute_notebooks.py stamps each notebook it executes (metadata
``gpubook.execution``: git commit, sha256 of each ``helpers/*.py`` and of each code cell, GPU, torch,
date, wall time). A stamped notebook fails this check when a code cell or a helpers file changed since
that run, unless ``notebooks/stale_ok.json`` vouches for exactly that change (a docstring, a comment:
something that cannot change an output), with a reason::

    {"require_stamp": ["09_fast_path.ipynb"],
     "allow": {"01_memory_anatomy.ipynb": [
                 {"cell": 4, "sha256": "<the cell's new sha256>", "reason": "comment reworded"}],
               "*": [{"helpers": "measure.py", "sha256": "<the file's new sha256>", "reason": "docstring"}]}}

An allowance names the new content's sha256 (the check prints it), so a later edit is not covered by
it; ``"*"`` applies to every notebook. A notebook without a stamp (executed before stamping existed)
is reported as such and passes, unless it is listed in ``require_stamp`` (``"*"`` there: every
notebook must carry a stamp, as every chapter does since chapter 8's first stamped run).

Raw MyST roles. Jupyter and Colab show a role such as ``{glue:text}`x``` literally, so a chapter's
markdown should carry none (sentences with run numbers are rendered by code cells). Chapters written
before that rule may keep at most the number of roles that ``notebooks/raw_roles.json`` allows them
(a ratchet: the count may fall, never rise; a notebook not listed may have none).

Usage: python scripts/check_notebooks.py notebooks [more paths]   (exit 1 on any problem)
Only the standard library is used, so this runs on any Python.
"""

from __future__ import annotations

import base64
import hashlib
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
HELPERS = Path(__file__).resolve().parents[1] / "helpers"
ALLOWANCES = "stale_ok.json"  # beside the notebooks
RAW_ROLES = "raw_roles.json"  # beside the notebooks
RAW_ROLE = re.compile(r"\{(?:glue|cite|numref|ref|eq|doc|term)(?::[a-z]+)?\}`")


def raw_roles(nb: dict) -> int:
    """How many MyST roles the notebook's markdown cells contain (Jupyter shows them literally)."""
    return sum(len(RAW_ROLE.findall("".join(c.get("source", "")))) for c in nb.get("cells", [])
               if c.get("cell_type") == "markdown")


def raw_roles_allowed(folder: Path) -> dict[str, int]:
    path = folder / RAW_ROLES
    return json.loads(path.read_text(encoding="utf-8")).get("allowed", {}) if path.exists() else {}


def sha256(text: str | bytes) -> str:
    return hashlib.sha256(text.encode("utf-8") if isinstance(text, str) else text).hexdigest()


def code_sources(nb: dict) -> list[str]:
    return ["".join(c.get("source", "")) for c in nb.get("cells", []) if c.get("cell_type") == "code"]


def code_fingerprint(nb: dict) -> dict:
    """sha256 of the notebook's code-cell sources: one per cell and one for all of them."""
    cells = [sha256(source) for source in code_sources(nb)]
    return {"code_sha256": sha256("\n".join(cells)), "code_cells_sha256": cells}


def helpers_fingerprint(helpers: Path = HELPERS) -> dict:
    """sha256 of each helpers/*.py and helpers/*/*.py (by path under helpers/) and of all of them together."""
    files = {p.relative_to(helpers).as_posix(): sha256(p.read_bytes()) for p in sorted(helpers.rglob("*.py"))}
    return {"helpers_sha256": sha256("\n".join(f"{k} {v}" for k, v in files.items())), "helpers_files_sha256": files}


def load_allowances(folder: Path) -> dict:
    path = folder / ALLOWANCES
    data = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    return {"require_stamp": data.get("require_stamp", []), "allow": data.get("allow", {})}


def stamp_status(path: Path, nb: dict, helpers: Path = HELPERS, allowances: dict | None = None) -> tuple[list[str], str]:
    """(problems, one-line note) for the notebook's execution stamp against today's code and helpers."""
    allowances = load_allowances(path.parent) if allowances is None else allowances
    stamp = nb.get("metadata", {}).get("gpubook", {}).get("execution")
    if not stamp:
        if path.name in allowances["require_stamp"] or "*" in allowances["require_stamp"]:
            return [f"no execution stamp, but {ALLOWANCES} requires one (execute it with "
                    "scripts/execute_notebooks.py)"], "not stamped"
        return [], "not stamped (executed before stamping)"
    allowed = [a for a in allowances["allow"].get("*", []) + allowances["allow"].get(path.name, [])
               if a.get("reason")]
    ok_cells = {(a.get("cell"), a.get("sha256")) for a in allowed if "cell" in a}
    ok_files = {(a.get("helpers"), a.get("sha256")) for a in allowed if "helpers" in a}
    problems, covered = [], 0
    now_cells = code_fingerprint(nb)["code_cells_sha256"]
    then_cells = stamp.get("code_cells_sha256", [])
    if len(now_cells) != len(then_cells):
        problems.append(f"stale outputs: {len(now_cells)} code cells now, {len(then_cells)} when executed "
                        f"({stamp.get('date', '?')}); re-execute it")
    else:
        for i, (now, then) in enumerate(zip(now_cells, then_cells, strict=True), start=1):
            if now != then:
                if (i, now) in ok_cells:
                    covered += 1
                else:
                    problems.append(f"stale outputs: code cell {i} changed since it was executed; re-execute, or "
                                    f"if no output can change, allow it in {ALLOWANCES}: "
                                    f'{{"cell": {i}, "sha256": "{now}", "reason": "..."}}')
    now_files = helpers_fingerprint(helpers)["helpers_files_sha256"]
    then_files = stamp.get("helpers_files_sha256", {})
    for name in sorted(set(now_files) | set(then_files)):
        now = now_files.get(name)
        if now != then_files.get(name):
            if (name, now) in ok_files:
                covered += 1
            else:
                what = "added" if name not in then_files else "removed" if now is None else "changed"
                problems.append(f"stale outputs: helpers/{name} {what} since the notebook was executed; "
                                f"re-execute, or if no output can change, allow it in {ALLOWANCES}: "
                                f'{{"helpers": "{name}", "sha256": "{now}", "reason": "..."}}')
    note = (f"stamped: {stamp.get('gpu', '?')}, {stamp.get('date', '?')}, commit {str(stamp.get('commit', '?'))[:10]}"
            + (f", {covered} change(s) allowed by {ALLOWANCES}" if covered else ""))
    return problems, note


def _text_of(output: dict) -> str:
    if output.get("output_type") == "stream":
        text = output.get("text", "")
        return "".join(text) if isinstance(text, list) else text
    parts = []
    for mime, value in output.get("data", {}).items():
        if mime.startswith("text") or mime.endswith("plain"):
            parts.append("".join(value) if isinstance(value, list) else str(value))
    return "\n".join(parts)


def check(path: Path, helpers: Path = HELPERS, allowances: dict | None = None) -> list[str]:
    """Return the hygiene problems of one notebook (empty when it is clean)."""
    return check_with_note(path, helpers, allowances)[0]


def check_with_note(path: Path, helpers: Path = HELPERS, allowances: dict | None = None) -> tuple[list[str], str]:
    """The hygiene problems of one notebook and a note on its execution stamp."""
    problems: list[str] = []
    size = path.stat().st_size
    if size > MAX_NOTEBOOK_BYTES:
        problems.append(f"notebook is {size / 1e6:.1f} MB (limit {MAX_NOTEBOOK_BYTES / 1e6:.0f} MB)")
    nb = json.loads(path.read_text(encoding="utf-8"))
    code = [c for c in nb.get("cells", []) if c.get("cell_type") == "code"]
    if not code:
        return problems + ["no code cells"], ""
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
    roles, allowed = raw_roles(nb), raw_roles_allowed(path.parent).get(path.name, 0)
    if roles > allowed:
        problems.append(f"{roles} raw MyST roles in markdown (allowed: {allowed}); Jupyter and Colab show them "
                        f"literally: render sentences with run numbers from a code cell instead")
    stale, note = stamp_status(path, nb, helpers, allowances)
    if roles and roles < allowed:
        note += f"; {roles} raw MyST roles, fewer than the {allowed} allowed: lower the allowance in {RAW_ROLES}"
    return problems + stale, note


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
        problems, note = check_with_note(path)
        status = "ok" if not problems else f"{len(problems)} problem(s)"
        print(f"{path}: {status}; {note}")
        for problem in problems:
            print(f"  - {problem}")
        failed += bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
