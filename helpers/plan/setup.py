"""The planner's input: a ``Setup`` (model and recipe), its validation, and the model's shape.

``Setup`` names the model (a registry name, a ``config.json`` path or a config object) and the recipe
(batch, sequence length, precision, optimizer, accumulation, checkpointing, attention kernel, LoRA/QLoRA,
ZeRO). ``validate`` refuses impossible setups and warns about odd ones. ``shape`` reads the sizes the
planner needs (layers, widths, every parameter's shape) from a model built on the ``meta`` device, which
allocates nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from helpers import models as _models

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

# The LoRA targets a setup gets when none are named: the attention's query and value projections.
DEFAULT_LORA_TARGETS = {"bert": ("query", "value"), "gpt_neox": ("query_key_value",), "llama": ("q_proj", "v_proj")}


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
    use_cache: bool | None = None
    name: str | None = None

    def replace(self, **changes) -> Setup:
        """A copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)

    def label(self) -> str:
        """A short one-line description."""
        parts = [self.name or _model_label(self.model), f"b{self.batch}", f"s{self.seq}", self.precision, self.optimizer]
        if self.grad_accum > 1:
            parts.append(f"ga{self.grad_accum}")
        if self.checkpointing not in ("none", None, 0):
            parts.append(f"ckpt={self.checkpointing}")
        parts.append(self.attention)
        if self.lora_rank:
            parts.append(("qlora" if self.qlora else "lora") + f" r{self.lora_rank}")
        if self.zero_stage:
            parts.append(f"zero{self.zero_stage}x{self.world_size}")
        if self.use_cache is not None:
            parts.append("cache" if self.use_cache else "no-cache")
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
    if s.use_cache not in (None, True, False):
        raise ValueError(f"use_cache must be True, False or None (the model's default), got {s.use_cache!r}")
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
    kv_heads: int = 0  # key/value heads (grouped-query attention: fewer than ``heads``); 0 = ``heads``
    head_dim: int = 0  # 0 = hidden // heads

    @property
    def n_params(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def kv_dim(self) -> int:
        """Width of the keys (and of the values): key/value heads x head size (``hidden`` without GQA)."""
        return (self.kv_heads or self.heads) * (self.head_dim or self.hidden // self.heads)

    def layer_linear_numel(self) -> int:
        return sum(i * o for _, i, o in self.layer_linears)

    def tied_head_numel(self) -> int:
        """Elements of an LM head that shares the input embedding's matrix (0 when the head has its own)."""
        own = any(p.kind == "head" and len(p.shape) == 2 for p in self.params)
        return self.vocab * self.hidden if self.tied_head and not own else 0

    def head_linear_numel(self) -> int:
        """Elements of the head's matrices, a tied LM head included (autocast casts it like any matmul weight)."""
        return sum(p.numel for p in self.params if p.kind == "head" and len(p.shape) == 2) + self.tied_head_numel()


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
        if path.is_dir():
            path = path / "config.json"
            if not path.is_file():
                raise ValueError(f"no config.json in the folder {model!r}")
        fields = read_config_json(path)
        model_type = fields.pop("model_type")
        cfg = AutoConfig.for_model(model_type, **fields)
        return cfg, cfg.to_json_string()
    raise ValueError(f"unknown model {model!r}; known: {', '.join(ALIASES)} (or a path to a config.json)")


# The sizes the planner reads from a config: a config.json must give each of them, as a positive integer.
REQUIRED_CONFIG_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
# Keys of real checkpoints' config.json files that transformers 5 no longer lists among a config's defaults
# (moved into ``rope_parameters``, renamed, or metadata): accepted and passed on.
_LEGACY_CONFIG_KEYS = frozenset({
    "rope_theta", "rope_scaling", "rotary_pct", "rotary_emb_base", "partial_rotary_factor", "torch_dtype",
    "gradient_checkpointing", "position_embedding_type", "auto_map", "quantization_config", "use_mrope",
    "tokenizer_class", "task_specific_params", "finetuning_task", "classifier_dropout", "layer_norm_eps",
    "max_window_layers", "sliding_window", "use_sliding_window", "head_dim", "attention_bias", "mlp_bias",
    "pretraining_tp", "hidden_dropout", "attention_dropout", "use_parallel_residual", "layer_types",
})


def _known_config_keys() -> frozenset[str]:
    from transformers import BertConfig, GPTNeoXConfig, LlamaConfig, MistralConfig, Qwen2Config

    keys = set(_LEGACY_CONFIG_KEYS)
    for cls in (BertConfig, GPTNeoXConfig, LlamaConfig, MistralConfig, Qwen2Config):
        keys |= set(cls().to_dict())
    return frozenset(keys)


def read_config_json(path: str | Path) -> dict:
    """The fields of a ``config.json``, checked: valid JSON, a supported ``model_type``, every size the planner
    reads (``REQUIRED_CONFIG_KEYS``) given as a positive integer, no key a supported config does not know
    (a misspelt key would otherwise be dropped silently and its default planned instead).

    Raises ``ValueError`` with one line saying what is wrong. Not used in a chapter directly: part of
    chapter 10's planner (section 10.1).
    """
    path = Path(path)
    try:
        fields = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {path.name}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path.name} is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") from None
    if not isinstance(fields, dict):
        raise ValueError(f"{path.name} must hold a JSON object, not a {type(fields).__name__}")
    model_type = fields.get("model_type")
    if model_type is None:
        raise ValueError(f"{path.name} has no model_type (the planner knows {', '.join(sorted(_FAMILY))})")
    if model_type not in _FAMILY:
        raise ValueError(f"model type {model_type!r} is not supported; the planner knows BERT, GPT-NeoX and Llama "
                         f"(model_type {', '.join(sorted(_FAMILY))})")
    missing = [k for k in REQUIRED_CONFIG_KEYS if k not in fields]
    if missing:
        raise ValueError(f"{path.name} lacks {', '.join(missing)}: the planner does not fill sizes with defaults")
    numeric = [*REQUIRED_CONFIG_KEYS, "num_key_value_heads", "max_position_embeddings", "head_dim"]
    for k in numeric:
        v = fields.get(k)
        if v is None and k not in REQUIRED_CONFIG_KEYS:
            continue
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{path.name}: {k} must be a positive integer, got {v!r}")
    unknown = sorted(set(fields) - _known_config_keys())
    if unknown:
        raise ValueError(f"{path.name} has keys the planner's model types do not know: {', '.join(unknown)}")
    kv = fields.get("num_key_value_heads")
    if kv is not None and fields["num_attention_heads"] % kv:
        raise ValueError(f"{path.name}: num_attention_heads ({fields['num_attention_heads']}) is not a multiple of "
                         f"num_key_value_heads ({kv})")
    return fields


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
        kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
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
