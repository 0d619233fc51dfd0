"""The environment report printed at the top of every chapter, Colab detection, and the GPUs' NVLink links.

The report reads the GPU through NVML, so printing it does not create a CUDA context: chapter 1
measures the context's cost afterwards and needs a clean start.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import warnings

import pandas as pd
import torch

from helpers import measure
from helpers import run_profile as _run_profile

PACKAGES = ("torch", "transformers", "accelerate", "peft", "bitsandbytes", "datasets")


def is_colab() -> bool:
    """True inside Google Colab (its ``google.colab`` module is loaded).

    Introduced in chapter 1, section 1.1.
    """
    return "google.colab" in sys.modules


def package_version(name: str) -> str:
    """Installed version of a distribution, or ``"not installed"`` (without importing it).

    Introduced in chapter 1, section 1.1.
    """
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def gpu_info(index: int = 0) -> dict[str, str | float] | None:
    """Name, total memory (GiB) and driver of CUDA device ``index`` via NVML; ``None`` without one.

    ``index`` counts the GPUs this process sees (``CUDA_VISIBLE_DEVICES`` applied), and ``count`` is
    how many it sees, so the report describes the GPUs the chapter really ran on. Creates no CUDA
    context.

    Introduced in chapter 1, section 1.1.
    """
    count = measure.visible_gpu_count()
    if index >= count:
        return None
    import pynvml

    with measure.nvml_device(index) as handle:
        name = pynvml.nvmlDeviceGetName(handle)
        name = name.decode() if isinstance(name, bytes) else name
        driver = pynvml.nvmlSystemGetDriverVersion()
        driver = driver.decode() if isinstance(driver, bytes) else driver
        total = pynvml.nvmlDeviceGetMemoryInfo(handle).total
    return {"name": name, "memory_gib": round(total / 2**30, 1), "driver": driver, "count": count}


def report(prof: _run_profile.Profile | None = None) -> pd.DataFrame:
    """Where this run's outputs came from: hardware, versions and the profile, as a table.

    >>> env.report(run_profile.get())

    Introduced in chapter 1's setup cell.
    """
    prof = prof or _run_profile.get()
    gpu = gpu_info() if _run_profile.cuda_available() else None
    rows: dict[str, str] = {}
    if gpu:
        rows["GPU"] = f"{gpu['count']} x {gpu['name']}, {gpu['memory_gib']} GiB each"
        rows["NVIDIA driver"] = str(gpu["driver"])
        rows["CUDA (torch build)"] = str(torch.version.cuda)
    else:
        rows["GPU"] = "none (CPU run)"
    rows["CPU"] = platform.processor() or platform.machine()
    rows["Python"] = platform.python_version()
    for name in PACKAGES:
        rows[name] = package_version(name)
    rows["profile"] = f"{prof.name} (set {_run_profile.ENV_VAR}=tiny|full to override)"
    rows["Colab"] = "yes" if is_colab() else "no"
    return pd.DataFrame({"value": rows})


def start(float_format: str = "{:,.2f}") -> _run_profile.Profile:
    """The setup every chapter runs after its imports; returns the run profile.

    The book's plot style (``plots.use_style``), pandas' number format, the run profile
    (``run_profile.get``), and the report of hardware and versions shown as the cell's output.

    >>> prof = env.start()

    Introduced in chapter 1's setup cell.
    """
    from helpers import plots  # here, not at the top: matplotlib's import is the chapter's, after quiet()

    plots.use_style()
    pd.options.display.float_format = float_format.format
    prof = _run_profile.get()
    table = report(prof)
    try:
        from IPython.display import display
    except ImportError:  # a plain script
        print(table.to_string())
    else:
        display(table)
    return prof


def _short_warning(message, category, filename, lineno, line=None) -> str:
    return f"{category.__name__}: {message}\n"


def quiet() -> None:
    """Keep notebook outputs about the lesson, the same on every machine. Call before other imports.

    - Python warnings still show, but as ``Category: message``, without the machine's file paths;
    - tqdm's "IProgress not found" notice (no ipywidgets) is dropped;
    - transformers and bitsandbytes log errors only (``TRANSFORMERS_VERBOSITY=error``; the
      ``bitsandbytes`` logger at ERROR), and neither ``datasets`` nor ``transformers`` (through
      ``HF_HUB_DISABLE_PROGRESS_BARS``) draws progress bars.

    Introduced in chapter 1's setup cell.
    """
    warnings.formatwarning = _short_warning
    warnings.filterwarnings("ignore", message="IProgress not found")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' loading/saving bars
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)


# --- the GPUs' links: what nvidia-smi reports (chapter 7) --------------------------------------------

_LINK_RE = re.compile(r"^\s*Link\s+(\d+):\s*([0-9.]+)\s*GB/s", re.I)
_GPU_RE = re.compile(r"^\s*GPU\s+(\d+):", re.I)


def parse_nvlink_status(text: str) -> dict[int, list[float]]:
    """The active NVLink links of each GPU, in GB/s, from the output of ``nvidia-smi nvlink -s``.

    The command prints ``GPU i: <name> (UUID: ...)`` and then one ``Link k: <speed> GB/s`` line per
    link (``Link k: <inactive>`` for one that is down, which is left out). A GPU without NVLink gets
    an empty list; text in another shape gives ``{}``.

    Introduced in chapter 7, section 7.7.
    """
    out: dict[int, list[float]] = {}
    gpu = None
    for line in text.splitlines():
        if m := _GPU_RE.match(line):
            gpu = int(m.group(1))
            out[gpu] = []
        elif (m := _LINK_RE.match(line)) and gpu is not None:
            out[gpu].append(float(m.group(2)))
    return out


def nvlink_status(timeout_s: float = 20.0) -> tuple[str, dict[int, list[float]]] | None:
    """Run ``nvidia-smi nvlink -s``: its output and ``parse_nvlink_status`` of it; None if it cannot run.

    None when ``nvidia-smi`` is missing, fails, or times out: the caller then says that the link's
    nominal bandwidth is unknown. (The speeds are per link and direction as the driver reports them.)

    Introduced in chapter 7, section 7.7.
    """
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        done = subprocess.run([exe, "nvlink", "-s"], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return done.stdout, parse_nvlink_status(done.stdout)
