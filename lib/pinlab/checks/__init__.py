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

from ..args import callable_arg


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
