"""Bad input, generated: every public function of the shared modules fails clearly or answers right.

For each public function (what ``pinlab.__all__`` exports from the shared modules, the plotting
helpers, the take-home tools ``h2d`` and ``paged_kv``, and the checkers' core) hypothesis
generates wrong types, negative / zero / huge / NaN / inf numbers, empty, non-contiguous, wrong
dtype and device tensors, and inconsistent metadata. The call must

* raise ``TypeError`` or ``ValueError`` whose message names the argument (or, for valid
  arguments of a GPU-only call on this CPU machine, the course's ``CudaUnavailableError``),
* within the deadline (no hang, no huge allocation),
* and never return a wrong result: where a generated input may still be valid, the answer is
  compared with a plain-Python one.

Deterministic (``derandomize``, no example database) and fast (a few seconds on 2 cores).
"""
from __future__ import annotations

import math
import os
from datetime import timedelta

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pinlab
from pinlab import args as pargs
from pinlab import busy, h2d, hostmem, paged_kv, plots, replay, timing
from pinlab.args import CudaUnavailableError
from pinlab.checks import as_int, run_cases, same_int

#: The loaded profile (conftest.py: derandomized, no database) with this suite's example counts and a
#: deadline that catches a hang or a huge allocation, not a slow machine: 30 s per example (the heaviest
#: example takes well under a second warm; imports are warmed before any example runs, below).
#: PINLAB_BAD_INPUT_EXAMPLES=500 (the "deep" profile) searches deeper, with a fresh random seed.
_DEEP = int(os.environ.get("PINLAB_BAD_INPUT_EXAMPLES", "0"))
PROFILE = settings(max_examples=_DEEP or 30, deadline=timedelta(seconds=30),
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
FEW = settings(PROFILE, max_examples=max(15, _DEEP // 4))


@pytest.fixture(scope="module", autouse=True)
def _warm_imports():
    """Import what the first examples would otherwise import inside their timed body (cold, about 6 s):
    ``torch.testing.assert_close`` pulls in ``torch.distributed.tensor``."""
    import importlib

    torch.testing.assert_close(torch.zeros(2, 2).t(), torch.zeros(2, 2))
    importlib.import_module("torch.distributed.tensor")


@pytest.fixture(autouse=True)
def _cpu_only(monkeypatch):
    """Behave as a CPU-only machine even on a GPU host (GPU-only calls then raise CudaUnavailableError)."""
    monkeypatch.setenv("PINLAB_FORCE_CPU", "1")


def clear_error(call, *names, cuda_ok: bool = False):
    """``call()`` must raise TypeError/ValueError naming one of ``names`` (CudaUnavailableError
    too where ``cuda_ok``); a return is a silent wrong result."""
    try:
        result = call()
    except CudaUnavailableError as exc:
        assert cuda_ok, f"a bad argument was reported as a missing GPU: {exc}"
        return exc
    except (TypeError, ValueError) as exc:
        msg = str(exc)
        assert any(n in msg for n in names), f"{type(exc).__name__}({msg!r}) does not name any of {names}"
        return exc
    raise AssertionError(f"returned {result!r:.200} instead of rejecting the input")


# ----------------------------------------------------------------- generated bad values

def _tensor_scalars():
    return st.sampled_from([torch.tensor(1.0), torch.tensor([1, 2]), torch.tensor(True)])


NOT_A_NUMBER = st.one_of(st.none(), st.booleans(), st.text(max_size=4), st.lists(st.text(max_size=1), max_size=2),
                         st.dictionaries(st.text(max_size=2), st.integers(), max_size=1), st.just(object()),
                         st.complex_numbers(allow_nan=False, max_magnitude=5), _tensor_scalars())
NOT_FINITE = st.sampled_from([math.nan, math.inf, -math.inf])
NEGATIVE = st.one_of(st.integers(max_value=-1), st.floats(max_value=-1e-9, allow_nan=False, allow_infinity=False))
NOT_AN_INT = st.one_of(NOT_A_NUMBER, st.floats(allow_nan=True), st.sampled_from([np.float64(2.0), 2.0]))


def bad_positive_int(maximum=None, allow_zero=False):
    wrong_value = st.integers(max_value=-1 if allow_zero else 0)
    parts = [NOT_AN_INT, wrong_value]
    if maximum is not None:
        parts.append(st.integers(min_value=maximum + 1, max_value=maximum * 4 + 2**70))
    return st.one_of(*parts)


BAD_DURATION = st.one_of(NOT_A_NUMBER, NOT_FINITE, NEGATIVE)
NOT_CALLABLE = st.one_of(st.none(), st.integers(), st.text(max_size=3), st.lists(st.integers(), max_size=2))
NOT_A_STR = st.one_of(st.none(), st.integers(), st.floats(allow_nan=True), st.lists(st.text(max_size=2), max_size=2))
NOT_A_BOOL = st.one_of(st.none(), st.integers(), st.text(max_size=3), st.floats(allow_nan=True))


# ----------------------------------------------------------------- args.py

@PROFILE
@given(st.one_of(bad_positive_int(maximum=100)), st.booleans())
def test_positive_int(bad, allow_zero):
    if allow_zero and type(bad) is int and bad == 0:
        return
    clear_error(lambda: pargs.positive_int("count", bad, allow_zero=allow_zero, maximum=100), "count")


@PROFILE
@given(st.one_of(BAD_DURATION, st.floats(min_value=101, allow_infinity=False), st.integers(min_value=2**1100)))
def test_positive_number(bad):
    clear_error(lambda: pargs.positive_number("rate", bad, maximum=100), "rate")


@PROFILE
@given(st.one_of(st.none(), st.integers(), st.text(max_size=3), st.just({1: 2}), _tensor_scalars(),
                 st.lists(st.one_of(NOT_AN_INT, st.integers(max_value=0)), min_size=1, max_size=3), st.just([])))
def test_size_list(bad):
    clear_error(lambda: pargs.size_list("sizes", bad), "sizes")


# ----------------------------------------------------------------- timing.py, busy.py

@PROFILE
@given(BAD_DURATION)
def test_fmt_ms(bad):
    clear_error(lambda: timing.fmt_ms(bad), "ms")


@PROFILE
@given(st.floats(min_value=0, max_value=1e15, allow_nan=False))
def test_fmt_ms_is_right_for_every_duration(ms):
    value, unit = timing.fmt_ms(ms).split()
    scale = {"ns": 1e-6, "µs": 1e-3, "ms": 1.0, "s": 1e3}[unit]
    assert abs(float(value) * scale - ms) <= 0.5 * scale * (1 if unit == "ns" else 0.1 if unit == "µs" else 0.01) + 1e-12


@PROFILE
@given(st.sampled_from(["label", "value", "unit"]), st.data())
def test_report(which, data):
    kw = {"label": "copy", "value": 1.0, "unit": "ms"}
    kw[which] = data.draw({"label": st.one_of(NOT_A_STR, st.just(""), st.just("a\nb")),
                           "value": BAD_DURATION, "unit": NOT_A_STR}[which])
    clear_error(lambda: timing.report(kw["label"], kw["value"], kw["unit"]), which)


@PROFILE
@given(st.one_of(NOT_A_NUMBER.filter(lambda v: not (isinstance(v, torch.Tensor) and v.dim())),  # a 1-D tensor is fine
                 st.lists(st.one_of(NOT_A_NUMBER, NOT_FINITE, NEGATIVE), min_size=1, max_size=3),
                 st.just([]), st.just(torch.tensor([1.0, -2.0])), st.just(np.array([math.nan]))))
def test_stats_of(bad):
    if isinstance(bad, dict) and bad == {}:
        bad = {"a": 1}
    clear_error(lambda: timing.Stats.of(bad), "samples_ms")


@PROFILE
@given(st.sampled_from(["rows", "columns"]), st.data())
def test_table(which, data):
    kw = {"rows": [{"a": 1}], "columns": [("a", "A")]}
    kw[which] = data.draw({
        "rows": st.one_of(st.none(), st.integers(), st.just([]), st.lists(st.one_of(st.integers(), st.just({"b": 1})),
                                                                          min_size=1, max_size=3)),
        "columns": st.one_of(st.none(), st.integers(), st.just([]), st.just(["a"]), st.just([("a",)]),
                             st.just([("a", "A", "not callable")]), st.just([("a", 5)])),
    }[which])
    clear_error(lambda: timing.table(kw["rows"], kw["columns"]), which, "rows", "columns")


@PROFILE
@given(st.sampled_from(["fn", "repeat", "warmup", "setup", "sync_after"]), st.data())
def test_host_time(which, data):
    kw = {"fn": lambda: None, "repeat": 2, "warmup": 0, "setup": None, "sync_after": True}
    kw[which] = data.draw({"fn": NOT_CALLABLE, "setup": st.one_of(st.integers(), st.text(min_size=1, max_size=3)),
                           "repeat": bad_positive_int(timing.MAX_REPEAT),
                           "warmup": bad_positive_int(timing.MAX_REPEAT, allow_zero=True),
                           "sync_after": NOT_A_BOOL}[which])
    fn = kw.pop("fn")
    clear_error(lambda: timing.host_time(fn, **kw), which)


@PROFILE
@given(st.sampled_from(["fn", "repeat", "warmup"]), st.data())
def test_cuda_time(which, data):
    kw = {"fn": lambda: None, "repeat": 2, "warmup": 0}
    kw[which] = data.draw({"fn": NOT_CALLABLE, "repeat": bad_positive_int(timing.MAX_REPEAT),
                           "warmup": bad_positive_int(timing.MAX_REPEAT, allow_zero=True)}[which])
    fn = kw.pop("fn")
    clear_error(lambda: timing.cuda_time(fn, **kw), which)


def test_gpu_only_calls_with_good_arguments_say_cuda_is_missing():
    for call in (lambda: timing.cuda_time(lambda: None), lambda: busy.gpu_busy(1.0), busy.cycles_per_ms,
                 lambda: h2d.pin_snapshot(torch.ones(2)), lambda: h2d.async_tensor_h2d([1])):
        with pytest.raises(CudaUnavailableError, match="needs a CUDA GPU"):
            call()


@PROFILE
@given(st.one_of(BAD_DURATION, st.just(0), st.floats(min_value=busy.MAX_BUSY_MS * 1.01, allow_infinity=False)))
def test_gpu_busy(bad):
    clear_error(lambda: busy.gpu_busy(bad), "ms")


@PROFILE
@given(st.one_of(st.tuples(st.just("repeat"), bad_positive_int(busy.MAX_WARMUP_REPEAT)),
                 st.tuples(st.just("fns[0]"), NOT_CALLABLE)))
def test_warmup_and_wall_ms(case):
    which, bad = case
    if which == "repeat":
        clear_error(lambda: busy.warmup(lambda: None, repeat=bad), "repeat")
    else:
        clear_error(lambda: busy.warmup(bad), "fns[0]")
        clear_error(lambda: busy.wall_ms(bad), "fn")


# ----------------------------------------------------------------- hostmem, progress, device, doctor, replay

@PROFILE
@given(st.one_of(NOT_AN_INT, NEGATIVE.filter(lambda v: isinstance(v, int))))
def test_pinned_back_to(bad):
    clear_error(lambda: hostmem.pinned_back_to(bad), "baseline")


@PROFILE
@given(st.one_of(NOT_AN_INT, st.integers(max_value=0)))
def test_next_pow2(bad):
    clear_error(lambda: hostmem.next_pow2(bad), "n")


@PROFILE
@given(st.integers(min_value=1, max_value=2**200))
def test_next_pow2_is_right(n):
    p = hostmem.next_pow2(n)
    assert p >= n and p & (p - 1) == 0 and (p == 1 or p // 2 < n)


@PROFILE
@given(st.sampled_from(["iterable", "desc", "total"]), st.data())
def test_progress(which, data):
    kw = {"iterable": [1, 2], "desc": "sweep", "total": None}
    kw[which] = data.draw({"iterable": st.one_of(st.none(), st.integers(), st.text(max_size=3), st.floats()),
                           "desc": NOT_A_STR.filter(lambda v: v is not None) | st.just(None),
                           "total": bad_positive_int(allow_zero=True).filter(lambda v: v is not None)}[which])
    clear_error(lambda: pinlab.progress(kw["iterable"], kw["desc"], kw["total"]), which)


@PROFILE
@given(st.one_of(st.integers(), st.floats(), st.lists(st.text(max_size=2), max_size=2)))
def test_header_and_doctor(bad):
    clear_error(lambda: pinlab.header(bad), "lesson")
    clear_error(lambda: pinlab.doctor(verbose=bad), "verbose")


@PROFILE
@given(st.sampled_from(["name", "fn", "quiet"]), st.data())
def test_measure(which, data):
    kw = {"name": "01_ok", "fn": lambda: 1, "quiet": True}
    kw[which] = data.draw({"name": st.one_of(NOT_A_STR, st.text(max_size=6).filter(lambda t: not t[:1].isalnum()
                                                                                    or not t.isascii() or " " in t)),
                           "fn": NOT_CALLABLE, "quiet": NOT_A_BOOL}[which])
    clear_error(lambda: replay.measure(kw["name"], kw["fn"], quiet=kw["quiet"]), which)


@FEW
@given(st.one_of(st.binary(max_size=40).map(lambda b: b.decode("latin-1")),
                 st.sampled_from(['{"meta": {"gpu": "G", "date": "d"}, "params": {}, "result": [1,',
                                  '[]', '{}', 'null', '3', '{"meta": [], "params": {}, "result": 1}',
                                  '{"meta": {"gpu": "G", "date": "d"}, "params": 1, "result": 1}',
                                  '{"meta": {"gpu": 3, "date": "d"}, "params": {}, "result": 1}'])))
def test_recorded_files(tmp_path_factory, text):
    d = tmp_path_factory.mktemp("data")
    path = d / "x.json"
    path.write_text(text, encoding="utf-8")
    try:
        stored = replay.load_recorded(path)
    except replay.ReplayFileError as exc:
        assert str(path) in str(exc) and "\n" not in str(exc)
    else:  # only a well-formed record may load
        assert set(stored) >= {"meta", "params", "result"} and isinstance(stored["meta"]["gpu"], str)


@PROFILE
@given(st.sampled_from(["name", "meta", "live"]), st.data())
def test_run(which, data):
    kw = {"name": "x", "result": 1, "meta": {"gpu": "G", "date": "d"}, "live": False}
    kw[which] = data.draw({"name": st.one_of(st.none(), st.integers()), "meta": st.one_of(st.none(), st.lists(st.integers())),
                           "live": NOT_A_BOOL}[which])
    clear_error(lambda: replay.Run(**kw), which)


# ----------------------------------------------------------------- plots.py

@PROFILE
@given(st.one_of(NOT_A_NUMBER, NOT_FINITE, NEGATIVE))
def test_fmt_bytes(bad):
    clear_error(lambda: plots.fmt_bytes(bad), "n")


@PROFILE
@given(st.integers(min_value=0, max_value=2**80))
def test_fmt_bytes_is_right(n):
    value, unit = plots.fmt_bytes(n).split()
    scale = 1024 ** ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"].index(unit)
    assert math.isclose(float(value) * scale, n, rel_tol=0.05, abs_tol=0.5)
    assert float(value) < 1024 or unit == "EiB"


@FEW
@given(st.sampled_from(["sizes", "series", "ylabel", "title", "hline", "vline"]), st.data())
def test_size_sweep(which, data):
    kw = {"sizes": [1, 2], "series": {"a": [1.0, 2.0]}, "ylabel": "y", "title": "t", "hline": None, "vline": None}
    kw[which] = data.draw({
        "sizes": st.one_of(st.none(), st.just([]), st.lists(st.one_of(NOT_A_NUMBER, NOT_FINITE, st.just(0), NEGATIVE),
                                                             min_size=2, max_size=2)),
        "series": st.one_of(st.none(), st.just({}), st.just({"a": [1.0]}), st.just({"a": [math.nan, 1.0]}),
                            st.just({"a": ["x", 1.0]}), st.just({"a": 3})),
        "ylabel": NOT_A_STR, "title": NOT_A_STR,
        "hline": st.one_of(st.integers(), st.just((math.inf, "x")), st.just(("a", "b")), st.just((0, "zero"))),
        "vline": st.one_of(st.integers(), st.just((math.nan, "x")), st.just((0, "x")), st.just((1, 2))),
    }[which])
    try:
        clear_error(lambda: plots.size_sweep(**kw), which, "sizes", "series")
    finally:
        plots.plt.close("all")


@FEW
@given(st.sampled_from(["labels", "values", "annotate", "lanes"]), st.data())
def test_bars_and_timeline(which, data):
    try:
        if which == "lanes":
            bad = data.draw(st.one_of(st.none(), st.just({}), st.just({"h": [(0, 1)]}), st.just({"h": [(0, "x", "a")]}),
                                      st.just({"h": [(2, 1, "a")]}), st.just({"h": [(math.nan, 1, "a")]}),
                                      st.just({"h": 3})))
            clear_error(lambda: plots.timeline(bad, title="t"), "lanes", "span")
            return
        kw = {"labels": ["a", "b"], "values": [1.0, 2.0], "annotate": "{:.1f}"}
        kw[which] = data.draw({
            "labels": st.one_of(st.none(), st.just([]), st.just(["a"])),
            "values": st.one_of(st.none(), st.lists(st.one_of(NOT_A_NUMBER, NOT_FINITE), min_size=2, max_size=2)),
            "annotate": st.one_of(NOT_A_STR, st.just("{x}"), st.just("{:d}"), st.just("{1}")),
        }[which])
        clear_error(lambda: plots.bars(kw["labels"], kw["values"], ylabel="y", title="t", annotate=kw["annotate"]),
                    which, "labels and values", "values")
    finally:
        plots.plt.close("all")


# ----------------------------------------------------------------- h2d.py

BAD_DEVICES = st.one_of(st.sampled_from(["cpu", "meta", "banana", "", "cuda:x", -1, 1.5, None, True]),
                        st.just(torch.device("cpu")))


@PROFILE
@given(st.sampled_from(["data", "dtype", "device"]), st.data())
def test_async_tensor_h2d(which, data):
    kw = {"data": [1, 2], "dtype": None, "device": "cuda"}
    kw[which] = data.draw({
        "data": st.one_of(st.none(), st.integers(), st.text(max_size=3), st.just({1: 2}), st.just(torch.ones(2, device="meta"))),
        "dtype": st.one_of(st.text(max_size=5), st.integers(), st.just(np.float32)),
        "device": BAD_DEVICES,
    }[which])
    clear_error(lambda: h2d.async_tensor_h2d(**kw), which)


@PROFILE
@given(st.one_of(st.lists(st.text(min_size=1, max_size=2), min_size=1, max_size=2),
                 st.just([[1, 2], [3]]), st.just([2**70]), st.just([None, 1]), st.just([{}]),
                 st.just(np.array(["a", "b"])), st.just(np.array([object()]))))
def test_stage_on_host_bad_lists_and_arrays(bad):
    clear_error(lambda: h2d.stage_on_host(bad, pin_memory=False), "data")


@PROFILE
@given(st.lists(st.integers(-2**40, 2**40), max_size=20), st.sampled_from([None, torch.int64, torch.float64]),
       st.booleans())
def test_stage_on_host_is_right(values, dtype, strided):
    src = torch.tensor(values, dtype=torch.int64)
    if strided:
        src = torch.stack([src, src], dim=1)[:, 0]  # non-contiguous
    out = h2d.stage_on_host(src, dtype, pin_memory=False)
    assert out.is_contiguous() and out.dtype == (dtype or torch.int64)
    assert out.tolist() == src.to(out.dtype).tolist() and (not out.numel() or out.data_ptr() != src.data_ptr())


@PROFILE
@given(st.one_of(st.none(), st.integers(), st.lists(st.integers(), max_size=2), st.just(np.ones(2)),
                 st.just(torch.ones(2, device="meta"))))
def test_pin_snapshot(bad):
    clear_error(lambda: h2d.pin_snapshot(bad), "t")


@PROFILE
@given(st.tuples(NOT_A_BOOL, st.booleans()) | st.tuples(st.booleans(), NOT_A_BOOL))
def test_snapshot_method(pair):
    clear_error(lambda: h2d.snapshot_method(*pair), "is_pinned", "is_contiguous")


@PROFILE
@given(BAD_DEVICES)
def test_cuda_device(bad):
    clear_error(lambda: h2d.cuda_device(bad), "device")


# ----------------------------------------------------------------- paged_kv.py: metadata

INT_LISTS = st.lists(st.integers(min_value=0, max_value=2**63 - 1), min_size=1, max_size=6)
PAGE_SIZES = st.integers(min_value=1, max_value=2**40)


def _ceil(a, b):
    return -(-a // b)


@PROFILE
@given(INT_LISTS, PAGE_SIZES)
def test_metadata_is_exact_or_refused(seq_lens, page_size):
    """Any length and page size: the int32 metadata is exact, or a ValueError names what does not fit."""
    pages = [_ceil(s, page_size) for s in seq_lens]
    indptr = [0]
    for p in pages:
        indptr.append(indptr[-1] + p)
    last = [0 if s == 0 else s - (p - 1) * page_size for s, p in zip(seq_lens, pages)]
    fits = page_size < 2**31 and indptr[-1] < 2**31
    for fn, want in ((paged_kv.num_pages, pages), (paged_kv.kv_indptr, indptr), (paged_kv.last_page_len, last)):
        tensor_input = torch.tensor(seq_lens, dtype=torch.int64)
        for arg in (seq_lens, tensor_input):
            if fits or (fn is paged_kv.last_page_len and page_size < 2**31) or (
                    fn is paged_kv.num_pages and page_size < 2**31 and max(pages) < 2**31):
                out = fn(arg, page_size)
                assert out.dtype == torch.int32 and out.tolist() == want
            else:
                clear_error(lambda: fn(arg, page_size), "seq_lens", "page_size")


BAD_SEQ_LENS = st.one_of(
    st.none(), st.integers(), st.text(max_size=3),
    st.lists(st.one_of(NOT_AN_INT, NEGATIVE.filter(lambda v: isinstance(v, int)),
                       st.integers(min_value=2**63)), min_size=1, max_size=3),
    st.sampled_from([torch.tensor([1.0, 2.0]), torch.tensor([[1, 2]]), torch.tensor([3, -1]), torch.tensor([True]),
                     torch.tensor(5)]),
)


@PROFILE
@given(st.sampled_from(["seq_lens", "page_size"]), st.sampled_from(["num_pages", "kv_indptr", "last_page_len"]),
       st.data())
def test_metadata_bad_arguments(which, fname, data):
    kw = {"seq_lens": [3, 17], "page_size": 16}
    kw[which] = data.draw(BAD_SEQ_LENS if which == "seq_lens" else bad_positive_int(2**31 - 1))
    fn = getattr(paged_kv, fname)
    clear_error(lambda: fn(kw["seq_lens"], kw["page_size"]), which)


@st.composite
def indptr_cases(draw):
    """(block_table, indptr, total_pages): indptr possibly decreasing, not starting at 0, too wide."""
    batch = draw(st.integers(0, 4))
    width = draw(st.integers(0, 4))
    table = draw(st.lists(st.lists(st.integers(-3, 50), min_size=width, max_size=width), min_size=batch,
                          max_size=batch))
    indptr = draw(st.lists(st.integers(-2, 3 * width + 2), min_size=batch + 1, max_size=batch + 1))
    total = draw(st.one_of(st.just(indptr[-1]), st.integers(-1, 12)))
    return table, indptr, total


def _naive_indices(table, indptr, total):
    """The answer when the metadata is consistent, else None."""
    if indptr[0] != 0 or any(b < a for a, b in zip(indptr, indptr[1:])) or total != indptr[-1]:
        return None
    out = []
    for row, a, b in zip(table, indptr, indptr[1:]):
        if b - a > len(row):
            return None
        out.extend(row[: b - a])
    return None if any(p < 0 for p in out) else out


@PROFILE
@given(indptr_cases(), st.booleans())
def test_page_indices_is_right_or_names_the_bad_argument(case, strided):
    table, indptr, total = case
    width = len(table[0]) if table else 0
    bt = torch.tensor(table, dtype=torch.int32).reshape(len(table), width)
    if strided:  # non-contiguous block table, same values
        bt = torch.cat([bt, bt], dim=1)[:, :width] if width else bt
    ip = torch.tensor(indptr, dtype=torch.int32)
    want = _naive_indices(table, indptr, total)
    if want is None:
        clear_error(lambda: paged_kv.page_indices(bt, ip, total), "indptr", "total_pages", "block_table")
    else:
        assert paged_kv.page_indices(bt, ip, total).tolist() == want


@PROFILE
@given(st.lists(st.integers(0, 40), min_size=1, max_size=4), st.sampled_from([1, 4, 16]), st.data())
def test_build_metadata_is_right_or_names_the_bad_argument(seq_lens, page_size, data):
    width = data.draw(st.integers(0, 5))
    table = data.draw(st.lists(st.lists(st.integers(-2, 30), min_size=width, max_size=width),
                               min_size=len(seq_lens), max_size=len(seq_lens)))
    bt = torch.tensor(table, dtype=torch.int32).reshape(len(seq_lens), width)
    pages = [_ceil(s, page_size) for s in seq_lens]
    used = [p for row, n in zip(table, pages) for p in row[:n]]
    if max(pages) > width or any(p < 0 for p in used):
        clear_error(lambda: paged_kv.build_metadata(bt, seq_lens, page_size), "block_table", "seq_lens_cpu")
    else:
        m = paged_kv.build_metadata(bt, seq_lens, page_size)
        assert m.indices.tolist() == used and m.indptr_cpu.tolist()[-1] == len(used)


@PROFILE
@given(st.sampled_from(["block_table", "seq_lens_cpu", "page_size", "device"]), st.data())
def test_build_metadata_bad_arguments(which, data):
    kw = {"block_table": torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), "seq_lens_cpu": [3, 17],
          "page_size": 16, "device": None}
    kw[which] = data.draw({
        "block_table": st.one_of(st.none(), st.just([[0, 1], [2, 3]]), st.just(torch.zeros(2, 2)),
                                 st.just(torch.zeros(4, dtype=torch.int32)), st.just(torch.zeros(3, 2, dtype=torch.int32)),
                                 st.just(torch.full((2, 2), -1, dtype=torch.int32))),
        "seq_lens_cpu": st.one_of(BAD_SEQ_LENS, st.just([3]), st.just([3, 100]),
                                  st.just(torch.tensor([3, 17], device="meta"))),
        "page_size": bad_positive_int(2**31 - 1),
        "device": st.one_of(st.sampled_from(["banana", 1.5, True, "cuda", "cuda:0"]), st.just(object())),
    }[which])
    clear_error(lambda: paged_kv.build_metadata(**kw), which, "block_table", "seq_lens_cpu", "page_size",
                cuda_ok=(which == "device"))


# ----------------------------------------------------------------- paged_kv.py: reference_decode

def _problem():
    b = paged_kv.random_batch(3, 40, 16, 2, 8, 4, seed=3, dtype=torch.float32)
    m = paged_kv.build_metadata(b.block_table, b.seq_lens, 16)
    return b, m


B, M = _problem()
GOOD = dict(q=B.q, k_cache=B.k_cache, v_cache=B.v_cache, indptr=M.indptr_cpu, indices=M.indices,
            last_page_len=M.last_page_len_cpu)
POOL = B.k_cache.shape[0]


def _i32(values):
    return torch.tensor(values, dtype=torch.int32)


@st.composite
def broken_decode_args(draw):
    """One argument of a valid decode problem made wrong (always wrong: never a valid variant)."""
    ip, idx, lpl = M.indptr_cpu.tolist(), M.indices.tolist(), M.last_page_len_cpu.tolist()
    nonempty = [b for b in range(3) if ip[b + 1] > ip[b]]
    choices = {
        "q": st.sampled_from([None, B.q[0], B.q.to(torch.int32), B.q[:, :3], B.q[..., :4], "q", B.q.to("meta")]),
        "k_cache": st.sampled_from([None, B.k_cache[0], B.k_cache[:, :, :0], B.k_cache.to(torch.int64),
                                    B.k_cache[..., :4]]),
        "v_cache": st.sampled_from([None, B.v_cache[:-1], B.v_cache[:, :8], B.v_cache.to(torch.int32)]),
        "indptr": st.sampled_from([None, _i32(ip[:-1]), M.indptr_cpu.long(), _i32([1] + ip[1:]),
                                   _i32(ip[:1] + [ip[2], ip[1]] + ip[3:]) if ip[1] != ip[2] else _i32([5, 0, 0, 0]),
                                   _i32(ip[:-1] + [len(idx) + 1])]),
        "indices": st.sampled_from([None, M.indices[:0] if ip[-1] else _i32([-1]), M.indices.long(),
                                    M.indices + POOL, M.indices - POOL]),
        "last_page_len": st.sampled_from([None, M.last_page_len_cpu[:2], M.last_page_len_cpu.float()]
                                         + ([_i32([17 if b == nonempty[0] else v for b, v in enumerate(lpl)]),
                                             _i32([0 if b == nonempty[0] else v for b, v in enumerate(lpl)])]
                                            if nonempty else [])),
        "sm_scale": st.one_of(BAD_DURATION.filter(lambda v: v is not None), st.just(0.0)),
    }
    which = draw(st.sampled_from(sorted(choices)))
    bad = draw(choices[which])
    if which == "indices" and not ip[-1] and bad is M.indices[:0]:
        bad = None
    return which, bad


@PROFILE
@given(broken_decode_args())
def test_reference_decode_names_the_bad_argument(case):
    which, bad = case
    names = {"q": ("q", "num_qo_heads", "head_dim"), "k_cache": ("k_cache",), "v_cache": ("v_cache",),
             "indptr": ("indptr",), "indices": ("indices",), "last_page_len": ("last_page_len",),
             "sm_scale": ("sm_scale",)}[which]
    clear_error(lambda: paged_kv.reference_decode(**(GOOD | {which: bad})), *names)


@FEW
@given(st.sampled_from(["q", "k_cache", "v_cache"]))
def test_reference_decode_non_contiguous_inputs_give_the_same_answer(which):
    want = paged_kv.reference_decode(**GOOD)
    t = GOOD[which]
    strided = torch.stack([t, torch.full_like(t, math.nan)], dim=-1)[..., 0]
    assert not strided.is_contiguous() and torch.equal(strided, t)
    torch.testing.assert_close(paged_kv.reference_decode(**(GOOD | {which: strided})), want)


@PROFILE
@given(st.sampled_from(["batch_size", "max_seq_len", "page_size", "num_kv_heads", "head_dim", "num_qo_heads",
                        "seed", "device", "dtype", "huge"]), st.data())
def test_random_batch(which, data):
    kw = dict(batch_size=2, max_seq_len=8, page_size=4, num_kv_heads=1, head_dim=4, num_qo_heads=1, seed=0)
    if which == "huge":
        kw |= data.draw(st.fixed_dictionaries({"batch_size": st.integers(10**4, 10**9),
                                               "max_seq_len": st.integers(10**4, 10**9)}))
        clear_error(lambda: paged_kv.random_batch(**kw), "random_batch would allocate")
        return
    kw[which] = data.draw({
        "device": st.sampled_from(["banana", 1.5, "cuda"]),
        "dtype": st.sampled_from([torch.int32, "float32", None, torch.bool]),
        "max_seq_len": bad_positive_int(allow_zero=True),
        "seed": bad_positive_int(allow_zero=True),
    }.get(which, bad_positive_int()))
    clear_error(lambda: paged_kv.random_batch(**kw), which, cuda_ok=(which == "device"))


@PROFILE
@given(st.sampled_from(["num_qo_heads", "num_kv_heads", "head_dim", "page_size", "workspace_bytes", "dtype"]),
       st.data())
def test_flashinfer_decode_checks_arguments_before_anything_else(which, data):
    kw = dict(num_qo_heads=4, num_kv_heads=2, head_dim=64, page_size=16)
    kw[which] = data.draw(st.sampled_from([torch.float32, "fp16", None]) if which == "dtype" else bad_positive_int())
    clear_error(lambda: paged_kv.FlashInferDecode(**kw), which)


# ----------------------------------------------------------------- checks core

@PROFILE
@given(st.sampled_from(["fn", "name", "cases", "reference", "compare", "hint"]), st.data())
def test_run_cases_bad_arguments(capsys, which, data):
    kw = {"fn": abs, "name": "abs", "cases": [(1,)], "reference": abs, "compare": lambda a, b: a == b, "hint": None}
    kw[which] = data.draw({"fn": NOT_CALLABLE, "reference": NOT_CALLABLE, "compare": NOT_CALLABLE,
                           "name": st.one_of(NOT_A_STR, st.just("")), "hint": st.one_of(st.integers(), st.just("")),
                           "cases": st.one_of(st.just([1]), st.just(["ab"]), st.just([None]))}[which])
    clear_error(lambda: run_cases(kw["fn"], kw["name"], kw["cases"], kw["reference"], compare=kw["compare"],
                                  hint=kw["hint"]), which)


@PROFILE
@given(st.integers(-2**62, 2**62), st.sampled_from(["int", "np64", "np32", "tensor", "array"]))
def test_integers_of_every_kind_are_ints(n, kind):
    if kind == "np32" and not -2**31 <= n < 2**31:
        n = n % 2**31
    v = {"int": int, "np64": np.int64, "np32": np.int32, "tensor": torch.tensor, "array": np.array}[kind](n)
    assert as_int(v) == n and same_int(v, n) and not same_int(v, n + 1)


@PROFILE
@given(st.one_of(st.floats(allow_nan=True), st.booleans(), st.text(max_size=2), st.none(),
                 st.sampled_from([np.float64(5.0), torch.tensor(5.0), torch.tensor([1, 2]), np.array([1, 2])])))
def test_non_integers_are_not_ints(v):
    assert not same_int(v, 5)
    clear_error(lambda: as_int(v), "expected an int")


@FEW
@given(st.lists(st.integers(), min_size=0, max_size=3000))
def test_long_arguments_show_their_ends(capsys, xs):
    run_cases(lambda v: None, "f", [(xs,)], lambda v: len(v))
    out = capsys.readouterr().out
    assert out.startswith("❌ f(") and len(out) < 1200
    if xs:
        assert repr(xs[-1]) in out


# ----------------------------------------------------------------- coverage of the public surface

COVERED = {
    "CudaUnavailableError", "ReplayMissingError", "Run", "Stats", "cuda_time", "cycles_per_ms", "doctor", "fmt_ms",
    "gpu_busy", "header", "host_time", "measure", "next_pow2", "pinned_back_to", "progress", "report", "show",
    "table", "wall_ms", "warmup", "async_tensor_h2d", "pin_snapshot",
    # no arguments: nothing to get wrong (called below)
    "facts", "flashinfer_status", "has_cuda", "host_stats", "pinned_baseline", "pinned_bytes_held",
    "pinned_memory_available", "release_cached_host_blocks", "platform_facts", "machine_summary",
    "ClaimError", "Reasons", "claim", "claims", "observe",
}
SHARED = {"args", "busy", "claims", "device", "doctor", "h2d", "hostmem", "probe", "progress", "replay", "timing"}


# ----------------------------------------------------------------- claims and the platform probe

@PROFILE
@given(name=st.text(min_size=1, max_size=12).filter(lambda s: s.isidentifier() and not s.startswith("_")),
       bad=st.one_of(st.none(), st.integers(), st.just(""), st.just("  "), st.lists(st.text(), max_size=2)))
def test_reasons_refuse_a_reason_without_words_and_name_a_missing_one(name, bad):
    clear_error(lambda: pinlab.Reasons(**{name: bad}), name)
    why = pinlab.Reasons(known="a sentence")
    if name != "known":
        with pytest.raises(AttributeError, match=f"no reason {name!r}.*known"):
            getattr(why, name)


@PROFILE
@given(count=st.one_of(st.none(), st.text(max_size=3), st.floats(allow_nan=True).filter(lambda x: x != x),
                       st.lists(st.integers(), max_size=2)))
def test_a_claim_with_expect_refuses_what_is_not_a_count(count):
    clear_error(lambda: pinlab.claim("a count", count, expect=0), "holds")
    clear_error(lambda: pinlab.claim("a count", 0, expect=count), "expect")


@PROFILE
@given(text=st.one_of(st.none(), st.integers(), st.just(""), st.just("   ")), holds=st.booleans())
def test_claim_and_observe_refuse_a_claim_without_words(text, holds):
    clear_error(lambda: pinlab.claim(text, holds), "text")
    clear_error(lambda: pinlab.observe(text, holds), "text")


@PROFILE
@given(holds=st.one_of(st.none(), st.text(max_size=3), st.just(torch.tensor([True, False]))))
def test_claim_refuses_a_truth_that_is_not_a_bool(holds):
    clear_error(lambda: pinlab.claim("a claim", holds), "holds")


@PROFILE
@given(holds=st.booleans(), value=st.one_of(st.none(), st.integers(), st.floats(allow_nan=True)))
def test_claim_fails_with_its_words_its_value_and_this_machine(holds, value, capsys):
    capsys.readouterr()
    if holds:
        assert pinlab.claim("the fact", holds, value=value) is None
        assert capsys.readouterr().out == "the fact: True\n"
        return
    with pytest.raises(pinlab.ClaimError) as err:
        pinlab.claim("the fact", holds, value=value, why="a shared GPU interleaves")
    msg = str(err.value)
    assert "the fact" in msg and "a shared GPU interleaves" in msg and "This machine:" in msg
    assert value is None or f"This run's value: {value}" in msg
    assert isinstance(err.value, AssertionError)  # a ClaimError is still an assertion


@PROFILE
@given(mapping=st.one_of(st.none(), st.just({}), st.lists(st.booleans(), max_size=2), st.text(max_size=2)))
def test_claims_refuses_what_is_not_a_dict_of_claims(mapping):
    clear_error(lambda: pinlab.claims(mapping), "mapping")


@PROFILE
@given(count=st.integers(min_value=-3, max_value=3))
def test_claims_with_an_expected_count_fail_exactly_when_it_differs(count, capsys):
    capsys.readouterr()
    try:
        pinlab.claims({"corrupted steps": count, "the race showed": True}, expect={"corrupted steps": 0})
        assert count == 0
    except pinlab.ClaimError as exc:
        assert count != 0 and "expected exactly 0" in str(exc)
    assert capsys.readouterr().out.startswith(f"corrupted steps: {count}\nthe race showed: True\n")


@PROFILE
@given(holds=st.booleans())
def test_observe_never_fails_and_prints_a_measured_line(holds, capsys):
    capsys.readouterr()
    assert pinlab.observe("pinned at least 2x pageable", holds, value="3.1x", why="a Gen3 link") is holds
    out = capsys.readouterr().out
    assert out.startswith("[measured] pinned at least 2x pageable: ") and ("yes (3.1x)" in out) == holds
    assert holds or "not in this run (3.1x); a Gen3 link" in out


def test_the_platform_report_answers_plainly_without_a_gpu():
    p = pinlab.platform_facts()
    assert p["gpu_usable"] is False and p["gpu"] is None and isinstance(p["cpu_cores_usable"], int)
    summary = pinlab.machine_summary()
    assert "no CUDA GPU" in summary and "CPU core" in summary


@PROFILE
@given(requires=st.one_of(st.just([]), st.just("vram"), st.just({"vram": 1}), st.just({"gpu_traces": True})))
def test_unmet_requirements_name_what_is_wrong(requires):
    from pinlab import probe

    clear_error(lambda: probe.unmet(requires), "requires")


def test_every_public_name_of_the_shared_modules_is_covered():
    ours = {n for n in pinlab.__all__ if getattr(getattr(pinlab, n), "__module__", "").split(".")[-1] in SHARED}
    assert ours - COVERED == set(), "add bad-input properties for these"


def test_functions_without_arguments_answer_plainly():
    assert isinstance(pinlab.facts(), dict) and pinlab.has_cuda() is False
    assert pinlab.pinned_memory_available() is False
    assert isinstance(pinlab.host_stats(), dict) and isinstance(pinlab.release_cached_host_blocks(), bool)
    held = pinlab.pinned_baseline()
    assert isinstance(held, int) and held >= 0 and isinstance(pinlab.pinned_bytes_held(), int)
    if not torch.cuda.is_available():  # (the caching host allocator is torch's, not PINLAB_FORCE_CPU's)
        assert pinlab.host_stats() == {} and held == 0
    version, note = pinlab.flashinfer_status()
    assert isinstance(note, str) and (version is None or isinstance(version, str))
    pinlab.show("x", math.nan)  # a fact is shown as it is: show() formats, never judges
