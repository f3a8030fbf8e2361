"""The course site (tools/build_site.py, `make site`), checked as files and in a real browser.

The browser part drives Debian's Chromium (/usr/bin/chromium) with selenium and its ChromeDriver
(/usr/bin/chromedriver): no browser is downloaded. It is skipped, saying why, where they are
missing (`apt-get install chromium chromium-driver`; CI's .ci/run installs them). It loads every
page of the built site from a local HTTP server and checks: no console errors, every image
loaded and described (a real alt text), every internal link resolves, nothing fetched from outside,
the provenance line on every notebook page; and at 1400 px and at a phone's 390 px, that no page scrolls
sideways, that no code block or output is wider than its box (code and outputs wrap), that no figure is wider
than the column, that every code cell has a copy button and that every notebook page has its "run it" row and
starts with the install cell. It saves build/screenshots/landing.png and build/screenshots/lesson.png (plus
lesson_plot.png when the lesson has a plot, and lesson_phone.png) for a person to look at.

Without a browser the same layout rules are checked in the built files: the site's CSS wraps code and outputs
and fits figures to the column, lesson 00's syllabus (a Markdown output) renders as a table whose links lead to
the lessons' pages, and the landing page's sentence on the "run it" row is true for the repository address.
"""
from __future__ import annotations

import base64
import functools
import html as html_lib
import http.server
import io
import json
import re
import shutil
import sys
import threading
import time
import urllib.parse
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import build_site  # noqa: E402
import install_cell  # noqa: E402

pytestmark = pytest.mark.slow  # make check leaves this module out; make test and CI run it

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
SCREENSHOTS = ROOT / "build" / "screenshots"
FOLDERS = ("notebooks", "exercises", "solutions", "capstone")


def _need_generator():
    missing = build_site.missing_packages()
    if missing:
        pytest.skip(f"the site generator is not installed ({', '.join(missing)}): pip install -e '.[site]'")


def _notebooks(root: Path = ROOT) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for f in FOLDERS for p in (root / f).glob("*.ipynb"))


# ---------------------------------------------------------------------------------------------
# provenance and syllabus: pure functions, no Sphinx needed

def _nb(outputs: bool, text: str = "# T") -> dict:
    code = {"cell_type": "code", "id": "c1", "source": "print(1)", "metadata": {}, "execution_count": 1 if outputs else None,
            "outputs": [{"output_type": "stream", "name": "stdout", "text": "1\n"}] if outputs else []}
    return {"cells": [{"cell_type": "markdown", "id": "c0", "source": text, "metadata": {}}, code], "metadata": {},
            "nbformat": 4, "nbformat_minor": 5}


REPORT = {"gpu": "NVIDIA H200", "utc": "2026-11-30T09:42:17Z", "torch": "2.11.0+cu130", "cuda": "13.0",
          "notebooks": [{"path": "notebooks/01_x.ipynb", "status": "passed"}]}


def test_provenance_says_where_outputs_come_from():
    nb = _nb(True)
    rep = json.loads(json.dumps(REPORT))
    rep["notebooks"][0]["source_sha256"] = build_site.nbtools.source_sha256(nb)
    kind, line = build_site.provenance("notebooks/01_x.ipynb", nb, rep)
    assert kind == "gpu" and "recorded on NVIDIA H200, 2026-11-30" in line and "edited" not in line
    kind, line = build_site.provenance("notebooks/01_x.ipynb", _nb(True, "# T\n\nnew text"), rep)
    assert kind == "gpu" and "edited since" in line
    assert build_site.provenance("notebooks/01_x.ipynb", _nb(False), rep)[0] == "not-executed"
    kind, line = build_site.provenance("exercises/01_x.ipynb", _nb(True), rep)
    assert kind == "cpu-replay" and "CPU replay" in line and "NVIDIA H200, 2026-11-30" in line
    assert build_site.provenance("exercises/01_x.ipynb", _nb(True), None)[0] == "cpu-replay"
    failed = dict(rep, notebooks=[dict(rep["notebooks"][0], status="failed")])
    assert build_site.provenance("notebooks/01_x.ipynb", nb, failed)[0] == "failed"


def test_a_lesson_page_says_its_place_in_the_course_and_its_minutes():
    rows = build_site.syllabus_rows()
    assert len(rows) >= 10
    k = next(i for i, r in enumerate(rows, 1) if r["lesson"] == "03")
    for folder in ("notebooks", "exercises", "solutions"):
        line = build_site.lesson_place(f"{folder}/03_the_race.ipynb", rows)
        assert line == f"Lesson 03 ({k} of {len(rows)}) · {rows[k - 1]['minutes']} minutes, lesson + exercise · core path"
    line00 = build_site.lesson_place("notebooks/00_start_here.ipynb", rows)
    assert line00.startswith(f"Lesson 00 (1 of {len(rows)}) · ") and "lesson + exercise" not in line00
    assert build_site.lesson_place("notebooks/99_none.ipynb", rows) is None
    page = build_site._page(_nb(True), "notebooks/03_the_race.ipynb", "gpu", "Outputs recorded.", None, line)
    top = page["cells"][0]["source"]
    assert top.index('<p class="lesson-place">') < top.index('<p class="provenance gpu">')


