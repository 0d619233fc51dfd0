#!/usr/bin/env python3
"""Execute chapter notebooks in the full profile on a GPU machine, then run the hygiene check.

    python scripts/execute_notebooks.py [notebooks/01_memory_anatomy.ipynb ...] [--out DIR] [--wheels DIR]
                                        [--commit SHA] [--emulate t4]

Without notebook arguments, every chapter runs in the order of notebooks/chapters.json; a chapter that
needs more GPUs than the machine has is skipped, saying so. Each notebook runs top to bottom in a
fresh kernel with GPUBOOK_PROFILE=full into a temporary file, which replaces the committed notebook
(or lands in --out) only when every cell succeeded: a failed run never overwrites a notebook (its
partial output is kept in a temporary folder for reading). The full profile needs a CUDA GPU: without
one the script refuses to start. Each executed notebook is stamped in its metadata
(``gpubook.execution``: content hashes of its code cells, of the helpers functions and classes it reaches
and of the launched scripts it names (scripts/stamps.py), git commit, GPU, torch version, UTC date, wall
seconds; the hygiene check compares the hashes with today's sources), and its wall time is recorded in
execution_times.json beside the written notebooks (read by scripts/status_page.py).

Provenance. In a git checkout the stamp records HEAD, and a full-profile run is refused when helpers/,
notebooks/scripts/ or a notebook to execute differ from HEAD (commit first: a stamp must name sources that
are in git). A machine without git (a copied working tree) records the commit given by ``--commit SHA`` or
the environment variable ``GPUBOOK_COMMIT``, else "unknown", with a warning. Staleness is decided by the
content hashes, so the commit is for the reader; the hashes are taken before the run and again after it,
and a chapter whose sources changed in between is not written.

Made for a bare GPU machine whose Python already has torch: it installs nothing it does not need.
Packages that are missing (nbclient, ipykernel, datasets, bitsandbytes, ...) can come from a folder of
wheels (--wheels): only the wheels whose distribution is not installed are unpacked, into a private
folder put on PYTHONPATH for this run and its kernels.

T4 mode (``--emulate t4``, ``make gpu-run EMULATE=t4``): the kernels run with ``GPUBOOK_EMULATE=t4`` and a
sitecustomize.py first on their PYTHONPATH that loads scripts/emulate_t4.py, so a big GPU answers like a
Colab T4 (compute capability 7.5, its name and memory, no bf16/TF32/flash attention; see that module for
what it cannot emulate), and they see one GPU. Only the single-GPU chapters run (chapter 7 needs two; a T4
reader has one), into a separate folder (``--out``, default _build/emulate-t4): never over the committed
notebooks. Their stamps name the emulated card. ``GPUBOOK_EMULATE`` set without ``--emulate`` is refused.
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
import check_notebooks  # noqa: E402  (the text of an output, as the hygiene check reads it)
import stamps  # noqa: E402  (the content hashes the hygiene check compares)

CHAPTERS = ROOT / "notebooks" / "chapters.json"
TIMES = "execution_times.json"
EMULATE_VAR = "GPUBOOK_EMULATE"  # read by scripts/emulate_t4.py in each kernel
EMULATE_CARDS = ("t4",)


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


def nbformat_read(path: Path):
    import nbformat

    return nbformat.read(path, as_version=4)


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


def emulation_environ(card: str, environ: dict, folder: Path) -> dict:
    """The kernels' environment for emulating ``card`` (scripts/emulate_t4.py): a copy of ``environ``.

    Writes into ``folder`` the sitecustomize.py that loads the emulation and puts ``folder`` first on
    PYTHONPATH (this checkout second, so the kernels import its helpers), sets ``GPUBOOK_EMULATE`` and shows
    the kernels one GPU: the first of ``CUDA_VISIBLE_DEVICES``, else GPU 0 (a T4 reader has one).
    """
    if card not in EMULATE_CARDS:
        raise ValueError(f"unknown card to emulate {card!r}; known: {', '.join(EMULATE_CARDS)}")
    import emulate_t4

    emulate_t4.write_sitecustomize(folder)
    env = dict(environ)
    env[EMULATE_VAR] = card
    paths = [str(folder), str(ROOT), *(environ.get("PYTHONPATH") or "").split(os.pathsep)]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p))
    first = (environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0].strip() or "0"
    env["CUDA_VISIBLE_DEVICES"] = first
    return env


def emulation_visible(nb) -> bool:
    """Whether the first code cell's output (the environment report) names an emulated card.

    A kernel started without the emulation (a Python that ignores PYTHONPATH, a sitecustomize that did not
    load) would run as the big card; its report then names that card alone, and the run must not pass as a T4's.
    """
    code = [c for c in nb.cells if c.cell_type == "code"]
    report = "\n".join(check_notebooks._text_of(out) for out in code[0].get("outputs", [])) if code else ""
    return "(emulated on " in report


def chapter_order(chapters: Path = CHAPTERS) -> list[dict]:
    """The chapters (file, gpus, ...) in the order of notebooks/chapters.json."""
    return json.loads(chapters.read_text(encoding="utf-8"))["chapters"]


provenance = stamps.provenance


def stamp(nb, gpu: str | None, wall_s: float, profile: str, commit: str | None = None,
          hashes: dict | None = None) -> dict:
    """The execution record stored in the notebook's metadata (gpubook.execution).

    ``hashes``: the chapter's content hashes taken before the run (default: now, from this checkout).
    """
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = None
    record = {
        "stamp_format": stamps.FORMAT,
        "commit": commit or provenance([], None, ROOT)[0],
        **(hashes if hashes is not None else content_hashes(nb, ROOT / "notebooks")),
        "gpu": gpu or "none (CPU)",
        "torch": torch_version,
        "profile": profile,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "wall_s": round(wall_s, 1),
    }
    nb.metadata.setdefault("gpubook", {})["execution"] = record
    return record


def content_hashes(nb, folder: Path) -> dict:
    """The chapter's content hashes from the sources on disk now (read afresh, never cached)."""
    sources = stamps.Sources.from_dirs(ROOT / "helpers", folder / "scripts")
    return stamps.fingerprint(stamps.code_cells(nb), sources)


