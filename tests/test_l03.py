"""CPU tests for pinlab.race: argument checks, the pure accounting, the timeline model, the step
loops in the emulated lagging stream, the torch fallback attention, and CudaUnavailableError."""
from __future__ import annotations

import json
import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from pinlab import CudaUnavailableError  # noqa
from pinlab.lessons import l03_the_race as race  # noqa: E402
from pinlab.paged_kv import kv_indptr, last_page_len, page_indices, reference_decode  # noqa: E402

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
EMU = race._EmuEnv
CORRECT = ("pageable", "snapshot", "ring_events", "event_wait")
RACY = ("reused_pinned", "double_pinned", "snapshot_of_pinned")


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setenv("PINLAB_FORCE_CPU", "1")


# --------------------------------------------------------------------------- CUDA is required

GPU_CALLS = [
    ("plain_race()", lambda: race.plain_race()),
    ("pageable_cost()", lambda: race.pageable_cost()),
    ("snapshot_soak()", lambda: race.snapshot_soak()),
    ("snapshot_cost()", lambda: race.snapshot_cost()),
    ("allocator_reuse()", lambda: race.allocator_reuse()),
    ("pin_trap()", lambda: race.pin_trap()),
    ("history()", lambda: race.history()),
    ("decode_race()", lambda: race.decode_race()),
    ("plan_hazard()", lambda: race.plan_hazard()),
]


@pytest.mark.parametrize("name,call", GPU_CALLS, ids=[n for n, _ in GPU_CALLS])
def test_gpu_experiments_need_cuda(no_cuda, name, call):
    with pytest.raises(CudaUnavailableError, match=name.replace("(", r"\(").replace(")", r"\)")):
        call()


def test_arguments_are_checked_before_cuda(no_cuda):
    with pytest.raises(ValueError, match="strategies"):
        race.plain_race(strategies=["nope"])
    with pytest.raises(ValueError, match="multiple of 4"):
        race.plain_race(nbytes=10)
    with pytest.raises(ValueError, match="busy_ms"):
        race.plain_race(busy_ms=0)
    with pytest.raises(TypeError, match="steps"):
        race.plain_race(steps=1.5)
    with pytest.raises(ValueError, match="ahead"):
        race.plain_race(ahead=0)
    with pytest.raises(ValueError, match="repeat"):
        race.plain_race(strategies=["pageable", "pageable"])
    with pytest.raises(TypeError, match="strategies"):
        race.plain_race(strategies="pageable")
    with pytest.raises(ValueError, match="no_copy"):
        race.history(strategies=["no_copy", "pageable"])
    with pytest.raises(ValueError, match="ring"):
        race.decode_race(ring=2, ahead=3)
    with pytest.raises(ValueError, match="backend"):
        race.decode_race(backend="triton")
    with pytest.raises(ValueError, match="multiple"):
        race.decode_race(num_qo_heads=6, num_kv_heads=4)
    with pytest.raises(ValueError, match="sizes"):
        race.pageable_cost(sizes=[])
    with pytest.raises(TypeError, match="sizes"):
        race.snapshot_cost(sizes=4096)
    with pytest.raises(ValueError, match="timeout_s"):
        race.plan_hazard(timeout_s=0)


# --------------------------------------------------------------------------- pure accounting

def test_corruption_summary():
    s = race.corruption_summary([0, 5, 5, -1, 4, None])
    assert s == {"steps": 6, "copied": 5, "corrupted": 3, "torn": 1, "rate": 3 / 5, "first_corrupted": 1}
    assert race.corruption_summary([None, None])["rate"] == 0.0
    assert race.corruption_summary([2, 2], expected=[2, 3])["corrupted"] == 1
    with pytest.raises(ValueError, match="expected"):
        race.corruption_summary([0], expected=[0, 1])
    with pytest.raises(TypeError):
        race.corruption_summary([0.5])
    with pytest.raises(TypeError):
        race.corruption_summary(7)


