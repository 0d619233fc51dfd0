"""T4 mode: make a big NVIDIA GPU answer like a Colab T4 for this book, when ``GPUBOOK_EMULATE=t4``.

Imported at the start of a kernel (``execute_notebooks.py --emulate t4`` writes a ``sitecustomize.py`` that
loads it, so every Python process started with that ``PYTHONPATH`` runs it before anything else), it
changes, for this process only and without creating a CUDA context:

- the compute capability: ``torch.cuda.get_device_capability`` and ``get_device_properties(..).major/minor``
  say (7, 5), so ``helpers.gpus.capability()`` sees a T4: fp16 autocast, no bf16, no TF32, no FlashAttention;
- ``torch.cuda.is_bf16_supported()`` says True and ``is_bf16_supported(including_emulation=False)`` False,
  as on a real T4 (bf16 runs there, through slow emulation, not natively); ``is_tf32_supported`` says False;
- the name: ``get_device_name``, ``get_device_properties(..).name`` and NVML's ``nvmlDeviceGetName`` say
  ``Tesla T4 (emulated on H100)``: the environment report stays honest, and ``helpers.gpus.gpu_key`` finds
  "T4", not the host card (see ``emulated_name``);
- memory: ``get_device_properties(..).total_memory`` and ``mem_get_info``'s total are the T4's
  ``helpers.gpus.T4_MEMORY_GIB`` (read from that file, not retyped), ``mem_get_info``'s free is that less
  what the card has in use; NVML's total is the T4's 15,360 MiB (what nvidia-smi shows on one), its *used*
  is the real card's; the caching allocator is capped at ``T4_MEMORY_GIB`` with
  ``set_per_process_memory_fraction`` once CUDA initialises, and ``set/get_per_process_memory_fraction``
  take and give fractions of the emulated card (so ``helpers.measure.gpu_budget`` caps at the GiB it asks);
- TF32 is off and locked (cuBLAS, cuDNN, ``set_float32_matmul_precision``, the ``fp32_precision`` API):
  asking for it is silently ignored, as a T4, which has no TF32 units, ignores it;
- scaled_dot_product_attention's flash and cuDNN backends are off and locked (``sdpa_kernel`` and
  ``enable_flash_sdp(True)`` cannot turn them on): memory-efficient and math stay, as on a T4. Forcing
  flash alone then fails with "no available kernel", as on a T4; and, as on a T4, the memory-efficient
  kernel takes no bf16 (``F.scaled_dot_product_attention`` on bf16 CUDA tensors runs with it disabled: the
  math kernel, which stores the s x s matrix, or "no available kernel" when math is not allowed).

Any other value of ``GPUBOOK_EMULATE`` is an error (``ValueError``); unset or empty, or without CUDA, the
module changes nothing.

What it cannot emulate:

- speed: an H100 has about 8x a T4's fp16 tensor throughput (and ~10x its memory bandwidth), so every
  timing is the big card's, and a time budget does not skip what it would skip on a T4; the number of SMs,
  the L2 cache and the other device properties are the real card's;
- NVML's *used* memory and torch's allocator numbers are real (the CUDA context of an H100 is larger than
  a T4's, which the chapters' ``measure.t4_budget`` subtracts as measured here), and the allocator's cap
  does not subtract the context, so a peak within the context's size (~0.5 GiB) of 14.75 GiB fits here and
  not on a T4; torch's out-of-memory message (C++) names the real card's total capacity and free memory;
- numerics: fp16 runs the same kernels' sm_90 versions, not sm_75's (and bf16 matmuls run natively here,
  where a T4 emulates them, slowly); code that calls torch's C++ attention ops directly, not through
  ``F.scaled_dot_product_attention``, still gets the memory-efficient kernel in bf16;
- what torch decides from the real device: its C++ code (e.g. which SDPA kernels are *available*) and its
  own Python modules (``torch.*`` and Triton callers get the real card's name, capability and properties:
  ``torch.compile`` must build kernels the H100 can load). Only the answers to the book's code and the
  libraries it calls (transformers, bitsandbytes, peft, ...) change;
- the GPU count: ``execute_notebooks.py --emulate t4`` shows the kernels one GPU (``CUDA_VISIBLE_DEVICES``).
"""

from __future__ import annotations

import ast
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

ENV_VAR = "GPUBOOK_EMULATE"
CARDS = ("t4",)
T4_NAME = "Tesla T4"  # what torch and NVML report on Colab's T4
T4_CAPABILITY = (7, 5)
T4_NVML_TOTAL_MIB = 15360  # nvidia-smi's total on a T4 (helpers/gpus.py: "nvidia-smi shows more (15,360 MiB)")
GPUS_PY = Path(__file__).resolve().parents[1] / "helpers" / "gpus.py"


