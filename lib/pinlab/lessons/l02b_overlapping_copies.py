"""Lesson 02b experiments: overlapping copies with compute, and the step loop that shows it.

Split from lesson 02's module (issue 31: one lesson, one room); what both lessons use (the sizes, the busy
GPU, the pure helpers) stays in :mod:`pinlab.lessons.l02_fake_non_blocking`. Each experiment keeps the GPU
busy or calibrated, warms up every kernel it times, and returns JSON-able data for :func:`pinlab.measure`
(names ``02_*``, the recordings' names from before the split). The notebook defines the key code (the step,
``demo_step``, the copy-stream loop) and hands it to :func:`step_loop`, :func:`detector_demo`,
:func:`overlap_loop`, :func:`many_tensors` and :func:`copy_engines`.

Why about 750 lines, above the course's ~500: five GPU experiments, each with its own buffers, warm-up, JSON
result and the pure sentences computed from it (tested on the CPU), one per notebook section.
"""
from __future__ import annotations

import inspect
import math
import statistics
import time
import warnings

import torch

from ..args import callable_arg, positive_int, positive_number
from ..busy import gpu_busy, wall_ms, warmup
from ..detector import FACTORY_SYNC, ITEM_SYNC, PAGEABLE_H2D
from ..device import require_cuda
from ..plots import MAX_WIDTH_IN
from ..profiler import gpu_kernel_idle_share, merge_spans, profile_runs, trace_path
from ..progress import progress
from ..timing import Stats, interleaved

from .l02_fake_non_blocking import GiB, KiB, MiB, _blocked_rows, _busy, _number_list


#: The calls in the notebook's ``demo_step`` the detector should report: a fragment of the line -> its kind.
DEMO_STALLS = {
    "inputs_gpu.copy_(": PAGEABLE_H2D,
    "torch.tensor(": FACTORY_SYNC,
    ".item()": ITEM_SYNC,
}


def source_lines(fn, fragments=None) -> dict:
    """``{kind: line}`` for each ``{fragment: kind}`` (default :data:`DEMO_STALLS`): the one line of
    ``fn``'s source holding the fragment, counted from 1 at ``fn``'s first line (``def``)."""
    callable_arg("fn", fn)
    fragments = DEMO_STALLS if fragments is None else fragments
    lines, _ = inspect.getsourcelines(fn)
    out = {}
    for fragment, kind in fragments.items():
        found = [i for i, line in enumerate(lines, 1) if fragment in line]
        if len(found) != 1:
            raise ValueError(f"{fragment!r} must occur on exactly one line of {fn.__name__}, found {found}")
        out[kind] = found[0]
    return out


def stall_lines(events, fn) -> dict:
    """``{kind: sorted lines}`` of the stall events (dicts or ``StallEvent``) that point into ``fn``,
    counted from 1 at ``fn``'s first line, whatever file ``fn`` lives in (a notebook cell's)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        raise TypeError(f"fn must be a Python function, got {type(fn).__name__}")
    n_lines = len(inspect.getsourcelines(fn)[0])
    out: dict = {}
    for e in events:
        where = e["where"] if isinstance(e, dict) else e.where
        kind = e["kind"] if isinstance(e, dict) else e.kind
        file, _, line = str(where).rpartition(":")
        if file == code.co_filename and line.isdigit():
            rel = int(line) - code.co_firstlineno + 1
            if 1 <= rel <= n_lines:
                out.setdefault(kind, set()).add(rel)
    return {k: sorted(v) for k, v in out.items()}


# --- the step loop, timed and profiled -----------------------------------------------------------

FORWARD_LABEL = "forward (kernel)"
STEP_MODES = ("pageable", "pinned")
RUN_NAMES = {"pageable": "run: pageable inputs", "pinned": "run: pinned inputs"}
DEFAULT_TRACE = "build/traces/02_step_loop.json"
ROUNDS = 2  # the timed steps are split into this many rounds, the two modes alternating
#: the spans of the notebook's step in which the host works for itself (the rest is waiting: for step i-2, in copy_)
HOST_WORK_SPANS = ("prepare inputs (CPU)", "launch forward")
#: the forward lasts at least this many times the host's own work per step, measured in the run's warm-up, so
#: that the GPU, not the host, sets the pace of both loops on a busy or slow host too (issue 33: in a shared run
#: "prepare inputs" took 6.6 ms instead of 1 ms, the host set the pace, and pinned and pageable ran alike)
GPU_BOUND_FACTOR = 2.0
MAX_FORWARD_MS = 25.0  # ... and at most this long: a host slower still is said to have set the pace


class HostSpans:
    """A ``span`` for the step loop that times the host's spans: ``spans(name)`` is a context manager, and
    ``spans.ms[name]`` lists the ms of each span of that name, in order (one per step)."""

    def __init__(self):
        self.ms: dict[str, list[float]] = {}

    def __call__(self, name):
        return _HostSpan(self.ms.setdefault(str(name), []))


class _HostSpan:
    def __init__(self, out: list):
        self.out = out

    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.out.append((time.perf_counter() - self.t0) * 1e3)
        return False


def host_work_per_step(ms: dict, names=HOST_WORK_SPANS) -> list[float]:
    """The host's own work in each step (ms): the sum of its ``names`` spans (:class:`HostSpans`.ms), step by step."""
    if not isinstance(ms, dict):
        raise TypeError(f"ms must be HostSpans().ms, a dict of span name -> list of ms, got {type(ms).__name__}")
    missing = [n for n in names if not ms.get(n)]
    if missing:
        raise ValueError(f"the step function marked no {missing[0]!r} span: the step loop's host work is timed by "
                         f"its spans {list(names)} (with span(name): ...)")
    lists = [_number_list(f"ms[{n!r}]", ms[n]) for n in names]
    return [sum(step) for step in zip(*lists)]


