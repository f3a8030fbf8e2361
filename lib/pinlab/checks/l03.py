"""Exercise checkers for lesson 03 (the race). They run on any CPU.

Each checker runs the learner's function on fixed and random cases through
:func:`pinlab.checks.run_cases` and prints one verdict line (⏳ / ❌ / ✅), returning True or False.
The references are the library's own: :func:`pinlab.paged_kv.kv_indptr` and
:func:`pinlab.paged_kv.last_page_len`, :func:`pinlab.steploop.copies_correct`.

:func:`check_race_free_loop` (torch code) runs the learner's step loop for 200 steps through a
harness (``write_metadata``, ``forward``; the host at most ``AHEAD`` steps ahead): on CUDA with the
GPU kept busy, without a GPU on the watched lagging stream of ``checks/l02.py``. It says which step
read whose data, or in how many steps the host waited for the GPU and why. The run is also judged by
order (:func:`pinlab.order.detect_races`: a copy the loop's order lets the host rewrite is a race whether or
not this run's GPU was behind enough to show it), and the events the loop makes with ``s.Event()`` are
followed: a buffer rewritten after waiting only on events recorded before its copy is named (lesson 04's
mistake; forward's run-ahead limit hides it here). Both verdicts are the same on a GPU and on the emulation.
``tests/test_checks_l03_l04.py`` proves each accepts the solution and rejects planted wrong answers.
(Why about 630 lines: three checkers, the race-free loop's harness, and its verdicts by data, by order and by
the loop's own events, each with a message that names the cause in the lesson's terms.)
"""
from __future__ import annotations

import numbers
import random

from .. import steploop
from ..paged_kv import kv_indptr, last_page_len
from . import (LearnerStop, _seq, checker, int_list, is_stub, learner_arg, learner_call, raised, run_cases,
              say)

# ---- lesson 03, exercise 1: indptr and last_page_len --------------------------------------------


def _ref_indptr_last_page_len(seq_lens, page_size):
    return kv_indptr(list(seq_lens), page_size).tolist(), last_page_len(list(seq_lens), page_size).tolist()


def _as_list(v) -> list:
    """A learner's answer (list, tuple, 1-d+ numpy array or tensor) as a plain list; TypeError
    for anything else (its type is checked before its values are)."""
    seq = _seq(v)
    if seq is None:
        raise TypeError(f"expected a list, got {type(v).__name__}")
    return seq


def _same_pair_of_int_lists(got, expected) -> bool:
    """``got`` is a pair (tuple or list) of two integer lists equal to ``expected``'s (compared as
    lists of Python ints: no object of the learner's decides)."""
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        return False
    try:
        return [int_list(got[0]), int_list(got[1])] == [list(expected[0]), list(expected[1])]
    except (TypeError, ValueError):
        return False


@checker
def check_indptr_last_page_len(fn) -> bool:
    """``indptr_last_page_len(seq_lens, page_size)`` -> ``(indptr, last_page_len)`` as lists."""
    rng = random.Random(3)
    cases = [
        ([37, 48, 17, 0], 16),     # the worked example: [0, 3, 6, 8, 8] and [5, 16, 1, 0]
        ([16, 32, 15, 1], 16),     # full last pages hold page_size tokens, not 0
        ([0, 0, 5], 4),            # empty sequences: no pages, last_page_len 0
        ([1, 2, 3], 1),            # page_size 1: every page is full
        ([], 16),                  # an empty batch: indptr [0]
        ([100], 64),
    ]
    for _ in range(30):
        ps = rng.choice([1, 4, 16, 64])
        lens = [rng.choice([0, rng.randint(1, 300), ps * rng.randint(1, 5)]) for _ in range(rng.randint(1, 12))]
        cases.append((lens, ps))
    return run_cases(fn, "indptr_last_page_len", cases, _ref_indptr_last_page_len,
                     compare=_same_pair_of_int_lists,
                     signature="(seq_lens, page_size) -> (indptr, last_page_len)")


# ---- lesson 03, exercise 2: which copies read their own step's data ----------------------------


