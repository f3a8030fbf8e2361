"""CPU tests for pinlab.paged_kv: vLLM's FlashInfer metadata, the torch reference, the glue."""
from __future__ import annotations

import inspect
import math
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pinlab.paged_kv import (
    FlashInferDecode,
    FlashInferUnavailableError,
    build_metadata,
    flashinfer_available,
    kv_indptr,
    last_page_len,
    num_pages,
    page_indices,
    random_batch,
    reference_decode,
)

PAGE_SIZES = [1, 16, 64]
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SLOW = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _flashinfer():
    """The flashinfer module if it imports on this CPU machine, else skip."""
    try:
        with warnings.catch_warnings():  # its import warns about cutlass deprecations
            warnings.simplefilter("ignore")
            import flashinfer
    except Exception as exc:  # some 0.6.x releases crash at import without a GPU
        pytest.skip(f"flashinfer does not import here: {type(exc).__name__}: {exc}")
    return flashinfer


# ----------------------------------------------------------------- naive Python-loop versions

def naive_metadata(block_table: list[list[int]], seq_lens: list[int], page_size: int):
    pages, indptr, last, indices = [], [0], [], []
    for row, n in zip(block_table, seq_lens):
        p = 0
        while p * page_size < n:
            p += 1
        pages.append(p)
        indptr.append(indptr[-1] + p)
        indices.extend(row[:p])
        if n == 0:
            last.append(0)
        else:
            last.append(n - (p - 1) * page_size)
    return pages, indptr, last, indices


