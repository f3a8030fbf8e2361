"""The stream a lesson's step loop runs on: the real CUDA stream, or an emulated one that lags behind.

The lessons' loops are plain torch code::

    with pinlab.stream() as s:                         # CUDA on a GPU, emulated on a CPU
        host_buf = torch.zeros(64, dtype=torch.int32, pin_memory=True)
        dst = torch.zeros(steps, 64, dtype=torch.int32, device=s.device)
        for n in range(steps):
            host_buf.fill_(n)                          # the host writes step n's data
            dst[n].copy_(host_buf, non_blocking=True)  # enqueue the H2D copy
            s.busy(0.5)                                # the rest of step n's forward
        s.synchronize()

* :class:`CudaStream` is the current CUDA stream, nothing added: ``busy`` is
  :func:`pinlab.gpu_busy`, ``Event`` is ``torch.cuda.Event``.
* :class:`LaggingStream` runs the same code on a machine without a GPU, as if the GPU were far
  behind the host: device work waits in a queue and runs only when the host waits for it. While
  its ``with`` block is active, a :class:`torch.overrides.TorchFunctionMode` emulates what
  matters for host-to-device copies:

  - ``torch.zeros(..., pin_memory=True)``, ``t.pin_memory()`` and ``t.is_pinned()`` work on a
    CPU-only torch; ``pin_memory()`` of an (emulated) pinned tensor returns that same tensor, as
    torch does;
  - a tensor created with an explicit ``device=s.device`` (or ``t.to(s.device)``) is device
    memory; create host tensors *without* a device argument;
  - ``dst.copy_(src, non_blocking=True)`` into device memory is queued. From a pinned ``src`` it
    reads ``src`` when it runs (later); from a pageable ``src`` it is staged (copied) now, as the
    driver does, except that a pageable copy larger than :data:`STAGING_LIMIT` first waits for
    the queue (the driver cannot stage it: the fake ``non_blocking``). A D2H ``non_blocking`` copy
    into pinned host memory is queued too (read it only after an event); into pageable memory it
    waits;
  - in-place ops and ``out=`` ops on device memory, and :meth:`LaggingStream.launch`, are queued;
    any other op that reads device memory (``.tolist()``, ``.item()``, arithmetic, a blocking
    copy) first runs the queue: the host waits for the emulated GPU, as it would for a real one.

  The emulation is exact about *order* (what a lagging GPU would read) and says nothing about
  time: its results are labelled "emulated" wherever they are shown.
"""
from __future__ import annotations

import sys
from collections import deque

import torch
from torch.overrides import TorchFunctionMode

from .args import callable_arg, positive_number, require_cuda
from .device import has_cuda

#: A pageable non_blocking copy larger than this waits for the queue (one copy the driver's
#: staging cannot take; 2 MiB returned at once on the H200, 2.25 MiB waited).
STAGING_LIMIT = 2 * 1024 * 1024

EMULATED_LABEL = "emulated lagging stream (CPU): queued device work runs only when the host waits"


class CudaStream:
    """The current CUDA stream, with the few calls the lessons' loops use."""

    emulated = False

    def __init__(self):
        require_cuda("CudaStream()")
        self.device = torch.device("cuda")

    @property
    def label(self) -> str:
        return f"CUDA stream on {torch.cuda.get_device_name(0)}"

    def __enter__(self) -> "CudaStream":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def busy(self, ms: float) -> None:
        """Keep the GPU busy for about ``ms`` milliseconds (returns at once)."""
        from .busy import gpu_busy

        gpu_busy(ms)

    def Event(self):  # noqa: N802 - mirrors torch.cuda.Event
        return torch.cuda.Event()

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def launch(self, fn, *args, **kwargs):
        """Device-side work: on CUDA simply ``fn(*args, **kwargs)`` (its kernels are enqueued)."""
        callable_arg("fn", fn)
        return fn(*args, **kwargs)

    def pinned_bytes(self) -> int:
        """Bytes of page-locked memory the caching host allocator holds (in use or cached)."""
        from .hostmem import pinned_bytes_held

        return pinned_bytes_held()

    def host_stats(self) -> dict:
        from .hostmem import host_stats

        return host_stats()

    def release(self) -> None:
        """Synchronize, then give cached pinned blocks back to the driver."""
        from .hostmem import release_cached_host_blocks

        release_cached_host_blocks()


