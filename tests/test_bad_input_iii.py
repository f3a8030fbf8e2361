"""Bad input, part III (issue 28): code added since the last hardening, held to the old bar. Claims and the
platform probe (``pinlab.claims``, ``pinlab.probe``), lesson 08's experiments (``lessons/l08_cuda_graphs.py``)
and its checkers (``checks/l08.py``). Each call with a bad argument must fail with a TypeError/ValueError that
names the argument (and the bound, where there is one), or give the exact answer; GPU-only calls with valid
arguments give the course's CudaUnavailableError. Nothing may return a silently wrong result.

Deterministic (``derandomize``, no example database). Timeouts: a hypothesis deadline per example (a slow
example fails), and a hard limit per test (:data:`HANG_S`, SIGALRM: a hang fails instead of stalling the run).
"""
from __future__ import annotations

import math
import signal
from datetime import timedelta

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_bad_input import clear_error

import pinlab
from pinlab import probe
from pinlab.args import CudaUnavailableError
from pinlab.checks import l08 as checks08
from pinlab.lessons import l08_cuda_graphs as l08

#: Seconds one test may run before it fails as a hang (the slowest here takes a few seconds on 2 busy cores).
HANG_S = 120
FEW = settings(max_examples=15, derandomize=True, database=None, deadline=timedelta(seconds=20),
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
SOME = settings(FEW, max_examples=30)

NOT_A_NUMBER = st.one_of(st.none(), st.text(max_size=3), st.just([1]), st.just({}), st.just(object()))
NOT_FINITE = st.sampled_from([math.nan, math.inf, -math.inf])
NOT_AN_INT = st.one_of(NOT_A_NUMBER, st.booleans(), st.floats(allow_nan=True), st.just(np.float64(2.0)))
NOT_A_BOOL = st.one_of(st.none(), st.integers(), st.floats(allow_nan=True), st.text(max_size=3), st.just([True]),
                       st.just({}), st.just(torch.tensor([True, False])), st.just(np.array([True, True])),
                       st.just(torch.tensor(1)))
BOOL_LIKE = st.sampled_from([True, False, np.bool_(True), np.bool_(False), torch.tensor(True), torch.tensor([False]),
                             np.array([True])])


@pytest.fixture(autouse=True)
def _cpu_only_and_bounded(monkeypatch):
    """A CPU-only machine even on a GPU host; and no test may hang (SIGALRM after HANG_S seconds)."""
    monkeypatch.setenv("PINLAB_FORCE_CPU", "1")
    for name in ("PINLAB_VRAM_LIMIT_GIB", "PINLAB_PINNED_LIMIT_GIB", "PINLAB_SIMULATE_NO_GPU_TRACE"):
        monkeypatch.delenv(name, raising=False)

    def hung(signum, frame):
        raise TimeoutError(f"this bad-input test ran past {HANG_S} s: a hang")

    old = signal.signal(signal.SIGALRM, hung)
    signal.setitimer(signal.ITIMER_REAL, HANG_S)
    yield
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, old)


# ----------------------------------------------------------------- claim / observe

@FEW
@given(NOT_A_BOOL)
def test_claim_and_observe_refuse_a_truth_that_is_not_one_bool(holds):
    """bool(3) and bool(nan) are True: a count or a float passed as ``holds`` was a silently wrong claim."""
    clear_error(lambda: pinlab.claim("a fact", holds), "holds")
    clear_error(lambda: pinlab.observe("a fact", holds), "holds")


@FEW
@given(holds=BOOL_LIKE)
def test_claim_and_observe_take_one_bool_in_any_container(holds, capsys):
    truth = bool(holds)
    assert pinlab.observe("a fact", holds) is truth
    if truth:
        assert pinlab.claim("a fact", holds) is None
    else:
        with pytest.raises(pinlab.ClaimError):
            pinlab.claim("a fact", holds)
    assert f"a fact: {truth}" in capsys.readouterr().out


