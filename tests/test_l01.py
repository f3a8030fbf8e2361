"""Lesson 01's library (pinlab.lessons.l01_pinned_memory) on a CPU: the reference answers, the
sizes the notebook sweeps, argument checks before CUDA, and CudaUnavailableError without it."""
from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pinlab
from pinlab import CudaUnavailableError
from pinlab.lessons import l01_pinned_memory as l01
from pinlab.replay import repo_root

KiB, MiB, GiB = l01.KiB, l01.MiB, l01.GiB


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setenv("PINLAB_FORCE_CPU", "1")


# ---- gbps ------------------------------------------------------------------------------------------

def test_gbps_is_decimal_gigabytes_per_second():
    assert math.isclose(l01.gbps(10**9, 1000.0), 1.0)
    assert math.isclose(l01.gbps(2**30, 19.375), 2**30 / 0.019375 / 1e9)
    assert l01.gbps(0, 1.0) == 0.0
    assert math.isclose(l01.gbps(1024.0, 0.001), 1.024)


@pytest.mark.parametrize("nbytes, ms, err, match", [
    (10, 0, ValueError, "ms must be > 0"),
    (10, -1.0, ValueError, "ms must be > 0"),
    (10, float("nan"), ValueError, "ms must be finite"),
    (10, float("inf"), ValueError, "ms must be finite"),
    (-1024, 1.0, ValueError, "nbytes must be >= 0"),
    ("1024", 1.0, TypeError, "nbytes must be a number"),
    (1024, None, TypeError, "ms must be a number"),
    (True, 1.0, TypeError, "nbytes must be a number"),
])
def test_gbps_rejects_bad_arguments_naming_them(nbytes, ms, err, match):
    with pytest.raises(err, match=match):
        l01.gbps(nbytes, ms)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 2**40), st.floats(1e-4, 1e5))
def test_gbps_scales_with_bytes_and_inversely_with_time(nbytes, ms):
    r = l01.gbps(nbytes, ms)
    assert r > 0
    assert math.isclose(l01.gbps(2 * nbytes, ms), 2 * r)
    assert math.isclose(l01.gbps(nbytes, 2 * ms), r / 2)


# ---- n_half ----------------------------------------------------------------------------------------

def test_n_half_examples():
    assert l01.n_half([1024, 4096, 16384], [1.0, 2.0, 4.0]) == 4096          # exactly half counts
    assert l01.n_half([4096, 1024, 65536], [20.0, 1.0, 30.0]) == 4096        # sizes in any order
    assert l01.n_half([1, 2, 4, 8], [1.0, 9.0, 3.0, 10.0]) == 2              # rates need not grow
    assert l01.n_half([1024, 2048, 4096], [4.6, 5.0, 9.5]) == 2048           # 4.6 < 9.5 / 2, though >= 9.5 // 2
    assert l01.n_half([7], [0.0]) == 7


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 2**31), st.floats(0, 1e3)), min_size=1, max_size=12,
                unique_by=lambda p: p[0]))
def test_n_half_is_the_smallest_size_at_half_the_peak(pairs):
    sizes, rates = [p[0] for p in pairs], [p[1] for p in pairs]
    n = l01.n_half(sizes, rates)
    peak = max(rates)
    rate_at = dict(pairs)
    assert rate_at[n] >= peak / 2
    assert all(r < peak / 2 for s, r in pairs if s < n)


@pytest.mark.parametrize("sizes, rates, err, match", [
    ([], [], ValueError, "sizes must not be empty"),
    ([1, 2], [1.0], ValueError, "equally long"),
    ([1, 2], [1.0, -2.0], ValueError, r"rates\[1\] must be >= 0"),
    ([1, 2], [1.0, float("nan")], ValueError, r"rates\[1\] must be finite"),
    ([1, "2"], [1.0, 2.0], TypeError, r"sizes\[1\] must be a number"),
    ([0, 2], [1.0, 2.0], ValueError, r"sizes\[0\] must be > 0"),
    (1024, [1.0], TypeError, "sizes must be a list"),
    ([1024], "1.0", TypeError, "rates must be a list"),
])
def test_n_half_rejects_bad_arguments_naming_them(sizes, rates, err, match):
    with pytest.raises(err, match=match):
        l01.n_half(sizes, rates)


