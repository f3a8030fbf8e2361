"""The emulated stream behaves like the CUDA stream (issues 19 and 20).

Each scenario below is plain torch code run under ``with stream as s:``; it returns what a reader of the
loop would see. The CPU tests run it on a :class:`pinlab.LaggingStream` and compare with what CUDA gives;
the ``gpu`` tests run the same function on the real CUDA stream (once to warm up: a kernel's first launch
loads its module lazily and waits for the busy GPU, which would hide a race) and on a LaggingStream on the
GPU host, and compare the two. Where a race must show on the GPU, the GPU is given a wide lead first
(``s.busy(LEAD_MS)``: the host enqueues the step's few calls in well under a millisecond).
"""
import os
import time

import pytest
import torch

import pinlab
from pinlab import LaggingStream
from pinlab.checks import l03 as checks03
from test_streams import ACCEPTED, PLANTED, made_on_each_side, refused_as_cuda_refuses

LEAD_MS = 50.0        # the GPU's lead where a race must show (the host needs microseconds)
POLL_LIMIT_S = 10.0   # a polling loop that has not ended by then is taken as hung
MIB = 1024 * 1024

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def on_device(s, t) -> bool:
    """Is ``t`` device memory, on either stream?"""
    return s.is_device(t) if s.emulated else t.device.type == "cuda"


def assert_refused_wait(exc: BaseException) -> None:
    """``exc`` is what ``with torch.cuda.graph(g):`` lets out when its body waited for the GPU: CUDA refused
    the wait (cudaErrorStreamCaptureUnsupported, a torch.AcceleratorError) and the capture was invalidated, so
    ending it raised "operation failed due to a previous error during capture", with the refusal as its context
    (or, where the capture survived the refusal, the refusal itself)."""
    from pinlab.streams import CAPTURE_INVALIDATED_ERROR, CAPTURE_SYNC_ERROR

    assert isinstance(exc, torch.AcceleratorError), repr(exc)
    chain = [exc, exc.__context__]
    assert any(isinstance(e, torch.AcceleratorError) and CAPTURE_SYNC_ERROR in str(e) for e in chain), repr(chain)
    assert CAPTURE_INVALIDATED_ERROR in str(exc) or CAPTURE_SYNC_ERROR in str(exc), repr(exc)


# --------------------------------------------------------------------------- the scenarios

def positional_non_blocking_h2d(s):
    """1. non_blocking passed positionally: ``copy_(src, True)``, ``to(device, dtype, True)``,
    ``to(device, None, True, True)``, ``to(other, True)``, ``cuda(None, True)``. Each copy is
    enqueued behind the busy GPU and reads the pinned source when it runs: after the host's write."""
    src = torch.zeros(16, dtype=torch.int32, pin_memory=True)
    dst = torch.zeros(8, 16, dtype=torch.int32, device=s.device)
    like = torch.zeros(1, dtype=torch.int64, device=s.device)
    s.busy(LEAD_MS)
    for n in range(8):                       # the lesson-03 race, non_blocking positional
        src.fill_(n)
        dst[n].copy_(src, True)
    a = src.to(s.device, torch.int32, True)
    b = src.to(s.device, None, True, True)
    c = src.cuda(None, True)
    d = src.to(like, True)                   # int64 on the device
    src.fill_(100)                           # written before any of the copies ran (the race too)
    s.synchronize()
    return {"race": dst[:, 0].tolist(), "to_dtype": int(a[0]), "to_copy": int(b[0]), "cuda": int(c[0]),
            "to_other": int(d[0]), "to_other_dtype": str(d.dtype),
            "on_device": [on_device(s, t) for t in (a, b, c, d)]}


POSITIONAL_H2D = {"race": [100] * 8, "to_dtype": 100, "to_copy": 100, "cuda": 100, "to_other": 100,
                  "to_other_dtype": "torch.int64", "on_device": [True] * 4}


