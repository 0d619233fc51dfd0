#!/usr/bin/env python3
"""Browser test of the built site: every page loaded in headless Chromium, served on loopback.

A page fails on: a console error or an uncaught script error; a resource (image, script, style sheet,
font) that does not load; a request that leaves the machine (the site must read offline: no CDN);
an image that did not decode or has no real alt text (an alt that is empty or just the file's path);
an internal link to a page that does not exist, or to an anchor (``#id``) that the target page does not
have; TeX left unrendered (``$...$``, ``\\(...\\)``, ``\\[...\\]``, ``\\begin{...}`` in the visible text
after MathJax ran); a MyST role or directive left raw in the visible text (``{glue:text}`...```,
``{cite:p}`...```, ``:::{note}``, ...); a table cell that shows ``NaN``.

It also writes build artefacts to ``--out``: screenshots of the landing page and of one chapter, and
``page_weight.json`` (bytes each page loads: HTML + CSS + JS + fonts + images, as the browser fetched
them).

Fits the screen: every page is loaded at a desktop width (1366 px, where all the checks above run) and a
phone width (390 px, touch). At each, a page fails when it is wider than the screen (the reader would scroll
the whole page sideways) or when a table runs past the column instead of scrolling inside its own box.
``layout.json`` records, per page and width, the page's overflow, each table's width against its box (how far
a reader scrolls it) and each output figure's rendered scale (rendered over natural width). The book's figures
are drawn at 100 dpi with their smallest text (legends) at 9 pt, 12.5 px at full size (``helpers/plots.py``),
so a figure's smallest text on screen is about 12.5 px times its scale; the summary counts the figures whose
text falls under 9 px at each width, and ``--min-figure-text-px 9`` makes each one a failure.

Usage:  python scripts/site_test.py [--html _build/html] [--out _build/site-test]
Needs the ``playwright`` Python package (from PyPI) and a Chromium binary; Playwright's own browser
download is not used (its CDN is not reachable from CI): the Debian ``chromium`` package is, found on
PATH or given with ``--chromium`` / ``$CHROMIUM``. Without any Chromium the test is skipped with a
message (exit 0) only when ``--allow-skip`` is given; ``make site-test`` installs Chromium first.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import json
import os
import re
import shutil
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urldefrag, urlparse

# Text that must never be visible on a rendered page.
RAW_ROLE = re.compile(r"\{(?:glue(?::\w+)?|cite(?::\w+)?|ref|doc|numref|term|eq|math|py:\w+|download)\}`")
RAW_DIRECTIVE = re.compile(r"^\s*(?::::*|```+)\s*\{[\w:-]+\}", re.M)
RAW_TEX = re.compile(r"(?<![\\\w])\$(?=\S)[^$\n]*?\\[A-Za-z]+[^$\n]*\$|\\\(|\\\)|\\\[|\\\]|\\begin\{|\$\$")
NAN_CELL = re.compile(r"^\s*(NaN|nan|<NA>)\s*$")
SKIP_DIRS = {"_static", "_sources", "_images", "_downloads"}
CHAPTER_FOR_SCREENSHOT = "notebooks/01_memory_anatomy.html"
SCREENSHOTS = {"book/intro.html": "screenshot_landing.png", CHAPTER_FOR_SCREENSHOT: "screenshot_chapter01.png"}
DESKTOP = {"width": 1366, "height": 900}
FIGURE_TEXT_PX = 9 * 100 / 72  # helpers/plots.py STYLE: legend.fontsize 9 (pt), savefig.dpi 100
MIN_FIGURE_TEXT_PX = 9.0
PHONE = {"width": 390, "height": 844}


@dataclass
class PageResult:
    path: str
    problems: list[str] = field(default_factory=list)
    bytes_by_kind: dict[str, int] = field(default_factory=dict)
    layout: dict[int, dict] = field(default_factory=dict)  # viewport width -> LAYOUT_PROBE's result

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_kind.values())


def find_chromium(explicit: str | None = None) -> str | None:
    """Return a Chromium executable: the argument, $CHROMIUM, or one on PATH; None when there is none."""
    for cand in (explicit, os.environ.get("CHROMIUM")):
        if cand and Path(cand).exists():
            return cand
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = shutil.which(name)
        if found:
            # Debian's /usr/bin/chromium is a shell wrapper; the real binary avoids its flags handling.
            real = Path("/usr/lib/chromium/chromium")
            return str(real) if name == "chromium" and real.exists() else found
    return None


def list_pages(html_dir: Path) -> list[str]:
    """Every HTML page of the site, as paths relative to ``html_dir`` (theme templates excluded)."""
    pages = []
    for p in sorted(html_dir.rglob("*.html")):
        rel = p.relative_to(html_dir)
        if rel.parts[0] in SKIP_DIRS:
            continue
        pages.append(rel.as_posix())
    return pages


def kind_of(url: str, content_type: str) -> str:
    """Classify a fetched resource for the page-weight report."""
    path = urlparse(url).path.lower()
    ct = content_type.lower()
    if path.endswith((".woff", ".woff2", ".ttf", ".otf", ".eot")) or "font" in ct:
        return "font"
    if path.endswith(".css") or "css" in ct:
        return "css"
    if path.endswith((".js", ".mjs")) or "javascript" in ct:
        return "js"
    if path.endswith((".png", ".jpg", ".jpeg", ".svg", ".gif", ".webp", ".ico")) or ct.startswith("image/"):
        return "image"
    if path.endswith(".html") or path.endswith("/") or "html" in ct:
        return "html"
    return "other"


def check_links(html_dir: Path, page: str, links: list[str], anchors_of) -> list[str]:
    """Internal links of one page that point at a missing file or a missing anchor."""
    problems = []
    base = (html_dir / page).parent
    for href in links:
        parsed = urlparse(href)
        if parsed.scheme or parsed.netloc or href.startswith(("mailto:", "javascript:")):
            continue
        target_path, frag = urldefrag(href)
        target = (base / unquote(target_path)).resolve() if target_path else (html_dir / page).resolve()
        if target.is_dir():
            target = target / "index.html"
        if not target.exists():
            problems.append(f"broken link: {href}")
            continue
        if frag and target.suffix == ".html":
            if unquote(frag) not in anchors_of(target):
                problems.append(f"missing anchor: {href}")
    return problems


ID_RE = re.compile(r"""\s(?:id|name)=["']([^"']+)["']""")


@functools.cache
def anchors_in(path: Path) -> frozenset[str]:
    """The ids and names defined in an HTML file."""
    return frozenset(ID_RE.findall(path.read_text(encoding="utf-8", errors="replace")))


def text_problems(text: str) -> list[str]:
    """Raw MyST roles/directives, unrendered TeX and NaN cells in a page's visible text."""
    problems = []
    for rx, what in ((RAW_ROLE, "raw MyST role"), (RAW_DIRECTIVE, "raw MyST directive"), (RAW_TEX, "raw TeX")):
        m = rx.search(text)
        if m:
            start = max(0, m.start() - 40)
            snippet = text[start : m.end() + 40].replace("\n", " ")
            problems.append(f"{what} in page text: ...{snippet}...")
    return problems


