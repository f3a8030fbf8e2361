"""Run a file of CUDA tests in a pytest process of its own, and fail with its output if any failed: for tests that
turn on torch's GPU trace (the order verdict does), which torch cannot turn off (docs/facts.md F22), so that the
gpu tests after them in the suite's pytest process do not run under it (under it torch loses errors raised while it
frees CUDA memory: docs/facts.md F24). Used by tests/test_order.py (tests/cuda_order_child.py),
tests/test_checks_l03_l04.py (tests/cuda_checks03_04_child.py) and tests/test_checks_l09.py
(tests/cuda_checks09_child.py)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


def run(child: str, timeout_s: float = 900) -> None:
    """``python -m pytest -q`` on ``tests/<child>`` from the repository's root: every test passes, none skipped."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    path = Path(__file__).with_name(child)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", str(path)],
                       cwd=path.parents[1], capture_output=True, text=True, timeout=timeout_s,
                       env={**os.environ, CHILD: "1"})
    assert r.returncode == 0, _crash(r.stdout) + r.stdout[-8000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and " skipped" not in r.stdout.splitlines()[-1], r.stdout[-2000:]


def _crash(out: str) -> str:
    """Where a child that crashed (a segmentation fault, an abort) died: the test it was in and the first frames of
    faulthandler's dump, which the tail of its output (the dump's last frames: pytest's own) does not show."""
    at = out.find("Fatal Python error")
    if at < 0:
        return ""
    test = out.rfind("\n", 0, at)
    return "the child crashed: " + out[test + 1:at + 1500] + "\n...\n"


#: set in a child's environment: there a test may turn the GPU trace on (the child is that test's process)
CHILD = "PINLAB_GPU_CHILD"


def gpu_trace_on() -> bool:
    """Whether pinlab's order verdict turned torch's GPU trace on in this process (docs/facts.md F22)."""
    order = sys.modules.get("pinlab.order")
    return bool(getattr(order, "_trace_on", False))


def trace_problem(nodeid: str, was_on: bool, now_on: bool, in_child: bool) -> str | None:
    """Why a test that turned torch's GPU trace on in the suite's process fails (None: it did not). Every
    test after it would run under the trace, where torch loses errors raised while it frees CUDA memory
    ("SystemError: error return without exception set", docs/facts.md F24): it must run through :func:`run`."""
    if was_on or not now_on or in_child:
        return None
    return (f"{nodeid} turned torch's GPU trace on in the test suite's process (pinlab.order on CUDA; torch "
            "cannot turn it off, and under it the tests after this one can get \"SystemError: error return "
            "without exception set\" instead of torch's errors: docs/facts.md F22, F24). Move it into a "
            "tests/cuda_*_child.py file run through gpu_child.run(), as tests/test_checks_l09.py does.")
