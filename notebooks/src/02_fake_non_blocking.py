# %% [markdown]
# # 02 · Fake `non_blocking`
#
# **What you will learn**
# - what `non_blocking=True` promises, and when a host-to-device copy keeps the promise;
# - the copy that returns or waits, as ten lines of code you can run, and the size from which a
#   single copy from pageable memory makes the host wait for the GPU;
# - the two limits of the driver's staging, undocumented and measured on your machine: one per
#   copy, one for the bytes pending;
# - why data copied `non_blocking` *into* pinned memory is wrong until you synchronize;
# - other calls that quietly block the host: `torch.tensor(list, device="cuda")`, a *non-dense*
#   pinned source, `.item()`, the first launch of a kernel;
# - what a pageable input costs a step loop, and what exactly it serializes, seen in a
#   `torch.profiler` trace;
# - how a copy runs *beside* the compute: a free copy engine, a copy stream, a pinned source; the
#   side-stream pattern (`wait_stream`, `torch.cuda.stream`, `record_stream`), its steps per second
#   and GPU idle share against one stream, and what goes wrong without `record_stream`;
# - many tensors: `non_blocking` copies and one sync against a blocking copy each;
# - the advice "use `non_blocking=True`, pinned or not" from PyTorch's tutorial, tested case by case
#   with this lesson's data;
# - two tools: `pinlab.async_tensor_h2d` (vLLM's honest H2D copy) and `pinlab.detect_stalls`, which
#   finds the copy that `torch.cuda.set_sync_debug_mode` misses.

# %% tags=["nbval-ignore-output"]
import contextlib
import statistics
import time
from functools import partial

import matplotlib.pyplot as plt
import torch

import pinlab
from pinlab.lessons import l02_fake_non_blocking as stalls
from pinlab.plots import fmt_bytes, size_sweep, timeline
from pinlab.profiler import span_stats

KiB, MiB = stalls.KiB, stalls.MiB
pinlab.header("02 fake non_blocking")
pinned_at_start = pinlab.pinned_baseline()

# %% [markdown]
# ## What `non_blocking=True` promises
#
# `gpu_t.copy_(cpu_t, non_blocking=True)` asks PyTorch to *enqueue* the copy on the GPU's stream and
# return at once. While the GPU works through its queue, the host prepares the next step: that
# overlap is what keeps a GPU fed.
#
# The promise holds for sure when the copy engine can read `cpu_t` where it lies, that is when
# `cpu_t` is **pinned** (lesson 01). From pageable memory the driver first copies the data into a
# pinned staging buffer of its own, and it has only so much of that. A copy it stages returns at
# once: asynchronous as far as the host is concerned, at the price of the staging `memcpy`. When a
# copy does not fit, the driver waits until the GPU has worked through everything queued before
# it and copies the data through staging itself, with the host waiting. The call still says
# `non_blocking=True`; the host waits anyway. That copy, the one that waits, is the *fake*
# `non_blocking`.
#
# CUDA's documentation promises no more than that. The CUDA Runtime API's page "API
# synchronization behavior" (https://docs.nvidia.com/cuda/cuda-runtime-api/api-sync-behavior.html)
# says that for transfers between device memory and pageable host memory an asynchronous copy
# "might be synchronous" with respect to the host. When it is, and up to which sizes the driver
# stages instead, is not documented: the driver decides, and this lesson measures what it did on
# this machine. Other platforms decide differently: on ROCm every pageable copy waits; where the
# GPU reads host memory through the host's page tables (a GH200), a pageable copy need not be
# staged at all.
#
# **How we make waiting visible.** An idle GPU runs a copy at once, so a call that waits for it
# still looks fast. Every experiment therefore first enqueues `pinlab.gpu_busy(ms)`, a kernel that
# spins for `ms` milliseconds. A call issued behind it that returns in microseconds did not wait;
# one that takes about `ms` waited. We say a call **waited** when it took more than half the busy
# time (`stalls.waited`). Every kernel an experiment times is launched once beforehand
# (`pinlab.warmup`): the first launch of a kernel can block too, as section 4 shows.

# %% [markdown]
# ## 1. The copy that returns or waits
#
# This is the whole experiment: make the GPU busy, time one `copy_(..., non_blocking=True)` on the
# host, synchronize. Copy it into your own code to test a copy you are unsure of.

# %%
def copy_returns_or_waits(dst, src, busy_ms):
    """Host ms spent inside one dst.copy_(src, non_blocking=True) issued behind busy_ms of GPU work."""
    torch.cuda.synchronize()             # start from an idle GPU: nothing queued, nothing staged
    pinlab.gpu_busy(busy_ms)             # queue busy_ms of GPU work; this call returns at once
    t0 = time.perf_counter()
    dst.copy_(src, non_blocking=True)    # enqueue the copy behind it ... or wait
    host_ms = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()             # let the GPU finish before the next try
    return host_ms


# %% [markdown]
# 🔮 **Predict.** Behind a GPU that is busy for 10 ms, how long does the host spend inside one
# `copy_(..., non_blocking=True)` of 256 B from pageable memory? Of 64 MiB? And from pinned memory?
#
# <details><summary>Answer</summary>
#
# From pinned memory: microseconds, at every size (the copy is only enqueued). From pageable
# memory, on a CUDA GPU over PCIe: microseconds for small copies, which the driver stages at once;
# from some size on, the whole busy time and then some. Find that size below (on ROCm, expect every
# pageable copy to wait).
# </details>
#
# `stalls.single_copy_sweep` runs the function above for 27 sizes from 256 B to 64 MiB (a finer
# grid between 1 and 4 MiB), from a pageable and from a pinned tensor, median of 3 tries each; it
# times `src.to("cuda", non_blocking=True)` the same way. It takes a few seconds on a GPU.

# %%
sweep = pinlab.measure("02_single_copy", partial(stalls.single_copy_sweep, copy_returns_or_waits),
                       sizes=stalls.SWEEP_SIZES, busy_ms=10.0, repeat=3, bench_bytes=8 * MiB, bench_repeat=30)
busy_ms, rows = sweep["busy_ms"], sweep["rows"]
sizes = [r["bytes"] for r in rows]

# %% tags=["nbval-ignore-output"]
ms = pinlab.fmt_ms
pinlab.table(rows, [("bytes", "size", fmt_bytes), ("copy_pageable_ms", "copy_ pageable", ms),
                    ("to_pageable_ms", ".to pageable", ms), ("copy_pinned_ms", "copy_ pinned", ms),
                    ("to_pinned_ms", ".to pinned", ms)])

# %% [markdown]
# Where does a pageable copy start to wait? We take the smallest size from which **every** larger
# copy waited (`stalls.first_waiting_size`), so one stray slow measurement cannot fool us.

# %%
first_wait = stalls.first_waiting_size(sizes, [r["copy_pageable_ms"] for r in rows], busy_ms / 2)
series = {k.replace("_ms", "").replace("_", " "): [r[k] for r in rows]
          for k in ("copy_pageable_ms", "to_pageable_ms", "copy_pinned_ms", "to_pinned_ms")}
size_sweep(sizes, series, ylabel="host ms inside the call", hline=(busy_ms, "GPU busy time"),
           vline=(first_wait, "every copy from here on waited") if first_wait else None,
           title=f"One non_blocking H2D call behind a busy GPU ({sweep.tag})")
plt.show()

# %%
quick = [s for s in sizes if first_wait is None or s < first_wait]
first_wait_to = stalls.first_waiting_size(sizes, [r["to_pageable_ms"] for r in rows], busy_ms / 2)
pinlab.show("pageable copy_: largest size that returned at once", fmt_bytes(max(quick)) if quick else "none")
pinlab.show("pageable copy_: first size from which every copy waited", fmt_bytes(first_wait) if first_wait else "none")
pinlab.show("pageable .to: first size from which every call waited", fmt_bytes(first_wait_to) if first_wait_to else "none")

# %%
by_size = {r["bytes"]: r for r in rows}
slowest_pinned = max(r[k] for r in rows for k in ("copy_pinned_ms", "to_pinned_ms"))
ok = pinlab.claim("every pinned copy_ and .to returned at once", not stalls.waited(slowest_pinned, busy_ms),
                  value=f"the slowest call took {pinlab.fmt_ms(slowest_pinned)} behind {busy_ms:g} ms of GPU work",
                  why="a copy from pinned memory is only enqueued (the CUDA Runtime API documents it as asynchronous); "
                      "only a host stalled for half the busy time in most tries of one size (an overloaded machine) "
                      "could make it look as if it waited")
