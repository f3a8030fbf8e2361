"""The GPU suite's adverse pass (``python3 tools/gpu_suite.py --adverse ...``, whose docstring and CONTRIBUTING.md's
"Running the GPU suite" say what it does): strict nbval of notebooks/ under conditions an H200 imitates
(evidence.ADVERSE_CONDITIONS), each pytest process in its own copy of the course; it writes
reports/gpu/adverse.json and adverse.log, and counts the passes of (a) and (b) as runs in stability.json.
``gpu_suite.main`` parses the arguments and calls :func:`run_adverse`."""
from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import evidence
import nbtools
import plan
import scope
from suite_common import REPORTS, ROOT, build_stability, expected_seconds, fit_budget, load_json, select, utc_now

# ---- --adverse: strict nbval of notebooks/ under conditions an H200 imitates ------------------------------------

#: make test's nbval flags (the Makefile's NBVAL; tests/test_adverse.py checks they stay the same)
NBVAL_FLAGS = ["--nbval", "--nbval-current-env", "--nbval-sanitize-with", "tests/nbval_sanitize.cfg",
               "--nbval-cell-timeout=1800"]
TOGETHER = ("b", "c", "d", "e")  # --adverse-together: these four at once, each in its own process
#: a learner's own checkout: what nbval of notebooks/ reads (and lib/ the kernels import, examples/ the suite lesson 07's gate runs, reports/gpu/ what a
#: section replays); each pytest process runs in its own copy, as each learner has a clone: lessons 02b and 07
#: write profiler traces under build/traces/ and read them back, which processes sharing one tree would mix up
CHECKOUT = ("conftest.py", "pyproject.toml", "lib", "notebooks", "examples", "tools", "tests/nbval_sanitize.cfg", "reports/gpu")
#: the variables a condition sets; cleared from every adverse process's environment before its own are set
IMITATION_VARS = ("PINLAB_RECORD", "PINLAB_VRAM_LIMIT_GIB", "PINLAB_PINNED_LIMIT_GIB", "PINLAB_NO_FLASHINFER",
                  "PINLAB_SIMULATE_NO_GPU_TRACE", "OMP_NUM_THREADS", "PINLAB_SUITE_PASS", "PINLAB_DATA_DIR",
                  "CUDA_LAUNCH_BLOCKING")
PIN_WRAPPER = ("import os, sys; os.sched_setaffinity(0, {int(c) for c in sys.argv[1].split(',')}); "
               "os.execvp(sys.argv[2], sys.argv[2:])")  # taskset where there is none


def adverse_plan(ids, together: bool, everything: bool = False) -> list[list[str]]:
    """Groups of condition ids, run one group after another; a group's conditions run at the same time.
    ``ids``: ``--adverse``'s (empty: every required condition; None: not given; an extra condition such as (f)
    runs only where named); ``together``: ``--adverse-together`` ((b), (c), (d), (e) as one group, after the
    others named); ``everything``: ``--adverse-all-together`` (every required condition in one group: (a)'s
    learners beside the other four)."""
    if everything:
        return [sorted(evidence.ADVERSE_CONDITIONS)]
    if ids is not None and not ids:
        ids = list(evidence.ADVERSE_CONDITIONS)
    ids = [i for i in dict.fromkeys(ids or []) if not (together and i in TOGETHER)]
    return [[i] for i in sorted(ids)] + ([list(TOGETHER)] if together else [])


def split_cores(cores, group) -> dict:
    """The CPU cores each condition of ``group`` is pinned to (None: not pinned). (b) takes the first two of
    ``cores`` (this process's, sorted); with (b) in a group of several, the others share the remaining cores
    in disjoint contiguous blocks (none pinned where fewer cores remain than conditions)."""
    cores = sorted(cores)
    out = dict.fromkeys(group)
    if "b" not in group:
        return out
    out["b"] = cores[:2]
    others, rest = [c for c in group if c != "b"], cores[2:]
    if others and len(rest) >= len(others):
        size, extra = divmod(len(rest), len(others))
        start = 0
        for k, cid in enumerate(others):
            n = size + (1 if k < extra else 0)
            out[cid] = rest[start:start + n]
            start += n
    return out


