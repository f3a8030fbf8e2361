# %% [markdown]
# # 03 · The race
#
# **What you will learn**
# - paged-KV metadata (`indptr`, `indices`, `last_page_len`) and vLLM's async scheduling;
# - why a `non_blocking` copy from a **reused pinned** buffer then delivers the wrong step's data
#   (in FlashInfer decode: the wrong pages), and how `pinlab.races.detect_races()` catches it;
# - what a correct **pageable** buffer costs, and *where* its host waits;
# - how many launches CUDA's launch queue holds before a launch call blocks.

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
import time

import matplotlib.pyplot as plt
import torch

import pinlab
from pinlab import lead, paged_kv, steploop
from pinlab.lessons import l03_the_race as l03
from pinlab.plots import fmt_bytes, timeline

pinlab.header("03 the race")
pinned_at_start = pinlab.pinned_baseline()

# %% [markdown]
# ## Primer: a paged KV cache in one figure
#
# A decoder keeps the keys and values of every token seen, per request: its **KV cache**. A
# **paged KV cache** (vLLM's PagedAttention) stores them in **pages** of `page_size` tokens taken
# from one pool as a request grows, so its pages need not be adjacent; each request's row of the
# **block table** lists them in order. The attention kernel finds a batch's pages through three
# int32 arrays, the **paged-KV metadata** (FlashInfer's CSR form):
#
# - `indices`: the page ids of request 0, then of request 1, and so on;
# - `indptr` (B+1 entries for B requests): 0, then the running sum of pages per request, so
#   request *r*'s pages are `indices[indptr[r]:indptr[r+1]]`;
# - `last_page_len` (B entries): the tokens in each request's last page (1 to `page_size`; 0 only
#   for an empty request).
#
# **FlashInfer**, vLLM's attention-kernel library here, decodes in two calls:
# `plan(indptr, indices, last_page_len, ...)`, once per step before the forward, prepares the
# work split from host copies of `indptr` and `last_page_len` (and copies them to the GPU itself);
# `run(q, kv_cache)`, per attention layer, launches the kernel that reads the pages. **MRV2**,
# vLLM's **Model Runner V2** (`vllm/v1/worker/gpu/`), builds each step's inputs on the CPU (token
# ids, positions, this metadata), copies them to the GPU and launches the forward.
#
# Three requests of 6, 9 and 3 tokens, pages of 4 tokens, 8 pages (`pinlab.paged_kv` computes
# the metadata as vLLM does):

# %%
PAGE_SIZE, CACHE_PAGES = 4, 8
seq_lens = torch.tensor([6, 9, 3], dtype=torch.int32)  # tokens so far, per request
block_table = torch.tensor(
    [[5, 1, 0], [2, 6, 3], [4, 0, 0]],  # each row: that request's pages
    dtype=torch.int32,
)  # (columns past its last page: unused)
meta = paged_kv.build_metadata(block_table, seq_lens, PAGE_SIZE)
print("indptr:       ", meta.indptr_cpu.tolist())
print("indices:      ", meta.indices.tolist())
print("last_page_len:", meta.last_page_len_cpu.tolist())

# %%
l03.plot_paged_kv(
    meta.indptr_cpu,
    meta.indices,
    meta.last_page_len_cpu,
    PAGE_SIZE,
    CACHE_PAGES,
    title="Three requests in a paged KV cache of "
    f"{CACHE_PAGES} pages of {PAGE_SIZE} tokens",
)
plt.show()
ip, ix, lpl = (
    meta.indptr_cpu.tolist(),
    meta.indices.tolist(),
    meta.last_page_len_cpu.tolist(),
)
for r in range(len(lpl)):
    pages = ix[ip[r] : ip[r + 1]]
    print(
        f"request {r}: pages indices[{ip[r]}:{ip[r + 1]}] = "
        f"{pages}, {len(pages) - 1} full page(s) + {lpl[r]} token(s) "
        f"= {(len(pages) - 1) * PAGE_SIZE + lpl[r]} tokens"
    )
reads_back = all(
    ix[ip[r] : ip[r + 1]] == block_table[r, : ip[r + 1] - ip[r]].tolist()
    and (ip[r + 1] - ip[r] - 1) * PAGE_SIZE + lpl[r] == int(seq_lens[r])
    for r in range(len(lpl))
)
pinlab.claim(
    "every request's pages and token count read back from the three arrays",
    reads_back,
    why=l03.WHY.exact,
)

# %% [markdown]
# 🔮 **Predict.** Request 0 decodes three more tokens (9 in all) and gets page 7 when page 1 is
# full. Which of the three arrays change?
#
# <details><summary>Answer</summary>
#
# All three: `indices` gains page 7 after pages 5 and 1, each `indptr` entry after the first grows
# by one (`[0, 3, 6, 7]`), and request 0's `last_page_len` becomes 1 (9 = 2 full pages + 1). So an
# engine rebuilds `indptr` and `last_page_len` on the host and copies them to the GPU every step.
# </details>

# %%
grown = paged_kv.build_metadata(
    torch.tensor([[5, 1, 7], [2, 6, 3], [4, 0, 0]], dtype=torch.int32),
    torch.tensor([9, 9, 3], dtype=torch.int32),
    PAGE_SIZE,
)
print("indptr:       ", meta.indptr_cpu.tolist(), "->", grown.indptr_cpu.tolist())
print("indices:      ", meta.indices.tolist(), "->", grown.indices.tolist())
print(
    "last_page_len:",
    meta.last_page_len_cpu.tolist(),
    "->",
    grown.last_page_len_cpu.tolist(),
)

