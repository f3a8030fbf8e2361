"""Measure live on a GPU, or replay the latest recorded GPU run on a machine without CUDA.

Every experiment a notebook shows goes through :func:`measure`:

* with CUDA, the experiment runs now; when ``PINLAB_RECORD=1`` (the GPU suite sets it) its
  result is also written to ``reports/gpu/data/<name>.json``;
* without CUDA, the result recorded by the latest GPU suite run is loaded and labelled
  "recorded on <GPU>, <date>". Nothing is typed in or invented.

Every reader of a recording (notebooks through :func:`measure`, exercises, solutions, checkers) goes
through :func:`load_recorded`, which refuses a broken file with one :class:`ReplayFileError` sentence
naming the file, what is wrong and ``git checkout -- <file>``. :func:`data_dir` finds the recordings in
``PINLAB_DATA_DIR``, the source checkout pinlab is imported from, the git checkout around the current
directory, or the copy a wheel ships (``pinlab/_recorded``); recordings are never written into an
installed package (:func:`record_dir`).

(Why about 540 lines: measuring, recording and replaying share one file format, and every way a recording
can be missing, stale or broken gets its own sentence, each tested.)
"""
from __future__ import annotations

import datetime as _dt
import errno
import json
import math
import os
import re
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .args import bool_arg, callable_arg
from .device import facts, has_cuda
from .timing import show

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class ReplayMissingError(RuntimeError):
    """No recorded GPU result exists for an experiment on a machine without CUDA."""


class ReplayFileError(ReplayMissingError):
    """A recorded GPU result exists but cannot be used: unreadable, too large, not JSON, of the wrong shape, holding
    NaN or infinity, of another experiment, or not matching the structure it was recorded with."""


class RecordingError(RuntimeError):
    """A live result cannot be recorded: nowhere to write it but an installed package, or a result a replay would
    refuse (NaN/infinity, too large)."""


#: the largest recorded file a replay reads (the largest recording is a few hundred KiB)
MAX_RECORDED_BYTES = 20 * 2**20
#: the folder pinlab is imported from (lib/pinlab in a checkout, site-packages/pinlab when installed)
PACKAGE_DIR = Path(__file__).resolve().parent


def restore_command(path) -> str:
    """The git command that restores the recording ``path`` (a ``.json`` file): ``git checkout -- <file>``,
    the file named from the root of the checkout it lies in (``reports/gpu/data/<file>``, and which checkout),
    else by its path. Symbolic links are not followed (a link that loops names itself)."""
    path = Path(path)
    root = os.path.abspath(repo_root())
    where = os.path.abspath(path)
    try:
        inside = os.path.commonpath([where, root]) == root
    except ValueError:  # another drive
        inside = False
    if inside and where != root:
        return f"`git checkout -- {Path(os.path.relpath(where, root)).as_posix()}` (in {root})"
    return f"`git checkout -- {path}`"


def _fix(path: Path) -> str:
    if path.suffix != ".json" or path.name == ".json":
        # not a recording's file ('', a folder, ...): checking it out would discard whatever the learner changed
        return ("give load_recorded an experiment's name (such as '01_bandwidth') or the path of its .json file "
                "under reports/gpu/data")
    if _is_within(path, PACKAGE_DIR) and _source_checkout() is None:  # data shipped in an installed package
        return ("reinstall pinlab to restore it, or run the course from a git checkout of it "
                "(git clone, then make lab)")
    return f"restore it with {restore_command(path)} or re-run the GPU suite on a CUDA machine (make gpu-suite)"


def _broken(path: Path, what: str) -> ReplayFileError:
    what = " ".join(str(what).split())  # one line, whatever the file held
    if len(what) > 240:
        what = what[:237] + "..."
    return ReplayFileError(f"The recorded GPU run {path} {what}: {_fix(path)}.")


