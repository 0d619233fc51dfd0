"""Inside a launched script: join the process group, fail all ranks together, wrap a model in an engine.

The rest of chapter 7's helpers live with their jobs: the ZeRO formula in ``estimates``, the bytes
one rank holds (``DTensor`` shards, wrapped optimizers) in ``accounting``, starting the processes
in ``launching``.

- ``init_process_group``: NCCL with one GPU per process, or gloo on CPUs.
- ``exit_all_ranks_on_oom``: a rank that runs out of memory (``measure.is_out_of_memory``) while the
  others wait for it in a collective would leave them waiting until NCCL's timeout (minutes). Instead it prints one clear
  line and ends its process at once; the launcher (``torchrun``, ``accelerate launch``) then stops
  the other ranks, and ``launching.run`` raises with that line in its message.
- ``wrap_engine``: hand a model to one of PyTorch's data-parallel engines by name (``ENGINES``): DDP,
  DDP + ``ZeroRedundancyOptimizer`` (ZeRO-1), FSDP2's ``fully_shard`` kept after forward (ZeRO-2) or
  resharded (ZeRO-3), and ``fsdp2``: ZeRO-3 with a bf16 ``MixedPrecisionPolicy`` (``bf16_policy``:
  parameters gathered and computed in bf16, gradients reduced in fp32, fp32 shards and optimizer
  states). Every engine takes an optional process ``group`` (a subgroup of the launched ranks, e.g.
  the first 2 of 4), so one launch can measure several world sizes. ``full_parameters`` gathers the
  whole parameters back, whatever the engine, to compare runs.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from helpers.measure import is_out_of_memory

# Exit status of a rank that ran out of memory (any non-zero status makes the launcher stop the others).
OOM_EXIT_CODE = 3


def init_process_group() -> torch.device:
    """Join the process group a launcher (torchrun, accelerate) set up; return this rank's device.

    One GPU per process with NCCL when CUDA is present (``LOCAL_RANK`` picks the GPU), otherwise the CPU
    with gloo. Call it once at the start of a launched script.

    Introduced in chapter 7, section 7.1.
    """
    import torch.distributed as dist

    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device


@contextmanager
def exit_all_ranks_on_oom(what: str) -> Iterator[None]:
    """Run the ``with`` block; if this rank runs out of memory, end the whole launch with a clear message.

    The other ranks may be waiting for this one inside a collective (an all-reduce in DDP's backward,
    an all-gather in FSDP's forward); catching the error and going on would leave them waiting. So
    the rank prints ``rank R: out of memory during WHAT: ...`` to standard error and exits with
    ``OOM_EXIT_CODE`` at once, without Python's shutdown (which could itself wait on the process
    group). The launcher sees the failure and stops every other rank. Out of memory means what
    ``measure.is_out_of_memory`` says (``torch.OutOfMemoryError``, or cuBLAS/cuDNN reporting a failed
    allocation); any other error propagates as usual.

    >>> with exit_all_ranks_on_oom("zero2 training"):
    ...     train(...)

    Introduced in chapter 7, section 7.4.
    """
    try:
        yield
    except RuntimeError as err:  # torch.OutOfMemoryError is one
        if not is_out_of_memory(err):
            raise
        rank = os.environ.get("RANK", "?")
        first = str(err).strip().splitlines()[0] if str(err).strip() else "out of memory"
        print(f"rank {rank}: out of memory during {what}: {first}; stopping every rank", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(OOM_EXIT_CODE)


# --- engines: one name per way of splitting the model states --------------------------------------------

# The data-parallel engines ``wrap_engine`` builds; the first four are chapter 7's ``estimates.STAGES``.
ENGINES = ("ddp", "zero1", "zero2", "zero3", "fsdp2")
ENGINE_LABELS = {
    "ddp": "DDP",
    "zero1": "ZeRO-1 (DDP + ZeroRedundancyOptimizer)",
    "zero2": "ZeRO-2 (FSDP2, kept after forward)",
    "zero3": "ZeRO-3 (FSDP2, resharded after forward)",
    "fsdp2": "FSDP2 bf16 (ZeRO-3, MixedPrecisionPolicy)",
}


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks, by the class names in its ``_no_split_modules`` (for GPT-NeoX,
    ``GPTNeoXLayer``): the units FSDP gathers one at a time. Empty for a model that names none.

    Introduced in chapter 7, section 7.4.
    """
    names = set(getattr(model, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


def bf16_policy(reduce_dtype: torch.dtype = torch.float32):
    """FSDP2's ``MixedPrecisionPolicy``: parameters all-gathered and used in bf16, gradients reduced in
    ``reduce_dtype`` (fp32 by default: the sum over ranks keeps fp32's precision; bf16 halves those bytes).
    The shards, their gradients and the optimizer states stay in the parameters' own dtype (fp32).

    Introduced in chapter 7, section 7.4.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)


def device_mesh(device: torch.device, group=None):
    """A one-dimensional ``DeviceMesh`` over ``group`` (default: every launched rank), for ``fully_shard``.

    Introduced in chapter 7, section 7.4.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group if group is not None else dist.group.WORLD, torch.device(device).type)


def shard_fsdp2(model: nn.Module, device: torch.device, *, units: list[nn.Module] | None = None,
                reshard_after_forward: bool = True, mp_policy=None, group=None) -> nn.Module:
    """``fully_shard`` each unit (default: ``transformer_blocks``), then the whole model (the rest:
    embeddings, final norm, head). Returns the model, sharded in place over ``group``.

    Introduced in chapter 7, section 7.4.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs = dict(mesh=device_mesh(device, group), reshard_after_forward=reshard_after_forward,
                  mp_policy=mp_policy if mp_policy is not None else MixedPrecisionPolicy())
    for unit in (transformer_blocks(model) if units is None else units):
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    return model


def wrap_engine(engine: str, model: nn.Module, device: torch.device, *, lr: float = 1e-5,
                optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW, group=None,
                units: list[nn.Module] | None = None, **optimizer_kwargs) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Hand ``model`` (the same weights on every rank) to ``engine`` over ``group``; return (model, optimizer).

    - ``ddp``: ``DistributedDataParallel`` (gradients as bucket views), everything replicated.
    - ``zero1``: DDP + ``ZeroRedundancyOptimizer``: each rank keeps and updates 1/N of the optimizer states.
    - ``zero2`` / ``zero3``: FSDP2 in the parameters' dtype, gathered parameters kept from forward to
      backward (``reshard_after_forward=False``) or freed and gathered again.
    - ``fsdp2``: ZeRO-3 with ``bf16_policy()``; run it without autocast (the policy casts), the others
      with bf16 autocast for a bf16 comparison.

    ``units``: FSDP's units (default ``transformer_blocks``). The training loop after this is the same for
    every engine: ``loss.backward()``, ``optimizer.step()``, ``optimizer.zero_grad()``.

    Introduced in chapter 7, section 7.4.
    """
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
    device = torch.device(device)
    opt = dict(lr=lr, **optimizer_kwargs)
    if engine in ("ddp", "zero1"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, process_group=group,
                    gradient_as_bucket_view=True)
        if engine == "ddp":
            return model, optimizer_class(model.parameters(), **opt)
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return model, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=optimizer_class,
                                              process_group=group, **opt)
    model = shard_fsdp2(model, device, units=units, reshard_after_forward=engine != "zero2",
                        mp_policy=bf16_policy() if engine == "fsdp2" else None, group=group)
    return model, optimizer_class(model.parameters(), **opt)


def no_gradient_sync(model: nn.Module, sync: bool):
    """A context in which ``backward`` accumulates gradients locally without communicating (``sync=False``)
    or communicates as usual (``sync=True``), for DDP (``no_sync``) and FSDP2 (``set_requires_gradient_sync``)
    alike: gradient accumulation over micro-batches, reducing once, on the last one.

    Introduced in chapter 7, section 7.1.
    """
    from contextlib import nullcontext

    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2: a switch, not a context
        model.set_requires_gradient_sync(sync)
        return nullcontext()
    if hasattr(model, "no_sync") and not sync:  # DDP
        return model.no_sync()
    return nullcontext()


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (FSDP2's shards gathered with ``full_tensor``), detached, on the CPU, under
    the model's own names (without DDP's ``module.`` prefix). Every rank of the group must call it.

    Introduced in chapter 7, section 7.4.
    """
    inner = getattr(model, "module", model)
    out = {}
    for name, p in inner.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = full.detach().to("cpu", copy=True)
    return out
