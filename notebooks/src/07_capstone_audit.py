# %% [markdown]
# # 07 · Capstone: audit an inference loop
#
# **What you will learn**
# - to audit an inference loop: every copy (pinned or pageable? who rewrites its source, and when?),
#   every read of GPU results (after which event?), every host wait for the GPU;
# - to find each problem with the course's tools, and to make the detectors a failing test (`pytest
#   --pinlab-races`);
# - what a fix must achieve, how the checker verifies it, and what it buys: the planted loop and the
#   reference fix side by side, on a timeline and in steps per second.
#
# No new mechanism: this practises lessons 02 to 06. Writing the fix is the exercise; the notebook
# measures the library's reference answer.

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
import gc

import matplotlib.pyplot as plt
import torch

import pinlab
from pinlab.checks import l07 as checks07
from pinlab.detector import PAGEABLE_H2D
from pinlab.lessons import l07_capstone_audit as l07

NO_TRACE = (
    "not measured: the trace holds no GPU activity (a "
    "profiler that records none, as often under WSL2)"
)

pinlab.header("07 capstone: audit an inference loop")
pinned_at_start = pinlab.pinned_baseline()

# %% [markdown]
# ## The engine
#
# A toy engine, `m = l07.CapstoneModel(stream)`, keeps what a real one hides behind its loop:
# - a **decoder over a paged KV cache** (lessons 03 and 04): requests grow by one token a step, join
#   and leave; the host writes each step's `indptr` and `last_page_len`, they are copied to
#   `m.meta_dev[n]`, and the page indices are built **on the GPU** from that copy; then paged decode
#   attention (FlashInfer's kernel where it can run, the torch reference elsewhere), the **LM head**
#   and an argmax give one token per request;
# - an **offloaded LM head** (lesson 05): an 8 MiB weight in host memory, copied into its GPU buffer
#   `m.lm_head` before every step, as a CPU-offloaded layer is;
# - a **vision encoder**, rotary position ids built on the device (lesson 06), then about 1 ms of
#   GPU work; the decoder's other layers add about 1 ms more;
# - the host's side: `m.schedule(n, buf)` writes step n's metadata into a host buffer; `m.emit(k,
#   host_tokens)` hands step k's tokens to the detokenizer, which reads them **now**;
#   `m.note_stop(k)` records that a request finished in step k (it produced the end-of-sequence
#   token `m.eos`); `m.host_work()` is the rest of the host's step (server, detokenizer): 0.3 ms of
#   CPU.
#
# The loop someone wrote on top of it runs and produces tokens. It is wrong in five places:


# %%
def planted_loop(m, steps):
    """The capstone's inference loop as written:
    it runs, and it is wrong in five places."""
    s = m.stream
    m.lm_head_host = m.lm_head.to("cpu")  # offload the LM head to host memory
    # the metadata buffer
    meta = torch.zeros(m.meta_ints, dtype=torch.int32, pin_memory=True)
    tokens_host = torch.zeros(m.max_batch, dtype=torch.int64, pin_memory=True)
    m.schedule(0, meta)  # the scheduler writes step 0's metadata
    for n in range(steps):
        # restore the offloaded LM head (8 MiB)
        m.lm_head.copy_(m.lm_head_host, non_blocking=True)
        m.encode(n)  # vision encoder: rotary ids, GPU work
        snap = meta.pin_memory()  # a private snapshot of step n's metadata
        m.meta_dev[n].copy_(snap, non_blocking=True)  # H2D: indptr + last_page_len
        if n + 1 < steps:
            m.schedule(n + 1, meta)  # the scheduler moves on to step n+1
        tokens = m.decode(n)  # paged attention, LM head, argmax (GPU)
        tokens_host.copy_(tokens, non_blocking=True)  # D2H into pinned memory
        m.emit(n, tokens_host)  # hand step n's tokens to the detokenizer
        if tokens.eq(m.eos).any().item():  # did a request finish?
            m.note_stop(n)
        m.host_work()  # the server, the detokenizer (CPU)
    s.synchronize()


