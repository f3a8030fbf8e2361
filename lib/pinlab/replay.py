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

from .args import bool_arg, callable_arg
from .device import facts, has_cuda
from .timing import show

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class ReplayMissingError(RuntimeError):
    """No recorded GPU result exists for an experiment on a machine without CUDA."""


class ReplayFileError(ReplayMissingError):
    """A recorded GPU result exists but cannot be used: unreadable, truncated, or of the wrong shape."""


_FIX = ("restore it with `git checkout -- reports/gpu/data` or re-run the GPU suite on a CUDA machine "
        "(make gpu-suite)")


def load_recorded(path) -> dict:
    """Read and validate one recorded result file: ``{"meta": {...}, "params": {...}, "result": ...}``.

    Raises :class:`ReplayMissingError` (missing file) or :class:`ReplayFileError` (unreadable,
    not JSON, truncated, or JSON of another shape), each one sentence naming the file and what
    to do. Returns the parsed dict.
    """
    path = Path(path)
    if not path.is_file():
        raise ReplayMissingError(f"The recorded GPU run {path} is missing: {_FIX}.")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ReplayFileError(f"The recorded GPU run {path} cannot be read ({type(exc).__name__}): {_FIX}.") from None
    if not text.strip():
        raise ReplayFileError(f"The recorded GPU run {path} is empty: {_FIX}.")
    try:
        stored = json.loads(text)
    except ValueError as exc:  # JSONDecodeError, or a number too large
        where = f"line {exc.lineno}" if hasattr(exc, "lineno") else "somewhere"
        raise ReplayFileError(
            f"The recorded GPU run {path} is not valid JSON (truncated or edited by hand? error at {where}): {_FIX}."
        ) from None
    problem = _shape_problem(stored)
    if problem:
        raise ReplayFileError(f"The recorded GPU run {path} has the wrong shape ({problem}): {_FIX}.")
    return stored


def _shape_problem(stored) -> str | None:
    if not isinstance(stored, dict):
        return f"a JSON {type(stored).__name__} instead of an object with meta, params and result"
    missing = [k for k in ("meta", "params", "result") if k not in stored]
    if missing:
        return f"no {', '.join(repr(k) for k in missing)} key"
    if not isinstance(stored["meta"], dict):
        return "'meta' is not an object"
    if not isinstance(stored["params"], dict):
        return "'params' is not an object"
    for key in ("gpu", "date"):
        if not isinstance(stored["meta"].get(key), str) or not stored["meta"][key]:
            return f"meta has no {key!r} string"
    return None


def check_recorded(directory=None) -> tuple[list[str], list[str]]:
    """(names of the valid recorded results, one sentence per broken file) under ``directory``
    (default :func:`data_dir`). Used by :func:`pinlab.doctor`."""
    directory = data_dir() if directory is None else Path(directory)
    good, broken = [], []
    if not directory.is_dir():
        return good, broken
    for path in sorted(directory.glob("*.json")):
        try:
            load_recorded(path)
        except ReplayMissingError as exc:
            broken.append(str(exc))
        else:
            good.append(path.stem)
    return good, broken


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
    #: why a machine with CUDA replays this experiment (a requirement it does not meet), else None
    reason: str | None = None

    def __post_init__(self):
        if not isinstance(self.name, str):
            raise TypeError(f"name must be a str, got {type(self.name).__name__}")
        if not isinstance(self.meta, dict):
            raise TypeError(f"meta must be a dict (gpu, date, ...), got {type(self.meta).__name__}")
        bool_arg("live", self.live)

    @property
    def label(self) -> str:
        gpu = self.meta.get("gpu") or "unknown GPU"
        if self.live:
            return f"measured now on {gpu}"
        why = self.reason or "no CUDA on this machine"
        return f"recorded on {gpu}, {self.meta.get('date', '?')} (replayed here: {why})"

    @property
    def tag(self) -> str:
        """A short form of :attr:`label` for plot titles: the GPU and the date it was measured on (a
        figure saved in a notebook outlives the run, so no "now"); "recorded" when replayed."""
        gpu = self.meta.get("gpu") or "unknown GPU"
        date = self.meta.get("date", "?")
        return f"{gpu}, {date}" if self.live else f"{gpu}, recorded {date}"

    def __getitem__(self, key):
        return self.result[key]


def _jsonable(obj):
    return json.loads(json.dumps(obj, default=lambda o: o.as_dict() if hasattr(o, "as_dict") else str(o)))


def measure(name: str, fn, *, quiet: bool = False, requires: dict | None = None, **params) -> Run:
    """Run ``fn(**params)`` on the GPU, or replay its recorded result without CUDA.

    ``params`` must be JSON-able; a replay checks that the recording used the same ones.
    ``requires`` (merged over :data:`pinlab.probe.REQUIREMENTS` for ``name``): what the experiment needs
    beyond a CUDA GPU (``gpu_trace``, ``vram_gib``, ``pinned_gib``, ``host_ram_gib``); where this machine
    does not meet one, the recorded run is replayed and labelled with the reason.
    Prints one ``[measured] source: ...`` line unless ``quiet``.
    """
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"name must be a short identifier like '01_bandwidth', got {name!r}"[:200])
    callable_arg("fn", fn)
    bool_arg("quiet", quiet)
    params = _jsonable(params)
    path = data_dir() / f"{name}.json"
    reasons = []
    if has_cuda():
        from .probe import REQUIREMENTS, unmet

        reasons = unmet({**REQUIREMENTS.get(name, {}), **(requires or {})})
    if has_cuda() and not reasons:
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
        stored = load_recorded(path)
        if stored["params"] != params:
            raise ReplayMissingError(
                f"The recorded GPU run for '{name}' used other parameters ({stored.get('params')}) "
                f"than this notebook asks for ({params}): re-run the GPU suite (make gpu-suite)."
            )
        run = Run(name, stored["result"], stored["meta"], live=False,
                  reason="; ".join(reasons) if reasons else None)
    if not quiet:
        show("source", run.label)
    return run
