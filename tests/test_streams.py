"""The lessons' streams: the emulated lagging stream on the CPU (and the CUDA stream where there is one)."""
import pytest
import torch

import pinlab
from pinlab import CudaUnavailableError, LaggingStream
from pinlab.streams import PIN_DEVICE_ERROR, STAGING_LIMIT


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


# --------------------------------------------------------------------------- what CUDA refuses (issue 28)
# Each planted call below is plain torch code that CUDA refuses; the emulation must refuse it too, with torch's
# exception type and message, or a checker's ✅ on a laptop would not hold on a GPU. tests/test_streams_cuda.py
# runs every one of them on a GPU as well (the `gpu` twin) and asserts the same exception.

def _captured(s, body):
    """Capture ``body(static)`` into a fresh graph, ``static`` a device tensor made before the capture."""
    static = torch.zeros(4, device=s.device)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body(static)


def _event_waited_in_a_capture(s, wait):
    ev = s.Event()
    ev.record()
    _captured(s, lambda static: wait(ev))


#: name (what it plants) -> (the call, given the stream; the exception type torch raises; text that its message,
#: or for a wait in a capture the message of its context, contains)
PLANTED = {
    # every host-to-device transfer inside a capture (torch's copy check: Copy.cu, copy_kernel_cuda)
    "tensor_from_a_list_with_device_in_a_capture":
        (lambda s: _captured(s, lambda st: torch.tensor([1.0, 2.0], device=st.device)), RuntimeError,
         "unless the CPU tensor is pinned"),
    "as_tensor_from_a_list_with_device_in_a_capture":
        (lambda s: _captured(s, lambda st: torch.as_tensor([1.0, 2.0], device=s.device)), RuntimeError,
         "unless the CPU tensor is pinned"),
    "as_tensor_of_a_host_tensor_with_device_in_a_capture":
        (lambda s: _captured(s, lambda st: torch.as_tensor(torch.ones(4), device=s.device)), RuntimeError,
         "unless the CPU tensor is pinned"),
    "new_tensor_of_a_device_tensor_in_a_capture":
        (lambda s: _captured(s, lambda st: st.new_tensor([1.0, 2.0])), RuntimeError,
         "unless the CPU tensor is pinned"),
    "to_device_of_a_pageable_tensor_in_a_capture":
        (lambda s: _captured(s, lambda st: torch.ones(4).to(s.device, non_blocking=True)), RuntimeError,
         "unless the CPU tensor is pinned"),
    "host_arange_moved_to_the_device_in_a_capture":
        (lambda s: _captured(s, lambda st: st.add_(torch.arange(4).to(st.device))), RuntimeError,
         "unless the CPU tensor is pinned"),
    "tolist_of_a_device_tensor_in_a_capture":
        (lambda s: _captured(s, lambda st: st.tolist()), RuntimeError, "unless the CPU tensor is pinned"),
    "device_tensor_indexed_with_a_host_index_in_a_capture":
        (lambda s: _captured(s, lambda st: st[torch.tensor([0, 2])]), RuntimeError,
         "unless the CPU tensor is pinned"),
    # a host arange left on the host inside a capture (08 part 1 with `.to(ids.device)` deleted)
    "host_arange_added_to_a_device_tensor_in_a_capture":
        (lambda s: _captured(s, lambda st: st.mul(2) + torch.arange(4)), RuntimeError,
         "Expected all tensors to be on the same device"),
    # pin_memory=True for device memory (EmptyTensor.cpp, empty_cuda)
    "empty_like_of_a_device_tensor_pinned":
        (lambda s: torch.empty_like(torch.zeros(4, device=s.device), pin_memory=True), RuntimeError,
         "Only dense CPU tensors can be pinned"),
    "zeros_like_of_a_device_tensor_pinned":
        (lambda s: torch.zeros_like(torch.zeros(4, device=s.device), pin_memory=True), RuntimeError,
         "Only dense CPU tensors can be pinned"),
    "ones_like_of_a_device_tensor_pinned":
        (lambda s: torch.ones_like(torch.zeros(4, device=s.device), pin_memory=True), RuntimeError,
         "Only dense CPU tensors can be pinned"),
    "full_like_of_a_device_tensor_pinned":
        (lambda s: torch.full_like(torch.zeros(4, device=s.device), 7, pin_memory=True), RuntimeError,
         "Only dense CPU tensors can be pinned"),
    "zeros_with_device_and_pin_memory":
        (lambda s: torch.zeros(4, device=s.device, pin_memory=True), RuntimeError,
         "Only dense CPU tensors can be pinned"),
    "new_zeros_of_a_device_tensor_pinned":
        (lambda s: torch.zeros(4, device=s.device).new_zeros(4, pin_memory=True), RuntimeError,
         "Only dense CPU tensors can be pinned"),
    "pin_memory_of_a_device_tensor":
        (lambda s: torch.zeros(4, device=s.device).pin_memory(), RuntimeError,
         "only dense CPU tensors can be pinned"),
    # device memory used as host memory
    "numpy_of_a_device_tensor":
        (lambda s: torch.zeros(4, device=s.device).numpy(), TypeError, "can't convert cuda:0 device type tensor"),
    "np_asarray_of_a_device_tensor":
        (lambda s: __import__("numpy").asarray(torch.zeros(4, device=s.device)), TypeError,
         "can't convert cuda:0 device type tensor"),
    "device_tensor_plus_a_host_tensor":
        (lambda s: torch.zeros(4, device=s.device) + torch.ones(4), RuntimeError,
         "Expected all tensors to be on the same device"),
    "device_tensor_in_place_plus_a_host_tensor":
        (lambda s: torch.zeros(4, device=s.device).add_(torch.ones(4)), RuntimeError,
         "Expected all tensors to be on the same device"),
    "cat_of_a_device_and_a_host_tensor":
        (lambda s: torch.cat([torch.zeros(4, device=s.device), torch.ones(4)]), RuntimeError,
         "Expected all tensors to be on the same device"),
    "index_select_of_a_device_tensor_with_a_host_index":
        (lambda s: torch.zeros(4, device=s.device).index_select(0, torch.tensor([0, 1])), RuntimeError,
         "Expected all tensors to be on the same device"),
    "host_tensor_indexed_with_a_device_index":
        (lambda s: torch.ones(4)[torch.tensor([0, 1], device=s.device)], RuntimeError,
         "indices should be either on cpu or on the same device as the indexed tensor"),
    # host waits inside a capture (cudaErrorStreamCaptureUnsupported; the invalidated capture's end lets it out)
    "item_in_a_capture":
        (lambda s: _captured(s, lambda st: st.sum().item()), torch.AcceleratorError,
         "operation not permitted when stream is capturing"),
    "synchronize_in_a_capture":
        (lambda s: _captured(s, lambda st: s.synchronize()), torch.AcceleratorError,
         "operation not permitted when stream is capturing"),
    "event_synchronize_in_a_capture":
        (lambda s: _event_waited_in_a_capture(s, lambda ev: ev.synchronize()), torch.AcceleratorError,
         "operation not permitted when stream is capturing"),
    "event_query_in_a_capture":
        (lambda s: _event_waited_in_a_capture(s, lambda ev: ev.query()), torch.AcceleratorError,
         "operation not permitted when stream is capturing"),
    "bool_of_a_device_tensor_in_a_capture":
        (lambda s: _captured(s, lambda st: bool(st.sum() > 0)), torch.AcceleratorError,
         "operation not permitted when stream is capturing"),
}


