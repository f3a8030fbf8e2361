"""Packaging and tools (issue 19): the wheel ships the recorded GPU run and replays it outside a checkout;
`make lab` is explicit about root and the network; tools/gpu-wheels.sh, tools/build_site.py --out and
tools/mutation_check.py are safe to run."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))


# ---- the wheel ----------------------------------------------------------------------------------------------

def test_pyproject_lists_every_package_and_maps_the_recordings():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {".".join(p.parent.relative_to(ROOT / "lib").parts) for p in (ROOT / "lib" / "pinlab").rglob("__init__.py")
             if "__pycache__" not in p.parts}
    assert set(tool["packages"]) == found | {"pinlab._recorded", "pinlab._recorded.data"}, (
        "a package under lib/pinlab is missing from [tool.setuptools] packages in pyproject.toml")
    assert tool["package-dir"] == {"": "lib", "pinlab._recorded": "reports/gpu",
                                   "pinlab._recorded.data": "reports/gpu/data"}
    assert tool["package-data"] == {"pinlab._recorded": ["latest.json"], "pinlab._recorded.data": ["*.json"]}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """A wheel built (no build isolation, so no network) from a copy of the sources the wheel needs."""
    pytest.importorskip("setuptools", reason="building the wheel needs setuptools in this environment")
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info", "*.pyc")
    shutil.copytree(ROOT / "lib", src / "lib", ignore=skip)
    shutil.copytree(ROOT / "reports" / "gpu", src / "reports" / "gpu")
    out = tmp_path_factory.mktemp("whl")
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                          "--no-index", "-w", str(out), str(src)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    (whl,) = out.glob("pinlab-*.whl")
    return whl


def test_the_wheel_ships_the_recorded_run(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    want = {f"pinlab/_recorded/data/{p.name}" for p in (ROOT / "reports" / "gpu" / "data").glob("*.json")}
    assert want and want <= names
    assert "pinlab/_recorded/latest.json" in names and "pinlab/replay.py" in names
    assert not any(n.startswith(("reports/", "lib/")) for n in names)


_PROBE = """
import json, os, sys, pinlab
from pinlab import replay
out = {"pinlab": pinlab.__file__, "where": [str(p) for p in replay.data_location()]}
if sys.argv[1:] == ["where"]:
    print(json.dumps(out))
    sys.exit()
run = pinlab.measure("00_tiny_copy", lambda: 1, quiet=True)
out["replayed"] = (not run.live) and run.result["median"] > 0
rep = pinlab.doctor(verbose=False)
out["doctor"] = {c["check"]: c["ok"] for c in rep["checks"]}
os.environ["PINLAB_RECORD"] = "1"
try:
    replay.record_dir()
except replay.RecordingError as exc:
    out["record"] = str(exc)
print(json.dumps(out))
"""


def test_an_installed_wheel_replays_outside_a_checkout_and_never_records_into_itself(wheel, tmp_path):
    site = tmp_path / "site"
    res = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                          str(site), str(wheel)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    away = tmp_path / "elsewhere"
    away.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PINLAB_DATA_DIR", "PINLAB_RECORD")}
    env.update(PYTHONPATH=str(site), PINLAB_FORCE_CPU="1", MPLBACKEND="Agg")
    res = subprocess.run([sys.executable, "-c", _PROBE], cwd=away, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["pinlab"].startswith(str(site))
    assert out["where"] == [str(site / "pinlab" / "_recorded" / "data"), "package"]
    assert out["replayed"] and out["doctor"]["recorded GPU run"] and out["doctor"]["GPU suite report"]
    assert "inside an installed package" in out["record"]
    # run from inside the course's checkout, the installed package replays the checkout's recordings
    res = subprocess.run([sys.executable, "-c", _PROBE, "where"], cwd=ROOT / "notebooks", env=env, capture_output=True,
                         text=True, timeout=300)
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["pinlab"].startswith(str(site)) and out["where"] == [str(ROOT / "reports" / "gpu" / "data"), "cwd"]