def test_provenance_of_make_run():
    rows = [build_site.RunRow("notebooks/01_x.ipynb", "CPU replay", 1.0, "ok"),
            build_site.RunRow("notebooks/02_y.ipynb", "CPU replay", 1.0, "FAILED")]
    run = build_site.Run("CPU replay", "2026-11-30", rows, ROOT / "build" / "executed")
    kind, line = build_site.provenance("notebooks/01_x.ipynb", _nb(True), REPORT, run)
    assert kind == "this-run" and "make run" in line and "CPU replay" in line and "NVIDIA H200" in line
    assert build_site.provenance("notebooks/02_y.ipynb", _nb(True), REPORT, run)[0] == "failed"
    gpu = build_site.Run("GPU (NVIDIA H200)", "2026-11-30", rows[:1], ROOT)
    assert "measured live on NVIDIA H200" in build_site.provenance("notebooks/01_x.ipynb", _nb(True), None, gpu)[1]
    # a notebook this run did not execute keeps the provenance of its committed outputs
    assert build_site.provenance("exercises/01_x.ipynb", _nb(False), REPORT, run)[0] == "not-executed"


def test_readme_syllabus_lists_every_lesson_with_minutes():
    """The README's table (generated from lib/pinlab/syllabus.py) is the one the site shows."""
    rows = build_site.parse_syllabus((ROOT / "README.md").read_text(encoding="utf-8"))
    by_path = {r["path"]: r for r in rows}
    site_rows = {r["path"]: r for r in build_site.syllabus_rows()}
    for rel in _notebooks():
        if rel.startswith("notebooks/"):
            assert rel in by_path, f"README's Syllabus table has no row for {rel}"
            assert re.fullmatch(r"\d+( \+ \d+)?", by_path[rel]["minutes"]), by_path[rel]
            assert by_path[rel]["gpu"], by_path[rel]
            assert site_rows[rel]["minutes"] == by_path[rel]["minutes"], rel


def test_progress_bars_keep_their_last_frame():
    cell = {"outputs": [{"output_type": "stream", "name": "stderr", "text": "\rsweep:   0%| 0/3"},
                        {"output_type": "stream", "name": "stderr", "text": "\rsweep: 100%| 3/3\n"},
                        {"output_type": "stream", "name": "stdout", "text": ["a\n", "b\n"]}]}
    build_site._tidy_outputs(cell)
    assert [o["text"] for o in cell["outputs"]] == ["sweep: 100%| 3/3\n", "a\nb\n"]


def test_a_page_without_a_title_gets_one_and_keeps_its_text():
    nb = _nb(False, "Some text, no heading.")
    page = build_site._page(nb, "solutions/07_x.ipynb", "not-executed", "Not executed yet.")
    md = [build_site._src(c) for c in page["cells"] if c["cell_type"] == "markdown"]
    assert md[0].startswith("# Solutions · 07 x\n") and "Not executed yet." in md[0]
    assert "".join(md).count("Some text, no heading.") == 1


def test_a_page_has_one_title_and_its_parts_nest_under_it():
    cells = [{"cell_type": "markdown", "source": "# 05 · T\n\n```\n# a comment\n```"},
             {"cell_type": "code", "source": "# code comment"},
             {"cell_type": "markdown", "source": ["# Part 1\n", "\n", "## a\n"]}]
    build_site._demote_extra_titles(cells)
    assert [c["source"] for c in cells] == ["# 05 · T\n\n```\n# a comment\n```", "# code comment",
                                            "## Part 1\n\n### a\n"]


# ---------------------------------------------------------------------------------------------
# the built site, as files

@pytest.fixture(scope="module")
def site(tmp_path_factory):
    _need_generator()
    out = tmp_path_factory.mktemp("site") / "html"
    t0 = time.perf_counter()
    pages = build_site.build(out)
    return {"out": out, "pages": pages, "seconds": time.perf_counter() - t0}


def _png_output() -> dict:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(3, 2))  # no pyplot: the process's backend stays as it is
    FigureCanvasAgg(fig)
    fig.add_subplot().plot([1, 2, 3], [1, 4, 9])
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return {"output_type": "display_data", "metadata": {},
            "data": {"image/png": base64.b64encode(buf.getvalue()).decode(), "text/plain": "<Figure>"}}


