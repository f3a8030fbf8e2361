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


# ---------------------------------------------------------------------------------------------
# every kind of figure the lessons show, drawn from the recorded GPU run as the notebooks draw it

import statistics  # noqa: E402
import warnings  # noqa: E402

import matplotlib.colors as mcolors  # noqa: E402

from pinlab import replay  # noqa: E402

TAG = "NVIDIA H200, recorded 2026-12-01"  # as long as a replayed run's tag


def _rec(name):
    return replay.load_recorded(name)["result"]


def _fig_01_bandwidth():
    from pinlab.lessons import l01_pinned_memory as bw
    rows = [{"bytes": r["bytes"], **{k[:-3]: bw.gbps(r["bytes"], r[k]) for k in r if k.endswith("_ms")}}
            for r in _rec("01_bandwidth")]
    return plots.size_sweep([r["bytes"] for r in rows], {k.replace("_", " "): [r[k] for r in rows] for k in (
        "h2d_pinned", "h2d_pageable", "d2h_pinned", "d2h_pageable")}, ylabel="GB/s",
        title=f"Copy bandwidth, one copy timed alone ({TAG})").figure


def _fig_01_latency():
    lat = _rec("01_latency")
    return plots.size_sweep([r["bytes"] for r in lat], {
        "one copy timed alone (host launch + copy)": [r["alone_us"] for r in lat],
        "interval between copies in a burst (copy engine)": [r["burst_us"] for r in lat]},
        ylabel="µs per pinned H2D copy", title=f"Time per copy ({TAG})").figure


def _fig_01_pin_cost():
    r = next(r for r in _rec("01_pin_cost") if r["bytes"] == 256 * 2**20)
    return plots.bars(["pageable H2D", "cold pin_memory() + H2D", "warm pin_memory() + H2D", "pinned H2D"],
                      [r["h2d_pageable_ms"], r["pin_memory_cold_ms"] + r["h2d_pinned_ms"],
                       r["pin_memory_warm_ms"] + r["h2d_pinned_ms"], r["h2d_pinned_ms"]],
                      ylabel="host ms until the data is on the GPU", title=f"Moving 256 MiB once ({TAG})",
                      annotate="{:.1f}").figure


def _fig_01_pin_threads():
    from pinlab.lessons import l01_pinned_memory as bw
    return bw.plot_pin_threads(_rec("01_pin_threads")["rows"], title=f"Pinning 32 x 4 MiB from several threads "
                               f"({TAG})").figure


def _fig_02_single_copy():
    from pinlab.lessons import l02_fake_non_blocking as stalls
    res = _rec("02_single_copy")
    rows, busy = res["rows"], res["busy_ms"]
    sizes = [r["bytes"] for r in rows]
    first = stalls.first_waiting_size(sizes, [r["copy_pageable_ms"] for r in rows], busy / 2)
    series = {k.replace("_ms", "").replace("_", " "): [r[k] for r in rows]
              for k in ("copy_pageable_ms", "to_pageable_ms", "copy_pinned_ms", "to_pinned_ms")}
    return plots.size_sweep(sizes, series, ylabel="host ms inside the call", hline=(busy, "GPU busy time"),
                            vline=(first, "every copy from here on waited") if first else None,
                            title=f"One non_blocking H2D call behind a busy GPU ({TAG})").figure


def _fig_02b_step_loop():
    loop = _rec("02_step_loop")
    fig, axes = plots.stacked(2, height=3.0, sharex=True)
    for ax, mode in zip(axes, ("pageable", "pinned")):
        m = loop["modes"][mode]
        plots.timeline({"host": m["host"], "GPU": m["gpu"]}, title=f"{mode} inputs", ax=ax)
        ax.set_ylim(1.5, -1.6)
    fig.suptitle(f"Six steps from the profiler trace ({TAG})")
    fig.tight_layout()  # as the lesson's cell does: the constrained layout stays
    return fig


