"""No chapter patches a rendered sentence with a static note about "the committed run".

A sentence that quotes a run is rendered by code from that run's numbers; if it came out wrong, the code is
fixed and the chapter re-executed. A static note under it ("in the committed run, ...") would contradict the
sentence a reader gets from their own run.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("[0-9][0-9]_*.ipynb"))
NOTE = re.compile(r"committed (?:run|execution|outputs?)|in the run above, the sentence|for this run,? the sentence", re.I)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_markdown_has_no_notes_about_the_committed_run(path):
    nb = json.loads(path.read_text())
    hits = []
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "markdown":
            continue
        text = "".join(cell["source"])
        hits += [f"markdown cell {i} ({cell.get('id')}): ...{text[max(0, m.start() - 60):m.end() + 60]}..."
                 for m in NOTE.finditer(text)]
    assert not hits, "notes that correct a rendered sentence for one run:\n" + "\n".join(hits)


def test_the_pattern_catches_the_known_phrasings():
    for text in ("In the committed run the step was", "the committed outputs show", "For this run the sentence"):
        assert NOTE.search(text)
    assert not NOTE.search("the run is committed with its outputs")
