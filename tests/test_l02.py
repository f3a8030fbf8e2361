"""Lesson 02's library (pinlab.stalls): the pure post-processing, argument checks, and that every
GPU experiment refuses clearly without CUDA. Runs on a CPU."""
import json
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pinlab
from pinlab.lessons import l02_fake_non_blocking as stalls
from pinlab.detector import FACTORY_SYNC, ITEM_SYNC, PAGEABLE_H2D, detect_stalls
from pinlab.replay import repo_root

KiB, MiB = stalls.KiB, stalls.MiB


# ---- sizes and "waited" --------------------------------------------------------------------------

def test_sweep_sizes_cover_256_bytes_to_64_mib_with_a_fine_grid():
    s = stalls.SWEEP_SIZES
    assert s == sorted(set(s))
    assert s[0] == 256 and s[-1] == 64 * MiB
    for fine in (1.25, 1.5, 2, 2.5, 3, 3.5, 4):
        assert int(fine * MiB) in s


def test_waited_is_more_than_half_the_busy_time():
    assert stalls.waited(5.01, 10.0) is True
    assert stalls.waited(5.0, 10.0) is False
    assert stalls.waited(0.0, 10.0) is False
    with pytest.raises(ValueError, match="busy_ms"):
        stalls.waited(1.0, 0)
    with pytest.raises(TypeError, match="host_ms"):
        stalls.waited("1", 10.0)


# ---- thresholds -----------------------------------------------------------------------------------

def test_first_waiting_size_h200_shape():
    sizes = [256 << i for i in range(19)]
    ms = [0.01] * 13 + [0.24, 10.3, 10.7, 11.6, 13.6, 17.3]
    assert stalls.first_waiting_size(sizes, ms, 5.0) == 4 * MiB


def test_first_waiting_size_ignores_a_stray_slow_small_copy():
    assert stalls.first_waiting_size([1, 2, 4, 8, 16], [0.1, 9.0, 0.1, 9.0, 9.0], 5.0) == 8


def test_first_waiting_size_unsorted_none_and_all():
    assert stalls.first_waiting_size([4096, 1024, 65536, 2048], [12, 0.1, 15, 0.2], 5.0) == 4096
    assert stalls.first_waiting_size([1, 2, 3], [0.1, 20.0, 0.1], 5.0) is None
    assert stalls.first_waiting_size([1, 2], [6.0, 7.0], 5.0) == 1
    assert stalls.first_waiting_size([1, 2], [5.0, 7.0], 5.0) == 2  # exactly the limit: not waiting


@pytest.mark.parametrize("args, err, match", [
    (([1, 2], [1.0], 5.0), ValueError, "host_ms must have 2"),
    (([1, 1], [1.0, 2.0], 5.0), ValueError, "repeat"),
    (([], [], 5.0), ValueError, "sizes must not be empty"),
    (([1, 2], [1.0, -2.0], 5.0), ValueError, r"host_ms\[1\]"),
    (([1, 2], "12", 5.0), TypeError, "host_ms"),
    (([1, 2], [1.0, 2.0], 0), ValueError, "limit_ms"),
    (([1.5, 2], [1.0, 2.0], 5.0), TypeError, r"sizes\[0\]"),
])
def test_first_waiting_size_rejects_bad_arguments(args, err, match):
    with pytest.raises(err, match=match):
        stalls.first_waiting_size(*args)


def test_first_blocking_index_and_pending_bytes():
    ms = [0.01, 0.02, 0.01, 48.0, 0.02, 0.01]
    assert stalls.first_blocking_index(ms, 25.0) == 3
    assert stalls.pending_bytes_at_block(ms, 64 * KiB, 25.0) == 3 * 64 * KiB
    assert stalls.first_blocking_index([0.1, 0.2], 25.0) is None
    assert stalls.pending_bytes_at_block([0.1, 0.2], 64 * KiB, 25.0) is None
    assert stalls.pending_bytes_at_block([30.0], 64 * KiB, 25.0) == 0
    with pytest.raises(ValueError, match="chunk_bytes"):
        stalls.pending_bytes_at_block(ms, 0, 25.0)


def test_cumulative():
    assert stalls.cumulative([1.0, 2.0, 0.5]) == [1.0, 3.0, 3.5]
    assert stalls.cumulative([]) == []
    with pytest.raises(TypeError):
        stalls.cumulative(3)


