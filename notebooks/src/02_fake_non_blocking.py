# %% [markdown]
# # 02 · Fake `non_blocking`: when a copy returns
#
# **What you will learn**
# - what `non_blocking=True` promises, and from what size one pageable copy makes the host wait;
# - the driver's two undocumented staging limits, measured here: per copy, and bytes pending;
# - why data copied `non_blocking` *into* pinned memory is wrong until you synchronize;
# - other calls that quietly block the host (`torch.tensor(list, device="cuda")`, a *non-dense*
#   pinned source, `.item()`, a kernel's first launch);
# - `with pinlab.stream() as s:`: the same order of host and GPU work on any machine (exercise 02
#   uses it);
# - PyTorch's tutorial advice "use `non_blocking=True`, pinned or not", tested case by case, with
#   its experiment and checklist.
#
# Lesson 02b continues with copies that overlap.

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
import time
from functools import partial

import matplotlib.pyplot as plt
import torch

import pinlab
from pinlab.lessons import l02_fake_non_blocking as stalls
from pinlab.plots import fmt_bytes, size_sweep

KiB, MiB = stalls.KiB, stalls.MiB
pinlab.header("02 fake non_blocking: when a copy returns")
pinned_at_start = pinlab.pinned_baseline()

# %% [markdown]
# ## What `non_blocking=True` promises
#
# `gpu_t.copy_(cpu_t, non_blocking=True)` asks PyTorch to *enqueue* the copy on the GPU's stream and
# return at once, so the host prepares the next step while the GPU works: that overlap keeps a GPU
# fed.
#
# The promise surely holds when `cpu_t` is **pinned** (lesson 01): the copy engine reads it where it
# lies. From pageable memory the driver first copies the data into a limited pinned staging buffer
# of its own. A copy it stages returns at once: asynchronous for the host, at the price of the
# staging `memcpy`. A copy that does not fit waits until the GPU has finished everything queued
# before it, then goes through staging with the host waiting. The call says `non_blocking=True`; the
# host waits anyway: the *fake* `non_blocking`.
#
# CUDA promises no more. The CUDA Runtime API's page "API synchronization behavior"
# (https://docs.nvidia.com/cuda/cuda-runtime-api/api-sync-behavior.html) says, in CUDA 12.2 and
# later, that for transfers between device memory and pageable host memory an asynchronous copy
# "might be synchronous" with respect to the host (`docs/facts.md` F6, F7). When, and up to which
# sizes the driver stages instead, is undocumented: this lesson measures what the driver did here.
# Other platforms differ (not measured here: the course never ran on them): HIP documents a
# `hipMemcpyAsync` from or to unpinned host memory as performed synchronously (ROCm, F17); where the
# GPU reads host memory through the host's page tables (a GH200, F15), a pageable copy need not be
# staged at all.
#
# **Making waiting visible.** An idle GPU runs a copy at once, so a call that waits for it still
# looks fast. So every experiment first enqueues `pinlab.gpu_busy(ms)`, a kernel spinning for `ms`
# milliseconds: a call behind it that returns in microseconds did not wait; one taking over half the
# busy time **waited** (`stalls.waited`). Every timed kernel is launched once beforehand
# (`pinlab.warmup`): a first launch can block too (section 4).

# %% [markdown]
# ## 1. The copy that returns or waits
#
# The whole experiment: make the GPU busy, time one `copy_(..., non_blocking=True)` on the host,
# synchronize. Copy it into your code to test a copy you are unsure of.


# %%
def copy_returns_or_waits(dst, src, busy_ms):
    """Host ms spent inside one dst.copy_(src,
    non_blocking=True) issued behind busy_ms of GPU work."""
    torch.cuda.synchronize()  # start from an idle GPU: nothing queued, nothing staged
    pinlab.gpu_busy(busy_ms)  # queue busy_ms of GPU work; this call returns at once
    t0 = time.perf_counter()
    dst.copy_(src, non_blocking=True)  # enqueue the copy behind it ... or wait
    host_ms = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()  # let the GPU finish before the next try
    return host_ms


# %% [markdown]
# 🔮 **Predict.** Behind a GPU busy for 10 ms, how long does the host spend in one `copy_(...,
# non_blocking=True)` of 256 B from pageable memory? Of 64 MiB? From pinned memory?
#
# <details><summary>Answer</summary>
#
# Pinned: microseconds, at every size (the copy is only enqueued). Pageable, on a CUDA GPU over
# PCIe: microseconds for small copies, which the driver stages at once; from some size on, the whole
# busy time and more. Find that size below (ROCm differs, not measured here: `docs/facts.md` F17).
# </details>
#
# `stalls.single_copy_sweep` runs the function above for 27 sizes from 256 B to 64 MiB (finer
# between 1 and 4 MiB), from a pageable and a pinned tensor, median of 3 tries each, and times
# `src.to("cuda", non_blocking=True)` the same way: a few seconds on a GPU.

# %%
sweep = pinlab.measure(
    "02_single_copy",
    partial(stalls.single_copy_sweep, copy_returns_or_waits),
    sizes=stalls.SWEEP_SIZES,
    busy_ms=10.0,
    repeat=3,
    bench_bytes=8 * MiB,
    bench_repeat=30,
)
busy_ms, rows = sweep["busy_ms"], sweep["rows"]
sizes = [r["bytes"] for r in rows]

# %% tags=["nbval-ignore-output"]
pinlab.table(rows, stalls.SWEEP_COLUMNS)

# %% [markdown]
# Where does a pageable copy start to wait? We take the smallest size from which **every** larger
# copy waited (`stalls.first_waiting_size`), so one stray slow measurement cannot fool us.

