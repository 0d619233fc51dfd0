"""Datasets that need no download.

- ``dummy_dataset``: random token ids with random labels, as in the Hugging Face guide "Model training
  anatomy", for measuring memory and time (what is learned does not matter there).
- ``markov_lm_dataset``: sequences from a fixed random Markov chain in which every token has
  ``branching`` equally likely successors. A causal LM can learn it, and the best possible loss is
  known exactly: ``log(branching)`` nats per token (``markov_loss_floor``), so loss curves mean something.
- ``keyword_dataset``: sequence classification, label 1 when a keyword token occurs anywhere.
- ``TokenizingDataset``: pseudo-texts tokenised on the fly in pure Python: real CPU work per sample,
  for measuring data-loading stalls.
- ``batches``: any of them as a ``DataLoader`` of whole, seeded batches.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from datasets import Dataset
from torch.utils.data import DataLoader


def _check_sizes(n_samples: int, seq_len: int) -> None:
    if n_samples <= 0:
        raise ValueError(f"n_samples must be positive, got {n_samples}")
    if seq_len <= 1:
        raise ValueError(f"seq_len must be at least 2, got {seq_len}")


def dummy_dataset(
    n_samples: int,
    seq_len: int,
    *,
    low: int = 100,
    high: int = 30000,
    task: str = "classification",
    num_labels: int = 2,
    seed: int = 0,
) -> Dataset:
    """Random ``input_ids`` in ``[low, high)`` with random labels, as a torch-format ``Dataset``.

    ``task="classification"``: one label per sample in ``[0, num_labels)`` (the Hugging Face guide's setup).
    ``task="causal-lm"``: ``labels`` equal to ``input_ids`` (the model shifts them itself).

    Introduced in chapter 1, section 1.2.
    """
    _check_sizes(n_samples, seq_len)
    if not 0 <= low < high:
        raise ValueError(f"need 0 <= low < high, got low={low}, high={high}")
    rng = np.random.default_rng(seed)
    ids = rng.integers(low, high, size=(n_samples, seq_len), dtype=np.int64)
    if task == "classification":
        labels = rng.integers(0, num_labels, size=n_samples, dtype=np.int64)
    elif task == "causal-lm":
        labels = ids.copy()
    else:
        raise ValueError(f"task must be 'classification' or 'causal-lm', got {task!r}")
    ds = Dataset.from_dict({"input_ids": ids, "labels": labels})
    ds.set_format("torch")
    return ds


def markov_transitions(vocab_used: int, branching: int, seed: int = 0) -> np.ndarray:
    """The chain: row ``i`` lists the ``branching`` tokens that may follow token ``i``.

    Introduced in chapter 3, section 3.3.
    """
    if not 1 <= branching <= vocab_used:
        raise ValueError(f"need 1 <= branching <= vocab_used, got {branching} and {vocab_used}")
    rng = np.random.default_rng(seed)
    return np.stack([rng.choice(vocab_used, size=branching, replace=False) for _ in range(vocab_used)])


def markov_loss_floor(branching: int) -> float:
    """The lowest achievable mean cross-entropy (nats/token) on ``markov_lm_dataset``.

    Introduced in chapter 3, section 3.3.
    """
    return math.log(branching)


def markov_lm_dataset(
    n_samples: int,
    seq_len: int,
    *,
    vocab_used: int = 64,
    branching: int = 4,
    offset: int = 100,
    seed: int = 0,
) -> Dataset:
    """Causal-LM sequences from a fixed Markov chain over ``vocab_used`` token ids from ``offset``.

    The chain (``markov_transitions(vocab_used, branching, seed)``) is the same for every sample;
    the samples differ in their random start and choices (drawn with ``seed + 1``).

    Introduced in chapter 3, section 3.3.
    """
    _check_sizes(n_samples, seq_len)
    nxt = markov_transitions(vocab_used, branching, seed)
    rng = np.random.default_rng(seed + 1)
    seqs = np.empty((n_samples, seq_len), dtype=np.int64)
    seqs[:, 0] = rng.integers(0, vocab_used, size=n_samples)
    choices = rng.integers(0, branching, size=(n_samples, seq_len - 1))
    for t in range(1, seq_len):
        seqs[:, t] = nxt[seqs[:, t - 1], choices[:, t - 1]]
    ids = seqs + offset
    ds = Dataset.from_dict({"input_ids": ids, "labels": ids.copy()})
    ds.set_format("torch")
    return ds


def keyword_dataset(
    n_samples: int,
    seq_len: int,
    *,
    keyword: int = 2023,
    low: int = 100,
    high: int = 30000,
    seed: int = 0,
) -> Dataset:
    """Classification: label 1 when ``keyword`` occurs in the sequence (half the samples), else 0.

    Introduced in chapter 5, section 5.1.
    """
    _check_sizes(n_samples, seq_len)
    if not low <= keyword < high:
        raise ValueError(f"keyword must lie in [low, high), got {keyword}")
    rng = np.random.default_rng(seed)
    ids = rng.integers(low, high - 1, size=(n_samples, seq_len), dtype=np.int64)
    ids[ids >= keyword] += 1  # random tokens never equal the keyword
    labels = (np.arange(n_samples) % 2).astype(np.int64)
    rng.shuffle(labels)
    where = rng.integers(0, seq_len, size=n_samples)
    ids[labels == 1, where[labels == 1]] = keyword
    ds = Dataset.from_dict({"input_ids": ids, "labels": labels})
    ds.set_format("torch")
    return ds


class TokenizingDataset:
    """A map-style dataset that does real CPU work per sample, as a tokenizer does.

    Sample ``i`` is a pseudo-text of ``words`` words drawn from a fixed seeded vocabulary of made-up words;
    ``__getitem__`` splits it, maps each word to sub-word ids with a pure-Python greedy longest-match over
    a fixed sub-word table (the shape of WordPiece), truncates or pads to ``seq_len`` and returns
    ``input_ids``, ``attention_mask`` and ``labels`` tensors. Each sequence starts with BERT's [CLS] (id 101)
    and ends with [SEP] (id 102), also when it is truncated; sub-word ids start at 104, above BERT's special
    ids ([PAD] 0, [UNK] 100, [CLS] 101, [SEP] 102, [MASK] 103), so ``vocab_size`` must exceed 104.
    The cost per sample grows with ``words``;
    nothing is cached, so every epoch pays it again, as an on-the-fly tokenizer does. Picklable, so
    ``DataLoader`` workers can run it.

    >>> ds = TokenizingDataset(1024, seq_len=128)
    >>> ds[0]["input_ids"].shape
    torch.Size([128])

    Introduced in chapter 9, section 9.5.
    """

    CLS_ID, SEP_ID, FIRST_SUBWORD_ID = 101, 102, 104

    def __init__(self, n_samples: int, seq_len: int, *, words: int = 200, vocab_size: int = 30000,
                 num_labels: int = 2, seed: int = 0) -> None:
        _check_sizes(n_samples, seq_len)
        if words < 1:
            raise ValueError(f"words must be positive, got {words}")
        if seq_len < 2:
            raise ValueError(f"seq_len must be at least 2 ([CLS] and [SEP]), got {seq_len}")
        if vocab_size <= self.FIRST_SUBWORD_ID:
            raise ValueError(f"vocab_size must exceed {self.FIRST_SUBWORD_ID} (ids up to {self.FIRST_SUBWORD_ID - 1} "
                             f"are BERT's special tokens), got {vocab_size}")
        self.n_samples, self.seq_len, self.words = n_samples, seq_len, words
        self.vocab_size, self.num_labels, self.seed = vocab_size, num_labels, seed
        rng = np.random.default_rng(seed)
        letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
        self.lexicon = ["".join(rng.choice(letters, size=rng.integers(3, 11))) for _ in range(2000)]
        pieces = {w[:k] for w in self.lexicon[::3] for k in (2, 3, 4)} | set(letters.tolist())
        first = self.FIRST_SUBWORD_ID
        self.subwords = {p: first + i % (vocab_size - first) for i, p in enumerate(sorted(pieces))}

    def __len__(self) -> int:
        return self.n_samples

    def text(self, index: int) -> str:
        """The pseudo-text of sample ``index`` (deterministic in ``seed`` and ``index``)."""
        rng = np.random.default_rng((self.seed, index))
        return " ".join(self.lexicon[j] for j in rng.integers(0, len(self.lexicon), size=self.words))

    def tokenize(self, text: str) -> list[int]:
        """Greedy longest-match sub-word ids of ``text`` (pure Python: the CPU work of a sample)."""
        ids = [self.CLS_ID]
        for word in text.split():
            start = 0
            while start < len(word):
                for end in range(min(len(word), start + 4), start, -1):
                    piece = word[start:end]
                    if piece in self.subwords:
                        ids.append(self.subwords[piece])
                        start = end
                        break
        ids.append(self.SEP_ID)
        return ids

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.n_samples:
            raise IndexError(f"index {index} out of range for {self.n_samples} samples")
        ids = self.tokenize(self.text(index))
        if len(ids) > self.seq_len:  # truncate the text, keep the closing [SEP]
            ids = ids[: self.seq_len - 1] + [self.SEP_ID]
        n = len(ids)
        input_ids = torch.zeros(self.seq_len, dtype=torch.long)
        input_ids[:n] = torch.tensor(ids, dtype=torch.long)
        mask = torch.zeros(self.seq_len, dtype=torch.long)
        mask[:n] = 1
        return {"input_ids": input_ids, "attention_mask": mask, "labels": torch.tensor(index % self.num_labels)}


def batches(dataset: Dataset, batch_size: int, *, seed: int = 0, shuffle: bool = True) -> DataLoader:
    """A ``DataLoader`` of dict batches from a torch-format dataset, shuffled with ``seed``.

    Only whole batches: the last ``len(dataset) % batch_size`` samples of each epoch are dropped.

    >>> next(iter(batches(dummy_dataset(64, 128), 8)))["input_ids"].shape   # (8, 128)

    Introduced in chapter 3, section 3.3.
    """
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    gen = torch.Generator().manual_seed(seed)
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, generator=gen, drop_last=True)
