"""Exercise checkers for lesson 02 (fake ``non_blocking``).

Each checker prints one verdict line (⏳ not implemented, ❌ what is wrong, ✅ correct) and returns
True or False; a hint follows from the second failure on.

* ``stall_threshold`` and ``gpu_idle_share`` (arithmetic on measurements) run on cases through
  :func:`pinlab.checks.run_cases`. Their references are the library's own: ``stall_threshold`` is
  :func:`pinlab.lessons.l02_fake_non_blocking.first_waiting_size` with half the busy time as the
  limit, ``gpu_idle_share`` is :func:`pinlab.profiler.idle_share`.
* ``step_without_syncs`` (torch code) runs the learner's step for real: on CUDA behind a busy GPU
  (a step that waits takes as long as the kernel; :func:`pinlab.detect_stalls` names the call), or
  without a GPU on :class:`WatchedLagging`, a :class:`pinlab.LaggingStream` that counts every wait
  of the host for queued device work and the call that caused it. :class:`Watch` (the copies a
  step makes, ``pin_memory()`` of pinned tensors, the order of events and copies) and the two
  watched streams are shared with lesson 03's loop checker (``checks/l03.py``).

``tests/test_checks_l02.py`` proves each checker accepts the master solution and rejects planted
wrong answers with the right message. (Over 500 lines: the watched streams and the watch belong
together with the checker they were written for; splitting them out would add a shared module that
every notebook's evidence depends on.)
"""
from __future__ import annotations

import random
from collections import Counter

from ..lessons.l02_fake_non_blocking import first_waiting_size
from ..profiler import idle_share
from . import (LearnerStop, checker, is_stub, learner_arg, learner_call, not_implemented, raised, run_cases,
              same_tensor, say)

MiB = 1 << 20

# ---- 1. stall_threshold -----------------------------------------------------------------------


def stall_threshold_reference(sizes, host_ms, busy_ms):
    """The smallest size from which on every larger copy waited (host ms > busy_ms / 2), or None."""
    return first_waiting_size(sizes, host_ms, busy_ms / 2)


def stall_cases():
    h200_sizes = [256 << i for i in range(19)]
    h200_ms = [0.014, 0.013, 0.013, 0.013, 0.013, 0.014, 0.017, 0.019, 0.027, 0.025, 0.031, 0.046,
               0.09, 0.24, 10.26, 10.69, 11.56, 13.62, 17.27]
    cases = [
        (h200_sizes, h200_ms, 10.0),                                        # the H200's shape
        ([1024, 2048, 4096, 8192, 16384], [0.01, 6.0, 0.01, 10.2, 11.0], 10.0),  # a stray slow small copy
        ([1, 2, 4], [0.1, 5.0, 10.5], 10.0),                               # exactly half is not waiting
        ([1, 2], [0.1, 10.0], 20.0),                                       # exactly half at the top: None
        ([1024, 2048, 4096], [2.5, 2.5, 2.5001], 5.0),                     # just above half, at the top only
        ([1, 2, 4, 8], [0.1, 0.2, 7.0, 12.0], 10.0),                       # waited less than the busy time
        ([4096, 1024, 65536, 2048], [12.0, 0.1, 15.0, 0.2], 10.0),         # sizes not sorted
        ([1, 2, 3], [0.1, 20.0, 0.1], 10.0),                               # the largest did not wait
        ([64, 128, 256], [0.01, 0.02, 0.03], 10.0),                        # nothing waited
        ([3 * MiB, MiB, 2 * MiB], [30.0, 25.5, 26.0], 50.0),               # everything waited
        ([5], [1.0], 1.0),                                                 # one size
    ]
    rng = random.Random(202)
    for _ in range(40):
        n = rng.randint(1, 14)
        sizes = rng.sample([1 << k for k in range(8, 28)], n)
        busy = rng.choice([5.0, 10.0, 20.0, 50.0])
        cut = rng.choice([1 << k for k in range(8, 29)])
        ms = []
        for s in sizes:
            slow = s >= cut
            if rng.random() < 0.15:
                slow = not slow  # a stray measurement
            ms.append(round(rng.uniform(busy * 0.55, busy * 1.8) if slow else rng.uniform(0.005, busy * 0.45), 3))
        cases.append((sizes, ms, busy))
    return cases


