#!/usr/bin/env python3
"""GPU output check (make gpu-test): re-execute the chapters on a GPU and compare their memory numbers.

    python scripts/gpu_check.py                      # execute every chapter (full profile), compare
    python scripts/gpu_check.py --executed DIR       # compare notebooks already executed into DIR
    python scripts/gpu_check.py --plan               # only say which cells would be checked/ignored
    python scripts/gpu_check.py --restamp            # ... and re-stamp each chapter that reproduced

The policy, per code cell (the chapters' code cells carry no nbval markers; the policy lives here and
in notebooks/gpu_check.json, so the GPU outputs need not be touched to change it):

- ignored: the first code cell (the environment report describes the machine) and every cell that
  notebooks/gpu_check.json lists for its notebook (by cell id), each with a reason (timings, losses, throughputs,
  NVML numbers that include the CUDA context, ...);
- checked: a cell whose committed text output holds a memory number (MiB, GiB, KiB, bytes): its text
  outputs (stream and text/plain; images and HTML are never compared) must equal the new run's, after
  both are passed through the regexes of notebooks/sanitize.cfg (GPU names, memory totals,
  driver/CUDA versions, dates, paths, timings in known formats, addresses); the same file serves
  ``pytest --nbval --nbval-sanitize-with notebooks/sanitize.cfg``;
- not compared: every other cell (no memory number in its output).

Allocator numbers are deterministic across GPU models of one family (an H100 re-run reproduced the
H200's memory tables to the byte), so a re-execution on an H100 or an H200 must pass. Chapters run in
the order of notebooks/chapters.json into a temporary folder: the committed notebooks are never
written. A chapter that needs more GPUs than the machine has is skipped, saying so.

Speed conclusions are compared too: every cell's verdict words ("faster", "slower", "no difference beyond the
noise", "host-bound", "GPU-bound", ...; scripts/verdicts.py) must come out the same in the re-run, cell by cell.
A flip fails the check unless notebooks/gpu_check.json declares that cell noise-sensitive (``noise_sensitive``,
at most three cells in the book, each with its reason). Exit 1 on any mismatch, undeclared flip or failed
execution. ``--report FILE`` writes the counts, mismatches and flips per chapter as JSON.

``--restamp`` (``make gpu-test`` passes it): a chapter whose every compared output reproduced gets a fresh
execution stamp in the committed notebook's metadata (the content hashes of the sources this run executed,
taken before it and unchanged after it; date, GPU, ``verified_by``; the earlier stamp's date, GPU and commit
under ``outputs_from``). Its outputs are not touched: they are the committed run's, now vouched for by this
one, so edits that changed no compared output (a refactor, a tiny-profile value) stop being stale without a
stale_ok.json entry. It does not re-stamp from sources that differ from git HEAD (it still compares), and
without git it records ``--commit SHA`` or $GPUBOOK_COMMIT (else "unknown", with a warning).
"""

from __future__ import annotations

import argparse
import configparser
import difflib
import json
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import stamps  # noqa: E402  (content hashes, for --restamp)
import verdicts as verdict_words  # noqa: E402  (the verdict words of rendered outputs)

NOTEBOOKS = ROOT / "notebooks"
MEMORY = re.compile(r"\b(?:KiB|MiB|GiB|TiB|bytes)\b")


def load_sanitizers(path: Path) -> list[tuple[re.Pattern, str]]:
    """The (regex, replacement) pairs of an nbval sanitize file, in file order."""
    parser = configparser.ConfigParser(interpolation=None)
    parser.read(path, encoding="utf-8")
    return [(re.compile(parser[s]["regex"]), parser[s]["replace"]) for s in parser.sections()]


def sanitize(text: str, sanitizers: list[tuple[re.Pattern, str]]) -> str:
    for regex, replace in sanitizers:
        text = regex.sub(replace, text)
    return text


def output_text(cell: dict) -> str:
    """A code cell's comparable text: its streams and text/plain results, in order (no images, no HTML).

    Consecutive stdout chunks are one stream: where the kernel split it depends on when it flushed, so the
    chunks are concatenated as they are (joining them with a newline would add a blank line wherever a flush
    fell, and two runs of the same code would differ); stderr and figures, not compared, do not split it. Other
    outputs are separated by a newline.
    """
    parts: list[str] = []
    in_stream = False
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream" and out.get("name") == "stdout":
            text = out.get("text", "")
            text = "".join(text) if isinstance(text, list) else text
            if in_stream:
                parts[-1] += text
            else:
                parts.append(text)
            in_stream = True
            continue
        if out.get("output_type") in ("execute_result", "display_data"):
            data = out.get("data", {})
            if any(k.startswith("image/") for k in data):
                continue  # a figure: its text/plain is only its repr ("<Figure size ...>"); images are not compared
            text = data.get("text/plain", "")
        elif out.get("output_type") == "error":
            text = f"{out.get('ename')}: {out.get('evalue')}"
        else:
            continue  # stderr (warnings) is not compared and does not split the stdout stream
        parts.append("".join(text) if isinstance(text, list) else text)
        in_stream = False
    return "\n".join(parts)


