"""Reading ``torch.profiler`` traces: host and GPU spans, their unions, idle shares.

Shared machinery for every lesson that profiles a loop:

* spans: :func:`merge_spans`, :func:`covered`, :func:`idle_share` (the share of a window in which
  no span is active; lesson 02's exercise ``gpu_idle_share`` is checked against it),
  :func:`span_stats` (durations, periods and gaps of the spans with one label);
* traces: :func:`load_trace_events` (a Chrome trace written by ``prof.export_chrome_trace``),
  :func:`events_from_profiler` (the same from ``prof.events()``, the fallback),
  :func:`trace_runs` (split a trace into runs marked by ``record_function`` annotations and turn
  each into host and GPU spans), :func:`gpu_kernel_idle_share`;
* :func:`profile_runs` (GPU): run a few functions under the profiler, one annotated run each,
  write the trace under the repository (:func:`trace_path`) and read it back into spans.

Everything except :func:`profile_runs` is pure Python, tested on the CPU with synthetic traces.
"""
from __future__ import annotations

import contextlib
import json
import math
import numbers
import statistics
import time
from pathlib import Path, PurePosixPath

from .args import callable_arg, positive_number
from .device import require_cuda

# --- spans ----------------------------------------------------------------------------------------


def _finite(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise TypeError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _span_pairs(spans) -> list[tuple[float, float]]:
    if isinstance(spans, (str, bytes)) or not hasattr(spans, "__iter__"):
        raise TypeError(f"spans must be a list of (start, end) pairs, got {type(spans).__name__}")
    out = []
    for i, s in enumerate(spans):
        if isinstance(s, (str, bytes)) or not hasattr(s, "__len__") or len(s) not in (2, 3):
            raise TypeError(f"spans[{i}] must be (start, end) or (start, end, label), got {s!r}")
        start, end = _finite(f"spans[{i}] start", s[0]), _finite(f"spans[{i}] end", s[1])
        if end < start:
            raise ValueError(f"spans[{i}] ends before it starts ({start} > {end})")
        out.append((start, end))
    return out


def merge_spans(spans) -> list[tuple[float, float]]:
    """The union of spans as sorted, non-overlapping ``(start, end)`` pairs (touching spans merge)."""
    merged: list[list[float]] = []
    for start, end in sorted(_span_pairs(spans)):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _window(start, end) -> tuple[float, float]:
    start, end = _finite("start", start), _finite("end", end)
    if end <= start:
        raise ValueError(f"end must be after start, got start={start}, end={end}")
    return start, end


def covered(spans, start, end) -> float:
    """Length of ``[start, end]`` covered by at least one span (overlaps counted once)."""
    start, end = _window(start, end)
    return sum(max(0.0, min(b, end) - max(a, start)) for a, b in merge_spans(spans))


def idle_share(spans, start, end) -> float:
    """Share of the window ``[start, end]`` in which no span is active (0 = always busy, 1 = never).

    Spans may overlap (counted once), come in any order and stick out of the window (only the
    part inside counts). The reference answer of lesson 02's exercise ``gpu_idle_share``.
    """
    start, end = _window(start, end)
    return 1.0 - covered(spans, start, end) / (end - start)


def span_stats(spans, label: str) -> dict | None:
    """Medians over the spans named ``label`` (``[start, end, label]``), in their time order:
    ``{"n", "duration_ms", "period_ms", "gap_ms"}``: duration, start-to-start and end-to-next-start
    (the idle time between them; negative when they overlap). ``period_ms``/``gap_ms`` are
    ``None`` with fewer than two spans; the whole result is ``None`` with none."""
    spans = list(spans) if not isinstance(spans, (str, bytes)) and hasattr(spans, "__iter__") else spans
    pairs = _span_pairs(spans)
    picked = sorted(p for p, s in zip(pairs, spans) if len(s) == 3 and s[2] == label)
    if not picked:
        return None
    pairs = list(zip(picked, picked[1:]))  # consecutive spans
    return {
        "n": len(picked),
        "duration_ms": statistics.median(b - a for a, b in picked),
        "period_ms": statistics.median(n[0] - p[0] for p, n in pairs) if pairs else None,
        "gap_ms": statistics.median(n[0] - p[1] for p, n in pairs) if pairs else None,
    }


def median_span_ms(spans, label: str) -> float | None:
    """Median duration of the spans named ``label`` (``None`` if there is none)."""
    stats = span_stats(spans, label)
    return None if stats is None else stats["duration_ms"]


# --- reading a torch.profiler trace ---------------------------------------------------------------

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


class TraceFileNotFoundError(FileNotFoundError):
    """:func:`load_trace_events` was given the path of a file that does not exist (the message names it)."""


def load_trace_events(path) -> list[dict]:
    """The events of a Chrome trace written by ``prof.export_chrome_trace(path)``.

    A missing file is a :class:`TraceFileNotFoundError` (a ``FileNotFoundError``) naming ``path``;
    a file that is not JSON is a ``ValueError`` naming it."""
    if not (isinstance(path, str) or hasattr(path, "__fspath__")) or not str(path):
        raise TypeError(f"path must be the path of a Chrome trace (a str or pathlib.Path), got {path!r}"[:200])
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TraceFileNotFoundError(f"path {str(path)!r}: no such trace file (write it first with "
                                     "prof.export_chrome_trace(path))") from None
    except IsADirectoryError:
        raise ValueError(f"path {str(path)!r} is a directory, not a Chrome trace file") from None
    except UnicodeDecodeError:
        raise ValueError(f"path {str(path)!r} is not a Chrome trace (not UTF-8 text)") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"path {str(path)!r} is not a Chrome trace (not JSON: {exc})") from None
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise ValueError(f"{path} holds no list of trace events")
    return [e for e in events if isinstance(e, dict)]