# %% [markdown]
# ## Async scheduling in Model Runner V2 (MRV2)
#
# With async scheduling a vLLM engine starts step N+1 before step N's result is back: a small
# **batch queue** (`max_concurrent_batches`: 2 without pipeline parallelism) waits only when full,
# for the *oldest* step's output. MRV2 adds no other host sync between steps, so the CPU runs
# ahead:
#
# ```
# CPU:  [build step 1][build step 2]   (wait for step 0's output) [build step 3] ...
# GPU:        [ step 0 forward .............][ step 1 forward .............][ step 2 ...
# ```
#
# Step N's inputs reach the GPU through `gpu_buf.copy_(host_buf, non_blocking=True)`. From pinned
# memory the call only *enqueues* a DMA, which reads `host_buf` when the stream gets to it.
#
# In vLLM's FlashInfer backend (`vllm/v1/attention/backends/flashinfer.py`), `indptr` and
# `last_page_len` are computed on the host into **persistent** buffers and copied to the GPU every
# step; the page indices are then built *on the GPU* from that copy of `indptr`. If the host
# buffer is pinned and reused, who wins: step N's DMA, or step N+1's write?

# %% [markdown]
# ## The race in a timeline model
#
# `steploop.simulate` models the step loop exactly (ms, no GPU): per step the host writes the
# buffer (0.1 ms), enqueues the copy and launches the forward (0.1 ms); the GPU runs each copy
# (0.05 ms) when it reaches it, then that step's forward (1 ms).
#
# 🔮 **Predict.** Six steps through one reused pinned buffer. Which step's data does each copy
# deliver?
#
# <details><summary>Answer</summary>
#
# Copy 0 runs at once (the GPU is idle): step 0. Each later copy waits behind a 1 ms forward, by
# when the host has written all six steps: copies 1 to 5 deliver step 5.
# </details>

# %%
sim = steploop.simulate(
    "reused_pinned", steps=6, host_ms=0.1, launch_ms=0.1, copy_ms=0.05, gpu_ms=1.0
)
timeline(
    {"host": sim["host"], "GPU": sim["gpu"]}, title="One reused pinned buffer (model)"
)
plt.show()
print(
    "takeaway: every copy that waited behind a "
    "forward delivered the last step the host wrote:",
    all(r == sim["received"][-1] for r in sim["received"][1:]),
)

# %%
print("copy n delivered the data of step:", sim["received"])
print(
    "copies that delivered the wrong step:",
    sim["corrupted"],
    "of",
    len(sim["received"]),
)

# %% [markdown]
# Nothing fails, nothing warns: the GPU computes with the wrong step's data. The race needs the
# host *ahead*; with a forward that keeps up, the buffer is safe:

# %%
fast = steploop.simulate(
    "reused_pinned", steps=6, host_ms=0.1, launch_ms=0.1, copy_ms=0.05, gpu_ms=0.01
)
print("GPU keeps up: copy n delivered step:", fast["received"])
print(
    "the race needs a GPU that is behind the host:",
    fast["corrupted"] == 0 and sim["corrupted"] > 0,
)

# %% [markdown]
# So the bug hides in a synchronous loop, or whenever the GPU is idle; it shows when the host runs
# ahead, as async scheduling intends.
#
# ## The step loop, in code
#
# Each step writes its number into a small host buffer (a stand-in for `indptr`), enqueues
# `copy_(non_blocking=True)` into its row on the device, and keeps the GPU busy 0.5 ms (`s.busy`:
# the rest of the forward). At the end we read back which step's data each row got.


# %%
def step_loop(s, host_buf, steps=200, busy_ms=0.5):
    """Async scheduling in miniature: which step's
    data did each copy deliver? (-1: a mix)"""
    dst = torch.zeros(steps, host_buf.numel(), dtype=host_buf.dtype, device=s.device)
    for n in range(steps):
        host_buf.fill_(n)  # the host writes step n's inputs
        # returns at once: it only enqueues the copy
        dst[n].copy_(host_buf, non_blocking=True)
        s.busy(busy_ms)  # the GPU runs step n's forward
    s.synchronize()  # only now does the host wait for the GPU
    return [row[0] if min(row) == max(row) else -1 for row in dst.tolist()]


# %% [markdown]
# `pinlab.stream()` (lesson 02, section 5) is the CUDA stream on a GPU; without one, an
# **emulated lagging stream**, a GPU far behind the host, whose results say "emulated".
#
# 🔮 **Predict.** The same loop with a reused **pinned** and a reused **pageable** buffer: which
# delivers every step its own data?
#
# <details><summary>Answer</summary>
#
# The pageable one: staged during the call (lesson 02), it is out of reach of the host's next
# write. The pinned buffer is read when the copy runs, after later writes: as in the model, copies
# deliver another step's data.
# </details>

# %%
with pinlab.stream() as s:
    reused = step_loop(s, torch.zeros(64, dtype=torch.int32, pin_memory=True))
    pageable_rows = step_loop(s, torch.zeros(64, dtype=torch.int32))
wrong = [n for n, r in enumerate(reused) if r != n]
pinlab.show("stream", s.label)
pinlab.show(
    "reused pinned buffer: copies that delivered another step's data",
    f"{len(wrong)} of {len(reused)}",
)
pinlab.show(
    "reused pinned buffer: the step whose data copies 0-7 delivered", reused[:8]
)
# the GPU is 0.5 ms behind per step, the host needs
# tens of µs: a wide lead, on any GPU, quiet or shared
own_data = pageable_rows == list(range(len(pageable_rows)))
lead.claim(
    "the reused pinned buffer delivered another step's data at least once",
    len(wrong) >= 1,
    value=f"{len(wrong)} of {len(reused)}",
    why=l03.WHY.host_ahead,
)
pinlab.claim(
    "the pageable buffer delivered every step its own data",
    own_data,
    why=l03.WHY.staged,
)

