"""helpers.steps (the book's training step) and helpers.prose (phrase helpers), on CPU."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from helpers import models, prose, steps


def tiny_bert():
    torch.manual_seed(0)
    return models.build("bert-large-uncased", head="sequence-classification", profile="tiny").train()


def test_batch_for_shapes_and_device():
    b = steps.batch_for("classification", 3, 16, "cpu")
    assert b["input_ids"].shape == (3, 16) and b["labels"].shape == (3,)
    with pytest.raises(ValueError, match=">= 1"):
        steps.batch_for("classification", 0, 16, "cpu")


def test_make_step_updates_weights_clears_grads_and_marks_phases():
    model = tiny_bert()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = steps.make_step(model, opt, steps.batch_for("classification", 2, 16, "cpu"))
    before = next(model.parameters()).detach().clone()
    with profile(activities=[ProfilerActivity.CPU]) as p:
        step()
    assert not torch.equal(before, next(model.parameters()))
    assert all(q.grad is None for q in model.parameters())
    names = {e.name for e in p.events()}
    assert {"forward", "backward", "optimizer"} <= names


def test_make_step_refuses_other_dtypes():
    model = tiny_bert()
    with pytest.raises(ValueError, match="amp must be"):
        steps.make_step(model, torch.optim.SGD(model.parameters(), lr=0.1), {}, amp=torch.float32)


def test_train_step_drops_gradients_even_when_it_fails():
    model = tiny_bert()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = steps.batch_for("classification", 2, 16, "cpu")
    model(**batch).loss.backward()  # leave gradients behind, then fail inside the step
    with pytest.raises(Exception):  # noqa: B017 - any failure inside the step
        steps.train_step(model, opt, {"input_ids": batch["input_ids"], "labels": batch["labels"][:1]})
    assert all(q.grad is None for q in model.parameters())


@pytest.mark.parametrize("items, text", [(["a"], "a"), (["a", "b"], "a and b"), (["a", "b", "c"], "a, b and c")])
def test_listing(items, text):
    assert prose.listing(items) == text
    assert prose.listing(items, conjunction="or").endswith(text.split()[-1])


def test_listing_refuses_nothing_and_formats():
    with pytest.raises(ValueError):
        prose.listing([])
    assert prose.ms(0.1234) == "123 ms" and prose.pct(0.934) == "93%" and prose.pct(0.9345, 1) == "93.5%"


def test_say_prints_outside_ipython(capsys, monkeypatch):
    import IPython

    monkeypatch.setattr(IPython, "get_ipython", lambda: None)  # another test may have started a shell
    prose.say("**hello**")
    assert capsys.readouterr().out.strip() == "**hello**"


def test_two_models_build_and_batch_of_follow_the_profile():
    from helpers import run_profile

    tiny, full = run_profile.Profile("tiny", "cpu"), run_profile.Profile("full", "cpu")
    assert steps.two_models(full)["bert-large-uncased"]["seq_len"] == 512
    assert steps.two_models(full)["polyglot-ko-1.3b"]["dtype"] == torch.float16
    setups = steps.two_models(tiny)
    assert setups["polyglot-ko-1.3b"]["dtype"] == torch.float32 and setups["polyglot-ko-1.3b"]["seq_len"] == 64
    b = steps.batch_of(setups, "bert-large-uncased", 3, device="cpu", seed=1)
    assert b["input_ids"].shape == (3, 64) and "labels" in b
    assert torch.equal(b["input_ids"], steps.batch_of(setups, "bert-large-uncased", 3, device="cpu", seed=1)["input_ids"])
    lm = steps.batch_of(setups, "polyglot-ko-1.3b", 2, device="cpu")
    assert torch.equal(lm["labels"], lm["input_ids"])
