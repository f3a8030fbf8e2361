"""The lessons' streams: the emulated lagging stream on the CPU (and the CUDA stream where there is one)."""
import pytest
import torch

import pinlab
from pinlab import CudaUnavailableError, LaggingStream
from pinlab.streams import STAGING_LIMIT


def _loop(s, host_buf, steps=8):
    """The lesson-03 loop: write step n, copy it non_blocking, let the GPU work; which step did each copy get?"""
    dst = torch.zeros(steps, host_buf.numel(), dtype=host_buf.dtype, device=s.device)
    for n in range(steps):
        host_buf.fill_(n)
        dst[n].copy_(host_buf, non_blocking=True)
        s.busy(0.5)
    s.synchronize()
    return dst[:, 0].tolist()


def test_reused_pinned_buffer_races_and_pageable_does_not():
    with LaggingStream() as s:
        assert _loop(s, torch.zeros(16, dtype=torch.int32, pin_memory=True)) == [7] * 8
        assert _loop(s, torch.zeros(16, dtype=torch.int32)) == list(range(8))


def test_snapshot_of_pageable_is_safe_and_snapshot_of_pinned_is_the_trap():
    with LaggingStream() as s:
        pageable = torch.zeros(4, dtype=torch.int32)
        pinned = torch.zeros(4, dtype=torch.int32, pin_memory=True)
        assert not pageable.is_pinned() and pinned.is_pinned()
        assert pinned.pin_memory() is pinned                      # torch returns the same tensor
        snap = pageable.pin_memory()
        assert snap.is_pinned() and snap.data_ptr() != pageable.data_ptr()
        dst = torch.zeros(6, 4, dtype=torch.int32, device=s.device)
        dst2 = torch.zeros(6, 4, dtype=torch.int32, device=s.device)
        for n in range(6):
            pageable.fill_(n)
            dst[n].copy_(pageable.pin_memory(), non_blocking=True)
            pinned.fill_(n)
            dst2[n].copy_(pinned.pin_memory(), non_blocking=True)
        assert dst[:, 0].tolist() == list(range(6))
        assert dst2[:, 0].tolist() == [5] * 6


def test_event_guarded_ring_is_correct_and_event_order():
    with LaggingStream() as s:
        depth, steps = 3, 9
        ring = [torch.zeros(4, dtype=torch.int32, pin_memory=True) for _ in range(depth)]
        events = [None] * depth
        dst = torch.zeros(steps, 4, dtype=torch.int32, device=s.device)
        for n in range(steps):
            k = n % depth
            if events[k] is not None:
                events[k].synchronize()          # the copy that last read this buffer has run
            ring[k].fill_(n)
            dst[n].copy_(ring[k], non_blocking=True)
            events[k] = s.Event()
            events[k].record()
        assert dst[:, 0].tolist() == list(range(steps))
        ev = s.Event()
        ev.record()
        assert not ev.query() or s.pending() == 0
        ev.synchronize()
        assert ev.query()


def test_queue_runs_only_when_the_host_waits():
    with LaggingStream() as s:
        src = torch.ones(4, pin_memory=True)
        dst = torch.zeros(4, device=s.device)
        dst.copy_(src, non_blocking=True)
        dst.mul_(3)
        assert s.pending() == 2
        assert dst.tolist() == [3.0] * 4          # reading device memory waits for the queue
        assert s.pending() == 0


def test_d2h_into_pinned_is_valid_only_after_an_event():
    with LaggingStream() as s:
        dev = torch.full((4,), 7.0, device=s.device)
        out = torch.full((4,), -1.0, pin_memory=True)
        out.copy_(dev, non_blocking=True)
        assert out.tolist() == [-1.0] * 4         # read too early: the old contents
        done = s.Event()
        done.record()
        done.synchronize()
        assert out.tolist() == [7.0] * 4
        pageable = torch.full((4,), -1.0)
        dev.add_(1)
        pageable.copy_(dev, non_blocking=True)    # into pageable memory the host waits
        assert pageable.tolist() == [8.0] * 4


def test_large_pageable_copy_waits_small_one_is_staged():
    with LaggingStream() as s:
        big = torch.zeros(STAGING_LIMIT + 4, dtype=torch.uint8)
        small = torch.zeros(16, dtype=torch.uint8)
        dev = torch.zeros(STAGING_LIMIT + 4, dtype=torch.uint8, device=s.device)
        dev.add_(1)
        dev[:16].copy_(small, non_blocking=True)
        assert s.pending() == 2
        dev.copy_(big, non_blocking=True)           # too large to stage: waits for everything queued
        assert s.pending() == 0


def test_to_device_and_back_and_launch():
    with LaggingStream() as s:
        host = torch.arange(6, dtype=torch.int64)
        dev = host.to(s.device, non_blocking=True)
        assert s.is_device(dev) and not s.is_device(host)
        got = []
        s.launch(lambda: got.append(1))
        assert got == []
        back = dev.to("cpu", non_blocking=True)      # torch gives a pinned result
        assert back.is_pinned()
        s.synchronize()
        assert got == [1] and back.tolist() == list(range(6))
        assert (dev * 2).tolist() == [0, 2, 4, 6, 8, 10]