def gpu_bound_forward_ms(host_work_ms, floor_ms: float, factor: float = GPU_BOUND_FACTOR,
                         cap_ms: float = MAX_FORWARD_MS) -> float:
    """How long the step loop's forward runs: ``floor_ms``, or ``factor`` times the host's own work per step where
    that is longer (rounded up to 0.5 ms), at most ``cap_ms``: long enough that the GPU sets the pace."""
    host_work_ms = positive_number("host_work_ms", host_work_ms, allow_zero=True)
    floor_ms, factor, cap_ms = (positive_number(n, v) for n, v in (("floor_ms", floor_ms), ("factor", factor),
                                                                    ("cap_ms", cap_ms)))
    want = max(floor_ms, math.ceil(factor * host_work_ms * 2) / 2)
    return float(min(want, max(cap_ms, floor_ms)))


def _with_kernel(spans: dict, label: str, mode: str, trace) -> dict:
    """One profiled run's spans, or a RuntimeError naming the run and the trace where the profiler recorded no
    GPU kernel ``label`` (no CUPTI): a result without GPU spans would read as a GPU that never ran."""
    if not any(g[2] == label for g in spans["gpu"]):
        raise RuntimeError(f"the profiler recorded no GPU kernel in the {mode} run (is CUPTI available?); "
                           f"see the trace {trace}")
    return spans


