# %% [markdown]
# # 09 · Audit real code: HF transformers `generate()`, a DataLoader, FlashInfer
#
# **What you will learn**
# - to audit code you did not write: `pinlab.detect_stalls` names each host sync of HF transformers'
#   `generate()` by `file:line`, and the profiler's trace confirms it at that call;
# - how exact the detector is on real code, and the one call that copies nothing;
# - when a deferred stop check buys tokens per second, and why one slot races;
# - who pins a DataLoader's batches, and when a pinned batch is copied from pageable memory anyway;
# - FlashInfer's staging through one pinned workspace per wrapper: how to make `detect_races` see
#   it, and two fixes.
#
# This uses lessons 02 to 04 and 07. The model is a tiny random `LlamaForCausalLM` built from a
# config: nothing is downloaded.

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
import inspect

import torch

import pinlab
from pinlab import lead
from pinlab.lessons import l09_real_code as l09

pinlab.header("09 audit real code")
pinned_at_start = pinlab.pinned_baseline()
pinlab.show("transformers here", l09.transformers_version())

# %% [markdown]
# ## The code under audit
#
# `l09.tiny_llama()` builds a random `LlamaForCausalLM` (hidden size 64, 2 layers, a vocabulary of
# 256) from a `LlamaConfig`, with end-of-sequence switched off, so `generate()` always makes exactly
# the tokens asked for. `l09.greedy(model, ids, mask, 24)` is a plain greedy `model.generate(...,
# max_new_tokens=24, do_sample=False)` on a batch of 2 prompts.

# %%
NEW_TOKENS, BATCH = 24, 2
# what the GPU experiments below require of a run (or of its recording)
GPU_TRACE = {"gpu_trace": True}
# ... with the newer transformers, or with FlashInfer (without it: the recording)
NEWER = dict(GPU_TRACE, newer_transformers=True)
FLASHINFER = {"flashinfer": True}
device = "cuda" if pinlab.has_cuda() else "cpu"
model = l09.tiny_llama(device)
ids, mask = l09.prompt(BATCH, device=device)
default_tokens = l09.greedy(model, ids, mask, NEW_TOKENS)
shape = tuple(default_tokens.shape)
pinlab.claim(
    f"generate() made {NEW_TOKENS} new tokens for each of {BATCH} prompts",
    shape == (BATCH, ids.shape[1] + NEW_TOKENS),
    value=shape,
    why=l09.WHY.no_eos,
)

# %% [markdown]
# 🔮 **Predict.** A greedy decode loop needs the new token on the GPU only (it feeds the next step).
# How many times per token does `generate()` make the host wait for the GPU?
#
# <details><summary>Answer</summary>
#
# At least one: `generate()` decides on the host, every step, whether to stop, and the "all
# finished" flag lives on the GPU. The audit below counts them all, by `file:line`.
# </details>
#
# ## 1. Audit `generate()`: the detector and the trace together
#
# `l09.audit_generate` runs `generate()` on the GPU (after a warm-up) under `pinlab.detect_stalls()`
# and `torch.profiler` at once. Each intercepted torch call runs in its own `record_function`
# window, where the trace shows a `cudaStreamSynchronize` (the host waited) or a `cudaMemcpyAsync`
# (a copy); a trace sync outside every reported window is one the detector missed. Each place is
# shown with its code, from the installed transformers.

# %%
audit = l09.measure_or_say(
    "09_generate_audit",
    l09.audit_generate,
    requires=GPU_TRACE,
    new_tokens=NEW_TOKENS,
    batch=BATCH,
)
if audit is not None:
    a = audit.result
    # every place (count, kind, file:line, code),
    # waits per token, the trace's syncs and copies
    l09.show_audit(a)
    pinlab.claim(
        "every event the detector reported has a "
        "sync or a copy in the trace at that call",
        a["false_positives"] == 0,
        value=f"{a['true_positives']} of {a['reported']}",
        why=l09.WHY.reported,
    )

