"""The course's layout rule (CONTRIBUTING.md, "Adding a lesson"), checked for every lesson: a notebook source, a
syllabus row, and where the lesson has an exercise, its lesson module, checker module, master solution, two test
files, and a checker test that loads the master solution (issue 31: "a conventions test").

A lesson found without one of its rooms fails here with the room's path, so that a new lesson cannot land half
laid out."""
import re
from pathlib import Path

import pytest

from pinlab import syllabus

ROOT = Path(__file__).resolve().parents[1]
LESSONS = {les.number: les for les in syllabus.LESSONS}
#: lessons without an exercise of their own: the start page, and 02b, which shares lesson 02's module
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
