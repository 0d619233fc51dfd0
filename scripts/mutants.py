"""Mutation test: plant one bug at a time in a scratch copy of the repository and see which CPU test catches it.

Each mutant is a textual replacement located by a search string that must occur exactly once across
``helpers/**/*.py`` (not by a fixed path: code may move between modules). The script

1. copies the repository's files (git's tracked and untracked-but-not-ignored files) to a scratch folder,
   and never writes to the repository itself;
2. runs the union of the mutants' test files once unmutated: they must pass, or the table would mean nothing;
3. for each mutant: applies it in the scratch copy, runs ``pytest -x`` on its test files, restores the file
   and checks the restoration byte for byte;
4. prints a table: mutant, kind, file, and the test that caught it, or SURVIVED.

Exit status 0 when every mutant is caught, 1 when one survives, 2 when a search string is not found exactly
once or the unmutated tests fail. The first 9 are the code review's (2026-11-27, section 4.2: M1-M6 and the
survivors X2, X5, X7); F1-F13 are fresh ones of the same kinds::

    PYTHONPATH=$PWD python scripts/mutants.py                 # all of them (a few minutes on 2 cores)
    PYTHONPATH=$PWD python scripts/mutants.py --only M1,M5    # some
    PYTHONPATH=$PWD python scripts/mutants.py --list          # the mutants and their test files
    PYTHONPATH=$PWD python scripts/mutants.py --only M1,M5 --tests tests/test_golden_numbers.py
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

GOLDEN = ("tests/test_golden_rules.py", "tests/test_golden_numbers.py")
PLAN = (*GOLDEN, "tests/test_plan.py")
MEASURE = ("tests/test_golden_rules.py", "tests/test_measure.py", "tests/test_cleanup.py", "tests/test_batching.py")
TIMING = ("tests/test_golden_rules.py", "tests/test_timing_profiler.py", "tests/test_interleaved.py",
          "tests/test_collectives.py")
ESTIMATES = (*GOLDEN, "tests/test_estimates.py")


@dataclass(frozen=True)
class Mutant:
    id: str
    kind: str
    what: str
    find: str
    replace: str
    tests: tuple[str, ...]


MUTANTS = [
    # --- the review's six (section 4.2)
    Mutant("M1", "off-by-one in a formula", "plan: which blocks are checkpointed every k",
           "return [i % k == 0 for i in range(n_layers)]", "return [(i + 1) % k == 0 for i in range(n_layers)]", PLAN),
    Mutant("M2", "wrong unit", "measure.allocator_mib: allocated / MIB -> / GIB",
           '"allocated_mib": torch.cuda.memory_allocated(device) / MIB',
           '"allocated_mib": torch.cuda.memory_allocated(device) / GIB', MEASURE),
    Mutant("M3", "median -> mean", "timing.Spread.of: statistics.median -> statistics.mean",
           "return cls(statistics.median(samples), q1, q3", "return cls(statistics.mean(samples), q1, q3", TIMING),
    Mutant("M4", "dropped term", "plan.predict: the forward peak at the loss loses the logits",
           '"temporaries": loss_fwd + kv}', '"temporaries": kv}', PLAN),
    Mutant("M5", "wrong bytes per parameter", "plan.optimizer_state_bytes: AdamW states always fp32",
           "total += 2 * n * e", "total += 2 * n * 4", PLAN),
    Mutant("M6", "threshold", "timing.GPU_BOUND_BUSY 0.9 -> 0.6",
           "GPU_BOUND_BUSY = 0.9", "GPU_BOUND_BUSY = 0.6", TIMING),
    # --- the review's survivors among its ten extra mutants
    Mutant("X2", "wrong bytes per parameter", "estimates.BYTES_PER_PARAM['mixed_adamw'] weights 6 -> 4",
           '"mixed_adamw": {"weights": 6,', '"mixed_adamw": {"weights": 4,', ESTIMATES),
    Mutant("X5", "threshold", "cleanup.back_at_baseline tolerance x100",
           "baseline_mib + tolerance_mib", "baseline_mib + 100 * tolerance_mib",
           ("tests/test_golden_rules.py", "tests/test_cleanup.py")),
    Mutant("X7", "dropped term", "plan.predict: ZeRO-3's gathered block dropped",
           "gathered = shape.layer_linear_numel() * _weight_dtype_bytes(s)", "gathered = 0", PLAN),
    # --- fresh ones of the same kinds
    Mutant("F1", "off-by-one in a formula", "estimates.zero_model_state_bytes: gradients sharded from stage 3",
           '"gradients": grad_bytes * n_params * share[level >= 2]',
           '"gradients": grad_bytes * n_params * share[level >= 3]', ESTIMATES),
    Mutant("F2", "wrong unit", "measure.allocator_mib: peak / MIB -> / GIB",
           '"peak_allocated_mib": torch.cuda.max_memory_allocated(device) / MIB',
           '"peak_allocated_mib": torch.cuda.max_memory_allocated(device) / GIB', MEASURE),
    Mutant("F3", "median -> mean", "timing.Comparison.speedup: median of the rounds -> mean",
           "return statistics.median(self.ratios)", "return statistics.mean(self.ratios)", TIMING),
    Mutant("F4", "dropped term", "flops.flops_per_token: the attention term 12 L d s dropped",
           "train = 6 * n_matmul_params + 12 * n_layers * hidden * seq_len", "train = 6 * n_matmul_params",
           ("tests/test_flops.py",)),
    Mutant("F5", "wrong bytes per parameter", "plan.optimizer_state_bytes: SGD momentum always fp32",
           'elif opt == "sgd-momentum":\n            total += n * e',
           'elif opt == "sgd-momentum":\n            total += n * 4', PLAN),
    Mutant("F6", "threshold", "timing.ratio_verdict: 'faster' needs lo > 1.03 instead of >=",
           "if lo >= 1.0 + threshold:", "if lo > 1.0 + threshold:", TIMING),
    Mutant("F7", "off-by-one in a formula", "timing.median_interval: upper order statistic one rank lower",
           "return xs[j - 1], xs[n - j]", "return xs[j - 1], xs[n - j - 1]", TIMING),
    Mutant("F8", "threshold", "accounting.optimizer_state_bytes: counts AdamW's 0-d step counters",
           "(include_scalars or value.dim() > 0)", "(include_scalars or value.dim() >= 0)",
           ("tests/test_golden_rules.py", "tests/test_accounting.py", "tests/test_estimates.py")),
    Mutant("F9", "dropped term", "plan._loss_bytes: backward keeps one fp32 logits gradient, not two",
           "bwd = 8 * tv", "bwd = 4 * tv", PLAN),
    Mutant("F10", "threshold", "timing.verdict: host-bound needs host > 0.5 instead of >=",
           "host_fraction is not None and host_fraction >= 0.5 \\", "host_fraction is not None and host_fraction > 0.5 \\",
           TIMING),
    Mutant("F11", "wrong unit", "measure.nvml_used_mib: used / MIB -> / GIB",
           "return pynvml.nvmlDeviceGetMemoryInfo(handle).used / MIB",
           "return pynvml.nvmlDeviceGetMemoryInfo(handle).used / GIB", MEASURE),
    Mutant("F12", "dropped term", "plan.autocast_copy_bytes: the adapters' 16-bit copies dropped",
           "    total += 2 * lora_trainable_params(s)\n    return total", "    return total", PLAN),
    Mutant("F13", "wrong bytes per parameter", "plan.optimizer_state_bytes: 8-bit AdamW without its absmaxes",
           "total += 2 * n + 2 * 4 * math.ceil(n / BNB_OPT_BLOCK)", "total += 2 * n", PLAN),
]


# ------------------------------------------------------------------------------------------------------


class MutantError(RuntimeError):
    """A mutant cannot be applied (its search string is not found exactly once)."""


def repo_files(root: Path) -> list[Path]:
    """The files a checkout holds: git's tracked files and the untracked ones it does not ignore."""
    try:
        out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             check=True, capture_output=True).stdout
        return [Path(p) for p in out.decode().split("\0") if p]
    except (subprocess.CalledProcessError, FileNotFoundError):
        skip = {".git", ".venv", "__pycache__", "_build", ".pytest_cache"}
        return [p.relative_to(root) for p in root.rglob("*") if p.is_file() and not skip & set(p.relative_to(root).parts)]


