"""Timing, profiler and memory-snapshot helpers (chapter 8)."""

import gzip
import json
import math
import time

import numpy as np
import pytest
import torch
from torch.profiler import record_function

from helpers import gpus, memsnap, profiler, timing

# --- timing ---------------------------------------------------------------------------------------


def test_spread_matches_numpy_quartiles():
    samples = (0.9, 0.1, 0.5, 0.3, 0.7, 0.2, 0.8, 0.4, 0.6, 1.0)
    s = timing.Spread.of(samples)
    q1, med, q3 = np.percentile(samples, [25, 50, 75])  # numpy's default is the inclusive method
    assert (s.q1, s.median, s.q3) == pytest.approx((q1, med, q3))
    assert (s.min, s.max) == (0.1, 1.0)
    assert s.iqr == pytest.approx(q3 - q1)


def test_spread_needs_samples():
    with pytest.raises(ValueError, match="at least one"):
        timing.Spread.of(())


@pytest.mark.parametrize(
    ("busy", "host", "expected"),
    [
        (0.95, 0.1, "GPU-bound"),
        (0.9, 1.0, "GPU-bound"),
        (0.8, 1.0, "mixed"),  # 70–90% busy: both sides matter
        (0.1, 0.95, "host-bound"),
        (0.34, 0.75, "host-bound"),  # a step whose optimizer tail runs after the host is done
        (0.1, 0.3, "GPU idle, host waiting"),
        (0.6, 0.9, "host-bound"),
        (0.6, 0.4, "mixed"),
        (0.75, 0.58, "mixed"),
        (None, None, "CPU run"),
    ],
)
def test_verdict_thresholds(busy, host, expected):
    assert timing.verdict(busy, host) == expected


def test_verdict_rejects_a_busy_fraction_above_one():
    with pytest.raises(ValueError, match="fraction"):
        timing.verdict(1.5, 0.5)


def test_time_it_on_cpu_measures_wall_time_of_a_sleep():
    t = timing.time_it(lambda: time.sleep(0.005), device="cpu", warmup=1, repeat=10)
    assert len(t.wall_s) == 10
    assert t.host_s == t.wall_s and t.gpu_s is None and t.gpu_busy is None
    assert 0.005 <= t.median_s < 0.05
    assert t.verdict == "CPU run"
    row = t.summary()
    assert row["repeats"] == 10 and "GPU busy" not in row


def test_time_it_counts_warmup_and_repeats():
    calls = []
    timing.time_it(lambda: calls.append(1), device="cpu", warmup=3, repeat=10)
    assert len(calls) == 13


@pytest.mark.parametrize(("warmup", "repeat"), [(-1, 10), (0, 0)])
def test_time_it_rejects_bad_counts(warmup, repeat):
    with pytest.raises(ValueError, match="warmup"):
        timing.time_it(lambda: None, device="cpu", warmup=warmup, repeat=repeat)


def _timed(*wall):
    return timing.Timed(tuple(wall), tuple(wall), None, None, None, "cpu")


def test_compare_separates_real_differences_from_noise():
    base = _timed(1.00, 1.01, 0.99, 1.02, 0.98)
    fast = _timed(0.50, 0.51, 0.49, 0.50, 0.52)
    noisy = _timed(0.97, 1.03, 0.95, 1.05, 1.0)
    out = timing.compare({"base": base, "fast": fast, "noisy": noisy}, "base")
    assert out["fast"]["difference"] == "faster" and out["fast"]["speed-up"] == pytest.approx(2.0, rel=0.02)
    assert out["noisy"]["difference"] == "within the noise"
    with pytest.raises(ValueError, match="baseline"):
        timing.compare({"a": base}, "b")


# --- profiler: pure functions ----------------------------------------------------------------------


def test_union_length_counts_overlaps_once():
    assert profiler.union_length([(0, 2), (1, 3), (5, 6)]) == 4
    assert profiler.union_length([]) == 0
    with pytest.raises(ValueError):
        profiler.union_length([(3, 1)])


