"""Lesson 04, the fix: its experiments and plots.

The notebook writes the ``pin_memory()`` snapshot and the event-guarded ring itself and runs
them live (GPU) or on the emulated lagging stream (CPU). The experiments here measure them on the
GPU with the step loop of :mod:`pinlab.steploop`:

* :func:`allocator_reuse`: the caching host allocator keeps a snapshot's block until its copy ran;
* :func:`pin_trap`: ``pin_memory()`` of a pinned tensor is that tensor;
* :func:`snapshot_cost`: the host µs the snapshot adds per step;
* :func:`history`: every fix vLLM tried, in one loop;
* :func:`plan_hazard`: FlashInfer's own ``plan()`` buffer, in child processes;
* :func:`metadata_loop` and :func:`fix_race`: a decode step's several metadata tensors, moved by
  each fix (the notebook's slab ring among them) behind a busy GPU, checked on the device;
* :func:`shared_pool`: several tensors per step, pageable against snapshots, up to a few MiB;
* :func:`snapshot_soak`: ten thousand snapshots cold, with the cache warmed, and with
  ``pinned_reserve_segment_size_mb``, each in a fresh child process.

The notebook's reasons why a claim may not hold on some machine (:data:`WHY`) and its table columns
(``*_COLUMNS``) live here too, so that each of its claims is one line.

Why over 500 lines: the lesson measures six things, three of them (the plan hazard, the soak with
its allocator settings, the several-tensor loops) with their own child-process or harness code,
and the children import this module by name; split, each part would need the others' runner.

Each step-loop experiment takes ``stream=None``: None means the CUDA stream (CudaUnavailableError
without CUDA); a :class:`pinlab.LaggingStream` runs the same code on the CPU. The decode loop
with the snapshot is :func:`pinlab.lessons.l03_the_race.decode_race`.
"""
from __future__ import annotations

import math
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

from .. import steploop
from ..args import callable_arg, one_of, positive_int, positive_number
from ..child import classify_child, report_and_exit, run_children  # noqa: F401 - as l04.run_children etc. too
from ..claims import Reasons
from ..device import require_cuda
from ..paged_kv import FlashInferDecode, FlashInferUnavailableError, build_metadata, random_batch, reference_decode
from ..plots import MAX_WIDTH_IN, color_for, fmt_bytes, headroom, label_line, legend_outside, stacked, subplots
from ..steploop import HISTORY, KiB, LABELS
from ..timing import interleaved, show, split_steps

__all__ = ["snapshot_soak", "allocator_reuse", "pin_trap", "snapshot_cost", "history", "plan_hazard",
           "classify_child", "child_code", "run_children", "plot_history", "METADATA", "PER_TENSOR", "PerTensor",
           "metadata_loop", "fix_race", "shared_pool", "log_histogram", "soak_child_code", "plot_host_times",
           "plot_shared_pool", "plot_soak", "WHY", "COST_COLUMNS", "HISTORY_COLUMNS", "AUDIT_COLUMNS", "audit_rows",
           "POOL_COLUMNS", "FIX_COLUMNS", "fix_rows", "which_fix_when"]

# =============================================================================================
# The notebook's reasons and table columns
# =============================================================================================

_ALLOCATOR = ("PyTorch's caching host allocator behaves the same on every CUDA GPU; a different answer means a torch "
              "whose allocator works otherwise")
_SLOW_HOST = "a host slower than that (a CPU shared by many processes) lets the GPU keep up"

#: Why a claim of the notebook may not hold on some machine (``why=l04.WHY.torch_bug``).
WHY = Reasons(
    torch_bug="the caching host allocator keeps each snapshot until its copy has run: a corrupted step is a bug in "
              "torch's allocator, not a property of the machine",
    soak_children="each run is a child process; one that could not start CUDA, or took over a minute, is missing",
    lead_005ms="the control needs the GPU behind the host: 0.05 ms of GPU work per step must outlast the host's step "
               "(a write, a copy, two launches); a much slower host (a CPU shared by many processes) lets the GPU "
               "keep up",
    pending="the copy waits behind 50 ms of GPU work and snapshot 2 is taken microseconds later; only a host stalled "
            "for that long (a CPU shared by many processes) could miss it",
    allocator=_ALLOCATOR,
    reused_early="the allocator waits for the copy's event before reusing a block: a failure here is the race, in "
                 "torch",
    in_flight="run-ahead 3: at most 4 snapshots are in flight; " + _ALLOCATOR,
    pin_memory_doc="torch's documented behaviour of pin_memory()",
    lead_05ms="the race needs the GPU behind the host (0.5 ms of GPU work per step against a host step of "
              "microseconds); " + _SLOW_HOST,
    lead_03ms="the race needs the GPU behind the host (0.3 ms of GPU work per step against a host step of "
              "microseconds); " + _SLOW_HOST,
    lead_025ms="the race needs the GPU behind the host (0.25 ms of GPU work per step against a host step of tens of "
               "µs); " + _SLOW_HOST,
    lead_3ms="the GPU is kept 3 ms behind per step; a host that needs more than that per step (a CPU shared by many "
             "processes, or FlashInfer's plan() far slower than usual) would let every copy run before the next write",
    alloc_count="torch.cuda.host_memory_stats() of this torch may not count cudaHostAlloc calls (host_alloc_time), or "
                "the loop had more snapshots in flight than the 1,024 warmed blocks (a deeper launch queue: lesson 03)",
    worst_step="one slow step is a host timing: the OS, the launch queue, or another process can make any run's worst "
               "step",
    ring_events="each buffer is rewritten only after the event recorded after its last copy: a wrong step is a bug",
    event_wait="host timings: a slow host (2 CPU cores, WSL2) makes the snapshot dearer, a GPU that keeps up makes "
               "the event wait cheaper",
    staging="host timings: the driver's staging and torch's allocator cost differently on other hosts and drivers",
    correct_fix="a correct fix by construction (its own memory per step in flight, or staged at the call): a wrong "
                "step is a bug",
    driver_staging="the driver stages pageable copies in its own memory, not in torch's pinned blocks",
    false_positive="a correct fix never rewrites memory a pending copy reads: a finding is a false positive (a bug in "
                   "pinlab.races)",
    detector_miss="the detector asks each copy's event before every call that touches its source: a miss is a bug",
    pool_bug="pageable copies are staged during the call and each snapshot is kept until its copy has run: a "
             "corrupted step is a bug in the driver or torch",
    crossing="when pageable copies wait is the driver's staging, undocumented; a shared GPU, a slow host or a link "
             "where pageable copies are cheap (a GH200, not measured here, docs/facts.md F15) moves or removes the "
             "crossing",
    step_count="the harness runs 10,000 steps of each: a different count is a bug",
    host_timing="host timings: a slower host, another process on the CPU or the GPU, or another driver changes them",
    fp16_tol="fp16 attention against an fp32 reference; a larger error means a broken attention kernel or build",
    own_context="the hazard runs in child processes, which have their own CUDA contexts; a failure here is a broken "
                "driver",
    synced_control="with a sync between the two plans nothing is pending when the second plan is written; a wrong or "
                   "crashed control means a broken FlashInfer build or driver, or a child that ran out of GPU memory "
                   "beside other processes",
)


def _us(v) -> str:
    return f"{v:.1f}"


#: The columns of the notebook's tables (``pinlab.table(rows, l04.COST_COLUMNS)``).
COST_COLUMNS = [("nbytes", "metadata", fmt_bytes), ("no_copy_us", "no copy µs", _us),
                ("reused_pinned_us", "reused pinned µs", _us), ("snapshot_us", "snapshot µs", _us),
                ("snapshot_extra_us", "snapshot adds µs", _us), ("copy_total_us", "snapshot - no copy µs", _us)]
