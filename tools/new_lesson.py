"""Lay out a new lesson in every room the course's layout rule asks for (CONTRIBUTING.md, "Layout: one room per
lesson"), so that it passes ``tests/test_conventions.py`` before its first real line is written.

    python3 tools/new_lesson.py 10 kv_offload "Offloading the KV cache"
    python3 tools/new_lesson.py 10 kv_offload "Offloading the KV cache" --dry-run   # list what it would write

It writes, for lesson ``NN`` with file stem ``NN_<name>``:

- ``notebooks/src/NN_<name>.py``: the lesson (title, "What you will learn", its install cell, the header, one
  measured example that calls the lesson module, "What to remember");
- ``lib/pinlab/lessons/lNN_<name>.py``: the lesson module, with one small function that checks its argument;
- ``lib/pinlab/checks/lNN.py``: the exercise checker of that function (``run_cases``, with a hint);
- ``solutions/src/NN_<name>.py``: the master solution (``### BEGIN SOLUTION`` / ``### END SOLUTION``);
- ``tests/test_lNN.py`` and ``tests/test_checks_lNN.py``: the lesson's CPU tests, and the checker's (it accepts
  the master solution and rejects a planted wrong answer);
- its syllabus row in ``lib/pinlab/syllabus.py`` (``LESSONS``), with ``minutes`` to be estimated.

It refuses a number or a name already taken, or a number that is not two ASCII digits (not '٠٣', '０３' or
'³'), and writes nothing then. It writes every file or none (``write_all``): an error midway (a full disk, a
folder it may not write) leaves nothing behind, so the same command can simply be run again. Afterwards: replace the example with the
lesson, give it a place in a ``WORKSHOP`` part of the syllabus, run ``python3 tools/syllabus.py --write``
(minutes, README and workshop copies) and ``make notebooks exercises`` (the notebooks, their install cells, the
exercise), then the GPU suite for its evidence (CONTRIBUTING.md: Running the GPU suite)."""
from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rooms(number: str, name: str) -> dict[str, str]:
    """The files of lesson ``number`` ``name``: path (relative to the checkout) -> text."""
    stem = f"{number}_{name}"
    n = number
    mod = f"l{n}_{name}"
    return {
        f"notebooks/src/{stem}.py": NOTEBOOK.format(n=n, stem=stem, mod=mod),
        f"lib/pinlab/lessons/{mod}.py": LESSON.format(n=n, stem=stem),
        f"lib/pinlab/checks/l{n}.py": CHECKS.format(n=n, mod=mod),
        f"solutions/src/{stem}.py": SOLUTION.format(n=n, stem=stem),
        f"tests/test_l{n}.py": TEST_LESSON.format(n=n, mod=mod),
        f"tests/test_checks_l{n}.py": TEST_CHECKS.format(n=n, stem=stem),
    }


def syllabus_row(number: str, name: str, title: str) -> str:
    return (f'    Lesson("{number}", "{number}_{name}", {title!r},\n'
            f'           goal="(one line: what a learner can do afterwards)",\n'
            f'           covers="(what it goes through)",\n'
            f'           gpu="(what needs a GPU to measure live)",\n'
            f'           minutes=10, exercise_minutes=5),\n')


def add_row(syllabus: str, row: str) -> str:
    """``syllabus`` (lib/pinlab/syllabus.py's text) with ``row`` added as the last entry of ``LESSONS``."""
    start = syllabus.find("LESSONS: tuple[Lesson, ...] = (")
    if start < 0:
        raise ValueError("lib/pinlab/syllabus.py has no `LESSONS: tuple[Lesson, ...] = (`: add the row by hand")
    end = syllabus.find("\n)\n", start)
    if end < 0:
        raise ValueError("lib/pinlab/syllabus.py: LESSONS does not end with a line `)`: add the row by hand")
    return syllabus[:end + 1] + row + syllabus[end + 1:]


def _digit_note(number: str) -> str:
    """What in ``number`` only looks like a digit (Arabic-Indic, full-width, superscript...), for the error."""
    odd = [f"{ch!r} is {unicodedata.name(ch, 'a non-ASCII digit').lower()}" for ch in number
           if not ch.isascii() and unicodedata.numeric(ch, None) is not None]
    return f" ({'; '.join(odd)}): type the number with the digits 0-9" if odd else ""


