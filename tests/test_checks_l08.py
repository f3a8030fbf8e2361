"""Lesson 08's checkers accept the master solution and reject planted wrong answers with the right diagnosis.

Each planted answer is named by what it plants. The ones marked "issue 28" were accepted before (on the
emulated stream) while a GPU refuses them or runs them wrong; the checker now rejects them on its own, by name,
whatever the emulation itself refuses."""
import nbtools
import pytest
import torch

import pinlab
from pinlab.checks import l08 as checks08

LIMIT = checks08.LIMIT
SOLUTION = nbtools.ROOT / "solutions" / "src" / "08_cuda_graphs.py"


def _solution(name):
    """The master solution's own function (solutions/src/08_cuda_graphs.py), not a copy."""
    return nbtools.load_definition(SOLUTION, name, {"torch": torch, "checks08": checks08})


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


# issue 28: wrong answers the emulation accepted

def eager_step_without_to(ids, out):            # the given step with only `.to(ids.device)` deleted
    pos = torch.arange(ids.numel())
    out.copy_(ids * 2 + pos)
    if out.max().item() > LIMIT:
        out.clamp_(max=LIMIT)


def host_arange_step(ids, out):                 # the same, with the clip fixed: a host arange in the capture
    pos = torch.arange(ids.numel(), dtype=ids.dtype)
    torch.clamp(ids * 2 + pos, max=LIMIT, out=out)


def tensor_factory_step(ids, out):              # torch.tensor(list, device=): a pageable H2D copy in the capture
    pos = torch.tensor(list(range(ids.numel())), device=ids.device)
    torch.clamp(ids * 2 + pos, max=LIMIT, out=out)


def scalar_tensor_factory_step(ids, out):       # torch.tensor(LIMIT, device=): one number, still an H2D copy
    pos = torch.arange(ids.numel(), dtype=ids.dtype, device=ids.device)
    torch.minimum(ids * 2 + pos, torch.tensor(LIMIT, device=ids.device), out=out)


def new_tensor_step(ids, out):                  # ids.new_tensor(list): the same copy, through the input
    pos = ids.new_tensor(list(range(ids.numel())))
    torch.clamp(ids * 2 + pos, max=LIMIT, out=out)


def pinned_like_gpu_step(ids, out):             # empty_like(a GPU tensor, pin_memory=True): refused on a GPU
    pos = torch.empty_like(ids, pin_memory=True).copy_(torch.arange(ids.numel()))
    torch.clamp(ids * 2 + pos.to(ids.device, non_blocking=True), max=LIMIT, out=out)


def overwrites_input_step(ids, out):            # right out, but computed in place in ids (the graph's input)
    pos = torch.arange(ids.numel(), dtype=ids.dtype, device=ids.device)
    ids.mul_(2).add_(pos).clamp_(max=LIMIT)
    out.copy_(ids)


def cpu_scalar_step(ids, out):                  # a 0-dim host tensor is a number on a GPU too: correct
    pos = torch.arange(ids.numel(), dtype=ids.dtype, device=ids.device)
    torch.minimum(ids * 2 + pos, torch.tensor(LIMIT), out=out)


def numpy_step(ids, out):                       # numpy for the clip: torch says "Use Tensor.cpu()", a D2H sync
    pos = torch.arange(ids.numel(), dtype=ids.dtype, device=ids.device)
    out.copy_(torch.from_numpy((ids * 2 + pos).numpy().clip(max=LIMIT)))