def code_cells(nb: dict) -> list[dict]:
    return [c for c in nb["cells"] if c["cell_type"] == "code"]


def plan(nb: dict, ignore: dict[str, str]) -> list[tuple[str, str]]:
    """Per code cell (in order), ("ignored" | "checked" | "not compared", why); ``ignore``: cell id -> reason."""
    rows = []
    for i, cell in enumerate(code_cells(nb), start=1):
        key = stamps.cell_key(cell, i)
        if i == 1:
            rows.append(("ignored", "environment report: describes the machine"))
        elif key in ignore:
            rows.append(("ignored", ignore[key]))
        elif MEMORY.search(output_text(cell)):
            rows.append(("checked", "memory numbers in the output"))
        else:
            rows.append(("not compared", "no memory number in the output"))
    return rows


def compare(committed: dict, executed: dict, ignore: dict[str, str],
            sanitizers: list[tuple[re.Pattern, str]]) -> tuple[dict, list[str]]:
    """Counts per verdict and the mismatches (a unified diff per cell) between two runs of a notebook."""
    old, new = code_cells(committed), code_cells(executed)
    if len(old) != len(new):
        return {}, [f"{len(old)} code cells committed, {len(new)} executed"]
    counts: dict[str, int] = {"checked": 0, "ignored": 0, "not compared": 0}
    mismatches = []
    for i, ((verdict, _), a, b) in enumerate(zip(plan(committed, ignore), old, new, strict=True), start=1):
        counts[verdict] += 1
        if verdict != "checked":
            continue
        want, got = sanitize(output_text(a), sanitizers), sanitize(output_text(b), sanitizers)
        if want != got:
            diff = difflib.unified_diff(want.splitlines(), got.splitlines(), "committed", "this run", lineterm="", n=0)
            mismatches.append(f"code cell {i} differs:\n    " + "\n    ".join(list(diff)[:40]))
    return counts, mismatches


def restamp(path: Path, hashes: dict, gpu: str, commit: str, counts: dict) -> dict:
    """Write a fresh stamp into a committed notebook whose re-execution reproduced its compared outputs.

    Only ``metadata.gpubook.execution`` changes; every other byte of the file stays as it was.
    """
    import datetime
    import importlib.metadata

    nb = json.loads(path.read_text(encoding="utf-8"))
    old = nb.get("metadata", {}).get("gpubook", {}).get("execution") or {}
    record = {
        "stamp_format": stamps.FORMAT,
        "commit": commit,
        **hashes,
        "gpu": gpu,
        "torch": importlib.metadata.version("torch"),
        "profile": "full",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "wall_s": old.get("wall_s"),
        "verified_by": "scripts/gpu_check.py",
        "verified": {k.replace(" ", "_"): v for k, v in counts.items()},
        "outputs_from": old.get("outputs_from") or {k: old.get(k) for k in ("date", "gpu", "commit")},
    }
    nb.setdefault("metadata", {}).setdefault("gpubook", {})["execution"] = record
    path.write_text(stamps.dumps_notebook(nb), encoding="utf-8")
    return record


def execute(path: Path, out_dir: Path, timeout_s: int) -> dict:
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    try:
        NotebookClient(nb, timeout=timeout_s, kernel_name="python3",
                       resources={"metadata": {"path": str(path.parent)}}).execute()
    finally:
        nbformat.write(nb, out_dir / path.name)
    return json.loads((out_dir / path.name).read_text(encoding="utf-8"))


