"""Notebook tooling shared by the build, the course runner, the GPU suite and the tests.

Sources are percent-format Python files (``notebooks/src/NN_topic.py``): a line ``# %%`` starts a
code cell, ``# %% [markdown]`` a Markdown cell (each line written as ``# text``), and
``tags=["a", "b"]`` after the marker sets the cell's tags. The ``.ipynb`` beside ``src/`` is
built from it and carries the outputs of the latest GPU run.
"""
from __future__ import annotations

import ast
import hashlib
import io
import json
import linecache
import os
import re
import subprocess
import time
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIRS = ("notebooks", "solutions")          # executed by the GPU suite
ALL_NOTEBOOK_DIRS = ("notebooks", "solutions", "exercises")
_MARKER = re.compile(r'^# %%(?P<md> \[markdown\])?(?:\s+tags=(?P<tags>\[.*\]))?\s*$')


def parse_percent(text: str) -> list[dict]:
    """Cells of a percent-format source: dicts with cell_type, source (str) and tags (list)."""
    cells, cur = [], None
    for line in text.splitlines():
        m = _MARKER.match(line)
        if m:
            if cur is not None:
                cells.append(cur)
            cur = {"cell_type": "markdown" if m.group("md") else "code",
                   "tags": json.loads(m.group("tags")) if m.group("tags") else [], "lines": []}
            continue
        if cur is None:
            continue  # a preamble before the first cell is ignored
        if cur["cell_type"] == "markdown":
            if line.startswith("# "):
                line = line[2:]
            elif line.strip() == "#":
                line = ""
            elif line.strip():
                raise ValueError(f"markdown line must start with '# ': {line!r}")
        cur["lines"].append(line)
    if cur is not None:
        cells.append(cur)
    out = []
    for c in cells:
        lines = c.pop("lines")
        while lines and not lines[-1].strip():
            lines.pop()
        while lines and not lines[0].strip():
            lines.pop(0)
        c["source"] = "\n".join(lines)
        out.append(c)
    return out


def definition_source(path: Path, name: str) -> str:
    """The source of the top-level function or class ``name`` defined in a code cell of the
    percent-format source ``path`` (a notebook's or a solution's), as the reader sees it there."""
    code = "\n\n".join(c["source"] for c in parse_percent(Path(path).read_text(encoding="utf-8"))
                       if c["cell_type"] == "code")
    for node in ast.parse(code).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
            return ast.get_source_segment(code, node, padded=True)
    raise LookupError(f"{Path(path).name} defines no top-level {name}")


def load_definition(path: Path, name: str, namespace: dict):
    """``name`` as the notebook ``path`` defines it, executed in ``namespace`` (the names its code
    uses) and returned: tests run the notebook's own code instead of a copy of it. Its source is
    registered with ``linecache`` under ``<file name:name>`` so that ``inspect`` and tracebacks see it."""
    src = definition_source(path, name) + "\n"
    filename = f"<{Path(path).name}:{name}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    exec(compile(src, filename, "exec"), namespace)
    return namespace[name]


#: the first line of the install cell (tools/install_cell.py writes the cell; the GPU evidence leaves it out)
INSTALL_MARK = "# Install cell: on Colab, or in any Python without the course, run this first."


def evidence_source(cell) -> str:
    """A cell's source as the GPU evidence sees it: the install cell as its first line only, so that writing the
    course's address into it (``make publish``) changes no notebook's evidence; every other cell as it is."""
    src = cell["source"]
    src = "".join(src) if isinstance(src, list) else src
    if cell.get("cell_type") == "code" and src.startswith(INSTALL_MARK):
        return INSTALL_MARK
    return src


def source_sha256(nb: dict) -> str:
    """sha256 of every cell's source (:func:`evidence_source`: the install cell as its mark) joined with blank lines
    (the GPU report's source_sha256)."""
    return hashlib.sha256("\n\n".join(evidence_source(c) for c in nb["cells"]).encode("utf-8")).hexdigest()


def _ast_form(node) -> str:
    """A node as text, the same on every Python the course runs (3.10-3.13): no positions, and no field that is
    None or empty (3.12 added ``type_params=[]`` to every def; 3.13's ``ast.dump`` leaves empty fields out)."""
    if isinstance(node, ast.AST):
        fields = [f"{k}={_ast_form(v)}" for k, v in ast.iter_fields(node) if v is not None and v != []]
        return f"{type(node).__name__}({', '.join(fields)})"
    if isinstance(node, list):
        return "[" + ", ".join(_ast_form(v) for v in node) + "]"
    return repr(node)