def requested(environ=None) -> str | None:
    """The card ``GPUBOOK_EMULATE`` asks for ("t4"), None when unset or empty; ValueError for another value."""
    value = (os.environ if environ is None else environ).get(ENV_VAR, "").strip().lower()
    if not value:
        return None
    if value not in CARDS:
        raise ValueError(f"{ENV_VAR}={value!r}: unknown card to emulate; known: {', '.join(CARDS)} (or unset it)")
    return value


def t4_memory_gib(gpus_py: Path = GPUS_PY) -> float:
    """``T4_MEMORY_GIB`` as helpers/gpus.py assigns it, read without importing the package."""
    for node in ast.parse(gpus_py.read_text(encoding="utf-8")).body:
        if (isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "T4_MEMORY_GIB" for t in node.targets)
                and isinstance(node.value, ast.Constant)):
            return float(node.value.value)
    raise RuntimeError(f"no T4_MEMORY_GIB = <number> in {gpus_py}")


_SEPARATORS = re.compile(r"[\s_-]+")  # where helpers.gpus.gpu_key splits a name into words
_VENDOR_WORDS = {"NVIDIA", "TESLA"}


def emulated_name(host: str) -> str:
    """``Tesla T4 (emulated on H100)`` for ``host`` "NVIDIA H100 80GB HBM3": the host's model (its first word
    after the vendor's) glued to the closing parenthesis, so that ``helpers.gpus.gpu_key``, which splits names
    at spaces, hyphens and underscores, reads "h100)" and never the word "H100" (which would tie with "T4" and
    win); short enough that the environment table shows its GPU row whole (pandas cuts cells at 50 characters).
    """
    words = [w for w in _SEPARATORS.split(host.strip()) if w and w.upper() not in _VENDOR_WORDS]
    return f"{T4_NAME} (emulated on {words[0] if words else 'another GPU'})"


class EmulatedProperties:
    """A device's real properties, with the emulated card's name, capability and total memory."""

    def __init__(self, real, name: str, major: int, minor: int, total_memory: int) -> None:
        self._real = real
        self.name, self.major, self.minor, self.total_memory = name, major, minor, total_memory

    def __getattr__(self, attr):
        return getattr(self._real, attr)

    def __repr__(self) -> str:
        return (f"EmulatedProperties(name={self.name!r}, major={self.major}, minor={self.minor}, "
                f"total_memory={self.total_memory // 2**20}MB, real={self._real!r})")


@dataclass
class Emulation:
    """What ``activate`` changed (``originals``: (owner, attribute, old value) to put back)."""

    card: str
    total_bytes: int
    capability: tuple[int, int]
    originals: list = field(default_factory=list)
    resets: list = field(default_factory=list)  # (setter, value): the flags as they were before

    def patch(self, owner, attr: str, new) -> None:
        self.originals.append((owner, attr, owner.__dict__.get(attr, getattr(owner, attr, None))
                               if isinstance(owner, type) else getattr(owner, attr)))
        setattr(owner, attr, new)


_active: Emulation | None = None

# Callers that see the real card: torch's own code (Inductor and Triton compile for the capability they are
# told, and an sm_75 binary does not load on an H100) and Triton. The book, transformers, bitsandbytes, ...
# see the T4.
_REAL_FOR = ("torch.", "triton.")


def _torch_internal(depth: int = 2) -> bool:
    """True when the function ``depth`` frames up was called from torch's or Triton's own modules."""
    try:
        caller = sys._getframe(depth).f_globals.get("__name__", "")
    except ValueError:
        return False
    return caller in ("torch", "triton") or caller.startswith(_REAL_FOR)


def active() -> Emulation | None:
    """The emulation in force in this process, or None."""
    return _active


