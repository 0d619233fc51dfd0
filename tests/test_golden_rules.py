"""CPU tests that pin what the code review's mutation test found unpinned (review 2026-11-27, section 4.3).

- the allocator reader's MiB conversion, with CUDA's counters faked (it ran only on a GPU before);
- the boundaries: ``cleanup.back_at_baseline``'s tolerance, ``timing.verdict`` at its thresholds (this also
  documents the cliff at 0.8), ``timing.ratio_verdict`` at the practical threshold;
- ``timing.Spread`` and ``Comparison.speedup`` on skewed samples, where a mean and a median differ;
- every ``estimates.BYTES_PER_PARAM`` recipe from what it keeps, in bytes of torch's dtypes;
- the planner's every-k checkpoint choice, 16-bit optimizer states and ZeRO-3's gathered block, against
  counts of a model the planner did not build (``plan.measure`` on a CPU, a meta-device model).

``scripts/mutants.py`` plants one bug at a time and checks that these tests (with the rest) catch it.
"""

from __future__ import annotations

import statistics

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import cleanup, estimates, measure, models, plan, timing

MIB = 2**20


# --------------------------------------------------------------------------------------------------------
# measure.allocator_mib: the unit, on a CPU


def test_allocator_reader_converts_bytes_to_mib(monkeypatch):
    """CUDA's counters faked at 4, 6 and 8 MiB: the reader must say 4.0, 6.0 and 8.0."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 4 * MIB)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 6 * MIB)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 8 * MIB)
    assert measure.allocator_mib() == {"allocated_mib": 4.0, "reserved_mib": 6.0, "peak_allocated_mib": 8.0}
    assert measure.allocator_mib(0) == measure.allocator_mib("cuda:0")


# --------------------------------------------------------------------------------------------------------
# cleanup.back_at_baseline: the tolerance's boundary


def _fake_cuda(monkeypatch, end_mib: float, held_mib: float = 100.0) -> None:
    readings = iter([held_mib, end_mib])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(measure, "allocator_mib", lambda device=None: dict.fromkeys(
        ("allocated_mib", "reserved_mib", "peak_allocated_mib"), next(readings)))
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: None, raising=False)
    monkeypatch.setattr(cleanup, "collect", lambda: None)


@pytest.mark.parametrize("baseline, tolerance, end, leak", [
    (0.0, None, 0.01, False),      # the default tolerance (0.01 MiB): exactly at it passes
    (0.0, None, 0.0101, True),     # just above it is a leak
    (65.0, None, 65.0, False),
    (65.0, None, 65.02, True),     # a 20 KiB tensor left behind is caught
    (2.0, 1.0, 3.0, False),        # an explicit tolerance moves the boundary
    (2.0, 1.0, 3.001, True),
])
def test_back_at_baseline_tolerance_boundary(monkeypatch, baseline, tolerance, end, leak):
    _fake_cuda(monkeypatch, end)
    kwargs = {} if tolerance is None else {"tolerance_mib": tolerance}
    if leak:
        with pytest.raises((AssertionError, RuntimeError), match="MiB still allocated"):
            cleanup.back_at_baseline(baseline, **kwargs)
    else:
        assert cleanup.back_at_baseline(baseline, **kwargs)["allocated at the end (MiB)"] == end


# --------------------------------------------------------------------------------------------------------
# timing: thresholds and medians

EPS = 1e-9


def test_the_printed_thresholds():
    """The chapters' prose names these numbers (90% busy for GPU-bound, below 70% for host-bound, 3% practical)."""
    assert timing.GPU_BOUND_BUSY == 0.9 and timing.HOST_LIMITED_BUSY == 0.7 and timing.HOST_BOUND_BUSY == 0.5
    assert timing.PRACTICAL_THRESHOLD == 0.03


@pytest.mark.parametrize("busy, host, word", [
    (0.9, 1.0, "GPU-bound"),               # a call that synchronises inside itself (host ~ 1)
    (0.9 - EPS, 1.0, "mixed"),             # below 0.9 it is not GPU-bound, but not host-bound either:
    (0.7, 1.0, "mixed"),                   # the 70-90% band is "mixed", so a few points never jump two words
    (0.7 - EPS, 1.0, "host-bound"),        # below 70%, with a host that issued longer than the GPU ran
    (0.8, 0.0, "mixed"),
    (0.5, 0.4, "mixed"),                   # HOST_BOUND_BUSY: at 0.5 not "idle" ...
    (0.5 - EPS, 0.4, "GPU idle, host waiting"),  # ... below it, with a host that issued little, idle
    (0.3, 0.5, "host-bound"),              # issuing took half the wall time and longer than the GPU ran
    (0.3, 0.5 - EPS, "GPU idle, host waiting"),
    (0.6, 0.6, "mixed"),                   # host-bound needs host > busy
    (0.6, 0.6 + EPS, "host-bound"),
])
def test_verdict_at_its_boundaries(busy, host, word):
    assert timing.verdict(busy, host) == word


