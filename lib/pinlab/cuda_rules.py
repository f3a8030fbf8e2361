"""CUDA's rules for a learner's code run on the emulated lagging stream, where the emulation lacks them.

The checkers of exercises 05-07 (and lesson 07's harness, :func:`pinlab.lessons.l07_capstone_audit.run_loop`)
run a learner's code inside ``with CudaRules(s):``, entered inside ``with s:``. On a
:class:`pinlab.CudaStream` it does nothing: CUDA applies its rules itself. On a
:class:`pinlab.LaggingStream` it adds what a GPU would do and the emulation (``streams.py``) does not
do yet (issue 28 gives the emulation these rules; where it has one, the rule here changes nothing):

* ``device="cpu"`` in a tensor factory is host memory, always: the string ``"cpu"``, or any
  ``torch.device("cpu")`` other than the stream's own ``s.device`` object. (The emulation names its GPU
  ``torch.device("cpu")`` and takes every such factory ``device=`` for its GPU. Its ``to()`` already
  reads only ``s.device`` itself as the GPU: a factory now reads it the same way.) ``device=s.device``,
  ``device=t.device`` of a device tensor ``t`` (which is ``s.device``), a CUDA device or an int name the
  GPU, as before.
* Pinned memory asked for on the GPU is refused with torch's own error, :data:`PIN_ON_GPU_ERROR`:
  ``torch.empty_like(gpu_tensor, pin_memory=True)`` (a ``*_like`` or ``gpu_tensor.new_*`` keeps its
  source's device), ``torch.zeros(..., device=s.device, pin_memory=True)``. CUDA's factories refuse it
  (``aten/src/ATen/cuda/EmptyTensor.cpp``, ``empty_cuda`` and ``empty_strided_cuda``:
  ``TORCH_CHECK(!pin_memory_opt.has_value() || !*pin_memory_opt, "Only dense CPU tensors can be pinned")``);
  the emulation hands out pinned host memory instead.
* ``torch.cuda.synchronize()`` waits for the emulated GPU (``s.synchronize()``): on a CPU-only torch it
  raises "Torch not compiled with CUDA enabled", so the checkers' own advice, "synchronize before
  returning", would crash there.
"""
from __future__ import annotations

import torch
from .streams import _tensors  # one walker over nested args
from torch.overrides import TorchFunctionMode

#: torch's error for pinned memory on a CUDA device (``empty_cuda``, ``aten/src/ATen/cuda/EmptyTensor.cpp``)
PIN_ON_GPU_ERROR = "Only dense CPU tensors can be pinned"

#: factories that allocate through ``empty_cuda`` on a GPU (so refuse ``pin_memory=True`` there) and take ``device=``
_EMPTY_FACTORIES = {"zeros", "empty", "ones", "full", "arange", "zeros_like", "empty_like", "ones_like", "full_like",
                    "rand", "randn", "randint", "randperm", "linspace", "logspace", "empty_strided", "eye",
                    "rand_like", "randn_like", "randint_like", "range", "new_empty", "new_zeros", "new_ones", "new_full",
                    "new_empty_strided"}
#: factories that copy their data argument: with ``device="cpu"`` they read device data on the host
_DATA_FACTORIES = {"tensor", "as_tensor", "asarray", "new_tensor"}




class CudaRules(TorchFunctionMode):
    """``with CudaRules(s):`` inside ``with s:`` (see the module docstring)."""

    def __init__(self, stream):
        super().__init__()
        if stream is None or not hasattr(stream, "emulated") or not hasattr(stream, "synchronize"):
            raise TypeError(f"stream must be a pinlab stream (pinlab.stream(), pinlab.LaggingStream()), "
                            f"got {type(stream).__name__}")
        self.s = stream
        self._saved_sync = None
        self._active = False

    def __enter__(self):
        if not self.s.emulated:
            return self  # CUDA applies its rules itself
        if self._active:
            raise RuntimeError("this CudaRules is already active; make a new one for a nested block")
        self._saved_sync = torch.cuda.synchronize
        torch.cuda.synchronize = self._synchronize
        self._active = True
        try:
            super().__enter__()
        except BaseException:
            torch.cuda.synchronize, self._active = self._saved_sync, False
            raise
        return self

    def __exit__(self, *exc):
        if not self._active:
            return None
        try:
            return super().__exit__(*exc)
        finally:
            torch.cuda.synchronize, self._saved_sync = self._saved_sync, None
            self._active = False

    def _synchronize(self, device=None) -> None:
        """``torch.cuda.synchronize(device=None)`` on the emulated stream: the host waits for its queue."""
        self.s.synchronize()

    def names_gpu(self, device) -> bool:
        """A factory's ``device=`` names the GPU: ``s.device`` itself, a CUDA device, or an int (a CUDA
        index, as torch reads it). Any other CPU device (``"cpu"``, ``torch.device("cpu")``) is host memory."""
        if device is None:
            return False
        if device is self.s.device:
            return True
        if isinstance(device, int) and not isinstance(device, bool):
            return True
        try:
            return torch.device(device).type == "cuda"
        except (RuntimeError, TypeError, ValueError):
            return False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name not in _EMPTY_FACTORIES and name not in _DATA_FACTORIES:
            return func(*args, **kwargs)
        device = kwargs.get("device")
        inherits = (name.endswith("_like") or name.startswith("new_")) and bool(args)
        if device is not None:
            on_gpu = self.names_gpu(device)
        else:
            on_gpu = inherits and isinstance(args[0], torch.Tensor) and self.s.is_device(args[0])
        if kwargs.get("pin_memory") and on_gpu and name in _EMPTY_FACTORIES:
            raise RuntimeError(PIN_ON_GPU_ERROR)  # as CUDA's empty_cuda refuses it
        if device is None or on_gpu or kwargs.get("pin_memory"):
            return func(*args, **kwargs)  # the emulation's own answer (pinned memory is host memory there)
        try:
            host = torch.device(device).type == "cpu"
        except (RuntimeError, TypeError, ValueError):
            return func(*args, **kwargs)  # torch's own error
        if not host:
            return func(*args, **kwargs)
        # device="cpu": host memory, made past the emulation (which would take it for its GPU); a factory
        # that copies device data reads it on the host, after the GPU has run what is queued
        data = args[1:] if name.startswith("new_") else args
        reads = name in _DATA_FACTORIES and any(self.s.is_device(t) for t in _tensors((data, kwargs)))
        if reads:
            self.s.synchronize()
        with torch._C.DisableTorchFunction():
            out = func(*args, **kwargs)
            if reads and isinstance(out, torch.Tensor) and self.s.is_device(out):
                out = out.clone()  # torch.as_tensor(t, device="cpu") of device memory is a host copy, not t
        return out
