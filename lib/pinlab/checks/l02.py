"""Exercise checkers for lesson 02 (fake ``non_blocking``), built on :func:`pinlab.checks.run_cases`.

Each checker prints one verdict line (⏳ not implemented, ❌ first failing case, ✅ correct) and
returns True or False. ``tests/test_checks02.py`` proves each accepts the master solution and
rejects planted wrong answers.
"""
from __future__ import annotations

import random

from . import run_cases

MiB = 1 << 20

# ---- 1. stall_threshold -----------------------------------------------------------------------


def _ref_stall_threshold(sizes, host_ms, busy_ms):
    """The smallest size from which on every larger copy waited (host ms > busy_ms / 2), or None."""
    threshold = None
    for size, ms in sorted(zip(sizes, host_ms), reverse=True):
        if ms <= busy_ms / 2:
            break
        threshold = size
    return threshold


def _stall_cases():
    h200_sizes = [256 << i for i in range(19)]
    h200_ms = [0.014, 0.013, 0.013, 0.013, 0.013, 0.014, 0.017, 0.019, 0.027, 0.025, 0.031, 0.046,
               0.09, 0.24, 10.26, 10.69, 11.56, 13.62, 17.27]
    cases = [
        (h200_sizes, h200_ms, 10.0),                                        # the H200's shape
        ([1024, 2048, 4096, 8192, 16384], [0.01, 6.0, 0.01, 10.2, 11.0], 10.0),  # a stray slow small copy
        ([1, 2, 4], [0.1, 5.0, 10.5], 10.0),                               # exactly half is not waiting
        ([1, 2, 4, 8], [0.1, 0.2, 7.0, 12.0], 10.0),                       # waited less than the busy time
        ([4096, 1024, 65536, 2048], [12.0, 0.1, 15.0, 0.2], 10.0),         # sizes not sorted
        ([1, 2, 3], [0.1, 20.0, 0.1], 10.0),                               # the largest did not wait
        ([64, 128, 256], [0.01, 0.02, 0.03], 10.0),                        # nothing waited
        ([3 * MiB, MiB, 2 * MiB], [30.0, 25.5, 26.0], 50.0),               # everything waited
        ([5], [1.0], 1.0),                                                 # one size
    ]
    rng = random.Random(202)
    for _ in range(40):
        n = rng.randint(1, 14)
        sizes = rng.sample([1 << k for k in range(8, 28)], n)
        busy = rng.choice([5.0, 10.0, 20.0, 50.0])
        cut = rng.choice([1 << k for k in range(8, 29)])
        ms = []
        for s in sizes:
            slow = s >= cut
            if rng.random() < 0.15:
                slow = not slow  # a stray measurement
            ms.append(round(rng.uniform(busy * 0.55, busy * 1.8) if slow else rng.uniform(0.005, busy * 0.45), 3))
        cases.append((sizes, ms, busy))
    return cases


def check_stall_threshold(fn) -> bool:
    """``stall_threshold(sizes, host_ms, busy_ms)``: the smallest size from which on every larger size
    waited (host time more than half the busy time); ``None`` when the largest size did not wait."""
    return run_cases(fn, "stall_threshold", _stall_cases(), _ref_stall_threshold)


# ---- 2. gpu_idle_share ------------------------------------------------------------------------


def _ref_gpu_idle_share(spans, start, end):
    """Share of [start, end] covered by no span; spans may overlap, be unsorted, stick out."""
    clipped = sorted((max(a, start), min(b, end)) for a, b in spans)
    busy, cur_start, cur_end = 0.0, None, None
    for a, b in clipped:
        if b <= a:
            continue
        if cur_end is None or a > cur_end:
            if cur_end is not None:
                busy += cur_end - cur_start
            cur_start, cur_end = a, b
        else:
            cur_end = max(cur_end, b)
    if cur_end is not None:
        busy += cur_end - cur_start
    return 1.0 - busy / (end - start)


def _idle_cases():
    cases = [
        ([(0.0, 2.0), (3.0, 5.0)], 0.0, 10.0),                  # two kernels
        ([], 0.0, 4.0),                                         # nothing ran: idle all the time
        ([(0.0, 4.0)], 0.0, 4.0),                               # busy all the time
        ([(1.0, 3.0), (2.0, 4.0)], 0.0, 8.0),                   # overlapping (two streams)
        ([(5.0, 6.0), (1.0, 2.0), (3.0, 4.0)], 0.0, 10.0),      # not sorted
        ([(-2.0, 1.0), (9.0, 12.0)], 0.0, 10.0),                # sticking out of the window
        ([(1.0, 9.0), (2.0, 3.0)], 0.0, 10.0),                  # nested
        ([(1.0, 2.0), (2.0, 3.0)], 0.0, 4.0),                   # touching
        ([(20.0, 30.0)], 0.0, 10.0),                            # entirely outside
        ([(0.5, 2.5), (2.0, 2.2), (6.0, 9.5), (9.0, 11.0)], 0.5, 10.5),
    ]
    rng = random.Random(2)
    for _ in range(40):
        start = round(rng.uniform(-5, 5), 3)
        end = round(start + rng.uniform(0.5, 20), 3)
        spans = []
        for _ in range(rng.randint(0, 8)):
            a = round(rng.uniform(start - 3, end + 1), 3)
            spans.append((a, round(a + rng.uniform(0, 6), 3)))
        cases.append((spans, start, end))
    return cases


def check_gpu_idle_share(fn) -> bool:
    """``gpu_idle_share(spans, start, end)``: the share of the window ``[start, end]`` in which no
    kernel span is running (spans may overlap, come unsorted and stick out of the window)."""
    return run_cases(fn, "gpu_idle_share", _idle_cases(), _ref_gpu_idle_share)
