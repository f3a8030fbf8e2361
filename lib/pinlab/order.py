"""Races found by order, not by luck: :func:`detect_races` with a happens-before verdict.

(Why about 950 lines, and a module of its own: the happens-before book, the hooks on every operation that orders
the host, the byte-range matching, the copies-only watch and the emulated stream at any lag belong to one rule and
read side by side.
:mod:`pinlab.races` decides "pending" by asking a copy's event whether the GPU has
run it yet, so it sees a race only when this run's timing makes it happen; a GPU that keeps up, or
``CUDA_LAUNCH_BLOCKING=1``, hides it. This module keeps that detector's torch function mode, hooks, copy
parser and report, and replaces its one rule: when a copy stops being a hazard. The lessons still show the
timing verdict of :mod:`pinlab.races`; they move to this one with their next GPU recording, and the two
modules then become one.)

Use it like :func:`pinlab.races.detect_races`::

    from pinlab.order import detect_races

    with detect_races() as races:                 # verdict="order", the default
        for step in range(100):
            ...                                   # your loop
    print(races)                                  # "can race" and "raced in this run", per copy site

**The rule.** A queued copy's host memory stays *unordered* from its enqueue until a host-side operation
orders it after the copy:

* ``event.synchronize()`` of an event recorded after the copy on its stream, or ``event.query()`` that
  returned True;
* ``stream.synchronize()`` of its stream, ``torch.cuda.synchronize()`` (or any device synchronize);
* a blocking copy or an implicit sync (``.item()``, ``.tolist()``, ``bool()``, a pageable D2H copy, ...) on a
  stream that ran after it: torch reports each as a stream synchronization;
* **not** ``wait_event`` / ``wait_stream`` alone: those order GPU work, not the host. They count only when the
  host then waits on the stream that waited (a vector clock per stream carries them there).
* **not** the end of the detector's block.

A host write to an unordered H2D source (through a torch call, whether or not it changed the bytes; through
numpy or another thread, when its bytes differ from what was queued), and a host read or write of an unordered
D2H destination, is a race **whether or not it corrupted anything in this run**: the verdict depends on the
program's order, not on how far behind the GPU happened to be. Each finding says "can race" (order) and, next
to it, how many of those copies **raced in this run** (the copy's own event had not completed when the host
touched its memory, the timing verdict of :mod:`pinlab.races`). ``verdict="timing"`` gives the old detector.

Shadows (a copy of the bytes the copy should read) are compared where order is decided: at the operation that
orders a copy, at the next torch call touching the same bytes, every ``scan_per_copy`` copies in turn, and
when the block ends. Memory is matched by **byte range** within a storage: two slots of one pinned tensor
(``flags[0]`` and ``flags[1]``, rows, elements, strided views) are judged slot by slot.

**Memory the program frees.** A pending copy's source is held *weakly*: when the program drops it, PyTorch's
caching host allocator keeps the block until the copies that used it have completed (it records an event on
the copy's stream, ``CachingHostAllocator`` ``record_event``: docs/facts.md F4), so the block coming back from a later
``pin_memory()`` (the snapshot fix) is ordered by the allocator, not a race. Storage set or resized under a
pending copy is handled without touching freed memory (a resize while unordered is a rewrite).

**Where the order comes from.** On CUDA: torch's GPU trace (``torch._C._activate_gpu_trace``; the callbacks
of ``torch.cuda._gpu_trace``: event record, event wait, event, stream and device synchronization), which torch
fires from C++ for every one of those operations (docs/facts.md F21), the syncs inside ``.item()`` and blocking
copies included
(``c10::cuda::stream_synchronize`` and ``memcpy_and_sync`` in c10/cuda/CUDAFunctions.h, ``CUDAEvent`` in
c10/cuda/CUDAEvent.h, ``synchronizeDevice`` in c10/cuda/impl/CUDAGuardImpl.h: read in torch 2.13's headers;
the ``gpu`` tests check it on the device's torch), plus ``Event.query()`` / ``Stream.query()`` that returned
True, which torch does not trace. The vector clocks follow the rule of PyTorch's CUDA sanitizer (CSAN), which
uses the same callbacks for device tensors; :class:`_Book` says why they are not CSAN's own objects. Torch cannot
turn its GPU trace off once on (c10/core/impl/GPUTrace.h: "only flipped once"; docs/facts.md F22): after the first order detector on CUDA, every CUDA event,
synchronization and allocation of the process calls into Python (a few µs), and a torch error raised while
CUDA memory or an event is freed can then come back as ``SystemError: error return without exception set``
(docs/facts.md F24): restart the kernel (or the process) to see torch's own message. On the emulated stream
(:class:`pinlab.LaggingStream`, one queue per stream): its ``synchronize()``, its events' ``record()``,
``synchronize()`` and ``query()`` (and everything that calls them: ``.item()`` of device memory, blocking
copies, ``torch.cuda.synchronize()`` in its block).

:func:`lagging_stream` makes an emulated stream whose GPU stays at most ``lag`` items behind (``lag=0``: a GPU
that keeps up): the timing verdict then sees no race, and the order verdict names the same ones at every lag.
"""
from __future__ import annotations

