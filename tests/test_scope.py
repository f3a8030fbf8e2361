"""Evidence scoped to what it proves (tools/scope.py, tools/plan.py; CONTRIBUTING, "GPU evidence"): a plumbing edit
renews the quiet pass and carries stability and the adverse conditions forward where the claims are the same; a
changed claim or verdict, or an edit to an experiment file, asks for the runs. On the recorded reports and on
made-up trees, without a GPU."""
import json
from pathlib import Path

import pytest

import evidence
import gpu_suite
import nbtools
import plan
import scope

ROOT = nbtools.ROOT
REPORTS = ROOT / "reports" / "gpu"
SUITE = nbtools.notebook_paths(nbtools.NOTEBOOK_DIRS)


def _json(name):
    return json.loads((REPORTS / name).read_text(encoding="utf-8"))


# ---- the recorded reports and the library as it is ----------------------------------------------------------------

def test_every_library_module_is_measured_or_plumbing_with_its_reason():
    """A new module of lib/pinlab must be put on scope.MEASURED or scope.PLUMBING (with why) before its notebooks'
    evidence can be scoped; lessons/lNN_*.py and checks/lNN.py are their lesson's experiment by their number."""
    assert scope.unclassified() == [], ("classify these in tools/scope.py (MEASURED: an experiment measures its code; "
                                        f"PLUMBING: it only reports, formats or checks): {scope.unclassified()}")
    for rel, why in {**scope.MEASURED, **scope.PLUMBING}.items():
        assert (ROOT / rel).exists(), f"tools/scope.py classifies {rel}, which no longer exists"
        assert len(why.split()) >= 4, f"{rel}: say why it is on its list"
    assert not set(scope.MEASURED) & set(scope.PLUMBING)


