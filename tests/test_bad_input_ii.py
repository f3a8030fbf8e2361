"""Bad input, part II (issue 19): the cases a hostile tester found in the trace reader, the decode and
step loops' accounting, and the lessons' entry points. Each must fail with a TypeError/ValueError that
names the argument (and the bound, where there is one), or give the exact answer; GPU-only calls with
valid arguments give the course's CudaUnavailableError.

Deterministic (``derandomize``, no example database) and quick (a few seconds on 2 cores); the
hypothesis profile (no deadline) is the repository's (conftest.py).
"""
from __future__ import annotations

import math
import random

import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_bad_input import clear_error

import nbtools
import pinlab
from pinlab import decode_loop, profiler, steploop
from pinlab.args import CudaUnavailableError
from pinlab.lessons import l03_the_race as l03
from pinlab.lessons import l04_the_fix as l04
from pinlab.lessons import l05_pinned_weight_restore as l05
from pinlab.lessons import l06_device_side_indices as l06
from pinlab.lessons import l07_capstone_audit as l07

FEW = settings(max_examples=15, derandomize=True, database=None)
SOME = settings(max_examples=25, derandomize=True, database=None)

NOT_A_NUMBER = st.one_of(st.none(), st.text(max_size=3), st.just([1]), st.just({}), st.just(object()))
NOT_FINITE = st.sampled_from([math.nan, math.inf, -math.inf])
NOT_AN_INT = st.one_of(NOT_A_NUMBER, st.booleans(), st.floats(allow_nan=True), st.just(np.float64(2.0)))


@pytest.fixture(autouse=True)
def _cpu_only(monkeypatch):
    """Behave as a CPU-only machine even on a GPU host (GPU-only calls then raise CudaUnavailableError)."""
    monkeypatch.setenv("PINLAB_FORCE_CPU", "1")


# ----------------------------------------------------------------- profiler

GOOD_SPAN = [0.0, 1.0, "kernel"]
BAD_SPANS = st.one_of(
    st.lists(st.floats(0, 5), min_size=0, max_size=2),                          # [0, 1]: no label
    st.tuples(st.floats(0, 5), st.floats(0, 5), st.just("kernel"), st.just("x")).map(list),
    st.tuples(st.one_of(NOT_A_NUMBER, NOT_FINITE), st.just(1.0), st.just("kernel")).map(list),
    st.tuples(st.floats(2, 5), st.floats(0, 1.9), st.just("kernel")).map(list),  # ends before it starts
    st.none(), st.integers(), st.text(max_size=3),
)


@SOME
@given(st.lists(st.just(GOOD_SPAN), max_size=2), BAD_SPANS, st.lists(st.just(GOOD_SPAN), max_size=2))
def test_gpu_kernel_idle_share_names_the_bad_span(before, bad, after):
    clear_error(lambda: profiler.gpu_kernel_idle_share({"gpu": before + [bad] + after}), "run['gpu']")


@FEW
@given(st.one_of(st.none(), st.integers(), st.just("spans"), st.just({"a": 1})))
def test_gpu_kernel_idle_share_needs_a_list_of_spans(bad):
    clear_error(lambda: profiler.gpu_kernel_idle_share({"gpu": bad}), "run['gpu']")


@SOME
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(1, 5), st.sampled_from(["kernel", "Memcpy HtoD"])),
                min_size=1, max_size=6))
def test_gpu_kernel_idle_share_is_right_for_good_spans(raw):
    gpu = [[a, a + d, label] for a, d, label in raw]
    start, end = min(s[0] for s in gpu), max(s[1] for s in gpu)
    busy = sum(any(s[0] <= t < s[1] for s in gpu if s[2] == "kernel") for t in range(start, end))
    assert profiler.gpu_kernel_idle_share({"gpu": gpu}) == pytest.approx(1 - busy / (end - start))


@FEW
@given(st.text(alphabet="abcxyz_-0123456789", min_size=1, max_size=12))
def test_load_trace_events_names_a_missing_file(tmp_path_factory, name):
    path = tmp_path_factory.mktemp("traces") / f"{name}.json"
    for arg in (path, str(path)):
        with pytest.raises(FileNotFoundError) as info:
            profiler.load_trace_events(arg)
        assert isinstance(info.value, profiler.TraceFileNotFoundError) and str(path) in str(info.value)
    with pytest.raises(FileNotFoundError, match="nonexistent.json"):
        profiler.load_trace_events("/nonexistent.json")