def adverse_command(cid: str, notebooks, cores=None, taskset: bool = True, python: str = "python3",
                    require_gpu: bool = True) -> tuple[list[str], dict]:
    """(argv, env) of one adverse pytest process, run in a learner's checkout with ``PYTHONPATH=lib``: strict
    nbval of ``notebooks`` with make test's flags and ``--require-gpu``, pinned to ``cores`` (``taskset -c``, or
    a ``python -c`` wrapper calling os.sched_setaffinity), and the condition's variables (``env``; a pinned
    process other than (b) gets ``OMP_NUM_THREADS`` = its cores)."""
    spec = evidence.ALL_CONDITIONS[cid]
    env = dict(spec["env"])
    if cores and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(len(cores))
    argv = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *(["--require-gpu"] if require_gpu else []),
            *NBVAL_FLAGS, *notebooks]
    if cores:
        listed = ",".join(str(c) for c in cores)
        argv = (["taskset", "-c", listed] if taskset else [python, "-c", PIN_WRAPPER, listed]) + argv
    return argv, env


def shell_line(argv, env) -> str:
    """The command as one shell line (variables first, in order), with ``python3`` for this interpreter."""
    words = ["python3" if a == sys.executable else a for a in argv]
    return " ".join([f"{k}={shlex.quote(v)}" for k, v in env.items()] + [shlex.join(words)])


def adverse_factor(group, cid: str) -> float:
    """Estimated slow-down of one nbval pass of ``cid`` in ``group`` against the H200 alone (the --budget estimate;
    the deadline is exact): each other process on the GPU adds a sixth, and 2 cores make a pass at least 1.3x
    slower. Measured with --adverse-all-together (seven processes) on the H200: notebooks 00-02b took 179 s
    against 89 s alone, 07-09 193 s against 100 s, both about 2x (1 + 6/6)."""
    procs = sum(evidence.ALL_CONDITIONS[c]["learners"] for c in group)
    return max(1 + (procs - 1) / 6, 1.3 if cid == "b" else 1.0)


def make_checkout(dest: Path, root: Path = ROOT) -> Path:
    """A learner's own copy of what nbval of notebooks/ needs (:data:`CHECKOUT`), without caches."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".ipynb_checkpoints")
    for rel in CHECKOUT:
        src, dst = root / rel, dest / rel
        if src.is_dir():
            shutil.copytree(src, dst, ignore=ignore)
        elif src.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
    return dest


def _adverse_env(checkout: Path, cond_env: dict, files: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in IMITATION_VARS}
    paths = [str(checkout / "lib")] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                      if p and Path(p).resolve() != (ROOT / "lib").resolve()]
    env.update(PYTHONPATH=os.pathsep.join(paths), PINLAB_NBVAL_CAPTURE=str(files["capture"]),
               PINLAB_PYTEST_LOG=str(files["log"]), **cond_env)
    return env


def _read_lines(path) -> list[str]:
    """The complete lines of a JSONL file another process is appending to (a last, partial line left out)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    return text.splitlines()[:-1] if text and not text.endswith("\n") else text.splitlines()


