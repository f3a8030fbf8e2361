"""Benchmark of the race detector, both verdicts (``pinlab.order.detect_races(verdict="order")``, the default, and
``"timing"``, ``pinlab.races.detect_races``): recall, false positives and overhead, on CUDA (or the emulated
stream).

    python3 tools/bench_races.py --out build/bench_races.json          # on a GPU: 10^4 steps per loop
    python3 tools/bench_races.py --steps 400                           # on a CPU: the emulated stream
    python3 tools/bench_races.py --verdict order                       # one verdict only
    python3 tools/bench_races.py --verdict order --watch copies        # the order verdict watching copies only

* Recall and false positives: the course's own step loop (``pinlab.steploop.plain_loop``, lessons 03-04) for
  every strategy, with the host unbounded and with the host waiting for step n-2 (``run_ahead=1``), each step's
  copy followed by the detector: every step whose data arrived wrong must be flagged (recall), and a
  strategy whose data is right by construction must have no finding (false positives). Lesson 08's race
  under graph replay (a captured copy from a reused pinned buffer) and its fix. The D2H 2-slot pinned ring of
  HF transformers' DeferredStopCheck, and its 1-slot variant read without its event.
  By order, a racy strategy is flagged at every step that reuses a buffer unordered, whether or not its data
  arrived wrong in this run (``latent``: flagged steps whose data arrived right).
* Overhead: host time of the same loops with and without the detector, in interleaved rounds (medians), and a
  loop that makes no pending pinned copy (HF ``generate()`` on a tiny random Llama where transformers is
  installed, else small GPU ops); µs per torch call and per followed copy; and (``unit_costs``) µs per followed
  copy and per ordering operation (an event recorded and synchronized) measured alone.
* ``--sections marks`` (by name only): µs per call of a followed copy's CUDA mark (a new event recorded) and of
  its parts and alternatives, with torch's GPU trace off and on and inside an order detector (:func:`marks`).
* ``--profile``: where the detector's host time goes, per followed copy and per step of the snapshot loop
  (cProfile, the 20 functions of most own time; last, so the figures above it are unprofiled).
* FlashInfer (where installed): one shared decode wrapper re-planned ahead of a busy GPU, in a subprocess
  (it can kill the CUDA context): does the detector flag it before the process dies?

Prints each section as it ends and writes the JSON after each (``complete``: false and ``left``: the sections not
run, until the last one ends): a run stopped by a timeout keeps what it measured. ``--budget S`` starts no section
after S seconds. Not a unit test: its figures depend on the machine.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "lib"))

import torch  # noqa: E402

import pinlab  # noqa: E402
from pinlab import steploop  # noqa: E402
from pinlab import order  # noqa: E402

FIXES = ("pageable", "snapshot", "ring_events", "event_wait")   # right by construction, whatever the lead
RACY = ("reused_pinned", "double_pinned", "snapshot_of_pinned", "ring")
VERDICT = "order"  # which detect_races() the measurements use (main() runs each verdict asked for)
WATCH = "every_op"  # and what it watches (order verdict: "every_op" or "copies")
LABEL = "order"  # the run's key in the JSON and its printed lines


def detect_races():
    return order.detect_races(verdict=VERDICT, watch=WATCH)


def _stream():
    return pinlab.CudaStream() if torch.cuda.is_available() else pinlab.LaggingStream()


#: rings whose depth is one short of their run-ahead (steploop.RING_RULE: run-ahead k needs k + 1 buffers): they
#: rely on a bound on the steps in flight that is one step too loose. ("ring/run_ahead=1" at the default depth 3
#: is ordered: RunAheadGate waits for step n-2's event, recorded after its copy, and the slot step n rewrites was
#: last read at step n-3.)
SHORT_RINGS = ((1, 1), (2, 2))


def _recall_row(strategy, run_ahead, steps, busy_ms, ring_depth=3, racy=None):
    with detect_races() as races:
        run = steploop.plain_loop(_stream(), strategy, steps=steps, n_ints=64, busy_ms=busy_ms, run_ahead=run_ahead,
                                  ring_depth=ring_depth)
    wrong = [n for n, r in enumerate(run["received"]) if r != n]
    raced = set(races.raced)
    missed = [n for n in wrong if n not in raced]
    return {
        "strategy": strategy, "run_ahead": run_ahead, "ring_depth": ring_depth, "steps": steps, "wrong": len(wrong),
        "flagged": len(raced), "latent": len(raced - set(wrong)),
        "raced_in_run": sum(getattr(races, "in_run", {}).values()),
        "missed": len(missed), "first_missed": missed[:5], "copies_followed": races.copies,
        "recall": 1.0 if not wrong else round(1 - len(missed) / len(wrong), 6),
        "false_positive": (strategy in FIXES if racy is None else not racy) and races.total > 0,
    }


def recall(steps: int, busy_ms: float) -> dict:
    out = {}
    for run_ahead in (None, 1):
        for strategy in RACY + FIXES:
            out[f"{strategy}/run_ahead={run_ahead}"] = _recall_row(strategy, run_ahead, steps, busy_ms)
    for run_ahead, depth in SHORT_RINGS:
        out[f"ring/run_ahead={run_ahead}/depth={depth}"] = _recall_row("ring", run_ahead, steps, busy_ms, depth,
                                                                      racy=True)
    return out


def graph_race(steps: int, busy_ms: float) -> dict:
    out = {}
    for fix in (False, True):
        s = _stream()
        with s, detect_races() as races:
            src = torch.zeros(64, dtype=torch.int32, pin_memory=True)
            static = torch.zeros(64, dtype=torch.int32, device=s.device)
            res = torch.zeros(64, dtype=torch.int32, device=s.device)
            outs = torch.zeros(steps, dtype=torch.int32, device=s.device)
            g = torch.cuda.CUDAGraph()
            s.synchronize()
            with torch.cuda.graph(g):
                static.copy_(src, non_blocking=True)
                res.copy_(static + 1)
            replayed = s.Event()
            for n in range(steps):
                if fix:
                    replayed.synchronize()
                src.fill_(n)
                g.replay()
                outs[n:n + 1].copy_(res[:1])
                replayed.record()
                s.busy(busy_ms)
            s.synchronize()
            got = outs.tolist()
        wrong = [n for n in range(steps) if got[n] != n + 1]
        missed = [n for n in wrong if n not in set(races.raced)]
        out["wait_for_replay" if fix else "racy_replay"] = {
            "steps": steps, "wrong": len(wrong), "flagged": races.total, "missed": len(missed),
            "false_positive": fix and races.total > 0}
    return out


def deferred_stop(steps: int, busy_ms: float) -> dict:
    """The stop flag copied D2H into pinned slots: two slots read one step late after their event (clean),
    one slot read at once (every read before the copy's event is flagged)."""
    out = {}
    for slots in (2, 1):
        s = _stream()
        with s, detect_races() as races:
            flags = [torch.zeros(1, dtype=torch.int32, pin_memory=True) for _ in range(slots)]
            events = [s.Event() for _ in range(slots)]
            state = torch.zeros(1, dtype=torch.int32, device=s.device)
            reads = 0
            for n in range(steps):
                s.busy(busy_ms)
                state.add_(1)
                k = n % slots
                flags[k].copy_(state, non_blocking=True)
                events[k].record()
                if slots == 2 and n:
                    events[1 - k].synchronize()
                    reads += int(flags[1 - k].item() < 0)
                elif slots == 1:
                    reads += int(flags[0].item() < 0)
            s.synchronize()
        out[f"{slots}_slot"] = {"steps": steps, "flagged": races.total, "copies_followed": races.copies,
                                "false_positive": slots == 2 and races.total > 0}
    return out


def _interleaved(fns: dict, rounds: int) -> dict:
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


class _Bare(torch.overrides.TorchFunctionMode):
    """The floor: a TorchFunctionMode that only passes every call on (what any such tool costs)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _Counting(torch.overrides.TorchFunctionMode):
    calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        _Counting.calls += 1
        return func(*args, **(kwargs or {}))


def overhead(steps: int, busy_ms: float, rounds: int) -> dict:
    out = {}
    for strategy in ("reused_pinned", "snapshot", "ring_events", "event_wait", "pageable"):
        run_ahead = 1 if strategy in ("ring_events", "event_wait") else None
        loop = {}

        def plain(strategy=strategy, run_ahead=run_ahead):
            loop["plain"] = steploop.plain_loop(_stream(), strategy, steps=steps, n_ints=64, busy_ms=busy_ms,
                                                run_ahead=run_ahead, per_step=False)

        def detected(strategy=strategy, run_ahead=run_ahead):
            with detect_races() as races:
                loop["detected"] = steploop.plain_loop(_stream(), strategy, steps=steps, n_ints=64,
                                                       busy_ms=busy_ms, run_ahead=run_ahead, per_step=False)
            loop["races"] = races

        def bare(strategy=strategy, run_ahead=run_ahead):
            with _Bare():
                loop["bare"] = steploop.plain_loop(_stream(), strategy, steps=steps, n_ints=64, busy_ms=busy_ms,
                                                   run_ahead=run_ahead, per_step=False)

        plain()
        detected()  # warm
        host = {"plain": [], "detected": [], "bare": []}
        for _ in range(rounds):
            plain()
            detected()
            bare()
            for k in host:
                host[k].append(loop[k]["host_loop_ms"])
        with _Counting():
            _Counting.calls = 0
            steploop.plain_loop(_stream(), strategy, steps=steps, n_ints=64, busy_ms=busy_ms, run_ahead=run_ahead,
                                per_step=False)
        calls = _Counting.calls
        p, d = statistics.median(host["plain"]), statistics.median(host["detected"])
        b = statistics.median(host["bare"])
        copies = max(loop["races"].copies, 1)
        out[strategy] = {"run_ahead": run_ahead, "steps": steps, "host_loop_ms_plain": round(p, 3),
                         "host_loop_ms_detected": round(d, 3), "ratio": round(d / p, 3),
                         "host_loop_ms_bare_mode": round(b, 3), "bare_mode_ratio": round(b / p, 3),
                         "torch_calls": calls, "us_per_call": round((d - p) * 1e3 / max(calls, 1), 3),
                         "us_per_followed_copy": round((d - p) * 1e3 / copies, 3),
                         "copies_followed": loop["races"].copies, "checks": loop["races"].checks}
    out["no_pending_copies"] = _no_pending(rounds)
    out["unit_costs"] = unit_costs(rounds)
    return out


def _copies(s, n: int):
    """(pinned source, device destination, a function making ``n`` non_blocking H2D copies from the one to the
    other and synchronizing ``s``): the copy loop :func:`unit_costs` times and :func:`profile` profiles."""
    buf = torch.zeros(64, dtype=torch.int32, pin_memory=True)
    dst = torch.zeros(64, dtype=torch.int32, device=s.device)

    def copies():
        for _ in range(n):
            dst.copy_(buf, non_blocking=True)
        s.synchronize()
    return buf, dst, copies


def unit_costs(rounds: int, n: int = 2000) -> dict:
    """µs of host time per followed copy (``n`` non_blocking H2D copies from one pinned buffer, nothing else) and
    per ordering operation (``n`` events recorded and synchronized, one copy pending), detector against none."""
    s = _stream()
    with s:
        buf, dst, copies = _copies(s, n)
        ev = s.Event()

        def syncs():
            dst.copy_(buf, non_blocking=True)
            for _ in range(n):
                ev.record()
                ev.synchronize()

        def under(fn):
            def run():
                with detect_races():
                    fn()
            return run

        copies(), syncs(), under(copies)(), under(syncs)()  # warm
        t = _interleaved({"copies": copies, "copies_detected": under(copies), "syncs": syncs,
                          "syncs_detected": under(syncs)}, rounds)
    return {"n": n, "us_per_copy": round((t["copies_detected"] - t["copies"]) * 1e6 / n, 3),
            "us_per_ordering_op": round((t["syncs_detected"] - t["syncs"]) * 1e6 / n, 3),
            "copy_ratio": round(t["copies_detected"] / t["copies"], 3),
            "ordering_op_ratio": round(t["syncs_detected"] / t["syncs"], 3)}


def _no_pending(rounds: int) -> dict:
    """A loop with no pending pinned copy: HF generate() on a tiny random Llama, or small GPU ops."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        import transformers
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).to(dev).eval()
        ids = torch.randint(0, 256, (2, 8), device=dev)

        def work():
            with torch.no_grad():
                return model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0)

        what = f"HF generate() (transformers {transformers.__version__}), tiny random Llama, batch 2, 24 tokens"
    except Exception as exc:  # noqa: BLE001
        x = torch.randn(64, 64, device=dev)

        def work():
            y = x
            for _ in range(200):
                y = torch.tanh(y @ x)
            return y.sum()

        what = f"200 small matmuls ({type(exc).__name__} for transformers)"
    work()
    with detect_races():
        same = torch.equal(work(), work()) if "generate" in what else True

    def detected():
        with detect_races():
            work()

    def bare():
        with _Bare():
            work()

    t = _interleaved({"plain": work, "detected": detected, "bare": bare}, rounds)
    return {"what": what, "same_tokens_under_detector": bool(same), "ms_plain": round(t["plain"] * 1e3, 3),
            "ms_detected": round(t["detected"] * 1e3, 3), "ratio": round(t["detected"] / t["plain"], 3),
            "ms_bare_mode": round(t["bare"] * 1e3, 3), "bare_mode_ratio": round(t["bare"] / t["plain"], 3)}


