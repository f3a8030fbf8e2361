"""Step loops that reproduce the race behind vLLM's FlashInfer metadata fix, and compare the fixes.

vLLM's Model Runner V2 schedules asynchronously: the CPU builds step N+1's inputs while the GPU
still runs step N, with no host sync between steps. If step N's inputs go to the GPU with
``gpu.copy_(host_buf, non_blocking=True)`` from a *pinned* ``host_buf`` that is reused every step,
the copy may run after the host has already written step N+1 into ``host_buf``: the GPU gets the
wrong step's data. This module reproduces that, with a plain step loop and with real FlashInfer
decode, and measures the fixes vLLM tried (see :data:`STRATEGIES`).

Every experiment is one loop, shared by all strategies::

    for step n:
        [bounded run-ahead: wait for step n-ahead's "done" event, like vLLM's batch queue]
        write step n's data into the host buffer (the strategy decides which buffer)
        dst[n].copy_(source, non_blocking=True)        <- timed together with the write's staging
        GPU work that reads dst[n] (attention in the decode loop)
        record done[n]
        gpu_busy(busy_ms)                              <- the rest of step n's forward

Two environments run the same loop code:

* ``_CudaEnv`` (the experiments: :func:`plain_race`, :func:`decode_race`, ...), on a GPU;
* ``_EmuEnv``, a CPU stand-in for a stream that lags far behind the host: device work waits in a
  queue until the host waits for an event, and a copy from "pinned" memory reads its source only
  when it runs. The unit tests use it to check the loop logic and the accounting without a GPU.

:func:`simulate` is a third, pure model (times in ms, no tensors) for timelines in the notebooks.
Nothing here syncs inside a loop: no ``.item()``, no blocking copy, no ``tensor[i] = scalar`` on
the device (that would be a blocking copy), and no data-dependent shapes.
"""
from __future__ import annotations

import gc
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

import numpy as np
import torch

from ..args import one_of, positive_int, positive_number, require_cuda
from ..paged_kv import (
    FlashInferDecode,
    FlashInferUnavailableError,
    build_metadata,
    page_indices,
    reference_decode,
)

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


def _strategy(name: str, value) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a strategy name (str), got {type(value).__name__}")
    return one_of(name, value, STRATEGIES)


def _strategies(value, *, allow_no_copy: bool = True) -> list[str]:
    if isinstance(value, str) or not hasattr(value, "__iter__"):
        raise TypeError(f"strategies must be a list of strategy names, got {type(value).__name__}")
    out = [_strategy(f"strategies[{i}]", v) for i, v in enumerate(value)]
    if not out:
        raise ValueError(f"strategies must not be empty; choose from {sorted(STRATEGIES)}")
    if len(set(out)) != len(out):
        raise ValueError(f"strategies must not repeat a name, got {out}")
    if not allow_no_copy and "no_copy" in out:
        raise ValueError("'no_copy' copies nothing, so it has no corruption to count: leave it out here")
    return out


def _ahead(value) -> int | None:
    """None (unbounded run-ahead) or a positive int."""
    if value is None:
        return None
    return positive_int("ahead", value)


def _nbytes_to_ints(name: str, nbytes) -> int:
    nbytes = positive_int(name, nbytes)
    if nbytes % 4:
        raise ValueError(f"{name} must be a multiple of 4 (the buffer holds int32 values), got {nbytes}")
    return nbytes // 4


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
    out = []
    for i, mm in enumerate(minmax):
        if len(mm) != 2:
            raise ValueError(f"minmax[{i}] must be a (min, max) pair, got {mm!r}")
        lo, hi = int(mm[0]), int(mm[1])
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
    """Median, mean, p90 and max of host times given in ns, in µs (rounded to 0.01 µs)."""
    us = [s / 1e3 for s in samples_ns]
    if not us:
        raise ValueError("samples_ns must not be empty")
    return {
        "median_us": round(statistics.median(us), 2),
        "mean_us": round(statistics.fmean(us), 2),
        "p90_us": round(percentile(us, 0.9), 2),
        "max_us": round(max(us), 2),
    }


