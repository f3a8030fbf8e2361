"""CPU tests for lesson 04's experiments (pinlab.lessons.l04_the_fix): CUDA is required unless a
stream is given, the experiments run on the emulated lagging stream, the plan-hazard child
reports its outcome as data, and the plot draws from a result."""
from __future__ import annotations

import json
import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

import pinlab  # noqa: E402
from pinlab import CudaUnavailableError, steploop  # noqa: E402
from pinlab.lessons import l04_the_fix as l04  # noqa: E402

CORRECT = ("pageable", "snapshot", "ring_events", "event_wait")
RACY = ("reused_pinned", "double_pinned", "snapshot_of_pinned")


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setenv("PINLAB_FORCE_CPU", "1")


GPU_CALLS = [
    ("snapshot_soak()", lambda: l04.snapshot_soak()),
    ("snapshot_cost()", lambda: l04.snapshot_cost()),
    ("allocator_reuse()", lambda: l04.allocator_reuse()),
    ("pin_trap()", lambda: l04.pin_trap()),
    ("history()", lambda: l04.history()),
    ("plan_hazard()", lambda: l04.plan_hazard()),
]


@pytest.mark.parametrize("name,call", GPU_CALLS, ids=[n for n, _ in GPU_CALLS])
def test_experiments_need_cuda_without_a_stream(no_cuda, name, call):
    with pytest.raises(CudaUnavailableError, match=name.replace("(", r"\(").replace(")", r"\)")):
        call()


def test_arguments_are_checked_before_cuda(no_cuda):
    with pytest.raises(ValueError, match="no_copy"):
        l04.history(strategies=["no_copy", "pageable"])
    with pytest.raises(TypeError, match="sizes"):
        l04.snapshot_cost(sizes=4096)
    with pytest.raises(ValueError, match="rounds"):
        l04.snapshot_cost(rounds=0)
    with pytest.raises(ValueError, match="timeout_s"):
        l04.plan_hazard(timeout_s=0)
    with pytest.raises(ValueError, match="watchdog_s"):
        l04.plan_hazard(watchdog_s=-1)
    with pytest.raises(ValueError, match="multiple of 4"):
        l04.snapshot_soak(nbytes=6)
    with pytest.raises(ValueError, match="ahead"):
        l04.allocator_reuse(ahead=0)


def test_snapshot_soak_on_the_lagging_stream():
    soak = l04.snapshot_soak(steps=300, nbytes=256, busy_ms=0.2, control_steps=40, stream=pinlab.LaggingStream())
    snap, control = soak["snapshot"], soak["control"]
    assert snap["steps"] == 300 and snap["corrupted"] == 0 and control["corrupted"] >= 1
    assert snap["reused_before_copy_done"] == 0 and snap["distinct_blocks"] >= 1
    assert snap["pinned_bytes_held"] > 0  # the queued snapshots are still held
    json.dumps(soak)


def test_snapshot_cost_on_the_lagging_stream():
    cost = l04.snapshot_cost(sizes=[1024, 4096], steps=30, busy_ms=0.1, ahead=2, rounds=3,
                             stream=pinlab.LaggingStream())
    assert [r["nbytes"] for r in cost["rows"]] == [1024, 4096] and cost["rounds"] == 3
    for r in cost["rows"]:
        assert r["snapshot_corrupted"] == 0
        assert math.isclose(r["snapshot_extra_us"], r["snapshot_us"] - r["reused_pinned_us"], abs_tol=0.011)
        assert math.isclose(r["copy_total_us"], r["snapshot_us"] - r["no_copy_us"], abs_tol=0.011)


def test_allocator_reuse_on_the_lagging_stream():
    a = l04.allocator_reuse(nbytes=256, busy_ms=5.0, steps=40, ahead=4, stream=pinlab.LaggingStream())
    assert a["copy_pending_at_second_snapshot"] and a["second_block_differs"]
    assert a["host_memory_stats"] == {} and a["new_host_allocs"] == [0, 0, 0]
    assert a["loop"]["corrupted"] == 0 and a["loop"]["reused_before_copy_done"] == 0 and a["loop"]["steps"] == 40
    json.dumps(a)


