# %% [markdown]
# # 02b · Overlapping copies
#
# **What you will learn**
# - what a pageable input costs a step loop, in a `torch.profiler` trace (and Nsight Systems);
# - how a copy runs *beside* the compute on a copy stream (`wait_stream`, `torch.cuda.stream`,
#   `record_stream`), and what goes wrong without `record_stream`;
# - copy engines: H2D and D2H at once; why a second H2D stream does not double the bandwidth;
# - many tensors: `non_blocking` copies and one sync against a blocking copy each;
# - `pinlab.async_tensor_h2d` (vLLM's honest H2D copy) and `pinlab.detect_stalls`, which finds the
#   copy that `torch.cuda.set_sync_debug_mode` misses.
#
# It builds on lesson 02 (section 1: the size from which a pageable copy waits; section 2: the
# staging pool; section 4: hidden syncs). Every experiment first makes the GPU busy
# (`pinlab.gpu_busy`); a call **waited** when it took more than half the busy time.

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
import contextlib
import time
from functools import partial

import matplotlib.pyplot as plt
import torch

import pinlab
from pinlab.lessons import l02b_overlapping_copies as l02b
from pinlab.plots import fmt_bytes, timeline
from pinlab.profiler import span_stats

KiB, MiB = l02b.KiB, l02b.MiB
ms = pinlab.fmt_ms
pinlab.header("02b overlapping copies")
pinned_at_start = pinlab.pinned_baseline()

# %% [markdown]
# ## 1. What it costs a step loop: a profiler timeline
#
# A toy step, as an engine runs it: wait until step *i-2* is done (an engine bounds how far the
# host runs ahead: **run-ahead k**, lesson 03, lets the host write step n+k's data before the GPU
# has run step n's copy; this is run-ahead 1), prepare an 8 MiB input on the CPU (at least 1 ms,
# into a small ring of host buffers), copy it with `copy_(..., non_blocking=True)`, launch a
# "forward" of `gpu_ms`. `span(name)` marks each part for the profiler (or a timer).


# %%
def run_steps(
    bufs, dev, steps, *, cpu_ms, gpu_ms, in_flight, span=contextlib.nullcontext
):
    """`steps` steps of the toy loop, then a sync;
    returns the host ms spent inside each copy_."""
    # done[k]: the step that used bufs[k] finished
    done = [torch.cuda.Event() for _ in bufs]
    copy_ms = []
    for i in range(steps):
        k = i % len(bufs)
        with span("wait for step i-2"):
            if i >= in_flight:
                done[(i - in_flight) % len(bufs)].synchronize()  # bounded run-ahead
        with span("prepare inputs (CPU)"):
            t_end = time.perf_counter() + cpu_ms / 1e3
            bufs[k].fill_(i % 251)  # write this step's input
            while time.perf_counter() < t_end:  # ... and the rest of the host's work
                pass
        with span("copy_(non_blocking=True)"):
            t0 = time.perf_counter()
            dev.copy_(bufs[k], non_blocking=True)
            copy_ms.append((time.perf_counter() - t0) * 1e3)
        with span("launch forward"):
            pinlab.gpu_busy(gpu_ms)  # the forward pass: gpu_ms of GPU work
        done[k].record()
    torch.cuda.synchronize()
    return copy_ms


# %% [markdown]
# `l02b.step_loop` runs it with three pageable host buffers, then three pinned ones. If the host
# needs longer per step than the GPU (a busy machine, few cores, other learners' kernels), it sets
# the pace whatever the copies do (in an earlier run on a shared machine, writing the 8 MiB input
# took over 6 ms instead of 1). So it first times the host's own work per step (the "prepare
# inputs" and "launch forward" spans of 5 steps of each kind, `l02b.HostSpans`) and makes the
# forward `gpu_bound_factor` (2) times that, at least `gpu_ms` (`l02b.gpu_bound_forward_ms`): the
# GPU sets the pace. 40 steps of each are timed (two alternating rounds); 6 of each are recorded
# with `torch.profiler` (CPU and CUDA activity) and plotted (`pinlab.profiler`).
#
# 🔮 **Predict.** The forward lasts F, at least twice the host's work per step (both printed
# below). How long does a step take with pinned inputs? With pageable ones: host work + F + copy?
#
# <details><summary>Answer</summary>
#
# Pinned: about one forward plus one copy: the GPU runs them in turn on one stream; the host's
# work hides behind them. Pageable: not the sum. Where an 8 MiB copy is not staged behind the
# queue (lesson 02, section 1), the host waits inside `copy_` for the previous forward, then while
# the driver feeds the data through staging, and only then launches the next forward. The
# preparation still overlaps the previous, longer forward; only the **staged copy** is
# serialized: one forward plus one (slower) staged copy per step, plus the moment the host needs
# to return and launch. Pinned inputs save the difference of the two copies plus that moment: a
# fixed amount, a smaller share of a longer forward.
# </details>

