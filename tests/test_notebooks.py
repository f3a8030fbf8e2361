"""Notebook hygiene: every notebook executed, in sync with its source, free of errors.
The GPU evidence (reports/gpu/latest.json, stability.json) is checked in tests/test_evidence.py."""
import json

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
    # the install cell counts as its first line only: publishing (a new address in it) changes no evidence
    cell = {"cell_type": "code", "source": nbtools.INSTALL_MARK + "\npip install x @ git+https://a.org/p"}
    other = dict(cell, source=nbtools.INSTALL_MARK + "\nraise ModuleNotFoundError('no address')")
    assert nbtools.source_sha256({"cells": [cell, {"source": "c"}]}) == nbtools.source_sha256(
        {"cells": [other, {"source": "c"}]}) == hashlib.sha256((nbtools.INSTALL_MARK + "\n\nc").encode()).hexdigest()
    edited = dict(cell, source="x = 1\n" + cell["source"])  # a cell that merely contains the mark is code as any
    assert nbtools.source_sha256({"cells": [edited]}) != nbtools.source_sha256({"cells": [cell]})


@pytest.mark.parametrize("stem", sorted(p.stem for p in (ROOT / "solutions" / "src").glob("*.py")))
def test_every_exercise_stub_runs_and_says_not_implemented(stem, capsys):
    """The generated exercise (solutions stripped) runs on a CPU, and each of its checks says
    "not implemented yet" instead of raising."""
    src = (ROOT / "solutions" / "src" / f"{stem}.py").read_text(encoding="utf-8")
    ns: dict = {}
    for cell in make_exercises.exercise_cells(ROOT / "solutions" / "src" / f"{stem}.py"):
        assert "BEGIN SOLUTION" not in cell["source"]
        if cell["cell_type"] == "code":
            exec(compile(cell["source"], f"{stem}.py", "exec"), ns)
    out = capsys.readouterr().out
    assert out.count("is not implemented yet") >= 1 and src.count("### BEGIN SOLUTION") >= 1
    assert not any(line.startswith("✅") for line in out.splitlines())


SOURCES = sorted((ROOT / "notebooks" / "src").glob("*.py")) + sorted((ROOT / "solutions" / "src").glob("*.py"))


def bare_asserts(text: str) -> list[int]:
    """Line numbers of the ``assert`` statements in a notebook source (cell magics and shell lines dropped)."""
    import ast

    code = "\n".join("" if ln.lstrip().startswith(("%", "!")) else ln for ln in text.splitlines())
    return [n.lineno for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Assert)]


@pytest.mark.parametrize("src", SOURCES, ids=_id)
def test_no_bare_assert_in_a_lesson(src):
    """A check in a lesson is pinlab.claim / claims (holds on any CUDA GPU; its failure explains itself) or
    pinlab.observe (machine-dependent, never fails): never a bare assert (CONTRIBUTING, assertion policy)."""
    lines = bare_asserts(src.read_text(encoding="utf-8"))
    assert not lines, (f"{_id(src)} has bare asserts at lines {lines}: use pinlab.claim(text, holds, value=..., "
                       "why=...) for what holds on any CUDA GPU, pinlab.observe(...) for what depends on the machine")


def test_the_bare_assert_finder_finds_them():
    assert bare_asserts("x = 1\nassert x\n%timeit x\nif x:\n    assert x == 1, 'm'\n") == [2, 5]
    assert bare_asserts("pinlab.claim('x', True)\n") == []


LESSON_SOURCES = sorted((ROOT / "notebooks" / "src").glob("*.py"))
PREDICT = "🔮"


def unanswered_predictions(cells: list[dict]) -> list[str]:
    """Where a 🔮 Predict prompt has no answer: 'cell N' for a prompt in a code cell (a comment, not Markdown:
    a missing `# %% [markdown]`), or for a prompt whose Markdown has no `<details>` after it and before the
    next prompt (CONTRIBUTING: every Predict with its answer in <details>)."""
    out = []
    for i, c in enumerate(cells):
        src = c["source"] if isinstance(c["source"], str) else "".join(c["source"])
        if PREDICT not in src:
            continue
        if c["cell_type"] != "markdown":
            out.append(f"cell {i}: a Predict prompt in a {c['cell_type']} cell")
            continue
        for k, after in enumerate(src.split(PREDICT)[1:], 1):
            if "<details>" not in after or "</details>" not in after:
                first = after.strip().splitlines()[0] if after.strip() else ""
                out.append(f"cell {i}, prompt {k}: no <details> answer after {first[:70]!r}")
    return out


@pytest.mark.parametrize("src", LESSON_SOURCES, ids=_id)
def test_every_predict_prompt_has_a_details_answer(src):
    missing = unanswered_predictions(nbtools.parse_percent(src.read_text(encoding="utf-8")))
    assert not missing, f"{_id(src)}: " + "; ".join(missing)


def test_the_predict_finder_finds_unanswered_prompts():
    md = lambda s: {"cell_type": "markdown", "source": s}  # noqa: E731
    answered = md("🔮 **Predict.** A?\n\n<details><summary>Answer</summary>\n\nA.\n</details>")
    assert unanswered_predictions([answered, md("no prompt"), {"cell_type": "code", "source": "x = 1"}]) == []
    assert unanswered_predictions([md("🔮 **Predict.** A?\n\nSome text.")]) == [
        "cell 0, prompt 1: no <details> answer after '**Predict.** A?'"]
    # two prompts in one cell, the answer only after the first
    two = md("🔮 **Predict.** A?\n<details>a</details>\n\n🔮 **Predict.** B?\n")
    assert unanswered_predictions([two]) == ["cell 0, prompt 2: no <details> answer after '**Predict.** B?'"]
    assert unanswered_predictions([{"cell_type": "code", "source": "x = 1\n# 🔮 **Predict.** C?\n# <details>"}]) == [
        "cell 0: a Predict prompt in a code cell"]
