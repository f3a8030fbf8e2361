"""Exercise checkers for lesson 08 (CUDA graphs: what a captured copy reads).

Each checker prints one verdict line (⏳ not implemented, ❌ what is wrong, in the lesson's terms, ✅ correct),
adds a hint from the second failure on, and returns True or False. ``tests/test_checks_l08.py`` proves each
accepts the master solution and rejects planted wrong answers with the right message. Both run the learner's
torch code on the CUDA stream, or on the emulated :class:`pinlab.LaggingStream` (which captures and replays
graphs, and refuses in a capture what CUDA refuses).

* :func:`check_capturable_step`: ``step(ids, out)`` must capture into a graph (no copy of host data, no host
  tensor in device work, no wait for the GPU) and, replayed, compute every value of ``out`` from whatever
  ``ids`` holds at each replay, leaving ``ids`` (the graph's input) as it was;
* :func:`check_graph_stage`: ``stage(s, meta, static, state)`` must get all of each step's host metadata into
  the graph's static input so that every replay reads its own step's data, with no pageable copy and no wait
  for the GPU, while the host rewrites the metadata right after each call; a stage that keeps pinned buffers
  between steps (a ring) is run for more steps than it has buffers.

The learner's calls run under :class:`_Watch`, which stops, before torch runs it, what a GPU refuses or what
would make the host wait there, so that the verdict is the same on the emulation and on CUDA whatever the
emulation itself refuses: a tensor built from host data on the GPU (``torch.tensor(..., device=)``,
``as_tensor``, ``new_tensor``: torch builds it in pageable host memory and copies it with a blocking
``.to(device)``, ``internal_new_from_data`` in ``torch/csrc/utils/tensor_new.cpp``), a host tensor used in
device work (torch: "Expected all tensors to be on the same device"), pinning GPU memory
(``torch.empty_like(gpu_tensor, pin_memory=True)``; ``empty_cuda`` in ``aten/src/ATen/cuda/EmptyTensor.cpp``:
"Only dense CPU tensors can be pinned") and, in a capture, a copy between pageable host memory and the device
(``copy_kernel_cuda`` in ``aten/src/ATen/native/cuda/Copy.cu``: :data:`pinlab.streams.CAPTURE_PAGEABLE_ERROR`).
"""
from __future__ import annotations

import math
import sys
import weakref
from collections import Counter
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode

from .. import steploop
from ..args import callable_arg, positive_int, positive_number
from ..streams import CAPTURE_PAGEABLE_ERROR, _tensors, stream  # one walker over nested args
from ..timing import show
from . import LearnerStop, checker, is_stub, learner_arg, learner_call, not_implemented, raised
from .l02 import _h2d_of

_failures: Counter = Counter()

HINTS = {
    "capturable_step": "build the positions on the GPU (`torch.arange(n, device=ids.device)`) instead of copying "
                       "them from the host, and replace the `.item()` test by a device-side op (`torch.clamp`): a "
                       "capture records work, so nothing in it may need a value back on the host.",
    "stage": "give every step its own pinned memory: `static.copy_(meta.pin_memory(), non_blocking=True)` copies "
             "a fresh pinned snapshot, which nobody rewrites before the copy has run.",
}

#: The lesson's step: ``out = min(ids * 2 + position, LIMIT)``.
LIMIT = 1000
#: Values of host metadata per step in :func:`staging_run` (all compared).
META_INTS = 16
#: Steps :func:`staging_run` runs at least; a stage that keeps k steps' worth of pinned memory between steps
#: (a ring of k buffers) is run again for 2k + 4 steps, so that its ring wraps while the GPU is behind.
STAGE_STEPS = 60
#: The deepest ring :func:`check_graph_stage` runs around (a deeper one is refused, with its depth).
MAX_RING = 1024
#: The GPU's lead in :func:`staging_run` per 60 steps (ms): far more than the host needs for them.
BUSY_MS_PER_60_STEPS = 50.0

#: torch's errors for what the checkers diagnose (each also stopped by :class:`_Watch` before torch sees it).
SAME_DEVICE_ERROR = "Expected all tensors to be on the same device"
PIN_GPU_ERROR = "Only dense CPU tensors can be pinned"
PIN_DATA_ERROR = "Can't pin tensor constructed from a variable"


def reset() -> None:
    """Forget earlier failures (the hint shows from a checker's second failure on)."""
    _failures.clear()


