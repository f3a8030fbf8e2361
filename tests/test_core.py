"""Unit tests for pinlab's core: argument checks, timing, printing, GPU-only errors (all on CPU)."""

import pytest
import torch

import pinlab
from pinlab import args as _check, busy, timing
from pinlab.hostmem import next_pow2


def test_positive_int_accepts_and_rejects():
    assert _check.positive_int("n", 3) == 3
    assert _check.positive_int("n", 0, allow_zero=True) == 0
    with pytest.raises(ValueError, match="n must be > 0, got 0"):
        _check.positive_int("n", 0)
    with pytest.raises(ValueError, match="n must be > 0"):
        _check.positive_int("n", -4)
    with pytest.raises(TypeError, match="n must be an int, got float"):
        _check.positive_int("n", 2.5)
    with pytest.raises(TypeError, match="n must be an int, got bool"):
        _check.positive_int("n", True)


def test_positive_number_rejects_nan_inf_and_strings():
    assert _check.positive_number("ms", 2) == 2.0
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="ms must be finite"):
            _check.positive_number("ms", bad)
    with pytest.raises(TypeError, match="ms must be a number, got str"):
        _check.positive_number("ms", "5")
    with pytest.raises(ValueError, match="ms must be > 0"):
        _check.positive_number("ms", -1.0)


def test_size_list():
    assert _check.size_list("sizes", (1, 2)) == [1, 2]
    with pytest.raises(ValueError, match="sizes must not be empty"):
        _check.size_list("sizes", [])
    with pytest.raises(ValueError, match=r"sizes\[1\] must be > 0"):
        _check.size_list("sizes", [4, 0])
    with pytest.raises(TypeError, match="sizes must be a list of ints"):
        _check.size_list("sizes", 1024)


def test_one_of_and_callable():
    assert _check.one_of("mode", "a", {"a", "b"}) == "a"
    with pytest.raises(ValueError, match=r"mode must be one of \['a', 'b'\], got 'c'"):
        _check.one_of("mode", "c", {"a", "b"})
    with pytest.raises(TypeError, match="fn must be callable"):
        _check.callable_arg("fn", 3)


def test_stats_summary():
    s = timing.Stats.of([3.0, 1.0, 2.0, 10.0])
    assert (s.median, s.min, s.max, s.n) == (2.5, 1.0, 10.0, 4)
    with pytest.raises(ValueError):
        timing.Stats.of([])


@pytest.mark.parametrize("ms, text", [(0.0000005, "0 ns"), (0.0125, "12.5 µs"), (3.14159, "3.14 ms"),
                                      (2500.0, "2.50 s")])
def test_fmt_ms(ms, text):
    assert timing.fmt_ms(ms) == text


def test_host_time_counts_only_fn_not_setup():
    calls = []
    s = pinlab.host_time(lambda: calls.append("fn"), setup=lambda: calls.append("setup"), repeat=3, warmup=1)
    assert s.n == 3
    assert calls == ["setup", "fn"] * 4
    with pytest.raises(ValueError, match="repeat must be > 0"):
        pinlab.host_time(lambda: None, repeat=0)
    with pytest.raises(TypeError, match="setup must be callable"):
        pinlab.host_time(lambda: None, setup=5)


def test_report_and_show_prefixes(capsys):
    pinlab.report("copy", 0.5)
    pinlab.report("copy", timing.Stats.of([1.0, 2.0]))
    pinlab.report("rate", 55.123, unit="GB/s")
    pinlab.show("threshold", "3 MiB")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "[timing] copy: 500.0 µs"
    assert lines[1].startswith("[timing] copy: median 1.50 ms (min 1.00 ms, max 2.00 ms, n=2)")
    assert lines[2] == "[timing] rate: 55.1 GB/s"
    assert lines[3] == "[measured] threshold: 3 MiB"
    with pytest.raises(TypeError, match="label"):
        pinlab.report("", 1.0)


def test_table_aligns_and_validates(capsys):
    pinlab.table([{"a": 1, "b": "xy"}, {"a": 100, "b": "z"}], [("a", "A"), ("b", "Bee", str.upper)])
    out = capsys.readouterr().out.splitlines()
    assert out == ["  A  Bee", "  1   XY", "100    Z"]
    with pytest.raises(ValueError, match="rows must not be empty"):
        pinlab.table([], [("a", "A")])


def test_gpu_only_calls_say_so_in_one_sentence(monkeypatch):
    monkeypatch.setenv("PINLAB_FORCE_CPU", "1")
    with pytest.raises(pinlab.CudaUnavailableError, match=r"^gpu_busy\(\) needs a CUDA GPU"):
        pinlab.gpu_busy(5)
    with pytest.raises(pinlab.CudaUnavailableError, match="cuda_time"):
        pinlab.cuda_time(lambda: None)
    with pytest.raises(pinlab.CudaUnavailableError, match="cycles_per_ms"):
        busy.cycles_per_ms()


def test_gpu_busy_validates_before_needing_cuda():
    with pytest.raises(ValueError, match="ms must be > 0"):
        pinlab.gpu_busy(0)
    with pytest.raises(TypeError, match="ms must be a number"):
        pinlab.gpu_busy("10")


def test_warmup_calls_each_function():
    seen = []
    pinlab.warmup(lambda: seen.append(1), lambda: seen.append(2), repeat=2)
    assert seen == [1, 2, 1, 2]
    with pytest.raises(TypeError, match=r"fns\[0\] must be callable"):
        pinlab.warmup(None)


def test_wall_ms_is_positive():
    assert pinlab.wall_ms(lambda: sum(range(1000))) > 0


def test_next_pow2():
    assert [next_pow2(n) for n in (1, 2, 3, 1024, 1025)] == [1, 2, 4, 1024, 2048]
    assert next_pow2(129 * 2**20 + 2**19) == 256 * 2**20
    with pytest.raises(ValueError):
        next_pow2(0)


def test_force_cpu_switch(monkeypatch):
    monkeypatch.setenv("PINLAB_FORCE_CPU", "1")
    assert pinlab.has_cuda() is False
    monkeypatch.setenv("PINLAB_FORCE_CPU", "0")
    assert pinlab.has_cuda() is torch.cuda.is_available()


def test_facts_and_header_without_cuda(monkeypatch, capsys):
    monkeypatch.setenv("PINLAB_FORCE_CPU", "1")
    f = pinlab.header("xx")
    out = capsys.readouterr().out
    assert f["cuda_available"] is False and f["gpu"] is None and f["pinned_memory"] is False
    assert out.startswith("pinlab | xx\n")
    assert "CPU replay" in out


def test_host_stats_without_cuda_is_empty():
    if torch.cuda.is_available():
        pytest.skip("CPU-only behaviour")
    assert pinlab.host_stats() == {}
    assert pinlab.pinned_bytes_held() == 0
    assert pinlab.pinned_back_to(pinlab.pinned_baseline())


def test_doctor_reports_required_checks(capsys):
    rep = pinlab.doctor()
    names = [c["check"] for c in rep["checks"]]
    assert "import torch" in names and "CUDA GPU" in names and "FlashInfer" in names
    assert rep["ok"] is True
    assert "This machine shows:" in capsys.readouterr().out
