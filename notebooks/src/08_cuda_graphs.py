# %% [markdown]
# # 08 · CUDA graphs: what a captured copy reads
#
# **What you will learn**
# - what a CUDA graph is (a stream's work captured once, replayed with one call) and why an
#   inference engine decodes under graphs: the host time per step, eager against one replay;
# - what a capture refuses: a copy from pageable memory, and anything that makes the host wait
#   for the GPU; so every host-to-device copy a graph holds reads **pinned** memory;
# - that a graph replays with the **addresses** it captured: a captured copy from a reused pinned
#   buffer reads whatever the host wrote last, the race of lesson 03 under replay (and the race
#   detector reports it);
# - the fixes that work with graphs (the PR's snapshot outside the graph, a ring of pinned
#   buffers), each proven with 0 corrupted steps, and their host cost;
# - the same race in real paged attention: FlashInfer's CUDA-graph decode wrapper, `plan()` outside
#   the graph, `run()` captured;
# - the regression test the vLLM PR lacked, as a test you can take home;
# - when graphs help less, and the memory they hold.
#
# Before this lesson: 03 (the race) and 04 (the fix).

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
import matplotlib.pyplot as plt
import torch

import pinlab
from pinlab.lessons import l08_cuda_graphs as l08

pinlab.header("08 cuda graphs")
pinned_at_start = pinlab.pinned_baseline()

# %% [markdown]
# ## Capture once, replay every step
#
# A decode step launches many small kernels: embeddings, one attention and a few matmuls per
# layer, sampling. Each launch costs the host a few microseconds in Python, torch and the driver.
# A **CUDA graph** records a stream's work once (`torch.cuda.graph(g)`: *capture*) and launches all
# of it again with one call (`g.replay()`). What a graph holds is fixed: the kernels, their
# arguments, and the **addresses** of every tensor they read and write. So a graph's inputs live in
# **static** tensors: before each replay the engine copies the step's data into them.
#
# ```python
# g = torch.cuda.CUDAGraph()
# with torch.cuda.graph(g):          # capture: nothing runs, the work is recorded
#     out.copy_(model(static_in))
# static_in.copy_(next_inputs)       # every step: fill the static input ...
# g.replay()                         # ... and launch all of it at once
# ```
#
# 🔮 **Predict.** Twenty tiny kernels per step. How much host time does one replay save against
# twenty eager launches: a quarter, a half, or most of it?
#
# <details><summary>Answer</summary>
#
# Most of it: a replay is one launch call whatever the graph holds, while eager launches cost the
# host per kernel. The measurement below shows how much on this machine.
# </details>

# %% tags=["nbval-ignore-output"]
cost = pinlab.measure(
    "08_host_cost", l08.host_cost, kernels=[1, 5, 10, 20, 40], repeat=200
)
rows = cost.result["rows"]
pinlab.table(rows, l08.HOST_COST_COLUMNS)

# %%
fig, ax = plt.subplots(figsize=(6, 3.2))
ax.plot(
    [r["kernels"] for r in rows],
    [r["eager_us"] for r in rows],
    "o-",
    label="eager launches",
)
ax.plot(
    [r["kernels"] for r in rows],
    [r["replay_us"] for r in rows],
    "s-",
    label="one g.replay()",
)
ax.set(
    xlabel="kernels per step",
    ylabel="host µs per step (median)",
    title=f"Host cost per step ({cost.tag})",
)
ax.legend()
plt.show()

# %%
at20 = next(r for r in rows if r["kernels"] == 20)
replay20, eager20 = at20["replay_us"], at20["eager_us"]
pinlab.observe(
    "at 20 kernels one replay costs the host at most a tenth of eager launches",
    replay20 <= eager20 / 10,
    value=f"{replay20:.1f} µs against {eager20:.1f} µs",
    why=l08.WHY.host_times,
)
pinlab.show(
    "what this run shows",
    f"at 20 kernels a replay cost the host {replay20:.1f} µs, eager "
    f"launches {eager20:.1f} µs ({eager20 / max(replay20, 1e-9):.0f}x)",
)

# %% [markdown]
# The eager line climbs with every kernel; the replay line stays nearly flat (a microsecond or two
# from 1 to 40 kernels). That is the whole reason an
# engine captures its decode step, and why everything the step needs must sit in static tensors.
#
# ## What a capture refuses
#
# A capture records work without running it, so it refuses what would need the work's result now.
# Run each line inside a capture and print what torch says. On a machine without CUDA the
# emulated stream (lesson 03) captures and replays graphs too, and refuses the same things with
# the same messages.