def positional_non_blocking_d2h(s):
    """1. D2H: ``copy_(dev, True)`` into pinned memory is enqueued (read before an event: the old
    contents); ``to("cpu", dtype, True)`` gives a pinned result; ``.cpu()`` is a blocking copy."""
    dev = torch.full((4,), 7, dtype=torch.int32, device=s.device)
    out = torch.full((4,), -1, dtype=torch.int32, pin_memory=True)
    s.busy(LEAD_MS)
    out.copy_(dev, True)
    early = out.tolist()                     # the GPU is still busy: the copy has not run
    done = s.Event()
    done.record()
    done.synchronize()
    late = out.tolist()
    back = dev.to("cpu", torch.int64, True)
    s.synchronize()
    host = dev.cpu()
    return {"early": early, "late": late, "to_cpu_pinned": bool(back.is_pinned()), "to_cpu": back.tolist(),
            "cpu_on_device": on_device(s, host), "cpu": host.tolist()}


POSITIONAL_D2H = {"early": [-1] * 4, "late": [7] * 4, "to_cpu_pinned": True, "to_cpu": [7] * 4,
                  "cpu_on_device": False, "cpu": [7] * 4}


def completed_event_returns_at_once(s):
    """2. Synchronizing an event that has already been reached waits for nothing queued after it;
    an event never recorded returns at once too (and its query() is True)."""
    first, second = (torch.zeros(4, dtype=torch.int32, pin_memory=True) for _ in range(2))
    dst = torch.zeros(2, 4, dtype=torch.int32, device=s.device)
    ev = s.Event()
    ev.record()
    ev.synchronize()                         # reached
    s.busy(LEAD_MS)
    dst[0].copy_(first, non_blocking=True)   # behind the busy GPU
    ev.synchronize()                         # already reached: must not wait for the copy
    first.fill_(9)                           # so the copy, still to run, reads 9
    never = s.Event()
    never_query = never.query()
    s.busy(LEAD_MS)
    dst[1].copy_(second, non_blocking=True)
    never.synchronize()                      # never recorded: returns at once
    second.fill_(3)
    s.synchronize()
    return {"dst": dst[:, 0].tolist(), "never_query": never_query, "reached_query": ev.query()}


COMPLETED_EVENT = {"dst": [9, 3], "never_query": True, "reached_query": True}


def to_own_device_is_the_tensor(s):
    """3. ``d.to(s.device)``, ``d.cuda()`` and ``d.to(d.device)`` of device memory return ``d`` itself;
    a dtype change or ``copy=True`` stays on the device; ``to("cpu")`` goes to the host."""
    d = torch.arange(4, device=s.device)
    d.add_(1)
    wider = d.to(torch.float64)
    copied = d.to(s.device, copy=True)
    host = d.to("cpu")
    return {"to_device_is_d": d.to(s.device) is d, "cuda_is_d": d.cuda() is d, "to_own_is_d": d.to(d.device) is d,
            "wider_on_device": on_device(s, wider), "wider": wider.tolist(),
            "copy_on_device": on_device(s, copied), "copy_is_d": copied is d, "copy": copied.tolist(),
            "host_on_device": on_device(s, host), "host": host.tolist()}


OWN_DEVICE = {"to_device_is_d": True, "cuda_is_d": True, "to_own_is_d": True, "wider_on_device": True,
              "wider": [1.0, 2.0, 3.0, 4.0], "copy_on_device": True, "copy_is_d": False, "copy": [1, 2, 3, 4],
              "host_on_device": False, "host": [1, 2, 3, 4]}


