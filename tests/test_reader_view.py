"""scripts/reader_view.py: sentence cells collapsed for Jupyter and Colab, absolute links to the book's pages.

The first two tests read the committed chapters: they pass once `python scripts/reader_view.py` has been run
on them (it rewrites the notebooks and their twins; `--check` says what it would change).
"""

import importlib.util
import json
import sys
from pathlib import Path

import jupytext
import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


reader_view = _load("reader_view")
stamps = _load("stamps")
check_twins = _load("check_twins")
SITE = "https://example.org/book/"


@pytest.mark.parametrize("notebook", CHAPTERS, ids=lambda p: p.stem)
def test_every_site_hidden_cell_is_collapsed_for_jupyter_and_colab(notebook):
    nb = json.loads(notebook.read_text(encoding="utf-8"))
    for cell in nb["cells"]:
        if cell["cell_type"] != "code" or "remove-input" not in cell["metadata"].get("tags", []):
            continue
        where = f"{notebook.name} cell {cell.get('id')} (run: python scripts/reader_view.py)"
        assert cell["metadata"].get("jupyter", {}).get("source_hidden") is True, where
        assert cell["metadata"].get("cellView") == "form", where
        first = "".join(cell["source"]).split("\n", 1)[0]
        assert first.startswith("# @title ") and len(first) > len("# @title ") + 3, where


@pytest.mark.parametrize("notebook", CHAPTERS, ids=lambda p: p.stem)
def test_no_relative_link_to_the_books_pages_in_a_notebooks_markdown(notebook):
    nb = json.loads(notebook.read_text(encoding="utf-8"))
    found = [link for cell in nb["cells"] if cell["cell_type"] == "markdown"
             for link in reader_view.relative_links("".join(cell["source"]))]
    assert found == [], f"{notebook.name}: relative links break in Colab (run: python scripts/reader_view.py)"


def test_check_mode_passes_on_the_committed_chapters():
    assert reader_view.main(["--check"]) == 0


def test_site_url_is_the_repositorys_pages_address():
    config = reader_view.load_config()
    owner, name = reader_view.repository_url(config).removeprefix("https://github.com/").split("/")
    assert reader_view.site_url(config) == f"https://{owner}.github.io/{name}/"


def test_site_url_must_be_absolute():
    with pytest.raises(ValueError, match="baseurl"):
        reader_view.site_url({"html": {"baseurl": "/book/"}})
    assert reader_view.site_url({"html": {"baseurl": "https://x.org/b"}}) == "https://x.org/b/"


# ----- the transform, on a small fabricated notebook -----------------------------------------------------

SENTENCE = 'if prof.on_gpu:\n    display(Markdown(f"peak {peak:.1f} GiB"))\nelse:\n    print("skipped on CPU")'
DEFINES = 'def flat_sentence(c):\n    """The flat step against the packed one (interleaved). More words."""\n    return "x"'
COMMENTED = "# The verdict in words\nprose.say(verdict)"


def fabricated():
    nb = nbformat.v4.new_notebook()
    nb.metadata["jupytext"] = {"formats": "ipynb,py:percent",
                               "notebook_metadata_filter": "-jupytext.text_representation.jupytext_version"}
    md = nbformat.v4.new_markdown_cell
    code = nbformat.v4.new_code_cell
    hidden = {"tags": ["remove-input"]}
    nb.cells = [
        md("# 3. Batches\n\nSee the [setup page](../book/setup.md), [Hu et al. (2022)](../book/references.md#hu2022),"
           " [chapter 2](02_dtypes_quantization.ipynb#21-formats) and [PyTorch](https://pytorch.org/docs)."),
        code("x = 1"),
        md("## 3.1 What a larger batch costs: and buys"),
        code(SENTENCE, metadata=dict(hidden)),
        code(DEFINES, metadata=dict(hidden)),
        code(COMMENTED, metadata={"tags": ["remove-input", "keep"], "jupyter": {"outputs_hidden": False}}),
        code('prose.say("see [refs](../book/references.md)")', metadata=dict(hidden)),
    ]
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"c{i}"
    return nb


def test_collapse_sets_the_metadata_and_a_title():
    nb = fabricated()
    changes = reader_view.collapse_cells(nb)
    assert changes
    shown = nb.cells[1]
    assert "jupyter" not in shown.metadata and "cellView" not in shown.metadata and shown.source == "x = 1"
    for cell in nb.cells[3:]:
        assert cell.metadata["jupyter"]["source_hidden"] is True
        assert cell.metadata["cellView"] == "form"
        assert cell.source.startswith("# @title ")
    assert nb.cells[5].metadata["jupyter"]["outputs_hidden"] is False  # other jupyter keys kept
    assert nb.cells[5].metadata["tags"] == ["remove-input", "keep"]
    titles = [c.source.split("\n", 1)[0] for c in nb.cells[3:]]
    assert titles[0] == "# @title Sentences from this run's numbers (3.1 What a larger batch costs)"
    assert titles[1] == "# @title The flat step against the packed one (interleaved)"
    assert titles[2] == "# @title The verdict in words"
    assert nb.cells[3].source.split("\n", 1)[1] == SENTENCE