def _category(e) -> str:
    """'gpu' for a kernel, memcpy or memset; 'skip' for other device-side events (for example
    ``gpu_user_annotation``, the GPU-side shadow of a ``record_function``); 'host' otherwise."""
    cat = str(e.get("cat", "")).lower()
    if cat in GPU_CATEGORIES:
        return "gpu"
    if cat.startswith("gpu_") or cat in ("ac2g", "flow"):
        return "skip"
    return "host"


def trace_runs(events, run_names, host_names, *, kernel_label: str = "kernel", gpu_skew_ms: float = 5.0) -> dict:
    """Split a profiler trace into runs and turn each into host and GPU spans.

    ``events``: Chrome-trace events (dicts with ``ph``, ``cat``, ``name``, ``ts`` and ``dur`` in
    µs), as :func:`load_trace_events` returns them. ``run_names``: ``{run: annotation name}``;
    each run is the window of the host annotation (``record_function``) of that name.
    ``host_names``: the annotation names that become host spans.

    Returns ``{run: {"window_ms", "host": [[start, end, name]...], "gpu": [[start, end, label]...],
    "memcpy_names": {name: count}}}``, times in ms from the start of the run's window. A GPU
    span is a kernel (labelled ``kernel_label``), a memcpy or a memset (labelled with its trace
    name, e.g. ``"Memcpy HtoD (Pinned -> Device)"``); it belongs to the run whose window holds
    its start or, if none does, to the nearest window within ``gpu_skew_ms`` (the profiler
    converts GPU timestamps to the CPU's clock; a small skew must not drop a span).
    """
    if isinstance(events, (str, bytes)) or not hasattr(events, "__iter__"):
        raise TypeError(f"events must be a list of trace events (dicts), got {type(events).__name__}")
    if not isinstance(run_names, dict) or not run_names:
        raise TypeError("run_names must be a non-empty dict {run: annotation name}")
    host_names = set(host_names)
    spans = []
    for i, e in enumerate(events):
        if not isinstance(e, dict) or e.get("ph") != "X":
            continue
        try:
            ts, dur = float(e["ts"]), float(e.get("dur", 0.0))
        except (KeyError, TypeError, ValueError):
            continue
        if not (math.isfinite(ts) and math.isfinite(dur)) or dur < 0:
            raise ValueError(f"events[{i}] ({str(e.get('name', ''))[:60]!r}) must have a finite ts and a "
                             f"dur >= 0, got ts={e['ts']!r}, dur={e.get('dur', 0.0)!r}")
        where = _category(e)
        if where == "skip":
            continue
        spans.append((ts, ts + dur, str(e.get("name", "")), where == "gpu", str(e.get("cat", "")).lower()))
    skew_us = positive_number("gpu_skew_ms", gpu_skew_ms, allow_zero=True) * 1e3
    windows = {}
    for run, ann in run_names.items():
        found = [(a, b) for a, b, name, gpu, _ in spans if name == ann and not gpu]
        if not found:
            raise ValueError(f"the trace holds no host annotation named {ann!r} (run {run!r})")
        windows[run] = found[0]

    def gpu_run(a):
        dist = {run: max(w0 - a, a - w1, 0.0) for run, (w0, w1) in windows.items()}
        best = min(dist, key=dist.get)
        return best if dist[best] <= skew_us else None

    out = {}
    for run, (w0, w1) in windows.items():
        host, gpu, names = [], [], {}
        for a, b, name, is_gpu, cat in spans:
            if (gpu_run(a) != run) if is_gpu else not (w0 <= a <= w1):
                continue
            rel = [round((a - w0) / 1e3, 4), round((b - w0) / 1e3, 4)]
            if is_gpu:
                label = kernel_label if cat == "kernel" else name
                gpu.append(rel + [label])
                if cat == "gpu_memcpy":
                    names[name] = names.get(name, 0) + 1
            elif name in host_names:
                host.append(rel + [name])
        host.sort()
        gpu.sort()
        out[run] = {"window_ms": round((w1 - w0) / 1e3, 4), "host": host, "gpu": gpu, "memcpy_names": names}
    return out