def main(argv: list[str] | None = None, committed_dir: Path | None = None) -> int:
    """The command line; ``committed_dir`` (tests) reads the committed notebooks from another folder."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("notebooks", nargs="*", help="chapter files (default: all, in chapters.json order)")
    parser.add_argument("--config", type=Path, default=NOTEBOOKS / "gpu_check.json")
    parser.add_argument("--sanitize", type=Path, default=NOTEBOOKS / "sanitize.cfg")
    parser.add_argument("--executed", type=Path, help="compare the notebooks in this folder; execute nothing")
    parser.add_argument("--plan", action="store_true", help="print the per-chapter policy; execute nothing")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds allowed per cell")
    parser.add_argument("--restamp", action="store_true",
                        help="re-stamp each chapter whose compared outputs all reproduced (outputs untouched)")
    parser.add_argument("--commit", help="with --restamp on a machine without git: the commit of these sources")
    parser.add_argument("--work", type=Path, help="execute into this folder (kept) instead of a temporary one")
    parser.add_argument("--report", type=Path, help="write per-chapter counts, mismatches and verdict flips here (JSON)")
    args = parser.parse_args(argv)
    if args.restamp and (args.plan or args.executed):
        print("--restamp needs this run to execute the chapters (not --plan, not --executed)", file=sys.stderr)
        return 2

    config = json.loads(args.config.read_text(encoding="utf-8"))["ignore"]
    noise_sensitive = verdict_words.load_noise_sensitive(args.config)
    sanitizers = load_sanitizers(args.sanitize)
    chapters = json.loads((NOTEBOOKS / "chapters.json").read_text(encoding="utf-8"))["chapters"]
    if args.notebooks:
        names = {Path(n).name for n in args.notebooks}
        chapters = [c for c in chapters if c["file"] in names]
    n_gpus = 0
    if not (args.plan or args.executed):
        import os

        import torch

        n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not n_gpus:
            print("make gpu-test needs a CUDA GPU: the committed outputs are full-profile GPU runs", file=sys.stderr)
            return 2
        if args.restamp:
            commit, dirty = stamps.provenance([NOTEBOOKS / c["file"] for c in chapters], args.commit, ROOT)
            if dirty:
                print("not re-stamping: these sources differ from git HEAD (commit them first; the outputs are "
                      "still compared):\n  " + "\n  ".join(dirty[:20]), file=sys.stderr, flush=True)
                args.restamp = False
            elif commit == "unknown":
                print("warning: no git here and no --commit SHA (or GPUBOOK_COMMIT): re-stamps record commit "
                      "'unknown'", file=sys.stderr, flush=True)
            gpu_name = torch.cuda.get_device_name(0) if args.restamp else None
        os.environ["GPUBOOK_PROFILE"] = "full"
        if os.environ.pop("MPLBACKEND", None):  # a non-inline backend drops every figure from the outputs
            print("MPLBACKEND unset for the kernels (a non-inline backend drops every figure)", flush=True)
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    work = args.work or Path(tempfile.mkdtemp(prefix="gpubook-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    report: dict[str, dict] = {}
    failed = 0
    totals = {"checked": 0, "ignored": 0, "not compared": 0}
    for chapter in chapters:
        name = chapter["file"]
        committed = json.loads(((committed_dir or NOTEBOOKS) / name).read_text(encoding="utf-8"))
        ignore = config.get(name, {})
        if args.plan:
            verdicts = [v for v, _ in plan(committed, ignore)]
            counts = {k: verdicts.count(k) for k in totals}
            print(f"{name}: would check {counts['checked']}, ignore {counts['ignored']}, "
                  f"not compare {counts['not compared']} code cells")
            totals = {k: totals[k] + counts[k] for k in totals}
            continue
        if not args.executed and chapter["gpus"] > n_gpus:
            print(f"{name}: SKIPPED: needs {chapter['gpus']} GPUs, this machine has {n_gpus}", flush=True)
            continue
        start = time.perf_counter()
        hashes = (stamps.fingerprint(stamps.code_cells(committed), stamps.Sources.from_dirs(
            ROOT / "helpers", NOTEBOOKS / "scripts")) if args.restamp else None)
        try:
            executed = (json.loads((args.executed / name).read_text(encoding="utf-8")) if args.executed
                        else execute(NOTEBOOKS / name, work, args.timeout))
        except Exception as err:
            print(f"{name}: FAILED to execute: {type(err).__name__}: {str(err)[-1500:]}", flush=True)
            failed += 1
            continue
        counts, mismatches = compare(committed, executed, ignore, sanitizers)
        totals = {k: totals[k] + counts.get(k, 0) for k in totals}
        verdict = "ok" if not mismatches else f"{len(mismatches)} MISMATCH(ES)"
        print(f"{name}: {verdict}: checked {counts.get('checked', 0)}, ignored {counts.get('ignored', 0)}, "
              f"not compared {counts.get('not compared', 0)} code cells; {time.perf_counter() - start:.0f} s", flush=True)
        for m in mismatches:
            print(f"  - {m}")
        with_verdicts, flips = verdict_words.compare(committed, executed, noise_sensitive.get(name, {}))
        undeclared = [f for f in flips if not f.declared]
        print(f"  verdicts: {with_verdicts} cells with verdict words, {len(flips)} flipped "
              f"({len(undeclared)} not declared noise-sensitive)", flush=True)
        for f in flips:
            print(f"  - verdict flip: {f.describe()}")
        report[name] = {"counts": counts, "mismatches": len(mismatches), "verdict_cells": with_verdicts,
                        "flips": [f.describe() for f in flips], "undeclared_flips": len(undeclared)}
        failed += bool(mismatches) or bool(undeclared)
        if args.restamp and counts and not mismatches and not undeclared:
            now = json.loads((NOTEBOOKS / name).read_text(encoding="utf-8"))
            if stamps.fingerprint(stamps.code_cells(now), stamps.Sources.from_dirs(
                    ROOT / "helpers", NOTEBOOKS / "scripts")) != hashes:
                print("  not re-stamped: its sources changed during the run", flush=True)
            else:
                restamp(NOTEBOOKS / name, hashes, gpu_name, commit, counts)
                print(f"  re-stamped: {name}'s stamp now holds the hashes of the sources this run executed", flush=True)
    if args.report:
        args.report.write_text(json.dumps(report, indent=1))
    print(f"total: checked {totals['checked']}, ignored {totals['ignored']}, not compared {totals['not compared']}"
          + ("" if args.plan else f"; executed notebooks in {args.executed or work}"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
