"""Lesson 01's library: the reference answers (``gbps``, ``n_half``) and the plumbing experiments.

The lesson's key code, the timed copy, the bandwidth sweep and the burst that measures the
interval between back-to-back small copies, is defined in ``notebooks/src/01_pinned_memory.py`` and handed to
``pinlab.measure`` there. What stays here: the two reference answers the exercise checkers import
(``pinlab.checks.l01``), the copy-loop peak the sweep is compared with, the cost of pinning and
the allocator's rounding and caching, and for "who pins" the data set the DataLoader loop reads
(:class:`PageableBatches`), the speed-up of pinning from several threads (:func:`speedups`) and
its plot (the loops themselves are the notebook's).

Why about 590 lines, above the course's ~500: besides those, lesson 01's pinning knobs, pinning that fails and
the pageable copy's host cost (issue 22), and the notebook's reasons (:data:`WHY`) and table columns (issue 31:
the notebook keeps one line per fact, this module the excuse and the formatting).
"""
from __future__ import annotations

import numbers
import statistics
import time

import torch
from torch.utils.data import Dataset

from ..args import positive_int, positive_number, size_list
from ..child import run_child
from ..claims import Reasons
from ..device import require_cuda
from ..hostmem import host_stats, release_cached_host_blocks
from ..progress import progress
from ..text import fmt_bytes
from ..timing import cuda_time, fmt_ms

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
DEFAULT_SIZES = [KiB << (2 * i) for i in range(11)]  # the bandwidth sweep: 1 KiB, 4 KiB, ... 1 GiB
LATENCY_SIZES = [KiB << (2 * i) for i in range(6)]   # the latency bursts: 1 KiB, 4 KiB, ... 1 MiB
PIN_COST_SIZES = (MiB, 16 * MiB, 256 * MiB)
ROUNDING_REQUEST = 129 * MiB + 512 * KiB             # 129.5 MiB: rounded up to 256 MiB
PIN_THREADS = [0, 1, 2, 4, 8]                        # pinning from several threads: pool sizes (0: the main thread)


# ---- reference answers (the exercise checkers import these) -------------------------------------

def gbps(nbytes: float, ms: float) -> float:
    """Bandwidth in GB/s (10**9 bytes per second) of moving ``nbytes`` in ``ms`` milliseconds."""
    nbytes = positive_number("nbytes", nbytes, allow_zero=True)
    ms = positive_number("ms", ms)
    return nbytes / (ms * 1e-3) / 1e9


def n_half(sizes, rates):
    """The smallest size whose rate reaches at least half the peak (the largest) rate.

    ``sizes`` and ``rates`` are parallel lists in any order; rates need not grow with size.
    Below N½ a copy is mostly latency, above it mostly bandwidth.
    """
    if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__len__"):
        raise TypeError(f"sizes must be a list of sizes, got {type(sizes).__name__}")
    if isinstance(rates, (str, bytes)) or not hasattr(rates, "__len__"):
        raise TypeError(f"rates must be a list of rates, got {type(rates).__name__}")
    if len(sizes) == 0:
        raise ValueError("sizes must not be empty")
    if len(sizes) != len(rates):
        raise ValueError(f"sizes and rates must be equally long, got {len(sizes)} and {len(rates)}")
    for i, s in enumerate(sizes):
        positive_number(f"sizes[{i}]", s)
    rates = [positive_number(f"rates[{i}]", r, allow_zero=True) for i, r in enumerate(rates)]
    peak = max(rates)
    return min(s for s, r in zip(sizes, rates) if r >= peak / 2)


# ---- plumbing experiments (GPU) ------------------------------------------------------------------

