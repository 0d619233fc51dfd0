"""The memory planner: predict the peak allocated memory of a training step, term by term.

A ``Setup`` names the model (a registry name, a ``config.json`` path or a config object) and the recipe
(batch, sequence length, precision, optimizer, accumulation, checkpointing, attention kernel, LoRA/QLoRA,
ZeRO). ``predict`` returns a ``Plan``: the bytes of each component and of each phase of a steady-state
step, which phase holds the peak, and the chapter that measured each term. ``suggest`` lists the
cheapest changes that make a setup fit a budget, ``measure`` runs the step on a device and reads the
allocator, ``baselines`` gives what four published estimators say for the same setup.

>>> p = predict(Setup(model="gpt-neox-1.3b", batch=4, seq=256, precision="bf16-autocast"))
>>> p.peak_gib, p.peak_phase
>>> print(p.table().to_string(na_rep="—"))

Command line: ``python -m helpers.plan --model gpt-neox-1.3b --batch 4 --seq 256 --gpu T4``.

Every term is a count, not a fit to GPU measurements:

- weights, gradients, optimizer states: bytes per parameter of each tensor, counted on a model built on
  the ``meta`` device (chapter 1, section 1.3; chapter 5, section 5.4 for the optimizers; chapter 6 for
  LoRA and QLoRA; chapter 7 for ZeRO);
- activations: the bytes autograd saves for backward, per layer, as integer coefficients of
  ``s*b*h``, ``s*b*I`` (MLP width), ``a*s^2*b`` (eager attention only) and ``a*s*b`` (the fused kernel's
  log-sum-exp) -- Korthikanti et al. (2022)'s formula rewritten for the Hugging Face implementations. The
  coefficients were counted with ``accounting.SavedTensorMeter`` on CPU (exact to the byte, see
  ``tests/test_plan.py``) and carry two CUDA corrections the book measured: dropout masks are 1-byte
  booleans on CUDA (chapter 1, section 1.4: bert-large matches Korthikanti's 34sbh + 5as^2b to 0.1%),
  and the 1.3B GPT-NeoX in fp32 with SDPA saves 28 rather than 32 bytes per s*b*h (chapter 6, section 6.3);
- autocast copies: 2 bytes per matmul weight, cached for the forward pass and saved for backward
  (chapter 1, section 1.3; chapter 5, section 5.1);
- temporaries: the multi-tensor AdamW step's one copy of the states (chapter 1, section 1.5), the loss's
  fp32 logits and their gradients for language-model heads (chapter 4, section 4.3), one layer's
  recomputed activations under checkpointing (chapter 4), Adafactor's per-parameter buffers, and in the
  forward pass the key/value cache that causal LMs build when they compute under autocast from an fp32
  residual stream without checkpointing (fp32 copies no saved tensor shares: ``kv_cache_bytes``, found
  by chapter 10, section 10.2's first GPU run; ``predict(..., kv_cache=False)`` leaves it out).

How sure each term is (what a GPU run should check first):

- counted exactly on CPU and matching the book's GPU runs to about 1%: model states of every optimizer
  (chapter 5's table: 6.31/5.41/4.16/2.91/3.55/2.92 GiB against 6.24/5.36/4.11/2.87/3.50/2.86 predicted,
  the rest being the chapter's 65 MiB baseline), bert-large's saved activations (3.12 GiB at 4 x 512),
  the 1.3B model's in fp32, bf16 autocast, LoRA and QLoRA (chapter 6), and the fp16 batch sweep of
  chapter 4 (17.05 and 26.34 GiB measured above a 0.32 GiB baseline, 16.84 and 26.12 predicted);
- reasoned, not yet seen on a GPU: BERT's eager attention under autocast (7 bytes per score: CUDA's
  autocast runs softmax in fp32), GPT-NeoX with SDPA and 16-bit weights (the CPU count, 16sbh), Llama
  (CPU counts only), the checkpointing schedule's every-k variant, Adafactor's step buffers;
- known gap: chapter 6's QLoRA step peaked 0.3 GiB above the sum of these terms (its peak includes
  loading the quantized checkpoint, which ``measure`` leaves out).

``measure`` leaves out what is allocated before the model is built, including the cuBLAS workspaces
(created by a warm-up matmul in both the forward and the autograd thread), so its peak is the training
step's own; the planner's GPU budgets subtract ``CONTEXT_RESERVE_GIB`` for the CUDA context and these.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import math
import sys
import time
import warnings
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from helpers import accounting, cleanup, estimates
from helpers import measure as _measure
from helpers import models as _models

GIB = 2**30

PRECISIONS = ("fp32", "bf16-autocast", "fp16-autocast", "bf16", "fp16")
OPTIMIZERS = ("adamw", "adamw-fused", "sgd", "sgd-momentum", "adafactor", "adamw8bit", "paged-adamw8bit")
ATTENTIONS = ("sdpa", "eager")

# Names a reader may type, mapped to the registry of ``helpers.models``.
ALIASES = {
    "bert-large": "bert-large-uncased",
    "bert-large-uncased": "bert-large-uncased",
    "gpt-neox-1.3b": "polyglot-ko-1.3b",
    "polyglot-ko-1.3b": "polyglot-ko-1.3b",
    "llama-2-7b": "llama-2-7b",
    "llama-7b": "llama-2-7b",
}

# GPU memory that programs can allocate, in GiB (what the CUDA driver reports as the device's total
# memory). The planner compares the predicted peak
# allocated memory with this less ``CONTEXT_RESERVE_GIB`` (CUDA context, allocator fragmentation).
GPU_MEMORY_GIB = {
    "T4": _measure.T4_MEMORY_GIB,
    "L4": 22.0,
    "A10G": 22.0,
    "V100-16": 15.77,
    "V100-32": 31.74,
    "A100-40": 39.39,
    "A100-80": 79.15,
    "L40S": 44.39,
    "H100": 79.19,
    "H200": 139.8,
}
CONTEXT_RESERVE_GIB = 0.75
NO_BF16_GPUS = ("T4", "V100-16", "V100-32")  # compute capability below 8.0

# Which chapter measured each component (shown by Plan.table()).
SOURCES = {
    "weights": "ch. 1.3 (bytes/param), ch. 2 (dtypes), ch. 6.4 (NF4)",
    "gradients": "ch. 1.3 (dtype of the trainable params), ch. 3 (accumulation)",
    "optimizer_states": "ch. 1.3, ch. 5.4 (AdamW 8 B, 8-bit 2 B, Adafactor factored), ch. 7 (ZeRO)",
    "activations": "ch. 1.4 (Korthikanti et al. 2022, HF layers), ch. 4 (checkpointing)",
    "autocast_copies": "ch. 1.3, ch. 5.1 (16-bit copies of fp32 weights)",
    "temporaries": "ch. 1.5 (foreach AdamW), ch. 4.3 (logits, layer backward), ch. 10.2 (fp32 KV cache)",
}


# ---------------------------------------------------------------------------------------------------
# The setup
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    """One training recipe to plan or measure.

    ``model``: a registry name of ``helpers.models`` (aliases ``bert-large``, ``gpt-neox-1.3b``,
    ``llama-2-7b``), a path to a ``config.json`` or a ``transformers`` config object. ``profile``:
    ``"full"`` (the real shape) or ``"tiny"`` (the registry's CPU twin). ``head``: None picks
    ``sequence-classification`` for BERT and ``causal-lm`` otherwise.

    ``precision``: ``"fp32"``; ``"bf16-autocast"`` / ``"fp16-autocast"`` (fp32 weights, 16-bit matmuls);
    ``"bf16"`` / ``"fp16"`` (the weights themselves in 16 bits). ``checkpointing``: ``"none"``,
    ``"full"`` (every layer) or an int k (every k-th layer). ``lora_rank`` turns on LoRA on
    ``lora_targets``; ``qlora=True`` stores the frozen base in NF4 (needs ``lora_rank``).
    ``zero_stage`` 0-3 and ``world_size``: ZeRO's per-rank share of the model states (formula).

    Introduced in chapter 10, section 10.1.
    """

    model: Any = "gpt-neox-1.3b"
    batch: int = 4
    seq: int = 256
    precision: str = "bf16-autocast"
    optimizer: str = "adamw"
    grad_accum: int = 1
    checkpointing: Any = "none"
    attention: str = "sdpa"
    lora_rank: int | None = None
    lora_targets: tuple[str, ...] = ("query_key_value",)
    lora_dropout: float = 0.05
    qlora: bool = False
    double_quant: bool = True
    zero_stage: int = 0
    world_size: int = 1
    profile: str = "full"
    head: str | None = None

    def replace(self, **changes) -> Setup:
        """A copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)

    def label(self) -> str:
        """A short one-line description."""
        parts = [_model_label(self.model), f"b{self.batch}", f"s{self.seq}", self.precision, self.optimizer]
        if self.grad_accum > 1:
            parts.append(f"ga{self.grad_accum}")
        if self.checkpointing not in ("none", None, 0):
            parts.append(f"ckpt={self.checkpointing}")
        parts.append(self.attention)
        if self.lora_rank:
            parts.append(("qlora" if self.qlora else "lora") + f" r{self.lora_rank}")
        if self.zero_stage:
            parts.append(f"zero{self.zero_stage}x{self.world_size}")
        return " ".join(parts)