HISTORY_COLUMNS = [("label", "approach"), ("corrupted", "corrupted steps"), ("host_us", "host µs/step", _us),
                   ("host_extra_us", "vs no copy µs", _us), ("pinned_bytes_held", "pinned bytes held")]
AUDIT_COLUMNS = [("approach", "approach"), ("wrong", "steps wrong"), ("flagged", "steps flagged"),
                 ("missed", "wrong, not flagged")]
POOL_COLUMNS = [("total_bytes", "per step", fmt_bytes), ("tensor_bytes", "per tensor", fmt_bytes),
                ("pageable_us", "pageable µs", _us), ("snapshot_us", "snapshot µs", _us),
                ("pageable_p90_us", "pageable p90 µs", _us), ("snapshot_p90_us", "snapshot p90 µs", _us),
                ("corrupted", "corrupted")]
SOAK_COLUMNS = [("run", "run"), ("p50_us", "host µs p50", _us), ("p99_us", "p99", _us), ("p999_us", "p99.9", _us),
                ("max_us", "max", _us), ("over_100us", "steps > 100 µs"), ("over_1ms", "steps > 1 ms"),
                ("distinct_blocks", "pinned blocks used"), ("new_blocks", "new pinned blocks"),
                ("slow_allocs", "cudaHostAlloc calls")]
FIX_COLUMNS = [("label", "approach"), ("corrupted", "corrupted steps"), ("p50_us", "host µs median", _us),
               ("round_medians", "round medians"), ("best_us", "best round", _us),
               ("spread", "largest / smallest round", lambda v: f"{v:.2f}"),
               ("p10_us", "p10", _us), ("p90_us", "p90", _us), ("p99_us", "p99", _us), ("max_us", "max", _us)]


def fix_rows(result: dict) -> list[dict]:
    """:func:`fix_race`'s rows for :data:`FIX_COLUMNS`, each with its rounds: ``round_medians`` (host µs per
    step, one median per round), ``best_us`` (the smallest: the approach's cost undisturbed, since disturbance
    only adds) and ``spread`` (largest / smallest round median: the machine's noise, not the approach's)."""
    rows = []
    for r in result["rows"]:
        meds = r["round_medians_us"]
        rows.append(dict(r, round_medians=", ".join(f"{v:.1f}" for v in meds), best_us=min(meds),
                         spread=max(meds) / min(meds)))
    return rows


def which_fix_when(best: dict, pool_rows: list, waited: list, passes: dict) -> None:
    """The lesson's closing figures, one line each, from the runs above: :func:`fix_race`'s best round per
    approach (``best``: host µs by strategy, :func:`fix_rows`' ``best_us``) and the cheapest correct fix,
    :func:`shared_pool`'s largest step (``pool_rows``), the smallest step whose pageable copies waited
    (``waited``: step sizes in bytes), and :func:`snapshot_soak`'s worst step per pass (``passes``)."""
    show("which fix when, host µs per step (6 tensors; best round median): racy / pageable / snapshot / slab ring",
         " / ".join(f"{best[k]:.1f}" for k in FIX_LABELS))
    show("which fix when: the cheapest correct fix for 6 small tensors, in this configuration on this run",
         FIX_LABELS[min((k for k in FIX_LABELS if k != "reused_pinned"), key=best.get)])
    big = pool_rows[-1]
    show(f"at {fmt_bytes(big['total_bytes'])} per step: pageable / snapshot host µs",
         f"{big['pageable_us']:.1f} / {big['snapshot_us']:.1f}")
    show("several tensors per step: the smallest step at which the pageable copies took over half a GPU step",
         fmt_bytes(min(waited)) if waited else "none measured")
    show("soak, cold / warmed / reserved: max host µs of a step",
         " / ".join(f"{passes[k]['max_us']:.0f}" if k in passes else "n/a" for k in SOAK_PASSES))


def audit_rows(audit: dict) -> list[dict]:
    """:func:`pinlab.lessons.l03_the_race.race_audit`'s result as rows of :data:`AUDIT_COLUMNS`: per approach,
    how many steps arrived wrong, how many the detector flagged, and how many wrong ones it did not flag."""
    return [{"approach": LABELS[k], "wrong": len(a["wrong"]), "flagged": len(a["flagged"]), "missed": len(a["missed"])}
            for k, a in audit.items()]


