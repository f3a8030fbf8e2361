"""The paged-decode step loop shared by lessons 03 and 04: real attention fed by raced metadata.

Each step the host writes indptr and last_page_len into the metadata buffer (the strategy of
:class:`pinlab.steploop.Staging` decides which buffer) and copies it to the device with
``non_blocking=True``; the page indices are built **on the device** from that copy of indptr
and the block table (:func:`pinlab.paged_kv.page_indices`, after :func:`safe_indptr`), and
attention runs: FlashInfer's decode wrapper (its ``plan()`` gets host indptr/last_page_len,
as in vLLM) or :func:`torch_paged_decode` (fed by the device copies of both arrays). Every
request's output is compared with :func:`pinlab.paged_kv.reference_decode` fed with the
*correct* metadata (:func:`decode_accounting`).

The pieces: :func:`decode_schedule` (requests grow, join and leave), :func:`metadata_images`
and :func:`match_received` (which step's metadata a copy delivered), :class:`DecodeSetup`,
:func:`decode_loop` (one strategy), :func:`every_strategy` (the loop for every strategy, with
the arguments checked). It runs on a :mod:`pinlab.streams` stream (CUDA or the emulated
lagging stream, where attention falls back to torch).

Why over 500 lines: the torch stand-in for FlashInfer (:func:`torch_paged_decode`) and the
accounting belong to this loop and to nothing else.
"""
from __future__ import annotations

import gc
import math
import random
import statistics
import sys
import time

import numpy as np
import torch

from .args import one_of, positive_int, positive_number
from .paged_kv import (
    FlashInferDecode,
    FlashInferUnavailableError,
    kv_indptr,
    last_page_len as last_page_lens,
    page_indices,
    reference_decode,
)
from .steploop import RunAheadGate, Staging, corruption_summary, strategies_arg, time_summary_us

