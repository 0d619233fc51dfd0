"""scripts/multigpu_bench.py: its tiny mode on 2 CPU processes (gloo), end to end, and its GPU-only readers on
fabricated inputs, so that the one run on a 4-GPU machine does not fail on a path never taken here."""

import gzip
import json
import math
import os
import subprocess
import sys

import pytest

from helpers import estimates, launching, models, timing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "multigpu_bench.py")
bench = launching.load_script(SCRIPT)
TINY = ["--tiny", "--layers", "1", "--seq", "16", "--batch", "1", "--vocab", "512", "--warmup", "1", "--steps", "8",
        "--max-bytes", "65536"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, SCRIPT, "--out", str(out), *TINY], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out, json.loads((out / "multigpu_bench.json").read_text())


def test_tiny_run_writes_one_json_and_one_log(tiny_run):
    out, result = tiny_run
    assert sorted(p.name for p in out.iterdir()) == ["multigpu_bench.json", "multigpu_bench.log"]
    log = (out / "multigpu_bench.log").read_text()
    assert "estimated time per part" in log and "torchrun --standalone --nproc_per_node=2" in log
    assert result["status"] == "ok" and result["machine"]["backend"] == "gloo"
    assert result["machine"]["launch_env"] == launching.LAUNCH_ENV_FORCED
    assert set(result["part_s"]) == {"bandwidth", "training", "interleaved", "big"}
    assert set(result["estimated_s"]) == {"startup", "bandwidth", "training", "interleaved", "big", "total"}


def test_tiny_bandwidth_records(tiny_run):
    _, result = tiny_run
    bw = result["bandwidth"]
    sizes = [4096, 16384, 65536]
    assert len(bw) == 4 * len(sizes) and {r["world_size"] for r in bw} == {2}
    for r in bw:
        assert r["n_ranks"] == 2 and len(r["times_s"]) == 10
        assert r["time_min_s"] <= r["time_median_s"] <= r["time_max_s"]
    assert {r["collective"] for r in result["summary"]["bandwidth_at_largest"]} == set(estimates.COLLECTIVES)


def test_tiny_training_records_every_engine_and_world_size(tiny_run):
    _, result = tiny_run
    rows = result["training"]
    keys = sorted((r["engine"], r["world_size"], r["rank"]) for r in rows)
    assert keys == sorted((e, ws, 0) for e in bench.ENGINES for ws in (1, 2))  # rank 0 writes, for all ranks
    psi = models.n_params(models.build("polyglot-ko-1.3b", profile="tiny", head="causal-lm", device="meta",
                                       num_hidden_layers=1, vocab_size=512))
    for r in rows:
        assert r["n_params"] == psi and len(r["step_times_s"]) == 8 and len(r["losses"]) == 9
        assert r["tokens_per_s_per_gpu"] == pytest.approx(16 / r["step_time_median_s"])
        assert r["autocast_bf16"] == (r["engine"] != "fsdp2")
        assert all(math.isnan(p) for p in r["peak_allocated_gib"])  # an allocator statistic: CUDA only
        assert len(r["model_states_gib"]) == r["world_size"]
    by = {(r["engine"], r["world_size"]): r for r in rows if r["rank"] == 0}
    full = 16 * psi / 2**30  # fp32 AdamW, 16 bytes per parameter
    for e in bench.ENGINES:
        assert by[(e, 1)]["model_states_gib_max"] == pytest.approx(full)  # nothing to shard on one rank
    assert by[("ddp", 2)]["model_states_gib_max"] == pytest.approx(full)
    for e in ("zero3", "fsdp2"):  # fully sharded, fp32 shards and states under the bf16 policy too
        assert by[(e, 2)]["model_states_gib_max"] == pytest.approx(full / 2, rel=1e-3)
        assert by[(e, 2)]["formula_states_gib"] == pytest.approx(full / 2)
    scaling = {(r["engine"], r["world_size"]): r for r in result["summary"]["scaling"]}
    assert scaling[("ddp", 1)]["scaling_efficiency"] == 1.0
    assert {"efficiency_lo", "efficiency_hi", "verdict"} <= set(scaling[("fsdp2", 2)])


def test_tiny_comm_rows_hold_the_formula_beside_an_empty_gloo_trace(tiny_run):
    _, result = tiny_run
    comm = result["summary"]["bytes_per_step"]
    psi = result["training"][0]["n_params"]
    fsdp2 = {c["collective"]: c for c in comm if c["engine"] == "fsdp2"}
    assert fsdp2["all_gather"]["formula_S_mib"] == pytest.approx(2 * 2 * psi / 2**20)  # bf16, forward + backward
    assert fsdp2["reduce_scatter"]["formula_S_mib"] == pytest.approx(4 * psi / 2**20)  # fp32 reduction
    assert all(c.get("calls", 0) == 0 for c in comm)  # gloo: no NCCL kernels in a CPU trace
    assert {c["engine"] for c in comm if c["collective"] == "(overlap)"} == set(bench.ENGINES)


def test_tiny_interleaved_record(tiny_run):
    _, result = tiny_run
    (rec,) = result["interleaved"]
    assert (rec["a"], rec["b"], rec["world_size"]) == ("ddp", "fsdp2", 2)
    assert len(rec["a_times_s"]) == len(rec["b_times_s"]) == 10 and rec["lo"] <= rec["ratio_a_over_b"] <= rec["hi"]