def snapshot_cost(sizes=(KiB, 4 * KiB, 16 * KiB, 64 * KiB), steps: int = 500, busy_ms: float = 0.1,
                  run_ahead: int | None = 1, rounds: int = 5, stream=None) -> dict:
    """Host µs per step of the snapshot, against the same loop without it (run-ahead ``run_ahead``).

    For each size: the median host time per step (write + stage + copy) of ``no_copy`` (write
    only), ``reused_pinned`` (write + the same non_blocking copy, no snapshot: the racy code the
    fix replaces) and ``snapshot`` (write + pin_memory() + copy). ``snapshot_extra_us`` = snapshot
    - reused_pinned: what the snapshot itself adds; ``copy_total_us`` = snapshot - no_copy: all
    that moving the metadata costs this way. Each value is the median over ``rounds`` interleaved
    rounds of each loop's median step; ``snapshot_corrupted`` counts over all rounds.
    """
    sizes = steploop.sizes_arg(sizes)
    steps = positive_int("steps", steps)
    busy_ms = positive_number("busy_ms", busy_ms)
    run_ahead = steploop.run_ahead_arg(run_ahead)
    rounds = positive_int("rounds", rounds)
    steploop.check_dst(steps, max(sizes) // 4)
    stream = steploop.cuda_or(stream, "snapshot_cost()")
    rows = []
    names = ["no_copy", "reused_pinned", "snapshot"]
    for s in sizes:
        n_ints = s // 4
        steploop.warm(stream, names, n_ints, busy_ms, run_ahead, 1)
        # interleaved rounds, each strategy's median per round; then the median over rounds
        runs = interleaved(names, rounds, lambda k, r: steploop.plain_loop(
            stream, k, steps=steps, n_ints=n_ints, busy_ms=busy_ms, run_ahead=run_ahead, per_step=False))
        med = {k: statistics.median(x["host"]["median_us"] for x in v) for k, v in runs.items()}
        corrupted = sum(x["corrupted"] for x in runs["snapshot"])
        rows.append({
            "nbytes": s,
            "no_copy_us": med["no_copy"],
            "reused_pinned_us": med["reused_pinned"],
            "snapshot_us": med["snapshot"],
            "snapshot_extra_us": round(med["snapshot"] - med["reused_pinned"], 2),
            "copy_total_us": round(med["snapshot"] - med["no_copy"], 2),
            "snapshot_corrupted": corrupted,
        })
    return {"steps": steps, "busy_ms": busy_ms, "run_ahead": run_ahead, "rounds": rounds, "rows": rows}


def allocator_reuse(nbytes: int = 4 * KiB, busy_ms: float = 50.0, steps: int = 200, run_ahead: int = 3,
                    stream=None) -> dict:
    """Watch PyTorch's caching host allocator keep a snapshot's block until its copy has run.

    Snapshot 1 is copied behind ``busy_ms`` of GPU work and freed; snapshot 2, taken while that
    copy is pending, gets another block; after a sync, snapshot 3 gets snapshot 1's block back
    without a new cudaHostAlloc. Then a step loop (``steps``, run-ahead ``run_ahead``)
    counts the distinct blocks and checks that no block was reused before its copy finished.
    Returns booleans, the new cudaHostAlloc calls per snapshot, a few host_memory_stats()
    entries ({} and zeros on the emulated stream), and the loop's counts; no addresses.
    """
    n_ints = steploop.ints_in("nbytes", nbytes)
    busy_ms = positive_number("busy_ms", busy_ms)
    steps = positive_int("steps", steps)
    run_ahead = positive_int("run_ahead", run_ahead, allow_zero=True)
    stream = steploop.cuda_or(stream, "allocator_reuse()")
    def stats_now() -> dict:
        return stream.host_stats()  # torch.cuda.host_memory_stats(); {} on the emulated stream

    def allocs() -> int:
        return int(stats_now().get("num_host_alloc", 0))

    steploop.warm(stream, ["snapshot"], n_ints, 0.05, None, 1)
    stream.release()
    with stream:
        buf = torch.arange(n_ints, dtype=torch.int32)  # pageable
        dst = torch.zeros(n_ints, dtype=torch.int32, device=stream.device)
        a0 = allocs()
        s1 = buf.pin_memory()
        p1 = int(s1.data_ptr())
        a1 = allocs()
        stream.busy(busy_ms)
        dst.copy_(s1, non_blocking=True)
        copied = stream.Event()
        copied.record()
        del s1  # back to the allocator, with the pending copy's event
        s2 = buf.pin_memory()
        p2 = int(s2.data_ptr())
        a2 = allocs()
        pending = not copied.query()
        stream.synchronize()
        s3 = buf.pin_memory()
        p3 = int(s3.data_ptr())
        a3 = allocs()
        stats = stats_now()
        del s2, s3
        stream.synchronize()
    keep = ("num_host_alloc", "num_host_free", "allocations.current", "allocated_bytes.current",
            "active_requests.current", "active_bytes.current")
    stats = {k: int(stats[k]) for k in keep if k in stats}
    loop = steploop.plain_loop(stream, "snapshot", steps=steps, n_ints=n_ints, busy_ms=0.5, run_ahead=run_ahead,
                               per_step=False, track_blocks=True)
    return {
        "nbytes": nbytes,
        "copy_pending_at_second_snapshot": bool(pending),
        "second_block_differs": p2 != p1,
        "third_reuses_first": p3 == p1,
        "new_host_allocs": [a1 - a0, a2 - a1, a3 - a2],
        "host_memory_stats": stats,
        "loop": {k: loop[k] for k in ("steps", "run_ahead", "corrupted", "distinct_blocks", "blocks_reused",
                                       "reused_before_copy_done")},
    }


def pin_trap(nbytes: int = 256, steps: int = 200, busy_ms: float = 0.5, stream=None) -> dict:
    """``pin_memory()`` of a pinned tensor returns the same storage, so the snapshot pattern on a
    pinned buffer still races. Returns ``same_storage``, ``pageable_gets_new_storage`` and the
    step loop (``race``, as :func:`pinlab.lessons.l03_the_race.plain_race`) for snapshot_of_pinned
    against snapshot."""
    n_ints = steploop.ints_in("nbytes", nbytes)
    steps = positive_int("steps", steps)
    busy_ms = positive_number("busy_ms", busy_ms)
    stream = steploop.cuda_or(stream, "pin_trap()")
    with stream:
        pinned = torch.zeros(n_ints, dtype=torch.int32, pin_memory=True)
        again = pinned.pin_memory()
        same = again.data_ptr() == pinned.data_ptr()
        pageable = torch.zeros(n_ints, dtype=torch.int32)
        snap = pageable.pin_memory()
        differs = snap.data_ptr() != pageable.data_ptr()
        del pinned, again, snap
    race = steploop.every_strategy(stream, strategies=["snapshot_of_pinned", "snapshot"], steps=steps, nbytes=nbytes,
                                   busy_ms=busy_ms, run_ahead=None, per_step=True)
    return {"same_storage": bool(same), "pageable_gets_new_storage": bool(differs), "race": race}


def history(strategies=tuple(HISTORY), steps: int = 1000, nbytes: int = 4 * KiB, busy_ms: float = 0.3,
            run_ahead: int | None = 1, ring_depth: int = 3, rounds: int = 5, stream=None) -> dict:
    """The fixes side by side in one step loop: corrupted steps, host µs per step, pinned bytes.

    ``run_ahead=1``: before writing step n the host waits for step n-2, as vLLM's batch queue does. After a
    warm-up, the approaches (and the no-copy baseline) run round-robin in ``rounds`` interleaved
    rounds (the order rotates), ``steps`` per approach split over the rounds, so that a slow spell
    of the machine does not land on one approach only. Returns ``{"rows": [{"strategy", "label",
    "corrupted", "steps", "host_us", "host_extra_us", "host_p90_us", "round_medians_us",
    "pinned_bytes_held"}], "no_copy_us", "no_copy_round_medians_us", ...}``: ``host_us`` is the
    median over rounds of each round's median host time per step inside write + stage + copy
    (event waits included), ``host_p90_us`` the same for the p90, ``host_extra_us`` ``host_us``
    minus the no-copy baseline's, ``corrupted`` the count over all rounds and
    ``pinned_bytes_held`` the most any round held.
    """
    strategies = steploop.strategies_arg(list(strategies), allow_no_copy=False)
    steps = positive_int("steps", steps, maximum=steploop.MAX_LOOP_STEPS)
    n_ints = steploop.ints_in("nbytes", nbytes)
    busy_ms = positive_number("busy_ms", busy_ms)
    run_ahead = steploop.run_ahead_arg(run_ahead)
    ring_depth = positive_int("ring_depth", ring_depth)
    rounds = positive_int("rounds", rounds, maximum=steps)
    steploop.check_dst(steps, n_ints)
    stream = steploop.cuda_or(stream, "history()")
    names = ["no_copy"] + strategies
    steploop.warm(stream, names, n_ints, busy_ms, run_ahead, ring_depth)
    per_round = split_steps(steps, rounds)
    runs = interleaved(names, rounds, lambda k, r: steploop.plain_loop(
        stream, k, steps=per_round[r], n_ints=n_ints, busy_ms=busy_ms, run_ahead=run_ahead,
        ring_depth=ring_depth, per_step=False))
    meds = {k: [x["host"]["median_us"] for x in v] for k, v in runs.items()}
    p90s = {k: [x["host"]["p90_us"] for x in v] for k, v in runs.items()}
    corrupted = {k: sum(x["corrupted"] for x in v) for k, v in runs.items()}
    held = {k: max(x["pinned_bytes_held"] for x in v) for k, v in runs.items()}
    med = {k: round(statistics.median(v), 2) for k, v in meds.items()}
    rows = []
    for s in strategies:
        rows.append({
            "strategy": s,
            "label": LABELS[s],
            "corrupted": corrupted[s],
            "steps": sum(per_round),
            "host_us": med[s],
            "host_extra_us": round(med[s] - med["no_copy"], 2),
            "host_p90_us": round(statistics.median(p90s[s]), 2),
            "round_medians_us": meds[s],
            "pinned_bytes_held": held[s],
        })
    return {"steps": steps, "nbytes": nbytes, "busy_ms": busy_ms, "run_ahead": run_ahead, "ring_depth": ring_depth,
            "rounds": rounds, "no_copy_us": med["no_copy"], "no_copy_round_medians_us": meds["no_copy"],
            "rows": rows}


# =============================================================================================
# FlashInfer's own plan(): two back-to-back plans on one wrapper, in a child process
# =============================================================================================

#: the plan-hazard children's modes: what the host does between two plans (lesson 09 adds the two fixes)
PLAN_MODES = {
    "synced": "one wrapper, torch.cuda.synchronize() between the two plans (the control)",
    "back_to_back": "one wrapper, the second plan right after the first (the host ahead: the race)",
    "two_wrappers": "one wrapper per step in flight: the second plan on a second wrapper",
    "event_wait": "one wrapper; the host waits for an event recorded after the first step before re-planning",
}

#: the bytes of FlashInfer's pinned int workspace a declared plan() copy covers (its plan info is written
#: from the start of the buffer; a decode plan of a few dozen requests takes a few KiB)
PLAN_INFO_BYTES = 64 * 1024


def _plan_hazard_child(mode: str, busy_ms: float, seed: int, tol: float, watchdog_s: float = 3.0,
                       wait_for_go: bool = False, races: bool = False) -> dict:
    """Runs in a child process: two plans, as :data:`PLAN_MODES` says (``synced``, ``back_to_back``,
    ``two_wrappers``, ``event_wait``). With ``races`` the two steps run under :func:`pinlab.detect_races`,
    and FlashInfer's own staging (its C++ ``cudaMemcpyAsync`` of the plan info from the wrapper's pinned
    ``_pin_memory_int_workspace_buffer``, which no torch call shows) is declared after each ``plan()``
    with ``RaceDetector.copied``; the result then holds ``races`` (findings), ``race_kinds`` and
    ``races_elsewhere`` (findings not at the declared staging). May crash or hang the CUDA context: never
    call it in a process you care about. With ``wait_for_go`` the set-up (CUDA, FlashInfer's first plan+run
    included) is done first, then the child says it is ready (it creates the file named by
    ``PINLAB_READY_FILE``, when set: :func:`run_children` starts its time limit only then) and
    waits for a line on its stdin before the hazard. Once it starts, a watchdog thread reports
    "hung" and ends the process if the two plans' work has not finished within ``watchdog_s``
    seconds."""
    one_of("mode", mode, set(PLAN_MODES))
    watchdog_s = positive_number("watchdog_s", watchdog_s)
    from contextlib import nullcontext

    from ..busy import gpu_busy

    try:
        dec = FlashInferDecode(8, 2, 128, 16)
        dec2 = FlashInferDecode(8, 2, 128, 16) if mode == "two_wrappers" else dec
    except FlashInferUnavailableError as exc:
        return {"status": "unavailable", "detail": str(exc)}
    batches = {}
    for name, size, s in (("a", 3, seed), ("b", 32, seed + 1)):
        rb = random_batch(size, 256, 16, 2, 128, 8, seed=s, device="cuda")
        lens = rb.seq_lens.clamp(min=1)  # every request decodes a token: FlashInfer leaves empty ones unspecified
        meta = build_metadata(rb.block_table, lens, 16)
        ref = reference_decode(rb.q, rb.k_cache, rb.v_cache, meta.indptr_cpu, meta.indices, meta.last_page_len_cpu)
        batches[name] = (meta, rb, ref)
    (ma, ba, ra), (mb, bb, rb_ref) = batches["a"], batches["b"]
    try:
        for d in {id(dec): dec, id(dec2): dec2}.values():
            d.plan(mb.indptr_cpu, mb.indices, mb.last_page_len_cpu)  # JIT build or cache load, then warm
            d.run(bb.q, bb.k_cache, bb.v_cache)
        torch.cuda.synchronize()
    except FlashInferUnavailableError as exc:
        return {"status": "unavailable", "detail": str(exc)}
    det, site = None, "plan(): FlashInfer's own copy of its plan info"
    if races:
        from ..races import detect_races

        if getattr(dec.wrapper, "_pin_memory_int_workspace_buffer", None) is None:
            return {"status": "unavailable", "detail": "this FlashInfer's decode wrapper has no "
                    "_pin_memory_int_workspace_buffer (the pinned workspace its plan() stages through)"}
        det = detect_races()

    def declare(d):  # plan() just wrote its plan info into d's pinned workspace and queued its copy
        if det is not None:
            ws = d.wrapper._pin_memory_int_workspace_buffer
            det.copied(ws, nbytes=min(PLAN_INFO_BYTES, ws.numel() * ws.element_size()), where=site)

    def found() -> dict:
        if det is None:
            return {}
        counts = dict(det.report.counts)
        elsewhere = sum(1 for f in det.report.findings if f.copy_where != site)
        return {"races": det.report.total, "race_kinds": counts, "races_elsewhere": elsewhere}
    if os.environ.get("PINLAB_READY_FILE"):
        Path(os.environ["PINLAB_READY_FILE"]).touch()  # set-up done: the parent's time limit starts now
    if wait_for_go:
        sys.stdin.readline()  # the parent says when: never two hazards on the GPU at once
    watchdog = threading.Timer(watchdog_s, lambda: report_and_exit(
        {"status": "hung", "detail": f"the two plans' work had not finished {watchdog_s:g} s after it was queued",
         **found()}))
    watchdog.daemon = True
    watchdog.start()
    step_done = torch.cuda.Event()
    try:
        with det if det is not None else nullcontext():
            gpu_busy(busy_ms)  # both plans' copies of their plan info wait behind this
            dec.plan(ma.indptr_cpu, ma.indices, ma.last_page_len_cpu)
            declare(dec)
            oa = dec.run(ba.q, ba.k_cache, ba.v_cache)
            if mode == "synced":
                torch.cuda.synchronize()
            elif mode == "event_wait":
                step_done.record()
                step_done.synchronize()  # the first step (its plan's copy included) has run
            dec2.plan(mb.indptr_cpu, mb.indices, mb.last_page_len_cpu)
            declare(dec2)
            ob = dec2.run(bb.q, bb.k_cache, bb.v_cache)
            torch.cuda.synchronize()
        err_a = float((oa.float() - ra).abs().max())
        err_b = float((ob.float() - rb_ref).abs().max())
    except Exception as exc:  # an illegal memory access surfaces here
        return {"status": "crashed", "detail": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}",
                **found()}
    finally:
        watchdog.cancel()
    wrong = err_a > tol or err_b > tol or not (math.isfinite(err_a) and math.isfinite(err_b))
    return {"status": "wrong output" if wrong else "correct", "err_a": err_a, "err_b": err_b,
            "detail": f"max error {err_a:.3g} (first batch), {err_b:.3g} (second)", **found()}


