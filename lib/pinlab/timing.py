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

from .args import bool_arg, callable_arg, positive_int, positive_number, text_arg
from .device import require_cuda
from .text import WIDTH, fmt_ms, wrapped  # noqa: F401 - re-exported: the names modules imported first

TIMING_PREFIX = "[timing]"
MEASURED_PREFIX = "[measured]"
#: A wrapped ``[timing]``/``[measured]`` line goes on indented by this many spaces (tests/nbval_sanitize.cfg).
MACHINE_INDENT = len(MEASURED_PREFIX) + 1


def _print_machine_line(prefix: str, label: str, text) -> None:
    print(wrapped(f"{prefix} {label}: {text}", indent=MACHINE_INDENT))


#: At most this many timed calls per host_time/cuda_time: a typo such as repeat=10**9 is an
#: error, not a notebook that never finishes.
MAX_REPEAT = 100_000


@dataclass(frozen=True)
class Stats:
    """Summary of repeated timings, in milliseconds."""

    median: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, samples_ms) -> "Stats":
        """Median, min, max and count of timings in ms (each a finite number >= 0)."""
        wrong = TypeError(f"samples_ms must be a list of timings in ms, got {type(samples_ms).__name__}")
        if isinstance(samples_ms, (str, bytes, dict)) or not hasattr(samples_ms, "__iter__"):
            raise wrong
        try:
            samples_ms = samples_ms.tolist() if hasattr(samples_ms, "tolist") else list(samples_ms)
            samples_ms = list(samples_ms)
        except TypeError:  # e.g. a 0-d tensor
            raise wrong from None
        samples = [positive_number(f"samples_ms[{i}]", s, allow_zero=True) for i, s in enumerate(samples_ms)]
        if not samples:
            raise ValueError("samples_ms must hold at least one timing")
        return cls(statistics.median(samples), min(samples), max(samples), len(samples))

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return f"median {fmt_ms(self.median)} (min {fmt_ms(self.min)}, max {fmt_ms(self.max)}, n={self.n})"




def host_time(fn, *, repeat: int = 10, warmup: int = 1, setup=None, sync_after: bool = True) -> Stats:
    """Host wall-clock time inside ``fn()`` (ms), over ``repeat`` calls.

    ``setup()`` runs before each call, untimed (for example ``lambda: gpu_busy(20)``).
    With ``sync_after`` the device is synchronized after each call, untimed, so that calls
    do not pile up behind each other.
    """
    callable_arg("fn", fn, no_args=True)
    if setup is not None:
        callable_arg("setup", setup, no_args=True)
    repeat = positive_int("repeat", repeat, maximum=MAX_REPEAT)
    warmup = positive_int("warmup", warmup, allow_zero=True, maximum=MAX_REPEAT)
    bool_arg("sync_after", sync_after)
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
    callable_arg("fn", fn, no_args=True)
    repeat = positive_int("repeat", repeat, maximum=MAX_REPEAT)
    warmup = positive_int("warmup", warmup, allow_zero=True, maximum=MAX_REPEAT)
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


def interleaved(names, rounds: int, run, desc: str | None = None) -> dict:
    """``run(name, r)`` for every name in each of ``rounds`` rounds, the order rotating by one each round
    (round ``r`` starts at ``names[r % len(names)]``), so that a slow spell of the machine falls on every
    name, not on one. Returns ``{name: [run's result in round 0, 1, ...]}``: the rounds loop of every
    comparison of the course. ``desc``: a progress bar over the rounds, with that text (long work)."""
    if isinstance(names, (str, bytes)) or not hasattr(names, "__iter__"):
        raise TypeError(f"names must be a list of what to compare, got {type(names).__name__}")
    names = list(names)
    if not names or len(set(names)) != len(names):
        raise ValueError(f"names must be at least one name, each once, got {names!r}")
    rounds = positive_int("rounds", rounds)
    callable_arg("run", run)
    out = {k: [] for k in names}
    if desc is not None:
        from .progress import progress

        text_arg("desc", desc)
    for r in range(rounds) if desc is None else progress(range(rounds), desc=desc):
        for k in names[r % len(names):] + names[:r % len(names)]:
            out[k].append(run(k, r))
    return out


