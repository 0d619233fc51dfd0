"""Memory over time: PyTorch's allocator history, as a figure and as the interactive page.

Introduced in chapter 8, section 8.4.

``record()`` switches on ``torch.cuda.memory._record_memory_history`` (every allocation and free, with
the Python stack that made it) for the code inside the ``with`` block and keeps the snapshot::

    with memsnap.record() as rec:
        train_step()
    df = memsnap.timeline(rec)        # allocated bytes after every allocator event, by origin
    fig = memsnap.plot(rec)           # the picture PyTorch's memory_viz draws, as a matplotlib figure
    memsnap.save_html(rec, "traces/step_memory.html")   # the interactive page, for a browser

Each allocation is put in a category by the Python stack that made it: ``optimizer`` (code in
``torch/optim``), ``backward`` (made by the autograd engine, which runs without Python frames, or
under a ``backward`` frame), ``forward`` (under a module's ``forward``) and ``other``. Memory that was
already allocated when recording began is the ``before recording`` band at the bottom.

The figure's x axis counts allocator events, not seconds: the order of allocations and frees is
what shapes the curve. The underscore names are PyTorch's own (documented in "Understanding CUDA
Memory Usage"); they have been stable since PyTorch 2.1.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import pandas as pd
import torch

from helpers.measure import GIB, PHASES
from helpers.profiler import PHASE_COLORS
from helpers.run_profile import require_cuda

ORIGINS = ("before recording", *PHASES, "other")  # a step's phases as measure.PHASES names them
ORIGIN_COLORS = {"before recording": "#B0B0B0", **PHASE_COLORS, "other": "#8172B3"}


@dataclass
class Recording:
    """What ``record`` captured: the allocator snapshot and the allocated bytes when recording began.

    Introduced in chapter 8, section 8.4.
    """

    device: int
    baseline_bytes: int = 0
    snapshot: dict[str, Any] = field(default_factory=dict)

    @property
    def trace(self) -> list[dict[str, Any]]:
        traces = self.snapshot.get("device_traces", [])
        return traces[self.device] if self.device < len(traces) else []


@contextmanager
def record(device: int | None = None, *, max_entries: int = 1_000_000) -> Iterator[Recording]:
    """Record every allocation and free on ``device`` (default: the current one) inside the block.

    Introduced in chapter 8, section 8.4.
    """
    require_cuda("memsnap.record")
    dev = torch.cuda.current_device() if device is None else device
    torch.cuda.synchronize(dev)
    rec = Recording(device=dev, baseline_bytes=torch.cuda.memory_allocated(dev))
    try:  # start from an empty history (clear_history exists from PyTorch 2.4 on)
        torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python", clear_history=True)
    except TypeError:
        torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    try:
        yield rec
    finally:
        torch.cuda.synchronize(dev)
        rec.snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)


def origin(frames: list[dict[str, Any]]) -> str:
    """The category of an allocation, from the Python frames (innermost first) that made it.

    Introduced in chapter 8, section 8.4.
    """
    if not frames:
        return "backward"  # the autograd engine's threads run no Python code
    files = [str(f.get("filename", "")) for f in frames]
    names = [str(f.get("name", "")) for f in frames]
    if any("torch/optim" in f or "torch\\optim" in f for f in files):
        return "optimizer"
    if any(n == "backward" or n.endswith("_backward") for n in names):
        return "backward"
    if any(n in ("forward", "_call_impl", "_wrapped_call_impl") for n in names):
        return "forward"
    return "other"


def timeline(rec: Recording) -> pd.DataFrame:
    """Allocated bytes after each allocator event, split by the origin of the live allocations.

    One row per ``alloc`` or ``free_completed`` event of the recording; columns are the ``ORIGINS``
    (bytes), ``total``, and ``event`` (``"alloc <origin>"`` or ``"free <origin>"``: what this event did).
    A block allocated before recording and freed during it is subtracted from ``before recording``.

    Introduced in chapter 8, section 8.4.
    """
    live: dict[int, tuple[str, int]] = {}  # address -> (origin, size)
    current = dict.fromkeys(ORIGINS, 0)
    current["before recording"] = rec.baseline_bytes
    rows = []
    for entry in rec.trace:
        action = entry.get("action")
        if action == "alloc":
            cat = origin(entry.get("frames", []))
            live[entry["addr"]] = (cat, entry["size"])
            current[cat] += entry["size"]
            event = f"alloc {cat}"
        elif action == "free_completed":
            cat, size = live.pop(entry["addr"], ("before recording", entry["size"]))
            current[cat] -= size
            event = f"free {cat}"
        else:
            continue
        rows.append({**current, "event": event})
    df = pd.DataFrame(rows, columns=[*ORIGINS, "event"])
    df.insert(len(ORIGINS), "total", df[list(ORIGINS)].sum(axis=1))
    df.index.name = "allocator event"
    return df


def peak_event(rec: Recording) -> pd.Series:
    """The row of ``timeline`` at the peak: its bytes by origin and the allocation that made the peak.

    Introduced in chapter 8, section 8.4.
    """
    df = timeline(rec)
    if df.empty:
        raise ValueError("the recording holds no allocations")
    return df.loc[df["total"].idxmax()]


def peak_bytes(rec: Recording) -> int:
    """The highest allocated total over the recording (equals the allocator's peak if it was reset at the start).

    Introduced in chapter 8, section 8.4.
    """
    df = timeline(rec)
    return int(df["total"].max()) if len(df) else rec.baseline_bytes


def survivors(rec: Recording, *, top: int = 10) -> pd.DataFrame:
    """Allocations made during the recording and still alive at its end, grouped by where they were made.

    Two columns name the place: ``allocated in`` is the innermost Python frame (often a library's
    ``forward``), ``called from`` the innermost frame of the reader's own code (a cell, a hook, a
    training loop), outside the files of PyTorch, transformers and other installed packages. After a
    training step that should leave nothing behind, any row here is a leak suspect.

    Introduced in chapter 8, section 8.4.
    """
    live: dict[int, tuple[str, str, int]] = {}
    for entry in rec.trace:
        if entry.get("action") == "alloc":
            frames = entry.get("frames", [])
            live[entry["addr"]] = (_where(frames[0]) if frames else "autograd engine (no Python frame)",
                                   _user_site(frames), entry["size"])
        elif entry.get("action") == "free_completed":
            live.pop(entry["addr"], None)
    df = pd.DataFrame(list(live.values()), columns=["allocated in", "called from", "bytes"])
    if df.empty:
        return pd.DataFrame(columns=["allocations", "MiB"], index=pd.MultiIndex.from_arrays(
            [[], []], names=["allocated in", "called from"]))
    out = df.groupby(["allocated in", "called from"])["bytes"].agg(allocations="size", MiB="sum")
    out["MiB"] = out["MiB"] / 2**20
    return out.sort_values("MiB", ascending=False).head(top)


_LIBRARY_PATHS = ("site-packages", "dist-packages", "/torch/", "/transformers/", "<frozen")


def _where(frame: dict[str, Any]) -> str:
    """``function (file:line)``; a notebook cell's file (a temporary ``NNNN.py``) is shown as "a cell"."""
    path = Path(str(frame.get("filename", "")))
    cell = path.stem.isdigit() or "ipykernel" in str(path)
    return f"{frame.get('name', '?')} ({'a cell' if cell else path.name}, line {frame.get('line', '?')})"