def child_code(mode: str, busy_ms: float, seed: int, tol: float, watchdog_s: float = 3.0,
               races: bool = False) -> str:
    """The ``python -c`` program of one plan-hazard child: it sets up, waits for a line on stdin,
    runs :func:`_plan_hazard_child` and prints its result on a ``PINLAB_CHILD`` line (:func:`pinlab.child.report_and_exit`)."""
    return (
        "from pinlab.lessons import l04_the_fix as fix\n"
        f"r = fix._plan_hazard_child({mode!r}, {busy_ms!r}, {seed!r}, {tol!r}, {watchdog_s!r}, wait_for_go=True, "
        f"races={bool(races)!r})\n"
        "fix.report_and_exit(r)\n"
    )


def _context_ok() -> bool:
    try:
        x = torch.ones(4, device="cuda")
        return bool((x * 2).sum().item() == 8.0)
    except Exception:
        return False


def plan_hazard(busy_ms: float = 50.0, seed: int = 0, tol: float = 0.02, timeout_s: float = 12.0,
                watchdog_s: float = 3.0, startup_s: float = 600.0) -> dict:
    """Two ``plan()`` calls on one FlashInfer wrapper while the GPU is busy, each in a child process.

    FlashInfer's ``plan()`` writes its plan info into one pinned buffer per wrapper and copies it
    to the GPU with ``cudaMemcpyAsync``: the same class of hazard as the lessons' reused buffer.
    ``synced`` (a sync between the two plans: the control) and ``back_to_back`` (no sync, as under
    overlap scheduling) each run in a fresh ``python -c`` child, so a crash or a hang cannot touch
    this process. Both children set up at once (Python, torch, CUDA, FlashInfer's first plan+run:
    seconds, more with a JIT build or a busy machine), each within ``startup_s`` of its start, and
    say when they are ready; the hazards then run one after the other (:func:`run_children`), so
    ``timeout_s`` covers a child's hazard only, never its set-up. A child reports "hung" itself
    when the plans' work has not finished ``watchdog_s`` after it was queued, and is killed
    ``timeout_s`` after its go in any case; one whose set-up outlasts ``startup_s`` is reported
    "unavailable" (not tested). The batches
    come from :func:`pinlab.paged_kv.random_batch`. CUDA only (a child process has its own CUDA
    context; no stream argument). Returns ``{"synced": outcome, "back_to_back": outcome,
    "parent_context_ok": bool, "timeout_s"}``, each outcome from :func:`classify_child` plus
    ``seconds`` and ``returncode``.
    """
    busy_ms = positive_number("busy_ms", busy_ms)
    seed = positive_int("seed", seed, allow_zero=True)
    tol = positive_number("tol", tol)
    timeout_s = positive_number("timeout_s", timeout_s)
    watchdog_s = positive_number("watchdog_s", watchdog_s)
    startup_s = positive_number("startup_s", startup_s, maximum=3600.0)
    require_cuda("plan_hazard()")
    from ..paged_kv import flashinfer_available

    ok, reason = flashinfer_available()
    modes = ("synced", "back_to_back")
    if ok:
        print("plan_hazard: running the synced, then the back_to_back child (fresh Python processes)...",
              file=sys.stderr, flush=True)
        out = run_children({m: child_code(m, busy_ms, seed, tol, watchdog_s) for m in modes}, timeout_s,
                           ready_timeout_s=startup_s)
    else:  # nothing to test: do not spend a child process on it
        out = {m: {"outcome": "unavailable", "detail": reason, "seconds": 0.0, "returncode": None} for m in modes}
    out["parent_context_ok"] = _context_ok()
    out["timeout_s"] = timeout_s
    return out