# %%
def try_in_capture(s, body):
    """Capture ``body`` into a fresh graph; return
    'captured', or the error torch raised."""
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g):
            body()
    except RuntimeError as exc:
        return str(exc).splitlines()[0]
    return "captured"


with pinlab.stream() as s:
    static = torch.zeros(4, device=s.device)
    pageable = torch.ones(4)
    pinned = torch.ones(4, pin_memory=True)
    attempts = {
        "H2D copy from pinned memory": lambda: static.copy_(pinned, non_blocking=True),
        "H2D copy from pageable memory": lambda: static.copy_(
            pageable, non_blocking=True
        ),
        "static.sum().item()": lambda: static.sum().item(),
    }
    outcome = {what: try_in_capture(s, body) for what, body in attempts.items()}
pinlab.show("stream", s.label)
for what, said in outcome.items():
    print(f"{what}: {'captured' if said == 'captured' else 'refused'}")
    if said != "captured":
        pinlab.show(f"  {what}: torch said", said)

# %%
captured = {what: said == "captured" for what, said in outcome.items()}
pinlab.claim(
    "a capture refused the copy from pageable memory",
    not captured["H2D copy from pageable memory"],
    why=l08.WHY.capture_rules,
)
pinlab.claim(
    "a capture took the copy from pinned memory",
    captured["H2D copy from pinned memory"],
    why=l08.WHY.capture_rules,
)
pinlab.claim(
    "a capture refused .item() (the host would wait for the GPU)",
    not captured["static.sum().item()"],
    why=l08.WHY.capture_rules,
)
# the experiment's own pinned tensor: what is still pinned now, the refusals left
del pinned
left_by_refusals = pinlab.pinned_baseline() - pinned_at_start
pinlab.show("pinned bytes the capture experiments left in use", left_by_refusals)
pinlab.show("what that is", l08.refusals_left_text(left_by_refusals))

# %% [markdown]
# Read `.item()`'s message with care. On a GPU, CUDA refuses the wait ("operation not permitted when
# stream is capturing"), and torch then ends the capture and reports what that ending saw: "operation
# failed due to a previous error during capture", the line a GPU run prints above; the refusal is
# that error's context. The emulated stream raises the same pair. The warning "The CUDA Graph is
# empty" that a GPU run leaves under the cell comes from the pageable copy's capture, not from
# `.item()`'s: torch refused that copy before anything was recorded, so the capture ended cleanly
# with no node in it, and `capture_end` warns when a graph has none
# (`aten/src/ATen/cuda/CUDAGraph.cpp`). The `.item()` capture had recorded the sum; CUDA invalidated
# it, and ending it raised the error above before any node count was taken (`docs/facts.md` F9).
#
# Torch refuses the pageable copy itself: `copy_kernel_cuda` in `aten/src/ATen/native/cuda/Copy.cu`
# checks, while a stream captures, that the CPU side of a copy is pinned (pytorch PR #172156). Its
# maintainers give lifetime as the reason: a captured copy stores the CPU buffer's address, and
# nothing keeps that buffer alive for the graph's replays, so a replay could silently read memory
# that was freed and reused, garbage (issue #171894; `docs/facts.md` F8). That is why graphs need
# pinned staging buffers that **outlive the graph**. `.item()` is refused because the host would
# have to wait for a value the capture has not computed. So an engine that captures its step pins
# every host buffer the step copies from and keeps it for the graph's life: the same persistent
# pinned buffers lesson 03 shows racing. Does the graph protect them?
#
# ## The race, under replay
#
# The loop of lesson 03 with one change: the copy is **inside the graph**. Each step writes its
# number into the pinned metadata buffer, keeps the GPU busy (the rest of the previous step), and
# replays. What does each replay's copy read?
#
# 🔮 **Predict.** The graph captured `static.copy_(pinned_buf, non_blocking=True)` once. The host
# rewrites `pinned_buf` every step. Which step's data does step n's replay read?
#
# <details><summary>Answer</summary>
#
# Whatever `pinned_buf` holds when the replayed copy *runs*. The graph stored the buffer's address,
# not its contents; with the GPU behind, the host has written later steps by then. It is lesson
# 03's race, and capturing the copy changed nothing about it.
# </details>