# %% [markdown]
# What each place is for (read in transformers 5.17's source; the lines above are this run's):
# - `generation/utils.py`, `StopCheck.__call__`: `return bool(unfinished_sequences.max() == 0)`. The
#   stop check: `bool()` brings the GPU flag to the host every step, so the host waits for the whole
#   step before queueing the next.
# - `masking_utils.py`, `_ignore_causal_mask_sdpa`: `fast_all(padding_mask)`. The mask builder asks
#   whether the padding mask is all ones, to hand SDPA `is_causal` instead of a mask: a `bool()` of
#   a GPU tensor, every step.
# - `torch.tensor(..., device=cuda)` from Python data: a blocking copy from pageable memory, where
#   generation sets itself up (a few, not per token).
# - The rest depends on the version audited: the lines are computed, so a transformers that removes
#   a sync shows one place fewer.
#
# ### The same audit on a newer release
#
# Upstream is working on these syncs (transformers#43089 reports "3.25 GPU syncs per token" for its
# own model and settings). `l09.audit_newer` reruns the audit in a fresh process with a newer
# `transformers` installed beside this one (`$PINLAB_TRANSFORMERS_NEWER`; the GPU suite's recipe
# installs it). Line numbers move between versions, so places are matched by function and source
# line:

# %%
newer = l09.measure_or_say(
    "09_generate_newer",
    l09.audit_newer,
    requires=NEWER,
    new_tokens=NEW_TOKENS,
    batch=BATCH,
)
if audit is not None and newer is not None:
    # the places of both, waits per token, what changed
    l09.show_comparison(audit.result, newer.result)

# %% [markdown]
# How the newer release removes the mask builder's sync (since 5.18.0; read in 5.25.0's
# `generation/utils.py`, `generate()`, lines 2895-2910): it checks **once**, up front, whether
# the attention mask is all ones (`(model_kwargs["attention_mask"] == 1).all()`, the new place in
# `generate` above), then drops it, so `_ignore_causal_mask_sdpa` gets `padding_mask=None` and
# asks the GPU nothing. One sync per call instead of one per token; a batch with padding keeps
# its mask, and the per-token `fast_all` with it. The same audit with the first prompt
# left-padded by 3 tokens (`left_pad=3`: prompts of different lengths in one batch), in both
# releases:

# %%
pad = dict(new_tokens=NEW_TOKENS, batch=BATCH, left_pad=3)
padded = l09.measure_or_say(
    "09_generate_padded", l09.audit_generate, requires=GPU_TRACE, **pad
)
padded_newer = l09.measure_or_say(
    "09_generate_newer_padded", l09.audit_newer, requires=NEWER, **pad
)
if padded is not None and padded_newer is not None:
    l09.show_comparison(padded.result, padded_newer.result)

# %% [markdown]
# transformers#43089 counted 3.25 syncs per token on 5.0.0.dev0 with its own tiny Llama (hidden
# size 16, 1 layer), a custom stopping criterion that returns an all-False tensor on the GPU every
# step, and a logits processor that takes a softmax. Its criterion and processor, on this
# course's model and the installed transformers (`issue_43089=True`), against the plain
# `generate()` audited above:

# %%
setup_43089 = l09.measure_or_say(
    "09_generate_43089",
    l09.audit_generate,
    requires=GPU_TRACE,
    new_tokens=NEW_TOKENS,
    batch=BATCH,
    issue_43089=True,
)
if audit is not None and setup_43089 is not None:
    l09.show_comparison(audit.result, setup_43089.result, labels=("plain", "#43089's"))