def step_loop(step_fn, steps: int = 40, warm_steps: int = 5, profile_steps: int = 6, input_bytes: int = 8 * MiB,
              gpu_ms: float = 2.0, cpu_ms: float = 1.0, in_flight: int = 2, trace: str = DEFAULT_TRACE,
              gpu_bound_factor: float = GPU_BOUND_FACTOR) -> dict:
    """The notebook's step loop, with pageable and with pinned input buffers: calibrated, timed, then profiled.
    ``step_fn(bufs, dev, steps, *, cpu_ms, gpu_ms, in_flight, span=...)`` runs ``steps`` steps
    (wait for step i-``in_flight``, prepare the input in ``bufs[i % len(bufs)]``, ``dev.copy_(...,
    non_blocking=True)``, launch a ``gpu_ms`` forward), synchronizes, and returns the host ms
    inside each ``copy_``; ``span(name)`` marks its host spans (the profiler's, or :class:`HostSpans`, which
    times :data:`HOST_WORK_SPANS`). ``bufs``: ``in_flight + 1`` host buffers of ``input_bytes``, pageable or
    pinned: the only difference.

    ``warm_steps`` per mode measure the host's own work per step on this machine now; the forward then lasts
    :func:`gpu_bound_forward_ms` of it (``gpu_bound_factor`` times it, at least ``gpu_ms``), so that the GPU sets the pace of both loops on a
    busy host too. Then ``steps`` per mode timed in :data:`ROUNDS` alternating rounds, then ``profile_steps``
    per mode under the profiler (:func:`pinlab.profiler.profile_runs`; the trace goes to ``trace``, relative to
    the repository root). Returns ``{"trace_file", "spans_from", "forward_ms", "calibration": {"host_work_ms",
    "factor", "floor_ms", "cap_ms"}, "modes": {mode: {"steps_per_s", "ms_per_step", "round_ms_per_step",
    "copy_host_ms", "host_work_ms", "host_slow_steps", "timed_steps", "window_ms", "host", "gpu",
    "memcpy_names", "gpu_idle_share"}}}`` (``round_ms_per_step``: each timed round's ms per step;
    ``host_slow_steps``: the timed steps whose host work took longer than the forward).
    """
    callable_arg("step_fn", step_fn)
    steps = positive_int("steps", steps)
    warm_steps = positive_int("warm_steps", warm_steps)
    profile_steps = positive_int("profile_steps", profile_steps)
    input_bytes = positive_int("input_bytes", input_bytes)
    gpu_ms = positive_number("gpu_ms", gpu_ms)
    cpu_ms = positive_number("cpu_ms", cpu_ms)
    in_flight = positive_int("in_flight", in_flight)
    gpu_bound_factor = positive_number("gpu_bound_factor", gpu_bound_factor)
    trace_path(trace)
    require_cuda("step_loop()")
    warmup(_busy(1.0))
    dev = torch.empty(input_bytes, dtype=torch.uint8, device="cuda")
    bufs = {m: [torch.zeros(input_bytes, dtype=torch.uint8, pin_memory=m == "pinned") for _ in range(in_flight + 1)]
            for m in STEP_MODES}
    forward = {"ms": gpu_ms}

    def run(mode, n, **span):
        return step_fn(bufs[mode], dev, n, cpu_ms=cpu_ms, gpu_ms=forward["ms"], in_flight=in_flight, **span)

    warm = {}
    for m in STEP_MODES:
        t = HostSpans()
        run(m, warm_steps, span=t)
        warm[m] = statistics.median(host_work_per_step(t.ms))
    calibration = {"host_work_ms": max(warm.values()), "factor": gpu_bound_factor, "floor_ms": gpu_ms,
                   "cap_ms": MAX_FORWARD_MS}
    forward["ms"] = gpu_bound_forward_ms(calibration["host_work_ms"], gpu_ms, gpu_bound_factor)
    per_round = max(1, steps // ROUNDS)
    rounds = {m: [] for m in STEP_MODES}
    copy_ms = {m: [] for m in STEP_MODES}
    work = {m: [] for m in STEP_MODES}
    for _ in range(ROUNDS):
        for m in STEP_MODES:
            t = HostSpans()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            copy_ms[m] += list(run(m, per_round, span=t))
            rounds[m].append((time.perf_counter() - t0) * 1e3 / per_round)
            work[m] += host_work_per_step(t.ms)
    modes = {m: {"steps_per_s": 1e3 / statistics.fmean(rounds[m]),
                 "ms_per_step": statistics.fmean(rounds[m]),
                 "round_ms_per_step": rounds[m],
                 "copy_host_ms": statistics.median(copy_ms[m]),
                 "host_work_ms": statistics.median(work[m]),
                 "host_slow_steps": sum(w > forward["ms"] for w in work[m]),
                 "timed_steps": len(work[m])} for m in STEP_MODES}
    runs = {RUN_NAMES[m]: (lambda span, m=m: run(m, profile_steps, span=span)) for m in STEP_MODES}
    spans, spans_from = profile_runs(runs, trace, kernel_label=FORWARD_LABEL)
    for m in STEP_MODES:
        spans_m = _with_kernel(spans[RUN_NAMES[m]], FORWARD_LABEL, m, trace)
        modes[m].update(spans_m)
        modes[m]["gpu_idle_share"] = gpu_kernel_idle_share(spans_m, FORWARD_LABEL)
    del bufs, dev
    torch.cuda.synchronize()
    return {"trace_file": trace, "spans_from": spans_from, "forward_ms": forward["ms"], "calibration": calibration,
            "modes": modes}


def _fmt(ms: float) -> str:
    """fmt_ms, with a sign for a negative difference."""
    from ..timing import fmt_ms

    return ("-" if ms < 0 else "") + fmt_ms(abs(ms))


def step_loop_findings(result: dict) -> dict:
    """What one :func:`step_loop` run shows, computed from it (no GPU needed): ``{"shown", "gpu_bound": {mode:
    bool}, "extra_ms" (pageable minus pinned ms per step), "gap_ms": {mode}, "copy_ms": {mode}, "forward_ms":
    {mode} (the profiled forwards' median), "models": {name: ms}, "nearest_model", "sentences"}``.

    The effect (pinned steps faster than pageable ones, by the GPU's shorter wait between two forwards) is
    ``shown`` where the GPU set the pace of both loops (the host's own work per step, median of the timed steps,
    under the profiled forward), the GPU waited longer between forwards with pageable inputs, and the timed
    pageable steps were the slower. The sentences say what the run showed, or why it could not show it."""
    if not isinstance(result, dict) or not isinstance(result.get("modes"), dict):
        raise TypeError("result must be what step_loop() returned (a dict with 'modes')")
    missing = [k for k in ("forward_ms", "calibration") if k not in result] + \
              [m for m in STEP_MODES if m not in result["modes"]]
    if missing:
        raise ValueError(f"result lacks {missing}: a step_loop() result recorded before the loop was calibrated "
                         "(issue 33); re-run the GPU suite for lesson 02b")
    from ..profiler import span_stats

    mo = result["modes"]
    fwd, gap, copy = {}, {}, {}
    for m in STEP_MODES:
        f = span_stats(mo[m]["gpu"], FORWARD_LABEL)
        names = list(mo[m].get("memcpy_names") or [])
        c = span_stats(mo[m]["gpu"], names[0]) if names else None
        if f is None or f["gap_ms"] is None or c is None:
            raise ValueError(f"the {m} run's profiled spans hold fewer than two forwards or no copy: "
                             "nothing to measure between two forwards")
        fwd[m], gap[m], copy[m] = f["duration_ms"], f["gap_ms"], c["duration_ms"]
    work = {m: float(mo[m]["host_work_ms"]) for m in STEP_MODES}
    bound = {m: work[m] < fwd[m] for m in STEP_MODES}
    pag, pin = mo["pageable"], mo["pinned"]
    extra = pag["ms_per_step"] - pin["ms_per_step"]
    staged, F = copy["pageable"], result["forward_ms"]
    models = {"only the staged copy serialized": F + staged,
              "host and GPU time added up": work["pageable"] + F + staged}
    nearest = min(models, key=lambda k: abs(models[k] - pag["ms_per_step"]))
    shown = all(bound.values()) and gap["pageable"] > gap["pinned"] and extra > 0
    cal = result["calibration"]["host_work_ms"]
    out = []
    if all(bound.values()):
        out.append(f"the GPU set the pace of both loops: the host's own work per step (prepare + launch, median) took "
                   f"{_fmt(work['pageable'])} pageable / {_fmt(work['pinned'])} pinned, under a forward of "
                   f"{_fmt(fwd['pageable'])} / {_fmt(fwd['pinned'])}")
    else:
        slow = [m for m in STEP_MODES if not bound[m]]
        capped = F >= result["calibration"]["cap_ms"]
        out.append(f"this run could not show it: in the {' and '.join(slow)} loop the host's own work per step "
                   f"({', '.join(_fmt(work[m]) for m in slow)}) took longer than a forward "
                   f"({', '.join(_fmt(fwd[m]) for m in slow)}), "
                   + (f"the longest this lesson runs, while the host needed {_fmt(cal)} before the timed steps: this "
                      "host is too slow for the loop" if capped else
                      f"sized from the {_fmt(cal)} the host needed before the timed steps: the host got slower after "
                      "that (as when other work shares its cores)")
                   + ", so the host set the pace, whatever the copies did")
    if gap["pageable"] > gap["pinned"]:
        out.append(f"between two forwards the GPU waited {_fmt(gap['pageable'])} with pageable inputs (the staged copy, "
                   f"{_fmt(staged)}, and {_fmt(max(0.0, gap['pageable'] - staged))} for the host to leave copy_ and "
                   f"launch) against {_fmt(gap['pinned'])} with pinned ones (the copy, {_fmt(copy['pinned'])})")
    else:
        if not all(bound.values()):
            why = "the GPU waited for the host either way"
        elif pag["copy_host_ms"] < staged / 2:
            why = (f"the pageable copy_ returned in {_fmt(pag['copy_host_ms'])}, before its copy ({_fmt(staged)}) had "
                   "run, so this driver staged it behind the queue (lesson 02, section 1)")
        else:
            why = ("the pageable copy_ held the host, but six profiled steps are few, and work of other processes on "
                   "the GPU moves the gaps")
        out.append(f"the GPU waited no longer between two forwards with pageable inputs ({_fmt(gap['pageable'])}) "
                   f"than with pinned ones ({_fmt(gap['pinned'])}): {why}")
    if shown:
        out.append(f"pageable steps took {_fmt(extra)} longer than pinned ones ({extra / pin['ms_per_step']:.0%} more; "
                   f"the gaps account for {_fmt(gap['pageable'] - gap['pinned'])}), and the measured pageable step "
                   f"({_fmt(pag['ms_per_step'])}) came closer to '{nearest}'")
    elif extra > 0:
        out.append(f"the timed pageable steps took {_fmt(extra)} longer than pinned ones "
                   f"({extra / pin['ms_per_step']:.0%} more), but not by the GPU's wait between forwards (the gaps "
                   f"differ by {_fmt(gap['pageable'] - gap['pinned'])})")
    else:
        moved = max(max(mo[m]["round_ms_per_step"]) - min(mo[m]["round_ms_per_step"]) for m in STEP_MODES)
        predicted = gap["pageable"] - gap["pinned"]
        tail = ""
        if all(bound.values()) and predicted > 0:
            tail = (f": the {_fmt(predicted)} per step the gaps predict is "
                    + (f"within what a step moved from one timed round to the other here ({_fmt(moved)})"
                       if predicted <= moved else
                       f"more than a step moved between the timed rounds ({_fmt(moved)}): the six profiled steps "
                       "and the timed ones disagree in this run"))
        out.append(f"the timed pageable steps were not slower ({_fmt(pag['ms_per_step'])} against "
                   f"{_fmt(pin['ms_per_step'])} pinned){tail}")
    return {"shown": shown, "gpu_bound": bound, "extra_ms": extra, "gap_ms": gap, "copy_ms": copy,
            "forward_ms": fwd, "host_work_ms": work, "models": models, "nearest_model": nearest, "sentences": out}


# --- async_tensor_h2d against torch.tensor(list, device="cuda") ----------------------------------

ASYNC_H2D_OPS = {
    "factory": "torch.tensor(data, device='cuda')",
    "pageable_nb": "torch.tensor(data).to('cuda', non_blocking=True)",
    "async": "pinlab.async_tensor_h2d(data)",
}


def async_h2d_cost(list_len: int = 4096, busy_ms: float = 20.0, repeat: int = 10) -> dict:
    """Host ms to get a Python list of ``list_len`` ints onto the GPU, three ways
    (:data:`ASYNC_H2D_OPS`), behind a busy GPU and idle; do all three give the same tensor?
    Returns ``{"busy_ms", "list_len", "rows": [{"key", "op", "host_ms", "idle_ms", "blocked"}],
    "same_values"}``.
    """
    list_len = positive_int("list_len", list_len)
    busy_ms = positive_number("busy_ms", busy_ms)
    repeat = positive_int("repeat", repeat)
    require_cuda("async_h2d_cost()")
    from ..h2d import async_tensor_h2d

    data = list(range(list_len))
    calls = {
        "factory": lambda: torch.tensor(data, device="cuda"),
        "pageable_nb": lambda: torch.tensor(data).to("cuda", non_blocking=True),
        "async": lambda: async_tensor_h2d(data),
    }
    warmup(_busy(1.0), *calls.values())
    rows = _blocked_rows(calls, ASYNC_H2D_OPS, busy_ms, repeat)
    gpu_busy(busy_ms)
    results = [fn() for fn in calls.values()]
    torch.cuda.synchronize()
    same = all(r.dtype == results[0].dtype and bool(torch.equal(r, results[0])) for r in results)
    del results
    return {"busy_ms": busy_ms, "list_len": list_len, "rows": rows, "same_values": bool(same)}


# --- the stall detector on the notebook's demo_step -----------------------------------------------

SYNC_WARNING = "synchronizing CUDA operation"


def _sync_debug_warnings(fn) -> int:
    """How many "called a synchronizing CUDA operation" warnings ``fn()`` raises under
    ``torch.cuda.set_sync_debug_mode("warn")``."""
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()
    return sum(SYNC_WARNING in str(w.message) for w in caught)


COMPARE_OPS = {
    "pageable_copy": "inputs_gpu.copy_(inputs_cpu, non_blocking=True)  # pageable",
    "tensor_list": "torch.tensor([step] * 64, device='cuda')",
    "item": "loss.item()",
}


def detector_demo(step_fn, steps: int = 20, gpu_ms: float = 0.5, features: int = 256, repeat: int = 5) -> dict:
    """:func:`pinlab.detect_stalls` on the notebook's ``step_fn(step, weights, inputs_cpu,
    inputs_gpu, gpu_ms)`` (holding the fragments of :data:`DEMO_STALLS`): ``steps`` steps under
    the detector (report; lines inside ``step_fn``, :func:`stall_lines`); host time with and
    without it, alternating, ``repeat`` times; each stalling call alone under
    ``torch.cuda.set_sync_debug_mode("warn")`` and under the detector. Returns ``{"steps",
    "counts", "total", "events" (the first 12, as dicts), "summary", "stall_lines",
    "expected_lines", "plain_ms", "detected_ms" (Stats dicts), "compare": [{"key", "op",
    "sync_debug_warnings", "detector_events"}]}``.
    """
    callable_arg("step_fn", step_fn)
    steps = positive_int("steps", steps)
    gpu_ms = positive_number("gpu_ms", gpu_ms)
    features = positive_int("features", features)
    repeat = positive_int("repeat", repeat)
    expected = {kind: [line] for kind, line in source_lines(step_fn).items()}
    require_cuda("detector_demo()")
    from ..detector import detect_stalls

    weights = torch.randn(features, features, device="cuda") / features
    inputs_cpu = torch.randn(features, features)  # pageable
    inputs_gpu = torch.empty(features, features, device="cuda")

    def loop():
        for step in range(steps):
            step_fn(step, weights, inputs_cpu, inputs_gpu, gpu_ms)
        torch.cuda.synchronize()

    def loop_detected():
        with detect_stalls():
            loop()

    warmup(_busy(1.0), loop, loop_detected)
    with detect_stalls(max_events=None) as report:
        loop()
    plain, detected = [], []
    for _ in range(repeat):
        plain.append(wall_ms(loop))
        detected.append(wall_ms(loop_detected))

    loss = torch.ones((), device="cuda")
    ops = {
        "pageable_copy": lambda: inputs_gpu.copy_(inputs_cpu, non_blocking=True),
        "tensor_list": lambda: torch.tensor([1] * 64, device="cuda"),
        "item": lambda: loss.item(),
    }
    compare = []
    for key, fn in ops.items():
        warns = _sync_debug_warnings(fn)
        with detect_stalls() as r:
            fn()
        torch.cuda.synchronize()
        compare.append({"key": key, "op": COMPARE_OPS[key], "sync_debug_warnings": warns,
                        "detector_events": r.total})
    events = [e.as_dict() for e in report.events]
    return {
        "steps": steps,
        "counts": dict(sorted(report.counts.items())),
        "total": report.total,
        "events": events[:12],
        "summary": report.summary(),
        "stall_lines": stall_lines(events, step_fn),
        "expected_lines": expected,
        "plain_ms": Stats.of(plain).as_dict(),
        "detected_ms": Stats.of(detected).as_dict(),
        "compare": compare,
    }


# --- copy/compute overlap: a copy stream ----------------------------------------------------------

#: The overlap experiment's loops: key -> what the notebook calls it. "copy stream" runs the notebook's
#: ``copy_stream_steps`` (with ``record_stream``); "one stream" its ``one_stream_steps``.
OVERLAP_MODES = {
    "one_stream_pinned": "one stream, pinned inputs",
    "copy_stream_pinned": "copy stream, pinned inputs",
    "copy_stream_pageable": "copy stream, pageable inputs",
}
COMPUTE_LABEL = "compute (kernel)"
OVERLAP_TRACE = "build/traces/02_overlap.json"
MEMCPY_PREFIX = "Memcpy"


def _gpu_spans(name: str, spans) -> list:
    if isinstance(spans, (str, bytes, dict)) or not hasattr(spans, "__iter__"):
        raise TypeError(f"{name} must be a list of [start, end, label] spans, got {type(spans).__name__}")
    spans = list(spans)
    for i, s in enumerate(spans):
        if isinstance(s, (str, bytes)) or not hasattr(s, "__len__") or len(s) != 3 or not isinstance(s[2], str):
            raise TypeError(f"{name}[{i}] must be [start, end, label] with a str label, got {s!r}"[:200])
    merge_spans([(s[0], s[1]) for s in spans])  # finite numbers, end >= start (errors name the span)
    return spans


def overlap_lanes(gpu_spans, kernel_label: str = COMPUTE_LABEL) -> dict:
    """The GPU spans of one profiled run split into two timeline lanes: ``{"compute": kernels
    (label ``kernel_label``), "copies": memcpys (label starting with "Memcpy")}``; others dropped."""
    spans = _gpu_spans("gpu_spans", gpu_spans)
    return {"compute": [list(s) for s in spans if s[2] == kernel_label],
            "copies": [list(s) for s in spans if s[2].startswith(MEMCPY_PREFIX)]}


def copy_overlap(gpu_spans, kernel_label: str = COMPUTE_LABEL, min_ms: float = 0.005) -> dict:
    """How much of each copy ran while a kernel ran, from one profiled run's GPU spans
    (``[start_ms, end_ms, label]``; kernels labelled ``kernel_label``, copies "Memcpy ...").
    A copy *overlapped* when at least ``min_ms`` of it ran beside a kernel (the profiler's
    timestamps of two operations one after the other on one stream may touch, never more).
    Returns ``{"copies", "overlapping", "copy_ms", "overlapped_ms", "share"}`` (``share`` = the
    overlapped part of all copy time, ``None`` without copies)."""
    lanes = overlap_lanes(gpu_spans, kernel_label)
    min_ms = positive_number("min_ms", min_ms, allow_zero=True)
    kernels = merge_spans([(s[0], s[1]) for s in lanes["compute"]])
    copy_ms = overlapped_ms = 0.0
    overlapping = 0
    for a, b, _ in lanes["copies"]:
        both = sum(max(0.0, min(b, k1) - max(a, k0)) for k0, k1 in kernels)
        copy_ms += b - a
        overlapped_ms += both
        overlapping += both >= min_ms and both > 0
    n = len(lanes["copies"])
    return {"copies": n, "overlapping": int(overlapping), "copy_ms": round(copy_ms, 4),
            "overlapped_ms": round(overlapped_ms, 4), "share": overlapped_ms / copy_ms if copy_ms > 0 else None}


def wrong_steps(values, expected) -> int:
    """How many steps' results differ from the expected ones (both lists of ints, one per step)."""
    for name, v in (("values", values), ("expected", expected)):
        if isinstance(v, (str, bytes, dict)) or not hasattr(v, "__iter__"):
            raise TypeError(f"{name} must be a list of ints, one per step, got {type(v).__name__}")
    values, expected = list(values), list(expected)
    if len(values) != len(expected):
        raise ValueError(f"values and expected must have one entry per step, got {len(values)} and {len(expected)}")
    return sum(a != b for a, b in zip(values, expected))


def plot_overlap(modes: dict, *, title: str, keys=None):
    """One timeline per mode of :func:`overlap_loop` (``result["modes"]``): its profiled GPU spans
    in a "compute" and a "copies" lane (:func:`overlap_lanes`). Returns the figure."""
    from ..plots import subplots, timeline

    if not isinstance(modes, dict) or not modes:
        raise TypeError("modes must be overlap_loop()'s non-empty 'modes' dict")
    keys = list(modes) if keys is None else list(keys)
    for k in keys:
        if k not in modes or not isinstance(modes[k], dict) or "gpu" not in modes[k]:
            raise ValueError(f"keys: {k!r} is not a mode with profiled 'gpu' spans in modes")
    fig, axes = subplots(len(keys), 1, figsize=(MAX_WIDTH_IN, 2.1 * len(keys) + 0.6), squeeze=False)
    for ax, k in zip(axes[:, 0], keys):  # each run on its own time axis: a slow one would squash the others
        timeline(overlap_lanes(modes[k]["gpu"]), title=OVERLAP_MODES.get(k, k), ax=ax)
        for bars in ax.collections:  # a thin edge shows where one kernel (or copy) ends and the next begins
            bars.set_edgecolor("white")
            bars.set_linewidth(0.6)
    fig.suptitle(title)
    return fig


def overlap_loop(one_stream_fn, copy_stream_fn, compute_fn, steps: int = 40, rounds: int = 3,
                 input_bytes: int = 16 * MiB, n_inputs: int = 4, compute_ms: float = 0.5,
                 profile_steps: int = 6, trace: str = OVERLAP_TRACE) -> dict:
    """The same step loop on one stream and with a copy stream (:data:`OVERLAP_MODES`).

    The notebook's functions: ``one_stream_fn(inputs, out, compute)`` and ``copy_stream_fn(inputs,
    out, compute, copy_stream, record=True)`` copy ``inputs[i]`` (host tensors of ``input_bytes``
    uint8, ``n_inputs`` distinct ones in turn) to the GPU with ``non_blocking=True`` and call
    ``compute(x_gpu, out[i])``; ``compute_fn(x, out_i, ms)`` keeps the GPU busy ``ms`` and writes
    ``x``'s sum into ``out_i``. Each mode: warmed up, then ``steps`` steps timed in ``rounds``
    interleaved rounds (every step's sum checked exactly), then ``profile_steps`` steps under the
    profiler (:func:`pinlab.profiler.profile_runs`, trace to ``trace``). Last, once: the copy
    stream without ``record_stream`` (``record=False``), results checked.

    Returns ``{"input_bytes", "compute_ms", "steps", "rounds", "trace_file", "spans_from",
    "modes": {key: {"ms_per_step" (median of rounds), "steps_per_s", "round_ms_per_step",
    "wrong_steps" (over all rounds), "window_ms", "gpu", "memcpy_names", "gpu_idle_share",
    "overlap" (:func:`copy_overlap`)}}, "no_record_stream": {"steps", "wrong_steps"}}``.
    """
    callable_arg("one_stream_fn", one_stream_fn)
    callable_arg("copy_stream_fn", copy_stream_fn)
    callable_arg("compute_fn", compute_fn)
    steps = positive_int("steps", steps, maximum=1000)
    rounds = positive_int("rounds", rounds, maximum=20)
    input_bytes = positive_int("input_bytes", input_bytes, maximum=256 * MiB)
    n_inputs = positive_int("n_inputs", n_inputs, maximum=16)
    if n_inputs < 2:
        raise ValueError(f"n_inputs must be >= 2 (neighbouring steps need different inputs), got {n_inputs}")
    compute_ms = positive_number("compute_ms", compute_ms, maximum=100.0)
    profile_steps = positive_int("profile_steps", profile_steps, maximum=100)
    trace_path(trace)
    require_cuda("overlap_loop()")
    gen = torch.Generator().manual_seed(0)
    pinned = [torch.randint(0, 256, (input_bytes,), dtype=torch.uint8, generator=gen).pin_memory()
              for _ in range(n_inputs)]
    pageable = [p.clone() for p in pinned]
    sums = [int(p.sum()) for p in pinned]
    sources = {"one_stream_pinned": pinned, "copy_stream_pinned": pinned, "copy_stream_pageable": pageable}
    copy_stream = torch.cuda.Stream()

    def compute(x, out_i):
        compute_fn(x, out_i, compute_ms)

    def run(mode, n, record=True):
        """n steps of ``mode``, then the per-step sums (host waits at the end, untimed by callers)."""
        out = torch.zeros(n, dtype=torch.int64, device="cuda")
        inputs = [sources[mode][i % n_inputs] for i in range(n)]
        if mode.startswith("one_stream"):
            one_stream_fn(inputs, out, compute)
        else:
            copy_stream_fn(inputs, out, compute, copy_stream, record=record)
        return out

    def expected(n):
        return [sums[i % n_inputs] for i in range(n)]

    warmup(_busy(1.0), *[lambda m=m: run(m, 3) for m in OVERLAP_MODES])
    def one_round(m, _r):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = run(m, steps)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3 / steps, wrong_steps(out.tolist(), expected(steps))

    # the order rotates each round, so that a slow spell of the machine falls on every mode, not on one
    got = interleaved(list(OVERLAP_MODES), rounds, one_round, desc="one stream vs a copy stream")
    per_step = {m: [ms for ms, _ in got[m]] for m in OVERLAP_MODES}
    wrong = {m: sum(w for _, w in got[m]) for m in OVERLAP_MODES}
    modes = {}
    for m in OVERLAP_MODES:
        ms = statistics.median(per_step[m])
        modes[m] = {"ms_per_step": ms, "steps_per_s": 1e3 / ms, "round_ms_per_step": per_step[m],
                    "wrong_steps": wrong[m]}
    names = {m: f"run: {OVERLAP_MODES[m]}" for m in OVERLAP_MODES}
    def profiled(mode):  # the sync keeps all of the run's GPU work inside its annotation's window
        run(mode, profile_steps)
        torch.cuda.synchronize()

    runs = {names[m]: (lambda span, m=m: profiled(m)) for m in OVERLAP_MODES}
    spans, spans_from = profile_runs(runs, trace, kernel_label=COMPUTE_LABEL)
    for m in OVERLAP_MODES:
        s = _with_kernel(spans[names[m]], COMPUTE_LABEL, m, trace)
        modes[m].update({"window_ms": s["window_ms"], "gpu": s["gpu"], "memcpy_names": s["memcpy_names"],
                         "gpu_idle_share": gpu_kernel_idle_share(s, COMPUTE_LABEL),
                         "overlap": copy_overlap(s["gpu"])})
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # start from an empty pool: each freed input's block is the next one handed out
    out = run("copy_stream_pinned", steps, record=False)
    torch.cuda.synchronize()
    race = {"steps": steps, "wrong_steps": wrong_steps(out.tolist(), expected(steps))}
    del pinned, pageable, sources, out
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # the copy stream's run-ahead allocated one input per step in flight
    return {"input_bytes": input_bytes, "compute_ms": compute_ms, "steps": steps, "rounds": rounds,
            "trace_file": trace, "spans_from": spans_from, "modes": modes, "no_record_stream": race}


# --- many tensors: one sync for all, or one wait per copy -----------------------------------------

MANY_VARIANTS = {
    "pinned_blocking_ms": "pinned, copy_ each (blocking)",
    "pinned_nb_sync_ms": "pinned, non_blocking + one sync",
    "pageable_blocking_ms": "pageable, copy_ each (blocking)",
    "pageable_nb_sync_ms": "pageable, non_blocking + one sync",
}


def _cases(cases) -> list[tuple[int, int]]:
    if isinstance(cases, (str, bytes, dict)) or not hasattr(cases, "__iter__"):
        raise TypeError(f"cases must be a list of [n_tensors, bytes] pairs, got {type(cases).__name__}")
    out = []
    for i, c in enumerate(cases):
        if isinstance(c, (str, bytes)) or not hasattr(c, "__len__") or len(c) != 2:
            raise TypeError(f"cases[{i}] must be a [n_tensors, bytes] pair, got {c!r}"[:200])
        n = positive_int(f"cases[{i}] n_tensors", c[0], maximum=4096)
        nbytes = positive_int(f"cases[{i}] bytes", c[1])
        if n * nbytes > 256 * MiB:
            raise ValueError(f"cases[{i}] copies {n} x {nbytes} bytes; keep a case within 256 MiB")
        out.append((n, nbytes))
    if not out:
        raise ValueError("cases must not be empty")
    return out


def many_tensors(copy_each_blocking, copy_all_then_sync, cases=((64, 4 * KiB), (64, 64 * KiB), (64, MiB)),
                 repeat: int = 7) -> dict:
    """N host tensors to N GPU tensors, the two ways the notebook defines: ``copy_each_blocking(dsts,
    srcs)`` (one blocking ``copy_`` each) and ``copy_all_then_sync(dsts, srcs)`` (``non_blocking``
    each, then one ``torch.cuda.synchronize()``), from pinned and from pageable tensors
    (:data:`MANY_VARIANTS`). The GPU is idle at the start of each timed call; host ms, median of
    ``repeat`` interleaved tries. Every variant's data is checked once, exactly. Returns
    ``{"rows": [{"n", "bytes", <variant>: ms..., "data_ok"}]}``.
    """
    callable_arg("copy_each_blocking", copy_each_blocking)
    callable_arg("copy_all_then_sync", copy_all_then_sync)
    cases = _cases(cases)
    repeat = positive_int("repeat", repeat, maximum=100)
    require_cuda("many_tensors()")
    rows = []
    for n, nbytes in progress(cases, desc="many tensors"):
        pageable = [torch.full((nbytes,), j % 251, dtype=torch.uint8) for j in range(n)]
        srcs = {"pinned": [t.pin_memory() for t in pageable], "pageable": pageable}
        dsts = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(n)]
        fns = {"pinned_blocking_ms": lambda: copy_each_blocking(dsts, srcs["pinned"]),
               "pinned_nb_sync_ms": lambda: copy_all_then_sync(dsts, srcs["pinned"]),
               "pageable_blocking_ms": lambda: copy_each_blocking(dsts, srcs["pageable"]),
               "pageable_nb_sync_ms": lambda: copy_all_then_sync(dsts, srcs["pageable"])}
        ok = True
        for fn in fns.values():  # warm-up, and the exact check: every byte of every tensor arrived
            for d in dsts:
                d.zero_()
            fn()
            torch.cuda.synchronize()
            ok = ok and all(bool(torch.equal(d.cpu(), s)) for d, s in zip(dsts, pageable))
        times = {k: [] for k in fns}
        for _ in range(repeat):
            for k, fn in fns.items():
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                times[k].append((time.perf_counter() - t0) * 1e3)
                torch.cuda.synchronize()
        rows.append({"n": n, "bytes": nbytes, **{k: statistics.median(v) for k, v in times.items()},
                     "data_ok": bool(ok)})
        del pageable, srcs, dsts
    torch.cuda.synchronize()
    return {"rows": rows}