def test_union_and_intersection_of_intervals():
    assert profiler.union([(5, 6), (0, 2), (1, 3), (3, 4)]) == [(0, 4), (5, 6)]  # touching ones merge
    # each side may overlap itself: it is counted once
    assert profiler.intersection_length([(0, 10), (5, 15)], [(2, 4), (3, 6), (14, 20)]) == 4 + 1
    assert profiler.intersection_length([(0, 1)], [(2, 3)]) == 0
    assert profiler.intersection_length([], [(0, 1)]) == 0


# Real kernel names (cuBLAS on Hopper and Ampere, cuBLAS's gemv, CUTLASS, FlashAttention, cuDNN's SDPA,
# NCCL, PyTorch's own kernels, and Inductor's Triton kernels from torch.compile(mode="max-autotune")).
REAL_KERNELS = [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel"
     "__5x_cublas", "GEMM"),
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "GEMM"),
    ("sm80_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize64x64x8_stage3_warpsize1x2x1_ffma_aligna4_alignc4_execute_kernel"
     "__51_cublas", "GEMM"),
    ("void gemmSN_TN_kernel<float, 128, 16, 2, 4, 4, 4, true, cublasGemvTensorStridedBatched<float const>, "
     "cublasGemvTensorStridedBatched<float const>, cublasGemvTensorStridedBatched<float> >(cublasGemmSmallNParams"
     "<cublasGemvTensorStridedBatched<float const>, cublasGemvTensorStridedBatched<float const>, "
     "cublasGemvTensorStridedBatched<float>, float>)", "GEMM"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>"
     "(cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8::Params)", "GEMM"),
    ("triton_tem_fused_mm_0", "GEMM"),
    ("triton_tem_fused_addmm_gelu_1", "GEMM"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, "
     "cutlass::bfloat16_t, Flash_kernel_traits<64, 128, 128, 4, cutlass::bfloat16_t> >, false, true, false, false, "
     "true, true, false, false>(pytorch_flash::Flash_fwd_params)", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x64x64_4x1x1_kernel0_0", "attention"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    ("void (anonymous namespace)::softmax_warp_forward<c10::BFloat16, c10::BFloat16, float, 9, false, false>"
     "(c10::BFloat16*, c10::BFloat16 const*, int, int, int, bool const*, int, bool)", "element-wise / normalisation"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float>(int, float, "
     "c10::BFloat16 const*, c10::BFloat16 const*, c10::BFloat16 const*, float*, float*, c10::BFloat16*)",
     "element-wise / normalisation"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, "
     "std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, std::array<char*, 3ul>)",
     "element-wise / normalisation"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespace)::OpaqueType<2u>, "
     "unsigned int, 3, 128, 1>(...)", "element-wise / normalisation"),
    ("triton_red_fused__to_copy_add_native_layer_norm_1", "element-wise / normalisation"),
]


@pytest.mark.parametrize(("name", "expected"), REAL_KERNELS, ids=[n[:40] for n, _ in REAL_KERNELS])
def test_kernel_category_of_real_kernel_names(name, expected):
    assert profiler.kernel_category(name) == expected


@pytest.mark.parametrize("name", ["concatenate_rows_kernel", "expand_weights", "address_translate", "renormalize_v2",
                                  "my_reindexing_kernel", "fastmultiply"])
def test_kernel_category_does_not_file_unknown_kernels_by_a_few_letters(name):
    """Short operator words (cat, exp, add, norm, index, mul) count as words of the name, not as any substring."""
    assert profiler.kernel_category(name) == "other"


@pytest.mark.parametrize(
    ("name", "cat", "phase", "expected"),
    [
        ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "kernel", "forward", "GEMM"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "kernel", "backward", "GEMM"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26", "kernel", "backward", "attention"),
        ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64>>", "kernel", "forward", "attention"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl>", "kernel", None,
         "element-wise / normalisation"),
        ("void at::native::multi_tensor_apply_kernel<TensorListMetadata<4>, PointwiseOpScalarFunctor>", "kernel",
         "optimizer", "optimizer"),
        ("Memcpy HtoD (Pageable -> Device)", "gpu_memcpy", "forward", "memcpy / memset"),
        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "kernel", "backward", "communication"),
        ("some_custom_kernel_xyz", "kernel", None, "other"),
    ],
)
def test_kernel_category(name, cat, phase, expected):
    assert profiler.kernel_category(name, cat=cat, phase=phase) == expected


