"""Exercise checkers for lesson 02 (fake ``non_blocking``), built on :func:`pinlab.checks.run_cases`.

Each checker prints one verdict line (⏳ not implemented, ❌ first failing case, ✅ correct) and
returns True or False. The reference answers are the library's own: ``stall_threshold`` is
:func:`pinlab.lessons.l02_fake_non_blocking.first_waiting_size` with half the busy time as the
limit, ``gpu_idle_share`` is :func:`pinlab.profiler.idle_share`. ``tests/test_checks_l02.py``
proves each checker accepts the master solution and rejects planted wrong answers.
"""
from __future__ import annotations

import random

from ..lessons.l02_fake_non_blocking import first_waiting_size
from ..profiler import idle_share
from . import run_cases

MiB = 1 << 20

# ---- 1. stall_threshold -----------------------------------------------------------------------


def stall_threshold_reference(sizes, host_ms, busy_ms):
    """The smallest size from which on every larger copy waited (host ms > busy_ms / 2), or None."""
    return first_waiting_size(sizes, host_ms, busy_ms / 2)


def stall_cases():
    h200_sizes = [256 << i for i in range(19)]
    h200_ms = [0.014, 0.013, 0.013, 0.013, 0.013, 0.014, 0.017, 0.019, 0.027, 0.025, 0.031, 0.046,
               0.09, 0.24, 10.26, 10.69, 11.56, 13.62, 17.27]
    cases = [
        (h200_sizes, h200_ms, 10.0),                                        # the H200's shape
        ([1024, 2048, 4096, 8192, 16384], [0.01, 6.0, 0.01, 10.2, 11.0], 10.0),  # a stray slow small copy
        ([1, 2, 4], [0.1, 5.0, 10.5], 10.0),                               # exactly half is not waiting
        ([1, 2], [0.1, 10.0], 20.0),                                       # exactly half at the top: None
        ([1024, 2048, 4096], [2.5, 2.5, 2.5001], 5.0),                     # just above half, at the top only
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
    return run_cases(fn, "stall_threshold", stall_cases(), stall_threshold_reference)


# ---- 2. gpu_idle_share ------------------------------------------------------------------------


def idle_cases():
    cases = [
        ([(0.0, 2.0), (3.0, 5.0)], 0.0, 10.0),                  # two kernels
        ([], 0.0, 4.0),                                         # nothing ran: idle all the time
        ([(0.0, 4.0)], 0.0, 4.0),                               # busy all the time
        ([(1.0, 3.0), (2.0, 4.0)], 0.0, 8.0),                   # overlapping (two streams)
        ([(5.0, 6.0), (1.0, 2.0), (3.0, 4.0)], 0.0, 10.0),      # not sorted
        ([(-2.0, 1.0), (9.0, 12.0)], 0.0, 10.0),                # sticking out of the window
        ([(1.0, 9.0), (2.0, 3.0)], 0.0, 10.0),                  # nested
        ([(1.0, 2.0), (2.0, 3.0)], 0.0, 4.0),                   # touching
        ([(2.0, 3.0), (0.0, 1.0), (1.0, 2.0)], 0.0, 5.0),       # a chain of touching spans, unsorted
        ([(0.0, 1.0), (1.0, 1.0), (1.0, 2.5)], 0.0, 4.0),       # touching through an empty span
        ([(-1.0, 0.0), (4.0, 5.0)], 0.0, 4.0),                  # touching the window from outside
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
    return run_cases(fn, "gpu_idle_share", idle_cases(), idle_share)