# %%
# the GPU suite keeps a copy of the trace there
RECORDED_TRACE = "reports/gpu/traces/02_step_loop.json"
STEP = dict(
    steps=40,
    warm_steps=5,
    profile_steps=6,
    input_bytes=8 * MiB,
    gpu_ms=2.0,
    cpu_ms=1.0,
    in_flight=2,
    gpu_bound_factor=2.0,
)
loop = pinlab.measure(
    "02_step_loop", partial(l02b.step_loop, run_steps), **STEP, trace=l02b.DEFAULT_TRACE
)
pag, pin = loop["modes"]["pageable"], loop["modes"]["pinned"]
pinlab.report(
    "the host's own work per step before the timed steps (median)",
    loop["calibration"]["host_work_ms"],
)
pinlab.report(
    f"so the forward lasts ({STEP['gpu_bound_factor']:g}x "
    f"that, rounded up to 0.5 ms, at least {ms(STEP['gpu_ms'])})",
    loop["forward_ms"],
)
if loop.live:
    pinlab.show("this run's profiler trace", loop["trace_file"])
print("the recorded GPU run's profiler trace:", RECORDED_TRACE)
print("  (open it in https://ui.perfetto.dev)")

# %%
fig, axes = pinlab.plots.stacked(2, height=3.0, sharex=True)
for ax, mode in zip(axes, l02b.STEP_MODES):
    m = loop["modes"][mode]
    timeline({"host": m["host"], "GPU": m["gpu"]}, title=f"{mode} inputs", ax=ax)
    ax.set_ylim(1.5, -1.6)  # room for the legend above the host lane
fig.suptitle(f"Six steps from the profiler trace ({loop.tag})")
fig.tight_layout()
plt.show()
pinlab.show(
    "takeaway",
    f"host time inside copy_ per step: {ms(pag['copy_host_ms'])} "
    f"pageable, {ms(pin['copy_host_ms'])} pinned",
)

# %% [markdown]
# What to look for. Pageable, where the driver does not stage the copy behind the queue: the host
# enters `copy_` while the previous forward runs and leaves after the copy has run; the GPU computes nothing until the next forward. Pinned:
# `copy_` returns at once, the host waits only at "wait for step i-2", and only the short copy
# sits between forwards. That gap, not the host's speed, is what this section measures. Below:
# the numbers, two models of the pageable step, and this run's findings
# (`l02b.step_loop_findings`):

# %%
found = l02b.step_loop_findings(loop.result)
pinlab.report("ms per step, pinned inputs", pin["ms_per_step"])
pinlab.report("ms per step, pageable inputs", pag["ms_per_step"])
for name, model_ms in found["models"].items():
    pinlab.report(f"pageable, if {name}", model_ms)
pinlab.show(
    "one copy on the GPU (median), pageable (staged) / pinned",
    f"{ms(found['copy_ms']['pageable'])} / {ms(found['copy_ms']['pinned'])}",
)
pinlab.show(
    "GPU time between two forwards (median), pageable / pinned",
    f"{ms(found['gap_ms']['pageable'])} / {ms(found['gap_ms']['pinned'])}",
)
pinlab.show(
    "host's own work per step (median of the timed steps), pageable / pinned",
    f"{ms(pag['host_work_ms'])} / {ms(pin['host_work_ms'])}",
)
pinlab.show(
    "timed steps whose host work took longer than the forward, pageable / pinned",
    f"{pag['host_slow_steps']} / {pin['host_slow_steps']} of {pin['timed_steps']}",
)
pinlab.report("host time inside copy_ per step, pageable (median)", pag["copy_host_ms"])
pinlab.report("host time inside copy_ per step, pinned (median)", pin["copy_host_ms"])
pinlab.show(
    "steps per second, pageable vs pinned inputs",
    f"{pag['steps_per_s']:.0f} vs {pin['steps_per_s']:.0f}",
)
pinlab.show(
    "GPU idle share (no kernel running), six profiled steps, pageable vs pinned",
    f"{pag['gpu_idle_share']:.0%} vs {pin['gpu_idle_share']:.0%}",
)
faster = pinlab.observe(
    "with the GPU setting the pace, pinned steps were "
    "faster, by the GPU's shorter wait between forwards",
    found["shown"],
    value=(
        f"{ms(found['extra_ms'])} per step"
        if found["extra_ms"] >= 0
        else f"no: pinned steps took {ms(-found['extra_ms'])} longer"
    ),
    why="it needs the driver not to stage an 8 MiB pageable copy "
    "behind the queue, and a host whose work stays under "
    "the forward; the sentences below say which part failed",
)
# one line per clause, to keep each line short
for i, part in enumerate(found["sentences"], 1):
    pinlab.show(f"what this run shows ({i}/{len(found['sentences'])})", part)

# %% [markdown]
# While the GPU sets the pace, the mechanism predicts the first model, "only the staged copy
# serialized": the host's preparation overlaps the previous forward, so "added up" counts hidden
# host time. Not to the microsecond: after the staged copy the GPU also waits for the host to
# return from `copy_` and launch; the timed steps include the loop's start and final sync; the
# staged copy's duration comes from the six profiled steps. If the host got slower after the
# forward was sized (other work on its cores), neither model holds: the host sets the pace, and
# the "what this run shows" lines say so.
#
# **Why steps per second and idle share are not asserted.** Pinned inputs change only the gaps
# between forwards: a fraction of a step, about a step's run-to-run noise on a shared GPU. The
# idle share says how long the GPU waited, not why; in six profiled steps one slow host step (the
# OS, a page fault, the profiler) shows up as idle GPU time. What holds on every run: the copies'
# names in the profiler; the cause, measured on the host, is shown beside them:

# %%
print("memcpy names in the pageable run:", sorted(pag["memcpy_names"]))
print("memcpy names in the pinned run:  ", sorted(pin["memcpy_names"]))
pinlab.show(
    "memcpys recorded, pageable / pinned run",
    f"{sum(pag['memcpy_names'].values())} / {sum(pin['memcpy_names'].values())}",
)
pinlab.claims(
    {
        "the profiler named every copy of the pageable run 'Pageable -> Device'": set(
            pag["memcpy_names"]
        )
        == {"Memcpy HtoD (Pageable -> Device)"},
        "the profiler named every copy of the pinned run 'Pinned -> Device'": set(
            pin["memcpy_names"]
        )
        == {"Memcpy HtoD (Pinned -> Device)"},
    },
    why="CUPTI names a copy by the kind of host memory it reads; another "
    "profiler (ROCm's, not measured here) may name copies differently",
)
host_held = pinlab.observe(
    "the host spent at least 10 times longer inside "
    "a pageable copy_ than inside a pinned one",
    pag["copy_host_ms"] >= 10 * pin["copy_host_ms"],
    value=f"{pag['copy_host_ms'] / pin['copy_host_ms']:.0f}x",
    why="where the driver stages an 8 MiB pageable copy behind the queue "
    "(another driver) or the GPU reads pageable memory directly (GH200, not "
    "measured here, docs/facts.md F15), the pageable copy_ returns sooner",
)

# %% [markdown]
# Search a trace for `Pageable -> Device` to find the copies that may be fake `non_blocking`.
#
# ### The same timeline in Nsight Systems
#
# Save the loop as a script, pass `span=torch.cuda.nvtx.range` (a range for nsys), and run:
#
# ```
# nsys profile -t cuda,nvtx,osrt -o build/traces/02_step_loop --force-overwrite true python step_loop.py
# nsys stats -r cuda_gpu_trace build/traces/02_step_loop.nsys-rep   # one row per copy and kernel
# ```
#
# In the Nsight Systems GUI, the **CUDA HW** rows hold the copies (`Memcpy HtoD`) and kernels;
# the Python thread's **CUDA API** row holds `cudaMemcpyAsync`, long where the host waited inside
# a pageable copy, short for a pinned one; the **NVTX** row holds the spans. `nsys stats -r
# cuda_gpu_trace` gives each copy's source memory kind (`Pageable` or `Pinned`). (Older nsys
# versions call the report `gputrace`.)
#
# ## 2. Copy and compute at the same time: a copy stream
#
# In section 1's pinned timeline the GPU computes nothing while it copies. `non_blocking=True`
# freed the **host**, not the GPU: copy and forward sit on one stream, which runs in order. A copy
# runs *beside* a kernel only with:
#
# 1. **a free copy engine**: DMA engines, separate from the cores that run kernels (data-centre
#    GPUs have several), copy while the cores compute;
# 2. **another stream**: on the compute's stream, copy and compute wait for each other;
# 3. **a pinned source**: only then can the copy engine of a GPU over PCIe read host memory by
#    itself; a pageable copy the driver does not stage behind the queue makes the host wait
#    (lesson 02, section 1). (A GPU that reads host memory through the host's page tables, as on a
#    GH200, is another case, not measured here: `docs/facts.md` F15.)
#
# PyTorch's tutorial "A guide on good usage of `non_blocking` and `pin_memory()`" lists these three
# conditions in a note, with no code for the side stream (`docs/facts.md` F20). Here, each step
# copies a 16 MiB pinned input and computes on it (`compute`: `ms` busy, then a sum that exposes
# wrong data). `one_stream_steps` uses the current stream; `copy_stream_steps` copies each input
# on a **copy stream** while the step before computes.


# %%
def compute(x, out_i, ms):
    """One step's work on the GPU: `ms` of busy
    kernel, then the sum of the input x into out_i."""
    pinlab.gpu_busy(ms)
    torch.sum(x, dim=0, dtype=torch.int64, out=out_i)


def one_stream_steps(inputs, out, compute):
    """Step i copies inputs[i] to the GPU, then computes
    on it; everything on the current stream."""
    for i, x in enumerate(inputs):
        x_gpu = x.to("cuda", non_blocking=True)
        compute(x_gpu, out[i])