def scratch_copy(root: Path) -> Path:
    dest = Path(tempfile.mkdtemp(prefix="gpubook-mutants-"))
    if dest.resolve().is_relative_to(root.resolve()):
        raise MutantError(f"the scratch folder {dest} lies inside the repository")
    for rel in repo_files(root):
        src = root / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


def locate(scratch: Path, m: Mutant) -> Path:
    """The one file of ``helpers/**/*.py`` that holds ``m.find`` exactly once (and no other file holds it)."""
    hits = [(p, p.read_text().count(m.find)) for p in sorted((scratch / "helpers").rglob("*.py"))]
    hits = [(p, n) for p, n in hits if n]
    total = sum(n for _, n in hits)
    if total != 1:
        where = ", ".join(f"{p.relative_to(scratch)} x{n}" for p, n in hits) or "nowhere"
        raise MutantError(f"{m.id}: the search string {m.find!r} must occur exactly once in helpers/**/*.py; "
                          f"found {total} ({where}). Update the mutant to the code.")
    return hits[0][0]


def run_pytest(scratch: Path, tests: tuple[str, ...], timeout_s: float) -> tuple[int, str, float]:
    env = {**os.environ, "PYTHONPATH": str(scratch), "PYTHONDONTWRITEBYTECODE": "1", "MPLBACKEND": "Agg"}
    missing = [t for t in tests if not (scratch / t).exists()]
    if missing:
        raise MutantError(f"test files not in the repository: {', '.join(missing)}")
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-rf", "--no-header", "-p", "no:cacheprovider", *tests]
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=scratch, env=env, capture_output=True, text=True, timeout=timeout_s)
        return done.returncode, done.stdout + done.stderr, time.perf_counter() - t0
    except subprocess.TimeoutExpired as err:
        return -1, f"timed out after {timeout_s:.0f} s\n{err.stdout or ''}", time.perf_counter() - t0