@pytest.fixture(scope="module")
def site_with_plot(tmp_path_factory):
    """A small course tree whose lesson has a plot: the image checks run even while the committed
    notebooks carry no outputs."""
    _need_generator()
    root = tmp_path_factory.mktemp("course")
    nb = _nb(True, "# 01 · A lesson with a plot\n\nSee [the exercises](../exercises/01_x.ipynb), "
             "[the data](../data/table.csv) and [the plot](#a-lesson-with-a-plot).")
    nb["cells"][1]["outputs"].append(_png_output())
    (root / "notebooks").mkdir()
    (root / "exercises").mkdir()
    (root / "notebooks" / "01_x.ipynb").write_text(json.dumps(nb))
    (root / "data").mkdir()
    (root / "data" / "table.csv").write_text("size,ms\n1,2\n")
    (root / "exercises" / "01_x.ipynb").write_text(json.dumps(_nb(False, "# Exercises · 01")))
    # lesson 00's syllabus: a Markdown output (display(Markdown(...))) with a table and links to other notebooks
    start = _nb(True, "# 00 · Start here")
    start["cells"][1]["outputs"] = [{"output_type": "display_data", "metadata": {}, "data": {
        "text/markdown": SYLLABUS_OUTPUT, "text/plain": "<IPython.core.display.Markdown object>"}}]
    (root / "notebooks" / "00_x.ipynb").write_text(json.dumps(start))
    (root / "README.md").write_text("# c\n\n## Syllabus\n\n| lesson | topic | minutes | gpu |\n|---|---|---|---|\n"
                                    "| [01](notebooks/01_x.ipynb) | plots | 5 | no |\n")
    out = root / "html"
    return {"out": out, "pages": build_site.build(out, root=root)}


SYLLABUS_OUTPUT = ("| lesson | what you learn | path |\n|---|---|---|\n| [00](00_x.ipynb) | **Start** | core |\n"
                   "| [01](01_x.ipynb) | **Plots** | deep dive |\n\nAbout 1 h 00 in all.")


def test_a_markdown_output_renders_as_a_table_linking_the_pages(site_with_plot):
    """Lesson 00 shows its syllabus as Markdown (pinlab.syllabus.markdown()): on the site it is a table, not
    pipes, and its links lead to the lessons' pages, not to .ipynb downloads."""
    html = (site_with_plot["out"] / "notebooks" / "00_x.html").read_text(encoding="utf-8")
    out = html[html.index("cell_output"):]
    table = re.search(r"<table.*?</table>", out, re.S)
    assert table and "| lesson |" not in out, out[:2000]
    assert 'href="01_x.html' in table.group(0) and ".ipynb" not in table.group(0), table.group(0)
    assert "deep dive" in table.group(0)


def test_the_site_css_wraps_code_and_fits_figures(site_with_plot):
    """No sideways scroll on a laptop or a phone, checked in the CSS the site serves (the browser test checks the
    pages themselves where Chromium is installed): code blocks and outputs wrap (white-space: pre-wrap; a copy
    button copies the code's own newlines), figures are at most the column's width at their aspect ratio."""
    css = (site_with_plot["out"] / "_static" / "course.css").read_text(encoding="utf-8")
    css = re.sub(r"/\*.*?\*/", "", css, flags=re.S)
    rules = [(sel.strip(), body) for sel, body in re.findall(r"([^{}]+)\{([^{}]*)\}", css)]

    def props(selector):
        found = {}
        for sel, body in rules:
            if selector in [s.strip() for s in sel.split(",")]:
                found.update({k.strip(): v.strip() for k, v in re.findall(r"([\w-]+)\s*:\s*([^;]+)", body)})
        return found

    for code in ("div.highlight pre", "div.cell_input pre", "div.cell_output pre", "div.output pre"):
        assert props(code).get("white-space") == "pre-wrap", f"{code} must wrap"
        assert props(code).get("overflow-wrap") == "anywhere", f"{code}: a long word must break too"
    img = props("div.cell_output img")
    assert img.get("max-width") == "100%" and img.get("height") == "auto", img
    html = (site_with_plot["out"] / "notebooks" / "01_x.html").read_text(encoding="utf-8")
    assert "_static/course.css" in html and 'class="highlight' in html


def test_every_notebook_page_starts_with_the_install_cell(site):
    """On every page the first code cell is the install cell (the one a learner on Colab runs first)."""
    for rel in site["pages"]:
        html = (site["out"] / rel).with_suffix(".html").read_text(encoding="utf-8")
        first = re.search(r'<div class="cell_input.*?</pre>', html, re.S)
        text = html_lib.unescape(re.sub(r"<[^>]+>", "", first.group(0))) if first else ""
        assert text.lstrip().startswith(install_cell.MARK), f"{rel}: {text[:120]!r}"


@pytest.fixture(scope="module")
def run_site(site_with_plot, tmp_path_factory):
    """What `make run` renders (tools/run_course.py): its executed copies and its run table."""
    root = site_with_plot["out"].parent
    executed = tmp_path_factory.mktemp("executed")
    (executed / "notebooks").mkdir()
    shutil.copyfile(root / "notebooks" / "01_x.ipynb", executed / "notebooks" / "01_x.ipynb")
    run = build_site.Run("CPU replay", "2026-11-30", [build_site.RunRow("notebooks/01_x.ipynb", "CPU replay", 1.5, "ok")],
                         executed)
    out = tmp_path_factory.mktemp("run") / "html"
    return {"out": out, "pages": build_site.build(out, root=root, run=run, strict=False)}


