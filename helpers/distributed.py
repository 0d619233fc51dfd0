"""Inside a launched script: join the process group, and fail all ranks together.

The rest of chapter 7's helpers live with their jobs: the ZeRO formula in ``estimates``, the bytes
one rank holds (``DTensor`` shards, wrapped optimizers) in ``accounting``, starting the processes
in ``launching``.

- ``init_process_group``: NCCL with one GPU per process, or gloo on CPUs.
- ``exit_all_ranks_on_oom``: a rank that runs out of memory (``measure.is_out_of_memory``) while the
  others wait for it in a collective would leave them waiting until NCCL's timeout (minutes). Instead it prints one clear
  line and ends its process at once; the launcher (``torchrun``, ``accelerate launch``) then stops
  the other ranks, and ``launching.run`` raises with that line in its message.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch

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
