"""Lesson 04's torch-code exercise checkers (pin_snapshot, ring_stage) accept the master solution and
reject planted wrong answers, each with the message that names what is wrong in the lesson's terms.

The CPU tests run on the emulated lagging stream, passed explicitly, so that they are exact on any
machine; the tests marked ``gpu`` run the same checkers on the CUDA stream behind a busy GPU.
(min_ring_depth's tests live in tests/test_checks_l03_l04.py.)"""
import re

import pytest
import torch

from nbtools import solution_namespace
from pinlab import LaggingStream
from pinlab.checks import l04 as checks04

STEM = "04_the_fix"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def sol():
    return solution_namespace(STEM)


@pytest.fixture(autouse=True)
def _fresh():
    checks04.reset()


def _stub(*args):
    raise NotImplementedError


# ---- pin_snapshot -------------------------------------------------------------------------------

def test_pin_snapshot_accepts_solution(sol, capsys):
    assert checks04.check_pin_snapshot.verdict(sol["pin_snapshot"], stream=LaggingStream()) is True
    out = capsys.readouterr().out
    assert "✅ pin_snapshot is correct" in out, out
    assert ("200 steps rewriting one pinned buffer, run-ahead 64: no call returned memory whose copy was "
            "still queued, 0 corrupted") in out, out


def test_pin_snapshot_accepts_the_library_reference(capsys):
    from pinlab import pin_snapshot

    assert checks04.check_pin_snapshot.verdict(pin_snapshot, stream=LaggingStream()) is True


def test_pin_snapshot_accepts_a_contiguous_copy(capsys):
    # the reference's layout (contiguous) is as good as keeping t's strides
    def contiguous(t):
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)

    assert checks04.check_pin_snapshot.verdict(contiguous, stream=LaggingStream()) is True


def test_pin_snapshot_says_not_implemented(capsys):
    assert checks04.check_pin_snapshot.verdict(_stub, stream=LaggingStream()) is False
    assert "⏳ pin_snapshot is not implemented yet" in capsys.readouterr().out


def _reused_snapshot():
    """One pinned snapshot buffer per shape and dtype, refilled at every call: pinned, its own storage,
    the right values, and still the race, one step later."""
    cache = {}

    def reused(t):
        key = (tuple(t.shape), t.dtype)
        if key not in cache:
            cache[key] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return cache[key].copy_(t)

    return reused


SAME = "this returns the same storage: pin_memory() of a pinned tensor is a no-op"
WRONG_SNAPSHOTS = {
    "pin-memory": (lambda t: t.pin_memory(), SAME),
    "pin-only-when-pageable": (lambda t: t if t.is_pinned() else t.pin_memory(), SAME),
    "contiguous-then-pin": (lambda t: t.contiguous().pin_memory(), SAME),
    "clone": (lambda t: t.clone(), "this returns pageable memory, not pinned"),
    "t-itself": (lambda t: t, "this returns t's own storage, not a snapshot"),
    "empty-like-without-copy": (lambda t: torch.empty_like(t, pin_memory=True), "the values differ from t's"),
    "float32-buffer": (lambda t: torch.empty(t.shape, pin_memory=True).copy_(t), "same shape, same dtype"),
    "to-the-gpu": (lambda t: t.cuda(), "returned a tensor on the GPU"),
    "returns-a-list": (lambda t: [t.pin_memory()], "not a tensor"),
}


@pytest.mark.parametrize("case", list(WRONG_SNAPSHOTS))
def test_pin_snapshot_rejects_wrong(case, capsys):
    wrong, message = WRONG_SNAPSHOTS[case]
    assert checks04.check_pin_snapshot.verdict(wrong, stream=LaggingStream()) is False
    out = capsys.readouterr().out
    assert "❌ pin_snapshot(<" in out and message in out, out
    assert "💡 Hint" not in out  # the hint comes from the second failure on