def _bool_list(v):
    """bools, numpy bools and the ints 0/1 only, as Python bools (their types checked, not ``==``)."""
    out = []
    for x in _as_list(v):
        if isinstance(x, bool):
            out.append(x)
        elif type(x).__module__.partition(".")[0] == "numpy" and type(x).__name__ in ("bool_", "bool"):
            out.append(bool(x))
        elif isinstance(x, numbers.Integral) and int(x) in (0, 1):
            out.append(int(x) == 1)
        else:
            raise TypeError
    return out


def _same_bool_list(got, expected) -> bool:
    try:
        return _bool_list(got) == list(expected)
    except (TypeError, ValueError):
        return False


def timeline_cases(seed: int) -> list:
    """(writes, copies) pairs: simulated step loops, edge cases on the boundaries, random ones."""
    rng = random.Random(seed)
    cases = []
    for strategy, kw in [("reused_pinned", {}), ("reused_pinned", {"gpu_ms": 0.01}),
                         ("reused_pinned", {"run_ahead": 1}), ("reused_pinned", {"run_ahead": 0}),
                         ("reused_pinned", {"run_ahead": 2, "steps": 9}),
                         ("reused_pinned", {"gpu_ms": 0.3, "steps": 8})]:
        sim = steploop.simulate(strategy, **({"steps": 6} | kw))
        cases.append((sim["writes"], sim["copies"]))
    cases += [
        ([(0.0, 1.0), (2.0, 3.0)], [(1.0, 2.0), (3.0, 4.0)]),     # the next write starts exactly at the copy's end: safe
        ([(0.0, 1.0), (1.5, 2.5)], [(1.5, 2.0), (3.0, 4.0)]),     # ... exactly at the copy's start: not safe
        ([(0.0, 1.0), (1.2, 3.0)], [(1.0, 2.0), (3.0, 3.5)]),     # starts during the copy, ends after it: not safe
        ([(0.0, 1.0)], [(5.0, 6.0)]),                             # one step: always its own data
        ([(0.0, 1.0), (1.0, 2.0), (9.0, 9.5)], [(1.0, 1.5), (2.0, 8.0), (9.5, 9.6)]),  # only a later write matters
        ([(0.0, 1.0), (1.1, 2.0), (2.1, 2.2)], [(3.0, 3.1), (3.2, 3.3), (3.4, 3.5)]),  # two later writes, all before
    ]
    for _ in range(25):
        steps = rng.randint(2, 9)
        writes, copies, t, g = [], [], 0.0, 0.0
        for _ in range(steps):
            t += round(rng.uniform(0, 1.5), 2)
            w = (t, round(t + rng.uniform(0.05, 0.5), 2))
            t = w[1]
            g = max(g, t) + round(rng.uniform(0, 2.0), 2)
            c = (g, round(g + rng.uniform(0.01, 0.4), 2))
            g = c[1]
            writes.append(w)
            copies.append(c)
        cases.append((writes, copies))
    return cases


@checker
def check_copies_correct(fn) -> bool:
    """``copies_correct(writes, copies)`` -> list of bools: did copy n deliver step n's data?"""
    return run_cases(fn, "copies_correct", timeline_cases(5), steploop.copies_correct, compare=_same_bool_list,
                     signature="(writes, copies) -> list of bools")


# ---- lesson 03, exercise 3 (torch code): a race-free step loop that does not block the host ------
#
# The harness hands the learner's loop two functions: write_metadata(buf, n) (the host writes step
# n's metadata into a host buffer) and forward(n, meta) (step n's forward on the GPU: it reads meta,
# then keeps the GPU busy). forward returns once the GPU is at most AHEAD steps behind (like vLLM's
# async scheduling, which reads step n-AHEAD's output): the harness waits for that, not the learner.
# After the loop the checker reads what every step's forward saw. On CUDA the GPU is kept busy
# BUSY_MS per step, so the host runs ahead; without a GPU the loop runs on the watched lagging
# stream (checks/l02.py), which counts every wait exactly.

import bisect
import gc
import sys
import time
from collections import Counter
from contextlib import contextmanager

import torch

from ..args import positive_int
from ..detector import find_caller
from ..order import detect_races
from ..races import H2D_REWRITE
from ..timing import show
from .l02 import Watch, _source_line, fail, not_implemented, watched_stream