@checker
def check_stall_threshold(fn) -> bool:
    """``stall_threshold(sizes, host_ms, busy_ms)``: the smallest size from which on every larger size
    waited (host time more than half the busy time); ``None`` when the largest size did not wait."""
    return run_cases(fn, "stall_threshold", stall_cases(), stall_threshold_reference,
                     signature="(sizes, host_ms, busy_ms) -> int (a size) or None")


# ---- 2. gpu_idle_share ------------------------------------------------------------------------


def idle_cases():
    cases = [
        ([(0.0, 2.0), (3.0, 5.0)], 0.0, 10.0),                  # two kernels
        ([], 0.0, 4.0),                                         # nothing ran: idle all the time
        ([(0.0, 4.0)], 0.0, 4.0),                               # busy all the time
        ([(1.0, 3.0), (2.0, 4.0)], 0.0, 8.0),                   # overlapping (two streams)
        ([(5.0, 6.0), (1.0, 2.0), (3.0, 4.0)], 0.0, 10.0),      # not sorted
        ([(-2.0, 1.0), (9.0, 12.0)], 0.0, 10.0),                # sticking out of the window
        ([(1.0, 9.0), (2.0, 3.0)], 0.0, 10.0),                  # nested
        ([(1.0, 2.0), (2.0, 3.0)], 0.0, 4.0),                   # touching
        ([(2.0, 3.0), (0.0, 1.0), (1.0, 2.0)], 0.0, 5.0),       # a chain of touching spans, unsorted
        ([(0.0, 1.0), (1.0, 1.0), (1.0, 2.5)], 0.0, 4.0),       # touching through an empty span
        ([(-1.0, 0.0), (4.0, 5.0)], 0.0, 4.0),                  # touching the window from outside
        ([(20.0, 30.0)], 0.0, 10.0),                            # entirely outside
        ([(0.5, 2.5), (2.0, 2.2), (6.0, 9.5), (9.0, 11.0)], 0.5, 10.5),
    ]
    rng = random.Random(2)
    for _ in range(40):
        start = round(rng.uniform(-5, 5), 3)
        end = round(start + rng.uniform(0.5, 20), 3)
        spans = []
        for _ in range(rng.randint(0, 8)):
            a = round(rng.uniform(start - 3, end + 1), 3)
            spans.append((a, round(a + rng.uniform(0, 6), 3)))
        cases.append((spans, start, end))
    return cases


@checker
def check_gpu_idle_share(fn) -> bool:
    """``gpu_idle_share(spans, start, end)``: the share of the window ``[start, end]`` in which no
    kernel span is running (spans may overlap, come unsorted and stick out of the window)."""
    return run_cases(fn, "gpu_idle_share", idle_cases(), idle_share, signature="(spans, start, end) -> float")


# =============================================================================================
# 3. hidden syncs (torch code): the checker runs the learner's step for real
# =============================================================================================
#
# On CUDA the GPU is kept busy by a long kernel while the step runs: a step that waits for the
# GPU takes about as long as the kernel, a step that does not returns in a few ms. The stall
# detector (pinlab.detect_stalls) names the call that waited. Without a GPU the step runs on a
# WatchedLagging stream: a LaggingStream that counts the times the host had to wait for queued
# device work ("a wait"), with the torch call that made it wait, and that queues plain device
# arithmetic as kernels (the base emulation runs the queue for any op that reads device memory,
# so `x.abs().max()` would look like a wait; on a GPU it is two kernel launches).

import linecache
import sys
import time

import torch
from torch.overrides import TorchFunctionMode

from ..copyargs import copy_call
from ..detector import (BLOCKING_COPY, ITEM_SYNC, PAGEABLE_D2H, PAGEABLE_H2D, SCALAR_SYNC, TOLIST_SYNC,
                        detect_stalls, find_caller)
from ..device import has_cuda
from ..streams import STAGING_LIMIT, CudaStream, LaggingStream
from ..text import fmt_bytes
from ..timing import show
from ..streams import _tensors  # one walker over nested args (streams.py)