# %% [markdown]
# 🔮 **Predict.** Which lines are wrong, and which lesson says why?
#
# <details><summary>Answer (lines counted from `def planted_loop`, line 1)</summary>
#
# 1. Line 9 restores the LM head from **pageable** memory (line 4's `.to("cpu")`): an 8 MiB
#    `non_blocking` copy the driver stages, holding the host (lessons 02 and 05).
# 2. Line 11's `pin_memory()` of a pinned buffer is the same tensor, no snapshot (lesson 04).
# 3. So line 14 rewrites the buffer step n's copy (line 12) has not read yet: the race (lesson 03).
# 4. Line 17 reads tokens whose `non_blocking` copy (line 16) has not run yet: read before its event
#    (lesson 02).
# 5. Line 18's `.item()` makes the host wait for the GPU every step (lesson 02).
# </details>
#
# ## 1. Run it, and judge every step
#
# `l07.run_loop(m, loop, steps)` runs the loop, then judges every step exactly: did the metadata
# copy deliver *this* step's `indptr` (compared entry by entry with the scheduler's), did `emit()`
# get the tokens the GPU computed for this step, were finished steps noted, is the LM head intact. A
# step whose metadata or tokens were wrong is **corrupted**.
#
# First on the emulated lagging stream, on every machine: its GPU runs queued work only when the
# host waits, so it shows exactly what a far-lagging GPU reads (exact in order, silent about time).

# %%
STEPS = 200
with pinlab.LaggingStream() as es:
    em = l07.CapstoneModel(es, steps=STEPS)
pinlab.show("stream", es.label)
planted = l07.run_loop(em, planted_loop, STEPS)
stale = planted["stale_reads"] - planted["overwritten"]
delivered_once = planted["deliveries"] == STEPS and planted["missing"] == 0
pinlab.claim(
    f"planted loop, emulated: corrupted steps (of {STEPS})",
    planted["corrupted"],
    expect=STEPS,
    why=l07.WHY.emulated,
)
pinlab.claim(
    "metadata copies that delivered the next step's data",
    planted["wrong_meta"],
    expect=STEPS - 1,
    why=l07.WHY.emulated,
)
pinlab.claim(
    "steps whose tokens were read before their copy ran",
    stale,
    expect=STEPS,
    why=l07.WHY.emulated,
)
pinlab.claim(
    "every step's tokens handed to the detokenizer once",
    delivered_once,
    why=l07.WHY.emulated,
)

# %% [markdown]
# The loop "works": it runs to the end, handing tokens to the detokenizer every step. But the GPU
# attended the wrong pages (its `indptr` was the next step's; only the last step, which schedules
# nothing after it, got its own), and the detokenizer got tokens the GPU had not written yet.
# Nothing crashed; a test of shapes would pass.
#
# The same loop on the GPU (200 steps, FlashInfer's decode where it runs):


# %%
def planted_on_gpu(steps):
    return l07.audit({"planted": planted_loop}, steps=steps)


on_gpu = pinlab.measure("07_planted_gpu", planted_on_gpu, steps=STEPS)
g = on_gpu.result["loops"]["planted"]
pinlab.show(
    "planted loop on the GPU: corrupted steps", f"{g['corrupted']} of {g['steps']}"
)
pinlab.show(
    "planted loop on the GPU: metadata copies that delivered another step's data",
    g["wrong_meta"],
)
pinlab.show(
    "planted loop on the GPU: steps whose tokens were read before their copy ran",
    g["stale_reads"],
)
pinlab.show("attention backend", on_gpu.result["backend"])

# %% [markdown]
# On a GPU the count depends on timing: a copy goes wrong when the host rewrites its buffer before
# the GPU reaches it. Here about a millisecond of encoder work precedes each metadata copy, and the
# scheduler rewrites the buffer microseconds later; the decoder's work precedes each token copy,
# read at once. A slower GPU, a busier step or a faster host moves towards the emulated count: a
# race is a bug whatever one run shows.
#
# ## 2. Find the stalls: `pinlab.detect_stalls`
#
# The detector (lesson 02b) watches every torch call of the process (the loop's, the engine's,
# FlashInfer's) and reports the copies and syncs that make the host wait for the GPU, with the line
# that made them, shown as its code. On the GPU for 20 steps, the engine handing FlashInfer's
# `plan()` pageable host metadata, as vLLM 0.29 does:


