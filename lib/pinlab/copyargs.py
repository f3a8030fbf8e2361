"""One parser of the calls that copy a tensor: ``copy_``, ``to``, ``cuda``, ``cpu``, ``_to_copy`` and
``__setitem__``, in every form torch accepts, positional and keyword.

The stall detector, the race detector, lesson 06's and lesson 07's audits, the checkers and the emulated
stream read a copy call through :func:`copy_call` (or its parts, :func:`to_args` and :func:`cuda_args`). There
were five parsers; one of them read ``non_blocking`` from keywords only, so ``x.to(dev, torch.float32, True)``
was audited as a blocking copy (issue 31). The forms, from torch's own signatures
(``torch/_tensor_docs.py``, ``Tensor.to``, ``Tensor.cuda``, ``Tensor.copy_``):

* ``to(device=None, dtype=None, non_blocking=False, copy=False, memory_format=...)``,
  ``to(dtype, non_blocking=False, copy=False, ...)`` and ``to(other, non_blocking=False, copy=False)``;
* ``cuda(device=None, non_blocking=False, memory_format=...)``; ``cpu(memory_format=...)``;
* ``copy_(src, non_blocking=False)``; ``_to_copy(*, dtype, layout, device, pin_memory, non_blocking,
  memory_format)`` (keyword only: what ``to`` dispatches as); ``dst[index] = value`` (never non-blocking).

A leaf module: it imports torch only, so every other module may import it (tests/test_import_graph.py).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

__all__ = ["CopyCall", "copy_call", "cuda_args", "device_type", "parse_to_args", "to_args"]

#: the names :func:`copy_call` reads
COPY_NAMES = ("copy_", "to", "cuda", "cpu", "_to_copy", "__setitem__")


class CopyCall(NamedTuple):
    """A copy call, read. ``src``: the tensor read (``copy_``'s ``src``, ``to``/``cuda``/``cpu``'s self,
    setitem's value, which may be a Python number); ``dst``: the tensor written (``copy_``'s and setitem's
    self; None for ``to``/``cuda``/``cpu``/``_to_copy``, whose result is known only after the call);
    ``device``: the target as given (None: no device named, the source's side); ``dtype``: the target
    dtype, or None; ``non_blocking`` and ``copy`` as passed."""

    name: str
    src: Any
    dst: Any
    device: Any
    dtype: torch.dtype | None
    non_blocking: bool
    copy: bool = False


def device_type(device) -> str | None:
    """'cuda' for 'cuda:1', torch.device('cuda', 1) or 1; None for None or what names no device."""
    if device is None:
        return None
    if isinstance(device, torch.device):
        return device.type
    if isinstance(device, str):
        return device.split(":", 1)[0]
    if isinstance(device, int) and not isinstance(device, bool):
        return "cuda"  # torch reads a bare index as a CUDA device
    try:
        return torch.device(device).type
    except (TypeError, RuntimeError, ValueError):
        return None


def to_args(rest, kwargs) -> tuple[Any, torch.dtype | None, bool, bool]:
    """``(device, dtype, non_blocking, copy)`` of ``t.to(*rest, **kwargs)`` (``rest``: the arguments after
    self) in its three forms; ``to(other)`` gives ``other``'s device and dtype."""
    kwargs = kwargs or {}
    device, dtype = kwargs.get("device"), kwargs.get("dtype")
    other = kwargs.get("other", kwargs.get("tensor"))
    rest = tuple(rest)
    if rest:
        first = rest[0]
        if isinstance(first, torch.Tensor):
            other, rest = first, rest[1:]
        elif isinstance(first, torch.dtype):
            dtype, rest = first, rest[1:]
        else:
            device, rest = first, rest[1:]
            if rest and (rest[0] is None or isinstance(rest[0], torch.dtype)):
                dtype, rest = rest[0], rest[1:]
    if other is not None:
        device, dtype = other.device, other.dtype
    non_blocking = bool(rest[0]) if rest else bool(kwargs.get("non_blocking", False))
    copy = bool(rest[1]) if len(rest) > 1 else bool(kwargs.get("copy", False))
    return device, dtype, non_blocking, copy


def cuda_args(rest, kwargs) -> tuple[Any, bool]:
    """``(device, non_blocking)`` of ``t.cuda(*rest, **kwargs)``; the device is ``"cuda"`` (the current
    one) where none is named."""
    kwargs = kwargs or {}
    vals = dict(zip(("device", "non_blocking"), rest))
    vals.update(kwargs)
    device = vals.get("device")
    return ("cuda" if device is None else device), bool(vals.get("non_blocking", False))


def parse_to_args(rest, kwargs) -> tuple[str | None, torch.dtype | None, bool]:
    """``(target device type or None, dtype or None, non_blocking)`` of ``t.to(*rest, **kwargs)``."""
    device, dtype, non_blocking, _ = to_args(rest, kwargs)
    return device_type(device), dtype, non_blocking


def copy_call(name: str, args, kwargs=None) -> CopyCall | None:
    """The copy call ``name(*args, **kwargs)`` (``args`` with self first) read, or None when it is not one
    (another name, no tensor self, ``copy_`` without a source)."""
    kwargs = kwargs or {}
    if name not in COPY_NAMES or not args:
        return None
    self = args[0]
    if name == "_to_copy":
        return CopyCall(name, self, None, kwargs.get("device"), kwargs.get("dtype"),
                        bool(kwargs.get("non_blocking", False)), True) if isinstance(self, torch.Tensor) else None
    if not isinstance(self, torch.Tensor):
        return None
    if name == "copy_":
        src = args[1] if len(args) > 1 else kwargs.get("src")
        if src is None:
            return None
        non_blocking = bool(args[2]) if len(args) > 2 else bool(kwargs.get("non_blocking", False))
        return CopyCall(name, src, self, None, None, non_blocking)
    if name == "__setitem__":
        if len(args) < 3:
            return None
        return CopyCall(name, args[2], self, None, None, False)
    if name == "to":
        device, dtype, non_blocking, copy = to_args(args[1:], kwargs)
        return CopyCall(name, self, None, device, dtype, non_blocking, copy)
    if name == "cuda":
        device, non_blocking = cuda_args(args[1:], kwargs)
        return CopyCall(name, self, None, device, None, non_blocking)
    return CopyCall(name, self, None, "cpu", None, False)  # cpu(memory_format=...)
