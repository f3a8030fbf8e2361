# %% [markdown]
# # 02 · Fake `non_blocking`
#
# **What you will learn**
# - what `non_blocking=True` promises, and when a host-to-device copy keeps the promise;
# - the copy that returns or waits, as ten lines of code you can run, and the size from which a
#   single copy from pageable memory makes the host wait for the GPU;
# - the two limits of the driver's staging: one per copy, one for the bytes pending;
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
# The promise can only hold when the copy engine can read `cpu_t` where it lies, that is when
# `cpu_t` is **pinned** (lesson 01). From pageable memory the driver first copies the data into a
# pinned staging buffer of its own, and it has only so much of that. When a copy does not fit,
# the driver waits until the GPU has worked through everything queued before it and copies the
# data through staging itself, with the host waiting. The call still says `non_blocking=True`;
# the host waits anyway. That is the *fake* `non_blocking`. CUDA's documentation promises no
# more than that: for copies between device memory and pageable host memory, an asynchronous
# copy "might be synchronous" with respect to the host. When it is, the driver decides.
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
# memory: microseconds for small copies, which the driver stages at once; from some size on, the
# whole busy time and then some. Find that size below.
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
facts = {
    "a 64 MiB pageable copy_ waited for the GPU": stalls.waited(by_size[64 * MiB]["copy_pageable_ms"], busy_ms),
    "a 64 MiB pageable .to waited for the GPU": stalls.waited(by_size[64 * MiB]["to_pageable_ms"], busy_ms),
    "a 256 B pageable copy_ returned at once": not stalls.waited(by_size[256]["copy_pageable_ms"], busy_ms),
    "every pinned copy_ and .to returned at once": not any(
        stalls.waited(r[k], busy_ms) for r in rows for k in ("copy_pinned_ms", "to_pinned_ms")),
}
for text, ok in facts.items():
    print(f"{text}:", ok)
assert all(facts.values())

# %% [markdown]
# Read the plot from the left: small pageable copies return too, with a host cost that tends to grow
# with their size (the driver's `memcpy` into staging). Where the pageable lines jump to the busy time,
# a `non_blocking=True` copy from pageable memory has become a blocking copy.
#
# Note what the function does first: `torch.cuda.synchronize()`. Every copy in this sweep was
# issued **alone**, with nothing else pending and the driver's staging buffer empty, and still the
# large ones waited. So the first limit is **per copy**: above a certain size the driver does not
# stage a pageable copy behind the queue at all, whatever room it has. Section 2 finds a second
# limit, for the bytes of many small copies pending at once.
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
ok = pageable_ms >= 100 * loop_ms
print(f"behind a busy GPU, a pinned copy_ of {size} cost the host at least 100 times less than a pageable one:", ok)
assert ok

# %% [markdown]
# Compare the two pinned copy_ lines above: a single call made right after the host waited can
# cost more than a call in a loop (it is the driver's first submission after an idle spell), so
# time copies the way your code issues them. Either way it is a small fraction of what a pageable
# copy of the same size costs the host (the line above checks a factor of 100).

# %% [markdown]
# ## 2. The staging pool: many small copies
#
# Small pageable copies return at once because the driver stages them. But staging space is
# finite, and staged data leaves it only when the GPU performs the copy, after everything queued
# before it.
#
# 🔮 **Predict.** Behind a kernel that runs for 50 ms, you issue 64 KiB pageable copies, one after
# another. Do they all return at once? If not, after how many?
#
# <details><summary>Answer</summary>
#
# The first few dozen return in microseconds; then one copy waits for the whole kernel, because
# the staging pool is full. The number of *bytes* pending at that moment is the pool's size.
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
print("in every trial, the host blocked after at least 1 MiB had been queued:",
      all(a is not None and a >= MiB for a in every))
print("every queued copy arrived intact:", all(t["data_ok"] for run in pool["runs"] for t in run["trials"]))
assert all(a is not None and a >= MiB for a in every)
assert all(t["data_ok"] for run in pool["runs"] for t in run["trials"])

# %% [markdown]
# Each curve rises slowly, then jumps by about the busy time: that copy waited until the GPU had
# worked through the kernel and started draining the staging pool. Is the pool counted in bytes
# or in copies? If in copies, both curves would jump at the same copy; if in bytes, the 16 KiB
# copies would get four times as far. Compare the lines above. Nothing was lost, the data is
# right: only the host's time went.
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
# below it, wait once the bytes pending reach the second. Neither limit is documented: CUDA only
# says that a copy from pageable memory "might be synchronous", and the sizes above are what this
# driver did on this machine. Another driver version, another GPU or another operating system may
# draw both lines elsewhere. Write code that does not depend on them: pin what you copy
# `non_blocking`.
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
facts = {
    "copy_ into pageable memory waited for the GPU every time":
        all(stalls.waited(t, d2h["busy_ms"]) for t in into_pageable["host_ms"]),
    "  ... and its data was right without a sync": all(into_pageable["valid_before_sync"]),
    "copy_ into pinned memory returned at once every time":
        not any(stalls.waited(t, d2h["busy_ms"]) for t in into_pinned["host_ms"]),
    "  ... and read before synchronizing, its data was wrong every time": not any(into_pinned["valid_before_sync"]),
}
for text, ok in facts.items():
    print(f"{text}:", ok)
