"""scripts/emulate_t4.py (T4 mode) on a fake H100, and the kernel environment execute_notebooks.py builds for it.

No GPU here: torch.cuda's answers are monkeypatched to an H100's first, then the module is imported as a
kernel would import it; the real helpers (gpus, env, measure) are asked what they see.
"""

import importlib.util
import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import nbformat
import pytest
import torch

from helpers import env, gpus, measure

ROOT = Path(__file__).resolve().parents[1]
MODULE = ROOT / "scripts" / "emulate_t4.py"
GIB = 2**30
H100 = "NVIDIA H100 80GB HBM3"
H100_BYTES = int(gpus.GPU_MEMORY_GIB["H100"] * GIB)


def load(name="emulate_t4_under_test"):
    """Import the module afresh, as a kernel's sitecustomize does (it activates on import)."""
    spec = importlib.util.spec_from_file_location(name, MODULE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as the sitecustomize registers it (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def fake_h100(monkeypatch):
    """torch.cuda and NVML answering like one H100; records fractions set and calls queued for CUDA init."""
    state = SimpleNamespace(fractions={}, queued=[], used=2 * GIB)
    props = SimpleNamespace(name=H100, major=9, minor=0, total_memory=H100_BYTES, multi_processor_count=132)
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "device_count", lambda: 1)
    monkeypatch.setattr(cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cuda, "get_device_properties", lambda device=None: props)
    monkeypatch.setattr(cuda, "_lazy_call", lambda fn, **kw: state.queued.append(fn))
    monkeypatch.setattr(cuda, "mem_get_info", lambda device=None: (H100_BYTES - state.used, H100_BYTES))

    def set_fraction(fraction, device=None):
        state.fractions[device or 0] = fraction

    monkeypatch.setattr(cuda, "set_per_process_memory_fraction", set_fraction)
    monkeypatch.setattr(cuda, "get_per_process_memory_fraction", lambda device=None: state.fractions.get(device or 0, 1.0))
    import pynvml

    monkeypatch.setattr(pynvml, "nvmlDeviceGetName", lambda handle: H100)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo",
                        lambda handle: SimpleNamespace(total=80 * 1024 * 2**20, used=state.used, free=0))
    monkeypatch.setattr(pynvml, "nvmlSystemGetDriverVersion", lambda: "550.54")

    @contextmanager
    def nvml_device(index=0):
        yield "handle"

    monkeypatch.setattr(measure, "visible_gpu_count", lambda: 1)
    monkeypatch.setattr(measure, "nvml_device", nvml_device)
    gpus.capability.cache_clear()
    yield state
    gpus.capability.cache_clear()


def answers():
    """Everything the module may change, as torch, NVML and the helpers report it."""
    import pynvml

    C = torch._C
    return {
        "capability": torch.cuda.get_device_capability(),
        "name": torch.cuda.get_device_name(),
        "props.name": torch.cuda.get_device_properties(0).name,
        "props.total_memory": torch.cuda.get_device_properties(0).total_memory,
        "props.multi_processor_count": torch.cuda.get_device_properties(0).multi_processor_count,
        "bf16": torch.cuda.is_bf16_supported(),
        "bf16_native": torch.cuda.is_bf16_supported(including_emulation=False),
        "tf32_supported": torch.cuda.is_tf32_supported(),
        "mem_get_info": torch.cuda.mem_get_info(),
        "nvml.name": pynvml.nvmlDeviceGetName("handle"),
        "nvml.total": pynvml.nvmlDeviceGetMemoryInfo("handle").total,
        "nvml.used": pynvml.nvmlDeviceGetMemoryInfo("handle").used,
        "cublas_tf32": C._get_cublas_allow_tf32(),
        "cudnn_tf32": C._get_cudnn_allow_tf32(),
        "flash": C._get_flash_sdp_enabled(),
        "cudnn_sdp": C._get_cudnn_sdp_enabled(),
        "efficient": C._get_mem_efficient_sdp_enabled(),
        "math": C._get_math_sdp_enabled(),
    }


@pytest.fixture
def emulated(fake_h100, monkeypatch):
    monkeypatch.setenv("GPUBOOK_EMULATE", "t4")
    torch.backends.cudnn.allow_tf32 = True  # the default: TF32 on for cuDNN
    module = load()
    assert module.active() is not None
    yield module, fake_h100
    module.deactivate()


def test_without_the_variable_nothing_changes(fake_h100, monkeypatch):
    monkeypatch.delenv("GPUBOOK_EMULATE", raising=False)
    before = answers()
    module = load()
    assert module.active() is None and answers() == before and not fake_h100.queued
    monkeypatch.setenv("GPUBOOK_EMULATE", "")
    module = load()
    assert module.active() is None and answers() == before