# %%
def graph_step_loop(s, steps=200, busy_ms=0.5):
    """Step n writes n into a pinned buffer; a graph
    captured the copy from it. What did step n read?"""
    pinned_buf = torch.zeros(64, dtype=torch.int32, pin_memory=True)
    static = torch.zeros(64, dtype=torch.int32, device=s.device)
    seen = torch.zeros(steps, dtype=torch.int32, device=s.device)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        # captured: this address, read at every replay
        static.copy_(pinned_buf, non_blocking=True)
    for n in range(steps):
        pinned_buf.fill_(n)  # the host writes step n's metadata
        s.busy(busy_ms)  # the GPU is behind (the rest of the last step)
        g.replay()  # enqueue the captured copy; returns at once
        seen[n : n + 1].copy_(static[:1])  # what step n's kernels read
    s.synchronize()
    return seen.tolist()


with pinlab.stream() as s:
    graph_step_loop(s, steps=5)  # warm-up: first launches load their kernels
    seen = graph_step_loop(s)
wrong = sum(v != n for n, v in enumerate(seen))
pinlab.show("stream", s.label)
pinlab.show("steps whose replay read another step's data", f"{wrong} of {len(seen)}")
pinlab.show("the step whose data steps 0-7 read", seen[:8])
pinlab.claim(
    "the captured copy from the reused pinned buffer "
    "delivered another step's data at least once",
    wrong >= 1,
    value=f"{wrong} of {len(seen)}",
    why=l08.WHY.lead,
)

# %% [markdown]
# Lesson 03's race detector follows graphs too: a graph captured while it is active has its
# captured copies' sources remembered, and each `replay()` makes them pending again. A host write
# into one before the replay's work has run is reported as a rewrite of what a pending replay reads.

# %% tags=["nbval-ignore-output"]
from pinlab.races import GRAPH_REWRITE, detect_races

with pinlab.stream() as s, detect_races() as races:
    seen = graph_step_loop(s, steps=50)
print(races)

# %%
wrong, flagged = sum(v != n for n, v in enumerate(seen)), races.count(GRAPH_REWRITE)
pinlab.show(
    "steps whose replay read another step's "
    "data / replayed copies the detector flagged",
    f"{wrong} / {flagged} of {len(seen)}",
)
pinlab.claim(
    "the detector flagged the rewrite of the captured copy's source",
    flagged >= 1,
    value=flagged,
    why=l08.WHY.detector,
)
pinlab.claim(
    "it flagged at least as many replays as read another step's data",
    flagged >= wrong,
    value=f"{flagged} flagged, {wrong} wrong",
    why=l08.WHY.detector,
)

# %% [markdown]
# The graph is not a snapshot of the data: it is a recording of *where* to read. Under async
# scheduling the host is a step or more ahead, so a captured copy from a buffer the host rewrites
# is exactly as racy as an eager one (the seed document's risk list names this case: "the
# `paged_kv_indptr` on the CPU being rewritten by later steps" under CUDA graphs).
#
# ## Every way to feed a graph, measured on the GPU
#
# `l08.every_variant` runs the same graph step loop for each way of getting step n's metadata into
# the graph's static input: six metadata tensors per step (as a decode step has: `indptr`,
# `indices`, `last_page_len`, positions, slot mapping, sequence lengths), the GPU 0.1 ms behind per
# step, 10,000 steps, counting the steps whose kernels read another step's data in any tensor:

# %%
for name, what in l08.VARIANTS.items():
    print(pinlab.timing.wrapped(f"{name}: {what}"))

# %% tags=["nbval-ignore-output"]
var = pinlab.measure(
    "08_variants",
    l08.every_variant,
    steps=10_000,
    tensors=6,
    n_ints=64,
    busy_ms=0.1,
    ring_depth=3,
)
pinlab.table(
    var.result["rows"], [("variant", "variant"), ("corrupted", "corrupted steps")]
)

# %%
by = {r["variant"]: r for r in var.result["rows"]}
steps = var.result["steps"]
FIXES = ("snapshot_outside", "ring_graphs", "ring_outside")
for v in FIXES:
    pinlab.claim(
        f"{v}: corrupted steps", by[v]["corrupted"], expect=0, why=l08.WHY.own_memory
    )
