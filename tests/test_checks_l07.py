"""Lesson 07's checker accepts the master solution (200 steps here; nbval of solutions/07 runs the checker's
default of 1000) and rejects plausible wrong fixes of the
capstone's loop, each with the message that names what is still wrong (on the emulated lagging stream
without a GPU: the emulation is exact about the order of host writes, copies and reads)."""
import inspect
import textwrap

import pytest

import make_exercises
import nbtools
from nbtools import solution_namespace
from pinlab.checks import l07 as checks07
from pinlab.lessons import l07_capstone_audit as l07

STEM = "07_capstone_audit"
FEW = 40  # the wrong answers are judged on fewer steps: they fail on the first ones


@pytest.fixture(scope="module")
def sol():
    return solution_namespace(STEM)


@pytest.fixture(autouse=True)
def _fresh():
    checks07.reset()


def _variant(name, *edits):
    """``l07.fixed_loop`` with source edits ``(old, new)`` applied, compiled as its own function."""
    src = textwrap.dedent(inspect.getsource(l07.fixed_loop))
    for old, new in edits:
        assert old in src, f"edit for {name} does not apply: {old!r}"
        src = src.replace(old, new)
    ns = {"torch": l07.torch}
    exec(compile(src, f"<{name}>", "exec"), ns)
    return ns["fixed_loop"]


SCHEDULE = "            m.schedule(n + 1, meta[(n + 1) % depth])"
COPY_META = "        m.meta_dev[n].copy_(meta[i], non_blocking=True)       # slot i is rewritten only after its event"
OFFLOAD = ('    m.lm_head_host = torch.empty_like(m.lm_head, device="cpu", pin_memory=True).copy_(m.lm_head)')
D2H = "        tokens_host[i].copy_(tokens, non_blocking=True)"

RECORD = "        done[i].record()"
DELIVER = "        if n + 1 >= depth:\n            deliver(n + 1 - depth)                            # frees slot (n + 1) % depth"
DRAIN = "    for k in range(max(0, steps - depth + 1), steps):"
RESTORE = "        m.lm_head.copy_(m.lm_head_host, non_blocking=True)    # pinned source: a truly async copy\n"
FIRST_SCHEDULE = "    m.schedule(0, meta[0])\n"
NO_RUN_AHEAD = "a wait that lets the host run no step ahead"


def ring_of_depth_1(m, steps):
    """The lesson's own solution with depth=1, the ring the lesson calls "as serial as the planted one"."""
    return l07.fixed_loop(m, steps, depth=1)


