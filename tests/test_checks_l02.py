"""Lesson 02's exercise checkers accept the master solution and reject planted wrong answers."""
import random

import pytest

import make_exercises
import nbtools
from nbtools import solution_namespace
from pinlab import profiler
from pinlab.checks import l02 as checks02
from pinlab.lessons import l02_fake_non_blocking as stalls

ROOT = nbtools.ROOT
STEM = "02_fake_non_blocking"


@pytest.fixture(scope="module")
def sol():
    return solution_namespace(STEM)


# ---- stall_threshold ----------------------------------------------------------------------------

def test_stall_threshold_accepts_solution(sol, capsys):
    assert checks02.check_stall_threshold.verdict(sol["stall_threshold"]) is True
    assert "✅ stall_threshold is correct" in capsys.readouterr().out


def _first_exceeding(sizes, host_ms, busy_ms):
    return min((s for s, m in zip(sizes, host_ms) if m > busy_ms / 2), default=None)


def _at_least_half(sizes, host_ms, busy_ms):
    t = None
    for s, m in sorted(zip(sizes, host_ms), reverse=True):
        if m < busy_ms / 2:
            break
        t = s
    return t


def _whole_busy_time(sizes, host_ms, busy_ms):
    t = None
    for s, m in sorted(zip(sizes, host_ms), reverse=True):
        if m <= busy_ms:
            break
        t = s
    return t


def _list_order(sizes, host_ms, busy_ms):
    t = None
    for s, m in reversed(list(zip(sizes, host_ms))):  # assumes the sizes come sorted
        if m <= busy_ms / 2:
            break
        t = s
    return t


def _largest_quick(sizes, host_ms, busy_ms):
    return max((s for s, m in zip(sizes, host_ms) if m <= busy_ms / 2), default=None)


def _top_only(sizes, host_ms, busy_ms):  # only asks whether the largest size waited
    top = max(sizes)
    return top if host_ms[sizes.index(top)] > busy_ms / 2 else None


@pytest.mark.parametrize("wrong", [_first_exceeding, _at_least_half, _whole_busy_time, _list_order, _largest_quick,
                                   _top_only], ids=lambda f: f.__name__)
def test_stall_threshold_rejects_wrong(wrong, capsys):
    assert checks02.check_stall_threshold.verdict(wrong) is False
    assert "❌ stall_threshold" in capsys.readouterr().out


def test_stall_reference_is_the_library_function():
    assert checks02.first_waiting_size is stalls.first_waiting_size
    for sizes, host_ms, busy in checks02.stall_cases():
        assert checks02.stall_threshold_reference(sizes, host_ms, busy) == stalls.first_waiting_size(
            sizes, host_ms, busy / 2)


def test_stall_cases_hold_the_decision_boundary():
    """Exactly half the busy time is not waiting: the cases contain it, at the top and below."""
    at_half = [(s, m, b) for s, m, b in checks02.stall_cases() if any(x == b / 2 for x in m)]
    assert len(at_half) >= 2
    assert checks02.stall_threshold_reference([1, 2], [0.1, 10.0], 20.0) is None
    assert checks02.stall_threshold_reference([1, 2, 4], [0.1, 5.0, 10.5], 10.0) == 4


# ---- gpu_idle_share -----------------------------------------------------------------------------

def test_gpu_idle_share_accepts_solution(sol, capsys):
    assert checks02.check_gpu_idle_share.verdict(sol["gpu_idle_share"]) is True
    assert "✅ gpu_idle_share is correct" in capsys.readouterr().out


def _sum_durations(spans, start, end):  # overlaps counted twice, nothing clipped
    return 1 - sum(b - a for a, b in spans) / (end - start)


def _no_clip(spans, start, end):  # a proper union, but not clipped to the window
    merged = profiler.merge_spans(spans)
    return 1 - sum(b - a for a, b in merged) / (end - start)


def _busy_share(spans, start, end):
    return 1 - profiler.idle_share(spans, start, end)


def _extent_window(spans, start, end):  # divides by the spans' extent, not the window
    if not spans:
        return 1.0
    lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
    return 1 - profiler.covered(spans, lo, hi) / (hi - lo) if hi > lo else 1.0


