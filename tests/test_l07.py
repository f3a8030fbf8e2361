"""Lesson 07 (the capstone) on a CPU: the planted loop corrupts on the emulated lagging stream and the
fixed one does not, the audit names the planted lines exactly, the judge is exact, the notebook and
the exercise hold the same loops as the library, and bad input is named."""
import inspect
import sys
import types

import pytest
import torch

import nbtools
import pinlab
from pinlab.lessons import l07_capstone_audit as l07
from pinlab.paged_kv import FlashInferDecode

ROOT = nbtools.ROOT
STEPS = 40


@pytest.fixture(scope="module")
def model():
    s = pinlab.LaggingStream()
    with s:
        m = l07.CapstoneModel(s, steps=STEPS, encoder_ms=1.0, host_ms=0.0)
    return m


def test_planted_loop_corrupts_on_the_emulated_stream(model):
    r = l07.run_loop(model, l07.planted_loop, STEPS)
    # the scheduler rewrites the one pinned buffer before the step's copy has run: every step but
    # the last (which schedules nothing) delivers the next step's metadata
    assert r["received"] == list(range(1, STEPS)) + [STEPS - 1]
    assert r["wrong_meta"] == STEPS - 1 and r["first_wrong_meta"] == 0
    # the host reads tokens_host before the D2H copy has run: the previous step's tokens (zeros first)
    assert r["stale_reads"] == STEPS and r["first_stale_got"] == [0] * model.max_batch
    assert r["deliveries"] == STEPS and r["missing"] == 0 and r["corrupted"] == STEPS
    assert r["stops_ok"] and r["lm_head_ok"]  # the .item() stop check is slow, not wrong


def test_planted_loop_audit_names_each_line(model):
    r = l07.run_loop(model, l07.planted_loop, STEPS)
    assert r["audit_lines"] == [
        f"pageable non_blocking H2D: .copy_(..., non_blocking=True) at line 9 of planted_loop, 8 MiB, {STEPS} time(s)",
        f"pin_memory() of a pinned tensor: .pin_memory() at line 11 of planted_loop, 68 B, {STEPS} time(s)",
        f"host sync: .item() at line 18 of planted_loop, 1 B, {STEPS} time(s)",
        "host sync: .to('cpu') at line 4 of planted_loop, 8 MiB, 1 time(s)",
        "host sync: stream.synchronize() at line 21 of planted_loop, 1 time(s)",
    ]
    assert r["counts"] == {l07.PAGEABLE: STEPS, l07.BLOCKING: 0, l07.SYNC: STEPS + 2, l07.PIN_NOOP: STEPS,
                           l07.FULL_WAIT: 0}
    assert r["in_loop"] == {l07.PAGEABLE: STEPS, l07.BLOCKING: 0, l07.SYNC: STEPS, l07.PIN_NOOP: STEPS,
                            l07.FULL_WAIT: 0}
    assert r["unrestored"] == 0  # the planted loop restores the LM head every step (from pageable memory)


def test_fixed_loop_is_exact_on_the_emulated_stream(model):
    r = l07.run_loop(model, l07.fixed_loop, STEPS)
    assert r["received"] == list(range(STEPS))
    assert r["corrupted"] == 0 and r["stale_reads"] == 0 and r["missing"] == 0 and r["deliveries"] == STEPS
    assert r["stops_ok"] and r["want_stops"], "the workload should finish some requests"
    assert r["lm_head_ok"]
    assert r["audit_lines"] == ["blocking copy: .copy_() device to host at line 4 of fixed_loop, 8 MiB, 1 time(s)",
                                "host sync: stream.synchronize() at line 31 of fixed_loop, 1 time(s)"]
    assert sum(r["in_loop"].values()) == 0
    assert model.stream is not None and not hasattr(model.stream, "_audit")  # the stream is given back


@pytest.mark.parametrize("depth", [1, 2, 7])
def test_fixed_loop_is_exact_for_any_ring_depth(model, depth):
    r = l07.run_loop(model, lambda m, steps: l07.fixed_loop(m, steps, depth=depth), 9)
    assert r["corrupted"] == 0 and r["deliveries"] == 9 and r["stops_ok"] and r["unrestored"] == 0
    # depth 1 waits, in steps 0 to 7, on the event of the step it just enqueued (the last step's wait is
    # draining); a deeper ring never does
    assert r["counts"][l07.FULL_WAIT] == (8 if depth == 1 else 0)


