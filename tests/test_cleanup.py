import gc
import weakref

import pytest
import torch

from helpers import cleanup, measure


def test_free_releases_the_objects_it_is_given():
    ns = {"model": torch.nn.Linear(100, 100), "keep": 1}
    ref = weakref.ref(ns["model"])
    freed = cleanup.free(ns, "model")
    assert ref() is None
    assert freed.names == ("model",) and freed.still_alive == ()
    assert "model" not in ns and ns["keep"] == 1


def test_free_also_clears_output_history_without_a_shell():
    obj = torch.nn.Linear(10, 10)
    ns = {"m": obj, "Out": {3: obj, 4: "other"}, "_": obj, "_3": obj}
    ref = weakref.ref(obj)
    del obj
    cleanup.free(ns, "m")
    gc.collect()
    assert ref() is None
    assert ns["Out"] == {4: "other"} and "_3" not in ns


@pytest.fixture
def shell():
    from IPython.core.interactiveshell import InteractiveShell

    sh = InteractiveShell.instance()
    yield sh
    InteractiveShell.clear_instance()


def test_free_clears_every_reference_ipython_keeps_to_a_displayed_object(shell):
    """A cell that ends with ``model`` displays it: IPython then holds it in Out, _, _N and its history."""
    shell.run_cell("import torch\nmodel = torch.nn.Linear(10, 10)")
    shell.run_cell("model")  # displayed: now also Out[2], _2, _ and the output history
    ref = weakref.ref(shell.user_ns["model"])
    freed = cleanup.free(shell.user_ns, "model")
    assert ref() is None, "a reference in IPython's output cache kept the model alive"
    assert freed.still_alive == ()
    assert "model" not in shell.user_ns


def test_free_leaves_other_names_of_the_same_object_alone(shell):
    """Freeing ``model_run`` must not delete ``model_acc`` when both name one model (chapter 3 relies on it)."""
    shell.run_cell("import torch\nmodel_acc = torch.nn.Linear(10, 10)\nmodel_run = model_acc")
    shell.run_cell("model_run")  # displayed as well
    freed = cleanup.free(shell.user_ns, "model_run")
    assert "model_acc" in shell.user_ns and "model_run" not in shell.user_ns
    assert freed.still_alive == ("model_run",)  # still held, by model_acc: reported, not hidden
    assert all(v is not shell.user_ns["model_acc"] for v in shell.history_manager.output_hist.values())


def test_free_reports_what_it_could_not_free():
    model = torch.nn.Linear(10, 10)
    ns = {"model": model, "n": 3}
    freed = cleanup.free(ns, "model", "n")
    assert freed.names == ("model", "n")
    assert freed.still_alive == ("model",)  # the local variable above still holds it; ints are not checked
    del model


def test_free_ignores_missing_names_and_rejects_objects():
    assert cleanup.free({}, "nothing").names == ()
    with pytest.raises(TypeError, match="names as strings"):
        cleanup.free({}, torch.ones(1))


def test_free_reads_memory_through_the_one_allocator_reader(monkeypatch):
    readings = iter([{"allocated_mib": 300.0, "reserved_mib": 512.0, "peak_allocated_mib": 300.0},
                     {"allocated_mib": 44.0, "reserved_mib": 64.0, "peak_allocated_mib": 300.0}])
    monkeypatch.setattr(measure, "allocator_mib", lambda device=None: next(readings))
    freed = cleanup.free({"x": 1}, "x")
    assert (freed.allocated_freed_mib, freed.reserved_freed_mib) == (256.0, 448.0)


@pytest.mark.gpu
def test_free_gives_cuda_memory_back():
    ns = {"x": torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")}
    freed = cleanup.free(ns, "x")
    assert freed.allocated_freed_mib == pytest.approx(256.0)
    assert freed.reserved_freed_mib >= 256.0


def _fake_cuda(monkeypatch, readings_mib):
    """CUDA 'in use' with allocated-memory readings (MiB) taken in order, through the one allocator reader;
    the workspace release is recorded."""
    readings = iter({"allocated_mib": r, "reserved_mib": r, "peak_allocated_mib": r} for r in readings_mib)
    released = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(measure, "allocator_mib", lambda device=None: next(readings))
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: released.append(True), raising=False)
    monkeypatch.setattr(cleanup, "collect", lambda: None)
    return released


def test_back_at_baseline_releases_the_workspaces_and_reports_the_three_numbers(monkeypatch):
    released = _fake_cuda(monkeypatch, [65.0, 2.0])
    rows = cleanup.back_at_baseline(2.0)
    assert released == [True]
    assert list(rows.values()) == [65.0, 2.0, 2.0]
    assert list(rows) == ["allocated before clearing the cuBLAS workspaces (MiB)", "allocated at the end (MiB)",
                          "allocated at the start (MiB)"]


