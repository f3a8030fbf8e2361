"""tools/new_lesson.py lays out a lesson that passes the conventions test, and refuses what is taken or wrong."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import nbtools
import new_lesson

pytestmark = pytest.mark.slow  # make check leaves this module out; make test and CI run it

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


@pytest.mark.parametrize("argv, message", [
    (["09", "again", "Taken"], "lesson 09 exists already"),
    (["7", "x", "Seven"], "number must be two digits"),
    (["10", "Bad-Name", "T"], "name must be lower-case words"),
    (["10", "fine", "  "], "title must say"),
])
def test_taken_or_wrong_arguments_are_refused_and_nothing_is_written(untouched, argv, message, capsys):
    root = untouched
    before = sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file())
    assert new_lesson.main([*argv, "--root", str(root)]) == 2
    assert message in capsys.readouterr().err
    assert sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file()) == before
