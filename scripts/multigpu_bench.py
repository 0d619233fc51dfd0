"""Chapter 7 on 1, 2 and 4 GPUs in one launch: collectives' bandwidth, each engine's throughput, memory and bytes.

Run it once on a machine with 4 GPUs (about 3 minutes on 4 H100s by its own estimate, which it prints per part
first; it stops the launch at ``--timeout-s``, 225 s by default on GPUs, and keeps what was written):

    python scripts/multigpu_bench.py --out OUT

It launches itself with ``torchrun`` on every GPU (``--ranks``, default: all of them), through
``helpers.launching`` (NVLink multicast off), and writes two files into ``OUT``:

- ``multigpu_bench.json``: the machine, the arguments, the estimated and actual time of each part, and one
  list of records per part (below), plus the derived tables (``summary``);
- ``multigpu_bench.log``: everything the driver printed and the launch's output.

The parts (``--parts``, all by default), every one on the same processes:

1. ``bandwidth``: all-reduce, reduce-scatter, all-gather and broadcast from ``--min-bytes`` (1 MiB) to
   ``--max-bytes`` (4 GiB) at world sizes 2 and 4 (the first 2 ranks form a subgroup), each size ``--repeat``
   times after ``--bw-warmup`` calls, timed as ``helpers.collectives`` does (nccl-tests' bus bandwidth,
   median, quartiles and fastest repeat).
2. ``training``: the 1.3B GPT-NeoX (bf16 autocast with fp32 weights for DDP, ZeRO-1, ZeRO-2 and ZeRO-3; FSDP2
   with its bf16 ``MixedPrecisionPolicy`` instead of autocast) at world sizes 1, 2 and 4, ``--warmup`` untimed
   and ``--steps`` timed steps each: per-step time (the slowest rank's), tokens/s per GPU, per-rank peak
   allocated memory and model-state bytes (against the ZeRO formula). With ``comm`` also chosen, one more
   step per engine at the world sizes ``--comm-world-sizes`` (default: the largest) runs under
   ``torch.profiler`` on rank 0: its NCCL kernels' bytes per
   collective against ``estimates.engine_transfers`` and their overlap with compute (the trace is deleted).
3. ``interleaved``: two engines (``--pair``, DDP and FSDP2) at the largest world size, both resident,
   stepped in alternating rounds (``timing.interleaved``, >= 10 rounds): their step-time ratio with its 95%
   interval.
4. ``big``: ``--big-model`` (Llama-2-7B's shape, from its config) under FSDP2 with the bf16 policy on every rank,
   built on the meta device, sharded, then materialised shard by shard (``to_empty``) and initialised: per-rank
   peak and model states against the ZeRO-3 formula, tokens/s per GPU. It comes last: if it runs out of memory
   or time, the parts before it are kept.

``--tiny``: the tiny GPT-NeoX twin and small sizes; with ``CUDA_VISIBLE_DEVICES=""`` it runs on CPU
processes with gloo (``tests/test_distributed_bench.py`` does so), which checks every code path but the
CUDA-only lines (peak memory, synchronisation, NCCL kernels in the trace).

If a rank runs out of memory, the launch ends (``distributed.exit_all_ranks_on_oom``); every record
finished before is kept (rank 0 appends them to ``OUT/parts/*.jsonl`` as they come) and the JSON says
where it stopped.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the workers run this file directly; helpers lives at the repository root
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from helpers import estimates, launching  # noqa: E402
from helpers.distributed import ENGINES  # noqa: E402  (the engines wrap_engine builds)

PARTS = ("bandwidth", "training", "comm", "interleaved", "big")
# For the time estimate only: what a 4x H100 (NVLink 4) machine roughly does.
ASSUMED_BUSBW_GB_S = {"cuda": 300.0, "cpu": 1.0}
ASSUMED_LATENCY_S = {"cuda": 1e-4, "cpu": 1e-3}
ASSUMED_TRAIN_FLOP_S = {"cuda": 300e12, "cpu": 2e10}  # bf16, achieved
STARTUP_S = {"cuda": 25.0, "cpu": 10.0}  # torch import, NCCL set-up
BUILD_S = {"cuda": 4.0, "cpu": 0.5}  # build a model on the device, wrap it, free it
TRACE_S = {"cuda": 6.0, "cpu": 1.0}  # one profiled step: export the trace, read it


# --- arguments ------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for multigpu_bench.json and multigpu_bench.log")
    p.add_argument("--tiny", action="store_true", help="tiny model and sizes (a CPU check of every code path)")
    p.add_argument("--ranks", type=int, default=0, help="processes (default: every GPU; 2 on a CPU)")
    p.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    p.add_argument("--pair", nargs=2, default=["ddp", "fsdp2"], choices=ENGINES, help="engines interleaved")
    p.add_argument("--model", default="polyglot-ko-1.3b")
    p.add_argument("--layers", type=int, default=0, help="transformer blocks (0: the model's own)")
    p.add_argument("--vocab", type=int, default=0, help="vocabulary size (0: the model's own; > 100)")
    p.add_argument("--batch", type=int, default=None, help="sequences per rank and step")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per engine")
    p.add_argument("--steps", type=int, default=None, help="timed steps per engine (>= 8 for an interval)")
    p.add_argument("--comm-world-sizes", nargs="+", type=int, default=None,
                   help="world sizes whose step is traced for the bytes per engine (default: the largest)")
    p.add_argument("--big-model", default="llama-2-7b", help="the model of part 'big' (FSDP2 on every rank)")
    p.add_argument("--big-batch", type=int, default=None)
    p.add_argument("--big-seq", type=int, default=None)
    p.add_argument("--big-warmup", type=int, default=None)
    p.add_argument("--big-steps", type=int, default=None)
    p.add_argument("--rounds", type=int, default=10, help="interleaved rounds (>= 10)")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--min-bytes", type=int, default=None)
    p.add_argument("--max-bytes", type=int, default=None)
    p.add_argument("--factor", type=int, default=4)
    p.add_argument("--bw-warmup", type=int, default=None)
    p.add_argument("--repeat", type=int, default=None)
    p.add_argument("--timeout-s", type=float, default=None,
                   help="the whole launch, then it is stopped and what it wrote is kept (default: 225 s on GPUs, "
                        "900 s on CPUs)")
    p.add_argument("--estimate-only", action="store_true", help="print the time estimate per part and stop")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    tiny = args.tiny
    defaults = dict(batch=2 if tiny else 4, seq=32 if tiny else 1024, warmup=1 if tiny else 3,
                    steps=8 if tiny else 10, min_bytes=2**12 if tiny else 2**20,
                    max_bytes=2**18 if tiny else 2**32, bw_warmup=1 if tiny else 5, repeat=10 if tiny else 20,
                    big_batch=1, big_seq=32 if tiny else 2048, big_warmup=1 if tiny else 2, big_steps=3 if tiny else 8)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if min(args.warmup, args.steps, args.big_warmup, args.big_steps) < 1:
        p.error("--warmup, --steps, --big-warmup and --big-steps must be >= 1 (the states are counted in the last "
                "warm-up step)")
    if args.vocab and args.vocab <= 100:
        p.error("--vocab must be > 100 (the random tokens start at 100)")
    if args.rounds < 10:
        p.error("--rounds must be >= 10 (timing.interleaved)")
    if args.repeat < 10:
        p.error("--repeat must be >= 10 (collectives.time_collective)")
    return args


def world_sizes(nproc: int, candidates: tuple[int, ...]) -> list[int]:
    """The world sizes of ``candidates`` that ``nproc`` processes can form (the first ``ws`` ranks)."""
    return [ws for ws in candidates if ws <= nproc]


# --- the time estimate ----------------------------------------------------------------------------------


def estimate_s(args: argparse.Namespace, nproc: int, kind: str, n_params: float) -> dict[str, float]:
    """Seconds per part, from assumed bandwidth, latency and throughput (``ASSUMED_*``): a plan, not a measurement."""
    from helpers import collectives

    sizes = collectives.sizes_between(args.min_bytes, args.max_bytes, args.factor)
    out = {"startup": STARTUP_S[kind]}
    if "bandwidth" in args.parts:
        calls = args.bw_warmup + args.repeat + 1
        bw = ASSUMED_BUSBW_GB_S[kind] * 1e9
        out["bandwidth"] = sum(calls * (ASSUMED_LATENCY_S[kind] + s * estimates.bus_factor(c, ws) / bw)
                               for ws in world_sizes(nproc, (2, 4)) for c in estimates.COLLECTIVES for s in sizes)
    step_s = 6 * n_params * args.batch * args.seq / ASSUMED_TRAIN_FLOP_S[kind] * 1.3  # + optimizer, communication
    if "training" in args.parts:
        traced = "comm" in args.parts
        per = {ws: BUILD_S[kind] + (args.warmup + args.steps) * step_s
               + (TRACE_S[kind] + step_s if traced and ws in args.comm_world_sizes else 0)
               for ws in world_sizes(nproc, (1, 2, 4))}
        out["training"] = len(args.engines) * sum(per.values())
    if "interleaved" in args.parts:
        out["interleaved"] = 2 * BUILD_S[kind] + 2 * (3 + args.rounds) * step_s
    if "big" in args.parts:
        from helpers import models

        big = models.n_params(models.build(args.big_model, profile="tiny" if args.tiny else "full", head="causal-lm",
                                           device="meta"))
        big_step_s = 6 * big * args.big_batch * args.big_seq / ASSUMED_TRAIN_FLOP_S[kind] * 1.5
        out["big"] = 3 * BUILD_S[kind] + (args.big_warmup + args.big_steps) * big_step_s
    out["total"] = sum(out.values())
    return out


# --- the driver -----------------------------------------------------------------------------------------


class Log:
    """Print and keep every line, for ``multigpu_bench.log``."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, text: str = "") -> None:
        print(text, flush=True)
        self.lines.append(text)


