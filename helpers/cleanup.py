"""Give memory back between experiments, and show that it came back.

Deleting a Python name frees a tensor only when nothing else refers to it. In a notebook the usual
hidden holders are IPython's output history (``Out``, ``_``, ``__``, ``___``, ``_3``: every value a
cell displayed) and a caught exception's traceback; ``free`` clears the first, and code that catches
an out-of-memory error should let the ``except`` block end before calling it. What is still alive
afterwards (some other reference holds it) is reported, not hidden.
"""

from __future__ import annotations

import gc
import re
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from helpers import measure

_OUTPUT_NAME = re.compile(r"_\d+|_{1,3}")


@dataclass(frozen=True)
class Freed:
    """What ``free`` removed, what it could not free, and how much GPU memory came back (NaN without CUDA).

    ``still_alive``: names whose objects something else still refers to after the cleanup (only
    objects that can be weakly referenced are checked: tensors, modules, optimizers, most classes).

    Introduced in chapter 1, section 1.2.
    """

    names: tuple[str, ...]
    allocated_before_mib: float
    allocated_after_mib: float
    reserved_before_mib: float
    reserved_after_mib: float
    still_alive: tuple[str, ...] = ()

    @property
    def allocated_freed_mib(self) -> float:
        """Allocated memory given back, in MiB."""
        return self.allocated_before_mib - self.allocated_after_mib

    @property
    def reserved_freed_mib(self) -> float:
        """Reserved memory the allocator handed back to the driver, in MiB."""
        return self.reserved_before_mib - self.reserved_after_mib


def collect() -> None:
    """Collect garbage and hand the allocator's cached blocks back to the driver (on CUDA).

    Introduced in chapter 3, section 3.2.
    """
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _ipython_shell(namespace: dict[str, Any]):
    """The running IPython shell whose user namespace is ``namespace``, if there is one."""
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover - IPython is a dependency
        return None
    shell = get_ipython()
    return shell if shell is not None and getattr(shell, "user_ns", None) is namespace else None


def _drop_from_history(namespace: dict[str, Any], dropped: set[int], shell=None) -> None:
    """Remove every output-history reference to a dropped object; the user's own names are left alone.

    The places are those IPython's ``del_var`` clears: ``Out`` (the history manager's output
    history), ``_N``, ``_``/``__``/``___`` (also kept by the display hook) and the last result.
    """
    histories = [namespace.get("Out")]
    if shell is not None:
        histories.append(getattr(getattr(shell, "history_manager", None), "output_hist", None))
    for history in histories:
        if isinstance(history, dict):
            for key in [k for k, v in history.items() if id(v) in dropped]:
                del history[key]
    spaces = [namespace] + ([shell.user_ns_hidden] if shell is not None else [])
    for space in spaces:
        for key in [k for k, v in space.items() if _OUTPUT_NAME.fullmatch(k) and id(v) in dropped]:
            if key in ("_", "__", "___"):
                space[key] = None
            else:
                del space[key]
    if shell is not None:
        hook = getattr(shell, "displayhook", None)
        for name in ("_", "__", "___"):
            if id(getattr(hook, name, None)) in dropped:
                setattr(hook, name, None)
        last = getattr(shell, "last_execution_result", None)
        if last is not None and id(getattr(last, "result", None)) in dropped:
            shell.last_execution_result = None


def free(namespace: dict[str, Any], *names: str) -> Freed:
    """Delete ``names`` from ``namespace`` (pass ``globals()``), collect garbage, empty the CUDA cache.

    In a notebook every output-history reference to the deleted objects goes too (the places IPython's
    own ``del_var`` clears: ``Out``, ``_``, ``_3``, the display hook, the last result); other names
    you gave the same object are left alone. Names that are not in the namespace are ignored, so a
    cleanup cell can run twice. ``Freed.still_alive`` names the objects that something else still
    holds.

    >>> freed = free(globals(), "model", "optimizer")
    >>> freed.allocated_freed_mib, freed.still_alive

    Introduced in chapter 1, section 1.2.
    """
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"free takes names as strings, got {type(name).__name__}")
    before = measure.allocator_mib()
    removed = tuple(dict.fromkeys(n for n in names if n in namespace))
    watch: dict[str, weakref.ref] = {}
    for name in removed:
        try:
            watch[name] = weakref.ref(namespace[name])
        except TypeError:  # ints, lists, dicts: cannot be watched
            pass
    shell = _ipython_shell(namespace)
    dropped = {id(namespace[n]) for n in removed}
    for name in removed:
        del namespace[name]
    _drop_from_history(namespace, dropped, shell)
    del dropped
    collect()
    after = measure.allocator_mib()
    alive = tuple(name for name, ref in watch.items() if ref() is not None)
    return Freed(
        removed, before["allocated_mib"], after["allocated_mib"], before["reserved_mib"], after["reserved_mib"], alive
    )


