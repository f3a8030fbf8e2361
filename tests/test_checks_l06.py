"""Lesson 06's exercise checkers accept the master solution and reject planted wrong answers, each
with the message that names its mistake; the hint appears on the second failure."""
import pytest
import torch

import make_exercises
import nbtools
from nbtools import solution_namespace
from pinlab.checks import l06 as checks06
from pinlab.lessons import l06_device_side_indices as l06

ROOT = nbtools.ROOT
STEM = "06_device_side_indices"


@pytest.fixture(scope="module")
def sol():
    return solution_namespace(STEM)


@pytest.fixture(autouse=True)
def _fresh_hints():
    checks06.reset_hints()
    yield
    checks06.reset_hints()


# ---- exercise 1: rot_pos_ids ------------------------------------------------------------------------

def test_rot_pos_ids_accepts_solution(sol, capsys):
    assert checks06.check_rot_pos_ids.verdict(sol["rot_pos_ids"]) is True
    out = capsys.readouterr().out
    assert "✅ rot_pos_ids is correct" in out and "emulated lagging stream" in out


def _table(grid_thw, m, device, *, pinned=True, non_blocking=True):
    counts = [t * h * w for t, h, w in grid_thw]
    starts = [sum(counts[:i]) for i in range(len(counts))]
    rows = [[c, s, h * w, w // m] for c, s, (_, h, w) in zip(counts, starts, grid_thw)]
    host = torch.tensor(rows, dtype=torch.int64)
    if pinned:
        host = host.pin_memory()
    return host.to(device, non_blocking=non_blocking), sum(counts)


def _closed_form(table, total, m, device, *, output_size=True, swap=False, as_float=False):
    kw = {"output_size": total} if output_size else {}
    per_token = torch.repeat_interleave(table[:, 1:], table[:, 0], dim=0, **kw)
    start, frame, bpr = per_token.unbind(1)
    k = (torch.arange(total, device=device) - start) % frame
    if as_float:
        b, r = torch.div(k, m * m).floor(), k % (m * m)
        row, col = torch.div(b, bpr).floor() * m + torch.div(r, m).floor(), (b % bpr) * m + r % m
    else:
        b, r = k // (m * m), k % (m * m)
        row, col = (b // bpr) * m + r // m, (b % bpr) * m + r % m
    return torch.stack([col, row] if swap else [row, col], dim=-1)


def per_image_loop(grid_thw, m, device):  # the PR's (b): right ids, one launch chain per image
    return l06.ids_per_image(grid_thw, m, device)


def cpu_then_pageable(grid_thw, m, device):  # (a): built on the host, pageable non_blocking copy
    return l06.ids_before(grid_thw, m, "cpu").to(device, non_blocking=True)


def no_output_size(grid_thw, m, device):  # repeat_interleave reads the total back: a sync
    table, total = _table(grid_thw, m, device)
    return _closed_form(table, total, m, device, output_size=False)


def pageable_table(grid_thw, m, device):  # the table copy is non_blocking from pageable memory
    table, total = _table(grid_thw, m, device, pinned=False)
    return _closed_form(table, total, m, device)


def blocking_table(grid_thw, m, device):  # torch.tensor(list, device=...): a blocking copy
    counts = [t * h * w for t, h, w in grid_thw]
    starts = [sum(counts[:i]) for i in range(len(counts))]
    table = torch.tensor([[c, s, h * w, w // m] for c, s, (_, h, w) in zip(counts, starts, grid_thw)],
                         dtype=torch.int64, device=device)
    return _closed_form(table, sum(counts), m, device)


def swapped(grid_thw, m, device):  # (col, row) instead of (row, col)
    table, total = _table(grid_thw, m, device)
    return _closed_form(table, total, m, device, swap=True)


def float_ids(grid_thw, m, device):  # true division: float ids
    table, total = _table(grid_thw, m, device)
    return _closed_form(table, total, m, device, as_float=True)


def row_major(grid_thw, m, device):  # forgets the merge blocks: plain row-major order
    table, total = _table(grid_thw, 1, device)
    return _closed_form(table, total, 1, device)


def one_frame(grid_thw, m, device):  # forgets to repeat over t
    table, total = _table([[1, h, w] for _, h, w in grid_thw], m, device)
    return _closed_form(table, total, m, device)


def host_only(grid_thw, m, device):  # right values, built on the host, never put on the device
    table = torch.tensor([[t * h * w, sum(a * b * c for a, b, c in grid_thw[:i]), h * w, w // m]
                          for i, (t, h, w) in enumerate(grid_thw)], dtype=torch.int64)
    total = int(table[:, 0].sum())
    per_token = torch.repeat_interleave(table[:, 1:], table[:, 0], dim=0, output_size=total)
    start, frame, bpr = per_token.unbind(1)
    k = (torch.arange(total) - start) % frame
    b, r = k // (m * m), k % (m * m)
    return torch.stack([(b // bpr) * m + r // m, (b % bpr) * m + r % m], dim=-1)


def _rows(grid_thw, m):
    counts = [t * h * w for t, h, w in grid_thw]
    starts = [sum(counts[:i]) for i in range(len(counts))]
    return [[c, s, h * w, w // m] for c, s, (_, h, w) in zip(counts, starts, grid_thw)], sum(counts)


def table_never_copied(grid_thw, m, device):  # issue 28: the table stays on the host, the arange is on the device
    rows, total = _rows(grid_thw, m)
    table = torch.tensor(rows, dtype=torch.int64)
    per_token = torch.repeat_interleave(table[:, 1:], table[:, 0], dim=0, output_size=total)
    start, frame, bpr = per_token.unbind(1)
    k = (torch.arange(total, device=device) - start) % frame  # a GPU refuses: device minus host tensor
    b, r = k // (m * m), k % (m * m)
    return torch.stack([(b // bpr) * m + r // m, (b % bpr) * m + r % m], dim=-1)


def host_ids_copied_once(grid_thw, m, device):  # issue 28: (a) on the host, then one pinned non_blocking copy
    return l06.ids_before(grid_thw, m, "cpu").pin_memory().to(device, non_blocking=True)


def per_token_table_copied(grid_thw, m, device):  # a table with one row per token, copied once
    rows, total = _rows(grid_thw, m)
    table = torch.tensor(rows, dtype=torch.int64)
    per_token = torch.repeat_interleave(table[:, 1:], table[:, 0], dim=0, output_size=total)
    per_token = per_token.pin_memory().to(device, non_blocking=True)
    start, frame, bpr = per_token.unbind(1)
    k = (torch.arange(total, device=device) - start) % frame
    b, r = k // (m * m), k % (m * m)
    return torch.stack([(b // bpr) * m + r // m, (b % bpr) * m + r % m], dim=-1)


def default_device_switch(grid_thw, m, device):  # issue 28: torch.set_default_device, set back at the end
    torch.set_default_device(device)
    try:
        table, total = _table(grid_thw, m, device)
        return _closed_form(table, total, m, device)
    finally:
        torch.set_default_device(None)


def default_device_left_set(grid_thw, m, device):  # ... and never set back: the checker must say so
    torch.set_default_device(device)
    table, total = _table(grid_thw, m, device)
    return _closed_form(table, total, m, device)


@pytest.mark.parametrize("wrong, message", [
    (table_never_copied, "that was never copied to the device"),
    (host_ids_copied_once, "the copy grows with the tokens"),
    (per_token_table_copied, "the copy grows with the tokens"),
    (default_device_switch, "set torch's default device (torch.set_default_device(cpu))"),
    (default_device_left_set, "changed torch's default device"),
    (per_image_loop, "the calls grow with the images"),
    (cpu_then_pageable, "non_blocking from pageable memory"),
    (no_output_size, "repeat_interleave without output_size"),
    (pageable_table, "non_blocking from pageable memory"),
    (blocking_table, "a blocking copy"),
    (swapped, "(column, row) pairs"),
    (float_ids, "use // (floor division)"),
    (row_major, "block by block"),
    (one_frame, "repeat over t"),
    (host_only, "the ids are host memory"),
], ids=lambda v: getattr(v, "__name__", "msg"))
def test_rot_pos_ids_rejects_wrong(wrong, message, capsys):
    assert checks06.check_rot_pos_ids.verdict(wrong) is False
    out = capsys.readouterr().out
    assert "❌" in out and message in out, out
    assert "💡 Hint" not in out


def copy_positional_non_blocking(grid_thw, m, device):  # issue 28: copy_(src, True) is non_blocking
    rows, total = _rows(grid_thw, m)
    host = torch.tensor(rows, dtype=torch.int64).pin_memory()
    table = torch.empty(host.shape, dtype=host.dtype, device=device)
    table.copy_(host, True)
    return _closed_form(table, total, m, device)


def to_positional_non_blocking(grid_thw, m, device):  # to(device, dtype, True) is non_blocking too
    rows, total = _rows(grid_thw, m)
    table = torch.tensor(rows, dtype=torch.int32).pin_memory().to(device, torch.int64, True)
    return _closed_form(table, total, m, device)


def explicit_cpu_table(grid_thw, m, device):  # issue 28: device="cpu" is the host, also on the emulated stream
    rows, total = _rows(grid_thw, m)
    table = torch.tensor(rows, dtype=torch.int64, device="cpu").pin_memory().to(device, non_blocking=True)
    return _closed_form(table, total, m, device)


def explicit_cpu_pinned_buffer(grid_thw, m, device):  # a pinned buffer made with device="cpu", filled, copied
    rows, total = _rows(grid_thw, m)
    host = torch.empty(len(rows), 4, dtype=torch.int64, device=torch.device("cpu"), pin_memory=True)
    host.copy_(torch.tensor(rows, dtype=torch.int64))
    return _closed_form(host.to(device, non_blocking=True), total, m, device)


@pytest.mark.parametrize("right", [copy_positional_non_blocking, to_positional_non_blocking, explicit_cpu_table,
                                   explicit_cpu_pinned_buffer], ids=lambda f: f.__name__)
def test_rot_pos_ids_accepts_near_boundary_answers(right, capsys):
    assert checks06.check_rot_pos_ids.verdict(right) is True, capsys.readouterr().out


def test_rot_pos_ids_leaves_the_default_device_as_it_was(capsys):
    checks06.check_rot_pos_ids.verdict(default_device_left_set)
    assert getattr(torch, "_GLOBAL_DEVICE_CONTEXT").device_context is None
    assert torch.empty(1).device.type == "cpu"


def test_rot_pos_ids_hint_on_second_failure(capsys):
    assert checks06.check_rot_pos_ids.verdict(per_image_loop) is False
    assert "💡 Hint" not in capsys.readouterr().out
    assert checks06.check_rot_pos_ids.verdict(per_image_loop) is False
    out = capsys.readouterr().out
    assert "💡 Hint" in out and "output_size" in out


def test_rot_pos_cases_cover_videos_and_merge_sizes():
    cases = checks06.rot_pos_cases()
    assert any(any(t > 1 for t, _, _ in g) for g, _ in cases)
    assert {m for _, m in cases} >= {1, 2, 4}
    assert any(len(g) > 4 for g, _ in cases)


# ---- exercise 2: start_d2h / finish_d2h -------------------------------------------------------------

def test_d2h_accepts_solution(sol, capsys):
    assert checks06.check_d2h_outputs.verdict(sol["start_d2h"], sol["finish_d2h"]) is True
    assert "✅ d2h_outputs is correct" in capsys.readouterr().out


def _start_ok(s, out):
    host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
    host.copy_(out, non_blocking=True)
    ev = s.Event()
    ev.record()
    return host, ev


def _finish_ok(host, ev):
    ev.synchronize()
    return host.tolist()


def _finish_early(host, ev):  # reads before the event
    return host.tolist()


def _start_pageable(s, out):  # pageable host buffer: the D2H copy waits
    host = torch.empty(out.shape, dtype=out.dtype)
    host.copy_(out, non_blocking=True)
    ev = s.Event()
    ev.record()
    return host, ev


def _start_cpu_then_pin(s, out):  # .cpu() waits for the GPU, then pins
    host = out.cpu().pin_memory()
    ev = s.Event()
    ev.record()
    return host, ev


_SHARED = {}


def _start_reused(s, out):  # one pinned buffer for every step
    key = (id(s), tuple(out.shape))
    if key not in _SHARED:
        _SHARED.clear()
        _SHARED[key] = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
    host = _SHARED[key]
    host.copy_(out, non_blocking=True)
    ev = s.Event()
    ev.record()
    return host, ev


def _finish_stream_sync(host, ev, _streams=[]):  # noqa: B006 - waits for everything
    ev.synchronize()
    _streams[-1].synchronize()
    return host.tolist()


def _start_remember_stream(s, out):
    _finish_stream_sync.__defaults__[0][:] = [s]
    return _start_ok(s, out)


def _start_event_first(s, out):  # the event recorded before the copy: it marks the work before it
    host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
    ev = s.Event()
    ev.record()
    host.copy_(out, non_blocking=True)
    return host, ev


def _start_cpu(s, out):  # a blocking copy into pageable memory
    ev = s.Event()
    ev.record()
    return out.cpu(), ev


def _start_pinned_like(s, out):  # issue 28: pinned memory on the GPU (empty_like keeps out's device)
    host = torch.empty_like(out, pin_memory=True)
    host.copy_(out, non_blocking=True)
    ev = s.Event()
    ev.record()
    return host, ev


def _start_pageable_device_cpu(s, out):  # pageable host memory named device="cpu": host memory, as on a GPU
    host = torch.empty(out.shape, dtype=out.dtype, device="cpu")
    host.copy_(out, non_blocking=True)
    ev = s.Event()
    ev.record()
    return host, ev


def _start_pinned_device_cpu(s, out):  # right: pinned host memory, device="cpu" said explicitly
    host = torch.empty_like(out, device="cpu", pin_memory=True)
    host.copy_(out, non_blocking=True)
    ev = s.Event()
    ev.record()
    return host, ev


def test_d2h_pinned_memory_on_the_gpu_is_rejected_and_device_cpu_is_the_host(capsys):
    assert checks06.check_d2h_outputs.verdict(_start_pinned_like, _finish_ok) is False
    out = capsys.readouterr().out
    assert "asked for pinned memory on the GPU" in out and "Only dense CPU tensors can be pinned" in out, out
    assert checks06.check_d2h_outputs.verdict(_start_pageable_device_cpu, _finish_ok) is False
    out = capsys.readouterr().out
    assert "host buffer is pageable memory" in out and "on the device" not in out, out
    assert checks06.check_d2h_outputs.verdict(_start_pinned_device_cpu, _finish_ok) is True, capsys.readouterr().out


def test_d2h_event_recorded_before_the_copy_is_named(capsys):
    """Issue "self-paced path", part 3: finish_d2h waited for the event, so "call event.synchronize()
    first" named the wrong cause."""
    assert checks06.check_d2h_outputs.verdict(_start_event_first, _finish_ok) is False
    out = capsys.readouterr().out
    assert "the event was recorded before the copy was queued" in out, out
    assert "call event.synchronize() first" not in out, out
    assert checks06.check_d2h_outputs.verdict(_start_ok, _finish_early) is False   # no wait at all: the old advice
    out = capsys.readouterr().out
    assert "call event.synchronize() first" in out and "recorded before the copy" not in out, out


def test_d2h_blocking_cpu_copy_is_not_called_a_non_blocking_one(capsys):
    assert checks06.check_d2h_outputs.verdict(_start_cpu, _finish_ok) is False
    out = capsys.readouterr().out
    assert "host buffer is pageable memory (`.cpu()`" in out and "non_blocking or not" in out, out


@pytest.mark.parametrize("start, finish, message", [
    (_start_ok, _finish_early, "before its copy had run"),
    (_start_pageable, _finish_ok, "host buffer is pageable"),
    (_start_cpu_then_pin, _finish_ok, "start_d2h waited for the GPU"),
    (_start_reused, _finish_ok, "reused step"),
    (_start_remember_stream, _finish_stream_sync, "waited for the whole stream"),
], ids=["early_read", "pageable", "cpu_then_pin", "reused_buffer", "stream_sync"])
def test_d2h_rejects_wrong(start, finish, message, capsys):
    assert checks06.check_d2h_outputs.verdict(start, finish) is False
    out = capsys.readouterr().out
    assert "❌" in out and message in out, out


def test_d2h_hint_on_second_failure(capsys):
    checks06.check_d2h_outputs.verdict(_start_ok, _finish_early)
    checks06.check_d2h_outputs.verdict(_start_ok, _finish_early)
    assert "💡 Hint" in capsys.readouterr().out


# ---- the verdicts and the generated exercise ----------------------------------------------------------

def test_stubs_are_reported_as_not_implemented(capsys):
    def stub(*args):
        raise NotImplementedError

    assert checks06.check_rot_pos_ids.verdict(stub) is False
    assert checks06.check_d2h_outputs.verdict(stub, stub) is False
    assert capsys.readouterr().out.count("is not implemented yet") == 2


def test_crash_is_reported_not_raised(capsys):
    assert checks06.check_rot_pos_ids.verdict(lambda *a: 1 / 0) is False
    assert "raised ZeroDivisionError" in capsys.readouterr().out
