"""The GPU suite: run on a CUDA machine to produce the course's GPU evidence.

0. the plain suite is the **quiet reference pass**: the committed notebook outputs, the recordings under
   reports/gpu/data, reports/gpu/traces and latest.json come from it, each notebook run alone on the GPU. It
   takes the suite's lock on this checkout exclusively (build/gpu-suite/suite.lock; every other pass takes it
   shared, so stability, development and adverse passes may run at once but never beside it) and refuses to
   start (exit status 3, naming the pids) while another suite holds the lock or any other process is on the GPU
   (NVML's process list: nvidia-smi --query-compute-apps, or pynvml; this suite and its children left out), or
   while that list cannot be read. It samples the conditions (other processes on the GPU, the host's load
   average and usable cores) at each notebook's start and end and records them in latest.json
   (``conditions``: ``quiet`` true only where no other process was listed at either); a notebook whose run was
   not quiet keeps nothing (its kernel records into a staging copy of reports/gpu/data, published only after a
   quiet run) and the call fails. Its kernels get PINLAB_SUITE_PASS=quiet-reference (lesson headers print it,
   recordings keep it in ``meta["suite_pass"]``). ``--shared`` (development) runs whatever else is on the GPU
   and, like ``--keep-going``, writes nothing committed: its reports and executed notebooks go to
   build/gpu-suite/ only;
1. executes every notebook in notebooks/ and solutions/ in place, once, recording each experiment's result under
   reports/gpu/data/ (PINLAB_RECORD=1), so the committed notebooks carry GPU outputs and CPU machines can
   replay them; it records which lib/ files each notebook imported (``deps``), their hashes, the notebook's
   experiment files and what it claims (tools/scope.py);
2. one pytest run: the unit tests marked ``gpu`` (``pytest -m gpu tests``), and with ``--nbval`` strict nbval
   (--require-gpu) of every executed notebook, measuring again (a second GPU run: one more stability run); its
   log is reports/gpu/nbval.log;
3. writes reports/gpu/latest.json: GPU and versions of this run, ``unit_tests``, and per notebook its status,
   seconds, ``source_sha256``, ``deps``/``deps_sha256``, its claims and UTC time, merged with the entries of
   notebooks this run left out (tests/test_evidence.py says which no longer hold); per notebook whose stability
   or adverse runs were taken on other deps, ``carried``: whether they carry forward to this tree (the same
   source and experiment files, and this pass claims what they claimed: scope.py);
4. adds every execution to reports/gpu/stability.json as a run of that notebook, and with ``--nbval`` its nbval
   pass as one more run (conftest.py captures each nbval cell's outcome and fresh stdout to
   $PINLAB_NBVAL_CAPTURE), to the notebook's runs that still hold (scope.py): per asserting cell how many runs
   passed it, per [measured]/[timing] line the min / median / max of each number. Profiler traces written under
   build/traces/ go to reports/gpu/traces/;
5. records its planned seconds (tools/plan.py's estimate) and the seconds it took in reports/gpu/renewals.json.

``--plan`` (CPU only, no GPU needed) prints what is stale in this tree and why, the device calls that renew it
(each at most 9 minutes, as gpu_suite commands to paste) and ``plan: N call(s), M device-minutes``.

``--adverse [ID ...]`` instead runs strict nbval of notebooks/ (make test's nbval flags + --require-gpu) under
conditions an H200 imitates (evidence.ADVERSE_CONDITIONS): (a) three learners at once on one GPU, (b) 2 CPU
cores, (c) a 16 GB GPU with a 2 GiB pinned budget, (d) no FlashInfer, (e) a profiler that records no GPU
activity; each pytest process in its own copy of the course (a learner's checkout), PINLAB_RECORD unset. It
writes reports/gpu/adverse.json (per condition and notebook: source, deps from latest.json, each learner's cells
passed / failed / skipped with the failing cells' messages, the command, seconds) and reports/gpu/adverse.log,
and counts the passes of (a) and (b) as nbval runs in stability.json (under (c)-(e) sections replay).
``--adverse-together`` runs (b), (c), (d), (e) at the same time, on disjoint cores; ``--adverse-all-together``
runs all five at once ((a)'s three learners too: seven processes), recorded as such. ``--adverse f`` runs an
extra condition (evidence.EXTRA_CONDITIONS: (f) CUDA_LAUNCH_BLOCKING=1), recorded in adverse.json, required only
of the notebooks its ``required_for`` names (none yet; --plan then schedules ``--adverse f --only`` them).

It uses the Python on PATH with its own torch; pinlab is imported from lib/ (no install needed).
Usage:  python3 tools/gpu_suite.py --plan
        python3 tools/gpu_suite.py --next-call S [--call N]
        python3 tools/gpu_suite.py [--only NAME ...] [--repeat N] [--stale] [--budget S] [--stability-only]
        [--keep-going] [--shared] [--cell-timeout S] [--no-unit-tests] [--nbval]
        python3 tools/gpu_suite.py --adverse [ID ...] [--adverse-together] [--only NAME ...] [--budget S]
        python3 tools/gpu_suite.py --adverse-all-together [--only NAME ...] [--budget S]
  --only NAME ...  only the notebooks whose file name contains a NAME (e.g. --only 03 04); a NAME with a '/'
                   is matched against the path (e.g. --only notebooks/04 leaves solutions/04 out)
  --plan           CPU only: what is stale and why, and the device calls that renew it (tools/plan.py)
  --next-call S    on the GPU: the first of those calls, its commands in order, each with --budget of what is
                   left of S seconds (e.g. 545 inside `timeout 565`); commit what it wrote, and --plan says what is
                   left (exit 4: time ran out before its last command)
  --call N         with --next-call: call N of the plan instead of the first (a shorter, later call when the
                   session has less device time left than call 1 takes: each call's notebooks are its own)
  --repeat N       execute each notebook N times (with --nbval, nbval once more on the last execution)
  --nbval          after the executions, strict nbval of each (a second GPU run, counted as a stability run)
  --stale          only what is missing: without --repeat, the notebooks whose latest.json entry does not hold;
                   with --repeat N, the executions that bring each notebook to N runs in stability.json that
                   still hold (scope.py; with --nbval its pass counted as one; at least one execution)
  --stability-only executions for stability.json only: no nbval, no unit tests; latest.json, the notebooks in
                   place and reports/gpu/data are left alone (run the plain suite for those)
  --budget S       start no notebook whose estimated time (from latest.json) would end the run after S seconds;
                   the rest is printed as left for a later run: with --stale, repeat the same command (with the
                   previous call's results in place) until nothing is left
  --keep-going     development: run every cell even after one fails; reports go to build/gpu-suite/ only
  --shared         development: run although other processes use the GPU; reports and the executed notebooks go
                   to build/gpu-suite/ only (no notebook in place, no recording, no latest.json)
  --cell-timeout S seconds one cell may take before it counts as failed (default 300)
  --no-unit-tests  leave out the gpu unit tests (latest.json keeps the previous unit_tests entry)
  --unit-test-workers N pytest-xdist workers for the gpu unit tests (default 4) where no notebook is in the same
                   pytest run (with --nbval they run serially); 1 runs them one after another
  --adverse [ID ...] strict nbval of notebooks/ under the conditions ID (a-e, and f: CUDA_LAUNCH_BLOCKING=1,
                   required where its required_for says; none named: the five, one after another); with
                   --budget, a condition starts only the notebooks estimated to fit and every process is stopped
                   at the deadline (what it had not finished is named, for --only)
  --adverse-all-together every condition at the same time: (a)'s three learners beside (b), (c), (d), (e), seven
                   processes on the GPU, each condition on its own cores ((b) on cores 0-1)
  --adverse-together (b), (c), (d), (e) at the same time, each its own process ((b) on cores 0-1, the others on
                   disjoint other cores): four learners on the GPU at once; recorded as such in adverse.json
  --cpu-dry-run    development: --adverse on a machine without CUDA (nbval replays; no --require-gpu); writes
                   build/gpu-suite/adverse.json only
Exit status: 0 when every notebook and every gpu unit test passed, 1 otherwise (a notebook whose run was not
quiet included), 2 on a usage error, 3 when it refused to start (another suite or process on the GPU).
"""
from __future__ import annotations

