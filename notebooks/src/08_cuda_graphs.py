# %% [markdown]
# # 08 · CUDA graphs: what a captured copy reads
#
# **What you will learn**
# - what a CUDA graph saves the host per decode step;
# - why every captured host-to-device copy reads **pinned** memory;
# - that a replay reads the **addresses** it captured: lesson 03's race, under replay;
# - graph-safe fixes, their host cost, and the same race in FlashInfer's graph decode wrapper;
# - a regression test; when graphs help less, and the memory they hold.
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
from pinlab import lead
from pinlab.lessons import l08_cuda_graphs as l08

pinlab.header("08 cuda graphs")
pinned_at_start = pinlab.pinned_baseline()

# %% [markdown]
# ## Capture once, replay every step
#
# A decode step launches many small kernels: embeddings, one attention and a few matmuls per
# layer, sampling. Each launch costs the host a few microseconds in Python, torch and the driver.
# A **CUDA graph** records a stream's work once (`torch.cuda.graph(g)`: *capture*) and launches it
# all with one call (`g.replay()`). It fixes the kernels, their arguments and the **addresses** of
# every tensor they read and write, so its inputs live in **static** tensors, filled before each
# replay.
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
# Most of it: a replay is one launch call; eager launches cost the host per kernel. Measured below.
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
# from 1 to 40 kernels). Hence engines capture the decode step.
#
# ## What a capture refuses
#
# A capture records work without running it, so it refuses what needs the work's result now.
# Lesson 03's emulated stream captures and replays graphs too, with the same refusals and
# messages.


# %%
def try_in_capture(s, body):
    """Capture ``body`` into a fresh graph; return
    'captured', or the error torch raised."""
    g = torch.cuda.CUDAGraph()
    try:
        with l08.quiet_refusal(), torch.cuda.graph(g):
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
# after freeing ours, what stays pinned is what the refusals left
del pinned
left_by_refusals = pinlab.pinned_baseline() - pinned_at_start
pinlab.show("pinned bytes the capture experiments left in use", left_by_refusals)
pinlab.show("what that is", l08.refusals_left_text(left_by_refusals))

# %% [markdown]
# Read `.item()`'s message with care: on a GPU, CUDA refuses the wait ("operation not permitted when
# stream is capturing"); torch then ends the capture and reports "operation failed due to a
# previous error during capture" (printed above), with the refusal as context. The warning "The
# CUDA Graph is empty" under a GPU run's cell comes from the pageable copy's capture, not from
# `.item()`'s: torch refused that copy before recording anything, so that capture ended cleanly,
# empty, and `capture_end` warns on an empty graph (`aten/src/ATen/cuda/CUDAGraph.cpp`). CUDA
# invalidated the `.item()` capture (it had recorded the sum), so ending it raised before any node
# count (`docs/facts.md` F9).
#
# `.item()` is refused because the host would wait for a value not yet computed. Torch refuses the
# pageable copy itself: `copy_kernel_cuda` in `aten/src/ATen/native/cuda/Copy.cu` checks, during
# capture, that a copy's CPU side is pinned (pytorch PR #172156). Its maintainers give lifetime as
# the reason: a captured copy stores the CPU buffer's address, but nothing keeps that buffer alive
# for the replays, which could silently read freed, reused memory: garbage (issue #171894;
# `docs/facts.md` F8). That is why graphs need pinned staging buffers that **outlive the graph**:
# the persistent pinned buffers that race in lesson 03. Does the graph protect them?
#
# ## The race, under replay
#
# Lesson 03's loop, with the copy **inside the graph**: each step writes its number into the
# pinned buffer, keeps the GPU busy, and replays.
#
# 🔮 **Predict.** The graph captured `static.copy_(pinned_buf, non_blocking=True)` once. The host
# rewrites `pinned_buf` every step. Which step's data does step n's replay read?
#
# <details><summary>Answer</summary>
#
# Whatever `pinned_buf` holds when the replayed copy *runs*: the graph stored its address, not its
# contents, and the host, ahead of the GPU, has written later steps by then.
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
        pinned_buf.fill_(n)
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
lead.claim(
    "the captured copy from the reused pinned buffer "
    "delivered another step's data at least once",
    wrong >= 1,
    value=f"{wrong} of {len(seen)}",
    why=l08.WHY.lead,
)