# ---- the sizes the notebook uses --------------------------------------------------------------------

def test_sweep_sizes_go_from_1_kib_to_1_gib_by_4x():
    s = l01.DEFAULT_SIZES
    assert s[0] == KiB and s[-1] == GiB
    assert all(b == 4 * a for a, b in zip(s, s[1:]))


def test_latency_sizes_are_small_and_include_1_and_16_kib():
    s = l01.LATENCY_SIZES
    assert KiB in s and 16 * KiB in s and max(s) <= MiB
    assert s == sorted(s)


def test_pin_cost_sizes_include_the_256_mib_row_the_notebook_plots():
    assert 256 * MiB in l01.PIN_COST_SIZES
    assert max(l01.PIN_COST_SIZES) <= 256 * MiB   # 1 GiB cold pins cost seconds: kept out of the 12 s budget


def test_rounding_request_rounds_up_to_twice_256_mib_half():
    assert pinlab.next_pow2(l01.ROUNDING_REQUEST) == 256 * MiB
    assert l01.ROUNDING_REQUEST > 128 * MiB


def test_recorded_sweep_keeps_the_schema_the_notebook_reads():
    """The notebook's own bandwidth_sweep must keep returning these rows, or the replay breaks."""
    path = repo_root() / "reports" / "gpu" / "data" / "01_bandwidth.json"
    stored = json.loads(path.read_text())
    assert stored["params"] == {"sizes": l01.DEFAULT_SIZES, "repeat": 5}
    keys = {"bytes", "h2d_pinned_ms", "h2d_pageable_ms", "d2h_pinned_ms", "d2h_pageable_ms"}
    assert [r["bytes"] for r in stored["result"]] == l01.DEFAULT_SIZES
    assert all(set(r) == keys for r in stored["result"])


# ---- GPU experiments: arguments first, then CUDA ----------------------------------------------------

GPU_CALLS = [
    ("copy_loop_peak()", lambda: l01.copy_loop_peak()),
    ("pin_cost()", lambda: l01.pin_cost()),
    ("pinned_rounding()", lambda: l01.pinned_rounding()),
]


@pytest.mark.parametrize("name,call", GPU_CALLS, ids=[n for n, _ in GPU_CALLS])
def test_gpu_experiments_need_cuda(no_cuda, name, call):
    with pytest.raises(CudaUnavailableError, match=name.replace("(", r"\(").replace(")", r"\)")):
        call()


@pytest.mark.parametrize("call, err, match", [
    (lambda: l01.copy_loop_peak(nbytes=0), ValueError, "nbytes must be > 0"),
    (lambda: l01.copy_loop_peak(iters=2.5), TypeError, "iters must be an int"),
    (lambda: l01.copy_loop_peak(trials=-1), ValueError, "trials must be > 0"),
    (lambda: l01.pin_cost(sizes=[]), ValueError, "sizes must not be empty"),
    (lambda: l01.pin_cost(sizes=[MiB, 0]), ValueError, r"sizes\[1\] must be > 0"),
    (lambda: l01.pin_cost(sizes=1024), TypeError, "sizes must be a list"),
    (lambda: l01.pinned_rounding(request_bytes=0), ValueError, "request_bytes must be > 0"),
    (lambda: l01.pinned_rounding(request_bytes="1"), TypeError, "request_bytes must be an int"),
])
def test_arguments_are_checked_before_cuda(no_cuda, call, err, match):
    with pytest.raises(err, match=match):
        call()


# ---- who pins: the DataLoader's data set, the speed-up from threads, its plot ---------------------

def test_pageable_batches_yields_fresh_pageable_batches_of_the_size_asked():
    ds = l01.PageableBatches(3, 4 * KiB)
    assert len(ds) == 3
    a, b = ds[0], ds[2]
    assert a.numel() * a.element_size() == 4 * KiB and a.dtype == l01.torch.float32
    assert not a.is_pinned() and a.data_ptr() != b.data_ptr()       # a new tensor per item
    assert a.data_ptr() != ds.data.data_ptr()