STEPS = 200
MAX_STEPS = 10_000  #: run_loop's most steps (the notebook runs 100, the checker 200): 40 MiB of results
N_INTS = 1024
AHEAD = 2           #: the harness's run-ahead (steploop.RUN_AHEAD): a ring needs AHEAD + 1 buffers
BUSY_MS = 4.0
WAIT_MS = BUSY_MS / 4      # a step whose host time exceeds this waited for the GPU (CUDA)
WARM_STEPS = 12
#: run-ahead AHEAD in this exercise's words (steploop.RUN_AHEAD)
_RUN_AHEAD_HERE = f"the host may write step n+{AHEAD}'s metadata while the GPU has not yet run step n's copy"

HINTS = {
    "race_free_loop": (
        "give every step its own pinned host memory: write into a pageable buffer, then "
        "`snap = buf.pin_memory()` (a fresh pinned copy: the caching host allocator keeps it until its copy "
        f"has run) and `meta.copy_(snap, non_blocking=True)`. Or, for run-ahead {AHEAD}, a ring of {AHEAD + 1} pinned "
        f"buffers ({steploop.RING_RULE}), each guarded "
        "by an event recorded after its copy and waited on before the buffer is rewritten (it is reached "
        "already, so the wait costs nothing)."),
}


class _HarnessError(Exception):
    """The learner's loop called write_metadata/forward wrongly (reported as such, not as a crash)."""


def _deliver(meta, row):
    row.copy_(meta)  # what step n's forward read


class _Harness:
    def __init__(self, s, steps):
        self.s, self.steps = s, steps
        self.next = 0
        self.results = torch.full((steps, N_INTS), -1, dtype=torch.int32, device=s.device)
        self.done = [s.Event() if s.emulated else torch.cuda.Event() for _ in range(AHEAD + 1)]
        self.host_ms = [0.0] * steps
        self.t_back = None
        self.written: dict[int, int] = {}  # step -> the storage write_metadata wrote step n's metadata into

    def _is_device(self, t) -> bool:
        return self.s.is_device(t) if self.s.emulated else t.device.type == "cuda"

    def write_metadata(self, buf, n):
        if not isinstance(buf, torch.Tensor) or buf.shape != (N_INTS,) or buf.dtype != torch.int32:
            raise _HarnessError(f"write_metadata(buf, {n!r}): buf must be a host tensor of {N_INTS} int32, "
                                f"got {buf!r}"[:200])
        if self._is_device(buf):
            raise _HarnessError(f"write_metadata(buf, {n!r}): buf is GPU memory, but the metadata is computed on the "
                                "host (it is the scheduler's output): write it into host memory, then copy it.")
        buf.fill_(int(n))
        if isinstance(n, int) and not isinstance(n, bool):
            self.written[n] = buf.untyped_storage().data_ptr()

    def forward(self, n, meta):
        now = time.perf_counter()
        if isinstance(n, bool) or not isinstance(n, int) or n != self.next:
            raise _HarnessError(f"forward({n!r}, meta) was called for step {n!r}, the next step is {self.next}: "
                                "call forward(n, meta) once per step, in order.")
        if (not isinstance(meta, torch.Tensor) or not self._is_device(meta) or meta.shape != (N_INTS,)
                or meta.dtype != torch.int32):
            raise _HarnessError(f"forward({n}, meta): meta must be step {n}'s metadata in GPU memory ({N_INTS} int32, "
                                "device=s.device), copied there with non_blocking=True.")
        s = self.s
        self.host_ms[n] = (now - self.t_back) * 1e3
        if s.emulated:
            s.counting = False
        s.launch(_deliver, meta, self.results[n])
        self.done[n % (AHEAD + 1)].record()   # step n's forward has read its metadata
        s.busy(BUSY_MS)                        # the rest of step n's forward
        if n >= AHEAD:
            self.done[(n - AHEAD) % (AHEAD + 1)].synchronize()   # the host runs at most AHEAD steps ahead
        self.next = n + 1
        s.step = n + 1
        if s.emulated:
            s.counting = True
        self.t_back = time.perf_counter()

    def run(self, fn, name: str = "race_free_loop"):
        s = self.s
        s.step = 0
        if s.emulated:
            s.waits.clear()
            s.counting = True
        else:
            s.noted.clear()
        gc_was_on = gc.isenabled()
        gc.disable()  # a collection pause in the middle of a step would look like a wait
        self.t_back = time.perf_counter()
        try:
            with learner_call(f"{name}(s, {self.steps}, write_metadata, forward)"):
                fn(s, self.steps, self.write_metadata, self.forward)
        finally:
            if gc_was_on:
                gc.enable()
            if s.emulated:
                s.counting = False
            s.synchronize()
        return self.results.cpu()