assert all(facts.values())

# %% [markdown]
# What did the host read? The first four values of the pinned buffer, right after the call and
# after waiting for the copy:

# %%
print("read right after the call:    ", into_pinned["head_before"])
print("expected:                     ", into_pinned["expected_head"])
print("read after done.synchronize():", into_pinned["head_after"])
print("correct after synchronizing, every time:", all(into_pinned["valid_after_sync"]))
assert all(into_pinned["valid_after_sync"])

# %% [markdown]
# The fix is the end of `copy_back`: record an event right after the copy and `synchronize()` the
# event before you read. Between the two the host is free to do other work while the copy runs.
# `torch.cuda.synchronize()` works too, but waits for everything on the GPU. And
# `gpu_t.to("cpu", non_blocking=True)` allocates the result in pinned memory for you: same rule.

# %%
facts = {
    ".to('cpu', non_blocking=True) returned at once every time":
        not any(stalls.waited(t, d2h["busy_ms"]) for t in to_cpu["host_ms"]),
    "  ... its result is pinned": to_cpu["result_pinned"],
    "  ... wrong before synchronizing, right after torch.cuda.synchronize()":
        not any(to_cpu["valid_before_sync"]) and all(to_cpu["valid_after_sync"]),
}
for text, ok in facts.items():
    print(f"{text}:", ok)
assert all(facts.values())

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
# in ordinary pageable memory, and copies that: fake `non_blocking` again, however pinned the
# source was. So `x[:, ::2]`, which is not dense (holes between the elements), always goes through
# a pageable temporary; `x.t()` is dense: copied into `torch.empty_like(x.t(), device="cuda")`,
# which keeps its layout, it goes straight from pinned memory; copied into a contiguous tensor, it
# is gathered first. The rule is *dense in the destination's layout*, not *contiguous*. A
# dtype-converting copy from a contiguous pinned tensor copies first and converts on the GPU:
# asynchronous once its conversion kernel is loaded; the *first* launch of any kernel blocks while
# CUDA loads it (lazy module loading). `.item()` has to wait for the value: it always blocks.
# </details>

# %%
hs = pinlab.measure("02_hidden_syncs", stalls.hidden_syncs, busy_ms=20.0, repeat=3, list_len=4096,
                    view_bytes=8 * MiB)
row = {r["key"]: r for r in hs["rows"]}

# %% tags=["nbval-ignore-output"]
pinlab.table(hs["rows"], [("op", "operation"), ("blocked", "host blocked"),
                          ("host_ms", "host, GPU busy", ms), ("idle_ms", "host, GPU idle", ms)])

# %%
facts = {
    "torch.tensor(list, device='cuda') blocked": row["tensor_list"]["blocked"],
    "copy_ from a non-dense pinned view x[:, ::2] blocked": row["nondense_pinned"]["blocked"],
    "copy_ from the dense view x.t() into a GPU tensor of the same layout did not block":
        not row["permuted_same_layout"]["blocked"],
    "copy_ from x.t() into a contiguous GPU tensor blocked": row["permuted_to_contiguous"]["blocked"],
    "copy_ from a contiguous pinned tensor did not block": not row["contig_pinned"]["blocked"],
    "a warm dtype-converting copy_ from pinned memory did not block": not row["dtype_warm"]["blocked"],
    ".item() blocked": row["item"]["blocked"],
    "a second launch of the same kernel did not block": not row["kernel_warm"]["blocked"],
}
for text, ok in facts.items():
    print(f"{text}:", ok)
assert all(facts.values())

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
# Pageable: not the sum. The 8 MiB copy is too large to be staged behind the queue, so `copy_`
# waits until the previous forward is done, then the driver feeds the data through its staging
# buffer while the host waits inside the call, and only then does the host launch the next
# forward. The host's preparation still overlapped the previous forward; what is serialized is
# the **staged copy**: about one forward plus one (slower) staged copy per step, plus the moment
# the host needs to return from `copy_` and launch the forward. The timeline shows it.
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
# What to look for. Pageable: the host enters `copy_` while the previous forward still runs and
# leaves it only after the copy has run on the GPU; the next forward starts after that, and the
# GPU computes nothing in between. The host's "prepare" still overlaps the GPU's forward.
# Pinned: `copy_` returns at once, the host waits only at the bounded run-ahead ("wait for step
# i-2"), and the forwards follow each other with only the short copy in between. The numbers,
# and two models of the pageable step:

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

