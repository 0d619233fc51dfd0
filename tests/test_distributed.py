"""Chapter 7's launched scripts, each on 2 CPU processes (gloo), and failing all ranks together."""

import os
import sys
import textwrap

import pytest
import torch

from helpers import distributed, launching

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "notebooks", "scripts")


def cpu_env() -> dict[str, str]:
    """The launch environment on the CPU path (gloo) on any machine, importing this checkout's helpers."""
    env = launching.launch_env()
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    return env


def run_in_ranks(tmp_path, body: str, timeout_s: float = 240) -> launching.Finished:
    """Launch a small driver script on 2 processes; ``body`` runs in each with SCRIPTS and OUT defined."""
    driver = tmp_path / "driver.py"
    driver.write_text(f"SCRIPTS = {SCRIPTS!r}\nOUT = {str(tmp_path)!r}\n" + textwrap.dedent(body))
    return launching.run(launching.torchrun(driver, 2), env=cpu_env(), timeout_s=timeout_s)


@pytest.fixture(scope="module")
def chapter_runs(tmp_path_factory):
    """One launch of 2 processes (one start-up of torch and transformers instead of three) that runs:

    1. ``ddp_grads.py``; 2. ``train_zero.py`` (all four stages); 3. ``train_zero.py`` again, where rank 1
    runs out of memory in its first backward while rank 0 waits for it in DDP's all-reduce. The driver
    joins the process group once and hands it to the scripts. The launch must then fail quickly, naming
    the cause, instead of leaving rank 0 waiting (for gloo's or NCCL's timeout, many minutes).
    Returns the results folder and the launch's error message.
    """
    tmp = tmp_path_factory.mktemp("ch7")
    with pytest.raises((RuntimeError, TimeoutError)) as failed:  # the launch must fail; how is checked below
        run_in_ranks(tmp, """
            import sys
            import torch
            import torch.distributed as dist
            from helpers import distributed, launching
            device = distributed.init_process_group()
            distributed.init_process_group = lambda: device  # the scripts join the group set up here
            dist.destroy_process_group = lambda *args, **kwargs: None  # and leave it when the launch ends
            sys.argv = ["ddp_grads.py", "--out", OUT + "/grads"]
            launching.load_script(SCRIPTS + "/ddp_grads.py").main()
            sys.argv = ["train_zero.py", "--out", OUT + "/zero", "--warmup", "0", "--steps", "1",
                        "--layers", "1", "--trace", OUT + "/traces"]
            zero = launching.load_script(SCRIPTS + "/train_zero.py")
            zero.main()

            wrap = zero.wrap
            def wrap_failing_on_rank_1(strategy, model, device, lr):
                model, optimizer, backward = wrap(strategy, model, device, lr)
                if dist.get_rank() == 1:
                    def backward(loss):
                        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
                return model, optimizer, backward
            zero.wrap = wrap_failing_on_rank_1
            sys.argv = ["train_zero.py", "--out", OUT + "/oom", "--warmup", "0", "--steps", "1", "--strategies", "ddp"]
            zero.main()
        """, timeout_s=120)
    return tmp, str(failed.value)


def test_ddp_grads_manual_allreduce_and_ddp_equal_the_whole_batch_gradient(chapter_runs):
    folder, message = chapter_runs
    assert (folder / "grads" / "grads_rank1.pt").exists(), message
    grads = launching.load_script(os.path.join(SCRIPTS, "ddp_grads.py"))
    ranks = [torch.load(folder / "grads" / f"grads_rank{r}.pt") for r in (0, 1)]
    model = grads.build("cpu")  # the whole batch in one process
    grads.lm_loss(model, grads.global_batch()).backward()
    whole = dict(grads.grads(model))
    for name, g in whole.items():
        local = [r["local"][name] for r in ranks]
        assert not torch.allclose(local[0], local[1])  # each rank alone saw a different half
        torch.testing.assert_close((local[0] + local[1]) / 2, g)  # the mean of the halves is the whole
        for r in ranks:
            torch.testing.assert_close(r["manual"][name], g)
            torch.testing.assert_close(r["ddp"][name], g)


