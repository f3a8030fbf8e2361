"""CPU tests for lesson 03's experiments (pinlab.lessons.l03_the_race): CUDA is required unless a
stream is given, arguments are checked first, the experiments run on the emulated lagging stream,
and the plots draw from their results."""
from __future__ import annotations

import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

import pinlab  # noqa: E402
import torch  # noqa: E402
from pinlab import CudaUnavailableError  # noqa: E402
from pinlab.lessons import l03_the_race as l03  # noqa: E402

SMALL_DECODE = dict(steps=16, max_batch=6, page_size=8, max_seq_len=64, num_qo_heads=4, num_kv_heads=2,
                    head_dim=16, seed=2)


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setenv("PINLAB_FORCE_CPU", "1")


@pytest.mark.parametrize("name,call", [
    ("plain_race()", lambda: l03.plain_race()),
    ("decode_race()", lambda: l03.decode_race()),
    ("launch_queue()", lambda: l03.launch_queue()),
], ids=["plain_race", "decode_race", "launch_queue"])
def test_experiments_need_cuda_without_a_stream(no_cuda, name, call):
    with pytest.raises(CudaUnavailableError, match=name.replace("(", r"\(").replace(")", r"\)")):
        call()


def test_arguments_are_checked_before_cuda(no_cuda):
    with pytest.raises(ValueError, match="strategies"):
        l03.plain_race(strategies=["nope"])
    with pytest.raises(ValueError, match="multiple of 4"):
        l03.plain_race(nbytes=10)
    with pytest.raises(ValueError, match="busy_ms"):
        l03.plain_race(busy_ms=0)
    with pytest.raises(TypeError, match="steps"):
        l03.plain_race(steps=1.5)
    with pytest.raises(ValueError, match="run_ahead"):
        l03.plain_race(run_ahead=-1)
    with pytest.raises(ValueError, match="repeat"):
        l03.plain_race(strategies=["pageable", "pageable"])
    with pytest.raises(TypeError, match="strategies"):
        l03.plain_race(strategies="pageable")
    with pytest.raises(ValueError, match="ring"):
        l03.decode_race(ring=2, run_ahead=2)
    with pytest.raises(ValueError, match="backend"):
        l03.decode_race(backend="triton")
    with pytest.raises(ValueError, match="multiple"):
        l03.decode_race(num_qo_heads=6, num_kv_heads=4)
    with pytest.raises(ValueError, match="no_copy"):
        l03.decode_race(strategies=["no_copy"])
    with pytest.raises(TypeError, match="pinlab stream"):
        l03.plain_race(stream="cuda")


def test_plain_race_on_the_lagging_stream():
    res = l03.plain_race(strategies=["reused_pinned", "pageable"], steps=40, nbytes=256, busy_ms=0.5,
                         stream=pinlab.LaggingStream())
    pinned, pageable = res["runs"]["reused_pinned"], res["runs"]["pageable"]
    # the emulated GPU runs nothing until the end: every copy reads what the host wrote last
    assert pinned["received"] == [39] * 40 and pinned["corrupted"] == 39 and pinned["first_corrupted"] == 0
    assert pageable["corrupted"] == 0 and pageable["received"] == list(range(40))
    assert set(res) == {"steps", "nbytes", "busy_ms", "run_ahead", "runs"}
    json.dumps(res)


def test_decode_race_on_the_lagging_stream():
    res = l03.decode_race(strategies=["reused_pinned", "pageable"], stream=pinlab.LaggingStream(), **SMALL_DECODE)
    assert res["backend"] == "torch" and "emulated" in res["fallback_reason"] and res["jit_s"] is None
    bad, good = res["runs"]["reused_pinned"], res["runs"]["pageable"]
    assert bad["copies_wrong"] >= 1 and bad["wrong_input_steps"] >= 1
    assert good["copies_wrong"] == 0 and good["wrong_input_steps"] == 0 and good["max_err_right_inputs"] <= res["tol"]
    json.dumps(res)


def test_plots_draw_from_results():
    s = pinlab.LaggingStream()
    runs = l03.plain_race(strategies=["reused_pinned", "pageable"], steps=12, nbytes=16, stream=s)["runs"]
    l03.plot_received(runs, title="t")
    l03.plot_errors(l03.decode_race(strategies=["reused_pinned"], stream=s, **SMALL_DECODE), "reused_pinned", title="t")
    l03.plot_step_parts(timed_sweep(), title="t")
    plt.close("all")
    with pytest.raises(TypeError):
        l03.plot_received({}, title="t")


