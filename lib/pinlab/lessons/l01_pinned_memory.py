"""Lesson 01 experiments: H2D/D2H bandwidth, pinned vs pageable, and the cost of pinning."""
from __future__ import annotations

import time

import torch

from ..args import positive_int, require_cuda, size_list
from ..hostmem import host_stats, release_cached_host_blocks
from ..progress import progress
from ..timing import cuda_time

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
DEFAULT_SIZES = [KiB << (2 * i) for i in range(11)]  # 1 KiB, 4 KiB, ... 1 GiB


def gbps(nbytes: float, ms: float) -> float:
    """Bandwidth in GB/s (10**9 bytes per second) of moving ``nbytes`` in ``ms`` milliseconds."""
    if ms <= 0:
        raise ValueError(f"ms must be > 0, got {ms}")
    return nbytes / (ms * 1e-3) / 1e9


def copy_bandwidth(sizes=DEFAULT_SIZES, repeat: int = 5) -> list[dict]:
    """Median GPU time (CUDA events) of one copy per size and direction, pinned vs pageable host side.

    Returns one row per size: ``{"bytes", "h2d_pinned_ms", "h2d_pageable_ms", "d2h_pinned_ms",
    "d2h_pageable_ms"}``. Buffers are allocated once at the largest size and sliced.
    """
    sizes = size_list("sizes", sizes)
    repeat = positive_int("repeat", repeat)
    require_cuda("copy_bandwidth()")
    top = max(sizes)
    pinned = torch.ones(top, dtype=torch.uint8, pin_memory=True)
    pageable = torch.ones(top, dtype=torch.uint8)  # ones: touch every page before timing
    dev = torch.ones(top, dtype=torch.uint8, device="cuda")
    rows = []
    for n in progress(sizes, desc="bandwidth sweep"):
        row = {"bytes": n}
        d, pin, pag = dev[:n], pinned[:n], pageable[:n]
        row["h2d_pinned_ms"] = cuda_time(lambda: d.copy_(pin, non_blocking=True), repeat=repeat).median
        row["h2d_pageable_ms"] = cuda_time(lambda: d.copy_(pag, non_blocking=True), repeat=repeat).median
        row["d2h_pinned_ms"] = cuda_time(lambda: pin.copy_(d, non_blocking=True), repeat=repeat).median
        row["d2h_pageable_ms"] = cuda_time(lambda: pag.copy_(d, non_blocking=True), repeat=repeat).median
        rows.append(row)
    del pinned, pageable, dev
    torch.cuda.synchronize()
    return rows


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


def pin_cost(sizes=(MiB, 16 * MiB, 256 * MiB, GiB)) -> list[dict]:
    """Host ms to get pinned memory cold (cudaHostAlloc) and warm (a cached block), per size.

    Also: ``pin_memory()`` of a pageable tensor (allocation + memcpy), warm and cold, a pageable H2D copy and a
    pinned H2D copy of the same size (host ms until the copy is done), and how many
    cudaHostAlloc calls each step made (``num_host_alloc`` from ``host_memory_stats``).
    """
    sizes = size_list("sizes", sizes)
    require_cuda("pin_cost()")
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


def pinned_rounding(request_bytes: int = 129 * MiB + 512 * KiB) -> dict:
    """How many bytes the caching host allocator really pins for one request."""
    request_bytes = positive_int("request_bytes", request_bytes)
    require_cuda("pinned_rounding()")
    release_cached_host_blocks()
    before = host_stats()
    t = torch.empty(request_bytes, dtype=torch.uint8, pin_memory=True)
    after = host_stats()
    del t
    torch.cuda.synchronize()
    release_cached_host_blocks()
    released = host_stats()
    key = "allocated_bytes.current"
    return {
        "request_bytes": request_bytes,
        "pinned_bytes_delta": after.get(key, 0) - before.get(key, 0),
        "held_after_release": released.get(key, 0),
        "held_before": before.get(key, 0),
    }