def plan(number: str, name: str, title: str, root: Path = ROOT) -> dict[Path, str]:
    """Every file to write (path -> text), the syllabus included; ValueError naming what is taken or wrong."""
    if not re.fullmatch(r"[0-9]{2}", number):  # not \d, which takes '٠٣' and '０３' too
        raise ValueError(f"number must be two ASCII digits 0-9, such as 10, got {number!r}{_digit_note(number)}")
    if not re.fullmatch(r"[a-z][a-z0-9]*(?:_[a-z0-9]+)*", name):  # not "kv__offload": no empty word
        raise ValueError(f"name must be lower-case words joined by '_', such as kv_offload, got {name!r}")
    if not title.strip():
        raise ValueError("title must say what the lesson is about, such as \"Offloading the KV cache\"")
    taken = sorted(p.relative_to(root).as_posix() for d in ("notebooks/src", "solutions/src")
                   for p in (root / d).glob(f"{number}*.py"))
    taken += sorted(p.relative_to(root).as_posix() for p in (root / "lib/pinlab/lessons").glob(f"l{number}_*.py"))
    taken += [f"lib/pinlab/checks/l{number}.py"] if (root / f"lib/pinlab/checks/l{number}.py").exists() else []
    if taken:
        raise ValueError(f"lesson {number} exists already ({', '.join(taken)}): pick the next free number")
    syllabus = (root / "lib/pinlab/syllabus.py").read_text(encoding="utf-8")
    if re.search(rf'Lesson\("{number}"', syllabus):
        raise ValueError(f"lib/pinlab/syllabus.py has a row for lesson {number} already: pick the next free number")
    out = {root / rel: text for rel, text in rooms(number, name).items()}
    out[root / "lib/pinlab/syllabus.py"] = add_row(syllabus, syllabus_row(number, name, title.strip()))
    return out


def write_all(files: dict[Path, str]) -> None:
    """Write every file of ``files`` (path -> text) or none: each text goes to a temporary file beside its path
    first (``.NAME.new_lesson-PID.tmp``); once all are written they are renamed into place (``os.replace``),
    new files first and a file that exists (the syllabus) last. On an OSError at any point the temporary files,
    the files already renamed into place (a replaced file gets its old text back) and the folders made for them
    are removed, and the error is raised again: a second run finds nothing of the first."""
    made_dirs: list[Path] = []
    temps: dict[Path, Path] = {}
    placed: list[Path] = []
    old: dict[Path, bytes] = {}
    try:
        for path in files:
            missing = []
            d = path.parent
            while not d.exists():
                missing.append(d)
                d = d.parent
            for d in reversed(missing):
                d.mkdir()
                made_dirs.append(d)
        old = {path: path.read_bytes() for path in files if path.exists()}
        for path, text in files.items():
            tmp = path.with_name(f".{path.name}.new_lesson-{os.getpid()}.tmp")
            temps[path] = tmp
            tmp.write_text(text, encoding="utf-8")
            if path in old:
                shutil.copymode(path, tmp)
        for path in sorted(files, key=lambda p: p in old):  # the new files first, then the one replaced
            os.replace(temps[path], path)
            placed.append(path)
    except BaseException:
        for tmp in temps.values():
            tmp.unlink(missing_ok=True)
        for path in reversed(placed):
            if path in old:
                path.write_bytes(old[path])
            else:
                path.unlink(missing_ok=True)
        for d in reversed(made_dirs):
            try:
                d.rmdir()
            except OSError:
                pass
        raise


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("number", help="two digits, the next free lesson number (e.g. 10)")
    ap.add_argument("name", help="the file stem's topic, lower case with '_' (e.g. kv_offload)")
    ap.add_argument("title", help="the lesson's title (e.g. \"Offloading the KV cache\")")
    ap.add_argument("--dry-run", action="store_true", help="list the files it would write, write none")
    ap.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)  # tests: a copy of the course
    a = ap.parse_args(argv)
    try:
        files = plan(a.number, a.name, a.title, a.root)
    except ValueError as exc:
        print(f"new_lesson: {exc}", file=sys.stderr)
        return 2
    rels = [path.relative_to(a.root).as_posix() for path in files]
    if a.dry_run:
        for rel in rels:
            print(f"would write {rel}")
        return 0
    try:
        write_all(files)
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename else ""
        print(f"new_lesson: could not write lesson {a.number}: {exc.strerror or exc}{where}. Nothing was written "
              "(every file of it removed, the syllabus as it was); fix that and run the same command again",
              file=sys.stderr)
        return 1
    for rel in rels:
        print(f"wrote {rel}")
    print("next: write the lesson; give it a place in a WORKSHOP part of lib/pinlab/syllabus.py; run "
          "`python3 tools/syllabus.py --write` and `make notebooks exercises`; "
          "`python3 -m pytest tests/test_conventions.py` checks the layout")
    return 0