def run_adverse_group(group, notebooks: list[str], code_cells: dict, args, t_start: float, deadline,
                      tmp: Path, out_log) -> list[dict]:
    """Run one group's pytest processes at once (one per learner of each condition, each in its own checkout),
    printing a line per notebook per process as it ends. Returns one record per process: {cid, learner, cores,
    command, env, results: {path: adverse_notebook_run}, capture: {path: records} of the notebooks it finished,
    left: the notebooks it did not finish (stopped at the deadline), rc, seconds}."""
    cores = split_cores(os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1),
                        group)
    has_taskset = shutil.which("taskset") is not None
    procs = []
    for cid in group:
        for learner in range(1, evidence.ALL_CONDITIONS[cid]["learners"] + 1):
            name = f"{cid}{learner}"
            checkout = make_checkout(tmp / name)
            files = {"capture": tmp / f"{name}.capture.jsonl", "log": tmp / f"{name}.pytest.jsonl",
                     "out": tmp / f"{name}.out"}
            argv, cond_env = adverse_command(cid, notebooks, cores[cid], has_taskset, sys.executable,
                                             require_gpu=not args.cpu_dry_run)
            shown = shell_line(argv, {"PYTHONPATH": "lib", **cond_env})
            who = evidence.condition_title(cid) + (f", learner {learner}" if evidence.ALL_CONDITIONS[cid]["learners"] > 1 else "")
            print(f"  {who}: {shown}" + (f"  (cores {','.join(map(str, cores[cid]))})" if cores[cid] else ""), flush=True)
            out = open(files["out"], "w", encoding="utf-8")
            proc = subprocess.Popen(argv, cwd=checkout, env=_adverse_env(checkout, cond_env, files), stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            procs.append({"cid": cid, "learner": learner, "who": who, "cores": cores[cid], "command": shown,
                          "env": cond_env, "proc": proc, "out": out, "files": files, "t0": time.perf_counter(),
                          "reported": set(), "results": {}, "capture": {}, "killed": False})
    try:
        while True:
            running = [p for p in procs if p["proc"].poll() is None]
            if deadline is not None and running and time.perf_counter() > deadline:
                for p in running:
                    print(f"  {p['who']}: stopped at the --budget deadline", flush=True)
                _stop(running)
                running = []
            for p in procs:
                _report_finished(p, notebooks, code_cells, t_start, ended=p["proc"].poll() is not None)
            if not running:
                break
            time.sleep(1.0)
    except BaseException:  # an interrupt or a bug here: leave no pytest (or kernel) of ours running
        _stop([p for p in procs if p["proc"].poll() is None])
        raise
    for p in procs:
        p["out"].close()
        p["rc"] = p["proc"].returncode
        p["seconds"] = round(time.perf_counter() - p["t0"], 1)
        p["left"] = [nb for nb in notebooks if nb not in p["results"]]
        text = Path(p["files"]["out"]).read_text(encoding="utf-8", errors="replace")
        out_log.write(f"# {utc_now()} {p['who']}\n$ {p['command']}\n{text}\n")
        tail = [ln for ln in text.strip().splitlines() if ln.strip()]
        print(f"  {p['who']}: pytest exited {p['rc']} after {p['seconds']:.0f} s: {tail[-1] if tail else '(no output)'}",
              flush=True)
    return procs


def _stop(procs: list[dict]) -> None:
    """Stop these pytest processes and their kernels (each started in its own session: its process group)."""
    for p in procs:
        p["killed"] = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p["proc"].pid, signal.SIGTERM)
    for p in procs:
        try:
            p["proc"].wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p["proc"].pid, signal.SIGKILL)
            p["proc"].wait()


def _report_finished(p: dict, notebooks, code_cells: dict, t_start: float, ended: bool) -> None:
    """Record and print the notebooks process ``p`` has finished: every code cell captured, or a later notebook
    begun, or the process ended (normally: a notebook it never reached failed to collect or ran no cell;
    stopped at the deadline: what it had not finished is left)."""
    capture = evidence.read_nbval_capture(_read_lines(p["files"]["capture"]))
    collect = {r["nodeid"]: r.get("message", "") for r in evidence.read_pytest_log(_read_lines(p["files"]["log"]))
               if r.get("when") == "collect" and r.get("outcome") == "failed"}
    seen = [k for k, nb in enumerate(notebooks) if capture.get(nb)]
    last_begun = max(seen) if seen else -1
    for k, nb in enumerate(notebooks):
        if nb in p["reported"]:
            continue
        recs = capture.get(nb, [])
        if nb in collect:
            done = True  # pytest could not collect it (it collects every notebook before running the first)
        elif recs and (len({r.get("cell") for r in recs}) >= code_cells[nb] or k < last_begun):
            done = True  # every cell captured, or pytest went on to a later notebook
        else:
            done = ended and not p["killed"]  # pytest ended: what it did not run of this notebook is "not run"
        if not done:
            continue
        p["reported"].add(nb)
        res = evidence.adverse_notebook_run(recs, code_cells[nb], collect.get(nb))
        if not recs and nb not in collect:
            res["failing_cells"].append({"cell": None, "code_cell": None, "outcome": "error", "error": None,
                                         "message": "nbval ran no cell of it (see reports/gpu/adverse.log)"})
        p["results"][nb] = dict(res, utc=utc_now())
        p["capture"][nb] = recs
        ok = evidence.adverse_run_passed(res)
        first = res["failing_cells"][0] if res["failing_cells"] else None
        print(f"  [{time.perf_counter() - t_start:5.0f} s] {p['who']}: {nb} "
              + (f"passed ({res['passed']}/{res['cells']} cells, {res['seconds']:.1f} s)" if ok else
                 f"FAILED ({res['passed']}/{res['cells']} cells passed, {res['failed']} failed, {res['not_run']} not run"
                 + (f"; cell {first['cell']}: {first['message'][:200]}" if first else "") + ")"), flush=True)