def _fail(name: str, message: str) -> bool:
    _failures[name] += 1
    print(f"❌ {message}")
    if _failures[name] >= 2:
        print(f"💡 Hint: {HINTS[name]}")
    return False


def reference_step(ids: torch.Tensor) -> torch.Tensor:
    """What the step computes from ``ids`` (a 1-D integer tensor): ``min(ids * 2 + position, LIMIT)``."""
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"ids must be a 1-D integer torch.Tensor, got {type(ids).__name__}")
    if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"ids must be a 1-D integer tensor (int64 in the exercise), got {ids.dim()}-D "
                         f"{str(ids.dtype).replace('torch.', '')}")
    pos = torch.arange(ids.numel(), dtype=ids.dtype, device=ids.device)
    return torch.clamp(ids * 2 + pos, max=LIMIT)


# ---- what the learner's calls may not do ----------------------------------------------------------------

class _Refused(LearnerStop):
    """A call of the learner's that :class:`_Watch` stopped before torch ran it; ``str()`` says what and why."""


#: Factories that build a tensor from data (a list, a number, a host tensor): on the GPU, a copy of host data.
_FROM_DATA = ("tensor", "as_tensor", "asarray", "new_tensor")
#: Calls that move data between host and device themselves, or only look at memory: never "device work that
#: reads a host tensor".
_MOVES = {"copy_", "to", "cuda", "cpu", "__getitem__", "__setitem__", "index_put_", "index_put", "pin_memory",
          "is_pinned", "__get__", "__set__", "set_", "untyped_storage", "data_ptr", "size", "dim", "numel",
          "stride", "is_contiguous", "element_size", "storage_offset", *_FROM_DATA}


def _call_text(name: str) -> str:
    return "`t.new_tensor(data)`" if name == "new_tensor" else f"`torch.{name}(data, device=...)`"


