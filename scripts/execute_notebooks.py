#!/usr/bin/env python3
"""Execute chapter notebooks in the full profile on a GPU machine, then run the hygiene check.

    python scripts/execute_notebooks.py [notebooks/01_memory_anatomy.ipynb ...] [--out DIR] [--wheels DIR]

Without notebook arguments, every chapter runs in the order of notebooks/chapters.json; a chapter that
needs more GPUs than the machine has is skipped, saying so. Each notebook runs top to bottom in a
fresh kernel with GPUBOOK_PROFILE=full into a temporary file, which replaces the committed notebook
(or lands in --out) only when every cell succeeded: a failed run never overwrites a notebook (its
partial output is kept in a temporary folder for reading). The full profile needs a CUDA GPU: without
one the script refuses to start. Each executed notebook is stamped in its metadata
(``gpubook.execution``: git commit, sha256 of each helpers/*.py and of each code cell, GPU, torch
version, UTC date, wall seconds; the hygiene check compares them with today's code), and its wall time
is recorded in execution_times.json beside the written notebooks (read by scripts/status_page.py).

Made for a bare GPU machine whose Python already has torch: it installs nothing it does not need.
Packages that are missing (nbclient, ipykernel, datasets, bitsandbytes, ...) can come from a folder of
wheels (--wheels): only the wheels whose distribution is not installed are unpacked, into a private
folder put on PYTHONPATH for this run and its kernels.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import check_notebooks  # noqa: E402  (the hashes the hygiene check compares)

CHAPTERS = ROOT / "notebooks" / "chapters.json"
TIMES = "execution_times.json"


def _dist_name(wheel: Path) -> str:
    return re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower()


def _installed(name: str) -> bool:
    try:
        importlib.metadata.version(name)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def install_missing(wheels: Path, target: Path) -> list[str]:
    """Install (without dependencies or network) the wheels whose distribution is missing."""
    missing = [w for w in sorted(wheels.glob("*.whl")) if not _installed(_dist_name(w))]
    if missing:
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
             "--target", str(target), *map(str, missing)],
            check=True,
        )
    return [_dist_name(w) for w in missing]


def gpus() -> tuple[int, str | None]:
    """(number of CUDA GPUs, name of the first) as torch sees them; (0, None) without CUDA or torch."""
    try:
        import torch
    except ImportError:
        return 0, None
    if not torch.cuda.is_available():
        return 0, None
    return torch.cuda.device_count(), torch.cuda.get_device_name(0)


def drop_non_inline_backend() -> None:
    """Unset MPLBACKEND for the kernels this process starts, saying so.

    With ``MPLBACKEND=Agg`` (as set for the CPU nbval run) in its environment, a Jupyter kernel does not
    use its inline backend, and every figure silently vanishes from the executed notebook's outputs.
    """
    backend = os.environ.pop("MPLBACKEND", None)
    if backend:
        print(f"MPLBACKEND={backend} unset for the kernels: a non-inline backend would drop every figure from "
              "the outputs", flush=True)


def chapter_order(chapters: Path = CHAPTERS) -> list[dict]:
    """The chapters (file, gpus, ...) in the order of notebooks/chapters.json."""
    return json.loads(chapters.read_text(encoding="utf-8"))["chapters"]


def git_commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "helpers", "notebooks"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head.stdout.strip() + ("+uncommitted" if dirty else "")


def stamp(nb, gpu: str | None, wall_s: float, profile: str) -> dict:
    """The execution record stored in the notebook's metadata (gpubook.execution)."""
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = None
    record = {
        "commit": git_commit(),
        **check_notebooks.helpers_fingerprint(ROOT / "helpers"),
        **check_notebooks.code_fingerprint(nb),
        "gpu": gpu or "none (CPU)",
        "torch": torch_version,
        "profile": profile,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "wall_s": round(wall_s, 1),
    }
    nb.metadata.setdefault("gpubook", {})["execution"] = record
    return record


