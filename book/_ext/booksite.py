"""Site-only fixes for the rendered book, applied at build time (the notebooks' outputs are not touched).

- MathJax 3 is served from the site itself (a copy from the ``django-static-mathjax`` package on PyPI),
  so the math renders offline and on mirrors; pages without math do not load it.
- Page weight: assets a page does not use are not linked (Font Awesome's 1.5 MB JavaScript, whose
  icons the theme's CSS web font already draws; sphinx-thebe, which this book does not use; sphinx-design
  and togglebutton where a page has none of their elements).
- Result tables: cells that pandas fills with ``NaN`` (a column that does not apply to a row) show "–";
  wide tables scroll inside their box (``booksite.css``).
- Output figures get the alt text written for them in ``book/figure_alt.yml`` (by chapter, in order of
  appearance); a chapter whose figure count no longer matches that file is a build warning (an error
  under ``-W``).
- ``helpers-api``: a directive that documents every module of ``helpers`` with autodoc, the module list
  taken from the package itself (``pkgutil``), so new modules appear without editing the page.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
import shutil
from pathlib import Path

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.errors import ExtensionError
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles

logger = logging.getLogger(__name__)
HERE = Path(__file__).parent
MATHJAX_DIR = "mathjax"  # under _static/
# The MathJax parts a page can load: the combined TeX-to-CommonHTML component, its web fonts, and the
# TeX extensions and UI pieces it may fetch on demand.
MATHJAX_PARTS = ["tex-chtml.js", "output/chtml/fonts/woff-v2", "input/tex/extensions", "ui", "a11y", "adaptors"]
NAN_CELL = re.compile(r"(<td[^>]*>)\s*(?:NaN|nan|&lt;NA&gt;)\s*(</td>)")
OUTPUT_IMG = re.compile(r'<img alt="([^"]*_images/[^"]+)" src="([^"]+)"')
DROP_ALWAYS = ("fontawesome.js", "sphinx-thebe")


def _mathjax_source() -> Path:
    try:
        import mathjax  # django-static-mathjax: MathJax 3 in a Python package
    except ImportError as exc:
        raise ExtensionError("booksite: install django-static-mathjax (pip install -e '.[book]')") from exc
    es5 = Path(mathjax.__file__).parent / "static" / "mathjax" / "es5"
    if not (es5 / "tex-chtml.js").exists():
        raise ExtensionError(f"booksite: no MathJax 3 es5 build under {es5}")
    return es5


FONTAWESOME_JS = re.compile(r'\s*<script defer src="[^"]*_static/scripts/fontawesome\.js[^"]*"></script>')


def _finish(app: Sphinx, exc: Exception | None) -> None:
    if exc is not None or app.builder.format != "html":
        return
    _copy_mathjax(app)
    # The theme's template links Font Awesome's JavaScript (1.5 MB) on every page; its CSS web font
    # already draws the same icons, so the script is dropped from the written pages.
    for page in Path(app.outdir).rglob("*.html"):
        text = page.read_text(encoding="utf-8")
        new = FONTAWESOME_JS.sub("", text)
        if new != text:
            page.write_text(new, encoding="utf-8")


def _copy_mathjax(app: Sphinx) -> None:
    src = _mathjax_source()
    dest = Path(app.outdir) / "_static" / MATHJAX_DIR
    for part in MATHJAX_PARTS:
        s, d = src / part, dest / part
        if s.is_dir():
            shutil.copytree(s, d, dirs_exist_ok=True)
        else:
            d.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(s, d)


def _load_alt_texts(app: Sphinx) -> dict[str, list[str]]:
    path = Path(app.srcdir) / "book" / "figure_alt.yml"
    if not path.exists():
        return {}
    import yaml

    return {k: list(v) for k, v in (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).items()}


def _filename(asset) -> str:
    return getattr(asset, "filename", None) or str(asset)


def _page_context(app: Sphinx, pagename: str, templatename: str, context: dict, doctree) -> None:
    body = context.get("body", "")

    def keep(asset) -> bool:
        name = _filename(asset) or ""
        inline = (getattr(asset, "attributes", {}) or {}).get("body", "")
        if any(d in name for d in DROP_ALWAYS) or "THEBE" in inline:
            return False
        if ("sphinx-design" in name or "design-tabs" in name) and "sd-" not in body:
            return False
        if "togglebutton" in name and "toggle" not in body:
            return False
        if MATHJAX_DIR + "/" in name and 'class="math' not in body:
            return False
        if "mathjax" in inline.lower() and 'class="math' not in body:
            return False
        return True

    for key in ("script_files", "css_files"):
        if key in context:
            context[key] = [a for a in context[key] if keep(a)]
    if not body:
        return
    body = NAN_CELL.sub(r"\1–\2", body)
    alts = app.env.booksite_alts.get(pagename)
    images = OUTPUT_IMG.findall(body)
    if images:
        if alts is None or len(alts) != len(images):
            logger.warning(
                "booksite: %s has %d output figures but book/figure_alt.yml gives %s alt texts",
                pagename, len(images), "no" if alts is None else len(alts), type="booksite")
        it = iter(alts or [])
        body = OUTPUT_IMG.sub(
            lambda m: f'<img alt="{_escape(next(it, "Figure output of the code cell above"))}" src="{m.group(2)}"',
            body)
    context["body"] = body


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace('"', "&quot;").replace("<", "&lt;")


class HelpersApi(SphinxDirective):
    """``{helpers-api} PACKAGE``: one section per module of the package, each with ``automodule``."""

    required_arguments = 1

    def run(self) -> list[nodes.Node]:
        package = importlib.import_module(self.arguments[0])
        names = sorted(m.name for m in pkgutil.iter_modules(package.__path__, package.__name__ + "."))
        lines = [f".. automodule:: {package.__name__}", ""]
        for name in names:
            lines += [name, "-" * len(name), "", f".. automodule:: {name}", "   :members:", ""]
        container = nodes.section()
        container.document = self.state.document
        nested_parse_with_titles(self.state, StringList(lines, source="helpers-api"), container)
        return container.children


def _builder_inited(app: Sphinx) -> None:
    app.env.booksite_alts = _load_alt_texts(app)


def setup(app: Sphinx) -> dict:
    app.connect("config-inited", lambda a, c: c.html_static_path.append(str(HERE / "static")))
    app.add_css_file("booksite.css")
    app.connect("builder-inited", _builder_inited)
    app.connect("html-page-context", _page_context, priority=900)
    app.connect("build-finished", _finish)
    app.add_directive("helpers-api", HelpersApi)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