def adverse_how(group, cid: str, cores: dict | None = None) -> str:
    """How ``cid`` ran, in words, for adverse.json (``group``: the conditions that ran at the same time,
    ``cores``: split_cores of the group)."""
    if len(group) > 1:
        others = ", ".join(f"({c})" for c in group if c != cid)
        pinned = cores is not None and all(cores.get(c) for c in group)
        procs = sum(evidence.ALL_CONDITIONS[c]["learners"] for c in group)
        flag = "--adverse-all-together" if set(group) == set(evidence.ADVERSE_CONDITIONS) else "--adverse-together"
        return (f"ran alongside {others} ({flag}): one pytest process per learner of each condition, "
                + ("each condition pinned to its own CPU cores" if pinned else
                   "(b) pinned to 2 cores, the others not pinned (too few cores to give each its own)")
                + f", {procs} processes sharing the GPU at once: harder than each condition alone")
    if evidence.ALL_CONDITIONS[cid]["learners"] > 1:
        return (f"{evidence.ALL_CONDITIONS[cid]['learners']} pytest processes at once on the same notebooks, "
                "each in its own checkout, sharing the GPU and the host's cores")
    return "ran alone on the GPU"


def adverse_entries(procs: list[dict], group, notebooks, deps: dict) -> list[dict]:
    """adverse.json's condition entries from one group's processes: per notebook that every learner of the
    condition finished, its source, deps and each learner's run (its counts, failing cells, command, cores,
    what ran alongside it)."""
    out = []
    for cid in group:
        mine = [p for p in procs if p["cid"] == cid]
        spec = evidence.ALL_CONDITIONS[cid]
        others = [evidence.condition_title(c) for c in group if c != cid]
        entries = []
        for nb in notebooks:
            if not mine or not all(nb in p["results"] for p in mine):
                continue
            d = deps.get(nb) or {}
            runs = []
            for p in mine:
                peers = [f"{evidence.condition_title(cid)}, learner {q['learner']}" for q in mine if q is not p]
                runs.append({"learner": p["learner"], **p["results"][nb], "command": p["command"], "env": p["env"],
                             "cores": p["cores"], "ran_alongside": others + peers})
            status = "passed" if all(evidence.adverse_run_passed(r) for r in runs) else "failed"
            entries.append({"path": nb, "status": status, "source_sha256": d.get("source_sha256"),
                            "deps": d.get("deps", []), "deps_sha256": d.get("deps_sha256"),
                            "deps_from": d.get("deps_from"), **d.get("scope", {}),
                            **({"latest_entry": d["latest_entry"]} if d.get("latest_entry") else {}), "runs": runs})
        out.append({"id": cid, "name": spec["name"], "imitates": spec["imitates"], "env": spec["env"],
                    "learners": spec["learners"], "counts_for_stability": spec["stability"],
                    "commands": [p["command"] for p in mine], "cores": [p["cores"] for p in mine],
                    "ran_alongside": others, "how": adverse_how(group, cid, {q["cid"]: q["cores"] for q in procs}),
                    "utc": utc_now(),
                    "seconds": max((p["seconds"] for p in mine), default=0.0), "notebooks": entries})
    return out


def notebook_deps(paths, latest: dict, root: Path = ROOT) -> dict:
    """Per notebook: its source_sha256 now, and the deps recorded in latest.json with their deps_sha256 now;
    ``deps_from`` says whether latest.json's entry holds (else its deps may be out of date)."""
    rows = {e.get("path"): e for e in latest.get("notebooks", [])}
    out = {}
    for p in paths:
        rel = Path(p).relative_to(root).as_posix()
        row = rows.get(rel)
        deps = sorted(row.get("deps") or []) if row else []
        why = evidence.freshness(row, root) if row else f"{rel} is not in reports/gpu/latest.json"
        ok = deps and all((root / d).exists() for d in deps)
        nb = nbtools.load(root / rel)
        out[rel] = {"source_sha256": nbtools.source_sha256(nb), "deps": deps,
                    "deps_sha256": nbtools.deps_sha256(deps, root) if ok else None,
                    "deps_from": "reports/gpu/latest.json", "fresh_latest": why is None,
                    **({"latest_entry": f"does not hold: {why}"} if why else {})}
        if ok and why is None and "claims" in row:  # what the runs prove: scoped to the experiment (scope.py)
            out[rel]["scope"] = scope.scope_fields(rel, deps, row["claims"], "adverse", root, nb)
    return out