def record_time(times: Path, name: str, record: dict) -> None:
    """Add one chapter's wall time to execution_times.json (read, update, replace)."""
    data = json.loads(times.read_text(encoding="utf-8")) if times.exists() else {"chapters": {}}
    data["chapters"][name] = {k: record[k] for k in ("wall_s", "gpu", "torch", "profile", "date", "commit")}
    data["chapters"] = dict(sorted(data["chapters"].items()))
    tmp = times.with_name(times.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, times)


def execute(path: Path, out: Path, timeout_s: int, gpu: str | None = None, profile: str = "full") -> dict:
    """Run one notebook in a fresh kernel; write it to `out` only if every cell succeeded.

    The executed notebook goes to a temporary file beside `out`, stamped, then replaces `out`. On any
    failure `out` is left as it was and the partial run is saved under the system temp folder.
    """
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    client = NotebookClient(
        nb, timeout=timeout_s, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    try:
        client.execute()
    except BaseException:
        failed = Path(tempfile.gettempdir()) / "gpubook-failed"
        failed.mkdir(exist_ok=True)
        nbformat.write(nb, failed / path.name)
        print(f"{path.name}: the partial run is in {failed / path.name}; {out} is untouched", flush=True)
        raise
    record = stamp(nb, gpu, time.perf_counter() - start, profile)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.stem}.", suffix=".ipynb.tmp", dir=out.parent)
    os.close(fd)
    try:
        nbformat.write(nb, tmp)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("notebooks", nargs="*", type=Path)
    parser.add_argument("--out", type=Path, help="write executed notebooks here instead of in place")
    parser.add_argument("--wheels", type=Path, help="folder of wheels for packages this Python lacks")
    parser.add_argument("--site", type=Path, default=Path("/tmp/gpubook-site"), help="where wheels are unpacked")
    parser.add_argument("--profile", default="full", choices=["full", "tiny"])
    parser.add_argument("--timeout", type=int, default=1200, help="seconds allowed per cell")
    args = parser.parse_args(argv)

    if args.wheels and not os.environ.get("_GPUBOOK_REEXEC"):
        added = install_missing(args.wheels, args.site)
        print(f"installed from {args.wheels}: {', '.join(added) or 'nothing (all present)'}", flush=True)
        env = dict(os.environ, _GPUBOOK_REEXEC="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), str(args.site), env.get("PYTHONPATH")]))
        return subprocess.call([sys.executable, *sys.argv], env=env)

    n_gpus, gpu = gpus()
    if args.profile == "full" and not n_gpus:
        print("refusing to run the full profile without a CUDA GPU: its outputs are the book's GPU numbers. "
              "On a CPU, use --profile tiny (nothing is written over the committed notebooks unless you ask).",
              file=sys.stderr)
        return 2
    os.environ["GPUBOOK_PROFILE"] = args.profile
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    drop_non_inline_backend()
    if args.notebooks:
        todo = [(path, 1) for path in args.notebooks]
    else:
        todo = [(ROOT / "notebooks" / c["file"], c["gpus"]) for c in chapter_order()]
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    status = 0
    written = []
    for path, needs in todo:
        if args.profile == "full" and needs > n_gpus:
            print(f"{path.name}: SKIPPED: needs {needs} GPUs, this machine has {n_gpus}", flush=True)
            continue
        out = (args.out / path.name) if args.out else path
        try:
            record = execute(path, out, args.timeout, gpu, args.profile)
            record_time(out.parent / TIMES, path.stem, record)
            print(f"{path.name}: executed in {record['wall_s']:.0f} s -> {out}", flush=True)
            written.append(str(out))
        except Exception as err:  # report and go on with the next notebook
            print(f"{path.name}: FAILED: {type(err).__name__}: {str(err)[-2000:]}", flush=True)
            status = 1
    if not written:
        return status or 1
    check = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_notebooks.py"), *written])
    return status or check.returncode


if __name__ == "__main__":
    sys.exit(main())
