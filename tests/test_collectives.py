"""helpers.collectives: bandwidths, trace reading, and the launched benchmark on 2 CPU processes (gloo)."""

import json
import math
import os
import sys

import pytest

from helpers import collectives, estimates, launching

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "notebooks", "scripts", "collectives_bench.py")


def test_alg_and_bus_bandwidth():
    assert collectives.algorithm_bandwidth(2e9, 0.5) == 4e9
    assert collectives.bus_bandwidth("all_reduce", 2e9, 0.5, 2) == 4e9  # factor 1 at n = 2
    assert collectives.bus_bandwidth("all_reduce", 2e9, 0.5, 4) == pytest.approx(6e9)  # 4e9 x 1.5
    assert collectives.bus_bandwidth("all_gather", 2e9, 0.5, 4) == pytest.approx(3e9)
    with pytest.raises(ValueError, match="collective"):
        estimates.bus_factor("all_to_all", 2)
    with pytest.raises(ValueError):
        estimates.bus_factor("all_reduce", 0)
    with pytest.raises(ValueError):
        collectives.algorithm_bandwidth(1, 0)


def test_sizes_between():
    assert collectives.sizes_between(1, 64, 4) == [1, 4, 16, 64]
    assert collectives.sizes_between(2**20, 2**30)[-1] == 2**30
    with pytest.raises(ValueError):
        collectives.sizes_between(8, 4)


def test_collective_kind_reads_torch_and_nccl_names():
    assert collectives.collective_kind("allreduce") == "all_reduce"
    assert collectives.collective_kind("_reduce_scatter_base") == "reduce_scatter"
    assert collectives.collective_kind("allgather_into_tensor_coalesced") == "all_gather"
    assert collectives.collective_kind("ncclDevKernel_Broadcast_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == "broadcast"
    assert collectives.collective_kind("ncclDevKernel_SendRecv") == "other"


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
    table = collectives.communication_from_trace(path)
    assert list(table.index) == ["all_gather", "all_reduce"]  # the GEMM and the CPU op are left out
    ar, ag = table.loc["all_reduce"], table.loc["all_gather"]
    assert ar["calls"] == 2 and ar["S (MiB)"] == 2 * 1024 and ar["kernel time (ms)"] == pytest.approx(2.0)
    assert ar["algbw (GB/s)"] == pytest.approx(2 * 2**30 / 2e-3 / 1e9)
    assert ar["busbw (GB/s)"] == pytest.approx(ar["algbw (GB/s)"])  # factor 1 at n = 2
    assert ag["S (MiB)"] == 512  # the gathered output, bf16
    assert ag["busbw (GB/s)"] == pytest.approx(ag["algbw (GB/s)"] / 2)
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"traceEvents": events[3:]}))
    assert collectives.communication_from_trace(empty).empty


def write_trace(path, events):
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_communication_from_trace_takes_sizes_from_cpu_records_when_kernels_have_none(tmp_path):
    kernel = {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(x)", "ts": 0,
              "dur": 100.0, "args": {"device": 0, "stream": 20}}
    record = {"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "ts": 0, "dur": 1.0,
              "args": {"Collective name": "_reduce_scatter_base", "In msg nelems": 2**20, "Out msg nelems": 2**19,
                       "Group size": 2, "dtype": "Float"}}
    table = collectives.communication_from_trace(write_trace(tmp_path / "t.json", [kernel, kernel, record, record]))
    assert table.loc["reduce_scatter", "calls"] == 2 and table.loc["reduce_scatter", "S (MiB)"] == 8
    bare = collectives.communication_from_trace(write_trace(tmp_path / "bare.json", [kernel]))
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
    got = collectives.communication_overlap(write_trace(tmp_path / "t.json", events))
    assert got["communication_s"] == pytest.approx(150e-6)
    assert got["hidden_s"] == pytest.approx(60e-6) and got["exposed_s"] == pytest.approx(90e-6)
    assert got["compute_s"] == pytest.approx(110e-6) and got["span_s"] == pytest.approx(350e-6)
    assert got["hidden_fraction"] == pytest.approx(0.4)
    none = collectives.communication_overlap(write_trace(tmp_path / "n.json", events[2:]))
    assert none["communication_s"] == 0 and math.isnan(none["hidden_fraction"])


def test_parse_nvlink_status():
    text = """GPU 0: NVIDIA H200 (UUID: GPU-aaaa)
\t Link 0: 26.562 GB/s
\t Link 1: 26.562 GB/s
\t Link 2: <inactive>
GPU 1: NVIDIA H200 (UUID: GPU-bbbb)
\t Link 0: 26.562 GB/s
GPU 2: Tesla T4 (UUID: GPU-cccc)
"""
    got = collectives.parse_nvlink_status(text)
    assert got == {0: [26.562, 26.562], 1: [26.562], 2: []}
    assert collectives.parse_nvlink_status("NVML: Unable to find NVLink") == {}


def test_nvlink_status_without_nvidia_smi(monkeypatch):
    monkeypatch.setattr(collectives.shutil, "which", lambda name: None)
    assert collectives.nvlink_status() is None


@pytest.mark.skipif(sys.platform == "win32", reason="torchrun needs a POSIX system here")
def test_benchmark_on_two_gloo_processes(tmp_path):
    """The launched script, for real: 2 CPU processes, gloo, small sizes (a few seconds)."""
    env = launching.launch_env()
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    out = tmp_path / "bw"
    args = ["--out", out, "--min-bytes", 4096, "--max-bytes", 262144, "--warmup", 2, "--repeat", 10]
    done = launching.run(launching.torchrun(BENCH, 2, args), env=env, timeout_s=180)
    assert "gloo" in done.stdout
    records = launching.read_results(out)
    assert len(records) == 4 * 4 and set(records["collective"]) == set(estimates.COLLECTIVES)
    assert (records["n_ranks"] == 2).all() and (records["repeats"] == 10).all()
    assert (records["time_min_s"] > 0).all()
    assert (records["time_min_s"] <= records["time_median_s"]).all()
    assert (records["time_median_s"] <= records["time_max_s"]).all()
    for row in records.itertuples():
        assert row.size_bytes % (2 * 4) == 0 and 4096 <= row.size_bytes <= 262144
        want = estimates.bus_factor(row.collective, 2) * row.size_bytes / row.time_median_s / 1e9
        assert math.isclose(row.busbw_gb_s, want, rel_tol=1e-9)
        assert 0 < row.busbw_gb_s < 1000  # GB/s: a sane number for two processes of one machine
    table = collectives.bandwidth_table(records)
    assert table.index.names == ["collective", "size (MiB)"] and len(table) == 16
