"""The GPU evidence's pure logic (no GPU, no kernel): used by tools/gpu_suite.py and by the tests.

* Freshness: a notebook's entry in ``reports/gpu/latest.json`` or ``reports/gpu/stability.json`` holds for
  the current tree while its ``source_sha256`` (nbtools.source_sha256) and its ``deps_sha256`` (sha256 over
  the ``deps``, the lib/ files the notebook imported when it ran; nbtools.deps_sha256) are unchanged.
* Merging: a partial run (``--only``) replaces its notebooks' entries and keeps the others while fresh.
* Stability: every execution of a notebook by the suite is a run, and so is its nbval pass (stored in
  stability.json, added to the runs already there while the notebook's source and deps are unchanged); the
  runs give, per code cell that asserts, how many passed it (a run that failed in an earlier cell did not
  pass it), and per ``[measured]``/``[timing]`` line (cell index + label) the min / median / max of each
  number in it. An nbval run (``"via": "nbval"``) comes from conftest.py's capture ($PINLAB_NBVAL_CAPTURE):
  :func:`nbval_outcome`, :func:`add_nbval_runs`.
* Adverse conditions (``tools/gpu_suite.py --adverse``, reports/gpu/adverse.json): the conditions an H200
  imitates (:data:`ADVERSE_CONDITIONS`), one nbval pass's counts from the capture (:func:`adverse_notebook_run`),
  merging (:func:`merge_adverse`) and the check that every cell passed under each (:func:`adverse_problems`).
* The nbval pass: one pytest run for every notebook and the ``gpu`` unit tests; conftest.py writes one JSON
  line per test phase to $PINLAB_PYTEST_LOG, read back here per notebook and for the unit tests.
"""
from __future__ import annotations

import hashlib
import io
import json
import re
import statistics
import tokenize
from pathlib import Path

import nbtools

ROOT = nbtools.ROOT
TIME_UNITS_MS = {"ns": 1e-6, "µs": 1e-3, "μs": 1e-3, "us": 1e-3, "ms": 1.0, "s": 1000.0}
_LINE = re.compile(r"^(?P<kind>\[measured\]|\[timing\]) (?P<label>[^:]*):(?P<value>.*)$")
_NUMBER = re.compile(r"(?<![\w.])(?P<num>[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)"
                     r"(?:\s?(?P<unit>ns|µs|μs|us|ms|s|%|x|×|KiB|MiB|GiB|kB|MB|GB/s|GB|B)(?![A-Za-z/]))?")


# ---- freshness and merging ------------------------------------------------------------------------------

#: Inputs of a process a notebook's code starts (the kernel's imports, which the suite records as ``deps``, do
#: not see them), per notebook: folders stand for every file under them. They are deps of its quiet pass like
#: the lib files it imports (plumbing: its stability and adverse runs carry forward where the quiet pass claims
#: what they claimed). Lesson 07 runs the pytest gate on the sample suite in a fresh pytest process, which imports
#: the gate and the detectors its kernel does not (tests/test_evidence.py checks the list against that process).
SUBPROCESS_INPUTS: dict[str, tuple[str, ...]] = {
    "notebooks/07_capstone_audit.ipynb": ("lib/pinlab_pytest.py", "lib/pinlab/order.py", "lib/pinlab/races.py",
                                          "examples/race_gate"),
}


def subprocess_inputs(rel: str, root: Path = ROOT) -> list[str]:
    """The files (relative to ``root``, sorted) of :data:`SUBPROCESS_INPUTS` for the notebook ``rel``."""
    out = set()
    for item in SUBPROCESS_INPUTS.get(rel, ()):
        path = root / item
        if path.is_dir():
            out |= {f.relative_to(root).as_posix() for f in path.rglob("*")
                    if f.is_file() and "__pycache__" not in f.parts and ".pytest_cache" not in f.parts}
        else:
            out.add(item)
    return sorted(out)


def freshness(entry: dict, root: Path = ROOT) -> str | None:
    """None if ``entry`` (a notebook's entry in a GPU report) holds for the current files, else why not."""
    rel = entry.get("path", "?")
    path = root / rel
    if not path.exists():
        return f"{rel} no longer exists"
    if entry.get("source_sha256") != nbtools.source_sha256(nbtools.load(path)):
        return f"{rel} changed after its GPU run"
    deps = entry.get("deps")
    if not deps or "deps_sha256" not in entry:
        return f"{rel} has no deps/deps_sha256 recorded (run before the suite recorded them)"
    missing = [d for d in deps if not (root / d).exists()]
    if missing:
        return f"{rel}: lib files it imported are gone: {', '.join(missing)}"
    unrecorded = [f for f in subprocess_inputs(rel, root) if f not in deps]
    if unrecorded:
        return (f"{rel}: recorded without {', '.join(unrecorded)}, input(s) of a process it runs "
                "(evidence.SUBPROCESS_INPUTS)")
    if entry["deps_sha256"] != nbtools.deps_sha256(deps, root):
        changed = nbtools.changed_files(entry["deps_files"], root) if entry.get("deps_files") else []
        if changed:
            return f"{rel}: lib files it imports changed after its GPU run: {', '.join(changed)}"
        return f"{rel}: a lib file it imports changed after its GPU run (one of {', '.join(deps)})"
    return None