# %% [markdown]
# The rest of #43089's 3.25 comes from what differs beyond these two: its release, its model and
# any other setting of its script; the lines above say whether the criterion and the processor add
# a wait on this one.
#
# ## 2. How exact is the detector?
#
# Precision: how many reported events have a sync or a copy in the trace. Recall: how many of the
# trace's syncs fall inside a reported call. `DynamicLayer.lazy_initialization` (`cache_utils.py`)
# makes `torch.tensor([], dtype=..., device=...)` twice per layer: empty tensors, which allocate and
# copy nothing. The detector used to report them as blocking copies; now it skips them
# (`pinlab.detector.copies_nothing`), and the audit counts them:

# %%
if audit is not None:
    a = audit.result
    true_pos, reported = a["true_positives"], a["reported"]
    in_windows, syncs = a["syncs_in_reported_windows"], a["trace_syncs"]
    precision = true_pos / reported if reported else 1.0
    recall = in_windows / syncs if syncs else 1.0
    pinlab.show(
        "precision (reported events with a sync or copy in the trace)",
        f"{true_pos} of {reported} ({precision:.0%})",
    )
    pinlab.show(
        "recall (trace syncs inside a reported call)",
        f"{in_windows} of {syncs} ({recall:.0%})",
    )
    pinlab.show("syncs the detector did not name", a["missed"] or "none")
    pinlab.show(
        "empty torch.tensor([], device=cuda) calls skipped",
        a["empty_factories"] or "none",
    )
    pinlab.observe(
        "the detector named every sync of the trace",
        recall == 1.0,
        value=f"{recall:.0%}",
        why=l09.WHY.unwatched,
    )

# %% [markdown]
# ## 3. Defer the stop check
#
# The fix upstream: transformers' `DeferredStopCheck` (`generation/utils.py`) copies the flag into
# one of two pinned slots with `non_blocking=True`, records an event, and reads the *other* slot,
# one step late; `is_supported` turns it on for `mps` only ("we should enable it for cuda if we
# observe perf gains"). The course's own, with the calls `generate()` makes (`l09.DeferredStop`):

# %%
print(inspect.getsource(l09.DeferredStop.__call__))

# %% [markdown]
# 🔮 **Predict.** The host still calls `synchronize()` on an event every step. Why is that not a
# stall like `bool()`?
#
# <details><summary>Answer</summary>
#
# It waits for the *previous* step's event, with this step's forward already queued behind it: the
# GPU has that to run while the host waits (whether it ever idled is not measured here), and on a
# GPU slower than the host the host stays one step ahead. `bool()` of the current step's flag waits
# for everything queued, the last kernel included.
# </details>
#
# It must give the same tokens (it stops at most one step later, and `generate()` undoes that step:
# `finish()` says how many). On this machine's stream (`l09.deferred_in_generate` hands it to
# `generate()`):

# %%
with pinlab.stream() as s:
    deferred_tokens = l09.greedy(
        model, ids, mask, NEW_TOKENS, deferred="course", stream=s
    )
pinlab.show("stream", s.label)
same = torch.equal(deferred_tokens.cpu(), default_tokens.cpu())
pinlab.claim(
    "the deferred stop check gives the same tokens as the default one",
    same,
    why=l09.WHY.same_tokens,
)

# %% [markdown]
# On the GPU, the default stop check against transformers' own `DeferredStopCheck` turned on for
# CUDA (`l09.stop_checks`; the course's where the installed transformers lacks it): trace syncs per
# token, the host's time in them, the GPU's idle share, tokens per second (median of 5 interleaved
# rounds, after a warm-up). Three workloads: the tiny model; the same with 4 ms of GPU work added to
# every forward (`gpu_ms`, a spinning kernel: a model whose step keeps the GPU busy about as long as
# the host's own work); and that with the newer transformers, whose mask builder no longer syncs.
#
# 🔮 **Predict.** In which of the three does deferring the stop check buy tokens per second?
#
# <details><summary>Answer</summary>
#
# Only where no other sync is left in the step and the GPU's work is long enough to hide the host's,
# and only by more than the deferred check's own host work per step (a copy, an event, a wait on the
# previous one). The tiny model's GPU finishes each step long before the host has queued the next:
# nothing to overlap. With 4 ms of GPU work in transformers 5.17, the mask builder's `fast_all`
# still waits for each forward: one wait per token either way. Only the third meets both conditions;
# the lines below say what each bought here.
# </details>

