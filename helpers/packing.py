"""Variable-length documents into batches: padding, length grouping and packing, with correct labels.

Introduced in chapter 9, section 9.2.

Three ways to batch documents of different lengths for a causal LM:

- ``pad_batches(docs, batch_size)``: consecutive documents, each batch padded to its longest one;
- ``pad_batches(docs, batch_size, group_by_length=True)``: documents sorted by length first, so each
  batch holds similar lengths and little padding (the Hugging Face Trainer's
  ``train_sampling_strategy="group_by_length"``);
- ``pack_rows(docs, row_len, rows_per_batch)``: documents concatenated into rows of ``row_len`` tokens
  with **position ids that restart at 0 for each document**. transformers reads a restart in
  ``position_ids`` (with ``attention_mask=None``) as a document boundary and builds a block-diagonal
  causal mask, so no token attends across documents. The first token of each document gets the label
  ``-100``: the model shifts labels by one, and the previous document's last token must not be trained
  to predict it.

Every batch is a dict of int64 tensors. All three hold the same documents, so the useful tokens (the
numerator of *useful tokens per second*) are the same; ``slots`` counts what the model computes on,
padding included.

>>> batches = pack_rows(docs, row_len=1024, rows_per_batch=4)
>>> loss = model(**batches[0]).loss
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

IGNORE_INDEX = -100


def _check_docs(docs: Sequence[Sequence[int]]) -> None:
    if not docs:
        raise ValueError("need at least one document")
    if any(len(d) == 0 for d in docs):
        raise ValueError("every document needs at least one token")


def pad_batches(
    docs: Sequence[Sequence[int]], batch_size: int, *, group_by_length: bool = False, pad_id: int = 0
) -> list[dict[str, torch.Tensor]]:
    """Batches of ``batch_size`` documents, each padded on the right to the batch's longest document.

    Returns dicts with ``input_ids``, ``attention_mask`` (1 for real tokens) and ``labels`` (the
    tokens, ``-100`` on padding). ``group_by_length`` sorts the documents by length (longest first)
    before batching.

    Introduced in chapter 9, section 9.2.
    """
    _check_docs(docs)
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    order = sorted(range(len(docs)), key=lambda i: -len(docs[i])) if group_by_length else list(range(len(docs)))
    batches = []
    for start in range(0, len(order), batch_size):
        chunk = [list(docs[i]) for i in order[start:start + batch_size]]
        width = max(len(d) for d in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for r, d in enumerate(chunk):
            ids[r, : len(d)] = torch.tensor(d, dtype=torch.long)
            mask[r, : len(d)] = 1
        labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return batches


def pack_rows(
    docs: Sequence[Sequence[int]], row_len: int, rows_per_batch: int, *, pad_id: int = 0
) -> list[dict[str, torch.Tensor]]:
    """Documents concatenated into rows of ``row_len`` tokens, ``rows_per_batch`` rows per batch.

    Documents are placed in order; one that does not fit in the rest of a row starts a new row (no
    document is split, so each must be at most ``row_len`` long). The rest of a row is padding: its
    position ids count on from 0 as one more (ignored) document and its labels are ``-100``.
    Returns dicts with ``input_ids``, ``position_ids`` and ``labels`` and no ``attention_mask``
    (transformers then derives the block-diagonal mask from the position ids).

    Introduced in chapter 9, section 9.2.
    """
    _check_docs(docs)
    if rows_per_batch < 1:
        raise ValueError(f"rows_per_batch must be at least 1, got {rows_per_batch}")
    longest = max(len(d) for d in docs)
    if longest > row_len:
        raise ValueError(f"a document of {longest} tokens does not fit a row of {row_len}")
    rows: list[list[list[int]]] = [[]]
    used = 0
    for d in docs:
        if used + len(d) > row_len:
            rows.append([])
            used = 0
        rows[-1].append(list(d))
        used += len(d)
    ids_rows, pos_rows, label_rows = [], [], []
    for row in rows:
        ids, pos, labels = [], [], []
        for d in row:
            ids += d
            pos += list(range(len(d)))
            labels += [IGNORE_INDEX] + d[1:]  # the first token of a document is predicted by nothing
        pad = row_len - len(ids)
        ids_rows.append(ids + [pad_id] * pad)
        pos_rows.append(pos + list(range(pad)))
        label_rows.append(labels + [IGNORE_INDEX] * pad)
    batches = []
    for start in range(0, len(rows), rows_per_batch):
        sl = slice(start, start + rows_per_batch)
        batches.append({
            "input_ids": torch.tensor(ids_rows[sl], dtype=torch.long),
            "position_ids": torch.tensor(pos_rows[sl], dtype=torch.long),
            "labels": torch.tensor(label_rows[sl], dtype=torch.long),
        })
    return batches


def slots(batches: Sequence[dict[str, torch.Tensor]]) -> int:
    """Token slots the model computes on (rows times width, padding included).

    Introduced in chapter 9, section 9.2.
    """
    return sum(int(b["input_ids"].numel()) for b in batches)


def pack_into(docs: Sequence[Sequence[int]], row_len: int, n_batches: int, *, pad_id: int = 0
              ) -> list[dict[str, torch.Tensor]]:
    """``pack_rows`` with the rows spread over exactly ``n_batches`` batches (sizes differ by at most one row).

    For comparisons at equal batch counts: padded batches and packed ones then differ in the token slots they
    compute on, not in the number of calls (and of kernel launches) a pass over them makes.

    Introduced in chapter 9, section 9.2.
    """
    if n_batches < 1:
        raise ValueError(f"n_batches must be at least 1, got {n_batches}")
    rows = pack_rows(docs, row_len, 1, pad_id=pad_id)
    if len(rows) < n_batches:
        raise ValueError(f"{len(rows)} packed rows cannot fill {n_batches} batches")
    size, extra = divmod(len(rows), n_batches)
    batches, start = [], 0
    for i in range(n_batches):
        stop = start + size + (1 if i < extra else 0)
        batches.append({k: torch.cat([r[k] for r in rows[start:stop]]) for k in rows[0]})
        start = stop
    return batches