def test_a_wait_is_judged_by_the_steps_enqueued_after_its_event(model):
    def loop(m, steps, lag):
        evs = []
        for n in range(steps):
            m.decode(n)
            ev = m.stream.Event()
            ev.record()
            evs.append(ev)
            if n >= lag:
                evs[n - lag].synchronize()
        m.stream.synchronize()

    for lag, full in ((0, 5), (1, 0), (2, 0)):
        r = l07.run_loop(model, lambda m, steps: loop(m, steps, lag), 6)
        assert r["counts"][l07.FULL_WAIT] == full, lag


def test_the_lm_head_restore_is_counted_per_step(model):
    def restore_once(m, steps):
        m.lm_head_host = torch.zeros_like(m.lm_head, device="cpu", pin_memory=True).copy_(m.lm_head)
        m.lm_head.copy_(m.lm_head_host, non_blocking=True)
        for n in range(steps):
            if n % 3 == 0:
                m.lm_head.copy_(m.lm_head_host, non_blocking=True)
            m.decode(n)
        m.stream.synchronize()

    r = l07.run_loop(model, restore_once, 7)
    assert r["unrestored"] == 4 and r["first_unrestored"] == 1 and r["lm_head_ok"]


def test_the_audit_reads_non_blocking_in_every_form(model):
    """Issue 31: LoopAudit read non_blocking from keywords only, so x.to(dev, torch.float32, True) from pageable
    memory was "a blocking copy". It reads the arguments with pinlab.detector.parse_to_args now."""
    def restores_from(source):
        def restores(m, steps):
            s = m.stream
            host = m.lm_head.to("cpu")
            if source == "pinned":
                host = torch.empty_like(m.lm_head, device="cpu", pin_memory=True).copy_(m.lm_head)
            for n in range(steps):
                m.lm_head = host.to(s.device, torch.float32, True)  # line 7: non_blocking positional
                m.lm_head.copy_(host, True)                          # line 8: the same for copy_
                m.decode(n)
            s.synchronize()
        return restores

    r = l07.run_loop(model, restores_from("pageable"), 6)
    assert r["in_loop"][l07.BLOCKING] == 0, r["audit_lines"]
    assert [(e["call"], e["line"], e["count"]) for e in r["audit"] if e["kind"] == l07.PAGEABLE] == [
        (".to(..., non_blocking=True)", 7, 6), (".copy_(..., non_blocking=True)", 8, 6)]
    r = l07.run_loop(model, restores_from("pinned"), 6)
    assert r["in_loop"][l07.BLOCKING] == 0 and r["counts"][l07.PAGEABLE] == 0, r["audit_lines"]
    assert r["unrestored"] == 0 and r["lm_head_ok"]


def test_the_audit_knows_inside_the_loop_from_the_steps_enqueued(model):
    """Issue 28: what ran inside the loop is told by the steps enqueued (after step 0's decode, before the
    last step's), not by a count: one sync inside is inside, ten before the loop or after it are not."""
    def loop(m, steps):
        s = m.stream
        for _ in range(10):
            s.synchronize()                      # line 4: set-up
        for n in range(steps):
            m.decode(n)
            if n == 2:
                s.synchronize()                  # line 8: once, inside
        for _ in range(10):
            s.synchronize()                      # line 10: draining

    r = l07.run_loop(model, loop, 6)
    assert [(e["line"], e["count"], e["in_loop"]) for e in r["audit"]] == [(4, 10, False), (8, 1, True),
                                                                          (10, 10, False)]
    assert r["in_loop"][l07.SYNC] == 1 and r["counts"][l07.SYNC] == 21


def test_a_slot_overwritten_by_a_later_step_is_told_from_an_early_read(model):
    def late(m, steps):
        out = torch.zeros(m.max_batch, dtype=torch.int64, pin_memory=True)
        for n in range(steps):
            m.meta_dev[n].copy_(m.meta_dev[n])  # (no metadata needed here)
            out.copy_(m.decode(n), non_blocking=True)
        m.stream.synchronize()
        for n in range(steps):
            m.emit(n, out)  # every step gets the last step's tokens

    r = l07.run_loop(model, late, 5)
    assert r["stale_reads"] == r["overwritten"] == 4 and r["first_stale"] == 0
    assert r["first_stale_overwritten_by"] == 4
    r = l07.run_loop(model, l07.planted_loop, 5)  # reads before the copy ran: earlier tokens, or zeros
    assert r["stale_reads"] == 5 and r["overwritten"] == 0 and r["first_stale_overwritten_by"] is None


