import json
import os
import sys
import time
from pathlib import Path

import pytest

from helpers import launching


def test_launch_env_keeps_the_callers_settings_but_never_enables_multicast():
    env = launching.launch_env({"NCCL_NVLS_ENABLE": "1", "OMP_NUM_THREADS": "4", "KEEP": "me"})
    assert env["KEEP"] == "me" and env["OMP_NUM_THREADS"] == "4"
    assert env["NCCL_NVLS_ENABLE"] == "0"  # forced off even when the caller asked for it
    assert env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1" and env["NVSHMEM_DISABLE_NVLS"] == "1"
    assert launching.launch_env({})["OMP_NUM_THREADS"] == "1"


def test_run_forces_multicast_off_even_with_an_explicit_environment():
    keys = sorted(launching.LAUNCH_ENV_FORCED)
    show = f"import os, json; print(json.dumps({{k: os.environ.get(k) for k in {keys!r}}}))"
    launch = launching.Launch((sys.executable, "-c", show), "show env")
    seen = json.loads(launching.run(launch, env={"NCCL_NVLS_ENABLE": "1"}).stdout)
    assert seen == launching.LAUNCH_ENV_FORCED


def test_torchrun_and_accelerate_commands():
    launch = launching.torchrun("scripts/x.py", 2, ["--out", "a b"])
    assert launch.argv[:3] == (sys.executable, "-m", "torch.distributed.run")
    assert launch.text == "torchrun --standalone --nproc_per_node=2 scripts/x.py --out 'a b'"
    acc = launching.accelerate_launch("c.yaml", "scripts/x.py", 2)
    assert acc.text == "accelerate launch --config_file c.yaml --num_processes 2 scripts/x.py"
    assert "--main_process_port" in acc.argv and sys.executable not in acc.text
    with pytest.raises(ValueError):
        launching.torchrun("x.py", 0)
    assert 0 < launching.free_port() < 65536


def test_run_returns_output_or_raises_with_it():
    ok = launching.Launch((sys.executable, "-c", "print('hello')"), "hello")
    assert launching.run(ok, env={}).stdout.strip() == "hello"
    bad = launching.Launch((sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"), "bad")
    with pytest.raises(RuntimeError, match=r"(?s)exit code 3.*boom"):
        launching.run(bad, env={})


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting to be reaped counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_timeout_stops_the_launcher_and_every_worker(tmp_path, monkeypatch):
    """Like torchrun: a parent that starts workers. On a timeout the workers must not survive it."""
    monkeypatch.setattr(launching, "STOP_GRACE_S", 2.0)
    pid_file = tmp_path / "worker.pid"
    parent = (
        "import subprocess, sys, time\n"
        f"w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(w.pid))\n"
        "time.sleep(60)\n"
    )
    launch = launching.Launch((sys.executable, "-c", parent), "parent")
    worker = None
    try:
        with pytest.raises((TimeoutError, Exception)) as info:
            launching.run(launch, env={}, timeout_s=2)
        worker = int(pid_file.read_text())
        deadline = time.time() + 5
        while _alive(worker) and time.time() < deadline:
            time.sleep(0.1)
        assert not _alive(worker), "a worker outlived the timed-out launch"
        assert isinstance(info.value, TimeoutError) and "stopped" in str(info.value)
    finally:
        if worker is not None and _alive(worker):
            os.kill(worker, 9)  # the process this test started


def test_read_results_and_load_script(tmp_path):
    (tmp_path / "rank0.json").write_text(json.dumps([{"rank": 0, "x": 1}, {"rank": 0, "x": 2}]))
    (tmp_path / "rank1.json").write_text(json.dumps([{"rank": 1, "x": 3}]))
    assert launching.read_results(tmp_path)["x"].tolist() == [1, 2, 3]
    with pytest.raises(FileNotFoundError):
        launching.read_results(tmp_path / "empty")
    script = tmp_path / "tool.py"
    script.write_text("def twice(x):\n    return 2 * x\n\nif __name__ == '__main__':\n    raise SystemExit(1)\n")
    assert launching.load_script(script).twice(21) == 42