def copy_stream_steps(inputs, out, compute, copy_stream, record=True):
    """The same steps; each input is copied on
    copy_stream while the step before it computes."""
    compute_stream = torch.cuda.current_stream()
    copy_stream.wait_stream(compute_stream)  # copies start after the work queued so far

    def fetch(x):
        with torch.cuda.stream(copy_stream):  # queue the copy on the copy stream
            # (its memory now belongs to copy_stream)
            return x.to("cuda", non_blocking=True)

    nxt = fetch(inputs[0])
    for i in range(len(inputs)):
        x_gpu = nxt
        # step i's input has arrived (the GPU waits, not the host)
        compute_stream.wait_stream(copy_stream)
        if record:
            # used there: do not reuse its memory before that is done
            x_gpu.record_stream(compute_stream)
        if i + 1 < len(inputs):
            # the next input, copied while this step computes
            nxt = fetch(inputs[i + 1])
        compute(x_gpu, out[i])
        del x_gpu


# %% [markdown]
# Two lines order the work. `copy_stream.wait_stream(compute_stream)`: the copies wait for what
# was queued before the loop. `compute_stream.wait_stream(copy_stream)`: step *i*'s compute waits,
# on the GPU, for the copies queued so far, up to step *i*'s input. An event does the same:
# `ev.record(copy_stream)` after the copy, then `compute_stream.wait_event(ev)`.
#
# The third line is about memory. PyTorch's caching allocator ties each block to the stream it was
# allocated on (the copy stream) and hands a freed block at once to that stream's next allocation.
# After `del x_gpu`, the next `fetch`, on a stream that never waits for the compute, may write the
# next input into that block before the compute has read it. `x_gpu.record_stream(compute_stream)`
# marks the block in use on the compute stream too: it is reused only once the work queued there
# at the time of the free has finished. (Or keep `x_gpu` alive until an event recorded after its
# last use has completed.)
#
# 🔮 **Predict.** A step computes for 0.5 ms; a 16 MiB pinned copy takes a fraction of that
# (lesson 01). Which loop runs more steps per second, and how idle is the GPU's compute in each?
# What changes with pageable inputs on the copy stream? What does
# `copy_stream_steps(..., record=False)` compute?
#
# <details><summary>Answer</summary>
#
# One stream: a copy, then a compute, per step. Copy stream, pinned: while the host queues steps
# faster than the GPU runs them, copies run beside the compute and a step shrinks to about the
# compute alone, if the copy is shorter. Pageable: the third condition fails: where a 16 MiB copy
# is not staged behind the queue (lesson 02, section 1), the host waits inside `fetch` while the
# driver feeds the data through staging, slower than a pinned copy, and cannot queue the next
# compute meanwhile. Without `record_stream`, wrong sums: inputs overwritten before being read.
# </details>
#
# The emulated stream (`LaggingStream`) has no side streams, so without CUDA this section replays
# the recorded GPU run. `l02b.overlap_loop` runs the three loops in interleaved rounds (40 steps
# each, 3 rounds, every sum checked against the CPU's), then 6 steps of each under the profiler,
# and last the copy stream once without `record_stream`.

# %%
OVERLAP = dict(
    steps=40,
    rounds=3,
    input_bytes=16 * MiB,
    n_inputs=4,
    compute_ms=0.5,
    profile_steps=6,
)
ov = pinlab.measure(
    "02_overlap",
    partial(l02b.overlap_loop, one_stream_steps, copy_stream_steps, compute),
    **OVERLAP,
    trace=l02b.OVERLAP_TRACE,
)
ovm = ov["modes"]

# %%
l02b.plot_overlap(
    ovm,
    title=f"Six steps from the profiler trace: compute kernels and copies ({ov.tag})",
)
plt.show()
pinlab.show(
    "takeaway: copies beside a kernel, one stream / copy stream pinned / pageable",
    ", ".join(
        f"{ovm[k]['overlap']['overlapping']} of {ovm[k]['overlap']['copies']}"
        for k in l02b.OVERLAP_MODES
    ),
)

# %% [markdown]
# What to look for (each plot has its own time axis). One stream: compute and copies take turns.
# Copy stream, pinned: copies run under the compute, one step ahead or more, while the host stays
# ahead and no other work holds the GPU (the copy stream never waits for the compute). Copy
# stream, pageable (not staged behind the queue): the copies, fed through the driver's staging
# buffer, are longer, and the compute runs mostly in the gaps between them: the host waits inside each `fetch`, and only then queues the compute. A
# second stream cannot help a copy that holds the host. The numbers:

# %%
for key, label in l02b.OVERLAP_MODES.items():
    m = ovm[key]
    o = m["overlap"]
    pinlab.report(
        f"{label}: ms per step (median of {ov['rounds']} rounds)", m["ms_per_step"]
    )
    pinlab.show(f"{label}: steps per second", f"{m['steps_per_s']:.0f}")
    pinlab.show(
        f"{label}: GPU idle share (no kernel running), profiled steps",
        f"{m['gpu_idle_share']:.0%}",
    )
    pinlab.show(
        f"{label}: copies beside a kernel (profiled steps)",
        f"{o['overlapping']} of {o['copies']} ({o['share']:.1%} of the copy time)",
    )
    copy = span_stats(
        l02b.overlap_lanes(m["gpu"])["copies"], next(iter(m["memcpy_names"]))
    )
    pinlab.report(f"{label}: one copy on the GPU (median)", copy["duration_ms"])