# %% [markdown]
# Compare the measured step with the two models above. The mechanism says which one to expect: a
# fake `non_blocking` copy does not make the host's preparation serial with the GPU's work (in
# the timeline it overlaps the previous forward), only the copy itself, so the "added up" model
# counts host time that was hidden. The second model is the mechanism's, but not to the
# microsecond, and the measured step can land on either side of it: after the staged copy the GPU
# also waits while the host returns from `copy_` and launches the next forward (the GPU time
# between two forwards, above, is the staged copy plus that wait); the timed steps include the
# loop's start and its final sync; and the staged copy's duration comes from the six profiled
# steps, not the timed ones. With more host work per step the "added up" model drifts further
# from the truth; with several such copies per step the serialized part grows with them.
#
# **Why we do not assert the steps per second or the idle share.** Both are shown, not tested.
# What pinned inputs change per step is what sits between two forwards on the GPU (the gaps above:
# a staged copy and the launch wait, against a pinned copy): a fraction of a step, of the order of
# what a step's time moves from run to run, so a comparison could flip on a noisy run.
# And the GPU's idle share is not a law of pinned memory: it says how long the GPU waited, not
# why. A loop whose host falls behind leaves the GPU idle whatever its copies do, and six profiled
# steps are few: the profiler adds host work to every call, and one slow host step (the operating
# system, a page fault, the profiler itself) shows up as idle GPU time. A run in which the pinned
# loop is faster can still show it the larger idle share. What holds on every run is the cause,
# measured on the host, and the names the profiler gives the copies:

# %%
ratio_ok = pag["copy_host_ms"] >= 10 * pin["copy_host_ms"]
print("the host spent at least 10 times longer inside a pageable copy_ than inside a pinned one:", ratio_ok)
print("memcpy names in the pageable run:", sorted(pag["memcpy_names"]))
print("memcpy names in the pinned run:  ", sorted(pin["memcpy_names"]))
pinlab.show("memcpys recorded, pageable / pinned run",
            f"{sum(pag['memcpy_names'].values())} / {sum(pin['memcpy_names'].values())}")
assert ratio_ok
assert set(pag["memcpy_names"]) == {"Memcpy HtoD (Pageable -> Device)"}
assert set(pin["memcpy_names"]) == {"Memcpy HtoD (Pinned -> Device)"}

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
# 3. **a pinned source**: only then can the copy engine read the host memory by itself. From
#    pageable memory the driver copies through its staging buffer, and a copy too large to stage
#    makes the host wait (section 1).
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
# fails: each 16 MiB copy is too large to be staged, so the host waits inside `fetch` while the
# driver feeds the data through staging, more slowly than a pinned copy, and it cannot queue the
# next compute meanwhile. Without `record_stream`, wrong sums: inputs overwritten before they were
# read.
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
# stream, pageable: the staged copies are much longer than the pinned ones, and the compute runs
# only in the gaps between them. The host waited inside each `fetch` until its staged copy was
# done, and queued the step's compute only after that: a second stream cannot help a copy that
# holds the host. The numbers:

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

# %% [markdown]
# Steps per second and idle shares are shown, not asserted: they depend on the copy's speed and
# the compute's length, and six profiled steps are few (section 5 says why). What holds on every
# run: the results, and what runs beside what.

# %%
one, side = ovm["one_stream_pinned"], ovm["copy_stream_pinned"]
facts = {
    "every step's sum was right in all three loops": all(ovm[k]["wrong_steps"] == 0 for k in stalls.OVERLAP_MODES),
    "on one stream, no copy ran beside a kernel": one["overlap"]["overlapping"] == 0,
    "with a copy stream and pinned inputs, most copies ran beside a kernel":
        side["overlap"]["overlapping"] >= side["overlap"]["copies"] / 2,
    "the copy stream's copies from pageable inputs went through staging (Pageable -> Device)":
        set(ovm["copy_stream_pageable"]["memcpy_names"]) == {"Memcpy HtoD (Pageable -> Device)"},
}
for text, ok in facts.items():
    print(f"{text}:", ok)
assert all(facts.values())

# %% [markdown]
# And without `record_stream`? The same copy-stream loop, pinned inputs, once:

# %%
race = ov["no_record_stream"]
pinlab.show("copy stream without record_stream: steps whose sum was wrong", f"{race['wrong_steps']} of {race['steps']}")
print("without record_stream, at least one step computed on an input overwritten before it was read:",
      race["wrong_steps"] > 0)
