"""The checkers' core (issue 19, a hostile tester's findings), for every checker of lessons 01-07:

1. a learner's function that never returns is stopped after the time limit (set low here through
   ``PINLAB_CHECK_TIMEOUT_S``), with a ❌ verdict that says so, and the SIGALRM handler and timer
   that were there before are back afterwards;
2. answers are compared by type first: ``unittest.mock.ANY`` (equal to anything), a float or int
   subclass whose ``__eq__`` says yes, or a tensor subclass whose ``torch.equal`` says yes, is rejected;
3. a function that leaves torch's global state changed (default device, dtype, threads, grad mode,
   ``PINLAB_*`` variables) fails with the change named, and the state is restored for what follows;
4. the exercise's stub reads as "not implemented yet", a NotImplementedError raised deeper (torch's
   unsupported op, a helper's) as an error;
5. a non-function argument is named with the checker's function and its signature;
6. ``steps`` is bounded.
"""
import os
import signal
import threading
import time
from unittest import mock

import pytest
import torch

import pinlab.checks as core
from pinlab.checks import l01 as checks01
from pinlab.checks import l02 as checks02
from pinlab.checks import l03 as checks03
from pinlab.checks import l04 as checks04
from pinlab.checks import l05 as checks05
from pinlab.checks import l06 as checks06
from pinlab.checks import l07 as checks07
from pinlab.lessons import l07_capstone_audit as l07
from pinlab.lessons.l01_pinned_memory import gbps
from pinlab.streams import LaggingStream

LIMIT = 0.5  # seconds: the time limit the tests set
ANY = mock.ANY


@pytest.fixture(autouse=True)
def _quick_and_emulated(monkeypatch, tmp_path):
    """A short time limit, the emulated stream even where there is a GPU, no recorded GPU run, and
    every checker's failure count reset (the hint would add a line from the second failure on)."""
    monkeypatch.setenv(core.TIMEOUT_ENV, str(LIMIT))
    monkeypatch.setenv("PINLAB_FORCE_CPU", "1")
    monkeypatch.setenv("PINLAB_DATA_DIR", str(tmp_path))
    for module in (checks02, checks04, checks05, checks07):
        module.reset()
    checks06.reset_hints()


def _stream_checker(check):
    """A torch-code checker that takes ``stream=``: on the emulated stream."""
    return lambda fn: check(fn, stream=LaggingStream())


def forever(*args, **kwargs):
    while True:
        pass


def forever_swallowing(*args, **kwargs):
    """Never returns, and swallows every Exception on the way: the stop must still get through."""
    while True:
        try:
            time.sleep(0.01)
        except Exception:
            pass


# (checker id, run(fn) -> verdict, the name in its verdict)
CHECKERS = [
    ("gbps", checks01.check_gbps.verdict, "gbps"),
    ("n_half", checks01.check_n_half.verdict, "n_half"),
    ("stall_threshold", checks02.check_stall_threshold.verdict, "stall_threshold"),
    ("gpu_idle_share", checks02.check_gpu_idle_share.verdict, "gpu_idle_share"),
    ("step_without_syncs", checks02.check_step_without_syncs.verdict, "step_without_syncs"),
    ("indptr_last_page_len", checks03.check_indptr_last_page_len.verdict, "indptr_last_page_len"),
    ("copies_correct", checks03.check_copies_correct.verdict, "copies_correct"),
    ("race_free_loop", checks03.check_race_free_loop.verdict, "race_free_loop"),
    ("pin_snapshot", _stream_checker(checks04.check_pin_snapshot.verdict), "pin_snapshot"),
    ("ring_stage", _stream_checker(checks04.check_ring_stage.verdict), "ring_stage"),
    ("min_ring_depth", checks04.check_min_ring_depth.verdict, "min_ring_depth"),
    ("restore_weight", checks05.check_restore_weight.verdict, "restore_weight"),
    ("pinned_footprint", checks05.check_pinned_footprint.verdict, "pinned_footprint"),
    ("rot_pos_ids", checks06.check_rot_pos_ids.verdict, "rot_pos_ids"),
    ("d2h_outputs-start", lambda fn: checks06.check_d2h_outputs.verdict(fn, lambda h, e: h.tolist()), "d2h_outputs"),
    ("d2h_outputs-finish", lambda fn: checks06.check_d2h_outputs.verdict(_start_d2h, fn), "d2h_outputs"),
    ("fixed_loop", lambda fn: checks07.check_fixed_loop.verdict(fn, steps=40), "fixed_loop"),
]


