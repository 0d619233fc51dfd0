"""Checking the planner: run a setup on a device and read the allocator (``measure``), the validation set,
what four published estimators say (``baselines``), and the error table of predicted against measured.

``measure`` leaves out what is allocated before the model is built, including the cuBLAS workspaces
(created by a warm-up matmul in both the forward and the autograd thread), so its peak is the training
step's own; the planner's GPU budgets subtract ``gpus.CONTEXT_RESERVE_GIB`` for the CUDA context and these.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import pandas as pd
import torch
from torch import nn

from helpers import accounting, cleanup, estimates
from helpers import measure as _measure
from helpers import models as _models
from helpers.plan.predict import GIB, PHASES, predict
from helpers.plan.setup import ALIASES, Setup, _resolve_config, _shape, validate
from helpers.plan.terms import _pclass

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
# Published estimators, the validation set, the error table
# ---------------------------------------------------------------------------------------------------


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