def _patch_torch(emu: Emulation) -> None:
    import torch
    import torch.cuda.memory as cuda_memory

    cuda, C = torch.cuda, torch._C
    real_props = cuda.get_device_properties
    real_set_fraction = cuda.set_per_process_memory_fraction
    real_get_fraction = getattr(cuda, "get_per_process_memory_fraction", None)
    real_mem_get_info = cuda.mem_get_info

    def emulated_props(device=None):
        real = real_props(device)
        return EmulatedProperties(real, emulated_name(real.name), *emu.capability, emu.total_bytes)

    def get_device_properties(device=None):
        return real_props(device) if _torch_internal() else emulated_props(device)

    def get_device_name(device=None) -> str:
        return real_props(device).name if _torch_internal() else emulated_props(device).name

    def get_device_capability(device=None) -> tuple[int, int]:
        props = real_props(device) if _torch_internal() else emulated_props(device)
        return props.major, props.minor

    def is_bf16_supported(including_emulation: bool = True) -> bool:
        """As on a T4: bf16 runs (through slow emulation) but not natively."""
        return bool(including_emulation)

    def is_tf32_supported() -> bool:
        return False

    def real_total(device=None) -> int:
        return real_props(device).total_memory

    def set_per_process_memory_fraction(fraction, device=None) -> None:
        """``fraction`` of the emulated card, applied as the same bytes of the real one."""
        if not isinstance(fraction, float):
            raise TypeError("Invalid type for fraction argument, must be `float`")
        if fraction < 0 or fraction > 1:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        real_set_fraction(min(1.0, fraction * emu.total_bytes / real_total(device)), device)

    def get_per_process_memory_fraction(device=None) -> float:
        return min(1.0, real_get_fraction(device) * real_total(device) / emu.total_bytes)

    def mem_get_info(device=None) -> tuple[int, int]:
        free, total = real_mem_get_info(device)
        return max(0, emu.total_bytes - (total - free)), emu.total_bytes

    for owner in (cuda, cuda_memory):
        for fn in (set_per_process_memory_fraction, mem_get_info):
            if hasattr(owner, fn.__name__):
                emu.patch(owner, fn.__name__, fn)
        if real_get_fraction is not None and hasattr(owner, "get_per_process_memory_fraction"):
            emu.patch(owner, "get_per_process_memory_fraction", get_per_process_memory_fraction)
    for fn in (get_device_properties, get_device_name, get_device_capability, is_bf16_supported):
        emu.patch(cuda, fn.__name__, fn)
    if hasattr(cuda, "is_tf32_supported"):
        emu.patch(cuda, "is_tf32_supported", is_tf32_supported)

    # The allocator cap, set when CUDA initialises (setting it now would create the CUDA context that
    # chapter 1 measures): the whole emulated card, for every device this process sees.
    def cap_allocator() -> None:
        for device in range(cuda.device_count()):
            real_set_fraction(min(1.0, emu.total_bytes / real_total(device)), device)

    cuda._lazy_call(cap_allocator)

    # TF32 off and locked. cuBLAS's flag and float32 matmul precision are read through torch._C at each call;
    # cuDNN's module holds its setters in class attributes, replaced here by ones that go through torch._C.
    def locked(setter, off):
        def set_locked(*args):
            return setter(*args[:-1], off(args[-1]))
        set_locked.__name__ = getattr(setter, "__name__", "set_locked")
        return set_locked

    never = lambda value: False  # noqa: E731
    emu.resets += [(C._set_cublas_allow_tf32, C._get_cublas_allow_tf32()),
                   (C._set_cudnn_allow_tf32, C._get_cudnn_allow_tf32()),
                   (C._set_float32_matmul_precision, torch.get_float32_matmul_precision())]
    for name in ("_set_cublas_allow_tf32", "_set_cudnn_allow_tf32"):
        getattr(C, name)(False)
        emu.patch(C, name, locked(getattr(C, name), never))
    C._set_float32_matmul_precision("highest")
    emu.patch(C, "_set_float32_matmul_precision",
              locked(C._set_float32_matmul_precision, lambda p: "highest" if p in ("high", "medium") else p))
    if hasattr(C, "_set_fp32_precision_setter"):
        emu.patch(C, "_set_fp32_precision_setter",
                  locked(C._set_fp32_precision_setter, lambda p: "ieee" if p == "tf32" else p))
    cudnn_type = type(torch.backends.cudnn)
    from torch.backends import ContextProp

    if isinstance(cudnn_type.__dict__.get("allow_tf32"), ContextProp):
        emu.patch(cudnn_type, "allow_tf32",
                  ContextProp(C._get_cudnn_allow_tf32, lambda v: torch._C._set_cudnn_allow_tf32(v)))
    if isinstance(cudnn_type.__dict__.get("fp32_precision"), ContextProp):
        emu.patch(cudnn_type, "fp32_precision",
                  ContextProp(cudnn_type.__dict__["fp32_precision"].getter,
                              lambda v: torch._C._set_fp32_precision_setter("cuda", "all", v)))

    # SDPA: flash and cuDNN attention off and locked (sdpa_kernel sets them through torch._C at each call).
    for name in ("_set_sdp_use_flash", "_set_sdp_use_cudnn"):
        if hasattr(C, name):
            getter = getattr(C, name.replace("_set_sdp_use_", "_get_") + "_sdp_enabled", None)
            if getter is not None:
                emu.resets.append((getattr(C, name), getter()))
            getattr(C, name)(False)
            emu.patch(C, name, locked(getattr(C, name), never))