def _write_trace(path, events):
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)


def _x(cat, name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid, "args": args}


def test_from_trace_computes_busy_phases_and_categories(tmp_path):
    """A hand-made trace with known answers: kernels on [10,30], [20,40] (overlapping) and [60,70]."""
    path = tmp_path / "t.json.gz"
    _write_trace(path, [
        _x("user_annotation", "ProfilerStep#1", -5, 100),
        _x("user_annotation", "forward", 0, 20),
        _x("cuda_runtime", "cudaLaunchKernel", 2, 1, correlation=1),
        _x("cuda_runtime", "cudaLaunchKernel", 4, 1, correlation=2),
        _x("user_annotation", "optimizer", 40, 10),
        _x("cuda_runtime", "cudaLaunchKernel", 42, 1, correlation=3),
        _x("kernel", "nvjet_gemm", 10, 20, tid=7, correlation=1, stream=7),
        _x("kernel", "vectorized_elementwise_kernel", 20, 20, tid=8, correlation=2, stream=8),
        _x("kernel", "multi_tensor_apply_kernel", 60, 10, tid=7, correlation=3, stream=7),
    ])
    p = profiler.from_trace(path)
    assert p.steps == 1 and p.windows_us == [(5.0, 75.0)]  # first event to the last kernel's end
    assert p.gpu_busy == pytest.approx(40 / 70)
    assert p.gpu_ms == pytest.approx(0.050)
    assert p.kernels_per_step == 3 and p.launches_per_step == 3
    cats = p.categories()["GPU time (ms/step)"]
    assert cats.sum() == pytest.approx(p.gpu_ms)
    assert cats["GEMM"] == pytest.approx(0.02) and cats["optimizer"] == pytest.approx(0.01)
    assert cats["element-wise / normalisation"] == pytest.approx(0.02)
    by_name = p.categories(use_phases=False)["GPU time (ms/step)"]
    assert by_name["optimizer"] == 0 and by_name["element-wise / normalisation"] == pytest.approx(0.03)
    ph = p.phases()
    assert list(ph.index) == ["forward", "optimizer"]
    assert ph.loc["forward", "GPU time (ms/step)"] == pytest.approx(0.04)
    assert ph.loc["optimizer", "host time (ms/step)"] == pytest.approx(0.01)


def test_from_trace_needs_profiler_steps(tmp_path):
    path = tmp_path / "t.json.gz"
    _write_trace(path, [_x("cpu_op", "aten::mm", 0, 5)])
    with pytest.raises(ValueError, match="ProfilerStep"):
        profiler.from_trace(path)


def test_self_times_subtract_children():
    import pandas as pd

    ops = pd.DataFrame({"ts_us": [0.0, 2.0, 6.0, 20.0], "dur_us": [10.0, 3.0, 2.0, 4.0], "tid": [1, 1, 1, 1]})
    assert list(profiler._self_times(ops)) == [5.0, 3.0, 2.0, 4.0]


# --- profiler on a real (CPU) step ---------------------------------------------------------------------


