"""Shared matplotlib helpers: size sweeps, bar charts, a host-vs-GPU timeline, and the course's plot style.

The style (applied when this module is imported, and by ``pinlab.header()`` in every notebook's first cell;
:func:`use_course_style`):
- sharp figures: in Jupyter, inline figures are rendered for high-density ("retina") screens;
- text of at least 9 pt at display size: figures are at most ``MAX_WIDTH_IN`` inches (740 px at the inline
  backend's 100 dpi) wide, the width of a lesson page's column, so they are shown unscaled;
- the course palette (``PALETTE``, colour-blind-safe) everywhere: set once as matplotlib's colour cycle
  (``axes.prop_cycle``), so a line drawn without a colour gets one of it, and one colour per label across all
  panels and figures with :func:`color_for` (a shared label -> colour map);
- constrained layout (``figure.constrained_layout.use``): titles, tick labels and legends placed outside the axes
  are fitted into the figure, never drawn over a neighbouring panel (:func:`subplots`, :func:`stacked`);
- legends outside the axes, under them: :func:`legend_outside`;
- several panels stacked, not side by side: :func:`stacked`.
tests/test_plot_style.py draws every kind of figure the lessons show from the recorded GPU run and checks the
style: width, text size, palette, legends over no data, no text over other text.
"""
from __future__ import annotations

import sys

import matplotlib as mpl
import matplotlib.figure
import matplotlib.pyplot as plt
from cycler import cycler
from matplotlib.layout_engine import ConstrainedLayoutEngine
from matplotlib.ticker import FuncFormatter

from .args import finite_number, positive_int, positive_number, text_arg
from .text import fmt_bytes  # noqa: F401 - re-exported (lessons import it from plots)

#: the widest figure, in inches: 740 px at the inline backend's 100 dpi, a lesson page's column
MAX_WIDTH_IN = 7.4
MIN_FONT_PT = 9
#: the palette :func:`color_for` hands out, in order (colour-blind-safe: Okabe-Ito, then tab10's others)
PALETTE = ("#0072b2", "#e69f00", "#009e73", "#d55e00", "#cc79a7", "#56b4e9", "#f0e442", "#000000",
           "#8c564b", "#7f7f7f", "#bcbd22", "#17becf")
COURSE_RC = {
    "axes.prop_cycle": cycler(color=list(PALETTE)),
    "figure.constrained_layout.use": True,
    "font.size": 10,
    "axes.titlesize": 11,
    "axes.labelsize": 10,
    "xtick.labelsize": MIN_FONT_PT,
    "ytick.labelsize": MIN_FONT_PT,
    "legend.fontsize": MIN_FONT_PT,
    "legend.title_fontsize": MIN_FONT_PT,
    "figure.titlesize": 11,
}
_COLORS: dict[str, str] = {}


def color_for(label) -> str:
    """The colour of ``label``, the same in every panel and figure of this process: a label gets the next
    colour of ``PALETTE`` the first time it is drawn (after 12 labels the palette repeats)."""
    key = text_arg("label", label, allow_empty=True) if isinstance(label, str) else str(label)
    if key not in _COLORS:
        _COLORS[key] = PALETTE[len(_COLORS) % len(PALETTE)]
    return _COLORS[key]


