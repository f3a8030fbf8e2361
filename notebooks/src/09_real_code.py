# %% [markdown]
# # 09 · Audit real code: HF transformers `generate()`, a DataLoader
#
# **What you will learn**
# - to audit code you did not write with the course's tools: `pinlab.detect_stalls` names every host
#   sync of HF transformers' `generate()` by `file:line`, and each one is matched with the
#   synchronization the profiler's trace shows at that call;
# - how exact the detector is on real code (precision and recall against the trace), and the one kind
#   of call that copies nothing: `torch.tensor([], device=...)`;
# - a deferred stop check (modelled on transformers' `DeferredStopCheck`: two pinned slots, an event,
#   the other slot read one step late): the same tokens, fewer syncs per token, and why one slot races;
# - a DataLoader's `pin_memory`: what the detector and the trace say about its copies, exactly.
#
# Everything here uses lessons 02 to 04 and 07. The model is a tiny random `LlamaForCausalLM` built
# from a config: nothing is downloaded.

# %%
# Install cell: on Colab, or in any Python without the course, run this first.
# Where `import pinlab` works (a clone set up with `make lab`), it does nothing.
import importlib.util

if importlib.util.find_spec("pinlab") is None:
    raise ModuleNotFoundError("pinlab is not installed here, and this copy of the course names no address "
                              "to install it from: clone the course and run `make lab` in it (whoever "
                              "publishes the course runs `make publish URL=<its address>`).")

# %% tags=["nbval-ignore-output"]
import inspect

import torch

import pinlab
from pinlab.lessons import l09_real_code as l09

pinlab.header("09 audit real code")
pinned_at_start = pinlab.pinned_baseline()
pinlab.show("transformers here", l09.transformers_version())

# %% [markdown]
# ## The code under audit
#
# `l09.tiny_llama()` builds a random `LlamaForCausalLM` (hidden size 64, 2 layers, a vocabulary of 256)
# from a `LlamaConfig`; end-of-sequence is switched off, so `generate()` always makes exactly the
# tokens asked for. `l09.greedy(model, ids, mask, 24)` is a plain greedy `model.generate(...,
# max_new_tokens=24, do_sample=False)` on a batch of 2 prompts.

# %%
NEW_TOKENS, BATCH = 24, 2
device = "cuda" if pinlab.has_cuda() else "cpu"
model = l09.tiny_llama(device)
ids, mask = l09.prompt(BATCH, device=device)
default_tokens = l09.greedy(model, ids, mask, NEW_TOKENS)
pinlab.claim(f"generate() made {NEW_TOKENS} new tokens for each of {BATCH} prompts",
             tuple(default_tokens.shape) == (BATCH, ids.shape[1] + NEW_TOKENS), value=tuple(default_tokens.shape),
             why="end-of-sequence is switched off: the length is set by max_new_tokens alone")

# %% [markdown]
# 🔮 **Predict.** A greedy decode loop needs the new token on the GPU only (it feeds the next step).
# How many times per token does `generate()` make the host wait for the GPU?
#
# <details><summary>Answer</summary>
#
# At least one: `generate()` decides on the host, every step, whether to stop, and the "all finished"
# flag lives on the GPU. The audit below counts them all, by `file:line`.
# </details>
#
# ## 1. Audit `generate()`: the detector and the trace together
#
# `l09.audit_generate` runs the same `generate()` on the GPU (after one warm-up run) under
# `pinlab.detect_stalls()` and `torch.profiler` at once. Each torch call the detector intercepts runs
# inside its own `record_function` window, so that every event the detector reports can be matched with
# what the trace shows inside its window: a `cudaStreamSynchronize` (the host waited) or a
# `cudaMemcpyAsync` (a copy). A sync of the trace outside every reported window is one the detector
# missed. Each place is shown with the code at that line, read from the installed transformers.

# %%
audit = l09.measure_or_say("09_generate_audit", l09.audit_generate, requires={"gpu_trace": True},
                           new_tokens=NEW_TOKENS, batch=BATCH)
if audit is not None:
    a = audit.result
    pinlab.show("transformers audited", f"{a['transformers']} (torch {a['torch']})")
    for p in a["places"]:
        pinlab.show(f"{p['n']:3d} x {p['kind']}", f"{p['where']} in {p['function']}(): {p['code']}")
    waits = sum(p["n"] for p in a["places"] if p["kind"] in l09.WAITING_KINDS)
    pinlab.show("host waits the detector reports, per new token", f"{waits / a['new_tokens']:.2f}")
    pinlab.show("cudaStreamSynchronize and other syncs in the trace", a["trace_syncs"])
    pinlab.show("H2D copies in the trace, by kind", a["memcpy"])
    every = [p for p in a["places"] if p["n"] == a["new_tokens"]]
    pinlab.show("places that make the host wait once per token",
                "; ".join(f"{p['where']} ({p['function']})" for p in every) or "none")
    pinlab.claim("every event the detector reported has a sync or a copy in the trace at that call",
                 a["false_positives"] == 0, value=f"{a['true_positives']} of {a['reported']}",
                 why="each reported kind (a sync, a blocking copy, a factory of data with elements) makes torch "
                     "call cudaStreamSynchronize or cudaMemcpyAsync: the value names how many did not")