class _Watch(TorchFunctionMode):
    """The learner's torch calls, on either stream: each is judged before torch runs it (see the module
    docstring; :class:`_Refused` stops what a GPU would refuse or wait for), copies from pageable memory are
    counted (``pageable``: lesson 02's ``_h2d_of``, and device-to-host ``copy_`` into pageable memory), and the
    pinned memory it allocates is remembered weakly (:meth:`kept_bytes`: what the learner still holds).

    Entered around the learner's call only. On the emulated stream, the queued device work that a wait of the
    learner's runs (``s.synchronize()``, an event's ``synchronize()``) is the emulated GPU's, not the learner's:
    it is not judged or counted. (While a mode's ``__torch_function__`` runs, torch takes the mode off the
    stack: the watch's own calls are not seen.)"""

    def __init__(self, s, who: str):
        super().__init__()
        self.s, self.who, self.pageable = s, who, 0
        self._pinned: list = []

    # -- what a tensor and a device argument are, on either stream
    def is_device(self, t) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        return self.s.is_device(t) if self.s.emulated else t.device.type == "cuda"

    def is_pinned(self, t) -> bool:
        return self.s.is_pinned(t) if self.s.emulated else t.is_pinned()

    def gpu_target(self, target) -> bool:
        """A ``device=`` or ``to()`` target names the GPU: a CUDA device (an int is a CUDA index), or on the
        emulation ``s.device`` itself (what ``gpu_tensor.device`` returns). ``"cpu"`` is the host, always."""
        if target is None or isinstance(target, bool):
            return False
        if isinstance(target, int):
            return True
        if self.s.emulated and target is self.s.device:
            return True
        try:
            return torch.device(target).type == "cuda"
        except (TypeError, RuntimeError, ValueError):
            return False

    def _draining(self) -> bool:
        return bool(self.s.emulated and getattr(self.s, "_draining", False))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._draining():
            return func(*args, **kwargs)  # the emulated GPU runs queued work: not the learner's call
        name = getattr(func, "__name__", "")
        capturing = bool(torch.cuda.is_current_stream_capturing())
        self._judge(name, args, kwargs, capturing)
        out = func(*args, **kwargs)
        if name == "pin_memory" or kwargs.get("pin_memory"):
            for t in _tensors(out):
                self._pinned.append(weakref.ref(t.untyped_storage()))
        return out

    def kept_bytes(self) -> int:
        """Bytes of the pinned memory allocated under this watch that something still holds."""
        seen = {}
        for ref in self._pinned:
            st = ref()
            if st is not None and st.nbytes():
                seen[st.data_ptr()] = st.nbytes()
        return sum(seen.values())

    # -- the rules
    def _judge(self, name: str, args: tuple, kwargs: dict, capturing: bool) -> None:
        first = args[0] if args else None
        if kwargs.get("pin_memory"):
            dev = kwargs.get("device")
            like_gpu = name.endswith("_like") and self.is_device(first) and (dev is None or self.gpu_target(dev))
            if like_gpu or self.gpu_target(dev):
                call = (f"`torch.{name}(a GPU tensor, pin_memory=True)`" if like_gpu
                        else f"`torch.{name}(..., device=<the GPU>, pin_memory=True)`")
                raise _Refused(
                    f"{self.who} asks torch to pin GPU memory with {call}: only host memory can be pinned, and on a "
                    f"GPU torch refuses it (\"{PIN_GPU_ERROR}\"). A `_like` factory makes memory where its model "
                    "lives: pin host memory instead (`meta.pin_memory()`, `torch.empty_like(meta, pin_memory=True)`, "
                    "or `device=\"cpu\"`).")
            if name in _FROM_DATA and isinstance(first, torch.Tensor):
                raise _Refused(
                    f"{self.who} calls `torch.{name}(a tensor, pin_memory=True)`: torch cannot pin a tensor built "
                    f"from a tensor (\"{PIN_DATA_ERROR}\"). Take a pinned snapshot with `t.pin_memory()`.")
        if name == "pin_memory" and self.is_device(first):
            raise _Refused(f"{self.who} calls `.pin_memory()` on a GPU tensor: only host memory can be pinned "
                           f"(torch: \"{PIN_GPU_ERROR}\"). Pin the host tensor, before it is copied.")
        if name in _FROM_DATA:
            self._judge_from_data(name, args, kwargs, capturing)
            return
        if capturing:
            h2d = _h2d_of(name, args, kwargs, self.is_device, self.gpu_target)
            d2h = (name == "copy_" and len(args) >= 2 and self.is_device(args[1]) and isinstance(first, torch.Tensor)
                   and not self.is_device(first))
            if (h2d is not None and not self.is_pinned(h2d[0])) or (d2h and not self.is_pinned(first)):
                raise _Refused(
                    f"{self.who} cannot be captured: it copies between pageable host memory and the GPU "
                    f"(torch: \"{CAPTURE_PAGEABLE_ERROR}\"). Build the tensor on the GPU, or copy it from pinned "
                    "memory outside the graph.")
        # a host tensor in device work: the emulated stream refuses it as a GPU does (streams.py), and
        # _explain names it
        if not capturing:
            h2d = _h2d_of(name, args, kwargs, self.is_device, self.gpu_target)
            if h2d is not None:
                self.pageable += not self.is_pinned(h2d[0])
            elif name == "copy_" and len(args) >= 2 and isinstance(args[1], torch.Tensor):
                if self.is_device(args[1]) and not self.is_device(first) and not self.is_pinned(first):
                    self.pageable += 1

    def _judge_from_data(self, name: str, args: tuple, kwargs: dict, capturing: bool) -> None:
        if name == "new_tensor":
            data = args[1] if len(args) > 1 else kwargs.get("data")
            to_gpu = self.gpu_target(kwargs["device"]) if kwargs.get("device") is not None else self.is_device(args[0])
        else:
            data = args[0] if args else kwargs.get("data", kwargs.get("obj"))
            dev = kwargs.get("device", args[2] if name in ("as_tensor", "asarray") and len(args) > 2 else None)
            to_gpu = self.gpu_target(dev)
        if not to_gpu or self.is_device(data):
            return
        call = _call_text(name)
        if capturing:
            raise _Refused(
                f"{self.who} cannot be captured: {call} copies host data to the GPU inside the capture (torch builds "
                f"the tensor in pageable host memory, then copies it: \"{CAPTURE_PAGEABLE_ERROR}\"). Build it on the "
                "GPU with a device op: `torch.arange(n, device=ids.device)`.")
        raise _Refused(
            f"{self.who} copies host data to the GPU through {call}: torch builds the tensor in pageable host memory "
            "and copies it with a blocking `.to(device)`, so the host waits for the GPU (and a graph could not "
            "capture it). Copy a pinned snapshot instead: `static.copy_(meta.pin_memory(), non_blocking=True)`.")