big_waited = pinlab.observe(
    "a 64 MiB pageable copy_ and .to waited for the GPU",
    stalls.waited(by_size[64 * MiB]["copy_pageable_ms"], busy_ms)
    and stalls.waited(by_size[64 * MiB]["to_pageable_ms"], busy_ms),
    value=", ".join(pinlab.fmt_ms(by_size[64 * MiB][k]) for k in ("copy_pageable_ms", "to_pageable_ms")),
    why="how large a pageable copy the driver stages behind the queue is undocumented driver behaviour; a GPU "
        "that reads pageable memory through the host's page tables (GH200) need not stage it at all")
small_returned = pinlab.observe(
    "a 256 B pageable copy_ returned at once", not stalls.waited(by_size[256]["copy_pageable_ms"], busy_ms),
    value=pinlab.fmt_ms(by_size[256]["copy_pageable_ms"]),
    why="staging small pageable copies is undocumented driver behaviour; on ROCm every pageable copy waits")

# %% [markdown]
# Read the plot from the left: the copies that returned, pageable and pinned, each cost the host
# something. Is that cost the driver's `memcpy` into staging, growing with the bytes, or a cost per
# call? The lines below compare the smallest sizes with the largest pageable copy that still
# returned, in this run. Where the pageable lines jump to the busy time, a `non_blocking=True` copy
# from pageable memory has become a blocking copy.

# %%
tiny = [r for r in rows if r["bytes"] <= 32 * KiB]
pag_tiny = [r["copy_pageable_ms"] for r in tiny]
pin_tiny = [r["copy_pinned_ms"] for r in tiny]
span = f"{fmt_bytes(tiny[0]['bytes'])} to {fmt_bytes(tiny[-1]['bytes'])}"
pinlab.show(f"host cost of one copy_, {span}: pageable / pinned",
            f"{pinlab.fmt_ms(min(pag_tiny))}-{pinlab.fmt_ms(max(pag_tiny))} / "
            f"{pinlab.fmt_ms(min(pin_tiny))}-{pinlab.fmt_ms(max(pin_tiny))}")
flat = max(pag_tiny) <= 2 * min(pag_tiny)
pinned_alike = statistics.median(pin_tiny) >= statistics.median(pag_tiny) / 2
words = (f"from {span} a pageable copy's host cost stayed within 2x whatever its size: a cost per call"
         + (", which pinned copies paid too" if pinned_alike else "") if flat
         else f"from {span} the host cost of a pageable copy varied more than 2x")
if quick and max(quick) > tiny[-1]["bytes"]:
    top_quick = by_size[max(quick)]["copy_pageable_ms"]
    pinlab.report(f"host cost of the largest pageable copy_ that returned ({fmt_bytes(max(quick))})", top_quick)
    growth = top_quick / statistics.median(pag_tiny)
    words += (f"; at {fmt_bytes(max(quick))}, the largest that returned, it cost {growth:.1f}x as much: the "
              "driver's memcpy into staging, which grows with the bytes" if growth > 2
              else f"; at {fmt_bytes(max(quick))}, the largest that returned, it cost about as much")
pinlab.show("what this run shows", words)

# %% [markdown]
# Note what the function does first: `torch.cuda.synchronize()`. Every copy in this sweep was
# issued **alone**, with nothing else pending and the driver's staging buffer empty. Where the
# large ones waited anyway (the lines above say whether they did here), the first limit is **per
# copy**: above a certain size this driver does not stage a pageable copy behind the queue at all,
# whatever room it has. Section 2 finds a second limit, for the bytes of many small copies pending
# at once. Both are the driver's choice, undocumented (CUDA's "API synchronization behavior" page
# only says such a copy "might be synchronous").
#
# **The benchmark.** An honest `non_blocking` copy should cost the host next to nothing, whatever
# the GPU is doing. A step loop issues its copies one after another, so that is how we time them:
# bursts of pinned copies of 8 MiB behind a busy GPU, host time per call (median over 30 bursts).
# For contrast, the same call made alone right after the host synchronized (the function above),
# and the pageable copy of the same size.

# %%
bench = sweep["bench"]
size = fmt_bytes(bench["bytes"])
loop_ms, pageable_ms = bench["copy_pinned_in_loop"]["median"], bench["copy_pageable"]["median"]
pinlab.report(f"pinned copy_ of {size} behind a busy GPU, per call in a loop (median)", loop_ms)
pinlab.report(f"pinned copy_ of {size}, a single call right after a sync (median)", bench["copy_pinned"]["median"])
pinlab.report(f"pinned .to of {size}, a single call right after a sync (median)", bench["to_pinned"]["median"])
pinlab.report(f"pageable copy_ of {size} behind a busy GPU (median)", pageable_ms)
single_ms = bench["copy_pinned"]["median"]
pinlab.show(f"pinned copy_ of {size}: a single call after a sync / a call in a loop", f"{single_ms / loop_ms:.2f}x")
pinned_cheap = pinlab.observe(
    f"behind a busy GPU, a pinned copy_ of {size} cost the host at least 100 times less than a pageable one",
    pageable_ms >= 100 * loop_ms, value=f"{pageable_ms / loop_ms:.0f}x",
    why=f"a pageable copy of {size} that the driver stages (another driver, a GH200) costs the host a staging "
        "memcpy, not a wait")

# %% [markdown]
# Compare the two pinned copy_ lines above: the same call, issued two ways, need not cost the same
# (the ratio line says how they compared in this run), so time copies the way your code issues
# them. Set either against what the pageable copy of the same size cost the host, the last line.

# %% [markdown]
# ## 2. The staging pool: many small copies
#
# Small pageable copies return at once where the driver stages them (section 1). But staging
# space is finite, and staged data leaves it only when the GPU performs the copy, after
# everything queued before it.
#
# 🔮 **Predict.** Behind a kernel that runs for 50 ms, you issue 64 KiB pageable copies, one after
# another. Do they all return at once? If not, after how many?
#
# <details><summary>Answer</summary>
#
# On a CUDA GPU over PCIe (what this course was recorded on): the first few dozen return in
# microseconds; then one copy waits for the whole kernel, because the staging pool is full. The
# number of *bytes* pending at that moment is the pool's size. On ROCm the first one already waits.
# </details>
#
# The experiment queues 16 MiB of copies, in 16 KiB and in 64 KiB pieces, behind a 50 ms kernel,
# and times each copy; 3 trials each. It then checks that every byte arrived.

# %%
pool = pinlab.measure("02_staging_pool", stalls.staging_pool, chunks=[16 * KiB, 64 * KiB],
                      total_bytes=16 * MiB, busy_ms=50.0, trials=3)
limit = pool["busy_ms"] / 2

# %%
fig, ax = plt.subplots(figsize=(7, 4))
for run in pool["runs"]:
    host_ms = run["trials"][0]["host_ms"]
    ax.plot(range(1, len(host_ms) + 1), stalls.cumulative(host_ms), label=f"{fmt_bytes(run['chunk'])} copies")
ax.axhline(pool["busy_ms"], ls="--", c="grey", lw=1, label="GPU busy time")
ax.set(xscale="log", yscale="log", xlabel="copies queued", ylabel="host ms, cumulative",
       title=f"Small pageable copies queued behind a busy GPU ({pool.tag})")
ax.grid(True, which="both", alpha=0.3)
ax.legend()
plt.show()

# %%
pending = {run["chunk"]: [stalls.pending_bytes_at_block(t["host_ms"], run["chunk"], limit) for t in run["trials"]]
           for run in pool["runs"]}
