"""The browser test's checks, without a browser: each must flag its defect and pass clean text."""

import importlib.util
import sys
from pathlib import Path

_spec = importlib.util.spec_from_file_location("site_test", Path(__file__).parents[1] / "scripts" / "site_test.py")
site_test = importlib.util.module_from_spec(_spec)
sys.modules["site_test"] = site_test  # dataclasses look their module up there
_spec.loader.exec_module(site_test)


def test_raw_roles_and_directives_are_flagged():
    assert site_test.text_problems("peak {glue:text}`x:.1f` GiB")[0].startswith("raw MyST role")
    assert site_test.text_problems("as {cite:p}`hu2022lora` showed")[0].startswith("raw MyST role")
    assert site_test.text_problems(":::{note}\nhello\n:::")[0].startswith("raw MyST directive")


def test_raw_tex_is_flagged_and_prose_is_not():
    assert site_test.text_problems(r"a cost of $\sqrt{N}$ stored outputs")[0].startswith("raw TeX")
    assert site_test.text_problems(r"where \(x^2\) grows")[0].startswith("raw TeX")
    assert site_test.text_problems(r"\begin{align} a \end{align}")[0].startswith("raw TeX")
    assert site_test.text_problems("costs $5 and $10 in total; 2²⁰ bytes; {x} set") == []


def test_nan_cells():
    assert site_test.NAN_CELL.match(" NaN ")
    assert not site_test.NAN_CELL.match("NaN-free")


def test_links_and_anchors(tmp_path):
    (tmp_path / "a.html").write_text('<h1 id="top">A</h1><a href="b.html#sec">b</a>')
    (tmp_path / "b.html").write_text('<section id="sec">B</section>')
    anchors = site_test.anchors_in
    ok = site_test.check_links(tmp_path, "a.html", ["b.html#sec", "#top", "https://x.org/y", "mailto:a@b"], anchors)
    assert ok == []
    bad = site_test.check_links(tmp_path, "a.html", ["c.html", "b.html#nope", "#gone"], anchors)
    assert bad == ["broken link: c.html", "missing anchor: b.html#nope", "missing anchor: #gone"]


def test_resource_kinds():
    assert site_test.kind_of("http://h/_static/x.woff2", "") == "font"
    assert site_test.kind_of("http://h/_static/x.css?v=1", "text/css") == "css"
    assert site_test.kind_of("http://h/_static/x.js", "") == "js"
    assert site_test.kind_of("http://h/_images/x.png", "image/png") == "image"
    assert site_test.kind_of("http://h/book/intro.html", "text/html") == "html"


def test_list_pages_skips_theme_templates(tmp_path):
    (tmp_path / "_static").mkdir()
    (tmp_path / "_static" / "webpack-macros.html").write_text("")
    (tmp_path / "index.html").write_text("")
    assert site_test.list_pages(tmp_path) == ["index.html"]
