"""Exercise checkers for lesson 04 (the fix).

Each checker prints one verdict line (⏳ not implemented, ❌ what is wrong, in the lesson's terms,
✅ correct), adds a hint from the second failure on, and returns True or False.
``tests/test_checks_l04.py`` proves each accepts the master solution and rejects planted wrong
answers with the right message. (Why about 670 lines: three checkers, each with the step loop that
shows its race on the GPU and on the emulated stream, judged by data and by order, and a message for every
planted wrong answer.)

* :func:`check_pin_snapshot` runs the learner's ``pin_snapshot(t)`` on pageable and pinned tensors
  (reference: :func:`pinlab.h2d.pin_snapshot`), then in a step loop that rewrites one reused pinned
  buffer every step while the GPU lags behind: no call may return memory an earlier call returned while
  that memory lives (a pool of any depth), and no race its order allows may remain.
* :func:`check_ring_stage` runs the learner's staging step of an event-guarded ring of pinned
  buffers for 200 steps, the host up to :data:`AHEAD` steps ahead of the GPU: with a ring deep
  enough (it must never make the host wait) and with a shallower one (it must wait, not race).
  It also notes, per step, whether ``events[k]`` was recorded before the copy out of ``ring[k]``:
  that race does not show on a GPU whose small copy runs before the host rewrites the buffer.
* :func:`check_min_ring_depth` checks the arithmetic of the ring's depth on timelines
  (reference: :func:`pinlab.steploop.min_ring_depth`).

The two torch checkers run on the CUDA stream on a GPU (a busy GPU, :data:`BUSY_MS` per step) and
on the emulated :class:`pinlab.LaggingStream` without one, where device work waits in a queue
until the host waits for it: what a lagging GPU would read is then exact. Their step loops also run
under :func:`pinlab.order.detect_races`: a race the loop's order allows is named (by the line of the
learner's function) even where this run's GPU kept up and no data was corrupted.
"""
from __future__ import annotations

import weakref
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

from .. import steploop
from ..order import detect_races
from ..races import H2D_REWRITE
from ..streams import stream as _default_stream
from ..timing import show
from . import (checker, say, LearnerStop, is_stub, learner_arg, learner_call, not_implemented, raised, run_cases, same_int,
               same_tensor)
from .l02 import _span
from .l03 import learner_name, learner_place, race_counts, timeline_cases

STEPS = 200        #: steps of each step loop
AHEAD = 4          #: the step loop's run-ahead (steploop.RUN_AHEAD): a ring needs AHEAD + 1 buffers
BUSY_MS = 1.0      #: GPU work per step (CUDA): the host needs well under this per step
N_INTS = 4096      #: int32 values per step's data (16 KiB)
SHALLOW = 2        #: the ring that must make the host wait (shallower than AHEAD + 1)
#: pin_snapshot's step loop keeps this many steps in flight: a "snapshot" recycled from a pool shallower than
#: this is caught racing (its copy is still queued); one from a deeper pool (fewer than STEPS buffers) is caught
#: too, as memory returned again while it is still held (every snapshot handed out is followed, no window)
SNAPSHOT_AHEAD = 64
#: every ring buffer comes round at least this many times in a run: rings are checked over more steps than
#: their depth
MIN_ROUNDS = 2
assert STEPS >= MIN_ROUNDS * (AHEAD + 1) and STEPS > SNAPSHOT_AHEAD
#: run-ahead AHEAD in this exercise's words (steploop.RUN_AHEAD)
_RUN_AHEAD_HERE = f"the host may write step n+{AHEAD}'s data while the GPU has not yet run step n's copy"

_failures: Counter = Counter()

HINTS = {
    "pin_snapshot": "`t.pin_memory()` copies only a pageable t; for a pinned t it returns t itself. "
                    "Allocate a new pinned tensor and copy t into it, whatever t is: "
                    "`torch.empty_like(t, pin_memory=True).copy_(t)`.",
    "ring_stage": "k = n % len(ring); `events[k].synchronize()` (the host waits only until the copy that last "
                  "read ring[k] has run); `ring[k].copy_(data)`; `dst.copy_(ring[k], non_blocking=True)`; "
                  "`events[k].record()` (after the copy, so that it completes when the copy has run).",
}


def reset() -> None:
    """Forget earlier failures (the hint shows from a checker's second failure on)."""
    _failures.clear()


def _fail(name: str, message: str) -> bool:
    _failures[name] += 1
    say(f"❌ {message}")
    if _failures[name] >= 2:
        say(f"💡 Hint: {HINTS[name]}")
    return False