def test_pageable_batches_works_in_a_dataloader_with_batch_size_none():
    from torch.utils.data import DataLoader

    got = list(DataLoader(l01.PageableBatches(4, 64), batch_size=None))
    assert len(got) == 4 and all(t.shape == (16,) for t in got)


@pytest.mark.parametrize("call, err, match", [
    (lambda: l01.PageableBatches(0, 64), ValueError, "batches must be > 0"),
    (lambda: l01.PageableBatches(2.0, 64), TypeError, "batches must be an int"),
    (lambda: l01.PageableBatches(2, 6), ValueError, "nbytes must be a multiple of 4"),
    (lambda: l01.PageableBatches(2, 2 * GiB), ValueError, "nbytes must be <="),
    (lambda: l01.PageableBatches(2, 64)[2], IndexError, r"i must be in \[0, 2\)"),
    (lambda: l01.PageableBatches(2, 64)[-1], IndexError, "i must be in"),
    (lambda: l01.PageableBatches(2, 64)["0"], TypeError, "i must be an int"),
])
def test_pageable_batches_rejects_bad_arguments_naming_them(call, err, match):
    with pytest.raises(err, match=match):
        call()


def test_speedups_are_one_thread_time_over_each_pool_size_time():
    assert l01.speedups({1: 8.0, 2: 4.0, 4: 4.0, 8: 16.0}) == {1: 1.0, 2: 2.0, 4: 2.0, 8: 0.5}
    # lists: their medians are compared (here 10 and 5)
    assert l01.speedups({2: [5.0, 4.0, 90.0], 1: [10.0, 11.0, 9.0]}) == {1: 1.0, 2: 2.0}
    assert list(l01.speedups({8: 1.0, 1: 1.0, 2: 1.0})) == [1, 2, 8]


@pytest.mark.parametrize("arg, err, match", [
    ({}, TypeError, "ms_by_threads must be a non-empty dict"),
    ([1.0], TypeError, "ms_by_threads must be a non-empty dict"),
    ({2: 1.0}, ValueError, "one-thread entry"),
    ({1: 1.0, 0: 1.0}, ValueError, "threads"),
    ({1: 1.0, 2: 0.0}, ValueError, r"ms_by_threads\[2\] must be > 0"),
    ({1: 1.0, 2: []}, ValueError, r"ms_by_threads\[2\] must not be an empty list"),
    ({1: [1.0, float("nan")]}, ValueError, r"ms_by_threads\[1\]\[1\] must be finite"),
    ({1: "1"}, TypeError, r"ms_by_threads\[1\] must be a number"),
])
def test_speedups_reject_bad_input_naming_it(arg, err, match):
    with pytest.raises(err, match=match):
        l01.speedups(arg)


def test_plot_pin_threads_draws_cold_warm_and_perfect_scaling():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pool = [t for t in l01.PIN_THREADS if t > 0]
    assert l01.PIN_THREADS[0] == 0 and pool == sorted(pool) and 1 in pool
    rows = [{"threads": t, "cold_ms": [64.0 / t ** 0.2] * 3, "warm_ms": [8.0 / t, 9.0 / t]} for t in pool]
    ax = l01.plot_pin_threads(rows, title="t")
    assert len(ax.lines) == 4            # cold, its perfect scaling, warm, its perfect scaling
    assert list(ax.lines[2].get_ydata()) == [8.5 / t for t in pool]   # medians
    assert list(ax.lines[2].get_xdata()) == pool
    # the main thread (threads 0) is a horizontal line per kind, at its median
    main = {"threads": 0, "cold_ms": [70.0, 71.0, 90.0], "warm_ms": [3.0]}
    ax = l01.plot_pin_threads([main] + rows, title="t")
    assert len(ax.lines) == 6
    assert {tuple(ln.get_ydata()) for ln in ax.lines if ln.get_linestyle() == "--"} == {(71.0, 71.0), (3.0, 3.0)}
    plt.close("all")
    with pytest.raises(TypeError, match="rows must be a non-empty list"):
        l01.plot_pin_threads([], title="t")
    with pytest.raises(ValueError, match="at least one pool size"):
        l01.plot_pin_threads([main], title="t")
    with pytest.raises(ValueError, match=r"rows\[0\]\['threads'\] must be >= 0"):
        l01.plot_pin_threads([{"threads": -1, "cold_ms": [1.0], "warm_ms": [1.0]}], title="t")