def _tiny_step():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(32, 64)

    def step():
        with record_function("forward"):
            loss = model(x).square().mean()
        with record_function("backward"):
            loss.backward()
        with record_function("optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)

    return step


def test_profile_on_cpu_splits_self_time_into_categories(tmp_path):
    p = profiler.profile(_tiny_step(), device="cpu", warmup=1, active=2, trace_path=tmp_path / "cpu.json")
    assert p.steps == 2 and not p.on_gpu and p.gpu_busy is None
    cats = p.categories()
    total_self = profiler._self_times(p.cpu_ops).sum() / 2 / 1e3
    assert cats["CPU self time (ms/step)"].sum() == pytest.approx(total_self)
    assert cats.loc["GEMM", "CPU self time (ms/step)"] > 0 and cats.loc["optimizer", "CPU self time (ms/step)"] > 0
    assert list(p.phases().index) == ["forward", "backward", "optimizer"]
    assert (tmp_path / "cpu.json").exists()
    fig = profiler.timeline(p)
    assert fig.axes[0].get_yticklabels()[0].get_text() == "CPU: phases"


# --- capability ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("major", "minor", "bf16", "dtype"), [(7, 5, False, torch.float16), (8, 0, True, torch.bfloat16),
                                                               (9, 0, True, torch.bfloat16)])
def test_capability_rules(major, minor, bf16, dtype):
    cap = gpus.Capability("GPU", major, minor)
    assert cap.bf16 is bf16 and cap.tf32 is bf16 and cap.flash_attention is bf16
    assert cap.amp_dtype == dtype


# --- GPU ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_tiny_kernel_loop_is_host_bound_and_big_matmul_gpu_bound():
    x = torch.randn(64, 64, device="cuda")
    small = timing.time_it(lambda: [x.add_(1) for _ in range(200)], device="cuda")
    assert small.verdict == "host-bound", small.evidence
    assert small.gpu_busy < 0.5 and small.kernels_per_call == 200
    assert 0 < small.kernel_s < small.wall.median
    assert small.profile is not None and small.profile.steps == 3
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    big = timing.time_it(lambda: a @ a, device="cuda")
    assert big.verdict == "GPU-bound", big.evidence
    assert big.host.median < 0.2 * big.wall.median
    # CUDA events and the wall clock agree for a GPU-bound call
    assert big.gpu.median == pytest.approx(big.wall.median, rel=0.1)


@pytest.mark.gpu
def test_profile_categories_sum_to_gpu_time():
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)

    def step():
        with record_function("forward"):
            torch.nn.functional.gelu(a @ a)

    p = profiler.profile(step, device="cuda", warmup=1, active=3)
    cats = p.categories()["GPU time (ms/step)"]
    assert cats.sum() == pytest.approx(p.gpu_ms)
    assert cats["GEMM"] > cats["element-wise / normalisation"] > 0
    assert 0 < p.gpu_busy <= 1


@pytest.mark.gpu
def test_memory_snapshot_peak_and_leak():
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    kept = []
    with memsnap.record() as rec:
        a = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
        b = torch.empty(128 * 2**20, dtype=torch.uint8, device="cuda")
        del a, b
        kept.append(torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda"))  # the planted leak
    df = memsnap.timeline(rec)
    assert df["total"].max() - rec.baseline_bytes == 384 * 2**20
    assert memsnap.peak_bytes(rec) == torch.cuda.max_memory_allocated()
    assert memsnap.peak_event(rec)["event"] == "alloc other"  # b's allocation made the peak
    leaks = memsnap.survivors(rec)
    assert leaks["MiB"].sum() == pytest.approx(64) and leaks["allocations"].sum() == 1
    allocated_in, called_from = leaks.index[0]
    assert "test_memory_snapshot_peak_and_leak" in called_from


# --- memory snapshot: pure functions on a hand-made history -------------------------------------------

_FWD = [{"filename": "/x/site-packages/transformers/models/bert/modeling_bert.py", "name": "forward", "line": 10},
        {"filename": "/tmp/ipykernel_7/123456.py", "name": "step", "line": 3}]
_OPT = [{"filename": "/x/site-packages/torch/optim/adamw.py", "name": "_multi_tensor_adamw", "line": 5}]


def _recording():
    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": _FWD},
        {"action": "alloc", "addr": 2, "size": 50, "frames": []},  # the autograd engine
        {"action": "segment_alloc", "addr": 9, "size": 4096, "frames": []},  # not a tensor: ignored
        {"action": "alloc", "addr": 3, "size": 30, "frames": _OPT},
        {"action": "free_completed", "addr": 3, "size": 30, "frames": _OPT},
        {"action": "free_completed", "addr": 1, "size": 100, "frames": _FWD},
        {"action": "free_completed", "addr": 77, "size": 200, "frames": []},  # allocated before recording
    ]
    return memsnap.Recording(device=0, baseline_bytes=1000, snapshot={"device_traces": [trace]})


