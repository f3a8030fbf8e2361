"""Exercise checkers: each runs the learner's function on cases and compares with a reference.

A checker prints one verdict line and returns True or False:

* ``⏳ ... not implemented yet`` when the stub still raises ``NotImplementedError``;
* ``❌ ...`` with the first failing case (arguments, what came back, what was expected);
* ``✅ ...`` when every case passes.

``tests/test_exercise_checks.py`` proves each checker accepts the solution and rejects planted
wrong answers.
"""
from __future__ import annotations

import math
import random

from ._check import callable_arg


def _close(a, b, rel=1e-6) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(float(a), float(b), rel_tol=rel, abs_tol=1e-12)
    return a == b


def run_cases(fn, name: str, cases, reference, *, compare=_close) -> bool:
    """Check ``fn(*args) == reference(*args)`` for every ``args`` in ``cases``."""
    callable_arg("fn", fn)
    n = 0
    for args in cases:
        expected = reference(*args)
        try:
            got = fn(*args)
        except NotImplementedError:
            print(f"⏳ {name} is not implemented yet: write it above, then re-run this cell.")
            return False
        except Exception as exc:  # the learner's bug, reported, not raised
            print(f"❌ {name}{_fmt_args(args)} raised {type(exc).__name__}: {exc}")
            return False
        if not compare(got, expected):
            print(f"❌ {name}{_fmt_args(args)} returned {got!r}, expected {expected!r}")
            return False
        n += 1
    print(f"✅ {name} is correct ({n} cases).")
    return True


def _fmt_args(args) -> str:
    text = ", ".join(repr(a) for a in args)
    return f"({text[:200]}{'...' if len(text) > 200 else ''})"


# ---- lesson 01 -------------------------------------------------------------------------------

def _ref_gbps(nbytes, ms):
    return nbytes / (ms * 1e-3) / 1e9


def check_gbps(fn) -> bool:
    """``gbps(nbytes, ms)``: bandwidth in GB/s (10**9 bytes per second)."""
    rng = random.Random(1)
    cases = [(2**30, 19.43), (1024, 0.0128), (256 * 2**20, 31.5)]
    cases += [(rng.randint(1, 2**31), rng.uniform(1e-3, 500)) for _ in range(20)]
    return run_cases(fn, "gbps", cases, _ref_gbps)


def _ref_n_half(sizes, rates):
    peak = max(rates)
    return min(s for s, r in zip(sizes, rates) if r >= peak / 2)


def check_n_half(fn) -> bool:
    """``n_half(sizes, rates)``: the smallest size whose rate reaches half the peak rate."""
    rng = random.Random(2)
    cases = [([1024, 4096, 16384], [1.0, 2.0, 4.0]),          # exactly half counts
             ([1, 2, 4, 8], [1.0, 9.0, 3.0, 10.0]),          # not monotone: first size, not last
             ([4096, 1024, 65536], [20.0, 1.0, 30.0])]       # sizes not sorted
    for _ in range(30):
        n = rng.randint(1, 12)
        sizes = rng.sample([1 << k for k in range(10, 31)], n)
        cases.append((sizes, [round(rng.uniform(0.01, 60), 2) for _ in range(n)]))
    return run_cases(fn, "n_half", cases, _ref_n_half)