# ---- issue 22: pinning knobs and failures (the children need a GPU; their parsing does not)

def test_child_result_reads_the_line_or_says_what_went_wrong():
    from pinlab.child import child_result

    assert child_result('noise\nPINLAB_CHILD {"ms": 1.5, "pinned": true}\n') == {"ms": 1.5, "pinned": True}
    bad = child_result("", "Traceback ...\nRuntimeError: unrecognized key pinned_max_round_threshold_mb\n", 1)
    assert bad["error"].startswith("the child exited with 1") and "unrecognized key" in bad["error"]
    assert child_result("", "", -9)["error"] == "the child exited with -9 and no result"


def test_the_knob_settings_name_real_allocator_keys():
    from pinlab.lessons import l01_pinned_memory as l01

    keys = {kv.split(":")[0] for conf in l01.PINNING_CONFIGS.values() if conf for kv in conf.split(",")}
    assert keys == {"pinned_use_cuda_host_register", "pinned_num_register_threads", "pinned_max_round_threshold_mb"}
    assert l01.KNOB_REQUEST & (l01.KNOB_REQUEST - 1), "the request must not be a power of two (rounding shows)"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
@pytest.mark.parametrize("name", ["pinning_knobs", "pinning_under_memlock", "pageable_and_memcpy"])
def test_issue22_experiments_need_cuda(name):
    from pinlab.lessons import l01_pinned_memory as l01

    with pytest.raises(pinlab.CudaUnavailableError, match=name):
        getattr(l01, name)()


@pytest.mark.parametrize("kwargs, match", [({"request_bytes": 0}, "request_bytes"), ({"configs": {}}, "configs"),
                                           ({"configs": {"x": 1}}, "configs"), ({"timeout_s": -1.0}, "timeout_s")])
def test_pinning_knobs_bad_arguments(kwargs, match):
    from pinlab.lessons import l01_pinned_memory as l01

    with pytest.raises((TypeError, ValueError), match=match):
        l01.pinning_knobs(**kwargs)


def test_numa_report_never_raises():
    from pinlab.lessons import l01_pinned_memory as l01

    rep = l01.numa_report()
    assert set(rep) == {"nodes", "gpu_node"}
    assert rep["nodes"] is None or rep["nodes"] >= 1


# ---- issue 22: the pure helpers behind the notebook's sentences ---------------------------------------

def test_may_lock_any_reads_cap_ipc_lock_from_capeff():
    assert l01.may_lock_any("000001ffffffffff") is True       # root outside a container: every capability
    assert l01.may_lock_any("00000000a80425fb") is False      # Docker's default set: no CAP_IPC_LOCK
    assert l01.may_lock_any("0000000000004000") is True       # bit 14 alone
    assert l01.may_lock_any("0000000000003fff") is False
    assert l01.may_lock_any(None) is None
    with pytest.raises(ValueError, match="cap_eff"):
        l01.may_lock_any("not hex")
    with pytest.raises(TypeError, match="cap_eff"):
        l01.may_lock_any(0x4000)


def test_unknown_alloc_key_finds_the_refused_setting():
    err = ("the child exited with 1 and no result: ValueError: Unrecognized key 'pinned_max_round_threshold_mb' "
           "in CUDA allocator config.")
    assert l01.unknown_alloc_key(err) == "pinned_max_round_threshold_mb"
    assert l01.unknown_alloc_key("RuntimeError: CUDA error: out of memory") is None
    assert l01.unknown_alloc_key(None) is None
    assert "pinned_max_round_threshold_mb" in l01.KNOB_SINCE


def test_memlock_sentence_follows_the_row():
    base = {"setting": "default (cudaHostAlloc)", "pinned": True, "ms": 1.0, "held_bytes": 256 * MiB}
    root = l01.memlock_sentence({**base, "euid": 0, "cap_eff": "000001ffffffffff"}, 64 * MiB)
    assert "could not bite here" in root and "root" in root
    capped = l01.memlock_sentence({**base, "euid": 1000, "cap_eff": "0000000000004000"}, 64 * MiB)
    assert "could not bite here" in capped and "root" not in capped
    plain = l01.memlock_sentence({**base, "euid": 1000, "cap_eff": "0000000000000000"}, 64 * MiB)
    assert "did not count" in plain and "could not bite" not in plain
    failed = l01.memlock_sentence({"setting": "x", "error": "RuntimeError: CUDA error: out of memory"}, 64 * MiB)
    assert "failed under a 64 MiB memlock limit" in failed and "out of memory" in failed
    with pytest.raises(TypeError, match="row"):
        l01.memlock_sentence({}, 64 * MiB)