def test_spread_of_skewed_samples_is_the_median():
    """Four 10 ms calls and one 50 ms outlier: the median is 10 ms (a mean would say 18 ms)."""
    s = timing.Spread.of((0.010, 0.010, 0.050, 0.010, 0.010))
    assert s.median == pytest.approx(0.010)
    assert (s.q1, s.q3, s.min, s.max) == pytest.approx((0.010, 0.010, 0.010, 0.050))
    assert s.iqr == pytest.approx(0.0)
    assert timing.Spread.of((0.010, 0.010, 0.010, 0.050)).median == pytest.approx(0.010)


def _timed(walls):
    return timing.Timed(wall_s=tuple(walls), host_s=tuple(walls), gpu_s=None, gpu_busy=None, kernels_per_call=None,
                        device="cpu")


def test_comparison_speedup_is_the_median_round_with_an_order_statistic_interval():
    ratios = (1.0,) * 9 + (3.0,) * 2 + (0.98, 0.99, 1.01, 1.02)  # 15 rounds, two disturbed ones
    c = timing.Comparison("a", "b", _timed([1.0] * 15), _timed([1.0] * 15), ratios, None)
    assert c.speedup == 1.0 and statistics.mean(ratios) > 1.2
    assert (c.lo, c.hi) == timing.median_interval(ratios) == (1.0, 1.01)  # the 4th and 12th smallest of 15
    assert c.verdict == timing.NO_DIFFERENCE


@pytest.mark.parametrize("lo, hi, word", [
    (1.03, 1.03, "faster"), (1.03 - EPS, 2.0, timing.NO_DIFFERENCE),
    (1 / 1.03, 1 / 1.03, "slower"), (0.5, 1 / 1.03 + EPS, timing.NO_DIFFERENCE)])
def test_ratio_verdict_at_the_practical_threshold(lo, hi, word):
    assert timing.ratio_verdict(lo, hi) == word


# --------------------------------------------------------------------------------------------------------
# estimates.BYTES_PER_PARAM: every recipe from what it keeps

F32, HALF = torch.float32.itemsize, torch.bfloat16.itemsize
KEEPS = {  # recipe: (weight copies, gradient copies, optimizer-state tensors), element sizes in bytes
    "fp32_adamw": ([F32], [F32], [F32, F32]),                  # AdamW: exp_avg and exp_avg_sq
    "mixed_adamw": ([F32, HALF], [F32], [F32, F32]),           # fp32 master + 16-bit copy (HF docs' count)
    "fp16_adamw": ([HALF], [HALF], [HALF, HALF]),              # the LLM book: everything in fp16
    "fp32_sgd_momentum": ([F32], [F32], [F32]),                # one momentum buffer
    "mixed_inference": ([F32, HALF], [], []),
    "fp32_inference": ([F32], [], []),
    "half_inference": ([HALF], [], []),
}


def test_every_bytes_per_param_recipe_has_a_rule_here():
    assert set(estimates.BYTES_PER_PARAM) == set(KEEPS)


@pytest.mark.parametrize("recipe", sorted(KEEPS))
def test_bytes_per_param_recipe_from_what_it_keeps(recipe):
    w, g, o = KEEPS[recipe]
    assert estimates.BYTES_PER_PARAM[recipe] == {"weights": sum(w), "gradients": sum(g), "optimizer_states": sum(o)}
    assert estimates.model_state_bytes(1000, recipe) == {k: 1000 * v for k, v in estimates.BYTES_PER_PARAM[recipe].items()}