def _fitting_ncols(fig, labels, ncols: int) -> int:
    """At most ``ncols`` legend columns, as many as fit across ``fig`` with its longest label (a wider legend
    would make the constrained layout squeeze the axes to its width)."""
    from matplotlib.font_manager import FontProperties
    from matplotlib.textpath import text_to_path

    size = mpl.rcParams["legend.fontsize"]
    size = size if isinstance(size, (int, float)) else MIN_FONT_PT
    prop = FontProperties(size=size)
    text_pt = max((text_to_path.get_text_width_height_descent(str(s), prop, ismath=False)[0] for s in labels),
                  default=0.0)
    rc = mpl.rcParams
    column_pt = text_pt + size * (rc["legend.handlelength"] + rc["legend.handletextpad"] + rc["legend.columnspacing"])
    room_pt = fig.get_figwidth() * 72 * 0.95 + size * rc["legend.columnspacing"]
    return max(1, min(ncols, int(room_pt // column_pt)))


def legend_outside(ax, handles=None, labels=None, *, ncols: int | None = None):
    """A legend under the axes (outside them: it hides no data), centred, in up to 3 columns (``ncols``), and
    never more than fit across the figure. Jupyter's inline figures are cropped to what is drawn, so the legend
    is shown in full."""
    if handles is None:
        handles, labels = ax.get_legend_handles_labels()
    if not handles:
        return None
    ncols = positive_int("ncols", ncols) if ncols is not None else min(3, len(handles))
    ncols = _fitting_ncols(ax.figure, labels or [], ncols)
    # the gap, in font sizes: below the tick labels and the x label
    return ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), borderaxespad=3.2,
                     ncols=ncols, frameon=False)


class Figure(matplotlib.figure.Figure):
    """A figure of the course: constrained layout, which fits titles, tick labels and the legends under the axes
    into the figure. ``tight_layout()`` leaves that layout in place (it would replace it, with a warning, and
    lose the room made for the legends): some lesson cells call it after drawing into :func:`stacked` panels.
    The class keeps matplotlib's name, so a notebook's ``<Figure size ...>`` line reads as before."""

    def tight_layout(self, *args, **kwargs):
        if isinstance(self.get_layout_engine(), ConstrainedLayoutEngine):
            return None
        return super().tight_layout(*args, **kwargs)

    def suptitle(self, t, **kwargs):
        """A title longer than the figure wraps (``wrap=True``) instead of widening the saved image: in stop 60 an
        H100's name in lesson 02b's title widened that figure from 1503 to 1626 px, and a phone's 390 px showed
        its 9-pt text at 8.5 px."""
        kwargs.setdefault("wrap", True)
        return super().suptitle(t, **kwargs)


def subplots(nrows: int = 1, ncols: int = 1, **kwargs):
    """``plt.subplots`` for a course figure (:class:`Figure`, constrained layout), at most ``MAX_WIDTH_IN`` wide."""
    nrows, ncols = positive_int("nrows", nrows), positive_int("ncols", ncols)
    w, h = kwargs.pop("figsize", (MAX_WIDTH_IN, 4.0))
    kwargs.setdefault("layout", "constrained")
    return plt.subplots(nrows, ncols, figsize=(min(positive_number("figsize[0]", w), MAX_WIDTH_IN),
                                               positive_number("figsize[1]", h)), FigureClass=Figure, **kwargs)


def stacked(n: int, *, height: float = 2.6, sharex: bool = False):
    """``fig, axes``: ``n`` panels stacked top to bottom at ``MAX_WIDTH_IN`` wide (each ``height`` inches),
    instead of side by side at a width a page shows shrunk; constrained layout, so the legend under a panel
    never lies over the panel below it."""
    n = positive_int("n", n)
    height = positive_number("height", height)
    fig, axes = subplots(n, 1, figsize=(MAX_WIDTH_IN, height * n), sharex=sharex, squeeze=False)
    return fig, list(axes[:, 0])


def label_line(ax, y: float, text: str, *, color: str = "grey"):
    """Write ``text`` for the horizontal line at ``y`` just right of the axes, outside them: it covers no bar,
    value or data point (constrained layout makes room for it)."""
    finite_number("y", y)
    text_arg("text", text)
    return ax.annotate(text, xy=(1.0, y), xycoords=("axes fraction", "data"), xytext=(4, 0),
                       textcoords="offset points", ha="left", va="center", fontsize=MIN_FONT_PT, color=color,
                       annotation_clip=False)


def headroom(ax, share: float = 0.18) -> None:
    """Room above the tallest bar for its value label (inside the axes, under the title): ``share`` of the
    y range more on top."""
    share = positive_number("share", share)
    lo, hi = ax.get_ylim()
    if ax.get_yscale() == "log":
        ax.set_ylim(lo, hi * (hi / lo) ** share)
    else:
        ax.set_ylim(lo, hi + (hi - lo) * share)


def use_course_style() -> None:
    """Apply the course's plot style: font sizes (``COURSE_RC``) and, inside IPython, retina inline figures
    (``InlineBackend.figure_formats``). Figure sizes are not touched (the notebooks' ``<Figure size ...>``
    outputs stay as they are)."""
    mpl.rcParams.update(COURSE_RC)
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
    if shell is None or not hasattr(shell, "run_line_magic"):
        return
    try:  # the config for when the inline backend starts, and the formatter if it has started already
        shell.run_line_magic("config", "InlineBackend.figure_formats = ['retina']")
        from matplotlib_inline.backend_inline import set_matplotlib_formats

        set_matplotlib_formats("retina")
    except Exception:  # noqa: BLE001 - a style, never a reason for a lesson to fail
        pass


use_course_style()




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
        _, ax = subplots(figsize=(7, 4))
    for label, values in series.items():
        xs = [s for s, v in zip(sizes, values) if v is not None]
        ys = [v for v in values if v is not None]
        ax.plot(xs, ys, marker="o", ms=4, label=label, color=color_for(label))
    ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(_tick_bytes))
    if hline is not None:
        ax.axhline(hline[0], ls="--", c="grey", lw=1)
        ax.annotate(hline[1], (ax.get_xlim()[0], hline[0]), textcoords="offset points", xytext=(4, 4),
                    fontsize=MIN_FONT_PT, color="grey")
    if vline is not None:
        ax.axvline(vline[0], ls=":", c=PALETTE[3], lw=1)
        ax.annotate(vline[1], (vline[0], ax.get_ylim()[1]), textcoords="offset points", xytext=(4, -12),
                    fontsize=MIN_FONT_PT, color=PALETTE[3])
    ax.set_xlabel("copy size")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    legend_outside(ax)
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
        _, ax = subplots(figsize=(7, 3.5))
    rects = ax.bar(range(len(values)), values, color=[color_for(label) for label in labels])
    ax.set_xticks(range(len(values)), labels, rotation=15, ha="right")
    if logy:
        ax.set_yscale("log")
    for r, v in zip(rects, values):
        ax.annotate(annotate.format(v), (r.get_x() + r.get_width() / 2, r.get_height()),
                    ha="center", va="bottom", fontsize=MIN_FONT_PT)
    headroom(ax)
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
        _, ax = subplots(figsize=(MAX_WIDTH_IN, 0.8 + 0.7 * len(lanes)))
    colors = {}
    for row, (lane, spans) in enumerate(lanes.items()):
        for start, end, label in spans:
            if end < start:
                raise ValueError(f"span {label!r} in lane {lane!r} ends before it starts ({start} > {end})")
            c = colors.setdefault(label, color_for(label))
            ax.broken_barh([(start, max(end - start, 1e-3))], (row - 0.35, 0.7), color=c)
    ax.set_yticks(range(len(lanes)), list(lanes))
    ax.invert_yaxis()
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    legend_outside(ax, handles, list(colors), ncols=min(4, len(colors)) if colors else None)
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.grid(True, axis="x", alpha=0.3)
    return ax