WRONG = {
    # one pinned buffer, "snapshotted" with pin_memory(): the same storage, the race stays
    "pin-memory-snapshot-of-pinned": (
        _variant("pin-memory-snapshot-of-pinned",
                 (COPY_META, "        m.meta_dev[n].copy_(meta[0].pin_memory(), non_blocking=True)"),
                 (SCHEDULE, "            m.schedule(n + 1, meta[0])")),
        ["pin_memory() of a pinned tensor returns the same storage", "at line 19 of fixed_loop",
         "step 0 of 40 delivered step 3's data"]),
    # one pinned buffer and no snapshot: the plain race of lesson 03
    "reused-pinned-buffer": (
        _variant("reused-pinned-buffer",
                 (COPY_META, "        m.meta_dev[n].copy_(meta[0], non_blocking=True)"),
                 (SCHEDULE, "            m.schedule(n + 1, meta[0])")),
        ["step 0 of 40 delivered step 3's data", "rewritten by the scheduler before its copy ran"]),
    # the stop check kept on the GPU with .item()
    "still-item": (
        _variant("still-item", (D2H, D2H + "\n        if tokens.eq(m.eos).any().item():\n            pass")),
        ["a host sync inside the loop: `.item()` at line 22 of fixed_loop (40 times)"]),
    # .tolist() of the GPU tokens to look for the end-of-sequence token
    "tolist-stop-check": (
        _variant("tolist-stop-check", (D2H, D2H + "\n        if m.eos in tokens.tolist():\n            pass")),
        ["a host sync inside the loop: `.tolist()`"]),
    # a wait for the whole GPU every step "to be safe"
    "sync-every-step": (
        _variant("sync-every-step", (D2H, D2H + "\n        s.synchronize()")),
        ["a host sync inside the loop: `stream.synchronize()` at line 22 of fixed_loop (40 times)"]),
    # nonzero() of a GPU tensor: its kernel must tell the host how many entries it found
    "nonzero-stop-check": (
        _variant("nonzero-stop-check", (D2H, D2H + "\n        if tokens.eq(m.eos).nonzero().numel():\n            pass")),
        ["a host sync inside the loop: `.nonzero()` at line 22 of fixed_loop (40 times)"]),
    # boolean-mask indexing of a GPU tensor: the result's size comes back to the host
    "mask-stop-check": (
        _variant("mask-stop-check", (D2H, D2H + "\n        if len(tokens[tokens == m.eos]):\n            pass")),
        ["a host sync inside the loop: `[boolean mask]` at line 22 of fixed_loop (40 times)"]),
    # the tokens read right after their copy is enqueued, before its event
    "reads-d2h-before-event": (
        _variant("reads-d2h-before-event",
                 (D2H, D2H + "\n        if m.eos in m.emit(n, tokens_host[i]):\n            m.note_stop(n)"),
                 ("        if m.eos in m.emit(k, tokens_host[k % depth]):\n            m.note_stop(k)", "        pass")),
        ["step 0's tokens were read before their D2H copy had run", "after an event"]),
    # the LM head still offloaded to pageable memory
    "pageable-offload": (
        _variant("pageable-offload", (OFFLOAD, '    m.lm_head_host = m.lm_head.to("cpu")')),
        ["a pageable non_blocking copy of 8 MiB", "at line 17 of fixed_loop (40 times)", "fake"]),
    # pinned, but through a pageable intermediate... that is still one pinned source: accepted below;
    # a pinned copy made every step from a pageable offload is a pageable copy per step, though
    "pin-every-step": (
        _variant("pin-every-step", (OFFLOAD, '    m.lm_head_host = m.lm_head.to("cpu")'),
                 ("        m.lm_head.copy_(m.lm_head_host, non_blocking=True)    # pinned source: a truly async copy",
                  "        m.lm_head.copy_(m.lm_head_host.pin_memory(), non_blocking=True)")),
        None),
    # the last depth-1 steps never delivered
    "no-drain": (
        _variant("no-drain", ("    for k in range(max(0, steps - depth + 1), steps):\n        deliver(k)\n", "")),
        ["step 37's tokens were never handed to m.emit() (3 of 40 steps missing)"]),
    # the stop check dropped altogether
    "no-stop-check": (
        _variant("no-stop-check", ("        if m.eos in m.emit(k, tokens_host[k % depth]):\n            m.note_stop(k)",
                                   "        m.emit(k, tokens_host[k % depth])")),
        ["the stop check is wrong", "was not noted"]),
    # (a) a wait on the event it just recorded, every step: a full wait, as s.synchronize() would be
    "waits-on-the-event-it-just-recorded": (
        _variant("waits-on-the-event-it-just-recorded", (RECORD, RECORD + "\n        done[i].synchronize()")),
        [NO_RUN_AHEAD, "`event.synchronize()` at line 24 of fixed_loop (39 times)",
         "recorded after the newest step the host had enqueued", "as serial as `s.synchronize()` every step"]),
    # (b) the lesson's own solution with depth=1: deliver() waits on the step just enqueued
    "ring-of-depth-1": (
        ring_of_depth_1,
        [NO_RUN_AHEAD, "`event.synchronize()` at line 3 of ring_of_depth_1 (39 times, in `return l07.fixed_loop(m, steps, depth=1)`)", "a ring of depth 1",
         "`depth` >= 2"]),
    # the same full wait, polled with query() instead of synchronize()
    "polls-the-event-it-just-recorded": (
        _variant("polls-the-event-it-just-recorded",
                 (RECORD, RECORD + "\n        while not done[i].query():\n            pass")),
        [NO_RUN_AHEAD, "`event.query() polled` at line 24 of fixed_loop"]),
    # a wait at the top of step n on step n-1's event: nothing of step n's decode is queued behind it
    "waits-on-the-previous-step-before-decoding": (
        _variant("waits-on-the-previous-step-before-decoding",
                 ("        m.encode(n)\n", "        m.encode(n)\n        if n:\n            done[(n - 1) % depth].synchronize()\n")),
        [NO_RUN_AHEAD, "`event.synchronize()` at line 20 of fixed_loop (39 times)"]),
    # (c) the LM head restored once, before the loop, instead of before every step
    "restore-hoisted-out-of-the-loop": (
        _variant("restore-hoisted-out-of-the-loop", (RESTORE, ""),
                 (FIRST_SCHEDULE, FIRST_SCHEDULE + "    m.lm_head.copy_(m.lm_head_host, non_blocking=True)\n")),
        ["the LM head was not restored before step 1's decode (39 of 40 steps)", "before every step",
         "Keep the restore inside the loop"]),
    # the restore dropped altogether (the GPU copy was never harmed, so the tokens are right)
    "no-restore": (
        _variant("no-restore", (RESTORE, "")),
        ["the LM head was not restored before step 0's decode (40 of 40 steps)"]),
    # the metadata slot guarded right, the tokens delivered one step late: step k's slot already holds
    # step k + depth's tokens when the host reads it
    "delivers-one-step-late": (
        _variant("delivers-one-step-late",
                 (DELIVER, "        if n + 1 >= depth:\n            done[(n + 1) % depth].synchronize()\n"
                           "        if n >= depth:\n            deliver(n - depth)"),
                 (DRAIN, "    for k in range(max(0, steps - depth), steps):")),
        ["step 0's tokens were overwritten by step 4's before they were read", "a later step's",
         "reused step 0's pinned slot"]),
    # the restore as an assignment into the GPU buffer: a blocking copy
    "restore-by-assignment": (
        _variant("restore-by-assignment", (RESTORE, "        m.lm_head[:] = m.lm_head_host\n")),
        ["a blocking copy inside the loop: `[...] = host tensor` at line 17 of fixed_loop (40 times)"]),
    # ---- issue 28: hidden syncs the audit missed, and a tolerance the exact audit does not need ----
    # `in` on the device tokens: Tensor.__contains__ is (x == t).any().item()
    "in-device-tokens-stop-check": (
        _variant("in-device-tokens-stop-check", (D2H, D2H + "\n        if m.eos in tokens:\n            pass")),
        ["a host sync inside the loop: `x in tensor (Tensor.__contains__)` at line 22 of fixed_loop (40 times"]),
    # torch.equal of device tensors answers a Python bool
    "torch-equal-stop-check": (
        _variant("torch-equal-stop-check",
                 (D2H, D2H + "\n        if torch.equal(tokens, torch.full_like(tokens, m.eos)):\n            pass")),
        ["a host sync inside the loop: `torch.equal()` at line 22 of fixed_loop (40 times"]),
    # a comparison used as a condition: bool() of a device tensor
    "bool-of-a-comparison-stop-check": (
        _variant("bool-of-a-comparison-stop-check", (D2H, D2H + "\n        if (tokens == m.eos).any():\n            pass")),
        ["a host sync inside the loop: `bool() or if of a tensor (Tensor.__bool__)` at line 22 of fixed_loop (40 times"]),
    # the device tokens handed straight to the detokenizer: its .tolist() waits for the GPU
    "emits-device-tokens": (
        _variant("emits-device-tokens",
                 (D2H, D2H + "\n        if m.eos in m.emit(n, tokens):\n            m.note_stop(n)"),
                 ("        if m.eos in m.emit(k, tokens_host[k % depth]):\n            m.note_stop(k)", "        pass")),
        ["a host sync inside the loop: `m.emit(k, <device tokens>) (its .tolist())` at line 21 of fixed_loop "
         "(40 times)"]),
    # 7 synchronize() calls inside 40 steps: fewer than the old tolerance of 8, still syncs inside the loop
    "seven-syncs-inside-the-loop": (
        _variant("seven-syncs-inside-the-loop", (D2H, D2H + "\n        if n % 6 == 0:\n            s.synchronize()")),
        ["a host sync inside the loop: `stream.synchronize()` at line 23 of fixed_loop (7 times"]),
    # one sync in the middle of the loop is one too many
    "one-sync-in-the-middle": (
        _variant("one-sync-in-the-middle", (D2H, D2H + "\n        if n == 20:\n            s.synchronize()")),
        ["a host sync inside the loop: `stream.synchronize()` at line 23 of fixed_loop (1 times"]),
    # torch.cuda.synchronize() every step: no torch call, the audit did not see it (and on a CPU it crashed)
    "cuda-synchronize-every-step": (
        _variant("cuda-synchronize-every-step", (D2H, D2H + "\n        torch.cuda.synchronize()")),
        ["a host sync inside the loop: `torch.cuda.synchronize()` at line 22 of fixed_loop (40 times"]),
    # the offload into pageable memory allocated with device="cpu": the restore reads pageable memory
    "pageable-offload-device-cpu": (
        _variant("pageable-offload-device-cpu",
                 (OFFLOAD, '    m.lm_head_host = torch.empty_like(m.lm_head, device="cpu").copy_(m.lm_head)')),
        ["a pageable non_blocking copy of 8 MiB", "at line 17 of fixed_loop (40 times)"]),
    # the offload asks for pinned memory on the GPU (empty_like keeps the device): CUDA refuses it
    "pinned-offload-on-the-gpu": (
        _variant("pinned-offload-on-the-gpu",
                 (OFFLOAD, '    m.lm_head_host = torch.empty_like(m.lm_head, pin_memory=True).copy_(m.lm_head)')),
        ["raised RuntimeError: Only dense CPU tensors can be pinned"]),
    # a blocking H2D copy of the metadata
    "blocking-metadata-copy": (
        _variant("blocking-metadata-copy", (COPY_META, "        m.meta_dev[n].copy_(meta[i])")),
        ["a blocking copy inside the loop: `.copy_() host to device` at line 19 of fixed_loop (40 times)"]),
}