@pytest.mark.parametrize("recipe, dtype, make", [
    ("fp16_adamw", torch.float16, lambda p: torch.optim.AdamW(p, foreach=False)),
    ("fp32_sgd_momentum", torch.float32, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
])
def test_bytes_per_param_recipe_against_a_real_step(recipe, dtype, make):
    from helpers import accounting

    model = nn.Linear(16, 8).to(dtype)
    opt = make(model.parameters())
    model(torch.ones(2, 16, dtype=dtype)).float().sum().backward()
    opt.step()
    n = sum(p.numel() for p in model.parameters())
    assert accounting.model_state_bytes(model, opt) == estimates.model_state_bytes(n, recipe)


# --------------------------------------------------------------------------------------------------------
# plan: the every-k choice, 16-bit optimizer states, ZeRO-3's gathered block


def test_every_k_checkpointing_keeps_the_blocks_the_model_keeps():
    """A 3-block BERT checkpointed every 2nd block (blocks 0 and 2, the chapter-4 convention: layers 0, k,
    2k, ...): the saved bytes plan.measure counts on a CPU move from the fully checkpointed run by exactly
    what the planner predicts. With 3 blocks the choice shows: blocks 1 only would be one block fewer."""
    cfg = models.config("bert-large-uncased", "tiny")
    cfg.num_hidden_layers = 3
    s = plan.Setup(model=cfg, batch=1, seq=8, precision="fp32", optimizer="sgd", attention="eager",
                   profile="tiny", checkpointing=2)
    full = s.replace(checkpointing="full")
    measured = plan.measure(s, device="cpu", steps=1)["accounted_bytes"]["activations"]
    measured_full = plan.measure(full, device="cpu", steps=1)["accounted_bytes"]["activations"]
    predicted = plan.predict(s, backend="cpu").totals["activations"]
    predicted_full = plan.predict(full, backend="cpu").totals["activations"]
    assert measured - measured_full == predicted - predicted_full > 0


@pytest.mark.parametrize("precision, optimizer", [("bf16", "adamw"), ("fp16", "sgd-momentum")])
def test_16_bit_optimizer_states_match_a_cpu_run(precision, optimizer):
    """With 16-bit weights AdamW's states are 16-bit too (2 x 2 bytes per parameter, not 2 x 4)."""
    s = plan.Setup(model="gpt-neox-1.3b", batch=1, seq=8, precision=precision, optimizer=optimizer, profile="tiny")
    acc = plan.measure(s, device="cpu", steps=1)["accounted_bytes"]
    n = plan.shape(s).n_params
    assert acc["weights"] == plan.weight_bytes(s) == 2 * n
    assert acc["gradients"] == plan.gradient_bytes(s) == 2 * n
    assert acc["optimizer_states"] == plan.optimizer_state_bytes(s) == {"adamw": 4, "sgd-momentum": 2}[optimizer] * n


def test_zero3_forward_holds_one_gathered_block():
    """ZeRO-3 gathers one block's weights at a time: the forward pass holds the rank's shard plus one block's
    matrices (counted here on a meta-device model, not through the planner's shape)."""
    s = plan.Setup(model="gpt-neox-1.3b", batch=4, seq=256, precision="fp32", optimizer="adamw",
                   zero_stage=3, world_size=2)
    p = plan.predict(s)
    extra = p.phase_components["forward"]["weights"] - p.phase_components["optimizer step"]["weights"]
    model = models.build("polyglot-ko-1.3b", profile="full", head="causal-lm", device="meta")
    block = model.gpt_neox.layers[0]
    matrices = sum(m.weight.numel() for m in block.modules() if isinstance(m, nn.Linear))
    everything = sum(t.numel() for t in block.parameters())
    assert 4 * matrices <= extra <= 4 * everything
    assert p.phase_components["optimizer step"]["weights"] == plan.weight_bytes(s) // 2
    no_zero = plan.predict(s.replace(zero_stage=0, world_size=1))
    assert no_zero.phase_components["forward"]["weights"] == no_zero.phase_components["optimizer step"]["weights"]


class _ParameterCasts(TorchDispatchMode):
    """Bytes of the 16-bit copies autocast makes of each parameter during a forward pass (once per parameter)."""

    def __init__(self, params):
        super().__init__()
        self.params = {p.data_ptr() for p in params}
        self.copies: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        src = args[0] if args else None
        if func is torch.ops.aten._to_copy.default and isinstance(src, torch.Tensor) \
                and src.data_ptr() in self.params and out.dtype == torch.bfloat16:
            self.copies[src.data_ptr()] = out.numel() * out.element_size()
        return out


def test_autocast_copies_of_a_lora_model_are_what_autocast_casts():
    """LoRA's fp32 adapters on a bf16 base are cast to 16 bits under autocast, like every fp32 weight that
    requires grad (chapter 1, section 1.3): the planner's copy bytes against the casts a CPU forward pass makes.
    (On an fp32 base autocast also casts the linears' biases, which the planner leaves out: a few KiB.)"""
    from peft import LoraConfig, get_peft_model

    targets = ("query_key_value", "dense")
    s = plan.Setup(model="gpt-neox-1.3b", batch=1, seq=8, precision="bf16", optimizer="adamw", profile="tiny",
                   lora_rank=4, lora_targets=targets)
    model = models.build("polyglot-ko-1.3b", profile="tiny", head="causal-lm", dtype=torch.bfloat16)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=16, lora_dropout=0.0, target_modules=list(targets),
                                             task_type="CAUSAL_LM"))
    ids = torch.randint(0, 100, (1, 8))
    with _ParameterCasts(model.parameters()) as casts, torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=ids, labels=ids)
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert adapters == plan.lora_trainable_params(s)
    assert sum(casts.copies.values()) == plan.autocast_copy_bytes(s) == 2 * adapters
