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
  behind the host: device work waits in a queue and runs only when the host waits for it (or polls
  an event, see below). While its ``with`` block is active, a
  :class:`torch.overrides.TorchFunctionMode` emulates what matters for host-to-device copies:

  - ``torch.zeros(..., pin_memory=True)``, ``t.pin_memory()`` and ``t.is_pinned()`` work on a
    CPU-only torch; ``pin_memory()`` of an (emulated) pinned tensor returns that same tensor, as
    torch does;
  - a tensor created with an explicit ``device=s.device`` is device memory; create host tensors
    *without* a device argument. ``t.to(s.device)``, ``t.to("cuda")`` and ``t.cuda()`` give device
    memory (``t`` itself when it already is, as torch returns ``self``); ``t.to("cpu")`` and
    ``t.cpu()`` give host memory. A device tensor's ``.device`` is ``s.device`` itself (so
    ``x.to(d.device)`` follows ``d``); ``s.device`` equals ``torch.device("cpu")``, so only that
    object (or a CUDA device) names the emulated GPU in ``to()`` (``module.to(s.device)`` hands its
    tensors a copy of it: they stay host memory);
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
    ``while not ev.query(): pass`` ends);
  - CUDA graphs (``torch.cuda.CUDAGraph()``, ``with torch.cuda.graph(g):``, ``g.replay()`` while the
    block is active): a capture records the device work the body queues instead of queuing it, and
    ``replay()`` queues that recorded work again, reading the tensors it captured (the addresses, as a
    real graph does: a captured copy from a pinned buffer reads what the buffer holds when the replay
    runs; an op that makes a new device tensor during the capture allocates it then and is recomputed at
    every replay). As on a GPU, a capture refuses a copy between host memory that is not pinned and the
    device (:data:`CAPTURE_PAGEABLE_ERROR`) and any wait for the GPU (``.item()``, ``nonzero()``, a
    blocking copy, ``synchronize()``: :data:`CAPTURE_SYNC_ERROR`);
    ``torch.cuda.is_current_stream_capturing()`` says whether a capture is under way;
  - emulated device and pinned memory is host memory, freed when the program drops the last
    reference to it, as the CUDA caching allocators make it reusable
    (:meth:`LaggingStream.device_bytes`, :meth:`LaggingStream.pinned_bytes`).

  The emulation is exact about *order* (what a lagging GPU would read) and says nothing about
  time: its results are labelled "emulated" wherever they are shown.
