#!/usr/bin/env python3
"""Make the chapters read in Jupyter and Colab as they read on the site.

Two rewrites of ``notebooks/NN_slug.ipynb`` and of its jupytext twin ``NN_slug.py`` (outputs, cell ids and
execution stamps untouched: only cell metadata, a comment line and markdown links change):

1. **Sentence code collapsed.** Every code cell tagged ``remove-input`` (the site hides its input: it writes a
   sentence from the run's numbers) gets ``metadata.jupyter.source_hidden = true`` (JupyterLab and Notebook 7
   collapse its input), Colab's ``metadata.cellView = "form"`` and, as its first line, a Colab
   ``# @title <what it writes>`` comment (Colab shows the title in place of the hidden code). The title is the
   first line of the docstring of the first function the cell defines, else the cell's first comment, else
   "Sentences from this run's numbers" and the section the cell sits in. A comment is not part of a cell's
   execution stamp (``scripts/stamps.py`` hashes the AST), so no chapter turns stale.
2. **Absolute links.** Markdown links to the book's pages (``../book/setup.md``, ``../book/references.md#x``)
   and to sibling chapters (``02_dtypes_quantization.ipynb``) break in Colab, which opens one notebook alone.
   They become absolute URLs of the published site, ``html.baseurl`` of ``_config.yml`` (its one home):
   ``<baseurl>book/setup.html``, ``<baseurl>notebooks/02_dtypes_quantization.html``. In the site build, the
   ``sitelinks`` extension (``book/_ext/sitelinks.py``) turns every link under ``html.baseurl`` back into a
   relative link to the page, so the built site keeps working offline and its link check still covers them.
   Links inside code cells (sentences rendered by code) are reported, not changed.
3. **The glossary at first use.** In each chapter, the first use of each term of ``GLOSSARY_FIRST_USE`` in a
   markdown cell's running text (not in a heading, code, math, a link or an HTML tag) links to the term's row
   of the glossary (``<baseurl>book/glossary.html#gpu-busy``); a chapter that already links a term's row is
   left alone.

Idempotent: a second run changes nothing. The twin is rewritten as jupytext writes it from the notebook, which
is what ``scripts/check_twins.py`` asks; a pair out of sync before the run is refused (sync it first).

Usage:
    python scripts/reader_view.py [NOTEBOOK ...]          # rewrite (default: notebooks/[0-9][0-9]_*.ipynb)
    python scripts/reader_view.py --check [NOTEBOOK ...]  # exit 1 if any notebook needs a change
"""

from __future__ import annotations

import argparse
import ast
import copy
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "_config.yml"
HIDDEN_TAG = "remove-input"
TITLE_LINE = re.compile(r"^\s*#\s*@title\b")
TITLE_MAX = 90
DEFAULT_TITLE = "Sentences from this run's numbers"

# A markdown link target that points at a page of the book or a sibling chapter, relative to notebooks/.
RELATIVE_LINK = re.compile(
    r"(?P<open>\]\(\s*<?)"
    r"(?:(?:\./)?\.\./book/(?P<page>[\w./-]+?)\.(?:md|ipynb|rst)|(?:\./)?(?P<chapter>\d\d_[\w-]+)\.ipynb)"
    r"(?P<frag>#[^)\s>]*)?"
    r"(?=>?[)\s])"
)
# Any relative link to the book's pages, in any cell (what tests, --check and scripts/check_notebooks.py look for):
# into ../book/, to a sibling chapter, or to any page or notebook (.md, .ipynb, .html) by a non-absolute address.
ANY_RELATIVE_BOOK_LINK = re.compile(r"\]\(\s*<?(?:\./)?\.\./book/|\]\(\s*<?(?:\./)?\d\d_[\w-]+\.ipynb"
                                    r"|\]\((?!\s*<?https?://)[^)\s]*\.(?:md|ipynb|html)(?:#[^)\s]*)?\)")


def load_config(path: Path = CONFIG) -> dict:
    import yaml

    return yaml.safe_load(path.read_text(encoding="utf-8")) or {}


def site_url(config: dict | None = None) -> str:
    """The published site's address (``html.baseurl`` of ``_config.yml``), ending in ``/``."""
    config = load_config() if config is None else config
    url = (config.get("html") or {}).get("baseurl") or ""
    if not re.match(r"https?://", url):
        raise ValueError(f"_config.yml: html.baseurl must be the site's absolute URL, got {url!r}")
    return url if url.endswith("/") else url + "/"


def repository_url(config: dict | None = None) -> str:
    """The repository's address (``repository.url`` of ``_config.yml``), without a trailing ``/``."""
    config = load_config() if config is None else config
    return (config.get("repository") or {}).get("url", "").rstrip("/")


# ---------------------------------------------------------------------------------------------------------
# 1. Collapsed sentence cells