class _LaggingEvent:
    """An event on a :class:`LaggingStream`: ``record()`` marks the queue, ``synchronize()`` runs
    the queue up to the mark, ``query()`` says whether the mark has been reached."""

    def __init__(self, stream: "LaggingStream"):
        self._stream = stream
        self._mark = None

    def record(self, stream=None) -> None:
        self._mark = object()
        self._stream._queue.append(self._mark)

    def synchronize(self) -> None:
        if self._mark is not None:
            self._stream._run_until(self._mark)

    def wait(self, stream=None) -> None:
        return None  # one emulated stream: everything is already in order

    def query(self) -> bool:
        return self._mark is None or self._mark not in self._stream._queue


# Ops that only look at metadata or make views: they never wait for the emulated GPU.
_NO_DATA = {
    "__getitem__", "view", "view_as", "reshape", "narrow", "select", "t", "T", "mT", "permute",
    "transpose", "unsqueeze", "squeeze", "flatten", "unflatten", "expand", "expand_as", "as_strided",
    "unbind", "split", "chunk", "unfold", "detach", "size", "dim", "numel", "stride", "storage_offset",
    "is_contiguous", "data_ptr", "untyped_storage", "element_size", "nelement", "__len__", "shape",
    "dtype", "device", "is_cuda", "layout", "requires_grad", "is_leaf", "grad_fn", "_base", "ndim",
    "is_floating_point", "is_complex", "__hash__", "names", "nbytes", "itemsize", "is_pinned", "__get__",
}
_FACTORIES = {"zeros", "empty", "ones", "full", "arange", "tensor", "as_tensor", "zeros_like", "empty_like",
              "ones_like", "full_like", "rand", "randn", "randint", "randperm", "linspace", "empty_strided",
              "eye", "rand_like", "randn_like"}


def _name(func) -> str:
    return getattr(func, "__name__", str(func))


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


class _Mode(TorchFunctionMode):
    def __init__(self, stream: "LaggingStream"):
        super().__init__()
        self.s = stream

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        s = self.s
        if s._draining:
            return func(*args, **kwargs)
        name = _name(func)
        if name in ("pin_memory",) and args and isinstance(args[0], torch.Tensor):
            return s._pin_memory(args[0])
        if name == "is_pinned" and args and isinstance(args[0], torch.Tensor):
            return s.is_pinned(args[0])
        if name in _FACTORIES and ("pin_memory" in kwargs or "device" in kwargs):
            return s._factory(func, args, kwargs)
        if name == "copy_" and len(args) >= 2:
            return s._copy(args[0], args[1], bool(kwargs.get("non_blocking", False)))
        if name == "to" and args and isinstance(args[0], torch.Tensor):
            return s._to(func, args, kwargs)
        if name in ("cuda", "cpu") and args and isinstance(args[0], torch.Tensor):
            return s._to(func, (args[0], s.device if name == "cuda" else torch.device("cpu")), kwargs)
        touched = [t for t in _tensors((args, kwargs)) if s.is_device(t)]
        if not touched:
            return func(*args, **kwargs)
        gather = name == "__getitem__" and any(isinstance(t, torch.Tensor) for t in _tensors(args[1:]))
        if name in _NO_DATA and not gather:
            out = func(*args, **kwargs)
            views = {s._key(t) for t in touched}
            if any(isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() and s._key(t) not in views
                   for t in _tensors(out)):
                # a reshape/flatten that had to copy read device memory: wait for the queue, redo it
                s.synchronize()
                with s._drain():
                    out = func(*args, **kwargs)
                for t in _tensors(out):
                    s._register(s._device, t)
            return out
        if name.endswith("_like"):  # a new tensor on the same (emulated) device: no data read
            return s._register(s._device, func(*args, **kwargs))
        if name == "__setitem__" and s.is_device(args[0]):
            value = args[2] if len(args) > 2 else None
            if isinstance(value, torch.Tensor) and not s.is_device(value):
                s.synchronize()  # gpu_t[i] = cpu_t is a blocking copy
                with s._drain():
                    return func(*args, **kwargs)
            s._queue.append(lambda: func(*args, **kwargs))
            return None
        inplace = name.endswith("_") and not name.startswith("__")
        if inplace and s.is_device(args[0]) or "out" in kwargs:
            s._queue.append(lambda: func(*args, **kwargs))  # device work, in stream order
            return kwargs["out"] if "out" in kwargs else args[0]
        s.synchronize()  # the host needs a value computed from device memory: it waits
        with s._drain():
            out = func(*args, **kwargs)
        for t in _tensors(out):
            s._register(s._device, t)
        return out


