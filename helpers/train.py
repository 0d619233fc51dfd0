"""A plain training loop for loss curves on the learnable tasks.

Chapters that teach a loop (accumulation, mixed precision, ...) write their own in the notebook;
this one is for the places where the loop is not the lesson.
"""

from __future__ import annotations

import torch
from datasets import Dataset
from torch import nn
from torch.utils.data import DataLoader


def batches(dataset: Dataset, batch_size: int, *, seed: int = 0, shuffle: bool = True) -> DataLoader:
    """A ``DataLoader`` of dict batches from a torch-format dataset, shuffled with ``seed``.

    Only whole batches: the last ``len(dataset) % batch_size`` samples of each epoch are dropped.

    >>> next(iter(batches(data.dummy_dataset(64, 128), 8)))["input_ids"].shape   # (8, 128)

    Introduced in chapter 3, section 3.3.
    """
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    gen = torch.Generator().manual_seed(seed)
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, generator=gen, drop_last=True)


def fit(
    model: nn.Module,
    dataset: Dataset,
    *,
    steps: int,
    batch_size: int,
    lr: float = 1e-3,
    seed: int = 0,
    optimizer: torch.optim.Optimizer | None = None,
) -> list[float]:
    """Train ``steps`` optimizer steps (cycling over the data) and return the loss of each step.

    The model must return ``.loss`` when given ``labels`` (every Hugging Face head does).
    ``optimizer`` defaults to ``AdamW(lr=lr)``. The dataset must hold at least one whole batch.

    >>> losses = fit(model, data.markov_lm_dataset(256, 32), steps=100, batch_size=16)

    Introduced in chapter 3, section 3.3.
    """
    if steps <= 0:
        raise ValueError(f"steps must be positive, got {steps}")
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    if len(dataset) < batch_size:
        raise ValueError(
            f"the dataset has {len(dataset)} samples, fewer than one batch of {batch_size}: no step could run"
        )
    device = next(model.parameters()).device
    opt = optimizer or torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    losses: list[float] = []
    epoch = 0
    while len(losses) < steps:
        for batch in batches(dataset, batch_size, seed=seed + epoch):
            batch = {k: v.to(device) for k, v in batch.items()}
            loss = model(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            if len(losses) == steps:
                break
        epoch += 1
    return losses
