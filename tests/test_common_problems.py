"""The reference pages quote the book's runs: every such number must still be in a chapter's committed outputs.

``book/common_problems.md`` and ``book/which_technique.md`` are static prose that quotes measured numbers (with
the GPU that produced them). After a chapter is re-executed its numbers move; this test then names each
number that no committed output (or the memory planner, for the planner's predictions) prints any more, so
the page is updated instead of drifting. Numbers checked: decimals (``12.47``, ``3.26×``) and percentages
(``+73%``); whole numbers in running text (``35 measured setups``) are not.
"""

import contextlib
import io
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "book" / "common_problems.md", ROOT / "book" / "which_technique.md"]
# The planner commands the pages quote (their predictions are not in a chapter's outputs).
PLANNER_RUNS = [
    ["--model", "gpt-neox-1.3b", "--batch", "4", "--seq", "256", "--precision", "bf16-autocast", "--optimizer",
     "adamw", "--gpu", "T4"],
    ["--model", "gpt-neox-1.3b", "--batch", "4", "--seq", "256", "--precision", "bf16-autocast", "--optimizer",
     "adamw-fused", "--gpu", "T4"],
    ["--model", "llama-2-7b", "--batch", "1", "--seq", "512", "--precision", "fp16", "--lora-rank", "16",
     "--lora-targets", "q_proj,v_proj", "--qlora", "--optimizer", "paged-adamw8bit", "--gpu", "T4"],
    ["--model", "llama-2-7b", "--batch", "1", "--seq", "512", "--precision", "bf16-autocast", "--optimizer",
     "adamw", "--gpu", "T4"],
]
# Numbers that are facts of the setup, not of a run (the datasheet, the T4's size, the rules the pages state).
NOT_MEASURED = {"14.75", "2.0", "8.0", "7.5", "0.18", "0.17"}
NUMBER = re.compile(r"(?<![\w.#/-])[+−-]?(\d[\d,]*\.\d+|\d[\d,]*(?=%))")


def outputs_text() -> str:
    parts = []
    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
            for out in cell.get("outputs", []):
                data = out.get("data", {})
                for key in ("text/markdown", "text/plain", "text/html"):
                    parts.append("".join(data.get(key, "")))
                parts.append("".join(out.get("text", "")))
    return "\n".join(parts)


def planner_text() -> str:
    from helpers import plan

    printed = io.StringIO()
    for args in PLANNER_RUNS:
        with contextlib.redirect_stdout(printed), contextlib.suppress(SystemExit):
            plan.main(args)
    return printed.getvalue()


@pytest.fixture(scope="module")
def haystack() -> str:
    return outputs_text() + "\n" + planner_text()


def quoted_numbers(text: str) -> list[str]:
    """The decimals and percentages of a page's prose (code blocks and links, whose texts are section
    numbers, left out)."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"\[[^\]]*\]\([^)]*\)", "", text)
    return [m.group(1) for m in NUMBER.finditer(text)]


def test_quoted_numbers_parse_the_forms_the_pages_use():
    assert quoted_numbers("+73% at batch 8, 1.77 times, 12.47 GiB, [4.3](x.ipynb#43-a), 3.26× faster, 2^16") == \
        ["73", "1.77", "12.47", "3.26"]
    assert quoted_numbers("```\npython -m helpers.plan --batch 4.5\n```\n0.076% of 20,228.5") == ["0.076", "20,228.5"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_number_the_page_quotes_is_in_a_committed_output_or_the_planner(page, haystack):
    missing = []
    for number in quoted_numbers(page.read_text(encoding="utf-8")):
        if number in NOT_MEASURED:
            continue
        plain = number.replace(",", "")
        if not re.search(rf"(?<![\d.]){re.escape(number)}|(?<![\d.,]){re.escape(plain)}", haystack):
            missing.append(number)
    assert missing == [], f"{page.name} quotes numbers no committed output prints any more: {missing}"
