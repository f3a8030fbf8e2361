"""Shared matplotlib helpers: size sweeps, bar charts, a host-vs-GPU timeline."""
from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter

from .args import finite_number, positive_number, text_arg

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def fmt_bytes(n: float) -> str:
    """1024 -> '1 KiB', 3 * 2**20 -> '3 MiB'. ``n`` is a finite byte count >= 0."""
    n = positive_number("n", n, allow_zero=True)
    for unit in _UNITS:
        text = f"{n:.0f}" if n == int(n) else f"{n:.1f}"
        if float(text) < 1024 or unit == _UNITS[-1]:  # 1023.96 KiB reads as 1.0 MiB, not 1024.0 KiB
            return f"{text} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _tick_bytes(x, _pos=None) -> str:
    """Axis tick label: :func:`fmt_bytes`, or '' where matplotlib asks about a non-size."""
    try:
        return fmt_bytes(x)
    except (TypeError, ValueError):
        return ""


def _list(name: str, values) -> list:
    if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{name} must be a list, got {type(values).__name__}")
    return list(values)


def _check_series(sizes, series):
    sizes = _list("sizes", sizes)
    if not sizes:
        raise ValueError("sizes must not be empty")
    for i, s in enumerate(sizes):
        positive_number(f"sizes[{i}]", s)  # a log axis: sizes are > 0
    if not isinstance(series, dict) or not series:
        raise TypeError("series must be a non-empty dict {label: list of values}")
    for label, values in series.items():
        values = _list(f"series[{label!r}]", values)
        if len(values) != len(sizes):
            raise ValueError(f"series {label!r} has {len(values)} values for {len(sizes)} sizes")
        for i, v in enumerate(values):
            if v is not None:
                finite_number(f"series[{label!r}][{i}]", v)
    return sizes


def _line(name: str, line):
    if line is None:
        return None
    if not isinstance(line, (tuple, list)) or len(line) != 2:
        raise TypeError(f"{name} must be None or a (value, text) pair, got {line!r}"[:160])
    return finite_number(f"{name}[0]", line[0]), text_arg(f"{name}[1]", line[1], allow_empty=True)


def _texts(**named):
    for name, value in named.items():
        text_arg(name, value, allow_empty=True)


def size_sweep(sizes, series: dict, *, ylabel: str, title: str, logy: bool = True, ax=None,
               hline: tuple[float, str] | None = None, vline: tuple[float, str] | None = None):
    """Log-log (or log-x) plot of values against sizes in bytes, one line per series."""
    sizes = _check_series(sizes, series)
    _texts(ylabel=ylabel, title=title)
    hline, vline = _line("hline", hline), _line("vline", vline)
    if logy and hline is not None and hline[0] <= 0:
        raise ValueError(f"hline must be > 0 on a log y axis, got {hline[0]}")
    if vline is not None and vline[0] <= 0:
        raise ValueError(f"vline must be > 0 on the log size axis, got {vline[0]}")
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4))
    for label, values in series.items():
        xs = [s for s, v in zip(sizes, values) if v is not None]
        ys = [v for v in values if v is not None]
        ax.plot(xs, ys, marker="o", ms=4, label=label)
    ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(_tick_bytes))
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
    labels, values = _list("labels", labels), _list("values", values)
    if len(labels) != len(values) or not labels:
        raise ValueError(f"labels and values must be non-empty and equally long ({len(labels)} vs {len(values)})")
    values = [finite_number(f"values[{i}]", v) for i, v in enumerate(values)]
    if logy and min(values) <= 0:
        raise ValueError(f"values must be > 0 on a log axis (logy=True), got {min(values)}")
    _texts(ylabel=ylabel, title=title, annotate=annotate)
    try:
        annotate.format(values[0])
    except (ValueError, IndexError, KeyError) as exc:
        raise ValueError(f"annotate must be a format string for one number such as '{{:.3g}}', "
                         f"got {annotate!r} ({exc})") from None
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
    _texts(title=title, xlabel=xlabel)
    checked = {}
    for lane, spans in lanes.items():
        rows = []
        for i, span in enumerate(_list(f"lanes[{lane!r}]", spans)):
            if not isinstance(span, (tuple, list)) or len(span) != 3:
                raise TypeError(f"lanes[{lane!r}][{i}] must be a (start, end, label) tuple, got {span!r}"[:200])
            start = finite_number(f"lanes[{lane!r}][{i}] start", span[0])
            end = finite_number(f"lanes[{lane!r}][{i}] end", span[1])
            rows.append((start, end, span[2]))
        checked[lane] = rows
    lanes = checked
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
