"""A sample test suite for the pinlab gate (docs/race_gate.md): one step loop written three ways.

Run it with ``pytest --pinlab-races examples/race_gate``: the racy loop fails, the two fixes pass. It runs on a
CUDA GPU, and on a machine without one through the emulated stream (``pinlab.stream()``)."""
import pytest
import torch

import pinlab

STEPS = 50


def step_loop(fix: str) -> list:
    """Copy step n's data (n everywhere) to the GPU while the GPU is busy; return what the GPU received."""
    with pinlab.stream() as s:
        pinned = torch.zeros(64, dtype=torch.int32, pin_memory=True)     # reused every step
        pageable = torch.zeros(64, dtype=torch.int32)
        ring = [torch.zeros(64, dtype=torch.int32, pin_memory=True) for _ in range(2)]
        copied = [s.Event() for _ in ring]
        dst = torch.zeros(STEPS, 64, dtype=torch.int32, device=s.device)
        for n in range(STEPS):
            if fix == "none":                       # the race: the host rewrites a buffer still being read
                pinned.fill_(n)
                dst[n].copy_(pinned, non_blocking=True)
            elif fix == "snapshot":                 # a fresh pinned snapshot per copy
                pageable.fill_(n)
                dst[n].copy_(pageable.pin_memory(), non_blocking=True)
            else:                                   # a ring of pinned buffers guarded by events
                k = n % len(ring)
                copied[k].synchronize()
                ring[k].fill_(n)
                dst[n].copy_(ring[k], non_blocking=True)
                copied[k].record()
            s.busy(1.0)                             # the rest of step n's GPU work
        s.synchronize()
        return [int(v) for v in dst[:, 0].tolist()]


def test_racy_loop():
    step_loop("none")   # the gate fails this test: the host rewrote the source of a pending copy


@pytest.mark.parametrize("fix", ["snapshot", "ring"])
def test_fixed_loop(fix):
    assert step_loop(fix) == list(range(STEPS))