def _model_label(model: Any) -> str:
    if isinstance(model, str):
        return Path(model).parent.name if model.endswith(".json") else model
    return type(model).__name__


def validate(s: Setup) -> list[str]:
    """Check a setup; raise ``ValueError`` for an impossible one, return warnings for odd ones.

    Not used in a chapter directly: part of chapter 10's planner (section 10.1).
    """
    notes: list[str] = []
    for name in ("batch", "seq", "grad_accum", "world_size"):
        v = getattr(s, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if s.precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {s.precision!r}")
    if s.optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {s.optimizer!r}")
    if s.attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {', '.join(ATTENTIONS)}, got {s.attention!r}")
    ck = s.checkpointing
    if not (ck in ("none", "full", None) or (isinstance(ck, int) and not isinstance(ck, bool) and ck >= 1)):
        raise ValueError(f"checkpointing must be 'none', 'full' or a positive int k (every k-th layer), got {ck!r}")
    if s.lora_rank is not None and (not isinstance(s.lora_rank, int) or s.lora_rank < 1):
        raise ValueError(f"lora_rank must be a positive integer or None, got {s.lora_rank!r}")
    if s.lora_rank is not None and not s.lora_targets:
        raise ValueError("LoRA needs at least one target module (lora_targets)")
    if not 0 <= s.lora_dropout < 1:
        raise ValueError(f"lora_dropout must be in [0, 1), got {s.lora_dropout}")
    if s.qlora and s.lora_rank is None:
        raise ValueError("QLoRA trains LoRA adapters on an NF4 base: give lora_rank")
    if s.qlora and s.precision in ("fp32", "bf16", "fp16"):
        notes.append("QLoRA computes in 16 bits: the plan assumes bf16 compute (autocast) as chapter 6 does")
    if s.zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {s.zero_stage!r}")
    if s.zero_stage and s.world_size == 1:
        notes.append("ZeRO with world_size 1 partitions nothing: the plan equals stage 0")
    if s.profile not in ("full", "tiny"):
        raise ValueError(f"profile must be 'full' or 'tiny', got {s.profile!r}")
    shape = _shape(s)
    if s.lora_rank is not None:
        missing = [t for t in s.lora_targets if t not in shape.linear_names]
        if missing:
            raise ValueError(
                f"LoRA targets {missing} are not linear layers of {shape.family}; "
                f"choose from {', '.join(sorted(shape.linear_names))}"
            )
    if s.seq > shape.max_positions:
        raise ValueError(f"seq {s.seq} exceeds the model's {shape.max_positions} positions")
    if isinstance(ck, int) and not isinstance(ck, bool) and ck > shape.layers:
        raise ValueError(f"checkpointing every k = {ck} layers: the model has only {shape.layers} layers "
                         f"(use 'full' to checkpoint every layer, or k <= {shape.layers})")
    return notes


# ---------------------------------------------------------------------------------------------------
# The model's shape, counted on the meta device
# ---------------------------------------------------------------------------------------------------

# Linear layers of one block grouped by the tensor they read: linears of a group share one input, so
# autograd saves it once. (family -> list of (group input width key, names)).
_INPUT_GROUPS = {
    "bert": [("h", ("attention.self.query", "attention.self.key", "attention.self.value")),
             ("h", ("attention.output.dense",)), ("h", ("intermediate.dense",)), ("I", ("output.dense",))],
    "gpt_neox": [("h", ("attention.query_key_value",)), ("h", ("attention.dense",)),
                 ("h", ("mlp.dense_h_to_4h",)), ("I", ("mlp.dense_4h_to_h",))],
    "llama": [("h", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")), ("h", ("self_attn.o_proj",)),
              ("h", ("mlp.gate_proj", "mlp.up_proj")), ("I", ("mlp.down_proj",))],
}
# Inputs of these groups are fp32 under autocast (outputs of LayerNorm/RMSNorm on the fp32 residual
# stream), so each linear of the group saves its own 16-bit cast copy; the others read 16-bit tensors.
_FP32_INPUT_UNDER_AUTOCAST = {"bert": (0, 2), "gpt_neox": (0, 2), "llama": (0, 2)}


@dataclass(frozen=True)
class Param:
    """One parameter tensor: name, shape, and where it sits (layer linear, embedding, head, other).

    Not used in a chapter directly: part of chapter 10's planner (section 10.1).
    """

    name: str
    shape: tuple[int, ...]
    kind: str  # "linear" (in a block), "embedding", "head", "other"
    module: str = ""  # the linear's short name inside the block ("query_key_value", ...)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Shape:
    """The sizes the planner needs, read from a model built on the meta device.

    Not used in a chapter directly: part of chapter 10's planner (section 10.1).
    """

    family: str
    head: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    vocab: int
    max_positions: int
    params: tuple[Param, ...]
    linear_names: frozenset[str]
    layer_linears: tuple[tuple[str, int, int], ...]  # (short name, in_features, out_features) of one block
    tied_head: bool

    @property
    def n_params(self) -> int:
        return sum(p.numel for p in self.params)

    def layer_linear_numel(self) -> int:
        return sum(i * o for _, i, o in self.layer_linears)

    def head_linear_numel(self) -> int:
        return sum(p.numel for p in self.params if p.kind == "head" and len(p.shape) == 2)


def _resolve_config(model: Any, profile: str) -> tuple[PretrainedConfig, str]:
    if isinstance(model, PretrainedConfig):
        return model, model.to_json_string()
    if not isinstance(model, str):
        raise ValueError(f"model must be a registry name, a config.json path or a config object, got {type(model).__name__}")
    if model in ALIASES:
        name = ALIASES[model]
        return _models.config(name, profile), f"{name}@{profile}"
    path = Path(model)
    if path.suffix == ".json" or path.is_dir():
        if not path.exists():
            raise ValueError(f"no config file at {model!r}")
        cfg = AutoConfig.from_pretrained(str(path.parent if path.is_file() else path))
        return cfg, cfg.to_json_string()
    raise ValueError(f"unknown model {model!r}; known: {', '.join(ALIASES)} (or a path to a config.json)")


_FAMILY = {"bert": "bert", "gpt_neox": "gpt_neox", "llama": "llama", "mistral": "llama", "qwen2": "llama"}


def _default_head(family: str) -> str:
    return "sequence-classification" if family == "bert" else "causal-lm"


@functools.lru_cache(maxsize=64)
def _shape_cached(key: str, head: str | None, cfg_json: str) -> Shape:
    cfg = _CFG_STORE[key]
    family = _FAMILY.get(cfg.model_type)
    if family is None:
        raise ValueError(f"model type {cfg.model_type!r} is not supported; the planner knows BERT, GPT-NeoX and Llama")
    head = head or _default_head(family)
    cls = _models._HEAD_CLASSES[head]
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = cls.from_config(cfg)
    layer_prefix = {"bert": "encoder.layer.", "gpt_neox": "layers.", "llama": "layers."}[family]
    params, names, first = [], set(), []
    seen: set[int] = set()
    for name, p in m.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        kind = "other"
        short = ""
        if layer_prefix in name:
            rest = name.split(layer_prefix, 1)[1].split(".", 1)[1]  # drop the layer index
            if p.dim() == 2:
                kind = "linear"
                short = rest.rsplit(".", 1)[0]
                names.add(short.split(".")[-1])
                names.add(short)
        elif "embed" in name and "embed_out" not in name:
            kind = "embedding"
        elif p.dim() == 2 and ("lm_head" in name or "embed_out" in name or "classifier" in name or "pooler" in name):
            kind = "head"
        params.append(Param(name, tuple(p.shape), kind, short))
    layer0 = [mod for mod in m.modules() if type(mod).__name__.endswith(("Layer", "DecoderLayer"))][0]
    for mname, mod in layer0.named_modules():
        if isinstance(mod, nn.Linear):
            first.append((mname, mod.in_features, mod.out_features))
    tied = bool(getattr(cfg, "tie_word_embeddings", False)) and head == "causal-lm"
    return Shape(
        family=family, head=head, layers=cfg.num_hidden_layers, hidden=cfg.hidden_size,
        intermediate=cfg.intermediate_size, heads=cfg.num_attention_heads, vocab=cfg.vocab_size,
        max_positions=getattr(cfg, "max_position_embeddings", 10**9), params=tuple(params),
        linear_names=frozenset(names), layer_linears=tuple(first), tied_head=tied,
    )


_CFG_STORE: dict[str, PretrainedConfig] = {}


def _shape(s: Setup) -> Shape:
    cfg, key = _resolve_config(s.model, s.profile)
    _CFG_STORE[key] = cfg
    return _shape_cached(key, s.head, "")


def shape(s: Setup) -> Shape:
    """The sizes of ``s.model`` (layers, widths, every parameter's shape), from a meta-device build.

    Not used in a chapter directly: part of chapter 10's planner (section 10.1).
    """
    return _shape(s)


# ---------------------------------------------------------------------------------------------------
# Activation coefficients: bytes saved for backward per layer
# ---------------------------------------------------------------------------------------------------

# (family, precision class, attention) -> bytes per layer as coefficients of
# (s*b*h, s*b*I, a*s^2*b, a*s*b, s*b). Precision classes: "fp32" (fp32 weights, no autocast), "amp"
# (fp32 weights, 16-bit autocast), "half" (16-bit weights, no autocast). Counted with SavedTensorMeter
# on CPU (``backend="cpu"``: exact, tests/test_plan.py) and corrected for CUDA where the two differ:
# dropout masks (BERT) are bool on CUDA (1 byte) but the dropout's dtype on CPU, and autocast runs
# softmax in fp32 on CUDA only. These are the per-layer versions of Korthikanti et al. (2022)'s
# 34sbh + 5as^2b: BERT in bf16 on CUDA is exactly 34sbh (= 18sbh + 4sbI with I = 4h) + 5as^2b.
ACT_COEF_CPU = {
    ("bert", "fp32", "eager"): (40, 8, 12, 0, 16), ("bert", "fp32", "sdpa"): (40, 8, 0, 4, 16),
    ("bert", "amp", "eager"): (28, 4, 6, 0, 16), ("bert", "amp", "sdpa"): (28, 4, 0, 4, 16),
    ("bert", "half", "eager"): (20, 4, 6, 0, 8), ("bert", "half", "sdpa"): (20, 4, 0, 4, 8),
    ("gpt_neox", "fp32", "eager"): (28, 8, 4, 0, 16), ("gpt_neox", "fp32", "sdpa"): (32, 8, 0, 4, 16),
    ("gpt_neox", "amp", "eager"): (16, 4, 6, 0, 16), ("gpt_neox", "amp", "sdpa"): (18, 4, 0, 4, 16),
    ("gpt_neox", "half", "eager"): (14, 4, 6, 0, 8), ("gpt_neox", "half", "sdpa"): (16, 4, 0, 4, 8),
    ("llama", "fp32", "eager"): (40, 16, 4, 0, 8), ("llama", "fp32", "sdpa"): (40, 16, 0, 4, 8),
    ("llama", "amp", "eager"): (34, 8, 6, 0, 8), ("llama", "amp", "sdpa"): (34, 8, 0, 4, 8),
    ("llama", "half", "eager"): (24, 8, 6, 0, 8), ("llama", "half", "sdpa"): (24, 8, 0, 4, 8),
}
# BERT's dropouts per layer: two on s*b*h tensors, one on the attention probabilities (eager only).
_BERT_MASKS = (2, 0, 1, 0, 0)
# Bytes per element of the tensors BERT's dropout masks are made for, on CPU (the mask has the dtype
# of its input there): fp32 4, autocast 2 (the matmul outputs), half 2.
_CPU_MASK_BYTES = {"fp32": 4, "amp": 2, "half": 2}


def _act_coef(family: str, pclass: str, attention: str, backend: str) -> tuple[float, ...]:
    c = list(ACT_COEF_CPU[(family, pclass, attention)])
    if backend == "cpu":
        return tuple(c)
    if family == "bert":  # CUDA dropout masks are bool (1 byte), CPU's are the input's dtype
        m = _CPU_MASK_BYTES[pclass]
        c = [ci - k * (m - 1) if ci else 0 for ci, k in zip(c, _BERT_MASKS, strict=True)]
        if pclass == "amp" and attention == "eager":
            # CUDA autocast runs softmax in fp32: fp32 probabilities (4) + mask (1) + bf16 copy for A.V (2)
            c[2] = 7
    if (family, pclass, attention) == ("gpt_neox", "fp32", "sdpa"):
        c[0] = 28  # chapter 6, section 6.3: the 1.3B model in fp32 saves 2.94 GiB at 4 x 256 (28sbh, not CPU's 32)
    return tuple(c)


# Outside the blocks (embeddings, final norm, head, loss), per token: coefficient of s*b*h by
# (family, precision class). Language-model heads add the loss's fp32 log-softmax, 4*s*b*V.
_OTHER_SBH = {
    ("bert", "fp32"): 9, ("bert", "amp"): 5, ("bert", "half"): 5,
    ("gpt_neox", "fp32"): 8, ("gpt_neox", "amp"): 6, ("gpt_neox", "half"): 4,
    ("llama", "fp32"): 12, ("llama", "amp"): 10, ("llama", "half"): 8,
}
# On CPU BERT's embedding dropout mask has the dtype of the embeddings (fp32) rather than 1 byte.
_OTHER_SBH_CPU = {("bert", "fp32"): 12, ("bert", "amp"): 8, ("bert", "half"): 6}


def _pclass(s: Setup) -> str:
    if s.qlora:
        return "amp"
    if s.precision in ("bf16-autocast", "fp16-autocast"):
        return "amp"
    if s.precision == "fp32":
        return "fp32"
    # pure 16-bit weights; with LoRA the book runs under autocast too (fp32 adapters, chapter 6)
    return "amp" if s.lora_rank else "half"


def _elem(s: Setup) -> int:
    """Bytes per element of activations kept in the model's dtype."""
    return 4 if _pclass(s) == "fp32" else 2


def _checkpointed_layers(s: Setup, n_layers: int) -> list[bool]:
    ck = s.checkpointing
    if ck in ("none", None):
        return [False] * n_layers
    k = 1 if ck == "full" else int(ck)
    return [i % k == 0 for i in range(n_layers)]


def _lora_targets(s: Setup, shape: Shape) -> list[tuple[str, int, int]]:
    """Block linears that carry adapters, matched as peft does (the module name ends with a target)."""
    if not s.lora_rank:
        return []
    out = []
    for name, i, o in shape.layer_linears:
        if any(name == t or name.endswith("." + t) for t in s.lora_targets):
            out.append((name, i, o))
    return out


def layer_activation_bytes(s: Setup, *, backend: str = "cuda") -> int:
    """Bytes one transformer block saves for backward at ``s.batch`` x ``s.seq`` (no checkpointing).

    ``backend="cpu"`` gives what ``SavedTensorMeter`` counts on a CPU (exact, see the tests);
    ``"cuda"`` applies the two CUDA corrections described in ``ACT_COEF_CPU``.

    Not used in a chapter directly: part of chapter 10's planner (section 10.1).
    """
    shape = _shape(s)
    pc = _pclass(s)
    b, q, h, wide, a = s.batch, s.seq, shape.hidden, shape.intermediate, shape.heads
    feats = (q * b * h, q * b * wide, a * q * q * b, a * q * b, q * b)
    c = _act_coef(shape.family, pc, s.attention, backend)
    total = sum(ci * f for ci, f in zip(c, feats, strict=True))
    if s.lora_rank:
        total += _lora_activation_delta(s, shape, pc, backend) * q * b
    if backend == "cuda" and pc == "amp":
        total += _amp_16bit_base_delta(s, shape) * q * b
    return int(total)


def _amp_16bit_base_delta(s: Setup, shape: Shape) -> float:
    """Per-token bytes that a 16-bit or NF4 base adds under CUDA autocast, beyond fp32 weights + autocast.

    - A bf16/fp16 base (LoRA, chapter 6): the residual stream is 16-bit, and CUDA autocast runs
      LayerNorm in fp32, so each LayerNorm saves its own fp32 copy of its input. GPT-NeoX's two
      LayerNorms read the same tensor (parallel residual), which an fp32 stream would share: +4*h.
      (BERT's LayerNorms read different tensors either way; Llama's RMSNorm casts explicitly.)
    - An NF4 base (QLoRA): ``prepare_model_for_kbit_training`` makes the residual stream fp32 and
      bitsandbytes' ``Linear4bit`` returns its input's dtype, so the MLP's up-projection output is fp32
      and the activation after it saves fp32 instead of bf16: +2*I (GPT-NeoX, BERT: GELU's input);
      Llama's SiLU input, its output and the up-projection, each saved by the product: +6*I.
    Reasoned from the Hugging Face and bitsandbytes code; chapter 6, section 6.3's measurements (LoRA
    2.23 GiB, QLoRA 2.54 GiB of saved activations at 4 x 256) agree with these terms to 1%.
    """
    if s.qlora:
        return {"llama": 6}.get(shape.family, 2) * shape.intermediate
    if s.precision in ("bf16", "fp16") and shape.family == "gpt_neox":
        return 4 * shape.hidden
    return 0.0


def _lora_activation_delta(s: Setup, shape: Shape, pc: str, backend: str) -> float:
    """Per-token change of a block's saved bytes when the base is frozen and adapters are added.

    A frozen linear no longer saves its input (autograd saves it only for the weight's gradient); each
    adapter saves its own input (dropout mask + dropped copy, or a cast copy) and its rank-r output.
    """
    targets = {n for n, _, _ in _lora_targets(s, shape)}
    e_x = 4 if pc == "fp32" else 2
    e_adapter = 4  # peft keeps adapters in fp32 (autocast_adapter_dtype)
    drop = s.lora_dropout > 0
    fp32_groups = _FP32_INPUT_UNDER_AUTOCAST[shape.family]
    widths = {"h": shape.hidden, "I": shape.intermediate}
    # The output projection reads a view of the fused attention kernel's output (which the kernel keeps
    # for its own backward) when that output is laid out (b, s, heads, d): BERT's on CPU and CUDA,
    # GPT-NeoX's on CUDA (the reason its fp32 blocks save 28sbh there, 32sbh on CPU).
    shared_out = s.attention == "sdpa" and (
        shape.family == "bert" or (backend == "cuda" and shape.family == "gpt_neox" and pc == "fp32"))
    delta = 0.0
    for gi, (wkey, members) in enumerate(_INPUT_GROUPS[shape.family]):
        d = widths[wkey]
        names = [n for n, _, _ in shape.layer_linears if n in members]
        n_t = sum(1 for n in names if n in targets)
        # what the frozen base no longer saves
        if gi == 1 and shared_out:
            pass  # the fused kernel's output stays saved whether or not the projection is frozen
        elif pc == "amp" and gi in fp32_groups:
            delta -= len(names) * 2 * d
        else:
            delta -= e_x * d
        if not n_t:
            continue
        if pc == "amp":
            mask = (4 if backend == "cpu" else 1) if drop else 0  # dropout runs on peft's fp32 cast
            # QLoRA / bf16 base: the group's input is fp32 only when it comes from a norm
            delta += n_t * (mask + 2) * d
        elif drop:
            mask = e_adapter if backend == "cpu" else 1
            delta += n_t * (mask + e_adapter) * d
        elif e_x == e_adapter:
            if not (gi == 1 and shared_out):
                delta += e_x * d  # lora_A saves the base's input itself, once per group
        else:
            delta += n_t * e_adapter * d  # a cast copy per adapter
    r_bytes = 2 if pc == "amp" else e_adapter
    delta += len(targets) * s.lora_rank * r_bytes
    return delta


def other_activation_bytes(s: Setup, *, backend: str = "cuda") -> int:
    """Bytes saved outside the blocks: embeddings, final norm, head, and the loss's fp32 log-softmax.

    Not used in a chapter directly: part of chapter 10's planner (section 10.1).
    """
    shape = _shape(s)
    pc = _pclass(s)
    tok = s.batch * s.seq
    k = _OTHER_SBH.get((shape.family, pc), 8)
    if backend == "cpu":
        k = _OTHER_SBH_CPU.get((shape.family, pc), k)
    if s.lora_rank and shape.head == "causal-lm" and shape.family == "gpt_neox":
        k = 4  # the frozen LM head no longer saves its input; the final LayerNorm's fp32 input remains
    total = k * tok * shape.hidden
    total += (20 if pc == "half" else 24) * tok  # token ids for the embedding's backward, norm statistics
    if shape.head == "causal-lm":
        total += 4 * tok * shape.vocab
    return int(total)


# ---------------------------------------------------------------------------------------------------
# Model states
# ---------------------------------------------------------------------------------------------------

NF4_BLOCK = 64  # bitsandbytes 4-bit block size: one absmax per 64 weights
DQ_BLOCK = 256  # double quantization: the absmaxes quantized to 8 bits in blocks of 256
BNB_OPT_BLOCK = 256  # 8-bit optimizer states: one fp32 absmax per 256 values per state
BNB_MIN_8BIT = 4096  # bitsandbytes keeps 32-bit states for tensors smaller than this


def _weight_dtype_bytes(s: Setup) -> int:
    return 2 if s.precision in ("bf16", "fp16") else 4


def _trainable(s: Setup, shape: Shape) -> list[tuple[int, tuple[int, ...], int]]:
    """(numel, shape, bytes per element) of each trainable tensor."""
    if s.lora_rank:
        out = []
        for _, i, o in _lora_targets(s, shape):
            for _ in range(shape.layers):
                out.append((s.lora_rank * i, (s.lora_rank, i), 4))
                out.append((o * s.lora_rank, (o, s.lora_rank), 4))
        return out
    eb = _weight_dtype_bytes(s)
    return [(p.numel, p.shape, eb) for p in _params(shape)]


def _params(shape: Shape) -> tuple[Param, ...]:
    return shape.params


def lora_trainable_params(s: Setup) -> int:
    """Adapter parameters: r x (in + out) per targeted linear, in every block.

    Introduced in chapter 6, section 6.2 (the count); used by the planner of chapter 10.
    """
    shape = _shape(s)
    return sum(s.lora_rank * (i + o) for _, i, o in _lora_targets(s, shape)) * shape.layers if s.lora_rank else 0


def weight_bytes(s: Setup) -> int:
    """Bytes of all weights on the device (frozen base, adapters, NF4 statistics), before ZeRO.

    Not used in a chapter directly: part of chapter 10's planner (section 10.1).
    """
    shape = _shape(s)
    if s.qlora:
        total = 0.0
        for p in shape.params:
            if p.kind == "linear":
                n = p.numel
                stats = n / NF4_BLOCK * ((1 + 4 / DQ_BLOCK) if s.double_quant else 4)
                total += n * 0.5 + stats
            else:  # prepare_model_for_kbit_training casts the non-quantized parameters to fp32
                total += 4 * p.numel
        return int(total + 4 * lora_trainable_params(s))
    base = _weight_dtype_bytes(s) * shape.n_params
    return base + 4 * lora_trainable_params(s)


def gradient_bytes(s: Setup) -> int:
    """Bytes of the gradients of the trainable parameters (their dtype), before ZeRO.

    Not used in a chapter directly: part of chapter 10's planner (section 10.1).
    """
    return sum(n * e for n, _, e in _trainable(s, _shape(s)))


def optimizer_state_bytes(s: Setup) -> int:
    """Bytes of optimizer states on the device, before ZeRO (paged 8-bit states live in unified memory: 0).

    AdamW: two states in the parameter's dtype (8 bytes per fp32 parameter); SGD with momentum: one;
    Adafactor (transformers): a row and a column vector per matrix, a full vector per 1-D tensor, fp32;
    8-bit AdamW (bitsandbytes): 2 bytes + two fp32 absmaxes per 256 values, 32-bit states for tensors
    under 4096 values. Chapter 5, section 5.4 measured 8.00, 4.00, 0.01 and 2.04 bytes per parameter.

    Not used in a chapter directly: part of chapter 10's planner (section 10.1).
    """
    opt = s.optimizer
    total = 0
    for n, shp, e in _trainable(s, _shape(s)):
        if opt in ("adamw", "adamw-fused"):
            total += 2 * n * e
        elif opt == "sgd-momentum":
            total += n * e
        elif opt == "adafactor":  # transformers' Adafactor keeps fp32 states (it upcasts 16-bit gradients)
            total += (math.prod(shp[:-1]) + math.prod(shp[:-2]) * shp[-1]) * 4 if len(shp) >= 2 else n * 4
        elif opt == "adamw8bit":
            total += 2 * n + 2 * 4 * math.ceil(n / BNB_OPT_BLOCK) if n >= BNB_MIN_8BIT else 8 * n
    return int(total)


def _zero_share(s: Setup) -> tuple[float, float, float]:
    """Per-rank fractions of weights, gradients, optimizer states (Rajbhandari et al. 2020)."""
    w = s.world_size
    st = s.zero_stage
    return (1 / w if st >= 3 else 1.0, 1 / w if st >= 2 else 1.0, 1 / w if st >= 1 else 1.0)


def autocast_copy_bytes(s: Setup) -> int:
    """Bytes of the 16-bit copies autocast makes of fp32 matmul weights (0 without fp32 weights + autocast).

    Not used in a chapter directly: a term of ``predict`` (introduced in chapter 10, section 10.1), measured
    in chapter 1, section 1.3 and chapter 5, section 5.1.
    """
    if _pclass(s) != "amp":
        return 0
    shape = _shape(s)
    total = 0
    if not s.qlora and s.precision not in ("bf16", "fp16"):
        total += 2 * shape.layers * shape.layer_linear_numel()  # block weights, fp32 -> 16 bit
    if s.qlora or s.precision not in ("bf16", "fp16"):
        total += 2 * shape.head_linear_numel()  # the head (fp32 also under QLoRA: not quantized)
    total += 2 * lora_trainable_params(s)
    return total


def kv_cache_bytes(s: Setup) -> int:
    """Bytes of the key/value cache a causal LM builds during a training forward pass, beyond what it saves.

    Without checkpointing, Hugging Face causal LMs (GPT-NeoX, Llama) keep ``use_cache=True`` in training:
    every block appends its keys and values to a ``DynamicCache`` that lives in the model's output until
    the loop drops it (``loss = model(**batch).loss``), i.e. through the forward pass, not the backward.
    The cache holds copies (``torch.cat``); with an fp32 residual stream under autocast (fp32 weights, or
    QLoRA's fp32 stream) the rotary embedding's fp32 ``cos``/``sin`` promote the keys to fp32 and the
    cache's concatenation promotes the values, so it holds 2 x 4 bytes per token and hidden unit per
    block, and attention saves the 16-bit casts instead: 8*s*b*h per block that no saved-tensor count
    sees. In every other case (fp32 without autocast, 16-bit weights) attention saves the cache's own
    tensors, so nothing is added. Checkpointing switches the cache off. Counted on CPU with the
    ``DynamicCache`` of the model's output (``tests/test_plan.py``); before this term (the version
    chapter 10's first GPU run validated) the planner left it out and under-predicted the forward
    peaks of these rows by about 8 bytes per token x hidden x layer.

    Introduced in chapter 10, section 10.2.
    """
    shape = _shape(s)
    if shape.head != "causal-lm" or shape.family not in ("gpt_neox", "llama"):
        return 0
    if any(_checkpointed_layers(s, shape.layers)) or _pclass(s) != "amp":
        return 0
    if s.precision in ("bf16", "fp16") and not s.qlora:  # 16-bit stream: the cache is what attention saves
        return 0
    return 8 * s.batch * s.seq * shape.hidden * shape.layers


# ---------------------------------------------------------------------------------------------------
# Phases and the plan
# ---------------------------------------------------------------------------------------------------

COMPONENTS = ("weights", "gradients", "optimizer_states", "activations", "autocast_copies", "temporaries")
PHASES = ("forward", "backward", "optimizer step")


@dataclass
class Plan:
    """A prediction: bytes by component at the peak, bytes by phase, and the whole-step totals.

    ``components`` are what is alive at the peak moment (they sum to ``peak_bytes``); ``totals`` are
    the full sizes of each term (all activations, all gradients); ``phases`` the peak of each phase.

    Introduced in chapter 10, section 10.1.
    """

    setup: Setup
    components: dict[str, int]
    phases: dict[str, int]
    phase_components: dict[str, dict[str, int]]
    totals: dict[str, int]
    notes: list[str] = field(default_factory=list)

    @property
    def peak_bytes(self) -> int:
        return max(self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda k: self.phases[k])

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GIB

    def fits(self, budget_gib: float) -> bool:
        """True when the predicted peak allocated memory is at most ``budget_gib``."""
        return self.peak_bytes <= budget_gib * GIB

    def table(self) -> pd.DataFrame:
        """One row per component: bytes and GiB at the peak, the whole-step total, and its source.

        The last row is the peak; its whole-step total is empty (NaN), so print the table with
        ``to_string(na_rep="—")`` as the command line does.
        """
        rows = [
            {"component": c, "bytes": self.components.get(c, 0), "GiB": self.components.get(c, 0) / GIB,
             "total (GiB)": self.totals.get(c, 0) / GIB, "source": SOURCES[c]}
            for c in COMPONENTS
        ]
        rows.append({"component": f"peak ({self.peak_phase})", "bytes": self.peak_bytes, "GiB": self.peak_gib,
                     "total (GiB)": float("nan"), "source": ""})
        return pd.DataFrame(rows).set_index("component")

    def explain(self) -> str:
        """A few lines: the setup, each phase's peak, and what the peak is made of."""
        lines = [f"setup: {self.setup.label()}"]
        lines += [f"  {ph:15s} {b / GIB:8.2f} GiB" + ("  <- peak" if ph == self.peak_phase else "")
                  for ph, b in self.phases.items()]
        parts = ", ".join(f"{c} {b / GIB:.2f}" for c, b in self.components.items() if b)
        lines.append(f"peak {self.peak_gib:.2f} GiB in the {self.peak_phase}: {parts} (GiB)")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _loss_bytes(s: Setup, shape: Shape) -> tuple[int, int]:
    """(forward, backward) transient bytes of a language-model loss: logits and their gradients."""
    if shape.head != "causal-lm":
        return 0, 0
    tv = s.batch * s.seq * shape.vocab
    fwd = 4 * tv if _pclass(s) == "fp32" else 6 * tv  # the logits (+ their fp32 copy) next to the log-softmax
    bwd = 8 * tv  # the fp32 gradients of the log-softmax and of the logits (chapter 4, section 4.3)
    return fwd, bwd


def predict(s: Setup, *, backend: str = "cuda", kv_cache: bool = True) -> Plan:
    """Predict the peak allocated memory of a steady-state training step of ``s`` (per rank).

    The phases are those of the book's loop (``loss = model(**batch).loss``, ``loss.backward()``,
    ``optimizer.step()``, ``zero_grad(set_to_none=True)``): the forward pass of step 2 holds the weights,
    the optimizer states and the activations; the backward pass frees activations as it creates
    gradients (the planner walks it layer by layer); the optimizer step holds weights, gradients, states
    and the step's temporaries. Under gradient accumulation the gradients are alive from the second
    micro-batch on. The forward pass also holds the fp32 key/value cache of ``kv_cache_bytes`` (as
    temporaries); ``kv_cache=False`` leaves it out, as the planner did before chapter 10's GPU run
    showed the gap.

    Introduced in chapter 10, section 10.1.
    """
    notes = validate(s)
    shape = _shape(s)
    pc = _pclass(s)
    fw, fg, fo = _zero_share(s)
    L = shape.layers
    W = int(weight_bytes(s) * fw)
    G_full = gradient_bytes(s)
    G = int(G_full * fg)
    O_full = optimizer_state_bytes(s)
    Ost = int(O_full * fo)
    if s.optimizer == "paged-adamw8bit":
        notes.append("paged 8-bit AdamW keeps its states in CUDA unified memory, outside torch's allocator")
    C_all = autocast_copy_bytes(s)
    C_layer = (C_all - 2 * shape.head_linear_numel() - 2 * lora_trainable_params(s)) // L if C_all else 0
    C_layer = max(C_layer, 0) + (2 * lora_trainable_params(s) // L if C_all else 0)
    C_head = C_all - C_layer * L
    A_layer = layer_activation_bytes(s, backend=backend)
    A_other = other_activation_bytes(s, backend=backend)
    ck = _checkpointed_layers(s, L)
    if any(ck) and shape.family == "gpt_neox" and s.attention == "sdpa":
        # Checkpointing turns the KV cache off (use_cache=False): the value tensor SDPA saves is then a
        # view of the fused QKV output, which keeps all three projections alive (+2 of them), instead of
        # the cache's copy. Counted with SavedTensorMeter on CPU: +8 (fp32) / +4 (16-bit) bytes per s*b*h.
        A_layer += (8 if pc == "fp32" else 4) * s.batch * s.seq * shape.hidden
    e_res = 4 if (pc in ("fp32", "amp") and s.precision not in ("bf16", "fp16")) or s.qlora else 2
    inp = e_res * s.batch * s.seq * shape.hidden  # a checkpointed block keeps only its input
    stored = [inp if c else A_layer for c in ck]
    stored_copies = [0 if c else C_layer for c in ck]
    loss_fwd, loss_bwd = _loss_bytes(s, shape)
    wide = (4 if pc == "fp32" else 2) * s.batch * s.seq * shape.intermediate
    T_layer = wide  # the gradient of a block's widest tensor while it runs backward

    # gradients per block and outside the blocks (head first, embeddings last)
    tr = _trainable(s, shape)
    if s.lora_rank:
        g_per_layer = G_full // L
        g_head = 0
    else:
        g_layers = sum(p.numel for p in shape.params if ".layers." in p.name or ".layer." in p.name)
        g_per_layer = g_layers * _weight_dtype_bytes(s) // L
        g_head = sum(p.numel for p in shape.params if p.kind == "head") * _weight_dtype_bytes(s)
    g_per_layer, g_head = int(g_per_layer * fg), int(g_head * fg)
    G_acc = G if s.grad_accum > 1 else 0
    gathered = 0
    if s.zero_stage >= 3 and s.world_size > 1:  # ZeRO-3 gathers one block's weights at a time
        gathered = shape.layer_linear_numel() * _weight_dtype_bytes(s)

    # forward (step 2: states exist): the larger of two moments, the last block running (a checkpointed
    # block holds its activations until it returns) and the loss (logits next to the log-softmax).
    # Autocast's copies stay cached until the forward pass ends, also under checkpointing.
    any_ck = any(ck)
    kv = kv_cache_bytes(s) if kv_cache else 0  # alive through the forward pass, dropped before backward
    in_last = {"weights": W + gathered, "gradients": G_acc, "optimizer_states": Ost,
               "activations": sum(stored[:-1]) + A_layer, "autocast_copies": C_all - C_head, "temporaries": kv}
    at_loss = {"weights": W + gathered, "gradients": G_acc, "optimizer_states": Ost,
               "activations": sum(stored) + A_other, "autocast_copies": C_all, "temporaries": loss_fwd + kv}
    forward = at_loss if sum(at_loss.values()) >= sum(in_last.values()) else in_last

    # backward: start (loss gradients) then block by block from the top
    best: dict[str, int] = {}
    saved_copies_total = sum(stored_copies) + C_head
    start = {"weights": W + gathered, "gradients": G_acc, "optimizer_states": Ost,
             "activations": sum(stored) + A_other, "autocast_copies": saved_copies_total, "temporaries": loss_bwd}
    best = start
    if loss_bwd:  # the LM head's backward: the log-softmax is gone, the logits' gradient and the head's arrive
        tv = s.batch * s.seq * shape.vocab
        head_tmp = (4 if pc == "fp32" else 2) * tv + (2 * shape.head_linear_numel() if C_head and not s.lora_rank else 0)
        head = {"weights": W + gathered, "gradients": max(G_acc, g_head), "optimizer_states": Ost,
                "activations": sum(stored) + A_other - 4 * tv, "autocast_copies": saved_copies_total,
                "temporaries": head_tmp}
        if sum(head.values()) > sum(best.values()):
            best = head
    for i in reversed(range(L)):
        done = g_head + (L - i) * g_per_layer
        below = sum(stored[:i])
        here = A_layer
        copies = sum(stored_copies[:i]) + C_layer
        cur = {"weights": W + gathered, "gradients": max(G_acc, done), "optimizer_states": Ost,
               "activations": below + here + A_other - (4 * s.batch * s.seq * shape.vocab if loss_fwd else 0),
               "autocast_copies": copies, "temporaries": T_layer}
        if sum(cur.values()) > sum(best.values()):
            best = cur
    end = {"weights": W, "gradients": G, "optimizer_states": Ost, "activations": 0, "autocast_copies": 0,
           "temporaries": 0}
    if sum(end.values()) > sum(best.values()):
        best = end
    backward = best

    # optimizer step
    T_opt = 0
    if s.optimizer == "adamw":
        T_opt = Ost // 2  # the multi-tensor step's sqrt(v): one copy of a state (chapter 1, section 1.5)
    elif s.optimizer == "adafactor":
        # per tensor: the update and the factored estimate (fp32); for 16-bit tensors also fp32 copies of
        # the gradient and the weight
        largest = max((n * 4 for n, _, _ in tr), default=0)
        T_opt = (2 if _weight_dtype_bytes(s) == 4 or s.lora_rank else 4) * largest
    step = {"weights": W, "gradients": G, "optimizer_states": Ost, "activations": 0, "autocast_copies": 0,
            "temporaries": T_opt}
    phase_components = {"forward": forward, "backward": backward, "optimizer step": step}
    phases = {k: int(sum(v.values())) for k, v in phase_components.items()}
    peak = max(phases, key=lambda k: phases[k])
    totals = {"weights": W, "gradients": G, "optimizer_states": Ost,
              "activations": L * A_layer + A_other if not any_ck else sum(stored) + A_other,
              "autocast_copies": C_all, "temporaries": max(T_opt, loss_bwd, T_layer, loss_fwd + kv)}
    return Plan(setup=s, components={k: int(v) for k, v in phase_components[peak].items()}, phases=phases,
                phase_components=phase_components, totals=totals, notes=notes)


# ---------------------------------------------------------------------------------------------------
# Measuring a setup (the book's training loop)
# ---------------------------------------------------------------------------------------------------


def _registry_name(model: Any) -> str | None:
    return ALIASES.get(model) if isinstance(model, str) else None


def _build_model(s: Setup, device: torch.device) -> nn.Module:
    shape = _shape(s)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(s.precision, torch.float32)
    if s.qlora:
        dtype = torch.bfloat16
    name = _registry_name(s.model)
    if name is not None:
        model = _models.build(name, profile=s.profile, head=shape.head, dtype=dtype,
                              attn_implementation=s.attention, device=device)
    else:
        cfg, _ = _resolve_config(s.model, s.profile)
        with device:
            model = _models._HEAD_CLASSES[shape.head].from_config(cfg, dtype=dtype, attn_implementation=s.attention)
    if s.qlora:
        model = _quantize_nf4(model, s.double_quant)
    if s.lora_rank:
        from peft import LoraConfig, get_peft_model

        task = "SEQ_CLS" if shape.head == "sequence-classification" else "CAUSAL_LM"
        model = get_peft_model(model, LoraConfig(r=s.lora_rank, lora_alpha=16, lora_dropout=s.lora_dropout,
                                                 target_modules=list(s.lora_targets), task_type=task))
        if task == "SEQ_CLS":  # peft trains the classifier of a SEQ_CLS model; the planner counts adapters only
            for n, p in model.named_parameters():
                if "lora_" not in n:
                    p.requires_grad_(False)
    ck = s.checkpointing
    if ck not in ("none", None):
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable({"use_reentrant": False})
        if s.lora_rank or s.qlora:
            model.enable_input_require_grads()
        if ck != "full":
            blocks = [m for m in model.modules() if hasattr(m, "gradient_checkpointing")
                      and type(m).__name__.endswith(("Layer", "DecoderLayer"))]
            for i, blk in enumerate(blocks):
                blk.gradient_checkpointing = i % int(ck) == 0
    model.train()
    return model


def _quantize_nf4(model: nn.Module, double_quant: bool) -> nn.Module:
    """Replace the blocks' linears by bitsandbytes NF4 layers and cast the rest to fp32.

    What ``from_pretrained(quantization_config=BitsAndBytesConfig(load_in_4bit=True, ...))`` followed by
    ``prepare_model_for_kbit_training`` gives (chapter 6, section 6.4), without writing a checkpoint.
    """
    import bitsandbytes as bnb

    for parent in list(model.modules()):
        for cname, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and not any(k in cname for k in ("lm_head", "embed_out", "classifier")):
                dev = child.weight.device
                q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                      compute_dtype=torch.bfloat16, compress_statistics=double_quant,
                                      quant_type="nf4", device="meta")
                q.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, module=q,
                                             compress_statistics=double_quant, quant_type="nf4").to(dev)
                if child.bias is not None:
                    q.bias = nn.Parameter(child.bias.data.float(), requires_grad=False)
                setattr(parent, cname, q)
                del child
    for p in model.parameters():  # prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        p.requires_grad_(False)
        if p.dtype in (torch.float16, torch.bfloat16):
            p.data = p.data.float()
    return model


def _make_optimizer(s: Setup, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if s.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=1e-5)
    if s.optimizer == "adamw-fused":
        return torch.optim.AdamW(params, lr=1e-5, fused=True)
    if s.optimizer == "sgd":
        return torch.optim.SGD(params, lr=1e-3)
    if s.optimizer == "sgd-momentum":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    if s.optimizer == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(params)
    import bitsandbytes as bnb

    cls = bnb.optim.PagedAdamW8bit if s.optimizer == "paged-adamw8bit" else bnb.optim.AdamW8bit
    return cls(params, lr=1e-5)


def measure(s: Setup, device: str | torch.device = "cuda", steps: int = 2, seed: int = 0) -> dict:
    """Build ``s`` on ``device``, run ``steps`` training steps on random tokens, read the peak.

    The loop is the book's: ``loss = model(**batch).loss`` under autocast (``/ grad_accum`` per
    micro-batch), ``loss.backward()``, ``optimizer.step()``, ``optimizer.zero_grad(set_to_none=True)``.
    The peak counter is reset after the model and optimizer are built, so construction transients (the
    NF4 conversion) are left out; ``peak_allocated_bytes`` is the peak less the memory allocated before
    the model was built (the cuBLAS workspace is created before that, by a warm-up matmul).

    Returns ``status`` (``"ok"``, ``"oom"`` with ``where``, or ``"skipped"`` with ``why``),
    ``peak_allocated_bytes``, ``peak_phase``, ``phases`` (peak bytes per phase over all steps) and
    ``step_s``. On a CPU there is no allocator peak: ``peak_allocated_bytes`` is None and
    ``accounted_bytes`` gives the last step's weights + gradients + optimizer states + saved
    activations, counted by ``helpers.accounting`` (what the CPU tests check).

    Introduced in chapter 10, section 10.2.
    """
    validate(s)
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    if s.zero_stage and s.world_size > 1:
        return {"status": "skipped", "why": "ZeRO needs several processes (chapter 7); the plan uses the formula"}
    if s.optimizer in ("adamw8bit", "paged-adamw8bit") and not cuda:
        return {"status": "skipped", "why": "bitsandbytes' 8-bit optimizers need CUDA"}
    where = ["building the model"]
    try:
        if cuda:
            # cuBLAS keeps a workspace per thread and stream: create the forward thread's and the autograd
            # thread's before the baseline, so that the peak counts the training step only.
            for dt in (torch.float32, torch.bfloat16, torch.float16):
                a = torch.ones(64, 64, device=dev, dtype=dt, requires_grad=True)
                (a @ a).float().sum().backward()
                del a
            _measure.synchronize(dev)
        base = torch.cuda.memory_allocated(dev) if cuda else 0
        result = _train(s, dev, steps, seed, base, where)
    except torch.OutOfMemoryError:
        result = {"status": "oom", "where": where[0], "setup": s.label(), "peak_allocated_bytes": None}
    finally:
        cleanup.collect()  # everything _train built is unreachable once it has returned or raised
    return result


def _train(s: Setup, dev: torch.device, steps: int, seed: int, base: int, where: list[str]) -> dict:
    """The body of ``measure``: its locals (model, optimizer, batches) die with the call."""
    cuda = dev.type == "cuda"
    amp = _pclass(s) == "amp"
    amp_dtype = torch.float16 if s.precision.startswith("fp16") else torch.bfloat16
    shape = _shape(s)
    gen = torch.Generator().manual_seed(seed)
    result: dict[str, Any] = {"status": "ok", "setup": s.label()}
    phases: dict[str, int] = {p: 0 for p in PHASES}
    model = _build_model(s, dev)
    optimizer = _make_optimizer(s, [p for p in model.parameters() if p.requires_grad])
    gc.collect()  # construction leftovers (the 16-bit weights an NF4 conversion replaced)
    scaler = torch.amp.GradScaler(dev.type) if (amp and amp_dtype == torch.float16) else None
    rec = _measure.PhaseRecorder(dev)
    times = []
    saved = 0
    states: dict[str, int] = {}
    for step in range(steps):
        t0 = time.perf_counter()
        for micro in range(s.grad_accum):
            ids = torch.randint(0, shape.vocab, (s.batch, s.seq), generator=gen).to(dev)
            labels = ids if shape.head == "causal-lm" else torch.randint(0, 2, (s.batch,), generator=gen).to(dev)
            where[0] = f"step {step + 1}: forward"
            meter = accounting.SavedTensorMeter(model) if step == steps - 1 and micro == 0 else None
            with rec.phase("forward"), (meter or nullcontext()), torch.autocast(dev.type, dtype=amp_dtype, enabled=amp):
                loss = model(input_ids=ids, labels=labels).loss / s.grad_accum
            if meter is not None:
                saved = meter.total_bytes
            where[0] = f"step {step + 1}: backward"
            with rec.phase("backward"):
                (scaler.scale(loss) if scaler else loss).backward()
            del loss
        where[0] = f"step {step + 1}: optimizer step"
        with rec.phase("optimizer step"):
            if scaler:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
        if step == steps - 1:
            states = accounting.model_state_bytes(model, optimizer)
        optimizer.zero_grad(set_to_none=True)
        _measure.synchronize(dev)
        times.append(time.perf_counter() - t0)
    if cuda:
        frame = rec.to_frame()
        for ph in PHASES:
            phases[ph] = int(frame.loc[[ph], "peak_allocated_mib"].max() * 2**20) - base
        result.update(peak_allocated_bytes=max(phases.values()), peak_phase=max(phases, key=lambda k: phases[k]),
                      phases=phases)
    else:
        result.update(peak_allocated_bytes=None, peak_phase=None, phases=None)
    result["accounted_bytes"] = {**states, "activations": saved}
    result["step_s"] = float(pd.Series(times).median())
    return result


# ---------------------------------------------------------------------------------------------------
# Suggestions, baselines, validation setups
# ---------------------------------------------------------------------------------------------------

# Relative step-time cost of each change (1.0 = no slower), from the book's measurements: checkpointing
# recomputes a forward pass (chapter 4: 1.3-2x), 8-bit AdamW and Adafactor slow the step (chapter 5.4),
# QLoRA dequantizes every matmul (chapter 6.3: ~1.8x LoRA), accumulation only adds launches.
_CHANGES: list[tuple[str, dict, float]] = [
    ("fused AdamW (no temporary copy)", {"optimizer": "adamw-fused"}, 1.0),
    ("SDPA attention", {"attention": "sdpa"}, 1.0),
    ("bf16 autocast", {"precision": "bf16-autocast"}, 1.0),
    ("8-bit AdamW", {"optimizer": "adamw8bit"}, 1.05),
    ("paged 8-bit AdamW", {"optimizer": "paged-adamw8bit"}, 1.07),
    ("checkpoint every 2nd block", {"checkpointing": 2}, 1.2),
    ("full gradient checkpointing", {"checkpointing": "full"}, 1.35),
    ("LoRA r=8 on all block linears, bf16 base", {"lora_rank": 8, "lora_targets": "all", "precision": "bf16"}, 1.0),
    ("QLoRA r=8 (NF4 base)", {"lora_rank": 8, "lora_targets": "all", "qlora": True, "precision": "bf16"}, 1.8),
    ("Adafactor", {"optimizer": "adafactor"}, 1.7),
]


def _all_targets(s: Setup) -> tuple[str, ...]:
    return tuple(n.split(".")[-1] if s.model not in ("bert-large", "bert-large-uncased") else n
                 for n, _, _ in _shape(s).layer_linears)


def suggest(s: Setup, budget_gib: float, *, max_changes: int = 2, half: str = "bf16") -> list[tuple[str, Setup, Plan, float]]:
    """Changes of ``s`` (one or two at a time, plus halving the batch with accumulation) that fit.

    Returns ``(description, setup, plan, relative_time_cost)`` for every candidate whose predicted peak
    is at most ``budget_gib``, cheapest first (ties: smaller peak first). The cost is a rough factor on
    the step time from the chapters' measurements; splitting the batch into micro-batches keeps the
    effective batch and costs little when the step is launch-bound. ``half``: the 16-bit type the
    changes may switch to (``"fp16"`` for GPUs without bf16 tensor cores, the T4 and the V100).

    Introduced in chapter 10, section 10.4.
    """
    import itertools

    if half not in ("bf16", "fp16"):
        raise ValueError(f"half must be 'bf16' or 'fp16', got {half!r}")
    singles: list[tuple[str, dict, float]] = []
    for desc, change, cost in _CHANGES:
        ch = dict(change)
        if "precision" in ch:  # GPUs without bf16 (T4, V100) get fp16
            ch["precision"] = ch["precision"].replace("bf16", half)
            desc = desc.replace("bf16", half)
        if ch.get("lora_targets") == "all":
            ch["lora_targets"] = _all_targets(s)
        if all(getattr(s, k) == v for k, v in ch.items()):
            continue
        if s.lora_rank and "lora_rank" in ch and not ch.get("qlora"):
            continue
        singles.append((desc, ch, cost))
    b = s.batch
    while b > 1:
        b //= 2
        ga = s.grad_accum * (s.batch // b)
        singles.append((f"micro-batch {b} x {ga} accumulation steps", {"batch": b, "grad_accum": ga},
                        1.0 + 0.05 * math.log2(s.batch // b)))
    out = []
    seen = set()
    fitting: set[int] = set()  # single changes that fit alone: no combination needs to add to them
    for k in range(1, max_changes + 1):
        for idx in itertools.combinations(range(len(singles)), k):
            combo = [singles[i] for i in idx]
            keys = [set(c[1]) for c in combo]
            if any(a & b_ for a, b_ in itertools.combinations(keys, 2)):
                continue
            if k > 1 and any(i in fitting for i in idx):
                continue
            change: dict = {}
            for c in combo:
                change.update(c[1])
            try:
                cand = s.replace(**change)
                validate(cand)
                p = predict(cand)
            except (ValueError, KeyError):
                continue
            key = tuple(getattr(cand, f.name) for f in dataclasses.fields(cand) if f.name != "model")
            if key in seen or not p.fits(budget_gib):
                continue
            seen.add(key)
            if k == 1:
                fitting.add(idx[0])
            cost = math.prod(c[2] for c in combo)
            out.append((" + ".join(c[0] for c in combo), cand, p, cost))
    out.sort(key=lambda r: (r[3], r[2].peak_bytes))
    return out


def baselines(s: Setup) -> dict[str, int]:
    """What four published estimators predict for ``s`` (bytes, per rank):

    - ``"4x model size (HF calculator)"``: the Hugging Face model-memory calculator's training rule,
      4 x the model's size in the setup's weight dtype (``estimates.hf_calculator_training_bytes``).
    - ``"accelerate estimate-memory (largest term, batch 1)"``: ``accelerate``'s own
      ``estimate_training_usage`` (accelerate/commands/estimate.py), called offline on the fp32 size of
      the model built on the meta device (``calculate_maximum_sizes``), with ``"float32"`` for fp32 and
      ``"bfloat16"``/``"float16"`` otherwise; the command prints the largest of its terms.
    - ``"ZeRO paper model states (16 bytes/param)"``: Rajbhandari et al. (2020), mixed-precision Adam,
      2 + 2 + 12 bytes per parameter, partitioned by ``zero_stage`` over ``world_size``.
    - ``"transformer-math: model states + Korthikanti activations"``: EleutherAI's Transformer Math 101
      (Anthony et al. 2023): model states (16 bytes/param for mixed-precision AdamW, also for fp32) plus
      Korthikanti et al. (2022)'s activations ``s*b*h*(34 + 5*a*s/h)`` per layer (the ``5as/h`` term
      dropped for SDPA), without the "framework overhead" that note adds by hand.

    The first three know nothing of LoRA, QLoRA, checkpointing or the optimizer's kind. Transformer
    Math 101 does give bytes per parameter for other optimizers (e.g. 8-bit states) and ``2*s*b*h*L``
    for fully recomputed activations; this column uses its mixed-precision AdamW and no-recomputation
    formulas on every setup.

    Introduced in chapter 10, section 10.2.
    """
    from accelerate.commands.estimate import estimate_training_usage

    shape = _shape(s)
    n = shape.n_params
    model_bytes = n * (2 if s.precision in ("bf16", "fp16") else 4)
    mp = {"fp32": "float32", "fp16": "float16", "fp16-autocast": "float16"}.get(s.precision, "bfloat16")
    acc = max(estimate_training_usage(4 * n, mp).values())
    stage = ("ddp", "zero1", "zero2", "zero3")[s.zero_stage]
    zero = estimates.zero_model_state_bytes(n, s.world_size, stage)["total"]
    act = estimates.korthikanti_activation_bytes(
        s.seq, s.batch, shape.hidden, shape.heads, layers=shape.layers,
        attention="eager" if s.attention == "eager" else "flash")
    return {
        "4x model size (HF calculator)": int(estimates.hf_calculator_training_bytes(model_bytes)),
        "accelerate estimate-memory (largest term, batch 1)": int(acc),
        "ZeRO paper model states (16 bytes/param)": int(zero),
        "transformer-math: model states + Korthikanti activations": int(16 * n + act),
    }


DEFAULT_LORA_TARGETS = {"bert": ("query", "value"), "gpt_neox": ("query_key_value",), "llama": ("q_proj", "v_proj")}
_NEOX_ALL = ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h")


def _validation_setups() -> list[Setup]:
    B, N = "bert-large", "gpt-neox-1.3b"
    S = Setup
    return [
        # bert-large, sequence classification, seq 512 unless said
        S(B, 4, 512, "fp32", "adamw"), S(B, 8, 512, "fp32", "adamw"), S(B, 16, 512, "fp32", "adamw"),
        S(B, 8, 512, "fp32", "adamw", attention="eager"), S(B, 8, 512, "bf16-autocast", "adamw"),
        S(B, 8, 512, "bf16-autocast", "adamw", attention="eager"), S(B, 8, 512, "fp16-autocast", "adamw-fused"),
        S(B, 16, 512, "bf16", "adamw"), S(B, 32, 512, "fp32", "adamw", checkpointing="full"),
        S(B, 16, 512, "bf16-autocast", "adamw", checkpointing=2), S(B, 2, 512, "fp32", "adamw", grad_accum=4),
        S(B, 64, 128, "fp32", "sgd-momentum"), S(B, 64, 128, "bf16-autocast", "adafactor"),
        S(B, 64, 128, "bf16-autocast", "adamw8bit"), S(B, 8, 512, "bf16-autocast", "adamw-fused",
                                                       lora_rank=8, lora_targets=("query", "value")),
        S(B, 8, 256, "fp32", "sgd"),
        # 1.3B GPT-NeoX, causal LM
        S(N, 4, 256, "fp32", "adamw-fused"), S(N, 4, 256, "bf16-autocast", "adamw"),
        S(N, 4, 256, "bf16-autocast", "adamw-fused"), S(N, 8, 512, "bf16-autocast", "adamw-fused"),
        S(N, 4, 256, "fp16", "adamw", attention="eager"), S(N, 16, 256, "fp16", "adamw", attention="eager"),
        S(N, 16, 256, "fp16", "adamw", attention="eager", checkpointing="full"),
        S(N, 8, 1024, "bf16-autocast", "adamw-fused", checkpointing="full"),
        S(N, 8, 512, "bf16", "adamw-fused", checkpointing=4), S(N, 4, 256, "bf16-autocast", "adamw8bit"),
        S(N, 4, 256, "bf16-autocast", "paged-adamw8bit"), S(N, 4, 256, "bf16-autocast", "adafactor"),
        S(N, 2, 512, "bf16-autocast", "adamw-fused", grad_accum=4),
        S(N, 4, 256, "bf16", "adamw-fused", lora_rank=8, lora_targets=_NEOX_ALL),
        S(N, 8, 512, "bf16", "adamw-fused", lora_rank=16, lora_targets=("query_key_value",)),
        S(N, 4, 256, "bf16-autocast", "adamw-fused", lora_rank=8, lora_targets=("query_key_value", "dense")),
        S(N, 4, 256, "bf16", "adamw8bit", lora_rank=8, lora_targets=_NEOX_ALL, qlora=True),
        S(N, 8, 512, "bf16", "adamw8bit", lora_rank=8, lora_targets=_NEOX_ALL, qlora=True, checkpointing="full"),
        S(N, 4, 512, "bf16-autocast", "sgd-momentum", attention="eager"),
    ]


VALIDATION_SETUPS: list[Setup] = _validation_setups()


# ---------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {v}")
    return v


def _checkpointing(text: str) -> Any:
    if text in ("none", "full"):
        return text
    return _positive_int(text)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m helpers.plan",
                                 description="Predict the peak GPU memory of a training step and whether it fits.")
    ap.add_argument("--model", required=True, help=f"registry name ({', '.join(ALIASES)}) or a config.json path")
    ap.add_argument("--profile", default="full", choices=("full", "tiny"))
    ap.add_argument("--batch", type=_positive_int, default=4)
    ap.add_argument("--seq", type=_positive_int, default=256)
    ap.add_argument("--precision", default="bf16-autocast", choices=PRECISIONS)
    ap.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS)
    ap.add_argument("--grad-accum", type=_positive_int, default=1)
    ap.add_argument("--checkpointing", type=_checkpointing, default="none", help="none | full | k (every k-th block)")
    ap.add_argument("--attention", default="sdpa", choices=ATTENTIONS)
    ap.add_argument("--lora-rank", type=_positive_int, default=None)
    ap.add_argument("--lora-targets", default=None,
                    help="comma-separated module names (default: the attention's query and value projections)")
    ap.add_argument("--qlora", action="store_true")
    ap.add_argument("--no-double-quant", action="store_true")
    ap.add_argument("--zero-stage", type=int, default=0, choices=(0, 1, 2, 3))
    ap.add_argument("--world-size", type=_positive_int, default=1)
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--gpu", choices=sorted(GPU_MEMORY_GIB), help="compare with this GPU's memory")
    group.add_argument("--budget-gib", type=float, help="compare with this budget (GiB of allocatable memory)")
    ap.add_argument("--top", type=_positive_int, default=5, help="how many suggestions to print")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: print the breakdown, the peak phase, the verdict and, if needed, suggestions.

    Exits with status 2 and a message for unknown models, impossible settings and bad numbers; 1 when
    the setup does not fit the budget; 0 when it fits (or no budget was given).

    Introduced in chapter 10, section 10.1.
    """
    ap = _parser()
    args = ap.parse_args(argv)
    if args.budget_gib is not None and not (args.budget_gib > 0 and math.isfinite(args.budget_gib)):
        ap.error(f"--budget-gib must be a positive number, got {args.budget_gib}")
    s = Setup(model=args.model, batch=args.batch, seq=args.seq, precision=args.precision, optimizer=args.optimizer,
              grad_accum=args.grad_accum, checkpointing=args.checkpointing, attention=args.attention,
              lora_rank=args.lora_rank, lora_targets=tuple(t for t in (args.lora_targets or "").split(",") if t),
              qlora=args.qlora, double_quant=not args.no_double_quant, zero_stage=args.zero_stage,
              world_size=args.world_size, profile=args.profile)
    if args.lora_targets is None:
        try:
            family = _shape(s).family
        except ValueError as exc:
            ap.error(str(exc))
        s = s.replace(lora_targets=DEFAULT_LORA_TARGETS[family])
    needs_bnb = s.qlora or s.optimizer in ("adamw8bit", "paged-adamw8bit")
    if needs_bnb:
        try:
            import bitsandbytes  # noqa: F401
        except Exception as exc:  # pragma: no cover - depends on the installation
            ap.error(f"QLoRA and 8-bit optimizers need bitsandbytes, which cannot be imported here ({exc})")
    try:
        p = predict(s)
    except ValueError as exc:
        ap.error(str(exc))
    with pd.option_context("display.float_format", "{:,.2f}".format, "display.width", 160):
        print(p.table().drop(columns=["bytes"]).to_string(na_rep="—"))
    print(p.explain())
    budget = GPU_MEMORY_GIB[args.gpu] - CONTEXT_RESERVE_GIB if args.gpu else args.budget_gib
    half = "fp16" if args.gpu in NO_BF16_GPUS else "bf16"
    if args.gpu in NO_BF16_GPUS and "bf16" in s.precision:
        print(f"note: the {args.gpu} has no bf16 tensor cores (compute capability < 8.0): use fp16 there")
    if budget is None:
        return 0
    where = f"{args.gpu} ({budget:.2f} GiB allocatable)" if args.gpu else f"the budget of {budget:.2f} GiB"
    if p.fits(budget):
        print(f"verdict: fits {where}: predicted peak {p.peak_gib:.2f} GiB")
        return 0
    print(f"verdict: does NOT fit {where}: predicted peak {p.peak_gib:.2f} GiB")
    options = suggest(s, budget, half=half)
    if not options:
        print("no change of one or two settings makes it fit; try a smaller batch or sequence, or more GPUs")
        return 1
    print("cheapest changes that fit (relative step time, predicted peak):")
    for desc, _, plan_, cost in options[: args.top]:
        print(f"  x{cost:.2f}  {plan_.peak_gib:6.2f} GiB  {desc}")
    return 1


if __name__ == "__main__":
    sys.exit(main())


def error_table(rows: Sequence[tuple[Setup, dict]]) -> pd.DataFrame:
    """Predicted vs measured peak for each ``(setup, measure(setup))`` pair, with the four baselines.

    Columns: ``setup``, ``family``, ``predicted (GiB)``, ``measured (GiB)``, ``error (%)`` (signed,
    predicted over measured), ``predicted phase``, ``measured phase``, and the signed error of each
    estimator of ``baselines``. Rows whose measurement did not run (out of memory, skipped) keep NaN
    errors. ``error_summary`` gives the median and max of the absolute errors.

    Not used in a chapter directly: part of chapter 10's planner (section 10.2).
    """
    out = []
    for s, m in rows:
        p = predict(s)
        meas = m.get("peak_allocated_bytes") if m.get("status") == "ok" else None
        row = {"setup": s.label(), "family": _shape(s).family, "predicted (GiB)": p.peak_gib,
               "measured (GiB)": meas / GIB if meas else float("nan"),
               "error (%)": 100 * (p.peak_bytes / meas - 1) if meas else float("nan"),
               "predicted phase": p.peak_phase, "measured phase": m.get("peak_phase")}
        for name, b in baselines(s).items():
            row[f"{name}: error (%)"] = 100 * (b / meas - 1) if meas else float("nan")
        out.append(row)
    return pd.DataFrame(out)


def error_summary(table: pd.DataFrame, column: str = "error (%)") -> dict[str, float]:
    """Median and max absolute error (%) of a column of ``error_table``, and how many rows were measured.

    Not used in a chapter directly: part of chapter 10's planner (section 10.2).
    """
    err = table[column].dropna().abs()
    return {"median_abs_pct": float(err.median()), "max_abs_pct": float(err.max()), "rows": int(err.size)}
