"""FLOPs, throughput and model FLOP utilisation (MFU).

One formula, used everywhere in the book (PaLM, Chowdhery et al. 2022, appendix B): training a
decoder or encoder transformer costs, per token,

    6 * N  +  12 * L * d * s        FLOPs

where N counts the weights of the matrix multiplications (every ``nn.Linear``, the LM head
included, the embedding lookups excluded: a lookup does no arithmetic), L is the number of layers,
d the hidden size and s the sequence length. ``6N`` is 2 FLOPs per multiply-add for the forward
pass and twice that for the backward pass; ``12 L d s`` is the attention score and value products
(QK^T and AV), which hold no parameters. A forward pass alone costs a third of this.

MFU = achieved FLOP/s / the GPU's dense peak for the dtype, from ``PEAK_TFLOPS`` (datasheet numbers,
no sparsity). The book also measures the real matmul ceiling, which is always below the datasheet.
"""

from __future__ import annotations

import torch
from torch import nn

# Dense (no 2:4 sparsity) peak TFLOP/s from NVIDIA datasheets. Keys are matched as substrings of
# the device name, in this order, so the more specific names come first.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "H100 PCIe": {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2},
    "H100": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "L4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
    "T4": {"fp16": 65.0, "fp32": 8.1},
    "V100": {"fp16": 125.0, "fp32": 15.7},
}

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def matmul_params(model: nn.Module) -> int:
    """N of the FLOP formula: elements of every ``nn.Linear`` weight (shared weights once)."""
    weights = {id(m.weight): m.weight for m in model.modules() if isinstance(m, nn.Linear)}
    return sum(w.numel() for w in weights.values())


def flops_per_token(n_matmul_params: int, n_layers: int, hidden: int, seq_len: int, *, training: bool = True) -> float:
    """FLOPs per token: ``6N + 12 L d s`` for a training step, a third of it for a forward pass."""
    if min(n_matmul_params, n_layers, hidden, seq_len) <= 0:
        raise ValueError("parameters, layers, hidden size and sequence length must be positive")
    train = 6 * n_matmul_params + 12 * n_layers * hidden * seq_len
    return float(train if training else train / 3)


def peak_tflops(device_name: str, dtype: torch.dtype | str) -> float:
    """Datasheet dense peak for ``device_name`` (e.g. ``"NVIDIA H100 80GB HBM3"``) and dtype."""
    key = _DTYPE_NAMES.get(dtype, dtype) if isinstance(dtype, torch.dtype) else str(dtype)
    for name, table in PEAK_TFLOPS.items():
        if name in device_name:
            if key not in table:
                raise ValueError(f"{name} has no {key} peak in the table; known: {', '.join(table)}")
            return table[key]
    raise ValueError(f"no peak FLOP/s known for {device_name!r}; known GPUs: {', '.join(PEAK_TFLOPS)}")


def throughput(n_samples: int, seq_len: int, time_s: float) -> dict[str, float]:
    """Samples/s and tokens/s of ``n_samples`` sequences of ``seq_len`` processed in ``time_s``."""
    if time_s <= 0:
        raise ValueError(f"time_s must be positive, got {time_s}")
    return {"samples_per_s": n_samples / time_s, "tokens_per_s": n_samples * seq_len / time_s}


def mfu(tokens_per_s: float, flops_per_tok: float, peak_tflops_: float) -> float:
    """Model FLOP utilisation: achieved FLOP/s over peak FLOP/s (a fraction, not a percentage)."""
    return tokens_per_s * flops_per_tok / (peak_tflops_ * 1e12)