def refused_as_cuda_refuses(exc: BaseException, expected: type, text: str) -> bool:
    """``exc`` is of torch's type and says ``text`` (or its context does: a wait refused inside a capture
    invalidates it, and ending the capture raises "operation failed due to a previous error during capture")."""
    return isinstance(exc, expected) and any(text in str(e) for e in (exc, exc.__context__) if e is not None)


@pytest.mark.parametrize("planted", list(PLANTED))
def test_the_emulation_refuses_what_cuda_refuses(planted):
    fn, expected, text = PLANTED[planted]
    with LaggingStream() as s:
        with pytest.raises(BaseException) as info:
            fn(s)
        assert not torch.cuda.is_current_stream_capturing()
    assert refused_as_cuda_refuses(info.value, expected, text), (planted, repr(info.value),
                                                                   repr(info.value.__context__))


def _pinned_copy_in_a_capture(s):
    pinned = torch.ones(4, pin_memory=True)
    _captured(s, lambda st: st.copy_(pinned, non_blocking=True))


#: name -> the call: what CUDA accepts near those refusals, and the emulation must accept too
ACCEPTED = {
    "pinned_non_blocking_copy_in_a_capture": _pinned_copy_in_a_capture,
    "device_factories_in_a_capture":
        lambda s: _captured(s, lambda st: st.add_(torch.arange(4, device=st.device) + torch.ones_like(st))),
    "device_tensor_plus_a_0dim_host_tensor": lambda s: torch.zeros(4, device=s.device) + torch.tensor(2.0),
    "device_tensor_indexed_with_a_host_index": lambda s: torch.zeros(4, device=s.device)[torch.tensor([0, 2])],
    "host_tensor_indexed_with_a_host_index": lambda s: torch.ones(4)[torch.tensor([0, 2])],
    "empty_like_of_a_device_tensor_on_the_host_pinned":
        lambda s: torch.empty_like(torch.zeros(4, device=s.device), device="cpu", pin_memory=True),
    "tensor_from_a_list_with_device": lambda s: torch.tensor([1.0, 2.0], device=s.device),
}

