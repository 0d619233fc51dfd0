import pytest
import torch
from torch import nn

from helpers import estimates, flops


def test_matmul_params_counts_linear_weights_only():
    model = nn.Sequential(nn.Embedding(100, 8), nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4, bias=False))
    assert flops.matmul_params(model) == 8 * 16 + 16 * 4


def test_flops_per_token_formula():
    assert flops.flops_per_token(1000, 2, 64, 128) == 6 * 1000 + 12 * 2 * 64 * 128
    assert flops.flops_per_token(1000, 2, 64, 128, training=False) == pytest.approx((6000 + 12 * 2 * 64 * 128) / 3)
    with pytest.raises(ValueError):
        flops.flops_per_token(0, 2, 64, 128)


def test_peak_table_lookup():
    assert flops.peak_tflops("NVIDIA H100 80GB HBM3", torch.bfloat16) == 989.4
    assert flops.peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.5
    assert flops.peak_tflops("Tesla T4", torch.float16) == 65.0
    with pytest.raises(ValueError, match="no bf16 peak"):
        flops.peak_tflops("Tesla T4", torch.bfloat16)
    with pytest.raises(ValueError, match="no peak FLOP/s known"):
        flops.peak_tflops("Some CPU", "fp32")


def test_throughput_and_mfu():
    tp = flops.throughput(8, 512, 2.0)
    assert tp == {"samples_per_s": 4.0, "tokens_per_s": 2048.0}
    assert flops.mfu(1e6, 1e6, 1000.0) == pytest.approx(1e12 / 1e15)
    with pytest.raises(ValueError):
        flops.throughput(8, 512, 0)


def test_bytes_per_param_rules():
    assert sum(estimates.BYTES_PER_PARAM["fp32_adamw"].values()) == 16
    assert sum(estimates.BYTES_PER_PARAM["mixed_adamw"].values()) == 18
    assert sum(estimates.BYTES_PER_PARAM["mixed_inference"].values()) == 6
    parts = estimates.model_state_bytes(1000, "fp16_adamw")
    assert parts == {"weights": 2000, "gradients": 2000, "optimizer_states": 4000}
    with pytest.raises(ValueError, match="unknown recipe"):
        estimates.model_state_bytes(10, "fp64_lion")


def test_korthikanti_formula():
    # GPT-3 175B's numbers in the paper: s=2048, h=12288, a=96, b=1 -> sbh(34 + 5as/h)
    s, b, h, a = 2048, 1, 12288, 96
    assert estimates.korthikanti_activation_bytes(s, b, h, a) == s * b * h * (34 + 5 * a * s // h)
    assert estimates.korthikanti_activation_bytes(s, b, h, a, attention="flash") == 34 * s * b * h
    assert estimates.korthikanti_activation_bytes(s, b, h, a, layers=3) == 3 * estimates.korthikanti_activation_bytes(s, b, h, a)
    with pytest.raises(ValueError, match="attention must be"):
        estimates.korthikanti_activation_bytes(s, b, h, a, attention="linear")
    with pytest.raises(ValueError):
        estimates.korthikanti_activation_bytes(s, -1, h, a)


def test_hf_calculator_rule():
    assert estimates.hf_calculator_training_bytes(2_000) == 8_000
