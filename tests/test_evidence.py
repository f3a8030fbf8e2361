"""The GPU evidence: reports/gpu/latest.json and reports/gpu/stability.json hold for the current notebooks and
the lib/ files each one imported; and the suite's CPU-side logic (tools/evidence.py, tools/gpu_suite.py,
nbtools' deps recording) works on made-up notebooks and trees."""
import ast
import contextlib
import hashlib
import io
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

import evidence
import gpu_suite
import nbtools
import scope

ROOT = nbtools.ROOT
GPU_SUITE = nbtools.notebook_paths(nbtools.NOTEBOOK_DIRS)
REPORT = ROOT / "reports" / "gpu" / "latest.json"
STABILITY = ROOT / "reports" / "gpu" / "stability.json"
RUN_SUITE = "run `python3 tools/gpu_suite.py` on a CUDA machine (CONTRIBUTING.md: Running the GPU suite) and commit reports/gpu/"


def _id(p):
    return p.relative_to(ROOT).as_posix()


def _report(path):
    how = RUN_SUITE.replace("gpu_suite.py`", "gpu_suite.py --repeat 5`") if path == STABILITY else RUN_SUITE
    assert path.exists(), f"no {path.relative_to(ROOT)}: {how}"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        pytest.fail(f"{path.relative_to(ROOT)} is not valid JSON ({exc}): {how}")


# ---- the recorded evidence ------------------------------------------------------------------------------------

def test_gpu_report_is_complete():
    rep = _report(REPORT)
    for key in ("gpu", "driver", "torch", "cuda", "flashinfer", "python", "utc", "lib_sha256", "unit_tests", "notebooks"):
        assert key in rep, f"reports/gpu/latest.json lacks {key}: {RUN_SUITE}"
    unit = rep["unit_tests"]
    assert unit and unit["failed"] == 0 and not unit.get("failures"), f"gpu unit tests failed on the GPU: {unit}"
    assert unit["passed"] >= 1, "no gpu unit test passed on the GPU"


@pytest.mark.parametrize("path", GPU_SUITE, ids=_id)
def test_gpu_report_covers_notebook(path):
    rows = {r["path"]: r for r in _report(REPORT).get("notebooks", [])}
    rel = _id(path)
    assert rel in rows, f"{rel} is not in reports/gpu/latest.json: run `python3 tools/gpu_suite.py --only {path.stem}`"
    row = rows[rel]
    assert row["status"] == "passed", f"{rel} did not pass on the GPU: {row.get('problem', row['status'])}"
    why = evidence.freshness(row)
    assert why is None, f"{why}: run `python3 tools/gpu_suite.py --only {path.stem}` on a CUDA machine"
    inputs = set(evidence.subprocess_inputs(rel))  # files of a process the notebook starts (SUBPROCESS_INPUTS)
    assert all(d in inputs or (d.startswith("lib/") and d.endswith(".py")) for d in row["deps"]), row["deps"]
    assert "lib/pinlab/__init__.py" in row["deps"]


@pytest.mark.parametrize("path", GPU_SUITE, ids=_id)
def test_stability_covers_notebook(path):
    rows = {r["path"]: r for r in _report(STABILITY).get("notebooks", [])}
    rel = _id(path)
    assert rel in rows, (f"{rel} is not in reports/gpu/stability.json: "
                         f"run `python3 tools/gpu_suite.py --repeat 5 --only {path.stem}` on a CUDA machine")
    problems = evidence.stability_problems(rows[rel], stale=scope.stale_check(_report(REPORT)))
    assert not problems, "; ".join(problems)