@FEW
@given(st.one_of(st.integers(), st.just(""), st.just("  "), st.just(["x"]), st.just(b"why")))
def test_claim_and_observe_refuse_a_why_without_words(why):
    clear_error(lambda: pinlab.claim("a fact", True, why=why), "why")
    clear_error(lambda: pinlab.observe("a fact", True, why=why), "why")


@FEW
@given(st.one_of(st.none(), st.integers(), st.text(max_size=2), st.just([])))
def test_claim_refuses_a_shown_that_is_not_a_bool(shown):
    clear_error(lambda: pinlab.claim("a fact", True, shown=shown), "shown")


@FEW
@given(st.one_of(st.none(), st.integers(), st.just(""), st.just("   ")))
def test_failure_message_needs_the_claim_in_words(text):
    from pinlab.claims import failure_message

    clear_error(lambda: failure_message(text, 3, "why"), "text")


# ----------------------------------------------------------------- claims

@SOME
@given(st.sampled_from(["mapping", "key", "value", "expect", "expect_value", "values", "why", "why_key", "why_value"]),
       st.data())
def test_claims_names_the_bad_argument(which, data):
    kw = {"mapping": {"a fact": True, "a count": 0}, "expect": {"a count": 0}}
    names = (which,)
    if which == "mapping":
        kw["mapping"] = data.draw(st.one_of(st.none(), st.just({}), st.just([]), st.text(max_size=2)))
    elif which == "key":
        kw["mapping"] = {data.draw(st.one_of(st.integers(), st.just(""), st.just("  "))): True}
        kw["expect"], names = None, ("mapping",)
    elif which == "value":
        kw["mapping"]["a fact"] = data.draw(NOT_A_BOOL)
        names = ("mapping['a fact']",)
    elif which == "expect":
        kw["expect"] = data.draw(st.one_of(st.just([0]), st.just(0), st.just({"not a claim": 0})))
    elif which == "expect_value":
        kw["expect"] = {"a count": data.draw(st.one_of(NOT_A_NUMBER, NOT_FINITE))}
        names = ("expect['a count']",)
    elif which == "values":
        kw["values"] = data.draw(st.one_of(st.just([1]), st.just({"not a claim": 1})))
    elif which == "why":
        kw["why"] = data.draw(st.one_of(st.integers(), st.just([]), st.just("")))
    elif which == "why_key":
        kw["why"], names = {"not a claim": "because"}, ("why",)
    else:
        kw["why"], names = {"a fact": data.draw(st.one_of(st.integers(), st.just("")))}, ("why",)
    clear_error(lambda: pinlab.claims(**kw), *names)


@FEW
@given(st.sampled_from([math.nan, "0", None, [0], torch.tensor([0, 0])]))
def test_claims_refuses_a_count_that_is_not_one_number(count):
    clear_error(lambda: pinlab.claims({"a count": count}, expect={"a count": 0}), "mapping['a count']")


@SOME
@given(entries=st.lists(st.one_of(st.booleans().map(lambda b: ("bool", b)),
                                  st.tuples(st.integers(0, 3), st.integers(0, 3)).map(lambda p: ("count", p))),
                        min_size=1, max_size=6))
def test_claims_fails_exactly_on_the_first_entry_that_does_not_hold(entries, capsys):
    mapping, expect, holds = {}, {}, []
    for i, (kind, v) in enumerate(entries):
        text = f"claim {i}"
        if kind == "bool":
            mapping[text], ok = v, v
        else:
            mapping[text], expect[text] = np.int64(v[0]) if i % 2 else torch.tensor(v[0]), v[1]
            ok = v[0] == v[1]
        holds.append(ok)
    if all(holds):
        assert pinlab.claims(mapping, expect=expect) is None
    else:
        with pytest.raises(pinlab.ClaimError) as err:
            pinlab.claims(mapping, expect=expect)
        assert f"Claim did not hold in this run: claim {holds.index(False)}." in str(err.value)
    assert capsys.readouterr().out.count("\n") == len(entries)   # every claim printed, pass or fail