one_pinned, side_pinned = ovm["one_stream_pinned"], ovm["copy_stream_pinned"]
pinlab.show(
    "steps per second, copy stream / one stream (pinned inputs)",
    f"{side_pinned['steps_per_s'] / one_pinned['steps_per_s']:.2f}x",
)
copy_ms = {
    k: span_stats(
        l02b.overlap_lanes(ovm[k]["gpu"])["copies"], next(iter(ovm[k]["memcpy_names"]))
    )["duration_ms"]
    for k in ("copy_stream_pinned", "copy_stream_pageable")
}
pinlab.show(
    "copy stream: one copy on the GPU, pageable / pinned inputs",
    f"{copy_ms['copy_stream_pageable'] / copy_ms['copy_stream_pinned']:.1f}x",
)

# %% [markdown]
# Steps per second, idle shares and the copies beside a kernel are shown or observed, not
# asserted: they depend on copy speed, compute length, the host and other GPU work, and six
# profiled steps are few. Asserted: the results, and that on one stream no copy runs beside a
# kernel.

# %%
one, side = ovm["one_stream_pinned"], ovm["copy_stream_pinned"]
pinlab.claim(
    "every step's sum was right in all three loops",
    all(ovm[k]["wrong_steps"] == 0 for k in l02b.OVERLAP_MODES),
    value=", ".join(f"{k}: {ovm[k]['wrong_steps']} wrong" for k in l02b.OVERLAP_MODES),
    why="each step's compute waits, on the GPU, for its input's "
    "copy (wait_stream), and record_stream keeps the "
    "input's memory from reuse until the compute has read it",
)
pinlab.claim(
    "on one stream, no copy ran beside a kernel",
    one["overlap"]["overlapping"] == 0,
    why="a stream runs its work in order, one operation at a time",
)
pinlab.claim(
    "the copy stream's copies from pageable inputs "
    "went through staging (Pageable -> Device)",
    set(ovm["copy_stream_pageable"]["memcpy_names"])
    == {"Memcpy HtoD (Pageable -> Device)"},
    why="CUPTI names a copy by the kind of host memory it reads; another "
    "profiler (ROCm's, not measured here) may name copies differently",
)
overlapped = pinlab.observe(
    "with a copy stream and pinned inputs, most copies ran beside a kernel",
    side["overlap"]["overlapping"] >= side["overlap"]["copies"] / 2,
    value=f"{side['overlap']['overlapping']} of {side['overlap']['copies']}",
    why="it needs a free copy engine and is read from the profiler's timestamps of six "
    "steps; a GPU shared with other processes switches between their work and yours",
)

# %% [markdown]
# And without `record_stream`? The same copy-stream loop, pinned inputs, once:

# %%
race = ov["no_record_stream"]
pinlab.show(
    "copy stream without record_stream: steps whose sum was wrong",
    f"{race['wrong_steps']} of {race['steps']}",
)
pinlab.claim(
    "without record_stream, at least one step computed "
    "on an input overwritten before it was read",
    race["wrong_steps"] > 0,
    value=f"{race['wrong_steps']} of {race['steps']} steps wrong",
    why="the race needs the host far ahead of the GPU (it queues 40 steps of "
    "0.5 ms in well under a millisecond each) and the caching allocator "
    "handing a freed input's block to the next copy; a host slower than the "
    "GPU's 0.5 ms per step would let the compute read each input in time",
)

# %% [markdown]
# The host queues many steps before the GPU has computed the first few: that lead makes the reuse
# fatal for many steps. Why some come out right is not shown: the compute may have read its block
# before the next copy overwrote it, or the input written over it had the same contents (4 inputs
# cycle). With a smaller lead the bug would corrupt only some steps, which a test of a few steps
# can miss (not measured here; lesson 03 shows how the lead decides it). The fix costs memory: with
# a host far ahead, `record_stream` keeps one input per step in flight (bounded by the engine's
# run-ahead, section 1).

# %% [markdown]
# ### Copy engines: both directions at once
#
# The GPU reports its copy engines as `asyncEngineCount`. With one, every copy takes its turn on
# it; with two or more, an H2D and a D2H copy can run at once, each over its own direction of the
# link (PCIe and NVLink carry both at once). One direction's bandwidth does *not* double: one
# large pinned copy already fills it.
#
# `l02b.copy_engines` times four cases of 256 MiB pinned copies queued by this function (medians
# of 5 interleaved rounds): H2D alone, D2H alone, H2D and D2H at once, two H2D at once (one stream
# per copy). A pair's rate counts both copies' bytes over the pair's time.


# %%
def copy_on(stream, dst, src):
    """Queue dst <- src on `stream` (pinned host memory:
    a copy engine runs it, the host goes on)."""
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)


# %% [markdown]
# 🔮 **Predict.** Against one copy alone, how many bytes per second do H2D and D2H at once move?
# And two H2D at once?
#
# <details><summary>Answer</summary>
#
# With two or more copy engines, H2D and D2H at once move well above either alone, if short of the
# sum: the directions do not share a lane. Two H2D move about what one does: one copy already
# fills that direction. With one copy engine, or a link or host that cannot serve both, the pair
# takes turns and moves about what one copy does. The lines below say which this run was.
# </details>