@pytest.mark.parametrize("path", SUITE, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_latest_json_records_the_claims_of_the_committed_outputs(path):
    """The claims a carried-forward run is compared with are those the committed notebook shows (the quiet pass
    wrote both): the report cannot claim what the outputs do not."""
    rel = path.relative_to(ROOT).as_posix()
    row = scope.latest_rows(_json("latest.json")).get(rel)
    assert row is not None, f"{rel} is not in latest.json"
    if evidence.freshness(row) is not None:
        pytest.skip(f"{rel}'s quiet pass is stale: tests/test_evidence.py says so")
    assert "claims" in row, f"{rel}: latest.json records no claims: run `python3 tools/scope.py --record` (CPU)"
    assert row["claims"] == evidence.claims_of(nbtools.load(path)), (
        f"{rel}: latest.json's claims are not those of the committed outputs: run the quiet pass again")
    assert row["claims_sha256"] == evidence.claims_sha256(row["claims"])


def test_carried_runs_have_their_comparison_in_latest_json():
    """Where stability or adverse runs were taken on other deps and hold (only plumbing changed since), latest.json
    says so: the quiet pass's record of the comparison (``carried``) with the same verdict as now."""
    missing = scope.uncarried(_json("latest.json"), _json("stability.json"), _json("adverse.json"))
    assert not missing, f"runs carried forward without latest.json's record of the comparison: {missing}"


def test_runs_whose_deps_outgrew_the_quiet_pass_get_a_quiet_pass_to_record_their_carry(course):
    """Stop 65: solution 01's stability runs had imported races.py, its quiet pass had not; a change to races.py then
    staled no quiet pass, its runs held by the plumbing rule, and nothing would write latest.json's record of that
    comparison (test_carried_runs_have_their_comparison_in_latest_json failed after any renewal). scope.uncarried
    names such a notebook; --plan runs its quiet pass, which writes the record."""
    latest, stab, adv = reports(course)
    row = scope.latest_rows(latest)["notebooks/02_two.ipynb"]
    row["deps"] = [d for d in row["deps"] if d != "lib/pinlab/races.py"]
    row["deps_sha256"] = nbtools.deps_sha256(row["deps"], course)
    row.update(scope.scope_fields(row["path"], row["deps"], row["claims"], "latest", course))
    (course / "reports" / "gpu" / "latest.json").write_text(json.dumps(latest))
    assert scope.uncarried(latest, stab, adv, course) == {}
    with open(course / "lib" / "pinlab" / "races.py", "a", encoding="utf-8") as f:
        f.write("\ndef more():\n    return 1\n")
    missing = scope.uncarried(latest, stab, adv, course)
    assert list(missing) == ["notebooks/02_two.ipynb"] and "stability" in missing["notebooks/02_two.ipynb"]
    st = {r["path"]: r for r in plan.status(course)}
    assert st["notebooks/02_two.ipynb"]["latest"] and "scope.uncarried" in st["notebooks/02_two.ipynb"]["latest"]
    first = plan.make_plan(course)["calls"][0]
    assert "notebooks/02_two.ipynb" in first["work"]["quiet"], first
    cmd = first["steps"][0][0]  # it names the notebook, or --stale, which runs it by scope.uncarried too
    assert "notebooks/02_two.ipynb" in cmd or "--stale" in cmd, cmd
    # the quiet pass on this tree writes the record: nothing is left without it
    entries = {"stability": scope.latest_rows(stab)["notebooks/02_two.ipynb"]}
    row["carried"] = scope.carried_record(entries, None, row, course)
    assert row["carried"]["proofs"]["stability"]["holds"]
    assert "stability" not in scope.uncarried(latest, stab, adv, course).get("notebooks/02_two.ipynb", [])


def test_plan_runs_on_the_committed_tree_and_ends_with_its_count():
    lines = plan.plan_lines()
    assert lines[-1].startswith("plan: ") and "call(s)" in lines[-1] and lines[-1].endswith("device-minutes")


# ---- claims --------------------------------------------------------------------------------------------------------

def _cell(src, out="", count=1):
    return {"cell_type": "code", "id": f"c{abs(hash((src, out))) % 10**9}", "source": src, "metadata": {},
            "outputs": [{"output_type": "stream", "name": "stdout", "text": out}] if out else [],
            "execution_count": count}


def _nb(cells):
    return {"cells": cells, "metadata": {"kernelspec": {"name": "python3"}}, "nbformat": 4, "nbformat_minor": 5}


def test_claims_are_the_asserting_cells_claim_lines_and_every_verdict():
    nb = _nb([
        _cell("x = 1", "a plain print: 3\n"),                                       # not an asserting cell
        _cell("pinlab.claims({...})",
              "[measured] steps: 3 of 4\n           continued: 9\n"
              "corrupted steps with the snapshot, all runs: 0\n"
              "a long claim that wraps onto\n    the next line: True\n"
              "a table row  12  13\n"),
        _cell("check_x(f)", "[measured] checked on: CPU\n✅ f is correct (44 cases,\n   0 corrupted).\n"),
    ])
    assert evidence.claims_of(nb) == [
        [1, "claim", "corrupted steps with the snapshot, all runs", "0"],
        [1, "claim", "a long claim that wraps onto the next line", "True"],
        [2, "verdict", "f is correct (44 cases, 0 corrupted).", "✅"],
    ]


def test_claim_differences_name_what_changed():
    a = [[1, "claim", "corrupted", "0"], [2, "verdict", "f is correct", "✅"]]
    assert evidence.claim_differences(a, a) == []
    assert evidence.claim_differences(a, [[1, "claim", "corrupted", "3"], a[1]]) == [
        "cell 1: claim 'corrupted' was 0, now 3"]
    assert evidence.claim_differences(a, [a[0]]) == ["cell 2: verdict 'f is correct' is gone"]
    assert evidence.claim_differences(a, a + [[3, "claim", "new", "True"]]) == ["cell 3: new claim 'new'"]
    assert evidence.claims_sha256(a) != evidence.claims_sha256([a[0]])


def test_a_run_that_claimed_otherwise_than_its_quiet_pass_is_a_problem(tmp_path):
    (tmp_path / "notebooks").mkdir()
    nb = _nb([_cell("assert True")])
    nbtools.save(nb, tmp_path / "notebooks" / "00_x.ipynb")
    runs = [{"passed": [0], "failed": [], "first_error": None, "lines": [], "claims_sha256": "aaaa"}] * 5
    entry = {"path": "notebooks/00_x.ipynb", "n": 5, "runs": runs, "claims_sha256": "aaaa",
             "assert_cells": [{"cell": 0, "passed": 5, "of": 5}]}
    assert evidence.stability_problems(entry, tmp_path, stale=lambda e: None) == []
    odd = dict(entry, runs=runs[:4] + [dict(runs[0], claims_sha256="bbbb", via="nbval")])
    (p,) = evidence.stability_problems(odd, tmp_path, stale=lambda e: None)
    assert "run 5 (nbval" in p and "claimed otherwise" in p


# ---- a made-up course: two lessons, plumbing and measured modules ----------------------------------------------------

LIB = {
    "__init__.py": "from .claims import claim\nfrom .steploop import run_loop\n",
    "claims.py": "def claim(text, ok):\n    print(f'{text}: {ok}')\n",
    "timing.py": "def show(label, value):\n    print(f'[measured] {label}: {value}')\n",
    "steploop.py": "from .timing import show\n\ndef run_loop():\n    return 0\n",
    "races.py": "def detect():\n    return 0\n",
    "lessons/__init__.py": "",
    "lessons/l01_one.py": "from .. import steploop\nfrom ..timing import show\n\ndef corrupted():\n    return steploop.run_loop()\n",
    "lessons/l02_two.py": "def answer():\n    return 42\n",
}


def _course_nb(lesson, module, claim="corrupted steps", value="0"):
    return _nb([
        _cell(f"import pinlab\nfrom pinlab.lessons import {module} as m"),
        _cell(f"pinlab.claim('{claim}', m.corrupted() == 0)", f"[measured] host: fast\n{claim}: {value}\n"),
    ])


@pytest.fixture
def course(tmp_path):
    """lib/pinlab with plumbing (claims, timing), measured modules (steploop, races) and two lessons; notebooks 01 and
    02 with recorded quiet passes, five stability runs each and lesson 01's adverse runs, all scoped."""
    for rel, text in LIB.items():
        f = tmp_path / "lib" / "pinlab" / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    (tmp_path / "notebooks").mkdir()
    nbtools.save(_course_nb("01", "l01_one"), tmp_path / "notebooks" / "01_one.ipynb")
    nbtools.save(_course_nb("02", "l02_two", "the answer is 42", "True"), tmp_path / "notebooks" / "02_two.ipynb")
    (tmp_path / "reports" / "gpu").mkdir(parents=True)
    record(tmp_path)
    return tmp_path


def deps_of(root):
    return sorted(p.relative_to(root).as_posix() for p in (root / "lib").rglob("*.py") if "l02" not in p.name)


def quiet_row(root, rel):
    nb = nbtools.load(root / rel)
    deps = deps_of(root)
    return {"path": rel, "status": "passed", "seconds": 10.0, "source_sha256": nbtools.source_sha256(nb),
            "deps": deps, "deps_sha256": nbtools.deps_sha256(deps, root), "utc": "t",
            **scope.scope_fields(rel, deps, evidence.claims_of(nb), "latest", root, nb)}


def record(root):
    """Write latest.json, stability.json and adverse.json as a quiet pass, 5 runs and the five conditions would."""
    rows = [quiet_row(root, f"notebooks/{n}") for n in ("01_one.ipynb", "02_two.ipynb")]
    stab = []
    for r in rows:
        runs = [{"utc": "t", "seconds": 10.0, "first_error": None, "passed": [1], "failed": [], "lines": [],
                 "claims_sha256": r["claims_sha256"]} for _ in range(5)]
        stab.append({"path": r["path"], "source_sha256": r["source_sha256"], "deps": r["deps"],
                     "deps_sha256": r["deps_sha256"], "utc": "t", "runs": runs,
                     **scope.scope_fields(r["path"], r["deps"], r["claims"], "stability", root),
                     **evidence.aggregate_stability(runs, nbtools.load(root / r["path"]))})
    conds = []
    for cid, spec in evidence.ADVERSE_CONDITIONS.items():
        entries = [{"path": r["path"], "source_sha256": r["source_sha256"], "deps": r["deps"],
                    "deps_sha256": r["deps_sha256"],
                    **scope.scope_fields(r["path"], r["deps"], r["claims"], "adverse", root),
                    "runs": [{"learner": k + 1, "cells": 2, "passed": 2, "failed": 0, "skipped": 0, "not_run": 0,
                              "seconds": 25.0} for k in range(spec["learners"])]} for r in rows]
        conds.append({"id": cid, "env": spec["env"], "notebooks": entries})
    gpu = root / "reports" / "gpu"
    (gpu / "latest.json").write_text(json.dumps({"notebooks": rows, "unit_tests": {"seconds": 40.0}}))
    (gpu / "stability.json").write_text(json.dumps({"notebooks": stab}))
    (gpu / "adverse.json").write_text(json.dumps({"conditions": conds}))


def reports(root):
    gpu = root / "reports" / "gpu"
    return [json.loads((gpu / f"{k}.json").read_text()) for k in ("latest", "stability", "adverse")]


def problems(root):
    latest, stab, adv = reports(root)
    check = scope.stale_check(latest, root)
    out = [p for e in stab["notebooks"] for p in evidence.stability_problems(e, root, stale=check)]
    paths = nbtools.notebook_paths(("notebooks",), root)
    return out + evidence.adverse_problems(dict(adv, **{k: "x" for k in ("gpu", "driver", "torch", "cuda",
                                                                        "flashinfer", "python", "utc")}),
                                           paths, root, stale=check)


def requote(root, rel, claims=None):
    """The quiet pass on the current tree: a new latest.json row for ``rel`` (with other ``claims`` if given)."""
    latest, stab, adv = reports(root)
    previous = scope.latest_rows(latest).get(rel)
    row = quiet_row(root, rel)
    if claims is not None:
        row.update(claims=claims, claims_sha256=evidence.claims_sha256(claims))
    entries = scope.carried_entries(rel, stab, adv, root)
    if entries:  # as gpu_suite.record_carried writes it after each quiet pass
        row["carried"] = scope.carried_record(entries, previous, row, root)
    latest["notebooks"] = [row if r["path"] == rel else r for r in latest["notebooks"]]
    (root / "reports" / "gpu" / "latest.json").write_text(json.dumps(latest))


def test_the_experiment_is_the_lesson_and_what_it_measures(course):
    assert scope.experiment_files("notebooks/01_one.ipynb", course) == [
        "lib/pinlab/lessons/l01_one.py", "lib/pinlab/steploop.py"]  # not claims.py, timing.py: plumbing
    assert scope.experiment_files("notebooks/02_two.ipynb", course) == ["lib/pinlab/lessons/l02_two.py"]
    assert problems(course) == []


def test_a_plumbing_edit_with_the_same_claims_carries_the_runs_forward(course):
    for rel in ("claims.py", "timing.py"):
        f = course / "lib" / "pinlab" / rel
        f.write_text(f.read_text() + "# a comment\n")
    before = problems(course)
    assert before and all("quiet pass is stale too" in p for p in before)
    assert any("lib/pinlab/claims.py, lib/pinlab/timing.py changed" in p for p in before)
    lines = plan.plan_lines(course)
    assert lines[-1].startswith("plan: 1 call(s), ")
    assert not any("--adverse" in ln or "--stability-only" in ln for ln in lines)
    minutes = float(lines[-1].split()[3])
    assert lines[-2] == (f"a session has 30 device-minutes: {30 - minutes:.1f} left for starts that fail (each "
                         "costs about 3.0 min)"), lines[-2]  # plan.FAILED_START_S: 180 s (stop 61)
    old, plan.SESSION_MIN = plan.SESSION_MIN, 1.0
    try:
        assert "more than that: land it over several sessions" in plan.plan_lines(course)[-2]
    finally:
        plan.SESSION_MIN = old
    requote(course, "notebooks/01_one.ipynb")
    requote(course, "notebooks/02_two.ipynb")
    assert problems(course) == []
    assert plan.plan_lines(course)[-1] == "plan: 0 call(s), 0.0 device-minutes"


def test_a_changed_claim_or_verdict_fails_the_carried_runs(course):
    (course / "lib" / "pinlab" / "claims.py").write_text(LIB["claims.py"] + "# reworded\n")
    claims = evidence.claims_of(nbtools.load(course / "notebooks" / "01_one.ipynb"))
    requote(course, "notebooks/01_one.ipynb", [[1, "claim", "corrupted steps", "3"]])
    requote(course, "notebooks/02_two.ipynb")
    found = problems(course)
    assert found and all("01_one" in p and "claims otherwise" in p for p in found)
    requote(course, "notebooks/01_one.ipynb", [[1, "claim", "corrupted steps, reworded", "0"]])  # another key
    assert problems(course) and all("claims otherwise" in p for p in problems(course))
    requote(course, "notebooks/01_one.ipynb", claims)
    assert problems(course) == []


def test_an_experiment_edit_asks_for_that_lessons_runs_and_no_other(course):
    f = course / "lib" / "pinlab" / "steploop.py"
    f.write_text(f.read_text() + "LOOP_VERSION = 2  # the loop changed\n")
    requote(course, "notebooks/01_one.ipynb")  # the quiet pass claims the same: it does not help
    requote(course, "notebooks/02_two.ipynb")
    found = problems(course)
    assert found and all("01_one" in p for p in found)
    assert any("an experiment file changed after its runs: lib/pinlab/steploop.py" in p for p in found)
    text = "\n".join(plan.plan_lines(course))
    assert "--adverse-all-together --only notebooks/01_one.ipynb" in text
    assert "02_two" not in text.split("call 1")[1]


def test_a_comment_or_docstring_in_an_experiment_file_is_plumbing_to_the_runs(course):
    """An experiment file whose code is unchanged (a comment, a docstring, the layout: nbtools.code_form_sha) renews
    the quiet pass only, like a plumbing edit: the runs carry forward where the quiet pass claims what they claimed.
    Entries recorded before ``experiment_forms`` was kept still ask for the runs (their code form is unknown)."""
    f = course / "lib" / "pinlab" / "steploop.py"
    text, form = f.read_text(), nbtools.code_form_sha("lib/pinlab/steploop.py", course)
    f.write_text('"""The step loop (a docstring added)."""\n' + text.replace("\n", "\n\n", 1) + "# a comment\n")
    assert nbtools.code_form_sha("lib/pinlab/steploop.py", course) == form
    f.write_text(text + "X = 1\n")
    assert nbtools.code_form_sha("lib/pinlab/steploop.py", course) != form
    f.write_text('"""The step loop (a docstring added)."""\n' + text.replace("\n", "\n\n", 1) + "# a comment\n")
    found = problems(course)
    assert found and not any("an experiment file changed" in p for p in found)
    assert all("quiet pass is stale too" in p for p in found)
    text_plan = "\n".join(plan.plan_lines(course))
    assert "--adverse" not in text_plan and "--stability-only" not in text_plan
    requote(course, "notebooks/01_one.ipynb")
    requote(course, "notebooks/02_two.ipynb")
    assert problems(course) == []
    # recorded before experiment_forms was kept: the bytes decide, as before
    for rel in ("stability.json", "adverse.json"):
        path = course / "reports" / "gpu" / rel
        rep = json.loads(path.read_text())
        for e in rep.get("notebooks", []) + [e for c in rep.get("conditions", []) for e in c["notebooks"]]:
            e.pop("experiment_forms", None)
        path.write_text(json.dumps(rep))
    assert any("an experiment file changed after its runs: lib/pinlab/steploop.py" in p for p in problems(course))


def test_a_new_import_changes_the_experiment(course):
    f = course / "lib" / "pinlab" / "lessons" / "l02_two.py"
    f.write_text("from ..races import detect\n" + f.read_text())
    assert scope.experiment_files("notebooks/02_two.ipynb", course) == [
        "lib/pinlab/lessons/l02_two.py", "lib/pinlab/races.py"]
    assert any("02_two" in p and "it now also uses lib/pinlab/races.py" in p for p in problems(course))


def _edit_cell(root, rel, index, src):
    nb = nbtools.load(root / rel)
    nb["cells"][index]["source"] = src
    nbtools.save(nb, root / rel)


def test_a_reformat_of_a_notebooks_code_carries_the_runs_forward(course):
    """Issue 49's formatter: the same code laid out otherwise (line breaks, quotes, spacing, a trailing comma, a
    string split in two) renews the quiet pass only, like a plumbing edit: the runs carry forward where the quiet
    pass on the new source claims what they claimed."""
    rel = "notebooks/01_one.ipynb"
    latest, _, adv = reports(course)
    for c in adv["conditions"]:  # lesson 01 takes sharing worse: its own runs set its estimate
        for e in c["notebooks"]:
            for r in e["runs"] if e["path"] == rel else []:
                r["seconds"] = 50.0
    estimate = plan.adverse_seconds(adv, latest, course)
    assert estimate[rel] == 50.0
    _edit_cell(course, rel, 1, 'pinlab.claim(\n    "corrupted " "steps",\n    m.corrupted()  ==  0,\n)\n')
    assert plan.adverse_seconds(adv, latest, course) == estimate  # its runs still tell how long it takes
    found = problems(course)
    assert found and all("01_one" in p and "quiet pass is stale too" in p for p in found), found
    assert any(f"the layout of {rel}'s code changed" in p for p in found)
    lines = plan.plan_lines(course)
    assert lines[-1].startswith("plan: 1 call(s), ") and not any("--adverse" in ln for ln in lines), lines
    requote(course, rel)
    assert problems(course) == []


def test_the_adverse_estimate_is_each_notebooks_own_longest_pass(course):
    """Stop 58: the median slow-down of all notebooks (2.1x) planned lesson 09's adverse pass at 153 s; it took
    81.5 s (x0.56: outside issue 44's +-30%). A notebook's own longest pass is its estimate, not less than its
    quiet seconds; the median slow-down is for a notebook never run under the conditions."""
    latest, _, adv = reports(course)
    q = plan.quiet_seconds(latest)
    for c in adv["conditions"]:
        for e in c["notebooks"]:
            for r in e["runs"]:
                r["seconds"] = 35.0 if e["path"] == "notebooks/01_one.ipynb" else 4.0
    est = plan.adverse_seconds(adv, latest, course)
    assert est["notebooks/01_one.ipynb"] == 35.0
    assert est["notebooks/02_two.ipynb"] == q["notebooks/02_two.ipynb"] > 4.0  # the quiet floor
    for c in adv["conditions"]:
        c["notebooks"] = [e for e in c["notebooks"] if e["path"] != "notebooks/02_two.ipynb"]
    est = plan.adverse_seconds(adv, latest, course)
    assert est["notebooks/02_two.ipynb"] == 35.0 / q["notebooks/01_one.ipynb"] * q["notebooks/02_two.ipynb"]


@pytest.mark.parametrize("src, why", [
    ("pinlab.claim('corrupted steps', m.corrupted() == 1)", "the code"),
    ("pinlab.claim('corrupted steps', m.corrupted() == 0)  # a new comment", "a comment"),
])
def test_a_change_beyond_layout_asks_for_the_runs(course, src, why):
    rel = "notebooks/01_one.ipynb"
    _edit_cell(course, rel, 1, src)
    requote(course, rel)  # the quiet pass claims the same: it does not help
    found = problems(course)
    assert found and any(f"{rel} changed after its runs" in p for p in found), (why, found)
    assert "--adverse-all-together --only notebooks/01_one.ipynb" in "\n".join(plan.plan_lines(course))


def test_stability_runs_accumulate_across_a_reformat(course):
    rel = "notebooks/01_one.ipynb"
    _edit_cell(course, rel, 1, 'pinlab.claim(\n    "corrupted steps", m.corrupted() == 0\n)\n')
    requote(course, rel)
    latest, stab, _ = reports(course)
    row = scope.latest_rows(latest)[rel]
    new = {"path": rel, "source_sha256": row["source_sha256"], "deps": row["deps"], "deps_sha256": row["deps_sha256"],
           "utc": "t2", "runs": [dict(stab["notebooks"][0]["runs"][0], utc="t2")],
           **scope.scope_fields(rel, row["deps"], row["claims"], "stability", course)}
    merged, _ = evidence.merge_stability(stab["notebooks"], [new], [rel], course, stale=scope.stale_check(latest, course),
                                         dead=scope.dead_check(latest, course))
    (e,) = [m for m in merged if m["path"] == rel]
    assert len(e["runs"]) == 6 and e["source_sha256"] == row["source_sha256"]


def test_the_form_of_code_is_its_syntax_comments_and_magics():
    a = 'def f(x):\n    """Two   words\n    wrapped."""\n    return g(x, \'a\' "b")  # why\n%time f(1)\n'
    b = 'def f(x):\n    """Two words wrapped."""\n    return g(\n        x,\n        "ab",\n    )  # why\n%time f(1)\n'
    assert nbtools.code_form(a) == nbtools.code_form(b)
    moved = 'def f(x):\n    """Two words wrapped."""\n    # why\n    return g(x, "ab")\n%time f(1)\n'
    assert nbtools.code_form(moved) == nbtools.code_form(a)  # a comment moved above its line
    for other in (a.replace("# why", "# why not"), a.replace("%time", "%timeit"), a.replace("g(x", "g(-x"),
                  a.replace("Two", "Three")):
        assert nbtools.code_form(other) != nbtools.code_form(a), other
    assert nbtools.code_form("def (:") == "unparsed:def (:"
    # the same text on every Python the course runs (CI 3.11, the GPU 3.12): no positions, no empty fields
    assert nbtools.code_form("def f(x=1):\n    return [x]\n") == (
        "Module(body=[FunctionDef(name='f', args=arguments(args=[arg(arg='x')], defaults=[Constant(value=1)]), "
        "body=[Return(value=List(elts=[Name(id='x', ctx=Load())], ctx=Load()))])])\n# ")
    md = {"cell_type": "markdown", "source": "Some  text"}
    code = _cell("x  =  1")
    assert nbtools.source_form_sha256({"cells": [md, code]}) == nbtools.source_form_sha256(
        {"cells": [md, _cell("x = 1")]})
    assert nbtools.source_form_sha256({"cells": [md, code]}) != nbtools.source_form_sha256(
        {"cells": [dict(md, source="Some text"), code]})  # Markdown is read as written


def test_a_sentence_fixed_renews_the_quiet_pass_and_carries_the_runs(course):
    """Stop 58: Markdown is not run. A notebook whose prose changed (a sentence fixed, a Markdown cell added) keeps
    its code's form (nbtools.code_form_sha256), so it renews its quiet pass only, and its stability and adverse runs
    carry forward where that pass claims what they claimed; lesson 09's one new sentence had asked for all its runs
    (7.2 device-minutes where its quiet pass is 1.7). A cell inserted before a claim moves the claim's cell number,
    so the quiet pass claims otherwise (evidence.claims_of numbers the cells) and the runs are asked for."""
    rel = "notebooks/01_one.ipynb"
    nb = nbtools.load(course / rel)
    before = nbtools.code_form_sha256(nb)
    nb["cells"].append({"cell_type": "markdown", "metadata": {}, "source": "The ring's *second* slot."})
    nbtools.save(nb, course / rel)
    assert nbtools.code_form_sha256(nbtools.load(course / rel)) == before
    found = problems(course)
    assert found and all("01_one" in p and "quiet pass is stale too" in p for p in found), found
    assert any(f"{rel}'s prose or its code's layout changed" in p for p in found), found
    lines = plan.plan_lines(course)
    assert lines[-1].startswith("plan: 1 call(s), ") and not any("--adverse" in ln for ln in lines), lines
    requote(course, rel)
    assert problems(course) == []
    requote(course, rel, claims=[[1, "claim", "corrupted steps", "1"]])
    assert problems(course), "a quiet pass that claims otherwise carries nothing"
    _edit_cell(course, rel, 1, "pinlab.claim('corrupted steps', m.corrupted() == 1)")
    requote(course, rel)
    assert any(f"{rel} changed after its runs" in p for p in problems(course)), "changed code asks for the runs"


def test_the_form_of_a_notebooks_code_leaves_its_prose_out():
    code = _cell("x = 1")
    md = {"cell_type": "markdown", "metadata": {}, "source": "Some text."}
    base = nbtools.code_form_sha256({"cells": [md, code]})
    assert nbtools.code_form_sha256({"cells": [dict(md, source="Other text."), code]}) == base
    assert nbtools.code_form_sha256({"cells": [code]}) == base
    assert nbtools.code_form_sha256({"cells": [md, _cell("x = 2")]}) != base
    assert nbtools.code_form_sha256({"cells": [md, code, _cell("y = 1")]}) != base
    assert nbtools.code_form_sha256({"cells": [md, _cell("x = 1  # why")]}) != base  # a comment is code's


def test_every_recorded_entry_keeps_its_sources_form():
    """What lets a formatter's pass carry the runs: every stability and adverse entry of a notebook records the form
    of the source it ran (scope.record_missing_scope added it to the entries recorded before 2026-12-05)."""
    for e in _json("stability.json")["notebooks"] + [e for c in _json("adverse.json")["conditions"]
                                                      for e in c["notebooks"]]:
        assert len(e.get("source_form_sha256") or "") == 64, e["path"]
        if e["source_sha256"] == nbtools.source_sha256(nbtools.load(ROOT / e["path"])):
            assert len(e.get("code_form_sha256") or "") == 64, e["path"]  # scope.py --record adds it


def test_the_plan_for_a_plumbing_edit_is_one_call_of_at_most_nine_minutes(course):
    (course / "lib" / "pinlab" / "timing.py").write_text(LIB["timing.py"] + "# x\n")
    p = plan.make_plan(course)
    assert len(p["calls"]) == 1 and p["calls"][0]["seconds"] <= plan.CALL_LIMIT_S
    (cmd, what, secs), = p["calls"][0]["steps"]
    assert cmd == "python3 tools/gpu_suite.py --stale" and "gpu unit tests" in what
    assert secs == plan.FIXED_S + 10.0 + 10.0 + 40.0  # the recorded seconds, and the unit tests'


def test_a_renewal_records_its_planned_and_actual_seconds(tmp_path):
    path = tmp_path / "renewals.json"
    rec = plan.record_renewal("python3 tools/gpu_suite.py --stale", "quiet", 400.0, 460.0, ["a", "b"], path, "t")
    assert rec["ratio"] == 1.15 and json.loads(path.read_text())["renewals"][-1] == rec


def test_the_quiet_pass_records_the_comparison_that_carries_runs(course, monkeypatch):
    monkeypatch.setattr(gpu_suite, "REPORTS", course / "reports" / "gpu")
    old = reports(course)[0]
    (course / "lib" / "pinlab" / "claims.py").write_text(LIB["claims.py"] + "# x\n")
    same = quiet_row(course, "notebooks/01_one.ipynb")
    other = dict(quiet_row(course, "notebooks/02_two.ipynb"), claims=[], claims_sha256=evidence.claims_sha256([]))
    lines = gpu_suite.record_carried([same, other], old, course)
    assert same["carried"]["proofs"]["stability"]["holds"] and same["carried"]["differences"] == []
    assert not other["carried"]["proofs"]["adverse (a)"]["holds"]
    assert other["carried"]["differences"] == ["cell 1: claim 'the answer is 42' is gone"]
    assert any("carried forward: adverse (a)" in ln for ln in lines)
    assert any("to renew" in ln and "02_two" in ln for ln in lines)


def test_plan_takes_no_other_option_and_needs_no_gpu(capsys):
    with pytest.raises(SystemExit):
        gpu_suite.parse_args(["--plan", "--only", "04"])
    assert gpu_suite.main(["--plan"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("plan: ")


def _fake_plan(steps):
    return {"calls": [{"steps": steps, "seconds": sum(t for _, _, t in steps)}, {"steps": [], "seconds": 0}]}


def test_next_call_runs_the_plans_first_call_within_its_seconds(monkeypatch, capsys):
    steps = [("python3 tools/gpu_suite.py --stale --only notebooks/01_x.ipynb", "quiet pass of 01", 100.0),
             ("python3 tools/gpu_suite.py --adverse-all-together --only notebooks/01_x.ipynb", "adverse of 01", 200.0),
             ("python3 tools/gpu_suite.py --repeat 5 --stale --stability-only --only solutions/01_x.ipynb", "s", 50.0)]
    monkeypatch.setattr(plan, "make_plan", lambda root=None: _fake_plan(steps))
    now, ran = [0.0], []

    def run(argv, cwd):
        ran.append(argv)
        now[0] += 150.0  # each command takes 150 s
        return type("Done", (), {"returncode": 0})()

    assert gpu_suite.run_next_call(545, run=run, clock=lambda: now[0]) == 0
    assert [a[1:-2] for a in ran] == [s[0].split()[1:] for s in steps]
    assert [a[-2:] for a in ran] == [["--budget", "545"], ["--budget", "395"], ["--budget", "245"]]
    assert all(a[0] == gpu_suite.sys.executable for a in ran)
    ran.clear()
    now[0] = 0.0
    assert gpu_suite.run_next_call(330, run=run, clock=lambda: now[0]) == gpu_suite.UNFINISHED  # 30 s left
    assert len(ran) == 3 - 1 and "not started: s" in capsys.readouterr().out

    def fails(argv, cwd):
        ran.append(argv)
        return type("Done", (), {"returncode": 3})()

    ran.clear()
    assert gpu_suite.run_next_call(545, run=fails, clock=lambda: 0.0) == 3 and len(ran) == 1
    monkeypatch.setattr(plan, "make_plan", lambda root=None: {"calls": []})
    assert gpu_suite.run_next_call(545, run=fails, clock=lambda: 0.0) == 0
    assert "nothing to renew" in capsys.readouterr().out


def test_next_call_runs_a_later_call_first(monkeypatch, capsys):
    """--call N: a session with less device time left than call 1 needs runs a shorter, later call (stop 61: 7.5
    device-minutes were left, call 1 took 9.9 and call 3 4.8); a call past the plan's last is refused."""
    first = [("python3 tools/gpu_suite.py --only notebooks/01_x.ipynb", "quiet pass of 01", 400.0)]
    third = [("python3 tools/gpu_suite.py --only notebooks/09_x.ipynb --no-unit-tests", "quiet pass of 09", 80.0)]
    calls = {"calls": [{"steps": first, "seconds": 400.0}, {"steps": first, "seconds": 400.0},
                       {"steps": third, "seconds": 80.0}]}
    monkeypatch.setattr(plan, "make_plan", lambda root=None: calls)
    ran = []

    def run(argv, cwd):
        ran.append(argv)
        return type("Done", (), {"returncode": 0})()

    assert gpu_suite.run_next_call(300, run=run, clock=lambda: 0.0, number=3) == 0
    assert [a[1:] for a in ran] == [third[0][0].split()[1:] + ["--budget", "300"]]
    assert "call 3 of 3" in capsys.readouterr().out
    assert gpu_suite.run_next_call(300, run=run, clock=lambda: 0.0, number=4) == 2 and len(ran) == 1
    assert "the plan has 3 call(s)" in capsys.readouterr().out
    assert gpu_suite.parse_args(["--next-call", "300", "--call", "3"]).call == 3


@pytest.mark.parametrize("argv, message", [
    (["--next-call", "545", "--only", "04"], "takes no other option"),
    (["--next-call", "545", "--call", "0"], "1 or more"),
    (["--call", "2"], "give --next-call S too"),
    (["--next-call", "30"], "60-600"),
    (["--next-call", "900"], "60-600"),
])
def test_next_call_refuses_what_it_cannot_do(argv, message, capsys):
    with pytest.raises(SystemExit):
        gpu_suite.parse_args(argv)
    assert message in capsys.readouterr().err


# ---- the quiet pass itself, end to end, on a copy of the checkout (CUDA and a quiet GPU faked) --------------------

FLIGHT = r'''
import os, sys
root = sys.argv[1]
sys.path[:0] = [os.path.join(root, "tools"), os.path.join(root, "lib")]
import torch
torch.cuda.is_available = lambda: True
import gpu_suite
quiet = {"other_gpu_processes": [], "load": [0.1, 0.1, 0.1], "cores": 2}
gpu_suite.suite_facts = lambda: {"gpu": "a faked GPU", "driver": "0", "capability": "9.0", "torch": torch.__version__,
                                 "cuda_runtime": "0", "flashinfer": None, "uuid": None, "cuda_available": True}
gpu_suite.sample_conditions = gpu_suite.sample_end = lambda *a, **k: dict(quiet)
gpu_suite.gpu_test_files = lambda: []
sys.exit(gpu_suite.main(sys.argv[2:]))
'''


def _course_with_a_plumbing_comment(tmp_path):
    """A copy of the course (its recorded evidence included) with a comment appended to claims.py and timing.py,
    and the environment to run its tools in; returns (copy, env, what `--plan` printed there)."""
    import os
    import shutil
    import subprocess
    import sys

    copy = tmp_path / "course"
    for rel in ("lib", "tools", "notebooks", "solutions", "reports", "examples", "conftest.py", "pyproject.toml",
                "tests/nbval_sanitize.cfg", "tests/gpu_child.py", "tests/test_evidence.py", "tests/test_scope.py"):
        src, dst = ROOT / rel, copy / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if src.is_dir() else shutil.copyfile)(src, dst)
    for rel in ("lib/pinlab/claims.py", "lib/pinlab/timing.py"):
        with open(copy / rel, "a", encoding="utf-8") as f:
            f.write("# a comment: plumbing only\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PINLAB_")}
    planned = subprocess.run([sys.executable, "tools/gpu_suite.py", "--plan"], cwd=copy, capture_output=True,
                             text=True, env=env)
    return copy, env, planned.stdout


def _recorded_quiet_seconds():
    latest = json.loads((ROOT / "reports" / "gpu" / "latest.json").read_text(encoding="utf-8"))
    notebooks = sum(e.get("seconds") or 0.0 for e in latest["notebooks"])
    return latest.get("gpu"), notebooks, (latest.get("unit_tests") or {}).get("seconds")


@pytest.fixture(scope="module")
def plumbing_plan(tmp_path_factory):
    """What `--plan` prints for a comment in claims.py and timing.py on a copy of the course as recorded (made once
    for the two tests that read it)."""
    return _course_with_a_plumbing_comment(tmp_path_factory.mktemp("plumbing"))[2]


@pytest.mark.slow
def test_a_plumbing_edit_of_the_course_as_recorded_lands_in_one_session(plumbing_plan):
    """Issue 44's problem on the course's own recorded seconds: a comment in claims.py and timing.py must renew within
    one session's device time, with room left for failed starts: at most 2 calls and 15 device-minutes sent back to
    back (one machine start). Stop 62 (an H100): 2 calls, 11.2 device-minutes chained (12.5 with a start per call)."""
    planned = plumbing_plan
    last = planned.strip().splitlines()[-1]
    calls = int(last.split("plan: ", 1)[1].split(" call(s)", 1)[0])
    chained = [line for line in planned.splitlines() if "the machine stays warm: about" in line]
    minutes = float(chained[0].split("about ", 1)[1].split(" device-minutes", 1)[0]) if chained else \
        float(last.split(", ", 1)[1].split(" device-minutes", 1)[0])
    assert calls <= 2 and minutes <= 15.0, planned[-2000:]


@pytest.mark.slow
def test_a_plumbing_edit_of_the_course_as_recorded_is_one_call(plumbing_plan):
    """Issue 44's target on the course's own recorded seconds: a comment in claims.py and timing.py renews in one
    device call of at most 9 minutes (the quiet pass of every notebook and the gpu unit tests). Met in stop 59 on an
    H200 (326 s of notebooks, 57.1 s of gpu unit tests: 1 call, 8.2 device-minutes) and in stop 60 on an H100
    (313 s); not met by stop 62's H100 recording (474 s of notebooks and 80.4 s of unit tests: the same notebooks
    took 1.2-2x as long on that machine: 00_start_here 15.1 s against 7.9 and 01_pinned_memory 45.5 against 26.0,
    lessons whose experiments did not change), where
    --plan says 2 calls. The target depends on the machine the last quiet pass ran on, so this reports it (an xfail
    naming the recorded seconds) rather than failing; the test above holds what every recording must meet."""
    planned = plumbing_plan
    if not planned.strip().splitlines()[-1].startswith("plan: 1 call(s), "):
        gpu, notebooks, unit = _recorded_quiet_seconds()
        pytest.xfail(f"issue 44's one-call target is not met by the latest quiet pass ({gpu}: {notebooks:.0f} s of "
                     f"notebooks, {unit} s of gpu unit tests): {planned.strip().splitlines()[-1]}")


@pytest.mark.slow
def test_a_plumbing_edit_lands_after_one_quiet_pass_end_to_end(tmp_path):
    """A comment in claims.py and timing.py, then the quiet passes --plan prints (and nothing else: no stability or
    adverse run), on a copy of the course (the notebooks replay: no GPU here): the pass records claims and the
    comparison, the runs carry forward, and the edited notebooks' evidence holds again, in the copy's own evidence
    tests. How many calls that is on the recorded seconds: the test above."""
    import subprocess
    import sys

    copy, env, planned = _course_with_a_plumbing_comment(tmp_path)
    lines = planned.strip().splitlines()
    assert lines[-1].startswith("plan: ") and "quiet pass of" in planned, planned[-2000:]
    assert not any("--adverse" in ln or "--stability-only" in ln for ln in lines), planned[-2000:]
    assert "20 notebooks carry their stability and adverse runs forward" in planned, planned[-2000:]
    only = ["--stale", "--only", "notebooks/00", "solutions/06"]
    ran = subprocess.run([sys.executable, "-c", FLIGHT, str(copy), *only], cwd=copy, capture_output=True, text=True,
                         env=env, timeout=600)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-2000:]
    assert "notebooks/00_start_here.ipynb: carried forward:" in ran.stdout
    assert "solutions/06_device_side_indices.ipynb: carried forward: stability" in ran.stdout
    latest = json.loads((copy / "reports" / "gpu" / "latest.json").read_text())
    rows = scope.latest_rows(latest)
    assert rows["solutions/06_device_side_indices.ipynb"]["carried"]["proofs"]["stability"]["holds"]
    renewal = json.loads((copy / "reports" / "gpu" / "renewals.json").read_text())["renewals"][-1]
    assert renewal["planned_s"] > 0 and renewal["actual_s"] > 0
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                            "tests/test_evidence.py", "tests/test_scope.py", "-k",
                            "(covers_notebook or latest_json_records) and (00_start or (06_device and solutions)) or carried"],
                           cwd=copy, capture_output=True, text=True, env=env, timeout=600)
    assert tests.returncode == 0 and " passed" in tests.stdout, tests.stdout[-3000:]


