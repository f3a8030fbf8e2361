"""Lesson 09's checker accepts the master solution and rejects the planted decode loop and plausible
wrong fixes, each with the message that names what is still wrong (on the emulated lagging stream
without a GPU: exact about the order of host reads, copies and waits)."""
import linecache

import pytest
import torch

from nbtools import solution_namespace
from pinlab.checks import l09 as checks09

STEM = "09_real_code"


@pytest.fixture(scope="module")
def sol():
    return solution_namespace(STEM)


@pytest.fixture(autouse=True)
def _fresh():
    checks09.reset()


def _variant(sol, name, *edits):
    """The master solution's ``fixed_decode`` with source edits ``(old, new)``, compiled on its own."""
    src = _solution_source()
    for old, new in edits:
        assert old in src, f"edit for {name} does not apply: {old!r}"
        src = src.replace(old, new)
    ns = {"torch": torch}
    filename = f"<{name}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)  # as IPython keeps a cell's
    exec(compile(src, filename, "exec"), ns)
    return ns["fixed_decode"]


def _master() -> str:
    from pathlib import Path

    return (Path(__file__).resolve().parents[1] / "solutions" / "src" / f"{STEM}.py").read_text(encoding="utf-8")


def _planted_source() -> str:
    """The planted loop and its stopping criterion, as the master copy writes them."""
    text = _master()
    return text[text.index("class StopOnEosOrRepeat:"):text.index("# %% [markdown]\n# ## Audit it")]


def _solution_source() -> str:
    """``fixed_decode`` as the master copy writes it (the solution markers dropped)."""
    text = _master()
    start = text.index("def fixed_decode(m, max_new):")
    end = text.index("### END SOLUTION", start)
    return "\n".join(line for line in text[start:end].splitlines() if "### BEGIN SOLUTION" not in line) + "\n"


WAIT = "            # step n - 1's copy has run; step n is queued\n            done[(n - 1) % 2].synchronize()"
FINISHED = "        finished = finished | (nxt == m.eos)"
STOP = "        stop = finished.all() | (nxt == tokens).all()  # the criterion, on the GPU"
WHERE = "        nxt = torch.where(finished, m.pad, logits.argmax(dim=-1))"
OUT = "        out.append(nxt)"

