import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from helpers import accounting, distributed

ROOT = Path(__file__).resolve().parents[1]
TRAIN_ZERO = ROOT / "notebooks" / "scripts" / "train_zero.py"


# --- the ZeRO formula ------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", distributed.STAGES)
def test_formula_reproduces_the_papers_7_5b_example(stage):
    total = distributed.zero_model_state_bytes(7.5e9, 64, stage)["total"]
    assert round(total / 1e9, 1) == distributed.PAPER_7_5B_GB[stage]  # the paper's GB are 10**9 bytes


def test_formula_components_follow_the_stages():
    psi, n = 1000, 4
    ddp, z1, z2, z3 = (distributed.zero_model_state_bytes(psi, n, s) for s in distributed.STAGES)
    assert ddp == {"parameters": 2000, "gradients": 2000, "optimizer_states": 12000, "total": 16000}
    assert z1["optimizer_states"] == 3000 and z1["gradients"] == 2000 and z1["parameters"] == 2000
    assert z2["gradients"] == 500 and z2["parameters"] == 2000
    assert z3["parameters"] == 500 and z3["total"] == 4000
    assert ddp["total"] > z1["total"] > z2["total"] > z3["total"]


def test_formula_on_one_gpu_shards_nothing_and_takes_other_recipes():
    totals = {s: distributed.zero_model_state_bytes(10, 1, s)["total"] for s in distributed.STAGES}
    assert set(totals.values()) == {160}
    fp32 = distributed.zero_model_state_bytes(10, 2, "zero1", param_bytes=4, grad_bytes=4, optimizer_bytes=8)
    assert fp32["total"] == 40 + 40 + 40


@pytest.mark.parametrize(
    "kwargs",
    [dict(stage="zero4"), dict(n_gpus=0), dict(n_gpus=1.5), dict(n_params=-1), dict(optimizer_bytes=-2)],
)
def test_formula_rejects_bad_inputs(kwargs):
    args = dict(n_params=10, n_gpus=2, stage="zero1") | kwargs
    with pytest.raises(ValueError):
        distributed.zero_model_state_bytes(**args)


def test_zero_table_rows_and_columns():
    table = distributed.zero_table(100, [1, 2, 8])
    assert list(table.index) == [1, 2, 8] and list(table.columns) == list(distributed.STAGES)
    assert table.loc[8, "zero3"] == 200 and table.loc[1, "zero3"] == 1600


# --- what one rank holds ---------------------------------------------------------------------------


def test_local_accounting_matches_accounting_for_plain_tensors():
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    t = torch.zeros(5, dtype=torch.float64)
    assert distributed.local_tensor(t) is t and distributed.local_bytes(t) == 40
    assert distributed.local_model_state_bytes(model, opt) == accounting.model_state_bytes(model, opt)
    assert distributed.unsharded_param_bytes(model) == accounting.param_bytes(model)
    assert distributed.local_model_state_bytes(model)["optimizer_states"] == 0


def test_inner_optimizer_unwraps_wrappers():
    adamw = torch.optim.AdamW(nn.Linear(2, 2).parameters())
    assert distributed.inner_optimizer(adamw) is adamw
    assert distributed.inner_optimizer(SimpleNamespace(optimizer=adamw)) is adamw  # like accelerate's
    assert distributed.inner_optimizer(SimpleNamespace(optim=adamw)) is adamw  # like ZeroRedundancyOptimizer


# --- launching -------------------------------------------------------------------------------------


def test_launch_env_keeps_the_callers_settings_but_never_enables_multicast():
    env = distributed.launch_env({"NCCL_NVLS_ENABLE": "1", "OMP_NUM_THREADS": "4", "KEEP": "me"})
    assert env["KEEP"] == "me" and env["OMP_NUM_THREADS"] == "4"
    assert env["NCCL_NVLS_ENABLE"] == "0"  # forced off even when the caller asked for it
    assert env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1" and env["NVSHMEM_DISABLE_NVLS"] == "1"
    assert distributed.launch_env({})["OMP_NUM_THREADS"] == "1"


def test_torchrun_and_accelerate_commands():
    launch = distributed.torchrun("scripts/x.py", 2, ["--out", "a b"])
    assert launch.argv[:3] == (sys.executable, "-m", "torch.distributed.run")
    assert launch.text == "torchrun --standalone --nproc_per_node=2 scripts/x.py --out 'a b'"
    acc = distributed.accelerate_launch("c.yaml", "scripts/x.py", 2)
    assert acc.text == "accelerate launch --config_file c.yaml --num_processes 2 scripts/x.py"
    assert "--main_process_port" in acc.argv and sys.executable not in acc.text
    with pytest.raises(ValueError):
        distributed.torchrun("x.py", 0)
    assert 0 < distributed.free_port() < 65536


def test_run_returns_output_or_raises_with_it():
    ok = distributed.Launch((sys.executable, "-c", "print('hello')"), "hello")
    assert distributed.run(ok, env={}).stdout.strip() == "hello"
    bad = distributed.Launch((sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"), "bad")
    with pytest.raises(RuntimeError, match=r"(?s)exit code 3.*boom"):
        distributed.run(bad, env={})


def test_read_results_and_load_script(tmp_path):
    (tmp_path / "rank0.json").write_text(json.dumps([{"rank": 0, "x": 1}, {"rank": 0, "x": 2}]))
    (tmp_path / "rank1.json").write_text(json.dumps([{"rank": 1, "x": 3}]))
    assert distributed.read_results(tmp_path)["x"].tolist() == [1, 2, 3]
    with pytest.raises(FileNotFoundError):
        distributed.read_results(tmp_path / "empty")
    script = tmp_path / "tool.py"
    script.write_text("def twice(x):\n    return 2 * x\n\nif __name__ == '__main__':\n    raise SystemExit(1)\n")
    assert distributed.load_script(script).twice(21) == 42


# --- the chapter's training script, on 2 CPU processes (gloo) ----------------------------------------


def test_train_zero_shards_what_each_stage_promises(tmp_path):
    launch = distributed.torchrun(TRAIN_ZERO, 2, ["--out", tmp_path, "--warmup", "0", "--steps", "1"])
    env = distributed.launch_env()
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path (gloo), on any machine
    distributed.run(launch, env=env)
    df = distributed.read_results(tmp_path).set_index(["strategy", "rank"])
    assert (df["status"] == "ok").all() and df["model_freed"].all()
    full = df["n_params"].iloc[0] * 4 / 2**20  # fp32 parameters of the whole model, MiB
    by = df.groupby(level="strategy")
    sums, maxima = by.sum(numeric_only=True), by.max(numeric_only=True)
    assert maxima.loc["ddp", "params_mib"] == pytest.approx(full)
    assert maxima.loc["ddp", "optimizer_states_mib"] == pytest.approx(2 * full)
    assert sums.loc["zero1", "optimizer_states_mib"] == pytest.approx(2 * full)  # split over 2 ranks
    assert maxima.loc["zero1", "optimizer_states_mib"] < 1.5 * full
    for stage in ("zero2", "zero3"):
        assert sums.loc[stage, "params_mib"] == pytest.approx(full)  # each rank holds its half
        assert sums.loc[stage, "grads_mib"] == pytest.approx(full)
    assert maxima.loc["zero2", "gathered_params_mib"] == pytest.approx(full)  # kept from forward
    assert maxima.loc["zero3", "gathered_params_mib"] == 0