# %%
first_wait = stalls.first_waiting_size(
    sizes, [r["copy_pageable_ms"] for r in rows], busy_ms / 2
)
series = {
    k.replace("_ms", "").replace("_", " "): [r[k] for r in rows]
    for k in ("copy_pageable_ms", "to_pageable_ms", "copy_pinned_ms", "to_pinned_ms")
}
size_sweep(
    sizes,
    series,
    ylabel="host ms inside the call",
    hline=(busy_ms, "GPU busy time"),
    vline=(first_wait, "every copy from here on waited") if first_wait else None,
    title=f"One non_blocking H2D call behind a busy GPU ({sweep.tag})",
)
plt.show()
pinned_quick = not stalls.waited(
    max(series["copy pinned"] + series["to pinned"]), busy_ms
)
pinlab.show(
    "takeaway",
    ("every pinned call returned at once" if pinned_quick else "a pinned call waited")
    + (
        f"; pageable copy_ waited from {fmt_bytes(first_wait)} on"
        if first_wait
        else "; no pageable copy_ waited"
    ),
)

# %%
quick = [s for s in sizes if first_wait is None or s < first_wait]
first_wait_to = stalls.first_waiting_size(
    sizes, [r["to_pageable_ms"] for r in rows], busy_ms / 2
)
pinlab.show(
    "pageable copy_: largest size that returned at once",
    fmt_bytes(max(quick)) if quick else "none",
)
pinlab.show(
    "pageable copy_: first size from which every copy waited",
    fmt_bytes(first_wait) if first_wait else "none",
)
pinlab.show(
    "pageable .to: first size from which every call waited",
    fmt_bytes(first_wait_to) if first_wait_to else "none",
)

# %%
by_size = {r["bytes"]: r for r in rows}
slowest_pinned = max(r[k] for r in rows for k in ("copy_pinned_ms", "to_pinned_ms"))
pinlab.claim(
    "every pinned copy_ and .to returned at once",
    not stalls.waited(slowest_pinned, busy_ms),
    value=f"the slowest call took {pinlab.fmt_ms(slowest_pinned)} "
    f"behind {busy_ms:g} ms of GPU work",
    why=stalls.WHY.pinned_enqueued,
)
big = by_size[64 * MiB]
big_both = stalls.waited(big["copy_pageable_ms"], busy_ms) and stalls.waited(
    big["to_pageable_ms"], busy_ms
)
big_waited = pinlab.observe(
    "a 64 MiB pageable copy_ and .to waited for the GPU",
    big_both,
    why=stalls.WHY.stage_size,
    value=", ".join(
        pinlab.fmt_ms(big[k]) for k in ("copy_pageable_ms", "to_pageable_ms")
    ),
)
small_ms = by_size[256]["copy_pageable_ms"]
small_returned = pinlab.observe(
    "a 256 B pageable copy_ returned at once",
    not stalls.waited(small_ms, busy_ms),
    value=pinlab.fmt_ms(small_ms),
    why=stalls.WHY.stage_small,
)

# %% [markdown]
# Read the plot from the left: the copies that returned, pageable and pinned, each cost the host
# something: the driver's `memcpy` into staging, growing with the bytes, or a cost per call? The
# lines below compare the smallest sizes with the largest pageable copy that still returned. Where
# the pageable lines jump to the busy time, a `non_blocking=True` pageable copy has become a
# blocking one.

# %%
tiny = [r for r in rows if r["bytes"] <= 32 * KiB]
pag_tiny = [r["copy_pageable_ms"] for r in tiny]
pin_tiny = [r["copy_pinned_ms"] for r in tiny]
span = f"{fmt_bytes(tiny[0]['bytes'])} to {fmt_bytes(tiny[-1]['bytes'])}"
pinlab.show(
    f"host cost of one copy_, {span}: pageable / pinned",
    f"{pinlab.fmt_ms(min(pag_tiny))}-{pinlab.fmt_ms(max(pag_tiny))} "
    f"/ {pinlab.fmt_ms(min(pin_tiny))}-{pinlab.fmt_ms(max(pin_tiny))}",
)
flat = max(pag_tiny) <= 2 * min(pag_tiny)
pinned_alike = statistics.median(pin_tiny) >= statistics.median(pag_tiny) / 2
words = (
    f"from {span} a pageable copy's host cost stayed within 2x whatever its size: a "
    "cost per call" + (", which pinned copies paid too" if pinned_alike else "")
    if flat
    else f"from {span} the host cost of a pageable copy varied more than 2x"
)
if quick and max(quick) > tiny[-1]["bytes"]:
    top_quick = by_size[max(quick)]["copy_pageable_ms"]
    pinlab.report(
        "host cost of the largest pageable copy_ "
        f"that returned ({fmt_bytes(max(quick))})",
        top_quick,
    )
    growth = top_quick / statistics.median(pag_tiny)
    words += (
        f"; at {fmt_bytes(max(quick))}, the largest that "
        f"returned, it cost {growth:.1f}x as much: the driver's "
        "memcpy into staging, which grows with the bytes"
        if growth > 2
        else f"; at {fmt_bytes(max(quick))}, the largest "
        "that returned, it cost about as much"
    )
parts = words.split("; ")  # one line per clause, to keep each line short
for i, part in enumerate(parts, 1):
    pinlab.show(f"what this run shows ({i}/{len(parts)})", part)

# %% [markdown]
# Note the function's first line, `torch.cuda.synchronize()`: each copy in this sweep was issued
# **alone**, with nothing pending and the staging buffer empty. Where large ones waited anyway (see
# above), the first limit is **per copy**: above some size this driver does not stage a pageable
# copy behind the queue, whatever room it has. Section 2 finds a second limit, on the bytes of many
# small copies pending at once. Both are the driver's undocumented choice.
#
# **The benchmark.** An honest `non_blocking` copy should cost the host next to nothing, whatever
# the GPU does. A step loop issues copies back to back, so we time bursts of 8 MiB pinned copies
# behind a busy GPU: host time per call, median over 30 bursts. For contrast: the same call alone
# right after a sync (the function above), and the pageable copy of that size.