def test_back_at_baseline_names_a_leak_in_mib(monkeypatch):
    _fake_cuda(monkeypatch, [70.0, 7.0])
    with pytest.raises(cleanup.LeakError, match=r"5\.00 MiB still allocated") as caught:
        cleanup.back_at_baseline(2.0)
    assert isinstance(caught.value, AssertionError)  # a chapter's leak check is an assertion


@pytest.mark.parametrize(("end_mib", "tolerance_mib", "leaks"), [
    (2.0 + 0.01, 0.01, False),  # exactly at the tolerance: passes
    (2.0 + 0.02, 0.01, True),  # 20 KiB over the start: a leak with the default tolerance
    (2.0 + 0.5, 0.01, True),
    (2.25, 0.25, False),
    (2.25 + 2**-10, 0.25, True),  # 1 KiB past a wider tolerance
])
def test_back_at_baseline_tolerance_boundary(monkeypatch, end_mib, tolerance_mib, leaks):
    _fake_cuda(monkeypatch, [60.0, end_mib])
    if leaks:
        with pytest.raises(cleanup.LeakError):
            cleanup.back_at_baseline(2.0, tolerance_mib)
    else:
        assert cleanup.back_at_baseline(2.0, tolerance_mib)["allocated at the end (MiB)"] == end_mib


def test_back_at_baseline_raises_under_python_optimisations():
    """The check is a raise, not an ``assert`` statement, so ``python -O`` keeps it."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(cleanup.back_at_baseline).lstrip())
    assert not any(isinstance(node, ast.Assert) for node in ast.walk(tree))


def test_baseline_releases_the_workspaces_before_reading_and_is_accepted_as_the_start(monkeypatch):
    """A workspace made before the start (32 MiB here) is not in the baseline, so a 20 MiB leak is caught:
    with a bare reading taken before releasing it (52 MiB), the same end would pass."""
    released = _fake_cuda(monkeypatch, [20.0, 72.0, 40.0, 60.0, 20.0])
    read = measure.allocator_mib
    released_when_read = []
    monkeypatch.setattr(measure, "allocator_mib", lambda device=None: released_when_read.append(bool(released)) or read())
    start = cleanup.baseline()
    assert released_when_read == [True] and start == cleanup.Baseline(20.0)  # released, then read
    with pytest.raises(cleanup.LeakError, match=r"20\.00 MiB still allocated"):
        start.check()
    assert cleanup.back_at_baseline(start)["allocated at the start (MiB)"] == 20.0


def test_baseline_on_a_cpu_is_nan_and_back_at_baseline_refuses_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    start = cleanup.baseline()
    assert start.allocated_mib != start.allocated_mib  # NaN
    with pytest.raises(ValueError, match="read on a GPU"):
        cleanup.back_at_baseline(start)


def test_back_at_baseline_refuses_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="CUDA is not in use"):
        cleanup.back_at_baseline(0.0)


@pytest.mark.gpu
def test_back_at_baseline_on_a_gpu_catches_a_held_tensor_and_passes_once_it_is_freed():
    torch.ones(8, 8, device="cuda") @ torch.ones(8, 8, device="cuda")  # a matrix product: a cuBLAS workspace
    torch._C._cuda_clearCublasWorkspaces()
    cleanup.collect()
    start = torch.cuda.memory_allocated() / 2**20
    x = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
    with pytest.raises(AssertionError, match=r"64\.00 MiB still allocated"):
        cleanup.back_at_baseline(start)
    del x
    rows = cleanup.back_at_baseline(start)
    assert rows["allocated at the end (MiB)"] <= start + 0.01


@pytest.mark.gpu
def test_baseline_on_a_gpu_leaves_out_the_workspaces_so_a_leak_of_their_size_is_caught():
    torch.ones(64, 64, device="cuda") @ torch.ones(64, 64, device="cuda")  # a cuBLAS workspace before the start
    start = cleanup.baseline()
    x = torch.empty(2 * 2**20, dtype=torch.uint8, device="cuda")  # a 2 MiB leak, smaller than the workspace
    torch.ones(64, 64, device="cuda") @ torch.ones(64, 64, device="cuda")
    with pytest.raises(cleanup.LeakError, match=r"2\.00 MiB still allocated"):
        cleanup.back_at_baseline(start)
    del x
    assert cleanup.back_at_baseline(start)["allocated at the end (MiB)"] <= start.allocated_mib + 0.01