def _explain(name: str, exc: BaseException) -> str | None:
    """The diagnosis of an error torch (on a GPU) or the emulation raised for the learner's call, or None."""
    text = str(exc)
    if "unless the CPU tensor is pinned" in text or CAPTURE_PAGEABLE_ERROR in text:
        return (f"{name} cannot be captured: it copies between pageable host memory and the GPU (torch: "
                f"\"{CAPTURE_PAGEABLE_ERROR}\"). Build the tensor on the GPU, or copy it from pinned memory outside "
                "the graph.")
    if "same device" in text:
        return (f"{name} uses a host tensor in device work (torch: \"{SAME_DEVICE_ERROR}\"): build it on the GPU "
                "(`device=ids.device`), or copy it there first.")
    if "to numpy" in text:
        return (f"{name} converts a GPU tensor to numpy (torch: \"can't convert ... to numpy\"): numpy reads host "
                "memory, and the `.cpu()` torch suggests is a blocking copy, which a capture refuses too. Keep the "
                "step in torch ops on the device (`torch.clamp(..., out=out)`).")
    if "can be pinned" in text or "cannot pin" in text or "Can't pin" in text:
        return (f"{name} pins memory that cannot be pinned (torch: \"{text.splitlines()[0][:120]}\"): only host "
                "memory can be pinned; pin the host tensor (`meta.pin_memory()`).")
    return None


# ---- 1. a step that can be captured ---------------------------------------------------------------------

STEP_CASES = [[3, 1, 4, 1, 5, 9, 2, 6], [0] * 8, [400, 500, 600, 700, 1, 2, 3, 4], [7, 7, 7, 7, 7, 7, 7, 7]]


@checker
def check_capturable_step(fn) -> bool:
    """``step(ids, out)``: writes ``min(ids * 2 + position, LIMIT)`` into ``out`` using only device work, so that
    it can be captured in a CUDA graph and replayed for new ``ids``, and leaves ``ids`` as it was."""
    name = "capturable_step"
    learner_arg(name, fn, "(ids, out) -> None (writes into out)")
    with stream() as s:
        show("capturable_step checked on", s.label)
        ids = torch.zeros(8, dtype=torch.int64, device=s.device)
        out = torch.zeros(8, dtype=torch.int64, device=s.device)
        g = torch.cuda.CUDAGraph()
        try:
            with learner_call("step(ids, out) inside torch.cuda.graph(g)"), torch.cuda.graph(g), _Watch(s, name):
                fn(ids, out)
        except LearnerStop as stop:
            return _fail(name, str(stop) if isinstance(stop, _Refused) else f"{name}: {stop}")
        except Exception as exc:  # noqa: BLE001 - the learner's step, reported
            if is_stub(exc, fn):
                return not_implemented(name)
            known = _explain(name, exc)
            if known:
                return _fail(name, known)
            text = str(exc)
            if "capturing" in text or "during capture" in text:  # CUDA's, or the error ending the capture
                return _fail(name, f"{name} cannot be captured: it makes the host wait for the GPU (a `.item()`, "
                                   "`.tolist()`, `print` of a device value or a blocking copy). A capture records "
                                   "work without running it: compute the decision on the device instead.")
            return _fail(name, f"capturing {name}(ids, out) raised {raised(exc)}")
        for case in STEP_CASES:
            ids.copy_(torch.tensor(case, dtype=torch.int64))   # outside the graph: the step's new input
            g.replay()
            s.synchronize()
            got, want = out.tolist(), reference_step(torch.tensor(case, dtype=torch.int64)).tolist()
            if got != want:
                if got == reference_step(torch.zeros(8, dtype=torch.int64)).tolist() and any(case):
                    return _fail(name, f"replayed with ids={case}, out was {got}: the answer computed at capture "
                                       "time. A graph replays its kernels, not the Python around them: compute "
                                       "out from ids with torch ops on the device, inside the step.")
                return _fail(name, f"replayed with ids={case}, out was {got}, expected {want} "
                                   f"(min(ids * 2 + position, {LIMIT})).")
            after = ids.tolist()
            if after != case:
                return _fail(name, f"replayed with ids={case}, out was right but ids became {after}: the step writes "
                                   "into ids, the graph's input. An engine fills the input once per step and other "
                                   "kernels read it too: write only into out (`torch.clamp(..., out=out)`), never "
                                   "in place into ids.")
    _failures.pop(name, None)
    print(f"✅ {name} is correct: captured, and {len(STEP_CASES)} replays computed all {len(STEP_CASES[0])} values "
          "of out from new ids, leaving ids as they were.")
    return True