def _docstrings(tree):
    """The docstrings of a syntax tree: (node, its body's first statement) of each module, class and function whose
    body starts with a string."""
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            yield node, body[0]


def _docstrings_flattened(tree) -> None:
    """Each docstring's words joined by one space (in place): re-wrapping a docstring is layout, not code."""
    for _, doc in list(_docstrings(tree)):
        doc.value.value = " ".join(doc.value.value.split())


def code_form(src: str) -> str:
    """What a code cell *is*, whatever its layout: its syntax tree (:func:`_ast_form`; docstrings with their words
    joined by single spaces), then the words of its comments in order, then its IPython magic lines. Two sources
    with the same form differ only in layout (line breaks, indentation of continuation lines, spacing, quotes,
    parentheses, trailing commas, strings split into implicitly joined parts, a comment wrapped over lines or
    moved from the end of a line to the line above): what ``ruff format`` and wrapping to 88 columns change. A
    source that does not parse is its own form."""
    lines = src.splitlines()
    magics = [ln.strip() for ln in lines if ln.lstrip().startswith(("%", "!"))]
    code = "\n".join("" if ln.lstrip().startswith(("%", "!")) else ln for ln in lines) + "\n"
    try:
        tree = ast.parse(code)
        comments = " ".join(w for t in tokenize.generate_tokens(io.StringIO(code).readline)
                            if t.type == tokenize.COMMENT for w in t.string.lstrip("#").split())
    except (SyntaxError, tokenize.TokenError, IndentationError):
        return "unparsed:" + src
    _docstrings_flattened(tree)
    return "\n".join([_ast_form(tree), "# " + comments, *("%" + m for m in magics)])


def source_form_sha256(nb: dict) -> str:
    """sha256 of the notebook's source as its stability and adverse runs see it: each cell's type, and its source
    (:func:`evidence_source`) as it is for Markdown, as its :func:`code_form` for code. Equal for two versions of a
    notebook that differ only in the layout of their code, so a formatter's pass (issue 49: at most 88 columns)
    renews the quiet pass, not the runs (tools/scope.py)."""
    parts = [f"{c.get('cell_type')}\n" + (code_form(evidence_source(c)) if c.get("cell_type") == "code"
                                          else evidence_source(c)) for c in nb["cells"]]
    return hashlib.sha256("\n\n".join(parts).encode("utf-8")).hexdigest()


def code_form_sha256(nb: dict) -> str:
    """sha256 of the notebook's code as its stability and adverse runs see it: each code cell's :func:`code_form`
    (of :func:`evidence_source`), in order; Markdown left out. Equal for two versions that differ only in their prose
    or in the layout of their code: a sentence fixed renews the quiet pass (its ``source_sha256`` changed) and
    carries the runs where that pass claims what they claimed, as a formatter's pass does (tools/scope.py)."""
    parts = [code_form(evidence_source(c)) for c in nb["cells"] if c.get("cell_type") == "code"]
    return hashlib.sha256("\n\n".join(parts).encode("utf-8")).hexdigest()


#: the forms a GPU report entry keeps of the notebook it ran, by key: the whole source up to its code's layout, and
#: its code alone (prose left out)
FORMS = {"source_form_sha256": source_form_sha256, "code_form_sha256": code_form_sha256}


def forms(nb: dict) -> dict[str, str]:
    """{key: form} of a notebook, for every form of :data:`FORMS`."""
    return {key: form(nb) for key, form in FORMS.items()}


def same_form(entry: dict, forms_now: dict) -> bool:
    """Whether a GPU report entry was recorded for a notebook with one of these forms (``forms_now``: {key: form},
    keys of :data:`FORMS`): False for a form the entry did not keep (recorded before it was kept)."""
    return any(entry.get(key) and entry[key] == form for key, form in forms_now.items())


def files_sha256(rel_paths, root: Path = ROOT) -> str:
    """sha256 over the given files (paths relative to ``root``) sorted by path, each as path + newline + content.

    Raises FileNotFoundError for a file that no longer exists.
    """
    h = hashlib.sha256()
    for rel in sorted(set(rel_paths)):
        h.update((rel + "\n" + (root / rel).read_text(encoding="utf-8")).encode("utf-8"))
    return h.hexdigest()


def lib_files(root: Path = ROOT) -> list[str]:
    """Every lib/**/*.py, as paths relative to ``root``, sorted."""
    return sorted(p.relative_to(root).as_posix() for p in (root / "lib").rglob("*.py"))


def lib_sha256(root: Path = ROOT) -> str:
    """sha256 over every lib/**/*.py sorted by path, each as path + newline + content."""
    return files_sha256(lib_files(root), root)