# %%
STEP_GPU_MS = 4.0  # GPU work added to every forward: about the host's own time per step
# every workload's generate() and timed rounds
run = dict(new_tokens=NEW_TOKENS, batch=BATCH, rounds=5)
stops = {
    "tiny model": l09.measure_or_say(
        "09_stop_checks", l09.stop_checks, requires=GPU_TRACE, **run
    ),
    f"+{STEP_GPU_MS:g} ms GPU per step": l09.measure_or_say(
        "09_stop_checks_gpu_heavy",
        l09.stop_checks,
        requires=GPU_TRACE,
        gpu_ms=STEP_GPU_MS,
        **run,
    ),
    f"+{STEP_GPU_MS:g} ms GPU per step, newer": l09.measure_or_say(
        "09_stop_checks_newer",
        l09.stop_checks_newer,
        requires=NEWER,
        gpu_ms=STEP_GPU_MS,
        **run,
    ),
}
stops = {label: m.result for label, m in stops.items() if m is not None}
for label, res in stops.items():
    same = res["runs"]["default"]["tokens"] == res["runs"]["deferred"]["tokens"]
    pinlab.claim(
        f"{label}: the deferred check "
        f"({res['deferred_is']}) gives the default's tokens",
        same,
        why=l09.WHY.same_tokens,
    )
    # syncs per token, host waiting, GPU idle, tokens per second, per round
    l09.show_stop_runs(res, NEW_TOKENS)
if stops:
    pinlab.show("what deferring the stop check bought", l09.stop_checks_text(stops))
    best = max(stops, key=lambda label: l09.speedup(stops[label]))
    pinlab.observe(
        "the deferred stop check made more tokens per second in one of the workloads",
        l09.speedup(stops[best]) > 1.0,
        value=f"{best}: {l09.speedup(stops[best]):.2f}x",
        why=l09.WHY.host_bound,
    )

# %% [markdown]
# The deferred check trades `bool()` syncs, which waited on everything queued, for event syncs on a
# step with work queued behind it. The host-waiting and idle lines show what it removed; tokens per
# second, whether that outweighed what it adds. Upstream leaves it off for CUDA until a gain is
# measured: these lines are such a measurement, on this machine.
#
# ### By batch size
#
# The same comparison at batch sizes 1, 8 and 64 (`l09.stop_check_sweep`), for the tiny model and
# with 4 ms of GPU work per step, in the installed transformers: tokens per second of both checks
# (the ratio of their medians over 5 interleaved rounds, and the range of the rounds' own
# ratios), the host's wait per token and the GPU's idle share, from the trace.

# %% tags=["nbval-ignore-output"]
sweep = l09.measure_or_say(
    "09_stop_sweep",
    l09.stop_check_sweep,
    requires=GPU_TRACE,
    new_tokens=NEW_TOKENS,
    rounds=5,
)
if sweep is not None:
    sw = sweep.result
    pinlab.claim(
        "the deferred check gives the default's tokens at every batch size",
        all(r["same_tokens"] for per in sw["results"].values() for r in per.values()),
        why=l09.WHY.same_tokens,
    )
    l09.table(l09.sweep_rows(sw), l09.SWEEP_COLUMNS)
    pinlab.show("by batch size", l09.sweep_text(sw))
    l09.plot_sweep(sw, title=f"Stop checks by batch size ({sweep.tag})")

# %% [markdown]
# ## 4. Why two slots: the race detector on the ring
#
# With one slot, the previous step's slot *is* the slot this step's copy is still writing: the host
# reads the destination of a pending D2H copy (lesson 02). `l09.race_ring` runs the check in a plain
# loop under `detect_races` (each step 1 ms of GPU work, then the flag; every sequence finishes in
# step 8):