WRONG = {
    "polls-event-query": ((
        (WAIT, "            while not done[(n - 1) % 2].query():\n                pass"),),
        ["a busy-wait", "`while not ev.query(): pass`"]),
    "x-in-device-tensor": ((
        (FINISHED, "        if m.eos in nxt:\n            finished = finished | (nxt == m.eos)"),),
        ["a host sync inside the loop: `x in tensor (Tensor.__contains__)`"]),
    "torch-equal-on-device": ((
        (STOP, "        stuck = torch.equal(nxt, tokens)\n        stop = finished.all() | (nxt == tokens).all()"),),
        ["a host sync inside the loop: `torch.equal()`"]),
    "item-inside-loop": ((
        (OUT, OUT + "\n        if nxt.max().item() >= m.vocab:\n            raise ValueError('out of range')"),),
        ["a host sync inside the loop: `.item()`"]),
    "tolist-inside-loop": ((
        (OUT, OUT + "\n        seen = nxt.tolist()"),),
        ["a host sync inside the loop: `.tolist()`"]),
    "one-slot-ring": ((
        ("for _ in range(2)]", "for _ in range(1)]"), ("flags[n % 2]", "flags[0]"), ("flags[(n - 1) % 2]", "flags[0]")),
        ["a race", "destination of a pending D2H copy"]),
    "reads-slot-before-its-event": ((
        (WAIT, "            pass"),),
        ["a race", "host read the destination of a pending D2H copy"]),
    "stop-two-steps-late": ((
        ("for _ in range(2)]", "for _ in range(3)]"), ("done = [None, None]", "done = [None, None, None]"),
        ("flags[n % 2]", "flags[n % 3]"), ("done[n % 2]", "done[n % 3]"), ("if n > 0:", "if n > 1:"),
        ("done[(n - 1) % 2]", "done[(n - 2) % 3]"), ("flags[(n - 1) % 2]", "flags[(n - 2) % 3]"),
        ("                out.pop()  # step n was decoded after the stop\n", "")),
        ["stopped 2 steps late"]),
    "tokens-changed": ((
        (WHERE, "        nxt = logits.argmax(dim=-1)"),),
        ["made different tokens"]),
    "waits-on-this-steps-event": ((
        (WAIT, "            done[n % 2].synchronize()"),),
        ["a wait on the newest step's work inside the loop"]),
    "synchronize-every-step": ((
        (WAIT, WAIT + "\n            s.synchronize()"),),
        ["a host sync inside the loop: `stream.synchronize()` at line 21 of fixed_decode"]),
    # issue 48 (l09.one_step_early_accepted): the step before the stop dropped too
    "stops-one-step-early": ((
        ("                out.pop()  # step n was decoded after the stop\n",
         "                out.pop()  # step n was decoded after the stop\n"
         "                out.pop()\n"),),
        ["stopped after", "before the criterion was met"]),
    # issue 48 (l09.float_tokens_accepted): the right token ids, as floats
    "float-tokens": ((
        ("    return torch.stack(out, dim=1)", "    return torch.stack(out, dim=1).float()"),),
        ["(float32)", "expected (3, steps) int64 tokens"]),
    # issue 48's holes, found by a new learner on the emulated stream and on the H200 (each was accepted: "✅ ... no
    # host sync or busy-wait inside the loop, 0 races"): torch.cuda.synchronize and torch.cuda.Event are watched as
    # in lesson 07, single-argument torch.where is a sync, the forwards are counted
    "torch-cuda-synchronize-every-step": ((
        (WAIT, WAIT + "\n            torch.cuda.synchronize()"),),
        ["a host sync inside the loop: `torch.cuda.synchronize()` at line 21 of fixed_decode"]),
    "waits-on-this-steps-torch-cuda-event": ((
        ("        done[n % 2] = s.Event()", "        done[n % 2] = torch.cuda.Event()"),
        (WAIT, "            done[n % 2].synchronize()")),
        ["a wait on the newest step's work inside the loop: `event.synchronize()` at line 19 of fixed_decode"]),
    "polls-this-steps-torch-cuda-event": ((
        ("        done[n % 2] = s.Event()", "        done[n % 2] = torch.cuda.Event()"),
        (WAIT, "            while not done[n % 2].query():\n                pass")),
        ["a busy-wait: `event.query() polled` at line 19 of fixed_decode"]),
    "runs-every-forward": ((
        ("                break\n", "                pass\n"),),
        ["fixed_decode called m.forward() 16 times (stop by end-of-sequence) where the criterion was met at step 8",
         "at most 10 steps", "`break`"]),
    "single-argument-torch-where": ((
        (STOP, STOP + "\n        if len(torch.where(finished)[0]) == m.batch:\n            pass"),),
        ["a host sync inside the loop: `torch.where(cond) with one argument (a .nonzero())` at line 14 of "
         "fixed_decode"]),
}


def test_the_solution_passes(sol, capsys):
    assert checks09.check_decode.verdict(sol["fixed_decode"]) is True
    assert "✅ fixed_decode is correct" in capsys.readouterr().out


def test_the_solution_keeping_the_extra_step_passes(sol, capsys):
    keep = _variant(sol, "keeps-extra-step",
                    ("                out.pop()  # step n was decoded after the stop\n", ""))
    assert checks09.check_decode.verdict(keep) is True, capsys.readouterr().out


def test_torch_cuda_events_and_one_synchronize_after_the_loop_pass(sol, capsys):
    """torch.cuda.Event() is watched as s.Event() is, and torch.cuda.synchronize() after the loop (once) is no sync
    inside it: the watching of issue 48 rejects neither."""
    fn = _variant(sol, "torch-cuda-event-and-final-sync",
                  ("        done[n % 2] = s.Event()", "        done[n % 2] = torch.cuda.Event()"),
                  ("    return torch.stack(out, dim=1)",
                   "    torch.cuda.synchronize()\n    return torch.stack(out, dim=1)"))
    assert checks09.check_decode.verdict(fn) is True, capsys.readouterr().out


