"""Notebook hygiene, and the GPU evidence: every notebook executed, in sync with its source,
and covered by the latest GPU suite report for the current sources and library."""
import json
from pathlib import Path

import pytest

import make_exercises
import nbtools

ROOT = nbtools.ROOT
ALL = nbtools.notebook_paths()
GPU_SUITE = nbtools.notebook_paths(nbtools.NOTEBOOK_DIRS)
LESSONS = nbtools.notebook_paths(("notebooks",))


def _id(p):
    return p.relative_to(ROOT).as_posix()


def test_there_are_lessons():
    assert len(LESSONS) >= 2
    assert (ROOT / "notebooks" / "00_start_here.ipynb").exists()


@pytest.mark.parametrize("path", ALL, ids=_id)
def test_executed_top_to_bottom(path):
    nb = nbtools.load(path)
    assert nb["metadata"]["kernelspec"]["name"] == "python3"
    counts = [c["execution_count"] for c in nb["cells"] if c["cell_type"] == "code"]
    assert counts == list(range(1, len(counts) + 1)), (
        f"{_id(path)} is not executed top to bottom (counts {counts}): run the GPU suite "
        "(or `make exercises` for exercises/)")


@pytest.mark.parametrize("path", ALL, ids=_id)
def test_outputs_are_small_and_error_free(path):
    nb = nbtools.load(path)
    for i, c in enumerate(nb["cells"]):
        if c["cell_type"] != "code":
            assert "data:image" not in "".join(c["source"]), f"cell {i}: no base64 images in Markdown"
            continue
        for o in c["outputs"]:
            assert o["output_type"] != "error", f"cell {i} stored an error: {o.get('ename')}: {o.get('evalue')}"
            assert len(json.dumps(o)) < 400_000, f"cell {i}: output over 400 kB"


@pytest.mark.parametrize("path", LESSONS, ids=_id)
def test_lessons_open_and_close_as_promised(path):
    text = "\n".join("".join(c["source"]) for c in nbtools.load(path)["cells"] if c["cell_type"] == "markdown")
    assert "What you will learn" in text and "What to remember" in text


@pytest.mark.parametrize("path", GPU_SUITE, ids=_id)
def test_notebook_matches_its_source(path):
    src = path.parent / "src" / (path.stem + ".py")
    assert src.exists(), f"{_id(path)} has no source {src.relative_to(ROOT)}"
    built = nbtools.to_notebook(nbtools.parse_percent(src.read_text(encoding="utf-8")), nbtools.load(path))
    assert built == nbtools.load(path), f"{_id(path)} is out of date: run `make notebooks`, then the GPU suite"


def test_exercises_are_generated_from_solutions():
    sols = sorted(p.stem for p in (ROOT / "solutions" / "src").glob("*.py"))
    exs = sorted(p.stem for p in (ROOT / "exercises").glob("*.ipynb"))
    assert sols == exs
    for stem in sols:
        cells = make_exercises.exercise_cells(ROOT / "solutions" / "src" / f"{stem}.py")
        nb = nbtools.load(ROOT / "exercises" / f"{stem}.ipynb")
        assert [("".join(c["source"])) for c in nb["cells"]] == [c["source"] for c in cells], (
            f"exercises/{stem}.ipynb is stale: run `make exercises`")
        text = json.dumps(nb)
        assert "BEGIN SOLUTION" not in text and "END SOLUTION" not in text


def test_strip_solutions():
    src = "def f(x):\n    ### BEGIN SOLUTION\n    return x + 1\n    ### END SOLUTION\n\n\nok = check(f)"
    assert make_exercises.strip_solutions(src) == (
        "def f(x):\n    # YOUR CODE HERE\n    raise NotImplementedError\n\n\nok = check(f)")
    with pytest.raises(ValueError, match="unbalanced"):
        make_exercises.strip_solutions("### BEGIN SOLUTION\nx = 1\n")


def test_parse_percent():
    cells = nbtools.parse_percent('x\n# %% [markdown]\n# # Title\n#\n# text\n# %% tags=["a"]\nprint(1)\n\n')
    assert cells == [{"cell_type": "markdown", "tags": [], "source": "# Title\n\ntext"},
                     {"cell_type": "code", "tags": ["a"], "source": "print(1)"}]
    with pytest.raises(ValueError, match="markdown line"):
        nbtools.parse_percent("# %% [markdown]\nnot a comment\n")


def test_source_sha256_definition():
    import hashlib

    nb = {"cells": [{"source": ["a\n", "b"]}, {"source": "c"}]}
    assert nbtools.source_sha256(nb) == hashlib.sha256("a\nb\n\nc".encode()).hexdigest()


# ---- the GPU evidence ------------------------------------------------------------------------

REPORT = ROOT / "reports" / "gpu" / "latest.json"


def test_gpu_report_exists_and_is_for_current_lib():
    assert REPORT.exists(), "no GPU evidence: run `python3 tools/gpu_suite.py` on a CUDA machine and commit reports/gpu/"
    rep = json.loads(REPORT.read_text())
    for key in ("gpu", "driver", "torch", "cuda", "flashinfer", "python", "utc", "lib_sha256", "notebooks"):
        assert key in rep, f"report lacks {key}"
    assert rep["lib_sha256"] == nbtools.lib_sha256(), "lib/ changed after the last GPU run: run the GPU suite again"


@pytest.mark.parametrize("path", GPU_SUITE, ids=_id)
def test_gpu_report_covers_notebook(path):
    rep = json.loads(REPORT.read_text())
    rows = {r["path"]: r for r in rep["notebooks"]}
    rel = _id(path)
    assert rel in rows, f"{rel} is not in the GPU report: run the GPU suite"
    assert rows[rel]["status"] == "passed", f"{rel} did not pass on the GPU: {rows[rel]['status']}"
    assert rows[rel]["source_sha256"] == nbtools.source_sha256(nbtools.load(path)), (
        f"{rel} changed after the last GPU run: run the GPU suite again")


def test_recorded_profiler_trace_is_kept():
    """Lesson 02 points readers without a GPU at the trace the GPU suite kept."""
    path = ROOT / "reports" / "gpu" / "traces" / "02_step_loop.json"
    assert path.exists(), "run the GPU suite: it copies build/traces/*.json to reports/gpu/traces/"
    events = json.loads(path.read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert any("Pageable -> Device" in n for n in names) and any("Pinned -> Device" in n for n in names)