# ---- step_parts / plot_step_parts: the notebook's timed step loop, summed up (synthetic runs) ----

def timed_run(write, copy, check, forward, loop_ms, drain_ms, nbytes=1024, buffer="pageable"):
    return {"nbytes": nbytes, "buffer": buffer, "us": {"write": write, "copy": copy, "check": check,
                                                       "forward": forward},
            "loop_ms": loop_ms, "drain_ms": drain_ms, "wrong": 0}


def timed_sweep():
    return {"sizes": [1024, 65536], "steps": 3, "busy_ms": 0.5, "runs": [
        timed_run([1, 1, 1], [10, 10, 10], [5, 5, 5], [5, 5, 5], 0.1, 1.4),
        timed_run([1, 1, 1], [10, 10, 10], [5, 5, 5], [5, 5, 5], 0.1, 1.4, buffer="pinned"),
        timed_run([1, 1, 1], [20, 20, 20], [5, 5, 5], [450, 480, 470], 1.5, 0.5, nbytes=65536),
        timed_run([1, 1, 1], [9, 9, 9], [5, 5, 5], [5, 5, 5], 0.1, 1.4, nbytes=65536, buffer="pinned"),
    ]}


def test_step_parts_sums_each_part_and_finds_where_the_host_spent_its_loop():
    p = l03.step_parts(timed_run([1, 2, 3], [10, 10, 400], [5, 5, 5], [5, 500, 5], 1.0, 3.0))
    assert p["steps"] == 3 and p["run_ms"] == 4.0 and p["share"] == 0.25
    assert p["total_ms"]["copy"] == pytest.approx(0.42) and p["total_ms"]["forward"] == pytest.approx(0.51)
    assert p["total_ms"]["other"] == pytest.approx(1.0 - 0.006 - 0.42 - 0.015 - 0.51)
    assert p["median_us"] == {"write": 2, "copy": 10, "check": 5, "forward": 5}
    assert p["group_ms"]["copy call"] == pytest.approx(0.42)
    assert p["group_ms"]["kernel launches"] == pytest.approx(0.525)
    assert p["largest"] == "kernel launches"
    # the groups cover every part once: they add up to the host loop
    assert sum(p["group_ms"].values()) == pytest.approx(p["loop_ms"])


def test_step_parts_other_never_goes_below_zero_and_an_empty_run_has_share_zero():
    p = l03.step_parts(timed_run([100.0], [900.0], [0.0], [0.0], 0.5, 0.0))  # parts sum to 1 ms > loop
    assert p["total_ms"]["other"] == 0.0 and p["share"] == 1.0 and p["largest"] == "copy call"
    assert l03.step_parts(timed_run([0], [0], [0], [0], 0, 0))["share"] == 0.0


@pytest.mark.parametrize("run, err, match", [
    ([], TypeError, "run must be a dict"),
    ({"us": {}, "loop_ms": 1.0}, ValueError, "drain_ms"),
    ({"us": [], "loop_ms": 1.0, "drain_ms": 1.0}, TypeError, r"run\['us'\] must be a dict"),
    (timed_run([1], "1", [1], [1], 1.0, 1.0), TypeError, r"run\['us'\]\['copy'\] must be a list"),
    (timed_run([1], [], [1], [1], 1.0, 1.0), ValueError, r"run\['us'\]\['copy'\] must not be empty"),
    (timed_run([1], [1], [1, 2], [1], 1.0, 1.0), ValueError, "equally long"),
    (timed_run([1], [-1], [1], [1], 1.0, 1.0), ValueError, r"run\['us'\]\['copy'\]\[0\] must be >= 0"),
    (timed_run([1], [float("nan")], [1], [1], 1.0, 1.0), ValueError, "finite"),
    (timed_run([1], [1], [1], [1], -1.0, 1.0), ValueError, r"run\['loop_ms'\] must be >= 0"),
    (timed_run([1], [1], [1], [1], 1.0, "1"), TypeError, r"run\['drain_ms'\] must be a number"),
])
def test_step_parts_rejects_bad_runs_naming_what_is_wrong(run, err, match):
    with pytest.raises(err, match=match):
        l03.step_parts(run)


