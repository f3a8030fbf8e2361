"""Lesson 02's library (pinlab.lessons.l02_fake_non_blocking): the pure post-processing, argument
checks, and that every GPU experiment refuses clearly without CUDA. Runs on a CPU."""
import ctypes
import os

import pytest
import torch

import nbtools
import pinlab
from pinlab.detector import FACTORY_SYNC, ITEM_SYNC, PAGEABLE_H2D, detect_stalls
from pinlab.lessons import l02_fake_non_blocking as stalls
from pinlab.lessons import l02b_overlapping_copies as ov

KiB, MiB = stalls.KiB, stalls.MiB
NOTEBOOK = nbtools.ROOT / "notebooks" / "src" / "02b_overlapping_copies.py"  # demo_step: lesson 02b defines it


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


# ---- the detector demo: lines counted inside the notebook's function -----------------------------

# the notebook's own demo_step (its cell, executed here), not a copy of it
demo_step = nbtools.load_definition(NOTEBOOK, "demo_step", {"torch": torch, "pinlab": pinlab})


def test_source_lines_count_from_the_def_line():
    assert ov.source_lines(demo_step) == {PAGEABLE_H2D: 2, FACTORY_SYNC: 3, ITEM_SYNC: 6}

    def two_copies(a, b):
        a.copy_(b)
        a.copy_(b)

    with pytest.raises(ValueError, match="exactly one line"):
        ov.source_lines(two_copies, {"a.copy_(": "x"})
    with pytest.raises(ValueError, match="exactly one line"):
        ov.source_lines(two_copies, {"nowhere": "x"})
    with pytest.raises(TypeError):
        ov.source_lines(3)


def test_the_detector_points_into_the_function_whatever_its_file():
    # meta tensors stand in for the GPU: the pageable copy is reported at line 2 of demo_step
    w, dev, host = torch.empty(4, 4, device="meta"), torch.empty(4, 4, device="meta"), torch.randn(4, 4)
    with detect_stalls(device_type="meta") as report:
        with pytest.raises(Exception):
            demo_step(0, w, host, dev, 0.5)  # fails later: torch.tensor(..., device="cuda") needs CUDA
    assert report.counts[PAGEABLE_H2D] == 1
    assert ov.stall_lines(report.events, demo_step) == {PAGEABLE_H2D: [2]}
    assert report.events[0].where.startswith(demo_step.__code__.co_filename + ":")


def test_stall_lines_keeps_only_lines_inside_the_function():
    code = demo_step.__code__
    first, file = code.co_firstlineno, code.co_filename
    events = [{"kind": "a", "where": f"{file}:{first + 2}"}, {"kind": "a", "where": f"{file}:{first + 2}"},
              {"kind": "b", "where": f"/elsewhere.py:{first + 2}"}, {"kind": "a", "where": f"{file}:{first + 5}"},
              {"kind": "c", "where": f"{file}:{first - 1}"}, {"kind": "c", "where": f"{file}:{first + 6}"},
              {"kind": "d", "where": "<unknown>"}]
    assert ov.stall_lines(events, demo_step) == {"a": [3, 6]}
    with pytest.raises(TypeError):
        ov.stall_lines(events, len)


# ---- the environment CUDA reads ----------------------------------------------------------------------

def test_c_environ_sees_what_setenv_wrote_and_os_environ_does_not(monkeypatch):
    name = "PINLAB_TEST_C_ENVIRON"
    monkeypatch.delenv(name, raising=False)
    assert stalls.c_environ(name) is None
    libc = ctypes.CDLL(None)
    libc.setenv(name.encode(), b"LAZY", 1)  # what older torch releases did for CUDA_MODULE_LOADING
    try:
        assert stalls.c_environ(name) == "LAZY"
        assert name not in os.environ  # Python's copy never heard of it
    finally:
        libc.unsetenv(name.encode())
    monkeypatch.setenv(name, "EAGER")  # os.environ writes go through putenv: C sees them too
    assert stalls.c_environ(name) == "EAGER"
    for bad in ("", "A=B", 3):
        with pytest.raises(ValueError):
            stalls.c_environ(bad)


def test_plain_floats():
    assert stalls.plain_floats([1.0, float("nan"), float("inf")]) == [1.0, "nan", "inf"]


def test_hidden_sync_rows_show_dense_and_non_dense_sources():
    ops = stalls.HIDDEN_SYNC_OPS
    assert {"nondense_pinned", "permuted_same_layout", "permuted_to_contiguous", "contig_pinned"} <= set(ops)
    assert {k[:-5] for k in ops if k.endswith(("_cold", "_warm"))} == {"dtype", "kernel"}


# ---- every GPU experiment: clear argument errors, and no CUDA -> CudaUnavailableError -----------------

def _timed_copy(dst, src, busy_ms):
    return 0.0


def _copy_back(host_buf, gpu_t, value, busy_ms):
    return 0.0, host_buf, host_buf


def _run_steps(bufs, dev, steps, *, cpu_ms, gpu_ms, in_flight, span=None):
    return []


def _one_stream(inputs, out, compute):
    pass


def _copy_stream(inputs, out, compute, copy_stream, record=True):
    pass