# %%
def detect_loop(loop, steps, pin_plan_inputs):
    return l07.detect(loop, steps=steps, pin_plan_inputs=pin_plan_inputs)


stalls = pinlab.measure(
    "07_detect_stalls",
    lambda **kw: detect_loop(planted_loop, **kw),
    steps=20,
    pin_plan_inputs=False,
)
# each line number shown as its code
for line in l07.code_of_lines(stalls.result["lines"], planted_loop):
    print(pinlab.timing.wrapped(line, indent=6))
kinds = " ".join(stalls.result["lines"])
named_both = "pageable H2D" in kinds and "host sync (.item())" in kinds
pinlab.claim(
    "the detector names the LM head restore's "
    "pageable copy and the stop check's .item()",
    named_both,
    value=stalls.result["lines"],
    why=l07.WHY.detector,
)
pinlab.show("attention backend", stalls.result["backend"])
pinlab.show(
    "detector events outside planted_loop's own lines, per step",
    f"{stalls.result['events_elsewhere'] / stalls.result['steps']:g}",
)
for line in stalls.result["elsewhere"]:
    pinlab.show("  elsewhere", line)

# %% [markdown]
# Two of the five problems show up here:
# - **the restore** `m.lm_head.copy_(m.lm_head_host, non_blocking=True)`, 8 MiB every step from
#   *pageable* memory: lesson 02's fake `non_blocking`, the host waiting while the driver stages it
#   (how long, and whether for the GPU too, is the driver's undocumented choice: the CUDA Runtime
#   API's "API synchronization behavior" page says only that such a copy may be synchronous);
# - **the stop check** `tokens.eq(m.eos).any().item()`: every step, the host waits for *all* the
#   queued work. Host and GPU take turns instead of overlapping.
#
# The offload's own blocking copy runs once, before the loop: offloading may wait.
#
# The `elsewhere` events (each names its file) come, where FlashInfer runs, from `plan()`: every
# step it copies the host `indptr` and `last_page_len` it is given, and a small range table of its
# own, to the GPU with `non_blocking=True`. Handed pageable tensors (as vLLM 0.29 did), these are
# pageable copies no loop line made: small, so the driver stages them and they usually return at
# once, but each costs the host its staging and may wait once the driver's staging pool is full.
# vLLM 0.33 pins them, as does the engine's fix below.
#
# The detector sees copies and syncs, not races (`m.schedule` rewriting `meta` under a queued copy,
# `m.emit` reading `tokens_host` before its copy ran). For those, the race detector.
#
# ## 2b. Find the races: `detect_races`, and a test that fails
#
# Lesson 03's `pinlab.races.detect_races()` reports the host touching memory a pending copy has not
# finished with. The planted loop under it, 20 steps on the emulated stream (exact counts on every
# machine), reporting the loop's own lines (`callers=[planted_loop]`, as for `detect_stalls`):

# %% tags=["nbval-ignore-output"]
from pinlab.races import D2H_READ, H2D_REWRITE, detect_races

with pinlab.LaggingStream() as rs:
    rm = l07.CapstoneModel(rs, steps=20)
with detect_races(callers=[planted_loop]) as races:
    l07.run_loop(rm, planted_loop, 20)
print(races)

# %%
pinlab.claim(
    "planted loop, emulated, 20 steps: metadata copies whose source the host rewrote",
    races.count(H2D_REWRITE),
    expect=19,
    why=l07.WHY.emulated,
)
pinlab.claim(
    "planted loop, emulated, 20 steps: token copies read before they had run",
    races.count(D2H_READ),
    expect=20,
    why=l07.WHY.emulated,
)

# %% [markdown]
# Both races, with their lines: the metadata copy (line 12) whose source the scheduler rewrote
# (reported where the detector first saw the new bytes: `m.schedule` writes through numpy, seen at
# the next torch call), and the token copy (line 16) that `m.emit` read on line 17. The last step
# schedules nothing: 19 and 20.
#
# A detector you must remember to run finds nothing. The course's pytest plugin runs it over a
# suite: `pytest --pinlab-races` fails every test whose code races, with this report
# (`--pinlab-stalls`, every test that stalls; `docs/race_gate.md` shows how a team adopts it). The
# sample suite `examples/race_gate` writes one step loop three ways: racy, with a snapshot, with an
# event-guarded ring. Plain `pytest` passes all three (the racy test in `test_step_loop.py` asserts
# nothing: what a race delivers changes from run to run); the gate fails it.

