# %% [markdown]
# # 01 · Pinned memory
#
# **What you will learn**
# - *pageable* against *pinned* (page-locked) host memory, and how to time a copy from each;
# - what a small copy really costs; what pinning costs, cold and warm, and what it holds;
# - who pins in practice, PyTorch's pinning knobs, failures and fallbacks, a pageable copy's cost
#   to the host, NUMA, and when *not* to pin.

# %%
# Install cell: on Colab, or in any Python without the course, run this first.
# Where `import pinlab` works (a clone set up with `make lab`), it does nothing.
import importlib.util

if importlib.util.find_spec("pinlab") is None:
    raise ModuleNotFoundError(
        "pinlab is not installed here, and this copy of the course names no address "
        "to install it from: clone the course and run `make lab` in it (whoever "
        "publishes the course runs `make publish URL=<its address>`)."
    )

# %% tags=["nbval-ignore-output"]
import statistics
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import matplotlib.pyplot as plt
import torch
from torch.utils.data import DataLoader

import pinlab
from pinlab.lessons import l01_pinned_memory as bw
from pinlab.plots import bars, fmt_bytes, size_sweep

pinlab.header("01 pinned memory")
pinned_at_start = pinlab.pinned_baseline()

# %% [markdown]
# ## Two kinds of host memory
#
# The operating system may move or swap out a page of ordinary (*pageable*) memory at any time.
# Over PCIe, the GPU's copy engine reads host memory by physical address, so it can only use memory
# guaranteed to stay put: **page-locked** (*pinned*) memory. So a pageable copy takes two hops: the
# driver copies your data into a pinned *staging* buffer of its own (a CPU `memcpy`), then the copy
# engine moves it.
#
# ```
# pageable:  your tensor --CPU memcpy--> driver's pinned staging --DMA--> GPU
# pinned:    your tensor ---------------------------------------DMA--> GPU
# ```
#
# On Grace Hopper (GH200, over NVLink-C2C) the GPU reads pageable memory through the host's own
# page tables (ATS: one page table for CPU and GPU), so a pageable copy need not be staged and comes
# much closer to pinned. Under HMM (some Linux set-ups) the GPU reaches pageable memory through
# page tables of its own that the driver keeps in step with the host's in software. Both: not
# measured here (CUDA Programming Guide, "Unified Memory": `docs/facts.md` F15, F16).
# `pinlab.platform_facts()` says which kind of machine you are on (`ats`).

# %% [markdown]
# In PyTorch, a CPU tensor is pageable unless you ask: `pin_memory=True` at creation, or
# `t.pin_memory()`, which returns a pinned *copy* of `t`, **unless `t` is already pinned**: then
# it returns `t` itself (`pin_memory` in PyTorch's `aten/src/ATen/native/Memory.cpp`:
# `docs/facts.md` F1). `is_pinned()` tells you which you have.

# %%
plain = torch.empty(1024)
print("torch.empty(...) is pinned:", plain.is_pinned())

# %% [markdown]
# Pinning needs a CUDA (or other accelerator) runtime: on a CPU-only torch, `pin_memory=True`
# raises. Code that must run everywhere gates it, as vLLM does with its `PIN_MEMORY` constant.

# %%
PIN_MEMORY = pinlab.has_cuda()
buf = torch.empty(1024, pin_memory=PIN_MEMORY)
print("pinned exactly when CUDA is available:", buf.is_pinned() == PIN_MEMORY)

# %% [markdown]
# 🔮 **Predict.** `snap = t.pin_memory()` gives you a pinned copy of a pageable `t`. What does
# `snap.pin_memory()` give you: another copy, or `snap` itself? (Without a GPU the cell runs on
# `pinlab.stream()`, which emulates pinning on a CPU: same answer.)
#
# <details><summary>Answer</summary>
#
# `snap` itself, no copy. Lesson 04 is built on this trap: a "snapshot" taken with `pin_memory()`
# of an already pinned buffer is no snapshot.
# </details>

# %%
with pinlab.stream() as s:
    pinlab.show("stream", s.label)
    t = torch.arange(1024)  # pageable
    snap = t.pin_memory()  # a pinned copy
    again = snap.pin_memory()  # already pinned: what comes back?
    new_copy = snap.is_pinned() and snap.data_ptr() != t.data_ptr()
    pinlab.claim(
        "pin_memory() of a pageable tensor is a new, pinned tensor",
        new_copy,
        why=bw.WHY.pin_memory,
    )
    same = again.data_ptr() == snap.data_ptr()
    pinlab.claim(
        "pin_memory() of a pinned tensor returns the same storage, no copy",
        same,
        why=bw.WHY.pin_memory,
    )
    del t, snap, again

# %% [markdown]
# ## Timing one copy
#
# The GPU runs a stream's work in order; a CUDA event is a timestamp it writes when the stream
# reaches it. Record one before the copy and one after, wait for the second: `elapsed_time` is the
# time between them on the GPU's clock.


# %%
def time_copy_ms(dst, src, repeat=5):
    """GPU ms of one copy dst <- src: the median of
    `repeat` copies, each between two CUDA events."""
    dst.copy_(src, non_blocking=True)  # warm-up, untimed
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()  # before the copy
        dst.copy_(src, non_blocking=True)
        end.record()  # after it
        end.synchronize()  # the host waits until the GPU has passed `end`
        times.append(start.elapsed_time(end))  # ms, on the GPU's clock
    return statistics.median(times)


# %% [markdown]
# ## Bandwidth, pinned against pageable
#
# 🔮 **Predict.** At 1 GiB, how much faster is a pinned H2D copy than a pageable one: the same,
# 2×, or more? And at 1 KiB?
#
# <details><summary>Answer</summary>
#
# Over a fast PCIe link, pinned is much faster at 1 GiB: the staging `memcpy` and second hop cost
# a lot. This course measured one machine, an H200 on PCIe Gen5. A slower link (PCIe Gen3, as on
# many cloud T4s; not measured here) would cap the pinned copy closer to the driver's staging rate,
# so the gap should shrink; on a GH200 (not measured here: `docs/facts.md` F15) pageable can come
# close to pinned. At 1 KiB the gap closes, and pinned can even be the slower (the
# `pinned / pageable H2D at 1 KiB` line says which): a tiny copy is nearly all fixed cost.
# </details>
#
# The sweep: one buffer of each kind at the largest size, sliced for the smaller ones. It needs
# about 2 GiB of host memory (half pinned) and 1 GiB on the GPU, and takes a few seconds.


