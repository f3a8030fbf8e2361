# %% [markdown]
# # 07 · Capstone: audit an inference loop
#
# **What you will learn**
# - to read an inference loop the way the course taught you: every copy (pinned or pageable? who
#   rewrites its source, and when?), every read of GPU results (after which event?), every place the
#   host waits for the GPU;
# - to find each problem with the tools: `pinlab.detect_stalls`, `pinlab.races.detect_races` and a
#   line-by-line audit of the loop's copies and syncs, the profiler's host-vs-GPU timeline, and an exact
#   count of corrupted steps; and to make the detectors a test that fails (`pytest --pinlab-races`);
# - what a fix must achieve, and how the checker verifies it: 0 corrupted steps over 1000 steps, 0
#   pageable copies (FlashInfer's own included), no sync inside the loop, no wait on the newest step's event
#   (so the host may run at least one step ahead of the GPU), every result read after its copy ran;
# - what the fixes buy: the planted loop and the reference fix side by side, on a timeline and in steps
#   per second.
#
# Everything here uses lessons 02 to 06; this notebook adds no new mechanism, only practice. It shows
# the planted loop and what the tools find in it, not the fixed code (section 5 quotes the one line
# of it the detector names, the offload): writing that is the exercise
# (`exercises/07_capstone_audit.ipynb`). The measurements of the fix run the reference answer from the
# library.

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
#   and leave; each step's `indptr` and `last_page_len` are written by the host, copied to
#   `m.meta_dev[n]` on the GPU, and the page indices are built **on the GPU** from that copy; then
#   paged decode attention runs (FlashInfer's decode kernel on a GPU where it can run, the torch
#   reference elsewhere), then the **LM head** and an argmax give one token per request;
# - an **offloaded LM head** (lesson 05): an 8 MiB weight that lives in host memory and is copied into
#   its GPU buffer `m.lm_head` before every step, as a CPU-offloaded layer is;
# - a **vision encoder** whose rotary position ids are built on the device (lesson 06), followed by
#   about 1 ms of GPU work; the decoder's other layers add about 1 ms more;
# - the host's side: `m.schedule(n, buf)` writes step n's metadata into a host buffer,
#   `m.emit(k, host_tokens)` hands step k's tokens to the detokenizer (it reads them **now**),
#   `m.note_stop(k)` records that a request finished in step k (it produced the end-of-sequence
#   token `m.eos`), and `m.host_work()` is the rest of the host's step (the server, the detokenizer):
#   0.3 ms of CPU.
#
# Here is the loop someone wrote on top of it. It runs, it produces tokens, and it is wrong in five
# places. Read it first, with the lessons in mind.


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
# 🔮 **Predict.** Before running anything: which lines are wrong, and which lesson says why? Write
# down your list; the rest of the notebook checks it.
#
# <details><summary>Answer (lines counted from `def planted_loop`, line 1)</summary>
#
# 1. Line 9 restores an LM head that line 4 offloaded with `.to("cpu")` into **pageable** memory: an
#    8 MiB `non_blocking` copy that the driver stages, holding the host (lessons 02 and 05).
# 2. Line 11 takes `pin_memory()` of a buffer that is already pinned: the same tensor, no snapshot
#    (lesson 04).
# 3. So line 14 rewrites, for step n+1, the buffer that step n's copy (line 12) has not read yet: the
#    race (lesson 03).
# 4. Line 17 hands the detokenizer tokens whose `non_blocking` copy into pinned memory (line 16) has
#    not run yet: read before its event (lesson 02).
# 5. Line 18's `.item()` makes the host wait for the GPU every step (lesson 02).
# </details>
#
# ## 1. Run it, and judge every step
#
# `l07.run_loop(m, loop, steps)` runs the loop and then judges every step exactly: did the metadata
# copy deliver *this* step's `indptr` (compared entry by entry with what the scheduler wrote for
# each step), did `emit()` get the tokens the GPU computed for this step, were the finished steps
# noted, is the LM head intact. A step is **corrupted** when its metadata or its tokens were wrong.
#
# First on the emulated lagging stream, on every machine: its GPU runs queued work only when the
# host waits for it, so it shows exactly what a GPU that lags far enough behind reads (the order is
# exact; it says nothing about time).

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
# The loop "works": it runs to the end and every step hands tokens to the detokenizer. But the GPU
# attended the wrong pages (its copy of `indptr` belonged to the next step; only the last step,
# which schedules nothing after it, got its own), and the host handed the detokenizer tokens the
# GPU had not written yet. Nothing crashed; no test that only looks at shapes would notice.
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
# On a real GPU the count depends on timing: a copy goes wrong when the host rewrites its buffer
# before the GPU has reached it. Here the GPU has about a millisecond of the vision encoder's work
# queued before each metadata copy, and the scheduler rewrites the buffer microseconds later; the
# decoder's work sits before each token copy, and the host reads the tokens at once. The emulated
# count is the worst case a slower GPU, a busier step or a faster host moves towards: a race is a
# bug whatever one run shows.
#
# ## 2. Find the stalls: `pinlab.detect_stalls`
#
# The detector (lesson 02b) watches every torch call of the process while the loop runs (the loop's,
# the engine's, FlashInfer's) and reports the copies and syncs that make the host wait for the GPU,
# with the line that made them (shown here as that line's code). Run on the GPU for 20 steps,
# the engine handing FlashInfer's `plan()` pageable host metadata, as vLLM 0.29 does:


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
# - **the restore** `m.lm_head.copy_(m.lm_head_host, non_blocking=True)`, a pageable `non_blocking`
#   copy of 8 MiB, every step: `m.lm_head.to("cpu")` offloaded the LM head into *pageable* memory, so
#   each restore is the fake `non_blocking` of lesson 02: the host waits while the driver stages 8 MiB
#   through its own pinned buffer (how long, and whether also for the GPU, is the driver's choice and
#   undocumented: the CUDA Runtime API's "API synchronization behavior" page says only that such a
#   copy may be synchronous);
# - **the stop check** `tokens.eq(m.eos).any().item()`, every step: `.item()` reads a GPU value into
#   Python, so the host waits for *all* the work queued so far. Host and GPU take turns instead of
#   overlapping.
#
# The blocking copy of the offload, `m.lm_head.to("cpu")`, runs once, before the loop: offloading is
# allowed to wait.
#
# The events outside the loop's own lines (the `elsewhere` lines name their file) come, where
# FlashInfer runs, from its `plan()`: every step it copies the host `indptr` and `last_page_len` it
# is given, and a small range table it keeps itself, to the GPU with `non_blocking=True`. The engine
# hands it pageable tensors (as vLLM 0.29 did), so these are pageable copies too, made by no line
# of the loop: small, so the driver stages them and they usually return at once, but each costs the
# host its staging, and each may wait once the driver's staging pool is full. vLLM 0.33 pins them;
# the engine's fix below does the same.
#
# The detector sees copies and syncs, not races: it does not know that `m.schedule(n + 1, meta)`
# rewrites `meta` while step n's copy `m.meta_dev[n].copy_(snap, non_blocking=True)` may still be
# waiting in the GPU's queue, nor that `m.emit(n, tokens_host)` reads `tokens_host` before the copy
# `tokens_host.copy_(tokens, non_blocking=True)` has run. For those, the race detector.
#
# ## 2b. Find the races: `detect_races`, and a test that fails
#
# Lesson 03's `pinlab.races.detect_races()` reports the host touching memory that a pending copy
# has not finished with. Run the planted loop under it for 20 steps, on the emulated stream (so the
# counts are exact on every machine; on a GPU they depend on how far behind it is), with the loop's
# own lines as the report's lines (`callers=[planted_loop]`, as for `detect_stalls`):

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
# Both races, with their lines: the metadata copy (line 12) whose source the scheduler rewrote (the
# report names where the detector first saw the new bytes: `m.schedule` writes through numpy, which
# the detector sees at the next torch call), and the token copy (line 16) that `m.emit` read on
# line 17. The last step schedules nothing after it, hence 19 and 20.
#
# A detector you must remember to run finds nothing. The course's pytest plugin runs it over a test
# suite: `pytest --pinlab-races` fails every test whose code races, with this report (and
# `--pinlab-stalls` every test that stalls; `docs/race_gate.md` shows how a team adopts it). The
# sample suite `examples/race_gate` writes one step loop three ways: racy, with a snapshot, with an
# event-guarded ring. Plain `pytest` passes all three (read `test_step_loop.py`: the racy test asserts
# nothing, since what a race delivers changes from run to run); the gate is what fails it.

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
# `run_loop` ran the loop under `l07.LoopAudit`, which records, per line of the loop, every
# pageable `non_blocking` H2D copy, blocking copy, host sync, every `pin_memory()` of a tensor that
# is already pinned, and every wait on an event recorded after the newest step the host had
# enqueued (a full wait: no later step queued behind it); it also notes whether the LM head was
# restored before each step's decode. It works on the emulated stream too; these are the counts of
# the emulated run above (on the GPU they are the same: they count calls, not time):

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
# The third problem: **the snapshot** `snap = meta.pin_memory()`. `meta` is already pinned, and
# `pin_memory()` of a pinned tensor returns **the same storage** (lesson 04's trap): `snap` is
# `meta`, no snapshot at all. Hence the fourth, the race the snapshot was meant to prevent (lesson
# 03): `m.meta_dev[n].copy_(snap, non_blocking=True)` copies from the buffer that
# `m.schedule(n + 1, meta)` rewrites for step n+1, while step n's copy still waits behind the vision
# encoder's GPU work.
#
# 🔮 **Predict.** The stop check's `.item()` makes the host wait for the GPU every step. Doesn't
# that wait save the metadata copy?
#
# <details><summary>Answer</summary>
#
# No. The wait comes *after* `m.schedule(n + 1, meta)` has rewritten `meta`. Within one step the GPU
# is still busy with the vision encoder when the host reaches the scheduler, so the copy that was
# enqueued before it reads step n+1's metadata. A sync in the wrong place costs time and protects
# nothing. (And once you remove the sync, a reused buffer would race across steps as well.)
# </details>
#
# The fifth: **the token read**. `tokens_host.copy_(tokens, non_blocking=True)`, a device-to-host copy
# into pinned memory, is only *enqueued*; `m.emit(n, tokens_host)` reads `tokens_host` at once,
# before the GPU has run the decoder. The detokenizer got the previous step's tokens (or zeros). Read
# a D2H result only after an event recorded behind its copy has completed.
#
# ## 4. See it: the profiler timeline
#
# A few steps of the planted loop under `torch.profiler` (on the GPU): the host lane shows the
# engine's host work (schedule, launches, host work, emit); a gap in it is the host waiting, in the
# pageable copy or in `.item()`. The GPU lane shows kernels and copies. Where the profiler records
# no GPU activity (often so under WSL2, not measured here: `docs/facts.md` F18), the timelines
# replay the recorded run, and the `source` line says why.


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
# The GPU sits idle while the host does its host work, and the host sits idle while the GPU runs:
# each `.item()` hands the turn from one to the other. The pageable copies appear as
# `Memcpy HtoD (Pageable -> Device)`: one per step is the 8 MiB restore of the LM head, which holds the host
# at least while the driver stages it; the others (where FlashInfer runs) are the small copies its
# `plan()` makes from the pageable metadata the engine gives it, the detector's events elsewhere.
# Together, the stalls give the loop its shape: nothing runs ahead, host and GPU mostly take turns.
#
# ## 5. What the fix must do
#
# One change per problem, each from its lesson:
# - **the restore** (`m.lm_head.copy_(m.lm_head_host, non_blocking=True)`): offload the LM head into
#   **pinned** memory, with one copy, before the loop (lesson 05); then each step's restore is a true
#   asynchronous copy (lesson 02). The restore stays inside the loop, once per step: the engine offloads
#   the LM head, and its GPU memory serves other layers in between;
# - **the stop check** (`tokens.eq(m.eos).any().item()`): drop the `.item()`; look for the
#   end-of-sequence token in the tokens the host reads anyway, on the host (lesson 02);
# - **the snapshot and the race** (`snap = meta.pin_memory()`, the metadata copy, `m.schedule(n + 1,
#   meta)`): give each step in flight **its own pinned metadata buffer**: a ring of `depth` slots, each
#   rewritten only after the event recorded behind its last copy has completed (lesson 04). No
#   `pin_memory()` of a pinned buffer;
# - **the token read** (`m.emit(n, tokens_host)` right after the D2H copy): read each step's tokens
#   from its own pinned slot **after its event** (lesson 04's event, used for a D2H copy, as in lesson
#   06's exercise), and before a later step's copy reuses the slot; the host delivers step k's tokens a
#   few steps later;
# - **the engine** (not the loop): hand FlashInfer's `plan()` **pinned** host `indptr` and
#   `last_page_len` that nobody rewrites, as vLLM 0.33 does after this PR (`CapstoneModel(...,
#   pin_plan_inputs=True)`; the GPU runs of the fixed loop below use it). `pinlab.paged_kv.
#   FlashInferDecode` then hands `plan()` its range table pinned too: no pageable copy is left.
#
# The only waits left are the ring's events, which bound how far the host runs ahead.
#
# 🔮 **Predict.** Why does the ring need more than 1 slot, when the host waits for step n+1-depth
# before the scheduler writes step n+1's metadata?
#
# <details><summary>Answer</summary>
#
# With one slot the host would wait, every step, for the step it just enqueued: no later step is
# queued behind that event, the GPU runs dry at every wait, and the loop is as serial as the planted
# one. With `depth` slots the host runs up to `depth - 1` steps ahead of the GPU, and only a wait on
# a step `depth - 1` steps old can block it, which happens only when the host is the faster of the
# two. Depth trades a little pinned memory and latency (tokens are delivered `depth - 1` steps late)
# for overlap; the checker asks for at least one step of run-ahead (`depth` >= 2).
# </details>
#
# The exercise (`exercises/07_capstone_audit.ipynb`) asks you to write `fixed_loop(m, steps)`. The
# rest of this notebook measures the reference answer, `l07.fixed_loop`, which lives in
# `pinlab.lessons.l07_capstone_audit`: **spoiler**, read its source after the exercise.

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
# What is left runs once: the blocking copy of the offload before the loop and the final
# `synchronize()` after it, both allowed (`run_loop` also counts `m.stream.synchronize()` calls, which
# are no torch calls; waits on events are the ring's, and are counted only where the host waits on
# the newest step it has enqueued). On the emulated stream, where every race shows, no step is
# corrupted; the checker below runs the loop for 1000 steps on this machine's stream (the GPU when
# there is one).
#
# The audit counts the loop's own lines. End to end, the detector counts every torch call of the
# process, FlashInfer's included: the fixed loop on the GPU for 20 steps, the engine handing
# `plan()` pinned inputs (the engine's fix). `l07.fixed_loop` lives in pinlab, whose own frames the
# detector skips; `l07.detect` names the loop as the caller (`detect_stalls(callers=[loop])`), so
# its calls are shown by their code, as the planted loop's were. It names only what the fix allows,
# the offload of the LM head into pinned memory: a blocking copy, once, before the loop; and no
# pageable copy anywhere (checked):

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
# loop, no wait on an event recorded after the newest step the host had enqueued (so the host may run
# at least one step ahead: `depth` >= 2), every step's tokens read after their copy and before a later
# step's copy reused their slot, every finished step noted, the LM head restored before every step
# and intact at the end. A progress bar (on stderr) counts the steps as they are decoded.

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
# Both loops on the GPU, the same engine and work per step (the fixed loop's runs with the engine's fix), with
# the host's own work (`host_work`) at 0.6 ms per step instead of 0.3, as a busier server's: steps
# per second in 3 interleaved rounds of 150 steps (the median round; the host's time in the
# engine's calls is clocked in the same round, without the profiler), then 6 steps of each under the
# profiler. Running the host's work while the GPU works, instead of in turn with it, can hide at most
# the smaller of the two shares of a step.


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
# In the planted loop a step costs the pageable copy, plus the host's launches, plus the GPU's work,
# plus the host's own work: each `.item()` makes the host wait for the GPU's step before it starts
# the next, so much of the work runs in turn, not all of it (the timelines below show what overlapped
# in this run; the `what this run shows` line compares a planted step with host + GPU). In the fixed loop the host prepares step n+1
# while the GPU runs step n, and the LM head's restore is a pinned copy the GPU does on its own: a
# step costs at least about the larger of the host's share and the GPU's, and more by what neither
# share counts (the loop's own calls, the hand-offs between host and GPU). The `per step` and `what
# this run shows` lines compare them for this run: which share is the larger decides what to speed
# up next. The timelines show where the time goes; under the profiler the host's calls usually take
# longer than without it (compare the two host figures above), so a host-bound loop can show more
# GPU idle there than in the unprofiled rounds. The speed-up's noise comes from the host side (the
# spin of `host_work`, launch times), which is why it is the median of interleaved rounds. And the
# speed-up is the smaller half of the story: the planted loop was also *wrong*, and no speed makes
# up for corrupted steps.

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
# - Audit a loop copy by copy: **where does the source live** (pinned, or a `non_blocking` that may wait),
#   **who rewrites it and when** (before the copy has run, it races), and **when is a D2H result
#   read** (only after an event behind its copy).
# - `pin_memory()` of a pinned buffer is that buffer: a snapshot must be a new tensor
#   (`pinlab.pin_snapshot`), or give each step in flight its own slot.
# - A hidden sync (`.item()`, `.tolist()`, `bool()` of a GPU tensor) serialises host and GPU, and
#   protects nothing if it comes after the write that races.
# - Count the copies of the libraries you call too: FlashInfer's `plan()` copies the host metadata it
#   is given with `non_blocking=True`; hand it pinned tensors nobody rewrites (vLLM 0.33).
# - Tools: `pinlab.detect_stalls` for copies and syncs (the whole process's), the profiler timeline
#   for who waits for whom, `pinlab.races.detect_races` for the host touching memory a pending copy
#   still needs, and an exact count of corrupted steps (on the emulated stream, without a GPU).
# - Make the detectors a test that fails: `pytest --pinlab-races --pinlab-stalls` on your suite
#   (`docs/race_gate.md`).
# - A fixed loop waits only on the events that bound its run-ahead, each at least one step older than
#   the newest step it has enqueued (a wait on the newest is as serial as a sync): honest, and as fast
#   as the host and the GPU let it be (the steps-per-second line says how much faster in your run).
#
# **Exercise:** `exercises/07_capstone_audit.ipynb` asks you to fix the loop yourself (solution in `solutions/`).
