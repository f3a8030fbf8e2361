"""pytest set-up for the whole repository: the notebooks run under nbval (strict).

* stderr is never compared (progress bars, CUDA warnings, FlashInfer build logs go there);
* ``--require-gpu`` (the GPU suite) turns a missing CUDA device into a usage error instead of
  letting the notebooks fall back to replaying the recorded GPU run;
* every notebook cell gets the marker ``notebook`` (the GPU suite selects ``-m "gpu or notebook"``: the
  ``gpu`` unit tests and nbval in one pytest run);
* with $PINLAB_PYTEST_LOG set, each test phase's outcome is appended there as a JSON line (the GPU suite
  reads them back per notebook and for the unit tests: tools/evidence.py);
* with $PINLAB_NBVAL_CAPTURE set, every notebook cell nbval ran (or skipped) is appended there as a JSON line
  once its teardown is done: {path, source_sha256, cell (index in the notebook's cells), code_cell, outcome
  (passed / failed / error / skipped), message, seconds, stdout (its fresh stdout), error ({ename, evalue} of
  an error output, or null)}; the GPU suite counts each notebook's nbval pass as a stability run from it
  (evidence.nbval_outcome).
"""
import json
import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "tools"))
sys.path.append(str(ROOT / "tests"))  # tests/gpu_child.py, for the fixture _gpu_trace_stays_off
os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")


def _register_hypothesis_profiles() -> None:
    """One set of Hypothesis settings for every property test (a test file sets only max_examples).

    * ``default`` (also CI): derandomized, no example database, no deadline: a fresh clone's first example
      may import half of torch (``torch.testing.assert_close`` pulls in ``torch.distributed.tensor``, about
      6 s cold), and a loaded 2-core machine runs any example slower; a hang is caught by the bad-input
      suite's own generous deadline (tests/test_bad_input.py) and by pytest's CI time limit, not by 2 s;
    * ``deep`` (``HYPOTHESIS_PROFILE=deep`` or ``PINLAB_BAD_INPUT_EXAMPLES=N``): random, N examples (500).
    """
    try:
        from hypothesis import HealthCheck, settings
    except ImportError:  # the test extra is not installed: nothing to register
        return
    quiet = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large]
    settings.register_profile("default", deadline=None, derandomize=True, database=None,
                              suppress_health_check=quiet, print_blob=True)
    deep = int(os.environ.get("PINLAB_BAD_INPUT_EXAMPLES", "0") or 0) or 500
    settings.register_profile("deep", deadline=None, derandomize=False, database=None, max_examples=deep,
                              suppress_health_check=quiet, print_blob=True)
    wanted = os.environ.get("HYPOTHESIS_PROFILE") or ("deep" if os.environ.get("PINLAB_BAD_INPUT_EXAMPLES") else "default")
    settings.load_profile(wanted)


_register_hypothesis_profiles()


def pytest_addoption(parser):
    parser.addoption("--require-gpu", action="store_true",
                     help="fail instead of replaying recorded results when CUDA is absent")


_PHASE_SECONDS: dict[str, float] = {}


def _phase(nodeid: str) -> str:
    head = nodeid.split("::", 1)[0]
    if head.endswith(".ipynb"):
        return f"nbval {head.split('/', 1)[0]}/"
    if head.startswith("tests/test_site"):
        return "site (headless browser)"
    if head.startswith("tests/test_lab"):
        return "JupyterLab"
    return "unit tests"


def pytest_terminal_summary(terminalreporter):
    """The time per phase at the end of every run (`make test`: unit tests, each notebook folder, the site)."""
    if not _PHASE_SECONDS:
        return
    total = sum(_PHASE_SECONDS.values())
    parts = ", ".join(f"{k} {v:.0f} s" for k, v in sorted(_PHASE_SECONDS.items(), key=lambda kv: -kv[1]))
    terminalreporter.write_line(f"time per phase: {parts} (tests: {total:.0f} s)")


#: what the tests, their notebook kernels, JupyterLab and Chromium would otherwise write into the home folder
#: (IPython's profile and history, matplotlib's font cache, Jupyter's config, data and runtime files,
#: Chromium's crash reports and dconf cache, pip's and npm's caches): one private folder per test session
PRIVATE_HOME_VARS = {"IPYTHONDIR": "ipython", "MPLCONFIGDIR": "matplotlib", "JUPYTER_CONFIG_DIR": "jupyter-config",
                     "JUPYTER_DATA_DIR": "jupyter-data", "XDG_CONFIG_HOME": "config", "XDG_CACHE_HOME": "cache",
                     "XDG_DATA_HOME": "data", "npm_config_cache": "npm"}
_PRIVATE_HOME: dict = {}


def _use_private_home_dirs() -> None:
    """Point every variable of :data:`PRIVATE_HOME_VARS` at a folder of a fresh temporary one (removed at the end
    of the session, with what was in it), so that `make test` leaves nothing in the home folder. The home folder
    itself (HOME) stays: git's identity, FlashInfer's and Triton's kernel caches on a GPU host live there."""
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="pinlab-test-home-"))
    _PRIVATE_HOME.update(base=base, saved={k: os.environ.get(k) for k in PRIVATE_HOME_VARS})
    for var, sub in PRIVATE_HOME_VARS.items():
        (base / sub).mkdir()
        os.environ[var] = str(base / sub)
    # removed at exit, after the exit handlers registered later (IPython's writes its history there at exit;
    # removed in pytest_unconfigure, its database was gone: "attempt to write a readonly database")
    import atexit
    import shutil

    atexit.register(shutil.rmtree, base, True)