# ---- 2. staging a captured step's inputs ------------------------------------------------------------------

def step_values(n: int) -> list[int]:
    """Step ``n``'s host metadata in :func:`staging_run`: :data:`META_INTS` values, none shared with another
    step, with 0 (the static input's start) or -1 (the host's rewrite)."""
    n = positive_int("n", n, allow_zero=True, maximum=10**8)
    return [META_INTS * (n + 1) + i for i in range(META_INTS)]


@contextmanager
def _entered(s):
    """``with s:``, where a LaggingStream already active (entered by the caller) is a ValueError naming ``s``."""
    try:
        s.__enter__()
    except RuntimeError as exc:
        raise ValueError(f"s: {exc} (staging_run enters the stream itself: hand it one that is not active)") from None
    try:
        yield s
    except BaseException:
        s.__exit__(*sys.exc_info())
        raise
    s.__exit__(None, None, None)


def staging_run(stage, s=None, *, steps: int = STAGE_STEPS, busy_ms: float | None = None) -> dict:
    """The regression test's loop (lesson 08) with the learner's ``stage(s, meta, static, state)``, ``steps``
    steps on ``s`` (a :class:`pinlab.LaggingStream` or None: the CUDA stream; entered here, so not one already
    active). Step n writes :func:`step_values` into the pageable ``meta``, calls ``stage``, replays the graph
    (its kernel copies the whole static input to ``out``), keeps ``out`` and rewrites ``meta`` with -1. The GPU
    starts ``busy_ms`` behind the host (default: :data:`BUSY_MS_PER_60_STEPS` per 60 steps).

    Returns ``seen`` (per step, the :data:`META_INTS` values its replay read), ``pageable`` (copies from
    pageable memory the stage made), ``waited`` (the busy work queued before the loop had run when it ended:
    the host waited for the GPU) and ``kept_pinned_bytes`` (pinned memory the stage allocated and still holds
    after the loop, in bytes; ``kept_steps``: that in steps' worth of metadata, a ring's depth). Raises what
    :class:`_Watch` refuses (a :class:`pinlab.checks.LearnerStop`) or what the stage raises."""
    callable_arg("stage", stage)
    if s is not None and not (hasattr(s, "emulated") and hasattr(s, "synchronize") and hasattr(s, "Event")):
        raise TypeError(f"s must be a pinlab stream (pinlab.LaggingStream(), pinlab.stream()) or None (the CUDA "
                        f"stream), got {type(s).__name__}")
    steps = positive_int("steps", steps, maximum=2 * MAX_RING + 4 + STAGE_STEPS)
    if busy_ms is None:
        busy_ms = BUSY_MS_PER_60_STEPS * max(1.0, steps / STAGE_STEPS)
    busy_ms = positive_number("busy_ms", busy_ms, maximum=10_000.0)
    s = steploop.cuda_or(s, "staging_run()")
    if s.emulated and not callable(getattr(s, "is_device", None)):
        raise TypeError(f"s must be a pinlab stream (pinlab.LaggingStream()) or None, got {type(s).__name__}")
    with _entered(s):
        values = torch.tensor([step_values(n) for n in range(steps)], dtype=torch.int32)  # host memory
        meta = torch.zeros(META_INTS, dtype=torch.int32)
        static = torch.zeros(META_INTS, dtype=torch.int32, device=s.device)
        out = torch.zeros(META_INTS, dtype=torch.int32, device=s.device)
        seen = torch.zeros(steps, META_INTS, dtype=torch.int32, device=s.device)
        state: dict = {}
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out.copy_(static)                     # the step's kernels read the static input
        s.busy(busy_ms)                           # the GPU far behind the host
        behind = s.Event()
        behind.record()
        watch = _Watch(s, "stage")
        for n in range(steps):
            meta.copy_(values[n])
            with learner_call(f"stage(s, meta, static, state) at step {n}"), watch:
                stage(s, meta, static, state)
            g.replay()
            seen[n].copy_(out)
            meta.fill_(-1)                        # the host rewrites the metadata at once
        waited = behind.query()
        s.synchronize()
        kept = watch.kept_bytes()
        rows = seen.tolist()
    per_step = META_INTS * 4
    return {"seen": rows, "pageable": watch.pageable, "waited": bool(waited), "kept_pinned_bytes": kept,
            "kept_steps": math.ceil(kept / per_step), "steps": steps}


