"""Lesson 03, the race: its experiments and plots.

The notebook writes the step loop itself and runs it live (GPU) or on the emulated lagging
stream (CPU). The experiments here are that loop for every strategy, measured on the GPU:

* :func:`plain_race`: the plain step loop (:mod:`pinlab.steploop`) with a reused pinned and a
  pageable buffer;
* :func:`decode_race`: the paged-decode loop (:mod:`pinlab.decode_loop`) with real attention.

Each takes ``stream=None``: None means the CUDA stream (CudaUnavailableError without CUDA); a
:class:`pinlab.LaggingStream` runs the same code on the CPU.

What the pageable buffer costs (#32799) is measured by the notebook's own timed step loop (a clock
around every call of the step); :func:`step_parts` sums one such run up, :func:`plot_step_parts`
draws where the host's time went, per size.

* :func:`launch_queue`: how many tiny kernels the host can launch behind a busy GPU before a launch
  call blocks (CUDA's launch queue is full); :func:`queue_full_at` finds that call in the host times,
  :func:`plot_launch_queue` draws them.

Why about 570 lines, above the course's ~500: four experiments with their plots, and the notebook's reasons
(:data:`WHY`) and table columns (issue 31: the notebook keeps one line per fact, this module the excuse).
"""
from __future__ import annotations

import numbers
import statistics
import time

import numpy as np
import torch

from .. import decode_loop, steploop
from ..args import positive_int, positive_number
from ..claims import Reasons
from ..plots import MAX_WIDTH_IN, PALETTE, color_for, fmt_bytes, legend_outside, subplots
from ..steploop import LABELS

__all__ = ["plain_race", "race_audit", "decode_race", "STEP_PARTS", "PART_GROUPS", "step_parts", "waits", "plot_received",
           "plot_errors", "plot_step_parts", "LAUNCH_WAIT_US", "QUEUE_DONE_WITHIN", "launch_queue", "queue_full_at",
           "plot_launch_queue", "plot_paged_kv", "WHY", "PARTS_COLUMNS"]

#: The calls of one step that the notebook's timed step loop clocks, in order: the host writes the
#: step's data, the copy call, the launch of the kernel that reads the copy, the launch of the rest
#: of the forward.
STEP_PARTS = ("write", "copy", "check", "forward")
#: How :func:`plot_step_parts` groups them ("other": the loop's own time between the clocked calls).
PART_GROUPS = {"copy call": ("copy",), "kernel launches": ("check", "forward"), "write + loop": ("write", "other")}


def plain_race(strategies=("reused_pinned", "pageable"), steps: int = 200, nbytes: int = 256,
               busy_ms: float = 0.5, run_ahead: int | None = None, ring_depth: int = 3, stream=None) -> dict:
    """The plain step loop, once per strategy.

    Each step writes its step number into every int32 of an ``nbytes`` host buffer, copies it
    with ``non_blocking=True`` into a device slot, and keeps the GPU busy for ``busy_ms`` (the
    step's forward). ``run_ahead=None``: the host never waits (MRV2 with no sync between steps);
    an int k: run-ahead k (:data:`pinlab.steploop.RUN_AHEAD`), the host waits for step n-k-1 before
    building step n (a batch queue).

    Returns ``{"steps", "nbytes", "busy_ms", "run_ahead", "runs": {strategy: run}}``; each run has
    ``received`` (the step each copy delivered, -1 for a torn row), ``corrupted``, ``torn``,
    ``host`` (µs per step inside write+stage+copy: median, mean, p90, max), ``host_us`` per step,
    ``host_loop_ms``, ``drain_ms`` (how long the final sync waited) and ``pinned_bytes_held``.
    """
    args = dict(strategies=steploop.strategies_arg(strategies), steps=positive_int("steps", steps),
                nbytes=nbytes, busy_ms=positive_number("busy_ms", busy_ms),
                run_ahead=steploop.run_ahead_arg(run_ahead),
                ring_depth=positive_int("ring_depth", ring_depth))
    steploop.ints_in("nbytes", nbytes)
    stream = steploop.cuda_or(stream, "plain_race()")
    return steploop.every_strategy(stream, **args)