def _three_runs_of_02(course, unit_tests_current=True):
    gpu = course / "reports" / "gpu"
    stab = json.loads((gpu / "stability.json").read_text())
    for e in stab["notebooks"]:
        if e["path"] == "notebooks/02_two.ipynb":
            e["runs"] = e["runs"][:3]
            e.update(evidence.aggregate_stability(e["runs"], nbtools.load(course / e["path"])))
    (gpu / "stability.json").write_text(json.dumps(stab))
    if unit_tests_current:
        latest = json.loads((gpu / "latest.json").read_text())
        latest["unit_tests"].update(passed=12, failed=0, failures=[], inputs_sha256=nbtools.unit_test_sha256(course))
        (gpu / "latest.json").write_text(json.dumps(latest))


def test_too_few_runs_ask_for_runs_only_not_another_quiet_pass(course):
    _three_runs_of_02(course)
    p = plan.make_plan(course)
    (call,) = p["calls"]
    (cmd, what, _), = call["steps"]
    assert cmd == "python3 tools/gpu_suite.py --repeat 5 --stale --stability-only --only notebooks/02_two.ipynb"


def test_gpu_unit_tests_not_current_ride_with_the_quickest_quiet_pass_where_no_quiet_pass_is_stale(course):
    """Stop 57: a test changed while only stability and adverse runs were left to renew, and the plan ran the gpu
    unit tests nowhere (they go with a quiet pass, and no call had one). Now the first call gives them the quiet
    pass of the notebook the recorded seconds say is quickest; with the unit tests current, no quiet pass."""
    _three_runs_of_02(course, unit_tests_current=False)
    assert not plan.unit_tests_current(course)
    quick = plan.quickest(course)
    assert quick in ("notebooks/01_one.ipynb", "notebooks/02_two.ipynb")
    (first, then), = [c["steps"] for c in plan.make_plan(course)["calls"]]
    assert first[0] == f"python3 tools/gpu_suite.py --only {quick}" and "gpu unit tests" in first[1]
    assert then[0] == "python3 tools/gpu_suite.py --repeat 5 --stale --stability-only --only notebooks/02_two.ipynb"



