"""What each piece of GPU evidence proves, and so what a change stales (CONTRIBUTING, "GPU evidence").

Three proofs, three scopes:

* **The quiet reference pass** (``reports/gpu/latest.json``, the committed outputs, the recordings) is what a learner
  reads. It holds while the notebook's source and every ``lib/`` file it imported are unchanged
  (:func:`evidence.freshness`): a comment in ``claims.py`` renews it.
* **Stability** (``stability.json``, N >= 5 runs) and **the adverse conditions** (``adverse.json``) prove that an
  experiment's claims hold run after run and under sharing. They are keyed to what the experiment *is*: the
  notebook's source and its **experiment files** (:func:`experiment_files`): its lesson module, its checker, and the
  modules whose code the experiment measures (:data:`MEASURED`, each with the reason it is on the list), followed
  through their imports. A change to any other module (:data:`PLUMBING`: reporting, formatting, the probe, replay
  lookup, argument checks), or to an experiment file's comments, docstrings or layout only (its code form,
  ``nbtools.code_form_sha``, recorded as ``experiment_forms``), carries the earlier runs forward **only if** the quiet pass on the changed tree gives
  every claim of the notebook the same verdict as the runs' own quiet pass: the same claims (:func:`evidence.claims_of`), the
  same values where they are exact counts, the same checker verdicts. :func:`scoped_problem` decides it; the suite
  records the comparison in latest.json (``carried``) and ``tests/test_evidence.py`` fails where it does not hold.

Pure logic over files: no torch, no kernel (tools/gpu_suite.py, tools/adverse.py, tools/plan.py and the tests).
"""
from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import evidence
import nbtools

ROOT = nbtools.ROOT
PKG = "lib/pinlab"

#: Modules whose code an experiment *measures*: a change to one renews the stability runs and the adverse
#: conditions of every notebook whose experiment reaches it (:func:`experiment_files`), not only its quiet pass.
MEASURED: dict[str, str] = {
    f"{PKG}/busy.py": "the GPU's lead: the spin kernels that keep the GPU behind the host, which every race, stall "
                      "and overlap experiment needs to show its effect",
    f"{PKG}/child.py": "experiments run in a fresh process (cold allocators, FlashInfer's crashing plan() staging): "
                       "the protocol decides what such a run reports",
    f"{PKG}/copyargs.py": "the one parser of copy calls: what the detectors, the audits, the checkers and the emulated "
                          "stream take for a copy, its source, its target and non_blocking",
    f"{PKG}/decode_loop.py": "the paged-decode step loop of lessons 03 and 04: real attention fed by raced metadata",
    f"{PKG}/detector.py": "detect_stalls: the syncs and pageable copies whose counts lessons assert",
    f"{PKG}/h2d.py": "async_tensor_h2d and pin_snapshot: the take-home copies the lessons measure",
    f"{PKG}/hostmem.py": "the caching host allocator's statistics: the cudaHostAlloc counts and pinned bytes lessons "
                         "assert",
    f"{PKG}/paged_kv.py": "the paged KV metadata and the torch reference that FlashInfer's output is compared with",
    f"{PKG}/profiler.py": "reading the profiler's trace: the copies, launches and waits lessons count in it",
    f"{PKG}/races.py": "detect_races: the races whose counts lessons assert",
    f"{PKG}/order.py": "detect_races by order (pinlab.detect_races, the happens-before verdict of the pytest gate "
                       "and of exercise 09's checker): the latent races lessons 03, 04 and 08 are to show",
    f"{PKG}/waits.py": "explicit host waits (synchronize of the device, a stream, an event) counted by file:line: "
                       "the waits lesson 09 matches against the trace, and detect_stalls' next kind",
    f"{PKG}/steploop.py": "the step loop of lessons 02-04 and 08: its strategies are the race and its fixes",
    f"{PKG}/streams.py": "the stream a step loop runs on (CUDA, or the emulated lagging stream): the order of host "
                         "and device work that every race shows",
    f"{PKG}/checks/__init__.py": "the checkers' core (with guard, compare and verdict): it runs the learner's code and "
                                 "decides the verdict a solution shows",
    f"{PKG}/checks/guard.py": "the checkers' core: the learner's call, its time limit and torch's state around it",
    f"{PKG}/checks/compare.py": "the checkers' core: how an answer is compared with the reference",
    f"{PKG}/checks/verdict.py": "the checkers' core: the verdict line a solution shows",
}