# Runs in the page: visible text of the article (MathJax output, code blocks and scripts excluded),
# images, links, table cells and launch links.
PAGE_PROBE = """
() => {
  const main = document.querySelector('main') || document.body;
  const clone = main.cloneNode(true);
  clone.querySelectorAll('mjx-container, script, style, pre, code, .highlight, .MathJax, .math, '
    + 'mjx-assistive-mml, .headerlink, textarea').forEach(e => e.remove());
  const imgs = Array.from(document.querySelectorAll('main img')).map(i => ({
    src: i.getAttribute('src') || '', alt: i.getAttribute('alt'),
    ok: i.complete && i.naturalWidth > 0, visible: i.offsetParent !== null}));
  const links = Array.from(document.querySelectorAll('a[href]')).map(a => a.getAttribute('href'));
  const cells = Array.from(document.querySelectorAll('main td, main th')).map(c => c.innerText);
  const launch = Array.from(document.querySelectorAll('a[href*="colab.research.google.com"], '
    + 'a[href*="mybinder.org"], a[href*="/lab/tree/"]')).map(a => a.href);
  return {text: clone.innerText, imgs, links, cells, launch,
          mathjax: typeof window.MathJax !== 'undefined'};
}
"""


# Runs in the page: how it fits the viewport. Page overflow: how much wider than the screen the document is.
# Tables: each visible table's width, the box that scrolls it (if any) and whether it is cut at the column
# edge. Figures: each visible output image's rendered width over its natural width.
LAYOUT_PROBE = """
(width) => {
  const doc = document.scrollingElement || document.documentElement;
  const main = document.querySelector('main') || document.body;
  const mainRight = main.getBoundingClientRect().right;
  const tables = Array.from(document.querySelectorAll('main table')).filter(t => t.offsetParent !== null)
    .map(t => {
      let box = null;
      for (let e = t.parentElement; e && e.tagName !== 'MAIN'; e = e.parentElement) {
        const ox = getComputedStyle(e).overflowX;
        if (ox === 'auto' || ox === 'scroll') { box = e; break; }
      }
      const r = t.getBoundingClientRect();
      return {width: Math.round(r.width), box: box ? Math.round(box.clientWidth) : null,
              cut: !box && r.right > mainRight + 1};
    });
  const figures = Array.from(document.querySelectorAll('main img'))
    .filter(i => i.offsetParent !== null && i.naturalWidth > 0 && i.closest('.cell_output'))
    .map(i => ({src: i.getAttribute('src'), scale: i.getBoundingClientRect().width / i.naturalWidth}));
  // A phone widens its layout viewport to fit a page that is too wide: compare with the screen's width.
  return {viewport: width, overflow: Math.max(0, doc.scrollWidth - width), tables, figures};
}
"""


