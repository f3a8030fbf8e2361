"""Explicit host waits: the ``synchronize()`` calls that make the host wait for the GPU, by ``file:line``.

(Why a module of its own: :func:`pinlab.detect_stalls` sees torch calls through a ``TorchFunctionMode``, and a
``synchronize()`` is no torch call: none of them reaches a mode. This module patches them instead, while a
watch is active. It is the first step of issues 45 and 47's "detect_stalls counts explicit host waits as a kind
of their own, so its totals match the profiler's synchronize calls": lesson 09's audit uses it next, then
``detect_stalls`` (a change to :mod:`pinlab.detector` renews every lesson that measures a stall; this module,
imported by nothing yet, renews nothing).)

Wrap the code you want to check::

    from pinlab.waits import watch_waits

    with watch_waits() as waits:
        ...                               # your loop
    print(waits)                          # or waits.counts, waits.events, waits.places

What is counted, each call once, at the ``file:line`` of the first frame outside pinlab and torch (as
:func:`pinlab.detector.find_caller` finds it; ``callers=`` as for ``detect_stalls``):

* ``torch.cuda.synchronize()`` and ``torch.accelerator.synchronize()`` (``cudaDeviceSynchronize`` in the
  profiler's trace);
* ``Stream.synchronize()`` of a ``torch.cuda.Stream`` (``cudaStreamSynchronize``) and of a ``torch.Stream``;
* ``Event.synchronize()`` of a ``torch.cuda.Event`` (``cudaEventSynchronize``) and of a ``torch.Event``: the
  generic classes are immutable C types in torch 2.13 (``torch.Event.synchronize = f`` raises ``TypeError``), so
  while a watch is active the names ``torch.Event`` and ``torch.Stream`` give subclasses whose ``synchronize()``
  is counted (``isinstance`` and ``issubclass`` against them still accept torch's own instances and classes).
  transformers 5.25.0's ``DeferredStopCheck`` (``generation/utils.py:438``) makes its events so, inside
  ``generate()``: each of its waits (line 471) is counted.

Not counted: events and streams made before the watch started through ``torch.Event``/``torch.Stream`` (they are
torch's own class; ``torch.cuda`` ones are counted wherever they were made); waits inside a torch call
(``.item()``, a blocking copy, ``nonzero``: :func:`pinlab.detect_stalls` names the call); ``Event.query()``
and ``Stream.query()``, which return at once; ``wait_event``/``wait_stream``, which order GPU work, not the
host. A watch sees the thread that entered it, like the detectors; watches nest (each sees every wait).

``around``: a function of the op's name returning a context manager entered around each counted wait (lesson
09 puts each in a profiler window, to match it with the trace's ``cudaEventSynchronize``).
"""
from __future__ import annotations

import contextlib
import sys
import threading
from collections import Counter
from dataclasses import asdict, dataclass

import torch

from .detector import _caller_codes, find_caller
from .order import _Patches

DEVICE_SYNC = "torch.cuda.synchronize"
ACCELERATOR_SYNC = "torch.accelerator.synchronize"
STREAM_SYNC = "Stream.synchronize"
EVENT_SYNC = "Event.synchronize"
#: what each op is in the profiler's trace (a CUDA runtime call)
RUNTIME = {DEVICE_SYNC: "cudaDeviceSynchronize", ACCELERATOR_SYNC: "cudaDeviceSynchronize",
           STREAM_SYNC: "cudaStreamSynchronize", EVENT_SYNC: "cudaEventSynchronize"}
OPS = tuple(RUNTIME)


@dataclass
class Wait:
    """One explicit wait: the op and where in your code."""

    op: str
    where: str

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return f"{self.op} at {self.where}"


