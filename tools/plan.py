"""``python3 tools/gpu_suite.py --plan``: what the current tree's GPU evidence lacks, and the device calls that renew it.

CPU only (no torch, no kernel): it reads reports/gpu/ and the files, and prints

* per notebook, what is stale and why: which file changed, and which proof that stales (scope.py: the quiet pass
  follows every dep; stability and the adverse conditions follow the source and the experiment files, and carry
  forward over a plumbing change when the quiet pass claims the same);
* the calls that renew it, each a chain of gpu_suite commands whose estimate is at most :data:`CALL_LIMIT_S`
  (9 minutes), estimated from the recorded seconds (latest.json, adverse.json) plus :data:`FIXED_S` per suite
  command and :data:`START_S` per call for the machine's start and the transfers;
* whether the tree passes ``make test`` after each call, and a last line ``plan: N call(s), M device-minutes``.

A call renews whole lessons (notebooks/NN with solutions/NN: quiet pass, then the adverse conditions, then the
stability runs still missing), so the tree after it passes the evidence tests of every notebook it covers.
The suite records each command's planned and actual seconds in reports/gpu/renewals.json (:func:`estimate`).
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import evidence
import nbtools
import scope

ROOT = nbtools.ROOT
REPORTS = ROOT / "reports" / "gpu"
CALL_LIMIT_S = 540.0   # one device call's command: 9 minutes (a call may run 10; the rest is margin)
START_S = 90.0         # a machine's start, the tree's transfer and the wheels' install, per call
SESSION_MIN = 30.0     # device-minutes a session has, earlier tries at the same work included
#: what a call that got no machine cost: 90 s where one kind was tried (stop 60: 91 s and 90 s), 180 s where the
#: H100 and then the H200 were (stop 61: 11 refused calls cost 1,531 s, the last four 180 s each)
FAILED_START_S = 180.0
#: a call sent while the last one's machine is still warm (within its 30 s after a reply): transfers and the gap,
#: no start (measured in stop 57: 396 s held for a 386 s command, 134 s for 126 s)
WARM_S = 15.0
#: one gpu_suite command's fixed part: its set-up (the machine's facts in a child) and its reports. Measured in stop
#: 58 (H100) on the four quiet-pass commands: set-up 15.3, 9.5, 11.3 and 13.0 s, reports 0.7-1.0 s; 30 s had
#: planned them x0.86-x0.92 of what they took
FIXED_S = 20.0
#: a --stability-only command's fixed part: no unit tests, no nbval (stop 56, H200: set-up 8.6 s and reports
#: 0.4 s of 32.6 s; FIXED_S planned 51.6 s for it, x0.63, outside issue 44's +-30%)
FIXED_STABILITY_S = 12.0
UNIT_TESTS_S = 60.0    # the gpu unit tests, where latest.json recorded no time for them
DEFAULT_S = 60.0       # a notebook never timed on the GPU
ADVERSE_FACTOR = 2.5   # an adverse pass of all conditions at once against the quiet pass, where none was timed
MIN_RUNS = evidence.MIN_RUNS
MIN_EXECUTIONS = 3     # recorded executions of a notebook before their median replaces latest.json's seconds
SUITE = "python3 tools/gpu_suite.py"


def _load(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, ValueError):
        return None


def quiet_seconds(latest: dict | None, stability: dict | None = None) -> dict:
    """Recorded seconds of one execution per notebook: latest.json's, or, given ``stability`` (stability.json),
    the median of the notebook's recorded executions there (its quiet passes and stability runs, of this
    experiment) where it has at least :data:`MIN_EXECUTIONS`. Why: the last pass's machine sets latest.json's
    seconds, and machines differ; stop 62's H100 took 384 s for a call planned at 262 s from stop 60's (x1.47,
    outside issue 44's +-30%), where the medians of the executions recorded by then planned 294 s (x1.31)."""
    out = {e.get("path"): e.get("seconds") for e in (latest or {}).get("notebooks", []) if e.get("seconds")}
    for e in (stability or {}).get("notebooks", []):
        runs = [r["seconds"] for r in e.get("runs", []) if r.get("via") == "execution" and r.get("seconds")]
        if e.get("path") in out and len(runs) >= MIN_EXECUTIONS:
            out[e["path"]] = round(statistics.median(runs), 1)
    return out


def adverse_seconds(adverse: dict | None, latest: dict | None = None, root: Path = ROOT,
                    condition: str | None = None) -> dict:
    """Per notebook, the estimated seconds of its adverse passes, all conditions at once: its longest recorded pass
    under any condition, of whatever version (its own runs tell how it takes sharing: lesson 04's soak slows down
    3.6x, lesson 09 not at all), but not less than its quiet seconds now; for a notebook never run under them, its
    quiet seconds times the median slow-down of the notebooks whose adverse runs are of their current source, up
    to its code's layout (scope.same_form), or :data:`ADVERSE_FACTOR`. Stop 58 (H100): that median slow-down
    (2.1x) had been applied to every notebook, and lesson 09's pass was planned at 153 s and took 81.5 s (x0.56);
    each notebook's own longest pass, with the quiet floor and :data:`FIXED_S`, plans this stop's four adverse
    commands at x0.91-x1.06 of what they took (04: 236 s for 248; 05, 07 and 08: 233 for 212; 09: 94 for 100 and
    99 for 103).

    ``condition``: an extra condition's id (evidence.EXTRA_CONDITIONS), sent on its own: the same estimate from
    that condition's recorded passes only (stop 63, an H100: (f) took 37-57 s per lesson where the five together
    took 113-251 s, and the plan had sent it at the five's seconds, 598 s for 182)."""
    recorded: dict = {}
    current: set = set()
    for c in (adverse or {}).get("conditions", []):
        if condition is not None and c.get("id") != condition:
            continue
        if condition is None and c.get("id") not in evidence.ADVERSE_CONDITIONS:
            continue  # an extra condition (f) is not in the passes the five send
        for e in c.get("notebooks", []):
            path = root / e.get("path", "")
            if path.exists() and (e.get("source_sha256") == nbtools.source_sha256(nb := nbtools.load(path))
                                  or scope.same_form(e, nb)):
                current.add(e["path"])
            for r in e.get("runs", []):
                if r.get("seconds"):
                    recorded[e["path"]] = max(recorded.get(e["path"], 0.0), r["seconds"])
    quiet = quiet_seconds(latest)
    ratios = sorted(recorded[p] / quiet[p] for p in current & set(recorded) if quiet.get(p))
    factor = ratios[len(ratios) // 2] if ratios else ADVERSE_FACTOR
    return {p: max(recorded[p], quiet.get(p, 0.0)) if p in recorded else factor * quiet.get(p, 0.0)
            for p in set(recorded) | {q for q in quiet if q.startswith("notebooks/")}}


def _lesson(rel: str) -> str:
    return scope.lesson_id(rel) or Path(rel).stem


def status(root: Path = ROOT) -> list[dict]:
    """Per notebook of the suite: what its three proofs need. ``latest``: why the quiet pass is stale (None: it
    holds); ``stability`` and each adverse condition: {state: "holds" | "carry" | "renew", why}; ``runs``: the
    stability runs still to add."""
    reports = root / "reports" / "gpu"
    latest = _load(reports / "latest.json") or {}
    stab = {e.get("path"): e for e in (_load(reports / "stability.json") or {}).get("notebooks", [])}
    adverse = _load(reports / "adverse.json") or {}
    conds = {c.get("id"): {e.get("path"): e for e in c.get("notebooks", [])} for c in adverse.get("conditions", [])}
    rows = scope.latest_rows(latest)
    unrecorded = scope.uncarried(latest, _load(reports / "stability.json"), adverse, root)
    out = []
    for p in nbtools.notebook_paths(nbtools.NOTEBOOK_DIRS, root):
        rel = p.relative_to(root).as_posix()
        row = rows.get(rel)
        latest_why = evidence.freshness(row, root) if row else "not in latest.json"
        if row and not latest_why and row.get("status") != "passed":
            latest_why = f"{rel} did not pass its last quiet pass ({row.get('status')})"
        if not latest_why and rel in unrecorded:
            latest_why = (f"{rel}: its {', '.join(unrecorded[rel])} runs carry forward, and only its quiet pass "
                          "records that comparison (scope.uncarried)")
        rec = {"path": rel, "lesson": _lesson(rel), "latest": latest_why,
               "changed": nbtools.changed_files(row["deps_files"], root) if row and row.get("deps_files") else []}
        e = stab.get(rel)
        state, why = scope.entry_state(e, row, root) if e is not None else ("renew", "none recorded")
        held = 0
        if state != "renew":
            counts = evidence.stability_problems(e, root, stale=lambda _: None)  # runs, passes, claims per run
            if counts:
                state, why = "renew", counts[0]
                few = all("runs (at least" in c for c in counts)  # only too few runs: the others still count
                held = len(e.get("runs") or []) if few else 0
        rec["stability"] = {"state": state, "why": why, "runs": max(0, MIN_RUNS - held) if state == "renew" else 0}
        if rel.startswith("notebooks/"):
            skips = evidence.skip_tagged_cells(nbtools.load(p))
            adv = {}
            for cid in evidence.required_conditions(rel):
                spec = evidence.ALL_CONDITIONS[cid]
                ae = conds.get(cid, {}).get(rel)
                state, why = scope.entry_state(ae, row, root) if ae is not None else ("renew", "none recorded")
                runs = (ae or {}).get("runs") or []
                if state != "renew" and (len(runs) != spec["learners"]
                                         or not all(evidence.adverse_run_passed(r, skips) for r in runs)):
                    state, why = "renew", "a learner's pass failed or is missing"
                adv[cid] = {"state": state, "why": why}
            rec["adverse"] = adv
        out.append(rec)
    return out


def estimate(paths, kind: str, root: Path = ROOT, repeat: int = 1, unit_tests: bool = False,
             nbval: bool = False, condition: str | None = None) -> float:
    """Estimated seconds of one gpu_suite command over ``paths`` (a list, or {path: executions}): ``kind``
    "quiet" (one execution each; ``nbval``: and a strict nbval pass of each; ``unit_tests``: and the gpu unit
    tests), "adverse" (every condition at once: the longest learner's passes, one notebook after another; with
    ``condition``, that extra condition alone) or "stability" (``repeat`` executions each, unless ``paths`` gives
    the number, one after another)."""
    reports = root / "reports" / "gpu"
    latest = _load(reports / "latest.json")
    quiet = quiet_seconds(latest, _load(reports / "stability.json"))
    counts = dict(paths) if isinstance(paths, dict) else dict.fromkeys(paths, 1 if kind == "quiet" else repeat)
    total = FIXED_STABILITY_S if kind == "stability" else FIXED_S
    if kind in ("quiet", "stability"):
        total += sum(n * (quiet.get(p) or DEFAULT_S) for p, n in counts.items())
        if nbval:
            total += sum(quiet.get(p) or DEFAULT_S for p in counts)
        if unit_tests:
            total += ((latest or {}).get("unit_tests") or {}).get("seconds") or UNIT_TESTS_S
    elif kind == "adverse":
        adv = adverse_seconds(_load(reports / "adverse.json"), latest, root, condition)
        total += sum(adv.get(p) or ADVERSE_FACTOR * (quiet.get(p) or DEFAULT_S) for p in counts)
    else:
        raise ValueError(f"kind must be quiet, adverse or stability, got {kind!r}")
    return round(total, 1)


def record_renewal(command: str, kind: str, planned_s: float, actual_s: float, notebooks: list[str],
                   path: Path | None = None, utc: str = "") -> dict:
    """Add one gpu_suite command's planned and actual seconds to reports/gpu/renewals.json (the plan's estimate
    held against what the GPU took; ``ratio`` actual / planned). Returns the record."""
    path = REPORTS / "renewals.json" if path is None else path
    rec = {"utc": utc, "command": command, "kind": kind, "notebooks": len(notebooks),
           "planned_s": round(planned_s, 1), "actual_s": round(actual_s, 1),
           "ratio": round(actual_s / planned_s, 2) if planned_s else None}
    data = _load(path) or {"about": "each gpu_suite command's seconds as tools/plan.py estimated them before it "
                                    "ran (planned_s) and as it took them (actual_s); a device call adds about "
                                    f"{START_S:.0f} s of start and transfers (plan.START_S)", "renewals": []}
    data["renewals"] = (data.get("renewals") or [])[-99:] + [rec]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    return rec


def _work(quiet=()) -> dict:
    """An empty piece of work (what :func:`lesson_work` returns), with these quiet passes."""
    return {"quiet": list(quiet), "adverse": [], "extra": [], "stability": []}


def lesson_work(recs: list[dict]) -> dict:
    """What renews one lesson's notebooks (``recs``: their :func:`status`): {"quiet": [...], "adverse": [...],
    "extra": [(condition, path), ...], "stability": [...]}. The quiet pass where it is stale; the five adverse
    conditions of a notebook of notebooks/ where any of them needs renewing (their (a) and (b) passes add 4
    stability runs); an extra condition it requires (evidence.EXTRA_CONDITIONS) on its own; stability-only runs
    where the quiet pass and the adverse passes still leave a notebook under :data:`MIN_RUNS`."""
    work: dict = _work()
    for r in recs:
        if r["latest"]:
            work["quiet"].append(r["path"])
        renew = [cid for cid, a in sorted(r.get("adverse", {}).items()) if a["state"] == "renew"]
        if any(cid in evidence.ADVERSE_CONDITIONS for cid in renew):
            work["adverse"].append(r["path"])
        work["extra"] += [(cid, r["path"]) for cid in renew if cid not in evidence.ADVERSE_CONDITIONS]
        if r["stability"]["state"] == "renew":
            given = (1 if r["path"] in work["quiet"] else 0) + (4 if r["path"] in work["adverse"] else 0)
            if r["stability"]["runs"] > given:
                work["stability"].append(r["path"])
    return work


def _steps(work: dict, root: Path, unit_tests: bool, every: bool) -> list[tuple[str, str, float]]:
    """One call's commands: the quiet pass of its notebooks (``every``: exactly the stale ones, so --stale alone),
    then their adverse conditions, then the stability runs still missing."""
    steps = []
    if work["quiet"]:  # (a lib change stales some notebook's quiet pass: the unit tests go with it)
        q = work["quiet"]
        sel = " --stale" if every else f" --only {' '.join(q)}"
        steps.append((f"{SUITE}{sel}{'' if unit_tests else ' --no-unit-tests'}",
                      "quiet pass of " + (f"all {len(q)} stale notebooks" if every else ", ".join(q))
                      + (" and the gpu unit tests" if unit_tests else ""),
                      estimate(q, "quiet", root, unit_tests=unit_tests)))
    if work["adverse"]:
        steps.append((f"{SUITE} --adverse-all-together --only {' '.join(work['adverse'])}",
                      "the five adverse conditions (4 stability runs with them) of " + ", ".join(work["adverse"]),
                      estimate(work["adverse"], "adverse", root)))
    for cid in sorted({c for c, _ in work["extra"]}):
        paths = [p for c, p in work["extra"] if c == cid]
        steps.append((f"{SUITE} --adverse {cid} --only {' '.join(paths)}",
                      f"the adverse condition {evidence.condition_title(cid)} of " + ", ".join(paths),
                      estimate(paths, "adverse", root, condition=cid)))
    if work["stability"]:
        steps.append((f"{SUITE} --repeat {MIN_RUNS} --stale --stability-only --only {' '.join(work['stability'])}",
                      f"stability runs up to {MIN_RUNS} of " + ", ".join(work["stability"]),
                      estimate(work["stability"], "stability", root, repeat=MIN_RUNS - 1)))
    return steps


def unit_tests_current(root: Path = ROOT) -> bool:
    """Whether the gpu unit tests recorded in latest.json passed on the files that decide them now
    (:func:`nbtools.unit_test_sha256`): then no call needs to run them again."""
    unit = (_load(root / "reports" / "gpu" / "latest.json") or {}).get("unit_tests") or {}
    return (unit.get("failed") == 0 and not unit.get("failures") and (unit.get("passed") or 0) >= 1
            and unit.get("inputs_sha256") == nbtools.unit_test_sha256(root))


def quickest(root: Path = ROOT) -> str:
    """The notebook whose quiet pass the recorded seconds say is quickest (the one the gpu unit tests ride with
    when no notebook's quiet pass is stale)."""
    paths = [p.relative_to(root).as_posix() for p in nbtools.notebook_paths(nbtools.NOTEBOOK_DIRS, root)]
    return min(paths, key=lambda p: (estimate([p], "quiet", root), p))


def make_plan(root: Path = ROOT) -> dict:
    """The plan: {status, calls: [{steps, seconds, covers}], carry}. The first call takes the plumbing's quiet pass
    (every stale notebook of a lesson whose experiment did not change) with the gpu unit tests; lessons whose
    experiment changed follow, whole, packed into calls of at most :data:`CALL_LIMIT_S`."""
    recs = status(root)
    by_lesson: dict = {}
    for r in recs:
        by_lesson.setdefault(r["lesson"], []).append(r)
    works = {k: lesson_work(v) for k, v in by_lesson.items()}
    experiment = [k for k, w in works.items() if w["adverse"] or w["extra"] or w["stability"]
                  or any(r["stability"]["state"] == "renew" for r in by_lesson[k])]
    plumbing = [p for k, w in works.items() if k not in experiment for p in w["quiet"]]
    calls: list[dict] = []
    units = not unit_tests_current(root)  # the first call runs them, unless they passed on these very files
    if units and experiment and not plumbing and not works[experiment[0]]["quiet"]:
        # they run with a quiet pass (gpu_suite has no pass of its own for them): where only experiments are left
        # to renew and the first call's has no quiet pass, it gets the quickest notebook's (stop 57: they were
        # silently left out; where its lesson's quiet pass is stale they ride with that one, stop 64)
        plumbing = [quickest(root)]

    def cost(work, unit_tests):
        return sum(s for _, _, s in _steps(work, root, unit_tests and units, False))

    def merged(a, b):
        return {k: a[k] + b[k] for k in a}
    # the plumbing's quiet pass first (it decides what carries forward), split where it is longer than a call
    todo = list(plumbing)
    while todo:
        chunk: list = []
        while todo and (not chunk or cost(_work(chunk + todo[:1]), not calls) <= CALL_LIMIT_S):
            chunk.append(todo.pop(0))
        calls.append({"work": _work(chunk), "covers": list(chunk)})
    for lesson in experiment:  # first fit: the first call it still fits in, else a new one
        w = works[lesson]
        cur = next((c for k, c in enumerate(calls) if cost(merged(c["work"], w), k == 0) <= CALL_LIMIT_S), None)
        if cur is None:
            cur = {"work": _work(), "covers": []}
            calls.append(cur)
        cur["work"] = merged(cur["work"], w)
        cur["covers"] += [r["path"] for r in by_lesson[lesson]]
    stale_quiet = sorted(r["path"] for r in recs if r["latest"])
    for k, call in enumerate(calls):
        every = len(calls) == 1 and sorted(call["work"]["quiet"]) == stale_quiet and not experiment
        call["steps"] = _steps(call["work"], root, k == 0 and units, every)
        call["seconds"] = sum(s for _, _, s in call["steps"])
    carry = [r["path"] for r in recs if r["stability"]["state"] == "carry"
             or any(a["state"] == "carry" for a in r.get("adverse", {}).values())]
    return {"status": recs, "calls": calls, "carry": carry, "unit_tests_current": not units}


def _join(steps) -> str:
    return " && ".join(cmd for cmd, _, _ in steps)


def _proofs_text(r: dict) -> list[str]:
    """What one notebook's stability and adverse proofs need, in short phrases."""
    parts = []
    proofs = [("stability", r["stability"])] + [(f"({c})", a) for c, a in sorted(r.get("adverse", {}).items())]
    for state, words in (("carry", "carried forward if the quiet pass claims what the runs claimed"),
                         ("renew", "renew")):
        names = [n for n, p in proofs if p["state"] == state]
        if not names:
            continue
        adv = [n for n in names if n.startswith("(")]
        label = ", ".join([n for n in names if not n.startswith("(")] + (["adverse " + "".join(adv)] if adv else []))
        if state == "renew":
            whys = sorted({p["why"] for n, p in proofs if p["state"] == "renew" and p["why"]})
            runs = r["stability"]["runs"]
            words = f"renew ({'; '.join(whys[:2])}" + (f"; {runs} stability runs to add" if runs else "") + ")"
        parts.append(f"{label}: {words}")
    return parts


def plan_lines(root: Path = ROOT) -> list[str]:
    """The text ``--plan`` prints."""
    plan = make_plan(root)
    lines = []
    stale = [r for r in plan["status"] if r["latest"] or r["stability"]["state"] != "holds"
             or any(a["state"] != "holds" for a in r.get("adverse", {}).values())]
    if not stale:
        lines.append("every notebook's quiet pass, stability runs and adverse conditions hold for this tree")
    for r in stale:
        head = r["path"] + ": "
        if r["latest"]:
            head += "quiet pass stale (" + (f"changed: {', '.join(r['changed'])}" if r["changed"] else r["latest"]) + ")"
        else:
            head += "quiet pass holds"
        lines.append("; ".join([head] + _proofs_text(r)))
    total = 0.0
    for k, call in enumerate(plan["calls"], 1):
        minutes = (call["seconds"] + START_S) / 60
        total += minutes
        lines.append(f"call {k}: about {call['seconds'] / 60:.1f} min of commands + {START_S / 60:.1f} min start "
                     f"= {minutes:.1f} device-minutes; renews {len(call['covers'])} notebooks")
        for cmd, what, secs in call["steps"]:
            lines.append(f"  {what}: about {secs:.0f} s")
        lines.append(f"  $ {_join(call['steps'])}")
        if call["seconds"] > CALL_LIMIT_S:
            lines.append(f"  over {CALL_LIMIT_S / 60:.0f} minutes: one lesson's renewal alone is longer; run it "
                         "with --budget and repeat the command")
    if plan["calls"]:
        last = len(plan["calls"])
        lines.append("make test passes after " + ("this call" if last == 1 else
                     f"call {last} only: until then the notebooks of later calls are stale (land the change in "
                     "slices, one lesson's experiment at a time, to land after each call)"))
        lines.append("on the GPU, one call per device command: python3 tools/gpu_suite.py --next-call 545 (inside "
                     "`timeout 565`; it runs call 1's commands, each with --budget of what is left)")
        if last > 1:
            short = min(range(last), key=lambda i: plan["calls"][i]["seconds"])
            lines.append(f"with less device time left than call 1 takes, `--next-call S --call N` runs call N first "
                         f"(each call renews its own notebooks): the shortest is call {short + 1}, about "
                         f"{(plan['calls'][short]['seconds'] + START_S) / 60:.1f} device-minutes")
        if plan["unit_tests_current"]:
            lines.append("the gpu unit tests are left out: they passed on the GPU on these very files "
                         "(latest.json's unit_tests.inputs_sha256, nbtools.unit_test_files)")
        if plan["carry"]:
            lines.append(f"{len(plan['carry'])} notebooks carry their stability and adverse runs forward if the quiet "
                         "pass claims what those runs claimed; where it does not, run --plan again after the call")
    if len(plan["calls"]) > 1:
        warm = (START_S + sum(c["seconds"] for c in plan["calls"]) + WARM_S * (len(plan["calls"]) - 1)) / 60
        lines.append(f"sent back to back, each within 30 s of the last one's reply (its res.tgz unpacked into the "
                     f"checkout the device copies first), the machine stays warm: about {warm:.1f} device-minutes, "
                     "one start")
    if plan["calls"]:
        left = SESSION_MIN - total
        lines.append(f"a session has {SESSION_MIN:.0f} device-minutes: "
                     + (f"{left:.1f} left for starts that fail (each costs about {FAILED_START_S / 60:.1f} min)"
                        if left >= 0 else
                        f"{-left:.1f} more than that: land it over several sessions, in slices that each leave "
                        "`make test` passing, or, where the change cannot be split (one experiment file of several "
                        "lessons), send the calls that fit and keep their evidence commits as a pending series "
                        "(`git format-patch <applied>..HEAD`, pending/README.md) for the next session, before "
                        "anything else changes the renewed notebooks' reports"))
    if not plan["calls"] and not plan["unit_tests_current"]:
        lines.append("the gpu unit tests have not passed on the GPU on these files (nbtools.unit_test_files): the "
                     "next renewal's first call runs them (or `python3 tools/gpu_suite.py --only "
                     f"{quickest(root)}` on the GPU now)")
    lines.append(f"plan: {len(plan['calls'])} call(s), {total:.1f} device-minutes")
    return lines