@pytest.mark.parametrize("accepted", list(ACCEPTED))
def test_the_emulation_accepts_what_cuda_accepts(accepted):
    with LaggingStream() as s:
        ACCEPTED[accepted](s)


def made_on_each_side(s):
    """Tensors made with an explicit host device (``"cpu"`` in its spellings) and tensors made on the GPU
    (``s.device``, ``"cuda"``, a device tensor's ``.device``, ``*_like``/``new_*`` of device memory)."""
    d = torch.zeros(4, device=s.device)
    host = {"zeros": torch.zeros(4, device="cpu"), "arange": torch.arange(4, device=torch.device("cpu")),
            "tensor": torch.tensor([1, 2], device="cpu"), "as_tensor": torch.as_tensor([1, 2], device="cpu"),
            "empty_like": torch.empty_like(d, device="cpu"), "zeros_like": torch.zeros_like(d, device="cpu"),
            "new_zeros": d.new_zeros(2, device="cpu"), "new_tensor": d.new_tensor([1, 2], device="cpu")}
    gpu = {"s.device": torch.zeros(2, device=s.device), "cuda": torch.zeros(2, device="cuda"),
           "d.device": torch.zeros(2, device=d.device), "empty_like": torch.empty_like(d),
           "zeros_like": torch.zeros_like(d, pin_memory=False), "new_zeros": d.new_zeros(2),
           "new_tensor": d.new_tensor([1, 2]), "tensor": torch.tensor([1, 2], device=s.device)}
    return host, gpu


def test_device_cpu_is_the_host_in_every_factory():
    """Issue 28: an explicit device="cpu" table was treated as the GPU (06). "cpu" is the host, always."""
    with LaggingStream() as s:
        host, gpu = made_on_each_side(s)
        assert [k for k, t in host.items() if s.is_device(t)] == []
        assert [k for k, t in gpu.items() if not s.is_device(t)] == []
        assert (host["tensor"] + torch.ones(2)).tolist() == [2.0, 3.0]    # host arithmetic: no device involved