def load_recorded(path_or_name) -> dict:
    """Read and validate one recorded result: ``{"meta": {...}, "params": {...}, "result": ...}``.

    ``path_or_name`` is a file, or an experiment's name (``"01_bandwidth"``: the file
    ``data_dir() / "01_bandwidth.json"``). The one way notebooks (:func:`measure`), exercises, solutions and
    checkers read a recording. Checks, before anything uses the data: the file is at most
    :data:`MAX_RECORDED_BYTES` (refused before it is read), UTF-8 JSON of that shape, with no NaN or
    infinity anywhere; where the recording names its experiment (``meta["name"]``, written by
    :func:`measure` since issue 19) the file is that experiment's, and where it carries the structure of its
    result (``meta["schema"]``, :func:`result_schema`) the result still has it (no key missing, no
    type changed, no row dropped). Files recorded before either was written are checked without them.

    Raises :class:`ReplayMissingError` (missing file) or :class:`ReplayFileError` (a folder, a symbolic link
    that loops, ...): one sentence naming the file, what is wrong and how to restore it
    (``git checkout -- reports/gpu/data/<file>``, :func:`restore_command`; never for what is not a recording's
    ``.json`` file). An empty name is a ValueError. Returns the parsed dict.
    """
    if isinstance(path_or_name, str) and _NAME.match(path_or_name) and not path_or_name.endswith(".json"):
        path = data_dir() / f"{path_or_name}.json"
    elif isinstance(path_or_name, (str, os.PathLike)):
        if not str(os.fspath(path_or_name)).strip():
            raise ValueError("path_or_name must be an experiment name (such as '01_bandwidth') or the path of its "
                             f".json file, got {path_or_name!r}")
        path = Path(path_or_name)
    else:
        raise TypeError(f"path_or_name must be an experiment name or a path, got {type(path_or_name).__name__}")
    try:
        st = path.stat()
    except FileNotFoundError:
        dangling = " (a symbolic link to a file that does not exist)" if path.is_symlink() else ""
        raise ReplayMissingError(f"The recorded GPU run {path} is missing{dangling}: {_fix(path)}.") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _broken(path, "is a symbolic link that loops (it leads back to itself, never to a file)") from None
        raise _broken(path, f"cannot be read ({type(exc).__name__})") from None
    if not stat.S_ISREG(st.st_mode):
        raise _broken(path, "is a folder, not a recording" if stat.S_ISDIR(st.st_mode)
                      else "is not a regular file (a recording is a .json file)")
    try:
        size = st.st_size
        if size > MAX_RECORDED_BYTES:
            raise _broken(path, f"is {size / 2**20:.0f} MiB, over the {MAX_RECORDED_BYTES >> 20} MiB a recording "
                                "may hold (it was not written by the GPU suite)")
        with open(path, "rb") as fh:
            raw = fh.read(MAX_RECORDED_BYTES + 1)
    except OSError as exc:
        raise _broken(path, f"cannot be read ({type(exc).__name__})") from None
    if len(raw) > MAX_RECORDED_BYTES:  # grew while read, or a special file
        raise _broken(path, f"holds over the {MAX_RECORDED_BYTES >> 20} MiB a recording may hold")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _broken(path, f"cannot be read (not UTF-8 text: binary garbage at byte {exc.start})") from None
    if not text.strip():
        raise _broken(path, "is empty")
    try:
        stored = json.loads(text)
    except RecursionError:
        raise _broken(path, "is JSON nested too deeply to be a recording") from None
    except ValueError as exc:  # JSONDecodeError, or a number too large
        where = f"line {exc.lineno}, column {exc.colno}" if hasattr(exc, "lineno") else "somewhere"
        raise _broken(path, f"is not valid JSON (truncated or edited by hand? error at {where})") from None
    try:
        problem = _problem(stored, path.stem)
    except RecursionError:
        problem = "is JSON nested too deeply to be a recording"
    if problem:
        raise _broken(path, problem)
    return stored