# %% [markdown]
# The race's line is a `[measured]` one: `lead.claim` asserts an effect that needs the host ahead
# of the GPU. It fails as `pinlab.claim` does where the effect did not show, except under
# `CUDA_LAUNCH_BLOCKING=1` (the heisenbug, below), where it says the launches blocked.
#
# ### Catch it in the act: `detect_races`
#
# Nothing raised, and no PyTorch tool reports this race: its CUDA sanitizer
# (`torch.cuda._sanitizer`) follows CUDA tensors only, and the host buffer is a CPU tensor. The
# course's `pinlab.races.detect_races()` keeps a copy of the bytes each pending `non_blocking` H2D
# copy should read; before each later torch call touching that memory it asks the copy's event
# whether it has run: if not, and the bytes changed, the host rewrote a pending copy's source.
# Wrap the loop in it:

# %% tags=["nbval-ignore-output"]
from pinlab.races import detect_races

with pinlab.stream() as s:
    with detect_races() as races:
        rows = step_loop(
            s, torch.zeros(64, dtype=torch.int32, pin_memory=True), steps=50
        )
    with detect_races() as races_pageable:
        step_loop(s, torch.zeros(64, dtype=torch.int32), steps=50)
print(races)

# %%
# one copy per step: ordinal = step
wrong, flagged = {n for n, r in enumerate(rows) if r != n}, set(races.raced)
pinlab.show("stream", s.label)
pinlab.show(
    "steps whose data arrived wrong / steps the detector flagged",
    f"{len(wrong)} / {len(flagged)} of 50",
)
lead.claim(
    "the detector flagged the reused pinned buffer",
    len(flagged) >= 1,
    value=f"{len(flagged)} of 50 steps",
    why=l03.WHY.host_ahead,
)
pinlab.claim(
    "steps whose data arrived wrong and were not flagged",
    len(wrong - flagged),
    expect=0,
    value=sorted(wrong - flagged),
    why=l03.WHY.detector_miss,
)
pinlab.claim(
    "the pageable buffer: races flagged",
    races_pageable.total,
    expect=0,
    why=l03.WHY.detector_false,
)

# %% [markdown]
# It may also flag a step whose data arrived right (a copy pending when the host rewrote its
# buffer, run before the write landed): the race, lost by luck. `print(races)` names the copy's
# line, the line that rewrote its source, and the fix. Lesson 04 runs every fix under it; lesson
# 07 makes it a failing test.

# %% [markdown]
# ### The heisenbug: `CUDA_LAUNCH_BLOCKING=1`
#
# Debugging a CUDA error, you set `CUDA_LAUNCH_BLOCKING=1`: every launch and copy waits until the
# GPU has run it. The host never runs ahead, the race cannot happen, and a detector asking "has
# this copy run yet?" (the one above) finds nothing, though the code is as wrong as before.
# `pinlab.detect_races()` judges by **order** instead: a copy's buffer stays off limits until the
# host orders it (its event's `synchronize()`, the stream's, `.item()`, ...), run or not. CUDA
# reads the variable at start, so `l03.heisenbug` runs the loop in a fresh process with it set,
# under each detector (without CUDA: the emulated stream at lag 0, a GPU that keeps up):

# %%
hb = l03.heisenbug(steps=50)
pinlab.show("stream in the child", hb["stream"])
pinlab.show(
    "steps whose data arrived wrong / timing "
    "findings / copies that can race by order (raced)",
    f"{hb['wrong']} / {hb['timing']} / {hb['order']} ({hb['raced']}) of {hb['steps']}",
)
pinlab.claim(
    "the GPU kept up (launches block): steps whose data arrived wrong",
    hb["wrong"],
    expect=0,
    why=l03.WHY.launch_blocking,
)
pinlab.claim(
    "the GPU kept up (launches block): races the timing verdict found",
    hb["timing"],
    expect=0,
    why=l03.WHY.launch_blocking,
)
pinlab.claim(
    "copies the order verdict says can race",
    hb["order"],
    expect=hb["steps"] - 1,
    why=l03.WHY.by_order,
)

# %% [markdown]
# The order verdict names the race in every run, GPU far behind, keeping up, or under
# `CUDA_LAUNCH_BLOCKING=1`: what a test needs (lesson 07's pytest gate judges by order). Run
# this notebook with the variable set and each `lead.claim` above says the launches blocked.

# %% [markdown]
# On the emulated stream nothing runs before the final `synchronize()`, so every copy of the step
# loop reads the last step; a real GPU runs a few copies early.
#
# ## This loop, for every strategy, measured on the GPU
#
# `l03.plain_race` runs it on the GPU through `pinlab.steploop.every_strategy` (the loop written
# once for every staging strategy lesson 04 compares, timing the host's copy section): 200 steps,
# 256 bytes, the GPU busy 0.5 ms per step, a reused pinned and a reused pageable buffer. Without
# CUDA, the course's recorded GPU run is replayed.

# %%
plain = pinlab.measure(
    "03_plain_race",
    l03.plain_race,
    strategies=["reused_pinned", "pageable"],
    steps=200,
    nbytes=256,
    busy_ms=0.5,
)