FLASHINFER_CHILD = textwrap.dedent('''
    import json, sys, torch
    sys.path.insert(0, sys.argv[1])
    import flashinfer, pinlab
    from pinlab.order import detect_races
    from pinlab.paged_kv import build_metadata, random_batch
    torch.manual_seed(0)
    b = random_batch(8, 256, 16, 4, 128, 32, seed=1, device="cuda")
    ws = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    metas = []                                # built before: building them copies (and waits) on its own
    for n in range(7):
        lens = (b.seq_lens + 16 * n).clamp(max=256).clamp(min=1)
        m = build_metadata(b.block_table, lens, 16, device="cuda")
        metas.append((m.indptr_cpu.pin_memory(), m.indices, m.last_page_len_cpu.pin_memory()))
    torch.cuda.synchronize()
    def plan(n):
        ip, idx, lpl = metas[n]
        w.plan(ip, idx, lpl, 32, 4, 128, 16, q_data_type=torch.float16, kv_data_type=torch.float16)
    plan(6); w.run(b.q, (b.k_cache, b.v_cache)); torch.cuda.synchronize()
    import time
    plan_ms = []
    with detect_races() as races, pinlab.detect_stalls() as stalls:
        pinlab.gpu_busy(200.0)
        for n in range(6):                    # one shared wrapper, planned again and again ahead of the GPU
            t = time.perf_counter()
            plan(n)
            plan_ms.append(round((time.perf_counter() - t) * 1e3, 3))
            w.run(b.q, (b.k_cache, b.v_cache))
        flagged = races.total
        behind = not torch.cuda.current_stream().query()
    print("REPORT " + json.dumps({"flagged": flagged, "copies": races.copies, "checks": races.checks,
                                  "plan_ms": plan_ms, "gpu_still_busy_after_loop": behind,
                                  "summary": races.summary(), "stalls": stalls.summary()}), flush=True)
    torch.cuda.synchronize()
    print("SURVIVED", flush=True)
''')


