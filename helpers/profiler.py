"""Where a step's time goes: ``torch.profiler`` reduced to the tables and the picture the book reads.

Introduced in chapter 8, section 8.2.

``profile(step, device=...)`` runs ``step()`` under ``torch.profiler`` (a wait/warm-up/active
schedule, CPU and CUDA activities), writes the Chrome/Perfetto trace, reads it back and returns a
``StepProfile``:

- ``categories()``: GPU time per kind of kernel (GEMM, attention, element-wise / normalisation,
  optimizer, communication, memcpy / memset, other) and its share; the rows sum to the GPU time;
- ``phases()``: host time and GPU time of each ``record_function`` range the step marks
  (``forward``, ``backward``, ``optimizer``); a kernel belongs to the range in which the CPU
  launched it;
- ``gpu_busy``: the fraction of the step's wall time during which some kernel or copy ran (the
  union of their intervals, so overlapping streams are not counted twice);
- ``kernels_per_step`` and ``launches_per_step``: GPU operations run (kernels, copies, memsets), and
  launch calls the CPU made (one CUDA-graph launch runs many kernels);
- ``top_kernels()``: the kernels that took the most GPU time;
- ``trace_path``: open it in https://ui.perfetto.dev or ``chrome://tracing``.

``timeline(prof)`` draws the trace with matplotlib (one row for the CPU's phases and operators, one
per CUDA stream), so the gaps in which the GPU waits are visible without a trace viewer.

On a CPU the same calls work with CPU activities only: the category table then splits CPU
operator self time (time in an operator minus the operators it called), and ``gpu_busy`` is None.

The one reader of Chrome traces in the package is here (``read_trace``), with the one interval algebra
(``union``, ``union_length``, ``intersection_length``). Chapter 7 reads communication kernels out of a
rank's trace with it: ``communication_from_trace`` (per collective: calls, bytes, kernel time and the
bandwidths that implies) and ``communication_overlap`` (how much of that time ran beside compute).
"""

from __future__ import annotations

import gzip
import json
import re
import tempfile
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import torch
from torch.profiler import ProfilerActivity, schedule

from helpers.estimates import COLLECTIVES, bus_factor
from helpers.measure import PHASES

CATEGORIES = (
    "GEMM",
    "attention",
    "element-wise / normalisation",
    "optimizer",
    "communication",
    "memcpy / memset",
    "other",
)
CATEGORY_COLORS = {
    "GEMM": "#4C72B0",
    "attention": "#8172B3",
    "element-wise / normalisation": "#DD8452",
    "optimizer": "#55A868",
    "communication": "#C44E52",
    "memcpy / memset": "#937860",
    "other": "#8C8C8C",
}
PHASE_COLORS = dict(zip(PHASES, ("#4C72B0", "#DD8452", "#55A868"), strict=True))  # memsnap's too
DEFAULT_PHASES = PHASES  # the step's phases as measure.PHASES names them (steps.train_step marks them)
GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
# CUDA runtime/driver calls that start work on the GPU.
LAUNCH_CALLS = re.compile(r"^(cudaLaunchKernel|cudaLaunchKernelExC|cuLaunchKernel|cuLaunchKernelEx|cudaLaunchCooperativeKernel|cudaGraphLaunch|cudaMemcpyAsync|cudaMemsetAsync|cuMemcpy|cuMemset)")