#: Ops the watched emulation queues as kernels (like a GPU launch) instead of waiting for the queue.
ASYNC_OPS = frozenset("""
abs neg exp exp2 expm1 log log2 log1p sqrt rsqrt reciprocal sigmoid tanh relu relu6 gelu silu softplus
leaky_relu hardtanh square sign sin cos floor ceil round trunc frac erf clamp clip clamp_min clamp_max
nan_to_num isnan isinf isfinite any all count_nonzero
max min amax amin aminmax sum nansum mean nanmean prod std var std_mean var_mean norm argmax argmin
cumsum cumprod logsumexp softmax log_softmax topk sort argsort
add sub rsub mul div true_divide floor_divide remainder pow maximum minimum where masked_fill lerp
addcmul addcdiv matmul mm bmm mv dot vdot outer addmm addmv baddbmm einsum linear layer_norm rms_norm
embedding index_select gather take take_along_dim index_add index_copy scatter scatter_add
bucketize searchsorted diff flip roll repeat tile tril triu cat stack concat concatenate
gt lt ge le eq ne logical_and logical_or logical_not logical_xor
bitwise_and bitwise_or bitwise_xor bitwise_not
__add__ __radd__ __sub__ __rsub__ __mul__ __rmul__ __truediv__ __rtruediv__ __floordiv__ __rfloordiv__
__mod__ __rmod__ __pow__ __rpow__ __neg__ __abs__ __invert__ __matmul__ __rmatmul__
__gt__ __lt__ __ge__ __le__ __eq__ __ne__ __and__ __rand__ __or__ __ror__ __xor__ __lshift__ __rshift__
clone contiguous float half bfloat16 int long type_as
""".split())

SYNC_NAMES = {"item": ".item()", "tolist": ".tolist()", "__bool__": "bool() (a Python `if` on a GPU value)",
              "__int__": "int()", "__float__": "float()", "__index__": "an index", "__format__": "an f-string",
              "__complex__": "complex()", "numpy": ".numpy()", "__repr__": "print()/repr()", "__str__": "str()"}


def _name(func) -> str:
    return getattr(func, "__name__", str(func))





def _source_line(where: str) -> str:
    """``where`` ("file:line") as "`the code`" when the source is known, else as it is."""
    file, _, line = where.rpartition(":")
    text = linecache.getline(file, int(line)).strip() if line.isdigit() else ""
    return f"`{text}`" if text else where


class _MixedDevices(Exception):
    pass


#: Why the host waited, for the three explicit waits (the reasons of the other waits name the torch call).
SYNC_WAIT = "`synchronize()` waits for everything queued"
EVENT_WAIT = "`event.synchronize()` waited for work still queued"
POLL_WAIT = ("a loop polling `event.query()` waited for work still queued: polling is a host wait, as "
             "`event.synchronize()` is")


