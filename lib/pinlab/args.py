"""Argument checks shared by every pinlab function: clear errors that say what to do."""
from __future__ import annotations

import numbers

from .device import CudaUnavailableError, require_cuda  # noqa: F401 - re-exported: where modules import them from

#: The largest value an int32 holds: FlashInfer's metadata arrays are int32.
INT32_MAX = 2**31 - 1


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def positive_int(name: str, value, *, allow_zero: bool = False, maximum: int | None = None) -> int:
    """``value`` as an int that is > 0 (>= 0 with ``allow_zero``) and <= ``maximum`` if given.

    Python ints and numpy integers are accepted; bools, floats and strings are not.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({_short(value)})")
    value = int(value)
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be {bound}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def positive_number(name: str, value, *, allow_zero: bool = False, maximum: float | None = None) -> float:
    """``value`` as a finite float that is > 0 (>= 0 with ``allow_zero``) and <= ``maximum`` if given."""
    value = finite_number(name, value)
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be {bound}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def finite_number(name: str, value) -> float:
    """``value`` as a finite float (ints, floats, numpy scalars); TypeError/ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} ({_short(value)})")
    try:
        value = float(value)
    except OverflowError:
        raise ValueError(f"{name} must be finite, got an int too large for a float") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def text_arg(name: str, value, *, allow_empty: bool = False) -> str:
    """``value`` as a str (non-empty unless ``allow_empty``)."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__} ({_short(value)})")
    if not value and not allow_empty:
        raise ValueError(f"{name} must not be empty")
    return value


def bool_arg(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} ({_short(value)})")
    return value


def size_list(name: str, values) -> list[int]:
    """A non-empty list of positive byte counts."""
    wrong = TypeError(f"{name} must be a list of ints (byte counts), got {type(values).__name__}")
    if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__iter__"):
        raise wrong
    try:
        values = list(values)
    except TypeError:  # e.g. a 0-d tensor
        raise wrong from None
    out = [positive_int(f"{name}[{i}]", v) for i, v in enumerate(values)]
    if not out:
        raise ValueError(f"{name} must not be empty: give at least one size in bytes")
    return out


def one_of(name: str, value, choices) -> str:
    try:
        known = value in choices
    except TypeError:  # an unhashable value against a set
        known = False
    if not known:
        raise ValueError(f"{name} must be one of {sorted(choices)}, got {value!r}")
    return value


def callable_arg(name: str, value, *, no_args: bool = False):
    """``value`` itself when callable, else TypeError ``"<name> must be callable (a function), got <type>"``;
    with ``no_args`` (the caller calls it as ``value()``) the message asks for "a function of no arguments"."""
    if not callable(value):
        what = "a function of no arguments" if no_args else "a function"
        raise TypeError(f"{name} must be callable ({what}), got {type(value).__name__}")
    return value
