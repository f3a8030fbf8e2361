"""A pytest gate: fail a test whose code races (by order, :func:`pinlab.detect_races` (``pinlab.order``); by timing
with ``pinlab_races_verdict = timing``, :func:`pinlab.races.detect_races`) or stalls (:func:`pinlab.detect_stalls`).

Installed with pinlab (the ``pytest11`` entry point ``pinlab``), it does nothing until asked:

* ``pytest --pinlab-races`` / ``pytest --pinlab-stalls``: every test runs under the detector(s), ``unittest``
  test cases too;
* ``@pytest.mark.pinlab_races`` / ``@pytest.mark.pinlab_stalls`` on a test (or a class or module, through
  ``pytestmark``): that test does;
* the fixtures ``pinlab_races`` / ``pinlab_stalls``: the test runs under the detector and gets its report
  (to look at what was found; the gate still fails the test on a finding that is not allowed).

The race gate judges by order (a latent race fails the test in every run, whether or not the GPU kept up:
:mod:`pinlab.order`); ``pinlab_races_verdict = timing`` in the ini file judges by timing instead (a race fails
the test only when this run's timing made it happen); ``pinlab_races_watch = copies`` watches the copies, a few
reads and writes and the ordering operations only, with no torch function mode (cheaper; a write that leaves the
bytes as they were, and a read through another torch call, are then not seen: ``pinlab.order.WatchDetector``).
Copies too large for the detector to keep a shadow of are named in
a warning (writes through torch calls are still judged; writes through numpy are not).

A test fails with the detector's report when a finding is not allowed. Allow known ones with
``allow=[...]`` on the marker, or in the ini file (one entry per line)::

    [tool.pytest.ini_options]
    pinlab_allow = [
        "pageable H2D (may wait for the GPU)",   # a kind, as the detector names it
        "src/loader.py:42",                      # a place: the file:line of the copy or call (a path suffix)
    ]

The race detector needs a CUDA device or the emulated stream (``with pinlab.stream() as s:`` on a machine
without CUDA, entered inside the test: the gate's detector follows it). The stall detector reports CUDA
traffic only. Importing this plugin imports neither torch nor pinlab: a test session that asks for no gate
pays nothing. ``docs/race_gate.md`` has the adoption guide.
"""
from __future__ import annotations

import pytest

_OPTIONS = {"races": "--pinlab-races", "stalls": "--pinlab-stalls"}
#: pinlab.order.VERDICTS and WATCHES (not imported: a session that asks for no gate imports neither torch nor pinlab)
_VERDICTS = ("order", "timing")
_WATCHES = ("every_op", "copies")


def pytest_addoption(parser):
    group = parser.getgroup("pinlab", "pinlab: fail tests whose code races or stalls")
    group.addoption("--pinlab-races", action="store_true", default=False,
                    help="run every test under pinlab.races.detect_races() and fail those that race")
    group.addoption("--pinlab-stalls", action="store_true", default=False,
                    help="run every test under pinlab.detect_stalls() and fail those that stall")
    parser.addini("pinlab_allow", type="linelist", default=[],
                  help="findings the pinlab gate allows: a kind, or a file:line (path suffix) of the copy or call")
    parser.addini("pinlab_races_verdict", default="order",
                  help="how the race gate decides: order (the default: what the program's order allows, in every "
                       "run) or timing (races this run's timing made happen)")
    parser.addini("pinlab_races_watch", default="every_op",
                  help="what the order verdict watches: every_op (the default: every torch call, a write found where "
                       "it is made) or copies (the copies, a few reads and writes and the ordering operations: cheaper)")


def pytest_configure(config):
    config.addinivalue_line("markers", "pinlab_races(allow=()): fail this test if its code can race "
                            "(by order: pinlab.detect_races; by timing: pinlab_races_verdict = timing); allow: kinds or file:line "
                            "places to accept")
    config.addinivalue_line("markers", "pinlab_stalls(allow=()): fail this test if its code stalls "
                            "(pinlab.detect_stalls); allow: kinds or file:line places to accept")


def _allowed(entries, kind: str, places) -> bool:
    for entry in entries:
        entry = entry.strip()
        if not entry:
            continue
        if entry == kind:
            return True
        if ":" in entry and any(place == entry or place.endswith("/" + entry) for place in places if place):
            return True  # a file:line, as a path suffix at a folder boundary
    return False


def _allow_list(item, which: str) -> list:
    entries = list(item.config.getini("pinlab_allow"))
    for mark in item.iter_markers(name=f"pinlab_{which}"):
        allow = mark.kwargs.get("allow", ())
        if isinstance(allow, str):
            allow = [allow]
        try:
            entries.extend(str(a) for a in allow)
        except TypeError:
            raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.pinlab_{which}(allow=...) must be a list of "
                                    f"kinds or file:line places, got {allow!r}") from None
    return entries