def race_audit(stream, strategies=("reused_pinned", "pageable"), *, steps: int = 50, nbytes: int = 256,
               busy_ms: float = 0.5, ring_depth: int = 3) -> dict:
    """The plain step loop, once per strategy, under :func:`pinlab.races.detect_races` (run live: on the GPU,
    or on the emulated stream ``stream`` is a :class:`pinlab.LaggingStream`). The host never waits.

    Returns ``{strategy: {"wrong": steps whose data arrived wrong, "flagged": steps whose copy the detector
    flagged, "missed": wrong steps it did not flag, "findings": races found, "copies": pending copies
    followed, "summary": the detector's report}}``. The loop makes one H2D copy per step, so the detector's
    ordinals (``report.raced``) are step numbers.

    Why ``missed`` is empty by construction: a step's data arrives wrong only when the host rewrote its
    buffer before the copy ran, and the detector asks the copy's event *before* each torch call that touches
    the buffer; a copy still pending then and whose bytes changed is flagged.
    """
    from ..races import detect_races

    strategies = steploop.strategies_arg(strategies, allow_no_copy=False)
    n_ints = steploop.ints_in("nbytes", nbytes)
    stream = steploop.cuda_or(stream, "race_audit()")
    steploop.warm(stream, strategies, n_ints, min(busy_ms, 0.05), None, ring_depth)
    out = {}
    for k in strategies:
        # the loop's own lines are the report's lines (not the caller's): which line copies, which rewrites
        with detect_races(callers=[steploop.plain_loop, steploop.Staging.stage, steploop.fill]) as races:
            run = steploop.plain_loop(stream, k, steps=positive_int("steps", steps), n_ints=n_ints,
                                      busy_ms=positive_number("busy_ms", busy_ms), run_ahead=None,
                                      ring_depth=positive_int("ring_depth", ring_depth))
        wrong = [n for n, got in enumerate(run["received"]) if got != n]
        flagged = sorted(set(races.raced))
        out[k] = {"wrong": wrong, "flagged": flagged, "missed": sorted(set(wrong) - set(flagged)),
                  "findings": races.total, "copies": races.copies, "summary": races.summary()}
    return out


#: the child of :func:`heisenbug`: CUDA reads CUDA_LAUNCH_BLOCKING when it starts, and the order verdict's GPU trace
#: stays on for good in the process that runs it (docs/facts.md F22), so neither touches the notebook's process
HEISENBUG_CHILD = ("import sys\nfrom pinlab.child import report_and_exit\n"
                   "from pinlab.lessons.l03_the_race import heisenbug_run\n"
                   "report_and_exit(heisenbug_run(int(sys.argv[1])))\n")


def heisenbug_run(steps: int) -> dict:
    """The reused pinned buffer's loop (one H2D copy per step, the GPU busy 0.5 ms a step, no host wait until the
    end) once under each verdict: :func:`pinlab.races.detect_races` (timing: "has this copy run yet?") and
    :func:`pinlab.detect_races` (order). On CUDA in this process as it is (:func:`heisenbug` starts it with
    ``CUDA_LAUNCH_BLOCKING=1``); without CUDA on the emulated stream at lag 0, a GPU that keeps up
    (:func:`pinlab.order.lagging_stream`), which is what blocking launches look like to the host.

    Returns ``steps``, ``stream`` (its label), ``launch_blocking`` (CUDA with the variable set), ``wrong`` (steps
    whose data arrived wrong, both runs), ``timing`` (the timing verdict's findings), ``order`` (copies the order
    verdict says can race) and ``raced`` (of those, raced in this run)."""
    import os

    from ..order import detect_races, lagging_stream
    from ..races import detect_races as by_timing
    from ..streams import stream as cuda_or_emulated

    steps = positive_int("steps", steps)
    cuda = torch.cuda.is_available()
    out = {"steps": steps, "launch_blocking": cuda and os.environ.get("CUDA_LAUNCH_BLOCKING", "").strip() == "1",
           "wrong": 0}
    for verdict, detector in (("timing", by_timing), ("order", detect_races)):
        s = cuda_or_emulated() if cuda else lagging_stream(0)
        with s:
            with detector() as races:
                buf = torch.zeros(64, dtype=torch.int32, pin_memory=True)
                dst = torch.zeros(steps, 64, dtype=torch.int32, device=s.device)
                for n in range(steps):
                    buf.fill_(n)
                    dst[n].copy_(buf, non_blocking=True)
                    s.busy(0.5)
                s.synchronize()
            rows = dst[:, 0].tolist()
        out["stream"] = s.label if not s.emulated else "emulated stream at lag 0 (a GPU that keeps up)"
        out["wrong"] += sum(v != n for n, v in enumerate(rows))
        out[verdict] = races.total
        if verdict == "order":
            out["raced"] = sum(races.in_run.values())
    return out


def heisenbug(steps: int = 50, timeout_s: float = 120.0) -> dict:
    """:func:`heisenbug_run` in a fresh process with ``CUDA_LAUNCH_BLOCKING=1`` (:data:`HEISENBUG_CHILD`); raises
    RuntimeError, saying what went wrong, where the child gives no result."""
    import os

    from ..child import run_child

    res = run_child(HEISENBUG_CHILD, (positive_int("steps", steps),),
                    env=dict(os.environ, CUDA_LAUNCH_BLOCKING="1"), timeout_s=positive_number("timeout_s", timeout_s))
    if "error" in res:
        raise RuntimeError(f"l03.heisenbug: {res['error']}")
    return res