# %%
def bandwidth_sweep(sizes, repeat=5):
    """One row per size: the median ms of one copy, H2D
    and D2H, from pinned and from pageable memory."""
    top = max(sizes)
    pinned = torch.ones(top, dtype=torch.uint8, pin_memory=True)
    # ones: every page touched before timing
    pageable = torch.ones(top, dtype=torch.uint8)
    device = torch.ones(top, dtype=torch.uint8, device="cuda")
    rows = []
    for n in pinlab.progress(sizes, desc="bandwidth sweep"):
        # views: nothing allocated per size
        d, pin, pag = device[:n], pinned[:n], pageable[:n]
        rows.append(
            {
                "bytes": n,
                "h2d_pinned_ms": time_copy_ms(d, pin, repeat),
                "h2d_pageable_ms": time_copy_ms(d, pag, repeat),
                "d2h_pinned_ms": time_copy_ms(pin, d, repeat),
                "d2h_pageable_ms": time_copy_ms(pag, d, repeat),
            }
        )
    return rows


sweep = pinlab.measure(
    "01_bandwidth", bandwidth_sweep, sizes=bw.DEFAULT_SIZES, repeat=5
)
rows = [
    {
        "bytes": r["bytes"],
        **{k[:-3]: bw.gbps(r["bytes"], r[k]) for k in r if k.endswith("_ms")},
    }
    for r in sweep.result
]

# %% tags=["nbval-ignore-output"]
pinlab.table(rows, bw.BANDWIDTH_COLUMNS)

# %%
sizes = [r["bytes"] for r in rows]
size_sweep(
    sizes,
    {
        k.replace("_", " "): [r[k] for r in rows]
        for k in ("h2d_pinned", "h2d_pageable", "d2h_pinned", "d2h_pageable")
    },
    ylabel="GB/s",
    title=f"Copy bandwidth, one copy timed alone ({sweep.tag})",
)
plt.show()

# %% [markdown]
# The lines below compare pinned and pageable at the largest size, and the smallest size's rates
# with the largest's.

# %%
big, small = rows[-1], rows[0]
kinds = ("h2d_pinned", "h2d_pageable", "d2h_pinned", "d2h_pageable")
big_ratio = big["h2d_pinned"] / big["h2d_pageable"]
small_share = max(small[k] for k in kinds) / big["h2d_pinned"]
small_ratio = small["h2d_pinned"] / small["h2d_pageable"]
pinlab.show(
    "pinned / pageable H2D at " + fmt_bytes(small["bytes"]), f"{small_ratio:.2f}x"
)
pinned_wins = pinlab.observe(
    f"at {fmt_bytes(big['bytes'])}, pinned H2D at least 2x faster than pageable",
    big_ratio >= 2,
    value=f"{big_ratio:.1f}x",
    why=bw.WHY.link,
)
small_slow = pinlab.observe(
    f"at {fmt_bytes(small['bytes'])}, every kind of "
    "copy under 5% of the largest size's pinned H2D rate",
    small_share < 0.05,
    value=f"the fastest at {small_share:.1%}",
    why=bw.WHY.fast_launch,
)
pinlab.show(
    "what this run shows",
    f"at {fmt_bytes(big['bytes'])} pinned H2D ran at {big['h2d_pinned']:.1f} GB/s, "
    f"{big_ratio:.1f}x pageable's {big['h2d_pageable']:.1f} GB/s"
    + (
        ""
        if pinned_wins
        else " (less than 2x: a slow link or a GPU that reads pageable memory directly)"
    )
    + f"; at {fmt_bytes(small['bytes'])} the fastest kind reached {small_share:.1%} of "
    "that "
    + (
        "(all fixed cost)"
        if small_slow
        else "(a small copy was not that much slower here)"
    ),
)

# %% [markdown]
# ## Is the sweep honest? Compare with a plain copy loop
#
# The reference: a plain loop of back-to-back 256 MiB pinned copies, timed as a whole; the best of
# 3 trials (`bw.copy_loop_peak`). On a quiet machine the two agree closely, but not to a fixed
# percentage: each sweep point is the median of five single copies, and the PCIe link and host
# memory are shared with whatever else moves data (VM neighbours, other users of a shared GPU).
# Measured at different moments, on a shared machine they can differ by much more than the method
# does. So the ratio is shown, not asserted.

# %%
peak = pinlab.measure("01_copy_loop_peak", bw.copy_loop_peak)
peak_gbps = peak.result["best_GBps"]
ratio = big["h2d_pinned"] / peak_gbps
pinlab.show("copy-loop peak", f"{peak_gbps:.1f} GB/s")
sweep_honest = pinlab.observe(
    f"the sweep's pinned H2D at {fmt_bytes(big['bytes'])} "
    "within 2x of the copy-loop peak",
    0.5 <= ratio <= 2.0,
    value=f"ratio {ratio:.3f}",
    why=bw.WHY.two_moments,
)

# %% [markdown]
# ## Small copies: one alone, or back to back
#
# `time_copy_ms` records `start` on an idle stream: the GPU passes it at once, then waits for the
# host to launch the copy (and, for a copy shorter than a launch, to record `end`). For a small copy
# that wait can be most of what the events see. So the sweep's small sizes measure **one copy
# issued alone: the host's launch plus the copy**, not what the copy engine needs per copy.
#
# To time the copy engine, keep the GPU busy (`pinlab.gpu_busy`), record `start`, enqueue a burst
# of copies, record `end`: when the busy kernel ends, the GPU runs the burst back to back.
# `start.query()` right after the burst says whether the GPU was still busy when the host had
# queued it all; a round where it was not would let host gaps in, so it is dropped.
#
# A burst's time per copy is the **interval between back-to-back copies**, a throughput figure;
# the *latency* of a copy (from the call until the data is on the GPU) is the "alone" figure or
# more.