def decode_schedule(steps: int, max_batch: int, max_seq_len: int, *, seed: int,
                    join_prob: float = 0.3, leave_prob: float = 0.06) -> dict:
    """A reproducible decode workload: requests grow by one token a step, join and leave.

    Each step, every active request leaves with probability ``leave_prob`` (always once it
    reaches ``max_seq_len``); then new requests join, one at a time with probability
    ``join_prob`` each, while fewer than ``max_batch`` are active (the batch is never empty);
    then every active request decodes one token. New requests arrive with 1..max_seq_len/2
    tokens. The batch keeps its order: leavers are removed, joiners are appended.

    Returns ``{"steps": [{"req_ids": [...], "seq_lens": [...]}, ...], "n_requests": int}``; the
    seq_lens of a step include the token decoded in that step.
    """
    steps = positive_int("steps", steps)
    max_batch = positive_int("max_batch", max_batch)
    max_seq_len = positive_int("max_seq_len", max_seq_len)
    seed = positive_int("seed", seed, allow_zero=True)
    for name, p in (("join_prob", join_prob), ("leave_prob", leave_prob)):
        positive_number(name, p, allow_zero=True)
        if p > 1:
            raise ValueError(f"{name} must be a probability in [0, 1], got {p}")
    if max_seq_len < 2:
        raise ValueError(f"max_seq_len must be at least 2 (a request arrives with a token and decodes more), got {max_seq_len}")
    rng = random.Random(seed)
    active: list[list[int]] = []
    next_id = 0

    def new_request():
        nonlocal next_id
        active.append([next_id, rng.randint(1, max(1, max_seq_len // 2))])
        next_id += 1

    for _ in range(max(1, (3 * max_batch) // 4)):
        new_request()
    out = []
    for n in range(steps):
        if n:
            active = [r for r in active if r[1] < max_seq_len and rng.random() >= leave_prob]
            while len(active) < max_batch and (not active or rng.random() < join_prob):
                new_request()
        for r in active:
            r[1] += 1
        out.append({"req_ids": [r[0] for r in active], "seq_lens": [r[1] for r in active]})
    return {"steps": out, "n_requests": next_id}


def metadata_images(indptrs, last_page_lens, max_batch: int) -> list[list[int]]:
    """The reused metadata buffer's content after each step's write.

    The buffer holds ``2 * max_batch + 1`` int32: indptr in ``[0, max_batch]`` and last_page_len
    from ``max_batch + 1`` on. Step n writes ``indptr[:B+1]`` and ``last_page_len[:B]``; entries
    past them keep what earlier steps wrote (the buffer starts as zeros), as in vLLM.
    """
    max_batch = positive_int("max_batch", max_batch)
    if len(indptrs) != len(last_page_lens):
        raise ValueError(f"indptrs ({len(indptrs)}) and last_page_lens ({len(last_page_lens)}) must have one entry per step")
    buf = [0] * (2 * max_batch + 1)
    images = []
    for n, (ip, lpl) in enumerate(zip(indptrs, last_page_lens)):
        b = len(lpl)
        if len(ip) != b + 1 or b > max_batch:
            raise ValueError(f"step {n}: need len(indptr) == len(last_page_len) + 1 <= max_batch + 1, "
                             f"got {len(ip)} and {b} (max_batch {max_batch})")
        buf[: b + 1] = [int(v) for v in ip]
        buf[max_batch + 1: max_batch + 1 + b] = [int(v) for v in lpl]
        images.append(list(buf))
    return images


def match_received(row, images, n: int, batch: int, max_batch: int) -> int:
    """Which step's metadata copy ``n`` delivered, judged on the entries step n uses
    (``indptr[:batch+1]`` and ``last_page_len[:batch]``): n if its own, a later step k if step k's
    (the race), or -1 if it matches no image from step n on (a mix of steps).

    ``row`` and every image hold ``2 * max_batch + 1`` ints (:func:`metadata_images`); ``n`` is a
    step of ``images`` (0 <= n < len(images)) and ``batch`` <= ``max_batch``."""
    max_batch = positive_int("max_batch", max_batch)
    batch = positive_int("batch", batch, allow_zero=True, maximum=max_batch)
    if isinstance(images, (str, bytes)) or not hasattr(images, "__len__") or not hasattr(images, "__getitem__"):
        raise TypeError(f"images must be a list of metadata images (lists of ints), got {type(images).__name__}")
    if not images:
        raise ValueError("images must not be empty: one metadata image per step")
    n = positive_int("n", n, allow_zero=True, maximum=len(images) - 1)
    width = 2 * max_batch + 1
    row = _int_row("row", row, width)
    used = list(range(batch + 1)) + list(range(max_batch + 1, max_batch + 1 + batch))
    want = [row[i] for i in used]
    for k in range(n, len(images)):
        image = images[k]
        if isinstance(image, (str, bytes)) or not hasattr(image, "__len__") or len(image) != width:
            raise ValueError(f"images[{k}] must hold 2 * max_batch + 1 = {width} ints, got "
                             f"{len(image) if hasattr(image, '__len__') else type(image).__name__}")
        if [image[i] for i in used] == want:
            return k
    return -1


def _int_row(name: str, row, width: int) -> list[int]:
    """``row`` (a list, tuple or 1-D integer tensor/array) as a list of ``width`` Python ints."""
    if isinstance(row, (torch.Tensor, np.ndarray)):
        if row.ndim != 1 or row.dtype == torch.bool or row.dtype == np.bool_ or not (
                (isinstance(row, torch.Tensor) and not row.dtype.is_floating_point and not row.dtype.is_complex)
                or (isinstance(row, np.ndarray) and np.issubdtype(row.dtype, np.integer))):
            raise TypeError(f"{name} must be a 1-D integer tensor or a list of ints, got {row.dtype} "
                            f"of shape {tuple(row.shape)}")
        row = row.tolist()
    elif isinstance(row, (str, bytes, dict)) or not hasattr(row, "__iter__"):
        raise TypeError(f"{name} must be a list of ints, got {type(row).__name__}")
    row = list(row)
    if len(row) != width:
        raise ValueError(f"{name} must hold 2 * max_batch + 1 = {width} ints, got {len(row)}")
    for i, v in enumerate(row):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"{name}[{i}] must be an int, got {type(v).__name__} ({v!r})"[:200])
    return [int(v) for v in row]

def safe_indptr(row: torch.Tensor, total_pages: int, positions: torch.Tensor) -> torch.Tensor:
    """Turn a (possibly wrong) device copy of indptr into a well-formed one, on the device.

    ``row`` is the received indptr (B+1 int32), ``positions`` is ``arange(B+1)`` on the same
    device (int64). The result starts at 0, never decreases, ends at ``total_pages`` and stays
    in [0, total_pages]; a correct indptr comes back unchanged. Why: PyTorch's
    ``repeat_interleave(..., output_size=...)`` and advanced indexing check their bounds *on the
    device*, and a failed device-side assert kills the CUDA context; vLLM's Triton kernel has no
    such assert. A wrong indptr still gives wrong pages (the race stays visible), never an
    out-of-bounds read. Only kernels with scalar arguments: no host sync.
    """
    total_pages = positive_int("total_pages", total_pages, allow_zero=True)
    for name, t in (("row", row), ("positions", positions)):
        if not isinstance(t, torch.Tensor) or t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer torch.Tensor, got "
                            f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
    if row.numel() == 0:
        raise ValueError("row must not be empty: an indptr has batch + 1 >= 1 entries")
    if row.dim() != 1 or positions.shape != row.shape:
        raise ValueError(f"row and positions must be 1-D and of the same length, got {tuple(row.shape)} "
                         f"and {tuple(positions.shape)}")
    last = row.numel() - 1
    ip = row.to(torch.int64).clamp(0, total_pages)
    ip = torch.cummax(ip, dim=0).values
    ip = ip * (positions > 0)
    ip = torch.maximum(ip, (positions == last).to(torch.int64) * total_pages)
    return ip.to(torch.int32)


def torch_paged_decode(q, k_cache, v_cache, indptr, indices, last_page_len, *, max_pages: int,
                       sm_scale: float | None = None) -> torch.Tensor:
    """Batched paged decode attention in plain torch, with all metadata on q's device, no host sync.

    The lesson's stand-in for FlashInfer when FlashInfer cannot run: fp32, every request padded
    to ``max_pages`` pages, masked. A request's page count is clamped to ``max_pages`` and every
    gather index is clamped into ``indices``, so wrong metadata gives a wrong answer, never an
    out-of-bounds read. An empty request gives zeros. Returns fp32 [B, num_qo_heads, head_dim].
    """
    max_pages = positive_int("max_pages", max_pages)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point torch.Tensor, got "
                            f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
    for name, t in (("indptr", indptr), ("indices", indices), ("last_page_len", last_page_len)):
        if not isinstance(t, torch.Tensor) or t.dtype.is_floating_point or t.dtype == torch.bool or t.dim() != 1:
            raise TypeError(f"{name} must be a 1-D integer torch.Tensor, got "
                            f"{(t.dtype, tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if q.dim() != 3:
        raise ValueError(f"q must be [batch, num_qo_heads, head_dim], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must be [num_pages, page_size, num_kv_heads, head_dim] (NHD), "
                         f"got shape {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must have k_cache's shape {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    batch, num_qo_heads, head_dim = q.shape
    total_pool, page_size, num_kv_heads, kv_head_dim = k_cache.shape
    if min(total_pool, page_size, num_kv_heads, head_dim) == 0 or kv_head_dim != head_dim:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and q {tuple(q.shape)} must have non-empty pages, "
                         f"heads and the same head_dim")
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if indptr.numel() != batch + 1 or last_page_len.numel() != batch:
        raise ValueError(f"indptr must have {batch + 1} and last_page_len {batch} entries, got "
                         f"{indptr.numel()} and {last_page_len.numel()}")
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else positive_number("sm_scale", sm_scale)
    dev = q.device
    out = torch.zeros(batch, num_qo_heads, head_dim, dtype=torch.float32, device=dev)
    if indices.numel() == 0 or batch == 0:
        return out
    group = num_qo_heads // num_kv_heads
    ip = indptr.to(device=dev, dtype=torch.int64)
    count = (ip[1:] - ip[:-1]).clamp(0, max_pages)
    slot = torch.arange(max_pages, device=dev)
    gather = (ip[:-1, None] + slot[None, :]).clamp(0, indices.numel() - 1)
    pages = indices.to(device=dev, dtype=torch.int64)[gather].clamp(0, total_pool - 1)  # [B, P], inside the cache
    span = max_pages * page_size
    k = k_cache[pages].reshape(batch, span, num_kv_heads, head_dim).float()
    v = v_cache[pages].reshape(batch, span, num_kv_heads, head_dim).float()
    lpl = last_page_len.to(device=dev, dtype=torch.int64).clamp(0, page_size)
    kv_len = ((count - 1).clamp(min=0) * page_size + lpl) * (count > 0)
    mask = torch.arange(span, device=dev)[None, :] < kv_len[:, None]  # [B, T]
    qf = q.float().reshape(batch, num_kv_heads, group, head_dim)
    logits = torch.einsum("bkgd,btkd->bkgt", qf, k) * scale
    logits = logits.masked_fill(~mask[:, None, None, :], float("-inf"))
    p = torch.nan_to_num(torch.softmax(logits, dim=-1), nan=0.0)
    return torch.einsum("bkgt,btkd->bkgd", p, v).reshape(batch, num_qo_heads, head_dim)


class DecodeSetup:
    """Everything a decode loop needs, built once before any loop runs (host and device).

    Build it inside ``with stream:``. The metadata of each step comes from
    :func:`pinlab.paged_kv.kv_indptr` and :func:`pinlab.paged_kv.last_page_len`.
    """

    def __init__(self, stream, *, steps, max_batch, page_size, max_seq_len, num_qo_heads, num_kv_heads,
                 head_dim, seed, dtype=torch.float16):
        self.stream = stream
        self.steps, self.max_batch, self.page_size = steps, max_batch, page_size
        sched = decode_schedule(steps, max_batch, max_seq_len, seed=seed)
        self.sched = sched["steps"]
        self.pages_per_req = -(-max_seq_len // page_size)
        n_req = sched["n_requests"]
        g = torch.Generator().manual_seed(seed)
        pool = n_req * self.pages_per_req + max_batch
        perm = torch.randperm(pool, generator=g).to(torch.int32)
        req_pages = perm[: n_req * self.pages_per_req].reshape(n_req, self.pages_per_req)
        spare = perm[n_req * self.pages_per_req:]
        self.indptrs, self.lpls = [], []
        for st in self.sched:
            self.indptrs.append(kv_indptr(st["seq_lens"], page_size).tolist())
            self.lpls.append(last_page_lens(st["seq_lens"], page_size).tolist())
        # wide enough that even a wrong (but well-formed) indptr indexes inside it
        self.width = max(self.pages_per_req, max(ip[-1] for ip in self.indptrs))
        bt = spare[torch.arange(steps * max_batch * self.width) % spare.numel()].reshape(
            steps, max_batch, self.width).clone()
        for n, st in enumerate(self.sched):
            for b, r in enumerate(st["req_ids"]):
                bt[n, b, : self.pages_per_req] = req_pages[r]
        self.block_table_cpu = bt
        self.indices_cpu = [
            page_indices(bt[n, : len(self.lpls[n])], torch.tensor(self.indptrs[n], dtype=torch.int32),
                         self.indptrs[n][-1])
            for n in range(steps)
        ]
        self.images = metadata_images(self.indptrs, self.lpls, max_batch)
        q = torch.randn((steps, max_batch, num_qo_heads, head_dim), generator=g).to(dtype)
        shape = (pool, page_size, num_kv_heads, head_dim)
        k = torch.randn(shape, generator=g).to(dtype)
        v = torch.randn(shape, generator=g).to(dtype)
        dev = stream.device
        self.q, self.k, self.v = q.to(dev), k.to(dev), v.to(dev)
        self.block_table = bt.to(dev)
        self.positions = torch.arange(max_batch + 1, dtype=torch.int64, device=dev)
        self.plan_inputs = [(torch.tensor(ip, dtype=torch.int32), torch.tensor(lpl, dtype=torch.int32))
                            for ip, lpl in zip(self.indptrs, self.lpls)]
        self.ip_np = [np.asarray(ip, dtype=np.int32) for ip in self.indptrs]
        self.lpl_np = [np.asarray(lpl, dtype=np.int32) for lpl in self.lpls]
        self.refs = None

    def batch(self, n: int) -> int:
        return len(self.lpls[n])

    def references(self) -> list[torch.Tensor]:
        """fp32 reference outputs per step (pinlab.paged_kv.reference_decode), on the host."""
        if self.refs is None:
            refs = []
            for n in range(self.steps):
                b = self.batch(n)
                ref = reference_decode(self.q[n, :b], self.k, self.v, torch.tensor(self.indptrs[n], dtype=torch.int32),
                                       self.indices_cpu[n], torch.tensor(self.lpls[n], dtype=torch.int32))
                refs.append(ref.cpu())
            self.refs = refs
        return self.refs


def _write_metadata(buf: torch.Tensor, arg) -> None:
    ip, lpl, mb = arg
    a = buf.numpy()
    a[: ip.size] = ip
    a[mb + 1: mb + 1 + lpl.size] = lpl


class _TorchAttention:
    name = "torch"

    def __init__(self, setup: DecodeSetup):
        self.s = setup

    def __call__(self, n, row, ip_dev, idx):
        s, b = self.s, self.s.batch(n)
        lpl_dev = row[s.max_batch + 1: s.max_batch + 1 + b]
        return torch_paged_decode(s.q[n, :b], s.k, s.v, ip_dev, idx, lpl_dev, max_pages=s.pages_per_req)


class _FlashInferAttention:
    name = "flashinfer"

    def __init__(self, setup: DecodeSetup, wrappers):
        self.s, self.wrappers = setup, wrappers

    def __call__(self, n, row, ip_dev, idx):
        s = self.s
        w = self.wrappers[n % len(self.wrappers)]
        ip_cpu, lpl_cpu = s.plan_inputs[n]  # plan() gets its own host copy, never the raced buffer
        w.plan(ip_cpu, idx, lpl_cpu)
        return w.run(s.q[n, : s.batch(n)], s.k, s.v)


def _decode_gpu_side(setup, attention, dst, n, outs, used):
    b = setup.batch(n)
    row = dst[n]
    total = setup.indptrs[n][-1]
    ip_dev = safe_indptr(row[: b + 1], total, setup.positions[: b + 1])
    idx = page_indices(setup.block_table[n, :b], ip_dev, total)
    used[n] = idx
    outs[n] = attention(n, row, ip_dev, idx)


def decode_loop(stream, setup: DecodeSetup, attention, strategy: str, *, steps: int, busy_ms: float,
                run_ahead: int | None, ring_depth: int = 3) -> dict:
    """One strategy through the decode loop on ``stream``: the device rows each copy delivered,
    the page indices each step used, the outputs, host ns per step and the pinned bytes held."""
    stream.release()
    base = stream.pinned_bytes()
    mb = setup.max_batch
    n_ints = 2 * mb + 1
    outs: list = [None] * steps
    used: list = [None] * steps
    host_ns = [0] * steps
    with stream:
        dst = torch.zeros(steps, n_ints, dtype=torch.int32, device=stream.device)
        staging = Staging(stream, strategy, n_ints, ring_depth)
        gate = RunAheadGate(stream, run_ahead)
        for n in range(steps):
            gate.wait(n)
            t0 = time.perf_counter_ns()
            src = staging.stage(_write_metadata, (setup.ip_np[n], setup.lpl_np[n], mb))
            dst[n].copy_(src, non_blocking=True)
            staging.after_copy()
            del src
            host_ns[n] = time.perf_counter_ns() - t0
            stream.launch(_decode_gpu_side, setup, attention, dst, n, outs, used)
            gate.record(n)
            stream.busy(busy_ms)
        held = stream.pinned_bytes() - base
        stream.synchronize()
        rows = dst.cpu().tolist()
        used_cpu = [u.cpu() for u in used]
        outs_cpu = [o.float().cpu() for o in outs]
        del staging, dst, gate, outs, used
    stream.release()
    return {"rows": rows, "used": used_cpu, "outs": outs_cpu, "host_ns": host_ns, "pinned_bytes_held": int(held)}


def decode_accounting(setup_like, raw: dict, refs, *, tol: float, gpu_last_page_len: bool) -> dict:
    """Per step and request: did the copy deliver the right metadata, did the attention read the
    right inputs, how far is its output from the reference. Pure (host tensors and lists).

    ``setup_like`` needs ``steps``, ``max_batch``, ``indptrs``, ``lpls``, ``images``,
    ``indices_cpu`` and ``batch(n)``; ``raw`` is a :func:`decode_loop` result; ``refs`` the fp32
    reference outputs per step. A request's inputs are wrong when its page ids differ from the
    correct ones, or (``gpu_last_page_len``: the torch backend reads the GPU copy of
    last_page_len; FlashInfer gets it from ``plan()``'s host copy) when its last_page_len does.
    """
    tol = positive_number("tol", tol)
    steps, mb = setup_like.steps, setup_like.max_batch
    received, wrong_pages, wrong_inputs, errs = [], [], [], []
    for n in range(steps):
        b = setup_like.batch(n)
        row = raw["rows"][n]
        received.append(match_received(row, setup_like.images, n, b, mb))
        ip, lpl = setup_like.indptrs[n], setup_like.lpls[n]
        got, want = raw["used"][n], setup_like.indices_cpu[n]
        wp, wi = [], []
        for r in range(b):
            a, z = ip[r], ip[r + 1]
            pages_bad = not torch.equal(got[a:z], want[a:z])
            lpl_bad = int(row[mb + 1 + r]) != lpl[r]
            wp.append(int(pages_bad))
            wi.append(int(pages_bad or (gpu_last_page_len and lpl_bad)))
        wrong_pages.append(wp)
        wrong_inputs.append(wi)
        diff = (raw["outs"][n] - refs[n]).abs().reshape(b, -1).amax(dim=1)
        errs.append([float(f"{float(e):.4g}") for e in diff])
    summary = corruption_summary(received)
    ok_errs = [e for es, wi in zip(errs, wrong_inputs) for e, w in zip(es, wi) if not w]
    bad_errs = [e for es, wi in zip(errs, wrong_inputs) for e, w in zip(es, wi) if w]
    return {
        "received": received,
        "copies_wrong": summary["corrupted"],
        "wrong_page_steps": sum(1 for wp in wrong_pages if any(wp)),
        "wrong_input_steps": sum(1 for wi in wrong_inputs if any(wi)),
        "wrong_input_requests": sum(sum(wi) for wi in wrong_inputs),
        "wrong_output_steps": sum(1 for e in errs if any(not x <= tol for x in e)),  # NaN counts as wrong
        "requests": sum(len(wi) for wi in wrong_inputs),
        "max_err_right_inputs": max(ok_errs) if ok_errs else 0.0,
        "max_err_wrong_inputs": max(bad_errs) if bad_errs else None,
        "median_err_wrong_inputs": statistics.median(bad_errs) if bad_errs else None,
        "wrong_inputs": wrong_inputs,
        "err": errs,
    }


def check_args(*, strategies, steps, max_batch, page_size, max_seq_len, num_qo_heads, num_kv_heads, head_dim,
               busy_ms, ring, run_ahead, seed, backend, tol) -> dict:
    """The decode experiment's arguments, checked (before any stream is made)."""
    strategies = strategies_arg(strategies, allow_no_copy=False)
    steps = positive_int("steps", steps)
    max_batch = positive_int("max_batch", max_batch)
    page_size = positive_int("page_size", page_size)
    max_seq_len = positive_int("max_seq_len", max_seq_len)
    busy_ms = positive_number("busy_ms", busy_ms)
    ring = positive_int("ring", ring)
    run_ahead = positive_int("run_ahead", run_ahead, allow_zero=True)
    if run_ahead >= ring:
        raise ValueError(
            f"run_ahead ({run_ahead}) must be less than ring ({ring}): a wrapper is re-planned every `ring` steps, "
            "and re-planning one whose previous plan has not run yet overwrites FlashInfer's own pinned "
            "plan buffer (an illegal memory access on the H200)")
    tol = positive_number("tol", tol)
    num_qo_heads = positive_int("num_qo_heads", num_qo_heads)
    num_kv_heads = positive_int("num_kv_heads", num_kv_heads)
    head_dim = positive_int("head_dim", head_dim)
    seed = positive_int("seed", seed, allow_zero=True)
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if max_seq_len < 2:
        raise ValueError(f"max_seq_len must be at least 2, got {max_seq_len}")
    one_of("backend", backend, {"auto", "flashinfer", "torch"})
    return dict(strategies=strategies, steps=steps, max_batch=max_batch, page_size=page_size,
                max_seq_len=max_seq_len, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                busy_ms=busy_ms, ring=ring, run_ahead=run_ahead, seed=seed, backend=backend, tol=tol)


def every_strategy(stream, *, strategies, steps, max_batch, page_size, max_seq_len, num_qo_heads, num_kv_heads,
                   head_dim, busy_ms, ring, run_ahead, seed, backend, tol) -> dict:
    """This decode loop, for every strategy (arguments as :func:`pinlab.lessons.l03_the_race.decode_race`,
    checked by :func:`check_args`; ``stream`` already a stream). On the emulated stream the attention
    is :func:`torch_paged_decode`: FlashInfer needs CUDA."""
    with stream:  # set-up, references and FlashInfer's first plan+run on the stream the loops use
        setup = DecodeSetup(stream, steps=steps, max_batch=max_batch, page_size=page_size, max_seq_len=max_seq_len,
                            num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, seed=seed)
        refs = setup.references()
        attention, reason, jit_s = None, None, None
        wrappers = []
        if backend in ("auto", "flashinfer") and stream.emulated:
            reason = "the emulated stream runs on the CPU; FlashInfer needs CUDA"
            if backend == "flashinfer":
                raise FlashInferUnavailableError(reason)
        elif backend in ("auto", "flashinfer"):
            try:
                wrappers = [FlashInferDecode(num_qo_heads, num_kv_heads, head_dim, page_size) for _ in range(ring)]
                print("building FlashInfer's decode kernel (JIT: slow the first time, then loaded from its cache)...", file=sys.stderr,
                      flush=True)
                t0 = time.perf_counter()
                for w in wrappers:  # first plan+run of each wrapper: compiles once, then loads
                    ip_cpu, lpl_cpu = setup.plan_inputs[0]
                    w.plan(ip_cpu, setup.indices_cpu[0].to(stream.device), lpl_cpu)
                    w.run(setup.q[0, : setup.batch(0)], setup.k, setup.v)
                stream.synchronize()
                jit_s = round(time.perf_counter() - t0, 2)
                attention = _FlashInferAttention(setup, wrappers)
            except FlashInferUnavailableError as exc:
                if backend == "flashinfer":
                    raise
                reason = str(exc)
                wrappers = []
        if attention is None:
            attention = _TorchAttention(setup)
            if reason is None:
                reason = "the torch backend was asked for"
    warm = min(steps, 2 * ring + 2)
    decode_loop(stream, setup, attention, "pageable", steps=warm, busy_ms=min(busy_ms, 0.05), run_ahead=run_ahead,
                 ring_depth=ring)
    runs = {}
    for s in strategies:
        raw = decode_loop(stream, setup, attention, s, steps=steps, busy_ms=busy_ms, run_ahead=run_ahead,
                          ring_depth=ring)
        acc = decode_accounting(setup, raw, refs, tol=tol, gpu_last_page_len=attention.name == "torch")
        acc["host"] = time_summary_us(raw["host_ns"])
        acc["pinned_bytes_held"] = raw["pinned_bytes_held"]
        runs[s] = acc
    sched = setup.sched
    out = {
        "backend": "flashinfer" if reason is None else "torch",
        "fallback_reason": reason,
        "jit_s": jit_s,
        "steps": steps,
        "max_batch": max_batch,
        "batch_sizes": [len(st["req_ids"]) for st in sched],
        "joins": sum(1 for n in range(1, steps) for r in sched[n]["req_ids"] if r not in sched[n - 1]["req_ids"]),
        "leaves": sum(1 for n in range(1, steps) for r in sched[n - 1]["req_ids"] if r not in sched[n]["req_ids"]),
        "tol": tol,
        "ring": ring,
        "run_ahead": run_ahead,
        "busy_ms": busy_ms,
        "runs": runs,
    }
    del wrappers, attention, setup
    gc.collect()  # FlashInfer's pinned plan buffers go back to the allocator now, not at some later GC
    stream.synchronize()
    return out


def error_matrix(run: dict, max_batch: int) -> np.ndarray:
    """A decode run's ragged ``err`` rows as a [steps, max_batch] float array, NaN where no request."""
    max_batch = positive_int("max_batch", max_batch)
    if not isinstance(run, dict) or not isinstance(run.get("err"), (list, tuple)):
        raise TypeError(f"run must be one decode run (a dict with an 'err' list of per-step error lists), "
                        f"got {type(run).__name__}{' without err' if isinstance(run, dict) else ''}")
    err = run["err"]
    m = np.full((len(err), max_batch), np.nan)
    for n, row in enumerate(err):
        if not isinstance(row, (list, tuple)) or not all(
                isinstance(e, (int, float, np.number)) and not isinstance(e, bool) for e in row):
            raise TypeError(f"run['err'][{n}] must be a list of numbers (one error per request), got {row!r}"[:200])
        if len(row) > max_batch:
            raise ValueError(f"step {n} has {len(row)} requests, more than max_batch={max_batch}")
        m[n, : len(row)] = row
    return m