for v in l08.RACY:
    pinlab.observe(
        f"{v}: at least 99% of steps read another step's data",
        by[v]["corrupted"] >= 0.99 * steps,
        value=f"{by[v]['corrupted']} of {steps}",
        why=l08.WHY.lead_01,
    )

# %% [markdown]
# Both racy variants are races: how many steps each lost depends on how far behind the GPU was when
# its copy ran, so the counts above are this run's. The captured copy runs after the step's busy
# work (it is in the graph, replayed after `s.busy`); the copy outside the graph is enqueued before
# it, so it waits only for the earlier steps' work, and runs before the host's next write whenever
# the GPU has caught up with those. Putting the copy in a graph or leaving it outside does not
# make a reused buffer safe. The three fixes each give every step memory that nobody rewrites
# until its copy has run:
#
# - **the PR's snapshot outside the graph**: the metadata stays pageable; `pin_memory()` makes a
#   fresh pinned copy each step, and the copy into the static input is enqueued *before* the replay,
#   outside the graph. The caching host allocator hands that block out again only after the copy
#   has run (lesson 04).
# - **one graph per ring slot**: capture the copy once per pinned buffer; step n replays slot
#   n mod depth after waiting for the event of that slot's previous use.
# - **the ring outside the graph**: lesson 04's event-guarded ring, copied outside the graph.

# %% [markdown]
# What does each cost the host? Over 10,000 steps the GPU falls behind, CUDA's launch queue fills
# (lesson 03), and every loop then runs at the GPU's pace, so the loop above cannot say. `l08.staging_cost`
# times the staging alone (metadata write, copies, replay call) in short rounds of 50 steps that end
# with a sync, the variants interleaved round by round, and reports the median of the rounds' medians.
# No busy work this time: on a GPU of your own it keeps up with the host, so the rings hardly ever
# wait for their events, and each time is the host's own cost. On a GPU shared with other processes
# those events can come late, and a ring then pays the GPU's pace instead: the line below says which
# happened in your run (no data is checked here: the loop above did that).

# %% tags=["nbval-ignore-output"]
cost6 = pinlab.measure(
    "08_staging_cost",
    l08.staging_cost,
    tensors=6,
    n_ints=256,
    rounds=10,
    steps=50,
    busy_ms=0.0,
)
pinlab.table(cost6.result["rows"], l08.STAGING_COLUMNS)

# %%
hc = {r["variant"]: r["host_us"] for r in cost6.result["rows"]}
pinlab.show(
    "what this run shows",
    "host µs per step, cheapest first: "
    + ", ".join(f"{v} {hc[v]:.1f}" for v in sorted(hc, key=hc.get)),
)
rings = min(("ring_graphs", "ring_outside"), key=lambda v: hc[v])
held = pinlab.observe(
    "the cheapest ring costs at most half the per-tensor snapshots",
    hc[rings] <= hc["snapshot_outside"] / 2,
    value=f"{rings} {hc[rings]:.1f} µs against "
    f"snapshot_outside {hc['snapshot_outside']:.1f} µs",
    why=l08.WHY.ring_cost,
)

# %% [markdown]
# The snapshot's cost is a pinned allocation per tensor per step; the rings pay with memory and
# events. The fix
# code, as vLLM 0.29 has it, is two lines outside the graph:


# %%
def snapshot_step(s, meta, static, g):
    """One step of the fix: the metadata is pageable;
    snapshot it, copy the snapshot, replay."""
    # a fresh pinned block, outside the graph
    static.copy_(meta.pin_memory(), non_blocking=True)
    g.replay()  # the graph only reads the static input


