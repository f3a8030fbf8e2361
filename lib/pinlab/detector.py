"""A stall detector: find the copies and syncs in *your* code that make the host wait for the GPU.

(Why about 600 lines: it is one ``TorchFunctionMode`` with a handler per kind of stall, each with the
rule that decides it and the words it reports; split, the rules would no longer read side by side.)

Wrap the code you want to check::

    with pinlab.detect_stalls() as report:
        for step in range(100):
            ...                     # your loop
    print(report)                   # or report.summary(), report.counts, report.events

Every event names the kind of stall, the torch call, and your ``file:line`` (the first stack
frame outside pinlab and torch, or in a function named in ``detect_stalls(callers=[fn])``: the
course's reference loops live in pinlab, and name their own lines so). What is reported:

* an H2D or D2H copy with ``non_blocking=True`` whose host side is **pageable** (an H2D copy is
  staged by the driver through its own pinned buffer and returns at once only while the driver
  stages it, up to limits it does not document; a D2H copy into pageable memory always waited until
  it had completed in lesson 02: either way ``non_blocking`` is "fake") or **pinned but not laid
  out for a direct DMA** (torch first makes a pageable contiguous copy on the host, same effect). This is what
  ``torch.cuda.set_sync_debug_mode("warn")`` misses (docs/facts.md F10), and what vLLM #53491 added
  to vLLM's own checker;
* every **blocking copy** between the CPU and the GPU: ``copy_``/``to``/``cuda`` without
  ``non_blocking=True``, ``.cpu()`` of a GPU tensor, ``gpu_tensor[...] = cpu_tensor``;
* every **host sync** that reads a GPU value into Python: ``.item()``, ``.tolist()``,
  ``bool()/int()/float()/index()/complex()`` and f-string formatting of a GPU tensor;
* ``torch.tensor(..., device="cuda")`` and its relatives (``torch.as_tensor``,
  ``torch.asarray``, ``Tensor.new_tensor``) from host data: the data is copied with a
  blocking, pageable copy. Not when the data has no element (``torch.tensor([], device="cuda")``
  copies nothing; lesson 09 checks it against the profiler's trace).

Not reported (use ``torch.cuda.set_sync_debug_mode("warn")`` alongside for these): ops whose
*kernel* needs a sync (``nonzero``, boolean-mask indexing, ``unique``, ``repeat_interleave``
without ``output_size``), indexing a GPU tensor with a CPU index tensor, ``print``/``repr``
of a GPU tensor, explicit ``torch.cuda.synchronize()``, and calls that torch makes
internally (only the call your code makes is seen, once).

A ``non_blocking`` D2H ``.to("cpu", non_blocking=True)`` is *not* a stall: torch allocates the
result in pinned memory. Its data is only valid after you synchronize, which this detector
cannot check.

How: a :class:`torch.overrides.TorchFunctionMode` sees every torch function and Tensor method
your code calls while the ``with`` block is active (in this thread). Everything is restored
on exit, also after an exception, and detectors nest (each one sees every call). Calls the
detector does not care about cost one dict lookup; ``is_pinned()`` (a few µs on a CUDA
machine) is called only for ``non_blocking`` copies between the CPU and the GPU. Measured on
torch 2.14 (CPU): about 1 µs per torch call, almost all of it the TorchFunctionMode machinery
itself; a loop of small CPU ops ran about 1.6x slower, a loop of GPU launches much less.
Use it on eager code: ``torch.compile``'d regions may be traced without it or graph-break.
"""
from __future__ import annotations

import numbers
import os
import sys
from collections import Counter
from dataclasses import asdict, dataclass

import torch
from torch.overrides import TorchFunctionMode

from .args import positive_int
from .text import fmt_bytes
from .copyargs import copy_call, cuda_args, parse_to_args
from .copyargs import device_type as _device_type

# --- kinds -----------------------------------------------------------------------------------

