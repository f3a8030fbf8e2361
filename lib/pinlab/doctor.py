"""Check this machine's set-up and say what it can show.

:func:`doctor` checks the packages, prints the platform report (:func:`platform_lines`, the same lines
lesson 00 shows) and which recorded experiments run live here and which replay, and why
(:func:`experiment_lines`, from :data:`pinlab.probe.REQUIREMENTS` and :func:`pinlab.probe.unmet`).
"""
from __future__ import annotations

import importlib
import json
import sys

from . import probe
from .args import bool_arg
from .device import facts
from .replay import check_recorded, data_dir
from .timing import wrapped


def _gib(v) -> str:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return "unknown"
    return f"{v:.1f} GiB" if v >= 1 else f"{v * 1024:.0f} MiB"


def platform_lines(p: dict | None = None) -> list[tuple[str, str]]:
    """The platform report as ``(label, text)`` lines, from :func:`pinlab.probe.platform_facts` (or the
    dict ``p`` it returned: a recorded one, or facts made up in a test). Each line says what this
    machine is, and where that changes what the lessons show (the link, a shared GPU, WSL2, ATS, ROCm)."""
    p = probe.platform_facts() if p is None else p
    if not isinstance(p, dict):
        raise TypeError(f"p must be the dict platform_facts() returns, got {type(p).__name__}")
    g = p.get
    lines = []
    backend = {"cuda": "CUDA", "hip": "ROCm/HIP"}.get(g("backend"))
    if not g("gpu_usable"):
        what = f"none visible to this {backend} build of torch" if backend else "none: this torch is CPU-only"
        lines.append(("GPU", f"{what}; the lessons replay the recorded GPU run and run the host/GPU ordering "
                             "loops on the emulated stream"))
    else:
        lines.append(("GPU", f"{g('gpu') or 'unknown'} ({backend})"))
        if g("backend") == "hip":
            lines.append(("ROCm", "a pageable copy blocks the host there: what the lessons measure of CUDA's "
                                  "staging (fake non_blocking) does not carry over one to one"))
        if g("integrated"):
            lines.append(("memory", "an integrated GPU: GPU and CPU share one physical memory"))
        if g("ats"):
            lines.append(("pageable host memory", "the GPU reads it through the host's page tables (ATS, as on "
                                                  "GH200/GB200 over NVLink-C2C): pageable copies come close to pinned"))
        elif g("pageable_memory_access"):
            lines.append(("pageable host memory", "the GPU can access it (HMM); copies from it are still staged"))
        else:
            lines.append(("pageable host memory", "not accessible to the GPU: the driver stages every pageable copy"))
        if g("pcie_gen") and g("pcie_width"):
            link = f"PCIe Gen{g('pcie_gen')} x{g('pcie_width')}"
            if (g("pcie_gen_max") and g("pcie_gen_max") != g("pcie_gen")) or \
                    (g("pcie_width_max") and g("pcie_width_max") != g("pcie_width")):
                link += (f" now, Gen{g('pcie_gen_max') or '?'} x{g('pcie_width_max') or '?'} at most "
                         "(an idle GPU may run its link slower)")
            lines.append(("link", link))
        else:
            lines.append(("link", "not reported (no nvidia-smi, WSL2, ROCm, or NVLink-C2C)"))
        if g("copy_engines") is not None:
            lines.append(("copy engines", str(g("copy_engines"))))
        vram = f"{_gib(g('vram_free_gib'))} free of {_gib(g('vram_total_gib'))}"
        if g("vram_limit_gib"):
            vram += f" (limited to {g('vram_limit_gib')} GiB by $PINLAB_VRAM_LIMIT_GIB)"
        lines.append(("VRAM", vram))
        others = g("other_gpu_processes")
        lines.append(("other processes on the GPU",
                      "unknown (nvidia-smi cannot tell)" if others is None
                      else "none: the GPU is yours" if others == 0
                      else f"{others}: a shared GPU (their work interleaves with yours; timings vary more)"))
        if g("driver_cuda") or g("wheel_cuda"):
            cuda = f"torch built for CUDA {g('wheel_cuda')}" if g("wheel_cuda") else "torch's CUDA version unknown"
            lines.append(("CUDA", cuda + (f"; the driver supports CUDA {g('driver_cuda')}" if g("driver_cuda") else "")))
    lines.append(("host RAM available", _gib(g("host_ram_available_gib"))))
    # cudaHostAlloc is not bound by the memlock limit (ulimit -l): 2 GiB pinned under a 1 MiB limit on
    # the H200 machine; host RAM bounds it, and $PINLAB_PINNED_LIMIT_GIB imitates a smaller budget
    lines.append(("pinned memory budget", f"{g('pinned_limit_gib')} GiB ($PINLAB_PINNED_LIMIT_GIB)"
                  if g("pinned_limit_gib") else "the host RAM available (no $PINLAB_PINNED_LIMIT_GIB set)"))
    lines.append(("CPU cores usable", str(g("cpu_cores_usable") or "unknown")))
    lines.append(("WSL2", "yes: the driver's staging and the profiler differ from native Linux (the profiler often "
                          "records no GPU activity)" if g("wsl") else "no"))
    return lines


