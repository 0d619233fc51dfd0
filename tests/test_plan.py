"""CPU tests of the memory planner (helpers.plan)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import accounting, models, plan

TINY = dict(profile="tiny", batch=2, seq=32)


def test_adamw_states_are_two_fp32_copies_of_the_params():
    s = plan.Setup(model="bert-large", precision="fp32", optimizer="adamw")
    shape = plan.shape(s)
    assert plan.optimizer_state_bytes(s) == 2 * 4 * shape.n_params
    assert plan.weight_bytes(s) == 4 * shape.n_params == plan.gradient_bytes(s)


def test_lora_trainable_is_r_times_in_plus_out_per_target():
    s = plan.Setup(model="gpt-neox-1.3b", lora_rank=8, lora_targets=("query_key_value", "dense"))
    h, layers = 2048, 24
    assert plan.lora_trainable_params(s) == layers * (8 * (h + 3 * h) + 8 * (h + h))
    assert plan.gradient_bytes(s) == 4 * plan.lora_trainable_params(s)


def test_components_sum_to_the_peak_and_phases():
    for s in plan.VALIDATION_SETUPS:
        p = plan.predict(s)
        assert sum(p.components.values()) == p.peak_bytes
        for ph, parts in p.phase_components.items():
            assert sum(parts.values()) == p.phases[ph]
        assert p.peak_phase in plan.PHASES


@pytest.mark.parametrize("key", ["batch", "seq"])
def test_peak_grows_with_batch_and_seq(key):
    base = plan.Setup(model="gpt-neox-1.3b", batch=8, seq=512, optimizer="adamw-fused")
    values = {"batch": (8, 16, 32, 64), "seq": (256, 512, 1024, 2048)}[key]
    peaks = [plan.predict(base.replace(**{key: v})).peak_bytes for v in values]
    assert peaks == sorted(peaks) and peaks[-1] > peaks[0]


def test_checkpointing_and_sdpa_reduce_activations():
    s = plan.Setup(model="bert-large", batch=16, seq=512, precision="fp32", attention="eager")
    eager = plan.predict(s).totals["activations"]
    sdpa = plan.predict(s.replace(attention="sdpa")).totals["activations"]
    ckpt = plan.predict(s.replace(attention="sdpa", checkpointing="full")).totals["activations"]
    assert eager > sdpa > ckpt


def test_validation_setups_are_many_and_fit_an_h100():
    assert len(plan.VALIDATION_SETUPS) >= 30
    assert {plan.shape(s).family for s in plan.VALIDATION_SETUPS} == {"bert", "gpt_neox"}
    assert all(plan.predict(s).peak_gib < 70 for s in plan.VALIDATION_SETUPS)


def _saved_per_layer(name, head, prec, attn, lora=None):
    """Bytes SavedTensorMeter counts in block 1 of a tiny model (fp32 weights), less autocast weight copies."""
    overrides = {"attention_probs_dropout_prob": 0.0} if name.startswith("bert") and attn == "sdpa" else {}
    dtype = torch.bfloat16 if prec == "bf16" else torch.float32
    m = models.build(name, profile="tiny", head=head, attn_implementation=attn, device="cpu", dtype=dtype,
                     num_hidden_layers=2, **overrides)
    if lora:
        from peft import LoraConfig, get_peft_model

        m = get_peft_model(m, LoraConfig(r=lora[0], lora_alpha=16, lora_dropout=lora[2], target_modules=list(lora[1])))
    m.train()
    base = m.base_model.model if lora else m
    blocks = base.bert.encoder.layer if hasattr(base, "bert") else base.gpt_neox.layers
    ids = torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(0))
    labels = torch.zeros(2, dtype=torch.long) if head == "sequence-classification" else ids
    meter = accounting.SavedTensorMeter(m, group={"b1": blocks[1]})
    with meter, torch.autocast("cpu", dtype=torch.bfloat16, enabled=prec == "bf16-autocast"):
        m(input_ids=ids, labels=labels)
    copies = 0
    if prec == "bf16-autocast":
        copies = 2 * sum(x.weight.numel() for x in blocks[1].modules() if isinstance(x, torch.nn.Linear))
    return meter.bytes_by_group["b1"] - copies


@pytest.mark.parametrize("model,head", [("bert-large", "sequence-classification"), ("gpt-neox-1.3b", "causal-lm")])
@pytest.mark.parametrize("prec", ["fp32", "bf16-autocast", "bf16"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_block_activation_formula_matches_saved_tensor_hooks_on_cpu(model, head, prec, attn):
    """The per-block coefficients reproduce SavedTensorMeter's count on CPU exactly (tolerance 0)."""
    name = plan.ALIASES[model]
    s = plan.Setup(model=model, precision=prec, attention=attn, **TINY)
    assert plan.layer_activation_bytes(s, backend="cpu") == _saved_per_layer(name, head, prec, attn)


