"""pinlab.profiler: span unions, idle shares and reading torch.profiler traces, on synthetic traces
(CPU); profile_runs refuses clearly without CUDA."""
import json
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pinlab
from pinlab import profiler
from pinlab.replay import repo_root

MiB = 1 << 20
RUN_NAMES = {"pageable": "run: pageable inputs", "pinned": "run: pinned inputs"}
PREPARE, COPY, LAUNCH = "prepare inputs (CPU)", "copy_(non_blocking=True)", "launch forward"
HOST_SPANS = (PREPARE, COPY, LAUNCH)
FORWARD = "forward (kernel)"


# ---- spans -----------------------------------------------------------------------------------------

def test_merge_spans_and_covered():
    assert profiler.merge_spans([(3, 4), (0, 1), (0.5, 2), (2, 2.5)]) == [(0, 2.5), (3, 4)]
    assert profiler.merge_spans([(0, 1, "a"), (1, 2, "b")]) == [(0, 2)]
    assert profiler.covered([(0, 2), (1, 3)], 0, 10) == 3
    assert profiler.covered([(-5, 1), (9, 20)], 0, 10) == 2
    assert profiler.idle_share([], 0, 4) == 1.0
    assert profiler.idle_share([(0, 4)], 0, 4) == 0.0
    assert profiler.idle_share([(0, 1), (0, 1)], 0, 4) == 0.75


@pytest.mark.parametrize("spans, err", [
    ([(2, 1)], ValueError), ([(0, "1")], TypeError), ([(0,)], TypeError), ("ab", TypeError),
    ([(0, float("nan"))], TypeError), ([(True, 2)], TypeError),
])
def test_spans_are_checked(spans, err):
    with pytest.raises(err):
        profiler.merge_spans(spans)


def test_window_is_checked():
    with pytest.raises(ValueError, match="end must be after start"):
        profiler.idle_share([], 3, 3)
    with pytest.raises(TypeError, match="start"):
        profiler.covered([], None, 3)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(-5, 25), st.integers(0, 8)), max_size=8), st.integers(-3, 5),
       st.integers(1, 20))
def test_idle_share_matches_brute_force(raw, start, width):
    spans = [(a, a + d) for a, d in raw]
    end = start + width
    busy_units = sum(any(a <= t < b for a, b in spans) for t in range(start, end))
    assert profiler.idle_share(spans, start, end) == pytest.approx(1 - busy_units / width)


# ---- reading a profiler trace -----------------------------------------------------------------------

def _trace(idle_gap_ms):
    """Two runs of two steps, as kineto writes them (µs), with the noise a real trace holds."""
    ev = []

    def x(cat, name, ts_ms, dur_ms, **kw):
        ev.append({"ph": "X", "cat": cat, "name": name, "ts": 1.7e15 + ts_ms * 1e3, "dur": dur_ms * 1e3,
                   "pid": 1, "tid": 1, **kw})

    t = 0.0
    for mode, gap, memcpy in (("pageable", idle_gap_ms, "Memcpy HtoD (Pageable -> Device)"),
                              ("pinned", 0.0, "Memcpy HtoD (Pinned -> Device)")):
        run0 = t
        x("user_annotation", RUN_NAMES[mode], t, 0)  # duration fixed below
        idx = len(ev) - 1
        x("gpu_user_annotation", RUN_NAMES[mode], t + 0.1, 9.0)  # the GPU-side shadow
        gpu_t = t + 0.2
        for _ in range(2):
            x("user_annotation", PREPARE, t, 1.0)
            x("cpu_op", "aten::fill_", t + 0.1, 0.5)
            x("user_annotation", COPY, t + 1.0, gap + 0.1)
            x("gpu_user_annotation", COPY, t + 1.0, 0.2)
            x("cuda_runtime", "cudaMemcpyAsync", t + 1.0, gap + 0.05)
            x("user_annotation", LAUNCH, t + 1.1 + gap, 0.02)
            gpu_t = max(gpu_t, t + 1.0 + gap)
            x("gpu_memcpy", memcpy, gpu_t, 0.2, args={"bytes": 8 * MiB})
            x("kernel", "void at::cuda::spin_kernel(long)", gpu_t + 0.2, 2.0)
            gpu_t += 2.2
            t += 1.2 + gap
        ev.append({"ph": "s", "cat": "ac2g", "name": "flow", "ts": 1.7e15 + t * 1e3, "id": 1})
        t = gpu_t + 0.1
        ev[idx]["dur"] = (t - run0) * 1e3
        t += 1.0
    x("kernel", "outside every run", t + 5.0, 1.0)
    ev.append({"ph": "M", "name": "process_name", "args": {"name": "python"}})
    return ev