# ---- the step loop both torch checkers run ------------------------------------------------------

def _gpu_step() -> None:
    """One step's GPU work on the emulated stream (it has no time: a queued item, run when the host waits)."""


def _marked(s, busy_ms: float):
    """The GPU's work for one step, then an event that completes when it has run. On the emulated stream the
    work is one queued item: the GPU is behind by every step in flight, so a wait for any of them is a wait."""
    if s.emulated:
        s.launch(_gpu_step)
    else:
        s.busy(busy_ms)
    e = s.Event()
    e.record()
    return e


def _queued(mark) -> bool:
    """Whether the checker's own ``mark`` has not run yet, looked at without ordering the host: a ``query()`` that
    returns True orders the host after the mark (:mod:`pinlab.order`), so on a GPU that keeps up the checker's
    own counting would order every copy of the learner's before its next step, and hide its races."""
    lagging = getattr(mark, "_mark", False)
    if lagging is not False:  # an emulated event: its mark in the queue (None: never recorded)
        return lagging is not None and not lagging.done
    cuda_event = getattr(torch._C, "_CudaEventBase", None)
    if cuda_event is not None and isinstance(mark, cuda_event):
        return not cuda_event.query(mark)  # torch's own query, beneath the Python method the order detector wraps
    return not mark.query()


def _step_loop(s, stage, *, steps: int = STEPS, run_ahead: int = AHEAD, busy_ms: float = BUSY_MS,
               n_ints: int = N_INTS, before: list | None = None, host_waits: list | None = None):
    """Run ``stage(n, data, dst[n])`` for ``steps`` steps, the host at most ``run_ahead`` steps ahead of
    the GPU (it starts ``run_ahead`` steps behind). ``data`` is step n's pageable host data, every value
    ``n + 1``; ``dst[n]`` its row of device memory.

    Returns ``(delivered, in_flight)``: ``delivered[n]`` the step whose data row n holds (-1: no data,
    -2: a mix); ``in_flight[n]`` how many earlier steps the GPU had not finished right after
    ``stage`` returned (``run_ahead`` when the host did not wait for the GPU; less when it did). Where
    ``before`` is a list, it gets the same count taken right before each ``stage`` call: the GPU work
    that finished *during* the call (``before[n] - in_flight[n]``) tells a stage that waited from a host
    that is merely slow between calls (a shared or 2-core machine). Where ``host_waits`` is a list, it gets,
    on the emulated stream, how many times the host waited for the GPU during each ``stage`` call
    (``LaggingStream.host_waits``: exact).
    """
    dst = torch.zeros(steps, n_ints, dtype=torch.int32, device=s.device)
    s.synchronize()
    marks = [_marked(s, busy_ms) for _ in range(run_ahead)]
    in_flight = []
    for n in range(steps):
        if n:
            marks[n - 1].synchronize()  # step n - run_ahead - 1 has run: the host is at most `run_ahead` ahead
        data = torch.full((n_ints,), n + 1, dtype=torch.int32)
        if before is not None:
            before.append(sum(_queued(m) for m in marks[-run_ahead:]))
        waits_before = s.host_waits if s.emulated else 0
        stage(n, data, dst[n])
        if host_waits is not None and s.emulated:
            host_waits.append(s.host_waits - waits_before)
        in_flight.append(sum(_queued(m) for m in marks[-run_ahead:]))
        marks.append(_marked(s, busy_ms))
    s.synchronize()
    rows = dst.cpu()
    lo, hi = rows.min(dim=1).values.tolist(), rows.max(dim=1).values.tolist()
    delivered = [a - 1 if a == b else -2 for a, b in zip(lo, hi)]
    return delivered, in_flight


def _corruption(delivered) -> str | None:
    """'step 17 of 200 delivered step 18's data (...)' for the first wrong step, or None."""
    bad = [n for n, got in enumerate(delivered) if got != n]
    if not bad:
        return None
    n, got = bad[0], delivered[bad[0]]
    steps = len(delivered)
    what = {-1: "no data (its row of dst is still zeros)", -2: "a mix of several steps' data"}.get(
        got, f"step {got}'s data")
    return f"step {n} of {steps} delivered {what} ({len(bad)} of {steps} steps corrupted)"


def _describe(t) -> str:
    kind = "pinned" if t.is_pinned() else "pageable"
    layout = "" if t.is_contiguous() else " non-contiguous"
    return f"<{kind}{layout} {tuple(t.shape)} {str(t.dtype).replace('torch.', '')}>"


# ---- 1. pin_snapshot ----------------------------------------------------------------------------

