"""helpers.collectives: nccl-tests' bandwidth definitions, the engines' bytes per step, trace reading,
and the launched benchmark on 2 CPU processes (gloo)."""

import json
import math
import os
import sys

import pytest

from helpers import collectives, launching

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "notebooks", "scripts", "collectives_bench.py")


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8, 64])
def test_bus_factors_are_the_nccl_tests_ones(n):
    assert collectives.bus_factor("all_reduce", n) == pytest.approx(2 * (n - 1) / n)
    assert collectives.bus_factor("reduce_scatter", n) == pytest.approx((n - 1) / n)
    assert collectives.bus_factor("all_gather", n) == pytest.approx((n - 1) / n)
    assert collectives.bus_factor("broadcast", n) == 1.0
    # an all-reduce is a reduce-scatter followed by an all-gather: the factors add up
    assert collectives.bus_factor("all_reduce", n) == pytest.approx(
        collectives.bus_factor("reduce_scatter", n) + collectives.bus_factor("all_gather", n))
    assert collectives.sent_factor("broadcast", n) == pytest.approx((n - 1) / n)


def test_alg_and_bus_bandwidth():
    assert collectives.algorithm_bandwidth(2e9, 0.5) == 4e9
    assert collectives.bus_bandwidth("all_reduce", 2e9, 0.5, 2) == 4e9  # factor 1 at n = 2
    assert collectives.bus_bandwidth("all_reduce", 2e9, 0.5, 4) == pytest.approx(6e9)  # 4e9 x 1.5
    assert collectives.bus_bandwidth("all_gather", 2e9, 0.5, 4) == pytest.approx(3e9)
    with pytest.raises(ValueError, match="collective"):
        collectives.bus_factor("all_to_all", 2)
    with pytest.raises(ValueError):
        collectives.bus_factor("all_reduce", 0)
    with pytest.raises(ValueError):
        collectives.algorithm_bandwidth(1, 0)


def totals(n_params, n, **kw):
    table = collectives.communication_table(n_params, n, **kw)
    return table.groupby("engine")["sent per rank (bytes)"].sum()


@pytest.mark.parametrize("n", [2, 4, 8])
def test_engine_bytes_follow_the_formulas(n):
    psi = 1e9
    sent = totals(psi, n)
    ring = 2 * (n - 1) / n * psi * 4  # DDP: a ring all-reduce of fp32 gradients
    assert sent["ddp"] == pytest.approx(ring)
    assert sent["zero1"] == pytest.approx(1.5 * ring)  # + the parameter broadcasts, as PyTorch runs ZeRO-1
    assert sent["zero2"] == pytest.approx(ring)  # reduce-scatter + one all-gather: DDP's bytes
    assert sent["zero3"] == pytest.approx(1.5 * ring)  # + the backward all-gather
    ratio = collectives.ratio_to_ddp(collectives.communication_table(psi, n))
    assert ratio.to_dict() == pytest.approx({"ddp": 1.0, "zero1": 1.5, "zero2": 1.0, "zero3": 1.5})
    bus = collectives.ratio_to_ddp(collectives.communication_table(psi, n), "bus bytes")
    assert bus["zero1"] == pytest.approx(1 + n / (2 * (n - 1)))  # sequential broadcasts: 2x DDP's time at n = 2
    assert bus["zero3"] == pytest.approx(1.5)


def test_engine_bytes_reach_the_papers_volumes_for_many_ranks():
    """Rajbhandari et al. 2020, section 7.2: 2 Psi (DP, P_os+g) and 3 Psi (P_os+g+p) per process, large N."""
    psi, n = 1e9, 4096
    sent = totals(psi, n, param_bytes=1, grad_bytes=1)  # in elements
    for engine in ("ddp", "zero2", "zero3"):
        assert sent[engine] / psi == pytest.approx(collectives.PAPER_VOLUME_PSI[engine], rel=1e-3)
    # ZeRO-1 as PyTorch runs it moves 3 Psi, 1.5x the paper's P_os (which reduce-scatters instead)
    assert sent["zero1"] / psi == pytest.approx(1.5 * collectives.PAPER_VOLUME_PSI["zero1"], rel=1e-3)


def test_widths_and_bad_engines():
    bf16 = totals(1e6, 2, param_bytes=2, grad_bytes=2)
    fp32 = totals(1e6, 2)
    assert (bf16 * 2).to_dict() == pytest.approx(fp32.to_dict())
    one = collectives.communication_table(1e6, 1)
    assert (one["sent per rank (bytes)"] == 0).all()  # nothing to send alone ...
    assert one.loc[one.collective == "broadcast", "bus bytes"].item() == 4e6  # ... though a broadcast's factor is 1
    with pytest.raises(ValueError, match="engine"):
        collectives.engine_transfers("zero4", 1e6, 2)


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
    assert len(records) == 4 * 4 and set(records["collective"]) == set(collectives.COLLECTIVES)
    assert (records["n_ranks"] == 2).all() and (records["repeats"] == 10).all()
    assert (records["time_min_s"] > 0).all()
    assert (records["time_min_s"] <= records["time_median_s"]).all()
    assert (records["time_median_s"] <= records["time_max_s"]).all()
    for row in records.itertuples():
        assert row.size_bytes % (2 * 4) == 0 and 4096 <= row.size_bytes <= 262144
        want = collectives.bus_factor(row.collective, 2) * row.size_bytes / row.time_median_s / 1e9
        assert math.isclose(row.busbw_gb_s, want, rel_tol=1e-9)
        assert 0 < row.busbw_gb_s < 1000  # GB/s: a sane number for two processes of one machine
    table = collectives.bandwidth_table(records)
    assert table.index.names == ["collective", "size (MiB)"] and len(table) == 16
