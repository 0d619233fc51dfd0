#!/usr/bin/env python3
"""Check the GitHub Actions workflow files (.github/workflows/*.yml); they cannot run here.

Each file must parse as YAML and have a trigger (`on`) and jobs; each job a runner (`runs-on`) and steps;
each `uses:` step an action pinned to a version (`owner/action@vN`); every `make TARGET` in a `run:`
step must name a target the Makefile defines, and every job with `run:` steps must call make (the
workflows run the same commands as a maintainer, nothing written only in YAML).

Usage: python scripts/check_workflows.py [.github/workflows] [--makefile Makefile]   (exit 1 on any problem)
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
TARGET = re.compile(r"^([A-Za-z0-9][A-Za-z0-9_.-]*)\s*:(?!=)", re.M)
MAKE_CALL = re.compile(r"(?:^|[;&|]\s*|\s)make\s+((?:[A-Za-z_][A-Za-z0-9_]*=\S+\s+|-\S+\s+)*)([A-Za-z0-9][\w.-]*)")


def makefile_targets(makefile: Path) -> set[str]:
    return set(TARGET.findall(makefile.read_text(encoding="utf-8")))


def check(path: Path, targets: set[str]) -> list[str]:
    """The problems of one workflow file (empty when it is fine)."""
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        return [f"not valid YAML: {err}"]
    if not isinstance(doc, dict):
        return ["not a mapping"]
    problems = []
    if "on" not in doc and True not in doc:  # YAML 1.1 reads a bare `on` key as True
        problems.append("no trigger (`on`)")
    jobs = doc.get("jobs")
    if not isinstance(jobs, dict) or not jobs:
        return problems + ["no jobs"]
    for name, job in jobs.items():
        if not isinstance(job, dict) or "runs-on" not in job:
            problems.append(f"job {name}: no runs-on")
            continue
        steps = job.get("steps")
        if not isinstance(steps, list) or not steps:
            problems.append(f"job {name}: no steps")
            continue
        runs = [s["run"] for s in steps if isinstance(s, dict) and "run" in s]
        for step in steps:
            uses = step.get("uses") if isinstance(step, dict) else None
            if uses and not re.fullmatch(r"[\w.-]+/[\w./-]+@[\w.-]+", uses):
                problems.append(f"job {name}: action not pinned to a version: {uses}")
        called = [m.group(2) for run in runs for m in MAKE_CALL.finditer(run)]
        if runs and not called:
            problems.append(f"job {name}: its run steps call no Makefile target")
        for target in called:
            if target not in targets:
                problems.append(f"job {name}: `make {target}`: the Makefile has no target {target!r}")
    return problems


def main(argv: list[str]) -> int:
    makefile = ROOT / "Makefile"
    if "--makefile" in argv:
        i = argv.index("--makefile")
        makefile = Path(argv[i + 1])
        argv = argv[:i] + argv[i + 2:]
    folder = Path(argv[0]) if argv else ROOT / ".github" / "workflows"
    files = sorted(folder.glob("*.yml")) + sorted(folder.glob("*.yaml"))
    if not files:
        print(f"no workflow files in {folder}")
        return 1
    targets = makefile_targets(makefile)
    failed = 0
    for path in files:
        problems = check(path, targets)
        print(f"{path}: {'ok' if not problems else f'{len(problems)} problem(s)'}")
        for problem in problems:
            print(f"  - {problem}")
        failed += bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
