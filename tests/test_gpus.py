"""GPU facts (helpers.gpus): datasheet peaks by name, memory, compute capability and what follows from it."""

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers import gpus

# --- datasheet peaks by the name torch reports ------------------------------------------------------


def test_peak_table_lookup():
    assert gpus.peak_tflops("NVIDIA H100 80GB HBM3", torch.bfloat16) == 989.4
    assert gpus.peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.5
    assert gpus.peak_tflops("NVIDIA H200", "bf16") == 989.4
    assert gpus.peak_tflops("NVIDIA A100-SXM4-80GB", torch.float16) == 312.0
    assert gpus.peak_tflops("Tesla T4", torch.float16) == 65.0
    with pytest.raises(ValueError, match="no bf16 peak"):
        gpus.peak_tflops("Tesla T4", torch.bfloat16)


@pytest.mark.parametrize(
    ("name", "wrong"),
    [("NVIDIA L40S", 121.0),  # not the L4's peak: MFU would come out about 3x too high
     ("NVIDIA H100 NVL", 989.4),  # not the SXM board's
     ("NVIDIA H200 NVL", 989.4)],
)
def test_similar_names_do_not_borrow_another_gpus_peak(name, wrong):
    assert gpus.peak_tflops(name, "bf16") != wrong


def test_datasheet_values_of_the_variants():
    # NVIDIA datasheets, dense (half the "with sparsity" figures): L40S 362.05 TFLOPS bf16; H100 NVL 835.5
    assert gpus.peak_tflops("NVIDIA L40S", "bf16") == pytest.approx(362.05)
    assert gpus.peak_tflops("NVIDIA H100 NVL", "bf16") == pytest.approx(835.5)
    assert gpus.peak_tflops("NVIDIA L4", "bf16") == pytest.approx(121.0)


@pytest.mark.parametrize("name", ["NVIDIA L40", "NVIDIA GH200 480GB", "Some CPU", ""])
def test_unknown_gpu_is_said_so(name):
    with pytest.raises(ValueError, match="unknown GPU"):
        gpus.peak_tflops(name, "fp32")


@pytest.mark.parametrize(("name", "gb_s"), [("NVIDIA H100 80GB HBM3", 3350.0), ("NVIDIA H200", 4800.0),
                                            ("NVIDIA H100 NVL", 3900.0), ("Tesla T4", 320.0), ("NVIDIA L4", 300.0),
                                            ("NVIDIA L40S", 864.0)])
def test_datasheet_bandwidth_by_exact_name(name, gb_s):
    assert gpus.peak_bandwidth_gb_s(name) == gb_s


def test_unknown_bandwidth_is_said_so():
    with pytest.raises(ValueError, match="unknown GPU"):
        gpus.peak_bandwidth_gb_s("NVIDIA A100-SXM4-80GB")


# --- memory and capability ---------------------------------------------------------------------------


def test_every_card_has_a_memory_and_a_capability():
    assert set(gpus.GPU_MEMORY_GIB) == set(gpus.COMPUTE_CAPABILITY)
    assert gpus.GPU_MEMORY_GIB["T4"] == gpus.T4_MEMORY_GIB == 14.75
    assert all(0 < gib < 200 for gib in gpus.GPU_MEMORY_GIB.values())


def test_no_bf16_list_follows_from_the_capability_rule():
    """One source of truth for "has bf16": compute capability 8.0 or newer."""
    assert gpus.NO_BF16_GPUS == ("T4", "V100-16", "V100-32")
    for name, (major, minor) in gpus.COMPUTE_CAPABILITY.items():
        assert (name in gpus.NO_BF16_GPUS) is not gpus.Capability(name, major, minor).bf16


def test_datasheet_bf16_peaks_agree_with_the_capability_rule():
    """A card with a bf16 peak in the datasheet table is one the capability rule gives bf16, and the reverse."""
    checked = 0
    for name, (major, minor) in gpus.COMPUTE_CAPABILITY.items():
        key = gpus.gpu_key(name)
        if key is None:  # A10G: no datasheet peak in the table
            continue
        assert ("bf16" in gpus.PEAK_TFLOPS[key]) is gpus.Capability(name, major, minor).bf16, name
        checked += 1
    assert checked >= 8


def test_amp_dtype_without_cuda_is_bf16(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    gpus.capability.cache_clear()
    try:
        assert gpus.capability() is None
        assert gpus.amp_dtype() == torch.bfloat16
    finally:
        gpus.capability.cache_clear()


@pytest.mark.parametrize(("name", "major", "minor", "dtype"), [("Tesla T4", 7, 5, torch.float16),
                                                               ("NVIDIA H100 80GB HBM3", 9, 0, torch.bfloat16)])
def test_capability_of_the_gpu_here(monkeypatch, name, major, minor, dtype):
    """The CUDA branch, fed a fake device: what ``capability()`` and ``amp_dtype()`` say on a T4 and an H100."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index=0: SimpleNamespace(name=name, major=major, minor=minor))
    gpus.capability.cache_clear()
    try:
        cap = gpus.capability()
        assert cap == gpus.Capability(name, major, minor)
        assert gpus.amp_dtype() == dtype
        assert cap.flash_attention is cap.tf32 is (major >= 8)
    finally:
        gpus.capability.cache_clear()


# --- the module's place in the package ----------------------------------------------------------------


def test_gpus_imports_no_other_helpers_module():
    tree = ast.parse((Path(gpus.__file__)).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert not (node.module or "").startswith("helpers") and not node.level, ast.unparse(node)
        elif isinstance(node, ast.Import):
            assert not any(a.name.startswith("helpers") for a in node.names), ast.unparse(node)


def test_gpu_facts_have_one_home():
    """The GPU facts live in ``gpus`` only: the modules that held them before no longer offer them."""
    from helpers import flops, plan, run_profile

    for name in ("PEAK_TFLOPS", "PEAK_BANDWIDTH_GB_S", "gpu_key", "peak_tflops", "peak_bandwidth_gb_s"):
        assert not hasattr(flops, name), name
    assert not hasattr(run_profile, "capability") and not hasattr(run_profile, "amp_dtype")
    for name in ("GPU_MEMORY_GIB", "CONTEXT_RESERVE_GIB", "NO_BF16_GPUS"):
        assert not hasattr(plan, name), name
