"""The step loop: its vocabulary, a pure timeline model of it, and the loop itself for every strategy.

vLLM's Model Runner V2 schedules asynchronously: the CPU builds step N+1's inputs while the GPU
still runs step N, with no host sync between steps. Lessons 03 and 04 write that loop in a
notebook cell; this module is the same loop, for every strategy vLLM tried (:data:`STRATEGIES`)::

    for step n:
        [run-ahead k: wait for step n-k-1's "done" event, like vLLM's batch queue (RunAheadGate)]
        write step n's data into the host buffer (the strategy decides which buffer: Staging)
        dst[n].copy_(source, non_blocking=True)        <- timed together with the write's staging
        GPU work that reads dst[n]
        record done[n]
        stream.busy(busy_ms)                           <- the rest of step n's forward

It runs on a :mod:`pinlab.streams` stream: a CUDA stream, or the emulated lagging stream on a
CPU (device work waits in a queue; a copy from pinned memory reads its source when it runs).
:func:`simulate` is a pure model of the same loop (times in ms, no tensors) for timelines and
exercises; :func:`copies_correct` and :func:`min_ring_depth` are the exercise references.
Nothing here syncs inside a loop: no ``.item()``, no blocking copy, no data-dependent shapes.
The paged-decode version of the loop is :mod:`pinlab.decode_loop`.

Run-ahead, the course's one definition (:data:`RUN_AHEAD`; lessons, exercises and checkers use it):
**run-ahead k**: the host may write step n+k's data while the GPU has not yet run step n's copy, so up
to k earlier steps' copies are still queued when the host writes a step; a ring of pinned buffers for
run-ahead k needs k + 1 buffers (:func:`ring_depth_for`). The loops take it as ``run_ahead=k``
(:func:`simulate`, :func:`plain_loop`, :func:`pinlab.decode_loop.decode_loop`, lesson 03's and 04's
experiments, lesson 04's ``metadata_loop``): before writing step n the host waits for the event of step
n-k-1, recorded after that step's copy (:class:`RunAheadGate`); ``run_ahead=None`` never waits. The
exercises' checkers state theirs in the same words (``AHEAD`` in ``checks/l03.py`` and ``l04.py``: the
run-ahead, not a queue depth).

Why over 500 lines: the vocabulary, the model and the harness share the strategy names and the
accounting; split, each part would import the others' private argument checks.
"""
from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from .args import one_of, positive_int, positive_number
from .device import require_cuda

KiB = 1024
MiB = 1024 * 1024

#: Every way of getting step N's host data to the GPU that the experiments know, in history order.
STRATEGIES = {
    "reused_pinned": "one pinned buffer, rewritten every step (the race)",
    "double_pinned": "#23737: write a pinned buffer, copy it into a second persistent pinned buffer, "
                     "copy that one to the GPU",
    "pageable": "#32799: the reused buffer is pageable; the driver stages each copy at call time",
    "snapshot": "the PR (vLLM 0.29): pageable buffer, pin_memory() snapshot every step, copy the snapshot",
    "snapshot_of_pinned": "the trap: pin_memory() of an already pinned buffer returns the same storage",
    "ring": "a ring of pinned buffers, one per step in turn, nothing waited for",
    "ring_events": "MRV2's buffer-pool idea: a ring of pinned buffers, each guarded by an event",
    "event_wait": "MRV1's prepare_inputs_event: wait for the previous step's copy, then rewrite the buffer",
    "no_copy": "baseline: write the buffer, copy nothing (for host timings only)",
}

#: Strategies whose GPU copy reads the host buffer when the copy *runs* (after the call returned).
LATE_READ = ("reused_pinned", "double_pinned", "snapshot_of_pinned", "ring", "ring_events", "event_wait")

#: The comparison of lesson 04, in the order the fixes were tried.
HISTORY = ["reused_pinned", "double_pinned", "pageable", "snapshot", "snapshot_of_pinned",
           "ring_events", "event_wait"]

