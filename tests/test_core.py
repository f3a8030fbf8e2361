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


def test_callable_arg_asks_for_no_arguments_only_where_the_function_takes_none():
    with pytest.raises(TypeError, match=r"^fn must be callable \(a function\), got int$"):
        _check.callable_arg("fn", 3)
    with pytest.raises(TypeError, match=r"^fn must be callable \(a function of no arguments\), got int$"):
        _check.callable_arg("fn", 3, no_args=True)
    for call in (lambda: timing.host_time(3), lambda: timing.cuda_time(3), lambda: pinlab.warmup(3),
                 lambda: timing.host_time(lambda: None, setup=3)):   # called as fn(), setup(), each of fns()
        with pytest.raises(TypeError, match=r"a function of no arguments\)"):
            call()
    with pinlab.LaggingStream() as s, pytest.raises(TypeError) as info:
        s.launch(3)                                                  # launch(fn, *args, **kwargs)
    assert "no arguments" not in str(info.value)


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
    out = capsys.readouterr().out
    assert "This machine shows:" in out
    assert "Platform:" in out and "CPU cores usable:" in out and "experiments:" in out
    assert rep["platform_lines"] and rep["experiment_lines"]


# ----------------------------------------------------------------- the platform report (facts faked)

import importlib  # noqa: E402

doctor_mod = importlib.import_module("pinlab.doctor")  # pinlab.doctor is the function; this is its module

H200 = {"backend": "cuda", "gpu_usable": True, "wsl": False, "cpu_cores_usable": 16, "host_ram_available_gib": 120.0,
        "memlock_limit_gib": None, "pinned_limit_gib": None, "vram_limit_gib": None, "gpu": "NVIDIA H200",
        "integrated": False, "pageable_memory_access": False, "ats": False, "copy_engines": 3,
        "vram_total_gib": 139.7, "vram_free_gib": 139.1, "pcie_gen": 5, "pcie_gen_max": 5, "pcie_width": 16,
        "pcie_width_max": 16, "driver_cuda": "13.0", "wheel_cuda": "13.0", "other_gpu_processes": 0}
CPU_ONLY = {k: None for k in H200} | {"gpu_usable": False, "wsl": False, "cpu_cores_usable": 2,
                                      "host_ram_available_gib": 12.0, "wheel_cuda": None}


def _lines(p):
    return dict(doctor_mod.platform_lines(p))


def test_platform_lines_of_a_quiet_h200():
    lines = _lines(H200)
    assert lines["GPU"] == "NVIDIA H200 (CUDA)"
    assert lines["link"] == "PCIe Gen5 x16"
    assert lines["other processes on the GPU"] == "none: the GPU is yours"
    assert lines["VRAM"] == "139.1 GiB free of 139.7 GiB"
    assert lines["CUDA"] == "torch built for CUDA 13.0; the driver supports CUDA 13.0"
    assert _lines(H200 | {"driver_cuda": None})["CUDA"] == "torch built for CUDA 13.0"
    assert lines["CPU cores usable"] == "16" and lines["WSL2"] == "no"
    assert "stages every pageable copy" in lines["pageable host memory"]


def test_platform_lines_of_a_shared_colab_t4_under_wsl2():
    p = H200 | {"gpu": "Tesla T4", "pcie_gen": 1, "pcie_gen_max": 3, "wsl": True, "cpu_cores_usable": 2,
                "other_gpu_processes": 2, "vram_total_gib": 15.0, "vram_free_gib": 0.5, "memlock_limit_gib": 8 / 1024}
    lines = _lines(p)
    assert lines["link"].startswith("PCIe Gen1 x16 now, Gen3 x16 at most")
    assert lines["other processes on the GPU"].startswith("2: a shared GPU")
    assert lines["WSL2"].startswith("yes") and "profiler" in lines["WSL2"]
    assert lines["VRAM"] == "512 MiB free of 15.0 GiB"
    assert lines["pinned memory budget"].startswith("the host RAM available")  # memlock does not bound cudaHostAlloc
    assert _lines(p | {"pinned_limit_gib": 2.0})["pinned memory budget"] == "2.0 GiB ($PINLAB_PINNED_LIMIT_GIB)"


