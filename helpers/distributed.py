"""Training on several GPUs: the ZeRO memory formula, per-rank accounting, and launching scripts.

- ``zero_model_state_bytes``: per-GPU bytes of parameters, gradients and optimizer states under
  plain data parallelism and ZeRO stages 1-3 (Rajbhandari et al. 2020, figure 1), with the paper's
  mixed-precision defaults (2-byte parameters and gradients, K = 12 optimizer bytes per parameter)
  or any other recipe. ``PAPER_7_5B_GB`` is the paper's example, in its units (GB = 10**9 bytes).
- ``local_model_state_bytes``: the bytes *this rank* holds. FSDP2 turns parameters, gradients and
  optimizer states into ``DTensor`` shards, whose ``numel()`` is the global size; here each is
  counted by its local shard. ``ZeroRedundancyOptimizer`` (and accelerate's wrapper) are unwrapped
  to the states this rank really keeps.
- ``torchrun`` / ``accelerate_launch`` / ``run``: build a launch command (and the short form to show
  in a notebook), run it with the environment the book's GPU machines need, read the JSON results.

>>> zero_model_state_bytes(7.5e9, 64, "zero3")["total"] / 1e9   # 1.875 GB per GPU
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pandas as pd
import torch
from torch import nn

from helpers.accounting import tensor_bytes

STAGES = ("ddp", "zero1", "zero2", "zero3")
STAGE_LABELS = {
    "ddp": "DDP (replicated)",
    "zero1": "ZeRO-1 (P_os)",
    "zero2": "ZeRO-2 (P_os+g)",
    "zero3": "ZeRO-3 (P_os+g+p)",
}
# Rajbhandari et al. 2020, figure 1: a 7.5B-parameter model, N_d = 64, K = 12, per-GPU model states,
# in GB as the paper prints them (decimal: 120 GB = 16 bytes x 7.5e9 parameters).
PAPER_7_5B_GB = {"ddp": 120.0, "zero1": 31.4, "zero2": 16.6, "zero3": 1.9}

# Forced in every launched process: no NVLink multicast (NVLS) in NCCL, symmetric memory or NVSHMEM. On
# shared multi-GPU hosts a program that uses it can take the GPUs out of service, so no caller's
# environment may turn it back on.
LAUNCH_ENV_FORCED = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
# Set unless the caller says otherwise: one CPU thread per process (torchrun's own default, stated so
# that it does not warn).
LAUNCH_ENV_DEFAULTS = {"OMP_NUM_THREADS": "1"}


def _check_stage(stage: str) -> str:
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; choose one of {', '.join(STAGES)}")
    return stage


def zero_model_state_bytes(
    n_params: float,
    n_gpus: int,
    stage: str,
    *,
    param_bytes: float = 2,
    grad_bytes: float = 2,
    optimizer_bytes: float = 12,
) -> dict[str, float]:
    """Per-GPU bytes of model states for ``n_params`` parameters on ``n_gpus`` data-parallel GPUs.

    ``stage``: ``"ddp"`` (every GPU holds everything), ``"zero1"`` (optimizer states partitioned),
    ``"zero2"`` (+ gradients), ``"zero3"`` (+ parameters). The defaults are the paper's mixed
    precision with Adam: fp16 parameters and gradients (2 + 2 bytes) and K = 12 bytes of fp32
    master weights, momentum and variance. For fp32 weights with autocast and AdamW pass
    ``param_bytes=4, grad_bytes=4, optimizer_bytes=8``. Returns ``parameters``, ``gradients``,
    ``optimizer_states`` and ``total``, in bytes (floats: a share may be fractional).
    """
    _check_stage(stage)
    if n_params < 0:
        raise ValueError(f"n_params must be >= 0, got {n_params}")
    if int(n_gpus) != n_gpus or n_gpus < 1:
        raise ValueError(f"n_gpus must be a positive integer, got {n_gpus}")
    if min(param_bytes, grad_bytes, optimizer_bytes) < 0:
        raise ValueError("bytes per parameter must be >= 0")
    level = STAGES.index(stage)  # 0 = nothing partitioned ... 3 = everything
    share = {True: 1 / n_gpus, False: 1.0}
    out = {
        "parameters": param_bytes * n_params * share[level >= 3],
        "gradients": grad_bytes * n_params * share[level >= 2],
        "optimizer_states": optimizer_bytes * n_params * share[level >= 1],
    }
    out["total"] = sum(out.values())
    return out


def zero_table(
    n_params: float, n_gpus: Sequence[int], *, stages: Sequence[str] = STAGES, **bytes_per_param: float
) -> pd.DataFrame:
    """Total per-GPU model-state bytes: one row per GPU count, one column per stage."""
    rows = {
        n: {s: zero_model_state_bytes(n_params, n, s, **bytes_per_param)["total"] for s in stages}
        for n in n_gpus
    }
    return pd.DataFrame(rows).T.rename_axis("GPUs")


# --- what one rank holds --------------------------------------------------------------------------


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: the local shard of a ``DTensor``, the tensor itself otherwise."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def local_bytes(t: torch.Tensor) -> int:
    """Bytes this rank stores for ``t`` (a DTensor counts by its local shard)."""
    with torch.no_grad():  # no autograd record of the DTensor -> local view
        return tensor_bytes(local_tensor(t))


def _unique_params(model: nn.Module) -> list[nn.Parameter]:
    return list({id(p): p for p in model.parameters()}.values())


def inner_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds this rank's states: unwraps accelerate and ``ZeroRedundancyOptimizer``."""
    seen = 0
    while seen < 8:
        seen += 1
        inner = getattr(optimizer, "optimizer", None)  # accelerate's AcceleratedOptimizer
        if isinstance(inner, torch.optim.Optimizer) and inner is not optimizer:
            optimizer = inner
            continue
        inner = getattr(optimizer, "optim", None)  # torch's ZeroRedundancyOptimizer: the local one
        if isinstance(inner, torch.optim.Optimizer) and inner is not optimizer:
            optimizer = inner
            continue
        break
    return optimizer


