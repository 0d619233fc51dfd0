"""helpers.collectives: bandwidths and the launched benchmark on 2 CPU processes (gloo)."""

import math
import os
import sys

import pytest

from helpers import collectives, env, estimates, launching, profiler

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


def test_trace_reading_and_nvlink_parsing_have_one_home():
    """They live in profiler (traces) and env (the machine), not in collectives."""
    for name in ("collective_kind", "communication_from_trace", "communication_overlap"):
        assert callable(getattr(profiler, name)) and not hasattr(collectives, name)
    for name in ("nvlink_status", "parse_nvlink_status"):
        assert callable(getattr(env, name)) and not hasattr(collectives, name)


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


def test_bandwidth_by_world_size_puts_two_sweeps_side_by_side():
    def rec(ws, coll, size, t):
        return {"world_size": ws, "n_ranks": ws, "collective": coll, "size_bytes": size, "time_q1_s": 0.5 * t,
                "time_median_s": t, "time_q3_s": 2 * t,
                "busbw_gb_s": collectives.bus_bandwidth(coll, size, t, ws) / 1e9}
    records = [rec(ws, c, s, 1e-3 * s / 2**20) for ws in (2, 4) for c in ("all_reduce", "broadcast") for s in (2**20, 2**30)]
    table = collectives.bandwidth_by_world_size(records)
    assert table.index.names == ["collective", "size (MiB)"] and len(table) == 4
    assert list(table.columns.get_level_values(0).unique()) == [2, 4]
    ar = table.loc[("all_reduce", 1024.0)]
    assert ar[(4, "busbw (GB/s)")] == pytest.approx(1.5 * ar[(2, "busbw (GB/s)")])  # 2(n-1)/n: 1 at 2, 1.5 at 4
    assert ar[(2, "busbw, q3 time (GB/s)")] < ar[(2, "busbw (GB/s)")] < ar[(2, "busbw, q1 time (GB/s)")]
    with pytest.raises(ValueError, match="world_size"):
        collectives.bandwidth_by_world_size([{k: v for k, v in records[0].items() if k != "world_size"}])