class WatchedLagging(LaggingStream):
    """A :class:`pinlab.LaggingStream` that records every time the host waits for queued device work.

    ``counting``: record waits only while True (the checker sets it around the learner's code).
    ``waits``: ``(step, reason, where)`` per wait, one for each wait the base emulation counts in
    ``host_waits`` (an event already reached, or with no work queued before it, is no wait; a loop
    polling ``query()`` is one). Plain device arithmetic (:data:`ASYNC_OPS` on device tensors) is
    queued as a kernel by :class:`Watch`.
    """

    def __init__(self):
        super().__init__()
        self.counting = False
        self.step = 0
        self.waits: list[tuple[int, str, str]] = []
        self.watch = None

    def _note_wait(self, kind: str) -> None:
        super()._note_wait(kind)
        if not self.counting:
            return
        op = self.watch.current if self.watch is not None and kind != "poll" else None
        if op:
            reason = describe_op(op, self.is_device, self.is_pinned)
        else:
            reason = {"synchronize": SYNC_WAIT, "event": EVENT_WAIT}.get(kind, POLL_WAIT)
        self.waits.append((self.step, reason, find_caller(sys._getframe(1))))

    def Event(self):  # noqa: N802 - mirrors torch.cuda.Event
        return _OrderedEvent(self, super().Event())

    def queue_kernel(self, func, args, kwargs):
        """Queue ``func(*args, **kwargs)`` on device tensors like a kernel launch; returns its
        (device) result, or None when it cannot be queued (the caller then lets the emulation
        wait for the queue, as a GPU would for an op whose output size depends on the data)."""
        def meta(t):
            if self.is_device(t):
                return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
            if t.dim() == 0:
                return t
            raise _MixedDevices

        def conv(obj):
            if isinstance(obj, torch.Tensor):
                return meta(obj)
            if isinstance(obj, (list, tuple)):
                return type(obj)(conv(o) for o in obj)
            return obj

        try:
            out_meta = func(*conv(args), **{k: conv(v) for k, v in kwargs.items()})
        except _MixedDevices:
            raise RuntimeError(f"Expected all tensors to be on the same device, but `{_name(func)}` got GPU and "
                               "host tensors (emulated GPU: the same error as on CUDA)") from None
        except Exception:
            return None
        single = isinstance(out_meta, torch.Tensor)
        metas = [out_meta] if single else list(out_meta) if isinstance(out_meta, tuple) else []
        if not metas or not all(isinstance(m, torch.Tensor) and m.device.type == "meta" for m in metas):
            return None  # a Python value (the host needs it now), or an output whose size depends on the data
        with self._drain():
            outs = [torch.empty_strided(m.shape, m.stride(), dtype=m.dtype) for m in metas]
        for o in outs:
            self._register(self._device, o)

        def kernel():
            result = func(*args, **kwargs)
            for o, r in zip(outs, [result] if single else list(result)):
                o.copy_(r)
        self._queue.append(kernel)
        if single:
            return outs[0]
        try:
            return type(out_meta)(outs)   # a torch.return_types structseq, or a tuple
        except TypeError:
            return tuple(outs)


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``[start, end)`` a tensor (or view) of host memory covers."""
    if not t.numel():
        return t.data_ptr(), t.data_ptr()
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()) if size)
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def _writes_first_arg(name: str) -> bool:
    """An in-place torch call that writes its first argument (``fill_``, ``copy_``, ``x[i] = ...``, ``+=``)."""
    return (name == "__setitem__" or (name.endswith("_") and not name.startswith("_"))
            or (name.startswith("__i") and name.endswith("__") and name not in ("__index__", "__int__", "__invert__",
                                                                                "__iter__", "__init__")))


class Watch(TorchFunctionMode):
    """Sees each torch call the learner's code makes (before the stream's own mode): remembers the
    current call (the reason of a wait), the host-to-device copies (``h2d``: step, seq, pinned,
    non_blocking, bytes, source storage and byte span, where), the host's writes into pinned memory
    (``pinned_writes``: step, seq, byte span, where: to tell a copy enqueued before the write of the
    data it should carry), ``pin_memory()`` of an already pinned tensor (``pin_of_pinned``), and on a
    :class:`WatchedLagging` queues device arithmetic as kernels."""

    def __init__(self, s):
        super().__init__()
        self.s = s
        self.current = None
        self.seq = 0                      # order of D2H copies and event records
        self.d2h: list[dict] = []         # copies from the device into host memory: seq, storage
        self.h2d: list[dict] = []
        self.pinned_writes: list[dict] = []
        self.pin_of_pinned: list[int] = []
        self.emulated = isinstance(s, LaggingStream)
        s.watch = self

    def is_device(self, t) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        return self.s.is_device(t) if self.emulated else t.device.type == "cuda"

    def is_device_target(self, target) -> bool:
        if isinstance(target, int):
            return True  # a CUDA device index
        if self.emulated:
            return self.s._is_our_device(target)
        return torch.device(target).type == "cuda"

    def _step(self) -> int:
        return getattr(self.s, "step", 0)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.emulated and self.s._draining:
            return func(*args, **kwargs)
        name = _name(func)
        if name == "pin_memory" and args and isinstance(args[0], torch.Tensor) and args[0].is_pinned():
            self.pin_of_pinned.append(self._step())
        copy = _h2d_of(name, args, kwargs, self.is_device, self.is_device_target)
        if copy is not None:
            src, non_blocking = copy
            self.h2d.append({"step": self._step(), "seq": self.next_seq(), "pinned": bool(src.is_pinned()),
                             "non_blocking": non_blocking, "nbytes": src.numel() * src.element_size(),
                             "storage": src.untyped_storage().data_ptr(), "span": _span(src),
                             "where": find_caller(sys._getframe(1))})
        elif _writes_first_arg(name) or "out" in kwargs:
            target = kwargs.get("out") if "out" in kwargs else (args[0] if args else None)
            if isinstance(target, torch.Tensor) and not self.is_device(target) and target.is_pinned():
                self.pinned_writes.append({"step": self._step(), "seq": self.next_seq(), "span": _span(target),
                                           "where": find_caller(sys._getframe(1))})
        gather = name == "__getitem__" and any(self.is_device(t) for t in _tensors(args[1:]))
        if (self.emulated and (name in ASYNC_OPS or gather) and "out" not in kwargs
                and any(self.is_device(t) for t in _tensors((args, kwargs)))):
            out = self.s.queue_kernel(func, args, kwargs)
            if out is not None:
                return out
        prev, self.current = self.current, (name, args, kwargs)
        try:
            out = func(*args, **kwargs)
        finally:
            self.current = prev
        if name in ("copy_", "to", "cpu") and isinstance(out, torch.Tensor) and args and isinstance(args[0], torch.Tensor):
            src = args[1] if name == "copy_" and len(args) > 1 else args[0]
            if isinstance(src, torch.Tensor) and self.is_device(src) and not self.is_device(out):
                self.d2h.append({"seq": self.next_seq(), "storage": out.untyped_storage().data_ptr()})
        return out

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq


def _h2d_of(name, args, kwargs, is_device, is_device_target):
    """(host source, non_blocking) when this call copies host memory to the device, else None."""
    if not args or not isinstance(args[0], torch.Tensor) or is_device(args[0]) and name != "copy_":
        return None
    c = copy_call(name, args, kwargs) if name in ("copy_", "cuda", "to") else None
    if c is None:
        return None
    if name == "copy_":
        if isinstance(c.src, torch.Tensor) and is_device(c.dst) and not is_device(c.src):
            return c.src, c.non_blocking
        return None
    if name == "cuda":
        return c.src, c.non_blocking
    if c.device is not None and is_device_target(c.device):
        return c.src, c.non_blocking
    return None


def describe_op(op, is_device, is_pinned) -> str:
    """Why the call ``op = (name, args, kwargs)`` made the host wait, in the lessons' terms."""
    name, args, kwargs = op
    if name in SYNC_NAMES:
        return (f"{SYNC_NAMES[name]} reads a GPU value into Python: the host waits for every kernel queued "
                "before it (keep the value on the GPU: a 0-dim tensor works in arithmetic)")
    if name in ("copy_", "to", "cuda", "cpu", "__setitem__") and args and isinstance(args[0], torch.Tensor):
        c = copy_call(name, args, kwargs)
        if name in ("copy_", "__setitem__") and c is not None and isinstance(c.src, torch.Tensor):
            dst, src, nb = c.dst, c.src, c.non_blocking
        else:
            src = args[0]
            target, nb = (c.device, c.non_blocking) if name == "to" else (None, False)
            to_host = name == "cpu" or (target is not None and str(target).startswith("cpu"))
            dst = None
            if is_device(src) and to_host:
                if not nb:
                    return "a blocking copy from the GPU to the host (`.cpu()` / `.to(\"cpu\")`) waits for the GPU"
                return "a copy from the GPU into pageable host memory waits for the GPU"
        if dst is not None and is_device(src) and not is_device(dst):  # D2H
            if not nb:
                return "a blocking copy from the GPU to the host waits for the GPU"
            if not is_pinned(dst):
                return (f"a copy from the GPU into pageable memory ({fmt_bytes(dst.numel() * dst.element_size())}) "
                        "waits for the GPU: copy into pinned memory with non_blocking=True and read it after an event")
        host = src
        size = fmt_bytes(host.numel() * host.element_size())
        if not nb:
            return f"a blocking copy to the GPU ({size}, no non_blocking=True) waits for the GPU"
        if not is_pinned(host):
            return (f"a non_blocking copy from pageable memory ({size}) waited for the GPU: the driver cannot "
                    "stage a copy that large, so non_blocking is fake (lesson 02); copy from pinned memory")
        return f"a copy ({size}) waited for the GPU"
    if name in ("__getitem__", "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive",
                "repeat_interleave"):
        what = "indexing with a boolean mask" if name == "__getitem__" else f"`{name}`"
        return f"{what}: the size of its result depends on GPU values, so the host waits for them"
    return f"`{name}` needed a GPU value, so the host waited for the queued work"