@FEW
@given(st.one_of(st.just("{"), st.just("not json"), st.just('{"traceEvents": 3}'), st.just("3"),
                 st.binary(min_size=1, max_size=8).map(lambda b: b"\xff" + b)))
def test_load_trace_events_names_a_file_that_is_no_trace(tmp_path_factory, content):
    path = tmp_path_factory.mktemp("traces") / "t.json"
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    exc = clear_error(lambda: profiler.load_trace_events(path), str(path))
    assert isinstance(exc, ValueError)
    clear_error(lambda: profiler.load_trace_events(None), "path")


RUN = {"run": "run: a"}


def _events(kernel_ts, kernel_dur):
    return [{"ph": "X", "cat": "user_annotation", "name": "run: a", "ts": 0, "dur": 10_000},
            {"ph": "X", "cat": "kernel", "name": "k", "ts": kernel_ts, "dur": kernel_dur}]


@SOME
@given(st.one_of(st.tuples(st.integers(0, 9000), st.one_of(st.integers(max_value=-1),
                                                           st.floats(max_value=-1e-6, allow_nan=False))),
                 st.tuples(NOT_FINITE, st.integers(0, 10)), st.tuples(st.integers(0, 10), NOT_FINITE)))
def test_trace_runs_refuses_negative_and_non_finite_durations(case):
    ts, dur = case
    exc = clear_error(lambda: profiler.trace_runs(_events(ts, dur), RUN, ()), "events[1]")
    assert "dur >= 0" in str(exc)


@FEW
@given(st.integers(0, 9000), st.integers(0, 1000))
def test_trace_runs_keeps_good_durations(ts, dur):
    gpu = profiler.trace_runs(_events(ts, dur), RUN, ())["run"]["gpu"]
    assert gpu == [[round(ts / 1e3, 4), round((ts + dur) / 1e3, 4), "kernel"]]


# ----------------------------------------------------------------- steploop

@SOME
@given(st.lists(st.integers(0, 10**6), max_size=3), st.one_of(NOT_A_NUMBER, NOT_FINITE, st.integers(max_value=-1),
                                                              st.floats(max_value=-1e-9, allow_nan=False)))
def test_time_summary_us_refuses_negative_and_non_numbers(good, bad):
    clear_error(lambda: steploop.time_summary_us(good + [bad]), "samples_ns")
    if not isinstance(bad, (list, dict)):  # [1] is a list of samples, {} an empty one
        clear_error(lambda: steploop.time_summary_us(bad), "samples_ns")


@FEW
@given(st.lists(st.integers(0, 10**9), min_size=1, max_size=20))
def test_time_summary_us_is_right(samples):
    out = steploop.time_summary_us(samples)
    assert out["max_us"] == round(max(samples) / 1e3, 2)
    assert out["median_us"] == round(float(np.median(samples)) / 1e3, 2)


@SOME
@given(st.lists(st.integers(0, 50).map(lambda v: (v, v)), max_size=3),
       st.one_of(st.tuples(st.integers(1, 100), st.integers(0, 100)).filter(lambda p: p[0] > p[1]),
                 st.tuples(st.integers(max_value=-1), st.integers(0, 5)),
                 st.tuples(NOT_AN_INT, st.integers(0, 5))))
def test_received_from_minmax_refuses_min_above_max(good, bad):
    clear_error(lambda: steploop.received_from_minmax(good + [bad]), f"minmax[{len(good)}]")


@FEW
@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)).map(lambda p: (min(p), max(p))), max_size=8))
def test_received_from_minmax_is_right(pairs):
    assert steploop.received_from_minmax(pairs) == [lo if lo == hi else -1 for lo, hi in pairs]


# ----------------------------------------------------------------- decode_loop

def _images(max_batch, steps, seed):
    rng = random.Random(seed)
    ips, lpls = [], []
    for _ in range(steps):
        b = rng.randint(0, max_batch)
        pages = [rng.randint(0, 3) for _ in range(b)]
        ips.append([sum(pages[:i]) for i in range(b + 1)])
        lpls.append([rng.randint(1, 4) for _ in range(b)])
    return decode_loop.metadata_images(ips, lpls, max_batch), [len(x) for x in lpls]


@SOME
@given(st.integers(1, 4), st.integers(1, 5), st.integers(0, 99), st.sampled_from(["row", "n", "batch", "images"]),
       st.data())