def closure(start, step) -> set:
    """Everything reachable from ``start`` (an iterable) through ``step`` (an item -> the items it leads to),
    ``start`` included: the files a file needs, transitively."""
    todo, done = set(start), set()
    while todo:
        item = todo.pop()
        if item not in done:
            done.add(item)
            todo |= set(step(item)) - done
    return done


#: a tests/test_*.py that marks a test ``gpu`` (the GPU suite runs ``pytest -m gpu`` over those files only)
GPU_MARKED = re.compile(r"^\s*(@pytest\.mark\.gpu\b|pytestmark\s*=.*\bmark\.gpu\b)|\bmarks\s*=\s*pytest\.mark\.gpu\b",
                        re.M)
_TEST_IMPORT = re.compile(r"^\s*(?:from|import)\s+(test_\w+)", re.M)


def gpu_test_files(root: Path = ROOT) -> list[str]:
    """tests/test_*.py files that mark a test ``gpu`` (collecting only those keeps the GPU suite's pytest short)."""
    return [p.relative_to(root).as_posix() for p in sorted((root / "tests").glob("test_*.py"))
            if GPU_MARKED.search(p.read_text(encoding="utf-8"))]


def unit_test_files(root: Path = ROOT) -> list[str]:
    """What decides the gpu unit tests, sorted: every lib/**/*.py and tools/**/*.py (the tests import nbtools,
    evidence, ...), conftest.py, the tests' modules that are not test files (tests/conftest.py, the CUDA children,
    helpers), the gpu-marked test files (:func:`gpu_test_files`) and every test file those import, transitively.
    A test file with no gpu test that none of them imports is left out: editing it asks no GPU run."""
    tests = root / "tests"
    start = gpu_test_files(root) + [p.relative_to(root).as_posix() for p in sorted(tests.rglob("*.py"))
                                    if not p.name.startswith("test_")]
    seen = closure(start, lambda rel: {f"tests/{name}.py" for name in
                                       _TEST_IMPORT.findall((root / rel).read_text(encoding="utf-8"))
                                       if (tests / f"{name}.py").is_file()})
    more = [p.relative_to(root).as_posix() for p in (root / "tools").rglob("*.py")]
    return sorted(set(lib_files(root) + more + sorted(seen)
                      + (["conftest.py"] if (root / "conftest.py").is_file() else [])))


def unit_test_sha256(root: Path = ROOT) -> str:
    """The GPU report's ``unit_tests.inputs_sha256``: the rule of :func:`lib_sha256` over
    :func:`unit_test_files`. The gpu unit tests that passed on these files need not run again."""
    return files_sha256(unit_test_files(root), root)


def deps_sha256(deps, root: Path = ROOT) -> str:
    """The GPU report's ``deps_sha256``: the rule of :func:`lib_sha256` over a notebook's ``deps`` only."""
    return files_sha256(deps, root)


def file_sha(rel: str, root: Path = ROOT) -> str:
    """The first 16 hex digits of a file's sha256: what a GPU report keeps per file (``deps_files``, ``experiment``)
    to name the file that changed."""
    return hashlib.sha256((root / rel).read_bytes()).hexdigest()[:16]


def code_form_sha(rel: str, root: Path = ROOT) -> str:
    """The first 16 hex digits of the sha256 of a Python file's code: its syntax tree without docstrings
    (:func:`_ast_form`: the same on the GPU host's Python 3.12 as on the CPU's 3.11, which ``ast.dump`` is not), so a
    comment, a docstring or the layout may change and the form stays; a file that is not Python (or does not parse)
    has its :func:`file_sha`. What a GPU report keeps per experiment file (``experiment_forms``): an experiment file
    whose code is unchanged is plumbing to the runs (scope.experiment_problem)."""
    path = root / rel
    if path.suffix != ".py":
        return file_sha(rel, root)
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, ValueError):
        return file_sha(rel, root)
    for node, doc in list(_docstrings(tree)):
        node.body.remove(doc)
    return hashlib.sha256(_ast_form(tree).encode("utf-8")).hexdigest()[:16]


def forms_map(files, root: Path = ROOT) -> dict[str, str]:
    """{file: :func:`code_form_sha`} of the given files, sorted by path."""
    return {rel: code_form_sha(rel, root) for rel in sorted(set(files))}


def files_map(files, root: Path = ROOT) -> dict[str, str]:
    """{file: :func:`file_sha`} of the given files (paths relative to ``root``), sorted by path."""
    return {rel: file_sha(rel, root) for rel in sorted(set(files))}