# %%
l03.plot_received(
    plain.result["runs"], title=f"Which step's data each copy delivered ({plain.tag})"
)
plt.show()
pinlab.show(
    "takeaway: steps that got another step's data, reused pinned / pageable",
    " / ".join(
        f"{plain.result['runs'][k]['corrupted']} of {plain.result['runs'][k]['steps']}"
        for k in ("reused_pinned", "pageable")
    ),
)

# %%
pinned, pageable = (
    plain.result["runs"]["reused_pinned"],
    plain.result["runs"]["pageable"],
)
pinlab.show(
    "reused pinned buffer: corrupted steps",
    f"{pinned['corrupted']} of {pinned['steps']} ({pinned['rate']:.1%}); "
    f"the first at step {pinned['first_corrupted']}",
)
# each step adds 0.5 ms of GPU work and tens of µs of host work, so the host's lead
# grows: after a host stall (another process, the OS) only the next copy or two
# can find the GPU caught up
lead.claim(
    "the reused pinned buffer corrupted at least one step",
    pinned["corrupted"] >= 1,
    value=pinned["corrupted"],
    why=l03.WHY.host_ahead,
)
lead.claim(
    "the reused pinned buffer corrupted more than half of the steps",
    pinned["corrupted"] > pinned["steps"] // 2,
    value=f"{pinned['corrupted']} of {pinned['steps']}",
    why=l03.WHY.host_ahead,
)
pinlab.claim(
    "the pageable buffer, corrupted steps",
    pageable["corrupted"],
    expect=0,
    why=l03.WHY.staged,
)

# %% [markdown]
# A point above the diagonal is a copy that delivered a later step's data; where the pinned
# points flatten at the last step, the host had finished its loop before those copies ran. The
# pageable buffer sits on the diagonal (why, and at what price, below).
#
# ## Real attention: FlashInfer decode over the wrong pages
#
# Does the race break real attention? `l03.decode_race` runs a decode loop shaped like vLLM's:
#
# - 64 steps; requests grow a token a step, join and leave (`pinlab.decode_loop.decode_schedule`),
#   so `indptr` and `last_page_len` change every step; the host writes them into **one reused
#   metadata buffer**, copied to the GPU with `non_blocking=True`;
# - page indices are built **on the GPU** from that copy of `indptr` and the block table
#   (`pinlab.paged_kv.page_indices`, as vLLM's Triton kernel does);
# - FlashInfer's `plan()` gets host `indptr`/`last_page_len` (its own copies) and the GPU indices,
#   `run()` computes decode attention; the GPU is kept 3 ms busy per step (the rest of the
#   forward, keeping the host ahead on most steps, as in an engine);
# - outputs are compared with `pinlab.paged_kv.reference_decode`, an fp32 torch reference fed the
#   *correct* metadata.
#
# Three details keep it honest and alive. The host waits for step N-2 before building step N,
# like a batch queue of depth 2: a run-ahead of 1 (**run-ahead k**: the host may write step N+k's
# data while the GPU has not yet run step N's copy; a ring of pinned buffers for run-ahead k needs
# k + 1 buffers). It cycles through three FlashInfer wrappers, so none is re-planned before its
# previous plan has run: `plan()` reuses a pinned buffer too, and one wrapper shared with the host
# ahead can crash or hang the CUDA context (lesson 04 tests that, in a separate process). And a
# wrong `indptr` is clamped into a well-formed one on the GPU (`pinlab.decode_loop.safe_indptr`):
# PyTorch checks index bounds *on the device*, and a failed device-side assert would kill the
# context too. It still gives wrong pages, never reads outside the cache.
#
# 🔮 **Predict.** Will every step with a corrupted copy also attend over wrong pages?
#
# <details><summary>Answer</summary>
#
# Not necessarily. If the overwriting step has the same `indptr` (no request crossed a page
# boundary, joined or left), the wrong copy carries the right pages. Both are counted below.
# </details>

# %%
print("FlashInfer compiles its decode kernel the first time it is used (JIT);")
print("how long that took is shown below. A replay of a recorded run skips it.")
dec = pinlab.measure(
    "03_decode_race",
    l03.decode_race,
    strategies=["reused_pinned", "pageable"],
    steps=64,
    busy_ms=3.0,
    ring=3,
    run_ahead=1,
    seed=0,
)

# %%
pinlab.show("attention backend", dec.result["backend"])
pinlab.show("why not FlashInfer", dec.result["fallback_reason"] or "FlashInfer ran")
pinlab.show("FlashInfer first plan+run (JIT or cache load), s", dec.result["jit_s"])
pinlab.show(
    "requests joined / left during the run",
    f"{dec.result['joins']} / {dec.result['leaves']}",
)

# %% [markdown]
# If the backend above says `torch`, FlashInfer could not run where this was recorded (not
# installed, or its JIT build failed: reason above), so the loop used
# `pinlab.decode_loop.torch_paged_decode`, a batched paged attention in plain torch that reads the
# **GPU copies** of `indptr` and `last_page_len`: the race shows the same way.

# %%
tol = dec.result["tol"]
l03.plot_errors(
    dec.result,
    "reused_pinned",
    title=f"Reused pinned buffer: error per request and step ({dec.tag})",
)
plt.show()
pinlab.show(
    "takeaway: reused pinned, steps whose attention read wrong pages",
    f"{dec.result['runs']['reused_pinned']['wrong_input_steps']} "
    f"of {dec.result['steps']}",
)