def flashinfer_shared_wrapper() -> dict:
    try:
        import flashinfer  # noqa: F401
    except ImportError as exc:
        return {"skipped": f"FlashInfer is not installed ({exc})"}
    if not torch.cuda.is_available():
        return {"skipped": "needs CUDA"}
    p = subprocess.run([sys.executable, "-c", FLASHINFER_CHILD, str(ROOT / "lib")], capture_output=True,
                       text=True, timeout=240)
    rep = next((json.loads(line[7:]) for line in p.stdout.splitlines() if line.startswith("REPORT ")), None)
    errors = [line for line in p.stderr.splitlines() if "error" in line.lower()][:5]
    return {"returncode": p.returncode, "report": rep, "survived": "SURVIVED" in p.stdout,
            "stderr_errors": errors, "stderr_tail": p.stderr[-800:]}


def _top(prof, per: int, n: int = 20) -> list:
    """The ``n`` functions of most own time in a cProfile run: [where, calls, own µs per unit, total µs per unit]."""
    import pstats

    stats = pstats.Stats(prof).stats
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:n]
    return [[f"{Path(f).name}:{line}({fn})", nc, round(tt * 1e6 / per, 2), round(ct * 1e6 / per, 2)]
            for (f, line, fn), (_, nc, tt, ct, _) in rows]