def test_recorded_profiler_trace_is_kept():
    """Lesson 02b points readers without a GPU at the trace the GPU suite kept."""
    path = ROOT / "reports" / "gpu" / "traces" / "02_step_loop.json"
    assert path.exists(), "run the GPU suite: it copies build/traces/*.json to reports/gpu/traces/"
    events = json.loads(path.read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert any("Pageable -> Device" in n for n in names) and any("Pinned -> Device" in n for n in names)


@pytest.mark.parametrize("path", GPU_SUITE, ids=_id)
def test_committed_outputs_come_from_the_quiet_reference_pass(path):
    """Issue 33: the committed outputs of every notebook come from a pass in which it ran alone on the GPU
    (tools/gpu_suite.py's plain suite, which refuses to run beside another process and records the conditions)."""
    rows = {r["path"]: r for r in _report(REPORT).get("notebooks", [])}
    rel = _id(path)
    assert rel in rows, f"{rel} is not in reports/gpu/latest.json: run `python3 tools/gpu_suite.py --only {path.stem}`"
    c = rows[rel].get("conditions")
    again = f"run `python3 tools/gpu_suite.py --only {path.stem}` alone on the GPU (the plain suite: the quiet reference pass)"
    assert isinstance(c, dict), f"{rel}: latest.json records no conditions for its run (it predates the quiet reference pass): {again}"
    assert c.get("pass") == gpu_suite.QUIET and c.get("quiet") is True, (
        f"{rel} was not recorded by the quiet reference pass ({c.get('pass')} pass, "
        f"{c.get('why_not_quiet') or 'quiet: ' + str(c.get('quiet'))}): {again}")
    for when in ("start", "end"):
        assert c.get(when, {}).get("other_gpu_processes") == [], f"{rel}: other processes at its {when}: {again}"


def test_recordings_come_from_the_quiet_reference_pass():
    """Every recording a replay shows was measured by the quiet reference pass (``meta["suite_pass"]``)."""
    bad = {}
    for f in sorted((ROOT / "reports" / "gpu" / "data").glob("*.json")):
        meta = json.loads(f.read_text(encoding="utf-8")).get("meta", {})
        if meta.get("suite_pass") != gpu_suite.QUIET:
            bad[f.name] = meta.get("suite_pass")
    assert not bad, (f"{len(bad)} recordings under reports/gpu/data were not measured by the quiet reference pass "
                     f"(their suite_pass: {sorted(set(map(str, bad.values())))}; e.g. {sorted(bad)[:5]}): {RUN_SUITE}")


# ---- made-up trees and notebooks -----------------------------------------------------------------------------

_ids = iter(range(10**9))


def code(src, outputs=(), count=1, tags=()):
    return {"cell_type": "code", "id": f"c{next(_ids)}", "source": src, "metadata": {"tags": list(tags)} if tags else {},
            "outputs": list(outputs), "execution_count": count}


def md(src):
    return {"cell_type": "markdown", "id": f"c{next(_ids)}", "source": src, "metadata": {}}


def out(text):
    return {"output_type": "stream", "name": "stdout", "text": text}


def err(ename="AssertionError", evalue=""):
    return {"output_type": "error", "ename": ename, "evalue": evalue, "traceback": []}


def notebook(cells):
    return {"cells": cells, "metadata": {"kernelspec": {"name": "python3"}}, "nbformat": 4, "nbformat_minor": 5}


@pytest.fixture
def tree(tmp_path):
    """A small project: lib/pkg with three modules, one notebook that imports two of them."""
    (tmp_path / "lib" / "pkg").mkdir(parents=True)
    (tmp_path / "lib" / "pkg" / "__init__.py").write_text("from . import a\n")
    (tmp_path / "lib" / "pkg" / "a.py").write_text("X = 1\n")
    (tmp_path / "lib" / "pkg" / "b.py").write_text("Y = 2\n")
    (tmp_path / "notebooks").mkdir()
    nbtools.save(notebook([md("# t"), code("import pkg\nassert pkg.a.X == 1")]), tmp_path / "notebooks" / "00_x.ipynb")
    return tmp_path


def entry(tree, rel="notebooks/00_x.ipynb", deps=("lib/pkg/__init__.py", "lib/pkg/a.py"), **kw):
    deps = sorted(deps)
    return {"path": rel, "status": "passed", "source_sha256": nbtools.source_sha256(nbtools.load(tree / rel)),
            "deps": deps, "deps_sha256": nbtools.deps_sha256(deps, tree), **kw}


def test_deps_sha256_is_lib_sha256_rule_over_the_deps(tree):
    h = hashlib.sha256()
    for rel in ("lib/pkg/__init__.py", "lib/pkg/a.py"):
        h.update((rel + "\n" + (tree / rel).read_text()).encode())
    assert nbtools.deps_sha256(["lib/pkg/a.py", "lib/pkg/__init__.py"], tree) == h.hexdigest()
    assert nbtools.lib_sha256(tree) == nbtools.files_sha256(nbtools.lib_files(tree), tree)
    assert nbtools.lib_files(tree) == ["lib/pkg/__init__.py", "lib/pkg/a.py", "lib/pkg/b.py"]
    h.update(("lib/pkg/b.py\n" + "Y = 2\n").encode())
    assert nbtools.lib_sha256(tree) == h.hexdigest()


def test_freshness_follows_the_source_and_only_the_deps(tree):
    e = entry(tree)
    assert evidence.freshness(e, tree) is None
    (tree / "lib" / "pkg" / "b.py").write_text("Y = 3  # not imported by the notebook\n")
    assert evidence.freshness(e, tree) is None
    (tree / "lib" / "pkg" / "a.py").write_text("X = 1  # a typo fixed\n")
    assert "a lib file it imports changed" in evidence.freshness(e, tree)
    e = entry(tree)
    (tree / "lib" / "pkg" / "a.py").unlink()
    assert "lib/pkg/a.py" in evidence.freshness(e, tree)
    (tree / "lib" / "pkg" / "a.py").write_text("X = 1  # a typo fixed\n")
    assert evidence.freshness(e, tree) is None
    nb = nbtools.load(tree / "notebooks" / "00_x.ipynb")
    nb["cells"][1]["source"] = "import pkg\nassert pkg.a.X == 1  # edited"
    nbtools.save(nb, tree / "notebooks" / "00_x.ipynb")
    assert "changed after its GPU run" in evidence.freshness(e, tree)
    assert "no deps" in evidence.freshness({"path": "notebooks/00_x.ipynb", "source_sha256": "x"} | {
        "source_sha256": nbtools.source_sha256(nb)}, tree)
    assert "no longer exists" in evidence.freshness({"path": "notebooks/gone.ipynb"}, tree)


def test_inputs_of_a_process_a_notebook_runs_are_deps_of_its_quiet_pass(tree, monkeypatch):
    """Lesson 07 runs the pytest gate on the sample suite in a process of its own: the kernel never imports the
    gate, so its recorded deps must name it (and the suite's files): an edit there stales the quiet pass."""
    (tree / "lib" / "gate.py").write_text("V = 1\n")
    (tree / "examples" / "suite").mkdir(parents=True)
    (tree / "examples" / "suite" / "test_s.py").write_text("def test_s(): pass\n")
    monkeypatch.setitem(evidence.SUBPROCESS_INPUTS, "notebooks/00_x.ipynb", ("lib/gate.py", "examples/suite"))
    inputs = evidence.subprocess_inputs("notebooks/00_x.ipynb", tree)
    assert inputs == ["examples/suite/test_s.py", "lib/gate.py"]
    assert "recorded without examples/suite/test_s.py, lib/gate.py" in evidence.freshness(entry(tree), tree)
    e = entry(tree, deps=["lib/pkg/__init__.py", "lib/pkg/a.py", *inputs])
    assert evidence.freshness(e, tree) is None
    (tree / "examples" / "suite" / "test_s.py").write_text("def test_s(): assert 1\n")
    assert "examples/suite/test_s.py" in evidence.freshness(e, tree)
    e = entry(tree, deps=["lib/pkg/__init__.py", "lib/pkg/a.py", *inputs])
    (tree / "examples" / "suite" / "test_t.py").write_text("def test_t(): pass\n")
    assert "recorded without examples/suite/test_t.py" in evidence.freshness(e, tree), "a new file of the suite too"
    assert evidence.subprocess_inputs("notebooks/01_y.ipynb", tree) == []


_LIB_FILES = """
import json, os, sys
lib = os.path.realpath(sys.argv[1])
def dump():
    files = {os.path.realpath(f) for f in (getattr(m, "__file__", None) for m in list(sys.modules.values()))
             if isinstance(f, str)}
    print("@@files@@" + json.dumps(sorted(os.path.relpath(f, os.path.dirname(lib)) for f in files
                                          if f.startswith(lib + os.sep))))
"""


@pytest.mark.slow
def test_lesson_07s_gate_run_is_in_its_scope(tmp_path):
    """Every lib file the gate's own pytest process imports (lesson 07 runs it on the sample suite) is one the
    kernel imports too, or one of evidence.SUBPROCESS_INPUTS: an edit there stales lesson 07's quiet pass."""
    import shutil
    import subprocess
    import sys

    from test_pytest_plugin import gate_env  # the gate's process, as lesson 07's run_gate starts it

    inputs = set(evidence.subprocess_inputs("notebooks/07_capstone_audit.ipynb"))
    assert {"lib/pinlab_pytest.py", "examples/race_gate/test_step_loop.py"} <= inputs
    lib = str(ROOT / "lib")
    env = gate_env()
    # the kernel as lesson 07 uses pinlab: its lesson module, pinlab.detect_stalls (section 2) and
    # pinlab.races.detect_races (section 2b); `import pinlab` alone imports neither detector (pinlab._LAZY)
    kernel = subprocess.run([sys.executable, "-c", _LIB_FILES + "import pinlab\n"
                             "from pinlab.lessons import l07_capstone_audit\npinlab.detect_stalls\n"
                             "from pinlab.races import detect_races\ndump()", lib],
                            capture_output=True, text=True, env=env, timeout=300)
    suite = tmp_path / "suite"
    shutil.copytree(ROOT / "examples" / "race_gate", suite, ignore=shutil.ignore_patterns("__pycache__"))
    (suite / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider\n")
    gate = subprocess.run([sys.executable, "-c", _LIB_FILES + "import pytest\n"
                           "pytest.main(['-q', '--pinlab-races', '.'])\ndump()", lib],
                          cwd=suite, capture_output=True, text=True, env=env, timeout=300)

    def files(r):
        line = next((x for x in r.stdout.splitlines() if x.startswith("@@files@@")), None)
        assert line, r.stdout[-2000:] + r.stderr[-2000:]
        return set(json.loads(line[len("@@files@@"):]))

    missing = files(gate) - files(kernel) - inputs
    assert not missing, (f"lesson 07's gate process imports {sorted(missing)}, which its kernel does not: add them to "
                         "evidence.SUBPROCESS_INPUTS")


def test_merge_keeps_fresh_entries_and_drops_stale_ones(tree):
    nbtools.save(notebook([code("import pkg")]), tree / "notebooks" / "01_y.ipynb")
    nbtools.save(notebook([code("import pkg.b")]), tree / "notebooks" / "02_z.ipynb")
    old = [entry(tree, status="failed", utc="old"), entry(tree, "notebooks/01_y.ipynb", utc="old"),
           entry(tree, "notebooks/02_z.ipynb", deps=["lib/pkg/b.py"], utc="old"),
           {"path": "notebooks/03_gone.ipynb", "status": "passed"}]
    (tree / "lib" / "pkg" / "b.py").write_text("Y = 4\n")  # 02_z's entry goes stale
    new = [entry(tree, utc="new")]
    keep = {"notebooks/00_x.ipynb", "notebooks/01_y.ipynb", "notebooks/02_z.ipynb"}
    merged, dropped = evidence.merge_entries(old, new, keep, tree)
    assert [(e["path"], e["utc"]) for e in merged] == [("notebooks/00_x.ipynb", "new"), ("notebooks/01_y.ipynb", "old")]
    assert len(dropped) == 2 and any("02_z" in d for d in dropped) and any("03_gone" in d for d in dropped)


def test_build_report_merges_and_describes_the_latest_run(tree):
    nbtools.save(notebook([code("import pkg")]), tree / "notebooks" / "01_y.ipynb")
    old = {"gpu": "old GPU", "utc": "2000-01-01T00:00:00Z", "unit_tests": {"passed": 3, "failed": 0, "skipped": 0},
           "notebooks": [entry(tree, utc="old"), entry(tree, "notebooks/01_y.ipynb", utc="old")]}
    meta = {"gpu": "NVIDIA H200", "torch": "2.11.0"}
    keep = {"notebooks/00_x.ipynb", "notebooks/01_y.ipynb"}
    rep, dropped = gpu_suite.build_report(old, [entry(tree, utc="new")], None, meta, "cmd --only 00", keep, tree)
    assert rep["gpu"] == "NVIDIA H200" and rep["command"] == "cmd --only 00" and rep["utc"] > old["utc"]
    assert rep["unit_tests"] == old["unit_tests"], "a run without unit tests keeps the previous unit_tests entry"
    assert [e["utc"] for e in rep["notebooks"]] == ["new", "old"] and not dropped
    assert rep["lib_sha256"] == nbtools.lib_sha256(tree)
    unit = {"passed": 5, "failed": 0, "skipped": 1, "failures": []}
    rep, _ = gpu_suite.build_report({}, [entry(tree)], unit, meta, "cmd", keep, tree)
    assert rep["unit_tests"] == unit and [e["path"] for e in rep["notebooks"]] == ["notebooks/00_x.ipynb"]
    ok = {"first_error": None, "passed": [1], "failed": [], "lines": []}
    stab, _ = gpu_suite.build_stability({"notebooks": [entry(tree, "notebooks/01_y.ipynb", n=5, runs=[ok] * 5)]},
                                        [entry(tree, runs=[ok] * 3)], meta, "cmd --repeat 3", keep, tree)
    assert stab["gpu"] == "NVIDIA H200" and [e["n"] for e in stab["notebooks"]] == [3, 5]


def test_stability_runs_accumulate_on_the_same_sources(tree):
    keep = {"notebooks/00_x.ipynb"}

    def run(passed=True, value="9 µs", deps=("lib/pkg/__init__.py", "lib/pkg/a.py")):
        r = {"first_error": None if passed else {"cell": 1, "ename": "AssertionError", "evalue": ""},
             "passed": [1] if passed else [], "failed": [] if passed else [1],
             "lines": [{"cell": 1, "kind": "[timing]", "label": "t", "occurrence": 0, "value": value}]}
        return entry(tree, deps=deps, runs=[r])

    merged, _ = evidence.merge_stability([], [run(), run(value="11 µs")], keep, tree)
    assert merged[0]["n"] == 1, "two entries for one path in one call: the later one (one notebook, one entry)"
    merged, _ = evidence.merge_stability([], [run()], keep, tree)
    merged, _ = evidence.merge_stability(merged, [run(value="11 µs")], keep, tree)
    merged, _ = evidence.merge_stability(merged, [run(passed=False, value="10 µs", deps=[])], keep, tree)
    e = merged[0]
    assert e["n"] == 3 and e["assert_cells"][0]["passed"] == 2 and len(e["failures"]) == 1
    assert e["measured"][0]["numbers"][0]["median"] == 0.01 and e["deps"] == ["lib/pkg/__init__.py", "lib/pkg/a.py"]
    assert evidence.freshness(e, tree) is None
    (tree / "lib" / "pkg" / "a.py").write_text("X = 1  # edited\n")
    merged, _ = evidence.merge_stability(merged, [run()], keep, tree)
    assert merged[0]["n"] == 1, "runs on other sources are not added up"
    many = merged
    for _ in range(evidence.MAX_RUNS + 3):
        many, _ = evidence.merge_stability(many, [run()], keep, tree)
    assert many[0]["n"] == evidence.MAX_RUNS


# ---- recording deps from inside the kernel -------------------------------------------------------------------

def test_deps_cell_reports_lib_files_and_leaves_no_names(tree, monkeypatch):
    def fake(name, file):
        m = types.ModuleType(name)
        m.__file__ = str(file)
        monkeypatch.setitem(sys.modules, name, m)

    fake("pinlab", tree / "lib" / "pinlab" / "__init__.py")
    fake("pkg_a_for_test", tree / "lib" / "pkg" / "a.py")
    fake("elsewhere_for_test", tree / "site-packages" / "x.py")
    ns: dict = {}
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(nbtools.deps_cell_source(tree), ns)
    assert set(ns) == {"__builtins__"}
    deps = nbtools.parse_deps_output("other output\n" + buf.getvalue(), tree)
    assert deps == ["lib/pinlab/__init__.py", "lib/pkg/a.py"]
    assert nbtools.parse_deps_output("no marker here\n", tree) is None
    fake("pinlab", tree / "site-packages" / "pinlab" / "__init__.py")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(nbtools.deps_cell_source(tree), {})
    with pytest.raises(RuntimeError, match="imported pinlab from"):
        nbtools.parse_deps_output(buf.getvalue(), tree)


@pytest.mark.slow
def test_run_notebook_records_deps_and_errors_in_a_real_kernel(tree):
    """One kernel: the deps cell sees what the notebook imported; with allow_errors the cells after a failure
    run, and run_outcome still counts the later asserting cell as not passed."""
    path = tree / "notebooks" / "01_err.ipynb"
    nbtools.save(notebook([code("import pkg, os\nassert 'PINLAB_TEST_DROPPED' not in os.environ", count=7,
                                outputs=[out("stale\n")]), code("raise ValueError('boom')"),
                           code("assert pkg.a.X == 1\nprint('[measured] x: 3 ms')")]), path)
    os.environ["PINLAB_TEST_DROPPED"] = "inherited"
    try:
        res = nbtools.run_notebook(path, tree / "ran.ipynb", env={"PYTHONPATH": str(tree / "lib"),
                                                                   "PINLAB_TEST_DROPPED": None},
                                   allow_errors=True, record_deps=True, root=tree, timeout=120)
    finally:
        assert os.environ.pop("PINLAB_TEST_DROPPED") == "inherited", "the caller's environment is restored"
    assert res["error"] is None
    assert res["deps"] == ["lib/pkg/__init__.py", "lib/pkg/a.py"]
    ran = nbtools.load(tree / "ran.ipynb")
    assert len(ran["cells"]) == 3, "the deps cell is removed again"
    assert [c["execution_count"] for c in ran["cells"]] == [1, 2, 3]
    assert nbtools.cell_errors(ran) == [{"cell": 1, "ename": "ValueError", "evalue": "boom"}]
    o = evidence.run_outcome(ran)
    assert (o["passed"], o["failed"]) == ([0], [2]) and o["first_error"]["cell"] == 1  # 0: the variable was dropped
    assert [ln["label"] for ln in o["lines"]] == ["x"]
    assert set(res["cell_seconds"]) == {0, 1, 2}
    assert nbtools.load(path)["cells"][0]["outputs"] == [out("stale\n")], "the source notebook is left alone"


@pytest.mark.slow
def test_run_notebook_without_allow_errors_stops_and_reports(tree):
    path = tree / "notebooks" / "02_stop.ipynb"
    nbtools.save(notebook([code("x = 1", count=4), code("assert x == 2, 'x is 1'"), code("assert x == 1", count=9)]), path)
    res = nbtools.run_notebook(path, env={"PYTHONPATH": str(tree / "lib")}, record_deps=True, root=tree, timeout=120)
    assert type(res["error"]).__name__ == "CellExecutionError" and res["deps"] is None
    ran = nbtools.load(path)
    assert [c["execution_count"] for c in ran["cells"]] == [1, 2, None], "no stale execution counts stay"
    assert evidence.run_outcome(ran)["failed"] == [1, 2]
    assert gpu_suite.one_line(res["error"]) == "AssertionError: x is 1"
    with pytest.raises(Exception, match="x is 1"):
        nbtools.execute(path)


# ---- stability aggregation ---------------------------------------------------------------------------------

def test_asserts_and_assert_cells():
    assert evidence.asserts("x = 1\nassert x == 1")
    assert evidence.asserts("if True:\n    assert ok, 'msg'")
    assert not evidence.asserts("# assert x\ns = 'assert y'\nprint(s)")
    assert evidence.asserts("%time assert x")  # IPython magic: falls back to lines
    nb = notebook([md("assert in prose"), code("assert 1"), code("print(1)"), code("y = 2\nassert y")])
    assert evidence.assert_cells(nb) == [1, 3]


def test_numbers_and_time_units():
    got = evidence.numbers_of("median 8.4 µs (min 980 ns, max 1.20 ms, n=50) on H200, 31% idle, 2.5x, 1.5 s")
    assert [(round(x, 9), u) for x, u in got] == [(0.0084, "ms"), (0.00098, "ms"), (1.2, "ms"), (50.0, None),
                                                 (31.0, "%"), (2.5, "x"), (1500.0, "ms")]
    assert evidence.numbers_of("12.5 GB/s over 4 MiB") == [(12.5, "GB/s"), (4.0, "MiB")]
    assert evidence.numbers_of("3 steps") == [(3.0, None)]


def test_machine_lines_by_cell_and_label():
    nb = notebook([code("x", outputs=[out("[timing] copy 4 KiB: 9.1 µs\n[measured] idle: 31%\nplain line\n"),
                                      out("[measured] idle: 40%\n")]),
                   code("y", outputs=[out("  [timing] a: b: 3 ms\n")])])
    lines = evidence.machine_lines(nb)
    assert [(ln["cell"], ln["kind"], ln["label"], ln["occurrence"], ln["value"]) for ln in lines] == [
        (0, "[timing]", "copy 4 KiB", 0, "9.1 µs"), (0, "[measured]", "idle", 0, "31%"),
        (0, "[measured]", "idle", 1, "40%"), (1, "[timing]", "a", 0, "b: 3 ms")]


def _run(first_error_cell=None, timing="9.0 µs", share="30%", cells=5):
    """An executed made-up notebook: cell 1 asserts, cell 2 prints, cell 3 asserts, cell 4 asserts."""
    srcs = ["import x", "assert True", "print()", "assert 1 == 1", "assert 2 == 2"]
    out_cells = []
    for i, s in enumerate(srcs[:cells]):
        outputs = []
        if i == 2:
            outputs = [out(f"[timing] copy: {timing}\n[measured] idle share: {share}\n")]
        if first_error_cell is not None and i == first_error_cell:
            outputs = [err("AssertionError", f"failed in {i}")]
        out_cells.append(code(s, outputs=outputs, count=i + 1))
    return notebook(out_cells)


def test_aggregate_stability_counts_passes_and_spreads():
    nb = _run()
    runs = [_run(), _run(timing="1.10 ms", share="60%"), _run(first_error_cell=3, timing="10.0 µs"),
            _run(first_error_cell=0), _run(timing="11.0 µs")]
    agg = evidence.aggregate_stability([evidence.run_outcome(r) for r in runs], nb)
    assert agg["n"] == 5
    assert [(c["cell"], c["passed"]) for c in agg["assert_cells"]] == [(1, 4), (3, 3), (4, 3)]
    assert agg["assert_cells"][1]["assert"] == "assert 1 == 1"
    (timing, share) = agg["measured"][1], agg["measured"][0]
    assert (timing["label"], timing["runs"]) == ("copy", 5)  # cells after a failure still ran (allow_errors)
    assert timing["numbers"] == [{"unit": "ms", "min": 0.009, "median": 0.01, "max": 1.1, "runs": 5}]
    assert share["label"] == "idle share" and share["numbers"][0]["max"] == 60.0
    assert [(f["run"], f["cell"]) for f in agg["failures"]] == [(3, 3), (4, 0)]
    summary = "\n".join(evidence.stability_summary([{"path": "notebooks/00_x.ipynb", **agg}]))
    assert "cell 3: 3/5" in summary and "most variable" in summary
    assert summary.index("'copy'") < summary.index("'idle share'")  # 12222% spread before 100%


def test_stability_spreads_compare_numbers_of_lines_of_one_shape():
    """Stop 57: solution 05's "recorded run" line changed GPU ("NVIDIA H200, 2026-12-02" five times, then "NVIDIA
    H100 80GB HBM3, 2026-12-05"), and its numbers were compared by position: 80 against 2026, 2026 against 12,
    reported as a 16783% spread. Numbers are compared among lines of the same shape only."""
    runs = [{"lines": [{"cell": 6, "kind": "[measured]", "label": "recorded run", "occurrence": 0, "value": v}],
             "first_error": None, "passed": [], "failed": []}
            for v in ["NVIDIA H200, 2026-12-02"] * 5 + ["NVIDIA H100 80GB HBM3, 2026-12-05"]]
    (m,) = evidence.aggregate_stability(runs, {"cells": []})["measured"]
    assert all(n["min"] == n["max"] for n in m["numbers"]), m["numbers"]
    assert [n["runs"] for n in m["numbers"]] == [5, 5, 5, 1, 1, 1, 1]


def _capture(nb, outcomes, path="notebooks/00_x.ipynb", sha=None, stdout=None, errors=None):
    """A made-up nbval capture of ``nb`` (conftest.py's records): ``outcomes`` {cell index: outcome} (code cells
    left out were never captured), ``stdout`` {index: text} (default: the cell's stored stdout)."""
    sha = sha or nbtools.source_sha256(nb)
    recs, k = [], 0
    for i, c in enumerate(nb["cells"]):
        if c["cell_type"] != "code":
            continue
        if i in outcomes:
            text = (stdout or {}).get(i, nbtools._stdout(c))
            recs.append({"path": path, "source_sha256": sha, "cell": i, "code_cell": k, "outcome": outcomes[i],
                         "message": "" if outcomes[i] == "passed" else f"nbval says {outcomes[i]}", "seconds": 0.5,
                         "stdout": text, "error": (errors or {}).get(i)})
        k += 1
    return recs


def test_nbval_capture_is_a_run_like_an_execution():
    nb = _run()
    cap = _capture(nb, dict.fromkeys(range(5), "passed"), stdout={2: "[timing] copy: 12.0 µs\n[measured] idle share: 50%\n"})
    o = evidence.nbval_outcome(cap, nb)
    assert o["via"] == "nbval" and o["first_error"] is None
    assert (o["passed"], o["failed"]) == ([1, 3, 4], [])
    assert [(ln["cell"], ln["label"], ln["value"]) for ln in o["lines"]] == [(2, "copy", "12.0 µs"), (2, "idle share", "50%")]
    agg = evidence.aggregate_stability([evidence.run_outcome(_run()), o], nb)
    assert agg["n"] == 2 and [c["passed"] for c in agg["assert_cells"]] == [2, 2, 2]
    timing = next(m for m in agg["measured"] if m["label"] == "copy")
    assert timing["numbers"] == [{"unit": "ms", "min": 0.009, "median": 0.0105, "max": 0.012, "runs": 2}]
    lines = [json.dumps(r) for r in cap] + ["", "{broken"]
    assert evidence.read_nbval_capture(lines) == {"notebooks/00_x.ipynb": cap}


def test_nbval_failing_cell_and_the_cells_after_it_do_not_pass():
    nb = _run()
    # cell 3 fails (an output mismatch: no error output), cell 4 passes afterwards in the same kernel: not passed
    o = evidence.nbval_outcome(_capture(nb, {0: "passed", 1: "passed", 2: "passed", 3: "failed", 4: "passed"}), nb)
    assert (o["passed"], o["failed"]) == ([1], [3, 4])
    assert o["first_error"] == {"cell": 3, "ename": "nbval", "evalue": "nbval says failed"}
    assert [ln["label"] for ln in o["lines"]] == ["copy", "idle share"], "a cell without an error output still measured"
    # an error in cell 1 (its error output kept), skipped and never captured cells after it: none passes
    e = {"ename": "AssertionError", "evalue": "too slow"}
    o = evidence.nbval_outcome(_capture(nb, {0: "passed", 1: "failed", 2: "passed", 3: "skipped"}, errors={1: e}), nb)
    assert (o["passed"], o["failed"]) == ([], [1, 3, 4]) and o["first_error"] == {"cell": 1, **e}
    o = evidence.nbval_outcome(_capture(nb, {0: "error", 1: "passed", 2: "passed", 3: "passed", 4: "passed"}), nb)
    assert o["passed"] == [] and o["first_error"]["cell"] == 0, "a setup error counts as a failure"
    # a cell whose fresh output is an error: its lines are not counted
    o = evidence.nbval_outcome(_capture(nb, dict.fromkeys(range(5), "passed"), errors={2: e}), nb)
    assert o["lines"] == []
    # a skipped cell (nbval-skip) with no failure before it only fails itself if it asserts
    o = evidence.nbval_outcome(_capture(nb, {0: "passed", 1: "passed", 2: "skipped", 3: "passed", 4: "skipped"}), nb)
    assert (o["passed"], o["failed"]) == ([1, 3], [4])


def test_add_nbval_runs_only_where_the_sources_hold(tree):
    path = tree / "notebooks" / "00_x.ipynb"
    nb = nbtools.load(path)
    meta = {"gpu": "NVIDIA H200"}
    ok = {"via": "execution", "first_error": None, "passed": [1], "failed": [], "lines": []}
    nbtools.save(notebook([code("import pkg")]), tree / "notebooks" / "01_y.ipynb")
    nbtools.save(notebook([code("import pkg\nassert 1")]), tree / "notebooks" / "02_z.ipynb")
    entries = [entry(tree, runs=[ok]), entry(tree, "notebooks/01_y.ipynb", runs=[ok]),
               entry(tree, "notebooks/02_z.ipynb", runs=[ok])]
    capture = {"notebooks/00_x.ipynb": _capture(nb, {1: "failed"}),
               "notebooks/02_z.ipynb": _capture(nb, {1: "passed"}, path="notebooks/02_z.ipynb", sha="other")}
    added, skipped = evidence.add_nbval_runs(entries, capture, meta, "2026-11-30T00:00:00Z", tree)
    assert added == {"notebooks/00_x.ipynb": 1}
    assert len(entries[0]["runs"]) == 2 and [len(e["runs"]) for e in entries[1:]] == [1, 1]
    run = entries[0]["runs"][1]
    assert (run["via"], run["passed"], run["failed"], run["gpu"], run["seconds"]) == ("nbval", [], [1], "NVIDIA H200", 0.5)
    assert any("01_y" in w and "no capture" in w for w in skipped) and any("another source" in w for w in skipped)
    merged, _ = evidence.merge_stability([], entries[:1], {"notebooks/00_x.ipynb"}, tree)
    assert merged[0]["n"] == 2 and merged[0]["assert_cells"][0]["passed"] == 1
    (tree / "lib" / "pkg" / "a.py").write_text("X = 1  # edited after the executions\n")
    entries = [entry(tree, runs=[ok])]
    (tree / "lib" / "pkg" / "a.py").write_text("X = 1  # edited again, before nbval\n")
    added, skipped = evidence.add_nbval_runs(entries, {"notebooks/00_x.ipynb": _capture(nb, {1: "passed"})}, meta, "t", tree)
    assert added == {} and "a lib file it imports changed" in skipped[0] and len(entries[0]["runs"]) == 1


def test_conftest_captures_nbval_cells(tmp_path, monkeypatch):
    """conftest.py's capture hook on a stand-in for nbval's IPyNbCell: outcome by phase, fresh stdout, index."""
    import conftest

    cap = tmp_path / "cap.jsonl"
    monkeypatch.setenv("PINLAB_NBVAL_CAPTURE", str(cap))
    cells = [{"cell_type": "markdown", "source": "# t"}, {"cell_type": "code", "source": "print(1)"},
             {"cell_type": "code", "source": "assert 0"}]
    import nbformat

    parent = types.SimpleNamespace(nb=nbformat.from_dict({"cells": cells}))  # as nbval's IPyNbFile.nb

    def item(k, outs):
        return types.SimpleNamespace(path=ROOT / "notebooks" / "00_x.ipynb", parent=parent, cell=parent.nb.cells[k],
                                     cell_num=k - 1, test_outputs=outs)

    def rep(when, outcome, duration=0.25):
        return types.SimpleNamespace(when=when, outcome=outcome, duration=duration, failed=outcome == "failed",
                                     skipped=outcome == "skipped", passed=outcome == "passed",
                                     longrepr=types.SimpleNamespace(reprcrash=types.SimpleNamespace(message="boom")))

    def phases(it, *outcomes):
        for when, outcome in zip(("setup", "call", "teardown"), outcomes):
            hook = conftest.pytest_runtest_makereport(it, types.SimpleNamespace(when=when))
            next(hook)
            with contextlib.suppress(StopIteration):
                hook.send(types.SimpleNamespace(get_result=lambda r=rep(when, outcome): r))

    phases(item(1, [{"output_type": "stream", "name": "stdout", "text": "1\n[timing] t: 3 ms\n"},
                    {"output_type": "stream", "name": "stderr", "text": "warn\n"}]), "passed", "passed", "passed")
    phases(item(2, [{"output_type": "error", "ename": "AssertionError", "evalue": "", "traceback": []}]),
           "passed", "failed", "passed")
    recs = [json.loads(ln) for ln in cap.read_text().splitlines()]
    sha = nbtools.source_sha256({"cells": cells})
    assert recs == [
        {"path": "notebooks/00_x.ipynb", "source_sha256": sha, "cell": 1, "code_cell": 0, "outcome": "passed",
         "message": "", "seconds": 0.75, "stdout": "1\n[timing] t: 3 ms\n", "error": None},
        {"path": "notebooks/00_x.ipynb", "source_sha256": sha, "cell": 2, "code_cell": 1, "outcome": "failed",
         "message": "boom", "seconds": 0.75, "stdout": "", "error": {"ename": "AssertionError", "evalue": ""}}]


def test_unexecuted_cells_do_not_pass():
    nb = _run()
    for c in nb["cells"][3:]:
        c["execution_count"] = None  # a timeout or a dead kernel in cell 3: no error output, no execution
    o = evidence.run_outcome(nb)
    assert (o["passed"], o["failed"]) == ([1], [3, 4])


def test_stability_problems(tree):
    nb = nbtools.load(tree / "notebooks" / "00_x.ipynb")
    good = entry(tree, n=5, assert_cells=[{"cell": 1, "passed": 5, "of": 5, "assert": "assert pkg.a.X == 1"}])
    assert evidence.assert_cells(nb) == [1]
    assert evidence.stability_problems(good, tree) == []
    assert any("only 3 runs (at least 5 needed)" in p for p in evidence.stability_problems(dict(good, n=3, assert_cells=[
        {"cell": 1, "passed": 3, "of": 3}]), tree, min_runs=5))
    few = evidence.MIN_RUNS - 1
    assert any(f"only {few} runs" in p for p in evidence.stability_problems(dict(good, n=few, assert_cells=[
        {"cell": 1, "passed": few, "of": few}]), tree))
    assert any("passed 4 of 5" in p for p in evidence.stability_problems(dict(good, assert_cells=[
        {"cell": 1, "passed": 4, "of": 5}]), tree))
    assert any("asserted cells [] recorded" in p for p in evidence.stability_problems(dict(good, assert_cells=[]), tree))
    # a claim is a checking cell; a run stored before claims counted passes one it reached without an error
    assert evidence.asserts("ok = pinlab.claims({'x': 1},\n    expect={'x': 1})") and evidence.asserts("pinlab.claim('x', 1)")
    assert not evidence.asserts("pinlab.observe('x', True)  # pinlab.claim( in a comment")
    assert evidence.cell_passed({"passed": [], "failed": [], "first_error": None}, 7)
    assert not evidence.cell_passed({"passed": [], "failed": [], "first_error": {"cell": 5}}, 7)
    assert evidence.cell_passed({"passed": [], "failed": [], "first_error": {"cell": 9}}, 7)
    assert not evidence.cell_passed({"passed": [], "failed": [7], "first_error": None}, 7)
    (tree / "lib" / "pkg" / "a.py").write_text("X = 1\n# changed\n")
    assert any("changed after its GPU run" in p for p in evidence.stability_problems(good, tree))


# ---- the one pytest run: nbval + gpu unit tests ------------------------------------------------------------

def test_pytest_results_per_notebook_and_unit_tests():
    recs = [
        {"nodeid": "notebooks/00_a.ipynb::Cell 0", "when": "setup", "outcome": "passed", "duration": 2.0},
        {"nodeid": "notebooks/00_a.ipynb::Cell 0", "when": "call", "outcome": "passed", "duration": 1.0},
        {"nodeid": "notebooks/01_b.ipynb::Cell 0", "when": "call", "outcome": "passed", "duration": 1.0},
        {"nodeid": "notebooks/01_b.ipynb::Cell 3", "when": "call", "outcome": "failed", "duration": 1.0,
         "message": "Unexpected output"},
        {"nodeid": "notebooks/02_c.ipynb", "when": "collect", "outcome": "failed", "message": "bad json"},
        {"nodeid": "tests/test_h2d.py::test_a", "when": "setup", "outcome": "passed"},
        {"nodeid": "tests/test_h2d.py::test_a", "when": "call", "outcome": "passed"},
        {"nodeid": "tests/test_h2d.py::test_b", "when": "call", "outcome": "failed", "message": "assert False"},
        {"nodeid": "tests/test_h2d.py::test_c", "when": "setup", "outcome": "skipped"},
        {"nodeid": "tests/test_h2d.py::test_d", "when": "call", "outcome": "passed"},
        {"nodeid": "tests/test_h2d.py::test_d", "when": "teardown", "outcome": "failed", "message": "leak"},
    ]
    nb = evidence.notebook_results(recs, ["notebooks/00_a.ipynb", "notebooks/01_b.ipynb", "notebooks/02_c.ipynb",
                                          "notebooks/03_d.ipynb"])
    assert {p: r["status"] for p, r in nb.items()} == {"notebooks/00_a.ipynb": "passed", "notebooks/01_b.ipynb": "failed",
                                                       "notebooks/02_c.ipynb": "failed", "notebooks/03_d.ipynb": "failed"}
    assert nb["notebooks/00_a.ipynb"]["seconds"] == 3.0 and "Cell 3" in nb["notebooks/01_b.ipynb"]["failures"][0]
    assert "ran no cell" in nb["notebooks/03_d.ipynb"]["failures"][0]
    unit = evidence.unit_test_results(recs)
    assert (unit["passed"], unit["failed"], unit["skipped"]) == (1, 2, 1)
    assert evidence.read_pytest_log(['{"nodeid": "x"}\n', "\n", "{broken\n"]) == [{"nodeid": "x"}]


def test_conftest_logs_each_phase(tmp_path, monkeypatch):
    import conftest

    log = tmp_path / "log.jsonl"
    monkeypatch.setenv("PINLAB_PYTEST_LOG", str(log))
    crash = types.SimpleNamespace(message="AssertionError: boom\nmore")
    conftest.pytest_runtest_logreport(types.SimpleNamespace(
        nodeid="tests/t.py::x", when="call", outcome="failed", duration=0.5, failed=True,
        longrepr=types.SimpleNamespace(reprcrash=crash)))
    conftest.pytest_runtest_logreport(types.SimpleNamespace(
        nodeid="tests/t.py::y", when="call", outcome="passed", duration=0.25, failed=False, longrepr=None))
    recs = evidence.read_pytest_log(log.read_text().splitlines())
    assert recs == [{"nodeid": "tests/t.py::x", "when": "call", "outcome": "failed", "duration": 0.5,
                     "message": "AssertionError: boom"},
                    {"nodeid": "tests/t.py::y", "when": "call", "outcome": "passed", "duration": 0.25, "message": ""}]
    monkeypatch.delenv("PINLAB_PYTEST_LOG")
    conftest.pytest_runtest_logreport(types.SimpleNamespace(
        nodeid="z", when="call", outcome="passed", duration=0.0, failed=False, longrepr=None))
    assert len(log.read_text().splitlines()) == 2


@pytest.mark.slow
def test_one_pytest_run_selects_notebook_cells_and_gpu_tests():
    files = gpu_suite.gpu_test_files()
    assert "tests/test_h2d.py" in files and "tests/test_evidence.py" not in files
    res = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "-m", "gpu or notebook", "--nbval", "--nbval-current-env", "notebooks/00_start_here.ipynb",
                          "tests/test_h2d.py"], cwd=ROOT, capture_output=True, text=True,
                         env=dict(os.environ, PINLAB_PYTEST_LOG=""))
    ids = [ln for ln in res.stdout.splitlines() if "::" in ln]
    assert any(i.startswith("notebooks/00_start_here.ipynb::Cell") for i in ids), res.stdout[-2000:]
    h2d = {i.split("::")[1].split("[")[0] for i in ids if i.startswith("tests/test_h2d.py::")}
    tree = ast.parse((ROOT / "tests" / "test_h2d.py").read_text())
    marked = {f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
              and any("mark.gpu" in ast.unparse(d) for d in f.decorator_list)}
    assert h2d == marked and marked