# ----------------------------------------------------------------- the platform probe

@SOME
@given(st.sampled_from(["gpu_trace", "vram_gib", "pinned_gib", "host_ram_gib"]), st.data())
def test_unmet_names_the_bad_requirement(key, data):
    if key == "gpu_trace":
        bad = data.draw(st.one_of(st.none(), st.integers(), st.text(max_size=3), st.just([True])))
    else:
        bad = data.draw(st.one_of(NOT_A_NUMBER, NOT_FINITE, st.booleans(), st.integers(max_value=-1),
                                  st.floats(max_value=-1e-9, allow_nan=False),
                                  st.floats(min_value=probe.MAX_REQUIRED_GIB * 1.01, allow_infinity=False)))
    clear_error(lambda: probe.unmet({key: bad}), f"requires[{key!r}]")


@FEW
@given(st.one_of(st.just([]), st.just("vram"), st.just({"vram": 1}), st.just({1: 2, "a": 3}), st.integers()))
def test_unmet_names_a_requires_that_is_not_a_dict_of_known_keys(requires):
    clear_error(lambda: probe.unmet(requires), "requires")


@SOME
@given(st.fixed_dictionaries({}, optional={"gpu_trace": st.booleans(),
                                           "vram_gib": st.floats(0, probe.MAX_REQUIRED_GIB),
                                           "pinned_gib": st.floats(0, probe.MAX_REQUIRED_GIB),
                                           "host_ram_gib": st.floats(0, 1.0)}))
def test_unmet_answers_exactly_on_this_cpu_machine(requires):
    """No GPU: the profiler records nothing, VRAM is not reported, no pinned budget is set; host RAM of at most
    1 GiB is available on any machine that runs these tests."""
    reasons = probe.unmet(requires)
    assert isinstance(reasons, list) and all(isinstance(r, str) for r in reasons)
    assert len(reasons) == int(requires.get("gpu_trace", False))


@FEW
@given(st.one_of(NOT_A_NUMBER, NOT_FINITE, st.booleans(), st.integers(max_value=0),
                 st.floats(min_value=probe.MAX_PIN_PROBE_GIB * 1.01, allow_infinity=False)))
def test_largest_pinned_gib_names_a_bad_want_gib(want):
    clear_error(lambda: probe.largest_pinned_gib(want), "want_gib")


def test_largest_pinned_gib_pins_nothing_without_cuda():
    assert probe.largest_pinned_gib() == 0.0 and probe.largest_pinned_gib(0.5) == 0.0


@FEW
@given(st.sampled_from(["PINLAB_VRAM_LIMIT_GIB", "PINLAB_PINNED_LIMIT_GIB"]),
       st.sampled_from(["x", "-1", "0", "nan", "inf", "-inf", "1e999"]))
def test_the_limit_variables_name_themselves(name, raw):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(name, raw)
        clear_error(probe.platform_facts, f"${name}")
        if name == "PINLAB_VRAM_LIMIT_GIB":
            clear_error(probe.apply_limits, f"${name}")


def test_the_probe_answers_plainly_here():
    p = probe.platform_facts()
    assert p["gpu_usable"] is False and p["other_gpu_processes"] is None
    assert "no CUDA GPU" in probe.machine_summary() and probe.apply_limits() is None


# ----------------------------------------------------------------- lesson 08: the graph step loop

BAD_LOOP = {
    "steps": st.one_of(NOT_AN_INT, st.integers(max_value=0), st.integers(100_001, 10**12)),
    "tensors": st.one_of(NOT_AN_INT, st.integers(max_value=0), st.integers(65, 10**9)),
    "n_ints": st.one_of(NOT_AN_INT, st.integers(max_value=0), st.integers((1 << 20) + 1, 10**12)),
    "busy_ms": st.one_of(NOT_A_NUMBER, NOT_FINITE, st.floats(max_value=-1e-9, allow_nan=False),
                         st.floats(min_value=1000.5, max_value=1e12)),
    "ring_depth": st.one_of(NOT_AN_INT, st.integers(max_value=0), st.integers(65, 10**9)),
    "variant": st.one_of(st.none(), st.integers(), st.just(["ring_graphs"]), st.just({}), st.just("graph"),
                         st.just("RING_GRAPHS")),
    "stream": st.one_of(st.integers(), st.just("cuda"), st.just(object()), st.just(torch.device("cpu"))),
}


