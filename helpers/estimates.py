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
- ``engine_transfers`` / ``communication_table``: the collectives each engine (DDP, ZeRO-1 as PyTorch
  runs it, FSDP as ZeRO-2 and ZeRO-3) runs per step, with the bytes each rank sends and the "bus
  bytes" of nccl-tests (``bus_factor``), against the paper's section 7 (``PAPER_COMM_VOLUME_PSI``).

>>> zero_model_state_bytes(7.5e9, 64, "zero3")["total"] / 1e9   # 1.875 GB per GPU
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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


# --- communication: bytes per rank per step, by engine ---------------------------------------------

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
COMM_LABELS = {
    "ddp": "DDP",
    "zero1": "ZeRO-1 as run (DDP + ZeroRedundancyOptimizer)",
    "zero2": "ZeRO-2 (FSDP, kept after forward)",
    "zero3": "ZeRO-3 (FSDP, FULL_SHARD)",
}
# Rajbhandari et al. 2020, section 7.2: data moved per process per step, in units of Psi elements, for
# large N (the (N-1)/N of a ring taken as 1). Baseline data parallelism: an all-reduce = reduce-scatter
# + all-gather, 2 Psi. P_os and P_os+g: the same 2 Psi (a reduce-scatter of gradients, an all-gather
# of updated parameters). P_os+g+p: parameters all-gathered in forward and again in backward plus the
# gradients' reduce-scatter, 3 Psi, "1.5x" the baseline.
PAPER_COMM_VOLUME_PSI = {"ddp": 2.0, "zero1": 2.0, "zero2": 2.0, "zero3": 3.0}


def _check_collective(collective: str, n_ranks: int) -> None:
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; choose one of {', '.join(COLLECTIVES)}")
    if int(n_ranks) != n_ranks or n_ranks < 1:
        raise ValueError(f"n_ranks must be a positive integer, got {n_ranks}")


def bus_factor(collective: str, n_ranks: int) -> float:
    """nccl-tests' factor from algorithm to bus bandwidth: 2(n-1)/n, (n-1)/n, (n-1)/n or 1.

    Introduced in chapter 7, section 7.7.
    """
    _check_collective(collective, n_ranks)
    n = n_ranks
    return {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_gather": (n - 1) / n,
            "broadcast": 1.0}[collective]


def sent_factor(collective: str, n_ranks: int) -> float:
    """Bytes one rank sends per byte of ``S`` with bandwidth-optimal (ring) algorithms, averaged over ranks.

    Equal to ``bus_factor`` except for broadcast: one root's ``S`` bytes reach ``n - 1`` ranks, so the
    ranks send ``(n-1) S`` together, ``(n-1)/n S`` each on average, although the root's link carries
    all ``S`` (which is why its bus factor is 1).

    Introduced in chapter 7, section 7.7.
    """
    _check_collective(collective, n_ranks)
    return (n_ranks - 1) / n_ranks if collective == "broadcast" else bus_factor(collective, n_ranks)


@dataclass(frozen=True)
class Transfer:
    """One kind of collective an engine runs each step: ``size_bytes`` (``S``, summed over the step's calls).

    Introduced in chapter 7, section 7.7.
    """

    engine: str
    when: str
    collective: str
    size_bytes: float
    n_ranks: int

    @property
    def sent_per_rank_bytes(self) -> float:
        return self.size_bytes * sent_factor(self.collective, self.n_ranks)

    @property
    def bus_bytes(self) -> float:
        """Bytes over the busiest link: divided by the measured bus bandwidth, the time it takes."""
        return self.size_bytes * bus_factor(self.collective, self.n_ranks)


def engine_transfers(
    engine: str, n_params: float, n_ranks: int, *, param_bytes: float = 4, grad_bytes: float = 4
) -> list[Transfer]:
    """The collectives of one training step of ``engine`` on ``n_ranks`` data-parallel ranks.

    - ``ddp``: the gradients all-reduced during backward (``S = Psi x grad_bytes``).
    - ``zero1``, as PyTorch runs it (DDP + ``ZeroRedundancyOptimizer``): DDP's all-reduce, then after
      the step every rank broadcasts the parameters it updated, ``n`` broadcasts of ``Psi/n`` each:
      1.5x DDP's bytes when parameters and gradients have the same width. In time it costs more
      on few ranks: the broadcasts run one after another and each is limited by its root's link
      (bus factor 1), so on 2 ranks the parameters take as long as DDP's whole all-reduce (the
      ``bus bytes`` are 2x DDP's, falling to 1.5x for many ranks). (The paper's ZeRO-1
      reduce-scatters the gradients instead and moves 2 Psi, like DDP.)
    - ``zero2`` (FSDP with gathered parameters kept from forward to backward): an all-gather of the
      parameters in forward and a reduce-scatter of the gradients in backward: DDP's bytes.
    - ``zero3`` (FSDP ``FULL_SHARD``): all-gather in forward, again in backward, and the
      reduce-scatter: 1.5x DDP. FSDP2 keeps its root unit (here the embeddings, final norm and head)
      gathered from forward to backward, so it all-gathers slightly less than this in backward.

    ``param_bytes`` and ``grad_bytes`` are the widths on the wire (4 for the fp32 training of chapter 7;
    2 where FSDP's mixed-precision policy gathers and reduces in bf16).

    Introduced in chapter 7, section 7.7.
    """
    if engine not in STAGES:
        raise ValueError(f"unknown engine {engine!r}; choose one of {', '.join(STAGES)}")
    if n_params < 0 or min(param_bytes, grad_bytes) <= 0:
        raise ValueError("need n_params >= 0 and positive bytes per element")
    _check_collective("all_reduce", n_ranks)
    p, g = n_params * param_bytes, n_params * grad_bytes
    steps = {
        "ddp": [("backward", "all_reduce", g)],
        "zero1": [("backward", "all_reduce", g), ("after the optimizer step", "broadcast", p)],
        "zero2": [("forward", "all_gather", p), ("backward", "reduce_scatter", g)],
        "zero3": [("forward", "all_gather", p), ("backward", "all_gather", p), ("backward", "reduce_scatter", g)],
    }[engine]
    return [Transfer(engine, when, coll, size, n_ranks) for when, coll, size in steps]


def communication_table(
    n_params: float, n_ranks: int, *, engines: Sequence[str] = STAGES, param_bytes: float = 4,
    grad_bytes: float = 4,
) -> pd.DataFrame:
    """One row per engine and collective: ``S``, the bytes each rank sends and the bus bytes, per step.

    Sum a column by engine for the step's total.

    Introduced in chapter 7, section 7.7.
    """
    rows = [
        {"engine": t.engine, "when": t.when, "collective": t.collective, "S (bytes)": t.size_bytes,
         "sent per rank (bytes)": t.sent_per_rank_bytes, "bus bytes": t.bus_bytes}
        for e in engines for t in engine_transfers(e, n_params, n_ranks, param_bytes=param_bytes,
                                                   grad_bytes=grad_bytes)
    ]
    return pd.DataFrame(rows)