def test_the_planted_loop_fails_on_its_first_sync(sol, capsys):
    capsys.readouterr()
    assert checks09.check_decode.verdict(sol["planted_decode"]) is False
    out = capsys.readouterr().out
    assert "a host sync inside the loop: `.item()`" in out


@pytest.mark.parametrize("name", sorted(WRONG))
def test_a_planted_wrong_answer_is_rejected(sol, capsys, name):
    edits, words = WRONG[name]
    fn = _variant(sol, name, *edits)
    capsys.readouterr()
    assert checks09.check_decode.verdict(fn) is False
    out = capsys.readouterr().out
    for w in words:
        assert w in out, f"{name}: {w!r} not in {out!r}"



# Issue 47: "the exercise's tests never ran on the GPU". Issue 48: the same verdict on a GPU as on a laptop. On CUDA
# the checker runs the loop on the CUDA stream and judges races by order, so that a race this GPU's timing hides is
# still rejected (3 racy answers were accepted on the H200 alone when races were judged by timing). The order
# verdict turns on torch's GPU trace for good: tests/cuda_checks09_child.py runs in a process of its own.
@pytest.mark.gpu
def test_gpu_the_checker_gives_the_cpus_verdicts_on_cuda_in_a_process_of_its_own():
    import gpu_child

    gpu_child.run("cuda_checks09_child.py")


def test_every_case_is_run_a_loop_wrong_only_on_the_second_case_is_rejected(sol, capsys):
    """l09.first_case_only: a loop that stops only when every sequence has finished (no stop by repetition) is
    right on the first case and decodes to max_new on the second: the checker runs every case and names it."""
    no_repeat = _variant(sol, "no-stop-by-repetition",
                         (STOP, "        stop = finished.all()  # no repetition check"))
    first = checks09.CASES[:1]
    assert checks09.check_decode.verdict(no_repeat, cases=first) is True, "right on the first case alone"
    checks09.reset()
    capsys.readouterr()
    assert checks09.check_decode.verdict(no_repeat) is False
    out = capsys.readouterr().out
    assert "steps late (stop by repetition" in out, out

def test_the_planted_loops_three_syncs_and_its_race_are_each_found(sol, capsys):
    """The planted loop with each sync taken out in turn: the next one is named, then the race."""
    planted = _planted_source()
    steps = [
        ("        if nxt.max().item() >= logits.shape[-1]:  # a sanity check\n"
         "            raise ValueError(\"token out of range\")\n", "", "`x in tensor (Tensor.__contains__)`"),
        ("        if self.eos in nxt:  # did a sequence finish this step?\n"
         "            finished = finished | (nxt == self.eos)",
         "        finished = finished | (nxt == self.eos)", "`torch.equal()`"),
        ("        stuck = torch.equal(nxt, prev)  # every sequence repeated its last token",
         "        stuck = False", "a race"),
    ]
    for old, new, word in steps:
        assert old in planted, old
        planted = planted.replace(old, new)
        ns = {"torch": torch}
        exec(compile(planted, "<planted>", "exec"), ns)
        checks09.reset()
        capsys.readouterr()
        assert checks09.check_decode.verdict(ns["planted_decode"]) is False
        assert word in capsys.readouterr().out, word


def test_a_stub_is_not_implemented(capsys):
    def fixed_decode(m, max_new):
        raise NotImplementedError

    assert checks09.check_decode.verdict(fixed_decode) is False
    assert "⏳ fixed_decode is not implemented yet" in capsys.readouterr().out


def test_not_a_tensor_and_not_a_function(sol, capsys):
    assert checks09.check_decode.verdict(lambda m, max_new: [1, 2]) is False
    assert "not a tensor of tokens" in capsys.readouterr().out
    with pytest.raises(TypeError, match="fixed_decode must be a function"):
        checks09.check_decode.verdict(3)


def test_the_reference_cases_stop_where_the_cases_say():
    stops = [checks09.reference(checks09.table(succ), start, max_new)[1] for _, succ, start, max_new in checks09.CASES]
    assert stops[0] is not None and stops[1] is not None and stops[2] is None
    assert all(s is None or s + 3 <= mx for s, (_, _, _, mx) in zip(stops, checks09.CASES))  # 2 late can show


