"""Each exercise checker accepts the master solution and rejects planted wrong answers."""
import pytest

import nbtools
from nbtools import solution_namespace
from pinlab.checks import l01 as checks

ROOT = nbtools.ROOT


@pytest.fixture(scope="module")
def sol01():
    return solution_namespace("01_pinned_memory")


def test_gbps_accepts_solution(sol01, capsys):
    assert checks.check_gbps.verdict(sol01["gbps"]) is True
    assert "✅ gbps is correct" in capsys.readouterr().out


@pytest.mark.parametrize("wrong", [
    lambda n, ms: n / (ms * 1e-3) / 2**30,         # GiB/s, not GB/s
    lambda n, ms: n / ms / 1e9,                     # ms taken as seconds
    lambda n, ms: n / (ms * 1e-3) / 1e6,            # MB/s
    lambda n, ms: round(n / (ms * 1e-3) / 1e9),     # rounded
    lambda n, ms: n * 8 / (ms * 1e-3) / 1e9,        # Gbit/s, not GB/s
    lambda n, ms: n / (ms * 1e3) / 1e9,             # ms converted the wrong way
    lambda n, ms: ms / (n * 1e-3) / 1e9,            # arguments swapped
], ids=["GiB/s", "ms-as-s", "MB/s", "rounded", "Gbit/s", "ms*1e3", "swapped"])
def test_gbps_rejects_wrong(wrong, capsys):
    assert checks.check_gbps.verdict(wrong) is False
    assert "❌ gbps" in capsys.readouterr().out


def test_n_half_accepts_solution(sol01):
    assert checks.check_n_half.verdict(sol01["n_half"]) is True


def _n_half_sorted(sizes, rates):
    peak = max(rates)
    for size, rate in sorted(zip(sizes, rates)):
        if 2 * rate >= peak:
            return size


@pytest.mark.parametrize("right", [
    _n_half_sorted,                                                            # walk the sorted pairs
    lambda s, r: sorted(x for x, y in zip(s, r) if y / max(r) >= 0.5)[0],      # as a fraction of the peak
    lambda s, r: int(min(x for x, y in zip(s, r) if y >= max(r) * 0.5)),
], ids=["sorted-walk", "fraction", "times-0.5"])
def test_n_half_accepts_equivalent_answers(right, capsys):
    assert checks.check_n_half.verdict(right) is True
    assert "✅ n_half is correct" in capsys.readouterr().out


def test_gbps_accepts_an_equivalent_answer():
    assert checks.check_gbps.verdict(lambda n, ms: n / ms / 1e6) is True


N_HALF_WRONG = {
    "strict >": lambda s, r: min(x for x, y in zip(s, r) if y > max(r) / 2),          # misses exactly-half
    "list order": lambda s, r: next(x for x, y in zip(s, r) if y >= max(r) / 2),      # first in list, not smallest
    "largest": lambda s, r: max(x for x, y in zip(s, r) if y >= max(r) / 2),
    "last rate as peak": lambda s, r: min(x for x, y in zip(s, r) if y >= r[-1] / 2),
    "floored threshold": lambda s, r: min(x for x, y in zip(s, r) if y >= max(r) // 2),  # issue 11
    "int() threshold": lambda s, r: min(x for x, y in zip(s, r) if y >= int(max(r) / 2)),
    "sizes sorted apart from rates": lambda s, r: min(x for x, y in zip(sorted(s), r) if y >= max(r) / 2),
    "index, not size": lambda s, r: min(i for i, y in enumerate(r) if y >= max(r) / 2),
    "rate, not size": lambda s, r: min(y for y in r if y >= max(r) / 2),
    "half of the smallest size's rate": lambda s, r: min(x for x, y in zip(s, r) if y >= min(r) / 2),
}


@pytest.mark.parametrize("wrong", list(N_HALF_WRONG.values()), ids=list(N_HALF_WRONG))
def test_n_half_rejects_wrong(wrong, capsys):
    assert checks.check_n_half.verdict(wrong) is False
    assert "❌ n_half" in capsys.readouterr().out


def test_floored_threshold_is_caught_by_a_rate_between_floor_and_half_the_peak(capsys):
    floored = N_HALF_WRONG["floored threshold"]
    assert checks.check_n_half.verdict(floored) is False
    out = capsys.readouterr().out
    assert "❌ n_half([1024, 2048, 4096], [4.6, 5.0, 9.5]) returned 1024, expected 2048" in out


def test_a_second_failure_gets_a_hint(capsys):
    wrong = N_HALF_WRONG["floored threshold"]
    assert checks.check_n_half.verdict(_n_half_sorted) is True   # a pass resets the failure count
    checks.check_n_half.verdict(wrong)
    checks.check_n_half.verdict(wrong)
    out = capsys.readouterr().out
    assert out.count("❌ n_half") == 2 and out.count("💡 Hint:") == 1 and "max(rates) / 2" in out


def test_n_half_answer_must_be_a_size_not_a_float(capsys):
    assert checks.check_n_half.verdict(lambda s, r: float(min(x for x, y in zip(s, r) if y >= max(r) / 2))) is False
    assert checks.check_n_half.verdict(lambda s, r: __import__("numpy").int64(
        min(x for x, y in zip(s, r) if y >= max(r) / 2))) is True


def test_checkers_use_the_lessons_reference_answers():
    from pinlab.lessons import l01_pinned_memory as lesson

    assert checks.gbps is lesson.gbps and checks.n_half is lesson.n_half


def test_stub_is_reported_as_not_implemented(capsys):
    def stub(*args):
        raise NotImplementedError

    assert checks.check_gbps.verdict(stub) is False
    assert "⏳ gbps is not implemented yet" in capsys.readouterr().out


def test_crash_is_reported_not_raised(capsys):
    assert checks.check_gbps.verdict(lambda n, ms: 1 / 0) is False
    assert "raised ZeroDivisionError" in capsys.readouterr().out