def _compute(x, out_i, ms):
    pass


def _copy_each(dsts, srcs):
    pass


GPU_FUNCTIONS = [(stalls.single_copy_sweep, (_timed_copy,)), (stalls.staging_pool, ()),
                 (stalls.d2h_visibility, (_copy_back,)),
                 (stalls.hidden_syncs, ()), (ov.step_loop, (_run_steps,)), (ov.async_h2d_cost, ()),
                 (ov.detector_demo, (demo_step,)), (ov.overlap_loop, (_one_stream, _copy_stream, _compute)),
                 (ov.many_tensors, (_copy_each, _copy_each))]


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setenv("PINLAB_FORCE_CPU", "1")


@pytest.mark.parametrize("fn, args", GPU_FUNCTIONS, ids=lambda f: getattr(f, "__name__", ""))
def test_gpu_experiments_need_cuda(fn, args, no_cuda):
    with pytest.raises(pinlab.CudaUnavailableError, match=fn.__name__):
        fn(*args)


@pytest.mark.parametrize("fn, kwargs, err, match", [
    (stalls.single_copy_sweep, {"timed_copy": 3}, TypeError, "timed_copy"),
    (stalls.single_copy_sweep, {"timed_copy": _timed_copy, "sizes": []}, ValueError, "sizes"),
    (stalls.single_copy_sweep, {"timed_copy": _timed_copy, "sizes": [0]}, ValueError, r"sizes\[0\]"),
    (stalls.single_copy_sweep, {"timed_copy": _timed_copy, "busy_ms": -1}, ValueError, "busy_ms"),
    (stalls.single_copy_sweep, {"timed_copy": _timed_copy, "repeat": 1.5}, TypeError, "repeat"),
    (stalls.single_copy_sweep, {"timed_copy": _timed_copy, "bench_bytes": 0}, ValueError, "bench_bytes"),
    (stalls.staging_pool, {"chunks": [8 * MiB], "total_bytes": 12 * MiB}, ValueError, "fit at least twice"),
    (stalls.staging_pool, {"trials": 0}, ValueError, "trials"),
    (stalls.staging_pool, {"chunks": "64"}, TypeError, "chunks"),
    (stalls.d2h_visibility, {"copy_back": _copy_back, "nbytes": 6}, ValueError, "multiple of 4"),
    (stalls.d2h_visibility, {"copy_back": _copy_back, "busy_ms": "20"}, TypeError, "busy_ms"),
    (stalls.d2h_visibility, {"copy_back": "no"}, TypeError, "copy_back"),
    (stalls.hidden_syncs, {"view_bytes": 1000}, ValueError, "multiple of 4096"),
    (stalls.hidden_syncs, {"list_len": 0}, ValueError, "list_len"),
    (ov.step_loop, {"step_fn": _run_steps, "trace": "/abs/trace.json"}, ValueError, "relative path"),
    (ov.step_loop, {"step_fn": _run_steps, "in_flight": 0}, ValueError, "in_flight"),
    (ov.step_loop, {"step_fn": _run_steps, "gpu_bound_factor": 0}, ValueError, "gpu_bound_factor"),
    (ov.step_loop, {"step_fn": _run_steps, "gpu_ms": 0}, ValueError, "gpu_ms"),
    (ov.step_loop, {"step_fn": None}, TypeError, "step_fn"),
    (ov.async_h2d_cost, {"list_len": True}, TypeError, "list_len"),
    (ov.detector_demo, {"step_fn": demo_step, "steps": 0}, ValueError, "steps"),
    (ov.detector_demo, {"step_fn": demo_step, "gpu_ms": float("inf")}, ValueError, "gpu_ms"),
    (ov.detector_demo, {"step_fn": _timed_copy}, ValueError, "exactly one line"),
    (ov.overlap_loop, {"one_stream_fn": None, "copy_stream_fn": _copy_stream, "compute_fn": _compute},
     TypeError, "one_stream_fn"),
    (ov.overlap_loop, {"one_stream_fn": _one_stream, "copy_stream_fn": _copy_stream, "compute_fn": 3},
     TypeError, "compute_fn"),
    (ov.overlap_loop, {"one_stream_fn": _one_stream, "copy_stream_fn": _copy_stream, "compute_fn": _compute,
                           "n_inputs": 1}, ValueError, "n_inputs"),
    (ov.overlap_loop, {"one_stream_fn": _one_stream, "copy_stream_fn": _copy_stream, "compute_fn": _compute,
                           "input_bytes": 0}, ValueError, "input_bytes"),
    (ov.overlap_loop, {"one_stream_fn": _one_stream, "copy_stream_fn": _copy_stream, "compute_fn": _compute,
                           "compute_ms": float("nan")}, ValueError, "compute_ms"),
    (ov.overlap_loop, {"one_stream_fn": _one_stream, "copy_stream_fn": _copy_stream, "compute_fn": _compute,
                           "trace": "../x.json"}, ValueError, "relative path"),
    (ov.many_tensors, {"copy_each_blocking": _copy_each, "copy_all_then_sync": "x"}, TypeError,
     "copy_all_then_sync"),
    (ov.many_tensors, {"copy_each_blocking": _copy_each, "copy_all_then_sync": _copy_each, "cases": []},
     ValueError, "cases must not be empty"),
    (ov.many_tensors, {"copy_each_blocking": _copy_each, "copy_all_then_sync": _copy_each, "cases": [[64]]},
     TypeError, r"cases\[0\]"),
    (ov.many_tensors, {"copy_each_blocking": _copy_each, "copy_all_then_sync": _copy_each,
                           "cases": [[4, 0]]}, ValueError, r"cases\[0\] bytes"),
    (ov.many_tensors, {"copy_each_blocking": _copy_each, "copy_all_then_sync": _copy_each,
                           "cases": [[1024, MiB]]}, ValueError, "within 256 MiB"),
    (ov.many_tensors, {"copy_each_blocking": _copy_each, "copy_all_then_sync": _copy_each, "repeat": 0},
     ValueError, "repeat"),
])
def test_gpu_experiments_check_arguments_first(fn, kwargs, err, match, no_cuda):
    with pytest.raises(err, match=match):
        fn(**kwargs)


