"""`make site`: the course as a website, built from the committed notebooks without executing them.

The generator is Sphinx with MyST-NB (notebooks as pages, their stored outputs and plots rendered
as they are: ``nb_execution_mode = "off"``) and the Furo theme (sidebar, previous/next links).
Its configuration and the landing page's text live in ``site/``; this script only stages the
sources and runs Sphinx:

1. copies ``site/`` into a staging folder and fills in the landing page: the syllabus table (from
   its one source, ``lib/pinlab/syllabus.py``, loaded by path: lesson, title and goal, minutes, what
   needs a GPU, with links to each lesson's exercises and solutions) and the tables of contents;
2. copies every lesson (``notebooks/``), exercise (``exercises/``), solution (``solutions/``) and
   capstone (``capstone/``, when there is one), adding at the top of each page one line that says
   where its outputs come from (``provenance``): "recorded on <GPU>, <date>" (the GPU suite's
   ``reports/gpu/latest.json``), "CPU replay", "not executed yet", or, for ``make run``, this run;
   finished progress bars are kept, their intermediate frames are dropped;
3. copies the repository files that the notebooks link to (so that every link resolves);
4. runs Sphinx (warnings are errors for ``make site`` and the tests).

Usage:  python3 tools/build_site.py [--out build/site] [--lenient] [--force] [--requirements]
It imports neither torch nor pinlab (`make site` runs it in .venv-site, which has the `site` extra only).
``--out`` is emptied first, so it must be a folder inside the checkout's ``build/`` (``out_problem``; symbolic
links resolved first, and ``build/`` itself a link to elsewhere is refused); ``--force`` allows a new or empty
folder elsewhere, never one that holds anything: nothing outside ``build/`` is ever deleted.
``make run`` (tools/run_course.py) calls ``build()`` with the notebooks it executed and its run
table, so that what it ran looks the same as this site.
"""
from __future__ import annotations

import argparse
import dataclasses
import html
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import install_cell as _install  # noqa: E402  (tools/install_cell.py: the course's address, the install cell)
import nbtools  # noqa: E402  (tools/nbtools.py: source_sha256, as the GPU suite computes it)

ROOT = nbtools.ROOT
SITE_SRC = ROOT / "site"
#: where the course lives when pyproject.toml names no [project.urls] Repository (it does: edit it there)
REPOSITORY_FALLBACK = _install.REPOSITORY_FALLBACK
#  folder       sidebar caption
SECTIONS = {"notebooks": "Lessons", "exercises": "Exercises", "solutions": "Solutions", "capstone": "Capstone"}
_LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


@dataclasses.dataclass
class RunRow:
    path: str        # relative to the repository, e.g. "notebooks/01_pinned_memory.ipynb"
    mode: str        # "GPU (NVIDIA H200)" or "CPU replay"
    seconds: float
    status: str      # "ok" or "FAILED"


@dataclasses.dataclass
class Run:
    """What `make run` executed: where (mode), when (UTC date) and one row per notebook."""
    mode: str
    date: str
    rows: list[RunRow]
    executed_root: Path  # the executed copies, laid out like the repository (build/executed)


# ---------------------------------------------------------------------------------------------
# facts read from the repository

def has_outputs(nb: dict) -> bool:
    return any(c.get("cell_type") == "code" and c.get("outputs") for c in nb.get("cells", []))


