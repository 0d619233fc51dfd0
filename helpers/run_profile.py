"""Run profiles: which model sizes a notebook uses, chosen by the hardware and overridable.

``tiny``: small configs of the same architectures, seconds per cell on a CPU (what CI runs).
``full``: the real sizes (bert-large, a polyglot-ko-1.3b-shaped GPT-NeoX, ...), for a GPU.

The profile is chosen automatically (CUDA present -> ``full``) unless the environment variable
``GPUBOOK_PROFILE`` says ``tiny`` or ``full``. Notebooks ask the profile for sizes instead of
branching on hardware themselves::

    prof = run_profile.get()
    seq_len = prof.pick(tiny=64, full=512)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TypeVar

import torch

# What the GPU here can do lives in ``helpers.gpus``.

ENV_VAR = "GPUBOOK_PROFILE"
PROFILES = ("tiny", "full")

T = TypeVar("T")


@dataclass(frozen=True)
class Profile:
    """A run profile: its name and the device the notebook computes on.

    Introduced in chapter 1's setup cell.
    """

    name: str
    device: str

    def pick(self, *, tiny: T, full: T) -> T:
        """Return the value for this profile, e.g. ``prof.pick(tiny=64, full=512)``."""
        return tiny if self.name == "tiny" else full

    @property
    def is_full(self) -> bool:
        return self.name == "full"

    @property
    def on_gpu(self) -> bool:
        return self.device == "cuda"


def cuda_available() -> bool:
    """True when torch sees a CUDA device. Does not create a CUDA context.

    Introduced in chapter 1's setup cell.
    """
    return torch.cuda.is_available()


def validate(name: str) -> str:
    """Return ``name`` lower-cased if it is a known profile, else raise ``ValueError``.

    Introduced in chapter 1's setup cell.
    """
    clean = str(name).strip().lower()
    if clean not in PROFILES:
        raise ValueError(f"unknown profile {name!r}: choose one of {', '.join(PROFILES)}")
    return clean


def get(name: str | None = None) -> Profile:
    """The profile to run: ``name`` if given, else ``$GPUBOOK_PROFILE``, else by hardware.

    Introduced in chapter 1's setup cell.
    """
    device = "cuda" if cuda_available() else "cpu"
    chosen = name if name is not None else os.environ.get(ENV_VAR)
    if chosen is None or chosen == "":
        chosen = "full" if device == "cuda" else "tiny"
    return Profile(name=validate(chosen), device=device)


def cuda_or_skip(what: str) -> bool:
    """Guard for a GPU-only step: True on CUDA; on a CPU print one line and return False.

    >>> if cuda_or_skip("NVML reads an NVIDIA GPU's memory"):
    ...     print(measure.nvml_used_mib())

    Introduced in chapter 1, section 1.1.
    """
    if cuda_available():
        return True
    print(f"skipped on CPU: {what}")
    return False


def require_cuda(what: str) -> None:
    """Raise a one-line ``RuntimeError`` when a GPU-only function is called without CUDA.

    Introduced in chapter 1, section 1.1.
    """
    if not cuda_available():
        raise RuntimeError(f"{what} needs a CUDA GPU; none is available (guard the call with cuda_or_skip)")
