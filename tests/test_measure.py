import math
import sys
import time
import types

import pytest
import torch

from helpers import env, measure


def test_time_fn_median_repeats_and_spread():
    sleeps = iter([0.0, 0.0, 0.01, 0.03, 0.02])  # two warm-up calls, then three timed ones

    def work():
        time.sleep(next(sleeps))

    timing = measure.time_fn(work, device="cpu", warmup=2, repeat=3)
    assert len(timing.times_s) == 3
    assert 0.019 < timing.median_s < 0.03  # the middle one, the 20 ms call
    assert 0.018 < timing.spread_s < 0.03  # 30 ms - 10 ms: the repeats really differ by 20 ms


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


def test_phase_recorder_rows_in_start_order_and_time_of_nested_phases():
    rec = measure.PhaseRecorder("cpu")
    with rec.phase("step"):
        with rec.phase("forward"):
            time.sleep(0.01)
        time.sleep(0.01)
    df = rec.to_frame()
    assert list(df.index) == ["step", "forward"]
    assert df.loc["step", "time_s"] >= df.loc["forward", "time_s"] + 0.009


class FakeAllocator:
    """Stands in for CUDA's caching allocator: current and peak allocated bytes (MiB here)."""

    def __init__(self):
        self.now, self.peak = 0.0, 0.0

    def alloc(self, mib):
        self.now += mib
        self.peak = max(self.peak, self.now)

    def read(self, device=None):
        return {"allocated_mib": self.now, "reserved_mib": self.now, "peak_allocated_mib": self.peak}

    def reset(self, device=None):
        self.peak = self.now


def test_nested_phase_keeps_the_peak_that_came_before_the_inner_phase(monkeypatch):
    mem = FakeAllocator()
    monkeypatch.setattr(measure, "allocator_mib", mem.read)
    monkeypatch.setattr(measure, "reset_peak", mem.reset)
    monkeypatch.setattr(measure, "synchronize", lambda device: None)
    rec = measure.PhaseRecorder("cuda")
    with rec.phase("step"):
        mem.alloc(100)  # a 100 MiB temporary ...
        mem.alloc(-100)  # ... gone before the inner phase starts
        with rec.phase("forward"):
            mem.alloc(30)
    df = rec.to_frame()
    assert df.loc["forward", "peak_allocated_mib"] == 30
    assert df.loc["step", "peak_allocated_mib"] == 100  # the inner reset must not hide it
    assert df.loc["step", "allocated_mib"] == 30


def test_allocator_reading_without_cuda_is_nan(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert all(math.isnan(v) for v in measure.allocator_mib().values())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU error")
def test_nvml_fails_clearly_without_a_driver():
    with pytest.raises(RuntimeError, match="NVML needs an NVIDIA GPU"):
        measure.nvml_used_mib()


def fake_pynvml(monkeypatch, used_mib, names=None):
    """A pynvml stand-in: a machine whose GPU i has ``used_mib[i]`` MiB in use."""
    uuids = [f"GPU-{i}aaa-{i}" for i in range(len(used_mib))]
    nvml = types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: len(used_mib),
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetUUID=lambda h: uuids[h],
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=used_mib[h] * 2**20, total=80 * 2**30),
        nvmlDeviceGetName=lambda h: (names or ["NVIDIA H100 80GB HBM3"] * len(used_mib))[h],
        nvmlSystemGetDriverVersion=lambda: "580.1",
    )
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    return uuids


@pytest.mark.parametrize(("visible", "expected"), [(None, 100.0), ("2,3", 300.0), ("3", 400.0), ("GPU-2aaa", 300.0)])
def test_nvml_reads_the_gpu_this_process_sees(monkeypatch, visible, expected):
    """With CUDA_VISIBLE_DEVICES=2,3 this process's cuda:0 is the machine's third GPU, not its first."""
    fake_pynvml(monkeypatch, [100.0, 200.0, 300.0, 400.0])
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert measure.nvml_used_mib(0) == expected


