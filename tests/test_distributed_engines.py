"""The data-parallel engines of ``distributed.wrap_engine`` train exactly like one process (2 CPU processes, gloo).

One launch of 2 processes trains a small MLP for a few AdamW steps under every engine (DDP, ZeRO-1 with
``ZeroRedundancyOptimizer``, FSDP2's ``fully_shard`` as ZeRO-2 and ZeRO-3, and FSDP2 with the bf16
``MixedPrecisionPolicy``), each rank on its half of every global batch, and with gradient accumulation
(2 micro-batches per rank, one gradient reduction). This process trains the same model on the whole batches
alone, and the parameters must agree in fp32 to rounding; a rank training on its own half alone must not.
"""

import os
import sys
import textwrap

import pytest
import torch
from torch import nn

from helpers import distributed, launching

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, GLOBAL_BATCH, LR = 4, 8, 1e-2
FP32 = dict(rtol=1e-5, atol=1e-6)  # fp32: sums in another order differ by ~1e-7; a real error is ~1e-2 (the lr)

MODEL_CODE = '''
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x):
        return x + torch.nn.functional.gelu(self.fc(self.norm(x)))


class TinyNet(nn.Module):
    """An embedding, two residual blocks (FSDP's units) and a head: a transformer's layout, without attention."""

    def __init__(self, d_in=6, d=16, d_out=3):
        super().__init__()
        self.embed, self.blocks, self.head = nn.Linear(d_in, d), nn.ModuleList([Block(d), Block(d)]), nn.Linear(d, d_out)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(seed=0):
    torch.manual_seed(seed)
    return TinyNet()


def batches(steps, global_batch, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(global_batch, 6, generator=g), torch.randn(global_batch, 3, generator=g)) for _ in range(steps)]


def loss_fn(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)
'''

DRIVER = '''
import torch
import torch.distributed as dist
from helpers import distributed

device = distributed.init_process_group()
rank, n = dist.get_rank(), dist.get_world_size()
data = batches(STEPS, GLOBAL_BATCH)
share = GLOBAL_BATCH // n
results = {}


def train(engine, micro=1, optimizer_class=torch.optim.AdamW, seen=None):
    model = build()
    model, opt = distributed.wrap_engine(engine, model, device, lr=LR, units=list(model.blocks),
                                         optimizer_class=optimizer_class)
    if seen is not None:  # the dtype of the weight a block computes with, inside its forward
        fc = model.blocks[0].fc
        fc.register_forward_pre_hook(lambda mod, args: seen.append(str(mod.weight.dtype)))
    losses = []
    for x, y in data:
        xs, ys = x[rank * share:(rank + 1) * share].chunk(micro), y[rank * share:(rank + 1) * share].chunk(micro)
        for i, (xm, ym) in enumerate(zip(xs, ys)):
            with distributed.no_gradient_sync(model, sync=i == micro - 1):
                loss = loss_fn(model, xm, ym) / micro
                loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return distributed.full_parameters(model), losses


for engine in distributed.ENGINES:
    results[engine] = train(engine)
for engine in ("ddp", "zero3"):
    results[engine + " accumulating 2"] = train(engine, micro=2)
seen = []
results["fsdp2 sgd"] = train("fsdp2", optimizer_class=torch.optim.SGD, seen=seen)
results["fsdp2 dtypes"] = seen
if rank == 0:  # the control: one rank alone on its half of every batch, no communication
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for x, y in data:
        loss_fn(model, x[:share], y[:share]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    results["rank 0 alone"] = ({k: v.detach().clone() for k, v in model.named_parameters()}, [])
    torch.save(results, OUT + "/engines.pt")
dist.barrier()
dist.destroy_process_group()
'''

tiny: dict = {}
exec(compile(MODEL_CODE, "tiny_model", "exec"), tiny)  # build, batches, loss_fn: the code the ranks run