# =============================================================================================
# A decode step's several metadata tensors: every fix in one loop, checked on the device
# =============================================================================================

#: A decode step's metadata for 256 requests (int32 entries per tensor), the tensors FlashInfer's
#: paged decode and the KV-cache write need each step.
METADATA = {"indptr": 257, "indices": 4096, "last_page_len": 256, "seq_lens": 256, "slot_mapping": 256,
            "positions": 256}

#: The per-tensor ways of moving them, one copy per tensor (:class:`PerTensor`).
PER_TENSOR = {
    "reused_pinned": "reused pinned buffers (the race)",
    "pageable": "pageable buffers (#32799)",
    "snapshot": "a pin_memory() snapshot per tensor (the PR)",
}

#: Labels of :func:`fix_race`'s strategies.
FIX_LABELS = dict(PER_TENSOR, slab_ring="slab ring (one pinned slab per step, one copy)")


def _entries(name: str, sizes) -> list[int]:
    if isinstance(sizes, (str, bytes, dict)) or not hasattr(sizes, "__iter__"):
        raise TypeError(f"{name} must be a list of tensor lengths (int32 entries), got {type(sizes).__name__}")
    out = [positive_int(f"{name}[{i}]", v, maximum=64 * 1024 * 1024) for i, v in enumerate(sizes)]
    if not out:
        raise ValueError(f"{name} must not be empty")
    return out


class PerTensor:
    """One ``non_blocking`` copy per tensor, from reused pinned buffers (``reused_pinned``: the
    race), reused pageable buffers (``pageable``) or a ``pin_memory()`` snapshot of reused pageable
    buffers (``snapshot``: the PR). Create it inside ``with stream:``. :func:`metadata_loop` calls
    ``host()`` (the host tensors to write this step's values into) and ``send()`` (enqueue the
    copies; returns the device tensors that hold the step)."""

    def __init__(self, stream, sizes, kind: str):
        self.kind = one_of("kind", kind, PER_TENSOR)
        sizes = _entries("sizes", sizes)
        pinned = self.kind == "reused_pinned"
        self.bufs = [torch.zeros(k, dtype=torch.int32, pin_memory=pinned) for k in sizes]
        self.dev = [torch.zeros(k, dtype=torch.int32, device=stream.device) for k in sizes]

    def host(self):
        return self.bufs

    def send(self):
        snap = self.kind == "snapshot"
        for d, b in zip(self.dev, self.bufs):
            d.copy_(b.pin_memory() if snap else b, non_blocking=True)
        return self.dev


def _check_step(outs, cat, base, n, bad):
    """Device work: tensor i of step n must hold 8n + i everywhere; count the step in ``bad`` if not."""
    torch.cat(outs, out=cat)
    cat.sub_(base)
    bad.add_(cat.ne(8 * n).any())


def metadata_loop(stream, make, *, steps: int, sizes, busy_ms: float, run_ahead: int = 1,
                  per_step: bool = False) -> dict:
    """This loop, for any way of moving a step's metadata tensors (``make(stream, sizes)`` builds it).

    Step n: [untimed: run-ahead ``run_ahead`` k, wait for step n-k-1's "done" event, the engine's batch
    queue]; then,
    timed together, ``views = mover.host()``, tensor i filled with ``8n + i``, ``outs = mover.send()``;
    then, untimed, a device check of ``outs`` (into a device error counter, read once at the end:
    no sync per step), the "done" event and ``busy_ms`` of GPU work. Returns ``{"steps",
    "corrupted" (steps whose tensors did not all hold their own step's values), "host" (µs per
    step: median, mean, p90, max), "host_loop_ms"}``, with ``per_step`` also ``host_ns``.
    """
    callable_arg("make", make)
    steps = positive_int("steps", steps, maximum=steploop.MAX_LOOP_STEPS)
    sizes = _entries("sizes", sizes)
    busy_ms = positive_number("busy_ms", busy_ms)
    run_ahead = positive_int("run_ahead", run_ahead, allow_zero=True)
    stream = steploop.cuda_or(stream, "metadata_loop()")
    host_ns = [0] * steps
    total = sum(sizes)
    with stream:
        mover = make(stream, list(sizes))
        if not (callable(getattr(mover, "host", None)) and callable(getattr(mover, "send", None))):
            raise TypeError(f"make must return an object with host() and send(), got {type(mover).__name__}")
        base_host = torch.cat([torch.full((k,), i, dtype=torch.int32) for i, k in enumerate(sizes)])
        base = torch.zeros(total, dtype=torch.int32, device=stream.device)
        base.copy_(base_host)
        cat = torch.zeros(total, dtype=torch.int32, device=stream.device)
        bad = torch.zeros(1, dtype=torch.int64, device=stream.device)
        gate = steploop.RunAheadGate(stream, run_ahead)
        t_loop = time.perf_counter()
        for n in range(steps):
            gate.wait(n)  # untimed: at most run_ahead steps still queued when the host writes step n
            t0 = time.perf_counter_ns()
            views = mover.host()
            for i, v in enumerate(views):
                v.fill_(8 * n + i)
            outs = mover.send()
            host_ns[n] = time.perf_counter_ns() - t0
            if n == 0 and (len(views) != len(sizes) or len(outs) != len(sizes)):
                raise ValueError(f"the mover must give one host and one device tensor per size ({len(sizes)}), "
                                 f"got {len(views)} and {len(outs)}")
            stream.launch(_check_step, outs, cat, base, n, bad)
            gate.record(n)
            stream.busy(busy_ms)
        host_loop_ms = (time.perf_counter() - t_loop) * 1e3
        stream.synchronize()
        corrupted = int(bad.item())
        del mover, outs, views
    out = {"steps": steps, "corrupted": corrupted, "host": steploop.time_summary_us(host_ns),
           "host_loop_ms": round(host_loop_ms, 2)}
    if per_step:
        out["host_ns"] = host_ns
    return out


