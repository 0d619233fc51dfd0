import math
import sys
import time
import types

import pytest
import torch

from helpers import env, measure


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


def fake_cuda(monkeypatch):
    """A FakeAllocator behind torch.cuda's own calls, so measure's real reset_peak and synchronize run."""
    mem = FakeAllocator()
    monkeypatch.setattr(measure, "allocator_mib", mem.read)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", mem.reset)
    return mem


def test_peak_on_a_cpu_is_nan_and_runs_the_block():
    ran = []
    with measure.peak("cpu") as p:
        ran.append(1)
    assert ran == [1] and math.isnan(p.mib) and math.isnan(p.start_mib)


def test_peak_reads_the_blocks_peak_after_a_reset(monkeypatch):
    mem = fake_cuda(monkeypatch)
    mem.alloc(500)
    mem.alloc(-400)  # an earlier 500 MiB peak that the block must not report
    with measure.peak() as p:
        assert math.isnan(p.mib)  # nothing read while the block runs
        mem.alloc(50)
        mem.alloc(-50)
        mem.alloc(20)
    assert (p.start_mib, p.mib, p.extra_mib) == (100, 150, 50)


def test_nested_peaks_and_phases_keep_the_outer_peak(monkeypatch):
    mem = fake_cuda(monkeypatch)
    rec = measure.PhaseRecorder("cuda")
    with measure.peak() as outer:
        mem.alloc(100)
        mem.alloc(-100)  # gone before the inner reset
        with rec.phase("inner phase"):
            mem.alloc(10)
            with measure.peak() as inner:
                mem.alloc(5)
            measure.reset_peak("cuda")  # a chapter's own reset inside both
        mem.alloc(-15)
    assert inner.mib == 15
    assert rec.to_frame().loc["inner phase", "peak_allocated_mib"] == 15
    assert outer.mib == 100  # no inner reset hides it


def test_peak_is_read_when_the_block_raises(monkeypatch):
    mem = fake_cuda(monkeypatch)
    with pytest.raises(torch.OutOfMemoryError):
        with measure.peak() as p:
            mem.alloc(70)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert p.mib == 70 and not measure._open_peaks


@pytest.mark.parametrize(("err", "expected"), [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
    (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), True),
    (RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"), True),
    (RuntimeError("CUDA error: out of memory"), True),
    (RuntimeError("CUDA error: an illegal memory access was encountered"), False),
    (ValueError("out of memory"), False),  # only runtime errors carry library messages
])
def test_is_out_of_memory(err, expected):
    assert measure.is_out_of_memory(err) is expected


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
def test_peak_on_the_gpu_sees_a_temporary_and_nests():
    torch.cuda.synchronize()
    with measure.peak() as outer:
        tmp = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")  # 64 MiB, freed before the inner block
        del tmp
        with measure.peak("cuda") as inner:
            keep = torch.empty(2**20, dtype=torch.uint8, device="cuda")
    assert inner.extra_mib == pytest.approx(1.0)
    assert outer.extra_mib >= 64 - 1e-6
    del keep


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
