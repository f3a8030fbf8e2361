"""pinlab.waits: explicit host waits counted by file:line (issues 45 and 47). The CPU tests put fakes in the
place of the synchronize calls before a watch starts (the watch wraps what it finds); the gpu tests count real
waits and compare them with the profiler's trace."""
import sys
import threading

import pytest
import torch

from pinlab import waits
from pinlab.waits import watch_waits

HERE = __file__


def _line(report, i=0) -> int:
    path, _, line = report.events[i].where.rpartition(":")
    assert path == HERE, report.events[i]
    return int(line)


@pytest.fixture
def fake_syncs(monkeypatch):
    """torch.cuda.synchronize, torch.cuda.Stream.synchronize and torch.cuda.Event.synchronize replaced by fakes
    that note their calls (a CPU build has no CUDA to wait for)."""
    from torch.cuda import streams

    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("device"))
    monkeypatch.setattr(streams.Stream, "synchronize", lambda self: calls.append(("stream", self)))
    monkeypatch.setattr(streams.Event, "synchronize", lambda self: calls.append(("event", self)))
    return calls


def test_each_wait_is_counted_once_at_the_callers_line_and_then_runs(fake_syncs):
    from torch.cuda import streams

    with watch_waits() as w:
        line = sys._getframe().f_lineno + 1
        torch.cuda.synchronize()
        streams.Stream.synchronize("s")
        streams.Event.synchronize("e")
    assert fake_syncs == ["device", ("stream", "s"), ("event", "e")]
    assert [e.op for e in w.events] == [waits.DEVICE_SYNC, waits.STREAM_SYNC, waits.EVENT_SYNC]
    assert _line(w) == line
    assert w.total == 3 and w.counts[waits.EVENT_SYNC] == 1
    assert "3 explicit host wait(s) at 3 place(s)" in str(w) and "cudaEventSynchronize" in str(w)


def test_nothing_is_counted_outside_the_block_and_everything_is_restored(fake_syncs):
    from torch.cuda import streams

    before = (torch.cuda.synchronize, streams.Event.synchronize, torch.Event, torch.Stream)
    with watch_waits() as w:
        assert torch.cuda.synchronize is not before[0]
    assert (torch.cuda.synchronize, streams.Event.synchronize, torch.Event, torch.Stream) == before
    torch.cuda.synchronize()
    assert w.total == 0 and fake_syncs == ["device"]
    assert str(w) == "pinlab.watch_waits: no explicit host waits"


def test_generic_torch_event_made_inside_the_block_is_counted_and_isinstance_still_holds():
    """torch.Event is an immutable C type: inside a watch the name gives a subclass whose synchronize counts
    (transformers' DeferredStopCheck makes its events so); torch's own instances still pass isinstance."""
    base = torch.Event
    old = torch.Event(device="cpu")
    with watch_waits() as w:
        assert torch.Event is not base
        assert isinstance(old, torch.Event) and issubclass(base, torch.Event)
        new = torch.Event(device="cpu")
        assert isinstance(new, base)
        new.synchronize()  # (a CPU event: returns at once)
        old.synchronize()  # made before the block: torch's own class, not seen (the docstring says so)
    assert torch.Event is base
    assert [e.op for e in w.events] == [waits.EVENT_SYNC]


def test_watches_nest_and_see_only_their_own_thread(fake_syncs):
    with watch_waits() as outer:
        with watch_waits() as inner:
            torch.cuda.synchronize()
        t = threading.Thread(target=torch.cuda.synchronize)
        t.start()
        t.join()
        torch.cuda.synchronize()
    assert inner.total == 1 and outer.total == 2
    assert fake_syncs == ["device"] * 3


def test_around_wraps_each_wait_and_a_wait_inside_a_wait_counts_once(fake_syncs, monkeypatch):
    from torch.cuda import streams

    seen = []

    class Note:
        def __init__(self, op):
            self.op = op

        def __enter__(self):
            seen.append(("enter", self.op))

        def __exit__(self, *exc):
            seen.append(("exit", self.op))

    def nested(self):  # a stream synchronize that synchronizes the device
        torch.cuda.synchronize()

    monkeypatch.setattr(streams.Stream, "synchronize", nested)
    with watch_waits(around=Note) as w:
        streams.Stream.synchronize("s")
    assert [e.op for e in w.events] == [waits.STREAM_SYNC]
    assert seen == [("enter", waits.STREAM_SYNC), ("exit", waits.STREAM_SYNC)]
    assert fake_syncs == ["device"]


def test_callers_name_a_functions_lines_wherever_it_lives(fake_syncs):
    def loop():
        torch.cuda.synchronize()

    with watch_waits(callers=[loop]) as w:
        loop()
    assert w.events[0].where.endswith(f":{loop.__code__.co_firstlineno + 1}")


def test_bad_input_is_named():
    with pytest.raises(TypeError, match="around must be None or a function"):
        watch_waits(around=3)
    with pytest.raises(TypeError, match="callers must be None or a list of Python functions"):
        watch_waits(callers="loop")
    w = watch_waits()
    with w:
        with pytest.raises(RuntimeError, match="already active"):
            w.__enter__()
    with w:  # again, after it exited: the report counts on
        pass


def test_a_failing_wait_still_leaves_the_hooks_as_they_were(monkeypatch):
    def boom(device=None):
        raise RuntimeError("no GPU")

    monkeypatch.setattr(torch.cuda, "synchronize", boom)
    with pytest.raises(RuntimeError, match="no GPU"):
        with watch_waits() as w:
            torch.cuda.synchronize()
    assert torch.cuda.synchronize is boom and w.total == 1
    with pytest.raises(RuntimeError, match="no GPU"):  # outside a watch: not counted, and a new watch counts again
        torch.cuda.synchronize()
    with watch_waits() as again, pytest.raises(RuntimeError, match="no GPU"):
        torch.cuda.synchronize()
    assert w.total == 1 and again.total == 1


# --- on the GPU: the real calls, against the profiler's trace ----------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
def test_every_wait_is_one_synchronize_of_the_trace():
    from torch.profiler import ProfilerActivity, profile, record_function

    x = torch.ones(1 << 20, device="cuda")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("pinlab_waits"), watch_waits() as w:
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                y = x * 2
            s.synchronize()
            ev = torch.cuda.Event()
            ev.record()
            ev.synchronize()
            gev = torch.Event(device="cuda")  # the generic class, as transformers' DeferredStopCheck makes it
            gev.record()
            gev.synchronize()
            torch.cuda.synchronize()
            torch.accelerator.synchronize()
    events = prof.events()
    region = next(e.time_range for e in events if e.name == "pinlab_waits")
    names = [e.name for e in events
             if "Synchronize" in e.name and region.start <= e.time_range.start <= region.end]
    assert y.sum().item() == 2 * (1 << 20)
    assert w.counts == {waits.STREAM_SYNC: 1, waits.EVENT_SYNC: 2, waits.DEVICE_SYNC: 1, waits.ACCELERATOR_SYNC: 1}
    assert sorted(names) == sorted(waits.RUNTIME[e.op] for e in w.events), names
