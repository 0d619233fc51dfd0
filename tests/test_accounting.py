from types import SimpleNamespace

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


# --- the meter is a pure observer, whatever other saved-tensor hooks are active ----------------------


def recording_hooks(log):
    """An outer saved-tensor hook pair like save_on_cpu's: it stores its own copy and logs each call."""

    def pack(t):
        log.append("pack")
        return ("moved", t.detach().clone())

    def unpack(packed):
        log.append("unpack")
        return packed[1]

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def test_meter_inside_another_hook_hands_every_tensor_on():
    """Nested inside save_on_cpu (or any hook), the meter must not switch that hook off."""
    model = mlp()
    x = torch.randn(4, 32)
    model(x).sum().backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    log = []
    with recording_hooks(log), accounting.SavedTensorMeter(model) as meter:
        loss = model(x).sum()
    n_packed = log.count("pack")
    assert n_packed == meter.n_saved > 0  # the outer hook packed every saved tensor
    assert meter.total_bytes == 4 * 32 * 4 + 4 * 64 * 4  # and the meter still counted them
    loss.backward()
    assert log.count("unpack") > 0
    for p, g in zip(model.parameters(), ref, strict=True):
        assert torch.equal(p.grad, g)


def test_kept_bytes_follow_what_the_outer_hook_stores():
    model = mlp()
    with accounting.SavedTensorMeter(model) as plain:
        model(torch.randn(4, 32)).sum()
    assert plain.kept_bytes("cpu") == plain.kept_bytes() == plain.total_bytes

    def pack_to_host_bytes(t):  # stores no tensor at all (like writing to disk)
        return t.detach().numpy().tobytes(), t.shape, t.dtype

    def unpack(packed):
        data, shape, dtype = packed
        return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)

    with torch.autograd.graph.saved_tensors_hooks(pack_to_host_bytes, unpack), \
            accounting.SavedTensorMeter(model) as offloaded:
        model(torch.randn(4, 32)).sum().backward()
    assert offloaded.total_bytes == plain.total_bytes
    assert offloaded.kept_bytes() == 0


def test_meter_refuses_a_hook_entered_inside_it():
    """A hook pushed inside the meter would hide every saved tensor from it: refuse, do not report 0."""
    model = mlp()
    with pytest.raises(RuntimeError, match="innermost saved-tensor hook"):
        with accounting.SavedTensorMeter(model), torch.autograd.graph.save_on_cpu():
            model(torch.randn(4, 32))


def test_meter_allows_gradient_checkpointing_inside_it():
    """A checkpointed region stores nothing for backward; the meter counts only what is kept outside it."""
    from torch.utils.checkpoint import checkpoint

    model = mlp()
    x = torch.randn(4, 32, requires_grad=True)
    with accounting.SavedTensorMeter(model) as meter:
        out = checkpoint(model, x, use_reentrant=False)
    out.sum().backward()
    with accounting.SavedTensorMeter(model) as plain:
        model(x)
    assert meter.total_bytes < plain.total_bytes


# --- one rank's bytes: sharded tensors and wrapped optimizers ----------------------------------------


class HalfShard(torch.Tensor):
    """Stands in for a DTensor sharded over 2 ranks: ``to_local()`` is this rank's half."""

    def to_local(self):
        return torch.Tensor(self)[: self.shape[0] // 2]


def test_sharded_tensors_count_by_their_local_shard():
    t = torch.zeros(8, 4).as_subclass(HalfShard)
    assert accounting.tensor_bytes(t) == 4 * 4 * 4
    assert accounting.local_tensor(torch.zeros(3)).numel() == 3


def test_model_states_of_an_unsharded_model_and_a_wrapped_optimizer():
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    adamw = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 8)).sum().backward()
    adamw.step()
    direct = accounting.model_state_bytes(model, adamw)
    assert direct["optimizer_states"] == 2 * direct["weights"]
    assert accounting.model_state_bytes(model, SimpleNamespace(optimizer=adamw)) == direct  # like accelerate's
    assert accounting.model_state_bytes(model, SimpleNamespace(optim=adamw)) == direct  # like ZeroRedundancyOptimizer
    assert accounting.unsharded_param_bytes(model) == accounting.param_bytes(model)


def test_inner_optimizer_unwraps_wrappers():
    adamw = torch.optim.AdamW(nn.Linear(2, 2).parameters())
    assert accounting.inner_optimizer(adamw) is adamw
    assert accounting.inner_optimizer(SimpleNamespace(optimizer=adamw)) is adamw
    assert accounting.inner_optimizer(SimpleNamespace(optim=adamw)) is adamw


@pytest.mark.gpu
def test_meter_inside_save_on_cpu_keeps_nothing_on_the_gpu():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512)).cuda()
    x = torch.randn(64, 512, device="cuda")
    with accounting.SavedTensorMeter(model) as plain:
        model(x)
    with torch.autograd.graph.save_on_cpu(pin_memory=True), accounting.SavedTensorMeter(model) as offloaded:
        out = model(x)
    assert plain.kept_bytes("cuda") == plain.total_bytes > 0
    assert offloaded.total_bytes == plain.total_bytes
    assert offloaded.kept_bytes("cuda") == 0 and offloaded.kept_bytes("cpu") >= plain.total_bytes
    out.sum().backward()


@pytest.mark.gpu
def test_meter_agrees_with_korthikanti_on_a_bert_layer():
    """On CUDA, bf16, eager attention, dropout on: a BERT layer saves 34sbh + 5as^2b bytes (within 2%)."""
    from helpers import data, estimates, models

    model = models.build("bert-large-uncased", profile="tiny", head="sequence-classification", device="cuda",
                         dtype=torch.bfloat16, attn_implementation="eager").train()
    h, a = model.config.hidden_size, model.config.num_attention_heads
    for b, s in [(4, 128), (2, 256)]:
        batch = {k: v.cuda() for k, v in data.dummy_dataset(b, s, seed=1)[:].items()}
        layers = {f"layer {i}": layer for i, layer in enumerate(model.bert.encoder.layer)}
        with accounting.SavedTensorMeter(model, group=layers) as meter:
            model(**batch)
        assert meter.bytes_by_group["layer 1"] == pytest.approx(estimates.korthikanti_activation_bytes(s, b, h, a), rel=0.02)