# ---- the command line ------------------------------------------------------------------------------------------

def test_suite_arguments():
    a = gpu_suite.parse_args(["--only", "03", "04", "--repeat", "5"])
    assert a.only == ["03", "04"] and a.repeat == 5 and not a.keep_going and a.cell_timeout == 300
    a = gpu_suite.parse_args(["--repeat", "3", "--only", "00", "--keep-going"])
    assert a.only == ["00"] and a.keep_going
    for bad in (["--repeat", "0"], ["--repeat", "x"], ["--only"], ["--cell-timeout", "0"], ["--bogus"]):
        with pytest.raises(SystemExit):
            gpu_suite.parse_args(bad)
    paths = [Path("notebooks/03_the_race.ipynb"), Path("notebooks/04_the_fix.ipynb"), Path("solutions/04_the_fix.ipynb")]
    assert gpu_suite.select(paths, ["04"]) == paths[1:] and gpu_suite.select(paths, None) == paths
    assert gpu_suite.select(paths, ["notebooks/04"]) == [paths[1]]
    assert gpu_suite.select(paths, ["notebooks/03_the_race", "solutions/"]) == [paths[0], paths[2]]
    assert gpu_suite.one_line(RuntimeError("a\nlong\ntraceback\nValueError: x")) == "RuntimeError: ValueError: x"