def test_platform_lines_of_a_gh200_and_of_rocm():
    gh = _lines(H200 | {"gpu": "NVIDIA GH200 480GB", "ats": True, "pageable_memory_access": True,
                        "pcie_gen": None, "pcie_width": None})
    assert "ATS" in gh["pageable host memory"] and "close to pinned" in gh["pageable host memory"]
    assert gh["link"].startswith("not reported")
    rocm = _lines(H200 | {"backend": "hip", "gpu": "AMD Instinct MI300X", "other_gpu_processes": None,
                          "copy_engines": None})
    assert rocm["GPU"] == "AMD Instinct MI300X (ROCm/HIP)" and "blocks the host" in rocm["ROCm"]
    assert rocm["other processes on the GPU"].startswith("unknown") and "copy engines" not in rocm


def test_platform_lines_without_a_gpu():
    lines = _lines(CPU_ONLY)
    assert lines["GPU"].startswith("none: this torch is CPU-only") and "replay" in lines["GPU"]
    assert "link" not in lines and lines["CPU cores usable"] == "2" and lines["host RAM available"] == "12.0 GiB"
    with pytest.raises(TypeError, match="platform_facts"):
        doctor_mod.platform_lines(["not", "a", "dict"])


def test_experiment_lines_say_what_replays_and_why(monkeypatch):
    assert doctor_mod.experiment_lines(CPU_ONLY)[0][1].startswith("all replay")
    monkeypatch.setattr(doctor_mod.probe, "REQUIREMENTS", {"05_sleep_wake": {"vram_gib": 6.5}, "06_launches": {"gpu_trace": True}})
    monkeypatch.setattr(doctor_mod.probe, "unmet", lambda need: ["it needs 6.5 GiB of free VRAM"] if "vram_gib" in need else [])
    lines = doctor_mod.experiment_lines(H200)
    assert lines == [("experiments", "live, except 1 that replay the recorded run:"),
                     ("replays 05_sleep_wake", "it needs 6.5 GiB of free VRAM")]
    monkeypatch.setattr(doctor_mod.probe, "unmet", lambda need: [])
    assert doctor_mod.experiment_lines(H200) == [("experiments", "all run live on this GPU")]


def test_doctor_prints_the_platform_it_is_given(monkeypatch, capsys):
    monkeypatch.setattr(doctor_mod.probe, "platform_facts", lambda: H200 | {"other_gpu_processes": 3})
    monkeypatch.setattr(doctor_mod.probe, "unmet", lambda need: [])
    rep = pinlab.doctor()
    out = capsys.readouterr().out
    assert "    GPU: NVIDIA H200 (CUDA)" in out and "    other processes on the GPU: 3: a shared GPU" in out
    assert "  experiments: all run live on this GPU" in out
    assert rep["platform"]["other_gpu_processes"] == 3


# ----------------------------------------------------------------- nonsense in, a clear error out

@pytest.mark.parametrize("bad, exc, match", [
    (-5.0, ValueError, "ms must be >= 0, got -5.0"),
    (float("nan"), ValueError, "ms must be finite"),
    (float("inf"), ValueError, "ms must be finite"),
    ("3", TypeError, "ms must be a number, got str"),
    (None, TypeError, "ms must be a number"),
    (True, TypeError, "ms must be a number, got bool"),
])
def test_fmt_ms_rejects_nonsense(bad, exc, match):
    with pytest.raises(exc, match=match):
        timing.fmt_ms(bad)


@pytest.mark.parametrize("ms, text", [(0, "0 ns"), (0.000999, "999 ns"), (0.001, "1.0 µs"), (0.999, "999.0 µs"),
                                      (1.0, "1.00 ms"), (999.0, "999.00 ms"), (1000.0, "1.00 s")])
def test_fmt_ms_units_at_the_boundaries(ms, text):
    assert timing.fmt_ms(ms) == text


@pytest.mark.parametrize("value, unit, exc, match", [
    (-1.0, "ms", ValueError, "value must be >= 0"),
    (float("nan"), "ms", ValueError, "value must be finite"),
    (-3.0, "GB/s", ValueError, "value must be >= 0"),
    (float("inf"), "GB/s", ValueError, "value must be finite"),
    ("fast", "ms", TypeError, "value must be a number"),
    (1.0, 3, TypeError, "unit must be a str"),
])
def test_report_rejects_nonsense(value, unit, exc, match, capsys):
    with pytest.raises(exc, match=match):
        pinlab.report("x", value, unit=unit)
    assert capsys.readouterr().out == ""  # nothing half-printed