def _patch_sdpa(emu: Emulation) -> None:
    """No bf16 in the memory-efficient SDPA kernel (it needs compute capability 8.0 for bf16): bf16 attention
    on CUDA runs as on a T4, with the math kernel, or fails when math is not allowed either."""
    import torch
    import torch.nn.functional as F

    C = torch._C
    real_sdpa = F.scaled_dot_product_attention

    def scaled_dot_product_attention(query, key, value, *args, **kwargs):
        if query.is_cuda and query.dtype == torch.bfloat16 and C._get_mem_efficient_sdp_enabled():
            C._set_sdp_use_mem_efficient(False)
            try:
                return real_sdpa(query, key, value, *args, **kwargs)
            finally:
                C._set_sdp_use_mem_efficient(True)
        return real_sdpa(query, key, value, *args, **kwargs)

    scaled_dot_product_attention.__doc__ = real_sdpa.__doc__
    emu.patch(F, "scaled_dot_product_attention", scaled_dot_product_attention)


def _patch_nvml(emu: Emulation) -> None:
    try:
        import pynvml
    except ImportError:
        return
    real_name, real_info = pynvml.nvmlDeviceGetName, pynvml.nvmlDeviceGetMemoryInfo
    total = T4_NVML_TOTAL_MIB * 2**20

    def nvmlDeviceGetName(handle):
        name = real_name(handle)
        if isinstance(name, bytes):
            return emulated_name(name.decode()).encode()
        return emulated_name(name)

    class MemoryInfo:
        """NVML's memory info with the T4's total: *used* is the real card's, *free* what the T4 would have."""

        def __init__(self, real) -> None:
            self._real, self.total, self.used = real, total, real.used
            self.free = max(0, total - real.used)

        def __getattr__(self, attr):
            return getattr(self._real, attr)

    def nvmlDeviceGetMemoryInfo(handle, *args, **kwargs):
        return MemoryInfo(real_info(handle, *args, **kwargs))

    emu.patch(pynvml, "nvmlDeviceGetName", nvmlDeviceGetName)
    emu.patch(pynvml, "nvmlDeviceGetMemoryInfo", nvmlDeviceGetMemoryInfo)


def activate(card: str = "t4") -> Emulation | None:
    """Make this process's CUDA GPU answer like ``card``; None (nothing changed) without CUDA or torch.

    Idempotent: a second call returns the emulation already in force. Creates no CUDA context.
    """
    global _active
    if card not in CARDS:
        raise ValueError(f"unknown card to emulate {card!r}; known: {', '.join(CARDS)}")
    if _active is not None:
        return _active
    try:
        import torch
    except ImportError:  # a Python without torch (a tool a chapter starts): no CUDA for it to see
        return None
    if not torch.cuda.is_available():
        return None
    emu = Emulation(card=card, total_bytes=int(t4_memory_gib() * 2**30), capability=T4_CAPABILITY)
    try:
        _patch_torch(emu)
        _patch_sdpa(emu)
        _patch_nvml(emu)
    except BaseException:
        _restore(emu)
        raise
    _active = emu
    return emu


def _restore(emu: Emulation) -> None:
    for owner, attr, old in reversed(emu.originals):
        setattr(owner, attr, old)
    for setter, value in reversed(emu.resets):
        setter(value)
    emu.originals.clear()
    emu.resets.clear()


def deactivate() -> None:
    """Put back everything ``activate`` replaced, and the TF32 and SDPA flags as they were (for tests)."""
    global _active
    if _active is not None:
        _restore(_active)
        _active = None


def activate_from_env(environ=None) -> Emulation | None:
    """``activate`` the card that ``GPUBOOK_EMULATE`` names; None when it is unset (ValueError if unknown)."""
    card = requested(environ)
    return activate(card) if card else None


# The code ``execute_notebooks.py --emulate`` writes as sitecustomize.py into a folder it puts first on the
# kernels' PYTHONPATH. It loads this file by path (no name on sys.path to collide with), stops the process
# if the emulation fails (a run labelled T4 must not silently run as the big card), then runs the
# sitecustomize that it shadows, if any.
SITECUSTOMIZE = '''\
"""Written by scripts/execute_notebooks.py --emulate: load the GPU emulation of {path}."""
import importlib.machinery
import importlib.util
import os
import sys

try:
    _spec = importlib.util.spec_from_file_location("gpubook_emulate", {path!r})
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["gpubook_emulate"] = _module
    _spec.loader.exec_module(_module)
except BaseException as _err:
    sys.stderr.write(f"GPUBOOK_EMULATE: the emulation failed, stopping this process: {{type(_err).__name__}}: {{_err}}\\n")
    sys.stderr.flush()
    os._exit(3)

_here = os.path.dirname(os.path.abspath(__file__))
_next = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != _here])
if _next is not None and _next.loader is not None:
    _next.loader.exec_module(importlib.util.module_from_spec(_next))
'''


def write_sitecustomize(folder: Path) -> Path:
    """Write the sitecustomize.py that loads this module into ``folder``; its path."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "sitecustomize.py"
    path.write_text(SITECUSTOMIZE.format(path=str(Path(__file__).resolve())), encoding="utf-8")
    return path


activate_from_env()
