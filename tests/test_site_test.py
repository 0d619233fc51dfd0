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


def test_layout_problems_flag_a_page_wider_than_the_screen_and_cut_tables():
    fits = {"viewport": 390, "overflow": 0, "figures": [],
            "tables": [{"width": 1200, "box": 370, "cut": False}, {"width": 300, "box": None, "cut": False}]}
    assert site_test.layout_problems(fits) == []
    wide = {**fits, "overflow": 612, "tables": [{"width": 3116, "box": None, "cut": True}]}
    assert site_test.layout_problems(wide) == [
        "at 390 px the page is 612 px wider than the screen",
        "at 390 px 1 wide table(s) cut off instead of scrolling (3116 px)"]
    assert site_test.layout_problems({**fits, "overflow": 1}) == []  # sub-pixel rounding


def test_layout_summary_counts_per_width():
    page = site_test.PageResult("a.html")
    page.layout = {
        1366: {"viewport": 1366, "overflow": 0, "tables": [{"width": 900, "box": 757, "cut": False}],
               "figures": [{"src": "x.png", "scale": 0.61}]},
        390: {"viewport": 390, "overflow": 20, "tables": [{"width": 900, "box": 370, "cut": False}],
              "figures": [{"src": "x.png", "scale": 0.29}]},
    }
    redirect = site_test.PageResult("index.html")
    lines = site_test.layout_summary([page, redirect])
    assert lines == [
        "layout at 1366 px: 0 of 1 pages wider than the screen; 1 of 1 tables scroll in their box; "
        "1 of 1 figures with text under 9 px, smallest figure at 61% of its size (text about 7.6 px)",
        "layout at 390 px: 1 of 1 pages wider than the screen; 1 of 1 tables scroll in their box; "
        "1 of 1 figures with text under 9 px, smallest figure at 29% of its size (text about 3.6 px)"]


def test_figure_text_size_fails_only_when_asked():
    layout = {"viewport": 1366, "overflow": 0, "tables": [],
              "figures": [{"src": "../_images/a.png", "scale": 0.61}, {"src": "../_images/b.png", "scale": 1.0}]}
    assert site_test.layout_problems(layout) == []
    assert site_test.layout_problems(layout, 9) == ["at 1366 px 1 figure(s) with text under 9 px: a.png (7.6 px)"]
    assert round(site_test.figure_text_px({"scale": 1.0}), 1) == 12.5  # 9 pt at 100 dpi
