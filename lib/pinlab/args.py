"""Argument checks shared by every pinlab function: clear errors that say what to do."""
from __future__ import annotations

import numbers


class CudaUnavailableError(RuntimeError):
    """Raised by a GPU-only pinlab call on a machine where CUDA is not available."""


def positive_int(name: str, value, *, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    value = int(value)
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return value


def positive_number(name: str, value, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} ({value!r})")
    value = float(value)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be finite, got {value}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return value


def size_list(name: str, values) -> list[int]:
    """A non-empty list of positive byte counts."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{name} must be a list of ints (byte counts), got {type(values).__name__}")
    out = [positive_int(f"{name}[{i}]", v) for i, v in enumerate(values)]
    if not out:
        raise ValueError(f"{name} must not be empty: give at least one size in bytes")
    return out


def one_of(name: str, value, choices) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {sorted(choices)}, got {value!r}")
    return value


def callable_arg(name: str, value):
    if not callable(value):
        raise TypeError(f"{name} must be callable (a function of no arguments), got {type(value).__name__}")
    return value


def require_cuda(what: str) -> None:
    """Raise a one-sentence CudaUnavailableError unless CUDA can be used."""
    from .device import has_cuda

    if not has_cuda():
        raise CudaUnavailableError(
            f"{what} needs a CUDA GPU, and none is available here "
            "(on a CPU-only machine the notebooks replay the recorded GPU run instead)."
        )
