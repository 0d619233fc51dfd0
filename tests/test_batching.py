import gc
import math
import weakref

import pytest
import torch

from helpers import batching, measure


@pytest.fixture(autouse=True)
def counted_release(monkeypatch):
    """Count the cleanups instead of running them: a full garbage collection per attempt is what made
    these search tests slow, and what the search does between attempts is pinned separately below."""
    calls = []
    monkeypatch.setattr(batching.cleanup, "collect", lambda: calls.append(1))
    return calls


def capacity_step(capacity: int, calls: list[int] | None = None):
    """A step that 'runs out of memory' above ``capacity`` samples, like a real card would."""

    def step(batch_size: int) -> int:
        if calls is not None:
            calls.append(batch_size)
        if batch_size > capacity:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {batch_size / 4:.2f} GiB. GPU 0 has a total capacity of 14.75 GiB"
            )
        return batch_size * 10

    return step


def test_try_batch_returns_the_step_value_when_it_fits():
    att = batching.try_batch(capacity_step(8), 8, memory_mib=lambda: 123.0)
    assert att.fits and att.value == 80 and att.error is None
    assert att.memory_after_mib == 123.0


def test_try_batch_catches_out_of_memory_and_keeps_the_short_message():
    att = batching.try_batch(capacity_step(8), 9, memory_mib=lambda: 5.0)
    assert not att.fits and att.value is None
    assert att.error == "Tried to allocate 2.25 GiB"
    assert att.memory_after_mib == 5.0


def test_try_batch_frees_the_failed_steps_tensors_before_cleaning_up_and_reading_memory(monkeypatch):
    """The traceback of a caught error holds the step's frames. The cleanup (empty_cache) and the memory
    reading must both come after the except block, when those frames and their tensors are gone:
    emptying the cache while they are alive would leave their blocks reserved."""
    refs = []

    def step(batch_size):
        activations = torch.empty(batch_size, 1000)  # a local of the failing frame
        refs.append(weakref.ref(activations))
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")

    alive_at = []
    monkeypatch.setattr(batching.cleanup, "collect", lambda: alive_at.append(("release", refs[0]() is not None)))
    batching.try_batch(step, 4, memory_mib=lambda: float(alive_at.append(("read", refs[0]() is not None)) or 0))
    assert alive_at == [("release", False), ("read", False)]


def test_try_batch_cleans_up_once_per_attempt(counted_release):
    batching.try_batch(capacity_step(8), 4, memory_mib=lambda: 0.0)
    batching.try_batch(capacity_step(8), 16, memory_mib=lambda: 0.0)
    assert len(counted_release) == 2


@pytest.mark.parametrize(
    "message",
    ["CUDA error: out of memory", "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"],
)
def test_try_batch_catches_out_of_memory_reported_as_a_plain_runtime_error(message):
    def step(batch_size):
        raise RuntimeError(message)

    att = batching.try_batch(step, 2, memory_mib=lambda: 0.0)
    assert not att.fits and att.error == message.splitlines()[0][:80]


def test_try_batch_lets_other_errors_through_and_rejects_bad_sizes():
    def broken(batch_size):
        raise ValueError("a bug, not a memory problem")

    with pytest.raises(ValueError, match="a bug"):
        batching.try_batch(broken, 1)
    with pytest.raises(ValueError, match="at least 1"):
        batching.try_batch(capacity_step(8), 0)


def test_default_memory_reader_is_the_one_allocator_reader(monkeypatch):
    monkeypatch.setattr(measure, "allocator_mib", lambda device=None: {"allocated_mib": 12.5})
    assert batching.allocated_mib() == 12.5
    assert batching.try_batch(capacity_step(8), 1).memory_after_mib == 12.5


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU reading")
def test_default_memory_reader_is_nan_without_cuda():
    assert math.isnan(batching.allocated_mib())


