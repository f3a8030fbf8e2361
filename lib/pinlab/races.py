"""A race detector for asynchronous copies: find where *your* host code touches memory that a queued copy
has not finished with.

(Why over 500 lines: one ``TorchFunctionMode`` with the three hazards it watches, the two clocks that say
when a queued copy has run (CUDA events; the emulated stream's queue), the graph hooks, and the report;
split, the rules would no longer read side by side. Its sibling is :mod:`pinlab.detector`, whose argument
parser, layout rule and ``file:line`` finder it reuses.)

Wrap the code you want to check::

    from pinlab.races import detect_races

    with detect_races() as races:
        for step in range(100):
            ...                           # your loop
    print(races)                          # or races.summary(), races.findings, races.counts

It reports three hazards, each at the ``file:line`` of the copy and of the place it was first seen:

* **the host rewrote the source of a pending H2D copy**: ``dst.copy_(pinned, non_blocking=True)`` (or
  ``pinned.to("cuda", non_blocking=True)``, ``.cuda(non_blocking=True)``) queues a DMA that reads
  ``pinned`` when the GPU gets to it; a write to ``pinned`` before then changes what the GPU receives
  (lessons 03 and 04: the reused pinned buffer). The detector keeps a copy (a *shadow*) of the bytes the
  copy should read, and compares it with the memory at every later torch call that touches that memory,
  a few other pending copies at each copy call in turn, and all of them when the block ends; a write made
  outside torch (through ``numpy()``) is seen there too;
* **the host read (or wrote) the destination of a pending D2H copy**: ``pinned.copy_(gpu,
  non_blocking=True)`` and ``gpu.to("cpu", non_blocking=True)`` return before the data has arrived;
  ``.tolist()``, ``.item()``, printing, ``torch.equal`` or arithmetic on it before the copy's event has
  completed read stale bytes (lesson 02), and a write is lost when the DMA lands (vLLM #51571). A view
  taken with ``numpy()`` while the copy is pending counts as a read: what numpy reads next the detector
  cannot see;
* **the host rewrote what a graph replay reads**: a copy from pinned memory captured in a CUDA graph reads
  its source again at every ``replay()``; a rewrite before the replay's work has run is the same race
  (lesson 08). Graphs captured while the detector is active are followed.

A copy is *pending* until an event recorded right after it has completed (``torch.cuda.Event.query()``),
on the stream it was queued on; on the emulated stream (:class:`pinlab.LaggingStream`), until the emulated
GPU has run it. Pageable and blocking copies are never pending (the driver staged them, or the host
waited), and neither is a pinned copy whose host side torch first copies into a pageable temporary (a
non-contiguous pinned view): :func:`pinlab.detector.host_layout_ok` decides that, as for the stall
detector.

What it cannot see: copies made outside torch's Python API (a C++ extension's own ``cudaMemcpyAsync``;
declare those with :meth:`RaceDetector.copied`), writes through numpy that no later torch call touches
before the copy completes, and copies queued before the block started. Copies over ``max_shadow_bytes``
are not compared; they are counted in ``report.unchecked`` and the summary says so.

On a machine without CUDA, enter it *inside* ``with pinlab.stream() as s:`` or around it: a
:class:`LaggingStream` entered while a detector is active gets the detector too, so the pytest gate
(:mod:`pinlab_pytest`) works on CPU. ``raise_on=`` turns findings of the kinds named into a
:class:`RaceError` at once, naming the fix. Detectors nest (each sees every call), state is restored on exit
and after exceptions, and, like :func:`pinlab.detect_stalls`, a detector sees the thread that entered it.

Prior art: CuSan (``tudasc/cusan``: CUDA-aware ThreadSanitizer, C/C++) and ARBALEST (data races in OpenMP
offloading); PyTorch's CUDA sanitizer (``torch.cuda._sanitizer``) tracks CUDA tensors only, and
compute-sanitizer device-side accesses only: neither sees host memory that a queued copy will read.
"""
from __future__ import annotations

import ctypes
import numbers
import sys
import threading
from collections import Counter, deque
from dataclasses import asdict, dataclass

import torch
from torch.overrides import TorchFunctionMode

from .args import positive_int
from .copyargs import copy_call
from .detector import _caller_codes, find_caller, host_layout_ok
from .text import fmt_bytes
from .streams import _NO_DATA as _STREAM_NO_DATA

# --- kinds ------------------------------------------------------------------------------------------

H2D_REWRITE = "host rewrote the source of a pending H2D copy"
D2H_READ = "host read the destination of a pending D2H copy"
D2H_WRITE = "host wrote the destination of a pending D2H copy"
GRAPH_REWRITE = "host rewrote what a pending graph replay reads"
KINDS = (H2D_REWRITE, D2H_READ, D2H_WRITE, GRAPH_REWRITE)