# %% [markdown]
# What each place is for (read in transformers 5.17's source; the lines above are this run's):
# - `generation/utils.py`, `StopCheck.__call__`: `return bool(unfinished_sequences.max() == 0)`. The
#   stop check: `unfinished_sequences` lives on the GPU, and `bool()` brings the flag to the host, every
#   step, so the host waits for the whole step before it may queue the next one.
# - `masking_utils.py`, `_ignore_causal_mask_sdpa`: `fast_all(padding_mask)`. The mask builder asks
#   whether the padding mask is all ones, to hand SDPA `is_causal` instead of a mask: a `bool()` of a GPU
#   tensor, every step.
# - `torch.tensor(..., device=cuda)` from Python data: a blocking copy from pageable memory, where
#   generation sets itself up (a few, not per token).
# - What the table shows besides these depends on the version audited: the lines are computed, so a
#   transformers that removes a sync shows one place fewer.
#
# ## 2. How exact is the detector?
#
# Precision: of the events reported, how many have a sync or a copy in the trace. Recall: of the
# trace's syncs, how many fall inside a reported call. `DynamicLayer.lazy_initialization`
# (`cache_utils.py`) makes `torch.tensor([], dtype=..., device=...)` twice per layer: empty tensors,
# which allocate and copy nothing. The detector used to report them as blocking copies; it no longer
# does (`pinlab.detector.copies_nothing`), and the audit counts the empty factories it skipped:

# %%
if audit is not None:
    a = audit.result
    precision = a["true_positives"] / a["reported"] if a["reported"] else 1.0
    recall = a["syncs_in_reported_windows"] / a["trace_syncs"] if a["trace_syncs"] else 1.0
    pinlab.show("precision (reported events with a sync or copy in the trace)",
                f"{a['true_positives']} of {a['reported']} ({precision:.0%})")
    pinlab.show("recall (trace syncs inside a reported call)",
                f"{a['syncs_in_reported_windows']} of {a['trace_syncs']} ({recall:.0%})")
    pinlab.show("syncs the detector did not name", a["missed"] or "none")
    pinlab.show("empty torch.tensor([], device=cuda) calls skipped", a["empty_factories"] or "none")
    pinlab.observe("the detector named every sync of the trace", recall == 1.0, value=f"{recall:.0%}",
                   why="ops whose kernel syncs (nonzero, boolean-mask indexing) and torch's own internal calls "
                       "are outside what the detector watches; the line above names them")

# %% [markdown]
# ## 3. Defer the stop check
#
# The fix upstream: transformers' `DeferredStopCheck` (`generation/utils.py`) copies the flag into one of
# two pinned slots with `non_blocking=True`, records an event, and reads the *other* slot, one step
# late; `is_supported` turns it on for `mps` only ("we should enable it for cuda if we observe perf
# gains"). The course's own, with the calls `generate()` makes (`l09.DeferredStop`):

# %%
print(inspect.getsource(l09.DeferredStop.__call__))

# %% [markdown]
# 🔮 **Predict.** The host still calls `synchronize()` on an event every step. Why is that not a
# stall like `bool()`?
#
# <details><summary>Answer</summary>
#
# It waits for the *previous* step's event: by then the host has queued this step's forward behind
# it, so the GPU never runs dry while the host waits, and on a GPU slower than the host the host is
# one step ahead. `bool()` of the current step's flag waits for everything queued, the last kernel
# included.
# </details>
#
# It must give the same tokens (it stops one step later at most, and `generate()` undoes that step:
# `finish()` says how many). On this machine's stream (`l09.deferred_in_generate` hands it to
# `generate()`):

# %%
with pinlab.stream() as s:
    deferred_tokens = l09.greedy(model, ids, mask, NEW_TOKENS, deferred="course", stream=s)
pinlab.show("stream", s.label)
pinlab.claim("the deferred stop check gives the same tokens as the default one",
             torch.equal(deferred_tokens.cpu(), default_tokens.cpu()),
             why="the stop decision changes when the host reads it, never what is decoded")

# %% [markdown]
# On the GPU: the default stop check against transformers' own `DeferredStopCheck` turned on for CUDA
# (`l09.stop_checks`: the course's where the installed transformers lacks it), the trace's syncs per
# token for both, and tokens per second (median of 5 interleaved rounds, after a warm-up):

# %%
stops = l09.measure_or_say("09_stop_checks", l09.stop_checks, requires={"gpu_trace": True},
                           new_tokens=NEW_TOKENS, batch=BATCH, rounds=5)
