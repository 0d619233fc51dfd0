"""The landing and setup pages say what runs where and how long: they must agree with each other and with
``notebooks/chapters.json``.

The landing page (``book/intro.md``) has a table of chapters with their minutes on a CPU (tiny profile), an
H100 (the committed run) and an estimated T4 (ten times the H100's); the setup page (``book/setup.md``) gives
the same in ranges, and both say in words what a T4 reader gets in chapters 7 and 9. The minutes move with
each re-execution: a cell that drifts further than a rounding from ``chapters.json`` fails here, and the
page is updated instead of going stale. The T4 descriptions of the two pages must make the same claims.
"""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
INTRO = ROOT / "book" / "intro.md"
SETUP = ROOT / "book" / "setup.md"
T4_PER_H100 = 10  # the pages' estimate: a T4 takes about ten times an H100's minutes


def chapter_minutes() -> dict[int, dict]:
    chapters = json.loads((ROOT / "notebooks" / "chapters.json").read_text(encoding="utf-8"))["chapters"]
    return {int(c["file"][:2]): c["minutes"] for c in chapters}


def landing_rows() -> dict[int, list[str]]:
    """The landing page's chapter table: chapter number -> its cells."""
    rows = {}
    for line in INTRO.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and re.match(r"\d+ \w", cells[0]):
            rows[int(cells[0].split()[0])] = cells
    return rows


def minutes_in(cell: str) -> tuple[str, float] | None:
    """``("<", 1.0)`` for "< 1 min", ``("~", 5.5)`` for "~5.5 min", None for a cell without minutes."""
    m = re.search(r"(<|~) ?(\d+(?:\.\d+)?) min", cell)
    return (m.group(1), float(m.group(2))) if m else None


def agrees(cell: str, measured: float, *, rel: float = 0.25, floor: float = 0.5) -> bool:
    """A cell's minutes against a measured number: "< N min" holds it below N; "~N min" within a rounding
    (``rel`` of the number, at least ``floor`` minutes)."""
    kind, value = minutes_in(cell)
    if kind == "<":
        return measured < value
    return abs(value - measured) <= max(floor, rel * measured)


def test_minutes_in_and_agrees():
    assert minutes_in("all, < 1 min") == ("<", 1.0) and minutes_in("full, ~5.5 min") == ("~", 5.5)
    assert minutes_in("on one GPU: the two-GPU parts skipped") is None
    assert agrees("~4 min", 3.9) and not agrees("~2.5 min", 3.9) and agrees("< 1 min", 0.4)
    assert not agrees("< 1 min", 1.9) and agrees("~60 min (estimate)", 59, floor=5)


def test_the_landing_table_has_every_chapter():
    assert sorted(landing_rows()) == sorted(chapter_minutes())


@pytest.mark.parametrize("column,key", [(2, "CPU tiny"), (4, "H100")], ids=["CPU tiny", "H100"])
def test_landing_table_minutes_follow_chapters_json(column, key):
    rows, minutes = landing_rows(), chapter_minutes()
    wrong = []
    for chapter, cells in rows.items():
        measured = minutes[chapter][key]
        if minutes_in(cells[column]) is None:
            continue  # chapter 7's H100 cell: its minutes are in the "several GPUs" column
        if measured is None or not agrees(cells[column], measured):
            wrong.append(f"chapter {chapter}: '{cells[column]}' against {measured} min in chapters.json")
    assert wrong == [], "\n".join(wrong)


def test_landing_table_t4_estimates_are_ten_times_the_h100():
    wrong = []
    for chapter, cells in landing_rows().items():
        if minutes_in(cells[3]) is None:
            continue  # chapter 7: not estimated
        estimate = T4_PER_H100 * chapter_minutes()[chapter]["H100"]
        if "(estimate)" not in cells[3] or not agrees(cells[3], estimate, floor=5):
            wrong.append(f"chapter {chapter}: '{cells[3][-30:]}' against {estimate:.0f} min")
    assert wrong == [], "\n".join(wrong)


def test_chapter_7s_minutes_on_two_gpus():
    cells = landing_rows()[7]
    assert "two H100s" in cells[5] and agrees(cells[5], chapter_minutes()[7]["H100"])


def test_setup_page_ranges_follow_chapters_json():
    text = " ".join(SETUP.read_text(encoding="utf-8").split())
    minutes = chapter_minutes()
    h100 = [m["H100"] for m in minutes.values()]
    low, high = re.search(r"about (\d+) to (\d+) minutes per chapter on an H100", text).groups()
    assert (int(low), int(high)) == (round(min(h100)), round(max(h100)))
    cpu = {c: m["CPU tiny"] for c, m in minutes.items()}
    m = re.search(r"from under half a minute \(chapter (\d+)\) to about (\d+) minutes \(chapter (\d+)\)", text)
    shortest, most, longest = int(m.group(1)), int(m.group(2)), int(m.group(3))
    assert cpu[shortest] == min(cpu.values()) < 0.5
    assert cpu[longest] == max(cpu.values()) and round(cpu[longest]) == most


# What a T4 reader gets in chapters 7 and 9 (and the rest), said the same way on both pages.
T4_CLAIMS = [
    "chapters 1 to 6 and 8",
    "chapters 7 and 10 in part",
    "which train as many of the model's 24 layers as fit",
    "the two-GPU runs of 7.4",
    "the data-parallel run of 7.1",
    "the collectives of 7.7",
    "the one-GPU runs of 7.4 train the 1.3B architecture with fewer transformer blocks",
    "no FlashAttention or cuDNN attention kernels",
    "the T4 recipe fits",
]


@pytest.mark.parametrize("page", [INTRO, SETUP], ids=lambda p: p.name)
def test_landing_and_setup_say_the_same_about_a_t4(page):
    text = " ".join(page.read_text(encoding="utf-8").split())
    assert [claim for claim in T4_CLAIMS if claim not in text] == []


def test_the_24_layers_are_the_1_3b_models():
    from helpers import models

    assert models.config("polyglot-ko-1.3b", profile="full").num_hidden_layers == 24