def copy_loop_peak(nbytes: int = 256 * MiB, iters: int = 8, trials: int = 3) -> dict:
    """The best pinned H2D rate a plain loop of back-to-back copies reaches (GB/s), the reference peak."""
    nbytes = positive_int("nbytes", nbytes)
    iters = positive_int("iters", iters)
    trials = positive_int("trials", trials)
    require_cuda("copy_loop_peak()")
    src = torch.ones(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    def loop():
        for _ in range(iters):
            dst.copy_(src, non_blocking=True)

    stats = cuda_time(loop, repeat=trials)
    del src, dst
    return {"bytes": nbytes, "iters": iters, "best_GBps": gbps(nbytes * iters, stats.min),
            "median_GBps": gbps(nbytes * iters, stats.median)}


def _ms(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def pin_cost(sizes=PIN_COST_SIZES) -> list[dict]:
    """Host ms to get pinned memory cold (cudaHostAlloc) and warm (a cached block), per size.

    Also: ``pin_memory()`` of a pageable tensor (allocation + memcpy), warm and cold, a pageable H2D copy and a
    pinned H2D copy of the same size (host ms until the copy is done), and how many
    cudaHostAlloc calls each step made (``num_host_alloc`` from ``host_memory_stats``).
    """
    sizes = size_list("sizes", sizes)
    require_cuda("pin_cost()")
    torch.ones(16, dtype=torch.uint8).pin_memory()  # the first pin_memory() of a process pays a one-off cost
    rows = []
    for n in progress(sizes, desc="pin cost"):
        src = torch.ones(n, dtype=torch.uint8)
        dev = torch.empty(n, dtype=torch.uint8, device="cuda")
        dev.copy_(src)  # warm the copy path
        torch.cuda.synchronize()
        release_cached_host_blocks()
        a0 = host_stats().get("num_host_alloc", 0)
        holder = {}
        cold = _ms(lambda: holder.__setitem__("t", torch.empty(n, dtype=torch.uint8, pin_memory=True)))
        a1 = host_stats().get("num_host_alloc", 0)
        del holder["t"]
        warm = _ms(lambda: holder.__setitem__("t", torch.empty(n, dtype=torch.uint8, pin_memory=True)))
        a2 = host_stats().get("num_host_alloc", 0)
        del holder["t"]
        pin_warm = _ms(lambda: holder.__setitem__("t", src.pin_memory()))
        del holder["t"]
        release_cached_host_blocks()
        pin_cold = _ms(lambda: holder.__setitem__("t", src.pin_memory()))
        pinned = holder.pop("t")

        def pageable_copy():
            dev.copy_(src)
            torch.cuda.synchronize()

        def pinned_copy():
            dev.copy_(pinned, non_blocking=True)
            torch.cuda.synchronize()

        rows.append({
            "bytes": n,
            "alloc_cold_ms": cold, "alloc_cold_host_allocs": a1 - a0,
            "alloc_warm_ms": warm, "alloc_warm_host_allocs": a2 - a1,
            "pin_memory_warm_ms": pin_warm, "pin_memory_cold_ms": pin_cold,
            "h2d_pageable_ms": min(_ms(pageable_copy) for _ in range(3)),
            "h2d_pinned_ms": min(_ms(pinned_copy) for _ in range(3)),
        })
        del src, dev, pinned
    torch.cuda.synchronize()
    release_cached_host_blocks()
    return rows


def pinned_rounding(request_bytes: int = ROUNDING_REQUEST) -> dict:
    """How many bytes the caching host allocator pins for one request, and when it lets them go.

    ``allocated_bytes.current`` of ``torch.cuda.host_memory_stats()`` (the bytes the allocator holds
    from ``cudaHostAlloc``, in use or cached) is read before the allocation, after it, after ``del``
    of the tensor (the block is freed into the allocator's cache, still page-locked) and after the
    cache is emptied (``torch._C._host_emptyCache()``: the block goes back to the driver).
    """
    request_bytes = positive_int("request_bytes", request_bytes)
    require_cuda("pinned_rounding()")
    release_cached_host_blocks()
    key = "allocated_bytes.current"
    before = host_stats().get(key, 0)
    t = torch.empty(request_bytes, dtype=torch.uint8, pin_memory=True)
    after = host_stats().get(key, 0)
    del t
    torch.cuda.synchronize()
    after_free = host_stats().get(key, 0)
    release_cached_host_blocks()
    released = host_stats().get(key, 0)
    return {
        "request_bytes": request_bytes,
        "pinned_bytes_delta": after - before,
        "held_before": before,
        "held_after_free": after_free,
        "held_after_release": released,
    }


# ---- who pins: the DataLoader's data, and pinning from several threads ----------------------------

class PageableBatches(Dataset):
    """A data set whose every item is one ready batch: a fresh pageable float32 tensor of ``nbytes``
    (a clone, as a collate function returns a new tensor). Use it with ``batch_size=None``."""

    def __init__(self, batches: int, nbytes: int):
        self.batches = positive_int("batches", batches)
        nbytes = positive_int("nbytes", nbytes, maximum=GiB)
        if nbytes % 4:
            raise ValueError(f"nbytes must be a multiple of 4 (float32 elements), got {nbytes}")
        self.data = torch.ones(nbytes // 4)

    def __len__(self) -> int:
        return self.batches

    def __getitem__(self, i):
        if isinstance(i, bool) or not isinstance(i, numbers.Integral):
            raise TypeError(f"i must be an int index, got {type(i).__name__}")
        if not 0 <= i < self.batches:
            raise IndexError(f"i must be in [0, {self.batches}), got {i}")
        return self.data.clone()


def speedups(ms_by_threads) -> dict:
    """``{threads: ms[1] / ms[threads]}`` from ``{threads: ms or a list of ms (its median is used)}``.

    The speed-up of doing the same work from ``threads`` threads instead of one: 1.0 means no gain,
    ``threads`` means perfect scaling. Needs the one-thread entry.
    """
    if not isinstance(ms_by_threads, dict) or not ms_by_threads:
        raise TypeError(f"ms_by_threads must be a non-empty dict {{threads: ms}}, got {type(ms_by_threads).__name__}")
    med = {}
    for t, v in ms_by_threads.items():
        t = positive_int("ms_by_threads key (threads)", t)
        if isinstance(v, (list, tuple)):
            if not v:
                raise ValueError(f"ms_by_threads[{t}] must not be an empty list")
            v = statistics.median(positive_number(f"ms_by_threads[{t}][{i}]", x) for i, x in enumerate(v))
        med[t] = positive_number(f"ms_by_threads[{t}]", v)
    if 1 not in med:
        raise ValueError(f"ms_by_threads must have the one-thread entry (key 1), got keys {sorted(med)}")
    return {t: med[1] / med[t] for t in sorted(med)}


def plot_pin_threads(rows, *, title: str, ax=None):
    """Host ms to pin all the tensors against the pool size, cold and warm (medians), with perfect
    scaling from a pool of one (dotted) and the main thread without a pool (``threads`` 0: dashed).
    ``rows``: ``[{"threads", "cold_ms": [...], "warm_ms": [...]}]``."""
    from ..plots import color_for, legend_outside, subplots

    if isinstance(rows, (str, bytes, dict)) or not isinstance(rows, (list, tuple)) or not rows:
        raise TypeError("rows must be a non-empty list of {'threads', 'cold_ms', 'warm_ms'}")
    threads_all = [positive_int(f"rows[{i}]['threads']", r.get("threads") if isinstance(r, dict) else None,
                                allow_zero=True) for i, r in enumerate(rows)]
    pool = [(t, r) for t, r in zip(threads_all, rows) if t > 0]
    main = [r for t, r in zip(threads_all, rows) if t == 0]
    if not pool:
        raise ValueError("rows must have at least one pool size (threads >= 1)")
    if ax is None:
        _, ax = subplots(figsize=(6.5, 4))
    threads = [t for t, _ in pool]
    for key, label, style in (("cold_ms", "cold: every block a new cudaHostAlloc", "o-"),
                              ("warm_ms", "warm: blocks from the cache (copy only)", "s-")):
        med = [statistics.median(r[key]) for _, r in pool]
        line, = ax.plot(threads, med, style, label=f"{label}, from a pool", color=color_for(label))
        if 1 in threads:
            one = med[threads.index(1)]
            ax.plot(threads, [one / t for t in threads], ":", color=line.get_color(), lw=1,
                    label="perfect scaling" if key == "warm_ms" else None)
        if main:
            ax.axhline(statistics.median(main[0][key]), color=line.get_color(), ls="--", lw=1,
                       label=f"{key[:4]}: the main thread, no pool")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(threads)
    ax.set_xticklabels([str(t) for t in threads])
    ax.set_xlabel("threads in the pool")
    ax.set_ylabel("host ms until every tensor is pinned")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    legend_outside(ax, ncols=2)
    return ax


# ---- issue 22: PyTorch's pinning knobs, pinning that fails, why pageable copies are slow -------------------

#: ``PYTORCH_CUDA_ALLOC_CONF`` settings of the caching host allocator compared by :func:`pinning_knobs`.
#: ``pinned_use_cuda_host_register`` makes the allocator ``malloc`` + ``cudaHostRegister`` (page-locking in
#: ``pinned_num_register_threads`` threads) instead of ``cudaHostAlloc``; ``pinned_max_round_threshold_mb``
#: (torch >= 2.13) stops the power-of-two rounding above that size. A torch that does not know a key says so:
#: the child's error is recorded, nothing is replayed in its place.
PINNING_CONFIGS = {
    "default (cudaHostAlloc)": "",
    "cudaHostRegister, 1 thread": "pinned_use_cuda_host_register:True,pinned_num_register_threads:1",
    "cudaHostRegister, 8 threads": "pinned_use_cuda_host_register:True,pinned_num_register_threads:8",
    "round only up to 64 MB": "pinned_max_round_threshold_mb:64",
}
#: the torch release that brought a setting, where a torch may lack it (the notebook names it when refused)
KNOB_SINCE = {"pinned_max_round_threshold_mb": "2.13"}
KNOB_REQUEST = 600 * MiB  # not a power of two: rounded to 1 GiB by default

_CHILD_PIN = r"""
import json, os, resource, sys, time, torch
limit, n = int(sys.argv[1]), int(sys.argv[2])
if limit > 0:
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (limit, limit))
soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
cap_eff = None
try:  # CapEff: the capabilities this process has; CAP_IPC_LOCK (bit 14) lets it lock any amount
    with open("/proc/self/status") as fh:
        cap_eff = next((ln.split()[1] for ln in fh if ln.startswith("CapEff:")), None)
except OSError:
    pass
torch.cuda.init()
key = "allocated_bytes.current"
before = torch.cuda.host_memory_stats().get(key, 0)
out = {"torch": torch.__version__, "euid": os.geteuid(), "cap_eff": cap_eff,
       "memlock_bytes": None if soft == resource.RLIM_INFINITY else soft}
try:
    t0 = time.perf_counter()
    x = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    out["ms"] = (time.perf_counter() - t0) * 1e3
    out["pinned"] = bool(x.is_pinned())
    out["held_bytes"] = torch.cuda.host_memory_stats().get(key, 0) - before
except Exception as exc:  # the error a program must handle: recorded as it is
    out["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
print("PINLAB_CHILD " + json.dumps(out))  # pinlab.child.MARK
"""


def _pin_in_child(conf: str, request_bytes: int, memlock_limit: int = 0, timeout_s: float = 120.0) -> dict:
    import os

    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env.pop("PYTORCH_ALLOC_CONF", None)  # torch >= 2.9 reads this name too: the child gets only `conf`
    if conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = conf
    return run_child(_CHILD_PIN, (memlock_limit, request_bytes), env=env, timeout_s=timeout_s)


def pinning_knobs(request_bytes: int = KNOB_REQUEST, configs=None, timeout_s: float = 120.0) -> dict:
    """One cold pinned allocation of ``request_bytes`` in a fresh process per allocator setting
    (:data:`PINNING_CONFIGS`): host ms, whether it is pinned, the bytes the allocator holds for it (the
    rounding), or the error this torch gave. CUDA only (the children need a GPU)."""
    request_bytes = positive_int("request_bytes", request_bytes, maximum=8 * GiB)
    timeout_s = positive_number("timeout_s", timeout_s, maximum=600.0)
    configs = dict(PINNING_CONFIGS if configs is None else configs)
    if not configs or not all(isinstance(k, str) and isinstance(v, str) for k, v in configs.items()):
        raise TypeError("configs must be a non-empty dict of label -> PYTORCH_CUDA_ALLOC_CONF string")
    require_cuda("pinning_knobs()")
    rows = [{"setting": label, "conf": conf, **_pin_in_child(conf, request_bytes, timeout_s=timeout_s)}
            for label, conf in progress(configs.items(), desc="allocator settings")]
    return {"request_bytes": request_bytes, "torch": torch.__version__, "rows": rows}


def pinning_under_memlock(limit_bytes: int = 64 * MiB, request_bytes: int = 256 * MiB,
                          timeout_s: float = 120.0) -> dict:
    """Pin ``request_bytes`` in a child whose memlock limit (``ulimit -l``) is ``limit_bytes``, with
    ``cudaHostAlloc`` (the default) and with ``cudaHostRegister``: which one the limit stops, and the
    error a program then gets. CUDA only."""
    limit_bytes = positive_int("limit_bytes", limit_bytes, maximum=GiB)
    request_bytes = positive_int("request_bytes", request_bytes, maximum=4 * GiB)
    timeout_s = positive_number("timeout_s", timeout_s, maximum=600.0)
    require_cuda("pinning_under_memlock()")
    rows = []
    for label in ("default (cudaHostAlloc)", "cudaHostRegister, 1 thread"):
        conf = PINNING_CONFIGS[label]
        rows.append({"setting": label, "conf": conf,
                     **_pin_in_child(conf, request_bytes, memlock_limit=limit_bytes, timeout_s=timeout_s)})
    return {"limit_bytes": limit_bytes, "request_bytes": request_bytes, "rows": rows}


def pageable_and_memcpy(sizes=(16 * MiB, 64 * MiB, 256 * MiB), reps: int = 9) -> list[dict]:
    """Per size: GB/s of a pageable H2D copy, a pageable D2H copy, and a host-to-host copy of the same bytes, two
    ways: ``q.copy_(p)`` (torch's copy, split over its intra-op threads) and ``ctypes.memmove`` (the C library's
    memmove on the calling thread alone). Medians of ``reps`` interleaved rounds after one untimed round (every page
    of every buffer touched first). Nothing changes torch's thread pool inside the rounds: the one-thread copy is
    the C library's, not torch's under ``set_num_threads(1)``, so no timed round pays for resizing the pool or
    runs on a pool just resized. How many threads the driver's staging copy uses is undocumented (CUDA only)."""
    import ctypes

    sizes = size_list("sizes", sizes)
    reps = positive_int("reps", reps, maximum=100)
    require_cuda("pageable_and_memcpy()")

    def seconds(fn):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    rows = []
    for n in progress(sizes, desc="pageable vs memcpy"):
        p = torch.ones(n, dtype=torch.uint8)       # ones / full: every page written before timing
        q = torch.full((n,), 7, dtype=torch.uint8)
        d = torch.empty(n, dtype=torch.uint8, device="cuda")
        cases = {"h2d_gbps": lambda: d.copy_(p), "d2h_gbps": lambda: q.copy_(d),
                 "memcpy_gbps": lambda: q.copy_(p),                                    # torch's threads
                 "memcpy_1t_gbps": lambda: ctypes.memmove(q.data_ptr(), p.data_ptr(), n)}  # one thread, libc
        for fn in cases.values():                  # untimed round: first touches, lazy loading
            seconds(fn)
        times = {k: [] for k in cases}
        for _ in range(reps):                      # interleaved: every case once per round
            for k, fn in cases.items():
                times[k].append(seconds(fn))
        rows.append({"bytes": n, **{k: n / statistics.median(t) / 1e9 for k, t in times.items()},
                     "intra_op_threads": torch.get_num_threads()})
        del p, q, d
    return rows


def numa_report() -> dict:
    """The host's NUMA nodes and the GPU's node, from /sys (None where this machine cannot tell). With one
    node there is no near or far memory to compare: the lesson says so instead of measuring."""
    import glob
    import os
    import subprocess

    nodes = sorted(os.path.basename(p) for p in glob.glob("/sys/devices/system/node/node[0-9]*"))
    gpu_node = None
    try:
        bus = subprocess.run(["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10).stdout.strip().splitlines()
        if bus:
            tail = bus[0].strip().lower()[-12:]
            found = glob.glob(f"/sys/bus/pci/devices/*{tail}/numa_node")
            gpu_node = int(open(found[0]).read().strip()) if found else None
    except (OSError, ValueError, subprocess.SubprocessError):
        gpu_node = None
    return {"nodes": len(nodes) or None, "gpu_node": gpu_node}


# ---- issue 22: pure helpers the notebook's sentences come from (tested on the CPU) ------------------------

CAP_IPC_LOCK = 14  # the capability bit that lets a process lock any amount of memory (linux/capability.h)


def may_lock_any(cap_eff) -> bool | None:
    """Whether a process with this ``CapEff`` (the hex mask in ``/proc/<pid>/status``) holds CAP_IPC_LOCK, and so
    may lock any amount of memory whatever ``ulimit -l`` says; None where the mask is unknown."""
    if cap_eff is None:
        return None
    if not isinstance(cap_eff, str):
        raise TypeError(f"cap_eff must be the hex string of CapEff or None, got {type(cap_eff).__name__}")
    try:
        mask = int(cap_eff.strip(), 16)
    except ValueError:
        raise ValueError(f"cap_eff must be a hex mask such as '000001ffffffffff', got {cap_eff!r}"[:200]) from None
    return bool(mask >> CAP_IPC_LOCK & 1)


def unknown_alloc_key(error) -> str | None:
    """The allocator setting a torch refused (``Unrecognized key 'X' in CUDA allocator config``), else None."""
    import re

    if error is None:
        return None
    if not isinstance(error, str):
        raise TypeError(f"error must be a str or None, got {type(error).__name__}")
    found = re.search(r"[Uu]nrecognized key '?([A-Za-z0-9_]+)'?", error)
    return found.group(1) if found else None


def memlock_sentence(row: dict, limit_bytes: int) -> str:
    """What one pin under ``ulimit -l limit_bytes`` shows (a row of :func:`pinning_under_memlock`), in words."""
    if not isinstance(row, dict) or "setting" not in row:
        raise TypeError("row must be a dict from pinning_under_memlock()['rows']")
    limit_bytes = positive_int("limit_bytes", limit_bytes)
    limit = f"{limit_bytes / MiB:g} MiB"
    if row.get("error"):
        return f"{row['setting']}: failed under a {limit} memlock limit with {row['error']}"
    if may_lock_any(row.get("cap_eff")) or (row.get("cap_eff") is None and row.get("euid") == 0):
        who = "runs as root, with CAP_IPC_LOCK" if row.get("euid") == 0 else "holds CAP_IPC_LOCK"
        if row.get("cap_eff") is None:
            who = "runs as root (its capabilities unknown)"
        return (f"{row['setting']}: pinned fine, but this process {who}: it may lock any amount, so the "
                f"{limit} limit could not bite here")
    return (f"{row['setting']}: pinned fine under a {limit} limit without CAP_IPC_LOCK: this driver did not count "
            "the pinned memory against ulimit -l")


#: a pageable H2D copy counts as faster than one thread's memcpy above this share of its rate
FASTER = 1.1


def pageable_summary(rows) -> str:
    """What the rows of :func:`pageable_and_memcpy` show together, in words: at how many sizes pageable H2D ran
    faster than one thread's memcpy (by :data:`FASTER`, as :func:`pageable_sentence` says it per size)."""
    rows = list(rows)
    if not rows:
        raise ValueError("rows must hold at least one row of pageable_and_memcpy()")
    above = sum(_memcpy_share(r) > FASTER for r in rows)
    head = f"pageable H2D ran faster than one thread's memcpy at {above} of {len(rows)} sizes"
    if above == len(rows):
        return head + ": one thread's memcpy did not bound it at any size"
    if above:
        others = "at the other size" if len(rows) - above == 1 else "at the others"
        return (head + f": at those sizes one thread's memcpy did not bound it; {others} it ran close to or "
                "below it (the lines above say which)")
    return head + ": at every size it ran no faster than one thread's memcpy"


def _memcpy_share(row: dict) -> float:
    """A row's pageable H2D rate over the host's one-thread memcpy rate (both checked)."""
    if not isinstance(row, dict):
        raise TypeError("row must be a dict from pageable_and_memcpy()")
    return (positive_number("row['h2d_gbps']", row["h2d_gbps"])
            / positive_number("row['memcpy_1t_gbps']", row["memcpy_1t_gbps"]))


def pageable_sentence(row: dict) -> str:
    """How a pageable H2D copy compared with the host's one-thread memcpy of the same bytes, and with torch's
    threaded copy (a row of :func:`pageable_and_memcpy`), in words."""
    share = _memcpy_share(row)
    size = f"{row['bytes'] / MiB:g} MiB"
    if share > FASTER:
        how = ("faster than it: the driver's staging copied faster than one thread's memcpy (how it copies, and "
               "on how many threads, is undocumented), so one thread's memcpy does not bound it here")
    elif share >= 0.6:
        how = "close to it: the staging memcpy can account for most of the copy's time"
    else:
        how = ("well below it: the memcpy alone does not explain the copy's time (the rest is the driver's, "
               "staging in chunks and moving each by DMA, undocumented)")
    text = f"at {size} pageable H2D ran at {share:.0%} of the host's one-thread memcpy, {how}"
    if row.get("memcpy_gbps") is not None:
        threaded = row["h2d_gbps"] / positive_number("row['memcpy_gbps']", row["memcpy_gbps"])
        text += f"; and at {threaded:.0%} of torch's threaded host copy"
    return text


def numa_sentence(nodes, gpu_node) -> str:
    """What :func:`numa_report` found, in words: one node (nothing to compare), or where the GPU sits."""
    if nodes is None:
        return "this machine does not say how its memory is split into NUMA nodes (no /sys/devices/system/node)"
    nodes = positive_int("nodes", nodes)
    if nodes == 1:
        return ("one NUMA node: every page of host memory is as near the GPU as any other, so there is no near or "
                "far memory to compare here")
    where = ("the GPU's node is not known (the kernel reports -1)" if gpu_node in (None, -1)
             else f"the GPU hangs off node {gpu_node}")
    return (f"{nodes} NUMA nodes, and {where}: pinned buffers and the threads that fill them belong on the GPU's "
            "node (numactl --cpunodebind=N --membind=N); this course does not measure the difference")


# ---- issue 31: the notebook's reasons (why a fact may not hold on some machine) and table columns ----------

#: why a claim or an observation of the notebook may not hold on some machine: ``why=bw.WHY.link``
WHY = Reasons(
    pin_memory="this is torch's documented behaviour of pin_memory(); only a torch build that changed it, or "
               "pinning that failed (a memlock limit), could make it differ",
    link="over a PCIe Gen3 link the link caps the pinned copy near the staging's rate, and on a GH200 (not measured "
         "here, docs/facts.md F15) the GPU reads pageable memory through the host's page tables; three learners "
         "copying at once share the link",
    fast_launch="a very fast host launch against a slow link narrows the gap between small and large copies",
    two_moments="the two were measured at different moments, and other copies on the machine (other users of a "
                "shared GPU, a neighbour in a virtual machine) share the link",
    slow_queue="a slow or busy host (2 cores, other users) can take longer to queue a burst than the GPU stays busy; "
               "those rounds were dropped",
    shared_gpu="on a GPU shared with other processes, their work can land between the copies of a burst",
    slow_link_bytes="on a slow link (PCIe Gen3, x8) the bytes weigh more against the fixed cost of a copy",
    slow_link_peak="a slow link lowers the peak that the small copies are compared with",
    cache_hit="torch's caching host allocator allocates on a miss and reuses a cached free block on a hit; an "
              "allocator setting that stops caching large blocks (pinned_max_cached_size_mb in PYTORCH_ALLOC_CONF, "
              "torch 2.13 and later) would make a warm allocation call cudaHostAlloc again",
    host_timing="host timings: a host busy with other work (other learners, 2 cores) can slow a single warm call",
    rounding="torch's caching host allocator rounds and caches by default; pinned_max_round_threshold_mb or "
             "pinned_max_cached_size_mb (torch 2.13 and later, in PYTORCH_ALLOC_CONF or PYTORCH_CUDA_ALLOC_CONF) set "
             "below the request turn the rounding or the caching off",
    dataloader="these follow from the code of torch's DataLoader and caching host allocator (a pin-memory thread is "
               "started only with worker processes; a freed pinned block is reused once its copy has completed); an "
               "allocator setting that stops caching (pinned_max_cached_size_mb, torch 2.13 and later) would make "
               "every batch call cudaHostAlloc",
    cheap_staging="where the GPU reads pageable memory through the host's page tables (GH200, not measured here, "
                  "docs/facts.md F15), or the driver's staging is fast, a pageable copy call costs the host less",
    cache_counts="counts of torch's caching host allocator: one block per tensor from an empty cache, none from a "
                 "full one; an allocator setting that stops caching (pinned_max_cached_size_mb, torch 2.13 and "
                 "later) changes the warm count",
    default_rounds="torch's caching host allocator rounds by default (unset, pinned_max_round_threshold_mb is "
                   "unlimited); a child that could not pin at all (no pinned memory left on the host) would fail it",
    register_threads="the threads only pre-fault the pages, one cudaHostRegister locks them: on a 2-core host, or "
                     "one busy with other learners, the threads wait for each other",
    fallback="the function's own logic, and torch pinning where an accelerator is available; a machine whose "
             "pinning fails for real (a memlock limit, WSL) would fail the last one: the [measured] line above "
             "says why",
)


def _f2(v) -> str:
    return f"{v:.2f}"


def _f3(v) -> str:
    return f"{v:.3f}"


#: the columns of the notebook's tables (``pinlab.table(rows, bw.BANDWIDTH_COLUMNS)``)
BANDWIDTH_COLUMNS = [("bytes", "size", fmt_bytes), ("h2d_pinned", "H2D pinned GB/s", _f2),
                     ("h2d_pageable", "H2D pageable GB/s", _f2), ("d2h_pinned", "D2H pinned GB/s", _f2),
                     ("d2h_pageable", "D2H pageable GB/s", _f2)]
PIN_COST_COLUMNS = [("bytes", "size", fmt_bytes), ("alloc_cold_ms", "cold alloc", fmt_ms),
                    ("alloc_warm_ms", "warm alloc", fmt_ms), ("pin_memory_cold_ms", "pin_memory() cold", fmt_ms),
                    ("h2d_pageable_ms", "pageable H2D", fmt_ms), ("h2d_pinned_ms", "pinned H2D", fmt_ms)]
LOADER_COLUMNS = [("num_workers", "num_workers"), ("pin_memory", "pin_memory"),
                  ("next_ms", "main thread in next() ms", _f3),
                  ("copy_call_ms", "main thread in the copy call ms", _f3),
                  ("per_batch_ms", "wall ms per batch", _f3)]
KNOB_COLUMNS = [("setting", "setting"), ("ms", "cold pin, host ms"), ("held", "held"), ("error", "error")]
PAGEABLE_COLUMNS = [("bytes", "size", fmt_bytes), ("h2d_gbps", "pageable H2D GB/s", _f2),
                    ("d2h_gbps", "pageable D2H GB/s", _f2), ("memcpy_gbps", "torch's copy_, its threads GB/s", _f2),
                    ("memcpy_1t_gbps", "memmove, one thread GB/s", _f2)]