def stability_from_adverse(procs: list[dict], deps: dict, meta: dict, root: Path = ROOT) -> tuple[list[dict], list[str]]:
    """stability.json entries of this call from the adverse passes of (a) and (b) (each learner's nbval pass of a
    notebook is one run, evidence.add_nbval_runs), for the notebooks whose latest.json entry holds (their deps
    are known); returns (entries, why the others were not counted)."""
    entries, skipped = {}, []
    for p in procs:
        spec = evidence.ALL_CONDITIONS[p["cid"]]
        if not spec["stability"]:
            continue
        for nb, recs in p["capture"].items():
            d = deps[nb]
            if not d["fresh_latest"]:
                skipped.append(f"{nb}: its latest.json entry {d['latest_entry']}")
                continue
            e = entries.setdefault(nb, {"path": nb, "source_sha256": d["source_sha256"], "deps": d["deps"],
                                        "deps_sha256": d["deps_sha256"], "utc": utc_now(), "gpu": meta["gpu"],
                                        "runs": [],
                                        **({**d["scope"], "deps_files": nbtools.files_map(d["deps"], root)}
                                           if d.get("scope") else {})})
            added, why = evidence.add_nbval_runs([e], {nb: recs}, meta, utc_now(), root)
            skipped += why
            if added:
                e["runs"][-1]["adverse"] = p["who"]
    return list(entries.values()), sorted(set(skipped))


def group_estimate(rels, group) -> float:
    """tools/plan.py's estimate of one group of conditions over ``rels``: an extra condition sent alone (``--adverse
    f``) from that condition's recorded passes (plan.estimate's ``condition``), any other group from the five's. Stop
    65 (an H100): the five's estimate had planned (f) of lessons 04 and 08 at 254 s and 137 s, and they took 61 s
    and 43 s (x0.24, x0.32), where the plan itself had said 82 s and 56 s."""
    if len(group) == 1 and group[0] not in evidence.ADVERSE_CONDITIONS:
        return plan.estimate(rels, "adverse", condition=group[0])
    return plan.estimate(rels, "adverse")


