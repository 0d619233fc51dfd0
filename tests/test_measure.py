import math
import time

import pytest
import torch

from helpers import measure


def test_time_fn_median_and_repeats():
    calls = []

    def work():
        calls.append(1)
        time.sleep(0.01)

    timing = measure.time_fn(work, device="cpu", warmup=2, repeat=3)
    assert len(calls) == 5
    assert len(timing.times_s) == 3
    assert 0.009 < timing.median_s < 0.1
    assert timing.spread_s >= 0


def test_time_fn_rejects_bad_counts():
    with pytest.raises(ValueError, match="repeat >= 1"):
        measure.time_fn(lambda: None, device="cpu", repeat=0)


def test_phase_recorder_on_cpu_times_phases_and_leaves_memory_nan():
    rec = measure.PhaseRecorder("cpu")
    with rec.phase("a"):
        time.sleep(0.01)
    with rec.phase("b"):
        pass
    df = rec.to_frame()
    assert list(df.index) == ["a", "b"]
    assert df.loc["a", "time_s"] >= 0.009
    assert math.isnan(df.loc["a", "peak_allocated_mib"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU error")
def test_gpu_only_calls_fail_clearly_on_cpu():
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        measure.allocator_mib()
    with pytest.raises(RuntimeError, match="NVML needs an NVIDIA GPU"):
        measure.nvml_used_mib()


@pytest.mark.gpu
def test_allocator_sees_exactly_one_tensor():
    torch.cuda.synchronize()
    before = measure.allocator_mib()["allocated_mib"]
    x = torch.empty(2**20, dtype=torch.float32, device="cuda")  # 4 MiB
    after = measure.allocator_mib()["allocated_mib"]
    assert after - before == pytest.approx(4.0)
    del x


@pytest.mark.gpu
def test_phase_recorder_peak_includes_temporaries():
    rec = measure.PhaseRecorder("cuda")
    with rec.phase("temp"):
        y = torch.ones(2**20, device="cuda")  # 4 MiB kept
        z = torch.ones(2**21, device="cuda")  # 8 MiB temporary
        del z
    df = rec.to_frame()
    assert df.loc["temp", "peak_allocated_mib"] - df.loc["temp", "allocated_mib"] >= 8.0 - 1e-6
    del y


@pytest.mark.gpu
def test_nvml_counts_the_context():
    torch.ones(1, device="cuda")
    assert measure.nvml_used_mib() > 100  # a CUDA context alone is hundreds of MiB


@pytest.mark.gpu
def test_gpu_budget_raises_oom_and_restores():
    with measure.gpu_budget(1.0):
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    x = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")  # fits again once restored
    del x
    torch.cuda.empty_cache()