def split_steps(steps: int, rounds: int) -> list:
    """``steps`` split over ``rounds`` as evenly as ints allow (the first rounds take one more); every round
    gets at least one step."""
    steps, rounds = positive_int("steps", steps), positive_int("rounds", rounds, maximum=steps)
    return [steps // rounds + (1 if r < steps % rounds else 0) for r in range(rounds)]


def _label(label) -> str:
    if not isinstance(label, str) or not label.strip():
        raise TypeError(f"label must be a non-empty str, got {label!r}"[:120])
    if "\n" in label or "\r" in label:
        raise ValueError("label must be one line (no newline): the sanitizer masks one line per value")
    return label


def report(label: str, value, unit: str = "ms") -> None:
    """Print one timing line: ``[timing] label: value``.

    ``value`` is a :class:`Stats` or a finite number >= 0 (a time in ms, or a rate in ``unit``).
    """
    _label(label)
    text_arg("unit", unit)
    if isinstance(value, Stats):
        text = str(value)
    elif unit == "ms":
        text = fmt_ms(positive_number("value", value, allow_zero=True))
    else:
        text = f"{positive_number('value', value, allow_zero=True):.3g} {unit}"
    _print_machine_line(TIMING_PREFIX, label, text)


def show(label: str, value) -> None:
    """Print one machine-dependent measured fact that is not a timing: ``[measured] label: value``."""
    _label(label)
    _print_machine_line(MEASURED_PREFIX, label, value)


def table(rows, columns) -> None:
    """Print rows (dicts) as an aligned text table.

    ``columns`` is a list of ``(key, header)`` or ``(key, header, fn)`` where ``fn`` turns a value
    into text (default ``str``). Tables hold measurements: tag their cells ``nbval-ignore-output``.
    """
    if isinstance(rows, (str, bytes, dict)) or not hasattr(rows, "__iter__"):
        raise TypeError(f"rows must be a list of dicts, got {type(rows).__name__}")
    rows = list(rows)
    if not rows:
        raise ValueError("rows must not be empty")
    if isinstance(columns, (str, bytes, dict)) or not hasattr(columns, "__iter__"):
        raise TypeError(f"columns must be a list of (key, header) tuples, got {type(columns).__name__}")
    cols = []
    for c in columns:
        if not isinstance(c, (tuple, list)) or len(c) not in (2, 3):
            raise ValueError(f"columns: each must be (key, header) or (key, header, fn), got {c!r}")
        if not isinstance(c[1], str):
            raise TypeError(f"columns: header must be a str, got {c[1]!r}")
        if len(c) == 3:
            callable_arg(f"columns: the fn of {c[1]!r}", c[2])
        cols.append((c[0], c[1], c[2] if len(c) == 3 else str))
    if not cols:
        raise ValueError("columns must not be empty")
    for i, r in enumerate(rows):
        if not isinstance(r, dict):
            raise TypeError(f"rows[{i}] must be a dict, got {type(r).__name__}")
        missing = [k for k, _, _ in cols if k not in r]
        if missing:
            raise ValueError(f"rows[{i}] has no key {missing[0]!r} (columns ask for it)")
    cells = [[str(fn(r[k])) for k, _, fn in cols] for r in rows]
    widths = [max(len(h), *(len(row[i]) for row in cells)) for i, (_, h, _) in enumerate(cols)]
    lines = ["  ".join(h.rjust(w) for (_, h, _), w in zip(cols, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    text = "\n".join(lines)
    shell = _ipython_kernel()
    if shell is None:
        print(text)
        return
    # in a notebook: an HTML table (it wraps and scrolls in its own box on a narrow page; the site shows it),
    # with the text table as the plain-text form
    import html

    from IPython.display import display

    head = "".join(f"<th>{html.escape(h)}</th>" for _, h, _ in cols)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in row) + "</tr>" for row in cells)
    display({"text/plain": text,
             "text/html": f'<table class="pinlab-table"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'},
            raw=True)


def _ipython_kernel():
    """The running IPython kernel's shell (a notebook), or None (a script, a terminal, a test)."""
    import sys

    if "IPython" not in sys.modules:
        return None
    shell = sys.modules["IPython"].get_ipython()
    return shell if shell is not None and getattr(shell, "kernel", None) is not None else None
