#!/usr/bin/env python3
"""Run chapters in parallel lanes on one multi-GPU machine: each lane its GPUs and its own CPU cores.

    python scripts/gpu_lanes.py check PLAN                # parse and validate a plan, print the lanes
    python scripts/gpu_lanes.py start PLAN [--res DIR]    # start the lanes in the background; returns at once
    python scripts/gpu_lanes.py wait SECONDS [--res DIR]  # wait until every lane is done (or SECONDS pass)
    python scripts/gpu_lanes.py collect OUT [--res DIR]   # tar the results and logs into OUT/results.tgz

A PLAN is lanes separated by ``;``, each a list of items separated by ``,`` that run one after the other:

- ``G:NN`` executes chapter NN (``notebooks/NN_*.ipynb``, full profile) on GPU(s) G into ``DIR/out_NN``
  (``scripts/execute_notebooks.py``): ``0:09``, or ``2-3:07`` for chapter 7 on GPUs 2 and 3;
- ``G:NN@chk`` does the same into ``DIR/chk_NN``: a *check copy*, a second execution of the same code whose
  verdicts and memory numbers ``scripts/gpu_check.py --executed DIR/chk_NN`` compares offline with the committed
  notebook (the way issue 24's re-runs were made);
- a lane written ``wNN-ITEMS`` starts only when chapter NN's ``out`` execution has finished (``wNN@chk-`` for its
  check copy), so it can reuse that chapter's GPUs.

Each item runs under ``taskset`` on the 16 cores that belong to its first GPU (``--cores-per-gpu``), times the number of
its GPUs, so that lanes share neither GPUs nor cores: timings of one lane are not disturbed by another's host work.

``check`` refuses a plan in which two lanes could use one GPU at the same time: two lanes that start together
must use disjoint GPUs, and a waiting lane may use only GPUs that the chapter it waits for used (or that no other
lane uses). On 2026-11-27 a plan "2-3:07,2:08;3:03" ran chapter 3 on GPU 3 while chapter 7 used GPUs 2 and 3, and
both outputs had to be thrown away; "2-3:07,2:08;w07-3:03" is what was meant.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_RES = Path("/tmp/gpu_lanes")


@dataclass(frozen=True)
class Item:
    gpus: tuple[int, ...]
    chapter: str  # two digits
    tag: str  # "out" or "chk"

    @property
    def key(self) -> str:
        return f"{self.tag}_{self.chapter}"


@dataclass(frozen=True)
class Lane:
    items: tuple[Item, ...]
    waits_for: str | None  # an Item.key, or None

    @property
    def gpus(self) -> set[int]:
        return {g for it in self.items for g in it.gpus}


def _gpus(text: str) -> tuple[int, ...]:
    if "-" in text:
        lo, hi = (int(x) for x in text.split("-"))
        if hi < lo:
            raise ValueError(f"GPU range {text!r} runs backwards")
        return tuple(range(lo, hi + 1))
    return (int(text),)


def parse_plan(plan: str) -> list[Lane]:
    """The lanes of ``plan`` (see the module docstring); ``ValueError`` with the offending part when malformed."""
    lanes = []
    for spec in (s.strip() for s in plan.split(";")):
        if not spec:
            raise ValueError(f"empty lane in plan {plan!r}")
        waits_for = None
        if spec.startswith("w"):
            head, _, spec = spec.partition("-")
            if not spec:
                raise ValueError(f"lane {head!r} waits but runs nothing")
            chapter, _, tag = head[1:].partition("@")
            waits_for = f"{tag or 'out'}_{chapter}"
        items = []
        for item in spec.split(","):
            try:
                devs, chapter = item.split(":")
                chapter, _, tag = chapter.partition("@")
                if tag not in ("", "chk") or len(chapter) != 2 or not chapter.isdigit():
                    raise ValueError
                items.append(Item(_gpus(devs), chapter, tag or "out"))
            except ValueError:
                raise ValueError(f"item {item!r}: expected G:NN, G-H:NN or G:NN@chk") from None
        lanes.append(Lane(tuple(items), waits_for))
    return lanes


def validate(lanes: list[Lane]) -> list[str]:
    """Why two lanes could use one GPU at the same time, or an item would never start (empty: the plan is safe)."""
    problems = []
    keys = {it.key: (i, it) for i, lane in enumerate(lanes) for it in lane.items}
    if len(keys) != sum(len(lane.items) for lane in lanes):
        problems.append("the same chapter and tag appear twice: the second run would overwrite the first's output")
    for i, lane in enumerate(lanes):
        if lane.waits_for is not None and lane.waits_for not in keys:
            problems.append(f"lane {i + 1} waits for {lane.waits_for}, which no lane runs")
        if lane.waits_for is not None and keys.get(lane.waits_for, (None,))[0] == i:
            problems.append(f"lane {i + 1} waits for its own item {lane.waits_for}")
    for i, a in enumerate(lanes):
        for j, b in enumerate(lanes):
            if j <= i or not (a.gpus & b.gpus):
                continue
            if not (_after(a, b, lanes, keys) or _after(b, a, lanes, keys)):
                problems.append(f"lanes {i + 1} and {j + 1} can use GPU(s) {sorted(a.gpus & b.gpus)} at the same time: "
                                f"give one of them other GPUs, or make it wait (wNN-) for the item that frees them")
    return problems


def _after(owner: Lane, waiter: Lane, lanes: list[Lane], keys: dict) -> bool:
    """True when ``waiter`` starts only after ``owner`` has finished every item that uses a GPU ``waiter`` uses:
    it waits for an item of ``owner``, and no later item of ``owner`` uses one of ``waiter``'s GPUs."""
    if waiter.waits_for is None or waiter.waits_for not in keys:
        return False
    lane_index, awaited = keys[waiter.waits_for]
    if lanes[lane_index] is not owner:
        return False
    later = owner.items[owner.items.index(awaited) + 1:]
    return not ({g for it in later for g in it.gpus} & waiter.gpus)


