"""Absolute links to the book's own pages, made relative again in the built site.

The chapters link to the book's pages with absolute URLs under ``html.baseurl`` of ``_config.yml``
(``https://.../book/setup.html``, ``https://.../notebooks/02_dtypes_quantization.html#21-formats``), because
relative ``../book/*.md`` links break in Colab, which opens one notebook alone (``scripts/reader_view.py``
writes them). In the site, such a link would leave the book (and, before the site is published, lead
nowhere): this extension turns each one back into a relative link to the page, before any builder sees it
(the HTML pages, and the link check, which then counts it as local instead of fetching the placeholder). A
link under ``html.baseurl`` to a page the book does not have is a build warning (an error under ``-W``);
anchors are checked by ``scripts/site_test.py`` like every internal link.
"""

from __future__ import annotations

from docutils import nodes
from sphinx.application import Sphinx
from sphinx.transforms.post_transforms import SphinxPostTransform
from sphinx.util import logging

logger = logging.getLogger(__name__)


def site_target(uri: str, baseurl: str) -> tuple[str, str] | None:
    """``(docname, anchor)`` of a link under the site's address, else None.

    >>> site_target("https://x.io/book/book/setup.html#colab", "https://x.io/book/")
    ('book/setup', 'colab')
    """
    if not baseurl or not uri.startswith(baseurl):
        return None
    path, _, anchor = uri[len(baseurl):].partition("#")
    path = path or "index.html"
    if path.endswith("/"):
        path += "index.html"
    if not path.endswith(".html"):
        return None
    return path[: -len(".html")], anchor


class SiteLinks(SphinxPostTransform):
    default_priority = 5  # before the link check collects external links (priority 800)

    def run(self, **kwargs) -> None:
        base = self.config.html_baseurl
        if not base:
            return
        base = base if base.endswith("/") else base + "/"
        for node in self.document.findall(nodes.reference):
            found = site_target(node.get("refuri", ""), base)
            if found is None:
                continue
            docname, anchor = found
            if docname == "index":  # the site's index.html only forwards to the landing page
                docname = self.config.root_doc
            if docname not in self.env.all_docs:
                logger.warning("sitelinks: %s links to %s, a page the book does not have", self.env.docname,
                               node["refuri"], location=node, type="sitelinks")
                continue
            try:
                uri = self.app.builder.get_relative_uri(self.env.docname, docname)
            except Exception:  # a builder without pages (e.g. the link check): any local link will do
                uri = docname
            node["refuri"] = uri + (f"#{anchor}" if anchor else "")
            node["internal"] = True


def setup(app: Sphinx) -> dict:
    app.add_post_transform(SiteLinks)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