def plot_many_tensors(rows, *, title: str):
    """Grouped bars of :func:`many_tensors`'s rows: host ms per case and variant (log scale)."""
    from ..plots import color_for, fmt_bytes, legend_outside, subplots

    if isinstance(rows, (str, bytes, dict)) or not hasattr(rows, "__iter__") or not list(rows):
        raise TypeError("rows must be many_tensors()'s non-empty list of rows")
    rows = list(rows)
    for i, r in enumerate(rows):
        if not isinstance(r, dict) or not {"n", "bytes", *MANY_VARIANTS} <= set(r):
            raise ValueError(f"rows[{i}] must hold 'n', 'bytes' and {sorted(MANY_VARIANTS)}")
    fig, ax = subplots(figsize=(MAX_WIDTH_IN, 4))
    width = 0.8 / len(MANY_VARIANTS)
    for j, (key, label) in enumerate(MANY_VARIANTS.items()):
        ax.bar([i + (j - 1.5) * width for i in range(len(rows))], [r[key] for r in rows], width, label=label,
               color=color_for(label))
    ax.set_xticks(range(len(rows)), [f"{r['n']} x {fmt_bytes(r['bytes'])}" for r in rows])
    ax.set(yscale="log", ylabel="host ms for all copies", title=title)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    legend_outside(ax, ncols=2)
    return fig


