import gc
import weakref

import pytest
import torch

from helpers import cleanup


def test_free_releases_the_objects_it_is_given():
    ns = {"model": torch.nn.Linear(100, 100), "keep": 1}
    ref = weakref.ref(ns["model"])
    freed = cleanup.free(ns, "model")
    assert ref() is None
    assert freed.names == ("model",)
    assert "model" not in ns and ns["keep"] == 1


def test_free_also_clears_ipython_output_history():
    obj = torch.nn.Linear(10, 10)
    ns = {"m": obj, "Out": {3: obj, 4: "other"}, "_": obj}
    ref = weakref.ref(obj)
    del obj
    cleanup.free(ns, "m")
    gc.collect()
    assert ref() is None
    assert ns["Out"] == {4: "other"}


def test_free_ignores_missing_names_and_rejects_objects():
    assert cleanup.free({}, "nothing").names == ()
    with pytest.raises(TypeError, match="names as strings"):
        cleanup.free({}, torch.ones(1))


@pytest.mark.gpu
def test_free_gives_cuda_memory_back():
    ns = {"x": torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")}
    freed = cleanup.free(ns, "x")
    assert freed.allocated_freed_mib == pytest.approx(256.0)
    assert freed.reserved_freed_mib >= 256.0