def test_gpu_unit_tests_that_passed_on_these_files_are_not_planned_again(course):
    """Stop 56: a renewal over several calls ran the gpu unit tests in its first call, and the plan put them in the
    next session's first call again (about 2 of its 27 device-minutes) though no file they depend on had changed.
    latest.json's unit_tests records ``inputs_sha256`` (nbtools.unit_test_sha256: lib/, tools/, conftest.py, the
    tests' helpers, the gpu test files and the test files they import); a plan leaves the unit tests out while it
    matches, and puts them back when one of those files changes."""
    (course / "lib" / "pinlab" / "timing.py").write_text(LIB["timing.py"] + "# x\n")
    latest_path = course / "reports" / "gpu" / "latest.json"
    latest = json.loads(latest_path.read_text())
    assert not plan.unit_tests_current(course)  # recorded before the hash was kept
    latest["unit_tests"].update(passed=12, failed=0, failures=[], inputs_sha256=nbtools.unit_test_sha256(course))
    latest_path.write_text(json.dumps(latest))
    assert plan.unit_tests_current(course)
    p = plan.make_plan(course)
    (cmd, what, secs), = p["calls"][0]["steps"]
    assert cmd == "python3 tools/gpu_suite.py --stale --no-unit-tests" and "unit tests" not in what
    assert secs == plan.FIXED_S + 10.0 + 10.0
    assert any("the gpu unit tests are left out" in ln for ln in plan.plan_lines(course))
    (course / "tests").mkdir(exist_ok=True)
    (course / "tests" / "test_new.py").write_text("def test_x():\n    pass\n")
    assert plan.unit_tests_current(course)  # a test file with no gpu test, imported by none: no GPU run (stop 57)
    (course / "tests" / "test_gpu.py").write_text("import pytest\nfrom test_new import *\n\n\n"
                                                  "@pytest.mark.gpu\ndef test_y():\n    pass\n")
    assert not plan.unit_tests_current(course)
    latest["unit_tests"].update(inputs_sha256=nbtools.unit_test_sha256(course))
    latest_path.write_text(json.dumps(latest))
    assert plan.unit_tests_current(course)
    (course / "tests" / "test_new.py").write_text("def test_x():\n    assert 1\n")  # a gpu test file imports it
    assert not plan.unit_tests_current(course)
    (cmd, what, _), = plan.make_plan(course)["calls"][0]["steps"]
    assert cmd == "python3 tools/gpu_suite.py --stale" and "gpu unit tests" in what
    latest["unit_tests"].update(inputs_sha256=nbtools.unit_test_sha256(course), failed=1)
    latest_path.write_text(json.dumps(latest))
    assert not plan.unit_tests_current(course)  # a failed run proves nothing


