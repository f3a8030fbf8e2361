"""`make test` leaves nothing behind: nothing in the home folder, no temporary folder of a passed test.

A pytest run in a subprocess, with a fresh HOME and TMPDIR, runs a probe test that writes where the tools the
tests drive write (matplotlib's font cache, an IPython profile as a notebook kernel makes it, Jupyter's data and
config folders, XDG config and cache as Chromium's crash reports and dconf use them, a file in its tmp_path):
afterwards the home folder holds only what it held before, and the temporary folder no folder of the run.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PROBE = '''
from pathlib import Path


def test_probe_writes_where_the_tools_write(tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import font_manager
    font_manager._load_fontmanager(try_read_cache=False)   # writes its font cache, as a first import does
    plt.figure()
    from IPython.core.profiledir import ProfileDir
    from IPython.paths import get_ipython_dir
    ProfileDir.create_profile_dir_by_name(get_ipython_dir(), "default")   # as a kernel's first start does
    from jupyter_core.paths import jupyter_config_dir, jupyter_data_dir, jupyter_runtime_dir
    import os
    for d in (jupyter_config_dir(), jupyter_data_dir(), jupyter_runtime_dir(),
              os.path.join(os.environ.get("XDG_CONFIG_HOME", str(Path.home() / ".config")), "chromium"),
              os.path.join(os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache")), "dconf")):
        Path(d).mkdir(parents=True, exist_ok=True)
        (Path(d) / "probe").write_text("written by the probe")
    (tmp_path / "big.bin").write_bytes(b"x" * 100_000)
'''


@pytest.mark.slow
def test_a_test_run_leaves_nothing_in_home_or_in_tmp(tmp_path):
    pytest.importorskip("IPython")
    pytest.importorskip("jupyter_core")
    home, tmp, work = tmp_path / "home", tmp_path / "tmp", tmp_path / "work"
    for d in (home, tmp, work):
        d.mkdir()
    (home / ".gitconfig").write_text("[user]\n\tname = t\n")
    (work / "test_probe.py").write_text(PROBE)
    env = {k: v for k, v in os.environ.items()
           if k not in ("IPYTHONDIR", "MPLCONFIGDIR", "JUPYTER_CONFIG_DIR", "JUPYTER_DATA_DIR", "JUPYTER_RUNTIME_DIR",
                        "XDG_CONFIG_HOME", "XDG_CACHE_HOME", "XDG_DATA_HOME", "npm_config_cache", "PYTEST_ADDOPTS")}
    env.update(HOME=str(home), TMPDIR=str(tmp), PYTHONPATH=os.pathsep.join(
        [str(ROOT), str(ROOT / "lib"), *filter(None, [os.environ.get("PYTHONPATH")])]))
    # the repository's pytest set-up: its pyproject.toml (ini options) and its conftest.py (as a plugin: the probe
    # lives outside the repository, where conftest.py would not be picked up)
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-c", str(ROOT / "pyproject.toml"),
                          "--rootdir", str(work), "-p", "conftest", str(work / "test_probe.py")],
                         cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    left_home = sorted(p.relative_to(home).as_posix() for p in home.rglob("*"))
    assert left_home == [".gitconfig"], f"the test run left these in the home folder: {left_home}"
    left_tmp = sorted(p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file())
    assert left_tmp == [], f"the test run left these temporary files: {left_tmp[:20]}"
    assert not list(tmp.glob("pinlab-test-home-*"))
