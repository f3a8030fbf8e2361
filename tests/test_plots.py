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