def test_memsnap_timeline_by_origin():
    df = memsnap.timeline(_recording())
    assert list(df["total"]) == [1100, 1150, 1180, 1150, 1050, 850]
    assert list(df["event"]) == ["alloc forward", "alloc backward", "alloc optimizer", "free optimizer",
                                 "free forward", "free before recording"]
    assert df.iloc[-1]["before recording"] == 800 and df.iloc[-1]["backward"] == 50
    assert memsnap.peak_bytes(_recording()) == 1180
    assert memsnap.peak_event(_recording())["event"] == "alloc optimizer"
    assert memsnap.plot(_recording()).axes[0].get_ylabel() == "allocated (GiB)"


def test_memsnap_survivors_name_the_library_frame_and_the_callers_cell():
    rec = _recording()
    rec.snapshot["device_traces"][0].pop(5)  # addr 1 (forward) is never freed now: a leak
    leaks = memsnap.survivors(rec)
    assert leaks.loc[("forward (modeling_bert.py, line 10)", "step (a cell, line 3)"), "allocations"] == 1
    assert leaks.loc[("autograd engine (no Python frame)", "autograd engine (no Python frame)"), "MiB"] == \
        pytest.approx(50 / 2**20)


@pytest.mark.parametrize(("frames", "expected"), [([], "backward"), (_OPT, "optimizer"), (_FWD, "forward"),
                                                  ([{"filename": "a.py", "name": "main", "line": 1}], "other")])
def test_memsnap_origin(frames, expected):
    assert memsnap.origin(frames) == expected



def test_time_it_back_to_back_loop_on_cpu():
    calls = []
    t = timing.time_it(lambda: calls.append(time.sleep(0.002)), device="cpu", warmup=1, repeat=10, loop=3)
    assert len(calls) == 1 + 10 + 10 * 3
    assert len(t.loop_s) == 10 and 0.002 <= t.loop.median < 0.05
    assert "back to back, per call (ms)" in t.summary()


def test_difference_of_two_spreads():
    base = timing.Spread.of((1.0, 1.01, 0.99, 1.0, 1.02))
    assert timing.difference(base, timing.Spread.of((0.5, 0.51, 0.49, 0.5))) == "faster"
    assert timing.difference(base, timing.Spread.of((2.0, 2.1, 1.9, 2.0))) == "slower"
    assert timing.difference(base, timing.Spread.of((1.005, 1.0, 1.01, 1.0))) == "within the noise"
    wide = timing.Spread.of((0.5, 1.5, 1.0, 0.6, 1.4))  # median 1.0 +- a wide IQR
    assert timing.difference(wide, timing.Spread.of((1.2, 1.21, 1.19))) == "within the noise"


# --- profiler: communication kernels of a trace (chapter 7) ----------------------------------------


