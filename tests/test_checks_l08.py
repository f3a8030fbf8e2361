"""Lesson 08's checkers accept the solutions and reject planted wrong answers with the right diagnosis."""
import pytest
import torch

from pinlab.checks import l08 as checks08

LIMIT = checks08.LIMIT


@pytest.fixture(autouse=True)
def _fresh():
    checks08.reset()


# ---- 1. capturable_step

def good_step(ids, out):
    pos = torch.arange(ids.numel(), dtype=ids.dtype, device=ids.device)
    torch.clamp(ids * 2 + pos, max=LIMIT, out=out)


def eager_step(ids, out):                       # the exercise's starting point
    pos = torch.arange(ids.numel()).to(ids.device)
    out.copy_(ids * 2 + pos)
    if out.max().item() > LIMIT:
        out.clamp_(max=LIMIT)


def item_step(ids, out):                        # positions fixed, the .item() left
    pos = torch.arange(ids.numel(), dtype=ids.dtype, device=ids.device)
    out.copy_(ids * 2 + pos)
    if out.max().item() > LIMIT:
        out.clamp_(max=LIMIT)


def no_clip_step(ids, out):                     # capturable, forgets the clip
    out.copy_(ids * 2 + torch.arange(ids.numel(), dtype=ids.dtype, device=ids.device))


def rebinds_out_step(ids, out):                 # computes into a new tensor: out never written
    out = torch.clamp(ids * 2 + torch.arange(ids.numel(), dtype=ids.dtype, device=ids.device), max=LIMIT)


def pinned_positions_step(ids, out, _pin={}):   # positions from pinned memory: capturable, correct
    pos = torch.arange(ids.numel(), dtype=ids.dtype).pin_memory()
    out.copy_(torch.clamp(ids * 2 + pos.to(ids.device, non_blocking=True), max=LIMIT))


def stub_step(ids, out):
    raise NotImplementedError


@pytest.mark.parametrize("fn, verdict, words", [
    (good_step, True, "is correct"),
    (pinned_positions_step, True, "is correct"),
    (eager_step, False, "pageable host memory"),
    (item_step, False, "makes the host wait"),
    (no_clip_step, False, "expected"),
    (rebinds_out_step, False, "expected"),
    (stub_step, False, "not implemented"),
])
def test_capturable_step(fn, verdict, words, capsys):
    assert checks08.check_capturable_step(fn) is verdict
    assert words in capsys.readouterr().out


def test_a_hint_from_the_second_failure(capsys):
    checks08.check_capturable_step(eager_step)
    assert "Hint" not in capsys.readouterr().out
    checks08.check_capturable_step(eager_step)
    assert "Hint" in capsys.readouterr().out


# ---- 2. stage

def good_stage(s, meta, static, state):
    static.copy_(meta.pin_memory(), non_blocking=True)


def reused_pinned_stage(s, meta, static, state):      # the old way: races
    if "buf" not in state:
        state["buf"] = torch.zeros_like(meta, pin_memory=True)
    state["buf"].copy_(meta)
    static.copy_(state["buf"], non_blocking=True)


def pageable_stage(s, meta, static, state):           # correct (staged at the call), but pageable
    static.copy_(meta, non_blocking=True)


def pageable_to_stage(s, meta, static, state):        # the same, through .to(device): still pageable
    static.copy_(meta.to(static.device, non_blocking=True))


def synced_stage(s, meta, static, state):             # correct, but waits every step
    static.copy_(meta.pin_memory(), non_blocking=True)
    s.synchronize()


def nothing_stage(s, meta, static, state):            # the static input never filled
    pass


def rebinding_stage(s, meta, static, state):          # a new tensor, not the graph's static input
    static = meta.pin_memory().to(static.device, non_blocking=True)


def ring_stage(s, meta, static, state, depth=3):     # an event-guarded ring: correct, no wait in steady state
    ring = state.setdefault("ring", [torch.zeros_like(meta, pin_memory=True) for _ in range(depth)])
    events = state.setdefault("events", [None] * depth)
    n = state["n"] = state.get("n", -1) + 1
    k = n % depth
    if events[k] is not None:
        events[k].synchronize()
    ring[k].copy_(meta)
    static.copy_(ring[k], non_blocking=True)
    events[k] = s.Event()
    events[k].record()


@pytest.mark.parametrize("fn, verdict, words", [
    (good_stage, True, "is correct"),
    (reused_pinned_stage, False, "rewrote before the copy ran"),
    (pageable_stage, False, "pageable memory"),
    (pageable_to_stage, False, "pageable memory"),
    (synced_stage, False, "waits for the GPU"),
    (nothing_stage, False, "did not receive this step's metadata"),
    (rebinding_stage, False, "did not receive this step's metadata"),
    (ring_stage, False, "waits for the GPU"),
])
def test_graph_stage(fn, verdict, words, capsys):
    assert checks08.check_graph_stage(fn) is verdict
    assert words in capsys.readouterr().out