def _clip_sum(spans, start, end):  # clipped, but overlaps counted twice
    return 1 - sum(max(0.0, min(b, end) - max(a, start)) for a, b in spans) / (end - start)


def _touching_dropped(spans, start, end):  # merges with > and <, forgets == : a touching span is lost
    busy, cur = 0.0, None
    for a, b in sorted((max(a, start), min(b, end)) for a, b in spans):
        if b <= a:
            continue
        if cur is None or a > cur[1]:
            if cur is not None:
                busy += cur[1] - cur[0]
            cur = [a, b]
        elif a < cur[1]:
            cur[1] = max(cur[1], b)
    if cur is not None:
        busy += cur[1] - cur[0]
    return 1.0 - busy / (end - start)


def _touching_double(spans, start, end):  # a span touching the last one restarts the union, recounting it
    busy, cur = 0.0, None
    for a, b in sorted((max(a, start), min(b, end)) for a, b in spans):
        if b <= a:
            continue
        if cur is not None and a < cur[1]:
            cur[1] = max(cur[1], b)
            continue
        if cur is not None:
            busy += cur[1] - cur[0] + (cur[1] - cur[0] if a == cur[1] else 0.0)
        cur = [a, b]
    if cur is not None:
        busy += cur[1] - cur[0]
    return 1.0 - busy / (end - start)


@pytest.mark.parametrize("wrong", [_sum_durations, _no_clip, _busy_share, _extent_window, _clip_sum,
                                   _touching_dropped, _touching_double], ids=lambda f: f.__name__)
def test_gpu_idle_share_rejects_wrong(wrong, capsys):
    assert checks02.check_gpu_idle_share.verdict(wrong) is False
    assert "❌ gpu_idle_share" in capsys.readouterr().out


def test_idle_reference_is_the_library_function():
    assert checks02.idle_share is profiler.idle_share


def test_idle_cases_hold_touching_spans():
    touching = [c for c in checks02.idle_cases() if _touching_dropped(*c) != pytest.approx(profiler.idle_share(*c))]
    assert len(touching) >= 3  # the near miss fails on several cases, not on one by luck
    assert profiler.idle_share([(1.0, 2.0), (2.0, 3.0)], 0.0, 4.0) == pytest.approx(0.5)


def test_idle_reference_random_unions():
    rng = random.Random(7)
    for _ in range(200):  # brute force on a fine grid of integer spans
        spans = [(a, a + rng.randint(0, 5)) for a in (rng.randint(-3, 12) for _ in range(rng.randint(0, 6)))]
        covered = sum(any(a <= t < b for a, b in spans) for t in range(0, 10))
        assert profiler.idle_share(spans, 0, 10) == pytest.approx(1 - covered / 10)


# ---- the verdicts and the generated exercise ------------------------------------------------------

@pytest.mark.parametrize("check", [checks02.check_stall_threshold.verdict, checks02.check_gpu_idle_share.verdict])
def test_stub_is_reported_as_not_implemented(check, capsys):
    def stub(*args):
        raise NotImplementedError

    assert check(stub) is False
    assert "is not implemented yet" in capsys.readouterr().out


@pytest.mark.parametrize("check", [checks02.check_stall_threshold.verdict, checks02.check_gpu_idle_share.verdict])
def test_crash_is_reported_not_raised(check, capsys):
    assert check(lambda *a: 1 / 0) is False
    assert "raised ZeroDivisionError" in capsys.readouterr().out


# ---- step_without_syncs (torch code) -------------------------------------------------------------
# Planted wrong answers, each with the words the checker must say: on the watched lagging stream
# (CPU) and on CUDA behind a busy GPU (the gpu tests). `.dev/probes` may import these too.

import torch  # noqa: E402

from pinlab.checks import l02  # noqa: E402


def _fixed_out(s, scores):
    out = torch.empty(scores.shape, dtype=scores.dtype, pin_memory=True)
    out.copy_(scores, non_blocking=True)
    done = s.Event()
    done.record()
    return out, done


def step_original(s, x_host, w):  # all three syncs
    x = x_host.to(s.device, non_blocking=True)
    scale = x.abs().max().item()
    return ((x / scale) @ w).cpu(), None