#: Every other module of lib/pinlab: shared plumbing. A change to one renews the quiet pass of every notebook that
#: imports it; stability and adverse runs carry forward where the quiet pass's claims are those of the runs.
PLUMBING: dict[str, str] = {
    f"{PKG}/__init__.py": "re-exports the library's names (it imports every module, so every notebook imports it)",
    f"{PKG}/args.py": "argument checks and their error messages",
    f"{PKG}/claims.py": "prints a claim and explains a failed one; the lesson computes what is claimed",
    f"{PKG}/lead.py": "prints a claim that needs the host ahead of the GPU, and decides whether it may fail (not "
                      "under CUDA_LAUNCH_BLOCKING=1); the lesson computes what is claimed",
    f"{PKG}/device.py": "machine facts: CUDA, the GPU, versions",
    f"{PKG}/doctor.py": "the set-up report of lesson 00 and `pinlab.doctor()`",
    f"{PKG}/plots.py": "figures and their style",
    f"{PKG}/probe.py": "the platform probe: what this machine can show, the run's conditions, the imitated limits",
    f"{PKG}/progress.py": "progress bars on stderr (nbval does not compare stderr)",
    f"{PKG}/replay.py": "replay lookup and recording: live on a GPU, the recorded run elsewhere",
    f"{PKG}/run_header.py": "the header each notebook starts with: the machine, the versions, the run's conditions",
    f"{PKG}/syllabus.py": "the syllabus table that lesson 00 prints",
    f"{PKG}/text.py": "formatting of durations, sizes and wrapped lines",
    f"{PKG}/timing.py": "timers and the [measured]/[timing] lines, which nbval masks and no claim reads",
    f"{PKG}/lessons/__init__.py": "the lessons package (no code)",
}

_LESSON = re.compile(r"^(?P<id>\d\d[a-z]?)_")


# ---- which files an experiment is ---------------------------------------------------------------------------

def lesson_id(path) -> str | None:
    """``"04"`` for notebooks/04_the_fix.ipynb or lessons/l04_the_fix.py, ``"02b"`` for 02b, else None."""
    name = Path(path).name
    if name.startswith("l") and Path(path).parent.name in ("lessons", "checks"):
        name = name[1:]
    m = _LESSON.match(name) or re.match(r"^(?P<id>\d\d[a-z]?)\.py$", name)
    return m.group("id") if m else None


def role(rel: str) -> str | None:
    """What a lib file is to the evidence: "measured", "plumbing", "lesson" (lessons/lNN_*.py), "checker"
    (checks/lNN.py), or None where nobody has classified it yet (tests/test_scope.py fails on that)."""
    if rel in MEASURED:
        return "measured"
    if rel in PLUMBING:
        return "plumbing"
    p = Path(rel)
    if p.parent.as_posix() == f"{PKG}/lessons" and lesson_id(p):
        return "lesson"
    if p.parent.as_posix() == f"{PKG}/checks" and lesson_id(p):
        return "checker"
    return None


def _experiment_kind(rel: str) -> bool:
    return role(rel) in ("measured", "lesson", "checker")


def _module_file(dotted: str, root: Path) -> str | None:
    """lib/ file of a module ``pinlab.a.b`` (a .py or a package's __init__.py), or None."""
    if dotted != "pinlab" and not dotted.startswith("pinlab."):
        return None
    base = Path("lib", *dotted.split("."))
    for cand in (base.with_suffix(".py"), base / "__init__.py"):
        if (root / cand).exists():
            return cand.as_posix()
    return None


