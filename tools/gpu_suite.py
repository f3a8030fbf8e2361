"""The GPU suite: run on a CUDA machine to produce the course's GPU evidence.

1. executes every notebook in notebooks/ and solutions/ in place, recording each experiment's result under
   reports/gpu/data/ (PINLAB_RECORD=1), so the committed notebooks carry GPU outputs and CPU machines can
   replay them; it records which lib/ files each notebook imported (``deps``);
2. one pytest run: nbval (strict, --require-gpu) on every executed notebook, measuring again, and the unit
   tests marked ``gpu`` (``pytest -m gpu tests``); its log is reports/gpu/nbval.log;
3. writes reports/gpu/latest.json: GPU and versions of this run, ``unit_tests``, and per notebook its status,
   seconds, ``source_sha256``, ``deps``/``deps_sha256`` and UTC time, merged with the entries of notebooks
   this run left out while they hold (their source and deps unchanged: tests/test_evidence.py);
4. adds every execution to reports/gpu/stability.json as a run of that notebook, and its nbval pass as one
   more run (conftest.py captures each nbval cell's outcome and fresh stdout to $PINLAB_NBVAL_CAPTURE; added
   only where nbval ran the executions' source and the deps are unchanged), so a plain call adds 2 runs per
   notebook that reached nbval (runs on the same source and deps accumulate, over calls too): per asserting
   cell how many runs passed it, per [measured]/[timing] line the min / median / max of each number.
   Profiler traces written under build/traces/ go to reports/gpu/traces/.

It uses the Python on PATH with its own torch; pinlab is imported from lib/ (no install needed).
Usage:  python3 tools/gpu_suite.py [--only NAME ...] [--repeat N] [--stale] [--budget S] [--stability-only]
        [--keep-going] [--cell-timeout S] [--no-unit-tests]
  --only NAME ...  only the notebooks whose file name contains a NAME (e.g. --only 03 04); a NAME with a '/'
                   is matched against the path (e.g. --only notebooks/04 leaves solutions/04 out)
  --repeat N       execute each notebook N times (then nbval once, on the last execution: N + 1 runs)
  --stale          only what is missing: without --repeat, the notebooks whose latest.json entry does not hold;
                   with --repeat N, the executions that bring each notebook to N runs in stability.json (the
                   nbval pass counted as one, unless --stability-only; at least one execution)
  --stability-only executions for stability.json only: no nbval, no unit tests; latest.json, the notebooks in
                   place and reports/gpu/data are left alone (run the plain suite for those)
  --budget S       start no notebook whose estimated time (from latest.json) would end the run after S seconds;
                   the rest is printed as left for a later run: with --stale, repeat the same command (with the
                   previous call's results in place) until nothing is left
  --keep-going     development: run every cell even after one fails; reports go to build/gpu-suite/ only
  --cell-timeout S seconds one cell may take before it counts as failed (default 300)
  --no-unit-tests  leave out the gpu unit tests (latest.json keeps the previous unit_tests entry)
Exit status: 0 when every notebook and every gpu unit test passed, 1 otherwise, 2 on a usage error.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import evidence
import nbtools

ROOT = nbtools.ROOT
REPORTS = ROOT / "reports" / "gpu"


def utc_now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="tools/gpu_suite.py", description="the course's GPU suite (see module doc)")
    ap.add_argument("--only", nargs="+", metavar="NAME", help="notebooks whose file name contains a NAME")
    ap.add_argument("--repeat", type=int, default=1, metavar="N", help="executions per notebook (stability.json)")
    ap.add_argument("--keep-going", action="store_true", help="run every cell after a failure; no reports/ written")
    ap.add_argument("--cell-timeout", type=int, default=300, metavar="S")
    ap.add_argument("--no-unit-tests", action="store_true")
    ap.add_argument("--stale", action="store_true",
                    help="only what is missing: notebooks without a fresh latest.json entry; with --repeat N, the runs "
                         "that bring each notebook to N fresh runs in stability.json")
    ap.add_argument("--stability-only", action="store_true",
                    help="runs for stability.json only: no nbval, no unit tests, latest.json and the notebooks untouched")
    ap.add_argument("--budget", type=float, metavar="S",
                    help="start no notebook that would end the run after S seconds (estimated from latest.json)")
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    if args.cell_timeout < 1:
        ap.error("--cell-timeout must be at least 1 second")
    return args


def select(paths, only):
    """The notebooks whose file name contains a NAME, or whose path does when the NAME has a '/'
    (``--only notebooks/04`` leaves out ``solutions/04_the_fix.ipynb``)."""
    if not only:
        return paths
    return [p for p in paths if any((o in Path(p).as_posix()) if "/" in o else (o in p.name) for o in only)]


def runs_needed(entry: dict | None, repeat: int, for_stability: bool, root=ROOT, nbval: bool = False) -> int:
    """--stale: how many executions a notebook needs. For latest.json: 1 unless its entry holds. For
    stability.json: what brings its fresh runs up to ``repeat`` (a failure on fresh sources is a result: rerun
    that notebook with --only); with ``nbval`` (the call has an nbval pass, which adds a run) one execution
    fewer, but at least one."""
    fresh = entry is not None and evidence.freshness(entry, root) is None
    if not for_stability:
        return 0 if fresh else 1
    need = max(0, repeat - (len(entry.get("runs") or []) if fresh else 0))
    return max(1, need - 1) if nbval and need else need


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


def gpu_test_files() -> list[str]:
    """tests/test_*.py files that mark a test ``gpu`` (collecting only those keeps the pytest run short)."""
    marked = re.compile(r"^\s*(@pytest\.mark\.gpu\b|pytestmark\s*=.*\bmark\.gpu\b)", re.M)
    return [p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "tests").glob("test_*.py"))
            if marked.search(p.read_text(encoding="utf-8"))]


def one_line(exc: BaseException) -> str:
    """A failing run in one line: the error's name and value, not nbclient's whole traceback."""
    name = getattr(exc, "ename", None) or type(exc).__name__
    value = getattr(exc, "evalue", None)
    if value is None:
        text = str(exc).strip().splitlines()
        value = text[-1] if text else ""
    return f"{name}: {value}"[:300]


def execute_notebook(p, n: int, args, meta) -> tuple[dict, dict]:
    """Execute one notebook ``n`` times; returns (its latest.json row, its stability entry with this call's runs).

    With --stability-only the notebook in place and the recorded data are left alone (nothing nbval checks)."""
    rel = p.relative_to(ROOT).as_posix()
    allow_errors = args.keep_going or n > 1
    env = {} if args.stability_only else {"PINLAB_RECORD": "1"}
    runs, deps, secs, cell_secs, failed_runs, problem = [], set(), [], {}, 0, ""
    nb = None
    for r in range(1, n + 1):
        res = nbtools.run_notebook(p, timeout=args.cell_timeout, env=env, allow_errors=allow_errors,
                                   record_deps=True, write=False)
        nb = res["nb"]
        secs.append(round(res["seconds"], 1))
        cell_secs = res["cell_seconds"]
        if res["deps"]:
            deps |= set(res["deps"])
        errors = nbtools.cell_errors(nb)
        runs.append({"utc": utc_now(), "gpu": meta["gpu"], "seconds": secs[-1], "via": "execution",
                     **evidence.run_outcome(nb)})
        problem = ""
        if res["error"] is not None or errors:
            cell = errors[0]["cell"] if errors else None
            what = one_line(res["error"]) if res["error"] is not None else f"{errors[0]['ename']}: {errors[0]['evalue']}"
            problem = (f"cell {cell}: " if cell is not None else "") + what[:300]
            failed_runs += 1
            print(f"    run {r}/{n}: FAILED after {res['seconds']:.1f} s, {problem}", flush=True)
            if res["error"] is not None:
                break  # stopped (a failing cell without --keep-going, a dead kernel, a timeout): no more runs
        else:
            print(f"    run {r}/{n}: ok in {res['seconds']:.1f} s" if n > 1 else f"    executed in {res['seconds']:.1f} s",
                  flush=True)
    status = "failed" if problem else "executed"  # the last execution decides; stability.json keeps every run
    if not args.stability_only:
        import nbformat

        nbformat.write(nb, str(p))  # the last execution stays in place (nbval runs on it; its outputs are committed)
    deps_list = sorted(deps)
    now = utc_now()
    src_sha = nbtools.source_sha256(nbtools.load(p))
    row = {
        "path": rel, "status": status, "seconds": secs[-1], "source_sha256": src_sha,
        "deps": deps_list, "deps_sha256": nbtools.deps_sha256(deps_list) if deps_list else None,
        "utc": now, "gpu": meta["gpu"], "torch": meta["torch"],
        "slowest_cells": sorted(([i, s] for i, s in cell_secs.items()), key=lambda t: -t[1])[:3],
        "overhead_seconds": round(secs[-1] - sum(cell_secs.values()), 1),
    }
    if problem:
        row["problem"] = problem
    if n > 1:
        row["failed_runs"] = failed_runs
    if not deps_list:
        row["status"] = "failed"
        row["problem"] = row.get("problem") or "the deps cell did not run: no lib/ files recorded"
    # deps are missing only where a failing cell stopped every run: merge_stability then takes them from the
    # notebook's earlier runs on the same source, if any
    stab = {"path": rel, "source_sha256": src_sha, "deps": deps_list, "deps_sha256": row["deps_sha256"],
            "utc": now, "gpu": meta["gpu"], "runs": runs}
    return row, stab


def pytest_pass(notebooks: list[str], test_files: list[str], args, log_path,
                require_gpu: bool = True) -> tuple[dict, dict | None, float, dict]:
    """One pytest run: nbval on ``notebooks`` and the gpu unit tests in ``test_files`` (``require_gpu=False``
    only to try it out on a CPU). Returns (per notebook results, unit test results, seconds, the nbval
    capture: {path: [cell records]}, evidence.read_nbval_capture)."""
    t0 = time.perf_counter()
    if not notebooks and not test_files:
        return {}, None, 0.0, {}
    fd, jsonl = tempfile.mkstemp(prefix="pinlab-pytest-", suffix=".jsonl")
    os.close(fd)
    fd, capture_path = tempfile.mkstemp(prefix="pinlab-nbval-capture-", suffix=".jsonl")
    os.close(fd)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu or notebook",
           *(["--require-gpu"] if require_gpu else []), "--nbval", "--nbval-current-env", "--nbval-sanitize-with", "tests/nbval_sanitize.cfg",
           f"--nbval-cell-timeout={args.cell_timeout}", *notebooks, *test_files]
    print(f"pytest: nbval on {len(notebooks)} notebooks + gpu unit tests in {len(test_files)} files ...", flush=True)
    env = dict(os.environ, PINLAB_PYTEST_LOG=jsonl, PINLAB_NBVAL_CAPTURE=capture_path)
    try:
        res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
        out = res.stdout + res.stderr
        with open(jsonl, encoding="utf-8") as f:
            records = evidence.read_pytest_log(f)
        with open(capture_path, encoding="utf-8") as f:
            capture = evidence.read_nbval_capture(f)
    finally:
        os.unlink(jsonl)
        os.unlink(capture_path)
    with open(log_path, "w", encoding="utf-8") as log:
        log.write(f"# {utc_now()}\n$ {shlex.join(['python3'] + cmd[1:])}\n{out}\n")
    tail = [ln for ln in out.strip().splitlines() if ln.strip()]
    print(f"    {tail[-1] if tail else '(no output)'}", flush=True)
    nb_res = evidence.notebook_results(records, notebooks)
    unit = None
    if test_files:
        unit = evidence.unit_test_results(records)
        unit.update(command="python3 -m pytest -q -m gpu " + " ".join(test_files), utc=utc_now())
        if unit["passed"] + unit["failed"] == 0:
            unit["failures"].append("no gpu unit test ran (collection error? see reports/gpu/nbval.log)")
    return nb_res, unit, time.perf_counter() - t0, capture


def build_report(old: dict, rows: list[dict], unit: dict | None, meta: dict, command: str, keep, root=ROOT):
    """latest.json after this run: this run's GPU, versions and time at the top; its notebook rows merged with
    the old report's (kept while fresh); ``unit_tests`` of this run, or the old one if this run had none."""
    entries, dropped = evidence.merge_entries(old.get("notebooks", []), rows, keep, root)
    return ({**meta, "utc": utc_now(), "command": command, "lib_sha256": nbtools.lib_sha256(root),
             "unit_tests": unit if unit is not None else old.get("unit_tests"), "notebooks": entries}, dropped)


def build_stability(old: dict, entries: list[dict], meta: dict, command: str, keep, root=ROOT):
    """stability.json after this run: this run's executions added to each notebook's runs on the same sources
    (evidence.merge_stability); GPU, versions and time of this run at the top."""
    merged, dropped = evidence.merge_stability(old.get("notebooks", []), entries, keep, root)
    return {**meta, "utc": utc_now(), "command": command, "notebooks": merged}, dropped


def load_json(path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        print(f"note: {path.relative_to(ROOT)} is unreadable ({exc}): starting it afresh")
        return None


def main(argv: list[str]) -> int:
    t_start = time.perf_counter()
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_suite: torch.cuda.is_available() is False: run this on a CUDA machine.")
        return 2
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "lib"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    sys.path.insert(0, str(ROOT / "lib"))
    from pinlab.device import facts

    all_paths = nbtools.notebook_paths(nbtools.NOTEBOOK_DIRS)
    paths = select(all_paths, args.only)
    if not paths:
        print(f"gpu_suite: no notebook under notebooks/ or solutions/ has a name containing any of {args.only}")
        return 2
    old_latest = load_json(REPORTS / "latest.json") or {}
    old_stab = load_json(REPORTS / "stability.json") or {}
    for_stability = args.repeat > 1 or args.stability_only
    counts = {p.relative_to(ROOT).as_posix(): args.repeat for p in paths}
    if args.stale:
        have = {e.get("path"): e for e in (old_stab if for_stability else old_latest).get("notebooks", [])}
        counts = {rel: runs_needed(have.get(rel), args.repeat, for_stability,
                                   nbval=for_stability and not args.stability_only) for rel in counts}
        counts = {rel: c for rel, c in counts.items() if c}
        paths = [p for p in paths if p.relative_to(ROOT).as_posix() in counts]
        print(f"--stale: {len(paths)} notebooks to run: "
              + (", ".join(f"{rel} x{c}" for rel, c in counts.items()) or "none, everything is fresh"))
        if not paths:
            return 0
    left = []
    if args.budget:
        recorded = {e.get("path"): e.get("seconds") for e in old_latest.get("notebooks", [])}
        rels, left = fit_budget([p.relative_to(ROOT).as_posix() for p in paths], recorded, counts, args.budget,
                                time.perf_counter() - t_start, nbval=not args.stability_only)
        paths = [ROOT / r for r in rels]
        if left:
            print(f"--budget {args.budget:.0f} s: left for a later run: {', '.join(left)}")
        if not paths:
            print("gpu_suite: no notebook fits into the budget")
            return 2
    f = facts()
    meta = {"gpu": f["gpu"], "driver": f["driver"], "capability": f["capability"], "torch": f["torch"],
            "cuda": f["cuda_runtime"], "flashinfer": f["flashinfer"], "python": platform.python_version()}
    command = "python3 tools/gpu_suite.py" + (" " + " ".join(argv) if argv else "")
    out_dir = ROOT / "build" / "gpu-suite" if args.keep_going else REPORTS
    out_dir.mkdir(parents=True, exist_ok=True)
    phases = {"set-up": time.perf_counter() - t_start}
    print(f"GPU suite on {meta['gpu']} (torch {meta['torch']}, FlashInfer {meta['flashinfer']}): {len(paths)} notebooks"
          + (f", up to {max(counts.values())} executions each" if max(counts.values()) > 1 else "")
          + (" (stability runs only)" if args.stability_only else ""), flush=True)

    # 1. execute
    t0 = time.perf_counter()
    rows, stab = [], []
    for i, p in enumerate(paths, 1):
        rel = p.relative_to(ROOT).as_posix()
        print(f"[{i}/{len(paths)}] executing {rel}" + (f" {counts[rel]} times" if counts[rel] > 1 else "") + " ...",
              flush=True)
        try:
            row, s = execute_notebook(p, counts[rel], args, meta)
        except Exception as exc:  # noqa: BLE001 - one broken notebook must not stop the others
            print(f"    FAILED: {one_line(exc)}", flush=True)
            row, s = {"path": rel, "status": "failed", "seconds": None, "problem": one_line(exc), "utc": utc_now(),
                      "source_sha256": nbtools.source_sha256(nbtools.load(p)), "deps": [], "deps_sha256": None}, None
        rows.append(row)
        if s is not None:
            stab.append(s)
    phases["execution"] = time.perf_counter() - t0
    traces = REPORTS / "traces"
    for t in [] if args.stability_only else sorted((ROOT / "build" / "traces").glob("*.json")):
        traces.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(t, traces / t.name)
        print(f"kept {t.relative_to(ROOT)} as {(traces / t.name).relative_to(ROOT)} ({t.stat().st_size // 1024} KiB)")

    # 2. nbval on what executed, and the gpu unit tests, in one pytest run
    executed = [] if args.stability_only else [r["path"] for r in rows if r["status"] == "executed"]
    test_files = [] if args.no_unit_tests or args.stability_only else gpu_test_files()
    nb_res, unit, phases["nbval + unit tests"], capture = pytest_pass(executed, test_files, args,
                                                                      out_dir / "nbval.log")
    # each notebook's nbval pass is one more stability run (where nbval ran the executions' source, deps unchanged)
    _, nbval_skipped = evidence.add_nbval_runs([s for s in stab if s["path"] in executed], capture, meta,
                                               utc_now())
    for why in nbval_skipped:
        print(f"    nbval pass not counted as a stability run: {why}", flush=True)
    for row in rows:
        if row["status"] != "executed" or row["path"] not in nb_res:
            continue
        res = nb_res[row["path"]]
        row["status"] = res["status"]
        row["nbval_seconds"] = res["seconds"]
        if res["failures"]:
            row["problem"] = "nbval: " + res["failures"][0]
        print(f"    nbval {row['path']}: {res['status']} ({res['cells']} cells, {res['seconds']:.1f} s)"
              + (f", {row['problem']}" if res["failures"] else ""), flush=True)
    if unit is not None:
        print(f"    gpu unit tests: {unit['passed']} passed, {unit['failed']} failed, {unit['skipped']} skipped", flush=True)
        for line in unit["failures"]:
            print(f"      {line}")

    # 3. reports
    t0 = time.perf_counter()
    keep = {p.relative_to(ROOT).as_posix() for p in all_paths}
    if not args.stability_only:
        report, dropped = build_report(old_latest, rows, unit, meta, command, keep)
        latest = out_dir / ("keep-going.json" if args.keep_going else "latest.json")
        latest.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {latest.relative_to(ROOT)} ({len(rows)} entries from this run, "
              f"{len(report['notebooks']) - len(rows)} kept)")
        for why in dropped:
            print(f"    dropped a stale entry: {why}")
    if stab:
        stability, s_dropped = build_stability(old_stab, stab, meta, command, keep)
        spath = out_dir / ("keep-going-stability.json" if args.keep_going else "stability.json")
        spath.write_text(json.dumps(stability, indent=1) + "\n")
        print(f"wrote {spath.relative_to(ROOT)} ({len(stab)} notebooks from this run, "
              f"{len(stability['notebooks']) - len(stab)} kept)")
        for why in s_dropped:
            print(f"    dropped a stale stability entry: {why}")
        mine = [e for e in stability["notebooks"] if e["path"] in {s["path"] for s in stab}]
        this_call = {s["path"]: s for s in stab}
        print("runs per notebook in stability.json now (this call's executions + nbval pass in brackets):")
        for e in stability["notebooks"]:
            s = this_call.get(e["path"])
            if s is None:
                print(f"    {e['path']}: {e['n']} (kept)")
                continue
            k = sum(r.get("via") == "nbval" for r in s["runs"])
            print(f"    {e['path']}: {e['n']} (+{len(s['runs']) - k} executions + {k} nbval)")
        missing = sorted(keep - {e["path"] for e in stability["notebooks"]})
        if missing:
            print(f"    stability.json does not cover yet: {', '.join(missing)}")
        print("\n".join(evidence.stability_summary(mine)))
    phases["reports"] = time.perf_counter() - t0
    phases["total"] = time.perf_counter() - t_start

    overhead = sum((r.get("overhead_seconds") or 0) * counts.get(r["path"], 1) for r in rows)
    print("phases (s): " + ", ".join(f"{k} {v:.1f}" for k, v in phases.items())
          + f"; of the execution, kernel start-up and between-cell overhead about {overhead:.1f}")
    slow = sorted((c[1], r["path"], c[0]) for r in rows for c in r.get("slowest_cells", []))[-5:][::-1]
    if slow:
        print("slowest cells: " + "; ".join(f"{p} cell {i} {s:.1f} s" for s, p, i in slow))
    if left:
        print(f"NOT RUN (over --budget): {', '.join(left)}: run the same command again for them")
    failed = [r for r in rows if r["status"] != ("executed" if args.stability_only else "passed")]
    for r in failed:
        print(f"FAILED {r['path']}: {r.get('problem', r['status'])}")
    unit_ok = unit is None or (unit["failed"] == 0 and not unit["failures"])
    ok = not failed and unit_ok
    print("GPU suite:", "all passed" if ok else "FAILURES",
          f"({len(rows) - len(failed)}/{len(rows)} notebooks"
          + (f"; gpu unit tests {unit['passed']} passed, {unit['failed']} failed" if unit is not None else "") + ")")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
