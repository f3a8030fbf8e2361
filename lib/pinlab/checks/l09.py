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
  ``x in t``, ``torch.equal`` of a device tensor, single-argument ``torch.where(cond)`` (a ``.nonzero()``), a
  blocking copy, ``s.synchronize()`` and ``torch.cuda.synchronize()`` (lesson 07's
  :class:`~pinlab.lessons.l07_capstone_audit.LoopAudit` names each by its line);
* no busy-wait (``while not ev.query(): pass``), and no line waits more than once on the newest step's work
  (``ev.synchronize()`` on an event recorded after the last ``m.forward()``): a wait inside the loop is on an
  event with a later step queued behind it. Every event is watched, ``s.Event()`` and ``torch.cuda.Event()``
  alike (lesson 07's ``LoopAudit.event_class``, as its ``run_loop`` watches them);
* the loop calls ``m.forward()`` at most once more than the reference's steps (it leaves the loop one step
  after the criterion is met, not only drops the extra tokens);
* :func:`pinlab.order.detect_races` finds no race (a pinned flag read before its copy ran, or while a later
  copy writes it): the verdict by order (happens-before), the same on the GPU and on the emulated stream,
  matched by byte range (two slots of one pinned tensor are two slots). A race is named by the lines of the
  learner's function, as a sync is.