# %% tags=["nbval-ignore-output"]
gate = l07.run_gate()  # pytest -q --pinlab-races examples/race_gate, in a fresh process
print(gate["tail"])

# %%
RACY = "test_step_loop.py::test_racy_loop"
gate_why = f"{l07.WHY.gate} (stderr: {gate['stderr_tail'] or 'empty'})"
pinlab.claim(
    f"the gate failed {RACY} and no other test",
    gate["failed_tests"] == [RACY],
    value=gate["failed_tests"],
    why=gate_why,
)
pinlab.claim("the gate: passed tests", gate["passed"], expect=2, why=gate_why)

# %% [markdown]
# ## 3. Audit every copy: `l07.LoopAudit`
#
# `run_loop` ran the loop under `l07.LoopAudit`, which records per line every pageable
# `non_blocking` H2D copy, blocking copy, host sync, `pin_memory()` of a pinned tensor, and wait on
# an event recorded after the newest step enqueued (a full wait: no later step queued behind it),
# and whether the LM head was restored before each step's decode. The emulated run's counts (the
# same on a GPU: they count calls, not time):

# %%
for line in l07.code_of_lines(planted["audit_lines"], planted_loop):
    print(pinlab.timing.wrapped(line, indent=6))
pinlab.claim(
    "planted loop: pin_memory() of a pinned tensor",
    planted["counts"][l07.PIN_NOOP],
    expect=STEPS,
    why=l07.WHY.audit,
)
pinlab.claim(
    "planted loop: pageable non_blocking copies in its lines",
    planted["counts"][l07.PAGEABLE],
    expect=STEPS,
    why=l07.WHY.audit,
)

# %% [markdown]
# The third problem, **the snapshot** `snap = meta.pin_memory()`: `meta` is already pinned, so
# `snap` is **the same storage** (lesson 04's trap). Hence the fourth, the race (lesson 03): step
# n's metadata copy, still queued behind the vision encoder, reads the buffer `m.schedule(n + 1,
# meta)` rewrites.
#
# 🔮 **Predict.** The stop check's `.item()` makes the host wait for the GPU every step. Doesn't that
# wait save the metadata copy?
#
# <details><summary>Answer</summary>
#
# No. The wait comes *after* `m.schedule(n + 1, meta)` has rewritten `meta`, while the GPU was still
# busy with the vision encoder, so the copy enqueued before reads step n+1's metadata. A sync in the
# wrong place costs time and protects nothing. (Without the sync, a reused buffer would race across
# steps as well.)
# </details>
#
# The fifth, **the token read**: the D2H copy into `tokens_host` is only *enqueued*; `m.emit(n,
# tokens_host)` reads it at once, before the GPU has run the decoder, so the detokenizer got the
# previous step's tokens (or zeros).
#
# ## 4. See it: the profiler timeline
#
# A few planted steps under `torch.profiler` (on the GPU). Host lane: schedule, launches, host work,
# emit; a gap is the host waiting, in the pageable copy or in `.item()`. GPU lane: kernels and
# copies. Where the profiler records no GPU activity (often so under WSL2, not measured here:
# `docs/facts.md` F18), the timelines replay the recorded run, and the `source` line says why.


# %%
def timeline_planted(steps):
    return l07.timeline({"planted": planted_loop}, steps=steps)


TL_STEPS = 6
PAGEABLE_MEMCPY = "Memcpy HtoD (Pageable -> Device)"
tl_planted = pinlab.measure("07_timeline_planted", timeline_planted, steps=TL_STEPS)
r = tl_planted.result["loops"]["planted"]
share = r["gpu_idle_share"]
pinlab.show(
    "planted: GPU idle share of the window (no kernel running)",
    NO_TRACE if share is None else f"{share:.0%}",
)
pinlab.show("planted: copies by kind", r["memcpy_names"])
pinlab.show(
    "planted: pageable H2D copies per step",
    f"{r['memcpy_names'].get(PAGEABLE_MEMCPY, 0) / TL_STEPS:g}",
)
l07.plot_timelines(tl_planted.result, title=f"host vs GPU ({tl_planted.tag})")
plt.show()

