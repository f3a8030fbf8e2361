"""Honest host-to-device copies: stage into pinned memory, then copy with ``non_blocking``.

Two tools, for two situations:

* :func:`async_tensor_h2d` (after vLLM's helper, ``vllm/utils/torch_utils.py``): you have *host
  data* (a Python list, a numpy array, a CPU tensor) and want it on the GPU now, without the host
  waiting. It stages the data in a pinned, contiguous host tensor and returns
  ``pinned.to(device, non_blocking=True)``: a new GPU tensor. The staging tensor is fresh unless the
  data already is a pinned, contiguous tensor of the right dtype, which is used as it is. vLLM 0.29
  does the same: it calls ``data.pin_memory()``, which copies a pageable tensor into a fresh pinned
  one and returns an already pinned tensor itself (docs/facts.md F1, F11).
* :func:`pin_snapshot`: you copy into a GPU buffer of your own (``gpu_buf[:n].copy_(...,
  non_blocking=True)``, the FlashInfer metadata pattern in vLLM 0.29) from a host buffer that
  you *reuse* every step. Copy from ``pin_snapshot(host_buf[:n])``: the snapshot is private to
  this copy, so step N+1 may rewrite ``host_buf`` while step N's copy is still pending.

Why a fresh pinned tensor: a ``non_blocking`` copy from *pageable* memory is staged by the
driver and returns at once only while the driver stages it (the "fake non_blocking" when it
waits: above a size, or once its staging pool fills; lesson 02); from
a *reused pinned* buffer it is truly asynchronous, so the GPU may read the buffer after the
host has already refilled it (the race: 199 of 200 steps wrong on the H200). A fresh block
from PyTorch's caching host allocator is not handed out again until the copy that used it has
completed (the allocator records an event on the stream: docs/facts.md F4), so it is both
asynchronous and race-free.

The trap: ``t.pin_memory()`` of a tensor that is already pinned (or a view of pinned memory)
returns ``t`` itself, the same storage: no snapshot, the race stays. :func:`pin_snapshot`
copies in that case. And ``t.pin_memory()`` keeps ``t``'s strides, so the "snapshot" of a
non-contiguous view is a non-contiguous pinned tensor, whose ``non_blocking`` copy into a
contiguous buffer stalls again; :func:`pin_snapshot` makes a contiguous copy there too.
"""
from __future__ import annotations

import warnings

import numpy as np
import torch

from .device import has_cuda, require_cuda

#: How :func:`pin_snapshot` makes its copy, by (is_pinned, is_contiguous).
PIN_MEMORY = "t.pin_memory()"
EMPTY_COPY = "torch.empty(..., pin_memory=True).copy_(t)"


# --- pure logic (testable without a GPU) -----------------------------------------------------


def snapshot_method(is_pinned: bool, is_contiguous: bool) -> str:
    """How to take a private, contiguous, pinned copy of a CPU tensor.

    ``t.pin_memory()`` only for a pageable contiguous tensor; otherwise (already pinned, where
    ``pin_memory()`` would return ``t`` itself; or non-contiguous, where it would keep the
    gaps) ``torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)``.
    """
    for name, value in (("is_pinned", is_pinned), ("is_contiguous", is_contiguous)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__} ({value!r})")
    return PIN_MEMORY if (not is_pinned and is_contiguous) else EMPTY_COPY


def _check_dtype(dtype):
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be None or a torch.dtype such as torch.int32, "
                        f"got {type(dtype).__name__} ({dtype!r})")


def _check_data(data):
    """TypeError/ValueError unless ``data`` is a list/tuple, a numpy array or a CPU tensor."""
    if isinstance(data, torch.Tensor):
        if data.device.type != "cpu":
            raise ValueError(f"data is already on {data.device}; async_tensor_h2d copies host data "
                             f"(a list, a numpy array or a CPU tensor) to the GPU")
        return
    if isinstance(data, (list, tuple, np.ndarray)):
        return
    raise TypeError(f"data must be a Python list, a numpy array or a CPU torch.Tensor, "
                    f"got {type(data).__name__}")


def cuda_device(device) -> torch.device:
    """``device`` as a ``torch.device`` of type cuda; TypeError/ValueError otherwise."""
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise TypeError(f"device must be a CUDA device such as 'cuda', 'cuda:0', 0 or torch.device('cuda'), "
                        f"got {type(device).__name__} ({device!r})")
    try:
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise ValueError(f"device must be a CUDA device such as 'cuda' or 'cuda:0', got {device!r}") from exc
    if dev.type != "cuda":
        raise ValueError(f"device must be a CUDA device such as 'cuda' or 'cuda:0', got {device!r} "
                         f"(async_tensor_h2d copies host data to the GPU)")
    return dev


def _tensor_from_numpy(a: np.ndarray) -> torch.Tensor:
    """A CPU tensor over ``a``'s memory (a copy only where torch cannot view it)."""
    if any(s < 0 for s in a.strides):
        a = np.ascontiguousarray(a)  # torch cannot view negative strides
    try:
        if not a.flags.writeable:
            with warnings.catch_warnings():  # we only read it, into a copy
                warnings.simplefilter("ignore", UserWarning)
                return torch.from_numpy(a)
        return torch.from_numpy(a)
    except TypeError as exc:
        raise TypeError(f"data: numpy dtype {a.dtype} has no torch equivalent ({exc})") from exc