LORA_CASES = [
    ("gpt-neox-1.3b", ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"), 0.05),
    ("gpt-neox-1.3b", ("query_key_value",), 0.0),
    ("bert-large", ("query", "value"), 0.05),
    ("bert-large", ("query", "value", "dense", "intermediate.dense"), 0.0),
]


@pytest.mark.parametrize("model,targets,dropout", LORA_CASES)
@pytest.mark.parametrize("prec", ["fp32", "bf16-autocast"])
def test_lora_block_activations_match_saved_tensor_hooks_on_cpu(model, targets, dropout, prec):
    """Frozen linears stop saving their inputs, adapters save theirs: exact on CPU (tolerance 0)."""
    s = plan.Setup(model=model, precision=prec, lora_rank=4, lora_targets=targets, lora_dropout=dropout, **TINY)
    head = plan.shape(s).head
    assert plan.layer_activation_bytes(s, backend="cpu") == _saved_per_layer(
        plan.ALIASES[model], head, prec, "sdpa", lora=(4, targets, dropout))


@pytest.mark.parametrize("batch,seq", [(1, 64), (3, 96)])
def test_block_formula_on_medium_shapes(batch, seq):
    """A wider block (h = 256, I = 1024, 8 heads) at other batch and sequence sizes: still exact."""
    over = dict(hidden_size=256, intermediate_size=1024, num_attention_heads=8, num_hidden_layers=2)
    m = models.build("polyglot-ko-1.3b", profile="tiny", head="causal-lm", attn_implementation="sdpa",
                     device="cpu", **over)
    m.train()
    meter = accounting.SavedTensorMeter(m, group={"b1": m.gpt_neox.layers[1]})
    ids = torch.randint(0, 1000, (batch, seq))
    with meter:
        m(input_ids=ids, labels=ids)
    cfg = models.config("polyglot-ko-1.3b", "tiny", **over)
    s = plan.Setup(model=cfg, precision="fp32", batch=batch, seq=seq)
    assert plan.layer_activation_bytes(s, backend="cpu") == meter.bytes_by_group["b1"]


@pytest.mark.parametrize("model,head,tol", [("bert-large", "sequence-classification", 0.1),
                                            ("gpt-neox-1.3b", "causal-lm", 0.001)])
@pytest.mark.parametrize("prec", ["fp32", "bf16-autocast", "bf16"])
def test_outside_blocks_formula_on_cpu(model, head, tol, prec):
    """Embeddings, final norm, head and loss: within 0.1% (GPT-NeoX, dominated by the fp32 log-softmax) and
    10% (BERT, a small term: its pooler and classifier are not modelled)."""
    over = {"attention_probs_dropout_prob": 0.0} if model == "bert-large" else {}
    dtype = torch.bfloat16 if prec == "bf16" else torch.float32
    m = models.build(plan.ALIASES[model], profile="tiny", head=head, device="cpu", dtype=dtype, **over)
    m.train()
    blocks = m.bert.encoder.layer if hasattr(m, "bert") else m.gpt_neox.layers
    meter = accounting.SavedTensorMeter(m, group={f"b{i}": x for i, x in enumerate(blocks)})
    ids = torch.randint(0, 1000, (4, 64))
    labels = ids if head == "causal-lm" else torch.zeros(4, dtype=torch.long)
    with meter, torch.autocast("cpu", dtype=torch.bfloat16, enabled=prec == "bf16-autocast"):
        m(input_ids=ids, labels=labels)
    s = plan.Setup(model=model, profile="tiny", batch=4, seq=64, precision=prec)
    head_copies = 2 * plan.shape(s).head_linear_numel() if prec == "bf16-autocast" else 0
    pred = plan.other_activation_bytes(s, backend="cpu") + head_copies
    assert pred == pytest.approx(meter.bytes_by_group["other"], rel=tol)


def test_suggest_returns_only_fitting_plans_sorted_by_cost():
    s = plan.Setup(model="gpt-neox-1.3b", batch=16, seq=256, precision="fp16", attention="eager")
    budget = 14.0
    assert not plan.predict(s).fits(budget)
    out = plan.suggest(s, budget)
    assert out
    assert all(p.fits(budget) and p.peak_gib <= budget for _, _, p, _ in out)
    costs = [c for *_, c in out]
    assert costs == sorted(costs)
    fits_alone = {d for d, *_ in out if " + " not in d}
    assert not any(part in fits_alone for d, *_ in out if " + " in d for part in d.split(" + "))
    fp16 = plan.suggest(s, budget, half="fp16")
    assert not any("bf16" in c.precision for _, c, _, _ in fp16)


def test_baselines_have_the_five_estimators():
    s = plan.Setup(model="bert-large", batch=4, seq=512, precision="fp32")
    b = plan.baselines(s)
    n = plan.shape(s).n_params
    assert b["4x model size (HF calculator)"] == 16 * n
    assert b["accelerate estimate-memory (largest term, batch 1)"] == 16 * n  # fp32: "step" = 4 x the model
    assert b["ZeRO paper model states (16 bytes/param)"] == 16 * n
    assert b["transformer-math: model states + Korthikanti activations"] > 16 * n
    assert list(b) == list(plan.BASELINE_NAMES) and len(b) == 5


# The Ultra-Scale Playbook's formula by hand: (2 + 2 + 4 + 8) bytes per parameter plus
# m_act = L*seq*bs*h*(34 + 5*n_heads*seq/h); bert-large: N = 335,143,938, L = 24, h = 1024, 16 heads;
# the 1.3B GPT-NeoX: N = 1,331,810,304, L = 24, h = 2048, 16 heads; both at 8 x 512.
#   bert-large: 16*335,143,938 = 5,362,303,008; 24*512*8*1024*(34 + 5*16*512/1024 = 74) = 7,449,083,904
#   the 1.3B:   16*1,331,810,304 = 21,308,964,864; 24*512*8*2048*(34 + 20) = 10,871,635,968
@pytest.mark.parametrize("model,n,expected", [("bert-large", 335_143_938, 5_362_303_008 + 7_449_083_904),
                                              ("gpt-neox-1.3b", 1_331_810_304, 21_308_964_864 + 10_871_635_968)])
def test_playbook_formula_by_hand(model, n, expected):
    s = plan.Setup(model=model, batch=8, seq=512, precision="bf16-autocast", optimizer="adamw")
    assert plan.shape(s).n_params == n
    assert plan.playbook_bytes(s) == expected
    assert plan.baselines(s)[plan.PLAYBOOK] == expected
    assert plan.playbook_bytes(s, fp32_grads=True) == expected + 4 * n  # "an additional m_params_fp32 = 4 * N"
    # the same formula on every attention kernel: the 5*n_heads*seq/h term is kept for SDPA too
    assert plan.playbook_bytes(s.replace(attention="eager")) == expected
    # transformer-math drops that term for SDPA: the two columns differ by exactly L*5*a*s^2*b
    tm = plan.baselines(s)["transformer-math: model states + Korthikanti activations"]
    assert expected - tm == 24 * 5 * 16 * 512 * 512 * 8
    assert plan.baselines(s.replace(attention="eager"))["transformer-math: model states + Korthikanti activations"] \
        == expected


def test_baseline_domains_are_mixed_precision_adamw_full_training():
    S = plan.Setup
    inside = [S("bert-large", 8, 512, "bf16-autocast", "adamw"), S("bert-large", 8, 512, "fp16-autocast", "adamw-fused"),
              S("gpt-neox-1.3b", 4, 256, "bf16-autocast", "adamw-fused", attention="eager"),
              S("gpt-neox-1.3b", 2, 512, "bf16-autocast", "adamw-fused", grad_accum=4)]
    outside = [S("bert-large", 8, 512, "fp32", "adamw"), S("bert-large", 16, 512, "bf16", "adamw"),
               S("gpt-neox-1.3b", 4, 256, "fp16", "adamw", attention="eager"),
               S("bert-large", 64, 128, "bf16-autocast", "adafactor"),
               S("gpt-neox-1.3b", 4, 256, "bf16-autocast", "adamw8bit"),
               S("bert-large", 16, 512, "bf16-autocast", "adamw", checkpointing=2),
               S("gpt-neox-1.3b", 8, 1024, "bf16-autocast", "adamw-fused", checkpointing="full"),
               S("bert-large", 8, 512, "bf16-autocast", "adamw-fused", lora_rank=8, lora_targets=("query", "value")),
               S("gpt-neox-1.3b", 4, 256, "bf16", "adamw8bit", lora_rank=8, qlora=True),
               S("gpt-neox-1.3b", 4, 256, "bf16-autocast", "adamw", zero_stage=2, world_size=2)]
    for s in inside:
        d = plan.baseline_domains(s)
        assert set(d) == set(plan.BASELINE_NAMES) and all(d.values()), s.label()
    for s in outside:
        assert not any(plan.baseline_domains(s).values()), s.label()
    # the validation set's mixed-precision AdamW rows: #5-7, 18-20 and 29
    rows = [i for i, s in enumerate(plan.VALIDATION_SETUPS, 1) if plan.in_mixed_precision_adamw_domain(s)]
    assert rows == [5, 6, 7, 18, 19, 20, 29]


@pytest.mark.parametrize("argv,msg", [
    (["--model", "nope"], "unknown model"),
    (["--model", "bert-large", "--batch", "-1"], "positive integer"),
    (["--model", "bert-large", "--seq", "abc"], "not an integer"),
    (["--model", "gpt-neox-1.3b", "--qlora"], "lora_rank"),
    (["--model", "bert-large", "--budget-gib", "-3"], "positive number"),
    (["--model", "bert-large", "--lora-rank", "8", "--lora-targets", "nothing"], "not linear layers"),
    (["--model", "bert-large", "--seq", "4096"], "positions"),
])
def test_cli_errors_exit_2_with_a_message(argv, msg, capsys):
    with pytest.raises(SystemExit) as exc:
        plan.main(argv)
    assert exc.value.code == 2
    assert msg in capsys.readouterr().err


def test_cli_verdicts(capsys):
    assert plan.main(["--model", "bert-large", "--batch", "4", "--seq", "128", "--gpu", "H100"]) == 0
    assert "fits" in capsys.readouterr().out
    assert plan.main(["--model", "gpt-neox-1.3b", "--batch", "16", "--precision", "fp16", "--attention", "eager",
                      "--gpu", "T4"]) == 1
    out = capsys.readouterr().out
    assert "does NOT fit" in out and "cheapest changes" in out


def test_measure_runs_on_cpu_and_accounts_the_model_states():
    s = plan.Setup(model="bert-large", precision="fp32", **TINY)
    r = plan.measure(s, device="cpu", steps=1)
    assert r["status"] == "ok" and r["peak_allocated_bytes"] is None  # no allocator peak on a CPU
    acc = r["accounted_bytes"]
    assert acc["weights"] == plan.weight_bytes(s) and acc["optimizer_states"] == plan.optimizer_state_bytes(s)
    assert plan.measure(s.replace(optimizer="adamw8bit"), device="cpu")["status"] == "skipped"


def test_error_table_and_summary():
    s = plan.Setup(model="bert-large", batch=4, seq=512, precision="fp32")
    p = plan.predict(s)
    rows = [(s, {"status": "ok", "peak_allocated_bytes": int(p.peak_bytes / 1.05), "peak_phase": "backward"}),
            (s.replace(batch=8), {"status": "oom", "peak_allocated_bytes": None})]
    table = plan.error_table(rows)
    assert table.loc[0, "error (%)"] == pytest.approx(5.0, rel=1e-3)
    summary = plan.error_summary(table)
    assert summary["rows"] == 1 and summary["max_abs_pct"] == pytest.approx(5.0, rel=1e-3)


def test_cli_reads_a_config_json(tmp_path, capsys):
    cfg = models.config("llama-2-7b", "full")
    cfg.save_pretrained(tmp_path)
    code = plan.main(["--model", str(tmp_path / "config.json"), "--batch", "1", "--seq", "512", "--precision", "bf16",
                      "--lora-rank", "16", "--qlora", "--optimizer", "paged-adamw8bit", "--budget-gib", "14"])
    out = capsys.readouterr().out
    assert code == 0 and "fits" in out and "qlora r16" in out
    s = plan.Setup(model=str(tmp_path / "config.json"), lora_rank=16, lora_targets=("q_proj", "v_proj"), qlora=True)
    assert plan.shape(s).family == "llama" and plan.shape(s).n_params == plan.shape(plan.Setup("llama-2-7b")).n_params


def test_a_config_object_plans_like_its_registry_name():
    cfg = models.config("polyglot-ko-1.3b", "full")
    by_obj = plan.Setup(model=cfg, batch=16, seq=512)
    by_name = plan.Setup(model="gpt-neox-1.3b", batch=16, seq=512)
    assert plan.predict(by_obj).peak_bytes == plan.predict(by_name).peak_bytes
    assert len(plan.suggest(by_obj, 14.0)) == len(plan.suggest(by_name, 14.0)) > 0


def test_checkpointing_every_k_beyond_the_layers_is_refused():
    with pytest.raises(ValueError, match="only 24 layers"):
        plan.predict(plan.Setup(model="bert-large", batch=1, seq=128, checkpointing=25))
    plan.predict(plan.Setup(model="bert-large", batch=1, seq=128, checkpointing=24))  # the last valid k


def _unshared_cache_bytes(s: plan.Setup) -> int:
    """Bytes of the output's DynamicCache that no tensor saved for backward shares (CPU autocast)."""
    model = plan.check._build_model(s, torch.device("cpu"))  # a private helper of the measuring module
    ids = torch.randint(0, plan.shape(s).vocab, (s.batch, s.seq))
    saved = []
    amp = plan.terms._pclass(s) == "amp"
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(t), t)[1], lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        out = model(input_ids=ids, labels=ids)
    kept = {t.untyped_storage().data_ptr() for t in saved}
    cache = out.past_key_values
    if cache is None:
        return 0
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
               if t.untyped_storage().data_ptr() not in kept)