@SOME
@given(st.sampled_from(sorted(BAD_LOOP)), st.data())
def test_graph_loop_names_the_bad_argument(which, data):
    kw = {"variant": "ring_graphs", "steps": 4, "tensors": 1, "n_ints": 4, "busy_ms": 0.1, "ring_depth": 2,
          "stream": pinlab.LaggingStream()}
    kw[which] = data.draw(BAD_LOOP[which])
    clear_error(lambda: l08.graph_loop(**kw), which)


def test_graph_loop_refuses_staging_memory_past_its_bound():
    exc = clear_error(lambda: l08.graph_loop("ring_outside", tensors=64, n_ints=1 << 20, ring_depth=64,
                                             stream=pinlab.LaggingStream()), "tensors", "n_ints", "ring_depth")
    assert str(l08.MAX_STAGING_BYTES) in str(exc)


@SOME
@given(st.sampled_from(list(l08.VARIANTS)), st.integers(2, 12), st.integers(1, 3), st.integers(1, 9),
       st.integers(1, 4))
def test_graph_loop_counts_exactly(variant, steps, tensors, n_ints, depth):
    run = l08.graph_loop(variant, steps=steps, tensors=tensors, n_ints=n_ints, ring_depth=depth,
                         stream=pinlab.LaggingStream())
    assert run["steps"] == steps and len(run["received"]) == steps and run["emulated"] is True
    assert run["corrupted"] == sum(v != n for n, v in enumerate(run["received"]))
    if variant in l08.RACY:
        assert run["corrupted"] == steps - 1 and run["received"] == [steps - 1] * steps
    else:
        assert run["corrupted"] == 0 and run["received"] == list(range(steps))


BAD_VARIANTS = st.one_of(st.just("ring_outside"), st.just([]), st.just(["x"]), st.just([3]), st.integers(),
                         st.just(["ring_outside", "ring_outside"]), st.just({"ring_outside": 1}))


@FEW
@given(BAD_VARIANTS)
def test_every_variant_names_bad_variants(variants):
    clear_error(lambda: l08.every_variant(variants, steps=2, stream=pinlab.LaggingStream()), "variants")


@FEW
@given(st.lists(st.sampled_from(list(l08.VARIANTS)), min_size=1, max_size=5, unique=True))
def test_every_variant_runs_each_named_variant_once(variants):
    res = l08.every_variant(variants, steps=3, stream=pinlab.LaggingStream())
    assert [r["variant"] for r in res["rows"]] == variants and list(res["received"]) == variants