@pytest.mark.slow
def test_accepts_the_solution_over_200_steps(sol, capsys):
    # 200 steps prove what 1000 do (the races show within the first steps); the 1000-step run is nbval's, of the
    # solution notebook's own call
    assert checks07.check_fixed_loop.verdict(sol["fixed_loop"], steps=200) is True
    out = capsys.readouterr().out
    assert "✅ fixed_loop is correct (200 steps: 0 corrupted" in out


def test_says_not_implemented(capsys):
    def stub(m, steps):
        raise NotImplementedError

    assert checks07.check_fixed_loop.verdict(stub, steps=FEW) is False
    assert "⏳ fixed_loop is not implemented yet" in capsys.readouterr().out


@pytest.mark.parametrize("case", [k for k, (_, msg) in WRONG.items() if msg])
def test_rejects_wrong_fixes_with_the_right_message(case, capsys):
    wrong, messages = WRONG[case]
    assert checks07.check_fixed_loop.verdict(wrong, steps=FEW) is False
    out = capsys.readouterr().out
    verdict = [line for line in out.splitlines() if line.startswith("❌")]
    assert len(verdict) == 1, out
    for message in messages:
        assert message in verdict[0], (case, verdict[0])
    assert "💡 Hint" not in out  # the first failure has no hint