if stops is not None:
    r = stops.result["runs"]
    pinlab.show("deferred check used", stops.result["deferred_is"])
    pinlab.claim("on the GPU, the deferred stop check gives the same tokens as the default one",
                 r["default"]["tokens"] == r["deferred"]["tokens"],
                 why="the stop decision changes when the host reads it, never what is decoded")
    for name in ("default", "deferred"):
        pinlab.show(f"{name}: syncs per token in the trace",
                    f"{sum(r[name]['syncs'].values()) / NEW_TOKENS:.2f} ({r[name]['syncs']})")
        pinlab.show(f"{name}: tokens per second", f"{r[name]['tokens_per_s']:.0f}")
    ratios = stops.result["ratios"]
    pinlab.show("deferred speed-up per round", ", ".join(f"{x:.2f}x" for x in ratios))
    pinlab.observe("the deferred stop check made more tokens per second",
                   r["deferred"]["tokens_per_s"] > r["default"]["tokens_per_s"],
                   value=f"{r['deferred']['tokens_per_s'] / r['default']['tokens_per_s']:.2f}x",
                   why="a model this small is bound by the host's launches: the GPU finishes each step before "
                       "the host has queued the next, so a wait saved is a short one")

# %% [markdown]
# The event syncs the deferred check adds are waits on a step the GPU has already queued work behind;
# the `bool()` syncs it removes were waits on everything queued. Whether that buys tokens per second
# depends on who is slower: the speed-up line says what it bought in this run.
#
# ## 4. Why two slots: the race detector on the ring
#
# With one slot, the previous step's slot *is* the slot this step's copy is still writing: the host
# reads the destination of a pending D2H copy (lesson 02). `l09.race_ring` runs the check in a plain
# loop under `detect_races` (each step 1 ms of GPU work, then the flag; every sequence finishes in step 8):

# %%
STEPS = 16
with pinlab.stream() as s:
    two = l09.race_ring(s, slots=2, steps=STEPS)
    one = l09.race_ring(s, slots=1, steps=STEPS)
pinlab.show("stream", s.label)
pinlab.claims({"2 slots: races found": two["total"],
               "2 slots: the check saw the stop one step after it happened": two["stopped_at"] == STEPS // 2 + 1,
               "1 slot: reads of a pending D2H copy found": one["findings"].get(l09.D2H_READ, 0) > 0},
              expect={"2 slots: races found": 0},
              why="the copy waits behind 1 ms of GPU work while the host reads within microseconds: a wide lead; "
                  "the 2-slot ring reads only a slot whose event has completed")

# %% [markdown]
# ## 5. A DataLoader: who pins, and what the trace says
#
# `l09.audit_dataloader`: a `DataLoader` (`num_workers=0`) of 8 batches of two tensors, each moved with
# `.to("cuda", non_blocking=True)`, once with `pin_memory=False` and once with `pin_memory=True` (the
# loader pins each batch in this process before handing it over), under the detector and the profiler:

# %%
loader = l09.measure_or_say("09_dataloader", l09.audit_dataloader, requires={"gpu_trace": True}, batches=8)
if loader is not None:
    pg, pn = loader.result["pageable"], loader.result["pinned"]
    pinlab.show("pin_memory=False: H2D copies in the trace", pg["memcpy"])
    pinlab.show("pin_memory=True: H2D copies in the trace", pn["memcpy"])
    pinlab.claims({"pin_memory=False: pageable H2D copies the detector reported": pg["detector_pageable"],
                   "pin_memory=False: Pageable -> Device copies in the trace": pg["memcpy"].get(l09.PAGEABLE_MEMCPY, 0),
                   "pin_memory=True: pageable H2D copies the detector reported": pn["detector_pageable"],
                   "pin_memory=True: Pinned -> Device copies in the trace": pn["memcpy"].get(l09.PINNED_MEMCPY, 0)},
                  expect={"pin_memory=False: pageable H2D copies the detector reported": 16,
                          "pin_memory=False: Pageable -> Device copies in the trace": 16,
                          "pin_memory=True: pageable H2D copies the detector reported": 0,
                          "pin_memory=True: Pinned -> Device copies in the trace": 16},
                  why="8 batches x 2 tensors, each one copy: the profiler names every copy by its host memory")

# %% [markdown]
# Exact: the detector and the trace agree copy for copy. With `pin_memory=False` each
# `non_blocking=True` copy is the fake one of lesson 02; with `pin_memory=True` the loader pays one
# host copy per tensor into pinned memory and every H2D copy is a true asynchronous DMA.

# %%
del model
pinlab.claim("pinned memory held is back to its starting level", pinlab.pinned_back_to(pinned_at_start),
             value=pinlab.pinned_bytes_held(),
             why="a pinned tensor of this notebook is still referenced, or another library took pinned memory")

# %% [markdown]
# ## What to remember
# - Audit code you did not write the way you audit your own: `detect_stalls` names the `file:line`
#   inside the library; the profiler's trace confirms each sync at that call.
# - HF `generate()` waits for the GPU on the host every token: the stop check's `bool()`, and the mask
#   builder's `fast_all`; the lines above are the ones of the version you ran.
# - A call that copies nothing (`torch.tensor([], device=...)`) stalls nothing: count against the
#   trace before you trust a count.
# - A deferred check reads a flag one step late from a ring of two pinned slots guarded by events:
#   the same tokens; one slot reads a copy still in flight (the race detector says so).
# - A DataLoader's `pin_memory=True` makes `non_blocking=True` honest; without it every copy is pageable.
