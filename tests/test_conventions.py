"""The course's layout rule (CONTRIBUTING.md, "Adding a lesson"), checked for every lesson: a notebook source, a
syllabus row, and where the lesson has an exercise, its lesson module, checker module, master solution, two test
files, and a checker test that loads the master solution (issue 31: "a conventions test").

A lesson found without one of its rooms fails here with the room's path, so that a new lesson cannot land half
laid out."""
import json
import sys
import re
from pathlib import Path

import pytest

from pinlab import syllabus

ROOT = Path(__file__).resolve().parents[1]
LESSONS = {les.number: les for les in syllabus.LESSONS}
#: lessons without an exercise of their own: the start page, and 02b, whose exercise is lesson 02's
NO_EXERCISE = {"00", "02b"}


def _one(pattern: str) -> list[Path]:
    return sorted(ROOT.glob(pattern))


def test_every_notebook_source_has_a_syllabus_row_and_back():
    sources = {p.stem for p in _one("notebooks/src/*.py")}
    rows = {les.stem for les in syllabus.LESSONS}
    assert sources == rows, (f"notebooks/src and the syllabus (lib/pinlab/syllabus.py, LESSONS) differ: only a source: "
                             f"{sorted(sources - rows)}, only a row: {sorted(rows - sources)}")


@pytest.mark.parametrize("number", sorted(LESSONS))
def test_every_lesson_has_its_rooms(number):
    les = LESSONS[number]
    n = number[:2]
    assert (ROOT / "notebooks" / "src" / f"{les.stem}.py").is_file(), f"lesson {number}: no notebooks/src/{les.stem}.py"
    if number in NO_EXERCISE:
        assert not les.exercise_minutes, f"lesson {number} is listed as having no exercise, but its row has one"
        return
    missing = []
    for pattern in (f"lib/pinlab/lessons/l{n}_*.py", f"lib/pinlab/checks/l{n}.py", f"solutions/src/{les.stem}.py",
                    f"tests/test_l{n}.py"):
        if not _one(pattern):
            missing.append(pattern)
    if not [p for p in _one("tests/test_checks_l*.py") if f"l{n}" in p.stem]:
        missing.append(f"tests/test_checks_l{n}.py")
    assert not missing, f"lesson {number} lacks {', '.join(missing)} (CONTRIBUTING.md: Adding a lesson)"
    assert les.exercise_minutes, f"lesson {number} has a master solution but its syllabus row has no exercise"


@pytest.mark.parametrize("stem", sorted(p.stem for p in _one("solutions/src/*.py")))
def test_every_checker_test_loads_the_master_solution(stem):
    """The checker tests run the master solution's own code (solutions/src/<stem>.py), not a copy of it: they name
    its stem (``solution_namespace("<stem>")``, ``STEM = "<stem>"``, or its path)."""
    n = stem[:2]
    tests = [p for p in _one("tests/test_checks_l*.py") if f"l{n}" in p.stem]
    naming = [p.name for p in tests if re.search(rf"['\"/]{re.escape(stem)}(\.py)?['\"]", p.read_text(encoding="utf-8"))]
    assert naming, (f"no checker test of lesson {n} ({', '.join(p.name for p in tests) or 'none'}) loads "
                    f"solutions/src/{stem}.py: load it with solution_namespace({stem!r})")


def test_a_lesson_module_belongs_to_a_lesson():
    numbers = {les.number[:2] for les in syllabus.LESSONS}
    stray = [p.name for p in _one("lib/pinlab/lessons/l*.py") + _one("lib/pinlab/checks/l*.py")
             if re.match(r"l(\d\d)", p.stem) and re.match(r"l(\d\d)", p.stem).group(1) not in numbers]
    assert not stray, f"lesson or checker modules with no lesson in the syllabus: {stray}"


def test_no_claim_result_is_swallowed():
    """Issue 31: claim() and claims() return nothing (a claim ending a cell prints its line and no ``Out:``), so
    no source line assigns their result (``ok = pinlab.claims(...)`` existed only to swallow a True)."""
    pattern = re.compile(r"^\s*\w+\s*=\s*pinlab\.claims?\(", re.M)
    found = [f"{p.relative_to(ROOT).as_posix()}:{text[:m.start()].count(chr(10)) + 1}"
             for d in ("notebooks/src", "solutions/src") for p in sorted((ROOT / d).glob("*.py"))
             for text in [p.read_text(encoding="utf-8")] for m in pattern.finditer(text)]
    assert not found, f"a claim's result assigned (claim/claims return None): {found}"


