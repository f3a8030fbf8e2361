"""The checkers of lessons 03 and 04 accept the master solutions and reject planted wrong answers."""
from pathlib import Path

import numpy as np
import pytest

import nbtools
from nbtools import solution_namespace
from pinlab.checks import l03 as checks03
from pinlab.checks import l04 as checks04

ROOT = nbtools.ROOT



@pytest.fixture(scope="module")
def sol03():
    return solution_namespace("03_the_race")


@pytest.fixture(scope="module")
def sol04():
    return solution_namespace("04_the_fix")


def _stub(*args):
    raise NotImplementedError


# ---- indptr / last_page_len

def test_indptr_accepts_solution(sol03, capsys):
    assert checks03.check_indptr_last_page_len.verdict(sol03["indptr_last_page_len"]) is True
    assert "✅ indptr_last_page_len is correct" in capsys.readouterr().out


def _pages(n, ps):
    return -(-n // ps)


def _cum(xs):
    out = [0]
    for x in xs:
        out.append(out[-1] + x)
    return out


@pytest.mark.parametrize("wrong", [
    lambda s, ps: (_cum([_pages(n, ps) for n in s]), [n % ps for n in s]),                    # full page -> 0
    lambda s, ps: (_cum([_pages(n, ps) for n in s]), [ps if n % ps == 0 else n % ps for n in s]),  # empty -> ps
    lambda s, ps: (_cum([n // ps for n in s]),                                                  # floor, not ceil
                   [ps if (n % ps == 0 and n) else n % ps for n in s]),
    lambda s, ps: (_cum([_pages(n, ps) for n in s])[1:],                                        # no leading 0
                   [ps if (n % ps == 0 and n) else n % ps for n in s]),
    lambda s, ps: (_cum(s), [ps if (n % ps == 0 and n) else n % ps for n in s]),                # tokens, not pages
    lambda s, ps: ([ps if (n % ps == 0 and n) else n % ps for n in s], _cum([_pages(n, ps) for n in s])),  # swapped
    lambda s, ps: (_cum([n // ps + 1 if n else 0 for n in s]),                                  # floor + 1: wrong on full pages
                   [ps if (n % ps == 0 and n) else n % ps for n in s]),
])
def test_indptr_rejects_wrong(wrong, capsys):
    assert checks03.check_indptr_last_page_len.verdict(wrong) is False
    assert "❌ indptr_last_page_len" in capsys.readouterr().out


def test_indptr_accepts_numpy_and_tensor_answers():
    from pinlab.paged_kv import kv_indptr, last_page_len

    assert checks03.check_indptr_last_page_len.verdict(lambda s, ps: (kv_indptr(list(s), ps), last_page_len(list(s), ps))) is True
    assert checks03.check_indptr_last_page_len.verdict(
        lambda s, ps: (kv_indptr(list(s), ps).numpy(), last_page_len(list(s), ps).numpy())) is True


def test_indptr_rejects_bad_shapes():
    assert checks03.check_indptr_last_page_len.verdict(lambda s, ps: [0]) is False
    assert checks03.check_indptr_last_page_len.verdict(lambda s, ps: None) is False


# ---- copies_correct

def test_copies_correct_accepts_solution(sol03):
    assert checks03.check_copies_correct.verdict(sol03["copies_correct"]) is True


def _cc(cond):
    return lambda w, c: [all(cond(w, c, n, m) for m in range(n + 1, len(w))) for n in range(len(c))]


@pytest.mark.parametrize("wrong", [
    _cc(lambda w, c, n, m: w[m][0] >= c[n][0]),            # compared with the copy's start: misses overlaps
    _cc(lambda w, c, n, m: w[m][0] > c[n][1]),             # strict: a write at exactly the copy's end is safe
    _cc(lambda w, c, n, m: w[m][1] >= c[n][1]),            # the write's end, not its start
    lambda w, c: [n == len(c) - 1 for n in range(len(c))],  # "only the last step is right"
    lambda w, c: [w[n][1] <= c[n][0] for n in range(len(c))],  # its own write, not the later ones
    lambda w, c: [True] * len(c),
    lambda w, c: [n < len(c) - 1 for n in range(len(c))][::-1],  # reversed
])
def test_copies_correct_rejects_wrong(wrong, capsys):
    assert checks03.check_copies_correct.verdict(wrong) is False
    assert "❌ copies_correct" in capsys.readouterr().out


# ---- min_ring_depth

def test_min_ring_depth_accepts_solution(sol04):
    assert checks04.check_min_ring_depth.verdict(sol04["min_ring_depth"]) is True


def test_min_ring_depth_accepts_numpy_integers(sol04, capsys):
    assert checks04.check_min_ring_depth.verdict(lambda w, c: np.int64(sol04["min_ring_depth"](w, c))) is True
    assert checks04.check_min_ring_depth.verdict(lambda w, c: np.int32(sol04["min_ring_depth"](w, c))) is True
    assert "✅ min_ring_depth" in capsys.readouterr().out


def _depth(cond, start=1):
    def f(w, c):
        d = start
        while d < len(w) and any(not cond(w, c, n, d) for n in range(len(w) - d)):
            d += 1
        return d
    return f


@pytest.mark.parametrize("wrong", [
    _depth(lambda w, c, n, d: w[n + d][0] >= c[n][1], start=2),     # never answers 1
    _depth(lambda w, c, n, d: w[n + d][0] >= c[n][0]),             # the copy's start
    lambda w, c: _depth(lambda w, c, n, d: w[n + d][0] >= c[n][1])(w, c) + 1,   # one too many
    lambda w, c: max(1, _depth(lambda w, c, n, d: w[n + d][0] >= c[n][1])(w, c) - 1),  # one too few
    lambda w, c: _depth(lambda w, c, n, d: n != 0 or w[d][0] >= c[0][1])(w, c),   # only step 0 checked
    lambda w, c: float(_depth(lambda w, c, n, d: w[n + d][0] >= c[n][1])(w, c)),  # a float, not an int
    _depth(lambda w, c, n, d: w[n + d][0] > c[n][1]),              # strict: a write exactly at the copy's end is safe
    lambda w, c: (lambda d: True if d == 1 else d)(_depth(lambda w, c, n, d: w[n + d][0] >= c[n][1])(w, c)),  # True, not 1
    lambda w, c: np.float64(_depth(lambda w, c, n, d: w[n + d][0] >= c[n][1])(w, c)),  # a numpy float
])
def test_min_ring_depth_rejects_wrong(wrong, capsys):
    assert checks04.check_min_ring_depth.verdict(wrong) is False
    assert "❌ min_ring_depth" in capsys.readouterr().out


# ---- stubs

@pytest.mark.parametrize("check", [checks03.check_indptr_last_page_len.verdict, checks03.check_copies_correct.verdict,
                                   checks04.check_min_ring_depth.verdict])
def test_stub_is_reported_as_not_implemented(check, capsys):
    assert check(_stub) is False
    assert "⏳" in capsys.readouterr().out


def test_solution_sources_exist():
    for stem in ("03_the_race", "04_the_fix"):
        assert (Path(ROOT) / "solutions" / "src" / f"{stem}.py").exists()


# ---- race_free_loop (torch code) -----------------------------------------------------------------
# Planted wrong loops, each with the words the checker must say (lagging stream / CUDA).

import torch  # noqa: E402

from pinlab.checks import l02 as checks02  # noqa: E402

N = checks03.N_INTS


def loop_racy(s, steps, write_metadata, forward):  # the notebook's loop: one reused pinned buffer
    buf = torch.zeros(N, dtype=torch.int32, pin_memory=True)
    for n in range(steps):
        write_metadata(buf, n)
        meta = torch.empty(N, dtype=torch.int32, device=s.device)
        meta.copy_(buf, non_blocking=True)
        forward(n, meta)


def loop_snapshot_of_pinned(s, steps, write_metadata, forward):  # pin_memory() of a pinned buffer: a no-op
    buf = torch.zeros(N, dtype=torch.int32, pin_memory=True)
    for n in range(steps):
        write_metadata(buf, n)
        meta = torch.empty(N, dtype=torch.int32, device=s.device)
        meta.copy_(buf.pin_memory(), non_blocking=True)
        forward(n, meta)


def _ring(depth, events, record_before_copy=False, poll=False, record=True):
    """A ring of ``depth`` pinned buffers, each guarded by an event (``events``) waited on before it is rewritten;
    ``record_before_copy``: lesson 04's mistake, the event recorded before the slot's copy (it guards nothing);
    ``poll``: the wait is a loop polling ``query()``; ``record=False``: the events are made but never recorded."""
    def loop(s, steps, write_metadata, forward):
        bufs = [torch.zeros(N, dtype=torch.int32, pin_memory=True) for _ in range(depth)]
        done = [None] * depth
        for n in range(steps):
            k = n % depth
            if events and done[k] is not None:
                if poll:
                    while not done[k].query():
                        pass
                else:
                    done[k].synchronize()          # the copy that last read bufs[k] has run
            write_metadata(bufs[k], n)
            if events and record_before_copy:
                done[k] = s.Event()
                done[k].record()
            meta = torch.empty(N, dtype=torch.int32, device=s.device)
            meta.copy_(bufs[k], non_blocking=True)
            if events and not record_before_copy:
                done[k] = s.Event()
                if record:
                    done[k].record()
            forward(n, meta)
    return loop


def loop_sync_each_step(s, steps, write_metadata, forward):
    buf = torch.zeros(N, dtype=torch.int32, pin_memory=True)
    for n in range(steps):
        s.synchronize()
        write_metadata(buf, n)
        meta = torch.empty(N, dtype=torch.int32, device=s.device)
        meta.copy_(buf, non_blocking=True)
        forward(n, meta)


def loop_sync_every_other_step(s, steps, write_metadata, forward):
    buf = torch.zeros(N, dtype=torch.int32, pin_memory=True)
    for n in range(steps):
        if n % 2 == 0:
            s.synchronize()
        write_metadata(buf, n)
        meta = torch.empty(N, dtype=torch.int32, device=s.device)
        meta.copy_(buf, non_blocking=True)
        forward(n, meta)


def loop_pageable_clone(s, steps, write_metadata, forward):  # a snapshot, but in pageable memory
    buf = torch.zeros(N, dtype=torch.int32, pin_memory=True)
    for n in range(steps):
        write_metadata(buf, n)
        meta = torch.empty(N, dtype=torch.int32, device=s.device)
        meta.copy_(buf.clone(), non_blocking=True)
        forward(n, meta)


def loop_blocking_copy(s, steps, write_metadata, forward):
    buf = torch.zeros(N, dtype=torch.int32, pin_memory=True)
    for n in range(steps):
        write_metadata(buf, n)
        forward(n, buf.to(s.device))


def loop_writes_device_memory(s, steps, write_metadata, forward):  # no copy: "metadata" made on the GPU
    for n in range(steps):
        meta = torch.empty(N, dtype=torch.int32, device=s.device)
        write_metadata(meta, n)
        forward(n, meta)


def loop_skips_a_step(s, steps, write_metadata, forward):
    for n in range(steps):
        if n == 5:
            continue
        snap = torch.empty(N, dtype=torch.int32, pin_memory=True)
        write_metadata(snap, n)
        meta = torch.empty(N, dtype=torch.int32, device=s.device)
        meta.copy_(snap, non_blocking=True)
        forward(n, meta)


def loop_pinned_snapshot_copy(s, steps, write_metadata, forward):  # another right answer: a fresh pinned tensor
    buf = torch.zeros(N, dtype=torch.int32)
    for n in range(steps):
        write_metadata(buf, n)
        snap = torch.empty(N, dtype=torch.int32, pin_memory=True)
        snap.copy_(buf)
        meta = torch.empty(N, dtype=torch.int32, device=s.device)
        meta.copy_(snap, non_blocking=True)
        forward(n, meta)


def loop_snapshot_before_write(s, steps, write_metadata, forward):  # no race: the snapshot is a step old
    buf = torch.zeros(N, dtype=torch.int32)
    for n in range(steps):
        snap = buf.pin_memory()                # taken before this step's write: step n-1's data
        write_metadata(buf, n)
        meta = torch.empty(N, dtype=torch.int32, device=s.device)
        meta.copy_(snap, non_blocking=True)
        forward(n, meta)


def _ring_planted(copy_slot, wait_slot):
    """A ring of AHEAD + 1 pinned buffers with events, written at n % depth; the copy reads
    copy_slot(n, depth) and the host waits on events[wait_slot(n, depth)] (the right answer: both n % depth)."""
    def loop(s, steps, write_metadata, forward):
        depth = checks03.AHEAD + 1
        bufs = [torch.zeros(N, dtype=torch.int32, pin_memory=True) for _ in range(depth)]
        done = [None] * depth
        for n in range(steps):
            k = n % depth
            w = wait_slot(n, depth)
            if done[w] is not None:
                done[w].synchronize()
            write_metadata(bufs[k], n)
            meta = torch.empty(N, dtype=torch.int32, device=s.device)
            meta.copy_(bufs[copy_slot(n, depth)], non_blocking=True)
            done[k] = s.Event()
            done[k].record()
            forward(n, meta)
    return loop


def loop_polls_each_step(s, steps, write_metadata, forward):  # issue 28: serial, waiting by polling (was praised)
    buf = torch.zeros(N, dtype=torch.int32, pin_memory=True)
    copied = s.Event()
    for n in range(steps):
        write_metadata(buf, n)
        meta = torch.empty(N, dtype=torch.int32, device=s.device)
        meta.copy_(buf, non_blocking=True)
        copied.record()
        forward(n, meta)
        while not copied.query():      # the host spins until the copy has run: a wait
            pass


def loop_event_sync_each_step(s, steps, write_metadata, forward):  # the same serial loop with synchronize()
    buf = torch.zeros(N, dtype=torch.int32, pin_memory=True)
    copied = s.Event()
    for n in range(steps):
        write_metadata(buf, n)
        meta = torch.empty(N, dtype=torch.int32, device=s.device)
        meta.copy_(buf, non_blocking=True)
        copied.record()
        forward(n, meta)
        copied.synchronize()


def loop_snapshot_sync_every_tenth_step(s, steps, write_metadata, forward):  # issue 28: 20 syncs ("never waited")
    buf = torch.zeros(N, dtype=torch.int32)
    for n in range(steps):
        write_metadata(buf, n)
        meta = torch.empty(N, dtype=torch.int32, device=s.device)
        meta.copy_(buf.pin_memory(), non_blocking=True)
        forward(n, meta)
        if n % 10 == 5:
            s.synchronize()


def loop_ring_copies_before_writing(s, steps, write_metadata, forward):  # issue 28: the copy enqueued first
    depth = checks03.AHEAD + 1
    bufs = [torch.zeros(N, dtype=torch.int32, pin_memory=True) for _ in range(depth)]
    done = [None] * depth
    for n in range(steps):
        k = n % depth
        if done[k] is not None:
            done[k].synchronize()
        meta = torch.empty(N, dtype=torch.int32, device=s.device)
        meta.copy_(bufs[k], non_blocking=True)   # enqueued before the buffer holds step n
        write_metadata(bufs[k], n)
        done[k] = s.Event()
        done[k].record()
        forward(n, meta)


def loop_snapshot_filled_after_its_copy(s, steps, write_metadata, forward):  # the same mistake with a snapshot
    buf = torch.zeros(N, dtype=torch.int32)
    for n in range(steps):
        write_metadata(buf, n)
        snap = torch.empty(N, dtype=torch.int32, pin_memory=True)
        meta = torch.empty(N, dtype=torch.int32, device=s.device)
        meta.copy_(snap, non_blocking=True)
        snap.copy_(buf)                          # filled after the copy was enqueued
        forward(n, meta)


def loop_snapshot_sync_after_the_loop(s, steps, write_metadata, forward):  # right: a wait after the last step
    buf = torch.zeros(N, dtype=torch.int32)
    for n in range(steps):
        write_metadata(buf, n)
        meta = torch.empty(N, dtype=torch.int32, device=s.device)
        meta.copy_(buf.pin_memory(), non_blocking=True)
        forward(n, meta)
    s.synchronize()


RIGHT_LOOPS = {
    "pinned-snapshot-copy": loop_pinned_snapshot_copy,
    "ring-ahead+1-events": _ring(checks03.AHEAD + 1, True),
    "ring-ahead+2-events": _ring(checks03.AHEAD + 2, True),
    "ring-ahead+1-no-events": _ring(checks03.AHEAD + 1, False),  # safe: forward keeps the host AHEAD steps ahead
    "ring-ahead+1-polls-its-events": _ring(checks03.AHEAD + 1, True, poll=True),  # issue 48: a query() that said True
    "snapshot-sync-after-the-loop": loop_snapshot_sync_after_the_loop,
}

SERIAL = "waiting is race-free but blocks: with one reused buffer the loop is serial"

#: name -> (wrong loop, words on the lagging stream, words on CUDA (any of them))
WRONG_LOOPS = {
    "racy": (loop_racy, "step 0 of 200 delivered step 2's data", ("delivered step",)),
    "snapshot-of-pinned": (loop_snapshot_of_pinned, "`pin_memory()` of a pinned tensor returns the same storage",
                           ("same storage",)),
    "ring-one-too-shallow-events": (_ring(checks03.AHEAD, True), "ring is too shallow for run-ahead 2",
                                    ("ring is too shallow",)),
    "ring-one-too-shallow-no-events": (_ring(checks03.AHEAD, False), "read from 2 host buffers",
                                       ("delivered step",)),
    "sync-each-step": (loop_sync_each_step, SERIAL, (SERIAL,)),
    # issue 28: waits the checker did not see, tolerances meant for GPU noise, the order of write and copy
    "polls-each-step": (loop_polls_each_step, SERIAL, (SERIAL,)),
    "event-sync-each-step": (loop_event_sync_each_step, SERIAL, (SERIAL,)),
    "snapshot-sync-every-tenth-step": (loop_snapshot_sync_every_tenth_step,
                                       "the host waited for the GPU in 20 of 200 steps (`synchronize()` waits for "
                                       "everything queued) — synchronize() is race-free but blocks",
                                       ("in 20 of 200 steps", "synchronize() is race-free but blocks")),
    "ring-copies-before-writing": (loop_ring_copies_before_writing,
                                   "step 0's copy was enqueued before the host wrote step 0's data into the pinned "
                                   "memory it reads", ("was enqueued before the host wrote",)),
    "snapshot-filled-after-its-copy": (loop_snapshot_filled_after_its_copy,
                                       "step 0's copy was enqueued before the host wrote step 0's data",
                                       ("was enqueued before the host wrote",)),
    "sync-every-other-step": (loop_sync_every_other_step, "step 0 of 200 delivered step 1's data",
                              ("delivered step", "synchronize() is race-free but blocks")),
    "pageable-clone": (loop_pageable_clone, "copy reads pageable memory", ("copy reads pageable memory",)),
    "blocking-copy": (loop_blocking_copy, "copy is blocking", ("copy is blocking",)),
    "writes-device-memory": (loop_writes_device_memory, "buf is GPU memory", ("buf is GPU memory",)),
    "skips-a-step": (loop_skips_a_step, "forward(6, meta) was called for step 6, the next step is 5",
                     ("the next step is 5",)),
    # issue "self-paced path", part 3: diagnoses that named the wrong cause
    "snapshot-before-write": (loop_snapshot_before_write,
                              "your snapshot copies the buffer before this step's write: the GPU receives step "
                              "n-1's data", ("your snapshot copies the buffer before this step's write",)),
    "ring-copies-the-previous-slot": (_ring_planted(lambda n, d: (n - 1) % d, lambda n, d: n % d),
                                      "step 1's copy read the buffer write_metadata wrote step 0's metadata into",
                                      ("step 1's copy read the buffer write_metadata wrote step 0's",)),
    "ring-waits-on-the-wrong-slot": (_ring_planted(lambda n, d: n % d, lambda n, d: (n + 1) % d),
                                     "read from 3 pinned buffers, enough for run-ahead 2, but the event you "
                                     "wait on is not reached yet", ("the event you wait on is not reached yet",)),
}

#: the cause each planted answer was given before, wrongly
WRONG_CAUSES = {
    "snapshot-before-write": "rewrote",
    "ring-copies-the-previous-slot": "run-ahead, guarded by events",
    "ring-waits-on-the-wrong-slot": "too shallow",
}


@pytest.fixture
def on_cpu(monkeypatch):
    """Force the emulated path (the lagging stream) even on a machine with a GPU."""
    monkeypatch.setenv("PINLAB_FORCE_CPU", "1")
    checks02.reset()


def test_race_free_loop_accepts_solution(sol03, on_cpu, capsys):
    assert checks03.check_race_free_loop.verdict(sol03["race_free_loop"]) is True
    out = capsys.readouterr().out
    assert "✅ race_free_loop is correct (200 steps" in out and "emulated lagging stream" in out


@pytest.mark.parametrize("case", list(RIGHT_LOOPS))
def test_race_free_loop_accepts_other_right_answers(case, on_cpu, capsys):
    assert checks03.check_race_free_loop.verdict(RIGHT_LOOPS[case]) is True, capsys.readouterr().out


def test_notebook_racy_loop_is_rejected(sol03, on_cpu, capsys):
    assert checks03.check_race_free_loop.verdict(sol03["racy_loop"]) is False
    assert "delivered step 2's data" in capsys.readouterr().out


@pytest.mark.parametrize("case", list(WRONG_LOOPS))
def test_race_free_loop_rejects_wrong(case, on_cpu, capsys):
    wrong, words, _ = WRONG_LOOPS[case]
    assert checks03.check_race_free_loop.verdict(wrong) is False
    out = capsys.readouterr().out
    assert "❌ race_free_loop" in out and words in out, out
    assert "💡 Hint" not in out
    if case in WRONG_CAUSES:
        assert WRONG_CAUSES[case] not in out, out


def test_race_free_loop_times_the_hosts_waits_in_a_run_without_the_order_verdict(sol03, on_cpu, monkeypatch):
    """Stop 55, on an H100: the order verdict's hooks cost the host up to a few ms per step on CUDA, and the
    checker read them as the learner's waits (a correct loop rejected: "waited for the GPU in 139 of 200
    steps"). On CUDA the host's time per step is measured in a second run, with no order detector active; the
    emulated stream counts waits exactly and needs none."""
    from types import SimpleNamespace

    from pinlab import order

    assert checks03._timed_run(checks02.WatchedLagging(), sol03["race_free_loop"]) is None
    active = []
    timed_run = checks03._timed_run

    def spy(s, fn):
        active.append(len(order._detectors()))
        return timed_run(s, fn)

    monkeypatch.setattr(checks03, "_timed_run", spy)
    assert checks03.check_race_free_loop.verdict(sol03["race_free_loop"]) is True
    assert active == [0], active  # called once, with no order detector active
    # the verdict's waits come from the timed run: the checked run's hook-slowed steps are not waits
    s = checks02.WatchedLagging()
    with s, checks02.Watch(s) as watch:
        h = checks03._Harness(s, checks03.STEPS)
        got = h.run(sol03["race_free_loop"])
    h.host_ms = [3.0] * checks03.STEPS
    timed = SimpleNamespace(next=checks03.STEPS, host_ms=[0.1] * checks03.STEPS, got=got)
    cuda_like = SimpleNamespace(emulated=False, noted=[])
    assert checks03._loop_problem(cuda_like, h, watch, got, None, (), None, timed) is None
    timed.host_ms = [3.0] * checks03.STEPS
    assert "waited for the GPU in 200 of 200 steps" in checks03._loop_problem(cuda_like, h, watch, got, None, (), None,
                                                                              timed)


def test_race_free_loop_counts_every_wait(on_cpu, capsys):
    """The lagging stream counts waits exactly: a synchronize() in each step waits in every step but
    the first (nothing is queued yet), a ring one too shallow in every step once it has come round."""
    assert checks03.check_race_free_loop.verdict(loop_sync_each_step) is False
    assert checks03.check_race_free_loop.verdict(_ring(checks03.AHEAD, True)) is False
    out = capsys.readouterr().out
    assert "waited for the GPU in 199 of 200 steps" in out
    assert "waited for the GPU in 198 of 200 steps" in out


def test_a_serial_loop_gets_the_same_diagnosis_however_it_waits(on_cpu, capsys):
    """Issue 28: one reused buffer, the host waiting for its copy every step: with synchronize(), an event's
    synchronize() or a loop polling the event, the same verdict (the polled one was praised as "no wait")."""
    verdicts = []
    for loop in (loop_sync_each_step, loop_event_sync_each_step, loop_polls_each_step):
        checks02.reset()  # each a first failure: no hint
        assert checks03.check_race_free_loop.verdict(loop) is False
        out = capsys.readouterr().out
        verdicts.append(out.split(" — ", 1)[1])
        assert "✅" not in out and "never waited" not in out
    assert verdicts[0] == verdicts[1] == verdicts[2], verdicts


def test_the_accepted_verdict_says_what_was_checked(sol03, on_cpu, capsys):
    assert checks03.check_race_free_loop.verdict(sol03["race_free_loop"]) is True
    out = capsys.readouterr().out
    assert "written before its copy, copied with non_blocking=True from pinned memory" in out, out
    flat = " ".join(out.split())  # wrapped lines read as one
    assert "[measured] how the host's waits inside the loop were seen: 0 waits, every one counted on the emulated " \
           "stream" in flat, out
    assert "from pinned memory; no wait for the GPU inside the loop)." in flat, out


def test_race_free_loop_hints_on_the_second_failure(on_cpu, capsys):
    assert checks03.check_race_free_loop.verdict(loop_racy) is False
    assert checks03.check_race_free_loop.verdict(loop_snapshot_of_pinned) is False
    out = capsys.readouterr().out
    assert out.count("❌") == 2 and out.count("💡 Hint") == 1
    assert "snap = buf.pin_memory()" in out.split("💡 Hint")[1]


def test_race_free_loop_stub_and_crash(on_cpu, capsys):
    assert checks03.check_race_free_loop.verdict(_stub) is False
    assert "⏳ race_free_loop is not implemented yet" in capsys.readouterr().out
    assert checks03.check_race_free_loop.verdict(lambda s, steps, w, f: 1 / 0) is False
    assert "raised ZeroDivisionError" in capsys.readouterr().out


def test_run_loop_shows_the_race(on_cpu):
    run = checks03.run_loop(loop_racy)
    assert run["steps"] == 200 and run["wrong_steps"] == 199 and "delivered step 2's data" in run["first_wrong"]
    assert checks03.run_loop(loop_pinned_snapshot_copy)["wrong_steps"] == 0
    short = checks03.run_loop(loop_racy, steps=100)
    assert short["steps"] == 100 and short["wrong_steps"] == 99
    for bad in (0, -3, 10**9):
        with pytest.raises(ValueError, match="steps"):
            checks03.run_loop(loop_racy, steps=bad)
    with pytest.raises(TypeError, match="fn"):
        checks03.run_loop("not a loop")


# The checkers of exercises 03 and 04 judge races by order too (pinlab.order), which turns on torch's GPU trace
# for good, and under it torch loses errors raised while it frees CUDA memory (docs/facts.md F22): their CUDA
# tests run in a process of their own, tests/cuda_checks03_04_child.py.
@pytest.mark.gpu
def test_gpu_checkers_03_and_04_in_a_process_of_their_own():
    import gpu_child

    gpu_child.run("cuda_checks03_04_child.py")


# ---- run-ahead: one definition (steploop.RUN_AHEAD), used by the checkers' messages ---------------

def test_run_ahead_has_one_definition_and_the_model_agrees():
    from pinlab import steploop

    assert steploop.RUN_AHEAD.startswith("run-ahead k: ") and steploop.RING_RULE in steploop.RUN_AHEAD
    assert [steploop.ring_depth_for(k) for k in (0, 1, 2, 4)] == [1, 2, 3, 5]
    with pytest.raises(ValueError, match="run_ahead"):
        steploop.ring_depth_for(-1)
    # issue 28 ("misnamed knobs"): the model's run_ahead=k is run-ahead k, as the checkers' AHEAD is: a ring
    # of k + 1 buffers (it was ahead=k + 1, a queue depth)
    for k in (0, 1, 2, 3):
        sim = steploop.simulate("reused_pinned", steps=12, run_ahead=k)
        assert steploop.min_ring_depth(sim["writes"], sim["copies"]) == steploop.ring_depth_for(k)
    with pytest.raises(TypeError):
        steploop.simulate("reused_pinned", steps=12, ahead=2)  # the old name, with its other meaning, is gone
    # the exercises' checkers state their run-ahead: a ring of AHEAD + 1 is the one that never waits
    assert checks03.AHEAD + 1 == steploop.ring_depth_for(checks03.AHEAD)


@pytest.mark.parametrize("case", ["ring-one-too-shallow-events", "ring-one-too-shallow-no-events", "racy",
                                  "ring-waits-on-the-wrong-slot"])
def test_race_free_loop_messages_use_the_run_ahead_definition(case, on_cpu, capsys):
    from pinlab import steploop

    wrong, _, _ = WRONG_LOOPS[case]
    assert checks03.check_race_free_loop.verdict(wrong) is False
    assert checks03.check_race_free_loop.verdict(wrong) is False   # the hint too
    out = capsys.readouterr().out
    assert f"run-ahead {checks03.AHEAD}" in out, out
    assert "steps ahead" not in out, out                   # the old, ambiguous wording
    if case != "ring-waits-on-the-wrong-slot":
        assert steploop.RING_RULE in out, out



def test_race_free_loop_rejects_a_ring_whose_event_comes_before_the_copy(on_cpu, capsys):
    """Issue 48: 04's checker caught this mistake, 03's accepted it. forward's run-ahead limit keeps a ring of
    AHEAD + 1 safe here, so no data and no race by order shows it: the loop's own events are followed."""
    # (the xfail called check_race_free_loop itself, which returns None: it could never pass; .verdict is the bool)
    assert checks03.check_race_free_loop.verdict(_ring(checks03.AHEAD + 1, True, record_before_copy=True)) is False
    out = capsys.readouterr().out
    flat = " ".join(out.split())
    assert ("❌ race_free_loop: step 3 rewrote the pinned buffer that step 0's copy at line 17 of loop "
            "(`meta.copy_(bufs[k], non_blocking=True)`) reads after waiting, at line 11 of loop "
            "(`done[k].synchronize()`), only on an event recorded at line 15 of loop (`done[k].record()`), before "
            "that copy, so the wait orders nothing about that copy") in flat, out
    assert "record the event right after the copy out of the buffer it guards." in flat, out


def test_race_free_loop_rejects_a_ring_that_waits_on_events_it_never_records(on_cpu, capsys):
    """The same mistake as the event recorded before the copy: a wait on an event never recorded returns at once."""
    assert checks03.check_race_free_loop.verdict(_ring(checks03.AHEAD + 1, True, record=False)) is False
    flat = " ".join(capsys.readouterr().out.split())
    assert ("❌ race_free_loop: step 3 rewrote the pinned buffer that step 0's copy at line 17 of loop "
            "(`meta.copy_(bufs[k], non_blocking=True)`) reads after waiting, at line 11 of loop "
            "(`done[k].synchronize()`), only on an event never recorded, so the wait orders nothing") in flat, flat


# ---- issue 48: the same verdict on a GPU that keeps up as on a laptop ---------------------------

@pytest.fixture
def keeping_up(monkeypatch, on_cpu):
    """The checker's stream is an emulated GPU that runs every copy before the host's next call (as a GPU that
    keeps up does): no step ever reads another step's data, whatever the loop does."""
    from pinlab.order import _BoundedQueue

    def stream():
        s = checks02.WatchedLagging()
        s._queue = _BoundedQueue(s, 0)
        return s

    monkeypatch.setattr(checks03, "watched_stream", stream)


@pytest.mark.parametrize("case", ["solution", *RIGHT_LOOPS])
def test_race_free_loop_right_answers_stay_accepted_on_a_gpu_that_keeps_up(case, sol03, keeping_up, capsys):
    right = sol03["race_free_loop"] if case == "solution" else RIGHT_LOOPS[case]
    assert checks03.check_race_free_loop.verdict(right) is True, capsys.readouterr().out


#: what the order verdict says of each racy loop behind a GPU that keeps up (line numbers from ``def``)
BY_ORDER = {
    "racy": ("the copy at line 6 of loop_racy (`meta.copy_(buf, non_blocking=True)`) can race with the host's "
             "write into its pinned source at line 4 of loop_racy (`write_metadata(buf, n)`), which nothing the "
             "loop waits on orders after that copy (199 of 200 copies can race by the loop's order, 0 raced in "
             "this run; a GPU further behind reads the new data): your copies read from 1 host buffer"),
    "snapshot-of-pinned": ("at line 4 of loop_snapshot_of_pinned (`write_metadata(buf, n)`)",
                           "`pin_memory()` of a pinned tensor returns the same storage"),
    "ring-one-too-shallow-no-events": ("the copy at line 17 of loop (`meta.copy_(bufs[k], non_blocking=True)`) can "
                                       "race", "198 of 200 copies can race", "your copies read from 2 host buffers"),
    "sync-every-other-step": ("100 of 200 copies can race by the loop's order",),
}


@pytest.mark.parametrize("case", list(BY_ORDER))
def test_race_free_loop_races_are_caught_on_a_gpu_that_keeps_up(case, keeping_up, capsys):
    """Behind the lagging GPU these loops deliver other steps' data (test_race_free_loop_rejects_wrong); behind
    one that keeps up every step reads its own data and they passed. The order verdict names the race."""
    wrong, _, _ = WRONG_LOOPS[case]
    assert checks03.check_race_free_loop.verdict(wrong) is False
    flat = " ".join(capsys.readouterr().out.split())
    words = BY_ORDER[case]
    for w in (words,) if isinstance(words, str) else words:
        assert w in flat, flat
    assert "❌ race_free_loop: the copy at line" in flat, flat


def test_race_free_loop_event_before_the_copy_is_caught_on_a_gpu_that_keeps_up(keeping_up, capsys):
    assert checks03.check_race_free_loop.verdict(_ring(checks03.AHEAD + 1, True, record_before_copy=True)) is False
    assert "only on an event recorded at line 15 of loop (`done[k].record()`)" in " ".join(capsys.readouterr().out.split())
