"""timing.blocks (the block method with its number) and timing.within_threshold, on a synthetic clock."""

from __future__ import annotations

import pytest

from helpers import timing


def test_blocks_reports_a_ratio_for_identical_work_on_a_drifting_host(clock):
    a = clock.work(0.010, slow_until_s=0.15)
    b = clock.work(0.010, slow_until_s=0.15)
    row = timing.blocks(a, b, device="cpu", repeat=10, warmup=3)
    assert row["verdict"] == "faster"
    assert row["speed-up"] == pytest.approx(1.3)


def test_blocks_on_a_steady_noisy_host_is_within_the_noise(clock):
    costs = iter([0.010, 0.011] * 100)  # the same work, with call-to-call jitter and no drift

    def fn() -> None:
        clock.now += next(costs)

    row = timing.blocks(fn, fn, device="cpu", repeat=10, warmup=2)
    assert row["verdict"] == "within the noise"
    assert row["speed-up"] == pytest.approx(1.0, abs=0.1)


def _comparison(ratios):
    t = timing.Timed(wall_s=(0.01,) * len(ratios), host_s=(0.01,) * len(ratios), gpu_s=None, gpu_busy=None,
                     kernels_per_call=None, device="cpu")
    return timing.Comparison("a", "b", t, t, tuple(ratios), None)


@pytest.mark.parametrize("ratios, inside", [
    ([1.0 + 0.001 * i for i in range(-7, 8)], True),                       # tight around 1
    ([0.99 + 0.005 * i for i in range(15)], False),                         # upper bound 1.045 > 1.03
    ([1.05 + 0.001 * i for i in range(15)], False),                         # clearly faster
    ([1 / 1.02 - 0.002 * i for i in range(15)], False),                      # lo below 1/1.03
])
def test_within_threshold(ratios, inside):
    assert timing.within_threshold(_comparison(ratios)) is inside