# Kernel names, matched in this order (names differ between GPU generations and libraries: cuBLAS's
# Hopper kernels are called nvjet_*, CUTLASS's sm90_xmma_*, older ones *gemm*; Inductor's Triton GEMM
# templates, from torch.compile(mode="max-autotune"), triton_tem_fused_mm_0 or ..._addmm_gelu_1, and its
# generated element-wise and reduction kernels triton_poi_*, triton_red_*, triton_per_*).
# Short operator words (add, cat, exp, index, norm, ...) count only as whole words of a kernel name: a
# word starts after a non-letter or with a capital, and ends before anything but a lower-case letter
# (CUDAFunctor_add, CatArrayBatchedCopy, indexSelectLargeIndex, DeviceReduceKernel), so that an unknown
# kernel that merely contains them (concatenate, expand, address, normalize) stays "other".
_WORD = r"(?:(?<!(?-i:[a-z]))|(?=(?-i:[A-Z])))(?:{})(?!(?-i:[a-z]))"
_KERNEL_RULES = (  # (NCCL kernels are ``communication`` before any rule: see kernel_category)
    ("attention", re.compile(r"flash|fmha|attention|sdpa|cudnn::fusion", re.I)),
    ("GEMM", re.compile(
        r"gemm|gemv|nvjet|xmma|cutlass|cublas|matmul|splitkreduce|dot_kernel|triton_tem|"
        + _WORD.format(r"mm_\d+|mm|addmm|bmm|baddbmm"), re.I)),
    ("element-wise / normalisation", re.compile(
        r"elementwise|vectorized|unrolled|reduce_kernel|softmax|layer_?norm|batch_?norm|group_?norm|rms_?norm|"
        r"dropout|embedding|cross_entropy|multi_tensor_apply|foreach|gammabeta|philox|triton_(?:poi|red|per)_|"
        + _WORD.format(r"reduce|norm|gelu|silu|relu|tanh|copy|fill|cat|index|gather|scatter|nll|loss|where|pow|"
                       r"mul|add|div|sqrt|exp|arange|triu|tril|cast|sort"), re.I)),
)
# CPU operators (for CPU-only runs), matched in this order.
_CPU_OP_RULES = (
    ("communication", re.compile(r"c10d|all_reduce|allreduce|broadcast|reduce_scatter|all_gather", re.I)),
    ("attention", re.compile(r"scaled_dot_product|flash|attention", re.I)),
    ("GEMM", re.compile(r"^aten::(mm|bmm|addmm|addbmm|baddbmm|matmul|linear|_addmm_activation)$")),
    ("memcpy / memset", re.compile(r"^aten::(copy_|to|_to_copy|zero_|fill_)$")),
    ("element-wise / normalisation", re.compile(r"^aten::")),
)


def kernel_category(name: str, *, cat: str = "kernel", phase: str | None = None) -> str:
    """The category of one GPU event: by its trace category, the phase that launched it, its name.

    Copies and memsets are ``memcpy / memset``; NCCL's kernels ``communication``; anything launched
    inside the ``optimizer`` range is ``optimizer``; otherwise the kernel name decides (see
    ``_KERNEL_RULES``: cuBLAS, CUTLASS and Inductor's Triton templates are GEMM; PyTorch's and
    Inductor's point-wise and reduction kernels element-wise / normalisation); unknown names are
    ``other``.

    Introduced in chapter 8, section 8.2.
    """
    if cat in ("gpu_memcpy", "gpu_memset") or name.startswith(("Memcpy", "Memset")):
        return "memcpy / memset"
    if re.search(r"nccl", name, re.I):
        return "communication"
    return _by_rules(name, phase, _KERNEL_RULES)


def _by_rules(name: str, phase: str | None, rules: tuple[tuple[str, re.Pattern], ...]) -> str:
    """``optimizer`` inside the optimizer phase, else the first rule whose pattern matches, else ``other``."""
    if phase == "optimizer":
        return "optimizer"
    return next((category for category, pattern in rules if pattern.search(name)), "other")


def cpu_op_category(name: str, *, phase: str | None = None) -> str:
    """The category of one CPU operator (used when there is no GPU).

    Introduced in chapter 8, section 8.2.
    """
    return _by_rules(name, phase, _CPU_OP_RULES)