def log_histogram(values_us, lo: float = 1.0, hi: float = 1e5, per_decade: int = 10) -> dict:
    """Counts of ``values_us`` in log-spaced bins from ``lo`` to ``hi`` µs (values outside go to the
    first or last bin). Returns ``{"edges": [...], "counts": [...]}`` (len(edges) = len(counts) + 1)."""
    lo = positive_number("lo", lo)
    hi = positive_number("hi", hi)
    per_decade = positive_int("per_decade", per_decade, maximum=100)
    if hi <= lo:
        raise ValueError(f"hi ({hi}) must be larger than lo ({lo})")
    k = max(1, math.ceil(math.log10(hi / lo) * per_decade))
    edges = [lo * 10 ** (j / per_decade) for j in range(k + 1)]
    counts = [0] * k
    for v in values_us:
        v = float(v)
        if not math.isfinite(v):
            raise ValueError(f"values_us must be finite, got {v}")
        j = 0 if v <= lo else min(k - 1, int(math.log10(v / lo) * per_decade))
        counts[j] += 1
    return {"edges": [round(e, 3) for e in edges], "counts": counts}


def _pcts(us) -> dict:
    return {f"p{q}_us": round(steploop.percentile(us, q / 100 if q < 100 else 1.0), 2)
            for q in (10, 50, 90, 99)} | {"max_us": round(max(us), 2)}


def fix_race(make_slab, steps: int = 10_000, sizes=tuple(METADATA.values()), busy_ms: float = 0.3, run_ahead: int = 1,
             depth: int = 3, rounds: int = 4, stream=None) -> dict:
    """Every fix for a step's several metadata tensors, in one loop (:func:`metadata_loop`).

    Strategies: the three of :class:`PerTensor` and ``slab_ring``, built by the notebook's
    ``make_slab(stream, sizes, depth)``. ``steps`` per strategy, split into ``rounds`` interleaved
    rounds (the order rotates), after a short warm-up. Returns ``{"rows": [{"strategy", "label",
    "steps", "corrupted", "median_us", "p10_us", "p90_us", "p99_us", "max_us", "round_medians_us",
    "hist"}], ...}``: host µs per step over all the strategy's steps, the median of each round,
    and a log histogram.
    """
    callable_arg("make_slab", make_slab)
    steps = positive_int("steps", steps, maximum=steploop.MAX_LOOP_STEPS)
    sizes = _entries("sizes", sizes)
    busy_ms = positive_number("busy_ms", busy_ms)
    run_ahead = positive_int("run_ahead", run_ahead, allow_zero=True)
    depth = positive_int("depth", depth)
    rounds = positive_int("rounds", rounds, maximum=steps)
    stream = steploop.cuda_or(stream, "fix_race()")
    makers = {k: (lambda st, sz, k=k: PerTensor(st, sz, k)) for k in PER_TENSOR}
    makers["slab_ring"] = lambda st, sz: make_slab(st, sz, depth)
    names = list(makers)
    for k in names:  # warm-up: kernels, pinned blocks, events
        metadata_loop(stream, makers[k], steps=2 * run_ahead + 6, sizes=sizes, busy_ms=min(busy_ms, 0.05),
                      run_ahead=run_ahead)
    per_round = split_steps(steps, rounds)
    runs = interleaved(names, rounds, lambda k, r: metadata_loop(
        stream, makers[k], steps=per_round[r], sizes=sizes, busy_ms=busy_ms, run_ahead=run_ahead, per_step=True))
    rounds_us = {k: [[v / 1e3 for v in x["host_ns"]] for x in v] for k, v in runs.items()}
    host = {k: [u for us in v for u in us] for k, v in rounds_us.items()}
    meds = {k: [round(statistics.median(us), 2) for us in v] for k, v in rounds_us.items()}
    bad = {k: sum(x["corrupted"] for x in v) for k, v in runs.items()}
    rows = []
    for k in names:
        rows.append({"strategy": k, "label": FIX_LABELS[k], "steps": len(host[k]), "corrupted": bad[k],
                     **_pcts(host[k]), "round_medians_us": meds[k], "hist": log_histogram(host[k])})
    return {"steps": steps, "sizes": sizes, "tensors": len(sizes), "bytes_per_step": 4 * sum(sizes),
            "busy_ms": busy_ms, "run_ahead": run_ahead, "depth": depth, "rounds": rounds, "rows": rows}