# %% [markdown]
# Each `.item()` hands the turn over: the GPU idles while the host works, and vice versa. Of the
# pageable copies (`Memcpy HtoD (Pageable -> Device)`), one per step is the 8 MiB restore, holding
# the host at least while the driver stages it; the rest (where FlashInfer runs) are `plan()`'s
# small copies, the detector's events elsewhere. Nothing runs ahead.
#
# ## 5. What the fix must do
#
# One change per problem, each from its lesson:
# - **the restore**: offload the LM head into **pinned** memory, with one copy, before the loop
#   (lesson 05), so each restore is truly asynchronous (lesson 02). It stays in the loop, once per
#   step: the LM head is offloaded, and its GPU memory serves other layers in between;
# - **the stop check**: drop the `.item()`; look for `m.eos` on the host, in the tokens it reads
#   anyway (lesson 02);
# - **the snapshot and the race**: give each step in flight **its own pinned metadata buffer**, a
#   ring of `depth` slots, each rewritten only after the event behind its last copy (lesson 04); no
#   `pin_memory()` of a pinned buffer;
# - **the token read**: read each step's tokens from its own pinned slot **after its event** (as in
#   lesson 06's exercise) and before a later step's copy reuses the slot; step k's tokens are
#   delivered a few steps later;
# - **the engine** (not the loop): hand `plan()` **pinned** `indptr` and `last_page_len` nobody
#   rewrites, as vLLM 0.33 does after this PR (`CapstoneModel(..., pin_plan_inputs=True)`, in the
#   fixed loop's GPU runs); `pinlab.paged_kv.FlashInferDecode` then pins its range table too.
#
# The only waits left are the ring's events, which bound how far the host runs ahead.
#
# 🔮 **Predict.** Why does the ring need more than 1 slot, when the host waits for step n+1-depth
# before the scheduler writes step n+1's metadata?
#
# <details><summary>Answer</summary>
#
# With one slot the host would wait every step for the step it just enqueued: the GPU runs dry at
# every wait, as serial as the planted loop. With `depth` slots the host runs up to `depth - 1`
# steps ahead, and a wait on a step that old blocks only when the host is the faster of the two.
# Depth trades a little pinned memory and latency (tokens arrive `depth - 1` steps late) for
# overlap; the checker asks for `depth` >= 2.
# </details>
#
# Writing `fixed_loop(m, steps)` is the exercise (`exercises/07_capstone_audit.ipynb`). Below, the
# reference answer `l07.fixed_loop` (in `pinlab.lessons.l07_capstone_audit`: **spoiler**, read it
# after the exercise).

# %%
# the reference answer (spoiler: read it after the exercise)
fixed_loop = l07.fixed_loop
fixed = l07.run_loop(em, fixed_loop, STEPS)
fc, in_loop = fixed["counts"], sum(fixed["in_loop"].values())
in_all = fc[l07.SYNC] + fc[l07.BLOCKING]
lm_head_ok = fixed["unrestored"] == 0 and fixed["stops_ok"] and fixed["lm_head_ok"]
pinlab.claim(
    f"fixed loop, emulated: corrupted steps (of {STEPS})",
    fixed["corrupted"],
    expect=0,
    why=l07.WHY.emulated,
)
pinlab.claim(
    "fixed loop: pageable copies in its lines",
    fc[l07.PAGEABLE],
    expect=0,
    why=l07.WHY.emulated,
)
pinlab.claim(
    "fixed loop: pin_memory() of a pinned tensor",
    fc[l07.PIN_NOOP],
    expect=0,
    why=l07.WHY.emulated,
)
pinlab.claim(
    "fixed loop: syncs or blocking copies inside the loop",
    in_loop,
    expect=0,
    why=l07.WHY.emulated,
)
pinlab.claim(
    "fixed loop: waits on the newest step's event",
    fc[l07.FULL_WAIT],
    expect=0,
    why=l07.WHY.emulated,
)
pinlab.claim(
    "fixed loop: syncs and blocking copies in all (the "
    "offload before the loop, the final synchronize)",
    in_all,
    expect=2,
    why=l07.WHY.emulated,
)
pinlab.claim(
    "fixed loop: the LM head restored before every "
    "step, every finished step noted, the LM head intact",
    lm_head_ok,
    why=l07.WHY.emulated,
)