def test_received_from_minmax_and_time_summary():
    assert race.received_from_minmax([(3, 3), (1, 4), [7, 7]]) == [3, -1, 7]
    with pytest.raises(ValueError):
        race.received_from_minmax([(1, 2, 3)])
    t = race.time_summary_us([1000, 2000, 3000, 10_000])
    assert t["median_us"] == 2.5 and t["mean_us"] == 4.0 and t["max_us"] == 10.0
    assert 3.0 < t["p90_us"] < 10.0
    with pytest.raises(ValueError):
        race.time_summary_us([])


@FAST
@given(st.lists(st.integers(0, 500), max_size=20), st.sampled_from([1, 3, 16, 64]))
def test_step_metadata_matches_paged_kv(lens, page_size):
    ip, lpl = race.step_metadata(lens, page_size)
    assert ip == kv_indptr(lens, page_size).tolist()
    assert lpl == last_page_len(lens, page_size).tolist()


def test_step_metadata_worked_example_and_checks():
    assert race.step_metadata([37, 48, 17, 0], 16) == ([0, 3, 6, 8, 8], [5, 16, 1, 0])
    with pytest.raises(ValueError):
        race.step_metadata([-1], 16)
    with pytest.raises(ValueError):
        race.step_metadata([1], 0)


def test_decode_schedule_invariants():
    sch = race.decode_schedule(80, 8, 64, seed=3)
    steps = sch["steps"]
    assert len(steps) == 80 and sch["n_requests"] > 8
    joins = leaves = 0
    for n, s in enumerate(steps):
        assert 1 <= len(s["req_ids"]) <= 8 and len(s["req_ids"]) == len(s["seq_lens"])
        assert all(1 <= x <= 64 for x in s["seq_lens"])
        assert len(set(s["req_ids"])) == len(s["req_ids"])
        if n:
            prev = dict(zip(steps[n - 1]["req_ids"], steps[n - 1]["seq_lens"]))
            for r, x in zip(s["req_ids"], s["seq_lens"]):
                if r in prev:
                    assert x == prev[r] + 1  # one decoded token per step
                else:
                    joins += 1
            leaves += sum(1 for r in prev if r not in s["req_ids"])
    assert joins > 0 and leaves > 0
    assert race.decode_schedule(80, 8, 64, seed=3) == sch  # reproducible
    assert race.decode_schedule(80, 8, 64, seed=4) != sch
    with pytest.raises(ValueError, match="probability"):
        race.decode_schedule(5, 4, 64, seed=0, join_prob=1.5)
    with pytest.raises(ValueError, match="max_seq_len"):
        race.decode_schedule(5, 4, 1, seed=0)


def test_metadata_images_and_match():
    ips = [[0, 1, 3], [0, 2], [0, 1, 2, 4]]
    lpls = [[5, 7], [3], [1, 2, 9]]
    img = race.metadata_images(ips, lpls, 3)
    assert img[0] == [0, 1, 3, 0, 5, 7, 0]
    assert img[1] == [0, 2, 3, 0, 3, 7, 0]  # entries past the batch keep older values
    assert img[2] == [0, 1, 2, 4, 1, 2, 9]
    assert race.match_received(img[0], img, 0, 2, 3) == 0
    assert race.match_received(img[2], img, 0, 2, 3) == 2
    assert race.match_received([9] * 7, img, 0, 2, 3) == -1
    # only the entries step n uses count: a different tail is still step n's data
    assert race.match_received([0, 2, 99, 99, 3, 99, 99], img, 1, 1, 3) == 1
    with pytest.raises(ValueError):
        race.metadata_images([[0, 1]], [[1, 2]], 3)
    with pytest.raises(ValueError):
        race.metadata_images([[0]], [[], []], 3)