def _fig_02b_overlap():
    from pinlab.lessons import l02b_overlapping_copies as ov
    return ov.plot_overlap(_rec("02_overlap")["modes"], title=f"Six steps from the profiler trace: compute "
                               f"kernels and copies ({TAG})")


def _fig_02b_many():
    from pinlab.lessons import l02b_overlapping_copies as ov
    return ov.plot_many_tensors(_rec("02_many_tensors")["rows"], title=f"N host tensors to the GPU, host time "
                                    f"({TAG})")


def _fig_03_paged_kv():
    from pinlab import paged_kv
    from pinlab.lessons import l03_the_race as l03
    import torch
    meta = paged_kv.build_metadata(torch.tensor([[5, 1, 0], [2, 6, 3], [4, 0, 0]], dtype=torch.int32),
                                   torch.tensor([6, 9, 3], dtype=torch.int32), 4)
    return l03.plot_paged_kv(meta.indptr_cpu, meta.indices, meta.last_page_len_cpu, 4, 8,
                             title="Three requests in a paged KV cache of 8 pages of 4 tokens").figure


def _fig_03_model():
    from pinlab import steploop
    sim = steploop.simulate("reused_pinned", steps=6, host_ms=0.1, launch_ms=0.1, copy_ms=0.05, gpu_ms=1.0)
    return plots.timeline({"host": sim["host"], "GPU": sim["gpu"]}, title="One reused pinned buffer (model)").figure


def _fig_03_received():
    from pinlab.lessons import l03_the_race as l03
    return l03.plot_received(_rec("03_plain_race")["runs"], title=f"Which step's data each copy delivered "
                             f"({TAG})").figure


def _fig_03_errors():
    from pinlab.lessons import l03_the_race as l03
    return l03.plot_errors(_rec("03_decode_race"), "reused_pinned", title=f"Reused pinned buffer: error per request "
                           f"and step ({TAG})").figure


def _fig_03_step_parts():
    from pinlab.lessons import l03_the_race as l03
    return l03.plot_step_parts(_rec("03_pageable_cost"), title=f"Where the host's loop time went ({TAG})").figure


def _fig_03_launch_queue():
    from pinlab.lessons import l03_the_race as l03
    return l03.plot_launch_queue(_rec("03_launch_queue"), title=f"Launch calls behind a busy GPU ({TAG})").figure


def _fig_04_trap():
    from pinlab.lessons import l03_the_race as l03
    return l03.plot_received(_rec("04_pin_trap")["race"]["runs"], title=f"The trap: pin_memory() of a pinned buffer "
                             f"({TAG})").figure


def _fig_04_snapshot_cost():
    rows = _rec("04_snapshot_cost")["rows"]
    return plots.bars([plots.fmt_bytes(r["nbytes"]) for r in rows], [r["snapshot_extra_us"] for r in rows],
                      ylabel="host µs per step added by pin_memory()", title=f"The snapshot's host cost ({TAG})",
                      annotate="{:.1f}").figure


def _fig_04_soak():
    from pinlab.lessons import l04_the_fix as l04
    return l04.plot_soak(_rec("04_soak"), title=f"10,000 snapshots, three ways ({TAG})").figure


def _fig_04_history():
    from pinlab.lessons import l04_the_fix as l04
    return l04.plot_history(_rec("04_history"), title=f"The fixes compared ({TAG})")[0].figure


def _fig_04_shared_pool():
    from pinlab.lessons import l04_the_fix as l04
    return l04.plot_shared_pool(_rec("04_shared_pool"), title=f"6 tensors per step: pageable vs snapshot "
                                f"({TAG})").figure


def _fig_04_host_times():
    from pinlab.lessons import l04_the_fix as l04
    return l04.plot_host_times(_rec("04_fix_race"), title=f"A step's 6 metadata tensors, 10,000 steps each "
                               f"({TAG})")[0].figure


def _fig_05_restore():
    res = _rec("05_restore")
    methods = res["methods"]
    return plots.bars(list(methods), [v["warm_ms"] for v in methods.values()], ylabel="host ms per restore (warm)",
                      logy=True, title=f"Restoring 256 MiB of bf16 weights ({TAG})", annotate="{:.1f}").figure


