"""Lesson 07 (the capstone) on a CPU: the planted loop corrupts on the emulated lagging stream and the
fixed one does not, the audit names the planted lines exactly, the judge is exact, the notebook and
the exercise hold the same loops as the library, and bad input is named."""
import types

import pytest
import torch

import nbtools
import pinlab
from pinlab.lessons import l07_capstone_audit as l07

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
        f"pageable non_blocking H2D: .copy_(..., non_blocking=True) at line 9 of planted_loop, 8.0 MiB, {STEPS} time(s)",
        f"pin_memory() of a pinned tensor: .pin_memory() at line 11 of planted_loop, 68 B, {STEPS} time(s)",
        f"host sync: .item() at line 18 of planted_loop, 1 B, {STEPS} time(s)",
        "host sync: .to('cpu') at line 4 of planted_loop, 8.0 MiB, 1 time(s)",
        "host sync: stream.synchronize() at line 21 of planted_loop, 1 time(s)",
    ]
    assert r["counts"] == {l07.PAGEABLE: STEPS, l07.BLOCKING: 0, l07.SYNC: STEPS + 2, l07.PIN_NOOP: STEPS}
    assert r["in_loop"] == {l07.PAGEABLE: STEPS, l07.BLOCKING: 0, l07.SYNC: STEPS, l07.PIN_NOOP: STEPS}


def test_fixed_loop_is_exact_on_the_emulated_stream(model):
    r = l07.run_loop(model, l07.fixed_loop, STEPS)
    assert r["received"] == list(range(STEPS))
    assert r["corrupted"] == 0 and r["stale_reads"] == 0 and r["missing"] == 0 and r["deliveries"] == STEPS
    assert r["stops_ok"] and r["want_stops"], "the workload should finish some requests"
    assert r["lm_head_ok"]
    assert r["audit_lines"] == ["blocking copy: .copy_() device to host at line 4 of fixed_loop, 8.0 MiB, 1 time(s)",
                                "host sync: stream.synchronize() at line 31 of fixed_loop, 1 time(s)"]
    assert sum(r["in_loop"].values()) == 0
    assert model.stream is not None and not hasattr(model.stream, "_audit")  # the stream is given back


@pytest.mark.parametrize("depth", [1, 2, 7])
def test_fixed_loop_is_exact_for_any_ring_depth(model, depth):
    r = l07.run_loop(model, lambda m, steps: l07.fixed_loop(m, steps, depth=depth), 9)
    assert r["corrupted"] == 0 and r["deliveries"] == 9 and r["stops_ok"]


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
    assert nbtools.definition_source(nb, "planted_loop") == _lib_source(l07.planted_loop)
    assert nbtools.definition_source(nb, "fixed_loop") == _lib_source(l07.fixed_loop)
    assert nbtools.definition_source(sol, "planted_loop") == _lib_source(l07.planted_loop)
    body = nbtools.definition_source(sol, "fixed_loop").replace("    ### BEGIN SOLUTION\n", "").replace("\n    ### END SOLUTION", "")
    lib = _lib_source(l07.fixed_loop).split("\n")
    assert body == "\n".join([lib[0]] + lib[2:]), "the solution is the library's fixed_loop (without its docstring)"


def test_stall_lines_keep_only_the_loops_own_lines():
    def loop(m, steps):
        return None

    first = loop.__code__.co_firstlineno
    file = loop.__code__.co_filename
    report = types.SimpleNamespace(places={
        ("pageable H2D (non_blocking is fake)", "Tensor.copy_", f"{file}:{first + 1}"): 3,
        ("host sync (.item())", "Tensor.item", f"{file}:{first + 1}"): 5,
        ("host sync (.item())", "Tensor.item", "/elsewhere/flashinfer/x.py:10"): 7,
        ("blocking copy", "Tensor.to", f"{file}:{first + 400}"): 1,
    })
    assert l07.stall_lines(report, loop) == [
        "host sync (.item()): Tensor.item at line 2 of loop, 5 time(s)",
        "pageable H2D (non_blocking is fake): Tensor.copy_ at line 2 of loop, 3 time(s)",
    ]


def test_fmt_bytes():
    assert [l07.fmt_bytes(n) for n in (68, 4096, 4 * l07.MiB)] == ["68 B", "4.0 KiB", "4.0 MiB"]


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


def test_emulated_experiment_has_the_audit_schema():
    r = l07.emulated({"planted": l07.planted_loop, "fixed": l07.fixed_loop}, steps=6)
    assert r["backend"] == "torch" and "FlashInfer needs CUDA" in r["fallback_reason"]
    assert r["loops"]["fixed"]["corrupted"] == 0 and r["loops"]["planted"]["corrupted"] == 6
    assert "received" not in r["loops"]["fixed"]
