"""The GPU suite: run on a CUDA machine to produce the course's GPU evidence.

1. executes every notebook in notebooks/ and solutions/ in place, recording each experiment's
   result under reports/gpu/data/ (PINLAB_RECORD=1), so the committed notebooks carry GPU outputs
   and CPU machines can replay them;
2. runs nbval (strict, --require-gpu) on each executed notebook, measuring again;
3. writes reports/gpu/latest.json (and the nbval log reports/gpu/nbval.log); profiler traces the
   notebooks wrote under build/traces/ are kept in reports/gpu/traces/.

It uses the Python on PATH with its own torch; pinlab is imported from lib/ (no install needed).
Usage:  python3 tools/gpu_suite.py [--keep-going] [--only NAME ...]
  --only NAME ...  a partial run (notebooks whose file name contains a NAME); no report written
  --keep-going     development: run every cell even after one fails (implies no report)
"""
from __future__ import annotations

import datetime as dt
import json
import os
import platform
import shutil
import subprocess
import sys
import time

import nbtools

ROOT = nbtools.ROOT


def main(argv: list[str]) -> int:
    import torch

    if not torch.cuda.is_available():
        print("gpu_suite: torch.cuda.is_available() is False: run this on a CUDA machine.")
        return 2
    only = argv[argv.index("--only") + 1:] if "--only" in argv else None
    keep_going = "--keep-going" in argv
    env_path = os.pathsep.join([str(ROOT / "lib"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    os.environ["PYTHONPATH"] = env_path
    sys.path.insert(0, str(ROOT / "lib"))
    from pinlab.device import facts

    paths = nbtools.notebook_paths(nbtools.NOTEBOOK_DIRS)
    if only:
        paths = [p for p in paths if any(o in p.name for o in only)]
    rows = []
    for i, p in enumerate(paths, 1):
        rel = p.relative_to(ROOT).as_posix()
        print(f"[{i}/{len(paths)}] executing {rel} ...", flush=True)
        try:
            secs = nbtools.execute(p, env={"PINLAB_RECORD": "1"}, allow_errors=keep_going)
            status = "executed"
        except Exception as exc:  # a failing cell: keep going, report it
            secs, status = float("nan"), "failed"
            print(f"    FAILED: {type(exc).__name__}: {str(exc)[-2000:]}", flush=True)
        print(f"    {status} in {secs:.1f} s", flush=True)
        rows.append({"path": rel, "status": status, "seconds": round(secs, 1)})
    # keep the profiler traces the notebooks wrote, so that readers without a GPU can open them
    traces = ROOT / "reports" / "gpu" / "traces"
    for t in sorted((ROOT / "build" / "traces").glob("*.json")):
        traces.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(t, traces / t.name)
        print(f"kept {t.relative_to(ROOT)} as {(traces / t.name).relative_to(ROOT)} ({t.stat().st_size // 1024} KiB)")
    log = open(ROOT / "reports" / "gpu" / "nbval.log", "w")
    for row in rows:
        if row["status"] != "executed":
            continue
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval", "--nbval-current-env",
               "--nbval-sanitize-with", "tests/nbval_sanitize.cfg", "--nbval-cell-timeout=1800",
               "--require-gpu", row["path"]]
        print(f"nbval {row['path']} ...", flush=True)
        res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        log.write(f"$ {' '.join(cmd[1:])}\n{res.stdout}{res.stderr}\n")
        row["status"] = "passed" if res.returncode == 0 else "failed"
        print(f"    nbval {row['status']}: {res.stdout.strip().splitlines()[-1] if res.stdout.strip() else ''}",
              flush=True)
    log.close()
    for row in rows:
        row["source_sha256"] = nbtools.source_sha256(nbtools.load(ROOT / row["path"]))
    f = facts()
    report = {
        "gpu": f["gpu"], "driver": f["driver"], "capability": f["capability"],
        "torch": f["torch"], "cuda": f["cuda_runtime"], "flashinfer": f["flashinfer"],
        "python": platform.python_version(),
        "utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": "python3 tools/gpu_suite.py",
        "lib_sha256": nbtools.lib_sha256(),
        "notebooks": rows,
    }
    if only or keep_going:
        print(json.dumps(report, indent=1))
        print("(partial run with --only: reports/gpu/latest.json not written)")
    else:
        (ROOT / "reports" / "gpu" / "latest.json").write_text(json.dumps(report, indent=1) + "\n")
        print("wrote reports/gpu/latest.json")
    ok = all(r["status"] == "passed" for r in rows)
    print("GPU suite:", "all passed" if ok else "FAILURES", f"({sum(r['status'] == 'passed' for r in rows)}/{len(rows)})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