def _fig_05_sleep_wake():
    from pinlab.lessons import l05_pinned_weight_restore as wr
    return wr.plot_sleep_wake(_rec("05_sleep_wake"), tag=TAG)  # the lesson's own figure


def _fig_06(name, fields, logy):
    from pinlab.lessons import l06_device_side_indices as l06
    res = _rec(name)["mixes"]
    fig, axes = plots.stacked(2, height=3.4)
    for ax, f in zip(axes, fields):
        l06.plot_by_mix({m: {k: res[m][k][f] for k in l06.BUILDERS} for m in res}, ylabel=f, logy=logy,
                        title=f"{f} ({TAG})", ax=ax)
    plt.tight_layout()  # as the lesson's cell does: the constrained layout stays
    return fig


def _fig_06_mask():
    from pinlab.lessons import l06_device_side_indices as l06
    res = _rec("06_mask_times")
    forms = res["forms"]
    return plots.bars([l06.MASK_FORMS[k] for k in forms], [forms[k]["host_us"] for k in forms],
                      ylabel="host µs per call", title=f"A {res['bytes'] // 1024} KiB streaming mask onto the GPU "
                      f"({TAG})", annotate="{:.0f}").figure


def _fig_07(name, key=None):
    from pinlab.lessons import l07_capstone_audit as l07
    res = _rec(name)
    return l07.plot_timelines(res[key] if key else res, title=f"host vs GPU ({TAG})")


def _fig_08_host_cost():
    """Lesson 08's cell draws with plain matplotlib, after pinlab.header() applied the course style."""
    rows = _rec("08_host_cost")["rows"]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot([r["kernels"] for r in rows], [r["eager_us"] for r in rows], "o-", label="eager launches")
    ax.plot([r["kernels"] for r in rows], [r["replay_us"] for r in rows], "s-", label="one g.replay()")
    ax.set(xlabel="kernels per step", ylabel="host µs per step (median)", title=f"Host cost per step ({TAG})")
    return fig


GALLERY = {
    "01 bandwidth": _fig_01_bandwidth, "01 latency": _fig_01_latency, "01 pin cost": _fig_01_pin_cost,
    "01 pin threads": _fig_01_pin_threads, "02 single copy": _fig_02_single_copy,
    "02b step loop": _fig_02b_step_loop, "02b overlap": _fig_02b_overlap, "02b many tensors": _fig_02b_many,
    "03 paged KV": _fig_03_paged_kv, "03 model": _fig_03_model, "03 received": _fig_03_received,
    "03 errors": _fig_03_errors, "03 step parts": _fig_03_step_parts, "03 launch queue": _fig_03_launch_queue,
    "04 trap": _fig_04_trap, "04 snapshot cost": _fig_04_snapshot_cost, "04 soak": _fig_04_soak,
    "04 history": _fig_04_history, "04 shared pool": _fig_04_shared_pool, "04 host times": _fig_04_host_times,
    "05 restore": _fig_05_restore, "05 sleep wake": _fig_05_sleep_wake,
    "06 builder times": lambda: _fig_06("06_builder_times", ("host_us", "e2e_us"), True),
    "06 step loop": lambda: _fig_06("06_step_loop", ("ms_per_step", "gpu_idle_share"), False),
    "06 mask": _fig_06_mask, "07 planted": lambda: _fig_07("07_timeline_planted"),
    "07 before after": lambda: _fig_07("07_before_after", "timeline"), "08 host cost": _fig_08_host_cost,
}
#: colours that are no series' colour: greys (grid, reference lines, empty slots), black, white
_NEUTRAL = lambda rgb: max(rgb) - min(rgb) < 0.02  # noqa: E731
_PALETTE = {mcolors.to_hex(c) for c in plots.PALETTE}