def dropped_temporaries_are_freed(s, steps=300):
    """4. ``steps`` dropped 1 MiB device temporaries (an op's result, a copy, an empty tensor written by
    a kernel): afterwards only what the program still holds is device memory."""
    x = torch.ones(MIB // 4, device=s.device)          # 1 MiB of float32, kept
    s.synchronize()
    base = s.device_bytes()
    for _ in range(steps):
        y = x * 2                                       # a temporary from an op
        y = y.to(s.device, copy=True)                   # a temporary from a copy
        z = torch.empty(MIB // 4, device=s.device)
        z.copy_(y)                                      # a kernel writes it
    del y, z
    s.synchronize()
    return {"held_mib_after": round((s.device_bytes() - base) / MIB, 1) <= 3.0, "x": float(x[0])}


DROPPED = {"held_mib_after": True, "x": 1.0}


def polling_an_event_ends(s):
    """5. ``while not ev.query(): pass`` ends; behind a busy GPU the first query says False; once it
    says True the copy has run (a later write to the source does not reach the device)."""
    src = torch.zeros(4, dtype=torch.int32, pin_memory=True)
    dst = torch.zeros(4, dtype=torch.int32, device=s.device)
    s.busy(LEAD_MS)
    dst.copy_(src, non_blocking=True)
    ev = s.Event()
    ev.record()
    first = ev.query()
    start = time.monotonic()
    while not ev.query():
        if time.monotonic() - start > POLL_LIMIT_S:
            return {"hung": True}
    src.fill_(4)                             # after the copy: the device keeps 0
    s.synchronize()
    return {"hung": False, "first": first, "dst": dst.tolist()}


POLLING = {"hung": False, "first": False, "dst": [0] * 4}


def ring_with_torch_cuda_events(s, depth=3, steps=9):
    """Issue 20: the event-guarded ring written with ``torch.cuda.Event()`` (not ``s.Event()``), the
    copies enqueued behind busy work: correct on both streams."""
    ring = [torch.zeros(4, dtype=torch.int32, pin_memory=True) for _ in range(depth)]
    events = [None] * depth
    dst = torch.zeros(steps, 4, dtype=torch.int32, device=s.device)
    for n in range(steps):
        k = n % depth
        if events[k] is not None:
            events[k].synchronize()          # the copy that last read ring[k] has run
        ring[k].fill_(n)
        s.busy(LEAD_MS / 10)
        dst[n].copy_(ring[k], True)
        events[k] = torch.cuda.Event()
        events[k].record()
    s.synchronize()
    return dst[:, 0].tolist()


RING = list(range(9))


def graph_replay_reads_the_pinned_buffer_when_it_runs(s, steps=8):
    """Issue 21: a graph captured with ``static.copy_(pin, non_blocking=True)`` replays with the address it
    captured. The host rewrites ``pin`` after every replay while the GPU is behind: every replayed copy
    reads what the buffer holds when it runs (the last write), not the step's data: the lesson-03 race,
    under graph replay."""
    pin = torch.zeros(4, dtype=torch.int32, pin_memory=True)
    static = torch.zeros(4, dtype=torch.int32, device=s.device)
    seen = torch.zeros(steps, 4, dtype=torch.int32, device=s.device)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static.copy_(pin, non_blocking=True)      # captured: this address, read at every replay
    capturing_after = torch.cuda.is_current_stream_capturing()
    s.busy(LEAD_MS)
    for n in range(steps):
        pin.fill_(n)                              # the host writes step n's metadata
        g.replay()                                # queued behind the busy GPU
        seen[n].copy_(static)                     # what step n's kernels would read (device to device)
    pin.fill_(100)
    s.synchronize()
    return {"seen": seen[:, 0].tolist(), "capturing_after": capturing_after}


GRAPH_RACE = {"seen": [100] * 8, "capturing_after": False}


def graph_with_snapshot_outside(s, steps=8):
    """Issue 21, the PR's fix under graphs: the host's metadata is pageable; each step copies a fresh pinned
    snapshot of it into the graph's static input *outside* the graph, then replays a graph that only reads
    the static input. The host rewrites the metadata at once: every step sees its own data."""
    meta = torch.zeros(4, dtype=torch.int32)                  # pageable, rewritten every step
    static = torch.zeros(4, dtype=torch.int32, device=s.device)
    out = torch.zeros(4, dtype=torch.int32, device=s.device)
    seen = torch.zeros(steps, 4, dtype=torch.int32, device=s.device)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out.copy_(static)                                     # the step's kernels read the static input
    s.busy(LEAD_MS)
    for n in range(steps):
        meta.fill_(n)
        static.copy_(meta.pin_memory(), non_blocking=True)   # the snapshot: its own pinned block
        g.replay()
        seen[n].copy_(out)
        meta.fill_(-1)                                       # rewritten right away (the next step's builder)
    s.synchronize()
    return seen[:, 0].tolist()


GRAPH_SNAPSHOT = list(range(8))


def graph_capture_refuses_a_pageable_copy(s):
    """Issue 21: a capture refuses a copy from pageable host memory (torch checks it before calling CUDA),
    and accepts one from pinned memory."""
    pageable = torch.ones(4, dtype=torch.int32)
    pin = torch.ones(4, dtype=torch.int32, pin_memory=True)
    static = torch.zeros(4, dtype=torch.int32, device=s.device)
    g = torch.cuda.CUDAGraph()
    message = ""
    try:
        with torch.cuda.graph(g):
            static.copy_(pageable, non_blocking=True)
    except RuntimeError as exc:
        message = str(exc)
    g2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g2):
        static.copy_(pin, non_blocking=True)
    g2.replay()
    s.synchronize()
    return {"refused": "unless the CPU tensor is pinned" in message, "pinned_replayed": static.tolist()}


GRAPH_REFUSES = {"refused": True, "pinned_replayed": [1] * 4}

def factory_in_a_capture_is_filled_at_every_replay(s):
    """Issue 28: a device factory inside a capture (``torch.zeros(4, device=)``) is filled by a captured
    kernel, so every replay fills it again: what the graph adds to it does not pile up across replays."""
    static = torch.zeros(4, dtype=torch.int32, device=s.device)
    out = torch.zeros(3, 4, dtype=torch.int32, device=s.device)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        acc = torch.zeros(4, dtype=torch.int32, device=s.device)
        acc.add_(static)
        acc.add_(torch.arange(4, dtype=torch.int32, device=s.device))
    for n in range(3):
        static.fill_(n)
        g.replay()
        out[n].copy_(acc)
    s.synchronize()
    return out.tolist()


FACTORY_REFILLED = [[n + i for i in range(4)] for n in range(3)]

SCENARIOS = {
    "positional_non_blocking_h2d": (positional_non_blocking_h2d, POSITIONAL_H2D),
    "positional_non_blocking_d2h": (positional_non_blocking_d2h, POSITIONAL_D2H),
    "completed_event_returns_at_once": (completed_event_returns_at_once, COMPLETED_EVENT),
    "to_own_device_is_the_tensor": (to_own_device_is_the_tensor, OWN_DEVICE),
    "dropped_temporaries_are_freed": (dropped_temporaries_are_freed, DROPPED),
    "polling_an_event_ends": (polling_an_event_ends, POLLING),
    "ring_with_torch_cuda_events": (ring_with_torch_cuda_events, RING),
    "graph_replay_reads_the_pinned_buffer_when_it_runs": (graph_replay_reads_the_pinned_buffer_when_it_runs,
                                                          GRAPH_RACE),
    "graph_with_snapshot_outside": (graph_with_snapshot_outside, GRAPH_SNAPSHOT),
    "graph_capture_refuses_a_pageable_copy": (graph_capture_refuses_a_pageable_copy, GRAPH_REFUSES),
    "factory_in_a_capture_is_filled_at_every_replay": (factory_in_a_capture_is_filled_at_every_replay,
                                                       FACTORY_REFILLED),
}


# --------------------------------------------------------------------------- on the CPU

@pytest.mark.parametrize("name", list(SCENARIOS))
def test_the_emulation_gives_what_cuda_gives(name):
    fn, cuda_gives = SCENARIOS[name]
    with LaggingStream() as s:
        got = fn(s)
    assert got == cuda_gives


def test_positional_non_blocking_is_queued_and_torch_refuses_what_it_refuses():
    with LaggingStream() as s:
        src = torch.zeros(4, pin_memory=True)
        dst = torch.zeros(4, device=s.device)
        dst.copy_(src, True)
        assert s.pending() == 1                      # queued, not run: a non_blocking copy
        dst.copy_(src, False)
        assert s.pending() == 0                      # a blocking copy waits for the queue
        src.to(s.device, torch.float32, True)
        src.to(torch.float64, True)                  # host to host: nothing queued
        assert s.pending() == 1
        with pytest.raises(TypeError):
            src.to(s.device, True)                   # torch refuses (str/device, bool) too
        with pytest.raises(TypeError):
            src.cpu(True)


def test_a_racy_loop_with_positional_non_blocking_is_rejected_and_a_ring_accepted(capsys):
    n_ints = checks03.N_INTS

    def racy(s, steps, write_metadata, forward):
        buf = torch.zeros(n_ints, dtype=torch.int32, pin_memory=True)
        for n in range(steps):
            write_metadata(buf, n)
            meta = torch.empty(n_ints, dtype=torch.int32, device=s.device)
            meta.copy_(buf, True)
            forward(n, meta)

    def ring(s, steps, write_metadata, forward):
        depth = checks03.AHEAD + 1
        bufs = [torch.zeros(n_ints, dtype=torch.int32, pin_memory=True) for _ in range(depth)]
        done = [None] * depth
        for n in range(steps):
            k = n % depth
            if done[k] is not None:
                done[k].synchronize()
            write_metadata(bufs[k], n)
            meta = torch.empty(n_ints, dtype=torch.int32, device=s.device)
            meta.copy_(bufs[k], True)
            done[k] = s.Event()
            done[k].record()
            forward(n, meta)

    assert checks03.check_race_free_loop.verdict(racy) is False
    assert checks03.check_race_free_loop.verdict(ring) is True, capsys.readouterr().out


def test_synchronizing_a_reached_event_runs_nothing_after_it():
    with LaggingStream() as s:
        ev = s.Event()
        ev.record()
        ran = []
        s.launch(ran.append, 1)
        ev2 = s.Event()
        ev2.record()
        s.launch(ran.append, 2)
        ev2.synchronize()
        assert ran == [1] and s.pending() == 1 and ev.query()
        ev.synchronize()                             # reached before ev2: nothing more runs
        ev2.synchronize()
        assert ran == [1] and s.pending() == 1
        ev.record()                                  # re-recorded: a new mark, after the queued work
        assert not ev.query()
        ev.synchronize()
        assert ran == [1, 2] and s.pending() == 0


def test_a_query_runs_nothing_but_polling_lets_the_emulated_gpu_move_one_item_per_poll():
    with LaggingStream() as s:
        ran = []
        for i in range(3):
            s.launch(ran.append, i)
        ev = s.Event()
        ev.record()
        s.launch(ran.append, 99)                     # after the mark: polling never runs it
        assert not ev.query() and ran == []          # one look: nothing runs
        assert not ev.query() and ran == [0]         # polled again, nothing in between: one item ran
        s.launch(ran.append, 100)                    # work queued between two queries: not polling
        assert not ev.query() and ran == [0]
        polls = 0
        while not ev.query():                        # each poll runs one item; the last one reaches the mark
            polls += 1
            assert polls <= 1 and ran == [0, 1]
        assert polls == 1 and ran == [0, 1, 2] and s.pending() == 2   # 99 and 100 still queued
        assert s.Event().query()                     # never recorded: True, as torch.cuda.Event


def test_counting_what_is_in_flight_with_one_query_per_step_leaves_the_gpu_behind():
    with LaggingStream() as s:
        src = torch.zeros(4, dtype=torch.int32, pin_memory=True)
        dst = torch.zeros(6, 4, dtype=torch.int32, device=s.device)
        marks, in_flight = [], []
        for n in range(6):
            src.fill_(n)
            dst[n].copy_(src, non_blocking=True)
            marks.append(s.Event())
            marks[-1].record()
            in_flight.append(sum(not m.query() for m in marks))
        assert in_flight == [1, 2, 3, 4, 5, 6]
        assert dst[:, 0].tolist() == [5] * 6         # the race, as far behind as ever


def test_device_tensors_report_the_stream_device_and_to_follows_it():
    with LaggingStream() as s:
        d = torch.zeros(3, device=s.device)
        h = torch.zeros(3)
        assert d.device is s.device and h.device == torch.device("cpu") and h.device is not s.device
        assert s.is_device(h.to(d.device)) and h.to(h.device) is h and h.to("cpu") is h and h.cpu() is h
        assert s.is_device(h.to("cuda")) and s.is_device(h.cuda()) and s.is_device(h.to(0))
        v = d[1:]
        assert v.to(s.device) is v and v.cuda() is v


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the resident set from /proc")
def test_dropped_device_temporaries_free_their_memory():
    with LaggingStream() as s:
        x = torch.ones(MIB // 4, device=s.device)
        before = _rss_bytes()
        for _ in range(400):
            y = x + 1                                # a 1 MiB device temporary, dropped next round
            y = y.to(s.device, copy=True)
        del y
        s.synchronize()
        grown = _rss_bytes() - before
        assert s.device_bytes() == MIB               # only x is still device memory
        assert grown < 100 * MIB, f"{grown / MIB:.0f} MiB still resident after 800 dropped 1 MiB temporaries"


def test_a_freed_address_reused_by_host_memory_is_not_device_memory():
    with LaggingStream() as s:
        seen = 0
        for _ in range(50):
            d = torch.empty(MIB // 4, device=s.device)
            ptr = d.data_ptr()
            del d
            h = torch.empty(MIB // 4)                # often at the address just freed
            seen += h.data_ptr() == ptr
            assert not s.is_device(h)
            p = torch.empty(MIB // 4, pin_memory=True)
            ptr = p.data_ptr()
            del p
            h2 = torch.empty(MIB // 4)
            assert not s.is_pinned(h2) and s.pinned_bytes() == 0
            del h, h2
        view = torch.zeros(8, device=s.device)[2:]   # the base tensor is dropped at once: its view keeps it
        assert s.is_device(view) and s.device_bytes() == 32


def test_torch_cuda_event_is_the_streams_event_inside_the_block():
    before = torch.cuda.Event
    with LaggingStream() as s:
        ev = torch.cuda.Event(enable_timing=True)
        assert isinstance(ev, torch.cuda.Event)
        ran = []
        s.launch(ran.append, 1)
        ev.record()
        ev.synchronize()
        assert ran == [1]
        with pytest.raises(RuntimeError, match="says nothing about time"):
            ev.elapsed_time(s.Event())
        assert s.Event.__doc__ and pinlab.CudaStream.Event.__doc__
    assert torch.cuda.Event is before                # restored when the block ends


# --------------------------------------------------------------------------- on a GPU: both streams

@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_gpu_cuda_and_the_emulation_agree(name):
    fn, cuda_gives = SCENARIOS[name]
    with pinlab.CudaStream() as s:
        assert not s.emulated
        fn(s)        # warm-up: the first launch of a kernel loads its module and waits for the busy GPU
        live = fn(s)
    with LaggingStream() as s:
        emulated = fn(s)
    assert live == emulated == cuda_gives, (live, emulated)


# --------------------------------------------------------------------------- what CUDA refuses (issue 28)

def _on_the_stream_it_started_on(fn, s):
    """``fn(s)``, then the current CUDA stream put back: ``torch.cuda.graph``'s ``__exit__`` raises before it
    leaves its side stream when ending an invalidated capture fails."""
    if s.emulated:
        return fn(s)
    before = torch.cuda.current_stream()
    try:
        return fn(s)
    finally:
        torch.cuda.set_stream(before)
        torch.cuda.synchronize()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("planted", list(PLANTED))
def test_gpu_cuda_refuses_what_the_emulation_refuses(planted):
    """The twin of tests/test_streams.py's test_the_emulation_refuses_what_cuda_refuses: each planted call on
    the CUDA stream raises torch's exception, and the emulation (on this GPU host too) raises the same type."""
    fn, expected, text = PLANTED[planted]
    with pinlab.CudaStream() as s:
        with pytest.raises(Exception) as live:
            _on_the_stream_it_started_on(fn, s)
    assert refused_as_cuda_refuses(live.value, expected, text), (planted, repr(live.value),
                                                                   repr(live.value.__context__))
    with LaggingStream() as s:
        with pytest.raises(Exception) as emulated:
            fn(s)
    assert type(emulated.value) is type(live.value), (repr(emulated.value), repr(live.value))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("accepted", list(ACCEPTED))
def test_gpu_cuda_accepts_what_the_emulation_accepts(accepted):
    with pinlab.CudaStream() as s:
        _on_the_stream_it_started_on(ACCEPTED[accepted], s)
    with LaggingStream() as s:
        ACCEPTED[accepted](s)


@pytest.mark.gpu
@needs_cuda
def test_gpu_device_cpu_is_the_host_in_every_factory():
    with pinlab.CudaStream() as s:
        host, gpu = made_on_each_side(s)
        assert [k for k, t in host.items() if t.device.type != "cpu"] == []
        assert [k for k, t in gpu.items() if t.device.type != "cuda"] == []


# --------------------------------------------------------------------------- graphs on the emulated stream

def test_a_capture_refuses_waits_and_events_and_graph_api_is_restored():
    real = (torch.cuda.CUDAGraph, torch.cuda.graph, torch.cuda.is_current_stream_capturing)
    with LaggingStream() as s:
        d = torch.ones(4, device=s.device)
        pin = torch.zeros(4, pin_memory=True)
        g = torch.cuda.CUDAGraph()
        for body in (lambda: d.sum().item(), s.synchronize, lambda: d.copy_(pin)):  # a blocking copy waits
            with pytest.raises(torch.AcceleratorError) as exc, torch.cuda.graph(g):
                assert torch.cuda.is_current_stream_capturing()
                body()
            assert_refused_wait(exc.value)
            assert not torch.cuda.is_current_stream_capturing()
        with pytest.raises(RuntimeError, match="event recorded inside a graph"), torch.cuda.graph(g):
            s.Event().record()
        assert not torch.cuda.is_current_stream_capturing()
        with pytest.raises(RuntimeError, match="never captured"):
            torch.cuda.CUDAGraph().replay()
        with pytest.raises(TypeError, match="CUDAGraph"):
            with torch.cuda.graph(object()):
                pass
    assert (torch.cuda.CUDAGraph, torch.cuda.graph, torch.cuda.is_current_stream_capturing) == real


def test_a_captured_graph_replays_in_stream_order_and_only_when_the_gpu_runs():
    with LaggingStream() as s:
        pin = torch.zeros(2, dtype=torch.int64, pin_memory=True)
        acc = torch.zeros(2, dtype=torch.int64, device=s.device)
        static = torch.zeros(2, dtype=torch.int64, device=s.device)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            static.copy_(pin, non_blocking=True)
            acc.add_(static)
        assert s.pending() == 0  # captured, not queued
        for n in range(1, 4):
            pin.fill_(n)
            g.replay()
            ev = s.Event()
            ev.record()
            ev.synchronize()     # a wait after each replay: every replay reads its own step's data
        assert acc.tolist() == [6, 6]
        for n in range(1, 4):    # no wait: every replay reads the last write
            pin.fill_(n)
            g.replay()
        assert s.pending() == 6
        s.synchronize()
        assert acc.tolist() == [6 + 9, 6 + 9]


@pytest.mark.parametrize("racy, expect_corrupted", [(True, True), (False, False)])
def test_the_graph_regression_test_fails_the_racy_step_and_passes_the_fix(racy, expect_corrupted):
    """The regression test the PR lacked (issue 21), on the emulated stream, 10 runs each: the racy variant
    (a captured copy from the reused pinned buffer) fails every time, the snapshot outside the graph never."""
    for _ in range(10):
        with LaggingStream() as s:
            seen = (graph_replay_reads_the_pinned_buffer_when_it_runs(s)["seen"] if racy
                    else graph_with_snapshot_outside(s))
        corrupted = sum(v != n for n, v in enumerate(seen))
        assert (corrupted > 0) == expect_corrupted, seen


def test_ops_making_new_device_tensors_are_recomputed_at_every_replay():
    with LaggingStream() as s:
        ids = torch.zeros(4, dtype=torch.int64, device=s.device)
        out = torch.zeros(4, dtype=torch.int64, device=s.device)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            pos = torch.arange(4, device=ids.device)
            y = ids * 2 + pos                   # new device tensors: allocated now, recomputed at replay
            torch.clamp(y, max=10, out=out)
        for case in ([1, 2, 3, 4], [5, 0, 5, 0]):
            ids.copy_(torch.tensor(case))
            g.replay()
            s.synchronize()
            assert out.tolist() == [min(v * 2 + i, 10) for i, v in enumerate(case)]
        for body in (lambda: ids.nonzero(), lambda: bool(ids.sum() > 0), lambda: int(ids[0])):
            with pytest.raises(torch.AcceleratorError) as exc, torch.cuda.graph(torch.cuda.CUDAGraph()):
                body()
            assert_refused_wait(exc.value)