@pytest.mark.parametrize("prec, ckpt, attn", [
    ("bf16-autocast", "none", "sdpa"), ("bf16-autocast", "none", "eager"), ("fp32", "none", "sdpa"),
    ("bf16", "none", "sdpa"), ("bf16-autocast", "full", "sdpa")])
def test_kv_cache_term_matches_the_models_cache_on_cpu(prec, ckpt, attn):
    s = plan.Setup(model="gpt-neox-1.3b", precision=prec, checkpointing=ckpt, attention=attn, **TINY)
    assert plan.kv_cache_bytes(s) == _unshared_cache_bytes(s)
    if prec == "bf16-autocast" and ckpt == "none":  # 8 bytes per token x hidden x layer, forward pass only
        shape = plan.shape(s)
        assert plan.kv_cache_bytes(s) == 8 * s.batch * s.seq * shape.hidden * shape.layers > 0
        with_kv, without = plan.predict(s), plan.predict(s, kv_cache=False)
        assert with_kv.phases["forward"] - without.phases["forward"] == plan.kv_cache_bytes(s)
        assert with_kv.phases["backward"] == without.phases["backward"]


def test_kv_cache_closes_the_forward_gap_of_the_validated_run():
    """Chapter 10's first H100 run (planner d6fcac2): rows whose measured peak is in the forward pass."""
    measured_gib = {20: 26.36, 29: 24.50, 33: 4.17, 35: 18.91}  # the committed validation table
    for i, m in measured_gib.items():
        s = plan.VALIDATION_SETUPS[i - 1]
        old, new = plan.predict(s, kv_cache=False), plan.predict(s)
        assert old.peak_phase == "backward" and abs(old.peak_gib / m - 1) > 0.01
        assert new.peak_phase == "forward" and abs(new.peak_gib / m - 1) < 0.01


# --- the package -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["predict", "suggest"])
def test_functions_named_like_their_module_are_the_functions(name):
    """``plan.predict`` and ``plan.suggest`` are the functions, although their modules carry the same names."""
    fn = getattr(plan, name)
    assert callable(fn) and fn.__name__ == name and fn.__module__ == f"helpers.plan.{name}"
    assert getattr(sys.modules[f"helpers.plan.{name}"], name) is fn


def test_command_line_runs_as_a_module():
    """``python -m helpers.plan`` runs ``helpers/plan/__main__.py`` once, without runpy's double-import warning."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    run = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-m", "helpers.plan", "--model", "bert-large",
                          "--batch", "4", "--seq", "128", "--gpu", "H100"], cwd=root, capture_output=True, text=True,
                         env=env)
    assert run.returncode == 0, run.stderr
    assert "verdict: fits H100" in run.stdout
    bad = subprocess.run([sys.executable, "-m", "helpers.plan", "--model", "nope"], cwd=root, capture_output=True,
                         text=True, env=env)
    assert bad.returncode == 2 and "unknown model 'nope'" in bad.stderr
