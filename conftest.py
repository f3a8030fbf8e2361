"""pytest set-up for the whole repository: the notebooks run under nbval (strict).

* stderr is never compared (progress bars, CUDA warnings, FlashInfer build logs go there);
* ``--require-gpu`` (the GPU suite) turns a missing CUDA device into a usage error instead of
  letting the notebooks fall back to replaying the recorded GPU run;
* every notebook cell gets the marker ``notebook`` (the GPU suite selects ``-m "gpu or notebook"``: the
  ``gpu`` unit tests and nbval in one pytest run);
* with $PINLAB_PYTEST_LOG set, each test phase's outcome is appended there as a JSON line (the GPU suite
  reads them back per notebook and for the unit tests: tools/evidence.py).
"""
import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "tools"))
os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")


def pytest_addoption(parser):
    parser.addoption("--require-gpu", action="store_true",
                     help="fail instead of replaying recorded results when CUDA is absent")


def pytest_configure(config):
    if config.getoption("--require-gpu"):
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--require-gpu was given but torch.cuda.is_available() is False")


def pytest_collectstart(collector):
    if getattr(collector, "path", None) is not None and collector.path.suffix == ".ipynb":
        collector.skip_compare += ("stderr",)


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        if getattr(item, "path", None) is not None and item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.notebook)


def _short(report) -> str:
    if not report.failed:
        return ""
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    if crash is not None and getattr(crash, "message", None):
        return crash.message.strip().splitlines()[0][:300] if crash.message.strip() else ""
    lines = [ln for ln in str(report.longrepr).splitlines() if ln.strip()]
    return " | ".join(lines[-3:])[-300:]


def _log(record: dict) -> None:
    path = os.environ.get("PINLAB_PYTEST_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


def pytest_runtest_logreport(report):
    _log({"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
          "duration": round(report.duration, 3), "message": _short(report)})


def pytest_collectreport(report):
    if report.failed:
        _log({"nodeid": report.nodeid, "when": "collect", "outcome": "failed", "duration": 0.0,
              "message": _short(report)})