def test_pin_snapshot_names_the_pinned_input_it_failed_on(capsys):
    assert checks04.check_pin_snapshot.verdict(WRONG_SNAPSHOTS["pin-memory"][0], stream=LaggingStream()) is False
    assert "❌ pin_snapshot(<pinned (64,) float32>): this returns the same storage" in capsys.readouterr().out


RECYCLED = ("❌ pin_snapshot(buf) at step {} of the step loop returned the pinned memory it returned at step 0, whose "
            "copy to the GPU had not run yet")


def test_pin_snapshot_reused_buffer_is_caught_in_the_step_loop(capsys):
    assert checks04.check_pin_snapshot.verdict(_reused_snapshot(), stream=LaggingStream()) is False
    out = capsys.readouterr().out
    # the next call hands back the one snapshot buffer while step 0's copy still waits in the queue
    assert RECYCLED.format(1) in out, out


def _pool_snapshot(depth):
    """A pool of ``depth`` pinned buffers per shape, dtype and layout, handed out in turn: pinned, its own
    storage, the right values; safe only while fewer than ``depth`` copies are in flight."""
    pools, turn = {}, {}

    def pooled(t):
        key = (tuple(t.shape), t.stride(), t.dtype)
        if key not in pools:
            pools[key] = [torch.empty_like(t, pin_memory=True) for _ in range(depth)]
            turn[key] = 0
        buf = pools[key][turn[key] % depth]
        turn[key] += 1
        return buf.copy_(t)

    return pooled


@pytest.mark.parametrize("depth", [5, 16])
def test_pin_snapshot_recycling_a_pool_is_caught(depth, capsys):
    """Issue 28: a pool of 5 passed (the loop kept only 4 steps in flight). The loop keeps more steps in flight
    than such a pool is deep, and a snapshot recycled while its copy is queued is named where it happens."""
    assert checks04.check_pin_snapshot.verdict(_pool_snapshot(depth), stream=LaggingStream()) is False
    out = capsys.readouterr().out
    assert RECYCLED.format(depth) in out and "A pool of buffers is safe only while it is deeper than the steps" in out, out
    assert "✅" not in out


def test_pin_snapshot_hints_on_the_second_failure(capsys):
    wrong = WRONG_SNAPSHOTS["pin-memory"][0]
    assert checks04.check_pin_snapshot.verdict(wrong, stream=LaggingStream()) is False
    assert checks04.check_pin_snapshot.verdict(wrong, stream=LaggingStream()) is False
    out = capsys.readouterr().out
    assert out.count("❌") == 2 and out.count("💡 Hint") == 1
    assert "empty_like(t, pin_memory=True).copy_(t)" in out.split("💡 Hint")[1]


def test_pin_snapshot_passing_forgets_the_failures(sol, capsys):
    wrong = WRONG_SNAPSHOTS["clone"][0]
    assert checks04.check_pin_snapshot.verdict(wrong, stream=LaggingStream()) is False
    assert checks04.check_pin_snapshot.verdict(sol["pin_snapshot"], stream=LaggingStream()) is True
    assert checks04.check_pin_snapshot.verdict(wrong, stream=LaggingStream()) is False
    assert "💡 Hint" not in capsys.readouterr().out


def test_pin_snapshot_reports_an_exception(capsys):
    def broken(t):
        raise ValueError("boom")

    assert checks04.check_pin_snapshot.verdict(broken, stream=LaggingStream()) is False
    assert "raised ValueError: boom" in capsys.readouterr().out


# ---- ring_stage ---------------------------------------------------------------------------------

