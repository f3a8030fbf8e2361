"""CPU tests for lesson 04's experiments (pinlab.lessons.l04_the_fix): CUDA is required unless a
stream is given, the experiments run on the emulated lagging stream, the plan-hazard and soak
children report their outcome as data, the metadata harness catches a race (with the notebook's
own slab ring), and the plots draw from a result."""
from __future__ import annotations

import inspect
import json
import math
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

import nbtools  # noqa: E402
import pinlab  # noqa: E402
import torch  # noqa: E402

from pinlab import CudaUnavailableError, steploop  # noqa: E402
from pinlab.lessons import l04_the_fix as l04  # noqa: E402

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "src" / "04_the_fix.py"


# the SlabRing class as the notebook defines it (its cell, executed here)
SlabRing = nbtools.load_definition(NOTEBOOK, "SlabRing", {"torch": torch})


class UnguardedSlabRing(SlabRing):
    """The same ring without its event wait: a planted bug the harness must catch."""

    def host(self):
        self.k = (self.k + 1) % len(self.slabs)
        return self.host_views[self.k]

CORRECT = ("pageable", "snapshot", "ring_events", "event_wait")
RACY = ("reused_pinned", "double_pinned", "snapshot_of_pinned")


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setenv("PINLAB_FORCE_CPU", "1")