def test_copies_correct_and_min_ring_depth():
    writes = [(0.0, 1.0), (2.0, 3.0), (3.5, 4.0)]
    copies = [(1.0, 2.0), (3.0, 5.0), (6.0, 7.0)]
    assert race.copies_correct(writes, copies) == [True, False, True]
    assert race.min_ring_depth(writes, copies) == 2
    assert race.min_ring_depth([(0, 1)], [(9, 10)]) == 1
    with pytest.raises(ValueError, match="one span per step"):
        race.copies_correct(writes, copies[:2])
    with pytest.raises(ValueError, match="ends before"):
        race.copies_correct([(2, 1)], [(3, 4)])
    with pytest.raises(TypeError):
        race.min_ring_depth(5, copies)


# --------------------------------------------------------------------------- the timeline model

def test_simulate_reused_pinned_delivers_the_last_step():
    sim = race.simulate("reused_pinned", steps=6)
    assert sim["received"] == [0, 5, 5, 5, 5, 5] and sim["corrupted"] == 4
    assert sim["host_end_ms"] < sim["gpu_end_ms"]
    assert race.copies_correct(sim["writes"], sim["copies"]) == [r == n for n, r in enumerate(sim["received"])]


def test_simulate_fast_gpu_and_the_fixes_are_correct():
    assert race.simulate("reused_pinned", steps=6, gpu_ms=0.01)["corrupted"] == 0
    for s in ("pageable", "snapshot", "event_wait", "ring_events"):
        assert race.simulate(s, steps=8)["corrupted"] == 0, s
    assert race.simulate("ring", steps=8, ring_depth=2)["corrupted"] > 0
    assert race.simulate("ring", steps=8, ring_depth=2, ahead=2)["corrupted"] == 0
    assert race.simulate("double_pinned", steps=8)["corrupted"] > 0
    assert race.simulate("snapshot_of_pinned", steps=8)["corrupted"] > 0


def test_simulate_waits_and_the_ring_depth_agree():
    sim = race.simulate("reused_pinned", steps=10, ahead=2)
    depth = race.min_ring_depth(sim["writes"], sim["copies"])
    assert race.simulate("ring", steps=10, ahead=2, ring_depth=depth)["corrupted"] == 0
    assert race.simulate("ring", steps=10, ahead=2, ring_depth=depth - 1)["corrupted"] > 0
    paced = race.simulate("pageable", steps=8, staging_slots=2)
    free = race.simulate("pageable", steps=8)
    assert paced["host_end_ms"] > free["host_end_ms"]
    assert any(lab == "host waits" for _, _, lab in paced["host"])
    ev = race.simulate("event_wait", steps=6)
    assert ev["host_end_ms"] > free["host_end_ms"] - 1e-9


def test_simulate_torn_read_and_checks():
    sim = race.simulate("reused_pinned", steps=3, host_ms=0.1, launch_ms=0.0, copy_ms=0.5, gpu_ms=0.0)
    assert sim["received"][0] == -1  # step 1's write started while copy 0 was running
    with pytest.raises(ValueError, match="no_copy"):
        race.simulate("no_copy")
    with pytest.raises(ValueError):
        race.simulate("bogus")
    with pytest.raises(ValueError):
        race.simulate(steps=0)


# --------------------------------------------------------------------------- emulated step loops

@pytest.mark.parametrize("ahead", [None, 1, 2])
def test_plain_loops_in_the_emulated_stream(ahead):
    res = race._plain_race(EMU, strategies=list(race.STRATEGIES), steps=30, nbytes=64, busy_ms=0.5, ahead=ahead)
    runs = res["runs"]
    for s in CORRECT:
        assert runs[s]["corrupted"] == 0, s
        assert runs[s]["received"] == list(range(30))
    for s in RACY:
        if ahead == 1:  # the host waits until the previous step's copy has run: one buffer is enough
            assert runs[s]["corrupted"] == 0, s
        else:
            assert runs[s]["corrupted"] >= 1, s
    assert runs["no_copy"]["copied"] == 0 and runs["no_copy"]["received"] == [None] * 30
    assert len(runs["pageable"]["host_us"]) == 30
    json.dumps(res)


