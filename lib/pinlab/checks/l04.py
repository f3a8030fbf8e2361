"""Exercise checkers for lesson 04 (the fix). The reference is :func:`pinlab.steploop.min_ring_depth`."""
from __future__ import annotations

from .. import steploop
from . import run_cases, same_int
from .l03 import timeline_cases

# ---- lesson 04: how deep must the ring be? ------------------------------------------------------


def check_min_ring_depth(fn) -> bool:
    """``min_ring_depth(writes, copies)`` -> the fewest buffers that keep every copy correct."""
    cases = timeline_cases(7)
    cases += [
        ([(0.0, 1.0), (1.0, 2.0), (2.0, 3.0), (3.0, 4.0)], [(1.0, 1.5), (2.0, 2.5), (3.0, 3.5), (4.0, 4.5)]),  # 2
        ([(0.0, 0.1), (0.1, 0.2), (0.2, 0.3), (2.5, 2.6)], [(2.0, 2.1), (2.1, 2.2), (2.2, 2.3), (2.6, 2.7)]),  # 3
        ([(0.0, 0.1), (0.2, 0.3), (0.4, 0.5), (0.6, 0.7), (3.0, 3.1)],
         [(1.0, 1.1), (1.2, 1.3), (2.0, 2.1), (2.2, 2.3), (3.1, 3.2)]),   # the worst step decides: 4
        ([(0.0, 1.0), (1.0, 2.0), (2.0, 3.0)], [(1.0, 2.0), (2.0, 3.0), (3.0, 4.0)]),  # a write exactly at a copy's end is safe: 2
        ([(0.0, 0.5), (0.5, 1.0), (2.0, 2.5)], [(1.0, 2.0), (2.0, 2.5), (2.5, 3.0)]),  # exactly at the end: 2
        ([(0.0, 0.5), (0.5, 1.0), (1.9, 2.5)], [(1.0, 2.0), (2.0, 2.5), (2.5, 3.0)]),  # 0.1 before it: 3
        ([(0.0, 1.0)], [(5.0, 6.0)]),                                                  # one step: 1
    ]
    return run_cases(fn, "min_ring_depth", cases, steploop.min_ring_depth, compare=same_int)
