"""Exercise checker for lesson 07, the capstone: is the learner's inference loop fixed?

:func:`check_fixed_loop` runs the learner's ``fixed_loop(m, steps)`` for 1000 steps on the CUDA
stream, or on the emulated :class:`pinlab.LaggingStream` without a GPU (the emulation is exact
about the order of host writes, copies and reads, so every check below runs there too), under
:class:`pinlab.lessons.l07_capstone_audit.LoopAudit`, and judges every step exactly
(:func:`~pinlab.lessons.l07_capstone_audit.run_loop`). It accepts the loop only when:

* every step's metadata copy delivered that step's data (0 corrupted steps), and no
  ``pin_memory()`` of an already pinned tensor stands in for a snapshot;
* no H2D copy with ``non_blocking=True`` reads pageable memory;
* no host sync (``.item()``, ``.tolist()``, ``bool()``, ``x in tensor``, ``torch.equal``, device tokens handed
  to ``m.emit``, ``s.synchronize()``, ``torch.cuda.synchronize()``... of device tensors) and no blocking copy
  runs inside the loop, not even once: between step 0's decode and the last step's (before the first decode,
  set-up such as offloading the LM head, and after the last one, the draining, may wait; the audit knows
  which is which by the steps enqueued, not by a count, so this holds exactly on CUDA and on the emulation);
* the host read every step's tokens after their D2H copy had run and before a later step's copy
  overwrote them, each step once, and noted every step whose tokens hold the end-of-sequence token;
* no wait inside the loop (``event.synchronize()``, or ``event.query()`` polled) is on an event
  recorded after the newest step the host had enqueued: the host stays at least one step ahead of
  the GPU (run-ahead >= 1 step, a ring of depth >= 2 in the lesson's terms); set-up before step 0's
  decode and the draining after the last step's may wait on anything;
* the LM head is restored (an H2D copy into ``m.lm_head``) before every step's decode, and is
  intact at the end.

It prints one verdict (⏳ / ❌ what is wrong, in the lesson's terms / ✅), with a hint from the
second failure on, and returns True or False. ``tests/test_checks_l07.py`` proves it accepts the
master solution and rejects plausible wrong answers with the right message.
"""
from __future__ import annotations

from collections import Counter

import torch

from ..args import positive_int
from ..lessons import l07_capstone_audit as l07
from ..streams import stream
from ..timing import show
from . import LearnerStop, TIMEOUT_S, checker, is_stub, learner_arg, learner_call, not_implemented, raised, say

_failures: Counter = Counter()

STEPS = 1000
MAX_STEPS = 10_000  #: the most steps check_fixed_loop runs (10x the notebooks' 1000)
#: the time limit of the learner's loop grows with its steps: the solution takes about 12 ms per step on
#: the emulated stream on a 2-core CPU shared with other jobs (run_loop runs it on one torch thread; on
#: torch's default threads it took up to 100 ms) and about 2 ms on the H200; 1000 steps may run 60 + 200 s
SECONDS_PER_STEP = 0.2

HINT = ("go through the loop line by line with the lessons: offload the LM head into pinned memory once "
        "(`torch.empty_like(w, device=\"cpu\", pin_memory=True).copy_(w)`, lesson 05); give each step in flight "
        "its own pinned metadata and token buffer, a ring of `depth` slots (lesson 04), and record an event after "
        "each step's copies; before the scheduler rewrites slot i, and before you read its tokens, wait for that "
        "event (`done[i].synchronize()`), never for the whole GPU nor for the step you just enqueued (with "
        "`depth` >= 2 slots, wait for step n + 1 - depth after enqueuing step n); keep the LM head's restore "
        "inside the loop, once per step; look for the end-of-sequence token in the tokens you read, on the "
        "host, instead of `.item()` on the GPU (lesson 02).")


def reset() -> None:
    """Forget earlier failures (the hint shows from the second failure on)."""
    _failures.clear()


def _fail(message: str) -> bool:
    _failures["fixed_loop"] += 1
    say(f"❌ {message}")
    if _failures["fixed_loop"] >= 2:
        say(f"💡 Hint: {HINT}")
    return False


