"""Lesson 02 experiments: when ``non_blocking=True`` still makes the host wait ("fake non_blocking").

Each experiment keeps the GPU busy (:func:`pinlab.gpu_busy`), so that a host call that waits for
it takes about the busy time, warms up every kernel it times, and returns JSON-able data for
:func:`pinlab.measure` (names ``02_*``). The notebook defines the key code (the timed copy, the
step loop, ``demo_step``) and hands it to :func:`single_copy_sweep`, :func:`step_loop` and
:func:`detector_demo`, which run it for every size or input kind. The pure post-processing is
tested on the CPU; reading profiler traces lives in :mod:`pinlab.profiler`.

Why about 680 lines, above the course's ~500: six GPU experiments of lesson 02 (the copy sweep, the staging
pool, D2H visibility, hidden syncs, the tutorial's matrix and loop), each with its own buffers, warm-up and
JSON result, the pure sentences computed from them, and the notebook's reasons (:data:`WHY`) and table columns
(issue 31: the notebook keeps one line per fact); lesson 02b's experiments live in
:mod:`pinlab.lessons.l02b_overlapping_copies` (issue 31), and reading traces in :mod:`pinlab.profiler`.
"""
from __future__ import annotations

import itertools
import math
import os
import statistics
import time

import torch

from ..args import callable_arg, positive_int, positive_number, size_list
from ..busy import gpu_busy, warmup
from ..claims import Reasons
from ..device import require_cuda
from ..progress import progress
from ..text import fmt_bytes
from ..timing import Stats, fmt_ms, host_time

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
BURST = 16  # pinned copies per burst in the benchmark: the way a step loop issues them

#: 256 B, 512 B, ... 64 MiB, plus a finer grid between 1 and 4 MiB, where pageable copies start to wait.
SWEEP_SIZES = sorted({256 << i for i in range(19)}
                     | {int(f * MiB) for f in (1.25, 1.5, 1.75, 2.25, 2.5, 2.75, 3, 3.5)})

# --- pure post-processing (no GPU needed) ---------------------------------------------------------


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
    """The smallest size from which on *every* larger size took more than ``limit_ms`` (exactly
    ``limit_ms`` is not waiting); ``None`` when the largest size did not. One stray slow small
    copy cannot fool it. ``sizes`` in any order, ``host_ms[i]`` for ``sizes[i]``. The reference
    answer of the exercise ``stall_threshold`` (``limit_ms = busy_ms / 2``)."""
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


def plain_floats(values) -> list:
    """Floats for JSON; a non-finite value (uninitialized memory may hold one) becomes its text."""
    return [float(v) if math.isfinite(v) else str(v) for v in values]


def c_environ(name: str):
    """Environment variable ``name`` as C code (the CUDA driver) sees it, or None. ``os.environ`` is
    Python's copy taken at start-up: a later C ``setenv`` (older PyTorch releases set
    ``CUDA_MODULE_LOADING`` that way when they initialised CUDA) does not show there. Falls back to
    ``os.environ`` without a libc."""
    if not isinstance(name, str) or not name or "=" in name or "\0" in name:
        raise ValueError(f"name must be an environment variable name, got {name!r}")
    try:
        import ctypes

        getenv = ctypes.CDLL(None).getenv
        getenv.restype, getenv.argtypes = ctypes.c_char_p, [ctypes.c_char_p]
    except (OSError, AttributeError, TypeError):
        return os.environ.get(name)
    value = getenv(name.encode())
    return None if value is None else value.decode(errors="replace")


# --- GPU experiments ------------------------------------------------------------------------------


def _busy(ms):
    return lambda: gpu_busy(ms)


