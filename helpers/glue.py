"""Glue numbers from a notebook's outputs into the book's prose (myst-nb ``glue``).

``glue(name, value)`` writes the value into the cell's outputs under a key that Jupyter Book's
myst-nb reads; markdown then shows it with ``{glue:text}`name:.1f```. This is myst-nb's own output
format (checked against ``myst_nb.glue`` by the tests), written here so that a notebook can glue
without Sphinx installed (Colab, the GPU machine).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from IPython.core.formatters import format_display_data
from IPython.display import display

GLUE_PREFIX = "application/papermill.record/"


def glue(name: str, value: Any, display_value: bool = False) -> None:
    """Record ``value`` under ``name`` for ``{glue:...}`` references (hidden unless asked).

    NumPy scalars are stored as plain Python numbers, so ``{glue:text}`name:.2f``` can format them.

    Introduced in chapter 1's setup cell.
    """
    if not name or not isinstance(name, str):
        raise ValueError("glue needs a non-empty string name")
    if isinstance(value, np.generic):  # np.float64(1.5) would not parse back as a number
        value = value.item()
    mimebundle, metadata = format_display_data(value)
    prefix = "" if display_value else GLUE_PREFIX
    metadata["scrapbook"] = {"name": name, "mime_prefix": prefix}
    display({prefix + k: v for k, v in mimebundle.items()}, raw=True, metadata=metadata)
