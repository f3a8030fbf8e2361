"""Lesson 09 on the oldest and the newest transformers it supports (``l09.SUPPORTED_TRANSFORMERS``, the range
pyproject.toml's lab extra asks for). The venv holds one release of the range (a fresh `make setup` installs the
newest; a venv made before keeps its own); the slow test installs the oldest and the newest that the venv lacks,
each into a folder of its own put first on PYTHONPATH (as the GPU suite's newer folder is), and runs the lesson's
CPU tests and its three notebooks under strict nbval with it. So CI, whose fresh venv holds the newest, tests
the oldest too, and a developer's venv with the oldest tests the newest."""
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from pinlab.lessons import l09_real_code as l09

ROOT = Path(__file__).resolve().parents[1]
transformers = pytest.importorskip("transformers")

#: the oldest release (the GPU image's) with the huggingface_hub it has: 5.17 asks hub < 2.0, and a venv with
#: the newest transformers holds hub 2.x (its other requirements, httpx among them, the venv has)
OLDEST = ("transformers==5.17.0", "huggingface-hub==1.33.0")
NEWER_LOCK = ROOT / "tools" / "gpu-wheels-newer.txt"
LESSON = ["tests/test_l09.py", "tests/test_checks_l09.py", "--nbval", "--nbval-current-env",
          "--nbval-sanitize-with", "tests/nbval_sanitize.cfg", "notebooks/09_real_code.ipynb",
          "solutions/09_real_code.ipynb", "exercises/09_real_code.ipynb"]


def _newest() -> list[str]:
    """The newest release and what it needs beside a 5.17 environment: tools/gpu-wheels-newer.txt's pins."""
    return [ln.split()[0] for ln in NEWER_LOCK.read_text().splitlines() if ln.strip() and not ln.startswith("#")]


def _version(pins) -> str:
    return next(p.split("==", 1)[1] for p in pins if p.startswith("transformers=="))


def test_the_range_is_said_once_and_its_ends_are_the_releases_tested():
    lab = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["lab"]
    (spec,) = [d for d in lab if d.startswith("transformers")]
    assert spec == "transformers" + l09.SUPPORTED_TRANSFORMERS, "pyproject.toml and l09.SUPPORTED_TRANSFORMERS"
    assert f'"transformers{l09.SUPPORTED_TRANSFORMERS}"' in (ROOT / "environment.yml").read_text()
    supported = SpecifierSet(l09.SUPPORTED_TRANSFORMERS)
    low = re.search(r">=([0-9.]+)", l09.SUPPORTED_TRANSFORMERS).group(1)
    high = Version(re.search(r"<([0-9.]+)", l09.SUPPORTED_TRANSFORMERS).group(1))
    oldest, newest = Version(_version(OLDEST)), Version(_version(_newest()))
    assert oldest == Version(low) and oldest in supported, "the oldest tested is the range's lower end"
    assert newest in supported and (newest.major, newest.minor + 1) == (high.major, high.minor), (
        f"the newest tested ({newest}, tools/gpu-wheels-newer.txt) is the last minor release below {high}")


def _install(pins, folder: Path):
    hashed = pins is not OLDEST
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
           "--only-binary=:all:", "--target", str(folder)]
    cmd += ["--require-hashes", "-r", str(NEWER_LOCK)] if hashed else list(pins)
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        why = f"pip could not install {' '.join(pins)} into a folder of its own: {res.stderr.strip()[-800:]}"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why + " (this test needs pip's index; CI fails here instead)")


@pytest.mark.slow
def test_lesson_09_passes_on_the_oldest_and_the_newest_supported_release(tmp_path):
    installed = transformers.__version__
    assert installed in SpecifierSet(l09.SUPPORTED_TRANSFORMERS), (
        f"the venv holds transformers {installed}, outside the range the lesson supports "
        f"({l09.SUPPORTED_TRANSFORMERS}): make setup installs one inside it")
    others = [pins for pins in (OLDEST, _newest()) if _version(pins) != installed]
    for pins in others:
        folder = tmp_path / _version(pins)
        _install(pins, folder)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(folder), str(ROOT / "lib")]))
        seen = subprocess.run([sys.executable, "-c", "import transformers; print(transformers.__version__)"],
                              env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert seen.stdout.strip() == _version(pins), seen.stdout + seen.stderr
        res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *LESSON], env=env,
                             capture_output=True, text=True, timeout=1200, cwd=ROOT)
        assert res.returncode == 0, (f"lesson 09 with transformers {_version(pins)} (installed beside the venv's "
                                     f"{installed}):\n{res.stdout[-3000:]}{res.stderr[-1000:]}")


def test_without_transformers_the_lesson_names_the_supported_range(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    with pytest.raises(ImportError, match=re.escape(f"pip install 'transformers{l09.SUPPORTED_TRANSFORMERS}'")):
        l09.require_transformers("lesson 09")