def step_item(s, x_host, w):  # pinned staging and a pinned D2H, but .item()
    x = x_host.pin_memory().to(s.device, non_blocking=True)
    return _fixed_out(s, (x / x.abs().max().item()) @ w)


def step_python_if(s, x_host, w):  # the scale stays on the GPU, then an `if` reads it
    x = x_host.pin_memory().to(s.device, non_blocking=True)
    scale = x.abs().max()
    if scale > 0:
        x = x / scale
    return _fixed_out(s, x @ w)


def step_blocking_cpu(s, x_host, w):  # the result comes back with a blocking .cpu()
    x = x_host.pin_memory().to(s.device, non_blocking=True)
    return ((x / x.abs().max()) @ w).cpu(), None


def step_pin_above_4mib(s, x_host, w):  # near the boundary: stages only large inputs, 2.5 MiB still waits
    src = x_host.pin_memory() if x_host.numel() * x_host.element_size() > (4 << 20) else x_host
    x = src.to(s.device, non_blocking=True)
    return _fixed_out(s, (x / x.abs().max()) @ w)


def step_pin_above_2mib(s, x_host, w):  # trusts the driver's staging for the 1 MiB input
    src = x_host.pin_memory() if x_host.numel() * x_host.element_size() > (2 << 20) else x_host
    x = src.to(s.device, non_blocking=True)
    return _fixed_out(s, (x / x.abs().max()) @ w)


def step_no_event(s, x_host, w):  # an asynchronous D2H, but nothing says when it has landed
    x = x_host.pin_memory().to(s.device, non_blocking=True)
    return ((x / x.abs().max()) @ w).to("cpu", non_blocking=True), None


def step_event_first(s, x_host, w):  # the event is recorded before the copy it should guard
    x = x_host.pin_memory().to(s.device, non_blocking=True)
    scores = (x / x.abs().max()) @ w
    done = s.Event()
    done.record()
    out = torch.empty(scores.shape, dtype=scores.dtype, pin_memory=True)
    out.copy_(scores, non_blocking=True)
    return out, done


def step_blocking_h2d(s, x_host, w):  # pinned, but a blocking copy
    x = x_host.pin_memory().to(s.device)
    return _fixed_out(s, (x / x.abs().max()) @ w)


def step_no_scale(s, x_host, w):  # no sync at all, and the wrong numbers
    x = x_host.pin_memory().to(s.device, non_blocking=True)
    return _fixed_out(s, x @ w)


def step_result_on_gpu(s, x_host, w):
    x = x_host.pin_memory().to(s.device, non_blocking=True)
    done = s.Event()
    done.record()
    return (x / x.abs().max()) @ w, done


def step_polls_its_event(s, x_host, w):  # issue 28: all right, then polls its own event before returning
    x = x_host.pin_memory().to(s.device, non_blocking=True)
    out, done = _fixed_out(s, (x / x.abs().max()) @ w)
    while not done.query():  # a host wait, as done.synchronize() is
        pass
    return out, done


def step_syncs_its_event(s, x_host, w):  # the same step with done.synchronize(): the same diagnosis
    x = x_host.pin_memory().to(s.device, non_blocking=True)
    out, done = _fixed_out(s, (x / x.abs().max()) @ w)
    done.synchronize()
    return out, done