def test_match_received_names_the_bad_argument(max_batch, steps, seed, which, data):
    images, batches = _images(max_batch, steps, seed)
    n = data.draw(st.integers(0, steps - 1))
    kw = {"row": list(images[n]), "images": images, "n": n, "batch": batches[n], "max_batch": max_batch}
    width = 2 * max_batch + 1
    kw[which] = data.draw({
        "row": st.one_of(st.lists(st.integers(0, 5), max_size=width - 1),
                         st.lists(st.integers(0, 5), min_size=width + 1, max_size=width + 3),
                         st.just([0.5] * width), st.just(torch.zeros(width)), st.none()),
        "n": st.one_of(st.integers(max_value=-1), st.integers(min_value=steps, max_value=steps + 5), NOT_AN_INT),
        "batch": st.one_of(st.integers(min_value=max_batch + 1, max_value=max_batch + 5), st.integers(max_value=-1),
                           NOT_AN_INT),
        "images": st.one_of(st.just([]), st.none(), st.just([img[:-1] for img in images])),
    }[which])
    if which == "images" and kw["images"] and len(kw["images"][0]) == width - 1:
        kw["n"] = 0  # every image too short: the first one looked at is refused
    clear_error(lambda: decode_loop.match_received(kw["row"], kw["images"], kw["n"], kw["batch"], kw["max_batch"]),
                which)


def test_match_received_reported_cases():
    clear_error(lambda: decode_loop.match_received([0, 1], [[0, 1, 0, 0, 0]], 0, 2, 2), "row")
    clear_error(lambda: decode_loop.match_received([0, 1, 0, 0, 0], [[0, 1, 0, 0, 0]], -1, 1, 2), "n", ">= 0")


@SOME
@given(st.integers(1, 4), st.integers(1, 6), st.integers(0, 99), st.data())
def test_match_received_is_right(max_batch, steps, seed, data):
    images, batches = _images(max_batch, steps, seed)
    n = data.draw(st.integers(0, steps - 1))
    row = data.draw(st.one_of(st.sampled_from(images), st.lists(st.integers(0, 6), min_size=2 * max_batch + 1,
                                                                 max_size=2 * max_batch + 1)))
    b = batches[n]
    used = list(range(b + 1)) + list(range(max_batch + 1, max_batch + 1 + b))
    want = next((k for k in range(n, steps) if [images[k][i] for i in used] == [row[i] for i in used]), -1)
    for arg in (row, torch.tensor(row, dtype=torch.int32)):
        assert decode_loop.match_received(arg, images, n, b, max_batch) == want


@FEW
@given(st.one_of(st.just({}), st.just({"err": None}), st.just({"err": 3}), st.none(), st.just([[0.1]]),
                 st.just({"err": [[0.1], "x"]}), st.just({"err": [[0.1, None]]}), st.just({"err": [[True]]})))
def test_error_matrix_names_the_bad_run(bad):
    clear_error(lambda: decode_loop.error_matrix(bad, 2), "run")


@FEW
@given(st.lists(st.lists(st.floats(0, 1), max_size=3), max_size=5))
def test_error_matrix_is_right(err):
    m = decode_loop.error_matrix({"err": err}, 3)
    assert m.shape == (len(err), 3)
    for row, got in zip(err, m):
        assert list(got[: len(row)]) == row and all(np.isnan(got[len(row):]))


@SOME
@given(st.one_of(
    st.sampled_from([torch.float32, torch.float16, torch.bool, torch.complex64]).map(lambda dt: torch.zeros(3, dtype=dt)),
    st.just(torch.zeros(0, dtype=torch.int32)), st.just([0, 1, 2]), st.none()))
def test_safe_indptr_refuses_float_bool_and_empty_rows(bad):
    positions = torch.arange(max(1, bad.numel() if isinstance(bad, torch.Tensor) else 3))
    clear_error(lambda: decode_loop.safe_indptr(bad, 4, positions), "row")


# ----------------------------------------------------------------- lessons 03 and 04: the plots

BAD_RUN = st.one_of(st.just({}), st.none(), st.just({"received": []}), st.just({"received": 3, "corrupted": 0}),
                    st.just({"received": [0, 1]}), st.just({"received": [0, 1], "corrupted": "2"}),
                    st.just({"corrupted": 0}), st.just({"received": [0], "corrupted": True}))