def test_labels_are_one_line():
    with pytest.raises(ValueError, match="label must be one line"):
        pinlab.show("a\nb", 1)
    with pytest.raises(TypeError, match="label must be a non-empty str"):
        pinlab.show(None, 1)


def test_stats_of_rejects_nonsense():
    with pytest.raises(ValueError, match=r"samples_ms\[1\] must be >= 0"):
        timing.Stats.of([1.0, -2.0])
    with pytest.raises(ValueError, match=r"samples_ms\[0\] must be finite"):
        timing.Stats.of([float("nan")])
    with pytest.raises(TypeError, match=r"samples_ms\[0\] must be a number"):
        timing.Stats.of(["a"])
    with pytest.raises(TypeError, match="samples_ms must be a list"):
        timing.Stats.of(3.0)


def test_table_rejects_malformed_rows_and_columns():
    with pytest.raises(ValueError, match=r"rows\[1\] has no key 'a'"):
        pinlab.table([{"a": 1}, {"b": 2}], [("a", "A")])
    with pytest.raises(TypeError, match=r"rows\[0\] must be a dict"):
        pinlab.table([[1]], [("a", "A")])
    with pytest.raises(ValueError, match="columns: each must be"):
        pinlab.table([{"a": 1}], ["a"])
    with pytest.raises(ValueError, match="columns must not be empty"):
        pinlab.table([{"a": 1}], [])
    with pytest.raises(TypeError, match="rows must be a list of dicts"):
        pinlab.table(5, [("a", "A")])


def test_repeat_and_busy_time_are_capped():
    with pytest.raises(ValueError, match=f"repeat must be <= {timing.MAX_REPEAT}"):
        pinlab.host_time(lambda: None, repeat=10**9)
    with pytest.raises(ValueError, match=f"ms must be <= {busy.MAX_BUSY_MS}"):
        pinlab.gpu_busy(1e9)
    with pytest.raises(ValueError, match="repeat must be <="):
        pinlab.warmup(lambda: None, repeat=10**9)
    with pytest.raises(TypeError, match="sync_after must be True or False"):
        pinlab.host_time(lambda: None, sync_after="yes")


def test_pinned_back_to_rejects_what_is_not_a_baseline():
    with pytest.raises(TypeError, match="baseline must be the int that pinned_baseline"):
        pinlab.pinned_back_to("x")
    with pytest.raises(TypeError, match="baseline"):
        pinlab.pinned_back_to(None)
    with pytest.raises(TypeError, match="baseline"):
        pinlab.pinned_back_to(1.5)
    with pytest.raises(ValueError, match="baseline must be >= 0"):
        pinlab.pinned_back_to(-1)


def test_next_pow2_types():
    import numpy as np

    assert next_pow2(np.int64(5)) == 8
    with pytest.raises(TypeError, match="n must be an int"):
        next_pow2(4.0)
    with pytest.raises(TypeError, match="n must be an int"):
        next_pow2(True)
    with pytest.raises(ValueError, match="n must be a positive int"):
        next_pow2(-3)


def test_progress_and_header_reject_nonsense():
    with pytest.raises(TypeError, match="iterable must be"):
        pinlab.progress(5, desc="x")
    with pytest.raises(TypeError, match="desc must be a str"):
        pinlab.progress([1], desc=None)
    with pytest.raises(ValueError, match="total must be >= 0"):
        pinlab.progress(iter([1]), desc="x", total=-1)
    with pytest.raises(TypeError, match="lesson must be a str"):
        pinlab.header(3)


# ----------------------------------------------------------------- the checkers' core

def test_as_int_and_same_int():
    import numpy as np

    from pinlab.checks import as_int, same_int

    for v in (5, np.int64(5), np.int32(5), np.array(5), torch.tensor(5), torch.tensor([5], dtype=torch.int32)):
        assert as_int(v) == 5 and type(as_int(v)) is int and same_int(v, 5)
    for v in (True, 5.0, np.float64(5.0), torch.tensor(5.0), torch.tensor(True), "5", None, [5], torch.tensor([5, 5])):
        assert not same_int(v, 5)
        with pytest.raises(TypeError, match="expected an int"):
            as_int(v)
    assert not same_int(np.int64(4), 5)


def _ref_count(xs):
    return len(xs)


