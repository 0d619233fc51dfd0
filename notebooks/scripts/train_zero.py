"""Train one model a few steps under DDP, ZeRO-1, FSDP (ZeRO-2-like) and FSDP (ZeRO-3), and measure each rank.

Chapter 7 launches this script on 1 and 2 processes (GPUs with NCCL, or CPU processes with gloo):

    torchrun --standalone --nproc_per_node=2 scripts/train_zero.py --out trainer_tmp_ch7/ws2
    accelerate launch --config_file scripts/accelerate_fsdp.yaml --num_processes 2 \\
        scripts/train_zero.py --strategies accelerate --out trainer_tmp_ch7/accelerate

For each strategy every rank builds the same model (seeded), hands it to PyTorch's engine, trains
``--warmup`` + ``--steps`` steps on its own random batches, and records: the bytes of parameters,
gradients and optimizer states it holds after the optimizer step (local shards only), the bytes of
parameters gathered for compute after the forward pass, its peak allocated memory (CUDA only) and
every timed step's time. Each rank writes ``<out>/rank<r>.json``, one record per strategy.

``--layers N`` builds the model with N transformer blocks instead of its own number (chapter 7 uses it
to fit one smaller GPU). ``--trace DIR``: after the timed steps every rank trains one more step, and
rank 0 records it with ``torch.profiler`` into ``DIR/<strategy>.json.gz`` (a gzipped Chrome trace; the
step is not timed and its loss is not recorded).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers import accounting, data, distributed, measure, models
from helpers.measure import MIB

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "accelerate")


def transformer_layers(model: nn.Module) -> list[nn.Module]:
    """The model's transformer blocks (for GPT-NeoX, its ``GPTNeoXLayer`` modules)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


def wrap(strategy: str, model: nn.Module, device: torch.device, lr: float):
    """Hand ``model`` to one of PyTorch's engines; return (model, optimizer, backward function)."""
    device_ids = [device.index] if device.type == "cuda" else None
    if strategy == "ddp":  # every rank: all parameters, gradients, optimizer states
        model = DDP(model, device_ids=device_ids, gradient_as_bucket_view=True)
        return model, torch.optim.AdamW(model.parameters(), lr=lr), torch.Tensor.backward
    if strategy == "zero1":  # DDP's gradients, but each rank keeps and updates 1/N of the optimizer states
        model = DDP(model, device_ids=device_ids, gradient_as_bucket_view=True)
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=lr)
        return model, optimizer, torch.Tensor.backward
    if strategy in ("zero2", "zero3"):  # FSDP2: parameters, gradients and states sharded at rest
        keep = strategy == "zero2"  # keep gathered parameters from forward to backward (~ZeRO-2)
        for layer in transformer_layers(model):  # one unit per block: gathered one block at a time
            fully_shard(layer, reshard_after_forward=not keep)
        fully_shard(model, reshard_after_forward=not keep)  # the rest: embeddings, final norm, head
        return model, torch.optim.AdamW(model.parameters(), lr=lr), torch.Tensor.backward
    if strategy == "accelerate":  # whatever the `accelerate launch` config says
        from accelerate import Accelerator

        accelerator = Accelerator()
        model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=lr))
        return model, optimizer, accelerator.backward
    raise ValueError(f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES)}")