import contextlib
import sys
import threading
import weakref
from collections import deque
from unittest import mock

import torch

from .args import positive_int
from .detector import find_caller
from .text import fmt_bytes
from .races import (
    D2H_READ,
    D2H_WRITE,
    FIXES,
    H2D_REWRITE,
    KINDS,
    RaceDetector,
    RaceError,
    RaceFinding,
    RaceReport,
    _CudaClock,
    _RaceMode,
    _active,
    _NO_DATA,
    _PURE_WRITES,
    _read,
    _region,
    _storage_key,
    _tensors,
    _writes_self,
)
from .streams import LaggingStream, _LaggingEvent, _Mark, _Queue

VERDICTS = ("order", "timing")
WATCHES = ("every_op", "copies")


# --- the report: two verdicts side by side ----------------------------------------------------------------

class OrderFinding(RaceFinding):
    """A :class:`pinlab.races.RaceFinding` with ``in_run``: how many of its ``count`` copies (that *can* race)
    raced in this run (the copy had not completed when the host touched its memory)."""

    def __init__(self, kind, copy_where, seen_where, nbytes, count=1, in_run=0):
        super().__init__(kind, copy_where, seen_where, nbytes, count)
        self.in_run = in_run

    def as_dict(self) -> dict:
        return {**super().as_dict(), "in_run": self.in_run}

    def __str__(self) -> str:
        return f"{super().__str__()} (can race; raced in this run: {self.in_run})"


