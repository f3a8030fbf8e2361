"""An experiment in a fresh Python process, and its one result line: the course's one child-process protocol.

The child prints ``PINLAB_CHILD <json>`` (:data:`MARK`; :func:`report_and_exit` prints it and ends the process
at once) as its result.

* :func:`run_child` runs one child and returns that JSON, or ``{"error": ...}`` saying what went wrong: the
  exit status and the last line of stderr, or the time-out. Lesson 01 (pinning under allocator settings and a
  memlock limit) and lesson 09 (the ``generate()`` audit on a newer transformers) use it.
* :func:`run_children` runs children that may crash or hang their CUDA context (lesson 04's FlashInfer
  ``plan()`` hazard, the snapshot soak): all start at once, each says when its set-up is done, and they are
  told to go one at a time under a time limit; :func:`classify_child` turns each into an outcome.

It imports nothing of pinlab but :mod:`.args`.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .args import positive_number

MARK = "PINLAB_CHILD "


def child_result(stdout: str, stderr: str = "", returncode: int = 0) -> dict:
    """The JSON a child printed (its last :data:`MARK` line), or what went wrong with the child."""
    for line in reversed(str(stdout).splitlines()):
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    tail = [ln for ln in str(stderr).strip().splitlines() if ln.strip()]
    return {"error": f"the child exited with {returncode} and no result"
                     + (f": {tail[-1][:300]}" if tail else "")}


def run_child(code: str, args=(), *, env: dict | None = None, timeout_s: float = 120.0) -> dict:
    """Run ``python -c code *args`` (this interpreter) and return :func:`child_result` of it."""
    try:
        res = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                             env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"the child took more than {timeout_s:.0f} s"}
    return child_result(res.stdout, res.stderr, res.returncode)


def report_and_exit(result: dict) -> None:
    """In a child: print ``result`` on the :data:`MARK` line and end the process at once (no atexit, no CUDA
    teardown that a broken context could hang in)."""
    print(MARK + json.dumps(result), flush=True)
    sys.stderr.flush()
    os._exit(0)


def classify_child(returncode, stdout: str, stderr: str, timed_out: bool) -> dict:
    """The outcome of a child run as data: ``{"outcome", "detail", ...}``.

    ``outcome`` is "hung" (killed at the timeout), the child's own status ("correct", "wrong
    output", "crashed", "hung", "unavailable") when it printed one, else "crashed" (it died: the
    last line of its stderr is the detail).
    """
    if timed_out:
        return {"outcome": "hung", "detail": "killed at the timeout"}
    for line in reversed((stdout or "").splitlines()):
        if line.startswith(MARK):
            try:
                data = json.loads(line[len(MARK):])
            except ValueError:
                break
            out = {"outcome": data.pop("status", "crashed"), "detail": data.pop("detail", "")}
            out.update(data)
            return out
    tail = [ln for ln in (stderr or "").strip().splitlines() if ln.strip()]
    detail = tail[-1][:200] if tail else f"exit status {returncode}, no output"
    return {"outcome": "crashed", "detail": detail}


def run_children(codes: dict, timeout_s: float, envs: dict | None = None, ready_timeout_s: float | None = None) -> dict:
    """Run ``python -c`` children: all start at once (their set-up overlaps), then one at a time,
    in the order given, each is told to go (a line on its stdin) and waited for, at most
    ``timeout_s`` (then it is killed). ``envs`` may give a child extra environment variables
    (``{name: {VAR: value}}``; a value of None removes VAR). With ``ready_timeout_s``, no child is
    told to go before every child has finished its set-up (it creates the file named by its
    ``PINLAB_READY_FILE``) or has ended, waiting at most ``ready_timeout_s`` from the start: then
    no set-up runs beside a timed child, and ``timeout_s`` measures the child's test alone, never
    its start-up (importing torch, CUDA, a JIT build). A child still in its set-up at that deadline
    is killed without being told to go: outcome "unavailable" (its set-up did not finish), never
    "hung". A child's output goes to a file, not a pipe, so a chatty set-up (a JIT build's log)
    can never block on a full pipe while it waits. Returns ``{name: outcome}``, each from
    :func:`classify_child` plus ``returncode`` and ``seconds`` (from its go to its end)."""
    timeout_s = positive_number("timeout_s", timeout_s)
    if not isinstance(codes, dict) or not codes:
        raise TypeError(f"codes must be a non-empty dict {{name: python code}}, got {type(codes).__name__}")
    envs = {} if envs is None else envs
    if not isinstance(envs, dict) or any(k not in codes or not isinstance(v, dict) for k, v in envs.items()):
        raise ValueError("envs must map names of codes to dicts of environment variables")
    if ready_timeout_s is not None:
        ready_timeout_s = positive_number("ready_timeout_s", ready_timeout_s)
    work = tempfile.mkdtemp(prefix="pinlab_children_")  # the children's output files, and their ready files
    ready_dir = work if ready_timeout_s is not None else None
    lib = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = lib + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("PINLAB_RECORD", None)

    def env_of(name):
        e = dict(env)
        if ready_dir is not None:
            e["PINLAB_READY_FILE"] = os.path.join(ready_dir, f"child{list(codes).index(name)}")
        for k, v in envs.get(name, {}).items():
            if v is None:
                e.pop(k, None)
            else:
                e[k] = str(v)
        return e

    files = {name: (open(os.path.join(work, f"child{i}.out"), "w+", encoding="utf-8", errors="replace"),
                    open(os.path.join(work, f"child{i}.err"), "w+", encoding="utf-8", errors="replace"))
             for i, name in enumerate(codes)}

    def output(name):
        texts = []
        for f in files[name]:
            f.flush()
            f.seek(0)
            texts.append(f.read())
        return texts

    procs = {name: subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=files[name][0],
                                    stderr=files[name][1], text=True, env=env_of(name))
             for name, code in codes.items()}
    out = {}
    try:
        not_ready = set()
        if ready_dir is not None:
            deadline = time.perf_counter() + ready_timeout_s
            for i, (name, p) in enumerate(procs.items()):
                ready = os.path.join(ready_dir, f"child{i}")
                while not os.path.exists(ready) and p.poll() is None and time.perf_counter() < deadline:
                    time.sleep(0.01)
                if not os.path.exists(ready) and p.poll() is None:
                    not_ready.add(name)
        for name, p in procs.items():
            if name in not_ready:  # still setting up at the deadline: not tested, and not "hung"
                p.kill()
                p.communicate()
                out[name] = {"outcome": "unavailable", "returncode": None, "seconds": 0.0,
                             "detail": f"its set-up (starting Python, torch, CUDA, any JIT build) did not finish "
                                       f"within {ready_timeout_s:g} s; killed before its test"}
                continue
            t0 = time.perf_counter()
            try:
                p.communicate(input="go\n", timeout=timeout_s)
                res = classify_child(p.returncode, *output(name), False)
                res["returncode"] = p.returncode
            except subprocess.TimeoutExpired:
                p.kill()
                p.communicate()
                res = classify_child(None, "", "", True)
                res["returncode"] = None
            res["seconds"] = round(time.perf_counter() - t0, 1)
            out[name] = res
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.communicate()
        for fo, fe in files.values():
            fo.close()
            fe.close()
        shutil.rmtree(work, ignore_errors=True)
    return out
