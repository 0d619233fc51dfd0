"""Train with a different sequence length every step and record what PyTorch's caching allocator does.

Chapter 8 (section 8.5) runs this script twice in fresh processes, once as it is and once with
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (the variable must be set before CUDA starts, so
it cannot be switched inside a running notebook):

    python scripts/alloc_churn.py --out churn_default.json
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python scripts/alloc_churn.py --out churn_expandable.json

Every step draws a sequence length between ``--min-len`` and ``--max-len`` (the same lengths in every
run: they come from ``--seed``), trains bert-large one step with bf16 autocast (fp16 below compute
capability 8.0) and records allocated, reserved and peak allocated memory. At the end it adds the
allocator's counters from ``torch.cuda.memory_stats()``. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from helpers import data, gpus, models, run_profile
from helpers.measure import MIB

COUNTERS = {  # table label: key of torch.cuda.memory_stats()
    "device allocations (num_device_alloc)": "num_device_alloc",
    "device frees (num_device_free)": "num_device_free",
    "retries after flushing the cache (num_alloc_retries)": "num_alloc_retries",
    "segments at the end (segment.all.current)": "segment.all.current",
    "inactive split blocks at the end (MiB)": "inactive_split_bytes.all.current",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bert-large-uncased")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--min-len", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    run_profile.require_cuda("alloc_churn.py")
    if not 1 <= args.min_len <= args.max_len:
        parser.error(f"need 1 <= --min-len <= --max-len, got {args.min_len}, {args.max_len}")

    model = models.build(args.model, head="sequence-classification", dtype=torch.float32, device="cuda").train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    amp = gpus.amp_dtype()
    lengths = np.random.default_rng(args.seed).integers(args.min_len, args.max_len + 1, size=args.steps)
    rows = []
    for i, seq_len in enumerate(lengths):
        batch = {k: v.cuda() for k, v in data.dummy_dataset(args.batch, int(seq_len), seed=i)[:].items()}
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast("cuda", dtype=amp):
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        rows.append({
            "step": i,
            "seq_len": int(seq_len),
            "step_s": time.perf_counter() - start,
            "allocated_mib": torch.cuda.memory_allocated() / MIB,
            "reserved_mib": torch.cuda.memory_reserved() / MIB,
            "peak_allocated_mib": torch.cuda.max_memory_allocated() / MIB,
        })
    stats = torch.cuda.memory_stats()
    counters = {label: stats.get(key, float("nan")) for label, key in COUNTERS.items()}
    counters["inactive split blocks at the end (MiB)"] /= MIB
    result = {
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "steps": rows,
        "counters": counters,
    }
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