# %%
STEPS = 16
with pinlab.stream() as s:
    two = l09.race_ring(s, slots=2, steps=STEPS)
    one = l09.race_ring(s, slots=1, steps=STEPS)
pinlab.show("stream", s.label)
one_slot_reads = one["findings"].get(l09.D2H_READ, 0)
pinlab.claim("2 slots: races found", two["total"], expect=0, why=l09.WHY.ring)
pinlab.claim(
    "2 slots: the check saw the stop one step after it happened",
    two["stopped_at"] == STEPS // 2 + 1,
    value=two["stopped_at"],
    why=l09.WHY.ring,
)
lead.claim(
    "1 slot: reads of a pending D2H copy found",
    one_slot_reads > 0,
    value=one_slot_reads,
    why=l09.WHY.ring,
)

# %% [markdown]
# ## 5. A DataLoader: who pins, and what the trace says
#
# `l09.audit_dataloader` runs five `DataLoader`s over 8 batches of two tensors, each moved with
# `.to("cuda", non_blocking=True)`, under the detector and the profiler. Each batch, an
# `l09.PinWitness` (the custom type with a `pin_memory()` method of DataLoader's "Memory Pinning"
# docs), records which thread pinned it. What torch does, read in its source
# (`torch/utils/data/dataloader.py`, `_utils/pin_memory.py`, torch 2.13; the run uses this torch):
# - `num_workers=0`: `_SingleProcessDataLoaderIter._next_data` pins each batch **in your loop's
#   thread**, inside `next()`;
# - `num_workers>0`: a `pin_memory` thread of your process (`_pin_memory_loop`) pins the batches the
#   workers send, while your loop runs;
# - a collate that returns a strided view: `pin_memory()` keeps the view's strides, and a CPU-to-GPU
#   copy of a non-dense tensor goes through a contiguous host temporary (`copy_requires_temporaries`
#   in `aten/src/ATen/native/cuda/Copy.cu`): pageable memory again;
# - `pin_memory_device`: the warning below says what this torch does with it.
#
# 🔮 **Predict.** In which of the five does `non_blocking=True` copy from pageable memory?
#
# <details><summary>Answer</summary>
#
# Two: `pin_memory=False` (every copy), and the strided collate (each batch's strided `x`, whose
# pinned copy is not dense, so torch stages it through a pageable temporary; `y` stays pinned).
# Workers and `pin_memory_device` change who pins and what is warned, not where copies come from.
# </details>

# %%
loaders = l09.measure_or_say(
    "09_dataloader", l09.audit_dataloader, requires=GPU_TRACE, batches=8
)
if loaders is not None:
    cases = loaders.result
    pinlab.table(l09.loader_rows(cases), l09.LOADER_COLUMNS)
    for name, c in cases.items():
        for w in c["warnings"]:
            pinlab.show(f"{name}: warning", w)
    for name, c in cases.items():
        detector, trace = l09.pageable_copies(c)
        pinlab.claim(
            f"{name}: the detector's pageable copies equal the trace's",
            detector == trace,
            value=(detector, trace),
            why=l09.WHY.copy_names,
        )
    # the trace's copies
    pageable = {k: c["memcpy"].get(l09.PAGEABLE_MEMCPY, 0) for k, c in cases.items()}
    pinned_copies = {k: c["memcpy"].get(l09.PINNED_MEMCPY, 0) for k, c in cases.items()}
    # batches it pinned
    in_main = {k: c["pinned_by"].get("main thread", 0) for k, c in cases.items()}
    plain, pinned, workers, strided = list(l09.LOADERS)[:4]  # the loaders' names
    pinlab.claim(
        "pin_memory=False: Pageable -> Device copies",
        pageable[plain],
        expect=16,
        why=l09.WHY.loaders,
    )
    pinlab.claim(
        "pin_memory=True: Pinned -> Device copies",
        pinned_copies[pinned],
        expect=16,
        why=l09.WHY.loaders,
    )
    pinlab.claim(
        "num_workers=0: batches pinned in the main thread",
        in_main[pinned],
        expect=8,
        why=l09.WHY.loaders,
    )
    pinlab.claim(
        "num_workers=2: batches pinned in the main thread",
        in_main[workers],
        expect=0,
        why=l09.WHY.loaders,
    )
    pinlab.claim(
        "strided collate: Pageable -> Device copies (the strided x)",
        pageable[strided],
        expect=8,
        why=l09.WHY.loaders,
    )