RIGHT = {
    # depth 2: the host runs one step ahead, the least the checker accepts
    "ring-of-depth-2": lambda m, steps: l07.fixed_loop(m, steps, depth=2),
    # waiting on the event from 2 steps ago (and reading those tokens): run-ahead 2
    "waits-on-the-event-from-2-steps-ago": _variant(
        "waits-on-the-event-from-2-steps-ago",
        (DELIVER, "        if n >= 2:\n            deliver(n - 2)"), (DRAIN, "    for k in range(max(0, steps - 2), steps):")),
    # polling the event of the previous step after enqueuing this one: run-ahead 1
    "polls-the-previous-steps-event": _variant(
        "polls-the-previous-steps-event",
        (RECORD, RECORD + "\n        if n:\n            while not done[(n - 1) % depth].query():\n                pass")),
    # the restore into a new GPU tensor each step (an allocation per step, but a restore from pinned memory)
    "restore-into-a-new-buffer": _variant(
        "restore-into-a-new-buffer", (RESTORE, "        m.lm_head = m.lm_head_host.to(s.device, non_blocking=True)\n")),
    # issue 31: to(device, dtype, non_blocking) with non_blocking positional, from pinned memory: not a blocking copy
    "restore-into-a-new-buffer-positional-non-blocking": _variant(
        "restore-into-a-new-buffer-positional-non-blocking",
        (RESTORE, "        m.lm_head = m.lm_head_host.to(s.device, torch.float32, True)\n")),
    # copy_(src, True): non_blocking positional
    "restore-copy-positional-non-blocking": _variant(
        "restore-copy-positional-non-blocking",
        (RESTORE, "        m.lm_head.copy_(m.lm_head_host, True)\n")),
    # a ring of 12 drained with a synchronize() per step left in flight (11 of them, more than the old
    # tolerance of 8): draining, after the last step's decode, however many times
    "deep-ring-drained-with-syncs": _variant(
        "deep-ring-drained-with-syncs", ("def fixed_loop(m, steps, depth=4):", "def fixed_loop(m, steps, depth=12):"),
        (DRAIN, "    for k in range(max(0, steps - depth + 1), steps):\n        s.synchronize()\n" + DRAIN)),
    # waits on the newest step's event at set-up (before step 0's decode) and while draining are allowed
    "waits-at-set-up-and-draining": _variant(
        "waits-at-set-up-and-draining",
        (FIRST_SCHEDULE, FIRST_SCHEDULE + "    e = s.Event()\n    e.record()\n    e.synchronize()\n"),
        (DRAIN, "    done[(steps - 1) % depth].synchronize()\n" + DRAIN)),
}