def test_a_lettered_lesson_has_its_own_module():
    """Issue 31: 02b's experiments live in lessons/l02b_*.py, not in lesson 02's module (one lesson, one room)."""
    for number in (n for n in LESSONS if not n.isdigit()):
        assert _one(f"lib/pinlab/lessons/l{number}_*.py"), f"lesson {number} has no lib/pinlab/lessons/l{number}_*.py"


#: the pinlab calls that report rather than teach (issue 31's definition of plumbing)
REPORTING = {"claim", "claims", "observe", "measure", "measure_or_say", "show", "table", "header", "pinned_baseline",
             "pinned_back_to"}
#: issue 31's done-when: in every lesson's source the plumbing is at most this share of the non-blank lines
PLUMBING_TARGET = 0.20
#: the width the share counts lines at: the lessons' layout when the target was set (before issue 49's formatter)
PACKED_WIDTH = 120


def _packed(text: str, indent: int = 0) -> int:
    """Lines of code ``text`` (``ast.unparse``'s: one line per simple statement) written as densely as
    :data:`PACKED_WIDTH` columns allow."""
    return sum(-(-(indent + len(ln)) // PACKED_WIDTH) for ln in text.splitlines() if ln.strip())


def plumbing_share(path: Path) -> float:
    """Lines of statements that call a reporting function (or assign its result), over the source's lines
    (prose and comments included), as issue 31 counts them, but whatever the layout: each statement counts
    the lines it takes written as densely as 120 columns allow (:func:`_packed`), each comment line one.

    Issue 31 counted the non-blank lines of the source as written, when lessons were laid out by hand at
    up to 120 columns. Issue 49's formatter (88 columns, one argument per line where a call does not fit)
    spreads a claim over five lines and would double every share with no change in what is written; counted
    packed, a formatter's pass leaves the share as it was (tests/test_conventions.py checks both)."""
    import ast
    import io
    import tokenize

    text = path.read_text(encoding="utf-8")
    tree = ast.parse(text)
    plumbing = 0
    for node in ast.walk(tree):
        if isinstance(node, (ast.Expr, ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Call):
            f = node.value.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if name in REPORTING:
                plumbing += _packed(ast.unparse(node), node.col_offset)
    comments = sum(1 for t in tokenize.generate_tokens(io.StringIO(text).readline)
                   if t.type == tokenize.COMMENT and not t.line[: t.start[1]].strip())
    return plumbing / max(1, _packed(ast.unparse(tree)) + comments)


@pytest.mark.parametrize("number", LESSONS)
def test_plumbing_is_at_most_a_fifth(number):
    (path,) = _one(f"notebooks/src/{number}_*.py")
    share = plumbing_share(path)
    assert share <= PLUMBING_TARGET, (f"lesson {number}: {share:.1%} of its non-blank lines are plumbing (claims, "
                                      f"show, measure, ...), over {PLUMBING_TARGET:.0%}: one line per fact, and the "
                                      "reasons (WHY), table columns and formatting in the lesson module")


def test_the_plumbing_count_does_not_depend_on_layout(tmp_path):
    src = tmp_path / "x.py"
    for text in ("# prose\nx = 1\npinlab.claims({'a': x}, why='b')\n\nprint(x)\n",
                 "# prose\nx = 1\npinlab.claims(\n    {'a': x},\n    why='b',\n)\n\nprint(x)\n"):
        src.write_text(text)
        assert plumbing_share(src) == 1 / 4
    src.write_text(f"# prose\nx = 1\npinlab.claim(\n    '{'a' * 120}',\n    x,\n)\nprint(x)\n")
    assert plumbing_share(src) == 2 / 5  # a claim of over 120 columns counts two lines


def test_a_formatters_pass_keeps_every_lessons_plumbing_share(tmp_path):
    """ruff at another width, and exploding every call, changes the lines, not the share."""
    import shutil
    import subprocess

    copy = tmp_path / "src"
    shutil.copytree(ROOT / "notebooks" / "src", copy)
    done = subprocess.run([sys.executable, "-m", "ruff", "format", "-q", "--line-length", "60", str(copy)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    for path in sorted((ROOT / "notebooks" / "src").glob("*.py")):
        assert plumbing_share(copy / path.name) == pytest.approx(plumbing_share(path), abs=0.002), path.name


def _code_lines(cells):
    for k, cell in enumerate(cells):
        if cell["cell_type"] == "code":
            src = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
            for line in src.splitlines():
                yield k, line


def test_notebook_code_fits_88_columns_and_is_ruff_formatted():
    """Issue 49: pages that read on a phone. Every code line of a lesson, a solution and an exercise (comments
    included, Markdown not) is at most 88 columns, and the sources are as `make format` (ruff format) leaves
    them: split a long string into joined parts, and put a long comment on the lines above."""
    import subprocess

    import nbtools

    long = []
    for path in _one("notebooks/src/*.py") + _one("solutions/src/*.py"):
        cells = nbtools.parse_percent(path.read_text(encoding="utf-8"))
        long += [f"{path.relative_to(ROOT)} cell {k}: {len(ln)} columns: {ln.strip()[:60]}"
                 for k, ln in _code_lines(cells) if len(ln) > 88]
    for path in _one("exercises/*.ipynb"):
        long += [f"{path.relative_to(ROOT)} cell {k}: {len(ln)} columns: {ln.strip()[:60]}"
                 for k, ln in _code_lines(json.loads(path.read_text(encoding="utf-8"))["cells"]) if len(ln) > 88]
    assert not long, "\n".join(long[:20])
    done = subprocess.run([sys.executable, "-m", "ruff", "format", "--check", "notebooks/src", "solutions/src"],
                          cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, ("not as ruff formats them: run `make format` (then `make notebooks exercises`)\n"
                                  + done.stdout[-2000:] + done.stderr[-1000:])


def test_tools_and_tests_name_only_defined_names():
    """A name used but never defined fails here, not on the GPU: stop 57's device call lost its quiet pass's
    report to ``NameError: name 'root' is not defined`` in tools/gpu_suite.py, a path that only runs there.
    ruff's F821 over tools/, tests/ and the pytest plugin (lib/pinlab's lesson modules are left out: ruff 0.17
    flags names that lambdas and closures there take from their function)."""
    import subprocess

    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--select", "F821", "--output-format", "concise",
                           "tools", "tests", "conftest.py", "lib/pinlab_pytest.py"],
                          cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, "names used but never defined:\n" + done.stdout[-2000:] + done.stderr[-1000:]


def test_no_ok_line_and_checkers_return_nothing():
    """Issue 31: no ``ok = ...`` line swallows a return value in a lesson or solution source, and every lesson
    checker returns None (its ``.verdict`` returns the bool), so a checker ending a cell shows no ``Out: True``."""
    import importlib

    pattern = re.compile(r"^\s*ok\s*=", re.M)
    found = [f"{p.relative_to(ROOT).as_posix()}:{text[:m.start()].count(chr(10)) + 1}"
             for d in ("notebooks/src", "solutions/src") for p in sorted((ROOT / d).glob("*.py"))
             for text in [p.read_text(encoding="utf-8")] for m in pattern.finditer(text)]
    assert not found, f"`ok =` lines (checkers and claims return None; use check_x.verdict(...) for a bool): {found}"
    unwrapped = []
    for path in _one("lib/pinlab/checks/l*.py"):
        mod = importlib.import_module(f"pinlab.checks.{path.stem}")
        unwrapped += [f"{path.stem}.{n}" for n in dir(mod) if n.startswith("check_") and callable(getattr(mod, n))
                      and getattr(getattr(mod, n), "__module__", "") == mod.__name__
                      and not callable(getattr(getattr(mod, n), "verdict", None))]
    assert not unwrapped, f"lesson checkers not wrapped by pinlab.checks.checker (they would show Out: True): {unwrapped}"


def test_no_committed_output_is_a_bare_bool():
    """Issue 31: no stray ``Out: True``/``Out: False`` in a committed notebook (a value a cell ended on by accident)."""
    found = []
    for d in ("notebooks", "solutions", "exercises"):
        for p in sorted((ROOT / d).glob("*.ipynb")):
            nb = json.loads(p.read_text(encoding="utf-8"))
            for i, cell in enumerate(nb["cells"]):
                for out in cell.get("outputs", []):
                    text = "".join(out.get("data", {}).get("text/plain", [])) if out.get("output_type") == "execute_result" else ""
                    if text.strip() in ("True", "False"):
                        found.append(f"{p.relative_to(ROOT).as_posix()} cell {i}")
    assert not found, f"a cell shows a bare Out: True/False: {found}"


def test_no_cell_ends_on_a_value():
    """Issue 31: a code cell of a lesson or solution never ends on a call that returns a value (``observe``
    returns whether it held): the cell would show it as ``Out: True``, a stray line nbval then compares."""
    import ast

    sys.path.insert(0, str(ROOT / "tools"))
    import nbtools

    quiet = {"claim", "claims", "show", "table", "print", "header", "report", "display", "plot"}
    found = []
    for d in ("notebooks/src", "solutions/src"):
        for p in sorted((ROOT / d).glob("*.py")):
            for i, cell in enumerate(nbtools.parse_percent(p.read_text(encoding="utf-8"))):
                src = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
                if cell.get("cell_type") != "code" or not src.strip():
                    continue
                last = ast.parse(src).body[-1]
                if isinstance(last, ast.Expr) and isinstance(last.value, ast.Call):
                    f = last.value.func
                    name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                    if name == "observe":
                        found.append(f"{p.relative_to(ROOT).as_posix()} cell {i}")
    assert not found, f"cells that end on pinlab.observe(...) (it returns a bool: Out: True): {found}"


#: a module over this many lines says why at its top (CONTRIBUTING.md), and how big it is
SIZE_NOTE_LINES = 500
_SIZE_NOTE = re.compile(r"(?i)\b(about|over|around)\s+([\d,]+)\s+lines")


def test_a_module_over_500_lines_says_why_and_its_size_is_true():
    """Issue 31: every module of lib/pinlab over 500 lines says why at the top of its docstring, with its size
    ("about N lines" within a quarter of the truth, or "over N lines" with N at most its length): a stale note
    (l07's "about 700" on 1,200 lines) fails."""
    import ast

    problems = []
    for p in sorted((ROOT / "lib" / "pinlab").rglob("*.py")):
        text = p.read_text(encoding="utf-8")
        n = len(text.splitlines())
        if n <= SIZE_NOTE_LINES:
            continue
        rel = p.relative_to(ROOT).as_posix()
        doc = ast.get_docstring(ast.parse(text)) or ""
        notes = _SIZE_NOTE.findall(doc)
        if not notes:
            problems.append(f"{rel} ({n} lines): its docstring says nothing like 'Why about {round(n, -1)} lines: ...'")
            continue
        word, num = notes[0][0].lower(), int(notes[0][1].replace(",", ""))
        if (word == "over" and num > n) or (word != "over" and not 0.75 * n <= num <= 1.25 * n):
            problems.append(f"{rel} ({n} lines): its docstring says '{word} {num} lines'")
    assert not problems, "modules over 500 lines without a true note of why:\n" + "\n".join(problems)


#: issue 46's measure of the course's size at the review (ed88a29): the words of the lessons' and solutions'
#: sources, counted as `wc -w` counts them (whitespace-separated), 63,969 + 8,115; its target is 15% fewer
WORDS_AT_REVIEW = 72_084
LEANER_BY = 0.15


def _words(paths) -> int:
    return sum(len(p.read_text(encoding="utf-8").split()) for p in paths)


def test_the_lessons_of_the_review_are_at_least_15_percent_leaner():
    """Lessons 00-09 (notebooks/src/0*.py and solutions/src/0*.py: the lessons the review measured; a new lesson
    10 is not in this sum) hold at least 15% fewer words than at the review, with no claim lost (the claims are
    the evidence tests'). Stop 59: 52,531 + 7,932 = 60,463 words, 16.1% fewer."""
    paths = _one("notebooks/src/0*.py") + _one("solutions/src/0*.py")
    words = _words(paths)
    limit = int(WORDS_AT_REVIEW * (1 - LEANER_BY))
    assert words <= limit, (f"lessons 00-09 hold {words:,} words (notebooks/src and solutions/src, as `wc -w` counts "
                            f"them), over issue 46's budget of {limit:,} (15% under the review's {WORDS_AT_REVIEW:,}): "
                            f"cut repeated explanations before adding more, or say in the issue why it grows")