def single_copy_sweep(timed_copy, sizes=SWEEP_SIZES, busy_ms: float = 10.0, repeat: int = 3,
                      bench_bytes: int = 8 * MiB, bench_repeat: int = 30) -> dict:
    """The notebook's ``timed_copy(dst, src, busy_ms)`` (host ms inside one ``dst.copy_(src,
    non_blocking=True)`` behind a GPU busy for ``busy_ms``) for every size, pageable and pinned,
    median of ``repeat``; the same for ``src.to("cuda", non_blocking=True)``. Then at
    ``bench_bytes``: per-call host ms of ``BURST`` pinned copies in a row behind the busy GPU
    (``bench_repeat`` bursts), and single calls. Returns ``{"busy_ms", "rows": [{"bytes",
    "copy_pageable_ms", "copy_pinned_ms", "to_pageable_ms", "to_pinned_ms"}], "bench": {"bytes",
    "burst", "copy_pinned_in_loop", "copy_pinned", "to_pinned", "copy_pageable"}}`` (Stats dicts).
    """
    callable_arg("timed_copy", timed_copy)
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
    warmup(busy, lambda: timed_copy(dev, pageable, 1.0), lambda: timed_copy(dev, pinned, 1.0),
           lambda: pageable.to("cuda", non_blocking=True), lambda: pinned.to("cuda", non_blocking=True))

    def median_of(fn):
        return statistics.median(fn() for _ in range(repeat))

    rows = []
    for n in progress(sizes, desc="one copy behind a busy GPU"):
        d, pag, pin = dev[:n], pageable[:n], pinned[:n]
        rows.append({
            "bytes": n,
            "copy_pageable_ms": median_of(lambda: timed_copy(d, pag, busy_ms)),
            "copy_pinned_ms": median_of(lambda: timed_copy(d, pin, busy_ms)),
            "to_pageable_ms": host_time(lambda: pag.to("cuda", non_blocking=True), setup=busy,
                                        repeat=repeat, warmup=0).median,
            "to_pinned_ms": host_time(lambda: pin.to("cuda", non_blocking=True), setup=busy,
                                      repeat=repeat, warmup=0).median,
        })
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
        "copy_pinned": Stats.of([timed_copy(d, pin, busy_ms) for _ in range(bench_repeat)]).as_dict(),
        "to_pinned": host_time(lambda: pin.to("cuda", non_blocking=True), setup=busy,
                               repeat=bench_repeat).as_dict(),
        "copy_pageable": Stats.of([timed_copy(d, pag, busy_ms) for _ in range(5)]).as_dict(),
    }
    del pageable, pinned, dev, d, pag, pin
    torch.cuda.synchronize()
    return {"busy_ms": busy_ms, "rows": rows, "bench": bench}