def reference(micro: int = 1, optimizer_class=torch.optim.AdamW) -> dict[str, torch.Tensor]:
    """One process, the whole global batch (in ``micro`` accumulated micro-batches), AdamW."""
    model = tiny["build"]()
    opt = optimizer_class(model.parameters(), lr=LR)
    for x, y in tiny["batches"](STEPS, GLOBAL_BATCH):
        for xm, ym in zip(x.chunk(micro), y.chunk(micro), strict=True):
            (tiny["loss_fn"](model, xm, ym) / micro).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.named_parameters()}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """The results of one launch of 2 gloo processes (a few seconds)."""
    tmp = tmp_path_factory.mktemp("engines")
    driver = tmp / "driver.py"
    header = f"STEPS, GLOBAL_BATCH, LR, OUT = {STEPS}, {GLOBAL_BATCH}, {LR}, {str(tmp)!r}\n"
    driver.write_text(MODEL_CODE + header + textwrap.dedent(DRIVER))
    env = launching.launch_env()
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    launching.run(launching.torchrun(driver, 2), env=env, timeout_s=180)
    return torch.load(tmp / "engines.pt")


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_single_process_accumulation_equals_the_large_batch():
    torch.testing.assert_close(reference(micro=2), reference(micro=1), **FP32)
    torch.testing.assert_close(reference(micro=4), reference(micro=1), **FP32)


@pytest.mark.parametrize("engine", ["ddp", "zero1", "zero2", "zero3"])
def test_fp32_engines_on_2_ranks_equal_one_process_on_the_whole_batch(ranks, engine):
    params, losses = ranks[engine]
    torch.testing.assert_close(params, reference(), **FP32)
    assert len(losses) == STEPS


@pytest.mark.parametrize("engine", ["ddp", "zero3"])
def test_accumulation_on_2_ranks_equals_the_large_batch(ranks, engine):
    params, _ = ranks[engine + " accumulating 2"]
    torch.testing.assert_close(params, reference(), **FP32)


def test_the_check_can_fail_one_rank_alone_differs(ranks):
    """Training on one half alone lands far outside the tolerance: the agreement above is not by construction."""
    params, _ = ranks["rank 0 alone"]
    assert max_diff(params, reference()) > 100 * FP32["atol"]
    init = dict(tiny["build"]().named_parameters())
    assert max_diff(reference(), {k: v.detach() for k, v in init.items()}) > 1e-3  # training moved the weights


def test_fsdp2_bf16_policy_computes_in_bf16_and_keeps_fp32_shards(ranks):
    """The policy gathers bf16 weights for compute; the shards (master weights) stay fp32. With SGD, whose
    update is proportional to the gradient, the bf16 run's updates are those of fp32 to bf16's ~1% (not to
    fp32's 1e-6): the policy really changed the arithmetic, and no more than bf16 rounding."""
    assert set(ranks["fsdp2 dtypes"]) == {"torch.bfloat16"} and len(ranks["fsdp2 dtypes"]) == STEPS
    params, losses = ranks["fsdp2 sgd"]
    assert all(p.dtype == torch.float32 for p in params.values())
    ref = reference(optimizer_class=torch.optim.SGD)
    init = {k: v.detach() for k, v in tiny["build"]().named_parameters()}
    moved = torch.cat([(ref[k] - init[k]).flatten() for k in ref])
    off = torch.cat([(params[k] - ref[k]).flatten() for k in ref])
    relative = (off.norm() / moved.norm()).item()
    assert 1e-4 < relative < 5e-2, relative
    _, fp32_losses = ranks["zero3"]
    assert abs(losses[0] - fp32_losses[0]) < 2e-2 * fp32_losses[0]  # the same first batch, bf16 compute


def test_wrap_engine_rejects_an_unknown_engine():
    with pytest.raises(ValueError, match="ddp, zero1, zero2, zero3, fsdp2"):
        distributed.wrap_engine("zero4", nn.Linear(2, 2), torch.device("cpu"))


def test_bf16_policy_and_blocks():
    policy = distributed.bf16_policy()
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32
    assert distributed.transformer_blocks(nn.Linear(2, 2)) == []


if sys.platform == "win32":  # pragma: no cover
    pytest.skip("torchrun needs a POSIX system here", allow_module_level=True)
