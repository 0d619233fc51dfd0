"""Offline model builders: a registry of real architectures, each with a ``tiny`` twin.

Nothing here downloads anything. Models are built from configs with random weights (each registry
entry names its Hub id, for readers who want the real weights with ``from_pretrained`` afterwards);
where a chapter must show the real ``from_pretrained`` path (quantized loading, adapters),
``save_checkpoint`` writes a local checkpoint first.

>>> model = build("bert-large-uncased", head="sequence-classification", dtype=torch.bfloat16)
>>> model = build("polyglot-ko-1.3b", profile="tiny", head="causal-lm")
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    BertConfig,
    GPTNeoXConfig,
    LlamaConfig,
    PretrainedConfig,
)

from helpers import run_profile as _run_profile


@dataclass(frozen=True)
class ModelSpec:
    """One registry entry: the hub id of the real model, its config, and the tiny twin's overrides.

    Introduced in chapter 1, section 1.1.
    """

    hub_id: str
    config_class: type[PretrainedConfig]
    full: dict
    tiny: dict
    heads: tuple[str, ...]


REGISTRY: dict[str, ModelSpec] = {
    # The Hugging Face guide's model ("Model training anatomy"): BERT-large, 24 layers, hidden 1024, 16 heads (335M with a classifier head).
    "bert-large-uncased": ModelSpec(
        hub_id="google-bert/bert-large-uncased",
        config_class=BertConfig,
        full=dict(
            vocab_size=30522, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
            intermediate_size=4096, max_position_embeddings=512,
        ),
        tiny=dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=512),
        heads=("sequence-classification", "base"),
    ),
    # The LLM book's model, EleutherAI/polyglot-ko-1.3b: GPT-NeoX, 24 layers, hidden 2048, 1.33B.
    "polyglot-ko-1.3b": ModelSpec(
        hub_id="EleutherAI/polyglot-ko-1.3b",
        config_class=GPTNeoXConfig,
        full=dict(
            vocab_size=30080, hidden_size=2048, num_hidden_layers=24, num_attention_heads=16,
            intermediate_size=8192, max_position_embeddings=2048, rotary_pct=0.5,
            use_parallel_residual=True, tie_word_embeddings=False,
        ),
        tiny=dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=512),
        heads=("causal-lm", "sequence-classification", "base"),
    ),
    # A 7B decoder for size arithmetic (build it on "meta" unless the GPU is large): Llama-2-7B's shape,
    # 32 layers, hidden 4096, SwiGLU MLP 11008, 6.74B parameters.
    "llama-2-7b": ModelSpec(
        hub_id="meta-llama/Llama-2-7b-hf",
        config_class=LlamaConfig,
        full=dict(
            vocab_size=32000, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
            num_key_value_heads=32, intermediate_size=11008, max_position_embeddings=4096,
            tie_word_embeddings=False,
        ),
        tiny=dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                  intermediate_size=344),
        heads=("causal-lm", "base"),
    ),
}

_HEAD_CLASSES = {
    "causal-lm": AutoModelForCausalLM,
    "sequence-classification": AutoModelForSequenceClassification,
    "base": AutoModel,
}
ATTENTION = ("eager", "sdpa")


def spec(name: str) -> ModelSpec:
    """The registry entry for ``name``; a ``ValueError`` lists the known names otherwise.

    Introduced in chapter 2, section 2.3.
    """
    if name not in REGISTRY:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(REGISTRY)}")
    return REGISTRY[name]


def config(name: str, profile: str | None = None, **overrides) -> PretrainedConfig:
    """The config of ``name`` in the given profile (default: the current one), with overrides.

    Introduced in chapter 1, section 1.4.
    """
    entry = spec(name)
    prof = _run_profile.validate(profile) if profile is not None else _run_profile.get().name
    kwargs = dict(entry.full)
    if prof == "tiny":
        kwargs.update(entry.tiny)
    kwargs.update(overrides)
    return entry.config_class(**kwargs)


def build(
    name: str,
    *,
    profile: str | None = None,
    head: str = "base",
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    device: str | torch.device | None = None,
    seed: int = 0,
    **config_overrides,
) -> nn.Module:
    """Build ``name`` with random weights drawn from ``seed``, directly on ``device`` and in ``dtype``.

    The same ``seed`` gives the same weights. The caller's random state is left as it was: building a
    model does not reseed torch's generators.

    ``head``: ``"causal-lm"``, ``"sequence-classification"`` or ``"base"``.
    ``attn_implementation``: ``"sdpa"`` (PyTorch's fused attention) or ``"eager"`` (plain matmuls
    that store the attention matrix). ``device`` defaults to the profile's device; ``"meta"`` builds
    the structure with no memory, to count parameters of any size.

    Introduced in chapter 1, section 1.1.
    """
    entry = spec(name)
    if head not in entry.heads:
        raise ValueError(f"{name} has no {head!r} head here; choose one of {', '.join(entry.heads)}")
    if attn_implementation not in ATTENTION:
        raise ValueError(f"attn_implementation must be one of {', '.join(ATTENTION)}, got {attn_implementation!r}")
    cfg = config(name, profile, **config_overrides)
    device = torch.device(device if device is not None else _run_profile.get().device)
    cuda = [device] if device.type == "cuda" else []
    # The weights come from ``seed``; the random generators are given back as they were, so building a
    # model changes no later random number (dropout masks, batches) of the caller.
    with torch.random.fork_rng(devices=cuda, device_type="cuda"):
        torch.random.default_generator.manual_seed(seed)
        if cuda:
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)
        with device:
            model = _HEAD_CLASSES[head].from_config(cfg, dtype=dtype, attn_implementation=attn_implementation)
    return model


def n_params(model: nn.Module) -> int:
    """Number of parameters (shared ones once).

    Introduced in chapter 1, section 1.1.
    """
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def save_checkpoint(model: nn.Module, path: str | Path) -> Path:
    """Save ``model`` as a local Hugging Face checkpoint (safetensors + config) and return its path.

    The real ``from_pretrained`` path (quantized loading, peft adapters) can then be shown offline::

        path = save_checkpoint(build("polyglot-ko-1.3b", head="causal-lm"), "ckpt/polyglot")
        AutoModelForCausalLM.from_pretrained(path, quantization_config=...)

    Introduced in chapter 2, section 2.5.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    return path