def _ring(wait=True, record_first=False, blocking=False, sync_all=None, one_buffer=False, wait_latest=False,
          stream_wait=False, record=True, write_ring=True, copy_view=False, wait_next=False, poll=False,
          copy_first=False):
    """A ring_stage with one planted mistake (the defaults give the right one)."""
    def stage(n, data, ring, events, dst):
        k = 0 if one_buffer else n % len(ring)
        if sync_all is not None:
            sync_all.synchronize()                        # the whole stream
        if wait or wait_latest:
            # wait_latest: the previous step's copy (MRV1's event wait); wait_next: the next slot's event
            ev = events[(n - 1) % len(ring) if wait_latest else (k + 1) % len(ring) if wait_next else k]
            if stream_wait:
                ev.wait()
            elif poll:
                while not ev.query():                     # a polling loop: a host wait like synchronize()
                    pass
            else:
                ev.synchronize()
        if record and record_first:
            events[k].record()
        if write_ring and copy_first:       # the copy enqueued before the buffer holds step n
            dst.copy_(ring[k], non_blocking=True)
            ring[k].copy_(data)
        elif write_ring:
            ring[k].copy_(data)
            dst.copy_(ring[k].view(-1) if copy_view else ring[k], non_blocking=not blocking)
        else:
            dst.copy_(data, non_blocking=True)
        if record and not record_first:
            events[k].record()
    return stage


def test_ring_stage_accepts_solution(sol, capsys):
    assert checks04.check_ring_stage.verdict(sol["ring_stage"], stream=LaggingStream()) is True
    out = capsys.readouterr().out
    assert ("✅ ring_stage is correct: 200 steps with each ring, run-ahead 4, every buffer written at least 2 times, "
            "0 corrupted") in out, out
    flat = " ".join(out.split())  # wrapped lines read as one
    assert ("[measured] the deep ring: with a ring of 5 the host never waited for the GPU, 0 waits with every one "
            "counted on the emulated stream") in flat, out
    assert "the ring deeper than the run-ahead never made the host wait, and the shallower one made it wait " \
           "instead of racing." in flat, out
    assert "[measured] ring of 5: steps in which the host waited for the GPU: 0 of 200" in out
    assert "[measured] ring of 2: most steps the GPU was behind after a staging: 2" in out


def test_ring_stage_accepts_the_planted_default(capsys):
    assert checks04.check_ring_stage.verdict(_ring(), stream=LaggingStream()) is True
    assert checks04.check_ring_stage.verdict(_ring(poll=True), stream=LaggingStream()) is True  # polling its own event


WAITS_EVERY_STEP = "ring_stage blocks the host: the host waited for the GPU in {} of 200 steps"
WRONG_EVENT = "at step 0, the host waited on events[1] but rewrote ring[0]: wait on events[0]"


@pytest.mark.parametrize("kwargs, words", [
    # issue 28, still open from the last round: the wrong slot's event (was "✅ ... no waiting")
    (dict(wait_next=True), [WRONG_EVENT, "whose last copy is more recent"]),
    # the same wrong slots, polled: rings that wait every step (was "✅ ... no waiting: the host kept its run-ahead")
    (dict(wait_next=True, poll=True), ["at step 4, the host waited on events[0] but rewrote ring[4]"]),
    (dict(wait_latest=True, poll=True), ["at step 1, the host waited on events[0] but rewrote ring[1]"]),
    (dict(sync_all=torch.cuda), [WAITS_EVERY_STEP.format(200)]),   # torch.cuda.synchronize() on the emulation
    (dict(blocking=True), [WAITS_EVERY_STEP.format(200), "200 waits counted on the emulated stream"]),
], ids=["waits-on-the-next-slots-event", "polls-the-next-slots-event", "polls-the-latest-event",
        "torch-cuda-synchronize", "blocking-copy"])
def test_ring_stage_rejects_a_ring_that_waits_every_step(kwargs, words, capsys):
    assert checks04.check_ring_stage.verdict(_ring(**kwargs), stream=LaggingStream()) is False
    out = capsys.readouterr().out
    assert "❌ ring_stage" in out and all(w in out for w in words), out
    assert "✅" not in out and "no waiting" not in out


