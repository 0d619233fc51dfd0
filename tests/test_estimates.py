import pytest
import torch
from torch import nn

from helpers import accounting, estimates


def trained_mlp(optimizer_class, dtype=torch.float32, **kwargs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)).to(dtype)
    optimizer = optimizer_class(model.parameters(), **kwargs)
    model(torch.randn(4, 32, dtype=dtype)).sum().backward()
    optimizer.step()
    return model, optimizer


# --- one vocabulary --------------------------------------------------------------------------------


def test_measured_and_estimated_model_states_share_their_names():
    model, optimizer = trained_mlp(torch.optim.AdamW)
    measured = accounting.model_state_bytes(model, optimizer)
    rule = estimates.model_state_bytes(10, "fp32_adamw")
    zero = estimates.zero_model_state_bytes(10, 2, "zero1")
    assert tuple(measured) == tuple(rule) == accounting.MODEL_STATES
    assert set(zero) == {*accounting.MODEL_STATES, "total"}
    assert all(set(parts) == set(accounting.MODEL_STATES) for parts in estimates.BYTES_PER_PARAM.values())


# --- bytes-per-parameter rules, against what a real optimizer allocates ------------------------------


@pytest.mark.parametrize(
    ("recipe", "optimizer_class", "dtype", "kwargs"),
    [
        ("fp32_adamw", torch.optim.AdamW, torch.float32, {}),
        ("fp16_adamw", torch.optim.AdamW, torch.float16, {}),  # AdamW keeps its states in the weights' dtype
        ("fp32_sgd_momentum", torch.optim.SGD, torch.float32, {"lr": 0.1, "momentum": 0.9}),
    ],
)
def test_bytes_per_param_rule_matches_a_real_optimizer(recipe, optimizer_class, dtype, kwargs):
    model, optimizer = trained_mlp(optimizer_class, dtype, **kwargs)
    n = sum(p.numel() for p in model.parameters())
    measured = accounting.model_state_bytes(model, optimizer)
    assert measured == estimates.model_state_bytes(n, recipe)


@pytest.mark.parametrize(("recipe", "dtype"), [("fp32_inference", torch.float32), ("half_inference", torch.bfloat16)])
def test_inference_rules_match_a_model_without_optimizer(recipe, dtype):
    model = nn.Linear(16, 16).to(dtype)
    n = sum(p.numel() for p in model.parameters())
    assert accounting.model_state_bytes(model) == estimates.model_state_bytes(n, recipe)


def test_unknown_recipe_and_negative_count():
    with pytest.raises(ValueError, match="unknown recipe"):
        estimates.model_state_bytes(10, "fp64_lion")
    with pytest.raises(ValueError, match="n_params"):
        estimates.model_state_bytes(-1, "fp32_adamw")


# --- published numbers ------------------------------------------------------------------------------


def test_korthikanti_against_the_papers_gpt3_numbers():
    # Korthikanti et al. 2022: for GPT-3 (a = 96, s = 2048, h = 12288) the attention term 5as/h is 80,
    # more than twice the 34 of the rest of the layer.
    s, b, h, a = 2048, 1, 12288, 96
    eager = estimates.korthikanti_activation_bytes(s, b, h, a)
    flash = estimates.korthikanti_activation_bytes(s, b, h, a, attention="flash")
    assert eager / (s * b * h) == pytest.approx(34 + 80)
    assert flash / (s * b * h) == pytest.approx(34)
    assert estimates.korthikanti_activation_bytes(s, 4, h, a, layers=96) == 4 * 96 * eager
    with pytest.raises(ValueError, match="attention must be"):
        estimates.korthikanti_activation_bytes(s, b, h, a, attention="linear")
    with pytest.raises(ValueError):
        estimates.korthikanti_activation_bytes(s, -1, h, a)


@pytest.mark.parametrize(
    ("total_gb", "training_gb"),
    [(27.49, 109.96),  # the calculator's report for HuggingFaceH4/zephyr-7b-alpha, float32
     (4.9, 19.61)],  # and for facebook/incoder-1B, float32 (its sizes rounded as printed)
)
def test_hf_calculator_rule_against_the_calculators_own_reports(total_gb, training_gb):
    assert estimates.hf_calculator_training_bytes(total_gb * 2**30) / 2**30 == pytest.approx(training_gb, abs=0.02)


# --- the ZeRO formula -------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", estimates.STAGES)
def test_zero_formula_reproduces_the_papers_7_5b_example(stage):
    total = estimates.zero_model_state_bytes(7.5e9, 64, stage)["total"]
    assert round(total / 1e9, 1) == estimates.PAPER_7_5B_GB[stage]  # the paper's GB are 10**9 bytes