def test_two_slots_of_one_pinned_tensor_are_correct(sol, capsys):
    """Issue 48: two slots as two elements of one pinned tensor are two slots (the order verdict matches byte
    ranges; pinlab.races' timing verdict matched the storage and called it a race)."""
    fn = _variant(sol, "one-tensor-two-slots",
                  ("flags = [torch.zeros((), dtype=torch.bool, pin_memory=True) for _ in range(2)]",
                   "flags = torch.zeros(2, dtype=torch.bool, pin_memory=True)"))
    capsys.readouterr()
    assert checks09.check_decode.verdict(fn) is True, capsys.readouterr().out


def _rejected_output(sol, capsys, name) -> str:
    """What the checker prints for the planted wrong answer ``name`` of WRONG (it must be rejected)."""
    capsys.readouterr()
    assert checks09.check_decode.verdict(_variant(sol, name, *WRONG[name][0])) is False
    return capsys.readouterr().out


def test_a_two_slot_loop_that_reads_early_is_not_told_to_use_two_slots(sol, capsys):
    """Issue 48: a loop with two slots that reads one before its event is told to wait, not to use two slots; a
    loop with one slot is told to use two."""
    out = _rejected_output(sol, capsys, "reads-slot-before-its-event")
    assert "a race" in out and "two slots" not in out and "after `synchronize()` of the event" in out, out
    checks09.reset()
    assert "give each step its own slot (two slots" in _rejected_output(sol, capsys, "one-slot-ring")


def test_a_race_is_named_by_the_line_of_the_learners_function(sol, capsys):
    """Issue 48: a race names the lines of the learner's function, as the sync messages do (not the compiled file:
    in a notebook ipykernel_<pid>/<hash>.py:135)."""
    out = _rejected_output(sol, capsys, "reads-slot-before-its-event")
    assert ("the copy at line 15 of fixed_decode (`flags[n % 2].copy_(stop, non_blocking=True)`), touched by the "
            "host at line 20 of fixed_decode (`if flags[(n - 1) % 2]:`)") in out, out
    assert "<reads-slot-before-its-event>:" not in out, out


@pytest.fixture
def keeping_up(monkeypatch):
    """The checker's stream is an emulated GPU that runs all work before the host's next call, as a GPU that
    keeps up does: every event is reached when the loop queries it."""
    from pinlab.checks.l02 import WatchedLagging
    from pinlab.order import _BoundedQueue

    def stream():
        s = WatchedLagging()
        s._queue = _BoundedQueue(s, 0)
        return s

    monkeypatch.setattr(checks09, "new_stream", stream)


@pytest.mark.parametrize("name", ["polls-event-query", "polls-this-steps-torch-cuda-event"])
def test_a_busy_wait_is_seen_in_the_code_on_a_gpu_that_keeps_up(sol, capsys, keeping_up, name):
    """Stop 55, on an H100: ``while not ev.query(): pass`` was accepted, because on a GPU that keeps up the
    event is reached, ``query()`` says True at once and the loop never spins. The checker reads the loop's
    condition from its source (a notebook cell's, as IPython keeps it; here linecache's): a busy-wait whatever
    ``query()`` returned."""
    out = _rejected_output(sol, capsys, name)
    assert "a busy-wait: `event.query() polled` at line " in out and "while not done[" in out, out
    checks09.reset()
    assert checks09.check_decode.verdict(sol["fixed_decode"]) is True, capsys.readouterr().out


def test_a_spin_loop_is_a_while_whose_condition_queries_and_that_calls_nothing_else():
    src = ("while not ev.query():\n    pass\n"
           "while not ev.query():\n    time.sleep(0.001)\n"
           "while n < steps:\n    m.forward(t)\n    if ev.query():\n        break\n"
           "while ev.query() is False and work():\n    pass\n")
    linecache.cache["<spin>"] = (len(src), None, src.splitlines(True), "<spin>")
    assert [checks09._spin_loop_at("<spin>", line) for line in (1, 3, 5, 7, 9)] == [True, True, False, False, False]
    assert checks09._spin_loop_at("<not kept>", 1) is False
