"""Formatting, one place: printed lines wrapped to the page, durations and byte counts as a reader takes
them in. A leaf of the import graph (it imports only :mod:`.args`): every module that prints may use it.
"""
from __future__ import annotations

import textwrap

from .args import positive_number

__all__ = ["WIDTH", "wrapped", "fmt_ms", "fmt_bytes"]

#: Printed lines are wrapped to this many columns (a notebook output, a site page, a terminal).
WIDTH = 100

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def wrapped(text: str, indent: int = 4, width: int | None = None) -> str:
    """``text`` (one line) wrapped at spaces to ``width`` columns, the lines after the first indented by
    ``indent`` spaces; words longer than a line are kept whole. Joining the lines with single spaces
    (after the indent) gives ``text`` back where it had single spaces."""
    width = WIDTH if width is None else width
    lines = textwrap.wrap(text, width=width, subsequent_indent=" " * indent, break_long_words=False,
                          break_on_hyphens=False, replace_whitespace=False, drop_whitespace=True)
    return "\n".join(lines) if lines else text


def fmt_ms(ms: float) -> str:
    """A duration in the unit a reader takes in at a glance: 0.0125 -> '12.5 µs'.

    ``ms`` is a finite number of milliseconds >= 0 (a duration cannot be negative).
    """
    ms = positive_number("ms", ms, allow_zero=True)
    if ms < 1e-3:
        return f"{ms * 1e6:.0f} ns"
    if ms < 1.0:
        return f"{ms * 1e3:.1f} µs"
    if ms < 1000.0:
        return f"{ms:.2f} ms"
    return f"{ms / 1e3:.2f} s"


def fmt_bytes(n: float) -> str:
    """1024 -> '1 KiB', 3 * 2**20 -> '3 MiB', 1536 -> '1.5 KiB'. ``n`` is a finite byte count >= 0."""
    n = positive_number("n", n, allow_zero=True)
    for unit in _UNITS:
        text = f"{n:.0f}" if n == int(n) else f"{n:.1f}"
        if float(text) < 1024 or unit == _UNITS[-1]:  # 1023.96 KiB reads as 1.0 MiB, not 1024.0 KiB
            return f"{text} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