It prints one verdict (⏳ / ❌ what is wrong, in the lesson's terms / ✅), with a hint from the second
failure on. ``tests/test_checks_l09.py`` proves it accepts the master solution and rejects planted
wrong answers with the right message.
"""
from __future__ import annotations

import ast
import functools
import linecache
import sys
from contextlib import contextmanager, nullcontext

import torch

from ..args import positive_int
from ..device import has_cuda
from ..lessons import l07_capstone_audit as l07
from ..order import detect_races
from ..streams import CudaStream
from ..timing import show
from . import LearnerStop, _FAILURES, _failed, checker, is_stub, learner_arg, learner_call, not_implemented, raised, say
from .l02 import Watch, WatchedLagging

VOCAB, BATCH, EOS, PAD = 32, 3, 1, 0
TEMPERATURE = 0.7
BUSY_MS = 0.5  #: the GPU work of one forward: on CUDA it keeps the GPU behind a host that does not wait
IN_LOOP = 1    #: a sync or a full wait made more often than this (at one line) is inside the loop
BUSY_WAIT = "busy-wait"  #: an event queried again, still False, with no m.forward() in between
#: the calls a spin loop makes besides ``query()``: ``while not ev.query(): time.sleep(0)`` spins too
SPIN_CALLS = frozenset({"query", "sleep"})

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

    lm_head = None  #: no LM head to restore (lesson 07's LoopAudit asks its model for one)

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

    @property
    def decoded(self) -> int:
        """The newest step whose forward is queued (-1 before the first): lesson 07's LoopAudit records an
        event's step and tells a poll (no step queued in between) by it."""
        return self.forwards - 1


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


class _Audit(l07.LoopAudit):
    """Lesson 07's LoopAudit on the decode loop: each call counted at the line of the loop it came from,
    directly or through the learner's own helpers (a stopping criterion written as a class outside the loop,
    say); its events (``s.Event()`` and ``torch.cuda.Event()``) note a :data:`BUSY_WAIT` for every poll and a
    :data:`~pinlab.lessons.l07_capstone_audit.FULL_WAIT` for a wait on the newest step's event; single-argument
    ``torch.where`` is a host sync; ``slots``: the host memory the loop's device-to-host copies write."""

    _where = l07.LoopAudit._caller_line

    def __init__(self, s, fn, m: DecodeEngine):
        super().__init__(s, fn)
        self.model = m  # the events' steps (m.decoded); no steps of its own: nothing is "inside" in lesson 07's sense
        self.slots: set = set()

    def _wait(self, recorded, call: str) -> None:
        """A wait on an event recorded when step ``recorded`` was the newest: lesson 07's rule without its set-up
        and draining windows (this loop's end is not known in advance: :data:`IN_LOOP` judges the count)."""
        if recorded is None:
            return
        poll = call.endswith("polled")
        if poll or recorded == self.model.decoded:
            line = self._caller_line()
            if line is not None:
                self._note(BUSY_WAIT if poll else l07.FULL_WAIT, call, 0, line)

    def event_class(self, base):
        """Lesson 07's watched events, whose ``query()`` in the condition of a spin loop is a poll at once."""
        cls = super().event_class(base)
        cls.query = _spin_query
        return cls

    def _inspect(self, name, args, kwargs):
        """Lesson 07's audit of a torch call, plus ``torch.where(cond)`` and the destinations of D2H copies."""
        super()._inspect(name, args, kwargs)
        first = args[0] if args else None
        if name == "where" and len(args) == 1 and not kwargs and self._dev(first):
            nbytes = first.numel() * first.element_size()
            self._note(l07.SYNC, "torch.where(cond) with one argument (a .nonzero())", nbytes)
        elif name == "copy_" and len(args) >= 2 and self._dev(args[1]) and isinstance(first, torch.Tensor) \
                and not self._dev(first):
            size = first.element_size()
            self.slots.add((first.untyped_storage().data_ptr(), first.storage_offset() * size, first.numel() * size))

    @contextmanager
    def watching_cuda(self):
        """``torch.cuda.Event`` makes watched events and ``torch.cuda.synchronize()`` is a host sync of the loop's
        line while the block runs, as in lesson 07's ``run_loop``; both restored after it."""
        event, sync = torch.cuda.Event, torch.cuda.synchronize
        torch.cuda.Event, torch.cuda.synchronize = self.event_class(event), self.cuda_synchronize
        self._saved_cuda_sync = sync
        try:
            yield
        finally:
            torch.cuda.Event, torch.cuda.synchronize, self._saved_cuda_sync = event, sync, None

    def line_of(self, where: str):
        """The line of the loop (from ``def``, line 1) of a detector's ``"file:line"``; None outside the loop."""
        file, _, line = where.rpartition(":")
        if file == self.file and line.isdigit() and self.first <= int(line) <= self.last:
            return int(line) - self.first + 1
        return None


def _spin_query(ev):
    """Lesson 07's ``query()`` (a poll: queried again, False, with no step enqueued in between), plus: a
    ``query()`` in the condition of a ``while`` loop that makes no other call (``while not ev.query(): pass``)
    is a poll whatever it returned. On a GPU that keeps up the event is reached already, ``query()`` says True
    at once and the loop never spins: on CUDA only the code shows the busy-wait (stop 55, on an H100: two
    polling answers were accepted). Noted once per record of the event and step, as lesson 07 notes a poll."""
    frame = sys._getframe(1)
    done = l07._ev_query(ev)
    m = ev._pinlab_audit.model
    if m is not None and ev._pinlab_step is not None and _spin_loop_at(frame.f_code.co_filename, frame.f_lineno):
        seen = (ev._pinlab_step, m.decoded)
        if getattr(ev, "_pinlab_spun", None) != seen:
            ev._pinlab_spun = seen
            if ev._pinlab_poll != ("polled", m.decoded):  # lesson 07's rule had not noted this poll
                ev._pinlab_audit._wait(ev._pinlab_step, "event.query() polled")
            ev._pinlab_poll = ("polled", m.decoded)
    return done


def _spin_loop_at(filename: str, line: int) -> bool:
    """Whether ``line`` of ``filename`` is in the condition of a ``while`` loop whose condition and body call
    nothing but ``query()`` (and ``sleep()``): a spin loop. Read from the source Python keeps for the file or
    the notebook cell (linecache); False where there is none (code compiled from a string)."""
    tree = _parsed("".join(linecache.getlines(filename)))
    if tree is None:
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.While) and node.test.lineno <= line <= node.test.end_lineno:
            names = {_called(c) for c in ast.walk(node) if isinstance(c, ast.Call)}
            if "query" in {_called(c) for c in ast.walk(node.test) if isinstance(c, ast.Call)} \
                    and names <= SPIN_CALLS:
                return True
    return False


def _called(call: ast.Call) -> str | None:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


@functools.lru_cache(maxsize=64)
def _parsed(text: str):
    try:
        return ast.parse(text) if text else None
    except SyntaxError:  # a cell with IPython magics: lesson 07's rule alone
        return None


def new_stream():
    """The stream the checker runs on: CUDA, or the watched emulated lagging stream."""
    return CudaStream() if has_cuda() else WatchedLagging()