class LeakError(AssertionError):
    """Allocated GPU memory did not come back to its baseline: the message says how many MiB are still held.

    An ``AssertionError``, as a chapter's leak check is an assertion, but raised explicitly, so it also
    fires under ``python -O``.

    Introduced in chapter 3's last cell (Memory back at the baseline).
    """


@dataclass(frozen=True)
class Baseline:
    """Allocated GPU memory at a chapter's start, read by ``baseline`` with the cuBLAS workspaces released.

    ``back_at_baseline`` takes it (or a bare number of MiB) and compares the end with it.

    Introduced in chapter 3's last cell (Memory back at the baseline).
    """

    allocated_mib: float

    def check(self, tolerance_mib: float = 0.01) -> dict[str, float]:
        """``back_at_baseline(self, tolerance_mib)``."""
        return back_at_baseline(self, tolerance_mib)


def _release_all() -> None:
    """Collect garbage, release the cuBLAS workspaces (when CUDA is in use), collect again."""
    collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # cuBLAS keeps a workspace per handle and stream that ran a matrix product (the autograd engine's
        # thread included) until told to let go; this is PyTorch's own private call for that.
        torch._C._cuda_clearCublasWorkspaces()
        collect()


def baseline() -> Baseline:
    """Read the allocated GPU memory a chapter's end must come back to, after releasing what would blur it.

    Collects garbage and releases the cuBLAS workspaces before reading, as ``back_at_baseline`` does
    before its own reading, so that a workspace created before the start (a matrix product in the
    setup) neither hides a leak of its size at the end nor counts as one. NaN without a CUDA GPU;
    0.0 before the first CUDA call (and reading creates no CUDA context).

    >>> start = cleanup.baseline()          # first cells of a chapter
    >>> cleanup.back_at_baseline(start)     # its last cell, on a GPU

    Not used in a chapter yet: the chapters pass ``back_at_baseline`` a number they read themselves.
    """
    _release_all()
    return Baseline(measure.allocator_mib()["allocated_mib"])


def back_at_baseline(start: Baseline | float, tolerance_mib: float = 0.01) -> dict[str, float]:
    """Release what a chapter still holds and check that allocated GPU memory is back at its start.

    ``start`` is a ``Baseline`` (from ``baseline``) or the allocated MiB a chapter read itself. Collects
    garbage and reads the allocated memory; releases the cuBLAS workspaces (cuBLAS keeps one per handle
    and stream that ran a matrix product, the autograd engine's thread included, until told to let go;
    this uses PyTorch's own private call, ``torch._C._cuda_clearCublasWorkspaces``); collects again and
    reads it once more. Returns the three numbers in MiB, labelled for a table: allocated before
    clearing the workspaces, at the end, and at the start.

    Raises ``LeakError`` (an ``AssertionError``) saying how many MiB are still allocated when the end
    exceeds the start by more than ``tolerance_mib`` (a leak); ``RuntimeError`` when CUDA is not in
    use (a chapter's CPU path prints its ``skipped on CPU`` line instead of calling this);
    ``ValueError`` for a start that is not a reading (NaN: read without a GPU).

    >>> rows = back_at_baseline(baseline_mib)      # the last cell of a chapter, on a GPU

    Introduced in chapter 3's last cell (Memory back at the baseline); every chapter ends with it.
    """
    baseline_mib = float(start.allocated_mib if isinstance(start, Baseline) else start)
    if baseline_mib != baseline_mib or baseline_mib < 0:
        raise ValueError(f"the start must be allocated MiB read on a GPU (>= 0), got {baseline_mib}")
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        raise RuntimeError("back_at_baseline checks GPU memory: CUDA is not in use in this process")
    collect()
    held_mib = measure.allocator_mib()["allocated_mib"]
    _release_all()
    end_mib = measure.allocator_mib()["allocated_mib"]
    if end_mib > baseline_mib + tolerance_mib:
        import gc

        live = [(tuple(t.shape), str(t.dtype)) for t in gc.get_objects() if torch.is_tensor(t) and t.is_cuda]
        raise LeakError(f"{end_mib - baseline_mib:.2f} MiB still allocated at the end (start {baseline_mib:.2f} MiB): "
                        f"a leak; CUDA tensors Python still holds (shape, dtype; at most 20): {live[:20]}")
    return {
        "allocated before clearing the cuBLAS workspaces (MiB)": held_mib,
        "allocated at the end (MiB)": end_mib,
        "allocated at the start (MiB)": baseline_mib,
    }