def test_budget_packs_notebooks_in_order_and_leaves_the_rest():
    secs = {"a": 10.0, "b": 100.0, "c": 5.0}
    # (repeat + 1) x seconds each; 30 s fixed; 7 s already spent
    def each(n):
        return dict.fromkeys("abcd", n)

    assert gpu_suite.fit_budget(list("abcd"), secs, each(1), 400, 7) == (list("abcd"), [])  # d: 30 s, unknown
    assert gpu_suite.fit_budget(list("abcd"), secs, each(2), 300, 7) == (["a", "c", "d"], ["b"])
    assert gpu_suite.fit_budget(["b"], secs, each(5), 300, 0) == ([], ["b"])
    assert gpu_suite.fit_budget(["b"], secs, each(1), 300, 0, nbval=False) == (["b"], [])  # 100 s + 30 s


def test_a_budget_expects_a_slower_gpu_than_the_recordings():
    """Seconds recorded on an H200 are expected 1.2x longer on an H100 (a margin between stop 58/59's 1.50x and
    stop 60's 0.96x: suite_common.GPU_SLOWDOWN), never shorter the other way, and unknown GPUs or seconds stay as
    they are: a quiet pass chooses its notebooks up front, and one planned on H200 seconds could run past its call
    on an H100."""
    from suite_common import expected_seconds

    h100, h200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
    assert expected_seconds(100.0, h200, h100) == 120.0
    assert expected_seconds(100.0, h100, h200) == 100.0
    assert expected_seconds(100.0, h200, h200) == 100.0
    assert expected_seconds(None, h200, h100) is None and expected_seconds(100.0, None, "a GPU") == 100.0