GPU_ONLY_BAD = {
    "staging_cost": (l08.staging_cost, {"variants": BAD_VARIANTS, "tensors": BAD_LOOP["tensors"],
                                        "n_ints": BAD_LOOP["n_ints"], "ring_depth": BAD_LOOP["ring_depth"],
                                        "rounds": st.one_of(NOT_AN_INT, st.integers(max_value=0)),
                                        "steps": st.one_of(NOT_AN_INT, st.integers(201, 10**9))}),
    "host_cost": (l08.host_cost, {"kernels": st.one_of(st.just([]), st.just("5"), st.just([0]), st.just([1001]),
                                                       st.just([2.0]), st.none(), st.integers()),
                                  "repeat": st.one_of(NOT_AN_INT, st.integers(max_value=0)),
                                  "numel": st.one_of(NOT_AN_INT, st.integers((1 << 24) + 1, 10**12))}),
    "graph_memory": (l08.graph_memory, {"batch_sizes": st.one_of(st.just([]), st.just("8"), st.just([0]),
                                                                 st.just([65537]), st.just([1.5]), st.none()),
                                        "hidden": st.one_of(NOT_AN_INT, st.integers(max_value=0)),
                                        "layers": st.one_of(NOT_AN_INT, st.integers(65, 10**6)),
                                        "ring_depth": BAD_LOOP["ring_depth"]}),
    "flashinfer_graph_decode": (lambda **kw: l08.flashinfer_graph_decode(kw.pop("variant", "snapshot"), **kw),
                                {"variant": st.one_of(st.none(), st.just(["snapshot"]), st.just("snap")),
                                 "steps": BAD_LOOP["steps"], "batch": st.integers(257, 10**6),
                                 "head_dim": st.one_of(NOT_AN_INT, st.integers(1025, 10**6)),
                                 "tol": st.one_of(NOT_A_NUMBER, NOT_FINITE, st.just(0.0)),
                                 "ring": st.one_of(NOT_AN_INT, st.integers(17, 100))}),
    "flashinfer_graph_runs": (l08.flashinfer_graph_runs, {"variants": BAD_VARIANTS.filter(lambda v: v != []) |
                                                          st.just(["reused_pinned", "reused_pinned"]),
                                                          "steps": BAD_LOOP["steps"],
                                                          "seed": st.one_of(NOT_AN_INT, st.integers(max_value=-1))}),
}


@SOME
@given(st.sampled_from(sorted((f, a) for f, (_, args) in GPU_ONLY_BAD.items() for a in args)), st.data())
def test_the_gpu_experiments_name_a_bad_argument_before_they_need_cuda(case, data):
    fn_name, arg = case
    fn, strategies = GPU_ONLY_BAD[fn_name]
    bad = data.draw(strategies[arg])
    clear_error(lambda: fn(**{arg: bad}), arg)


def test_the_gpu_experiments_refuse_memory_past_their_bound():
    exc = clear_error(lambda: l08.flashinfer_graph_decode("snapshot", steps=100_000, batch=256, num_qo_heads=256,
                                                          num_kv_heads=8, head_dim=1024), "steps", "batch")
    assert "GiB" in str(exc)
    clear_error(lambda: l08.graph_memory([65536] * 8, hidden=1 << 16), "batch_sizes", "hidden")


@pytest.mark.parametrize("call, name", [
    (lambda: l08.staging_cost(["snapshot_outside"]), "staging_cost()"),
    (lambda: l08.host_cost([1, 2]), "host_cost()"),
    (lambda: l08.graph_memory([1]), "graph_memory()"),
    (lambda: l08.flashinfer_graph_decode("pinned_ring"), "flashinfer_graph_decode()"),
    (lambda: l08.flashinfer_graph_runs(["snapshot"]), "flashinfer_graph_runs()"),
])
def test_valid_arguments_of_the_gpu_experiments_say_they_need_cuda(call, name):
    with pytest.raises(CudaUnavailableError, match=name.replace("(", r"\(").replace(")", r"\)")):
        call()


@SOME
@given(st.sampled_from(["n", "batch", "max_pages", "page_size"]), st.data())
def test_decode_metadata_names_the_bad_argument(which, data):
    kw = {"n": 3, "batch": 4, "max_pages": 4, "page_size": 16}
    bound = {"n": None, "batch": 1 << 16, "max_pages": 1 << 20, "page_size": 1 << 16}[which]
    wrong = st.integers(max_value=-1 if which == "n" else 0)
    too_big = st.integers(bound + 1, 10**12) if bound else st.nothing()
    kw[which] = data.draw(st.one_of(NOT_AN_INT, wrong, too_big))
    clear_error(lambda: l08.decode_metadata(**kw), f"{which} must")


def test_decode_metadata_refuses_an_indptr_past_int32():
    clear_error(lambda: l08.decode_metadata(0, 1 << 16, 1 << 20, 16), "batch x max_pages")


