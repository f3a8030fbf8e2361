"""Run a file of CUDA tests in a pytest process of its own, and fail with its output if any failed: for tests that
turn on torch's GPU trace (the order verdict does), which torch cannot turn off (docs/facts.md F22), so that the
gpu tests after them in the suite's pytest process do not run under it. Used by tests/test_order.py
(tests/cuda_order_child.py) and tests/test_checks_l09.py (tests/cuda_checks09_child.py)."""
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
                       cwd=path.parents[1], capture_output=True, text=True, timeout=timeout_s)
    assert r.returncode == 0, r.stdout[-8000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and " skipped" not in r.stdout.splitlines()[-1], r.stdout[-2000:]