class WaitReport:
    """What a :func:`watch_waits` block counted: ``events`` (each :class:`Wait`, in order), ``counts`` (per op),
    ``places`` ((op, where) -> count), ``total``; ``print(report)`` gives a table by op and place."""

    def __init__(self):
        self.events: list[Wait] = []
        self.counts: Counter = Counter()
        self.places: Counter = Counter()

    @property
    def total(self) -> int:
        return len(self.events)

    def __len__(self) -> int:
        return self.total

    def _record(self, op: str, where: str) -> Wait:
        w = Wait(op, where)
        self.events.append(w)
        self.counts[op] += 1
        self.places[(op, where)] += 1
        return w

    def summary(self) -> str:
        if not self.total:
            return "pinlab.watch_waits: no explicit host waits"
        lines = [f"pinlab.watch_waits: {self.total} explicit host wait(s) at {len(self.places)} place(s)"]
        for op, n in sorted(self.counts.items(), key=lambda kv: (-kv[1], OPS.index(kv[0]))):
            lines.append(f"  {op} ({RUNTIME[op]})  {n:>6}")
            for (o, where), c in sorted(self.places.items(), key=lambda kv: -kv[1]):
                if o == op:
                    lines.append(f"      {c:>6} x at {where}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def __repr__(self) -> str:
        return f"WaitReport(total={self.total}, counts={dict(self.counts)})"


# --- the hooks ------------------------------------------------------------------------------------------------

_local = threading.local()
def _watches() -> list:
    """The watches active in this thread, outermost first."""
    if not hasattr(_local, "active"):
        _local.active = []
    return _local.active


def _counted(op: str, orig):
    """``orig`` (a synchronize), counted by every watch active in this thread before it runs."""
    def wait(*args, **kwargs):
        active = _watches()
        if not active or getattr(_local, "inside", False):
            return orig(*args, **kwargs)
        frame = sys._getframe(1)
        with contextlib.ExitStack() as stack:
            for w in list(active):
                w.report._record(op, find_caller(frame, callers=w.callers))
                if w.around is not None:
                    stack.enter_context(w.around(op))
            _local.inside = True  # a synchronize that calls another (torch.cuda.synchronize -> ...) counts once
            try:
                return orig(*args, **kwargs)
            finally:
                _local.inside = False
    wait.__name__ = getattr(orig, "__name__", "synchronize")
    wait.__qualname__ = getattr(orig, "__qualname__", wait.__name__)
    wait.__doc__ = getattr(orig, "__doc__", None)
    return wait


def _generic(base, op: str):
    """A subclass of torch's immutable ``base`` (``torch.Event``, ``torch.Stream``) whose ``synchronize()`` is
    counted; ``isinstance``/``issubclass`` against it accept whatever they accept against ``base``."""
    class _Meta(type(base)):
        def __instancecheck__(cls, obj):
            return isinstance(obj, base)

        def __subclasscheck__(cls, sub):
            return issubclass(sub, base)

    counted = _counted(op, base.synchronize)
    return _Meta(base.__name__, (base,), {"synchronize": counted, "__module__": base.__module__,
                                          "__qualname__": base.__qualname__, "__doc__": base.__doc__})


def _targets() -> list:
    """(owner, attribute, wrapper maker) of every synchronize this module counts (:class:`pinlab.order._Patches`)."""
    from torch.cuda import streams as cuda_streams

    out = [(torch.cuda, "synchronize", lambda orig: _counted(DEVICE_SYNC, orig)),
           (cuda_streams.Stream, "synchronize", lambda orig: _counted(STREAM_SYNC, orig)),
           (cuda_streams.Event, "synchronize", lambda orig: _counted(EVENT_SYNC, orig))]
    accel = getattr(torch, "accelerator", None)
    if accel is not None and hasattr(accel, "synchronize"):
        out.append((accel, "synchronize", lambda orig: _counted(ACCELERATOR_SYNC, orig)))
    for name, op in (("Event", EVENT_SYNC), ("Stream", STREAM_SYNC)):
        base = getattr(torch, name, None)
        if isinstance(base, type) and hasattr(base, "synchronize"):
            out.append((torch, name, lambda base, op=op: _generic(base, op)))
    return out


#: patched while at least one watch is active (the order detector's holder of its own hooks; when detect_stalls
#: counts waits, detector.py cannot import order.py, which imports it: that change moves _Patches below both)
_HOOKS = _Patches(_targets)


# --- the context manager --------------------------------------------------------------------------------------

class WaitWatch:
    """The context manager :func:`watch_waits` returns; ``with`` gives its :class:`WaitReport` (it may be entered
    again after it has exited, the report counting on, but not while it is active)."""

    def __init__(self, *, callers=None, around=None):
        if around is not None and not callable(around):
            raise TypeError(f"around must be None or a function of the op's name returning a context manager, got "
                            f"{type(around).__name__} ({around!r})")
        self.callers = _caller_codes(callers)
        self.around = around
        self.report = WaitReport()
        self._active = False

    def __enter__(self) -> WaitReport:
        if self._active:
            raise RuntimeError("this watch_waits() block is already active; to nest, use a second "
                               "pinlab.waits.watch_waits()")
        _HOOKS.install()
        _watches().append(self)
        self._active = True
        return self.report

    def __exit__(self, exc_type, exc, tb):
        self._active = False
        active = _watches()
        if self in active:
            active.remove(self)
        _HOOKS.remove()
        return False


def watch_waits(*, callers=None, around=None) -> WaitWatch:
    """Count the explicit host waits (``synchronize()`` of the device, a stream or an event) your code makes:
    ``with watch_waits() as waits: ...`` (see the module docstring for what is counted and what is not).
    ``callers``: as for :func:`pinlab.detect_stalls`; ``around``: a function of the op's name returning a context
    manager entered around each counted wait."""
    return WaitWatch(callers=callers, around=around)


__all__ = ["ACCELERATOR_SYNC", "DEVICE_SYNC", "EVENT_SYNC", "OPS", "RUNTIME", "STREAM_SYNC", "Wait", "WaitReport",
           "WaitWatch", "watch_waits"]