def changed_files(recorded: dict, root: Path = ROOT) -> list[str]:
    """The files of a recorded :func:`files_map` that changed since, or are gone."""
    return [rel for rel, sha in sorted(recorded.items()) if not (root / rel).exists() or file_sha(rel, root) != sha]


def load(path: Path) -> dict:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def save(nb: dict, path: Path) -> None:
    Path(path).write_text(json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def _lines(src: str) -> list[str]:
    return src.splitlines(keepends=True)


def to_notebook(cells: list[dict], old: dict | None = None) -> dict:
    """Build a notebook from parsed cells. Outputs of ``old`` are kept only if no code cell changed (the install
    cell aside: a new address in it changes no output, :func:`evidence_source`)."""
    def key(c):
        return (c["cell_type"], evidence_source(c), tuple(c.get("tags") or c.get("metadata", {}).get("tags", [])))

    keep = old is not None and [key(c) for c in cells if c["cell_type"] == "code"] == [
        key(c) for c in old["cells"] if c["cell_type"] == "code"]
    old_code = [c for c in old["cells"] if c["cell_type"] == "code"] if keep else []
    nb_cells, code_i = [], 0
    for i, c in enumerate(cells):
        meta = {"tags": c["tags"]} if c["tags"] else {}
        cell = {"cell_type": c["cell_type"], "id": f"c{i:03d}", "metadata": meta, "source": _lines(c["source"])}
        if c["cell_type"] == "code":
            if keep:
                cell["execution_count"] = old_code[code_i]["execution_count"]
                cell["outputs"] = old_code[code_i]["outputs"]
            else:
                cell["execution_count"] = None
                cell["outputs"] = []
            code_i += 1
        nb_cells.append(cell)
    metadata = {
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
    }
    if old is not None:  # execution fills in language_info; keep what is there
        metadata = old.get("metadata") or metadata
    return {
        "cells": nb_cells,
        "metadata": metadata,
        "nbformat": 4,
        "nbformat_minor": 5,
    }


def notebook_paths(dirs=ALL_NOTEBOOK_DIRS, root: Path = ROOT) -> list[Path]:
    out = []
    for d in dirs:
        out += sorted((root / d).glob("*.ipynb"))
    return out


def execute(path: Path, out_path: Path | None = None, *, timeout: int = 1800, env: dict | None = None,
            allow_errors: bool = False) -> float:
    """Execute a notebook with nbclient (cwd = its folder); write it to ``out_path`` (default: in place).

    Returns seconds taken. Raises nbclient's CellExecutionError on a failing cell (the partly
    executed notebook is still written), unless ``allow_errors`` (then errors stay in the outputs).
    """
    res = run_notebook(path, out_path, timeout=timeout, env=env, allow_errors=allow_errors)
    if res["error"] is not None:
        raise res["error"]
    return res["seconds"]


# ---- executing with evidence: which lib/ files the kernel imported, how long each cell took ----------------

DEPS_MARKER = "@@pinlab-deps@@"


def deps_cell_source(root: Path = ROOT) -> str:
    """One expression, run as an extra last cell: prints DEPS_MARKER + JSON of the kernel's imported files
    under lib/ (and where ``pinlab`` came from). It leaves no name behind in the notebook's namespace."""
    lib = os.path.realpath(root / "lib")
    return (
        "(lambda sys, os, json, lib: print(" + repr(DEPS_MARKER) + " + json.dumps({'files': sorted({"
        "os.path.realpath(f) for f in (getattr(m, '__file__', None) for m in list(sys.modules.values())) "
        "if isinstance(f, str) and os.path.realpath(f).startswith(lib + os.sep)}), "
        "'pinlab': getattr(sys.modules.get('pinlab'), '__file__', None)})))"
        "(__import__('sys'), __import__('os'), __import__('json'), " + repr(lib) + ")"
    )


def parse_deps_output(text: str, root: Path = ROOT) -> list[str] | None:
    """The lib/ .py files (relative to ``root``, sorted) from the deps cell's stdout; None if it printed nothing.

    Raises RuntimeError if the kernel imported pinlab from outside ``root``/lib (an installed copy: its
    files would not be the ones the evidence is about)."""
    for line in text.splitlines():
        if line.startswith(DEPS_MARKER):
            data = json.loads(line[len(DEPS_MARKER):])
            lib = Path(os.path.realpath(root / "lib"))
            if data.get("pinlab") and not Path(os.path.realpath(data["pinlab"])).is_relative_to(lib):
                raise RuntimeError(f"the kernel imported pinlab from {data['pinlab']}, not from {lib}: "
                                   "uninstall that copy or put lib/ first on PYTHONPATH")
            real_root = Path(os.path.realpath(root))
            return sorted({Path(f).relative_to(real_root).as_posix() for f in data["files"] if f.endswith(".py")})
    return None


def _stdout(cell) -> str:
    return "".join("".join(o["text"]) if isinstance(o.get("text"), list) else o.get("text", "")
                   for o in cell.get("outputs", []) if o.get("output_type") == "stream" and o.get("name") == "stdout")


def cell_errors(nb: dict) -> list[dict]:
    """Code cells with an error output (cells tagged ``raises-exception`` expect one and are left out):
    [{cell, ename, evalue}], ``cell`` being the index in nb["cells"]."""
    out = []
    for i, c in enumerate(nb["cells"]):
        if c["cell_type"] != "code" or "raises-exception" in c.get("metadata", {}).get("tags", []):
            continue
        for o in c.get("outputs", []):
            if o.get("output_type") == "error":
                out.append({"cell": i, "ename": o.get("ename", ""), "evalue": str(o.get("evalue", ""))})
                break
    return out


def _seconds_between(a: str, b: str) -> float | None:
    import datetime as dt

    try:
        return (dt.datetime.fromisoformat(b.replace("Z", "+00:00"))
                - dt.datetime.fromisoformat(a.replace("Z", "+00:00"))).total_seconds()
    except (TypeError, ValueError, AttributeError):
        return None


def run_notebook(path: Path, out_path: Path | None = None, *, timeout: int = 1800, env: dict | None = None,
                 allow_errors: bool = False, record_deps: bool = False, write: bool = True,
                 root: Path = ROOT) -> dict:
    """Execute a notebook (cwd = its folder) and write it to ``out_path`` (default: in place; not if not
    ``write``); ``env``: variables for its kernel, a None value removes one. Returns {seconds, cell_seconds:
    {index: s}, nb, deps, error}:

    * ``deps``: with ``record_deps``, the lib/ files the kernel had imported at the end (an extra last cell
      prints them; it is removed again before writing), None if that cell did not run;
    * ``error``: None, or an exception (CellExecutionError, DeadKernelError, a timeout, ...) that stopped the
      run; the partly executed notebook is still written. With ``allow_errors`` cells run on after a failure
      and their errors stay in the outputs (see :func:`cell_errors`).
    """
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(str(path), as_version=4)
    for cell in nb.cells:  # no stale outputs: a cell a failure kept from running shows as not executed
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    n_cells = len(nb.cells)
    if record_deps:
        nb.cells.append(nbformat.v4.new_code_cell(deps_cell_source(root)))
    old_env = dict(os.environ)
    for key, value in (env or {}).items():  # None: the kernel does not inherit it
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    t0 = time.perf_counter()
    error = None
    try:
        client = NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=allow_errors,
                                resources={"metadata": {"path": str(Path(path).parent)}})
        try:
            # the kernel process's own log (not cell output) goes nowhere: it only holds start-up noise
            client.execute(stderr=subprocess.DEVNULL)
        except Exception as exc:  # noqa: BLE001 - returned to the caller, who decides
            error = exc
    finally:
        os.environ.clear()
        os.environ.update(old_env)
    seconds = time.perf_counter() - t0
    deps = None
    if record_deps:
        extra = nb.cells.pop()
        if extra.get("outputs"):
            deps = parse_deps_output(_stdout(extra), root)
    cell_seconds = {}
    for i, cell in enumerate(nb.cells[:n_cells]):
        if cell.cell_type == "code":
            ex = cell.metadata.pop("execution", None) or {}  # keep stored outputs free of volatile metadata
            s = _seconds_between(ex.get("iopub.execute_input"), ex.get("shell.execute_reply"))
            if s is not None:
                cell_seconds[i] = round(s, 3)
    if write:
        nbformat.write(nb, str(out_path or path))
    return {"seconds": seconds, "cell_seconds": cell_seconds, "nb": nb, "deps": deps, "error": error}


def solution_namespace(stem: str, root: Path = ROOT) -> dict:
    """Execute the code cells of solutions/src/<stem>.py (checks included); return its names.

    The exercise tests use it to run each checker against the master solution.
    """
    ns: dict = {}
    src = (root / "solutions" / "src" / f"{stem}.py").read_text(encoding="utf-8")
    for cell in parse_percent(src):
        if cell["cell_type"] == "code":
            exec(compile(cell["source"], f"{stem}.py", "exec"), ns)
    return ns
