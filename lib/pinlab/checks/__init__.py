"""Exercise checkers: each runs the learner's function on cases and compares with a reference.

A checker prints one verdict line and returns True or False:

* ``⏳ ... not implemented yet`` when the stub still raises ``NotImplementedError``;
* ``❌ ...`` with the first failing case (arguments, what came back, what was expected; long
  lists and tensors are summarised: length or shape, first and last values, and the first
  entry where the answer differs), followed by ``💡 Hint: ...`` from the second failure of the
  same checker on, when the checker gives a hint;
* ``✅ ...`` when every case passes.

Lesson checkers (``checks/lNN.py``) call :func:`run_cases`; their compare functions can use
:func:`as_int` / :func:`same_int` so that a numpy or tensor integer counts as the int it is.
``tests/test_checks_lNN.py`` proves each checker accepts the solution and rejects planted
wrong answers.
"""
from __future__ import annotations

import copy
import math
import numbers

from ..args import callable_arg, text_arg

#: Failures so far per checker name (reset when it passes): the hint shows from the second on.
_FAILURES: dict[str, int] = {}

_SHOW = 3  # first and last values shown of a long list or tensor


def as_int(value) -> int:
    """``value`` as a Python int: an int, a numpy integer, or a one-element integer tensor/array.

    A bool, a float (even 5.0) or anything else is a TypeError: the answer should be a count.
    """
    if isinstance(value, bool):
        raise TypeError(f"expected an int, got a bool ({value!r})")
    if isinstance(value, numbers.Integral):
        return int(value)
    dtype = getattr(value, "dtype", None)
    if dtype is not None and hasattr(value, "item") and _numel(value) == 1:
        is_float = getattr(dtype, "is_floating_point", None)
        kind = getattr(dtype, "kind", None)  # numpy
        if kind in ("i", "u") or (is_float is False and not getattr(dtype, "is_complex", False)
                                  and str(dtype) != "torch.bool"):
            return int(value.item())
    raise TypeError(f"expected an int, got {type(value).__name__} ({_summary(value)})")


def same_int(got, expected) -> bool:
    """True when ``got`` is an integer (Python, numpy or a one-element tensor) equal to ``expected``."""
    try:
        return as_int(got) == expected
    except TypeError:
        return False


def _numel(value) -> int:
    n = getattr(value, "numel", None)
    if callable(n):
        return int(n())
    return int(getattr(value, "size", 0))