def experiment_lines(p: dict | None = None) -> list[tuple[str, str]]:
    """Which recorded experiments run live on this machine and which replay, and why, as ``(label, text)``
    lines. Without a usable GPU every experiment replays; on one, each experiment listed in
    :data:`pinlab.probe.REQUIREMENTS` whose needs this machine does not meet (:func:`pinlab.probe.unmet`)
    replays, labelled with the reason, and every other experiment runs live."""
    p = probe.platform_facts() if p is None else p
    if not isinstance(p, dict):
        raise TypeError(f"p must be the dict platform_facts() returns, got {type(p).__name__}")
    recorded, _ = check_recorded()
    n = len(recorded)
    if not p.get("gpu_usable"):
        return [("experiments", f"all replay: the {n} recorded ones (no CUDA GPU here)")]
    replay = [(name, "; ".join(reasons)) for name, need in sorted(probe.REQUIREMENTS.items())
              if (reasons := probe.unmet(need))]
    lines = [("experiments", "all run live on this GPU" if not replay
              else f"live, except {len(replay)} that replay the recorded run:")]
    lines += [(f"replays {name}", why) for name, why in replay]
    return lines


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
    # the library's requirements (pyproject.toml's dependencies), then the notebook tools of the "lab" extra, which
    # only `make setup`'s commands need (a plain `pip install` of the course, on Colab, leaves them out)
    for mod, required in (("torch", True), ("numpy", True), ("matplotlib", True), ("tqdm", True),
                          ("nbformat", False)):
        try:
            m = importlib.import_module(mod)
            add(f"import {mod}", True, getattr(m, "__version__", ""), required=required)
        except Exception as exc:  # pragma: no cover - depends on the machine
            add(f"import {mod}", False, f"{type(exc).__name__}: {exc}; run `make setup`"
                + ("" if required else " (only make run, make notebooks and the GPU suite need it)"),
                required=required)
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
            print(wrapped(f"  [{mark}] {c['check']:<18} {c['note']}", indent=28))
        print("  This machine shows:", "live GPU measurements" if f["cuda_available"]
              else "the recorded GPU run, replayed (no CUDA here)")
    p = probe.platform_facts()
    platform, experiments = platform_lines(p), experiment_lines(p)
    if verbose:
        print("  Platform:")
        for label, text in platform:
            print(wrapped(f"    {label}: {text}", indent=6))
        for label, text in experiments:
            print(wrapped(f"  {label}: {text}", indent=4) if label == "experiments" else wrapped(f"    {label}: {text}", indent=6))
    return {"ok": ok, "checks": checks, "live": f["cuda_available"], "platform": p,
            "platform_lines": platform, "experiment_lines": experiments}
