#!/usr/bin/env python3
"""Verdict words of a chapter's rendered outputs, and where a re-execution changed them.

    python scripts/verdicts.py COMMITTED.ipynb EXECUTED.ipynb    # print the cells whose verdicts differ

A speed conclusion in this book is a *verdict word* in a cell's output: "faster", "slower", "no practical
difference" (the interleaved comparison's three outcomes, ``helpers.timing.ratio_verdict``), the older "no
difference beyond the noise" and "within the noise", and the words for what limits a step ("host-bound", "GPU-bound", "mixed", "GPU idle, host waiting").
``make gpu-test`` (scripts/gpu_check.py) re-executes each chapter and compares, cell by cell (matched by cell id),
the sequence of verdict words in the committed outputs with the new run's. A cell whose sequence differs is a
*flip*: the experiment's conclusion did not survive a re-run, which the book treats as a bug in the experiment.
A cell may be declared noise-sensitive in notebooks/gpu_check.json (``"noise_sensitive": {notebook: {cell id:
reason}}``), at most three in the whole book; its flips are reported but do not fail the check.

Outputs read: streams, ``text/markdown`` and ``text/plain`` (tables print their verdict columns there); HTML and
images are not read. Words are matched whole and case-sensitively as the helpers write them, so "faster" inside
"steadfaster" or a capitalised heading word does not count.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

# Longest alternatives first, so "no difference beyond the noise" is not also read as a shorter word.
# ("no difference beyond the noise" was the third verdict before it became "no practical difference".)
WORDS = ("no difference beyond the noise", "no practical difference", "within the noise", "GPU idle, host waiting", "host-bound", "GPU-bound",
         "faster", "slower", "mixed")
PATTERN = re.compile(r"(?<![\w-])(" + "|".join(re.escape(w) for w in WORDS) + r")(?![\w-])")
MAX_NOISE_SENSITIVE = 3


def _texts(cell: dict) -> list[str]:
    texts = []
    for out in cell.get("outputs", []):
        kind = out.get("output_type")
        if kind == "stream":
            text = out.get("text", "")
            texts.append("".join(text) if isinstance(text, list) else text)
        elif kind in ("execute_result", "display_data"):
            data = out.get("data", {})
            for mime in ("text/markdown", "text/plain"):
                if mime in data:
                    value = data[mime]
                    texts.append("".join(value) if isinstance(value, list) else value)
                    break  # a table's markdown and plain forms say the same thing: read one
    return texts


def extract(cell: dict) -> list[str]:
    """The verdict words of one code cell's outputs, in the order they appear."""
    return [m.group(1) for text in _texts(cell) for m in PATTERN.finditer(text)]


def cell_key(cell: dict, index: int) -> str:
    """A cell's id (nbformat 4.5), or its position among the code cells when it has none."""
    return cell.get("id") or f"code-{index}"


def verdicts_by_cell(nb: dict) -> dict[str, list[str]]:
    """Verdict words of every code cell that has any, keyed by ``cell_key``."""
    found = {}
    code = [c for c in nb.get("cells", []) if c.get("cell_type") == "code"]
    for i, cell in enumerate(code, start=1):
        words = extract(cell)
        if words:
            found[cell_key(cell, i)] = words
    return found


@dataclass(frozen=True)
class Flip:
    cell: str
    committed: tuple[str, ...]
    executed: tuple[str, ...]
    declared: str | None  # the noise-sensitive reason, when the cell is declared so

    def describe(self) -> str:
        tag = f" (declared noise-sensitive: {self.declared})" if self.declared else ""
        return f"cell {self.cell}: committed {list(self.committed)} -> re-run {list(self.executed)}{tag}"


def compare(committed: dict, executed: dict, noise_sensitive: dict[str, str] | None = None) -> tuple[int, list[Flip]]:
    """(cells with verdicts compared, flips) between two executions of the same notebook."""
    noise_sensitive = noise_sensitive or {}
    old, new = verdicts_by_cell(committed), verdicts_by_cell(executed)
    flips = []
    for key in sorted(set(old) | set(new)):
        a, b = tuple(old.get(key, ())), tuple(new.get(key, ()))
        if a != b:
            flips.append(Flip(key, a, b, noise_sensitive.get(key)))
    return len(set(old) | set(new)), flips


def load_noise_sensitive(policy: Path) -> dict[str, dict[str, str]]:
    """notebooks/gpu_check.json's ``noise_sensitive`` section; refuses more than ``MAX_NOISE_SENSITIVE`` cells."""
    data = json.loads(policy.read_text()) if policy.exists() else {}
    declared = data.get("noise_sensitive", {})
    declared = {nb: cells for nb, cells in declared.items() if not nb.startswith("_")}
    total = sum(len(cells) for cells in declared.values())
    if total > MAX_NOISE_SENSITIVE:
        raise ValueError(f"{policy} declares {total} noise-sensitive cells; at most {MAX_NOISE_SENSITIVE} are allowed "
                         "in the whole book: redesign the experiments instead")
    for nb, cells in declared.items():
        for cell, reason in cells.items():
            if not str(reason).strip():
                raise ValueError(f"{policy}: noise-sensitive cell {nb} {cell} needs a reason")
    return declared


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    committed, executed = (json.loads(Path(p).read_text()) for p in argv)
    declared = load_noise_sensitive(Path(__file__).resolve().parents[1] / "notebooks" / "gpu_check.json")
    compared, flips = compare(committed, executed, declared.get(Path(argv[0]).name, {}))
    for f in flips:
        print(f.describe())
    undeclared = [f for f in flips if not f.declared]
    print(f"{compared} cells with verdicts, {len(flips)} flipped ({len(undeclared)} not declared noise-sensitive)")
    return 1 if undeclared else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
