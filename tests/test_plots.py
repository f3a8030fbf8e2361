"""Plot helpers draw what they are given and reject malformed input."""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from pinlab import plots  # noqa: E402


def test_fmt_bytes():
    assert [plots.fmt_bytes(n) for n in (512, 1024, 3 << 20, 1536, 1 << 30)] == [
        "512 B", "1 KiB", "3 MiB", "1.5 KiB", "1 GiB"]


def test_size_sweep_draws_one_line_per_series():
    ax = plots.size_sweep([1, 2, 4], {"a": [1, 2, 3], "b": [3, None, 1]}, ylabel="y", title="t",
                          hline=(2, "peak"), vline=(2, "threshold"))
    assert len(ax.get_lines()) == 2 + 2  # two series, one hline, one vline
    assert list(ax.get_lines()[1].get_xdata()) == [1, 4]  # None skipped
    plt.close("all")


def test_size_sweep_rejects_mismatched_series():
    with pytest.raises(ValueError, match="has 2 values for 3 sizes"):
        plots.size_sweep([1, 2, 3], {"a": [1, 2]}, ylabel="y", title="t")
    with pytest.raises(TypeError, match="non-empty dict"):
        plots.size_sweep([1], {}, ylabel="y", title="t")


def test_bars_and_timeline():
    ax = plots.bars(["a", "b"], [1.0, 2.0], ylabel="ms", title="t")
    assert len(ax.patches) == 2
    with pytest.raises(ValueError, match="equally long"):
        plots.bars(["a"], [1, 2], ylabel="ms", title="t")
    ax = plots.timeline({"host": [(0, 1, "prep")], "GPU": [(0.5, 3, "kernel"), (3, 4, "copy")]}, title="t")
    assert len(ax.collections) == 3
    with pytest.raises(ValueError, match="ends before it starts"):
        plots.timeline({"host": [(2, 1, "x")]}, title="t")
    plt.close("all")


@pytest.mark.parametrize("n, text", [(0, "0 B"), (1023, "1023 B"), (1024, "1 KiB"), (1025, "1.0 KiB"),
                                     (2**20 - 1, "1.0 MiB"), (2**20 - 2**9, "1023.5 KiB"), (2**20, "1 MiB"), (2**40, "1 TiB"),
                                     (2**50, "1 PiB"), (2**60, "1 EiB"), (2**70, "1024 EiB")])
def test_fmt_bytes_units(n, text):
    assert plots.fmt_bytes(n) == text


@pytest.mark.parametrize("bad, exc", [(float("inf"), ValueError), (float("nan"), ValueError), (-1, ValueError),
                                      ("1024", TypeError), (None, TypeError), (True, TypeError)])
def test_fmt_bytes_rejects_nonsense(bad, exc):
    with pytest.raises(exc, match="n must be"):
        plots.fmt_bytes(bad)


def test_plot_helpers_name_the_bad_argument():
    with pytest.raises(ValueError, match=r"sizes\[1\] must be > 0"):
        plots.size_sweep([1, 0], {"a": [1, 2]}, ylabel="y", title="t")
    with pytest.raises(ValueError, match=r"series\['a'\]\[0\] must be finite"):
        plots.size_sweep([1, 2], {"a": [float("nan"), 2]}, ylabel="y", title="t")
    with pytest.raises(TypeError, match="hline must be None or a"):
        plots.size_sweep([1, 2], {"a": [1, 2]}, ylabel="y", title="t", hline=3)
    with pytest.raises(TypeError, match="title must be a str"):
        plots.size_sweep([1, 2], {"a": [1, 2]}, ylabel="y", title=None)
    with pytest.raises(TypeError, match=r"values\[1\] must be a number"):
        plots.bars(["a", "b"], [1, "x"], ylabel="y", title="t")
    with pytest.raises(ValueError, match="values must be > 0 on a log axis"):
        plots.bars(["a", "b"], [1, 0], ylabel="y", title="t", logy=True)
    with pytest.raises(ValueError, match="annotate must be a format string"):
        plots.bars(["a"], [1], ylabel="y", title="t", annotate="{x}")
    with pytest.raises(TypeError, match=r"lanes\['host'\]\[0\] must be a \(start, end, label\)"):
        plots.timeline({"host": [(0, 1)]}, title="t")
    with pytest.raises(ValueError, match=r"lanes\['host'\]\[0\] end must be finite"):
        plots.timeline({"host": [(0, float("inf"), "x")]}, title="t")
    plt.close("all")


def test_size_axis_ticks_in_bytes():
    ax = plots.size_sweep([1024, 2**20], {"a": [1, 2]}, ylabel="y", title="t")
    fmt = ax.xaxis.get_major_formatter()
    assert fmt(1024, 0) == "1 KiB" and fmt(2**20, 0) == "1 MiB" and fmt(-1, 0) == ""
    plt.close("all")


def test_a_long_suptitle_wraps_instead_of_widening_the_figure():
    """Stop 60: an H100's name in lesson 02b's title widened the saved figure (1503 -> 1626 px), and at 390 px the
    site showed its 9-pt text under 9 px. A course figure's suptitle wraps; the saved image keeps its width."""
    import io
    import struct

    def width(title):
        fig, axes = plots.subplots(2, 1, figsize=(plots.MAX_WIDTH_IN, 4.0), squeeze=False)
        for ax in axes[:, 0]:
            ax.plot([0, 1], [0, 1])
        fig.suptitle(title)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", bbox_inches="tight", dpi=100)
        plt.close(fig)
        return struct.unpack(">I", buf.getvalue()[16:20])[0]

    short = width("Six steps")
    long = width("Six steps from the profiler trace: compute kernels and copies (measured on NVIDIA H100 80GB HBM3, "
                 "torch 2.11.0+cu130, in this run, quiet)")
    assert long <= short + 2, (short, long)