def run_decode(s, fn, succ: dict, start, max_new: int) -> dict:
    """Run ``fn(m, max_new)`` once on ``s`` under lesson 07's LoopAudit (:class:`_Audit`) and
    :func:`pinlab.order.detect_races`. Returns ``tokens`` (a host tensor, or None), ``error`` (an exception, or
    None), ``audit`` (LoopAudit events, each with the ``code`` of its line where the source can be read),
    ``races`` (findings by kind), ``race`` (the first finding: ``kind``, ``copy`` and ``seen`` sites, or None),
    ``slots`` (how many host places the loop's D2H copies write), ``forwards``."""
    max_new = positive_int("max_new", max_new)
    threads = torch.get_num_threads()
    if s.emulated:
        torch.set_num_threads(1)  # tiny emulated kernels: one thread (as lesson 07's run_loop)
    try:
        with s:
            m = DecodeEngine(s, succ, start)
            s.synchronize()
            audit = _Audit(s, fn, m)
            real, m.stream = m.stream, l07._WatchedStream(s, audit)
            out, error = None, None
            with detect_races() as races:
                watch = Watch(s) if s.emulated else nullcontext()
                try:
                    with watch, audit, audit.watching_cuda(), \
                            learner_call(f"{getattr(fn, '__name__', 'fixed_decode')}(m, {max_new})"):
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
    events = audit.as_list()
    for e in events:
        e["code"] = l07.line_code(fn, e["line"])
    race = None
    if races.findings:
        f = races.findings[0]
        race = {"kind": f.kind, "count": sum(races.counts.values()),
                **{k: _site(audit, fn, where) for k, where in (("copy", f.copy_where), ("seen", f.seen_where))}}
    return {"tokens": tokens, "returned": out, "error": error, "audit": events, "races": dict(races.counts),
            "race": race, "slots": len(audit.slots), "forwards": m.forwards}


def _site(audit: _Audit, fn, where: str) -> dict:
    """A detector's ``"file:line"`` as the audit names a line: ``line`` of the loop (None outside it), ``code``."""
    line = audit.line_of(where)
    return {"where": where, "line": line, "code": l07.line_code(fn, line) if line else None}


def _place(site: dict, name: str) -> str:
    """A :func:`_site` in words: ``line N of fixed_decode (`code`)``, or the detector's ``file:line`` outside it."""
    if site["line"] is None:
        return site["where"]
    code = f" (`{site['code']}`)" if site.get("code") else ""
    return f"line {site['line']} of {name}{code}"


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
    waits = (BUSY_WAIT, l07.FULL_WAIT)
    syncs = [e for e in r["audit"] if e["count"] > IN_LOOP and e["kind"] not in waits]
    if syncs:
        e = syncs[0]
        return (f"a host sync inside the loop: {_at(e, name)}. Each one waits for every kernel queued so far: "
                "the GPU runs dry before the host queues the next step. `x in t` and `torch.equal` of a GPU "
                "tensor sync like `.item()`: compute the criterion on the GPU and read it late.")
    polls = [e for e in r["audit"] if e["kind"] == BUSY_WAIT]
    if polls:
        return (f"a busy-wait: {_at(polls[0], name)}, an event queried again and again with no step queued in "
                "between (`while not ev.query(): pass`). It waits like `ev.synchronize()` and spins a CPU core "
                "doing it: call `ev.synchronize()` on the previous step's event.")
    race = r["race"]
    if race is not None:
        fix = ("Read a slot only after `synchronize()` of the event recorded after its copy: the previous step's "
               "event, then the previous step's slot." if r["slots"] > 1 else
               "With one slot the copy of the step in flight writes the slot the host reads: give each step its "
               "own slot (two slots, `flags[n % 2]`) and read the previous step's after its event.")
        return (f"a race ({case}): {race['kind']}, the copy at {_place(race['copy'], name)}, touched by the host "
                f"at {_place(race['seen'], name)} ({race['count']} copies can race). {fix}")
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
    allowed = min(shape[1] + 1, max_new)  # one step late at most, never past max_new
    if r["forwards"] > allowed:
        why = f"the criterion was met at step {stopped}" if stopped is not None else f"max_new is {max_new}"
        return (f"{name} called m.forward() {r['forwards']} times ({case}) where {why}: a deferred check "
                f"decodes at most {allowed} steps. Leave the loop with `break` once the previous step's flag "
                "says stop: dropping the extra tokens does not give the GPU its time back.")
    full = [e for e in r["audit"] if e["kind"] == l07.FULL_WAIT and e["count"] > IN_LOOP]
    if full:
        return (f"a wait on the newest step's work inside the loop: {_at(full[0], name)}. `ev.synchronize()` on "
                "the event recorded after the last `m.forward()` leaves the GPU nothing queued, as serial as "
                "`bool()`. Wait for the previous step's event, after this step's forward is queued.")
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
        found = problem(r, case, max_new, want, stopped, full, name)
        if found:
            return _fail(found)
    _FAILURES.pop("fixed_decode", None)
    say(f"✅ fixed_decode is correct ({len(cases)} cases: the reference's tokens, the stop at most one step late, "
        "no host sync or busy-wait inside the loop, 0 races).")
    return True