def test_stale_counts_the_runs_still_needed(tree):
    ok = {"first_error": None, "passed": [1], "failed": [], "lines": []}
    bad = dict(ok, passed=[], failed=[1])
    e = entry(tree, runs=[ok, bad, ok])
    assert gpu_suite.runs_needed(None, 1, False, tree) == 1 and gpu_suite.runs_needed(None, 5, True, tree) == 5
    assert gpu_suite.runs_needed(e, 5, True, tree) == 2, "a failure on fresh sources is a run like any other"
    assert gpu_suite.runs_needed(e, 3, True, tree) == 0
    assert gpu_suite.runs_needed(dict(e, status="failed"), 1, False, tree) == 0
    assert gpu_suite.runs_needed(e, 5, True, tree, nbval=True) == 1, "the nbval pass is the other run"
    assert gpu_suite.runs_needed(e, 4, True, tree, nbval=True) == 1, "nbval needs an execution to run on"
    assert gpu_suite.runs_needed(e, 3, True, tree, nbval=True) == 0
    (tree / "lib" / "pkg" / "a.py").write_text("X = 1  # edited\n")
    assert gpu_suite.runs_needed(e, 1, False, tree) == 1 and gpu_suite.runs_needed(e, 5, True, tree) == 5
    assert gpu_suite.runs_needed(e, 5, True, tree, nbval=True) == 4