def test_ring_without_events_races_when_shallow():
    runs = race._plain_race(EMU, strategies=["ring"], steps=20, nbytes=16, busy_ms=0.5, ahead=None,
                            ring_depth=2)["runs"]
    assert runs["ring"]["corrupted"] >= 1
    runs = race._plain_race(EMU, strategies=["ring"], steps=20, nbytes=16, busy_ms=0.5, ahead=2,
                            ring_depth=3)["runs"]
    assert runs["ring"]["corrupted"] == 0


def test_other_experiments_in_the_emulated_stream():
    pc = race._pageable_cost(EMU, sizes=[1024, 4096], steps=10, busy_ms=0.5)
    assert [r["nbytes"] for r in pc["runs"]] == [1024, 4096] and all(r["corrupted"] == 0 for r in pc["runs"])
    assert all(len(r["host_us"]) == 10 and "received" not in r for r in pc["runs"])
    soak = race._snapshot_soak(EMU, steps=300, nbytes=256, busy_ms=0.2, control_steps=40)
    assert soak["snapshot"]["corrupted"] == 0 and soak["control"]["corrupted"] >= 1
    assert soak["snapshot"]["reused_before_copy_done"] == 0
    cost = race._snapshot_cost(EMU, sizes=[1024, 4096], steps=30, busy_ms=0.1, ahead=2)
    assert [r["nbytes"] for r in cost["rows"]] == [1024, 4096]
    for r in cost["rows"]:
        assert r["snapshot_corrupted"] == 0
        assert math.isclose(r["snapshot_extra_us"], r["snapshot_us"] - r["reused_pinned_us"], abs_tol=0.011)
    alloc = race._allocator_reuse(EMU, nbytes=256, busy_ms=5.0, steps=40, ahead=4)
    assert alloc["copy_pending_at_second_snapshot"] and alloc["second_block_differs"]
    assert alloc["loop"]["corrupted"] == 0 and alloc["loop"]["reused_before_copy_done"] == 0
    trap = race._pin_trap(EMU, nbytes=64, steps=20, busy_ms=0.5)
    assert trap["same_storage"] and trap["pageable_gets_new_storage"]
    assert trap["race"]["runs"]["snapshot_of_pinned"]["corrupted"] >= 1
    assert trap["race"]["runs"]["snapshot"]["corrupted"] == 0
    hist = race._history(EMU, strategies=race.HISTORY, steps=25, nbytes=256, busy_ms=0.3, ahead=2, ring_depth=3)
    rows = {r["strategy"]: r for r in hist["rows"]}
    assert list(rows) == race.HISTORY
    assert all(rows[s]["corrupted"] == 0 for s in CORRECT) and all(rows[s]["corrupted"] > 0 for s in RACY)
    json.dumps([pc, soak, cost, alloc, trap, hist])


def test_staging_kinds():
    env = EMU()
    st_ = race._Staging(env, "snapshot_of_pinned", 4)
    assert st_.stage(race._fill, 1) is st_.slots[0]  # pin_memory() of a pinned tensor: the same tensor
    st_ = race._Staging(env, "snapshot", 4)
    snap = st_.stage(race._fill, 2)
    assert snap is not st_.slots[0] and EMU.is_pinned(snap) and snap.tolist() == [2] * 4
    st_ = race._Staging(env, "ring_events", 4, ring_depth=3)
    got = [st_.stage(race._fill, n) for n in range(4)]
    assert got[0] is got[3] and got[0] is not got[1]
    assert race._Staging(env, "no_copy", 4).stage(race._fill, 0) is None
    assert not EMU.is_pinned(race._Staging(env, "pageable", 4).slots[0])


# --------------------------------------------------------------------------- decode pieces

@FAST
@given(st.lists(st.integers(-50, 400), min_size=2, max_size=18), st.integers(0, 300))
def test_safe_indptr_is_always_well_formed(row, total):
    t = torch.tensor(row, dtype=torch.int32)
    out = race.safe_indptr(t, total, torch.arange(len(row))).tolist()
    assert out[0] == 0 and out[-1] == total
    assert all(0 <= a <= b <= total for a, b in zip(out, out[1:]))