# %% [markdown]
# ## Real decode under replay: FlashInfer's graph wrappers
#
# A step counter is a stand-in; lesson 03 showed the race in real attention. Under graphs, vLLM's
# FlashInfer backend builds one decode wrapper per captured batch size with `use_cuda_graph=True`
# and **fixed device buffers** for `indptr`, `indices` and `last_page_len`. `plan()` runs outside
# the graph every step: it reads the host metadata, computes the plan on the host, and copies the
# metadata into the fixed buffers with `non_blocking=True` (`_plan_impl` in FlashInfer's
# `flashinfer/decode.py`, which also stages its plan info through one pinned workspace per wrapper:
# `docs/facts.md` F19). `run()` is captured once, and every
# replay reads whatever the fixed buffers hold when it runs:
#
# ```python
# wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
#     workspace, "NHD", use_cuda_graph=True,             # fixed buffers: the graph keeps their addresses
#     paged_kv_indptr_buffer=indptr_buf, paged_kv_indices_buffer=indices_buf,
#     paged_kv_last_page_len_buffer=last_page_len_buf)
# wrapper.plan(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size)
# g = torch.cuda.CUDAGraph()
# with torch.cuda.graph(g):                              # capture run() once
#     out = wrapper.run(q, (k_cache, v_cache))
# # every step, outside the graph: the H2D copies of plan() fill the fixed buffers, then replay
# wrapper.plan(indptr_n, indices_n, last_page_len_n, num_qo_heads, num_kv_heads, head_dim, page_size)
# g.replay()
# ```
#
# `pinlab.paged_kv.FlashInferDecode(..., graph_batch=8, graph_max_pages=64)` builds that wrapper.
# `l08.flashinfer_graph_decode` runs 1,000 decode steps of 8 requests whose page count and last-page
# lengths change every step (`l08.decode_metadata`), through a ring of three wrappers, each with its
# own captured `run()`: step n uses wrapper n mod 3 after waiting for the event of that wrapper's
# previous step (so FlashInfer's own pinned plan buffer is never rewritten early: lesson 04's
# `plan()` hazard). The GPU is kept 0.5 ms busy per step. Only the way step n's host metadata reaches
# `plan()` changes:
#
# ```python
# indptr, last = slots[n % len(slots)]             # one pinned pair, or one pair per wrapper (the ring)
# indptr.copy_(step_indptr); last.copy_(step_last)  # the host writes step n's metadata
# if variant == "snapshot":                        # the PR: pageable metadata, a fresh pinned snapshot
#     indptr, last = indptr.pin_memory(), last.pin_memory()
# wrappers[n % ring].plan(indptr, indices, last)   # its copies run when the GPU gets to them
# ```
#
# Every step's output is then compared with `pinlab.paged_kv.reference_decode`, the fp32 reference
# fed with step n's correct metadata.

# %%
for name, what in l08.FLASHINFER_VARIANTS.items():
    print(pinlab.timing.wrapped(f"{name}: {what}"))

# %% [markdown]
# 🔮 **Predict.** The graph captured `run()`, not the copies: `plan()` enqueues them outside the graph
# at every step. Does that protect the reused pinned pair?
#
# <details><summary>Answer</summary>
#
# No. `plan()`'s copies are `non_blocking` copies from pinned memory: they read the pair when the
# GPU runs them, behind the previous steps' work, by which time the host has written later steps'
# metadata into it. The replayed `run()` then attends with step n's plan over another step's
# `indptr` and `last_page_len`: other pages, other lengths, and no error. The snapshot and the ring
# give every `plan()` memory nobody rewrites before its copies have run.
# </details>

# %%
print("FlashInfer compiles its decode kernel the first time it is used (JIT);")
print("how long that took is shown below. A replay of a recorded run skips it.")
fi = pinlab.measure(
    "08_flashinfer_graph", l08.flashinfer_graph_runs, steps=1000, ring=3, busy_ms=0.5
)

# %%
fr, fi_ran = fi.result, fi.result["flashinfer"]
fb = {r["variant"]: r for r in fr["rows"]}
pinlab.show("FlashInfer ran", "yes" if fi_ran else f"no: {fr['reason']}")
for v, r in fb.items():
    pinlab.show(
        f"{v}: steps whose attention was wrong (max "
        "error; seconds, the first with the JIT)",
        f"{r['wrong_steps']} of {fr['steps']} ({r['max_err']:.3f}; {r['seconds']} s)",
    )
FI_FIXES = ("snapshot", "pinned_ring")
for v in FI_FIXES:
    wrong_steps = fb[v]["wrong_steps"] if fi_ran else 0
    pinlab.claim(
        f"{v}: steps whose attention was wrong, wherever FlashInfer ran",
        wrong_steps,
        expect=0,
        why=l08.WHY.fi_fixes,
    )
