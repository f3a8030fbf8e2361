"""Exercise checker for lesson 09: is the learner's decode loop free of host syncs and races?

The exercise's loop is a short greedy decode loop written the way a user writes one: a toy model
(:class:`DecodeEngine`: ``m.forward(tokens)`` gives the next logits on the GPU), a sampling step
(temperature, then argmax; finished sequences emit padding) and a custom stopping criterion (stop when
every sequence has produced end-of-sequence, or when a step repeats every sequence's last token). As
written it waits for the GPU three times per token and reads its stop flag before the copy has run.

:func:`check_decode` runs the learner's ``fixed_decode(m, max_new)`` on three cases (the stop by
end-of-sequence, the stop by repetition, no stop before ``max_new``), on the CUDA stream, or without
a GPU on the emulated lagging stream (:class:`pinlab.checks.l02.WatchedLagging`, with device arithmetic
queued like kernels: the emulated GPU stays behind the host until the host waits), and accepts it only
when, in every case:

* the tokens are those of the reference, and the loop stops at most one step after the step whose
  tokens meet the criterion (one step late is what a deferred check costs; the extra step's tokens
  must be the ones the model makes there);
* no host sync made by the loop (its own lines, or the helpers it calls) runs more than once: ``.item()``, ``.tolist()``, ``bool()``,
  ``x in t``, ``torch.equal`` of a device tensor, a blocking copy (lesson 07's
  :class:`~pinlab.lessons.l07_capstone_audit.LoopAudit` names each by its line);
* no busy-wait (``while not ev.query(): pass``), and no more than one wait on the newest step's work
  (``ev.synchronize()`` on an event recorded after the last ``m.forward()``, or ``s.synchronize()``):
  a wait inside the loop is on an event with a later step queued behind it;
* :func:`pinlab.races.detect_races` finds no race (a pinned flag read before its copy ran, or while a
  later copy writes it).

It prints one verdict (⏳ / ❌ what is wrong, in the lesson's terms / ✅), with a hint from the second
failure on. ``tests/test_checks_l09.py`` proves it accepts the master solution and rejects planted
wrong answers with the right message.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch

from ..args import positive_int
from ..device import has_cuda
from ..lessons import l07_capstone_audit as l07
from ..races import detect_races
from ..streams import CudaStream
from ..timing import show
from . import LearnerStop, _FAILURES, _failed, checker, is_stub, learner_arg, learner_call, not_implemented, raised, say
from .l02 import Watch, WatchedLagging

VOCAB, BATCH, EOS, PAD = 32, 3, 1, 0
TEMPERATURE = 0.7
BUSY_MS = 0.5  #: the GPU work of one forward: on CUDA it keeps the GPU behind a host that does not wait
IN_LOOP = 1    #: a sync or a full wait made more often than this is inside the loop

#: (name, {token: next token}, the start tokens, max_new): every token not named maps to itself
CASES = (
    ("stop by end-of-sequence", {**{t: t + 1 for t in range(2, 10)}, 10: EOS,
                                 **{t: t + 1 for t in range(11, 15)}, 15: EOS, 16: 17, 17: EOS}, (2, 11, 16), 16),
    ("stop by repetition", {2: 3, 3: 4, 4: 5, 5: 6, 20: 21, 25: EOS}, (2, 20, 25), 12),
    ("no stop before max_new", {2: 3, 3: 4, 4: 2, 5: 6, 6: 5, 7: 8, 8: 9, 9: 7}, (2, 5, 7), 12),
)

HINT = ("compute the stopping criterion on the GPU as one flag (`finished.all() | (nxt == tokens).all()`), "
        "copy it with `non_blocking=True` into one of two pinned slots (`flags[n % 2]`), record an event after "
        "the copy, then wait for the *previous* step's event and read the previous step's slot: the stop is "
        "seen one step late and the host never waits for the step it just queued (lesson 09, the deferred "
        "stop check). Update `finished` with `|` on the GPU instead of `if m.eos in nxt:`, and drop `.item()`.")

def reset() -> None:
    """Forget earlier failures (the hint shows from the second failure on)."""
    _FAILURES.pop("fixed_decode", None)


def _fail(message: str) -> bool:
    return _failed("fixed_decode", f"❌ {message}", HINT)  # the checkers' one hint counter


def table(succ: dict) -> torch.Tensor:
    """The toy model's logits: row ``t`` is 4 at ``succ(t)`` (``t`` itself where not named) plus noise
    in [0, 1): the argmax is ``succ(t)`` by a margin of 3, on any device."""
    g = torch.Generator().manual_seed(9)
    logits = torch.rand(VOCAB, VOCAB, generator=g)
    for t in range(VOCAB):
        logits[t, succ.get(t, t)] += 4.0
    return logits


class DecodeEngine:
    """The model the exercise's loop runs: ``m.forward(tokens)`` (``(batch,)`` token ids on the GPU ->
    ``(batch, vocab)`` logits on the GPU, after ``BUSY_MS`` of GPU work), ``m.start`` (the last prompt
    token of each sequence, on the GPU), ``m.stream``, ``m.batch``, ``m.vocab``, ``m.eos``, ``m.pad``,
    ``m.temperature``. Make it inside ``with s:``. ``m.forwards`` counts the forwards made."""

    def __init__(self, s, succ: dict, start):
        self.stream = s
        self.batch, self.vocab, self.eos, self.pad, self.temperature = len(start), VOCAB, EOS, PAD, TEMPERATURE
        self.logits_host = table(succ)
        self.logits = self.logits_host.to(s.device)
        self.start_host = torch.tensor(start, dtype=torch.int64)
        self.start = self.start_host.to(s.device)
        self.forwards = 0

    def forward(self, tokens):
        """The next logits of each sequence, on the GPU (the model's layers: ``BUSY_MS`` of GPU work)."""
        self.forwards += 1
        self.stream.busy(BUSY_MS)
        return self.logits[tokens]


def reference(logits: torch.Tensor, start, max_new: int, stop: bool = True):
    """The reference decode on the host: ``(tokens (batch, steps), the step that met the criterion or
    None)``; ``stop=False`` decodes all ``max_new`` steps (what the model makes after the stop)."""
    tokens = torch.as_tensor(start, dtype=torch.int64).clone()
    finished = torch.zeros(len(tokens), dtype=torch.bool)
    out, stopped = [], None
    for n in range(max_new):
        nxt = torch.where(finished, PAD, (logits[tokens] / TEMPERATURE).argmax(dim=-1))
        out.append(nxt)
        finished = finished | (nxt == EOS)
        if stopped is None and (bool(finished.all()) or torch.equal(nxt, tokens)):
            stopped = n
            if stop:
                break
        tokens = nxt
    return torch.stack(out, dim=1), stopped


class _Waits:
    """What the loop's waits were: busy-waits (an event queried again, still False, with no
    ``m.forward()`` in between) and waits on the newest step's work (``synchronize()`` of an event
    recorded after the last ``m.forward()``, or of the whole stream)."""

    def __init__(self, m):
        self.m, self.polls, self.full = m, 0, 0


class _Event:
    def __init__(self, ev, waits: _Waits):
        self._ev, self._w = ev, waits
        self._at = None       # m.forwards when recorded
        self._polled = None   # m.forwards at the last query that said False

    def record(self, stream=None):
        self._at, self._polled = self._w.m.forwards, None
        return self._ev.record() if stream is None else self._ev.record(stream)

    def query(self) -> bool:
        done = self._ev.query()
        if not done:
            if self._polled == self._w.m.forwards:
                self._w.polls += 1
            self._polled = self._w.m.forwards
        return done

    def synchronize(self) -> None:
        if self._at is not None and self._at == self._w.m.forwards:
            self._w.full += 1
        self._ev.synchronize()

    def wait(self, stream=None):
        return self._ev.wait() if stream is None else self._ev.wait(stream)


class _Stream:
    """The stream handed to the learner (``m.stream``): the real one, with its events watched."""

    def __init__(self, s, waits: _Waits):
        self._s, self._w = s, waits

    def __getattr__(self, name):
        return getattr(self._s, name)

    def Event(self, *args, **kwargs):  # noqa: N802 - mirrors torch.cuda.Event
        return _Event(self._s.Event(*args, **kwargs), self._w)

    def synchronize(self) -> None:
        self._w.full += 1
        self._s.synchronize()


class _Audit(l07.LoopAudit):
    """Lesson 07's LoopAudit, each call counted at the line of the loop it came from, directly or through
    the learner's own helpers (a stopping criterion written as a class outside the loop, say)."""

    _where = l07.LoopAudit._caller_line


def new_stream():
    """The stream the checker runs on: CUDA, or the watched emulated lagging stream."""
    return CudaStream() if has_cuda() else WatchedLagging()


def run_decode(s, fn, succ: dict, start, max_new: int) -> dict:
    """Run ``fn(m, max_new)`` once on ``s`` under lesson 07's LoopAudit and :func:`detect_races`.
    Returns ``tokens`` (a host tensor, or None), ``error`` (an exception, or None), ``audit`` (LoopAudit
    events), ``races`` (findings by kind), ``first_race``, ``polls``, ``full_waits``."""
    max_new = positive_int("max_new", max_new)
    threads = torch.get_num_threads()
    if s.emulated:
        torch.set_num_threads(1)  # tiny emulated kernels: one thread (as lesson 07's run_loop)
    try:
        with s:
            m = DecodeEngine(s, succ, start)
            s.synchronize()
            waits = _Waits(m)
            real, m.stream = m.stream, _Stream(s, waits)
            audit = _Audit(s, fn)
            out, error = None, None
            with detect_races() as races:
                watch = Watch(s) if s.emulated else nullcontext()
                try:
                    with watch, audit, learner_call(f"{getattr(fn, '__name__', 'fixed_decode')}(m, {max_new})"):
                        out = fn(m, max_new)
                except LearnerStop:
                    raise
                except Exception as exc:  # the learner's bug: reported by the caller
                    error = exc
                m.stream = real
                s.synchronize()
            tokens = None
            if error is None and isinstance(out, torch.Tensor):
                tokens = out.to("cpu").clone()
    finally:
        torch.set_num_threads(threads)
    first = races.findings[0] if races.findings else None
    return {"tokens": tokens, "returned": out, "error": error, "audit": audit.as_list(),
            "races": dict(races.counts), "first_race": first, "polls": waits.polls, "full_waits": waits.full}


def _at(e: dict, name: str) -> str:
    code = f", in `{e['code']}`" if e.get("code") else ""
    return f"`{e['call']}` at line {e['line']} of {name} ({e['count']} times{code})"


def problem(r: dict, case: str, max_new: int, want: torch.Tensor, stopped, full: torch.Tensor,
            name: str = "fixed_decode") -> str | None:
    """What is wrong with one :func:`run_decode` result, in the lesson's terms (None: nothing)."""
    got = r["tokens"]
    if got is None:
        kind = type(r["returned"]).__name__
        return (f"{name}(m, {max_new}) returned {kind}, not a tensor of tokens ({case}): return "
                "`torch.stack(out, dim=1)`, the (batch, steps) tokens on the GPU.")
    syncs = [e for e in r["audit"] if e["count"] > IN_LOOP]
    if syncs:
        e = syncs[0]
        return (f"a host sync inside the loop: {_at(e, name)}. Each one waits for every kernel queued so far: "
                "the GPU runs dry before the host queues the next step. `x in t` and `torch.equal` of a GPU "
                "tensor sync like `.item()`: compute the criterion on the GPU and read it late.")
    if r["polls"]:
        return (f"a busy-wait: an event was queried again and again ({r['polls']} polls) with no step queued in "
                "between (`while not ev.query(): pass`). It waits like `ev.synchronize()` and spins a CPU core "
                "doing it: call `ev.synchronize()` on the previous step's event.")
    if r["first_race"] is not None:
        f = r["first_race"]
        n = sum(r["races"].values())
        return (f"a race ({n} finding(s), {case}): {f}. A pinned slot is read before its copy has run, or "
                "while a later step's copy writes it: read only the slot whose event you waited for, and give "
                "the step in flight its own slot (two slots).")
    shape = tuple(want.shape)
    if got.dim() != 2 or got.shape[0] != shape[0] or got.dtype != torch.int64:
        return (f"{name} returned a tensor of shape {tuple(got.shape)} ({str(got.dtype).replace('torch.', '')}) "
                f"({case}), expected ({shape[0]}, steps) int64 tokens.")
    steps = got.shape[1]
    if steps < shape[1]:
        return (f"{name} stopped after {steps} steps ({case}), before the criterion was met: the reference "
                f"decodes {shape[1]} steps. Stop only on the step whose flag says so.")
    late = steps - shape[1]
    if late > 1:
        return (f"{name} stopped {late} steps late ({case}: {steps} steps decoded, the criterion was met at "
                f"step {stopped}): a deferred check may read the flag one step late, no later. Read the "
                "previous step's slot, not an older one (a ring of two slots).")
    if not torch.equal(got, full[:, :steps]):
        diff = (got != full[:, :steps]).nonzero()[0].tolist()
        return (f"{name} made different tokens ({case}): sequence {diff[0]}, step {diff[1]}: got "
                f"{int(got[diff[0], diff[1]])}, the model makes {int(full[diff[0], diff[1]])}. The check "
                "changes when the host reads the flag, never what is decoded (finished sequences emit m.pad).")
    if r["full_waits"] > IN_LOOP:
        return (f"a wait on the newest step's work inside the loop ({r['full_waits']} times): "
                "`ev.synchronize()` on the event recorded after the last `m.forward()` (or `s.synchronize()`) "
                "leaves the GPU nothing queued, as serial as `bool()`. Wait for the previous step's event, "
                "after this step's forward is queued.")
    return None


@checker
def check_decode(fn, cases=CASES) -> bool:
    """``fixed_decode(m, max_new) -> tokens``: the lesson's decode loop without host syncs or races,
    judged exactly on every case (tokens, stop at most one step late, syncs, waits, races)."""
    learner_arg("fixed_decode", fn, "(m, max_new) -> tokens (a (batch, steps) tensor)")
    name = getattr(fn, "__name__", "fixed_decode")
    if not isinstance(name, str) or not name.isidentifier():
        name = "fixed_decode"
    s = new_stream()
    show("fixed_decode checked on", s.label)
    for case, succ, start, max_new in cases:
        logits = table(succ)
        want, stopped = reference(logits, start, max_new)
        full, _ = reference(logits, start, max_new, stop=False)
        try:
            r = run_decode(s, fn, succ, start, max_new)
        except LearnerStop as stop:
            return _fail(f"fixed_decode: {stop}")
        if r["error"] is not None:
            if is_stub(r["error"], fn):
                return not_implemented("fixed_decode")
            return _fail(f"{name}(m, {max_new}) raised {raised(r['error'])} ({case})")
        for e in r["audit"]:
            e["code"] = l07.line_code(fn, e["line"])
        found = problem(r, case, max_new, want, stopped, full, name)
        if found:
            return _fail(found)
    _FAILURES.pop("fixed_decode", None)
    say(f"✅ fixed_decode is correct ({len(cases)} cases: the reference's tokens, the stop at most one step late, "
        "no host sync or busy-wait inside the loop, 0 races).")
    return True