def merge_entries(old: list[dict], new: list[dict], keep_paths, root: Path = ROOT,
                  stale=None) -> tuple[list[dict], list[str]]:
    """``new`` entries, plus the ``old`` ones for other notebooks in ``keep_paths`` that still hold (``stale``:
    entry -> why it does not hold, or None; :func:`freshness` unless given: scope.stale_check for the runs).

    Returns (entries sorted by path, reasons for the old entries dropped)."""
    stale = (lambda e: freshness(e, root)) if stale is None else stale
    by_path = {e["path"]: e for e in new}
    dropped = []
    for e in old:
        if e.get("path") in by_path:
            continue
        if e.get("path") not in keep_paths:
            dropped.append(f"{e.get('path')}: not a notebook of the suite any more")
            continue
        why = stale(e)
        if why:
            dropped.append(why)
        else:
            by_path[e["path"]] = e
    return [by_path[p] for p in sorted(by_path)], dropped


# ---- what a cell asserts, what it measured -------------------------------------------------------------------

def _source(cell) -> str:
    src = cell["source"]
    return "".join(src) if isinstance(src, list) else src


#: a check a lesson makes: ``pinlab.claim(...)`` / ``pinlab.claims(...)`` (CONTRIBUTING, assertion policy)
_CLAIM = re.compile(r"\bpinlab\.claims?\(")


def asserts(source: str) -> bool:
    """Whether code checks something: an ``assert`` statement or a ``pinlab.claim``/``pinlab.claims`` call
    (not in a comment or string)."""
    try:
        toks = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):  # IPython magics and the like
        return any(re.match(r"\s*assert\b", line) or _CLAIM.search(line.split("#")[0])
                   for line in source.splitlines())
    names = [t.string for t in toks if t.type in (tokenize.NAME, tokenize.OP)]
    return "assert" in names or any(names[k:k + 4] in (["pinlab", ".", "claim", "("], ["pinlab", ".", "claims", "("])
                                    for k in range(len(names)))


def check_line(source: str) -> str:
    """The first line of a cell that checks something (what stability.json shows for it)."""
    return next((ln.strip() for ln in source.splitlines()
                 if re.match(r"\s*assert\b", ln) or _CLAIM.search(ln.split("#")[0])), "")


def cell_passed(run: dict, cell: int) -> bool:
    """Whether one stored run passed a checking cell: listed in its ``passed``; or, for a cell that run did
    not list either way (a run stored before the cell was recognised as checking: the claims of issue 18),
    whether the run reached past it without an error (no first error, or a first error after the cell)."""
    if cell in run.get("passed", []):
        return True
    if cell in run.get("failed", []):
        return False
    first = run.get("first_error")
    return first is None or cell < first.get("cell", -1)