import argparse
import contextlib
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
import plan
import scope

from suite_common import REPORTS, ROOT, build_stability, expected_seconds, fit_budget, load_json, select, utc_now
from adverse import run_adverse


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="tools/gpu_suite.py", description="the course's GPU suite (see module doc)")
    ap.add_argument("--only", nargs="+", metavar="NAME", help="notebooks whose file name contains a NAME")
    ap.add_argument("--repeat", type=int, default=1, metavar="N", help="executions per notebook (stability.json)")
    ap.add_argument("--keep-going", action="store_true", help="run every cell after a failure; no reports/ written")
    ap.add_argument("--shared", action="store_true",
                    help="development: run although other processes use the GPU; nothing committed is written "
                         "(reports under build/gpu-suite/ only)")
    ap.add_argument("--cell-timeout", type=int, default=300, metavar="S")
    ap.add_argument("--no-unit-tests", action="store_true")
    ap.add_argument("--unit-test-workers", type=int, default=UNIT_TEST_WORKERS, metavar="N",
                    help="pytest-xdist workers for the gpu unit tests where no notebook shares their run (1: serial)")
    ap.add_argument("--nbval", action="store_true",
                    help="after the executions, strict nbval of each executed notebook (a second GPU run: one more "
                         "stability run); the quiet pass runs each notebook once without it")
    ap.add_argument("--plan", action="store_true",
                    help="CPU only: what is stale in this tree and the device calls that renew it (tools/plan.py)")
    ap.add_argument("--next-call", type=float, metavar="S",
                    help="run the first device call of --plan, each of its commands with --budget of what is left "
                         "of S seconds (one device call: give the seconds it may take, e.g. 545 under timeout 565)")
    ap.add_argument("--call", type=int, metavar="N",
                    help="with --next-call: run call N of --plan instead of the first (each call renews its own "
                         "notebooks: a shorter, later call fits a session with less device time left)")
    ap.add_argument("--stale", action="store_true",
                    help="only what is missing: notebooks without a fresh latest.json entry; with --repeat N, the runs "
                         "that bring each notebook to N fresh runs in stability.json")
    ap.add_argument("--stability-only", action="store_true",
                    help="runs for stability.json only: no nbval, no unit tests, latest.json and the notebooks untouched")
    ap.add_argument("--budget", type=float, metavar="S",
                    help="start no notebook that would end the run after S seconds (estimated from latest.json)")
    ap.add_argument("--adverse", nargs="*", metavar="ID", type=str.lower,
                    help="strict nbval of notebooks/ under imitated adverse conditions a-e (none named: all), "
                         "writes reports/gpu/adverse.json")
    ap.add_argument("--adverse-together", action="store_true",
                    help="run conditions b, c, d, e at the same time (four processes sharing the GPU)")
    ap.add_argument("--adverse-all-together", action="store_true",
                    help="run all five conditions at the same time: (a)'s three learners beside (b), (c), (d), (e) "
                         "(seven processes sharing the GPU)")
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="development: the adverse mode without --require-gpu on a machine without CUDA "
                         "(nbval replays); writes build/gpu-suite/adverse.json only")
    args = ap.parse_args(argv)
    if args.adverse_all_together:
        if args.adverse_together or args.adverse:
            ap.error("--adverse-all-together runs every condition at once: leave out --adverse-together and the ids")
        args.adverse, args.adverse_together = list(evidence.ADVERSE_CONDITIONS), True
    adverse = args.adverse is not None or args.adverse_together
    if adverse:
        bad = [i for i in args.adverse or [] if i not in evidence.ALL_CONDITIONS]
        if bad:
            ap.error(f"--adverse takes condition ids among {', '.join(evidence.ALL_CONDITIONS)}, got {', '.join(bad)}")
        clash = [o for o, on in (("--repeat", args.repeat != 1), ("--stale", args.stale),
                                 ("--stability-only", args.stability_only), ("--keep-going", args.keep_going),
                                 ("--shared", args.shared)) if on]
        if clash:
            ap.error(f"--adverse runs nbval only: it does not take {', '.join(clash)}")
    elif args.cpu_dry_run:
        ap.error("--cpu-dry-run goes with --adverse or --adverse-together")
    if args.plan and len([a for a in argv if a != "--plan"]):
        ap.error("--plan takes no other option: it plans for the whole tree")
    if args.call is not None and args.next_call is None:
        ap.error("--call N picks which call of the plan --next-call runs: give --next-call S too")
    if args.call is not None and args.call < 1:
        ap.error(f"--call takes a call's number in --plan, 1 or more, got {args.call}")
    if args.next_call is not None:
        if any(a.startswith("-") and a.split("=")[0] not in ("--next-call", "--call") for a in argv):
            ap.error("--next-call takes no other option but --call: it runs the plan's own commands")
        if not NEXT_CALL_MIN_S <= args.next_call <= NEXT_CALL_MAX_S:
            ap.error(f"--next-call takes the seconds the call may run, {NEXT_CALL_MIN_S}-{NEXT_CALL_MAX_S} (a device "
                     f"command runs at most 600 s), got {args.next_call:g}")
    if args.nbval and args.stability_only:
        ap.error("--stability-only runs no nbval: leave out --nbval")
    if args.shared and args.stability_only:
        ap.error("--stability-only may share the GPU already: leave out --shared")
    if args.budget is not None and args.budget <= 0:
        ap.error("--budget must be a positive number of seconds")
    if args.unit_test_workers < 1:
        ap.error(f"--unit-test-workers must be at least 1 (1 runs the gpu unit tests one after another), "
                 f"got {args.unit_test_workers}")
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    if args.cell_timeout < 1:
        ap.error("--cell-timeout must be at least 1 second")
    return args


