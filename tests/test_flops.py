import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from helpers import flops, models


def test_matmul_params_counts_linear_weights_only():
    model = nn.Sequential(nn.Embedding(100, 8), nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4, bias=False))
    assert flops.matmul_params(model) == 8 * 16 + 16 * 4


@pytest.mark.parametrize(("batch", "seq"), [(2, 32), (1, 64)])
def test_flops_per_token_agrees_with_torchs_flop_counter(batch, seq):
    """The formula (6N + 12 L d s per token) against the FLOPs PyTorch counts for a real model's matmuls."""
    model = models.build("polyglot-ko-1.3b", profile="tiny", head="causal-lm", device="cpu",
                         attn_implementation="eager", vocab_size=512)
    cfg = model.config
    ids = torch.randint(0, 512, (batch, seq))
    n = flops.matmul_params(model)
    with FlopCounterMode(display=False) as forward:
        model(input_ids=ids)
    with FlopCounterMode(display=False) as step:
        model(input_ids=ids, labels=ids).loss.backward()
    tokens = batch * seq
    per_token = flops.flops_per_token(n, cfg.num_hidden_layers, cfg.hidden_size, seq, training=False)
    assert forward.get_total_flops() == pytest.approx(per_token * tokens, rel=1e-9)
    assert step.get_total_flops() == pytest.approx(
        flops.flops_per_token(n, cfg.num_hidden_layers, cfg.hidden_size, seq) * tokens, rel=1e-9)


def test_flops_per_token_rejects_bad_sizes():
    with pytest.raises(ValueError):
        flops.flops_per_token(0, 2, 64, 128)


def test_throughput_and_mfu():
    tp = flops.throughput(8, 512, 2.0)
    assert tp == {"samples_per_s": 4.0, "tokens_per_s": 2048.0}
    # 1e6 tokens/s x 1e6 FLOPs per token = 1e12 FLOP/s: on a 1000-TFLOP/s card, 0.1% of the peak
    assert flops.mfu(1e6, 1e6, 1000.0) == pytest.approx(1e-3)
    with pytest.raises(ValueError):
        flops.throughput(8, 512, 0)