@pytest.mark.parametrize("capacity", [1, 5, 37, 64, 100, 1000])
def test_largest_batch_finds_the_capacity(capacity):
    calls = []
    search = batching.largest_batch(capacity_step(capacity, calls), memory_mib=lambda: 0.0)
    assert search.largest == capacity
    assert len(calls) == len(set(calls)), "no size is tried twice"
    assert [a.batch_size for a in search.attempts] == calls
    assert all(a.fits == (a.batch_size <= capacity) for a in search.attempts)
    assert len(calls) <= 2 * math.ceil(math.log2(capacity + 1)) + 2


def test_largest_batch_doubles_then_bisects():
    search = batching.largest_batch(capacity_step(37), memory_mib=lambda: 0.0)
    assert [a.batch_size for a in search.attempts] == [1, 2, 4, 8, 16, 32, 64, 48, 40, 36, 38, 37]


def test_largest_batch_respects_multiple_of_and_backs_off_from_a_failing_start():
    search = batching.largest_batch(capacity_step(37), start=128, multiple_of=8, memory_mib=lambda: 0.0)
    assert search.largest == 32
    assert all(a.batch_size % 8 == 0 for a in search.attempts)
    assert search.attempts[0].batch_size == 128 and not search.attempts[0].fits


def test_largest_batch_when_nothing_fits_or_the_limit_is_reached():
    none = batching.largest_batch(capacity_step(3), start=8, multiple_of=4, memory_mib=lambda: 0.0)
    assert none.largest is None and [a.batch_size for a in none.attempts] == [8, 4]
    capped = batching.largest_batch(capacity_step(1000), max_batch=50, memory_mib=lambda: 0.0)
    assert capped.largest == 50 and capped.hit_limit
    assert max(a.batch_size for a in capped.attempts) == 50


def test_largest_batch_rejects_bad_arguments():
    step = capacity_step(10)
    with pytest.raises(ValueError, match="multiple_of"):
        batching.largest_batch(step, multiple_of=0)
    with pytest.raises(ValueError, match="positive multiple of 8"):
        batching.largest_batch(step, start=12, multiple_of=8)
    with pytest.raises(ValueError, match="max_batch"):
        batching.largest_batch(step, start=16, max_batch=8)


def test_search_table_has_one_row_per_attempt():
    search = batching.largest_batch(capacity_step(5), memory_mib=lambda: 7.0)
    df = search.to_frame()
    assert list(df["batch size"]) == [a.batch_size for a in search.attempts]
    assert set(df["result"]) == {"fits", "out of memory"}
    assert (df["allocated after cleanup (MiB)"] == 7.0).all()
    assert df.loc[df["result"] == "out of memory", "error"].str.startswith("Tried to allocate").all()


def test_short_error_falls_back_to_the_first_line():
    assert batching.short_error("something odd\nmore") == "something odd"
    assert batching.short_error("") == "out of memory"


@pytest.mark.gpu
def test_try_batch_gives_cuda_memory_back_after_a_real_out_of_memory(monkeypatch):
    torch.ones(1, device="cuda")
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    total = torch.cuda.get_device_properties(0).total_memory

    def step(batch_size):
        keep = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")  # 256 MiB, freed after the failure
        too_big = torch.empty(2 * total, dtype=torch.uint8, device="cuda")
        return keep, too_big

    att = batching.try_batch(step, 1)
    assert not att.fits and att.error.startswith("Tried to allocate")
    assert torch.cuda.memory_allocated() == base


@pytest.mark.gpu
def test_try_batch_empties_the_cache_only_after_the_failed_step_is_gone(monkeypatch):
    """Reserved memory after the attempt tells the orders apart: emptying the cache while the traceback
    still holds the step's 256 MiB would leave those blocks reserved."""
    torch.ones(1, device="cuda")
    gc.collect()
    torch.cuda.empty_cache()
    base_reserved = torch.cuda.memory_reserved()
    total = torch.cuda.get_device_properties(0).total_memory

    def step(batch_size):
        keep = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
        too_big = torch.empty(2 * total, dtype=torch.uint8, device="cuda")
        return keep, too_big

    att = batching.try_batch(step, 1, memory_mib=lambda: torch.cuda.memory_reserved() / 2**20)
    assert not att.fits
    assert att.memory_after_mib * 2**20 <= base_reserved + 2 * 2**20  # the 256 MiB went back to the driver