def test_a_loop_that_fixes_nothing_but_the_race_is_still_judged_exactly(model):
    def reads_early(m, steps):
        meta = [torch.zeros(m.meta_ints, dtype=torch.int32, pin_memory=True) for _ in range(steps)]
        out = torch.zeros(m.max_batch, dtype=torch.int64, pin_memory=True)
        for n in range(steps):
            m.schedule(n, meta[n])
            m.meta_dev[n].copy_(meta[n], non_blocking=True)
            out.copy_(m.decode(n), non_blocking=True)
            m.emit(n, out)
        m.stream.synchronize()

    r = l07.run_loop(model, reads_early, 5)
    assert r["wrong_meta"] == 0 and r["stale_reads"] == 5 and r["lm_head_ok"]


def _lib_source(fn):
    import inspect
    import textwrap

    return textwrap.dedent(inspect.getsource(fn)).rstrip()


def test_the_notebook_and_the_exercise_hold_the_librarys_loops():
    nb = ROOT / "notebooks" / "src" / "07_capstone_audit.py"
    sol = ROOT / "solutions" / "src" / "07_capstone_audit.py"
    # the same code (nbtools.code_form: the syntax tree and the comments' words), whatever the layout: the sources
    # are laid out by ruff at 88 columns, the library at 120
    form = nbtools.code_form
    assert form(nbtools.definition_source(nb, "planted_loop")) == form(_lib_source(l07.planted_loop))
    # the lesson shows the planted loop, not the fix: it measures the library's (the exercise's answer)
    assert "def fixed_loop" not in nb.read_text(encoding="utf-8")
    assert "fixed_loop = l07.fixed_loop" in nb.read_text(encoding="utf-8")
    assert form(nbtools.definition_source(sol, "planted_loop")) == form(_lib_source(l07.planted_loop))
    body = nbtools.definition_source(sol, "fixed_loop").replace("    ### BEGIN SOLUTION\n", "").replace(
        "\n    ### END SOLUTION", "")
    lib = _lib_source(l07.fixed_loop).split("\n")
    assert form(body) == form("\n".join([lib[0]] + lib[2:])), \
        "the solution is the library's fixed_loop (without its docstring)"


def test_stall_lines_keep_only_the_loops_own_lines():
    def loop(m, steps):
        return None

    first = loop.__code__.co_firstlineno
    file = loop.__code__.co_filename
    report = types.SimpleNamespace(places={
        ("pageable H2D (may wait for the GPU)", "Tensor.copy_", f"{file}:{first + 1}"): 3,
        ("host sync (.item())", "Tensor.item", f"{file}:{first + 1}"): 5,
        ("host sync (.item())", "Tensor.item", "/elsewhere/flashinfer/x.py:10"): 7,
        ("blocking copy", "Tensor.to", f"{file}:{first + 400}"): 1,
    })
    assert l07.stall_lines(report, loop) == [
        "host sync (.item()): Tensor.item at line 2 of loop, 5 time(s)",
        "pageable H2D (may wait for the GPU): Tensor.copy_ at line 2 of loop, 3 time(s)",
    ]


def test_code_of_lines_names_each_line_by_its_code():
    lines = ["host sync: .item() at line 18 of planted_loop, 1 B, 40 time(s)",
             "blocking copy: Tensor.to at line 4 of planted_loop, 1 time(s)",
             "host sync: .item() at line 99 of planted_loop, 1 time(s)",  # no such line: left as it is
             "host sync: .item() at line 4 of other_loop, 1 time(s)"]     # another function: left as it is
    assert l07.code_of_lines(lines, l07.planted_loop) == [
        "host sync: .item() at `if tokens.eq(m.eos).any().item():` in planted_loop, 1 B, 40 time(s)",
        'blocking copy: Tensor.to at `m.lm_head_host = m.lm_head.to("cpu")` in planted_loop, 1 time(s)',
        lines[2], lines[3]]
    assert l07.line_code(l07.planted_loop, 1) == "def planted_loop(m, steps):"
    ns = {}
    exec("def f(m, steps):\n    pass\n", ns)  # no source to read
    assert l07.line_code(ns["f"], 1) is None and l07.code_of_lines(lines[:1], ns["f"]) == lines[:1]


