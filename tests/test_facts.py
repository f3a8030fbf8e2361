"""docs/facts.md, the course's table of technical claims with their sources (issue 33).

The table is checked here for what a machine can check: its format (an id, a claim, a source, a version
and at least one place per row), that every place it names exists and still says what the row quotes,
and that the lessons cite the table: every row is cited by its id in one of the files it names, and every
id a file cites is a row. Whether a source says what a row claims is the human's part of the check
(docs/facts.md says how). The checker is written against planted bad tables below, so it can fail.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FACTS = ROOT / "docs" / "facts.md"
COLUMNS = ["id", "claim", "source (file / function, or page)", "version", "where the course states it"]
LOCATION = re.compile(r'`([^`]+)`: "((?:[^"\\]|\\.)+)"')
ID = re.compile(r"^F[1-9][0-9]*$")
CITED = re.compile(r"\bF([1-9][0-9]*)\b")


def _cells(line: str) -> list[str]:
    """The cells of one Markdown table row; a `|` inside backticks or escaped stays in its cell."""
    cells, cur, tick, i = [], [], False, 0
    body = line.strip()[1:-1] if line.strip().startswith("|") and line.strip().endswith("|") else line.strip()
    while i < len(body):
        ch = body[i]
        if ch == "\\" and i + 1 < len(body):
            cur.append(body[i:i + 2])
            i += 2
            continue
        if ch == "`":
            tick = not tick
        if ch == "|" and not tick:
            cells.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
        i += 1
    cells.append("".join(cur).strip())
    return cells


def parse(text: str) -> tuple[list[str], list[list[str]]]:
    """(header cells, row cells) of the one table in the text; raises ValueError where there is none."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith("| id |")), None)
    if start is None:
        raise ValueError("no table whose first column is 'id'")
    header = _cells(lines[start])
    rows = []
    for ln in lines[start + 2:]:
        if not ln.lstrip().startswith("|"):
            break
        rows.append(_cells(ln))
    return header, rows


def normalized(text: str) -> str:
    """A file's text with comment markers at the start of lines removed, all whitespace collapsed, and
    Python's implicit string concatenation undone (`"a " "b"` reads `a b`)."""
    out = []
    for ln in text.splitlines():
        s = ln.strip()
        s = re.sub(r"^#+\s?", "", s)
        out.append(s)
    flat = " ".join(" ".join(out).split())
    return re.sub(r'" f?"', "", flat)


def locations(cell: str) -> list[tuple[str, str]]:
    """(file, quote) pairs of a 'where' cell, quotes unescaped (\\" -> ")."""
    return [(f, q.replace('\\"', '"')) for f, q in LOCATION.findall(cell)]


def problems(text: str, root: Path = ROOT) -> list[str]:
    """Everything wrong with a facts table (its text), read against the files under ``root``."""
    try:
        header, rows = parse(text)
    except ValueError as exc:
        return [str(exc)]
    out = []
    if header != COLUMNS:
        out.append(f"the header is {header}, not {COLUMNS}")
    if not rows:
        out.append("the table has no rows")
    seen, texts = set(), {}
    for n, row in enumerate(rows, 1):
        if len(row) != len(COLUMNS):
            out.append(f"row {n} has {len(row)} cells, not {len(COLUMNS)}")
            continue
        fid, claim, source, version, where = row
        if not ID.match(fid):
            out.append(f"row {n}: id {fid!r} is not F<number>")
        if fid in seen:
            out.append(f"row {n}: id {fid} is used twice")
        seen.add(fid)
        for name, cell in (("claim", claim), ("source", source), ("version", version)):
            if len(cell) < 3:
                out.append(f"{fid}: the {name} is empty")
        if not re.search(r"\d", version):
            out.append(f"{fid}: the version names no version number ({version!r})")
        locs = locations(where)
        if not locs:
            out.append(f"{fid}: 'where' names no `file`: \"quote\" location")
        cited = False
        for path, quote in locs:
            f = root / path
            if not f.is_file():
                out.append(f"{fid}: {path} does not exist")
                continue
            body = texts.setdefault(path, f.read_text(encoding="utf-8"))
            if normalized(quote) not in normalized(body):
                out.append(f"{fid}: {path} no longer says {quote!r}")
            if "facts.md" in body and re.search(rf"\b{fid}\b", body):
                cited = True
        if locs and not cited:
            out.append(f"{fid}: none of the files it names cites it (docs/facts.md and {fid})")
    for path, body in texts.items():
        if "facts.md" not in body:
            continue
        for m in CITED.finditer(body):
            if f"F{m.group(1)}" not in seen:
                out.append(f"{path} cites F{m.group(1)}, which is not a row of the table")
    return out