# ---- the copy stream: overlap read from profiled spans ----------------------------------------------

K, PIN, PAG = ov.COMPUTE_LABEL, "Memcpy HtoD (Pinned -> Device)", "Memcpy HtoD (Pageable -> Device)"


def test_copy_overlap_one_stream_touching_spans_do_not_overlap():
    # one stream: copy, compute, copy, compute ... end of one = start of the next (profiler rounding)
    gpu = [[0.0, 0.3, PIN], [0.3, 0.8, K], [0.8, 1.1, PIN], [1.1, 1.6, K], [1.6, 1.9, PIN], [1.9, 2.4, K]]
    o = ov.copy_overlap(gpu)
    assert o == {"copies": 3, "overlapping": 0, "copy_ms": 0.9, "overlapped_ms": 0.0, "share": 0.0}
    # a timestamp skew of 1 µs is not an overlap; 5 µs or more is
    gpu[2] = [0.799, 1.1, PIN]
    assert ov.copy_overlap(gpu)["overlapping"] == 0
    assert ov.copy_overlap(gpu, min_ms=0)["overlapping"] == 1


def test_copy_overlap_copy_stream_counts_each_copy_once_over_merged_kernels():
    gpu = [[0.0, 0.3, PIN], [0.3, 0.6, PIN], [0.3, 0.8, K], [0.5, 0.7, K], [0.6, 0.9, PIN], [0.9, 1.4, K],
           [2.0, 2.1, "Memset (Device)"]]
    o = ov.copy_overlap(gpu)
    assert o["copies"] == 3 and o["overlapping"] == 2
    assert o["overlapped_ms"] == pytest.approx(0.3 + 0.2)  # not 0.3 + 0.1 + 0.2: kernels merged first
    assert o["share"] == pytest.approx(0.5 / 0.9)
    assert ov.copy_overlap([[0, 1, K]])["share"] is None


def test_overlap_lanes_split_compute_and_copies():
    gpu = [[0.0, 0.3, PAG], [0.3, 0.8, K], [0.8, 0.9, "Memset (Device)"]]
    assert ov.overlap_lanes(gpu) == {"compute": [[0.3, 0.8, K]], "copies": [[0.0, 0.3, PAG]]}
    assert ov.overlap_lanes(gpu, kernel_label="other") == {"compute": [], "copies": [[0.0, 0.3, PAG]]}


@pytest.mark.parametrize("spans, err, match", [
    ("spans", TypeError, "gpu_spans"),
    ({"a": 1}, TypeError, "gpu_spans"),
    ([[0, 1]], TypeError, r"gpu_spans\[0\]"),
    ([[0, 1, 3]], TypeError, r"gpu_spans\[0\]"),
    ([[0, 1, K], [2, 1, K]], ValueError, "ends before it starts"),
    ([[0, float("nan"), K]], TypeError, "finite"),
])
def test_overlap_functions_reject_bad_spans(spans, err, match):
    with pytest.raises(err, match=match):
        ov.copy_overlap(spans)
    with pytest.raises(err, match=match):
        ov.overlap_lanes(spans)


def test_copy_overlap_rejects_a_bad_min_ms():
    with pytest.raises(ValueError, match="min_ms"):
        ov.copy_overlap([[0, 1, K]], min_ms=-1)


def test_wrong_steps():
    assert ov.wrong_steps([1, 2, 3], [1, 2, 3]) == 0
    assert ov.wrong_steps([1, 5, 3, 0], [1, 2, 3, 4]) == 2
    assert ov.wrong_steps([], []) == 0
    with pytest.raises(ValueError, match="one entry per step"):
        ov.wrong_steps([1, 2], [1])
    with pytest.raises(TypeError, match="values"):
        ov.wrong_steps(3, [1])
    with pytest.raises(TypeError, match="expected"):
        ov.wrong_steps([1], "1")