def test_pin_trap_on_the_lagging_stream():
    trap = l04.pin_trap(nbytes=64, steps=20, busy_ms=0.5, stream=pinlab.LaggingStream())
    assert trap["same_storage"] and trap["pageable_gets_new_storage"]
    assert trap["race"]["runs"]["snapshot_of_pinned"]["corrupted"] >= 1
    assert trap["race"]["runs"]["snapshot"]["corrupted"] == 0


def test_history_on_the_lagging_stream():
    hist = l04.history(strategies=steploop.HISTORY, steps=25, nbytes=256, busy_ms=0.3, ahead=2, ring_depth=3,
                       stream=pinlab.LaggingStream())
    rows = {r["strategy"]: r for r in hist["rows"]}
    assert list(rows) == steploop.HISTORY
    assert all(rows[s]["corrupted"] == 0 for s in CORRECT) and all(rows[s]["corrupted"] > 0 for s in RACY)
    assert rows["pageable"]["pinned_bytes_held"] == 0 and rows["snapshot"]["label"] == steploop.LABELS["snapshot"]
    json.dumps(hist)


def test_classify_child():
    ok = l04.classify_child(0, 'x\nPINLAB_RESULT {"status": "correct", "detail": "fine", "err_a": 0.001}\n', "", False)
    assert ok == {"outcome": "correct", "detail": "fine", "err_a": 0.001}
    assert l04.classify_child(None, "", "", True)["outcome"] == "hung"
    hung = l04.classify_child(0, 'PINLAB_RESULT {"status": "hung", "detail": "not finished"}\n', "", False)
    assert hung == {"outcome": "hung", "detail": "not finished"}
    dead = l04.classify_child(-6, "", "...\nRuntimeError: CUDA error: an illegal memory access was encountered\n", False)
    assert dead["outcome"] == "crashed" and "illegal memory access" in dead["detail"]
    assert l04.classify_child(1, "", "", False)["detail"].startswith("exit status 1")
    assert l04.classify_child(0, "PINLAB_RESULT {bad json", "boom", False)["outcome"] == "crashed"


def test_child_process_runs_and_reports(no_cuda):
    code = l04.child_code("synced", 1.0, 0, 0.02)
    assert "from pinlab.lessons import l04_the_fix" in code and "wait_for_go=True" in code
    res = l04.run_children({"synced": code}, timeout_s=120)["synced"]
    assert res["outcome"] == "unavailable" and res["returncode"] == 0  # no GPU here, reported as data


def test_run_children_one_at_a_time_after_a_shared_set_up():
    tag = "PINLAB_RESULT "
    waits = ("import json, sys, time\n"
             "t = time.time(); sys.stdin.readline()\n"
             f"print({tag!r} + json.dumps({{'status': 'correct', 'detail': 'ok', 'go': time.time()}}), flush=True)\n")
    hangs = "import sys, time\nsys.stdin.readline()\ntime.sleep(60)\n"
    dies = "import sys\nsys.stdin.readline()\nraise SystemExit('RuntimeError: an illegal memory access')\n"
    skips = f"print({tag!r} + '{{\"status\": \"unavailable\", \"detail\": \"no GPU\"}}')\n"  # never reads stdin
    out = l04.run_children({"a": waits, "b": hangs, "c": dies, "d": skips, "e": waits}, timeout_s=2.0)
    assert list(out) == ["a", "b", "c", "d", "e"]
    assert out["a"]["outcome"] == "correct" and out["a"]["returncode"] == 0
    assert out["b"]["outcome"] == "hung" and out["b"]["returncode"] is None and out["b"]["seconds"] >= 1.9
    assert out["c"]["outcome"] == "crashed" and "illegal memory access" in out["c"]["detail"]
    assert out["d"]["outcome"] == "unavailable"
    assert out["e"]["go"] > out["a"]["go"] + 1.9  # e was told to go only after b's time limit


def test_plot_history_draws():
    hist = l04.history(steps=8, nbytes=64, stream=pinlab.LaggingStream())
    axes = l04.plot_history(hist, title="t")
    assert len(axes) == 3
    plt.close("all")
