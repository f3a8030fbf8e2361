"""tools/new_lesson.py lays out a lesson that passes the conventions test, and refuses what is taken or wrong."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import nbtools
import new_lesson

# the tests on a copy of the course are marked slow (make check leaves them out; make test and CI run them); the
# refusals and the all-or-nothing writing run on a small made-up course, fast

ROOT = nbtools.ROOT


def _copy(dest: Path) -> Path:
    """What the conventions test reads: lib/, tools/, the notebook and solution sources and the lesson tests."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for rel in ("lib", "tools", "notebooks/src", "solutions/src"):
        shutil.copytree(ROOT / rel, dest / rel, ignore=ignore)
    (dest / "tests").mkdir()
    for p in [ROOT / "tests" / "test_conventions.py", *(ROOT / "tests").glob("test_checks_l*.py"),
              *(ROOT / "tests").glob("test_l0*.py")]:
        shutil.copy(p, dest / "tests" / p.name)
    return dest


@pytest.mark.slow
def test_a_new_lesson_passes_the_conventions_test_and_its_own_tests(tmp_path):
    root = _copy(tmp_path / "course")
    assert new_lesson.main(["10", "kv_offload", "Offloading the KV cache", "--root", str(root)]) == 0
    for rel in ("notebooks/src/10_kv_offload.py", "lib/pinlab/lessons/l10_kv_offload.py", "lib/pinlab/checks/l10.py",
                "solutions/src/10_kv_offload.py", "tests/test_l10.py", "tests/test_checks_l10.py"):
        assert (root / rel).is_file(), rel
    assert 'Lesson("10", "10_kv_offload", \'Offloading the KV cache\'' in (root / "lib/pinlab/syllabus.py").read_text()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root / "lib"), str(root / "tools")]))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_conventions.py",
                           "tests/test_l10.py", "tests/test_checks_l10.py"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    # the conventions test can fail: a lesson without its checker test is named
    (root / "tests" / "test_checks_l10.py").unlink()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_conventions.py"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "lesson 10 lacks tests/test_checks_l10.py" in done.stdout


@pytest.fixture(scope="module")
def untouched(tmp_path_factory):
    """One copy for the refusals: each must leave it as it was."""
    return _copy(tmp_path_factory.mktemp("refusals") / "course")


@pytest.mark.slow
@pytest.mark.parametrize("argv, message", [
    (["09", "again", "Taken"], "lesson 09 exists already"),
    (["7", "x", "Seven"], "number must be two ASCII digits"),
    (["10", "Bad-Name", "T"], "name must be lower-case words"),
    (["10", "fine", "  "], "title must say"),
])
def test_taken_or_wrong_arguments_are_refused_and_nothing_is_written(untouched, argv, message, capsys):
    root = untouched
    before = sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file())
    assert new_lesson.main([*argv, "--root", str(root)]) == 2
    assert message in capsys.readouterr().err
    assert sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file()) == before


# ---------------------------------------------------------------------------------------------
# issue 48: Unicode digits refused; a lesson written whole or not at all

SYLLABUS = '''"""A made-up syllabus."""
LESSONS: tuple[Lesson, ...] = (
    Lesson("01", "01_first", 'First', goal="g", covers="c", gpu="-", minutes=10, exercise_minutes=5),
)
'''