def _problem(stored, name: str) -> str | None:
    """What is wrong with a parsed recording of experiment ``name`` (the file's stem), or None."""
    if not isinstance(stored, dict):
        return f"has the wrong shape (a JSON {type(stored).__name__} instead of an object with meta, params and result)"
    missing = [k for k in ("meta", "params", "result") if k not in stored]
    if missing:
        return f"has the wrong shape (no {', '.join(repr(k) for k in missing)} key)"
    meta = stored["meta"]
    if not isinstance(meta, dict):
        return "has the wrong shape ('meta' is not an object)"
    if not isinstance(stored["params"], dict):
        return "has the wrong shape ('params' is not an object)"
    for key in ("gpu", "date"):
        if not isinstance(meta.get(key), str) or not meta[key]:
            return f"has the wrong shape (meta has no {key!r} string)"
    bad = _non_finite(stored)
    if bad:
        return f"holds {bad[1]} at {bad[0]} (a recording holds finite numbers only)"
    if "name" in meta and meta["name"] != name:
        return (f"holds the result of another experiment ({meta['name']!r}, not {name!r}: "
                "a file copied over this one?)")
    if "schema" in meta:
        diff = schema_difference(meta["schema"], result_schema(stored["result"]))
        if diff:
            return f"does not have the structure it was recorded with ({diff})"
    return None


def _non_finite(value) -> tuple[str, str] | None:
    """(where, "NaN"/"infinity") of the first non-finite number in ``value``, or None."""
    todo = [(value, "")]
    while todo:
        v, where = todo.pop()
        if isinstance(v, float) and not math.isfinite(v):
            return where or "the top level", "NaN" if math.isnan(v) else "infinity"
        if isinstance(v, dict):
            todo.extend((x, f"{where}[{k!r}]") for k, x in reversed(list(v.items())))
        elif isinstance(v, list):
            todo.extend((x, f"{where}[{i}]") for i, x in reversed(list(enumerate(v))))
    return None