# %%
bad, good = dec.result["runs"]["reused_pinned"], dec.result["runs"]["pageable"]
steps = dec.result["steps"]
pinlab.show(
    "reused pinned: copies that delivered another step's metadata",
    f"{bad['copies_wrong']} of {steps}",
)
pinlab.show(
    "reused pinned: steps whose attention read wrong pages (this run)",
    f"{bad['wrong_input_steps']} of {steps} ({bad['wrong_input_steps'] / steps:.0%})",
)
pinlab.show(
    "reused pinned: requests that read wrong pages",
    f"{bad['wrong_input_requests']} of {bad['requests']}",
)
pinlab.show(
    "their error against the reference (median, max)",
    f"{bad['median_err_wrong_inputs']}, {bad['max_err_wrong_inputs']}",
)
# the GPU is kept 3 ms busy per step behind a host
# that needs well under 1 ms: a wide lead on any GPU
right_err = max(bad["max_err_right_inputs"], good["max_err_right_inputs"])
lead.claim(
    "reused pinned buffer: some copy delivered another step's metadata",
    bad["copies_wrong"] >= 1,
    value=bad["copies_wrong"],
    why=l03.WHY.behind,
)
lead.claim(
    "reused pinned buffer: the attention read wrong pages on at least one step",
    bad["wrong_input_steps"] >= 1,
    value=bad["wrong_input_steps"],
    why=l03.WHY.behind,
)
pinlab.claim(
    "pageable buffer: steps whose attention read wrong pages",
    good["wrong_input_steps"],
    expect=0,
    why=l03.WHY.staged,
)
pinlab.claim(
    "every request whose attention read the right "
    f"inputs matched the reference within {tol}",
    right_err <= tol,
    value=right_err,
    why=l03.WHY.fp16,
)

# %% [markdown]
# Each red dot is a request whose attention read another request's pages, or another step's
# layout of the batch: not its attention at all, and nothing raised. In a serving engine: a wrong
# token, silently.
#
# How many steps go wrong depends on where the GPU was when each copy ran, so it varies by run
# (lesson 04 reruns this loop as a control). Every run asserts that the reused pinned buffer sent
# some step over the wrong pages, the pageable buffer none.
#
# ## The first fix: a pageable buffer (#32799)
#
# vLLM's answer for MRV2 (#32799, "Don't pin reused flashinfer tensors") was to stop pinning the
# reused buffers. The driver stages a **pageable** source into its own pinned buffer *during the
# call*, out of reach of later writes: correct, as both experiments showed. The price is lesson
# 02's "fake `non_blocking`": a CPU `memcpy` every call, and once the driver holds enough staged
# data (or too large a copy), the host must wait for the GPU and can no longer run ahead.
#
# *Where* does it wait? Any call after the copy may take the wait, so clock **every** call of the
# step: the write, the copy, the launch of the kernel that reads the copy, and the launch of the
# rest of the forward. The loop is the one above, plus that small kernel, which records what each
# copy delivered, so the data is checked too:


# %%
def timed_step_loop(s, host_buf, steps=400, busy_ms=0.5):
    """The unbounded step loop with a clock around
    every call: host µs per step for each part."""
    dst = torch.zeros(4, host_buf.numel(), dtype=host_buf.dtype, device=s.device)
    # min, max each copy delivered
    seen = torch.zeros(steps, 2, dtype=host_buf.dtype, device=s.device)
    us = {"write": [], "copy": [], "check": [], "forward": []}
    clock = time.perf_counter_ns
    start = clock()
    for n in range(steps):
        t0 = clock()
        host_buf.fill_(n)
        t1 = clock()
        dst[n % 4].copy_(host_buf, non_blocking=True)  # the copy call
        t2 = clock()
        # launch: a kernel reads it
        s.launch(torch.aminmax, dst[n % 4], out=(seen[n, 0], seen[n, 1]))
        t3 = clock()
        s.busy(busy_ms)  # launch: the rest of the forward
        t4 = clock()
        for part, a, b in (
            ("write", t0, t1),
            ("copy", t1, t2),
            ("check", t2, t3),
            ("forward", t3, t4),
        ):
            us[part].append(round((b - a) / 1e3, 2))
    end_of_loop = clock()
    s.synchronize()  # the host waits for the GPU only here
    wrong = sum(1 for n, (lo, hi) in enumerate(seen.tolist()) if not lo == hi == n)
    return {
        "us": us,
        "loop_ms": (end_of_loop - start) / 1e6,
        "drain_ms": (clock() - end_of_loop) / 1e6,
        "wrong": wrong,
    }


# %% [markdown]
# The sweep runs it with a pageable buffer of 1 KiB, 64 KiB, 1 MiB and 4 MiB per step, the GPU
# busy 0.5 ms per step, and with a reused **pinned** buffer of each size (racy: only its timing
# matters, a loop with no copy staged). Each run is warmed up (lazy module loading would block the
# first launch).
#
# 🔮 **Predict.** Which sizes let the host finish its 400 steps long before the GPU does? Where
# the host waits, is it in the copy call?
#
# <details><summary>Answer</summary>
#
# Pinned: every size, if the host is faster than the GPU: nothing is staged, so calls only enqueue
# until CUDA's launch queue is full (last section). Pageable: only sizes within the driver's
# limits (lesson 02: per copy, and on the bytes pending in its staging pool): a small copy may
# never fill the pool in 400 steps; larger ones fill it after some steps, or exceed the per-copy
# limit at once, and then the host runs at the GPU's pace (or slower, if slow or shared). The wait
# may land in a later call, such as the next launch, not the copy.
# </details>