class NotingCuda(CudaStream):
    """The CUDA stream handed to the learner's code: notes (``noted``: ``(step, reason)``) each
    explicit ``synchronize()`` with work still queued, each ``event.synchronize()`` of an event not yet
    reached, and each loop polling such an event's ``query()`` (of its events): the waits it asks for,
    counted as the emulation counts them (implicit ones, a blocking copy or ``.item()``, show in the
    host's time)."""

    def __init__(self):
        super().__init__()
        self.step = 0
        self.noted: list[tuple[int, str]] = []
        self.watch = None

    def synchronize(self) -> None:
        if not torch.cuda.current_stream().query():  # work still queued: the host waits for it
            self.noted.append((self.step, SYNC_WAIT))
        super().synchronize()

    def Event(self):  # noqa: N802 - mirrors torch.cuda.Event
        return _OrderedEvent(self, torch.cuda.Event())


class _OrderedEvent:
    """An event handed to the learner's code: remembers when (``seq``, in the order of the
    :class:`Watch`'s device-to-host copies) it was last recorded; ``synchronize`` notes a wait."""

    def __init__(self, s, ev):
        self._s, self._ev = s, ev
        self.seq = None
        self._looked = False  # the last query said False (on CUDA: a second one in a row is a poll)

    def record(self, stream=None):
        watch = getattr(self._s, "watch", None)
        if watch is not None:
            self.seq = watch.next_seq()
        self._looked = False
        return self._ev.record() if stream is None else self._ev.record(stream)

    def query(self) -> bool:
        done = self._ev.query()
        if isinstance(self._s, NotingCuda) and not done:
            if self._looked is True:  # polled again: note the loop once
                self._s.noted.append((self._s.step, POLL_WAIT))
                self._looked = "noted"
            elif self._looked is False:
                self._looked = True
        elif done:
            self._looked = False
        return done

    def wait(self, stream=None):
        return self._ev.wait() if stream is None else self._ev.wait(stream)

    def synchronize(self) -> None:
        if isinstance(self._s, NotingCuda) and not self._ev.query():
            self._s.noted.append((self._s.step, EVENT_WAIT))
        self._ev.synchronize()


