"""Collectives timed: bus bandwidth against message size, inside launched processes, and from a trace.

- **Bandwidth definitions** of NVIDIA's ``nccl-tests`` (doc/PERFORMANCE.md). For a collective on
  ``S`` bytes that took ``t`` seconds on ``n`` ranks, the *algorithm bandwidth* is ``S / t`` and the
  *bus bandwidth* is ``algbw x factor``, with the factor ``2(n-1)/n`` for all-reduce, ``(n-1)/n`` for
  reduce-scatter and all-gather, ``1`` for broadcast (``estimates.bus_factor``). The bus bandwidth
  is the number to hold against a link's nominal bandwidth, whatever ``n`` is. ``S`` is the whole
  buffer: for all-gather the gathered output, for reduce-scatter the input (``n`` x each share).
- **Timing** a collective inside a launched process (``time_collective``, ``sweep``): a barrier and a
  device synchronisation before every repeat, warm-up calls first, at least 10 timed repeats; a
  repeat's time is the slowest rank's (a collective is done when the last rank is), and the
  result keeps every repeat for the median and the spread. Run it under ``torchrun`` with gloo on
  CPUs or NCCL on GPUs (chapter 7's ``scripts/collectives_bench.py``).
- **A profiler trace's** communication kernels per collective (``communication_from_trace``), to hold
  against the bytes per step that ``estimates.communication_table`` predicts for each engine.

Introduced in chapter 7, section 7.7 (Communication, measured).

>>> t = time_collective("all_reduce", 2**26, device="cuda")   # on every rank of a process group
>>> t.record()["busbw_gb_s"]
"""

from __future__ import annotations

import gzip
import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import pandas as pd
import torch

from helpers.estimates import COLLECTIVES, bus_factor
from helpers.profiler import kernel_category
from helpers.timing import Spread

GB = 1e9  # bandwidth in GB/s (decimal), as nccl-tests and link specifications print it


def algorithm_bandwidth(size_bytes: float, time_s: float) -> float:
    """``S / t`` in bytes per second.

    Introduced in chapter 7, section 7.7 (through ``scripts/collectives_bench.py``).
    """
    if time_s <= 0 or size_bytes < 0:
        raise ValueError(f"need size_bytes >= 0 and time_s > 0, got {size_bytes} and {time_s}")
    return size_bytes / time_s


def bus_bandwidth(collective: str, size_bytes: float, time_s: float, n_ranks: int) -> float:
    """Algorithm bandwidth times ``bus_factor``, in bytes per second.

    Introduced in chapter 7, section 7.7 (through ``scripts/collectives_bench.py``).
    """
    return algorithm_bandwidth(size_bytes, time_s) * bus_factor(collective, n_ranks)


# --- timing, inside a launched process --------------------------------------------------------------


@dataclass(frozen=True)
class CollectiveTiming:
    """One collective at one size: every timed repeat (the slowest rank's time, seconds) and the bandwidths.

    ``size_bytes`` is ``S`` in the nccl-tests sense (see the module docstring).

    Introduced in chapter 7, section 7.7 (through ``scripts/collectives_bench.py``).
    """

    collective: str
    size_bytes: int
    n_ranks: int
    backend: str
    device: str
    times_s: tuple[float, ...]

    @property
    def spread(self) -> Spread:
        return Spread.of(self.times_s)

    def record(self) -> dict[str, float | int | str]:
        """A flat dict: sizes, median / quartile / extreme times and bandwidths in GB/s (medians)."""
        s = self.spread
        return {
            "collective": self.collective, "size_bytes": self.size_bytes, "n_ranks": self.n_ranks,
            "backend": self.backend, "device": self.device, "repeats": len(self.times_s),
            "time_median_s": s.median, "time_q1_s": s.q1, "time_q3_s": s.q3, "time_min_s": s.min,
            "time_max_s": s.max,
            "algbw_gb_s": algorithm_bandwidth(self.size_bytes, s.median) / GB,
            "busbw_gb_s": bus_bandwidth(self.collective, self.size_bytes, s.median, self.n_ranks) / GB,
            "busbw_best_gb_s": bus_bandwidth(self.collective, self.size_bytes, s.min, self.n_ranks) / GB,
        }