def _user_site(frames: list[dict[str, Any]]) -> str:
    for f in frames:
        if not any(lib in str(f.get("filename", "")) for lib in _LIBRARY_PATHS):
            return _where(f)
    return "inside libraries (no user frame)" if frames else "autograd engine (no Python frame)"


def plot(rec: Recording, *, title: str | None = None, ax: plt.Axes | None = None) -> plt.Figure:
    """Stacked areas of allocated memory (GiB) by origin, over allocator events, with the peak marked.

    Introduced in chapter 8, section 8.4.
    """
    df = timeline(rec)
    if df.empty:
        raise ValueError("the recording holds no allocations")
    if ax is None:
        fig, ax = plt.subplots(figsize=(9, 4))
    else:
        fig = ax.figure
    cols = [c for c in ORIGINS if (df[c] != 0).any()]
    ax.stackplot(df.index, *(df[c] / GIB for c in cols), labels=cols, colors=[ORIGIN_COLORS[c] for c in cols],
                 linewidth=0)
    peak_at = int(df["total"].idxmax())
    peak = df["total"].max() / GIB
    ax.annotate(f"peak {peak:.2f} GiB", (peak_at, peak), xytext=(0, 6), textcoords="offset points", ha="center")
    ax.set_xlabel("allocator event (allocations and frees, in order)")
    ax.set_ylabel("allocated (GiB)")
    ax.set_xlim(0, len(df) - 1)
    ax.set_ylim(0, peak * 1.12)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(title or "allocated memory over one step, by where it was allocated")
    fig.tight_layout()
    return fig


def save_html(rec: Recording, path: str | Path) -> Path:
    """Write PyTorch's interactive memory timeline (``torch.cuda._memory_viz.trace_plot``) to ``path``.

    The page loads its viewer script from the web, so open it in a browser with internet access. The
    raw snapshot is written beside it (``.pickle``): drag it onto https://pytorch.org/memory_viz.

    Introduced in chapter 8, section 8.4.
    """
    from torch.cuda import _memory_viz

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(_memory_viz.trace_plot(rec.snapshot), encoding="utf-8")
    with open(path.with_suffix(".pickle"), "wb") as f:
        pickle.dump(rec.snapshot, f)
    return path
