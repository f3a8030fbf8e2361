"""One syllabus (lib/pinlab/syllabus.py), and every copy of it generated from it (tools/syllabus.py)."""
from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import syllabus as tool  # noqa: E402

SYL = tool.load()


def test_every_lesson_notebook_has_one_row_in_order():
    stems = [r.stem for r in SYL.LESSONS]
    assert sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb")) == sorted(stems)
    assert [r.number for r in SYL.LESSONS] == sorted(r.number for r in SYL.LESSONS), "rows in lesson order"
    assert len({r.number for r in SYL.LESSONS}) == len(SYL.LESSONS)
    for r in SYL.LESSONS:
        assert r.stem.startswith(r.number + "_"), r
        assert (r.exercise_minutes > 0) == (ROOT / "solutions" / "src" / f"{r.stem}.py").exists(), r
        assert r.title and r.goal and "\n" not in r.goal and r.gpu and r.minutes > 0, r


def test_readme_and_workshop_are_generated_from_it_and_minutes_are_estimated():
    found = tool.problems()
    assert not found, "\n".join(found) + "\nrun: python3 tools/syllabus.py --write"


def test_every_lesson_and_exercise_is_in_the_workshop_once():
    items = [i for _name, part in SYL.WORKSHOP for i in part if isinstance(i, str)]
    want = [r.number for r in SYL.LESSONS] + [f"ex {r.number}" for r in SYL.LESSONS if r.exercise_minutes]
    assert sorted(items) == sorted(want)
    block = SYL.workshop_block()
    for r in SYL.LESSONS:
        assert f"{r.number} · {r.title} ({r.minutes} min)" in block


def test_notebook_00s_table_links_every_lesson_from_inside_notebooks():
    md = SYL.markdown()
    for r in SYL.LESSONS:
        assert f"[{r.number}]({r.stem}.ipynb)" in md and (ROOT / "notebooks" / f"{r.stem}.ipynb").exists()
    assert "[01](notebooks/01_pinned_memory.ipynb)" in SYL.markdown(base="notebooks/")
    assert "[01]" not in SYL.markdown(links=False)


def test_the_installed_module_is_the_same_table():
    pytest.importorskip("torch")
    import pinlab.syllabus as installed

    assert installed.__file__ == str(ROOT / "lib" / "pinlab" / "syllabus.py") or installed.LESSONS == SYL.LESSONS
    assert installed.markdown() == SYL.markdown()
    with pytest.raises(ValueError, match="no lesson '99'"):
        installed.lesson("99")


def test_a_new_lesson_row_flows_into_every_copy(tmp_path):
    """What adding a lesson takes (as 02b was added): one row, one agenda entry, --write."""
    for rel in ("lib/pinlab/syllabus.py", "README.md", "docs/workshop.md", "reports/gpu/latest.json"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / rel, tmp_path / rel)
    for folder in ("notebooks/src", "solutions/src"):
        shutil.copytree(ROOT / folder, tmp_path / folder)
    (tmp_path / "notebooks/src/06b_more_indices.py").write_text(
        "# %% [markdown]\n# # 06b · More indices\n#\n" + "# word\n" * 2000 + "# 🔮 **Predict.** x\n")
    src = tmp_path / "lib/pinlab/syllabus.py"
    text = src.read_text(encoding="utf-8")
    row = ('    Lesson("06b", "06b_more_indices", "More indices", goal="build more indices",\n'
           '           covers="more ids", gpu="yes (replayed without)", minutes=1, exercise_minutes=0),\n')
    text = text.replace('    Lesson("07", ', row + '    Lesson("07", ', 1)
    text = text.replace('"ex 06", ', '"ex 06", "06b", ', 1)
    src.write_text(text, encoding="utf-8")
    assert tool.problems(tmp_path), "a stale copy is noticed"
    assert tool.main(["--write", "--root", str(tmp_path)]) == 0
    assert tool.problems(tmp_path) == []
    syl = tool.load(tmp_path)
    assert syl.lesson("06b").minutes >= 10  # 2000 words: estimated, not the 1 typed in
    assert "[06b](notebooks/06b_more_indices.ipynb)" in (tmp_path / "README.md").read_text(encoding="utf-8")
    assert "06b · More indices" in (tmp_path / "docs/workshop.md").read_text(encoding="utf-8")
    tool.load()  # the real module again, for the other tests' sake


def test_write_minutes_touches_only_its_row():
    text = (ROOT / "lib/pinlab/syllabus.py").read_text(encoding="utf-8")
    new = tool.write_minutes(text, "03", 123, 45)
    assert re.search(r'Lesson\("03",.*?\bminutes=123, exercise_minutes=45', new, re.S)
    assert sum(a != b for a, b in zip(text.splitlines(), new.splitlines())) == 1


def test_notebook_00_shows_the_generated_syllabus():
    src = (ROOT / "notebooks/src/00_start_here.py").read_text(encoding="utf-8")
    assert "syllabus.markdown(" in src, "notebook 00 must show pinlab.syllabus.markdown(), not a typed table"
    assert not re.search(r"^# \| 0\d \|", src, re.M), "notebook 00 still has a typed table row"


def test_the_core_path_is_marked_and_shorter():
    """A core path: the lessons a shorter course keeps (start here, the four lessons the race and its fix need,
    the capstone that applies them); the others are deep dives. Every copy says which, with both totals."""
    core = [r.number for r in SYL.core_lessons()]
    assert core == [r.number for r in SYL.LESSONS if r.core] and core[0] == "00" and "07" in core, core
    assert {"01", "02", "03", "04"} <= set(core) and len(core) < len(SYL.LESSONS), core
    assert SYL.total_minutes(SYL.core_lessons()) < SYL.total_minutes()
    hours = lambda m: f"{m // 60} h {m % 60:02d}"  # noqa: E731
    sentence = SYL.totals_text()
    assert hours(SYL.total_minutes()) in sentence and hours(SYL.total_minutes(SYL.core_lessons())) in sentence
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for md in (SYL.markdown(), SYL.readme_block(), readme):
        assert sentence in md
        for r in SYL.LESSONS:
            row = next(line for line in md.splitlines() if line.startswith(f"| [{r.number}]("))
            assert row.rstrip().endswith("| core |" if r.core else "| deep dive |"), row[-40:]


def test_the_core_agenda_is_the_core_lessons_and_their_exercises():
    name, items = SYL.CORE_WORKSHOP
    got = [i for i in items if isinstance(i, str)]
    want = [n for r in SYL.core_lessons() for n in ([r.number] + ([f"ex {r.number}"] if r.exercise_minutes else []))]
    assert got == want, got
    block = (ROOT / "docs" / "workshop.md").read_text(encoding="utf-8")
    t = sum(i[1] if isinstance(i, tuple) else SYL.lesson(i[3:]).exercise_minutes if i.startswith("ex ")
            else SYL.lesson(i).minutes for i in items)
    assert f"### {name} (about {t // 60} h {t % 60:02d})" in block
