"""Lesson 02 experiments: when ``non_blocking=True`` still makes the host wait ("fake non_blocking").

Every experiment keeps the GPU busy (:func:`pinlab.gpu_busy`) so that a host call that waits for
the GPU takes about the busy time, warms up every kernel it times (lazy module loading blocks the
first launch), and returns plain JSON-able data for :func:`pinlab.measure`:

* :func:`single_copy_sweep` (``02_single_copy``): host time inside one ``copy_``/``.to`` with
  ``non_blocking=True``, pageable vs pinned, 256 B to 64 MiB, and a benchmark of the pinned call;
* :func:`staging_pool` (``02_staging_pool``): many small pageable copies queued behind a busy
  GPU: host time of each copy, so that the pending bytes at the first wait can be found;
* :func:`d2h_visibility` (``02_d2h``): GPU-to-host copies, pageable vs pinned: does the host
  wait, and is the data valid before and after a synchronization;
* :func:`hidden_syncs` (``02_hidden_syncs``): other calls that block the host, as a table;
* :func:`step_loop` (``02_step_loop``): a small step loop with pageable vs pinned inputs, timed
  and profiled with ``torch.profiler`` (trace written under ``build/traces/``);
* :func:`async_h2d_cost` (``02_async_h2d``): :func:`pinlab.async_tensor_h2d` against
  ``torch.tensor(list, device="cuda")``;
* :func:`detector_demo` (``02_detector``): :func:`pinlab.detect_stalls` on a small loop, its cost,
  and what ``torch.cuda.set_sync_debug_mode("warn")`` sees of the same calls.

The post-processing (thresholds, span unions, idle shares, reading a profiler trace) is pure
Python, tested on the CPU with synthetic data.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import linecache
import math
import numbers
import os
import statistics
import time
import warnings
from pathlib import Path, PurePosixPath

import torch

from ..args import positive_int, positive_number, require_cuda, size_list
from ..busy import gpu_busy, wall_ms, warmup
from ..detector import FACTORY_SYNC, ITEM_SYNC, PAGEABLE_H2D
from ..progress import progress
from ..timing import Stats, host_time

KiB, MiB = 1 << 10, 1 << 20
BURST = 16  # pinned copies per burst in the benchmark: the way a step loop issues them

#: 256 B, 512 B, ... 64 MiB, plus a finer grid between 1 and 4 MiB, where pageable copies start to wait.
SWEEP_SIZES = sorted({256 << i for i in range(19)}
                     | {int(f * MiB) for f in (1.25, 1.5, 1.75, 2.25, 2.5, 2.75, 3, 3.5)})

# ---------------------------------------------------------------------------------------------
# pure post-processing (no GPU needed)
# ---------------------------------------------------------------------------------------------


def _number_list(name: str, values, length: int | None = None) -> list[float]:
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{name} must be a list of numbers, got {type(values).__name__}")
    out = [positive_number(f"{name}[{i}]", v, allow_zero=True) for i, v in enumerate(values)]
    if length is not None and len(out) != length:
        raise ValueError(f"{name} must have {length} values (one per size), got {len(out)}")
    return out


def waited(host_ms, busy_ms) -> bool:
    """True when a call made behind a GPU busy for ``busy_ms`` took more than half of it: it waited."""
    host_ms = positive_number("host_ms", host_ms, allow_zero=True)
    busy_ms = positive_number("busy_ms", busy_ms)
    return host_ms > busy_ms / 2


def first_waiting_size(sizes, host_ms, limit_ms):
    """The smallest size from which on *every* larger size took more than ``limit_ms``; ``None``
    when the largest size did not.

    A copy "waited" when its host time exceeds ``limit_ms`` (half the GPU's busy time). Taking
    the start of the final run of waiting sizes, rather than the first size that exceeded the
    limit, makes one stray slow measurement below the threshold harmless. ``sizes`` may come
    in any order; ``host_ms[i]`` belongs to ``sizes[i]``.
    """
    sizes = size_list("sizes", sizes)
    host_ms = _number_list("host_ms", host_ms, len(sizes))
    limit_ms = positive_number("limit_ms", limit_ms)
    if len(set(sizes)) != len(sizes):
        raise ValueError("sizes must not repeat a size")
    threshold = None
    for size, ms in sorted(zip(sizes, host_ms), reverse=True):
        if ms <= limit_ms:
            break
        threshold = size
    return threshold


def first_blocking_index(host_ms, limit_ms):
    """Index of the first call whose host time exceeds ``limit_ms``, or ``None``."""
    host_ms = _number_list("host_ms", host_ms)
    limit_ms = positive_number("limit_ms", limit_ms)
    return next((i for i, ms in enumerate(host_ms) if ms > limit_ms), None)


def pending_bytes_at_block(host_ms, chunk_bytes, limit_ms):
    """Bytes of copies queued (and returned) before the first one that blocked, or ``None``."""
    chunk_bytes = positive_int("chunk_bytes", chunk_bytes)
    i = first_blocking_index(host_ms, limit_ms)
    return None if i is None else i * chunk_bytes


def cumulative(values) -> list[float]:
    """Running sums: ``[a, a + b, a + b + c, ...]``."""
    return list(itertools.accumulate(_number_list("values", values)))


def _span_pairs(spans) -> list[tuple[float, float]]:
    if isinstance(spans, (str, bytes)) or not hasattr(spans, "__iter__"):
        raise TypeError(f"spans must be a list of (start, end) pairs, got {type(spans).__name__}")
    out = []
    for i, s in enumerate(spans):
        if isinstance(s, (str, bytes)) or not hasattr(s, "__len__") or len(s) not in (2, 3):
            raise TypeError(f"spans[{i}] must be (start, end) or (start, end, label), got {s!r}")
        start, end = s[0], s[1]
        for name, v in (("start", start), ("end", end)):
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
                raise TypeError(f"spans[{i}] {name} must be a finite number, got {v!r}")
        if end < start:
            raise ValueError(f"spans[{i}] ends before it starts ({start} > {end})")
        out.append((float(start), float(end)))
    return out


def merge_spans(spans) -> list[tuple[float, float]]:
    """The union of spans as sorted, non-overlapping ``(start, end)`` pairs."""
    merged: list[list[float]] = []
    for start, end in sorted(_span_pairs(spans)):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def covered(spans, start, end) -> float:
    """Length of ``[start, end]`` covered by at least one span (overlaps counted once)."""
    for name, v in (("start", start), ("end", end)):
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
            raise TypeError(f"{name} must be a finite number, got {v!r}")
    if end <= start:
        raise ValueError(f"end must be after start, got start={start}, end={end}")
    total = 0.0
    for a, b in merge_spans(spans):
        total += max(0.0, min(b, end) - max(a, start))
    return total


def idle_share(spans, start, end) -> float:
    """Share of the window ``[start, end]`` in which no span is active (0 = always busy, 1 = never)."""
    return 1.0 - covered(spans, start, end) / (end - start)


# --- reading a torch.profiler trace -------------------------------------------------------------

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def load_trace_events(path) -> list[dict]:
    """The events of a Chrome trace written by ``prof.export_chrome_trace(path)``."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
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
    for e in events:
        if not isinstance(e, dict) or e.get("ph") != "X":
            continue
        try:
            ts, dur = float(e["ts"]), float(e.get("dur", 0.0))
        except (KeyError, TypeError, ValueError):
            continue
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
    if not gpu:
        return None
    start, end = min(s[0] for s in gpu), max(s[1] for s in gpu)
    if end <= start:
        return None
    return idle_share([s for s in gpu if s[2] == kernel_label], start, end)


def median_span_ms(spans, label: str) -> float | None:
    """Median duration of the spans named ``label`` (``None`` if there is none)."""
    durations = [s[1] - s[0] for s in spans if s[2] == label]
    return statistics.median(durations) if durations else None


# ---------------------------------------------------------------------------------------------
# GPU experiments
# ---------------------------------------------------------------------------------------------


def _busy(ms):
    return lambda: gpu_busy(ms)


def single_copy_sweep(sizes=SWEEP_SIZES, busy_ms: float = 10.0, repeat: int = 3,
                      bench_bytes: int = 8 * MiB, bench_repeat: int = 30) -> dict:
    """Host ms spent inside one H2D call with ``non_blocking=True`` while the GPU is busy.

    For every size: ``dev[:n].copy_(src[:n], non_blocking=True)`` and ``src[:n].to("cuda",
    non_blocking=True)``, from pageable and from pinned memory, each behind a fresh
    ``gpu_busy(busy_ms)`` (median of ``repeat``, the device synchronized after each call).
    Then a benchmark at ``bench_bytes``: per-call host ms of pinned copies issued ``BURST`` in a
    row behind the busy GPU (as a loop issues them), ``bench_repeat`` bursts; and single calls,
    each the first after a synchronize, ``bench_repeat`` times each.

    Returns ``{"busy_ms", "rows": [{"bytes", "copy_pageable_ms", "copy_pinned_ms",
    "to_pageable_ms", "to_pinned_ms"}], "bench": {"bytes", "burst", "copy_pinned_in_loop",
    "copy_pinned", "to_pinned", "copy_pageable"}}`` (bench entries are Stats dicts: median, min,
    max, n).
    """
    sizes = sorted(size_list("sizes", sizes))
    busy_ms = positive_number("busy_ms", busy_ms)
    repeat = positive_int("repeat", repeat)
    bench_bytes = positive_int("bench_bytes", bench_bytes)
    bench_repeat = positive_int("bench_repeat", bench_repeat)
    require_cuda("single_copy_sweep()")
    top = max(sizes[-1], bench_bytes)
    pageable = torch.ones(top, dtype=torch.uint8)  # ones: every page touched before timing
    pinned = torch.ones(top, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(top, dtype=torch.uint8, device="cuda")
    busy = _busy(busy_ms)
    warmup(busy, lambda: dev.copy_(pageable, non_blocking=True), lambda: dev.copy_(pinned, non_blocking=True),
           lambda: pageable.to("cuda", non_blocking=True), lambda: pinned.to("cuda", non_blocking=True))
    rows = []
    for n in progress(sizes, desc="one copy behind a busy GPU"):
        d, pag, pin = dev[:n], pageable[:n], pinned[:n]
        calls = {
            "copy_pageable_ms": lambda: d.copy_(pag, non_blocking=True),
            "copy_pinned_ms": lambda: d.copy_(pin, non_blocking=True),
            "to_pageable_ms": lambda: pag.to("cuda", non_blocking=True),
            "to_pinned_ms": lambda: pin.to("cuda", non_blocking=True),
        }
        row = {"bytes": n}
        for key, fn in calls.items():
            row[key] = host_time(fn, setup=busy, repeat=repeat, warmup=1).median
        rows.append(row)
    d, pag, pin = dev[:bench_bytes], pageable[:bench_bytes], pinned[:bench_bytes]

    def burst():  # BURST calls in a row, as a step loop makes them: per-call host ms
        t0 = time.perf_counter()
        for _ in range(BURST):
            d.copy_(pin, non_blocking=True)
        return (time.perf_counter() - t0) * 1e3 / BURST

    per_call = []
    for _ in range(bench_repeat):
        busy()
        per_call.append(burst())
        torch.cuda.synchronize()
    bench = {
        "bytes": bench_bytes,
        "burst": BURST,
        "copy_pinned_in_loop": Stats.of(per_call).as_dict(),
        "copy_pinned": host_time(lambda: d.copy_(pin, non_blocking=True), setup=busy,
                                 repeat=bench_repeat).as_dict(),
        "to_pinned": host_time(lambda: pin.to("cuda", non_blocking=True), setup=busy,
                               repeat=bench_repeat).as_dict(),
        "copy_pageable": host_time(lambda: d.copy_(pag, non_blocking=True), setup=busy, repeat=5).as_dict(),
    }
    del pageable, pinned, dev, d, pag, pin
    torch.cuda.synchronize()
    return {"busy_ms": busy_ms, "rows": rows, "bench": bench}


def staging_pool(chunks=(16 * KiB, 64 * KiB), total_bytes: int = 16 * MiB, busy_ms: float = 50.0,
                 trials: int = 3) -> dict:
    """Many small pageable ``non_blocking`` copies queued behind one busy kernel.

    For each chunk size, ``total_bytes // chunk`` copies of consecutive slices of a pageable
    tensor into a GPU tensor, all enqueued behind ``gpu_busy(busy_ms)``; the host time of each
    copy is recorded. After a sync the GPU data is compared with the source.

    Returns ``{"busy_ms", "total_bytes", "runs": [{"chunk", "n_copies", "trials": [{"host_ms":
    [one per copy], "data_ok"}]}]}``.
    """
    chunks = size_list("chunks", chunks)
    total_bytes = positive_int("total_bytes", total_bytes)
    busy_ms = positive_number("busy_ms", busy_ms)
    trials = positive_int("trials", trials)
    for c in chunks:
        if 2 * c > total_bytes:
            raise ValueError(f"every chunk must fit at least twice into total_bytes ({total_bytes}), got {c}")
    require_cuda("staging_pool()")
    g = torch.Generator().manual_seed(0)
    src = torch.randint(0, 256, (total_bytes,), dtype=torch.uint8, generator=g)  # pageable, pages touched
    dst = torch.zeros(total_bytes, dtype=torch.uint8, device="cuda")
    warmup(_busy(1.0), lambda: dst[:chunks[0]].copy_(src[:chunks[0]], non_blocking=True), lambda: dst.zero_())
    runs = []
    for chunk in chunks:
        n = total_bytes // chunk
        pairs = [(dst[i * chunk:(i + 1) * chunk], src[i * chunk:(i + 1) * chunk]) for i in range(n)]
        out = []
        for _ in progress(range(trials), desc=f"{chunk // KiB} KiB copies queued"):
            dst.zero_()
            torch.cuda.synchronize()
            gpu_busy(busy_ms)
            times = []
            for d, s in pairs:
                t0 = time.perf_counter()
                d.copy_(s, non_blocking=True)
                times.append(round((time.perf_counter() - t0) * 1e3, 4))
            torch.cuda.synchronize()
            ok = bool(torch.equal(dst[: n * chunk].cpu(), src[: n * chunk]))
            out.append({"host_ms": times, "data_ok": ok})
        runs.append({"chunk": chunk, "n_copies": n, "trials": out})
    del src, dst, pairs
    torch.cuda.synchronize()
    return {"busy_ms": busy_ms, "total_bytes": total_bytes, "runs": runs}


def _plain_floats(values) -> list:
    """Floats for JSON; a non-finite value (uninitialized memory may hold one) becomes its text."""
    return [float(v) if math.isfinite(v) else str(v) for v in values]


D2H_VARIANTS = ("copy_ into pageable", "copy_ into pinned", ".to('cpu', non_blocking=True)")


def d2h_visibility(nbytes: int = 64 * KiB, busy_ms: float = 20.0, trials: int = 5) -> dict:
    """GPU-to-host copies with ``non_blocking=True``: does the host wait, is the data valid?

    Each trial: the host buffer is filled with -1; the GPU is made busy, then a kernel writes a
    new value (distinct per trial) into a GPU tensor; the D2H copy is issued and timed; the
    host buffer is read at once (before any sync), then again after ``event.synchronize()``
    (``torch.cuda.synchronize()`` for ``.to``). Variants: :data:`D2H_VARIANTS`.

    Returns ``{"busy_ms", "nbytes", "variants": [{"variant", "host_ms": [...], "valid_before_sync":
    [...], "valid_after_sync": [...], "head_before", "head_after", "expected_head", "result_pinned"}]}``
    (``head_*``: the first 4 values of trial 0).
    """
    nbytes = positive_int("nbytes", nbytes)
    if nbytes % 4:
        raise ValueError(f"nbytes must be a multiple of 4 (float32 elements), got {nbytes}")
    busy_ms = positive_number("busy_ms", busy_ms)
    trials = positive_int("trials", trials)
    require_cuda("d2h_visibility()")
    n = nbytes // 4
    g = torch.zeros(n, device="cuda")
    pageable = torch.empty(n)
    pinned = torch.empty(n, pin_memory=True)
    warmup(_busy(1.0), lambda: g.fill_(1.0), lambda: pageable.copy_(g, non_blocking=True),
           lambda: pinned.copy_(g, non_blocking=True), lambda: g.to("cpu", non_blocking=True))
    variants = []
    for v, name in enumerate(D2H_VARIANTS):
        rec = {"variant": name, "host_ms": [], "valid_before_sync": [], "valid_after_sync": []}
        for t in range(trials):
            value = 100.0 * (v + 1) + t
            out = None  # drop the last result: its pinned block is reused, no new one allocated
            pageable.fill_(-1.0)
            pinned.fill_(-1.0)
            torch.cuda.synchronize()
            gpu_busy(busy_ms)
            g.fill_(value)  # runs on the GPU after the busy kernel
            t0 = time.perf_counter()
            if v == 0:
                out = pageable.copy_(g, non_blocking=True)
            elif v == 1:
                out = pinned.copy_(g, non_blocking=True)
            else:
                out = g.to("cpu", non_blocking=True)
            rec["host_ms"].append((time.perf_counter() - t0) * 1e3)
            before = out.clone()  # what a reader who does not synchronize sees
            if v == 2:
                torch.cuda.synchronize()  # the fix, the blunt way
            else:
                done = torch.cuda.Event()
                done.record()
                done.synchronize()  # the fix: wait for the copy, and nothing later
            after = out.clone()
            rec["valid_before_sync"].append(bool((before == value).all()))
            rec["valid_after_sync"].append(bool((after == value).all()))
            if t == 0:
                rec["head_before"] = _plain_floats(before[:4].tolist())
                rec["head_after"] = _plain_floats(after[:4].tolist())
                rec["expected_head"] = [value] * 4
                rec["result_pinned"] = bool(out.is_pinned())
        variants.append(rec)
    del g, pageable, pinned, out
    torch.cuda.synchronize()
    return {"busy_ms": busy_ms, "nbytes": nbytes, "variants": variants}


def _once_behind_busy(fn, busy_ms) -> float:
    torch.cuda.synchronize()
    gpu_busy(busy_ms)
    ms = wall_ms(fn)
    torch.cuda.synchronize()
    return ms


HIDDEN_SYNC_OPS = {
    "tensor_list": "torch.tensor(python_list, device='cuda')",
    "noncontig_pinned": "copy_(non-contiguous pinned view, non_blocking=True)",
    "contig_pinned": "copy_(contiguous pinned tensor, non_blocking=True)",
    "dtype_cold": "copy_(pinned float32 -> GPU bfloat16, non_blocking=True), first call",
    "dtype_warm": "copy_(pinned float32 -> GPU bfloat16, non_blocking=True), again",
    "item": "gpu_scalar.item()",
    "kernel_cold": "torch.erf(float64 GPU tensor), first launch in this process",
    "kernel_warm": "torch.erf(float64 GPU tensor), second launch",
}


def hidden_syncs(busy_ms: float = 50.0, repeat: int = 3, list_len: int = 4096, view_bytes: int = 8 * MiB) -> dict:
    """Calls that block the host behind a busy GPU although nothing in them says "sync".

    Each call (:data:`HIDDEN_SYNC_OPS`) is timed behind ``gpu_busy(busy_ms)`` and with the GPU
    idle; it *blocked* when the difference exceeds half the busy time (so host work that the
    call does anyway, like building a contiguous copy, is not counted as waiting). The two
    "first" rows are single calls made before anything else in this process used their
    kernels: with CUDA lazy module loading (the default) the first launch of a kernel blocks.

    Returns ``{"busy_ms", "module_loading", "rows": [{"key", "op", "host_ms", "idle_ms",
    "blocked", "first_use"}]}``.
    """
    busy_ms = positive_number("busy_ms", busy_ms)
    repeat = positive_int("repeat", repeat)
    list_len = positive_int("list_len", list_len)
    view_bytes = positive_int("view_bytes", view_bytes)
    if view_bytes % (4 * 1024):
        raise ValueError(f"view_bytes must be a multiple of 4096 (rows of 1024 float32), got {view_bytes}")
    require_cuda("hidden_syncs()")
    rows_n, cols = view_bytes // (4 * 1024), 1024
    data = list(range(list_len))
    base = torch.ones(rows_n, 2 * cols, pin_memory=True)
    view = base[:, ::2]  # pinned, but every other column: not one block of memory
    contig = torch.ones(rows_n, cols, pin_memory=True)
    dev = torch.empty(rows_n, cols, device="cuda")
    f32 = torch.ones(view_bytes // 4, pin_memory=True)
    bf16 = torch.empty(view_bytes // 4, dtype=torch.bfloat16, device="cuda")
    scalar = torch.ones((), device="cuda")
    x64 = torch.full((4096,), 0.5, dtype=torch.float64, device="cuda")
    warmup(_busy(1.0))
    calls = {
        "tensor_list": lambda: torch.tensor(data, device="cuda"),
        "noncontig_pinned": lambda: dev.copy_(view, non_blocking=True),
        "contig_pinned": lambda: dev.copy_(contig, non_blocking=True),
        "dtype": lambda: bf16.copy_(f32, non_blocking=True),
        "item": lambda: scalar.item(),
        "kernel": lambda: torch.erf(x64),
    }
    # first launches, before anything warms these kernels up
    cold = {"dtype_cold": _once_behind_busy(calls["dtype"], busy_ms),
            "kernel_cold": _once_behind_busy(calls["kernel"], busy_ms)}
    warmup(*calls.values())
    busy = _busy(busy_ms)
    warm_keys = ("tensor_list", "noncontig_pinned", "contig_pinned", "dtype", "item", "kernel")
    idle = {k: host_time(calls[k], repeat=repeat, warmup=0).median for k in warm_keys}
    behind = {k: host_time(calls[k], setup=busy, repeat=repeat, warmup=0).median for k in warm_keys}
    rows = []
    for key in HIDDEN_SYNC_OPS:
        if key.endswith("_cold"):
            base_key, host_ms, first = key[:-5], cold[key], True
        elif key.endswith("_warm"):
            base_key, first = key[:-5], False
            host_ms = behind[base_key]
        else:
            base_key, host_ms, first = key, behind[key], False
        idle_ms = idle[base_key]
        rows.append({"key": key, "op": HIDDEN_SYNC_OPS[key], "host_ms": host_ms, "idle_ms": idle_ms,
                     "blocked": bool(host_ms - idle_ms > busy_ms / 2), "first_use": first})
    del base, view, contig, dev, f32, bf16, scalar, x64
    torch.cuda.synchronize()
    return {"busy_ms": busy_ms, "module_loading": os.environ.get("CUDA_MODULE_LOADING", ""), "rows": rows}


# --- the step loop, timed and profiled -----------------------------------------------------------

HOST_WAIT = "wait for step i-2"
HOST_PREPARE = "prepare inputs (CPU)"
HOST_COPY = "copy_(non_blocking=True)"
HOST_LAUNCH = "launch forward"
HOST_SPANS = (HOST_WAIT, HOST_PREPARE, HOST_COPY, HOST_LAUNCH)
FORWARD_LABEL = "forward (kernel)"
STEP_MODES = ("pageable", "pinned")
RUN_NAMES = {"pageable": "run: pageable inputs", "pinned": "run: pinned inputs"}
DEFAULT_TRACE = "build/traces/02_step_loop.json"


def trace_path(trace: str) -> Path:
    """Where the trace goes: ``trace`` is a path relative to the repository root, ending in ``.json``."""
    if not isinstance(trace, str) or not trace:
        raise TypeError(f"trace must be a relative path such as {DEFAULT_TRACE!r}, got {trace!r}")
    p = PurePosixPath(trace)
    if p.is_absolute() or ".." in p.parts or p.suffix != ".json":
        raise ValueError(f"trace must be a relative path inside the repository ending in .json, "
                         f"such as {DEFAULT_TRACE!r}, got {trace!r}")
    from ..replay import repo_root

    return repo_root().joinpath(*p.parts)


class _StepLoop:
    """A toy training/serving step: wait for step i-``in_flight``, prepare inputs on the CPU, copy
    them to the GPU with ``non_blocking=True``, launch the "forward". Only ``pinned`` differs."""

    def __init__(self, pinned: bool, input_bytes: int, gpu_ms: float, cpu_ms: float, in_flight: int):
        depth = in_flight + 1
        self.bufs = [torch.zeros(input_bytes, dtype=torch.uint8, pin_memory=pinned) for _ in range(depth)]
        self.dev = torch.empty(input_bytes, dtype=torch.uint8, device="cuda")
        self.events = [torch.cuda.Event() for _ in range(depth)]
        self.gpu_ms, self.cpu_s, self.in_flight, self.depth = gpu_ms, cpu_ms / 1e3, in_flight, depth

    def run(self, steps: int, annotate: bool = False) -> list[float]:
        """Run ``steps`` steps and synchronize; returns the host ms inside each ``copy_``."""
        span = torch.profiler.record_function if annotate else (lambda name: contextlib.nullcontext())
        torch.cuda.synchronize()
        copy_ms = []
        for i in range(steps):
            k = i % self.depth
            with span(HOST_WAIT):
                if i >= self.in_flight:  # bounded run-ahead, like an engine's batch queue
                    self.events[(i - self.in_flight) % self.depth].synchronize()
            with span(HOST_PREPARE):
                t_end = time.perf_counter() + self.cpu_s
                self.bufs[k].fill_(i % 251)
                while time.perf_counter() < t_end:
                    pass
            with span(HOST_COPY):
                t0 = time.perf_counter()
                self.dev.copy_(self.bufs[k], non_blocking=True)
                copy_ms.append((time.perf_counter() - t0) * 1e3)
            with span(HOST_LAUNCH):
                gpu_busy(self.gpu_ms)
            self.events[k].record()
        torch.cuda.synchronize()
        return copy_ms


def _events_from_profiler(prof, annotations) -> list[dict]:
    """Chrome-trace-like dicts from ``prof.events()`` (the fallback if the JSON cannot be read).
    ``annotations``: our ``record_function`` names (their GPU-side shadows are not kernels)."""
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


def step_loop(steps: int = 40, warm_steps: int = 5, profile_steps: int = 6, input_bytes: int = 8 * MiB,
              gpu_ms: float = 2.0, cpu_ms: float = 1.0, in_flight: int = 2, trace: str = DEFAULT_TRACE) -> dict:
    """A small step loop with pageable vs pinned inputs: throughput, then a profiler trace.

    Each step: wait until step i-``in_flight`` is done (bounded run-ahead), prepare an input of
    ``input_bytes`` on the CPU (``cpu_ms`` of work, filling a host buffer from a ring), copy it
    with ``copy_(..., non_blocking=True)``, launch ``gpu_busy(gpu_ms)`` as the forward. The
    two modes differ only in ``pin_memory`` of the host buffers.

    1. ``steps`` steps timed without the profiler: steps per second, host ms inside ``copy_``;
    2. ``profile_steps`` steps per mode under ``torch.profiler`` (CPU + CUDA), both modes in one
       trace written to ``trace`` (relative to the repository root), read back into spans
       (:func:`trace_runs`).

    Returns ``{"trace_file", "spans_from", "modes": {mode: {"steps_per_s", "ms_per_step",
    "copy_host_ms", "window_ms", "host", "gpu", "memcpy_names", "gpu_idle_share",
    "trace_copy_host_ms"}}}``.
    """
    steps = positive_int("steps", steps)
    warm_steps = positive_int("warm_steps", warm_steps)
    profile_steps = positive_int("profile_steps", profile_steps)
    input_bytes = positive_int("input_bytes", input_bytes)
    gpu_ms = positive_number("gpu_ms", gpu_ms)
    cpu_ms = positive_number("cpu_ms", cpu_ms)
    in_flight = positive_int("in_flight", in_flight)
    path = trace_path(trace)
    require_cuda("step_loop()")
    from torch.profiler import ProfilerActivity, profile, record_function

    warmup(_busy(1.0))
    loops = {m: _StepLoop(m == "pinned", input_bytes, gpu_ms, cpu_ms, in_flight) for m in STEP_MODES}
    for loop in loops.values():
        loop.run(warm_steps)
    modes = {}
    for m, loop in loops.items():
        t0 = time.perf_counter()
        copy_ms = loop.run(steps)
        elapsed_ms = (time.perf_counter() - t0) * 1e3
        modes[m] = {"steps_per_s": steps / (elapsed_ms / 1e3), "ms_per_step": elapsed_ms / steps,
                    "copy_host_ms": statistics.median(copy_ms)}
    path.parent.mkdir(parents=True, exist_ok=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for m, loop in loops.items():
            with record_function(RUN_NAMES[m]):
                loop.run(profile_steps, annotate=True)
            time.sleep(0.02)  # keep the runs apart in the trace
    prof.export_chrome_trace(str(path))
    try:
        runs = trace_runs(load_trace_events(path), RUN_NAMES, HOST_SPANS, kernel_label=FORWARD_LABEL)
        spans_from = "the exported Chrome trace"
    except (OSError, ValueError, KeyError):
        events = _events_from_profiler(prof, set(RUN_NAMES.values()) | set(HOST_SPANS))
        runs = trace_runs(events, RUN_NAMES, HOST_SPANS, kernel_label=FORWARD_LABEL)
        spans_from = "prof.events()"
    for m in STEP_MODES:
        run = runs[m]
        if not any(g[2] == FORWARD_LABEL for g in run["gpu"]):
            raise RuntimeError(f"the profiler recorded no GPU kernel in the {m} run (is CUPTI available?); "
                               f"see the trace {path}")
        modes[m].update(run)
        modes[m]["gpu_idle_share"] = gpu_kernel_idle_share(run, FORWARD_LABEL)
        modes[m]["trace_copy_host_ms"] = median_span_ms(run["host"], HOST_COPY)
    del loops
    torch.cuda.synchronize()
    return {"trace_file": PurePosixPath(trace).as_posix(), "spans_from": spans_from, "modes": modes}


# --- async_tensor_h2d against torch.tensor(list, device="cuda") ----------------------------------

ASYNC_H2D_OPS = {
    "factory": "torch.tensor(data, device='cuda')",
    "pageable_nb": "torch.tensor(data).to('cuda', non_blocking=True)",
    "async": "pinlab.async_tensor_h2d(data)",
}


def async_h2d_cost(list_len: int = 4096, busy_ms: float = 20.0, repeat: int = 10) -> dict:
    """Host ms to get a Python list of ``list_len`` ints onto the GPU, three ways, behind a busy GPU
    and with the GPU idle (:data:`ASYNC_H2D_OPS`); and whether all three give the same tensor.

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
    busy = _busy(busy_ms)
    rows = []
    for key, fn in calls.items():
        idle_ms = host_time(fn, repeat=repeat, warmup=0).median
        host_ms = host_time(fn, setup=busy, repeat=repeat, warmup=0).median
        rows.append({"key": key, "op": ASYNC_H2D_OPS[key], "host_ms": host_ms, "idle_ms": idle_ms,
                     "blocked": bool(host_ms - idle_ms > busy_ms / 2)})
    gpu_busy(busy_ms)
    results = [fn() for fn in calls.values()]
    torch.cuda.synchronize()
    same = all(r.dtype == results[0].dtype and bool(torch.equal(r, results[0])) for r in results)
    del results
    return {"busy_ms": busy_ms, "list_len": list_len, "rows": rows, "same_values": bool(same)}


# --- the stall detector on a small loop -----------------------------------------------------------

DEMO_FILE = "demo_step.py"
#: The loop body the detector demo runs. It is compiled under the file name ``demo_step.py`` so
#: that the detector, which skips pinlab's own frames, points at *its* lines, as it would at yours.
DEMO_SOURCE = '''\
def demo_step(step, weights, inputs_cpu, inputs_gpu, gpu_ms):
    inputs_gpu.copy_(inputs_cpu, non_blocking=True)       # the batch, from pageable memory
    positions = torch.tensor([step] * 64, device="cuda")   # built from a Python list
    hidden = torch.relu(inputs_gpu @ weights) + positions[0]
    gpu_busy(gpu_ms)                                       # the rest of the forward
    return hidden.sum().item()                             # the loss, read on the host
'''
#: The calls in DEMO_SOURCE the detector should report: a fragment of the line -> its kind.
DEMO_STALLS = {
    "inputs_gpu.copy_(": PAGEABLE_H2D,
    "torch.tensor(": FACTORY_SYNC,
    ".item()": ITEM_SYNC,
}


def demo_stall_lines() -> dict:
    """``{kind: line number in DEMO_SOURCE}`` for the calls in :data:`DEMO_STALLS`."""
    out = {}
    for fragment, kind in DEMO_STALLS.items():
        lines = [i for i, line in enumerate(DEMO_SOURCE.splitlines(), 1) if fragment in line]
        if len(lines) != 1:
            raise AssertionError(f"{fragment!r} must occur on exactly one line of DEMO_SOURCE, found {lines}")
        out[kind] = lines[0]
    return out


def demo_step_function():
    """Compile :data:`DEMO_SOURCE` as ``demo_step.py`` and return its ``demo_step`` function."""
    ns = {"torch": torch, "gpu_busy": gpu_busy}
    exec(compile(DEMO_SOURCE, DEMO_FILE, "exec"), ns)  # noqa: S102 - our own constant source
    linecache.cache[DEMO_FILE] = (len(DEMO_SOURCE), None, DEMO_SOURCE.splitlines(True), DEMO_FILE)
    return ns["demo_step"]


def stall_lines(events, filename: str = DEMO_FILE) -> dict:
    """``{kind: sorted line numbers}`` of the events whose ``where`` is in ``filename``."""
    out: dict = {}
    for e in events:
        where = e["where"] if isinstance(e, dict) else e.where
        kind = e["kind"] if isinstance(e, dict) else e.kind
        file, _, line = str(where).rpartition(":")
        if file == filename and line.isdigit():
            out.setdefault(kind, set()).add(int(line))
    return {k: sorted(v) for k, v in out.items()}


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


def detector_demo(steps: int = 20, gpu_ms: float = 0.5, features: int = 256, repeat: int = 5) -> dict:
    """:func:`pinlab.detect_stalls` on a realistic little loop (:data:`DEMO_SOURCE`).

    1. The loop (``steps`` steps: a pageable ``non_blocking`` copy, a ``torch.tensor(list,
       device="cuda")``, a small matmul, ``gpu_busy(gpu_ms)``, a ``.item()``) once under the
       detector: its report.
    2. Its host time with and without the detector, alternating, ``repeat`` times each.
    3. Each of the three stalling calls alone, under ``torch.cuda.set_sync_debug_mode("warn")``
       (warnings counted) and under the detector (events counted).

    Returns ``{"steps", "counts", "total", "events" (the first 12, as dicts), "summary",
    "stall_lines", "expected_lines", "plain_ms", "detected_ms" (Stats dicts), "compare":
    [{"key", "op", "sync_debug_warnings", "detector_events"}]}``.
    """
    steps = positive_int("steps", steps)
    gpu_ms = positive_number("gpu_ms", gpu_ms)
    features = positive_int("features", features)
    repeat = positive_int("repeat", repeat)
    require_cuda("detector_demo()")
    from ..detector import detect_stalls
    from ..timing import Stats

    demo_step = demo_step_function()
    weights = torch.randn(features, features, device="cuda") / features
    inputs_cpu = torch.randn(features, features)  # pageable
    inputs_gpu = torch.empty(features, features, device="cuda")

    def loop():
        for step in range(steps):
            demo_step(step, weights, inputs_cpu, inputs_gpu, gpu_ms)
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
        "stall_lines": stall_lines(events),
        "expected_lines": {k: [v] for k, v in demo_stall_lines().items()},
        "plain_ms": Stats.of(plain).as_dict(),
        "detected_ms": Stats.of(detected).as_dict(),
        "compare": compare,
    }