def test_leaving_the_block_runs_the_queue_and_restores_torch():
    s = LaggingStream()
    with s:
        src = torch.ones(4, pin_memory=True)
        dst = torch.zeros(4, device=s.device)
        dst.copy_(src, non_blocking=True)
    assert s.pending() == 0 and dst.tolist() == [1.0] * 4
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError):
            torch.zeros(4, pin_memory=True)      # outside the block torch is itself again
    with pytest.raises(RuntimeError, match="already active"):
        with s:
            with s:
                pass


def test_pinned_bytes_counts_live_emulated_pinned_memory():
    with LaggingStream() as s:
        assert s.pinned_bytes() == 0
        a = torch.zeros(256, dtype=torch.uint8, pin_memory=True)
        assert s.pinned_bytes() == 256
        del a
        s.release()
        assert s.pinned_bytes() == 0


def test_busy_checks_its_argument():
    with LaggingStream() as s:
        with pytest.raises(ValueError, match="ms"):
            s.busy(-1)
        with pytest.raises(TypeError, match="fn"):
            s.launch(3)


def test_stream_picks_the_emulation_without_cuda(monkeypatch):
    monkeypatch.setenv("PINLAB_FORCE_CPU", "1")
    s = pinlab.stream()
    assert isinstance(s, LaggingStream) and s.emulated and "emulated" in s.label
    with pytest.raises(CudaUnavailableError):
        pinlab.CudaStream()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_stream_runs_the_same_loop():
    with pinlab.stream() as s:
        assert not s.emulated and s.device.type == "cuda"
        got = _loop(s, torch.zeros(16, dtype=torch.int32), steps=8)
        assert got == list(range(8))
        pinned = _loop(s, torch.zeros(16, dtype=torch.int32, pin_memory=True), steps=8)
        assert pinned[-1] == 7 and len(pinned) == 8


def test_gather_with_a_device_index_waits_for_the_queue():
    with LaggingStream() as s:
        table = torch.zeros(8, device=s.device)
        idx = torch.zeros(3, dtype=torch.int64, device=s.device)
        table.copy_(torch.arange(8.0), non_blocking=True)           # staged, queued
        idx.copy_(torch.tensor([7, 0, 3]), non_blocking=True)
        got = table[idx]                                              # reads device memory
        assert s.is_device(got) and s.pending() == 0
        assert got.tolist() == [7.0, 0.0, 3.0]


def test_reshape_that_copies_reads_after_the_queue_and_stays_on_the_device():
    with LaggingStream() as s:
        x = torch.zeros(4, 6, device=s.device)
        x.copy_(torch.ones(4, 6), non_blocking=True)
        y = x.t().reshape(-1)                                         # not a view: a copy
        assert s.is_device(y)
        assert y.tolist() == [1.0] * 24
        v = x.reshape(2, 12)                                           # a view: no wait needed
        assert s.is_device(v)


def test_torch_cuda_event_is_restored_when_the_block_raises():
    before = torch.cuda.Event
    with pytest.raises(ZeroDivisionError):
        with LaggingStream() as s:
            assert torch.cuda.Event is not before
            ev = torch.cuda.Event()
            ev.record()
            1 / 0
    assert torch.cuda.Event is before                # restored although the block raised
    with LaggingStream() as s:                       # and a new block patches it again
        assert torch.cuda.Event().query() and s.pending() == 0
    assert torch.cuda.Event is before


@pytest.mark.skipif(torch.cuda.is_available(), reason="torch.cuda.Event works on a CUDA machine")
def test_torch_cuda_event_outside_the_block_points_to_s_event():
    """Issue "self-paced path" 3: outside an active emulated stream, torch says only "Tried to instantiate
    dummy base class Event"; a learner's call in a checker is told what to use instead."""
    from pinlab.checks import learner_call
    from pinlab.streams import explain_dummy_event

    with pytest.raises(RuntimeError, match="dummy base class Event"):
        torch.cuda.Event()                           # torch's own words, outside any block
    with pytest.raises(RuntimeError) as info:
        with learner_call("start_d2h(s, out)"):
            torch.cuda.Event()
    text = str(info.value)
    assert "on this machine the stream is emulated: use s.Event() (works on a GPU too)" in text, text
    assert "dummy base class Event" in text and isinstance(info.value.__cause__, RuntimeError)
    assert explain_dummy_event(RuntimeError("another error")) is None
    assert explain_dummy_event(ValueError("dummy base class Event")) is None
    with pytest.raises(RuntimeError, match="another error"):  # any other error passes through unchanged
        with learner_call("f()"):
            raise RuntimeError("another error")