# %%
bench = sweep["bench"]
size = fmt_bytes(bench["bytes"])
loop_ms, pageable_ms = (
    bench["copy_pinned_in_loop"]["median"],
    bench["copy_pageable"]["median"],
)
pinlab.report(
    f"pinned copy_ of {size} behind a busy GPU, per call in a loop (median)", loop_ms
)
pinlab.report(
    f"pinned copy_ of {size}, a single call right after a sync (median)",
    bench["copy_pinned"]["median"],
)
pinlab.report(
    f"pinned .to of {size}, a single call right after a sync (median)",
    bench["to_pinned"]["median"],
)
pinlab.report(f"pageable copy_ of {size} behind a busy GPU (median)", pageable_ms)
single_ms = bench["copy_pinned"]["median"]
pinlab.show(
    f"pinned copy_ of {size}: a single call after a sync / a call in a loop",
    f"{single_ms / loop_ms:.2f}x",
)
pinned_cheap = pinlab.observe(
    f"behind a busy GPU, a pinned copy_ of {size} cost "
    "the host at least 100 times less than a pageable one",
    pageable_ms >= 100 * loop_ms,
    value=f"{pageable_ms / loop_ms:.0f}x",
    why=stalls.WHY.staged_costs,
)

# %% [markdown]
# The two pinned copy_ lines (the same call, issued two ways) need not cost the same (the ratio line
# compares them here): time copies the way your code issues them. Set either against the pageable
# copy's host cost, the last line.

# %% [markdown]
# ## 2. The staging pool: many small copies
#
# Small pageable copies return at once where the driver stages them (section 1). But staging space
# is finite, and staged data leaves it only when the GPU performs the copy, after everything queued
# before it.
#
# 🔮 **Predict.** Behind a kernel running for 50 ms, you issue 64 KiB pageable copies, one after
# another. Do they all return at once? If not, after how many?
#
# <details><summary>Answer</summary>
#
# On a CUDA GPU over PCIe (what this course was recorded on): the first few dozen return in
# microseconds; then one copy waits for the whole kernel: the staging pool is full. The *bytes*
# pending then are the pool's size.
# </details>
#
# The experiment queues 16 MiB of copies, in 16 KiB and in 64 KiB pieces, behind a 50 ms kernel,
# times each copy (3 trials each), and checks that every byte arrived.

# %%
pool = pinlab.measure(
    "02_staging_pool",
    stalls.staging_pool,
    chunks=[16 * KiB, 64 * KiB],
    total_bytes=16 * MiB,
    busy_ms=50.0,
    trials=3,
)
limit = pool["busy_ms"] / 2

# %%
fig, ax = plt.subplots(figsize=(7, 4))
for run in pool["runs"]:
    host_ms = run["trials"][0]["host_ms"]
    ax.plot(
        range(1, len(host_ms) + 1),
        stalls.cumulative(host_ms),
        label=f"{fmt_bytes(run['chunk'])} copies",
    )
ax.axhline(pool["busy_ms"], ls="--", c="grey", lw=1, label="GPU busy time")
ax.set(
    xscale="log",
    yscale="log",
    xlabel="copies queued",
    ylabel="host ms, cumulative",
    title=f"Small pageable copies queued behind a busy GPU ({pool.tag})",
)
ax.grid(True, which="both", alpha=0.3)
ax.legend()
plt.show()
blocked_at = [
    a
    for run in pool["runs"]
    for t in run["trials"]
    if (a := stalls.pending_bytes_at_block(t["host_ms"], run["chunk"], limit))
    is not None
]
pinlab.show(
    "takeaway",
    f"the host first blocked once {fmt_bytes(statistics.median(blocked_at))} "
    "of copies were queued (median of all trials)"
    if blocked_at
    else "the host never blocked: the driver staged every copy",
)

