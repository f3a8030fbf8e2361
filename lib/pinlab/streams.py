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

(Why about 1,000 lines: the emulation refuses what CUDA refuses, so that a checker's verdict on a laptop
holds on a GPU; each refusal, event and graph rule is emulated here once, for every lesson and checker.)

* :class:`CudaStream` is the current CUDA stream, nothing added: ``busy`` is
  :func:`pinlab.gpu_busy`, ``Event`` is ``torch.cuda.Event``.
* :class:`LaggingStream` runs the same code on a machine without a GPU, as if the GPU were far
  behind the host: device work waits in a queue and runs only when the host waits for it (or polls
  an event, see below). While its ``with`` block is active, a
  :class:`torch.overrides.TorchFunctionMode` emulates what matters for host-to-device copies:

  - ``torch.zeros(..., pin_memory=True)``, ``t.pin_memory()`` and ``t.is_pinned()`` work on a
    CPU-only torch; ``pin_memory()`` of an (emulated) pinned tensor returns that same tensor, as
    torch does;
  - a tensor created with an explicit ``device=s.device`` (or ``"cuda"``, or a device tensor's
    ``.device``) is device memory, and so is what ``*_like`` and ``new_*`` make from device memory
    without a ``device=``; ``device="cpu"`` is the host, always. ``t.to(s.device)``, ``t.to("cuda")``
    and ``t.cuda()`` give device memory (``t`` itself when it already is, as torch returns
    ``self``); ``t.to("cpu")`` and ``t.cpu()`` give host memory. A device tensor's ``.device`` is
    ``s.device`` itself (so ``x.to(d.device)`` follows ``d``); ``s.device`` equals
    ``torch.device("cpu")``, so only that object (or a CUDA device) names the emulated GPU
    (``module.to(s.device)`` hands its tensors a copy of it: they stay host memory). A factory that
    builds from host data (``torch.tensor(data, device=)``, ``torch.as_tensor``, ``new_tensor``) is a
    blocking host-to-device copy, as torch makes it (``internal_new_from_data`` in
    torch/csrc/utils/tensor_new.cpp: the host waits for the GPU);
  - what CUDA refuses is refused, with torch's exception type and message: ``pin_memory=True`` for
    device memory (:data:`PIN_DEVICE_ERROR`, ``empty_cuda`` in aten/src/ATen/cuda/EmptyTensor.cpp),
    ``.pin_memory()`` of device memory (``_pin_memory`` in aten/src/ATen/native/Memory.cpp),
    ``.numpy()`` of device memory (a TypeError, :data:`NUMPY_DEVICE_ERROR`,
    torch/csrc/utils/tensor_numpy.cpp), an op mixing device memory with a host tensor of one or
    more dimensions (:data:`MIXED_DEVICE_ERROR`, ``TensorIteratorBase::compute_types``; a 0-dim host
    tensor is a CPU scalar there, allowed), and a host tensor indexed with a device index
    (:data:`INDEX_DEVICE_ERROR`, ``check_indices_on_cpu_or_selfdevice`` in
    aten/src/ATen/native/TensorAdvancedIndexing.cpp; a device tensor indexed with a host index is
    allowed: torch copies the index to the device, a blocking copy);
  - ``dst.copy_(src, non_blocking=True)`` into device memory is queued. From a pinned ``src`` it
    reads ``src`` when it runs (later); from a pageable ``src`` it is staged (copied) now, as the
    driver does, except that a pageable copy larger than :data:`STAGING_LIMIT` first waits for
    the queue (the driver cannot stage it: the fake ``non_blocking``). A D2H ``non_blocking`` copy
    into pinned host memory is queued too (read it only after an event); into pageable memory it
    waits. ``non_blocking`` counts however torch accepts it: ``copy_(src, True)``,
    ``to(device, dtype, True)``, ``to(dtype, True)``, ``to(other, True)``, ``cuda(device, True)``;
  - in-place ops and ``out=`` ops on device memory, device-to-device copies (``d2.copy_(d)``,
    ``d.to(torch.float64)``, ``d.to(s.device, copy=True)``) and :meth:`LaggingStream.launch` are queued;
    any other op that reads device memory (``.tolist()``, ``.item()``, arithmetic, a blocking
    copy) first runs the queue: the host waits for the emulated GPU, as it would for a real one;
  - events (``s.Event()``, and ``torch.cuda.Event()`` while the block is active) mark the queue:
    ``synchronize()`` runs the queue up to the mark and no further (at once if the mark has run,
    or was never recorded); ``query()`` says whether the queue has run past the mark, without
    running anything, except that an event polled again with nothing queued or run in between
    lets the emulated GPU run one more queued item (a GPU progresses while the host spins, so
    ``while not ev.query(): pass`` ends; so does a polling loop that queues work between its
    polls, after :data:`SPIN_LIMIT` of them);
  - :attr:`LaggingStream.host_waits` counts, exactly, every time the host waited for the emulated GPU:
    a ``synchronize()`` (the stream's, ``torch.cuda.synchronize()`` while the block is active, an
    event's), a blocking copy, ``.item()``, ``.tolist()``, ``bool()`` or any other read of device memory
    that had to run queued work first, and each loop polling an event with ``query()`` (one wait per
    loop, however many polls). A call that finds no queued work before its mark returns at once and is
    no wait; neither is a single ``query()`` that looks and moves on (a loop counting what is still in
    flight). On a GPU, where the work may finish by itself, only timing tells a wait; here the GPU
    never finishes by itself, so every wait the code asks for shows;
  - CUDA graphs (``torch.cuda.CUDAGraph()``, ``with torch.cuda.graph(g):``, ``g.replay()`` while the
    block is active): a capture records the device work the body queues instead of queuing it, and
    ``replay()`` queues that recorded work again, reading the tensors it captured (the addresses, as a
    real graph does: a captured copy from a pinned buffer reads what the buffer holds when the replay
    runs; an op that makes a new device tensor during the capture allocates it then and is recomputed at
    every replay; so is a factory's, ``torch.zeros(n, device=)`` say). As on a GPU, a capture refuses
    every copy between host memory that is not pinned and the device (:data:`CAPTURE_PAGEABLE_ERROR`, a
    RuntimeError, checked in ``copy_kernel_cuda``, aten/src/ATen/native/cuda/Copy.cu, before CUDA is
    called, so the capture itself goes on): ``copy_``, ``.to()``, ``torch.tensor(data, device=)``,
    ``torch.as_tensor``, ``new_tensor``, ``.tolist()``, a device tensor indexed with a host index. A
    ``non_blocking`` copy from pinned memory is captured. Any wait for the GPU (``.item()``,
    ``nonzero()``, ``bool()``, a blocking copy from pinned memory, ``synchronize()``, an event's
    ``synchronize()`` or ``query()``) raises CUDA's ``cudaErrorStreamCaptureUnsupported`` as torch
    does (:data:`CAPTURE_SYNC_ERROR`, a ``torch.AcceleratorError``) and invalidates the capture, so
    that ending it (``with torch.cuda.graph(g):`` ends it) raises :data:`CAPTURE_INVALIDATED_ERROR`
    (``CUDAGraph::capture_end``, aten/src/ATen/cuda/CUDAGraph.cpp), the wait's error as its context;
    ``torch.cuda.is_current_stream_capturing()`` says whether a capture is under way;
  - emulated device and pinned memory is host memory, freed when the program drops the last
    reference to it, as the CUDA caching allocators make it reusable
    (:meth:`LaggingStream.device_bytes`, :meth:`LaggingStream.pinned_bytes`).

  The emulation is exact about *order* (what a lagging GPU would read) and says nothing about
  time: its results are labelled "emulated" wherever they are shown.

Why one module of this length: the emulation is one torch function mode whose cases (memory kinds, the
queue, events, graphs, what CUDA refuses) share the stream's table of storages and must agree on every call.
"""
from __future__ import annotations

import weakref
from collections import deque

import torch
from torch.overrides import TorchFunctionMode

from .args import callable_arg, positive_number
from .copyargs import copy_call, cuda_args, to_args
from .device import has_cuda, require_cuda

#: A pageable non_blocking copy larger than this waits for the queue (one copy the driver's
#: staging cannot take; 2 MiB returned at once on the H200, 2.25 MiB waited).
STAGING_LIMIT = 2 * 1024 * 1024

EMULATED_LABEL = "emulated lagging stream (CPU): queued device work runs only when the host waits"

#: A polling loop that queues work between its polls (``while not ev.query(): x.add_(1)``) is still the
#: host spinning on the event: after this many queries in a row that found the event not reached, every
#: further query lets the emulated GPU run one item, so the loop ends (a loop that only looks, once per
#: step, queries an event a few times before a wait reaches it: far fewer).
SPIN_LIMIT = 10_000

#: torch's error (a RuntimeError) for a capture that copies between pageable host memory and the device, in
#: either direction (``copy_kernel_cuda`` in aten/src/ATen/native/cuda/Copy.cu checks it before it calls CUDA;
#: torch 2.11 on the H200 said exactly this). The emulation raises the same text.
CAPTURE_PAGEABLE_ERROR = ("Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the CPU "
                          "tensor is pinned. Please use tensor.pin_memory() or allocate the tensor with "
                          "pin_memory=True.")
#: CUDA's error for a wait on the GPU (a sync) while a stream is capturing (cudaErrorStreamCaptureUnsupported),
#: the first line of the ``torch.AcceleratorError`` torch raises (``c10_cuda_check_implementation``,
#: c10/cuda/CUDAException.cpp).
CAPTURE_SYNC_ERROR = "CUDA error: operation not permitted when stream is capturing"
#: What ending a capture that such a wait invalidated raises (``cudaStreamEndCapture`` in
#: ``CUDAGraph::capture_end``, a ``torch.AcceleratorError``): what ``with torch.cuda.graph(g):`` lets out, the
#: wait's error as its ``__context__`` (torch 2.11 on the H200 printed this line for ``.item()``).
CAPTURE_INVALIDATED_ERROR = "CUDA error: operation failed due to a previous error during capture"
#: torch's error (RuntimeError) for ``pin_memory=True`` with device memory (``empty_cuda`` and
#: ``empty_strided_cuda`` in aten/src/ATen/cuda/EmptyTensor.cpp): ``torch.empty_like(gpu_t, pin_memory=True)``,
#: ``torch.zeros(n, device="cuda", pin_memory=True)``.
PIN_DEVICE_ERROR = "Only dense CPU tensors can be pinned"
#: torch's error (TypeError) for ``.numpy()`` (or ``np.asarray``) of device memory (torch/csrc/utils/tensor_numpy.cpp).
NUMPY_DEVICE_ERROR = ("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor to "
                      "host memory first.")
#: torch's error (RuntimeError) for an op on device memory and a host tensor of one or more dimensions
#: (``TensorIteratorBase::compute_types`` in aten/src/ATen/TensorIterator.cpp; ops checked by their generated
#: wrappers say "Expected all tensors to be on the same device, but got ..." instead: the same start).
MIXED_DEVICE_ERROR = "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!"
#: torch's error (RuntimeError) for a host tensor indexed with a device index
#: (``check_indices_on_cpu_or_selfdevice`` in aten/src/ATen/native/TensorAdvancedIndexing.cpp).
INDEX_DEVICE_ERROR = "indices should be either on cpu or on the same device as the indexed tensor (cpu)"

#: The exception type torch raises for a CUDA error (``torch.AcceleratorError``, a RuntimeError; older torch:
#: RuntimeError itself).
_AcceleratorError = getattr(torch, "AcceleratorError", RuntimeError)


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

    def Event(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):  # noqa: N802
        """A ``torch.cuda.Event`` (the same arguments): ``record()`` it after the work it marks;
        ``synchronize()`` waits until the GPU has run that work, ``query()`` says whether it has
        (without waiting). Named like the class it returns."""
        return torch.cuda.Event(enable_timing=enable_timing, blocking=blocking, interprocess=interprocess)

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

    def device_bytes(self) -> int:
        """Bytes of device memory held by live tensors (``torch.cuda.memory_allocated()``)."""
        return int(torch.cuda.memory_allocated())

    def host_stats(self) -> dict:
        from .hostmem import host_stats

        return host_stats()

    def release(self) -> None:
        """Synchronize, then give cached pinned blocks back to the driver."""
        from .hostmem import release_cached_host_blocks

        release_cached_host_blocks()


class _Queue(deque):
    """A :class:`LaggingStream`'s queue of device work (callables) and event marks; ``state()``
    changes whenever an item is added or taken out."""

    def __init__(self):
        super().__init__()
        self.pushed = 0

    def append(self, item) -> None:
        self.pushed += 1
        super().append(item)

    def state(self) -> tuple:
        return self.pushed, len(self)


class _CaptureQueue(_Queue):
    """What a :class:`LaggingStream` queues into while a graph is captured: the graph's recorded work."""

    def __init__(self, graph: "_EmulatedGraph"):
        super().__init__()
        self.graph = graph

    def append(self, item) -> None:
        if isinstance(item, _Mark):
            raise RuntimeError("an event recorded inside a graph capture is not emulated: record it before "
                               "the capture or after replay()")
        super().append(item)


class _EmulatedGraph:
    """``torch.cuda.CUDAGraph`` on a :class:`LaggingStream`: ``replay()`` queues the captured work again.

    A wait for the GPU during the capture (:meth:`refuse_wait`) invalidates it, as CUDA does; ending an
    invalidated capture raises :data:`CAPTURE_INVALIDATED_ERROR` and leaves the graph without work to replay."""

    def __init__(self, stream: "LaggingStream"):
        self._stream = stream
        self._items: list | None = None
        self._invalidated = False

    def capture_begin(self, *args, **kwargs) -> None:
        s = self._stream
        if s._capture is not None:
            raise RuntimeError("a graph capture is already under way on this stream")
        s.synchronize()  # torch.cuda.graph synchronizes the device before it captures
        s._capture, s._queue_outside = self, s._queue
        s._queue = _CaptureQueue(self)
        self._invalidated = False

    def refuse_wait(self) -> BaseException:
        """The error for a host wait during this capture (raise it): CUDA's cudaErrorStreamCaptureUnsupported as
        torch raises it (:data:`CAPTURE_SYNC_ERROR`); the capture is invalidated, as CUDA invalidates it."""
        self._invalidated = True
        return _AcceleratorError(CAPTURE_SYNC_ERROR)

    def _end(self) -> None:
        s = self._stream
        self._items = None if self._invalidated else list(s._queue)
        s._queue, s._queue_outside, s._capture = s._queue_outside, None, None

    def capture_end(self) -> None:
        s = self._stream
        if s._capture is not self:
            raise RuntimeError("capture_end() without capture_begin() on this graph")
        self._end()
        if self._invalidated:  # cudaStreamEndCapture of an invalidated capture (CUDAGraph::capture_end)
            raise _AcceleratorError(CAPTURE_INVALIDATED_ERROR)

    def replay(self) -> None:
        """Queue the captured work (it runs in stream order, later, reading what its tensors hold then)."""
        if self._items is None:
            raise RuntimeError("replay() of a graph without a successful capture: it was never captured, or its "
                               "capture failed (capture it with torch.cuda.graph(g))")
        for item in self._items:
            self._stream._queue.append(item)

    def reset(self) -> None:
        self._items = None

    def pool(self):
        return None


class _Mark:
    """An event's place in a :class:`LaggingStream`'s queue; ``done`` once the queue has passed it."""

    __slots__ = ("done",)

    def __init__(self):
        self.done = False


class _LaggingEvent:
    """An event on a :class:`LaggingStream`, made by ``s.Event()`` (or ``torch.cuda.Event()`` in its
    ``with`` block), with ``torch.cuda.Event``'s calls:

    - ``record()`` marks the queue (a new mark each time, as CUDA re-records);
    - ``synchronize()`` runs the queue up to the mark, and nothing after it; it returns at once when
      the mark has already run, or when the event was never recorded (as ``torch.cuda.Event`` does);
    - ``query()`` is True when the queue has run past the mark, or the event was never recorded.
      A query looks and runs nothing: until the host waits, it says False, as it would behind a
      busy GPU. But a real GPU drains its queue while the host spins on an event, so when the host
      queries this event again with nothing queued or run in between (it only polls), the emulated
      GPU first runs one more queued item: ``while not ev.query(): pass`` ends, after at most one
      poll more than the items queued before the mark. (A single query per step, as a loop that
      counts what is still in flight makes, runs nothing, so the emulated GPU stays as far behind
      as ever and a race still shows.) The choice: a query that ran queued work on its own would
      let a loop that only looks hide its race; a poll that never ran anything would hang.
      Polling is a host wait: the first poll again of a loop adds one to the stream's
      ``host_waits``; after :data:`SPIN_LIMIT` queries in a row that found the mark not reached,
      each query moves the emulated GPU on, even with work queued in between;
    - ``wait()`` does nothing (one emulated stream: everything is already in order);
    - ``elapsed_time()`` raises: the emulation says nothing about time.
    """

    def __init__(self, stream: "LaggingStream", enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False):
        self._stream = stream
        self._mark = None
        self._polled = None     # the queue's state() when this event was last queried
        self._misses = 0        # queries in a row that found the mark not reached
        self._spinning = False  # the host is polling this mark (its wait already counted)

    def record(self, stream=None) -> None:
        self._mark = _Mark()
        self._polled, self._misses, self._spinning = None, 0, False
        self._stream._queue.append(self._mark)

    def synchronize(self) -> None:
        if self._mark is not None and self._stream._capture is not None:  # cudaEventSynchronize while capturing
            raise self._stream._capture.refuse_wait()
        if self._mark is not None and not self._mark.done:
            self._stream._run_until(self._mark)

    def wait(self, stream=None) -> None:
        return None  # one emulated stream: everything is already in order

    def query(self) -> bool:
        if self._mark is not None and self._stream._capture is not None:  # cudaEventQuery while capturing
            raise self._stream._capture.refuse_wait()
        if self._mark is None or self._mark.done:
            return True
        stream, queue = self._stream, self._stream._queue
        self._misses += 1
        if self._polled == queue.state() or self._misses > SPIN_LIMIT:
            # polled again, nothing else happened (or the host has spun on it SPIN_LIMIT times): the host
            # is waiting for the GPU, which moves on meanwhile; one wait per polling loop
            if not self._spinning:
                self._spinning = True
                stream._note_wait("poll")
            stream._advance()
        else:
            self._spinning = False  # the host did something else since its last look: not one loop
        self._polled = queue.state()
        return self._mark.done

    def elapsed_time(self, end_event) -> float:
        raise RuntimeError("elapsed_time() needs CUDA events on a GPU: the emulated stream says nothing about time")


# Ops that only look at metadata or make views: they never wait for the emulated GPU.
_NO_DATA = {
    "__getitem__", "view", "view_as", "reshape", "narrow", "select", "t", "T", "mT", "permute",
    "transpose", "unsqueeze", "squeeze", "flatten", "unflatten", "expand", "expand_as", "as_strided",
    "unbind", "split", "chunk", "unfold", "detach", "size", "dim", "numel", "stride", "storage_offset",
    "is_contiguous", "data_ptr", "untyped_storage", "element_size", "nelement", "__len__", "shape",
    "dtype", "device", "is_cuda", "layout", "requires_grad", "is_leaf", "grad_fn", "_base", "ndim",
    "is_floating_point", "is_complex", "__hash__", "names", "nbytes", "itemsize", "is_pinned", "__get__",
}
# Ops whose result is a host value or has a data-dependent shape: in a capture they would make the host wait.
_DATA_DEPENDENT = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "__complex__", "__format__",
                   "__repr__", "__str__", "__array__", "numpy", "nonzero", "masked_select", "unique",
                   "unique_consecutive", "argwhere", "bincount", "repeat_interleave", "equal", "allclose"}
_FACTORIES = {"zeros", "empty", "ones", "full", "arange", "tensor", "as_tensor", "asarray", "zeros_like",
              "empty_like", "ones_like", "full_like", "rand", "randn", "randint", "randperm", "linspace",
              "empty_strided", "eye", "rand_like", "randn_like"}
# Tensor methods making a new tensor on the device of the tensor they are called on (unless device= says otherwise).
_NEW_FACTORIES = {"new_zeros", "new_ones", "new_empty", "new_full", "new_empty_strided", "new_tensor"}
# Factories that build from data (a list, a NumPy array, a tensor): on the device that is a copy from the host.
_DATA_FACTORIES = {"tensor", "as_tensor", "asarray", "new_tensor"}
# Factories without a pin_memory argument: torch raises its own TypeError for one.
_NO_PIN_ARG = {"as_tensor", "asarray", "new_tensor"}
# Factories whose result holds no values: nothing to fill again at a graph's replay.
_UNINITIALIZED = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
# Ops that take device memory and host tensors together on CUDA (indexing moves a host index to the device;
# type_as(host) converts to the host's type; index_put_ takes host indices; `p.data = t` sets an attribute).
_MIXED_OK = {"__getitem__", "__setitem__", "index_put_", "index_put", "_index_put_impl_", "type_as", "set_",
             "reshape_as", "is_same_size", "broadcast_tensors", "__set__"}
# The positional arguments of Tensor.to's three forms (after self), as torch names them.
_TO_FORMS = {"device": ("device", "dtype", "non_blocking", "copy"), "dtype": ("dtype", "non_blocking", "copy"),
             "other": ("other", "non_blocking", "copy")}


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


def _forget(table: dict, key: int, ref) -> None:
    """A tracked storage was freed: forget its address (unless a newer storage holds it already)."""
    if table.get(key) is ref:
        del table[key]


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
        if name == "__get__" and getattr(getattr(func, "__self__", None), "__name__", None) == "device":
            t = args[0] if args else None
            return s.device if s.is_device(t) else func(*args, **kwargs)  # t.device of device memory
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if name == "pin_memory" and first is not None:
            return s._pin_memory(first)
        if name == "is_pinned" and first is not None:
            return s.is_pinned(first)
        if s._makes_memory(name, first, kwargs):
            return s._factory(func, name, args, kwargs)
        if name == "copy_" and len(args) >= 2:
            c = copy_call(name, args, kwargs)  # copy_(src, True) and copy_(src, non_blocking=True)
            return s._copy(c.dst, c.src, c.non_blocking)
        if name in ("to", "cuda", "cpu") and first is not None:
            return s._to(func, name, args, kwargs)
        touched = [t for t in _tensors((args, kwargs)) if s.is_device(t)]
        if not touched:
            return func(*args, **kwargs)
        if name in ("numpy", "__array__") and s.is_device(first):
            raise TypeError(NUMPY_DEVICE_ERROR)  # tensor_numpy.cpp: NumPy reads host memory only
        gather = name == "__getitem__" and any(isinstance(t, torch.Tensor) for t in _tensors(args[1:]))
        if name in ("__getitem__", "__setitem__") and first is not None:
            s._check_index(first, args[1] if len(args) > 1 else None)
        elif name not in _MIXED_OK and name not in _NO_DATA and any(
                not s.is_device(t) and t.dim() > 0 for t in _tensors((args, kwargs))):
            raise RuntimeError(MIXED_DEVICE_ERROR)  # a host tensor (not a 0-dim CPU scalar) in a device op
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
        if name == "__setitem__":
            value = args[2] if len(args) > 2 else None
            if not s.is_device(first):  # cpu_t[i] = gpu_t: a blocking device-to-host copy
                s._blocking_copy(first)
                with s._drain():
                    return func(*args, **kwargs)
            if isinstance(value, torch.Tensor) and not s.is_device(value):
                if value.dim() or s._capture is None:
                    s._blocking_copy(value)  # gpu_t[i] = cpu_t is a blocking copy
                    with s._drain():
                        return func(*args, **kwargs)
                value = value.item()  # a 0-dim CPU value in a capture: a fill with the value it holds now
                s._queue.append(lambda: func(args[0], args[1], value))
                return None
            s._queue.append(lambda: func(*args, **kwargs))
            return None
        inplace = name.endswith("_") and not name.startswith("__")
        if inplace and s.is_device(args[0]) or "out" in kwargs:
            s._queue.append(lambda: func(*args, **kwargs))  # device work, in stream order
            return kwargs["out"] if "out" in kwargs else args[0]
        if s._capture is not None:
            return s._captured_op(func, name, args, kwargs)
        s.synchronize()  # the host needs a value computed from device memory: it waits
        with s._drain():
            out = func(*args, **kwargs)
        for t in _tensors(out):
            s._register(s._device, t)
        return out


class LaggingStream:
    """A CPU stand-in for a CUDA stream that lags far behind the host (see the module docstring).

    Use it as a context manager; :func:`stream` returns one on a machine without CUDA. Leaving the
    ``with`` block runs whatever is still queued. While the block is active, ``torch.cuda.Event``
    makes this stream's events (as :meth:`Event`), so code written for CUDA runs unchanged.
    """

    emulated = True
    label = EMULATED_LABEL

    def __init__(self):
        self.device = torch.device("cpu")
        self._queue = _Queue()
        # storage data_ptr -> a weak reference to that storage: held weakly, so that memory the program
        # drops is freed (and forgotten: a new tensor at the same address is not taken for it)
        self._device: dict[int, weakref.ref] = {}
        self._pinned: dict[int, weakref.ref] = {}
        self._draining = False
        self._mode = None
        self._saved_cuda_event = None
        self._saved_graph_api = None
        self._capture: _EmulatedGraph | None = None  # the graph being captured, if any
        self._queue_outside = None                    # the stream's queue while a capture records
        self._saved_cuda_sync = None
        #: how many times the host waited for the emulated GPU (see the module docstring): exact
        self.host_waits = 0

    # --- the context ------------------------------------------------------------------------
    def __enter__(self) -> "LaggingStream":
        if self._mode is not None:
            raise RuntimeError("this LaggingStream is already active; make a new one for a nested block")
        event_class = self._cuda_event_class()
        self._mode = _Mode(self)
        self._mode.__enter__()
        # torch.cuda.Event (and the graph API) make this stream's events and graphs until the block ends
        # (restored in __exit__, an exception in the block too): code written for CUDA runs unchanged
        self._saved_cuda_event, torch.cuda.Event = torch.cuda.Event, event_class
        self._saved_cuda_sync, torch.cuda.synchronize = torch.cuda.synchronize, self._cuda_synchronize()
        self._saved_graph_api = (torch.cuda.CUDAGraph, torch.cuda.graph, torch.cuda.is_current_stream_capturing)
        torch.cuda.CUDAGraph, torch.cuda.graph, torch.cuda.is_current_stream_capturing = self._graph_api()
        return self

    def __exit__(self, *exc) -> None:
        try:
            if exc[0] is None:
                self.synchronize()
        finally:
            torch.cuda.Event, self._saved_cuda_event = self._saved_cuda_event, None
            torch.cuda.synchronize, self._saved_cuda_sync = self._saved_cuda_sync, None
            (torch.cuda.CUDAGraph, torch.cuda.graph,
             torch.cuda.is_current_stream_capturing), self._saved_graph_api = self._saved_graph_api, None
            if self._capture is not None:  # an error left a capture open: end it (raising nothing more)
                self._capture._end()
            mode, self._mode = self._mode, None
            mode.__exit__(*exc)

    def _graph_api(self):
        """``torch.cuda.CUDAGraph``, ``torch.cuda.graph`` and ``torch.cuda.is_current_stream_capturing``
        while this stream is active: graphs captured and replayed on it."""
        import contextlib

        stream = self

        class CUDAGraph(_EmulatedGraph):
            """``torch.cuda.CUDAGraph`` inside an active :class:`LaggingStream` (see the module docstring)."""

            def __init__(self, *args, **kwargs):
                super().__init__(stream)

        @contextlib.contextmanager
        def graph(cuda_graph, pool=None, stream=None, capture_error_mode="global"):
            """``torch.cuda.graph`` inside an active :class:`LaggingStream`: captures into ``cuda_graph``."""
            if not isinstance(cuda_graph, _EmulatedGraph):
                raise TypeError("torch.cuda.graph(g): g must be a torch.cuda.CUDAGraph() made inside this "
                                f"stream's with block, got {type(cuda_graph).__name__}")
            cuda_graph.capture_begin()
            try:
                yield cuda_graph
            finally:
                cuda_graph.capture_end()

        def is_current_stream_capturing() -> bool:
            return stream._capture is not None

        return CUDAGraph, graph, is_current_stream_capturing

    def _cuda_synchronize(self):
        """What ``torch.cuda.synchronize`` is while this stream is active: the host waits for the emulated
        GPU (this stream's :meth:`synchronize`), then, on a machine with CUDA, for the real one too."""
        stream, real = self, torch.cuda.synchronize

        def synchronize(device=None) -> None:
            """``torch.cuda.synchronize()`` inside an active :class:`LaggingStream`: runs its queue (a host wait)."""
            stream.synchronize()
            if torch.cuda.is_available():
                real(device)

        return synchronize

    def _cuda_event_class(self):
        """What ``torch.cuda.Event`` is while this stream is active: a class making its events."""
        stream = self

        class Event(_LaggingEvent):
            """``torch.cuda.Event`` inside an active :class:`LaggingStream`: an event on that stream
            (the same as ``s.Event()``; the timing and IPC arguments are accepted and ignored)."""

            def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
                super().__init__(stream)

        return Event

    # --- the calls the lessons use ----------------------------------------------------------
    def busy(self, ms: float) -> None:
        """The emulated GPU is always behind: nothing to add (``ms`` is checked, then ignored)."""
        positive_number("ms", ms)

    def Event(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):  # noqa: N802
        """An event on this stream, with ``torch.cuda.Event``'s calls and arguments (the timing
        ones are ignored): ``record()`` marks the queue, ``synchronize()`` runs the queue up to the
        mark (at once when it has run), ``query()`` says whether the mark has run (polled again and
        again, it lets the emulated GPU move on one item per poll). Named like the class it mirrors."""
        return _LaggingEvent(self, enable_timing, blocking, interprocess)

    def synchronize(self) -> None:
        """Run everything queued (the host waits for the emulated GPU: one :attr:`host_waits` more, unless
        nothing was queued)."""
        self._run_until(None)

    def launch(self, fn, *args, **kwargs):
        """Queue device-side work: ``fn(*args, **kwargs)`` runs in stream order, later. Returns None."""
        callable_arg("fn", fn)
        self._queue.append(lambda: fn(*args, **kwargs))

    def pinned_bytes(self) -> int:
        """Bytes of emulated pinned memory still referenced by the program (or by queued work)."""
        return self._live_bytes(self._pinned)

    def device_bytes(self) -> int:
        """Bytes of emulated device memory still referenced by the program (or by queued work)."""
        return self._live_bytes(self._device)

    def host_stats(self) -> dict:
        return {}

    def release(self) -> None:
        """Run the queue (the emulation caches no pinned blocks: dropped memory is already freed)."""
        self.synchronize()

    def pending(self) -> int:
        """How many queued items (copies, kernels, event marks) have not run yet."""
        return len(self._queue)

    def _captured_op(self, func, name: str, args: tuple, kwargs: dict):
        """An op on device memory during a capture: its result tensors are allocated now (the shapes, from
        what the inputs hold now) and the graph records recomputing them from what the inputs hold at each
        replay. An op whose result is a host value, or whose shape depends on the data, would make the host
        wait: refused, as CUDA refuses it."""
        if name == "tolist":  # tensor_to_list copies to pageable host memory: torch's copy check refuses it
            raise RuntimeError(CAPTURE_PAGEABLE_ERROR)
        if name in _DATA_DEPENDENT:
            raise self._capture.refuse_wait()
        with self._drain():
            out = func(*args, **kwargs)
        outs = list(_tensors(out))
        if not outs or not isinstance(out, (torch.Tensor, tuple, list)):
            raise self._capture.refuse_wait()  # a Python value (bool(), int(), len of a result ...)
        for t in outs:
            self._register(self._device, t)

        def recompute():
            for dst, src in zip(outs, _tensors(func(*args, **kwargs))):
                dst.copy_(src)

        self._queue.append(recompute)
        return out

    # --- memory kinds -----------------------------------------------------------------------
    @staticmethod
    def _key(t: torch.Tensor) -> int:
        return t.untyped_storage().data_ptr()

    @staticmethod
    def _live_bytes(table: dict) -> int:
        storages = [ref() for ref in list(table.values())]
        return sum(st.nbytes() for st in storages if st is not None)

    def _register(self, table: dict, t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.nbytes():
            key = st.data_ptr()
            old = table.get(key)
            if old is None or old() is not st:
                # forgotten when the storage is freed (the last tensor or view on it dropped)
                table[key] = weakref.ref(st, lambda ref, table=table, key=key: _forget(table, key, ref))
        return t

    @staticmethod
    def _holds(table: dict, t) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        st = t.untyped_storage()
        if not st.nbytes():
            return False
        ref = table.get(st.data_ptr())
        return ref is not None and ref() is st  # the same storage, not a new one at a freed address

    def is_device(self, t: torch.Tensor) -> bool:
        return self._holds(self._device, t)

    def is_pinned(self, t: torch.Tensor) -> bool:
        return self._holds(self._pinned, t)

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
        """Run the queue up to ``mark`` (a :class:`_Mark` still queued) or, for None, all of it. Where
        queued work stands before it, the host waits for it: one more :attr:`host_waits`."""
        if self._capture is not None:
            raise self._capture.refuse_wait()  # the host would wait for the GPU in the middle of a capture
        if not self._draining:
            for item in self._queue:
                if item is mark:
                    break
                if not isinstance(item, _Mark):  # work the GPU has not run: the host waits for it
                    self._note_wait("synchronize" if mark is None else "event")
                    break
        with self._drain():
            while self._queue:
                item = self._queue.popleft()
                if isinstance(item, _Mark):
                    item.done = True
                    if item is mark:
                        return
                else:
                    item()

    def _note_wait(self, kind: str) -> None:
        """The host waits for the emulated GPU: ``kind`` is ``"synchronize"`` (for everything queued: the
        stream's or torch.cuda's ``synchronize()``, or a read of device memory), ``"event"`` (an event's
        ``synchronize()``) or ``"poll"`` (a loop polling an event's ``query()``). Counted in
        :attr:`host_waits`; a subclass may note more (the exercise checkers note the call that waited)."""
        self.host_waits += 1

    def _advance(self) -> None:
        """The emulated GPU moves on by one queued item (marks it passes cost nothing)."""
        if self._capture is not None:
            return  # a capture records work; nothing of it runs until a replay
        with self._drain():
            ran = False
            while self._queue:
                item = self._queue[0]
                if isinstance(item, _Mark):
                    item.done = True
                elif ran:
                    return
                else:
                    ran = True
                    self._queue.popleft()
                    item()
                    continue
                self._queue.popleft()

    # --- intercepted torch calls ------------------------------------------------------------
    def _names_gpu(self, device) -> bool:
        """A ``device=`` of a factory or a ``to()`` target names the emulated GPU: ``s.device`` itself (which
        a device tensor's ``.device`` is), or any CUDA device (an int too, as torch reads it). Any other CPU
        device (``"cpu"``, ``torch.device("cpu")``) is host memory."""
        if device is self.device:
            return True
        if isinstance(device, int) and not isinstance(device, bool):
            return True
        return torch.device(device).type == "cuda"

    def _is_our_device(self, device) -> bool:
        """An explicit ``device=`` names the emulated GPU (:meth:`_names_gpu`; None names nothing). The exercise
        checkers (checks/l02.py, checks/l08.py) ask it of the targets they see."""
        return device is not None and self._names_gpu(device)

    def _makes_memory(self, name: str, first, kwargs: dict) -> bool:
        """Does this call make a new tensor whose kind of memory (device, pinned, host) the emulation decides?
        A factory with ``device=`` or ``pin_memory=``, or a ``*_like`` / ``new_*`` of device memory."""
        derived = name in _NEW_FACTORIES or name.endswith("_like")
        if not (derived or name in _FACTORIES):
            return False
        return "pin_memory" in kwargs or "device" in kwargs or (derived and self.is_device(first))

    def _factory(self, func, name: str, args: tuple, kwargs: dict):
        """A factory on the emulated stream: device memory where torch would allocate on the GPU (an explicit
        GPU ``device=``, or ``*_like`` / ``new_*`` of device memory without one), pinned host memory for
        ``pin_memory=True`` on the host, refused (:data:`PIN_DEVICE_ERROR`) for ``pin_memory=True`` on the
        device. In a capture, a device factory's fill is recorded: every replay fills it again."""
        derived = name in _NEW_FACTORIES or name.endswith("_like")
        base = args[0] if derived and args and isinstance(args[0], torch.Tensor) else None
        if "pin_memory" in kwargs and name in _NO_PIN_ARG:
            with self._drain():
                return func(*args, **kwargs)  # torch's own TypeError: no pin_memory argument
        pin = bool(kwargs.pop("pin_memory", False))
        device_given = kwargs.get("device") is not None
        if device_given:
            on_device = self._is_our_device(kwargs["device"])
            if on_device:
                kwargs["device"] = "cpu"  # the emulated GPU's memory is host memory
        else:
            on_device = self.is_device(base)
        if name in _DATA_FACTORIES:
            return self._from_data(func, name, args, kwargs, base, pin, on_device if device_given or base is not None
                                   else None)
        if pin and on_device:
            raise RuntimeError(PIN_DEVICE_ERROR)  # empty_cuda: only host memory can be pinned
        with self._drain():
            out = func(*args, **kwargs)
        if pin:
            return self._register(self._pinned, out)
        if not on_device:
            return out
        self._register(self._device, out)
        if self._capture is not None and name not in _UNINITIALIZED:
            # the kernel that fills it is captured: every replay fills it again
            self._queue.append(lambda: out.copy_(func(*args, **kwargs)))
        return out

    def _from_data(self, func, name: str, args: tuple, kwargs: dict, base, pin: bool, on_device):
        """``torch.tensor`` / ``torch.as_tensor`` / ``torch.asarray`` / ``Tensor.new_tensor``, as torch builds
        them (``internal_new_from_data``, torch/csrc/utils/tensor_new.cpp): the data goes into host memory
        (pinned for ``pin_memory=True``), then ``.to(device)``, a blocking copy: the host waits for the GPU,
        and a capture refuses it for pageable data. A tensor as data is ``data.to(device, dtype, copy=...)``.
        ``on_device`` None: no device named, the data's own side."""
        rest = args[1:] if base is not None else args
        data = rest[0] if rest else kwargs.get("data", kwargs.get("obj"))
        if isinstance(data, torch.Tensor):
            if pin:
                raise RuntimeError("Can't pin tensor constructed from a variable")  # internal_new_from_data
            on_device = self.is_device(data) if on_device is None else on_device
            dtype = kwargs.get("dtype") or data.dtype
            copy = name in ("tensor", "new_tensor") or kwargs.get("copy") is True
            out = self._to(torch.Tensor.to, "to", (data, self.device if on_device else "cpu", dtype), {"copy": copy})
            if name in ("tensor", "new_tensor"):
                out = out.detach()
            if kwargs.get("requires_grad"):
                out.requires_grad_(True)
            return out
        if any(self.is_device(t) for t in _tensors(data)):
            self.synchronize()  # device values inside a list are read on the host: it waits (refused in a capture)
        with self._drain():
            host = func(*args, **kwargs)
        if pin:
            self._register(self._pinned, host)
        if not on_device:
            return host
        with self._drain():
            out = torch.empty_like(host)
        self._register(self._device, out)
        self._copy(out, host, False)  # tensor.to(device): a blocking copy
        if host.requires_grad:
            out.requires_grad_(True)
        return out

    def _pin_memory(self, t: torch.Tensor) -> torch.Tensor:
        if self.is_pinned(t):
            return t  # torch does the same: no copy, the same storage
        if self.is_device(t):  # _pin_memory in aten/src/ATen/native/Memory.cpp, with TensorBase::toString's name
            kind = t.type().replace("torch.", "").replace("Tensor", "")
            raise RuntimeError(f"cannot pin 'CUDA{kind}Type' only dense CPU tensors can be pinned")
        with self._drain():
            out = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype).copy_(t)
        return self._register(self._pinned, out)

    def _blocking_copy(self, host: torch.Tensor) -> None:
        """Before a blocking copy between ``host`` (host memory) and the device, which torch makes with a wait
        for the stream (``memcpy_and_sync``): in a capture it is refused as CUDA refuses it (pageable memory:
        torch's check; pinned: the wait); otherwise the host waits for the queue."""
        if self._capture is not None:
            if not self.is_pinned(host):
                raise RuntimeError(CAPTURE_PAGEABLE_ERROR)
            raise self._capture.refuse_wait()
        self.synchronize()

    def _check_index(self, t: torch.Tensor, index) -> None:
        """Indexing ``t`` with ``index`` (``t[index]``, ``t[index] = v``) as CUDA does it: a host tensor
        with a device index is refused (:data:`INDEX_DEVICE_ERROR`); a device tensor's host index tensors
        are copied to the device first (``make_info`` in TensorAdvancedIndexing.cpp: ``indice.to(self.device())``,
        a blocking copy). A 0-dim integer index is a number (read on the host)."""
        indices = list(_tensors(index))
        if not self.is_device(t):
            if any(self.is_device(i) for i in indices):
                raise RuntimeError(INDEX_DEVICE_ERROR)
            return
        for i in indices:
            if not self.is_device(i) and (i.dim() or i.dtype == torch.bool):
                self._blocking_copy(i)

    def _copy(self, dst: torch.Tensor, src, non_blocking: bool):
        if not isinstance(src, torch.Tensor):
            with self._drain():
                return dst.copy_(src, non_blocking=non_blocking)
        d_dev, s_dev = self.is_device(dst), self.is_device(src)
        if not d_dev and not s_dev:  # host to host: a memcpy, now
            with self._drain():
                return dst.copy_(src)
        if self._capture is not None and d_dev != s_dev and not self.is_pinned(dst if s_dev else src):
            raise RuntimeError(CAPTURE_PAGEABLE_ERROR)
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

    def _to_args(self, name: str, rest: tuple, kwargs: dict):
        """``(target, dtype, non_blocking, copy)`` of ``t.to/cuda/cpu(*rest, **kwargs)`` in every form
        torch accepts (non_blocking positional too); ``target`` is ``"gpu"``, ``"host"``, None (the
        same side) or another torch.device. Arguments torch refuses raise torch's own error."""
        if name == "cpu":
            torch.empty(0).cpu(*rest, **kwargs)  # torch's check of the arguments (memory_format only)
            return "host", None, False, False
        if name == "cuda":
            if len(rest) > 2:
                raise TypeError(f"cuda() takes at most 2 positional arguments ({len(rest)} given)")
            return "gpu", None, cuda_args(rest, kwargs)[1], False
        form = ("other" if rest and isinstance(rest[0], torch.Tensor)
                else "dtype" if rest and isinstance(rest[0], torch.dtype) else "device")
        names = _TO_FORMS[form]
        # torch's own check of the arguments (it knows no copy=; an int device is a CUDA index)
        check = list(rest[: len(names) - 1]) if len(rest) == len(names) else list(rest)
        check_kw = {k: v for k, v in kwargs.items() if k != "copy"}
        if form == "device" and check and isinstance(check[0], int) and not isinstance(check[0], bool):
            check[0] = torch.device("cuda", check[0])
        if isinstance(check_kw.get("device"), int) and not isinstance(check_kw["device"], bool):
            check_kw["device"] = torch.device("cuda", check_kw["device"])
        torch._C._nn._parse_to(*check, **check_kw)
        device, dtype, non_blocking, copy = to_args(rest, kwargs)
        other = rest[0] if form == "other" else kwargs.get("other", kwargs.get("tensor"))
        if isinstance(other, torch.Tensor) and self.is_device(other):
            device = self.device  # an emulated device tensor lives in host memory
        if device is None:
            target = None
        elif self._names_gpu(device):
            target = "gpu"
        else:
            target = "host" if torch.device(device).type == "cpu" else torch.device(device)
        return target, dtype, non_blocking, copy

    def _to(self, func, name: str, args: tuple, kwargs: dict):
        t = args[0]
        target, dtype, non_blocking, copy = self._to_args(name, args[1:], kwargs)
        on_device = self.is_device(t)
        if target is None:
            target = "gpu" if on_device else "host"
        dtype = dtype or t.dtype
        fmt = kwargs.get("memory_format") or torch.preserve_format  # (nn.Module.to may pass None)
        if target == "gpu":
            if on_device and dtype == t.dtype and not copy and fmt is torch.preserve_format:
                return t  # already there: torch returns the tensor itself
            with self._drain():
                out = torch.empty_like(t, dtype=dtype, memory_format=fmt)
            self._register(self._device, out)
            self._copy(out, t, non_blocking)  # H2D as copy_ would do it; on the device a queued kernel
            return out
        if target == "host" and on_device:
            with self._drain():
                out = torch.empty_like(t, dtype=dtype, memory_format=fmt)
            if non_blocking:  # torch allocates the result pinned
                self._register(self._pinned, out)
            self._copy(out, t, non_blocking)
            return out
        if on_device:  # another kind of device (meta, ...): read after the queue
            self.synchronize()
        with self._drain():
            return func(*args, **kwargs)  # host to host: torch's own answer (often t itself)


#: What a ``torch.cuda.Event()`` made outside an active :class:`LaggingStream` on a machine without
#: CUDA is told (torch itself says only "Tried to instantiate dummy base class Event").
EMULATED_EVENT_TEXT = ("torch.cuda.Event() needs a CUDA GPU, and on this machine the stream is emulated: use "
                       "s.Event() (works on a GPU too), or make the event inside `with pinlab.stream() as s:`, "
                       "where torch.cuda.Event() is s.Event()")


def explain_dummy_event(exc: BaseException):
    """For torch's ``RuntimeError: Tried to instantiate dummy base class Event`` (``torch.cuda.Event()``
    on a torch without CUDA, outside an active :class:`LaggingStream`): a RuntimeError saying
    :data:`EMULATED_EVENT_TEXT`. None for any other exception."""
    if isinstance(exc, RuntimeError) and "dummy base class Event" in str(exc):
        return RuntimeError(f"{EMULATED_EVENT_TEXT} (torch: {exc})")
    return None


def stream():
    """The stream a lesson's loop should use here: :class:`CudaStream` where CUDA is available,
    otherwise a new :class:`LaggingStream` (emulated; say so wherever its results are shown)."""
    return CudaStream() if has_cuda() else LaggingStream()