def decode_race(strategies=("reused_pinned", "pageable"), steps: int = 64, max_batch: int = 16,
                page_size: int = 16, max_seq_len: int = 256, num_qo_heads: int = 8, num_kv_heads: int = 2,
                head_dim: int = 128, busy_ms: float = 1.0, ring: int = 3, run_ahead: int = 1, seed: int = 0,
                backend: str = "auto", tol: float = 0.02, stream=None) -> dict:
    """A vLLM-shaped decode loop with real paged attention, once per strategy (:mod:`pinlab.decode_loop`).

    Requests grow by one token a step, join and leave (:func:`pinlab.decode_loop.decode_schedule`).
    Each step the host writes indptr and last_page_len into the metadata buffer and copies it to
    the GPU with ``non_blocking=True``; the page indices are built **on the GPU** from that GPU
    copy of indptr and the block table; FlashInfer's ``plan()`` gets host indptr/last_page_len and
    the GPU indices, as in vLLM. A ring of ``ring`` :class:`~pinlab.paged_kv.FlashInferDecode`
    wrappers is used in turn, with run-ahead ``run_ahead`` k: the host waits for step n-k-1 before building
    step n (``run_ahead < ring``: never re-plan a wrapper whose last plan may not have run, which crashes
    the CUDA context). ``backend="auto"`` falls back to
    :func:`~pinlab.decode_loop.torch_paged_decode` (fed by the GPU copies of both arrays) when
    FlashInfer cannot run (always on the emulated stream); the result says which ran and why.

    Returns per strategy: ``received`` (the step whose metadata each copy delivered), counts of
    wrong copies, of steps/requests that attended wrong pages and of steps with an output off by
    more than ``tol`` from :func:`pinlab.paged_kv.reference_decode`, the per-request ``err``
    and ``wrong_inputs`` matrices (ragged: one row per step), and host µs per step.
    """
    args = decode_loop.check_args(strategies=strategies, steps=steps, max_batch=max_batch, page_size=page_size,
                                  max_seq_len=max_seq_len, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                                  head_dim=head_dim, busy_ms=busy_ms, ring=ring, run_ahead=run_ahead, seed=seed,
                                  backend=backend, tol=tol)
    stream = steploop.cuda_or(stream, "decode_race()")
    return decode_loop.every_strategy(stream, **args)


# =============================================================================================
# Plots (computed from recorded results, identical live and replayed)
# =============================================================================================

def _keys_of(value) -> str:
    return f"a dict with keys {sorted(map(str, value))[:8]}" if isinstance(value, dict) else type(value).__name__


def plot_received(runs: dict, *, title: str, ax=None):
    """x: the step, y: the step whose data its copy delivered (-1: a mix); the diagonal is correct."""
    if not isinstance(runs, dict) or not runs:
        raise TypeError("runs must be a non-empty dict {strategy: run with 'received'}")
    for name, run in runs.items():
        if not isinstance(run, dict) or not isinstance(run.get("received"), (list, tuple)) or not run["received"]:
            raise TypeError(f"runs[{name!r}] must be a run with a non-empty 'received' list (a run of plain_race), "
                            f"got {_keys_of(run)}")
        if isinstance(run.get("corrupted"), bool) or not isinstance(run.get("corrupted"), numbers.Integral):
            raise TypeError(f"runs[{name!r}]['corrupted'] must be an int (a run of plain_race), got {_keys_of(run)}")
    if ax is None:
        _, ax = subplots(figsize=(7, 4))
    markers = "oxs^v+"
    for i, (name, run) in enumerate(runs.items()):
        rec = run["received"]
        ax.plot(range(len(rec)), [r if r is not None else float("nan") for r in rec], markers[i % len(markers)],
                ms=3, alpha=0.7, label=f"{LABELS.get(name, name)}: {run['corrupted']} wrong",
                color=color_for(LABELS.get(name, name)))
    n = max(len(r["received"]) for r in runs.values())
    ax.plot([0, n - 1], [0, n - 1], "k--", lw=0.8, label="correct (its own step)")
    ax.set_xlabel("step n")
    ax.set_ylabel("step whose data copy n delivered")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    legend_outside(ax, ncols=min(3, len(runs) + 1))
    return ax


