"""Check this machine's set-up and say what it can show."""
from __future__ import annotations

import importlib
import json
import sys

from .args import bool_arg
from .device import facts
from .replay import check_recorded, data_dir


def doctor(verbose: bool = True) -> dict:
    """Run the checks; print one line each (unless ``verbose=False``); return a summary dict.

    ``summary["ok"]`` is True when everything the course needs on *any* machine is present:
    a GPU is optional (without one the lessons replay the recorded GPU run).
    """
    bool_arg("verbose", verbose)
    checks = []

    def add(name, ok, note, required=True):
        checks.append({"check": name, "ok": bool(ok), "note": note, "required": required})

    add("python >= 3.10", sys.version_info >= (3, 10), sys.version.split()[0])
    for mod in ("torch", "numpy", "matplotlib", "tqdm", "nbformat"):
        try:
            m = importlib.import_module(mod)
            add(f"import {mod}", True, getattr(m, "__version__", ""))
        except Exception as exc:  # pragma: no cover - depends on the machine
            add(f"import {mod}", False, f"{type(exc).__name__}: {exc}; run `make setup`")
    f = facts()
    add("CUDA GPU", f["cuda_available"],
        f"{f['gpu']} (cc {f['capability']})" if f["cuda_available"] else "none: lessons replay the recorded GPU run",
        required=False)
    add("pinned memory", f["pinned_memory"],
        "page-locked host memory can be allocated" if f["pinned_memory"] else "needs CUDA", required=False)
    add("FlashInfer", f["flashinfer"] is not None, f["flashinfer_note"], required=False)
    recorded, broken = check_recorded()
    if broken:
        note = f"{len(broken)} broken file(s) under {data_dir()}: " + " ".join(broken)
    elif recorded:
        note = f"{len(recorded)} experiments under reports/gpu/data, all readable"
    else:
        note = f"none under {data_dir()}: run the GPU suite on a CUDA machine (make gpu-suite)"
    add("recorded GPU run", bool(recorded) and not broken, note, required=not f["cuda_available"])
    report = data_dir().parent / "latest.json"
    fix = "restore it with `git checkout -- reports/gpu` or re-run the GPU suite (make gpu-suite)"
    try:
        notebooks = json.loads(report.read_text(encoding="utf-8")).get("notebooks")
        ok_report = isinstance(notebooks, list) and bool(notebooks)
        report_note = (f"{len(notebooks)} notebooks in the latest GPU suite run" if ok_report
                       else f"{report} lists no notebooks: {fix}")
    except (OSError, ValueError, AttributeError) as exc:
        ok_report = False
        report_note = f"{report} is missing or unreadable ({type(exc).__name__}): {fix}"
    add("GPU suite report", ok_report, report_note, required=False)
    ok = all(c["ok"] for c in checks if c["required"])
    if verbose:
        for c in checks:
            mark = "ok  " if c["ok"] else ("FAIL" if c["required"] else "--  ")
            print(f"  [{mark}] {c['check']:<18} {c['note']}")
        print("  This machine shows:", "live GPU measurements" if f["cuda_available"]
              else "the recorded GPU run, replayed (no CUDA here)")
    return {"ok": ok, "checks": checks, "live": f["cuda_available"]}