# ---- spans -----------------------------------------------------------------------------------------

def test_merge_spans_and_covered():
    assert stalls.merge_spans([(3, 4), (0, 1), (0.5, 2), (2, 2.5)]) == [(0, 2.5), (3, 4)]
    assert stalls.merge_spans([(0, 1, "a"), (1, 2, "b")]) == [(0, 2)]
    assert stalls.covered([(0, 2), (1, 3)], 0, 10) == 3
    assert stalls.covered([(-5, 1), (9, 20)], 0, 10) == 2
    assert stalls.idle_share([], 0, 4) == 1.0
    assert stalls.idle_share([(0, 4)], 0, 4) == 0.0
    assert stalls.idle_share([(0, 1), (0, 1)], 0, 4) == 0.75


@pytest.mark.parametrize("spans, err", [
    ([(2, 1)], ValueError), ([(0, "1")], TypeError), ([(0,)], TypeError), ("ab", TypeError),
    ([(0, float("nan"))], TypeError), ([(True, 2)], TypeError),
])
def test_spans_are_checked(spans, err):
    with pytest.raises(err):
        stalls.merge_spans(spans)


def test_window_is_checked():
    with pytest.raises(ValueError, match="end must be after start"):
        stalls.idle_share([], 3, 3)
    with pytest.raises(TypeError, match="start"):
        stalls.covered([], None, 3)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(-5, 25), st.integers(0, 8)), max_size=8), st.integers(-3, 5),
       st.integers(1, 20))
def test_idle_share_matches_brute_force(raw, start, width):
    spans = [(a, a + d) for a, d in raw]
    end = start + width
    busy_units = sum(any(a <= t < b for a, b in spans) for t in range(start, end))
    assert stalls.idle_share(spans, start, end) == pytest.approx(1 - busy_units / width)


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
        x("user_annotation", stalls.RUN_NAMES[mode], t, 0)  # duration fixed below
        idx = len(ev) - 1
        x("gpu_user_annotation", stalls.RUN_NAMES[mode], t + 0.1, 9.0)  # the GPU-side shadow
        gpu_t = t + 0.2
        for _ in range(2):
            x("user_annotation", stalls.HOST_PREPARE, t, 1.0)
            x("cpu_op", "aten::fill_", t + 0.1, 0.5)
            x("user_annotation", stalls.HOST_COPY, t + 1.0, gap + 0.1)
            x("gpu_user_annotation", stalls.HOST_COPY, t + 1.0, 0.2)
            x("cuda_runtime", "cudaMemcpyAsync", t + 1.0, gap + 0.05)
            x("user_annotation", stalls.HOST_LAUNCH, t + 1.1 + gap, 0.02)
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
    runs = stalls.trace_runs(_trace(2.0), stalls.RUN_NAMES, stalls.HOST_SPANS, kernel_label=stalls.FORWARD_LABEL)
    assert set(runs) == {"pageable", "pinned"}
    pag, pin = runs["pageable"], runs["pinned"]
    assert pag["memcpy_names"] == {"Memcpy HtoD (Pageable -> Device)": 2}
    assert pin["memcpy_names"] == {"Memcpy HtoD (Pinned -> Device)": 2}
    for run in runs.values():
        labels = [s[2] for s in run["host"]]
        assert labels.count(stalls.HOST_COPY) == 2  # the gpu_user_annotation shadows are not host spans
        assert "aten::fill_" not in labels and "cudaMemcpyAsync" not in labels
        assert [s[2] for s in run["gpu"]].count(stalls.FORWARD_LABEL) == 2
        assert all(0 <= s[0] <= s[1] <= run["window_ms"] + 1e-9 for s in run["host"] + run["gpu"])
        assert run["host"] == sorted(run["host"])
    assert pag["host"][0][0] == 0.0
    assert stalls.median_span_ms(pag["host"], stalls.HOST_COPY) == pytest.approx(2.1)
    assert stalls.median_span_ms(pin["host"], stalls.HOST_COPY) == pytest.approx(0.1)
    assert stalls.median_span_ms(pin["host"], "nothing") is None
    idle_pag = stalls.gpu_kernel_idle_share(pag, stalls.FORWARD_LABEL)
    idle_pin = stalls.gpu_kernel_idle_share(pin, stalls.FORWARD_LABEL)
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
    runs = stalls.trace_runs(ev, {"a": "run: a", "b": "run: b"}, ())
    assert runs["a"]["gpu"] == [[9.0, 11.0, "kernel"], [12.0, 13.0, "kernel"]]
    assert runs["b"]["gpu"] == [[-3.0, -2.0, "kernel"]]
    strict = stalls.trace_runs(ev, {"a": "run: a", "b": "run: b"}, (), gpu_skew_ms=0)
    assert len(strict["a"]["gpu"]) == 1 and strict["b"]["gpu"] == []