def shared_pool(totals=(24 * KiB, 192 * KiB, 768 * KiB, 3 * 1024 * KiB, 6 * 1024 * KiB), tensors: int = 6,
                steps: int = 80, busy_ms: float = 0.5, run_ahead: int = 1, rounds: int = 3, stream=None) -> dict:
    """Several tensors per step sharing the driver's staging: pageable buffers against a snapshot
    per tensor, for per-step totals from a few KiB to a few MiB (``tensors`` equal tensors each).

    For each total: interleaved ``rounds`` of ``steps`` steps of each (:func:`metadata_loop`, run-ahead
    ``run_ahead``, ``busy_ms`` of GPU work per step); each value is the median
    over rounds of each round's median host µs per step. Returns ``{"rows": [{"total_bytes",
    "tensor_bytes", "pageable_us", "snapshot_us", "pageable_p90_us", "snapshot_p90_us",
    "corrupted"}], ...}`` (``corrupted``: both strategies, all rounds).
    """
    totals = steploop.sizes_arg(totals)
    tensors = positive_int("tensors", tensors, maximum=64)
    steps = positive_int("steps", steps, maximum=steploop.MAX_LOOP_STEPS)
    busy_ms = positive_number("busy_ms", busy_ms)
    run_ahead = positive_int("run_ahead", run_ahead, allow_zero=True)
    rounds = positive_int("rounds", rounds)
    for i, t in enumerate(totals):
        if t % (4 * tensors):
            raise ValueError(f"totals[{i}] ({t}) must split into {tensors} int32 tensors of equal size")
        if t > 256 * 1024 * KiB:
            raise ValueError(f"totals[{i}] ({t}) is more than 256 MiB per step: a typo, not metadata")
    stream = steploop.cuda_or(stream, "shared_pool()")
    names = ["pageable", "snapshot"]
    rows = []
    for t in totals:
        sizes = [t // 4 // tensors] * tensors
        for k in names:
            metadata_loop(stream, lambda st, sz, k=k: PerTensor(st, sz, k), steps=2 * run_ahead + 4, sizes=sizes,
                          busy_ms=min(busy_ms, 0.05), run_ahead=run_ahead)
        runs = interleaved(names, rounds, lambda k, r: metadata_loop(
            stream, lambda st, sz: PerTensor(st, sz, k), steps=steps, sizes=sizes, busy_ms=busy_ms,
            run_ahead=run_ahead))
        meds = {k: [x["host"]["median_us"] for x in v] for k, v in runs.items()}
        p90 = {k: [x["host"]["p90_us"] for x in v] for k, v in runs.items()}
        corrupted = sum(x["corrupted"] for v in runs.values() for x in v)
        med = lambda v: round(statistics.median(v), 2)  # noqa: E731
        rows.append({"total_bytes": t, "tensor_bytes": t // tensors,
                     "pageable_us": med(meds["pageable"]), "snapshot_us": med(meds["snapshot"]),
                     "pageable_p90_us": med(p90["pageable"]), "snapshot_p90_us": med(p90["snapshot"]),
                     "corrupted": corrupted})
    return {"tensors": tensors, "steps": steps, "busy_ms": busy_ms, "run_ahead": run_ahead, "rounds": rounds,
            "rows": rows}


# =============================================================================================
# The soak: ten thousand snapshots cold, warmed, and with a reserved pinned segment (children)
# =============================================================================================

SOAK_PASSES = ("cold", "warmed", "reserved")


def _soak_loop(steps: int, n_ints: int, busy_ms: float) -> dict:
    """In a child, on CUDA: the snapshot loop with unbounded run-ahead; per-step host ns of
    write + pin_memory() + copy, corrupted steps (checked on the device), blocks and allocations."""
    from ..busy import gpu_busy
    from ..hostmem import host_stats

    rows = 4
    buf = torch.zeros(n_ints, dtype=torch.int32)  # pageable, reused every step
    dst = torch.zeros(rows, n_ints, dtype=torch.int32, device="cuda")
    mm = torch.zeros(steps, 2, dtype=torch.int32, device="cuda")
    host_ns = [0] * steps
    ptrs = set()
    s0 = host_stats()
    torch.cuda.synchronize()
    for n in range(steps):
        t0 = time.perf_counter_ns()
        buf.fill_(n)
        snap = buf.pin_memory()
        dst[n % rows].copy_(snap, non_blocking=True)
        host_ns[n] = time.perf_counter_ns() - t0
        ptrs.add(snap.data_ptr())
        del snap
        torch.aminmax(dst[n % rows], out=(mm[n, 0], mm[n, 1]))
        gpu_busy(busy_ms)
    torch.cuda.synchronize()
    s1 = host_stats()
    received = steploop.received_from_minmax(mm.cpu().tolist())
    return {"host_us": [round(v / 1e3, 2) for v in host_ns],
            "corrupted": steploop.corruption_summary(received)["corrupted"],
            "distinct_blocks": len(ptrs),
            "new_blocks": int(s1.get("num_host_alloc", 0) - s0.get("num_host_alloc", 0)),
            "slow_allocs": int(s1.get("host_alloc_time.count", 0) - s0.get("host_alloc_time.count", 0))}


def _soak_child(passes, steps: int, nbytes: int, busy_ms: float, warm_blocks: int, wait_for_go: bool = False) -> dict:
    """Runs in a child process (a fresh caching host allocator). ``passes`` in order: "cold" (the
    cache emptied first), "warmed" (emptied, then ``warm_blocks`` blocks allocated and freed),
    "reserved" (run as is: the child was started with a reserved pinned segment)."""
    from ..busy import gpu_busy
    from ..hostmem import release_cached_host_blocks

    n_ints = steploop.ints_in("nbytes", nbytes)
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    if not torch.cuda.is_available():
        return {"status": "unavailable", "conf": conf, "detail": "no CUDA device in the child process"}
    try:
        torch.zeros(1, device="cuda")
        torch.zeros(4, dtype=torch.int32).pin_memory()
    except Exception as exc:  # e.g. an allocator setting this torch does not know
        return {"status": "rejected", "conf": conf,
                "detail": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"}
    gpu_busy(0.05)
    _soak_loop(16, n_ints, 0.05)  # kernels loaded, nothing timed
    torch.cuda.synchronize()
    if os.environ.get("PINLAB_READY_FILE"):
        Path(os.environ["PINLAB_READY_FILE"]).touch()  # set-up done: the parent may start a timed child
    if wait_for_go:
        sys.stdin.readline()
    out = {}
    for p in passes:
        one_of("passes", p, SOAK_PASSES)
        release_cached_host_blocks()
        warm_ms = 0.0
        if p == "warmed":
            t0 = time.perf_counter()
            blocks = [torch.empty(n_ints, dtype=torch.int32, pin_memory=True) for _ in range(warm_blocks)]
            del blocks
            warm_ms = (time.perf_counter() - t0) * 1e3
        out[p] = _soak_loop(steps, n_ints, busy_ms)
        out[p]["warm_ms"] = round(warm_ms, 1)
    return {"status": "correct", "detail": "ran", "conf": conf, "passes": out}


def soak_child_code(passes, steps: int, nbytes: int, busy_ms: float, warm_blocks: int) -> str:
    """The ``python -c`` program of one soak child (see :func:`_soak_child`)."""
    return (
        "from pinlab.lessons import l04_the_fix as fix\n"
        f"r = fix._soak_child({list(passes)!r}, {steps!r}, {nbytes!r}, {busy_ms!r}, {warm_blocks!r},"
        " wait_for_go=True)\n"
        "fix.report_and_exit(r)\n"
    )


def _soak_summary(p: dict) -> dict:
    us = p["host_us"]
    return {"steps": len(us), "corrupted": p["corrupted"], "distinct_blocks": p["distinct_blocks"],
            "new_blocks": p["new_blocks"], "slow_allocs": p["slow_allocs"], "warm_ms": p.get("warm_ms", 0.0),
            **_pcts(us), "p999_us": round(steploop.percentile(us, 0.999), 2),
            "over_100us": sum(v > 100 for v in us), "over_1ms": sum(v > 1000 for v in us),
            "total_ms": round(sum(us) / 1e3, 2), "hist": log_histogram(us)}


def snapshot_soak(steps: int = 10_000, nbytes: int = 4 * KiB, busy_ms: float = 0.1, control_steps: int = 1_000,
                  warm_blocks: int = 1024, reserve_mb: int = 64, timeout_s: float = 60.0) -> dict:
    """Ten thousand ``pin_memory()`` snapshots with unbounded run-ahead, three ways, each in a fresh
    child process: ``cold`` (an empty cache: every new block is a ``cudaHostAlloc``), ``warmed``
    (``warm_blocks`` blocks allocated and freed first, same child) and ``reserved`` (a child started
    with ``PYTORCH_CUDA_ALLOC_CONF=pinned_reserve_segment_size_mb:<reserve_mb>``); then, here, the
    reused pinned buffer as a control (it must corrupt, or the soak proves nothing).

    Returns ``{"passes": {name: summary}, "reserve": {"accepted", "detail"}, "control": run, ...}``;
    a summary holds the host µs percentiles, a log histogram, ``new_blocks`` (blocks the allocator
    created), ``slow_allocs`` (its calls into ``cudaHostAlloc``), ``distinct_blocks`` and
    ``corrupted``. A pass whose child failed is missing from ``passes`` (see ``children``).
    """
    steps = positive_int("steps", steps, maximum=steploop.MAX_LOOP_STEPS)
    n_ints = steploop.ints_in("nbytes", nbytes)
    busy_ms = positive_number("busy_ms", busy_ms)
    control_steps = positive_int("control_steps", control_steps, maximum=steploop.MAX_LOOP_STEPS)
    warm_blocks = positive_int("warm_blocks", warm_blocks, maximum=100_000)
    reserve_mb = positive_int("reserve_mb", reserve_mb, maximum=64 * 1024)
    timeout_s = positive_number("timeout_s", timeout_s)
    require_cuda("snapshot_soak()")
    conf = f"pinned_reserve_segment_size_mb:{reserve_mb}"
    codes = {"default": soak_child_code(["cold", "warmed"], steps, nbytes, busy_ms, warm_blocks),
             "reserved": soak_child_code(["reserved"], steps, nbytes, busy_ms, warm_blocks)}
    envs = {"default": {"PYTORCH_CUDA_ALLOC_CONF": None, "PYTORCH_ALLOC_CONF": None},
            "reserved": {"PYTORCH_CUDA_ALLOC_CONF": conf, "PYTORCH_ALLOC_CONF": None}}
    print("snapshot_soak: two fresh Python processes (default allocator; reserved pinned segment)...",
          file=sys.stderr, flush=True)
    children = run_children(codes, timeout_s, envs=envs, ready_timeout_s=timeout_s)
    passes = {}
    for name, res in children.items():
        for p, data in (res.get("passes") or {}).items():
            passes[p] = _soak_summary(data)
    rc = children["reserved"]
    accepted = rc["outcome"] == "correct" and "reserved" in passes
    stream = steploop.cuda_or(None, "snapshot_soak()")
    steploop.warm(stream, ["reused_pinned"], n_ints, busy_ms, None, 1)
    control = steploop.plain_loop(stream, "reused_pinned", steps=control_steps, n_ints=n_ints, busy_ms=busy_ms,
                                  run_ahead=None, per_step=False)
    return {"steps": steps, "nbytes": nbytes, "busy_ms": busy_ms, "warm_blocks": warm_blocks,
            "reserve_conf": conf, "reserve": {"accepted": accepted, "detail": str(rc.get("detail", ""))[:200]},
            "passes": passes,
            "children": {k: {"outcome": v["outcome"], "detail": str(v.get("detail", ""))[:200],
                             "seconds": v.get("seconds")} for k, v in children.items()},
            "control": control}


# =============================================================================================
# Plots (computed from recorded results, identical live and replayed)
# =============================================================================================

def _check_history(result) -> None:
    """``result`` must be a :func:`history` result: TypeError naming the missing part otherwise."""
    if not isinstance(result, dict):
        raise TypeError(f"result must be a history() result (a dict), got {type(result).__name__}")
    for key in ("rows", "steps", "no_copy_us"):
        if key not in result:
            raise TypeError(f"result must be a history() result: result[{key!r}] is missing "
                            f"(got keys {sorted(map(str, result))[:8]})")
    rows = result["rows"]
    if not isinstance(rows, list) or not rows:
        raise TypeError(f"result['rows'] must be a non-empty list of rows, got {rows!r}"[:200])
    positive_number("result['no_copy_us']", result["no_copy_us"], allow_zero=True)
    for i, r in enumerate(rows):
        if not isinstance(r, dict):
            raise TypeError(f"result['rows'][{i}] must be a dict, got {type(r).__name__}")
        for key in ("label", "corrupted", "host_us", "pinned_bytes_held"):
            if key not in r:
                raise TypeError(f"result['rows'][{i}][{key!r}] is missing (a row of history())")
            if key != "label":
                positive_number(f"result['rows'][{i}][{key!r}]", r[key], allow_zero=True)


def plot_history(result: dict, *, title: str):
    """Three bar charts, stacked: corrupted steps, host µs per step (the step without a copy dashed, labelled right
    of the axes, over no bar or value), pinned KiB held."""
    _check_history(result)
    rows = result["rows"]
    labels = [r["label"] for r in rows]
    fig, axes = stacked(3, height=3.0)
    panels = [
        ("corrupted", f"corrupted steps (of {result['steps']})", "{:.0f}"),
        ("host_us", "host µs per step (median)", "{:.1f}"),
        ("pinned_kib", "pinned KiB held", "{:.0f}"),
    ]
    for ax, (key, ylabel, fmt) in zip(axes, panels):
        vals = [r["pinned_bytes_held"] / 1024 if key == "pinned_kib" else r[key] for r in rows]
        bars = ax.bar(range(len(vals)), vals, color=[color_for(lab) for lab in labels])
        for b, v in zip(bars, vals):
            ax.annotate(fmt.format(v), (b.get_x() + b.get_width() / 2, b.get_height()), ha="center",
                        va="bottom", fontsize=9)
        ax.set_xticks(range(len(vals)), labels if ax is axes[-1] else [""] * len(vals), rotation=30, ha="right")
        ax.set_ylabel(ylabel)
        ax.grid(True, axis="y", alpha=0.3)
        if key == "host_us":
            ax.axhline(result["no_copy_us"], ls="--", c="grey", lw=1)
            label_line(ax, result["no_copy_us"], "no copy")
        headroom(ax)  # the tallest bar's value stays inside its panel
    fig.suptitle(title)
    return axes


def _hist_lines(ax, rows, key_label, hist_key="hist", ncols=None):
    for r in rows:
        h = r[hist_key]
        total = max(1, sum(h["counts"]))
        ax.stairs([c / total for c in h["counts"]], h["edges"], label=r[key_label], color=color_for(r[key_label]),
                  lw=1.6)
    ax.set_xscale("log")
    ax.set_ylabel("share of steps")
    ax.grid(True, alpha=0.3, which="both")
    legend_outside(ax, ncols=ncols)


def plot_host_times(result: dict, *, title: str):
    """Top: host µs per step, a log histogram per strategy. Bottom: each strategy's median as a
    horizontal bar in the same colour, with the range of its round medians, its label wrapped and
    its corrupted steps under it."""
    import textwrap

    rows = result["rows"]
    fig, (a1, a2) = stacked(2, height=3.4)
    _hist_lines(a1, rows, "label", ncols=2)
    a1.set_xlabel("host µs per step (write + stage + copy), log scale")
    meds = [r["p50_us"] for r in rows]
    lo = [r["p50_us"] - min(r["round_medians_us"]) for r in rows]
    hi = [max(r["round_medians_us"]) - r["p50_us"] for r in rows]
    ys = range(len(rows))
    bars = a2.barh(ys, meds, xerr=[[max(0, v) for v in lo], [max(0, v) for v in hi]], capsize=4,
                   color=[color_for(r["label"]) for r in rows])
    for b, v, h in zip(bars, meds, hi):
        a2.annotate(f"{v:.1f}", (b.get_width() + max(0, h), b.get_y() + b.get_height() / 2), xytext=(4, 0),
                    textcoords="offset points", ha="left", va="center", fontsize=9)
    a2.set_yticks(ys, [f"{textwrap.fill(r['label'], 28)}\n{r['corrupted']} corrupted" for r in rows], fontsize=9)
    a2.invert_yaxis()  # the first strategy on top
    a2.set_xlim(0, max(m + max(0, h) for m, h in zip(meds, hi)) * 1.15 or 1.0)  # room for the numbers
    a2.set_xlabel("host µs per step: median (whisker: the round medians' range)")
    a2.grid(True, axis="x", alpha=0.3)
    fig.suptitle(title)
    return a1, a2


def plot_shared_pool(result: dict, *, title: str):
    """Host µs per step against the bytes copied per step, pageable against snapshots (log-log)."""
    from ..plots import fmt_bytes

    rows = result["rows"]
    x = [r["total_bytes"] for r in rows]
    fig, ax = subplots(figsize=(MAX_WIDTH_IN, 4.2))
    ax.plot(x, [r["pageable_us"] for r in rows], "o-", label="pageable buffers", color=color_for("pageable buffers"))
    ax.plot(x, [r["snapshot_us"] for r in rows], "s-", label="pin_memory() snapshot per tensor",
            color=color_for("pin_memory() snapshot per tensor"))
    ax.axhline(result["busy_ms"] * 1e3, ls="--", c="grey", lw=1)
    label_line(ax, result["busy_ms"] * 1e3, "GPU work\nper step")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(x, [fmt_bytes(v) for v in x])
    ax.set_xlabel(f"bytes copied per step ({result['tensors']} tensors)")
    ax.set_ylabel("host µs per step (median)")
    ax.grid(True, alpha=0.3, which="both")
    legend_outside(ax)
    ax.set_title(title)
    return ax


def plot_soak(result: dict, *, title: str):
    """Host µs per snapshot step, a log histogram per pass (cold, warmed, reserved)."""
    rows = [dict(p, label=f"{name} (max {p['max_us'] / 1e3:.2f} ms)") for name, p in result["passes"].items()]
    fig, ax = subplots(figsize=(MAX_WIDTH_IN, 4.2))
    _hist_lines(ax, rows, "label")
    ax.set_yscale("log")
    ax.set_xlabel("host µs per step (write + pin_memory() + copy), log scale")
    ax.set_title(title)
    return ax