"""
from __future__ import annotations

import weakref
from collections import deque

import torch
from torch.overrides import TorchFunctionMode

from .args import callable_arg, positive_number, require_cuda
from .device import has_cuda

#: A pageable non_blocking copy larger than this waits for the queue (one copy the driver's
#: staging cannot take; 2 MiB returned at once on the H200, 2.25 MiB waited).
STAGING_LIMIT = 2 * 1024 * 1024

EMULATED_LABEL = "emulated lagging stream (CPU): queued device work runs only when the host waits"

#: torch's error for a capture that copies between pageable host memory and the device (the emulation
#: raises the same text; torch's copy_ checks it before it calls CUDA).
CAPTURE_PAGEABLE_ERROR = ("Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the CPU "
                          "tensor is pinned.")
#: CUDA's error for a wait on the GPU (a sync) while a stream is capturing (cudaErrorStreamCaptureUnsupported).
CAPTURE_SYNC_ERROR = "CUDA error: operation not permitted when stream is capturing"


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
    """``torch.cuda.CUDAGraph`` on a :class:`LaggingStream`: ``replay()`` queues the captured work again."""

    def __init__(self, stream: "LaggingStream"):
        self._stream = stream
        self._items: list | None = None

    def capture_begin(self, *args, **kwargs) -> None:
        s = self._stream
        if s._capture is not None:
            raise RuntimeError("a graph capture is already under way on this stream")
        s.synchronize()  # torch.cuda.graph synchronizes the device before it captures
        s._capture, s._queue_outside = self, s._queue
        s._queue = _CaptureQueue(self)

    def capture_end(self) -> None:
        s = self._stream
        if s._capture is not self:
            raise RuntimeError("capture_end() without capture_begin() on this graph")
        self._items = list(s._queue)
        s._queue, s._queue_outside, s._capture = s._queue_outside, None, None

    def replay(self) -> None:
        """Queue the captured work (it runs in stream order, later, reading what its tensors hold then)."""
        if self._items is None:
            raise RuntimeError("replay() of a graph that was never captured (capture it with torch.cuda.graph(g))")
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
    - ``wait()`` does nothing (one emulated stream: everything is already in order);
    - ``elapsed_time()`` raises: the emulation says nothing about time.
    """

    def __init__(self, stream: "LaggingStream", enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False):
        self._stream = stream
        self._mark = None
        self._polled = None  # the queue's state() when this event was last queried

    def record(self, stream=None) -> None:
        self._mark = _Mark()
        self._stream._queue.append(self._mark)

    def synchronize(self) -> None:
        if self._mark is not None and not self._mark.done:
            self._stream._run_until(self._mark)

    def wait(self, stream=None) -> None:
        return None  # one emulated stream: everything is already in order

    def query(self) -> bool:
        if self._mark is None or self._mark.done:
            return True
        stream, queue = self._stream, self._stream._queue
        if self._polled == queue.state():
            stream._advance()  # polled again, nothing else happened: the GPU moves on meanwhile
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
_FACTORIES = {"zeros", "empty", "ones", "full", "arange", "tensor", "as_tensor", "zeros_like", "empty_like",
              "ones_like", "full_like", "rand", "randn", "randint", "randperm", "linspace", "empty_strided",
              "eye", "rand_like", "randn_like"}
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
        if name in ("pin_memory",) and args and isinstance(args[0], torch.Tensor):
            return s._pin_memory(args[0])
        if name == "is_pinned" and args and isinstance(args[0], torch.Tensor):
            return s.is_pinned(args[0])
        if name in _FACTORIES and ("pin_memory" in kwargs or "device" in kwargs):
            return s._factory(func, args, kwargs)
        if name == "copy_" and len(args) >= 2:
            non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)  # copy_(src, True)
            return s._copy(args[0], args[1], bool(non_blocking))
        if name in ("to", "cuda", "cpu") and args and isinstance(args[0], torch.Tensor):
            return s._to(func, name, args, kwargs)
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
        self._saved_graph_api = (torch.cuda.CUDAGraph, torch.cuda.graph, torch.cuda.is_current_stream_capturing)
        torch.cuda.CUDAGraph, torch.cuda.graph, torch.cuda.is_current_stream_capturing = self._graph_api()
        return self

    def __exit__(self, *exc) -> None:
        try:
            if exc[0] is None:
                self.synchronize()
        finally:
            torch.cuda.Event, self._saved_cuda_event = self._saved_cuda_event, None
            (torch.cuda.CUDAGraph, torch.cuda.graph,
             torch.cuda.is_current_stream_capturing), self._saved_graph_api = self._saved_graph_api, None
            if self._capture is not None:  # an error left a capture open: end it
                self._capture.capture_end()
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
        """Run everything queued (the host waits for the emulated GPU)."""
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
        if name in _DATA_DEPENDENT:
            raise RuntimeError(CAPTURE_SYNC_ERROR)
        with self._drain():
            out = func(*args, **kwargs)
        outs = list(_tensors(out))
        if not outs or not isinstance(out, (torch.Tensor, tuple, list)):
            raise RuntimeError(CAPTURE_SYNC_ERROR)  # a Python value (bool(), int(), len of a result ...)
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
        """Run the queue up to ``mark`` (a :class:`_Mark` still queued) or, for None, all of it."""
        if self._capture is not None:
            raise RuntimeError(CAPTURE_SYNC_ERROR)  # the host would wait for the GPU in the middle of a capture
        with self._drain():
            while self._queue:
                item = self._queue.popleft()
                if isinstance(item, _Mark):
                    item.done = True
                    if item is mark:
                        return
                else:
                    item()

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
    def _is_our_device(self, device) -> bool:
        """An explicit ``device=`` of a factory names the emulated GPU: ``s.device``, or any CUDA device."""
        if device is None:
            return False
        d = torch.device(device)
        return d.type == "cuda" or d == self.device

    def _names_gpu(self, device) -> bool:
        """A ``to()`` target names the emulated GPU: ``s.device`` itself, or any CUDA device (an int
        too, as torch reads it). Any other CPU device (``"cpu"``) is host memory."""
        if device is self.device:
            return True
        if isinstance(device, int) and not isinstance(device, bool):
            return True
        return torch.device(device).type == "cuda"

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
            vals = dict(zip(("device", "non_blocking"), rest), **kwargs)
            return "gpu", None, bool(vals.get("non_blocking", False)), False
        form = ("other" if rest and isinstance(rest[0], torch.Tensor)
                else "dtype" if rest and isinstance(rest[0], torch.dtype) else "device")
        names = _TO_FORMS[form]
        vals = dict(zip(names, rest))
        vals.update(kwargs)
        # torch's own check of the arguments (it knows no copy=; an int device is a CUDA index)
        check = list(rest[: len(names) - 1]) if len(rest) == len(names) else list(rest)
        check_kw = {k: v for k, v in kwargs.items() if k != "copy"}
        if form == "device" and check and isinstance(check[0], int) and not isinstance(check[0], bool):
            check[0] = torch.device("cuda", check[0])
        if isinstance(check_kw.get("device"), int) and not isinstance(check_kw["device"], bool):
            check_kw["device"] = torch.device("cuda", check_kw["device"])
        torch._C._nn._parse_to(*check, **check_kw)
        if form == "other":
            other = vals["other"]
            device, dtype = (self.device if self.is_device(other) else other.device), other.dtype
        else:
            device, dtype = vals.get("device"), vals.get("dtype")
        if device is None:
            target = None
        elif self._names_gpu(device):
            target = "gpu"
        else:
            target = "host" if torch.device(device).type == "cpu" else torch.device(device)
        return target, dtype, bool(vals.get("non_blocking", False)), bool(vals.get("copy", False))

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
