"""``train.batches``: the name chapters 3, 5 and 6 call for ``data.batches`` (a ``DataLoader`` of whole batches).

The book's training step is ``steps.train_step``; chapters that teach a loop (accumulation, mixed
precision, ...) write their own in the notebook. New code calls ``data.batches``.
"""

from __future__ import annotations

from helpers.data import batches

__all__ = ["batches"]