# %% [markdown]
# Detector and trace agree exactly, loader by loader, kind by kind (counts, not a match of each
# copy). Without `pin_memory` each `non_blocking=True` copy is lesson 02's fake one; with it, a true
# asynchronous DMA, pinned by your loop's thread without workers, by a thread of its own with them.
# Strided views undo the pinning for those tensors: call `.contiguous()` in the collate, where the
# workers pay for it.

# ## 6. FlashInfer's own staging: what `detect_races` sees, and how to tell it
#
# FlashInfer's decode wrapper's `plan()` writes its plan info into **one pinned workspace per
# wrapper** (`_pin_memory_int_workspace_buffer`), and the C++ planner it calls copies it to the GPU
# asynchronously (`flashinfer/decode.py`, `_plan_impl`; `docs/facts.md` F19). As lesson 04 showed, a
# second `plan()` on the same wrapper, with the host ahead, can overwrite the first plan before its
# copy has run. That copy is made below torch's Python API, invisible to `detect_races` (the library
# says so); `RaceDetector.copied(buf)` declares it after the call that queued it (first comparing
# the earlier pending copies from the same memory).
#
# 🔮 **Predict.** Two decode steps, the GPU 50 ms behind: (a) one wrapper, the second `plan()` right
# after the first; (b) one wrapper per step in flight; (c) one wrapper, the host waits for an event
# recorded after the first step before it re-plans. Which does the detector flag?
#
# <details><summary>Answer</summary>
#
# Only (a): the second `plan()` writes the workspace while the first copy is still queued. (b)
# writes another wrapper's workspace (lesson 04's ring of wrappers); in (c) the first copy has run
# before the rewrite (the wait vLLM's MRV1 runner makes before reusing its host buffers,
# `prepare_inputs_event`, lesson 04).
# </details>
#
# First, the stall detector on FlashInfer, as on `generate()`: 8 decode steps (`plan()`, then
# `run()`) with `indptr` and `last_page_len` in pageable host memory, as vLLM 0.29 passes them (the
# PR this course follows left them pageable; later vLLM pins them), each event matched with the
# trace:

# %% tags=["nbval-ignore-output"]
fia = l09.measure_or_say(
    "09_flashinfer_audit",
    l09.audit_flashinfer,
    requires=dict(GPU_TRACE, **FLASHINFER),
    steps=8,
    batch=16,
)
if fia is not None and "places" in fia.result:
    f = fia.result
    pinlab.show("FlashInfer", f["flashinfer"])
    l09.show_flashinfer_audit(f)
    pinlab.show(
        "precision (reported events with a sync or copy in the trace)",
        f"{f['true_positives']} of {f['reported']}",
    )
    pinlab.show(
        "recall (trace syncs inside a reported call)",
        f"{f['syncs_in_reported_windows']} of {f['trace_syncs']}",
    )
    pinlab.claim(
        "every event the detector reported in plan() and "
        "run() has a sync or a copy in the trace at that call",
        f["false_positives"] == 0,
        value=f"{f['true_positives']} of {f['reported']}",
        why=l09.WHY.reported,
    )
    pinlab.observe(
        "the detector named every sync of FlashInfer's steps in the trace",
        f["syncs_in_reported_windows"] == f["trace_syncs"],
        value=f["missed"] or "none",
        why=l09.WHY.unwatched,
    )