def _start_d2h(s, out):
    host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
    host.copy_(out, non_blocking=True)
    ev = s.Event()
    ev.record()
    return host, ev


# ---- 1. a function that never returns ----------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("check, name", [c[1:] for c in CHECKERS], ids=[c[0] for c in CHECKERS])
def test_a_function_that_never_returns_is_stopped(check, name, capsys):
    t0 = time.monotonic()
    assert check(forever) is False
    took = time.monotonic() - t0
    out = capsys.readouterr().out
    assert f"❌ {name}: your function did not return within {LIMIT:g} s" in out, out
    assert "a loop that never ends?" in out and "ev.synchronize()" in out and "ev.query()" in out
    # issue 28: polling is a wait like ev.synchronize() (and ends on the emulated stream): not told "don't poll"
    assert "not a loop on `ev.query()`" not in out and "a loop on `ev.query()`" in out
    assert took < 30, took  # the limit, plus the checker's own set-up (the capstone's model)


def test_a_loop_that_swallows_exceptions_is_stopped_too(capsys):
    assert checks01.check_gbps.verdict(forever_swallowing) is False
    assert f"❌ gbps: your function did not return within {LIMIT:g} s" in capsys.readouterr().out


def test_the_time_limit_puts_back_the_handler_and_timer_it_found(capsys):
    fired = []
    previous = signal.signal(signal.SIGALRM, lambda signum, frame: fired.append(signum))
    try:
        signal.setitimer(signal.ITIMER_REAL, 30.0)
        assert checks01.check_gbps.verdict(gbps) is True
        assert checks01.check_gbps.verdict(forever) is False
        left, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 25.0 < left <= 30.0  # the enclosing timer runs on, minus the time spent
        assert fired == []
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        time.sleep(0.3)
        assert fired == [signal.SIGALRM]  # and it is this handler that runs
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_the_limit_comes_from_the_environment_or_the_checker(monkeypatch):
    assert core.timeout_s() == LIMIT
    monkeypatch.delenv(core.TIMEOUT_ENV)
    assert core.timeout_s() == core.TIMEOUT_S == 60.0
    assert core.timeout_s(200.0) == 200.0
    monkeypatch.setenv(core.TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match=core.TIMEOUT_ENV):
        core.timeout_s()


def test_outside_the_main_thread_a_call_runs_unbounded():
    """Signals reach only the main thread: there the call is not stopped (it returns normally)."""
    result = []

    def work():
        with core.learner_call("slow()"):
            time.sleep(LIMIT * 2)
        result.append("returned")

    t = threading.Thread(target=work)
    t.start()
    t.join(10)
    assert result == ["returned"]


def test_run_loop_reports_a_loop_that_never_returns_as_a_timeout_error():
    with pytest.raises(TimeoutError, match=f"did not return within {LIMIT:g} s"):
        checks03.run_loop(forever, steps=10)


# ---- 2. the type of the answer first -----------------------------------------------------------

class AlwaysEqualFloat(float):
    def __eq__(self, other):
        return True

    __hash__ = float.__hash__


class AlwaysEqualInt(int):
    def __eq__(self, other):
        return True

    __hash__ = int.__hash__


