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

import re

import torch
from torch import nn

# Dense (no 2:4 sparsity) peak TFLOP/s from NVIDIA's datasheets (sparse figures halved). A key matches a
# device name when every word of the key is a word of the name ("L4" matches "NVIDIA L4", not
# "NVIDIA L40S"); of the keys that match, the one with the most words wins ("H100 NVL" over "H100").
# "H100" and "H200" alone are the SXM boards (torch reports "NVIDIA H100 80GB HBM3", "NVIDIA H200").
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "H200 NVL": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    "H100": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "H100 NVL": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    "H100 PCIe": {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "L40S": {"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6},
    "L4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
    "T4": {"fp16": 65.0, "fp32": 8.1},
    "V100": {"fp16": 125.0, "fp32": 15.7},
}

# Datasheet memory bandwidth (GB/s, decimal: 10**9 bytes per second), matched like PEAK_TFLOPS. A100s are
# left out on purpose: their bandwidth depends on the memory size and form factor, which the name alone
# does not always tell.
PEAK_BANDWIDTH_GB_S: dict[str, float] = {
    "H200": 4800.0,
    "H200 NVL": 4800.0,
    "H100": 3350.0,
    "H100 NVL": 3900.0,
    "H100 PCIe": 2000.0,
    "L40S": 864.0,
    "L4": 300.0,
    "T4": 320.0,
    "V100": 900.0,
}

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def matmul_params(model: nn.Module) -> int:
    """N of the FLOP formula: elements of every ``nn.Linear`` weight (shared weights once).

    Introduced in chapter 8, section 8.3 (the FLOPs of the matrix products inside bert-large).
    """
    weights = {id(m.weight): m.weight for m in model.modules() if isinstance(m, nn.Linear)}
    return sum(w.numel() for w in weights.values())


def flops_per_token(n_matmul_params: int, n_layers: int, hidden: int, seq_len: int, *, training: bool = True) -> float:
    """FLOPs per token: ``6N + 12 L d s`` for a training step, a third of it for a forward pass.

    Introduced in chapter 4, section 4.3 (checked against PyTorch's FLOP counter by the tests); chapter 10,
    section 10.3 computes MFU with it.
    """
    if min(n_matmul_params, n_layers, hidden, seq_len) <= 0:
        raise ValueError("parameters, layers, hidden size and sequence length must be positive")
    train = 6 * n_matmul_params + 12 * n_layers * hidden * seq_len
    return float(train if training else train / 3)


def _words(name: str) -> set[str]:
    return set(re.split(r"[\s\-_]+", name.strip().lower())) - {""}


def gpu_key(device_name: str, table: dict | None = None) -> str | None:
    """The key of ``table`` (default ``PEAK_TFLOPS``) for ``device_name``: the most specific key whose
    words all occur in the name, or None.

    Introduced in chapter 5, section 5.5.
    """
    words = _words(device_name)
    matches = [key for key in (PEAK_TFLOPS if table is None else table) if _words(key) <= words]
    return max(matches, key=lambda k: len(_words(k))) if matches else None


def peak_tflops(device_name: str, dtype: torch.dtype | str) -> float:
    """Datasheet dense peak for ``device_name`` (e.g. ``"NVIDIA H100 80GB HBM3"``) and dtype.

    Raises ``ValueError`` for a GPU that is not in ``PEAK_TFLOPS`` ("unknown GPU") rather than
    guess from a similar name: an L40S is not an L4, an H100 NVL is not an H100 SXM.

    >>> peak_tflops(torch.cuda.get_device_name(), torch.bfloat16)

    Introduced in chapter 5, section 5.5.
    """
    key = _DTYPE_NAMES.get(dtype, dtype) if isinstance(dtype, torch.dtype) else str(dtype)
    name = gpu_key(device_name)
    if name is None:
        raise ValueError(f"unknown GPU {device_name!r}: no peak FLOP/s in the table; known: {', '.join(PEAK_TFLOPS)}")
    table = PEAK_TFLOPS[name]
    if key not in table:
        raise ValueError(f"{name} has no {key} peak in the table; known: {', '.join(table)}")
    return table[key]


def peak_bandwidth_gb_s(device_name: str) -> float:
    """Datasheet memory bandwidth of ``device_name`` in GB/s (10**9 bytes per second).

    Raises ``ValueError`` for a GPU not in ``PEAK_BANDWIDTH_GB_S`` (an A100, whose bandwidth depends on
    the model, among them).

    Introduced in chapter 8, section 8.3.
    """
    key = gpu_key(device_name, PEAK_BANDWIDTH_GB_S)
    if key is None:
        raise ValueError(f"unknown GPU {device_name!r}: no datasheet bandwidth; known: {', '.join(PEAK_BANDWIDTH_GB_S)}")
    return PEAK_BANDWIDTH_GB_S[key]


def throughput(n_samples: int, seq_len: int, time_s: float) -> dict[str, float]:
    """Samples/s and tokens/s of ``n_samples`` sequences of ``seq_len`` processed in ``time_s``.

    Introduced in chapter 3, section 3.1.
    """
    if time_s <= 0:
        raise ValueError(f"time_s must be positive, got {time_s}")
    return {"samples_per_s": n_samples / time_s, "tokens_per_s": n_samples * seq_len / time_s}


def mfu(tokens_per_s: float, flops_per_tok: float, peak_tflops_: float) -> float:
    """Model FLOP utilisation: achieved FLOP/s over peak FLOP/s (a fraction, not a percentage).

    Introduced in chapter 10, section 10.3 (against ``peak_tflops`` and a measured matmul ceiling).
    """
    return tokens_per_s * flops_per_tok / (peak_tflops_ * 1e12)
