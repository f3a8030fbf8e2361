"""Lesson 05 on a CPU: the model, the argument checks, copy counting on the emulated stream, the
reference footprint, the GPU harnesses' refusal without CUDA, and Part 1 of the notebook run live."""
import pathlib

import pytest
import torch

import nbtools
import pinlab
from pinlab.lessons import l05_pinned_weight_restore as wr

ROOT = nbtools.ROOT
SRC = ROOT / "notebooks" / "src" / "05_pinned_weight_restore.py"
MiB, GiB = wr.MiB, wr.GiB


def test_the_restore_model_is_llama_shaped_and_not_a_power_of_two():
    assert wr.mlp_shape_for(43 * 4096 * 4096 // 2) == (wr.HIDDEN, wr.INTER)
    m = wr.make_model(64, 172, 2)
    assert [tuple(p.shape) for p in m.parameters()] == [(172, 64), (64, 172)] * 2
    assert all(p.dtype == torch.bfloat16 for p in m.parameters())
    assert all(layer.bias is None for layer in m)
    w = wr.HIDDEN * wr.INTER * 2
    assert wr.pinned_footprint([w] * 4) == 4 * 128 * MiB  # 86 MiB weights in 128 MiB blocks


def test_make_model_is_reproducible():
    a, b = wr.make_model(64, 172, 1, seed=3), wr.make_model(64, 172, 1, seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    c = wr.make_model(64, 172, 1, seed=4)
    assert not torch.equal(next(a.parameters()), next(c.parameters()))
    assert wr.param_bytes(a) == [64 * 172 * 2] * 2


def test_sleep_sizes_stay_in_budget():
    for target in wr.SLEEP_SIZES:
        h, i = wr.mlp_shape_for(target)
        nbytes = 2 * 2 * h * i * wr.BLOCKS
        assert 0.9 * target <= nbytes <= 1.1 * target
        assert wr.pinned_footprint([h * i * 2] * (2 * wr.BLOCKS)) <= 4 * GiB
    assert wr.SLEEP_SIZES[0] == 64 * MiB and wr.SLEEP_SIZES[-1] >= 2 * GiB


@pytest.mark.parametrize("module, target, exc, match", [
    ("weights.pt", None, TypeError, "must be a torch.nn.Module"),
    (torch.nn.Linear(2, 2, device="meta"), None, ValueError, "meta device"),
    (torch.nn.Linear(2, 2), "cuda:99", ValueError, "does not exist"),
    (torch.nn.Linear(2, 2), "gpu", ValueError, "not a device name"),
    (torch.nn.Linear(2, 2), "mps", ValueError, "restores to 'cuda' or 'cpu'"),
])
def test_bad_input_gets_a_clear_error(module, target, exc, match):
    with pytest.raises(exc, match=match):
        wr.check_restore_args(module, target)


def test_no_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("PINLAB_FORCE_CPU", "1")
    with pytest.raises(pinlab.CudaUnavailableError, match="needs a CUDA GPU"):
        wr.check_restore_args(torch.nn.Linear(2, 2), "cuda")
    assert wr.check_restore_args(torch.nn.Linear(2, 2), "cpu") == torch.device("cpu")


def test_copies_counted_on_the_emulated_stream():
    with pinlab.LaggingStream() as s:
        w = torch.randn(64, 64).to(torch.bfloat16).to(s.device)
        ref = w.cpu()  # a host copy to compare with: torch.equal refuses tensors on two devices
        pageable, ops1 = wr.count_copies(lambda: w.to("cpu"))
        two, ops2 = wr.count_copies(lambda: w.to("cpu").pin_memory())
        one, ops3 = wr.count_copies(lambda: torch.empty_like(w, device="cpu", pin_memory=True).copy_(w))
        assert (len(ops1), len(ops2), len(ops3)) == (1, 2, 1)
        assert (pageable.is_pinned(), two.is_pinned(), one.is_pinned()) == (False, True, True)
        assert all(torch.equal(t, ref) for t in (pageable, two, one))


def test_count_copies_on_plain_cpu_ops():
    t = torch.arange(10)
    assert wr.count_copies(lambda: t.clone())[1] == ["clone"]
    assert wr.count_copies(lambda: torch.empty(10).copy_(t))[1] == ["copy_"]
    assert wr.count_copies(lambda: t.view(2, 5))[1] == []
    with pytest.raises(TypeError, match="callable"):
        wr.count_copies(3)


def test_pinned_footprint_reference():
    assert wr.pinned_footprint([]) == 0
    assert wr.pinned_footprint([0, 1, 2, 3]) == 1 + 2 + 4
    assert wr.pinned_footprint([129 * MiB + 512 * 1024]) == 256 * MiB
    with pytest.raises(TypeError):
        wr.pinned_footprint(5)
    with pytest.raises(ValueError):
        wr.pinned_footprint([-1])


def test_gpu_harnesses_need_cuda(monkeypatch):
    monkeypatch.setenv("PINLAB_FORCE_CPU", "1")
    f = lambda w: w  # noqa: E731
    for call in (lambda: wr.time_restores({"f": f}), lambda: wr.d2h_copy_loop_peak(),
                 lambda: wr.sleep_wake_sweep(f, f), lambda: wr.zero_copy_matmul(f)):
        with pytest.raises(pinlab.CudaUnavailableError):
            call()


def test_harnesses_check_their_arguments():
    with pytest.raises(TypeError, match="non-empty dict"):
        wr.time_restores({})
    with pytest.raises(TypeError, match="callable"):
        wr.time_restores({"x": 3})
    with pytest.raises(TypeError, match="callable"):
        wr.sleep_wake_sweep(3, lambda m, d: None)
    with pytest.raises(ValueError, match="sizes"):
        wr.sleep_wake_sweep(lambda m, p: None, lambda m, d: None, sizes=[])


def test_lesson_module_is_short():
    assert len(pathlib.Path(wr.__file__).read_text().splitlines()) <= 500


def test_part_1_of_the_notebook_runs_live_on_the_emulated_stream(capsys):
    """Every code cell before Part 2 (the measured part) runs here, its assertions included."""
    text = SRC.read_text(encoding="utf-8")
    part1 = text[: text.index("# # Part 2")]
    ns = {}
    import matplotlib

    matplotlib.use("Agg")
    for cell in nbtools.parse_percent(part1):
        if cell["cell_type"] == "code":
            exec(compile(cell["source"], str(SRC), "exec"), ns)
    out = capsys.readouterr().out
    assert "to_cpu_pin_memory  copies: 2, pinned: True, bitwise equal: True" in out
    assert "from empty_pinned_copy : 5 queued items" in out and "from to_cpu            : 0 queued" in out
    assert "no rounding in the emulation): True" in out


def test_every_measured_experiment_is_named_for_lesson_05():
    import ast

    calls = [n for n in ast.walk(ast.parse(SRC.read_text(encoding="utf-8"))) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Attribute) and n.func.attr == "measure"
             and getattr(n.func.value, "id", None) == "pinlab" and n.args and isinstance(n.args[0], ast.Constant)]
    names = [n.args[0].value for n in sorted(calls, key=lambda n: n.lineno)]
    assert names == ["05_d2h_copy_loop_peak", "05_restore", "05_sleep_wake", "05_zero_copy"]


def test_plot_sleep_wake_draws_the_recorded_sweep_and_names_bad_rows():
    """The lesson's sleep/wake figure (the notebook calls it; tests/test_plot_style.py checks its style)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [{"bytes": b, "pinned_cold_sleep_ms": 1.0, "pinned_warm_sleep_ms": 0.5, "pageable_sleep_ms": 2.0,
             "pinned_warm_wake_ms": 0.4, "pageable_wake_ms": 1.5, "pinned_cold_new_pinned_bytes": b} for b in (2**26, 2**28)]
    fig = wr.plot_sleep_wake(rows, tag="test")
    top, bottom = fig.axes[:2]
    assert [l.get_label() for l in top.get_lines()] == [label for _, label in wr.SLEEP_WAKE_SERIES]
    assert [l.get_label() for l in bottom.get_lines()] == ["weights", "pinned held while asleep"]
    assert top.get_title() == "Sleep / wake time (test)"
    plt.close(fig)
    with pytest.raises(TypeError, match="rows must be sleep_wake_sweep's"):
        wr.plot_sleep_wake([], tag="t")
    with pytest.raises(ValueError, match=r"rows lack \['pageable_wake_ms'\]"):
        wr.plot_sleep_wake([{k: v for k, v in rows[0].items() if k != "pageable_wake_ms"}], tag="t")
