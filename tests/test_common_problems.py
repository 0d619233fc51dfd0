"""The reference pages quote the book's runs: every such number must still be in a chapter's committed outputs.

``book/common_problems.md`` and ``book/which_technique.md`` are static prose that quotes measured numbers (with
the GPU that produced them). After a chapter is re-executed its numbers move; this test then names each
number that no committed output (or the memory planner, for the planner's predictions) prints any more, so
the page is updated instead of drifting. Numbers checked: decimals (``12.47``, ``3.26×``) and percentages
(``+73%``, and both ends of ``28 to 33%``); whole numbers in running text (``35 measured setups``) are not.

A number is looked up in the chapters its paragraph (or list item) links to, not in the whole book: a stale
``1.56×`` must not pass because another chapter happens to print 1.56. A whole-number percentage must appear
with its ``%`` there. A paragraph that links no chapter is checked against every chapter. The 7B-on-a-T4
estimate, which is arithmetic on the book's formula and datasheet table rather than a measurement, is
recomputed from ``helpers`` by its own test.
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
# A number with its kind: decimal, or a percentage (``12%``, or the first end of ``12 to 33%`` / ``+12% to +33%``).
FIGURE = re.compile(r"(?<![\w.#/-])[+−-]?(\d[\d,]*\.\d+|\d[\d,]*)(%|(?= to [+−-]?\d[\d,.]*%))?")
# Paragraphs and list items: the unit whose links say which chapters its numbers come from.
BLOCK = re.compile(r"\n\s*\n|\n(?=\s*(?:\d+\.|-) )")
LINKED_CHAPTER = re.compile(r"\.\./notebooks/(\d\d)_")


def chapter_outputs() -> dict[str, str]:
    """Each chapter's committed outputs as one text, by chapter number ("01" ... "10")."""
    chapters = {}
    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        parts = []
        for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
            for out in cell.get("outputs", []):
                data = out.get("data", {})
                for key in ("text/markdown", "text/plain", "text/html"):
                    parts.append("".join(data.get(key, "")))
                parts.append("".join(out.get("text", "")))
        chapters[path.name[:2]] = "\n".join(parts)
    return chapters


def outputs_text() -> str:
    return "\n".join(chapter_outputs().values())


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


@pytest.fixture(scope="module")
def sources() -> tuple[dict[str, str], str]:
    return chapter_outputs(), planner_text()


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


def quoted_figures(text: str) -> list[tuple[str, bool]]:
    """``(number, is_percentage)`` for each decimal and percentage of prose (code blocks and link texts out)."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"\[[^\]]*\]\([^)]*\)", "", text)
    found = []
    for m in FIGURE.finditer(text):
        number, percent = m.group(1), m.group(2) is not None
        if "." in number or percent:
            found.append((number, percent))
    return found


def blocks_with_chapters(text: str) -> list[tuple[str, list[str]]]:
    """The page's paragraphs and list items, each with the chapters it links to."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return [(block, sorted(set(LINKED_CHAPTER.findall(block)))) for block in BLOCK.split(text)]


def is_printed(number: str, percent: bool, text: str) -> bool:
    """Whether ``text`` prints ``number``: a decimal as itself (with or without thousands commas), a whole-number
    percentage with its ``%``."""
    if percent and "." not in number:
        return re.search(rf"(?<![\d.,]){re.escape(number)}\s?%", text) is not None
    plain = number.replace(",", "")
    return re.search(rf"(?<![\d.]){re.escape(number)}|(?<![\d.,]){re.escape(plain)}", text) is not None


def test_figures_parse_percent_ranges_and_blocks_find_their_chapters():
    assert quoted_figures("+32% to +33% at batch 8, 28 to 33% of 1.5 GiB, [4.3](x.ipynb#43-a), batch 16") == \
        [("32", True), ("33", True), ("28", True), ("33", True), ("1.5", False)]
    blocks = blocks_with_chapters("A [x](../notebooks/04_a.ipynb#b) 1.29\n\nB\n- item [y](../notebooks/09_c.ipynb)\n"
                                  "- item two")
    assert [chapters for _, chapters in blocks] == [["04"], [], ["09"], []]
    assert is_printed("64", True, "GPU busy 64% plain") and not is_printed("64", True, "batch 64, 1.64")
    assert is_printed("19,289", False, "19289.25 tokens/s") and not is_printed("1.56", False, "11.56")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_number_is_printed_by_a_chapter_its_paragraph_links_to(page, sources):
    chapters, planner = sources
    missing = []
    for block, linked in blocks_with_chapters(page.read_text(encoding="utf-8")):
        text = "\n".join(chapters[c] for c in (linked or chapters)) + "\n" + planner
        for number, percent in quoted_figures(block):
            if number not in NOT_MEASURED and not is_printed(number, percent, text):
                where = f"chapter{'s' if len(linked) != 1 else ''} {', '.join(linked)}" if linked else "any chapter"
                missing.append(f"{number}{'%' if percent else ''} (not in {where}'s outputs): "
                               f"{' '.join(block.split())[:70]}...")
    assert missing == [], f"{page.name} quotes numbers its linked chapters no longer print:\n" + "\n".join(missing)


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


def test_the_7b_on_a_t4_estimate_is_the_books_formula_on_the_numbers_it_quotes():
    """common_problems' "how fast" answer: 6N + 12·L·d·s per token (helpers.flops), a third of 6N skipped by LoRA,
    the T4's fp16 datasheet peak (helpers.gpus), then the capstone's best MFU and QLoRA's measured slowdown as
    the page quotes them (the other test holds those two to the chapters' outputs)."""
    from helpers import flops, gpus, models

    text = " ".join((ROOT / "book" / "common_problems.md").read_text(encoding="utf-8").split())
    section = text[text.index("## Will a 7B model train on a T4"):]
    seq = int(re.search(r"about \d+ GFLOP per token at (\d+) tokens", section).group(1))
    model = models.build("llama-2-7b", profile="full", head="causal-lm", device="meta")
    config = models.config("llama-2-7b", profile="full")
    n = flops.matmul_params(model)
    per_token = flops.flops_per_token(n, config.num_hidden_layers, config.hidden_size, seq)
    lora = per_token - 2 * n  # no weight gradients for the frozen base: a third of 6N
    peak = gpus.PEAK_TFLOPS["T4"]["fp16"]
    ceiling = peak * 1e12 / lora
    mfu = float(re.search(r"best MFU the capstone reached after every optimisation, ([\d.]+)%", section).group(1))
    slowdown = float(re.search(r"4-bit base at ([\d.]+)× the 16-bit base's speed", section).group(1))
    estimate = ceiling * mfu / 100 * slowdown
    assert f"about {per_token / 1e9:.0f} GFLOP per token" in section
    assert f"which leaves about {lora / 1e9:.0f} GFLOP" in section
    assert f"datasheet peak, {peak:.0f} TFLOP/s in fp16" in section
    assert f"at most about {round(ceiling, -2):,.0f} tokens/s" in section
    assert f"that is about {round(estimate, -1):,.0f} tokens/s" in section
    assert f"a million tokens in about {round(1e6 / estimate / 60, -1):.0f} minutes" in section