def test_trace_runs_splits_runs_and_skips_gpu_shadows():
    runs = profiler.trace_runs(_trace(2.0), RUN_NAMES, HOST_SPANS, kernel_label=FORWARD)
    assert set(runs) == {"pageable", "pinned"}
    pag, pin = runs["pageable"], runs["pinned"]
    assert pag["memcpy_names"] == {"Memcpy HtoD (Pageable -> Device)": 2}
    assert pin["memcpy_names"] == {"Memcpy HtoD (Pinned -> Device)": 2}
    for run in runs.values():
        labels = [s[2] for s in run["host"]]
        assert labels.count(COPY) == 2  # the gpu_user_annotation shadows are not host spans
        assert "aten::fill_" not in labels and "cudaMemcpyAsync" not in labels
        assert [s[2] for s in run["gpu"]].count(FORWARD) == 2
        assert all(0 <= s[0] <= s[1] <= run["window_ms"] + 1e-9 for s in run["host"] + run["gpu"])
        assert run["host"] == sorted(run["host"])
    assert pag["host"][0][0] == 0.0
    assert profiler.median_span_ms(pag["host"], COPY) == pytest.approx(2.1)
    assert profiler.median_span_ms(pin["host"], COPY) == pytest.approx(0.1)
    assert profiler.median_span_ms(pin["host"], "nothing") is None
    idle_pag = profiler.gpu_kernel_idle_share(pag, FORWARD)
    idle_pin = profiler.gpu_kernel_idle_share(pin, FORWARD)
    assert idle_pin == pytest.approx(0.4 / 4.4)
    assert idle_pag > idle_pin
    json.dumps(runs)  # JSON-able, for pinlab.measure


def test_trace_runs_tolerates_a_small_gpu_clock_skew():
    ev = [
        {"ph": "X", "cat": "user_annotation", "name": "run: a", "ts": 0, "dur": 10_000},
        {"ph": "X", "cat": "user_annotation", "name": "run: b", "ts": 30_000, "dur": 10_000},
        {"ph": "X", "cat": "kernel", "name": "k", "ts": 9_000, "dur": 2_000},      # inside a
        {"ph": "X", "cat": "kernel", "name": "k", "ts": 12_000, "dur": 1_000},     # 2 ms after a: a
        {"ph": "X", "cat": "kernel", "name": "k", "ts": 27_000, "dur": 1_000},     # 3 ms before b: b
        {"ph": "X", "cat": "kernel", "name": "k", "ts": 20_000, "dur": 1_000},     # 10 ms from both: dropped
    ]
    runs = profiler.trace_runs(ev, {"a": "run: a", "b": "run: b"}, ())
    assert runs["a"]["gpu"] == [[9.0, 11.0, "kernel"], [12.0, 13.0, "kernel"]]
    assert runs["b"]["gpu"] == [[-3.0, -2.0, "kernel"]]
    strict = profiler.trace_runs(ev, {"a": "run: a", "b": "run: b"}, (), gpu_skew_ms=0)
    assert len(strict["a"]["gpu"]) == 1 and strict["b"]["gpu"] == []


def test_trace_runs_needs_its_annotations():
    with pytest.raises(ValueError, match="run: pinned inputs"):
        profiler.trace_runs(_trace(0)[:5], RUN_NAMES, HOST_SPANS)
    with pytest.raises(TypeError, match="run_names"):
        profiler.trace_runs([], {}, HOST_SPANS)
    with pytest.raises(TypeError, match="events"):
        profiler.trace_runs("trace.json", RUN_NAMES, HOST_SPANS)


def test_gpu_kernel_idle_share_edge_cases():
    assert profiler.gpu_kernel_idle_share({"gpu": []}) is None
    assert profiler.gpu_kernel_idle_share({"gpu": [[0, 1, "kernel"], [1, 2, "Memcpy"]]}) == 0.5
    with pytest.raises(TypeError):
        profiler.gpu_kernel_idle_share([])