def test_step_parts_missing_a_part_is_named():
    run = timed_run([1], [1], [1], [1], 1.0, 1.0)
    del run["us"]["forward"]
    with pytest.raises(TypeError, match=r"run\['us'\]\['forward'\]"):
        l03.step_parts(run)


def test_plot_step_parts_draws_one_stacked_bar_per_buffer_and_size():
    ax = l03.plot_step_parts(timed_sweep(), title="t")
    # 4 runs x 3 groups of bars, and the GPU's work as a line
    assert len(ax.patches) == 4 * len(l03.PART_GROUPS)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1 KiB per step", "64 KiB per step"]
    plt.close("all")
    with pytest.raises(TypeError, match="runs"):
        l03.plot_step_parts({"runs": []}, title="t")
    with pytest.raises(ValueError, match="busy_ms"):
        l03.plot_step_parts({**timed_sweep(), "busy_ms": 0}, title="t")


def test_waits_counts_the_steps_whose_call_took_longer_than_the_threshold():
    run = timed_run([1, 1, 1, 1], [10, 600, 10, 900], [5, 5, 300, 5], [5, 5, 5, 5], 2.0, 0.0)
    w = l03.waits(run, 250)
    assert w["copy"] == {"steps": 2, "first": 1, "ms": pytest.approx(1.5)}  # 600 + 900 µs, the fast calls left out
    assert w["check"] == {"steps": 1, "first": 2, "ms": pytest.approx(0.3)}
    assert w["write"] == w["forward"] == {"steps": 0, "first": None, "ms": 0}
    assert set(w) == set(l03.STEP_PARTS)
    # strictly longer: a call of exactly the threshold did not wait
    assert l03.waits(run, 300)["check"] == {"steps": 0, "first": None, "ms": 0}


def test_waits_checks_its_arguments():
    run = timed_run([1], [1], [1], [1], 1.0, 1.0)
    with pytest.raises(ValueError, match="threshold_us must be > 0"):
        l03.waits(run, 0)
    with pytest.raises(TypeError, match="threshold_us must be a number"):
        l03.waits(run, "250")
    with pytest.raises(ValueError, match="equally long"):
        l03.waits(timed_run([1], [1, 2], [1], [1], 1.0, 1.0), 250)


# ---- the launch queue: the experiment on the emulated stream, the analysis on synthetic times ----

def test_launch_queue_on_the_lagging_stream_runs_every_launch_and_never_blocks():
    res = l03.launch_queue(launches=300, busy_ms=5.0, numel=8, stream=pinlab.LaggingStream())
    assert res["ran"] == 300 and len(res["launch_us"]) == 300 and res["launches"] == 300
    # nothing limits the emulated queue, and a single event query runs nothing (the emulated GPU moves on
    # only while the host spins on one event): the busy kernel is never seen done during the loop, so no
    # call, however slow, is taken for a full queue
    assert res["busy_done_at"] is None and res["full_at"] is None
    assert set(res["before_full"]) == {"median_us", "p90_us", "max_us"}
    assert res["before_full"]["median_us"] <= res["before_full"]["p90_us"] <= res["before_full"]["max_us"]
    json.dumps(res)


def test_launch_queue_checks_its_arguments_before_cuda(no_cuda):
    with pytest.raises(ValueError, match="launches"):
        l03.launch_queue(launches=0)
    with pytest.raises(TypeError, match="launches"):
        l03.launch_queue(launches=2.5)
    with pytest.raises(ValueError, match="busy_ms"):
        l03.launch_queue(busy_ms=-1)
    with pytest.raises(ValueError, match="busy_ms"):
        l03.launch_queue(busy_ms=1e9)
    with pytest.raises(ValueError, match="numel"):
        l03.launch_queue(numel=0)
    with pytest.raises(TypeError, match="pinlab stream"):
        l03.launch_queue(stream="cuda")