def result_schema(value):
    """A compact structural fingerprint of a JSON value, as :func:`measure` records it in ``meta["schema"]``:
    ``"num"``, ``"str"``, ``"bool"`` or ``"null"`` for a scalar; for an object, an object with the same keys
    and the fingerprint of each value; for a list, ``[length, fingerprint, ...]`` with each distinct element
    fingerprint once, in order of first appearance (a sweep of 21 rows of one shape: ``[21, {...}]``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "num"
    if isinstance(value, str):
        return "str"
    if isinstance(value, dict):
        return {str(k): result_schema(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        kinds, seen = [], set()
        for v in value:
            s = result_schema(v)
            key = json.dumps(s, sort_keys=True)
            if key not in seen:
                seen.add(key)
                kinds.append(s)
        return [len(value), *kinds]
    raise TypeError(f"value must be JSON data (dict, list, str, number, bool, None), got {type(value).__name__}")


def _kind(schema) -> str:
    if isinstance(schema, dict):
        return "an object"
    if isinstance(schema, list):
        return "a list"
    return {"num": "a number", "str": "a string", "bool": "a boolean", "null": "null"}.get(schema, repr(schema))


def schema_difference(recorded, now, where: str = "result") -> str | None:
    """The first way ``now`` (a :func:`result_schema`) differs from ``recorded``, in words, or None."""
    if isinstance(recorded, dict) and isinstance(now, dict):
        for k in recorded:
            if k not in now:
                return f"{where}[{k!r}] is missing"
        for k in now:
            if k not in recorded:
                return f"{where}[{k!r}] was not recorded"
        for k in recorded:
            diff = schema_difference(recorded[k], now[k], f"{where}[{k!r}]")
            if diff:
                return diff
        return None
    if isinstance(recorded, list) and isinstance(now, list):
        if not recorded or not isinstance(recorded[0], int):
            return f"the recorded structure of {where} is not a fingerprint (meta['schema'] edited by hand?)"
        if recorded[0] != now[0]:
            return f"{where} has {now[0]} items, recorded with {recorded[0]}"
        if len(recorded) == len(now) == 2:
            return schema_difference(recorded[1], now[1], f"{where}[*]")
        keys = {json.dumps(s, sort_keys=True) for s in recorded[1:]}
        if any(json.dumps(s, sort_keys=True) not in keys for s in now[1:]) or len(now) != len(recorded):
            return f"an item of {where} has another structure than recorded"
        return None
    if recorded != now:
        return f"{where} is {_kind(now)}, recorded as {_kind(recorded)}"
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


# ------------------------------------------------------------------ where recordings live

def _is_within(path: Path, folder: Path) -> bool:
    try:
        Path(path).resolve().relative_to(Path(folder).resolve())
        return True
    except (ValueError, OSError, RuntimeError):  # RuntimeError: a symbolic link loop (Python < 3.13)
        return False


def _source_checkout() -> Path | None:
    """The source tree this package is imported from (an editable install or PYTHONPATH=lib): the folder
    holding ``pyproject.toml`` and ``lib/pinlab``; None for an installed copy (site-packages)."""
    root = PACKAGE_DIR.parent.parent
    if PACKAGE_DIR.parent.name == "lib" and (root / "pyproject.toml").is_file():
        return root
    return None


def _cwd_checkout() -> Path | None:
    """The git checkout around the current directory, if it holds recorded GPU runs."""
    try:
        here = Path.cwd().resolve()
    except OSError:
        return None
    for d in (here, *here.parents):
        if (d / ".git").exists():
            return d if (d / "reports" / "gpu" / "data").is_dir() else None
    return None


def _package_data() -> Path:
    """Where a wheel of pinlab ships the recorded GPU run (pyproject.toml: package ``pinlab._recorded``,
    mapped to ``reports/gpu``)."""
    return PACKAGE_DIR / "_recorded" / "data"


def data_location() -> tuple[Path, str]:
    """(the folder of recorded GPU results, where it was found): the first of ``PINLAB_DATA_DIR`` ("env"),
    the source checkout pinlab is imported from ("checkout"), the git checkout around the current
    directory when it has ``reports/gpu/data`` ("cwd"), the recorded run shipped in an installed
    wheel ("package"); else ("none") the place a wheel would hold it, which does not exist."""
    override = os.environ.get("PINLAB_DATA_DIR")
    if override:
        return Path(override), "env"
    root = _source_checkout()
    if root is not None:
        return root / "reports" / "gpu" / "data", "checkout"
    root = _cwd_checkout()
    if root is not None:
        return root / "reports" / "gpu" / "data", "cwd"
    return _package_data(), "package" if _package_data().is_dir() else "none"


def data_dir() -> Path:
    """Where recorded GPU results live (see :func:`data_location`; ``PINLAB_DATA_DIR`` overrides)."""
    return data_location()[0]


def repo_root() -> Path:
    """The course's checkout: the source tree pinlab is imported from, else the git checkout around the
    current directory, else the current directory (never an installed package's folder)."""
    root = _source_checkout() or _cwd_checkout()
    if root is not None:
        return root
    try:
        return Path.cwd()
    except OSError:
        return Path.home()


def _installed_dirs() -> list[Path]:
    """Folders of installed packages (site-packages): never written by a recording."""
    import site
    import sysconfig

    dirs = {sysconfig.get_paths().get(k) for k in ("purelib", "platlib")}
    try:
        dirs.update(site.getsitepackages())
    except AttributeError:  # some virtualenvs
        pass
    dirs.add(site.getusersitepackages() if hasattr(site, "getusersitepackages") else None)
    if _source_checkout() is None:
        dirs.add(str(PACKAGE_DIR))
    return [Path(d) for d in dirs if d]


def record_dir() -> Path:
    """Where :func:`measure` writes a recording (``PINLAB_RECORD=1``): :func:`data_dir`, unless that is
    inside an installed package or site-packages (:class:`RecordingError`)."""
    where, kind = data_location()
    inside = next((d for d in _installed_dirs() if _is_within(where, d)), None)
    if kind in ("package", "none") or inside is not None:
        raise RecordingError(
            f"PINLAB_RECORD=1 would write recordings into {where}, inside an installed package: recordings go "
            "into a git checkout of the course (run from one, with pinlab installed from it: pip install -e .) "
            "or into PINLAB_DATA_DIR.")
    return where


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


def _record(path: Path, name: str, meta: dict, params: dict, result) -> None:
    """Write one recording, with its experiment's name and the structure of its result
    (``meta["name"]``, ``meta["schema"]``: :func:`load_recorded` checks both), refusing what a replay
    would refuse."""
    bad = _non_finite(result)
    if bad:
        raise RecordingError(f"'{name}' returned {bad[1]} at result{bad[0]}: a replay refuses non-finite numbers, "
                             "so it is not recorded (return None, or leave the entry out, where there is no number)")
    meta = {**meta, "name": name, "schema": result_schema(result)}
    text = json.dumps({"meta": meta, "params": params, "result": result}, indent=1) + "\n"
    if len(text.encode("utf-8")) > MAX_RECORDED_BYTES:
        raise RecordingError(f"'{name}' returned {len(text) / 2**20:.0f} MiB of JSON, over the "
                             f"{MAX_RECORDED_BYTES >> 20} MiB a replay reads: record a summary")
    path.parent.mkdir(parents=True, exist_ok=True)
    # a fresh temporary file of its own (O_CREAT | O_EXCL: nothing planted at its name is followed), renamed over
    # the recording (a symbolic link at the recording's name is replaced, not written through): never a
    # half-written recording, and no write outside the data folder
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            os.fchmod(fh.fileno(), 0o644)  # as a file written by the suite would be (mkstemp makes it 0600)
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def measure(name: str, fn, *, quiet: bool = False, requires: dict | None = None, **params) -> Run:
    """Run ``fn(**params)`` on the GPU, or replay its recorded result without CUDA.

    ``params`` must be JSON-able; a replay checks that the recording used the same ones.
    ``requires`` (merged over :data:`pinlab.probe.REQUIREMENTS` for ``name``): what the experiment needs
    beyond a CUDA GPU (``gpu_trace``, ``flashinfer``, ``vram_gib``, ``pinned_gib``, ``host_ram_gib``); where this
    machine does not meet one, the recorded run is replayed and labelled with the reason.
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
        from .probe import suite_pass

        result = _jsonable(fn(**params))
        f = facts()
        meta = {
            "gpu": f["gpu"], "driver": f["driver"], "torch": f["torch"], "cuda": f["cuda_runtime"],
            "flashinfer": f["flashinfer"], "python": f["python"],
            "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d"),
            # which pass of the GPU suite measured it ($PINLAB_SUITE_PASS; None outside the suite): the committed
            # recordings come from its quiet reference pass (tests/test_evidence.py checks it)
            "suite_pass": suite_pass(),
        }
        if recording():
            _record(record_dir() / f"{name}.json", name, meta, params, result)
        run = Run(name, result, meta, live=True)
    else:
        if not path.exists() and not path.is_symlink():  # a link that loops or leads nowhere: load_recorded says so
            where = "" if data_location()[1] != "none" else (
                " (this installed pinlab ships no recorded run: run the course from a git checkout of it, "
                "or point PINLAB_DATA_DIR at a reports/gpu/data folder)")
            restore = "" if where else f"restore it with {restore_command(path)}, or "
            raise ReplayMissingError(
                f"No CUDA here and no recorded GPU run for '{name}' ({path} is missing{where}): "
                f"{restore}run the GPU suite on a CUDA machine (make gpu-suite) and commit reports/gpu/."
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


def measure_if_recorded(name: str, fn, **kwargs) -> Run | None:
    """:func:`measure`, except where a machine without CUDA has **no recording** of this experiment yet (a new
    experiment, until the GPU suite has run it) or one made with other parameters: then one ``[measured]
    source`` line says so, in one sentence, and the result is None, so that the notebook skips what depends on
    it instead of stopping with a traceback. A broken recording still raises :class:`ReplayFileError`."""
    try:
        return measure(name, fn, **kwargs)
    except ReplayFileError:
        raise
    except ReplayMissingError as exc:
        why = "was recorded with other parameters" if "other parameters" in str(exc) else "has no recorded GPU run yet"
        show("source", f"no CUDA here, and '{name}' {why}: this section shows its results after the next GPU "
                       "suite run (make gpu-suite); the cells below that need them print nothing")
        return None