def cores(item: Item, per_gpu: int) -> str:
    first = item.gpus[0]
    return f"{first * per_gpu}-{first * per_gpu + per_gpu * len(item.gpus) - 1}"


def notebook(chapter: str) -> str:
    found = sorted(glob.glob(str(ROOT / "notebooks" / f"{chapter}_*.ipynb")))
    if not found:
        raise SystemExit(f"no notebook notebooks/{chapter}_*.ipynb")
    return found[0]


def private_copy(path: str, tree: Path) -> str:
    """A copy of the chapter's folder (``notebooks/``: the notebook and its launched scripts) under ``tree``.

    A kernel runs in its notebook's folder, and chapters write files there by relative path (chapter 8's
    ``traces/*.json.gz``). A check copy executed beside the same chapter's ``out`` run would write the same
    files at the same time: on 2026-11-28 chapter 8's check copy read a trace the other run was rewriting and
    stopped with ``BadGzipFile``. So a check copy runs from its own copy of the folder; helpers still come from
    the repository (``PYTHONPATH``), and the stamp hashes the copy's cells and scripts, which are the same.
    """
    src = Path(path).parent
    dst = tree / src.name
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("traces", "__pycache__", ".ipynb_checkpoints"))
    return str(dst / Path(path).name)


def run_lane(lane: Lane, index: int, res: Path, per_gpu: int) -> None:
    log = open(res / f"lane{index}.log", "a", buffering=1)
    if lane.waits_for:
        while not (res / f"done_{lane.waits_for}").exists():
            time.sleep(2)
    for item in lane.items:
        out = res / item.key
        out.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(map(str, item.gpus)), PYTHONUNBUFFERED="1")
        cmd = ["taskset", "-c", cores(item, per_gpu), sys.executable, "scripts/execute_notebooks.py", "--out", str(out),
               private_copy(notebook(item.chapter), res / f"tree_{item.key}") if item.tag == "chk"
               else notebook(item.chapter)]
        t0 = time.time()
        log.write(f"== {item.key} on GPU(s) {item.gpus}, cores {cores(item, per_gpu)}\n")
        with open(res / f"log_{item.key}.txt", "w") as f:
            rc = subprocess.call(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
        log.write(f"== {item.key} rc={rc} in {time.time() - t0:.0f} s\n")
        (res / f"done_{item.key}").write_text(str(rc))
    (res / f"lane{index}.done").write_text("ok")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("command", choices=["check", "start", "wait", "collect", "lane"])
    ap.add_argument("arg", help="PLAN (check, start), SECONDS (wait), OUT folder (collect)")
    ap.add_argument("--res", type=Path, default=DEFAULT_RES, help=f"results folder (default {DEFAULT_RES})")
    ap.add_argument("--cores-per-gpu", type=int, default=16)
    ap.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.command in ("check", "start", "lane"):
        lanes = parse_plan(args.arg)
        problems = validate(lanes)
        if problems:
            print("plan refused:\n- " + "\n- ".join(problems), file=sys.stderr)
            return 2
        if args.command == "check":
            for i, lane in enumerate(lanes, 1):
                wait = f" (after {lane.waits_for})" if lane.waits_for else ""
                print(f"lane {i}{wait}: " + ", then ".join(f"{it.key} on GPU(s) {list(it.gpus)}, cores "
                                                          f"{cores(it, args.cores_per_gpu)}" for it in lane.items))
            return 0
        if args.command == "lane":
            run_lane(lanes[args.index], args.index, args.res, args.cores_per_gpu)
            return 0
        args.res.mkdir(parents=True, exist_ok=True)
        (args.res / "nlanes").write_text(str(len(lanes)))
        (args.res / "t0").write_text(str(time.time()))
        for i in range(len(lanes)):
            subprocess.Popen([sys.executable, __file__, "lane", args.arg, "--index", str(i), "--res", str(args.res),
                              "--cores-per-gpu", str(args.cores_per_gpu)], cwd=ROOT, start_new_session=True,
                             stdout=open(args.res / f"lane{i}.out", "w"), stderr=subprocess.STDOUT)
        print(f"started {len(lanes)} lanes")
        return 0
    if args.command == "wait":
        limit, t = float(args.arg), time.time()
        n = int((args.res / "nlanes").read_text())
        while time.time() - t < limit and len(list(args.res.glob("lane*.done"))) < n:
            time.sleep(5)
        t0 = float((args.res / "t0").read_text())
        print(f"elapsed {time.time() - t0:.0f} s; lanes done {len(list(args.res.glob('lane*.done')))}/{n}")
        for f in sorted(args.res.glob("lane*.log")):
            print(f.read_text())
        return 0
    out = Path(args.arg)
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out / "results.tgz", "w:gz") as tar:
        for p in args.res.iterdir():
            if not p.name.startswith("tree_"):  # the check copies' private folders: sources, not results
                tar.add(p, arcname=p.name)
    print("collected", (out / "results.tgz").stat().st_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