def _events(r: dict, kind: str, in_loop: bool = False) -> list[dict]:
    """The audit's events of ``kind``; with ``in_loop``, those of lines seen inside the loop (between step 0's
    decode and the last step's: exact, on CUDA as on the emulated stream, whatever the count)."""
    return [e for e in r["audit"] if e["kind"] == kind and (not in_loop or e.get("in_loop", e["count"] > l07.IN_LOOP))]


def _at(e: dict, name: str) -> str:
    code = f", in `{e['code']}`" if e.get("code") else ""
    return f"`{e['call']}` at line {e['line']} of {name} ({e['count']} times{code})"


def problem(r: dict, name: str = "fixed_loop") -> str | None:
    """What is wrong with a :func:`~pinlab.lessons.l07_capstone_audit.run_loop` result, in the lesson's
    terms (None: nothing). The first problem found, in the order of the lessons' importance."""
    steps = r["steps"]
    noop = _events(r, l07.PIN_NOOP)
    race = None
    if r["first_wrong_meta"] is not None:
        n = r["first_wrong_meta"]
        got = r["received_first_wrong"]
        what = f"step {got}'s data" if got >= 0 else "a mix of several steps' data"
        race = (f"step {n} of {steps} delivered {what} ({r['wrong_meta']} of {steps} steps corrupted): "
                "its pinned metadata buffer was rewritten by the scheduler before its copy ran")
    if noop:
        return (f"pin_memory() of a pinned tensor returns the same storage: {_at(noop[0], name)} is no snapshot, "
                "the copy still reads the buffer the scheduler rewrites"
                + (f"; {race}." if race else ". Copy from a buffer nobody rewrites before the copy has run."))
    if race:
        return (f"{race}. Give each step in flight its own pinned buffer (a ring, each slot rewritten only after "
                "the event recorded behind its last copy), or copy from a fresh snapshot.")
    pageable = _events(r, l07.PAGEABLE)
    if pageable:
        e = pageable[0]
        return (f"a pageable non_blocking copy of {l07.fmt_bytes(e['nbytes'])}: {_at(e, name)}. From pageable memory "
                "`non_blocking=True` is fake: the host waits while the driver stages it (lesson 02). Keep the "
                "source in pinned memory (offload the LM head with `pin_memory=True`, lesson 05).")
    syncs = _events(r, l07.SYNC, in_loop=True)
    if syncs:
        return (f"a host sync inside the loop: {_at(syncs[0], name)}. Every call waits for the GPU to finish all "
                "the work queued so far, so the host and the GPU take turns instead of overlapping.")
    blocking = _events(r, l07.BLOCKING, in_loop=True)
    if blocking:
        return (f"a blocking copy inside the loop: {_at(blocking[0], name)}. The host waits for the GPU to reach "
                "it; copy with `non_blocking=True` between pinned memory and the GPU.")
    if r["first_stale"] is not None:
        k, by = r["first_stale"], r["first_stale_overwritten_by"]
        if by is not None:
            return (f"step {k}'s tokens were overwritten by step {by}'s before they were read ({r['stale_reads']} of "
                    f"{steps} steps read wrong tokens, {r['overwritten']} of them a later step's): emit() got step "
                    f"{by}'s tokens {_short(r['first_stale_got'])}, step {k} computed {_short(r['first_stale_want'])}. "
                    f"Step {by}'s D2H copy reused step {k}'s pinned slot and had run when the host read it: read "
                    f"step {k}'s slot after step {k}'s event, before the wait that lets a later copy into that "
                    "slot run (in a ring of `depth` slots, step k's slot is reused by step k + depth).")
        return (f"step {k}'s tokens were read before their D2H copy had run ({r['stale_reads']} of {steps} steps): "
                f"emit() got {_short(r['first_stale_got'])}, the GPU computed {_short(r['first_stale_want'])}. "
                "A `non_blocking` device-to-host copy is only enqueued: read its buffer after an event recorded "
                "behind it has completed.")
    full = _events(r, l07.FULL_WAIT)
    if full:
        return (f"a wait that lets the host run no step ahead: {_at(full[0], name)} waited for an event recorded "
                "after the newest step the host had enqueued. No later step was queued behind it, so the GPU ran "
                "dry at every such wait, host and GPU took turns: as serial as `s.synchronize()` every step (a "
                "ring of depth 1). Wait only on an event at least one step older than the newest step enqueued: "
                "with a ring of `depth` >= 2 slots, wait for step n + 1 - depth after enqueuing step n, and the "
                "host runs up to depth - 1 steps ahead of the GPU.")
    if r["missing"]:
        return (f"step {r['first_missing']}'s tokens were never handed to m.emit() ({r['missing']} of {steps} steps "
                "missing): deliver every step's tokens, also the last ones still in flight when the loop ends.")
    if r["extra"] or r["deliveries"] != steps:
        return (f"m.emit() was called {r['deliveries']} times for {steps} steps"
                + (f" (steps {r['extra'][:3]} do not exist)" if r["extra"] else "")
                + ": hand each step's tokens to the detokenizer exactly once.")
    if not r["stops_ok"]:
        missed = [k for k in r["want_stops"] if k not in r["stops"]]
        wrong = [k for k in r["stops"] if k not in r["want_stops"]]
        detail = (f"step {missed[0]} produced the end-of-sequence token ({l07.EOS}) but was not noted"
                  if missed else f"step {wrong[0]} was noted, but its tokens hold no end-of-sequence token")
        return (f"the stop check is wrong: {detail} ({len(r['want_stops'])} steps should be noted). Check the tokens "
                "you read on the host (after their event) and call m.note_stop(k) once for each such step.")
    if r["unrestored"]:
        k = r["first_unrestored"]
        return (f"the LM head was not restored before step {k}'s decode ({r['unrestored']} of {steps} steps): the "
                "engine offloads it, so the loop copies it from host memory into `m.lm_head` before every step, "
                "as a CPU-offloaded layer is (its GPU memory serves other layers in between). Keep the restore "
                "inside the loop, one pinned `non_blocking` copy per step.")
    if not r["lm_head_ok"]:
        return ("the LM head on the GPU is not the model's any more: the restore must copy the offloaded weight "
                "back unchanged, every step.")
    return None