def figure_text_px(figure: dict) -> float:
    """The smallest text of a book figure as rendered, in CSS pixels (from its scale)."""
    return FIGURE_TEXT_PX * figure["scale"]


def layout_problems(layout: dict, min_figure_text_px: float = 0.0) -> list[str]:
    """What does not fit the screen in one LAYOUT_PROBE result (empty when the page fits); figures whose
    smallest text renders under ``min_figure_text_px`` count only when that is given."""
    width = layout["viewport"]
    problems = []
    if layout["overflow"] > 1:
        problems.append(f"at {width} px the page is {layout['overflow']} px wider than the screen")
    cut = [t for t in layout["tables"] if t["cut"]]
    if cut:
        widths = ", ".join(f"{t['width']} px" for t in cut[:5])
        problems.append(f"at {width} px {len(cut)} wide table(s) cut off instead of scrolling ({widths})")
    small = [f for f in layout["figures"] if figure_text_px(f) < min_figure_text_px]
    if small:
        problems.append(f"at {width} px {len(small)} figure(s) with text under {min_figure_text_px:g} px: "
                        + ", ".join(f"{f['src'].rsplit('/', 1)[-1]} ({figure_text_px(f):.1f} px)" for f in small[:3]))
    return problems


def run_browser(html_dir: Path, out_dir: Path, chromium: str, pages: list[str] | None = None) -> list[PageResult]:
    """Serve ``html_dir`` on loopback, load every page in headless Chromium and check it."""
    from playwright.sync_api import sync_playwright

    handler = functools.partial(_QuietHandler, directory=str(html_dir))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    port = server.server_address[1]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    origin = f"http://127.0.0.1:{port}"
    pages = pages or list_pages(html_dir)
    results: list[PageResult] = []
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
            context = browser.new_context(viewport=DESKTOP)
            for page_path in pages:
                results.append(_check_page(context, origin, html_dir, out_dir, page_path))
            context.close()
            phone = browser.new_context(viewport=PHONE, is_mobile=True, has_touch=True, device_scale_factor=2)
            for res in results:
                if DESKTOP["width"] in res.layout:  # not a redirect page
                    _check_layout(phone, origin, res)
            phone.close()
            browser.close()
    finally:
        server.shutdown()
    return results


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # noqa: D401 - keep the test's output readable
        pass