def _race(got, steps) -> tuple[str, int] | None:
    """(what the first wrong step delivered, how many steps were wrong) or None."""
    lo, hi = got.min(dim=1).values.tolist(), got.max(dim=1).values.tolist()
    bad = [n for n in range(steps) if not lo[n] == hi[n] == n]
    if not bad:
        return None
    n = bad[0]
    if lo[n] == hi[n] == -1:
        what = f"step {n} of {steps}: forward read memory nothing was copied into"
    elif lo[n] == hi[n]:
        what = f"step {n} of {steps} delivered step {lo[n]}'s data"
    else:
        what = f"step {n} of {steps} delivered a mix of steps {lo[n]}..{hi[n]} (its buffer was rewritten while the copy read it)"
    return what, len(bad)


def _stale(got, steps) -> int | None:
    """How many steps back the wrong steps' data was, when every wrong step delivered one *earlier*
    step's data, the same number of steps back (no race: a race delivers a later write); else None."""
    lo, hi = got.min(dim=1).values.tolist(), got.max(dim=1).values.tolist()
    back = {n - lo[n] for n in range(steps) if not lo[n] == hi[n] == n}
    if len(back) == 1 and all(lo[n] == hi[n] for n in range(steps)):
        k = back.pop()
        return k if k > 0 else None
    return None


def _stale_cause(k: int) -> str:
    if k == 1:
        return ("there is no race here: your snapshot copies the buffer before this step's write: the GPU receives "
                "step n-1's data. Take the snapshot after write_metadata(buf, n), then copy it.")
    return (f"there is no race here: each step's copy reads data written {k} steps earlier (the GPU receives step "
            f"n-{k}'s data): copy from the buffer this step's write_metadata(buf, n) wrote, after it wrote it.")


def _other_slot(watch, written: dict) -> tuple[int, int] | None:
    """``(n, m)``: step n's copy read the buffer write_metadata last wrote at an earlier step m, not the one
    it wrote at step n (a ring indexed off by one); None when no step did."""
    last_writer: dict[int, int] = {}
    copies = sorted(watch.h2d, key=lambda c: c["step"])
    i = 0
    for n in sorted(written):
        last_writer[written[n]] = n
        while i < len(copies) and copies[i]["step"] <= n:
            c = copies[i]
            i += 1
            m = last_writer.get(c["storage"])
            if c["step"] == n and m is not None and m < n and written[n] != c["storage"]:
                return n, m
    return None


def _race_cause(watch, written: dict | None = None, stale: int | None = None) -> str:
    """Why steps read another step's data: a copy from another buffer than the one just written, a
    snapshot taken before the write (``stale``: the data was that many steps old), then the races."""
    slot = _other_slot(watch, written or {})
    if slot is None and stale is not None:
        return _stale_cause(stale)
    if slot is not None:
        n, m = slot
        return (f"step {n}'s copy read the buffer write_metadata wrote step {m}'s metadata into, not the one it "
                f"wrote step {n}'s into: copy from the buffer you just wrote (in a ring, the same index "
                f"n % len(ring) for the write, the copy and its event); that buffer is rewritten while its copy "
                "waits in the queue.")
    if watch.pin_of_pinned:
        return ("`pin_memory()` of a pinned tensor returns the same storage (a no-op), so it is not a snapshot: "
                "every step's copy still reads the one reused buffer.")
    storages = {c["storage"] for c in watch.h2d}
    if watch.h2d and len(storages) < len(watch.h2d):
        k = len(storages)
        return (f"your copies read from {k} host buffer{'s' if k > 1 else ''}: the host rewrote a buffer before the "
                f"GPU had copied it (run-ahead {AHEAD}: {_RUN_AHEAD_HERE}). Give each step its own snapshot, or use a "
                f"ring of {AHEAD + 1} buffers ({steploop.RING_RULE}), guarded by events.")
    return "the host rewrote the data before the GPU had copied it."