#: name -> (wrong step, words on the lagging stream, words on CUDA)
WRONG_STEPS = {
    "original": (step_original, "non_blocking copy from pageable memory (8 MiB)", "pageable memory (8 MiB)"),
    "item": (step_item, ".item() reads a GPU value into Python", ".item() reads a GPU value into Python"),
    "python-if": (step_python_if, "Python `if`", "Python `if`"),
    "blocking-cpu": (step_blocking_cpu, "a blocking copy from the GPU to the host", "blocking copy"),
    "pin-above-4mib": (step_pin_above_4mib, "pageable memory (2.5 MiB) waited for the GPU", "pageable memory (2.5 MiB)"),
    "pin-above-2mib": (step_pin_above_2mib, "pageable memory (1 MiB) with the 1 MiB input", "pageable memory (1 MiB)"),
    "no-event": (step_no_event, "no event", "no event"),
    "event-first": (step_event_first, "recorded before the copy into the result", "recorded before the copy"),
    "blocking-h2d": (step_blocking_h2d, "a blocking copy to the GPU (8 MiB", "blocking copy"),
    "no-scale": (step_no_scale, "differs from the reference", "differs from the reference"),
    "result-on-gpu": (step_result_on_gpu, "still on the GPU", "still on the GPU"),
    "polls-its-event": (step_polls_its_event, "(1 wait on the emulated lagging GPU): a loop polling `event.query()`",
                        "Return the event instead of waiting on it"),
    "syncs-its-event": (step_syncs_its_event, "`event.synchronize()` waited for work still queued, at "
                        "`done.synchronize()`. Return the event instead of waiting on it",
                        "Return the event instead of waiting on it"),
}


@pytest.fixture
def on_cpu(monkeypatch):
    """Force the emulated path (the lagging stream) even on a machine with a GPU."""
    monkeypatch.setenv("PINLAB_FORCE_CPU", "1")
    l02.reset()


def test_step_without_syncs_accepts_solution(sol, on_cpu, capsys):
    assert checks02.check_step_without_syncs.verdict(sol["step_without_syncs"]) is True
    out = capsys.readouterr().out
    assert "✅ step_without_syncs is correct" in out and "emulated lagging stream" in out


def test_step_with_syncs_of_the_notebook_is_rejected(sol, on_cpu, capsys):
    """The notebook's own slow step: the checker names its first sync, and counts all three."""
    assert checks02.check_step_without_syncs.verdict(sol["step_with_syncs"]) is False
    out = capsys.readouterr().out
    assert "pageable memory (8 MiB)" in out and "(3 waits" in out, out


@pytest.mark.parametrize("case", list(WRONG_STEPS))
def test_step_without_syncs_rejects_wrong(case, on_cpu, capsys):
    wrong, words, _ = WRONG_STEPS[case]
    assert checks02.check_step_without_syncs.verdict(wrong) is False
    out = capsys.readouterr().out
    assert "❌ step_without_syncs" in out and words in out, out
    assert "💡 Hint" not in out


def test_step_without_syncs_hints_on_the_second_failure(on_cpu, capsys):
    assert checks02.check_step_without_syncs.verdict(step_item) is False
    assert checks02.check_step_without_syncs.verdict(step_item) is False
    out = capsys.readouterr().out
    assert out.count("❌") == 2 and out.count("💡 Hint") == 1
    assert "pin_memory()" in out.split("💡 Hint")[1]


def test_step_without_syncs_says_where(on_cpu, capsys):
    """The verdict quotes the line of the learner's code that waited."""
    assert checks02.check_step_without_syncs.verdict(step_item) is False
    assert "`return _fixed_out(s, (x / x.abs().max().item()) @ w)`" in capsys.readouterr().out


def test_step_without_syncs_stub_and_crash(on_cpu, capsys):
    def stub(s, x_host, w):
        raise NotImplementedError

    assert checks02.check_step_without_syncs.verdict(stub) is False
    assert "⏳ step_without_syncs is not implemented yet" in capsys.readouterr().out
    assert checks02.check_step_without_syncs.verdict(lambda s, x, w: 1 / 0) is False
    assert "raised ZeroDivisionError" in capsys.readouterr().out


def test_watched_lagging_queues_arithmetic_and_counts_waits():
    """Device arithmetic is queued like kernel launches (no wait); reading a value waits, once."""
    s = l02.WatchedLagging()
    with s, l02.Watch(s):
        x = torch.ones(4, device=s.device)
        y = (x * 2).sum()          # queued: no wait
        s.counting = True
        assert s.pending() >= 2 and s.waits == []
        assert y.item() == 8.0     # waits for the queue
        assert len(s.waits) == 1 and ".item()" in s.waits[0][1]
        done = s.Event()
        done.record()
        done.synchronize()         # nothing queued before it: no wait
        assert len(s.waits) == 1
        s.counting = False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_step_without_syncs_accepts_solution(sol, capsys):
    l02.reset()
    assert checks02.check_step_without_syncs.verdict(sol["step_without_syncs"]) is True
    assert "CUDA stream" in capsys.readouterr().out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", list(WRONG_STEPS))