#: Labels for tables and charts.
LABELS = {
    "reused_pinned": "reused pinned buffer",
    "double_pinned": "pinned double buffer (#23737)",
    "pageable": "pageable buffer (#32799)",
    "snapshot": "pin_memory() snapshot (the PR)",
    "snapshot_of_pinned": "pin_memory() of a pinned buffer",
    "ring": "ring of pinned buffers",
    "ring_events": "ring + events (MRV2 pool)",
    "event_wait": "event wait (MRV1)",
    "no_copy": "no copy (baseline)",
}

_MAX_DST_BYTES = 1 << 30
#: The timeline model is quadratic in the steps: more than this is a typo, not a lesson (2,000 take ~0.5 s).
MAX_SIM_STEPS = 2_000
#: The step loops run one GPU step each: more than this would keep a notebook busy for many minutes.
MAX_LOOP_STEPS = 200_000


def strategy_arg(name: str, value) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a strategy name (str), got {type(value).__name__}")
    return one_of(name, value, STRATEGIES)


def strategies_arg(value, *, allow_no_copy: bool = True) -> list[str]:
    if isinstance(value, str) or not hasattr(value, "__iter__"):
        raise TypeError(f"strategies must be a list of strategy names, got {type(value).__name__}")
    out = [strategy_arg(f"strategies[{i}]", v) for i, v in enumerate(value)]
    if not out:
        raise ValueError(f"strategies must not be empty; choose from {sorted(STRATEGIES)}")
    if len(set(out)) != len(out):
        raise ValueError(f"strategies must not repeat a name, got {out}")
    if not allow_no_copy and "no_copy" in out:
        raise ValueError("'no_copy' copies nothing, so it has no corruption to count: leave it out here")
    return out


#: How deep a ring must be, in the words the checkers' messages use (part of :data:`RUN_AHEAD`).
RING_RULE = "a ring for run-ahead k needs k + 1 buffers"
#: The definition of run-ahead that lessons, exercises and checker messages use (see the module docstring).
RUN_AHEAD = ("run-ahead k: the host may write step n+k's data while the GPU has not yet run step n's copy "
             f"(up to k earlier copies still queued); {RING_RULE} (pinned buffers)")


def ring_depth_for(run_ahead: int) -> int:
    """The fewest pinned buffers in a ring for run-ahead ``run_ahead`` (:data:`RUN_AHEAD`): ``run_ahead + 1``
    (the copies still queued, and the buffer the host writes)."""
    return positive_int("run_ahead", run_ahead, allow_zero=True) + 1


def run_ahead_arg(value, name: str = "run_ahead") -> int | None:
    """None (unbounded: the host never waits) or an int >= 0: the run-ahead (:data:`RUN_AHEAD`), the steps the
    host may be ahead of the GPU (it waits for step n-run_ahead-1's event before writing step n)."""
    if value is None:
        return None
    return positive_int(name, value, allow_zero=True)


class RunAheadGate:
    """The loops' bounded run-ahead, as vLLM's batch queue: ``wait(n)`` before writing step n waits (on the
    host) for the event step n-run_ahead-1 recorded with ``record(n)`` after its copy; with ``run_ahead``
    None both do nothing. Make it inside the stream's ``with`` block (its events are the stream's)."""

    def __init__(self, stream, run_ahead):
        self.run_ahead = run_ahead_arg(run_ahead)
        self.done = None if self.run_ahead is None else [stream.Event() for _ in range(self.run_ahead + 2)]

    def wait(self, n: int) -> None:
        if self.done is not None and n > self.run_ahead:
            self.done[(n - self.run_ahead - 1) % len(self.done)].synchronize()

    def record(self, n: int) -> None:
        if self.done is not None:
            self.done[n % len(self.done)].record()


def ints_in(name: str, nbytes) -> int:
    nbytes = positive_int(name, nbytes)
    if nbytes % 4:
        raise ValueError(f"{name} must be a multiple of 4 (the buffer holds int32 values), got {nbytes}")
    return nbytes // 4