def plot_errors(result: dict, strategy: str, *, title: str, ax=None):
    """Heatmap of a decode run's per-request max error (log10), steps down, batch slots across;
    a dot marks a request whose attention read wrong inputs (the legend under the heatmap, over none of it)."""
    run = result["runs"][strategy]
    m = decode_loop.error_matrix(run, result["max_batch"])
    if ax is None:
        _, ax = subplots(figsize=(7, 5))
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
        ax.plot(xs, ys, ".", ms=4, color=PALETTE[3], label="read wrong pages / metadata")  # vermillion on viridis
        legend_outside(ax)
    ax.figure.colorbar(img, ax=ax, label="log10 max |output - reference|")
    ax.set_xlabel("request (position in the batch)")
    ax.set_ylabel("step")
    ax.set_title(title)
    return ax


# =============================================================================================
# Where the host's time went in a timed step loop (pure: recorded data in, numbers out)
# =============================================================================================

def _non_negative(name: str, value) -> float:
    return positive_number(name, value, allow_zero=True)


def step_parts(run: dict) -> dict:
    """Sum up one run of the notebook's timed step loop.

    ``run`` has ``us`` (a dict: for each of :data:`STEP_PARTS` a list of host µs per step, all
    equally long), ``loop_ms`` (the whole host loop) and ``drain_ms`` (the final wait for the GPU).

    Returns ``steps``, ``loop_ms``, ``drain_ms``, ``run_ms`` (loop + drain), ``share`` (loop / run:
    near 1 when the host ran at the GPU's pace, small when it ran ahead), ``total_ms`` and
    ``median_us`` per part (``total_ms`` also has ``other``: the loop's time outside the clocked
    calls, never below 0), ``group_ms`` (the totals by :data:`PART_GROUPS`) and ``largest`` (the
    group with the most host time).
    """
    if not isinstance(run, dict):
        raise TypeError(f"run must be a dict (one run of the timed step loop), got {type(run).__name__}")
    for key in ("us", "loop_ms", "drain_ms"):
        if key not in run:
            raise ValueError(f"run must have '{key}' (one run of the timed step loop); it has {sorted(run)}"[:200])
    us = run["us"]
    if not isinstance(us, dict):
        raise TypeError(f"run['us'] must be a dict of per-step lists, got {type(us).__name__}")
    per_part = {}
    for part in STEP_PARTS:
        vals = us.get(part)
        if isinstance(vals, (str, bytes)) or not isinstance(vals, (list, tuple)):
            raise TypeError(f"run['us']['{part}'] must be a list of µs per step, got {type(vals).__name__}")
        if not vals:
            raise ValueError(f"run['us']['{part}'] must not be empty")
        per_part[part] = [_non_negative(f"run['us']['{part}'][{i}]", v) for i, v in enumerate(vals)]
    lengths = {len(v) for v in per_part.values()}
    if len(lengths) != 1:
        raise ValueError(f"run['us'] lists must be equally long (one value per step), got lengths "
                         f"{ {p: len(v) for p, v in per_part.items()} }")
    loop_ms = _non_negative("run['loop_ms']", run["loop_ms"])
    drain_ms = _non_negative("run['drain_ms']", run["drain_ms"])
    run_ms = loop_ms + drain_ms
    total = {p: sum(v) / 1e3 for p, v in per_part.items()}
    total["other"] = max(0.0, loop_ms - sum(total.values()))
    groups = {g: sum(total[p] for p in parts) for g, parts in PART_GROUPS.items()}
    return {
        "steps": lengths.pop(),
        "loop_ms": loop_ms,
        "drain_ms": drain_ms,
        "run_ms": run_ms,
        "share": loop_ms / run_ms if run_ms > 0 else 0.0,
        "total_ms": total,
        "median_us": {p: statistics.median(v) for p, v in per_part.items()},
        "group_ms": groups,
        "largest": max(groups, key=groups.get),
    }


def waits(run: dict, threshold_us: float) -> dict:
    """Which calls of the step waited: per part of :data:`STEP_PARTS`, ``{"steps": how many steps
    took longer than ``threshold_us`` in that call, "first": the first such step (None: none),
    "ms": the host ms those slow calls took in all}``.

    ``run`` as in :func:`step_parts` (checked the same way). A call that waits for the GPU takes about
    a GPU step; pass half of one as the threshold, far from both a call that only enqueues (µs) and
    one that waits.
    """
    threshold_us = positive_number("threshold_us", threshold_us)
    step_parts(run)  # the same checks: a dict with equally long lists of µs >= 0
    out = {}
    for part in STEP_PARTS:
        slow = [n for n, v in enumerate(run["us"][part]) if v > threshold_us]
        out[part] = {"steps": len(slow), "first": slow[0] if slow else None,
                     "ms": sum(run["us"][part][n] for n in slow) / 1e3}
    return out


