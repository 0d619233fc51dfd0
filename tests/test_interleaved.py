"""The interleaved comparison (timing.interleaved) against the retired block method, on a synthetic clock.

The host's speed drifts: the first calls cost 30% more (another process was busy) and then the host is
fast again. Both sides do the same work. Timed as two blocks (a first, then b), b looks faster; timed in
alternating rounds, the per-round ratio stays at 1 and the verdict is "no practical difference".
"""

from __future__ import annotations

import pytest

from helpers import timing


def test_drifting_host_fools_blocks_but_not_interleaved_rounds(clock):
    # identical work on both sides; the host is 30% slower for the first 0.15 s of fake time
    a = clock.work(0.010, slow_until_s=0.15)
    b = clock.work(0.010, slow_until_s=0.15)
    assert timing.blocks(a, b, device="cpu", repeat=10, warmup=3)["verdict"] == "faster"
    clock.now = 0.0
    c = timing.interleaved(a, b, device="cpu", rounds=15, warmup=3)
    assert c.verdict == timing.NO_DIFFERENCE
    assert c.speedup == pytest.approx(1.0)
    assert c.lo <= 1.0 <= c.hi


def test_real_difference_is_found_through_the_drift(clock):
    a = clock.work(0.012, slow_until_s=0.2)
    b = clock.work(0.010, slow_until_s=0.2)
    c = timing.interleaved(a, b, device="cpu", rounds=12, warmup=2)
    assert c.verdict == "faster"
    assert c.speedup == pytest.approx(1.2)
    assert c.phrase().startswith("1.20×, faster (95% interval 1.20–1.20×, 12 rounds)")
    slower = timing.interleaved(b, a, device="cpu", rounds=12, warmup=2)
    assert slower.verdict == "slower" and slower.speedup == pytest.approx(1 / 1.2)


def test_alternating_order_and_setups(clock):
    order = []
    a = lambda: order.append("a") or setattr(clock, "now", clock.now + 0.01)  # noqa: E731
    b = lambda: order.append("b") or setattr(clock, "now", clock.now + 0.01)  # noqa: E731
    seen = []
    timing.interleaved(a, b, device="cpu", rounds=10, warmup=0, setup_a=lambda: seen.append("A"),
                       setup_b=lambda: seen.append("B"))
    assert order[:4] == ["a", "b", "b", "a"]  # even rounds a first, odd rounds b first
    assert seen[:4] == ["A", "B", "B", "A"] and len(order) == 20


@pytest.mark.parametrize("n, ranks", [(6, (1, 6)), (10, (2, 9)), (15, (4, 12)), (20, (6, 15))])
def test_median_interval_uses_binomial_order_statistics(n, ranks):
    xs = list(range(1, n + 1))
    assert timing.median_interval(xs[::-1]) == ranks


def test_median_interval_refuses_too_few_samples():
    with pytest.raises(ValueError, match="at least 6"):
        timing.median_interval([1.0, 2.0, 3.0, 4.0, 5.0])


@pytest.mark.parametrize("lo, hi, word", [
    (1.03, 1.2, "faster"), (1.029, 1.2, timing.NO_DIFFERENCE), (0.5, 1 / 1.03, "slower"),
    (0.5, 0.98, timing.NO_DIFFERENCE), (0.9, 1.1, timing.NO_DIFFERENCE)])
def test_ratio_verdict_needs_the_whole_interval_beyond_the_threshold(lo, hi, word):
    assert timing.ratio_verdict(lo, hi) == word


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="at least 10 rounds"):
        timing.interleaved(lambda: None, lambda: None, device="cpu", rounds=9)
    with pytest.raises(ValueError, match="lo <= hi"):
        timing.ratio_verdict(1.2, 1.1)


def test_row_carries_ratio_interval_and_verdict(clock):
    a = clock.work(0.02, slow_until_s=0.0)
    b = clock.work(0.01, slow_until_s=0.0)
    row = timing.interleaved(a, b, device="cpu", names=("eager", "compiled"), rounds=10, warmup=0).row()
    assert row["eager (ms)"] == pytest.approx(20.0) and row["candidate (ms)"] == pytest.approx(10.0)
    assert row["speed-up"] == pytest.approx(2.0) and row["verdict"] == "faster" and row["rounds"] == 10