def staging_pool(chunks=(16 * KiB, 64 * KiB), total_bytes: int = 16 * MiB, busy_ms: float = 50.0,
                 trials: int = 3) -> dict:
    """Many small pageable ``non_blocking`` copies queued behind one busy kernel: for each chunk,
    ``total_bytes // chunk`` copies of consecutive slices, each timed; then the data is checked.
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


D2H_VARIANTS = ("copy_ into pageable", "copy_ into pinned", ".to('cpu', non_blocking=True)")


def d2h_visibility(copy_back, nbytes: int = 64 * KiB, busy_ms: float = 20.0, trials: int = 5) -> dict:
    """GPU-to-host copies with ``non_blocking=True`` (:data:`D2H_VARIANTS`): does the host wait, is
    the data valid before and after waiting? The notebook's ``copy_back(host_buf, gpu_t, value,
    busy_ms)`` (-> host ms inside the copy, ``host_buf`` read at once, read after the copy's event)
    runs into a pageable and into a pinned buffer; ``.to`` gets the same trial here, with
    ``torch.cuda.synchronize()`` as the wait. ``value`` differs per trial. Returns ``{"busy_ms",
    "nbytes", "variants": [{"variant", "host_ms", "valid_before_sync", "valid_after_sync" (one per
    trial), "head_before", "head_after", "expected_head" (first 4 values, trial 0), "result_pinned"}]}``.
    """
    callable_arg("copy_back", copy_back)
    nbytes = positive_int("nbytes", nbytes)
    if nbytes % 4:
        raise ValueError(f"nbytes must be a multiple of 4 (float32 elements), got {nbytes}")
    busy_ms = positive_number("busy_ms", busy_ms)
    trials = positive_int("trials", trials)
    require_cuda("d2h_visibility()")
    n = nbytes // 4
    g = torch.zeros(n, device="cuda")
    pageable, pinned = torch.empty(n), torch.empty(n, pin_memory=True)

    def to_cpu(value):  # .to allocates its (pinned) result itself
        torch.cuda.synchronize()
        gpu_busy(busy_ms)
        g.fill_(value)  # runs on the GPU after the busy kernel
        t0 = time.perf_counter()
        out = g.to("cpu", non_blocking=True)
        host_ms = (time.perf_counter() - t0) * 1e3
        before = out.clone()
        torch.cuda.synchronize()  # the fix, the blunt way
        return host_ms, before, out.clone(), bool(out.is_pinned())

    warmup(_busy(1.0), lambda: g.fill_(1.0), lambda: copy_back(pageable, g, 1.0, 1.0),
           lambda: copy_back(pinned, g, 1.0, 1.0), lambda: to_cpu(1.0))
    trial_fns = (lambda value: (*copy_back(pageable, g, value, busy_ms), pageable.is_pinned()),
                 lambda value: (*copy_back(pinned, g, value, busy_ms), pinned.is_pinned()), to_cpu)
    variants = []
    for v, (name, trial) in enumerate(zip(D2H_VARIANTS, trial_fns)):
        rec = {"variant": name, "host_ms": [], "valid_before_sync": [], "valid_after_sync": []}
        for t in range(trials):
            value = 100.0 * (v + 1) + t
            host_ms, before, after, result_pinned = trial(value)
            rec["host_ms"].append(float(host_ms))
            rec["valid_before_sync"].append(bool((before == value).all()))
            rec["valid_after_sync"].append(bool((after == value).all()))
            if t == 0:
                rec["head_before"] = plain_floats(before[:4].tolist())
                rec["head_after"] = plain_floats(after[:4].tolist())
                rec["expected_head"] = [value] * 4
                rec["result_pinned"] = bool(result_pinned)
        variants.append(rec)
    del g, pageable, pinned
    torch.cuda.synchronize()
    return {"busy_ms": busy_ms, "nbytes": nbytes, "variants": variants}


def _blocked_rows(calls, ops, busy_ms, repeat, cold=None) -> list[dict]:
    """Rows ``{"key", "op", "host_ms", "idle_ms", "blocked"}`` for ``ops`` (``{key: text}``): each
    call timed with the GPU idle and behind ``gpu_busy(busy_ms)`` (median of ``repeat``); it
    blocked when the difference exceeds half the busy time. A key ending in ``_cold``/``_warm``
    uses the call without that suffix; ``cold[key]`` holds its single first-call time."""
    busy = _busy(busy_ms)
    idle = {k: host_time(fn, repeat=repeat, warmup=0).median for k, fn in calls.items()}
    behind = {k: host_time(fn, setup=busy, repeat=repeat, warmup=0).median for k, fn in calls.items()}
    rows = []
    for key, op in ops.items():
        base = key.rsplit("_", 1)[0] if key.endswith(("_cold", "_warm")) else key
        host_ms = cold[key] if key.endswith("_cold") else behind[base]
        rows.append({"key": key, "op": op, "host_ms": host_ms, "idle_ms": idle[base],
                     "blocked": bool(host_ms - idle[base] > busy_ms / 2)})
    return rows


HIDDEN_SYNC_OPS = {
    "tensor_list": "torch.tensor(python_list, device='cuda')",
    "nondense_pinned": "copy_(pinned x[:, ::2], a non-dense view, non_blocking=True)",
    "permuted_same_layout": "copy_(pinned x.t() into torch.empty_like(x.t(), device='cuda'), non_blocking=True)",
    "permuted_to_contiguous": "copy_(pinned x.t() into a contiguous GPU tensor, non_blocking=True)",
    "contig_pinned": "copy_(contiguous pinned tensor, non_blocking=True)",
    "dtype_cold": "copy_(pinned float32 -> GPU bfloat16, non_blocking=True), first call",
    "dtype_warm": "copy_(pinned float32 -> GPU bfloat16, non_blocking=True), again",
    "item": "gpu_scalar.item()",
    "kernel_cold": "torch.erf(float64 GPU tensor), first launch in this process",
    "kernel_warm": "torch.erf(float64 GPU tensor), second launch",
}


def hidden_syncs(busy_ms: float = 20.0, repeat: int = 3, list_len: int = 4096, view_bytes: int = 8 * MiB) -> dict:
    """Calls that block the host behind a busy GPU although nothing in them says "sync"
    (:data:`HIDDEN_SYNC_OPS`, ``x`` a pinned float32 tensor of ``view_bytes``; :func:`_blocked_rows`).
    The "first" rows are single calls made before this process used their kernels (lazy module
    loading blocks a first launch). Returns ``{"busy_ms", "module_loading_environ",
    "module_loading_effective", "rows": [{"key", "op", "host_ms", "idle_ms", "blocked",
    "first_use"}]}``: ``CUDA_MODULE_LOADING`` in ``os.environ`` and in the C environment (what
    CUDA reads; :func:`c_environ`), "" if unset.
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
    wide = torch.ones(rows_n, 2 * cols, pin_memory=True)
    nondense = wide[:, ::2]  # pinned, but every other column: no layout makes it one block
    x = torch.ones(rows_n, cols, pin_memory=True)
    dev = torch.empty(rows_n, cols, device="cuda")
    dev_same = torch.empty_like(x.t(), device="cuda")  # the same (transposed) strides as x.t()
    dev_t = torch.empty(cols, rows_n, device="cuda")  # contiguous
    f32 = torch.ones(view_bytes // 4, pin_memory=True)
    bf16 = torch.empty(view_bytes // 4, dtype=torch.bfloat16, device="cuda")
    scalar = torch.ones((), device="cuda")
    x64 = torch.full((4096,), 0.5, dtype=torch.float64, device="cuda")
    warmup(_busy(1.0))
    calls = {
        "tensor_list": lambda: torch.tensor(data, device="cuda"),
        "nondense_pinned": lambda: dev.copy_(nondense, non_blocking=True),
        "permuted_same_layout": lambda: dev_same.copy_(x.t(), non_blocking=True),
        "permuted_to_contiguous": lambda: dev_t.copy_(x.t(), non_blocking=True),
        "contig_pinned": lambda: dev.copy_(x, non_blocking=True),
        "dtype": lambda: bf16.copy_(f32, non_blocking=True),
        "item": lambda: scalar.item(),
        "kernel": lambda: torch.erf(x64),
    }
    # first launches, before anything warms these kernels up (one call each, behind the busy GPU)
    cold = {f"{k}_cold": host_time(calls[k], setup=_busy(busy_ms), repeat=1, warmup=0).median
            for k in ("dtype", "kernel")}
    warmup(*calls.values())
    rows = _blocked_rows(calls, HIDDEN_SYNC_OPS, busy_ms, repeat, cold)
    for r in rows:
        r["first_use"] = r["key"].endswith("_cold")
    del wide, nondense, x, dev, dev_same, dev_t, f32, bf16, scalar, x64
    torch.cuda.synchronize()
    return {"busy_ms": busy_ms, "module_loading_environ": os.environ.get("CUDA_MODULE_LOADING", ""),
            "module_loading_effective": c_environ("CUDA_MODULE_LOADING") or "", "rows": rows}


# --- the tutorial's headline advice, tested with this lesson's data --------------------------------

ADVICE_HOLDS, ADVICE_WAITS, ADVICE_STALE = "returns at once", "the host waits", "returns at once, data not there yet"


def _result(name: str, value, keys) -> dict:
    if not isinstance(value, dict):
        raise TypeError(f"{name} must be the result dict of its experiment, got {type(value).__name__}")
    missing = [k for k in keys if k not in value]
    if missing:
        raise ValueError(f"{name} must hold {missing} (the result of its experiment)")
    return value


def _size_text(n: int) -> str:
    for unit, div in (("MiB", MiB), ("KiB", KiB)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


def advice_rows(sweep, pool, d2h) -> list[dict]:
    """The tutorial's advice "use ``non_blocking=True``, pinned or not", case by case, from this
    lesson's results: ``sweep`` (:func:`single_copy_sweep`), ``pool`` (:func:`staging_pool`),
    ``d2h`` (:func:`d2h_visibility`). Rows ``{"case", "outcome"}`` (:data:`ADVICE_HOLDS`,
    :data:`ADVICE_WAITS` or :data:`ADVICE_STALE`) and ``"evidence"`` (text with the numbers)."""
    sweep = _result("sweep", sweep, ("busy_ms", "rows"))
    pool = _result("pool", pool, ("busy_ms", "runs"))
    d2h = _result("d2h", d2h, ("busy_ms", "variants"))
    rows = sorted(sweep["rows"], key=lambda r: r["bytes"]) if isinstance(sweep["rows"], list) else None
    if not rows:
        raise ValueError("sweep['rows'] must be a non-empty list of rows")
    busy = positive_number("sweep['busy_ms']", sweep["busy_ms"])
    small, large = rows[0], rows[-1]

    def fmt(ms):
        return f"{ms:.3g} ms"

    out = []
    pinned_max = max(max(r["copy_pinned_ms"], r["to_pinned_ms"]) for r in rows)
    out.append({"case": "H2D from pinned memory, any size",
                "outcome": ADVICE_WAITS if waited(pinned_max, busy) else ADVICE_HOLDS,
                "evidence": f"slowest call {fmt(pinned_max)} behind {fmt(busy)} of GPU work"})
    for r, what in ((small, "a small copy"), (large, "one large copy")):
        ms = r["copy_pageable_ms"]
        out.append({"case": f"H2D from pageable memory, {what} ({_size_text(r['bytes'])})",
                    "outcome": ADVICE_WAITS if waited(ms, busy) else ADVICE_HOLDS,
                    "evidence": f"{fmt(ms)} behind {fmt(busy)} of GPU work"})
    pool_busy = positive_number("pool['busy_ms']", pool["busy_ms"])
    at = [pending_bytes_at_block(t["host_ms"], run["chunk"], pool_busy / 2)
          for run in pool["runs"] for t in run["trials"]]
    if not at:
        raise ValueError("pool['runs'] must hold at least one trial")
    blocked = [a for a in at if a is not None]
    out.append({"case": "H2D from pageable memory, many small copies queued",
                "outcome": ADVICE_WAITS if len(blocked) == len(at) else ADVICE_HOLDS,
                "evidence": (f"the host blocked in {len(blocked)} of {len(at)} trials, after "
                             f"{min(blocked) // KiB}-{max(blocked) // KiB} KiB queued") if blocked
                else f"no trial blocked ({len(at)} trials)"})
    d2h_busy = positive_number("d2h['busy_ms']", d2h["busy_ms"])
    variants = {v.get("variant"): v for v in d2h["variants"] if isinstance(v, dict)}
    for key, case in ((D2H_VARIANTS[0], "D2H into pageable memory"), (D2H_VARIANTS[1], "D2H into pinned memory")):
        if key not in variants:
            raise ValueError(f"d2h['variants'] must hold the variant {key!r}")
        v = variants[key]
        waits = all(waited(t, d2h_busy) for t in v["host_ms"])
        stale = not any(v["valid_before_sync"])
        outcome = ADVICE_WAITS if waits else (ADVICE_STALE if stale else ADVICE_HOLDS)
        out.append({"case": case, "outcome": outcome,
                    "evidence": f"median {fmt(statistics.median(v['host_ms']))} behind {fmt(d2h_busy)}; "
                                f"right before a sync in {sum(map(bool, v['valid_before_sync']))} "
                                f"of {len(v['valid_before_sync'])} trials"})
    return out


# ---- issue 22: copy engines, both directions at once, and the tutorial's matrix -----------------------

MATRIX_SOURCES = ("pageable", "pinned", "pin_memory() then copy")


def tutorial_matrix(to_gpu=None, nbytes: int = 16 * MiB, reps: int = 10) -> list[dict]:
    """Host ms until each copy of ``nbytes`` is done (a sync after it), for every source in
    :data:`MATRIX_SOURCES` × ``non_blocking`` False / True, medians of ``reps`` interleaved rounds.
    ``to_gpu(source, dst, pageable, pinned, non_blocking)`` makes one cell's copy and waits for it (the
    notebook's; default: the same, written here). CUDA only."""
    if to_gpu is not None:
        callable_arg("to_gpu", to_gpu)
    nbytes = positive_int("nbytes", nbytes, maximum=GiB)
    reps = positive_int("reps", reps, maximum=100)
    require_cuda("tutorial_matrix()")
    pageable = torch.ones(nbytes, dtype=torch.uint8)
    pinned = pageable.pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    def run(source, nb):
        if to_gpu is not None:
            return to_gpu(source, dst, pageable, pinned, nb)
        src = pageable if source == "pageable" else pinned if source == "pinned" else pageable.pin_memory()
        dst.copy_(src, non_blocking=nb)
        torch.cuda.synchronize()

    cells = [(src, nb) for src in MATRIX_SOURCES for nb in (False, True)]
    for c in cells:
        run(*c)
    ms = {c: [] for c in cells}
    for _ in range(reps):
        for c in cells:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            run(*c)
            ms[c].append((time.perf_counter() - t0) * 1e3)
    return [{"source": src, "non_blocking": nb, "ms": statistics.median(ms[(src, nb)])} for src, nb in cells]


#: The PyTorch tutorial's own experiment (pytorch/tutorials ``intermediate_source/pinmem_nonblock.py``): 1,000
#: tensors of ``torch.randn(1000)`` (float32, 4,000 bytes each), copied with ``.to("cuda:0")`` one by one, or with
#: ``non_blocking=True`` and one ``torch.cuda.synchronize()`` at the end; from pageable, pinned, and "pin then copy".
TUTORIAL_COUNT, TUTORIAL_NUMEL = 1000, 1000


def tutorial_loop(copies, count: int = TUTORIAL_COUNT, numel: int = TUTORIAL_NUMEL, reps: int = 15) -> dict:
    """The tutorial's experiment: host ms until ``copies(tensors, non_blocking, pin_first)`` (the notebook's
    loop: every tensor ``.to("cuda")``, and with ``non_blocking`` one sync at the end) has put ``count`` float32
    tensors of ``numel`` elements on the GPU, for every source of :data:`MATRIX_SOURCES` × ``non_blocking`` False
    / True: medians of ``reps`` interleaved rounds after one untimed round, the GPU idle at the start of each.
    The first round's copies are checked, every tensor bitwise. CUDA only."""
    callable_arg("copies", copies)
    count = positive_int("count", count, maximum=100_000)
    numel = positive_int("numel", numel, maximum=1 << 24)
    reps = positive_int("reps", reps, maximum=100)
    require_cuda("tutorial_loop()")
    gen = torch.Generator().manual_seed(0)
    pageable = [torch.randn(numel, generator=gen) for _ in range(count)]
    pinned = [t.pin_memory() for t in pageable]                  # pinned once, reused
    runs = {"pageable": lambda nb: copies(pageable, nb, False), "pinned": lambda nb: copies(pinned, nb, False),
            "pin_memory() then copy": lambda nb: copies(pageable, nb, True)}
    cells = [(src, nb) for src in MATRIX_SOURCES for nb in (False, True)]
    ok = True
    for src, nb in cells:                                        # untimed: warm-up, and the exact check
        out = runs[src](nb)
        torch.cuda.synchronize()
        ok = ok and len(out) == count and all(bool(torch.equal(o.cpu(), t)) for o, t in zip(out, pageable))
        del out
    ms = {c: [] for c in cells}
    for _ in range(reps):                                        # interleaved: every cell once per round
        for src, nb in cells:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = runs[src](nb)
            torch.cuda.synchronize()                             # a no-op after the loop's own waits
            ms[(src, nb)].append((time.perf_counter() - t0) * 1e3)
            del out
    del pageable, pinned
    return {"count": count, "bytes_each": numel * 4, "data_ok": bool(ok),
            "rows": [{"source": s, "non_blocking": nb, "ms": statistics.median(ms[(s, nb)])} for s, nb in cells]}


def tutorial_loop_sentences(result: dict, matrix_rows) -> list[str]:
    """What the tutorial's own experiment (:func:`tutorial_loop`) shows in this run, beside this lesson's variant
    (:func:`tutorial_matrix`: one large copy with a wait after it): one sentence per finding, from the numbers."""
    if not isinstance(result, dict) or not isinstance(result.get("rows"), list):
        raise TypeError("result must be the dict tutorial_loop() returns (with 'rows')")
    loop, one = matrix_ms(result["rows"]), matrix_ms(matrix_rows)
    n = result.get("count", "?")
    out = []
    for s in MATRIX_SOURCES:
        blocking, nb = loop[(s, False)], loop[(s, True)]
        if nb < blocking:
            out.append(f"{n} tensors from {s}: non_blocking with one sync took {nb:.2f} ms, {blocking / nb:.2f}x "
                       f"faster than a blocking copy each ({blocking:.2f} ms)")
        else:
            out.append(f"{n} tensors from {s}: non_blocking with one sync took {nb:.2f} ms, no faster than a blocking "
                       f"copy each ({blocking:.2f} ms) in this run")
    gain = max(loop[(s, False)] / loop[(s, True)] for s in MATRIX_SOURCES)
    change = max(abs(one[(s, True)] / one[(s, False)] - 1) for s in MATRIX_SOURCES)
    first = (f"non_blocking made the tutorial's loop up to {gain:.2f}x faster" if gain > 1 else
             f"non_blocking made the tutorial's loop no faster in this run (best ratio {gain:.2f}x)")
    out.append(f"{first}; with one copy and a wait right after it (the lesson's variant above) it changed no cell "
               f"by more than {change:.0%}: the flag can pay only where the host has further copies to queue before "
               "it waits")
    return out


# ---- issue 22: the sentences of the copy-engine and matrix sections (pure, tested on the CPU) ---------------

def matrix_ms(rows) -> dict:
    """``{(source, non_blocking): ms}`` of a :func:`tutorial_matrix` result, checked: all six cells."""
    if isinstance(rows, (str, bytes, dict)) or not isinstance(rows, (list, tuple)):
        raise TypeError("rows must be the list tutorial_matrix() returns")
    ms = {}
    for i, r in enumerate(rows):
        if not isinstance(r, dict):
            raise TypeError(f"rows[{i}] must be a dict with source, non_blocking, ms")
        ms[(r.get("source"), r.get("non_blocking"))] = positive_number(f"rows[{i}]['ms']", r.get("ms"))
    missing = [(s, nb) for s in MATRIX_SOURCES for nb in (False, True) if (s, nb) not in ms]
    if missing:
        raise ValueError(f"rows lacks the cell(s) {missing}")
    return ms


def matrix_sentences(rows) -> list[str]:
    """What the tutorial's matrix shows in this run, one sentence per finding, decided by its numbers."""
    ms = matrix_ms(rows)
    best = {s: min(ms[(s, False)], ms[(s, True)]) for s in MATRIX_SOURCES}
    pag, pin, then = best["pageable"], best["pinned"], best["pin_memory() then copy"]
    out = [f"a copy from memory pinned once and reused was the fastest source: {pag / pin:.1f}x faster than pageable"
           if pin < min(pag, then) else
           f"the pinned source was not the fastest here (pinned {pin:.3f} ms, pageable {pag:.3f} ms)"]
    if then > pag:
        out.append(f"pinning then copying cost more than the pageable copy it replaces ({then / pag:.2f}x), as the "
                   "tutorial warns: the pin is a second full copy, plus a pinned allocation")
    else:
        out.append(f"pinning then copying cost {then / pag:.2f}x the pageable copy here: less, not the 'up to twice "
                   "as slow' the tutorial saw (the pin reused a cached pinned block, one host memcpy, and the copy "
                   "from it skipped the driver's staging)")
    change = max(abs(ms[(s, True)] / ms[(s, False)] - 1) for s in MATRIX_SOURCES)
    out.append(f"with a sync right after each copy, non_blocking changed no cell by more than {change:.0%}: the "
               "flag frees the host only when it has other work to do before the wait")
    return out


# ---- issue 31: the notebook's reasons (why a fact may not hold on some machine) and table columns ----------

#: why a claim or an observation of the notebook may not hold on some machine: ``why=stalls.WHY.stage_size``
WHY = Reasons(
    pinned_enqueued="a copy from pinned memory is only enqueued (the CUDA Runtime API documents it as asynchronous); "
                    "only a host stalled for half the busy time in most tries of one size (an overloaded machine) "
                    "could make it look as if it waited",
    stage_size="how large a pageable copy the driver stages behind the queue is undocumented driver behaviour; a GPU "
               "that reads pageable memory through the host's page tables (GH200, not measured here, docs/facts.md "
               "F15) need not stage it at all",
    stage_small="staging small pageable copies is undocumented driver behaviour; HIP documents every pageable copy "
                "as synchronous (ROCm, not measured here, docs/facts.md F17)",
    staged_costs="a pageable copy of that size that the driver stages (another driver; a GH200, not measured here) "
                 "costs the host a staging memcpy, not a wait",
    staged_intact="a pageable copy is read into staging at the call, so its data cannot change; a copy that came out "
                  "wrong would be a driver or hardware fault",
    pool_size="the staging pool's size is undocumented driver behaviour (another driver, WSL2 or a GH200 may differ), "
              "and HIP documents every pageable copy as synchronous (WSL2, GH200, ROCm: not measured here, "
              "docs/facts.md F15, F17, F18)",
    d2h_pageable="every CUDA driver this course ran returned only once the copy had completed, as the API "
                 "synchronization behavior page promised up to CUDA 11.0; from CUDA 12.2 on the page says only "
                 "'might be synchronous' (docs/facts.md F7): a driver that returns earlier would fail it",
    done="the call returned after the copy had completed",
    d2h_pinned="a copy into pinned memory is only enqueued (documented); only a host stalled for half the busy time "
               "could make it look as if it waited",
    d2h_stale="the host reads within microseconds while the copy waits behind 20 ms of GPU work; only a host stalled "
              "for that long between the call and the read could see the new data",
    event="an event recorded after the copy on its stream completes only once the copy has",
    to_cpu="torch allocates the result of a non_blocking copy to the CPU in pinned memory and only enqueues the "
           "copy; the host reads within microseconds while the copy waits behind 20 ms of GPU work",
    hidden="torch.tensor(list, device=...) makes a blocking copy and .item() needs the value, so both wait for the "
           "busy GPU; a copy from pinned memory and a launch are only enqueued. Only a host stalled for half the "
           "busy time (an overloaded machine) could turn a 'did not block' into 'blocked'",
    gathered="the 8 MiB temporary is pageable: whether its copy waits is the driver's staging decision (section 1), "
             "undocumented; a driver that stages it, or a GH200 that reads it directly (not measured here, "
             "docs/facts.md F15), returns at once",
    read_back="the host reads within microseconds while the copy waits behind 20 ms of GPU work (only a host "
              "stalled that long could see the new value early); the event completes only after the copy; a copy "
              "into pageable host memory returns once it has completed (so on every CUDA driver this course ran, "
              "and documented up to CUDA 11.0: docs/facts.md F7)",
    advice_documented="a copy from or into pinned memory is only enqueued (documented), a copy into pageable host "
                      "memory returns once it has completed (documented up to CUDA 11.0, docs/facts.md F7, and so "
                      "on every driver this course ran); only a host stalled for half the busy time could change an "
                      "outcome",
    advice_staging="when a pageable copy waits is undocumented driver behaviour (the staging limits of sections 1 "
                   "and 2); HIP documents every pageable copy as synchronous (ROCm), on a GH200 it need not wait "
                   "(not measured here: docs/facts.md F15, F17)",
    slow_link="over a slow link (PCIe Gen3) the link caps the pinned copy near the staging's rate; on a GH200 (not "
              "measured here, docs/facts.md F15) the GPU reads pageable memory directly",
    bitwise="every tensor is compared bitwise after a sync; a wrong one would be a fault, not a timing",
    tutorial="the driver stages each pageable copy on the host either way, and once the staging pool is full "
             "(section 2) a non_blocking copy waits too; a fast host and an idle GPU make each blocking round trip "
             "short",
)


#: the columns of the notebook's tables (``pinlab.table(rows, stalls.SWEEP_COLUMNS)``)
SWEEP_COLUMNS = [("bytes", "size", fmt_bytes), ("copy_pageable_ms", "copy_ pageable", fmt_ms),
                 ("to_pageable_ms", ".to pageable", fmt_ms), ("copy_pinned_ms", "copy_ pinned", fmt_ms),
                 ("to_pinned_ms", ".to pinned", fmt_ms)]
MATRIX_COLUMNS = [("source", "16 MiB from"), ("non_blocking", "non_blocking"), ("ms", "host ms until done", fmt_ms)]


def loop_columns(result: dict) -> list:
    """The columns of the table of the tutorial's own experiment (a :func:`tutorial_loop` result: its count and
    size name the first column)."""
    if not isinstance(result, dict) or "count" not in result or "bytes_each" not in result:
        raise TypeError("result must be the dict tutorial_loop() returns (with 'count' and 'bytes_each')")
    return [("source", f"{result['count']} x {fmt_bytes(result['bytes_each'])} from"), ("non_blocking", "non_blocking"),
            ("ms", "host ms until all are done", fmt_ms)]