def plot_step_parts(result: dict, *, title: str, ax=None):
    """Stacked bars: where the host's loop time went (:data:`PART_GROUPS`), one bar per buffer kind
    and size, beside the GPU's work (steps x busy_ms, dashed). ``result`` is the timed sweep:
    ``{"steps", "busy_ms", "runs": [{"nbytes", "buffer", "us", "loop_ms", "drain_ms", ...}]}``. Each part has
    its course colour, each buffer kind its hatching; the legend is under the axes, over no bar."""
    if not isinstance(result, dict) or not isinstance(result.get("runs"), list) or not result["runs"]:
        raise TypeError("result must be a dict with a non-empty list 'runs' (the timed step-loop sweep)")
    steps = positive_int("result['steps']", result.get("steps"))
    busy_ms = positive_number("result['busy_ms']", result.get("busy_ms"))
    sizes, kinds = [], []
    for r in result["runs"]:
        if not isinstance(r, dict) or not isinstance(r.get("nbytes"), numbers.Integral) or "buffer" not in r:
            raise TypeError("each run must be a dict with an int 'nbytes' and a 'buffer'")
        if r["nbytes"] not in sizes:
            sizes.append(r["nbytes"])
        if r["buffer"] not in kinds:
            kinds.append(r["buffer"])
    if ax is None:
        _, ax = subplots(figsize=(MAX_WIDTH_IN, 4.5))
    width = 0.8 / len(kinds)
    colors = {g: color_for(g) for g in ("copy call", "kernel launches", "write + loop")}
    hatches = ["", "//", "xx", ".."]
    labelled = set()
    for r in result["runs"]:
        x = sizes.index(r["nbytes"]) + (kinds.index(r["buffer"]) - (len(kinds) - 1) / 2) * width
        bottom = 0.0
        for g, ms in step_parts(r)["group_ms"].items():
            key = (g, r["buffer"])
            label = f"{r['buffer']}: {g}" if key not in labelled else None
            labelled.add(key)
            ax.bar(x, ms, width * 0.9, bottom=bottom, color=colors[g], hatch=hatches[kinds.index(r["buffer"]) % 4],
                   edgecolor="white", label=label)
            bottom += ms
    ax.axhline(steps * busy_ms, color="k", ls="--", lw=0.8, label=f"the GPU's work ({steps} x {busy_ms} ms)")
    ax.set_xticks(range(len(sizes)))
    ax.set_xticklabels([f"{fmt_bytes(n)} per step" for n in sizes])
    ax.set_ylabel(f"host ms in the loop ({steps} steps)")
    ax.set_title(title)
    ax.grid(True, axis="y", alpha=0.3)
    legend_outside(ax, ncols=2)
    return ax


# =============================================================================================
# The launch queue: how many launches wait behind a busy GPU before a launch call blocks
# =============================================================================================

#: A launch call that took longer than this (µs) waited: one that only enqueues takes a few µs.
LAUNCH_WAIT_US = 500.0
#: The call that found the queue full returns when the busy kernel ends; the event recorded after that
#: kernel completes a moment later: :func:`queue_full_at` looks this many calls ahead for it.
QUEUE_DONE_WITHIN = 8


def queue_full_at(launch_us, wait_us: float = LAUNCH_WAIT_US, busy_done=None):
    """The index of the launch call at which the launch queue was full, or None.

    ``launch_us``: host µs of each launch call, in order, all issued behind one long GPU kernel.
    The call that finds the queue full waits until that kernel ends (a slot frees only then): it
    takes over ``wait_us``, and the kernel is done right after it. An earlier hiccup (the OS taking
    the CPU away for a moment) also takes long, but the kernel is still running after it.

    ``busy_done`` (optional): ``len(launch_us) + 1`` booleans, whether the long kernel had finished
    before each call (the last: after the loop), from an event recorded right after it. With it,
    the answer is the last call over ``wait_us`` before the first query that found the kernel
    finished, at most :data:`QUEUE_DONE_WITHIN` calls before it: the call during which the kernel
    ended. Without it, the first call over ``wait_us`` that took at least half as long as the
    longest (the kernel's wait is the longest of the loop).
    None: no such call (the queue never filled while the GPU was busy).
    """
    wait_us = positive_number("wait_us", wait_us)
    if isinstance(launch_us, (str, bytes, dict)) or not hasattr(launch_us, "__iter__"):
        raise TypeError(f"launch_us must be a list of µs per launch call, got {type(launch_us).__name__}")
    us = [positive_number(f"launch_us[{i}]", v, allow_zero=True) for i, v in enumerate(launch_us)]
    if not us:
        raise ValueError("launch_us must not be empty")
    if busy_done is None:
        longest = max(us)
        return next((i for i, v in enumerate(us) if v > wait_us and v >= longest / 2), None)
    if isinstance(busy_done, (str, bytes, dict)) or not hasattr(busy_done, "__iter__"):
        raise TypeError(f"busy_done must be a list of booleans, got {type(busy_done).__name__}")
    done = list(busy_done)
    if len(done) != len(us) + 1 or not all(isinstance(d, bool) for d in done):
        raise ValueError(f"busy_done must hold len(launch_us) + 1 = {len(us) + 1} booleans (one before each call, "
                         f"one after the loop), got {len(done)} values")
    d = next((k for k, v in enumerate(done) if v), None)  # the first query that found the kernel finished
    if d is None:
        return None
    return next((i for i in range(d - 1, max(-1, d - 1 - QUEUE_DONE_WITHIN), -1) if us[i] > wait_us), None)