def test_ring_stage_rejects_a_copy_enqueued_before_the_write(capsys):
    """The ordering contract (write, then copy), as in exercise 03: the emulated GPU reads ring[k] after the
    late write and delivers the right data; a GPU may run the copy first."""
    assert checks04.check_ring_stage.verdict(_ring(copy_first=True), stream=LaggingStream()) is False
    out = capsys.readouterr().out
    assert ("at step 0, the copy out of ring[0] was enqueued before data was written into ring[0]" in out
            and "Write data into ring[0] first, then copy it into dst." in out), out


def test_rings_are_checked_over_more_steps_than_their_depth():
    assert checks04.STEPS >= checks04.MIN_ROUNDS * (checks04.AHEAD + 1) >= 2 * checks04.SHALLOW


def test_ring_stage_says_not_implemented(capsys):
    assert checks04.check_ring_stage.verdict(_stub, stream=LaggingStream()) is False
    assert "⏳ ring_stage is not implemented yet" in capsys.readouterr().out


RACE = "ring_stage: step 0 of 200 delivered step {}'s data"
SHALLOW = ("with a ring of 2 buffers, run-ahead 4 (the host may write step n+4's data while the GPU has not yet run "
           "step n's copy): a buffer was rewritten before")
NO_WAIT = "the host did not wait for it: before writing ring[k], wait on the host (`events[k].synchronize()`)"
EARLY = "the host did wait before rewriting, but for an event that completed before the copy"
WRONG_RINGS = {
    # the deep ring never races; the shallow one does, and the message names the step
    "no-event-wait": (dict(wait=False), [RACE.format(4), SHALLOW, NO_WAIT]),
    # recorded before the copy: caught where it happens, on the emulation and on a GPU alike
    "event-recorded-before-the-copy": (dict(record_first=True), [
        "ring_stage: at step 0, events[0] was recorded before the copy out of ring[0] (a ring of 5 buffers",
        "Record the event after the copy."]),
    # the same through a view of the buffer (not seen as a copy out of ring[k]): the race shows it
    "event-recorded-before-a-copy-from-a-view": (dict(record_first=True, copy_view=True),
                                                 [RACE.format(2), SHALLOW, EARLY]),
    "event-never-recorded": (dict(record=False), [RACE.format(4), SHALLOW, NO_WAIT]),
    "stream-wait-instead-of-host-wait": (dict(stream_wait=True), [RACE.format(4), SHALLOW, NO_WAIT]),
    # correct, but the host waits for the GPU at (nearly) every step
    "one-buffer-with-events": (dict(one_buffer=True), [
        "ring_stage: with a ring of 5 buffers, run-ahead 4 (the host may write step n+4's data while the GPU has "
        "not yet run step n's copy), ring[1] was written in 0 of 200 steps (1 of the 5 buffers used): write step n "
        "into ring[n % len(ring)]"]),
    "waits-for-the-previous-copy": (dict(wait_latest=True), [
        "at step 0, the host waited on events[4] but rewrote ring[0]: wait on events[0]"]),
    "blocking-copy": (dict(blocking=True), ["the host waited for the GPU in 200 of 200 steps",
                                            "200 waits counted on the emulated stream"]),
    # the copy does not come from the ring
    "bypasses-the-ring": (dict(write_ring=False), ["after step 0, no ring buffer holds step 0's data"]),
}


def _ring_slots(copy_slot=None, record_slot=None, copy_data=False):
    """A ring_stage that writes ring[n % len(ring)] and waits on its event, but copies from
    ring[copy_slot(n, depth)] (or from data too) or records events[record_slot(n, depth)]."""
    def stage(n, data, ring, events, dst):
        d = len(ring)
        k = n % d
        events[k].synchronize()
        ring[k].copy_(data)
        dst.copy_(ring[copy_slot(n, d) if copy_slot else k], non_blocking=True)
        if copy_data:
            dst.copy_(data, non_blocking=True)
        events[record_slot(n, d) if record_slot else k].record()
    return stage