def test_run_cases_verdicts_and_return_values(capsys):
    import numpy as np

    from pinlab.checks import run_cases, same_int

    cases = [([1, 2],), ([],), (list(range(9)),)]
    assert run_cases(lambda xs: np.int64(len(xs)), "count_np", cases, _ref_count, compare=same_int) is True
    assert run_cases(lambda xs: torch.tensor(len(xs)), "count_t", cases, _ref_count, compare=same_int) is True
    assert run_cases(lambda xs: len(xs) + 0.0, "count_f", cases, _ref_count, compare=same_int) is False

    def stub(xs):
        raise NotImplementedError

    assert run_cases(stub, "count_stub", cases, _ref_count) is False
    assert run_cases(lambda xs: 1 / 0, "count_err", cases, _ref_count) is False
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "✅ count_np is correct (3 cases)." and out[1] == "✅ count_t is correct (3 cases)."
    assert out[2].startswith("❌ count_f([1, 2]) returned 2.0, expected 2")
    assert out[3].startswith("⏳ count_stub is not implemented yet")
    assert out[4].startswith("❌ count_err([1, 2]) raised ZeroDivisionError")


def test_default_compare_accepts_numpy_and_tensor_numbers(capsys):
    import numpy as np

    from pinlab.checks import run_cases

    ref = lambda a, b: a / b  # noqa: E731
    assert run_cases(lambda a, b: np.float32(a / b), "div_np", [(1, 4), (3, 8)], ref)
    assert run_cases(lambda a, b: torch.tensor(a / b, dtype=torch.float64), "div_t", [(1, 4)], ref)
    assert not run_cases(lambda a, b: float("nan"), "div_nan", [(1, 4)], ref)
    assert not run_cases(lambda a, b: True, "div_bool", [(1, 1)], ref)


def test_long_arguments_are_summarised_not_cut(capsys):
    from pinlab.checks import run_cases

    xs = list(range(1000)) + [-7]
    run_cases(lambda v: sorted(v), "sort", [(xs,)], lambda v: sorted(v)[::-1])
    out = capsys.readouterr().out
    assert "..." in out and "-7]" in out and "(len 1001)" in out  # the last value is shown
    assert "first difference at [0]: got -7, expected 999" in out
    assert len(out) < 600
    t = torch.arange(10_000).reshape(100, 100)
    run_cases(lambda v: 0, "tsum", [(t,)], lambda v: int(v.sum()))
    out = capsys.readouterr().out
    assert "shape=(100, 100)" in out and "9999" in out and len(out) < 400


def test_hint_from_the_second_failure_on(capsys):
    from pinlab.checks import run_cases

    def wrong(x):
        return x + 1

    def right(x):
        return x

    cases = [(1,), (2,)]
    kw = dict(hint="return x itself")
    assert not run_cases(wrong, "ident_h", cases, right, **kw)
    first = capsys.readouterr().out.splitlines()
    assert len(first) == 1 and first[0].startswith("❌ ident_h(1) returned 2, expected 1")
    assert not run_cases(wrong, "ident_h", cases, right, **kw)
    second = capsys.readouterr().out.splitlines()
    assert second[0].startswith("❌") and second[1] == "💡 Hint: return x itself"
    assert run_cases(right, "ident_h", cases, right, **kw)
    assert capsys.readouterr().out.splitlines() == ["✅ ident_h is correct (2 cases)."]
    assert not run_cases(wrong, "ident_h", cases, right, **kw)  # the count starts again after a pass
    assert len(capsys.readouterr().out.splitlines()) == 1


def test_a_learner_function_that_changes_its_input_changes_nothing_else(capsys):
    from pinlab.checks import run_cases

    def sneaky(xs):
        xs.append(99)
        return len(xs) - 1

    data = [1, 2, 3]
    assert run_cases(sneaky, "len_sneaky", [(data,)], lambda xs: len(xs))
    assert data == [1, 2, 3]


def test_run_cases_checks_its_own_arguments():
    from pinlab.checks import run_cases

    with pytest.raises(TypeError, match="fn must be a function taking the arguments of each case"):
        run_cases(None, "x", [(1,)], abs)
    with pytest.raises(TypeError, match=r"cases\[0\] must be a tuple"):
        run_cases(abs, "x", [1], abs)
    with pytest.raises(TypeError, match="name must be a str"):
        run_cases(abs, None, [(1,)], abs)


