"""What the GPU suite's passes share (tools/gpu_suite.py: the plain, stability and development passes;
tools/adverse.py: the adverse conditions): the checkout's paths, UTC time, reading a report, choosing notebooks by
name, packing them into a time budget, and stability.json after a run. It imports neither torch nor pinlab."""
from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import evidence
import nbtools
import scope

ROOT = nbtools.ROOT
REPORTS = ROOT / "reports" / "gpu"


def utc_now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def load_json(path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        print(f"note: {path.relative_to(ROOT)} is unreadable ({exc}): starting it afresh")
        return None


def select(paths, only):
    """The notebooks whose file name contains a NAME, or whose path does when the NAME has a '/'
    (``--only notebooks/04`` leaves out ``solutions/04_the_fix.ipynb``)."""
    if not only:
        return paths
    return [p for p in paths if any((o in Path(p).as_posix()) if "/" in o else (o in p.name) for o in only)]


#: how many times longer a --budget expects a notebook to run on the GPU named first than on the one named second.
#: Measured twice, far apart: the 13 notebooks that stop 58 recorded on an H100 took 344.2 s there and 228.8 s on
#: the H200 in stop 59 (1.50x; 1.17-1.77 each), while in stop 60 the 20 notebooks took 313.1 s on an H100 against
#: 326.0 s recorded on the H200 with the same code (0.96x; 0.74-1.56 each). 1.5 split stop 60's plumbing renewal,
#: planned as one call of 403 s, into two (9 solutions left over, 62 s). 1.2 is a margin between the two, not a
#: measured constant: with it a plan of up to 7.4 minutes stays one 9-minute call.
GPU_SLOWDOWN = {("NVIDIA H100 80GB HBM3", "NVIDIA H200"): 1.2}


def expected_seconds(seconds, recorded_on, running_on):
    """``seconds`` recorded on the GPU ``recorded_on``, as a --budget should expect them on ``running_on``: longer
    where :data:`GPU_SLOWDOWN` says that GPU is slower, never shorter (a budget keeps its margin); None stays None.
    A quiet pass selects its notebooks up front: on a slower GPU than the recording's, the call would otherwise
    run past its timeout and lose the whole pass."""
    factor = GPU_SLOWDOWN.get((running_on, recorded_on))
    return seconds * factor if factor and seconds else seconds


def fit_budget(paths, seconds: dict, counts: dict, budget: float, spent: float, nbval: bool = True,
               default: float = 30.0, fixed: float = 30.0):
    """(kept, left): the notebooks, in order, whose estimated time (``counts[p]`` executions, + the nbval pass,
    from ``seconds``, the last recorded seconds per path) still fits into ``budget`` after ``spent`` seconds and
    ``fixed`` seconds for the pytest start and the unit tests."""
    kept, left, total = [], [], spent + fixed
    for p in paths:
        cost = (counts[p] + (1 if nbval else 0)) * (seconds.get(p) or default)
        if total + cost <= budget:
            kept.append(p)
            total += cost
        else:
            left.append(p)
    return kept, left


def build_stability(old: dict, entries: list[dict], meta: dict, command: str, keep, root=ROOT, latest=None):
    """stability.json after this run: this run's executions added to each notebook's runs that still hold
    (evidence.merge_stability, scoped by ``latest``: latest.json as it is now, scope.stale_check; the entries of
    other notebooks kept unless they can never hold again, scope.dead_check); GPU, versions and time of this run
    at the top."""
    merged, dropped = evidence.merge_stability(old.get("notebooks", []), entries, keep, root,
                                               stale=scope.stale_check(latest, root), dead=scope.dead_check(latest, root))
    return {**meta, "utc": utc_now(), "command": command, "notebooks": merged}, dropped