def step_metadata(seq_lens, page_size: int) -> tuple[list[int], list[int]]:
    """indptr and last_page_len for one decode step, as lists (vLLM's formulas, pure Python)."""
    page_size = positive_int("page_size", page_size)
    indptr, last = [0], []
    for i, n in enumerate(seq_lens):
        n = positive_int(f"seq_lens[{i}]", n, allow_zero=True)
        pages = -(-n // page_size)
        indptr.append(indptr[-1] + pages)
        r = n % page_size
        last.append(page_size if (r == 0 and n) else r)
    return indptr, last


def decode_schedule(steps: int, max_batch: int, max_seq_len: int, *, seed: int,
                    join_prob: float = 0.3, leave_prob: float = 0.06) -> dict:
    """A reproducible decode workload: requests grow by one token a step, join and leave.

    Each step, every active request leaves with probability ``leave_prob`` (always once it
    reaches ``max_seq_len``); then new requests join, one at a time with probability
    ``join_prob`` each, while fewer than ``max_batch`` are active (the batch is never empty);
    then every active request decodes one token. New requests arrive with 1..max_seq_len/2
    tokens. The batch keeps its order: leavers are removed, joiners are appended.

    Returns ``{"steps": [{"req_ids": [...], "seq_lens": [...]}, ...], "n_requests": int}``; the
    seq_lens of a step include the token decoded in that step.
    """
    steps = positive_int("steps", steps)
    max_batch = positive_int("max_batch", max_batch)
    max_seq_len = positive_int("max_seq_len", max_seq_len)
    seed = positive_int("seed", seed, allow_zero=True)
    for name, p in (("join_prob", join_prob), ("leave_prob", leave_prob)):
        positive_number(name, p, allow_zero=True)
        if p > 1:
            raise ValueError(f"{name} must be a probability in [0, 1], got {p}")
    if max_seq_len < 2:
        raise ValueError(f"max_seq_len must be at least 2 (a request arrives with a token and decodes more), got {max_seq_len}")
    rng = random.Random(seed)
    active: list[list[int]] = []
    next_id = 0

    def new_request():
        nonlocal next_id
        active.append([next_id, rng.randint(1, max(1, max_seq_len // 2))])
        next_id += 1

    for _ in range(max(1, (3 * max_batch) // 4)):
        new_request()
    out = []
    for n in range(steps):
        if n:
            active = [r for r in active if r[1] < max_seq_len and rng.random() >= leave_prob]
            while len(active) < max_batch and (not active or rng.random() < join_prob):
                new_request()
        for r in active:
            r[1] += 1
        out.append({"req_ids": [r[0] for r in active], "seq_lens": [r[1] for r in active]})
    return {"steps": out, "n_requests": next_id}


def metadata_images(indptrs, last_page_lens, max_batch: int) -> list[list[int]]:
    """The reused metadata buffer's content after each step's write.

    The buffer holds ``2 * max_batch + 1`` int32: indptr in ``[0, max_batch]`` and last_page_len
    from ``max_batch + 1`` on. Step n writes ``indptr[:B+1]`` and ``last_page_len[:B]``; entries
    past them keep what earlier steps wrote (the buffer starts as zeros), as in vLLM.
    """
    max_batch = positive_int("max_batch", max_batch)
    if len(indptrs) != len(last_page_lens):
        raise ValueError(f"indptrs ({len(indptrs)}) and last_page_lens ({len(last_page_lens)}) must have one entry per step")
    buf = [0] * (2 * max_batch + 1)
    images = []
    for n, (ip, lpl) in enumerate(zip(indptrs, last_page_lens)):
        b = len(lpl)
        if len(ip) != b + 1 or b > max_batch:
            raise ValueError(f"step {n}: need len(indptr) == len(last_page_len) + 1 <= max_batch + 1, "
                             f"got {len(ip)} and {b} (max_batch {max_batch})")
        buf[: b + 1] = [int(v) for v in ip]
        buf[max_batch + 1: max_batch + 1 + b] = [int(v) for v in lpl]
        images.append(list(buf))
    return images


def match_received(row, images, n: int, batch: int, max_batch: int) -> int:
    """Which step's metadata copy ``n`` delivered, judged on the entries step n uses
    (``indptr[:batch+1]`` and ``last_page_len[:batch]``): n if its own, a later step k if step k's
    (the race), or -1 if it matches no image from step n on (a mix of steps)."""
    row = [int(v) for v in row]
    used = list(range(batch + 1)) + list(range(max_batch + 1, max_batch + 1 + batch))
    want = [row[i] for i in used]
    for k in range(n, len(images)):
        if [images[k][i] for i in used] == want:
            return k
    return -1


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
             copy_ms: float = 0.05, gpu_ms: float = 1.0, ahead: int | None = None, ring_depth: int = 2,
             staging_slots: int | None = None) -> dict:
    """A pure timeline model of the step loop (times in ms; deterministic; no GPU, no tensors).

    Each step the host writes the step's data into the buffer (``host_ms``), enqueues the copy,
    then launches the step's forward (``launch_ms``). The GPU runs copy n (``copy_ms``) as soon as
    it is enqueued and the previous forward is over, then the forward (``gpu_ms``). ``ahead``:
    the host waits for copy n-ahead to finish before writing step n (None: never). Strategies as
    in :data:`STRATEGIES` (``no_copy`` excluded): late-read ones read their buffer when the copy
    *runs*; ``pageable`` and ``snapshot`` capture the data at the call; ``ring``/``ring_events``
    use ``ring_depth`` buffers; ``staging_slots`` limits how many pageable copies may be pending
    before the host blocks (None: no limit).

    Returns ``received`` (the step each copy delivered; -1 if a write was in progress while the
    copy ran), ``corrupted``, the ``writes`` and ``copies`` spans per step, and ``host``/``gpu``
    lanes of ``(start, end, label)`` for :func:`pinlab.plots.timeline`.
    """
    strategy = _strategy("strategy", strategy)
    if strategy == "no_copy":
        raise ValueError("simulate() models copies; 'no_copy' has none")
    steps = positive_int("steps", steps)
    host_ms = positive_number("host_ms", host_ms)
    launch_ms = positive_number("launch_ms", launch_ms, allow_zero=True)
    copy_ms = positive_number("copy_ms", copy_ms)
    gpu_ms = positive_number("gpu_ms", gpu_ms, allow_zero=True)
    ahead = _ahead(ahead)
    ring_depth = positive_int("ring_depth", ring_depth)
    if staging_slots is not None:
        staging_slots = positive_int("staging_slots", staging_slots)
    depth = ring_depth if strategy in ("ring", "ring_events") else 1
    t = g = 0.0
    writes, copies, host, gpu = [], [], [], []
    for n in range(steps):
        until = t
        if ahead is not None and n >= ahead:
            until = max(until, copies[n - ahead][1])
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
# Environments: a CUDA stream, or a CPU stand-in for a stream that lags behind
# =============================================================================================

class _CudaEnv:
    """The real thing: CUDA copies, events, gpu_busy."""

    emulated = False

    def __init__(self, what: str = "this experiment"):
        require_cuda(what)
        from ..busy import gpu_busy
        from ..hostmem import host_stats, pinned_bytes_held, release_cached_host_blocks

        self.device = torch.device("cuda")
        self._busy = gpu_busy
        self._host_stats = host_stats
        self._pinned = pinned_bytes_held
        self._release = release_cached_host_blocks

    def pinned_zeros(self, n: int, dtype=torch.int32) -> torch.Tensor:
        return torch.zeros(n, dtype=dtype, pin_memory=True)

    def pin_memory(self, t: torch.Tensor) -> torch.Tensor:
        return t.pin_memory()

    def copy_h2d(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def gpu(self, fn, *args):
        return fn(*args)

    def event(self):
        return torch.cuda.Event()

    def busy(self, ms: float) -> None:
        self._busy(ms)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def pinned_bytes(self) -> int:
        return self._pinned()

    def host_stats(self) -> dict:
        return self._host_stats()

    def release(self) -> None:
        self._release()


class _EmuEvent:
    def __init__(self, env: "_EmuEnv"):
        self._env = env
        self._mark = None

    def record(self) -> None:
        self._mark = object()
        self._env._queue.append(self._mark)

    def synchronize(self) -> None:
        if self._mark is not None:
            self._env._run_until(self._mark)

    def query(self) -> bool:
        return self._mark is None or self._mark not in self._env._queue


def _cuda(what: str):
    """An environment factory for the experiments: a CUDA environment, or CudaUnavailableError."""
    return lambda: _CudaEnv(what)


class _EmuEnv:
    """A CPU stand-in for a CUDA stream that lags far behind the host (for tests).

    Device work (:meth:`gpu`, the copies) waits in a FIFO queue and runs only when the host
    waits for an event recorded after it, or synchronizes. A copy from a "pinned" tensor reads
    it when it runs; a copy from a pageable tensor is staged (cloned) at the call, as the driver
    does. ``pin_memory()`` of a "pinned" tensor returns that tensor, as torch does.
    """

    emulated = True

    def __init__(self):
        self.device = torch.device("cpu")
        self._queue: deque = deque()

    @staticmethod
    def _mark_pinned(t: torch.Tensor) -> torch.Tensor:
        t._pinlab_pinned = True
        return t

    @staticmethod
    def is_pinned(t: torch.Tensor) -> bool:
        return bool(getattr(t, "_pinlab_pinned", False))

    def pinned_zeros(self, n: int, dtype=torch.int32) -> torch.Tensor:
        return self._mark_pinned(torch.zeros(n, dtype=dtype))

    def pin_memory(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.is_pinned(t) else self._mark_pinned(t.clone())

    def copy_h2d(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if not self.is_pinned(src):
            src = src.clone()  # staged now, like a pageable copy
        self._queue.append(lambda: dst.copy_(src))

    def gpu(self, fn, *args):
        self._queue.append(lambda: fn(*args))

    def event(self):
        return _EmuEvent(self)

    def busy(self, ms: float) -> None:
        positive_number("ms", ms)

    def _run_until(self, mark) -> None:
        while self._queue:
            item = self._queue.popleft()
            if item is mark:
                return
            if callable(item):
                item()

    def synchronize(self) -> None:
        self._run_until(None)

    def pinned_bytes(self) -> int:
        return 0

    def host_stats(self) -> dict:
        return {}

    def release(self) -> None:
        self.synchronize()


def _data_ptr(t: torch.Tensor) -> int:
    return int(t.data_ptr())


# =============================================================================================
# Staging: how each strategy gets a step's data into the host memory that the copy reads
# =============================================================================================

class _Staging:
    """The host side of one strategy: ``stage(write, arg)`` writes step data (``write(buf, arg)``)
    and returns the tensor to copy from (None for ``no_copy``); ``after_copy()`` follows the
    enqueued copy (it records the guarding events)."""

    def __init__(self, env, strategy: str, n_ints: int, ring_depth: int = 3):
        self.env, self.kind = env, _strategy("strategy", strategy)
        k = self.kind
        self.depth = positive_int("ring_depth", ring_depth) if k in ("ring", "ring_events") else 1
        self.slots = []
        if k in ("reused_pinned", "snapshot_of_pinned", "event_wait"):
            self.slots = [env.pinned_zeros(n_ints)]
        elif k in ("pageable", "snapshot", "no_copy"):
            self.slots = [torch.zeros(n_ints, dtype=torch.int32)]
        elif k == "double_pinned":
            self.work = env.pinned_zeros(n_ints)
            self.slots = [env.pinned_zeros(n_ints)]
        else:  # ring, ring_events
            self.slots = [env.pinned_zeros(n_ints) for _ in range(self.depth)]
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
            return self.env.pin_memory(buf)
        if k == "no_copy":
            return None
        return buf

    def after_copy(self) -> None:
        if self.kind in ("ring_events", "event_wait"):
            s = self._slot
            if self.events[s] is None:
                self.events[s] = self.env.event()
            self.events[s].record()


def _fill(buf: torch.Tensor, value: int) -> None:
    buf.fill_(value)


def _minmax_into(row: torch.Tensor, out_row: torch.Tensor) -> None:
    torch.aminmax(row, out=(out_row[0], out_row[1]))


# =============================================================================================
# The plain step loop
# =============================================================================================

def _plain_loop(env, strategy: str, *, steps: int, n_ints: int, busy_ms: float, ahead: int | None,
                ring_depth: int = 3, per_step: bool = True, track_blocks: bool = False) -> dict:
    """One strategy through the plain loop. Each step writes its step number into every element."""
    env.release()
    base = env.pinned_bytes()
    ring = 4
    dst = torch.zeros(ring, n_ints, dtype=torch.int32, device=env.device)
    stats = torch.zeros(steps, 2, dtype=torch.int32, device=env.device)
    staging = _Staging(env, strategy, n_ints, ring_depth)
    n_ev = (ahead or 0) + 1
    done = [env.event() for _ in range(n_ev)] if ahead else None
    host_ns = [0] * steps
    blocks: list[int] = []
    reuse_checks = {"reused": 0, "reused_before_done": 0}
    last_user: dict[int, int] = {}
    copy_events: list = []
    copies = strategy != "no_copy"
    t_loop = time.perf_counter()
    for n in range(steps):
        if ahead and n >= ahead:
            done[(n - ahead) % n_ev].synchronize()
        slot = dst[n % ring]
        t0 = time.perf_counter_ns()
        src = staging.stage(_fill, n)
        if src is not None:
            env.copy_h2d(slot, src)
        if track_blocks and src is not None:
            # recorded before the snapshot is freed, so before the allocator's own event: when the
            # allocator may reuse the block, this event has completed too
            p = _data_ptr(src)
            if p in last_user:
                reuse_checks["reused"] += 1
                if not copy_events[last_user[p]].query():
                    reuse_checks["reused_before_done"] += 1
            last_user[p] = n
            blocks.append(p)
            ev = env.event()
            ev.record()
            copy_events.append(ev)
        staging.after_copy()
        del src
        host_ns[n] = time.perf_counter_ns() - t0
        if copies:
            env.gpu(_minmax_into, slot, stats[n])
        if ahead:
            done[n % n_ev].record()
        env.busy(busy_ms)
    host_loop_ms = (time.perf_counter() - t_loop) * 1e3
    held = env.pinned_bytes() - base  # before the sync: what this approach keeps page-locked
    t_drain = time.perf_counter()
    env.synchronize()
    drain_ms = (time.perf_counter() - t_drain) * 1e3
    received = received_from_minmax(stats.cpu().tolist()) if copies else [None] * steps
    summary = corruption_summary(received)
    out = {
        "strategy": strategy,
        "steps": steps,
        "nbytes": 4 * n_ints,
        "busy_ms": busy_ms,
        "ahead": ahead,
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
    del staging, dst, stats, done, copy_events
    env.release()
    return out


def _check_dst(steps: int, n_ints: int) -> None:
    if steps * 8 > _MAX_DST_BYTES or 4 * n_ints * 4 > _MAX_DST_BYTES:
        raise ValueError(f"steps ({steps}) and nbytes ({4 * n_ints}) are too large for this experiment")


def _warm_plain(env, strategies, n_ints, busy_ms, ahead, ring_depth) -> None:
    """Launch every kernel and allocate every block size the measured loops use."""
    for s in strategies:
        _plain_loop(env, s, steps=min(8, 2 * (ahead or 1) + 2), n_ints=n_ints, busy_ms=min(busy_ms, 0.05),
                    ahead=ahead, ring_depth=ring_depth, per_step=False)


def _plain_race(make_env, *, strategies, steps, nbytes, busy_ms, ahead, ring_depth=3, per_step=True) -> dict:
    strategies = _strategies(strategies)
    steps = positive_int("steps", steps)
    n_ints = _nbytes_to_ints("nbytes", nbytes)
    busy_ms = positive_number("busy_ms", busy_ms)
    ahead = _ahead(ahead)
    ring_depth = positive_int("ring_depth", ring_depth)
    _check_dst(steps, n_ints)
    env = make_env()
    _warm_plain(env, strategies, n_ints, busy_ms, ahead, ring_depth)
    runs = {s: _plain_loop(env, s, steps=steps, n_ints=n_ints, busy_ms=busy_ms, ahead=ahead,
                           ring_depth=ring_depth, per_step=per_step) for s in strategies}
    return {"steps": steps, "nbytes": nbytes, "busy_ms": busy_ms, "ahead": ahead, "runs": runs}


def plain_race(strategies=("reused_pinned", "pageable"), steps: int = 200, nbytes: int = 256,
               busy_ms: float = 0.5, ahead: int | None = None, ring_depth: int = 3) -> dict:
    """The plain step loop on the GPU, once per strategy.

    Each step writes its step number into every int32 of an ``nbytes`` host buffer, copies it
    with ``non_blocking=True`` into a GPU slot, and keeps the GPU busy for ``busy_ms`` (the
    step's forward). ``ahead=None``: the host never waits (MRV2 with no sync between steps);
    an int: the host waits for step n-ahead before building step n (a batch queue).

    Returns ``{"steps", "nbytes", "busy_ms", "ahead", "runs": {strategy: run}}``; each run has
    ``received`` (the step each copy delivered, -1 for a torn row), ``corrupted``, ``torn``,
    ``host`` (µs per step inside write+stage+copy: median, mean, p90, max), ``host_us`` per step,
    ``host_loop_ms``, ``drain_ms`` (how long the final sync waited) and ``pinned_bytes_held``.
    """
    return _plain_race(_cuda("plain_race()"), strategies=strategies, steps=steps, nbytes=nbytes, busy_ms=busy_ms,
                       ahead=ahead, ring_depth=ring_depth)


def _metadata_sizes(sizes) -> list[int]:
    """A non-empty list of byte counts, each a whole number of int32 elements."""
    sizes = [positive_int(f"sizes[{i}]", s) for i, s in enumerate(sizes)]
    if not sizes:
        raise ValueError("sizes must not be empty")
    for i, s in enumerate(sizes):
        _nbytes_to_ints(f"sizes[{i}]", s)
    return sizes


def _pageable_cost(make_env, *, sizes, steps, busy_ms) -> dict:
    sizes = _metadata_sizes(sizes)
    steps = positive_int("steps", steps)
    busy_ms = positive_number("busy_ms", busy_ms)
    _check_dst(steps, max(sizes) // 4)
    env = make_env()
    runs = []
    for s in sizes:
        n_ints = s // 4
        _warm_plain(env, ["pageable"], n_ints, busy_ms, None, 1)
        run = _plain_loop(env, "pageable", steps=steps, n_ints=n_ints, busy_ms=busy_ms, ahead=None)
        run.pop("received")
        runs.append(run)
    return {"sizes": sizes, "steps": steps, "busy_ms": busy_ms, "runs": runs}


def pageable_cost(sizes=(KiB, 64 * KiB, MiB, 4 * MiB), steps: int = 400, busy_ms: float = 0.5) -> dict:
    """The pageable buffer (#32799) in the unbounded step loop, at several metadata sizes.

    Returns ``{"sizes", "steps", "busy_ms", "runs": [run per size]}``; each run as in
    :func:`plain_race` (without ``received``): correct data, but the host time per step shows
    when the driver's staging makes the host wait for the GPU.
    """
    if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__iter__"):
        raise TypeError(f"sizes must be a list of byte counts, got {type(sizes).__name__}")
    return _pageable_cost(_cuda("pageable_cost()"), sizes=list(sizes), steps=steps, busy_ms=busy_ms)


# =============================================================================================
# Lesson 04: the snapshot, the allocator, the trap, the history
# =============================================================================================

def _snapshot_soak(make_env, *, steps, nbytes, busy_ms, control_steps) -> dict:
    steps = positive_int("steps", steps)
    control_steps = positive_int("control_steps", control_steps)
    n_ints = _nbytes_to_ints("nbytes", nbytes)
    busy_ms = positive_number("busy_ms", busy_ms)
    _check_dst(max(steps, control_steps), n_ints)
    env = make_env()
    _warm_plain(env, ["snapshot", "reused_pinned"], n_ints, busy_ms, None, 1)
    snap = _plain_loop(env, "snapshot", steps=steps, n_ints=n_ints, busy_ms=busy_ms, ahead=None,
                       per_step=False, track_blocks=True)
    control = _plain_loop(env, "reused_pinned", steps=control_steps, n_ints=n_ints, busy_ms=busy_ms,
                          ahead=None, per_step=False)
    return {"nbytes": nbytes, "busy_ms": busy_ms, "snapshot": snap, "control": control}


def snapshot_soak(steps: int = 10_000, nbytes: int = 4 * KiB, busy_ms: float = 0.2,
                  control_steps: int = 1_000) -> dict:
    """Many steps of the pin_memory() snapshot with unbounded run-ahead, and a control.

    Returns ``{"snapshot": run, "control": run}`` (runs as in :func:`plain_race`, without per-step
    lists). The snapshot run also has ``distinct_blocks`` (pinned blocks the snapshots used),
    ``blocks_reused`` and ``reused_before_copy_done`` (how often the allocator handed out a block
    whose previous copy had not finished: it must be 0). The control is the reused pinned buffer
    under the same load: it must corrupt, or the soak proves nothing.
    """
    return _snapshot_soak(_cuda("snapshot_soak()"), steps=steps, nbytes=nbytes, busy_ms=busy_ms, control_steps=control_steps)


def _snapshot_cost(make_env, *, sizes, steps, busy_ms, ahead, rounds: int = 3) -> dict:
    sizes = _metadata_sizes(sizes)
    steps = positive_int("steps", steps)
    busy_ms = positive_number("busy_ms", busy_ms)
    ahead = _ahead(ahead)
    _check_dst(steps, max(sizes) // 4)
    env = make_env()
    rows = []
    rounds = positive_int("rounds", rounds)
    for s in sizes:
        n_ints = s // 4
        names = ["no_copy", "reused_pinned", "snapshot"]
        _warm_plain(env, names, n_ints, busy_ms, ahead, 1)
        # interleaved rounds, each strategy's median per round; then the median over rounds, so
        # that a slow spell of the machine does not land on one strategy only
        meds = {k: [] for k in names}
        corrupted = 0
        for r in range(rounds):
            for k in names[r % len(names):] + names[:r % len(names)]:
                run = _plain_loop(env, k, steps=steps, n_ints=n_ints, busy_ms=busy_ms, ahead=ahead, per_step=False)
                meds[k].append(run["host"]["median_us"])
                if k == "snapshot":
                    corrupted += run["corrupted"]
        med = {k: statistics.median(v) for k, v in meds.items()}
        rows.append({
            "nbytes": s,
            "no_copy_us": med["no_copy"],
            "reused_pinned_us": med["reused_pinned"],
            "snapshot_us": med["snapshot"],
            "snapshot_extra_us": round(med["snapshot"] - med["reused_pinned"], 2),
            "copy_total_us": round(med["snapshot"] - med["no_copy"], 2),
            "snapshot_corrupted": corrupted,
        })
    return {"steps": steps, "busy_ms": busy_ms, "ahead": ahead, "rounds": rounds, "rows": rows}


def snapshot_cost(sizes=(KiB, 4 * KiB, 16 * KiB, 64 * KiB), steps: int = 2000, busy_ms: float = 0.1,
                  ahead: int | None = 2, rounds: int = 3) -> dict:
    """Host µs per step of the snapshot, against the same loop without it.

    For each size: the median host time per step (write + stage + copy) of ``no_copy`` (write
    only), ``reused_pinned`` (write + the same non_blocking copy, no snapshot: the racy code the
    fix replaces) and ``snapshot`` (write + pin_memory() + copy). ``snapshot_extra_us`` = snapshot
    - reused_pinned: what the snapshot itself adds; ``copy_total_us`` = snapshot - no_copy: all
    that moving the metadata costs this way. Each value is the median over ``rounds`` interleaved
    rounds of each loop's median step; ``snapshot_corrupted`` counts over all rounds.
    """
    if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__iter__"):
        raise TypeError(f"sizes must be a list of byte counts, got {type(sizes).__name__}")
    return _snapshot_cost(_cuda("snapshot_cost()"), sizes=list(sizes), steps=steps, busy_ms=busy_ms, ahead=ahead,
                          rounds=rounds)


def _allocator_reuse(make_env, *, nbytes, busy_ms, steps, ahead) -> dict:
    n_ints = _nbytes_to_ints("nbytes", nbytes)
    busy_ms = positive_number("busy_ms", busy_ms)
    steps = positive_int("steps", steps)
    ahead = positive_int("ahead", ahead)
    env = make_env()

    def allocs():
        return int(env.host_stats().get("num_host_alloc", 0))

    buf = torch.arange(n_ints, dtype=torch.int32)  # pageable
    dst = torch.zeros(n_ints, dtype=torch.int32, device=env.device)
    _warm_plain(env, ["snapshot"], n_ints, 0.05, None, 1)
    env.synchronize()
    env.release()
    a0 = allocs()
    s1 = env.pin_memory(buf)
    p1 = _data_ptr(s1)
    a1 = allocs()
    env.busy(busy_ms)
    env.copy_h2d(dst, s1)
    copied = env.event()
    copied.record()
    del s1  # back to the allocator, with the pending copy's event
    s2 = env.pin_memory(buf)
    p2 = _data_ptr(s2)
    a2 = allocs()
    pending = not copied.query()
    env.synchronize()
    s3 = env.pin_memory(buf)
    p3 = _data_ptr(s3)
    a3 = allocs()
    stats = env.host_stats()
    keep = ("num_host_alloc", "num_host_free", "allocations.current", "allocated_bytes.current",
            "active_requests.current", "active_bytes.current")
    stats = {k: int(stats[k]) for k in keep if k in stats}
    del s2, s3
    env.synchronize()
    loop = _plain_loop(env, "snapshot", steps=steps, n_ints=n_ints, busy_ms=0.5, ahead=ahead,
                       per_step=False, track_blocks=True)
    return {
        "nbytes": nbytes,
        "copy_pending_at_second_snapshot": bool(pending),
        "second_block_differs": p2 != p1,
        "third_reuses_first": p3 == p1,
        "new_host_allocs": [a1 - a0, a2 - a1, a3 - a2],
        "host_memory_stats": stats,
        "loop": {k: loop[k] for k in ("steps", "ahead", "corrupted", "distinct_blocks", "blocks_reused",
                                       "reused_before_copy_done")},
    }


def allocator_reuse(nbytes: int = 4 * KiB, busy_ms: float = 50.0, steps: int = 200, ahead: int = 4) -> dict:
    """Watch PyTorch's caching host allocator keep a snapshot's block until its copy has run.

    Snapshot 1 is copied behind ``busy_ms`` of GPU work and freed; snapshot 2, taken while that
    copy is pending, gets another block; after a sync, snapshot 3 gets snapshot 1's block back
    without a new cudaHostAlloc. Then a step loop (``steps``, host at most ``ahead`` steps ahead)
    counts the distinct blocks and checks that no block was reused before its copy finished.
    Returns booleans, the new cudaHostAlloc calls per snapshot, a few host_memory_stats()
    entries, and the loop's counts; no addresses.
    """
    return _allocator_reuse(_cuda("allocator_reuse()"), nbytes=nbytes, busy_ms=busy_ms, steps=steps, ahead=ahead)


def _pin_trap(make_env, *, nbytes, steps, busy_ms) -> dict:
    n_ints = _nbytes_to_ints("nbytes", nbytes)
    steps = positive_int("steps", steps)
    busy_ms = positive_number("busy_ms", busy_ms)
    env = make_env()
    pinned = env.pinned_zeros(n_ints)
    again = env.pin_memory(pinned)
    same = _data_ptr(again) == _data_ptr(pinned)
    pageable = torch.zeros(n_ints, dtype=torch.int32)
    snap = env.pin_memory(pageable)
    differs = _data_ptr(snap) != _data_ptr(pageable)
    del pinned, again, snap
    race = _plain_race(lambda: env, strategies=["snapshot_of_pinned", "snapshot"], steps=steps, nbytes=nbytes,
                       busy_ms=busy_ms, ahead=None, per_step=True)
    return {"same_storage": bool(same), "pageable_gets_new_storage": bool(differs), "race": race}


def pin_trap(nbytes: int = 256, steps: int = 200, busy_ms: float = 0.5) -> dict:
    """``pin_memory()`` of a pinned tensor returns the same storage, so the snapshot pattern on a
    pinned buffer still races. Returns ``same_storage``, ``pageable_gets_new_storage`` and the
    step loop (``race``, as :func:`plain_race`) for snapshot_of_pinned against snapshot."""
    return _pin_trap(_cuda("pin_trap()"), nbytes=nbytes, steps=steps, busy_ms=busy_ms)


def _history(make_env, *, strategies, steps, nbytes, busy_ms, ahead, ring_depth) -> dict:
    strategies = _strategies(strategies, allow_no_copy=False)
    res = _plain_race(make_env, strategies=["no_copy"] + strategies, steps=steps, nbytes=nbytes, busy_ms=busy_ms,
                      ahead=ahead, ring_depth=ring_depth, per_step=False)
    base = res["runs"]["no_copy"]["host"]["median_us"]
    rows = []
    for s in strategies:
        r = res["runs"][s]
        rows.append({
            "strategy": s,
            "label": LABELS[s],
            "corrupted": r["corrupted"],
            "steps": r["steps"],
            "host_us": r["host"]["median_us"],
            "host_extra_us": round(r["host"]["median_us"] - base, 2),
            "host_p90_us": r["host"]["p90_us"],
            "pinned_bytes_held": r["pinned_bytes_held"],
        })
    return {"steps": steps, "nbytes": nbytes, "busy_ms": busy_ms, "ahead": ahead, "ring_depth": ring_depth,
            "no_copy_us": base, "rows": rows}


def history(strategies=tuple(HISTORY), steps: int = 1000, nbytes: int = 4 * KiB, busy_ms: float = 0.3,
            ahead: int | None = 2, ring_depth: int = 3) -> dict:
    """The fixes side by side in one step loop: corrupted steps, host µs per step, pinned bytes.

    ``ahead=2``: the host runs at most two steps ahead, as vLLM's batch queue allows. Returns
    ``{"rows": [{"strategy", "label", "corrupted", "steps", "host_us", "host_extra_us",
    "host_p90_us", "pinned_bytes_held"}], "no_copy_us", ...}``; ``host_us`` is the median host
    time per step inside write + stage + copy (event waits included), ``host_extra_us`` the same
    minus the no-copy baseline.
    """
    return _history(_cuda("history()"), strategies=list(strategies), steps=steps, nbytes=nbytes, busy_ms=busy_ms,
                    ahead=ahead, ring_depth=ring_depth)


# =============================================================================================
# Real attention: a decode loop whose page indices come from the raced indptr copy
# =============================================================================================

def safe_indptr(row: torch.Tensor, total_pages: int, positions: torch.Tensor) -> torch.Tensor:
    """Turn a (possibly wrong) device copy of indptr into a well-formed one, on the device.

    ``row`` is the received indptr (B+1 int32), ``positions`` is ``arange(B+1)`` on the same
    device (int64). The result starts at 0, never decreases, ends at ``total_pages`` and stays
    in [0, total_pages]; a correct indptr comes back unchanged. Why: PyTorch's
    ``repeat_interleave(..., output_size=...)`` and advanced indexing check their bounds *on the
    device*, and a failed device-side assert kills the CUDA context; vLLM's Triton kernel has no
    such assert. A wrong indptr still gives wrong pages (the race stays visible), never an
    out-of-bounds read. Only kernels with scalar arguments: no host sync.
    """
    total_pages = positive_int("total_pages", total_pages, allow_zero=True)
    if row.dim() != 1 or positions.shape != row.shape:
        raise ValueError(f"row and positions must be 1-D and of the same length, got {tuple(row.shape)} "
                         f"and {tuple(positions.shape)}")
    last = row.numel() - 1
    ip = row.to(torch.int64).clamp(0, total_pages)
    ip = torch.cummax(ip, dim=0).values
    ip = ip * (positions > 0)
    ip = torch.maximum(ip, (positions == last).to(torch.int64) * total_pages)
    return ip.to(torch.int32)


def torch_paged_decode(q, k_cache, v_cache, indptr, indices, last_page_len, *, max_pages: int,
                       sm_scale: float | None = None) -> torch.Tensor:
    """Batched paged decode attention in plain torch, with all metadata on q's device, no host sync.

    The lesson's stand-in for FlashInfer when FlashInfer cannot run: fp32, every request padded
    to ``max_pages`` pages, masked. A request's page count is clamped to ``max_pages`` and every
    gather index is clamped into ``indices``, so wrong metadata gives a wrong answer, never an
    out-of-bounds read. An empty request gives zeros. Returns fp32 [B, num_qo_heads, head_dim].
    """
    max_pages = positive_int("max_pages", max_pages)
    batch, num_qo_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if indptr.numel() != batch + 1 or last_page_len.numel() != batch:
        raise ValueError(f"indptr must have {batch + 1} and last_page_len {batch} entries, got "
                         f"{indptr.numel()} and {last_page_len.numel()}")
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else positive_number("sm_scale", sm_scale)
    dev = q.device
    out = torch.zeros(batch, num_qo_heads, head_dim, dtype=torch.float32, device=dev)
    if indices.numel() == 0 or batch == 0:
        return out
    group = num_qo_heads // num_kv_heads
    ip = indptr.to(device=dev, dtype=torch.int64)
    count = (ip[1:] - ip[:-1]).clamp(0, max_pages)
    slot = torch.arange(max_pages, device=dev)
    gather = (ip[:-1, None] + slot[None, :]).clamp(0, indices.numel() - 1)
    pages = indices.to(device=dev, dtype=torch.int64)[gather]  # [B, P]
    span = max_pages * page_size
    k = k_cache[pages].reshape(batch, span, num_kv_heads, head_dim).float()
    v = v_cache[pages].reshape(batch, span, num_kv_heads, head_dim).float()
    lpl = last_page_len.to(device=dev, dtype=torch.int64).clamp(0, page_size)
    kv_len = ((count - 1).clamp(min=0) * page_size + lpl) * (count > 0)
    mask = torch.arange(span, device=dev)[None, :] < kv_len[:, None]  # [B, T]
    qf = q.float().reshape(batch, num_kv_heads, group, head_dim)
    logits = torch.einsum("bkgd,btkd->bkgt", qf, k) * scale
    logits = logits.masked_fill(~mask[:, None, None, :], float("-inf"))
    p = torch.nan_to_num(torch.softmax(logits, dim=-1), nan=0.0)
    return torch.einsum("bkgt,btkd->bkgd", p, v).reshape(batch, num_qo_heads, head_dim)


class _DecodeSetup:
    """Everything a decode loop needs, built once before any loop runs (host and device)."""

    def __init__(self, env, *, steps, max_batch, page_size, max_seq_len, num_qo_heads, num_kv_heads,
                 head_dim, seed, dtype=torch.float16):
        self.env = env
        self.steps, self.max_batch, self.page_size = steps, max_batch, page_size
        sched = decode_schedule(steps, max_batch, max_seq_len, seed=seed)
        self.sched = sched["steps"]
        self.pages_per_req = -(-max_seq_len // page_size)
        n_req = sched["n_requests"]
        g = torch.Generator().manual_seed(seed)
        pool = n_req * self.pages_per_req + max_batch
        perm = torch.randperm(pool, generator=g).to(torch.int32)
        req_pages = perm[: n_req * self.pages_per_req].reshape(n_req, self.pages_per_req)
        spare = perm[n_req * self.pages_per_req:]
        self.indptrs, self.lpls = [], []
        for st in self.sched:
            ip, lpl = step_metadata(st["seq_lens"], page_size)
            self.indptrs.append(ip)
            self.lpls.append(lpl)
        # wide enough that even a wrong (but well-formed) indptr indexes inside it
        self.width = max(self.pages_per_req, max(ip[-1] for ip in self.indptrs))
        bt = spare[torch.arange(steps * max_batch * self.width) % spare.numel()].reshape(
            steps, max_batch, self.width).clone()
        for n, st in enumerate(self.sched):
            for b, r in enumerate(st["req_ids"]):
                bt[n, b, : self.pages_per_req] = req_pages[r]
        self.block_table_cpu = bt
        self.indices_cpu = [
            page_indices(bt[n, : len(self.lpls[n])], torch.tensor(self.indptrs[n], dtype=torch.int32),
                         self.indptrs[n][-1])
            for n in range(steps)
        ]
        self.images = metadata_images(self.indptrs, self.lpls, max_batch)
        q = torch.randn((steps, max_batch, num_qo_heads, head_dim), generator=g).to(dtype)
        shape = (pool, page_size, num_kv_heads, head_dim)
        k = torch.randn(shape, generator=g).to(dtype)
        v = torch.randn(shape, generator=g).to(dtype)
        dev = env.device
        self.q, self.k, self.v = q.to(dev), k.to(dev), v.to(dev)
        self.block_table = bt.to(dev)
        self.positions = torch.arange(max_batch + 1, dtype=torch.int64, device=dev)
        self.plan_inputs = [(torch.tensor(ip, dtype=torch.int32), torch.tensor(lpl, dtype=torch.int32))
                            for ip, lpl in zip(self.indptrs, self.lpls)]
        self.ip_np = [np.asarray(ip, dtype=np.int32) for ip in self.indptrs]
        self.lpl_np = [np.asarray(lpl, dtype=np.int32) for lpl in self.lpls]
        self.refs = None

    def batch(self, n: int) -> int:
        return len(self.lpls[n])

    def references(self) -> list[torch.Tensor]:
        """fp32 reference outputs per step (pinlab.paged_kv.reference_decode), on the host."""
        if self.refs is None:
            refs = []
            for n in range(self.steps):
                b = self.batch(n)
                ref = reference_decode(self.q[n, :b], self.k, self.v, torch.tensor(self.indptrs[n], dtype=torch.int32),
                                       self.indices_cpu[n], torch.tensor(self.lpls[n], dtype=torch.int32))
                refs.append(ref.cpu())
            self.refs = refs
        return self.refs


def _write_metadata(buf: torch.Tensor, arg) -> None:
    ip, lpl, mb = arg
    a = buf.numpy()
    a[: ip.size] = ip
    a[mb + 1: mb + 1 + lpl.size] = lpl


class _TorchAttention:
    name = "torch"

    def __init__(self, setup: _DecodeSetup):
        self.s = setup

    def __call__(self, n, row, ip_dev, idx):
        s, b = self.s, self.s.batch(n)
        lpl_dev = row[s.max_batch + 1: s.max_batch + 1 + b]
        return torch_paged_decode(s.q[n, :b], s.k, s.v, ip_dev, idx, lpl_dev, max_pages=s.pages_per_req)


class _FlashInferAttention:
    name = "flashinfer"

    def __init__(self, setup: _DecodeSetup, wrappers):
        self.s, self.wrappers = setup, wrappers

    def __call__(self, n, row, ip_dev, idx):
        s = self.s
        w = self.wrappers[n % len(self.wrappers)]
        ip_cpu, lpl_cpu = s.plan_inputs[n]  # plan() gets its own host copy, never the raced buffer
        w.plan(ip_cpu, idx, lpl_cpu)
        return w.run(s.q[n, : s.batch(n)], s.k, s.v)


def _decode_gpu_side(setup, attention, dst, n, outs, used):
    b = setup.batch(n)
    row = dst[n]
    total = setup.indptrs[n][-1]
    ip_dev = safe_indptr(row[: b + 1], total, setup.positions[: b + 1])
    idx = page_indices(setup.block_table[n, :b], ip_dev, total)
    used[n] = idx
    outs[n] = attention(n, row, ip_dev, idx)


def _decode_loop(env, setup: _DecodeSetup, attention, strategy: str, *, steps: int, busy_ms: float,
                 ahead: int | None, ring_depth: int = 3) -> dict:
    env.release()
    base = env.pinned_bytes()
    mb = setup.max_batch
    n_ints = 2 * mb + 1
    dst = torch.zeros(steps, n_ints, dtype=torch.int32, device=env.device)
    staging = _Staging(env, strategy, n_ints, ring_depth)
    n_ev = (ahead or 0) + 1
    done = [env.event() for _ in range(n_ev)] if ahead else None
    outs: list = [None] * steps
    used: list = [None] * steps
    host_ns = [0] * steps
    for n in range(steps):
        if ahead and n >= ahead:
            done[(n - ahead) % n_ev].synchronize()
        t0 = time.perf_counter_ns()
        src = staging.stage(_write_metadata, (setup.ip_np[n], setup.lpl_np[n], mb))
        env.copy_h2d(dst[n], src)
        staging.after_copy()
        del src
        host_ns[n] = time.perf_counter_ns() - t0
        env.gpu(_decode_gpu_side, setup, attention, dst, n, outs, used)
        if ahead:
            done[n % n_ev].record()
        env.busy(busy_ms)
    held = env.pinned_bytes() - base
    env.synchronize()
    rows = dst.cpu().tolist()
    used_cpu = [u.cpu() for u in used]
    outs_cpu = [o.float().cpu() for o in outs]
    del staging, dst, done, outs, used
    env.release()
    return {"rows": rows, "used": used_cpu, "outs": outs_cpu, "host_ns": host_ns, "pinned_bytes_held": int(held)}


def decode_accounting(setup_like, raw: dict, refs, *, tol: float, gpu_last_page_len: bool) -> dict:
    """Per step and request: did the copy deliver the right metadata, did the attention read the
    right inputs, how far is its output from the reference. Pure (host tensors and lists).

    ``setup_like`` needs ``steps``, ``max_batch``, ``indptrs``, ``lpls``, ``images``,
    ``indices_cpu`` and ``batch(n)``; ``raw`` is a :func:`_decode_loop` result; ``refs`` the fp32
    reference outputs per step. A request's inputs are wrong when its page ids differ from the
    correct ones, or (``gpu_last_page_len``: the torch backend reads the GPU copy of
    last_page_len; FlashInfer gets it from ``plan()``'s host copy) when its last_page_len does.
    """
    tol = positive_number("tol", tol)
    steps, mb = setup_like.steps, setup_like.max_batch
    received, wrong_pages, wrong_inputs, errs = [], [], [], []
    for n in range(steps):
        b = setup_like.batch(n)
        row = raw["rows"][n]
        received.append(match_received(row, setup_like.images, n, b, mb))
        ip, lpl = setup_like.indptrs[n], setup_like.lpls[n]
        got, want = raw["used"][n], setup_like.indices_cpu[n]
        wp, wi = [], []
        for r in range(b):
            a, z = ip[r], ip[r + 1]
            pages_bad = not torch.equal(got[a:z], want[a:z])
            lpl_bad = int(row[mb + 1 + r]) != lpl[r]
            wp.append(int(pages_bad))
            wi.append(int(pages_bad or (gpu_last_page_len and lpl_bad)))
        wrong_pages.append(wp)
        wrong_inputs.append(wi)
        diff = (raw["outs"][n] - refs[n]).abs().reshape(b, -1).amax(dim=1)
        errs.append([float(f"{float(e):.4g}") for e in diff])
    summary = corruption_summary(received)
    ok_errs = [e for es, wi in zip(errs, wrong_inputs) for e, w in zip(es, wi) if not w]
    bad_errs = [e for es, wi in zip(errs, wrong_inputs) for e, w in zip(es, wi) if w]
    return {
        "received": received,
        "copies_wrong": summary["corrupted"],
        "wrong_page_steps": sum(1 for wp in wrong_pages if any(wp)),
        "wrong_input_steps": sum(1 for wi in wrong_inputs if any(wi)),
        "wrong_input_requests": sum(sum(wi) for wi in wrong_inputs),
        "wrong_output_steps": sum(1 for e in errs if any(not x <= tol for x in e)),  # NaN counts as wrong
        "requests": sum(len(wi) for wi in wrong_inputs),
        "max_err_right_inputs": max(ok_errs) if ok_errs else 0.0,
        "max_err_wrong_inputs": max(bad_errs) if bad_errs else None,
        "median_err_wrong_inputs": statistics.median(bad_errs) if bad_errs else None,
        "wrong_inputs": wrong_inputs,
        "err": errs,
    }


def _decode_race(make_env, *, strategies, steps, max_batch, page_size, max_seq_len, num_qo_heads, num_kv_heads,
                 head_dim, busy_ms, ring, ahead, seed, backend, tol) -> dict:
    strategies = _strategies(strategies, allow_no_copy=False)
    steps = positive_int("steps", steps)
    max_batch = positive_int("max_batch", max_batch)
    page_size = positive_int("page_size", page_size)
    max_seq_len = positive_int("max_seq_len", max_seq_len)
    busy_ms = positive_number("busy_ms", busy_ms)
    ring = positive_int("ring", ring)
    ahead = positive_int("ahead", ahead)
    if ahead > ring:
        raise ValueError(
            f"ahead ({ahead}) must be <= ring ({ring}): a wrapper is re-planned every `ring` steps, and "
            "re-planning one whose previous plan has not run yet overwrites FlashInfer's own pinned "
            "plan buffer (an illegal memory access on the H200)")
    tol = positive_number("tol", tol)
    num_qo_heads = positive_int("num_qo_heads", num_qo_heads)
    num_kv_heads = positive_int("num_kv_heads", num_kv_heads)
    head_dim = positive_int("head_dim", head_dim)
    seed = positive_int("seed", seed, allow_zero=True)
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if max_seq_len < 2:
        raise ValueError(f"max_seq_len must be at least 2, got {max_seq_len}")
    one_of("backend", backend, {"auto", "flashinfer", "torch"})
    env = make_env()
    setup = _DecodeSetup(env, steps=steps, max_batch=max_batch, page_size=page_size, max_seq_len=max_seq_len,
                         num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, seed=seed)
    refs = setup.references()
    attention, reason, jit_s = None, None, None
    wrappers = []
    if backend in ("auto", "flashinfer"):
        try:
            wrappers = [FlashInferDecode(num_qo_heads, num_kv_heads, head_dim, page_size) for _ in range(ring)]
            print("building FlashInfer's decode kernel (JIT: slow the first time, then loaded from its cache)...", file=sys.stderr,
                  flush=True)
            t0 = time.perf_counter()
            for w in wrappers:  # first plan+run of each wrapper: compiles once, then loads
                ip_cpu, lpl_cpu = setup.plan_inputs[0]
                w.plan(ip_cpu, setup.indices_cpu[0].to(env.device), lpl_cpu)
                w.run(setup.q[0, : setup.batch(0)], setup.k, setup.v)
            env.synchronize()
            jit_s = round(time.perf_counter() - t0, 2)
            attention = _FlashInferAttention(setup, wrappers)
        except FlashInferUnavailableError as exc:
            if backend == "flashinfer":
                raise
            reason = str(exc)
            wrappers = []
    if attention is None:
        attention = _TorchAttention(setup)
        if reason is None:
            reason = "the torch backend was asked for"
    warm = min(steps, 2 * ring + 2)
    _decode_loop(env, setup, attention, "pageable", steps=warm, busy_ms=min(busy_ms, 0.05), ahead=ahead,
                 ring_depth=ring)
    runs = {}
    for s in strategies:
        raw = _decode_loop(env, setup, attention, s, steps=steps, busy_ms=busy_ms, ahead=ahead, ring_depth=ring)
        acc = decode_accounting(setup, raw, refs, tol=tol, gpu_last_page_len=attention.name == "torch")
        acc["host"] = time_summary_us(raw["host_ns"])
        acc["pinned_bytes_held"] = raw["pinned_bytes_held"]
        runs[s] = acc
    sched = setup.sched
    out = {
        "backend": "flashinfer" if reason is None else "torch",
        "fallback_reason": reason,
        "jit_s": jit_s,
        "steps": steps,
        "max_batch": max_batch,
        "batch_sizes": [len(st["req_ids"]) for st in sched],
        "joins": sum(1 for n in range(1, steps) for r in sched[n]["req_ids"] if r not in sched[n - 1]["req_ids"]),
        "leaves": sum(1 for n in range(1, steps) for r in sched[n - 1]["req_ids"] if r not in sched[n]["req_ids"]),
        "tol": tol,
        "ring": ring,
        "ahead": ahead,
        "busy_ms": busy_ms,
        "runs": runs,
    }
    del wrappers, attention, setup
    gc.collect()  # FlashInfer's pinned plan buffers go back to the allocator now, not at some later GC
    env.synchronize()
    return out


def decode_race(strategies=("reused_pinned", "pageable"), steps: int = 64, max_batch: int = 16,
                page_size: int = 16, max_seq_len: int = 256, num_qo_heads: int = 8, num_kv_heads: int = 2,
                head_dim: int = 128, busy_ms: float = 1.0, ring: int = 3, ahead: int = 2, seed: int = 0,
                backend: str = "auto", tol: float = 0.02) -> dict:
    """A vLLM-shaped decode loop with real paged attention, once per strategy.

    Requests grow by one token a step, join and leave (:func:`decode_schedule`). Each step the
    host writes indptr and last_page_len into the metadata buffer and copies it to the GPU with
    ``non_blocking=True``; the page indices are built **on the GPU** from that GPU copy of indptr
    and the block table (:func:`pinlab.paged_kv.page_indices`, after :func:`safe_indptr`);
    FlashInfer's ``plan()`` gets host indptr/last_page_len and the GPU indices, as in vLLM. A ring
    of ``ring`` :class:`~pinlab.paged_kv.FlashInferDecode` wrappers is used in turn and the host
    waits for step n-``ahead`` before building step n (``ahead <= ring``: never re-plan a wrapper
    whose last plan may not have run, which crashes the CUDA context). ``backend="auto"`` falls
    back to :func:`torch_paged_decode` (fed by the GPU copies of both arrays) when FlashInfer
    cannot run; the result says which ran and why.

    Returns per strategy: ``received`` (the step whose metadata each copy delivered), counts of
    wrong copies, of steps/requests that attended wrong pages and of steps with an output off by
    more than ``tol`` from :func:`pinlab.paged_kv.reference_decode`, the per-request ``err``
    and ``wrong_pages`` matrices (ragged: one row per step), and host µs per step.
    """
    return _decode_race(_cuda("decode_race()"), strategies=strategies, steps=steps, max_batch=max_batch, page_size=page_size,
                        max_seq_len=max_seq_len, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                        head_dim=head_dim, busy_ms=busy_ms, ring=ring, ahead=ahead, seed=seed, backend=backend,
                        tol=tol)


def error_matrix(run: dict, max_batch: int) -> np.ndarray:
    """A decode run's ragged ``err`` rows as a [steps, max_batch] float array, NaN where no request."""
    max_batch = positive_int("max_batch", max_batch)
    err = run["err"]
    m = np.full((len(err), max_batch), np.nan)
    for n, row in enumerate(err):
        if len(row) > max_batch:
            raise ValueError(f"step {n} has {len(row)} requests, more than max_batch={max_batch}")
        m[n, : len(row)] = row
    return m


# =============================================================================================
# FlashInfer's own plan(): two back-to-back plans on one wrapper, in a child process
# =============================================================================================

_CHILD_TAG = "PINLAB_RESULT "


def _plan_hazard_child(mode: str, busy_ms: float, seed: int, tol: float) -> dict:
    """Runs in a child process: two plans on ONE wrapper, with (``synced``) or without
    (``back_to_back``) a sync between them. May crash the CUDA context: never call it in a
    process you care about."""
    one_of("mode", mode, {"synced", "back_to_back"})
    from ..busy import gpu_busy

    try:
        dec = FlashInferDecode(8, 2, 128, 16)
    except FlashInferUnavailableError as exc:
        return {"status": "unavailable", "detail": str(exc)}
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    page_size, width = 16, 16
    batches = {}
    pool = 64 * width
    perm = torch.randperm(pool, generator=g).to(torch.int32)
    k = torch.randn((pool, page_size, 2, 128), generator=g).half().cuda()
    v = torch.randn((pool, page_size, 2, 128), generator=g).half().cuda()
    start = 0
    for name, b in (("a", 3), ("b", 32)):
        lens = [rng.randint(1, width * page_size) for _ in range(b)]
        bt = perm[start: start + b * width].reshape(b, width)
        start += b * width
        meta = build_metadata(bt.cuda(), torch.tensor(lens, dtype=torch.int32), page_size)
        q = torch.randn((b, 8, 128), generator=g).half().cuda()
        ref = reference_decode(q, k, v, meta.indptr_cpu, meta.indices, meta.last_page_len_cpu)
        batches[name] = (meta, q, ref)
    ma, qa, ra = batches["a"]
    mb, qb, rb = batches["b"]
    try:
        dec.plan(mb.indptr_cpu, mb.indices, mb.last_page_len_cpu)  # JIT build or cache load, then warm
        dec.run(qb, k, v)
        torch.cuda.synchronize()
    except FlashInferUnavailableError as exc:
        return {"status": "unavailable", "detail": str(exc)}
    try:
        gpu_busy(busy_ms)  # both plans' copies of their plan info wait behind this
        dec.plan(ma.indptr_cpu, ma.indices, ma.last_page_len_cpu)
        oa = dec.run(qa, k, v)
        if mode == "synced":
            torch.cuda.synchronize()
        dec.plan(mb.indptr_cpu, mb.indices, mb.last_page_len_cpu)
        ob = dec.run(qb, k, v)
        torch.cuda.synchronize()
        err_a = float((oa.float() - ra).abs().max())
        err_b = float((ob.float() - rb).abs().max())
    except Exception as exc:  # an illegal memory access surfaces here
        return {"status": "crashed", "detail": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"}
    wrong = err_a > tol or err_b > tol or not (math.isfinite(err_a) and math.isfinite(err_b))
    return {"status": "wrong output" if wrong else "correct", "err_a": err_a, "err_b": err_b,
            "detail": f"max error {err_a:.3g} (first batch), {err_b:.3g} (second)"}


def classify_child(returncode, stdout: str, stderr: str, timed_out: bool) -> dict:
    """The outcome of a child run as data: ``{"outcome", "detail", ...}``.

    ``outcome`` is "hung" (killed at the timeout), the child's own status ("correct", "wrong
    output", "crashed", "unavailable") when it printed one, else "crashed" (it died: the last
    line of its stderr is the detail).
    """
    if timed_out:
        return {"outcome": "hung", "detail": "killed at the timeout"}
    for line in reversed((stdout or "").splitlines()):
        if line.startswith(_CHILD_TAG):
            try:
                data = json.loads(line[len(_CHILD_TAG):])
            except ValueError:
                break
            out = {"outcome": data.pop("status", "crashed"), "detail": data.pop("detail", "")}
            out.update(data)
            return out
    tail = [ln for ln in (stderr or "").strip().splitlines() if ln.strip()]
    detail = tail[-1][:200] if tail else f"exit status {returncode}, no output"
    return {"outcome": "crashed", "detail": detail}


def _run_child(mode: str, busy_ms: float, seed: int, tol: float, timeout_s: float) -> dict:
    lib = str(Path(__file__).resolve().parents[1])
    code = (
        "import json, os, sys\n"
        "from pinlab.lessons import l03_the_race as race\n"
        f"r = race._plan_hazard_child({mode!r}, {busy_ms!r}, {seed!r}, {tol!r})\n"
        f"print({_CHILD_TAG!r} + json.dumps(r), flush=True)\n"
        "sys.stderr.flush()\n"
        "os._exit(0)\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = lib + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("PINLAB_RECORD", None)
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s, env=env)
        res = classify_child(p.returncode, p.stdout, p.stderr, False)
        res["returncode"] = p.returncode
    except subprocess.TimeoutExpired:
        res = classify_child(None, "", "", True)
        res["returncode"] = None
    res["seconds"] = round(time.perf_counter() - t0, 1)
    return res


def _context_ok() -> bool:
    try:
        x = torch.ones(4, device="cuda")
        return bool((x * 2).sum().item() == 8.0)
    except Exception:
        return False


def plan_hazard(busy_ms: float = 50.0, seed: int = 0, tol: float = 0.02, timeout_s: float = 30.0) -> dict:
    """Two ``plan()`` calls on one FlashInfer wrapper while the GPU is busy, each in a child process.

    FlashInfer's ``plan()`` writes its plan info into one pinned buffer per wrapper and copies it
    to the GPU with ``cudaMemcpyAsync``: the same class of hazard as the lessons' reused buffer.
    ``synced`` (a sync between the two plans: the control) and ``back_to_back`` (no sync, as under
    overlap scheduling) each run in a fresh ``python -c`` child with a ``timeout_s`` limit, so a
    crash or a hang cannot touch this process. Returns ``{"synced": outcome, "back_to_back":
    outcome, "parent_context_ok": bool}``, each outcome from :func:`classify_child` plus
    ``seconds`` and ``returncode``.
    """
    busy_ms = positive_number("busy_ms", busy_ms)
    seed = positive_int("seed", seed, allow_zero=True)
    tol = positive_number("tol", tol)
    timeout_s = positive_number("timeout_s", timeout_s)
    require_cuda("plan_hazard()")
    from ..paged_kv import flashinfer_available

    ok, reason = flashinfer_available()
    out = {}
    for mode in ("synced", "back_to_back"):
        if not ok:  # nothing to test: do not spend a child process on it
            out[mode] = {"outcome": "unavailable", "detail": reason, "seconds": 0.0, "returncode": None}
            continue
        print(f"plan_hazard: running the {mode} child (a fresh Python process)...", file=sys.stderr, flush=True)
        out[mode] = _run_child(mode, busy_ms, seed, tol, timeout_s)
    out["parent_context_ok"] = _context_ok()
    out["timeout_s"] = timeout_s
    return out


# =============================================================================================
# Plots (computed from recorded results, identical live and replayed)
# =============================================================================================

def plot_received(runs: dict, *, title: str, ax=None):
    """x: the step, y: the step whose data its copy delivered (-1: a mix); the diagonal is correct."""
    import matplotlib.pyplot as plt

    if not isinstance(runs, dict) or not runs:
        raise TypeError("runs must be a non-empty dict {strategy: run with 'received'}")
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4))
    markers = "oxs^v+"
    for i, (name, run) in enumerate(runs.items()):
        rec = run["received"]
        ax.plot(range(len(rec)), [r if r is not None else float("nan") for r in rec], markers[i % len(markers)],
                ms=3, alpha=0.7, label=f"{LABELS.get(name, name)}: {run['corrupted']} wrong")
    n = max(len(r["received"]) for r in runs.values())
    ax.plot([0, n - 1], [0, n - 1], "k--", lw=0.8, label="correct (its own step)")
    ax.set_xlabel("step n")
    ax.set_ylabel("step whose data copy n delivered")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return ax


def plot_errors(result: dict, strategy: str, *, title: str, ax=None):
    """Heatmap of a decode run's per-request max error (log10), steps down, batch slots across;
    a dot marks a request whose attention read wrong inputs."""
    import matplotlib.pyplot as plt

    run = result["runs"][strategy]
    m = error_matrix(run, result["max_batch"])
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 5))
    with np.errstate(divide="ignore", invalid="ignore"):
        img = ax.imshow(np.log10(np.maximum(m, 1e-7)), aspect="auto", cmap="viridis", vmin=-6, vmax=1,
                        interpolation="nearest")
    ys, xs = [], []
    for n, row in enumerate(run["wrong_inputs"]):
        for b, w in enumerate(row):
            if w:
                ys.append(n)
                xs.append(b)
    if xs:
        ax.plot(xs, ys, "r.", ms=4, label="read wrong pages / metadata")
        ax.legend(loc="lower right", fontsize=8)
    ax.figure.colorbar(img, ax=ax, label="log10 max |output - reference|")
    ax.set_xlabel("request (position in the batch)")
    ax.set_ylabel("step")
    ax.set_title(title)
    return ax


def plot_host_cumulative(result: dict, *, title: str, ax=None):
    """Cumulative host ms inside the copy section against the step, one line per metadata size,
    and the GPU's pace (busy_ms per step) for comparison."""
    import matplotlib.pyplot as plt

    from ..plots import fmt_bytes

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4))
    for run in result["runs"]:
        cum = np.cumsum(run["host_us"]) / 1e3
        ax.plot(range(1, len(cum) + 1), cum, label=f"pageable, {fmt_bytes(run['nbytes'])} per step")
    steps = result["steps"]
    ax.plot([1, steps], [result["busy_ms"], steps * result["busy_ms"]], "k--", lw=0.8,
            label=f"the GPU's pace ({result['busy_ms']} ms per step)")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("host ms spent in copy calls (cumulative)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return ax


def plot_history(result: dict, *, title: str):
    """Three bar charts side by side: corrupted steps, host µs per step, pinned KiB held."""
    import matplotlib.pyplot as plt

    rows = result["rows"]
    labels = [r["label"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2))
    panels = [
        ("corrupted", f"corrupted steps (of {result['steps']})", "{:.0f}"),
        ("host_us", "host µs per step (median)", "{:.1f}"),
        ("pinned_kib", "pinned KiB held", "{:.0f}"),
    ]
    colors = plt.cm.tab10.colors
    for ax, (key, ylabel, fmt) in zip(axes, panels):
        vals = [r["pinned_bytes_held"] / 1024 if key == "pinned_kib" else r[key] for r in rows]
        bars = ax.bar(range(len(vals)), vals, color=[colors[i % 10] for i in range(len(vals))])
        for b, v in zip(bars, vals):
            ax.annotate(fmt.format(v), (b.get_x() + b.get_width() / 2, b.get_height()), ha="center",
                        va="bottom", fontsize=7)
        ax.set_xticks(range(len(vals)), labels, rotation=35, ha="right", fontsize=7)
        ax.set_ylabel(ylabel)
        ax.grid(True, axis="y", alpha=0.3)
        if key == "host_us":
            ax.axhline(result["no_copy_us"], ls="--", c="grey", lw=1)
            ax.annotate("no copy", (0, result["no_copy_us"]), textcoords="offset points", xytext=(2, 3),
                        fontsize=7, color="grey")
    fig.suptitle(title)
    fig.tight_layout()
    return axes