def _snapshot_inputs():
    """(maker, ...) the tensors pin_snapshot is tried on; made inside the stream (pinned ones need it)."""
    g = torch.Generator().manual_seed(404)
    return [
        lambda: torch.randn(3, 4, generator=g),                                           # pageable
        lambda: torch.arange(48, dtype=torch.int64).reshape(6, 8)[:, ::2],                # non-contiguous
        lambda: torch.randn(4, 6, generator=g).to(torch.bfloat16).t(),                    # transposed
        lambda: torch.tensor(7, dtype=torch.uint8),                                       # 0-d
        lambda: torch.empty(0, 3),                                                        # empty
        lambda: torch.randn(64, generator=g).pin_memory(),                                # pinned
        lambda: torch.randint(-9, 9, (5, 7), generator=g, dtype=torch.int32).pin_memory(),
        lambda: torch.randn(6, 8, generator=g).half().pin_memory()[:, 1::2],              # a pinned view
        lambda: (torch.arange(10) % 3 == 0).pin_memory(),                                 # bool
        lambda: torch.tensor(2.5, dtype=torch.float64).pin_memory(),                      # pinned 0-d
        lambda: torch.empty(0, dtype=torch.int64).pin_memory(),                           # pinned empty
    ]


def _snapshot_problem(s, t, desc, expected, out) -> str | None:
    """What is wrong with ``out = pin_snapshot(t)`` (None: nothing); ``desc`` describes ``t``."""
    call = f"pin_snapshot({desc})"
    if not isinstance(out, torch.Tensor):
        return f"{call} returned {type(out).__name__}, not a tensor: return the pinned copy."
    if out.shape != expected.shape or out.dtype != expected.dtype:
        return (f"{call} returned shape {tuple(out.shape)} {out.dtype}, t is {tuple(expected.shape)} "
                f"{expected.dtype}: a snapshot is a copy of t (same shape, same dtype).")
    if (s.is_device(out) if s.emulated else out.device.type != "cpu"):
        return (f"{call} returned a tensor on the GPU: the snapshot stays in host memory (pinned), the "
                "source of the non_blocking copy the caller makes next.")
    if out.numel() and out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
        if t.is_pinned():
            return (f"{call}: this returns the same storage: pin_memory() of a pinned tensor is a no-op "
                    "(it returns t itself). The caller rewrites t at the next step, and the copy that is "
                    "still queued reads the new data: the race of lesson 03 again.")
        return (f"{call}: this returns t's own storage, not a snapshot: the caller rewrites t at the next "
                "step, while the copy that reads it may still be queued.")
    if out.numel() and not out.is_pinned():
        return (f"{call}: this returns pageable memory, not pinned: a non_blocking copy from pageable memory "
                "is staged by the driver (and blocks the host when it is large, lesson 02). The snapshot "
                "must be pinned.")
    if not same_tensor(out, expected):
        return (f"{call}: the values differ from t's: a snapshot is a bitwise copy of t "
                "(a pinned tensor allocated but never filled holds whatever was in that memory).")
    return None


