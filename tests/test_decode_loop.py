"""CPU tests for pinlab.decode_loop: the schedule, metadata images, safe_indptr, the torch paged
decode, the accounting, and the decode loop on the emulated lagging stream."""
from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pinlab
from pinlab import decode_loop
from pinlab.paged_kv import kv_indptr, last_page_len, page_indices, reference_decode

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_decode_schedule_invariants():
    sch = decode_loop.decode_schedule(80, 8, 64, seed=3)
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
    assert decode_loop.decode_schedule(80, 8, 64, seed=3) == sch  # reproducible
    assert decode_loop.decode_schedule(80, 8, 64, seed=4) != sch
    with pytest.raises(ValueError, match="probability"):
        decode_loop.decode_schedule(5, 4, 64, seed=0, join_prob=1.5)
    with pytest.raises(ValueError, match="max_seq_len"):
        decode_loop.decode_schedule(5, 4, 1, seed=0)


def test_metadata_images_and_match():
    ips = [[0, 1, 3], [0, 2], [0, 1, 2, 4]]
    lpls = [[5, 7], [3], [1, 2, 9]]
    img = decode_loop.metadata_images(ips, lpls, 3)
    assert img[0] == [0, 1, 3, 0, 5, 7, 0]
    assert img[1] == [0, 2, 3, 0, 3, 7, 0]  # entries past the batch keep older values
    assert img[2] == [0, 1, 2, 4, 1, 2, 9]
    assert decode_loop.match_received(img[0], img, 0, 2, 3) == 0
    assert decode_loop.match_received(img[2], img, 0, 2, 3) == 2
    assert decode_loop.match_received([9] * 7, img, 0, 2, 3) == -1
    # only the entries step n uses count: a different tail is still step n's data
    assert decode_loop.match_received([0, 2, 99, 99, 3, 99, 99], img, 1, 1, 3) == 1
    with pytest.raises(ValueError):
        decode_loop.metadata_images([[0, 1]], [[1, 2]], 3)
    with pytest.raises(ValueError):
        decode_loop.metadata_images([[0]], [[], []], 3)


@FAST
@given(st.lists(st.integers(-50, 400), min_size=2, max_size=18), st.integers(0, 300))
def test_safe_indptr_is_always_well_formed(row, total):
    t = torch.tensor(row, dtype=torch.int32)
    out = decode_loop.safe_indptr(t, total, torch.arange(len(row))).tolist()
    assert out[0] == 0 and out[-1] == total
    assert all(0 <= a <= b <= total for a, b in zip(out, out[1:]))


@FAST
@given(st.lists(st.integers(0, 200), min_size=1, max_size=12), st.sampled_from([1, 16]))
def test_safe_indptr_keeps_a_correct_indptr(lens, page_size):
    ip = kv_indptr(lens, page_size)
    assert decode_loop.safe_indptr(ip, int(ip[-1]), torch.arange(ip.numel())).tolist() == ip.tolist()


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
    got = decode_loop.torch_paged_decode(q, k, v, ip, idx, lpl, max_pages=width)
    want = reference_decode(q, k, v, ip, idx, lpl)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)


def test_torch_paged_decode_survives_wrong_metadata():
    q, k, v, ip, idx, lpl, width = _random_case(7)
    wrong_ip = torch.tensor([0, 50, 2, 3, 900, 5], dtype=torch.int32)
    out = decode_loop.torch_paged_decode(q, k, v, wrong_ip, idx, torch.full_like(lpl, 77), max_pages=width)
    assert out.shape == q.shape and bool(torch.isfinite(out).all())
    empty = decode_loop.torch_paged_decode(q, k, v, torch.zeros(6, dtype=torch.int32), idx[:0], lpl, max_pages=width)
    assert bool((empty == 0).all())
    with pytest.raises(ValueError, match="entries"):
        decode_loop.torch_paged_decode(q, k, v, ip[:-1], idx, lpl, max_pages=width)


def test_decode_setup_uses_paged_kv_metadata():
    with pinlab.LaggingStream() as s:
        setup = decode_loop.DecodeSetup(s, steps=6, max_batch=4, page_size=8, max_seq_len=40, num_qo_heads=2,
                                        num_kv_heads=1, head_dim=8, seed=1)
    for n, stp in enumerate(setup.sched):
        assert setup.indptrs[n] == kv_indptr(stp["seq_lens"], 8).tolist()
        assert setup.lpls[n] == last_page_len(stp["seq_lens"], 8).tolist()
        assert setup.batch(n) == len(stp["req_ids"])
    assert len(setup.references()) == 6


