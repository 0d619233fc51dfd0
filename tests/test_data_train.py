import math

import pytest
import torch

from helpers import data, models


def test_dummy_dataset_shapes_ranges_and_seed():
    ds = data.dummy_dataset(16, 32, seed=3)[:]
    assert ds["input_ids"].shape == (16, 32)
    assert ds["input_ids"].dtype == torch.int64
    assert int(ds["input_ids"].min()) >= 100 and int(ds["input_ids"].max()) < 30000
    assert set(ds["labels"].tolist()) <= {0, 1}
    assert torch.equal(ds["input_ids"], data.dummy_dataset(16, 32, seed=3)[:]["input_ids"])
    lm = data.dummy_dataset(4, 8, task="causal-lm")[:]
    assert torch.equal(lm["input_ids"], lm["labels"])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(n_samples=0, seq_len=8), "n_samples must be positive"),
        (dict(n_samples=-4, seq_len=8), "n_samples must be positive"),
        (dict(n_samples=4, seq_len=1), "seq_len must be at least 2"),
        (dict(n_samples=4, seq_len=8, task="qa"), "task must be"),
        (dict(n_samples=4, seq_len=8, low=10, high=5), "low < high"),
    ],
)
def test_dummy_dataset_bad_input(kwargs, message):
    with pytest.raises(ValueError, match=message):
        data.dummy_dataset(**kwargs)


def test_markov_sequences_follow_the_chain():
    nxt = data.markov_transitions(16, 3, seed=5)
    ds = data.markov_lm_dataset(8, 20, vocab_used=16, branching=3, offset=100, seed=5)[:]
    ids = ds["input_ids"] - 100
    for row in ids:
        for a, b in zip(row[:-1].tolist(), row[1:].tolist(), strict=True):
            assert b in nxt[a]
    assert data.markov_loss_floor(3) == pytest.approx(math.log(3))


def test_keyword_dataset_labels_mean_what_they_say():
    ds = data.keyword_dataset(64, 16, keyword=500, seed=2)[:]
    has = (ds["input_ids"] == 500).any(dim=1).long()
    assert torch.equal(has, ds["labels"])
    assert int(ds["labels"].sum()) == 32


def test_markov_task_is_learnable():
    """A tiny GPT-NeoX gets well below the uniform loss, toward the known floor."""
    torch.manual_seed(0)
    ds = data.markov_lm_dataset(256, 32, vocab_used=32, branching=2, seed=0)
    model = models.build("polyglot-ko-1.3b", profile="tiny", head="causal-lm", device="cpu",
                         vocab_size=256, seed=0)
    # 60 steps at lr 6e-3 reach the same loss as 120 at 3e-3, in half the time
    losses = train_losses(model, ds, steps=60, batch_size=16, lr=6e-3)
    assert len(losses) == 60
    start, end = sum(losses[:5]) / 5, sum(losses[-10:]) / 10
    assert start > math.log(32)  # starts above a uniform guess over the used tokens
    assert end < 0.5 * start
    assert end < data.markov_loss_floor(2) + 0.5


def train_losses(model, dataset, *, steps, batch_size, lr):
    """A plain AdamW loop over ``data.batches``, a new shuffle each epoch; the loss of every step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    losses, epoch = [], 0
    while len(losses) < steps:
        for batch in data.batches(dataset, batch_size, seed=epoch):
            loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            if len(losses) == steps:
                break
        epoch += 1
    return losses


def test_batches_are_whole_seeded_and_checked():
    ds = data.dummy_dataset(10, 8)
    got = list(data.batches(ds, 4, seed=1))
    assert [len(b["input_ids"]) for b in got] == [4, 4]  # the last 2 samples are dropped
    again = list(data.batches(ds, 4, seed=1))
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(got, again, strict=True))
    in_order = next(iter(data.batches(ds, 4, shuffle=False)))
    assert torch.equal(in_order["input_ids"], ds[:4]["input_ids"])
    with pytest.raises(ValueError, match="batch_size must be positive"):
        data.batches(ds, 0)