@SOME
@given(st.integers(0, 10**6), st.integers(1, 64), st.integers(1, 64), st.integers(1, 64))
def test_decode_metadata_is_exact(n, batch, max_pages, page_size):
    indptr, last = l08.decode_metadata(n, batch, max_pages, page_size)
    w = 1 + n % max_pages
    assert indptr == [i * w for i in range(batch + 1)]
    assert last == [1 + (5 * n + 3 * i) % page_size for i in range(batch)]


# ----------------------------------------------------------------- lesson 08's checkers

@FEW
@given(st.one_of(st.none(), st.just([1, 2]), st.just(torch.zeros(3)), st.just(torch.zeros(2, 3, dtype=torch.int64)),
                 st.just(torch.zeros(3, dtype=torch.bool)), st.just(torch.zeros(3, dtype=torch.complex64)),
                 st.just(np.zeros(3, dtype=np.int64))))
def test_reference_step_names_bad_ids(ids):
    clear_error(lambda: checks08.reference_step(ids), "ids")


@FEW
@given(st.lists(st.integers(-10**6, 10**6), min_size=0, max_size=12), st.sampled_from([torch.int64, torch.int32]))
def test_reference_step_is_exact(values, dtype):
    got = checks08.reference_step(torch.tensor(values, dtype=dtype)).tolist()
    assert got == [min(v * 2 + i, checks08.LIMIT) for i, v in enumerate(values)]


def _good_stage(s, meta, static, state):
    static.copy_(meta.pin_memory(), non_blocking=True)


@SOME
@given(st.sampled_from(["stage", "steps", "busy_ms", "s"]), st.data())
def test_staging_run_names_the_bad_argument(which, data):
    kw = {"stage": _good_stage, "s": pinlab.LaggingStream(), "steps": 3, "busy_ms": 1.0}
    kw[which] = data.draw({
        "stage": st.one_of(st.none(), st.integers(), st.text(max_size=2)),
        "steps": st.one_of(NOT_AN_INT, st.integers(max_value=0), st.integers(10**5, 10**12)),
        "busy_ms": st.one_of(NOT_A_NUMBER.filter(lambda v: v is not None), NOT_FINITE,  # None: the default
                             st.floats(max_value=0, allow_nan=False), st.floats(min_value=10_001, max_value=1e12)),
        "s": st.one_of(st.integers(), st.just("cuda"), st.just(object()), st.just(torch.device("cpu"))),
    }[which])
    clear_error(lambda: checks08.staging_run(kw.pop("stage"), kw.pop("s"), **kw), f"{which} must", f"{which}:")


def test_staging_run_names_a_stream_already_active():
    with pinlab.LaggingStream() as s:
        clear_error(lambda: checks08.staging_run(_good_stage, s, steps=2), "s: ")


def test_staging_run_without_a_stream_needs_cuda():
    with pytest.raises(CudaUnavailableError, match="staging_run"):
        checks08.staging_run(_good_stage, steps=2)


@FEW
@given(st.integers(1, 20))
def test_staging_run_reads_every_value_exactly(steps):
    run = checks08.staging_run(_good_stage, pinlab.LaggingStream(), steps=steps)
    assert run["seen"] == [checks08.step_values(n) for n in range(steps)]
    assert (run["pageable"], run["waited"], run["kept_steps"], run["steps"]) == (0, False, 0, steps)


@FEW
@given(st.one_of(NOT_AN_INT, st.integers(max_value=-1), st.integers(10**8 + 1, 10**12)))
def test_step_values_names_a_bad_step(n):
    clear_error(lambda: checks08.step_values(n), "n must")


@FEW
@given(st.one_of(st.none(), st.integers(), st.text(max_size=3), st.just([])))
def test_the_checkers_name_an_answer_that_is_not_a_function(fn):
    clear_error(lambda: checks08.check_capturable_step(fn), "capturable_step")
    clear_error(lambda: checks08.check_graph_stage(fn), "stage")