PLANTED = "<img src=x onerror=alert(2)>"


@pytest.fixture(scope="module")
def planted_site(tmp_path_factory):
    """A course tree whose reports/gpu/latest.json holds script in every recorded string (gpu, driver, torch,
    CUDA, date, a notebook's status) and a make-run table that does too: the site must show it as text."""
    _need_generator()
    root = tmp_path_factory.mktemp("planted")
    for folder in ("notebooks", "exercises"):
        (root / folder).mkdir()
    (root / "notebooks" / "01_x.ipynb").write_text(json.dumps(_nb(True, "# 01 · A lesson")))
    (root / "notebooks" / "02_y.ipynb").write_text(json.dumps(_nb(True, "# 02 · Another")))
    (root / "exercises" / "01_x.ipynb").write_text(json.dumps(_nb(True, "# Exercises · 01")))
    (root / "README.md").write_text("# c\n\n## Syllabus\n\n| lesson | topic | minutes | gpu |\n|---|---|---|---|\n"
                                    "| [01](notebooks/01_x.ipynb) | x | 5 | no |\n")
    (root / "reports" / "gpu").mkdir(parents=True)
    report = {"gpu": PLANTED, "driver": f"580 {PLANTED}", "torch": f"2.11 {PLANTED}", "cuda": f"13.0{PLANTED}",
              "utc": "<script>alert(3)</script>", "notebooks": [
                  {"path": "notebooks/01_x.ipynb", "status": f"failed {PLANTED}"},
                  {"path": "notebooks/02_y.ipynb", "status": "passed\n\n[click](javascript:alert(4))"}]}
    (root / "reports" / "gpu" / "latest.json").write_text(json.dumps(report))
    executed = tmp_path_factory.mktemp("planted-executed")
    (executed / "exercises").mkdir()
    shutil.copyfile(root / "exercises" / "01_x.ipynb", executed / "exercises" / "01_x.ipynb")
    run = build_site.Run(f"GPU ({PLANTED})", f"2026-12-01 {PLANTED}",
                         [build_site.RunRow("exercises/01_x.ipynb", f"GPU | {PLANTED}", 1.5, f"ok {PLANTED}")],
                         executed)
    out = tmp_path_factory.mktemp("planted-site") / "html"
    return {"out": out, "pages": build_site.build(out, root=root, run=run, strict=False)}


def test_recorded_strings_reach_the_site_escaped(planted_site):
    out = planted_site["out"]
    pages = {p.relative_to(out).as_posix(): p.read_text(encoding="utf-8") for p in out.rglob("*.html")}
    for rel in ("index.html", "run.html", "notebooks/01_x.html", "notebooks/02_y.html", "exercises/01_x.html"):
        assert rel in pages, sorted(pages)
    for rel, text in pages.items():
        assert "<img src=x" not in text and "onerror=alert" not in text.replace("onerror=alert(2)&gt;", ""), rel
        assert "<script>alert" not in text and 'href="javascript:' not in text, rel
    escaped = html_lib.escape(PLANTED, quote=False)  # the values are there, as text
    assert pages["index.html"].count(escaped) == 6 and "&lt;script&gt;al" in pages["index.html"]
    assert escaped in pages["notebooks/01_x.html"] and "[click](javascript:alert(4))" in pages["notebooks/02_y.html"]
    table = re.search(r"<table.*?</table>", pages["run.html"], re.S).group(0)
    assert table.count("<td") == 4, table   # one row of four cells: the planted | did not end a cell
    assert f"<td><p>GPU | {escaped}</p></td>" in table and f"<td><p>ok {escaped}</p></td>" in table


def test_make_run_renders_what_it_ran_with_its_run_table(run_site):
    assert run_site["pages"]["notebooks/01_x.ipynb"]["kind"] == "this-run"
    assert run_site["pages"]["exercises/01_x.ipynb"]["kind"] == "not-executed"  # not run: as committed
    table = (run_site["out"] / "run.html").read_text(encoding="utf-8")
    assert "notebooks/01_x.ipynb" in table and "1.5" in table and "CPU replay" in table
    assert 'href="run.html"' in (run_site["out"] / "index.html").read_text(encoding="utf-8")


def test_site_builds_from_committed_notebooks_without_executing_them(site):
    assert site["seconds"] < 60, f"make site took {site['seconds']:.0f} s"
    assert set(site["pages"]) == set(_notebooks())
    for rel, page in site["pages"].items():
        html = (site["out"] / rel).with_suffix(".html").read_text(encoding="utf-8")
        # unescaped: a sentence with an apostrophe ("The page's text has been edited") is &#x27; in the HTML
        assert 'class="provenance' in html and page["provenance"].split(":")[0] in html_lib.unescape(html), rel
        stem = Path(rel).stem
        assert ('class="lesson-place"' in html) == any(Path(r["path"]).stem == stem
                                                       for r in build_site.syllabus_rows()), rel
        # the committed outputs are on the page exactly when the line says there are some
        assert (page["kind"] == "not-executed") == ("cell_output" not in html), rel