@FAST
@given(st.lists(st.integers(0, 200), min_size=1, max_size=12), st.sampled_from([1, 16]))
def test_safe_indptr_keeps_a_correct_indptr(lens, page_size):
    ip = kv_indptr(lens, page_size)
    assert race.safe_indptr(ip, int(ip[-1]), torch.arange(ip.numel())).tolist() == ip.tolist()


def _random_case(seed, batch=5, page_size=16, hq=4, hkv=2, d=32, max_len=90):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_len, (batch,), generator=g)
    width = -(-max_len // page_size)
    pool = batch * width + 3
    bt = torch.randperm(pool, generator=g)[: batch * width].reshape(batch, width).to(torch.int32)
    ip = kv_indptr(lens, page_size)
    lpl = last_page_len(lens, page_size)
    idx = page_indices(bt, ip, int(ip[-1]))
    q = torch.randn(batch, hq, d, generator=g)
    k = torch.randn(pool, page_size, hkv, d, generator=g)
    v = torch.randn(pool, page_size, hkv, d, generator=g)
    return q, k, v, ip, idx, lpl, width


@pytest.mark.parametrize("seed", range(4))
def test_torch_paged_decode_matches_the_reference(seed):
    q, k, v, ip, idx, lpl, width = _random_case(seed, hq=4 if seed % 2 else 2, hkv=2)
    got = race.torch_paged_decode(q, k, v, ip, idx, lpl, max_pages=width)
    want = reference_decode(q, k, v, ip, idx, lpl)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)


def test_torch_paged_decode_survives_wrong_metadata():
    q, k, v, ip, idx, lpl, width = _random_case(7)
    wrong_ip = torch.tensor([0, 50, 2, 3, 900, 5], dtype=torch.int32)
    out = race.torch_paged_decode(q, k, v, wrong_ip, idx, torch.full_like(lpl, 77), max_pages=width)
    assert out.shape == q.shape and bool(torch.isfinite(out).all())
    empty = race.torch_paged_decode(q, k, v, torch.zeros(6, dtype=torch.int32), idx[:0], lpl, max_pages=width)
    assert bool((empty == 0).all())
    with pytest.raises(ValueError, match="entries"):
        race.torch_paged_decode(q, k, v, ip[:-1], idx, lpl, max_pages=width)


def _decode(strategies, **kw):
    args = dict(strategies=strategies, steps=24, max_batch=6, page_size=8, max_seq_len=64, num_qo_heads=4,
                num_kv_heads=2, head_dim=16, busy_ms=1.0, ring=3, ahead=2, seed=2, backend="auto", tol=0.02)
    args.update(kw)
    return race._decode_race(EMU, **args)


def test_decode_race_in_the_emulated_stream():
    res = _decode(["reused_pinned", "pageable", "snapshot", "ring_events", "double_pinned"])
    assert res["backend"] == "torch" and res["fallback_reason"]  # no CUDA here: the torch fallback
    assert res["joins"] > 0 and res["leaves"] > 0
    assert len(res["batch_sizes"]) == 24 and max(res["batch_sizes"]) <= 6
    for s in ("pageable", "snapshot", "ring_events"):
        r = res["runs"][s]
        assert r["copies_wrong"] == 0 and r["wrong_input_steps"] == 0 and r["wrong_output_steps"] == 0, s
        assert r["received"] == list(range(24)) and r["max_err_right_inputs"] < 1e-4
    for s in ("reused_pinned", "double_pinned"):
        r = res["runs"][s]
        assert r["copies_wrong"] >= 1 and r["wrong_input_steps"] >= 1 and r["wrong_output_steps"] >= 1, s
        assert r["max_err_right_inputs"] < 1e-4  # wrong outputs come only from wrong inputs
        assert [len(e) for e in r["err"]] == res["batch_sizes"]
    m = race.error_matrix(res["runs"]["reused_pinned"], res["max_batch"])
    assert m.shape == (24, 6) and math.isnan(m[0, -1]) == (res["batch_sizes"][0] < 6)
    json.dumps(res)