def test_collapse_is_idempotent_and_replaces_an_old_title():
    nb = fabricated()
    reader_view.collapse_cells(nb)
    once = [c.source for c in nb.cells]
    assert reader_view.collapse_cells(nb) == []
    assert [c.source for c in nb.cells] == once
    nb.cells[4].source = "# @title an outdated title\n" + DEFINES
    assert reader_view.collapse_cells(nb) == ["cell c4: # @title"]
    assert nb.cells[4].source == once[4]


def test_the_title_line_leaves_the_execution_stamp_alone():
    nb = fabricated()
    before = [stamps.cell_hash(c.source) for c in nb.cells if c.cell_type == "code"]
    reader_view.collapse_cells(nb)
    assert [stamps.cell_hash(c.source) for c in nb.cells if c.cell_type == "code"] == before


def test_titles_are_short_balanced_and_colab_safe():
    long_doc = 'def f():\n    """' + "word " * 40 + '(the tail)"""'
    title = reader_view.title_for(long_doc, None)
    assert len(title) <= reader_view.TITLE_MAX and title.endswith("…")
    assert reader_view.title_for('def f():\n    """One n x n product (``t``: the time)."""', None) == \
        "One n x n product"
    assert reader_view.title_for("y = 2", None) == reader_view.DEFAULT_TITLE
    assert reader_view.title_for("y = 2", "1.6 [The *rule*](x.md): `4 x`") == \
        f"{reader_view.DEFAULT_TITLE} (1.6 The rule)"
    assert reader_view.title_for("%time y = 2", "A") == f"{reader_view.DEFAULT_TITLE} (A)"  # not Python: no crash
    assert "{" not in reader_view._colab_safe("a {display-mode: 'form'}")


def test_links_become_absolute_site_urls():
    nb = fabricated()
    changes = reader_view.link_cells(nb, SITE)
    assert changes == ["cell c0: 3 link(s) made absolute"]
    text = nb.cells[0].source
    assert "(https://example.org/book/book/setup.html)" in text
    assert "(https://example.org/book/book/references.html#hu2022)" in text
    assert "(https://example.org/book/notebooks/02_dtypes_quantization.html#21-formats)" in text
    assert "(https://pytorch.org/docs)" in text
    assert reader_view.relative_links(text) == []
    assert reader_view.link_cells(nb, SITE) == []  # idempotent
    # code cells (rendered sentences) are reported, not changed
    assert reader_view.code_cell_links(nb) == [("c6", "](../book/references.md)")]
    assert "../book/references.md" in nb.cells[6].source


def test_link_forms():
    f = reader_view.absolute_links
    assert f("[a](./../book/glossary.md)", SITE) == f"[a]({SITE}book/glossary.html)"
    assert f("[a](<../book/glossary.md>)", SITE) == f"[a](<{SITE}book/glossary.html>)"
    assert f('[a](../book/glossary.md "the glossary")', SITE) == f'[a]({SITE}book/glossary.html "the glossary")'
    assert f("[a](10_capstone.ipynb)", SITE) == f"[a]({SITE}notebooks/10_capstone.html)"
    assert f("see ../book/setup.md in the repository", SITE) == "see ../book/setup.md in the repository"
    assert f("[a](../book/_static/x.png)", SITE) == "[a](../book/_static/x.png)"


def _write_pair(folder: Path, nb) -> Path:
    path = folder / "03_batches.ipynb"
    nbformat.write(nb, path)
    path.with_suffix(".py").write_text(jupytext.writes(nbformat.read(path, as_version=4), fmt="py:percent"))
    return path


def test_process_rewrites_the_notebook_and_its_twin_in_sync(tmp_path):
    nb = fabricated()
    nb.cells[3].outputs = [nbformat.v4.new_output("display_data", data={"text/markdown": "peak 1.0 GiB"})]
    path = _write_pair(tmp_path, nb)
    before = path.read_bytes(), path.with_suffix(".py").read_bytes()
    changes, in_code = reader_view.process(path, SITE, check=True)
    assert changes and in_code == [("c6", "](../book/references.md)")]
    assert (path.read_bytes(), path.with_suffix(".py").read_bytes()) == before  # check mode wrote nothing
    reader_view.process(path, SITE, check=False)
    assert check_twins.twin_problems(path) == []
    written = nbformat.read(path, as_version=4)
    assert written.cells[3].outputs[0]["data"]["text/markdown"] == "peak 1.0 GiB"
    assert [c["id"] for c in written.cells] == [f"c{i}" for i in range(7)]
    twin = path.with_suffix(".py").read_text()
    assert 'cellView="form"' in twin and '"source_hidden": true' in twin and "# @title" in twin
    again = jupytext.reads(twin, fmt="py:percent")  # the twin alone keeps the metadata
    assert again.cells[3].metadata["cellView"] == "form"
    assert reader_view.process(path, SITE, check=True)[0] == []


