"""The header every notebook starts with: the machine, the versions, and the run's conditions (live now, or
those the GPU suite recorded for the run a replay shows). Apart from :mod:`pinlab.device` (which stays a leaf
that every module may import), so that the modules it needs (plots, timing, probe, replay) can import
``device`` at the top without an import cycle (tests/test_import_graph.py)."""
from __future__ import annotations

import json

from . import probe
from .device import _gpu_uuid, facts
from .plots import use_course_style
from .replay import data_dir
from .timing import wrapped


def header(lesson: str | None = None) -> dict:
    """Print the header every notebook starts with, and return the facts. It also applies the course's plot style
    (:func:`pinlab.plots.use_course_style`: palette, layout, retina figures), so that every figure of a notebook
    has it, also one drawn with plain matplotlib before anything imports ``pinlab.plots``.

    Its last line gives the run's conditions: live, the GPU, the other processes on it, the host's load and
    usable cores now, and whether this is the GPU suite's quiet reference pass ($PINLAB_SUITE_PASS); replayed,
    the conditions the GPU suite recorded for this lesson's notebook in reports/gpu/latest.json (found by the
    lesson's number, the first word of ``lesson``)."""
    if lesson is not None and not isinstance(lesson, str):
        raise TypeError(f"lesson must be a str such as '01 pinned memory' or None, got {type(lesson).__name__}")
    use_course_style()
    f = facts()
    lines = [f"pinlab | {lesson}" if lesson else "pinlab",
             f"  python {f['python']}, torch {f['torch']}, FlashInfer {f['flashinfer'] or 'not installed'}"]
    if f["cuda_available"]:
        lines += [f"  GPU: {f['gpu']} (compute capability {f['capability']}), CUDA {f['cuda_runtime']}, "
                  f"driver {f['driver'] or 'unknown'}, pinned memory: {'yes' if f['pinned_memory'] else 'NO'}",
                  f"  mode: measured live on this GPU, in the run of {_now_utc()} (a saved notebook shows that "
                  "run until its cells run again)",
                  f"  now: {live_conditions_text(f['gpu'])}"]
    else:
        lines += ["  GPU: none (no CUDA device visible to torch)",
                  "  mode: CPU replay: GPU experiments show the latest recorded GPU run, labelled as such",
                  f"  recorded run: {_recorded_run()}",
                  f"  recorded conditions: {recorded_conditions_text(lesson)}"]
    for line in lines:
        print(wrapped(line, indent=4))
    return f


def live_conditions_text(gpu: str | None, conditions: dict | None = None, which: str | None = None) -> str:
    """The header's line on a live run's conditions (``conditions``: :func:`pinlab.probe.run_conditions`, taken
    now when None; ``which``: the suite's pass, :func:`pinlab.probe.suite_pass` when None)."""
    c = probe.run_conditions(uuid=_gpu_uuid()) if conditions is None else conditions
    which = probe.suite_pass() if which is None else which
    ref = probe.SUITE_PASSES.get(which, "your live run, not the GPU suite's quiet reference pass")
    return f"{gpu or 'the GPU'}, {probe.processes_text(c.get('other_gpu_processes'))}; {probe.load_text(c)}; {ref}"


def _now_utc() -> str:
    """This run's date and time, UTC, to the minute: a saved notebook's header then reads as that run's (issue 49:
    "measuring live" read as if it were measuring now, in a notebook opened before it runs)."""
    from datetime import datetime, timezone

    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def recorded_conditions_text(lesson: str | None, report: dict | None = None) -> str:
    """The header's line on the conditions of the recorded run a replay shows: those the GPU suite recorded for
    this lesson's notebook (``notebooks/<number>_*.ipynb``, ``<number>`` the first word of ``lesson``) in
    ``report`` (reports/gpu/latest.json, read beside the recorded data when None)."""
    if report is None:
        try:
            report = json.loads((data_dir().parent / "latest.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return "unknown (reports/gpu/latest.json is missing or unreadable)"
    number = lesson.split()[0] if lesson and lesson.split() else None
    rows = report.get("notebooks") if isinstance(report, dict) else None
    entry = next((r for r in rows or [] if isinstance(r, dict) and number
                  and str(r.get("path", "")).startswith(f"notebooks/{number}_")), None)
    if entry is None:
        return "unknown (no notebook of this lesson in reports/gpu/latest.json)"
    c = entry.get("conditions")
    if not isinstance(c, dict) or not isinstance(c.get("start"), dict) or not isinstance(c.get("end"), dict):
        return (f"not recorded ({entry['path']}'s run predates the quiet reference pass: nothing says whether "
                "it had the GPU to itself)")
    start, end = c["start"], c["end"]
    what = ("the GPU suite's quiet reference pass" if c.get("quiet") is True
            else f"NOT the quiet reference pass ({c.get('why_not_quiet') or c.get('pass') or 'no reason recorded'})")
    gpu = c.get("gpu") or "the GPU"
    procs = [start.get("other_gpu_processes"), end.get("other_gpu_processes")]
    seen = (f"{gpu}, {probe.processes_text(procs[0])} from start to end" if procs[0] == procs[1]
            else f"{gpu}, at its start {probe.processes_text(procs[0])}, at its end {probe.processes_text(procs[1])}")
    loads = [x.get("load_avg") for x in (start, end)]
    load = ("host load unknown" if not all(loads) else
            f"host load {loads[0][0]:.2f} at its start, {loads[1][0]:.2f} at its end (1-min average)")
    cores = start.get("cores_usable")
    return f"{what}: {seen}; {load}" + (f" on {cores} usable cores" if cores else "")


def _recorded_run() -> str:
    """One line on the GPU run the replay shows (its GPU and versions, from reports/gpu/latest.json)."""
    path = data_dir().parent / "latest.json"  # beside the recorded data: a checkout's or a wheel's
    try:
        rep = json.loads(path.read_text(encoding="utf-8"))
        return (f"{rep['gpu']}, {rep['utc'][:10]}: torch {rep['torch']}, CUDA {rep['cuda']}, "
                f"FlashInfer {rep.get('flashinfer') or 'not installed'}, driver {rep.get('driver') or 'unknown'}")
    except (OSError, ValueError, KeyError, TypeError):
        return f"none readable at {path} (run the GPU suite on a CUDA machine, or git checkout reports/gpu)"