def test_fmt_bytes():
    assert [l07.fmt_bytes(n) for n in (68, 4096, 4 * l07.MiB)] == ["68 B", "4 KiB", "4 MiB"]


# ---- bad input, GPU-only experiments -----------------------------------------------------------------

@pytest.mark.parametrize("kwargs, err, match", [
    (dict(steps=0), ValueError, "steps"),
    (dict(steps=2.5), TypeError, "steps"),
    (dict(encoder_ms=-1.0), ValueError, "encoder_ms"),
    (dict(host_ms=float("nan")), ValueError, "host_ms"),
    (dict(backend="triton"), ValueError, "backend"),
])
def test_bad_model_arguments_are_named(kwargs, err, match):
    s = pinlab.LaggingStream()
    with s, pytest.raises(err, match=match):
        l07.CapstoneModel(s, **{"steps": 4, **kwargs})


def test_run_loop_names_bad_arguments(model):
    with pytest.raises(TypeError, match="loop"):
        l07.run_loop(model, "planted_loop", 4)
    with pytest.raises(ValueError, match="steps"):
        l07.run_loop(model, l07.fixed_loop, STEPS + 1)
    with pytest.raises(ValueError, match="steps"):
        l07.run_loop(model, l07.fixed_loop, 0)


def test_flashinfer_is_refused_clearly_on_the_emulated_stream():
    s = pinlab.LaggingStream()
    with s, pytest.raises(Exception, match="FlashInfer needs CUDA"):
        l07.CapstoneModel(s, steps=2, backend="flashinfer")


@pytest.mark.skipif(pinlab.has_cuda(), reason="checks the refusal without CUDA")
def test_gpu_experiments_say_they_need_a_gpu():
    loops = {"fixed": l07.fixed_loop}
    for call in (lambda: l07.audit(loops, steps=2), lambda: l07.throughput(loops, steps=2),
                 lambda: l07.timeline(loops, steps=2), lambda: l07.detect(l07.fixed_loop, steps=2)):
        with pytest.raises(pinlab.CudaUnavailableError, match="needs a CUDA GPU"):
            call()
    with pytest.raises(TypeError, match="loops must be a non-empty dict"):
        l07.audit({}, steps=2)