def test_zero_formula_partitions_one_more_state_per_stage():
    psi, n = 1000, 4
    ddp, z1, z2, z3 = (estimates.zero_model_state_bytes(psi, n, s) for s in estimates.STAGES)
    assert ddp == {"weights": 2000, "gradients": 2000, "optimizer_states": 12000, "total": 16000}
    assert (z1["weights"], z1["gradients"], z1["optimizer_states"]) == (2000, 2000, 3000)
    assert (z2["weights"], z2["gradients"]) == (2000, 500)
    assert z3["weights"] == 500 and z3["total"] == 4000


def test_zero_formula_on_one_gpu_shards_nothing_and_takes_other_recipes():
    totals = {s: estimates.zero_model_state_bytes(10, 1, s)["total"] for s in estimates.STAGES}
    assert set(totals.values()) == {160}
    fp32 = estimates.zero_model_state_bytes(10, 2, "zero1", param_bytes=4, grad_bytes=4, optimizer_bytes=8)
    assert fp32["total"] == 40 + 40 + 40


@pytest.mark.parametrize(
    "kwargs",
    [dict(stage="zero4"), dict(n_gpus=0), dict(n_gpus=1.5), dict(n_params=-1), dict(optimizer_bytes=-2)],
)
def test_zero_formula_rejects_bad_inputs(kwargs):
    args = dict(n_params=10, n_gpus=2, stage="zero1") | kwargs
    with pytest.raises(ValueError):
        estimates.zero_model_state_bytes(**args)


def test_zero_table_rows_and_columns():
    table = estimates.zero_table(100, [1, 2, 8])
    assert list(table.index) == [1, 2, 8] and list(table.columns) == list(estimates.STAGES)
    assert table.loc[8, "zero3"] == 200 and table.loc[1, "zero3"] == 1600


# --- communication per step ---


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8, 64])
def test_bus_factors_are_the_nccl_tests_ones(n):
    assert estimates.bus_factor("all_reduce", n) == pytest.approx(2 * (n - 1) / n)
    assert estimates.bus_factor("reduce_scatter", n) == pytest.approx((n - 1) / n)
    assert estimates.bus_factor("all_gather", n) == pytest.approx((n - 1) / n)
    assert estimates.bus_factor("broadcast", n) == 1.0
    # an all-reduce is a reduce-scatter followed by an all-gather: the factors add up
    assert estimates.bus_factor("all_reduce", n) == pytest.approx(
        estimates.bus_factor("reduce_scatter", n) + estimates.bus_factor("all_gather", n))
    assert estimates.sent_factor("broadcast", n) == pytest.approx((n - 1) / n)


def totals(n_params, n, **kw):
    table = estimates.communication_table(n_params, n, **kw)
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
    bus = estimates.communication_table(psi, n).groupby("engine")["bus bytes"].sum()
    bus = bus / bus["ddp"]
    assert bus["zero1"] == pytest.approx(1 + n / (2 * (n - 1)))  # sequential broadcasts: 2x DDP's time at n = 2
    assert bus["zero3"] == pytest.approx(1.5)


def test_engine_bytes_reach_the_papers_volumes_for_many_ranks():
    """Rajbhandari et al. 2020, section 7.2: 2 Psi (DP, P_os+g) and 3 Psi (P_os+g+p) per process, large N."""
    psi, n = 1e9, 4096
    sent = totals(psi, n, param_bytes=1, grad_bytes=1)  # in elements
    for engine in ("ddp", "zero2", "zero3"):
        assert sent[engine] / psi == pytest.approx(estimates.PAPER_COMM_VOLUME_PSI[engine], rel=1e-3)
    # ZeRO-1 as PyTorch runs it moves 3 Psi, 1.5x the paper's P_os (which reduce-scatters instead)
    assert sent["zero1"] / psi == pytest.approx(1.5 * estimates.PAPER_COMM_VOLUME_PSI["zero1"], rel=1e-3)


def test_widths_and_bad_engines():
    bf16 = totals(1e6, 2, param_bytes=2, grad_bytes=2)
    fp32 = totals(1e6, 2)
    assert (bf16 * 2).to_dict() == pytest.approx(fp32.to_dict())
    one = estimates.communication_table(1e6, 1)
    assert (one["sent per rank (bytes)"] == 0).all()  # nothing to send alone ...
    assert one.loc[one.collective == "broadcast", "bus bytes"].item() == 4e6  # ... though a broadcast's factor is 1
    with pytest.raises(ValueError, match="engine"):
        estimates.engine_transfers("zero4", 1e6, 2)
