"""The book's training step: a batch on the device and one step with its phases marked.

Introduced in chapter 3, section 3.1 (the plain step) and chapter 8, section 8.2 (the step with phases). The
chapters whose lesson *is* a loop (gradient accumulation in chapter 3, checkpointed blocks in chapter 4, the
mixed-precision recipe in chapter 5) write that loop themselves; every other chapter takes its step from here, so
that a step means the same thing in every table of the book.

A step is forward, backward, optimizer step and ``zero_grad(set_to_none=True)``. ``make_step`` marks the three
phases with ``torch.profiler.record_function("forward" / "backward" / "optimizer")``: the names that
``profiler.profile`` reads to split a step's kernels by phase (``profiler.DEFAULT_PHASES``).

>>> batch = steps.batch_for("classification", 8, 512, "cuda")
>>> step = steps.make_step(model, optimizer, batch, amp=torch.bfloat16)
>>> step()
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.profiler import record_function

from helpers import data


def batch_for(task: str, batch_size: int, seq_len: int, device: str | torch.device, *, seed: int = 0
              ) -> dict[str, torch.Tensor]:
    """``batch_size`` random sequences of ``seq_len`` tokens for ``task`` (``data.dummy_dataset``), on ``device``.

    Introduced in chapter 3, section 3.1.
    """
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size} and {seq_len}")
    ds = data.dummy_dataset(batch_size, seq_len, task=task, seed=seed)
    return {k: v.to(device) for k, v in ds[:].items()}


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor]) -> None:
    """Forward, backward, optimizer step in the model's own precision; the gradients are dropped even when the
    step fails (an out-of-memory error must not leave gradients behind).

    Introduced in chapter 3, section 3.1.
    """
    try:
        model(**batch).loss.backward()
        optimizer.step()
    finally:
        optimizer.zero_grad(set_to_none=True)


def make_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor], *,
              amp: torch.dtype | None = None, new_graph_step: bool = False) -> Callable[[], None]:
    """A callable for one training step with its phases marked for the profiler.

    ``amp``: the autocast dtype (``torch.bfloat16`` or ``torch.float16``), or None for the weights' own precision.
    fp16 gets a ``GradScaler`` (its gradients would underflow without loss scaling; chapter 5). ``new_graph_step``
    calls ``torch.compiler.cudagraph_mark_step_begin()`` first, as ``mode="reduce-overhead"`` needs (chapter 9).

    Introduced in chapter 8, section 8.2.
    """
    if amp not in (None, torch.bfloat16, torch.float16):
        raise ValueError(f"amp must be None, torch.bfloat16 or torch.float16, got {amp}")
    device_type = next(model.parameters()).device.type
    scaler = torch.amp.GradScaler(device_type) if amp == torch.float16 else None

    def step() -> None:
        if new_graph_step:
            torch.compiler.cudagraph_mark_step_begin()
        with record_function("forward"), torch.autocast(device_type, dtype=amp or torch.float32,
                                                        enabled=amp is not None):
            loss = model(**batch).loss
        with record_function("backward"):
            (scaler.scale(loss) if scaler else loss).backward()
        with record_function("optimizer"):
            if scaler:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return step


def two_models(prof) -> dict[str, dict]:
    """The two setups that chapter 3 measures and chapter 4 measures again, by model name.

    bert-large (sequence classification, 512 tokens, fp32 weights, SDPA attention) and the GPT-NeoX shape of
    polyglot-ko-1.3b (causal LM, 256 tokens, fp16 weights, eager attention). ``prof`` is the run profile: the
    tiny profile shortens the sequences and keeps the 1.3B model's twin in fp32 (CPUs are slow at fp16).

    Introduced in chapter 3, section 3.1.
    """
    return {
        "bert-large-uncased": dict(head="sequence-classification", dtype=torch.float32, attn_implementation="sdpa",
                                   seq_len=prof.pick(tiny=64, full=512)),
        "polyglot-ko-1.3b": dict(head="causal-lm", dtype=prof.pick(tiny=torch.float32, full=torch.float16),
                                 attn_implementation="eager", seq_len=prof.pick(tiny=64, full=256)),
    }


def build(setups: dict[str, dict], name: str, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """``setups[name]``'s model in training mode and a plain AdamW (weight decay off; lr 1e-5, which only the
    chapters that train read).

    Introduced in chapter 3, section 3.1.
    """
    from helpers import models  # here: models imports transformers, which a batch alone does not need

    setup = setups[name]
    model = models.build(name, head=setup["head"], dtype=setup["dtype"],
                         attn_implementation=setup["attn_implementation"], seed=seed).train()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)


def batch_of(setups: dict[str, dict], name: str, batch_size: int, *, device: str | torch.device, seed: int = 0
             ) -> dict[str, torch.Tensor]:
    """``batch_size`` random sequences for ``setups[name]`` (its task and length), on ``device`` (``batch_for``).

    Introduced in chapter 3, section 3.1.
    """
    task = "classification" if setups[name]["head"] == "sequence-classification" else "causal-lm"
    return batch_for(task, batch_size, setups[name]["seq_len"], device, seed=seed)