def test_process_refuses_a_twin_out_of_sync(tmp_path):
    path = _write_pair(tmp_path, fabricated())
    twin = path.with_suffix(".py")
    twin.write_text(twin.read_text() + "\n# %%\nedited = True\n")
    with pytest.raises(SystemExit, match="out of sync"):
        reader_view.process(path, SITE, check=False)


def test_the_site_build_turns_absolute_links_back_into_its_own_pages():
    """book/_ext/sitelinks.py: what reader_view writes, the site reads as a link to its own page."""
    sys.path.insert(0, str(ROOT / "book" / "_ext"))
    try:
        import sitelinks
    finally:
        sys.path.remove(str(ROOT / "book" / "_ext"))
    written = reader_view.absolute_links("[a](../book/setup.md#colab) [b](04_gradient_checkpointing.ipynb)", SITE)
    targets = [sitelinks.site_target(u, SITE) for u in (f"{SITE}book/setup.html#colab",
                                                         f"{SITE}notebooks/04_gradient_checkpointing.html")]
    assert f"{SITE}book/setup.html#colab" in written
    assert targets == [("book/setup", "colab"), ("notebooks/04_gradient_checkpointing", "")]
    assert sitelinks.site_target(SITE, SITE) == ("index", "")
    assert sitelinks.site_target("https://pytorch.org/docs/x.html", SITE) is None
    assert sitelinks.site_target(f"{SITE}_static/x.png", SITE) is None


# ----- the glossary at first use ------------------------------------------------------------------------


def _glossary_ids() -> list[str]:
    import re

    return re.findall(r'<span id="([^"]+)"></span>', (ROOT / "book" / "glossary.md").read_text(encoding="utf-8"))


def test_the_glossary_is_a_table_of_at_least_80_terms_each_with_an_anchor_and_both_languages():
    text = (ROOT / "book" / "glossary.md").read_text(encoding="utf-8")
    rows = [line for line in text.splitlines() if line.startswith("| <span id=")]
    ids = _glossary_ids()
    assert len(rows) == len(ids) >= 80 and len(set(ids)) == len(ids)
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        assert len(cells) == 3 and all(cells), row
        assert any("\uac00" <= ch <= "\ud7a3" for ch in cells[1]) or cells[1].isascii(), row  # Korean (or a name)
    for needed in ("host-enqueue", "gpu-busy", "knee", "graph-break", "verdict", "utilisation-utilization", "mfu"):
        assert needed in ids, needed
    assert "utilization" in text and "utilisation" in text


def test_every_first_use_link_points_at_a_glossary_anchor():
    assert set(reader_view.GLOSSARY_FIRST_USE.values()) <= set(_glossary_ids())


def _md(source, cell_id):
    cell = nbformat.v4.new_markdown_cell(source)
    cell["id"] = cell_id
    return cell


def test_glossary_links_go_to_the_first_use_in_running_text_only():
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        _md("# 8. The GPU-busy fraction\n\nWe time `GPU-busy` in code and $GPU-busy$ in math, [GPU-busy](x.md) "
            "in a link, <b title='GPU-busy'>x</b>.", "m0"),
        nbformat.v4.new_code_cell("gpu_busy = 'GPU-busy'"),
        _md("The *GPU-busy* fraction, then GPU-busy again. LoRA, not QLoRA-ish; a host-bound step.", "m1"),
        _md("GPU-busy a third time; host-bound again.", "m2"),
    ]
    changes = reader_view.glossary_cells(nb, SITE)
    gloss = f"{SITE}book/glossary.html#"
    assert nb.cells[0].source.startswith("# 8. The GPU-busy fraction\n\nWe time `GPU-busy` in code")
    assert gloss not in nb.cells[0].source
    assert nb.cells[2].source == (f"The *[GPU-busy]({gloss}gpu-busy)* fraction, then GPU-busy again. "
                                  f"[LoRA]({gloss}lora), not QLoRA-ish; a [host-bound]({gloss}host-bound) step.")
    assert nb.cells[3].source == "GPU-busy a third time; host-bound again."
    assert nb.cells[1].source == "gpu_busy = 'GPU-busy'"
    assert sorted(changes) == ["cell m1: glossary link for 'GPU-busy'", "cell m1: glossary link for 'LoRA'",
                               "cell m1: glossary link for 'host-bound'"]
    assert reader_view.glossary_cells(nb, SITE) == []  # idempotent: a linked term is not linked again
