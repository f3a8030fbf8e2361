"""Lesson 02's library (pinlab.lessons.l02_fake_non_blocking): the pure post-processing, argument
checks, and that every GPU experiment refuses clearly without CUDA. Runs on a CPU."""
import ctypes
import os

import pytest
import torch

import pinlab
from pinlab.detector import FACTORY_SYNC, ITEM_SYNC, PAGEABLE_H2D, detect_stalls
from pinlab.lessons import l02_fake_non_blocking as stalls

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


# ---- the detector demo: lines counted inside the notebook's function -----------------------------

def demo_step(step, weights, inputs_cpu, inputs_gpu, gpu_ms):
    inputs_gpu.copy_(inputs_cpu, non_blocking=True)       # the batch, from pageable memory
    positions = torch.tensor([step] * 64, device="cuda")   # built from a Python list
    hidden = torch.relu(inputs_gpu @ weights) + positions[0]
    pinlab.gpu_busy(gpu_ms)                                # the rest of the forward
    return hidden.sum().item()                             # the loss, read on the host


def test_source_lines_count_from_the_def_line():
    assert stalls.source_lines(demo_step) == {PAGEABLE_H2D: 2, FACTORY_SYNC: 3, ITEM_SYNC: 6}

    def two_copies(a, b):
        a.copy_(b)
        a.copy_(b)

    with pytest.raises(ValueError, match="exactly one line"):
        stalls.source_lines(two_copies, {"a.copy_(": "x"})
    with pytest.raises(ValueError, match="exactly one line"):
        stalls.source_lines(two_copies, {"nowhere": "x"})
    with pytest.raises(TypeError):
        stalls.source_lines(3)


def test_the_detector_points_into_the_function_whatever_its_file():
    # meta tensors stand in for the GPU: the pageable copy is reported at line 2 of demo_step
    w, dev, host = torch.empty(4, 4, device="meta"), torch.empty(4, 4, device="meta"), torch.randn(4, 4)
    with detect_stalls(device_type="meta") as report:
        with pytest.raises(Exception):
            demo_step(0, w, host, dev, 0.5)  # fails later: torch.tensor(..., device="cuda") needs CUDA
    assert report.counts[PAGEABLE_H2D] == 1
    assert stalls.stall_lines(report.events, demo_step) == {PAGEABLE_H2D: [2]}
    assert report.events[0].where.startswith(__file__)


def test_stall_lines_keeps_only_lines_inside_the_function():
    code = demo_step.__code__
    first, file = code.co_firstlineno, code.co_filename
    events = [{"kind": "a", "where": f"{file}:{first + 2}"}, {"kind": "a", "where": f"{file}:{first + 2}"},
              {"kind": "b", "where": f"/elsewhere.py:{first + 2}"}, {"kind": "a", "where": f"{file}:{first + 5}"},
              {"kind": "c", "where": f"{file}:{first - 1}"}, {"kind": "c", "where": f"{file}:{first + 6}"},
              {"kind": "d", "where": "<unknown>"}]
    assert stalls.stall_lines(events, demo_step) == {"a": [3, 6]}
    with pytest.raises(TypeError):
        stalls.stall_lines(events, len)


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


GPU_FUNCTIONS = [(stalls.single_copy_sweep, (_timed_copy,)), (stalls.staging_pool, ()),
                 (stalls.d2h_visibility, (_copy_back,)),
                 (stalls.hidden_syncs, ()), (stalls.step_loop, (_run_steps,)), (stalls.async_h2d_cost, ()),
                 (stalls.detector_demo, (demo_step,))]


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
    (stalls.step_loop, {"step_fn": _run_steps, "trace": "/abs/trace.json"}, ValueError, "relative path"),
    (stalls.step_loop, {"step_fn": _run_steps, "in_flight": 0}, ValueError, "in_flight"),
    (stalls.step_loop, {"step_fn": _run_steps, "gpu_ms": 0}, ValueError, "gpu_ms"),
    (stalls.step_loop, {"step_fn": None}, TypeError, "step_fn"),
    (stalls.async_h2d_cost, {"list_len": True}, TypeError, "list_len"),
    (stalls.detector_demo, {"step_fn": demo_step, "steps": 0}, ValueError, "steps"),
    (stalls.detector_demo, {"step_fn": demo_step, "gpu_ms": float("inf")}, ValueError, "gpu_ms"),
    (stalls.detector_demo, {"step_fn": _timed_copy}, ValueError, "exactly one line"),
])
def test_gpu_experiments_check_arguments_first(fn, kwargs, err, match, no_cuda):
    with pytest.raises(err, match=match):
        fn(**kwargs)