def test_tiny_big_model_sharded_from_the_meta_device(tiny_run):
    """Llama-2-7B's tiny twin built on meta, sharded, materialised shard by shard: it trains (a loss near
    ln(vocabulary) from random weights, not NaN) and each rank holds half the fp32 states."""
    _, result = tiny_run
    (rec,) = result["big"]
    psi = models.n_params(models.build("llama-2-7b", profile="tiny", head="causal-lm", device="meta"))
    assert rec["n_params"] == psi and rec["world_size"] == 2 and len(rec["step_times_s"]) == 3
    assert all(abs(loss - math.log(32000)) < 1.0 for loss in rec["losses"])
    assert rec["model_states_gib"] == pytest.approx([8 * psi / 2**30] * 2, rel=1e-3)
    assert rec["formula_states_gib"] == pytest.approx(8 * psi / 2**30)


def test_default_run_on_4_gpus_is_estimated_within_240_s():
    args = bench.parse_args(["--out", "x"])
    args.comm_world_sizes = [4]
    psi = models.n_params(models.build("polyglot-ko-1.3b", profile="full", head="causal-lm", device="meta"))
    est = bench.estimate_s(args, 4, "cuda", psi)
    assert est["total"] <= 240 and est["training"] > est["bandwidth"] > 0
    assert args.max_bytes == 2**32 and args.min_bytes == 2**20 and args.steps >= 8


def test_estimate_only_launches_nothing(tmp_path, capsys):
    assert bench.main(["--out", str(tmp_path), "--tiny", "--ranks", "4", "--estimate-only"]) == 0
    assert "estimated time per part" in capsys.readouterr().out and not any(tmp_path.iterdir())


@pytest.mark.parametrize("bad", [["--rounds", "5"], ["--repeat", "3"], ["--warmup", "0"], ["--big-steps", "0"],
                                 ["--vocab", "50"]])
def test_arguments_are_checked(bad):
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", "x", *bad])


def test_comm_records_read_nccl_kernels_from_a_gpu_like_trace(tmp_path):
    """What rank 0 does with a GPU trace: FSDP2 (bf16 all-gathers, fp32 reduce-scatters) on 4 ranks."""
    psi = 1_000_000

    def kernel(name, coll, nin, nout, ts, dur, dtype):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,
                "args": {"Collective name": coll, "In msg nelems": nin, "Out msg nelems": nout, "Group size": 4,
                         "dtype": dtype}}
    events = [
        kernel("ncclDevKernel_AllGather_RING_LL(x)", "_allgather_base", psi // 4, psi, 0, 100, "BFloat16"),
        kernel("ncclDevKernel_AllGather_RING_LL(x)", "_allgather_base", psi // 4, psi, 500, 100, "BFloat16"),
        kernel("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(x)", "_reduce_scatter_base", psi, psi // 4, 800, 200,
               "Float"),
        {"ph": "X", "cat": "kernel", "name": "nvjet_hsh_128x256", "ts": 50, "dur": 900, "args": {}},
    ]
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    rows = {r["collective"]: r for r in bench.comm_records(path, "fsdp2", psi, 4)}
    assert rows["all_gather"]["profiler_S_mib"] == pytest.approx(2 * 2 * psi / 2**20)
    assert rows["all_gather"]["formula_S_mib"] == pytest.approx(rows["all_gather"]["profiler_S_mib"])
    assert rows["reduce_scatter"]["profiler_S_mib"] == pytest.approx(4 * psi / 2**20) and rows["reduce_scatter"]["calls"] == 1
    overlap = rows["(overlap)"]
    assert overlap["communication_s"] == pytest.approx(400e-6)
    # compute runs from 50 to 950 us: the first all-gather's first 50 us and the reduce-scatter's last 50 us are exposed
    assert overlap["exposed_s"] == pytest.approx(100e-6) and overlap["hidden_s"] == pytest.approx(300e-6)
    assert json.dumps(list(rows.values()))  # what goes into the JSON


def test_summarize_gpu_like_records():
    """The driver's tables from records shaped like a GPU run's (peaks are numbers there)."""
    def rec(engine, ws, step):
        times = [step * (1 + 0.01 * i) for i in range(10)]
        return {"engine": engine, "world_size": ws, "rank": 0, "tokens_per_s_per_gpu": 4096 / step,
                "step_time_median_s": step, "step_time_q1_s": step, "step_time_q3_s": step,
                "peak_allocated_gib_max": 30.0 / ws, "model_states_gib_max": 20.0 / ws, "formula_states_gib": 20.0 / ws,
                "step_times_s": times, "comm": [{"collective": "all_reduce", "formula_S_mib": 5.0, "profiler_S_mib": 5.0}]}
    parts = {"training": [rec("ddp", 1, 0.20), rec("ddp", 2, 0.21), rec("ddp", 4, 0.25)],
             "bandwidth": [{"world_size": 4, "collective": "all_reduce", "size_bytes": s, "busbw_gb_s": 300.0,
                            "busbw_best_gb_s": 320.0, "time_q1_s": 1.0, "time_median_s": 1.0, "time_q3_s": 1.0}
                           for s in (2**20, 2**32)]}
    summary = bench.summarize(parts)
    eff = {r["world_size"]: r for r in summary["scaling"]}
    assert eff[4]["scaling_efficiency"] == pytest.approx(0.8) and eff[4]["verdict"] == "slower"
    assert eff[2]["verdict"] == timing.NO_DIFFERENCE
    assert [r["size_bytes"] for r in summary["bandwidth_at_largest"]] == [2**32]
    assert len(summary["bytes_per_step"]) == 3


if sys.platform == "win32":  # pragma: no cover
    pytest.skip("torchrun needs a POSIX system here", allow_module_level=True)
