import pytest
import torch
from torch import nn

from helpers import accounting


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))


def test_param_and_grad_bytes():
    model = mlp()
    n = sum(p.numel() for p in model.parameters())
    assert accounting.param_bytes(model) == 4 * n
    assert accounting.grad_bytes(model) == 0
    model(torch.randn(4, 32)).sum().backward()
    assert accounting.grad_bytes(model) == 4 * n
    model.half()
    assert accounting.param_bytes(model) == 2 * n


def test_frozen_parameters_are_excluded_when_asked():
    model = mlp()
    model[0].weight.requires_grad_(False)
    assert accounting.param_bytes(model, trainable_only=True) == accounting.param_bytes(model) - 4 * 32 * 64


def test_adamw_state_is_two_fp32_copies_of_the_parameters():
    model = mlp()
    opt = torch.optim.AdamW(model.parameters())
    assert accounting.optimizer_state_bytes(opt) == 0  # lazily created
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    assert accounting.optimizer_state_bytes(opt) == 2 * accounting.param_bytes(model)
    # the per-parameter step counters are scalars, only counted on request
    n_tensors = len(list(model.parameters()))
    extra = accounting.optimizer_state_bytes(opt, include_scalars=True) - accounting.optimizer_state_bytes(opt)
    assert extra == 4 * n_tensors


def test_sgd_momentum_state_is_one_copy():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    assert accounting.optimizer_state_bytes(opt) == accounting.param_bytes(model)


def test_saved_tensors_of_a_linear_layer_exclude_its_weight():
    lin = nn.Linear(16, 16, bias=False)
    x = torch.randn(8, 16, requires_grad=True)
    with accounting.SavedTensorMeter(lin) as meter:
        lin(x).sum()
    # F.linear saves its input (8x16 fp32) and its weight; the weight is a parameter, not counted
    assert meter.total_bytes == 8 * 16 * 4
    assert meter.n_saved >= 2


def test_saved_tensor_counted_once_when_saved_twice():
    x = torch.randn(100, requires_grad=True)
    with accounting.SavedTensorMeter() as meter:
        y = x.exp()  # saves its output y
        (y * y).sum()  # saves y twice more
    assert meter.total_bytes == 100 * 4


def test_no_grad_saves_nothing():
    model = mlp()
    with accounting.SavedTensorMeter(model) as meter, torch.no_grad():
        model(torch.randn(4, 32))
    assert meter.total_bytes == 0


def test_bytes_are_attributed_to_groups():
    model = mlp()
    x = torch.randn(4, 32)
    with accounting.SavedTensorMeter(model, group={"first": model[0], "last": model[2]}) as meter:
        model(x).sum()
    # Linear(32->64) saves its input x (4x32 fp32) for its weight gradient; ReLU, outside the groups,
    # saves its output (4x64); Linear(64->8) saves that same storage again, so it adds nothing.
    assert meter.bytes_by_group["first"] == 4 * 32 * 4
    assert meter.bytes_by_group["other"] == 4 * 64 * 4
    assert meter.bytes_by_group.get("last", 0) == 0
    assert meter.total_bytes == 4 * 32 * 4 + 4 * 64 * 4


def test_saved_tensor_meter_matches_what_backward_needs():
    """The meter observes only: gradients are unchanged by it."""
    model = mlp()
    x = torch.randn(4, 32)
    model(x).sum().backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with accounting.SavedTensorMeter(model):
        loss = model(x).sum()
    loss.backward()
    for p, g in zip(model.parameters(), ref, strict=True):
        assert torch.equal(p.grad, g)


def test_forward_without_backward_under_the_meter_frees_everything():
    """A graph built under the meter and dropped without backward must be freed (no ref cycle)."""
    import weakref

    x = torch.randn(1000, requires_grad=True)
    with accounting.SavedTensorMeter():
        y = x.exp()  # exp saves its own output: the case that would form a cycle
        z = y.sin()
    ref = weakref.ref(y)
    del y, z
    assert ref() is None


@pytest.mark.gpu
def test_saved_bytes_agree_with_the_allocator():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512)) for _ in range(4)]).cuda()
    x = torch.randn(64, 512, device="cuda")
    with torch.no_grad():
        model(x)  # warm-up: cuBLAS takes its workspace from the allocator on the first matmul
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with accounting.SavedTensorMeter(model) as meter:
        out = model(x)
    after = torch.cuda.memory_allocated()
    # the forward left allocated: the saved activations and the output; the meter also counts the
    # input x (saved by the first layer), which was allocated before the measurement started
    held = after - before - out.numel() * out.element_size()
    assert held + x.numel() * x.element_size() == pytest.approx(meter.total_bytes, rel=0.01)
    del out