def read_parts(folder: Path) -> dict[str, list[dict]]:
    """The records rank 0 appended, by part (``parts/<part>.jsonl``)."""
    out = {}
    for f in sorted((folder / "parts").glob("*.jsonl")):
        out[f.stem] = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return out


def summarize(parts: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """Derived tables: bandwidth at the largest size, throughput and scaling efficiency, bytes per engine."""
    from helpers import timing

    summary: dict[str, list[dict]] = {}
    bw = parts.get("bandwidth", [])
    if bw:
        top = max(r["size_bytes"] for r in bw)
        summary["bandwidth_at_largest"] = [
            {k: r[k] for k in ("world_size", "collective", "size_bytes", "busbw_gb_s", "busbw_best_gb_s",
                               "time_q1_s", "time_median_s", "time_q3_s")}
            for r in bw if r["size_bytes"] == top]
    train = [r for r in parts.get("training", []) if r.get("rank") == 0]
    rows = []
    for r in train:
        one = next((o for o in train if o["engine"] == r["engine"] and o["world_size"] == 1), None)
        row = {k: r[k] for k in ("engine", "world_size", "tokens_per_s_per_gpu", "step_time_median_s",
                                 "step_time_q1_s", "step_time_q3_s", "peak_allocated_gib_max",
                                 "model_states_gib_max", "formula_states_gib")}
        if one is not None:
            row["scaling_efficiency"] = one["step_time_median_s"] / r["step_time_median_s"]
            if len(one["step_times_s"]) >= 8 and len(r["step_times_s"]) >= 8 and r["world_size"] > 1:
                u = timing.unpaired(one["step_times_s"], r["step_times_s"], names=("1 GPU", f"{r['world_size']} GPUs"))
                row |= {"efficiency_lo": u.lo, "efficiency_hi": u.hi, "verdict": u.verdict}
        rows.append(row)
    if rows:
        summary["scaling"] = rows
    comm = [{"engine": r["engine"], "world_size": r["world_size"], **c} for r in train for c in r.get("comm", [])]
    if comm:
        summary["bytes_per_step"] = comm
    return summary


def machine(device: torch.device) -> dict[str, object]:
    """Where the run happened (called by rank 0 of the launch, so the driver never touches a GPU)."""
    import torch.distributed as dist

    cuda = device.type == "cuda"
    nccl = torch.cuda.nccl.version() if cuda else None
    return {"host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "backend": dist.get_backend(), "world_size": dist.get_world_size(),
            "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
            "nccl": (".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)) if cuda else None,
            "launch_env": {k: os.environ.get(k) for k in launching.LAUNCH_ENV_FORCED}}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    from helpers import models

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in (out / "parts").glob("*"):
        stale.unlink()
    kind = "cuda" if torch.cuda.is_available() else "cpu"
    if args.timeout_s is None:
        args.timeout_s = 225.0 if kind == "cuda" else 900.0
    nproc = args.ranks or (torch.cuda.device_count() if kind == "cuda" else 2)
    profile = "tiny" if args.tiny else "full"
    n_params = models.n_params(models.build(args.model, profile=profile, head="causal-lm", device="meta",
                                            **_overrides(args)))
    log = Log()
    if args.comm_world_sizes is None:  # the largest world size only: a trace per engine costs seconds
        args.comm_world_sizes = [max(world_sizes(nproc, (2, 4)) or [2])]
    est = estimate_s(args, nproc, kind, n_params)
    log(f"multigpu_bench: {nproc} processes ({kind}), {args.model} {profile} ({n_params / 1e9:.2f}B parameters), "
        f"parts {', '.join(args.parts)}")
    log("estimated time per part (assumed bandwidth and throughput, not measured): "
        + ", ".join(f"{k} {v:.0f} s" for k, v in est.items()))
    if args.estimate_only:
        return 0
    argv_worker = [a for a in (sys.argv[1:] if argv is None else argv)] + ["--worker", "--ranks", str(nproc)]
    argv_worker += ["--comm-world-sizes", *map(str, args.comm_world_sizes)]
    launch = launching.torchrun(Path(__file__).resolve(), nproc, argv_worker)
    log(launch.text)
    env = launching.launch_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    start, status, output = time.perf_counter(), "ok", ""
    try:
        done = launching.run(launch, env=env, timeout_s=args.timeout_s)
        output = done.stdout
    except (RuntimeError, TimeoutError) as err:
        status, output = f"failed: {str(err).splitlines()[0]}", str(err)
    wall = time.perf_counter() - start
    log(output.rstrip())
    parts = read_parts(out)
    timings = next(iter(parts.get("timings", [])), {})
    result = {"status": status, "machine": next(iter(parts.get("machine", [])), {}), "args": vars(args), "nproc": nproc, "n_params": n_params,
              "estimated_s": est, "wall_s": wall, "part_s": timings, **{k: v for k, v in parts.items() if k not in ("timings", "machine")},
              "summary": summarize(parts)}
    (out / "multigpu_bench.json").write_text(json.dumps(result, indent=1, default=str))
    log(f"{status}: {wall:.0f} s in all (estimated {est['total']:.0f} s); per part: "
        + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()))
    for name, rows in result["summary"].items():
        log(f"\n{name}:")
        for row in rows:
            log("  " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    (out / "multigpu_bench.log").write_text("\n".join(log.lines) + "\n")
    if (out / "parts").exists():  # folded into the JSON (and a trace a stopped launch left behind)
        for f in (out / "parts").iterdir():
            f.unlink()
        (out / "parts").rmdir()
    return 0 if status == "ok" else 1


# --- the workers (under torchrun) ------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from helpers import distributed

    device = distributed.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    folder = Path(args.out) / "parts"
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)

    def write(part: str, records: list[dict]) -> None:
        if rank == 0:
            with open(folder / f"{part}.jsonl", "a") as f:
                for r in records:
                    f.write(json.dumps(r, default=str) + "\n")

    write("machine", [machine(device)] if rank == 0 else [])
    groups = {}
    for ws in sorted({1, 2, 4, world}):  # every rank creates every group, in the same order
        if ws <= world:
            groups[ws] = dist.group.WORLD if ws == world else dist.new_group(list(range(ws)))
    part_s = {}
    for part, fn in (("bandwidth", bandwidth_part), ("training", training_part), ("interleaved", interleaved_part),
                     ("big", big_part)):
        if part not in args.parts:
            continue
        start = time.perf_counter()
        fn(args, device, groups, write)
        dist.barrier()
        part_s[part] = time.perf_counter() - start
        if rank == 0:
            print(f"{part}: {part_s[part]:.1f} s", flush=True)
    write("timings", [part_s])
    dist.destroy_process_group()
    return 0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bandwidth_part(args, device, groups, write) -> None:
    import torch.distributed as dist

    from helpers import collectives

    sizes = collectives.sizes_between(args.min_bytes, args.max_bytes, args.factor)
    for ws in world_sizes(dist.get_world_size(), (2, 4)):
        if dist.get_rank() < ws:
            timings = collectives.sweep(sizes, device=device, warmup=args.bw_warmup, repeat=args.repeat,
                                        group=groups[ws])
            write("bandwidth", [t.record() | {"world_size": ws, "times_s": list(t.times_s)} for t in timings])
        dist.barrier()


def _overrides(args) -> dict[str, int]:
    """The model's configuration changes that ``--layers`` and ``--vocab`` ask for."""
    return ({"num_hidden_layers": args.layers} if args.layers else {}) | ({"vocab_size": args.vocab} if args.vocab else {})


def _build(args, device):
    from helpers import models

    overrides = _overrides(args)
    return models.build(args.model, profile="tiny" if args.tiny else "full", head="causal-lm", device=device,
                        seed=0, **overrides)


def _batches(args, n_steps: int, rank: int, device, *, batch: int | None = None, seq: int | None = None,
             vocab: int | None = None):
    from helpers import data

    batch, seq = batch or args.batch, seq or args.seq
    ds = data.dummy_dataset(batch * n_steps, seq, task="causal-lm", seed=1000 + rank,
                            high=min(30000, vocab or args.vocab or 30000))
    return [{k: v.to(device) for k, v in ds[i * batch:(i + 1) * batch].items()} for i in range(n_steps)]


def _step(model, optimizer, batch, device, autocast: bool, before_zero_grad=None):
    """One training step; ``before_zero_grad()`` runs after the optimizer step, while the gradients exist."""
    with torch.autocast(device.type, torch.bfloat16, enabled=autocast):
        loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    if before_zero_grad is not None:
        before_zero_grad()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def wire_bytes(engine: str) -> dict[str, int]:
    """Bytes per element on the wire: fp32 everywhere but FSDP2's bf16 policy, which gathers bf16 and reduces fp32."""
    return {"param_bytes": 2, "grad_bytes": 4} if engine == "fsdp2" else {"param_bytes": 4, "grad_bytes": 4}


def comm_records(trace: Path, engine: str, n_params: int, ws: int) -> list[dict]:
    """Per collective of one traced step: ``S`` from the NCCL kernels and from the formula, calls, kernel time;
    plus one row ``collective='(overlap)'`` with the exposed and hidden communication time."""
    from helpers import profiler

    measured = profiler.communication_from_trace(trace)
    formula = estimates.communication_table(n_params, ws, engines=["zero3" if engine == "fsdp2" else engine],
                                            **wire_bytes(engine))
    by_kind = formula.groupby("collective")["S (bytes)"].sum() / 2**20
    rows = []
    for kind in sorted(set(measured.index) | set(by_kind.index)):
        got = measured.loc[kind] if kind in measured.index else None
        rows.append({"collective": kind, "formula_S_mib": float(by_kind.get(kind, 0.0)),
                     "profiler_S_mib": float(got["S (MiB)"]) if got is not None else 0.0,
                     "calls": int(got["calls"]) if got is not None else 0,
                     "kernel_time_ms": float(got["kernel time (ms)"]) if got is not None else 0.0})
    overlap = profiler.communication_overlap(trace)
    rows.append({"collective": "(overlap)", **{k: float(v) for k, v in overlap.items()}})
    return rows


def measure_engine(args, engine: str, ws: int, group, device, batches) -> dict:
    """Train ``engine`` on the first ``ws`` ranks (``group``): time its steps, count its memory, trace one step.

    Every rank of ``group`` calls it; it returns this rank's record (step times are the slowest rank's).
    """
    import torch.distributed as dist

    from helpers import accounting, distributed, models, timing

    rank, cuda = dist.get_rank(), device.type == "cuda"
    before = torch.cuda.memory_allocated(device) / 2**30 if cuda else float("nan")  # left by the previous engine
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    model = _build(args, device)
    n_params = models.n_params(model)
    model, optimizer = distributed.wrap_engine(engine, model, device, lr=args.lr, group=group)
    model.train()
    autocast = engine != "fsdp2"  # FSDP2's policy casts to bf16 itself
    times, losses, held = [], [], {}

    def count_states() -> None:  # parameters, gradients and optimizer states this rank holds
        held.update(accounting.model_state_bytes(model, optimizer))

    for i in range(args.warmup + args.steps):
        _sync(device)
        t0 = time.perf_counter()
        last_warmup = i == args.warmup - 1  # the states are counted there, in an untimed step
        losses.append(_step(model, optimizer, batches[i], device, autocast, count_states if last_warmup else None))
        _sync(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else float("nan")
    comm = []
    if "comm" in args.parts and ws in args.comm_world_sizes:
        if rank == 0:
            trace = Path(args.out) / "parts" / f"trace_{engine}_ws{ws}.json.gz"
            activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
            with torch.profiler.profile(activities=activities) as prof:
                _step(model, optimizer, batches[-1], device, autocast)
                _sync(device)
            prof.export_chrome_trace(str(trace))
            comm = comm_records(trace, engine, n_params, ws)
            trace.unlink()
        else:
            _step(model, optimizer, batches[-1], device, autocast)
            _sync(device)
    slowest = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    mine = torch.tensor([peak, sum(held.values()) / 2**30], dtype=torch.float64, device=device)
    every = [torch.zeros_like(mine) for _ in range(ws)]
    dist.all_gather(every, mine, group=group)
    step_times = slowest.cpu().tolist()
    spread = timing.Spread.of(tuple(step_times))
    stage = "zero3" if engine == "fsdp2" else engine
    formula = estimates.zero_model_state_bytes(n_params, ws, stage, param_bytes=4, grad_bytes=4, optimizer_bytes=8)
    tokens = args.batch * args.seq
    return {
        "engine": engine, "label": distributed.ENGINE_LABELS[engine], "world_size": ws, "rank": rank,
        "n_params": n_params, "batch_per_rank": args.batch, "seq_len": args.seq, "tokens_per_step_per_rank": tokens,
        "autocast_bf16": autocast,
        "mixed_precision_policy": "bf16 parameters, fp32 reduction" if engine == "fsdp2" else None,
        "step_times_s": step_times, "step_time_median_s": spread.median, "step_time_q1_s": spread.q1,
        "step_time_q3_s": spread.q3, "tokens_per_s_per_gpu": tokens / spread.median,
        "allocated_before_gib": before,
        "peak_allocated_gib": [float(t[0]) for t in every],
        "peak_allocated_gib_max": max(float(t[0]) for t in every),
        "model_states_gib": [float(t[1]) for t in every],
        "model_states_gib_max": max(float(t[1]) for t in every),
        "formula_states_gib": formula["total"] / 2**30,
        "losses": [float(v) for v in torch.stack(losses).cpu()],
        "comm": comm,
    }


def training_part(args, device, groups, write) -> None:
    import torch.distributed as dist

    from helpers import distributed

    rank, world = dist.get_rank(), dist.get_world_size()
    batches = _batches(args, args.warmup + args.steps + 1, rank, device)
    for ws in world_sizes(world, (1, 2, 4)):
        for engine in args.engines:
            if rank < ws:
                with distributed.exit_all_ranks_on_oom(f"{engine} on {ws} GPUs"):
                    record = measure_engine(args, engine, ws, groups[ws], device, batches)
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                write("training", [record])
                if rank == 0:
                    print(f"  {engine} on {ws}: {record['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, peak "
                          f"{record['peak_allocated_gib_max']:.2f} GiB per rank", flush=True)
            dist.barrier()


def interleaved_part(args, device, groups, write) -> None:
    import torch.distributed as dist

    from helpers import distributed, timing

    rank, world = dist.get_rank(), dist.get_world_size()
    ws = max(world_sizes(world, (1, 2, 4)))
    a_name, b_name = args.pair
    with distributed.exit_all_ranks_on_oom(f"interleaved {a_name} vs {b_name} on {ws} GPUs"):
        if rank < ws:
            batches = _batches(args, 4, rank, device)
            sides = {}
            for name in (a_name, b_name):
                model, optimizer = distributed.wrap_engine(name, _build(args, device), device, lr=args.lr,
                                                           group=groups[ws])
                sides[name] = (model, optimizer, name != "fsdp2")
            counter = {a_name: 0, b_name: 0}

            def stepper(name):
                def step():
                    model, optimizer, autocast = sides[name]
                    _step(model, optimizer, batches[counter[name] % len(batches)], device, autocast)
                    counter[name] += 1
                return step

            cmp = timing.interleaved(stepper(a_name), stepper(b_name), device=device, names=(a_name, b_name),
                                     rounds=args.rounds, warmup=3, busy=False)
            record = {"world_size": ws, "a": a_name, "b": b_name, "ratio_a_over_b": cmp.speedup, "lo": cmp.lo,
                      "hi": cmp.hi, "verdict": cmp.verdict, "gpu_ratio_a_over_b": cmp.gpu_ratio,
                      "gpu_verdict": cmp.gpu_verdict, "a_times_s": list(cmp.a.wall_s),
                      "b_times_s": list(cmp.b.wall_s), "rank": rank}
            if rank == 0:
                write("interleaved", [record])
                print(f"  interleaved {a_name} / {b_name} on {ws}: {cmp.speedup:.3f} ({cmp.lo:.3f} to {cmp.hi:.3f}), "
                      f"{cmp.verdict}", flush=True)
            del sides
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    dist.barrier()


def big_part(args, device, groups, write) -> None:
    """``--big-model`` (Llama-2-7B's shape) under FSDP2 with the bf16 policy on every rank: built on the meta
    device, sharded, then each rank materialises and initialises only its shards (a 7B model's fp32 states,
    108 GB, fit no single GPU)."""
    import torch.distributed as dist

    from helpers import accounting, distributed, models, timing

    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = device.type == "cuda"
    profile = "tiny" if args.tiny else "full"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    with distributed.exit_all_ranks_on_oom(f"{args.big_model} under FSDP2 on {world} ranks"):
        model = models.build(args.big_model, profile=profile, head="causal-lm", device="meta")
        n_params = models.n_params(model)
        distributed.shard_fsdp2(model, device, mp_policy=distributed.bf16_policy(), group=groups[world])
        model.to_empty(device=device)
        torch.manual_seed(0)  # every rank the same seed: DTensor's random ops then draw each shard once
        std = getattr(model.config, "initializer_range", 0.02)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    torch.nn.init.normal_(p, 0.0, std)
                else:  # the RMSNorm weights (Llama has no biases)
                    torch.nn.init.ones_(p)
            # non-persistent buffers (the rotary frequencies) depend on the width, not the depth: take them from
            # a one-block, small-vocabulary copy built normally
            small = models.build(args.big_model, profile=profile, head="causal-lm", device=device,
                                 num_hidden_layers=1, vocab_size=128)
            small_buffers = dict(small.named_buffers())
            for name, buf in model.named_buffers():
                buf.copy_(small_buffers[name])
            del small, small_buffers
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        init_s = time.perf_counter() - start
        batches = _batches(args, args.big_warmup + args.big_steps, rank, device, batch=args.big_batch, seq=args.big_seq,
                           vocab=model.config.vocab_size)
        times, held = [], {}

        def count_states() -> None:
            held.update(accounting.model_state_bytes(model, optimizer))

        losses = []
        for i in range(args.big_warmup + args.big_steps):
            _sync(device)
            t0 = time.perf_counter()
            losses.append(_step(model, optimizer, batches[i], device, False,
                                count_states if i == args.big_warmup - 1 else None))
            _sync(device)
            if i >= args.big_warmup:
                times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else float("nan")
    slowest = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    mine = torch.tensor([peak, sum(held.values()) / 2**30], dtype=torch.float64, device=device)
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    spread = timing.Spread.of(tuple(slowest.cpu().tolist()))
    tokens = args.big_batch * args.big_seq
    formula = estimates.zero_model_state_bytes(n_params, world, "zero3", param_bytes=4, grad_bytes=4, optimizer_bytes=8)
    record = {
        "model": args.big_model, "profile": profile, "n_params": n_params, "world_size": world, "engine": "fsdp2",
        "batch_per_rank": args.big_batch, "seq_len": args.big_seq, "init_s": init_s,
        "step_times_s": slowest.cpu().tolist(), "step_time_median_s": spread.median, "step_time_q1_s": spread.q1,
        "step_time_q3_s": spread.q3, "tokens_per_s_per_gpu": tokens / spread.median,
        "peak_allocated_gib": [float(t[0]) for t in every], "model_states_gib": [float(t[1]) for t in every],
        "formula_states_gib": formula["total"] / 2**30, "losses": [float(v) for v in torch.stack(losses).cpu()],
    }
    write("big", [record])
    if rank == 0:
        print(f"  {args.big_model} on {world}: {record['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, peak "
              f"{max(record['peak_allocated_gib']):.1f} GiB per rank, states {max(record['model_states_gib']):.1f} GiB "
              f"(formula {record['formula_states_gib']:.1f})", flush=True)


if __name__ == "__main__":
    sys.exit(main())