def sizes_arg(sizes) -> list[int]:
    """A non-empty list of byte counts, each a whole number of int32 elements."""
    if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__iter__"):
        raise TypeError(f"sizes must be a list of byte counts, got {type(sizes).__name__}")
    sizes = [positive_int(f"sizes[{i}]", s) for i, s in enumerate(sizes)]
    if not sizes:
        raise ValueError("sizes must not be empty")
    for i, s in enumerate(sizes):
        ints_in(f"sizes[{i}]", s)
    return sizes

# =============================================================================================
# Pure helpers: accounting, schedules, metadata images, the timeline model
# =============================================================================================

def corruption_summary(received, expected=None) -> dict:
    """Count the steps whose copy did not receive its own step's data.

    ``received[n]`` is the step whose data copy n delivered, ``-1`` for a mix of several steps
    (a torn read), or ``None`` where nothing was copied. ``expected`` defaults to 0, 1, 2, ...
    Returns ``{"steps", "copied", "corrupted", "torn", "rate", "first_corrupted"}`` where
    ``rate`` is corrupted / copied (0.0 when nothing was copied).
    """
    if isinstance(received, (str, bytes)) or not hasattr(received, "__iter__"):
        raise TypeError(f"received must be a list of step numbers, got {type(received).__name__}")
    received = list(received)
    expected = list(range(len(received))) if expected is None else list(expected)
    if len(expected) != len(received):
        raise ValueError(f"expected has {len(expected)} entries for {len(received)} received")
    for i, r in enumerate(received):
        if r is not None and (isinstance(r, bool) or not isinstance(r, (int, np.integer))):
            raise TypeError(f"received[{i}] must be an int step number, -1 or None, got {r!r}")
    copied = [(r, e) for r, e in zip(received, expected) if r is not None]
    bad = [i for i, (r, e) in enumerate(zip(received, expected)) if r is not None and r != e]
    torn = sum(1 for r, _ in copied if r == -1)
    return {
        "steps": len(received),
        "copied": len(copied),
        "corrupted": len(bad),
        "torn": torn,
        "rate": (len(bad) / len(copied)) if copied else 0.0,
        "first_corrupted": bad[0] if bad else None,
    }


def received_from_minmax(minmax) -> list[int]:
    """[(min, max)] of each received row -> the step it holds (rows are filled with the step
    number), or -1 where the row mixes steps."""
    if isinstance(minmax, (str, bytes, dict)) or not hasattr(minmax, "__iter__"):
        raise TypeError(f"minmax must be a list of (min, max) pairs, got {type(minmax).__name__}")
    out = []
    for i, mm in enumerate(minmax):
        if isinstance(mm, (str, bytes)) or not hasattr(mm, "__len__") or len(mm) != 2:
            raise ValueError(f"minmax[{i}] must be a (min, max) pair, got {mm!r}"[:200])
        lo = positive_int(f"minmax[{i}] min", mm[0], allow_zero=True)  # rows hold step numbers: >= 0
        hi = positive_int(f"minmax[{i}] max", mm[1], allow_zero=True)
        if lo > hi:
            raise ValueError(f"minmax[{i}] must have min <= max, got ({lo}, {hi})")
        out.append(lo if lo == hi else -1)
    return out


def percentile(values, q: float) -> float:
    """The q-quantile (0..1) of ``values`` by linear interpolation (numpy's default)."""
    vals = sorted(float(v) for v in values)
    if not vals:
        raise ValueError("values must not be empty")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q}")
    return float(np.quantile(np.asarray(vals), q))


def time_summary_us(samples_ns) -> dict:
    """Median, mean, p90 and max of host times given in ns, in µs (rounded to 0.01 µs).
    Every sample must be a finite number >= 0 (a negative duration is a bug upstream)."""
    if isinstance(samples_ns, (str, bytes, dict)) or not hasattr(samples_ns, "__iter__"):
        raise TypeError(f"samples_ns must be a list of durations in ns, got {type(samples_ns).__name__}")
    us = []
    for i, s in enumerate(samples_ns):
        if type(s) is not int or s < 0:  # the loops' perf_counter_ns() differences: ints, checked fast
            s = positive_number(f"samples_ns[{i}]", s, allow_zero=True)
        us.append(s / 1e3)
    if not us:
        raise ValueError("samples_ns must not be empty")
    return {
        "median_us": round(statistics.median(us), 2),
        "mean_us": round(statistics.fmean(us), 2),
        "p90_us": round(percentile(us, 0.9), 2),
        "max_us": round(max(us), 2),
    }