def _plain(text: str) -> str:
    """Markdown heading or comment text without its markup: links, code ticks, emphasis."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[`*]", "", text)
    return " ".join(text.split())


def _balanced(text: str) -> str:
    """Text cut before its last unclosed parenthesis."""
    while text.count("(") > text.count(")"):
        text = text[: text.rfind("(")].rstrip(" ,;:")
    return text


def _shorten(text: str, limit: int = TITLE_MAX) -> str:
    """The first clause of a text (up to a full stop, colon or semicolon), at most ``limit`` characters."""
    text = _plain(text)
    first = _balanced(re.split(r"(?<=[\w)])[.:;](?:\s|$)", text, maxsplit=1)[0].rstrip(" .:;"))
    if len(first) <= limit:
        return first
    return _balanced(first[: limit - 1].rsplit(" ", 1)[0]).rstrip(",;:( ") + "…"


def _body_without_title(source: str) -> str:
    lines = source.split("\n")
    return "\n".join(lines[1:]) if lines and TITLE_LINE.match(lines[0]) else source


def title_for(source: str, section: str | None) -> str:
    """A short description of what a sentence cell writes (the text after ``# @title``)."""
    body = _body_without_title(source)
    try:
        tree = ast.parse(body)
    except SyntaxError:
        tree = None
    if tree is not None:
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and doc.strip():
                    return _shorten(doc.strip().splitlines()[0] if doc.strip() else "")
                break
    for line in body.split("\n"):
        stripped = line.strip()
        if not stripped:
            continue
        if stripped.startswith("#") and not stripped.startswith(("#!", "# NBVAL", "# noqa")):
            text = stripped.lstrip("#").strip()
            if text:
                return _shorten(text)
        break
    return f"{DEFAULT_TITLE} ({_shorten(section, 60)})" if section else DEFAULT_TITLE


def _colab_safe(title: str) -> str:
    """Colab reads ``{...}`` after a title as form options: keep braces out."""
    return title.replace("{", "(").replace("}", ")")


def with_title(source: str, title: str) -> str:
    """The source with ``# @title <title>`` as its first line (replacing an existing title line)."""
    body = _body_without_title(source)
    return f"# @title {title}\n{body}" if body else f"# @title {title}"


def _heading(markdown: str) -> str | None:
    found = None
    for line in markdown.split("\n"):
        m = re.match(r"^#{1,4}\s+(.+?)\s*#*\s*$", line)
        if m:
            found = m.group(1)
    return found


def collapse_cells(nb) -> list[str]:
    """Collapse every ``remove-input`` code cell in place; the changes made, one line each."""
    changes = []
    section = None
    for index, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown":
            section = _heading(cell.source) or section
            continue
        if cell.cell_type != "code" or HIDDEN_TAG not in cell.metadata.get("tags", []):
            continue
        label = cell.get("id", f"#{index}")
        jupyter = cell.metadata.get("jupyter", {})
        if jupyter.get("source_hidden") is not True:
            cell.metadata["jupyter"] = {**jupyter, "source_hidden": True}
            changes.append(f"cell {label}: jupyter.source_hidden")
        if cell.metadata.get("cellView") != "form":
            cell.metadata["cellView"] = "form"
            changes.append(f"cell {label}: cellView form")
        new = with_title(cell.source, _colab_safe(title_for(cell.source, section)))
        if new != cell.source:
            cell.source = new
            changes.append(f"cell {label}: # @title")
    return changes


# ---------------------------------------------------------------------------------------------------------
# 2. Absolute links


def absolute_links(markdown: str, site: str) -> str:
    """Markdown with its links to ``../book/*.md`` and sibling ``NN_*.ipynb`` made absolute under ``site``."""
    def repl(m: re.Match) -> str:
        target = f"book/{m['page']}.html" if m["page"] else f"notebooks/{m['chapter']}.html"
        return f"{m['open']}{site}{target}{m['frag'] or ''}"

    return RELATIVE_LINK.sub(repl, markdown)


def relative_links(source: str) -> list[str]:
    """The relative links to the book's pages or sibling chapters left in a cell's source."""
    return [source[m.start(): source.find(")", m.start()) + 1] for m in ANY_RELATIVE_BOOK_LINK.finditer(source)]


def link_cells(nb, site: str) -> list[str]:
    """Make the markdown cells' links absolute, in place; the changes made, one line each."""
    changes = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "markdown":
            continue
        new = absolute_links(cell.source, site)
        if new != cell.source:
            n = len(RELATIVE_LINK.findall(cell.source))
            changes.append(f"cell {cell.get('id', f'#{index}')}: {n} link(s) made absolute")
            cell.source = new
    return changes


def code_cell_links(nb) -> list[tuple[str, str]]:
    """(cell id, link) for relative book links inside code cells (rendered sentences): reported only."""
    return [(cell.get("id", f"#{i}"), link) for i, cell in enumerate(nb.cells) if cell.cell_type == "code"
            for link in relative_links(cell.source)]


# ---------------------------------------------------------------------------------------------------------
# 3. The glossary at first use

# Term as the chapters write it -> its anchor in book/glossary.md (technical terms only: a word that is also
# plain English, such as "padding" or "verdict", is not linked automatically).
GLOSSARY_FIRST_USE = {
    "CUDA context": "cuda-context",
    "caching allocator": "caching-allocator",
    "peak allocated": "peak-allocated-memory",
    "optimizer states": "optimizer-states",
    "activations": "activations",
    "autocast": "autocast",
    "mixed precision": "mixed-precision",
    "tensor cores": "tensor-cores",
    "loss scaling": "loss-scaling",
    "micro-batch": "micro-batch",
    "gradient accumulation": "gradient-accumulation",
    "gradient checkpointing": "gradient-checkpointing",
    "SDPA": "sdpa",
    "LoRA": "lora",
    "QLoRA": "qlora",
    "NF4": "nf4",
    "DDP": "ddp",
    "ZeRO": "zero",
    "FSDP": "fsdp",
    "NVML": "nvml",
    "MFU": "mfu",
    "GPU-busy": "gpu-busy",
    "GPU busy": "gpu-busy",
    "host enqueue": "host-enqueue",
    "host-bound": "host-bound",
    "GPU-bound": "gpu-bound",
    "CUDA graph": "cuda-graph",
    "graph break": "graph-break",
    "expandable_segments": "expandable-segments",
}
# Markdown a link must not go into: headings, code, math, links (and images), HTML tags.
PROTECTED = re.compile(r"^[ \t]*#[^\n]*|```[\s\S]*?```|`[^`\n]*`|\$\$[\s\S]*?\$\$|\$[^$\n]*\$"
                       r"|!?\[[^\]]*\]\([^)]*\)|<[^>\n]*>", re.M)


def _free_spans(text: str) -> list[tuple[int, int]]:
    spans, start = [], 0
    for m in PROTECTED.finditer(text):
        spans.append((start, m.start()))
        start = m.end()
    return spans + [(start, len(text))]


def glossary_cells(nb, site: str) -> list[str]:
    """Link each glossary term's first use in the chapter's running text, in place; the changes made."""
    glossary = f"{site}book/glossary.html#"
    markdown = [cell for cell in nb.cells if cell.cell_type == "markdown"]
    changes = []
    for term, anchor in GLOSSARY_FIRST_USE.items():
        if any(f"{glossary}{anchor})" in cell.source for cell in markdown):
            continue
        pattern = re.compile(rf"(?<![\w`\[/#.-]){re.escape(term)}(?![\w`-])")
        for cell in markdown:
            found = next((m for a, b in _free_spans(cell.source) for m in [pattern.search(cell.source, a, b)] if m),
                         None)
            if found:
                cell.source = (cell.source[: found.start()] + f"[{found.group()}]({glossary}{anchor})"
                               + cell.source[found.end():])
                changes.append(f"cell {cell.get('id', '?')}: glossary link for {term!r}")
                break
    return changes


# ---------------------------------------------------------------------------------------------------------


def transform(nb, site: str) -> list[str]:
    """The three rewrites on a notebook (an ``nbformat`` node), in place; the changes made."""
    return collapse_cells(nb) + link_cells(nb, site) + glossary_cells(nb, site)


def process(path: Path, site: str, check: bool) -> tuple[list[str], list[tuple[str, str]]]:
    """Rewrite one notebook and its twin (or, with ``check``, only say what would change)."""
    import jupytext
    import nbformat

    nb = nbformat.read(path, as_version=4)
    before = copy.deepcopy(nb)
    changes = transform(nb, site)
    if check or not changes:
        return changes, code_cell_links(nb)
    twin = path.with_suffix(".py")
    if twin.exists() and twin.read_text(encoding="utf-8") != jupytext.writes(before, fmt="py:percent"):
        raise SystemExit(f"{twin} is out of sync with {path.name}: run jupytext --sync {path} first")
    nbformat.write(nb, path)
    if twin.exists():  # from the notebook as written (its JSON sorts the metadata keys), as check_twins does
        twin.write_text(jupytext.writes(nbformat.read(path, as_version=4), fmt="py:percent"), encoding="utf-8")
    return changes, code_cell_links(nb)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a notebook needs a change")
    ap.add_argument("--verbose", "-v", action="store_true", help="list every change")
    ap.add_argument("notebooks", nargs="*", type=Path)
    args = ap.parse_args(argv)
    paths = args.notebooks or sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    site = site_url()
    pending = 0
    for path in paths:
        changes, in_code = process(path, site, args.check)
        pending += bool(changes)
        verb = "needs" if args.check else "made"
        print(f"{path.name}: " + (f"{verb} {len(changes)} change(s)" if changes else "ok"))
        if args.verbose or args.check:
            for line in changes[:200 if args.verbose else 5]:
                print(f"    {line}")
            if args.check and not args.verbose and len(changes) > 5:
                print(f"    ... and {len(changes) - 5} more")
        for cell_id, link in in_code:
            print(f"    note: cell {cell_id} (code) renders a relative link, left as it is: {link}")
    if args.check and pending:
        print(f"{pending} notebook(s) need: python scripts/reader_view.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