def watched_stream():
    """A :class:`NotingCuda` stream where CUDA is available, else a :class:`WatchedLagging`."""
    return NotingCuda() if has_cuda() else WatchedLagging()


KIND_REASONS = {
    PAGEABLE_H2D: "a non_blocking copy from pageable memory{size}: the driver stages it, and one that large waits "
                  "for the GPU, so non_blocking is fake (lesson 02); copy from pinned memory",
    PAGEABLE_D2H: "a copy from the GPU into pageable memory{size} waits for the GPU: copy into pinned memory with "
                  "non_blocking=True and read it after an event",
    BLOCKING_COPY: "a blocking copy between host and GPU{size} (no non_blocking=True) waits for the GPU",
    ITEM_SYNC: ".item() reads a GPU value into Python: the host waits for every kernel queued before it "
               "(keep the value on the GPU: a 0-dim tensor works in arithmetic)",
    TOLIST_SYNC: ".tolist() reads GPU values into Python: the host waits for every kernel queued before it",
    SCALAR_SYNC: "bool()/int()/float() of a GPU value (a Python `if` on it) reads a GPU value into Python: the "
                 "host waits for every kernel queued before it (use torch.where / arithmetic on the GPU)",
}


def _event_reason(event) -> str:
    size = f" ({fmt_bytes(event.nbytes)})" if event.nbytes else ""
    text = KIND_REASONS.get(event.kind, event.kind)
    return text.format(size=size)


# ---- 3. step_without_syncs ----------------------------------------------------------------------

SYNC_CASES = [(2048, 1024), (640, 1024), (256, 1024)]   # 8 MiB, 2.5 MiB (just over the staging limit), 1 MiB
N_OUT = 64
SYNC_BUSY_MS = 40.0     # a step that waits takes about this long; one that does not took 1.5-5 ms on the H200
SYNC_ATTEMPTS = 2       # on CUDA the faster of two timed calls counts (each behind its own busy kernel)
_failures: Counter = Counter()
HINTS = {
    "step_without_syncs": (
        "three changes, one per sync: (1) `x_host.pin_memory().to(s.device, non_blocking=True)` (a host memcpy "
        "into pinned memory, then a real asynchronous copy); (2) keep the scale on the GPU: "
        "`scale = x.abs().max()` (no `.item()`, no `if` on it); (3) `out = torch.empty(scores.shape, "
        "dtype=scores.dtype, pin_memory=True)`, `out.copy_(scores, non_blocking=True)`, then "
        "`done = s.Event(); done.record()` and `return out, done`."),
}


def reset() -> None:
    """Forget earlier failures of the torch-code checkers (their hint shows from the second on)."""
    _failures.clear()


def fail(name: str, message: str, hints: dict | None = None) -> bool:
    """Print ``❌ name: message`` (and, from the second failure of ``name`` on, its hint); False."""
    _failures[name] += 1
    say(f"❌ {name}: {message}")
    hint = (hints or HINTS).get(name)
    if hint and _failures[name] >= 2:
        say(f"💡 Hint: {hint}")
    return False


