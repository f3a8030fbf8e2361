"""The checkers of lessons 03 and 04 accept the master solutions and reject planted wrong answers."""
from pathlib import Path

import numpy as np
import pytest

import nbtools
from nbtools import solution_namespace
from pinlab.checks import l03 as checks03
from pinlab.checks import l04 as checks04

ROOT = nbtools.ROOT



@pytest.fixture(scope="module")
def sol03():
    return solution_namespace("03_the_race")


@pytest.fixture(scope="module")
def sol04():
    return solution_namespace("04_the_fix")


def _stub(*args):
    raise NotImplementedError


# ---- indptr / last_page_len

def test_indptr_accepts_solution(sol03, capsys):
    assert checks03.check_indptr_last_page_len(sol03["indptr_last_page_len"]) is True
    assert "✅ indptr_last_page_len is correct" in capsys.readouterr().out


def _pages(n, ps):
    return -(-n // ps)


def _cum(xs):
    out = [0]
    for x in xs:
        out.append(out[-1] + x)
    return out


@pytest.mark.parametrize("wrong", [
    lambda s, ps: (_cum([_pages(n, ps) for n in s]), [n % ps for n in s]),                    # full page -> 0
    lambda s, ps: (_cum([_pages(n, ps) for n in s]), [ps if n % ps == 0 else n % ps for n in s]),  # empty -> ps
    lambda s, ps: (_cum([n // ps for n in s]),                                                  # floor, not ceil
                   [ps if (n % ps == 0 and n) else n % ps for n in s]),
    lambda s, ps: (_cum([_pages(n, ps) for n in s])[1:],                                        # no leading 0
                   [ps if (n % ps == 0 and n) else n % ps for n in s]),
    lambda s, ps: (_cum(s), [ps if (n % ps == 0 and n) else n % ps for n in s]),                # tokens, not pages
    lambda s, ps: ([ps if (n % ps == 0 and n) else n % ps for n in s], _cum([_pages(n, ps) for n in s])),  # swapped
    lambda s, ps: (_cum([n // ps + 1 if n else 0 for n in s]),                                  # floor + 1: wrong on full pages
                   [ps if (n % ps == 0 and n) else n % ps for n in s]),
])
def test_indptr_rejects_wrong(wrong, capsys):
    assert checks03.check_indptr_last_page_len(wrong) is False
    assert "❌ indptr_last_page_len" in capsys.readouterr().out


def test_indptr_accepts_numpy_and_tensor_answers():
    from pinlab.paged_kv import kv_indptr, last_page_len

    assert checks03.check_indptr_last_page_len(lambda s, ps: (kv_indptr(list(s), ps), last_page_len(list(s), ps))) is True
    assert checks03.check_indptr_last_page_len(
        lambda s, ps: (kv_indptr(list(s), ps).numpy(), last_page_len(list(s), ps).numpy())) is True


def test_indptr_rejects_bad_shapes():
    assert checks03.check_indptr_last_page_len(lambda s, ps: [0]) is False
    assert checks03.check_indptr_last_page_len(lambda s, ps: None) is False


# ---- copies_correct

def test_copies_correct_accepts_solution(sol03):
    assert checks03.check_copies_correct(sol03["copies_correct"]) is True


def _cc(cond):
    return lambda w, c: [all(cond(w, c, n, m) for m in range(n + 1, len(w))) for n in range(len(c))]


@pytest.mark.parametrize("wrong", [
    _cc(lambda w, c, n, m: w[m][0] >= c[n][0]),            # compared with the copy's start: misses overlaps
    _cc(lambda w, c, n, m: w[m][0] > c[n][1]),             # strict: a write at exactly the copy's end is safe
    _cc(lambda w, c, n, m: w[m][1] >= c[n][1]),            # the write's end, not its start
    lambda w, c: [n == len(c) - 1 for n in range(len(c))],  # "only the last step is right"
    lambda w, c: [w[n][1] <= c[n][0] for n in range(len(c))],  # its own write, not the later ones
    lambda w, c: [True] * len(c),
    lambda w, c: [n < len(c) - 1 for n in range(len(c))][::-1],  # reversed
])
def test_copies_correct_rejects_wrong(wrong, capsys):
    assert checks03.check_copies_correct(wrong) is False
    assert "❌ copies_correct" in capsys.readouterr().out


# ---- min_ring_depth

def test_min_ring_depth_accepts_solution(sol04):
    assert checks04.check_min_ring_depth(sol04["min_ring_depth"]) is True


def test_min_ring_depth_accepts_numpy_integers(sol04, capsys):
    assert checks04.check_min_ring_depth(lambda w, c: np.int64(sol04["min_ring_depth"](w, c))) is True
    assert checks04.check_min_ring_depth(lambda w, c: np.int32(sol04["min_ring_depth"](w, c))) is True
    assert "✅ min_ring_depth" in capsys.readouterr().out


def _depth(cond, start=1):
    def f(w, c):
        d = start
        while d < len(w) and any(not cond(w, c, n, d) for n in range(len(w) - d)):
            d += 1
        return d
    return f


@pytest.mark.parametrize("wrong", [
    _depth(lambda w, c, n, d: w[n + d][0] >= c[n][1], start=2),     # never answers 1
    _depth(lambda w, c, n, d: w[n + d][0] >= c[n][0]),             # the copy's start
    lambda w, c: _depth(lambda w, c, n, d: w[n + d][0] >= c[n][1])(w, c) + 1,   # one too many
    lambda w, c: max(1, _depth(lambda w, c, n, d: w[n + d][0] >= c[n][1])(w, c) - 1),  # one too few
    lambda w, c: _depth(lambda w, c, n, d: n != 0 or w[d][0] >= c[0][1])(w, c),   # only step 0 checked
    lambda w, c: float(_depth(lambda w, c, n, d: w[n + d][0] >= c[n][1])(w, c)),  # a float, not an int
    _depth(lambda w, c, n, d: w[n + d][0] > c[n][1]),              # strict: a write exactly at the copy's end is safe
    lambda w, c: (lambda d: True if d == 1 else d)(_depth(lambda w, c, n, d: w[n + d][0] >= c[n][1])(w, c)),  # True, not 1
    lambda w, c: np.float64(_depth(lambda w, c, n, d: w[n + d][0] >= c[n][1])(w, c)),  # a numpy float
])
def test_min_ring_depth_rejects_wrong(wrong, capsys):
    assert checks04.check_min_ring_depth(wrong) is False
    assert "❌ min_ring_depth" in capsys.readouterr().out


# ---- stubs

@pytest.mark.parametrize("check", [checks03.check_indptr_last_page_len, checks03.check_copies_correct,
                                   checks04.check_min_ring_depth])
def test_stub_is_reported_as_not_implemented(check, capsys):
    assert check(_stub) is False
    assert "⏳" in capsys.readouterr().out


def test_solution_sources_exist():
    for stem in ("03_the_race", "04_the_fix"):
        assert (Path(ROOT) / "solutions" / "src" / f"{stem}.py").exists()
