"""The platform probe: what this machine can show, and which experiments need what.

:func:`platform_facts` reads, without running an experiment: CUDA or HIP, WSL, an integrated GPU and
whether the GPU reads pageable host memory through the host's page tables (ATS/HMM: Grace Hopper, some
HMM-enabled Linux set-ups), the link (PCIe generation and width, where ``nvidia-smi`` tells), the copy
engines (``asyncEngineCount``), free and total VRAM, available host RAM, the memlock limit, the CPU cores
this process may use, other processes on the GPU, and the driver's CUDA against the wheel's. The costlier
probes run only when asked: :func:`profiler_records_gpu` (one profiled kernel) and
:func:`largest_pinned_gib` (page-locks the course's largest pinned request once).

The run's conditions (issue 33): :func:`compute_apps` lists the compute processes NVML sees on the GPU
(``nvidia-smi --query-compute-apps``, or pynvml), :func:`host_load` the host's load average and usable cores,
and :func:`run_conditions` puts them together, leaving out the given pids; the GPU suite records them per
notebook (tools/gpu_suite.py, the quiet reference pass) and :func:`pinlab.header` prints them, with
:func:`suite_pass` ($PINLAB_SUITE_PASS: which pass of the suite runs the kernel).

:data:`REQUIREMENTS` names what each recorded experiment needs beyond a CUDA GPU; :func:`unmet` says
which of those this machine lacks, in words, and :func:`pinlab.measure` replays the recorded run where
one is unmet (labelled with the reason) instead of failing mid-lesson.

(Why about 520 lines: each fact comes from its own source, nvidia-smi, NVML, /proc, torch's device
properties, with the one sentence a learner reads when that source is missing.)

Adverse conditions can be imitated on a large GPU (``tools/gpu_suite.py --adverse``) through:

* ``PINLAB_VRAM_LIMIT_GIB=16``: the process may use at most that much VRAM
  (``torch.cuda.set_per_process_memory_fraction``, applied by :func:`apply_limits`); free VRAM reads as
  at most that much;
* ``PINLAB_PINNED_LIMIT_GIB=2``: the course treats that as the most pinned memory it may take;
* ``PINLAB_SIMULATE_NO_GPU_TRACE=1``: the profiler is taken to record no GPU activity (as under WSL2);
* ``PINLAB_NO_FLASHINFER=1``: FlashInfer is taken as absent (:func:`pinlab.flashinfer_status`).
"""
from __future__ import annotations

import ctypes
import os
import resource
import subprocess
from functools import lru_cache

import torch

from .args import positive_number
from .device import has_cuda

GiB = 1024 ** 3

#: What each recorded experiment needs beyond a CUDA GPU. Keys: ``gpu_trace`` (the profiler records GPU
#: activity), ``vram_gib`` (free VRAM), ``pinned_gib`` (page-locked host memory), ``host_ram_gib``
#: (available host RAM). Sizes are what the experiment allocates at its peak, rounded up.
REQUIREMENTS: dict[str, dict] = {
    "01_bandwidth": {"vram_gib": 2.5, "pinned_gib": 2.5, "host_ram_gib": 4},
    "01_copy_loop_peak": {"vram_gib": 1, "pinned_gib": 1},
    "01_rounding": {"pinned_gib": 0.5},
    "02_step_loop": {"gpu_trace": True},
    "02_overlap": {"gpu_trace": True},
    "05_restore": {"vram_gib": 1, "pinned_gib": 1, "host_ram_gib": 2},
    "05_d2h_copy_loop_peak": {"vram_gib": 1, "pinned_gib": 1},
    "05_sleep_wake": {"vram_gib": 6.5, "pinned_gib": 4, "host_ram_gib": 10},
    "06_launches": {"gpu_trace": True},
    "07_timeline_planted": {"gpu_trace": True},
    "07_before_after": {"gpu_trace": True},
}

_KNOWN = {"gpu_trace", "vram_gib", "pinned_gib", "host_ram_gib", "newer_transformers", "flashinfer"}

#: where a newer transformers release is installed beside the one in use (lesson 09 audits both): the GPU
#: recipe in the README installs the carried wheel (tools/gpu-wheels.sh) into a folder and names it here
NEWER_TRANSFORMERS_ENV = "PINLAB_TRANSFORMERS_NEWER"


