import pytest
import torch

from helpers import env, run_profile


def test_auto_profile_follows_hardware(monkeypatch):
    monkeypatch.delenv(run_profile.ENV_VAR, raising=False)
    prof = run_profile.get()
    assert prof.name == ("full" if torch.cuda.is_available() else "tiny")
    assert prof.device == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("value", ["tiny", "FULL", " full "])
def test_env_var_overrides(monkeypatch, value):
    monkeypatch.setenv(run_profile.ENV_VAR, value)
    assert run_profile.get().name == value.strip().lower()


def test_unknown_profile_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(run_profile.ENV_VAR, "huge")
    with pytest.raises(ValueError, match="unknown profile 'huge'.*tiny, full"):
        run_profile.get()
    with pytest.raises(ValueError, match="unknown profile"):
        run_profile.get("medium")


def test_pick():
    assert run_profile.Profile("tiny", "cpu").pick(tiny=1, full=2) == 1
    assert run_profile.Profile("full", "cuda").pick(tiny=1, full=2) == 2


def test_cuda_guard_prints_one_line_on_cpu(capsys, monkeypatch):
    monkeypatch.setattr(run_profile, "cuda_available", lambda: False)
    assert run_profile.cuda_or_skip("NVML needs an NVIDIA GPU") is False
    assert capsys.readouterr().out == "skipped on CPU: NVML needs an NVIDIA GPU\n"
    with pytest.raises(RuntimeError, match="nvml_used_mib needs a CUDA GPU"):
        run_profile.require_cuda("nvml_used_mib")


def test_report_names_versions_and_profile():
    import transformers

    df = env.report(run_profile.Profile("tiny", "cpu"))
    for key in ("GPU", "torch", "transformers", "peft", "bitsandbytes", "profile"):
        assert key in df.index
    # the versions the packages themselves report, not read back through the same helper
    assert df.loc["torch", "value"] == torch.__version__
    assert df.loc["transformers", "value"] == transformers.__version__
    assert df.loc["profile", "value"].startswith("tiny")
    if not torch.cuda.is_available():
        assert df.loc["GPU", "value"] == "none (CPU run)"


def test_package_version_of_missing_package():
    assert env.package_version("surely-not-a-real-package-xyz") == "not installed"


def test_colab_is_recognised_by_its_module(monkeypatch):
    import sys
    import types

    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    assert env.is_colab() is False
    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    assert env.is_colab() is True
    df = env.report(run_profile.Profile("tiny", "cpu"))
    assert df.loc["Colab", "value"] == "yes"


def test_quiet_formats_warnings_without_paths(monkeypatch):
    import logging
    import warnings

    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)
    monkeypatch.setattr(warnings, "filters", list(warnings.filters))
    monkeypatch.delenv("TRANSFORMERS_VERBOSITY", raising=False)
    env.quiet()
    text = warnings.formatwarning("careful", UserWarning, "/home/someone/x.py", 3)
    assert text == "UserWarning: careful\n"
    assert logging.getLogger("bitsandbytes").level == logging.ERROR
    import os

    assert os.environ["TRANSFORMERS_VERBOSITY"] == "error"
    monkeypatch.delenv("TRANSFORMERS_VERBOSITY")


def test_parse_nvlink_status():
    text = """GPU 0: NVIDIA H200 (UUID: GPU-aaaa)
\t Link 0: 26.562 GB/s
\t Link 1: 26.562 GB/s
\t Link 2: <inactive>
GPU 1: NVIDIA H200 (UUID: GPU-bbbb)
\t Link 0: 26.562 GB/s
GPU 2: Tesla T4 (UUID: GPU-cccc)
"""
    got = env.parse_nvlink_status(text)
    assert got == {0: [26.562, 26.562], 1: [26.562], 2: []}
    assert env.parse_nvlink_status("NVML: Unable to find NVLink") == {}


def test_nvlink_status_without_nvidia_smi(monkeypatch):
    monkeypatch.setattr(env.shutil, "which", lambda name: None)
    assert env.nvlink_status() is None


def test_start_sets_the_format_shows_the_report_and_returns_the_profile(monkeypatch, capsys):
    import pandas as pd

    monkeypatch.setenv(run_profile.ENV_VAR, "tiny")
    shown = []
    monkeypatch.setattr("IPython.display.display", lambda obj: shown.append(obj))
    old = pd.options.display.float_format
    try:
        prof = env.start("{:,.3f}")
        assert prof == run_profile.get() and prof.name == "tiny"
        assert pd.options.display.float_format(1234.5) == "1,234.500"
        assert len(shown) == 1 and shown[0].loc["profile", "value"].startswith("tiny")
    finally:
        pd.options.display.float_format = old
