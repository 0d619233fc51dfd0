"""Launching a script on several processes: ``torchrun`` and ``accelerate launch``, from a notebook.

- ``torchrun`` / ``accelerate_launch``: build a launch command (and the short form to show in a
  notebook).
- ``run``: run it with ``launch_env``'s environment, always: whatever environment the caller
  passes, NVLink multicast stays off (``LAUNCH_ENV_FORCED``). On a timeout, or when the notebook
  is interrupted, the launcher *and every worker it started* are stopped (the whole process
  group), so no orphaned rank keeps holding a GPU.
- ``read_results`` / ``load_script``: read what the ranks wrote; import a script to show its code.

>>> done = run(torchrun("scripts/train_zero.py", 2, ["--out", "results"]))
>>> read_results("results")
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pandas as pd

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
# Seconds between asking a timed-out launch to stop (SIGTERM) and killing it (SIGKILL).
STOP_GRACE_S = 10.0


def launch_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for launched processes: ``base`` (default: this one), ``LAUNCH_ENV_DEFAULTS``
    where ``base`` sets nothing, and ``LAUNCH_ENV_FORCED`` always (multicast stays off).

    Introduced in chapter 7, section 7.5.
    """
    env = dict(os.environ if base is None else base)
    for key, value in LAUNCH_ENV_DEFAULTS.items():
        env.setdefault(key, value)
    env.update(LAUNCH_ENV_FORCED)
    return env


def free_port() -> int:
    """A TCP port on this machine that is free now (for a rendezvous).

    Introduced in chapter 7, section 7.5.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class Launch:
    """A command to run (``argv``, with this Python) and the way to show it (``text``).

    Introduced in chapter 7, section 7.1.
    """

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

    Introduced in chapter 7, section 7.1.
    """
    _check_nproc(nproc)
    opts = ["--standalone", f"--nproc_per_node={nproc}"]
    tail = [str(script), *map(str, args)]
    return Launch(
        argv=(sys.executable, "-m", "torch.distributed.run", *opts, *tail),
        text=_show(["torchrun", *opts, *tail]),
    )


def accelerate_launch(config: str | Path, script: str | Path, nproc: int, args: Sequence[str] = ()) -> Launch:
    """``accelerate launch --config_file C --num_processes N script args`` (on a free port).

    Introduced in chapter 7, section 7.5.
    """
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
    """A launch that succeeded: its wall time and its standard output.

    Introduced in chapter 7, section 7.1.
    """

    seconds: float
    stdout: str


def _stop_group(proc: subprocess.Popen, grace_s: float) -> None:
    """Stop ``proc`` and every process in its group: SIGTERM, then SIGKILL after ``grace_s``."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
        try:  # the launcher is gone; make sure no worker outlived it
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return


def run(launch: Launch, *, env: dict[str, str] | None = None, timeout_s: float = 600) -> Finished:
    """Run ``launch`` to completion; raise ``RuntimeError`` with the end of its output if it fails.

    The environment is ``launch_env(env)``: ``env`` (default: this process's) with multicast forced
    off. The launch runs in its own process group; on a timeout (``TimeoutError``) or an interrupt
    the whole group is stopped, workers included.

    Introduced in chapter 7, section 7.1.
    """
    start = time.perf_counter()
    proc = subprocess.Popen(
        list(launch.argv), env=launch_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _stop_group(proc, STOP_GRACE_S)
        stdout, stderr = proc.communicate()
        tail = (stdout[-2000:] + "\n" + stderr[-4000:]).strip()
        raise TimeoutError(
            f"{launch.text} did not finish in {timeout_s:g} s; it and its workers were stopped:\n{tail}"
        ) from None
    except BaseException:  # KeyboardInterrupt in a notebook: leave no worker behind
        _stop_group(proc, STOP_GRACE_S)
        raise
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        tail = (stdout[-3000:] + "\n" + stderr[-6000:]).strip()
        raise RuntimeError(f"{launch.text} failed (exit code {proc.returncode}):\n{tail}")
    return Finished(seconds, stdout)


def read_results(folder: str | Path, pattern: str = "rank*.json") -> pd.DataFrame:
    """Concatenate the records (a JSON list of dicts per file) that launched ranks wrote to ``folder``.

    Introduced in chapter 7, section 7.4.
    """
    files = sorted(Path(folder).glob(pattern))
    if not files:
        raise FileNotFoundError(f"no {pattern} in {folder}: did the launch write its results?")
    rows = [row for f in files for row in json.loads(f.read_text())]
    return pd.DataFrame(rows)


def load_script(path: str | Path) -> ModuleType:
    """Import a script as a module (its ``if __name__ == "__main__"`` part does not run).

    Introduced in chapter 7, section 7.1.
    """
    path = Path(path)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module