def _small_course(tmp_path: Path) -> Path:
    """What new_lesson.plan reads, and no more: the syllabus, a lesson 01; no lib/pinlab/checks/ nor tests/ folder
    (the write makes them, and must remove them again when it fails)."""
    root = tmp_path / "course"
    for d in ("notebooks/src", "solutions/src", "lib/pinlab/lessons"):
        (root / d).mkdir(parents=True)
    (root / "notebooks/src/01_first.py").write_text("# %% [markdown]\n# # 01 · First\n")
    (root / "lib/pinlab/syllabus.py").write_text(SYLLABUS)
    return root


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every file (its bytes) and folder (None) under root, hidden ones included."""
    return {p.relative_to(root).as_posix(): (p.read_bytes() if p.is_file() else None) for p in root.rglob("*")}


@pytest.mark.parametrize("number", ["٠٣", "０３", "³", "1²", "0٣", "١٠"])
def test_unicode_digits_are_refused_as_a_lesson_number(tmp_path, capsys, number):
    """Planted: a lesson number of digits that are not 0-9 (Arabic-Indic, full-width, superscript), which
    `\\d` and str.isdigit() take. Refused with the character named, nothing written."""
    root = _small_course(tmp_path)
    before = _tree(root)
    assert new_lesson.main([number, "kv_offload", "Offloading", "--root", str(root)]) == 2
    err = capsys.readouterr().err
    assert f"number must be two ASCII digits 0-9, such as 10, got {number!r}" in err, err
    assert "type the number with the digits 0-9" in err and "digit" in err.split("got", 1)[1], err
    assert _tree(root) == before


def _fail_after(monkeypatch, target, name: str, n: int) -> list:
    """Make ``target.name`` raise OSError (no space left) on its call after the first ``n``."""
    real, calls = getattr(target, name), []

    def flaky(*args, **kwargs):
        calls.append(args)
        if len(calls) > n:
            raise OSError(28, "No space left on device", str(args[0]))
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, flaky)
    return calls


@pytest.mark.parametrize("n", [1, 4])
def test_an_oserror_after_n_files_written_leaves_nothing_and_the_rerun_works(tmp_path, monkeypatch, capsys, n):
    """Planted: an OSError (a full disk) on writing the file after the first ``n`` (of 7: six new files and the
    syllabus). Nothing of the lesson is left: no file, no temporary file, no folder it made, the syllabus as it
    was; the error names what happened; the same command run again writes the lesson (not "exists already")."""
    root = _small_course(tmp_path)
    before = _tree(root)
    argv = ["10", "kv_offload", "Offloading the KV cache", "--root", str(root)]
    with monkeypatch.context() as m:
        calls = _fail_after(m, Path, "write_text", n)
        assert new_lesson.main(argv) == 1
    assert len(calls) == n + 1
    err = capsys.readouterr().err
    assert "could not write lesson 10: No space left on device" in err and "run the same command again" in err, err
    assert _tree(root) == before, sorted(set(_tree(root)) ^ set(before))
    assert new_lesson.main(argv) == 0, capsys.readouterr().err
    assert "Lesson(\"10\", \"10_kv_offload\"" in (root / "lib/pinlab/syllabus.py").read_text()
    assert (root / "lib/pinlab/checks/l10.py").is_file() and (root / "tests/test_checks_l10.py").is_file()
    assert not [p for p in root.rglob("*.tmp")]


@pytest.mark.parametrize("n", [1, 4, 6])
def test_an_oserror_after_n_files_moved_into_place_is_undone(tmp_path, monkeypatch, capsys, n):
    """Planted: the OSError while moving the written files into place, after the first ``n`` renames (6: every
    new file is in place, the syllabus is the one that fails). The files already in place are removed again,
    the syllabus keeps its text, and the rerun writes the lesson."""
    root = _small_course(tmp_path)
    before = _tree(root)
    argv = ["10", "kv_offload", "Offloading the KV cache", "--root", str(root)]
    with monkeypatch.context() as m:
        calls = _fail_after(m, new_lesson.os, "replace", n)
        assert new_lesson.main(argv) == 1
    assert len(calls) == n + 1
    assert "Nothing was written" in capsys.readouterr().err
    assert _tree(root) == before, sorted(set(_tree(root)) ^ set(before))
    assert new_lesson.main(argv) == 0
    assert (root / "notebooks/src/10_kv_offload.py").is_file()


def test_the_written_files_have_the_usual_permissions(tmp_path):
    """The files are renamed from temporary ones: they get the mode any new file gets here (the umask), and the
    syllabus keeps its own."""
    root = _small_course(tmp_path)
    (root / "lib/pinlab/syllabus.py").chmod(0o640)
    probe = tmp_path / "probe"
    probe.write_text("x")
    assert new_lesson.main(["10", "kv_offload", "Offloading", "--root", str(root)]) == 0
    assert (root / "tests/test_l10.py").stat().st_mode & 0o777 == probe.stat().st_mode & 0o777
    assert (root / "lib/pinlab/syllabus.py").stat().st_mode & 0o777 == 0o640