# %%
def pageable_cost(sizes, buffers, steps=400, busy_ms=0.5):
    """The timed step loop per size and kind of host
    buffer ("pageable", or a reused "pinned" one)."""
    runs = []
    with pinlab.stream() as s:
        for nbytes in pinlab.progress(sizes, desc="timed step loop"):
            for buffer in buffers:
                host_buf = torch.zeros(
                    nbytes // 4, dtype=torch.int32, pin_memory=buffer == "pinned"
                )
                # warm-up, not recorded
                timed_step_loop(s, host_buf, steps=8, busy_ms=0.05)
                runs.append(
                    {
                        "nbytes": nbytes,
                        "buffer": buffer,
                        **timed_step_loop(s, host_buf, steps, busy_ms),
                    }
                )
                del host_buf
    return {"sizes": sizes, "steps": steps, "busy_ms": busy_ms, "runs": runs}


pc = pinlab.measure(
    "03_pageable_cost",
    pageable_cost,
    sizes=[1024, 64 * 1024, 1024 * 1024, 4 * 1024 * 1024],
    buffers=["pageable", "pinned"],
    steps=400,
    busy_ms=0.5,
)
parts = {(r["buffer"], r["nbytes"]): l03.step_parts(r) for r in pc.result["runs"]}

# %% tags=["nbval-ignore-output"]
part_rows = [
    {
        "buffer": b,
        "bytes": n,
        "loop": p["loop_ms"],
        "share": p["share"],
        **p["group_ms"],
        "copy_med": p["median_us"]["copy"],
        "check_med": p["median_us"]["check"],
        "fwd_med": p["median_us"]["forward"],
    }
    for (b, n), p in parts.items()
]
pinlab.table(part_rows, l03.PARTS_COLUMNS)

# %%
l03.plot_step_parts(pc.result, title=f"Where the host's loop time went ({pc.tag})")
plt.show()
pinlab.show(
    "takeaway: pageable, host loop / whole run",
    ", ".join(
        f"{fmt_bytes(n)} {parts[('pageable', n)]['share']:.0%}"
        for n in pc.result["sizes"]
    ),
)

# %% [markdown]
# A call that only enqueues takes microseconds; one that waits for the GPU, about a GPU step. So
# count, per call, the steps over **half a GPU step** (`l03.waits`; the 4 MiB copy is slow to
# stage even with nothing queued: lesson 01's pageable bandwidth). For the first such step the
# line estimates what was queued: steps issued minus steps the GPU had run, each three operations
# in the stream's queue (copy, check kernel, forward kernel) and one copy's worth of staged bytes.
#
# When a pageable copy waits, and in which call, is the driver's business: the CUDA
# Runtime API's ["API synchronization behavior"](https://docs.nvidia.com/cuda/cuda-runtime-api/api-sync-behavior.html)
# page says only that an asynchronous copy between device memory and pageable host memory "might
# be synchronous with respect to host", and the Driver API's
# [page of the same name](https://docs.nvidia.com/cuda/cuda-driver-api/api-sync-behavior.html) that
# any call "may block or synchronize for various reasons such as contention for or unavailability
# of internal resources". So everything below is *observed*, not asserted; only the data is checked.

# %%
sizes, steps, busy_ms = pc.result["sizes"], pc.result["steps"], pc.result["busy_ms"]
half_step_us = busy_ms * 1e3 / 2
# per step: copy, check kernel, forward kernel
OPS_PER_STEP = 3
call_names = {
    "write": "the write",
    "copy": "the copy call",
    "check": "the launch of the kernel that reads the copy",
    "forward": "the launch of the forward",
}
runs_of = {(r["buffer"], r["nbytes"]): r for r in pc.result["runs"]}
waited = {n: l03.waits(runs_of[("pageable", n)], half_step_us) for n in sizes}
first_wait = {}  # per size: (step, call, steps queued then), or None


def launch_wait_ms(r):
    """Host ms spent in launch calls that took over half a GPU step (they waited)."""
    return (
        sum(
            v
            for part in ("check", "forward")
            for v in r["us"][part]
            if v > half_step_us
        )
        / 1e3
    )


for n in sizes:
    r, p, w = runs_of[("pageable", n)], parts[("pageable", n)], waited[n]
    launches = w["check"]["steps"] + w["forward"]["steps"]
    pinlab.show(
        f"pageable, {fmt_bytes(n)} per step: host loop / "
        "whole run; share of the loop in copy calls, launches",
        f"{p['share']:.0%}; {p['group_ms']['copy call'] / p['loop_ms']:.0%}, "
        f"{p['group_ms']['kernel launches'] / p['loop_ms']:.0%}",
    )
    firsts = [(v["first"], part) for part, v in w.items() if v["first"] is not None]
    if firsts:
        first, part = min(firsts)
        host_ms = sum(sum(r["us"][q][:first]) for q in l03.STEP_PARTS) / 1e3
        queued = max(0.0, first - host_ms / busy_ms)
        first_wait[n] = (first, part, queued)
        where = (
            f"step {first}, in {call_names[part]}, with about {queued:.0f} "
            f"steps queued ({queued * OPS_PER_STEP:.0f} operations "
            f"in the stream's queue, {fmt_bytes(queued * n)} of copies)"
        )
    else:
        first_wait[n] = None
        where = "none"
    pinlab.show(
        f"pageable, {fmt_bytes(n)} per step: steps whose copy "
        "call / a launch took over half a GPU step; the first",
        f"{w['copy']['steps']} / {launches} of {steps}; {where}",
    )
pinlab.show(
    "pinned (racy), host loop / whole run per size",
    ", ".join(f"{parts[('pinned', n)]['share']:.0%}" for n in sizes),
)
# %% [markdown]
# This run in words, size by size; then the data check, true everywhere, and this run's
# behaviour as observations.

