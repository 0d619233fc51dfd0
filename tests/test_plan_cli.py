"""CPU tests of the planner's command line: every bad input exits 2 with one line; 1 means "does not fit"."""

from __future__ import annotations

import json

import pytest

from helpers import models, plan

LLAMA3_HUB_CONFIG = {  # Meta-Llama-3-8B's config.json as published (transformers 4.x keys), 2 blocks
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 8192, "model_type": "llama", "num_attention_heads": 32,
    "num_hidden_layers": 2, "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.40.0.dev0", "use_cache": True, "vocab_size": 128256,
}


def _write(tmp_path, content) -> str:
    path = tmp_path / "config.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


def _fails(argv, capsys, msg):
    with pytest.raises(SystemExit) as exc:
        plan.main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2
    lines = [line for line in err.splitlines() if line.strip() and "gemm_4bit" not in line]
    assert len(lines) == 1, err  # one line, no usage block
    assert lines[0].startswith("python -m helpers.plan: error:") and msg in lines[0], lines[0]


def _without(key):
    return {k: v for k, v in LLAMA3_HUB_CONFIG.items() if k != key}


BAD_CONFIGS = [
    ('{"model_type": "llama", "hidden_size": 40', "not valid JSON"),
    ("", "not valid JSON"),
    ("[1, 2]", "must hold a JSON object"),
    (_without("model_type"), "has no model_type"),
    ({**LLAMA3_HUB_CONFIG, "model_type": "gpt2"}, "model type 'gpt2' is not supported"),
    ({"model_type": "llama", "hidden_size": 64}, "lacks intermediate_size, num_hidden_layers"),
    (_without("vocab_size"), "lacks vocab_size"),
    ({**LLAMA3_HUB_CONFIG, "num_hidden_layers": 0}, "num_hidden_layers must be a positive integer, got 0"),
    ({**LLAMA3_HUB_CONFIG, "hidden_size": -4096}, "hidden_size must be a positive integer"),
    ({**LLAMA3_HUB_CONFIG, "intermediate_size": 14336.5}, "intermediate_size must be a positive integer"),
    ({**LLAMA3_HUB_CONFIG, "vocab_size": "128256"}, "vocab_size must be a positive integer"),
    ({**LLAMA3_HUB_CONFIG, "num_attention_heads": True}, "num_attention_heads must be a positive integer"),
    ({**LLAMA3_HUB_CONFIG, "num_key_value_heads": 0}, "num_key_value_heads must be a positive integer"),
    ({**LLAMA3_HUB_CONFIG, "num_key_value_heads": 5}, "not a multiple of num_key_value_heads"),
    ({**_without("num_hidden_layers"), "num_hiden_layers": 2}, "lacks num_hidden_layers"),
    ({**LLAMA3_HUB_CONFIG, "num_kv_heads": 8}, "do not know: num_kv_heads"),
]


@pytest.mark.parametrize("content,msg", BAD_CONFIGS, ids=[m for _, m in BAD_CONFIGS])
def test_bad_config_json_exits_2_with_one_line(tmp_path, capsys, content, msg):
    _fails(["--model", _write(tmp_path, content), "--batch", "1", "--seq", "128"], capsys, msg)


BAD_ARGS = [
    (["--model", "nope"], "unknown model 'nope'"),
    (["--model", "/nonexistent/config.json"], "no config file"),
    (["--model", "bert-large", "--batch", "0"], "must be a positive integer, got 0"),
    (["--model", "bert-large", "--batch", "-4"], "must be a positive integer"),
    (["--model", "bert-large", "--batch", "4.5"], "not an integer"),
    (["--model", "bert-large", "--seq", "0"], "must be a positive integer"),
    (["--model", "bert-large", "--grad-accum", "0"], "must be a positive integer"),
    (["--model", "bert-large", "--lora-rank", "0"], "must be a positive integer"),
    (["--model", "bert-large", "--checkpointing", "0"], "must be a positive integer"),
    (["--model", "bert-large", "--checkpointing", "abc"], "not an integer"),
    (["--model", "bert-large", "--world-size", "0"], "must be a positive integer"),
    (["--model", "bert-large", "--top", "0"], "must be a positive integer"),
    (["--model", "bert-large", "--budget-gib", "0"], "positive number"),
    (["--model", "bert-large", "--budget-gib", "-3"], "positive number"),
    (["--model", "bert-large", "--budget-gib", "nan"], "positive number"),
    (["--model", "bert-large", "--margin-pct", "-1"], "must be a number >= 0"),
    (["--model", "bert-large", "--margin-pct", "abc"], "not a number"),
    (["--model", "bert-large", "--precision", "fp8"], "invalid choice"),
    (["--model", "bert-large", "--gpu", "H100", "--budget-gib", "10"], "not allowed with argument"),
    (["--model", "gpt-neox-1.3b", "--world-size", "8"], "needs --zero-stage"),
    (["--model", "gpt-neox-1.3b", "--qlora"], "lora_rank"),
    (["--model", "bert-large", "--lora-rank", "8", "--lora-targets", "nothing"], "not linear layers"),
    (["--model", "bert-large", "--seq", "4096"], "positions"),
    (["--model", "bert-large", "--unknown-flag"], "unrecognized arguments"),
]