def copy_engines(copy_on=None, nbytes: int = 256 * MiB, reps: int = 5) -> dict:
    """How many copy engines the GPU has (``asyncEngineCount``, from :mod:`pinlab.probe`) and what they do
    with pinned copies of ``nbytes``: H2D alone, D2H alone, H2D and D2H at once on two streams, and two H2D at
    once on two streams. GB/s (for the pairs: both copies' bytes over the pair's time), medians of ``reps``.
    With two or more engines H2D and D2H can overlap; two copies in one direction share one engine and the
    link, so they cannot add up. ``copy_on(stream, dst, src)`` queues one copy on a stream (the notebook's;
    default: ``dst.copy_(src, non_blocking=True)`` inside ``torch.cuda.stream(stream)``). CUDA only."""
    if copy_on is not None:
        callable_arg("copy_on", copy_on)
    nbytes = positive_int("nbytes", nbytes, maximum=4 * GiB)
    reps = positive_int("reps", reps, maximum=100)
    require_cuda("copy_engines()")
    from ..probe import platform_facts

    engines = platform_facts().get("copy_engines")
    h1 = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    h2 = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    d1 = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    d2 = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def h2d(stream, dst, src):
        if copy_on is not None:
            return copy_on(stream, dst, src)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    cases = {
        "H2D alone": (lambda: h2d(s1, d1, h1), 1),
        "D2H alone": (lambda: h2d(s2, h2, d2), 1),
        "H2D and D2H at once": (lambda: (h2d(s1, d1, h1), h2d(s2, h2, d2)), 2),
        "two H2D at once": (lambda: (h2d(s1, d1, h1), h2d(s2, d2, h2)), 2),
    }
    for fn, _ in cases.values():
        fn()
    torch.cuda.synchronize()
    times = {k: [] for k in cases}
    for _ in range(reps):  # interleaved: every case once per round
        for k, (fn, _) in cases.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times[k].append(time.perf_counter() - t0)
    rows = [{"case": k, "gbps": n * nbytes / statistics.median(times[k]) / 1e9,
             "round_gbps": [n * nbytes / t / 1e9 for t in times[k]]} for k, (_, n) in cases.items()]
    del h1, h2, d1, d2
    return {"nbytes": nbytes, "copy_engines": engines, "rows": rows}