racy_wrong = fb["reused_pinned"]["wrong_steps"] if fi_ran else None
pinlab.claim(
    "reused pinned pair: the replayed run() attended with another "
    "step's metadata on at least one step, wherever FlashInfer ran",
    not fi_ran or racy_wrong >= 1,
    value=f"{racy_wrong} of {fr['steps']}",
    why=l08.WHY.fi_race,
)
held = pinlab.observe(
    "reused pinned pair: at least 99% of steps wrong",
    fi_ran and racy_wrong >= 0.99 * fr["steps"],
    value=f"{racy_wrong} of {fr['steps']}" if fi_ran else "FlashInfer did not run",
    why=l08.WHY.fi_most,
)

# %% [markdown]
# Where FlashInfer ran, the lines above count the steps whose attention differed from the
# reference by more than the tolerance: with the reused pinned pair, the captured `run()` worked
# with the plan of one step and the `indptr` of another. Capturing `run()` in a graph changed
# nothing about where its inputs come from; the fix is the one of lesson 04, applied to whatever
# `plan()` copies from. Where FlashInfer could not run (not installed, or its build failed), the
# line above says why, and the claims hold trivially: there was nothing to count.
#
# ## The regression test the PR lacked
#
# A test that must fail on the racy step and pass on the fix: the host rewrites the metadata right
# after each replay while the GPU is far behind, and every step's kernels must read their own
# step's data. It runs on the GPU and, unchanged, on the emulated stream. Copy it into your own
# test suite with your engine's staging function in place of `stage`.


# %%
def check_graph_staging(stage, steps=100, busy_ms=0.5):
    """Fail if a graph step staged by ``stage(s, meta, static, state)`` reads another
    step's metadata.  ``stage`` gets the stream, the host metadata (rewritten by the
    host right after the call), the graph's static device input and a dict it may keep
    buffers in (new for every run); it must get ``meta``'s current contents into
    ``static`` for the replay that follows."""
    with pinlab.stream() as s:
        meta = torch.zeros(16, dtype=torch.int32)
        static = torch.zeros(16, dtype=torch.int32, device=s.device)
        out = torch.zeros(16, dtype=torch.int32, device=s.device)
        seen = torch.zeros(steps, dtype=torch.int32, device=s.device)
        state = {}
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out.copy_(static)  # the step's kernels read the static input
        s.busy(busy_ms * steps)  # the GPU far behind the host
        for n in range(steps):
            meta.fill_(n)
            stage(s, meta, static, state)
            g.replay()
            seen[n : n + 1].copy_(out[:1])
            meta.fill_(-1)  # the host rewrites the metadata at once
        s.synchronize()
    wrong = [n for n, v in enumerate(seen.tolist()) if v != n]
    if wrong:
        raise AssertionError(
            f"{len(wrong)} of {steps} steps read another "
            f"step's metadata (first: step {wrong[0]})"
        )


def racy_stage(s, meta, static, state):
    """The old way: one persistent pinned buffer, reused every step."""
    if "pinned" not in state:
        state["pinned"] = torch.zeros_like(meta, pin_memory=True)
    state["pinned"].copy_(meta)
    static.copy_(state["pinned"], non_blocking=True)


def fixed_stage(s, meta, static, state):
    """vLLM 0.29: a fresh pinned snapshot every step."""
    static.copy_(meta.pin_memory(), non_blocking=True)


def outcomes(stage, runs=10):
    failed = 0
    for _ in range(runs):
        try:
            check_graph_staging(stage)
        except AssertionError:
            failed += 1
    return failed


racy_failed, fixed_failed = outcomes(racy_stage), outcomes(fixed_stage)
pinlab.claim(
    "the test failed the racy staging, runs of 10",
    racy_failed,
    expect=10,
    why=l08.WHY.test_lead,
)
pinlab.claim(
    "the test failed the fixed staging, runs of 10",
    fixed_failed,
    expect=0,
    why=l08.WHY.test_lead,
)

# %% [markdown]
# ## When graphs help less, and what they cost
#
# A graph saves host time per *launch*. The host-cost run at the top of the lesson also measured a
# step of one kernel:

# %%
at1 = next(r for r in rows if r["kernels"] == 1)
pinlab.show(
    "one kernel per step: eager / one replay, host µs",
    f"{at1['eager_us']:.1f} / {at1['replay_us']:.1f}",
)
saved1, saved20 = at1["eager_us"] - at1["replay_us"], eager20 - replay20
held = pinlab.observe(
    "a replay saves the host less at 1 kernel than at 20",
    saved1 < saved20,
    value=f"{saved1:.1f} µs against {saved20:.1f} µs saved",
    why=l08.WHY.few_us,
)

