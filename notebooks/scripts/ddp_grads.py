"""Data parallelism two ways, checked: a manual all-reduce of gradients, then DistributedDataParallel.

Every rank takes its share of one global batch and computes the gradient of its loss. Averaged over
the ranks, that gradient must equal the gradient of the whole batch computed in one process;
chapter 7 compares the two. The model is the tiny GPT-NeoX twin in float64, so that rounding (which
changes with the order of summation) stays far below the comparison's tolerance.

    torchrun --standalone --nproc_per_node=2 scripts/ddp_grads.py --out trainer_tmp_ch7/grads

Each rank writes ``grads_rank<r>.pt``: its gradients without communication (``local``), after the
manual all-reduce (``manual``) and under DDP (``ddp``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers import data, distributed, models


def global_batch(n_samples: int = 4, seq_len: int = 32, seed: int = 0) -> torch.Tensor:
    """The same token ids on every rank (and in the notebook's single process)."""
    return data.dummy_dataset(n_samples, seq_len, task="causal-lm", seed=seed)[:]["input_ids"]


def build(device: str | torch.device) -> torch.nn.Module:
    """The tiny GPT-NeoX twin in float64, identical weights everywhere (seeded)."""
    return models.build("polyglot-ko-1.3b", profile="tiny", head="causal-lm", dtype=torch.float64, device=device)


def lm_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over all tokens of ``ids`` (computed in the model's dtype)."""
    logits = model(input_ids=ids).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A CPU copy of every parameter's gradient, by name."""
    return {name: p.grad.detach().cpu().clone() for name, p in model.named_parameters()}


def manual_allreduce(model: torch.nn.Module, ids: torch.Tensor) -> None:
    """Data parallelism by hand: backward on this rank's shard, then average gradients over ranks."""
    lm_loss(model, ids).backward()
    world = dist.get_world_size()
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)  # every rank now holds the sum ...
        p.grad /= world  # ... and the mean: each rank's loss was a mean over its shard


def with_ddp(model: torch.nn.Module, ids: torch.Tensor, device: torch.device) -> None:
    """The same with DistributedDataParallel: it averages gradient buckets during backward."""
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    lm_loss(ddp, ids).backward()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for grads_rank<r>.pt")
    parser.add_argument("--batch", type=int, default=4, help="global batch (sequences), split over ranks")
    parser.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    args = parser.parse_args()

    device = distributed.init_process_group()  # NCCL on GPUs, gloo on CPUs
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch % world:
        raise ValueError(f"the global batch ({args.batch}) must split evenly over {world} ranks")
    shard = global_batch(args.batch, args.seq).chunk(world)[rank].to(device)  # this rank's sequences

    result = {"rank": rank, "world_size": world, "backend": dist.get_backend()}
    model = build(device)
    lm_loss(model, shard).backward()
    result["local"] = grads(model)  # this rank's gradient alone: no communication

    model = build(device)
    manual_allreduce(model, shard)
    result["manual"] = grads(model)

    model = build(device)
    with_ddp(model, shard, device)
    result["ddp"] = grads(model)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(result, out / f"grads_rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