def _wrong_row(n: int, row: list[int]) -> str:
    """Why step ``n``'s replay read ``row`` instead of :func:`step_values` of ``n``, in the lesson's terms."""
    want = step_values(n)
    if all(v == -1 for v in row):
        return (f"step {n}'s replay read the rewritten metadata (-1): the copy read memory the host rewrote before "
                "the copy ran. A buffer reused every step (pinned, captured or not) races when the GPU is behind; "
                "give every step its own pinned snapshot.")
    m = row[0] // META_INTS - 1
    if m >= 0 and m != n and row == step_values(m):
        if m > n:
            return (f"step {n}'s replay read step {m}'s data: the copy read memory the host rewrote before the "
                    "copy ran. A buffer reused every step (pinned, captured or not) races when the GPU is behind; "
                    "give every step its own pinned snapshot.")
        return (f"step {n}'s replay read step {m}'s data: the static input did not receive this step's metadata "
                "before the replay. Copy into `static` (the graph's own input), in place, before the replay.")
    right = sum(a == b for a, b in zip(row, want))
    if right:
        return (f"step {n}'s replay read only {right} of its {META_INTS} values (it read {row}, expected {want}): "
                "copy all of meta into static, not a part of it.")
    return (f"step {n}'s replay read {row[:4]}...: the static input did not receive this step's metadata before "
            "the replay. Copy into `static` (the graph's own input), in place, before the replay.")


@checker
def check_graph_stage(fn) -> bool:
    """``stage(s, meta, static, state)``: gets all of ``meta``'s current contents into the graph's static input
    for the replay that follows, while the host rewrites ``meta`` right after; no pageable copy, no wait for the
    GPU. A stage that keeps pinned memory between steps is run for more steps than it keeps buffers."""
    name = "stage"
    learner_arg(name, fn, "(s, meta, static, state) -> None")
    s = stream()
    show("stage checked on", s.label)
    try:
        run = staging_run(fn, s)
        depth = run["kept_steps"]
        if depth > MAX_RING:
            return _fail(name, f"{name} keeps {depth} steps' worth of pinned memory between steps (a ring of about "
                               f"{depth} buffers): deeper than the {MAX_RING} steps this check runs around, and a "
                               "ring only postpones the wait it needs when it wraps. Give every step its own "
                               "pinned snapshot (`meta.pin_memory()`).")
        if 2 * depth + 4 > run["steps"]:         # a ring deeper than the loop: run it until it wraps, twice
            run = staging_run(fn, s, steps=2 * depth + 4)
    except _Refused as stop:
        return _fail(name, str(stop))
    except LearnerStop as stop:
        return _fail(name, f"{name}: {stop}")
    except Exception as exc:  # noqa: BLE001
        if is_stub(exc, fn):
            return not_implemented(name)
        known = _explain(name, exc)
        return _fail(name, known or f"{name}(s, meta, static, state) raised {raised(exc)}")
    seen, steps = run["seen"], run["steps"]
    wrong = [n for n, row in enumerate(seen) if row != step_values(n)]
    if wrong:
        return _fail(name, f"{name}: {len(wrong)} of {steps} steps did not read their own metadata; "
                           f"{_wrong_row(wrong[0], seen[wrong[0]])}")
    ring = (f" (it keeps {run['kept_steps']} steps' worth of pinned memory, a ring: checked over {steps} steps, "
            "more than twice its depth)") if run["kept_steps"] else ""
    if run["waited"]:
        return _fail(name, f"{name} is correct but waits for the GPU{ring}: the busy work queued before the loop had "
                           "run when it ended. A sync, a blocking copy or an event wait (a ring of buffers wraps "
                           "around while the GPU is behind) ties the host to the GPU; a pinned snapshot needs no wait.")
    if run["pageable"]:
        return _fail(name, f"{name} is correct here but makes {run['pageable']} copies from pageable memory: the "
                           "driver stages small ones at the call, but a large one waits for the GPU, and a graph "
                           "cannot capture them. Copy a pinned snapshot (`meta.pin_memory()`).")
    _failures.pop(name, None)
    print(f"✅ {name} is correct: {steps} steps each read all {META_INTS} values of their own metadata, the host never "
          f"waited{ring}, no pageable copy.")
    return True
