"""pinlab: the helper library of the course on honest host-to-device copies in PyTorch."""
from .args import CudaUnavailableError
from .busy import cycles_per_ms, gpu_busy, wall_ms, warmup
from .claims import ClaimError, Reasons, claim, claims, observe
from .device import facts, flashinfer_status, has_cuda, pinned_memory_available
from .doctor import doctor
from .hostmem import (PINNED_BACK_WHY, host_stats, next_pow2, pinned_back_to, pinned_baseline, pinned_bytes_held,
                      release_cached_host_blocks)
from .probe import apply_limits, machine_summary, platform_facts
from .progress import progress
from .replay import ReplayMissingError, Run, measure
from .run_header import header
from .streams import CudaStream, LaggingStream, stream
from .timing import Stats, cuda_time, fmt_ms, host_time, report, show, table

__all__ = [
    "StallError", "async_tensor_h2d", "detect_stalls", "pin_snapshot", "RaceError", "detect_races",
    "CudaStream", "LaggingStream", "stream",
    "CudaUnavailableError", "ReplayMissingError", "Run", "Stats",
    "cuda_time", "cycles_per_ms", "doctor", "facts", "flashinfer_status", "fmt_ms", "gpu_busy",
    "has_cuda", "header", "host_stats", "host_time", "measure", "next_pow2", "pinned_bytes_held",
    "PINNED_BACK_WHY", "pinned_back_to", "pinned_baseline", "pinned_memory_available", "progress", "release_cached_host_blocks", "report", "show", "table",
    "wall_ms", "warmup",
    "ClaimError", "Reasons", "claim", "claims", "observe", "machine_summary", "platform_facts",
]

#: the take-home tools, imported where first used (PEP 562), not here: a notebook that never asks for one does
#: not record its modules among its deps, so a change to the race detector (order.py, races.py), the stall
#: detector (detector.py) or the copy helpers (h2d.py) renews only the lessons that use them (issue 44: evidence
#: scoped to what it proves). No name here may be a submodule's name (``pinlab.doctor`` is both: it stays eager)
_LAZY = {"detect_races": "order", "RaceError": "order", "detect_stalls": "detector", "StallError": "detector",
         "async_tensor_h2d": "h2d", "pin_snapshot": "h2d"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pinlab' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


apply_limits()  # $PINLAB_VRAM_LIMIT_GIB: a smaller GPU, imitated (tools/gpu_suite.py --adverse)
