"""The course's plot style (lib/pinlab/plots.py): one colour per label everywhere, legends outside the
axes, text of at least 9 pt, figures at most 740 px wide, panels stacked, retina figures in Jupyter."""
import types

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.text import Text  # noqa: E402

from pinlab import plots  # noqa: E402

MAX_PX = 740


def _figures():
    sweep = plots.size_sweep([1, 2, 4], {"pinned": [1, 2, 3], "pageable": [3, 2, 1]}, ylabel="GB/s", title="t",
                             hline=(2, "peak"), vline=(2, "knee")).figure
    bars = plots.bars(["pinned", "pageable"], [1.0, 2.0], ylabel="ms", title="t").figure
    tl = plots.timeline({"host": [(0, 1, "prep")], "GPU": [(0.5, 3, "kernel"), (3, 4, "copy")]}, title="t").figure
    return sweep, bars, tl


def test_one_colour_per_label_across_figures():
    sweep, bars, _tl = _figures()
    line = {l.get_label(): matplotlib.colors.to_hex(l.get_color()) for l in sweep.axes[0].get_lines()}
    bar = [matplotlib.colors.to_hex(p.get_facecolor()) for p in bars.axes[0].patches]
    assert line["pinned"] == bar[0] == plots.color_for("pinned")
    assert line["pageable"] == bar[1] == plots.color_for("pageable") != line["pinned"]
    plt.close("all")


def test_legends_sit_outside_the_axes():
    for fig in _figures():
        fig.canvas.draw()
        ax = fig.axes[0]
        legend = ax.get_legend()
        if legend is None:
            continue  # bars label their x axis instead
        lb, ab = legend.get_window_extent(), ax.get_window_extent()
        assert lb.y1 <= ab.y0 + 1, "the legend is drawn below the axes, over no data"
        assert max(t.get_window_extent().y0 for t in ax.get_xticklabels() if t.get_text()) > lb.y1 - 1
    plt.close("all")


def test_text_is_at_least_9_pt_and_figures_at_most_740_px():
    for fig in _figures():
        assert fig.get_size_inches()[0] * 100 <= MAX_PX
        fig.canvas.draw()
        sizes = [t.get_fontsize() for t in fig.findobj(Text) if t.get_text().strip()]
        assert sizes and min(sizes) >= plots.MIN_FONT_PT, sizes
    plt.close("all")


def test_panels_are_stacked_at_page_width():
    fig, axes = plots.stacked(3, height=2.0, sharex=True)
    assert len(axes) == 3 and fig.get_size_inches()[0] * 100 <= MAX_PX
    xs = {round(ax.get_position().x0, 3) for ax in axes}
    assert len(xs) == 1, "one above the other"
    with pytest.raises(ValueError, match="n must be"):
        plots.stacked(0)
    plt.close("all")


def test_retina_inline_figures_in_ipython(monkeypatch):
    calls = []
    shell = types.SimpleNamespace(run_line_magic=lambda *a: calls.append(a))
    monkeypatch.setitem(__import__("sys").modules, "IPython", types.SimpleNamespace(get_ipython=lambda: shell))
    plots.use_course_style()
    assert ("config", "InlineBackend.figure_formats = ['retina']") in calls
    assert matplotlib.rcParams["xtick.labelsize"] >= plots.MIN_FONT_PT