# %%
eng = pinlab.measure(
    "02b_copy_engines", partial(l02b.copy_engines, copy_on), nbytes=256 * MiB, reps=5
)

# %% tags=["nbval-ignore-output"]
pinlab.table(
    eng["rows"],
    [
        ("case", "256 MiB pinned copies"),
        ("gbps", "GB/s (both copies' bytes)", lambda v: f"{v:.1f}"),
    ],
)

# %%
rate = l02b.engine_rates(eng.result)
pinlab.show("copy engines (asyncEngineCount)", eng["copy_engines"])
both_up = rate["H2D and D2H at once"] / max(rate["H2D alone"], rate["D2H alone"])
two_up = rate["two H2D at once"] / rate["H2D alone"]
pinlab.observe(
    "H2D and D2H at once moved at least 1.5x either alone",
    both_up >= 1.5,
    value=f"{both_up:.2f}x",
    why="needs two copy engines and a link and host that serve "
    "both directions; other learners' copies share the link",
)
pinlab.observe(
    "two H2D at once moved under 1.25x one H2D alone",
    two_up < 1.25,
    value=f"{two_up:.2f}x",
    why="one copy fills the link in one direction on a quiet machine; a copy that does "
    "not (a slow host, a link shared with other learners) leaves room for a second",
)
for i, part in enumerate(l02b.engines_sentence(eng.result).split("; "), 1):
    pinlab.show(f"what this run shows ({i}/3)", part)

# %% [markdown]
# So copies in and out (a KV cache offloaded and restored, weights prefetched while activations go
# back) can use both directions at once, on their own streams; more streams for one direction buy
# nothing. CUDA's `deviceQuery` sample prints the number of copy engines;
# `pinlab.platform_facts()["copy_engines"]` reads it (`asyncEngineCount`) from the CUDA runtime.
#
# ## 3. Many tensors: one sync for all
#
# The tutorial's second lesson: copy N tensors with `non_blocking=True` and synchronize once,
# instead of N blocking copies that each wait. Both, for N host tensors (pinned, or pageable for
# contrast), GPU idle, as a data loader hands over a batch:


# %%
def copy_each_blocking(dsts, srcs):
    for d, s in zip(dsts, srcs):
        d.copy_(s)  # queue it, then wait until it is done


def copy_all_then_sync(dsts, srcs):
    for d, s in zip(dsts, srcs):
        d.copy_(s, non_blocking=True)  # queue them all
    torch.cuda.synchronize()  # one wait, for all of them


# %% [markdown]
# 🔮 **Predict.** 64 tensors of 4 KiB, of 64 KiB, of 1 MiB: which way costs the host less, pinned
# and pageable?
#
# <details><summary>Answer</summary>
#
# Pinned: blocking copies make host and copy engine take turns; with one sync the host queues the
# next copy while the engine runs the last, and waits once. Pageable: the host copies every tensor
# into staging either way, which one sync does not remove, and once the staging pool is full
# (lesson 02, section 2) `non_blocking` copies wait too. So expect one sync to be cheaper both
# ways. Look at the ratio and the time saved: as tensors grow, the ratio can shrink while the time
# saved grows.
# </details>
#
# `l02b.many_tensors` times both (median of 7 interleaved tries) and checks every byte arrived.

# %%
many = pinlab.measure(
    "02_many_tensors",
    partial(l02b.many_tensors, copy_each_blocking, copy_all_then_sync),
    cases=[[64, 4 * KiB], [64, 64 * KiB], [64, MiB]],
    repeat=7,
)

# %% tags=["nbval-ignore-output"]
for kind in ("pinned", "pageable"):  # one table per kind of host memory
    pinlab.table(
        many["rows"],
        [
            ("n", "tensors"),
            ("bytes", "each", fmt_bytes),
            *[
                (k, label, ms)
                for k, label in l02b.MANY_VARIANTS.items()
                if k.startswith(kind)
            ],
        ],
    )

# %%
l02b.plot_many_tensors(
    many["rows"], title=f"N host tensors to the GPU, host time ({many.tag})"
)
plt.show()
cheaper = sum(
    r[f"{k}_nb_sync_ms"] < r[f"{k}_blocking_ms"]
    for r in many["rows"]
    for k in ("pinned", "pageable")
)
pinlab.show(
    "takeaway",
    "one sync cost the host less than a blocking copy "
    f"each in {cheaper} of {2 * len(many['rows'])} cases",
)

# %%
for r in many["rows"]:
    case = f"{r['n']} x {fmt_bytes(r['bytes'])}"
    for kind in ("pinned", "pageable"):
        blocking, one_sync = r[f"{kind}_blocking_ms"], r[f"{kind}_nb_sync_ms"]
        saved = blocking - one_sync
        pinlab.show(
            f"{case}, {kind}: blocking copies / one sync",
            f"{blocking / one_sync:.1f}x, {ms(abs(saved))} "
            f"{'saved' if saved >= 0 else 'lost'} by the one sync",
        )
