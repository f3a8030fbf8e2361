"""Comparing answers by their type first, then their value (no learner object's ``__eq__`` decides), and
showing them: long lists and tensors summarised by length or shape, first and last values, and the first
entry where the answer differs. Part of the checkers' core (:mod:`pinlab.checks`), with :mod:`.guard` and
:mod:`.verdict`.
"""
from __future__ import annotations

import copy
import math
import numbers

import torch

from .guard import LearnerStop, learner_call

_SHOW = 3  # first and last values shown of a long list or tensor

# =============================================================================================
# Comparing answers: the type first, then the value; no learner object's __eq__ decides
# =============================================================================================


def _is_array(value) -> bool:
    """A torch tensor or a numpy array/scalar (the only objects whose .item()/.tolist() we trust)."""
    return isinstance(value, torch.Tensor) or type(value).__module__.partition(".")[0] == "numpy"


def as_int(value) -> int:
    """``value`` as a Python int: an int, a numpy integer, or a one-element integer tensor/array.

    A bool, a float (even 5.0) or anything else is a TypeError: the answer should be a count.
    """
    if isinstance(value, bool):
        raise TypeError(f"expected an int, got a bool ({value!r})")
    if isinstance(value, numbers.Integral):
        return int(value)  # an exact int, whatever the learner's class says
    dtype = getattr(value, "dtype", None) if _is_array(value) else None
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


def int_list(value) -> list[int]:
    """A learner's list of integers (list, tuple, numpy array or tensor; whole floats count) as a
    list of Python ints; TypeError for anything else (a bool, a non-whole number, another object)."""
    if _is_array(value) and len(getattr(value, "shape", ())) >= 1:
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"expected a list of ints, got {type(value).__name__}")
    out = []
    for x in value:
        if isinstance(x, bool) or not isinstance(x, numbers.Real):
            raise TypeError(f"expected an int, got {type(x).__name__}")
        f = float(x)
        if not f.is_integer():
            raise TypeError(f"expected an int, got {f!r}")
        out.append(int(x) if isinstance(x, numbers.Integral) else int(f))
    return out


def same_tensor(got, expected, *, rtol: float | None = None, atol: float = 0.0) -> bool:
    """``got`` is a tensor of ``expected``'s shape equal to it (``rtol``: close instead); a tensor
    subclass's ``__torch_function__`` does not decide (torch function modes still see the call)."""
    if not isinstance(got, torch.Tensor):
        return False
    with torch._C.DisableTorchFunctionSubclass():
        if tuple(got.shape) != tuple(expected.shape):
            return False
        if rtol is None:
            return bool(torch.equal(got, expected))
        return bool(torch.allclose(got, expected, rtol=rtol, atol=atol))


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
        try:
            return float(value)  # an exact float, whatever the learner's class says
        except Exception:
            return None
    if _is_array(value) and hasattr(value, "item") and _numel(value) == 1:
        item = value.item()
        if isinstance(item, numbers.Real) and not isinstance(item, bool):
            return float(item)
    return None


def _seq(value):
    """A list-like answer (list, tuple, 1-d+ tensor or array) as a list, anything else None."""
    if isinstance(value, (list, tuple)):
        return list(value)
    if _is_array(value) and hasattr(value, "tolist") and len(getattr(value, "shape", ())) >= 1:
        return value.tolist()
    return None


def _close(a, b, rel=1e-6) -> bool:
    """``a`` (the learner's answer) matches ``b`` (the reference's): the type first, then the value.

    Numbers within ``rel`` (numpy and tensor scalars count; a bool is not a number); ``None`` only
    by ``None``; lists and tuples entry by entry (a list, tuple, tensor or array of the same length);
    a tensor by :func:`same_tensor`; anything else must be an instance of the reference's type, and
    the reference's type's ``__eq__`` decides. No learner object's ``__eq__`` is ever called
    (``unittest.mock.ANY`` equals nothing here)."""
    y = _number(b)
    if y is not None:
        x = _number(a)
        return x is not None and math.isclose(x, y, rel_tol=rel, abs_tol=1e-12)
    if b is None:
        return a is None
    if isinstance(b, bool):
        return (isinstance(a, bool) or type(a).__name__ in ("bool_", "bool") and _is_array(a)) and bool(a) is b
    if isinstance(b, torch.Tensor):
        return same_tensor(a, b)
    if isinstance(b, (list, tuple)):
        seq = _seq(a)
        return seq is not None and len(seq) == len(b) and all(_close(x, y, rel) for x, y in zip(seq, b))
    if isinstance(b, dict):
        return (isinstance(a, dict) and len(a) == len(b) and all(k in b for k in a)
                and all(_close(a[k], b[k], rel) for k in b))
    try:
        return isinstance(a, type(b)) and type(b).__eq__(b, a) is True
    except Exception:  # a broken __eq__
        return False


# =============================================================================================
# Showing answers
# =============================================================================================


def _repr(value, width: int) -> str:
    """``repr(value)``; for an object of the learner's (not a builtin), bounded in time, and
    ``<TypeName object>`` when its repr fails."""
    if _plain(value) or _is_array(value):
        text = repr(value)
    else:
        try:
            with learner_call("repr() of your answer", 5.0):
                text = repr(value)
            if not isinstance(text, str):
                raise TypeError
        except (Exception, LearnerStop):
            text = f"<{type(value).__name__} object>"
    if len(text) > width:
        return text[: width - 20] + f"... ({len(text)} chars)"
    return text


def _summary(value, width: int = 120, depth: int = 0) -> str:
    """``repr`` of ``value``, summarised when long: shape/length, first and last values."""
    if _is_array(value) and hasattr(value, "shape") and hasattr(value, "dtype") and hasattr(value, "tolist"):
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
    if type(value) in (list, tuple):
        if _plain(value):
            text = repr(value)
        elif len(value) <= 4 * _SHOW and depth < 2:  # an object of the learner's inside: each one summarised
            text = ", ".join(_summary(v, width, depth + 1) for v in value)
            text = f"[{text}]" if isinstance(value, list) else f"({text}{',' if len(value) == 1 else ''})"
        else:
            text = None
        if text is not None and len(text) <= width and len(value) <= 4 * _SHOW:
            return text
        return _ends(value, width, depth) + f" (len {len(value)})"
    return _repr(value, width)


_PLAIN = (int, float, complex, str, bytes, bool, type(None))


def _plain(value, depth: int = 0) -> bool:
    """Made of builtin scalars, lists, tuples and dicts only (its repr runs no learner code)."""
    if type(value) in _PLAIN:
        return True
    if depth > 8:
        return False
    if type(value) in (list, tuple):
        return all(_plain(v, depth + 1) for v in value)
    if type(value) is dict:
        return all(_plain(k, depth + 1) and _plain(v, depth + 1) for k, v in value.items())
    return False


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


def _difference(got, expected, args=()) -> str:
    """Where two list-like answers first differ, as ' (...)', or ''. Arguments as long as the
    answer are shown at that index too (the entries that decide it)."""
    a, b = _seq(got), _seq(expected)
    if a is None or b is None:
        return ""
    if len(a) != len(b):
        return f" (length {len(a)}, expected length {len(b)})"
    for i, (x, y) in enumerate(zip(a, b)):
        if not _close(x, y):
            at = [_seq(a) for a in args]
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