def naive_attention(q, k_cache, v_cache, block_table, seq_lens, page_size, sm_scale):
    """Dense attention per request and per head, reading K/V token by token from the block table."""
    batch, hq, d = q.shape
    hkv = k_cache.shape[2]
    out = torch.zeros(batch, hq, d, dtype=torch.float64)
    for b in range(batch):
        n = int(seq_lens[b])
        if n == 0:
            continue
        ks = torch.stack([k_cache[int(block_table[b, t // page_size]), t % page_size] for t in range(n)]).double()
        vs = torch.stack([v_cache[int(block_table[b, t // page_size]), t % page_size] for t in range(n)]).double()
        for h in range(hq):
            kvh = h // (hq // hkv)
            scores = ks[:, kvh, :] @ q[b, h].double() * sm_scale
            weights = torch.exp(scores - scores.max())
            weights = weights / weights.sum()
            out[b, h] = weights @ vs[:, kvh, :]
    return out


# ----------------------------------------------------------------- strategies

@st.composite
def batches(draw, max_batch=8, max_pages=6):
    """(page_size, seq_lens, block_table) with distinct page ids; lengths include 0 and full pages."""
    page_size = draw(st.sampled_from(PAGE_SIZES))
    max_len = page_size * max_pages
    one_len = st.one_of(
        st.just(0),
        st.integers(0, max_pages).map(lambda k: k * page_size),  # page-aligned
        st.integers(0, max_len),
    )
    seq_lens = draw(st.lists(one_len, min_size=1, max_size=max_batch))
    width = draw(st.integers(max_pages, max_pages + 2))
    pool = draw(st.permutations(range(len(seq_lens) * width + 3)))
    block_table = [list(pool[i * width:(i + 1) * width]) for i in range(len(seq_lens))]
    return page_size, seq_lens, block_table


# ----------------------------------------------------------------- metadata

def test_vllm_worked_example():
    s = torch.tensor([37, 48, 17, 0], dtype=torch.int32)
    assert num_pages(s, 16).tolist() == [3, 3, 2, 0]
    assert kv_indptr(s, 16).tolist() == [0, 3, 6, 8, 8]
    assert last_page_len(s, 16).tolist() == [5, 16, 1, 0]
    for t in (num_pages(s, 16), kv_indptr(s, 16), last_page_len(s, 16)):
        assert t.dtype == torch.int32 and t.device == s.device


def test_old_vllm_docstring_example():
    # pages [0,5,8], [1,6,7], [3,4] -> indices [0,5,8,1,6,7,3,4], indptr [0,3,6,8]
    bt = torch.tensor([[0, 5, 8, 99], [1, 6, 7, 99], [3, 4, 99, 99]], dtype=torch.int32)
    m = build_metadata(bt, torch.tensor([40, 33, 20]), 16)
    assert m.indptr_cpu.tolist() == [0, 3, 6, 8]
    assert m.indices.tolist() == [0, 5, 8, 1, 6, 7, 3, 4]
    assert m.last_page_len_cpu.tolist() == [8, 1, 4]
    assert m.batch_size == 3 and m.total_pages == 8


@FAST
@given(batches())
def test_metadata_matches_naive(batch):
    page_size, seq_lens, table = batch
    pages, indptr, last, indices = naive_metadata(table, seq_lens, page_size)
    s = torch.tensor(seq_lens, dtype=torch.int64)
    bt = torch.tensor(table, dtype=torch.int32)
    assert num_pages(s, page_size).tolist() == pages
    assert kv_indptr(s, page_size).tolist() == indptr
    assert last_page_len(s, page_size).tolist() == last
    assert page_indices(bt, kv_indptr(s, page_size), indptr[-1]).tolist() == indices
    m = build_metadata(bt, s, page_size)
    assert m.indptr_cpu.tolist() == indptr and m.last_page_len_cpu.tolist() == last
    assert m.indices.tolist() == indices
    assert {m.indptr_cpu.dtype, m.last_page_len_cpu.dtype, m.indices.dtype} == {torch.int32}
    assert m.indptr_cpu.device.type == "cpu" and m.last_page_len_cpu.device.type == "cpu"


@FAST
@given(batches())
def test_flashinfer_get_seq_lens_round_trips(batch):
    flashinfer = _flashinfer()
    page_size, seq_lens, _ = batch
    s = torch.tensor(seq_lens, dtype=torch.int32)
    back = flashinfer.page.get_seq_lens(kv_indptr(s, page_size), last_page_len(s, page_size), page_size)
    assert back.tolist() == seq_lens


def test_last_page_len_is_in_flashinfer_range():
    s = torch.arange(0, 200)
    for ps in PAGE_SIZES:
        lpl = last_page_len(s, ps)
        assert lpl[0] == 0
        assert bool(((lpl[1:] >= 1) & (lpl[1:] <= ps)).all())


def test_page_indices_needs_no_host_data():
    """On the meta device any read of a value (.item(), .tolist(), a boolean mask) fails,
    so this passing means page_indices never syncs with the device."""
    bt = torch.empty(5, 7, dtype=torch.int32, device="meta")
    indptr = torch.empty(6, dtype=torch.int32, device="meta")
    out = page_indices(bt, indptr, 19)
    assert out.shape == (19,) and out.dtype == torch.int32 and out.device.type == "meta"


def test_page_indices_has_no_loop_over_requests():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    counts = []
    for batch in (2, 40):
        bt = torch.empty(batch, 9, dtype=torch.int32, device="meta")
        indptr = torch.empty(batch + 1, dtype=torch.int32, device="meta")
        with Record() as rec:
            page_indices(bt, indptr, 3 * batch)
        counts.append(len(rec.ops))
        assert not any("_local_scalar_dense" in op or "nonzero" in op for op in rec.ops)
    assert counts[0] == counts[1], f"op count grows with the batch: {counts}"


def test_build_metadata_device_argument():
    bt = torch.tensor([[3, 1], [0, 2]], dtype=torch.int32)
    m = build_metadata(bt, [17, 16], 16, device="cpu")
    assert m.indices.tolist() == [3, 1, 0] and m.indices.device.type == "cpu"


# ----------------------------------------------------------------- bad inputs

@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: num_pages(torch.tensor([3, -1]), 16), ValueError, r"seq_lens must be >= 0.*seq_lens\[1\] = -1"),
        (lambda: num_pages([3, -1], 16), ValueError, "seq_lens"),
        (lambda: num_pages(torch.tensor([3]), 0), ValueError, "page_size must be > 0"),
        (lambda: kv_indptr(torch.tensor([3]), 16.0), TypeError, "page_size must be an int"),
        (lambda: last_page_len(torch.tensor([3.0]), 16), TypeError, "seq_lens must have an integer dtype"),
        (lambda: num_pages(torch.tensor([[3]]), 16), ValueError, "seq_lens must be 1-D"),
        (lambda: num_pages([3, 2.5], 16), TypeError, r"seq_lens\[1\] must be an int"),
        (lambda: page_indices(torch.zeros(2, 3, dtype=torch.int32), torch.zeros(3, dtype=torch.int64), 0),
         TypeError, "indptr must have an integer dtype"),
        (lambda: page_indices(torch.zeros(6, dtype=torch.int32), torch.zeros(3, dtype=torch.int32), 0),
         ValueError, "block_table must be 2-D"),
        (lambda: page_indices(torch.zeros(2, 3, dtype=torch.int32), torch.zeros(4, dtype=torch.int32), 0),
         ValueError, "indptr must have batch_size \\+ 1 = 3"),
        (lambda: page_indices(torch.zeros(2, 3, dtype=torch.int32), torch.tensor([0, 1, 2], dtype=torch.int32), 5),
         ValueError, "total_pages must equal indptr\\[-1\\] = 2"),
        (lambda: page_indices(torch.zeros(2, 3, dtype=torch.int32), torch.tensor([0, 1, 2], dtype=torch.int32), -1),
         ValueError, "total_pages must be >= 0"),
        (lambda: build_metadata(torch.zeros(2, 3, dtype=torch.int32), torch.tensor([1, 2, 3]), 16),
         ValueError, "seq_lens_cpu has 3 requests but block_table has 2 rows"),
        (lambda: build_metadata(torch.zeros(2, 1, dtype=torch.int32), torch.tensor([1, 17]), 16),
         ValueError, "needs 2 pages .* only 1 columns"),
        (lambda: build_metadata(torch.zeros(2, 3, dtype=torch.float32), torch.tensor([1, 2]), 16),
         TypeError, "block_table must have an integer dtype"),
        (lambda: build_metadata(torch.zeros(2, 3, dtype=torch.int32), torch.tensor([1, 2], device="meta"), 16),
         ValueError, "seq_lens_cpu must be a CPU tensor"),
    ],
)
def test_metadata_bad_inputs(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def _small_problem():
    b = random_batch(3, 40, 16, 2, 8, 4, seed=0, dtype=torch.float32)
    m = build_metadata(b.block_table, b.seq_lens, 16)
    return b, m


@pytest.mark.parametrize(
    "change, exc, match",
    [
        (lambda b, m: dict(q=b.q[0]), ValueError, "q must be \\[batch, num_qo_heads, head_dim\\]"),
        (lambda b, m: dict(q=b.q.to(torch.int32)), TypeError, "q must have a floating-point dtype"),
        (lambda b, m: dict(v_cache=b.v_cache[:, :8]), ValueError, "v_cache must have k_cache's shape"),
        (lambda b, m: dict(k_cache=b.k_cache[0]), ValueError, "k_cache must be .*NHD"),
        (lambda b, m: dict(q=b.q[:, :3]), ValueError, "multiple of num_kv_heads"),
        (lambda b, m: dict(q=b.q[..., :4]), ValueError, "head_dim 4 but k_cache has head_dim 8"),
        (lambda b, m: dict(indptr=m.indptr_cpu.long()), TypeError, "indptr must have an integer dtype \\(int32\\)"),
        (lambda b, m: dict(indptr=m.indptr_cpu[:-1]), ValueError, "indptr must have batch_size \\+ 1 = 4"),
        (lambda b, m: dict(last_page_len=m.last_page_len_cpu[:2]), ValueError, "last_page_len must have batch_size = 3"),
        (lambda b, m: dict(indices=m.indices[:0]), ValueError, "indices must hold at least"),
        (lambda b, m: dict(indices=m.indices + 1000), ValueError, "indices must be page ids in"),
        (lambda b, m: dict(sm_scale=0.0), ValueError, "sm_scale must be > 0"),
    ],
)
def test_reference_decode_bad_inputs(change, exc, match):
    b, m = _small_problem()
    if not m.total_pages:
        pytest.skip("seed gave no pages")
    args = dict(q=b.q, k_cache=b.k_cache, v_cache=b.v_cache, indptr=m.indptr_cpu,
                indices=m.indices, last_page_len=m.last_page_len_cpu)
    args.update(change(b, m))
    with pytest.raises(exc, match=match):
        reference_decode(**args)


def test_reference_decode_rejects_inconsistent_last_page_len():
    q = torch.zeros(2, 1, 4)
    kv = torch.zeros(3, 4, 1, 4)
    indptr = torch.tensor([0, 1, 1], dtype=torch.int32)
    indices = torch.tensor([2], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"last_page_len\[0\] must be in 1..4"):
        reference_decode(q, kv, kv, indptr, indices, torch.tensor([5, 0], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"last_page_len\[1\] must be 0"):
        reference_decode(q, kv, kv, indptr, indices, torch.tensor([1, 2], dtype=torch.int32))


# ----------------------------------------------------------------- reference attention

@SLOW
@given(
    page_size=st.sampled_from(PAGE_SIZES),
    batch=st.integers(1, 5),
    kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2, 4]),
    head_dim=st.sampled_from([4, 16]),
    seed=st.integers(0, 2**20),
)
def test_reference_decode_matches_dense(page_size, batch, kv_heads, group, head_dim, seed):
    max_len = min(3 * page_size + 5, 70)
    b = random_batch(batch, max_len, page_size, kv_heads, head_dim, kv_heads * group,
                     seed=seed, dtype=torch.float32)
    m = build_metadata(b.block_table, b.seq_lens, page_size)
    got = reference_decode(b.q, b.k_cache, b.v_cache, m.indptr_cpu, m.indices, m.last_page_len_cpu)
    want = naive_attention(b.q, b.k_cache, b.v_cache, b.block_table, b.seq_lens, page_size, 1 / math.sqrt(head_dim))
    assert got.dtype == torch.float32 and got.shape == (batch, kv_heads * group, head_dim)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_reference_decode_gqa_empty_and_fp16():
    ps, hkv, group, d = 16, 2, 3, 8
    b = random_batch(4, 50, ps, hkv, d, hkv * group, seed=7, dtype=torch.float16)
    seq_lens = torch.tensor([0, 32, 1, 45], dtype=torch.int32)  # empty, page-aligned, one token, ragged
    m = build_metadata(b.block_table, seq_lens, ps)
    got = reference_decode(b.q, b.k_cache, b.v_cache, m.indptr_cpu, m.indices, m.last_page_len_cpu, sm_scale=0.3)
    want = naive_attention(b.q, b.k_cache, b.v_cache, b.block_table, seq_lens, ps, 0.3)
    assert got.dtype == torch.float32
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    # one token: the output is exactly that token's value row for every query head in the group
    v_tok = b.v_cache[int(b.block_table[2, 0]), 0].float()
    torch.testing.assert_close(got[2], v_tok.repeat_interleave(group, dim=0), rtol=1e-6, atol=1e-6)


def test_reference_decode_all_empty():
    b = random_batch(2, 0, 16, 1, 4, 2, seed=1, dtype=torch.float32)
    m = build_metadata(b.block_table, b.seq_lens, 16)
    assert m.total_pages == 0 and m.indices.numel() == 0
    out = reference_decode(b.q, b.k_cache, b.v_cache, m.indptr_cpu, m.indices, m.last_page_len_cpu)
    assert torch.equal(out, torch.zeros(2, 2, 4))


# ----------------------------------------------------------------- random_batch

def test_random_batch_shapes_and_distinct_pages():
    b = random_batch(6, 100, 16, 2, 8, 4, seed=3, device="cpu", dtype=torch.bfloat16)
    width = math.ceil(100 / 16)
    assert b.block_table.shape == (6, width) and b.block_table.dtype == torch.int32
    assert b.block_table.unique().numel() == b.block_table.numel()
    assert b.k_cache.shape[0] > b.block_table.numel()  # spare pages exist
    assert b.k_cache.shape[1:] == (16, 2, 8) and b.v_cache.shape == b.k_cache.shape
    assert b.q.shape == (6, 4, 8) and b.q.dtype == torch.bfloat16
    assert b.seq_lens.dtype == torch.int32 and b.seq_lens.device.type == "cpu"
    assert int(b.seq_lens.min()) >= 0 and int(b.seq_lens.max()) <= 100
    assert int(b.block_table.max()) < b.k_cache.shape[0]


def test_random_batch_reproducible_and_varied():
    a = random_batch(4, 64, 16, 1, 4, 1, seed=11)
    b = random_batch(4, 64, 16, 1, 4, 1, seed=11)
    c = random_batch(4, 64, 16, 1, 4, 1, seed=12)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a.k_cache, c.k_cache)
    lens = torch.cat([random_batch(8, 64, 16, 1, 4, 1, seed=s).seq_lens for s in range(20)])
    assert (lens % 16 != 0).any()
    empty = (lens == 0).float().mean()
    assert empty > 0.10, f"only {empty:.0%} empty sequences (about 18% expected)"
    aligned = ((lens % 16 == 0) & (lens > 0)).float().mean()
    assert aligned > 0.12, f"only {aligned:.0%} page-aligned non-empty lengths (about 24% expected)"


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(batch_size=0), ValueError, "batch_size must be > 0"),
        (dict(max_seq_len=-1), ValueError, "max_seq_len must be >= 0"),
        (dict(num_qo_heads=3), ValueError, "multiple of num_kv_heads"),
        (dict(dtype=torch.int32), TypeError, "dtype must be a floating-point"),
        (dict(seed=1.5), TypeError, "seed must be an int"),
    ],
)
def test_random_batch_bad_inputs(kwargs, exc, match):
    args = dict(batch_size=2, max_seq_len=10, page_size=4, num_kv_heads=2, head_dim=4, num_qo_heads=4,
                seed=0, dtype=torch.float16)
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        random_batch(**args)


# ----------------------------------------------------------------- FlashInfer glue on the CPU

def test_flashinfer_available_false_without_cuda(monkeypatch):
    monkeypatch.setenv("PINLAB_FORCE_CPU", "1")
    ok, reason = flashinfer_available()
    assert ok is False and "CUDA" in reason and reason.endswith(".")


def test_flashinfer_available_false_when_not_installed(monkeypatch):
    import pinlab.device as dev

    monkeypatch.setattr(dev, "has_cuda", lambda: True)
    monkeypatch.setattr(dev, "flashinfer_status",
                        lambda: (None, "FlashInfer is not importable (ImportError: x); install flashinfer-python"))
    ok, reason = flashinfer_available()
    assert ok is False and "not importable" in reason and "install flashinfer-python" in reason


def test_flashinfer_available_never_raises(monkeypatch):
    import pinlab.device as dev

    def boom():
        raise OSError("broken")

    monkeypatch.setattr(dev, "has_cuda", boom)
    ok, reason = flashinfer_available()
    assert ok is False and "OSError" in reason


def test_flashinfer_decode_unavailable_on_cpu(monkeypatch):
    monkeypatch.setenv("PINLAB_FORCE_CPU", "1")
    with pytest.raises(FlashInferUnavailableError, match="needs a CUDA GPU") as info:
        FlashInferDecode(8, 2, 64, 16)
    assert isinstance(info.value, RuntimeError)


@pytest.mark.parametrize(
    "args, kwargs, exc, match",
    [
        ((6, 4, 64, 16), {}, ValueError, "num_qo_heads \\(6\\) must be a multiple of num_kv_heads \\(4\\)"),
        ((8, 2, 64, 0), {}, ValueError, "page_size must be > 0"),
        ((8, 2, 64, 16), dict(dtype=torch.float32), TypeError, "dtype must be torch.float16 or torch.bfloat16"),
    ],
)
def test_flashinfer_decode_checks_arguments_first(monkeypatch, args, kwargs, exc, match):
    monkeypatch.setenv("PINLAB_FORCE_CPU", "1")
    with pytest.raises(exc, match=match):
        FlashInferDecode(*args, **kwargs)


class _FakeWrapper:
    def __init__(self, fail_plan=False, fail_run=False):
        self.fail_plan, self.fail_run, self.plan_calls = fail_plan, fail_run, []

    def plan(self, *args, **kwargs):
        self.plan_calls.append((args, kwargs))
        if self.fail_plan:
            raise RuntimeError("nvcc: command not found")

    def run(self, q, kv):
        if self.fail_run:
            raise RuntimeError("ninja build failed")
        return torch.zeros_like(q)


def _decode_with(wrapper, ps=16):
    dec = FlashInferDecode.__new__(FlashInferDecode)  # skip __init__: no GPU here
    dec.num_qo_heads, dec.num_kv_heads, dec.head_dim, dec.page_size = 4, 2, 8, ps
    dec.dtype, dec.wrapper, dec._batch_size, dec._proven = torch.float16, wrapper, None, False
    return dec


def test_first_plan_and_run_errors_become_unavailable():
    b, m = _small_problem()
    kv = (b.k_cache.half(), b.v_cache.half())
    dec = _decode_with(_FakeWrapper(fail_plan=True))
    with pytest.raises(FlashInferUnavailableError, match="first plan\\(\\) failed.*nvcc") as info:
        dec.plan(m.indptr_cpu, m.indices, m.last_page_len_cpu)
    assert isinstance(info.value.__cause__, RuntimeError)

    dec = _decode_with(_FakeWrapper(fail_run=True))
    with pytest.raises(RuntimeError, match="call plan"):
        dec.run(b.q.half(), *kv)
    dec.plan(m.indptr_cpu, m.indices, m.last_page_len_cpu)
    with pytest.raises(FlashInferUnavailableError, match="first run\\(\\) failed.*ninja"):
        dec.run(b.q.half(), *kv)

    dec = _decode_with(_FakeWrapper())
    dec.plan(m.indptr_cpu, m.indices, m.last_page_len_cpu)
    assert dec.run(b.q.half(), *kv).shape == b.q.shape
    dec.wrapper.fail_run = True  # after a first success, errors pass through unchanged
    with pytest.raises(RuntimeError, match="ninja") as info:
        dec.run(b.q.half(), *kv)
    assert not isinstance(info.value, FlashInferUnavailableError)


def test_decode_plan_and_run_check_inputs():
    b, m = _small_problem()
    dec = _decode_with(_FakeWrapper())
    with pytest.raises(TypeError, match="indptr must have an integer dtype \\(int32\\)"):
        dec.plan(m.indptr_cpu.long(), m.indices, m.last_page_len_cpu)
    with pytest.raises(ValueError, match="indptr must have len\\(last_page_len\\) \\+ 1"):
        dec.plan(m.indptr_cpu, m.indices, m.last_page_len_cpu[:-1])
    dec.plan(m.indptr_cpu, m.indices, m.last_page_len_cpu)
    with pytest.raises(TypeError, match="q must be torch.float16"):
        dec.run(b.q, b.k_cache.half(), b.v_cache.half())
    with pytest.raises(ValueError, match="q must have shape \\(3, 4, 8\\)"):
        dec.run(b.q[:2].half(), b.k_cache.half(), b.v_cache.half())
    with pytest.raises(ValueError, match="k_cache must be \\[num_pages, 16, 2, 8\\]"):
        dec.run(b.q.half(), b.k_cache[:, :8].half(), b.v_cache[:, :8].half())


def test_plan_keywords_exist_in_installed_flashinfer():
    """The keywords we pass to plan() must be accepted by this FlashInfer (0.6.18 and 0.7.x both)."""
    flashinfer = _flashinfer()
    _, m = _small_problem()
    dec = _decode_with(_FakeWrapper())
    dec.plan(m.indptr_cpu, m.indices, m.last_page_len_cpu, sm_scale=0.5)
    args, kwargs = dec.wrapper.plan_calls[-1]
    cls = flashinfer.BatchDecodeWithPagedKVCacheWrapper
    impl = getattr(cls, "_plan_impl", cls.plan)
    params = inspect.signature(impl).parameters
    assert list(params)[1:8] == ["indptr", "indices", "last_page_len", "num_qo_heads",
                                 "num_kv_heads", "head_dim", "page_size"]
    assert len(args) == 7 and set(kwargs) <= set(params), set(kwargs) - set(params)
    assert "kv_layout" in inspect.signature(cls.__init__).parameters
    assert "use_tensor_cores" in inspect.signature(cls.__init__).parameters


@pytest.mark.slow
def test_module_does_not_import_flashinfer():
    import subprocess
    import sys

    code = "import sys, pinlab.paged_kv; print('flashinfer' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# ----------------------------------------------------------------- int32 overflow, bad page ids, bad indptr

@pytest.mark.parametrize("call, match", [
    (lambda: num_pages(torch.tensor([3_000_000_000]), 1), r"seq_lens\[0\] = 3000000000 needs 3000000000 pages"),
    (lambda: num_pages([2**62], 16), r"seq_lens\[0\] = 4611686018427387904 needs"),
    (lambda: num_pages([2**63 - 1], 2**31 - 1), "more than FlashInfer's int32"),
    (lambda: num_pages([2**64], 16), r"seq_lens\[0\] = 18446744073709551616 does not fit in int64"),
    (lambda: kv_indptr([1_500_000_000] * 2, 1), "seq_lens need 3000000000 pages in all"),
    (lambda: last_page_len([5], 2**40), "page_size must be <= 2147483647"),
    (lambda: build_metadata(torch.zeros(2, 2, dtype=torch.int32), [2**31, 1], 1), r"seq_lens_cpu\[0\]"),
])
def test_metadata_never_overflows_int32_silently(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_metadata_at_the_int32_limit_is_exact():
    big = 2**31 - 1
    assert num_pages([big], 1).tolist() == [big]
    assert kv_indptr([big - 5, 5], 1).tolist() == [0, big - 5, big]
    assert num_pages(torch.tensor([2**40], dtype=torch.int64), 2**20).tolist() == [2**20]
    assert last_page_len([2**40 + 3], 2**20).tolist() == [3]


def test_build_metadata_rejects_negative_page_ids():
    bt = torch.tensor([[3, -1], [0, 2]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"block_table\[0, 1\] = -1 is not a page id"):
        build_metadata(bt, [17, 16], 16)
    assert build_metadata(bt, [16, 16], 16).indices.tolist() == [3, 0]  # an unused -1 is fine
    wide = torch.tensor([[2**31, 0]], dtype=torch.int64)
    with pytest.raises(ValueError, match=r"block_table\[0, 0\] = 2147483648 is not a page id"):
        build_metadata(wide, [1], 16)


@pytest.mark.parametrize("indptr, total, match", [
    ([0, 2, 1], 1, r"indptr must never decrease, got indptr\[1\] = 2 > indptr\[2\] = 1"),
    ([1, 2, 3], 3, r"indptr must start at 0, got indptr\[0\] = 1"),
    ([-1, 0, 1], 1, "indptr must start at 0"),
])
def test_page_indices_names_a_malformed_indptr(indptr, total, match):
    with pytest.raises(ValueError, match=match):
        page_indices(torch.zeros(2, 3, dtype=torch.int32), torch.tensor(indptr, dtype=torch.int32), total)


def test_build_metadata_on_cuda_without_cuda_says_so(monkeypatch):
    monkeypatch.setenv("PINLAB_FORCE_CPU", "1")
    from pinlab.args import CudaUnavailableError

    bt = torch.tensor([[3, 1], [0, 2]], dtype=torch.int32)
    with pytest.raises(CudaUnavailableError, match=r"^build_metadata\(device='cuda'\) needs a CUDA GPU"):
        build_metadata(bt, [17, 16], 16, device="cuda")
    with pytest.raises(ValueError, match="device must name a device"):
        build_metadata(bt, [17, 16], 16, device="banana")
    with pytest.raises(TypeError, match="device must be None, a str"):
        build_metadata(bt, [17, 16], 16, device=1.5)


def test_reference_decode_issue_cases():
    b, m = _small_problem()
    args = dict(q=b.q, k_cache=b.k_cache, v_cache=b.v_cache, indptr=m.indptr_cpu,
                indices=m.indices, last_page_len=m.last_page_len_cpu)
    pool = b.k_cache.shape[0]
    cases = [
        (dict(indices=m.indices + pool), ValueError, rf"indices must be page ids in \[0, {pool}\)"),
        (dict(k_cache=b.k_cache[:, :, :0], v_cache=b.v_cache[:, :, :0]), ValueError, "num_kv_heads > 0"),
        (dict(k_cache=b.k_cache[0]), ValueError, r"k_cache must be \[num_pages, page_size, num_kv_heads, head_dim\]"),
        (dict(v_cache=b.v_cache[:-1]), ValueError, "v_cache must have k_cache's shape"),
        (dict(q=None), TypeError, "q must be a torch.Tensor, got NoneType"),
        (dict(q=b.q[..., :0], k_cache=b.k_cache[..., :0], v_cache=b.v_cache[..., :0]), ValueError, "head_dim > 0"),
        (dict(k_cache=b.k_cache[:, :0], v_cache=b.v_cache[:, :0]), ValueError, "page_size > 0"),
        (dict(sm_scale=float("nan")), ValueError, "sm_scale must be finite"),
        (dict(q=b.q.to("meta")), ValueError, "q is on the meta device"),
    ]
    for change, exc, match in cases:
        with pytest.raises(exc, match=match):
            reference_decode(**(args | change))


def test_random_batch_refuses_huge_allocations():
    with pytest.raises(ValueError, match="random_batch would allocate"):
        random_batch(10**6, 10**6, 16, 8, 128, 8, seed=0)
    with pytest.raises(ValueError, match="device must name a device"):
        random_batch(2, 8, 4, 1, 4, 1, seed=0, device="banana")
