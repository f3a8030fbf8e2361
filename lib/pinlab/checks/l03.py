"""Exercise checkers for lesson 03 (the race). They run on any CPU.

Each checker runs the learner's function on fixed and random cases through
:func:`pinlab.checks.run_cases` and prints one verdict line (⏳ / ❌ / ✅), returning True or False.
The references are the library's own: :func:`pinlab.paged_kv.kv_indptr` and
:func:`pinlab.paged_kv.last_page_len`, :func:`pinlab.steploop.copies_correct`.
``tests/test_checks_l03_l04.py`` proves each accepts the solution and rejects planted wrong answers.
"""
from __future__ import annotations

import random

from .. import steploop
from ..paged_kv import kv_indptr, last_page_len
from . import run_cases

# ---- lesson 03, exercise 1: indptr and last_page_len --------------------------------------------


def _ref_indptr_last_page_len(seq_lens, page_size):
    return kv_indptr(list(seq_lens), page_size).tolist(), last_page_len(list(seq_lens), page_size).tolist()


def _as_list(v) -> list:
    """A learner's answer (list, tuple, numpy array or tensor) as a plain list; TypeError otherwise."""
    if hasattr(v, "tolist"):
        v = v.tolist()
    if isinstance(v, (str, bytes)) or not hasattr(v, "__iter__"):
        raise TypeError
    return list(v)


def _int_list(v):
    out = []
    for x in _as_list(v):
        if isinstance(x, bool) or not float(x).is_integer():
            raise TypeError
        out.append(int(x))
    return out


def _same_pair_of_int_lists(got, expected) -> bool:
    try:
        a, b = got
        return (_int_list(a), _int_list(b)) == (list(expected[0]), list(expected[1]))
    except (TypeError, ValueError):
        return False


def check_indptr_last_page_len(fn) -> bool:
    """``indptr_last_page_len(seq_lens, page_size)`` -> ``(indptr, last_page_len)`` as lists."""
    rng = random.Random(3)
    cases = [
        ([37, 48, 17, 0], 16),     # the worked example: [0, 3, 6, 8, 8] and [5, 16, 1, 0]
        ([16, 32, 15, 1], 16),     # full last pages hold page_size tokens, not 0
        ([0, 0, 5], 4),            # empty sequences: no pages, last_page_len 0
        ([1, 2, 3], 1),            # page_size 1: every page is full
        ([], 16),                  # an empty batch: indptr [0]
        ([100], 64),
    ]
    for _ in range(30):
        ps = rng.choice([1, 4, 16, 64])
        lens = [rng.choice([0, rng.randint(1, 300), ps * rng.randint(1, 5)]) for _ in range(rng.randint(1, 12))]
        cases.append((lens, ps))
    return run_cases(fn, "indptr_last_page_len", cases, _ref_indptr_last_page_len,
                     compare=_same_pair_of_int_lists)


# ---- lesson 03, exercise 2: which copies read their own step's data ----------------------------


def _bool_list(v):
    out = []
    for x in _as_list(v):
        if x is None or x not in (True, False):  # bools, numpy bools (and 0/1) only
            raise TypeError
        out.append(bool(x))
    return out


def _same_bool_list(got, expected) -> bool:
    try:
        return _bool_list(got) == list(expected)
    except (TypeError, ValueError):
        return False


def timeline_cases(seed: int) -> list:
    """(writes, copies) pairs: simulated step loops, edge cases on the boundaries, random ones."""
    rng = random.Random(seed)
    cases = []
    for strategy, kw in [("reused_pinned", {}), ("reused_pinned", {"gpu_ms": 0.01}),
                         ("reused_pinned", {"ahead": 2}), ("reused_pinned", {"ahead": 1}),
                         ("reused_pinned", {"ahead": 3, "steps": 9}), ("reused_pinned", {"gpu_ms": 0.3, "steps": 8})]:
        sim = steploop.simulate(strategy, **({"steps": 6} | kw))
        cases.append((sim["writes"], sim["copies"]))
    cases += [
        ([(0.0, 1.0), (2.0, 3.0)], [(1.0, 2.0), (3.0, 4.0)]),     # the next write starts exactly at the copy's end: safe
        ([(0.0, 1.0), (1.5, 2.5)], [(1.5, 2.0), (3.0, 4.0)]),     # ... exactly at the copy's start: not safe
        ([(0.0, 1.0), (1.2, 3.0)], [(1.0, 2.0), (3.0, 3.5)]),     # starts during the copy, ends after it: not safe
        ([(0.0, 1.0)], [(5.0, 6.0)]),                             # one step: always its own data
        ([(0.0, 1.0), (1.0, 2.0), (9.0, 9.5)], [(1.0, 1.5), (2.0, 8.0), (9.5, 9.6)]),  # only a later write matters
        ([(0.0, 1.0), (1.1, 2.0), (2.1, 2.2)], [(3.0, 3.1), (3.2, 3.3), (3.4, 3.5)]),  # two later writes, all before
    ]
    for _ in range(25):
        steps = rng.randint(2, 9)
        writes, copies, t, g = [], [], 0.0, 0.0
        for _ in range(steps):
            t += round(rng.uniform(0, 1.5), 2)
            w = (t, round(t + rng.uniform(0.05, 0.5), 2))
            t = w[1]
            g = max(g, t) + round(rng.uniform(0, 2.0), 2)
            c = (g, round(g + rng.uniform(0.01, 0.4), 2))
            g = c[1]
            writes.append(w)
            copies.append(c)
        cases.append((writes, copies))
    return cases


def check_copies_correct(fn) -> bool:
    """``copies_correct(writes, copies)`` -> list of bools: did copy n deliver step n's data?"""
    return run_cases(fn, "copies_correct", timeline_cases(5), steploop.copies_correct, compare=_same_bool_list)