def copies_correct(writes, copies) -> list[bool]:
    """For one reused buffer: did copy n read step n's data?

    ``writes[n] = (start, end)``: when the host wrote step n into the buffer; ``copies[n] =
    (start, end)``: when the GPU's DMA of step n ran. Copy n is correct when no later step's
    write starts before copy n ends (a write at exactly its end is safe). This is the reference
    of the lesson 03 exercise.
    """
    writes, copies = _spans("writes", writes), _spans("copies", copies)
    if len(writes) != len(copies):
        raise ValueError(f"writes ({len(writes)}) and copies ({len(copies)}) must have one span per step")
    return [all(writes[m][0] >= copies[n][1] for m in range(n + 1, len(writes))) for n in range(len(copies))]


def min_ring_depth(writes, copies) -> int:
    """The fewest buffers a ring needs so that no copy reads a later step's data.

    Step n writes buffer ``n % depth``; the host's timing does not depend on ``depth``. The ring
    is safe when, for every n, the next write into the same buffer (step n + depth) starts no
    earlier than copy n ends. The reference of the lesson 04 exercise.
    """
    writes, copies = _spans("writes", writes), _spans("copies", copies)
    if len(writes) != len(copies):
        raise ValueError(f"writes ({len(writes)}) and copies ({len(copies)}) must have one span per step")
    steps = len(writes)
    for depth in range(1, steps + 1):
        if all(writes[n + depth][0] >= copies[n][1] for n in range(steps - depth)):
            return depth
    return max(1, steps)


def _spans(name, spans) -> list[tuple[float, float]]:
    if isinstance(spans, (str, bytes)) or not hasattr(spans, "__iter__"):
        raise TypeError(f"{name} must be a list of (start, end) pairs, got {type(spans).__name__}")
    out = []
    for i, s in enumerate(spans):
        if len(s) != 2:
            raise ValueError(f"{name}[{i}] must be a (start, end) pair, got {s!r}")
        a, b = float(s[0]), float(s[1])
        if b < a:
            raise ValueError(f"{name}[{i}] ends before it starts: {s!r}")
        out.append((a, b))
    return out