def profile(steps: int, n: int = 2000) -> dict:
    """Where the detector's host time goes: cProfile of ``n`` followed copies from one pinned buffer (as
    :func:`unit_costs`) and of ``steps`` steps of the snapshot loop, each under the detector, per copy and per step
    (µs; cProfile's own cost inflates every figure, their shares are what to read). Stop 62 (H100): a followed copy
    cost 73-112 µs of host time on CUDA against 7-50 µs on the emulated stream, unexplained without this."""
    import cProfile

    s = _stream()
    out = {}
    with s:
        _, _, copies = _copies(s, n)

        def loop():
            steploop.plain_loop(_stream(), "snapshot", steps=steps, n_ints=64, busy_ms=0.02, run_ahead=None,
                                per_step=False)

        for name, fn, per in (("copies", copies, n), ("snapshot_loop", loop, steps)):
            with detect_races():
                fn()  # warm
            prof = cProfile.Profile()
            t = time.perf_counter()
            with detect_races():
                prof.enable()
                fn()
                prof.disable()
            out[name] = {"per": per, "us_per_unit_profiled": round((time.perf_counter() - t) * 1e6 / per, 2),
                         "top": _top(prof, per)}
    return out


def marks(n: int = 2000, rounds: int = 5) -> dict:
    """µs per call of what a followed copy's *mark* costs on CUDA (today a new ``torch.cuda.Event()`` recorded on
    the current stream: ``races._CudaClock.mark``, the largest CUDA part of a followed copy in stop 62's profile),
    of its parts, and of what a cheaper mark could do instead (record an event made earlier, on a stream fetched
    once), in interleaved rounds (medians): with torch's GPU trace as this process has it, then on (the order
    verdict turns it on for good, docs/facts.md F22: every record then calls into Python), then inside an order
    detector with nothing pending (its callbacks note each record). Measured only: a pool of marks crashed a CUDA
    process in stop 60 (``order._QuietCudaClock``), so no cheaper mark is proposed before these figures and that
    crash are understood. On a machine without CUDA: ``{"skipped": ...}``."""
    if not torch.cuda.is_available():
        return {"skipped": "needs CUDA"}
    one = torch.cuda.Event()
    one.record()
    stream = torch.cuda.current_stream()

    def per_op(ops: dict) -> dict:
        for fn in ops.values():
            fn()  # warm
        t = _interleaved(ops, rounds)
        torch.cuda.synchronize()
        return {k: round(v * 1e6 / n, 3) for k, v in t.items()}

    def times(op):
        def run():
            for _ in range(n):
                op()
        return run

    # each looked up at the call, as a detector's code does (inside one, order patches Event.query)
    ops = {"new_event": times(lambda: torch.cuda.Event()),
           "new_event_record": times(lambda: torch.cuda.Event().record()),
           "current_stream": times(lambda: torch.cuda.current_stream()),
           "new_event_record_on_stream": times(lambda: torch.cuda.Event().record(stream)),
           "record_one_event": times(lambda: one.record(stream)), "query_one_event": times(lambda: one.query())}
    out = {"n": n, "trace_was_on": order._trace_on}
    if not order._trace_on:
        out["trace_off"] = per_op(ops)
        order._cuda_trace()
    out["trace_on"] = per_op(ops)
    with order.detect_races():
        out["in_order_detector"] = per_op(ops)
    return out