def test_gpu_step_without_syncs_rejects_wrong(case, capsys):
    l02.reset()
    wrong, _, words = WRONG_STEPS[case]
    assert checks02.check_step_without_syncs.verdict(wrong) is False
    out = capsys.readouterr().out
    assert "❌ step_without_syncs" in out and words in out, out


def test_watched_lagging_waits_only_where_a_gpu_would():
    """Ops with several outputs and gathers are queued; a boolean mask (size depends on the data) waits."""
    s = l02.WatchedLagging()
    with s, l02.Watch(s):
        x = torch.arange(12, dtype=torch.float32, device=s.device).reshape(3, 4)
        index = torch.tensor([2, 0], device=s.device)  # (a blocking copy from a list: before the count)
        s.counting = True
        values, indices = x.max(dim=1)
        top = torch.topk(x, 2, dim=1)
        rows = x[index]
        assert s.waits == []
        picked = x[x > 5]
        assert len(s.waits) == 1 and "boolean mask" in s.waits[0][1]
        s.counting = False
        assert values.tolist() == [3.0, 7.0, 11.0] and indices.tolist() == [3, 3, 3]
        assert top.values.tolist() == [[3.0, 2.0], [7.0, 6.0], [11.0, 10.0]]
        assert rows.tolist() == [[8.0, 9.0, 10.0, 11.0], [0.0, 1.0, 2.0, 3.0]]
        assert picked.tolist() == [6.0, 7.0, 8.0, 9.0, 10.0, 11.0]


def test_host_tensor_in_device_arithmetic_fails_as_on_cuda(on_cpu, capsys):
    def step_on_the_host(s, x_host, w):  # forgets to copy x: host and GPU tensors in one op
        scores = (x_host / x_host.abs().max()) @ w
        return _fixed_out(s, scores)

    assert checks02.check_step_without_syncs.verdict(step_on_the_host) is False
    assert "raised RuntimeError: Expected all tensors to be on the same device" in capsys.readouterr().out


def test_polling_and_synchronizing_the_event_get_the_same_advice(on_cpu, capsys):
    """Issue 28: `while not done.query(): pass` is a host wait (it was accepted), and it is told what
    `done.synchronize()` is told: return the event instead."""
    assert checks02.check_step_without_syncs.verdict(step_polls_its_event) is False
    polled = capsys.readouterr().out
    assert checks02.check_step_without_syncs.verdict(step_syncs_its_event) is False
    synced = capsys.readouterr().out
    advice = "Return the event instead of waiting on it: the caller waits when it needs the scores"
    assert advice in polled and advice in synced, (polled, synced)
    assert "`while not done.query():" in polled and "`done.synchronize()`" in synced


def test_the_verdict_counts_every_wait_exactly(on_cpu, capsys):
    """The emulated verdict counts the host's waits from LaggingStream.host_waits: two polled events, two waits."""
    def step_polls_twice(s, x_host, w):
        x = x_host.pin_memory().to(s.device, non_blocking=True)
        mid = s.Event()
        mid.record()
        while not mid.query():
            pass
        scores = (x / x.abs().max()) @ w
        out, done = _fixed_out(s, scores)
        while not done.query():
            pass
        return out, done

    assert checks02.check_step_without_syncs.verdict(step_polls_twice) is False
    assert "(2 waits on the emulated lagging GPU)" in capsys.readouterr().out


def test_the_accepted_verdict_says_what_was_checked_on_the_emulation(sol, on_cpu, capsys):
    assert checks02.check_step_without_syncs.verdict(sol["step_without_syncs"]) is True
    out = capsys.readouterr().out
    flat = " ".join(out.split())  # wrapped lines read as one
    assert "[measured] how the host's waits were seen: 0 waits, every one counted on the emulated stream" in flat, out
    # the verdict reads the same on a GPU: how the waits were seen is the [measured] line above, masked by nbval
    assert "✅ step_without_syncs is correct (3 inputs: the host never waited for the GPU; every copy" in flat, out