def simulate(strategy: str = "reused_pinned", *, steps: int = 6, host_ms: float = 0.1, launch_ms: float = 0.1,
             copy_ms: float = 0.05, gpu_ms: float = 1.0, run_ahead: int | None = None, ring_depth: int = 2,
             staging_slots: int | None = None) -> dict:
    """A pure timeline model of the step loop (times in ms; deterministic; no GPU, no tensors).

    Each step the host writes the step's data into the buffer (``host_ms``), enqueues the copy,
    then launches the step's forward (``launch_ms``). The GPU runs copy n (``copy_ms``) as soon as
    it is enqueued and the previous forward is over, then the forward (``gpu_ms``). ``run_ahead``
    k (:data:`RUN_AHEAD`): the host waits for copy n-k-1 to finish before writing step n (None: never),
    so a ring of k + 1 buffers is enough. Strategies as
    in :data:`STRATEGIES` (``no_copy`` excluded): late-read ones read their buffer when the copy
    *runs*; ``pageable`` and ``snapshot`` capture the data at the call; ``ring``/``ring_events``
    use ``ring_depth`` buffers; ``staging_slots`` limits how many pageable copies may be pending
    before the host blocks (None: no limit).

    Returns ``received`` (the step each copy delivered; -1 if a write was in progress while the
    copy ran), ``corrupted``, the ``writes`` and ``copies`` spans per step, and ``host``/``gpu``
    lanes of ``(start, end, label)`` for :func:`pinlab.plots.timeline`.
    """
    strategy = strategy_arg("strategy", strategy)
    if strategy == "no_copy":
        raise ValueError("simulate() models copies; 'no_copy' has none")
    steps = positive_int("steps", steps, maximum=MAX_SIM_STEPS)
    host_ms = positive_number("host_ms", host_ms)
    launch_ms = positive_number("launch_ms", launch_ms, allow_zero=True)
    copy_ms = positive_number("copy_ms", copy_ms)
    gpu_ms = positive_number("gpu_ms", gpu_ms, allow_zero=True)
    run_ahead = run_ahead_arg(run_ahead)
    ring_depth = positive_int("ring_depth", ring_depth)
    if staging_slots is not None:
        staging_slots = positive_int("staging_slots", staging_slots)
    depth = ring_depth if strategy in ("ring", "ring_events") else 1
    t = g = 0.0
    writes, copies, host, gpu = [], [], [], []
    for n in range(steps):
        until = t
        if run_ahead is not None and n > run_ahead:
            until = max(until, copies[n - run_ahead - 1][1])
        if strategy == "ring_events" and n >= depth:
            until = max(until, copies[n - depth][1])
        if strategy == "event_wait" and n >= 1:
            until = max(until, copies[n - 1][1])
        if strategy == "pageable" and staging_slots is not None:
            pending = sorted(c[1] for c in copies if c[1] > t)
            if len(pending) >= staging_slots:
                until = max(until, pending[len(pending) - staging_slots])
        if until > t:
            host.append((t, until, "host waits"))
            t = until
        writes.append((t, t + host_ms))
        host.append((t, t + host_ms, "host writes a step's data"))
        t += host_ms
        start = max(t, g)
        copies.append((start, start + copy_ms))
        gpu.append((start, start + copy_ms, "GPU copies a step's data"))
        g = start + copy_ms
        if gpu_ms > 0:
            gpu.append((g, g + gpu_ms, "GPU runs the forward"))
            g += gpu_ms
        if launch_ms > 0:
            host.append((t, t + launch_ms, "host launches the forward"))
            t += launch_ms
    received = []
    for n in range(steps):
        if strategy not in LATE_READ:
            received.append(n)
            continue
        cs = copies[n][0]
        same = [m for m in range(steps) if m % depth == n % depth and m >= n]
        version = max(m for m in same if writes[m][0] <= cs)
        in_progress = any(writes[m][0] <= cs < writes[m][1] for m in same if m > n) or any(
            cs < writes[m][0] < copies[n][1] for m in same if m > n)
        received.append(-1 if in_progress else version)
    summary = corruption_summary(received)
    r = lambda v: round(v, 6)  # noqa: E731
    return {
        "strategy": strategy,
        "received": received,
        "corrupted": summary["corrupted"],
        "writes": [(r(a), r(b)) for a, b in writes],
        "copies": [(r(a), r(b)) for a, b in copies],
        "host": [(r(a), r(b), lab) for a, b, lab in host],
        "gpu": [(r(a), r(b), lab) for a, b, lab in gpu],
        "host_end_ms": r(t),
        "gpu_end_ms": r(g),
    }



# =============================================================================================
# Streams: None means the CUDA stream
# =============================================================================================

def cuda_or(stream, what: str):
    """``stream`` itself, or (``None``) a :class:`pinlab.streams.CudaStream`; CudaUnavailableError
    naming ``what`` where there is no CUDA."""
    if stream is not None:
        for attr in ("device", "emulated", "busy", "Event", "synchronize", "launch", "pinned_bytes", "release",
                     "host_stats"):
            if not hasattr(stream, attr):
                raise TypeError(f"stream must be a pinlab stream (pinlab.stream(), pinlab.LaggingStream(), "
                                f"pinlab.CudaStream()) or None, got {type(stream).__name__}")
        return stream
    require_cuda(what)
    from .streams import CudaStream

    return CudaStream()


# =============================================================================================
# Staging: how each strategy gets a step's data into the host memory that the copy reads
# =============================================================================================

