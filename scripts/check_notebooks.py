#!/usr/bin/env python3
"""Notebook hygiene check, run in CI on the committed notebooks.

A committed chapter must be one fresh top-to-bottom GPU run: every code cell executed, execution
counts 1, 2, 3, ...; no error output and no traceback; no machine-local absolute path; no huge
output (each image under 300 KB, the notebook under 2 MB); and its first code cell (the
environment report) names an NVIDIA GPU and the full profile. nbval markers must be written exactly
(``# NBVAL_CHECK_OUTPUT`` alone on its line), or nbval silently ignores them.

Stale outputs. scripts/execute_notebooks.py stamps each notebook it executes (metadata
``gpubook.execution``: content hashes of what its outputs depend on, plus commit, GPU, torch, date, wall
time; scripts/stamps.py says what is hashed): each code cell by cell id, in its full-profile projection
(``prof.pick(tiny=a, full=b)`` read as ``b``; comments and docstrings left out), and each ``helpers``
function, class or top-level name the chapter reaches (statically, transitively), as its docstring-free
AST. A stamped notebook fails this check when one of those changed since the run, or a code cell was added
or removed; moving a cell, a tiny-only value, a docstring, a comment, a new helper function or module, or
an edit to a helper the chapter never reaches change nothing. ``scripts/gpu_check.py --restamp`` re-stamps a
chapter whose re-execution reproduced every compared output. ``notebooks/stale_ok.json`` may vouch for a
change that cannot change an output, with a reason (the check prints the entry to paste)::

    {"require_stamp": ["*"],
     "allow": {"04_gradient_checkpointing.ipynb": [
                 {"cell_id": "c65", "sha256": "<the cell's new sha256>", "reason": "..."}],
               "*": [{"helpers": "cleanup.back_at_baseline", "sha256": "<its new sha256>", "reason": "..."}]}}

An allowance names the new content's sha256, so a later edit is not covered by it; ``"*"`` applies to every
notebook; an allowance that covers nothing in any notebook is reported, to be removed. A notebook without a
stamp is reported as such and passes, unless ``require_stamp`` lists it (``"*"``: every notebook). A stamp in
the old format (a hash per helpers file and per cell position) is reported: convert it with
``python scripts/check_notebooks.py --migrate-stamps notebooks`` (hashes recomputed from the sources at the
stamp's commit) or re-execute.

Raw MyST roles. Jupyter and Colab show a role such as ``{glue:text}`x``` literally, so a chapter's
markdown should carry none (sentences with run numbers are rendered by code cells). Chapters written
before that rule may keep at most the number of roles that ``notebooks/raw_roles.json`` allows them
(a ratchet: the count may fall, never rise; a notebook not listed may have none).

Usage: python scripts/check_notebooks.py notebooks [more paths]   (exit 1 on any problem)
       python scripts/check_notebooks.py --migrate-stamps notebooks   (old-format stamps -> content hashes)
Only the standard library is used, so this runs on any Python.
"""

from __future__ import annotations

import base64
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import reader_view  # noqa: E402  (what counts as a relative link to the book's pages)
import stamps  # noqa: E402  (the content hashes of a chapter)

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
    return stamps.sha256(text)


_SOURCES: dict[tuple[Path, Path], stamps.Sources] = {}


def sources(helpers: Path, scripts: Path) -> stamps.Sources:
    """Today's helpers and launched scripts, read and parsed once per process."""
    key = (helpers.resolve(), scripts.resolve())
    if key not in _SOURCES:
        _SOURCES[key] = stamps.Sources.from_dirs(helpers, scripts)
    return _SOURCES[key]


def load_allowances(folder: Path) -> dict:
    path = folder / ALLOWANCES
    data = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    return {"require_stamp": data.get("require_stamp", []), "allow": data.get("allow", {})}


def allowance_key(entry: dict) -> tuple | None:
    """(kind, key, sha256) of an allowance, None for one this version does not read (old positional form)."""
    for kind, name in (("cell", "cell_id"), ("helpers", "helpers"), ("script", "script")):
        if name in entry:
            return kind, entry[name], entry.get("sha256")
    return None


def _entry(kind: str, key: str, sha: str) -> str:
    name = {"cell": "cell_id", "helpers": "helpers", "script": "script"}[kind]
    return f'{{"{name}": "{key}", "sha256": "{sha}", "reason": "..."}}'


