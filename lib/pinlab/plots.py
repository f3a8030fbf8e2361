"""Shared matplotlib helpers: size sweeps, bar charts, a host-vs-GPU timeline."""
from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter


def fmt_bytes(n: float) -> str:
    """1024 -> '1 KiB', 3 * 2**20 -> '3 MiB'."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if n == int(n) else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _check_series(sizes, series):
    if not isinstance(series, dict) or not series:
        raise TypeError("series must be a non-empty dict {label: list of values}")
    for label, values in series.items():
        if len(values) != len(sizes):
            raise ValueError(f"series {label!r} has {len(values)} values for {len(sizes)} sizes")


def size_sweep(sizes, series: dict, *, ylabel: str, title: str, logy: bool = True, ax=None,
               hline: tuple[float, str] | None = None, vline: tuple[float, str] | None = None):
    """Log-log (or log-x) plot of values against sizes in bytes, one line per series."""
    _check_series(sizes, series)
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4))
    for label, values in series.items():
        xs = [s for s, v in zip(sizes, values) if v is not None]
        ys = [v for v in values if v is not None]
        ax.plot(xs, ys, marker="o", ms=4, label=label)
    ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: fmt_bytes(x)))
    if hline is not None:
        ax.axhline(hline[0], ls="--", c="grey", lw=1)
        ax.annotate(hline[1], (ax.get_xlim()[0], hline[0]), textcoords="offset points", xytext=(4, 4),
                    fontsize=8, color="grey")
    if vline is not None:
        ax.axvline(vline[0], ls=":", c="crimson", lw=1)
        ax.annotate(vline[1], (vline[0], ax.get_ylim()[1]), textcoords="offset points", xytext=(4, -12),
                    fontsize=8, color="crimson")
    ax.set_xlabel("copy size")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return ax


def bars(labels, values, *, ylabel: str, title: str, ax=None, logy: bool = False, annotate: str = "{:.3g}"):
    """A labelled bar chart with each bar's value written on it."""
    labels, values = list(labels), list(values)
    if len(labels) != len(values) or not labels:
        raise ValueError(f"labels and values must be non-empty and equally long ({len(labels)} vs {len(values)})")
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.5))
    rects = ax.bar(range(len(values)), values, color=plt.cm.tab10.colors[: len(values)])
    ax.set_xticks(range(len(values)), labels, rotation=15, ha="right")
    if logy:
        ax.set_yscale("log")
    for r, v in zip(rects, values):
        ax.annotate(annotate.format(v), (r.get_x() + r.get_width() / 2, r.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, axis="y", alpha=0.3)
    return ax


def timeline(lanes: dict, *, title: str, ax=None, xlabel: str = "time (ms)"):
    """Draw spans per lane: ``lanes = {"host": [(start_ms, end_ms, label), ...], "GPU": [...]}``."""
    if not isinstance(lanes, dict) or not lanes:
        raise TypeError("lanes must be a non-empty dict {lane name: list of (start, end, label)}")
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.8 + 0.7 * len(lanes)))
    colors = {}
    palette = plt.cm.tab10.colors
    for row, (lane, spans) in enumerate(lanes.items()):
        for start, end, label in spans:
            if end < start:
                raise ValueError(f"span {label!r} in lane {lane!r} ends before it starts ({start} > {end})")
            c = colors.setdefault(label, palette[len(colors) % len(palette)])
            ax.broken_barh([(start, max(end - start, 1e-3))], (row - 0.35, 0.7), color=c)
    ax.set_yticks(range(len(lanes)), list(lanes))
    ax.invert_yaxis()
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(handles, list(colors), loc="upper right", fontsize=8, ncols=min(4, len(colors)))
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.grid(True, axis="x", alpha=0.3)
    return ax