def pytest_unconfigure(config):
    if _PRIVATE_HOME.pop("base", None) is None:
        return
    for var, value in _PRIVATE_HOME.pop("saved").items():
        if value is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = value


def pytest_configure(config):
    if not config.getoption("--require-gpu"):
        # not on the GPU suite's host: there, kernel caches that honour XDG_CACHE_HOME (torch's extension
        # builds, FlashInfer's JIT where it does) must persist between runs
        _use_private_home_dirs()
    if config.getoption("--require-gpu"):
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--require-gpu was given but torch.cuda.is_available() is False")


def pytest_collectstart(collector):
    if getattr(collector, "path", None) is not None and collector.path.suffix == ".ipynb":
        collector.skip_compare += ("stderr",)


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        if getattr(item, "path", None) is not None and item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.notebook)


def _short(report) -> str:
    if not report.failed:
        return ""
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    if crash is not None and getattr(crash, "message", None):
        return crash.message.strip().splitlines()[0][:300] if crash.message.strip() else ""
    lines = [ln for ln in str(report.longrepr).splitlines() if ln.strip()]
    return " | ".join(lines[-3:])[-300:]


def _log(record: dict) -> None:
    path = os.environ.get("PINLAB_PYTEST_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


def pytest_runtest_logreport(report):
    _PHASE_SECONDS[_phase(report.nodeid)] = _PHASE_SECONDS.get(_phase(report.nodeid), 0.0) + report.duration
    _log({"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
          "duration": round(report.duration, 3), "message": _short(report)})


_PHASE_OUTCOME = {"setup": "error", "call": "failed", "teardown": "error"}


def _capture_cell(item, reports: dict) -> dict:
    """The $PINLAB_NBVAL_CAPTURE record of one nbval cell (``reports``: its test reports by phase)."""
    import nbtools

    nb_item = item.parent
    if not hasattr(nb_item, "_pinlab_sha256"):
        nb_item._pinlab_sha256 = nbtools.source_sha256(nb_item.nb)
    index = next((i for i, c in enumerate(nb_item.nb.cells) if c is item.cell), None)
    outcome, message = "passed", ""
    for when in ("setup", "call", "teardown"):
        rep = reports.get(when)
        if rep is None:
            continue
        if rep.failed:
            outcome, message = _PHASE_OUTCOME[when], re.sub(r"\x1b\[[0-9;]*m", "", _short(rep))  # no colours
            break
        if rep.skipped:  # nbval-skip, or an xfail after a timeout
            outcome = "skipped"
            break
    if "call" not in reports and outcome == "passed":
        outcome = "skipped"  # never ran
    outs = getattr(item, "test_outputs", None) or []  # nbval's fresh outputs (raw: not sanitized)
    stdout = "".join(o.get("text", "") for o in outs if o.get("output_type") == "stream" and o.get("name") == "stdout")
    error = next(({"ename": o.get("ename", ""), "evalue": str(o.get("evalue", ""))[:300]}
                  for o in outs if o.get("output_type") == "error"), None)
    return {"path": Path(os.path.relpath(item.path, ROOT)).as_posix(), "source_sha256": nb_item._pinlab_sha256,
            "cell": index, "code_cell": item.cell_num, "outcome": outcome, "message": message,
            "seconds": round(sum(r.duration for r in reports.values()), 3), "stdout": stdout, "error": error}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    path = os.environ.get("PINLAB_NBVAL_CAPTURE")
    if not path or getattr(item, "path", None) is None or item.path.suffix != ".ipynb" \
            or not hasattr(item, "cell_num"):
        return
    reports = item.__dict__.setdefault("_pinlab_reports", {})
    reports[call.when] = outcome.get_result()
    if call.when == "teardown":
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(_capture_cell(item, reports)) + "\n")


def pytest_collectreport(report):
    if report.failed:
        _log({"nodeid": report.nodeid, "when": "collect", "outcome": "failed", "duration": 0.0,
              "message": _short(report)})


@pytest.fixture(autouse=True)
def _gpu_trace_stays_off(request):
    """A test must not turn torch's GPU trace on in the suite's process (tests/gpu_child.py says why)."""
    import gpu_child

    was_on = gpu_child.gpu_trace_on()
    yield
    problem = gpu_child.trace_problem(request.node.nodeid, was_on, gpu_child.gpu_trace_on(),
                                      bool(os.environ.get(gpu_child.CHILD)))
    if problem:
        pytest.fail(problem)


@pytest.fixture(autouse=True)
def _unwrapped_output(request, monkeypatch):
    """Unit tests match printed messages as whole sentences: pinlab's 100-column wrapping is off for them (a
    test marked ``wrapping`` keeps it; tests/test_evidence.py tests the wrapping itself). Notebooks (nbval)
    run in their own kernels: they wrap as a learner sees it."""
    if request.node.get_closest_marker("wrapping") is None and "pinlab.text" in sys.modules:
        monkeypatch.setattr(sys.modules["pinlab.text"], "WIDTH", 10**6)
    yield