def test_load_trace_events(tmp_path):
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"traceEvents": [{"ph": "X"}, 3], "displayTimeUnit": "ms"}))
    assert profiler.load_trace_events(p) == [{"ph": "X"}]
    p.write_text(json.dumps([{"ph": "X"}]))
    assert profiler.load_trace_events(p) == [{"ph": "X"}]
    p.write_text(json.dumps({"traceEvents": 3}))
    with pytest.raises(ValueError):
        profiler.load_trace_events(p)
    p.write_text("{not json")
    with pytest.raises(ValueError):
        profiler.load_trace_events(p)


def test_events_from_profiler_fallback():
    cuda = torch.autograd.DeviceType.CUDA
    cpu = torch.autograd.DeviceType.CPU

    def fe(name, start, end, dev):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), device_type=dev)

    prof = SimpleNamespace(events=lambda: [
        fe(RUN_NAMES["pageable"], 0, 100, cpu), fe(RUN_NAMES["pageable"], 1, 90, cuda),
        fe(COPY, 10, 20, cpu), fe("Memcpy HtoD (Pageable -> Device)", 15, 30, cuda),
        fe("spin_kernel", 30, 80, cuda), fe("Memset (Device)", 80, 81, cuda),
    ])
    names = set(RUN_NAMES.values()) | set(HOST_SPANS)
    events = profiler.events_from_profiler(prof, names)
    assert [e["cat"] for e in events] == ["user_annotation", "gpu_user_annotation", "user_annotation",
                                          "gpu_memcpy", "kernel", "gpu_memset"]
    run = profiler.trace_runs(events, {"pageable": RUN_NAMES["pageable"]}, HOST_SPANS)["pageable"]
    assert run["host"] == [[0.01, 0.02, COPY]]
    assert [g[2] for g in run["gpu"]] == ["Memcpy HtoD (Pageable -> Device)", "kernel", "Memset (Device)"]


def test_trace_path():
    assert profiler.trace_path("build/traces/02_step_loop.json") == repo_root() / "build" / "traces" / "02_step_loop.json"
    for bad in ("/tmp/x.json", "../x.json", "build/x.txt", "build/../../x.json"):
        with pytest.raises(ValueError, match="relative path"):
            profiler.trace_path(bad)
    with pytest.raises(TypeError):
        profiler.trace_path(None)


def test_merge_spans_merges_touching_spans():
    assert profiler.merge_spans([(1, 2), (2, 3)]) == [(1, 3)]
    assert profiler.merge_spans([(2, 3), (0, 1), (1, 2)]) == [(0, 3)]
    assert profiler.idle_share([(1, 2), (2, 3)], 0, 4) == pytest.approx(0.5)


def test_span_stats():
    gpu = [[4.0, 6.0, "k"], [0.0, 2.0, "k"], [2.0, 2.5, "copy"], [2.5, 4.0, "copy"], [6.5, 8.0, "k"]]
    k = profiler.span_stats(gpu, "k")
    assert k["n"] == 3
    assert k["duration_ms"] == pytest.approx(2.0)
    assert k["period_ms"] == pytest.approx(3.25)  # starts 0, 4, 6.5
    assert k["gap_ms"] == pytest.approx(1.25)  # gaps 2.0 and 0.5
    one = profiler.span_stats([[1.0, 3.0, "x"]], "x")
    assert one == {"n": 1, "duration_ms": 2.0, "period_ms": None, "gap_ms": None}
    assert profiler.span_stats(gpu, "none") is None
    assert profiler.span_stats([(0.0, 1.0)], "x") is None  # unlabelled spans never match
    assert profiler.median_span_ms(gpu, "copy") == pytest.approx(1.0)
    with pytest.raises(ValueError):
        profiler.span_stats([[2.0, 1.0, "x"]], "x")


def test_profile_runs_checks_arguments_and_needs_cuda(monkeypatch):
    monkeypatch.setenv("PINLAB_FORCE_CPU", "1")
    with pytest.raises(TypeError, match="runs"):
        profiler.profile_runs({}, "build/traces/x.json")
    with pytest.raises(TypeError, match="runs"):
        profiler.profile_runs({"a": 3}, "build/traces/x.json")
    with pytest.raises(ValueError, match="relative path"):
        profiler.profile_runs({"a": lambda span: None}, "/tmp/x.json")
    with pytest.raises(pinlab.CudaUnavailableError, match="profile_runs"):
        profiler.profile_runs({"a": lambda span: None}, "build/traces/x.json")