def sync_reference(x_host: torch.Tensor, w_host: torch.Tensor) -> torch.Tensor:
    """What the step computes, on the host: scores of the rows normalised by the largest magnitude."""
    return (x_host / x_host.abs().max()) @ w_host


def _first_sync(report):
    for e in report.events:
        if e.kind in KIND_REASONS:
            return e
    return None


@checker
def check_step_without_syncs(fn) -> bool:
    """``step_without_syncs(s, x_host, w)`` -> ``(scores_host, done_event)``: the step of the exercise
    with its three hidden syncs removed. Runs it behind a busy GPU (CUDA) or on the watched
    lagging stream, for three input sizes, and checks: no host wait, no copy from pageable memory,
    a result in host memory that equals the reference once ``done_event`` is reached."""
    name = "step_without_syncs"
    learner_arg(name, fn, "(s, x_host, w) -> (scores_host, done_event)")
    s = watched_stream()
    host_ms_seen = []
    with s:
        for i, shape in enumerate(SYNC_CASES):
            gen = torch.Generator().manual_seed(20 + i)
            x_host = torch.randn(shape, generator=gen)
            w_host = torch.randn(shape[1], N_OUT, generator=gen)
            expected = sync_reference(x_host, w_host)
            what = f"with the {fmt_bytes(x_host.numel() * 4)} input"
            call = f"{name}(s, x_host, w) {what}"
            w = w_host.to(s.device)
            s.synchronize()
            try:
                if not s.emulated:  # first launches, cuBLAS, the pinned blocks: not timed
                    with learner_call(call):
                        fn(s, x_host, w)
                    s.synchronize()
                best = None
                for _ in range(1 if s.emulated else SYNC_ATTEMPTS):
                    if s.emulated:
                        s.launch(lambda: None)  # the GPU is busy: a wait has work to wait for
                        s.waits.clear()
                        waits_before = s.host_waits
                        s.counting = True
                    else:
                        s.synchronize()
                        s.noted.clear()
                        s.busy(SYNC_BUSY_MS)
                    with detect_stalls() as report, Watch(s) as watch, learner_call(call):
                        t0 = time.perf_counter()
                        res = fn(s, x_host, w)
                        host_ms = (time.perf_counter() - t0) * 1e3
                    noted = list(getattr(s, "noted", ()))
                    if best is None or host_ms < best[0]:  # a slow host moment once is not a wait
                        best = (host_ms, report, watch, res, noted)
                host_ms, report, watch, res, noted = best
                if not s.emulated:
                    s.noted[:] = noted
            except LearnerStop as stop:  # it ran past its time, or left torch's state changed
                if s.emulated:
                    s.counting = False
                s.synchronize()
                return fail(name, str(stop))
            except Exception as exc:  # the learner's bug, reported, not raised
                if s.emulated:
                    s.counting = False
                s.synchronize()
                if is_stub(exc, fn):
                    return not_implemented(name)
                return fail(name, f"{call} raised {raised(exc)}")
            waited = 0
            if s.emulated:
                s.counting = False
                waited = s.host_waits - waits_before  # exact: every wait of the host, the learner's call only
            host_ms_seen.append(host_ms)
            problem = _sync_problem(s, report, watch, res, expected, host_ms, what, waited)
            s.synchronize()
            if problem:
                return fail(name, problem)
    show(f"{name} checked on", s.label)
    if not s.emulated:
        show(f"your step's host time behind a {SYNC_BUSY_MS:.0f} ms kernel, largest input", f"{host_ms_seen[0]:.2f} ms")
    # how the waits were seen depends on the stream: a [measured] line (nbval masks it), so that the verdict
    # below reads the same on a GPU and on the emulated stream
    show("how the host's waits were seen", "0 waits, every one counted on the emulated stream" if s.emulated else
         f"each call returned in under {SYNC_BUSY_MS / 2:.0f} ms behind a {SYNC_BUSY_MS:.0f} ms kernel, with no sync "
         "seen by the stall detector")
    say(f"✅ {name} is correct ({len(SYNC_CASES)} inputs: the host never waited for the GPU; every copy to the GPU "
        "non_blocking from pinned memory; the result in host memory, equal to the reference once its event is "
        "reached).")
    return True