#: issue "self-paced path", part 3: (answer, words, the cause it was given before, wrongly)
WRONG_SLOTS = {
    "copies-the-previous-slot": (_ring_slots(copy_slot=lambda n, d: (n - 1) % d),
                                 "at step 0, step 0's data was written into ring[0] but the copy read ring[4]",
                                 "the host did not wait for it"),
    "records-the-next-slots-event": (_ring_slots(record_slot=lambda n, d: (n + 1) % d),
                                     "at step 0, the copy read ring[0] but the event recorded after it was events[1]",
                                     "ring_stage blocks the host"),
    "copies-data-itself": (_ring_slots(copy_data=True), "at step 0, dst was copied from data itself", "✅"),
}


@pytest.mark.parametrize("case", list(WRONG_SLOTS))
def test_ring_stage_names_the_wrong_slot(case, capsys):
    wrong, words, old_cause = WRONG_SLOTS[case]
    assert checks04.check_ring_stage.verdict(wrong, stream=LaggingStream()) is False
    out = capsys.readouterr().out
    assert "❌ ring_stage" in out and words in out and old_cause not in out, out


@pytest.mark.parametrize("case", list(WRONG_RINGS))
def test_ring_stage_rejects_wrong(case, capsys):
    kwargs, messages = WRONG_RINGS[case]
    assert checks04.check_ring_stage.verdict(_ring(**kwargs), stream=LaggingStream()) is False
    out = capsys.readouterr().out
    assert "❌ ring_stage" in out and all(m in out for m in messages), out
    assert "💡 Hint" not in out


def test_ring_stage_that_synchronizes_the_whole_stream_blocks_the_host(capsys):
    s = LaggingStream()
    assert checks04.check_ring_stage.verdict(_ring(sync_all=s), stream=s) is False
    out = capsys.readouterr().out
    assert "❌ ring_stage blocks the host: the host waited for the GPU in 200 of 200 steps" in out, out
    assert "[measured] ring of 5: steps in which the host waited for the GPU: 200 of 200" in out


def test_ring_stage_hints_on_the_second_failure(capsys):
    wrong = _ring(wait=False)
    assert checks04.check_ring_stage.verdict(wrong, stream=LaggingStream()) is False
    assert checks04.check_ring_stage.verdict(wrong, stream=LaggingStream()) is False
    out = capsys.readouterr().out
    assert out.count("❌") == 2 and out.count("💡 Hint") == 1
    assert "events[k].synchronize()" in out.split("💡 Hint")[1]


def test_ring_stage_reports_an_exception(capsys):
    def broken(n, data, ring, events, dst):
        raise ValueError("boom")

    assert checks04.check_ring_stage.verdict(broken, stream=LaggingStream()) is False
    assert "raised ValueError: boom" in capsys.readouterr().out


def test_ring_stage_verdicts_rest_on_exact_run_ahead(capsys):
    """The emulation is exact: a blocking copy waits for every step in flight, at every step, each counted
    (LaggingStream.host_waits)."""
    assert checks04.check_ring_stage.verdict(_ring(blocking=True), stream=LaggingStream()) is False
    out = capsys.readouterr().out
    assert "[measured] ring of 5: steps in which the host waited for the GPU: 200 of 200" in out, out
    assert "200 waits counted on the emulated stream" in out


def test_checkers_reject_a_non_callable():
    with pytest.raises(TypeError, match=r"pin_snapshot must be a function \(t\) -> tensor .*, got NoneType"):
        checks04.check_pin_snapshot.verdict(None)
    with pytest.raises(TypeError, match=r"ring_stage must be a function \(n, data, ring, events, dst\)"):
        checks04.check_ring_stage.verdict("ring_stage")


# ---- on a real GPU: tests/cuda_checks03_04_child.py (run by test_checks_l03_l04.py) ----------------------------


