"""Measure live on a GPU, or replay the latest recorded GPU run on a machine without CUDA.

Every experiment a notebook shows goes through :func:`measure`:

* with CUDA, the experiment runs now; when ``PINLAB_RECORD=1`` (the GPU suite sets it) its
  result is also written to ``reports/gpu/data/<name>.json``;
* without CUDA, the result recorded by the latest GPU suite run is loaded and labelled
  "recorded on <GPU>, <date>". Nothing is typed in or invented.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from .args import callable_arg
from .device import facts, has_cuda
from .timing import show

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class ReplayMissingError(RuntimeError):
    """No recorded GPU result exists for an experiment on a machine without CUDA."""


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def data_dir() -> Path:
    """Where recorded GPU results live (``PINLAB_DATA_DIR`` overrides)."""
    override = os.environ.get("PINLAB_DATA_DIR")
    return Path(override) if override else repo_root() / "reports" / "gpu" / "data"


def recording() -> bool:
    return os.environ.get("PINLAB_RECORD", "") not in ("", "0")


@dataclass
class Run:
    """The result of one experiment, measured now or replayed, with where it came from."""

    name: str
    result: object
    meta: dict
    live: bool

    @property
    def label(self) -> str:
        gpu = self.meta.get("gpu") or "unknown GPU"
        if self.live:
            return f"measured now on {gpu}"
        return f"recorded on {gpu}, {self.meta.get('date', '?')} (replayed here: no CUDA on this machine)"

    @property
    def tag(self) -> str:
        """A short form of :attr:`label` for plot titles."""
        gpu = self.meta.get("gpu") or "unknown GPU"
        return f"{gpu}, measured now" if self.live else f"{gpu}, recorded {self.meta.get('date', '?')}"

    def __getitem__(self, key):
        return self.result[key]


def _jsonable(obj):
    return json.loads(json.dumps(obj, default=lambda o: o.as_dict() if hasattr(o, "as_dict") else str(o)))


def measure(name: str, fn, *, quiet: bool = False, **params) -> Run:
    """Run ``fn(**params)`` on the GPU, or replay its recorded result without CUDA.

    ``params`` must be JSON-able; a replay checks that the recording used the same ones.
    Prints one ``[measured] source: ...`` line unless ``quiet``.
    """
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"name must be a short identifier like '01_bandwidth', got {name!r}")
    callable_arg("fn", fn)
    params = _jsonable(params)
    path = data_dir() / f"{name}.json"
    if has_cuda():
        result = _jsonable(fn(**params))
        f = facts()
        meta = {
            "gpu": f["gpu"], "driver": f["driver"], "torch": f["torch"], "cuda": f["cuda_runtime"],
            "flashinfer": f["flashinfer"], "python": f["python"],
            "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d"),
        }
        if recording():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"meta": meta, "params": params, "result": result}, indent=1) + "\n")
        run = Run(name, result, meta, live=True)
    else:
        if not path.exists():
            raise ReplayMissingError(
                f"No CUDA here and no recorded GPU run for '{name}' ({path} is missing): "
                "run the GPU suite on a CUDA machine (make gpu-suite) and commit reports/gpu/."
            )
        stored = json.loads(path.read_text())
        if stored.get("params") != params:
            raise ReplayMissingError(
                f"The recorded GPU run for '{name}' used other parameters ({stored.get('params')}) "
                f"than this notebook asks for ({params}): re-run the GPU suite (make gpu-suite)."
            )
        run = Run(name, stored["result"], stored["meta"], live=False)
    if not quiet:
        show("source", run.label)
    return run