# %% [markdown]
# Left: two allowed calls, once each, the offload's blocking copy and the final `synchronize()`
# (`run_loop` also counts `m.stream.synchronize()`, not a torch call; the ring's event waits count
# only when on the newest step enqueued). No step is corrupted on the emulated stream, where every
# race shows.
#
# The audit counts the loop's own lines; the detector, every torch call of the process. Below: the
# fixed loop on the GPU for 20 steps, `plan()` given pinned inputs. The detector skips pinlab's own
# frames, so `l07.detect` names `l07.fixed_loop` as the caller (`detect_stalls(callers=[loop])`) to
# show its calls by their code. It names only the offload into pinned memory (a blocking copy, once,
# before the loop), and no pageable copy anywhere (checked):

# %%
fixed_stalls = pinlab.measure(
    "07_detect_fixed",
    lambda **kw: detect_loop(fixed_loop, **kw),
    steps=20,
    pin_plan_inputs=True,
)
# each line number shown as its code
for line in l07.code_of_lines(fixed_stalls.result["lines"], fixed_loop):
    print(pinlab.timing.wrapped(line, indent=6))
pageable_seen = fixed_stalls.result["counts"].get(PAGEABLE_H2D, 0)
pinlab.claim(
    "fixed loop, the whole process: pageable non_blocking H2D copies the detector saw",
    pageable_seen,
    expect=0,
    value=fixed_stalls.result["elsewhere"] or fixed_stalls.result["counts"],
    why=l07.WHY.plan_copies,
)
for line in fixed_stalls.result["elsewhere"]:
    pinlab.show("  elsewhere", line)

# %% [markdown]
# ## 6. The checker: 1000 steps
#
# The exercise's checker runs a loop for 1000 steps (on the GPU, or on the emulated stream) and
# accepts it only with 0 corrupted steps, 0 pageable copies, no sync or blocking copy inside the
# loop, no wait on an event recorded after the newest step enqueued (`depth` >= 2), every step's
# tokens read after their copy and before a later step's copy reused their slot, every finished step
# noted, the LM head restored before every step and intact at the end. A progress bar (on stderr)
# counts the steps.

# %%
pinlab.claim(
    "the checker accepts fixed_loop",
    checks07.check_fixed_loop.verdict(fixed_loop),
    shown=False,
    why=l07.WHY.checker,
)

# %% [markdown]
# ## 7. Before and after: timeline and steps per second
#
# Both loops on the GPU, the same engine and work per step (the fixed loop with the engine's fix),
# `host_work` at 0.6 ms per step instead of 0.3, as a busier server's: steps per second over 3
# interleaved rounds of 150 steps (the median round; the host's time in the engine's calls clocked
# in the same round, unprofiled), then 6 steps of each under the profiler. Overlap can hide at most
# the smaller of the host's and the GPU's shares of a step.


# %%
def both_loops(**params):
    return l07.before_after({"planted": planted_loop, "fixed": fixed_loop}, **params)


ba = pinlab.measure(
    "07_before_after",
    both_loops,
    timeline_steps=TL_STEPS,
    steps=150,
    rounds=3,
    encoder_ms=1.0,
    decoder_ms=1.0,
    host_ms=0.6,
    pinned_plan=["fixed"],
)
thr, tl = ba.result["throughput"]["loops"], ba.result["timeline"]["loops"]
speedup = thr["fixed"]["steps_per_s"] / thr["planted"]["steps_per_s"]
for name in ("planted", "fixed"):
    pinlab.show(f"{name} loop: steps per second", f"{thr[name]['steps_per_s']:.0f}")
