"""The rules of thumb and formulas that the book's measurements are held against.

Every function returns bytes; divide by ``measure.GIB`` for GiB.
"""

from __future__ import annotations

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
    """Bytes of weights, gradients and optimizer states for ``n_params`` under ``recipe``."""
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
    """
    if min(seq_len, batch_size, hidden, heads, layers) <= 0:
        raise ValueError("seq_len, batch_size, hidden, heads and layers must be positive")
    if attention not in ("eager", "flash"):
        raise ValueError(f"attention must be 'eager' or 'flash', got {attention!r}")
    s, b, h, a = seq_len, batch_size, hidden, heads
    per_layer = 34 * s * b * h + (5 * a * s * s * b if attention == "eager" else 0)
    return per_layer * layers


def hf_calculator_training_bytes(model_bytes: int) -> int:
    """The Hugging Face model-memory calculator's training estimate: 4 x the model's size (Adam)."""
    return 4 * model_bytes