def gpu_kernel_idle_share(run: dict, kernel_label: str = "kernel") -> float | None:
    """Share of a run's GPU window (first GPU span start to last GPU span end) with no kernel running.

    Copies do not count as work: a GPU that only waits for an input copy is idle. ``None`` when
    the run has no GPU span.
    """
    if not isinstance(run, dict) or "gpu" not in run:
        raise TypeError("run must be one run of trace_runs(): a dict with a 'gpu' list")
    gpu = run["gpu"]
    if isinstance(gpu, (str, bytes)) or not hasattr(gpu, "__iter__"):
        raise TypeError(f"run['gpu'] must be a list of [start, end, label] spans, got {type(gpu).__name__}")
    gpu = list(gpu)
    for i, s in enumerate(gpu):
        if isinstance(s, (str, bytes)) or not hasattr(s, "__len__") or len(s) != 3:
            raise TypeError(f"run['gpu'][{i}] must be a [start, end, label] span, got {s!r}"[:200])
        a, b = _finite(f"run['gpu'][{i}] start", s[0]), _finite(f"run['gpu'][{i}] end", s[1])
        if b < a:
            raise ValueError(f"run['gpu'][{i}] ends before it starts ({a} > {b})")
    if not gpu:
        return None
    start, end = min(s[0] for s in gpu), max(s[1] for s in gpu)
    if end <= start:
        return None
    return idle_share([s for s in gpu if s[2] == kernel_label], start, end)


def events_from_profiler(prof, annotations) -> list[dict]:
    """Chrome-trace-like dicts from ``prof.events()`` (the fallback if the JSON cannot be read).
    ``annotations``: the ``record_function`` names used (their GPU-side shadows are not kernels)."""
    import torch

    out = []
    annotations = set(annotations)
    cuda_type = getattr(torch.autograd.DeviceType, "CUDA", None)
    for e in prof.events():
        start, end = e.time_range.start, e.time_range.end
        on_gpu = cuda_type is not None and getattr(e, "device_type", None) == cuda_type
        if on_gpu:
            if e.name in annotations:
                cat = "gpu_user_annotation"
            elif e.name.startswith("Memcpy"):
                cat = "gpu_memcpy"
            elif e.name.startswith("Memset"):
                cat = "gpu_memset"
            else:
                cat = "kernel"
        else:
            cat = "user_annotation"
        out.append({"ph": "X", "cat": cat, "name": e.name, "ts": start, "dur": end - start})
    return out


# --- profiling a few runs (GPU) -------------------------------------------------------------------


def trace_path(trace: str) -> Path:
    """Where a trace goes: ``trace`` is a path relative to the repository root, ending in ``.json``
    (for example ``"build/traces/02_step_loop.json"``)."""
    if not isinstance(trace, str) or not trace:
        raise TypeError(f"trace must be a relative path such as 'build/traces/x.json', got {trace!r}")
    p = PurePosixPath(trace)
    if p.is_absolute() or ".." in p.parts or p.suffix != ".json":
        raise ValueError(f"trace must be a relative path inside the repository ending in .json, "
                         f"such as 'build/traces/x.json', got {trace!r}")
    from .replay import repo_root

    return repo_root().joinpath(*p.parts)


def _no_span(name):
    return contextlib.nullcontext(name)


def profile_runs(runs: dict, trace: str, *, kernel_label: str = "kernel", warm: bool = True,
                 gap_s: float = 0.02) -> tuple[dict, str]:
    """Run each ``fn(span)`` of ``runs`` (``{annotation: fn}``) once under ``torch.profiler`` (CPU +
    CUDA), inside ``record_function(annotation)``, and read the trace back into spans.

    ``fn`` marks its host spans with ``with span("name"):`` and must leave the GPU idle when it
    returns (synchronize). With ``warm`` each ``fn`` first runs once, unrecorded (``span`` does
    nothing), so that the profiler's own start-up does not land in a recorded run; runs are kept
    ``gap_s`` apart. The trace is written to ``trace`` (:func:`trace_path`).

    Returns ``(spans, spans_from)``: :func:`trace_runs` of the trace keyed by annotation, and
    whether the spans came from "the exported Chrome trace" or "prof.events()".
    """
    if not isinstance(runs, dict) or not runs:
        raise TypeError("runs must be a non-empty dict {annotation: fn(span)}")
    for name, fn in runs.items():
        callable_arg(f"runs[{name!r}]", fn)
    gap_s = positive_number("gap_s", gap_s)
    path = trace_path(trace)
    require_cuda("profile_runs()")
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    names: set = set()

    def span(name):
        names.add(name)
        return record_function(name)

    path.parent.mkdir(parents=True, exist_ok=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for annotation, fn in runs.items():
            for recorded in ((False, True) if warm else (True,)):
                if recorded:
                    with record_function(annotation):
                        fn(span)
                else:
                    fn(_no_span)
                torch.cuda.synchronize()
                time.sleep(gap_s)  # keep the runs apart in the trace
    prof.export_chrome_trace(str(path))
    run_names = {a: a for a in runs}
    try:
        return trace_runs(load_trace_events(path), run_names, names, kernel_label=kernel_label), \
            "the exported Chrome trace"
    except (OSError, ValueError, KeyError):
        events = events_from_profiler(prof, names | set(runs))
        return trace_runs(events, run_names, names, kernel_label=kernel_label), "prof.events()"