# ---- the quiet reference pass: it alone on the GPU, or nothing committed is written ------------------------------

#: where a suite's lock, its holders' records and a development pass's reports live (per checkout, ignored by git)
BUILD = ROOT / "build" / "gpu-suite"
#: the pass that writes the committed outputs (notebooks in place, reports/gpu/data, latest.json, traces)
QUIET = "quiet-reference"
REFUSED = 3  # exit status of a suite that refused to start


def suite_pass(args) -> str:
    """Which pass a call is ($PINLAB_SUITE_PASS for its kernels; pinlab.probe.SUITE_PASSES): the plain suite is
    the quiet reference pass; ``--shared`` and ``--keep-going`` are development passes (reports under
    build/gpu-suite/ only); ``--stability-only`` a stability pass; ``--adverse`` "adverse"."""
    if getattr(args, "adverse", None) is not None or getattr(args, "adverse_together", False):
        return "adverse"
    if args.stability_only:
        return "stability"
    return "development" if args.shared or args.keep_going else QUIET


def writes_evidence(args) -> bool:
    """Whether a call writes the committed outputs: the notebooks in place, reports/gpu/data, latest.json and
    reports/gpu/traces (the quiet reference pass only; stability passes write stability.json alone)."""
    return suite_pass(args) == QUIET