def _copy_before_write(watch) -> tuple[dict, dict] | None:
    """``(copy, write)``: a copy to the GPU enqueued in a step *before* the host wrote, in that same step,
    into the pinned memory it reads (the ordering contract is write, then copy); None when no step did."""
    writes: dict[int, list] = {}
    for w in watch.pinned_writes:
        writes.setdefault(w["step"], []).append(w)
    for c in watch.h2d:
        if not c["pinned"]:
            continue  # pageable: staged at the call, so a later write shows in the data
        a, b = c["span"]
        for w in writes.get(c["step"], ()):
            wa, wb = w["span"]
            if w["seq"] > c["seq"] and wa < b and a < wb:
                return c, w
    return None


# ---- the verdict by order, and the loop's own events: the same on a GPU as on the emulation -------

def learner_place(fn, where: str, name: str) -> str:
    """A race detector's ``"file:line"`` named as lesson 09's checker names a line: ``line N of name (`code`)``
    (N counted from ``def``, line 1) where it lies in ``fn``'s own lines, else the ``file:line`` as it is (lesson
    04's checker names its races with it too). Read from ``fn``'s code object and its source, not through lesson
    09's audit, so that the lesson 06, 07 and 09 modules stay out of exercises 03's and 04's experiment scope."""
    import inspect
    import re
    import textwrap

    code = getattr(fn, "__code__", None)
    file, _, line = where.rpartition(":")
    if code is None or file != code.co_filename or not line.isdigit():
        return where
    lines = [ln for _, _, ln in code.co_lines() if ln is not None]
    n = int(line) - code.co_firstlineno + 1
    if not lines or not code.co_firstlineno <= int(line) <= max(lines):
        return where
    try:
        src = textwrap.dedent(inspect.getsource(fn)).splitlines()
    except (OSError, TypeError):  # compiled from a string: no source to quote
        src = []
    text = re.sub(r"\s+#.*$", "", src[n - 1]).strip() if 1 <= n <= len(src) else ""
    return f"line {n} of {name}" + (f" (`{text}`)" if text else "")


def learner_name(fn, default: str) -> str:
    """The name of the learner's function, as its lines are named (``default`` for a lambda or a callable object)."""
    name = getattr(fn, "__name__", default)
    return name if isinstance(name, str) and name.isidentifier() else default


def race_counts(races) -> str:
    """How many copies an order verdict (:func:`pinlab.order.detect_races`) says can race, and how many did."""
    raced = sum(races.in_run.values())
    return (f"{races.total} of {races.copies} copies can race by the loop's order, {raced} raced in this run; a GPU "
            "further behind reads the new data")


class _LearnerEvent:
    """An event the learner's loop made with ``s.Event()``, followed: where its last ``record()`` was made (its
    place in the :class:`Watch`'s order, ``seq``), and each wait on it (``synchronize()``, or a ``query()`` that
    returned True) with the record it waited for; everything else is the event's own."""

    def __init__(self, s, ev, waits: list, watch):
        self._s, self._ev, self._waits, self._watch = s, ev, waits, watch
        self._record = None  # (seq, where) of the last record()

    def record(self, stream=None):
        out = self._ev.record() if stream is None else self._ev.record(stream)
        self._record = (self._ev.seq if self._ev.seq is not None else self._watch.next_seq(),
                        find_caller(sys._getframe(1)))
        return out

    def synchronize(self) -> None:
        self._ev.synchronize()
        self._waited(sys._getframe(1))

    def query(self) -> bool:
        done = self._ev.query()
        if done:
            self._waited(sys._getframe(1))
        return done

    def wait(self, stream=None):
        return self._ev.wait() if stream is None else self._ev.wait(stream)

    def _waited(self, frame) -> None:
        self._waits.append({"seq": self._watch.next_seq(), "step": getattr(self._s, "step", 0),
                            "record": self._record, "where": find_caller(frame)})

    def __getattr__(self, name):
        return getattr(self._ev, name)


@contextmanager
def _following_events(s, watch):
    """While the block runs, ``s.Event()`` makes :class:`_LearnerEvent`s; yields the list of their waits."""
    waits: list = []
    make = s.Event
    s.Event = lambda *args, **kwargs: _LearnerEvent(s, make(*args, **kwargs), waits, watch)
    try:
        yield waits
    finally:
        del s.Event