def test_queue_full_at_finds_the_call_that_waited_for_the_busy_kernel():
    quick = [4.0] * 10
    # the queue filled at call 6: it waited ~80 ms for the busy kernel; the calls after it are quick again
    assert l03.queue_full_at(quick[:6] + [80_000.0] + quick) == 6
    # an earlier OS hiccup (over the threshold, far shorter than the real wait) is not the full queue
    assert l03.queue_full_at([4.0, 900.0, 4.0, 4.0, 60_000.0, 4.0]) == 4
    # no call over the threshold: the queue never filled while the GPU was busy
    assert l03.queue_full_at(quick) is None
    assert l03.queue_full_at([4.0, 500.0, 4.0]) is None  # strictly over
    assert l03.queue_full_at([4.0, 501.0, 4.0]) == 1
    assert l03.queue_full_at([4.0, 30.0, 4.0], wait_us=20.0) == 1
    # the first of two comparable waits
    assert l03.queue_full_at([4.0, 50_000.0, 4.0, 40_000.0]) == 1


def test_queue_full_at_with_the_busy_kernels_event_tells_the_wait_from_a_hiccup():
    us = [4.0, 9_000.0, 4.0, 4.0, 3_000.0, 4.0, 4.0]
    # a long hiccup at call 1 while the kernel still ran; the real wait at call 4, the kernel done right after
    done = [False, False, False, False, False, False, True, True]
    assert l03.queue_full_at(us, busy_done=done) == 4
    assert l03.queue_full_at(us) == 1  # without the event, the longer hiccup would have been taken
    # the kernel ended before the queue filled: the slow call came after it, so no call waited for it
    assert l03.queue_full_at(us, busy_done=[False, True, True, True, True, True, True, True]) is None
    # the kernel never finished during the loop (nothing freed a slot): no call found the queue full
    assert l03.queue_full_at(us, busy_done=[False] * 8) is None
    # a hiccup just before the real wait: the call during which the kernel ended is the last slow one
    assert l03.queue_full_at([4.0, 900.0, 4.0, 60_000.0, 4.0], busy_done=[False] * 4 + [True] * 2) == 3
    # the event completes a few calls after the wait, not later
    w = l03.QUEUE_DONE_WITHIN
    assert l03.queue_full_at([4.0, 3_000.0] + [4.0] * (w - 1), busy_done=[False] * (w + 1) + [True]) == 1
    assert l03.queue_full_at([4.0, 3_000.0] + [4.0] * w, busy_done=[False] * (w + 2) + [True]) is None
    # the last call waited: the query after the loop counts
    assert l03.queue_full_at([4.0, 4.0, 2_000.0], busy_done=[False, False, False, True]) == 2
    with pytest.raises(ValueError, match="busy_done"):
        l03.queue_full_at(us, busy_done=[False] * 7)
    with pytest.raises(ValueError, match="busy_done"):
        l03.queue_full_at(us, busy_done=[0] * 8)
    with pytest.raises(TypeError, match="busy_done"):
        l03.queue_full_at(us, busy_done="no")


@pytest.mark.parametrize("args, err, match", [
    (([],), ValueError, "must not be empty"),
    (("12",), TypeError, "launch_us must be a list"),
    (({"a": 1},), TypeError, "launch_us must be a list"),
    (([1.0, -2.0],), ValueError, r"launch_us\[1\] must be >= 0"),
    (([1.0, float("nan")],), ValueError, "finite"),
    (([1.0], 0), ValueError, "wait_us must be > 0"),
])
def test_queue_full_at_rejects_bad_input_naming_it(args, err, match):
    with pytest.raises(err, match=match):
        l03.queue_full_at(*args)


def test_plot_launch_queue_draws_and_marks_the_full_queue():
    us = [4.0] * 20 + [70_000.0] + [3.0] * 20
    ax = l03.plot_launch_queue({"launch_us": us, "full_at": l03.queue_full_at(us)}, title="t")
    assert ax.get_yscale() == "log" and any("launch 20" in t.get_text() for t in ax.get_legend().get_texts())
    ax = l03.plot_launch_queue({"launch_us": [4.0, 5.0], "full_at": None}, title="t")
    assert not any("full" in t.get_text() for t in ax.get_legend().get_texts())
    plt.close("all")
    with pytest.raises(TypeError, match="launch_queue"):
        l03.plot_launch_queue({"launch_us": []}, title="t")
    with pytest.raises(ValueError, match="full_at"):
        l03.plot_launch_queue({"launch_us": [4.0], "full_at": 3}, title="t")