def test_the_evidence_test_asks_the_policys_five_runs():
    """CONTRIBUTING's policy is N >= 5 GPU runs per notebook; lowering MIN_RUNS would weaken every evidence test."""
    assert evidence.MIN_RUNS >= 5, f"tools/evidence.py MIN_RUNS is {evidence.MIN_RUNS}; the policy asks 5"


@pytest.mark.wrapping
def test_a_wrapped_machine_line_is_read_as_one_line(capsys):
    """pinlab.show wraps at 100 columns; the stability numbers come from the whole line, joined back."""
    import pinlab

    label = "what this run shows: a label long enough to wrap, with numbers at its end"
    pinlab.show(label, "pinned 5.7x pageable, 12.5 GB/s against 2.2 GB/s, over 3 rounds of 1 GiB each, and so on")
    out = capsys.readouterr().out
    assert len(out.splitlines()) > 1 and all(len(ln) <= 100 for ln in out.splitlines())
    nb = {"cells": [{"cell_type": "code", "source": "", "outputs": [{"output_type": "stream", "name": "stdout",
                                                                        "text": out + "an ordinary line\n"}]}]}
    lines = evidence.machine_lines(nb)
    assert len(lines) == 1 and lines[0]["label"] == "what this run shows"
    assert [n for n, _ in evidence.numbers_of(lines[0]["value"])][:3] == [5.7, 12.5, 2.2]
    assert lines[0]["value"].endswith("and so on")