def _dotted(rel: str) -> str:
    p = Path(rel).relative_to("lib")
    parts = list(p.with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _parse(text: str):
    """The AST of code that may hold IPython magics (a notebook cell): those lines are blanked first."""
    lines = [("" if ln.lstrip().startswith(("%", "!")) else ln) for ln in text.splitlines()]
    try:
        return ast.parse("\n".join(lines))
    except SyntaxError:
        return None


_TREES: dict = {}


def _parse_file(rel: str, root: Path):
    """:func:`_parse` of a lib file, cached while the file is unchanged (its mtime and size)."""
    st = (root / rel).stat()
    key = (str(root), rel, st.st_mtime_ns, st.st_size)
    if key not in _TREES:
        _TREES[key] = _parse((root / rel).read_text(encoding="utf-8"))
    return _TREES[key]


def _imports(tree, package: str | None) -> list[tuple[str, list[str]]]:
    """(module, names imported from it) for every import in ``tree``, function-local ones included; relative
    imports resolved against ``package`` (the dotted package the code lives in)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                if package is None:
                    continue
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
                mod = ".".join(base + ([mod] if mod else []))
            out.append((mod, [a.name for a in node.names]))
    return out


def _resolve(dotted: str, name: str | None, root: Path, seen=None) -> str | None:
    """The lib file that defines ``dotted.name`` (``name`` None: the module itself): a submodule, or a name a
    module imports from another (followed through re-exports such as pinlab/__init__.py), else the module."""
    seen = set() if seen is None else seen
    if name is not None:
        sub = _module_file(f"{dotted}.{name}", root)
        if sub:
            return sub
    rel = _module_file(dotted, root)
    if rel is None or name is None or (rel, name) in seen:
        return rel
    seen.add((rel, name))
    tree = _parse_file(rel, root)
    pkg = dotted if rel.endswith("__init__.py") else dotted.rpartition(".")[0]
    for node in (tree.body if tree else []):
        if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names):
            (mod, _), = _imports(ast.Module(body=[node], type_ignores=[]), pkg)
            orig = next(a.name for a in node.names if (a.asname or a.name) == name)
            return _resolve(mod, orig, root, seen) or rel
    return rel


_TARGETS: dict = {}


def _lib_state(root: Path) -> tuple:
    """Every lib file with its mtime and size: what the cached import graph was read from."""
    out = []
    for p in sorted((root / "lib").rglob("*.py")):
        st = p.stat()
        out.append((p.relative_to(root).as_posix(), st.st_mtime_ns, st.st_size))
    return (str(root), tuple(out))


def module_targets(rel: str, root: Path = ROOT, state: tuple | None = None) -> set[str]:
    """The lib files a lib module imports (function-local imports too), names resolved to their defining module;
    cached for the lib files' ``state`` (:func:`_lib_state`)."""
    state = _lib_state(root) if state is None else state
    key = (state, rel)
    if key not in _TARGETS:
        _TARGETS[key] = _module_targets(rel, root)
    return _TARGETS[key]


def _module_targets(rel: str, root: Path) -> set[str]:
    tree = _parse_file(rel, root)
    if tree is None:
        return set()
    dotted = _dotted(rel)
    pkg = dotted if rel.endswith("__init__.py") else dotted.rpartition(".")[0]
    out = set()
    for mod, names in _imports(tree, pkg):
        for name in names or [None]:
            target = _resolve(mod, name if name != "*" else None, root)
            if target:
                out.add(target)
    return out


def notebook_targets(nb: dict, root: Path = ROOT) -> set[str]:
    """The lib files a notebook's code names: its pinlab imports and every ``pinlab.x.y`` it uses."""
    out = set()
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        tree = _parse(evidence._source(cell))
        if tree is None:
            continue
        for mod, names in _imports(tree, None):
            for name in names or [None]:
                target = _resolve(mod, name if name != "*" else None, root)
                if target:
                    out.add(target)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                chain = []
                cur = node
                while isinstance(cur, ast.Attribute):
                    chain.append(cur.attr)
                    cur = cur.value
                if isinstance(cur, ast.Name) and cur.id == "pinlab":
                    chain.reverse()
                    mod = "pinlab"
                    for part in chain:
                        if _module_file(f"{mod}.{part}", root):
                            mod = f"{mod}.{part}"
                            continue
                        target = _resolve(mod, part, root)
                        if target:
                            out.add(target)
                        break
                    else:
                        out.add(_module_file(mod, root))
    return {t for t in out if t}


def experiment_files(path, root: Path = ROOT, nb: dict | None = None) -> list[str]:
    """The files a notebook's stability and adverse runs are keyed to, besides its source: its lesson module and
    checker (by number), every lesson, checker or :data:`MEASURED` module its code names, and those such a module
    imports in turn (plumbing modules are not followed: what they import is not what the experiment measures)."""
    path = Path(path)
    nb = nbtools.load(root / path if not path.is_absolute() else path) if nb is None else nb
    state = _lib_state(root)
    key = (state, path.as_posix(), nbtools.source_sha256(nb))
    if key not in _EXPERIMENTS:
        _EXPERIMENTS[key] = _experiment_files(path, root, nb, state)
    return list(_EXPERIMENTS[key])


_EXPERIMENTS: dict = {}


def _experiment_files(path: Path, root: Path, nb: dict, state: tuple) -> list[str]:
    lid = lesson_id(path)
    todo = {t for t in notebook_targets(nb, root) if _experiment_kind(t)}
    if lid:  # its lesson module; a solution's or exercise's checker too (a lesson notebook runs no checker)
        dirs = ("lessons", "checks") if path.parent.name in ("solutions", "exercises") else ("lessons",)
        todo |= {p.relative_to(root).as_posix() for d in dirs for p in (root / PKG / d).glob("*.py")
                 if lesson_id(p) == lid}
    return sorted(nbtools.closure(todo, lambda rel: {t for t in module_targets(rel, root, state)
                                                     if _experiment_kind(t)}))


def unclassified(root: Path = ROOT) -> list[str]:
    """lib/pinlab files that neither :data:`MEASURED` nor :data:`PLUMBING` names and that are no lesson module or
    checker: each must be put on one list, with its reason, before its notebooks' evidence can be scoped."""
    return [rel for rel in nbtools.lib_files(root) if rel.startswith(PKG + "/") and role(rel) is None]


# ---- does a stability or adverse entry hold for the current tree? ---------------------------------------------

def scope_fields(rel: str, deps, claims: list, kind: str, root: Path = ROOT, nb: dict | None = None) -> dict:
    """What an entry of ``kind`` ("latest", "stability", "adverse") records of its scope when it is written: its
    experiment files with their short sha256; the short sha256 of every dep (latest and stability: so that a later
    tree can name the file that changed); and the claims of the quiet pass its runs go with: the list itself in
    latest.json (the pass's own), its hash (evidence.claims_sha256) in the others (their baseline)."""
    nb = nbtools.load(root / rel) if nb is None else nb
    files = experiment_files(rel, root, nb)
    out = {"experiment": nbtools.files_map(files, root), "experiment_forms": nbtools.forms_map(files, root),
           **nbtools.forms(nb)}
    if kind != "adverse":
        out["deps_files"] = nbtools.files_map(deps, root)
    if kind == "latest":
        out["claims"] = claims
    out["claims_sha256"] = evidence.claims_sha256(claims)
    return out


def experiment_problem(entry: dict, root: Path = ROOT) -> str | None:
    """Why a stability.json or adverse.json entry's runs no longer prove anything for the current tree whatever the
    quiet pass claims: the notebook is gone, its source changed, its experiment files changed (other files, or other
    contents), or it was recorded before the scope fields were kept and a dep changed. None: its runs hold now, or
    will once the quiet pass on this tree claims what they claimed (:func:`scoped_problem`)."""
    rel = entry.get("path", "?")
    path = root / rel
    if not path.exists():
        return f"{rel} no longer exists"
    nb = nbtools.load(path)
    if entry.get("source_sha256") != nbtools.source_sha256(nb) and not same_form(entry, nb):
        return f"{rel} changed after its runs"
    if "experiment" not in entry:
        return evidence.freshness(entry, root)
    now = experiment_files(rel, root, nb)
    recorded = entry["experiment"]
    if sorted(recorded) != now:
        gained, lost = sorted(set(now) - set(recorded)), sorted(set(recorded) - set(now))
        return (f"{rel}: its experiment files changed"
                + (f": it now also uses {', '.join(gained)}" if gained else "")
                + (f"; no longer {', '.join(lost)}" if lost else ""))
    changed = nbtools.changed_files(recorded, root)
    forms = entry.get("experiment_forms") or {}
    # a file whose code is unchanged (a comment, a docstring, the layout) is plumbing to these runs: they carry
    # forward where the quiet pass on this tree claims what they claimed (_plumbing_problem decides)
    changed = [f for f in changed if not (f in forms and (root / f).exists() and nbtools.code_form_sha(f, root) == forms[f])]
    if changed:
        return f"{rel}: an experiment file changed after its runs: {', '.join(changed)}"
    return None


def same_form(entry: dict, nb: dict) -> bool:
    """Whether ``nb`` is the source an entry's runs were taken with, up to the layout of its code
    (nbtools.source_form_sha256: a formatter's pass) and its prose (nbtools.code_form_sha256: Markdown is not run).
    An entry recorded before a form was kept has none of it."""
    return nbtools.same_form(entry, nbtools.forms(nb))


def scoped_problem(entry: dict, latest: dict | None, root: Path = ROOT) -> str | None:
    """None if a stability.json or adverse.json entry still proves what it proved, else why not.

    It holds while :func:`experiment_problem` finds nothing (the same source, the same experiment files with the
    same contents) and either every dep is unchanged, or the notebook's quiet pass on the current tree (``latest``,
    its latest.json entry, fresh) claims what the entry's runs were taken with (``claims``: the same claims, exact
    values and checker verdicts). An entry recorded before these fields were kept holds only with every dep
    unchanged (:func:`evidence.freshness`)."""
    return experiment_problem(entry, root) or _plumbing_problem(entry, latest, root)


def _plumbing_problem(entry: dict, latest: dict | None, root: Path) -> str | None:
    """:func:`scoped_problem` once :func:`experiment_problem` found nothing: the deps, or the quiet pass's claims."""
    if evidence.freshness(entry, root) is None:
        return None
    rel = entry.get("path", "?")
    plumbing = nbtools.changed_files(entry.get("deps_files") or {}, root)
    nb = nbtools.load(root / rel)
    if entry.get("source_sha256") != nbtools.source_sha256(nb):
        # experiment_problem found the same form: its code's layout changed, or its prose
        layout = nbtools.same_form(entry, {"source_form_sha256": nbtools.source_form_sha256(nb)})
        plumbing = [f"the layout of {rel}'s code" if layout else f"{rel}'s prose or its code's layout"] + plumbing
    plumbing = plumbing or ["one of its deps"]
    if latest is None:
        return f"{rel}: {', '.join(plumbing)} changed and latest.json has no quiet pass of it to compare claims with"
    why = evidence.freshness(latest, root)
    if why:
        return (f"{rel}: {', '.join(plumbing)} changed (plumbing) and its quiet pass is stale too ({why}): the "
                "quiet pass on this tree decides whether these runs carry forward")
    if "claims_sha256" not in latest or "claims_sha256" not in entry:
        return f"{rel}: {', '.join(plumbing)} changed and no claims were recorded to compare"
    if latest["claims_sha256"] != entry["claims_sha256"]:
        said = (latest.get("carried") or {}).get("differences") or []
        return (f"{rel}: {', '.join(plumbing)} changed and the quiet pass on this tree claims otherwise than these "
                f"runs" + (f": {'; '.join(said)}" if said else f" (claims {latest['claims_sha256']}, theirs "
                                                                 f"{entry['claims_sha256']})"))
    return None


def carried_record(entries: dict, previous: dict | None, row: dict, root: Path = ROOT) -> dict:
    """latest.json's record, for a notebook the quiet pass has just run, of the comparison that decides whether its
    stability and adverse runs carry forward (``entries``: {"stability": entry, "adverse (a)": entry, ...}, those
    recorded; ``previous``: its latest.json entry before this pass; ``row``: this pass's). ``differences``: how this
    pass's claims differ from the previous pass's (where the runs were taken with those); per proof, whether it
    holds now, or why not."""
    diff = []
    if previous is not None and "claims" in previous:
        diff = evidence.claim_differences(previous["claims"], row.get("claims") or [])
    out = {"claims_sha256": row.get("claims_sha256"), "differences": diff, "proofs": {}}
    for name, e in entries.items():
        if e is None:
            continue
        why = scoped_problem(e, row, root) if "claims_sha256" in row else "this pass recorded no claims"
        out["proofs"][name] = {"runs_claims_sha256": e.get("claims_sha256"), "holds": why is None,
                               **({"why_not": why} if why else {})}
    return out


def carried_entries(rel: str, stability: dict | None, adverse: dict | None, root: Path = ROOT) -> dict:
    """{proof name: entry} of notebook ``rel``'s stability and adverse entries that were taken on other deps than
    today's (the adverse conditions its evidence requires only): what a quiet pass of it compares and records
    (:func:`carried_record`, ``gpu_suite`` after each quiet pass)."""
    entries = {"stability": next((e for e in (stability or {}).get("notebooks", []) if e.get("path") == rel), None)}
    for c in (adverse or {}).get("conditions", []):
        if c.get("id") not in evidence.required_conditions(rel):
            continue  # an extra condition (f) this notebook's evidence does not require: nothing to carry
        entries[f"adverse ({c.get('id')})"] = next((e for e in c.get("notebooks", []) if e.get("path") == rel), None)
    return {k: e for k, e in entries.items() if e is not None and evidence.freshness(e, root) is not None}


def uncarried(latest: dict | None, stability: dict | None, adverse: dict | None, root: Path = ROOT) -> dict:
    """{notebook: [proof names]} of the stability and adverse entries that were taken on other deps and hold by the
    plumbing rule (:func:`stale_check` finds nothing: only files outside the experiment changed, and the quiet pass
    claims what the runs claimed) while latest.json has no record of that comparison (its row's ``carried`` with a
    proof that holds): only a quiet pass on this tree writes that record (:func:`carried_record`). It happens where
    an entry's deps are more than the quiet pass's (solution 01's stability runs imported pinlab.races, its stop 65
    quiet pass did not), so a change to such a file stales no quiet pass; tools/plan.py and ``gpu_suite --stale``
    then run the quiet pass all the same, and tests/test_scope.py holds that nothing is left without the record."""
    rows = latest_rows(latest)
    check = stale_check(latest, root)
    paths = {e.get("path") for e in (stability or {}).get("notebooks", [])}
    paths |= {e.get("path") for c in (adverse or {}).get("conditions", []) for e in c.get("notebooks", [])}
    out: dict = {}
    for rel in sorted(p for p in paths if p):
        for name, e in carried_entries(rel, stability, adverse, root).items():
            if check(e) is not None:
                continue  # not holding: its own tests say so
            proof = ((rows.get(rel) or {}).get("carried") or {}).get("proofs", {}).get(name)
            if not proof or not proof.get("holds"):
                out.setdefault(rel, []).append(name)
    return out


def latest_rows(latest: dict | None) -> dict:
    """latest.json's notebook entries by path."""
    return {e.get("path"): e for e in (latest or {}).get("notebooks", []) if isinstance(e, dict)}


def entry_state(entry: dict, latest: dict | None, root: Path = ROOT) -> tuple[str, str | None]:
    """("holds" | "carry" | "renew", why) of a stability.json or adverse.json entry against its notebook's
    latest.json entry ``latest``: "holds" (:func:`scoped_problem` finds nothing); "carry" where only plumbing
    changed and the quiet pass on this tree is still to run (it decides); "renew" where the runs prove nothing for
    this tree: :func:`experiment_problem`, or the quiet pass on this tree ran and claims otherwise."""
    why = experiment_problem(entry, root)
    if why:
        return "renew", why
    why = _plumbing_problem(entry, latest, root)
    if why is None:
        return "holds", None
    if latest is not None and evidence.freshness(latest, root) is None:
        return "renew", why
    return "carry", why


def stale_check(latest: dict | None, root: Path = ROOT):
    """``entry -> why it no longer holds`` (None: it holds) for stability.json and adverse.json entries, scoped
    against ``latest`` (latest.json as it is now): what evidence.stability_problems, evidence.adverse_problems and
    evidence.merge_stability take as ``stale``."""
    rows = latest_rows(latest)
    return lambda entry: entry_state(entry, rows.get(entry.get("path")), root)[1]


def dead_check(latest: dict | None, root: Path = ROOT):
    """``entry -> why its runs can never hold again`` (:func:`entry_state` "renew"; None: they hold, or may once
    the quiet pass on this tree has run). What evidence.merge_stability drops: a stability entry waiting for its
    notebook's quiet pass is kept."""
    rows = latest_rows(latest)

    def dead(entry):
        state, why = entry_state(entry, rows.get(entry.get("path")), root)
        return why if state == "renew" else None
    return dead


def record_missing_scope(report: dict, kind: str, latest: dict | None, root: Path = ROOT) -> list[str]:
    """Add the scope fields (:func:`scope_fields`) to the entries of a report written before they were kept, where
    they can be proven from the current files: the entry holds with every dep unchanged (evidence.freshness), so
    its experiment files and deps are today's; its claims are those of the committed notebook, the output of the
    quiet pass on these same files (whose latest.json entry must hold too). An entry with its scope but not its
    source's form (``source_form_sha256``, kept since 2026-12-05) or its code's (``code_form_sha256``, since stop 58)
    gets the form of today's source where that is the very source it recorded (the same ``source_sha256``); one
    without its experiment files' code forms (``experiment_forms``, since stop 62) gets today's where every one of
    those files is the very file it recorded (the same bytes). ``kind``: "latest", "stability" or
    "adverse". Returns what was recorded, one line per entry; entries that do not hold are left as they are."""
    rows = latest_rows(latest)
    done = []
    if kind == "adverse":
        entries = [e for c in report.get("conditions", []) for e in c.get("notebooks", [])]
    else:
        entries = report.get("notebooks", [])
    for e in entries:
        rel = e.get("path")
        if "experiment" in e and "experiment_forms" not in e and not nbtools.changed_files(e["experiment"], root):
            e["experiment_forms"] = nbtools.forms_map(e["experiment"], root)
            done.append(f"{kind}: {rel}: the code forms of its {len(e['experiment'])} experiment files")
        if rel and "experiment" in e and not ("source_form_sha256" in e and "code_form_sha256" in e) \
                and (root / rel).exists():
            nb = nbtools.load(root / rel)
            if e.get("source_sha256") == nbtools.source_sha256(nb):  # the very source: its forms are today's
                for key, form in nbtools.FORMS.items():
                    if key not in e:
                        e[key] = form(nb)
                        done.append(f"{kind}: {rel}: its {key[:-7].replace('_', ' ')} {e[key][:16]}")
            continue
        if "experiment" in e or not rel or evidence.freshness(e, root) is not None:
            continue
        row = e if kind == "latest" else rows.get(rel)
        if row is None or evidence.freshness(row, root) is not None:
            continue
        nb = nbtools.load(root / rel)
        e.update(scope_fields(rel, e["deps"], evidence.claims_of(nb), kind, root, nb))
        done.append(f"{kind}: {rel}: {len(e['experiment'])} experiment files, claims {e['claims_sha256']}")
    return done


def record_reports(reports: Path | None = None, root: Path = ROOT) -> list[str]:
    """:func:`record_missing_scope` over latest.json, stability.json and adverse.json (written back where it
    recorded something). CPU only; what it writes follows from files that every dep of the entry still matches."""
    reports = root / "reports" / "gpu" if reports is None else reports
    done = []
    paths = {k: reports / f"{k}.json" for k in ("latest", "stability", "adverse")}
    data = {k: (json.loads(p.read_text(encoding="utf-8")) if p.exists() else None) for k, p in paths.items()}
    for kind in ("latest", "stability", "adverse"):
        if data[kind] is None:
            continue
        lines = record_missing_scope(data[kind], kind, data["latest"], root)
        if lines:
            paths[kind].write_text(json.dumps(data[kind], indent=1) + "\n", encoding="utf-8")
        done += lines
    return done


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--record"]:
        print("usage: python3 tools/scope.py --record   (add the scope fields to the GPU reports' entries that hold "
              "with every dep unchanged; CPU only)")
        sys.exit(2)
    lines = record_reports()
    print("\n".join(lines) or "nothing to record: every entry that holds has its scope fields")
