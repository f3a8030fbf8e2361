"""Timing: host wall clock and CUDA events, repeated, summarised; printing with a fixed prefix.

Every machine-dependent number a notebook prints goes through :func:`report` or :func:`show`,
whose lines start with ``[timing]`` or ``[measured]``; nbval's sanitizer masks exactly those
lines, so the numbers may change from run to run while every other output is compared.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from .args import callable_arg, positive_int, require_cuda

TIMING_PREFIX = "[timing]"
MEASURED_PREFIX = "[measured]"


@dataclass(frozen=True)
class Stats:
    """Summary of repeated timings, in milliseconds."""

    median: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, samples_ms) -> "Stats":
        samples = [float(s) for s in samples_ms]
        if not samples:
            raise ValueError("samples_ms must hold at least one timing")
        return cls(statistics.median(samples), min(samples), max(samples), len(samples))

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return f"median {fmt_ms(self.median)} (min {fmt_ms(self.min)}, max {fmt_ms(self.max)}, n={self.n})"


def fmt_ms(ms: float) -> str:
    """A duration in the unit a reader takes in at a glance."""
    if ms < 1e-3:
        return f"{ms * 1e6:.0f} ns"
    if ms < 1.0:
        return f"{ms * 1e3:.1f} µs"
    if ms < 1000.0:
        return f"{ms:.2f} ms"
    return f"{ms / 1e3:.2f} s"


def host_time(fn, *, repeat: int = 10, warmup: int = 1, setup=None, sync_after: bool = True) -> Stats:
    """Host wall-clock time inside ``fn()`` (ms), over ``repeat`` calls.

    ``setup()`` runs before each call, untimed (for example ``lambda: gpu_busy(20)``).
    With ``sync_after`` the device is synchronized after each call, untimed, so that calls
    do not pile up behind each other.
    """
    callable_arg("fn", fn)
    if setup is not None:
        callable_arg("setup", setup)
    repeat = positive_int("repeat", repeat)
    warmup = positive_int("warmup", warmup, allow_zero=True)
    cuda = torch.cuda.is_available()
    samples = []
    for i in range(warmup + repeat):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        dt = (time.perf_counter() - t0) * 1e3
        if sync_after and cuda:
            torch.cuda.synchronize()
        if i >= warmup:
            samples.append(dt)
    return Stats.of(samples)


def cuda_time(fn, *, repeat: int = 10, warmup: int = 1) -> Stats:
    """GPU time of the work ``fn()`` enqueues (ms), measured with CUDA events."""
    callable_arg("fn", fn)
    repeat = positive_int("repeat", repeat)
    warmup = positive_int("warmup", warmup, allow_zero=True)
    require_cuda("cuda_time()")
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return Stats.of(samples)


def report(label: str, value, unit: str = "ms") -> None:
    """Print one timing line: ``[timing] label: value``. ``value`` may be a Stats or a number."""
    if not isinstance(label, str) or not label:
        raise TypeError("label must be a non-empty str")
    if isinstance(value, Stats):
        text = str(value)
    elif unit == "ms":
        text = fmt_ms(float(value))
    else:
        text = f"{float(value):.3g} {unit}"
    print(f"{TIMING_PREFIX} {label}: {text}")


def show(label: str, value) -> None:
    """Print one machine-dependent measured fact that is not a timing: ``[measured] label: value``."""
    if not isinstance(label, str) or not label:
        raise TypeError("label must be a non-empty str")
    print(f"{MEASURED_PREFIX} {label}: {value}")


def table(rows, columns) -> None:
    """Print rows (dicts) as an aligned text table.

    ``columns`` is a list of ``(key, header)`` or ``(key, header, fn)`` where ``fn`` turns a value
    into text (default ``str``). Tables hold measurements: tag their cells ``nbval-ignore-output``.
    """
    rows = list(rows)
    if not rows:
        raise ValueError("rows must not be empty")
    cols = []
    for c in columns:
        if len(c) not in (2, 3):
            raise ValueError(f"each column must be (key, header) or (key, header, fn), got {c!r}")
        cols.append((c[0], c[1], c[2] if len(c) == 3 else str))
    cells = [[fn(r[k]) for k, _, fn in cols] for r in rows]
    widths = [max(len(h), *(len(row[i]) for row in cells)) for i, (_, h, _) in enumerate(cols)]
    print("  ".join(h.rjust(w) for (_, h, _), w in zip(cols, widths)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))