def test_code_of_lines_reads_a_library_loop():
    # what notebook 07 prints for the detector's one event in the fixed loop: the offload, by its code
    src = inspect.getsource(l07.fixed_loop).splitlines()
    line = next(i for i, text in enumerate(src, 1) if "m.lm_head_host =" in text)
    assert line == 4  # what the GPU test below expects detect() to report
    assert l07.code_of_lines([f"blocking copy: Tensor.copy_ at line {line} of fixed_loop, 1 time(s)"], l07.fixed_loop) == [
        "blocking copy: Tensor.copy_ at `m.lm_head_host = torch.empty_like(m.lm_head, device=\"cpu\", "
        "pin_memory=True).copy_(m.lm_head)` in fixed_loop, 1 time(s)"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_detect_names_the_lines_of_the_library_loop():
    # fixed_loop lives in pinlab, whose frames the detector skips: detect() names it as the caller, so its one
    # blocking copy (the offload before the loop) is counted in its own lines, not blamed on whoever called it
    r = l07.detect(l07.fixed_loop, steps=4, pin_plan_inputs=True)
    assert r["lines"] == ["blocking copy: Tensor.copy_ at line 4 of fixed_loop, 1 time(s)"], r
    assert r["events_elsewhere"] == 0 and r["elsewhere"] == [], r


@pytest.mark.gpu
@pytest.mark.skipif(not pinlab.has_cuda(), reason="needs CUDA")
def test_gpu_throughput_times_every_loop_in_interleaved_rounds():
    """l07.throughput's rounds are timing.interleaved: every loop gets one time per round, and the median round's
    host spans (stop 59: the hand-written loop it replaced ran the loops in one order every round)."""
    loops = {"planted": l07.planted_loop, "fixed": l07.fixed_loop}
    res = l07.throughput(loops, steps=4, rounds=2, warm_steps=2, encoder_ms=0.1, decoder_ms=0.1, host_ms=0.05)
    assert list(res["loops"]) == list(loops)
    for name, row in res["loops"].items():
        assert len(row["rounds_ms"]) == 2 and row["steps_per_s"] > 0, (name, row)
        assert row["host_ms_per_step"] >= 0, (name, row)


def test_emulated_experiment_has_the_audit_schema():
    r = l07.emulated({"planted": l07.planted_loop, "fixed": l07.fixed_loop}, steps=6)
    assert r["backend"] == "torch" and "FlashInfer needs CUDA" in r["fallback_reason"]
    assert r["loops"]["fixed"]["corrupted"] == 0 and r["loops"]["planted"]["corrupted"] == 6
    assert "received" not in r["loops"]["fixed"]


# ---- FlashInfer's plan() inputs: pageable (vLLM 0.29) or pinned (vLLM 0.33) -----------------------------

def test_plan_host_is_pageable_by_default_and_a_pinned_copy_when_asked(model):
    d = model.setup
    with model.stream:
        assert model.pin_plan_inputs is False
        ip, lpl = model.plan_host(3)
        assert ip is d.plan_inputs[3][0] and not ip.is_pinned()
        model.pin_plan_inputs = True
        try:
            for n in (0, 3, STEPS - 1):
                ip, lpl = model.plan_host(n)
                assert ip.is_pinned() and lpl.is_pinned()
                assert ip.tolist() == d.indptrs[n] and lpl.tolist() == d.lpls[n]
        finally:
            model.pin_plan_inputs = False
    with pytest.raises(TypeError, match="pin_plan_inputs"):
        with pinlab.LaggingStream() as s:
            l07.CapstoneModel(s, steps=2, pin_plan_inputs="yes")


def _fake_flashinfer(monkeypatch):
    """A stand-in for flashinfer.utils' range-table cache and a decode wrapper whose plan() takes its
    qo_indptr table from that cache, as FlashInfer 0.4-0.6.18 does; records what plan() copied from."""
    utils = types.ModuleType("flashinfer.utils")
    utils._cache_buf = {}
    utils._ceil_pow2 = lambda n: 1 << (n - 1).bit_length()

    def get_range_buf(n, device):
        key = (f"range_{utils._ceil_pow2(n)}", device)
        if key not in utils._cache_buf:
            utils._cache_buf[key] = torch.arange(utils._ceil_pow2(n), dtype=torch.int32)
        return utils._cache_buf[key][:n]

    seen = []

    class Wrapper:
        def plan(self, indptr, indices, last_page_len, *args, **kwargs):
            qo = get_range_buf(last_page_len.numel() + 1, "cpu")
            seen.append({"indptr": indptr.is_pinned(), "last_page_len": last_page_len.is_pinned(),
                         "range table": qo.is_pinned(), "range values": qo.tolist()})

    fi = types.ModuleType("flashinfer")
    fi.utils = utils
    monkeypatch.setitem(sys.modules, "flashinfer", fi)
    monkeypatch.setitem(sys.modules, "flashinfer.utils", utils)
    dec = object.__new__(FlashInferDecode)  # no CUDA here: the wrapper is the stand-in above
    dec.__dict__.update(num_qo_heads=8, num_kv_heads=2, head_dim=128, page_size=16, dtype=torch.float16,
                        wrapper=Wrapper(), _proven=True, _batch_size=None, _pinned_ranges={})
    return dec, utils, seen


def test_plan_with_pinned_inputs_gets_flashinfers_range_table_pinned_for_that_call_only(monkeypatch):
    dec, utils, seen = _fake_flashinfer(monkeypatch)
    indices = torch.arange(5, dtype=torch.int32)
    with pinlab.LaggingStream():
        dec.plan(torch.tensor([0, 2, 5], dtype=torch.int32), indices, torch.tensor([3, 16], dtype=torch.int32))
        ip = torch.tensor([0, 2, 5], dtype=torch.int32).pin_memory()
        lpl = torch.tensor([3, 16], dtype=torch.int32).pin_memory()
        dec.plan(ip, indices, lpl)
        dec.plan(ip, indices, lpl)
    assert seen[0] == {"indptr": False, "last_page_len": False, "range table": False, "range values": [0, 1, 2]}
    assert seen[1] == seen[2] == {"indptr": True, "last_page_len": True, "range table": True, "range values": [0, 1, 2]}
    # FlashInfer's own cache holds its own (pageable) table again after each call: nothing pinned outlives the wrapper
    assert not utils._cache_buf[("range_4", "cpu")].is_pinned()
    assert list(dec._pinned_ranges) == [4]


def test_plan_leaves_flashinfers_cache_alone_where_it_is_not_as_expected(monkeypatch):
    dec, utils, seen = _fake_flashinfer(monkeypatch)
    del utils._ceil_pow2  # another FlashInfer: no such helper, so plan() copies its own table as before
    with pinlab.LaggingStream():
        ip = torch.tensor([0, 2], dtype=torch.int32).pin_memory()
        lpl = torch.tensor([3], dtype=torch.int32).pin_memory()
        with pytest.raises(AttributeError):  # the stand-in itself needs the helper
            dec.plan(ip, torch.arange(2, dtype=torch.int32), lpl)
    assert dec._pinned_ranges == {}


# ---- the harness's helpers ------------------------------------------------------------------------------

def test_span_union_counts_overlaps_once():
    assert l07.span_union_ms([]) == 0.0
    assert l07.span_union_ms([[0, 1, "kernel"], [0.5, 2, "copy"], [3, 4, "kernel"], [3.5, 3.6, "kernel"]]) == 3.0
    with pytest.raises(ValueError, match="ends before it starts"):
        l07.span_union_ms([[2, 1, "kernel"]])
    with pytest.raises(TypeError, match="spans"):
        l07.span_union_ms("spans")


def test_elsewhere_lines_group_the_places_outside_the_loop_by_file():
    def loop(m, steps):
        return None

    first, file = loop.__code__.co_firstlineno, loop.__code__.co_filename
    fi = "/venv/lib/python3.12/site-packages/flashinfer/decode.py"
    report = types.SimpleNamespace(places={
        ("pageable H2D (may wait for the GPU)", "Tensor.copy_", f"{file}:{first + 1}"): 3,
        ("pageable H2D (may wait for the GPU)", "Tensor.to", f"{fi}:1509"): 20,
        ("pageable H2D (may wait for the GPU)", "Tensor.to", f"{fi}:1515"): 20,
        ("pageable H2D (may wait for the GPU)", "Tensor.to", f"{fi}:1518"): 20,
        ("host sync (.item())", "Tensor.item", "/elsewhere/engine.py:10"): 7,
    })
    assert l07.elsewhere_lines(report, loop) == [
        "pageable H2D (may wait for the GPU): Tensor.to in flashinfer/decode.py, 60 time(s)",
        "host sync (.item()): Tensor.item in elsewhere/engine.py, 7 time(s)",
    ]


def test_the_harness_names_a_bad_pinned_plan():
    loops = {"planted": l07.planted_loop, "fixed": l07.fixed_loop}
    with pytest.raises(TypeError, match="pinned_plan"):
        l07.throughput(loops, pinned_plan="fixed")
    with pytest.raises(ValueError, match="pinned_plan names loops"):
        l07.timeline(loops, pinned_plan=["repaired"])


@pytest.mark.slow
def test_run_gate_fails_the_racy_sample_and_passes_its_fixes(monkeypatch):
    monkeypatch.setenv("FORCE_COLOR", "1")  # a CI or GPU host that forces colour: the counts are still read
    monkeypatch.setenv("PY_COLORS", "1")
    r = l07.run_gate()
    assert r["returncode"] == 1, r["tail"] + r["stderr_tail"]
    assert r["failed_tests"] == ["test_step_loop.py::test_racy_loop"] and r["passed"] == 2


def test_run_gate_refuses_a_missing_suite(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a folder"):
        l07.run_gate(str(tmp_path / "nope"))


@pytest.mark.slow
def test_the_gate_run_ignores_the_callers_pytest_options(monkeypatch):
    monkeypatch.setenv("PYTEST_ADDOPTS", "--durations=3")
    gate = l07.run_gate()
    assert gate["failed_tests"] == ["test_step_loop.py::test_racy_loop"], gate
    assert "slowest" not in gate["tail"], gate["tail"]
