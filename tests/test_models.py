import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers import models


def test_full_sizes_match_the_real_models():
    def n_params(name, profile):
        head = models.spec(name).heads[0]
        return models.n_params(models.build(name, profile=profile, head=head, device="meta"))

    # bert-large-uncased with a 2-label classifier; polyglot-ko-1.3b as published (1,331,810,304)
    assert n_params("bert-large-uncased", "full") == 335_143_938
    assert n_params("polyglot-ko-1.3b", "full") == 1_331_810_304
    assert n_params("llama-2-7b", "full") == 6_738_415_616  # Llama-2-7B as published
    assert all(n_params(name, "tiny") < 10_000_000 for name in models.REGISTRY)


def test_tiny_twin_keeps_the_architecture():
    full = models.config("polyglot-ko-1.3b", "full")
    tiny = models.config("polyglot-ko-1.3b", "tiny")
    assert type(full) is type(tiny)
    assert tiny.vocab_size == full.vocab_size
    assert tiny.rope_parameters == full.rope_parameters == {"rope_theta": 10000.0, "partial_rotary_factor": 0.5, "rope_type": "default"}
    assert tiny.hidden_size < full.hidden_size


def test_build_dtype_attention_device_and_seed():
    a = models.build("bert-large-uncased", profile="tiny", head="sequence-classification",
                     dtype=torch.bfloat16, attn_implementation="eager", device="cpu", seed=1)
    b = models.build("bert-large-uncased", profile="tiny", head="sequence-classification",
                     dtype=torch.bfloat16, attn_implementation="eager", device="cpu", seed=1)
    assert next(a.parameters()).dtype == torch.bfloat16
    assert a.config._attn_implementation == "eager"
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)


def test_forward_of_tiny_causal_lm_gives_a_loss():
    model = models.build("polyglot-ko-1.3b", profile="tiny", head="causal-lm", device="cpu")
    ids = torch.randint(100, 1000, (2, 16))
    out = model(input_ids=ids, labels=ids)
    assert out.logits.shape == (2, 16, 30080)
    assert torch.isfinite(out.loss)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(name="gpt-17"), "unknown model 'gpt-17'; known: bert-large-uncased, polyglot-ko-1.3b, llama-2-7b"),
        (dict(name="bert-large-uncased", head="causal-lm"), "has no 'causal-lm' head"),
        (dict(name="bert-large-uncased", attn_implementation="flash"), "attn_implementation must be"),
        (dict(name="bert-large-uncased", profile="medium"), "unknown profile"),
    ],
)
def test_bad_input_is_a_clear_error(kwargs, message):
    name = kwargs.pop("name")
    with pytest.raises(ValueError, match=message):
        models.build(name, device="meta", **kwargs)


def test_checkpoint_roundtrip_through_from_pretrained(tmp_path):
    model = models.build("polyglot-ko-1.3b", profile="tiny", head="causal-lm", device="cpu")
    path = models.save_checkpoint(model, tmp_path / "ckpt")
    assert (path / "config.json").exists()
    loaded = AutoModelForCausalLM.from_pretrained(path)
    ids = torch.randint(100, 1000, (1, 8))
    model.eval()
    loaded.eval()
    assert torch.allclose(model(ids).logits, loaded(ids).logits)


def test_build_leaves_the_callers_random_state_alone():
    """Building a model must not reseed the global generator: later dropout masks and batches stay the caller's."""
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    models.build("bert-large-uncased", profile="tiny", head="base", device="cpu", seed=0)
    assert torch.equal(torch.rand(3), expected)


def test_build_with_the_same_seed_gives_the_same_weights_whatever_the_state():
    torch.manual_seed(1)
    a = models.build("polyglot-ko-1.3b", profile="tiny", head="causal-lm", device="cpu", seed=7)
    torch.manual_seed(2)
    b = models.build("polyglot-ko-1.3b", profile="tiny", head="causal-lm", device="cpu", seed=7)
    c = models.build("polyglot-ko-1.3b", profile="tiny", head="causal-lm", device="cpu", seed=8)
    assert all(torch.equal(pa, pb) for pa, pb in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a.gpt_neox.embed_in.weight, c.gpt_neox.embed_in.weight)


@pytest.mark.gpu
def test_build_on_cuda_leaves_the_cuda_generator_alone():
    torch.cuda.manual_seed(123)
    expected = torch.rand(3, device="cuda")
    torch.cuda.manual_seed(123)
    models.build("bert-large-uncased", profile="tiny", head="base", device="cuda", seed=0)
    assert torch.equal(torch.rand(3, device="cuda"), expected)