pinlab.observe(
    "the fixed loop ran more steps per second than the planted one",
    speedup > 1,
    value=f"{speedup:.2f}x",
    why=l07.WHY.overlap,
)
pageable_on_timeline = tl["fixed"]["memcpy_names"].get(PAGEABLE_MEMCPY, 0)
pinlab.claim(
    "fixed loop on the timeline: pageable H2D copies, FlashInfer's included",
    pageable_on_timeline,
    expect=0,
    value=tl["fixed"]["memcpy_names"],
    why=l07.WHY.profiler,
)
share = {}
for name in ("planted", "fixed"):
    gpu = l07.span_union_ms(tl[name]["gpu"]) / TL_STEPS if tl[name]["gpu"] else None
    share[name] = (thr[name]["ms_per_step"], thr[name]["host_ms_per_step"], gpu)
    idle = tl[name]["gpu_idle_share"]
    pinlab.show(
        f"{name}: GPU idle share on the timeline",
        NO_TRACE if idle is None else f"{idle:.0%}",
    )
    host_profiled = l07.span_union_ms(tl[name]["host"]) / TL_STEPS
    pinlab.show(
        f"{name}: per step", l07.per_step_line(*share[name][:2], host_profiled, gpu)
    )
step, host, gpu = share["fixed"]
if gpu is not None:
    larger, who = max((host, "the host's"), (gpu, "the GPU's"))
    pinlab.show(
        "what this run shows",
        f"a fixed step took {step:.2f} ms, {step / larger:.2f}x the larger share, "
        f"{who} ({larger:.2f} ms); a planted step took {share['planted'][0]:.2f} ms "
        f"against host + GPU {share['planted'][1] + (share['planted'][2] or 0):.2f} ms",
    )
    pinlab.observe(
        "a fixed step costs about the larger of "
        "the host's share and the GPU's (within 25%)",
        step <= 1.25 * larger,
        value=f"{step:.2f} ms against {larger:.2f} ms",
        why=l07.WHY.shares,
    )

# %%
l07.plot_timelines(ba.result["timeline"], title=f"host vs GPU ({ba.tag})")
plt.show()

# %% [markdown]
# In the planted loop each `.item()` makes the host wait for the GPU's step, so much of the pageable
# copy, launches, GPU work and host work runs in turn (the timelines show what overlapped). In the
# fixed loop the host prepares step n+1 while the GPU runs step n, and the restore is a pinned copy
# the GPU does alone: a step costs at least about the larger of the two shares, plus what neither
# counts (the loop's own calls, hand-offs). The `per step` and `what this run shows` lines give this
# run's numbers; speed up the larger share next. The profiler usually slows the host's calls
# (compare the two host figures), so a host-bound loop can show more GPU idle there than unprofiled.
# The speed-up's noise comes from the host (the spin of `host_work`, launch times), hence the median
# of interleaved rounds. And the planted loop was also *wrong*: no speed makes up for corrupted
# steps.

# %%
del em, planted, fixed
gc.collect()
pinlab.claim(
    "pinned memory held is back to its starting level",
    pinlab.pinned_back_to(pinned_at_start),
    value=pinlab.pinned_bytes_held(),
    why=l07.WHY.pinned,
)

# %% [markdown]
# ## What to remember
# - Audit a loop copy by copy: **where does the source live** (pinned, or a `non_blocking` that may
#   wait), **who rewrites it and when** (before the copy has run, it races), **when is a D2H result
#   read** (only after an event behind its copy).
# - `pin_memory()` of a pinned buffer is that buffer: a snapshot must be a new tensor
#   (`pinlab.pin_snapshot`), or give each step in flight its own slot.
# - A hidden sync (`.item()`, `.tolist()`, `bool()` of a GPU tensor) serialises host and GPU, and
#   protects nothing if it comes after the write that races.
# - Count the copies of the libraries you call: FlashInfer's `plan()` copies its host metadata with
#   `non_blocking=True`; hand it pinned tensors nobody rewrites (vLLM 0.33).
# - Tools: `pinlab.detect_stalls` (copies and syncs, the whole process's), the profiler timeline
#   (who waits for whom), `pinlab.races.detect_races` (the host touching memory a pending copy
#   needs), an exact count of corrupted steps (emulated, no GPU needed); `pytest --pinlab-races
#   --pinlab-stalls` makes the detectors a failing test (`docs/race_gate.md`).
# - A fixed loop waits only on the events that bound its run-ahead, each at least one step older
#   than the newest step enqueued (a wait on the newest is as serial as a sync): honest, and as fast
#   as host and GPU allow.
#
# **Exercise:** `exercises/07_capstone_audit.ipynb`: fix the loop yourself (solution in
# `solutions/`).