def _short(tokens) -> str:
    return str(tokens if tokens is None or len(tokens) <= 8 else tokens[:8] + ["..."])


@checker
def check_fixed_loop(fn, steps: int = STEPS) -> bool:
    """``fixed_loop(m, steps)``: the capstone's loop, fixed. Run for ``steps`` steps (1000) and judged
    exactly: 0 corrupted steps, 0 pageable copies, no sync inside the loop, no early D2H read."""
    learner_arg("fixed_loop", fn, "(m, steps) -> None (the capstone's loop, fixed)")
    steps = positive_int("steps", steps, maximum=MAX_STEPS)
    name = getattr(fn, "__name__", "fixed_loop")
    if not isinstance(name, str) or not name.isidentifier():
        name = "fixed_loop"
    with stream() as s:
        show("fixed_loop checked on", s.label)
        # the torch attention (no FlashInfer plan() to guard, whatever the loop's run-ahead); on a GPU the
        # work per step keeps it behind a host with no work of its own, so that a race can show
        threads = torch.get_num_threads()
        if s.emulated:  # one torch thread: as in run_loop, several spin-wait on a CPU shared with other jobs
            torch.set_num_threads(1)
        try:
            model = l07.CapstoneModel(s, steps=steps, encoder_ms=1.0, decoder_ms=0.8, host_ms=0.0, seed=3,
                                      backend="torch")
        finally:
            torch.set_num_threads(threads)
    try:
        with learner_call(f"{name}(m, {steps})", TIMEOUT_S + steps * SECONDS_PER_STEP):
            r = l07.run_loop(model, fn, steps, progress=f"{name}: steps decoded")
    except LearnerStop as stop:  # it ran past its time, or left torch's state changed
        return _fail(f"fixed_loop: {stop}")
    except Exception as exc:  # the learner's bug, reported, not raised
        if is_stub(exc, fn):
            return not_implemented("fixed_loop")
        return _fail(f"{name}(m, {steps}) raised {raised(exc)}")
    n = r["first_wrong_meta"]
    r["received_first_wrong"] = r["received"][n] if n is not None else None
    for e in r["audit"]:  # the code of each line, where the loop's source can be read (a notebook cell's can)
        e["code"] = l07.line_code(fn, e["line"])
    found = problem(r, name)
    if found:
        return _fail(found)
    _failures.pop("fixed_loop", None)
    say(f"✅ fixed_loop is correct ({steps} steps: 0 corrupted, 0 pageable copies, no sync inside the loop, "
          "every step's tokens read after their copy).")
    return True
