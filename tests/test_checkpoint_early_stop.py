"""Chapter 4, section 4.3 ("The price"): what checkpointing's recomputation redoes, counted on a CPU.

PyTorch's non-reentrant checkpoint stops recomputing a layer once every tensor the layer saved for backward is
rebuilt (``torch.utils.checkpoint``'s early stop, on by default), and an operation saves its inputs before it runs.
A GPT-NeoX layer with a parallel residual ends with the MLP's output product, which saves only its input, so that
product is not recomputed: the recomputation redoes ``1 - 2Ih / (8h^2 + 4Ih + 4sh)`` of the layer's forward
matrix-product FLOPs (two thirds at the 1.3B model's sizes). A BERT layer ends in a LayerNorm, which also saves two
of its outputs, so all of it runs again. The chapter's prose states both; this test holds them to the installed
torch and transformers (a change of either layer's order, or of the early stop, fails it).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import set_checkpoint_early_stop

from helpers import run_profile, steps

aten = torch.ops.aten


class MatmulFlops(TorchDispatchMode):
    """Adds up the FLOPs of every mm, addmm and bmm while ``on``."""

    def __init__(self) -> None:
        super().__init__()
        self.flops, self.on = 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.on:
            if func is aten.mm.default:
                self.flops += 2 * args[0].shape[0] * args[0].shape[1] * args[1].shape[1]
            elif func is aten.addmm.default:
                self.flops += 2 * args[1].shape[0] * args[1].shape[1] * args[2].shape[1]
            elif func is aten.bmm.default:
                self.flops += 2 * args[0].shape[0] * args[0].shape[1] * args[0].shape[2] * args[1].shape[2]
        return out


def recomputed_share(name: str) -> float:
    """Matrix-product FLOPs the recomputation redoes with the early stop, over those it redoes without it."""
    setups = steps.two_models(run_profile.get("tiny"))
    model, _ = steps.build(setups, name)
    batch = steps.batch_of(setups, name, 2, device="cpu")
    backward_flops = {}
    for label, on, early in (("plain", False, True), ("early stop", True, True), ("no early stop", True, False)):
        if on:
            model.gradient_checkpointing_enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_disable()
        counter = MatmulFlops()
        with counter, set_checkpoint_early_stop(early):
            loss = model(**batch).loss
            counter.on = True
            loss.backward()
        model.zero_grad(set_to_none=True)
        backward_flops[label] = counter.flops
    extra = {k: backward_flops[k] - backward_flops["plain"] for k in ("early stop", "no early stop")}
    assert extra["no early stop"] > 0, "checkpointing recomputed nothing: the count cannot tell"
    return extra["early stop"] / extra["no early stop"]


def test_bert_layers_are_recomputed_whole():
    assert recomputed_share("bert-large-uncased") == 1.0


def test_gpt_neox_skips_its_last_product():
    cfg = steps.build(steps.two_models(run_profile.get("tiny")), "polyglot-ko-1.3b")[0].config
    h, i, s = cfg.hidden_size, cfg.intermediate_size, steps.two_models(run_profile.get("tiny"))["polyglot-ko-1.3b"]["seq_len"]
    assert cfg.use_parallel_residual
    expected = 1 - 2 * i * h / (8 * h * h + 4 * i * h + 4 * s * h)
    assert abs(recomputed_share("polyglot-ko-1.3b") - expected) < 0.01