@pytest.mark.parametrize("share, word", [(1.5, "faster than it"), (0.9, "close to it"), (0.3, "well below it")])
def test_pageable_sentence_follows_the_ratio(share, word):
    text = l01.pageable_sentence({"bytes": 64 * MiB, "h2d_gbps": 10 * share, "memcpy_1t_gbps": 10.0})
    assert word in text and "64 MiB" in text and f"{share:.0%}" in text


def test_pageable_sentence_adds_the_threaded_copy_where_it_was_measured():
    row = {"bytes": 16 * MiB, "h2d_gbps": 13.0, "memcpy_1t_gbps": 10.0, "memcpy_gbps": 26.0}
    text = l01.pageable_sentence(row)
    assert "130% of the host's one-thread memcpy" in text and "does not bound it here" in text
    assert text.endswith("and at 50% of torch's threaded host copy")
    assert "threaded" not in l01.pageable_sentence({k: v for k, v in row.items() if k != "memcpy_gbps"})
    with pytest.raises(ValueError, match="memcpy_gbps"):
        l01.pageable_sentence({**row, "memcpy_gbps": 0})


def test_pageable_summary_counts_by_the_sentences_threshold():
    def row(share):
        return {"bytes": 16 * MiB, "h2d_gbps": 10.0 * share, "memcpy_1t_gbps": 10.0}

    # the quiet run's case: faster at two sizes, 82% at the third (the summary used to say "did not bound it here")
    mixed = l01.pageable_summary([row(1.3), row(1.2), row(0.82)])
    assert mixed.startswith("pageable H2D ran faster than one thread's memcpy at 2 of 3 sizes: at those sizes")
    assert "at the other size it ran close to or below it" in mixed
    assert "at the others it ran" in l01.pageable_summary([row(1.3), row(0.8), row(0.5)])
    assert l01.pageable_summary([row(1.3), row(1.2)]).endswith("did not bound it at any size")
    # 1.05x is "close to it" in pageable_sentence, so it is not counted as faster here either
    assert "close to it" in l01.pageable_sentence(row(1.05))
    assert l01.pageable_summary([row(1.05), row(0.5)]).endswith(": at every size it ran no faster than one thread's memcpy")
    assert "at 0 of 2 sizes" in l01.pageable_summary([row(1.05), row(0.5)])
    with pytest.raises(ValueError, match="at least one row"):
        l01.pageable_summary([])
    with pytest.raises(ValueError, match="memcpy_1t_gbps"):
        l01.pageable_summary([row(1.0), {**row(1.0), "memcpy_1t_gbps": 0}])


def test_pageable_and_memcpy_changes_no_thread_pool_in_its_timed_rounds():
    """Issue 33: toggling torch.set_num_threads inside the timed rounds skewed them; the one-thread copy is
    the C library's memmove, and nothing in the function calls set_num_threads (or set_num_interop_threads)."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(l01.pageable_and_memcpy)))
    called = {n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
    assert "memmove" in called
    assert not called & {"set_num_threads", "set_num_interop_threads"}


def test_pageable_sentence_rejects_a_zero_rate():
    with pytest.raises(ValueError, match="memcpy_1t_gbps"):
        l01.pageable_sentence({"bytes": MiB, "h2d_gbps": 1.0, "memcpy_1t_gbps": 0})


def test_numa_sentence():
    assert "one NUMA node" in l01.numa_sentence(1, -1)
    assert "node 1" in l01.numa_sentence(2, 1)
    assert "not known" in l01.numa_sentence(2, -1) and "not known" in l01.numa_sentence(4, None)
    assert "does not say" in l01.numa_sentence(None, None)
    with pytest.raises(ValueError, match="nodes"):
        l01.numa_sentence(0, None)
