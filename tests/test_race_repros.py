"""Real races, reproduced small: break -> detect -> fix -> prove, on the emulated stream (CPU) and on CUDA (the
tests marked gpu). Each names the public report it follows; the code is the pattern the report describes,
written small, not the project's code.

* vLLM #48085 / #48399 ("Fix race condition in KVBlockZeroer"; 1Cat-vLLM #406 describes it: "zero_block_ids()
  wrote every scheduler batch into the same _ids_pinned allocation and launched idx.copy_(...,
  non_blocking=True) ... A subsequent scheduler call could therefore mutate the pinned source before the
  previous transfer consumed it"): H2D, a reused pinned id buffer;
* sglang #1712 ("fix the race condition in overlap mode: make a copy of seq_len"): H2D, a host tensor updated
  in place for the next batch while the previous batch's copy of it is still queued;
* vLLM #51571 / #51599 (a D2H copy into a pinned buffer that condense() rewrites while the copy is in flight):
  D2H, the destination written early;
* the seed's reused pinned indptr (vLLM #23737 -> #32799 -> 0.29): H2D, one pinned indptr buffer per step.
"""
import pytest
import torch

import pinlab
from pinlab.races import D2H_WRITE, H2D_REWRITE, detect_races
from pinlab.streams import LaggingStream

STREAMS = ["emulated", pytest.param("cuda", marks=pytest.mark.gpu)]


def _stream(kind):
    if kind == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("needs CUDA")
        s = pinlab.CudaStream()
        pinlab.warmup(lambda: pinlab.gpu_busy(0.1))
        return s
    return LaggingStream()


# ---- vLLM KVBlockZeroer ---------------------------------------------------------------------------------

class BlockZeroer:
    """Zero the KV blocks of each scheduler batch on the GPU (the pattern of vLLM's KVBlockZeroer)."""

    def __init__(self, s, kv, fixed: bool):
        self.s, self.kv, self.fixed = s, kv, fixed
        self.ids_pinned = torch.zeros(4, dtype=torch.int64, pin_memory=True)   # reused: the bug
        self.ids_gpu = torch.zeros(4, dtype=torch.int64, device=s.device)

    def zero_block_ids(self, ids):
        if self.fixed:   # the fix: a pinned snapshot owned by this submission (what vLLM's async_tensor_h2d does)
            src = torch.tensor(ids, dtype=torch.int64).pin_memory().to(self.s.device, non_blocking=True)
            self.s.launch(self.kv.index_fill_, 0, src, 0.0)
            return
        self.ids_pinned.copy_(torch.tensor(ids, dtype=torch.int64))
        self.ids_gpu.copy_(self.ids_pinned, non_blocking=True)
        self.s.launch(self.kv.index_fill_, 0, self.ids_gpu, 0.0)


@pytest.mark.parametrize("kind", STREAMS)
@pytest.mark.parametrize("fixed", [False, True])
def test_vllm_kv_block_zeroer(kind, fixed):
    s = _stream(kind)
    with s, detect_races() as races:
        kv = torch.ones(16, 8, device=s.device)
        z = BlockZeroer(s, kv, fixed)
        kv.index_fill_(0, torch.tensor([15], device=s.device), 1.0)  # a first launch waits behind a busy GPU
        s.synchronize()
        s.busy(20.0)                       # the GPU is behind the scheduler
        z.zero_block_ids([0, 1, 2, 3])
        z.zero_block_ids([8, 9, 10, 11])   # the next batch, before the first copy ran
        s.synchronize()
        cleared = [int(i) for i in (kv.sum(dim=1) == 0).nonzero().flatten().tolist()]
    if fixed:
        assert cleared == [0, 1, 2, 3, 8, 9, 10, 11] and races.total == 0, races.summary()
    else:
        assert cleared == [8, 9, 10, 11], "the first batch's blocks were never cleared: the race"
        assert races.counts == {H2D_REWRITE: 1}, races.summary()


# ---- sglang overlap mode: seq_lens updated in place -----------------------------------------------------

@pytest.mark.parametrize("kind", STREAMS)
@pytest.mark.parametrize("fixed", [False, True])
def test_sglang_seq_lens_in_overlap_mode(kind, fixed):
    s = _stream(kind)
    with s, detect_races() as races:
        seq_lens = torch.tensor([5, 7, 9], dtype=torch.int32).pin_memory()
        seen = torch.zeros(3, 3, dtype=torch.int32, device=s.device)
        for step in range(3):
            s.busy(10.0)
            src = seq_lens.clone().pin_memory() if fixed else seq_lens   # the fix: "make a copy of seq_len"
            seen[step].copy_(src, non_blocking=True)
            seq_lens.add_(1)                                            # the next batch, prepared at once
        s.synchronize()
        got = seen.tolist()
    want = [[5 + k, 7 + k, 9 + k] for k in range(3)]
    if fixed:
        assert got == want and races.total == 0, races.summary()
    else:
        assert got != want and races.counts[H2D_REWRITE] == 3, races.summary()


# ---- vLLM #51571: condense() rewrites a pinned buffer a D2H copy is still filling ------------------------

@pytest.mark.parametrize("kind", STREAMS)
@pytest.mark.parametrize("fixed", [False, True])
def test_vllm_condense_during_a_d2h_copy(kind, fixed):
    s = _stream(kind)
    with s, detect_races() as races:
        sampled = torch.arange(10, 18, device=s.device)
        host = torch.zeros(8, dtype=torch.int64, pin_memory=True)
        done = s.Event()
        s.busy(20.0)
        host.copy_(sampled, non_blocking=True)     # the step's sampled tokens come back
        done.record()
        if fixed:
            done.synchronize()                     # the fix: wait for the copy before touching the buffer
        host[2:6] = host[4:8].clone()              # condense(): move the kept requests down
        done.synchronize()
        got = host.tolist()
    if fixed:
        assert got == [10, 11, 14, 15, 16, 17, 16, 17] and races.total == 0, races.summary()
    else:
        assert got == list(range(10, 18)), "the copy landed after the condense and undid it"
        assert races.count() >= 1 and races.counts[D2H_WRITE] + races.counts["host read the destination of " 
                                                                              "a pending D2H copy"] >= 1


# ---- the seed: one reused pinned indptr ------------------------------------------------------------------

@pytest.mark.parametrize("kind", STREAMS)
@pytest.mark.parametrize("fix", ["none", "snapshot"])
def test_seed_reused_pinned_indptr(kind, fix):
    s = _stream(kind)
    steps = 20
    with s, detect_races() as races:
        indptr_pinned = torch.zeros(9, dtype=torch.int32, pin_memory=True)     # #23737's persistent buffer
        indptr_cpu = torch.zeros(9, dtype=torch.int32)                          # 0.29: pageable + snapshot
        got = torch.zeros(steps, 9, dtype=torch.int32, device=s.device)
        for n in range(steps):
            s.busy(5.0)
            step = torch.arange(9, dtype=torch.int32) * (n + 1)
            if fix == "none":
                indptr_pinned.copy_(step)
                got[n].copy_(indptr_pinned, non_blocking=True)
            else:
                indptr_cpu.copy_(step)
                got[n].copy_(indptr_cpu.pin_memory(), non_blocking=True)
        s.synchronize()
        wrong = [n for n, row in enumerate(got.tolist()) if row != [k * (n + 1) for k in range(9)]]
    if fix == "none":
        assert wrong and set(wrong) <= set(races.raced), races.summary()
    else:
        assert wrong == [] and races.total == 0, races.summary()