REFRESH = re.compile(r"""<meta http-equiv=["']refresh["'] content=["'][^"']*url=([^"']+)["']""", re.I)


def _check_page(context, origin: str, html_dir: Path, out_dir: Path, page_path: str) -> PageResult:
    res = PageResult(page_path)
    redirect = REFRESH.search((html_dir / page_path).read_text(encoding="utf-8", errors="replace"))
    if redirect:  # index.html only forwards to the landing page, which is loaded on its own
        res.problems += check_links(html_dir, page_path, [redirect.group(1)], anchors_in)
        return res
    page = context.new_page()
    sizes: dict[str, int] = {}

    def on_route(route):
        url = route.request.url
        if url.startswith(origin) or url.startswith("data:") or url.startswith("blob:"):
            route.continue_()
        else:
            res.problems.append(f"request leaves the machine (site must read offline): {url}")
            route.abort()

    def on_response(resp):
        if not resp.url.startswith(origin):
            return
        if resp.status >= 400:
            res.problems.append(f"HTTP {resp.status}: {resp.url[len(origin):]}")
            return
        try:
            n = len(resp.body())
        except Exception:  # a redirect or an aborted body has none
            n = 0
        kind = kind_of(resp.url, resp.headers.get("content-type", ""))
        sizes[resp.url] = n
        res.bytes_by_kind[kind] = res.bytes_by_kind.get(kind, 0) + n

    page.route("**/*", on_route)
    page.on("response", on_response)
    page.on("console", lambda m: m.type == "error" and res.problems.append(f"console error: {m.text}"))
    page.on("pageerror", lambda e: res.problems.append(f"script error: {e}"))
    page.on("requestfailed", lambda r: r.url.startswith(origin)
            and res.problems.append(f"failed to load: {r.url[len(origin):]}"))
    page.goto(f"{origin}/{page_path}", wait_until="load", timeout=60_000)
    # MathJax typesets asynchronously (and fetches its fonts): wait for it where the page loaded it, then
    # for the web fonts. No "network idle" wait: a page may keep a request open without being unfinished.
    page.wait_for_function("() => !document.querySelector('.math') || (window.MathJax && MathJax.startup"
                           " && MathJax.startup.promise)", timeout=30_000)
    page.evaluate("async () => { if (window.MathJax && MathJax.startup) await MathJax.startup.promise;"
                  " await document.fonts.ready; }")
    probe = page.evaluate(PAGE_PROBE)
    res.problems += text_problems(probe["text"])
    for img in probe["imgs"]:
        if not img["ok"]:
            res.problems.append(f"image did not load: {img['src']}")
        alt = (img["alt"] or "").strip()
        if img["visible"] and (not alt or alt == img["src"] or re.fullmatch(r"[\w./-]+\.(png|svg|jpe?g)", alt)):
            res.problems.append(f"image without alt text: {img['src']}")
    bad_cells = [c for c in probe["cells"] if NAN_CELL.match(c)]
    if bad_cells:
        res.problems.append(f"{len(bad_cells)} table cell(s) show NaN")
    # A redirect page (index.html) ends on another page: resolve links against where the browser is.
    landed = urlparse(page.url).path.lstrip("/") or "index.html"
    res.problems += check_links(html_dir, landed, probe["links"], anchors_in)
    for url in probe["launch"]:
        m = re.search(r"/(notebooks/[^/?#]+\.ipynb)", url)
        repo_root = html_dir.parent.parent
        if not m or not (repo_root / m.group(1)).exists():
            res.problems.append(f"launch button points at no notebook of the repository: {url}")
    if page_path in SCREENSHOTS:
        page.screenshot(path=str(out_dir / SCREENSHOTS[page_path]), full_page=False)
    _record_layout(page, res, DESKTOP["width"])
    page.close()
    return res


def _record_layout(page, res: PageResult, width: int) -> None:
    layout = page.evaluate(LAYOUT_PROBE, width)
    res.layout[layout["viewport"]] = layout


