"""CPU tests for pinlab.steploop: the pure accounting, the timeline model, the exercise references,
Staging and the plain step loop on the emulated lagging stream."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import pinlab
from pinlab import steploop

CORRECT = ("pageable", "snapshot", "ring_events", "event_wait")
RACY = ("reused_pinned", "double_pinned", "snapshot_of_pinned")


# --------------------------------------------------------------------------- vocabulary

def test_vocabulary_is_consistent():
    assert set(steploop.LABELS) == set(steploop.STRATEGIES)
    assert set(steploop.HISTORY) <= set(steploop.STRATEGIES) and "no_copy" not in steploop.HISTORY
    assert set(steploop.LATE_READ) <= set(steploop.STRATEGIES)
    assert not {"pageable", "snapshot", "no_copy"} & set(steploop.LATE_READ)


def test_argument_checks():
    assert steploop.strategies_arg(["pageable", "snapshot"]) == ["pageable", "snapshot"]
    with pytest.raises(ValueError, match="repeat"):
        steploop.strategies_arg(["pageable", "pageable"])
    with pytest.raises(TypeError, match="strategies"):
        steploop.strategies_arg("pageable")
    with pytest.raises(ValueError, match="empty"):
        steploop.strategies_arg([])
    with pytest.raises(ValueError, match="no_copy"):
        steploop.strategies_arg(["no_copy"], allow_no_copy=False)
    assert steploop.run_ahead_arg(None) is None and steploop.run_ahead_arg(1) == 1 and steploop.run_ahead_arg(0) == 0
    with pytest.raises(ValueError, match="run_ahead"):
        steploop.run_ahead_arg(-1)
    with pytest.raises(TypeError, match="run_ahead"):
        steploop.run_ahead_arg(1.5)
    assert steploop.ints_in("nbytes", 64) == 16
    with pytest.raises(ValueError, match="multiple of 4"):
        steploop.ints_in("nbytes", 10)
    assert steploop.sizes_arg((1024, 4096)) == [1024, 4096]
    with pytest.raises(TypeError, match="sizes"):
        steploop.sizes_arg(4096)
    with pytest.raises(ValueError, match="sizes"):
        steploop.sizes_arg([])
    with pytest.raises(ValueError, match="too large"):
        steploop.check_dst(10, 1 << 28)
    with pytest.raises(TypeError, match="pinlab stream"):
        steploop.cuda_or(object(), "x()")


def test_cuda_or_needs_cuda(monkeypatch):
    monkeypatch.setenv("PINLAB_FORCE_CPU", "1")
    with pytest.raises(pinlab.CudaUnavailableError, match=r"thing\(\)"):
        steploop.cuda_or(None, "thing()")
    s = pinlab.LaggingStream()
    assert steploop.cuda_or(s, "thing()") is s


# --------------------------------------------------------------------------- pure accounting

def test_corruption_summary():
    s = steploop.corruption_summary([0, 5, 5, -1, 4, None])
    assert s == {"steps": 6, "copied": 5, "corrupted": 3, "torn": 1, "rate": 3 / 5, "first_corrupted": 1}
    assert steploop.corruption_summary([None, None])["rate"] == 0.0
    assert steploop.corruption_summary([2, 2], expected=[2, 3])["corrupted"] == 1
    assert steploop.corruption_summary(np.arange(3))["corrupted"] == 0
    with pytest.raises(ValueError, match="expected"):
        steploop.corruption_summary([0], expected=[0, 1])
    with pytest.raises(TypeError):
        steploop.corruption_summary([0.5])
    with pytest.raises(TypeError):
        steploop.corruption_summary([True])
    with pytest.raises(TypeError):
        steploop.corruption_summary(7)


def test_received_from_minmax_and_time_summary():
    assert steploop.received_from_minmax([(3, 3), (1, 4), [7, 7]]) == [3, -1, 7]
    with pytest.raises(ValueError):
        steploop.received_from_minmax([(1, 2, 3)])
    t = steploop.time_summary_us([1000, 2000, 3000, 10_000])
    assert t["median_us"] == 2.5 and t["mean_us"] == 4.0 and t["max_us"] == 10.0
    assert 3.0 < t["p90_us"] < 10.0
    with pytest.raises(ValueError):
        steploop.time_summary_us([])
    assert steploop.percentile([1, 2, 3], 0.5) == 2.0
    with pytest.raises(ValueError):
        steploop.percentile([1], 1.5)


def test_copies_correct_and_min_ring_depth():
    writes = [(0.0, 1.0), (2.0, 3.0), (3.5, 4.0)]
    copies = [(1.0, 2.0), (3.0, 5.0), (6.0, 7.0)]
    assert steploop.copies_correct(writes, copies) == [True, False, True]
    assert steploop.min_ring_depth(writes, copies) == 2
    assert steploop.min_ring_depth([(0, 1)], [(9, 10)]) == 1
    # a write that starts exactly when the copy ends is safe; a hair earlier is not
    assert steploop.copies_correct([(0, 1), (2, 3)], [(1, 2), (3, 4)]) == [True, True]
    assert steploop.copies_correct([(0, 1), (1.99, 3)], [(1, 2), (3, 4)]) == [False, True]
    with pytest.raises(ValueError, match="one span per step"):
        steploop.copies_correct(writes, copies[:2])
    with pytest.raises(ValueError, match="ends before"):
        steploop.copies_correct([(2, 1)], [(3, 4)])
    with pytest.raises(TypeError):
        steploop.min_ring_depth(5, copies)


# --------------------------------------------------------------------------- the timeline model

def test_simulate_reused_pinned_delivers_the_last_step():
    sim = steploop.simulate("reused_pinned", steps=6)
    assert sim["received"] == [0, 5, 5, 5, 5, 5] and sim["corrupted"] == 4
    assert sim["host_end_ms"] < sim["gpu_end_ms"]
    assert steploop.copies_correct(sim["writes"], sim["copies"]) == [r == n for n, r in enumerate(sim["received"])]


def test_simulate_fast_gpu_and_the_fixes_are_correct():
    assert steploop.simulate("reused_pinned", steps=6, gpu_ms=0.01)["corrupted"] == 0
    for s in CORRECT:
        assert steploop.simulate(s, steps=8)["corrupted"] == 0, s
    assert steploop.simulate("ring", steps=8, ring_depth=2)["corrupted"] > 0
    assert steploop.simulate("ring", steps=8, ring_depth=2, run_ahead=1)["corrupted"] == 0
    assert steploop.simulate("double_pinned", steps=8)["corrupted"] > 0
    assert steploop.simulate("snapshot_of_pinned", steps=8)["corrupted"] > 0


def test_simulate_waits_and_the_ring_depth_agree():
    sim = steploop.simulate("reused_pinned", steps=10, run_ahead=1)
    depth = steploop.min_ring_depth(sim["writes"], sim["copies"])
    assert depth == steploop.ring_depth_for(1)
    assert steploop.simulate("ring", steps=10, run_ahead=1, ring_depth=depth)["corrupted"] == 0
    assert steploop.simulate("ring", steps=10, run_ahead=1, ring_depth=depth - 1)["corrupted"] > 0
    paced = steploop.simulate("pageable", steps=8, staging_slots=2)
    free = steploop.simulate("pageable", steps=8)
    assert paced["host_end_ms"] > free["host_end_ms"]
    assert any(lab == "host waits" for _, _, lab in paced["host"])
    ev = steploop.simulate("event_wait", steps=6)
    assert ev["host_end_ms"] > free["host_end_ms"] - 1e-9


def test_simulate_torn_read_and_checks():
    sim = steploop.simulate("reused_pinned", steps=3, host_ms=0.1, launch_ms=0.0, copy_ms=0.5, gpu_ms=0.0)
    assert sim["received"][0] == -1  # step 1's write started while copy 0 was running
    with pytest.raises(ValueError, match="no_copy"):
        steploop.simulate("no_copy")
    with pytest.raises(ValueError):
        steploop.simulate("bogus")
    with pytest.raises(ValueError):
        steploop.simulate(steps=0)


# --------------------------------------------------------------------------- Staging

def test_staging_kinds_on_the_lagging_stream():
    with pinlab.LaggingStream() as s:
        st = steploop.Staging(s, "snapshot_of_pinned", 4)
        assert st.stage(steploop.fill, 1) is st.slots[0]  # pin_memory() of a pinned tensor: the same tensor
        st = steploop.Staging(s, "snapshot", 4)
        snap = st.stage(steploop.fill, 2)
        assert snap is not st.slots[0] and snap.is_pinned() and snap.tolist() == [2] * 4
        assert not st.slots[0].is_pinned()
        st = steploop.Staging(s, "ring_events", 4, ring_depth=3)
        got = [st.stage(steploop.fill, n) for n in range(4)]
        assert got[0] is got[3] and got[0] is not got[1] and all(g.is_pinned() for g in got)
        assert steploop.Staging(s, "no_copy", 4).stage(steploop.fill, 0) is None
        st = steploop.Staging(s, "double_pinned", 4)
        out = st.stage(steploop.fill, 7)
        assert out is st.slots[0] and out is not st.work and out.tolist() == [7] * 4


# --------------------------------------------------------------------------- the plain loop, emulated

@pytest.mark.parametrize("run_ahead", [None, 0, 1])
def test_every_strategy_on_the_lagging_stream(run_ahead):
    res = steploop.every_strategy(pinlab.LaggingStream(), strategies=list(steploop.STRATEGIES), steps=30, nbytes=64,
                                  busy_ms=0.5, run_ahead=run_ahead)
    runs = res["runs"]
    for s in CORRECT:
        assert runs[s]["corrupted"] == 0, s
        assert runs[s]["received"] == list(range(30))
    for s in RACY:
        if run_ahead == 0:  # the host waits until the previous step's copy has run: one buffer is enough
            assert runs[s]["corrupted"] == 0, s
        else:
            assert runs[s]["corrupted"] >= 1, s
    assert runs["no_copy"]["copied"] == 0 and runs["no_copy"]["received"] == [None] * 30
    assert len(runs["pageable"]["host_us"]) == 30
    assert runs["pageable"]["pinned_bytes_held"] == 0 and runs["reused_pinned"]["pinned_bytes_held"] == 64
    json.dumps(res)


def test_ring_without_events_races_when_shallow():
    s = pinlab.LaggingStream()
    runs = steploop.every_strategy(s, strategies=["ring"], steps=20, nbytes=16, busy_ms=0.5, run_ahead=None,
                                   ring_depth=2)["runs"]
    assert runs["ring"]["corrupted"] >= 1
    runs = steploop.every_strategy(s, strategies=["ring"], steps=20, nbytes=16, busy_ms=0.5, run_ahead=1,
                                   ring_depth=3)["runs"]
    assert runs["ring"]["corrupted"] == 0


def test_plain_loop_tracks_snapshot_blocks():
    run = steploop.plain_loop(pinlab.LaggingStream(), "snapshot", steps=50, n_ints=16, busy_ms=0.2, run_ahead=None,
                              per_step=False, track_blocks=True)
    assert run["corrupted"] == 0 and run["reused_before_copy_done"] == 0
    assert run["distinct_blocks"] >= 1 and "received" not in run
    with pytest.raises(ValueError, match="strateg"):
        steploop.plain_loop(pinlab.LaggingStream(), "nope", steps=2, n_ints=1, busy_ms=0.1, run_ahead=None)


def test_run_ahead_gate_keeps_the_host_at_most_run_ahead_steps_ahead():
    """run_ahead=k: before writing step n the host waits for step n-k-1, so k earlier steps stay queued."""
    for k in (0, 1, 3):
        with pinlab.LaggingStream() as s:
            gate, ran, queued = steploop.RunAheadGate(s, k), [], []
            for n in range(8):
                gate.wait(n)
                queued.append(n - len(ran))          # steps the emulated GPU has not run yet
                s.launch(ran.append, n)
                gate.record(n)
            assert queued == [min(n, k) for n in range(8)], (k, queued)
    with pinlab.LaggingStream() as s:
        gate = steploop.RunAheadGate(s, None)      # unbounded: never waits
        for n in range(5):
            gate.wait(n)
            s.launch(lambda: None)
            gate.record(n)
        assert s.pending() == 5 and s.host_waits == 0
    with pytest.raises(ValueError, match="run_ahead"):
        steploop.RunAheadGate(pinlab.LaggingStream(), -1)
