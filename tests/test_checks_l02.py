"""Lesson 02's exercise checkers accept the master solution and reject planted wrong answers."""
import random

import pytest

import make_exercises
import nbtools
from nbtools import solution_namespace
from pinlab import profiler
from pinlab.checks import l02 as checks02
from pinlab.lessons import l02_fake_non_blocking as stalls

ROOT = nbtools.ROOT
STEM = "02_fake_non_blocking"


@pytest.fixture(scope="module")
def sol():
    return solution_namespace(STEM)


# ---- stall_threshold ----------------------------------------------------------------------------

def test_stall_threshold_accepts_solution(sol, capsys):
    assert checks02.check_stall_threshold(sol["stall_threshold"]) is True
    assert "✅ stall_threshold is correct" in capsys.readouterr().out


def _first_exceeding(sizes, host_ms, busy_ms):
    return min((s for s, m in zip(sizes, host_ms) if m > busy_ms / 2), default=None)


def _at_least_half(sizes, host_ms, busy_ms):
    t = None
    for s, m in sorted(zip(sizes, host_ms), reverse=True):
        if m < busy_ms / 2:
            break
        t = s
    return t


def _whole_busy_time(sizes, host_ms, busy_ms):
    t = None
    for s, m in sorted(zip(sizes, host_ms), reverse=True):
        if m <= busy_ms:
            break
        t = s
    return t


def _list_order(sizes, host_ms, busy_ms):
    t = None
    for s, m in reversed(list(zip(sizes, host_ms))):  # assumes the sizes come sorted
        if m <= busy_ms / 2:
            break
        t = s
    return t


def _largest_quick(sizes, host_ms, busy_ms):
    return max((s for s, m in zip(sizes, host_ms) if m <= busy_ms / 2), default=None)


def _top_only(sizes, host_ms, busy_ms):  # only asks whether the largest size waited
    top = max(sizes)
    return top if host_ms[sizes.index(top)] > busy_ms / 2 else None


@pytest.mark.parametrize("wrong", [_first_exceeding, _at_least_half, _whole_busy_time, _list_order, _largest_quick,
                                   _top_only], ids=lambda f: f.__name__)
def test_stall_threshold_rejects_wrong(wrong, capsys):
    assert checks02.check_stall_threshold(wrong) is False
    assert "❌ stall_threshold" in capsys.readouterr().out


def test_stall_reference_is_the_library_function():
    assert checks02.first_waiting_size is stalls.first_waiting_size
    for sizes, host_ms, busy in checks02.stall_cases():
        assert checks02.stall_threshold_reference(sizes, host_ms, busy) == stalls.first_waiting_size(
            sizes, host_ms, busy / 2)


def test_stall_cases_hold_the_decision_boundary():
    """Exactly half the busy time is not waiting: the cases contain it, at the top and below."""
    at_half = [(s, m, b) for s, m, b in checks02.stall_cases() if any(x == b / 2 for x in m)]
    assert len(at_half) >= 2
    assert checks02.stall_threshold_reference([1, 2], [0.1, 10.0], 20.0) is None
    assert checks02.stall_threshold_reference([1, 2, 4], [0.1, 5.0, 10.5], 10.0) == 4


# ---- gpu_idle_share -----------------------------------------------------------------------------

def test_gpu_idle_share_accepts_solution(sol, capsys):
    assert checks02.check_gpu_idle_share(sol["gpu_idle_share"]) is True
    assert "✅ gpu_idle_share is correct" in capsys.readouterr().out


def _sum_durations(spans, start, end):  # overlaps counted twice, nothing clipped
    return 1 - sum(b - a for a, b in spans) / (end - start)


def _no_clip(spans, start, end):  # a proper union, but not clipped to the window
    merged = profiler.merge_spans(spans)
    return 1 - sum(b - a for a, b in merged) / (end - start)


def _busy_share(spans, start, end):
    return 1 - profiler.idle_share(spans, start, end)


def _extent_window(spans, start, end):  # divides by the spans' extent, not the window
    if not spans:
        return 1.0
    lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
    return 1 - profiler.covered(spans, lo, hi) / (hi - lo) if hi > lo else 1.0


def _clip_sum(spans, start, end):  # clipped, but overlaps counted twice
    return 1 - sum(max(0.0, min(b, end) - max(a, start)) for a, b in spans) / (end - start)


def _touching_dropped(spans, start, end):  # merges with > and <, forgets == : a touching span is lost
    busy, cur = 0.0, None
    for a, b in sorted((max(a, start), min(b, end)) for a, b in spans):
        if b <= a:
            continue
        if cur is None or a > cur[1]:
            if cur is not None:
                busy += cur[1] - cur[0]
            cur = [a, b]
        elif a < cur[1]:
            cur[1] = max(cur[1], b)
    if cur is not None:
        busy += cur[1] - cur[0]
    return 1.0 - busy / (end - start)


def _touching_double(spans, start, end):  # a span touching the last one restarts the union, recounting it
    busy, cur = 0.0, None
    for a, b in sorted((max(a, start), min(b, end)) for a, b in spans):
        if b <= a:
            continue
        if cur is not None and a < cur[1]:
            cur[1] = max(cur[1], b)
            continue
        if cur is not None:
            busy += cur[1] - cur[0] + (cur[1] - cur[0] if a == cur[1] else 0.0)
        cur = [a, b]
    if cur is not None:
        busy += cur[1] - cur[0]
    return 1.0 - busy / (end - start)


@pytest.mark.parametrize("wrong", [_sum_durations, _no_clip, _busy_share, _extent_window, _clip_sum,
                                   _touching_dropped, _touching_double], ids=lambda f: f.__name__)
def test_gpu_idle_share_rejects_wrong(wrong, capsys):
    assert checks02.check_gpu_idle_share(wrong) is False
    assert "❌ gpu_idle_share" in capsys.readouterr().out


def test_idle_reference_is_the_library_function():
    assert checks02.idle_share is profiler.idle_share


def test_idle_cases_hold_touching_spans():
    touching = [c for c in checks02.idle_cases() if _touching_dropped(*c) != pytest.approx(profiler.idle_share(*c))]
    assert len(touching) >= 3  # the near miss fails on several cases, not on one by luck
    assert profiler.idle_share([(1.0, 2.0), (2.0, 3.0)], 0.0, 4.0) == pytest.approx(0.5)


def test_idle_reference_random_unions():
    rng = random.Random(7)
    for _ in range(200):  # brute force on a fine grid of integer spans
        spans = [(a, a + rng.randint(0, 5)) for a in (rng.randint(-3, 12) for _ in range(rng.randint(0, 6)))]
        covered = sum(any(a <= t < b for a, b in spans) for t in range(0, 10))
        assert profiler.idle_share(spans, 0, 10) == pytest.approx(1 - covered / 10)


# ---- the verdicts and the generated exercise ------------------------------------------------------

@pytest.mark.parametrize("check", [checks02.check_stall_threshold, checks02.check_gpu_idle_share])
def test_stub_is_reported_as_not_implemented(check, capsys):
    def stub(*args):
        raise NotImplementedError

    assert check(stub) is False
    assert "is not implemented yet" in capsys.readouterr().out


@pytest.mark.parametrize("check", [checks02.check_stall_threshold, checks02.check_gpu_idle_share])
def test_crash_is_reported_not_raised(check, capsys):
    assert check(lambda *a: 1 / 0) is False
    assert "raised ZeroDivisionError" in capsys.readouterr().out
