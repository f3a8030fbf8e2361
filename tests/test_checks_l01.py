"""Each exercise checker accepts the master solution and rejects planted wrong answers."""
from pathlib import Path

import pytest

import nbtools
from nbtools import solution_namespace
from pinlab.checks import l01 as checks

ROOT = nbtools.ROOT



@pytest.fixture(scope="module")
def sol01():
    return solution_namespace("01_pinned_memory")


def test_gbps_accepts_solution(sol01, capsys):
    assert checks.check_gbps(sol01["gbps"]) is True
    assert "✅ gbps is correct" in capsys.readouterr().out


@pytest.mark.parametrize("wrong", [
    lambda n, ms: n / (ms * 1e-3) / 2**30,         # GiB/s, not GB/s
    lambda n, ms: n / ms / 1e9,                     # ms taken as seconds
    lambda n, ms: n / (ms * 1e-3) / 1e6,            # MB/s
    lambda n, ms: round(n / (ms * 1e-3) / 1e9),     # rounded
])
def test_gbps_rejects_wrong(wrong, capsys):
    assert checks.check_gbps(wrong) is False
    assert "❌ gbps" in capsys.readouterr().out


def test_n_half_accepts_solution(sol01):
    assert checks.check_n_half(sol01["n_half"]) is True


@pytest.mark.parametrize("wrong", [
    lambda s, r: min(x for x, y in zip(s, r) if y > max(r) / 2),        # strict >: misses exactly-half
    lambda s, r: next(x for x, y in zip(s, r) if y >= max(r) / 2),      # first in list order, not smallest
    lambda s, r: max(x for x, y in zip(s, r) if y >= max(r) / 2),       # largest
    lambda s, r: min(x for x, y in zip(s, r) if y >= r[-1] / 2),        # last rate taken as the peak
])
def test_n_half_rejects_wrong(wrong):
    assert checks.check_n_half(wrong) is False


def test_stub_is_reported_as_not_implemented(capsys):
    def stub(*args):
        raise NotImplementedError

    assert checks.check_gbps(stub) is False
    assert "⏳ gbps is not implemented yet" in capsys.readouterr().out


def test_crash_is_reported_not_raised(capsys):
    assert checks.check_gbps(lambda n, ms: 1 / 0) is False
    assert "raised ZeroDivisionError" in capsys.readouterr().out