def test_landing_page_has_the_syllabus_and_links_every_lesson(site):
    html = (site["out"] / "index.html").read_text(encoding="utf-8")
    assert "Who it is for" in html and "Syllabus" in html
    table = re.search(r'<table[^>]*syllabus.*?</table>', html, re.S)
    assert table, "no syllabus table on the landing page"
    for rel in _notebooks():
        if rel.startswith("notebooks/"):
            assert f'href="{rel[:-6]}.html"' in table.group(0), rel
    # the core path: each lesson says whether it is core or a deep dive, and both totals are given
    syl = build_site.syllabus_rows()
    assert table.group(0).count("<td><p>core</p></td>") == sum(r["core"] == "core" for r in syl) > 0
    assert "deep dive" in table.group(0) and "the core path" in html_lib.unescape(html)
    # the run-it sentence is the one for pyproject.toml's address (no Colab promise while it is the placeholder)
    text = " ".join(html_lib.unescape(re.sub(r"<[^>]+>", "", html)).split())
    if build_site.is_placeholder(build_site.repository_url()):
        assert "There is no Colab link yet" in text and "opens the notebook in Colab" not in text
    else:
        assert "opens the notebook in Colab" in text


# ---------------------------------------------------------------------------------------------
# in the browser

class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if missing:
        pytest.skip(f"browser test skipped: {', '.join(missing)} not found "
                    "(apt-get install chromium chromium-driver; CI's .ci/run installs them)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="browser test skipped: selenium is not "
                                    "installed (pip install -e '.[site]')")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1280,900",
                 f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=opts, service=Service(executable_path=str(CHROMEDRIVER)))
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def serve():
    servers = []

    def start(directory: Path) -> str:
        handler = functools.partial(_QuietHandler, directory=str(directory))
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}/"

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


_PAGE_FACTS = """
const done = arguments[arguments.length - 1];
const imgs = Array.from(document.images);
Promise.all(imgs.map(i => i.complete ? null : new Promise(r => { i.onload = r; i.onerror = r; })))
  .then(() => done({
    images: imgs.map(i => ({src: i.currentSrc || i.src, ok: i.complete && i.naturalWidth > 0,
                            alt: i.getAttribute('alt') || ''})),
    links: Array.from(document.querySelectorAll('a[href]')).map(a => a.href),
    resources: performance.getEntriesByType('resource').map(r => r.name),
    provenance: Array.from(document.querySelectorAll('.provenance')).map(p => p.textContent.trim()),
    prev: !!document.querySelector('a.prev-page'),
    next: !!document.querySelector('a.next-page'),
    title: document.title,
  }));
"""


def _real_alt(alt: str) -> bool:
    """An alt text a reader can use: words, not a file name or hash."""
    alt = alt.strip()
    return len(alt) >= 8 and not re.search(r"\.(png|svg|jpe?g|gif)$|[0-9a-f]{16}", alt, re.I)


_LAYOUT_FACTS = """
const done = arguments[arguments.length - 1];
const imgs = Array.from(document.images);
Promise.all(imgs.map(i => i.complete ? null : new Promise(r => { i.onload = r; i.onerror = r; })))
  .then(() => setTimeout(() => {
    const doc = document.documentElement;
    const wide = Array.from(document.querySelectorAll('div.cell_output pre, div.output pre'))
      .filter(p => p.scrollWidth > p.clientWidth + 1).map(p => p.textContent.slice(0, 80));
    const wideCode = Array.from(document.querySelectorAll('div.cell_input pre, div.highlight pre'))
      .filter(p => p.scrollWidth > p.clientWidth + 1).map(p => p.textContent.slice(0, 80));
    const article = document.querySelector('article') || document.body;
    // a figure wider than the column is one only where no box of its own scrolls it (a phone's figures do)
    const scrolls = i => { const b = i.closest('a.image-reference');
      return !!b && getComputedStyle(b).overflowX === 'auto' && b.getBoundingClientRect().width <= article.getBoundingClientRect().width + 1; };
    const wideImages = imgs.filter(i => i.getBoundingClientRect().width > article.getBoundingClientRect().width + 1 && !scrolls(i))
      .map(i => i.getAttribute('alt') || i.src);
    // a plot's smallest text: 9 pt, drawn at 100 dpi (12.5 px) at its width attribute (pinlab.plots' style)
    const figureText = imgs.filter(i => i.closest('div.cell_output') && i.getAttribute('width'))
      .map(i => ({alt: i.getAttribute('alt'), px: 12.5 * i.getBoundingClientRect().width / Number(i.getAttribute('width'))}));
    const firstCode = document.querySelector('div.cell_input pre');
    const runIt = document.querySelector('.run-it');
    done({
      pageScroll: doc.scrollWidth - doc.clientWidth,
      wideOutputs: wide,
      wideCode: wideCode,
      wideImages: wideImages,
      figureText: figureText,
      codeBlocks: document.querySelectorAll('div.cell_input div.highlight pre').length,
      copyButtons: document.querySelectorAll('div.cell_input button.copybtn').length,
      outputCopyButtons: document.querySelectorAll('div.output button.copybtn').length,
      runIt: runIt ? Array.from(runIt.querySelectorAll('a, span.repository')).map(a => a.className) : null,
      installCell: !!firstCode && firstCode.textContent.startsWith(INSTALL_MARK),
    });
  }, 300));
"""