def _decode(strategies, **kw):
    args = dict(strategies=strategies, steps=24, max_batch=6, page_size=8, max_seq_len=64, num_qo_heads=4,
                num_kv_heads=2, head_dim=16, busy_ms=1.0, ring=3, run_ahead=1, seed=2, backend="auto", tol=0.02)
    args.update(kw)
    return decode_loop.every_strategy(pinlab.LaggingStream(), **decode_loop.check_args(**args))


@pytest.mark.slow
def test_decode_loop_on_the_lagging_stream():
    res = _decode(["reused_pinned", "pageable", "snapshot", "ring_events", "double_pinned"])
    assert res["backend"] == "torch" and "emulated" in res["fallback_reason"]
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
    m = decode_loop.error_matrix(res["runs"]["reused_pinned"], res["max_batch"])
    assert m.shape == (24, 6) and math.isnan(m[0, -1]) == (res["batch_sizes"][0] < 6)
    json.dumps(res)


def test_decode_torch_backend_and_errors():
    res = _decode(["pageable"], backend="torch", steps=6)
    assert res["backend"] == "torch" and "asked" in res["fallback_reason"]
    with pytest.raises(pinlab.paged_kv.FlashInferUnavailableError):  # FlashInfer cannot run on the emulation
        _decode(["pageable"], backend="flashinfer", steps=4)
    with pytest.raises(ValueError, match="ring"):
        decode_loop.check_args(strategies=["pageable"], steps=4, max_batch=2, page_size=8, max_seq_len=16,
                               num_qo_heads=2, num_kv_heads=1, head_dim=8, busy_ms=1.0, ring=2, run_ahead=2, seed=0,
                               backend="auto", tol=0.02)


def test_decode_accounting_counts_wrong_pages():
    class Setup:
        steps, max_batch = 2, 2
        indptrs = [[0, 1, 3], [0, 2, 3]]
        lpls = [[4, 2], [1, 4]]
        images = decode_loop.metadata_images(indptrs, lpls, 2)
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
    acc = decode_loop.decode_accounting(s, raw, refs, tol=0.1, gpu_last_page_len=False)
    assert acc["received"] == [1, 1] and acc["copies_wrong"] == 1
    assert acc["wrong_inputs"] == [[0, 1], [0, 0]] and acc["wrong_input_steps"] == 1
    assert acc["wrong_output_steps"] == 1 and acc["max_err_wrong_inputs"] == 0.5
    acc = decode_loop.decode_accounting(s, raw, refs, tol=0.1, gpu_last_page_len=True)
    assert acc["wrong_inputs"][0] == [1, 1]  # the torch backend also reads the raced last_page_len


def test_torch_paged_decode_rejects_bad_input_and_never_reads_outside_the_cache():
    import pytest
    import torch

    from pinlab.decode_loop import torch_paged_decode

    q = torch.randn(2, 4, 8)
    k = torch.randn(5, 4, 2, 8)
    ip, lpl = torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([4, 4], dtype=torch.int32)
    far = torch.tensor([99, -7], dtype=torch.int32)  # page ids past the cache and negative
    out = torch_paged_decode(q, k, k.clone(), ip, far, lpl, max_pages=2)
    assert out.shape == (2, 4, 8) and torch.isfinite(out).all()
    with pytest.raises(TypeError, match="q"):
        torch_paged_decode(None, k, k, ip, far, lpl, max_pages=2)
    with pytest.raises(ValueError, match="k_cache"):
        torch_paged_decode(q, k[0], k[0], ip, far, lpl, max_pages=2)
    with pytest.raises(ValueError, match="v_cache"):
        torch_paged_decode(q, k, k[:3], ip, far, lpl, max_pages=2)
    with pytest.raises(ValueError, match="heads"):
        torch_paged_decode(q, k[:, :, :0], k[:, :, :0], ip, far, lpl, max_pages=2)
    with pytest.raises(TypeError, match="indptr"):
        torch_paged_decode(q, k, k, ip.float(), far, lpl, max_pages=2)


def test_the_step_models_refuse_runaway_step_counts():
    import pytest

    from pinlab import steploop

    with pytest.raises(ValueError, match="steps"):
        steploop.simulate(steps=10**7)
    with pytest.raises(ValueError, match="steps"):
        steploop.check_dst(10**7, 4)