NOTEBOOK = '''# %% [markdown]
# # {n} · (the lesson's title)
#
# **What you will learn**
# - (one line per point, each measured below)

# %% tags=["nbval-ignore-output"]
import torch

import pinlab
from pinlab.lessons import {mod} as l{n}

pinlab.header("{stem}")

# %% [markdown]
# ## An example (replace it with the lesson)

# %%
t = torch.zeros(1024, dtype=torch.float32)
pinlab.claim(
    "bytes a 1024-element float32 tensor holds",
    l{n}.nbytes(t),
    expect=4096,
    why=l{n}.WHY.float32,
)

# %% [markdown]
# ## What to remember
# - (one line per point)
'''

LESSON = '''"""Lesson {n}'s experiments and plots ({stem}): nothing else (CONTRIBUTING.md, the layout rule)."""
from __future__ import annotations

import torch

from ..claims import Reasons

#: why a fact of this lesson may not hold on some machine: the notebook names one (``why=l{n}.WHY.float32``)
WHY = Reasons(float32="float32 is 4 bytes per element on every machine: another count is a bug in the lesson")


def nbytes(t: torch.Tensor) -> int:
    """The bytes ``t``'s elements take (``numel() * element_size()``): an example to replace."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"t must be a torch.Tensor, got {{type(t).__name__}}")
    return t.numel() * t.element_size()
'''

CHECKS = '''"""Exercise checkers for lesson {n}: the reference answers are the lesson module's own. Each prints its
verdict and returns None in a notebook; ``check_x.verdict(...)`` returns it as a bool (the tests)."""
from __future__ import annotations

import torch

from ..lessons.{mod} import nbytes
from . import checker, run_cases, same_int


@checker
def check_nbytes(fn) -> bool:
    """``nbytes(t)``: the bytes a tensor's elements take."""
    cases = [(torch.zeros(0),), (torch.zeros(3, dtype=torch.float16),), (torch.zeros(2, 5, dtype=torch.int64),),
             (torch.zeros(7, dtype=torch.uint8),)]
    return run_cases(fn, "nbytes", cases, nbytes, compare=same_int, signature="(t) -> int (bytes)",
                     hint="numel() counts the elements; element_size() is the bytes of one.")
'''

SOLUTION = '''# %% [markdown]
# # Exercise · {n} (the lesson's title)
#
# **What you will practise**: (one line)

# %%
import torch

from pinlab.checks import l{n} as checks{n}

# %% [markdown]
# ## 1. The bytes of a tensor


# %%
def nbytes(t):
    ### BEGIN SOLUTION
    return t.numel() * t.element_size()
    ### END SOLUTION


checks{n}.check_nbytes(nbytes)
'''

TEST_LESSON = '''"""Lesson {n}'s library ({mod}) on a CPU: the reference answers and the argument checks."""
import pytest
import torch

from pinlab.lessons import {mod} as l{n}


def test_nbytes_counts_every_element():
    assert l{n}.nbytes(torch.zeros(2, 3, dtype=torch.float64)) == 48
    assert l{n}.nbytes(torch.zeros(0)) == 0


def test_nbytes_names_a_bad_argument():
    with pytest.raises(TypeError, match="t must be a torch.Tensor"):
        l{n}.nbytes([1, 2])
'''

TEST_CHECKS = '''"""Lesson {n}'s exercise checker accepts the master solution and rejects a planted wrong answer."""
import pytest

from nbtools import solution_namespace
from pinlab.checks import l{n} as checks

STEM = "{stem}"


@pytest.fixture(scope="module")
def sol():
    return solution_namespace(STEM)


def test_nbytes_accepts_solution(sol, capsys):
    assert checks.check_nbytes.verdict(sol["nbytes"]) is True
    assert "✅" in capsys.readouterr().out


def test_nbytes_rejects_the_element_count(capsys):
    assert checks.check_nbytes.verdict(lambda t: t.numel()) is False
    assert "❌" in capsys.readouterr().out
'''


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