def test_trace_runs_needs_its_annotations():
    with pytest.raises(ValueError, match="run: pinned inputs"):
        stalls.trace_runs(_trace(0)[:5], stalls.RUN_NAMES, stalls.HOST_SPANS)
    with pytest.raises(TypeError, match="run_names"):
        stalls.trace_runs([], {}, stalls.HOST_SPANS)
    with pytest.raises(TypeError, match="events"):
        stalls.trace_runs("trace.json", stalls.RUN_NAMES, stalls.HOST_SPANS)


def test_gpu_kernel_idle_share_edge_cases():
    assert stalls.gpu_kernel_idle_share({"gpu": []}) is None
    assert stalls.gpu_kernel_idle_share({"gpu": [[0, 1, "kernel"], [1, 2, "Memcpy"]]}) == 0.5
    with pytest.raises(TypeError):
        stalls.gpu_kernel_idle_share([])


def test_load_trace_events(tmp_path):
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"traceEvents": [{"ph": "X"}, 3], "displayTimeUnit": "ms"}))
    assert stalls.load_trace_events(p) == [{"ph": "X"}]
    p.write_text(json.dumps([{"ph": "X"}]))
    assert stalls.load_trace_events(p) == [{"ph": "X"}]
    p.write_text(json.dumps({"traceEvents": 3}))
    with pytest.raises(ValueError):
        stalls.load_trace_events(p)
    p.write_text("{not json")
    with pytest.raises(ValueError):
        stalls.load_trace_events(p)


def test_events_from_profiler_fallback():
    cuda = torch.autograd.DeviceType.CUDA
    cpu = torch.autograd.DeviceType.CPU

    def fe(name, start, end, dev):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), device_type=dev)

    prof = SimpleNamespace(events=lambda: [
        fe(stalls.RUN_NAMES["pageable"], 0, 100, cpu), fe(stalls.RUN_NAMES["pageable"], 1, 90, cuda),
        fe(stalls.HOST_COPY, 10, 20, cpu), fe("Memcpy HtoD (Pageable -> Device)", 15, 30, cuda),
        fe("spin_kernel", 30, 80, cuda), fe("Memset (Device)", 80, 81, cuda),
    ])
    names = set(stalls.RUN_NAMES.values()) | set(stalls.HOST_SPANS)
    events = stalls._events_from_profiler(prof, names)
    assert [e["cat"] for e in events] == ["user_annotation", "gpu_user_annotation", "user_annotation",
                                          "gpu_memcpy", "kernel", "gpu_memset"]
    run = stalls.trace_runs(events, {"pageable": stalls.RUN_NAMES["pageable"]}, stalls.HOST_SPANS)["pageable"]
    assert run["host"] == [[0.01, 0.02, stalls.HOST_COPY]]
    assert [g[2] for g in run["gpu"]] == ["Memcpy HtoD (Pageable -> Device)", "kernel", "Memset (Device)"]


def test_trace_path():
    assert stalls.trace_path(stalls.DEFAULT_TRACE) == repo_root() / "build" / "traces" / "02_step_loop.json"
    for bad in ("/tmp/x.json", "../x.json", "build/x.txt", "build/../../x.json"):
        with pytest.raises(ValueError, match="relative path"):
            stalls.trace_path(bad)
    with pytest.raises(TypeError):
        stalls.trace_path(None)


# ---- the detector demo ----------------------------------------------------------------------------

def test_demo_stall_lines_point_at_the_calls():
    lines = stalls.demo_stall_lines()
    src = stalls.DEMO_SOURCE.splitlines()
    assert set(lines) == {PAGEABLE_H2D, FACTORY_SYNC, ITEM_SYNC}
    assert "copy_(" in src[lines[PAGEABLE_H2D] - 1] and "non_blocking=True" in src[lines[PAGEABLE_H2D] - 1]
    assert "torch.tensor(" in src[lines[FACTORY_SYNC] - 1]
    assert ".item()" in src[lines[ITEM_SYNC] - 1]