def launch_queue(launches: int = 5000, busy_ms: float = 100.0, numel: int = 16, stream=None) -> dict:
    """How many tiny kernels the host can launch behind a busy GPU before a launch call blocks.

    One kernel keeps the GPU busy ``busy_ms``, an event recorded after it; then the host launches
    ``launches`` tiny kernels (``x.add_(1)`` on ``numel`` int32 on the device, warmed first),
    timing each launch call, and asks the event (untimed) before each call whether the busy kernel
    has finished. While the GPU is busy every launch waits in the stream's launch queue; once it is
    full, the next launch call blocks until the GPU frees a slot (CUDA documents only that any call
    "may block or synchronize for various reasons such as contention for or unavailability of
    internal resources"). Afterwards ``x`` is read back: each launch added 1.

    Returns ``{"launches", "busy_ms", "numel", "launch_us" (host µs per launch call), "full_at"
    (:func:`queue_full_at`: the index of the call that found the queue full, that is how many
    launches were queued before it; None: no call waited for the busy kernel, because the GPU was
    done before the queue filled or the queue holds more than ``launches``), "waited_ms" (how long
    that call took), "busy_done_at" (the first call before which the busy kernel had finished;
    None: not during the loop), "slow_calls" (calls over :data:`LAUNCH_WAIT_US`), "before_full"
    (median / p90 / max host µs of the calls before it), "loop_ms", "drain_ms", "ran" (launches
    the GPU ran, read back: must equal ``launches``)}``. ``stream=None``: CUDA
    (CudaUnavailableError without it); on a :class:`pinlab.LaggingStream` nothing ever blocks.
    """
    launches = positive_int("launches", launches, maximum=100_000)
    busy_ms = positive_number("busy_ms", busy_ms, maximum=10_000.0)
    numel = positive_int("numel", numel, maximum=1 << 20)
    stream = steploop.cuda_or(stream, "launch_queue()")
    clock = time.perf_counter_ns
    ns = [0] * launches
    done = [False] * (launches + 1)
    with stream:
        x = torch.zeros(numel, dtype=torch.int32, device=stream.device)
        busy_done = stream.Event()
        for _ in range(3):                  # warm-up: every kernel used below loaded (lazy loading blocks)
            x.add_(1)
            x.zero_()
        stream.busy(0.05)
        busy_done.record()
        stream.synchronize()
        stream.busy(busy_ms)                # the GPU is busy; everything below queues behind it
        busy_done.record()                  # completes when the busy kernel has finished
        t_loop = clock()
        for i in range(launches):
            done[i] = busy_done.query()     # untimed: has the busy kernel finished yet?
            t0 = clock()
            x.add_(1)                       # one tiny kernel: the call only enqueues it, until the queue is full
            ns[i] = clock() - t0
        done[launches] = busy_done.query()
        t_end = clock()
        stream.synchronize()
        t_drain = clock()
        ran = int(x[0].item())
        del x
    us = [round(v / 1e3, 2) for v in ns]
    full = queue_full_at(us, busy_done=done)
    before = us[:full] if full else us
    return {
        "launches": launches, "busy_ms": busy_ms, "numel": numel, "launch_us": us, "full_at": full,
        "waited_ms": round(us[full] / 1e3, 3) if full is not None else None,
        "busy_done_at": next((i for i, d in enumerate(done) if d), None),
        "slow_calls": sum(v > LAUNCH_WAIT_US for v in us),
        "before_full": {"median_us": round(statistics.median(before), 2),
                        "p90_us": round(steploop.percentile(before, 0.9), 2), "max_us": round(max(before), 2)},
        "loop_ms": round((t_end - t_loop) / 1e6, 3), "drain_ms": round((t_drain - t_end) / 1e6, 3), "ran": ran,
    }