def gpu_report(root: Path = ROOT) -> dict | None:
    """reports/gpu/latest.json, or None when it is missing or unreadable (the site still builds)."""
    try:
        rep = json.loads((root / "reports" / "gpu" / "latest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return rep if isinstance(rep, dict) else None


def _date(utc) -> str:
    return (utc if isinstance(utc, str) else "")[:10] or "an unknown date"


_MD_PUNCTUATION = re.compile(r"([!-/:-@\[-`{-~])")


def md_text(value) -> str:
    """A recorded value (``latest.json``'s ``gpu``, driver, dates, a run's mode...) as literal text in MyST
    Markdown: one line, every ASCII punctuation character backslash-escaped (CommonMark), so that nothing in it
    is read as HTML (``<img src=x onerror=...>`` shows as text), a link, emphasis, a role or a table cell's end."""
    return _MD_PUNCTUATION.sub(r"\\\1", " ".join(str(value).split()))


def provenance(rel: str, nb: dict, report: dict | None, run: Run | None = None) -> tuple[str, str]:
    """Where the outputs of notebook ``rel`` come from: (kind, one sentence for the top of its page).

    kind is one of "gpu", "cpu-replay", "not-executed", "this-run", "failed".
    """
    recorded = ""
    if report:
        recorded = f"{report.get('gpu') or 'a GPU'}, {_date(report.get('utc'))}"
    if run is not None:
        row = next((r for r in run.rows if r.path == rel), None)
        if row is not None:
            if run.mode.startswith("GPU"):
                where = f"measured live on {run.mode[len('GPU'):].strip(' ()') or 'this GPU'}"
            else:
                where = ("a CPU replay on this machine" + (f" of the GPU run recorded on {recorded}" if recorded else "")
                         + "; step loops on the emulated stream")
            sentence = f"Outputs from this run (make run, {run.date}): {where}."
            if row.status != "ok":
                return "failed", sentence + " This notebook FAILED in this run: outputs stop at the failing cell."
            return "this-run", sentence
    if not has_outputs(nb):
        return "not-executed", ("Not executed yet: this page shows the code without outputs "
                                "(make lab or make run executes it).")
    entry = None
    if report:
        entry = next((n for n in report.get("notebooks", []) if isinstance(n, dict) and n.get("path") == rel), None)
    if entry is not None:
        details = ", ".join(f"{label} {report[k]}" for k, label in (("torch", "torch"), ("cuda", "CUDA"))
                            if report.get(k))
        sentence = f"Outputs recorded on {recorded} by the GPU suite" + (f" ({details})" if details else "") + "."
        if entry.get("status") not in ("passed", "executed"):
            return "failed", sentence + f" The suite reported this notebook as {entry.get('status')}."
        if entry.get("source_sha256") and entry["source_sha256"] != nbtools.source_sha256(nb):
            sentence += " The page's text has been edited since that run."
        return "gpu", sentence
    sentence = "Outputs from a CPU replay"
    if recorded:
        sentence += f": experiments replayed from the GPU run recorded on {recorded}"
    return "cpu-replay", sentence + "; step loops on the emulated stream."


def parse_syllabus(readme: str) -> list[dict]:
    """Rows of the README's "## Syllabus" table: lesson, path, topic, minutes, gpu."""
    m = re.search(r"^## Syllabus\s*$(.*?)(?=^## |\Z)", readme, re.M | re.S)
    if not m:
        return []
    rows = []
    for line in m.group(1).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or not line.lstrip().startswith("|"):
            continue
        link = re.match(r"\[([^\]]+)\]\(([^)]+)\)", cells[0])
        if not link:
            continue  # the header row and the |---| row
        rows.append({"lesson": link.group(1), "path": link.group(2), "topic": cells[1],
                     "minutes": cells[2], "gpu": cells[3]})
    return rows


def syllabus_rows(root: Path = ROOT) -> list[dict]:
    """The syllabus's rows (lesson, path, topic, minutes, gpu) from its one source, lib/pinlab/syllabus.py
    (loaded by path: the site build imports no torch); a tree without it (a test's) falls back to the
    README's "## Syllabus" table."""
    if not (root / "lib" / "pinlab" / "syllabus.py").exists():
        readme = root / "README.md"
        return parse_syllabus(readme.read_text(encoding="utf-8")) if readme.exists() else []
    import syllabus as tool  # tools/syllabus.py

    syl = tool.load(root)
    return [{"lesson": r.number, "path": r.notebook, "topic": f"**{_md_cell(r.title)}**: {_md_cell(r.goal)}",
             "minutes": syl.minutes_text(r), "gpu": _md_cell(r.gpu), "core": "core" if r.core else "deep dive"}
            for r in syl.LESSONS]


def syllabus_totals(root: Path = ROOT) -> str:
    """The sentence under the syllabus: the whole course's time and the core path's ("" without the module)."""
    if not (root / "lib" / "pinlab" / "syllabus.py").exists():
        return ""
    import syllabus as tool  # tools/syllabus.py

    return tool.load(root).totals_text()


def repository_url(root: Path = ROOT) -> str:
    """``[project.urls] Repository`` in pyproject.toml: the one place the course's address is written."""
    return _install.repository_url(root)


def is_placeholder(repo: str) -> bool:
    """pyproject.toml's Repository is still the placeholder: no link may point there."""
    return _install.is_placeholder(repo)


def colab_url(repo: str, rel: str, branch: str = "main") -> str | None:
    """Colab opens a notebook straight from GitHub: None for a repository elsewhere, or none yet."""
    if is_placeholder(repo):
        return None
    m = re.match(r"https://github\.com/([^/]+)/([^/#?]+?)(?:\.git)?/?$", repo)
    return f"https://colab.research.google.com/github/{m.group(1)}/{m.group(2)}/blob/{branch}/{rel}" if m else None


def install_cell(repo: str, ref: str | None = None) -> str:
    """The install cell at the top of every notebook (tools/install_cell.py) for the course at ``repo``, installing
    its tag or commit ``ref`` (default: pyproject.toml's)."""
    return _install.source(repo, ref=ref)


def run_it_row(rel: str, repo: str) -> str:
    """The "run it" row under a page's title: Colab (once the repository address is real), the .ipynb to
    download, the repository (or, while its address is the placeholder, how to run it locally). The install
    cell that Colab needs is the notebook's own first code cell, on the page under this row."""
    name = Path(rel).name
    links = []
    colab = colab_url(repo, rel)
    if colab:
        links.append(f'<a class="colab" href="{html.escape(colab)}">Open in Colab</a>')
    links.append(f'<a class="download" href="{html.escape(name)}" download>Download {html.escape(name)}</a>')
    placeholder = is_placeholder(repo)  # no public address yet: the download, and how to run it locally
    links.append('<span class="repository">run it locally: <code>make lab</code> in the course\'s checkout</span>'
                 if placeholder else f'<a class="repository" href="{html.escape(repo)}">Repository</a>')
    if colab:
        links.append('<span class="run-it-note">on Colab, run the install cell (the first code cell) first</span>')
    return '<div class="run-it"><span class="run-it-label">Run it:</span> ' + " · ".join(links) + "</div>"


_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
_TITLE_ARG = re.compile(r"""(?:\btitle\s*=|set_title\(|suptitle\()\s*f?(["'])((?:(?!\1).){3,160})\1""")


def _title_text(literal: str) -> str:
    """A title as a reader sees it, from its literal: an f-string's fields in parentheses (this run's tag) or at
    either end are left out; "" where a field is inside the sentence (the title would not read)."""
    text = re.sub(r"\s*[(\[][^()\[\]]*\{[^{}]*\}[^()\[\]]*[)\]]", "", literal)
    text = re.sub(r"^\s*\{[^{}]*\}\s*[,;:·-]?|[,;:·-]?\s*\{[^{}]*\}\s*$", "", text)
    if "{" in text:
        return ""
    return re.sub(r"\s{2,}", " ", text).strip(" ,;:-·")


def _plain(md: str) -> str:
    """Markdown inline text as plain text (for an alt attribute)."""
    md = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", md)
    return re.sub(r"[*_`]", "", md).strip()


def alt_texts(cells: list[dict]) -> None:
    """Give every code cell with an image output an alt text (MyST-NB's cell metadata ``mystnb.image.alt``):
    the plot titles written in its source as plain strings, else the heading the cell sits under."""
    heading = ""
    for c in cells:
        if c.get("cell_type") == "markdown":
            found = _HEADING.findall(_src(c))
            if found:
                heading = _plain(found[-1])
            continue
        if c.get("cell_type") != "code":
            continue
        n = sum(1 for o in c.get("outputs", []) if any(k.startswith("image/") for k in o.get("data", {})))
        if not n:
            continue
        titles = [x for x in (_title_text(m.group(2)) for m in _TITLE_ARG.finditer(_src(c))) if len(x) >= 8]
        if titles:
            alt = "Plot: " + "; ".join(dict.fromkeys(titles))
        else:
            alt = f"Plot for “{heading}”" if heading else "Plot of this cell's results"
        if n > 1:
            alt += f" ({n} figures)"
        meta = c.setdefault("metadata", {}).setdefault("mystnb", {})
        meta.setdefault("image", {})["alt"] = alt


# the GPU host's paths: an IPython cell's file name (replaced) and warnings that name a file (dropped)
_CELL_FILE = re.compile(r"/tmp/ipykernel_\d+/\d+\.py")
_PATH_WARNING = re.compile(r"^\s*(?:/|[A-Za-z]:\\)\S*\.py:\d+: \w*(?:Warning|warn)\b.*$")
_WARN_SOURCE = re.compile(r"^\s+(?:warn|warnings\.warn|_warn)\w*\(.*$")


def _host_paths(text: str, stderr: bool) -> str:
    """A stream output without the GPU host's paths: "/tmp/ipykernel_803/15.py:2" reads "<cell>:2"; on
    stderr, a warning line naming a file (torch's profiler warns so) goes with the source line after it."""
    text = _CELL_FILE.sub("<cell>", text)
    if not stderr:
        return text
    out, drop_next = [], False
    for line in text.split("\n"):
        if drop_next and _WARN_SOURCE.match(line):
            drop_next = False
            continue
        drop_next = bool(_PATH_WARNING.match(line))
        if not drop_next:
            out.append(line)
    return "\n".join(out)


def title_of(nb: dict) -> str | None:
    for c in nb.get("cells", []):
        if c.get("cell_type") == "markdown":
            src = "".join(c["source"]) if isinstance(c["source"], list) else c["source"]
            m = re.match(r"\s*#\s+(.+)", src)
            return m.group(1).strip() if m else None
    return None


# ---------------------------------------------------------------------------------------------
# staging

def _src(cell: dict) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def _collapse_progress(text: str) -> str:
    """What a terminal shows after carriage returns: the last frame of each progress bar."""
    return "\n".join(line.rsplit("\r", 1)[-1] if "\r" in line.rstrip("\r") else line.rstrip("\r")
                     for line in text.split("\n"))


def _tidy_outputs(cell: dict) -> None:
    merged: list[dict] = []
    for out in cell.get("outputs", []):
        if (out.get("output_type") == "stream" and merged and merged[-1].get("output_type") == "stream"
                and merged[-1].get("name") == out.get("name")):
            merged[-1]["text"] = _src({"source": merged[-1]["text"]}) + _src({"source": out["text"]})
            continue
        merged.append(dict(out))
    for out in merged:
        if out.get("output_type") == "stream":
            out["text"] = _host_paths(_collapse_progress(_src({"source": out["text"]})), out.get("name") == "stderr")
        elif isinstance(out.get("data", {}).get("text/plain"), (str, list)):
            out["data"]["text/plain"] = _CELL_FILE.sub("<cell>", _src({"source": out["data"]["text/plain"]}))
    cell["outputs"] = [o for o in merged if o.get("output_type") != "stream" or o["text"].strip()]


def lesson_place(rel: str, rows: list[dict]) -> str | None:
    """Where a lesson's page stands in the course, for the line under its title: "Lesson 03 (5 of 11) · 65 + 15
    minutes, lesson + exercise · core path" (``rows``: :func:`syllabus_rows`); None for a page of no lesson."""
    stem = Path(rel).stem
    for k, r in enumerate(rows, 1):
        if Path(r["path"]).stem == stem:
            minutes = str(r["minutes"])
            what = "lesson + exercise" if "+" in minutes else "lesson"
            path = "core path" if r.get("core") == "core" else ("deep dive" if r.get("core") else "")
            return (f"Lesson {r['lesson']} ({k} of {len(rows)}) · {minutes} minutes, {what}"
                    + (f" · {path}" if path else ""))
    return None


def _page(nb: dict, rel: str, kind: str, sentence: str, repo: str | None = None, place: str | None = None) -> dict:
    """The notebook as a page: a title, the lesson's place in the course (``place``, :func:`lesson_place`), the
    provenance line and the "run it" row under it, tidy outputs (progress bars, no host paths), alt texts for its
    plots."""
    nb = json.loads(json.dumps(nb))
    folder = rel.split("/", 1)[0]
    # one line (a blank line in a recorded value would end the HTML block), every recorded value in it escaped
    line = f'<p class="provenance {html.escape(kind)}">{html.escape(" ".join(sentence.split()))}</p>'
    if place:
        line = f'<p class="lesson-place">{html.escape(place)}</p>\n\n' + line
    if repo:
        line += "\n\n" + run_it_row(rel, repo)
    cells = nb.setdefault("cells", [])
    first = next((c for c in cells if c.get("cell_type") == "markdown"), None)
    src = _src(first) if first else ""
    m = re.match(r"\s*(#\s+[^\n]*)\n?", src)
    if m:
        title_line, rest = m.group(1), src[m.end():]
    else:  # a page needs a title: the file name stands in
        title_line, rest, first = "# " + Path(rel).stem.replace("_", " "), "", None
    if folder == "solutions":
        title_line = re.sub(r"^#\s+Exercises\b", "# Solutions", title_line)
        if not title_line.startswith("# Solutions"):
            title_line = "# Solutions · " + title_line[2:]
    new_src = f"{title_line}\n\n{line}\n\n{rest}".rstrip() + "\n"
    if first is not None:
        first["source"] = new_src
    else:
        cells.insert(0, {"cell_type": "markdown", "metadata": {}, "source": new_src})
        if nb.get("nbformat_minor", 0) >= 5:
            cells[0]["id"] = "provenance"
    # code is Python: say so where a notebook that never ran does not
    nb.setdefault("metadata", {}).setdefault("language_info", {"name": "python"})
    _demote_extra_titles(cells)
    for c in cells:
        if c.get("cell_type") == "code":
            _tidy_outputs(c)
    alt_texts(cells)
    return nb


def _demote_extra_titles(cells: list[dict]) -> None:
    """A page has one title: when later Markdown cells open with more "# " headings (parts of a
    lesson), every heading after the title goes one level down, so they nest under it."""
    def headings(cell):
        fence = False
        for i, line in enumerate(cell["source"].split("\n")):
            if line.lstrip().startswith(("```", "~~~")):
                fence = not fence
            elif not fence and re.match(r"#{1,5}\s", line):
                yield i, line

    md = [c for c in cells if c.get("cell_type") == "markdown"]
    for c in md:
        c["source"] = _src(c)
    found = [(c, i) for c in md for i, line in headings(c) if line.startswith("# ")]
    if len(found) < 2:
        return
    title_cell, title_line = found[0]
    for c in md:
        lines = c["source"].split("\n")
        for i, _ in list(headings(c)):
            if not (c is title_cell and i == title_line):
                lines[i] = "#" + lines[i]
        c["source"] = "\n".join(lines)


def _linked_files(nb: dict, nb_rel: str, root: Path) -> set[str]:
    """Repository files (not notebooks) that the notebook's Markdown links to, relative to root."""
    out = set()
    base = (root / nb_rel).parent
    for c in nb.get("cells", []):
        if c.get("cell_type") != "markdown":
            continue
        for target in _LINK.findall(_src(c)):
            if re.match(r"^[a-z][a-z0-9+.-]*:|^#|^/", target, re.I):
                continue
            path = target.split("#", 1)[0]
            if not path or path.endswith((".ipynb", ".md")):
                continue
            p = (base / path).resolve()
            if p.is_file() and root.resolve() in p.parents:
                out.add(p.relative_to(root.resolve()).as_posix())
    return out


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _syllabus_md(rows: list[dict], pages: dict[str, dict], totals: str = "") -> str:
    """The syllabus table in MyST Markdown; lessons without a README row still get one."""
    by_path = {r["path"]: r for r in rows}
    lines = ["| lesson | what you learn | minutes (lesson + exercise) | needs a GPU to measure live | path | exercises |",
             "|---|---|---|---|---|---|"]
    for rel in sorted(p for p in pages if p.startswith("notebooks/")):
        r = by_path.get(rel, {})
        stem = Path(rel).stem
        lesson = r.get("lesson") or stem.split("_", 1)[0]
        practice = [f"[{d}]({d}/{stem}.ipynb)" for d in ("exercises", "solutions") if f"{d}/{stem}.ipynb" in pages]
        topic = r.get("topic") or _md_cell(pages[rel]["title"] or stem)
        lines.append(f"| [{lesson}]({rel}) | {topic} | {r.get('minutes', '')} | {r.get('gpu', '')} | "
                     f"{r.get('core', '')} | {', '.join(practice) or ''} |")
    table = "\n".join(lines)
    return f":::{{table}}\n:class: syllabus\n:width: 100%\n\n{table}\n:::" + (f"\n\n{totals}" if totals else "")


def run_it_text(repo: str) -> str:
    """The landing page's sentence on each page's "run it" row: true for the address pyproject.toml names."""
    if is_placeholder(repo):
        return ("Under each page's title, a **Run it** row downloads the `.ipynb`. To run the notebooks, clone the "
                "course and run `make lab` in it. There is no Colab link yet: the course's public address is not "
                "set (`[project.urls] Repository` in `pyproject.toml`).")
    return ("Under each page's title, a **Run it** row opens the notebook in Colab (run its first code cell, the "
            "install cell, first: it installs the course there, keeping Colab's torch), downloads the `.ipynb`, or "
            "goes to the repository.")


def _toctrees(pages: dict[str, dict], run: Run | None) -> str:
    lessons = sorted(p for p in pages if p.startswith("notebooks/"))
    exercises = sorted(p for p in pages if p.startswith("exercises/"))
    groups: list[tuple[str, list[str]]] = []
    # a lesson, then its exercises: previous/next follows the way a learner goes through the course
    flow = []
    for rel in lessons:
        flow.append(rel)
        ex = f"exercises/{Path(rel).name}"
        if ex in pages:
            flow.append(ex)
    flow += [e for e in exercises if e not in flow]
    groups.append(("Lessons and exercises", flow))
    for folder in ("capstone", "solutions"):
        groups.append((SECTIONS[folder], sorted(p for p in pages if p.startswith(folder + "/"))))
    if run is not None:
        groups.append(("This run", ["run.md"]))
    out = []
    for caption, docs in groups:
        if docs:
            entries = "\n".join(d.rsplit(".", 1)[0] for d in docs)
            out.append(f"```{{toctree}}\n:caption: {caption}\n:maxdepth: 1\n:hidden:\n\n{entries}\n```")
    return "\n\n".join(out)


def _evidence(report: dict | None, run: Run | None) -> str:
    parts = []
    if report:
        nbs = [n for n in report.get("notebooks", []) if isinstance(n, dict)]
        ok = sum(n.get("status") == "passed" for n in nbs)
        versions = ", ".join(f"{label} {md_text(report[k])}" for k, label in
                             (("driver", "driver"), ("torch", "torch"), ("cuda", "CUDA")) if report.get(k))
        parts.append(f"The committed outputs come from the GPU suite's run on {md_text(report.get('gpu') or 'a GPU')}"
                     + (f" ({versions})" if versions else "") + f" on {md_text(_date(report.get('utc')))}: "
                     f"{ok} of {len(nbs)} notebooks passed there (`reports/gpu/latest.json`).")
    else:
        parts.append("No GPU run is recorded yet (`reports/gpu/latest.json` is missing).")
    if run is not None:
        parts.append(f"This build shows what `make run` executed on {md_text(run.mode)} on {md_text(run.date)}: "
                     "see [the run table](run.md).")
    return " ".join(parts)


def _run_md(run: Run) -> str:
    lines = ["# This run", "",
             f"Executed by `make run` on {md_text(run.date)} on this machine: {md_text(run.mode)}. Each notebook "
             "ran headless from a fresh kernel; the committed notebooks were not changed.", "",
             "| notebook | mode | seconds | status |", "|---|---|---|---|"]
    for r in run.rows:
        link = f"[{md_text(r.path)}](<{r.path}>)" if re.fullmatch(r"[\w./-]+", r.path) else md_text(r.path)
        lines.append(f"| {link} | {md_text(r.mode)} | {float(r.seconds):.1f} | {md_text(r.status)} |")
    return "\n".join(lines) + "\n"


def stage(dest: Path, *, root: Path = ROOT, run: Run | None = None) -> dict[str, dict]:
    """Write the Sphinx sources into ``dest``; return {page path: {"title", "kind", "provenance"}}."""
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(SITE_SRC, dest, ignore=shutil.ignore_patterns("__pycache__"))
    report = gpu_report(root)
    repo = repository_url(root)
    pages: dict[str, dict] = {}
    linked: set[str] = set()
    rows = syllabus_rows(root)
    for folder in SECTIONS:
        for path in sorted((root / folder).glob("*.ipynb")):
            rel = path.relative_to(root).as_posix()
            src = path
            if run is not None and any(r.path == rel for r in run.rows) and (run.executed_root / rel).exists():
                src = run.executed_root / rel
            nb = json.loads(src.read_text(encoding="utf-8"))
            kind, sentence = provenance(rel, nb, report, run)
            page = _page(nb, rel, kind, sentence, repo, lesson_place(rel, rows))
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            (dest / rel).write_text(json.dumps(page, ensure_ascii=False), encoding="utf-8")
            pages[rel] = {"title": title_of(page), "kind": kind, "provenance": sentence, "source": src}
            linked |= _linked_files(nb, rel, root)
    for rel in sorted(linked):
        if not (dest / rel).exists():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(root / rel, dest / rel)
    index = (dest / "index.md").read_text(encoding="utf-8")
    index = (index.replace("{{syllabus}}", _syllabus_md(syllabus_rows(root), pages, syllabus_totals(root)))
             .replace("{{evidence}}", _evidence(report, run))
             .replace("{{run_it}}", run_it_text(repo))
             .replace("{{toctrees}}", _toctrees(pages, run)))
    (dest / "index.md").write_text(index, encoding="utf-8")
    if run is not None:
        (dest / "run.md").write_text(_run_md(run), encoding="utf-8")
    return pages


def build(out: Path, *, root: Path = ROOT, run: Run | None = None, strict: bool = True,
          quiet: bool = True) -> dict[str, dict]:
    """Build the site into ``out`` (index.html at its top); return the pages as ``stage`` does."""
    problem = out_problem(out, force=True, root=ROOT)  # never deletes outside the checkout's build/
    if problem:
        raise ValueError(f"build(out=...): {problem}")
    out = Path(out).expanduser().resolve()
    with tempfile.TemporaryDirectory(prefix="pinlab-site-") as tmp:
        src = Path(tmp) / "src"
        pages = stage(src, root=root, run=run)
        if out.exists():
            shutil.rmtree(out)
        cmd = [sys.executable, "-m", "sphinx", "-b", "html", "-E", "-d", str(Path(tmp) / "doctrees"),
               str(src), str(out)]
        if quiet:
            cmd.insert(3, "-q")
        if strict:
            cmd[3:3] = ["-W", "--keep-going"]
        res = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"Sphinx failed (exit {res.returncode}):\n{res.stdout[-4000:]}{res.stderr[-4000:]}")
        if res.stderr.strip() and not quiet:
            print(res.stderr, file=sys.stderr)
    for rel, page in pages.items():  # the "Download" link of each page: the notebook as it was given
        shutil.copyfile(page.pop("source"), out / rel)
    return pages


def site_requirements(root: Path = ROOT) -> list[str]:
    """The `site` extra of pyproject.toml: what `make site` installs into .venv-site (no torch, no pinlab)."""
    text = (root / "pyproject.toml").read_text(encoding="utf-8")
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the extra's list, read as text
        m = re.search(r"^site\s*=\s*\[(.*?)\]", text, re.M | re.S)
        return re.findall(r'"([^"]+)"', re.sub(r"#[^\n]*", "", m.group(1))) if m else []
    return list(tomllib.loads(text)["project"]["optional-dependencies"]["site"])


def missing_packages() -> list[str]:
    """The generator's packages that are not installed here (the `site` extra)."""
    import importlib.util

    return [name for mod, name in (("sphinx", "sphinx"), ("myst_nb", "myst-nb"), ("furo", "furo"),
                                   ("sphinx_copybutton", "sphinx-copybutton"))
            if importlib.util.find_spec(mod) is None]


def out_problem(out: Path, force: bool = False, root: Path = ROOT) -> str | None:
    """Why ``--out`` may not be emptied and rebuilt (None when it may). Symbolic links are resolved first: a
    folder is judged by where it really is. It may be a folder inside the checkout's ``build/`` (a real folder,
    not a link to one elsewhere); with ``force``, also a new or empty folder elsewhere, as nothing is deleted
    there; never a folder outside ``build/`` that holds anything (it would be deleted), whatever ``force`` says,
    and never the repository, a folder that holds it, the home folder or ``/``."""
    given = Path(os.path.abspath(Path(out).expanduser()))
    try:
        real = given.resolve()
        root_real = Path(root).resolve()
        build_real = (root_real / "build").resolve()
    except (OSError, RuntimeError) as exc:  # a symlink loop (RuntimeError before Python 3.13)
        return f"--out {given} cannot be resolved ({exc}): refused; give a folder inside build/"
    build_dir = root_real / "build"
    if build_real != build_dir:
        return (f"{build_dir} is a symbolic link to {build_real}: the site would be deleted and written there, "
                f"outside the checkout: refused; make it a folder of its own (rm {build_dir} && mkdir {build_dir})")
    if real != build_dir and build_dir in real.parents:
        return None
    if real == real.parent or real == Path.home().resolve() or real == root_real or real in root_real.parents:
        return f"--out {real} would delete the repository, a folder holding it, your home folder or /: refused"
    if given != real and (given == build_dir or build_dir in given.parents or Path(root) / "build" in given.parents):
        return (f"--out {given} leads through a symbolic link to {real}, outside {build_dir}{os.sep}: refused "
                "(it is deleted before the site is written there); give a real folder inside build/")
    if not force:
        return (f"--out {real} is outside {build_dir}{os.sep} and is deleted before the site is written there: "
                "give a folder inside build/, or --force for a new or empty folder elsewhere")
    if real.is_dir() and not any(real.iterdir()):
        return None
    if not real.exists() and not real.is_symlink():
        return None
    what = "is not a folder" if not real.is_dir() else "holds files"
    return (f"--out {real} is outside {build_dir}{os.sep} and {what}: it would be deleted before the site is "
            "written there, and build_site deletes nothing outside build/, even with --force: give a new or "
            "empty folder, or one inside build/")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "site",
                    help="output folder, emptied first: inside build/ (default build/site) unless --force")
    ap.add_argument("--force", action="store_true",
                    help="allow an --out outside build/ that is new or empty (nothing outside build/ is deleted)")
    ap.add_argument("--lenient", action="store_true", help="Sphinx warnings are not errors")
    ap.add_argument("--requirements", action="store_true",
                    help="print the site extra's requirements, one a line (make site installs them) and exit")
    args = ap.parse_args(argv)
    if args.requirements:
        print("\n".join(site_requirements()))
        return 0
    problem = out_problem(args.out, args.force)
    if problem:
        print(f"build_site: {problem}", file=sys.stderr)
        return 2
    missing = missing_packages()
    if missing:
        print(f"build_site: {', '.join(missing)} not installed: run `make site` (it sets up .venv-site), or "
              f"`{sys.executable} -m pip install -e '.[site]'`", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    pages = build(args.out, strict=not args.lenient)
    kinds: dict[str, int] = {}
    for p in pages.values():
        kinds[p["kind"]] = kinds.get(p["kind"], 0) + 1
    summary = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
    print(f"site: {len(pages)} notebook pages ({summary}) in {time.perf_counter() - t0:.1f} s: "
          f"{(args.out / 'index.html')}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
