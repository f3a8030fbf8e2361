"""Notebook tooling shared by the build, the course runner, the GPU suite and the tests.

Sources are percent-format Python files (``notebooks/src/NN_topic.py``): a line ``# %%`` starts a
code cell, ``# %% [markdown]`` a Markdown cell (each line written as ``# text``), and
``tags=["a", "b"]`` after the marker sets the cell's tags. The ``.ipynb`` beside ``src/`` is
built from it and carries the outputs of the latest GPU run.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import time
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


def source_sha256(nb: dict) -> str:
    """sha256 of every cell's source joined with blank lines (the GPU report's source_sha256)."""
    sources = []
    for cell in nb["cells"]:
        src = cell["source"]
        sources.append("".join(src) if isinstance(src, list) else src)
    return hashlib.sha256("\n\n".join(sources).encode("utf-8")).hexdigest()


def lib_sha256(root: Path = ROOT) -> str:
    """sha256 over every lib/**/*.py sorted by path, each as path + newline + content."""
    h = hashlib.sha256()
    for p in sorted((root / "lib").rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = p.relative_to(root).as_posix()
        h.update((rel + "\n" + p.read_text(encoding="utf-8")).encode("utf-8"))
    return h.hexdigest()


def load(path: Path) -> dict:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def save(nb: dict, path: Path) -> None:
    Path(path).write_text(json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def _lines(src: str) -> list[str]:
    return src.splitlines(keepends=True)


def to_notebook(cells: list[dict], old: dict | None = None) -> dict:
    """Build a notebook from parsed cells. Outputs of ``old`` are kept only if no code cell changed."""
    def key(c):
        src = c["source"] if isinstance(c["source"], str) else "".join(c["source"])
        return (c["cell_type"], src, tuple(c.get("tags") or c.get("metadata", {}).get("tags", [])))

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
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(str(path), as_version=4)
    old_env = dict(os.environ)
    if env:
        os.environ.update(env)
    t0 = time.perf_counter()
    try:
        client = NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=allow_errors,
                                resources={"metadata": {"path": str(Path(path).parent)}})
        try:
            # the kernel process's own log (not cell output) goes nowhere: it only holds start-up noise
            client.execute(stderr=subprocess.DEVNULL)
        finally:
            for cell in nb.cells:  # keep stored outputs free of volatile metadata
                if cell.cell_type == "code":
                    cell.metadata.pop("execution", None)
            nbformat.write(nb, str(out_path or path))
    finally:
        os.environ.clear()
        os.environ.update(old_env)
    return time.perf_counter() - t0


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