def test_gpu_processes_leave_out_this_process_and_its_parents(monkeypatch):
    """A kernel started by the GPU suite (which holds a CUDA context itself) is not on a shared GPU."""
    import os
    import subprocess
    import sys

    from pinlab import probe

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        me, parent = os.getpid(), os.getppid()
        assert {me, parent} <= probe._ancestors()
        assert child.pid not in probe._ancestors()
        rows = [f"{me}", f"{parent}", f"{child.pid}"]
        monkeypatch.setattr(probe, "_nvidia_smi", lambda *a, **k: rows)
        assert probe._gpu_processes() == 1  # only the unrelated process (another learner's kernel)
        rows[:] = [f"{me}", f"{parent}"]
        assert probe._gpu_processes() == 0
        monkeypatch.setattr(probe, "_nvidia_smi", lambda *a, **k: None)
        assert probe._gpu_processes() is None  # no nvidia-smi: cannot tell
    finally:
        child.kill()
        child.wait()


def test_interleaved_rotates_the_order_and_keeps_each_names_results():
    calls = []
    out = timing.interleaved(["a", "b", "c"], 4, lambda k, r: calls.append((r, k)) or f"{k}{r}")
    assert out == {"a": ["a0", "a1", "a2", "a3"], "b": ["b0", "b1", "b2", "b3"], "c": ["c0", "c1", "c2", "c3"]}
    assert [k for r, k in calls] == list("abc" "bca" "cab" "abc")
    assert timing.split_steps(10, 3) == [4, 3, 3] and sum(timing.split_steps(7, 7)) == 7


@pytest.mark.parametrize("names, rounds, run, word", [
    ("ab", 2, lambda k, r: 0, "names"), ([], 2, lambda k, r: 0, "names"), (["a", "a"], 2, lambda k, r: 0, "names"),
    (["a"], 0, lambda k, r: 0, "rounds"), (["a"], 2.0, lambda k, r: 0, "rounds"), (["a"], 2, None, "run")])
def test_interleaved_names_a_bad_argument(names, rounds, run, word):
    with pytest.raises((TypeError, ValueError), match=word):
        timing.interleaved(names, rounds, run)
    with pytest.raises(ValueError, match="rounds"):
        timing.split_steps(3, 4)


def test_interleaved_shows_progress_over_the_rounds_when_asked(capsys):
    """desc= draws a progress bar on stderr over the rounds (lesson 02b's long comparison), and names a bad desc."""
    from pinlab.timing import interleaved

    got = interleaved(["a", "b"], 3, lambda k, r: (k, r), desc="comparing")
    assert got == {"a": [("a", 0), ("a", 1), ("a", 2)], "b": [("b", 0), ("b", 1), ("b", 2)]}
    assert "comparing" in capsys.readouterr().err
    with pytest.raises((TypeError, ValueError), match="desc"):
        interleaved(["a"], 1, lambda k, r: None, desc=3)


def test_the_race_detector_is_imported_where_first_used():
    """``import pinlab`` leaves the take-home tools' modules (order, races, detector, h2d) out of sys.modules (a
    notebook's recorded deps): a change to one renews only the lessons that use it (issue 44). ``pinlab.detect_races``,
    ``from pinlab import RaceError`` and the rest still work, and an unknown name is an AttributeError naming it."""
    import subprocess
    import sys

    tools = ("order", "races", "detector", "h2d")
    code = (f"import sys, pinlab; print([m for m in {tools!r} if 'pinlab.' + m in sys.modules]); "
            "from pinlab import RaceError, detect_races; "
            "print(detect_races.__module__, RaceError.__name__, 'detect_races' in dir(pinlab)); "
            "print(pinlab.detect_stalls.__module__, pinlab.StallError.__name__, pinlab.pin_snapshot.__module__, "
            "pinlab.async_tensor_h2d.__module__, all(hasattr(pinlab, n) for n in pinlab.__all__))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["[]", "pinlab.order", "RaceError", "True", "pinlab.detector", "StallError", "pinlab.h2d",
                           "pinlab.h2d", "True"], out
    import pkgutil  # a lazy name that is also a submodule's would be shadowed once the submodule is imported

    assert not set(pinlab._LAZY) & {m.name for m in pkgutil.iter_modules(pinlab.__path__)}
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        pinlab.no_such_name