def main(argv=None) -> int:
    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10_000 if cuda else 400, help="steps per recall loop")
    ap.add_argument("--busy-ms", type=float, default=0.3, help="GPU work per step (keeps the GPU behind)")
    ap.add_argument("--overhead-steps", type=int, default=2_000 if cuda else 200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--verdict", choices=("both",) + order.VERDICTS, default="both",
                    help="the detector's verdict to measure (both: order, then timing)")
    ap.add_argument("--watch", choices=("both",) + order.WATCHES, default="both",
                    help="what the order verdict watches (both: every_op, then copies; the timing verdict: every_op)")
    ap.add_argument("--profile", action="store_true",
                    help="also profile, for each verdict and watch, 2,000 followed copies and the snapshot step loop "
                         "under the detector (cProfile: the 20 functions of most own time, in the JSON's \"profile\")")
    ap.add_argument("--sections", default=None, metavar="A,B",
                    help="run only these sections, in their order (recall, graph, deferred_stop, overhead, "
                         "flashinfer_shared_wrapper, profile, marks; without it, all but marks, and profile only "
                         "with --profile)")
    ap.add_argument("--budget", type=float, default=None, metavar="S",
                    help="start no section after S seconds (the first always starts: a run under load spends its "
                         "set-up first); what was left is named in the JSON (\"left\")")
    a = ap.parse_args(argv)
    for name in ("steps", "overhead_steps", "rounds"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(a, name)}")
    if a.budget is not None and a.budget <= 0:
        ap.error(f"--budget must be a positive number of seconds, got {a.budget}")
    t0 = time.time()
    res = {"device": torch.cuda.get_device_name(0) if cuda else "emulated lagging stream (CPU)",
           "torch": torch.__version__, "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "launch_blocking": os.environ.get("CUDA_LAUNCH_BLOCKING", "") == "1"}
    if cuda:
        pinlab.warmup(lambda: pinlab.gpu_busy(0.1))
    global VERDICT, WATCH, LABEL
    verdicts = order.VERDICTS if a.verdict == "both" else (a.verdict,)
    watches = order.WATCHES if a.watch == "both" else (a.watch,)
    # (the key in the JSON, the verdict, what it watches): the timing verdict watches every op only
    runs = [(v if w == "every_op" else f"{v}+{w}", v, w) for v in verdicts for w in watches
            if v == "order" or w == "every_op"]
    if not runs:
        ap.error("--verdict timing watches every op: give --watch every_op or both")
    sections = {
        "recall": lambda: recall(a.steps, a.busy_ms),
        "graph": lambda: graph_race(min(a.steps, 2000), a.busy_ms),
        "deferred_stop": lambda: deferred_stop(min(a.steps, 2000), a.busy_ms),
        "overhead": lambda: overhead(a.overhead_steps, 0.02 if cuda else 0.5, a.rounds),
        "flashinfer_shared_wrapper": flashinfer_shared_wrapper,
        "profile": lambda: profile(a.overhead_steps),  # last: the figures before it are unprofiled
        "marks": lambda: marks(rounds=a.rounds),  # asked by name only (it turns the GPU trace on)
    }
    if a.sections is None:
        wanted = [k for k in sections if k != "marks" and (k != "profile" or a.profile)]
    else:
        wanted = [w.strip() for w in a.sections.split(",") if w.strip()]
        unknown = [w for w in wanted if w not in sections]
        if unknown or not wanted:
            ap.error(f"--sections: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(sections)}")
    sections = {k: v for k, v in sections.items() if k in wanted}
    res["complete"], res["left"] = False, [f"{key}/{k}" for key, _, _ in runs for k in sections]
    started = False  # the first section starts whatever --budget says
    for key, VERDICT, WATCH in runs:
        LABEL = key
        part = res.setdefault("verdicts", {})[key] = {}
        for name, run in sections.items():
            if a.budget is not None and started and time.time() - t0 > a.budget:
                print(f"--budget {a.budget:.0f} s spent: not started {', '.join(res['left'])}", flush=True)
                return _write(res, a.out, t0)
            print(f"{LABEL:6s} {name} ...", flush=True)
            started = True
            t1 = time.time()
            part[name] = run()
            part.setdefault("seconds", {})[name] = round(time.time() - t1, 1)
            res["left"].remove(f"{key}/{name}")
            _print_section(name, part[name])
            _write(res, a.out, t0)  # what is done survives a timeout
    res["complete"] = True
    return _write(res, a.out, t0)


def _print_section(name: str, out: dict) -> None:
    if name == "profile":
        for k, v in out.items():
            print(f"{LABEL:6s} profile {k}: {v['us_per_unit_profiled']} µs per {'copy' if k == 'copies' else 'step'} "
                  f"(profiled); own µs, total µs per unit:")
            for where, calls, own, total in v["top"][:12]:
                print(f"{LABEL:6s}     {own:9.2f} {total:9.2f} {calls:8d}  {where}")
    elif name == "recall":
        for k, v in out.items():
            print(f"{LABEL:6s} recall {k:32s} wrong {v['wrong']:6d} flagged {v['flagged']:6d} latent "
                  f"{v['latent']:6d} missed {v['missed']:4d}{'  FALSE POSITIVE' if v['false_positive'] else ''}")
    elif name == "flashinfer_shared_wrapper":
        print(LABEL, "flashinfer", {k: v for k, v in out.items() if k != "stderr_tail"})
    else:
        for k, v in out.items():
            print(f"{LABEL:6s} {name} {k:20s} {v}")
    sys.stdout.flush()


def _write(res: dict, out: Path | None, t0: float) -> int:
    res["seconds"] = round(time.time() - t0, 1)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(res, indent=1))
        tmp.replace(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