def _number(value):
    """A float for a real number (Python, numpy, one-element tensor), None for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Real):
        return float(value)
    if hasattr(value, "dtype") and hasattr(value, "item") and _numel(value) == 1:
        item = value.item()
        if isinstance(item, numbers.Real) and not isinstance(item, bool):
            return float(item)
    return None


def _close(a, b, rel=1e-6) -> bool:
    """Numbers within ``rel`` (numpy and tensor scalars count), anything else by ``==``."""
    x, y = _number(a), _number(b)
    if x is not None and y is not None:
        return math.isclose(x, y, rel_tol=rel, abs_tol=1e-12)
    if y is not None and isinstance(a, bool):
        return False  # True is not the number 1 here
    try:
        return bool(a == b)
    except Exception:  # an array's ambiguous truth value, or a broken __eq__
        return False


def _summary(value, width: int = 120, depth: int = 0) -> str:
    """``repr`` of ``value``, summarised when long: shape/length, first and last values."""
    if hasattr(value, "shape") and hasattr(value, "dtype") and hasattr(value, "tolist"):
        shape = tuple(value.shape)
        kind = type(value).__name__
        dtype = str(value.dtype).replace("torch.", "")
        if _numel(value) <= 2 * _SHOW:
            try:
                return f"{kind}({value.tolist()!r}, dtype={dtype})"
            except Exception:  # a meta tensor has no values
                return f"{kind}(shape={shape}, dtype={dtype})"
        try:
            flat = value.reshape(-1).tolist()
        except Exception:
            return f"{kind}(shape={shape}, dtype={dtype})"
        return f"{kind}(shape={shape}, dtype={dtype}: {_ends(flat, width, depth)})"
    if isinstance(value, (list, tuple)):
        text = repr(value)
        if len(text) <= width and len(value) <= 4 * _SHOW:
            return text
        return _ends(value, width, depth) + f" (len {len(value)})"
    text = repr(value)
    if len(text) > width:
        return text[: width - 20] + f"... ({len(text)} chars)"
    return text


def _ends(seq, width, depth) -> str:
    seq = list(seq)
    inner = max(24, width // 3)
    if depth >= 2:
        return f"[... {len(seq)} items]"
    parts = [_summary(v, inner, depth + 1) for v in seq[:_SHOW]]
    if len(seq) > 2 * _SHOW:
        parts.append("...")
        parts += [_summary(v, inner, depth + 1) for v in seq[-_SHOW:]]
    else:
        parts += [_summary(v, inner, depth + 1) for v in seq[_SHOW:]]
    return "[" + ", ".join(parts) + "]"


def _as_seq(value):
    if hasattr(value, "tolist") and hasattr(value, "shape") and len(getattr(value, "shape", ())) >= 1:
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return list(value)
    return None


def _difference(got, expected, args=()) -> str:
    """Where two list-like answers first differ, as ' (...)', or ''. Arguments as long as the
    answer are shown at that index too (the entries that decide it)."""
    a, b = _as_seq(got), _as_seq(expected)
    if a is None or b is None:
        return ""
    if len(a) != len(b):
        return f" (length {len(a)}, expected length {len(b)})"
    for i, (x, y) in enumerate(zip(a, b)):
        if not _close(x, y):
            at = [_as_seq(a) for a in args]
            inputs = [_summary(a[i], 60) for a in at if a is not None and len(a) == len(b)]
            where = f"; the arguments there: {', '.join(inputs)}" if inputs and len(b) > 2 * _SHOW else ""
            return f" (first difference at [{i}]: got {_summary(x, 60)}, expected {_summary(y, 60)}{where})"
    return ""


def _copy(args: tuple) -> tuple:
    try:
        return copy.deepcopy(args)
    except Exception:  # something that cannot be copied is passed as is
        return args


def fmt_args(args) -> str:
    """A call's arguments as ``(a, b, ...)``, each summarised like the verdict lines do."""
    return "(" + ", ".join(_summary(a) for a in args) + ")"


def summary(value, width: int = 120) -> str:
    """``repr(value)``, or for a long list/tensor its length or shape with its first and last values."""
    return _summary(value, width)


_fmt_args = fmt_args  # the name lesson checkers imported first


def _failed(name: str, line: str, hint: str | None) -> bool:
    print(line)
    _FAILURES[name] = _FAILURES.get(name, 0) + 1
    if hint and _FAILURES[name] >= 2:
        print(f"💡 Hint: {hint}")
    return False


def run_cases(fn, name: str, cases, reference, *, compare=_close, hint: str | None = None) -> bool:
    """Check ``compare(fn(*args), reference(*args))`` for every ``args`` in ``cases``.

    Prints one verdict line (⏳ / ❌ / ✅) and returns True or False. ``hint`` (a sentence) is
    printed after the verdict from the second failure of the checker ``name`` on. Each call of
    ``fn`` gets its own copy of the arguments, so a learner's function that changes its input
    changes neither the next case nor the arguments shown.
    """
    callable_arg("fn", fn)
    text_arg("name", name)
    callable_arg("reference", reference)
    callable_arg("compare", compare)
    if hint is not None:
        text_arg("hint", hint)
    n = 0
    for i, args in enumerate(cases):
        if not isinstance(args, (tuple, list)):
            raise TypeError(f"cases[{i}] must be a tuple of arguments, got {type(args).__name__}")
        args = tuple(args)
        expected = reference(*_copy(args))
        try:
            got = fn(*_copy(args))
        except NotImplementedError:
            print(f"⏳ {name} is not implemented yet: write it above, then re-run this cell.")
            return False
        except Exception as exc:  # the learner's bug, reported, not raised
            return _failed(name, f"❌ {name}{fmt_args(args)} raised {type(exc).__name__}: {exc}", hint)
        try:
            ok = bool(compare(got, expected))
        except Exception:  # an answer of a shape compare cannot handle is a wrong answer
            ok = False
        if not ok:
            return _failed(
                name,
                f"❌ {name}{fmt_args(args)} returned {_summary(got)}, expected {_summary(expected)}"
                f"{_difference(got, expected, args)}",
                hint,
            )
        n += 1
    _FAILURES.pop(name, None)
    print(f"✅ {name} is correct ({n} cases).")
    return True