#: The PyTorch tutorial's matrix ("A guide on good usage of non_blocking and pin_memory()"): how the host
#: memory is obtained × how the copy is called.


def engine_rates(result: dict) -> dict:
    """``{case: GB/s}`` of a :func:`copy_engines` result, checked: the four cases, each a positive number."""
    if not isinstance(result, dict) or not isinstance(result.get("rows"), list):
        raise TypeError("result must be the dict copy_engines() returns (with 'rows')")
    rates = {r.get("case"): r.get("gbps") for r in result["rows"] if isinstance(r, dict)}
    want = ("H2D alone", "D2H alone", "H2D and D2H at once", "two H2D at once")
    missing = [k for k in want if k not in rates]
    if missing:
        raise ValueError(f"result['rows'] lacks the case(s) {missing}")
    return {k: positive_number(f"the GB/s of {k!r}", rates[k]) for k in want}


def engines_sentence(result: dict) -> str:
    """What a :func:`copy_engines` run shows, in words, decided by its numbers (and the engine count)."""
    r = engine_rates(result)
    alone = max(r["H2D alone"], r["D2H alone"])
    both, two = r["H2D and D2H at once"] / alone, r["two H2D at once"] / r["H2D alone"]
    engines = result.get("copy_engines")
    count = ("the GPU reports an unknown number of copy engines" if engines is None
             else f"the GPU reports {engines} copy engine{'s' if engines != 1 else ''} (asyncEngineCount)")
    if both >= 1.5:
        dirs = (f"H2D and D2H at once moved {both:.2f}x the bytes per second of either alone: the two directions "
                "ran side by side")
    elif both >= 1.1:
        dirs = (f"H2D and D2H at once moved only {both:.2f}x the bytes per second of either alone: they "
                "overlapped in part")
    else:
        dirs = (f"H2D and D2H at once moved {both:.2f}x the bytes per second of either alone: they took turns "
                "(one copy engine, or a link or host that could not serve both)")
    same = (f"two H2D at once moved {two:.2f}x one H2D: " +
            ("no more than one copy, as one copy already fills the link in that direction" if two < 1.25
             else "more than one copy alone: one copy did not fill the link here"))
    return f"{count}; {dirs}; {same}"
