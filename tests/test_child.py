"""pinlab.child: one protocol for an experiment in a fresh process (lessons 01 and 09)."""
from pinlab.child import MARK, run_child


def test_run_child_returns_the_result_line_or_what_went_wrong():
    ok = run_child(f"import json, sys; print('noise'); print({MARK!r} + json.dumps({{'args': sys.argv[1:]}}))", (3, "x"))
    assert ok == {"args": ["3", "x"]}
    bad = run_child("raise SystemExit('no GPU here')")
    assert bad == {"error": "the child exited with 1 and no result: no GPU here"}
    assert run_child("import time; time.sleep(30)", timeout_s=1.0) == {"error": "the child took more than 1 s"}
