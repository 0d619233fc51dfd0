"""Facts about GPUs, by name or by compute capability: memory, peak FLOP/s, bandwidth, bf16/TF32/FlashAttention.

Every number the book holds a measurement against, or plans with, for a GPU it may not be running on:

- ``GPU_MEMORY_GIB``: the memory programs can allocate on each card, ``T4_MEMORY_GIB`` for Colab's T4
  (chapter 1, section 1.5 emulates that card on a bigger one), and ``CONTEXT_RESERVE_GIB``, what the
  planner of chapter 10 leaves for the CUDA context (chapter 5, section 5.1 already sizes batches with it);
- ``PEAK_TFLOPS`` and ``PEAK_BANDWIDTH_GB_S``: datasheet peaks, found from the name torch reports with
  ``gpu_key`` (chapter 5, section 5.5; chapter 8, section 8.3; MFU in chapter 10, section 10.3);
- what a generation can do, from its compute capability: ``Capability`` (bf16 and TF32 tensor cores and
  FlashAttention from 8.0, Ampere), ``capability()`` for the GPU here and ``amp_dtype()``, the 16-bit type
  autocast should use (chapter 1, section 1.3). ``COMPUTE_CAPABILITY`` gives the capability of the cards of
  ``GPU_MEMORY_GIB``, and ``NO_BF16_GPUS`` follows from it by the same rule: the one source of "has bf16".

This module imports no other module of the package.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache

import torch

# ---------------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------------

# A Tesla T4 (Colab's free GPU) as the CUDA driver reports it to programs ("deviceMemorySize: 14.75GiB").
# nvidia-smi shows more (15,360 MiB), part of which the driver keeps for itself.
T4_MEMORY_GIB = 14.75

# GPU memory that programs can allocate, in GiB (what the CUDA driver reports as the device's total
# memory). The planner compares the predicted peak
# allocated memory with this less ``CONTEXT_RESERVE_GIB`` (CUDA context, allocator fragmentation).
GPU_MEMORY_GIB = {
    "T4": T4_MEMORY_GIB,
    "L4": 22.0,
    "A10G": 22.0,
    "V100-16": 15.77,
    "V100-32": 31.74,
    "A100-40": 39.39,
    "A100-80": 79.15,
    "L40S": 44.39,
    "H100": 79.19,
    "H200": 139.8,
}
CONTEXT_RESERVE_GIB = 0.75

# ---------------------------------------------------------------------------------------------------
# What a generation can do
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Capability:
    """What a GPU's generation can do, from its compute capability (major.minor).

    bf16 and TF32 tensor cores and FlashAttention need compute capability 8.0 (Ampere) or newer: a T4
    (7.5) runs bf16 only through slow fallbacks, and its bf16 SDPA uses the math kernel, which stores the
    s x s attention matrix. fp16 tensor cores exist from 7.0 (V100).

    >>> Capability("Tesla T4", 7, 5).amp_dtype
    torch.float16

    Introduced in chapter 2, section 2.2 (what ``capability()`` returns).
    """

    name: str
    major: int
    minor: int

    @property
    def at_least_ampere(self) -> bool:
        return (self.major, self.minor) >= (8, 0)

    @property
    def bf16(self) -> bool:
        return self.at_least_ampere

    @property
    def tf32(self) -> bool:
        return self.at_least_ampere

    @property
    def flash_attention(self) -> bool:
        return self.at_least_ampere

    @property
    def amp_dtype(self) -> torch.dtype:
        """The 16-bit type for autocast: bf16 where tensor cores support it, else fp16."""
        return torch.bfloat16 if self.bf16 else torch.float16


# Compute capability (major, minor) of the cards of GPU_MEMORY_GIB (NVIDIA's CUDA GPUs list).
COMPUTE_CAPABILITY: dict[str, tuple[int, int]] = {
    "T4": (7, 5),
    "L4": (8, 9),
    "A10G": (8, 6),
    "V100-16": (7, 0),
    "V100-32": (7, 0),
    "A100-40": (8, 0),
    "A100-80": (8, 0),
    "L40S": (8, 9),
    "H100": (9, 0),
    "H200": (9, 0),
}
# The cards of GPU_MEMORY_GIB without bf16 tensor cores (compute capability below 8.0): T4, V100.
NO_BF16_GPUS = tuple(name for name, cc in COMPUTE_CAPABILITY.items() if not Capability(name, *cc).bf16)


@cache
def capability(index: int = 0) -> Capability | None:
    """The ``Capability`` of CUDA device ``index``; ``None`` on a machine without CUDA.

    Introduced in chapter 2, section 2.2.
    """
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(index)
    return Capability(props.name, props.major, props.minor)


def amp_dtype() -> torch.dtype:
    """Autocast's 16-bit type here: bf16 on a CPU and on GPUs of compute capability >= 8.0, else fp16.

    Introduced in chapter 1, section 1.3.
    """
    cap = capability()
    return torch.bfloat16 if cap is None else cap.amp_dtype


# ---------------------------------------------------------------------------------------------------
# Datasheet peaks, by the name torch reports
# ---------------------------------------------------------------------------------------------------

# Dense (no 2:4 sparsity) peak TFLOP/s from NVIDIA's datasheets (sparse figures halved). A key matches a
# device name when every word of the key is a word of the name ("L4" matches "NVIDIA L4", not
# "NVIDIA L40S"); of the keys that match, the one with the most words wins ("H100 NVL" over "H100").
# "H100" and "H200" alone are the SXM boards (torch reports "NVIDIA H100 80GB HBM3", "NVIDIA H200").
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "H200 NVL": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    "H100": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "H100 NVL": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    "H100 PCIe": {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "L40S": {"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6},
    "L4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
    "T4": {"fp16": 65.0, "fp32": 8.1},
    "V100": {"fp16": 125.0, "fp32": 15.7},
}

# Datasheet memory bandwidth (GB/s, decimal: 10**9 bytes per second), matched like PEAK_TFLOPS. A100s are
# left out on purpose: their bandwidth depends on the memory size and form factor, which the name alone
# does not always tell.
PEAK_BANDWIDTH_GB_S: dict[str, float] = {
    "H200": 4800.0,
    "H200 NVL": 4800.0,
    "H100": 3350.0,
    "H100 NVL": 3900.0,
    "H100 PCIe": 2000.0,
    "L40S": 864.0,
    "L4": 300.0,
    "T4": 320.0,
    "V100": 900.0,
}

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _words(name: str) -> set[str]:
    return set(re.split(r"[\s\-_]+", name.strip().lower())) - {""}


def gpu_key(device_name: str, table: dict | None = None) -> str | None:
    """The key of ``table`` (default ``PEAK_TFLOPS``) for ``device_name``: the most specific key whose
    words all occur in the name, or None.

    Introduced in chapter 5, section 5.5.
    """
    words = _words(device_name)
    matches = [key for key in (PEAK_TFLOPS if table is None else table) if _words(key) <= words]
    return max(matches, key=lambda k: len(_words(k))) if matches else None


def peak_tflops(device_name: str, dtype: torch.dtype | str) -> float:
    """Datasheet dense peak for ``device_name`` (e.g. ``"NVIDIA H100 80GB HBM3"``) and dtype.

    Raises ``ValueError`` for a GPU that is not in ``PEAK_TFLOPS`` ("unknown GPU") rather than
    guess from a similar name: an L40S is not an L4, an H100 NVL is not an H100 SXM.

    >>> peak_tflops(torch.cuda.get_device_name(), torch.bfloat16)

    Introduced in chapter 5, section 5.5.
    """
    key = _DTYPE_NAMES.get(dtype, dtype) if isinstance(dtype, torch.dtype) else str(dtype)
    name = gpu_key(device_name)
    if name is None:
        raise ValueError(f"unknown GPU {device_name!r}: no peak FLOP/s in the table; known: {', '.join(PEAK_TFLOPS)}")
    table = PEAK_TFLOPS[name]
    if key not in table:
        raise ValueError(f"{name} has no {key} peak in the table; known: {', '.join(table)}")
    return table[key]


def peak_bandwidth_gb_s(device_name: str) -> float:
    """Datasheet memory bandwidth of ``device_name`` in GB/s (10**9 bytes per second).

    Raises ``ValueError`` for a GPU not in ``PEAK_BANDWIDTH_GB_S`` (an A100, whose bandwidth depends on
    the model, among them).

    Introduced in chapter 8, section 8.3.
    """
    key = gpu_key(device_name, PEAK_BANDWIDTH_GB_S)
    if key is None:
        raise ValueError(f"unknown GPU {device_name!r}: no datasheet bandwidth; known: {', '.join(PEAK_BANDWIDTH_GB_S)}")
    return PEAK_BANDWIDTH_GB_S[key]