def _wait_advice(reason: str) -> str:
    """The advice for a step that waited on its own event (by a wait or by polling it): none for other waits."""
    if reason in (EVENT_WAIT, POLL_WAIT):
        return (" Return the event instead of waiting on it: the caller waits when it needs the scores, and until "
                "then the host is free.")
    return ""


def _sync_problem(s, report, watch, res, expected, host_ms, what, waited: int = 0) -> str | None:
    """What is wrong with one call of the learner's step (None: nothing). ``waited``: the host's waits
    during the call on the emulated stream (its ``host_waits``, exact)."""
    if s.emulated and waited:
        step, reason, where = s.waits[0] if s.waits else (0, "the host waited for queued GPU work", "")
        at = f", at {_source_line(where)}" if where else ""
        return (f"your step made the host wait for the GPU {what} ({waited} wait{'s' if waited > 1 else ''} on the "
                f"emulated lagging GPU): {reason}{at}.{_wait_advice(reason)}")
    if not s.emulated:
        first = _first_sync(report)
        if host_ms > SYNC_BUSY_MS / 2:
            if first is not None:
                why, where = _event_reason(first), first.where
            elif s.noted:
                why, where = s.noted[0][1], ""
            else:
                why, where = ("something in it waited for the GPU (the stall detector saw no copy or .item(): an op "
                              "whose kernel needs a sync, such as nonzero, or torch.cuda.synchronize())"), ""
            at = f", at {_source_line(where)}" if where else ""
            return (f"your step blocked the host for {host_ms:.1f} ms behind a {SYNC_BUSY_MS:.0f} ms kernel {what}: "
                    f"{why}{at}.{_wait_advice(why)}")
        if first is not None and first.kind != PAGEABLE_H2D:
            return f"your step has a hidden sync {what}: {_event_reason(first)}, at {_source_line(first.where)}."
    pageable = [c for c in watch.h2d if not c["pinned"]]
    if pageable:
        c = pageable[0]
        return (f"a non_blocking copy from pageable memory ({fmt_bytes(c['nbytes'])}) {what}, at {_source_line(c['where'])}: "
                "it did not wait this time (the driver staged it), but non_blocking from pageable memory is fake "
                "(lesson 02): a larger one waits for the GPU. Copy from pinned memory.")
    blocking = [c for c in watch.h2d if not c["non_blocking"]]
    if blocking:
        return (f"a blocking copy to the GPU {what}, at {_source_line(blocking[0]['where'])}: pass non_blocking=True "
                "(from pinned memory it is truly asynchronous).")
    if not (isinstance(res, tuple) and len(res) == 2):
        return (f"your step returned {type(res).__name__}, not a pair `(scores_host, done_event)`: return the "
                "host tensor the result is copied into, and the event recorded after that copy.")
    out, done = res
    if not isinstance(out, torch.Tensor):
        return f"the result {type(out).__name__} is not a tensor: return the host tensor the scores are copied into."
    on_gpu = s.is_device(out) if s.emulated else out.device.type != "cpu"
    if on_gpu:
        return (f"the result {what} is still on the GPU: copy it into host memory (pinned, non_blocking=True), "
                "so that the host can read it after the event.")
    if done is None or not all(hasattr(done, a) for a in ("record", "synchronize", "query")):
        return (f"no event {what} (got {type(done).__name__}): record one after the copy to the host "
                "(`done = s.Event(); done.record()`) and return it; the result may be read only once it is reached.")
    into_out = [c["seq"] for c in watch.d2h if c["storage"] == out.untyped_storage().data_ptr()]
    if getattr(done, "seq", None) is not None and into_out and max(into_out) > done.seq:
        return (f"the event {what} was recorded before the copy into the result: it is reached before the scores "
                "are there, so the caller would read the result too early. Record it after the copy.")
    try:
        with learner_call(f"done_event.synchronize() {what}"):
            done.synchronize()
    except LearnerStop as stop:
        return str(stop)
    except Exception as exc:
        return f"done_event.synchronize() {what} raised {raised(exc)}"
    if tuple(out.shape) != tuple(expected.shape) or out.dtype != expected.dtype:
        return (f"the result {what} has shape {tuple(out.shape)} {out.dtype}, the reference "
                f"{tuple(expected.shape)} {expected.dtype}.")
    if not same_tensor(out, expected, rtol=1e-2, atol=5e-2):
        return (f"the result {what} differs from the reference once the event is reached: was the event recorded "
                "after the copy to the host, and is the scale the largest magnitude of x (`x.abs().max()`)?")
    return None