# %%
small, mid = sorted(sizes)[:2]
big = [n for n in sizes if n >= 1024 * 1024]
pinlab.show(
    f"{fmt_bytes(small)} pageable / pinned: of the "
    "time in launch calls, in launches that waited",
    " / ".join(
        f"{launch_wait_ms(runs_of[(b, small)]):.1f} of "
        f"{parts[(b, small)]['group_ms']['kernel launches']:.1f} ms"
        for b in ("pageable", "pinned")
    ),
)


def what_it_shows(n):
    """This run's behaviour at one size, in words (computed, so true on any machine)."""
    p, w = parts[("pageable", n)], waited[n]
    slow_ms = {
        "write": w["write"]["ms"],
        "copy": w["copy"]["ms"],  # host ms in calls over half a GPU step
        "launch": w["check"]["ms"] + w["forward"]["ms"],
    }
    pace = (
        "ran ahead of the GPU" if p["share"] < 0.5 else "did not run ahead of the GPU"
    )
    if max(slow_ms.values()) == 0:
        return f"the host {pace}; no call took over half a GPU step"
    where = {
        "write": "the write, the host's own work (no call into CUDA)",
        "copy": "the copy call itself",
        "launch": "a launch after the copy, a call that copies nothing",
    }[max(slow_ms, key=slow_ms.get)]
    return (
        f"the host {pace}; of the time in calls "
        f"over half a GPU step, most was in {where}"
    )


for n in sizes:
    pinlab.show(
        f"what this run shows, pageable {fmt_bytes(n)} per step", what_it_shows(n)
    )

# exact, on every machine: the driver stages each pageable copy during the call
wrong_pageable = sum(runs_of[("pageable", n)]["wrong"] for n in sizes)
pinlab.claim(
    "pageable buffer, steps that received another step's data, at every size",
    wrong_pageable,
    expect=0,
    why=l03.WHY.staged,
)

# observed: when the host waits depends on the driver's staging (undocumented), the
# link, the host's speed and what else runs on the GPU
share = {(b, n): parts[(b, n)]["share"] for (b, n) in parts}
mid_launches = waited[mid]["check"]["steps"] + waited[mid]["forward"]["steps"]
mid_copies = waited[mid]["copy"]["steps"]
pinlab.observe(
    f"{fmt_bytes(small)} pageable: the host finished its "
    "loop while most of the GPU work was still queued",
    share[("pageable", small)] < 0.5,
    value=f"loop / run {share[('pageable', small)]:.0%}",
    why=l03.WHY.staging,
)
pinlab.observe(
    f"{fmt_bytes(mid)} and larger, pageable: the "
    "host loop lasted at least half of the run",
    all(share[("pageable", n)] >= 0.5 for n in sizes if n >= mid),
    value=", ".join(f"{share[('pageable', n)]:.0%}" for n in sizes if n >= mid),
    why=l03.WHY.staging,
)
pinlab.observe(
    f"{fmt_bytes(mid)} pageable: the copy calls did not wait, a launch after them did",
    mid_copies <= steps // 10 and mid_launches >= steps // 4,
    why=l03.WHY.staging,
    value=f"over half a step: {mid_copies} copy calls, "
    f"{mid_launches} launches of {steps} steps",
)
for n in big:
    pinlab.observe(
        f"{fmt_bytes(n)} pageable: the copy call "
        "itself took over half a GPU step on most steps",
        waited[n]["copy"]["steps"] > steps // 2,
        value=f"{waited[n]['copy']['steps']} of {steps}",
        why=l03.WHY.staging_or_slow_host,
    )
pinned_ran_ahead = pinlab.observe(
    "reused pinned buffer: the host finished its loop first at every size",
    all(share[("pinned", n)] < 0.5 for n in sizes),
    why=l03.WHY.slow_host,
    value=", ".join(f"{share[('pinned', n)]:.0%}" for n in sizes),
)

# %% [markdown]
# A bar far below the dashed line (the GPU's work) is a host that ran ahead; one that reaches it
# ran at the GPU's pace, and its colours say where that time went.
#
# - **Pinned** buffer: nothing is staged (and the data can be wrong); its host runs ahead unless
#   it is slower than the GPU.
# - **Small pageable copies**: the copy call pays the staging `memcpy` and returns; the bar is
#   mostly launch calls, their own cost plus any that waited (the smallest size's line splits the
#   two, for both buffers). Launches that waited with only a few KiB per step queued mean no
#   staging pool was full: what fills up without staging is the stream's **launch queue**, three
#   operations a step (counted by the first-wait line; the next section measures its depth).
# - **Medium pageable copies**: where the host ran at the GPU's pace while its copy calls stayed
#   short, it waited in a call that copies nothing, the **launch right after the copy**, once
#   enough staged copies were queued (the first-wait line says how many bytes). Timing only the
#   copy call would miss it.
# - **Large pageable copies**: where the copy calls took about a GPU step or longer, the host
#   spent that time inside them: staging this much can take that long by itself, and past the
#   driver's limits it also waits for the GPU (lesson 02).
# - **A slow write**: where a "what this run shows" line names the write, the host's own work was
#   slow (a CPU shared with other processes, say), not waiting for the GPU.
#
# Which size falls in which case depends on the driver, link and load. vLLM's metadata is small,
# but the same pattern elsewhere is not, and even at 1 KiB the staging is a host `memcpy` on
# every step's critical path. Lesson 04 shows a fix both asynchronous and correct.
#
# ## How many launches fit in the queue
#
# A launch call (a kernel, a copy, an event record) normally only *enqueues* work, in
# microseconds. But the host-to-GPU queue has limited slots: once full, the next launch call
# blocks until the GPU frees one. CUDA does not document the depth (the pages above say only that
# a call may block for "unavailability of internal resources"), so measure it.
#
# `l03.launch_queue` keeps the GPU busy with one long kernel (100 ms), then launches 5,000 tiny
# kernels (`x.add_(1)` on 16 ints, warmed up first), timing each call. The one that finds the
# queue full waits until the long kernel ends, far longer than any other (an event recorded after
# the long kernel tells that wait from an OS preemption: after the real one, the kernel is done).
# Then `x` is read back: every launch must have added 1.
#
# 🔮 **Predict.** Will all 5,000 launch calls return in microseconds?
#
# <details><summary>Answer</summary>
#
# Not if the queue holds fewer than 5,000: behind the 100 ms kernel nothing leaves it, so once
# full the next launch call waits for that kernel to end; later calls find slots freed as the GPU
# races through the tiny kernels.
# </details>