def _series_colours(fig) -> set[str]:
    """The colours of what a figure draws (lines, markers, bars, spans), images (a colour map) left out."""
    out = set()
    for ax in fig.axes:
        if ax.get_label() == "<colorbar>":
            continue
        for line in ax.get_lines():
            for c in (line.get_color(), line.get_markerfacecolor()):
                if isinstance(c, str) and c.lower() in ("none", "auto"):
                    continue
                out.add(mcolors.to_hex(c))
        for p in ax.patches:
            if p.get_fill() and p.get_facecolor()[3] > 0:
                out.add(mcolors.to_hex(p.get_facecolor()))
        for coll in ax.collections:
            for fc in coll.get_facecolors():
                if fc[3] > 0:
                    out.add(mcolors.to_hex(fc))
    return {c for c in out if not _NEUTRAL(mcolors.to_rgb(c))}


def _overlap(a, b, slack: float = 1.0) -> bool:
    return a.x0 < b.x1 - slack and b.x0 < a.x1 - slack and a.y0 < b.y1 - slack and b.y0 < a.y1 - slack


def _texts(ax):
    """The texts drawn inside or beside an axes that must not cover one another: annotations (values, line
    labels), its title and its legend's labels."""
    out = [t for t in ax.texts if t.get_visible() and t.get_text().strip()]
    if ax.title.get_text():
        out.append(ax.title)
    if ax.get_legend():
        out += [t for t in ax.get_legend().get_texts() if t.get_text()]
    return out


def legibility_problems(fig) -> list[str]:
    """What makes a figure hard to read at a page's width: wider than the column, text under 9 pt, a legend over
    a panel's data area, texts over each other, colours outside the course palette."""
    problems = []
    if fig.get_size_inches()[0] * 100 > MAX_PX + 0.5:
        problems.append(f"{fig.get_size_inches()[0] * 100:.0f} px wide (at most {MAX_PX})")
    fig.canvas.draw()
    small = sorted({t.get_fontsize() for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()
                    and t.get_fontsize() < plots.MIN_FONT_PT})
    if small:
        problems.append(f"text under {plots.MIN_FONT_PT} pt: {small}")
    r = fig.canvas.get_renderer()
    data_axes = [a for a in fig.axes if a.get_label() != "<colorbar>" and a.axison]
    fig_box = fig.bbox
    for ax in data_axes:  # one column of panels: each is most of the figure's width, not squeezed by a legend
        if ax.get_subplotspec() is not None and ax.get_subplotspec().get_gridspec().ncols == 1:
            share = ax.get_window_extent(r).width / fig_box.width
            if share < 0.5:
                problems.append(f"the axes {ax.get_title()!r} are {share:.0%} of the figure's width")
    legends = [a.get_legend() for a in fig.axes if a.get_legend()] + list(fig.legends)
    for lg in legends:
        if lg.get_window_extent(r).width > fig_box.width + 1:
            problems.append(f"a legend ({lg.get_texts()[0].get_text()!r}...) is wider than the figure")
        for ax in data_axes:
            if _overlap(lg.get_window_extent(r), ax.get_window_extent(r)):
                problems.append(f"a legend ({lg.get_texts()[0].get_text()!r}...) lies over the data of "
                                f"{ax.get_title()!r}")
    texts = [t for ax in fig.axes for t in _texts(ax)] + ([fig._suptitle] if fig._suptitle else [])
    boxes = [(t, Text.get_window_extent(t, r)) for t in texts]  # the text itself, not its arrow
    for i, (t1, b1) in enumerate(boxes):
        for t2, b2 in boxes[i + 1:]:
            if _overlap(b1, b2):
                problems.append(f"{t1.get_text()!r} is drawn over {t2.get_text()!r}")
    off = _series_colours(fig) - _PALETTE
    if off:
        problems.append(f"colours outside the course palette: {sorted(off)}")
    return problems


@pytest.mark.parametrize("name", sorted(GALLERY))
def test_every_lesson_figure_is_legible_and_in_the_course_style(name):
    """Each kind of figure the lessons show, drawn from the recorded run as its notebook draws it: at most 740 px
    wide, text of at least 9 pt, no legend over data, no text over text, the course palette, constrained layout,
    and no warning from matplotlib while it is drawn."""
    plots.use_course_style()  # what pinlab.header() does in each notebook's first cell
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fig = GALLERY[name]()
        assert not legibility_problems(fig), f"{name}: " + "; ".join(legibility_problems(fig))
    assert fig.get_layout_engine().__class__.__name__ == "ConstrainedLayoutEngine", name
    plt.close("all")