@pytest.mark.wrapping
def test_the_sanitizer_masks_a_wrapped_machine_line_and_nothing_after_it(capsys):
    import configparser
    import re

    import pinlab

    cfg = configparser.ConfigParser()
    cfg.read(Path(__file__).parent / "nbval_sanitize.cfg")
    sec = cfg["pinlab-machine-dependent-lines"]
    pinlab.report("a timing " + "with a long label " * 6, 1.5)
    pinlab.show("then", "a measured line " * 10)
    out = capsys.readouterr().out + "    an indented ordinary line\nok: True\n"
    masked = re.sub(sec["regex"], sec["replace"].replace("\\n", "\n"), out)
    assert masked == "[machine-dependent lines masked]\n    an indented ordinary line\nok: True\n"


def test_nbval_log_keeps_a_block_only_while_no_later_pass_ran_its_notebooks_again():
    def block(t, *words):
        return f"# 2026-12-01T{t}Z\n$ python3 -m pytest -q --nbval {' '.join(words)}\nout {t}\n"

    first = block("10:00", "notebooks/a.ipynb", "notebooks/b.ipynb", "tests/test_x.py")
    second = block("11:00", "notebooks/a.ipynb")
    log = gpu_suite.merge_log(gpu_suite.merge_log("", first), second)
    assert log == first + second                          # b and the unit tests were not run again
    third = block("12:00", "notebooks/b.ipynb", "tests/test_y.py")
    assert gpu_suite.merge_log(log, third) == second + third  # the first block is superseded, in order kept
    assert gpu_suite.merge_log(second + third, second) == third + second  # a rerun replaces its own old block


# ---- the quiet reference pass: refusal, lock and conditions (made-up process lists, no GPU) -------------------

def _procs(*pids, mib=512):
    return [{"pid": p, "used_mib": mib, "gpu_uuid": None} for p in pids]


def test_the_quiet_pass_refuses_other_processes_and_names_them():
    assert gpu_suite.refusal([]) is None, "an unshared GPU and no other suite: it runs"
    why = gpu_suite.refusal(_procs(4242, 777))
    assert why.startswith("gpu_suite: refused") and "2 other processes use the GPU" in why
    assert "pid 4242 (512 MiB)" in why and "pid 777 (512 MiB)" in why and "--shared" in why
    assert "1 other process uses the GPU: pid 9 (512 MiB)" in gpu_suite.refusal(_procs(9))
    assert "could not list" in gpu_suite.refusal(None), "a GPU whose processes cannot be listed is not known quiet"
    holder = {"pid": 31337, "pass": "stability", "command": "python3 tools/gpu_suite.py --stability-only", "utc": "t"}
    why = gpu_suite.refusal([], [holder])
    assert "another GPU suite of this checkout is running: pid 31337 (stability pass" in why


def test_this_suite_and_its_children_are_not_other_processes():
    me = os.getpid()
    table = {me: 1, 500: me, 501: 500, 600: 1, 601: 600}  # 500: a kernel, 501: its child; 600/601 someone else's
    assert gpu_suite.descendants(table, me) == {me, 500, 501}
    c = gpu_suite.sample_conditions(query=lambda uuid: _procs(me, 501, 601), table=table)
    assert [p["pid"] for p in c["other_gpu_processes"]] == [601]
    assert set(c) >= {"utc", "other_gpu_processes", "load_avg", "cores_usable"} and c["cores_usable"] >= 1
    assert gpu_suite.sample_conditions(query=lambda uuid: None, table=table)["other_gpu_processes"] is None
    real = gpu_suite.process_table()
    assert real.get(me) == os.getppid() and me in gpu_suite.own_pids(real)


def test_the_end_sample_waits_for_a_kernel_that_has_just_exited():
    answers, slept = [_procs(12), []], []
    c = gpu_suite.sample_end(query=lambda uuid: answers.pop(0) if answers else [], table={}, sleep=slept.append)
    assert c["other_gpu_processes"] == [] and slept == [1.0]
    slept.clear()
    c = gpu_suite.sample_end(query=lambda uuid: _procs(13), table={}, retries=3, sleep=slept.append)
    assert [p["pid"] for p in c["other_gpu_processes"]] == [13] and len(slept) == 3, "a process that stays counts"


def test_a_notebook_is_quiet_only_alone_from_start_to_end_in_the_quiet_pass():
    alone = {"other_gpu_processes": [], "load_avg": [0.5, 0.4, 0.3], "cores_usable": 16}
    c = gpu_suite.notebook_conditions(gpu_suite.QUIET, "NVIDIA H200", alone, alone)
    assert c["quiet"] is True and c["why_not_quiet"] is None and c["gpu"] == "NVIDIA H200"
    assert c["start"]["load_avg"] == [0.5, 0.4, 0.3] and c["end"]["cores_usable"] == 16
    shared = dict(alone, other_gpu_processes=_procs(55))
    c = gpu_suite.notebook_conditions(gpu_suite.QUIET, "NVIDIA H200", alone, shared)
    assert c["quiet"] is False and "at its end pid 55 (512 MiB) used the GPU" in c["why_not_quiet"]
    c = gpu_suite.notebook_conditions(gpu_suite.QUIET, "g", dict(alone, other_gpu_processes=None), alone)
    assert c["quiet"] is False and "could not be listed" in c["why_not_quiet"]
    c = gpu_suite.notebook_conditions("development", "g", alone, alone)
    assert c["quiet"] is False and "development pass" in c["why_not_quiet"], "only the quiet pass is quiet"


def test_the_suites_lock_keeps_the_quiet_pass_alone_and_lets_the_others_share(tmp_path):
    with gpu_suite.suite_lock(False, "stability", "python3 tools/gpu_suite.py --stability-only --only 03", tmp_path):
        with gpu_suite.suite_lock(False, "adverse", "python3 tools/gpu_suite.py --adverse a", tmp_path):
            assert len(gpu_suite.live_holders(tmp_path)) == 2, "stability and adverse passes may share"
        with pytest.raises(gpu_suite.SuiteBusy) as exc:
            with gpu_suite.suite_lock(True, gpu_suite.QUIET, "python3 tools/gpu_suite.py", tmp_path):
                pytest.fail("the quiet pass started beside another suite")
        assert exc.value.exclusive and f"pid {os.getpid()} (stability pass" in str(exc.value)
        assert "--only 03" in gpu_suite.refusal([], exc.value.holders)
    assert gpu_suite.live_holders(tmp_path) == [], "a suite that ends leaves no record"
    with gpu_suite.suite_lock(True, gpu_suite.QUIET, "python3 tools/gpu_suite.py", tmp_path):
        with pytest.raises(gpu_suite.SuiteBusy, match="the quiet reference pass of the GPU suite is running"):
            with gpu_suite.suite_lock(False, "stability", "x", tmp_path):
                pass
    stale = tmp_path / "suite-holders" / "999999-1.json"
    stale.write_text(json.dumps({"pid": 999999, "pass": "stability", "command": "killed", "utc": "t"}))
    assert gpu_suite.live_holders(tmp_path, alive=lambda pid: False) == [] and not stale.exists()


def test_only_the_plain_suite_is_the_quiet_pass_and_writes_the_committed_outputs():
    def which(*argv):
        a = gpu_suite.parse_args(list(argv))
        return gpu_suite.suite_pass(a), gpu_suite.writes_evidence(a)

    assert which() == (gpu_suite.QUIET, True) and which("--only", "03", "--repeat", "2") == (gpu_suite.QUIET, True)
    assert which("--shared") == ("development", False) and which("--keep-going") == ("development", False)
    assert which("--stability-only", "--repeat", "3") == ("stability", False)
    assert which("--adverse", "a") == ("adverse", False)
    for bad in (["--shared", "--stability-only"], ["--adverse", "a", "--shared"]):
        with pytest.raises(SystemExit):
            gpu_suite.parse_args(bad)