@FEW
@given(st.dictionaries(st.sampled_from(["reused_pinned", "pageable"]), st.just({"received": [0, 1], "corrupted": 0}),
                       max_size=1), BAD_RUN)
def test_plot_received_names_the_bad_run(good, bad):
    try:
        clear_error(lambda: l03.plot_received({**good, "x": bad}, title="t"), "runs['x']")
    finally:
        plt.close("all")


GOOD_ROW = {"label": "a", "corrupted": 0, "host_us": 1.0, "pinned_bytes_held": 0}


@FEW
@given(st.one_of(
    st.just({}), st.none(), st.just({"rows": [], "steps": 1, "no_copy_us": 1.0}),
    st.just({"rows": [GOOD_ROW], "steps": 1}), st.just({"rows": [GOOD_ROW], "no_copy_us": 1.0}),
    st.just({"rows": [3], "steps": 1, "no_copy_us": 1.0}),
    st.just({"rows": [{"label": "a"}], "steps": 1, "no_copy_us": 1.0}),
    st.just({"rows": [GOOD_ROW | {"host_us": math.nan}], "steps": 1, "no_copy_us": 1.0}),
    st.just({"rows": [GOOD_ROW], "steps": 1, "no_copy_us": "x"})))
def test_plot_history_names_the_bad_result(bad):
    try:
        clear_error(lambda: l04.plot_history(bad, title="t"), "result")
    finally:
        plt.close("all")


# ----------------------------------------------------------------- lesson 05: the model and the restore

@FEW
@given(st.one_of(
    st.tuples(st.integers(2**18, 10**7), st.integers(2**18, 10**7), st.integers(1, 4)),  # >= 256 GiB
    st.tuples(st.just(l05.HIDDEN), st.just(l05.INTER), st.integers(l05.MAX_BLOCKS + 1, 10**9))))
def test_make_model_refuses_sizes_past_its_bound(shape):
    hidden, inter, blocks = shape
    exc = clear_error(lambda: l05.make_model(hidden, inter, blocks), "MAX_MODEL_BYTES", "blocks")
    assert str(l05.MAX_BLOCKS) in str(exc) or "64 GiB" in str(exc)


def test_make_model_bound_is_generous():
    for target in l05.SLEEP_SIZES:  # the sweep's models, and 8x the largest, are within the bound
        h, i = l05.mlp_shape_for(target)
        assert 8 * 2 * l05.BLOCKS * h * i * 2 <= l05.MAX_MODEL_BYTES


SRC05 = nbtools.ROOT / "notebooks" / "src" / "05_pinned_weight_restore.py"


def _device_loading_context():
    import contextlib

    fn = nbtools.load_definition(SRC05, "device_loading_context",
                                 {"contextlib": contextlib, "torch": torch, "wr": l05, "DISABLE_PIN": False})
    return fn if hasattr(fn, "__wrapped__") else contextlib.contextmanager(fn)  # (the source has no decorator)


@FEW
@given(st.sampled_from(["cpu", torch.device("cpu")]), st.booleans())
def test_device_loading_context_outside_a_stream(target, pin):
    """Outside a LaggingStream on a CPU-only machine, pinning is impossible: a clear error up front
    naming pin, before any parameter moves; with pin=False the round trip is exact."""
    ctx = _device_loading_context()
    model = torch.nn.Linear(3, 2, bias=False)
    before = model.weight.detach().clone()
    if pin and not torch.cuda.is_available():
        clear_error(lambda: ctx(model, target, pin=pin).__enter__(), "pin")
    else:
        with ctx(model, target, pin=pin):
            pass
        assert model.weight.is_pinned() == pin
    assert torch.equal(model.weight.detach().cpu(), before)


def test_device_loading_context_inside_a_stream_still_pins():
    ctx = _device_loading_context()
    with pinlab.LaggingStream() as s:
        model = torch.nn.Linear(3, 2, bias=False)
        with ctx(model, s.device):
            assert s.is_device(model.weight)
        assert model.weight.is_pinned()


# ----------------------------------------------------------------- lesson 06

BUILDERS = [l06.ids_before, l06.ids_per_image, l06.ids_vectorised, l06.ids_recommended]


