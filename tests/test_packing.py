"""packing: padded, length-grouped and packed batches keep every document token, with correct labels."""

import pytest
import torch

from helpers import data, packing

DOCS = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14], [15]]


def test_pad_batches_pads_to_the_longest_and_masks_labels():
    batches = packing.pad_batches(DOCS, 2)
    assert [b["input_ids"].shape for b in batches] == [(2, 3), (2, 5)]
    assert sum(int(b["attention_mask"].sum()) for b in batches) == sum(len(d) for d in DOCS)
    b = batches[0]
    assert b["labels"][1].tolist() == [8, 9, packing.IGNORE_INDEX]


def test_length_grouping_reduces_slots():
    plain, grouped = packing.pad_batches(DOCS, 2), packing.pad_batches(DOCS, 2, group_by_length=True)
    assert packing.slots(grouped) < packing.slots(plain)
    assert grouped[0]["input_ids"][0].tolist() == DOCS[2]  # longest first


def test_pack_rows_restarts_positions_and_hides_document_starts():
    (batch,) = packing.pack_rows(DOCS, row_len=8, rows_per_batch=2)
    assert batch["input_ids"].shape == (2, 8)
    assert batch["position_ids"][0].tolist() == [0, 1, 2, 0, 1, 0, 1, 2]  # doc 0, doc 1, then padding
    assert batch["labels"][0].tolist() == [-100, 6, 7, -100, 9, -100, -100, -100]
    # every document token but each document's first is a label
    assert int((batch["labels"] != -100).sum()) == sum(len(d) - 1 for d in DOCS)
    assert batch["input_ids"][1, :5].tolist() == DOCS[2]


def test_pack_rows_rejects_a_document_longer_than_a_row():
    with pytest.raises(ValueError, match="does not fit"):
        packing.pack_rows(DOCS, row_len=4, rows_per_batch=1)
    with pytest.raises(ValueError):
        packing.pad_batches([], 2)


def test_tokenizing_dataset_is_deterministic_and_does_work():
    ds = data.TokenizingDataset(4, seq_len=16, words=20)
    a, b = ds[1], ds[1]
    assert torch.equal(a["input_ids"], b["input_ids"])
    assert a["input_ids"].shape == (16,) and a["input_ids"][0] == 101
    assert not torch.equal(ds[0]["input_ids"], ds[1]["input_ids"])
    assert len(ds.tokenize(ds.text(0))) > 20  # sub-words: more ids than words
    with pytest.raises(IndexError):
        ds[4]
    short = data.TokenizingDataset(1, seq_len=64, words=2)[0]
    assert 0 < int(short["attention_mask"].sum()) < 64  # padded, and the mask says where


def test_tokenizing_dataset_subword_ids_avoid_special_tokens():
    ds = data.TokenizingDataset(2, seq_len=512, words=100, vocab_size=200)
    ids = ds.tokenize(ds.text(0))
    assert ids[0] == 101 and ids[-1] == 102
    inner = ids[1:-1]
    assert inner and min(inner) >= 104 and max(inner) < 200  # no [PAD]/[UNK]/[CLS]/[SEP]/[MASK] among sub-words
    assert 101 not in inner and 102 not in inner


def test_tokenizing_dataset_keeps_sep_on_truncation():
    ds = data.TokenizingDataset(1, seq_len=8, words=50)
    row = ds[0]["input_ids"]
    assert int(ds[0]["attention_mask"].sum()) == 8
    assert row[0] == 101 and row[-1] == 102


def test_tokenizing_dataset_rejects_small_vocab_and_seq_len():
    with pytest.raises(ValueError, match="vocab_size must exceed 104"):
        data.TokenizingDataset(1, seq_len=8, vocab_size=100)
    with pytest.raises(ValueError, match="seq_len must be at least 2"):
        data.TokenizingDataset(1, seq_len=1)