def record_time(times: Path, name: str, record: dict) -> None:
    """Add one chapter's wall time to execution_times.json (read, update, replace)."""
    data = json.loads(times.read_text(encoding="utf-8")) if times.exists() else {"chapters": {}}
    data["chapters"][name] = {k: record[k] for k in ("wall_s", "gpu", "torch", "profile", "date", "commit")}
    data["chapters"] = dict(sorted(data["chapters"].items()))
    tmp = times.with_name(times.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, times)


def execute(path: Path, out: Path, timeout_s: int, gpu: str | None = None, profile: str = "full",
            commit: str | None = None) -> dict:
    """Run one notebook in a fresh kernel; write it to `out` only if every cell succeeded.

    The executed notebook goes to a temporary file beside `out`, stamped, then replaces `out`. On any
    failure `out` is left as it was and the partial run is saved under the system temp folder. The content
    hashes are taken before the run; if they differ after it (an edit during the run), nothing is written.
    """
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    before = content_hashes(nb, path.parent)
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
    wall_s = time.perf_counter() - start
    if content_hashes(nbformat.read(path, as_version=4), path.parent) != before:
        raise RuntimeError(f"{path.name}: its cells, the helpers it uses or its scripts changed during the run; "
                           f"{out} is untouched: run it again")
    record = stamp(nb, gpu, wall_s, profile, commit, before)
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
    parser.add_argument("--commit", help="the commit these sources are (a machine without git; "
                                         "default: $GPUBOOK_COMMIT, else unknown)")
    parser.add_argument("--emulate", choices=EMULATE_CARDS,
                        help="run the single-GPU chapters as on this card (scripts/emulate_t4.py), into --out "
                             "(default _build/emulate-CARD), never over the committed notebooks")
    args = parser.parse_args(argv)

    in_env = os.environ.get(EMULATE_VAR, "").strip().lower()
    if in_env and in_env != (args.emulate or ""):
        print(f"{EMULATE_VAR}={in_env} is set: the kernels would run emulated; pass --emulate {in_env} (which "
              f"writes into a separate folder) or unset it", file=sys.stderr)
        return 2
    if args.emulate:
        args.out = (args.out or ROOT / "_build" / f"emulate-{args.emulate}").resolve()
        if args.out == (ROOT / "notebooks").resolve() or any(
                args.out == p.resolve().parent for p in args.notebooks):
            print(f"--emulate writes into a folder of its own, not {args.out}: its outputs are not the book's",
                  file=sys.stderr)
            return 2

    if args.wheels and not os.environ.get("_GPUBOOK_REEXEC"):
        added = install_missing(args.wheels, args.site)
        print(f"installed from {args.wheels}: {', '.join(added) or 'nothing (all present)'}", flush=True)
        env = dict(os.environ, _GPUBOOK_REEXEC="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), str(args.site), env.get("PYTHONPATH")]))
        return subprocess.call([sys.executable, *sys.argv], env=env)

    n_gpus, gpu = gpus()
    if args.emulate and gpu:
        import emulate_t4

        gpu = emulate_t4.emulated_name(gpu)
    if args.profile == "full" and not n_gpus:
        print("refusing to run the full profile without a CUDA GPU: its outputs are the book's GPU numbers. "
              "On a CPU, use --profile tiny (nothing is written over the committed notebooks unless you ask).",
              file=sys.stderr)
        return 2
    if args.notebooks:
        needs = {c["file"]: c["gpus"] for c in chapter_order()} if args.emulate else {}
        todo = [(path, needs.get(path.name, 1)) for path in args.notebooks]
    else:
        todo = [(ROOT / "notebooks" / c["file"], c["gpus"]) for c in chapter_order()]
    commit, dirty = provenance([path for path, _ in todo], args.commit, ROOT)
    if dirty and args.profile == "full" and not args.emulate:
        print("refusing to stamp outputs from sources that are not in git: commit (or stash) these first, so "
              "the stamp's commit holds what ran:\n  " + "\n  ".join(dirty[:20]), file=sys.stderr)
        return 2
    if dirty:
        commit += "+uncommitted"
        print(f"{args.profile} profile from an uncommitted tree: stamped {commit}", flush=True)
    if commit == "unknown":
        print("warning: no git here and no --commit SHA (or GPUBOOK_COMMIT): the stamps record commit 'unknown' "
              "(staleness is decided by their content hashes; the commit only tells readers where they came from)",
              file=sys.stderr, flush=True)
    os.environ["GPUBOOK_PROFILE"] = args.profile
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    drop_non_inline_backend()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    check_env = dict(os.environ)  # the hygiene check runs without the emulation
    if args.emulate:
        env = emulation_environ(args.emulate, dict(os.environ), Path(tempfile.mkdtemp(prefix="gpubook-emulate-")))
        os.environ.clear()
        os.environ.update(env)
        print(f"{args.emulate.upper()} mode: the kernels run with {EMULATE_VAR}={args.emulate} on GPU "
              f"{env['CUDA_VISIBLE_DEVICES']}, as {gpu or 'nothing (no GPU here: the emulation changes nothing)'}; "
              f"outputs -> {args.out}", flush=True)
    status = 0
    written = []
    for path, needs in todo:
        if args.emulate and needs > 1:
            print(f"{path.name}: SKIPPED: needs {needs} GPUs; a {args.emulate.upper()} reader has one", flush=True)
            continue
        if args.profile == "full" and needs > n_gpus:
            print(f"{path.name}: SKIPPED: needs {needs} GPUs, this machine has {n_gpus}", flush=True)
            continue
        out = (args.out / path.name) if args.out else path
        try:
            record = execute(path, out, args.timeout, gpu, args.profile, commit)
            if args.emulate and n_gpus and not emulation_visible(nbformat_read(out)):
                raise RuntimeError(f"the environment report of {out} names no emulated card: the kernel ran "
                                   f"without the {args.emulate.upper()} emulation (its outputs are the big GPU's)")
            record_time(out.parent / TIMES, path.stem, record)
            print(f"{path.name}: executed in {record['wall_s']:.0f} s -> {out}", flush=True)
            written.append(str(out))
        except Exception as err:  # report and go on with the next notebook
            print(f"{path.name}: FAILED: {type(err).__name__}: {str(err)[-2000:]}", flush=True)
            status = 1
    if not written:
        return status or 1
    check = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_notebooks.py"), *written], env=check_env)
    return status or check.returncode


if __name__ == "__main__":
    sys.exit(main())