#: what to do about each kind (the summary and :class:`RaceError` say it)
FIXES = {
    H2D_REWRITE: ("copy from a fresh pinned snapshot each step (pinlab.pin_snapshot, or pin_memory() of a "
                  "pageable buffer), use a ring of pinned buffers guarded by events (wait for a slot's event "
                  "before rewriting it), or wait for this copy's event before writing the buffer"),
    D2H_READ: ("record an event after the copy and call event.synchronize() (or check event.query()) before "
               "reading the destination"),
    D2H_WRITE: ("wait for the copy's event before writing its destination, or give each copy a buffer of "
                "its own"),
    GRAPH_REWRITE: ("a captured copy reads its pinned source again at every replay(): wait for an event "
                    "recorded after replay() before rewriting the source, or stage each step's inputs in a ring "
                    "of pinned buffers with one graph per slot"),
}


class RaceError(RuntimeError):
    """Raised by :func:`detect_races` for a kind listed in ``raise_on``, where the hazard is first seen."""


# --- torch calls --------------------------------------------------------------------------------------

# Calls that look at metadata or make views: they read no data (a pending D2H destination may be touched).
# The emulated stream's list of them, and a few more that matter only here.
_NO_DATA = frozenset(_STREAM_NO_DATA) | {
    "is_cpu", "__set__", "record_stream", "__del__", "_is_view", "is_sparse", "is_quantized", "is_meta",
    "is_nested", "__dlpack_device__",
}
_INPLACE_DUNDERS = frozenset({
    "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
    "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__",
})
_COPY_NAMES = frozenset({"copy_", "to", "cuda"})
# In-place calls that write their first argument without reading it.
_PURE_WRITES = frozenset({"copy_", "fill_", "zero_", "__setitem__", "index_put_", "index_copy_", "masked_fill_",
                          "scatter_", "index_fill_", "put_", "normal_", "uniform_", "random_", "set_"})


def _name(func) -> str:
    return getattr(func, "__name__", "")


def _writes_self(name: str) -> bool:
    """A call that writes its first argument (``fill_``, ``copy_``, ``x[i] = v``, ``x += 1``)."""
    return name in _INPLACE_DUNDERS or (name.endswith("_") and not name.startswith("__"))


def _tensors(obj) -> list:
    """The tensors in a call's arguments (a tensor, or a list, tuple or dict of them, two levels down)."""
    Tensor = torch.Tensor
    if isinstance(obj, Tensor):
        return [obj]
    out = []
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    for o in items:
        if isinstance(o, Tensor):
            out.append(o)
        elif isinstance(o, (list, tuple)):
            out.extend(x for x in o if isinstance(x, Tensor))
    return out


def _storage_key(t: torch.Tensor):
    try:
        st = t.untyped_storage()
        return st.data_ptr() if st.nbytes() else None
    except (RuntimeError, NotImplementedError, TypeError):  # sparse, meta, tensor subclasses without storage
        return None


def _region(t: torch.Tensor) -> int | None:
    """Bytes of memory a dense tensor covers from ``data_ptr()`` on (None if its strides are negative)."""
    if any(s < 0 for s in t.stride()):
        return None
    return t.numel() * t.element_size()


def _read(ptr: int, nbytes: int) -> bytes:
    return ctypes.string_at(ptr, nbytes) if nbytes else b""


# --- clocks: when has a queued copy run? ----------------------------------------------------------------

class _CudaClock:
    """Copies queued on CUDA streams: each pending copy holds an event recorded on its stream after it
    (events come from a pool: a completed one is recorded again rather than made anew)."""

    emulated = False

    def __init__(self):
        self._free: list = []

    @staticmethod
    def capturing() -> bool:
        return bool(torch.cuda.is_current_stream_capturing())

    def mark(self):
        ev = self._free.pop() if self._free else torch.cuda.Event()
        ev.record()
        return ev

    @staticmethod
    def done(mark) -> bool:
        return mark.query()

    def release(self, mark) -> None:
        """A mark whose copy has run: its event may be recorded again (a pool of at most 64)."""
        if len(self._free) < 64:
            self._free.append(mark)

    @staticmethod
    def is_device(t: torch.Tensor) -> bool:
        return t.is_cuda

    @staticmethod
    def is_pinned(t: torch.Tensor) -> bool:
        return t.is_pinned()


class _EmulatedClock:
    """Copies queued on a :class:`pinlab.LaggingStream`: the n-th item pushed on a queue has run once the
    queue has taken n + 1 items out (it runs them in order)."""

    emulated = True

    def __init__(self, lag):
        self.lag = lag

    def capturing(self) -> bool:
        return self.lag._capture is not None

    def mark(self):
        q = self.lag._queue
        return q, q.pushed - 1  # the item the copy (or replay) just queued

    @staticmethod
    def done(mark) -> bool:
        q, index = mark
        pushed, waiting = q.state()
        return index < pushed - waiting

    @staticmethod
    def release(mark) -> None:
        return None

    def is_device(self, t: torch.Tensor) -> bool:
        return self.lag.is_device(t)

    def is_pinned(self, t: torch.Tensor) -> bool:
        return self.lag.is_pinned(t)