def assert_cells(nb: dict) -> list[int]:
    """Indices (in nb["cells"]) of the code cells that assert."""
    return [i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code" and asserts(_source(c))]


def numbers_of(value: str) -> list[tuple[float, str | None]]:
    """The numbers in a printed value with their units; durations converted to ms (``fmt_ms`` switches
    between ns, µs, ms and s as the value changes)."""
    out = []
    for m in _NUMBER.finditer(value):
        x, unit = float(m.group("num")), m.group("unit")
        if unit in TIME_UNITS_MS:
            x, unit = x * TIME_UNITS_MS[unit], "ms"
        out.append((x, unit))
    return out


_CONTINUATION = re.compile(r"^ {11}\S")  # a [measured]/[timing] line wrapped onto the next (pinlab.timing.wrapped)


def _unwrapped(stdout: str) -> list[str]:
    """The printed lines with each wrapped ``[measured]``/``[timing]`` line joined back into one."""
    out: list[str] = []
    in_machine_line = False
    for line in stdout.splitlines():
        if in_machine_line and _CONTINUATION.match(line):
            out[-1] += " " + line.strip()
            continue
        in_machine_line = line.startswith(("[measured]", "[timing]"))
        out.append(line)
    return out


def machine_lines(nb: dict, cells=None) -> list[dict]:
    """Every ``[measured]``/``[timing]`` line printed (stdout) by the code cells (those in ``cells`` if given):
    [{cell, kind, label, occurrence, text}], ``occurrence`` counting repeats of one label in one cell."""
    out = []
    for i, c in enumerate(nb["cells"]):
        if c["cell_type"] != "code" or (cells is not None and i not in cells):
            continue
        seen: dict = {}
        for line in _unwrapped(nbtools._stdout(c)):
            m = _LINE.match(line.strip())
            if not m:
                continue
            key = (m.group("kind"), m.group("label").strip())
            k = seen[key] = seen.get(key, -1) + 1
            out.append({"cell": i, "kind": m.group("kind"), "label": key[1], "occurrence": k,
                        "value": m.group("value").strip()})
    return out


# ---- what a notebook claims ------------------------------------------------------------------------------------

_CLAIM_LINE = re.compile(r"^(?P<text>\S.*?): (?P<value>True|False|[-+]?\d+|tensor\([-+]?\d+\))$")
_VERDICT = ("✅", "❌", "⏳")


def _claim_lines(stdout: str) -> list[str]:
    """The printed lines with wrapped ones joined back (a claim continues with 4 spaces, a verdict with 3,
    a [measured]/[timing] line with 11); machine-dependent lines left out."""
    out: list = []
    for line in stdout.splitlines():
        if re.match(r"^ {11}\S", line):
            continue  # a wrapped [measured]/[timing] line
        if re.match(r"^ {3,4}\S", line) and out and out[-1] is not None:
            out[-1] += " " + line.strip()
            continue
        if line.startswith(("[measured]", "[timing]")):
            out.append(None)
            continue
        out.append(line)
    return [ln for ln in out if ln]


def claims_of_cells(stdouts: dict[int, str], nb: dict) -> list[list]:
    """What the notebook claims, from each code cell's stdout (``stdouts``: {cell index: text}): per asserting cell
    (evidence.assert_cells) its claim lines ``text: value`` (value a bool or an exact count), per code cell its
    checker verdicts (the verdict's words and its mark, ✅ / ❌ / ⏳): ``[[cell, "claim", text, value] | [cell,
    "verdict", words, mark], ...]``. Machine-dependent lines are not claims (nbval masks them)."""
    asserting = set(assert_cells(nb))
    out = []
    for i in sorted(stdouts):
        for line in _claim_lines(stdouts[i]):
            s = line.strip()
            if s.startswith(_VERDICT):
                out.append([i, "verdict", s[1:].strip(), s[0]])
            elif i in asserting:
                m = _CLAIM_LINE.match(s)
                if m:
                    out.append([i, "claim", m.group("text"), m.group("value")])
    return out


def claims_of(nb: dict) -> list[list]:
    """:func:`claims_of_cells` of an executed notebook's outputs."""
    return claims_of_cells({i: nbtools._stdout(c) for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"}, nb)


def claims_of_capture(records: list[dict], nb: dict) -> list[list]:
    """:func:`claims_of_cells` of one nbval pass (conftest.py's capture records of the notebook)."""
    return claims_of_cells({r["cell"]: r.get("stdout") or "" for r in records if r.get("cell") is not None}, nb)


def claims_sha256(claims: list) -> str:
    """A short hash of a claim list (:func:`claims_of`): what a run and a stability or adverse entry keep of it
    (latest.json keeps the list itself)."""
    text = json.dumps(claims, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def claim_differences(before: list, after: list, limit: int = 5) -> list[str]:
    """How two claim lists differ, in words (empty: the same claims, values and verdicts)."""
    if before == after:
        return []
    b = {(c[0], c[1], c[2]): c[3] for c in before}
    a = {(c[0], c[1], c[2]): c[3] for c in after}
    out = []
    for key in sorted(set(b) | set(a), key=lambda k: (k[0], k[1], k[2])):
        cell, kind, text = key
        what = "verdict" if kind == "verdict" else "claim"
        if key not in a:
            out.append(f"cell {cell}: {what} {text!r} is gone")
        elif key not in b:
            out.append(f"cell {cell}: new {what} {text!r}")
        elif a[key] != b[key]:
            out.append(f"cell {cell}: {what} {text!r} was {b[key]}, now {a[key]}")
    if not out:
        out.append("the same claims in another order or repeated another number of times")
    return out[:limit] + ([f"and {len(out) - limit} more"] if len(out) > limit else [])


def run_outcome(nb: dict) -> dict:
    """One execution's result, JSON as stored in stability.json's ``runs``: {first_error, passed, failed, lines}.
    ``passed``/``failed`` list the asserting cells; a cell after the first failing cell, or one that never ran
    (a timeout, a dead kernel), did not pass, whatever it printed; lines come from the cells that ran without
    an error."""
    errors = nbtools.cell_errors(nb)
    first = errors[0]["cell"] if errors else None
    bad = {e["cell"] for e in errors}
    ok_cells = {i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code" and i not in bad}
    ran = {i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code" and c.get("execution_count") is not None}
    cells = assert_cells(nb)
    ok = [i for i in cells if i in ran and (first is None or i < first)]
    return {
        "first_error": dict(errors[0], evalue=errors[0]["evalue"][:300]) if errors else None,
        "passed": ok,
        "failed": [i for i in cells if i not in ok],
        "lines": machine_lines(nb, ok_cells),
        "claims_sha256": claims_sha256(claims_of(nb)),
    }


def read_nbval_capture(lines) -> dict:
    """conftest.py's $PINLAB_NBVAL_CAPTURE lines, grouped by notebook path: {path: [cell records]}."""
    out: dict = {}
    for rec in read_pytest_log(lines):
        if isinstance(rec, dict) and rec.get("path") is not None:
            out.setdefault(rec["path"], []).append(rec)
    return out


def nbval_outcome(cells: list[dict], nb: dict) -> dict:
    """One nbval pass over a notebook as a run, the form of :func:`run_outcome`: ``cells``, the capture's
    records of that notebook (conftest.py), ``nb`` the notebook nbval ran (its source is that of the capture).

    An asserting cell passed if its nbval item passed and no code cell before it failed or errored (an output
    mismatch included); a cell after a failure, skipped or not captured, did not pass. ``first_error`` is the
    first cell that failed: its error output, or nbval's message (``ename`` "nbval", e.g. outputs differ).
    ``lines`` come from the captured cells whose fresh outputs hold no error (a ``raises-exception`` cell's
    expected error aside), as an execution's do."""
    by_cell = {c["cell"]: c for c in cells if c.get("cell") is not None}
    bad = sorted(i for i, c in by_cell.items() if c.get("outcome") in ("failed", "error"))
    first = bad[0] if bad else None
    asserting = assert_cells(nb)
    ok = [i for i in asserting if by_cell.get(i, {}).get("outcome") == "passed" and (first is None or i < first)]
    first_error = None
    if first is not None:
        c = by_cell[first]
        e = c.get("error") or {"ename": "nbval", "evalue": c.get("message") or c.get("outcome", "")}
        first_error = {"cell": first, "ename": e.get("ename", ""), "evalue": str(e.get("evalue", ""))[:300]}
    fresh = {"cells": []}
    for i, cell in enumerate(nb["cells"]):
        rec = by_cell.get(i)
        expected = "raises-exception" in cell.get("metadata", {}).get("tags", [])
        if cell["cell_type"] != "code" or rec is None or (rec.get("error") and not expected):
            fresh["cells"].append({"cell_type": "markdown", "source": ""})
        else:
            fresh["cells"].append({"cell_type": "code", "source": "",
                                   "outputs": [{"output_type": "stream", "name": "stdout", "text": rec.get("stdout") or ""}]})
    return {"via": "nbval", "first_error": first_error, "passed": ok,
            "failed": [i for i in asserting if i not in ok], "lines": machine_lines(fresh),
            "claims_sha256": claims_sha256(claims_of_capture(cells, nb))}


def add_nbval_runs(entries: list[dict], capture: dict, meta: dict, utc: str, root: Path = ROOT) -> tuple[dict, list[str]]:
    """Add each notebook's nbval pass (``capture``: :func:`read_nbval_capture`) to its stability entry of this
    run (``entries``, changed in place) as one more run, where it holds: the source nbval ran is the entry's,
    and the entry is fresh now (its deps unchanged since the executions). Returns ({path: runs added}, why
    the others were not added)."""
    added, skipped = {}, []
    for e in entries:
        cells = capture.get(e["path"])
        if not cells:
            skipped.append(f"{e['path']}: nbval left no capture of it (not in the nbval pass, or no cell ran)")
            continue
        shas = {c.get("source_sha256") for c in cells}
        if shas != {e.get("source_sha256")}:
            skipped.append(f"{e['path']}: nbval ran another source than the executions")
            continue
        why = freshness(e, root)
        if why:
            skipped.append(why)
            continue
        run = nbval_outcome(cells, nbtools.load(root / e["path"]))
        e["runs"].append({"utc": utc, "gpu": meta.get("gpu"),
                          "seconds": round(sum(c.get("seconds") or 0.0 for c in cells), 1), **run})
        added[e["path"]] = 1
    return added, skipped


def _round(x: float) -> float:
    return float(f"{x:.4g}")


def aggregate_stability(runs: list[dict], nb: dict) -> dict:
    """Aggregate N :func:`run_outcome` results (or stored runs) of one notebook (``nb``: its current form)."""
    n = len(runs)
    cells = []
    for i in assert_cells(nb):
        cells.append({"cell": i, "passed": sum(cell_passed(r, i) for r in runs), "of": n,
                      "assert": check_line(_source(nb["cells"][i]))[:160]})
    groups: dict = {}
    for r in runs:
        for ln in r["lines"]:
            groups.setdefault((ln["cell"], ln["kind"], ln["label"], ln["occurrence"]), []).append(ln["value"])
    measured = []
    for (cell, kind, label, occ), values in sorted(groups.items()):
        # the k-th number of values of one shape (the text around the numbers): "NVIDIA H200, 2026-12-02" and
        # "NVIDIA H100 80GB HBM3, 2026-12-05" are two shapes, so 80 GB is not read as a day (stop 57: "16783%")
        per_pos: dict = {}
        for v in values:
            shape = _NUMBER.sub("#", v)
            for k, (x, unit) in enumerate(numbers_of(v)):
                pos = per_pos.setdefault((shape, k), {"unit": unit, "xs": []})
                if pos["unit"] == unit:
                    pos["xs"].append(x)
        numbers = [{"unit": p["unit"], "min": _round(min(p["xs"])), "median": _round(statistics.median(p["xs"])),
                    "max": _round(max(p["xs"])), "runs": len(p["xs"])} for p in per_pos.values() if p["xs"]]
        measured.append({"cell": cell, "kind": kind, "label": label, "occurrence": occ, "runs": len(values),
                         "example": values[-1][:200], "numbers": numbers})
    failures = [dict(r["first_error"], run=k + 1, utc=r.get("utc")) for k, r in enumerate(runs) if r["first_error"]]
    return {"n": n, "assert_cells": cells, "measured": measured, "failures": failures}


MAX_RUNS = 20  # runs kept per notebook in stability.json (the latest ones)


def merge_stability(old: list[dict], new: list[dict], keep_paths, root: Path = ROOT,
                    max_runs: int = MAX_RUNS, stale=None, dead=None) -> tuple[list[dict], list[str]]:
    """stability.json's entries after a run: for a notebook of this run whose old entry still holds (``stale``, as
    :func:`merge_entries`: same source, or scoped the same up to its code's layout (``source_form_sha256``) or its
    prose (``code_form_sha256``), and
    its deps unchanged or, scoped, its experiment unchanged and its claims those of the quiet pass now), the new
    runs are added to the old ones (the last ``max_runs`` kept) and
    everything is aggregated again, with the new entry's scope (its deps, experiment files and claims: those of the
    current tree); other entries are replaced, or kept unless ``dead`` (entry -> why its runs can never hold again;
    ``stale`` unless given: scope.dead_check keeps an entry that waits for its notebook's quiet pass)."""
    stale = (lambda e: freshness(e, root)) if stale is None else stale
    olds = {e.get("path"): e for e in old}
    combined = []
    for e in new:
        prev = olds.get(e["path"])
        if prev is not None and prev.get("runs") and stale(prev) is None and (
                prev.get("source_sha256") == e["source_sha256"]
                or nbtools.same_form(prev, {key: e.get(key) for key in nbtools.FORMS})):
            runs = (prev["runs"] + e["runs"])[-max_runs:]
            deps = sorted(set(prev["deps"]) | set(e["deps"]))
            e = dict(e, runs=runs, deps=deps, deps_sha256=nbtools.deps_sha256(deps, root))
            if "deps_files" in e:
                e["deps_files"] = nbtools.files_map(deps, root)
        e = dict(e, **aggregate_stability(e["runs"], nbtools.load(root / e["path"])))
        e["seconds"] = [r.get("seconds") for r in e["runs"]]
        combined.append(e)
    return merge_entries(old, combined, keep_paths, root, stale if dead is None else dead)


def spread(num: dict) -> float:
    """(max - min) / |median|, the relative spread of one number across runs (inf where the median is 0)."""
    if num["max"] == num["min"]:
        return 0.0
    return (num["max"] - num["min"]) / abs(num["median"]) if num["median"] else float("inf")


def stability_summary(entries: list[dict], top: int = 8) -> list[str]:
    """Text lines: asserted cells that passed fewer than N of N runs, then the most variable numbers."""
    lines = []
    short = [(e["path"], c) for e in entries for c in e.get("assert_cells", []) if c["passed"] < c["of"]]
    if short:
        lines.append("asserted cells that did not pass every run:")
        lines += [f"  {p} cell {c['cell']}: {c['passed']}/{c['of']}  {c['assert']}" for p, c in short]
    else:
        total = sum(len(e.get("assert_cells", [])) for e in entries)
        lines.append(f"every asserted cell passed every run ({total} cells in {len(entries)} notebooks)")
    ranked = []
    for e in entries:
        for m in e.get("measured", []):
            for k, num in enumerate(m["numbers"]):
                if num["runs"] >= 2 and spread(num) > 0:
                    ranked.append((spread(num), e["path"], m, k, num))
    ranked.sort(key=lambda t: -t[0])  # an inf spread (the median is 0, the runs differ) first
    if not ranked:
        lines.append("no measured number varied between runs")
    else:
        lines.append("most variable measured numbers, (max - min) / median:")
        for s, path, m, k, num in ranked[:top]:
            unit = f" {num['unit']}" if num["unit"] else ""
            lines.append(f"  {s:6.0%}  {Path(path).stem} cell {m['cell']} {m['kind']} {m['label']!r} #{k}: "
                         f"min {num['min']:g} / median {num['median']:g} / max {num['max']:g}{unit}")
    return lines


#: Runs the evidence test asks of every notebook in stability.json: the policy (CONTRIBUTING, issue 8).
#: (It was 3 for one session, 2026-12-01, when device time ran out; back to 5 with the next GPU session.)
MIN_RUNS = 5


def stability_problems(entry: dict, root: Path = ROOT, min_runs: int = MIN_RUNS, stale=None) -> list[str]:
    """What keeps a stability.json entry from showing that a notebook's asserted cells hold run after run (and, where
    its runs recorded their claims, that each claimed what the entry's quiet pass claimed). ``stale``: entry -> why
    it no longer holds for the current tree (:func:`freshness` unless given; scope.stale_check scopes it)."""
    rel = entry.get("path", "?")
    problems = []
    why = (freshness(entry, root) if stale is None else stale(entry))
    if why:
        problems.append(why)
    n = entry.get("n", 0)
    if entry.get("runs") is not None and len(entry["runs"]) != n:
        problems.append(f"{rel}: n is {n} but {len(entry['runs'])} runs are stored")
    if n < min_runs:
        problems.append(f"{rel}: only {n} runs (at least {min_runs} needed)")
    if not why:
        want = assert_cells(nbtools.load(root / rel))
        got = [c["cell"] for c in entry.get("assert_cells", [])]
        if want != got:
            problems.append(f"{rel}: asserted cells {got} recorded, the notebook has {want}")
    for c in entry.get("assert_cells", []):
        if c["passed"] != n or c.get("of", n) != n:
            problems.append(f"{rel} cell {c['cell']} passed {c['passed']} of {n} runs: {c.get('assert', '')}")
    if "claims_sha256" in entry:  # each run that recorded its claims must claim what the entry's quiet pass claimed
        for k, r in enumerate(entry.get("runs") or [], 1):
            if r.get("claims_sha256", entry["claims_sha256"]) != entry["claims_sha256"] and not r.get("first_error"):
                problems.append(f"{rel}: run {k} ({r.get('via', 'execution')}, {r.get('utc')}) claimed otherwise than "
                                f"its quiet pass (claims {r['claims_sha256']}, not {entry['claims_sha256']}: a claim's "
                                "value or a checker's verdict differed although every cell ran)")
    return problems


# ---- the nbval + gpu unit-test pass ----------------------------------------------------------------------------

def read_pytest_log(lines) -> list[dict]:
    out = []
    for line in lines:
        line = line.strip()
        if line:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def notebook_results(records: list[dict], paths) -> dict:
    """Per notebook path: {status, seconds, failures}; "passed" only if cells ran and none failed."""
    res = {p: {"status": "failed", "seconds": 0.0, "failures": [], "cells": 0} for p in paths}
    for r in records:
        file = r["nodeid"].split("::")[0]
        if file not in res:
            continue
        row = res[file]
        row["seconds"] += r.get("duration", 0.0)
        if r.get("when") == "call":
            row["cells"] += 1
        if r.get("outcome") == "failed":
            row["failures"].append(f"{r['nodeid']} ({r.get('when')}): {r.get('message', '')}"[:400])
    for p, row in res.items():
        if row["cells"] and not row["failures"]:
            row["status"] = "passed"
        elif not row["cells"] and not row["failures"]:
            row["failures"].append(f"{p}: nbval ran no cell of it")
        row["seconds"] = round(row["seconds"], 1)
    return res


def unit_test_results(records: list[dict], prefix: str = "tests/") -> dict:
    """{passed, failed, skipped, failures} over the unit tests (node ids under ``prefix``)."""
    tests: dict = {}
    for r in records:
        if not r["nodeid"].startswith(prefix):
            continue
        t = tests.setdefault(r["nodeid"], {"outcome": None, "message": ""})
        if r.get("outcome") == "failed":
            t["outcome"], t["message"] = "failed", r.get("message", "")
        elif r.get("outcome") == "skipped" and t["outcome"] is None:
            t["outcome"] = "skipped"
        elif r.get("when") == "call" and r.get("outcome") == "passed" and t["outcome"] is None:
            t["outcome"] = "passed"
    counts = {k: sum(t["outcome"] == k for t in tests.values()) for k in ("passed", "failed", "skipped")}
    counts["failures"] = [f"{nid}: {t['message']}"[:400] for nid, t in tests.items() if t["outcome"] == "failed"]
    return counts


# ---- adverse conditions (tools/gpu_suite.py --adverse, reports/gpu/adverse.json) ----------------------------

#: The conditions an H200 imitates for ``--adverse``: strict nbval of notebooks/ under each. ``env``: what the
#: pytest process (and so its notebooks' kernels) gets, besides ``PYTHONPATH=lib``; ``learners``: pytest
#: processes at once on the same notebooks; ``cores``: CPU cores it is pinned to; ``stability``: whether its
#: nbval passes count as runs in stability.json (every cell executes live on the GPU, as in the suite's own
#: nbval pass; under (c)-(e) sections replay the recorded run instead, so they do not).
ADVERSE_CONDITIONS: dict[str, dict] = {
    "a": {"name": "three learners at once on one GPU",
          "imitates": "a workshop where three participants run the same notebooks at the same time on one GPU: "
                      "three pytest processes (three kernels) whose copies and kernels interleave on it",
          "learners": 3, "env": {}, "cores": None, "stability": True},
    "b": {"name": "2 CPU cores",
          "imitates": "a small VM or Colab (2 vCPUs): pytest and its notebook kernels pinned to 2 cores "
                      "(taskset -c, or os.sched_setaffinity where taskset is missing), OMP_NUM_THREADS=2",
          "learners": 1, "env": {"OMP_NUM_THREADS": "2"}, "cores": 2, "stability": True},
    "c": {"name": "a 16 GB GPU with a small host pinned budget",
          "imitates": "a 16 GB GPU (T4, V100-16GB class) on a host that lets the course page-lock 2 GiB: torch may "
                      "use 16 GiB of VRAM (set_per_process_memory_fraction) and free VRAM reads at most 16 GiB; "
                      "experiments that need more VRAM or pinned memory replay the recorded run, labelled",
          "learners": 1, "env": {"PINLAB_VRAM_LIMIT_GIB": "16", "PINLAB_PINNED_LIMIT_GIB": "2"}, "cores": None,
          "stability": False},
    "d": {"name": "no FlashInfer",
          "imitates": "a machine without FlashInfer (not installed, or no build for its GPU): lessons 03 and 04 "
                      "decode with the torch reference and say so",
          "learners": 1, "env": {"PINLAB_NO_FLASHINFER": "1"}, "cores": None, "stability": False},
    "e": {"name": "a profiler that records no GPU activity (simulated)",
          "imitates": "WSL2 or a container where torch.profiler records no CUDA activity: the experiments that read a "
                      "profiler trace replay the recorded run, labelled with the reason",
          "learners": 1, "env": {"PINLAB_SIMULATE_NO_GPU_TRACE": "1"}, "cores": None, "stability": False},
}
#: conditions the suite can run (``--adverse f``) and records in adverse.json, required only of the notebooks in
#: their ``required_for`` (:func:`required_conditions`; the five above are required of every notebook). (f) is
#: issue 45's heisenbug: under ``CUDA_LAUNCH_BLOCKING=1`` strict nbval of lessons 03, 04, 08 and 09 failed in 17
#: of 103 cells (the H200, before the claims named the variable) and 19 of 108 (an H100, stop 63), each a claim
#: that a race or a pending copy shows. A lesson whose such claims are ``pinlab.lead.claim``s (they only observe
#: under the variable) is added to ``required_for`` in the same renewal: its evidence then needs the pass, and
#: --plan schedules ``--adverse f --only`` it. Lesson 04's (f) pass on stop 64's H100 failed 1 of 40 cells: cell 10's
#: "after a sync, snapshot 3 got snapshot 1's block back" follows from the pending copy too (under the variable
#: snapshot 1's copy has run before snapshot 2 is taken, so its block is free for snapshot 2), as does "snapshot 3
#: needed no new cudaHostAlloc"; both are lead claims since.
EXTRA_CONDITIONS: dict[str, dict] = {
    "f": {"name": "CUDA_LAUNCH_BLOCKING=1",
          "imitates": "a learner debugging with CUDA_LAUNCH_BLOCKING=1: every launch and copy waits until the GPU has "
                      "run it, so no race or overlap can show; a lesson must say so (and the order verdict still name "
                      "the race), not fail blaming the CPU",
          "learners": 1, "env": {"CUDA_LAUNCH_BLOCKING": "1"}, "cores": None, "stability": False,
          "required_for": ("notebooks/03_the_race.ipynb", "notebooks/04_the_fix.ipynb",
                           "notebooks/08_cuda_graphs.ipynb", "notebooks/09_real_code.ipynb")},
}
#: every condition the suite can run: the required ones first
ALL_CONDITIONS: dict[str, dict] = {**ADVERSE_CONDITIONS, **EXTRA_CONDITIONS}
ADVERSE_RENEW = "python3 tools/gpu_suite.py --adverse"


def required_conditions(rel: str) -> list[str]:
    """The adverse conditions whose pass the notebook ``rel`` (relative to the root) must have: every condition
    without a ``required_for``, and those that name it."""
    return [cid for cid, spec in ALL_CONDITIONS.items()
            if spec.get("required_for") is None or rel in spec["required_for"]]


def condition_title(cid: str) -> str:
    """``(c) a 16 GB GPU with a small host pinned budget``."""
    return f"({cid}) {ALL_CONDITIONS[cid]['name']}"


def code_cell_count(nb: dict) -> int:
    return sum(c["cell_type"] == "code" for c in nb["cells"])


def skip_tagged_cells(nb: dict) -> int:
    """Code cells nbval skips by design (tag ``nbval-skip``): the only cells an adverse pass may skip."""
    return sum(c["cell_type"] == "code" and "nbval-skip" in c.get("metadata", {}).get("tags", []) for c in nb["cells"])


def adverse_notebook_run(cells: list[dict], code_cells: int, collect_error: str | None = None) -> dict:
    """One pytest process's strict nbval pass over one notebook, from conftest.py's capture records of it
    (``cells``; $PINLAB_NBVAL_CAPTURE): cells passed / failed / skipped / not run, each failing cell with
    nbval's message and its error output, and the seconds the cells took. ``collect_error``: pytest could not
    collect the notebook (the records are then empty)."""
    by_cell: dict = {}
    for c in cells:
        by_cell[c.get("cell")] = c  # one record per cell (the last, should a cell appear twice)
    outcomes = [c.get("outcome") for c in by_cell.values()]
    failing = [{"cell": c.get("cell"), "code_cell": c.get("code_cell"), "outcome": c.get("outcome"),
                "message": (c.get("message") or "")[:400], "error": c.get("error")}
               for c in sorted(by_cell.values(), key=lambda c: (c.get("cell") is None, c.get("cell") or 0))
               if c.get("outcome") in ("failed", "error")]
    if collect_error is not None:
        failing.insert(0, {"cell": None, "code_cell": None, "outcome": "error",
                           "message": f"pytest could not collect the notebook: {collect_error}"[:400], "error": None})
    return {"cells": code_cells,
            "passed": outcomes.count("passed"),
            "failed": outcomes.count("failed") + outcomes.count("error") + (collect_error is not None),
            "skipped": outcomes.count("skipped"),
            "not_run": max(0, code_cells - len(by_cell)),
            "failing_cells": failing,
            "seconds": round(sum(c.get("seconds") or 0.0 for c in by_cell.values()), 1)}


def adverse_run_passed(run: dict, allowed_skips: int = 0) -> bool:
    """Every cell passed (a cell tagged ``nbval-skip`` may be skipped instead)."""
    return (run.get("failed") == 0 and run.get("not_run") == 0 and run.get("passed", 0) >= 1
            and run.get("skipped", 0) <= allowed_skips and run["passed"] + run.get("skipped", 0) == run.get("cells"))


def merge_adverse(old: dict, new_conditions: list[dict], keep_paths) -> list[dict]:
    """adverse.json's ``conditions`` after a call: a condition of this call takes its new notebook entries and keeps
    its old entries of other notebooks of notebooks/ (a call with ``--only``, or one the budget cut short);
    conditions this call did not run are kept as they were. Whether an entry still holds is for
    :func:`adverse_problems` to say (it names the stale ones).

    Each notebook entry keeps the ``how`` of the call that ran it (a kept entry the ``how`` of its condition when it
    was written), so that a condition whose entries come from calls run differently (alone, or beside the other
    conditions) says so entry by entry; the condition's own ``how`` is the newest call's."""
    olds = {c.get("id"): c for c in old.get("conditions", [])}
    out = dict(olds)
    for c in new_conditions:
        prev = olds.get(c["id"]) or {}
        by_path = {e.get("path"): (dict(e, how=e.get("how") or prev.get("how")) if prev.get("how") else e)
                   for e in prev.get("notebooks", []) if e.get("path") in keep_paths}
        by_path.update({e["path"]: (dict(e, how=c["how"]) if c.get("how") else e) for e in c["notebooks"]})
        out[c["id"]] = dict(c, notebooks=[by_path[p] for p in sorted(by_path)])
    return [out[k] for k in sorted(out)]


def adverse_problems(report: dict | None, paths, root: Path = ROOT, stale=None) -> list[str]:
    """What keeps ``report`` (reports/gpu/adverse.json, None if absent) from showing that every notebook of
    ``paths`` (notebooks/*.ipynb) passed every cell under each condition of :data:`ADVERSE_CONDITIONS`, for
    its current source and deps (``stale``: entry -> why it no longer holds, :func:`freshness` unless given;
    scope.stale_check scopes it to the experiment). Each problem names the condition, the notebook and the
    command that renews it."""
    stale = (lambda e: freshness(e, root)) if stale is None else stale
    if report is None:
        return [f"no reports/gpu/adverse.json: run `{ADVERSE_RENEW}` on a CUDA machine (CONTRIBUTING.md: Running the GPU "
                "suite) and commit reports/gpu/"]
    problems = [f"reports/gpu/adverse.json lacks {k}: run `{ADVERSE_RENEW}`"
                for k in ("gpu", "driver", "torch", "cuda", "flashinfer", "python", "utc", "conditions") if k not in report]
    conds = {c.get("id"): c for c in report.get("conditions", []) if isinstance(c, dict)}
    rels = {p: Path(p).relative_to(root).as_posix() for p in paths}
    for cid, spec in ALL_CONDITIONS.items():
        title = condition_title(cid)
        cond = conds.get(cid)
        if not any(cid in required_conditions(r) for r in rels.values()):
            continue  # an extra condition no notebook requires yet (--adverse f runs it where asked)
        if cond is None:
            problems.append(f"{title} is not in reports/gpu/adverse.json: run `{ADVERSE_RENEW} {cid}`")
            continue
        if cond.get("env") != spec["env"]:
            problems.append(f"{title} ran with {cond.get('env')}, not {spec['env']} (an older definition): "
                            f"run `{ADVERSE_RENEW} {cid}`")
        entries = {e.get("path"): e for e in cond.get("notebooks", [])}
        for p in paths:
            rel = rels[p]
            if cid not in required_conditions(rel):
                continue
            again = f"`{ADVERSE_RENEW} {cid}` (this notebook only: `{ADVERSE_RENEW} {cid} --only {Path(p).stem}`)"
            e = entries.get(rel)
            if e is None:
                problems.append(f"{title}: {rel} was not run under it: run {again}")
                continue
            why = stale(e)
            if why:
                problems.append(f"{title}: {why}: run `{ADVERSE_RENEW}` on a CUDA machine "
                                f"(this notebook only: `{ADVERSE_RENEW} --only {Path(p).stem}`)")
                continue
            runs = e.get("runs") or []
            if len(runs) != spec["learners"]:
                problems.append(f"{title}: {rel} has {len(runs)} runs recorded, the condition has "
                                f"{spec['learners']} learner(s): run {again}")
            nb = nbtools.load(Path(p))
            skips = skip_tagged_cells(nb)
            for k, r in enumerate(runs, 1):
                who = f", learner {r.get('learner', k)}" if spec["learners"] > 1 else ""
                if r.get("cells") != code_cell_count(nb):
                    problems.append(f"{title}{who}: {rel} recorded {r.get('cells')} code cells, the notebook has "
                                    f"{code_cell_count(nb)}: run {again}")
                    continue
                if adverse_run_passed(r, skips):
                    continue
                failing = "; ".join(f"cell {f.get('cell')}: {f.get('message') or f.get('outcome')}"
                                    for f in r.get("failing_cells", [])[:3])
                problems.append(f"{title}{who}: {rel} passed {r.get('passed')} of {r.get('cells')} cells "
                                f"({r.get('failed')} failed, {r.get('skipped')} skipped, {r.get('not_run')} not run)"
                                + (f": {failing}" if failing else "") + f"; fix it, then run {again}")
    return problems
