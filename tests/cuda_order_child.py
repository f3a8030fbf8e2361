"""The CUDA tests of pinlab.order's verdict, run by tests/test_order.py in a process of their own
(``test_gpu_the_order_verdict_on_cuda_in_a_process_of_its_own``): the verdict turns on torch's GPU trace, which torch
cannot turn off (docs/facts.md F22), and the gpu tests that run after it in the suite's pytest process must not run
under it. Not collected on its own (the name does not start with ``test_``); run it by path:
``python -m pytest tests/cuda_order_child.py``.

What they check on a GPU: the patterns of tests/test_order.py (every fix silent, every latent race named), a side
stream ordered through ``wait_event`` and a host sync of the stream that waited (and not by ``wait_event`` alone),
every host sync torch reports (``.item()``, ``.tolist()``, a blocking copy, event, stream and device synchronize, a
``query()`` that returned True), and 10^3 steps of each fix with no finding (with 10^4 steps of each, this child
took 117 s of the gpu unit tests' 161 s on the H200, up to 3 ms per step, which kept a plumbing renewal from
fitting one device call; tools/bench_races.py runs the long loops).
"""
import pytest
import torch

import pinlab
import test_order as t
from pinlab.order import detect_races
from pinlab.races import H2D_REWRITE

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.parametrize("watch", ("every_op", "copies"))
@pytest.mark.parametrize("fn", t.CORRECT, ids=t.CORRECT_IDS)
def test_gpu_correct_patterns_are_silent(fn, watch):
    s = pinlab.stream()
    with s:
        with detect_races(watch=watch) as r:
            keep = fn(s)
    del keep
    assert r.total == 0, r.summary()


@cuda
@pytest.mark.parametrize("watch", ("every_op", "copies"))
@pytest.mark.parametrize("fn,kind,n,name", [(*r, i) for r, i in zip(t.RACY, t.RACY_IDS)], ids=t.RACY_IDS)
def test_gpu_latent_races_are_named(fn, kind, n, name, watch):
    s = pinlab.stream()
    with s:
        with detect_races(watch=watch) as r:
            keep = fn(s)
    del keep
    if watch == "copies" and name in t.MISSED_BY_COPIES:
        assert r.total == 0, r.summary()
    else:
        assert r.count(kind) >= 1 and (n is None or r.count(kind) == n), r.summary()


@cuda
def test_gpu_side_stream_ordered_through_wait_event_and_a_host_sync():
    side = torch.cuda.Stream()
    buf = torch.zeros(1 << 10, dtype=torch.int32, pin_memory=True)
    d = torch.zeros(1 << 10, dtype=torch.int32, device="cuda")
    with detect_races() as r:
        with torch.cuda.stream(side):
            d.copy_(buf, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
        torch.cuda.current_stream().wait_event(ev)   # device-side only: the host is not ordered yet
        pinlab.gpu_busy(1.0)
        torch.cuda.current_stream().synchronize()    # the host waits for the stream that waited: ordered
        buf.fill_(1)
    assert r.total == 0, r.summary()
    with detect_races() as r2:
        with torch.cuda.stream(side):
            d.copy_(buf, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
        torch.cuda.current_stream().wait_event(ev)
        buf.fill_(2)                                 # only the GPU waited
    torch.cuda.synchronize()
    assert r2.count(H2D_REWRITE) == 1, r2.summary()


@cuda
@pytest.mark.parametrize("sync", ["item", "tolist", "blocking_copy", "event", "stream", "device", "query"])
def test_gpu_every_host_sync_orders_the_copy(sync):
    buf = torch.zeros(1 << 10, dtype=torch.int32, pin_memory=True)
    d = torch.zeros(1 << 10, dtype=torch.int32, device="cuda")
    with detect_races() as r:
        d.copy_(buf, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        if sync == "item":
            d.sum().item()
        elif sync == "tolist":
            d[:2].tolist()
        elif sync == "blocking_copy":
            d[:4].cpu()
        elif sync == "event":
            ev.synchronize()
        elif sync == "stream":
            torch.cuda.current_stream().synchronize()
        elif sync == "device":
            torch.cuda.synchronize()
        else:
            while not ev.query():
                pass
        buf.fill_(1)
    assert r.total == 0, f"{sync} did not order the copy: {r.summary()}"


@cuda
def test_gpu_1k_steps_of_the_fixes_give_no_false_positive():
    s = pinlab.stream()
    old, t.STEPS = t.STEPS, 1_000
    try:
        for fn in (t.ring_with_events, t.ring_with_slot_guard, t.snapshot_each_step, t.deferred_stop_check):
            with s:
                with detect_races() as r:
                    keep = fn(s)
            del keep
            assert r.total == 0 and r.copies >= t.STEPS, (fn.__name__, r.summary())
    finally:
        t.STEPS = old


@cuda
def test_gpu_the_order_verdict_leaves_torchs_sanitizer_unloaded():
    """pinlab.order keeps its own vector clocks: CSAN's handlers, registered on torch's GPU trace when
    torch.cuda._sanitizer is imported, would run at every synchronization of the process (stop 59: 3.8 ms per
    event synchronize after tools/bench_races.py's graph section)."""
    import sys

    buf = torch.zeros(16, dtype=torch.int32, pin_memory=True)
    d = torch.zeros(16, dtype=torch.int32, device="cuda")
    with detect_races() as r:
        d.copy_(buf, non_blocking=True)
        torch.cuda.synchronize()
        buf.fill_(1)
    assert r.total == 0, r.summary()
    assert "torch.cuda._sanitizer" not in sys.modules


@cuda
def test_gpu_the_stream_a_copy_is_queued_on_is_the_one_torchs_trace_names():
    """order._stream_id reads the raw cudaStream_t in one C call: the value torch.cuda.current_stream().cuda_stream
    gives and the GPU trace passes, on the default stream and inside a side stream's block."""
    from pinlab import order

    clock = order._QuietCudaClock()
    assert order._stream_id(clock) == torch.cuda.current_stream().cuda_stream
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert order._stream_id(clock) == side.cuda_stream == torch.cuda.current_stream().cuda_stream