pinlab.claim(
    "every tensor arrived intact, every way",
    all(r["data_ok"] for r in many["rows"]),
    why="every copy is checked after a sync, byte for "
    "byte; a wrong byte would be a fault, not a timing",
)

# %% [markdown]
# Shown, not asserted: a blocking copy's wait is a round trip to an idle GPU, which varies between
# runs. The mechanism does not: N blocking copies wait N times, the other way once. In training,
# `DataLoader(..., pin_memory=True)` gives the pinned batch (lesson 01: a pin-memory thread pins it
# with `num_workers > 0`, the main thread inside `next()` with `num_workers=0`), and
# `batch.to("cuda", non_blocking=True)` per tensor queues every copy without a wait.

# %% [markdown]
# ## 4. `async_tensor_h2d`: host data to the GPU, honestly
#
# Host data often starts as a Python list (token ids, positions, a mask); `torch.tensor(list,
# device="cuda")` blocks (lesson 02, section 4). vLLM's `async_tensor_h2d` builds the tensor **on
# the CPU**, **pins** it (a fresh block nobody else writes while the copy is pending), and copies
# it **`non_blocking=True`**; so does `pinlab.async_tensor_h2d(data, dtype=None, device="cuda")`.
#
# 🔮 **Predict.** Behind a 20 ms kernel, which of these three calls, each bringing 4096 ints to the
# GPU, waits: `torch.tensor(ids, device="cuda")`, `torch.tensor(ids).to("cuda", non_blocking=True)`,
# `pinlab.async_tensor_h2d(ids)`?
#
# <details><summary>Answer</summary>
#
# The first (a blocking copy). The third never waits: it only enqueues a copy from a fresh pinned
# block. The second copies 32 KiB (int64) from pageable memory: it returns at once where the
# driver stages a copy that small (lesson 02, sections 1 and 2), and waits where it does not (on
# ROCm, not measured here, HIP documents every pageable copy as synchronous: `docs/facts.md` F17).
# </details>

# %%
ah = pinlab.measure(
    "02_async_h2d", l02b.async_h2d_cost, list_len=4096, busy_ms=20.0, repeat=10
)
arow = {r["key"]: r for r in ah["rows"]}

# %% tags=["nbval-ignore-output"]
pinlab.table(
    ah["rows"],
    [
        ("op", f"{ah['list_len']} ints to the GPU"),
        ("blocked", "host blocked"),
        ("host_ms", "host, GPU busy", ms),
        ("idle_ms", "host, GPU idle", ms),
    ],
)

# %%
pinlab.claims(
    {
        "torch.tensor(list, device='cuda') waited for the GPU": arow["factory"][
            "blocked"
        ],
        "pinlab.async_tensor_h2d(list) did not": not arow["async"]["blocked"],
        "all three calls gave the same GPU tensor": ah["same_values"],
    },
    why="torch.tensor(list, device=...) makes a blocking copy; async_tensor_h2d "
    "copies from a fresh pinned block, which is only enqueued; "
    "only a host stalled for half the busy time could change that",
)
small_staged = pinlab.observe(
    "torch.tensor(list).to('cuda', non_blocking=True) "
    "did not wait (the driver staged it)",
    not arow["pageable_nb"]["blocked"],
    value=pinlab.fmt_ms(arow["pageable_nb"]["host_ms"]),
    why="a small pageable copy is staged where the driver chooses to (undocumented); "
    "HIP documents it as synchronous (ROCm, not measured here, docs/facts.md F17)",
)

# %% [markdown]
# In a loop that queues more pageable copies, the middle one waits too (lesson 02, section 2).
# Use `async_tensor_h2d` for host data that becomes a **new** GPU tensor on a hot path. For a GPU
# buffer you refill every step, copy from a private pinned snapshot:
# `gpu_buf[:n].copy_(pinlab.pin_snapshot(host_buf[:n]), non_blocking=True)` (lesson 04). Off the
# hot path, `torch.tensor(..., device="cuda")` is fine.
#
# ## 5. Finding stalls in your own code: `pinlab.detect_stalls`
#
# `torch.cuda.set_sync_debug_mode("warn")` warns when PyTorch itself synchronizes; a fake
# `non_blocking` copy blocks inside the CUDA driver, where PyTorch never knows. vLLM added its own
# check for this (#53491). `pinlab.detect_stalls()` watches every torch call in a `with` block and
# reports pageable `non_blocking` copies, blocking copies, `.item()`-style syncs and
# `torch.tensor(..., device="cuda")`, each with your `file:line`. The loop body it watches:


# %%
def demo_step(step, weights, inputs_cpu, inputs_gpu, gpu_ms):
    inputs_gpu.copy_(inputs_cpu, non_blocking=True)  # the batch, from pageable memory
    positions = torch.tensor([step] * 64, device="cuda")  # built from a Python list
    hidden = torch.relu(inputs_gpu @ weights) + positions[0]
    pinlab.gpu_busy(gpu_ms)  # the rest of the forward
    return hidden.sum().item()  # the loss, read on the host


