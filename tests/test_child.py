"""pinlab.child: one protocol for an experiment in a fresh process (lessons 01 and 09)."""
from pinlab.child import MARK, run_child


def test_run_child_returns_the_result_line_or_what_went_wrong():
    ok = run_child(f"import json, sys; print('noise'); print({MARK!r} + json.dumps({{'args': sys.argv[1:]}}))", (3, "x"))
    assert ok == {"args": ["3", "x"]}
    bad = run_child("raise SystemExit('no GPU here')")
    assert bad == {"error": "the child exited with 1 and no result: no GPU here"}
    assert run_child("import time; time.sleep(30)", timeout_s=1.0) == {"error": "the child took more than 1 s"}


def test_a_test_that_turns_the_gpu_trace_on_in_the_suites_process_fails(monkeypatch):
    """Stop 55, on an H100: the checker 03 tests turned torch's GPU trace on in the suite's process, and 18
    refusals of tests/test_streams_cuda.py after them came back as "SystemError: error return without exception
    set". conftest.py's fixture ``_gpu_trace_stays_off`` fails such a test, by its name; in a child process
    (tests/gpu_child.py) the trace is that test's own."""
    import sys
    import types

    import gpu_child

    assert gpu_child.trace_problem("t", False, False, False) is None
    assert gpu_child.trace_problem("t", True, True, False) is None  # on before it: an earlier test is named
    assert gpu_child.trace_problem("t", False, True, True) is None
    problem = gpu_child.trace_problem("tests/test_x.py::test_y", False, True, False)
    assert "tests/test_x.py::test_y turned torch's GPU trace on" in problem and "gpu_child.run()" in problem
    monkeypatch.setitem(sys.modules, "pinlab.order", types.SimpleNamespace(_trace_on=True))
    assert gpu_child.gpu_trace_on() is True
    monkeypatch.setitem(sys.modules, "pinlab.order", types.SimpleNamespace(_trace_on=False))
    assert gpu_child.gpu_trace_on() is False