def local_model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Parameters, gradients and optimizer states held by this rank, in bytes (local shards only).

    Scalar optimizer states (AdamW's ``step``) are left out, as in ``accounting.optimizer_state_bytes``.
    """
    params = _unique_params(model)
    states = 0
    if optimizer is not None:
        for state in inner_optimizer(optimizer).state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    states += local_bytes(value)
    return {
        "parameters": sum(local_bytes(p) for p in params),
        "gradients": sum(local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer_states": states,
    }


def unsharded_param_bytes(model: nn.Module) -> int:
    """Bytes of the parameters that are whole tensors on this rank (not DTensor shards).

    All of them under DDP; under FSDP2, the parameters that are gathered at the moment of the call
    (between forward and backward with ``reshard_after_forward=False``), none at rest.
    """
    with torch.no_grad():
        return sum(tensor_bytes(p) for p in _unique_params(model) if local_tensor(p) is p)


def init_process_group() -> torch.device:
    """Join the process group a launcher (torchrun, accelerate) set up; return this rank's device.

    One GPU per process with NCCL when CUDA is present (``LOCAL_RANK`` picks the GPU), otherwise the CPU
    with gloo. Call it once at the start of a launched script.
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


# --- launching ------------------------------------------------------------------------------------


def launch_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for launched processes: ``base`` (default: this one), ``LAUNCH_ENV_DEFAULTS``
    where ``base`` sets nothing, and ``LAUNCH_ENV_FORCED`` always (multicast stays off)."""
    env = dict(os.environ if base is None else base)
    for key, value in LAUNCH_ENV_DEFAULTS.items():
        env.setdefault(key, value)
    env.update(LAUNCH_ENV_FORCED)
    return env


def free_port() -> int:
    """A TCP port on this machine that is free now (for a rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class Launch:
    """A command to run (``argv``, with this Python) and the way to show it (``text``)."""

    argv: tuple[str, ...]
    text: str


def _check_nproc(nproc: int) -> None:
    if int(nproc) != nproc or nproc < 1:
        raise ValueError(f"nproc must be a positive integer, got {nproc}")


def _show(parts: Sequence[str]) -> str:
    return " ".join(f"'{p}'" if (" " in p or not p) else p for p in parts)


def torchrun(script: str | Path, nproc: int, args: Sequence[str] = ()) -> Launch:
    """``torchrun --standalone --nproc_per_node=N script args``, run as ``python -m torch.distributed.run``.

    ``--standalone`` starts a rendezvous on a free local port: one machine, ``N`` processes, each
    with ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE`` in its environment.
    """
    _check_nproc(nproc)
    opts = ["--standalone", f"--nproc_per_node={nproc}"]
    tail = [str(script), *map(str, args)]
    return Launch(
        argv=(sys.executable, "-m", "torch.distributed.run", *opts, *tail),
        text=_show(["torchrun", *opts, *tail]),
    )


def accelerate_launch(config: str | Path, script: str | Path, nproc: int, args: Sequence[str] = ()) -> Launch:
    """``accelerate launch --config_file C --num_processes N script args`` (on a free port)."""
    _check_nproc(nproc)
    opts = ["--config_file", str(config), "--num_processes", str(nproc)]
    tail = [str(script), *map(str, args)]
    port = ["--main_process_port", str(free_port())]
    return Launch(
        argv=(sys.executable, "-m", "accelerate.commands.launch", *opts, *port, *tail),
        text=_show(["accelerate", "launch", *opts, *tail]),
    )


@dataclass(frozen=True)
class Finished:
    """A launch that succeeded: its wall time and its standard output."""

    seconds: float
    stdout: str


def run(launch: Launch, *, env: dict[str, str] | None = None, timeout_s: float = 600) -> Finished:
    """Run ``launch`` to completion; raise ``RuntimeError`` with the end of its output if it fails."""
    start = time.perf_counter()
    proc = subprocess.run(
        list(launch.argv), env=launch_env() if env is None else env, capture_output=True, text=True,
        timeout=timeout_s,
    )
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        tail = (proc.stdout[-3000:] + "\n" + proc.stderr[-6000:]).strip()
        raise RuntimeError(f"{launch.text} failed (exit code {proc.returncode}):\n{tail}")
    return Finished(seconds, proc.stdout)


def read_results(folder: str | Path, pattern: str = "rank*.json") -> pd.DataFrame:
    """Concatenate the records (a JSON list of dicts per file) that launched ranks wrote to ``folder``."""
    files = sorted(Path(folder).glob(pattern))
    if not files:
        raise FileNotFoundError(f"no {pattern} in {folder}: did the launch write its results?")
    rows = [row for f in files for row in json.loads(f.read_text())]
    return pd.DataFrame(rows)


def load_script(path: str | Path) -> ModuleType:
    """Import a script as a module (its ``if __name__ == "__main__"`` part does not run)."""
    path = Path(path)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module
