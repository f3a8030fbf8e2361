"""The CUDA tests of the checkers of exercises 03 (``check_race_free_loop``) and 04 (``check_pin_snapshot``,
``check_ring_stage``), run by tests/test_checks_l03_l04.py in a process of their own
(``test_gpu_checkers_03_and_04_in_a_process_of_their_own``): the checkers judge races by order too, which turns on
torch's GPU trace for good (docs/facts.md F22), and the gpu tests after them in the suite's process would run
under it (stop 55, on an H100: 18 of tests/test_streams_cuda.py's refusals came back as "SystemError: error return
without exception set"). Not collected on its own (the name does not start with ``test_``); run it by path:
``python -m pytest tests/cuda_checks03_04_child.py``.
"""
import re

import pytest
import torch

from nbtools import solution_namespace
from pinlab.checks import l02 as checks02
from pinlab.checks import l03 as checks03
from pinlab.checks import l04 as checks04
from test_checks_l03_l04 import RIGHT_LOOPS, WRONG_LOOPS, sol03  # noqa: F401 - sol03: a fixture
from test_checks_l04 import RECYCLED, SHALLOW, WRONG_EVENT, WRONG_SNAPSHOTS, _pool_snapshot, _reused_snapshot, _ring

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def sol04():
    return solution_namespace("04_the_fix")


@pytest.fixture(autouse=True)
def _fresh():
    checks02.reset()
    checks04.reset()


@cuda
def test_gpu_race_free_loop_accepts_solution_and_a_ring(sol03, capsys):
    checks02.reset()
    assert checks03.check_race_free_loop.verdict(sol03["race_free_loop"]) is True
    assert checks03.check_race_free_loop.verdict(RIGHT_LOOPS["ring-ahead+1-events"]) is True
    assert "CUDA stream" in capsys.readouterr().out


@cuda
@pytest.mark.parametrize("case", ["racy", "snapshot-of-pinned", "ring-one-too-shallow-events", "sync-each-step",
                                  "snapshot-before-write", "polls-each-step", "event-sync-each-step",
                                  "snapshot-sync-every-tenth-step", "ring-copies-before-writing",
                                  "snapshot-filled-after-its-copy"])
def test_gpu_race_free_loop_rejects_wrong(case, capsys):
    checks02.reset()
    wrong, _, words = WRONG_LOOPS[case]
    assert checks03.check_race_free_loop.verdict(wrong) is False
    out = capsys.readouterr().out
    assert "❌ race_free_loop" in out and any(w in out for w in words), out


@cuda
def test_gpu_pin_snapshot_checker(sol04, capsys):
    assert checks04.check_pin_snapshot.verdict(sol04["pin_snapshot"]) is True
    for case in ("pin-memory", "clone", "empty-like-without-copy"):
        wrong, message = WRONG_SNAPSHOTS[case]
        assert checks04.check_pin_snapshot.verdict(wrong) is False
        assert message in capsys.readouterr().out
    assert checks04.check_pin_snapshot.verdict(_reused_snapshot()) is False
    assert RECYCLED.format(1) in capsys.readouterr().out
    assert checks04.check_pin_snapshot.verdict(_pool_snapshot(5)) is False   # 64 steps in flight behind the busy GPU
    assert RECYCLED.format(5) in capsys.readouterr().out


@cuda
def test_gpu_ring_stage_checker(sol04, capsys):
    assert checks04.check_ring_stage.verdict(sol04["ring_stage"]) is True
    capsys.readouterr()
    assert checks04.check_ring_stage.verdict(_ring(wait=False)) is False  # the shallow ring races behind the busy GPU
    out = capsys.readouterr().out
    assert re.search(r"❌ ring_stage: step \d+ of 200 delivered (step \d+'s|a mix of several steps') data", out), out
    assert SHALLOW in out
    # the race of an event recorded before the copy did not show behind the H200's busy GPU (the 16 KiB
    # copy starts and ends before the host rewrites the buffer): the checker sees the order instead
    assert checks04.check_ring_stage.verdict(_ring(record_first=True)) is False
    assert "ring_stage: at step 0, events[0] was recorded before the copy out of ring[0]" in capsys.readouterr().out
    for kwargs in (dict(blocking=True), dict(sync_all=torch.cuda)):
        assert checks04.check_ring_stage.verdict(_ring(**kwargs)) is False
        out = capsys.readouterr().out
        assert re.search(r"❌ ring_stage blocks the host: the host waited for the GPU in (1\d\d|200) of 200 steps", out), out
    assert checks04.check_ring_stage.verdict(_ring(wait_next=True)) is False
    assert WRONG_EVENT in capsys.readouterr().out
    for kwargs in (dict(wait_latest=True), dict(wait_next=True, poll=True)):
        assert checks04.check_ring_stage.verdict(_ring(**kwargs)) is False
        assert "the host waited on events[" in capsys.readouterr().out
    assert checks04.check_ring_stage.verdict(_ring(one_buffer=True)) is False
    assert "ring[1] was written in 0 of 200 steps" in capsys.readouterr().out
    assert checks04.check_ring_stage.verdict(_ring(copy_first=True)) is False
    assert "the copy out of ring[0] was enqueued before data was written into ring[0]" in capsys.readouterr().out


@cuda
def test_gpu_ring_stage_accepts_the_reference_on_a_slow_host(sol04, capsys):
    """A host slower than the GPU between ring_stage calls (a shared CPU, 2 cores) lets the GPU catch up; that
    is not the learner's wait. Here the checker's loop spends 2.5 ms of host time per step outside ring_stage
    (after queueing each step's 1 ms of GPU work) on a stream of the public API: the reference ring must still
    pass (the checker counted this as waiting until 2026-12-01, when the reference was rejected with 69 of 200
    steps on an H200 shared by three test suites). (On such a host a sync inside ring_stage finds the GPU idle
    and costs nothing, so timing cannot tell it from no wait: the planted syncs are rejected behind the busy
    GPU, in test_gpu_ring_stage_checker.)"""
    import time

    from pinlab import CudaStream

    class SlowHost(CudaStream):
        def busy(self, ms):
            super().busy(ms)
            time.sleep(0.0025)  # the host's own work between calls, slower than the GPU's step

    assert checks04.check_ring_stage.verdict(sol04["ring_stage"], stream=SlowHost()) is True, capsys.readouterr().out