class Staging:
    """The host side of one strategy. Create it inside ``with stream:``.

    ``stage(write, arg)`` writes step data (``write(buf, arg)``) and returns the tensor to copy
    from (None for ``no_copy``); ``after_copy()`` follows the enqueued copy (it records the
    guarding events). ``slots`` are the buffers the strategy rewrites.
    """

    def __init__(self, stream, strategy: str, n_ints: int, ring_depth: int = 3):
        self.stream, self.kind = stream, strategy_arg("strategy", strategy)
        k = self.kind
        self.depth = positive_int("ring_depth", ring_depth) if k in ("ring", "ring_events") else 1

        def pinned():
            return torch.zeros(n_ints, dtype=torch.int32, pin_memory=True)

        if k in ("reused_pinned", "snapshot_of_pinned", "event_wait"):
            self.slots = [pinned()]
        elif k in ("pageable", "snapshot", "no_copy"):
            self.slots = [torch.zeros(n_ints, dtype=torch.int32)]
        elif k == "double_pinned":
            self.work = pinned()
            self.slots = [pinned()]
        else:  # ring, ring_events
            self.slots = [pinned() for _ in range(self.depth)]
        self.events = [None] * len(self.slots)
        self._n = -1
        self._slot = 0

    def stage(self, write, arg):
        k = self.kind
        self._n += 1
        s = self._slot = self._n % len(self.slots)
        buf = self.slots[s]
        if k in ("ring_events", "event_wait") and self.events[s] is not None:
            self.events[s].synchronize()  # the copy that last read this buffer has run
        if k == "double_pinned":
            write(self.work, arg)
            buf.copy_(self.work)  # host memcpy into the persistent buffer the GPU copies from
            return buf
        write(buf, arg)
        if k in ("snapshot", "snapshot_of_pinned"):
            return buf.pin_memory()
        if k == "no_copy":
            return None
        return buf

    def after_copy(self) -> None:
        if self.kind in ("ring_events", "event_wait"):
            s = self._slot
            if self.events[s] is None:
                self.events[s] = self.stream.Event()
            self.events[s].record()


def fill(buf: torch.Tensor, value: int) -> None:
    """The plain loop's "write step n's data": every element becomes n."""
    buf.fill_(value)


def _minmax_into(row: torch.Tensor, out_row: torch.Tensor) -> None:
    torch.aminmax(row, out=(out_row[0], out_row[1]))


# =============================================================================================
# The plain step loop, for every strategy
# =============================================================================================

def plain_loop(stream, strategy: str, *, steps: int, n_ints: int, busy_ms: float, run_ahead: int | None,
               ring_depth: int = 3, per_step: bool = True, track_blocks: bool = False) -> dict:
    """One strategy through the plain loop on ``stream``. Step n writes n into every element.

    Returns the run: ``received`` (per_step), ``corrupted``, ``torn``, ``copied``, ``rate``,
    ``first_corrupted``, ``host`` (µs per step inside write + stage + copy), ``host_us`` (per_step),
    ``host_loop_ms``, ``drain_ms``, ``pinned_bytes_held``; with ``track_blocks`` the snapshot's
    ``distinct_blocks``, ``blocks_reused`` and ``reused_before_copy_done``.
    """
    stream.release()
    base = stream.pinned_bytes()
    ring = 4
    copies = strategy != "no_copy"
    host_ns = [0] * steps
    blocks: list[int] = []
    reuse_checks = {"reused": 0, "reused_before_done": 0}
    last_user: dict[int, int] = {}
    copy_events: list = []
    with stream:
        dst = torch.zeros(ring, n_ints, dtype=torch.int32, device=stream.device)
        stats = torch.zeros(steps, 2, dtype=torch.int32, device=stream.device)
        staging = Staging(stream, strategy, n_ints, ring_depth)
        gate = RunAheadGate(stream, run_ahead)
        t_loop = time.perf_counter()
        for n in range(steps):
            gate.wait(n)
            slot = dst[n % ring]
            t0 = time.perf_counter_ns()
            src = staging.stage(fill, n)
            if src is not None:
                slot.copy_(src, non_blocking=True)
            if track_blocks and src is not None:
                # recorded before the snapshot is freed, so before the allocator's own event: when the
                # allocator may reuse the block, this event has completed too
                p = int(src.data_ptr())
                if p in last_user:
                    reuse_checks["reused"] += 1
                    if not copy_events[last_user[p]].query():
                        reuse_checks["reused_before_done"] += 1
                last_user[p] = n
                blocks.append(p)
                ev = stream.Event()
                ev.record()
                copy_events.append(ev)
            staging.after_copy()
            del src
            host_ns[n] = time.perf_counter_ns() - t0
            if copies:
                stream.launch(_minmax_into, slot, stats[n])
            gate.record(n)
            stream.busy(busy_ms)
        host_loop_ms = (time.perf_counter() - t_loop) * 1e3
        held = stream.pinned_bytes() - base  # before the sync: what this approach keeps page-locked
        t_drain = time.perf_counter()
        stream.synchronize()
        drain_ms = (time.perf_counter() - t_drain) * 1e3
        minmax = stats.cpu().tolist() if copies else None
        del staging, dst, stats, gate, copy_events
    received = received_from_minmax(minmax) if copies else [None] * steps
    summary = corruption_summary(received)
    out = {
        "strategy": strategy,
        "steps": steps,
        "nbytes": 4 * n_ints,
        "busy_ms": busy_ms,
        "run_ahead": run_ahead,
        "corrupted": summary["corrupted"],
        "torn": summary["torn"],
        "copied": summary["copied"],
        "rate": round(summary["rate"], 6),
        "first_corrupted": summary["first_corrupted"],
        "host": time_summary_us(host_ns),
        "host_loop_ms": round(host_loop_ms, 3),
        "drain_ms": round(drain_ms, 3),
        "pinned_bytes_held": int(held),
    }
    if per_step:
        out["received"] = received
        out["host_us"] = [round(v / 1e3, 2) for v in host_ns]
    if track_blocks:
        out["distinct_blocks"] = len(set(blocks))
        out["blocks_reused"] = reuse_checks["reused"]
        out["reused_before_copy_done"] = reuse_checks["reused_before_done"]
    stream.release()
    return out