def test_collective_kind_reads_torch_and_nccl_names():
    assert profiler.collective_kind("allreduce") == "all_reduce"
    assert profiler.collective_kind("_reduce_scatter_base") == "reduce_scatter"
    assert profiler.collective_kind("allgather_into_tensor_coalesced") == "all_gather"
    assert profiler.collective_kind("ncclDevKernel_Broadcast_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == "broadcast"
    assert profiler.collective_kind("ncclDevKernel_SendRecv") == "other"


def test_communication_from_trace_parses_nccl_kernels(tmp_path):
    """A hand-written trace in the shape torch.profiler writes on GPUs (no GPU here: this checks the parsing)."""
    def kernel(name, coll, nin, nout, dur_us, dtype="Float"):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": 0, "dur": dur_us,
                "args": {"Collective name": coll, "In msg nelems": nin, "Out msg nelems": nout,
                         "Group size": 2, "dtype": dtype}}
    events = [
        kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL(x)", "allreduce", 2**28, 2**28, 1000.0),
        kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL(x)", "allreduce", 2**28, 2**28, 1000.0),
        kernel("ncclDevKernel_AllGather_RING_LL(x)", "_allgather_base", 2**27, 2**28, 500.0, "BFloat16"),
        {"ph": "X", "cat": "kernel", "name": "nvjet_hsh_128x256", "ts": 0, "dur": 5000.0, "args": {}},
        {"ph": "X", "cat": "cpu_op", "name": "c10d::allreduce_", "ts": 0, "dur": 10.0, "args": {}},
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    table = profiler.communication_from_trace(path)
    assert list(table.index) == ["all_gather", "all_reduce"]  # the GEMM and the CPU op are left out
    ar, ag = table.loc["all_reduce"], table.loc["all_gather"]
    assert ar["calls"] == 2 and ar["S (MiB)"] == 2 * 1024 and ar["kernel time (ms)"] == pytest.approx(2.0)
    assert ar["algbw (GB/s)"] == pytest.approx(2 * 2**30 / 2e-3 / 1e9)
    assert ar["busbw (GB/s)"] == pytest.approx(ar["algbw (GB/s)"])  # factor 1 at n = 2
    assert ag["S (MiB)"] == 512  # the gathered output, bf16
    assert ag["busbw (GB/s)"] == pytest.approx(ag["algbw (GB/s)"] / 2)
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"traceEvents": events[3:]}))
    assert profiler.communication_from_trace(empty).empty


def write_trace(path, events):
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_communication_from_trace_takes_sizes_from_cpu_records_when_kernels_have_none(tmp_path):
    kernel = {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(x)", "ts": 0,
              "dur": 100.0, "args": {"device": 0, "stream": 20}}
    record = {"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "ts": 0, "dur": 1.0,
              "args": {"Collective name": "_reduce_scatter_base", "In msg nelems": 2**20, "Out msg nelems": 2**19,
                       "Group size": 2, "dtype": "Float"}}
    table = profiler.communication_from_trace(write_trace(tmp_path / "t.json", [kernel, kernel, record, record]))
    assert table.loc["reduce_scatter", "calls"] == 2 and table.loc["reduce_scatter", "S (MiB)"] == 8
    bare = profiler.communication_from_trace(write_trace(tmp_path / "bare.json", [kernel]))
    assert bare.loc["reduce_scatter", "calls"] == 1 and math.isnan(bare.loc["reduce_scatter", "S (MiB)"])


def test_communication_overlap_splits_hidden_and_exposed(tmp_path):
    def k(name, ts, dur):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {}}
    events = [
        k("ncclDevKernel_AllReduce_Sum_f32_RING_LL(x)", 0, 100),  # 0-100 us
        k("ncclDevKernel_AllReduce_Sum_f32_RING_LL(x)", 50, 100),  # 50-150: union 0-150
        k("nvjet_hsh_128x256_gemm", 20, 40),  # 20-60 hidden
        k("vectorized_elementwise_kernel", 40, 40),  # 40-80: union with the GEMM 20-80
        k("vectorized_elementwise_kernel", 300, 50),  # 300-350: compute only
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 100, "dur": 50, "args": {}},  # not compute
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 400, "args": {}},  # not a kernel
    ]
    got = profiler.communication_overlap(write_trace(tmp_path / "t.json", events))
    assert got["communication_s"] == pytest.approx(150e-6)
    assert got["hidden_s"] == pytest.approx(60e-6) and got["exposed_s"] == pytest.approx(90e-6)
    assert got["compute_s"] == pytest.approx(110e-6) and got["span_s"] == pytest.approx(350e-6)
    assert got["hidden_fraction"] == pytest.approx(0.4)
    none = profiler.communication_overlap(write_trace(tmp_path / "n.json", events[2:]))
    assert none["communication_s"] == 0 and math.isnan(none["hidden_fraction"])