def stamp_status(path: Path, nb: dict, helpers: Path = HELPERS, allowances: dict | None = None,
                 used: set | None = None) -> tuple[list[str], str]:
    """(problems, one-line note) for the notebook's execution stamp against today's code and helpers.

    ``used`` collects (notebook or "*", index) of the allowances that covered a change.
    """
    allowances = load_allowances(path.parent) if allowances is None else allowances
    stamp = nb.get("metadata", {}).get("gpubook", {}).get("execution")
    if not stamp:
        if path.name in allowances["require_stamp"] or "*" in allowances["require_stamp"]:
            return [f"no execution stamp, but {ALLOWANCES} requires one (execute it with "
                    "scripts/execute_notebooks.py)"], "not stamped"
        return [], "not stamped (executed before stamping)"
    note = (f"stamped: {stamp.get('gpu', '?')}, {stamp.get('date', '?')}, commit {str(stamp.get('commit', '?'))[:10]}"
            + (f", verified by {stamp['verified_by']}" if stamp.get("verified_by") else ""))
    if not stamps.is_current(stamp):
        return [f"stale outputs: the execution stamp is in the old format (hashes per helpers file and per cell "
                f"position): python scripts/check_notebooks.py --migrate-stamps {path.parent}, or re-execute"], note
    allowed = {}
    for scope in (path.name, "*"):
        for i, entry in enumerate(allowances["allow"].get(scope, [])):
            key = allowance_key(entry)
            if key is not None and str(entry.get("reason", "")).strip():
                allowed.setdefault(key, (scope, i))
    now = stamps.fingerprint(stamps.code_cells(nb), sources(helpers, path.parent / "scripts"))
    problems, covered = [], 0
    unverified: dict[str, int] = {}
    for kind, key, what, sha in stamps.differences(stamp, now):
        if kind == "helpers" and stamp["helpers"].get(key) == stamps.UNVERIFIED:
            module = key.split(".")[0]
            unverified[module] = unverified.get(module, 0) + 1
            continue
        if (kind, key, sha) in allowed:
            covered += 1
            if used is not None:
                used.add(allowed[(kind, key, sha)])
            continue
        thing = {"cell": f"code cell {key}", "helpers": f"helpers {key}", "script": f"scripts/{key}"}[kind]
        problems.append(f"stale outputs: {thing} {what} since the notebook was executed "
                        f"({stamp.get('date', '?')}); re-execute, or if no output can change, allow it in "
                        f"{ALLOWANCES}: {_entry(kind, key, sha)}")
    problems += [f"stale outputs: helpers/{module}.py: the sources the chapter ran with are not in git (its stamp's "
                 f"commit has another version), so {n} unit(s) it uses cannot be compared: re-execute it"
                 for module, n in sorted(unverified.items())]
    if covered:
        note += f", {covered} change(s) allowed by {ALLOWANCES}"
    return problems, note


def unused_allowances(folder: Path, used: set, names: set[str]) -> list[str]:
    """The allowances of the checked notebooks (and "*" when every chapter was checked) that covered nothing."""
    data = load_allowances(folder)["allow"]
    every = {p.name for p in folder.glob("[0-9][0-9]_*.ipynb")} <= names
    problems = []
    for scope, entries in data.items():
        if scope.startswith("_") or not (scope in names or (scope == "*" and every)):
            continue
        for i, entry in enumerate(entries):
            if (scope, i) not in used:
                what = {k: entry[k] for k in ("cell_id", "helpers", "script", "cell") if k in entry}
                problems.append(f"the allowance {json.dumps(what)} for {scope} covers no change "
                                f"any more: remove it")
    return problems


def _text_of(output: dict) -> str:
    if output.get("output_type") == "stream":
        text = output.get("text", "")
        return "".join(text) if isinstance(text, list) else text
    parts = []
    for mime, value in output.get("data", {}).items():
        if mime.startswith("text") or mime.endswith("plain"):
            parts.append("".join(value) if isinstance(value, list) else str(value))
    return "\n".join(parts)


def relative_links(nb: dict) -> list[tuple[int, str]]:
    """(cell number, link target) of every relative link to a page or notebook, in sources and outputs.

    Such a link works on the built site only and breaks in Jupyter and Colab (BOOK_STANDARD: absolute links from
    notebooks). What counts as one is ``reader_view.relative_links``'s rule, which also rewrites markdown links;
    here it runs on every cell's source and on its outputs (the sentences code cells render).
    """
    found = []
    for i, cell in enumerate(nb.get("cells", []), start=1):
        texts = ["".join(cell.get("source", ""))] + [_text_of(o) for o in cell.get("outputs", [])]
        found += [(i, link[2:-1].strip(" <>")) for text in texts for link in reader_view.relative_links(text)]
    return found


def check(path: Path, helpers: Path = HELPERS, allowances: dict | None = None) -> list[str]:
    """Return the hygiene problems of one notebook (empty when it is clean)."""
    return check_with_note(path, helpers, allowances)[0]


def check_with_note(path: Path, helpers: Path = HELPERS, allowances: dict | None = None,
                    used: set | None = None) -> tuple[list[str], str]:
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
    for i, target in relative_links(nb):
        problems.append(f"cell {i}: relative link ({target}) breaks in Jupyter and Colab: use the site's absolute URL")
    roles, allowed = raw_roles(nb), raw_roles_allowed(path.parent).get(path.name, 0)
    if roles > allowed:
        problems.append(f"{roles} raw MyST roles in markdown (allowed: {allowed}); Jupyter and Colab show them "
                        f"literally: render sentences with run numbers from a code cell instead")
    stale, note = stamp_status(path, nb, helpers, allowances, used)
    if roles and roles < allowed:
        note += f"; {roles} raw MyST roles, fewer than the {allowed} allowed: lower the allowance in {RAW_ROLES}"
    return problems + stale, note


def main(argv: list[str]) -> int:
    migrate = "--migrate-stamps" in argv
    argv = [a for a in argv if a != "--migrate-stamps"]
    paths: list[Path] = []
    for arg in argv or ["notebooks"]:
        p = Path(arg)
        paths.extend(sorted(p.glob("[0-9][0-9]_*.ipynb")) if p.is_dir() else [p])
    if not paths:
        print("no notebooks found")
        return 1
    if migrate:
        for path in paths:
            print(f"{path}: {stamps.migrate(path, HELPERS.parent)}")
        return 0
    failed = 0
    used: set = set()
    for path in paths:
        problems, note = check_with_note(path, used=used)
        status = "ok" if not problems else f"{len(problems)} problem(s)"
        print(f"{path}: {status}; {note}")
        for problem in problems:
            print(f"  - {problem}")
        failed += bool(problems)
    for folder in sorted({p.parent for p in paths}):
        names = {p.name for p in paths if p.parent == folder}
        unused = unused_allowances(folder, used, names)
        every = {p.name for p in folder.glob("[0-9][0-9]_*.ipynb")} <= names  # else a note (a re-executed few)
        for problem in unused:
            print(f"{folder / ALLOWANCES}: {problem}" + ("" if every else " (a note: not a failure here)"))
        failed += bool(unused) and every
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