def test_the_legibility_check_finds_the_old_faults():
    """The check must fail on the faults the lessons' figures had: a legend in the data (03's stacked bars), a label
    over a bar's value (04's "no copy" over "8.5"), a legend under a panel without room (05's sleep/wake), tab
    colours, a figure 1000 px wide."""
    import matplotlib.figure
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    def figure(**kw):  # no layout engine: how the figures were drawn before
        fig = matplotlib.figure.Figure(layout="none", **kw)
        FigureCanvasAgg(fig)
        return fig

    # a legend inside the axes, default colours of another cycle
    fig = figure(figsize=(7, 4))
    ax = fig.add_subplot()
    ax.bar([0, 1], [3, 4], color="tab:red", label="copy call")
    ax.legend(loc="upper left")
    found = legibility_problems(fig)
    assert any("lies over the data" in p for p in found) and any("outside the course palette" in p for p in found)
    # a value label and a line label over one another
    fig = figure(figsize=(7, 3))
    ax = fig.add_subplot()
    b = ax.bar([0], [8.5], color=plots.PALETTE[0])[0]
    ax.annotate("8.5", (b.get_x() + b.get_width() / 2, 8.5), ha="center", va="bottom", fontsize=9)
    ax.annotate("no copy", (0, 8.5), textcoords="offset points", xytext=(2, 3), fontsize=9)
    assert any("is drawn over" in p for p in legibility_problems(fig))
    # two stacked panels without a layout: the upper legend lies over the lower panel
    fig = figure(figsize=(7.4, 7.2))
    a1, a2 = fig.subplots(2, 1)
    for a in (a1, a2):
        plots.size_sweep([1, 2, 4], {f"s{i}": [1, 2, 3] for i in range(5)}, ylabel="ms", title="t", ax=a)
    assert any("lies over the data" in p for p in legibility_problems(fig))
    assert any("px wide" in p for p in legibility_problems(figure(figsize=(10, 2))))


def test_the_palette_is_the_colour_cycle_and_figures_use_constrained_layout():
    plots.use_course_style()
    cycle = [mcolors.to_hex(c) for c in matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]]
    assert cycle == [mcolors.to_hex(c) for c in plots.PALETTE]
    assert matplotlib.rcParams["figure.constrained_layout.use"]
    fig, ax = plt.subplots()  # a plain figure, as a lesson cell draws one: the palette, constrained layout
    line, = ax.plot([0, 1])
    assert mcolors.to_hex(line.get_color()) == plots.PALETTE[0]
    fig, axes = plots.stacked(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "The figure layout has changed to tight"
        fig.tight_layout()
    assert fig.get_layout_engine().__class__.__name__ == "ConstrainedLayoutEngine"
    assert repr(fig).startswith("<Figure size 740x520 with 2 Axes>")  # the notebooks' compared output line
    plt.close("all")


def test_header_applies_the_course_style(monkeypatch, capsys):
    """Every notebook calls pinlab.header() first: from then on its figures are retina and in the palette, also
    those drawn with plain matplotlib before pinlab.plots is imported (lesson 08's)."""
    import pinlab

    calls = []
    shell = types.SimpleNamespace(run_line_magic=lambda *a: calls.append(a))
    monkeypatch.setitem(__import__("sys").modules, "IPython", types.SimpleNamespace(get_ipython=lambda: shell))
    matplotlib.rcParams["axes.prop_cycle"] = matplotlib.cycler(color=["#123456"])
    pinlab.header("x")
    assert ("config", "InlineBackend.figure_formats = ['retina']") in calls
    assert matplotlib.rcParams["axes.prop_cycle"].by_key()["color"][0] == plots.PALETTE[0]
    capsys.readouterr()