def first_failure(output: str) -> str:
    m = re.search(r"^FAILED (.+?)(?: - |$)", output, re.M)
    if m:
        return m.group(1).removeprefix("tests/")
    m = re.search(r"^ERROR (.+?)(?: - |$)", output, re.M)
    return f"error in {m.group(1)}" if m else "(see pytest output)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Plant one bug at a time in a scratch copy and run the CPU tests.")
    ap.add_argument("--only", help="comma-separated mutant ids (default: all)")
    ap.add_argument("--list", action="store_true", help="print the mutants and exit")
    ap.add_argument("--keep", action="store_true", help="keep the scratch copy (its path is printed)")
    ap.add_argument("--tests", help="comma-separated test files that replace every mutant's own (e.g. to see "
                    "whether the golden tests alone catch a mutant)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per pytest run")
    ap.add_argument("--verbose", action="store_true", help="print pytest's output of survivors and errors")
    args = ap.parse_args(argv)
    mutants = MUTANTS
    if args.only:
        wanted = [x.strip() for x in args.only.split(",") if x.strip()]
        unknown = set(wanted) - {m.id for m in MUTANTS}
        if unknown:
            ap.error(f"unknown mutant(s): {', '.join(sorted(unknown))}")
        mutants = [m for m in MUTANTS if m.id in wanted]
    if args.tests:
        tests = tuple(t.strip() for t in args.tests.split(",") if t.strip())
        mutants = [dataclasses.replace(m, tests=tests) for m in mutants]
    if args.list:
        for m in mutants:
            print(f"{m.id:4} {m.kind:26} {m.what}  [{', '.join(t.removeprefix('tests/') for t in m.tests)}]")
        return 0

    scratch = scratch_copy(ROOT)
    print(f"scratch copy: {scratch}", flush=True)
    try:
        files = {m.id: locate(scratch, m) for m in mutants}  # every search string first: fail before any run
        union = tuple(dict.fromkeys(t for m in mutants for t in m.tests))
        rc, out, secs = run_pytest(scratch, union, args.timeout)
        if rc != 0:
            print(out[-4000:])
            print(f"the unmutated tests fail (exit {rc}): fix them before a mutation test", file=sys.stderr)
            return 2
        print(f"unmutated: {len(union)} test files pass ({secs:.0f} s)", flush=True)
        rows = []
        for m in mutants:
            path = files[m.id]
            original = path.read_bytes()
            path.write_text(original.decode().replace(m.find, m.replace, 1))
            try:
                rc, out, secs = run_pytest(scratch, m.tests, args.timeout)
            finally:
                path.write_bytes(original)
            if path.read_bytes() != original:
                raise MutantError(f"{m.id}: {path} was not restored")
            if rc == 1:
                result, by = "caught", first_failure(out)
            elif rc == 0:
                result, by = "SURVIVED", ""
            else:  # a collection error, an interrupted run or a timeout: not a test that caught a wrong number
                result, by = f"error (exit {rc})", first_failure(out)
            rows.append((m, str(path.relative_to(scratch)), result, by, secs))
            print(f"{m.id:4} {result:9} {secs:5.0f} s  {by}", flush=True)
            if args.verbose and result != "caught":
                print(out[-3000:])
    except MutantError as err:
        print(f"mutants.py: {err}", file=sys.stderr)
        return 2
    finally:
        if args.keep:
            print(f"kept: {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)

    print()
    print("| # | kind | bug | file | result | caught by |")
    print("|---|---|---|---|---|---|")
    for m, file, result, by, _ in rows:
        print(f"| {m.id} | {m.kind} | {m.what} | {file} | {'**' + result + '**' if result != 'caught' else result} "
              f"| {by} |")
    caught = sum(r[2] == "caught" for r in rows)
    print(f"\ncaught {caught} of {len(rows)} mutants with the CPU tests")
    return 0 if caught == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