def test_tensor_from_host_data_with_device_waits_for_the_queue():
    """torch.tensor(list, device=) is a blocking copy from the host (the briefing: it blocked behind a busy GPU
    every time); so are as_tensor and new_tensor. A factory that builds on the device waits for nothing."""
    with LaggingStream() as s:
        pin = torch.ones(4, pin_memory=True)
        d = torch.zeros(4, device=s.device)
        for make in (lambda: torch.tensor([1, 2], device=s.device), lambda: torch.as_tensor([1, 2], device=s.device),
                     lambda: d.new_tensor([1, 2])):
            d.copy_(pin, non_blocking=True)
            assert s.pending() == 1
            t = make()
            assert s.pending() == 0 and s.is_device(t) and t.tolist() == [1, 2]
        d.copy_(pin, non_blocking=True)
        torch.arange(4, device=s.device), torch.zeros_like(d), d.new_zeros(3)
        assert s.pending() == 1


def test_a_device_factory_in_a_capture_is_filled_again_at_every_replay():
    """A zeros() made inside a capture is zeroed by a captured kernel: every replay zeroes it again (it must
    not accumulate across replays)."""
    with LaggingStream() as s:
        static = torch.zeros(4, device=s.device)
        out = torch.zeros(4, device=s.device)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            acc = torch.zeros(4, device=s.device)
            acc.add_(static)
            out.copy_(acc)
        for n in (1, 2, 3):
            static.fill_(n)
            g.replay()
            assert out.tolist() == [float(n)] * 4


# --------------------------------------------------------------------------- host_waits (issue 28)

def test_host_waits_counts_every_synchronize_that_has_work_to_wait_for():
    with LaggingStream() as s:
        dev = torch.zeros(4, device=s.device)
        assert s.host_waits == 0
        s.synchronize()                              # nothing queued: returns at once, no wait
        assert s.host_waits == 0
        dev.add_(1)
        s.synchronize()
        assert s.host_waits == 1
        dev.add_(1)
        torch.cuda.synchronize()                     # torch's own call, while the block is active
        assert s.host_waits == 2 and s.pending() == 0
        assert dev.tolist() == [2.0] * 4 and s.host_waits == 2   # nothing queued: a read waits for nothing
    if not torch.cuda.is_available():
        with pytest.raises((RuntimeError, AssertionError)):
            torch.cuda.synchronize()                 # restored: torch's own again outside the block


def test_host_waits_counts_event_waits_only_where_the_mark_has_not_run():
    with LaggingStream() as s:
        never = s.Event()
        never.synchronize()                          # never recorded: returns at once
        ev = s.Event()
        ev.record()
        ev.synchronize()                             # nothing before it: the GPU has nothing to run
        first, second = s.Event(), s.Event()
        first.record()
        second.record()
        second.synchronize()                         # only another event's mark before it: no work, no wait
        s.Event().record()
        s.synchronize()                              # only a mark queued: no wait either
        assert s.host_waits == 0
        s.launch(lambda: None)
        ev.record()
        ev.synchronize()
        assert s.host_waits == 1
        ev.synchronize()                             # reached already
        assert s.host_waits == 1


@pytest.mark.parametrize("read", ["item", "tolist", "bool", "blocking copy", "pageable d2h", "arithmetic"])
def test_host_waits_counts_each_read_of_device_data_that_runs_queued_work(read):
    with LaggingStream() as s:
        dev = torch.zeros(1, device=s.device)
        dev.add_(1)
        before = s.host_waits
        if read == "item":
            dev.item()
        elif read == "tolist":
            dev.tolist()
        elif read == "bool":
            bool(dev)
        elif read == "blocking copy":
            dev.copy_(torch.ones(1))                 # a blocking H2D waits for what is queued before it
        elif read == "pageable d2h":
            torch.zeros(1).copy_(dev, non_blocking=True)
        else:
            dev + 1
        assert s.host_waits == before + 1 and s.pending() == 0


