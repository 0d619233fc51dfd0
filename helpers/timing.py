"""Timing GPU work honestly: wall time, GPU time, host enqueue time, spread, and a verdict.

Introduced in chapter 8, section 8.1; every speed number of the book from chapter 8 on comes from
``time_it``.

A GPU runs asynchronously: a Python call that launches a kernel returns long before the kernel
ends. So each timed call records three clocks:

- **wall**: from the start of the call until the GPU has finished its work (``synchronize``);
- **GPU**: CUDA events recorded on the stream just before and just after the call. On an idle
  stream the first event completes as soon as it is recorded, so this is the span from the start of
  the call to the end of its last kernel, idle gaps included: close to wall time;
- **host enqueue**: from the start of the call until it returns, before synchronising: the time
  the CPU needs to issue the work.

When the host needs about as long to issue the work as the GPU needs to run it, the GPU waits for
Python and kernel launches (*host-bound*, also called launch-bound or overhead-bound); when the host
is done early and then waits, the GPU had a queue (*GPU-bound*). A host that synchronises inside
the call (``.item()``, printing a loss) also makes enqueue ≈ wall, so on CUDA ``time_it`` runs a few
more calls under ``torch.profiler`` and measures the **GPU-busy fraction**: the time some kernel or
copy was running, over the call's unprofiled wall time. The verdict rests on that number.

Why not ``torch.utils.benchmark.Timer``? It synchronises and repeats correctly, but reports one
clock only; the split into GPU, host and busy time is the point here.

>>> t = time_it(lambda: model(**batch).loss.backward(), device="cuda")
>>> t.summary()      # medians, spreads, GPU-busy and the verdict, as a dict
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# GPU-busy thresholds for the verdict (fractions of the call's wall time). Between HOST_LIMITED_BUSY and
# GPU_BOUND_BUSY the word is "mixed": a band 20 points wide, so that a step whose busy fraction moves by a few
# points between two runs (or two hosts) does not jump from "host-bound" straight to "GPU-bound".
GPU_BOUND_BUSY = 0.9
HOST_LIMITED_BUSY = 0.7
HOST_BOUND_BUSY = 0.5


@dataclass(frozen=True)
class Spread:
    """Median, quartiles and extremes of repeated samples (seconds).

    Introduced in chapter 8, section 8.1.
    """

    median: float
    q1: float
    q3: float
    min: float
    max: float

    @classmethod
    def of(cls, samples: tuple[float, ...]) -> Spread:
        if not samples:
            raise ValueError("need at least one sample")
        if len(samples) == 1:
            q1 = q3 = samples[0]
        else:
            q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")
        return cls(statistics.median(samples), q1, q3, min(samples), max(samples))

    @property
    def iqr(self) -> float:
        """Interquartile range: the middle half of the samples lies within it."""
        return self.q3 - self.q1

    @property
    def relative_iqr(self) -> float:
        return self.iqr / self.median if self.median > 0 else float("nan")


def verdict(gpu_busy: float | None, host_fraction: float | None) -> str:
    """One word for what limits the timed call.

    ``gpu_busy``: the fraction of wall time in which some kernel ran (``None`` on a CPU);
    ``host_fraction``: host enqueue time over wall time.

    - ``"CPU run"``: no GPU, wall time only;
    - ``"GPU-bound"``: kernels ran at least ``GPU_BOUND_BUSY`` (90%) of the time;
    - ``"host-bound"``: the GPU was busy less than ``HOST_LIMITED_BUSY`` (70%) of the time, the CPU needed
      longer to *issue* the work than the GPU needed to *run* it (``host_fraction > gpu_busy``), and issuing
      took at least half the wall time: Python, the dispatcher and kernel launches are the limit;
    - ``"GPU idle, host waiting"``: the GPU was busy less than ``HOST_BOUND_BUSY`` of the time and
      the host issued work less than half of it: the call waits on something else (a
      synchronisation, a data-loading wait, a CPU-side computation);
    - ``"mixed"``: in between, in particular every call with 70% to 90% busy: both sides matter there,
      and a few points of run-to-run (or host-to-host) variation must not flip the word.

    Introduced in chapter 8, section 8.1.
    """
    if gpu_busy is None:
        return "CPU run"
    if not 0.0 <= gpu_busy <= 1.0 + 1e-6:
        raise ValueError(f"gpu_busy must be a fraction in [0, 1], got {gpu_busy}")
    if gpu_busy >= GPU_BOUND_BUSY:
        return "GPU-bound"
    if gpu_busy < HOST_LIMITED_BUSY and host_fraction is not None and host_fraction >= 0.5 \
            and host_fraction > gpu_busy:
        return "host-bound"
    if gpu_busy < HOST_BOUND_BUSY and (host_fraction is None or host_fraction < 0.5):
        return "GPU idle, host waiting"
    return "mixed"


@dataclass(frozen=True)
class Timed:
    """Repeated timings of one call (seconds), with the GPU-busy fraction measured on profiled calls.

    Introduced in chapter 8, section 8.1.
    """

    wall_s: tuple[float, ...]
    host_s: tuple[float, ...]
    gpu_s: tuple[float, ...] | None  # None on a CPU
    gpu_busy: float | None  # None on a CPU, or when not measured
    kernels_per_call: int | None  # GPU operations (kernels, copies, memsets) of the profiled call
    device: str
    kernel_s: float | None = None  # summed duration of those operations per call (profiled calls' mean)
    loop_s: tuple[float, ...] | None = None  # per-call time of calls run back to back (``loop`` > 0)
    profile: Any = field(default=None, repr=False, compare=False)  # the profiler.StepProfile behind busy

    @property
    def wall(self) -> Spread:
        return Spread.of(self.wall_s)

    @property
    def host(self) -> Spread:
        return Spread.of(self.host_s)

    @property
    def gpu(self) -> Spread | None:
        return Spread.of(self.gpu_s) if self.gpu_s else None

    @property
    def loop(self) -> Spread | None:
        return Spread.of(self.loop_s) if self.loop_s else None

    @property
    def median_s(self) -> float:
        """Median wall time: the number to quote for "how long does it take"."""
        return self.wall.median

    @property
    def host_fraction(self) -> float:
        return self.host.median / self.wall.median if self.wall.median > 0 else float("nan")

    @property
    def verdict(self) -> str:
        if self.gpu_s is None:
            return verdict(None, None)
        if self.gpu_busy is None:  # without the profiled call, only the host clock can tell
            return "GPU-bound" if self.host_fraction < 0.5 else "unknown (GPU-busy not measured)"
        return verdict(self.gpu_busy, self.host_fraction)

    @property
    def evidence(self) -> str:
        """The numbers behind the verdict, as one sentence fragment."""
        if self.gpu_s is None:
            return f"wall time only (CPU), median {self.wall.median * 1e3:.3g} ms"
        parts = [f"host enqueue {self.host.median * 1e3:.3g} of {self.wall.median * 1e3:.3g} ms wall"]
        if self.gpu_busy is not None:
            parts.insert(0, f"GPU busy {self.gpu_busy:.0%}")
        return ", ".join(parts)

    def summary(self, unit: str = "ms") -> dict[str, float | int | str | None]:
        """Medians, spreads, GPU-busy and verdict as a flat dict (one table row)."""
        scale = {"s": 1.0, "ms": 1e3, "us": 1e6}[unit]
        wall = self.wall
        row: dict[str, float | int | str | None] = {
            f"wall median ({unit})": wall.median * scale,
            f"wall IQR ({unit})": wall.iqr * scale,
            f"wall min ({unit})": wall.min * scale,
            f"wall max ({unit})": wall.max * scale,
        }
        if self.gpu_s is not None:
            row[f"GPU (events) median ({unit})"] = self.gpu.median * scale
            row[f"host enqueue median ({unit})"] = self.host.median * scale
            row["GPU busy"] = self.gpu_busy
            row[f"GPU kernel time ({unit})"] = self.kernel_s * scale if self.kernel_s is not None else None
            row["GPU ops per call"] = self.kernels_per_call
        if self.loop_s:
            row[f"back to back, per call ({unit})"] = self.loop.median * scale
            row[f"back to back IQR ({unit})"] = self.loop.iqr * scale
        row["repeats"] = len(self.wall_s)
        row["verdict"] = self.verdict
        return row


def time_it(
    fn: Callable[[], object],
    *,
    device: str | torch.device,
    warmup: int = 3,
    repeat: int = 10,
    busy: bool = True,
    loop: int = 0,
    profile_steps: int = 3,
    trace_path: str | Path | None = None,
) -> Timed:
    """Time ``fn()``: ``warmup`` untimed calls, then ``repeat`` timed ones, each on its own clock.

    On CUDA every repeat records wall, host-enqueue and CUDA-event times; the device is synchronised
    before each call, so calls do not overlap. Host enqueue runs until the call returns, so it includes
    any time the CPU spends *blocked* inside it (a full launch queue, a synchronisation).

    With ``busy`` (CUDA only), ``profile_steps`` more calls run under ``torch.profiler``: the GPU's busy
    time per call (the union of its kernels and copies) is divided by the *unprofiled* median wall time,
    because the profiler slows the host and would make a host-bound call look idler than it is. The
    profile is kept in ``Timed.profile`` (its trace in ``trace_path``, default a temporary file).

    With ``loop`` > 0, ``repeat`` more samples each time ``loop`` calls back to back with a single
    synchronisation, as a training loop runs them: the CPU then issues call n+1 while the GPU finishes
    call n, which a synchronised call cannot show. ``loop_s`` holds the time per call.

    On a CPU only wall time exists; ``host_s`` then equals ``wall_s``.

    >>> t = time_it(lambda: x @ x, device="cuda")
    >>> t.median_s, t.wall.iqr, t.gpu_busy, t.verdict

    Introduced in chapter 8, section 8.1.
    """
    if warmup < 0 or repeat < 1 or loop < 0 or profile_steps < 1:
        raise ValueError(f"need warmup >= 0, repeat >= 1, loop >= 0 and profile_steps >= 1, got warmup={warmup}, "
                         f"repeat={repeat}, loop={loop}, profile_steps={profile_steps}")
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise RuntimeError("time_it(device='cuda') needs a CUDA GPU; none is available")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    for _ in range(warmup):
        fn()
    sync()
    wall, host, gpu = [], [], []
    for _ in range(repeat):
        if cuda:
            start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start_ev.record()
            fn()
            t_host = time.perf_counter() - t0
            end_ev.record()
            torch.cuda.synchronize(dev)
            t_wall = time.perf_counter() - t0
            gpu.append(start_ev.elapsed_time(end_ev) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            t_wall = t_host = time.perf_counter() - t0
        wall.append(t_wall)
        host.append(t_host)
    loop_s = None
    if loop:
        samples = []
        for _ in range(repeat):
            sync()
            t0 = time.perf_counter()
            for _ in range(loop):
                fn()
            sync()
            samples.append((time.perf_counter() - t0) / loop)
        loop_s = tuple(samples)
    gpu_busy, kernels, kernel_s, prof = None, None, None, None
    if cuda and busy:
        from helpers import profiler  # imported here: the profiler module is the heavier one

        prof = profiler.profile(fn, device=dev, warmup=1, active=profile_steps, trace_path=trace_path)
        busy_s = statistics.median(prof.busy_us_per_step()) / 1e6
        gpu_busy = min(1.0, busy_s / statistics.median(wall))
        kernels, kernel_s = prof.kernels_per_step, prof.gpu_ms / 1e3
    return Timed(tuple(wall), tuple(host), tuple(gpu) if cuda else None, gpu_busy, kernels, str(dev), kernel_s,
                 loop_s, prof)


def compare(timings: dict[str, Timed], baseline: str) -> dict[str, dict[str, float | str]]:
    """Speed-up of each timing over ``baseline`` and whether it is larger than the noise.

    A difference counts only when the two medians differ by more than the larger of the two IQRs;
    otherwise the row says "within the noise".

    Introduced in chapter 8, section 8.1.
    """
    if baseline not in timings:
        raise ValueError(f"baseline {baseline!r} is not one of {', '.join(timings)}")
    ref = timings[baseline].wall
    return {name: {"speed-up": ref.median / t.wall.median, "difference": difference(ref, t.wall)}
            for name, t in timings.items()}


def difference(reference: Spread, other: Spread) -> str:
    """``"faster"``, ``"slower"`` or ``"within the noise"``: ``other`` against ``reference`` (times).

    The rule of ``compare``: a difference counts only when the two medians differ by more than the
    larger of the two IQRs. For spreads that come from elsewhere (the step times a launched script
    recorded, for example).

    Introduced in chapter 7, section 7.4.
    """
    significant = abs(reference.median - other.median) > max(reference.iqr, other.iqr)
    if not significant:
        return "within the noise"
    return "faster" if other.median < reference.median else "slower"


# ---------------------------------------------------------------------------------------------------------
# Comparing two ways of doing the same work: interleaved rounds, a ratio with its interval, a verdict.

#: A difference counts as "faster" or "slower" only when the whole 95% interval of the speed-up lies beyond
#: this fraction (3%): smaller differences are rarely worth a change, and a host's noise reaches them easily.
PRACTICAL_THRESHOLD = 0.03
#: Rounds of an interleaved comparison unless told otherwise (at least 10: the book's measurement rule).
ROUNDS = 15
# The third verdict: the interval includes 1 (the noise cannot tell the two apart), or it excludes 1 but stays
# within the practical threshold (a real difference, too small to matter). Both are "no practical difference".
NO_DIFFERENCE = "no practical difference"


def median_interval(samples: tuple[float, ...] | list[float], confidence: float = 0.95) -> tuple[float, float]:
    """A distribution-free interval for the median of ``samples``: two order statistics.

    With n samples, the number lying below the true median is Binomial(n, 1/2); the interval from the j-th
    to the (n+1-j)-th smallest sample covers the median with probability 1 - 2·P(B < j). ``j`` is the
    largest rank that keeps the coverage at least ``confidence``. Needs at least 6 samples for 95%.

    Introduced in chapter 8, section 8.1.
    """
    xs = sorted(samples)
    n = len(xs)
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    from math import comb

    def coverage(j: int) -> float:  # P(j <= B <= n - j) for B ~ Binomial(n, 1/2), ranks 1-based
        below = sum(comb(n, i) for i in range(j)) / 2**n
        return 1.0 - 2.0 * below

    if n == 0 or coverage(1) < confidence:
        raise ValueError(f"{n} samples cannot bound a median at {confidence:.0%}: need at least 6 for 95%")
    j = 1
    while j + 1 <= (n + 1) // 2 and coverage(j + 1) >= confidence:
        j += 1
    return xs[j - 1], xs[n - j]


def ratio_verdict(lo: float, hi: float, threshold: float = PRACTICAL_THRESHOLD) -> str:
    """``"faster"``, ``"slower"`` or ``"no practical difference"`` for a speed-up's interval.

    The speed-up is baseline time over candidate time (above 1: the candidate is faster). It is a
    difference only when the *whole* interval lies beyond the practical threshold: ``lo >= 1 + threshold``
    is faster, ``hi <= 1 / (1 + threshold)`` is slower; anything else is no practical difference (the interval
    includes 1, or the difference it shows is within the threshold).

    Introduced in chapter 8, section 8.1.
    """
    if threshold < 0:
        raise ValueError(f"threshold must be >= 0, got {threshold}")
    if not lo <= hi:
        raise ValueError(f"need lo <= hi, got {lo} > {hi}")
    if lo >= 1.0 + threshold:
        return "faster"
    if hi <= 1.0 / (1.0 + threshold):
        return "slower"
    return NO_DIFFERENCE


def _fmt_ratio(x: float) -> str:
    return f"{x:.2f}"


@dataclass(frozen=True)
class Comparison:
    """The result of ``interleaved``: candidate ``b`` against baseline ``a``, timed in alternating rounds.

    ``ratios`` holds one speed-up per round (a's time over b's time in that round; above 1: b is faster),
    ``speedup`` their median, ``lo``/``hi`` its 95% interval (order statistics over rounds).
    ``gpu_ratio`` is the same ratio of the CUDA-event times (None on a CPU); ``kernel_ratio`` the ratio of
    kernel time per call from profiled calls (the GPU's own work, host gaps excluded; None when not profiled).
    ``a``/``b`` keep each side's samples as ``Timed`` (GPU busy, kernels per call, host enqueue).

    Introduced in chapter 8, section 8.1.
    """

    a_name: str
    b_name: str
    a: Timed
    b: Timed
    ratios: tuple[float, ...]
    gpu_ratios: tuple[float, ...] | None
    threshold: float = PRACTICAL_THRESHOLD

    @property
    def rounds(self) -> int:
        return len(self.ratios)

    @property
    def speedup(self) -> float:
        return statistics.median(self.ratios)

    @property
    def interval(self) -> tuple[float, float]:
        return median_interval(self.ratios)

    @property
    def lo(self) -> float:
        return self.interval[0]

    @property
    def hi(self) -> float:
        return self.interval[1]

    @property
    def gpu_ratio(self) -> float | None:
        return statistics.median(self.gpu_ratios) if self.gpu_ratios else None

    @property
    def gpu_interval(self) -> tuple[float, float] | None:
        return median_interval(self.gpu_ratios) if self.gpu_ratios else None

    @property
    def kernel_ratio(self) -> float | None:
        if self.a.kernel_s and self.b.kernel_s:
            return self.a.kernel_s / self.b.kernel_s
        return None

    @property
    def verdict(self) -> str:
        """``"faster"``/``"slower"`` (b against a, wall time) or ``"no practical difference"``."""
        return ratio_verdict(self.lo, self.hi, self.threshold)

    @property
    def gpu_verdict(self) -> str | None:
        """The same rule on the CUDA-event times (None on a CPU)."""
        iv = self.gpu_interval
        return ratio_verdict(iv[0], iv[1], self.threshold) if iv else None

    def phrase(self, *, what: str = "") -> str:
        """The fragment the chapters quote: ``"1.22× faster (95% interval 1.18–1.26×)"``.

        The number is always the speed-up (baseline time over candidate time); "slower" rows show it below 1.
        ``what`` is put after the verdict word ("faster than the default").
        """
        word = self.verdict
        head = f"{_fmt_ratio(self.speedup)}×"
        tail = f" {what}" if what and self.verdict != NO_DIFFERENCE else ""
        return f"{head}, {word}{tail} (95% interval {_fmt_ratio(self.lo)}–{_fmt_ratio(self.hi)}×, {self.rounds} rounds)"

    def row(self, unit: str = "ms") -> dict[str, float | int | str | None]:
        """One table row: both sides' medians, the speed-up with its interval, GPU figures and the verdict."""
        scale = {"s": 1.0, "ms": 1e3, "us": 1e6}[unit]
        row: dict[str, float | int | str | None] = {
            f"{self.a_name} ({unit})": self.a.wall.median * scale,
            f"candidate ({unit})": self.b.wall.median * scale,
            "speed-up": self.speedup,
            "95% low": self.lo,
            "95% high": self.hi,
        }
        if self.gpu_ratios:
            row["GPU-time speed-up"] = self.gpu_ratio
        if self.kernel_ratio is not None:
            row["kernel-time speed-up"] = self.kernel_ratio
        if self.a.gpu_busy is not None:
            row["baseline GPU busy"] = self.a.gpu_busy
        if self.b.gpu_busy is not None:
            row["candidate GPU busy"] = self.b.gpu_busy
        row["rounds"] = self.rounds
        row["verdict"] = self.verdict
        return row


def us_per_launch(t: Timed) -> float | None:
    """Host enqueue time per GPU operation (µs): what one launch costs this host (None without a profile).

    Introduced in chapter 8, section 8.1.
    """
    if not t.kernels_per_call:
        return None
    return t.host.median * 1e6 / t.kernels_per_call


def interleaved(
    a: Callable[[], object],
    b: Callable[[], object],
    *,
    device: str | torch.device,
    names: tuple[str, str] = ("baseline", "candidate"),
    rounds: int = ROUNDS,
    warmup: int = 3,
    loop: int = 1,
    busy: bool = True,
    profile_steps: int = 3,
    threshold: float = PRACTICAL_THRESHOLD,
    setup_a: Callable[[], object] | None = None,
    setup_b: Callable[[], object] | None = None,
) -> Comparison:
    """Time ``a`` (the baseline) and ``b`` (the candidate) in alternating rounds and compare them.

    After ``warmup`` calls of each, every round times one sample of each side, in the order a, b on even
    rounds and b, a on odd ones (so neither side always runs first). A sample is ``loop`` calls back to
    back with one synchronisation at the end (``loop`` = 1: one synchronised call, as ``time_it``), and
    records wall, host-enqueue and (CUDA) event time. The round's speed-up is a's time over b's time.
    Because both samples of a round run within milliseconds of each other, a host whose speed drifts
    between rounds (other processes, clocks, caches) moves both alike and the ratio stays; medians of two
    separate blocks of samples, as ``compare`` takes them, absorb the drift instead.

    ``setup_a``/``setup_b`` run, untimed, before each sample of that side: switches such as
    ``torch.backends.cuda.matmul.allow_tf32`` that the two sides set differently.

    With ``busy`` (CUDA only), ``profile_steps`` more calls of each side run under ``torch.profiler`` for
    the GPU-busy fraction, the kernels per call and the kernel time per call (``Comparison.kernel_ratio``).

    Introduced in chapter 8, section 8.1.
    """
    if rounds < 10:
        raise ValueError(f"an interleaved comparison needs at least 10 rounds, got {rounds}")
    if warmup < 0 or loop < 1 or profile_steps < 1:
        raise ValueError(f"need warmup >= 0, loop >= 1 and profile_steps >= 1, got warmup={warmup}, loop={loop}, "
                         f"profile_steps={profile_steps}")
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise RuntimeError("interleaved(device='cuda') needs a CUDA GPU; none is available")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    sides = {0: (a, setup_a), 1: (b, setup_b)}
    for _ in range(warmup):
        for fn, setup in sides.values():
            if setup is not None:
                setup()
            fn()
    sync()
    wall: dict[int, list[float]] = {0: [], 1: []}
    host: dict[int, list[float]] = {0: [], 1: []}
    gpu: dict[int, list[float]] = {0: [], 1: []}

    def sample(side: int) -> None:
        fn, setup = sides[side]
        if setup is not None:
            setup()
        sync()
        if cuda:
            start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start_ev.record()
            for _ in range(loop):
                fn()
            t_host = time.perf_counter() - t0
            end_ev.record()
            torch.cuda.synchronize(dev)
            t_wall = time.perf_counter() - t0
            gpu[side].append(start_ev.elapsed_time(end_ev) / 1e3 / loop)
        else:
            t0 = time.perf_counter()
            for _ in range(loop):
                fn()
            t_wall = t_host = time.perf_counter() - t0
        wall[side].append(t_wall / loop)
        host[side].append(t_host / loop)

    for r in range(rounds):
        for side in ((0, 1) if r % 2 == 0 else (1, 0)):
            sample(side)

    timed = {}
    for side, (fn, setup) in sides.items():
        gpu_busy = kernels = kernel_s = prof = None
        if cuda and busy:
            from helpers import profiler  # imported here: the profiler module is the heavier one

            if setup is not None:
                setup()
            prof = profiler.profile(fn, device=dev, warmup=1, active=profile_steps)
            busy_s = statistics.median(prof.busy_us_per_step()) / 1e6
            gpu_busy = min(1.0, busy_s / statistics.median(wall[side]))
            kernels, kernel_s = prof.kernels_per_step, prof.gpu_ms / 1e3
        timed[side] = Timed(tuple(wall[side]), tuple(host[side]), tuple(gpu[side]) if cuda else None, gpu_busy,
                            kernels, str(dev), kernel_s, None, prof)
    ratios = tuple(x / y for x, y in zip(wall[0], wall[1], strict=True))
    gpu_ratios = tuple(x / y for x, y in zip(gpu[0], gpu[1], strict=True)) if cuda else None
    return Comparison(names[0], names[1], timed[0], timed[1], ratios, gpu_ratios, threshold)



def blocks(a: Callable[[], object], b: Callable[[], object], *, device: str | torch.device, repeat: int = 10,
           warmup: int = 3) -> dict[str, float | str]:
    """The retired block method with its number: ``a`` timed as one block, then ``b`` as another (``time_it``,
    no profile), b judged by ``difference`` (medians against the larger IQR). ``interleaved`` replaces it; this is kept to
    show why.

    Returns ``{"speed-up": a's median / b's median, "verdict": "faster" | "slower" | "within the noise"}``:
    one row of the table that sets the block method beside ``interleaved``, for the same work on both sides.

    Introduced in chapter 8, section 8.1.
    """
    ta = time_it(a, device=device, warmup=warmup, repeat=repeat, busy=False)
    tb = time_it(b, device=device, warmup=warmup, repeat=repeat, busy=False)
    return {"speed-up": ta.wall.median / tb.wall.median, "verdict": difference(ta.wall, tb.wall)}


def within_threshold(c: Comparison) -> bool:
    """Whether the whole 95% interval of ``c``'s speed-up lies inside the ±threshold band around 1.

    That is a stronger statement than the verdict ``"no practical difference"``, which also covers an
    interval that straddles the band's edge: inside the band, the data rule out a difference as large as the
    threshold.

    Introduced in chapter 8, section 8.1.
    """
    return 1.0 / (1.0 + c.threshold) < c.lo and c.hi < 1.0 + c.threshold


def per_sample(c: Comparison, batch_a: int, batch_b: int) -> Comparison:
    """``c`` restated per sample, for two sides that train different batch sizes (a batch-size rung).

    Each round's speed-up becomes (a's time / ``batch_a``) over (b's time / ``batch_b``), so above 1 means b
    trains more samples per second; the interval and the verdict follow from the scaled rounds by the same rule.
    ``c.a``/``c.b`` keep their per-call times.

    >>> per_sample(timing.interleaved(step_b4, step_b32, device="cuda"), 4, 32).phrase()

    Introduced in chapter 10, section 10.3.
    """
    if batch_a < 1 or batch_b < 1:
        raise ValueError(f"batch sizes must be >= 1, got {batch_a} and {batch_b}")
    scale = batch_b / batch_a
    gpu = tuple(r * scale for r in c.gpu_ratios) if c.gpu_ratios else c.gpu_ratios
    return Comparison(c.a_name, c.b_name, c.a, c.b, tuple(r * scale for r in c.ratios), gpu, c.threshold)


# Two separate launches (processes started one after the other) differ by more than the spread of the steps
# inside either: GPU clocks, the host's other work, NCCL's setup. The steps of one launch cannot show it.
LAUNCH_THRESHOLD = 0.10


@dataclass(frozen=True)
class Unpaired:
    """Two sets of step times that could not be interleaved (two separate launches), compared by their medians.

    ``ratio`` is median(a) / median(b), so above 1 means b's steps are shorter (the convention of
    ``Comparison.speedup``). ``lo``/``hi`` bound it by the order-statistics intervals of the two medians, each
    at 97.5% so that both hold together with at least 95% probability: ``lo`` = a's low / b's high, ``hi`` = a's
    high / b's low. That interval covers the spread of the steps *within* each launch only; the verdict asks the
    whole interval to lie beyond ``threshold`` (``LAUNCH_THRESHOLD``, 10%, not the 3% of an interleaved
    comparison), a margin for what changes from one launch to the next.

    Introduced in chapter 7, section 7.4.
    """

    a_name: str
    b_name: str
    a: Spread
    b: Spread
    ratio: float
    lo: float
    hi: float
    threshold: float = LAUNCH_THRESHOLD

    @property
    def verdict(self) -> str:
        """``"faster"``/``"slower"`` (b against a) only beyond ``threshold``, else ``NO_DIFFERENCE``."""
        return ratio_verdict(self.lo, self.hi, self.threshold)

    def phrase(self) -> str:
        """``"0.93× (interval 0.91–0.95×)"``: the ratio of medians with its interval."""
        return f"{_fmt_ratio(self.ratio)}× (interval {_fmt_ratio(self.lo)}–{_fmt_ratio(self.hi)}×)"


def unpaired(a: tuple[float, ...] | list[float], b: tuple[float, ...] | list[float], *,
             names: tuple[str, str] = ("a", "b"), threshold: float = LAUNCH_THRESHOLD) -> Unpaired:
    """Compare two separate blocks of samples (seconds) that no interleaving could pair (see ``Unpaired``).

    Needs at least 8 samples on each side (the 97.5% order-statistics interval of a median).

    >>> unpaired(steps_1gpu, steps_2gpu, names=("1 GPU", "2 GPUs")).phrase()

    Introduced in chapter 7, section 7.4.
    """
    if threshold < 0:
        raise ValueError(f"threshold must be >= 0, got {threshold}")
    if len(a) < 8 or len(b) < 8:
        raise ValueError(f"unpaired() needs at least 8 samples per side, got {len(a)} and {len(b)}")
    if min(a) <= 0 or min(b) <= 0:
        raise ValueError("unpaired() needs positive times")
    a_lo, a_hi = median_interval(a, 0.975)
    b_lo, b_hi = median_interval(b, 0.975)
    return Unpaired(names[0], names[1], Spread.of(tuple(a)), Spread.of(tuple(b)),
                    statistics.median(a) / statistics.median(b), a_lo / b_hi, a_hi / b_lo, threshold)


def comparisons_table(comparisons: dict[Any, Comparison], unit: str = "ms") -> Any:
    """One row per comparison, with the same columns whatever the baselines are called (a ``pandas.DataFrame``).

    ``Comparison.row`` names its first column after the baseline, which suits one comparison; a table of
    several comparisons with different baselines needs fixed columns: baseline and candidate names, both medians,
    the speed-up with its 95% interval, the GPU-time and kernel-time speed-ups, both GPU-busy fractions, rounds and
    verdict. The keys of ``comparisons`` become the index (tuples become a MultiIndex).

    >>> comparisons_table({"fused AdamW": c1, "TF32": c2})

    Introduced in chapter 9, section 9.2.
    """
    import pandas as pd

    if not comparisons:
        raise ValueError("comparisons_table() needs at least one comparison")
    scale = {"s": 1.0, "ms": 1e3, "us": 1e6}[unit]
    rows = {}
    for key, c in comparisons.items():
        if not isinstance(c, Comparison):
            raise ValueError(f"{key!r} is a {type(c).__name__}, not a timing.Comparison")
        rows[key] = {"baseline": c.a_name, "candidate": c.b_name,
                     f"baseline ({unit})": c.a.wall.median * scale, f"candidate ({unit})": c.b.wall.median * scale,
                     "speed-up": c.speedup, "95% low": c.lo, "95% high": c.hi,
                     "GPU-time speed-up": c.gpu_ratio, "kernel-time speed-up": c.kernel_ratio,
                     "baseline GPU busy": c.a.gpu_busy, "candidate GPU busy": c.b.gpu_busy,
                     "rounds": c.rounds, "verdict": c.verdict}
    return pd.DataFrame.from_dict(rows, orient="index")


class Budget:
    """A chapter's time budget that counts computing time only: the seconds spent inside ``charged()`` blocks.

    The time a reader spends between cells is not charged, so reading at human speed skips nothing; a slow GPU
    or CPU uses the budget up sooner, and the optional experiments that check ``seconds_left()`` before they start
    skip themselves. A ``charged()`` block inside another counts once (the outer one counts its time), and
    ``seconds_left()`` inside a block already counts the time that block has run.

    >>> budget = Budget(260)
    >>> with budget.charged():
    ...     run_the_experiment()
    >>> if budget.seconds_left() < 30: ...

    Introduced in chapter 9, section 9.3; chapter 10 uses it too.
    """

    def __init__(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a budget needs seconds >= 0, got {seconds}")
        self.seconds = seconds
        self.spent_s = 0.0
        self._since: float | None = None  # the start of the running (outermost) charged block

    @contextlib.contextmanager
    def charged(self) -> Iterator[None]:
        """Charge the enclosed block's time to the budget (a nested block counts once, by the outer one)."""
        if self._since is not None:
            yield
            return
        self._since = time.perf_counter()
        try:
            yield
        finally:
            self.spent_s += time.perf_counter() - self._since
            self._since = None

    def seconds_left(self) -> float:
        """Seconds left of the budget, the running charged block's time included."""
        running = time.perf_counter() - self._since if self._since is not None else 0.0
        return self.seconds - self.spent_s - running