@FEW
@given(st.sampled_from(BUILDERS), st.one_of(
    st.tuples(st.integers(1, 4), st.integers(2**11 + 1, 2**20).map(lambda v: 2 * v),
              st.integers(2**11 + 1, 2**20).map(lambda v: 2 * v)).map(lambda r: [list(r)]),  # > 2**24 tokens
    st.integers(l06.MAX_IMAGES + 1, l06.MAX_IMAGES + 50).map(lambda n: [[1, 2, 2]] * n),
    st.just([[1, 2**20, 2**20]])))
def test_ids_builders_refuse_batches_past_their_bound(builder, grid):
    clear_error(lambda: builder(grid, 2, "cpu"), "grid_thw")
    clear_error(lambda: builder(torch.tensor(grid), 2, "cpu"), "grid_thw")


def test_ids_bounds_are_generous():
    rng = random.Random(0)
    assert max(l06.num_tokens(g) for g in l06.MIXES.values()) * 8 <= l06.MAX_TOKENS
    assert 32 * 4 * 128 * 128 * 8 <= l06.MAX_TOKENS and 32 * 8 <= l06.MAX_IMAGES  # random_grid's largest
    grid = l06.random_grid(rng, 2)
    assert torch.equal(l06.ids_vectorised(grid, 2, "cpu"), l06.ids_before(grid, 2, "cpu"))


@FEW
@given(st.one_of(st.integers(l06.MAX_MASK_LEN + 1, 10**9)), st.integers(1, 16))
def test_streaming_masks_refuse_lengths_past_their_bound(x_len, chunk):
    for fn in (lambda: l06.streaming_mask_device(x_len, chunk, 1, 0, "cpu"),
               lambda: l06.adaptive_enc_mask(x_len, chunk, 1, 0)):
        exc = clear_error(fn, "x_len")
        assert str(l06.MAX_MASK_LEN) in str(exc)
    assert 8 * 750 <= l06.MAX_MASK_LEN  # the lesson's mask


@FEW
@given(st.sampled_from(["cuda", "cuda:0", "cuda:1", torch.device("cuda")]))
def test_vision_rotary_on_cuda_without_cuda_says_so(device):
    with pytest.raises(CudaUnavailableError, match="needs a CUDA GPU"):
        l06.VisionRotary(80, device=device)


@FEW
@given(st.sampled_from(["max_position", "head_dim"]), st.data())
def test_vision_rotary_refuses_tables_past_their_bound(which, data):
    bound = {"max_position": l06.MAX_POSITION, "head_dim": l06.MAX_HEAD_DIM}[which]
    bad = data.draw(st.integers(bound + 1, 2**40).map(lambda v: v + (-v % 4) if which == "head_dim" else v))
    exc = clear_error(lambda: l06.VisionRotary(**{which: bad}), which)
    assert str(bound) in str(exc)
    assert 8 * 8192 <= l06.MAX_POSITION and 8 * 80 <= l06.MAX_HEAD_DIM


ROPE = l06.VisionRotary(80, max_position=64)


@FEW
@given(st.one_of(st.booleans(), st.floats(allow_nan=True), st.text(max_size=2), st.none(),
                 st.integers(max_value=0), st.integers(65, 2**70)))
def test_get_cos_sin_refuses_bools_and_out_of_range(bad):
    clear_error(lambda: ROPE.get_cos_sin(bad), "seqlen")


@FEW
@given(st.integers(1, 64), st.sampled_from([int, np.int64, np.int32]))
def test_get_cos_sin_is_right(n, kind):
    cos, sin = ROPE.get_cos_sin(kind(n))
    assert cos.shape == (n, 20) and torch.equal(cos, ROPE.cos_sin_cache[:n, :20])
    assert torch.equal(sin, ROPE.cos_sin_cache[:n, 20:])


@SOME
@given(st.sampled_from(["merge_size", "max_images", "max_side", "max_t", "rng"]), st.data())
def test_random_grid_names_the_bad_argument(which, data):
    kw = {"merge_size": 2, "max_images": 4, "max_side": 16, "max_t": 3}
    rng = random.Random(0)
    if which == "rng":
        clear_error(lambda: l06.random_grid(data.draw(st.one_of(st.none(), st.integers(), st.text(max_size=2)))), "rng")
        return
    kw[which] = data.draw({
        "merge_size": st.one_of(st.integers(max_value=0), NOT_AN_INT, st.integers(17, 100)),
        "max_images": st.one_of(st.integers(max_value=0), NOT_AN_INT, st.integers(l06.MAX_IMAGES + 1, 10**12)),
        "max_side": st.one_of(st.integers(max_value=1), NOT_AN_INT),
        "max_t": st.one_of(st.integers(max_value=0), NOT_AN_INT),
    }[which])
    names = (which, "max_side") if which == "merge_size" else (which,)  # merge_size 17..100 > max_side 16
    clear_error(lambda: l06.random_grid(rng, **kw), *names)