def _visit(driver, url: str) -> dict:
    driver.get(url)
    facts = driver.execute_async_script(_PAGE_FACTS)
    facts["errors"] = [e["message"] for e in driver.get_log("browser") if e.get("level") == "SEVERE"]
    return facts


def _ids(html_file: Path) -> set[str]:
    return set(re.findall(r'\bid="([^"]+)"', html_file.read_text(encoding="utf-8")))


def _check_site_in_browser(driver, out: Path, base: str, pages: dict) -> dict[str, dict]:
    """Every HTML page of the site: no console error, images loaded, internal links resolve."""
    html_files = sorted(p for p in out.rglob("*.html") if not p.relative_to(out).as_posix().startswith("_"))
    seen, problems = {}, []
    for f in html_files:
        rel = f.relative_to(out).as_posix()
        facts = seen[rel] = _visit(driver, base + rel)
        problems += [f"{rel}: console error: {m}" for m in facts["errors"]]
        problems += [f"{rel}: image did not load: {i['src']}" for i in facts["images"] if not i["ok"]]
        problems += [f"{rel}: image without a real alt text ({i['alt']!r}): {i['src']}" for i in facts["images"]
                     if not _real_alt(i["alt"])]
        problems += [f"{rel}: fetched from outside the site: {r}" for r in facts["resources"] if not r.startswith(base)]
        for href in facts["links"]:
            if not href.startswith(base):
                continue  # an external link (Sphinx, Furo credits): not followed
            parsed = urllib.parse.urlsplit(href)
            target = out / urllib.parse.unquote(parsed.path[len(urllib.parse.urlsplit(base).path):])
            if target.is_dir():
                target = target / "index.html"
            if not target.is_file():
                problems.append(f"{rel}: broken link {href}")
            elif parsed.fragment and target.suffix == ".html" and urllib.parse.unquote(parsed.fragment) not in _ids(target):
                problems.append(f"{rel}: link to a missing anchor {href}")
        nb_rel = rel[:-5] + ".ipynb"
        if nb_rel in pages:
            want = pages[nb_rel]["provenance"]
            if want not in facts["provenance"]:
                problems.append(f"{rel}: provenance line missing (want {want!r}, found {facts['provenance']})")
            if not facts["prev"]:  # every page follows at least the landing page
                problems.append(f"{rel}: no link to the previous page")
        if rel == "index.html" and not facts["next"]:
            problems.append("index.html: no link to the next page")
    assert not problems, "\n".join(problems)
    for nb_rel in pages:  # every notebook was visited as a page
        assert nb_rel[:-6] + ".html" in seen, nb_rel
    return seen