def plot_launch_queue(result: dict, *, title: str, ax=None):
    """Host µs of each launch call (log scale) behind the busy GPU, the call that found the queue full
    marked. ``result`` is a :func:`launch_queue` result."""
    if not isinstance(result, dict) or not isinstance(result.get("launch_us"), list) or not result["launch_us"]:
        raise TypeError("result must be a launch_queue() result (a dict with a non-empty list 'launch_us')")
    us = [positive_number(f"result['launch_us'][{i}]", v, allow_zero=True) for i, v in enumerate(result["launch_us"])]
    full = result.get("full_at")
    if full is not None:
        full = positive_int("result['full_at']", full, allow_zero=True, maximum=len(us) - 1)
    if ax is None:
        _, ax = subplots(figsize=(MAX_WIDTH_IN, 3.8))
    ax.plot(range(len(us)), [max(v, 0.1) for v in us], ".", ms=2, color=color_for("one launch call"),
            label="one launch call")
    ax.axhline(LAUNCH_WAIT_US, color="k", ls=":", lw=0.8, label=f"{LAUNCH_WAIT_US:g} µs")
    if full is not None:
        ax.axvline(full, color=color_for("the queue was full"), ls="--", lw=1.0,
                   label=f"launch {full}: the queue was full")
    ax.set_yscale("log")
    ax.set_xlabel("launch call (in order, all behind one busy kernel)")
    ax.set_ylabel("host µs in the launch call")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    legend_outside(ax)
    return ax


def plot_paged_kv(indptr, indices, last_page_len, page_size: int, cache_pages: int, *, title: str, ax=None):
    """The lesson's primer figure: a paged KV cache of ``cache_pages`` pages of ``page_size`` tokens,
    each request's pages coloured (its used token slots filled), and under it the three metadata
    arrays FlashInfer's decode reads: ``indices`` (the pages, request by request), ``indptr`` (where
    each request's run of ``indices`` starts; arrows) and ``last_page_len``. Plain lists of ints
    (or int tensors); checked to be consistent: indptr starts at 0, never decreases, ends at
    len(indices), and has one more entry than last_page_len."""
    from matplotlib.patches import Rectangle

    def ints(name, value):
        if isinstance(value, torch.Tensor):
            value = value.tolist()
        if not isinstance(value, (list, tuple)) or not all(
                isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in value):
            raise TypeError(f"{name} must be a list of ints or an int tensor, got {value!r}")
        return [int(v) for v in value]

    indptr, indices, lpl = ints("indptr", indptr), ints("indices", indices), ints("last_page_len", last_page_len)
    page_size = positive_int("page_size", page_size)
    cache_pages = positive_int("cache_pages", cache_pages)
    if len(indptr) != len(lpl) + 1 or indptr[0] != 0 or indptr[-1] != len(indices) or any(
            b < a for a, b in zip(indptr, indptr[1:])):
        raise ValueError(f"indptr must start at 0, never decrease, end at len(indices) = {len(indices)} and have "
                         f"len(last_page_len) + 1 = {len(lpl) + 1} entries, got {indptr}")
    if any(not 0 <= p < cache_pages for p in indices) or len(set(indices)) != len(indices):
        raise ValueError(f"indices must be distinct page ids in 0..{cache_pages - 1}, got {indices}")
    if any(not 0 <= n <= page_size for n in lpl):
        raise ValueError(f"last_page_len must be in 0..page_size = {page_size}, got {lpl}")
    owner, used = {}, {}
    for r in range(len(lpl)):
        pages = indices[indptr[r]:indptr[r + 1]]
        for k, p in enumerate(pages):
            owner[p], used[p] = r, (lpl[r] if k == len(pages) - 1 else page_size)
    colors = [color_for(f"request {r}") for r in range(len(lpl))]  # the course palette, one per request
    if ax is None:
        _, ax = subplots(figsize=(MAX_WIDTH_IN, 4.2))
    # the cache: one box per page, one cell per token slot
    for p in range(cache_pages):
        x0 = p * (page_size + 1)
        for t in range(page_size):
            filled = p in owner and t < used[p]
            ax.add_patch(Rectangle((x0 + t, 3), 1, 1, ec="k", lw=0.6,
                                   fc=colors[owner[p]] if filled else ("white" if p not in owner else "0.92")))
        ax.text(x0 + page_size / 2, 4.25, f"page {p}", ha="center", va="bottom", fontsize=9)
    ax.text(-0.5, 3.5, "KV cache", ha="right", va="center", fontsize=9)
    # indices, with indptr's arrows, and last_page_len: boxes of width w, one per entry
    w = 2.0
    for i, p in enumerate(indices):
        r = next(r for r in range(len(lpl)) if indptr[r] <= i < indptr[r + 1])
        ax.add_patch(Rectangle((i * w, 1), w, 1, ec="k", lw=0.8, fc=colors[r], alpha=0.8))
        ax.text(i * w + w / 2, 1.5, str(p), ha="center", va="center", fontsize=9)
    ax.text(-0.5, 1.5, "indices", ha="right", va="center", fontsize=9)
    ax.text(-1.8, 0.0, "indptr", ha="right", va="center", fontsize=9)
    for j, v in enumerate(indptr):
        ax.annotate(f"[{j}]={v}", xy=(v * w, 1), xytext=(v * w, 0.2 - 0.45 * (j % 2)), ha="center", fontsize=9,
                    arrowprops=dict(arrowstyle="->", lw=0.8))
    for r, n in enumerate(lpl):
        ax.add_patch(Rectangle((r * w, -1.8), w, 1, ec="k", lw=0.8, fc=colors[r], alpha=0.8))
        ax.text(r * w + w / 2, -1.3, str(n), ha="center", va="center", fontsize=9)
    ax.text(-0.5, -1.3, "last_page_len", ha="right", va="center", fontsize=9)
    for r in range(len(lpl)):
        ax.add_patch(Rectangle((0, 0), 0, 0, fc=colors[r], label=f"request {r}"))
    ax.set_xlim(-9, max(cache_pages * (page_size + 1), len(indices) * w) + 0.5)
    ax.set_ylim(-2.0, 5.0)
    ax.set_axis_off()
    ax.set_title(title)
    legend_outside(ax, ncols=min(4, len(lpl)) if lpl else None)
    return ax


