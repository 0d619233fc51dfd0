"""Memory and time measurement.

Four memory numbers, never mixed up:

- NVML *used*: what the driver reports for the whole GPU (every process, CUDA context included),
  the number ``nvidia-smi`` shows.
- torch *reserved*: what PyTorch's caching allocator holds from the driver (allocated + cached).
- torch *allocated*: bytes in live tensors.
- *peak allocated*: the most allocated since the last reset.

All memory is reported in MiB (2**20 bytes). Time is the median of timed repeats after warm-up,
with the device synchronised before each clock read.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import pandas as pd
import torch

from helpers.profiles import require_cuda

MIB = 2**20
GIB = 2**30
# A Tesla T4 (Colab's free GPU) as the CUDA driver reports it to programs ("deviceMemorySize: 14.75GiB").
# nvidia-smi shows more (15,360 MiB), part of which the driver keeps for itself.
T4_MEMORY_GIB = 14.75


def nvml_used_mib(index: int = 0) -> float:
    """GPU memory in use on device ``index`` as NVML (and ``nvidia-smi``) reports it, in MiB."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as err:  # no driver / no GPU
        raise RuntimeError("NVML needs an NVIDIA GPU and driver; none is available") from err
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        return pynvml.nvmlDeviceGetMemoryInfo(handle).used / MIB
    finally:
        pynvml.nvmlShutdown()


def allocator_mib(device: int | str | torch.device | None = None) -> dict[str, float]:
    """torch's view of GPU memory: allocated, reserved and peak allocated, in MiB."""
    require_cuda("allocator_mib")
    return {
        "allocated_mib": torch.cuda.memory_allocated(device) / MIB,
        "reserved_mib": torch.cuda.memory_reserved(device) / MIB,
        "peak_allocated_mib": torch.cuda.max_memory_allocated(device) / MIB,
    }


def synchronize(device: str | torch.device) -> None:
    """Wait for queued GPU work (no-op on CPU), so a clock read covers the work."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device: str | torch.device) -> None:
    """Make the next peak reading start from the current allocation (CUDA only; no-op on CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


@dataclass
class PhaseRecord:
    phase: str
    time_s: float
    allocated_mib: float
    peak_allocated_mib: float
    reserved_mib: float


@dataclass
class PhaseRecorder:
    """Record time and memory of named phases (load -> forward -> backward -> step).

    For each phase: the peak counter is reset when it starts, and after it ends the recorder notes
    allocated memory (what the phase left behind) and peak allocated (the most it needed at once).
    On a CPU the memory columns are NaN; the times are still measured.

    >>> rec = PhaseRecorder("cuda")
    >>> with rec.phase("forward"):
    ...     loss = model(**batch).loss
    >>> rec.to_frame()
    """

    device: str | torch.device
    records: list[PhaseRecord] = field(default_factory=list)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        cuda = torch.device(self.device).type == "cuda"
        synchronize(self.device)
        reset_peak(self.device)
        start = time.perf_counter()
        yield
        synchronize(self.device)
        elapsed = time.perf_counter() - start
        if cuda:
            stats = allocator_mib(self.device)
            rec = PhaseRecord(
                name, elapsed, stats["allocated_mib"], stats["peak_allocated_mib"], stats["reserved_mib"]
            )
        else:
            nan = float("nan")
            rec = PhaseRecord(name, elapsed, nan, nan, nan)
        self.records.append(rec)

    def to_frame(self) -> pd.DataFrame:
        """One row per phase, in the order they ran."""
        return pd.DataFrame([vars(r) for r in self.records]).set_index("phase")


@dataclass(frozen=True)
class Timing:
    """Timed repeats of one function, in seconds."""

    times_s: tuple[float, ...]

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s)

    @property
    def spread_s(self) -> float:
        """max - min of the repeats: differences smaller than this are noise."""
        return max(self.times_s) - min(self.times_s)


def time_fn(
    fn: Callable[[], object], *, device: str | torch.device, warmup: int = 2, repeat: int = 5
) -> Timing:
    """Time ``fn()``: ``warmup`` untimed calls, then ``repeat`` timed ones, synchronising the device.

    >>> time_fn(lambda: x @ x, device="cuda").median_s
    """
    if warmup < 0 or repeat < 1:
        raise ValueError(f"need warmup >= 0 and repeat >= 1, got warmup={warmup}, repeat={repeat}")
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return Timing(tuple(times))


@contextmanager
def gpu_budget(total_gib: float, device: int = 0) -> Iterator[float]:
    """Emulate a smaller GPU: cap this process's caching allocator at ``total_gib`` GiB.

    Uses ``torch.cuda.set_per_process_memory_fraction`` and restores the full card on exit.
    Yields the fraction of the real card that was allowed. Allocations past the cap raise
    ``torch.OutOfMemoryError`` exactly as a smaller card would (the CUDA context is not counted:
    subtract it from the card's size before calling, as chapter 1 does).
    """
    require_cuda("gpu_budget")
    if total_gib <= 0:
        raise ValueError(f"total_gib must be positive, got {total_gib}")
    card = torch.cuda.get_device_properties(device).total_memory
    fraction = min(1.0, total_gib * GIB / card)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    try:
        yield fraction
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
