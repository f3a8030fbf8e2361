"""Keep the GPU busy for a known time, so that a host call that waits for it becomes visible."""
from __future__ import annotations

import time

import torch

from .args import callable_arg, positive_int, positive_number
from .device import require_cuda

_CYCLES_PER_MS: float | None = None
#: gpu_busy() keeps the GPU busy for at most this long (a minute): more is a typo, not an experiment.
MAX_BUSY_MS = 60_000.0
#: warmup() calls each function at most this many times.
MAX_WARMUP_REPEAT = 10_000


def cycles_per_ms() -> float:
    """GPU clock cycles per millisecond of ``torch.cuda._sleep``, calibrated once per process."""
    global _CYCLES_PER_MS
    require_cuda("cycles_per_ms()")
    if _CYCLES_PER_MS is None:
        torch.cuda.synchronize()
        torch.cuda._sleep(1_000_000)  # first launch: lazy module loading, not timed
        torch.cuda.synchronize()
        best = float("inf")
        cycles = 50_000_000
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end))
        _CYCLES_PER_MS = cycles / best
    return _CYCLES_PER_MS


def gpu_busy(ms: float) -> None:
    """Enqueue a kernel that keeps the current stream busy for about ``ms`` milliseconds.

    Returns at once: the host runs ahead while the GPU spins. Anything the host enqueues
    next runs only after it, and a host call that waits for the GPU waits about ``ms``.
    """
    ms = positive_number("ms", ms, maximum=MAX_BUSY_MS)
    require_cuda("gpu_busy()")
    torch.cuda._sleep(int(ms * cycles_per_ms()))


def warmup(*fns, repeat: int = 1) -> None:
    """Call each function ``repeat`` times and synchronize, before anything is timed.

    The first launch of a kernel not used before in a process loads its module lazily and
    blocks the host behind a busy GPU (280 ms on the H200): warm up every kernel an
    experiment uses, or the first measurement lies.
    """
    repeat = positive_int("repeat", repeat, maximum=MAX_WARMUP_REPEAT)
    for i, fn in enumerate(fns):
        callable_arg(f"fns[{i}]", fn, no_args=True)
    for _ in range(repeat):
        for fn in fns:
            fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def wall_ms(fn) -> float:
    """Host wall-clock milliseconds spent inside one call of ``fn``."""
    callable_arg("fn", fn, no_args=True)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3