# ---- issue 31: the notebook's reasons (why a fact may not hold on some machine) and table columns ----------

_STAGING = ("the driver's staging limits and where a pageable copy blocks are undocumented and differ by driver, "
            "link and platform (a GH200's NVLink-C2C, WSL2, ROCm: not measured here, docs/facts.md F15, F17, F18); "
            "a GPU shared with other processes works through the queue more slowly")
#: why a claim or an observation of the notebook may not hold on some machine: ``why=l03.WHY.staged``
WHY = Reasons(
    exact="the metadata is computed on the CPU by exact integer arithmetic; only a bug in pinlab.paged_kv could "
          "make it differ",
    host_ahead="the race needs the host ahead of the GPU (0.5 ms of GPU work per step against a host step of "
               "microseconds): a host slower than that (a CPU shared by many processes) lets the GPU keep up, and "
               "copies run before the next write",
    staged="the driver copies a pageable source into its staging buffer during the call: a step that received "
           "another step's data here is a bug in the driver or torch, not a property of the machine",
    detector_miss="a copy reads wrong data only if the host rewrote its buffer while it was pending, and the "
                  "detector asks before every call that touches the buffer: a miss is a bug in pinlab.races",
    detector_false="the driver stages a pageable copy during the call, so nothing is pending: a finding here is a "
                   "false positive (a bug in pinlab.races)",
    behind="the GPU is kept 3 ms behind per step; a host that needs more than that per step (a CPU shared by many "
           "processes, or FlashInfer's plan() far slower than usual) would let every copy run before the next write",
    fp16="fp16 attention against an fp32 reference; a larger error means a broken attention kernel or build",
    staging=_STAGING,
    staging_or_slow_host=_STAGING + "; or the host was too slow to queue enough (the 'what this run shows' lines "
                                    "say where its time went)",
    slow_host="a host slower than the GPU (a CPU shared by many processes) cannot run ahead even without staging",
    launch_count="each launch adds 1 on the device; a different count is a bug, not a property of the machine",
    launch_blocking="with CUDA_LAUNCH_BLOCKING=1 every copy has run before copy_() returns, on any CUDA GPU (and "
                    "on the emulated stream at lag 0): a wrong step or a timing finding means the variable did not "
                    "reach the child's CUDA, or a bug in pinlab.races",
    by_order="the order verdict counts every copy whose buffer the host rewrote before anything ordered it, whatever "
             "the GPU's speed: steps - 1 here (the final synchronize() orders the last); another count is a bug in "
             "pinlab.order",
    two_runs="the two runs are separate measurements; a shared GPU or a busy host shifts the estimate of what was "
             "queued",
)


def _f1(v) -> str:
    return f"{v:.1f}"


#: the columns of the notebook's table of the timed step loop, one row per (buffer, size) of :func:`step_parts`
PARTS_COLUMNS = [("buffer", "buffer", str), ("bytes", "per step", fmt_bytes), ("loop", "host loop ms", _f1),
                 ("share", "loop / run", lambda v: f"{v:.0%}"), ("copy call", "in copy calls ms", _f1),
                 ("kernel launches", "in launches ms", _f1), ("write + loop", "write + loop ms", _f1),
                 ("copy_med", "copy call µs (median)", _f1), ("check_med", "check launch µs (median)", _f1),
                 ("fwd_med", "forward launch µs (median)", _f1)]