def test_plot_paged_kv_draws_the_primer_and_refuses_inconsistent_metadata():
    import torch

    from pinlab import paged_kv

    meta = paged_kv.build_metadata(torch.tensor([[5, 1, 0], [2, 6, 3], [4, 0, 0]], dtype=torch.int32),
                                   torch.tensor([6, 9, 3], dtype=torch.int32), 4)
    ax = l03.plot_paged_kv(meta.indptr_cpu, meta.indices, meta.last_page_len_cpu, 4, 8, title="t")
    texts = {t.get_text() for t in ax.texts}
    assert {"indices", "indptr", "last_page_len", "page 7"} <= texts
    assert {f"[{j}]={v}" for j, v in enumerate([0, 2, 5, 6])} <= texts
    # filled token slots: 6 + 9 + 3 tokens, coloured; every one of the 8 pages has 4 slots
    slots = [p for p in ax.patches if p.get_height() == 1 and p.get_width() == 1]
    assert len(slots) == 8 * 4
    assert sum(1 for p in slots if p.get_facecolor()[:3] not in ((1.0, 1.0, 1.0), (0.92, 0.92, 0.92))) == 18
    plt.close("all")
    for bad in (dict(indptr=[0, 2, 5]), dict(indptr=[1, 2, 5, 6]), dict(indptr=[0, 3, 2, 6]),
                dict(indices=[5, 1, 2, 6, 3, 9]), dict(indices=[5, 5, 2, 6, 3, 4]), dict(last_page_len=[2, 5, 3])):
        args = dict(indptr=[0, 2, 5, 6], indices=[5, 1, 2, 6, 3, 4], last_page_len=[2, 1, 3]) | bad
        with pytest.raises(ValueError):
            l03.plot_paged_kv(args["indptr"], args["indices"], args["last_page_len"], 4, 8, title="t")
    with pytest.raises(TypeError, match="indices"):
        l03.plot_paged_kv([0, 1], [0.5], [1], 4, 8, title="t")


def test_race_audit_flags_every_racy_approach_and_no_fix_on_the_emulated_stream():
    import pinlab
    from pinlab import steploop

    audit = l03.race_audit(pinlab.LaggingStream(), steploop.HISTORY, steps=12)
    for k in ("reused_pinned", "double_pinned", "snapshot_of_pinned"):
        assert audit[k]["flagged"] == list(range(11)) and audit[k]["wrong"] == list(range(11)), k
    for k in ("pageable", "snapshot", "ring_events", "event_wait"):
        assert audit[k]["findings"] == 0 and audit[k]["wrong"] == [], k
    assert all(a["missed"] == [] for a in audit.values())
    assert "steploop.py" in audit["double_pinned"]["summary"], "the loop's own lines, not the caller's"


def test_race_audit_refuses_bad_input():
    import pinlab

    with pytest.raises(ValueError, match="no_copy"):
        l03.race_audit(pinlab.LaggingStream(), ["no_copy"])
    with pytest.raises(ValueError, match="multiple of 4"):
        l03.race_audit(pinlab.LaggingStream(), ["pageable"], nbytes=6)
    with pytest.raises(TypeError, match="pinlab stream"):
        l03.race_audit("cuda", ["pageable"])


# ---- the heisenbug (issue 45): CUDA_LAUNCH_BLOCKING=1 hides the race from timing, not from order -----------------

def test_heisenbug_a_gpu_that_keeps_up_hides_the_race_from_timing_not_from_order():
    r = l03.heisenbug_run(20)
    assert (r["wrong"], r["timing"], r["order"], r["raced"]) == (0, 0, 19, 0), r
    if not torch.cuda.is_available():
        assert "lag 0" in r["stream"] and r["launch_blocking"] is False


def test_heisenbug_runs_in_a_child_with_launch_blocking_and_refuses_bad_input():
    r = l03.heisenbug(12)
    assert (r["steps"], r["wrong"], r["timing"], r["order"]) == (12, 0, 0, 11), r
    for bad in (0, -1, 2.5, "8"):
        with pytest.raises((TypeError, ValueError), match="steps"):
            l03.heisenbug(bad)


@pytest.mark.gpu
def test_gpu_heisenbug_under_cuda_launch_blocking():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    r = l03.heisenbug(64)
    assert r["launch_blocking"] is True and "emulated" not in r["stream"], r
    assert (r["wrong"], r["timing"], r["order"]) == (0, 0, 63), r