# --- findings and the report ---------------------------------------------------------------------------

@dataclass
class RaceFinding:
    """One hazard at one copy site: what, where the copy was made, where it was first seen, how often."""

    kind: str
    copy_where: str
    seen_where: str
    nbytes: int
    count: int = 1

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        times = "once" if self.count == 1 else f"in {self.count} copies"
        return (f"{self.kind}: the copy at {self.copy_where} ({fmt_bytes(self.nbytes)}), first seen at "
                f"{self.seen_where}, {times}")


class RaceReport:
    """What a :func:`detect_races` block found.

    ``findings``: one :class:`RaceFinding` per (kind, copy site), in the order first seen; ``counts``: copies
    affected per kind; ``total``: all of them. ``copies``: pending copies followed (H2D, D2H and replayed
    graph copies); ``raced``: the ordinals (0, 1, ... in the order followed) of the copies that raced, so a
    loop that follows one copy per step can say which steps; ``checks``: byte comparisons made;
    ``unchecked``: copies over ``max_shadow_bytes`` per copy site (not compared; a D2H destination is still
    followed for reads). ``summary()`` / ``print(report)``: a table with the fixes.
    """

    def __init__(self):
        self.findings: list[RaceFinding] = []
        self.raced: list[int] = []
        self.counts: Counter = Counter()
        self.unchecked: Counter = Counter()
        self.copies = 0
        self.checks = 0
        self._by_site: dict = {}

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __len__(self) -> int:
        return self.total

    def count(self, kind: str | None = None) -> int:
        """Copies affected by one kind of hazard (all kinds for ``None``)."""
        if kind is None:
            return self.total
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {list(KINDS)}, got {kind!r}")
        return self.counts[kind]

    def _record(self, kind: str, copy_where: str, seen_where: str, nbytes: int) -> RaceFinding:
        self.counts[kind] += 1
        key = (kind, copy_where)
        found = self._by_site.get(key)
        if found is None:
            found = self._by_site[key] = RaceFinding(kind, copy_where, seen_where, nbytes)
            self.findings.append(found)
        else:
            found.count += 1
        return found

    def as_dict(self) -> dict:
        return {"findings": [f.as_dict() for f in self.findings], "counts": dict(self.counts),
                "copies": self.copies, "raced": list(self.raced), "checks": self.checks,
                "unchecked": dict(self.unchecked)}

    def summary(self) -> str:
        head = (f"pinlab.detect_races: {self.copies} pending cop{'y' if self.copies == 1 else 'ies'} followed, "
                f"{self.checks} check(s)")
        lines = [head + (": no races found" if not self.total else
                         f": {self.total} cop{'y' if self.total == 1 else 'ies'} raced at "
                         f"{len(self.findings)} place(s)")]
        for f in self.findings:
            lines.append(f"  {f.kind}: {f.count} x")
            lines.append(f"      copy at   {f.copy_where} ({fmt_bytes(f.nbytes)})")
            lines.append(f"      first at  {f.seen_where}")
            lines.append(f"      fix: {FIXES[f.kind]}")
        if self.unchecked:
            n = sum(self.unchecked.values())
            where = ", ".join(f"{w} ({c})" for w, c in self.unchecked.most_common(3))
            lines.append(f"  unchecked: {n} cop{'y' if n == 1 else 'ies'} over max_shadow_bytes (not compared): {where}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def __repr__(self) -> str:
        return f"RaceReport(total={self.total}, counts={dict(self.counts)}, copies={self.copies})"


# --- pending copies ----------------------------------------------------------------------------------

class _Pending:
    """One queued copy's host side: where it is, what it should read (the shadow), and its clock's mark. Copies of
    the same unchanged bytes from the same place share one record (``copies``: each one's mark and ordinal, in
    queue order; ``mark``: the newest, which has run only once all of them have)."""

    __slots__ = ("kind", "where", "ptr", "nbytes", "shadow", "key", "mark", "tensor", "live", "ordinal", "copies")

    def __init__(self, kind, where, t, nbytes, shadow, key, mark, ordinal):
        self.kind, self.where, self.nbytes, self.shadow, self.key, self.mark = kind, where, nbytes, shadow, key, mark
        self.ordinal = ordinal
        self.copies = deque([(mark[1], ordinal)])
        self.ptr = t.data_ptr()
        self.tensor = t      # holds the memory while the copy is pending (it must stay valid anyway)
        self.live = True     # False once flagged or done: no more comparisons


# --- the mode -------------------------------------------------------------------------------------------

class _RaceMode(TorchFunctionMode):
    def __init__(self, det: "RaceDetector", clock):
        super().__init__()
        self.det = det
        self.clock = clock

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        det, clock = self.det, self.clock
        if det._lags and det._emulated_gpu_running():
            return func(*args, **kwargs)  # the emulated GPU runs queued work: not the host's calls
        name = getattr(func, "__name__", "")
        copy = name in _COPY_NAMES
        if not det._tracked:
            if not copy:
                return func(*args, **kwargs)  # nothing pending: a set lookup per call
            out = func(*args, **kwargs)
            det._after_copy(clock, name, args, kwargs, out)
            return out
        with torch._C.DisableTorchFunction():
            touched = det._touched(args, kwargs)  # the pending copies whose memory this call touches
        if touched:
            det._check_access(touched, name, args, kwargs)
        out = func(*args, **kwargs)
        if touched:
            with torch._C.DisableTorchFunction():
                det._compare(touched, known_pending=True)
        if copy:
            with torch._C.DisableTorchFunction():
                det._scan_some()
            det._after_copy(clock, name, args, kwargs, out)
        return out


# --- hooks: graphs and emulated streams entered inside a detector ----------------------------------------

_local = threading.local()
_hook_lock = threading.Lock()
_hook_users = 0
_saved: list = []


def _active() -> list:
    """The detectors active in this thread, outermost first."""
    if not hasattr(_local, "active"):
        _local.active = []
    return _local.active


def _graph_classes() -> list:
    from .streams import _EmulatedGraph

    classes = [_EmulatedGraph]
    real = getattr(getattr(torch.cuda, "graphs", None), "CUDAGraph", None)
    if isinstance(real, type):
        classes.append(real)
    return classes


def _patch(cls, attr, make):
    had = attr in cls.__dict__
    old = cls.__dict__.get(attr)
    setattr(cls, attr, make(getattr(cls, attr)))
    _saved.append((cls, attr, had, old))


def _install_hooks() -> None:
    """While any detector is active: follow graph captures and replays, and give a LaggingStream entered
    inside an active detector that detector too (its mode sits above the stream's)."""
    global _hook_users
    with _hook_lock:
        _hook_users += 1
        if _hook_users > 1:
            return
        from .streams import LaggingStream

        for cls in _graph_classes():
            _patch(cls, "capture_begin", _then_tell("_capture_begin"))
            _patch(cls, "capture_end", _then_tell("_capture_end"))
            _patch(cls, "replay", _then_tell("_replayed"))
        _patch(LaggingStream, "__enter__", _wrap_stream_enter)
        _patch(LaggingStream, "__exit__", _wrap_stream_exit)
        for cls in _flashinfer_wrappers():
            _patch(cls, "plan", _wrap_flashinfer_plan)


def _remove_hooks() -> None:
    global _hook_users
    with _hook_lock:
        _hook_users -= 1
        if _hook_users:
            return
        while _saved:
            cls, attr, had, old = _saved.pop()
            if had:
                setattr(cls, attr, old)
            else:
                delattr(cls, attr)


def _then_tell(hook: str):
    """A wrapper maker for a graph method: call it, then ``detector.<hook>(graph)`` for each active detector."""
    def wrap(orig):
        def method(graph, *args, **kwargs):
            out = orig(graph, *args, **kwargs)
            for det in _active():
                getattr(det, hook)(graph)
            return out
        method.__name__ = orig.__name__
        return method
    return wrap


#: the bytes of a FlashInfer wrapper's pinned int workspace a detector compares after each ``plan()`` (the
#: host planner writes the plan info at its start, then copies it to the GPU with its own cudaMemcpyAsync,
#: which torch does not see; 64 KiB covers the plan of batches into the thousands)
FLASHINFER_PLAN_BYTES = 64 * 1024


def _flashinfer_wrappers() -> list:
    """FlashInfer's wrapper classes with a ``plan()``, if FlashInfer is already imported (never imported here)."""
    fi = sys.modules.get("flashinfer")
    if fi is None:
        return []
    out = []
    for name in dir(fi):
        cls = getattr(fi, name, None)
        if isinstance(cls, type) and name.endswith("Wrapper") and "plan" in cls.__dict__:
            out.append(cls)
    return out


def _wrap_flashinfer_plan(orig):
    def plan(wrapper, *args, **kwargs):
        out = orig(wrapper, *args, **kwargs)
        buf = getattr(wrapper, "_pin_memory_int_workspace_buffer", None)
        if isinstance(buf, torch.Tensor) and buf.numel():
            for det in _active():
                if det._modes and not isinstance(det._modes[-1].clock, _NoClock):
                    nbytes = min(buf.numel() * buf.element_size(), FLASHINFER_PLAN_BYTES)
                    det.copied(buf, nbytes=nbytes, where=find_caller(sys._getframe(), callers=det.callers))
        return out
    return plan


def _wrap_stream_enter(orig):
    def __enter__(lag):
        out = orig(lag)
        children = []
        for det in list(_active()):
            children.append(det._enter_child(lag))
        lag.__dict__.setdefault("_race_children", []).append(children)
        return out
    return __enter__


def _wrap_stream_exit(orig):
    def __exit__(lag, *exc):
        stack = lag.__dict__.get("_race_children") or [[]]
        children = stack.pop() if stack else []
        exc = tuple(exc) + (None,) * (3 - len(exc))
        try:
            if exc[0] is None and children:
                lag.synchronize()  # what is still queued runs first, as the stream's own exit would
        finally:
            # the children's modes sit above the stream's: they leave first
            for det, mode in reversed(children):
                det._exit_child(mode, lag, exc)
        return orig(lag, *exc)
    return __exit__


def _emulated_stream_active():
    """The LaggingStream whose mode is nearest the top of this thread's function-mode stack, if any."""
    from torch.overrides import _get_current_function_mode_stack

    from .streams import _Mode

    for mode in reversed(_get_current_function_mode_stack()):
        if isinstance(mode, _Mode):
            return mode.s
    return None


# --- the detector ---------------------------------------------------------------------------------------

class RaceDetector:
    """The context manager :func:`detect_races` returns; ``with`` gives its :class:`RaceReport`.

    It may be entered again after it has exited (the report keeps counting), but not while it is active;
    for nesting, make a second detector.
    """

    #: the torch function mode each block enters (pinlab.order's watch="copies" gives one that is not pushed on
    #: torch's mode stack: only the calls it patches reach it)
    _mode_class = _RaceMode

    def __init__(self, *, raise_on=None, max_shadow_bytes: int = 1 << 20, scan_per_copy: int = 2, callers=None):
        if raise_on is None or raise_on is False:
            raise_on = frozenset()
        elif raise_on is True:
            raise_on = frozenset(KINDS)
        else:
            if isinstance(raise_on, (str, bytes)) or not hasattr(raise_on, "__iter__"):
                raise TypeError(f"raise_on must be None, True (every kind) or a set of kinds (e.g. "
                                f"{{pinlab.races.H2D_REWRITE}}), got {type(raise_on).__name__} ({raise_on!r})")
            raise_on = frozenset(raise_on)
            unknown = sorted(k for k in raise_on if k not in KINDS)
            if unknown:
                raise ValueError(f"raise_on holds unknown kind(s) {unknown}; the kinds are {list(KINDS)}")
        for arg, value in (("max_shadow_bytes", max_shadow_bytes), ("scan_per_copy", scan_per_copy)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"{arg} must be an int, got {type(value).__name__} ({value!r})")
        self.max_shadow_bytes = positive_int("max_shadow_bytes", max_shadow_bytes, allow_zero=True)
        self.scan_per_copy = positive_int("scan_per_copy", scan_per_copy, allow_zero=True)
        self.raise_on = raise_on
        self.callers = _caller_codes(callers)
        self.report = RaceReport()
        self._modes: list = []                 # this detector's modes (the main one, then children), innermost last
        self._queues: dict = {}                # stream key -> deque of (_Pending, mark), in queue order
        self._by_storage: dict = {}            # storage data_ptr -> list of live _Pending
        self._tracked = 0                      # live _Pending in _by_storage
        self._ring: deque = deque()            # live _Pending, for the round-robin comparison
        self._capturing: dict = {}             # id(graph) -> list of captured copies being recorded
        self._graphs: dict = {}                # id(graph) -> (graph weakref-less handle, captured copies)
        self._clock = None
        self._lags: list = []                  # the emulated streams this detector watches

    # --- the context -------------------------------------------------------------------------------
    def __enter__(self) -> RaceReport:
        if self._modes:
            raise RuntimeError("this detect_races() block is already active; to nest, use a second "
                               "pinlab.races.detect_races()")
        lag = _emulated_stream_active()
        if lag is not None:
            clock = _EmulatedClock(lag)
            self._lags.append(lag)
        elif torch.cuda.is_available():
            clock = _CudaClock()
        else:
            clock = None  # no GPU and no emulated stream (yet): a LaggingStream entered inside gets a child
        self._clock = clock
        _install_hooks()
        try:
            mode = self._mode_class(self, clock if clock is not None else _NoClock())
            mode.__enter__()
        except BaseException:
            _remove_hooks()
            raise
        self._modes.append(mode)
        _active().append(self)
        return self.report

    def __exit__(self, exc_type, exc, tb):
        try:
            if exc_type is None:
                with torch._C.DisableTorchFunction():
                    self._prune()
                    self._compare(list(self._ring))  # every copy still pending, once more
        finally:
            active = _active()
            if self in active:
                active.remove(self)
            modes, self._modes = self._modes, []
            for mode in reversed(modes):
                mode.__exit__(exc_type, exc, tb)
            self._queues.clear()
            self._by_storage.clear()
            self._ring.clear()
            self._tracked = 0
            self._capturing.clear()
            self._graphs.clear()
            self._lags.clear()
            _remove_hooks()
        return False

    def _emulated_gpu_running(self) -> bool:
        return any(lag._draining for lag in self._lags)

    def _enter_child(self, lag):
        mode = self._mode_class(self, _EmulatedClock(lag))
        mode.__enter__()
        self._modes.append(mode)
        self._lags.append(lag)
        return self, mode

    def _exit_child(self, mode, lag, exc) -> None:
        if exc[0] is None:
            with torch._C.DisableTorchFunction():
                self._prune()
                self._compare(list(self._ring))
        if mode in self._modes:
            self._modes.remove(mode)
        if lag in self._lags:
            self._lags.remove(lag)
        mode.__exit__(*exc)

    # --- declaring a copy made outside torch -------------------------------------------------------------
    def copied(self, src: torch.Tensor, *, nbytes: int | None = None, where: str | None = None) -> None:
        """Declare that an asynchronous H2D copy from pinned ``src`` (its first ``nbytes`` bytes) was queued
        just now on the current stream by code the detector cannot see (a C++ extension's own
        ``cudaMemcpyAsync``, such as FlashInfer's ``plan()`` staging its plan info): it is then followed like
        any other pending copy. Since that code has just written ``src`` (outside torch), the copies still
        pending from the same memory are compared first: a new copy from a buffer an earlier copy has not
        finished reading is the reused-buffer race, reported where ``copied()`` is called. Keep the detector
        to call it: ``det = detect_races()``, then ``with det as races: ...; det.copied(buf)``."""
        if not isinstance(src, torch.Tensor):
            raise TypeError(f"src must be a torch.Tensor (the pinned host buffer the copy reads), got "
                            f"{type(src).__name__}")
        if not self._modes:
            raise RuntimeError("copied() needs an active detector: call it inside `with detect_races() as r:`")
        clock = self._modes[-1].clock
        size = _region(src)
        if size is None or not src.is_contiguous():
            raise ValueError("src must be a contiguous tensor (the bytes the copy reads)")
        if nbytes is not None:
            if isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Integral):
                raise TypeError(f"nbytes must be an int or None, got {type(nbytes).__name__}")
            if not 0 < nbytes <= size:
                raise ValueError(f"nbytes must be in 1..{size} (the bytes src holds), got {nbytes}")
            size = int(nbytes)
        site = where if where is not None else find_caller(sys._getframe(1), callers=self.callers)
        with torch._C.DisableTorchFunction():
            self._prune()
            key = _storage_key(src)
            if key is not None and key in self._by_storage:
                self._compare(list(self._by_storage[key]))
            self._track(clock, H2D_REWRITE, site, src, size, clock.mark() if not clock.capturing() else None)

    # --- bookkeeping -------------------------------------------------------------------------------------
    def _track(self, clock, kind, where, t, nbytes, mark) -> None:
        ordinal = self.report.copies
        self.report.copies += 1
        if kind == D2H_READ:
            # a D2H destination changes when the DMA lands, which on a GPU may be before its event completes:
            # its bytes are compared only on the emulated stream (where nothing lands before the queue runs);
            # on CUDA, reads and writes through torch calls are what is seen
            shadow = _read(t.data_ptr(), nbytes) if clock.emulated and nbytes <= self.max_shadow_bytes else None
        elif nbytes > self.max_shadow_bytes:
            self.report.unchecked[where] += 1
            return
        else:
            shadow = _read(t.data_ptr(), nbytes)
        key = _storage_key(t)
        if key is None:
            return
        queue = self._queues.setdefault(id(clock), deque())
        if mark is not None and shadow is not None:
            ptr = t.data_ptr()
            for q in self._by_storage.get(key, ()):
                # the same bytes queued again from the same place, unchanged since: one record with one more copy,
                # so that a buffer copied N times while its copies are pending costs one comparison per touch, not
                # N (issue 48: 2,000 pending copies of one buffer took 31 s)
                if q.live and q.kind == kind and q.ptr == ptr and q.nbytes == nbytes and q.where == where \
                        and q.mark[0] is clock and q.shadow == shadow:
                    q.copies.append((mark, ordinal))
                    q.mark = (clock, mark)
                    queue.append((q, mark))
                    return
        p = _Pending(kind, where, t, nbytes, shadow, key, (clock, mark), ordinal)
        # one queue per clock, in the order copies were queued: copies on other streams may complete out of
        # order, which only delays their retirement (a touched copy is asked itself whether it has run)
        queue.append((p, mark))
        self._by_storage.setdefault(key, []).append(p)
        self._ring.append(p)
        self._tracked += 1

    def _retire(self, p: _Pending) -> None:
        if not p.live:
            return
        p.live = False
        p.tensor = None
        self._tracked -= 1
        lst = self._by_storage.get(p.key)
        if lst is not None:
            try:
                lst.remove(p)
            except ValueError:
                pass
            if not lst:
                del self._by_storage[p.key]

    def _prune(self) -> None:
        """Retire the copies that have run (each queue in order: stop at the first still pending)."""
        for q in self._queues.values():
            while q:
                p, mark = q[0]
                clock = p.mark[0]
                if not clock.done(mark):
                    break
                q.popleft()
                if p.copies and p.copies[0][0] is mark:
                    p.copies.popleft()
                if p.mark[1] is mark:  # its newest copy has run (a shared record: every one of them)
                    self._retire(p)
                if not (q and q[0][1] is mark):  # a replay's copies share one mark: the last frees it
                    clock.release(mark)
        if self._ring and len(self._ring) > 2 * self._tracked + 8:
            self._ring = deque(p for p in self._ring if p.live)

    def _touched(self, args, kwargs) -> list:
        """The live pending copies whose host memory a call's tensors share, each asked (unless a stream is
        capturing, when CUDA refuses event queries) whether it has run: those that have are retired."""
        found = []
        by_storage = self._by_storage
        for obj in (args, kwargs) if kwargs else (args,):
            for t in _tensors(obj):
                if not t.is_cpu:
                    continue
                lst = by_storage.get(_storage_key(t))
                if lst:
                    found.extend(p for p in lst if p not in found)
        if found and not self._capturing:
            for p in list(found):
                clock, mark = p.mark
                if clock.done(mark):
                    self._retire(p)
                    found.remove(p)
        return found

    def _check_access(self, touched, name, args, kwargs) -> None:
        """Before a call: does it read or write the destination of a pending D2H copy?"""
        dests = [p for p in touched if p.kind == D2H_READ]
        if not dests:
            return
        if name in _NO_DATA:
            return
        with torch._C.DisableTorchFunction():
            first = args[0] if args else None
            out = kwargs.get("out")
            written = {_storage_key(t) for t in _tensors(out)} if out is not None else set()
            if isinstance(first, torch.Tensor) and _writes_self(name):
                written.add(_storage_key(first))
            read_keys = {_storage_key(t) for i, a in enumerate(args) for t in _tensors(a)
                         if not (i == 0 and name in _PURE_WRITES)}
            read_keys.update(_storage_key(t) for k, v in kwargs.items() if k != "out" for t in _tensors(v))
        where = None
        for p in dests:
            if p.key in read_keys:
                kind = D2H_READ
            elif p.key in written:
                kind = D2H_WRITE
            else:
                continue
            where = where or find_caller(sys._getframe(), callers=self.callers)
            self._flag(p, kind, where)

    def _compare(self, pending, known_pending: bool = False) -> None:
        """Compare pending copies' memory with their shadows; a difference is a race if the copy had not run
        (``known_pending``: asked just before the call that may have written it; otherwise asked now)."""
        where = None
        for p in pending:
            if not p.live or p.shadow is None:
                continue
            self.report.checks += 1
            if _read(p.ptr, p.nbytes) != p.shadow:
                if not known_pending and not self._capturing:
                    clock, mark = p.mark
                    if clock.done(mark):  # it ran before the write: the write was fine
                        self._retire(p)
                        continue
                kind = D2H_WRITE if p.kind == D2H_READ else p.kind
                where = where or find_caller(sys._getframe(), callers=self.callers)
                self._flag(p, kind, where)

    def _scan_some(self) -> None:
        n = self.scan_per_copy
        ring = self._ring
        while n and ring:
            p = ring.popleft()
            if not p.live:
                continue
            ring.append(p)
            n -= 1
            self._compare((p,))

    def _flag(self, p: _Pending, kind: str, where: str) -> None:
        self._retire(p)
        for ordinal in self._raced_copies(p):
            self.report.raced.append(ordinal)
            self.report._record(kind, p.where, where, p.nbytes)
        if kind in self.raise_on:
            raise RaceError(f"{kind}: the copy at {p.where} ({fmt_bytes(p.nbytes)}), seen at {where}. "
                            f"Fix: {FIXES[kind]}. (Raised because detect_races(raise_on=...) lists this kind.)")

    def _raced_copies(self, p: _Pending) -> list:
        """The ordinals of a flagged record's copies that had not run: each is one race, as if each copy had its
        own record (while a stream is capturing, CUDA refuses the question: all of them)."""
        if len(p.copies) <= 1:
            return [p.ordinal if not p.copies else p.copies[0][1]]
        clock = p.mark[0]
        if self._capturing:
            return [o for _, o in p.copies]
        return [o for m, o in p.copies if not clock.done(m)] or [p.copies[-1][1]]

    # --- copies ----------------------------------------------------------------------------------------
    def _after_copy(self, clock, name, args, kwargs, out) -> None:
        """After ``copy_``/``to``/``cuda``: follow the copy if it is queued and reads or fills pinned memory."""
        try:
            c = copy_call(name, args, kwargs)
            if c is None:
                return
            src, dst, non_blocking = c.src, (c.dst if name == "copy_" else out), c.non_blocking
            if not non_blocking or not isinstance(src, torch.Tensor) or not isinstance(dst, torch.Tensor):
                return
            if dst is src:
                return
            with torch._C.DisableTorchFunction():
                if self._tracked and not self._capturing:
                    self._prune()  # at each copy: what has run is retired (bounded memory)
                self._follow(clock, name, src, dst)
        except RaceError:
            raise
        except Exception as exc:  # noqa: BLE001 - torch has run the call; the detector must not break it
            self.report.unchecked[f"<a {name}() the detector could not read: {type(exc).__name__}: {exc}>"[:200]] += 1

    def _follow(self, clock, name, src, dst) -> None:
        src_dev, dst_dev = clock.is_device(src), clock.is_device(dst)
        if src_dev == dst_dev:
            return
        host, dev = (src, dst) if dst_dev else (dst, src)
        if host.device.type != "cpu" or not clock.is_pinned(host):
            return
        op = "Tensor.copy_" if name == "copy_" else "Tensor.to"
        if not host_layout_ok(op, host.shape, host.stride(), host.is_contiguous(), dev.shape, dev.stride(),
                              src.dtype == dst.dtype):
            return  # torch copies through a pageable temporary: nothing stays pending on `host`
        nbytes = _region(host)
        if nbytes is None:
            return
        where = find_caller(sys._getframe(), callers=self.callers)
        if clock.capturing():
            for rec in self._capturing.values():
                rec.append((GRAPH_REWRITE if dst_dev else D2H_READ, where, host, nbytes))
            return
        self._track(clock, H2D_REWRITE if dst_dev else D2H_READ, where, host, nbytes, clock.mark())

    # --- graphs ----------------------------------------------------------------------------------------
    def _capture_begin(self, graph) -> None:
        self._capturing[id(graph)] = []

    def _capture_end(self, graph) -> None:
        rec = self._capturing.pop(id(graph), None)
        if rec is not None:
            self._graphs[id(graph)] = (graph, rec)

    def _replayed(self, graph) -> None:
        entry = self._graphs.get(id(graph))
        if entry is None or entry[0] is not graph or not self._modes:
            return
        clock = self._modes[-1].clock
        with torch._C.DisableTorchFunction():
            self._prune()
            mark = clock.mark()
            for kind, where, host, nbytes in entry[1]:
                self._track(clock, kind, where, host, nbytes, mark)