@pytest.mark.parametrize("fn, verdict, words", [
    (good_step, True, "is correct"),
    (pinned_positions_step, True, "is correct"),
    (cpu_scalar_step, True, "is correct"),
    (eager_step_without_to, False, "uses a host tensor"),
    (host_arange_step, False, "uses a host tensor"),
    (tensor_factory_step, False, "copies host data to the GPU inside the capture"),
    (scalar_tensor_factory_step, False, "copies host data to the GPU inside the capture"),
    (new_tensor_step, False, "`t.new_tensor(data)` copies host data to the GPU inside the capture"),
    (pinned_like_gpu_step, False, "asks torch to pin GPU memory"),
    (overwrites_input_step, False, "writes into ids, the graph's input"),
    (eager_step, False, "pageable host memory"),
    (item_step, False, "makes the host wait"),
    (no_clip_step, False, "expected"),
    (rebinds_out_step, False, "expected"),
    (stub_step, False, "not implemented"),
    (numpy_step, False, "converts a GPU tensor to numpy"),
])
def test_capturable_step(fn, verdict, words, capsys):
    assert checks08.check_capturable_step.verdict(fn) is verdict
    assert words in capsys.readouterr().out


def test_the_master_solution_passes(capsys):
    assert checks08.check_capturable_step.verdict(_solution("capturable_step")) is True
    assert checks08.check_graph_stage.verdict(_solution("stage")) is True
    out = capsys.readouterr().out
    assert "✅ capturable_step is correct" in out and "✅ stage is correct" in out and "❌" not in out


def test_a_host_tensor_in_the_capture_is_named_with_torchs_own_words(capsys):
    """The most natural wrong answer of part 1: on a GPU torch refuses it; the verdict quotes torch."""
    assert checks08.check_capturable_step.verdict(eager_step_without_to) is False
    out = capsys.readouterr().out
    assert checks08.SAME_DEVICE_ERROR in out and "device=ids.device" in out and "makes the host wait" not in out


def test_numpy_in_the_step_is_not_told_to_use_tensor_cpu(capsys):
    """issue 48 (08 w17): torch's own advice for ``.numpy()`` of device memory, "Use Tensor.cpu()", is a blocking
    copy a capture refuses: the verdict must not echo it."""
    assert checks08.check_capturable_step.verdict(numpy_step) is False
    out = capsys.readouterr().out
    assert "Use Tensor.cpu()" not in out and "blocking copy" in out


def test_a_hint_from_the_second_failure(capsys):
    checks08.check_capturable_step.verdict(eager_step)
    assert "Hint" not in capsys.readouterr().out
    checks08.check_capturable_step.verdict(eager_step)
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


# issue 28: wrong answers the emulation accepted, and right ones near them

def tensor_factory_stage(s, meta, static, state):        # a staging copy through torch.tensor(..., device=)
    static.copy_(torch.tensor(meta.tolist(), device=static.device))


def as_tensor_stage(s, meta, static, state):             # as_tensor(meta, device=): a blocking pageable copy
    static.copy_(torch.as_tensor(meta, device=static.device))


def pinned_like_gpu_stage(s, meta, static, state):       # empty_like(static, pin_memory=True): static is on the GPU
    snap = torch.empty_like(static, pin_memory=True)
    snap.copy_(meta)
    static.copy_(snap, non_blocking=True)


def pinned_tensor_of_tensor_stage(s, meta, static, state):   # torch.tensor(meta, pin_memory=True): refused by torch
    static.copy_(torch.tensor(meta, pin_memory=True), non_blocking=True)


def half_copy_stage(s, meta, static, state):             # only the first 8 of 16 values: element 0 is right
    static[:8].copy_(meta[:8].pin_memory(), non_blocking=True)


def deep_ring_stage(s, meta, static, state):             # a ring deeper than the 60 steps once checked
    ring_stage(s, meta, static, state, depth=64)


def host_like_pinned_stage(s, meta, static, state):      # empty_like(static, device="cpu", pin_memory=True): vLLM's way
    snap = torch.empty_like(static, device="cpu", pin_memory=True)
    snap.copy_(meta)
    static.copy_(snap, non_blocking=True)


def pinned_from_list_stage(s, meta, static, state):      # torch.tensor(list, pin_memory=True): a fresh pinned copy
    static.copy_(torch.tensor(meta.tolist(), dtype=meta.dtype, pin_memory=True), non_blocking=True)


def keeps_every_snapshot_stage(s, meta, static, state):  # correct, holds every snapshot (more steps than 60)
    snap = meta.pin_memory()
    state.setdefault("kept", []).append(snap)
    static.copy_(snap, non_blocking=True)


