"""Lesson 06's library: the three rotary-id builders are exactly equal (hypothesis), bad input gets
clear errors, the streaming mask matches Phi-4-MM's, the call counter sees copies and syncs, the
trace reader counts what it should, and every experiment runs on the emulated stream with the
schema the notebook reads (and refuses clearly without CUDA). Runs on a CPU."""
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pinlab
from pinlab.lessons import l06_device_side_indices as l06


# ---- the builders: exact equality ---------------------------------------------------------------------

@st.composite
def grids(draw, max_images=32, max_side=128):
    m = draw(st.sampled_from([1, 2, 2, 4]))
    n = draw(st.integers(1, max_images))
    rows = []
    for _ in range(n):
        video = draw(st.booleans())
        t = draw(st.integers(2, 4)) if video else 1
        rows.append([t, m * draw(st.integers(1, max_side // m)), m * draw(st.integers(1, max_side // m))])
    return rows, m


ROPE = l06.VisionRotary(80)


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(grids())
def test_builders_give_equal_ids_and_embeddings(case):
    grid, m = case
    r = l06.equivalent(grid, m, ROPE)
    assert r["ids_equal"] and r["emb_equal"] and r["dtype_int64"]
    assert r["tokens"] == sum(t * h * w for t, h, w in grid)


@settings(max_examples=60, deadline=None)
@given(grids(max_images=6, max_side=24))
def test_vectorised_matches_the_closed_form_token_by_token(case):
    grid, m = case
    ids = l06.ids_vectorised(grid, m, "cpu").tolist()
    k0 = 0
    for t, h, w in grid:
        for k in range(t * h * w):
            kf = k % (h * w)
            b, r = kf // (m * m), kf % (m * m)
            assert ids[k0 + k] == [(b // (w // m)) * m + r // m, (b % (w // m)) * m + r % m]
        k0 += t * h * w


def test_worked_example_from_the_briefing():
    ids = l06.ids_per_image([[1, 4, 6]], 2, "cpu")[:12].tolist()
    assert ids == [[0, 0], [0, 1], [1, 0], [1, 1], [0, 2], [0, 3], [1, 2], [1, 3], [0, 4], [0, 5], [1, 4], [1, 5]]


def test_video_frames_repeat_the_same_positions():
    ids = l06.ids_vectorised([[3, 4, 6]], 2, "cpu")
    assert torch.equal(ids[:24], ids[24:48]) and torch.equal(ids[:24], ids[48:])


def test_tensor_grid_and_tuples_are_accepted():
    a = l06.ids_vectorised(torch.tensor([[1, 4, 6], [2, 2, 2]]), 2, "cpu")
    b = l06.ids_before(((1, 4, 6), (2, 2, 2)), 2, torch.device("cpu"))
    assert torch.equal(a, b)


def test_embeddings_have_vllm_shape_and_h_frequencies_first():
    cos, sin = l06.rot_pos_emb(l06.ids_vectorised, [[1, 4, 6]], 2, ROPE)
    assert cos.shape == (24, 40) and sin.shape == (24, 40)
    table_cos, _ = ROPE.get_cos_sin(6)
    assert torch.equal(cos[4, :20], table_cos[0]) and torch.equal(cos[4, 20:], table_cos[2])  # token 4 = (0, 2)


def test_recommended_chooses_per_batch(monkeypatch):
    used = []
    monkeypatch.setattr(l06, "ids_per_image", lambda *a: used.append("b") or torch.zeros(0))
    monkeypatch.setattr(l06, "ids_vectorised", lambda *a: used.append("c") or torch.zeros(0))
    l06.ids_recommended([[4, 8, 8]], 2, "cpu")
    l06.ids_recommended([[1, 8, 8]] * 2, 2, "cpu")
    assert used == ["b", "c"]


# ---- bad input --------------------------------------------------------------------------------------

@pytest.mark.parametrize("builder", list(l06.BUILDERS.values()), ids=list(l06.BUILDERS))
@pytest.mark.parametrize("grid, merge, device, err, match", [
    ([[1, 15, 16]], 2, "cpu", ValueError, r"grid_thw\[0\]: h=15 is not a multiple of merge_size=2"),
    ([[1, 16, 6]], 4, "cpu", ValueError, r"w=6 is not a multiple of merge_size=4"),
    ([], 2, "cpu", ValueError, "grid_thw is empty"),
    (torch.zeros(0, 3, dtype=torch.int64), 2, "cpu", ValueError, "grid_thw is empty"),
    (torch.tensor([[1.0, 4.0, 4.0]]), 2, "cpu", TypeError, "grid_thw must hold integers"),
    ([[1, 4]], 2, "cpu", ValueError, r"grid_thw\[0\] must be a \(t, h, w\) row"),
    ([[0, 4, 4]], 2, "cpu", ValueError, r"grid_thw\[0\].t must be > 0"),
    ([[1, 4.0, 4]], 2, "cpu", TypeError, r"grid_thw\[0\].h must be an int"),
    ("1,4,4", 2, "cpu", TypeError, "grid_thw must be a list"),
    ([[1, 4, 4]], 0, "cpu", ValueError, "merge_size must be > 0"),
    ([[1, 4, 4]], 2, 0, TypeError, "device must be a torch.device"),
    ([[1, 4, 4]], 2, "gpu!", ValueError, "device must name a device"),
])
def test_bad_input_names_the_argument(builder, grid, merge, device, err, match):
    with pytest.raises(err, match=match):
        builder(grid, merge, device)


def test_a_gpu_grid_is_refused_without_reading_it():
    meta = torch.empty(2, 3, dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match="grid_thw is on meta"):
        l06.check_grid(meta, 2)


def test_rotary_table_checks():
    with pytest.raises(ValueError, match="head_dim must be a multiple of 4"):
        l06.VisionRotary(82)
    with pytest.raises(ValueError, match="seqlen"):
        ROPE.get_cos_sin(9000)


# ---- the streaming mask -------------------------------------------------------------------------------

@settings(max_examples=80, deadline=None)
@given(st.integers(1, 120), st.integers(1, 40), st.integers(0, 5), st.integers(0, 3))
def test_device_mask_equals_phi4mm_mask(x_len, chunk, left, right):
    assert torch.equal(l06.adaptive_enc_mask(x_len, chunk, left, right),
                       l06.streaming_mask_device(x_len, chunk, left, right, "cpu"))


def test_mask_arguments_are_checked():
    with pytest.raises(ValueError, match="chunk_size must be > 0"):
        l06.streaming_mask_device(10, 0, 1, 0, "cpu")
    with pytest.raises(ValueError, match="left_window must be >= 0"):
        l06.adaptive_enc_mask(10, 2, -1)


# ---- counting calls, copies and syncs --------------------------------------------------------------------

def test_call_counts_grow_per_image_but_not_vectorised():
    c = {n: {k: l06.count_calls(f, [[1, 8, 8]] * n, 2, "cpu").calls for k, f in l06.BUILDERS.items()} for n in (1, 8)}
    assert c[1]["c"] == c[8]["c"]
    assert c[8]["a"] > 4 * c[1]["a"] and c[8]["b"] > 4 * c[1]["b"]


def test_torch_calls_sees_copies_and_syncs_on_the_lagging_stream():
    with pinlab.LaggingStream() as s:
        with l06.TorchCalls(s) as c:
            host = torch.arange(8)
            a = host.to(s.device, non_blocking=True)             # pageable
            b = host.pin_memory().to(s.device, non_blocking=True)  # pinned
            d = torch.empty(8, dtype=torch.int64, device=s.device)
            d.copy_(host)                                         # blocking
            torch.tensor([1, 2], device=s.device)                 # blocking factory
            reps = torch.ones(8, dtype=torch.int64, device=s.device)
            torch.repeat_interleave(a, reps)                      # reads the total back
            torch.repeat_interleave(b, reps, output_size=8)       # does not
            (a + b).sum().item()                                  # a sync
    assert [h["kind"] for h in c.h2d] == ["pageable", "pinned", "blocking", "blocking"]
    assert c.syncs == ["repeat_interleave without output_size", ".item()"]
    assert c.device_factories == 2


def test_torch_calls_reads_non_blocking_in_every_form_and_sees_mixed_devices():
    """Issue 28/31: non_blocking read by pinlab.detector.parse_to_args (copy_(src, True), to(device, dtype,
    True), cuda(device, True)); a call given device and host tensors is recorded, and refused as a GPU refuses it."""
    with pinlab.LaggingStream() as s:
        with l06.TorchCalls(s) as c:
            pinned = torch.arange(8).pin_memory()
            d = torch.empty(8, dtype=torch.int64, device=s.device)
            d.copy_(pinned, True)                                  # pinned, non_blocking positional
            pinned.to(s.device, torch.int32, True)                 # pinned
            pinned.to(s.device, torch.int32)                       # blocking
            pinned.cuda(None, True)                                # pinned
            d[:4] = pinned[:4]                                     # blocking: gpu[...] = host tensor
            with pytest.raises(RuntimeError, match="same device"):  # mixed: a GPU refuses it, and so does the emulation
                d - torch.arange(8)
            d - torch.tensor(3)                                    # a 0-d host tensor is a scalar: allowed
    assert [(h["kind"], h["call"]) for h in c.h2d] == [
        ("pinned", ".copy_()"), ("pinned", ".to()"), ("blocking", ".to()"), ("pinned", ".cuda()"),
        ("blocking", "[...] = host tensor")]
    assert c.h2d[0]["nbytes"] == 64
    assert [m["call"] for m in c.mixed] == ["sub"] and c.mixed[0]["shape"] == [8]
    assert c.default_device is None


# ---- the profiler-trace reader -------------------------------------------------------------------------

def _ev(cat, name, ts, dur=1.0, corr=None):
    e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}
    if corr is not None:
        e["args"] = {"correlation": corr}
    return e


def test_trace_counts_by_correlation():
    events = [
        _ev("user_annotation", "w1", 0, 100), _ev("user_annotation", "w2", 10_000, 100),
        _ev("cuda_runtime", "cudaLaunchKernel", 10, corr=1), _ev("cuda_runtime", "cudaMemcpyAsync", 20, corr=2),
        _ev("cuda_runtime", "cudaLaunchKernelExC", 10_010, corr=3), _ev("cuda_runtime", "cudaStreamSynchronize", 10_020),
        _ev("cuda_runtime", "cudaLaunchKernel", 5_000, corr=9),          # outside every window
        _ev("kernel", "k1", 9_000, corr=1),                             # ran late: still w1's
        _ev("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 9_500, corr=2),
        _ev("kernel", "k3", 10_500, corr=3), _ev("kernel", "k9", 5_100, corr=9),
        _ev("gpu_user_annotation", "w1", 0, 100),
    ]
    out = l06.trace_counts(events, {"w1": (0, 100), "w2": (10_000, 10_100)})
    assert out["w1"] == {"kernels": 1, "launches": 1, "syncs": 0, "h2d": ["Memcpy HtoD (Pinned -> Device)"]}
    assert out["w2"] == {"kernels": 1, "launches": 1, "syncs": 1, "h2d": []}


def test_trace_counts_by_time_without_correlation():
    events = [_ev("cuda_runtime", "cudaLaunchKernel", 10), _ev("kernel", "k", 50),
              _ev("kernel", "k", 10_050), _ev("gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", 10_060),
              _ev("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 10_070)]
    out = l06.trace_counts(events, {"w1": (0, 100), "w2": (10_000, 10_100)})
    assert out["w1"]["kernels"] == 1 and out["w1"]["launches"] == 1
    assert out["w2"]["kernels"] == 1 and out["w2"]["h2d"] == ["Memcpy HtoD (Pageable -> Device)"]


# ---- the experiments: emulated runs with the notebook's schema; clear refusal without CUDA -----------------

MIXES = {"one": [[1, 8, 8]], "two": [[1, 4, 4], [2, 4, 6]]}


@pytest.fixture(scope="module")
def emulated():
    with pinlab.LaggingStream() as s:
        return {
            "times": l06.builder_times(MIXES, rounds=2, busy_ms=1.0, stream=s),
            "loop": l06.builder_step_loop(MIXES, steps=3, warm_steps=1, stream=s),
            "launches": l06.launch_counts(MIXES, stream=s),
            "mask": l06.mask_times(x_len=40, chunk_size=4, rounds=2, stream=s),
        }


def test_builder_times_schema(emulated):
    r = emulated["times"]
    assert r["builders"] == list(l06.BUILDERS)
    assert r["mixes"]["two"]["tokens"] == 16 + 48 and r["mixes"]["two"]["images"] == 2
    for row in r["mixes"].values():
        for k in l06.BUILDERS:
            assert row[k]["host_us"] > 0 and row[k]["e2e_us"] > 0
        ratios = l06.ratios_to_best(row)
        assert min(ratios[k] for k in "abc") == pytest.approx(1.0)


def test_step_loop_schema(emulated):
    r = emulated["loop"]
    assert r["encoder_ms"] == 1.0 and r["in_flight"] == 2
    for row in r["mixes"].values():
        assert set(row) == set(l06.BUILDERS)
        for v in row.values():
            assert set(v) == {"ms_per_step", "build_ms", "idle_ms", "wall_ms_per_step", "gpu_idle_share"}
            assert v["ms_per_step"] > 0 and 0 < v["build_ms"] <= v["ms_per_step"] and v["wall_ms_per_step"] > 0
            assert v["gpu_idle_share"] is None and v["idle_ms"] is None  # no GPU clock on the emulated stream


def test_step_loop_medians_need_no_more_steps_than_the_run_ahead():
    with pinlab.LaggingStream() as s:
        r = l06.builder_step_loop({"one": [[1, 4, 4]]}, steps=1, warm_steps=0, in_flight=2, stream=s)
    assert all(v["ms_per_step"] > 0 and v["build_ms"] > 0 for v in r["mixes"]["one"].values())


def test_launch_counts_schema_and_emulated_facts(emulated):
    r = emulated["launches"]["mixes"]
    assert emulated["launches"]["counted_by"].startswith("torch calls")
    assert r["one"]["b"]["h2d"] == [] and r["two"]["b"]["h2d"] == []
    assert r["one"]["a"]["h2d"] == ["pageable .to()"]
    assert r["two"]["c"]["kernels"] == r["one"]["c"]["kernels"]
    assert r["two"]["b"]["kernels"] > r["one"]["b"]["kernels"]
    assert all(v["syncs"] == 0 for row in r.values() for v in row.values())


def test_mask_times_schema(emulated):
    r = emulated["mask"]
    assert r["equal"] is True and r["bytes"] == 1600
    assert set(r["forms"]) == set(l06.MASK_FORMS) and all(v["host_us"] > 0 for v in r["forms"].values())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
@pytest.mark.parametrize("fn", [l06.builder_times, l06.builder_step_loop, l06.launch_counts, l06.mask_times])
def test_experiments_refuse_clearly_without_cuda(fn):
    with pytest.raises(pinlab.CudaUnavailableError, match="needs a CUDA GPU"):
        fn()


def test_experiment_arguments_are_checked():
    with pinlab.LaggingStream() as s:
        with pytest.raises(TypeError, match="mixes must be a non-empty dict"):
            l06.builder_times({}, stream=s)
        with pytest.raises(ValueError, match="rounds must be > 0"):
            l06.builder_times(MIXES, rounds=0, stream=s)
        with pytest.raises(ValueError, match=r"grid_thw\[0\]: w=5"):
            l06.builder_step_loop({"bad": [[1, 4, 5]]}, stream=s)


def test_random_grid_mixes_images_and_videos():
    rng = random.Random(1)
    rows = [r for _ in range(50) for r in l06.random_grid(rng, 2)]
    assert any(r[0] == 1 for r in rows) and any(r[0] > 1 for r in rows)
    assert all(r[1] % 2 == 0 and r[2] % 2 == 0 and 2 <= r[1] <= 128 for r in rows)