@pytest.mark.parametrize("argv,msg", BAD_ARGS, ids=[" ".join(a[2:]) or a[1] for a, _ in BAD_ARGS])
def test_bad_arguments_exit_2_with_one_line(capsys, argv, msg):
    _fails(argv, capsys, msg)


def test_a_folder_without_config_json(tmp_path, capsys):
    _fails(["--model", str(tmp_path)], capsys, "no config.json in the folder")


def test_real_configs_are_accepted(tmp_path, capsys):
    assert plan.main(["--model", _write(tmp_path, LLAMA3_HUB_CONFIG), "--batch", "1", "--seq", "512"]) == 0
    out = capsys.readouterr().out
    assert "peak" in out
    for name in ("bert-large-uncased", "polyglot-ko-1.3b", "llama-2-7b"):  # what transformers 5 writes
        folder = tmp_path / name
        models.config(name, "full").save_pretrained(folder)
        assert plan.main(["--model", str(folder / "config.json"), "--batch", "1", "--seq", "128"]) == 0
    # a config.json with the sizes given plans exactly like the config object
    s_file = plan.Setup(model=_write(tmp_path, LLAMA3_HUB_CONFIG), batch=1, seq=512)
    fields = {k: v for k, v in LLAMA3_HUB_CONFIG.items() if k not in ("model_type", "rope_scaling")}
    s_obj = plan.Setup(model=models.config("llama-2-7b", "full", **fields), batch=1, seq=512)
    assert plan.predict(s_file).peak_bytes == plan.predict(s_obj).peak_bytes


def test_the_margin_decides_a_tight_fit(capsys):
    argv = ["--model", "bert-large", "--batch", "8", "--seq", "512", "--precision", "fp32"]
    peak = plan.predict(plan.Setup(model="bert-large", batch=8, seq=512, precision="fp32")).peak_gib
    budget = f"{peak * 1.02:.3f}"  # above the peak, below the peak + 5%
    assert plan.main([*argv, "--budget-gib", budget]) == 1
    out = capsys.readouterr().out
    assert "does NOT fit" in out and "with the 5% margin" in out and "expandable_segments" in out
    assert plan.main([*argv, "--budget-gib", budget, "--margin-pct", "0"]) == 0
    assert "verdict: fits" in capsys.readouterr().out
    assert plan.main([*argv, "--budget-gib", f"{peak * 1.06:.3f}"]) == 0


@pytest.mark.parametrize("batch", [7, 12, 13, 64])
def test_suggest_keeps_the_effective_batch(batch):
    s = plan.Setup(model="gpt-neox-1.3b", batch=batch, seq=512, precision="fp16", attention="eager", grad_accum=3)
    options = plan.suggest(s, 10.0)
    assert options
    assert all(c.batch * c.grad_accum == batch * 3 for _, c, _, _ in options)
    splits = [d for d, *_ in options if "micro-batch" in d]
    assert all(f"effective batch {batch * 3} kept" in d for d in splits)


def test_suggest_on_a_huge_batch_is_quick_and_exact():
    s = plan.Setup(model="bert-large", batch=99999999, seq=128, precision="fp32")
    options = plan.suggest(s, 14.0, max_changes=1)
    assert all(c.batch * c.grad_accum == 99999999 for _, c, _, _ in options)


def test_the_no_cache_flag_plans_use_cache_false(capsys):
    assert plan.main(["--model", "gpt-neox-1.3b", "--batch", "4", "--seq", "256", "--no-cache"]) == 0
    assert "no-cache" in capsys.readouterr().out