@SOME
@given(st.integers(0, 10**6), st.integers(1, 4), st.integers(1, 8), st.integers(1, 40), st.integers(1, 4))
def test_random_grid_is_a_valid_batch(seed, m, max_images, max_side, max_t):
    if max_side < m:
        max_side = m
    rows = l06.random_grid(random.Random(seed), m, max_images, max_side, max_t)
    assert 1 <= len(rows) <= max_images
    assert all(1 <= t <= max_t and h % m == 0 and w % m == 0 and 0 < h <= max_side and 0 < w <= max_side
               for t, h, w in rows)
    assert l06.check_grid(rows, m) == [tuple(r) for r in rows]
    if max_t >= 2:  # the images-and-videos draw is unchanged by the checks
        assert rows == l06.random_grid(random.Random(seed), m, max_images, max_side, max_t)


@FEW
@given(st.sampled_from(["steps", "warm_steps", "in_flight", "encoder_ms"]), st.data())
def test_builder_step_loop_refuses_runs_past_its_bound(which, data):
    bound = pinlab.busy.MAX_BUSY_MS if which == "encoder_ms" else l06.MAX_STEPS
    bad = data.draw(st.integers(int(bound) + 1, 10**12))
    exc = clear_error(lambda: l06.builder_step_loop({"one": [[1, 4, 4]]}, **{which: bad},
                                                    stream=pinlab.LaggingStream()), which)
    assert str(int(bound)) in str(exc).replace(".0", "")


# ----------------------------------------------------------------- lesson 07

def _model(steps=4):
    s = pinlab.LaggingStream()
    with s:
        return l07.CapstoneModel(s, steps=steps)


M07 = _model()


@FEW
@given(st.one_of(st.none(), st.integers(), st.text(max_size=3), st.just(object()), st.just(torch.device("cpu"))))
def test_capstone_model_needs_a_stream(bad):
    clear_error(lambda: l07.CapstoneModel(bad, steps=2), "stream")


@FEW
@given(st.integers(l07.MAX_STEPS + 1, 10**12))
def test_capstone_model_refuses_steps_past_its_bound(steps):
    exc = clear_error(lambda: l07.CapstoneModel(pinlab.LaggingStream(), steps=steps), "steps")
    assert str(l07.MAX_STEPS) in str(exc)
    clear_error(lambda: l07.emulated({"fixed": l07.fixed_loop}, steps=steps), "steps")
    assert 8 * 1000 <= l07.MAX_STEPS  # the lesson's longest loop: 1000 steps


@FEW
@given(st.one_of(st.none(), st.integers(), st.just(object()), st.just({"steps": 5})))
def test_run_loop_needs_a_model(bad):
    clear_error(lambda: l07.run_loop(bad, l07.fixed_loop, 2), "m")
    clear_error(lambda: l07.judge(bad, 2, [], [], True), "m")


@SOME
@given(st.sampled_from(["steps", "rows", "tokens"]), st.data())
def test_judge_names_the_bad_argument(which, data):
    steps = 3
    kw = {"steps": steps, "rows": [[0] * M07.meta_ints] * steps, "tokens": [[0] * M07.max_batch] * steps}
    kw[which] = data.draw({
        "steps": st.one_of(NOT_AN_INT, st.integers(max_value=0), st.integers(M07.steps + 1, 10**6)),
        "rows": st.one_of(st.just([]), st.none(), st.just([[0] * M07.meta_ints] * (steps - 1)),
                          st.just([[0] * (M07.meta_ints - 1)] * steps), st.just([None] * steps)),
        "tokens": st.one_of(st.just([]), st.just("abc"), st.just([[0] * (M07.max_batch + 1)] * steps)),
    }[which])
    clear_error(lambda: l07.judge(M07, kw["steps"], kw["rows"], kw["tokens"], True), which)


def test_judge_and_run_loop_still_judge_a_loop_exactly():
    r = l07.run_loop(M07, l07.fixed_loop, 4)
    assert r["corrupted"] == 0 and r["steps"] == 4 and r["received"] == [0, 1, 2, 3]