def union(intervals: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The ``(start, end)`` intervals merged where they overlap or touch: sorted and disjoint.

    Introduced in chapter 8, section 8.2.
    """
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if end < start:
            raise ValueError(f"interval ends before it starts: {(start, end)}")
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def union_length(intervals: Sequence[tuple[float, float]]) -> float:
    """Total length covered by ``(start, end)`` intervals, overlaps counted once.

    Introduced in chapter 8, section 8.2.
    """
    return sum(end - start for start, end in union(intervals))


def intersection_length(a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]) -> float:
    """Total length covered by both ``a`` and ``b`` (each a list of intervals, overlaps counted once).

    Introduced in chapter 7, section 7.7 (hidden communication: ``communication_overlap``).
    """
    a, b = union(a), union(b)
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _self_times(ops: pd.DataFrame) -> pd.Series:
    """Self time of nested CPU operators (per thread): duration minus direct children's durations."""
    self_us = ops["dur_us"].astype(float).copy()
    for _, group in ops.sort_values(["tid", "ts_us", "dur_us"], ascending=[True, True, False]).groupby("tid"):
        stack: list[tuple[int, float]] = []  # (index, end)
        for idx, ts, dur in zip(group.index, group["ts_us"], group["dur_us"], strict=True):
            while stack and ts >= stack[-1][1] - 1e-9:
                stack.pop()
            if stack:
                self_us[stack[-1][0]] -= dur
            stack.append((idx, ts + dur))
    return self_us.clip(lower=0.0)


def read_trace(path: str | Path) -> list[dict]:
    """The ``traceEvents`` of a Chrome trace file that ``torch.profiler`` wrote, gzipped (``.gz``) or not.

    Introduced in chapter 8, section 8.2.
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return json.load(f)["traceEvents"]


@dataclass
class StepProfile:
    """The reduced trace of ``steps`` profiled steps (times in microseconds from the first step's start).

    Introduced in chapter 8, section 8.2.
    """

    events: pd.DataFrame  # one row per complete ("X") event: name, cat, ts_us, dur_us, tid, stream, phase, step
    windows_us: list[tuple[float, float]]  # each profiled step's (start, end)
    trace_path: Path | None
    device: str

    @property
    def steps(self) -> int:
        return len(self.windows_us)

    @property
    def on_gpu(self) -> bool:
        return bool((self.events["cat"].isin(GPU_CATS)).any())

    @property
    def gpu_events(self) -> pd.DataFrame:
        return self.events[self.events["cat"].isin(GPU_CATS)]

    @property
    def cpu_ops(self) -> pd.DataFrame:
        return self.events[self.events["cat"] == "cpu_op"]

    @property
    def wall_ms(self) -> float:
        """Wall time per step (from the step's start on the CPU to its end, the synchronise included)."""
        return sum(e - s for s, e in self.windows_us) / self.steps / 1e3

    @property
    def gpu_ms(self) -> float:
        """Summed duration of GPU kernels and copies per step (concurrent streams add up)."""
        return float(self.gpu_events["dur_us"].sum()) / self.steps / 1e3

    def busy_us_per_step(self) -> list[float]:
        """Time (µs) during which some kernel or copy ran, per profiled step (union of their intervals)."""
        g = self.gpu_events
        busy = []
        for start, end in self.windows_us:
            starts = g["ts_us"].clip(lower=start, upper=end)
            ends = (g["ts_us"] + g["dur_us"]).clip(lower=start, upper=end)
            busy.append(union_length(list(zip(starts, ends, strict=True))))
        return busy

    @property
    def gpu_busy(self) -> float | None:
        """Fraction of the profiled steps' wall time during which some kernel or copy ran; None without a GPU.

        The profiler slows the host, so for a host-bound step this is lower than without it; ``timing.time_it``
        divides the busy time by the unprofiled wall time instead.
        """
        if not self.on_gpu:
            return None
        return sum(self.busy_us_per_step()) / sum(e - s for s, e in self.windows_us)

    @property
    def kernels_per_step(self) -> int | None:
        """GPU operations per step: kernels, copies and memsets (None without a GPU)."""
        if not self.on_gpu:
            return None
        return round(len(self.gpu_events) / self.steps)

    @property
    def launches_per_step(self) -> int | None:
        if not self.on_gpu:
            return None
        runtime = self.events[self.events["cat"].isin(["cuda_runtime", "cuda_driver"])]
        return round(runtime["name"].str.match(LAUNCH_CALLS).sum() / self.steps)

    def _timed_rows(self, use_phases: bool = True) -> tuple[pd.DataFrame, str]:
        """GPU events with their durations, or CPU operators with self times on a CPU run."""
        if self.on_gpu:
            g = self.gpu_events.copy()
            phases = g["phase"] if use_phases else [None] * len(g)
            g["category"] = [kernel_category(n, cat=c, phase=p) for n, c, p in zip(g["name"], g["cat"], phases, strict=True)]
            g["time_us"] = g["dur_us"]
            return g, "GPU"
        ops = self.cpu_ops.copy()
        ops["time_us"] = _self_times(ops) if len(ops) else 0.0
        ops["category"] = [cpu_op_category(n, phase=p) for n, p in zip(ops["name"], ops["phase"], strict=True)]
        return ops, "CPU self"

    def categories(self, *, use_phases: bool = True) -> pd.DataFrame:
        """Time per category per step (ms) and its share; the rows add up to the total (GPU or CPU self) time.

        With ``use_phases=False`` kernels are sorted by name only (the optimizer's element-wise kernels
        then count as element-wise): the way to compare with a step whose phases the profiler cannot
        see, such as a replayed CUDA graph.

        Introduced in chapter 8, section 8.2.
        """
        rows, what = self._timed_rows(use_phases)
        per = rows.groupby("category")["time_us"].sum().reindex(CATEGORIES, fill_value=0.0) / self.steps / 1e3
        total = per.sum()
        return pd.DataFrame({f"{what} time (ms/step)": per, "share": per / total if total > 0 else per})

    def phases(self) -> pd.DataFrame:
        """Per ``record_function`` phase: host time (the range on the CPU) and GPU time of its kernels (ms/step)."""
        ann = self.events[(self.events["cat"] == "user_annotation") & (self.events["name"] == self.events["phase"])]
        host = ann.groupby("phase")["dur_us"].sum() / self.steps / 1e3
        out = pd.DataFrame({"host time (ms/step)": host})
        if self.on_gpu:
            out["GPU time (ms/step)"] = self.gpu_events.groupby("phase")["dur_us"].sum() / self.steps / 1e3
            out["GPU ops per step"] = self.gpu_events.groupby("phase").size() / self.steps
        order = [p for p in DEFAULT_PHASES if p in out.index] + [p for p in out.index if p not in DEFAULT_PHASES]
        return out.reindex(order).fillna(0.0)

    def top_kernels(self, n: int = 10, *, width: int = 60) -> pd.DataFrame:
        """The ``n`` kernels (or CPU operators) with the most time, names shortened to ``width`` characters."""
        rows, what = self._timed_rows()
        grouped = rows.groupby("name").agg(
            calls=("time_us", "size"), time_us=("time_us", "sum"), category=("category", "first"))
        grouped = grouped.sort_values("time_us", ascending=False).head(n)
        total = rows["time_us"].sum()
        return pd.DataFrame(
            {
                "category": grouped["category"].to_numpy(),
                "calls per step": grouped["calls"].to_numpy() / self.steps,
                f"{what} time (ms/step)": grouped["time_us"].to_numpy() / self.steps / 1e3,
                "share": grouped["time_us"].to_numpy() / total if total > 0 else 0.0,
            },
            index=pd.Index([_short(k, width) for k in grouped.index], name="kernel" if what == "GPU" else "operator"),
        )

    def summary(self) -> dict[str, float | int | None]:
        """Wall time, GPU time, GPU-busy and launches per step, as one table row."""
        return {
            "wall (ms/step)": self.wall_ms,
            "GPU kernel time (ms/step)": self.gpu_ms if self.on_gpu else None,
            "GPU busy": self.gpu_busy,
            "GPU ops per step": self.kernels_per_step,
            "launch calls per step": self.launches_per_step,
        }


def _short(name: str, width: int) -> str:
    """A kernel name without ``void``, namespaces and argument lists, cut to ``width`` characters."""
    name = re.sub(r"\s+", " ", name)
    name = re.sub(r"^void ", "", name)
    name = re.sub(r"(at::native::|at::cuda::|at_cuda_detail::|\(anonymous namespace\)::|c10::)", "", name)
    name = re.sub(r"\((?:[^()]|\([^()]*\))*\)$", "", name)  # the parameter list
    return name if len(name) <= width else name[: width - 1] + "…"


def from_trace(path: str | Path, *, phases: Sequence[str] = DEFAULT_PHASES, device: str = "cuda") -> StepProfile:
    """Reduce a Chrome trace written by ``torch.profiler`` to a ``StepProfile``.

    The profiled steps are the ``ProfilerStep#N`` ranges; each kernel is assigned to the phase (one
    of ``phases``) during which the CPU launched it, through the launch's correlation id.

    Introduced in chapter 8, section 8.2.
    """
    path = Path(path)
    raw = [e for e in read_trace(path) if e.get("ph") == "X"]
    if not raw:
        raise ValueError(f"{path} holds no complete events: was anything profiled?")
    steps = sorted(
        (e["ts"], e["ts"] + e["dur"]) for e in raw if e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep#")
    )
    if not steps:
        raise ValueError(f"{path} has no ProfilerStep ranges: call prof.step() after each step")
    t0 = steps[0][0]
    ranges = sorted(
        (e["ts"], e["ts"] + e["dur"], e["name"]) for e in raw if e.get("cat") == "user_annotation" and e["name"] in phases
    )
    launch_ts = {
        e["args"]["correlation"]: e["ts"]
        for e in raw if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }

    def phase_at(ts: float) -> str | None:
        inside = [name for start, end, name in ranges if start <= ts <= end]
        return inside[0] if inside else None  # the outermost range that started first

    def step_at(ts: float) -> int | None:
        for i, (start, end) in enumerate(steps):
            if start <= ts <= end:
                return i
        return None

    rows = []
    for e in raw:
        cat = e.get("cat", "")
        if cat in GPU_CATS:
            when = launch_ts.get(e.get("args", {}).get("correlation"), e["ts"])
        else:
            when = e["ts"]
        phase = e["name"] if cat == "user_annotation" and e["name"] in phases else phase_at(when)
        rows.append(
            {
                "name": e["name"],
                "cat": cat,
                "ts_us": e["ts"] - t0,
                "dur_us": float(e.get("dur", 0.0)),
                "tid": e.get("tid"),
                "stream": e.get("args", {}).get("stream"),
                "phase": phase,
                "step": step_at(when),
            }
        )
    events = pd.DataFrame(rows)
    # Keep what belongs to the profiled steps (GPU work launched in a step may end after it: kept).
    events = events[events["step"].notna() | events["cat"].isin(["Trace"])].reset_index(drop=True)
    # A step's window runs from its first event to the end of its last one (the final synchronise, or
    # GPU work that ends after the CPU's range): the profiler's own bookkeeping at the step boundary
    # is left out, which matters for short steps.
    inner = events[~(events["cat"].eq("user_annotation") & events["name"].str.startswith("ProfilerStep#"))]
    inner = inner.assign(end=inner["ts_us"] + inner["dur_us"]).groupby("step").agg(start=("ts_us", "min"), end=("end", "max"))
    windows = [
        (float(inner.loc[i, "start"]), float(inner.loc[i, "end"])) if i in inner.index else (s - t0, e - t0)
        for i, (s, e) in enumerate(steps)
    ]
    return StepProfile(events, windows, path, device)


def profile(
    step: Callable[[], object],
    *,
    device: str | torch.device,
    wait: int = 0,
    warmup: int = 1,
    active: int = 1,
    trace_path: str | Path | None = None,
    phases: Sequence[str] = DEFAULT_PHASES,
) -> StepProfile:
    """Run ``step()`` ``wait + warmup + active`` times under ``torch.profiler``; reduce the ``active`` ones.

    ``step`` marks its phases with ``torch.profiler.record_function("forward")`` (and ``"backward"``,
    ``"optimizer"``) for the phase table; the device is synchronised at the end of every step so each
    step's GPU work stays inside it. The trace is written to ``trace_path`` (``.json`` or ``.json.gz``;
    default: a temporary file) and can be opened in Perfetto.

    >>> prof = profile(train_step, device="cuda", warmup=2, active=3, trace_path="traces/step.json.gz")
    >>> prof.categories(), prof.gpu_busy, prof.kernels_per_step

    Introduced in chapter 8, section 8.2.
    """
    if wait < 0 or warmup < 0 or active < 1:
        raise ValueError(f"need wait >= 0, warmup >= 0 and active >= 1, got {wait}, {warmup}, {active}")
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if trace_path is None:
        trace_path = Path(tempfile.mkdtemp(prefix="gpubook-trace-")) / "trace.json.gz"
    trace_path = Path(trace_path)
    trace_path.parent.mkdir(parents=True, exist_ok=True)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    sync()
    with warnings.catch_warnings():  # the profiler warns that each cycle clears its events: that is the intent
        warnings.filterwarnings("ignore", message=".*Profiler clears events")
        with torch.profiler.profile(
            activities=activities,
            schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=1),
            on_trace_ready=lambda p: p.export_chrome_trace(str(trace_path)),
        ) as prof:
            for _ in range(wait + warmup + active):
                step()
                sync()
                prof.step()
    return from_trace(trace_path, phases=phases, device=str(dev))


def timeline(prof: StepProfile, *, step: int = 0, title: str | None = None, ax: plt.Axes | None = None,
             bins: int = 200) -> plt.Figure:
    """Draw one profiled step: the CPU's phases and operators above, the GPU below.

    Every GPU operation is drawn at its true width, coloured by category (thousands of microsecond
    kernels on a 100 ms axis are thin lines); the row below it shows, in ``bins`` slices of the step,
    the fraction of each slice during which the GPU was busy, so idle time is visible at any zoom.
    Times in milliseconds from the step's start.

    Introduced in chapter 8, section 8.2.
    """
    if not 0 <= step < prof.steps:
        raise ValueError(f"step must be in 0..{prof.steps - 1}, got {step}")
    start, end = prof.windows_us[step]
    span_ms = (end - start) / 1e3
    ev = prof.events[prof.events["step"] == step]
    if ax is None:
        fig, ax = plt.subplots(figsize=(11, 3.6))
    else:
        fig = ax.figure
    rows: list[str] = []

    def row(label: str) -> int:
        rows.append(label)
        return len(rows) - 1

    def bars(y: int, frame: pd.DataFrame, colors: Sequence[str], height: float = 0.8) -> None:
        spans = [((t - start) / 1e3, d / 1e3) for t, d in zip(frame["ts_us"], frame["dur_us"], strict=True)]
        ax.broken_barh(spans, (y - height / 2, height), facecolors=list(colors), linewidth=0)

    ann = ev[(ev["cat"] == "user_annotation") & (ev["name"] == ev["phase"])]
    y = row("CPU: phases")
    bars(y, ann, [PHASE_COLORS.get(p, "#8C8C8C") for p in ann["phase"]])
    for _, a in ann.iterrows():
        ax.text((a["ts_us"] - start + a["dur_us"] / 2) / 1e3, y, a["name"], ha="center", va="center", fontsize=8, color="white")
    ops = ev[ev["cat"] == "cpu_op"]
    if len(ops):
        marks = ev[ev["cat"] == "user_annotation"]  # record_function ranges run on the main thread
        main_tid = marks["tid"].iloc[0] if len(marks) else ops["tid"].mode().iloc[0]
        for tid, label in ((main_tid, "CPU: operators (main thread)"),) + tuple(
            (t, "CPU: operators (autograd thread)") for t in ops["tid"].unique() if t != main_tid
        )[:1]:
            y = row(label)
            bars(y, ops[ops["tid"] == tid], ["#8C8C8C"] * int((ops["tid"] == tid).sum()))
    gpu = ev[ev["cat"].isin(GPU_CATS)]
    gpu_cats = pd.Series(
        [kernel_category(n, cat=c, phase=p) for n, c, p in zip(gpu["name"], gpu["cat"], gpu["phase"], strict=True)],
        index=gpu.index, dtype=object)
    for stream in sorted(gpu["stream"].dropna().unique()):
        in_stream = gpu["stream"] == stream
        y = row(f"GPU: stream {int(stream)}")
        bars(y, gpu[in_stream], [CATEGORY_COLORS[c] for c in gpu_cats[in_stream]])
    if len(gpu):
        y = row("GPU busy per slice")
        edges = [start + (end - start) * i / bins for i in range(bins + 1)]
        g_start, g_end = gpu["ts_us"].to_numpy(float), (gpu["ts_us"] + gpu["dur_us"]).to_numpy(float)
        for lo, hi in zip(edges[:-1], edges[1:], strict=True):
            frac = union_length([(max(a, lo), min(b, hi)) for a, b in zip(g_start, g_end, strict=True) if a < hi and b > lo]) / (hi - lo)
            if frac > 0:
                ax.broken_barh([((lo - start) / 1e3, (hi - lo) / 1e3)], (y + 0.4 - 0.8 * frac, 0.8 * frac),
                               facecolors="#333333", linewidth=0)
    ax.set_yticks(range(len(rows)), rows)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, span_ms)
    ax.set_xlabel("time from the step's start (ms)")
    ax.grid(axis="y", visible=False)
    present = [c for c in CATEGORIES if c in set(gpu_cats)]
    if present:
        handles = [plt.Rectangle((0, 0), 1, 1, color=CATEGORY_COLORS[c]) for c in present]
        ax.legend(handles, present, loc="upper center", bbox_to_anchor=(0.5, -0.28), ncol=4)
    if title is None:
        busy = prof.busy_us_per_step()[step] / (end - start) if len(gpu) else None
        title = f"one profiled step: {span_ms:.1f} ms" + (f", GPU busy {busy:.0%}" if busy is not None else " (CPU only)")
    ax.set_title(title)
    fig.tight_layout()
    return fig


# --- communication kernels of a trace (chapter 7) -----------------------------------------------------

GB = 1e9  # bandwidth in GB/s (decimal), as nccl-tests and link specifications print it

# Element sizes of the dtype names PyTorch writes into NCCL kernels' trace arguments.
_DTYPE_BYTES = {"float": 4, "float32": 4, "double": 8, "float64": 8, "half": 2, "float16": 2, "bfloat16": 2,
                "long": 8, "int64": 8, "int": 4, "int32": 4, "short": 2, "char": 1, "byte": 1, "bool": 1,
                "float8_e4m3fn": 1, "float8_e5m2": 1}


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

    Kernels are those ``kernel_category`` calls ``communication`` (NCCL's). Their trace
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
    events = read_trace(path)
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


def communication_overlap(path: str | Path) -> dict[str, float]:
    """How much of one rank's communication-kernel time ran while a compute kernel ran on its GPU.

    From a ``torch.profiler`` Chrome trace of one rank on GPUs: the union of the communication
    kernels' intervals (NCCL's, ``kernel_category``) and the union of every other kernel's
    (copies and memsets are not counted as compute). *Hidden* is the length of their intersection,
    *exposed* the communication time with no compute kernel beside it. Returns seconds:
    ``communication_s``, ``hidden_s``, ``exposed_s``, ``compute_s`` and ``span_s`` (first kernel start
    to last kernel end), and ``hidden_fraction`` (NaN without communication). An NCCL kernel's time
    includes waiting for the other ranks, so *exposed* includes that waiting; a trace of one rank
    cannot tell the two apart.

    Introduced in chapter 7, section 7.7.
    """
    events = read_trace(path)
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
    everything = union(comm + compute)
    communication, hidden = union_length(comm), intersection_length(comm, compute)
    return {
        "communication_s": communication, "hidden_s": hidden, "exposed_s": communication - hidden,
        "compute_s": union_length(compute),
        "span_s": (everything[-1][1] - everything[0][0]) if everything else 0.0,
        "hidden_fraction": hidden / communication if communication > 0 else float("nan"),
    }