# %%
def copy_latency(sizes, copies=64, busy_ms=5.0, rounds=5):
    """Per size, µs per pinned H2D copy: one copy timed alone, and copies in a burst
    queued behind a busy GPU."""
    top = max(sizes)
    src = torch.ones(top, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(top, dtype=torch.uint8, device="cuda")
    start, end = (
        torch.cuda.Event(enable_timing=True),
        torch.cuda.Event(enable_timing=True),
    )
    rows = []
    for n in sizes:
        d, s = dst[:n], src[:n]
        alone, burst = [], []
        for _ in range(rounds):  # interleaved: one copy alone, then a burst
            alone.append(time_copy_ms(d, s, repeat=1) * 1e3)
            # the copies below queue behind the busy kernel
            pinlab.gpu_busy(busy_ms)
            start.record()
            for _ in range(copies):
                d.copy_(s, non_blocking=True)
            # was the GPU still busy when the host had queued all?
            queued = not start.query()
            end.record()
            end.synchronize()
            if queued:  # else host gaps leaked in: drop the round
                burst.append(start.elapsed_time(end) * 1e3 / copies)
        rows.append(
            {
                "bytes": n,
                "alone_us": statistics.median(alone),
                "burst_us": statistics.median(burst) if burst else None,
                "queued_rounds": len(burst),
                "rounds": rounds,
            }
        )
    return rows


lat = pinlab.measure("01_latency", copy_latency, sizes=bw.LATENCY_SIZES)
by_size = {r["bytes"]: r for r in lat.result}

# %%
lsizes = [r["bytes"] for r in lat.result]
# sizes with at least one queued burst
bursts = [r for r in lat.result if r["burst_us"] is not None]
size_sweep(
    lsizes,
    {
        "one copy timed alone (host launch + copy)": [
            r["alone_us"] for r in lat.result
        ],
        "interval between copies in a burst (copy engine)": [
            r["burst_us"] for r in lat.result
        ],
    },
    ylabel="µs per pinned H2D copy",
    title=f"Time per copy ({lat.tag})",
)
plt.show()

# %%
most_queued = all(r["queued_rounds"] > r["rounds"] / 2 for r in lat.result)
per_size = ", ".join(
    f"{fmt_bytes(r['bytes'])} {r['queued_rounds']}/{r['rounds']}" for r in lat.result
)
queued_ok = pinlab.observe(
    "most bursts were queued in full before the GPU reached them",
    most_queued,
    value=per_size,
    why=bw.WHY.slow_queue,
)
kib1, kib16 = by_size[bw.KiB], by_size[16 * bw.KiB]
if kib1["burst_us"] is not None and kib16["burst_us"] is not None:
    burst_rates = [bw.gbps(r["bytes"], r["burst_us"] * 1e-3) for r in bursts]
    rate_1kib = bw.gbps(bw.KiB, kib1["burst_us"] * 1e-3)
    pinlab.report(
        "a 1 KiB copy in a burst: interval between copies", kib1["burst_us"] * 1e-3
    )
    pinlab.report("a 1 KiB copy timed alone: launch + copy", kib1["alone_us"] * 1e-3)
    n_half = bw.n_half([r["bytes"] for r in bursts], burst_rates)
    pinlab.show(
        "N½ of pinned H2D in a burst (half the best burst rate)", fmt_bytes(n_half)
    )
    pinlab.observe(
        "timed alone, a 1 KiB copy took longer than one in a burst",
        kib1["alone_us"] > kib1["burst_us"],
        value=f"a burst saved {1 - kib1['burst_us'] / kib1['alone_us']:.0%} of it",
        why=bw.WHY.shared_gpu,
    )
    x16 = kib16["burst_us"] / kib1["burst_us"]
    pinlab.observe(
        "16 KiB in a burst took less than 4x the time of 1 KiB (16x the bytes)",
        kib16["burst_us"] < 4 * kib1["burst_us"],
        value=f"{x16:.1f}x",
        why=bw.WHY.slow_link_bytes,
    )
    pinlab.observe(
        "even in a burst, a 1 KiB copy moved under 5% of the copy-loop peak's rate",
        rate_1kib < 0.05 * peak_gbps,
        value=f"{rate_1kib / peak_gbps:.1%}",
        why=bw.WHY.slow_link_peak,
    )
    pinlab.show(
        "what this run shows",
        f"one 16 KiB copy took {kib16['burst_us']:.1f} µs in a burst, sixteen 1 KiB "
        "copies "
        f"{16 * kib1['burst_us']:.1f} µs: batching small copies into one "
        + ("paid" if kib16["burst_us"] < 16 * kib1["burst_us"] else "did not pay")
        + " here",
    )

# %% [markdown]
# Below N½ a copy is mostly fixed cost, above it mostly bytes at the link's rate (the last line
# compares one 16 KiB copy with sixteen of 1 KiB): batch small transfers into one, and time small
# copies the way your program issues them.
#
# ## What pinning costs
#
# The *first* pinned allocation of a size calls `cudaHostAlloc`: the operating system touches and
# locks each 4 KiB page (65,536 of them for 256 MiB) and the driver maps them for the GPU, host
# work per page that no copy engine can take over. PyTorch's **caching host allocator** keeps
# freed pinned blocks and hands them out again, so a *warm* allocation costs almost nothing.
# `torch.cuda.host_memory_stats()` counts the `cudaHostAlloc` calls (`num_host_alloc`).
#
# 🔮 **Predict.** Is getting 256 MiB of pinned memory cheaper or dearer than copying 256 MiB from
# pageable memory to the GPU? Cold, and warm?
#
# <details><summary>Answer</summary>
#
# Cold, expect dearer: the pageable copy is staged but does no work per page, while page-locking
# works on every page before a byte moves. Warm, almost free: the allocator hands back a block it
# already holds.
# </details>

# %%
cost = pinlab.measure("01_pin_cost", bw.pin_cost)

# %% tags=["nbval-ignore-output"]
pinlab.table(cost.result, bw.PIN_COST_COLUMNS)

# %%
largest = max(cost.result, key=lambda r: r["bytes"])
# cudaHostAlloc calls per size
cold_allocs = [r["alloc_cold_host_allocs"] for r in cost.result]
warm_allocs = [r["alloc_warm_host_allocs"] for r in cost.result]
pinlab.claim(
    "every cold allocation called cudaHostAlloc",
    all(a >= 1 for a in cold_allocs),
    why=bw.WHY.cache_hit,
)
pinlab.claim(
    "no warm allocation called cudaHostAlloc",
    all(a == 0 for a in warm_allocs),
    why=bw.WHY.cache_hit,
)
warm_ms, cold_ms = largest["alloc_warm_ms"], largest["alloc_cold_ms"]
warm_cheap = pinlab.observe(
    f"at {fmt_bytes(largest['bytes'])}, a warm allocation cost under 1% of a cold one",
    warm_ms < 0.01 * cold_ms,
    value=f"{pinlab.fmt_ms(warm_ms)} vs {pinlab.fmt_ms(cold_ms)}",
    why=bw.WHY.host_timing,
)

# %%
r = next(r for r in cost.result if r["bytes"] == 256 * bw.MiB)
labels = [
    "pageable H2D",
    "cold pin_memory() + H2D",
    "warm pin_memory() + H2D",
    "pinned H2D",
]
values = [
    r["h2d_pageable_ms"],
    r["pin_memory_cold_ms"] + r["h2d_pinned_ms"],
    r["pin_memory_warm_ms"] + r["h2d_pinned_ms"],
    r["h2d_pinned_ms"],
]
bars(
    labels,
    values,
    ylabel="host ms until the data is on the GPU",
    title=f"Moving {fmt_bytes(r['bytes'])} once ({cost.tag})",
    annotate="{:.1f}",
)
plt.show()

# %%
one_off = r["pin_memory_cold_ms"] + r["h2d_pinned_ms"]
pinlab.show(
    f"one-off {fmt_bytes(r['bytes'])}: cold pin + pinned copy vs pageable copy",
    f"{one_off:.1f} ms vs {r['h2d_pageable_ms']:.1f} ms "
    f"({'pinning loses' if one_off > r['h2d_pageable_ms'] else 'pinning wins'} here)",
)
reused = r["pin_memory_warm_ms"] + r["h2d_pinned_ms"]
pinlab.show(
    f"reused buffer {fmt_bytes(r['bytes'])}: warm pin + pinned copy vs pageable copy",
    f"{reused:.1f} ms vs {r['h2d_pageable_ms']:.1f} ms "
    f"({'pinning loses' if reused > r['h2d_pageable_ms'] else 'pinning wins'} here)",
)

# %% [markdown]
# Pinning pays when the pinned memory is **reused**. Pinning a fresh buffer for a single copy can
# cost more than the pageable copy it replaces (the two lines above say which way it went here).
#
# ## Pinned blocks are rounded up, and stay pinned after `del`
#
# A freed block helps only if it fits the next request, so torch's caching host allocator rounds
# every request up to a power of two, where blocks of nearby sizes fit. The rounding is the
# allocator's choice, not the hardware's.
#
# 🔮 **Predict.** You ask for 129.5 MiB of pinned memory. How much does the allocator page-lock?
# And when you `del` the tensor, is that memory unpinned?
#
# <details><summary>Answer</summary>
#
# 256 MiB, the next power of two: almost twice what you asked for. And `del` does not unpin it: the
# block goes back to the allocator's cache, still page-locked (what makes a warm allocation cheap),
# and back to the driver only when the cache is emptied or the process ends.
# </details>
#
# The experiment reads the bytes the allocator holds (`allocated_bytes.current` in
# `torch.cuda.host_memory_stats()`) before the allocation, after it, after `del` and after
# `torch._C._host_emptyCache()` (what `pinlab.release_cached_host_blocks()` calls).
#
# Up to torch 2.12 that is all. From torch 2.13 the rounding is configurable:
# `pinned_max_round_threshold_mb` (above it, requests are not rounded) and
# `pinned_max_cached_size_mb` (above it, blocks are neither rounded nor cached), set in
# `PYTORCH_ALLOC_CONF` (or `PYTORCH_CUDA_ALLOC_CONF`). Unset, both are unlimited, and the claims
# below hold.

# %%
rounding = pinlab.measure(
    "01_rounding", bw.pinned_rounding, request_bytes=bw.ROUNDING_REQUEST
)
rr = rounding.result
req, got = rr["request_bytes"], rr["pinned_bytes_delta"]
pinlab.show("requested / pinned", f"{fmt_bytes(req)} / {fmt_bytes(got)}")
still_pinned = rr["held_after_free"] - rr["held_before"] == got
released = rr["held_after_release"] == rr["held_before"]
pinlab.claim(
    "the request was rounded up to the next power of two",
    got == pinlab.next_pow2(req),
    value=f"{req} bytes asked, {got} pinned",
    why=bw.WHY.rounding,
)
pinlab.claim(
    "after del, the block is still pinned (in the allocator's cache)",
    still_pinned,
    why=bw.WHY.rounding,
)
pinlab.claim(
    "after emptying the cache, it went back to the driver",
    released,
    why=bw.WHY.rounding,
)

# %% [markdown]
# So by default up to 2× the memory you asked for stays locked: vLLM users saw `--cpu-offload-gb`
# take nearly twice the host memory requested for this reason (vLLM #56410; not measured here).
#
# ## Who pins, in practice
#
# Few programs call `pin_memory()` by hand: PyTorch's `DataLoader` does, and so does code that
# pins many tensors at once from a pool of threads (TensorDict's
# `.to(..., non_blocking_pin=True, num_threads=k)`).
#
# ### The DataLoader's `pin_memory=True`
#
# With `pin_memory=True` every batch the loader yields is pinned, so the
# `.to("cuda", non_blocking=True)` that follows is truly asynchronous (one exception, not measured
# here: under NVIDIA Confidential Computing a copy from pinned memory blocks the host too,
# `docs/facts.md` F23). With worker processes, a **pin-memory thread** in the main process pins
# each batch as it arrives; with `num_workers=0` the main thread pins inside `next()`.
#
# Below, each batch (4 MiB, a fresh pageable tensor from `bw.PageableBatches`) goes to the GPU,
# then a 2 ms training step runs and the host waits for it (as `loss.item()` would). The loop
# clocks the main thread in `next()` and in the copy call, and checks which batches arrived pinned
# and whether a pin-memory thread ran.
#
# 🔮 **Predict.** With `num_workers=2`, what does `pin_memory=True` change for the main thread:
# the time it waits for a batch, or the time its copy call takes?
#
# <details><summary>Answer</summary>
#
# Both can change. The copy call shrinks to an enqueue of the DMA, where from a pageable batch the
# host stages it all (on a PCIe GPU). `next()` changes too, up or down: the pin-memory thread, not
# the main thread, now takes each batch off the workers' queue (and pins it).
# </details>


# %%
def loader_to_gpu(pin_memory, num_workers, batches=48, nbytes=4 * bw.MiB, step_ms=2.0):
    """Batches from a DataLoader to the GPU, one training
    step each: where the main thread spends its time."""
    loader = DataLoader(
        bw.PageableBatches(batches, nbytes),
        batch_size=None,
        num_workers=num_workers,
        pin_memory=pin_memory,
    )
    dev = torch.empty(nbytes // 4, device="cuda")
    # cudaHostAlloc calls so far
    allocs = lambda: pinlab.host_stats().get("num_host_alloc", 0)  # noqa: E731
    allocs_before = allocs()
    next_ms, copy_ms, pinned, pin_thread = [], [], 0, False
    it = iter(loader)  # the worker processes (and the pin thread) start
    for n in range(batches):
        if n == 1:
            t_first = time.perf_counter()  # from the second batch on: the steady state
        t0 = time.perf_counter()
        x = next(it)
        t1 = time.perf_counter()
        dev.copy_(x, non_blocking=True)  # what x.to("cuda", non_blocking=True) does
        t2 = time.perf_counter()
        pinlab.gpu_busy(step_ms)  # the training step on the GPU ...
        torch.cuda.synchronize()  # ... and loss.item(): the host waits for it
        next_ms.append((t1 - t0) * 1e3)
        copy_ms.append((t2 - t1) * 1e3)
        pinned += x.is_pinned()
        pin_thread = pin_thread or any(
            "pin_memory" in t.name for t in threading.enumerate()
        )
    per_batch_ms = (time.perf_counter() - t_first) * 1e3 / (batches - 1)
    del it, loader
    return {
        "pin_memory": pin_memory,
        "num_workers": num_workers,
        "batches": batches,
        "step_ms": step_ms,
        "next_ms": statistics.median(next_ms[1:]),
        "copy_call_ms": statistics.median(copy_ms[1:]),
        "per_batch_ms": per_batch_ms,
        "pinned_batches": pinned,
        "pin_thread": pin_thread,
        "host_allocs": allocs() - allocs_before,
    }


def loader_sweep(workers, batches=48, nbytes=4 * bw.MiB, step_ms=2.0):
    runs = []
    for w in workers:
        for pin in (False, True):
            # every run starts with an empty pinned cache
            pinlab.release_cached_host_blocks()
            runs.append(loader_to_gpu(pin, w, batches, nbytes, step_ms))
    return runs


loaders = pinlab.measure(
    "01_dataloader_pin",
    loader_sweep,
    workers=[0, 2],
    batches=48,
    nbytes=4 * bw.MiB,
    step_ms=2.0,
)

# %% tags=["nbval-ignore-output"]
pinlab.table(loaders.result, bw.LOADER_COLUMNS)

# %%
by = {(r["num_workers"], r["pin_memory"]): r for r in loaders.result}
for (w, pin), r in by.items():
    pinlab.show(
        f"num_workers={w}, pin_memory={pin}: main thread "
        "per batch (next() + copy call), wall per batch",
        f"{r['next_ms'] + r['copy_call_ms']:.3f} ms, "
        f"{r['per_batch_ms']:.3f} ms (step {r['step_ms']} ms)",
    )
n = loaders.result[0]["batches"]
pinlab.show(
    f"pin_memory=True: cudaHostAlloc calls during the {n} batches (num_workers 0, 2)",
    f"{by[(0, True)]['host_allocs']}, {by[(2, True)]['host_allocs']}",
)
all_pinned = all(by[(w, True)]["pinned_batches"] == n for w in (0, 2))
none_pinned = all(
    by[(w, False)]["pinned_batches"] == 0 and by[(w, False)]["host_allocs"] == 0
    for w in (0, 2)
)
blocks_reused = all(by[(w, True)]["host_allocs"] < n / 2 for w in (0, 2))
# the runs in which a pin-memory thread ran
pin_threads = [k for k, r in by.items() if r["pin_thread"]]
pinlab.claim(
    "pin_memory=True: every batch arrived pinned (both num_workers)",
    all_pinned,
    why=bw.WHY.dataloader,
)
pinlab.claim(
    "pin_memory=False: no batch arrived pinned, and nothing was pinned",
    none_pinned,
    why=bw.WHY.dataloader,
)
pinlab.claim(
    "pin_memory=True: pinned blocks were reused "
    "(cudaHostAlloc calls under half the batches)",
    blocks_reused,
    value=f"{by[(0, True)]['host_allocs']}, "
    f"{by[(2, True)]['host_allocs']} calls for {n} batches",
    why=bw.WHY.dataloader,
)
pinlab.claim(
    "a pin-memory thread ran only with num_workers=2 and pin_memory=True",
    pin_threads == [(2, True)],
    why=bw.WHY.dataloader,
)
nb0 = {pin: by[(0, pin)] for pin in (False, True)}
copy_gain = pinlab.observe(
    "num_workers=2: the copy call of a pinned "
    "batch took under half that of a pageable one",
    by[(2, True)]["copy_call_ms"] < 0.5 * by[(2, False)]["copy_call_ms"],
    value=f"{by[(2, True)]['copy_call_ms']:.3f} ms "
    f"vs {by[(2, False)]['copy_call_ms']:.3f} ms",
    why=bw.WHY.cheap_staging,
)
pinlab.show(
    "num_workers=0: what pin_memory=True changed in the main thread",
    f"next() {nb0[True]['next_ms'] - nb0[False]['next_ms']:+.3f} ms (it now copies the "
    f"batch into pinned memory: {nb0[True]['host_allocs']} cudaHostAlloc calls for {n} "
    "batches, the rest reused cached blocks), copy call "
    f"{nb0[True]['copy_call_ms'] - nb0[False]['copy_call_ms']:+.3f} ms (it no longer "
    "stages it)",
)

# %% [markdown]
# Reading the table (the copy call: see the answer above):
#
# - **`next()` with workers**: the pin-memory thread takes each batch from the workers (through
#   shared memory) and pins it (a `memcpy` into a pinned block) while the main thread waits for the
#   training step.
# - **`next()` without workers**: the main thread pins each batch itself (torch's single-process
#   loader iterator pins in `_next_data`; the pin-memory thread belongs to the multi-process one):
#   a `memcpy` into a cached block, which torch may spread over its intra-op threads (the threads
#   it splits one operation over, `torch.get_num_threads()`), and the copy call skips the staging.
#   Which weighs more depends on your machine: the line above gives both changes.
# - **Wall ms per batch**: how close each set-up came to the training step alone, the one number a
#   training loop feels.
#
# Each pinned batch is freed after its step and the next reuses its cached block: the loader calls
# `cudaHostAlloc` only for the first few batches (the count above), not per batch.
#
# ### Pinning from several threads
#
# Cold pinning page-locks new memory (`cudaHostAlloc`) through the driver (a global lock) and the
# operating system's page tables; warm pinning is a `memcpy` into a cached block, which needs
# neither. Do threads help? Below: 32 tensors of 4 MiB, pinned with `t.pin_memory()` from the main
# thread (no pool) and from pools of 1, 2, 4 and 8 threads, cold (the cache emptied first) and warm
# (the blocks just freed), in interleaved rounds.
#
# 🔮 **Predict.** Which gains more from 8 threads: cold pinning or warm pinning?
#
# <details><summary>Answer</summary>
#
# Usually warm: copies into cached blocks run side by side on several cores, until the host's
# memory bandwidth is the limit. Cold, the threads queue at the driver's lock and share the
# page-table work badly. On a host busy with other work, neither may gain: no free cores.
# </details>


# %%
def pin_from_threads(tensors, threads):
    """`t.pin_memory()` of every tensor from a pool of `threads` threads (0: the calling
    thread, no pool). Returns the host ms until all are pinned, and the pinned tensors.
    """
    t0 = time.perf_counter()
    if threads == 0:
        pinned = [t.pin_memory() for t in tensors]
    else:
        with ThreadPoolExecutor(threads) as pool:
            pinned = list(pool.map(torch.Tensor.pin_memory, tensors))
    return (time.perf_counter() - t0) * 1e3, pinned


def pin_scaling(count, nbytes, threads, rounds=3):
    """Host ms to pin `count` tensors of `nbytes`, cold
    and warm, per pool size, and cudaHostAlloc calls."""
    tensors = [torch.ones(nbytes // 4) for _ in range(count)]
    # cudaHostAlloc calls so far
    allocs = lambda: pinlab.host_stats().get("num_host_alloc", 0)  # noqa: E731
    rows = {
        t: {
            "threads": t,
            "cold_ms": [],
            "warm_ms": [],
            "cold_allocs": [],
            "warm_allocs": [],
        }
        for t in threads
    }
    for _ in range(rounds):  # interleaved: every pool size once per round
        for t in threads:
            pinlab.release_cached_host_blocks()  # cold: the cache is empty
            a0 = allocs()
            ms, pinned = pin_from_threads(tensors, t)
            rows[t]["cold_ms"].append(ms)
            rows[t]["cold_allocs"].append(allocs() - a0)
            del pinned  # freed into the cache, still pinned
            a0 = allocs()
            # warm: every block comes from the cache
            ms, pinned = pin_from_threads(tensors, t)
            rows[t]["warm_ms"].append(ms)
            rows[t]["warm_allocs"].append(allocs() - a0)
            del pinned
    pinlab.release_cached_host_blocks()
    return {"rows": list(rows.values()), "intra_op_threads": torch.get_num_threads()}


pin_count = 32
threaded = pinlab.measure(
    "01_pin_threads",
    pin_scaling,
    count=pin_count,
    nbytes=4 * bw.MiB,
    threads=bw.PIN_THREADS,
)

# %%
bw.plot_pin_threads(
    threaded.result["rows"],
    title=f"Pinning 32 x 4 MiB from several threads ({threaded.tag})",
)
plt.show()

# %%
rows_t = threaded.result["rows"]
pool = [t for t in bw.PIN_THREADS if t > 0]
med = {
    (r["threads"], k): statistics.median(r[k])
    for r in rows_t
    for k in ("cold_ms", "warm_ms")
}
cold_up = bw.speedups({t: med[(t, "cold_ms")] for t in pool})
warm_up = bw.speedups({t: med[(t, "warm_ms")] for t in pool})
for kind, up in (("cold", cold_up), ("warm", warm_up)):
    pinlab.show(
        f"{kind}, speed-up of a pool of "
        f"{', '.join(map(str, pool[1:]))} threads over a pool of one",
        ", ".join(f"{up[t]:.1f}x" for t in pool[1:]),
    )
best = min(pool, key=lambda t: med[(t, "warm_ms")])
pinlab.show(
    "warm, the main thread alone vs the best pool",
    f"{med[(0, 'warm_ms')]:.1f} ms vs {med[(best, 'warm_ms')]:.1f} ms ({best} "
    f"threads); torch's intra-op threads: {threaded.result['intra_op_threads']}",
)
pinlab.claim(
    "cold: every tensor cost exactly one cudaHostAlloc, whatever the number of threads",
    all(a == pin_count for r in rows_t for a in r["cold_allocs"]),
    why=bw.WHY.cache_counts,
)
pinlab.claim(
    "warm: no cudaHostAlloc at all",
    all(a == 0 for r in rows_t for a in r["warm_allocs"]),
    why=bw.WHY.cache_counts,
)

# %% [markdown]
# Read each line against its dotted line (perfect scaling from a pool of one):
#
# - **Cold**: page-locking goes through the driver (PyTorch's source notes a global lock in the
#   driver there: `docs/facts.md` F3) and the page tables, work that threads share badly: expect
#   the cold line near the one-thread time. Threads do not change *how many* `cudaHostAlloc` calls
#   are made (the counts): only a warm cache removes them.
# - **Warm**: a `memcpy` per tensor, which threads share until the host's memory bandwidth is the
#   limit.
# - The **main thread alone** (dashed): PyTorch can spread one copy over its intra-op threads, and
#   a call from a pool thread need not get that. So the main thread alone can match a pool, beat it,
#   or, when other work holds the cores, fall far behind (the last line above says which). Measure
#   before you add a pool.

# %% [markdown]
# ## PyTorch's knobs for the cost of pinning
#
# Two settings of the caching host allocator change what a cold pin costs and what it holds. They
# go in `PYTORCH_CUDA_ALLOC_CONF` (or `PYTORCH_ALLOC_CONF`), which torch reads once per process:
# set it in the shell, or in `os.environ` before the process first pins.
#
# - `pinned_use_cuda_host_register:True`: page-lock ordinary memory (`malloc`) with
#   `cudaHostRegister` instead of calling `cudaHostAlloc`. With `pinned_num_register_threads:N`, N
#   tasks on a thread pool of its own first *touch* the block's pages, one byte per 4 KiB page, so
#   that the operating system maps them; then **one** `cudaHostRegister` call, on the calling
#   thread, page-locks the whole block (`allocWithCudaHostRegister` and `mapPagesForRegister` in
#   PyTorch's `aten/src/ATen/cuda/CachingHostAllocator.cpp`, torch 2.11 to 2.13: `docs/facts.md`
#   F2).
# - `pinned_max_round_threshold_mb:M` (torch 2.13 and later, above): a request above M MB is not
#   rounded up.
#
# The settings compared (`bw.PINNING_CONFIGS`):

# %%
for label, conf in bw.PINNING_CONFIGS.items():
    print(f"{label:28s} PYTORCH_CUDA_ALLOC_CONF={conf!r}")

# %% [markdown]
# Since torch reads the setting once, each runs in a fresh Python process (`bw.pinning_knobs`):
# one cold `torch.empty(600 MiB, pin_memory=True)`, timed on the host, and the bytes the allocator
# then holds. A torch that does not know a setting refuses it: that row shows the error, and
# nothing is measured or replayed in its place.
#
# 🔮 **Predict.** 600 MiB pinned with 8 register threads against one: how much faster? And how
# many bytes does each setting hold?
#
# <details><summary>Answer</summary>
#
# Less than 8x. The threads only pre-fault the block's pages (the first touch of each page); the
# page-locking is still one `cudaHostRegister` call on one thread. So 8 threads shorten the
# faulting part, if the host has cores to spare; whether they beat the default `cudaHostAlloc` at
# all depends on the machine. The rounding does not depend on how the block is page-locked:
# 600 MiB is held as 1 GiB under every setting that keeps the rounding, and as about 600 MiB under
# `pinned_max_round_threshold_mb:64`, on a torch that knows it.
# </details>

# %%
knobs = pinlab.measure(
    "01_pinning_knobs", bw.pinning_knobs, request_bytes=bw.KNOB_REQUEST
)

# %% tags=["nbval-ignore-output"]
knob_rows = [
    {
        "setting": r["setting"],
        "ms": f"{r['ms']:.0f}" if "ms" in r else "-",
        "held": fmt_bytes(r["held_bytes"]) if "held_bytes" in r else "-",
        "error": bw.unknown_alloc_key(r.get("error"))
        and "unknown setting"
        or r.get("error", ""),
    }
    for r in knobs["rows"]
]
pinlab.table(knob_rows, bw.KNOB_COLUMNS)

# %%
knob = {r["setting"]: r for r in knobs["rows"]}
req = knobs["request_bytes"]
for r in knobs["rows"]:
    key = bw.unknown_alloc_key(r.get("error"))
    if key:
        since = (
            f" (torch {bw.KNOB_SINCE[key]} and later do)"
            if key in bw.KNOB_SINCE
            else ""
        )
        what = (
            f"refused: torch {knobs['torch']} does "
            f"not know {key}{since}; nothing measured"
        )
    elif "error" in r:
        what = f"failed: {r['error']}"
    else:
        rounded = r["held_bytes"] == pinlab.next_pow2(req)
        what = (
            f"{r['ms']:.0f} ms, holds {fmt_bytes(r['held_bytes'])} "
            f"for {fmt_bytes(req)} "
            f"({'' if rounded else 'not '}rounded up to a power of two)"
        )
    pinlab.show(r["setting"], what)
default = knob["default (cudaHostAlloc)"]
default_rounded = default.get("pinned") is True and default.get(
    "held_bytes"
) == pinlab.next_pow2(req)
pinlab.claim(
    "default setting: pinned, and held as the next power of two",
    default_rounded,
    value=default,
    why=bw.WHY.default_rounds,
)
reg1, reg8 = knob["cudaHostRegister, 1 thread"], knob["cudaHostRegister, 8 threads"]
if "ms" in reg1 and "ms" in reg8:
    reg_up = reg1["ms"] / reg8["ms"]
    pinlab.observe(
        f"{fmt_bytes(req)} pinned faster with 8 register threads than with 1",
        reg_up > 1,
        value=f"{reg_up:.2f}x",
        why=bw.WHY.register_threads,
    )
    pinlab.show(
        "one block from 8 register threads, against "
        "the pool of 8 threads above (32 cold pins)",
        f"{reg_up:.1f}x over one register thread; the "
        f"pool: {cold_up[8]:.1f}x over a pool of one",
    )
    if "ms" in default:
        vs_alloc = default["ms"] / reg8["ms"]
        pinlab.show(
            "8 register threads against the default cudaHostAlloc",
            f"{vs_alloc:.2f}x ({'faster' if vs_alloc > 1 else 'not faster'} "
            "than the default here)",
        )
else:
    pinlab.show(
        "register threads",
        "this run has no timing of both register settings (an error above)",
    )

# %% [markdown]
# **Threads**: `pinned_num_register_threads` splits the first touch of *one* block's pages; the
# pool above split the tensors, each thread pinning a whole tensor with its own call into the
# driver. It needs `malloc` + `cudaHostRegister`, and a host with free cores. **Rounding**: only
# `pinned_max_round_threshold_mb` turns it off, on a torch that has it.
#
# ## When pinning fails
#
# `pin_memory=True` can fail, and a program should expect it:
#
# - **The memlock limit.** `ulimit -l` (`RLIMIT_MEMLOCK`) caps the memory a process may lock,
#   unless it has the capability `CAP_IPC_LOCK` (root, outside most containers). Containers often
#   start with a small limit and without it (Docker: `--ulimit memlock=-1`, `--cap-add IPC_LOCK`).
#   Whether `cudaHostAlloc` or `cudaHostRegister` memory counts against the limit is up to the
#   driver: the experiment below tries both.
# - **WSL2.** NVIDIA's CUDA on WSL guide lists the pinned system memory available to an application
#   as limited; vLLM turns pinning off under WSL2 (`is_pin_memory_available()` returns False there
#   unless `VLLM_WSL2_ENABLE_PIN_MEMORY=1`). Not measured here (`docs/facts.md` F18).
# - **The host runs out.** Pinned memory cannot be swapped, and the rounding can double it: vLLM's
#   weight offloading ran a GB300 host out of memory this way, which is why
#   `VLLM_WEIGHT_OFFLOADING_DISABLE_PIN_MEMORY` exists (lesson 05).
# - **No accelerator.** A CPU-only torch raises on `pin_memory=True`.
#
# 🔮 **Predict.** A child process sets `ulimit -l` to 64 MiB, then pins 256 MiB, once with
# `cudaHostAlloc` and once with `cudaHostRegister`. Which fails?
#
# <details><summary>Answer</summary>
#
# It depends who runs it. With `CAP_IPC_LOCK` (root, usually) the limit cannot bite: both succeed.
# Without it, each succeeds or fails as the driver counts its pinned memory against the limit.
# </details>

# %%
memlock = pinlab.measure(
    "01_pinning_memlock",
    bw.pinning_under_memlock,
    limit_bytes=64 * bw.MiB,
    request_bytes=256 * bw.MiB,
)
for r in memlock["rows"]:
    pinlab.show(
        f"{fmt_bytes(memlock['request_bytes'])} under "
        f"ulimit -l {fmt_bytes(memlock['limit_bytes'])}",
        bw.memlock_sentence(r, memlock["limit_bytes"]),
    )

# %% [markdown]
# Whatever stops it, `torch.empty(..., pin_memory=True)` (or `t.pin_memory()`) raises a
# `RuntimeError` (out of memory is `torch.OutOfMemoryError`, a subclass). The pattern: try pinned,
# fall back to pageable memory, and **say so**: every copy from that buffer is now staged by the
# driver, slower, and a `non_blocking` copy from it may wait (lesson 02). vLLM gates the same way,
# once, with `is_pin_memory_available()`.


# %%
def pin_or_fall_back(
    nbytes, pin=lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=True)
):
    """A host buffer of nbytes for copies to the GPU: pinned
    if pinning works, else pageable, and a warning."""
    try:
        return pin(nbytes)
    # no accelerator, a memlock limit, WSL's pinned limit, the host out of memory
    except RuntimeError as exc:
        why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        warnings.warn(
            f"pinning {nbytes} bytes failed ({why}): falling back "
            "to pageable memory; copies from it are staged by "
            "the driver, slower, and a non_blocking copy may wait",
            stacklevel=2,
        )
        return torch.empty(nbytes, dtype=torch.uint8)


# %% [markdown]
# It runs twice: as this machine pins (on a GPU it pins; without one it falls back), and with a
# pinning call that raises a full host's error on purpose (a **simulated** failure), so that the
# fallback runs on every machine.


# %%
def simulated_failure(nbytes):
    raise torch.OutOfMemoryError("CUDA error: out of memory (simulated)")


with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    here = pin_or_fall_back(bw.MiB)  # this machine's pinning
    n_real = len(said)
    fallback = pin_or_fall_back(bw.MiB, pin=simulated_failure)  # a failure, simulated
pinlab.show(
    "pinning 1 MiB here",
    "pinned" if here.is_pinned() else f"fell back: {said[0].message}",
)
print("simulated failure: a buffer came back:", fallback.numel() == bw.MiB)
print(
    "simulated failure: it is pageable, and the program said so:",
    not fallback.is_pinned()
    and len(said) == n_real + 1
    and "(simulated)" in str(said[-1].message),
)
pinlab.claim(
    "the fallback returned a pageable buffer of the size asked for",
    fallback.numel() == bw.MiB and not fallback.is_pinned(),
    why=bw.WHY.fallback,
)
pinlab.claim(
    "it warned, naming the error",
    "(simulated)" in str(said[-1].message),
    why=bw.WHY.fallback,
)
pinlab.claim(
    "without the failure, the buffer is pinned exactly where CUDA is available",
    here.is_pinned() == PIN_MEMORY,
    why=bw.WHY.fallback,
)
del here, fallback

# %% [markdown]
# ## Pageable copies and the host's `memcpy`
#
# A pageable copy is staged: the driver copies the data into a pinned buffer of its own while the
# calling thread waits inside `copy_` (lesson 02 measures that), then the DMA moves it. So every
# byte also costs a host-to-host copy, however fast the link. Does that copy set the pace?
# `bw.pageable_and_memcpy` times, per size, pageable H2D and D2H copies and a host-to-host copy of
# the same bytes two ways: torch's `q.copy_(p)` (split over torch's intra-op threads) and the C
# library's `memmove` on one thread (`ctypes.memmove`), with torch's thread pool unchanged between
# them, in interleaved rounds after an untimed one that touches every page. How the driver's
# staging copies, and on how many threads, is not documented.
#
# 🔮 **Predict.** Which is faster: 256 MiB from one pageable host buffer to another on one thread,
# or 256 MiB from pageable memory to the GPU?
#
# <details><summary>Answer</summary>
#
# It depends on the host. The pageable H2D copy is a `memcpy` into staging, in chunks, plus each
# chunk's DMA, so you might expect the host-to-host copy to win; but the driver's staging need not
# run at one thread's `memcpy` rate (it may overlap chunks with their DMA, or use more threads:
# undocumented). A host busy with other work slows both.
# </details>

# %%
pm = pinlab.replay.measure_if_recorded(
    "01_pageable_vs_memcpy",
    bw.pageable_and_memcpy,
    sizes=[16 * bw.MiB, 64 * bw.MiB, 256 * bw.MiB],
    reps=9,
)

# %% tags=["nbval-ignore-output"]
if pm is not None:
    pinlab.table(pm.result, bw.PAGEABLE_COLUMNS)

# %%
if pm is not None:
    for r in pm.result:
        pinlab.show("pageable H2D against the host's memcpy", bw.pageable_sentence(r))
    pinlab.show("what this run shows", bw.pageable_summary(pm.result))
    first, last = pm.result[0], pm.result[-1]
    pinlab.show(
        "pageable H2D, largest size against smallest",
        f"{last['h2d_gbps'] / first['h2d_gbps']:.2f}x the rate "
        f"({fmt_bytes(last['bytes'])} vs {fmt_bytes(first['bytes'])}); "
        f"pageable D2H {last['d2h_gbps'] / first['d2h_gbps']:.2f}x",
    )

# %% [markdown]
# Where pageable H2D comes close to one thread's `memcpy`, the staging `memcpy` can set the pace:
# pinning (no staging) helps, a faster link would not. Well below it, the chunks and their waits
# cost more than the bytes. Above it, the staging is not paced by one thread's `memcpy`, and
# torch's threaded copy (its column in the table) is the other yardstick. D2H is staged the other
# way (DMA into staging, then a `memcpy` out) and need not run at H2D's rate. How a pageable copy's
# rate changes with its size (the last line) is the driver's choice, undocumented.
#
# ### Near and far host memory: NUMA
#
# With several NUMA nodes (several CPU sockets, or sub-NUMA clustering), memory on the GPU's node
# is nearer: a copy from far memory also crosses the link between the sockets. Keep pinned
# buffers, and the threads that fill them, on the GPU's node
# (`numactl --cpunodebind=N --membind=N python ...`; `nvidia-smi topo -m` names the GPU's node).
# With one node there is nothing to choose or measure.

# %%
numa = pinlab.measure("01_numa", bw.numa_report)
pinlab.show("NUMA", bw.numa_sentence(numa["nodes"], numa["gpu_node"]))

# %% [markdown]
# ## When *not* to pin
# - **One-off transfers** of big buffers: a cold pin can cost more than the pageable copy.
# - **Huge buffers**: the rounding can double them, and pinned memory cannot be swapped out; pin
#   too much and the whole machine slows down or the process is killed.
# - **Memory you free and do not reuse**: it stays page-locked in PyTorch's cache until
#   `torch._C._host_emptyCache()` (private; `pinlab.release_cached_host_blocks()` wraps it) or the
#   process ends. A program that pins many different sizes once each keeps them all locked.
# - **Where pinning is unavailable or buys little**: CPU-only builds, WSL (vLLM gates it), and
#   coherent systems such as GH200 (above), where every pinned byte is still host memory nobody
#   else can use. Its CPU memory (LPDDR5X) and GPU memory (HBM) are separate memories (lesson 05);
#   vLLM's docstring for `VLLM_WEIGHT_OFFLOADING_DISABLE_PIN_MEMORY` says pinned memory "eats into
#   GPU memory" there. Both platforms: not measured here (`docs/facts.md` F14, F15, F18).

# %%
del buf
pinlab.claim(
    "pinned memory held is back to its starting level",
    pinlab.pinned_back_to(pinned_at_start),
    why=pinlab.PINNED_BACK_WHY,
)

# %% [markdown]
# ## What to remember
# - Over PCIe the copy engine reads only pinned memory; the driver stages pageable copies (a GH200
#   reads pageable memory through the host's page tables: not measured here, `docs/facts.md` F15).
# - Time a copy with two CUDA events. Large copies: pinned runs at the link's rate, pageable at a
#   fraction of it on most PCIe machines. Small copies are mostly fixed cost, and one timed alone
#   also times its launch.
# - `t.pin_memory()` of an already pinned `t` returns `t` itself.
# - Cold pinning is expensive, warm pinning cheap: pin buffers you **reuse**. By default the
#   allocator rounds up to a power of two and keeps blocks pinned after `del`, and pinned memory
#   cannot be swapped: do not pin everything.
# - `DataLoader(..., pin_memory=True)` pins in a pin-memory thread with workers, in `next()` with
#   `num_workers=0`. Threads share warm pinning (a `memcpy`) well, cold (`cudaHostAlloc`) badly:
#   warm the cache.
# - `PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True,pinned_num_register_threads:8`
#   pre-faults one block's pages from several threads, then page-locks it with one
#   `cudaHostRegister`; `pinned_max_round_threshold_mb` (torch 2.13 and later) stops the rounding
#   above a size. Torch reads them once per process; an older torch refuses a key it does not know.
# - Pinning can fail (a memlock limit without `CAP_IPC_LOCK`, WSL2, a host out of memory): fall
#   back to pageable, and say so.
# - A pageable copy adds a host-to-host copy of every byte. With several NUMA nodes, keep pinned
#   buffers on the GPU's node.
#
# **Exercise:** `exercises/01_pinned_memory.ipynb` (solution in `solutions/`).
# **Next:** 02 · fake `non_blocking`.