def test_a_polling_loop_is_one_host_wait_and_a_single_look_is_none():
    with LaggingStream() as s:
        for _ in range(3):
            s.launch(lambda: None)
        ev = s.Event()
        ev.record()
        assert not ev.query() and s.host_waits == 0   # a look: no wait
        polls = 0
        while not ev.query():
            polls += 1
        assert polls >= 1 and s.host_waits == 1       # however many polls: one wait
        # a loop that counts what is in flight, one query per step, never waits
        marks = []
        src = torch.zeros(4, pin_memory=True)
        dst = torch.zeros(6, 4, device=s.device)
        for n in range(6):
            src.fill_(n)
            dst[n].copy_(src, non_blocking=True)
            marks.append(s.Event())
            marks[-1].record()
            sum(not m.query() for m in marks)
        assert s.host_waits == 1 and s.pending() > 0
        ev.record()
        while not ev.query():                          # a second loop on a re-recorded event: a second wait
            pass
        assert s.host_waits == 2


def test_a_polling_loop_that_queues_work_between_polls_ends():
    from pinlab.streams import SPIN_LIMIT

    with LaggingStream() as s:
        dev = torch.zeros(1, device=s.device)
        dev.add_(1)
        ev = s.Event()
        ev.record()
        polls = 0
        while not ev.query():
            dev.add_(1)                                # work queued between the polls: never a repeat look
            polls += 1
            assert polls <= SPIN_LIMIT + 10, "the polling loop did not end"
        assert s.host_waits == 1 and polls > SPIN_LIMIT - 1
        s.synchronize()
        assert dev.item() == 1 + polls


# ---- CUDA's rules for factories and torch.cuda.synchronize on the emulated stream (issue 28) ----------
def test_factories_pinned_memory_on_the_emulated_gpu_is_refused_with_torchs_error():
    with pinlab.LaggingStream() as s:
        w = torch.ones(4, device=s.device)
        for make in (lambda: torch.empty_like(w, pin_memory=True), lambda: torch.zeros_like(w, pin_memory=True),
                     lambda: w.new_empty(4, pin_memory=True), lambda: torch.zeros(4, device=s.device, pin_memory=True),
                     lambda: torch.empty(4, device=w.device, pin_memory=True),
                     lambda: torch.ones(4, device="cuda", pin_memory=True)):
            with pytest.raises(RuntimeError, match=PIN_DEVICE_ERROR):
                make()
        pinned = torch.empty_like(w, device="cpu", pin_memory=True)  # on the host: fine
        assert s.is_pinned(pinned) and not s.is_device(pinned)


def test_factories_device_cpu_is_the_host_and_s_device_the_gpu():
    with pinlab.LaggingStream() as s:
        w = torch.arange(4, device=s.device)
        for host in (torch.empty_like(w, device="cpu"), torch.zeros(3, device=torch.device("cpu")),
                     torch.tensor([1, 2], device="cpu"), w.new_zeros(2, device="cpu")):
            assert not s.is_device(host) and not s.is_pinned(host)
        for dev in (torch.zeros(3, device=s.device), torch.empty_like(w), torch.arange(3, device=w.device)):
            assert s.is_device(dev)
        w.add_(1)                                       # queued on the emulated GPU
        read = torch.as_tensor(w, device="cpu")         # reads device data on the host: after the queue ran
        assert s.pending() == 0 and not s.is_device(read) and read.tolist() == [1, 2, 3, 4]


def test_torch_cuda_synchronize_inside_the_block_waits_for_the_emulated_gpu_and_is_put_back():
    before = torch.cuda.synchronize
    with pinlab.LaggingStream() as s:
        d = torch.zeros(4, device=s.device)
        d.add_(1)
        assert s.pending() == 1
        torch.cuda.synchronize()
        assert s.pending() == 0
    assert torch.cuda.synchronize is before