def _check_layout(context, origin: str, res: PageResult) -> None:
    """Load a page at another viewport and check only how it fits."""
    page = context.new_page()
    page.goto(f"{origin}/{res.path}", wait_until="load", timeout=60_000)
    page.evaluate("async () => { if (window.MathJax && MathJax.startup) await MathJax.startup.promise;"
                  " await document.fonts.ready; }")
    _record_layout(page, res, PHONE["width"])
    page.close()


def layout_summary(results: list[PageResult]) -> list[str]:
    """One line per viewport width: pages wider than the screen, tables that scroll, smallest figure scale."""
    lines = []
    for width in (DESKTOP["width"], PHONE["width"]):
        layouts = [r.layout[width] for r in results if width in r.layout]
        if not layouts:
            continue
        wide = sum(lay["overflow"] > 1 for lay in layouts)
        tables = [t for lay in layouts for t in lay["tables"]]
        scrolled = sum(t["box"] is not None and t["width"] > t["box"] + 1 for t in tables)
        figures = [f for lay in layouts for f in lay["figures"]]
        small = sum(figure_text_px(f) < MIN_FIGURE_TEXT_PX for f in figures)
        smallest = (f"; {small} of {len(figures)} figures with text under {MIN_FIGURE_TEXT_PX:g} px, smallest "
                    f"figure at {min(f['scale'] for f in figures):.0%} of its size "
                    f"(text about {min(figure_text_px(f) for f in figures):.1f} px)") if figures else ""
        lines.append(f"layout at {width} px: {wide} of {len(layouts)} pages wider than the screen; "
                     f"{scrolled} of {len(tables)} tables scroll in their box{smallest}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--html", default="_build/html", type=Path)
    ap.add_argument("--out", default="_build/site-test", type=Path)
    ap.add_argument("--chromium", default=None)
    ap.add_argument("--allow-skip", action="store_true", help="exit 0 with a message when no Chromium exists")
    ap.add_argument("--min-figure-text-px", type=float, default=0.0,
                    help=f"fail a figure whose smallest text renders smaller (e.g. {MIN_FIGURE_TEXT_PX:g}; default: report only)")
    ap.add_argument("pages", nargs="*", help="pages relative to --html (default: all)")
    args = ap.parse_args(argv)
    if not (args.html / "index.html").exists():
        print(f"site-test: {args.html}/index.html not found; build the site first", file=sys.stderr)
        return 2
    chromium = find_chromium(args.chromium)
    if chromium is None:
        msg = "site-test: no Chromium found (apt-get install chromium, or set CHROMIUM=/path/to/chrome)"
        print(("SKIPPED " if args.allow_skip else "") + msg, file=sys.stderr)
        return 0 if args.allow_skip else 2
    t0 = time.perf_counter()
    results = run_browser(args.html, args.out, chromium, args.pages or None)
    for r in results:
        for width in sorted(r.layout, reverse=True):
            r.problems += layout_problems(r.layout[width], args.min_figure_text_px)
    elapsed = time.perf_counter() - t0
    weight = {r.path: {"total_bytes": r.total_bytes, **r.bytes_by_kind} for r in results}
    (args.out / "page_weight.json").write_text(json.dumps(weight, indent=1, sort_keys=True) + "\n")
    layout = {r.path: r.layout for r in results if r.layout}
    (args.out / "layout.json").write_text(json.dumps(layout, indent=1, sort_keys=True) + "\n")
    failed = [r for r in results if r.problems]
    for r in failed:
        print(f"FAIL {r.path}")
        for p in dict.fromkeys(r.problems):
            print(f"    {p}")
    for key in ("book/intro.html", CHAPTER_FOR_SCREENSHOT):
        if key in weight:
            print(f"page weight {key}: {weight[key]['total_bytes'] / 2**20:.2f} MiB "
                  + ", ".join(f"{k} {v / 1024:.0f} KiB" for k, v in sorted(weight[key].items()) if k != "total_bytes"))
    for line in layout_summary(results):
        print(line)
    print(f"site-test: {len(results)} pages, {len(failed)} failed, {elapsed:.1f} s; artefacts in {args.out}/")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