class _NoClock:
    """Neither CUDA nor an emulated stream (yet): nothing can be pending (a copy to a GPU fails anyway)."""

    emulated = False

    @staticmethod
    def capturing() -> bool:
        return False

    @staticmethod
    def is_device(t) -> bool:
        return t.is_cuda

    @staticmethod
    def is_pinned(t) -> bool:
        return False

    @staticmethod
    def mark():
        raise RuntimeError("no copy can be pending here: there is no CUDA device and no emulated stream "
                           "(make the copy inside `with pinlab.stream() as s:`)")


def detect_races(*, raise_on=None, max_shadow_bytes: int = 1 << 20, scan_per_copy: int = 2,
                 callers=None) -> RaceDetector:
    """Report where your host code touches memory a queued copy has not finished with:
    ``with detect_races() as races: ...`` (see the module docstring for what it sees and misses).

    ``raise_on``: ``None``, ``True`` (every kind) or a set of kinds from :data:`KINDS`; a hazard of such a
    kind raises :class:`RaceError` where it is first seen, naming the fix.
    ``max_shadow_bytes``: the largest copy (bytes) whose source is compared (a copy of its bytes is kept
    while it is pending); larger ones are counted in ``report.unchecked``.
    ``scan_per_copy``: how many other pending copies each copy call compares in turn (for writes made
    outside torch); the memory any torch call touches is always compared.
    ``callers``: as for :func:`pinlab.detect_stalls`: functions whose lines count as your code even under
    pinlab or torch.
    """
    return RaceDetector(raise_on=raise_on, max_shadow_bytes=max_shadow_bytes, scan_per_copy=scan_per_copy,
                        callers=callers)
