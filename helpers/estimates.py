"""The rules of thumb and formulas that the book's measurements are held against.

Every function returns bytes; divide by ``measure.GIB`` for GiB. Model states carry the same
names as ``accounting.model_state_bytes`` measures: ``weights``, ``gradients``, ``optimizer_states``.

- ``BYTES_PER_PARAM`` / ``model_state_bytes``: bytes per parameter of common training recipes.
- ``korthikanti_activation_bytes``: activations kept for backward by a transformer layer.
- ``hf_calculator_training_bytes``: the Hugging Face calculator's "4 x the model" rule.
- ``zero_model_state_bytes`` / ``zero_table``: per-GPU model states under plain data parallelism
  and ZeRO stages 1-3 (Rajbhandari et al. 2020, figure 1), with the paper's mixed-precision
  defaults (2-byte weights and gradients, K = 12 optimizer bytes per parameter) or any other
  recipe. ``PAPER_7_5B_GB`` is the paper's example, in its units (GB = 10**9 bytes).

>>> zero_model_state_bytes(7.5e9, 64, "zero3")["total"] / 1e9   # 1.875 GB per GPU
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

# Bytes per parameter of the model states (weights, gradients, optimizer states) for common recipes.
# "mixed_adamw" and "mixed_inference" are the Hugging Face docs' counts (model training anatomy):
# mixed precision keeps an fp32 master copy *and* a 16-bit copy of the weights (4 + 2 = 6 bytes).
# "fp16_adamw" is what the LLM book's experiment does: weights, gradients and both AdamW states in fp16.
BYTES_PER_PARAM: dict[str, dict[str, int]] = {
    "fp32_adamw": {"weights": 4, "gradients": 4, "optimizer_states": 8},
    "mixed_adamw": {"weights": 6, "gradients": 4, "optimizer_states": 8},
    "fp16_adamw": {"weights": 2, "gradients": 2, "optimizer_states": 4},
    "fp32_sgd_momentum": {"weights": 4, "gradients": 4, "optimizer_states": 4},
    "mixed_inference": {"weights": 6, "gradients": 0, "optimizer_states": 0},
    "fp32_inference": {"weights": 4, "gradients": 0, "optimizer_states": 0},
    "half_inference": {"weights": 2, "gradients": 0, "optimizer_states": 0},
}


def model_state_bytes(n_params: int, recipe: str) -> dict[str, int]:
    """Bytes of weights, gradients and optimizer states for ``n_params`` under ``recipe``.

    >>> model_state_bytes(335_000_000, "fp32_adamw")["optimizer_states"] / 2**30   # 2.5 GiB

    Introduced in chapter 1, section 1.3.
    """
    if recipe not in BYTES_PER_PARAM:
        raise ValueError(f"unknown recipe {recipe!r}; choose one of {', '.join(BYTES_PER_PARAM)}")
    if n_params < 0:
        raise ValueError(f"n_params must be >= 0, got {n_params}")
    return {part: n_params * b for part, b in BYTES_PER_PARAM[recipe].items()}


def korthikanti_activation_bytes(
    seq_len: int, batch_size: int, hidden: int, heads: int, *, layers: int = 1, attention: str = "eager"
) -> int:
    """Activation bytes kept for backward by ``layers`` transformer layers with 16-bit activations.

    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"), eq. 1:
    ``s*b*h*(34 + 5*a*s/h)`` bytes per layer, for a layer with a 4h-wide MLP, GeLU, dropout (1-byte
    masks) and attention that materialises the s x s score matrix. ``attention="flash"`` drops the
    ``5*a*s^2*b`` score/softmax/dropout term, which a fused attention kernel (FlashAttention, SDPA)
    never stores, leaving ``34*s*b*h``.

    Introduced in chapter 1, section 1.4.
    """
    if min(seq_len, batch_size, hidden, heads, layers) <= 0:
        raise ValueError("seq_len, batch_size, hidden, heads and layers must be positive")
    if attention not in ("eager", "flash"):
        raise ValueError(f"attention must be 'eager' or 'flash', got {attention!r}")
    s, b, h, a = seq_len, batch_size, hidden, heads
    per_layer = 34 * s * b * h + (5 * a * s * s * b if attention == "eager" else 0)
    return per_layer * layers


def hf_calculator_training_bytes(model_bytes: int) -> int:
    """The Hugging Face model-memory calculator's training estimate: 4 x the model's size (Adam).

    Introduced in chapter 1, section 1.6.
    """
    return 4 * model_bytes


# --- ZeRO: model states per GPU under data parallelism ----------------------------------------------

STAGES = ("ddp", "zero1", "zero2", "zero3")
STAGE_LABELS = {
    "ddp": "DDP (replicated)",
    "zero1": "ZeRO-1 (P_os)",
    "zero2": "ZeRO-2 (P_os+g)",
    "zero3": "ZeRO-3 (P_os+g+p)",
}
# Rajbhandari et al. 2020, figure 1: a 7.5B-parameter model, N_d = 64, K = 12, per-GPU model states,
# in GB as the paper prints them (decimal: 120 GB = 16 bytes x 7.5e9 parameters).
PAPER_7_5B_GB = {"ddp": 120.0, "zero1": 31.4, "zero2": 16.6, "zero3": 1.9}


def zero_model_state_bytes(
    n_params: float,
    n_gpus: int,
    stage: str,
    *,
    param_bytes: float = 2,
    grad_bytes: float = 2,
    optimizer_bytes: float = 12,
) -> dict[str, float]:
    """Per-GPU bytes of model states for ``n_params`` parameters on ``n_gpus`` data-parallel GPUs.

    ``stage``: ``"ddp"`` (every GPU holds everything), ``"zero1"`` (optimizer states partitioned),
    ``"zero2"`` (+ gradients), ``"zero3"`` (+ weights). The defaults are the paper's mixed
    precision with Adam: fp16 weights and gradients (2 + 2 bytes) and K = 12 bytes of fp32
    master weights, momentum and variance. For fp32 weights with autocast and AdamW pass
    ``param_bytes=4, grad_bytes=4, optimizer_bytes=8``. Returns ``weights``, ``gradients``,
    ``optimizer_states`` and ``total``, in bytes (floats: a share may be fractional).

    Introduced in chapter 7, section 7.3.
    """
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; choose one of {', '.join(STAGES)}")
    if n_params < 0:
        raise ValueError(f"n_params must be >= 0, got {n_params}")
    if int(n_gpus) != n_gpus or n_gpus < 1:
        raise ValueError(f"n_gpus must be a positive integer, got {n_gpus}")
    if min(param_bytes, grad_bytes, optimizer_bytes) < 0:
        raise ValueError("bytes per parameter must be >= 0")
    level = STAGES.index(stage)  # 0 = nothing partitioned ... 3 = everything
    share = {True: 1 / n_gpus, False: 1.0}
    out = {
        "weights": param_bytes * n_params * share[level >= 3],
        "gradients": grad_bytes * n_params * share[level >= 2],
        "optimizer_states": optimizer_bytes * n_params * share[level >= 1],
    }
    out["total"] = sum(out.values())
    return out


def zero_table(
    n_params: float, n_gpus: Sequence[int], *, stages: Sequence[str] = STAGES, **bytes_per_param: float
) -> pd.DataFrame:
    """Total per-GPU model-state bytes: one row per GPU count, one column per stage.

    Introduced in chapter 7, section 7.3.
    """
    rows = {
        n: {s: zero_model_state_bytes(n_params, n, s, **bytes_per_param)["total"] for s in stages}
        for n in n_gpus
    }
    return pd.DataFrame(rows).T.rename_axis("GPUs")