def check_dst(steps: int, n_ints: int) -> None:
    """Refuse step counts above :data:`MAX_LOOP_STEPS`, and sizes whose device buffers would exceed 1 GiB."""
    positive_int("steps", steps, maximum=MAX_LOOP_STEPS)
    if steps * 8 > _MAX_DST_BYTES or 4 * n_ints * 4 > _MAX_DST_BYTES:
        raise ValueError(f"steps ({steps}) and nbytes ({4 * n_ints}) are too large for this experiment")


def warm(stream, strategies, n_ints, busy_ms, run_ahead, ring_depth) -> None:
    """Launch every kernel and allocate every block size the measured loops use."""
    for s in strategies:
        plain_loop(stream, s, steps=min(8, 2 * ((run_ahead or 0) + 1) + 2), n_ints=n_ints,
                   busy_ms=min(busy_ms, 0.05), run_ahead=run_ahead, ring_depth=ring_depth, per_step=False)


def every_strategy(stream, *, strategies, steps, nbytes, busy_ms, run_ahead, ring_depth=3, per_step=True) -> dict:
    """This loop, for every strategy: the arguments checked, a warm-up, then one run per strategy.

    Returns ``{"steps", "nbytes", "busy_ms", "run_ahead", "runs": {strategy: run}}`` (runs as
    :func:`plain_loop`). ``stream`` must already be a stream (see :func:`cuda_or`).
    """
    strategies = strategies_arg(strategies)
    steps = positive_int("steps", steps)
    n_ints = ints_in("nbytes", nbytes)
    busy_ms = positive_number("busy_ms", busy_ms)
    run_ahead = run_ahead_arg(run_ahead)
    ring_depth = positive_int("ring_depth", ring_depth)
    check_dst(steps, n_ints)
    warm(stream, strategies, n_ints, busy_ms, run_ahead, ring_depth)
    runs = {s: plain_loop(stream, s, steps=steps, n_ints=n_ints, busy_ms=busy_ms, run_ahead=run_ahead,
                          ring_depth=ring_depth, per_step=per_step) for s in strategies}
    return {"steps": steps, "nbytes": nbytes, "busy_ms": busy_ms, "run_ahead": run_ahead, "runs": runs}