class LaggingStream:
    """A CPU stand-in for a CUDA stream that lags far behind the host (see the module docstring).

    Use it as a context manager; :func:`stream` returns one on a machine without CUDA. Leaving the
    ``with`` block runs whatever is still queued.
    """

    emulated = True
    label = EMULATED_LABEL

    def __init__(self):
        self.device = torch.device("cpu")
        self._queue: deque = deque()
        self._device: dict[int, torch.Tensor] = {}   # storage data_ptr -> a tensor holding it
        self._pinned: dict[int, torch.Tensor] = {}
        self._draining = False
        self._mode = None

    # --- the context ------------------------------------------------------------------------
    def __enter__(self) -> "LaggingStream":
        if self._mode is not None:
            raise RuntimeError("this LaggingStream is already active; make a new one for a nested block")
        self._mode = _Mode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        try:
            if exc[0] is None:
                self.synchronize()
        finally:
            mode, self._mode = self._mode, None
            mode.__exit__(*exc)

    # --- the calls the lessons use ----------------------------------------------------------
    def busy(self, ms: float) -> None:
        """The emulated GPU is always behind: nothing to add (``ms`` is checked, then ignored)."""
        positive_number("ms", ms)

    def Event(self):  # noqa: N802 - mirrors torch.cuda.Event
        return _LaggingEvent(self)

    def synchronize(self) -> None:
        """Run everything queued (the host waits for the emulated GPU)."""
        self._run_until(None)

    def launch(self, fn, *args, **kwargs):
        """Queue device-side work: ``fn(*args, **kwargs)`` runs in stream order, later. Returns None."""
        callable_arg("fn", fn)
        self._queue.append(lambda: fn(*args, **kwargs))

    def pinned_bytes(self) -> int:
        """Bytes of emulated pinned memory still referenced by the program."""
        self._prune()
        return sum(t.untyped_storage().nbytes() for t in self._pinned.values())

    def host_stats(self) -> dict:
        return {}

    def release(self) -> None:
        self.synchronize()
        self._prune()

    def pending(self) -> int:
        """How many queued items (copies, kernels, event marks) have not run yet."""
        return len(self._queue)

    # --- memory kinds -----------------------------------------------------------------------
    @staticmethod
    def _key(t: torch.Tensor) -> int:
        return t.untyped_storage().data_ptr()

    def _register(self, table: dict, t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().nbytes():
            table[self._key(t)] = t
        return t

    def is_device(self, t: torch.Tensor) -> bool:
        return isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > 0 and self._key(t) in self._device

    def is_pinned(self, t: torch.Tensor) -> bool:
        return isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > 0 and self._key(t) in self._pinned

    def _prune(self) -> None:
        """Forget pinned blocks nobody references any more (a freed snapshot), so that a new
        allocation at the same address is not taken for pinned memory."""
        for key in list(self._pinned):
            t = self._pinned[key]
            # forget it when nobody else holds the tensor (only the dict, `t` and the argument) and
            # nobody else uses its storage (only the dict's tensor and the temporary storage object):
            # a parameter given it with `p.data = pinned` shares the storage, not the tensor object
            use_count = getattr(torch._C, "_storage_Use_Count", None)
            if sys.getrefcount(t) <= 3 and (use_count is None or use_count(t.untyped_storage()._cdata) <= 2):
                del self._pinned[key]

    # --- the queue --------------------------------------------------------------------------
    class _Drain:
        def __init__(self, s):
            self.s, self.prev = s, None

        def __enter__(self):
            self.prev, self.s._draining = self.s._draining, True

        def __exit__(self, *exc):
            self.s._draining = self.prev

    def _drain(self):
        return LaggingStream._Drain(self)

    def _run_until(self, mark) -> None:
        with self._drain():
            while self._queue:
                item = self._queue.popleft()
                if item is mark:
                    return
                if callable(item):
                    item()
        self._prune()

    # --- intercepted torch calls ------------------------------------------------------------
    def _is_our_device(self, device) -> bool:
        """An explicit ``device=`` names the emulated GPU: ``s.device``, or any CUDA device."""
        if device is None:
            return False
        d = torch.device(device)
        return d.type == "cuda" or d == self.device

    def _factory(self, func, args, kwargs):
        pin = bool(kwargs.pop("pin_memory", False))
        dev = kwargs.get("device")
        on_device = self._is_our_device(dev) and not pin
        if dev is not None and (pin or on_device):
            kwargs["device"] = "cpu"  # the emulated GPU's memory is host memory
        with self._drain():
            out = func(*args, **kwargs)
        if pin:
            return self._register(self._pinned, out)
        if on_device:
            return self._register(self._device, out)
        return out

    def _pin_memory(self, t: torch.Tensor) -> torch.Tensor:
        if self.is_pinned(t):
            return t  # torch does the same: no copy, the same storage
        if self.is_device(t):
            raise RuntimeError("cannot pin a tensor that lives on the (emulated) GPU")
        with self._drain():
            out = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype).copy_(t)
        return self._register(self._pinned, out)

    def _copy(self, dst: torch.Tensor, src, non_blocking: bool):
        if not isinstance(src, torch.Tensor):
            with self._drain():
                return dst.copy_(src, non_blocking=non_blocking)
        d_dev, s_dev = self.is_device(dst), self.is_device(src)
        if not d_dev and not s_dev:  # host to host: a memcpy, now
            with self._drain():
                return dst.copy_(src)
        if d_dev and not s_dev:  # H2D
            if non_blocking and self.is_pinned(src):
                self._queue.append(lambda: dst.copy_(src))  # the DMA reads src when it runs
                return dst
            if non_blocking and src.numel() * src.element_size() <= STAGING_LIMIT:
                with self._drain():
                    staged = src.clone()  # the driver stages a small pageable copy at the call
                self._queue.append(lambda: dst.copy_(staged))
                return dst
            self.synchronize()  # a blocking copy (or one the staging cannot take) waits
            with self._drain():
                return dst.copy_(src)
        if s_dev and not d_dev:  # D2H
            if non_blocking and self.is_pinned(dst):
                self._queue.append(lambda: dst.copy_(src))  # valid only after an event
                return dst
            self.synchronize()
            with self._drain():
                return dst.copy_(src)
        self._queue.append(lambda: dst.copy_(src))  # device to device: a kernel, in order
        return dst

    def _to(self, func, args, kwargs):
        t = args[0]
        target = kwargs.get("device")
        rest = list(args[1:])
        if target is None and rest and isinstance(rest[0], (str, int, torch.device)):
            target = rest.pop(0)
            target = torch.device("cuda", target) if isinstance(target, int) else target
        dtype = kwargs.get("dtype")
        if dtype is None and rest and isinstance(rest[0], torch.dtype):
            dtype = rest[0]
        non_blocking = bool(kwargs.get("non_blocking", False))
        if target is None:  # a dtype conversion on the same side
            if self.is_device(t):
                self.synchronize()
            with self._drain():
                out = func(*args, **kwargs)
            return self._register(self._device, out) if self.is_device(t) else out
        to_device = self._is_our_device(target) and not self.is_device(t)
        dtype = dtype or t.dtype
        if to_device:
            with self._drain():
                out = torch.empty(t.shape, dtype=dtype)
            self._register(self._device, out)
            self._copy(out, t, non_blocking)
            return out
        if self.is_device(t):  # to the host
            with self._drain():
                out = torch.empty(t.shape, dtype=dtype)
            if non_blocking:  # torch allocates the result pinned
                self._register(self._pinned, out)
            self._copy(out, t, non_blocking)
            return out
        with self._drain():
            return func(*args, **kwargs) if torch.device(target).type == "cpu" else t


def stream():
    """The stream a lesson's loop should use here: :class:`CudaStream` where CUDA is available,
    otherwise a new :class:`LaggingStream` (emulated; say so wherever its results are shown)."""
    return CudaStream() if has_cuda() else LaggingStream()