#: a pageable non_blocking H2D copy: the driver stages it at the call (a host memcpy) and it waits for the
#: GPU once the staging cannot take it (lesson 02): "fake" only then, so the kind says "may wait"
PAGEABLE_H2D = "pageable H2D (may wait for the GPU)"
NONCONTIG_H2D = "non-contiguous pinned H2D"
PAGEABLE_D2H = "pageable D2H"
NONCONTIG_D2H = "non-contiguous pinned D2H"
BLOCKING_COPY = "blocking copy"
ITEM_SYNC = "host sync (.item())"
TOLIST_SYNC = "host sync (.tolist())"
SCALAR_SYNC = "host sync (bool/int/float of a CUDA tensor)"
FACTORY_SYNC = "torch.tensor(..., device=cuda)"

KINDS = (
    PAGEABLE_H2D,
    NONCONTIG_H2D,
    PAGEABLE_D2H,
    NONCONTIG_D2H,
    BLOCKING_COPY,
    ITEM_SYNC,
    TOLIST_SYNC,
    SCALAR_SYNC,
    FACTORY_SYNC,
)

# --- ops (the names events and classify() use) -------------------------------------------------

COPY_OPS = ("Tensor.copy_", "Tensor.to", "Tensor.cuda", "Tensor.cpu", "Tensor.__setitem__")
SYNC_OPS = {
    "Tensor.item": ITEM_SYNC,
    "Tensor.tolist": TOLIST_SYNC,
    "Tensor.__bool__": SCALAR_SYNC,
    "Tensor.__int__": SCALAR_SYNC,
    "Tensor.__float__": SCALAR_SYNC,
    "Tensor.__index__": SCALAR_SYNC,
    "Tensor.__complex__": SCALAR_SYNC,
    "Tensor.__format__": SCALAR_SYNC,
}
FACTORY_OPS = ("torch.tensor", "torch.as_tensor", "torch.asarray", "Tensor.new_tensor")
OPS = COPY_OPS + tuple(SYNC_OPS) + FACTORY_OPS


class StallError(RuntimeError):
    """Raised by :func:`detect_stalls` for a kind listed in ``raise_on``, before the call runs."""


# --- the pure part: classification -------------------------------------------------------------


def classify(op, src_device_type, dst_device_type, host_pinned=None, host_contiguous=None,
             non_blocking=False, *, device_type="cuda"):
    """The kind of stall one call causes, or ``None`` when it causes none.

    ``op``: one of :data:`OPS` (for example ``"Tensor.copy_"``).
    ``src_device_type`` / ``dst_device_type``: where the data comes from and goes to
    (``"cpu"``, ``"cuda"``, ...). For a sync op (``.item()``...) ``src`` is the tensor's device;
    for a factory (``torch.tensor``) ``src`` is ``"cpu"`` for host data (lists, numpy, CPU
    tensors) and ``dst`` the device asked for.
    ``host_pinned`` / ``host_contiguous``: facts about the *host* side of a copy (the source of
    an H2D, the destination of a D2H); needed only for a ``non_blocking`` copy between the CPU
    and the device. ``host_contiguous`` means "torch can DMA the host memory as it is" (see
    :func:`host_layout_ok`).
    ``device_type``: the accelerator whose traffic counts (``"cuda"``; tests use ``"meta"``).
    """
    if op not in OPS:
        raise ValueError(f"op must be one of {sorted(OPS)}, got {op!r}")
    for name, value in (("src_device_type", src_device_type), ("dst_device_type", dst_device_type),
                        ("device_type", device_type)):
        if not isinstance(value, str):
            raise TypeError(f"{name} must be a device type string such as 'cpu' or 'cuda', "
                            f"got {type(value).__name__} ({value!r})")
    if not isinstance(non_blocking, bool):
        raise TypeError(f"non_blocking must be a bool, got {type(non_blocking).__name__} ({non_blocking!r})")

    if op in SYNC_OPS:
        return SYNC_OPS[op] if src_device_type == device_type else None
    if op in FACTORY_OPS:
        return FACTORY_SYNC if (src_device_type == "cpu" and dst_device_type == device_type) else None

    # a copy
    if src_device_type == "cpu" and dst_device_type == device_type:
        h2d = True
    elif src_device_type == device_type and dst_device_type == "cpu":
        h2d = False
    else:
        return None  # CPU->CPU, GPU->GPU, or a device this detector does not watch
    if not non_blocking:
        return BLOCKING_COPY
    for name, value in (("host_pinned", host_pinned), ("host_contiguous", host_contiguous)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool for a non_blocking copy between the CPU and "
                            f"{device_type}, got {type(value).__name__} ({value!r})")
    if not host_pinned:
        return PAGEABLE_H2D if h2d else PAGEABLE_D2H
    if not host_contiguous:
        return NONCONTIG_H2D if h2d else NONCONTIG_D2H
    return None