# %%
pending = {
    run["chunk"]: [
        stalls.pending_bytes_at_block(t["host_ms"], run["chunk"], limit)
        for t in run["trials"]
    ]
    for run in pool["runs"]
}
for chunk, at in pending.items():
    pinlab.show(
        f"{fmt_bytes(chunk)} copies: bytes queued at the first block, per trial",
        ", ".join(fmt_bytes(a) if a is not None else "never" for a in at),
    )
    pinlab.show(
        f"{fmt_bytes(chunk)} copies: copies queued at the first block, per trial",
        ", ".join(str(a // chunk) if a is not None else "never" for a in at),
    )

# %%
every = [a for at in pending.values() for a in at]
intact = all(t["data_ok"] for run in pool["runs"] for t in run["trials"])
pinlab.claim("every queued copy arrived intact", intact, why=stalls.WHY.staged_intact)
pool_seen = pinlab.observe(
    "in every trial, the host blocked after at least 1 MiB had been queued",
    all(a is not None and a >= MiB for a in every),
    why=stalls.WHY.pool_size,
    value=", ".join(fmt_bytes(a) if a is not None else "never" for a in every),
)
counts = {
    chunk: [a // chunk for a in at if a is not None] for chunk, at in pending.items()
}
if all(counts.values()) and len(counts) == 2:
    (c1, n1), (c2, n2) = ((c, statistics.median(n)) for c, n in sorted(counts.items()))
    pinlab.show(
        "what this run shows",
        f"the {fmt_bytes(c1)} copies got {n1 / n2:.1f}x as many copies "
        f"queued as the {fmt_bytes(c2)} ones before the host blocked",
    )
    pinlab.show(
        "how to read it",
        f"{c2 // c1}x would mean a pool counted in bytes, 1x one counted in copies",
    )

# %% [markdown]
# On a CUDA GPU over PCIe each curve rises slowly, then jumps by about the busy time: that copy
# waited until the GPU had worked through the kernel and started draining the pool. Counted in
# copies, both curves would jump at the same copy; in bytes, the 16 KiB copies would get four times
# as far: the last two lines compare them for this run. Nothing was lost: only the host's time went.
#
# **Two limits, then**, from this run's two experiments:

# %%
pending_median = (
    statistics.median(a for a in every if a is not None)
    if any(a is not None for a in every)
    else None
)
pinlab.show(
    "limit 1, per copy: the largest lone pageable copy that returned at once",
    fmt_bytes(max(quick)) if quick else "none",
)
pinlab.show(
    "limit 2, pending bytes: small copies queued "
    "before the host blocked (median of trials)",
    fmt_bytes(pending_median) if pending_median is not None else "never",
)

# %% [markdown]
# A single copy above the first limit waits even into an empty pool; many small copies, each far
# below it, wait once the bytes pending reach the second. Neither is documented: the sizes above are
# what this driver did on this machine, and another driver version, GPU or operating system may draw
# both lines elsewhere. So pin what you copy `non_blocking`.
#
# ## 3. Device to host: `non_blocking` the other way
#
# 🔮 **Predict.** `host_buf.copy_(gpu_t, non_blocking=True)` while the GPU is busy. If `host_buf` is
# pageable, does the host wait? If it is pinned, and you read `host_buf` right after the call, what
# do you read?
#
# <details><summary>Answer</summary>
#
# Into pageable memory the call waits until the copy is done: blocking, but correct. The CUDA
# Runtime API's "API synchronization behavior" page said so up to CUDA 11.0 ("the function will
# return only once the copy has completed"); from CUDA 12.2 on it says only "might be synchronous"
# (`docs/facts.md` F7): drivers do it, the current page does not promise it, and the claims below
# check it. Into pinned memory the call returns at once and the copy happens later: read right away,
# the buffer holds its **old** contents.
# </details>
#
# One trial: fill the host buffer with -1, make the GPU busy, let a GPU kernel write a new value,
# copy it back with `non_blocking=True`, read the buffer at once, and again after waiting for *that
# copy* (an event recorded right after it, on the same stream).


# %%
def copy_back(host_buf, gpu_t, value, busy_ms):
    """Host ms inside host_buf.copy_(gpu_t, non_blocking=True),
    and host_buf read before / after waiting."""
    host_buf.fill_(-1.0)
    torch.cuda.synchronize()
    pinlab.gpu_busy(busy_ms)
    gpu_t.fill_(value)  # runs on the GPU, after the busy kernel
    t0 = time.perf_counter()
    host_buf.copy_(gpu_t, non_blocking=True)
    host_ms = (time.perf_counter() - t0) * 1e3
    before = host_buf.clone()  # what a reader who does not wait sees
    done = torch.cuda.Event()
    done.record()  # after the copy, on the same stream
    done.synchronize()  # the fix: wait for that copy, and nothing later
    return host_ms, before, host_buf.clone()


# %% [markdown]
# `stalls.d2h_visibility` runs it 5 times into a pageable and into a pinned buffer of 64 KiB behind
# a 20 ms kernel, a new value each time, and gives `gpu_t.to("cpu", non_blocking=True)` the same
# trial.

# %%
d2h = pinlab.measure(
    "02_d2h",
    partial(stalls.d2h_visibility, copy_back),
    nbytes=64 * KiB,
    busy_ms=20.0,
    trials=5,
)
into_pageable, into_pinned, to_cpu = (
    {r["variant"]: r for r in d2h["variants"]}[v] for v in stalls.D2H_VARIANTS
)
for r in d2h["variants"]:
    pinlab.report(
        f"{r['variant']}: host time inside the call (median)",
        statistics.median(r["host_ms"]),
    )

# %%
pageable_waited = all(
    stalls.waited(t, d2h["busy_ms"]) for t in into_pageable["host_ms"]
)
pinned_returned = not any(
    stalls.waited(t, d2h["busy_ms"]) for t in into_pinned["host_ms"]
)
pinlab.claim(
    "copy_ into pageable memory waited for the GPU every time",
    pageable_waited,
    why=stalls.WHY.d2h_pageable,
)
pinlab.claim(
    "... and its data was right without a sync",
    all(into_pageable["valid_before_sync"]),
    why=stalls.WHY.done,
)
pinlab.claim(
    "copy_ into pinned memory returned at once every time",
    pinned_returned,
    why=stalls.WHY.d2h_pinned,
    value=", ".join(pinlab.fmt_ms(t) for t in into_pinned["host_ms"]),
)
pinlab.claim(
    "... and read before synchronizing, its data was wrong every time",
    not any(into_pinned["valid_before_sync"]),
    why=stalls.WHY.d2h_stale,
)

# %% [markdown]
# The first four values of the pinned buffer, read right after the call and after waiting for the
# copy:

# %%
print("read right after the call:    ", into_pinned["head_before"])
print("expected:                     ", into_pinned["expected_head"])
print("read after done.synchronize():", into_pinned["head_after"])
pinlab.claim(
    "correct after synchronizing, every time",
    all(into_pinned["valid_after_sync"]),
    why=stalls.WHY.event,
)

# %% [markdown]
# The fix is the end of `copy_back`: record an event right after the copy and `synchronize()` it
# before you read; in between, the host is free to work while the copy runs.
# `torch.cuda.synchronize()` works too, but waits for everything on the GPU. `gpu_t.to("cpu",
# non_blocking=True)` allocates its result in pinned memory: same rule.

# %%
to_cpu_quick = not any(stalls.waited(t, d2h["busy_ms"]) for t in to_cpu["host_ms"])
stale_first = not any(to_cpu["valid_before_sync"]) and all(to_cpu["valid_after_sync"])
pinlab.claim(
    ".to('cpu', non_blocking=True) returned at once every time",
    to_cpu_quick,
    why=stalls.WHY.to_cpu,
)
pinlab.claim("... its result is pinned", to_cpu["result_pinned"], why=stalls.WHY.to_cpu)
pinlab.claim(
    "... wrong before synchronizing, right after torch.cuda.synchronize()",
    stale_first,
    why=stalls.WHY.to_cpu,
)

# %% [markdown]
# ## 4. Other hidden syncs
#
# Some calls block the host behind a busy GPU though nothing in them says "sync". Each is timed
# behind a 20 ms kernel and with the GPU idle; it **blocked** when the difference is over half the
# busy time (so host work it does anyway does not count). `x` is a pinned float32 tensor of 8 MiB;
# the strided source is every other column of a pinned tensor twice as wide (also 8 MiB).
#
# One rule, in torch's CUDA `copy_` (`aten/src/ATen/native/cuda/Copy.cu`), decides the copies among
# them (`copy_requires_temporaries`: `docs/facts.md` F5). Between host and GPU, PyTorch hands the
# driver the source's memory as one block, where it lies, when the source has the destination's
# dtype and is **dense in the destination's layout**: its elements fill their memory with no holes,
# in the destination's order of the dimensions (`x.t()` is dense, read in another order than `x`;
# `x[:, ::2]` has holes). Otherwise a `non_blocking` copy still sends a **contiguous** source as it
# lies, into a GPU temporary, and converts or reorders it there; any other source is first gathered
# into a contiguous temporary on the CPU, in ordinary pageable memory, and that is copied.
#
# 🔮 **Predict** for each: blocks or not? `torch.tensor(python_list, device="cuda")`; a copy from
# `x[:, ::2]`; from `x.t()` into a GPU tensor laid out like it, and into a contiguous one; a
# float32-to-bfloat16 copy; `.item()`.
#
# <details><summary>Answer</summary>
#
# `torch.tensor(list, device="cuda")` builds the tensor on the CPU, then makes a blocking copy.
# `x[:, ::2]` is neither dense nor contiguous: gathered into a pageable temporary **on the CPU**, it
# is a pageable copy again, however pinned the source. `x.t()` goes straight from pinned memory into
# `torch.empty_like(x.t(), device="cuda")`, which keeps its layout; into a contiguous tensor it is
# neither dense in that layout nor contiguous, so it is gathered too. The rule is *dense in the
# destination's layout*, not *contiguous*. Whether a gathered 8 MiB temporary's copy waits is
# section 1's undocumented staging decision (a fake `non_blocking` when it does): see the
# `[measured]` line after the claims. A dtype-converting copy from a contiguous pinned tensor
# converts on the GPU: asynchronous once its conversion kernel is loaded; the *first* launch of any
# kernel blocks while CUDA loads it (lazy module loading). `.item()` must wait for the value: it
# always blocks.
# </details>

# %%
hs = pinlab.measure(
    "02_hidden_syncs",
    stalls.hidden_syncs,
    busy_ms=20.0,
    repeat=3,
    list_len=4096,
    view_bytes=8 * MiB,
)
row = {r["key"]: r for r in hs["rows"]}

# %% tags=["nbval-ignore-output"]
ms = pinlab.fmt_ms
# two lines per operation, whose name is long
for r in hs["rows"]:
    print(
        f"{r['op']}\n    host blocked: {r['blocked']!s:5}   host, GPU busy: "
        f"{ms(r['host_ms']):>9}   host, GPU idle: {ms(r['idle_ms']):>9}"
    )

# %%
blocked = {key: r["blocked"] for key, r in row.items()}
pinlab.claim(
    "torch.tensor(list, device='cuda') blocked",
    blocked["tensor_list"],
    why=stalls.WHY.hidden,
)
pinlab.claim(
    "copy_ from the dense view x.t() into a "
    "GPU tensor of the same layout did not block",
    not blocked["permuted_same_layout"],
    why=stalls.WHY.hidden,
)
pinlab.claim(
    "copy_ from a contiguous pinned tensor did not block",
    not blocked["contig_pinned"],
    why=stalls.WHY.hidden,
)
pinlab.claim(
    "a warm dtype-converting copy_ from pinned memory did not block",
    not blocked["dtype_warm"],
    why=stalls.WHY.hidden,
)
pinlab.claim(".item() blocked", blocked["item"], why=stalls.WHY.hidden)
pinlab.claim(
    "a second launch of the same kernel did not block",
    not blocked["kernel_warm"],
    why=stalls.WHY.hidden,
)
nondense, to_contig = row["nondense_pinned"], row["permuted_to_contiguous"]
gathered_ms = (
    f"{pinlab.fmt_ms(nondense['host_ms'])}, "
    f"{pinlab.fmt_ms(to_contig['host_ms'])} behind {hs['busy_ms']:g} ms"
)
gathered_waited = pinlab.observe(
    "the copies gathered through a pageable temporary (from "
    "x[:, ::2], and x.t() into a contiguous tensor) waited",
    nondense["blocked"] and to_contig["blocked"],
    value=gathered_ms,
    why=stalls.WHY.gathered,
)

# %% [markdown]
# The two *first* calls depend on how CUDA loads kernels (the environment variable
# `CUDA_MODULE_LOADING`). With `LAZY` a kernel's code loads on its first launch, which waits for the
# busy GPU; with `EAGER` everything loads at start-up (slower start, no surprise later). Unset, CUDA
# defaults to lazy loading: on Linux since CUDA 12.2, everywhere since 12.3 (CUDA programming guide,
# "Lazy Loading"). Older PyTorch releases set `LAZY` themselves when initialising CUDA, with C's
# `setenv`; newer ones leave it alone, since the driver loads lazily by default. Python's
# `os.environ`, a copy of the environment taken at interpreter start, misses a later `setenv`, so we
# read the variable in both Python's copy and the process environment CUDA reads. "(unset)" in both
# does not mean eager loading: the next two lines show what the first launches did.

# %%
pinlab.show(
    "CUDA_MODULE_LOADING in os.environ (Python's copy)",
    hs["module_loading_environ"] or "(unset)",
)
pinlab.show(
    "CUDA_MODULE_LOADING in the process environment (what CUDA reads)",
    hs["module_loading_effective"] or "(unset)",
)
for key in ("dtype_cold", "kernel_cold"):
    r = row[key]
    pinlab.show(
        r["op"],
        f"{'blocked' if r['blocked'] else 'did not block'} "
        f"({pinlab.fmt_ms(r['host_ms'])})",
    )

# %% [markdown]
# For measurements: launch every kernel once before you time anything, or the first measurement
# lies. For serving: warm up (vLLM runs dummy batches before it serves).
# %% [markdown]
# ## 5. The same copies without a GPU: `pinlab.stream()`
#
# The experiments above need a GPU (without one they replay the recorded run), but the *order* of
# host and GPU work shows on any machine. `pinlab.stream()` gives the CUDA stream where there is a
# GPU, otherwise an **emulated lagging stream** (`pinlab.LaggingStream`) that runs the same torch
# code on the CPU as if the GPU were far behind the host. Queued copies and kernels run only when
# the host waits for them; a copy from pinned memory reads its source when it runs; a pageable copy
# is staged at the call, unless it is larger than a per-copy limit (`pinlab.streams.STAGING_LIMIT`,
# standing in for section 1's): then it first waits for the queue; a copy into pageable host memory
# waits, one into pinned memory is only queued. The emulation is exact about order, silent about
# time: its results say "emulated" wherever shown.
#
# Inside `with pinlab.stream() as s:` create host tensors without `device=`, device tensors with
# `device=s.device`; `s.busy(ms)` queues `ms` of GPU work, `s.Event()` makes an event
# (`torch.cuda.Event` on a GPU), `s.synchronize()` waits for everything queued. Section 3's copy
# back, on that stream:


# %%
def read_back(s, value, busy_ms=20.0):
    """The first element of a pinned and of a pageable host buffer, each filled from the
    GPU with non_blocking=True: read right after the call, and (pinned) after waiting
    for an event."""
    gpu_t = torch.zeros(16 * 1024, device=s.device)
    gpu_t.fill_(0.0)  # a first launch can block (section 4): not in the test
    into_pinned = torch.zeros(16 * 1024, pin_memory=True)
    into_pageable = torch.zeros(16 * 1024)
    into_pinned.fill_(-1.0)
    into_pageable.fill_(-1.0)
    s.busy(busy_ms)  # the GPU is far behind the host
    gpu_t.fill_(value)  # queued behind the busy kernel
    into_pinned.copy_(gpu_t, non_blocking=True)  # into pinned memory: only queued
    pinned_now = into_pinned[0].item()  # read at once
    done = s.Event()
    done.record()  # after the copy, on the same stream
    done.synchronize()  # wait for that copy
    pinned_after = into_pinned[0].item()
    s.busy(busy_ms)
    gpu_t.fill_(value + 1)
    # into pageable memory: returns once it is done
    into_pageable.copy_(gpu_t, non_blocking=True)
    return pinned_now, pinned_after, into_pageable[0].item()


# %% [markdown]
# 🔮 **Predict.** Which of the three values read in `read_back(s, 7.0)` is the old `-1`?
#
# <details><summary>Answer</summary>
#
# Only the first: the copy into pinned memory was queued behind the busy kernel, so the host read
# the buffer before it ran. After `done.synchronize()`: 7. The copy into pageable memory returned
# only once it had run: 8, without an event (section 3). Same three values on the emulated stream
# and on a GPU.
# </details>

# %%
with pinlab.stream() as s:
    pinlab.show("stream", s.label)
    pinned_now, pinned_after, pageable_now = read_back(s, 7.0)
print("pinned buffer, read right after the call:", pinned_now)
print("pinned buffer, read after done.synchronize():", pinned_after)
print("pageable buffer, read right after the call:", pageable_now)
pinlab.claim(
    "read before its event, the pinned buffer still held the old value",
    pinned_now == -1.0,
    why=stalls.WHY.read_back,
)
pinlab.claim(
    "after the event, it held the new one",
    pinned_after == 7.0,
    why=stalls.WHY.read_back,
)
pinlab.claim(
    "the copy into pageable memory was complete when the call returned",
    pageable_now == 8.0,
    why=stalls.WHY.read_back,
)

# %% [markdown]
# This lesson's exercise runs its third part this way: on the CUDA stream with a GPU, otherwise on
# the emulated stream, which records every time the host waits for queued GPU work.

# %% [markdown]
# ## 6. The tutorial's advice, tested
#
# PyTorch's tutorial advises, in its summary, `tensor.to(device, non_blocking=True)` in general,
# pinned or not. Sections 1 to 3 of this run test it, case by case:

# %%
advice = stalls.advice_rows(sweep.result, pool.result, d2h.result)

# %% tags=["nbval-ignore-output"]
# three lines per case: the case, its outcome, the evidence
for r in advice:
    print(
        f"non_blocking=True, {r['case']}\n    outcome: "
        f" {r['outcome']}\n    evidence: {r['evidence']}"
    )

# %%
expected_outcomes = [
    stalls.ADVICE_HOLDS,
    stalls.ADVICE_HOLDS,
    stalls.ADVICE_WAITS,
    stalls.ADVICE_WAITS,
    stalls.ADVICE_WAITS,
    stalls.ADVICE_STALE,
]
# pinned H2D, D2H into pinned (documented); D2H
# into pageable (documented up to CUDA 11.0)
documented = (0, 4, 5)
for i in documented:
    r, want = advice[i], expected_outcomes[i]
    pinlab.claim(
        f"{r['case']}: {want}", r["outcome"] == want, why=stalls.WHY.advice_documented
    )
for i, (r, want) in enumerate(zip(advice, expected_outcomes)):
    if i not in documented:
        pinlab.observe(
            f"{r['case']}: {want}",
            r["outcome"] == want,
            value=r["evidence"],
            why=stalls.WHY.advice_staging,
        )

# %% [markdown]
# Where the advice holds: a copy from pinned memory is queued at any size (documented); a small
# pageable copy returns at once where the driver stages it (CUDA's drivers do, up to undocumented
# limits; ROCm, not measured here, differs). The copy runs in stream order, before anything queued
# after it, so the device data is right, on one condition the flag adds: the host must not write a
# pinned source until the copy has run (lesson 03 is that race; a pageable source is copied into
# staging at the call). Where it fails: a large pageable copy the driver does not stage, and small
# ones once the pool's pending bytes are full, wait for the GPU; a copy into pageable host memory
# was synchronous whatever the flag said, in every run (documented up to CUDA 11.0; "might be" from
# 12.2). Where it is a trap: a copy into pinned memory (which `.to("cpu", non_blocking=True)`
# allocates for you) returns before the data is there (section 3; the tutorial warns of this too).
# Lesson 02b adds: even pinned, a `non_blocking` copy on the compute's stream never runs beside the
# compute.
#
# So for host-to-device copies the flag is a request, not a promise (the two experiments below time
# the same copies with and without it): pin what you copy on a hot path, and leave the pinned source
# alone until the copy has run; read device-to-host results only after an event; put copies on their
# own stream to hide them behind the compute (lesson 02b).

# %% [markdown]
# ### The tutorial's three sources, one large copy each (this lesson's variant)
#
# The tutorial (`intermediate_source/pinmem_nonblock.py` in `pytorch/tutorials`: `docs/facts.md`
# F20) compares three sources, each copied blocking and `non_blocking`: a **pageable** tensor; a
# tensor **pinned** once and reused; and `pin_memory()` **then** copy, pinning a fresh copy every
# time. Its own experiment (next section) copies 1,000 small tensors and synchronizes once. The
# course's variant: **one** 16 MiB copy from `source`, then a wait for it (as `.item()` or a loss
# read would). With a wait after every copy, `non_blocking` has nothing to overlap: this measures
# what each source costs, not what the flag buys.


# %%
def to_gpu(source, dst, pageable, pinned, non_blocking):
    """One cell of this lesson's variant: dst <- the
    data from `source` memory, then wait for it."""
    if source == "pageable":
        src = pageable
    elif source == "pinned":
        src = pinned  # pinned once, reused every time
    else:
        src = pageable.pin_memory()  # "pin_memory() then copy": pins a copy every time
    dst.copy_(src, non_blocking=non_blocking)
    torch.cuda.synchronize()


# %% [markdown]
# 🔮 **Predict.** Rank the three sources, and say what `non_blocking` changes in each.
#
# <details><summary>Answer</summary>
#
# Pinned and reused is fastest: one DMA, no staging. Pageable pays the driver's staging.
# `pin_memory()` then copy pays a host copy into pinned memory, then the DMA: the tutorial found it
# up to twice as slow as a plain pageable copy, but with a warm pinned cache (the allocator reuses a
# cached block, lesson 01) it can come out ahead; the lines below say which it did here.
# `non_blocking` changes little anywhere, by construction: each copy is followed by a wait.
# </details>

# %%
matrix = pinlab.measure(
    "02_tutorial_matrix",
    partial(stalls.tutorial_matrix, to_gpu),
    nbytes=16 * MiB,
    reps=10,
)

# %% tags=["nbval-ignore-output"]
pinlab.table(matrix.result, stalls.MATRIX_COLUMNS)

# %%
cell = stalls.matrix_ms(matrix.result)
best = {s: min(cell[(s, False)], cell[(s, True)]) for s in stalls.MATRIX_SOURCES}
pinlab.observe(
    "pinned and reused at least 2x faster than pageable",
    best["pageable"] >= 2 * best["pinned"],
    value=f"{best['pageable'] / best['pinned']:.1f}x",
    why=stalls.WHY.slow_link,
)
for i, sentence in enumerate(stalls.matrix_sentences(matrix.result), 1):
    pinlab.show(f"what this run shows ({i}/3)", sentence)

# %% [markdown]
# ### The tutorial's own experiment: 1,000 tensors of 4 KB, one sync
#
# The tutorial's experiment is different: a list of 1,000 tensors of `torch.randn(1000)` (float32,
# 4,000 bytes each), each sent with `.to("cuda:0")`, a new GPU tensor per call; blocking, every call
# waits for its copy; `non_blocking=True`, the loop queues all 1,000 and synchronizes once at the
# end. Same three sources. Its loop as one function (the tutorial's `copy_to_device`,
# `copy_to_device_nonblocking` and their `pin_copy_` twins):


# %%
def tutorial_copies(tensors, non_blocking, pin_first=False):
    """The tutorial's loop: every tensor .to("cuda") (pinned first if pin_first);
    non_blocking: one sync at the end."""
    result = []
    for t in tensors:
        src = t.pin_memory() if pin_first else t
        result.append(src.to("cuda", non_blocking=non_blocking))
    if non_blocking:
        torch.cuda.synchronize()  # the tutorial's one sync, for all 1,000 copies
    return result


# %% [markdown]
# 🔮 **Predict.** With 1,000 tensors of 4 KB and one sync, does `non_blocking` now matter? For which
# source most?
#
# <details><summary>Answer</summary>
#
# It can: blocking, the host waits 1,000 times, a round trip per 4 KB copy; `non_blocking`, it
# queues each next copy while the last runs, and waits once. Pinned copies are only queued. Pageable
# ones are staged by the driver, a host `memcpy` per call either way, and up to 1,000 × 4 KB, about
# 4 MB, can be pending before the sync: set that against section 2's "limit 2" line (this run's
# staging pool) to see whether some `non_blocking` copies may have waited anyway. The tutorial timed
# it with `torch.utils.benchmark.Timer`; this lesson times every cell in interleaved rounds (median
# of 15), each from an idle GPU.
# </details>

# %%
tut = pinlab.replay.measure_if_recorded(
    "02_tutorial_loop",
    partial(stalls.tutorial_loop, tutorial_copies),
    count=stalls.TUTORIAL_COUNT,
    numel=stalls.TUTORIAL_NUMEL,
    reps=15,
)

# %% tags=["nbval-ignore-output"]
if tut is not None:
    pinlab.table(tut["rows"], stalls.loop_columns(tut.result))

# %%
if tut is not None:
    pinlab.claim(
        "every tensor arrived intact, every source, both ways",
        tut["data_ok"],
        why=stalls.WHY.bitwise,
    )
    loop_ms = stalls.matrix_ms(tut["rows"])
    pinlab.observe(
        "pageable tensors: non_blocking with one sync was faster "
        "than a blocking copy each (the tutorial's finding)",
        loop_ms[("pageable", True)] < loop_ms[("pageable", False)],
        value=f"{loop_ms[('pageable', False)] / loop_ms[('pageable', True)]:.2f}x",
        why=stalls.WHY.tutorial,
    )
    for i, sentence in enumerate(
        stalls.tutorial_loop_sentences(tut.result, matrix.result), 1
    ):
        pinlab.show(f"what this run shows ({i}/4)", sentence)

# %% [markdown]
# Side by side: with a wait after every copy, `non_blocking` cannot change much; with many copies
# queued before one wait, it can (the last line above says how much it did in each experiment, in
# this run). What it buys in a loop with other work, and what a fake one costs: sections 1 to 3 and
# lesson 02b.
#
# ### The tutorial's checklist, answered by this course
#
# The tutorial ends with factors to check before speeding up CPU-GPU copies or comparing throughput
# across set-ups. The course measures each on your machine:
#
# | the tutorial's factor | where this course measures it |
# | --- | --- |
# | number of available cores | 01 · pinning from several threads, and the register threads of PyTorch's knobs |
# | core utilization (other work on the host) | 02b · section 1 (a host slower than a forward sets the pace); 01 · the DataLoader |
# | memory utilization (pageable and pinned) | 01 · rounding, when pinning fails, when *not* to pin; 05 · pinned weight restore |
# | CUDA device capabilities (DMA engines) | 02b · copy engines: both directions at once |
# | number of tensors | 02b · section 3, many tensors: one sync for all |
# | size of the tensors | 01 · bandwidth and small copies; 02 · section 1, the size from which a copy waits |
# | system architecture (bus speeds) | 01 · bandwidth against the copy-loop peak, the host's `memcpy`, NUMA |
# %% [markdown]
# ## Clean up

# %%
pinlab.claim(
    "pinned memory held is back to its starting level",
    pinlab.pinned_back_to(pinned_at_start),
    why=pinlab.PINNED_BACK_WHY,
)

# %% [markdown]
# ## What to remember
# - `non_blocking=True` is a request, not a promise: honoured from **pinned** memory; from
#   **pageable** memory only while the driver stages the copy (asynchronous for the host, at the
#   cost of a staging `memcpy`). Above a per-copy size, or once small copies queued behind a busy
#   GPU pass a limit on pending bytes, the host waits: the *fake* `non_blocking`. Both limits are
#   undocumented and driver-dependent (this run's are above; on ROCm, not measured here, HIP
#   documents every pageable copy as synchronous).
# - A copy into pageable host memory is synchronous. A `non_blocking` copy **into** pinned host
#   memory returns before the data is there: record an event after it and `synchronize()` the event
#   before you read.
# - Hidden syncs: `torch.tensor(list, device="cuda")`, a source neither dense in the destination's
#   layout nor contiguous (gathered into a pageable temporary, whose copy may wait), `.item()`,
#   every kernel's first launch (warm up before you measure or serve).
# - `with pinlab.stream() as s:` runs the same torch code on the CUDA stream or, without a GPU, on
#   the emulated lagging stream, exact about the order of host and GPU work.
# - The tutorial's sources: memory pinned once and reused is fastest; `pin_memory()` then copy pays
#   a host copy every time (slower or faster than pageable: see this run above). `non_blocking`
#   changes little with a wait after every copy; it can with 1,000 small copies and one sync.
#
# **Exercise:** `exercises/02_fake_non_blocking.ipynb` (solution in `solutions/`); its part 2, the
# GPU's idle share from a trace's kernel spans, needs nothing from lesson 02b.
# **Next:** 02b · overlapping copies: what a fake `non_blocking` costs a step loop, a copy stream
# beside the compute, many tensors, and two tools.