for chunk, at in pending.items():
    pinlab.show(f"{fmt_bytes(chunk)} copies: bytes queued when the host first blocked, per trial",
                ", ".join(fmt_bytes(a) if a is not None else "never" for a in at))
    pinlab.show(f"{fmt_bytes(chunk)} copies: copies queued when the host first blocked, per trial",
                ", ".join(str(a // chunk) if a is not None else "never" for a in at))

# %%
every = [a for at in pending.values() for a in at]
ok = pinlab.claim("every queued copy arrived intact", all(t["data_ok"] for run in pool["runs"] for t in run["trials"]),
                  why="a pageable copy is read into staging at the call, so its data cannot change; a copy that "
                      "came out wrong would be a driver or hardware fault")
pool_seen = pinlab.observe(
    "in every trial, the host blocked after at least 1 MiB had been queued",
    all(a is not None and a >= MiB for a in every),
    value=", ".join(fmt_bytes(a) if a is not None else "never" for a in every),
    why="the staging pool's size is undocumented driver behaviour (another driver, WSL2 or a GH200 may differ), "
        "and on ROCm every pageable copy waits")
counts = {chunk: [a // chunk for a in at if a is not None] for chunk, at in pending.items()}
if all(counts.values()) and len(counts) == 2:
    (c1, n1), (c2, n2) = ((c, statistics.median(n)) for c, n in sorted(counts.items()))
    pinlab.show("what this run shows",
                f"the {fmt_bytes(c1)} copies got {n1 / n2:.1f}x as many copies queued as the {fmt_bytes(c2)} ones "
                f"before the host blocked ({c2 // c1}x would mean a pool counted in bytes, 1x one counted in copies)")

# %% [markdown]
# On a CUDA GPU over PCIe each curve rises slowly, then jumps by about the busy time: that copy
# waited until the GPU had worked through the kernel and started draining the staging pool. Is the
# pool counted in bytes or in copies? If in copies, both curves would jump at the same copy; if in
# bytes, the 16 KiB copies would get four times as far. The last line compares them for this run.
# Nothing was lost, the data is right: only the host's time went.
#
# **Two limits, then.** Side by side, from this run's two experiments:

# %%
pending_median = statistics.median(a for a in every if a is not None) if any(a is not None for a in every) else None
pinlab.show("limit 1, per copy: the largest lone pageable copy that returned at once",
            fmt_bytes(max(quick)) if quick else "none")
pinlab.show("limit 2, pending bytes: small copies queued before the host blocked (median of trials)",
            fmt_bytes(pending_median) if pending_median is not None else "never")

# %% [markdown]
# A single copy above the first limit waits even into an empty pool; many small copies, each far
# below it, wait once the bytes pending reach the second. Neither limit is documented: CUDA's "API
# synchronization behavior" page only says that a copy from pageable memory "might be
# synchronous", and the sizes above are what this driver did on this machine. Another driver
# version, another GPU or another operating system may draw both lines elsewhere (on ROCm every
# pageable copy waits). Write code that does not depend on them: pin what you copy `non_blocking`.
#
# ## 3. Device to host: `non_blocking` the other way
#
# 🔮 **Predict.** `host_buf.copy_(gpu_t, non_blocking=True)` while the GPU is busy. If `host_buf`
# is pageable, does the host wait? If it is pinned, and you read `host_buf` right after the
# call, what do you read?
#
# <details><summary>Answer</summary>
#
# Into pageable memory the driver cannot let the copy run behind the host's back, so the call
# waits until the copy is done: blocking, but correct. Into pinned memory the call returns at once
# and the copy happens later: what you read right away is the buffer's **old** contents.
# </details>
#
# One trial: fill the host buffer with -1, make the GPU busy, let a GPU kernel write a new value,
# copy it back with `non_blocking=True`, read the buffer at once, then again after waiting for
# *that copy*: an event recorded right after it, on the same stream.

# %%
def copy_back(host_buf, gpu_t, value, busy_ms):
    """Host ms inside host_buf.copy_(gpu_t, non_blocking=True), and host_buf read before / after waiting."""
    host_buf.fill_(-1.0)
    torch.cuda.synchronize()
    pinlab.gpu_busy(busy_ms)
    gpu_t.fill_(value)                           # runs on the GPU, after the busy kernel
    t0 = time.perf_counter()
    host_buf.copy_(gpu_t, non_blocking=True)
    host_ms = (time.perf_counter() - t0) * 1e3
    before = host_buf.clone()                    # what a reader who does not wait sees
    done = torch.cuda.Event()
    done.record()                                # after the copy, on the same stream
    done.synchronize()                           # the fix: wait for that copy, and nothing later
    return host_ms, before, host_buf.clone()


# %% [markdown]
# `stalls.d2h_visibility` runs it 5 times into a pageable and into a pinned buffer of 64 KiB behind
# a 20 ms kernel, a new value each time, and gives `gpu_t.to("cpu", non_blocking=True)` the same
# trial.

# %%
d2h = pinlab.measure("02_d2h", partial(stalls.d2h_visibility, copy_back), nbytes=64 * KiB, busy_ms=20.0, trials=5)
into_pageable, into_pinned, to_cpu = ({r["variant"]: r for r in d2h["variants"]}[v] for v in stalls.D2H_VARIANTS)
for r in d2h["variants"]:
    pinlab.report(f"{r['variant']}: host time inside the call (median)", statistics.median(r["host_ms"]))

# %%
ok = pinlab.claims({
    "copy_ into pageable memory waited for the GPU every time":
        all(stalls.waited(t, d2h["busy_ms"]) for t in into_pageable["host_ms"]),
    "... and its data was right without a sync": all(into_pageable["valid_before_sync"]),
    "copy_ into pinned memory returned at once every time":
        not any(stalls.waited(t, d2h["busy_ms"]) for t in into_pinned["host_ms"]),
    "... and read before synchronizing, its data was wrong every time": not any(into_pinned["valid_before_sync"]),
}, why={
    "copy_ into pageable memory waited for the GPU every time":
        "the CUDA Runtime API documents that a copy into pageable host memory returns only once it has completed",
    "... and its data was right without a sync": "the call returned after the copy had completed",
    "copy_ into pinned memory returned at once every time":
        "a copy into pinned memory is only enqueued (documented); only a host stalled for half the busy time "
        "could make it look as if it waited",
    "... and read before synchronizing, its data was wrong every time":
        "the host reads within microseconds while the copy waits behind 20 ms of GPU work; only a host stalled "
        "for that long between the call and the read could see the new data",
}, values={"copy_ into pinned memory returned at once every time":
           ", ".join(pinlab.fmt_ms(t) for t in into_pinned["host_ms"])})

# %% [markdown]
# What did the host read? The first four values of the pinned buffer, right after the call and
# after waiting for the copy:

# %%
print("read right after the call:    ", into_pinned["head_before"])
print("expected:                     ", into_pinned["expected_head"])
print("read after done.synchronize():", into_pinned["head_after"])
ok = pinlab.claim("correct after synchronizing, every time", all(into_pinned["valid_after_sync"]),
                  why="an event recorded after the copy on its stream completes only once the copy has")

# %% [markdown]
# The fix is the end of `copy_back`: record an event right after the copy and `synchronize()` the
# event before you read. Between the two the host is free to do other work while the copy runs.
# `torch.cuda.synchronize()` works too, but waits for everything on the GPU. And
# `gpu_t.to("cpu", non_blocking=True)` allocates the result in pinned memory for you: same rule.

# %%
ok = pinlab.claims({
    ".to('cpu', non_blocking=True) returned at once every time":
        not any(stalls.waited(t, d2h["busy_ms"]) for t in to_cpu["host_ms"]),
    "... its result is pinned": to_cpu["result_pinned"],
    "... wrong before synchronizing, right after torch.cuda.synchronize()":
        not any(to_cpu["valid_before_sync"]) and all(to_cpu["valid_after_sync"]),
}, why="torch allocates the result of a non_blocking copy to the CPU in pinned memory and only enqueues the copy; "
       "the host reads within microseconds while the copy waits behind 20 ms of GPU work")

# %% [markdown]
# ## 4. Other hidden syncs
#
# Some calls block the host behind a busy GPU although nothing in them says "sync". Each one below
# is timed behind a 20 ms kernel and with the GPU idle; it **blocked** when the difference is more
# than half the busy time (so host work it does anyway is not counted as waiting). `x` is a pinned
# float32 tensor of 8 MiB.
#
# 🔮 **Predict** for each: blocks or not? `torch.tensor(python_list, device="cuda")`; a copy from
# `x[:, ::2]` (every other column of pinned memory); a copy from `x.t()` (the transpose: the same
# memory, read in another order) into a GPU tensor laid out like it, and into a contiguous one; a
# copy that converts float32 to bfloat16; `.item()`.
#
# <details><summary>Answer</summary>
#
# `torch.tensor(list, device="cuda")` builds the tensor on the CPU and copies it with a blocking
# copy. For a copy between host and GPU, PyTorch hands the driver one block of memory only when
# source and destination have the same dtype and the same dense layout (in any order of the
# dimensions). Otherwise it first gathers the source into a contiguous temporary **on the CPU**,
# in ordinary pageable memory, and copies that: a pageable copy again, however pinned the source
# was. This one is 8 MiB: whether it waits is the driver's staging decision of section 1 (where
# one copy of that size waited, this one waits too: fake `non_blocking`). So `x[:, ::2]`, which
# is not dense (holes between the elements), always goes through a pageable temporary; `x.t()` is
# dense: copied into `torch.empty_like(x.t(), device="cuda")`, which keeps its layout, it goes
# straight from pinned memory; copied into a contiguous tensor, it is gathered first. The rule is
# *dense in the destination's layout*, not *contiguous*. A dtype-converting copy from a
# contiguous pinned tensor copies first and converts on the GPU: asynchronous once its conversion
# kernel is loaded; the *first* launch of any kernel blocks while CUDA loads it (lazy module
# loading). `.item()` has to wait for the value: it always blocks.
# </details>

# %%
hs = pinlab.measure("02_hidden_syncs", stalls.hidden_syncs, busy_ms=20.0, repeat=3, list_len=4096,
                    view_bytes=8 * MiB)
row = {r["key"]: r for r in hs["rows"]}

# %% tags=["nbval-ignore-output"]
pinlab.table(hs["rows"], [("op", "operation"), ("blocked", "host blocked"),
                          ("host_ms", "host, GPU busy", ms), ("idle_ms", "host, GPU idle", ms)])

# %%
ok = pinlab.claims({
    "torch.tensor(list, device='cuda') blocked": row["tensor_list"]["blocked"],
    "copy_ from the dense view x.t() into a GPU tensor of the same layout did not block":
        not row["permuted_same_layout"]["blocked"],
    "copy_ from a contiguous pinned tensor did not block": not row["contig_pinned"]["blocked"],
    "a warm dtype-converting copy_ from pinned memory did not block": not row["dtype_warm"]["blocked"],
    ".item() blocked": row["item"]["blocked"],
    "a second launch of the same kernel did not block": not row["kernel_warm"]["blocked"],
}, why="torch.tensor(list, device=...) makes a blocking copy and .item() needs the value, so both wait for the "
       "busy GPU; a copy from pinned memory and a launch are only enqueued. Only a host stalled for half the "
       "busy time (an overloaded machine) could turn a 'did not block' into 'blocked'")
gathered_waited = pinlab.observe(
    "the copies gathered through a pageable temporary (from x[:, ::2], and x.t() into a contiguous tensor) waited",
    row["nondense_pinned"]["blocked"] and row["permuted_to_contiguous"]["blocked"],
    value=f"{pinlab.fmt_ms(row['nondense_pinned']['host_ms'])}, "
          f"{pinlab.fmt_ms(row['permuted_to_contiguous']['host_ms'])} behind {hs['busy_ms']:g} ms",
    why="the 8 MiB temporary is pageable: whether its copy waits is the driver's staging decision (section 1), "
        "undocumented; a driver or a GH200 that stages or reads it directly returns at once")

# %% [markdown]
# The two *first* calls depend on how CUDA loads kernels, which the environment variable
# `CUDA_MODULE_LOADING` controls. With `LAZY` a kernel's code is loaded on its first launch, and
# that launch waits for the busy GPU; with `EAGER` everything is loaded at start-up instead
# (slower start, no surprise later). Left unset, CUDA uses its default: lazy loading, on Linux
# since CUDA 12.2 and on every platform since 12.3 (CUDA programming guide, "Lazy Loading").
# Older PyTorch releases set `LAZY` themselves when they initialised CUDA, with C's `setenv`; newer
# ones leave the variable alone, since the driver loads lazily by default. Python's `os.environ` is
# a copy of the environment made when the interpreter started and does not see a later `setenv`,
# so we read the variable both ways: in Python's copy and in the process environment that CUDA
# reads. "(unset)" in both does not mean eager loading: the two lines after them show what the
# first launches did in this run.

# %%
pinlab.show("CUDA_MODULE_LOADING in os.environ (Python's copy)", hs["module_loading_environ"] or "(unset)")
pinlab.show("CUDA_MODULE_LOADING in the process environment (what CUDA reads)",
            hs["module_loading_effective"] or "(unset)")
for key in ("dtype_cold", "kernel_cold"):
    r = row[key]
    pinlab.show(r["op"], f"{'blocked' if r['blocked'] else 'did not block'} ({pinlab.fmt_ms(r['host_ms'])})")

# %% [markdown]
# The lesson for measurements: launch every kernel once before you time anything, or the first
# measurement lies. The lesson for serving: warm up (vLLM runs dummy batches before it serves).

# %% [markdown]
# ## 5. What it costs a step loop: a profiler timeline
#
# A toy step, as an engine runs it: wait until step *i-2* is done (an engine bounds how far the
# host runs ahead), prepare an 8 MiB input on the CPU (1 ms of work, written into a small ring of
# host buffers), copy it with `copy_(..., non_blocking=True)`, launch a 2 ms "forward". Here is
# the loop; `span(name)` marks each part for the profiler and does nothing otherwise.

# %%
def run_steps(bufs, dev, steps, *, cpu_ms, gpu_ms, in_flight, span=contextlib.nullcontext):
    """`steps` steps of the toy loop, then a sync; returns the host ms spent inside each copy_."""
    done = [torch.cuda.Event() for _ in bufs]       # done[k]: the step that used bufs[k] finished
    copy_ms = []
    for i in range(steps):
        k = i % len(bufs)
        with span("wait for step i-2"):
            if i >= in_flight:
                done[(i - in_flight) % len(bufs)].synchronize()   # bounded run-ahead
        with span("prepare inputs (CPU)"):
            t_end = time.perf_counter() + cpu_ms / 1e3
            bufs[k].fill_(i % 251)                  # write this step's input
            while time.perf_counter() < t_end:      # ... and the rest of the host's work
                pass
        with span("copy_(non_blocking=True)"):
            t0 = time.perf_counter()
            dev.copy_(bufs[k], non_blocking=True)
            copy_ms.append((time.perf_counter() - t0) * 1e3)
        with span("launch forward"):
            pinlab.gpu_busy(gpu_ms)                 # the forward pass, 2 ms of GPU work
        done[k].record()
    torch.cuda.synchronize()
    return copy_ms


# %% [markdown]
# `stalls.step_loop` runs this loop with three host buffers that are pageable, and with three that
# are pinned: the only difference. 40 steps of each are timed without the profiler (two rounds,
# alternating); then 6 steps of each are recorded with `torch.profiler` (CPU and CUDA activity),
# and the trace is read back into the plot below (`pinlab.profiler`).
#
# 🔮 **Predict.** The GPU needs 2 ms per step and the host 1 ms. How long does a step take with
# pinned inputs? With pageable ones: the host's 1 ms plus the GPU's 2 ms plus the copy?
#
# <details><summary>Answer</summary>
#
# Pinned: about one forward plus one copy per step. The copy and the forwards share one stream,
# so the GPU still runs them one after the other, but the host's 1 ms hides behind the GPU's work.
# Pageable: not the sum. Where the driver does not stage an 8 MiB copy behind the queue (section
# 1 measured from which size on it does not, on this machine), `copy_` waits until the previous
# forward is done, then the driver feeds the data through its staging buffer while the host waits
# inside the call, and only then does the host launch the next forward. The host's preparation
# still overlaps the previous forward, as long as it is shorter than a forward; what is serialized
# is the **staged copy**: about one forward plus one (slower) staged copy per step, plus the moment
# the host needs to return from `copy_` and launch the forward. A host that needs longer than a
# forward (a busy machine, few cores) sets the pace itself. The timeline shows which it was.
# </details>

# %%
RECORDED_TRACE = "reports/gpu/traces/02_step_loop.json"  # the GPU suite keeps a copy of the trace there
STEP = dict(steps=40, warm_steps=5, profile_steps=6, input_bytes=8 * MiB, gpu_ms=2.0, cpu_ms=1.0, in_flight=2)
loop = pinlab.measure("02_step_loop", partial(stalls.step_loop, run_steps), **STEP, trace=stalls.DEFAULT_TRACE)
pag, pin = loop["modes"]["pageable"], loop["modes"]["pinned"]
if loop.live:
    pinlab.show("this run's profiler trace", loop["trace_file"])
print("the recorded GPU run's profiler trace:", RECORDED_TRACE, "(open it in https://ui.perfetto.dev)")

# %%
fig, axes = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
for ax, mode in zip(axes, stalls.STEP_MODES):
    m = loop["modes"][mode]
    timeline({"host": m["host"], "GPU": m["gpu"]}, title=f"{mode} inputs", ax=ax)
    ax.set_ylim(1.5, -1.6)  # room for the legend above the host lane
fig.suptitle(f"Six steps from the profiler trace ({loop.tag})")
fig.tight_layout()
plt.show()

# %% [markdown]
# What to look for. Pageable, where the driver does not stage the copy behind the queue: the host
# enters `copy_` while the previous forward still runs and leaves it only after the copy has run on
# the GPU; the next forward starts after that, and the GPU computes nothing in between. The host's
# "prepare" overlaps the GPU's forward, where it is the shorter of the two. Pinned: `copy_`
# returns at once, the host waits only at the bounded run-ahead ("wait for step i-2"), and the
# forwards follow each other with only the short copy in between. The numbers, two models of the
# pageable step, and what this run shows:

# %%
memcpy = {m: span_stats(loop["modes"][m]["gpu"], name) for m in stalls.STEP_MODES
          for name in loop["modes"][m]["memcpy_names"]}
forward = {m: span_stats(loop["modes"][m]["gpu"], stalls.FORWARD_LABEL) for m in stalls.STEP_MODES}
staged = memcpy["pageable"]["duration_ms"]
pinlab.report("ms per step, pinned inputs", pin["ms_per_step"])
pinlab.report("ms per step, pageable inputs", pag["ms_per_step"])
pinlab.report("pageable, if host and GPU time added up: prepare + forward + staged copy",
              STEP["cpu_ms"] + STEP["gpu_ms"] + staged)
pinlab.report("pageable, if only the staged copy is serialized: forward + staged copy", STEP["gpu_ms"] + staged)
pinlab.show("one copy on the GPU (median), pageable (staged) / pinned",
            f"{ms(staged)} / {ms(memcpy['pinned']['duration_ms'])}")
pinlab.show("GPU time between two forwards (median), pageable / pinned",
            f"{ms(forward['pageable']['gap_ms'])} / {ms(forward['pinned']['gap_ms'])}")
pinlab.report("host time inside copy_ per step, pageable (median)", pag["copy_host_ms"])
pinlab.report("host time inside copy_ per step, pinned (median)", pin["copy_host_ms"])
pinlab.show("steps per second, pageable vs pinned inputs", f"{pag['steps_per_s']:.0f} vs {pin['steps_per_s']:.0f}")
pinlab.show("GPU idle share in the six profiled steps (no kernel running), pageable vs pinned",
            f"{pag['gpu_idle_share']:.0%} vs {pin['gpu_idle_share']:.0%}")
prep = span_stats(pag["host"], "prepare inputs (CPU)")["duration_ms"]
gap = forward["pageable"]["gap_ms"]
pinlab.report("host time preparing a step's input, pageable run (median of the profiled steps)", prep)
held = pag["copy_host_ms"] >= staged  # the host stayed inside copy_ at least as long as the copy ran on the GPU
if prep < STEP["gpu_ms"]:
    pace = (f"the host prepared a step in {ms(prep)}, less than a forward ({ms(STEP['gpu_ms'])}), so the "
            f"preparation hid behind the previous forward; between two forwards the GPU waited {ms(gap)}: the "
            f"staged copy ({ms(staged)}) and {ms(max(0.0, gap - staged))} for the host to leave copy_ and launch")
else:
    pace = (f"the host needed {ms(prep)} to prepare a step, more than a forward ({ms(STEP['gpu_ms'])}): the host "
            f"set the pace; between two forwards the GPU waited {ms(gap)}, of which the staged copy ran "
            f"{ms(staged)}")
models = {"only the staged copy serialized": STEP["gpu_ms"] + staged,
          "host and GPU time added up": STEP["cpu_ms"] + STEP["gpu_ms"] + staged}
nearest = min(models, key=lambda k: abs(models[k] - pag["ms_per_step"]))
pinlab.show("what this run shows",
            f"{pace}; the host {'stayed' if held else 'did not stay'} inside copy_ as long as the copy ran "
            f"on the GPU; the measured pageable step ({ms(pag['ms_per_step'])}) came closer to '{nearest}'")

# %% [markdown]
# Compare the measured step with the two models above. The mechanism predicts the second one
# while the host's work fits inside a forward: a fake `non_blocking` copy does not make the host's
# preparation serial with the GPU's work (in the timeline it overlaps the previous forward), only
# the copy itself, so the "added up" model counts host time that was hidden. Not to the
# microsecond: after the staged copy the GPU also waits while the host returns from `copy_` and
# launches the next forward; the timed steps include the loop's start and its final sync; and the
# staged copy's duration comes from the six profiled steps, not the timed ones. Where the host
# needs longer than a forward to prepare a step (a busy machine, few cores, a GPU shared with
# other learners), neither model holds: the host sets the pace, and the GPU waits for it between
# forwards. The last line above says which case this run was.
#
# **Why we do not assert the steps per second or the idle share.** Both are shown, not tested.
# What pinned inputs change per step is what sits between two forwards on the GPU (the gaps above):
# a fraction of a step, of the order of what a step's time moves from run to run, so a comparison
# could flip on a noisy run.
# And the GPU's idle share is not a law of pinned memory: it says how long the GPU waited, not
# why. A loop whose host falls behind leaves the GPU idle whatever its copies do, and six profiled
# steps are few: the profiler adds host work to every call, and one slow host step (the operating
# system, a page fault, the profiler itself) shows up as idle GPU time. A run in which the pinned
# loop is faster can still show it the larger idle share. What holds on every run are the names
# the profiler gives the copies; the cause, measured on the host, is shown beside them:

# %%
print("memcpy names in the pageable run:", sorted(pag["memcpy_names"]))
print("memcpy names in the pinned run:  ", sorted(pin["memcpy_names"]))
pinlab.show("memcpys recorded, pageable / pinned run",
            f"{sum(pag['memcpy_names'].values())} / {sum(pin['memcpy_names'].values())}")
ok = pinlab.claims({
    "the profiler named every copy of the pageable run 'Pageable -> Device'":
        set(pag["memcpy_names"]) == {"Memcpy HtoD (Pageable -> Device)"},
    "the profiler named every copy of the pinned run 'Pinned -> Device'":
        set(pin["memcpy_names"]) == {"Memcpy HtoD (Pinned -> Device)"},
}, why="CUPTI names a copy by the kind of host memory it reads; ROCm's profiler names copies differently")
host_held = pinlab.observe(
    "the host spent at least 10 times longer inside a pageable copy_ than inside a pinned one",
    pag["copy_host_ms"] >= 10 * pin["copy_host_ms"], value=f"{pag['copy_host_ms'] / pin['copy_host_ms']:.0f}x",
    why="where the driver stages an 8 MiB pageable copy behind the queue (another driver) or the GPU reads "
        "pageable memory directly (GH200), the pageable copy_ returns sooner")

# %% [markdown]
# The profiler tells the two copies apart by name: search a trace for `Pageable -> Device` to find
# the copies that may be fake `non_blocking`.
#
# ## 6. Copy and compute at the same time: a copy stream
#
# Look again at the pinned timeline of section 5: between two forwards the GPU runs the copy, and
# computes nothing meanwhile. `non_blocking=True` freed the **host**; it did not let the copy run
# beside the GPU's work, because the copy and the forward sit on one stream, and a stream runs its
# work in order. A copy runs *beside* a kernel only when three things hold:
#
# 1. **a free copy engine**: the GPU moves data with DMA engines separate from the cores that run
#    kernels (data-centre GPUs have several), so one can copy while the others compute;
# 2. **another stream**: the copy must be queued on a stream other than the compute's, or it waits
#    its turn behind the compute (and the compute behind it);
# 3. **a pinned source**: only then can the copy engine of a GPU over PCIe read the host memory
#    by itself. From pageable memory the driver copies through its staging buffer, and a copy it
#    does not stage behind the queue makes the host wait (section 1). (A GPU that reads host
#    memory through the host's page tables, as on a GH200, is another case.)
#
# PyTorch's tutorial "A guide on good usage of `non_blocking` and `pin_memory()`" shows the pattern
# with a side stream. Here it is in a step loop: each step copies a 16 MiB pinned input to the GPU
# and computes on it (`compute` keeps the GPU busy for `ms`, then sums the input, so that a step
# that read the wrong data shows it). `one_stream_steps` does it all on the current stream;
# `copy_stream_steps` copies each input on a **copy stream** while the step before computes.

# %%
def compute(x, out_i, ms):
    """One step's work on the GPU: `ms` of busy kernel, then the sum of the input x into out_i."""
    pinlab.gpu_busy(ms)
    torch.sum(x, dim=0, dtype=torch.int64, out=out_i)


def one_stream_steps(inputs, out, compute):
    """Step i copies inputs[i] to the GPU, then computes on it; everything on the current stream."""
    for i, x in enumerate(inputs):
        x_gpu = x.to("cuda", non_blocking=True)
        compute(x_gpu, out[i])


def copy_stream_steps(inputs, out, compute, copy_stream, record=True):
    """The same steps; each input is copied on copy_stream while the step before it computes."""
    compute_stream = torch.cuda.current_stream()
    copy_stream.wait_stream(compute_stream)         # copies start after the work queued so far

    def fetch(x):
        with torch.cuda.stream(copy_stream):        # queue the copy on the copy stream
            return x.to("cuda", non_blocking=True)  # (its memory now belongs to copy_stream)

    nxt = fetch(inputs[0])
    for i in range(len(inputs)):
        x_gpu = nxt
        compute_stream.wait_stream(copy_stream)     # step i's input has arrived (the GPU waits, not the host)
        if record:
            x_gpu.record_stream(compute_stream)     # used there: do not reuse its memory before that is done
        if i + 1 < len(inputs):
            nxt = fetch(inputs[i + 1])              # the next input, copied while this step computes
        compute(x_gpu, out[i])
        del x_gpu


# %% [markdown]
# Two lines do the ordering. `copy_stream.wait_stream(compute_stream)` makes the copy stream wait
# for what was queued before the loop; `compute_stream.wait_stream(copy_stream)` makes step *i*'s
# compute wait, on the GPU, for the copies queued so far, that is up to step *i*'s input (the next
# one is queued after it). An event does the same: `ev.record(copy_stream)` after the copy, then
# `compute_stream.wait_event(ev)`.
#
# The third line is about memory. PyTorch's caching allocator ties every block it hands out to the
# stream it was allocated on, here the copy stream, and hands a freed block out again at once to
# the next allocation on that stream. When `x_gpu` is freed (`del x_gpu`), the next `fetch`,
# queued on the copy stream, which never waits for the compute, may write the next input into
# that block while the compute stream has not read it yet. `x_gpu.record_stream(compute_stream)` tells the
# allocator that the block is in use on the compute stream too: it is reused only once the work
# queued there at the time of the free has finished. (The other way: keep `x_gpu` alive until an
# event recorded after its last use has completed.)
#
# 🔮 **Predict.** A step computes for 0.5 ms; a 16 MiB copy from pinned memory takes a fraction of
# that (lesson 01 measured the bandwidth). Which loop runs more steps per second, and how idle is
# the GPU's compute in each? What changes with pageable inputs on the copy stream? And what does
# `copy_stream_steps(..., record=False)` compute?
#
# <details><summary>Answer</summary>
#
# One stream: a copy, then a compute, per step; the compute is idle while each copy runs. With the
# copy stream and pinned inputs the copies run beside the compute and the step shrinks to about
# the compute alone, as long as the copy is shorter. With pageable inputs the third condition
# fails: where the driver does not stage a 16 MiB copy behind the queue (section 1 says from which
# size on it did not, here), the host waits inside `fetch` while the driver feeds the data through
# staging, more slowly than a pinned copy, and it cannot queue the next compute meanwhile. Without
# `record_stream`, wrong sums: inputs overwritten before they were read.
# </details>
#
# This section needs a GPU: the emulated stream that lessons run on a CPU (`LaggingStream`) has a
# single queue and no side streams, so without CUDA the notebook replays the recorded GPU run.
#
# `stalls.overlap_loop` runs the three loops in interleaved rounds (40 steps each, 3 rounds, every
# step's sum checked against the CPU's), then 6 steps of each under the profiler, and last the
# copy stream once without `record_stream`.

# %%
OVERLAP = dict(steps=40, rounds=3, input_bytes=16 * MiB, n_inputs=4, compute_ms=0.5, profile_steps=6)
ov = pinlab.measure("02_overlap", partial(stalls.overlap_loop, one_stream_steps, copy_stream_steps, compute),
                    **OVERLAP, trace=stalls.OVERLAP_TRACE)
ovm = ov["modes"]

# %%
stalls.plot_overlap(ovm, title=f"Six steps from the profiler trace: compute kernels and copies ({ov.tag})")
plt.show()

# %% [markdown]
# What to look for (each plot has its own time axis). One stream: compute and copies take turns,
# never side by side. Copy stream, pinned: the copies run under the compute, one step ahead or more
# (the host queues every step at once, and the copy stream never waits for the compute). Copy
# stream, pageable, where the driver does not stage a 16 MiB copy behind the queue: the staged
# copies are longer than the pinned ones (the last line below says by how much here), and the
# compute runs only in the gaps between them. The host waits inside each `fetch` until its staged
# copy is done, and queues the step's compute only after that: a second stream cannot help a copy
# that holds the host. The numbers:

# %%
for key, label in stalls.OVERLAP_MODES.items():
    m = ovm[key]
    o = m["overlap"]
    pinlab.report(f"{label}: ms per step (median of {ov['rounds']} rounds)", m["ms_per_step"])
    pinlab.show(f"{label}: steps per second", f"{m['steps_per_s']:.0f}")
    pinlab.show(f"{label}: GPU idle share (no kernel running), profiled steps", f"{m['gpu_idle_share']:.0%}")
    pinlab.show(f"{label}: copies that ran beside a kernel, profiled steps",
                f"{o['overlapping']} of {o['copies']} ({o['share']:.0%} of the copy time)")
    copy = span_stats(stalls.overlap_lanes(m["gpu"])["copies"], next(iter(m["memcpy_names"])))
    pinlab.report(f"{label}: one copy on the GPU (median)", copy["duration_ms"])
pinlab.show("steps per second, copy stream / one stream (pinned inputs)",
            f"{ovm['copy_stream_pinned']['steps_per_s'] / ovm['one_stream_pinned']['steps_per_s']:.2f}x")
copy_ms = {k: span_stats(stalls.overlap_lanes(ovm[k]["gpu"])["copies"], next(iter(ovm[k]["memcpy_names"])))
           ["duration_ms"] for k in ("copy_stream_pinned", "copy_stream_pageable")}
pinlab.show("copy stream: one copy on the GPU, pageable / pinned inputs",
            f"{copy_ms['copy_stream_pageable'] / copy_ms['copy_stream_pinned']:.1f}x")

# %% [markdown]
# Steps per second and idle shares are shown, not asserted: they depend on the copy's speed and
# the compute's length, and six profiled steps are few (section 5 says why). What holds on every
# run: the results, and what runs beside what.

# %%
one, side = ovm["one_stream_pinned"], ovm["copy_stream_pinned"]
ok = pinlab.claims({
    "every step's sum was right in all three loops": all(ovm[k]["wrong_steps"] == 0 for k in stalls.OVERLAP_MODES),
    "on one stream, no copy ran beside a kernel": one["overlap"]["overlapping"] == 0,
    "the copy stream's copies from pageable inputs went through staging (Pageable -> Device)":
        set(ovm["copy_stream_pageable"]["memcpy_names"]) == {"Memcpy HtoD (Pageable -> Device)"},
}, why={
    "every step's sum was right in all three loops":
        "each step's compute waits, on the GPU, for its input's copy (wait_stream), and record_stream keeps the "
        "input's memory from reuse until the compute has read it",
    "on one stream, no copy ran beside a kernel": "a stream runs its work in order, one operation at a time",
    "the copy stream's copies from pageable inputs went through staging (Pageable -> Device)":
        "CUPTI names a copy by the kind of host memory it reads; ROCm's profiler names copies differently",
}, values={"every step's sum was right in all three loops":
           ", ".join(f"{k}: {ovm[k]['wrong_steps']} wrong" for k in stalls.OVERLAP_MODES)})
overlapped = pinlab.observe(
    "with a copy stream and pinned inputs, most copies ran beside a kernel",
    side["overlap"]["overlapping"] >= side["overlap"]["copies"] / 2,
    value=f"{side['overlap']['overlapping']} of {side['overlap']['copies']}",
    why="it needs a free copy engine and is read from the profiler's timestamps of six steps; a GPU shared with "
        "other processes switches between their work and yours")

# %% [markdown]
# And without `record_stream`? The same copy-stream loop, pinned inputs, once:

# %%
race = ov["no_record_stream"]
pinlab.show("copy stream without record_stream: steps whose sum was wrong", f"{race['wrong_steps']} of {race['steps']}")
ok = pinlab.claim("without record_stream, at least one step computed on an input overwritten before it was read",
                  race["wrong_steps"] > 0, value=f"{race['wrong_steps']} of {race['steps']} steps wrong",
                  why="the race needs the host far ahead of the GPU (it queues 40 steps of 0.5 ms in well under a "
                      "millisecond each) and the caching allocator handing a freed input's block to the next copy; "
                      "a host slower than the GPU's 0.5 ms per step would let the compute read each input in time")

# %% [markdown]
# The host queues all 40 steps long before the GPU has computed the first few: that lead is what
# makes the reuse fatal here, for many steps of the run. Some steps still come out right, by luck:
# their block was last overwritten by an input with the same contents (the loop cycles through 4
# inputs, and the freed blocks are handed out in turn). In a real loop the lead is smaller and the
# same bug corrupts a step now and then: the worst kind. Note the cost of the fix too:
# with `record_stream` and a host far ahead, the allocator cannot reuse an input's memory until
# its compute has run, so it holds one input per step in flight (an engine bounds the run-ahead,
# section 5, and with it this memory).
#
# ## 7. Many tensors: one sync for all
#
# A step rarely copies one tensor. The tutorial's second lesson: copy N tensors with
# `non_blocking=True` and synchronize once, instead of N blocking copies that each wait for their
# own copy. Here are both, for N tensors already on the host (pinned, or pageable for contrast),
# with the GPU idle, as a data loader hands over a batch:

# %%
def copy_each_blocking(dsts, srcs):
    for d, s in zip(dsts, srcs):
        d.copy_(s)                         # each copy: queue it, then wait until it is done


def copy_all_then_sync(dsts, srcs):
    for d, s in zip(dsts, srcs):
        d.copy_(s, non_blocking=True)      # queue them all
    torch.cuda.synchronize()               # one wait, for all of them


# %% [markdown]
# 🔮 **Predict.** 64 tensors of 4 KiB, of 64 KiB, of 1 MiB: which way costs the host less, pinned
# and pageable?
#
# <details><summary>Answer</summary>
#
# Pinned: blocking copies make the host and the copy engine take turns (queue a copy, wait for it,
# queue the next); with one sync the host queues the next copy while the engine runs the last one,
# and waits once. Pageable: the host itself copies every tensor into the driver's staging buffer
# either way, a cost the single sync does not remove, and once the staging pool is full (section
# 2) the `non_blocking` copies wait too. So expect one sync to be cheaper both ways, and look at
# two numbers per case below: the ratio, and the time it saved. They need not move together: as
# the tensors grow, the copies take longer either way, which can shrink the ratio while the time
# saved grows.
# </details>
#
# `stalls.many_tensors` times both functions (median of 7 interleaved tries) and checks that every
# byte arrived.

# %%
many = pinlab.measure("02_many_tensors", partial(stalls.many_tensors, copy_each_blocking, copy_all_then_sync),
                      cases=[[64, 4 * KiB], [64, 64 * KiB], [64, MiB]], repeat=7)

# %% tags=["nbval-ignore-output"]
pinlab.table(many["rows"], [("n", "tensors"), ("bytes", "each", fmt_bytes),
                            *[(k, label, ms) for k, label in stalls.MANY_VARIANTS.items()]])

# %%
stalls.plot_many_tensors(many["rows"], title=f"N host tensors to the GPU, host time ({many.tag})")
plt.show()

# %%
for r in many["rows"]:
    case = f"{r['n']} x {fmt_bytes(r['bytes'])}"
    for kind in ("pinned", "pageable"):
        blocking, one_sync = r[f"{kind}_blocking_ms"], r[f"{kind}_nb_sync_ms"]
        saved = blocking - one_sync
        pinlab.show(f"{case}, {kind}: blocking copies / non_blocking + one sync",
                    f"{blocking / one_sync:.1f}x, {ms(abs(saved))} {'saved' if saved >= 0 else 'lost'} by the one sync")
ok = pinlab.claim("every tensor arrived intact, every way", all(r["data_ok"] for r in many["rows"]),
                  why="every copy is checked after a sync, byte for byte; a wrong byte would be a fault, not a timing")

# %% [markdown]
# Read the lines above: the ratio (more than 1x: the single sync was cheaper) and the host time it
# saved, per case. They are shown, not asserted: a blocking copy's wait is a round trip to an idle
# GPU, which varies from run to run. The mechanism does not vary: N blocking copies wait N times,
# the other way waits once, after queuing everything. In a training loop a `DataLoader(...,
# pin_memory=True)` gives you the pinned batch (with `num_workers > 0` a pin-memory thread pins it
# while the loop runs; with `num_workers=0` the main thread pins it inside `next()`, lesson 01),
# and `batch.to("cuda", non_blocking=True)` per tensor then queues every copy without a wait.
#
# ## 8. The tutorial's advice, tested
#
# The tutorial's summary advises calling `tensor.to(device, non_blocking=True)` in general, whether
# or not the tensor is pinned. This lesson's own measurements (sections 1 to 3, this run) test it,
# case by case:

# %%
advice = stalls.advice_rows(sweep.result, pool.result, d2h.result)

# %% tags=["nbval-ignore-output"]
pinlab.table(advice, [("case", "non_blocking=True, ..."), ("outcome", "outcome"), ("evidence", "evidence (this run)")])

# %%
expected_outcomes = [stalls.ADVICE_HOLDS, stalls.ADVICE_HOLDS, stalls.ADVICE_WAITS, stalls.ADVICE_WAITS,
                     stalls.ADVICE_WAITS, stalls.ADVICE_STALE]
documented = (0, 4, 5)  # pinned H2D, D2H into pageable, D2H into pinned: what CUDA documents
ok = pinlab.claims({f"{advice[i]['case']}: {expected_outcomes[i]}": advice[i]["outcome"] == expected_outcomes[i]
                    for i in documented},
                   why="CUDA documents these three (a copy from or into pinned memory is only enqueued, a copy into "
                       "pageable host memory returns once it has completed); only a host stalled for half the busy "
                       "time could change an outcome")
for i, (r, want) in enumerate(zip(advice, expected_outcomes)):
    if i not in documented:
        pinlab.observe(f"{r['case']}: {want}", r["outcome"] == want, value=r["evidence"],
                       why="when a pageable copy waits is undocumented driver behaviour (the staging limits of "
                           "sections 1 and 2); on ROCm every pageable copy waits, on a GH200 it need not")

# %% [markdown]
# Where the advice holds: a copy from pinned memory is queued at any size (documented), and a small
# pageable copy is staged by the driver and returns at once where the driver stages it (CUDA's
# drivers do, up to limits they do not document; on ROCm every pageable copy waits: the
# `[measured]` lines above say what happened here). On the GPU the copy runs in stream order, before
# anything queued after it, so the device data is right, with one condition the flag adds: the
# host must not write a pinned source until the copy has run (lesson 03 is that race; a pageable
# source is copied into staging at the call). Where it fails: one large pageable copy waits for
# the GPU where the driver does not stage it; many small ones wait once the staging pool's pending
# bytes are full; a copy into pageable host memory is synchronous whatever the flag says
# (documented). And where it is a
# trap: into pinned memory (`.to("cpu", non_blocking=True)` allocates pinned memory for you), the
# call returns before the data is there (section 3; the tutorial warns about this one too).
# Section 6 adds the last case: even pinned and `non_blocking`, a copy on the compute's stream never
# runs beside the compute.
#
# So for host-to-device copies the advice costs nothing and may help, but it is a request, not a
# promise: pin what you copy on a hot path (and leave the pinned source alone until the copy has
# run), read device-to-host results only after an event, and put copies on their own stream when
# they should hide behind the compute.
#
# ## 9. `async_tensor_h2d`: host data to the GPU, honestly
#
# Host data often starts as a Python list (token ids, positions, a mask). `torch.tensor(list,
# device="cuda")` is the obvious way, and it blocks (section 4). vLLM's `async_tensor_h2d` keeps
# a contract in three steps: build the tensor **on the CPU**, **pin** it (a fresh block, so
# nobody else writes it while the copy is pending), copy it with **`non_blocking=True`**.
# `pinlab.async_tensor_h2d(data, dtype=None, device="cuda")` does the same.
#
# 🔮 **Predict.** Behind a 20 ms kernel, which of the three calls below waits?

# %%
ah = pinlab.measure("02_async_h2d", stalls.async_h2d_cost, list_len=4096, busy_ms=20.0, repeat=10)
arow = {r["key"]: r for r in ah["rows"]}

# %% tags=["nbval-ignore-output"]
pinlab.table(ah["rows"], [("op", f"{ah['list_len']} ints to the GPU"), ("blocked", "host blocked"),
                          ("host_ms", "host, GPU busy", ms), ("idle_ms", "host, GPU idle", ms)])

# %%
ok = pinlab.claims({
    "torch.tensor(list, device='cuda') waited for the GPU": arow["factory"]["blocked"],
    "pinlab.async_tensor_h2d(list) did not": not arow["async"]["blocked"],
    "all three calls gave the same GPU tensor": ah["same_values"],
}, why="torch.tensor(list, device=...) makes a blocking copy; async_tensor_h2d copies from a fresh pinned block, "
       "which is only enqueued; only a host stalled for half the busy time could change that")
small_staged = pinlab.observe(
    "torch.tensor(list).to('cuda', non_blocking=True) did not wait (the driver staged it)",
    not arow["pageable_nb"]["blocked"], value=pinlab.fmt_ms(arow["pageable_nb"]["host_ms"]),
    why="a small pageable copy is staged where the driver chooses to (undocumented); on ROCm it waits")

# %% [markdown]
# The middle one, a small pageable tensor copied `non_blocking`, is staged by the driver where it
# fits the staging pool, and then returns at once (the last line says whether it did here); in a
# loop that queues more pageable copies, it waits (section 2).
# Use `async_tensor_h2d` for host data that becomes a **new** GPU tensor on a hot path (a step
# loop, while the GPU is busy). For a GPU buffer you keep and refill every step, copy from a
# private pinned snapshot instead: `gpu_buf[:n].copy_(pinlab.pin_snapshot(host_buf[:n]),
# non_blocking=True)` (lesson 04). Off the hot path, `torch.tensor(..., device="cuda")` is fine.
#
# ## 10. Finding stalls in your own code: `pinlab.detect_stalls`
#
# `torch.cuda.set_sync_debug_mode("warn")` warns when PyTorch itself synchronizes. But a fake
# `non_blocking` copy blocks inside the CUDA driver, not in PyTorch: PyTorch never knows. vLLM
# added its own check for exactly this (#53491). `pinlab.detect_stalls()` watches every torch call
# in a `with` block and reports pageable `non_blocking` copies, blocking copies, `.item()`-style
# syncs and `torch.tensor(..., device="cuda")`, each with your `file:line`.
#
# The loop body it watches here, as a function of this notebook: a pageable `non_blocking` copy,
# a tensor built from a Python list, a little GPU work, and a loss read on the host.

# %%
def demo_step(step, weights, inputs_cpu, inputs_gpu, gpu_ms):
    inputs_gpu.copy_(inputs_cpu, non_blocking=True)       # the batch, from pageable memory
    positions = torch.tensor([step] * 64, device="cuda")   # built from a Python list
    hidden = torch.relu(inputs_gpu @ weights) + positions[0]
    pinlab.gpu_busy(gpu_ms)                                # the rest of the forward
    return hidden.sum().item()                             # the loss, read on the host


# %% [markdown]
# 🔮 **Predict.** 20 steps of `demo_step` under `detect_stalls()`: how many stalls, of which kinds,
# and at which lines?
#
# `stalls.detector_demo(demo_step, ...)` runs it: the loop under the detector, the loop's cost with
# and without it, and each stalling call alone under `set_sync_debug_mode("warn")`.

# %%
det = pinlab.measure("02_detector", partial(stalls.detector_demo, demo_step), steps=20, gpu_ms=0.5,
                     features=256, repeat=5)

# %% tags=["nbval-ignore-output"]
print(det["summary"])

# %% [markdown]
# The report names each stall's file and line: here the file is this notebook's cell, whose name
# changes from run to run, so we count lines inside `demo_step` (its `def` is line 1).

# %%
expected = {kind: det["steps"] for kind in stalls.DEMO_STALLS.values()}
for kind, n in det["counts"].items():
    print(f"{kind}: {n}")
lines = {kind: [line] for kind, line in stalls.source_lines(demo_step).items()}
for kind, line in sorted(lines.items(), key=lambda kv: kv[1]):
    print(f"line {line[0]} of demo_step: {kind}")
ok = pinlab.claims({
    "one stall of each kind per step, and nothing else": det["counts"] == expected,
    "each stall points at its line of demo_step": det["stall_lines"] == lines,
}, values={"one stall of each kind per step, and nothing else": det["counts"],
           "each stall points at its line of demo_step": det["stall_lines"]},
   why="the detector classifies each call by its arguments (a pageable source, a Python list, .item()), not by "
       "timing, so the counts are exact on any machine")

# %% [markdown]
# The same three calls, one at a time, under `torch.cuda.set_sync_debug_mode("warn")` (its
# warnings caught with `warnings.catch_warnings(record=True)`) and under `detect_stalls()`:

# %%
for c in det["compare"]:
    print(f"{c['op']}\n    set_sync_debug_mode('warn') warned: {c['sync_debug_warnings'] > 0}"
          f"   detect_stalls() reported: {c['detector_events'] > 0}")
cmp = {c["key"]: c for c in det["compare"]}
ok = pinlab.claim("set_sync_debug_mode('warn') missed the pageable non_blocking copy, detect_stalls() reported it",
                  cmp["pageable_copy"]["sync_debug_warnings"] == 0 and cmp["pageable_copy"]["detector_events"] > 0,
                  value=cmp["pageable_copy"],
                  why="torch's sync debug mode warns only where torch itself synchronizes; a torch release that "
                      "learned to flag pageable non_blocking copies would change the first half")

# %% [markdown]
# Does watching cost much? The loop's host time with and without the detector (median of 5 runs
# each). The loop does real GPU work every step, as a training or serving loop does, so the
# ratio is the one you would see.

# %%
plain, watched = det["plain_ms"]["median"], det["detected_ms"]["median"]
pinlab.report(f"{det['steps']} steps, plain (median)", plain)
pinlab.report(f"{det['steps']} steps under detect_stalls() (median)", watched)
cheap = pinlab.observe("the detector at most doubled the loop's host time", watched <= 2 * plain,
                       value=f"{watched / plain:.2f}x",
                       why="the detector adds Python work to every torch call; a slow or busy host (2 cores, other "
                           "learners) pays more for it against the same GPU work")

# %% [markdown]
# ## Clean up

# %%
ok = pinlab.claim("pinned memory held is back to its starting level", pinlab.pinned_back_to(pinned_at_start),
                  why="every experiment frees what it pinned and empties torch's pinned cache; a tensor still "
                      "referenced from a cell, or an error that stopped an experiment halfway, keeps its block")

# %% [markdown]
# ## What to remember
# - `non_blocking=True` is a request. From **pinned** memory it is honoured; from **pageable**
#   memory only while the driver agrees to stage the copy: one copy above a size limit, or many
#   small ones queued behind a busy GPU up to a limit on pending bytes, and the host waits. Both
#   limits are undocumented and driver-dependent (CUDA's "API synchronization behavior" page only
#   says such a copy "might be synchronous"; on ROCm every pageable copy waits); this run's sizes
#   are above. A pageable copy the driver stages is asynchronous for the host, at the cost of the
#   staging `memcpy`; *fake* is the one that says `non_blocking` and waits.
# - A `non_blocking` copy **into** pinned host memory returns before the data is there: record an
#   event after it and `synchronize()` the event before you read.
# - Hidden syncs: `torch.tensor(list, device="cuda")`, a source that is not dense in the
#   destination's layout (PyTorch gathers it into a pageable temporary), `.item()`, and the first
#   launch of every kernel (warm up before you measure or serve).
# - In a step loop, a fake `non_blocking` copy serializes the staged copy with the GPU's work:
#   the host waits inside `copy_` and the GPU computes nothing meanwhile. The profiler names the
#   copy `Memcpy HtoD (Pageable -> Device)`.
# - `non_blocking` frees the host, not the GPU: on one stream a copy and a kernel take turns. A copy
#   runs beside the compute only with a free copy engine, a **copy stream** and a **pinned** source:
#   `copy_stream.wait_stream(compute_stream)`, the copy inside `with torch.cuda.stream(copy_stream):`,
#   `compute_stream.wait_stream(copy_stream)` (or an event) before the compute uses it, and
#   `x_gpu.record_stream(compute_stream)`, or the caching allocator hands the copy's memory to the
#   next copy before the compute has read it (this run counted the wrong steps above).
# - Many tensors: queue every copy `non_blocking` and synchronize once, instead of one wait per copy.
# - "`non_blocking=True`, pinned or not" costs nothing for host-to-device copies, but it is a
#   request, not a promise: large or many pageable copies wait, a copy into pageable host memory is
#   synchronous, and one into pinned memory returns before the data is there.
# - Use `async_tensor_h2d` (CPU build, pin, `non_blocking`) for host data on a hot path, and
#   `detect_stalls()` to find what `set_sync_debug_mode("warn")` misses.
#
# **Exercise:** `exercises/02_fake_non_blocking.ipynb` (solution in `solutions/`).
# **Next:** 03 · the race: a reused pinned buffer and a CPU that runs ahead.
