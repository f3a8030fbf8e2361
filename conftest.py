"""pytest set-up for the whole repository: the notebooks run under nbval (strict).

* stderr is never compared (progress bars, CUDA warnings, FlashInfer build logs go there);
* ``--require-gpu`` (the GPU suite) turns a missing CUDA device into a usage error instead of
  letting the notebooks fall back to replaying the recorded GPU run.
"""
import os
import sys
from pathlib import Path

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