def test_a_stability_only_command_is_planned_with_its_own_fixed_part(course):
    """Stop 56: a --stability-only command of 4 runs took 32.6 s (set-up 8.6 s) where the plan said 51.6 s (x0.63,
    outside issue 44's +-30%): it runs no unit tests and no nbval, so its fixed part is smaller than a quiet pass's."""
    assert plan.FIXED_STABILITY_S < plan.FIXED_S
    assert plan.estimate(["notebooks/01_one.ipynb"], "stability", course, repeat=4) == plan.FIXED_STABILITY_S + 4 * 10.0
    assert plan.estimate(["notebooks/01_one.ipynb"], "quiet", course) == plan.FIXED_S + 10.0


def test_calls_sent_back_to_back_are_planned_with_one_start(course, monkeypatch):
    """Stop 57: a call sent within 30 s of the last one's reply found the machine warm (396 s held for a 386 s
    command): --plan says what the calls cost sent that way, one start and plan.WARM_S per later call."""
    real = plan.make_plan(course)
    fake = dict(real, calls=[{"steps": [("a", "x", 300.0)], "seconds": 300.0, "covers": ["n"]},
                             {"steps": [("b", "y", 240.0)], "seconds": 240.0, "covers": ["m"]}])
    monkeypatch.setattr(plan, "make_plan", lambda root=None: fake)
    lines = plan.plan_lines(course)
    warm = (plan.START_S + 540.0 + plan.WARM_S) / 60
    assert any(ln.startswith("sent back to back") and f"about {warm:.1f} device-minutes, one start" in ln
               for ln in lines), lines
    assert lines[-1] == f"plan: 2 call(s), {(540.0 + 2 * plan.START_S) / 60:.1f} device-minutes"


