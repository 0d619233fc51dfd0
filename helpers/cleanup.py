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


def _drop_from_history(namespace: dict[str, Any], dropped: set[int]) -> None:
    """Without a shell: remove every output-history entry that points at a dropped object."""
    history = namespace.get("Out")
    if isinstance(history, dict):
        for key in [k for k, v in history.items() if id(v) in dropped]:
            del history[key]
    for key in [k for k, v in namespace.items() if _OUTPUT_NAME.fullmatch(k) and id(v) in dropped]:
        if key in ("_", "__", "___"):
            namespace[key] = None
        else:
            del namespace[key]


def free(namespace: dict[str, Any], *names: str) -> Freed:
    """Delete ``names`` from ``namespace`` (pass ``globals()``), collect garbage, empty the CUDA cache.

    In a notebook the objects are deleted with IPython's own ``del_var``, which also clears every
    output-history reference to them (``Out``, ``_``, ``_3``, the last result). Names that are not
    in the namespace are ignored, so a cleanup cell can run twice. ``Freed.still_alive`` names the
    objects that something else still holds.

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
        if name not in namespace:  # an earlier name was the same object; del_var removed it already
            continue
        if shell is not None:
            shell.del_var(name, by_name=False)  # also clears Out, _, _N and the last result
        else:
            del namespace[name]
    if shell is None:
        _drop_from_history(namespace, dropped)
    del dropped
    collect()
    after = measure.allocator_mib()
    alive = tuple(name for name, ref in watch.items() if ref() is not None)
    return Freed(
        removed, before["allocated_mib"], after["allocated_mib"], before["reserved_mib"], after["reserved_mib"], alive
    )
