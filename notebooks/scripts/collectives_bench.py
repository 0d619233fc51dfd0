"""Bus bandwidth of all-reduce, reduce-scatter, all-gather and broadcast against message size.

The definitions are those of NVIDIA's nccl-tests (see ``helpers.collectives``). Launched on every
GPU of a machine (NCCL) or as CPU processes (gloo):

    torchrun --standalone --nproc_per_node=2 scripts/collectives_bench.py --out trainer_tmp_ch7/bw \\
        --min-bytes 1048576 --max-bytes 1073741824

Every rank runs the same sweep (the timings are the slowest rank's); rank 0 writes
``<out>/rank0.json``, one record per collective and size, with every timed repeat.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist

from helpers import collectives, distributed, estimates

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for rank0.json")
    parser.add_argument("--min-bytes", type=int, default=2**20, help="smallest message S (bytes)")
    parser.add_argument("--max-bytes", type=int, default=2**30, help="largest message S (bytes)")
    parser.add_argument("--factor", type=int, default=4, help="each size is this many times the previous")
    parser.add_argument("--collectives", nargs="+", default=list(estimates.COLLECTIVES),
                        choices=estimates.COLLECTIVES)
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls first")
    parser.add_argument("--repeat", type=int, default=20, help="timed calls (at least 10)")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    device = distributed.init_process_group()  # NCCL on GPUs, gloo on CPUs
    sizes = collectives.sizes_between(args.min_bytes, args.max_bytes, args.factor)
    timings = collectives.sweep(sizes, args.collectives, device=device, dtype=DTYPES[args.dtype],
                                warmup=args.warmup, repeat=args.repeat)
    if dist.get_rank() == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "rank0.json").write_text(collectives.records_json(timings))
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        print(f"{len(timings)} timings, {dist.get_world_size()} ranks, {dist.get_backend()}, {name}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