def test_experiment_forms_are_recorded_only_for_the_very_files_the_runs_used(course):
    """scope.record_missing_scope gives an entry recorded before ``experiment_forms`` the code forms of today's
    experiment files only where each is byte for byte the file it recorded: an edited file's form is unknown."""
    path = course / "reports" / "gpu" / "stability.json"
    rep = json.loads(path.read_text())
    for e in rep["notebooks"]:
        e.pop("experiment_forms", None)
    f = course / "lib" / "pinlab" / "steploop.py"
    f.write_text(f.read_text() + "# edited after the runs\n")
    done = scope.record_missing_scope(rep, "stability", None, course)
    by_path = {e["path"]: e for e in rep["notebooks"]}
    assert "experiment_forms" not in by_path["notebooks/01_one.ipynb"]  # its steploop.py is not the one recorded
    assert by_path["notebooks/02_two.ipynb"]["experiment_forms"] == nbtools.forms_map(
        ["lib/pinlab/lessons/l02_two.py"], course)
    assert done == ["stability: notebooks/02_two.ipynb: the code forms of its 1 experiment files"]


def test_the_quiet_estimate_is_the_median_of_the_recorded_executions():
    """Stop 62: a call planned at 262 s from the last pass's seconds (stop 60's H100) took 384 s on another H100
    (x1.47); the median of each notebook's recorded executions (quiet passes and stability runs, not nbval passes)
    planned 294 s. Fewer than plan.MIN_EXECUTIONS executions: latest.json's seconds."""
    latest = {"notebooks": [{"path": "a", "seconds": 30.0}, {"path": "b", "seconds": 8.0}, {"path": "c", "seconds": 5.0}]}
    stab = {"notebooks": [
        {"path": "a", "runs": [{"via": "execution", "seconds": s} for s in (10.0, 20.0, 30.0, 90.0)]
         + [{"via": "nbval", "seconds": 500.0}] * 5},
        {"path": "b", "runs": [{"via": "execution", "seconds": 2.0}, {"via": "execution", "seconds": 3.0},
                               {"via": "nbval", "seconds": 4.0}]},
        {"path": "z", "runs": [{"via": "execution", "seconds": 1.0}] * 3}]}
    assert plan.quiet_seconds(latest) == {"a": 30.0, "b": 8.0, "c": 5.0}
    assert plan.quiet_seconds(latest, stab) == {"a": 25.0, "b": 8.0, "c": 5.0}


