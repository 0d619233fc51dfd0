"""Find the largest batch that fits, without crashing on the way: try, catch, free, back off.

``try_batch(step, batch_size)`` calls ``step(batch_size)`` once. If it runs out of memory
(``torch.OutOfMemoryError``, or a ``RuntimeError`` from a library that reports an allocation failure
in its own words, such as cuBLAS's ``CUBLAS_STATUS_ALLOC_FAILED``) the error is caught, its first
line kept, and memory is given back
*after* the ``except`` block has ended: while an exception is being handled, its traceback holds
the failed step's stack frames, and with them every tensor the step had made. Then the memory
reader is called, so each attempt records what was left afterwards (the number that shows
whether anything leaked).

``largest_batch(step)`` doubles the batch from ``start`` until a step fails (or ``max_batch`` is
reached), halves it instead if ``start`` already fails, then bisects between the largest size
that fitted and the smallest that failed, in steps of ``multiple_of``.

Both take the step function and the memory reader as arguments, so they run anywhere: unit tests
simulate an out-of-memory error by raising ``torch.OutOfMemoryError`` themselves.

>>> search = largest_batch(lambda bs: train_step(model, optimizer, make_batch(bs)), multiple_of=8)
>>> search.largest, search.to_frame()
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from helpers import cleanup, measure


def allocated_mib() -> float:
    """torch's allocated CUDA memory in MiB (``measure.allocator_mib``); NaN without CUDA.

    The default memory reader of ``try_batch`` and ``largest_batch`` (chapter 3 also reads its
    baseline with it).

    Introduced in chapter 3, section 3.2.
    """
    return measure.allocator_mib()["allocated_mib"]


def short_error(message: str) -> str:
    """The part of an out-of-memory message worth a table cell: "Tried to allocate 2.00 GiB", or its first line.

    Introduced in chapter 3, section 3.2.
    """
    found = re.search(r"Tried to allocate [\d.]+ [KMGT]?i?B", message)
    if found:
        return found.group(0)
    first = message.strip().splitlines()[0] if message.strip() else "out of memory"
    return first[:80]


@dataclass(frozen=True)
class Attempt:
    """One try: did ``batch_size`` fit, what the step returned, memory after cleanup, the error.

    Introduced in chapter 3, section 3.1.
    """

    batch_size: int
    fits: bool
    memory_after_mib: float
    value: Any = None
    error: str | None = None


def try_batch(
    step: Callable[[int], Any], batch_size: int, *, memory_mib: Callable[[], float] = allocated_mib
) -> Attempt:
    """Run ``step(batch_size)``; when it runs out of memory, record the failure instead of raising.

    Out of memory is what ``measure.is_out_of_memory`` recognises (``torch.OutOfMemoryError``, or a
    ``RuntimeError`` reporting a library's allocation failure); any other exception propagates. After the call, successful or not, garbage is collected, the
    CUDA cache is emptied and ``memory_mib()`` is read into ``Attempt.memory_after_mib``.

    Introduced in chapter 3, section 3.1.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    value, error = None, None
    try:
        value = step(batch_size)
    except RuntimeError as err:  # torch.OutOfMemoryError is one
        if not measure.is_out_of_memory(err):
            raise
        error = short_error(str(err))
    # The except block is over: Python has dropped ``err`` and its traceback, so the failed step's
    # frames (and the tensors they held) can be freed now, not before.
    cleanup.collect()
    return Attempt(batch_size, error is None, memory_mib(), value if error is None else None, error)


@dataclass
class Search:
    """The outcome of ``largest_batch``: the largest size that fitted and every attempt, in order.

    Introduced in chapter 3, section 3.2.
    """

    largest: int | None
    attempts: list[Attempt] = field(default_factory=list)
    hit_limit: bool = False  # True when ``max_batch`` fitted: the card may hold more

    def to_frame(self) -> pd.DataFrame:
        """One row per attempt: batch size, result, memory after cleanup (MiB), error."""
        return pd.DataFrame(
            {
                "batch size": [a.batch_size for a in self.attempts],
                "result": ["fits" if a.fits else "out of memory" for a in self.attempts],
                "allocated after cleanup (MiB)": [a.memory_after_mib for a in self.attempts],
                "error": [a.error or "" for a in self.attempts],
            },
            index=pd.RangeIndex(1, len(self.attempts) + 1, name="attempt"),
        )


def largest_batch(
    step: Callable[[int], Any],
    *,
    start: int = 1,
    max_batch: int | None = None,
    multiple_of: int = 1,
    memory_mib: Callable[[], float] = allocated_mib,
) -> Search:
    """The largest batch size (a multiple of ``multiple_of``) for which ``step`` does not run out of memory.

    Doubling from ``start`` finds a size that fails (or stops at ``max_batch``); if ``start`` fails,
    halving finds one that fits (``largest`` is None when even ``multiple_of`` fails). Bisection
    then narrows the gap. Each size is tried once, with ``try_batch``; memory use is assumed to
    grow with the batch size.

    Introduced in chapter 3, section 3.2.
    """
    if multiple_of < 1:
        raise ValueError(f"multiple_of must be at least 1, got {multiple_of}")
    if start < 1 or start % multiple_of:
        raise ValueError(f"start must be a positive multiple of {multiple_of}, got {start}")
    if max_batch is not None and max_batch < start:
        raise ValueError(f"max_batch ({max_batch}) must be at least start ({start})")
    search = Search(largest=None)

    def fits(bs: int) -> bool:
        attempt = try_batch(step, bs, memory_mib=memory_mib)
        search.attempts.append(attempt)
        return attempt.fits

    lo, hi = None, None  # largest size known to fit, smallest known to fail
    if fits(start):
        lo = start
        while hi is None:
            nxt = lo * 2 if max_batch is None else min(lo * 2, max_batch // multiple_of * multiple_of)
            if nxt <= lo:
                search.hit_limit = True
                break
            if fits(nxt):
                lo = nxt
            else:
                hi = nxt
    else:
        hi = start
        while lo is None and hi > multiple_of:
            nxt = max(multiple_of, hi // 2 // multiple_of * multiple_of)
            if fits(nxt):
                lo = nxt
            else:
                hi = nxt
        if lo is None:
            return search
    while hi is not None and hi - lo > multiple_of:
        mid = (lo + hi) // 2 // multiple_of * multiple_of
        if fits(mid):
            lo = mid
        else:
            hi = mid
    search.largest = lo
    return search