assert race["wrong_steps"] > 0

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
# either way, and once the staging pool is full (section 2) the `non_blocking` copies wait too, so
# the single sync saves less as the tensors grow. See the table.
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
    pinlab.show(f"{case}: blocking copies / non_blocking + one sync, pinned",
                f"{r['pinned_blocking_ms'] / r['pinned_nb_sync_ms']:.1f}x")
    pinlab.show(f"{case}: blocking copies / non_blocking + one sync, pageable",
                f"{r['pageable_blocking_ms'] / r['pageable_nb_sync_ms']:.1f}x")
ok = all(r["data_ok"] for r in many["rows"])
print("every tensor arrived intact, every way:", ok)
assert ok

# %% [markdown]
# Read the ratios above (more than 1x: the single sync was cheaper). They are shown, not asserted:
# a blocking copy's wait is a round trip to an idle GPU, which varies from run to run. The
# mechanism does not vary: N blocking copies wait N times, the other way waits once, after queuing
# everything. In a training loop a `DataLoader(..., pin_memory=True)` gives you the pinned batch
# (a background thread pins it while the loop runs), and `batch.to("cuda", non_blocking=True)` per
# tensor then queues every copy without a wait.
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
for r in advice:
    print(f"{r['case']}: {r['outcome']}")
expected_outcomes = [stalls.ADVICE_HOLDS, stalls.ADVICE_HOLDS, stalls.ADVICE_WAITS, stalls.ADVICE_WAITS,
                     stalls.ADVICE_WAITS, stalls.ADVICE_STALE]
assert [r["outcome"] for r in advice] == expected_outcomes

# %% [markdown]
# Where the advice holds: a copy from pinned memory is queued at any size, and a small pageable
# copy is staged by the driver and returns at once. On the GPU the copy runs in stream order, before
# anything queued after it, so the device data is right, with one condition the flag adds: the
# host must not write a pinned source until the copy has run (lesson 03 is that race; a pageable
# source is copied into staging at the call). Where it fails: one large pageable copy waits for
# the GPU; many small ones wait once the staging pool's pending bytes are full; a copy into
# pageable host memory is synchronous whatever the flag says. And where it is a
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
print("torch.tensor(list, device='cuda') waited for the GPU:", arow["factory"]["blocked"])
print("pinlab.async_tensor_h2d(list) did not:", not arow["async"]["blocked"])
print("all three calls gave the same GPU tensor:", ah["same_values"])
assert arow["factory"]["blocked"] and not arow["async"]["blocked"] and ah["same_values"]

# %% [markdown]
# The middle one, a small pageable tensor copied `non_blocking`, fits the staging pool, so it can
# return at once (see its row); in a loop that queues more pageable copies, it waits (section 2).
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
print("one stall of each kind per step, and nothing else:", det["counts"] == expected)
lines = {kind: [line] for kind, line in stalls.source_lines(demo_step).items()}
for kind, line in sorted(lines.items(), key=lambda kv: kv[1]):
    print(f"line {line[0]} of demo_step: {kind}")
print("each stall points at its line of demo_step:", det["stall_lines"] == lines)
assert det["counts"] == expected and det["stall_lines"] == lines

# %% [markdown]
# The same three calls, one at a time, under `torch.cuda.set_sync_debug_mode("warn")` (its
# warnings caught with `warnings.catch_warnings(record=True)`) and under `detect_stalls()`:

# %%
for c in det["compare"]:
    print(f"{c['op']}\n    set_sync_debug_mode('warn') warned: {c['sync_debug_warnings'] > 0}"
          f"   detect_stalls() reported: {c['detector_events'] > 0}")
cmp = {c["key"]: c for c in det["compare"]}
assert cmp["pageable_copy"]["sync_debug_warnings"] == 0 and cmp["pageable_copy"]["detector_events"] > 0

# %% [markdown]
# Does watching cost much? The loop's host time with and without the detector (median of 5 runs
# each). The loop does real GPU work every step, as a training or serving loop does, so the
# ratio is the one you would see.

# %%
plain, watched = det["plain_ms"]["median"], det["detected_ms"]["median"]
pinlab.report(f"{det['steps']} steps, plain (median)", plain)
pinlab.report(f"{det['steps']} steps under detect_stalls() (median)", watched)
ok = watched <= 2 * plain
print("the detector at most doubled the loop's host time:", ok)
assert ok

# %% [markdown]
# ## Clean up

# %%
back = pinlab.pinned_back_to(pinned_at_start)
print("pinned memory held is back to its starting level:", back)
assert back

# %% [markdown]
# ## What to remember
# - `non_blocking=True` is a request. From **pinned** memory it is honoured; from **pageable**
#   memory only while the driver agrees to stage the copy: one copy above a size limit, or many
#   small ones queued behind a busy GPU up to a limit on pending bytes, and the host waits. Both
#   limits are undocumented and driver-dependent; this run's sizes are above.
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