def test_waited_steps_tells_a_wait_from_a_slow_host():
    """The ring_stage checker's count of waiting steps (AHEAD = 4 here)."""
    ahead = checks04.AHEAD
    # a stage that synced: 4 steps queued before the call, none after, every step
    assert checks04.waited_steps([ahead] * 10, [0] * 10) == 10
    # a wait for the previous step's copy, in steady state: 2 queued before, 1 after
    assert checks04.waited_steps([2] * 10, [1] * 10) == 10
    # a host slower than the GPU between calls: the GPU caught up before the call, nothing finished in it
    assert checks04.waited_steps([0] * 10, [0] * 10) == 0
    assert checks04.waited_steps([1] * 10, [1] * 10) == 0
    # a correct ring on a fast host: the run-ahead kept, one mark finishing during a call now and then
    assert checks04.waited_steps([ahead, ahead, ahead], [ahead, ahead - 1, ahead]) == 0
    # the boundary: ahead - 2 queued after the call counts only when something finished during it
    assert checks04.waited_steps([ahead - 1], [ahead - 2]) == 1
    assert checks04.waited_steps([ahead - 2], [ahead - 2]) == 0
    with pytest.raises(ValueError, match="one count per step"):
        checks04.waited_steps([1, 2], [1])


HELD = ("❌ pin_snapshot(buf) at step 128 of the step loop returned the pinned memory it returned at step 0, which it "
        "still holds (a pool of 128 buffers, or a cache)")


def test_pin_snapshot_recycling_a_pool_of_128_is_caught(capsys):
    """Issue 48: the recycling check looked back only SNAPSHOT_AHEAD (64) steps, so a deeper pool passed. Every
    snapshot handed out is followed while its memory lives: the pool comes round at step 128, its copy long
    waited for (no race by order in this loop), and is named as memory returned again while still held. (The
    xfail called check_pin_snapshot itself, which returns None: it could never pass; .verdict is the bool.)"""
    assert checks04.check_pin_snapshot.verdict(_pool_snapshot(128), stream=LaggingStream()) is False
    out = capsys.readouterr().out
    assert HELD in out and "allocate new pinned memory at every call" in out, out
    assert "whose copy to the GPU had not run yet" not in out and "✅" not in out, out


# ---- issue 48: the same verdict on a GPU that keeps up as on a laptop ---------------------------
#
# pinlab.order.lagging_stream(0) is an emulated GPU that runs every copy before the host's next call: no data
# is ever corrupted there, as behind a fast GPU. The checkers judge races by order (pinlab.order.detect_races)
# and follow every snapshot handed out, so each wrong answer is rejected there with the laptop's verdict.

def _keeping_up():
    from pinlab.order import lagging_stream

    return lagging_stream(0)


def _keeps_its_last_128():
    """Right: new pinned memory at every call; it keeps references to its last 128 snapshots (never hands one
    out again, never writes one again)."""
    from collections import deque

    kept = deque(maxlen=128)

    def keeping(t):
        out = torch.empty_like(t, pin_memory=True).copy_(t)
        kept.append(out)
        return out

    return keeping


def _scrubs_its_last_snapshot():
    """Wrong: new pinned memory at every call, but it clears the snapshot it returned before (to 'free' it)
    while the caller's copy of it may still be queued."""
    last = []

    def scrubbing(t):
        if last:
            last[0].zero_()
        out = torch.empty_like(t, pin_memory=True).copy_(t)
        last[:] = [out]
        return out

    return scrubbing


@pytest.mark.parametrize("make_stream", [LaggingStream, _keeping_up], ids=["lagging", "keeping-up"])
def test_pin_snapshot_right_answers_stay_accepted(make_stream, sol, capsys):
    from pinlab import pin_snapshot

    for right in (sol["pin_snapshot"], pin_snapshot, _keeps_its_last_128()):
        assert checks04.check_pin_snapshot.verdict(right, stream=make_stream()) is True, capsys.readouterr().out


