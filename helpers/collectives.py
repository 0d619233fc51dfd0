"""Collectives timed: bus bandwidth against message size, inside launched processes.

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
- **Not here:** a profiler trace's communication kernels and their overlap with compute
  (``profiler.communication_from_trace``, ``profiler.communication_overlap``), which belong with the one trace
  reader, and the NVLink status of ``nvidia-smi nvlink -s`` (``env.nvlink_status``), which describes the machine.

Introduced in chapter 7, section 7.7 (Communication, measured).

>>> t = time_collective("all_reduce", 2**26, device="cuda")   # on every rank of a process group
>>> t.record()["busbw_gb_s"]
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import pandas as pd
import torch

from helpers.estimates import COLLECTIVES, bus_factor
from helpers.profiler import GB
from helpers.timing import Spread


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


def records_json(timings: Sequence[CollectiveTiming]) -> str:
    """The timings as JSON (a list of ``record`` dicts plus the raw repeats), for a launched rank to write.

    Introduced in chapter 7, section 7.7 (through ``scripts/collectives_bench.py``).
    """
    return json.dumps([t.record() | {"times_s": list(asdict(t)["times_s"])} for t in timings], indent=1)


def bandwidth_by_world_size(records: pd.DataFrame | Sequence[dict]) -> pd.DataFrame:
    """Median bus bandwidth (GB/s) with its spread, one row per collective and size (MiB), one column group per
    world size: the records of several sweeps (each with a ``world_size`` key, as ``scripts/multigpu_bench.py``
    writes them) side by side. The spread is the bus bandwidth of the slowest and the fastest quartile's time.

    Introduced in chapter 7, section 7.7.
    """
    df = pd.DataFrame(list(records) if not isinstance(records, pd.DataFrame) else records)
    if "world_size" not in df:
        raise ValueError("records need a 'world_size' key (one sweep per world size)")
    factor = [bus_factor(c, int(n)) for c, n in zip(df["collective"], df["n_ranks"], strict=True)]
    table = pd.DataFrame({
        "world_size": df["world_size"].astype(int), "collective": df["collective"], "size (MiB)": df["size_bytes"] / 2**20,
        "busbw (GB/s)": df["busbw_gb_s"],
        "busbw, q3 time (GB/s)": df["size_bytes"] / df["time_q3_s"] * factor / GB,
        "busbw, q1 time (GB/s)": df["size_bytes"] / df["time_q1_s"] * factor / GB,
    })
    return table.pivot_table(index=["collective", "size (MiB)"], columns="world_size").swaplevel(axis=1).sort_index(axis=1)
