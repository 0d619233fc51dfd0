"""Memory measurement: the one reader of GPU memory, peaks, phases, budgets.

Four memory numbers, never mixed up:

- NVML *used*: what the driver reports for the whole GPU (every process, CUDA context included),
  the number ``nvidia-smi`` shows.
- torch *reserved*: what PyTorch's caching allocator holds from the driver (allocated + cached).
- torch *allocated*: bytes in live tensors.
- *peak allocated*: the most allocated since the last reset.

All memory is reported in MiB (2**20 bytes). Without a CUDA GPU the allocator numbers are NaN.

Also here, because every memory-aware helper needs them: ``PHASES``, the names of a training step's
phases that ``steps``, ``profiler`` and ``memsnap`` share, and ``is_out_of_memory``, the one test of
whether an error means the GPU ran out of memory (``batching`` and ``distributed`` both ask it).
Time is ``timing``'s job (``PhaseRecorder`` notes each phase's wall time only as a side note).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import pandas as pd
import torch

from helpers.gpus import T4_MEMORY_GIB  # the T4 card that t4_budget emulates
from helpers.run_profile import require_cuda

MIB = 2**20
GIB = 2**30


def _visible_nvml_indices(pynvml) -> list[int]:
    """NVML indices of the GPUs this process sees, in CUDA's order (``CUDA_VISIBLE_DEVICES`` applied).

    NVML numbers every GPU of the machine; CUDA numbers only the visible ones. With
    ``CUDA_VISIBLE_DEVICES=2,3`` CUDA's device 0 is NVML's device 2. Entries may be indices or
    (prefixes of) UUIDs; as in CUDA, the list ends at the first entry that names no GPU.
    """
    count = pynvml.nvmlDeviceGetCount()
    var = os.environ.get("CUDA_VISIBLE_DEVICES")
    if var is None:
        return list(range(count))
    uuids = None
    visible: list[int] = []
    for entry in (e.strip() for e in var.split(",")):
        if entry.isdigit():
            index = int(entry)
        elif entry.startswith(("GPU-", "MIG-")):
            if uuids is None:
                uuids = []
                for i in range(count):
                    uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))
                    uuids.append(uuid.decode() if isinstance(uuid, bytes) else uuid)
            matches = [i for i, u in enumerate(uuids) if u.startswith(entry)]
            index = matches[0] if len(matches) == 1 else -1
        else:
            index = -1
        if not 0 <= index < count or index in visible:
            break
        visible.append(index)
    return visible


@contextmanager
def nvml_device(index: int = 0) -> Iterator[object]:
    """An NVML handle for CUDA device ``index`` (the GPU that ``torch.device("cuda", index)`` uses).

    Maps ``index`` through ``CUDA_VISIBLE_DEVICES``, so a process that sees one GPU of a shared
    machine reads that GPU, not the machine's first. Raises ``RuntimeError`` without NVML (no NVIDIA
    driver) or when ``index`` is not a visible GPU. Creates no CUDA context. Assumes CUDA numbers the
    GPUs in NVML's (PCI bus) order, as it does with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` and on a machine
    of one GPU model; CUDA's default order (fastest first) can differ on a machine with mixed GPUs.

    Introduced in chapter 1, section 1.1.
    """
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as err:  # no driver / no GPU
        raise RuntimeError("NVML needs an NVIDIA GPU and driver; none is available") from err
    try:
        visible = _visible_nvml_indices(pynvml)
        if not 0 <= index < len(visible):
            raise RuntimeError(f"CUDA device {index} is not visible to this process ({len(visible)} visible)")
        yield pynvml.nvmlDeviceGetHandleByIndex(visible[index])
    finally:
        pynvml.nvmlShutdown()


def visible_gpu_count() -> int:
    """How many GPUs this process can use (NVML's count with ``CUDA_VISIBLE_DEVICES`` applied); 0 without NVML.

    Introduced in chapter 1, section 1.1.
    """
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return 0
    try:
        return len(_visible_nvml_indices(pynvml))
    finally:
        pynvml.nvmlShutdown()


def nvml_used_mib(index: int = 0) -> float:
    """GPU memory in use on CUDA device ``index`` as NVML (and ``nvidia-smi``) reports it, in MiB.

    The whole GPU's use: this process's CUDA context and tensors, and any other process's. ``index``
    counts the GPUs this process sees (``CUDA_VISIBLE_DEVICES`` applied), as ``torch.device("cuda",
    index)`` does. Creates no CUDA context.

    >>> nvml_used_mib()

    Introduced in chapter 1, section 1.1.
    """
    import pynvml

    with nvml_device(index) as handle:
        return pynvml.nvmlDeviceGetMemoryInfo(handle).used / MIB


def allocator_mib(device: int | str | torch.device | None = None) -> dict[str, float]:
    """torch's view of GPU memory: allocated, reserved and peak allocated, in MiB.

    The one reader of the caching allocator that every helper uses. Without a CUDA GPU every value
    is NaN (there is no GPU memory to read); before the first CUDA call it is 0.0 (nothing
    allocated yet) and reading creates no CUDA context.

    >>> allocator_mib()["peak_allocated_mib"]

    Introduced in chapter 1, section 1.1.
    """
    if not torch.cuda.is_available():
        nan = float("nan")
        return {"allocated_mib": nan, "reserved_mib": nan, "peak_allocated_mib": nan}
    if not torch.cuda.is_initialized():
        return {"allocated_mib": 0.0, "reserved_mib": 0.0, "peak_allocated_mib": 0.0}
    return {
        "allocated_mib": torch.cuda.memory_allocated(device) / MIB,
        "reserved_mib": torch.cuda.memory_reserved(device) / MIB,
        "peak_allocated_mib": torch.cuda.max_memory_allocated(device) / MIB,
    }


# The phases of one training step, in order: the names ``steps.train_step`` marks with
# ``record_function``, ``profiler`` splits a step's kernels by, and ``memsnap`` files allocations under.
PHASES = ("forward", "backward", "optimizer")

# RuntimeError messages that mean "out of memory" when a library allocates behind torch's back (cuBLAS,
# cuDNN, NCCL, a raw CUDA call) instead of raising torch.OutOfMemoryError.
OOM_MESSAGES = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED", "CUDNN_STATUS_NOT_ENOUGH_WORKSPACE")


def is_out_of_memory(err: BaseException) -> bool:
    """True for ``torch.OutOfMemoryError`` and for a ``RuntimeError`` whose message reports an allocation failure.

    A library that allocates GPU memory behind torch's back reports the failure in its own words
    (cuBLAS's ``CUBLAS_STATUS_ALLOC_FAILED``, cuDNN's ``CUDNN_STATUS_ALLOC_FAILED``, CUDA's
    ``out of memory``); those count too (``OOM_MESSAGES``). The one definition the book uses:
    ``batching.try_batch`` catches what it accepts, ``distributed.exit_all_ranks_on_oom`` ends a
    launch on it.

    >>> is_out_of_memory(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"))
    True

    Introduced in chapter 3, section 3.2.
    """
    if isinstance(err, torch.OutOfMemoryError):
        return True
    return isinstance(err, RuntimeError) and any(m in str(err) for m in OOM_MESSAGES)


def synchronize(device: str | torch.device) -> None:
    """Wait for queued GPU work (no-op on CPU, and before the first CUDA call), so a clock read covers the work.

    Introduced in chapter 1, section 1.3.
    """
    if torch.device(device).type == "cuda" and torch.cuda.is_initialized():
        torch.cuda.synchronize(device)


class _OpenPeak:
    """A peak being measured (a ``peak`` block or a ``PhaseRecorder`` phase): its device and the highest
    peak counter seen before an inner reset."""

    def __init__(self, device: int | str | torch.device | None):
        self.key = _device_key(device)
        self.seen = 0.0


# Peaks being measured now, innermost last. Every reset goes through ``reset_peak``, which first raises
# their ``seen`` to the counter, so an inner reset never hides a peak an enclosing measurement saw.
_open_peaks: list[_OpenPeak] = []


def _device_key(device: int | str | torch.device | None) -> int | None:
    """The CUDA device index that ``device`` names; None for a CPU device."""
    if isinstance(device, int):
        return device
    d = torch.device(device if device is not None else "cuda")
    if d.type != "cuda":
        return None
    if d.index is not None:
        return d.index
    return torch.cuda.current_device() if torch.cuda.is_initialized() else 0


def _keep_open_peaks(device: int | str | torch.device | None) -> None:
    """Before the counter is reset: note its value in every open peak of the same device."""
    key = _device_key(device)
    mine = [p for p in _open_peaks if p.key == key and key is not None]
    if not mine:
        return
    now = allocator_mib(device)["peak_allocated_mib"]
    if now == now:  # not NaN
        for p in mine:
            p.seen = max(p.seen, now)


def reset_peak(device: str | torch.device) -> None:
    """Make the next peak reading start from the current allocation (CUDA only; no-op on CPU).

    An enclosing ``peak`` block or ``PhaseRecorder`` phase keeps the peak it saw before this reset.

    Introduced in chapter 1, section 1.3.
    """
    if torch.device(device).type == "cuda" and torch.cuda.is_initialized():
        _keep_open_peaks(device)
        torch.cuda.reset_peak_memory_stats(device)


@contextmanager
def _measured_peak(device: int | str | torch.device | None) -> Iterator[_OpenPeak]:
    """Synchronise and reset the peak counter, register an open peak for the block, unregister it after."""
    dev = device if device is not None else "cuda"
    if isinstance(dev, int):
        dev = torch.device("cuda", dev)
    synchronize(dev)
    _keep_open_peaks(dev)
    reset_peak(dev)
    tracker = _OpenPeak(dev)
    _open_peaks.append(tracker)
    try:
        yield tracker
    finally:
        _open_peaks.remove(tracker)
        synchronize(dev)


@dataclass
class Peak:
    """What ``peak`` measured: allocated MiB when the block began (``start_mib``) and the most allocated
    at any moment inside it (``mib``). NaN on a CPU, and while the block runs.

    Not used in a chapter yet: chapter 1, section 1.3 reads peaks per phase with ``PhaseRecorder``.
    """

    start_mib: float = float("nan")
    mib: float = float("nan")

    @property
    def extra_mib(self) -> float:
        """The block's own peak: its most allocated less what was already allocated when it began."""
        return self.mib - self.start_mib


@contextmanager
def peak(device: int | str | torch.device | None = None) -> Iterator[Peak]:
    """Measure the peak allocated GPU memory of the ``with`` block, in MiB (NaN on a CPU).

    Synchronises and resets the allocator's peak counter when the block starts; when it ends,
    synchronises and reads the peak into the yielded ``Peak`` (``.mib``; ``.start_mib`` is what was
    allocated when it began). ``device`` defaults to the current CUDA device, or the CPU without CUDA.
    Blocks nest, with each other and with ``PhaseRecorder`` phases and ``reset_peak``: an inner reset
    does not hide a peak the outer block saw before it. (A direct ``torch.cuda.reset_peak_memory_stats``
    call inside the block would.)

    >>> with measure.peak() as p:
    ...     loss = model(**batch).loss
    >>> p.mib, p.extra_mib

    Not used in a chapter yet: chapter 1, section 1.3 reads peaks per phase with ``PhaseRecorder``.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    result = Peak()
    if _device_key(device) is None:  # a CPU: nothing to measure, the block still runs
        yield result
        return
    tracker = None
    try:
        with _measured_peak(device) as tracker:
            result.start_mib = allocator_mib(device)["allocated_mib"]
            yield result
    finally:  # read even when the block raised (an out-of-memory demonstration)
        result.mib = max(allocator_mib(device)["peak_allocated_mib"], tracker.seen if tracker else 0.0)


@dataclass
class PhaseRecord:
    """One phase of a ``PhaseRecorder``: its wall time and memory in MiB (NaN on a CPU).

    Introduced in chapter 1, section 1.3.
    """

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
    Phases may nest (``step`` around ``forward`` and ``backward``): an inner phase's reset does not
    hide an earlier peak from the outer phase, whose peak is the most allocated at any moment inside
    it. Rows are in the order the phases started. On a CPU the memory columns are NaN; the times are
    still measured.

    >>> rec = PhaseRecorder("cuda")
    >>> with rec.phase("forward"):
    ...     loss = model(**batch).loss
    >>> rec.to_frame()

    Introduced in chapter 1, section 1.3.
    """

    device: str | torch.device
    records: list[PhaseRecord] = field(default_factory=list)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the ``with`` block and record its memory under ``name``."""
        cuda = torch.device(self.device).type == "cuda"
        slot = len(self.records)
        nan = float("nan")
        self.records.append(PhaseRecord(name, nan, nan, nan, nan))
        tracker, start = None, time.perf_counter()
        try:
            with _measured_peak(self.device) as tracker:
                start = time.perf_counter()
                yield
        finally:  # a phase that raised (an out-of-memory demonstration) is recorded too
            elapsed = time.perf_counter() - start
            rec = PhaseRecord(name, elapsed, nan, nan, nan)
            if cuda:
                stats = allocator_mib(self.device)
                peak_mib = max(stats["peak_allocated_mib"], tracker.seen if tracker else 0.0)
                rec = PhaseRecord(name, elapsed, stats["allocated_mib"], peak_mib, stats["reserved_mib"])
            self.records[slot] = rec

    def to_frame(self) -> pd.DataFrame:
        """One row per phase, in the order they started."""
        return pd.DataFrame([vars(r) for r in self.records]).set_index("phase")


@dataclass(frozen=True)
class Budget:
    """An emulated smaller GPU: the card's memory less this process's CUDA context, in GiB.

    Introduced in chapter 1, section 1.5.
    """

    card_gib: float
    context_gib: float
    card_name: str = "T4"

    @property
    def budget_gib(self) -> float:
        """What the allocator may hold: the card less the context (which the allocator never sees)."""
        return self.card_gib - self.context_gib

    def describe(self) -> str:
        return (f"allocator capped at {self.budget_gib:.2f} GiB = {self.card_gib:.2f} GiB ({self.card_name}) "
                f"- {self.context_gib:.2f} GiB (this process's CUDA context)")


def context_gib(nvml_before_mib: float, device: int = 0) -> float:
    """This process's CUDA context in GiB: NVML *used* now, less *used* before the first CUDA call, less
    what torch's allocator reserves. Call it after the first CUDA call (and the first matmul, which loads
    cuBLAS), with the NVML reading taken before any CUDA call.

    Introduced in chapter 1, section 1.5.
    """
    require_cuda("context_gib")
    if nvml_before_mib < 0:
        raise ValueError(f"nvml_before_mib must be a reading in MiB (>= 0), got {nvml_before_mib}")
    used_mib = nvml_used_mib(device)
    return (used_mib - nvml_before_mib) * MIB / GIB - torch.cuda.memory_reserved(device) / GIB


def t4_budget(nvml_before_mib: float, device: int = 0, card_gib: float = T4_MEMORY_GIB,
              card_name: str = "T4") -> Budget:
    """The budget that makes this GPU behave like a T4 (Colab's free GPU): 14.75 GiB less this process's
    CUDA context, for ``gpu_budget(t4_budget(...).budget_gib)``. One call replaces the emulation cell
    chapters 1, 3, 4 and 6 used to repeat. On a real T4 the budget is the whole card less the context,
    so the cap changes nothing.

    >>> budget = measure.t4_budget(nvml_before)
    >>> print(budget.describe())
    >>> with measure.gpu_budget(budget.budget_gib):
    ...     train_step(...)

    Introduced in chapter 1, section 1.5.
    """
    if card_gib <= 0:
        raise ValueError(f"card_gib must be positive, got {card_gib}")
    ctx = context_gib(nvml_before_mib, device)
    if ctx >= card_gib:
        raise ValueError(f"the CUDA context ({ctx:.2f} GiB) does not leave room on a {card_gib:.2f} GiB card")
    return Budget(card_gib=card_gib, context_gib=ctx, card_name=card_name)


def t4_start() -> tuple[Budget, float]:
    """The first GPU cell of a chapter that emulates a T4: measure this process's CUDA context with cuBLAS loaded
    (one small matrix product in fp32 and one in fp16, as the chapter's own products will load it), then clear
    cuBLAS's workspaces (the chapter's last cell clears them too, so both ends exclude them). Returns the T4
    budget (``t4_budget``) and the allocated MiB at this point: the chapter's baseline, checked at its end.
    Call it before anything else touches the GPU.

    >>> budget, baseline_mib = measure.t4_start()

    Introduced in chapter 3, section 3.1 (chapter 1, section 1.5, explains the budget).
    """
    nvml_before = nvml_used_mib()
    for dtype in (torch.float32, torch.float16):
        torch.ones(256, 256, device="cuda", dtype=dtype) @ torch.ones(256, 256, device="cuda", dtype=dtype)
    budget = t4_budget(nvml_before)
    torch._C._cuda_clearCublasWorkspaces()
    return budget, torch.cuda.memory_allocated() / MIB


# Fractions set by gpu_budget on each device, innermost last: what to restore on exit where torch cannot
# report the current fraction (get_per_process_memory_fraction is recent).
_budget_stack: dict[int, list[float]] = {}


def _current_fraction(device: int) -> float:
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if getter is not None:
        return float(getter(device))
    stack = _budget_stack.get(device)
    return stack[-1] if stack else 1.0


@contextmanager
def gpu_budget(total_gib: float, device: int = 0) -> Iterator[float]:
    """Emulate a smaller GPU: cap this process's caching allocator at ``total_gib`` GiB.

    Uses ``torch.cuda.set_per_process_memory_fraction`` and, on exit, restores the fraction that was
    in force before (the full card unless an enclosing ``gpu_budget`` or the caller had set less).
    Yields the fraction of the real card that was allowed. Allocations past the cap raise
    ``torch.OutOfMemoryError`` exactly as a smaller card would (the CUDA context is not counted:
    subtract it from the card's size before calling, as chapter 1 does).

    >>> with gpu_budget(gpus.T4_MEMORY_GIB - context_gib):
    ...     train_step(model, optimizer, batch)

    Introduced in chapter 1, section 1.5.
    """
    require_cuda("gpu_budget")
    if total_gib <= 0:
        raise ValueError(f"total_gib must be positive, got {total_gib}")
    card = torch.cuda.get_device_properties(device).total_memory
    fraction = min(1.0, total_gib * GIB / card)
    previous = _current_fraction(device)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    _budget_stack.setdefault(device, []).append(fraction)
    try:
        yield fraction
    finally:
        _budget_stack[device].pop()
        torch.cuda.set_per_process_memory_fraction(previous, device)
