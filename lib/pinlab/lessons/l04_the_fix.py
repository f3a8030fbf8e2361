"""Lesson 04, the fix: its experiments and plots.

The notebook writes the ``pin_memory()`` snapshot and the event-guarded ring itself and runs
them live (GPU) or on the emulated lagging stream (CPU). The experiments here measure them on the
GPU with the step loop of :mod:`pinlab.steploop`:

* :func:`snapshot_soak`: ten thousand snapshot steps with unbounded run-ahead, and a control;
* :func:`allocator_reuse`: the caching host allocator keeps a snapshot's block until its copy ran;
* :func:`pin_trap`: ``pin_memory()`` of a pinned tensor is that tensor;
* :func:`snapshot_cost`: the host µs the snapshot adds per step;
* :func:`history`: every fix vLLM tried, in one loop;
* :func:`plan_hazard`: FlashInfer's own ``plan()`` buffer, in child processes.

Each step-loop experiment takes ``stream=None``: None means the CUDA stream (CudaUnavailableError
without CUDA); a :class:`pinlab.LaggingStream` runs the same code on the CPU. The decode loop
with the snapshot is :func:`pinlab.lessons.l03_the_race.decode_race`.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from .. import steploop
from ..args import one_of, positive_int, positive_number, require_cuda
from ..paged_kv import FlashInferDecode, FlashInferUnavailableError, build_metadata, random_batch, reference_decode
from ..steploop import HISTORY, KiB, LABELS

__all__ = ["snapshot_soak", "allocator_reuse", "pin_trap", "snapshot_cost", "history", "plan_hazard",
           "classify_child", "child_code", "run_children", "plot_history"]


def snapshot_soak(steps: int = 10_000, nbytes: int = 4 * KiB, busy_ms: float = 0.2, control_steps: int = 1_000,
                  stream=None) -> dict:
    """Many steps of the pin_memory() snapshot with unbounded run-ahead, and a control.

    Returns ``{"snapshot": run, "control": run}`` (runs as :func:`pinlab.steploop.plain_loop`,
    without per-step lists). The snapshot run also has ``distinct_blocks`` (pinned blocks the
    snapshots used), ``blocks_reused`` and ``reused_before_copy_done`` (how often a block came
    back while its previous copy had not finished: it must be 0). The control is the reused pinned
    buffer under the same load: it must corrupt, or the soak proves nothing.
    """
    steps = positive_int("steps", steps)
    control_steps = positive_int("control_steps", control_steps)
    n_ints = steploop.ints_in("nbytes", nbytes)
    busy_ms = positive_number("busy_ms", busy_ms)
    steploop.check_dst(max(steps, control_steps), n_ints)
    stream = steploop.cuda_or(stream, "snapshot_soak()")
    steploop.warm(stream, ["snapshot", "reused_pinned"], n_ints, busy_ms, None, 1)
    snap = steploop.plain_loop(stream, "snapshot", steps=steps, n_ints=n_ints, busy_ms=busy_ms, ahead=None,
                               per_step=False, track_blocks=True)
    control = steploop.plain_loop(stream, "reused_pinned", steps=control_steps, n_ints=n_ints, busy_ms=busy_ms,
                                  ahead=None, per_step=False)
    return {"nbytes": nbytes, "busy_ms": busy_ms, "snapshot": snap, "control": control}


def snapshot_cost(sizes=(KiB, 4 * KiB, 16 * KiB, 64 * KiB), steps: int = 500, busy_ms: float = 0.1,
                  ahead: int | None = 2, rounds: int = 5, stream=None) -> dict:
    """Host µs per step of the snapshot, against the same loop without it.

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
    ahead = steploop.ahead_arg(ahead)
    rounds = positive_int("rounds", rounds)
    steploop.check_dst(steps, max(sizes) // 4)
    stream = steploop.cuda_or(stream, "snapshot_cost()")
    rows = []
    names = ["no_copy", "reused_pinned", "snapshot"]
    for s in sizes:
        n_ints = s // 4
        steploop.warm(stream, names, n_ints, busy_ms, ahead, 1)
        # interleaved rounds, each strategy's median per round; then the median over rounds, so
        # that a slow spell of the machine does not land on one strategy only
        meds = {k: [] for k in names}
        corrupted = 0
        for r in range(rounds):
            for k in names[r % len(names):] + names[:r % len(names)]:
                run = steploop.plain_loop(stream, k, steps=steps, n_ints=n_ints, busy_ms=busy_ms, ahead=ahead,
                                          per_step=False)
                meds[k].append(run["host"]["median_us"])
                if k == "snapshot":
                    corrupted += run["corrupted"]
        med = {k: statistics.median(v) for k, v in meds.items()}
        rows.append({
            "nbytes": s,
            "no_copy_us": med["no_copy"],
            "reused_pinned_us": med["reused_pinned"],
            "snapshot_us": med["snapshot"],
            "snapshot_extra_us": round(med["snapshot"] - med["reused_pinned"], 2),
            "copy_total_us": round(med["snapshot"] - med["no_copy"], 2),
            "snapshot_corrupted": corrupted,
        })
    return {"steps": steps, "busy_ms": busy_ms, "ahead": ahead, "rounds": rounds, "rows": rows}


def allocator_reuse(nbytes: int = 4 * KiB, busy_ms: float = 50.0, steps: int = 200, ahead: int = 4,
                    stream=None) -> dict:
    """Watch PyTorch's caching host allocator keep a snapshot's block until its copy has run.

    Snapshot 1 is copied behind ``busy_ms`` of GPU work and freed; snapshot 2, taken while that
    copy is pending, gets another block; after a sync, snapshot 3 gets snapshot 1's block back
    without a new cudaHostAlloc. Then a step loop (``steps``, host at most ``ahead`` steps ahead)
    counts the distinct blocks and checks that no block was reused before its copy finished.
    Returns booleans, the new cudaHostAlloc calls per snapshot, a few host_memory_stats()
    entries ({} and zeros on the emulated stream), and the loop's counts; no addresses.
    """
    n_ints = steploop.ints_in("nbytes", nbytes)
    busy_ms = positive_number("busy_ms", busy_ms)
    steps = positive_int("steps", steps)
    ahead = positive_int("ahead", ahead)
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
    loop = steploop.plain_loop(stream, "snapshot", steps=steps, n_ints=n_ints, busy_ms=0.5, ahead=ahead,
                               per_step=False, track_blocks=True)
    return {
        "nbytes": nbytes,
        "copy_pending_at_second_snapshot": bool(pending),
        "second_block_differs": p2 != p1,
        "third_reuses_first": p3 == p1,
        "new_host_allocs": [a1 - a0, a2 - a1, a3 - a2],
        "host_memory_stats": stats,
        "loop": {k: loop[k] for k in ("steps", "ahead", "corrupted", "distinct_blocks", "blocks_reused",
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
                                   busy_ms=busy_ms, ahead=None, per_step=True)
    return {"same_storage": bool(same), "pageable_gets_new_storage": bool(differs), "race": race}


def history(strategies=tuple(HISTORY), steps: int = 1000, nbytes: int = 4 * KiB, busy_ms: float = 0.3,
            ahead: int | None = 2, ring_depth: int = 3, stream=None) -> dict:
    """The fixes side by side in one step loop: corrupted steps, host µs per step, pinned bytes.

    ``ahead=2``: the host runs at most two steps ahead, as vLLM's batch queue allows. Returns
    ``{"rows": [{"strategy", "label", "corrupted", "steps", "host_us", "host_extra_us",
    "host_p90_us", "pinned_bytes_held"}], "no_copy_us", ...}``; ``host_us`` is the median host
    time per step inside write + stage + copy (event waits included), ``host_extra_us`` the same
    minus the no-copy baseline.
    """
    strategies = steploop.strategies_arg(list(strategies), allow_no_copy=False)
    steps = positive_int("steps", steps)
    steploop.ints_in("nbytes", nbytes)
    busy_ms = positive_number("busy_ms", busy_ms)
    ahead = steploop.ahead_arg(ahead)
    ring_depth = positive_int("ring_depth", ring_depth)
    stream = steploop.cuda_or(stream, "history()")
    res = steploop.every_strategy(stream, strategies=["no_copy"] + strategies, steps=steps, nbytes=nbytes,
                                  busy_ms=busy_ms, ahead=ahead, ring_depth=ring_depth, per_step=False)
    base = res["runs"]["no_copy"]["host"]["median_us"]
    rows = []
    for s in strategies:
        r = res["runs"][s]
        rows.append({
            "strategy": s,
            "label": LABELS[s],
            "corrupted": r["corrupted"],
            "steps": r["steps"],
            "host_us": r["host"]["median_us"],
            "host_extra_us": round(r["host"]["median_us"] - base, 2),
            "host_p90_us": r["host"]["p90_us"],
            "pinned_bytes_held": r["pinned_bytes_held"],
        })
    return {"steps": steps, "nbytes": nbytes, "busy_ms": busy_ms, "ahead": ahead, "ring_depth": ring_depth,
            "no_copy_us": base, "rows": rows}


# =============================================================================================
# FlashInfer's own plan(): two back-to-back plans on one wrapper, in a child process
# =============================================================================================

_CHILD_TAG = "PINLAB_RESULT "


def _report_and_exit(result: dict) -> None:
    print(_CHILD_TAG + json.dumps(result), flush=True)
    sys.stderr.flush()
    os._exit(0)


def _plan_hazard_child(mode: str, busy_ms: float, seed: int, tol: float, watchdog_s: float = 3.0,
                       wait_for_go: bool = False) -> dict:
    """Runs in a child process: two plans on ONE wrapper, with (``synced``) or without
    (``back_to_back``) a sync between them. May crash or hang the CUDA context: never call it in a
    process you care about. With ``wait_for_go`` the set-up (FlashInfer's first plan+run
    included) is done first, then the child waits for a line on its stdin before the hazard. Once
    it starts, a watchdog thread reports "hung" and ends the process if the two plans' work has
    not finished within ``watchdog_s`` seconds."""
    one_of("mode", mode, {"synced", "back_to_back"})
    watchdog_s = positive_number("watchdog_s", watchdog_s)
    from ..busy import gpu_busy

    try:
        dec = FlashInferDecode(8, 2, 128, 16)
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
        dec.plan(mb.indptr_cpu, mb.indices, mb.last_page_len_cpu)  # JIT build or cache load, then warm
        dec.run(bb.q, bb.k_cache, bb.v_cache)
        torch.cuda.synchronize()
    except FlashInferUnavailableError as exc:
        return {"status": "unavailable", "detail": str(exc)}
    if wait_for_go:
        sys.stdin.readline()  # the parent says when: never two hazards on the GPU at once
    watchdog = threading.Timer(watchdog_s, _report_and_exit, args=(
        {"status": "hung", "detail": f"the two plans' work had not finished {watchdog_s:g} s after it was queued"},))
    watchdog.daemon = True
    watchdog.start()
    try:
        gpu_busy(busy_ms)  # both plans' copies of their plan info wait behind this
        dec.plan(ma.indptr_cpu, ma.indices, ma.last_page_len_cpu)
        oa = dec.run(ba.q, ba.k_cache, ba.v_cache)
        if mode == "synced":
            torch.cuda.synchronize()
        dec.plan(mb.indptr_cpu, mb.indices, mb.last_page_len_cpu)
        ob = dec.run(bb.q, bb.k_cache, bb.v_cache)
        torch.cuda.synchronize()
        err_a = float((oa.float() - ra).abs().max())
        err_b = float((ob.float() - rb_ref).abs().max())
    except Exception as exc:  # an illegal memory access surfaces here
        return {"status": "crashed", "detail": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"}
    finally:
        watchdog.cancel()
    wrong = err_a > tol or err_b > tol or not (math.isfinite(err_a) and math.isfinite(err_b))
    return {"status": "wrong output" if wrong else "correct", "err_a": err_a, "err_b": err_b,
            "detail": f"max error {err_a:.3g} (first batch), {err_b:.3g} (second)"}


def classify_child(returncode, stdout: str, stderr: str, timed_out: bool) -> dict:
    """The outcome of a child run as data: ``{"outcome", "detail", ...}``.

    ``outcome`` is "hung" (killed at the timeout), the child's own status ("correct", "wrong
    output", "crashed", "hung", "unavailable") when it printed one, else "crashed" (it died: the
    last line of its stderr is the detail).
    """
    if timed_out:
        return {"outcome": "hung", "detail": "killed at the timeout"}
    for line in reversed((stdout or "").splitlines()):
        if line.startswith(_CHILD_TAG):
            try:
                data = json.loads(line[len(_CHILD_TAG):])
            except ValueError:
                break
            out = {"outcome": data.pop("status", "crashed"), "detail": data.pop("detail", "")}
            out.update(data)
            return out
    tail = [ln for ln in (stderr or "").strip().splitlines() if ln.strip()]
    detail = tail[-1][:200] if tail else f"exit status {returncode}, no output"
    return {"outcome": "crashed", "detail": detail}


def child_code(mode: str, busy_ms: float, seed: int, tol: float, watchdog_s: float = 3.0) -> str:
    """The ``python -c`` program of one plan-hazard child: it sets up, waits for a line on stdin,
    runs :func:`_plan_hazard_child` and prints its result on a ``PINLAB_RESULT`` line."""
    return (
        "from pinlab.lessons import l04_the_fix as fix\n"
        f"r = fix._plan_hazard_child({mode!r}, {busy_ms!r}, {seed!r}, {tol!r}, {watchdog_s!r}, wait_for_go=True)\n"
        "fix._report_and_exit(r)\n"
    )


def run_children(codes: dict, timeout_s: float) -> dict:
    """Run ``python -c`` children: all start at once (their set-up overlaps), then one at a time,
    in the order given, each is told to go (a line on its stdin) and waited for, at most
    ``timeout_s`` (then it is killed). Returns ``{name: outcome}``, each from :func:`classify_child`
    plus ``returncode`` and ``seconds`` (from its go to its end)."""
    timeout_s = positive_number("timeout_s", timeout_s)
    lib = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = lib + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("PINLAB_RECORD", None)
    procs = {name: subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env=env)
             for name, code in codes.items()}
    out = {}
    try:
        for name, p in procs.items():
            t0 = time.perf_counter()
            try:
                stdout, stderr = p.communicate(input="go\n", timeout=timeout_s)
                res = classify_child(p.returncode, stdout, stderr, False)
                res["returncode"] = p.returncode
            except subprocess.TimeoutExpired:
                p.kill()
                p.communicate()
                res = classify_child(None, "", "", True)
                res["returncode"] = None
            res["seconds"] = round(time.perf_counter() - t0, 1)
            out[name] = res
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.communicate()
    return out


def _context_ok() -> bool:
    try:
        x = torch.ones(4, device="cuda")
        return bool((x * 2).sum().item() == 8.0)
    except Exception:
        return False


def plan_hazard(busy_ms: float = 50.0, seed: int = 0, tol: float = 0.02, timeout_s: float = 12.0,
                watchdog_s: float = 3.0) -> dict:
    """Two ``plan()`` calls on one FlashInfer wrapper while the GPU is busy, each in a child process.

    FlashInfer's ``plan()`` writes its plan info into one pinned buffer per wrapper and copies it
    to the GPU with ``cudaMemcpyAsync``: the same class of hazard as the lessons' reused buffer.
    ``synced`` (a sync between the two plans: the control) and ``back_to_back`` (no sync, as under
    overlap scheduling) each run in a fresh ``python -c`` child, so a crash or a hang cannot touch
    this process. Both children set up at once; the hazards run one after the other
    (:func:`run_children`). A child reports "hung" itself when the plans' work has not finished
    ``watchdog_s`` after it was queued, and is killed ``timeout_s`` after its go in any case. The batches
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
    require_cuda("plan_hazard()")
    from ..paged_kv import flashinfer_available

    ok, reason = flashinfer_available()
    modes = ("synced", "back_to_back")
    if ok:
        print("plan_hazard: running the synced, then the back_to_back child (fresh Python processes)...",
              file=sys.stderr, flush=True)
        out = run_children({m: child_code(m, busy_ms, seed, tol, watchdog_s) for m in modes}, timeout_s)
    else:  # nothing to test: do not spend a child process on it
        out = {m: {"outcome": "unavailable", "detail": reason, "seconds": 0.0, "returncode": None} for m in modes}
    out["parent_context_ok"] = _context_ok()
    out["timeout_s"] = timeout_s
    return out


# =============================================================================================
# Plots (computed from recorded results, identical live and replayed)
# =============================================================================================

def plot_history(result: dict, *, title: str):
    """Three bar charts side by side: corrupted steps, host µs per step, pinned KiB held."""
    import matplotlib.pyplot as plt

    rows = result["rows"]
    labels = [r["label"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2))
    panels = [
        ("corrupted", f"corrupted steps (of {result['steps']})", "{:.0f}"),
        ("host_us", "host µs per step (median)", "{:.1f}"),
        ("pinned_kib", "pinned KiB held", "{:.0f}"),
    ]
    colors = plt.cm.tab10.colors
    for ax, (key, ylabel, fmt) in zip(axes, panels):
        vals = [r["pinned_bytes_held"] / 1024 if key == "pinned_kib" else r[key] for r in rows]
        bars = ax.bar(range(len(vals)), vals, color=[colors[i % 10] for i in range(len(vals))])
        for b, v in zip(bars, vals):
            ax.annotate(fmt.format(v), (b.get_x() + b.get_width() / 2, b.get_height()), ha="center",
                        va="bottom", fontsize=7)
        ax.set_xticks(range(len(vals)), labels, rotation=35, ha="right", fontsize=7)
        ax.set_ylabel(ylabel)
        ax.grid(True, axis="y", alpha=0.3)
        if key == "host_us":
            ax.axhline(result["no_copy_us"], ls="--", c="grey", lw=1)
            ax.annotate("no copy", (0, result["no_copy_us"]), textcoords="offset points", xytext=(2, 3),
                        fontsize=7, color="grey")
    fig.suptitle(title)
    fig.tight_layout()
    return axes