def _buffers(collective: str, size_bytes: int, n: int, rank: int, device: torch.device, dtype: torch.dtype):
    """Input and output tensors for one collective on ``S`` bytes (``S`` rounded down to n elements)."""
    elem = torch.tensor([], dtype=dtype).element_size()
    numel = max(n, (size_bytes // elem) // n * n)  # whole buffer, divisible into n shares
    share = numel // n
    if collective == "all_reduce" or collective == "broadcast":
        return torch.full((numel,), float(rank + 1), dtype=dtype, device=device), None, numel * elem
    if collective == "reduce_scatter":
        return (torch.full((numel,), float(rank + 1), dtype=dtype, device=device),
                torch.empty(share, dtype=dtype, device=device), numel * elem)
    return (torch.full((share,), float(rank + 1), dtype=dtype, device=device),
            torch.empty(numel, dtype=dtype, device=device), numel * elem)


def _run(collective: str, inp: torch.Tensor, out: torch.Tensor | None, group) -> None:
    import torch.distributed as dist

    if collective == "all_reduce":
        dist.all_reduce(inp, group=group)
    elif collective == "broadcast":
        dist.broadcast(inp, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    elif collective == "reduce_scatter":  # the single-tensor forms (renamed in torch 2.13)
        (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, inp, group=group)
    else:
        (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, inp, group=group)


def _expected(collective: str, n: int, rank: int) -> float:
    """Every element's value after one call, when rank r's buffers start filled with r + 1."""
    return {"all_reduce": n * (n + 1) / 2, "reduce_scatter": n * (n + 1) / 2, "broadcast": 1.0}.get(collective, 0.0)


def time_collective(
    collective: str,
    size_bytes: int,
    *,
    device: str | torch.device,
    dtype: torch.dtype = torch.float32,
    warmup: int = 5,
    repeat: int = 20,
    group=None,
) -> CollectiveTiming:
    """Time one collective on ``S = size_bytes`` bytes; call it on every rank of an initialised process group.

    Before the timed calls, one call's result is checked (every rank's buffer is filled with
    ``rank + 1``), so a wrong collective fails here instead of producing a bandwidth. Each of the
    ``warmup`` + ``repeat`` calls starts after a barrier and a device synchronisation and ends with a
    synchronisation; the host clock measures it. The per-rank times are all-reduced with MAX, so
    each repeat is the slowest rank's. Small messages measure latency (launch, barrier release)
    rather than bandwidth; nccl-tests times many back-to-back calls instead, which gives smaller
    times there and the same large-message bandwidth.

    Introduced in chapter 7, section 7.7 (through ``scripts/collectives_bench.py``).
    """
    import torch.distributed as dist

    n, rank = dist.get_world_size(group), dist.get_rank(group)
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; choose one of {', '.join(COLLECTIVES)}")
    if repeat < 10:
        raise ValueError(f"repeat must be >= 10 (a spread needs samples), got {repeat}")
    device = torch.device(device)
    inp, out, size = _buffers(collective, int(size_bytes), n, rank, device, dtype)
    _run(collective, inp, out, group)
    got = out if collective in ("reduce_scatter", "all_gather") else inp
    if collective == "all_gather":
        want = torch.arange(1, n + 1, dtype=dtype, device=device).repeat_interleave(got.numel() // n)
    else:
        want = torch.full_like(got, _expected(collective, n, rank))
    if not torch.equal(got, want):
        raise RuntimeError(f"{collective} on rank {rank} returned wrong values: the collective is broken")
    times = []
    for i in range(warmup + repeat):
        inp.fill_(rank + 1)  # the same work every call (all-reduce would otherwise grow its input)
        dist.barrier(group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        _run(collective, inp, out, group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    slowest = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return CollectiveTiming(collective, size, n, dist.get_backend(group), str(device.type),
                            tuple(slowest.cpu().tolist()))


def sizes_between(min_bytes: int, max_bytes: int, factor: int = 4) -> list[int]:
    """``min_bytes``, ``min_bytes x factor``, ... up to ``max_bytes`` (nccl-tests' ``-b``, ``-e``, ``-f``).

    Introduced in chapter 7, section 7.7 (through ``scripts/collectives_bench.py``).
    """
    if min_bytes < 1 or max_bytes < min_bytes or factor < 2:
        raise ValueError(f"need 1 <= min_bytes <= max_bytes and factor >= 2, got {min_bytes}, {max_bytes}, {factor}")
    sizes, s = [], int(min_bytes)
    while s <= max_bytes:
        sizes.append(s)
        s *= factor
    return sizes


def sweep(
    sizes_bytes: Iterable[int], collectives: Sequence[str] = COLLECTIVES, **kwargs
) -> list[CollectiveTiming]:
    """``time_collective`` for every collective and size (every rank must call it with the same arguments).

    Introduced in chapter 7, section 7.7 (through ``scripts/collectives_bench.py``).
    """
    return [time_collective(c, s, **kwargs) for c in collectives for s in sizes_bytes]


def bandwidth_table(records: pd.DataFrame | Sequence[dict]) -> pd.DataFrame:
    """The records of ``CollectiveTiming.record`` as a table: one row per collective and size (MiB).

    Introduced in chapter 7, section 7.7 (through ``scripts/collectives_bench.py``).
    """
    df = pd.DataFrame(list(records) if not isinstance(records, pd.DataFrame) else records)
    table = pd.DataFrame({
        "collective": df["collective"],
        "size (MiB)": df["size_bytes"] / 2**20,
        "time median (ms)": df["time_median_s"] * 1e3,
        "time IQR (ms)": (df["time_q3_s"] - df["time_q1_s"]) * 1e3,
        "algbw (GB/s)": df["algbw_gb_s"],
        "busbw (GB/s)": df["busbw_gb_s"],
        "busbw, fastest repeat (GB/s)": df["busbw_best_gb_s"],
    })
    return table.set_index(["collective", "size (MiB)"]).sort_index()


# --- communication kernels of a profiler trace --------------------------------------------------------

# Element sizes of the dtype names PyTorch writes into NCCL kernels' trace arguments.
_DTYPE_BYTES = {"float": 4, "float32": 4, "double": 8, "float64": 8, "half": 2, "float16": 2, "bfloat16": 2,
                "long": 8, "int64": 8, "int": 4, "int32": 4, "short": 2, "char": 1, "byte": 1, "bool": 1,
                "float8_e4m3fn": 1, "float8_e5m2": 1}



def _trace_events(path: str | Path) -> list[dict]:
    """The ``traceEvents`` of a Chrome trace file, gzipped (``.gz``) or not."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return json.load(f)["traceEvents"]

def collective_kind(name: str) -> str:
    """``all_reduce``, ``reduce_scatter``, ``all_gather``, ``broadcast`` or ``other`` for a collective's name
    (``allreduce``, ``_reduce_scatter_base``, ``ncclDevKernel_AllGather_RING_LL``, ...).

    Introduced in chapter 7, section 7.7 (collective_kind names the collectives of a trace).
    """
    key = re.sub(r"[^a-z]", "", name.lower())
    for kind, word in (("reduce_scatter", "reducescatter"), ("all_reduce", "allreduce"),
                       ("all_gather", "allgather"), ("broadcast", "broadcast")):
        if word in key:
            return kind
    return "other"


def communication_from_trace(path: str | Path) -> pd.DataFrame:
    """Per collective, the communication kernels of a ``torch.profiler`` Chrome trace of one rank on GPUs.

    Kernels are those ``profiler.kernel_category`` calls ``communication`` (NCCL's). Their trace
    arguments (``Collective name``, ``In msg nelems``, ``Out msg nelems``, ``dtype``, ``Group size``)
    give ``S`` = the larger of input and output, as in nccl-tests. Returns calls, ``S`` summed (MiB),
    kernel time (ms) and the bandwidths that implies. A kernel's time includes waiting for the other
    ranks to arrive, so the bandwidths are lower bounds of what the link did; the time is what the
    step spent in communication kernels (hidden behind compute or not: ``communication_overlap``).
    Where the kernels carry no sizes, the sizes come from the CPU-side records of the same
    collectives (``record_param_comms`` events, which carry the same arguments), per collective kind;
    ``S`` is NaN where neither has them.

    Introduced in chapter 7, section 7.7.
    """
    events = _trace_events(path)
    rows, cpu_rows = [], []
    for e in events:
        if e.get("ph") != "X":
            continue
        args = e.get("args", {})
        if e.get("cat") == "cpu_op" and "Collective name" in args:  # PyTorch's record_param_comms
            kind, size, n = _comm_args(args, "")
            cpu_rows.append({"collective": kind, "size_bytes": size, "n_ranks": n})
            continue
        if e.get("cat") != "kernel" or kernel_category(e.get("name", ""), cat="kernel") != "communication":
            continue
        kind, size, n = _comm_args(args, e["name"])
        rows.append({"collective": kind, "size_bytes": size, "time_s": float(e.get("dur", 0.0)) / 1e6,
                     "n_ranks": n})
    columns = ["calls", "S (MiB)", "kernel time (ms)", "algbw (GB/s)", "busbw (GB/s)"]
    if not rows:
        return pd.DataFrame(columns=columns).rename_axis("collective")
    df = pd.DataFrame(rows)
    out = df.groupby("collective").agg(calls=("time_s", "size"), size=("size_bytes", "sum"),
                                       time=("time_s", "sum"), n=("n_ranks", "max"))
    unknown = df.groupby("collective")["size_bytes"].apply(lambda v: bool(v.isna().any()))
    if unknown.any():  # kernels without sizes: take the sizes of the CPU-side records, if any
        cpu = (pd.DataFrame(cpu_rows).groupby("collective").agg(size=("size_bytes", "sum"), n=("n_ranks", "max"))
               if cpu_rows else pd.DataFrame(columns=["size", "n"]))
        for kind in unknown[unknown].index:
            if kind in cpu.index and pd.notna(cpu.loc[kind, "size"]):
                out.loc[kind, "size"] = cpu.loc[kind, "size"]
                out.loc[kind, "n"] = max(out.loc[kind, "n"], cpu.loc[kind, "n"])
            else:
                out.loc[kind, "size"] = float("nan")
    out["algbw (GB/s)"] = out["size"] / out["time"] / GB
    out["busbw (GB/s)"] = [
        a * bus_factor(c, int(n)) if c in COLLECTIVES and n >= 1 else float("nan")
        for c, a, n in zip(out.index, out["algbw (GB/s)"], out["n"], strict=True)
    ]
    out = out.rename(columns={"size": "S (MiB)", "time": "kernel time (ms)"})
    out["S (MiB)"] /= 2**20
    out["kernel time (ms)"] *= 1e3
    return out[columns]


def _comm_args(args: dict, name: str) -> tuple[str, float, int]:
    """(kind, S in bytes or NaN, group size) from a trace event's collective arguments."""
    kind = collective_kind(str(args.get("Collective name", "")) or name)
    nelems = max(int(args.get("In msg nelems", 0) or 0), int(args.get("Out msg nelems", 0) or 0))
    elem = _DTYPE_BYTES.get(str(args.get("dtype", "")).lower())
    has_size = elem is not None and ("In msg nelems" in args or "Out msg nelems" in args)
    return kind, (nelems * elem if has_size else float("nan")), int(args.get("Group size", 0) or 0)


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Merge overlapping [start, end) intervals; sorted, disjoint."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the overlap of two sorted, disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def communication_overlap(path: str | Path) -> dict[str, float]:
    """How much of one rank's communication-kernel time ran while a compute kernel ran on its GPU.

    From a ``torch.profiler`` Chrome trace of one rank on GPUs: the union of the communication
    kernels' intervals (NCCL's, ``profiler.kernel_category``) and the union of every other kernel's
    (copies and memsets are not counted as compute). *Hidden* is the length of their intersection,
    *exposed* the communication time with no compute kernel beside it. Returns seconds:
    ``communication_s``, ``hidden_s``, ``exposed_s``, ``compute_s`` and ``span_s`` (first kernel start
    to last kernel end), and ``hidden_fraction`` (NaN without communication). An NCCL kernel's time
    includes waiting for the other ranks, so *exposed* includes that waiting; a trace of one rank
    cannot tell the two apart.

    Introduced in chapter 7, section 7.7.
    """
    events = _trace_events(path)
    comm, compute = [], []
    for e in events:
        if e.get("ph") != "X" or e.get("cat") != "kernel" or float(e.get("dur", 0) or 0) <= 0:
            continue
        start = float(e["ts"]) / 1e6
        interval = (start, start + float(e["dur"]) / 1e6)
        category = kernel_category(e.get("name", ""), cat="kernel")
        if category == "communication":
            comm.append(interval)
        elif category != "memcpy / memset":
            compute.append(interval)
    comm_u, compute_u = _union(comm), _union(compute)
    everything = _union(comm + compute)
    communication, hidden = _length(comm_u), _intersection(comm_u, compute_u)
    return {
        "communication_s": communication, "hidden_s": hidden, "exposed_s": communication - hidden,
        "compute_s": _length(compute_u),
        "span_s": (everything[-1][1] - everything[0][0]) if everything else 0.0,
        "hidden_fraction": hidden / communication if communication > 0 else float("nan"),
    }


# --- the link: what nvidia-smi reports ------------------------------------------------------------------

_LINK_RE = re.compile(r"^\s*Link\s+(\d+):\s*([0-9.]+)\s*GB/s", re.I)
_GPU_RE = re.compile(r"^\s*GPU\s+(\d+):", re.I)


def parse_nvlink_status(text: str) -> dict[int, list[float]]:
    """The active NVLink links of each GPU, in GB/s, from the output of ``nvidia-smi nvlink -s``.

    The command prints ``GPU i: <name> (UUID: ...)`` and then one ``Link k: <speed> GB/s`` line per
    link (``Link k: <inactive>`` for one that is down, which is left out). A GPU without NVLink gets
    an empty list; text in another shape gives ``{}``.

    Introduced in chapter 7, section 7.7.
    """
    out: dict[int, list[float]] = {}
    gpu = None
    for line in text.splitlines():
        if m := _GPU_RE.match(line):
            gpu = int(m.group(1))
            out[gpu] = []
        elif (m := _LINK_RE.match(line)) and gpu is not None:
            out[gpu].append(float(m.group(2)))
    return out


def nvlink_status(timeout_s: float = 20.0) -> tuple[str, dict[int, list[float]]] | None:
    """Run ``nvidia-smi nvlink -s``: its output and ``parse_nvlink_status`` of it; None if it cannot run.

    None when ``nvidia-smi`` is missing, fails, or times out: the caller then says that the link's
    nominal bandwidth is unknown. (The speeds are per link and direction as the driver reports them.)

    Introduced in chapter 7, section 7.7.
    """
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        done = subprocess.run([exe, "nvlink", "-s"], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return done.stdout, parse_nvlink_status(done.stdout)


def records_json(timings: Sequence[CollectiveTiming]) -> str:
    """The timings as JSON (a list of ``record`` dicts plus the raw repeats), for a launched rank to write.

    Introduced in chapter 7, section 7.7 (through ``scripts/collectives_bench.py``).
    """
    return json.dumps([t.record() | {"times_s": list(asdict(t)["times_s"])} for t in timings], indent=1)