@pytest.mark.parametrize("fn, verdict, words", [
    (good_stage, True, "is correct"),
    (host_like_pinned_stage, True, "is correct"),
    (pinned_from_list_stage, True, "is correct"),
    (keeps_every_snapshot_stage, True, "is correct"),
    (tensor_factory_stage, False, "copies host data to the GPU through `torch.tensor(data, device=...)`"),
    (as_tensor_stage, False, "copies host data to the GPU through `torch.as_tensor(data, device=...)`"),
    (pinned_like_gpu_stage, False, "asks torch to pin GPU memory"),
    (pinned_tensor_of_tensor_stage, False, "cannot pin a tensor built from a tensor"),
    (half_copy_stage, False, "read only 8 of its 16 values"),
    (deep_ring_stage, False, "a ring: checked over 132 steps"),
    (reused_pinned_stage, False, "rewrote before the copy ran"),
    (pageable_stage, False, "pageable memory"),
    (pageable_to_stage, False, "pageable memory"),
    (synced_stage, False, "waits for the GPU"),
    (nothing_stage, False, "did not receive this step's metadata"),
    (rebinding_stage, False, "did not receive this step's metadata"),
    (ring_stage, False, "waits for the GPU"),
])
def test_graph_stage(fn, verdict, words, capsys):
    assert checks08.check_graph_stage.verdict(fn) is verdict
    assert words in capsys.readouterr().out


def test_a_ring_is_checked_over_more_steps_than_its_depth(capsys):
    """A ring of 64 never wraps in 60 steps: the check runs it for 2 x 64 + 4 steps, and it waits there."""
    assert checks08.check_graph_stage.verdict(deep_ring_stage) is False
    out = capsys.readouterr().out
    assert "waits for the GPU" in out and "keeps 64 steps' worth of pinned memory" in out


def test_a_ring_deeper_than_the_check_runs_around_is_refused_with_its_depth(capsys):
    depth = checks08.MAX_RING + 1
    assert checks08.check_graph_stage.verdict(lambda s, meta, static, state: ring_stage(s, meta, static, state, depth)) is False
    assert f"keeps {depth} steps' worth of pinned memory" in capsys.readouterr().out


def test_the_snapshots_a_correct_stage_keeps_run_it_longer_and_pass(capsys):
    assert checks08.check_graph_stage.verdict(keeps_every_snapshot_stage) is True
    out = capsys.readouterr().out
    assert "124 steps each read all 16 values" in out


@pytest.mark.parametrize("fn", [synced_stage, ring_stage])
def test_pinned_copies_a_sync_drains_are_not_counted_as_pageable(fn):
    """The known bug: the watch saw the emulated GPU's queued copies run by the learner's sync (there
    is_pinned() answers for plain torch) and counted them as pageable copies."""
    run = checks08.staging_run(fn, pinlab.LaggingStream())
    assert run["pageable"] == 0 and run["waited"] is True
    assert checks08.staging_run(pageable_stage, pinlab.LaggingStream())["pageable"] == checks08.STAGE_STEPS


def pageable_synced_stage(s, meta, static, state):     # one pageable copy per step, then a wait that drains it
    static.copy_(meta, non_blocking=True)
    s.synchronize()


def test_a_pageable_copy_a_sync_drains_counts_once():
    """The copy the driver staged at the call is the learner's; running it later is the emulated GPU's work."""
    run = checks08.staging_run(pageable_synced_stage, pinlab.LaggingStream())
    assert run["pageable"] == checks08.STAGE_STEPS and run["waited"] is True


def test_every_value_of_every_step_is_compared():
    run = checks08.staging_run(good_stage, pinlab.LaggingStream(), steps=5)
    assert run["seen"] == [checks08.step_values(n) for n in range(5)]
    assert len({v for row in run["seen"] for v in row}) == 5 * checks08.META_INTS
    assert run["kept_steps"] == 0