# %% [markdown]
# Lesson 03's race detector follows graphs too: it remembers the sources of copies captured while
# it is active, and each `replay()` makes them pending again, so it reports a host write into one
# before the replay has run.

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
lead.claim(
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
# That detector judges by timing: it asks whether the replay's copy has run yet. Under
# `CUDA_LAUNCH_BLOCKING=1` every replay has run before `replay()` returns, so it finds nothing,
# and the code is as wrong as before (lesson 03's heisenbug). `pinlab.detect_races()` judges by
# **order**: a captured copy's source stays off limits until the host orders it.
# `l08.blocking_verdicts` runs the same race (`l08.graph_loop`'s `captured_reused_pinned`) under
# each, in a fresh process with the variable set (without CUDA: the emulated stream at lag 0, a
# GPU that keeps up):

# %%
bv = l08.blocking_verdicts(steps=50)
pinlab.show("stream in the child", bv["stream"])
pinlab.show(
    "steps whose replay read another step's data / timing "
    "findings / captured copies that can race by order (raced)",
    f"{bv['wrong']} / {bv['timing']} / {bv['order']} ({bv['raced']}) of {bv['steps']}",
)
pinlab.claim(
    "the GPU kept up (launches block): steps that read another step's data",
    bv["wrong"],
    expect=0,
    why=l08.WHY.launch_blocking,
)
pinlab.claim(
    "the GPU kept up (launches block): races the timing verdict found",
    bv["timing"],
    expect=0,
    why=l08.WHY.launch_blocking,
)
pinlab.claim(
    "captured copies the order verdict says can race",
    bv["order"],
    expect=bv["steps"] - 1,
    why=l08.WHY.by_order,
)

# %% [markdown]
# Every step's rewrite but the last is named (the final `synchronize()` orders the last replay),
# whether or not the GPU kept up: lesson 07's pytest gate judges by order.
#
# Under async scheduling the host runs a step or more ahead, so a captured copy from a rewritten
# buffer is as racy as an eager one. The seed document's risk list names this case: "the
# `paged_kv_indptr` on the CPU being rewritten by later steps" under CUDA graphs.
#
# ## Every way to feed a graph
#
# `l08.every_variant` runs a graph step loop per way of feeding step n's metadata to the static
# input: six tensors per step (as in decode: `indptr`, `indices`, `last_page_len`, positions, slot
# mapping, sequence lengths), the GPU 0.1 ms behind, 10,000 steps, counting steps that read
# another step's data in any tensor:

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
# A racy variant's count varies with how far behind the GPU was when its copy ran. The captured
# copy is replayed after `s.busy`; the copy outside the graph is enqueued before it, so it waits
# only for earlier steps and beats the host's next write whenever the GPU has caught up.
#
# Each fix listed above gives every step memory nobody rewrites until its copy has run. The PR's
# snapshot is copied into the static input *before* the replay, and the caching host allocator
# reuses its block only after that copy has run (lesson 04). With one graph per ring slot, step n
# replays slot n mod depth after waiting for that slot's previous event.

# %% [markdown]
# The loop above runs at the GPU's pace (over 10,000 steps the GPU falls behind and CUDA's launch
# queue fills: lesson 03), so `l08.staging_cost` times each variant's staging alone on the host
# (metadata write, copies, replay call): rounds of 50 steps ending with a sync, variants
# interleaved round by round, median of the rounds' medians. With no busy work your own GPU keeps
# up, the rings hardly ever wait, and each time is the host's own cost; on a shared GPU the events
# can come late and a ring pays the GPU's pace (the line below says which). No data is checked
# here.

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
# The snapshot pays a pinned allocation per tensor per step; the rings pay in memory and events.
# vLLM 0.29's fix is two lines outside the graph:


# %%
def snapshot_step(s, meta, static, g):
    """One step of the fix: the metadata is pageable;
    snapshot it, copy the snapshot, replay."""
    # a fresh pinned block, outside the graph
    static.copy_(meta.pin_memory(), non_blocking=True)
    g.replay()  # the graph only reads the static input


# %% [markdown]
# ## Real decode: FlashInfer's graph wrappers
#
# Under graphs, vLLM's FlashInfer backend builds one decode wrapper per captured batch size with
# `use_cuda_graph=True` and **fixed device buffers** for `indptr`, `indices` and `last_page_len`.
# Every step, outside the graph, `plan()` reads the host metadata, computes the plan on the host
# and copies the metadata into the fixed buffers with `non_blocking=True` (`_plan_impl` in
# FlashInfer's `flashinfer/decode.py`, which also stages its plan info through one pinned
# workspace per wrapper: `docs/facts.md` F19). `run()` is captured once:
#
# ```python
# wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
#     workspace, "NHD", use_cuda_graph=True,             # the graph keeps these buffers' addresses
#     paged_kv_indptr_buffer=indptr_buf, paged_kv_indices_buffer=indices_buf,
#     paged_kv_last_page_len_buffer=last_page_len_buf)
# wrapper.plan(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size)
# g = torch.cuda.CUDAGraph()
# with torch.cuda.graph(g):                              # capture run() once
#     out = wrapper.run(q, (k_cache, v_cache))
# # every step, outside the graph: plan()'s H2D copies fill the buffers
# wrapper.plan(indptr_n, indices_n, last_page_len_n, num_qo_heads, num_kv_heads, head_dim, page_size)
# g.replay()
# ```
#
# `pinlab.paged_kv.FlashInferDecode(..., graph_batch=8, graph_max_pages=64)` builds that wrapper.
# `l08.flashinfer_graph_decode` runs 1,000 decode steps of 8 requests whose page counts and
# last-page lengths change every step (`l08.decode_metadata`), through a ring of three wrappers,
# each with its own captured `run()`. Step n uses wrapper n mod 3 after waiting for that
# wrapper's previous step's event, so FlashInfer's own pinned plan buffer is never rewritten early
# (lesson 04's `plan()` hazard). The GPU is kept 0.5 ms busy per step. Only how step n's metadata
# reaches `plan()` differs:
#
# ```python
# indptr, last = slots[n % len(slots)]             # one pinned pair, or one pair per wrapper
# indptr.copy_(step_indptr); last.copy_(step_last)  # the host writes step n's metadata
# if variant == "snapshot":                        # the PR: pageable, a fresh pinned snapshot
#     indptr, last = indptr.pin_memory(), last.pin_memory()
# wrappers[n % ring].plan(indptr, indices, last)   # its copies run when the GPU gets to them
# ```
#
# Each step's output is compared with `pinlab.paged_kv.reference_decode`, the fp32 reference given
# step n's correct metadata.

# %%
for name, what in l08.FLASHINFER_VARIANTS.items():
    print(pinlab.timing.wrapped(f"{name}: {what}"))

# %% [markdown]
# 🔮 **Predict.** The graph captured `run()`, not the copies: `plan()` enqueues them outside the
# graph every step. Does that protect the reused pinned pair?
#
# <details><summary>Answer</summary>
#
# No. `plan()`'s `non_blocking` copies read the pinned pair when the GPU runs them, after the host
# has written later steps' metadata into it. The replayed `run()` then attends with step n's plan
# over another step's `indptr` and `last_page_len`: other pages, other lengths, no error. The
# snapshot and the ring (lesson 04's fixes) give each `plan()` memory nobody rewrites before its
# copies run.
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
lead.claim(
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
# Where FlashInfer ran, the lines above count the steps whose attention differed from the reference
# beyond the tolerance. Where FlashInfer could not run (not installed, or its build failed), the
# line above says why, and the claims hold trivially.
#
# ## The regression test the PR lacked
#
# It must fail on racy staging and pass on the fix: the host rewrites the metadata right after each
# replay, with the GPU far behind, and every step must read its own data. It runs unchanged on the
# GPU and the emulated stream. Copy it into your suite, with your engine's staging function as
# `stage`.


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
lead.claim(
    "the test failed the racy staging in every one of 10 runs",
    racy_failed == 10,
    value=f"{racy_failed} of 10",
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
# A graph saves host time per *launch*. The host-cost run above also measured a one-kernel step:

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
# - everything it reads is static: buffers sized for the largest batch, one graph per batch size
#   (vLLM captures a list of sizes and pads each batch up to the next);
# - each graph allocates what its kernels produce (activations, outputs) from a **private memory
#   pool** only its replays use, reserved while the graph lives;
# - pinned staging buffers are host memory nobody else can use (lesson 01): a ring holds depth ×
#   the metadata, rounded up by the caching host allocator.
#
# `l08.graph_memory` captures one small graph per batch size (four elementwise layers on a static
# `[batch, 4096]` fp32 input), reading `torch.cuda.memory_allocated()` and `memory_reserved()`
# around each capture, then pins a ring of three six-tensor slabs and reads the caching host
# allocator's statistics:

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
# hold far more than it uses, per captured batch size (see the smallest batch in the table). So
# engines share one pool among their graphs (`torch.cuda.graph`'s `pool=` argument; vLLM does)
# and capture a bounded list of sizes. The ring's pinned bytes, rounded up per slab, are small for
# metadata.
#
# Anything data-dependent (`.item()`, `nonzero()`, a changing shape) stays out of the graph: it
# runs between replays, at eager cost.

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
# - A graph replays the *addresses* it captured: a captured copy reads its buffer when the replay
#   runs.
# - Captures refuse pageable copies and host waits, so graph staging lives in long-lived pinned
#   memory, which races when the host rewrites it.
# - Give each step memory nobody rewrites until its copy has run: a `pin_memory()` snapshot outside
#   the graph (vLLM 0.29) or an event-guarded ring; FlashInfer's `plan()` too.
# - Test it with `check_graph_staging`.
# - Graphs save host time per launch and hold memory: static buffers for the largest batch, a
#   private pool per graph unless shared.
