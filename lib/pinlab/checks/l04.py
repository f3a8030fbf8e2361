"""Exercise checkers for lesson 04 (the fix)."""
from __future__ import annotations

from ..lessons import l03_the_race as race
from . import run_cases
from .l03 import _timeline_cases


# ---- lesson 04: how deep must the ring be? ------------------------------------------------------


def _same_int(got, expected) -> bool:
    return not isinstance(got, bool) and isinstance(got, int) and got == expected


def check_min_ring_depth(fn) -> bool:
    """``min_ring_depth(writes, copies)`` -> the fewest buffers that keep every copy correct."""
    cases = _timeline_cases(7)
    cases += [
        ([(0.0, 1.0), (1.0, 2.0), (2.0, 3.0), (3.0, 4.0)], [(1.0, 1.5), (2.0, 2.5), (3.0, 3.5), (4.0, 4.5)]),  # 2
        ([(0.0, 0.1), (0.1, 0.2), (0.2, 0.3), (2.5, 2.6)], [(2.0, 2.1), (2.1, 2.2), (2.2, 2.3), (2.6, 2.7)]),  # 3
        ([(0.0, 0.1), (0.2, 0.3), (0.4, 0.5), (0.6, 0.7), (3.0, 3.1)],
         [(1.0, 1.1), (1.2, 1.3), (2.0, 2.1), (2.2, 2.3), (3.1, 3.2)]),   # the worst step decides: 4
    ]
    return run_cases(fn, "min_ring_depth", cases, race.min_ring_depth, compare=_same_int)