def test_an_extra_condition_is_estimated_from_its_own_passes(tmp_path):
    """Stop 63 (an H100): (f) took 37-57 s per lesson where the five conditions together took 113-251 s, and the plan
    had sent it at the five's seconds (598 s for the 182 it took). Each extra condition is estimated from its own
    recorded passes, not below the notebook's quiet seconds; the five from theirs alone."""
    nb = "notebooks/04_x.ipynb"
    latest = {"notebooks": [{"path": nb, "seconds": 40.0}]}

    def entry(seconds):
        return {"path": nb, "source_sha256": "old", "runs": [{"seconds": seconds}]}
    adv = {"conditions": [{"id": "a", "notebooks": [entry(250.0)]}, {"id": "f", "notebooks": [entry(57.0)]}]}
    assert plan.adverse_seconds(adv, latest, tmp_path)[nb] == 250.0
    assert plan.adverse_seconds(adv, latest, tmp_path, condition="f")[nb] == 57.0
    adv["conditions"][1]["notebooks"][0]["runs"][0]["seconds"] = 12.0
    assert plan.adverse_seconds(adv, latest, tmp_path, condition="f")[nb] == 40.0  # not below its quiet seconds


def test_the_unit_tests_ride_with_the_first_experiment_s_own_quiet_pass(course):
    """Stop 64: with only an experiment to renew and the unit tests stale, the plan added the quickest notebook's
    quiet pass to the first call, though that call had the changed lesson's own quiet pass to run them with."""
    nb = nbtools.load(course / "notebooks" / "01_one.ipynb")
    nb["cells"][0]["source"] += "\nsteps = 2"  # the notebook's own code: its experiment, no other notebook's
    nbtools.save(nb, course / "notebooks" / "01_one.ipynb")
    assert not plan.unit_tests_current(course)
    (call,) = plan.make_plan(course)["calls"]
    cmd, what, _ = call["steps"][0]
    assert cmd == "python3 tools/gpu_suite.py --only notebooks/01_one.ipynb" and "gpu unit tests" in what, call
    assert "02_two" not in json.dumps(call["steps"])