elif fia is not None:
    pinlab.show("FlashInfer", fia.result["flashinfer"])

# %% [markdown]
# Each case runs in a child process (a race here can kill a CUDA context), with the detector on and
# the staging declared after each `plan()`; the lines that matter, in `l04._plan_hazard_child`:
#
# ```python
# dec.plan(...)                                  # writes the plan info into the pinned workspace
# det.copied(dec.wrapper._pin_memory_int_workspace_buffer, nbytes=64 * 1024)   # and FlashInfer copies it
# ```
#
# The table is this run's: its seconds change from run to run. Without FlashInfer, this cell and the
# one above replay the recorded GPU run.

# %% tags=["nbval-ignore-output"]
stg = l09.measure_or_say(
    "09_plan_staging",
    l09.plan_staging,
    requires=FLASHINFER,
    busy_ms=50.0,
    timeout_s=12.0,
)
if stg is not None:
    r = stg.result
    pinlab.show("FlashInfer", r["flashinfer"])
    pinlab.table(l09.staging_rows(r), l09.STAGING_COLUMNS)
    pinlab.show("what this run shows", l09.staging_text(r))
    tested = r["back_to_back"]["outcome"] != "unavailable"
    flagged = r["back_to_back"].get("races", 0) - r["back_to_back"].get(
        "races_elsewhere", 0
    )
    pinlab.claim(
        "this notebook's own CUDA context is unharmed",
        r["parent_context_ok"],
        why=l09.WHY.own_context,
    )
    lead.claim(
        "one wrapper, host ahead: the declared "
        "staging was flagged, wherever FlashInfer ran",
        not tested or flagged >= 1,
        value=r["back_to_back"],
        why=l09.WHY.staging_declared,
    )
    for fix in ("two_wrappers", "event_wait"):
        clean = not tested or (
            r[fix]["outcome"] == "correct" and r[fix].get("races", 0) == 0
        )
        pinlab.claim(
            f"{fix}: the right output and no race found, wherever FlashInfer ran",
            clean,
            value=r[fix],
            why=l09.WHY.staging_fixed,
        )

# %% [markdown]
# Told about the copy it cannot see, the detector finds FlashInfer's race; the table's last column
# says what it found in FlashInfer's own torch calls. Both fixes are race-free and correct. In your
# code, declare every copy a C++ extension makes from a buffer you reuse, and run the gate (`pytest
# --pinlab-races`, lesson 03) on a loop that plans with the host ahead.

# %%
del model
pinlab.claim(
    "pinned memory held is back to its starting level",
    pinlab.pinned_back_to(pinned_at_start),
    value=pinlab.pinned_bytes_held(),
    why=pinlab.PINNED_BACK_WHY,
)

# %% [markdown]
# ## What to remember
# - Audit others' code as your own: `detect_stalls` names the `file:line` inside the library; the
#   profiler's trace confirms each sync at that call.
# - HF `generate()` makes the host wait for the GPU every token: the stop check's `bool()` and the
#   mask builder's `fast_all`; the lines above are those of the version you ran.
# - A call that copies nothing (`torch.tensor([], device=...)`) stalls nothing: check counts against
#   the trace.
# - A deferred check reads a flag one step late from a ring of two pinned slots guarded by events:
#   the same tokens; one slot reads a copy still in flight (the race detector says so).
# - A DataLoader's `pin_memory=True` makes `non_blocking=True` honest for contiguous batches;
#   without it, or for a strided view, the copy is pageable. Without workers your loop pays for
#   pinning.
# - A library's own C++ copies are invisible to a torch-level detector: declare them
#   (`RaceDetector.copied`). FlashInfer's `plan()` reuses one pinned workspace per wrapper: give
#   each step in flight its own wrapper, or wait for the previous step before re-planning.
