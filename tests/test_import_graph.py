"""lib/pinlab's imports form a DAG (issue 31): no module imports, at its top or inside a function, a module
that imports it back, directly or through others. A cycle kept alive by function-local imports works until
someone moves one of them to the top of its file; then ``import pinlab`` fails with "partially initialized
module". The graph is read from the source (``ast``), every ``import`` and ``from ... import`` anywhere in
a module counted."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

LIB = Path(__file__).resolve().parents[1] / "lib"


def module_name(path: Path, lib: Path) -> str:
    parts = list(path.relative_to(lib).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(lib: Path, package: str = "pinlab") -> dict[str, dict[str, int]]:
    """{module: {module it imports: first line}} over the package's modules, function-local imports
    included. ``from . import x`` where ``x`` is a module depends on ``x`` only (not on the package's
    ``__init__``, which is already being imported when that line runs)."""
    paths = {module_name(p, lib): p for p in sorted((lib / package).rglob("*.py"))}
    graph = {}
    for mod, path in paths.items():
        here = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        deps: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")[: len(here.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in paths]
                targets = subs if len(subs) == len(node.names) else [target, *subs]
            else:
                continue
            for t in targets:
                if t in paths and t != mod:
                    deps.setdefault(t, node.lineno)
        graph[mod] = deps
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def describe(graph, comp) -> str:
    return "; ".join(f"{a} -> {b} (line {graph[a][b]})" for a in comp for b in sorted(graph[a]) if b in comp)


def test_lib_pinlab_has_no_import_cycle():
    graph = import_graph(LIB)
    assert len(graph) > 20, "the graph misses modules"
    found = cycles(graph)
    assert not found, "import cycles in lib/pinlab (function-local imports count): " + " | ".join(
        describe(graph, c) for c in found)


def test_the_cycle_check_finds_a_cycle_kept_alive_by_a_function_local_import(tmp_path):
    pkg = tmp_path / "pinlab"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import f\n")
    (pkg / "a.py").write_text("from .b import g\n\ndef f():\n    return g()\n")
    (pkg / "b.py").write_text("def g():\n    from .sub import c\n    return c.h()\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("def h():\n    from ..a import f\n    return f\n")
    graph = import_graph(tmp_path)
    assert graph["pinlab.b"] == {"pinlab.sub.c": 2} and graph["pinlab.sub.c"] == {"pinlab.a": 2}
    assert cycles(graph) == [["pinlab.a", "pinlab.b", "pinlab.sub.c"]]
    (pkg / "sub" / "c.py").write_text("def h():\n    return 1\n")
    assert cycles(import_graph(tmp_path)) == []


@pytest.mark.parametrize("line, dep", [("from . import b\n", "pinlab.b"), ("from .b import g\n", "pinlab.b"),
                                       ("import pinlab.b\n", "pinlab.b"), ("from pinlab import b\n", "pinlab.b")])
def test_every_import_form_is_an_edge(tmp_path, line, dep):
    pkg = tmp_path / "pinlab"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "b.py").write_text("def g():\n    return 1\n")
    (pkg / "a.py").write_text(line)
    assert dep in import_graph(tmp_path)["pinlab.a"]
