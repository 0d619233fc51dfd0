"""CPU tests for timing.per_sample (chapter 10's batch rungs) and timing.unpaired (chapter 7's separate launches)."""

import pytest

from helpers import timing


def _timed(wall):
    return timing.Timed(wall_s=tuple(wall), host_s=tuple(wall), gpu_s=None, gpu_busy=None, kernels_per_call=None,
                        device="cpu")


def test_per_sample_scales_every_round_and_keeps_the_rule():
    ratios = tuple(0.2 + 0.001 * i for i in range(15))  # b takes ~5x a's time per call
    c = timing.Comparison("b4", "b32", _timed([0.1] * 15), _timed([0.5] * 15), ratios, None)
    assert c.verdict == "slower"
    p = timing.per_sample(c, 4, 32)  # 8x the samples in ~5x the time: faster per sample
    assert p.ratios == pytest.approx(tuple(r * 8 for r in ratios))
    assert p.speedup == pytest.approx(c.speedup * 8)
    assert (p.lo, p.hi) == pytest.approx((c.lo * 8, c.hi * 8))
    assert p.verdict == "faster"
    assert p.a is c.a and p.b is c.b and p.gpu_ratios is None
    assert timing.per_sample(c, 4, 4).ratios == c.ratios
    with pytest.raises(ValueError):
        timing.per_sample(c, 0, 4)


def test_unpaired_ratio_interval_and_wide_threshold():
    one = [0.230 + 0.001 * i for i in range(10)]
    two = [0.250 + 0.001 * i for i in range(10)]  # 8% longer: beyond 3% but inside the 10% launch margin
    u = timing.unpaired(one, two, names=("1 GPU", "2 GPUs"))
    assert u.ratio == pytest.approx(0.2345 / 0.2545)
    assert u.lo < u.ratio < u.hi
    assert (u.lo, u.hi) == pytest.approx((0.231 / 0.258, 0.238 / 0.251))  # 2nd and 9th of 10, crossed
    assert u.verdict == timing.NO_DIFFERENCE
    assert timing.unpaired(one, two, threshold=0.03).verdict == "slower"
    far = [0.300 + 0.001 * i for i in range(10)]  # 28% longer: beyond any launch margin
    assert timing.unpaired(one, far).verdict == "slower"
    assert timing.unpaired(far, one).verdict == "faster"
    assert u.phrase().startswith("0.92× (interval 0.")


def test_unpaired_rejects_too_few_or_bad_samples():
    with pytest.raises(ValueError, match="at least 8"):
        timing.unpaired([0.1] * 5, [0.1] * 10)
    with pytest.raises(ValueError, match="positive"):
        timing.unpaired([0.0] * 10, [0.1] * 10)
    with pytest.raises(ValueError, match="threshold"):
        timing.unpaired([0.1] * 10, [0.1] * 10, threshold=-1)
