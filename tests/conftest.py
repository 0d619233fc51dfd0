import types

import pytest
import torch

from helpers import timing


def pytest_collection_modifyitems(config, items):
    """Skip tests marked ``gpu`` when no CUDA device is present."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


class FakeClock:
    """A clock for ``helpers.timing`` that only moves when the timed work says so (``work``)."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def work(self, cost_s: float, slow_until_s: float, slow: float = 1.3):
        """A call that costs ``cost_s``, ``slow`` times more while the clock is before ``slow_until_s``: a host
        whose speed drifts once, as when another process stops competing for it."""
        def fn() -> None:
            self.now += cost_s * (slow if self.now < slow_until_s else 1.0)
        return fn


@pytest.fixture
def clock(monkeypatch):
    """``helpers.timing`` reads this fake clock instead of ``time.perf_counter`` for the test's duration."""
    c = FakeClock()
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=c.perf_counter))
    return c