def test_plots_draw_synthetic_results_and_reject_bad_input():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpu = [[0.0, 0.3, PIN], [0.3, 0.8, K]]
    fig = ov.plot_overlap({m: {"gpu": gpu} for m in ov.OVERLAP_MODES}, title="t")
    assert len(fig.axes) == 3
    plt.close(fig)
    with pytest.raises(ValueError, match="keys"):
        ov.plot_overlap({"one_stream_pinned": {"gpu": gpu}}, title="t", keys=["copy_stream_pinned"])
    with pytest.raises(TypeError, match="modes"):
        ov.plot_overlap({}, title="t")
    rows = [{"n": 4, "bytes": 4096, **{k: 1.0 + i for i, k in enumerate(ov.MANY_VARIANTS)}}]
    fig = ov.plot_many_tensors(rows, title="t")
    plt.close(fig)
    with pytest.raises(ValueError, match=r"rows\[0\]"):
        ov.plot_many_tensors([{"n": 4}], title="t")
    with pytest.raises(TypeError, match="rows"):
        ov.plot_many_tensors([], title="t")


# ---- the tutorial's advice from the lesson's own results -------------------------------------------

def _sweep(pinned_ms=0.02, small_ms=0.05, large_ms=19.0):
    rows = [{"bytes": n, "copy_pageable_ms": ms, "to_pageable_ms": ms, "copy_pinned_ms": pinned_ms,
             "to_pinned_ms": 0.01} for n, ms in ((64 * MiB, large_ms), (256, small_ms), (MiB, 0.3))]
    return {"busy_ms": 10.0, "rows": rows}