@checker
def check_pin_snapshot(fn, stream=None) -> bool:
    """``pin_snapshot(t)``: a pinned copy of the host tensor ``t`` with its own storage (the caller
    may rewrite ``t`` right after), equal to ``t``, for pageable and already pinned ``t``. Then used
    in a step loop that rewrites one pinned buffer every step: no step may see a later step's data.

    ``stream``: the stream to run on (default :func:`pinlab.stream`: CUDA, or emulated without it).
    """
    name = "pin_snapshot"
    learner_arg(name, fn, "(t) -> tensor (a pinned copy of t)")
    s = _default_stream() if stream is None else stream
    with s:
        show("pin_snapshot checked on", s.label)
        makers = _snapshot_inputs()
        for make in makers:
            t = make()
            desc, expected = _describe(t), t.clone()
            try:
                with learner_call(f"pin_snapshot({desc})"):
                    out = fn(t)
            except LearnerStop as stop:  # it ran past its time, or left torch's state changed
                return _fail(name, f"{name}: {stop}")
            except Exception as exc:  # the learner's bug, reported, not raised
                if is_stub(exc, fn):
                    return not_implemented(name)
                return _fail(name, f"pin_snapshot({desc}) raised {raised(exc)}")
            problem = _snapshot_problem(s, t, desc, expected, out)
            if problem:
                return _fail(name, problem)

        buf = torch.zeros(N_INTS, dtype=torch.int32, pin_memory=True)   # the reused pinned buffer
        # every snapshot handed out, for as long as its memory lives: a correct pin_snapshot never returns memory
        # it returned before while that memory is still alive (held by a pool, or by the copy still queued): a
        # new block cannot lie there, and the caching host allocator hands a freed pinned block out again only
        # once the events recorded for its copies have completed (PyTorch, aten/src/ATen/core/
        # CachingHostAllocator.h; lesson 04's allocator_reuse shows it on the GPU). No window of steps: a pool
        # of any depth that comes round within the loop is caught, whether or not its copy has run
        handed = _Handed()

        def stage(n, data, dst):
            buf.copy_(data)                                     # the host writes step n into buf
            races_before = races.total
            with learner_call(f"pin_snapshot(buf) at step {n} of the step loop"):
                snap = fn(buf)
            if isinstance(snap, torch.Tensor) and snap.numel():
                m = handed.earlier(snap)
                if m is not None:
                    # by order: did pin_snapshot write into memory whose copy nothing had ordered yet?
                    raise _Recycled(n, m, races.total > races_before)
                handed.add(n, snap)
            dst.copy_(snap, non_blocking=True)                  # and copies a snapshot of it

        setting = (f"run-ahead {SNAPSHOT_AHEAD} (the host may write step n+{SNAPSHOT_AHEAD}'s data while the GPU "
                   "has not yet run step n's copy)")
        try:
            # judged by order too (pinlab.order.detect_races): the races the loop's order allows, whatever the
            # GPU's speed
            with detect_races() as races:
                delivered, _ = _step_loop(s, stage, run_ahead=SNAPSHOT_AHEAD)
        except LearnerStop as stop:
            return _fail(name, f"{name}: {stop}")
        except _Recycled as e:
            n, m, pending = e.args
            s.synchronize()
            if not pending:
                return _fail(name, f"pin_snapshot(buf) at step {n} of the step loop returned the pinned memory it "
                                   f"returned at step {m}, which it still holds (a pool of {n - m} buffers, or a "
                                   f"cache): a caller with {n - m} or more steps in flight is still copying from "
                                   f"it then (this loop: {setting}), and pin_snapshot cannot know how far ahead of "
                                   "the GPU its caller runs: allocate new pinned memory at every call "
                                   "(`torch.empty_like(t, pin_memory=True).copy_(t)`); the caching host allocator "
                                   "reuses a block only once its copy has run.")
            return _fail(name, f"pin_snapshot(buf) at step {n} of the step loop returned the pinned memory it "
                               f"returned at step {m}, whose copy to the GPU had not run yet ({setting}): the "
                               "caller writes into it now, and that copy reads the new data (the race of lesson "
                               f"03). A pool of buffers is safe only while it is deeper than the steps in flight, "
                               f"which pin_snapshot cannot know ({n - m} were not enough here): allocate new pinned "
                               "memory at every call (`torch.empty_like(t, pin_memory=True).copy_(t)`); the caching "
                               "host allocator reuses a block only once its copy has run.")
        except Exception as exc:
            return _fail(name, f"pin_snapshot in the step loop raised {raised(exc)}")
        bad = _corruption(delivered)
        if bad:
            return _fail(name, f"pin_snapshot in the step loop: {bad}. The loop rewrites one pinned buffer every "
                               f"step with {setting}, and copies pin_snapshot(buf) with non_blocking=True: each "
                               "call must return new memory that nothing writes again (a snapshot reused by "
                               "a later call is the same race).")
        if races.findings:
            f = races.findings[0]
            fname = learner_name(fn, name)
            return _fail(name, f"pin_snapshot in the step loop: a snapshot it returned earlier can race: "
                               f"{f.kind} at {learner_place(fn, f.seen_where, fname)}, while the step loop's "
                               f"copy from it could still be queued ({race_counts(races)}): once returned, a "
                               "snapshot belongs to the caller's copy, so pin_snapshot must not touch it again; "
                               "allocate new pinned memory at every call and keep no reference to it.")
    _failures.pop(name, None)
    say(f"✅ {name} is correct ({len(makers)} tensors, pageable and pinned: pinned copies with their own storage, "
        f"bit for bit; {STEPS} steps rewriting one pinned buffer, run-ahead {SNAPSHOT_AHEAD}: no call returned "
        "memory whose copy was still queued, 0 corrupted).")
    return True


# ---- 2. ring_stage: a ring of pinned buffers guarded by events ----------------------------------

class _NotInRing(Exception):
    pass


class _Recycled(Exception):
    """pin_snapshot returned, at step n, the memory it returned at step m, still alive: ``(n, m, pending)``,
    ``pending``: it wrote into that memory while the copy from it was unordered (a race by order)."""