def run_adverse(args, argv, meta: dict, t_start: float) -> int:
    """--adverse / --adverse-together: see the module doc and CONTRIBUTING.md (Running the GPU suite)."""
    paths = select(nbtools.notebook_paths(("notebooks",)), args.only)
    if not paths:
        print(f"gpu_suite: no notebook under notebooks/ has a name containing any of {args.only}")
        return 2
    rels = [p.relative_to(ROOT).as_posix() for p in paths]
    code_cells = {p.relative_to(ROOT).as_posix(): evidence.code_cell_count(nbtools.load(p)) for p in paths}
    latest = load_json(REPORTS / "latest.json") or {}
    deps = notebook_deps(paths, latest)
    for rel, d in deps.items():
        if not d["fresh_latest"]:
            print(f"note: {rel}: its latest.json entry {d['latest_entry']}: its deps may be out of date (run the "
                  "plain suite first, or this notebook's adverse evidence may go stale when it does)", flush=True)
    groups = adverse_plan(args.adverse, args.adverse_together, getattr(args, "adverse_all_together", False))
    out_dir = ROOT / "build" / "gpu-suite" if args.cpu_dry_run else REPORTS
    out_dir.mkdir(parents=True, exist_ok=True)
    command = "python3 tools/gpu_suite.py " + " ".join(argv)
    recorded = {e.get("path"): expected_seconds(e.get("nbval_seconds") or e.get("seconds"), e.get("gpu"), meta.get("gpu"))
                for e in latest.get("notebooks", [])}
    deadline = t_start + args.budget - 5 if args.budget else None
    planned = sum(group_estimate(rels, g) for g in groups)
    print(f"planned: about {planned:.0f} s (tools/plan.py's estimate from the recorded seconds)", flush=True)
    print(f"adverse conditions on {meta['gpu']} (torch {meta['torch']}, FlashInfer {meta['flashinfer']}): "
          + " then ".join("+".join(f"({c})" for c in g) + (" at once" if len(g) > 1 else "") for g in groups)
          + f"; strict nbval of {len(rels)} notebooks", flush=True)
    conditions, all_procs, left = [], [], []
    ran: list[str] = []  # the notebooks that ran, and their estimate: --budget may leave some out
    planned_ran = 0.0
    tmp = Path(tempfile.mkdtemp(prefix="pinlab-adverse-"))
    try:
        with open(out_dir / "adverse.log", "w", encoding="utf-8") as log:
            for gi, group in enumerate(groups):
                todo = rels
                if args.budget:
                    factor = max(adverse_factor(group, c) for c in group)
                    todo, cut = fit_budget(rels, {r: (recorded.get(r) or 30.0) * factor for r in rels},
                                           dict.fromkeys(rels, 0), args.budget, time.perf_counter() - t_start,
                                           nbval=True, default=30.0 * factor, fixed=20.0)
                    for c in group:
                        left += [(c, r) for r in cut]
                    if cut:
                        print(f"--budget {args.budget:.0f} s: {'+'.join(group)} leaves out {', '.join(cut)}", flush=True)
                    if not todo:
                        continue
                print(f"group {gi + 1}/{len(groups)}: {' + '.join(evidence.condition_title(c) for c in group)}"
                      f" ({len(todo)} notebooks)", flush=True)
                ran += [r for r in todo if r not in ran]
                planned_ran += group_estimate(todo, group)
                procs = run_adverse_group(group, todo, code_cells, args, t_start, deadline, tmp / f"g{gi}", log)
                all_procs += procs
                for p in procs:
                    left += [(p["cid"], r) for r in p["left"]]
                conditions += [c for c in adverse_entries(procs, group, todo, deps) if c["notebooks"]]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    left = sorted(set(left))
    old = load_json(out_dir / "adverse.json") or {}
    keep = set(rels) | {p.relative_to(ROOT).as_posix() for p in nbtools.notebook_paths(("notebooks",))}
    report = {**meta, "utc": utc_now(), "command": command,
              "how": "strict nbval of notebooks/ (make test's nbval flags + --require-gpu) under each condition, each "
                     "pytest process in its own copy of the course (a learner's checkout), PINLAB_RECORD unset; "
                     "per notebook its source_sha256 and the deps recorded in latest.json (deps_sha256 over them)",
              "conditions": evidence.merge_adverse(old, conditions, keep)}
    if conditions:
        (out_dir / "adverse.json").write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {(out_dir / 'adverse.json').relative_to(ROOT)} and {(out_dir / 'adverse.log').relative_to(ROOT)}")
    if not args.cpu_dry_run:
        entries, skipped = stability_from_adverse(all_procs, deps, meta)
        for why in skipped:
            print(f"    adverse pass not counted as a stability run: {why}", flush=True)
        if entries:
            keep_all = {p.relative_to(ROOT).as_posix() for p in nbtools.notebook_paths(nbtools.NOTEBOOK_DIRS)}
            stability, _ = build_stability(load_json(REPORTS / "stability.json") or {}, entries, meta, command, keep_all,
                                           latest=latest)
            (REPORTS / "stability.json").write_text(json.dumps(stability, indent=1) + "\n")
            runs = {e["path"]: len(e["runs"]) for e in entries}
            now = {e["path"]: e["n"] for e in stability["notebooks"]}
            print("stability.json: adverse passes of (a)/(b) counted as runs: "
                  + ", ".join(f"{Path(k).stem} +{v} (now {now.get(k)})" for k, v in runs.items()))
    problems = [f"{evidence.condition_title(c['id'])}: {e['path']} learner {r['learner']}: "
                f"{r['passed']}/{r['cells']} cells passed"
                + (f"; cell {r['failing_cells'][0]['cell']}: {r['failing_cells'][0]['message'][:200]}"
                   if r["failing_cells"] else "")
                for c in conditions for e in c["notebooks"] for r in e["runs"] if not evidence.adverse_run_passed(r)]
    print(f"phases (s): total {time.perf_counter() - t_start:.1f}")
    if not args.cpu_dry_run:
        # held against the estimate of what ran (stop 57: --budget left 2 of 3 notebooks out, and the record
        # compared 76 s of one notebook with 203 s planned for three)
        rec = plan.record_renewal(command, "adverse", round(planned_ran, 1), time.perf_counter() - t_start, ran,
                                  utc=utc_now())
        print(f"renewal: planned {rec['planned_s']:.0f} s for the {len(ran)} notebooks that ran, took "
              f"{rec['actual_s']:.0f} s (x{rec['ratio']}): reports/gpu/renewals.json", flush=True)
    for line in problems:
        print(f"FAILED {line}")
    if left:
        by = {}
        for c, r in left:
            by.setdefault(c, []).append(Path(r).stem)
        for c, stems in by.items():
            print(f"NOT RUN (over --budget): {evidence.condition_title(c)}: {', '.join(stems)}: run "
                  f"`python3 tools/gpu_suite.py --adverse {c} --only {' '.join(stems)}`")
    ok = not problems and not left
    print("adverse conditions:", "all passed" if ok else ("FAILURES" if problems else "incomplete (budget)"))
    return 0 if ok else 1