def test_train_zero_shards_what_each_stage_promises(chapter_runs):
    folder, message = chapter_runs
    assert (folder / "zero" / "rank1.json").exists(), message
    df = launching.read_results(folder / "zero").set_index(["strategy", "rank"])
    assert (df["status"] == "ok").all() and df["model_freed"].all()
    full = df["n_params"].iloc[0] * 4 / 2**20  # fp32 parameters of the whole model, MiB
    by = df.groupby(level="strategy")
    sums, maxima = by.sum(numeric_only=True), by.max(numeric_only=True)
    assert maxima.loc["ddp", "params_mib"] == pytest.approx(full)
    assert maxima.loc["ddp", "optimizer_states_mib"] == pytest.approx(2 * full)
    assert sums.loc["zero1", "optimizer_states_mib"] == pytest.approx(2 * full)  # split over 2 ranks
    assert maxima.loc["zero1", "optimizer_states_mib"] < 1.5 * full
    for stage in ("zero2", "zero3"):
        assert sums.loc[stage, "params_mib"] == pytest.approx(full)  # each rank holds its half
        assert sums.loc[stage, "grads_mib"] == pytest.approx(full)
    assert maxima.loc["zero2", "gathered_params_mib"] == pytest.approx(full)  # kept from forward
    assert maxima.loc["zero3", "gathered_params_mib"] == 0


def test_train_zero_layers_step_times_and_a_trace_per_strategy(chapter_runs):
    from helpers import models, profiler

    folder, message = chapter_runs
    assert (folder / "zero" / "rank1.json").exists(), message
    df = launching.read_results(folder / "zero")
    one_layer = models.n_params(models.build("polyglot-ko-1.3b", profile="tiny", head="causal-lm", device="meta",
                                             num_hidden_layers=1))
    assert (df["n_params"] == one_layer).all() and (df["layers"] == 1).all()
    assert all(len(t) == 1 and t[0] > 0 for t in df["step_times_s"])  # --steps 1: one timed step each
    assert all(len(losses) == 1 for losses in df["losses"])  # the traced step is not among the losses
    traces = sorted(p.name for p in (folder / "traces").iterdir())
    assert traces == [f"{s}.json.gz" for s in ("ddp", "zero1", "zero2", "zero3")]  # rank 0 only, one each
    for name in traces:  # gloo on CPUs: no communication kernels, and the readers say so
        assert profiler.communication_from_trace(folder / "traces" / name).empty
        assert profiler.communication_overlap(folder / "traces" / name)["communication_s"] == 0


def test_out_of_memory_on_one_rank_of_train_zero_ends_every_rank(chapter_runs):
    _, message = chapter_runs
    assert "did not finish" not in message, "the other rank was left waiting"
    assert "rank 1: out of memory during ddp training: CUDA out of memory. Tried to allocate 20.00 GiB" in message


def test_exit_all_ranks_on_oom_lets_other_errors_through():
    with pytest.raises(ValueError, match="a bug"):
        with distributed.exit_all_ranks_on_oom("a test"):
            raise ValueError("a bug")
    with distributed.exit_all_ranks_on_oom("a test"):
        pass


@pytest.mark.parametrize("err", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                                 RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate`")])
def test_exit_all_ranks_on_oom_ends_the_rank_on_what_measure_calls_out_of_memory(monkeypatch, capsys, err):
    """The same predicate as batching's: cuBLAS failing to allocate its workspace is out of memory too."""
    def exit_now(code):
        raise SystemExit(code)

    monkeypatch.setattr(distributed.os, "_exit", exit_now)
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit) as done:
        with distributed.exit_all_ranks_on_oom("a test"):
            raise err
    assert done.value.code == distributed.OOM_EXIT_CODE
    assert capsys.readouterr().err.startswith("rank 1: out of memory during a test: ")
    with pytest.raises(RuntimeError, match="illegal memory access"):
        with distributed.exit_all_ranks_on_oom("a test"):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_init_process_group_on_cpu_is_gloo(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    calls = []
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append(backend))
    assert distributed.init_process_group() == torch.device("cpu") and calls == ["gloo"]


if sys.platform == "win32":  # pragma: no cover
    pytest.skip("torchrun needs a POSIX system here", allow_module_level=True)
