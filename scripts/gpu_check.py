#!/usr/bin/env python3
"""GPU output check (make gpu-test): re-execute the chapters on a GPU and compare their memory numbers.

    python scripts/gpu_check.py                      # execute every chapter (full profile), compare
    python scripts/gpu_check.py --executed DIR       # compare notebooks already executed into DIR
    python scripts/gpu_check.py --plan               # only say which cells would be checked/ignored

The policy, per code cell (the chapters' code cells carry no nbval markers; the policy lives here and
in notebooks/gpu_check.json, so the GPU outputs need not be touched to change it):

- ignored: the first code cell (the environment report describes the machine) and every cell that
  notebooks/gpu_check.json lists for its notebook, each with a reason (timings, losses, throughputs,
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
written. A chapter that needs more GPUs than the machine has is skipped, saying so. Exit 1 on any
mismatch or failed execution.
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
    """Per code cell (1-based order), ("ignored" | "checked" | "not compared", why)."""
    rows = []
    for i, cell in enumerate(code_cells(nb), start=1):
        if i == 1:
            rows.append(("ignored", "environment report: describes the machine"))
        elif str(i) in ignore:
            rows.append(("ignored", ignore[str(i)]))
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("notebooks", nargs="*", help="chapter files (default: all, in chapters.json order)")
    parser.add_argument("--config", type=Path, default=NOTEBOOKS / "gpu_check.json")
    parser.add_argument("--sanitize", type=Path, default=NOTEBOOKS / "sanitize.cfg")
    parser.add_argument("--executed", type=Path, help="compare the notebooks in this folder; execute nothing")
    parser.add_argument("--plan", action="store_true", help="print the per-chapter policy; execute nothing")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds allowed per cell")
    args = parser.parse_args(argv)

    config = json.loads(args.config.read_text(encoding="utf-8"))["ignore"]
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
        os.environ["GPUBOOK_PROFILE"] = "full"
        if os.environ.pop("MPLBACKEND", None):  # a non-inline backend drops every figure from the outputs
            print("MPLBACKEND unset for the kernels (a non-inline backend drops every figure)", flush=True)
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    work = Path(tempfile.mkdtemp(prefix="gpubook-gpu-check-"))
    failed = 0
    totals = {"checked": 0, "ignored": 0, "not compared": 0}
    for chapter in chapters:
        name = chapter["file"]
        committed = json.loads((NOTEBOOKS / name).read_text(encoding="utf-8"))
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
        failed += bool(mismatches)
    print(f"total: checked {totals['checked']}, ignored {totals['ignored']}, not compared {totals['not compared']}"
          + ("" if args.plan else f"; executed notebooks in {args.executed or work}"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