def train(strategy: str, args: argparse.Namespace, device: torch.device) -> tuple[dict, weakref.ref]:
    """Train ``args.warmup + args.steps`` steps under ``strategy``; return this rank's record."""
    rank, world = dist.get_rank(), dist.get_world_size()
    overrides = {"num_hidden_layers": args.layers} if args.layers else {}
    model = models.build(args.model, profile=args.profile, head="causal-lm", device=device, seed=0, **overrides)
    record = {"n_params": models.n_params(model)}
    alive = weakref.ref(model)  # to check that the model is freed afterwards
    model, optimizer, backward = wrap(strategy, model, device, args.lr)
    model.train()
    steps = args.warmup + args.steps
    traced = 1 if args.trace else 0
    batches = data.dummy_dataset(args.batch * (steps + traced), args.seq, task="causal-lm", seed=1000 + rank)
    rec = measure.PhaseRecorder(device)
    losses, gathered, held = [], 0, {}
    for step in range(steps):
        batch = {k: v.to(device) for k, v in batches[step * args.batch:(step + 1) * args.batch].items()}
        with rec.phase(f"{step}:forward"), torch.autocast(device.type, torch.bfloat16, enabled=args.bf16):
            loss = model(**batch).loss
        gathered = accounting.unsharded_param_bytes(model)  # whole parameters held now
        with rec.phase(f"{step}:backward"):
            backward(loss)
        with rec.phase(f"{step}:step"):
            optimizer.step()
        held = accounting.model_state_bytes(model, optimizer)
        gathered -= accounting.unsharded_param_bytes(model)  # minus those held at rest as well
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    if traced:
        batch = {k: v.to(device) for k, v in batches[steps * args.batch:(steps + 1) * args.batch].items()}
        trace_step(lambda: _one_step(model, optimizer, backward, batch, device, args.bf16),
                   Path(args.trace) / f"{strategy}.json.gz", device, record=rank == 0)
    phases = rec.to_frame()
    timed = phases.iloc[3 * args.warmup:]
    step_times = timed["time_s"].to_numpy().reshape(args.steps, 3).sum(axis=1)
    record |= {
        "strategy": strategy, "world_size": world, "rank": rank, "status": "ok",
        "wrapped_as": type(model).__name__, "optimizer": type(accounting.inner_optimizer(optimizer)).__name__,
        "params_mib": held["weights"] / MIB, "grads_mib": held["gradients"] / MIB,
        "optimizer_states_mib": held["optimizer_states"] / MIB, "gathered_params_mib": gathered / MIB,
        "peak_allocated_mib": float(timed["peak_allocated_mib"].max()),
        "step_time_s": statistics.median(step_times), "step_times_s": [float(t) for t in step_times],
        "losses": losses,
    }
    return record, alive


def _one_step(model: nn.Module, optimizer, backward, batch: dict, device: torch.device, bf16: bool) -> None:
    """One training step (forward, backward, optimizer step, zero_grad), as in ``train``'s loop."""
    with torch.autocast(device.type, torch.bfloat16, enabled=bf16):
        loss = model(**batch).loss
    backward(loss)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def trace_step(step, path: Path, device: torch.device, *, record: bool) -> None:
    """Run ``step()`` once; if ``record``, under ``torch.profiler`` (CPU, and CUDA on a GPU), saved to ``path``.

    Every rank must call it (the step's collectives need all of them); only the recording rank pays
    for the profiler. The trace is written gzipped (``path`` ends in ``.gz``).
    """
    if not record:
        step()
        return
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))


def run_strategy(strategy: str, args: argparse.Namespace, device: torch.device) -> dict:
    """``train``, then free everything and note what was left.

    Out of memory on any rank ends the whole launch with one clear line (the other ranks would otherwise
    wait for this one in their next collective until NCCL's timeout).
    """
    cuda = device.type == "cuda"
    before = torch.cuda.memory_allocated(device) / MIB if cuda else float("nan")
    with distributed.exit_all_ranks_on_oom(f"{strategy} training"):
        record, alive = train(strategy, args, device)
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    record["allocated_before_mib"] = before
    record["allocated_after_mib"] = torch.cuda.memory_allocated(device) / MIB if cuda else float("nan")
    record["model_freed"] = alive() is None
    record |= {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "backend": dist.get_backend(),
               "bf16_autocast": args.bf16, "batch_per_rank": args.batch, "seq_len": args.seq,
        "layers": args.layers}
    dist.barrier()
    return record


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for rank<r>.json")
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES[:4]), choices=STRATEGIES)
    parser.add_argument("--model", default="polyglot-ko-1.3b", help="a name in helpers.models.REGISTRY")
    parser.add_argument("--profile", default="tiny", choices=["tiny", "full"], help="model size")
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank and step")
    parser.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=2, help="timed steps")
    parser.add_argument("--layers", type=int, default=0, help="transformer blocks (0: the model's own number)")
    parser.add_argument("--trace", default="", help="folder for one profiled step per strategy (rank 0)")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (fp32 weights and states)")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    device = distributed.init_process_group()  # NCCL on GPUs, gloo on CPUs
    records = [run_strategy(strategy, args, device) for strategy in args.strategies]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(records, indent=1))
    if dist.get_rank() == 0:
        for r in records:
            print(f"{r['strategy']:>10}: {r['status']}, world size {dist.get_world_size()}, {r['device']}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