def _screenshot(driver, url: str, path: Path, *, full: bool = False, scroll_to_image: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    driver.set_window_size(1280, 900)
    driver.get(url)
    if full:
        height = driver.execute_script("return document.documentElement.scrollHeight")
        driver.set_window_size(1280, min(max(height, 900), 3200))
    if scroll_to_image:
        driver.execute_async_script(_PAGE_FACTS)  # wait for the images: they set the page's layout
        driver.execute_script("const i = document.querySelector('article img');"
                              "if (i) i.scrollIntoView({block: 'center', behavior: 'instant'});")
        time.sleep(0.3)
    driver.save_screenshot(str(path))
    assert path.stat().st_size > 1000
    driver.set_window_size(1280, 900)


def test_every_page_of_the_site_in_chromium(site, browser, serve):
    base = serve(site["out"])
    seen = _check_site_in_browser(browser, site["out"], base, site["pages"])
    _screenshot(browser, base + "index.html", SCREENSHOTS / "landing.png", full=True)
    lessons = [r for r in seen if r.startswith("notebooks/")]
    lesson = max(lessons, key=lambda r: (len(seen[r]["images"]), r == "notebooks/01_pinned_memory.html"))
    _screenshot(browser, base + lesson, SCREENSHOTS / "lesson.png")
    if seen[lesson]["images"]:
        _screenshot(browser, base + lesson, SCREENSHOTS / "lesson_plot.png", scroll_to_image=True)


@pytest.mark.parametrize("which", ["site_with_plot", "run_site"])
def test_plots_load_in_chromium(which, request, browser, serve):
    built = request.getfixturevalue(which)
    base = serve(built["out"])
    seen = _check_site_in_browser(browser, built["out"], base, built["pages"])
    imgs = seen["notebooks/01_x.html"]["images"]
    assert imgs and all(i["ok"] for i in imgs), imgs


def _layout(driver, url: str, width: int = 1400) -> dict:
    driver.set_window_size(width, 900)
    try:
        driver.get(url)
        return driver.execute_async_script(_LAYOUT_FACTS.replace("INSTALL_MARK", json.dumps(install_cell.MARK)))
    finally:
        driver.set_window_size(1280, 900)


@pytest.mark.parametrize("width", [1400, 390])
def test_lesson_pages_wrap_code_and_outputs_and_offer_copy_and_run_it(site, browser, serve, width):
    """At 1400 px and at a phone's 390 px a lesson page has no horizontal scroll (code and outputs wrap; a wide
    table scrolls inside its own box), no figure is wider than the column but in a box that scrolls it, every
    figure's smallest text (9 pt) shows at 9 px or more (issue 49; at 390 px every figure shows at 73% of its drawn
    size and scrolls in its box: one width for all showed a figure drawn wider at 8.5 px in stop 60), every code
    cell has a copy button (outputs have none), the "run it" row is under the title and the first code cell is the
    install cell."""
    base = serve(site["out"])
    problems = []
    for rel in sorted(site["pages"]):
        facts = _layout(browser, base + rel[:-6] + ".html", width)
        if facts["pageScroll"] > 0:
            problems.append(f"{rel}: the page scrolls sideways by {facts['pageScroll']} px at {width} px")
        problems += [f"{rel}: an output scrolls sideways at {width} px: {w!r}" for w in facts["wideOutputs"]]
        problems += [f"{rel}: a code block scrolls sideways at {width} px: {w!r}" for w in facts["wideCode"]]
        problems += [f"{rel}: a figure is wider than the column at {width} px: {w!r}" for w in facts["wideImages"]]
        problems += [f"{rel}: a figure's 9-pt text shows at {f['px']:.1f} px at {width} px (under 9): {f['alt']!r}"
                     for f in facts["figureText"] if f["px"] < 9]
        problems += [f"{rel}: a figure shows larger than drawn ({f['px']:.1f} px for 12.5) at {width} px: {f['alt']!r}"
                     for f in facts["figureText"] if width < 600 and f["px"] > 12.6]
        if facts["codeBlocks"] and facts["copyButtons"] < facts["codeBlocks"]:
            problems.append(f"{rel}: {facts['copyButtons']} copy buttons for {facts['codeBlocks']} code cells")
        if facts["outputCopyButtons"]:
            problems.append(f"{rel}: copy buttons on outputs")
        if not facts["runIt"] or not {"download", "repository"} <= set(facts["runIt"]):
            problems.append(f"{rel}: no run-it row with a download and a repository link or local-run note "
                            f"({facts['runIt']})")
        elif build_site.colab_url(build_site.repository_url(), rel) and "colab" not in facts["runIt"]:
            problems.append(f"{rel}: no Colab link in the run-it row")
        if not facts["installCell"]:
            problems.append(f"{rel}: the first code cell is not the install cell")
    landing = _layout(browser, base + "index.html", width)
    if landing["pageScroll"] > 0:
        problems.append(f"index.html: the page scrolls sideways by {landing['pageScroll']} px at {width} px")
    assert not problems, "\n".join(problems)
    if width == 390:
        lesson = next(r for r in sorted(site["pages"]) if r.startswith("notebooks/01"))
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        browser.set_window_size(390, 844)
        browser.get(base + lesson[:-6] + ".html")
        browser.save_screenshot(str(SCREENSHOTS / "lesson_phone.png"))
        browser.set_window_size(1280, 900)


def test_download_link_serves_the_committed_notebook(site):
    for rel in site["pages"]:
        assert (site["out"] / rel).read_bytes() == (ROOT / rel).read_bytes(), rel


def test_run_it_row_and_repository_url():
    repo = build_site.repository_url()
    assert repo.startswith("https://") and repo == build_site.REPOSITORY_FALLBACK or "REPLACE-ME" not in repo
    assert build_site.colab_url("https://github.com/a/b", "notebooks/01_x.ipynb") == \
        "https://colab.research.google.com/github/a/b/blob/main/notebooks/01_x.ipynb"
    assert build_site.colab_url("https://gitlab.com/a/b", "notebooks/01_x.ipynb") is None
    # the placeholder address gets no link at all: no Colab, no repository, no install cell pointing there
    row = build_site.run_it_row("notebooks/01_x.ipynb", build_site.REPOSITORY_FALLBACK)
    assert build_site.colab_url(build_site.REPOSITORY_FALLBACK, "notebooks/01_x.ipynb") is None
    assert "REPLACE-ME" not in row and "make lab" in row and 'class="download"' in row
    assert "github.com/a/b" in build_site.run_it_row("notebooks/01_x.ipynb", "https://github.com/a/b")
    cell = build_site.install_cell("https://github.com/a/b", "v1.0")
    assert 'find_spec("pinlab") is None' in cell
    assert install_cell.installed_spec(cell) == "pinlab @ git+https://github.com/a/b@v1.0"
    assert cell == install_cell.source("https://github.com/a/b", ref="v1.0")  # one template: tools/install_cell.py
    compile(cell, "install", "exec")  # plain Python: no IPython magic
    # a real address: the row offers Colab and says to run the install cell first; the placeholder: neither
    real = build_site.run_it_row("notebooks/01_x.ipynb", "https://github.com/a/b")
    assert 'class="colab"' in real and "install cell" in real
    assert 'class="colab"' not in row and "install cell" not in row


def test_the_landing_page_says_what_the_run_it_row_does():
    """The landing page's sentence about the "run it" row is true for the address pyproject.toml names."""
    placeholder = build_site.run_it_text(build_site.REPOSITORY_FALLBACK)
    assert "Colab" in placeholder and "no Colab link" in placeholder and "make lab" in placeholder
    assert "opens the notebook in Colab" not in placeholder
    real = build_site.run_it_text("https://github.com/a/b")
    assert "opens the notebook in Colab" in real and "install cell" in real
    assert "{{run_it}}" in (ROOT / "site" / "index.md").read_text(encoding="utf-8")


def test_alt_texts_come_from_titles_or_headings():
    png = {"output_type": "display_data", "data": {"image/png": "x", "text/plain": "<Figure>"}, "metadata": {}}
    cells = [{"cell_type": "markdown", "source": "## Bandwidth, *pinned* against pageable"},
             {"cell_type": "code", "source": "plot(x)", "outputs": [png], "metadata": {}},
             {"cell_type": "code", "source": 'ax.set_title("Copy time by size")', "outputs": [png, png],
              "metadata": {}},
             {"cell_type": "code", "source": "print(1)", "outputs": [], "metadata": {}},
             {"cell_type": "code", "source": 'plot(r, title=f"10,000 snapshots ({run.tag})")\nplot(title=f"{m}")',
              "outputs": [png], "metadata": {}}]
    build_site.alt_texts(cells)
    assert cells[4]["metadata"]["mystnb"]["image"]["alt"] == "Plot: 10,000 snapshots"
    assert cells[1]["metadata"]["mystnb"]["image"]["alt"] == "Plot for “Bandwidth, pinned against pageable”"
    assert cells[2]["metadata"]["mystnb"]["image"]["alt"] == "Plot: Copy time by size (2 figures)"
    assert "mystnb" not in cells[3]["metadata"]


def test_host_paths_and_profiler_warnings_leave_the_page():
    cell = {"outputs": [
        {"output_type": "stream", "name": "stdout", "text": "20 x Tensor.copy_ at /tmp/ipykernel_803/1494548031.py:2\n"},
        {"output_type": "stream", "name": "stderr", "text":
            "/usr/lib/python3/dist-packages/torch/profiler/profiler.py:123: UserWarning: CUPTI busy\n"
            "  warn(\"CUPTI busy\")\nsweep: 100%| 3/3\n"},
        {"output_type": "stream", "name": "stderr", "text":
            "/tmp/x/lib/python3.12/site-packages/torch/profiler/profiler.py:9: UserWarning: x\n"}]}
    build_site._tidy_outputs(cell)
    assert [o["text"] for o in cell["outputs"]] == ["20 x Tensor.copy_ at <cell>:2\n", "sweep: 100%| 3/3\n"]


def test_site_build_needs_no_torch_and_its_venv_only_the_site_extra():
    """`make site` runs in .venv-site (the `site` extra only): staging the pages must not import torch or pinlab."""
    import subprocess

    code = ("import sys; sys.modules['torch'] = None; sys.modules['pinlab'] = None; sys.path.insert(0, 'tools')\n"
            "import build_site, tempfile, pathlib\n"
            "with tempfile.TemporaryDirectory() as d:\n"
            "    pages = build_site.stage(pathlib.Path(d) / 'src')\n"
            "assert pages and build_site.syllabus_rows()\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    reqs = build_site.site_requirements()
    assert not any(r.split(">")[0].split("=")[0].strip() in ("torch", "pinlab") for r in reqs), reqs
    assert {"sphinx", "myst-nb", "furo", "sphinx-copybutton"} <= {re.split(r"[<>=!~ ]", r)[0] for r in reqs}


def test_site_requirements_read_the_same_without_tomllib(monkeypatch):
    """Python 3.10 has no tomllib: `make site` reads the extra as text there, to the same list."""
    want = build_site.site_requirements()
    monkeypatch.setitem(sys.modules, "tomllib", None)
    assert build_site.site_requirements() == want