def test_main_refuses_the_quiet_pass_beside_another_process_and_lets_shared_run(monkeypatch, tmp_path, capsys):
    import torch

    from pinlab import probe

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))  # main() prepends lib/ to both
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(gpu_suite, "BUILD", tmp_path)
    monkeypatch.setattr(gpu_suite, "suite_facts", lambda: {
        "gpu": "NVIDIA H200", "driver": "580", "capability": "9.0", "torch": "2.11", "cuda_runtime": "13.0",
        "flashinfer": None, "uuid": "GPU-1"})
    monkeypatch.setattr(gpu_suite.time, "sleep", lambda s: None)
    ran = []
    monkeypatch.setattr(gpu_suite, "run_suite", lambda args, argv, meta, command, t0: ran.append(
        (gpu_suite.suite_pass(args), meta["uuid"])) or 0)
    monkeypatch.setattr(probe, "compute_apps", lambda uuid=None: _procs(4242))
    assert gpu_suite.main([]) == gpu_suite.REFUSED and not ran
    out = capsys.readouterr().out
    assert "refused" in out and "pid 4242 (512 MiB)" in out
    assert gpu_suite.main(["--shared"]) == 0 and ran == [("development", "GPU-1")]
    assert gpu_suite.main(["--stability-only"]) == 0 and ran[-1][0] == "stability"
    monkeypatch.setattr(probe, "compute_apps", lambda uuid=None: [])
    assert gpu_suite.main(["--only", "03"]) == 0 and ran[-1] == (gpu_suite.QUIET, "GPU-1")
    with gpu_suite.suite_lock(False, "stability", "python3 tools/gpu_suite.py --stability-only", tmp_path):
        assert gpu_suite.main([]) == gpu_suite.REFUSED, "another suite of this checkout holds the lock"
    assert "another GPU suite of this checkout is running" in capsys.readouterr().out


def test_a_quiet_run_publishes_its_recordings_and_a_staging_copy_keeps_the_rest(tmp_path):
    reports = tmp_path / "reports"
    (reports / "data").mkdir(parents=True)
    (reports / "data" / "01_a.json").write_text("old a")
    (reports / "data" / "01_b.json").write_text("b")
    (reports / "latest.json").write_text("{}")
    staging = tmp_path / "staging"
    data = gpu_suite.prepare_staging(staging, reports)
    assert sorted(f.name for f in data.iterdir()) == ["01_a.json", "01_b.json"] and (staging / "latest.json").exists()
    (data / "01_a.json").write_text("new a")
    (data / "02_c.json").write_text("c")
    assert (reports / "data" / "01_a.json").read_text() == "old a", "nothing reaches reports/ before publishing"
    assert gpu_suite.publish_staging(staging, reports) == ["01_a.json", "02_c.json"]
    assert (reports / "data" / "01_a.json").read_text() == "new a" and (reports / "data" / "02_c.json").exists()
    traces = tmp_path / "traces"
    traces.mkdir()
    old, new = traces / "old.json", traces / "new.json"
    old.write_text("{}")
    os.utime(old, (1000.0, 1000.0))
    new.write_text("{}")
    assert gpu_suite.new_traces(2000.0, traces) == [new]


def test_compute_apps_rows_are_read_and_other_gpus_left_out(monkeypatch):
    from pinlab import probe

    rows = ["41, 1024, GPU-aaaa", "77, [N/A], GPU-bbbb", "90"]
    assert probe.parse_compute_apps(rows) == [{"pid": 41, "used_mib": 1024, "gpu_uuid": "GPU-aaaa"},
                                              {"pid": 77, "used_mib": None, "gpu_uuid": "GPU-bbbb"},
                                              {"pid": 90, "used_mib": None, "gpu_uuid": None}]
    with pytest.raises(ValueError, match="start with a pid"):
        probe.parse_compute_apps(["No running processes found"])
    gpus = ["GPU-aaaa", "GPU-bbbb"]
    monkeypatch.setattr(probe, "_nvidia_smi", lambda query, kind="--query-gpu": gpus if query == "uuid" else rows)
    assert [p["pid"] for p in probe.compute_apps("aaaa")] == [41, 90], "another GPU's processes do not share this one"
    assert [p["pid"] for p in probe.compute_apps("GPU-AAAA")] == [41, 90]
    assert [p["pid"] for p in probe.compute_apps()] == [41, 77, 90]
    assert [p["pid"] for p in probe.compute_apps("MIG-1234")] == [41, 77, 90], "a UUID NVML does not know: all count"
    monkeypatch.setattr(probe, "_nvidia_smi", lambda *a, **k: ["garbage"])
    assert probe.compute_apps() is None, "output it cannot read is 'cannot tell', not 'no process'"
    assert probe.others(None, {1}) is None and probe.others(_procs(1, 2), {1}) == _procs(2)


def test_the_header_prints_the_conditions_live_and_replayed(monkeypatch, capsys):
    import pinlab
    from pinlab import probe
    from pinlab import run_header as device

    alone = {"other_gpu_processes": [], "load_avg": [0.42, 0.3, 0.2], "cores_usable": 16}
    line = device.live_conditions_text("NVIDIA H200", alone, "quiet-reference")
    assert line == ("NVIDIA H200, no other process on it; host load 0.42 (1-min average) on 16 usable cores; "
                    "the GPU suite's quiet reference pass")
    line = device.live_conditions_text("NVIDIA H200", dict(alone, other_gpu_processes=_procs(7, 8)), None)
    assert "2 other processes on it (pid 7 using 512 MiB, pid 8 using 512 MiB)" in line
    assert line.endswith("your live run, not the GPU suite's quiet reference pass")
    monkeypatch.setenv("PINLAB_SUITE_PASS", "stability")
    assert probe.suite_pass() == "stability"
    monkeypatch.setenv("PINLAB_SUITE_PASS", "bogus")
    assert probe.suite_pass() is None
    cond = gpu_suite.notebook_conditions(gpu_suite.QUIET, "NVIDIA H200", alone, dict(alone, load_avg=[0.9, 0.5, 0.2]))
    report = {"notebooks": [{"path": "notebooks/02b_overlapping_copies.ipynb", "conditions": cond},
                            {"path": "notebooks/02_fake_non_blocking.ipynb"}]}
    text = device.recorded_conditions_text("02b overlapping copies", report)
    assert text == ("the GPU suite's quiet reference pass: NVIDIA H200, no other process on it from start to end; "
                    "host load 0.42 at its start, 0.90 at its end (1-min average) on 16 usable cores")
    assert device.recorded_conditions_text("02 fake", report).startswith("not recorded (notebooks/02_fake")
    cond = gpu_suite.notebook_conditions(gpu_suite.QUIET, "NVIDIA H200", alone, dict(alone, other_gpu_processes=_procs(5)))
    text = device.recorded_conditions_text("02b overlapping copies", {"notebooks": [
        {"path": "notebooks/02b_overlapping_copies.ipynb", "conditions": cond}]})
    assert text.startswith("NOT the quiet reference pass (at its end pid 5 (512 MiB) used the GPU)")
    assert "at its end 1 other process on it (pid 5 using 512 MiB)" in text
    monkeypatch.setenv("PINLAB_FORCE_CPU", "1")
    pinlab.header("02b overlapping copies")
    out = capsys.readouterr().out
    assert "\n  recorded conditions: " in out, "a replay shows the recorded run's conditions"


def test_a_live_header_says_which_run_it_is(monkeypatch, capsys):
    """Issue 49: a saved notebook opened before it runs showed "mode: measuring live on this GPU"; the live line
    now names the run (UTC, to the minute), so a stored header reads as that run's."""
    import re

    from pinlab import run_header

    gpu = {"python": "3.12", "torch": "2.11", "flashinfer": None, "cuda_available": True, "gpu": "NVIDIA H200",
           "capability": "9.0", "cuda_runtime": "13.0", "driver": "580", "pinned_memory": True}
    monkeypatch.setattr(run_header, "facts", lambda: gpu)
    monkeypatch.setattr(run_header, "live_conditions_text", lambda name, *a, **k: f"{name}, quiet")
    run_header.header("04 the fix")
    out = capsys.readouterr().out
    assert re.search(r"\n  mode: measured live on this GPU, in the run of 20\d\d-\d\d-\d\d \d\d:\d\d UTC \(a saved",
                     out), out
    assert "measuring live" not in out
