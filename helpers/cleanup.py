"""Give memory back between experiments, and show that it came back.

Deleting a Python name frees a tensor only when nothing else refers to it. In a notebook the usual
hidden holders are IPython's output history (``Out``, ``_``, ``__``, ``___``) and a caught
exception's traceback; ``free`` clears the first, and code that catches an out-of-memory error
should let the ``except`` block end before calling it.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any

import torch

from helpers.measure import MIB


@dataclass(frozen=True)
class Freed:
    """What ``free`` removed and how much GPU memory came back (NaN without CUDA)."""

    names: tuple[str, ...]
    allocated_before_mib: float
    allocated_after_mib: float
    reserved_before_mib: float
    reserved_after_mib: float

    @property
    def allocated_freed_mib(self) -> float:
        return self.allocated_before_mib - self.allocated_after_mib

    @property
    def reserved_freed_mib(self) -> float:
        return self.reserved_before_mib - self.reserved_after_mib


def cuda_mib() -> tuple[float, float]:
    """torch's allocated and reserved CUDA memory in MiB; NaN for both before CUDA is in use."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return float("nan"), float("nan")
    return torch.cuda.memory_allocated() / MIB, torch.cuda.memory_reserved() / MIB


def collect() -> None:
    """Collect garbage and hand the allocator's cached blocks back to the driver (on CUDA)."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def free(namespace: dict[str, Any], *names: str) -> Freed:
    """Delete ``names`` from ``namespace`` (pass ``globals()``), collect garbage, empty the CUDA cache.

    Also drops any entry of IPython's output history that points at a deleted object. Names that
    are not in the namespace are ignored, so a cleanup cell can run twice.

    >>> freed = free(globals(), "model", "optimizer")
    >>> freed.allocated_freed_mib
    """
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"free takes names as strings, got {type(name).__name__}")
    alloc0, res0 = cuda_mib()
    dropped = {id(namespace[n]) for n in names if n in namespace}
    removed = tuple(n for n in names if n in namespace)
    for name in removed:
        del namespace[name]
    history = namespace.get("Out")
    if isinstance(history, dict):
        for key in [k for k, v in history.items() if id(v) in dropped]:
            del history[key]
    for short in ("_", "__", "___"):
        if id(namespace.get(short)) in dropped:
            namespace[short] = None
    collect()
    alloc1, res1 = cuda_mib()
    return Freed(removed, alloc0, alloc1, res0, res1)