def test_demo_step_is_compiled_as_its_own_file_and_the_detector_points_there():
    f = stalls.demo_step_function()
    assert f.__code__.co_filename == stalls.DEMO_FILE
    # meta tensors stand in for the GPU: the pageable copy is reported at line 2 of demo_step.py
    w, dev, host = torch.empty(4, 4, device="meta"), torch.empty(4, 4, device="meta"), torch.randn(4, 4)
    with detect_stalls(device_type="meta") as report:
        with pytest.raises(Exception):
            f(0, w, host, dev, 0.5)  # fails later: torch.tensor(..., device="cuda") needs CUDA
    assert report.counts[PAGEABLE_H2D] == 1
    assert stalls.stall_lines(report.events) == {PAGEABLE_H2D: [stalls.demo_stall_lines()[PAGEABLE_H2D]]}


def test_stall_lines_keeps_only_the_demo_file():
    events = [{"kind": "a", "where": "demo_step.py:3"}, {"kind": "a", "where": "demo_step.py:3"},
              {"kind": "b", "where": "/x/y.py:3"}, {"kind": "a", "where": "demo_step.py:7"},
              {"kind": "c", "where": "<unknown>"}]
    assert stalls.stall_lines(events) == {"a": [3, 7]}


def test_plain_floats():
    assert stalls._plain_floats([1.0, float("nan"), float("inf")]) == [1.0, "nan", "inf"]


# ---- every GPU experiment: clear argument errors, and no CUDA -> CudaUnavailableError -----------------

GPU_FUNCTIONS = [stalls.single_copy_sweep, stalls.staging_pool, stalls.d2h_visibility, stalls.hidden_syncs,
                 stalls.step_loop, stalls.async_h2d_cost, stalls.detector_demo]


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setenv("PINLAB_FORCE_CPU", "1")


@pytest.mark.parametrize("fn", GPU_FUNCTIONS, ids=lambda f: f.__name__)
def test_gpu_experiments_need_cuda(fn, no_cuda):
    with pytest.raises(pinlab.CudaUnavailableError, match=fn.__name__):
        fn()


@pytest.mark.parametrize("fn, kwargs, err, match", [
    (stalls.single_copy_sweep, {"sizes": []}, ValueError, "sizes"),
    (stalls.single_copy_sweep, {"sizes": [0]}, ValueError, r"sizes\[0\]"),
    (stalls.single_copy_sweep, {"busy_ms": -1}, ValueError, "busy_ms"),
    (stalls.single_copy_sweep, {"repeat": 1.5}, TypeError, "repeat"),
    (stalls.single_copy_sweep, {"bench_bytes": 0}, ValueError, "bench_bytes"),
    (stalls.staging_pool, {"chunks": [8 * MiB], "total_bytes": 12 * MiB}, ValueError, "fit at least twice"),
    (stalls.staging_pool, {"trials": 0}, ValueError, "trials"),
    (stalls.staging_pool, {"chunks": "64"}, TypeError, "chunks"),
    (stalls.d2h_visibility, {"nbytes": 6}, ValueError, "multiple of 4"),
    (stalls.d2h_visibility, {"busy_ms": "20"}, TypeError, "busy_ms"),
    (stalls.hidden_syncs, {"view_bytes": 1000}, ValueError, "multiple of 4096"),
    (stalls.hidden_syncs, {"list_len": 0}, ValueError, "list_len"),
    (stalls.step_loop, {"trace": "/abs/trace.json"}, ValueError, "relative path"),
    (stalls.step_loop, {"in_flight": 0}, ValueError, "in_flight"),
    (stalls.step_loop, {"gpu_ms": 0}, ValueError, "gpu_ms"),
    (stalls.async_h2d_cost, {"list_len": True}, TypeError, "list_len"),
    (stalls.detector_demo, {"steps": 0}, ValueError, "steps"),
    (stalls.detector_demo, {"gpu_ms": float("inf")}, ValueError, "gpu_ms"),
])
def test_gpu_experiments_check_arguments_first(fn, kwargs, err, match, no_cuda):
    with pytest.raises(err, match=match):
        fn(**kwargs)