def test_decode_race_torch_backend_and_errors():
    res = _decode(["pageable"], backend="torch", steps=6)
    assert res["backend"] == "torch" and "asked" in res["fallback_reason"]
    with pytest.raises(Exception):  # FlashInfer cannot run without CUDA
        _decode(["pageable"], backend="flashinfer", steps=4)


def test_decode_accounting_counts_wrong_pages():
    class Setup:
        steps, max_batch = 2, 2
        indptrs = [[0, 1, 3], [0, 2, 3]]
        lpls = [[4, 2], [1, 4]]
        images = race.metadata_images(indptrs, lpls, 2)
        indices_cpu = [torch.tensor([7, 8, 9], dtype=torch.int32), torch.tensor([7, 10, 8], dtype=torch.int32)]

        def batch(self, n):
            return len(self.lpls[n])

    s = Setup()
    raw = {
        "rows": [s.images[1], s.images[1]],  # step 0's copy got step 1's metadata
        "used": [torch.tensor([7, 10, 8], dtype=torch.int32), s.indices_cpu[1]],
        "outs": [torch.zeros(2, 1, 2), torch.zeros(1 + 1, 1, 2)],
    }
    refs = [torch.tensor([[[0.0, 0.0]], [[0.5, 0.0]]]), torch.zeros(2, 1, 2)]
    acc = race.decode_accounting(s, raw, refs, tol=0.1, gpu_last_page_len=False)
    assert acc["received"] == [1, 1] and acc["copies_wrong"] == 1
    assert acc["wrong_inputs"] == [[0, 1], [0, 0]] and acc["wrong_input_steps"] == 1
    assert acc["wrong_output_steps"] == 1 and acc["max_err_wrong_inputs"] == 0.5
    acc = race.decode_accounting(s, raw, refs, tol=0.1, gpu_last_page_len=True)
    assert acc["wrong_inputs"][0] == [1, 1]  # the torch backend also reads the raced last_page_len


# --------------------------------------------------------------------------- the child process

def test_classify_child():
    ok = race.classify_child(0, 'x\nPINLAB_RESULT {"status": "correct", "detail": "fine", "err_a": 0.001}\n', "", False)
    assert ok == {"outcome": "correct", "detail": "fine", "err_a": 0.001}
    assert race.classify_child(None, "", "", True)["outcome"] == "hung"
    dead = race.classify_child(-6, "", "...\nRuntimeError: CUDA error: an illegal memory access was encountered\n", False)
    assert dead["outcome"] == "crashed" and "illegal memory access" in dead["detail"]
    assert race.classify_child(1, "", "", False)["detail"].startswith("exit status 1")
    assert race.classify_child(0, "PINLAB_RESULT {bad json", "boom", False)["outcome"] == "crashed"


def test_child_process_runs_and_reports(no_cuda):
    res = race._run_child("synced", 1.0, 0, 0.02, timeout_s=120)
    assert res["outcome"] == "unavailable" and res["returncode"] == 0  # no GPU here, reported as data


def test_plan_hazard_child_checks_its_mode():
    with pytest.raises(ValueError, match="mode"):
        race._plan_hazard_child("sideways", 1.0, 0, 0.02)


# --------------------------------------------------------------------------- plots

def test_plots_draw_from_results():
    runs = race._plain_race(EMU, strategies=["reused_pinned", "pageable"], steps=12, nbytes=16, busy_ms=0.5,
                            ahead=None)["runs"]
    race.plot_received(runs, title="t")
    race.plot_errors(_decode(["reused_pinned"], steps=8), "reused_pinned", title="t")
    race.plot_host_cumulative(race._pageable_cost(EMU, sizes=[1024], steps=5, busy_ms=0.5), title="t")
    race.plot_history(race._history(EMU, strategies=race.HISTORY, steps=8, nbytes=64, busy_ms=0.3, ahead=2,
                                     ring_depth=3), title="t")
    plt.close("all")
    with pytest.raises(TypeError):
        race.plot_received({}, title="t")