# %%
lq = pinlab.measure(
    "03_launch_queue", l03.launch_queue, launches=5000, busy_ms=100.0, numel=16
)
q = lq.result

# %%
l03.plot_launch_queue(q, title=f"Launch calls behind a busy GPU ({lq.tag})")
plt.show()
pinlab.show(
    "takeaway",
    f"a launch call blocked once {q['full_at']} launches were queued"
    if q["full_at"] is not None
    else "no launch call found the queue full",
)

# %%
pinlab.claim(
    "every queued launch ran once (x read back after the sync)",
    q["ran"] == q["launches"],
    value=f"{q['ran']} of {q['launches']}",
    why=l03.WHY.launch_count,
)
if q["full_at"] is not None:
    pinlab.show(
        "launches queued behind the busy GPU before "
        "a launch call blocked (the queue's depth)",
        q["full_at"],
    )
    pinlab.show("that launch call waited", f"{q['waited_ms']:.1f} ms")
elif q["busy_done_at"] is not None:
    pinlab.show(
        "launches queued behind the busy GPU before a launch call blocked",
        "none: the busy kernel ended at launch "
        f"{q['busy_done_at']}, before the queue was full",
    )
else:
    pinlab.show(
        "launches queued behind the busy GPU before a launch call blocked",
        f"none among {q['launches']}: the queue holds more",
    )
pinlab.show(
    "host µs per launch call, before the one that blocked if any: median / p90 / max",
    " / ".join(f"{q['before_full'][k]:.1f}" for k in ("median_us", "p90_us", "max_us")),
)
# the 1 KiB loop above: operations queued when its
# first wait came, against the depth measured here
fw = first_wait[small]
if q["full_at"] is not None and fw is not None:
    ops = fw[2] * OPS_PER_STEP
    near = abs(ops - q["full_at"]) <= 0.25 * q["full_at"]
    pinlab.observe(
        f"the {fmt_bytes(small)} loop's first wait came when about "
        "as many operations were queued as the launch queue holds",
        near,
        value=f"{ops:.0f} operations then, a queue of {q['full_at']}",
        why=l03.WHY.two_runs,
    )
    if near:
        pinlab.show(
            "what this run shows",
            f"the {fmt_bytes(small)} loop waited because the "
            f"launch queue was full, with only {fmt_bytes(fw[2] * small)} "
            "of copies staged: not the staging pool",
        )
else:
    which = (
        []
        if q["full_at"] is not None
        else ["the launch-queue measurement (no launch call blocked)"]
    ) + (
        []
        if fw is not None
        else [f"the {fmt_bytes(small)} loop above (its host never waited)"]
    )
    pinlab.show(
        "what this run shows",
        "no comparison: nothing filled up in " + " nor in ".join(which),
    )

# %% [markdown]
# Where the queue filled, the plot shows launch calls that only enqueued (microseconds, spread by
# Python, the driver, the OS), and one far above (the dashed line) that found it full and waited
# for the busy kernel. Its index, printed above, is the queue's depth on this machine and driver
# (give or take the long kernel and its event, which hold slots too); other drivers, GPUs or
# platforms (ROCm, WSL2: not measured here) may differ.
#
# If the lines above put the smallest size's first wait at about the queue's depth, the full queue
# explains its waits: from then on a loop that never synchronizes waits for a slot, that is, for
# the GPU, at every launch, however few bytes it copies. Otherwise it never waited (it finished
# first) or waited earlier (a shared GPU, say, where the queued estimate is off too). Lesson 04
# meets this queue in its soak, and bounds the run-ahead as an engine does.

# %%
back = pinlab.pinned_back_to(pinned_at_start)
pinlab.claim(
    "pinned memory held is back to its starting level", back, why=pinlab.PINNED_BACK_WHY
)

# %% [markdown]
# ## What to remember
# - With async scheduling the host writes step N+1 while step N's copies are still queued.
# - A `non_blocking` copy from pinned memory reads the buffer when it **runs**: a reused pinned
#   buffer silently delivers a later step's data whenever the host rewrote it first (how often
#   varies from run to run). In vLLM's FlashInfer path: attention over the wrong pages, no error.
# - A pageable buffer is correct (staged during the call) but costs a host `memcpy` every step,
#   and the host waits for the GPU once the driver holds enough staged data, not always in the
#   copy call: clock the whole step.
# - Even a loop that stages nothing waits for the GPU at every launch once CUDA's launch queue is
#   full. Its depth is undocumented: measure it.
#
# **Exercise:** `exercises/03_the_race.ipynb` (solution in `solutions/`).
# **Next:** 04 · the fix: a pinned snapshot per step, and the history of fixes compared.