# ---- the real table ----------------------------------------------------------------------------------

def test_the_fact_table_exists_and_has_no_problem():
    assert FACTS.is_file(), "docs/facts.md is missing"
    assert problems(FACTS.read_text(encoding="utf-8")) == []


def test_every_row_has_a_lesson_or_library_location():
    _, rows = parse(FACTS.read_text(encoding="utf-8"))
    for row in rows:
        assert all(p.startswith(("notebooks/src/", "lib/pinlab/", "solutions/src/")) for p, _ in locations(row[4])), row[0]


def test_lessons_that_state_such_facts_cite_the_table():
    """Every lesson the table names points its reader to docs/facts.md, and lesson 00 says where the table is."""
    _, rows = parse(FACTS.read_text(encoding="utf-8"))
    named = {p for row in rows for p, _ in locations(row[4]) if p.startswith("notebooks/src/")}
    assert len(named) >= 8
    for path in sorted(named):
        assert "docs/facts.md" in (ROOT / path).read_text(encoding="utf-8"), path
    assert "docs/facts.md" in (ROOT / "notebooks/src/00_start_here.py").read_text(encoding="utf-8")


def test_platforms_never_run_are_rows_marked_not_measured_here():
    _, rows = parse(FACTS.read_text(encoding="utf-8"))
    by_id = {r[0]: r for r in rows}
    for fid, word in (("F15", "GH200"), ("F16", "HMM"), ("F17", "ROCm"), ("F18", "WSL2")):
        assert word in by_id[fid][1] and "Not measured here" in by_id[fid][1], fid


@pytest.mark.parametrize("path", sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "notebooks" / "src").glob("*.py")))
def test_a_platform_statement_in_a_lesson_says_not_measured_here(path):
    """Every paragraph (Markdown cell block or why= string) of a lesson that states how a GH200, ROCm or HMM
    behaves says, in it, that this course did not measure it."""
    text = (ROOT / path).read_text(encoding="utf-8")
    for block in re.split(r"\n\s*\n|\n# %%", text):
        flat = normalized(block)
        if re.search(r"\b(GH200|ROCm|HMM)\b", flat) and re.search(
                r"page tables|pageable copy|HIP documents|waits|stag|eats into|LPDDR5X|narrows", flat):
            assert re.search(r"not measured here|never ran on", flat, re.I), f"{path}: {flat[:200]}"


# ---- the checker fails where it should (planted bad tables) --------------------------------------------

GOOD = (
    "| id | claim | source (file / function, or page) | version | where the course states it |\n"
    "| --- | --- | --- | --- | --- |\n"
    "| F1 | a claim | `x.cpp`, `f` | torch 2.11 | `lesson.py`: \"the quoted words\" |\n"
)


@pytest.fixture()
def tree(tmp_path):
    (tmp_path / "lesson.py").write_text("# the quoted\n# words, see docs/facts.md F1\n", encoding="utf-8")
    return tmp_path


def test_checker_passes_a_good_table(tree):
    assert problems(GOOD, tree) == []


@pytest.mark.parametrize("bad, message", [
    (GOOD.replace("| F1 |", "| 1 |"), "is not F<number>"),
    (GOOD + GOOD.splitlines()[-1] + "\n", "used twice"),
    (GOOD.replace("torch 2.11", "main"), "names no version number"),
    (GOOD.replace("`lesson.py`", "`missing.py`"), "does not exist"),
    (GOOD.replace("the quoted words", "words it no longer says"), "no longer says"),
    (GOOD.replace(' `lesson.py`: "the quoted words" ', " lesson.py "), "names no"),
    (GOOD.replace("| a claim |", "| |"), "claim is empty"),
    (GOOD.replace("| id |", "| key |"), "no table"),
    (GOOD.replace("| version |", "| release |"), "the header is"),
])
def test_checker_rejects_a_planted_bad_table(tree, bad, message):
    assert any(message in p for p in problems(bad, tree)), problems(bad, tree)


def test_checker_rejects_an_uncited_row_and_a_dangling_citation(tree):
    (tree / "lesson.py").write_text("# the quoted words, see docs/facts.md F2\n", encoding="utf-8")
    found = problems(GOOD, tree)
    assert any("none of the files it names cites it" in p for p in found)
    assert any("cites F2, which is not a row" in p for p in found)