class _Gate:
    """The detectors one test runs under, and the verdict on what they found."""

    def __init__(self, item, which):
        self.item = item
        self.which = which        # ("races", "stalls") subset
        self.detectors = {}
        self.reports = {}
        if "races" in which:
            verdict = str(item.config.getini("pinlab_races_verdict")).strip() or "order"
            if verdict not in _VERDICTS:
                raise pytest.UsageError(f"pinlab_races_verdict must be one of {list(_VERDICTS)}, got {verdict!r} "
                                        f"(in the ini file)")
            watch = str(item.config.getini("pinlab_races_watch")).strip() or "every_op"
            if watch not in _WATCHES:
                raise pytest.UsageError(f"pinlab_races_watch must be one of {list(_WATCHES)}, got {watch!r} "
                                        f"(in the ini file)")
            if verdict == "timing" and watch != "every_op":
                raise pytest.UsageError("pinlab_races_watch = copies needs pinlab_races_verdict = order (the timing "
                                        "verdict watches every op)")
            from pinlab.order import detect_races  # both verdicts (timing: pinlab.races.detect_races's detector)

            self.detectors["races"] = detect_races(verdict=verdict, watch=watch)
            self.reports["races"] = self.detectors["races"].report
        if "stalls" in which:
            from pinlab.detector import detect_stalls

            self.detectors["stalls"] = detect_stalls(max_events=None)
            self.reports["stalls"] = self.detectors["stalls"].report

    def __enter__(self):
        entered = []
        try:
            for det in self.detectors.values():
                det.__enter__()
                entered.append(det)
        except BaseException:
            for det in reversed(entered):
                det.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc):
        for det in reversed(list(self.detectors.values())):
            det.__exit__(*exc)
        return False

    def unchecked(self) -> str | None:
        rep = self.reports.get("races")
        if rep is None or not rep.unchecked:
            return None
        n = sum(rep.unchecked.values())
        where = ", ".join(f"{w} ({c})" for w, c in rep.unchecked.most_common(3))
        return (f"{self.item.nodeid}: the race gate kept no shadow of {n} cop{'y' if n == 1 else 'ies'} over "
                f"max_shadow_bytes ({where}): writes through torch calls were judged, writes through numpy were not")

    def problems(self) -> list:
        out = []
        if "races" in self.reports:
            allow = _allow_list(self.item, "races")
            rep = self.reports["races"]
            bad = [f for f in rep.findings if not _allowed(allow, f.kind, (f.copy_where, f.seen_where))]
            if bad:
                out.append(rep.summary() + ("" if len(bad) == len(rep.findings) else
                                            f"\n  ({len(rep.findings) - len(bad)} of these allowed by pinlab_allow)"))
        if "stalls" in self.reports:
            allow = _allow_list(self.item, "stalls")
            rep = self.reports["stalls"]
            bad = [(k, op, w, c) for (k, op, w), c in rep.places.items() if not _allowed(allow, k, (w,))]
            if bad:
                lines = [f"{c} x {k}: {op} at {w}" for k, op, w, c in bad]
                out.append("pinlab.detect_stalls found " + "; ".join(lines))
        return out


def _which(item) -> tuple:
    which = []
    for name, option in _OPTIONS.items():
        if (item.config.getoption(option.lstrip("-").replace("-", "_"))
                or item.get_closest_marker(f"pinlab_{name}") is not None
                or f"pinlab_{name}" in getattr(item, "fixturenames", ())):
            which.append(name)
    return tuple(which)


def _gate(item):
    gate = item.stash.get(_GATE_KEY, None)
    if gate is None:
        which = _which(item)
        if not which:
            return None
        gate = _Gate(item, which)
        item.stash[_GATE_KEY] = gate
    return gate


_GATE_KEY = pytest.StashKey()


class PinlabGateWarning(UserWarning):
    """What the gate could not judge (copies it kept no shadow of)."""


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    # the call phase of every kind of test item (functions, unittest.TestCase methods): fixtures are set up
    # before it and torn down after it, outside the detectors
    gate = _gate(item)
    if gate is None:
        return (yield)
    with gate:
        result = yield
    note = gate.unchecked()
    if note:
        import warnings

        warnings.warn(PinlabGateWarning(note), stacklevel=1)
    problems = gate.problems()
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)
    return result


@pytest.fixture
def pinlab_races(request):
    """The :class:`pinlab.races.RaceReport` (by order: :class:`pinlab.order.OrderReport`) of this test (the test runs
    under the race detector)."""
    return _gate(request.node).reports["races"]


@pytest.fixture
def pinlab_stalls(request):
    """The :class:`pinlab.detector.StallReport` of this test (the test runs under the stall detector)."""
    return _gate(request.node).reports["stalls"]
