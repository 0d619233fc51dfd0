"""Sentences that quote a run: small phrase helpers, so a chapter's rendered cells stay one call long.

Introduced in chapter 1, section 1.1. A chapter writes the explanation once, in markdown; where a sentence must
quote the reader's own run (a peak, a speed-up, a verdict), a hidden code cell builds it with these helpers and
``say`` shows it as Markdown (the site hides the cell's code; Jupyter and Colab show it collapsed).

>>> prose.listing(["fused AdamW", "TF32", "aligned shapes"])
'fused AdamW, TF32 and aligned shapes'
>>> prose.say(f"The step took {prose.ms(0.1234)}.")
"""

from __future__ import annotations

from collections.abc import Iterable


def listing(items: Iterable[object], *, conjunction: str = "and") -> str:
    """``"a"``, ``"a and b"``, ``"a, b and c"``: items joined as a sentence does.

    Introduced in chapter 1, section 1.1.
    """
    words = [str(x) for x in items]
    if not words:
        raise ValueError("listing() needs at least one item")
    if len(words) == 1:
        return words[0]
    return f"{', '.join(words[:-1])} {conjunction} {words[-1]}"


def ms(seconds: float, digits: int = 3) -> str:
    """A duration in seconds written in milliseconds with ``digits`` significant digits: ``"123 ms"``.

    Introduced in chapter 1, section 1.1.
    """
    return f"{seconds * 1e3:.{digits}g} ms"


def pct(fraction: float, digits: int = 0) -> str:
    """A fraction written as a percentage: ``0.934`` → ``"93%"``.

    Introduced in chapter 1, section 1.1.
    """
    return f"{fraction:.{digits}%}"


def say(markdown: str) -> None:
    """Show ``markdown`` as the cell's output (IPython's ``display(Markdown(...))``); prints it outside IPython.

    Introduced in chapter 1, section 1.1.
    """
    try:
        from IPython import get_ipython
        from IPython.display import Markdown, display
    except ImportError:  # pragma: no cover - IPython is a dependency
        print(markdown)
        return
    if get_ipython() is None:
        print(markdown)
    else:
        display(Markdown(markdown))
