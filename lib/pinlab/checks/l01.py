"""Exercise checkers for lesson 01 (pinned memory).

The reference answers are the lesson's own (``pinlab.lessons.l01_pinned_memory``): one copy each.
"""
from __future__ import annotations

import random

from ..lessons.l01_pinned_memory import gbps, n_half
from . import checker, run_cases, same_int


@checker
def check_gbps(fn) -> bool:
    """``gbps(nbytes, ms)``: bandwidth in GB/s (10**9 bytes per second)."""
    rng = random.Random(1)
    cases = [(2**30, 19.43), (1024, 0.0128), (256 * 2**20, 31.5), (10**9, 1000.0), (0, 5.0)]
    cases += [(rng.randint(1, 2**31), rng.uniform(1e-3, 500)) for _ in range(20)]
    return run_cases(fn, "gbps", cases, gbps, signature="(nbytes, ms) -> float (GB/s)",
                     hint="GB/s means 10**9 bytes (not 2**30) per second, and ms are thousandths of a "
                          "second: convert ms to seconds before you divide.")


@checker
def check_n_half(fn) -> bool:
    """``n_half(sizes, rates)``: the smallest size whose rate reaches half the peak rate."""
    rng = random.Random(2)
    cases = [([1024, 4096, 16384], [1.0, 2.0, 4.0]),          # exactly half counts
             ([1, 2, 4, 8], [1.0, 9.0, 3.0, 10.0]),          # not monotone: first size, not last
             ([4096, 1024, 65536], [20.0, 1.0, 30.0]),       # sizes not sorted
             # a rate between floor(peak)/2 and peak/2 is below half the peak: a floored threshold
             # (max(r) // 2, int(max(r) / 2)) takes it
             ([1024, 2048, 4096], [4.6, 5.0, 9.5]),
             ([1024, 4096, 16384], [3, 6, 7]),
             ([65536, 1024, 4096], [55.4, 27.5, 27.65]),
             ([7], [0.5])]                                   # one size: it is its own peak
    for _ in range(30):
        n = rng.randint(1, 12)
        sizes = rng.sample([1 << k for k in range(10, 31)], n)
        cases.append((sizes, [round(rng.uniform(0.01, 60), 2) for _ in range(n)]))
    return run_cases(fn, "n_half", cases, n_half, compare=same_int, signature="(sizes, rates) -> int (a size)",
                     hint="compare each rate with max(rates) / 2 exactly (no rounding: 4.6 is below half of "
                          "9.5), keep each size with its own rate, and return the smallest size that "
                          "qualifies, not the first one in the list.")