def stage_on_host(data, dtype=None, *, pin_memory: bool = True) -> torch.Tensor:
    """The host tensor :func:`async_tensor_h2d` copies from: fresh, contiguous, of ``dtype``.

    * a list or tuple: ``torch.tensor(data, dtype=dtype, pin_memory=pin_memory)``;
    * a numpy array or a CPU tensor: ``torch.empty(shape, dtype=dtype or t.dtype,
      pin_memory=pin_memory).copy_(t)``, one host copy that also makes it contiguous and
      converts the dtype (on the host, so no conversion kernel runs on the GPU);
    * except a tensor that is already pinned, contiguous and of ``dtype``, which is returned
      as is, as vLLM does (no copy; but then *you* must not rewrite it before the copy has run:
      use :func:`pin_snapshot` for a reused buffer).

    ``pin_memory=False`` gives the same staging in pageable memory (CPU-only machines, tests).
    """
    _check_data(data)
    _check_dtype(dtype)
    if not isinstance(pin_memory, bool):
        raise TypeError(f"pin_memory must be a bool, got {type(pin_memory).__name__}")
    if isinstance(data, (list, tuple)):
        try:
            return torch.tensor(data, dtype=dtype, pin_memory=pin_memory)
        except (TypeError, ValueError, OverflowError, RuntimeError) as exc:
            msg = str(exc)
            if "overflow" in msg.lower():
                raise ValueError(f"data: a number in this list does not fit {dtype or 'int64'} ({msg})") from None
            if "infer dtype" in msg or "dimensions 'str'" in msg:
                raise TypeError(f"data must hold numbers (or nested lists of numbers), got a list with "
                                f"something else ({msg})") from None
            if "pin" in msg.lower() or "accelerator" in msg.lower() or "cuda" in msg.lower():
                raise
            raise ValueError(f"data: this list cannot become a tensor ({msg}); give a rectangular list "
                             f"of numbers") from None
    t = _tensor_from_numpy(data) if isinstance(data, np.ndarray) else data
    target = t.dtype if dtype is None else dtype
    if pin_memory and target == t.dtype and t.is_contiguous() and t.is_pinned():
        return t
    return torch.empty(t.shape, dtype=target, pin_memory=pin_memory).copy_(t)


# --- GPU calls --------------------------------------------------------------------------------


def _require_pinned_memory(what: str) -> None:
    """Return where pinned memory and H2D copies can run: CUDA, or (on a machine without CUDA)
    inside an emulated stream (``with pinlab.LaggingStream():``), which emulates both; else the
    course's one-sentence CudaUnavailableError."""
    if has_cuda():
        return
    if not torch.cuda.is_available():  # (PINLAB_FORCE_CPU on a GPU machine must not probe)
        try:
            if torch.empty(1, pin_memory=True).is_pinned():
                return  # an emulated stream is active
        except RuntimeError:  # no pinned allocator on this machine
            pass
    require_cuda(what)


def async_tensor_h2d(data, dtype=None, device="cuda") -> torch.Tensor:
    """Copy host data to the GPU without making the host wait; returns the new GPU tensor.

    ``data``: a Python list, a numpy array or a CPU tensor. ``dtype``: the result's dtype
    (``None``: inferred / kept). ``device``: a CUDA device (``"cuda"``, ``"cuda:1"``, ``1``).

    The data is staged into a pinned, contiguous host tensor (:func:`stage_on_host`): a fresh one,
    unless ``data`` already is a pinned, contiguous tensor of ``dtype``, which is used as it is, as
    vLLM 0.29's ``data.pin_memory()`` does (so then *you* must not rewrite ``data`` before the copy
    has run). Then it is copied with ``.to(device, non_blocking=True)``: truly asynchronous, and,
    from a fresh staging block, race-free because nobody else holds it. The GPU tensor is ready for
    any later work on the current stream; read it on the host only after a sync.

    When to use which: this one for host data that should become a *new* GPU tensor; for a
    copy into a GPU buffer you keep, ``gpu_buf[:n].copy_(pin_snapshot(host_buf[:n]),
    non_blocking=True)``.
    """
    _check_data(data)
    _check_dtype(dtype)
    dev = cuda_device(device)
    _require_pinned_memory("async_tensor_h2d")
    staged = stage_on_host(data, dtype, pin_memory=True)
    return staged.to(dev, non_blocking=True)


def pin_snapshot(t: torch.Tensor) -> torch.Tensor:
    """A private, pinned, contiguous copy of the CPU tensor ``t``, ready for a ``non_blocking`` copy.

    For a pageable contiguous ``t`` this is ``t.pin_memory()`` (vLLM 0.29's FlashInfer fix).
    For a ``t`` that is already pinned it is **not**: ``t.pin_memory()`` would return ``t``
    itself (same storage, so no snapshot and the race stays); a new pinned tensor is made
    instead. A non-contiguous ``t`` also gets a contiguous copy (``pin_memory()`` would keep
    its strides, and a non-contiguous pinned copy stalls). See :func:`snapshot_method`.

    Use it when you reuse a host buffer every step and copy from it into a GPU buffer of your
    own; use :func:`async_tensor_h2d` when the data should become a new GPU tensor.

    Needs CUDA, or an emulated stream (``with pinlab.LaggingStream():``) on a machine without it.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"t must be a CPU torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"t must be a CPU tensor (it is the host side of an H2D copy), got one on {t.device}")
    _require_pinned_memory("pin_snapshot")
    if snapshot_method(t.is_pinned(), t.is_contiguous()) == PIN_MEMORY:
        return t.pin_memory()
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)