GPU_CALLS = [
    ("snapshot_soak()", lambda: l04.snapshot_soak()),
    ("fix_race()", lambda: l04.fix_race(SlabRing)),
    ("shared_pool()", lambda: l04.shared_pool()),
    ("metadata_loop()", lambda: l04.metadata_loop(None, SlabRing, steps=4, sizes=[4], busy_ms=0.1)),
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
    with pytest.raises(ValueError, match="run_ahead"):
        l04.allocator_reuse(run_ahead=-1)


def test_metadata_loop_counts_races_on_the_lagging_stream():
    s, sizes = pinlab.LaggingStream(), [257, 64, 3]
    runs = {k: l04.metadata_loop(s, lambda st, sz, k=k: l04.PerTensor(st, sz, k), steps=40, sizes=sizes,
                                 busy_ms=0.3, run_ahead=1) for k in l04.PER_TENSOR}
    assert runs["reused_pinned"]["corrupted"] == 39  # step n's copies wait behind step n+1's write, but the last
    assert runs["pageable"]["corrupted"] == 0 and runs["snapshot"]["corrupted"] == 0
    for depth in (1, 2, 3):  # too shallow a ring waits (the events), it never races
        ring = l04.metadata_loop(s, lambda st, sz, d=depth: SlabRing(st, sz, d), steps=40, sizes=sizes, busy_ms=0.3,
                                 run_ahead=1)
        assert ring["corrupted"] == 0 and ring["steps"] == 40
    bad = l04.metadata_loop(s, lambda st, sz: UnguardedSlabRing(st, sz, 1), steps=40, sizes=sizes, busy_ms=0.3,
                            run_ahead=1)
    assert bad["corrupted"] >= 1
    assert set(runs["pageable"]["host"]) == {"median_us", "mean_us", "p90_us", "max_us"}
    json.dumps(runs)


def test_metadata_loop_bad_input_is_named():
    s = pinlab.LaggingStream()
    with pytest.raises(TypeError, match="make"):
        l04.metadata_loop(s, "SlabRing", steps=4, sizes=[4], busy_ms=0.1)
    with pytest.raises(TypeError, match="make"):
        l04.metadata_loop(s, lambda st, sz: object(), steps=4, sizes=[4], busy_ms=0.1)
    with pytest.raises(ValueError, match="sizes"):
        l04.metadata_loop(s, SlabRing, steps=4, sizes=[], busy_ms=0.1)
    with pytest.raises(ValueError, match=r"sizes\[1\]"):
        l04.metadata_loop(s, SlabRing, steps=4, sizes=[4, 0], busy_ms=0.1)
    with pytest.raises(TypeError, match="sizes"):
        l04.metadata_loop(s, SlabRing, steps=4, sizes=4096, busy_ms=0.1)
    with pytest.raises(ValueError, match="steps"):
        l04.metadata_loop(s, SlabRing, steps=0, sizes=[4], busy_ms=0.1)
    with pytest.raises(ValueError, match="run_ahead"):
        l04.metadata_loop(s, SlabRing, steps=4, sizes=[4], busy_ms=0.1, run_ahead=-1)
    with pytest.raises(TypeError, match="stream"):
        l04.metadata_loop("cuda", SlabRing, steps=4, sizes=[4], busy_ms=0.1)
    with pytest.raises(ValueError, match="one host and one device tensor per size"):
        l04.metadata_loop(s, lambda st, sz: SlabRing(st, sz[:1]), steps=4, sizes=[4, 8], busy_ms=0.1)
    with pytest.raises(ValueError, match="kind"):
        l04.PerTensor(s, [4], "ring")


def test_fix_race_on_the_lagging_stream():
    res = l04.fix_race(SlabRing, steps=50, sizes=[257, 300, 16], busy_ms=0.3, run_ahead=1, depth=3, rounds=3,
                       stream=pinlab.LaggingStream())
    rows = {r["strategy"]: r for r in res["rows"]}
    assert list(rows) == ["reused_pinned", "pageable", "snapshot", "slab_ring"]
    assert all(r["steps"] == 50 and len(r["round_medians_us"]) == 3 for r in rows.values())
    assert sum(rows["reused_pinned"]["hist"]["counts"]) == 50
    assert rows["reused_pinned"]["corrupted"] >= 1
    assert all(rows[k]["corrupted"] == 0 for k in ("pageable", "snapshot", "slab_ring"))
    assert rows["slab_ring"]["p10_us"] <= rows["slab_ring"]["p50_us"] <= rows["slab_ring"]["max_us"]
    assert res["bytes_per_step"] == 4 * (257 + 300 + 16)
    json.dumps(res)
    a1, a2 = l04.plot_host_times(res, title="t")
    # one colour per approach in both panels: each bar has its histogram's colour
    lines = {p.get_label(): matplotlib.colors.to_hex(p.get_edgecolor()) for p in a1.patches}
    bars = [matplotlib.colors.to_hex(p.get_facecolor()) for p in a2.patches]
    assert bars == [lines[r["label"]] for r in res["rows"]]
    plt.close("all")


def test_fix_race_and_shared_pool_check_arguments_before_cuda(no_cuda):
    with pytest.raises(TypeError, match="make_slab"):
        l04.fix_race(None)
    with pytest.raises(ValueError, match="rounds"):
        l04.fix_race(SlabRing, steps=10, rounds=11)
    with pytest.raises(ValueError, match="depth"):
        l04.fix_race(SlabRing, depth=0)
    with pytest.raises(ValueError, match=r"totals\[0\]"):
        l04.shared_pool(totals=[100])
    with pytest.raises(ValueError, match="tensors"):
        l04.shared_pool(tensors=0)
    with pytest.raises(ValueError, match="warm_blocks"):
        l04.snapshot_soak(warm_blocks=0)
    with pytest.raises(ValueError, match="reserve_mb"):
        l04.snapshot_soak(reserve_mb=0)


def test_shared_pool_on_the_lagging_stream():
    res = l04.shared_pool(totals=[24 * 1024, 3 * 1024 * 1024], tensors=6, steps=6, busy_ms=0.5, run_ahead=1, rounds=2,
                          stream=pinlab.LaggingStream())
    assert [r["total_bytes"] for r in res["rows"]] == [24 * 1024, 3 * 1024 * 1024]
    assert [r["tensor_bytes"] for r in res["rows"]] == [4096, 512 * 1024]
    assert all(r["corrupted"] == 0 and r["pageable_us"] > 0 and r["snapshot_us"] > 0 for r in res["rows"])
    json.dumps(res)
    l04.plot_shared_pool(res, title="t")
    plt.close("all")


def test_log_histogram():
    h = l04.log_histogram([0.5, 1.0, 1.5, 10.0, 99.0, 1e6], lo=1.0, hi=100.0, per_decade=2)
    assert len(h["edges"]) == 5 and len(h["counts"]) == 4 and sum(h["counts"]) == 6
    assert h["counts"] == [3, 0, 1, 2]  # below lo -> first bin, above hi -> last bin
    with pytest.raises(ValueError, match="lo"):
        l04.log_histogram([1.0], lo=0)
    with pytest.raises(ValueError, match="hi"):
        l04.log_histogram([1.0], lo=10, hi=5)
    with pytest.raises(ValueError, match="finite"):
        l04.log_histogram([float("nan")])


def test_plot_soak_draws():
    def summary(us):
        return {"max_us": max(us), "hist": l04.log_histogram(us)}
    res = {"passes": {"cold": summary([30.0, 40.0, 1500.0]), "warmed": summary([30.0, 31.0])}}
    l04.plot_soak(res, title="t")
    plt.close("all")


@pytest.mark.slow
def test_soak_child_reports_no_cuda_as_data(no_cuda):
    code = l04.soak_child_code(["cold", "warmed"], 10, 4096, 0.1, 4)
    assert "_soak_child(['cold', 'warmed'], 10, 4096, 0.1, 4, wait_for_go=True)" in code
    res = l04.run_children({"default": code}, timeout_s=120)["default"]
    assert res["outcome"] == "unavailable" and res["returncode"] == 0


@pytest.mark.slow
def test_run_children_gives_each_child_its_environment(monkeypatch):
    monkeypatch.setenv("PINLAB_T_GONE", "parent")
    tag = "PINLAB_CHILD "
    show = ("import json, os, sys\nsys.stdin.readline()\n"
            f"print({tag!r} + json.dumps({{'status': 'correct', 'detail': 'x', "
            "'a': os.environ.get('PINLAB_T_A'), 'gone': os.environ.get('PINLAB_T_GONE')}), flush=True)\n")
    out = l04.run_children({"plain": show, "set": show}, timeout_s=30,
                           envs={"set": {"PINLAB_T_A": "pinned_reserve_segment_size_mb:64", "PINLAB_T_GONE": None}})
    assert out["plain"]["a"] is None and out["plain"]["gone"] == "parent"
    assert out["set"]["a"] == "pinned_reserve_segment_size_mb:64" and out["set"]["gone"] is None
    ready = ("import json, os, sys, time, pathlib\ntime.sleep(1.0)\nt = time.time()\n"
             "pathlib.Path(os.environ['PINLAB_READY_FILE']).touch()\n"
             f"sys.stdin.readline()\nprint({tag!r} + json.dumps({{'status': 'correct', 'detail': 'x', "
             "'ready_at': t}))\n")
    quick = ("import json, os, pathlib, sys, time\n"
             "os.environ.get('PINLAB_READY_FILE') and pathlib.Path(os.environ['PINLAB_READY_FILE']).touch()\n"
             f"sys.stdin.readline()\nprint({tag!r} + json.dumps({{'status': 'correct', 'detail': 'x', "
             "'go': time.time()}))\n")
    both = l04.run_children({"quick": quick, "slow_set_up": ready}, timeout_s=30, ready_timeout_s=30)
    assert both["quick"]["outcome"] == "correct" and both["slow_set_up"]["outcome"] == "correct"
    assert both["quick"]["go"] >= both["slow_set_up"]["ready_at"]  # told to go only once every set-up was done
    t0 = time.time()
    nosetup = l04.run_children({"quick": quick, "never_ready": "import time\ntime.sleep(30)\n"}, timeout_s=0.5,
                               ready_timeout_s=1.0)
    # still setting up at the deadline: killed without a go, reported as not tested (never "hung")
    assert nosetup["never_ready"]["outcome"] == "unavailable" and "set-up" in nosetup["never_ready"]["detail"]
    assert nosetup["quick"]["outcome"] == "correct" and time.time() - t0 < 10
    with pytest.raises(ValueError, match="envs"):
        l04.run_children({"plain": show}, timeout_s=5, envs={"other": {}})
    with pytest.raises(TypeError, match="codes"):
        l04.run_children({}, timeout_s=5)


@pytest.mark.slow
def test_run_children_starts_the_time_limit_only_after_the_set_up():
    """A child whose set-up (2 s here; importing torch, CUDA and a JIT build in the plan hazard) is
    longer than its time limit still gets the whole limit for its test."""
    tag = "PINLAB_CHILD "
    slow = ("import json, os, pathlib, sys, time\ntime.sleep(2.0)\n"
            "pathlib.Path(os.environ['PINLAB_READY_FILE']).touch()\n"
            "sys.stdin.readline()\ntime.sleep(0.3)\n"
            f"print({tag!r} + json.dumps({{'status': 'correct', 'detail': 'x'}}), flush=True)\n")
    out = l04.run_children({"a": slow, "b": slow}, timeout_s=1.5, ready_timeout_s=30)
    assert out["a"]["outcome"] == "correct" and out["b"]["outcome"] == "correct"
    assert out["a"]["seconds"] < 1.5 and out["b"]["seconds"] < 1.5  # counted from the go, not from the start
    # without the ready protocol the same child is killed at its time limit, inside its set-up
    late = l04.run_children({"a": slow.replace("pathlib.Path(os.environ['PINLAB_READY_FILE']).touch()\n", "")},
                            timeout_s=1.0)
    assert late["a"]["outcome"] == "hung"


def test_run_children_a_chatty_set_up_cannot_block_on_its_output():
    """A child that writes far more than a pipe holds (a JIT build's log) before it is ready still gets
    ready: its output goes to a file the parent reads at the end."""
    tag = "PINLAB_CHILD "
    chatty = ("import json, os, pathlib, sys\n"
              "sys.stderr.write('x' * 300_000); sys.stdout.write('y' * 300_000 + '\\n'); sys.stdout.flush()\n"
              "pathlib.Path(os.environ['PINLAB_READY_FILE']).touch()\nsys.stdin.readline()\n"
              f"print({tag!r} + json.dumps({{'status': 'correct', 'detail': 'x'}}), flush=True)\n")
    out = l04.run_children({"a": chatty, "b": chatty}, timeout_s=10, ready_timeout_s=10)
    assert out["a"]["outcome"] == "correct" and out["b"]["outcome"] == "correct"
    dies = "import sys\nsys.stderr.write('noise\\n' * 50_000 + 'RuntimeError: the last line')\n"
    assert l04.run_children({"d": dies}, timeout_s=10)["d"]["detail"] == "RuntimeError: the last line"


def test_the_plan_hazard_child_says_it_is_ready_after_its_set_up_and_before_its_go():
    src = inspect.getsource(l04._plan_hazard_child)
    setup_done = src.index("torch.cuda.synchronize()")  # the warm plan+run has finished
    ready = src.index('Path(os.environ["PINLAB_READY_FILE"]).touch()')
    go = src.index("sys.stdin.readline()")
    hazard = src.index("gpu_busy(busy_ms)")
    assert setup_done < ready < go < hazard


def test_plan_hazard_gives_its_children_a_start_up_limit_apart_from_the_time_limit(monkeypatch):
    seen = {}

    def fake_run_children(codes, timeout_s, envs=None, ready_timeout_s=None):
        seen.update(codes=codes, timeout_s=timeout_s, ready_timeout_s=ready_timeout_s)
        return {m: {"outcome": "correct", "detail": "ok", "seconds": 0.1, "returncode": 0} for m in codes}

    import pinlab.paged_kv as paged_kv
    monkeypatch.setattr(l04, "require_cuda", lambda what: None)
    monkeypatch.setattr(paged_kv, "flashinfer_available", lambda: (True, ""))
    monkeypatch.setattr(l04, "run_children", fake_run_children)
    monkeypatch.setattr(l04, "_context_ok", lambda: True)
    out = l04.plan_hazard(timeout_s=12.0, watchdog_s=3.0, startup_s=250.0)
    assert seen["timeout_s"] == 12.0 and seen["ready_timeout_s"] == 250.0
    assert list(seen["codes"]) == ["synced", "back_to_back"]
    assert all("wait_for_go=True" in c for c in seen["codes"].values())
    assert out["synced"]["outcome"] == "correct" and out["parent_context_ok"] and out["timeout_s"] == 12.0
    with pytest.raises(ValueError, match="startup_s"):
        l04.plan_hazard(startup_s=0)


def test_snapshot_cost_on_the_lagging_stream():
    cost = l04.snapshot_cost(sizes=[1024, 4096], steps=30, busy_ms=0.1, run_ahead=1, rounds=3,
                             stream=pinlab.LaggingStream())
    assert [r["nbytes"] for r in cost["rows"]] == [1024, 4096] and cost["rounds"] == 3
    for r in cost["rows"]:
        assert r["snapshot_corrupted"] == 0
        assert math.isclose(r["snapshot_extra_us"], r["snapshot_us"] - r["reused_pinned_us"], abs_tol=0.011)
        assert math.isclose(r["copy_total_us"], r["snapshot_us"] - r["no_copy_us"], abs_tol=0.011)


def test_allocator_reuse_on_the_lagging_stream():
    a = l04.allocator_reuse(nbytes=256, busy_ms=5.0, steps=40, run_ahead=3, stream=pinlab.LaggingStream())
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
    hist = l04.history(strategies=steploop.HISTORY, steps=25, nbytes=256, busy_ms=0.3, run_ahead=1, ring_depth=3,
                       rounds=3, stream=pinlab.LaggingStream())
    rows = {r["strategy"]: r for r in hist["rows"]}
    assert list(rows) == steploop.HISTORY
    assert all(rows[s]["corrupted"] == 0 for s in CORRECT) and all(rows[s]["corrupted"] > 0 for s in RACY)
    assert rows["pageable"]["pinned_bytes_held"] == 0 and rows["snapshot"]["label"] == steploop.LABELS["snapshot"]
    # interleaved rounds: 25 steps per approach as 9 + 8 + 8, one median per round, the row's value their median
    assert hist["rounds"] == 3 and len(hist["no_copy_round_medians_us"]) == 3
    for r in rows.values():
        assert r["steps"] == 25 and len(r["round_medians_us"]) == 3
        assert r["host_us"] == round(sorted(r["round_medians_us"])[1], 2)
        assert math.isclose(r["host_extra_us"], r["host_us"] - hist["no_copy_us"], abs_tol=0.011)
    json.dumps(hist)


def test_history_runs_the_approaches_round_robin(monkeypatch):
    order = []
    real = steploop.plain_loop

    def spy(stream, strategy, **kw):
        order.append((strategy, kw["steps"]))
        return real(stream, strategy, **kw)

    monkeypatch.setattr(steploop, "plain_loop", spy)
    l04.history(strategies=["pageable", "snapshot"], steps=7, nbytes=64, busy_ms=0.1, run_ahead=1, rounds=3,
                stream=pinlab.LaggingStream())
    measured = order[-9:]  # after the warm-up: 3 rounds of 3 approaches, the order rotating each round
    assert [s for s, _ in measured] == ["no_copy", "pageable", "snapshot", "pageable", "snapshot", "no_copy",
                                        "snapshot", "no_copy", "pageable"]
    assert [n for _, n in measured] == [3, 3, 3, 2, 2, 2, 2, 2, 2]
    with pytest.raises(ValueError, match="rounds"):
        l04.history(steps=4, rounds=5, stream=pinlab.LaggingStream())


def test_classify_child():
    ok = l04.classify_child(0, 'x\nPINLAB_CHILD {"status": "correct", "detail": "fine", "err_a": 0.001}\n', "", False)
    assert ok == {"outcome": "correct", "detail": "fine", "err_a": 0.001}
    assert l04.classify_child(None, "", "", True)["outcome"] == "hung"
    hung = l04.classify_child(0, 'PINLAB_CHILD {"status": "hung", "detail": "not finished"}\n', "", False)
    assert hung == {"outcome": "hung", "detail": "not finished"}
    dead = l04.classify_child(-6, "", "...\nRuntimeError: CUDA error: an illegal memory access was encountered\n", False)
    assert dead["outcome"] == "crashed" and "illegal memory access" in dead["detail"]
    assert l04.classify_child(1, "", "", False)["detail"].startswith("exit status 1")
    assert l04.classify_child(0, "PINLAB_CHILD {bad json", "boom", False)["outcome"] == "crashed"


@pytest.mark.slow
def test_child_process_runs_and_reports(no_cuda):
    code = l04.child_code("synced", 1.0, 0, 0.02)
    assert "from pinlab.lessons import l04_the_fix" in code and "wait_for_go=True" in code
    res = l04.run_children({"synced": code}, timeout_s=120)["synced"]
    assert res["outcome"] == "unavailable" and res["returncode"] == 0  # no GPU here, reported as data


@pytest.mark.slow
def test_run_children_one_at_a_time_after_a_shared_set_up():
    tag = "PINLAB_CHILD "
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


class _FakeWrapper:
    """FlashInfer's decode wrapper as far as the plan hazard uses it: plan() writes its plan info into ONE
    pinned workspace (outside torch, as its C++ planner does) and queues the copy on the stream."""

    def __init__(self, stream):
        self.s = stream
        self._pin_memory_int_workspace_buffer = torch.zeros(4096, dtype=torch.uint8, pin_memory=True)
        self.plans = 0


class _FakeDecode:
    def __init__(self, stream, *args):
        self.wrapper = _FakeWrapper(stream)

    def plan(self, indptr, indices, last_page_len):
        w = self.wrapper
        w.plans += 1
        w._pin_memory_int_workspace_buffer.numpy()[: int(indptr[-1]) + 1] = w.plans
        w.s.launch(lambda: None)  # the planner's cudaMemcpyAsync of the plan info

    def run(self, q, k, v):
        return torch.zeros(2, 2)


@pytest.mark.parametrize("mode, flagged", [("back_to_back", 1), ("two_wrappers", 0), ("event_wait", 0),
                                           ("synced", 0)])
def test_the_plan_hazard_child_declares_the_staging_and_flags_only_the_shared_workspace(monkeypatch, mode, flagged):
    """The child's own logic on the emulated stream (FlashInfer faked as above; the GPU run is lesson 09's):
    with races=True each plan()'s copy is declared, and only one wrapper re-planned while its copy is queued
    is a finding."""
    s = pinlab.LaggingStream()

    class Event:
        def record(self):
            self.e = s.record_event()

        def synchronize(self):
            self.e.synchronize()

    meta = type("M", (), {"indptr_cpu": torch.tensor([0, 3]), "indices": None, "last_page_len_cpu": None})()
    batch = type("B", (), {"q": None, "k_cache": None, "v_cache": None, "seq_lens": torch.tensor([3]),
                           "block_table": None})()
    monkeypatch.setattr(l04, "FlashInferDecode", lambda *a: _FakeDecode(s, *a))
    monkeypatch.setattr(l04, "random_batch", lambda *a, **k: batch)
    monkeypatch.setattr(l04, "build_metadata", lambda *a, **k: meta)
    monkeypatch.setattr(l04, "reference_decode", lambda *a, **k: torch.zeros(2, 2))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: s.synchronize())
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr("pinlab.busy.gpu_busy", lambda ms: s.busy(ms))
    monkeypatch.delenv("PINLAB_READY_FILE", raising=False)
    with s:
        r = l04._plan_hazard_child(mode, 50.0, 0, 0.02, watchdog_s=30.0, races=True)
    assert r["status"] == "correct", r
    assert r["races"] - r["races_elsewhere"] == flagged and r["races_elsewhere"] == 0, r
