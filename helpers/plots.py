"""One figure style for the book, and the two plot kinds most chapters need.

Functions return the ``matplotlib`` Figure; the notebook shows it. Memory axes are in binary units
(MiB or GiB), and every axis label says which.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib as mpl
import matplotlib.pyplot as plt
import pandas as pd

STYLE = {
    "figure.figsize": (7.0, 4.0),
    "figure.dpi": 100,
    "savefig.dpi": 100,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.titlesize": 11,
    "axes.labelsize": 10,
    "legend.fontsize": 9,
    "legend.frameon": False,
}

# Fixed colours for the memory components, so a colour means the same thing in every chapter.
COMPONENT_COLORS = {
    "weights": "#4C72B0",
    "gradients": "#DD8452",
    "optimizer states": "#55A868",
    "activations": "#C44E52",
    "transient": "#8172B3",
    "CUDA context & cache": "#937860",
}


def use_style() -> None:
    """Apply the book's matplotlib style (call once, in the setup cell).

    Introduced in chapter 1's setup cell.
    """
    mpl.rcParams.update(STYLE)


def stacked_bar(
    df: pd.DataFrame, *, title: str, ylabel: str, xlabel: str = "", colors: dict[str, str] | None = None
) -> plt.Figure:
    """One bar per row of ``df``, stacked from its columns (the memory components).

    >>> stacked_bar(breakdown_gib, title="Where the memory goes", ylabel="memory (GiB)")

    Introduced in chapter 1, section 1.3.
    """
    if df.empty:
        raise ValueError("stacked_bar needs at least one row and one column")
    colors = {**COMPONENT_COLORS, **(colors or {})}
    fig, ax = plt.subplots()
    bottom = pd.Series(0.0, index=df.index)
    for col in df.columns:
        values = df[col].fillna(0.0).astype(float)
        ax.bar([str(i) for i in df.index], values, bottom=bottom, label=col, color=colors.get(col))
        bottom = bottom + values
    if len(df.index) > 5:  # long category names would overlap
        ax.tick_params(axis="x", labelrotation=35)
        for label in ax.get_xticklabels():
            label.set_horizontalalignment("right")
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.set_xlabel(xlabel)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig


def lines(
    df: pd.DataFrame,
    *,
    x: str,
    ys: Sequence[str],
    title: str,
    xlabel: str,
    ylabel: str,
    styles: Sequence[str] | None = None,
    logx: bool = False,
    logy: bool = False,
) -> plt.Figure:
    """Plot columns ``ys`` of ``df`` against column ``x``, one line each, labelled by column name.

    Introduced in chapter 1, section 1.5.
    """
    missing = [c for c in [x, *ys] if c not in df.columns]
    if missing:
        raise ValueError(f"columns not in the frame: {', '.join(missing)}")
    fig, ax = plt.subplots()
    for i, col in enumerate(ys):
        style = styles[i] if styles else "o-"
        ax.plot(df[x], df[col], style, label=col)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend()
    fig.tight_layout()
    return fig
