"""CPU tests of the planner terms added for the held-out families: grouped-query attention, use_cache, tied heads."""

from __future__ import annotations

import pytest
import torch

from helpers import accounting, models, plan

H, HEADS, WIDE, B, S = 256, 8, 512, 2, 32


def _unshared_cache_bytes(s: plan.Setup) -> int:
    """Bytes of the output's DynamicCache that no tensor saved for backward shares (CPU autocast)."""
    model = plan.check._build_model(s, torch.device("cpu"))  # a private helper of the measuring module
    ids = torch.randint(0, plan.shape(s).vocab, (s.batch, s.seq))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(t), t)[1], lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=plan.terms._pclass(s) == "amp"):
        out = model(input_ids=ids, labels=ids)
    kept = {t.untyped_storage().data_ptr() for t in saved}
    if out.past_key_values is None:
        return 0
    return sum(t.numel() * t.element_size() for layer in out.past_key_values.layers
               for t in (layer.keys, layer.values) if t.untyped_storage().data_ptr() not in kept)


def _llama(kv: int, **over):
    return models.config("llama-2-7b", "tiny", hidden_size=H, intermediate_size=WIDE, num_attention_heads=HEADS,
                         num_key_value_heads=kv, num_hidden_layers=2, **over)


def _saved_block(cfg, prec: str, attn: str, use_cache: bool, family_blocks=lambda m: m.model.layers) -> int:
    dtype = torch.bfloat16 if prec == "bf16" else torch.float32
    m = models._HEAD_CLASSES["causal-lm"].from_config(cfg, dtype=dtype, attn_implementation=attn)
    m.train()
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(0))
    block = family_blocks(m)[1]
    meter = accounting.SavedTensorMeter(m, group={"b1": block})
    with meter, torch.autocast("cpu", dtype=torch.bfloat16, enabled=prec == "bf16-autocast"):
        m(input_ids=ids, labels=ids, use_cache=use_cache)
    copies = 2 * sum(x.weight.numel() for x in block.modules() if isinstance(x, torch.nn.Linear)) \
        if prec == "bf16-autocast" else 0
    return meter.bytes_by_group["b1"] - copies


@pytest.mark.parametrize("kv", [8, 2, 1])
@pytest.mark.parametrize("prec", ["fp32", "bf16-autocast", "bf16"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_gqa_block_activations_match_saved_tensor_hooks_on_cpu(kv, prec, attn):
    """SDPA saves keys and values at kv_dim (enable_gqa); eager repeats them to the full width: exact on CPU."""
    cfg = _llama(kv)
    s = plan.Setup(model=cfg, batch=B, seq=S, precision=prec, attention=attn)
    assert plan.shape(s).kv_dim == H * kv // HEADS
    assert plan.layer_activation_bytes(s, backend="cpu") == _saved_block(cfg, prec, attn, use_cache=True)
    assert _saved_block(cfg, prec, attn, use_cache=False) == _saved_block(cfg, prec, attn, use_cache=True)


@pytest.mark.parametrize("kv", [8, 2])
@pytest.mark.parametrize("prec", ["bf16-autocast", "fp32", "bf16"])
def test_kv_cache_term_has_the_keys_width(kv, prec):
    s = plan.Setup(model=_llama(kv), batch=B, seq=S, precision=prec)
    assert plan.kv_cache_bytes(s) == _unshared_cache_bytes(s)
    if prec == "bf16-autocast":
        assert plan.kv_cache_bytes(s) == 8 * B * S * (H * kv // HEADS) * 2 > 0


@pytest.mark.parametrize("model", ["llama", "gpt-neox-1.3b"])
def test_use_cache_false_drops_the_cache_from_the_forward_pass(model):
    cfg = _llama(2) if model == "llama" else model
    s = plan.Setup(model=cfg, batch=B, seq=S, precision="bf16-autocast", profile="tiny")
    off = s.replace(use_cache=False)
    assert plan.kv_cache_bytes(s) > 0 and plan.kv_cache_bytes(off) == 0
    assert plan.predict(off).phase_components["forward"]["temporaries"] < plan.predict(s).phase_components[
        "forward"]["temporaries"]
    assert plan.kv_cache_bytes(s.replace(use_cache=True)) == plan.kv_cache_bytes(s)  # the default is on


@pytest.mark.parametrize("prec,attn", [("fp32", "sdpa"), ("bf16-autocast", "sdpa"), ("bf16", "sdpa"),
                                       ("bf16-autocast", "eager")])
def test_gpt_neox_without_the_cache_saves_the_fused_qkv_view(prec, attn):
    """Without the cache SDPA keeps a view of the fused QKV output: +8 (fp32) / +4 (16-bit) bytes per s*b*h."""
    cfg = models.config("polyglot-ko-1.3b", "tiny", num_hidden_layers=2)
    on = _saved_block(cfg, prec, attn, True, lambda m: m.gpt_neox.layers)
    off = _saved_block(cfg, prec, attn, False, lambda m: m.gpt_neox.layers)
    s = plan.Setup(model=cfg, batch=B, seq=S, precision=prec, attention=attn)
    layers = plan.shape(s).layers
    kv_on, kv_off = plan.kv_cache_bytes(s), plan.kv_cache_bytes(s.replace(use_cache=False))
    planned = (plan.predict(s.replace(use_cache=False)).totals["activations"] - plan.predict(s).totals["activations"])
    assert planned == (off - on) * layers
    assert kv_off == 0 and (kv_on > 0) == (prec == "bf16-autocast")


def test_a_tied_head_is_cast_by_autocast_and_its_gradient_arrives_with_the_head():
    tied = _llama(2, tie_word_embeddings=True)
    untied = _llama(2, tie_word_embeddings=False)
    st, su = (plan.Setup(model=c, batch=B, seq=S, precision="bf16-autocast") for c in (tied, untied))
    v_h = tied.vocab_size * H
    assert plan.shape(st).tied_head_numel() == v_h and plan.shape(su).tied_head_numel() == 0
    assert plan.shape(su).n_params - plan.shape(st).n_params == v_h  # one matrix fewer
    assert plan.autocast_copy_bytes(st) == plan.autocast_copy_bytes(su)  # the head is cast either way
    assert plan.weight_bytes(su) - plan.weight_bytes(st) == 4 * v_h


def test_tied_autocast_copy_is_what_cpu_autocast_caches():
    """Under autocast the tied head's weight is cast to 16 bits once, like an untied head's."""
    cfg = _llama(2, tie_word_embeddings=True)
    m = models._HEAD_CLASSES["causal-lm"].from_config(cfg, attn_implementation="sdpa")
    m.train()
    ids = torch.randint(0, cfg.vocab_size, (B, S))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(t), t)[1], lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16):
        m(input_ids=ids, labels=ids)
    shapes = [tuple(t.shape) for t in saved if t.dtype == torch.bfloat16]
    assert (H, cfg.vocab_size) in shapes or (cfg.vocab_size, H) in shapes  # the cast head, saved for backward