def test_an_extra_condition_is_required_only_where_named_and_planned_on_its_own(course, monkeypatch):
    """(f) CUDA_LAUNCH_BLOCKING=1 is required of the notebooks in its ``required_for`` only: there, a missing pass is
    a problem and --plan runs `--adverse f --only` that notebook, not the five conditions again; elsewhere nothing."""
    assert problems(course) == []
    monkeypatch.setitem(evidence.ALL_CONDITIONS["f"], "required_for", ("notebooks/01_one.ipynb",))
    assert evidence.required_conditions("notebooks/01_one.ipynb") == ["a", "b", "c", "d", "e", "f"]
    assert evidence.required_conditions("notebooks/02_two.ipynb") == ["a", "b", "c", "d", "e"]
    (found,) = problems(course)
    assert found.startswith("(f) CUDA_LAUNCH_BLOCKING=1 is not in reports/gpu/adverse.json")
    lines = plan.plan_lines(course)
    text = "\n".join(lines)
    assert "--adverse f --only notebooks/01_one.ipynb" in text and "--adverse-all-together" not in text, text
    assert "02_two" not in text.split("call 1")[1]
    # recorded for 01_one: it holds, and 02_two needs none
    latest, _, adv = reports(course)
    one = next(e for c in adv["conditions"] if c["id"] == "a" for e in c["notebooks"]
               if e["path"] == "notebooks/01_one.ipynb")
    adv["conditions"].append({"id": "f", "env": {"CUDA_LAUNCH_BLOCKING": "1"},
                              "notebooks": [dict(one, runs=one["runs"][:1])]})
    (course / "reports" / "gpu" / "adverse.json").write_text(json.dumps(adv))
    assert problems(course) == []
    assert plan.plan_lines(course)[-1] == "plan: 0 call(s), 0.0 device-minutes"