class _Handed:
    """Every snapshot pin_snapshot handed out: its storage (held weakly: memory the program frees goes back to the
    allocator), its bytes, its step."""

    def __init__(self):
        self._by_base: dict[int, list] = {}

    def earlier(self, t: torch.Tensor) -> int | None:
        """The latest step that returned bytes ``t`` shares, in a storage still alive (None: none did)."""
        st = t.untyped_storage()
        entries = self._by_base.get(st.data_ptr())
        if not entries:
            return None
        entries[:] = [e for e in entries if e[0]() is not None]  # freed: the allocator orders their reuse
        lo, hi = _span(t)
        hits = [m for ref, a, b, m in entries if ref() is st and a < hi and lo < b]
        return max(hits) if hits else None

    def add(self, n: int, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        self._by_base.setdefault(st.data_ptr(), []).append((weakref.ref(st), *_span(t), n))


class _LoggedEvent:
    """The event guarding ``ring[j]``, as handed to the learner: it notes each ``record()`` in the
    step's log (to tell an event recorded before the copy it should follow), the rest is the event's."""

    def __init__(self, event, log: list, j: int):
        self._event, self._log, self._j = event, log, j

    def record(self, stream=None) -> None:
        self._log.append(("record", self._j))
        if stream is None:
            self._event.record()
        else:
            self._event.record(stream)

    def synchronize(self) -> None:
        # ("wait", j, pending): pending when the event had not been reached (the host really waited)
        self._log.append(("wait", self._j, not self._event.query()))
        self._event.synchronize()

    def query(self) -> bool:
        done = self._event.query()
        self._log.append(("look", self._j, not done))  # a look (pending: not reached); a poll, if repeated
        return done

    def wait(self, stream=None) -> None:
        if stream is None:
            self._event.wait()
        else:
            self._event.wait(stream)


class _CopyLog(TorchFunctionMode):
    """Notes ``dst.copy_(ring[j], ...)`` (these very tensor objects) in the step's log, and
    ``dst.copy_(data, ...)`` as ``("copy", None)``, and each in-place write into ``ring[j]`` itself
    (``ring[j].copy_(data)``, ``ring[j][:] = ...``) as ``("write", j)``; changes nothing."""

    def __init__(self, log: list, ring, dst, data=None):
        super().__init__()
        self.log, self.ring, self.dst, self.data = log, ring, dst, data

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name == "copy_" and len(args) >= 2 and args[0] is self.dst:
            for j, b in enumerate(self.ring):
                if args[1] is b:
                    self.log.append(("copy", j))
            if self.data is not None and args[1] is self.data:
                self.log.append(("copy", None))
        elif args and (name == "__setitem__" or (name.endswith("_") and not name.startswith("_"))):
            for j, b in enumerate(self.ring):
                if args[0] is b:
                    self.log.append(("write", j))
        return func(*args, **(kwargs or {}))


def _recorded_before_copy(log) -> int | None:
    """The buffer j whose copy this step came after every record of events[j] (None: no such j).
    A buffer whose event was not recorded at all is left to the race check."""
    log = [entry[:2] for entry in log]
    for j in sorted({j for kind, j in log if kind == "copy" and j is not None}):
        last_copy = max(i for i, (kind, b) in enumerate(log) if kind == "copy" and b == j)
        records = [i for i, (kind, b) in enumerate(log) if kind == "record" and b == j]
        if records and max(records) < last_copy:
            return j
    return None


class _RecordedEarly(Exception):
    pass


class _WrongSlot(Exception):
    """A step whose copy, or event, was not the ring buffer it wrote: ``(n, message)``."""


def _slot_problem(n: int, log, written: list) -> str | None:
    """What a step did with the wrong ring buffer (None: nothing): it wrote step n's data into ring[k]
    (``written``) but copied from another buffer, or from ``data`` itself, or recorded another buffer's
    event than the one it copied from, or waited on (or polled) another buffer's event than the one it rewrote."""
    copies = [e[1] for e in log if e[0] == "copy"]
    records = [e[1] for e in log if e[0] == "record"]
    waits = [e[1] for e in log if e[0] == "wait"] + _polled(log)  # synchronize() calls, and polling loops
    if None in copies:
        return (f"ring_stage: at step {n}, dst was copied from data itself (pageable memory, staged by the driver), "
                f"not from the ring buffer you wrote it into: copy out of ring[k], the pinned buffer.")
    for j in sorted({c for c in copies if c is not None}):
        first_copy = min(i for i, e in enumerate(log) if e[0] == "copy" and e[1] == j)
        if any(e[0] == "write" and e[1] == j for e in log[first_copy:]):
            return (f"ring_stage: at step {n}, the copy out of ring[{j}] was enqueued before data was written into "
                    f"ring[{j}]: a non_blocking copy reads its source when the GPU gets to it, which on a GPU may be "
                    "before the write, during it or after it (the emulated GPU, always behind, reads the new data; a "
                    f"real one need not). Write data into ring[{j}] first, then copy it into dst.")
    ring_copies = sorted(set(copies))
    if not written or not ring_copies:
        return None  # no copy out of the ring seen (a view of it, say): the race check decides
    k = written[0]
    if not set(ring_copies) & set(written):
        return (f"ring_stage: at step {n}, step {n}'s data was written into ring[{k}] but the copy read "
                f"ring[{ring_copies[0]}]: use the same index for the write, the copy and the event "
                f"(k = n % len(ring)); the buffer copied from holds another step's data, or is rewritten while its "
                "copy waits in the queue.")
    if records and not set(records) & set(ring_copies):
        j = ring_copies[0]
        return (f"ring_stage: at step {n}, the copy read ring[{j}] but the event recorded after it was "
                f"events[{records[-1]}]: record events[{j}], the event of the buffer you copied from, so that the "
                f"wait before ring[{j}] is rewritten waits for this copy, not for another one.")
    other = [j for j in waits if j not in written]
    if other:
        j = other[0]
        return (f"ring_stage: at step {n}, the host waited on events[{j}] but rewrote ring[{k}]: wait on events[{k}], "
                f"the event recorded after the copy that last read ring[{k}]. events[{j}] guards another buffer, "
                "whose last copy is more recent: waiting for it makes the host wait where no wait is needed, and "
                "gives up run-ahead.")
    return None


def _polled(log) -> list:
    """The events one step's log shows polled: queried again after a query that found them not reached."""
    pending, polled = set(), []
    for e in log:
        if e[0] == "look":
            if e[1] in pending and e[1] not in polled:
                polled.append(e[1])
            if e[2]:
                pending.add(e[1])
    return polled


def _explicit_waits(log) -> int:
    """The waits one step's log shows on the events handed to the learner: each ``synchronize()`` of an event
    not yet reached, and one for each event polled."""
    return sum(1 for e in log if e[0] == "wait" and e[2]) + len(_polled(log))


def _ring_run(s, fn, depth):
    """Run the learner's ring_stage through :func:`_step_loop` with a ring of ``depth``, under
    :func:`pinlab.order.detect_races`. Returns ``(delivered, in_flight, before, waits, rounds, races)``:
    ``waits[n]`` how many times the host waited for the GPU in step n's stage (on the emulated stream all of
    them, exact; on CUDA those on the events handed to it), ``rounds[j]`` how many steps wrote ``ring[j]``,
    ``races`` the order verdict's report."""
    ring = [torch.zeros(N_INTS, dtype=torch.int32, pin_memory=True) for _ in range(depth)]
    log: list = []
    events = [_LoggedEvent(s.Event(), log, j) for j in range(depth)]
    writes = Counter()

    buffers = tuple(ring)  # the checker's own references: the learner's code may change the list
    explicit: list = []

    def stage(n, data, dst):
        log.clear()
        with _CopyLog(log, ring, dst, data), learner_call(f"ring_stage({n}, data, ring, events, dst)"):
            fn(n, data, ring, events, dst)
        written = [j for j, b in enumerate(buffers) if torch.equal(b, data)]
        if not written:
            raise _NotInRing(n)
        writes.update(written)
        explicit.append(_explicit_waits(log))
        problem = _slot_problem(n, log, written)
        if problem is not None:
            raise _WrongSlot(n, problem)
        j = _recorded_before_copy(log)
        if j is not None:
            raise _RecordedEarly(n, j)

    before: list = []
    host_waits: list = []
    with detect_races() as races:  # the verdict by order, whatever the GPU's speed
        delivered, in_flight = _step_loop(s, stage, before=before, host_waits=host_waits)
    waits = host_waits if s.emulated else explicit
    return delivered, in_flight, before, waits, [writes[j] for j in range(depth)], races


def _ring_race(fn, races, setting: str) -> str:
    """The first race the ring's order allows, named by the lines of the learner's ring_stage."""
    f = races.findings[0]
    name = learner_name(fn, "ring_stage")
    copy, seen = learner_place(fn, f.copy_where, name), learner_place(fn, f.seen_where, name)
    if f.kind != H2D_REWRITE:
        return f"ring_stage: with {setting}, the copy at {copy} can race: {f.kind} at {seen} ({race_counts(races)})."
    return (f"ring_stage: with {setting}, the copy at {copy} can race with the host's write into its ring buffer at "
            f"{seen}, which nothing the host waited on orders after that copy ({race_counts(races)}): before "
            "writing ring[k], wait on the host (`events[k].synchronize()`) for the event recorded after the copy "
            "that last read it.")


def waited_steps(before, in_flight, run_ahead: int = AHEAD) -> int:
    """How many steps of :func:`_step_loop` made the host wait for the GPU: the host had lost its run-ahead
    (at most ``run_ahead - 2`` steps queued right after the call) *and* GPU work finished during the call itself
    (``before[n] > in_flight[n]``). A host that is merely slow between calls (a shared or 2-core machine) lets
    the GPU catch up too, but then nothing finishes inside a short call."""
    if len(before) != len(in_flight):
        raise ValueError(f"before and in_flight must have one count per step, got {len(before)} and {len(in_flight)}")
    return sum(h <= run_ahead - 2 and b > h for b, h in zip(before, in_flight))


@checker
def check_ring_stage(fn, stream=None) -> bool:
    """``ring_stage(n, data, ring, events, dst)``: stage step n's ``data`` through the ring of pinned
    buffers ``ring`` into device memory ``dst`` without a race and without blocking the host more than
    the ring's depth requires (``events[i]`` guards ``ring[i]``).

    Run for :data:`STEPS` steps with the host up to :data:`AHEAD` steps ahead: a ring of ``AHEAD + 1``
    buffers must deliver every step and never make the host wait; a ring of :data:`SHALLOW` must
    deliver every step too, by waiting (the host then at most ``SHALLOW`` steps ahead).
    """
    name = "ring_stage"
    learner_arg(name, fn, "(n, data, ring, events, dst) -> None")
    s = _default_stream() if stream is None else stream
    waited_limit = STEPS // 4
    with s:
        show("ring_stage checked on", s.label)
        for depth in (AHEAD + 1, SHALLOW):
            setting = f"a ring of {depth} buffers, run-ahead {AHEAD} ({_RUN_AHEAD_HERE})"
            try:
                delivered, in_flight, before, waits, rounds, races = _ring_run(s, fn, depth)
            except LearnerStop as stop:  # it ran past its time, or left torch's state changed
                s.synchronize()
                return _fail(name, f"{name}: {stop}")
            except _RecordedEarly as e:
                s.synchronize()
                n, j = e.args
                return _fail(name, f"ring_stage: at step {n}, events[{j}] was recorded before the copy out of "
                                   f"ring[{j}] ({setting}): it completes when the work before it has run, before "
                                   f"that copy has, so waiting for it later does not protect ring[{j}] (the race, "
                                   "whenever the GPU is behind). Record the event after the copy.")
            except _WrongSlot as e:
                s.synchronize()
                return _fail(name, f"{e.args[1]} ({setting})")
            except _NotInRing as e:
                s.synchronize()
                n = e.args[0]
                return _fail(name, f"ring_stage: after step {n}, no ring buffer holds step {n}'s data ({setting}): "
                                   f"write data into ring[n % len(ring)] and copy from that pinned buffer.")
            except Exception as exc:
                s.synchronize()
                if is_stub(exc, fn):
                    return not_implemented(name)
                return _fail(name, f"ring_stage ({setting}) raised {raised(exc)}")
            bad = _corruption(delivered)
            if bad:
                if depth <= AHEAD and max(in_flight[depth:]) <= depth:
                    why = ("the host did wait before rewriting, but for an event that completed before the copy "
                           "that reads the buffer had run: record events[k] after the copy.")
                else:
                    why = ("the host did not wait for it: before writing ring[k], wait on the host "
                           "(`events[k].synchronize()`) for the event recorded after the copy that last read it "
                           "(`events[k].wait()` makes the GPU wait, not the host).")
                return _fail(name, f"ring_stage: {bad}, with {setting}: a buffer was rewritten before the copy "
                                   f"that read it had run; {why}")
            if races.findings:  # no data corrupted in this run, but the order allows it (a GPU that kept up)
                return _fail(name, _ring_race(fn, races, setting))
            seldom = [j for j, r in enumerate(rounds) if r < MIN_ROUNDS]
            if seldom:
                j = seldom[0]
                used = sum(r > 0 for r in rounds)
                return _fail(name, f"ring_stage: with {setting}, ring[{j}] was written in {rounds[j]} of {STEPS} steps "
                                   f"({used} of the {depth} buffers used): write step n into ring[n % len(ring)], "
                                   "every buffer in turn. A ring that uses fewer buffers than it has makes the host "
                                   "wait (or race) where the whole ring would not, and the check must see every "
                                   "buffer come round.")
            waited_in = [n for n, w in enumerate(waits) if w]
            if depth > AHEAD:
                # on the emulated stream every wait is counted (exact); on CUDA the waits on the ring's events are
                # counted, the others (a synchronize(), a blocking copy) show as GPU work finishing during the call
                timed = 0 if s.emulated else waited_steps(before, in_flight)
                show(f"ring of {depth}: steps in which the host waited for the GPU",
                     f"{max(len(waited_in), timed)} of {STEPS}")
                if waited_in or timed > waited_limit:
                    count = len(waited_in) if waited_in else timed
                    how = (f", {sum(waits)} waits counted on the emulated stream" if s.emulated and waited_in
                           else ", on events not yet reached" if waited_in else "")
                    return _fail(name, f"ring_stage blocks the host: the host waited for the GPU in {count} of "
                                       f"{STEPS} steps{how}, with {setting}: each buffer's last copy has run by the "
                                       "time it comes round, so no wait is needed. Wait only for the event of "
                                       "the buffer you rewrite, not for the whole stream or the latest copy.")
                deep = (f"with a ring of {depth} the host never waited for the GPU, "
                        + ("0 waits with every one counted on the emulated stream" if s.emulated else
                           f"no wait on an event not yet reached and GPU work finishing during {timed} of {STEPS} "
                           f"stagings, at most {waited_limit} allowed for a busy machine"))
            else:
                ahead = max(in_flight[depth:])
                show(f"ring of {depth}: most steps the GPU was behind after a staging", ahead)
                if ahead > depth:
                    return _fail(name, f"ring_stage: with {setting}, the host ran {ahead} steps ahead of the GPU: "
                                       f"a ring of {depth} is enough only for run-ahead {depth - 1} "
                                       f"({steploop.RING_RULE}), so it must make the host wait, or it "
                                       "rewrites a buffer whose copy has not run.")
                shallow = (f"with a ring of {depth} the host waited for the GPU in {len(waited_in)} of {STEPS} steps "
                           f"and never had more than {depth} steps' work still queued after a staging")
    _failures.pop(name, None)
    # how the waits were seen depends on the stream: [measured] lines (nbval masks them), so that the verdict
    # below reads the same on a GPU and on the emulated stream
    show("the deep ring", deep)
    show("the shallow ring", shallow)
    say(f"✅ {name} is correct: {STEPS} steps with each ring, run-ahead {AHEAD}, every buffer written at least "
        f"{MIN_ROUNDS} times, 0 corrupted; the ring deeper than the run-ahead never made the host wait, and the "
        "shallower one made it wait instead of racing.")
    return True


# ---- 3. how deep must the ring be? --------------------------------------------------------------


@checker
def check_min_ring_depth(fn) -> bool:
    """``min_ring_depth(writes, copies)`` -> the fewest buffers that keep every copy correct."""
    cases = timeline_cases(7)
    cases += [
        ([(0.0, 1.0), (1.0, 2.0), (2.0, 3.0), (3.0, 4.0)], [(1.0, 1.5), (2.0, 2.5), (3.0, 3.5), (4.0, 4.5)]),  # 2
        ([(0.0, 0.1), (0.1, 0.2), (0.2, 0.3), (2.5, 2.6)], [(2.0, 2.1), (2.1, 2.2), (2.2, 2.3), (2.6, 2.7)]),  # 3
        ([(0.0, 0.1), (0.2, 0.3), (0.4, 0.5), (0.6, 0.7), (3.0, 3.1)],
         [(1.0, 1.1), (1.2, 1.3), (2.0, 2.1), (2.2, 2.3), (3.1, 3.2)]),   # the worst step decides: 4
        ([(0.0, 1.0), (1.0, 2.0), (2.0, 3.0)], [(1.0, 2.0), (2.0, 3.0), (3.0, 4.0)]),  # a write exactly at a copy's end is safe: 2
        ([(0.0, 0.5), (0.5, 1.0), (2.0, 2.5)], [(1.0, 2.0), (2.0, 2.5), (2.5, 3.0)]),  # exactly at the end: 2
        ([(0.0, 0.5), (0.5, 1.0), (1.9, 2.5)], [(1.0, 2.0), (2.0, 2.5), (2.5, 3.0)]),  # 0.1 before it: 3
        ([(0.0, 1.0)], [(5.0, 6.0)]),                                                  # one step: 1
    ]
    return run_cases(fn, "min_ring_depth", cases, steploop.min_ring_depth, compare=same_int,
                     signature="(writes, copies) -> int (buffers)")