def _event_before_copy(watch, waits) -> tuple[dict, dict, dict] | None:
    """``(write, copy, wait)``: a step wrote into pinned memory that an earlier step's copy reads after the host
    had waited, since that copy, only on events recorded before it (or never recorded): an event is reached once
    the work queued before its ``record()`` has run, so those waits order nothing about the copy. None when no
    step did; a loop that waits on no event of its own is judged by the order verdict alone."""
    if not waits:
        return None
    copies = sorted((c for c in watch.h2d if c["pinned"]), key=lambda c: c["seq"])
    copy_seqs = [c["seq"] for c in copies]
    wait_seqs = [w["seq"] for w in waits]  # noted in order
    for w in sorted(watch.pinned_writes, key=lambda w: w["seq"]):
        wa, wb = w["span"]
        c = next((copies[i] for i in range(bisect.bisect_left(copy_seqs, w["seq"]) - 1, -1, -1)
                  if copies[i]["span"][0] < wb and wa < copies[i]["span"][1]), None)
        if c is None or c["step"] >= w["step"]:
            continue  # nothing copied these bytes before, or this step's own copy (write, then copy: judged apart)
        between = waits[bisect.bisect_right(wait_seqs, c["seq"]):bisect.bisect_left(wait_seqs, w["seq"])]
        if between and all(x["record"] is None or x["record"][0] < c["seq"] for x in between):
            return w, c, between[-1]
    return None


def _order_problem(fn, name, races, watch, written) -> str | None:
    """The first race the loop's order allows (:func:`pinlab.order.detect_races`), in the lesson's terms; None."""
    if not races.findings:
        return None
    f = races.findings[0]
    copy, seen = learner_place(fn, f.copy_where, name), learner_place(fn, f.seen_where, name)
    if f.kind == H2D_REWRITE:
        return (f"the copy at {copy} can race with the host's write into its pinned source at {seen}, which nothing "
                f"the loop waits on orders after that copy ({race_counts(races)}): {_race_cause(watch, written)}")
    return f"the copy at {copy} can race: {f.kind} at {seen} ({race_counts(races)})."


def _event_problem(fn, name, early) -> str:
    w, c, x = early
    rec = x["record"]
    event = (f"recorded at {learner_place(fn, rec[1], name)}, before that copy," if rec is not None
             else "never recorded,")
    return (f"step {w['step']} rewrote the pinned buffer that step {c['step']}'s copy at "
            f"{learner_place(fn, c['where'], name)} reads after waiting, at {learner_place(fn, x['where'], name)}, "
            f"only on an event {event} so the wait orders nothing about that copy (an event is reached once the "
            "work queued before its record() has run; here forward's run-ahead limit kept the buffer safe, not "
            "the event): record the event right after the copy out of the buffer it guards.")


def run_loop(fn, steps: int = STEPS) -> dict:
    """Run ``fn(s, steps, write_metadata, forward)`` through the exercise's harness once, unchecked:
    ``{"steps", "wrong_steps" (steps that read another step's data), "first_wrong" (its message or None),
    "label"}``. For showing what the racy loop does; the checker is :func:`check_race_free_loop`."""
    learner_arg("fn", fn, "(s, steps, write_metadata, forward) -> None (the step loop)")
    steps = positive_int("steps", steps, maximum=MAX_STEPS)
    name = getattr(fn, "__name__", "the loop")
    s = watched_stream()
    try:
        with s:
            if not s.emulated:
                with Watch(s):
                    _Harness(s, WARM_STEPS).run(fn, name)
            with Watch(s):
                got = _Harness(s, steps).run(fn, name)
    except LearnerStop as stop:  # reported as an ordinary exception: this runs, it does not judge
        raise stop.as_error() from None
    race = _race(got, steps)
    return {"steps": steps, "wrong_steps": race[1] if race else 0, "first_wrong": race[0] if race else None,
            "label": s.label}