# %% [markdown]
# 🔮 **Predict.** 20 steps of `demo_step` under `detect_stalls()`: how many stalls, of which kinds,
# and at which lines?
#
# <details><summary>Answer</summary>
#
# Three per step, 60 in all: the pageable copy (line 2 of `demo_step`, its `def` being line 1),
# the tensor from a Python list (line 3) and the `.item()` (line 6). Lines 4 and 5 (matmul,
# `relu`, busy kernel) are only enqueued: no stall.
# </details>
#
# `l02b.detector_demo` runs the loop under the detector, times it with and without, and runs each
# stalling call alone under `set_sync_debug_mode("warn")`.

# %%
det = pinlab.measure(
    "02_detector",
    partial(l02b.detector_demo, demo_step),
    steps=20,
    gpu_ms=0.5,
    features=256,
    repeat=5,
)

# %% tags=["nbval-ignore-output"]
print(det["summary"])

# %% [markdown]
# The report names each stall's file and line; a notebook cell's file name changes between runs,
# so we count lines inside `demo_step`.

# %%
expected = {kind: det["steps"] for kind in l02b.DEMO_STALLS.values()}
for kind, n in det["counts"].items():
    print(f"{kind}: {n}")
lines = {kind: [line] for kind, line in l02b.source_lines(demo_step).items()}
for kind, line in sorted(lines.items(), key=lambda kv: kv[1]):
    print(f"line {line[0]} of demo_step: {kind}")
pinlab.claims(
    {
        "one stall of each kind per step, and nothing else": det["counts"] == expected,
        "each stall points at its line of demo_step": det["stall_lines"] == lines,
    },
    values={
        "one stall of each kind per step, and nothing else": det["counts"],
        "each stall points at its line of demo_step": det["stall_lines"],
    },
    why="the detector classifies each call by its arguments (a pageable source, a "
    "Python list, .item()), not by timing, so the counts are exact on any machine",
)

# %% [markdown]
# Each call alone, under `torch.cuda.set_sync_debug_mode("warn")` (warnings caught with
# `warnings.catch_warnings(record=True)`) and under `detect_stalls()`:

# %%
for c in det["compare"]:
    print(
        f"{c['op']}\n    set_sync_debug_mode('warn') "
        f"warned: {c['sync_debug_warnings'] > 0}   "
        f"detect_stalls() reported: {c['detector_events'] > 0}"
    )
cmp = {c["key"]: c for c in det["compare"]}
pinlab.claim(
    "set_sync_debug_mode('warn') missed the pageable "
    "non_blocking copy, detect_stalls() reported it",
    cmp["pageable_copy"]["sync_debug_warnings"] == 0
    and cmp["pageable_copy"]["detector_events"] > 0,
    value=cmp["pageable_copy"],
    why="torch's sync debug mode warns only where torch itself "
    "synchronizes; a torch release that learned to flag "
    "pageable non_blocking copies would change the first half",
)

# %% [markdown]
# The detector's cost: the loop's host time with and without it (median of 5 runs each). It adds
# work to every torch call, so a loop with more calls per millisecond of GPU work pays more.

# %%
plain, watched = det["plain_ms"]["median"], det["detected_ms"]["median"]
pinlab.report(f"{det['steps']} steps, plain (median)", plain)
pinlab.report(f"{det['steps']} steps under detect_stalls() (median)", watched)
cheap = pinlab.observe(
    "the detector at most doubled the loop's host time",
    watched <= 2 * plain,
    value=f"{watched / plain:.2f}x",
    why="the detector adds Python work to every torch call; a slow or busy host "
    "(2 cores, other learners) pays more for it against the same GPU work",
)
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
# - An unstaged pageable `non_blocking` copy (lesson 02, section 1) holds the host in `copy_`
#   until the work before it and the staged copy have run; the GPU computes nothing meanwhile. In
#   a GPU-paced loop that adds the staged copy and a launch to every step; in a host-paced one,
#   pinned inputs do not help. The profiler names it `Memcpy HtoD (Pageable -> Device)`.
# - `non_blocking` frees the host, not the GPU. A copy runs beside the compute only with a free
#   copy engine, a **copy stream** and a **pinned** source:
#   `copy_stream.wait_stream(compute_stream)`, the copy inside `with torch.cuda.stream(copy_stream):`,
#   `compute_stream.wait_stream(copy_stream)` (or an event) before the compute uses it, and
#   `x_gpu.record_stream(compute_stream)`, or the allocator reuses the memory too early.
# - With two or more copy engines (`asyncEngineCount`), H2D and D2H run at once; a second H2D
#   stream does not double the bandwidth.
# - `nsys profile -t cuda,nvtx,osrt python script.py` records the same timeline.
# - Many tensors: queue every copy `non_blocking` and synchronize once.
# - `async_tensor_h2d` (CPU build, pin, `non_blocking`) for host data on a hot path;
#   `detect_stalls()` finds what `set_sync_debug_mode("warn")` misses.
#
# **Exercise:** `exercises/02_fake_non_blocking.ipynb` covers lessons 02 and 02b (its part 2 is the
# idle share of this lesson's profiler traces).
# **Next:** 03 · the race: a reused pinned buffer and a CPU that runs ahead.
