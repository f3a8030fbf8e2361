"""tools/bench_races.py on the emulated stream: each section is written as it ends, so a run stopped by a timeout
(as on the H200 in December, where a run that printed nothing until its end lost everything) keeps what it
measured; --budget starts no section late; bad sizes are refused by name."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = [sys.executable, str(ROOT / "tools" / "bench_races.py")]


@pytest.mark.slow
def test_a_budget_keeps_the_sections_done_and_names_the_rest(tmp_path):
    """--budget 0.001: the first section starts whatever the set-up took (under load, CI's two runs at once spent
    more than 1 ms before it and ran none), and no other."""
    out = tmp_path / "b.json"
    r = subprocess.run(BENCH + ["--steps", "20", "--overhead-steps", "10", "--rounds", "1", "--verdict", "order",
                                "--budget", "0.001", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["complete"] is False and list(res["verdicts"]["order"]) == ["recall", "seconds"], res.get("left")
    assert res["left"] == ["order/graph", "order/deferred_stop", "order/overhead",
                           "order/flashinfer_shared_wrapper"] + [
        f"order+copies/{k}" for k in ("recall", "graph", "deferred_stop", "overhead", "flashinfer_shared_wrapper")]
    assert "order  recall ..." in r.stdout and "--budget 0 s spent: not started order/graph" in r.stdout
    assert not out.with_name(out.name + ".tmp").exists()


@pytest.mark.parametrize("arg,value", [("--steps", "0"), ("--overhead-steps", "-1"), ("--rounds", "0"),
                                       ("--budget", "0"), ("--watch", "all")])
def test_bad_sizes_are_refused_by_name(arg, value):
    r = subprocess.run(BENCH + [arg, value], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and arg in r.stderr, r.stderr[-1000:]


def test_the_timing_verdict_watching_copies_only_is_refused():
    r = subprocess.run(BENCH + ["--verdict", "timing", "--watch", "copies"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--verdict timing watches every op" in r.stderr, r.stderr[-1000:]


def test_profile_says_where_the_detector_spends_per_copy_and_per_step():
    """--profile (stop 62: a followed copy cost 73-112 µs on an H100, 7-50 µs on the emulated stream): the
    functions of most own time, per followed copy and per step of the snapshot loop, with pinlab's among them."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import bench_races
    finally:
        sys.path.remove(str(ROOT / "tools"))
    out = bench_races.profile(20, n=50)
    assert set(out) == {"copies", "snapshot_loop"}
    assert out["copies"]["per"] == 50 and out["snapshot_loop"]["per"] == 20
    for part in out.values():
        assert part["us_per_unit_profiled"] > 0 and 0 < len(part["top"]) <= 20
        assert all(len(row) == 4 and row[1] >= 1 and row[2] >= 0 and row[3] >= row[2] for row in part["top"])
        assert any(row[0].startswith(("races.py", "order.py")) for row in part["top"]), part["top"]


def test_sections_runs_only_those_named_and_refuses_unknown_names(tmp_path):
    out = tmp_path / "b.json"
    r = subprocess.run(BENCH + ["--verdict", "order", "--watch", "copies", "--sections", "graph", "--steps", "20",
                                "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["complete"] and list(res["verdicts"]["order+copies"]) == ["graph", "seconds"]
    r = subprocess.run(BENCH + ["--sections", "recall,bogus"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--sections: unknown bogus; choose from recall" in r.stderr and "profile" in r.stderr


def test_the_marks_section_runs_by_name_only_and_says_when_it_cannot(tmp_path):
    """--sections marks (a CUDA microbenchmark of a followed copy's mark) is not among the default sections; on a
    machine without CUDA it says so in the JSON instead of measuring the emulated stream."""
    out = tmp_path / "m.json"
    r = subprocess.run(BENCH + ["--sections", "marks", "--verdict", "order", "--watch", "copies", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    marks = res["verdicts"]["order+copies"]["marks"]
    if "skipped" in marks:
        assert marks == {"skipped": "needs CUDA"}
    else:
        assert {"trace_on", "in_order_detector"} <= set(marks) and marks["n"] == 2000