@checker
def check_race_free_loop(fn) -> bool:
    """``race_free_loop(s, steps, write_metadata, forward)``: every step's forward must read its own
    metadata (copied with non_blocking=True from pinned memory), and the host must not wait for the
    GPU inside the loop (beyond forward's own run-ahead limit). Runs 200 steps on CUDA with the GPU
    kept busy, or on the watched lagging stream without a GPU."""
    name = "race_free_loop"
    learner_arg(name, fn, "(s, steps, write_metadata, forward) -> None (the step loop)")
    s = watched_stream()
    with s:
        try:
            if not s.emulated:  # first launches, calibration, pinned blocks: a short run, not checked
                with Watch(s):
                    _Harness(s, WARM_STEPS).run(fn)
            # judged by order too: the races this loop's order allows, whatever this GPU's speed
            with detect_races() as races, Watch(s) as watch:
                h = _Harness(s, STEPS)
                with _following_events(s, watch) as waits:
                    got = h.run(fn)
            timed = _timed_run(s, fn)
        except LearnerStop as stop:  # it ran past its time, or left torch's state changed
            return fail(name, str(stop), HINTS)
        except _HarnessError as exc:
            return fail(name, str(exc), HINTS)
        except Exception as exc:  # the learner's bug, reported, not raised
            if is_stub(exc, fn):
                return not_implemented(name)
            return fail(name, f"{name}(s, {STEPS}, write_metadata, forward) raised {raised(exc)}", HINTS)
        problem = _loop_problem(s, h, watch, got, races, waits, fn, timed)
    if problem:
        return fail(name, problem, HINTS)
    show(f"{name} checked on", s.label)
    # how the waits were seen depends on the stream: [measured] lines (nbval masks them), so that the verdict
    # below reads the same on a GPU and on the emulated stream
    if s.emulated:
        show("how the host's waits inside the loop were seen", "0 waits, every one counted on the emulated stream")
    else:
        slow = sum(ms > WAIT_MS for ms in timed.host_ms)
        show(f"host time per step of your loop, outside forward (median of {STEPS})",
             f"{sorted(timed.host_ms)[STEPS // 2]:.3f} ms")
        show("how the host's waits inside the loop were seen",
             f"no synchronize() or event wait, and the host's time per step outside forward stayed under "
             f"{WAIT_MS:g} ms (a wait for the GPU takes about {BUSY_MS:g} ms) in {STEPS - slow} of {STEPS} steps")
    say(f"✅ {name} is correct ({STEPS} steps, run-ahead {AHEAD}: every step read its own metadata, written "
        "before its copy, copied with non_blocking=True from pinned memory; no wait for the GPU inside the loop).")
    return True


def _timed_run(s, fn):
    """On CUDA, a second run of the loop for its waits alone (None on the emulated stream, which counts every
    wait): the host's time per step outside forward, and the waits the CUDA stream notes. The order verdict's
    hooks cost the host time of its own in every step (up to a few ms on CUDA: an H100 counted 30 to 139 of a
    correct loop's 200 steps over ``WAIT_MS``, stop 55), which the checked run would read as waits."""
    if s.emulated:
        return None
    with Watch(s):
        timed = _Harness(s, STEPS)
        timed.got = timed.run(fn)
    return timed