@pytest.mark.parametrize("case", list(RIGHT))
def test_accepts_near_boundary_fixes(case, capsys):
    assert checks07.check_fixed_loop.verdict(RIGHT[case], steps=FEW) is True, capsys.readouterr().out


def test_a_pinned_copy_of_a_pageable_offload_every_step_is_honest_but_accepted(capsys):
    # .pin_memory() of the pageable offload makes a new pinned tensor each step: the copy reads
    # pinned memory (no fake non_blocking) and no step races. Slow (a 4 MiB memcpy per step), not wrong.
    wrong, _ = WRONG["pin-every-step"]
    assert checks07.check_fixed_loop.verdict(wrong, steps=FEW) is True


def snapshot_fix(m, steps, depth=4):
    """Another correct fix: a pageable metadata buffer with a pin_memory() snapshot per step (lesson 04),
    a fresh pinned tensor per step for the tokens, read after its event."""
    from collections import deque

    s = m.stream
    m.lm_head_host = l07.torch.empty_like(m.lm_head, device="cpu", pin_memory=True).copy_(m.lm_head)
    meta = l07.torch.zeros(m.meta_ints, dtype=l07.torch.int32)  # pageable, reused
    pending = deque()

    def deliver():
        k, out, ev = pending.popleft()
        ev.synchronize()
        if m.eos in m.emit(k, out):
            m.note_stop(k)

    m.schedule(0, meta)
    for n in range(steps):
        m.lm_head.copy_(m.lm_head_host, non_blocking=True)
        m.encode(n)
        m.meta_dev[n].copy_(meta.pin_memory(), non_blocking=True)
        out = l07.torch.empty(m.max_batch, dtype=l07.torch.int64, pin_memory=True)
        out.copy_(m.decode(n), non_blocking=True)
        ev = s.Event()
        ev.record()
        pending.append((n, out, ev))
        if len(pending) >= depth:
            deliver()
        if n + 1 < steps:
            m.schedule(n + 1, meta)
        m.host_work()
    while pending:
        deliver()
    s.synchronize()


def test_accepts_another_correct_fix(capsys):
    assert checks07.check_fixed_loop.verdict(snapshot_fix, steps=120) is True
    assert "✅ fixed_loop is correct" in capsys.readouterr().out


def test_rejects_the_planted_loop_and_hints_from_the_second_failure(capsys):
    assert checks07.check_fixed_loop.verdict(l07.planted_loop, steps=FEW) is False
    first = capsys.readouterr().out
    assert "pin_memory() of a pinned tensor returns the same storage" in first and "💡 Hint" not in first
    assert checks07.check_fixed_loop.verdict(l07.planted_loop, steps=FEW) is False
    second = capsys.readouterr().out
    assert "💡 Hint:" in second and "pin_memory=True" in second and "done[i].synchronize()" in second


def test_reports_a_crash_in_the_loop(capsys):
    def broken(m, steps):
        m.decode(steps + 5)

    assert checks07.check_fixed_loop.verdict(broken, steps=FEW) is False
    assert "❌ broken(m, 40) raised IndexError" in capsys.readouterr().out


def test_checker_names_bad_arguments():
    with pytest.raises(TypeError, match=r"fixed_loop must be a function \(m, steps\) .*, got str"):
        checks07.check_fixed_loop.verdict("fixed_loop")
    with pytest.raises(ValueError, match="steps"):
        checks07.check_fixed_loop.verdict(l07.fixed_loop, steps=0)


def test_the_exercise_is_generated_from_the_solution():
    cells = make_exercises.exercise_cells(nbtools.ROOT / "solutions" / "src" / f"{STEM}.py")
    code = "\n".join(c["source"] for c in cells if c["cell_type"] == "code")
    assert "def planted_loop(m, steps):" in code  # the learner starts from the planted loop
    assert "def fixed_loop(m, steps, depth=4):\n    # YOUR CODE HERE\n    raise NotImplementedError" in code
    assert "done[i].record()" not in code