def test_nvml_refuses_a_device_this_process_cannot_see(monkeypatch):
    fake_pynvml(monkeypatch, [100.0, 200.0])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    with pytest.raises(RuntimeError, match="not visible"):
        measure.nvml_used_mib(1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert measure.visible_gpu_count() == 0


def test_gpu_info_describes_the_visible_gpus(monkeypatch):
    fake_pynvml(monkeypatch, [1.0, 2.0, 3.0], names=["NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3", "NVIDIA L4"])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    info = env.gpu_info()
    assert info == {"name": "NVIDIA L4", "memory_gib": 80.0, "driver": "580.1", "count": 1}
    assert env.gpu_info(1) is None


def test_gpu_budget_restores_the_fraction_that_was_in_force(monkeypatch):
    fractions = [0.5]  # the caller had already capped this process at half the card
    monkeypatch.setattr(measure, "require_cuda", lambda what: None)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(total_memory=80 * 2**30))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d=None: fractions.append(f))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda d=None: fractions[-1], raising=False)
    with measure.gpu_budget(20.0) as outer:
        assert outer == 0.25
        with measure.gpu_budget(8.0) as inner:
            assert inner == 0.1
        assert fractions[-1] == 0.25  # the enclosing budget, not the whole card
    assert fractions[-1] == 0.5  # the caller's own cap, not 1.0


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
def test_nvml_agrees_with_torchs_own_nvml_reading():
    torch.ones(1, device="cuda")
    assert measure.nvml_used_mib(0) == pytest.approx(torch.cuda.device_memory_used(0) / 2**20, abs=64)


@pytest.mark.gpu
def test_phase_recorder_nested_peak_on_the_gpu():
    rec = measure.PhaseRecorder("cuda")
    with rec.phase("outer"):
        tmp = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")  # 64 MiB, freed before the inner phase
        del tmp
        with rec.phase("inner"):
            keep = torch.empty(2**20, dtype=torch.uint8, device="cuda")
    df = rec.to_frame()
    assert df.loc["outer", "peak_allocated_mib"] - df.loc["inner", "peak_allocated_mib"] >= 63
    del keep


@pytest.mark.gpu
def test_gpu_budget_nested_restores_the_outer_cap():
    with measure.gpu_budget(4.0):
        with measure.gpu_budget(1.0):
            pass
        assert torch.cuda.get_per_process_memory_fraction(0) == pytest.approx(
            4.0 * 2**30 / torch.cuda.get_device_properties(0).total_memory)
    assert torch.cuda.get_per_process_memory_fraction(0) == 1.0


@pytest.mark.gpu
def test_gpu_budget_raises_oom_and_restores():
    with measure.gpu_budget(1.0):
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    x = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")  # fits again once restored
    del x
    torch.cuda.empty_cache()


def test_t4_budget_subtracts_the_context(monkeypatch):
    monkeypatch.setattr(measure, "require_cuda", lambda what: None)
    monkeypatch.setattr(measure, "nvml_used_mib", lambda device=0: 1000.0 + 600.0)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=0: 88 * 2**20)
    budget = measure.t4_budget(1000.0)
    assert budget.context_gib == pytest.approx((600 - 88) / 1024)
    assert budget.budget_gib == pytest.approx(14.75 - (600 - 88) / 1024)
    assert "14.75 GiB (T4)" in budget.describe() and f"{budget.budget_gib:.2f} GiB" in budget.describe()


def test_t4_budget_rejects_bad_input(monkeypatch):
    monkeypatch.setattr(measure, "require_cuda", lambda what: None)
    monkeypatch.setattr(measure, "nvml_used_mib", lambda device=0: 40_000.0)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=0: 0)
    with pytest.raises(ValueError, match="MiB"):
        measure.t4_budget(-1.0)
    with pytest.raises(ValueError, match="positive"):
        measure.t4_budget(0.0, card_gib=0)
    with pytest.raises(ValueError, match="does not leave room"):
        measure.t4_budget(0.0)  # a 39 GiB "context" on a 14.75 GiB card


def test_t4_budget_needs_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(RuntimeError):
        measure.t4_budget(0.0)
