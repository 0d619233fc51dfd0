"""One home for the repository's address: ``repository.url`` of ``_config.yml``.

The chapters' install lines (and chapter 7's clone), the Colab links of the README and the setup page, the
launch buttons (Jupyter Book builds them from ``repository``) and the site's address (``html.baseurl``, the
repository's GitHub Pages address) all follow it. To move the book, change ``_config.yml``, then every place
this test names.
"""

import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CONFIG = yaml.safe_load((ROOT / "_config.yml").read_text(encoding="utf-8"))
REPO = CONFIG["repository"]["url"].rstrip("/")
BRANCH = CONFIG["repository"].get("branch", "main")
OWNER, NAME = re.fullmatch(r"https://github\.com/([\w.-]+)/([\w.-]+)", REPO).groups()
CHAPTERS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))
TEXTS = [ROOT / "README.md", *sorted((ROOT / "book").glob("*.md")), *CHAPTERS]

# Every way a text can name a GitHub repository of the book.
GIT_INSTALL = re.compile(r"git\+(https://github\.com/[\w.-]+/[\w.-]+?)(?:\.git)?(?=[\"'@#\s]|$)", re.M)
GIT_CLONE = re.compile(r"git clone\b[^\n]*?(https://github\.com/[\w.-]+/[\w.-]+?)(?:\.git)?(?=[\s\"']|$)", re.M)
COLAB = re.compile(r"colab\.research\.google\.com/github/([\w.-]+)/([\w.-]+)/blob/([\w.-]+)/([\w./-]+\.ipynb)")


def _setup_cell(path: Path) -> str:
    """The first code cell of a chapter's text twin."""
    import jupytext

    return next(c.source for c in jupytext.read(path).cells if c.cell_type == "code")


def test_config_names_the_repository_and_its_site():
    assert CONFIG["html"]["use_repository_button"] is True
    assert CONFIG["launch_buttons"]["colab_url"] == "https://colab.research.google.com"
    assert CONFIG["html"]["baseurl"] == f"https://{OWNER}.github.io/{NAME}/"


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem)
def test_each_chapters_install_line_installs_this_repository(chapter):
    setup = _setup_cell(chapter)
    found = GIT_INSTALL.findall(setup) + GIT_CLONE.findall(setup)
    assert found, f"{chapter.name}: no install line from GitHub in the setup cell"
    assert set(found) == {REPO}, f"{chapter.name}: {found} against _config.yml's {REPO}"


@pytest.mark.parametrize("path", TEXTS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_repository_address_in_the_text_is_the_configured_one(path):
    text = path.read_text(encoding="utf-8")
    for url in GIT_INSTALL.findall(text) + GIT_CLONE.findall(text):
        assert url == REPO, f"{path.name}: {url}"
    for owner, name, branch, notebook in COLAB.findall(text):
        assert (owner, name, branch) == (OWNER, NAME, BRANCH), f"{path.name}: Colab link to {owner}/{name}@{branch}"
        assert (ROOT / notebook).exists(), f"{path.name}: Colab link to a missing {notebook}"
    # The project's own GitHub address, wherever it is spelled out, is the configured one.
    for url in re.findall(rf"https://github\.com/{re.escape(OWNER)}/[\w.-]+", text):
        assert url.removesuffix(".git") == REPO, f"{path.name}: {url}"


def test_the_readme_and_setup_page_give_a_colab_link():
    for path in (ROOT / "README.md", ROOT / "book" / "setup.md"):
        assert COLAB.search(path.read_text(encoding="utf-8")), f"{path.name} gives no Colab link"