def _pool(block_at=(60, 62, 250, 248)):
    runs = [{"chunk": 64 * KiB, "trials": [], "n_copies": 256}, {"chunk": 16 * KiB, "trials": [], "n_copies": 1024}]
    for i, at in enumerate(block_at):
        host = [0.01] * 300
        if at is not None:
            host[at] = 48.0
        runs[i // 2]["trials"].append({"host_ms": host, "data_ok": True})
    return {"busy_ms": 50.0, "total_bytes": 16 * MiB, "runs": runs}


def _d2h(pageable_ms=20.0, pinned_valid=False):
    def v(name, ms, valid):
        return {"variant": name, "host_ms": [ms] * 3, "valid_before_sync": [valid] * 3, "valid_after_sync": [True] * 3}
    return {"busy_ms": 20.0, "nbytes": 64 * KiB,
            "variants": [v(stalls.D2H_VARIANTS[0], pageable_ms, True), v(stalls.D2H_VARIANTS[1], 0.04, pinned_valid),
                         v(stalls.D2H_VARIANTS[2], 0.05, False)]}


def test_advice_rows_on_an_h200_shaped_run():
    rows = stalls.advice_rows(_sweep(), _pool(), _d2h())
    H, W, S = stalls.ADVICE_HOLDS, stalls.ADVICE_WAITS, stalls.ADVICE_STALE
    assert [(r["case"], r["outcome"]) for r in rows] == [
        ("H2D from pinned memory, any size", H),
        ("H2D from pageable memory, a small copy (256 B)", H),
        ("H2D from pageable memory, one large copy (64 MiB)", W),
        ("H2D from pageable memory, many small copies queued", W),
        ("D2H into pageable memory", W),
        ("D2H into pinned memory", S),
    ]
    assert "4 of 4 trials, after 3840-4000 KiB" in rows[3]["evidence"]  # 64 KiB x 60 ... 16 KiB x 250
    assert all(isinstance(r["evidence"], str) and r["evidence"] for r in rows)


def test_advice_rows_follow_the_data():
    H, W = stalls.ADVICE_HOLDS, stalls.ADVICE_WAITS
    out = {r["case"]: r["outcome"] for r in stalls.advice_rows(
        _sweep(pinned_ms=7.0, large_ms=0.5), _pool(block_at=(60, None, None, None)),
        _d2h(pageable_ms=1.0, pinned_valid=True))}
    assert out["H2D from pinned memory, any size"] == W      # a pinned copy that waited is reported
    assert out["H2D from pageable memory, one large copy (64 MiB)"] == H
    assert out["H2D from pageable memory, many small copies queued"] == H  # not every trial blocked
    assert out["D2H into pageable memory"] == H
    assert out["D2H into pinned memory"] == H                 # data there before the sync: no trap


def test_advice_rows_on_a_rocm_shaped_run():
    """Where every pageable copy waits (ROCm), the lesson's observed rows say so and its claimed rows hold:
    the notebook observes the three pageable H2D rows and claims only pinned H2D and the two D2H rows."""
    H, W, S = stalls.ADVICE_HOLDS, stalls.ADVICE_WAITS, stalls.ADVICE_STALE
    rows = stalls.advice_rows(_sweep(small_ms=12.0), _pool(block_at=(0, 0, 0, 0)), _d2h())
    assert [r["outcome"] for r in rows] == [H, W, W, W, W, S]
    assert "after 0-0 KiB queued" in rows[3]["evidence"]
    assert stalls.first_waiting_size([256, MiB, 64 * MiB], [12.0, 12.0, 19.0], 5.0) == 256


@pytest.mark.parametrize("args, err, match", [
    (([], _pool(), _d2h()), TypeError, "sweep"),
    (({"busy_ms": 10.0}, _pool(), _d2h()), ValueError, r"sweep must hold \['rows'\]"),
    (({"busy_ms": 10.0, "rows": []}, _pool(), _d2h()), ValueError, "sweep\\['rows'\\]"),
    (({"busy_ms": 0, "rows": _sweep()["rows"]}, _pool(), _d2h()), ValueError, "busy_ms"),
    ((_sweep(), {"busy_ms": 50.0}, _d2h()), ValueError, "pool must hold"),
    ((_sweep(), {"busy_ms": 50.0, "runs": []}, _d2h()), ValueError, "at least one trial"),
    ((_sweep(), _pool(), "d2h"), TypeError, "d2h"),
    ((_sweep(), _pool(), {"busy_ms": 20.0, "variants": []}), ValueError, "copy_ into pageable"),
])
def test_advice_rows_reject_results_of_the_wrong_shape(args, err, match):
    with pytest.raises(err, match=match):
        stalls.advice_rows(*args)


# ---- on a real GPU: the copy stream and many tensors give exact results ----------------------------

def _gpu_compute(x, out_i, ms):
    pinlab.gpu_busy(ms)
    torch.sum(x, dim=0, dtype=torch.int64, out=out_i)


def _gpu_one_stream(inputs, out, compute):
    for i, x in enumerate(inputs):
        compute(x.to("cuda", non_blocking=True), out[i])


def _gpu_copy_stream(inputs, out, compute, copy_stream, record=True):
    main = torch.cuda.current_stream()
    copy_stream.wait_stream(main)

    def fetch(x):
        with torch.cuda.stream(copy_stream):
            return x.to("cuda", non_blocking=True)

    nxt = fetch(inputs[0])
    for i in range(len(inputs)):
        x_gpu = nxt
        main.wait_stream(copy_stream)
        if record:
            x_gpu.record_stream(main)
        if i + 1 < len(inputs):
            nxt = fetch(inputs[i + 1])
        compute(x_gpu, out[i])
        del x_gpu


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_overlap_loop_results_are_exact():
    r = ov.overlap_loop(_gpu_one_stream, _gpu_copy_stream, _gpu_compute, steps=8, rounds=1,
                            input_bytes=MiB, compute_ms=0.2, profile_steps=2, trace="build/test_traces/02_overlap.json")
    assert set(r["modes"]) == set(ov.OVERLAP_MODES)
    assert all(m["wrong_steps"] == 0 for m in r["modes"].values())
    assert r["modes"]["one_stream_pinned"]["overlap"]["overlapping"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_many_tensors_data_arrives():
    def each(dsts, srcs):
        for d, s in zip(dsts, srcs):
            d.copy_(s)

    def all_then_sync(dsts, srcs):
        for d, s in zip(dsts, srcs):
            d.copy_(s, non_blocking=True)
        torch.cuda.synchronize()

    r = ov.many_tensors(each, all_then_sync, cases=[[8, 4 * KiB]], repeat=2)
    assert [row["data_ok"] for row in r["rows"]] == [True]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
@pytest.mark.parametrize("module, name", [(ov, "copy_engines"), (stalls, "tutorial_matrix")])
def test_issue22_copy_experiments_need_cuda(module, name):
    with pytest.raises(pinlab.CudaUnavailableError, match=name):
        getattr(module, name)()


@pytest.mark.parametrize("name, kwargs", [("copy_engines", {"nbytes": 0}), ("copy_engines", {"reps": 0}),
                                          ("tutorial_matrix", {"nbytes": -1}), ("tutorial_matrix", {"reps": 1.5})])
def test_issue22_copy_experiments_check_arguments(name, kwargs):
    with pytest.raises((TypeError, ValueError), match=next(iter(kwargs))):
        getattr(ov if hasattr(ov, name) else stalls, name)(**kwargs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_copy_engines_and_matrix_shapes():
    from pinlab.lessons import l02_fake_non_blocking as l02

    res = ov.copy_engines(nbytes=16 << 20, reps=2)
    assert [r["case"] for r in res["rows"]] == ["H2D alone", "D2H alone", "H2D and D2H at once", "two H2D at once"]
    assert all(r["gbps"] > 0 for r in res["rows"])
    assert len(l02.tutorial_matrix(nbytes=1 << 20, reps=2)) == 6


# ---- issue 22: the sentences of the copy-engine and matrix sections ------------------------------------

def _engines(both, two, engines=3):
    rates = {"H2D alone": 50.0, "D2H alone": 50.0, "H2D and D2H at once": both, "two H2D at once": two}
    return {"nbytes": 1, "copy_engines": engines, "rows": [{"case": k, "gbps": v} for k, v in rates.items()]}


def test_engines_sentence_follows_the_rates():
    text = ov.engines_sentence(_engines(95.0, 51.0))
    assert "3 copy engines" in text and "side by side" in text and "no more than one copy" in text
    text = ov.engines_sentence(_engines(50.0, 51.0, engines=1))
    assert "1 copy engine " in text and "took turns" in text
    assert "in part" in ov.engines_sentence(_engines(65.0, 51.0))
    assert "did not fill the link" in ov.engines_sentence(_engines(95.0, 90.0))
    assert "unknown number" in ov.engines_sentence(_engines(95.0, 51.0, engines=None))
    bad = _engines(95.0, 51.0)
    bad["rows"] = bad["rows"][:3]
    with pytest.raises(ValueError, match="two H2D at once"):
        ov.engines_sentence(bad)


def _matrix(pageable, pinned, then, nb_factor=1.0):
    ms = {"pageable": pageable, "pinned": pinned, "pin_memory() then copy": then}
    return [{"source": s, "non_blocking": nb, "ms": ms[s] * (nb_factor if nb else 1.0)}
            for s in ms for nb in (False, True)]


def test_matrix_sentences_follow_the_numbers():
    from pinlab.lessons import l02_fake_non_blocking as l02

    first, second, third = l02.matrix_sentences(_matrix(1.28, 0.32, 0.8, nb_factor=0.95))
    assert "fastest" in first and "4.0x" in first
    assert "less, not the 'up to twice" in second
    assert "5%" in third
    _, second, _ = l02.matrix_sentences(_matrix(1.0, 0.3, 2.0))
    assert "cost more than the pageable copy" in second and "2.00x" in second
    first, _, _ = l02.matrix_sentences(_matrix(0.3, 0.4, 2.0))
    assert "not the fastest" in first
    with pytest.raises(ValueError, match="cell"):
        l02.matrix_sentences(_matrix(1.0, 0.3, 0.5)[:5])
    with pytest.raises(TypeError, match="rows"):
        l02.matrix_sentences({"source": "pinned"})


# ---- issue 33: the tutorial's own experiment (1,000 x 4 KB, one sync) -------------------------------------

def _tutorial_result(pageable, pinned, then, nb_factor):
    return {"count": 1000, "bytes_each": 4000, "data_ok": True, "rows": _matrix(pageable, pinned, then, nb_factor)}


def test_tutorial_loop_is_the_tutorials_experiment():
    assert (stalls.TUTORIAL_COUNT, stalls.TUTORIAL_NUMEL) == (1000, 1000)  # torch.randn(1000) x 1000: 4,000 B each


def test_tutorial_loop_sentences_follow_the_numbers():
    first, second, third, last = stalls.tutorial_loop_sentences(_tutorial_result(20.0, 10.0, 30.0, 0.5),
                                                                _matrix(1.28, 0.32, 0.8, nb_factor=0.95))
    assert first.startswith("1000 tensors from pageable") and "2.00x faster than a blocking copy each" in first
    assert "pinned" in second and "pin_memory() then copy" in third
    assert "up to 2.00x faster" in last and "by more than 5%" in last
    first, *_, last = stalls.tutorial_loop_sentences(_tutorial_result(20.0, 10.0, 30.0, 1.1), _matrix(1.0, 0.3, 0.5))
    assert "no faster than a blocking copy each" in first
    assert "no faster in this run" in last and "0.91x" in last
    with pytest.raises(TypeError, match="result"):
        stalls.tutorial_loop_sentences([], _matrix(1.0, 0.3, 0.5))
    with pytest.raises(ValueError, match="cell"):
        stalls.tutorial_loop_sentences({"rows": _matrix(1.0, 0.3, 0.5)[:5]}, _matrix(1.0, 0.3, 0.5))


@pytest.mark.parametrize("kwargs, match", [({"copies": 3}, "copies"), ({"count": 0}, "count"),
                                           ({"numel": -1}, "numel"), ({"reps": 1.5}, "reps")])
def test_tutorial_loop_checks_its_arguments(kwargs, match):
    args = {"copies": lambda tensors, nb, pin_first: [], **kwargs}
    with pytest.raises((TypeError, ValueError), match=match):
        stalls.tutorial_loop(**args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_tutorial_loop_needs_cuda():
    with pytest.raises(pinlab.CudaUnavailableError, match="tutorial_loop"):
        stalls.tutorial_loop(lambda tensors, nb, pin_first: [])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_tutorial_loop_shape_and_data():
    def copies(tensors, non_blocking, pin_first=False):
        out = [(t.pin_memory() if pin_first else t).to("cuda", non_blocking=non_blocking) for t in tensors]
        if non_blocking:
            torch.cuda.synchronize()
        return out

    res = stalls.tutorial_loop(copies, count=20, numel=100, reps=2)
    assert res["data_ok"] and len(res["rows"]) == 6 and res["bytes_each"] == 400
    assert len(stalls.tutorial_loop_sentences(res, stalls.tutorial_matrix(nbytes=1 << 20, reps=2))) == 4


def test_issue22_copy_experiments_check_their_function_argument():
    from pinlab.lessons import l02_fake_non_blocking as l02

    with pytest.raises(TypeError, match="copy_on"):
        ov.copy_engines(copy_on=3)
    with pytest.raises(TypeError, match="to_gpu"):
        l02.tutorial_matrix(to_gpu="x")


# ---- 02b's step loop: calibrated so that the GPU sets the pace; what a run shows, from fake timings ------------

PAGEABLE_NAME, PINNED_NAME = "Memcpy HtoD (Pageable -> Device)", "Memcpy HtoD (Pinned -> Device)"


def _gpu_lane(copy_ms, gap_ms, forward_ms, name, steps=6):
    """A profiled GPU lane: each step a copy, then a forward starting ``gap_ms`` after the previous one ended."""
    spans, t = [], 0.0
    for _ in range(steps):
        spans.append([t, t + copy_ms, name])
        spans.append([t + gap_ms, t + gap_ms + forward_ms, ov.FORWARD_LABEL])
        t += gap_ms + forward_ms
    return spans


def _loop(forward=2.5, cal=1.05, work=(1.05, 1.05), gaps=(0.86, 0.2), copies=(0.8, 0.2), per_step=(3.4, 2.75),
          copy_host=(2.2, 0.05), slow=(0, 0), gpu_forward=None, rounds=None):
    """A step_loop() result with made-up timings (shaped after the H200's: an 8 MiB staged copy 0.63-1.0 ms, a
    pinned one 0.16-0.26 ms, reports/gpu/stability.json's 02b entry)."""
    modes = {}
    for k, m in enumerate(ov.STEP_MODES):
        name = PAGEABLE_NAME if m == "pageable" else PINNED_NAME
        modes[m] = {"ms_per_step": per_step[k], "steps_per_s": 1e3 / per_step[k], "copy_host_ms": copy_host[k],
                    "round_ms_per_step": list(rounds[k]) if rounds else [per_step[k]] * 2,
                    "host_work_ms": work[k], "host_slow_steps": slow[k], "timed_steps": 40, "host": [],
                    "gpu": _gpu_lane(copies[k], gaps[k], gpu_forward or forward, name), "memcpy_names": {name: 6},
                    "gpu_idle_share": 0.2}
    return {"trace_file": "t.json", "spans_from": "x", "forward_ms": forward,
            "calibration": {"host_work_ms": cal, "factor": 2.0, "floor_ms": 2.0, "cap_ms": 25.0}, "modes": modes}


def test_the_forward_is_sized_from_the_hosts_work_so_that_the_gpu_sets_the_pace():
    assert ov.gpu_bound_forward_ms(0.4, 2.0) == 2.0, "a quick host: the floor"
    assert ov.gpu_bound_forward_ms(1.01, 2.0) == 2.5, "twice the host's work, rounded up to 0.5 ms"
    assert ov.gpu_bound_forward_ms(6.62, 2.0) == 13.5, "the shared run's 6.6 ms prepare: a 13.5 ms forward"
    assert ov.gpu_bound_forward_ms(60.0, 2.0) == ov.MAX_FORWARD_MS, "capped"
    assert ov.gpu_bound_forward_ms(3.0, 2.0, factor=3.0) == 9.0
    for bad, err in ((-1.0, ValueError), (float("nan"), ValueError), ("1", TypeError)):
        with pytest.raises(err, match="host_work_ms"):
            ov.gpu_bound_forward_ms(bad, 2.0)
    with pytest.raises(ValueError, match="floor_ms"):
        ov.gpu_bound_forward_ms(1.0, 0)


def test_the_notebooks_step_marks_the_spans_the_calibration_times():
    """The notebook's own run_steps, on the CPU with a stand-in for torch.cuda: HostSpans times one
    'prepare inputs (CPU)' and one 'launch forward' span per step, and the host's work is their sum."""
    import contextlib
    import time
    import types

    class Event:
        def record(self):
            pass

        def synchronize(self):
            pass

    launched = []
    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(Event=Event, synchronize=lambda: None))
    fake_pinlab = types.SimpleNamespace(gpu_busy=launched.append)
    run_steps = nbtools.load_definition(NOTEBOOK, "run_steps", {"torch": fake_torch, "pinlab": fake_pinlab,
                                                                "time": time, "contextlib": contextlib})
    bufs = [torch.zeros(4096, dtype=torch.uint8) for _ in range(3)]
    spans = ov.HostSpans()
    copy_ms = run_steps(bufs, torch.empty(4096, dtype=torch.uint8), 5, cpu_ms=0.5, gpu_ms=7.0, in_flight=2, span=spans)
    assert len(copy_ms) == 5 and launched == [7.0] * 5
    assert set(ov.HOST_WORK_SPANS) <= set(spans.ms) and all(len(v) == 5 for v in spans.ms.values())
    work = ov.host_work_per_step(spans.ms)
    assert len(work) == 5 and all(w >= 0.5 for w in work), "prepare busy-waits cpu_ms at least"
    assert work == [a + b for a, b in zip(*(spans.ms[n] for n in ov.HOST_WORK_SPANS))]
    with pytest.raises(ValueError, match="marked no 'launch forward' span"):
        ov.host_work_per_step({"prepare inputs (CPU)": [1.0]})


def test_a_run_where_the_gpu_set_the_pace_shows_the_staged_copy_in_every_step():
    f = ov.step_loop_findings(_loop())
    assert f["shown"] and f["gpu_bound"] == {"pageable": True, "pinned": True}
    assert f["extra_ms"] == pytest.approx(0.65) and f["gap_ms"]["pageable"] == pytest.approx(0.86)
    assert f["nearest_model"] == "only the staged copy serialized"
    assert f["models"]["only the staged copy serialized"] == pytest.approx(2.5 + 0.8)
    text = " ".join(f["sentences"])
    assert "the GPU set the pace of both loops" in text and "could not" not in text
    assert "pageable steps took 650.0 µs longer than pinned ones (24% more" in text
    assert "the GPU waited 860.0 µs with pageable inputs (the staged copy, 800.0 µs" in text


def test_a_run_whose_host_set_the_pace_says_it_could_not_show_it():
    # the committed shared run: prepare 6.45 ms against a 2 ms forward, 8.32 vs 8.41 ms per step
    f = ov.step_loop_findings(_loop(forward=2.0, cal=1.01, work=(6.45, 6.5), gaps=(5.53, 6.4),
                                        per_step=(8.32, 8.41), slow=(40, 40)))
    assert not f["shown"] and f["gpu_bound"] == {"pageable": False, "pinned": False}
    first = f["sentences"][0]
    assert first.startswith("this run could not show it: in the pageable and pinned loop the host's own work per step")
    assert "(6.45 ms, 6.50 ms) took longer than a forward (2.00 ms, 2.00 ms)" in first
    assert "sized from the 1.01 ms the host needed before the timed steps: the host got slower after that" in first
    assert "the GPU waited for the host either way" in f["sentences"][1]
    assert f["sentences"][2] == "the timed pageable steps were not slower (8.32 ms against 8.41 ms pinned)"
    f = ov.step_loop_findings(_loop(forward=25.0, cal=30.0, work=(30.0, 30.0), gpu_forward=25.0))
    assert not f["shown"] and "this host is too slow for the loop" in f["sentences"][0]
    f = ov.step_loop_findings(_loop(work=(1.05, 3.0)))  # only the pinned loop's host fell behind
    assert not f["shown"] and f["sentences"][0].startswith("this run could not show it: in the pinned loop")
    f = ov.step_loop_findings(_loop(forward=2.0, work=(6.6, 7.5), gaps=(5.93, 5.99), per_step=(8.04, 7.96)))
    assert f["sentences"][2] == ("the timed pageable steps took 80.0 µs longer than pinned ones (1% more), but not by "
                                 "the GPU's wait between forwards (the gaps differ by -60.0 µs)")


def test_a_driver_that_stages_the_copy_behind_the_queue_is_named():
    f = ov.step_loop_findings(_loop(gaps=(0.2, 0.2), copies=(0.2, 0.2), copy_host=(0.03, 0.03),
                                        per_step=(2.7, 2.7)))
    assert not f["shown"]
    assert any("staged it behind the queue" in s and "no longer between two forwards" in s for s in f["sentences"])
    f = ov.step_loop_findings(_loop(gaps=(0.18, 0.2)))  # the copy_ held the host, the gaps did not show it
    assert not f["shown"] and any("copy_ held the host, but six profiled steps are few" in s for s in f["sentences"])


def test_gaps_that_the_timed_steps_do_not_show_are_said_so():
    f = ov.step_loop_findings(_loop(per_step=(2.74, 2.75), rounds=((2.0, 3.48), (2.7, 2.8))))
    assert not f["shown"] and f["gpu_bound"]["pageable"]
    assert f["sentences"][-1].startswith("the timed pageable steps were not slower (2.74 ms against 2.75 ms")
    assert ("the 660.0 µs per step the gaps predict is within what a step moved from one timed round to the other "
            "here (1.48 ms)") in f["sentences"][-1]
    f = ov.step_loop_findings(_loop(per_step=(2.74, 2.75)))  # rounds alike: the two measurements disagree
    assert "more than a step moved between the timed rounds (0 ns)" in f["sentences"][-1]


def test_findings_refuse_a_result_recorded_before_the_calibration():
    old = _loop()
    del old["forward_ms"], old["calibration"]
    with pytest.raises(ValueError, match="before the loop was calibrated"):
        ov.step_loop_findings(old)
    with pytest.raises(TypeError, match="step_loop"):
        ov.step_loop_findings([])
    bad = _loop()
    bad["modes"]["pinned"]["gpu"] = bad["modes"]["pinned"]["gpu"][:2]  # one forward: no gap
    with pytest.raises(ValueError, match="fewer than two forwards"):
        ov.step_loop_findings(bad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_step_loop_sizes_the_forward_from_the_hosts_work():
    import contextlib
    import time

    run_steps = nbtools.load_definition(NOTEBOOK, "run_steps", {"torch": torch, "pinlab": pinlab, "time": time,
                                                                "contextlib": contextlib})
    r = ov.step_loop(run_steps, steps=8, warm_steps=3, profile_steps=3, input_bytes=MiB, gpu_ms=1.0, cpu_ms=0.5,
                         trace="build/test_traces/02_step_loop.json")
    cal = r["calibration"]["host_work_ms"]
    assert cal >= 0.5 and r["forward_ms"] == ov.gpu_bound_forward_ms(cal, 1.0)
    assert all(m["timed_steps"] == 8 and m["host_work_ms"] >= 0.5 for m in r["modes"].values())
    f = ov.step_loop_findings(r)
    assert len(f["sentences"]) == 3 and set(f["gpu_bound"]) == set(ov.STEP_MODES)