class LiarTensor(torch.Tensor):
    """A tensor whose torch.equal / allclose always say yes."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.equal, torch.allclose):
            return True
        return super().__torch_function__(func, types, args, kwargs or {})


ANSWERS = {
    "gbps": [lambda n, ms: ANY, lambda n, ms: AlwaysEqualFloat(0.0)],
    "n_half": [lambda s, r: ANY, lambda s, r: AlwaysEqualInt(0)],
    "stall_threshold": [lambda s, h, b: ANY, lambda s, h, b: AlwaysEqualInt(0)],
    "gpu_idle_share": [lambda sp, a, b: ANY, lambda sp, a, b: AlwaysEqualFloat(-1.0)],
    "indptr_last_page_len": [lambda lens, p: ANY, lambda lens, p: ANY],
    "copies_correct": [lambda w, c: ANY, lambda w, c: [ANY] * len(w)],
    "min_ring_depth": [lambda w, c: ANY, lambda w, c: AlwaysEqualInt(0)],
    "pinned_footprint": [lambda b: ANY, lambda b: AlwaysEqualInt(0)],
    "pin_snapshot": [lambda t: ANY],
    "restore_weight": [lambda w, pin=True: ANY],
    "rot_pos_ids": [lambda g, m, d: ANY],
    "step_without_syncs": [lambda s, x, w: ANY, lambda s, x, w: (ANY, ANY)],
    "d2h_outputs-finish": [lambda h, e: ANY, lambda h, e: [ANY] * len(h)],
}


@pytest.mark.parametrize("check, name, answer", [
    (c[1], c[2], a) for c in CHECKERS if c[0] in ANSWERS for a in ANSWERS[c[0]]
], ids=[f"{c[0]}-{i}" for c in CHECKERS if c[0] in ANSWERS for i in range(len(ANSWERS[c[0]]))])
def test_an_answer_that_equals_everything_is_rejected(check, name, answer, capsys):
    assert check(answer) is False
    out = capsys.readouterr().out
    assert "❌" in out and "✅" not in out, out


def test_a_container_of_anys_is_rejected_where_lists_are_compared(capsys):
    assert checks03.check_indptr_last_page_len.verdict(lambda lens, p: ([ANY] * (len(lens) + 1), [ANY] * len(lens))) is False
    assert "returned ([<ANY>" in capsys.readouterr().out  # shown by its own repr, bounded


def test_a_tensor_subclass_does_not_decide_equality(capsys):
    from pinlab.lessons import l06_device_side_indices as l06

    def liar(grid, m, device):
        n = sum(t * h * w for t, h, w in grid)
        return torch.zeros(n, 2, dtype=torch.int64, device=device).as_subclass(LiarTensor)

    assert checks06.check_rot_pos_ids.verdict(liar) is False
    assert "❌ rot_pos_ids(grid_thw=[[1, 4, 6]], m=2) token" in capsys.readouterr().out
    assert not core.same_tensor(torch.zeros(3).as_subclass(LiarTensor), torch.ones(3))
    assert core.same_tensor(l06.ids_before([[1, 4, 6]], 2, "cpu"), l06.ids_before([[1, 4, 6]], 2, "cpu"))


def test_int_list_checks_types_before_values():
    assert core.int_list([1, 2.0, torch.tensor(3).item()]) == [1, 2, 3]
    assert core.int_list(torch.tensor([4, 5])) == [4, 5]
    for bad in (ANY, [ANY], [True], [1.5], "12", None, 3):
        with pytest.raises(TypeError):
            core.int_list(bad)


# ---- 3. torch's global state -------------------------------------------------------------------

def _leaky_gbps(change):
    def leaky(nbytes, ms):
        change()
        return gbps(nbytes, ms)
    return leaky


THREADS = torch.get_num_threads()
LEAKS = {
    "dtype": (lambda: torch.set_default_dtype(torch.float64),
              "your function changed torch's default dtype to float64 and did not restore it"),
    "device": (lambda: torch.set_default_device("meta"),
               "your function changed torch's default device to meta and did not restore it"),
    # issue 28: the default device set to the name it already had ("cpu", the emulated GPU's name) is still a change
    "device-same-name": (lambda: torch.set_default_device("cpu"),
                         "your function changed torch's default device (torch.set_default_device(cpu)) and did not "
                         "restore it"),
    "device-context": (lambda: torch.device("meta").__enter__(),
                       "your function changed torch's default device to meta and did not restore it"),
    "threads": (lambda: torch.set_num_threads(THREADS + 1),
                f"your function changed torch's number of threads to {THREADS + 1} (torch.set_num_threads)"),
    "grad": (lambda: torch.set_grad_enabled(False),
             "your function changed grad mode to off (torch.set_grad_enabled(False)) and did not restore it"),
    "env": (lambda: os.environ.__setitem__("PINLAB_LEAKED", "1"),
            "your function changed the environment variable PINLAB_LEAKED (set to '1') and did not restore it"),
}


def _state():
    return (str(torch.get_default_device()), torch.get_default_dtype(), torch.get_num_threads(),
            torch.is_grad_enabled(), {k: v for k, v in os.environ.items() if k.startswith("PINLAB_")},
            torch.empty(1).device.type)


@pytest.mark.parametrize("kind", list(LEAKS))
def test_a_leak_of_global_state_is_named_and_restored(kind, capsys):
    change, message = LEAKS[kind]
    before = _state()
    assert checks01.check_gbps.verdict(_leaky_gbps(change)) is False
    out = capsys.readouterr().out
    assert out.startswith("❌ gbps: ") and message in out, out
    assert "the checker restored it" in out
    assert _state() == before
    assert checks01.check_gbps.verdict(gbps) is True  # a correct answer afterwards gets the right verdict


def test_two_leaks_are_both_named(capsys):
    def leaky(nbytes, ms):
        torch.set_default_dtype(torch.float64)
        torch.set_grad_enabled(False)
        return gbps(nbytes, ms)

    before = _state()
    assert checks01.check_gbps.verdict(leaky) is False
    out = capsys.readouterr().out
    assert "default dtype to float64 and grad mode to off" in out and "did not restore them" in out
    assert _state() == before


def test_a_leak_in_torch_code_is_named_and_later_answers_are_judged_right(capsys):
    def snapshot(t):
        return torch.empty_like(t, pin_memory=True).copy_(t)

    def leaky(t):
        out = snapshot(t)
        torch.set_default_device("meta")
        return out

    before = _state()
    assert checks04.check_pin_snapshot.verdict(leaky, stream=LaggingStream()) is False
    assert "❌ pin_snapshot: your function changed torch's default device to meta" in capsys.readouterr().out
    assert _state() == before
    assert checks05.check_restore_weight.verdict(lambda w, pin=True: torch.set_grad_enabled(False)) is False
    assert "❌ restore_weight: your function changed grad mode to off" in capsys.readouterr().out
    assert _state() == before


def test_state_changed_and_put_back_inside_the_function_is_fine(capsys):
    def tidy(nbytes, ms):
        with torch.no_grad(), torch.device("meta"):
            torch.empty(1)
        return gbps(nbytes, ms)

    assert checks01.check_gbps.verdict(tidy) is True


# ---- 4. the stub's NotImplementedError and the others -------------------------------------------

def stub(nbytes, ms):
    raise NotImplementedError


def stub_with_words(nbytes, ms):
    raise NotImplementedError("write gbps")


def helper(ms):
    raise NotImplementedError("no such unit")


def uses_helper(nbytes, ms):
    return nbytes / helper(ms)


def unsupported_op(nbytes, ms):
    torch.zeros(2, 2).to_sparse().view(4)  # torch: "Could not run 'aten::view' ... 'SparseCPU' backend"
    return gbps(nbytes, ms)


@pytest.mark.parametrize("fn", [stub, stub_with_words, lambda n, ms: stub(n, ms)],
                         ids=["stub", "stub-with-words", "wrapped-stub"])
def test_the_stub_reads_as_not_implemented(fn, capsys):
    assert checks01.check_gbps.verdict(fn) is False
    assert capsys.readouterr().out.startswith("⏳ gbps is not implemented yet")


@pytest.mark.parametrize("fn, words", [
    (uses_helper, "raised NotImplementedError: no such unit (raised inside helper(), not by the exercise's stub"),
    (unsupported_op, "raised NotImplementedError: Could not run 'aten::view'"),
], ids=["helper", "torch-op"])
def test_a_deeper_not_implemented_error_is_an_error(fn, words, capsys):
    assert checks01.check_gbps.verdict(fn) is False
    out = capsys.readouterr().out
    assert out.startswith("❌ gbps(") and words in out and "not by the exercise's stub" in out, out
    assert "not implemented yet" not in out


def test_a_deeper_not_implemented_error_in_torch_code_is_an_error(capsys):
    def ids(grid, m, device):
        torch.zeros(2, 2).to_sparse().view(4)

    assert checks06.check_rot_pos_ids.verdict(ids) is False
    out = capsys.readouterr().out
    assert out.startswith("❌ rot_pos_ids(") and "raised NotImplementedError" in out
    assert "called in ids() (line " in out and "not by the exercise's stub" in out, out


def test_is_stub():
    for fn, stubbed in ((stub, True), (stub_with_words, True), (uses_helper, False), (unsupported_op, False)):
        try:
            fn(1, 1.0)
        except NotImplementedError as exc:
            assert core.is_stub(exc, fn) is stubbed, fn
    assert core.is_stub(ValueError("x"), stub) is False


# ---- 5. the function and its signature in the message --------------------------------------------

SIGNATURES = [
    (checks01.check_gbps.verdict, "gbps must be a function (nbytes, ms) -> float"),
    (checks01.check_n_half.verdict, "n_half must be a function (sizes, rates) -> int"),
    (checks02.check_stall_threshold.verdict, "stall_threshold must be a function (sizes, host_ms, busy_ms) -> int"),
    (checks02.check_gpu_idle_share.verdict, "gpu_idle_share must be a function (spans, start, end) -> float"),
    (checks02.check_step_without_syncs.verdict, "step_without_syncs must be a function (s, x_host, w) -> (scores_host, "
                                        "done_event)"),
    (checks03.check_indptr_last_page_len.verdict, "indptr_last_page_len must be a function (seq_lens, page_size) -> "
                                          "(indptr, last_page_len)"),
    (checks03.check_copies_correct.verdict, "copies_correct must be a function (writes, copies) -> list of bools"),
    (checks03.check_race_free_loop.verdict, "race_free_loop must be a function (s, steps, write_metadata, forward)"),
    (checks03.run_loop, "fn must be a function (s, steps, write_metadata, forward)"),
    (checks04.check_pin_snapshot.verdict, "pin_snapshot must be a function (t) -> tensor"),
    (checks04.check_ring_stage.verdict, "ring_stage must be a function (n, data, ring, events, dst)"),
    (checks04.check_min_ring_depth.verdict, "min_ring_depth must be a function (writes, copies) -> int"),
    (checks05.check_restore_weight.verdict, "restore_weight must be a function (w, pin=True) -> tensor"),
    (checks05.check_pinned_footprint.verdict, "pinned_footprint must be a function (param_bytes) -> int"),
    (checks06.check_rot_pos_ids.verdict, "rot_pos_ids must be a function (grid_thw, m, device) -> tensor"),
    (lambda f: checks06.check_d2h_outputs.verdict(f, _start_d2h), "start_d2h must be a function (s, out) -> (host, event)"),
    (lambda f: checks06.check_d2h_outputs.verdict(_start_d2h, f), "finish_d2h must be a function (host, event)"),
    (checks07.check_fixed_loop.verdict, "fixed_loop must be a function (m, steps)"),
]


@pytest.mark.parametrize("check, words", SIGNATURES, ids=[w.split(" ")[0] for _, w in SIGNATURES])
def test_a_non_function_is_named_with_its_signature(check, words, capsys):
    with pytest.raises(TypeError) as info:
        check(5)
    message = str(info.value)
    assert message.startswith(words) and message.endswith(", got int"), message
    assert "no arguments" not in message
    assert capsys.readouterr().out == ""  # nothing ran


def test_run_cases_names_its_own_arguments():
    with pytest.raises(TypeError, match="fn must be a function taking the arguments of each case, got int"):
        core.run_cases(5, "f", [(1,)], abs)
    with pytest.raises(TypeError, match=r"compare must be a function \(got, expected\) -> bool, got str"):
        core.run_cases(abs, "f", [(1,)], abs, compare="==")


# ---- 6. bounded work -----------------------------------------------------------------------------

def test_fixed_loop_steps_are_bounded(capsys):
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=f"steps must be <= {checks07.MAX_STEPS}, got 1000000"):
        checks07.check_fixed_loop.verdict(l07.fixed_loop, steps=10**6)
    assert time.monotonic() - t0 < 5 and capsys.readouterr().out == ""  # refused before any work
    assert checks07.MAX_STEPS >= 10 * checks07.STEPS


def test_run_loop_steps_are_bounded():
    with pytest.raises(ValueError, match=f"steps must be <= {checks03.MAX_STEPS}, got 1000000"):
        checks03.run_loop(forever, steps=10**6)
    assert checks03.MAX_STEPS >= 50 * checks03.STEPS


@pytest.mark.wrapping
def test_a_verdict_wraps_at_100_columns(capsys):
    from pinlab.checks import say

    say("✅ " + "a long verdict " * 20)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) > 1 and all(len(ln) <= 100 for ln in lines) and lines[1].startswith("   verdict")
