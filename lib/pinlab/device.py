"""What this machine can show: CUDA, the GPU, library versions, pinned memory."""
from __future__ import annotations

import os
import platform
import subprocess
from functools import lru_cache

import torch


class CudaUnavailableError(RuntimeError):
    """Raised by a GPU-only pinlab call on a machine where CUDA is not available."""


def has_cuda() -> bool:
    """True when a CUDA GPU can be used. ``PINLAB_FORCE_CPU=1`` forces the CPU path (replay)."""
    if os.environ.get("PINLAB_FORCE_CPU", "") not in ("", "0"):
        return False
    return torch.cuda.is_available()


@lru_cache(maxsize=1)
def flashinfer_status() -> tuple[str | None, str]:
    """(version or None, a one-line explanation). Never raises. ``PINLAB_NO_FLASHINFER=1`` takes it as absent."""
    if os.environ.get("PINLAB_NO_FLASHINFER", "") not in ("", "0"):
        return None, "FlashInfer taken as absent ($PINLAB_NO_FLASHINFER is set): the torch reference runs instead"
    try:
        import flashinfer  # noqa: F401
    except Exception as exc:  # ImportError, or a crash inside flashinfer's import
        return None, f"FlashInfer is not importable ({type(exc).__name__}: {str(exc)[:120]}); install flashinfer-python"
    version = getattr(flashinfer, "__version__", "unknown")
    return version, f"FlashInfer {version} imports"


def _driver_version() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10,
        )
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    return None


def pinned_memory_available() -> bool:
    """Can this process allocate page-locked host memory through torch?"""
    if not has_cuda():
        return False
    try:
        return bool(torch.empty(1, pin_memory=True).is_pinned())
    except RuntimeError:
        return False


def facts() -> dict:
    """Machine facts as a dict (all JSON-able)."""
    cuda = has_cuda()
    fi_version, fi_note = flashinfer_status()
    out = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_available": cuda,
        "cuda_runtime": torch.version.cuda,
        "gpu": None,
        "capability": None,
        "driver": None,
        "pinned_memory": False,
        "flashinfer": fi_version,
        "flashinfer_note": fi_note,
    }
    if cuda:
        props = torch.cuda.get_device_properties(0)
        out["gpu"] = props.name
        out["capability"] = f"{props.major}.{props.minor}"
        out["driver"] = _driver_version()
        out["pinned_memory"] = pinned_memory_available()
    return out


def _gpu_uuid() -> str | None:
    try:
        return str(torch.cuda.get_device_properties(0).uuid)
    except (RuntimeError, AttributeError, AssertionError):
        return None


def require_cuda(what: str) -> None:
    """Raise a one-sentence CudaUnavailableError unless CUDA can be used (beside :func:`has_cuda`; re-exported by
    :mod:`pinlab.args`, where most modules import it from)."""
    if not has_cuda():
        raise CudaUnavailableError(
            f"{what} needs a CUDA GPU, and none is available here "
            "(on a CPU-only machine the notebooks replay the recorded GPU run instead)."
        )