@pytest.mark.parametrize("make_stream", [LaggingStream, _keeping_up], ids=["lagging", "keeping-up"])
@pytest.mark.parametrize("wrong, message", [
    (_reused_snapshot, RECYCLED.format(1)),
    (lambda: _pool_snapshot(5), RECYCLED.format(5)),
    (lambda: _pool_snapshot(16), RECYCLED.format(16)),
    (lambda: _pool_snapshot(128), HELD),
], ids=["cache", "pool-of-5", "pool-of-16", "pool-of-128"])
def test_pin_snapshot_recycling_gets_one_verdict_whatever_the_gpus_speed(make_stream, wrong, message, capsys):
    """A pool shallower than the loop's 64 steps in flight races by order (on a GPU that keeps up too, where its
    copies have run: the timing check let it pass there); a deeper one is memory handed out again while held."""
    assert checks04.check_pin_snapshot.verdict(wrong(), stream=make_stream()) is False
    out = capsys.readouterr().out
    assert message in out and "✅" not in out, out


def test_pin_snapshot_race_by_order_names_the_line(capsys):
    """Behind a GPU that keeps up no step is corrupted; the order verdict names the write of pin_snapshot's."""
    assert checks04.check_pin_snapshot.verdict(_scrubs_its_last_snapshot(), stream=_keeping_up()) is False
    flat = " ".join(capsys.readouterr().out.split())
    assert ("❌ pin_snapshot in the step loop: a snapshot it returned earlier can race: host rewrote the source of a "
            "pending H2D copy at line 3 of scrubbing (`last[0].zero_()`), while the step loop's copy from it could "
            "still be queued (199 of 200 copies can race by the loop's order, 0 raced in this run") in flat, flat
    assert "pin_snapshot must not touch it again" in flat, flat
    # behind the lagging GPU the same answer corrupts the data, and that is what is said
    assert checks04.check_pin_snapshot.verdict(_scrubs_its_last_snapshot(), stream=LaggingStream()) is False
    assert "pin_snapshot in the step loop: step 0 of 200 delivered no data" in capsys.readouterr().out


def test_ring_stage_right_answers_stay_accepted_on_a_gpu_that_keeps_up(sol, capsys):
    for right in (sol["ring_stage"], _ring(), _ring(poll=True)):
        assert checks04.check_ring_stage.verdict(right, stream=_keeping_up()) is True, capsys.readouterr().out


RING_RACE = ("ring_stage: with a ring of 2 buffers, run-ahead 4 (the host may write step n+4's data while the GPU "
             "has not yet run step n's copy), the copy at line 22 of stage (`dst.copy_(ring[k].view(-1) if copy_view "
             "else ring[k], non_blocking=not blocking)`) can race with the host's write into its ring buffer at line "
             "21 of stage (`ring[k].copy_(data)`), which nothing the host waited on orders after that copy (198 of "
             "200 copies can race by the loop's order, 0 raced in this run")


@pytest.mark.parametrize("case", ["no-event-wait", "event-recorded-before-a-copy-from-a-view", "event-never-recorded",
                                  "stream-wait-instead-of-host-wait"])
def test_ring_stage_races_are_caught_on_a_gpu_that_keeps_up(case, capsys):
    """These rings corrupt data behind the lagging GPU (test_ring_stage_rejects_wrong); behind one that keeps up
    nothing is corrupted and the shallow ring never falls behind: they passed. The order verdict names them."""
    kwargs, _ = WRONG_RINGS[case]
    assert checks04.check_ring_stage.verdict(_ring(**kwargs), stream=_keeping_up()) is False
    flat = " ".join(capsys.readouterr().out.split())
    assert f"❌ {RING_RACE}" in flat and "wait on the host (`events[k].synchronize()`)" in flat, flat
