"""FLOPs, throughput and model FLOP utilisation (MFU).

One formula, used everywhere in the book (PaLM, Chowdhery et al. 2022, appendix B): training a
decoder or encoder transformer costs, per token,

    6 * N  +  12 * L * d * s        FLOPs

where N counts the weights of the matrix multiplications (every ``nn.Linear``, the LM head
included, the embedding lookups excluded: a lookup does no arithmetic), L is the number of layers,
d the hidden size and s the sequence length. ``6N`` is 2 FLOPs per multiply-add for the forward
pass and twice that for the backward pass; ``12 L d s`` is the attention score and value products
(QK^T and AV), which hold no parameters. A forward pass alone costs a third of this.

MFU = achieved FLOP/s / the GPU's dense peak for the dtype, from ``gpus.PEAK_TFLOPS`` (datasheet
numbers, no sparsity). The book also measures the real matmul ceiling, which is always below the datasheet.
"""

from __future__ import annotations

from torch import nn

# The datasheet peaks live in ``helpers.gpus``; chapters 5, 8 and 10 still call them through ``flops``.


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
