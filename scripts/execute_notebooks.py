#!/usr/bin/env python3
"""Execute chapter notebooks in the full profile on a GPU machine, then run the hygiene check.

    python scripts/execute_notebooks.py notebooks/01_memory_anatomy.ipynb [--out DIR] [--wheels DIR]

Each notebook runs top to bottom in a fresh kernel with GPUBOOK_PROFILE=full and is written back in
place (or into --out). Made for a bare GPU machine whose Python already has torch: it installs
nothing it does not need. Packages that are missing (nbclient, ipykernel, datasets, bitsandbytes,
...) can come from a folder of wheels (--wheels): only the wheels whose distribution is not
installed are unpacked, into a private folder put on PYTHONPATH for this run and its kernels.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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


def execute(path: Path, out: Path, timeout_s: int) -> float:
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    client = NotebookClient(
        nb, timeout=timeout_s, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    try:
        client.execute()
    finally:
        nbformat.write(nb, out)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("notebooks", nargs="*", type=Path)
    parser.add_argument("--out", type=Path, help="write executed notebooks here instead of in place")
    parser.add_argument("--wheels", type=Path, help="folder of wheels for packages this Python lacks")
    parser.add_argument("--site", type=Path, default=Path("/tmp/gpubook-site"), help="where wheels are unpacked")
    parser.add_argument("--profile", default="full", choices=["full", "tiny"])
    parser.add_argument("--timeout", type=int, default=1200, help="seconds allowed per cell")
    args = parser.parse_args()

    if args.wheels and not os.environ.get("_GPUBOOK_REEXEC"):
        added = install_missing(args.wheels, args.site)
        print(f"installed from {args.wheels}: {', '.join(added) or 'nothing (all present)'}", flush=True)
        env = dict(os.environ, _GPUBOOK_REEXEC="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), str(args.site), env.get("PYTHONPATH")]))
        return subprocess.call([sys.executable, *sys.argv], env=env)

    os.environ["GPUBOOK_PROFILE"] = args.profile
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    notebooks = args.notebooks or sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    status = 0
    written = []
    for path in notebooks:
        out = (args.out / path.name) if args.out else path
        try:
            seconds = execute(path, out, args.timeout)
            print(f"{path.name}: executed in {seconds:.0f} s -> {out}", flush=True)
        except Exception as err:  # report and go on with the next notebook
            print(f"{path.name}: FAILED: {type(err).__name__}: {str(err)[-2000:]}", flush=True)
            status = 1
        written.append(str(out))
    check = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_notebooks.py"), *written])
    return status or check.returncode


if __name__ == "__main__":
    sys.exit(main())