# %% [markdown]
# A step of a few large kernels saves a few µs against milliseconds of GPU work; a decode step of
# hundreds of small kernels saves most of its host time. And a graph holds memory:
#
# - everything it reads is static: input buffers sized for the largest batch, and one graph per batch
#   size (vLLM captures a list of sizes and pads the batch up to the next one);
# - each graph allocates what its kernels produce (activations, outputs) from a **private memory
#   pool** that only its replays use: the pool keeps those blocks reserved as long as the graph lives;
# - pinned staging buffers are host memory nobody else can use (lesson 01): a ring holds depth ×
#   the metadata, rounded up by the caching host allocator.
#
# `l08.graph_memory` captures one small graph per batch size (four elementwise layers on a static
# `[batch, 4096]` fp32 input) and reads `torch.cuda.memory_allocated()` and `memory_reserved()` around
# each capture, then pins a ring of three six-tensor slabs and reads the caching host allocator's
# statistics:

# %% tags=["nbval-ignore-output"]
mem = pinlab.measure(
    "08_graph_memory",
    l08.graph_memory,
    batch_sizes=[1, 8, 64, 256],
    hidden=4096,
    layers=4,
    ring_depth=3,
    tensors=6,
    n_ints=256,
)
pinlab.table(mem.result["rows"], l08.MEMORY_COLUMNS)

# %%
gm = mem.result
b1 = gm["rows"][0]
pinlab.show(
    "all graphs and static inputs together: allocated / reserved MiB",
    f"{gm['held_allocated_bytes'] / 2**20:.1f} "
    f"/ {gm['held_reserved_bytes'] / 2**20:.1f}",
)
pinlab.show(
    f"pinned ring of {gm['ring_depth']} slabs: requested / held KiB",
    f"{gm['ring_requested_bytes'] / 1024:.0f} / {gm['ring_pinned_bytes'] / 1024:.0f}",
)
held = pinlab.observe(
    f"at batch {b1['batch']} the capture reserved at least 10x one activation",
    b1["graph_reserved_bytes"] >= 10 * b1["activation_bytes"],
    value=f"{b1['graph_reserved_bytes'] / 1024:.0f} KiB "
    f"for {b1['activation_bytes'] / 1024:.0f} KiB",
    why=l08.WHY.pool,
)

# %% [markdown]
# A graph's pool reserves whole segments of the caching allocator, so a graph of small tensors can
# hold far more than it uses, once per captured batch size (read the table: the smallest batch's
# reservation against its activation). Engines share one pool among their graphs (`torch.cuda.graph`'s
# `pool=` argument; vLLM does) and capture a bounded list of sizes for this reason. The ring's pinned
# bytes are small for metadata; they are rounded up per slab, like every pinned block (lesson 01).
#
# Anything that depends on the data (a `.item()`, `nonzero()`, a shape that changes) cannot be in
# the graph: it runs outside, between replays, and costs what it costs eagerly.

# %%
back = pinlab.pinned_back_to(
    pinned_at_start + left_by_refusals
) or pinlab.pinned_back_to(pinned_at_start)
pinlab.claim(
    "pinned memory held is back to its starting "
    "level, but for what the refused captures left",
    back,
    why=pinlab.PINNED_BACK_WHY,
)

# %% [markdown]
# **What to remember**
# - A CUDA graph replays the *addresses* it captured. A captured `copy_(pinned_buf, non_blocking=True)`
#   reads the buffer when the replay runs, not when it was captured or launched.
# - A capture refuses pageable copies (nothing would keep a pageable buffer alive for the replays)
#   and host waits, so graphs push every staging buffer into pinned memory that outlives the graph,
#   the memory that races when the host rewrites it.
# - Graph-safe fixes give each step memory nobody rewrites until its copy has run: a `pin_memory()`
#   snapshot copied into the static input outside the graph (vLLM 0.29), or an event-guarded ring.
# - The same holds for FlashInfer's graph wrappers: `run()` is captured, `plan()` copies the host
#   metadata outside the graph, so what `plan()` copies from needs the same fix.
# - Test it: rewrite the metadata right after each replay with the GPU behind, and check that every
#   step read its own data (`check_graph_staging`).
# - A graph saves host time per launch (little for a step of few kernels) and holds memory: static
#   buffers for the largest batch, and a private pool per graph unless graphs share one.