def _loop_problem(s, h, watch, got, races=None, waits=(), fn=None, timed=None) -> str | None:
    """What is wrong with one checked run (None: nothing): the order of write and copy, the data each step
    read, then the races the loop's order allows (``races``: what this run's timing hid), the loop's own
    events (``waits``), the kind of copy, and the host's waits: on CUDA those of ``timed`` (:func:`_timed_run`,
    a run without the order verdict's hooks), whose data must be right too."""
    steps = STEPS
    if timed is not None and timed.next == steps and _race(got, steps) is None:
        got = timed.got  # a race only the run without the hooks made happen is reported as any other
    if h.next != steps:
        return f"forward was called for {h.next} of {steps} steps: call forward(n, meta) once for every step."
    # the order of write and copy first: its race may show in the data or not (on a GPU it depends on timing)
    early = _copy_before_write(watch)
    if early is not None:
        c, w = early
        return (f"step {c['step']}'s copy was enqueued before the host wrote step {c['step']}'s data into the pinned "
                f"memory it reads (the copy at {_source_line(c['where'])}, the write at {_source_line(w['where'])}): "
                "a non_blocking copy reads its source when the GPU gets to it, which on a GPU may be before the "
                "write, during it or after it (the emulated GPU, always behind, reads the new data; a real one need "
                "not). Fill the buffer first (write_metadata, or your copy into a snapshot), then enqueue the "
                "copy from it.")
    race = _race(got, steps)
    if race is not None:
        what, bad = race
        return (f"{what} ({bad} of {steps} steps read another step's data): "
                f"{_race_cause(watch, h.written, _stale(got, steps))}")
    name = learner_name(fn, "race_free_loop")
    if races is not None:
        # the data above shows the races this run's timing made happen; the order shows those a GPU further
        # behind would make happen (on a GPU that keeps up, the data shows none)
        by_order = _order_problem(fn, name, races, watch, h.written)
        if by_order is not None:
            return by_order
    early = _event_before_copy(watch, waits)
    if early is not None:
        return _event_problem(fn, name, early)
    pageable = [c for c in watch.h2d if not c["pinned"]]
    if pageable:
        c = pageable[0]
        return (f"step {c['step']}'s copy reads pageable memory (clone(), empty() and plain tensors are pageable): the "
                "driver stages it, which is race-free but not asynchronous beyond its staging pool (lesson 02). "
                "Copy from pinned memory: a pinned snapshot, or a ring of pinned buffers.")
    blocking = [c for c in watch.h2d if not c["non_blocking"]]
    if blocking:
        return (f"step {blocking[0]['step']}'s copy is blocking (no non_blocking=True): the host waits for the GPU "
                "at every step.")
    if not watch.h2d:
        return "no copy from host memory to the GPU: each step's metadata must be copied with non_blocking=True."
    # The waits inside the loop (after the last forward the harness synchronizes anyway). Explicit ones are
    # exact on both streams: the emulation counts every wait (LaggingStream.host_waits), the CUDA stream notes
    # each synchronize() with work queued, each wait on, or polling loop of, an event not yet reached. On CUDA
    # only the implicit ones (a blocking copy, .item()) are judged from the host's time per step, with room for
    # a stray slow step (a shared or 2-core machine).
    explicit = [(w[0], w[1]) for w in s.waits] if s.emulated else list(s.noted)  # s.noted: the timed run's
    explicit = [(n, why) for n, why in explicit if n < steps]
    host_ms = (timed or h).host_ms
    slow = set() if s.emulated else {n for n in range(steps) if host_ms[n] > WAIT_MS}
    reasons = {}
    for n, why in reversed(explicit):
        reasons[n] = why
    if explicit or len(slow) > steps // 10:
        waited = sorted(set(reasons) | slow)
        for n in waited:
            reasons.setdefault(n, "something in your loop waited for the GPU")
        why = Counter(reasons[n] for n in waited).most_common(1)[0][0]  # a stray slow step does not decide
        advice = "use a snapshot or a ring"
        depth = len({c["storage"] for c in watch.h2d if c["pinned"]})
        if depth <= 1 and len(waited) > steps // 2:
            advice = ("waiting is race-free but blocks: with one reused buffer the loop is serial (the host waits "
                      "for each copy before it rewrites the buffer, whether with synchronize(), an event or a loop "
                      "polling it), so the host never runs ahead. Give each step its own pinned snapshot "
                      "(`buf.pin_memory()` of a pageable buffer), or use a ring of "
                      f"{AHEAD + 1} pinned buffers ({steploop.RING_RULE}) guarded by events")
        elif "event" in why and depth > AHEAD:
            advice = (f"your copies read from {depth} pinned buffers, enough for run-ahead {AHEAD}, but the "
                      "event you wait on is not reached yet: before rewriting a buffer, wait on the event recorded "
                      "after that same buffer's last copy (the same index for the write, the copy and its event), "
                      "not on a more recent step's event")
        elif "event" in why:
            advice = (f"your ring is too shallow for run-ahead {AHEAD} ({_RUN_AHEAD_HERE}): its events are not reached "
                      f"yet when a buffer comes round again; {steploop.RING_RULE}: "
                      f"{AHEAD + 1} here")
        elif "synchronize()" in why:
            advice = ("synchronize() is race-free but blocks: the loop needs no wait of its own (a pinned snapshot "
                      f"per step, or a ring of {AHEAD + 1} pinned buffers guarded by events, is race-free without "
                      "one): take it out")
        return f"the host waited for the GPU in {len(waited)} of {steps} steps ({why}) — {advice}."
    return None