def is_dense(shape, strides) -> bool:
    """True when a tensor of this shape and these strides covers its memory without gaps or
    overlaps (contiguous up to a permutation of the dimensions, e.g. a transpose)."""
    shape, strides = tuple(shape), tuple(strides)
    if len(shape) != len(strides):
        raise ValueError(f"shape and strides must have the same length, got {shape} and {strides}")
    if 0 in shape:
        return True
    expected = 1
    for size, stride in sorted(zip(shape, strides), key=lambda p: p[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def host_layout_ok(op, host_shape, host_strides, host_contiguous, dev_shape=None, dev_strides=None,
                   same_dtype=True) -> bool:
    """Can torch DMA the host side of this copy as it is (no hidden host-side temporary)?

    Torch copies CPU<->GPU with one ``cudaMemcpyAsync`` when both sides are walked in the same
    dense order with the same dtype; otherwise it makes contiguous temporaries, and the host
    temporary is *pageable*, which brings the stall back (a non-contiguous pinned view took
    57 ms behind a busy GPU on the H200, the contiguous one returned at once).

    * ``Tensor.copy_``: OK if the host tensor is contiguous with the device tensor's shape
      (no broadcast), or both sides have the same shape, strides and dtype and are dense.
    * ``Tensor.to`` / ``Tensor.cuda`` (the result keeps a dense layout): OK if the host tensor
      is contiguous, or dense with an unchanged dtype.
    """
    if op == "Tensor.copy_":
        same_shape = tuple(host_shape) == tuple(dev_shape)
        if host_contiguous and same_shape:
            return True
        return (same_dtype and same_shape and tuple(host_strides) == tuple(dev_strides)
                and is_dense(host_shape, host_strides))
    return bool(host_contiguous) or (same_dtype and is_dense(host_shape, host_strides))


# --- where: the reader's file:line --------------------------------------------------------------


def _package_dir(module) -> tuple[str, ...]:
    d = os.path.dirname(os.path.abspath(module.__file__))
    return tuple({d + os.sep, os.path.realpath(d) + os.sep})


SKIP_PREFIXES = tuple(sorted(set(_package_dir(sys.modules[__package__]) + _package_dir(torch))))


def find_caller(frame=None, skip_prefixes=SKIP_PREFIXES, callers=frozenset()) -> str:
    """``"file:line"`` of the first frame, from ``frame`` (default: the caller) outwards, whose
    file is not under one of ``skip_prefixes`` (pinlab and torch), or whose code object is one of
    ``callers`` (wherever its file lies). Walks ``f_back``: no ``inspect.stack()``, which reads
    source files and is far too slow for a hot loop."""
    f = sys._getframe(1) if frame is None else frame
    while f is not None:
        code = f.f_code
        if code in callers or not code.co_filename.startswith(skip_prefixes):
            return f"{code.co_filename}:{f.f_lineno}"
        f = f.f_back
    return "<unknown>"


def _codes(code):
    """A code object and the code objects nested in it (the functions defined inside a function)."""
    yield code
    for c in code.co_consts:
        if hasattr(c, "co_lines"):
            yield from _codes(c)


def _caller_codes(callers) -> frozenset:
    """The code objects of ``callers`` (None, or Python functions) and of the functions defined inside
    them: what :func:`find_caller` counts as the caller's code wherever it lives."""
    if callers is None:
        return frozenset()
    if isinstance(callers, (str, bytes)) or not hasattr(callers, "__iter__"):
        raise TypeError(f"callers must be None or a list of Python functions, got {type(callers).__name__}")
    codes = set()
    for fn in callers:
        code = getattr(fn, "__code__", None)
        if not hasattr(code, "co_lines"):
            raise TypeError(f"callers must hold Python functions (with a __code__), got {type(fn).__name__} "
                            f"({fn!r})")
        codes.update(_codes(code))
    return frozenset(codes)


# --- events and the report ---------------------------------------------------------------------


@dataclass
class StallEvent:
    """One stall: what kind, which torch call, where in your code, how many host bytes."""

    kind: str
    op: str
    where: str
    nbytes: int | None = None
    detail: str = ""

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        size = "" if self.nbytes is None else f", {fmt_bytes(self.nbytes)}"
        detail = f" ({self.detail}{size})" if self.detail or size else ""
        return f"{self.kind}: {self.op} at {self.where}{detail}"




class StallReport:
    """What a :func:`detect_stalls` block found.

    ``events``: the first ``max_events`` :class:`StallEvent` s, in order. ``counts``: events per
    kind (all of them, also those past ``max_events``). ``total``: all events. ``dropped``:
    events counted but not kept. ``summary()`` / ``print(report)``: a table by kind and place.
    """

    def __init__(self, max_events: int | None = 1000):
        self.max_events = max_events
        self.events: list[StallEvent] = []
        self.counts: Counter = Counter()
        self.places: Counter = Counter()  # (kind, op, where) -> count
        self.dropped = 0

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __len__(self) -> int:
        return self.total

    def count(self, kind: str | None = None) -> int:
        """Events of one kind (all events for ``None``)."""
        if kind is None:
            return self.total
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {list(KINDS)}, got {kind!r}")
        return self.counts[kind]

    def _record(self, kind, op, where, nbytes, detail):
        self.counts[kind] += 1
        self.places[(kind, op, where)] += 1
        if self.max_events is not None and len(self.events) >= self.max_events:
            self.dropped += 1
            return None
        event = StallEvent(kind, op, where, nbytes, detail)
        self.events.append(event)
        return event

    def summary(self, places_per_kind: int = 3) -> str:
        """A readable table: count per kind, then the places that caused most of them."""
        places_per_kind = positive_int("places_per_kind", places_per_kind)
        if not self.total:
            return "pinlab.detect_stalls: no stalls found"
        lines = [f"pinlab.detect_stalls: {self.total} stall(s) at {len(self.places)} place(s)"]
        width = max(len(k) for k in self.counts)
        for kind, n in sorted(self.counts.items(), key=lambda kv: (-kv[1], KINDS.index(kv[0]))):
            lines.append(f"  {kind:<{width}}  {n:>6}")
            here = [(c, op, where) for (k, op, where), c in self.places.items() if k == kind]
            here.sort(key=lambda t: -t[0])
            for c, op, where in here[:places_per_kind]:
                lines.append(f"      {c:>6} x {op} at {where}")
            if len(here) > places_per_kind:
                lines.append(f"      ... and {len(here) - places_per_kind} more place(s)")
        if self.dropped:
            lines.append(f"  ({self.dropped} event(s) counted but not kept: max_events={self.max_events})")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def __repr__(self) -> str:
        return f"StallReport(total={self.total}, counts={dict(self.counts)})"


# --- the handlers: facts about one call (args as torch passes them, self first) -----------------


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def copies_nothing(data) -> bool:
    """True when ``data`` (a factory's host data: a tensor, a numpy array, a nested list or tuple) has no
    element: ``torch.tensor([], device="cuda")`` allocates and copies nothing, so it makes no one wait
    (transformers' ``cache_utils.py`` ``DynamicLayer.lazy_initialization`` makes two per layer; the profiler
    shows no copy for them: lesson 09)."""
    if isinstance(data, torch.Tensor):
        return data.numel() == 0
    size = getattr(data, "size", None)
    if isinstance(size, numbers.Integral) and not isinstance(data, (list, tuple)):
        return size == 0  # a numpy array
    if isinstance(data, (list, tuple)):
        return all(isinstance(d, (list, tuple)) and copies_nothing(d) for d in data)
    return False


def _copy_detail(src_type, dst_type, non_blocking, extra=""):
    text = f"{src_type} -> {dst_type}, non_blocking={non_blocking}"
    return f"{text}, {extra}" if extra else text


def _classify_copy(op, host, dev_shape, dev_strides, src_type, dst_type, non_blocking, device_type,
                   same_dtype=True):
    """Shared tail of the copy handlers: look at the host side only when it matters."""
    crosses = (src_type == "cpu" and dst_type == device_type) or (src_type == device_type and dst_type == "cpu")
    if not crosses:
        return None
    pinned = contiguous = None
    extra = ""
    if non_blocking:
        pinned = host.is_pinned()
        if pinned:
            contiguous = host_layout_ok(op, host.shape, host.stride(), host.is_contiguous(),
                                        dev_shape, dev_strides, same_dtype)
            if not contiguous:
                extra = f"host strides {tuple(host.stride())} for shape {tuple(host.shape)}"
        else:
            contiguous = True
    kind = classify(op, src_type, dst_type, pinned, contiguous, non_blocking, device_type=device_type)
    if kind is None:
        return None
    return kind, op, _nbytes(host), _copy_detail(src_type, dst_type, non_blocking, extra)


def _h_copy_(args, kwargs, device_type):
    c = copy_call("copy_", args, kwargs)
    if c is None:
        return None
    dst, src, non_blocking = c.dst, c.src, c.non_blocking
    if not isinstance(src, torch.Tensor) or (src.is_cpu and dst.is_cpu):  # fast exit: CPU -> CPU
        return None
    src_type, dst_type = src.device.type, dst.device.type
    if src_type == dst_type:
        return None
    host, dev = (src, dst) if src_type == "cpu" else (dst, src)
    return _classify_copy("Tensor.copy_", host, dev.shape, dev.stride(), src_type, dst_type,
                          non_blocking, device_type, same_dtype=src.dtype == dst.dtype)


def _h_to(args, kwargs, device_type):
    if len(args) > 1 and isinstance(args[1], torch.dtype) and not kwargs:
        return None  # fast exit: .to(dtype), no device change
    self = args[0]
    dst_type, dtype, non_blocking = parse_to_args(args[1:], kwargs)
    src_type = self.device.type
    if dst_type is None or dst_type == src_type:
        return None
    if src_type == "cpu":
        same = dtype is None or dtype == self.dtype
        return _classify_copy("Tensor.to", self, None, None, src_type, dst_type, non_blocking,
                              device_type, same_dtype=same)
    if non_blocking and dst_type == "cpu":
        # D2H with non_blocking=True: torch allocates the result in pinned memory, so the copy
        # is truly asynchronous (no stall; the data is valid only after a sync).
        return None
    return _classify_copy("Tensor.to", self, None, None, src_type, dst_type, False, device_type)


def _h_cuda(args, kwargs, device_type):
    self = args[0]
    src_type = self.device.type
    if src_type == "cuda":
        return None
    non_blocking = cuda_args(args[1:], kwargs)[1]
    return _classify_copy("Tensor.cuda", self, None, None, src_type, "cuda", non_blocking, device_type)


def _h_cpu(args, kwargs, device_type):
    self = args[0]
    src_type = self.device.type
    if src_type == "cpu":
        return None
    return _classify_copy("Tensor.cpu", self, None, None, src_type, "cpu", False, device_type)


def _h_setitem(args, kwargs, device_type):
    if len(args) < 3:
        return None
    self, value = args[0], args[2]
    # a 0-dim CPU tensor is used like a Python scalar (a fill, no copy): not reported
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return None
    src_type, dst_type = value.device.type, self.device.type
    if src_type == dst_type:
        return None
    host = value if src_type == "cpu" else self
    return _classify_copy("Tensor.__setitem__", host, None, None, src_type, dst_type, False, device_type)


def _make_sync_handler(op):
    def handler(args, kwargs, device_type):
        self = args[0]
        if self.is_cpu or self.device.type != device_type:
            return None
        kind = classify(op, device_type, "cpu", device_type=device_type)
        nbytes = _nbytes(self) if op == "Tensor.tolist" else self.element_size()
        return kind, op, nbytes, f"reads a {device_type} value into Python"
    return handler


def _default_device_type():
    fn = getattr(torch, "get_default_device", None)
    return fn().type if fn is not None else "cpu"


def _make_factory_handler(op):
    def handler(args, kwargs, device_type):
        if op == "Tensor.new_tensor":
            owner, args = args[0], args[1:]
        else:
            owner = None
        data = args[0] if args else kwargs.get("data", kwargs.get("obj"))
        device = kwargs.get("device")  # keyword-only in all four
        if device is None:
            if owner is not None:
                device = owner.device
            elif isinstance(data, torch.Tensor):
                device = data.device
            else:
                device = _default_device_type()
        dst_type = _device_type(device)
        src_type = data.device.type if isinstance(data, torch.Tensor) else "cpu"
        if dst_type is None or copies_nothing(data):
            return None  # no element: nothing is copied, no one waits
        kind = classify(op, src_type, dst_type, device_type=device_type)
        if kind is None:
            return None
        nbytes = _nbytes(data) if isinstance(data, torch.Tensor) else None
        what = "CPU tensor" if isinstance(data, torch.Tensor) else type(data).__name__
        return kind, op, nbytes, f"{what} data -> {dst_type}: a blocking copy from pageable memory"
    return handler


_HANDLERS = {
    torch.Tensor.copy_: _h_copy_,
    torch.Tensor.to: _h_to,
    torch.Tensor.cuda: _h_cuda,
    torch.Tensor.cpu: _h_cpu,
    torch.Tensor.__setitem__: _h_setitem,
    torch.tensor: _make_factory_handler("torch.tensor"),
    torch.as_tensor: _make_factory_handler("torch.as_tensor"),
    torch.Tensor.new_tensor: _make_factory_handler("Tensor.new_tensor"),
}
if hasattr(torch, "asarray"):
    _HANDLERS[torch.asarray] = _make_factory_handler("torch.asarray")
for _op in SYNC_OPS:
    _fn = getattr(torch.Tensor, _op.split(".", 1)[1], None)
    if _fn is not None:
        _HANDLERS[_fn] = _make_sync_handler(_op)
del _op, _fn

#: The torch callables the detector intercepts (what the TorchFunctionMode acts on).
INTERCEPTED = tuple(_HANDLERS)


# --- the mode and the context manager -----------------------------------------------------------


class _StallMode(TorchFunctionMode):
    def __init__(self, report: StallReport, device_type: str, raise_on: frozenset, callers: frozenset):
        super().__init__()
        self._report = report
        self._device_type = device_type
        self._raise_on = raise_on
        self._callers = callers

    def __torch_function__(self, func, types, args=(), kwargs=None):
        handler = _HANDLERS.get(func)
        if kwargs is None:
            kwargs = {}
        if handler is None:
            return func(*args, **kwargs)
        try:
            found = handler(args, kwargs, self._device_type)
        except Exception:  # unusual arguments: let torch run (and complain) as it would without us
            found = None
        if found is None:
            return func(*args, **kwargs)
        kind, op, nbytes, detail = found
        where = find_caller(sys._getframe(1), callers=self._callers)
        event = self._report._record(kind, op, where, nbytes, detail)
        if kind in self._raise_on:
            raise StallError(f"{kind}: {op} at {where} ({detail}); raised because "
                             f"detect_stalls(raise_on=...) lists this kind")
        result = func(*args, **kwargs)
        if event is not None and event.nbytes is None and isinstance(result, torch.Tensor):
            event.nbytes = _nbytes(result)
        return result


class StallDetector:
    """The context manager :func:`detect_stalls` returns; ``with`` gives its :class:`StallReport`.

    It may be entered again after it has exited (the report keeps counting), but not while it
    is active; for nesting, make a second detector.
    """

    def __init__(self, *, device_type: str = "cuda", raise_on=None, max_events: int | None = 1000, callers=None):
        if not isinstance(device_type, str):
            raise TypeError(f"device_type must be a string such as 'cuda', got {type(device_type).__name__}")
        if device_type == "cpu" or not device_type:
            raise ValueError(f"device_type must name an accelerator such as 'cuda' (the device whose "
                             f"copies to and from the CPU are checked), got {device_type!r}")
        if raise_on is None:
            raise_on = frozenset()
        else:
            if isinstance(raise_on, (str, bytes)) or not hasattr(raise_on, "__iter__"):
                raise TypeError(f"raise_on must be None or a set of kinds (e.g. {{pinlab.detector.PAGEABLE_H2D}}), "
                                f"got {type(raise_on).__name__} ({raise_on!r})")
            raise_on = frozenset(raise_on)
            unknown = sorted(k for k in raise_on if k not in KINDS)
            if unknown:
                raise ValueError(f"raise_on holds unknown kind(s) {unknown}; the kinds are {list(KINDS)}")
        if max_events is not None:
            if isinstance(max_events, bool) or not isinstance(max_events, numbers.Integral):
                raise TypeError(f"max_events must be an int or None, got {type(max_events).__name__} ({max_events!r})")
            max_events = positive_int("max_events", max_events, allow_zero=True)
        self.device_type = device_type
        self.raise_on = raise_on
        self.callers = _caller_codes(callers)
        self.report = StallReport(max_events)
        self._mode = None

    def __enter__(self) -> StallReport:
        if self._mode is not None:
            raise RuntimeError("this detect_stalls() block is already active; "
                               "to nest, use a second pinlab.detect_stalls()")
        mode = _StallMode(self.report, self.device_type, self.raise_on, self.callers)
        mode.__enter__()
        self._mode = mode
        return self.report

    def __exit__(self, exc_type, exc, tb):
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.__exit__(exc_type, exc, tb)
        return False


def detect_stalls(*, device_type: str = "cuda", raise_on=None, max_events: int | None = 1000,
                  callers=None) -> StallDetector:
    """Report the host stalls your code causes: ``with detect_stalls() as report: ...``.

    ``raise_on``: ``None`` or a set of kinds (from :data:`KINDS`); a call of such a kind raises
    :class:`StallError` at once, before it runs, with your ``file:line``.
    ``max_events``: how many events to keep (``None``: all); counting goes on past it.
    ``device_type``: the accelerator whose copies count (default ``"cuda"``); the CPU tests
    use ``"meta"`` as a stand-in, since meta tensors exist on every machine.
    ``callers``: ``None`` or a list of Python functions whose lines (and those of the functions
    defined inside them) count as your code even where they live under pinlab or torch, whose
    frames are otherwise skipped (lesson 07 names the lines of its reference loop so).

    Works on a machine without CUDA too (there is then nothing to report, unless the code calls
    ``.cuda()`` or the like, which fails after being reported).
    """
    return StallDetector(device_type=device_type, raise_on=raise_on, max_events=max_events, callers=callers)