def newer_transformers_dir():
    """The folder $PINLAB_TRANSFORMERS_NEWER names, if it holds a transformers package; else None."""
    raw = os.environ.get(NEWER_TRANSFORMERS_ENV, "").strip()
    if raw and os.path.isfile(os.path.join(raw, "transformers", "__init__.py")):
        return raw
    return None


def _env_gib(name: str) -> float | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"${name} must be a number of GiB such as 16, got {raw!r}") from None
    if not (value > 0 and value != float("inf")):
        raise ValueError(f"${name} must be a positive, finite number of GiB such as 16, got {raw!r}")
    return value


def apply_limits() -> None:
    """Apply ``PINLAB_VRAM_LIMIT_GIB`` (a smaller GPU, imitated) to this process; idempotent."""
    limit = _env_gib("PINLAB_VRAM_LIMIT_GIB")
    if limit is None or not has_cuda():
        return
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, limit * GiB / total), 0)


def _nvidia_smi(query: str, kind: str = "--query-gpu") -> list[str] | None:
    try:
        out = subprocess.run(["nvidia-smi", f"{kind}={query}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return [ln.strip() for ln in out.stdout.strip().splitlines() if ln.strip()]


@lru_cache(maxsize=1)
def _cu_attributes() -> dict:
    """Device attributes read from the driver API (libcuda), or {} where it cannot be read."""
    names = {"copy_engines": 40, "integrated": 18, "pageable_memory_access": 88,
             "pageable_access_uses_host_page_tables": 100}
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        if lib.cuInit(0) != 0:
            return {}
        dev = ctypes.c_int()
        if lib.cuDeviceGet(ctypes.byref(dev), 0) != 0:
            return {}
        out = {}
        version = ctypes.c_int()
        if lib.cuDriverGetVersion(ctypes.byref(version)) == 0:
            out["driver_version"] = int(version.value)
        for key, attr in names.items():
            value = ctypes.c_int()
            if lib.cuDeviceGetAttribute(ctypes.byref(value), attr, dev) == 0:
                out[key] = int(value.value)
        return out
    except (OSError, AttributeError):
        return {}


def _wsl() -> bool:
    try:
        with open("/proc/version", encoding="utf-8") as f:
            return "microsoft" in f.read().lower()
    except OSError:
        return False


def _host_ram_available_gib() -> float | None:
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 / GiB
    except (OSError, ValueError, IndexError):
        pass
    return None


def _memlock_gib() -> float | None:
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    except (OSError, ValueError, AttributeError):
        return None
    return None if soft == resource.RLIM_INFINITY else soft / GiB


def _ancestors(pid: int | None = None) -> set[int]:
    """``pid`` (default: this process) and its parents, read from /proc (empty where there is no /proc)."""
    out, pid = set(), os.getpid() if pid is None else pid
    while pid > 1 and pid not in out:
        out.add(pid)
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
                stat = f.read()
            pid = int(stat[stat.rindex(")") + 2:].split()[1])  # the field after the state: the parent's pid
        except (OSError, ValueError, IndexError):
            break
    return out or {os.getpid()}


def parse_compute_apps(rows) -> list[dict]:
    """The rows of ``nvidia-smi --query-compute-apps=pid,used_memory,gpu_uuid --format=csv,noheader,nounits``
    (one string per process; the later columns may be missing) as ``[{"pid", "used_mib", "gpu_uuid"}]``
    (``used_mib``/``gpu_uuid`` None where not given or "[N/A]"). A row without a pid is a ``ValueError``
    naming it: output this function does not understand is not read as "no process"."""
    if isinstance(rows, (str, bytes)) or not hasattr(rows, "__iter__"):
        raise TypeError(f"rows must be a list of nvidia-smi's lines, got {type(rows).__name__}")
    out = []
    for row in rows:
        if not isinstance(row, str):
            raise TypeError(f"each row must be a str (a line of nvidia-smi's output), got {type(row).__name__}")
        if not row.strip():
            continue
        cols = [c.strip() for c in row.split(",")]
        if not cols[0].isdigit():
            raise ValueError(f"an nvidia-smi row must start with a pid, got {row!r}"[:200])
        mem = cols[1].split()[0] if len(cols) > 1 and cols[1] else ""
        uuid = cols[2] if len(cols) > 2 and cols[2] and not cols[2].startswith("[") else None
        out.append({"pid": int(cols[0]), "used_mib": int(mem) if mem.isdigit() else None, "gpu_uuid": uuid})
    return out


def _nvml_compute_apps() -> list[dict] | None:
    """The compute processes of every GPU through pynvml (NVML's Python binding, ``nvidia-ml-py``), or None."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # no driver, no GPU: NVML cannot tell
        return None
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            uuid = pynvml.nvmlDeviceGetUUID(h)
            uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                used = getattr(proc, "usedGpuMemory", None)
                out.append({"pid": int(proc.pid), "used_mib": int(used) // 2**20 if isinstance(used, int) else None,
                            "gpu_uuid": uuid})
        return out
    except Exception:
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _uuid_key(u: str) -> str:
    return u.strip().lower().removeprefix("gpu-")


def _same_gpu(a: str | None, b: str | None) -> bool:
    """Whether two GPU UUIDs name one GPU (``GPU-`` prefix and case ignored; unknown: assumed the same)."""
    if not a or not b:
        return True
    return _uuid_key(a) == _uuid_key(b)


def compute_apps(uuid: str | None = None) -> list[dict] | None:
    """The compute processes NVML lists (``nvidia-smi --query-compute-apps``; pynvml where there is no
    nvidia-smi): ``[{"pid", "used_mib", "gpu_uuid"}]``, on the GPU ``uuid`` only where given (another GPU's
    processes do not share this one). None where neither can list them: "cannot tell", never "none".

    The pids are those the driver reports: inside a container with its own pid namespace they may not be
    this container's pids, and some containers list no process at all."""
    rows = _nvidia_smi("pid,used_memory,gpu_uuid", kind="--query-compute-apps")
    if rows is None:
        import shutil

        procs = _nvml_compute_apps() if shutil.which("nvidia-smi") is None else None
        gpus = None
    else:
        try:
            procs = parse_compute_apps(rows)
        except ValueError:
            return None
        gpus = _nvidia_smi("uuid")
    if procs is None:
        return None
    known = {_uuid_key(g) for g in gpus or []} | {_uuid_key(p["gpu_uuid"]) for p in procs if p.get("gpu_uuid")}
    if uuid is None or _uuid_key(uuid) not in known:
        # a UUID NVML does not know (another spelling of it, a MIG instance): every process counts, so that a GPU
        # shared with others is never taken for an unshared one
        return procs
    return [p for p in procs if _same_gpu(p.get("gpu_uuid"), uuid)]


def others(procs: list[dict] | None, mine) -> list[dict] | None:
    """The processes of ``procs`` (:func:`compute_apps`) whose pid is not in ``mine``, by pid; None stays None."""
    if procs is None:
        return None
    mine = {int(p) for p in mine}
    return [p for p in procs if p["pid"] not in mine]


def _gpu_processes() -> int | None:
    """Compute processes on the GPU other than this one and its parents (a shared GPU), where nvidia-smi tells.

    The parents are left out: a Jupyter kernel started by a program that uses the GPU itself (the course's GPU
    suite, a test runner) is not sharing the GPU with anyone else."""
    rows = _nvidia_smi("pid", kind="--query-compute-apps")
    if rows is None:
        return None
    pids = {r.split(",")[0].strip() for r in rows}
    return len(pids - {str(p) for p in _ancestors()})


def host_load() -> dict:
    """``{"load_avg": [1, 5, 15 min] or None, "cores_usable": n}``: the host's load average
    (``os.getloadavg``: runnable and waiting tasks, over the whole host, container or not) and the CPU cores
    this process may run on (``os.sched_getaffinity``)."""
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        load = None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"load_avg": load, "cores_usable": cores}


#: $PINLAB_SUITE_PASS, set by tools/gpu_suite.py for the kernels it runs: which of its passes this is, in the
#: words a lesson's header uses (only the quiet reference pass writes the committed outputs and recordings)
SUITE_PASSES = {
    "quiet-reference": "the GPU suite's quiet reference pass",
    "development": "a development pass of the GPU suite (--shared or --keep-going), not the quiet reference",
    "stability": "a stability pass of the GPU suite (--stability-only), not the quiet reference",
}


def suite_pass() -> str | None:
    """Which pass of the GPU suite runs this kernel ($PINLAB_SUITE_PASS), or None outside the suite."""
    value = os.environ.get("PINLAB_SUITE_PASS", "").strip()
    return value if value in SUITE_PASSES else None


def run_conditions(mine=None, uuid: str | None = None, query=None) -> dict:
    """This moment's conditions, as the GPU suite records them and a lesson's header prints them:
    ``{"utc", "other_gpu_processes": [{"pid", "used_mib", "gpu_uuid"}] or None (cannot tell), "load_avg",
    "cores_usable"}``. ``mine``: the pids not counted as others (default: this process and its parents, see
    :func:`_ancestors`); ``query``: what lists the GPU's processes (default :func:`compute_apps`), for tests."""
    import datetime as _dt

    procs = (query or compute_apps)(uuid)
    return {"utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "other_gpu_processes": others(procs, _ancestors() if mine is None else mine), **host_load()}


def processes_text(procs: list[dict] | None) -> str:
    """``no other process on it`` / ``2 other processes on it (pid 41 using 1024 MiB, pid 77)`` / unknown."""
    if procs is None:
        return "other processes on it: unknown (nvidia-smi could not list them)"
    if not procs:
        return "no other process on it"
    shown = ", ".join(f"pid {p['pid']}" + (f" using {p['used_mib']} MiB" if p.get("used_mib") is not None else "")
                      for p in procs[:4])
    more = f" and {len(procs) - 4} more" if len(procs) > 4 else ""
    return f"{len(procs)} other process{'es' if len(procs) > 1 else ''} on it ({shown}{more})"


def load_text(c: dict) -> str:
    """``host load 0.42 (1-min average) on 16 usable cores``, from :func:`host_load`'s keys."""
    load = c.get("load_avg")
    what = f"host load {load[0]:.2f} (1-min average)" if load else "host load unknown"
    cores = c.get("cores_usable")
    return what + (f" on {cores} usable core{'s' if cores != 1 else ''}" if cores else "")


def platform_facts() -> dict:
    """The platform report (all JSON-able; None where this machine cannot tell)."""
    out = {
        "backend": "hip" if getattr(torch.version, "hip", None) else ("cuda" if torch.version.cuda else None),
        "gpu_usable": has_cuda(),
        "wsl": _wsl(),
        "cpu_cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "host_ram_available_gib": _host_ram_available_gib(),
        "memlock_limit_gib": _memlock_gib(),
        "pinned_limit_gib": _env_gib("PINLAB_PINNED_LIMIT_GIB"),
        "vram_limit_gib": _env_gib("PINLAB_VRAM_LIMIT_GIB"),
        "gpu": None, "integrated": None, "pageable_memory_access": None, "ats": None, "copy_engines": None,
        "vram_total_gib": None, "vram_free_gib": None, "pcie_gen": None, "pcie_gen_max": None,
        "pcie_width": None, "pcie_width_max": None, "driver_cuda": None, "wheel_cuda": torch.version.cuda,
        "other_gpu_processes": None,
    }
    if not out["gpu_usable"]:
        return out
    props = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info(0)
    if out["vram_limit_gib"] is not None:
        free = min(free, out["vram_limit_gib"] * GiB)
    attrs = _cu_attributes()
    out.update({
        "gpu": props.name,
        "integrated": bool(getattr(props, "is_integrated", attrs.get("integrated", 0))),
        "pageable_memory_access": None if "pageable_memory_access" not in attrs
        else bool(attrs["pageable_memory_access"]),
        "ats": None if "pageable_access_uses_host_page_tables" not in attrs
        else bool(attrs["pageable_access_uses_host_page_tables"]),
        "copy_engines": attrs.get("copy_engines"),
        "vram_total_gib": round(total / GiB, 1),
        "vram_free_gib": round(free / GiB, 1),
        "other_gpu_processes": _gpu_processes(),
    })
    version = _cu_attributes().get("driver_version")  # e.g. 13000
    out["driver_cuda"] = f"{version // 1000}.{version % 1000 // 10}" if version else None
    rows = _nvidia_smi("pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,pcie.link.width.max")
    if rows:
        vals = [v.strip() for v in rows[0].split(",")]
        for key, v in zip(("pcie_gen", "pcie_gen_max", "pcie_width", "pcie_width_max"), vals):
            out[key] = int(v) if v.isdigit() else None
    return out


@lru_cache(maxsize=1)
def profiler_records_gpu() -> bool:
    """Does ``torch.profiler`` record GPU activity here? (Often not under WSL2.) Profiles one small kernel.

    ``PINLAB_SIMULATE_NO_GPU_TRACE=1`` answers False (imitating such a machine)."""
    if os.environ.get("PINLAB_SIMULATE_NO_GPU_TRACE", "") not in ("", "0"):
        return False
    if not has_cuda():
        return False
    import warnings

    from torch.profiler import ProfilerActivity, profile

    x = torch.ones(1024, device="cuda")
    torch.cuda.synchronize()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                (x * 2).sum()
                torch.cuda.synchronize()
        return any(getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA for e in prof.events())
    except Exception:  # a profiler that cannot start is one that records nothing
        return False


#: The most :func:`largest_pinned_gib` tries to page-lock at once (GiB).
MAX_PIN_PROBE_GIB = 1024.0


def largest_pinned_gib(want_gib: float = 4.0) -> float:
    """Page-lock ``want_gib`` GiB once (then free it): ``want_gib`` where that worked, else the largest
    power-of-two share that did (0 where none). ``PINLAB_PINNED_LIMIT_GIB`` caps the answer. ``want_gib``:
    a number of GiB, more than 0 and at most :data:`MAX_PIN_PROBE_GIB`."""
    want = positive_number("want_gib", want_gib, maximum=MAX_PIN_PROBE_GIB)
    return _largest_pinned_gib(want)


@lru_cache(maxsize=4)
def _largest_pinned_gib(want_gib: float) -> float:
    limit = _env_gib("PINLAB_PINNED_LIMIT_GIB")
    if not has_cuda():
        return 0.0
    size = want_gib if limit is None else min(want_gib, limit)
    while size >= 1 / 64:
        try:
            t = torch.empty(int(size * GiB), dtype=torch.uint8, pin_memory=True)
            del t
            from .hostmem import release_cached_host_blocks

            release_cached_host_blocks()
            return size
        except RuntimeError:
            size /= 2
    return 0.0


#: The most a requirement may ask for (GiB): beyond any machine, so surely a typo.
MAX_REQUIRED_GIB = 4096.0


def unmet(requires: dict | None) -> list[str]:
    """The requirements in ``requires`` this machine does not meet, each as a short reason (empty: all met).

    ``requires`` (as in :data:`REQUIREMENTS`): ``gpu_trace``, ``newer_transformers`` and ``flashinfer`` True or
    False (``flashinfer``: the experiment measures FlashInfer itself, so without it the recorded run is replayed,
    as issue 47 asks of lesson 09, not a run that says "unavailable"); ``vram_gib``, ``pinned_gib``,
    ``host_ram_gib`` a number of GiB (0 means none needed, at most :data:`MAX_REQUIRED_GIB`)."""
    if requires is None:
        return []
    if not isinstance(requires, dict):
        raise TypeError(f"requires must be a dict such as {{'vram_gib': 6.5, 'gpu_trace': True}}, "
                        f"got {type(requires).__name__}")
    unknown = sorted((str(k) for k in requires if k not in _KNOWN), key=str)
    if unknown:
        raise ValueError(f"requires has unknown keys {unknown}; known: {sorted(_KNOWN)}")
    for key in ("gpu_trace", "newer_transformers", "flashinfer"):
        if key in requires and not isinstance(requires[key], bool):
            raise TypeError(f"requires[{key!r}] must be True or False, got {type(requires[key]).__name__} "
                            f"({requires[key]!r})")
    for key in ("vram_gib", "pinned_gib", "host_ram_gib"):
        if key in requires:
            positive_number(f"requires[{key!r}]", requires[key], allow_zero=True, maximum=MAX_REQUIRED_GIB)
    reasons = []
    if requires.get("gpu_trace") and not profiler_records_gpu():
        why = ("$PINLAB_SIMULATE_NO_GPU_TRACE is set" if os.environ.get("PINLAB_SIMULATE_NO_GPU_TRACE")
               not in (None, "", "0") else "as often under WSL2")
        reasons.append(f"the profiler records no GPU activity on this machine ({why})")
    if requires.get("newer_transformers") and newer_transformers_dir() is None:
        reasons.append(f"no newer transformers is installed beside this one (${NEWER_TRANSFORMERS_ENV} names no "
                       "folder holding one; the README's GPU recipe installs it)")
    if requires.get("flashinfer"):
        from .device import flashinfer_status

        version, why = flashinfer_status()
        if version is None:
            reasons.append(why.split(": the torch reference")[0].split("; install")[0])
    p = platform_facts() if any(k in requires for k in ("vram_gib", "host_ram_gib", "pinned_gib")) else {}
    need = requires.get("vram_gib")
    if need and p.get("vram_free_gib") is not None and p["vram_free_gib"] < need:
        reasons.append(f"it needs {need} GiB of free VRAM and this GPU has {p['vram_free_gib']} GiB free")
    need = requires.get("host_ram_gib")
    if need and p.get("host_ram_available_gib") is not None and p["host_ram_available_gib"] < need:
        reasons.append(f"it needs {need} GiB of host RAM and {p['host_ram_available_gib']:.1f} GiB is available")
    need = requires.get("pinned_gib")
    if need:
        # only the course's own budget: cudaHostAlloc is not bound by the memlock limit (ulimit -l; 2 GiB
        # were pinned under a 1 MiB limit on the H200 machine), so that limit would replay what runs fine
        budget = p.get("pinned_limit_gib")
        if budget is not None and budget < need:
            reasons.append(f"it page-locks {need} GiB and $PINLAB_PINNED_LIMIT_GIB allows {budget:.1f} GiB")
    return reasons


#: what CUDA_LAUNCH_BLOCKING=1 does to a lesson's effects (issue 45: under it, failures blamed the CPU)
LAUNCH_BLOCKING_WHY = ("CUDA_LAUNCH_BLOCKING=1 is set: every launch and copy waits until the GPU has run it, so the "
                       "host never runs ahead of the GPU and nothing is pending; a race, an overlap or a stall of a "
                       "host ahead of the GPU cannot happen in this run (unset it to measure them)")


def launch_blocking() -> bool:
    """Whether CUDA serializes every launch with the host here: ``CUDA_LAUNCH_BLOCKING=1`` and a CUDA GPU (the
    emulated stream and a replay do not read the variable)."""
    return os.environ.get("CUDA_LAUNCH_BLOCKING", "").strip() == "1" and has_cuda()


def machine_summary() -> str:
    """One line on what about this machine may explain a result: GPU, link, sharing, cores, OS."""
    p = platform_facts()
    parts = []
    if not p["gpu_usable"]:
        parts.append("no CUDA GPU (this is the recorded GPU run, replayed: a failure here means the recorded "
                     "file does not say what the lesson claims; restore it with `git checkout -- reports/gpu`)")
    else:
        if launch_blocking():
            parts.append("CUDA_LAUNCH_BLOCKING=1 (every launch waits for the GPU: the host never runs ahead)")
        link = (f"PCIe Gen{p['pcie_gen']} x{p['pcie_width']}" if p["pcie_gen"] and p["pcie_width"]
                else "link not reported")
        parts.append(f"{p['gpu']} ({link}, {p['vram_free_gib']} of {p['vram_total_gib']} GiB VRAM free)")
        if p["other_gpu_processes"]:
            parts.append(f"{p['other_gpu_processes']} other process(es) on the GPU (a shared GPU: its work "
                         "interleaves with yours)")
        if p["ats"] or p["integrated"]:
            parts.append("the GPU reads host memory through the host's page tables (pageable behaves closer "
                         "to pinned)")
        if p["backend"] == "hip":
            parts.append("ROCm/HIP (every pageable copy blocks)")
        if p["driver_cuda"] and p["wheel_cuda"] and p["driver_cuda"] != p["wheel_cuda"]:
            parts.append(f"driver CUDA {p['driver_cuda']} vs torch's {p['wheel_cuda']}")
    parts.append(f"{p['cpu_cores_usable']} CPU core(s) usable")
    if p["wsl"]:
        parts.append("WSL2 (the driver's staging and the profiler differ from native Linux)")
    return "; ".join(parts)