def test_an_unknown_value_is_a_clear_error(fake_h100, monkeypatch):
    monkeypatch.setenv("GPUBOOK_EMULATE", "a100")
    before = answers()
    with pytest.raises(ValueError, match="GPUBOOK_EMULATE='a100': unknown card to emulate; known: t4"):
        load()
    assert answers() == before


def test_without_cuda_it_is_a_no_op(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("GPUBOOK_EMULATE", "t4")
    assert load().active() is None


def test_a_python_without_torch_is_left_alone(monkeypatch):
    monkeypatch.setenv("GPUBOOK_EMULATE", "t4")
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    assert load().active() is None


def test_t4_mode_changes_exactly_the_listed_answers(emulated):
    module, state = emulated
    module.deactivate()
    torch.backends.cudnn.allow_tf32 = True
    before = answers()
    module.activate("t4")
    after = answers()
    t4_bytes = int(gpus.T4_MEMORY_GIB * GIB)  # the constant the module reads from helpers/gpus.py
    name = "Tesla T4 (emulated on H100)"
    expected = dict(before, **{
        "capability": (7, 5), "name": name, "props.name": name, "props.total_memory": t4_bytes,
        "bf16_native": False, "tf32_supported": False,  # bf16 "supported" stays True: through emulation, as on a T4
        "mem_get_info": (t4_bytes - state.used, t4_bytes), "nvml.name": name, "nvml.total": 15360 * 2**20,
        "cublas_tf32": False, "cudnn_tf32": False, "flash": False, "cudnn_sdp": False,
    })
    assert after == expected
    assert before["efficient"] and before["math"]  # memory-efficient and math attention stay on
    assert after["props.multi_processor_count"] == 132  # the rest is the real card's


def test_the_helpers_see_a_t4(emulated):
    cap = gpus.capability()
    assert (cap.major, cap.minor) == (7, 5) and cap.name.startswith("Tesla T4 (emulated on ")
    assert not cap.bf16 and not cap.tf32 and not cap.flash_attention
    assert gpus.amp_dtype() == torch.float16
    name = torch.cuda.get_device_name()
    assert gpus.gpu_key(name) == "T4" and gpus.gpu_key(name, gpus.PEAK_BANDWIDTH_GB_S) == "T4"
    assert gpus.gpu_key(name, gpus.GPU_MEMORY_GIB) == "T4"
    assert gpus.peak_tflops(name, torch.float16) == gpus.PEAK_TFLOPS["T4"]["fp16"]
    info = env.gpu_info()
    assert info["name"] == name and info["memory_gib"] == 15.0 and info["count"] == 1
    report = env.report()
    assert report.loc["GPU", "value"] == "1 x Tesla T4 (emulated on H100), 15.0 GiB each"
    assert "<td>1 x Tesla T4 (emulated on H100), 15.0 GiB each</td>" in report._repr_html_()  # shown whole


def test_torch_and_triton_themselves_see_the_real_card(emulated):
    """Inductor asks the capability to choose Triton's target: an sm_75 binary would not load on the H100."""
    ask = ("(torch.cuda.get_device_capability(), torch.cuda.get_device_name(), "
           "torch.cuda.get_device_properties(0).total_memory)")
    real = (9, 0), H100, H100_BYTES
    for module in ("torch._dynamo.device_interface", "torch._inductor.runtime.hints", "triton.backends.nvidia"):
        assert eval(ask, {"__name__": module, "torch": torch}) == real, module
    emulated_answer = eval(ask, {"__name__": "transformers.utils", "torch": torch})
    assert emulated_answer[0] == (7, 5) and emulated_answer[1].startswith("Tesla T4")


def test_the_host_card_never_wins_the_name_lookup(emulated):
    module, _ = emulated
    hosts = {"NVIDIA H100 80GB HBM3": "H100", "NVIDIA H100 NVL": "H100", "NVIDIA H200": "H200",
             "NVIDIA A100-SXM4-80GB": "A100", "NVIDIA L4": "L4", "NVIDIA L40S": "L40S", "Tesla V100-SXM2-16GB": "V100"}
    for host, model in hosts.items():
        name = module.emulated_name(host)
        assert name == f"Tesla T4 (emulated on {model})", host
        for table in (None, gpus.PEAK_BANDWIDTH_GB_S, gpus.GPU_MEMORY_GIB):
            assert gpus.gpu_key(name, table) == "T4", (host, table)


def test_the_allocator_is_capped_at_the_t4_and_budgets_are_fractions_of_it(emulated):
    module, state = emulated
    assert module.t4_memory_gib() == gpus.T4_MEMORY_GIB
    (cap,) = state.queued  # applied when CUDA initialises, not at import (no CUDA context yet)
    assert state.fractions == {}
    cap()
    assert state.fractions[0] == pytest.approx(gpus.T4_MEMORY_GIB * GIB / H100_BYTES)
    assert torch.cuda.get_per_process_memory_fraction(0) == pytest.approx(1.0)
    with measure.gpu_budget(10.0) as fraction:  # the helper the chapters' T4 budget goes through
        assert fraction == pytest.approx(10.0 / gpus.T4_MEMORY_GIB)
        assert state.fractions[0] * H100_BYTES == pytest.approx(10.0 * GIB)
    assert state.fractions[0] * H100_BYTES == pytest.approx(gpus.T4_MEMORY_GIB * GIB)  # restored to the T4
    with pytest.raises(ValueError):
        torch.cuda.set_per_process_memory_fraction(1.5)


def test_tf32_and_flash_attention_stay_off_whatever_a_chapter_asks(emulated):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.set_float32_matmul_precision("high")
    torch.backends.cuda.enable_flash_sdp(True)
    torch.backends.cuda.enable_cudnn_sdp(True)
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    assert torch.get_float32_matmul_precision() == "highest"
    assert not torch.backends.cuda.flash_sdp_enabled() and not torch.backends.cuda.cudnn_sdp_enabled()
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        assert not torch.backends.cuda.flash_sdp_enabled()
        assert torch.backends.cuda.mem_efficient_sdp_enabled()
    assert torch.backends.cuda.mem_efficient_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()


def test_deactivate_puts_everything_back(fake_h100, monkeypatch):
    monkeypatch.delenv("GPUBOOK_EMULATE", raising=False)
    before = answers()
    module = load()
    module.activate("t4")
    module.deactivate()
    assert answers() == before and torch.get_float32_matmul_precision() == "highest"


# --- the runner: the kernels' environment --------------------------------------------------------------

spec = importlib.util.spec_from_file_location("execute_notebooks_t4", ROOT / "scripts" / "execute_notebooks.py")
execute_notebooks = importlib.util.module_from_spec(spec)
spec.loader.exec_module(execute_notebooks)


def test_the_runner_builds_the_kernel_environment(tmp_path):
    environ = {"PYTHONPATH": "/elsewhere", "CUDA_VISIBLE_DEVICES": "3,5", "HOME": "/home/x"}
    env = execute_notebooks.emulation_environ("t4", environ, tmp_path / "site")
    assert env["GPUBOOK_EMULATE"] == "t4" and env["HOME"] == "/home/x"
    assert env["PYTHONPATH"].split(os.pathsep) == [str(tmp_path / "site"), str(ROOT), "/elsewhere"]
    assert env["CUDA_VISIBLE_DEVICES"] == "3"  # one GPU, as a T4 reader has
    assert environ["CUDA_VISIBLE_DEVICES"] == "3,5"  # a copy: the caller's mapping is untouched
    assert execute_notebooks.emulation_environ("t4", {}, tmp_path / "s2")["CUDA_VISIBLE_DEVICES"] == "0"
    site = (tmp_path / "site" / "sitecustomize.py").read_text()
    assert repr(str(MODULE)) in site
    with pytest.raises(ValueError):
        execute_notebooks.emulation_environ("v100", environ, tmp_path / "s3")


def test_the_sitecustomize_loads_the_emulation_in_a_new_process(tmp_path):
    env = execute_notebooks.emulation_environ("t4", dict(os.environ), tmp_path / "site")
    env["CUDA_VISIBLE_DEVICES"] = ""  # no GPU even on a GPU machine: the answer below is the same everywhere
    code = "import sys; m = sys.modules['gpubook_emulate']; print(m.requested(), m.active())"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["t4", "None"]  # loaded, asked for a T4, no CUDA here: changed nothing
    env["GPUBOOK_EMULATE"] = "t5"
    done = subprocess.run([sys.executable, "-c", "print('ran')"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 3 and "ran" not in done.stdout  # a failed emulation stops the process
    assert "GPUBOOK_EMULATE='t5': unknown card to emulate" in done.stderr


def test_the_runner_refuses_the_variable_without_the_flag_and_the_committed_folder(monkeypatch, capsys):
    monkeypatch.setenv("GPUBOOK_EMULATE", "t4")
    assert execute_notebooks.main(["--profile", "tiny"]) == 2
    assert "pass --emulate t4" in capsys.readouterr().err
    monkeypatch.delenv("GPUBOOK_EMULATE")
    assert execute_notebooks.main(["--emulate", "t4", "--out", str(ROOT / "notebooks")]) == 2
    assert "a folder of its own" in capsys.readouterr().err


def test_t4_mode_runs_the_single_gpu_chapters_only():
    chapters = execute_notebooks.chapter_order()
    assert [c["file"] for c in chapters if c["gpus"] > 1] == ["07_distributed_zero.ipynb"]
    assert json.loads((ROOT / "notebooks" / "chapters.json").read_text())["chapters"] == chapters


def test_bf16_attention_gets_no_memory_efficient_kernel_as_on_a_t4(emulated, monkeypatch):
    import torch.nn.functional as F

    module, _ = emulated
    module.deactivate()
    seen = []
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda q, k, v, *a, **kw: seen.append((q.dtype, torch._C._get_mem_efficient_sdp_enabled())))
    module.activate("t4")
    for dtype, is_cuda in ((torch.bfloat16, True), (torch.float16, True), (torch.bfloat16, False)):
        q = SimpleNamespace(is_cuda=is_cuda, dtype=dtype)
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert seen == [(torch.bfloat16, False), (torch.float16, True), (torch.bfloat16, True)]
    assert torch._C._get_mem_efficient_sdp_enabled()  # switched back on after the call


def test_the_runner_on_a_fake_h100_runs_single_gpu_chapters_emulated_into_its_folder(tmp_path, monkeypatch, capsys):
    """The GPU path of main(): chapter 7 skipped, the others executed in kernels with the T4 environment."""
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k != "GPUBOOK_EMULATE"})
    monkeypatch.setattr(execute_notebooks, "gpus", lambda: (2, H100))
    calls = []

    def fake_execute(path, out, timeout_s, gpu=None, profile="full", commit=None):
        calls.append((path.name, out, gpu, profile, dict(os.environ)))
        report = f"GPU  1 x {gpu}, 15.0 GiB each" if "06_" not in path.name else "GPU  1 x NVIDIA H100 80GB HBM3"
        nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("env.start()", outputs=[
            nbformat.v4.new_output("execute_result", data={"text/plain": report})])])
        nbformat.write(nb, out)
        return {"wall_s": 1.0, "gpu": gpu, "torch": "x", "profile": profile, "date": "d", "commit": commit}

    monkeypatch.setattr(execute_notebooks, "execute", fake_execute)
    monkeypatch.setattr(execute_notebooks, "provenance", lambda paths, commit, root: ("abc123", ["helpers/x.py"]))
    monkeypatch.setattr(execute_notebooks.subprocess, "run", lambda *a, **k: SimpleNamespace(returncode=0))
    out = tmp_path / "t4"
    assert execute_notebooks.main(["--emulate", "t4", "--out", str(out)]) == 1  # chapter 6 ran un-emulated
    printed = capsys.readouterr().out
    assert "06_lora_qlora.ipynb: FAILED: RuntimeError: the environment report of" in printed
    assert "names no emulated card: the kernel ran without the T4 emulation" in printed
    assert "stamped abc123+uncommitted" in printed  # a dirty tree is allowed: nothing is committed from here
    assert "07_distributed_zero.ipynb: SKIPPED: needs 2 GPUs; a T4 reader has one" in printed
    expected = [c["file"] for c in execute_notebooks.chapter_order() if c["gpus"] == 1]
    assert [name for name, *_ in calls] == expected and len(expected) == 9
    for name, dest, gpu, profile, environ in calls:
        assert dest == out / name and gpu == "Tesla T4 (emulated on H100)" and profile == "full"
        assert environ["GPUBOOK_EMULATE"] == "t4" and environ["CUDA_VISIBLE_DEVICES"] == "0"
        assert environ["GPUBOOK_PROFILE"] == "full"
        site = Path(environ["PYTHONPATH"].split(os.pathsep)[0])
        assert (site / "sitecustomize.py").exists()
    times = json.loads((out / "execution_times.json").read_text())["chapters"]
    assert sorted(times) == sorted(Path(f).stem for f in expected if "06_" not in f)
    calls.clear()
    one = ROOT / "notebooks" / "07_distributed_zero.ipynb"
    assert execute_notebooks.main(["--emulate", "t4", "--out", str(out), str(one)]) == 1  # nothing written
    assert not calls and "SKIPPED" in capsys.readouterr().out
