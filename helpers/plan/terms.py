"""The terms of a plan: bytes of weights, gradients, optimizer states, activations, autocast copies, temporaries.

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
"""

from __future__ import annotations

import math

from helpers.plan.setup import Param, Setup, Shape, _shape

# The terms, in the order a plan's table lists them.
COMPONENTS = ("weights", "gradients", "optimizer_states", "activations", "autocast_copies", "temporaries")

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
# Activation coefficients: bytes saved for backward per layer
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
    if s.attention == "sdpa" and shape.kv_dim < h:
        # Grouped-query attention: SDPA (enable_gqa, no padding mask) saves the keys and values at their own
        # width, kv_dim, where the coefficients above count h; eager attention repeats them to h first.
        # Counted with SavedTensorMeter on CPU (tests/test_plan_terms.py): 2 tensors x their bytes.
        total -= 2 * (4 if pc == "fp32" else 2) * (h - shape.kv_dim) * q * b
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
    tensors, so nothing is added. Checkpointing switches the cache off, and so does ``use_cache=False``.
    With grouped-query attention the cache holds the keys and values at their own width (``kv_dim``). Counted on CPU with the
    ``DynamicCache`` of the model's output (``tests/test_plan.py``); before this term (the version
    chapter 10's first GPU run validated) the planner left it out and under-predicted the forward
    peaks of these rows by about 8 bytes per token x hidden x layer.

    Introduced in chapter 10, section 10.2.
    """
    shape = _shape(s)
    if shape.head != "causal-lm" or shape.family not in ("gpt_neox", "llama"):
        return 0
    if s.use_cache is False or any(_checkpointed_layers(s, shape.layers)) or _pclass(s) != "amp":
        return 0
    if s.precision in ("bf16", "fp16") and not s.qlora:  # 16-bit stream: the cache is what attention saves
        return 0
    return 8 * s.batch * s.seq * shape.kv_dim * shape.layers  # keys and values at their width (GQA: kv_dim)