class OrderReport(RaceReport):
    """What an order-verdict :func:`detect_races` block found: :class:`pinlab.races.RaceReport`'s fields, each
    finding an :class:`OrderFinding`; ``in_run``: copies that raced in this run, per kind (``counts``: copies
    that can race); ``ordering_ops``: host operations that ordered at least one followed copy."""

    verdict = "order"

    def __init__(self):
        super().__init__()
        self.in_run: dict = {}
        self.ordering_ops = 0

    def _record(self, kind, copy_where, seen_where, nbytes, n=1, in_run=0):
        self.counts[kind] += n
        self.in_run[kind] = self.in_run.get(kind, 0) + in_run
        key = (kind, copy_where)
        found = self._by_site.get(key)
        if found is None:
            found = self._by_site[key] = OrderFinding(kind, copy_where, seen_where, nbytes, n, in_run)
            self.findings.append(found)
        else:
            found.count += n
            found.in_run += in_run
        return found

    def as_dict(self) -> dict:
        return {**super().as_dict(), "verdict": self.verdict, "in_run": dict(self.in_run),
                "ordering_ops": self.ordering_ops}

    def summary(self) -> str:
        n = self.copies
        head = (f"pinlab.detect_races (by order): {n} cop{'y' if n == 1 else 'ies'} followed, "
                f"{self.ordering_ops} ordering operation(s), {self.checks} check(s)")
        if not self.total:
            lines = [head + ": no copy can race"]
        else:
            lines = [head + f": {self.total} cop{'y' if self.total == 1 else 'ies'} can race at "
                            f"{len(self.findings)} place(s), {sum(self.in_run.values())} raced in this run"]
        for f in self.findings:
            lines.append(f"  {f.kind}: can race {f.count} x, raced in this run {f.in_run} x")
            lines.append(f"      copy at   {f.copy_where} ({fmt_bytes(f.nbytes)})")
            lines.append(f"      first at  {f.seen_where}")
            lines.append(f"      fix: {FIXES[f.kind]}")
        if self.total and not sum(self.in_run.values()):
            lines.append("  none raced in this run (the GPU kept up, or launches were serialized): the order allows "
                         "it, so a slower GPU or a busier host will")
        if self.unchecked:
            n = sum(self.unchecked.values())
            where = ", ".join(f"{w} ({c})" for w, c in self.unchecked.most_common(3))
            lines.append(f"  unchecked: {n} cop{'y' if n == 1 else 'ies'} over max_shadow_bytes (writes through "
                         f"torch calls still judged, writes through numpy not): {where}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"OrderReport(total={self.total}, counts={dict(self.counts)}, in_run={self.in_run}, "
                f"copies={self.copies})")


# --- the happens-before book: vector clocks, CSAN's rule ---------------------------------------------------

def _merge(into: dict, other: dict) -> None:
    """``into`` now knows everything ``other`` knows (a vector clock join: the larger sequence number per stream)."""
    for stream, seq in other.items():
        if seq > into.get(stream, 0):
            into[stream] = seq


class _Book:
    """Which queued work the host is ordered after: a vector clock per stream and per recorded event, and the
    host's, with a sequence number per stream for followed copies. The rule is that of PyTorch's CUDA sanitizer
    (CSAN, ``torch.cuda._sanitizer.StreamSynchronizations``), kept to what the host's verdict needs: CSAN also
    hands the host's clock to every stream at each host wait, which changes no answer of :meth:`host` (the
    host's clock only grows; ``tests/test_order.py`` checks the two agree on random sequences).

    This module does not import ``torch.cuda._sanitizer``: importing it builds CSAN's handler, which registers
    itself on torch's GPU trace (``cuda_sanitizer = CUDASanitizer()`` at module level; the callbacks in
    ``CUDASanitizerDispatchMode.__init__``: read in torch 2.13's source, and seen on the H100 with torch 2.11).
    Once this module turns the trace on, that handler runs at every event, stream and device synchronization of
    the process and walks every stream it has seen: after ``tools/bench_races.py``'s graph section an event's
    ``record()`` and ``synchronize()`` took 3.8 ms (13.5 µs before; stop 59), with or without a detector."""

    def __init__(self):
        self.streams: dict = {}     # stream -> {stream: seq}: what work queued on it is ordered after
        self.events: dict = {}      # event -> the clock of its stream when it was recorded
        self.host_clock: dict = {}  # stream -> the last seq the host is ordered after
        self.seq: dict = {}

    def _clock(self, stream) -> dict:
        clock = self.streams.get(stream)
        if clock is None:
            clock = self.streams[stream] = {}
        return clock

    def enqueue(self, stream) -> int:
        seq = self.seq.get(stream, 0) + 1
        self.seq[stream] = seq
        self._clock(stream)[stream] = seq
        return seq

    def host(self, stream) -> int:
        """The last sequence number of ``stream`` the host is ordered after (0: none)."""
        return self.host_clock.get(stream, 0)

    def ordered(self, stream, seq) -> bool:
        return seq <= self.host(stream)

    def record(self, event, stream) -> None:
        self.events[event] = dict(self._clock(stream))

    def wait(self, event, stream) -> None:
        """Device-side: ``stream`` waits for ``event`` (orders GPU work, not the host)."""
        clock = self.events.get(event)
        if clock is not None:
            _merge(self._clock(stream), clock)

    def event_synchronized(self, event) -> None:
        clock = self.events.get(event)
        if clock is not None:
            _merge(self.host_clock, clock)

    def stream_synchronized(self, stream) -> None:
        _merge(self.host_clock, self._clock(stream))

    def device_synchronized(self) -> None:
        for clock in self.streams.values():
            _merge(self.host_clock, clock)

    def forget_event(self, event) -> None:
        self.events.pop(event, None)


# --- pending copies, by byte range -------------------------------------------------------------------------

class _Pending:
    """Copies queued from (H2D) or into (D2H) one byte range of one storage, with the bytes they should read
    (the shadow); ``positions``: each copy's (stream, seq, clock mark, ordinal), still unordered."""

    __slots__ = ("kind", "where", "ref", "base", "lo", "hi", "shadow", "key", "clock", "positions", "live", "landed",
                 "tensor")

    def __init__(self, kind, where, st, lo, nbytes, shadow, key, clock):
        self.kind, self.where, self.lo, self.hi, self.shadow, self.key = kind, where, lo, lo + nbytes, shadow, key
        self.ref = weakref.ref(st)   # weak: memory the program drops goes back to the allocator, which orders it
        self.base = st.data_ptr()    # a storage resized under the copy moves: that is a rewrite
        self.clock = clock
        self.positions: deque = deque()
        self.live = True
        self.landed = False  # a D2H copy the emulated GPU has run: its shadow is then what it wrote
        self.tensor = None   # (pinlab.races holds the tensor; here the storage is held weakly, in ref)

    @property
    def nbytes(self) -> int:
        return self.hi - self.lo

    def current(self):
        """The bytes the range holds now; None when the program freed the storage; b"" when it was resized or
        re-set under the copy (the memory the copy reads is gone: the host changed it)."""
        st = self.ref()
        if st is None:
            return None
        if st.data_ptr() != self.base or st.nbytes() < self.hi:
            return b""
        return _read(self.base + self.lo, self.hi - self.lo)


def _extent(t: torch.Tensor):
    """(first byte, one past the last byte) of the memory a tensor's elements cover, offsets within its storage
    (the caller has matched the storage); None for a tensor with no element."""
    if not t.numel():
        return None
    size = t.element_size()
    lo = t.storage_offset() * size
    span_lo = span_hi = 0
    for n, s in zip(t.shape, t.stride()):
        if n > 1:
            if s >= 0:
                span_hi += (n - 1) * s
            else:
                span_lo += (n - 1) * s
    return lo + span_lo * size, lo + (span_hi + 1) * size


def _indexed(t: torch.Tensor, index) -> torch.Tensor:
    """What ``t[index] = v`` writes: the view ``t[index]`` where the index is basic (slices, ints), else all of
    ``t`` (an advanced index writes elements a view cannot name: judged as the whole tensor)."""
    try:
        v = torch.Tensor.__getitem__(t, index)
    except Exception:  # noqa: BLE001 - torch raises its own error when the call itself runs
        return t
    return v if isinstance(v, torch.Tensor) and v._base is not None and _storage_key(v) == _storage_key(t) else t


def _covers(t: torch.Tensor, ext, lo: int, hi: int) -> bool:
    """Does one of ``t``'s elements lie in bytes [lo, hi) of its storage? ``ext``: :func:`_extent` of ``t``."""
    if ext[1] <= lo or ext[0] >= hi:
        return False
    if t.is_contiguous() or t.numel() > 1 << 16:
        return True  # dense (or too many elements to list): its extent is what it covers
    size = t.element_size()
    offs = torch.zeros((), dtype=torch.int64)
    for d, (n, s) in enumerate(zip(t.shape, t.stride())):
        shape = [1] * t.dim()
        shape[d] = n
        offs = offs + torch.arange(n, dtype=torch.int64).reshape(shape) * s
    start = (offs.reshape(-1) + t.storage_offset()) * size
    return bool(((start < hi) & (start + size > lo)).any())


# --- hooks: the operations that order the host ---------------------------------------------------------------

class _Patches:
    """Methods patched while at least one detector holds them: ``targets()`` gives (class, method name, wrapper
    maker); unittest.mock restores each method as it was when the last holder lets go, after an exception too."""

    def __init__(self, targets):
        self._targets = targets
        self._lock = threading.Lock()
        self.users = 0
        self._stack = None  # a contextlib.ExitStack of the patched methods while held

    def install(self) -> None:
        with self._lock:
            self.users += 1
            if self.users > 1:
                return
            stack = contextlib.ExitStack()
            try:
                for cls, attr, make in self._targets():
                    stack.enter_context(mock.patch.object(cls, attr, make(getattr(cls, attr))))
            except BaseException:
                stack.close()
                self.users -= 1
                raise
            self._stack = stack

    def remove(self) -> None:
        with self._lock:
            self.users -= 1
            if not self.users and self._stack is not None:
                self._stack.close()
                self._stack = None


_trace_on = False


def _detectors() -> list:
    """The order detectors active in this thread."""
    return [d for d in _active() if isinstance(d, OrderDetector) and d._modes]


def _stream_id(clock) -> int:
    """The stream a copy made now is queued on: the emulated stream's queue, or the current CUDA stream."""
    lag = getattr(clock, "lag", None)
    if lag is not None:
        return id(lag)
    # the raw cudaStream_t, as torch's GPU trace passes it: one C call (torch.cuda.current_stream() builds a
    # Stream object, 21 µs a call under the profiler on the H100, stop 59)
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(torch._C._cuda_getDevice()) if raw is not None else torch.cuda.current_stream().cuda_stream


def _ordering(update, defer: bool = False):
    """A host operation that orders: every active order detector applies ``update(book)``, then settles. A race
    found then is raised here, or (``defer``: inside torch's trace callbacks, which log exceptions instead of
    raising them) at the detector's next check."""
    dets = _detectors()
    for det in dets:
        update(det._book)
        det._settle()
    if not defer:
        for det in dets:
            det._raise_deferred()


# CUDA: torch's GPU trace (fired from C++; an exception raised in a callback is logged, not raised, by
# torch._utils.CallbackRegistry, so a race found here raises at the detector's next check)
def _on_record(event, stream):
    for det in _detectors():
        det._book.record(event, stream)


def _on_wait(event, stream):
    for det in _detectors():
        det._book.wait(event, stream)


def _on_event_sync(event):
    _ordering(lambda b: b.event_synchronized(event), defer=True)


def _on_stream_sync(stream):
    _ordering(lambda b: b.stream_synchronized(stream), defer=True)


def _on_device_sync():
    _ordering(lambda b: b.device_synchronized(), defer=True)


def _on_event_deletion(event):
    for det in _detectors():
        det._book.forget_event(event)


def _cuda_trace() -> None:
    """Turn torch's GPU trace on and register the callbacks (once a process: torch cannot undo either)."""
    global _trace_on
    if _trace_on:
        return
    import torch.cuda._gpu_trace as gpu_trace

    torch._C._activate_gpu_trace()
    gpu_trace.register_callback_for_event_record(_on_record)
    gpu_trace.register_callback_for_event_wait(_on_wait)
    gpu_trace.register_callback_for_event_synchronization(_on_event_sync)
    gpu_trace.register_callback_for_stream_synchronization(_on_stream_sync)
    gpu_trace.register_callback_for_device_synchronization(_on_device_sync)
    gpu_trace.register_callback_for_event_deletion(_on_event_deletion)
    _trace_on = True


def _query_then_order(key_of, update):
    """``query()`` that returned True orders the host (torch does not trace queries)."""
    def wrap(orig):
        def query(obj, *args, **kwargs):
            done = orig(obj, *args, **kwargs)
            if done and _active():
                key = key_of(obj)
                _ordering(lambda b: update(b, key))
            return done
        query.__name__ = orig.__name__
        return query
    return wrap


def _emulated_event_key(ev) -> int:
    key = id(ev)
    if not getattr(ev, "_pinlab_order_key", False):
        ev._pinlab_order_key = True
        weakref.finalize(ev, _forget_emulated, key)
    return key


def _forget_emulated(key) -> None:
    for det in list(_all_order_detectors):
        det._book.forget_event(key)


_all_order_detectors: "weakref.WeakSet" = weakref.WeakSet()


def _wrap_lag_record(orig):
    def record(ev, stream=None):
        out = orig(ev, stream)
        if _active():
            key = _emulated_event_key(ev)
            for det in _detectors():
                det._book.record(key, id(ev._stream))
        return out
    return record


def _wrap_lag_event_sync(orig):
    def synchronize(ev):
        if ev._mark is not None and ev._stream._capture is None and _active():
            # ordered before the emulated GPU runs (timing: what it runs next still reads the memory)
            _ordering(lambda b: b.event_synchronized(id(ev)))
        return orig(ev)
    return synchronize


def _wrap_lag_stream_sync(orig):
    def synchronize(lag):
        if lag._capture is None and not lag._draining and _active():
            _ordering(lambda b: b.stream_synchronized(id(lag)))
        return orig(lag)
    return synchronize


def _hook_targets() -> list:
    """(class, method, wrapper maker) of the operations that order the host and torch does not trace."""
    targets = [
        (_LaggingEvent, "record", _wrap_lag_record),
        (_LaggingEvent, "synchronize", _wrap_lag_event_sync),
        (_LaggingEvent, "query", _query_then_order(id, lambda b, k: b.event_synchronized(k))),
        (LaggingStream, "synchronize", _wrap_lag_stream_sync),
    ]
    if torch.cuda.is_available():
        # torch's own classes (torch.cuda.Event is the emulated one inside a LaggingStream's block)
        from torch.cuda import streams as cuda_streams

        targets += [
            (cuda_streams.Event, "query", _query_then_order(lambda e: e.cuda_event,
                                                            lambda b, k: b.event_synchronized(k))),
            (cuda_streams.Stream, "query", _query_then_order(lambda s: s.cuda_stream,
                                                             lambda b, k: b.stream_synchronized(k))),
        ]
    return targets


#: while any order detector is active, the wrappers of :func:`_hook_targets` are in place
_HOOKS = _Patches(_hook_targets)
_install_hooks, _remove_hooks = _HOOKS.install, _HOOKS.remove


class _QuietCudaClock(_CudaClock):
    """The timing clock of :mod:`pinlab.races`, whose own event queries do not count as the program's (they
    bypass the ``query()`` wrapper that orders the host). Its events are not recycled: a graph replay's copies
    share one, and a copy stays followed until the host orders it, long after its event completed. (Stop 60: a
    pool of marks, held per copy and recorded again once ordered, crashed the CUDA process with a segmentation
    fault in ``check_pin_snapshot``'s recycled-snapshot cases, on the H100 with torch 2.11, whether the pool or the
    cached recording stream was left out alone; without both it passed. Not pooled until that is understood.)"""

    @staticmethod
    def done(mark) -> bool:
        return torch._C._CudaEventBase.query(mark)

    def release(self, mark) -> None:
        return None


# --- the detector ------------------------------------------------------------------------------------------

class OrderDetector(RaceDetector):
    """:class:`pinlab.races.RaceDetector` with the happens-before verdict (see the module docstring); ``with``
    gives its :class:`OrderReport`."""

    def __init__(self, *, raise_on=None, max_shadow_bytes: int = 1 << 20, scan_per_copy: int = 2, callers=None):
        super().__init__(raise_on=raise_on, max_shadow_bytes=max_shadow_bytes, scan_per_copy=scan_per_copy,
                         callers=callers)
        self.report = OrderReport()
        self._book = _Book()
        self._streams: dict = {}        # stream -> deque of (seq, _Pending), in queue order
        self._deferred = None           # a RaceError found inside a torch trace callback, raised at the next check
        _all_order_detectors.add(self)

    # --- the context -----------------------------------------------------------------------------------
    def __enter__(self) -> OrderReport:
        if torch.cuda.is_available():
            _cuda_trace()
        _install_hooks()
        try:
            report = super().__enter__()
        except BaseException:
            _remove_hooks()
            raise
        if isinstance(self._clock, _CudaClock):
            self._clock = _QuietCudaClock()
            self._modes[0].clock = self._clock
        return report

    def __exit__(self, exc_type, exc, tb):
        try:
            super().__exit__(exc_type, exc, tb)
            for q in self._streams.values():
                q.clear()
        finally:
            _remove_hooks()
        if exc_type is None:
            self._raise_deferred()
        return False

    def _raise_deferred(self) -> None:
        err, self._deferred = self._deferred, None
        if err is not None:
            raise err

    # --- following copies ------------------------------------------------------------------------------
    def copied(self, src: torch.Tensor, *, nbytes: int | None = None, where: str | None = None) -> None:
        """:meth:`pinlab.races.RaceDetector.copied`: declare an H2D copy from pinned ``src`` queued just now by code
        the detector cannot see. ``src`` must be pinned host memory (a meta, device or pageable tensor is refused:
        nothing of it stays pending); on the emulated stream the declared copy takes its place in the queue, so it
        completes when the emulated GPU gets there, like any queued copy."""
        if isinstance(src, torch.Tensor) and self._modes:
            clock = self._modes[-1].clock
            if src.device.type != "cpu" or src.is_meta:
                raise ValueError(f"src must be the pinned host buffer the copy reads, got a tensor on "
                                 f"{src.device} (declare the host side of the copy)")
            if not clock.is_pinned(src):
                raise ValueError("src must be pinned host memory: a copy from pageable memory is staged at the call "
                                 "(nothing stays pending); pin it (pin_memory=True) or do not declare it")
            if clock.emulated and not clock.capturing():
                clock.lag._queue.append(_Mark())  # the declared copy's place: done once the emulated GPU passes it
        return super().copied(src, nbytes=nbytes, where=where)

    def _track(self, clock, kind, where, t, nbytes, mark) -> None:
        self._raise_deferred()
        ordinal = self.report.copies
        self.report.copies += 1
        over = nbytes > self.max_shadow_bytes
        if over:
            self.report.unchecked[where] += 1
        key = _storage_key(t)
        if key is None:
            return
        st = t.untyped_storage()
        lo = t.storage_offset() * t.element_size()
        if kind == D2H_READ:
            # a D2H destination changes when the DMA lands, which on a GPU may be before its event completes: its
            # bytes are compared only on the emulated stream; on CUDA, reads and writes through torch are seen
            shadow = _read(t.data_ptr(), nbytes) if clock.emulated and not over else None
        else:
            shadow = None if over else _read(t.data_ptr(), nbytes)
        stream = _stream_id(clock)
        seq = self._book.enqueue(stream)
        p = None
        for q in self._by_storage.get(key, ()):
            # the same bytes queued again, unchanged: one record with one more copy (constant cost per copy)
            if q.live and q.kind == kind and q.lo == lo and q.hi == lo + nbytes and q.clock is clock \
                    and q.ref() is st and q.shadow == shadow:
                p = q
                break
        if p is None:
            p = _Pending(kind, where, st, lo, nbytes, shadow, key, clock)
            self._by_storage.setdefault(key, []).append(p)
            self._ring.append(p)
            self._tracked += 1
        p.positions.append((stream, seq, mark, ordinal))
        self._streams.setdefault(stream, deque()).append((seq, p))

    def _retire(self, p: _Pending) -> None:
        super()._retire(p)
        p.positions.clear()

    def _settle(self) -> None:
        """After an ordering operation: every copy it ordered is compared with its shadow (was its memory
        changed while it was unordered?), then dropped."""
        book, any_ordered = self._book, False
        for stream, q in self._streams.items():
            host = book.host(stream)
            while q and q[0][0] <= host:
                seq, p = q.popleft()
                any_ordered = True
                if not p.live:
                    continue
                try:
                    self._compare((p,))
                except RaceError as err:
                    self._deferred = self._deferred or err
                if p.live:
                    while p.positions and book.ordered(p.positions[0][0], p.positions[0][1]):
                        p.positions.popleft()
                    if not p.positions:
                        self._retire(p)
        if any_ordered:
            self.report.ordering_ops += 1

    def _prune(self) -> None:
        """At each copy: what is ordered was settled when it was ordered; drop retired copies from the ring."""
        if self._ring and len(self._ring) > 2 * self._tracked + 8:
            self._ring = deque(p for p in self._ring if p.live)

    def _touched(self, args, kwargs) -> list:
        """The unordered pending copies whose bytes a call's CPU tensors share (a storage and an overlapping
        byte range); copies whose storage the program freed are retired (the allocator orders them)."""
        self._raise_deferred()
        found = []
        by_storage = self._by_storage
        for obj in (args, kwargs) if kwargs else (args,):
            for t in _tensors(obj):
                if not t.is_cpu:
                    continue
                lst = by_storage.get(_storage_key(t))
                if not lst:
                    continue
                ext = _extent(t)
                if ext is None:
                    continue
                for p in list(lst):
                    if not p.live or p in found:
                        continue
                    if p.ref() is None:  # freed: the allocator orders its reuse (this is a new storage)
                        self._retire(p)
                    elif _covers(t, ext, p.lo, p.hi):
                        found.append(p)
        return found

    def _in_run(self, p: _Pending) -> int:
        """How many of ``p``'s unordered copies had not run when the host touched their memory (timing)."""
        if self._capturing or p.clock is None:
            return 0
        return sum(1 for pos in p.positions if pos[2] is not None and not p.clock.done(pos[2]))

    def _check_access(self, touched, name, args, kwargs) -> None:
        """Before a call: does it write an unordered H2D source, or read or write an unordered D2H
        destination (byte ranges)?"""
        if name in _NO_DATA:
            return
        with torch._C.DisableTorchFunction():
            first = args[0] if args else None
            written = list(_tensors(kwargs.get("out"))) if kwargs.get("out") is not None else []
            if isinstance(first, torch.Tensor) and _writes_self(name):
                written.append(_indexed(first, args[1]) if name == "__setitem__" and len(args) > 1 else first)
            read = [t for i, a in enumerate(args) for t in _tensors(a) if not (i == 0 and name in _PURE_WRITES)]
            read += [t for k, v in kwargs.items() if k != "out" for t in _tensors(v)]
            where = None
            for p in touched:
                if not p.live:
                    continue
                hit = lambda ts: any(t.is_cpu and _storage_key(t) == p.key and  # noqa: E731
                                     (ext := _extent(t)) is not None and _covers(t, ext, p.lo, p.hi) for t in ts)
                if p.kind == D2H_READ:
                    kind = D2H_READ if hit(read) else D2H_WRITE if hit(written) else None
                else:
                    kind = p.kind if hit(written) else None  # a write, whether or not it changes the bytes
                if kind is None:
                    continue
                where = where or find_caller(sys._getframe(), callers=self.callers)
                self._flag(p, kind, where)

    def _compare(self, pending, known_pending: bool = False) -> None:
        """Compare unordered copies' memory with their shadows: a difference is a race (by order). A storage
        the program freed is retired (the allocator orders its reuse)."""
        where = None
        for p in pending:
            if not p.live:
                continue
            now = p.current()
            if now is None:
                self._retire(p)
                continue
            if p.shadow is None and now != b"":
                continue
            if p.kind == D2H_READ and not p.landed and p.clock is not None and p.clock.emulated and all(
                    pos[2] is None or p.clock.done(pos[2]) for pos in p.positions):
                p.shadow, p.landed = now, True  # the emulated GPU ran it (a bounded lag): what it wrote, from now on
                continue
            self.report.checks += 1
            if now != p.shadow:
                kind = D2H_WRITE if p.kind == D2H_READ else p.kind
                where = where or find_caller(sys._getframe(), callers=self.callers)
                self._flag(p, kind, where)

    def _flag(self, p: _Pending, kind: str, where: str) -> None:
        n, in_run = len(p.positions), self._in_run(p)
        self.report.raced.extend(pos[3] for pos in p.positions)
        self._retire(p)
        self.report._record(kind, p.where, where, p.nbytes, max(n, 1), in_run)
        if kind in self.raise_on:
            raise RaceError(f"{kind}: the copy at {p.where} ({fmt_bytes(p.nbytes)}), seen at {where}: it can race "
                            f"(nothing the host did ordered it after the copy; raced in this run: {in_run} of "
                            f"{max(n, 1)}). Fix: {FIXES[kind]}. (Raised because detect_races(raise_on=...) lists "
                            f"this kind.)")


# --- watch="copies": the copies, a few reads and writes, and the ordering operations; not every torch call ------

class _WatchMode(_RaceMode):
    """A :class:`pinlab.races._RaceMode` that is not pushed on torch's function-mode stack (a mode there sees every
    torch call: 1.19-1.82x host time alone on the course's step loops, stop 59 on an H100). Only the
    ``torch.Tensor`` methods :data:`WATCHED` names reach it, through :func:`_watched`."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


#: what watch="copies" follows: the copies (each one queued is followed, and the same memory's pending copies are
#: compared first), the host writes and reads most code uses on pinned memory; every other write is judged by
#: its bytes where order is decided (an ordering operation, the next copy from the same memory, a scan, the end
#: of the block), and every other read is not seen (watch="every_op" sees them: it locates the exact write)
WATCHED = ("copy_", "to", "cuda", "__setitem__", "__bool__", "item", "tolist", "numpy", "__int__", "__float__",
           "__index__")

_watch_local = threading.local()


def _watchers() -> list:
    """The watch="copies" detectors active in this thread, innermost first."""
    return [d for d in reversed(_active()) if isinstance(d, WatchDetector) and d._modes]


def _watched(name: str, orig):
    """``torch.Tensor.<name>`` while a watcher is active: the call goes through each active watcher's mode, as a
    torch function mode's call would (the detector's own torch calls, and those the emulated GPU makes while it
    runs queued work, go straight to torch)."""
    def method(*args, **kwargs):
        if getattr(_watch_local, "busy", False):
            return orig(*args, **kwargs)
        dets = _watchers()
        if not dets:
            return orig(*args, **kwargs)
        _watch_local.busy = True
        try:
            call = orig
            for det in reversed(dets):  # the innermost detector sees the call first, as on torch's mode stack
                call = _through(det._modes[-1], call, name)
            return call(*args, **kwargs)
        finally:
            _watch_local.busy = False
    method.__name__ = name
    method.__qualname__ = f"Tensor.{name}"
    method.__doc__ = getattr(orig, "__doc__", None)
    return method


def _through(mode, inner, name: str):
    def call(*args, **kwargs):
        return mode.__torch_function__(inner, (), args, kwargs)
    call.__name__ = name
    return call


#: while any watch="copies" detector is active, torch.Tensor's :data:`WATCHED` methods go through :func:`_watched`
_WATCH = _Patches(lambda: [(torch.Tensor, name, lambda orig, name=name: _watched(name, orig)) for name in WATCHED])
_install_watch, _remove_watch = _WATCH.install, _WATCH.remove


class WatchDetector(OrderDetector):
    """:class:`OrderDetector` (the happens-before verdict) that follows only the calls :data:`WATCHED` names and the
    ordering operations, not every torch call: ``detect_races(watch="copies")``. What it cannot see: a write
    through another torch call that leaves the bytes as they were (``buf.zero_()`` of zeros), and a read through
    another torch call (``flags.any()``); ``watch="every_op"`` sees both."""

    _mode_class = _WatchMode

    def __enter__(self) -> OrderReport:
        _install_watch()
        try:
            return super().__enter__()
        except BaseException:
            _remove_watch()
            raise

    def __exit__(self, exc_type, exc, tb):
        try:
            return super().__exit__(exc_type, exc, tb)
        finally:
            _remove_watch()


# --- the emulated stream at any lag --------------------------------------------------------------------------

class _BoundedQueue(_Queue):
    """A :class:`pinlab.LaggingStream`'s queue whose emulated GPU runs queued work as soon as more than ``lag``
    items of work wait (outside a capture, and not while it is already running work)."""

    def __init__(self, stream, lag: int):
        super().__init__()
        self.stream, self.lag = stream, lag

    def append(self, item) -> None:
        super().append(item)
        s = self.stream
        if s._draining or s._capture is not None or s._queue is not self:
            return
        while sum(1 for i in self if not isinstance(i, _Mark)) > self.lag:
            s._advance()
        while self and isinstance(self[0], _Mark):  # marks the GPU has reached
            self.popleft().done = True


def lagging_stream(lag: int = 0) -> LaggingStream:
    """A :class:`pinlab.LaggingStream` whose emulated GPU stays at most ``lag`` queued items behind the host:
    ``lag=0`` is a GPU that keeps up (every copy has run before the host's next call), where the timing verdict
    sees no race and the order verdict still names every one. The default stream lags without bound."""
    lag = positive_int("lag", lag, allow_zero=True)
    s = LaggingStream()
    s._queue = _BoundedQueue(s, lag)
    return s


# --- the entry point -----------------------------------------------------------------------------------------

def detect_races(*, verdict: str = "order", raise_on=None, max_shadow_bytes: int = 1 << 20, scan_per_copy: int = 2,
                 callers=None, watch: str = "every_op"):
    """Report where your host code can touch memory a queued copy has not finished with:
    ``with detect_races() as races: ...``.

    ``verdict``: ``"order"`` (the default, see the module docstring: races the program's order allows, each
    with how many raced in this run) or ``"timing"`` (:func:`pinlab.races.detect_races`: only races this run's
    timing made happen). ``watch`` (order verdict only): ``"every_op"`` (the default: a torch function mode sees
    every torch call, and a write is found where it is made, whatever it writes) or ``"copies"``
    (:class:`WatchDetector`: the copies, the calls :data:`WATCHED` names and the ordering operations; a write
    elsewhere is found by its bytes where order is decided). The other arguments are
    :func:`pinlab.races.detect_races`'s.
    """
    if not isinstance(verdict, str) or verdict not in VERDICTS:
        raise ValueError(f"verdict must be one of {list(VERDICTS)} ('order': what the program's order allows; "
                         f"'timing': what this run's timing made happen), got {verdict!r}")
    if not isinstance(watch, str) or watch not in WATCHES:
        raise ValueError(f"watch must be one of {list(WATCHES)} ('every_op': every torch call, to locate the exact "
                         f"write; 'copies': the copies and the ordering operations, cheaper), got {watch!r}")
    if watch == "copies" and verdict != "order":
        raise ValueError("watch='copies' needs verdict='order' (the timing verdict asks each copy's event at every "
                         "torch call: it watches every op)")
    cls = (WatchDetector if watch == "copies" else OrderDetector) if verdict == "order" else RaceDetector
    return cls(raise_on=raise_on, max_shadow_bytes=max_shadow_bytes, scan_per_copy=scan_per_copy, callers=callers)


__all__ = ["KINDS", "VERDICTS", "WATCHED", "WATCHES", "OrderDetector", "OrderFinding", "OrderReport", "RaceError",
           "WatchDetector", "detect_races", "lagging_stream"]