class SuiteBusy(RuntimeError):
    """Another suite of this checkout holds the lock in a way that excludes this one (:func:`suite_lock`)."""

    def __init__(self, holders: list[dict], exclusive: bool):
        self.holders, self.exclusive = holders, exclusive
        super().__init__(busy_text(holders, exclusive))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def live_holders(lock_dir: Path | None = None, alive=_alive) -> list[dict]:
    """The suites of this checkout that hold its lock now: their records under ``lock_dir/suite-holders``
    (``{pid, mode, pass, command, utc}``), those of processes gone (a suite that was killed) removed."""
    out = []
    lock_dir = BUILD if lock_dir is None else lock_dir
    for f in sorted((lock_dir / "suite-holders").glob("*.json")):
        try:
            rec = json.loads(f.read_text(encoding="utf-8"))
            pid = int(rec["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if alive(pid):
            out.append(rec)
        else:
            with contextlib.suppress(OSError):
                f.unlink()
    return out


def busy_text(holders: list[dict], exclusive: bool) -> str:
    """Why a suite may not take the lock, naming the suites that hold it (pid, pass, command, since when)."""
    named = "; ".join(f"pid {h.get('pid')} ({h.get('pass', '?')} pass, `{h.get('command', '?')}`, since "
                      f"{h.get('utc', '?')})" for h in holders) or "a suite whose record is gone (it is ending)"
    if exclusive:
        return f"another GPU suite of this checkout is running: {named}"
    return (f"the quiet reference pass of the GPU suite is running on this checkout ({named}): it must have the GPU "
            "to itself; start this one after it ends")


@contextlib.contextmanager
def suite_lock(exclusive: bool, which: str, command: str, lock_dir: Path | None = None):
    """The suite's lock on this checkout (fcntl, ``lock_dir/suite.lock``): exclusive for the quiet reference pass,
    shared for every other pass (stability, development, adverse passes may run at once, on disjoint --only
    sets, but never beside the quiet one). Never waits: raises :class:`SuiteBusy` naming the holders. While held,
    ``lock_dir/suite-holders/<pid>-<n>.json`` says who holds it."""
    import fcntl

    lock_dir = BUILD if lock_dir is None else lock_dir
    lock_dir.mkdir(parents=True, exist_ok=True)
    f = open(lock_dir / "suite.lock", "a")
    try:
        fcntl.flock(f, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise SuiteBusy(live_holders(lock_dir), exclusive) from None
    holders = lock_dir / "suite-holders"
    holders.mkdir(exist_ok=True)
    me = holders / f"{os.getpid()}-{next(_HOLDER_IDS)}.json"
    try:
        me.write_text(json.dumps({"pid": os.getpid(), "mode": "exclusive" if exclusive else "shared", "pass": which,
                                  "command": command, "utc": utc_now()}) + "\n", encoding="utf-8")
        yield
    finally:
        with contextlib.suppress(OSError):
            me.unlink()
        fcntl.flock(f, fcntl.LOCK_UN)
        f.close()


_HOLDER_IDS = iter(range(1, 10**9))


def process_table(proc: Path = Path("/proc")) -> dict[int, int]:
    """{pid: parent pid} of every process visible in ``proc`` (empty where there is no /proc)."""
    out = {}
    for d in proc.glob("[0-9]*"):
        try:
            stat = (d / "stat").read_text(encoding="ascii", errors="replace")
            out[int(d.name)] = int(stat[stat.rindex(")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return out


def descendants(table: dict[int, int], root: int) -> set[int]:
    """``root`` and every process below it in ``table`` ({pid: parent pid}: :func:`process_table`)."""
    children: dict[int, list[int]] = {}
    for pid, ppid in table.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in out:
            out.add(pid)
            todo += children.get(pid, [])
    return out


def own_pids(table=None) -> set[int]:
    """This suite and the processes it started (its kernels, its pytest and theirs): not "other" processes."""
    return descendants(process_table() if table is None else table, os.getpid())


def sample_conditions(uuid=None, query=None, table=None) -> dict:
    """:func:`pinlab.probe.run_conditions` as the suite sees them: every process on the GPU but this suite and its
    children counts as another."""
    from pinlab.probe import run_conditions

    return run_conditions(mine=own_pids(table), uuid=uuid, query=query)


def sample_end(uuid=None, query=None, table=None, retries: int = 3, wait_s: float = 1.0, sleep=None) -> dict:
    """The conditions at a notebook's end, after its kernel has stopped: where another process is listed, sampled
    again up to ``retries`` times ``wait_s`` apart (a kernel that has just exited can stay listed a moment; a
    process that uses the GPU stays)."""
    sleep = time.sleep if sleep is None else sleep
    c = sample_conditions(uuid, query, table)
    for _ in range(retries):
        if c["other_gpu_processes"] == []:
            break
        sleep(wait_s)
        c = sample_conditions(uuid, query, table)
    return c


def procs_text(procs) -> str:
    if procs is None:
        return "nvidia-smi (or pynvml) could not list the GPU's processes, so nothing shows that it is unshared"
    return ", ".join(f"pid {p['pid']}" + (f" ({p['used_mib']} MiB)" if p.get("used_mib") is not None else "")
                     for p in procs)


def refusal(others, holders=()) -> str | None:
    """Why the quiet reference pass may not start (None: it may): other suites of this checkout hold the lock
    (``holders``: :func:`live_holders`), other processes use the GPU (``others``: their
    :func:`pinlab.probe.compute_apps` rows, this suite left out), or the GPU's processes cannot be listed
    (``others`` None)."""
    reasons = []
    if holders:
        reasons.append(busy_text(list(holders), True))
    if others is None:
        reasons.append(procs_text(None))
    elif others:
        reasons.append(f"{len(others)} other process{'es' if len(others) > 1 else ''} use{'' if len(others) > 1 else 's'}"
                       f" the GPU: {procs_text(others)}")
    if not reasons:
        return None
    return ("gpu_suite: refused. The plain suite is the quiet reference pass: it writes the committed notebook "
            "outputs, reports/gpu/data and reports/gpu/latest.json, and runs only alone on the GPU. Now "
            + "; and ".join(reasons) + ". Wait until they end; or run a development pass with --shared (its reports "
            "go to build/gpu-suite/ only), or stability runs with --stability-only (they may share the GPU).")


def notebook_conditions(which: str, gpu, start: dict, end: dict) -> dict:
    """latest.json's ``conditions`` of one notebook: the pass, the GPU, the conditions at its start and end
    (:func:`sample_conditions`), and ``quiet``: the quiet reference pass, and no other process listed on the GPU
    at either (with the lock held, no other suite of this checkout ran); ``why_not_quiet`` says why not."""
    why = []
    if which != QUIET:
        why.append(f"a {which} pass, not the quiet reference")
    for when, c in (("start", start), ("end", end)):
        procs = c.get("other_gpu_processes")
        if procs is None:
            why.append(f"at its {when} the GPU's processes could not be listed")
        elif procs:
            why.append(f"at its {when} {procs_text(procs)} used the GPU")
    return {"pass": which, "quiet": not why, "why_not_quiet": "; ".join(why) or None, "gpu": gpu,
            "start": start, "end": end}


def staging_dir() -> Path:
    return BUILD / f"staging-{os.getpid()}"


def prepare_staging(staging: Path, reports: Path | None = None) -> Path:
    """A copy of reports/gpu's recordings (and latest.json, which lesson 00's doctor reads beside them) that a
    quiet pass's kernel records into ($PINLAB_DATA_DIR): nothing reaches reports/gpu/data before the notebook's
    run is known to have been quiet (:func:`publish_staging`). Returns the data folder."""
    reports = REPORTS if reports is None else reports
    shutil.rmtree(staging, ignore_errors=True)
    data = staging / "data"
    if (reports / "data").is_dir():
        shutil.copytree(reports / "data", data)
    else:
        data.mkdir(parents=True)
    if (reports / "latest.json").exists():
        shutil.copyfile(reports / "latest.json", staging / "latest.json")
    return data


def publish_staging(staging: Path, reports: Path | None = None) -> list[str]:
    """Copy the recordings a quiet run wrote (new or changed files of ``staging/data``) into reports/gpu/data;
    returns their names."""
    reports = REPORTS if reports is None else reports
    out = []
    for f in sorted((staging / "data").glob("*.json")):
        dest = reports / "data" / f.name
        if not dest.exists() or dest.read_bytes() != f.read_bytes():
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, dest)
            out.append(f.name)
    return out


def new_traces(since: float, traces: Path | None = None) -> list[Path]:
    """Profiler traces (build/traces/*.json) written since ``since`` (time.time()): the notebook's own."""
    traces = ROOT / "build" / "traces" if traces is None else traces
    return sorted(t for t in traces.glob("*.json") if t.stat().st_mtime >= since)


def suite_facts() -> dict:
    """pinlab.device.facts() (and the GPU's UUID), read in a child process: this process never holds a CUDA
    context, so that it is not itself a process on the GPU when the suite looks for others (and in a container
    whose pids NVML does not report as its own, none of its processes is listed while no kernel runs)."""
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); from pinlab.device import facts, _gpu_uuid; "
            "f = facts(); f['uuid'] = _gpu_uuid() if f['cuda_available'] else None; print(json.dumps(f))")
    res = subprocess.run([sys.executable, "-c", code, str(ROOT / "lib")], capture_output=True, text=True,
                         timeout=600, env={k: v for k, v in os.environ.items() if k != "PINLAB_SUITE_PASS"})
    if res.returncode != 0:
        raise RuntimeError(f"reading the machine's facts failed: {(res.stderr or res.stdout).strip()[-800:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def meta_of(f: dict) -> dict:
    return {"gpu": f["gpu"], "driver": f["driver"], "capability": f["capability"], "torch": f["torch"],
            "cuda": f["cuda_runtime"], "flashinfer": f["flashinfer"], "python": platform.python_version()}


def runs_needed(entry: dict | None, repeat: int, for_stability: bool, root=ROOT, nbval: bool = False,
                stale=None) -> int:
    """--stale: how many executions a notebook needs. For latest.json: 1 unless its entry holds. For
    stability.json: what brings the runs that hold (``stale``: scope.stale_check; evidence.freshness unless given)
    up to ``repeat`` (a failure on fresh sources is a result: rerun that notebook with --only); with ``nbval``
    (the call has an nbval pass, which adds a run) one execution fewer, but at least one."""
    why = None if entry is None else (evidence.freshness(entry, root) if stale is None or not for_stability
                                      else stale(entry))
    fresh = entry is not None and why is None
    if not for_stability:
        return 0 if fresh else 1
    need = max(0, repeat - (len(entry.get("runs") or []) if fresh else 0))
    return max(1, need - 1) if nbval and need else need


def gpu_test_files() -> list[str]:
    """tests/test_*.py files that mark a test ``gpu`` (:func:`nbtools.gpu_test_files`)."""
    return nbtools.gpu_test_files(ROOT)


def one_line(exc: BaseException) -> str:
    """A failing run in one line: the error's name and value, not nbclient's whole traceback."""
    name = getattr(exc, "ename", None) or type(exc).__name__
    value = getattr(exc, "evalue", None)
    if value is None:
        text = str(exc).strip().splitlines()
        value = text[-1] if text else ""
    return f"{name}: {value}"[:300]


def executed_copy(rel: str) -> Path:
    """Where a pass that writes no committed output keeps a notebook's executed form (build/gpu-suite/executed/)."""
    return BUILD / "executed" / rel


def execute_notebook(p, n: int, args, meta, query=None) -> tuple[dict, dict]:
    """Execute one notebook ``n`` times; returns (its latest.json row, its stability entry with this call's runs).

    The conditions (other processes on the GPU, the host's load, usable cores) are sampled before and after each
    execution; the row's ``conditions`` are those of the last one (:func:`notebook_conditions`). In the quiet
    reference pass the kernel records into a staging copy of reports/gpu/data, and the last execution's notebook
    (in place), recordings and profiler traces are kept only where its run was quiet; otherwise the row's status
    is "not quiet" and nothing committed changes. Other passes record nothing: --stability-only keeps no
    notebook, a development pass (--shared, --keep-going) keeps it under build/gpu-suite/executed/."""
    rel = p.relative_to(ROOT).as_posix()
    which = suite_pass(args)
    allow_errors = args.keep_going or n > 1
    staging = staging_dir()
    # PYTEST_ADDOPTS (set for the unit tests' pytest, e.g. --durations) must not reach a pytest a notebook starts
    # (lesson 07's gate): on 2026-12-05 it put a durations table into lesson 07's recorded output
    env = {"PINLAB_SUITE_PASS": which, "PYTEST_ADDOPTS": None}
    if which == QUIET:
        env.update(PINLAB_RECORD="1", PINLAB_DATA_DIR=str(staging / "data"))
    runs, deps, secs, cell_secs, failed_runs, problem = [], set(), [], {}, 0, ""
    nb, start, end, t_wall = None, None, None, time.time()
    for r in range(1, n + 1):
        if which == QUIET:
            prepare_staging(staging)
        t_wall = time.time()
        start = sample_conditions(meta.get("uuid"), query)
        res = nbtools.run_notebook(p, timeout=args.cell_timeout, env=env, allow_errors=allow_errors,
                                   record_deps=True, write=False)
        end = sample_end(meta.get("uuid"), query)
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
    conditions = notebook_conditions(which, meta["gpu"], start, end)
    import nbformat

    if which == QUIET and conditions["quiet"]:
        nbformat.write(nb, str(p))  # the last execution stays in place (nbval runs on it; its outputs are committed)
        kept = publish_staging(staging)
        for t in new_traces(t_wall):
            (REPORTS / "traces").mkdir(parents=True, exist_ok=True)
            shutil.copyfile(t, REPORTS / "traces" / t.name)
            kept.append(f"traces/{t.name}")
        print(f"    quiet (no other process on the GPU at its start or end): kept the notebook in place and "
              f"{len(kept)} files under reports/gpu/", flush=True)
    elif which != "stability":
        copy = executed_copy(rel)
        copy.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, str(copy))
        if which == QUIET:
            print(f"    NOT QUIET ({conditions['why_not_quiet']}): its outputs, recordings and traces were not "
                  f"kept (the executed notebook is {copy.relative_to(ROOT)})", flush=True)
    if which == QUIET:
        shutil.rmtree(staging, ignore_errors=True)
    deps_list = sorted(deps | set(evidence.subprocess_inputs(rel))) if deps else []
    now = utc_now()
    src_sha = nbtools.source_sha256(nbtools.load(p))
    row = {
        "path": rel, "status": status, "seconds": secs[-1], "source_sha256": src_sha,
        "deps": deps_list, "deps_sha256": nbtools.deps_sha256(deps_list) if deps_list else None,
        "utc": now, "gpu": meta["gpu"], "torch": meta["torch"],
        "slowest_cells": sorted(([i, s] for i, s in cell_secs.items()), key=lambda t: -t[1])[:3],
        "overhead_seconds": round(secs[-1] - sum(cell_secs.values()), 1),
        "conditions": conditions,
    }
    if problem:
        row["problem"] = problem
    if n > 1:
        row["failed_runs"] = failed_runs
    if not deps_list:
        row["status"] = "failed"
        row["problem"] = row.get("problem") or "the deps cell did not run: no lib/ files recorded"
    if which == QUIET and not conditions["quiet"]:
        row["status"] = "not quiet"
        row["problem"] = f"not quiet: {conditions['why_not_quiet']}; nothing of it was kept: run it again alone"
    # deps are missing only where a failing cell stopped every run: merge_stability then takes them from the
    # notebook's earlier runs on the same source, if any
    stab = {"path": rel, "source_sha256": src_sha, "deps": deps_list, "deps_sha256": row["deps_sha256"],
            "utc": now, "gpu": meta["gpu"], "runs": runs}
    if deps_list:  # what the runs prove, and the claims they go with (scope.py); latest.json keeps the claims
        claims = evidence.claims_of(nb)
        row.update(scope.scope_fields(rel, deps_list, claims, "latest"))
        stab.update(scope.scope_fields(rel, deps_list, claims, "stability"))
    return row, stab


#: pytest-xdist workers for the gpu unit tests when no notebook shares their pytest run (the image of the GPU hosts
#: has pytest-xdist, KINDS.md): they ran one after another in 110-117 s (stop 57/58, H100), which with the quiet pass
#: of all 20 notebooks (459 s) made a core change's renewal two calls (issue 44 asks one of at most 9 minutes). The
#: unit tests assert only what holds on a shared GPU, so running them side by side is itself such a GPU; a notebook
#: in the same run (--nbval) keeps the run serial, since nbval's notebooks must each be alone on the GPU.
UNIT_TEST_WORKERS = 4


def unit_test_workers(notebooks, test_files, asked: int = UNIT_TEST_WORKERS) -> int:
    """How many pytest workers run the gpu unit tests: ``asked`` (at most one per test file) when no notebook is in
    the same pytest run, else 1; 1 where pytest-xdist is not installed."""
    if asked < 1:
        raise ValueError(f"--unit-test-workers must be at least 1, got {asked}")
    if notebooks or not test_files or asked == 1:
        return 1
    import importlib.util

    if importlib.util.find_spec("xdist") is None:
        print("    pytest-xdist is not installed: the gpu unit tests run one after another", flush=True)
        return 1
    return min(asked, len(test_files))


def pytest_pass(notebooks: list[str], test_files: list[str], args, log_path,
                require_gpu: bool = True, which: str = QUIET) -> tuple[dict, dict | None, float, dict]:
    """One pytest run: nbval on ``notebooks`` and the gpu unit tests in ``test_files`` (``require_gpu=False``
    only to try it out on a CPU; ``which``: the pass, $PINLAB_SUITE_PASS of its kernels, which record nothing).
    Returns (per notebook results, unit test results, seconds, the nbval capture: {path: [cell records]},
    evidence.read_nbval_capture)."""
    t0 = time.perf_counter()
    if not notebooks and not test_files:
        return {}, None, 0.0, {}
    fd, jsonl = tempfile.mkstemp(prefix="pinlab-pytest-", suffix=".jsonl")
    os.close(fd)
    fd, capture_path = tempfile.mkstemp(prefix="pinlab-nbval-capture-", suffix=".jsonl")
    os.close(fd)
    workers = unit_test_workers(notebooks, test_files, getattr(args, "unit_test_workers", UNIT_TEST_WORKERS))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu or notebook",
           *(["--require-gpu"] if require_gpu else []), "--nbval", "--nbval-current-env", "--nbval-sanitize-with", "tests/nbval_sanitize.cfg",
           f"--nbval-cell-timeout={args.cell_timeout}", *(["-n", str(workers), "--dist", "loadfile"] if workers > 1 else []),
           *(["--durations=12"] if test_files else []), *notebooks, *test_files]
    print(f"pytest: nbval on {len(notebooks)} notebooks + gpu unit tests in {len(test_files)} files"
          + (f" ({workers} pytest workers, a file per worker)" if workers > 1 else "") + " ...", flush=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PINLAB_RECORD", "PINLAB_DATA_DIR")}
    env.update(PINLAB_PYTEST_LOG=jsonl, PINLAB_NBVAL_CAPTURE=capture_path, PINLAB_SUITE_PASS=which)
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
    # one block per pass, merged under a lock (suites on disjoint --only sets may write it at once): the blocks
    # of earlier passes stay while they hold a notebook or the unit tests that no later pass ran again
    block = f"# {utc_now()}\n$ {shlex.join(['python3'] + cmd[1:])}\n{out}\n"
    with stability_lock(log_path):
        old = log_path.read_text(encoding="utf-8") if getattr(args, "only", None) and log_path.exists() else ""
        log_path.write_text(merge_log(old, block), encoding="utf-8")
    tail = [ln for ln in out.strip().splitlines() if ln.strip()]
    print(f"    {tail[-1] if tail else '(no output)'}", flush=True)
    nb_res = evidence.notebook_results(records, notebooks)
    unit = None
    if test_files:
        unit = evidence.unit_test_results(records)
        unit.update(command="python3 -m pytest -q -m gpu " + (f"-n {workers} --dist loadfile " if workers > 1 else "")
                    + " ".join(test_files), utc=utc_now(), workers=workers)
        if unit["passed"] + unit["failed"] == 0:
            unit["failures"].append("no gpu unit test ran (collection error? see reports/gpu/nbval.log)")
    return nb_res, unit, time.perf_counter() - t0, capture


_LOG_BLOCK = re.compile(r"^# \S+\n\$ ", re.M)


def _log_items(block: str) -> set[str]:
    """What one nbval.log block ran: its notebooks, and "gpu unit tests" where it ran test files."""
    words = block.split("\n", 2)[1].split() if block.count("\n") >= 1 else []
    items = {w for w in words if w.endswith(".ipynb")}
    if any(w.startswith("tests/") and w.endswith(".py") for w in words):
        items.add("gpu unit tests")
    return items


def merge_log(old: str, block: str) -> str:
    """nbval.log after a pass: ``block`` appended to ``old``'s blocks, leaving out every earlier block whose
    notebooks (and unit tests) a later block ran again."""
    starts = [m.start() for m in _LOG_BLOCK.finditer(old)]
    blocks = [old[a:b] for a, b in zip(starts, starts[1:] + [len(old)])] + [block]
    kept, covered = [], set()
    for b in reversed(blocks):
        items = _log_items(b)
        if b is block or not items <= covered:
            kept.append(b)
        covered |= items
    return "".join(reversed(kept))


def record_carried(rows: list[dict], old_latest: dict, root=ROOT) -> list[str]:
    """For each notebook of this quiet pass, record in its row (``carried``, scope.carried_record) whether its
    stability and adverse runs carry forward to this tree: its claims against those the runs were taken with.
    Returns one line per notebook whose runs were taken on other deps (what the call prints)."""
    stab = load_json(REPORTS / "stability.json") or {}
    adverse = load_json(REPORTS / "adverse.json") or {}
    previous = scope.latest_rows(old_latest)
    lines = []
    for row in rows:
        if "claims_sha256" not in row:
            continue
        rel = row["path"]
        entries = scope.carried_entries(rel, stab, adverse, root)
        if not entries:
            continue  # every run was taken on these very deps (or there are none): nothing to carry
        rec = scope.carried_record(entries, previous.get(rel), row, root)
        row["carried"] = rec
        held = sorted(k for k, v in rec["proofs"].items() if v["holds"])
        lost = sorted(k for k, v in rec["proofs"].items() if not v["holds"])
        lines.append(f"{rel}: " + (f"carried forward: {', '.join(held)}" if held else "")
                     + ("; " if held and lost else "") + (f"to renew: {', '.join(lost)}" if lost else "")
                     + (f" (claims differ: {'; '.join(rec['differences'])})" if rec["differences"] else ""))
    return lines


def build_report(old: dict, rows: list[dict], unit: dict | None, meta: dict, command: str, keep, root=ROOT):
    """latest.json after this run: this run's GPU, versions and time at the top; its notebook rows merged with
    the old report's (kept, stale or not: tests/test_evidence.py names the stale ones, and --plan reads which of
    their files changed and what they claimed); ``unit_tests`` of this run, or the old one if this run had none."""
    entries, dropped = evidence.merge_entries(old.get("notebooks", []), rows, keep, root, stale=lambda e: None)
    return ({**meta, "utc": utc_now(), "command": command, "lib_sha256": nbtools.lib_sha256(root),
             "unit_tests": unit if unit is not None else old.get("unit_tests"), "notebooks": entries}, dropped)


@contextlib.contextmanager
def stability_lock(path: Path):
    """An exclusive lock (fcntl) beside ``path`` for its read-merge-write."""
    import fcntl

    with open(path.with_name("." + path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


#: --next-call's bounds: a device command runs at most 600 s, and a step needs a minute to do anything
NEXT_CALL_MIN_S, NEXT_CALL_MAX_S = 60, 600
#: a step of the call starts only with at least this many seconds left (its --budget then fits a notebook or two)
NEXT_STEP_MIN_S = 45
#: exit status of --next-call when time ran out before its last command (what is done is kept; run it again)
UNFINISHED = 4


def run_next_call(seconds: float, root: Path = ROOT, run=subprocess.run, clock=time.monotonic,
                  number: int = 1) -> int:
    """Call ``number`` (the first by default) of the plan (tools/plan.py) on this machine: its commands in order,
    each given ``--budget`` of what is left of ``seconds``, so that the whole call ends inside one device command.
    Stops at the first command that fails (its exit status). A step with under :data:`NEXT_STEP_MIN_S` left is not
    started (:data:`UNFINISHED`). After it, commit what it wrote; ``--plan`` then names the calls left (a call done
    drops out). A later call runs as well first: each call renews its own notebooks (``--only``)."""
    start = clock()
    calls = plan.make_plan(root)["calls"]
    if not calls:
        print("gpu_suite --next-call: nothing to renew (plan: 0 call(s))", flush=True)
        return 0
    if number > len(calls):
        print(f"gpu_suite --next-call: --call {number}, but the plan has {len(calls)} call(s): run --plan",
              flush=True)
        return 2
    call = calls[number - 1]
    print(f"gpu_suite --next-call: call {number} of {len(calls)}, planned {call['seconds']:.0f} s of commands, "
          f"given {seconds:.0f} s", flush=True)
    for k, (cmd, what, _secs) in enumerate(call["steps"]):
        left = seconds - (clock() - start)
        if left < NEXT_STEP_MIN_S:
            rest = "; ".join(w for _, w, _ in call["steps"][k:])
            print(f"gpu_suite --next-call: {left:.0f} s left, not started: {rest}. Commit what is done; --plan "
                  "names what is left", flush=True)
            return UNFINISHED
        words = shlex.split(cmd)
        argv = [sys.executable, *words[1:], "--budget", f"{int(left)}"]
        print(f"$ python3 {' '.join(argv[1:])}   # {what}", flush=True)
        rc = run(argv, cwd=root).returncode
        if rc:
            print(f"gpu_suite --next-call: stopped, exit status {rc} from: {cmd}", flush=True)
            return rc
    print(f"gpu_suite --next-call: done in {clock() - start:.0f} s; commit reports/gpu, notebooks/ and solutions/, "
          "then --plan names the next call", flush=True)
    return 0


def main(argv: list[str]) -> int:
    t_start = time.perf_counter()
    args = parse_args(argv)
    if args.plan:
        print("\n".join(plan.plan_lines()))
        return 0
    if args.next_call is not None:
        return run_next_call(args.next_call, number=args.call or 1)
    import torch

    if not torch.cuda.is_available() and not args.cpu_dry_run:
        print("gpu_suite: torch.cuda.is_available() is False: run this on a CUDA machine.")
        return 2
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "lib"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    sys.path.insert(0, str(ROOT / "lib"))
    which = suite_pass(args)
    command = "python3 tools/gpu_suite.py" + (" " + " ".join(argv) if argv else "")
    try:
        with suite_lock(which == QUIET, which, command):
            f = suite_facts()
            meta = {**meta_of(f), "uuid": f.get("uuid")}
            if which == QUIET:
                # sampled like a notebook's end: the facts' child process, just gone, may stay listed a moment
                why = refusal(sample_end(meta["uuid"])["other_gpu_processes"])
                if why:
                    print(why, flush=True)
                    return REFUSED
            if which == "adverse":
                return run_adverse(args, argv, meta_of(f), t_start)
            return run_suite(args, argv, meta, command, t_start)
    except SuiteBusy as exc:
        print(refusal([], exc.holders) if exc.exclusive else f"gpu_suite: refused: {exc}.", flush=True)
        return REFUSED


def run_suite(args, argv, meta: dict, command: str, t_start: float) -> int:
    """The suite without --adverse, once the lock is held (and, for the quiet reference pass, the GPU found
    unshared); ``meta``: the GPU and versions (and ``uuid``, the GPU's, which the conditions look at)."""
    which = suite_pass(args)
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
        holds = scope.stale_check(old_latest)
        counts = {rel: runs_needed(have.get(rel), args.repeat, for_stability, nbval=args.nbval, stale=holds)
                  for rel in counts}
        if not for_stability:  # a quiet pass that holds but must record its runs' carried comparison
            unrecorded = scope.uncarried(old_latest, old_stab, load_json(REPORTS / "adverse.json"))
            counts = {rel: c or int(rel in unrecorded) for rel, c in counts.items()}
        counts = {rel: c for rel, c in counts.items() if c}
        paths = [p for p in paths if p.relative_to(ROOT).as_posix() in counts]
        print(f"--stale: {len(paths)} notebooks to run: "
              + (", ".join(f"{rel} x{c}" for rel, c in counts.items()) or "none, everything is fresh"))
        if not paths:
            return 0
    left = []
    if args.budget:
        recorded = {e.get("path"): expected_seconds(e.get("seconds"), e.get("gpu"), meta.get("gpu"))
                    for e in old_latest.get("notebooks", [])}
        # the pytest start and, where they run, the gpu unit tests (their recorded seconds on this GPU)
        unit = (old_latest.get("unit_tests") or {}) if not (args.no_unit_tests or args.stability_only) else {}
        fixed = 20.0 + (expected_seconds(unit.get("seconds"), old_latest.get("gpu"), meta.get("gpu")) or 0.0)
        rels, left = fit_budget([p.relative_to(ROOT).as_posix() for p in paths], recorded, counts, args.budget,
                                time.perf_counter() - t_start, nbval=args.nbval, fixed=max(fixed, 30.0))
        paths = [ROOT / r for r in rels]
        if left:
            print(f"--budget {args.budget:.0f} s: left for a later run: {', '.join(left)}")
        if not paths:
            print("gpu_suite: no notebook fits into the budget")
            return 2
    uuid = meta.get("uuid")
    meta = {k: v for k, v in meta.items() if k != "uuid"}  # latest.json and stability.json keep the GPU's name
    run_tests = not (args.no_unit_tests or args.stability_only)
    planned = plan.estimate({p.relative_to(ROOT).as_posix(): counts[p.relative_to(ROOT).as_posix()] for p in paths},
                            "stability" if args.stability_only else "quiet", unit_tests=run_tests, nbval=args.nbval)
    print(f"planned: about {planned:.0f} s (tools/plan.py's estimate from the recorded seconds)", flush=True)
    dev = which == "development"
    out_dir = BUILD if dev else REPORTS
    out_dir.mkdir(parents=True, exist_ok=True)
    phases = {"set-up": time.perf_counter() - t_start}
    print(f"GPU suite on {meta['gpu']} (torch {meta['torch']}, FlashInfer {meta['flashinfer']}): {len(paths)} notebooks"
          + (f", up to {max(counts.values())} executions each" if max(counts.values()) > 1 else "")
          + {QUIET: " (the quiet reference pass: it alone on the GPU)", "stability": " (stability runs only)",
             "development": " (a development pass: reports under build/gpu-suite/ only, nothing committed written)"}[which],
          flush=True)

    # 1. execute
    t0 = time.perf_counter()
    rows, stab = [], []
    for i, p in enumerate(paths, 1):
        rel = p.relative_to(ROOT).as_posix()
        print(f"[{i}/{len(paths)}] executing {rel}" + (f" {counts[rel]} times" if counts[rel] > 1 else "") + " ...",
              flush=True)
        try:
            row, s = execute_notebook(p, counts[rel], args, dict(meta, uuid=uuid))
        except Exception as exc:  # noqa: BLE001 - one broken notebook must not stop the others
            print(f"    FAILED: {one_line(exc)}", flush=True)
            row, s = {"path": rel, "status": "failed", "seconds": None, "problem": one_line(exc), "utc": utc_now(),
                      "source_sha256": nbtools.source_sha256(nbtools.load(p)), "deps": [], "deps_sha256": None}, None
        rows.append(row)
        if s is not None:
            stab.append(s)
    shutil.rmtree(staging_dir(), ignore_errors=True)  # left by a notebook whose execution raised
    phases["execution"] = time.perf_counter() - t0

    # 2. nbval on what executed, and the gpu unit tests, in one pytest run (a development pass: on the executed
    #    copies under build/gpu-suite/executed/, whose results are mapped back to the notebooks' paths)
    executed = [] if args.stability_only or not args.nbval else [r["path"] for r in rows if r["status"] == "executed"]
    if not args.stability_only and not args.nbval:  # one execution per notebook: it passed, or it failed
        for row in rows:
            if row["status"] == "executed":
                row["status"], row["nbval"] = "passed", "not run (one execution per notebook; --nbval adds it)"
    target = {(executed_copy(rel).relative_to(ROOT).as_posix() if dev else rel): rel for rel in executed}
    test_files = gpu_test_files() if run_tests else []
    nb_res, unit, phases["nbval + unit tests"], capture = pytest_pass(list(target), test_files, args,
                                                                      out_dir / "nbval.log", which=which)
    nb_res = {target.get(k, k): v for k, v in nb_res.items()}
    capture = {target.get(k, k): v for k, v in capture.items()}
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
        if not executed:
            unit["seconds"] = round(phases["nbval + unit tests"], 1)
        unit["inputs_sha256"] = nbtools.unit_test_sha256()  # tools/plan.py: no second run on the same files
        print(f"    gpu unit tests: {unit['passed']} passed, {unit['failed']} failed, {unit['skipped']} skipped", flush=True)
        for line in unit["failures"]:
            print(f"      {line}")

    # 3. reports
    t0 = time.perf_counter()
    keep = {p.relative_to(ROOT).as_posix() for p in all_paths}
    if not args.stability_only:
        latest = out_dir / ("development.json" if dev else "latest.json")
        # only the quiet reference pass writes latest.json (the suite's exclusive lock: no other suite runs), and only
        # the notebooks whose run was quiet: a notebook that was not keeps its previous entry while that holds
        reported = [r for r in rows if r["status"] != "not quiet"]
        if not dev:
            carried = record_carried(reported, old_latest)
            for line in carried:
                print(f"    {line}", flush=True)
        with stability_lock(latest):
            current = load_json(latest) if latest == REPORTS / "latest.json" else old_latest
            report, dropped = build_report(current or {}, reported, unit, meta, command, keep)
            latest.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {latest.relative_to(ROOT)} ({len(reported)} entries from this run, "
              f"{len(report['notebooks']) - len(reported)} kept)")
        for why in dropped:
            print(f"    dropped a stale entry: {why}")
    if stab and args.stability_only:  # the runs go with the claims of the quiet pass on this tree, where it holds
        rows_now = scope.latest_rows(load_json(REPORTS / "latest.json"))
        for s in stab:
            row = rows_now.get(s["path"])
            if row and "claims_sha256" in row and evidence.freshness(row) is None:
                s["claims_sha256"] = row["claims_sha256"]
    if stab:
        spath = out_dir / ("development-stability.json" if dev else "stability.json")
        # read again under a lock: suites started at once on disjoint --only sets (the runs of a short lease
        # spread over one GPU) each add their runs to the file as it is now, not as it was at their start
        with stability_lock(spath):
            current = load_json(spath) if spath == REPORTS / "stability.json" else old_stab
            stability, s_dropped = build_stability(current or {}, stab, meta, command, keep,
                                                   latest=load_json(REPORTS / "latest.json"))
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
    if not dev:
        rec = plan.record_renewal(command, "stability" if args.stability_only else "quiet", planned, phases["total"],
                                  [r["path"] for r in rows], utc=utc_now())
        print(f"renewal: planned {rec['planned_s']:.0f} s, took {rec['actual_s']:.0f} s (x{rec['ratio']}): "
              "reports/gpu/renewals.json", flush=True)

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
