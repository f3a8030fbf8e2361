"""Generate exercises/NN.ipynb from the master copies in solutions/src/NN.py, and execute them.

Every region between ``### BEGIN SOLUTION`` and ``### END SOLUTION`` becomes a stub that raises
``NotImplementedError``; the exercise notebooks are then executed here (they need no GPU), so the
stored outputs show each checker's "not implemented yet" verdict. ``--check`` fails when an
exercise notebook is stale or still contains solution code; ``--execute`` executes every exercise again
(after a change in the library changes what the checkers print).
"""
from __future__ import annotations

import re
import sys

import nbtools

_REGION = re.compile(r"^(?P<indent>[ \t]*)### BEGIN SOLUTION\n.*?^[ \t]*### END SOLUTION\n?", re.M | re.S)


def strip_solutions(source: str) -> str:
    def stub(m):
        ind = m.group("indent")
        return f"{ind}# YOUR CODE HERE\n{ind}raise NotImplementedError\n"
    out = _REGION.sub(stub, source + "\n").rstrip("\n")
    if "### BEGIN SOLUTION" in out or "### END SOLUTION" in out:
        raise ValueError("unbalanced ### BEGIN SOLUTION / ### END SOLUTION markers")
    return out


def exercise_cells(src_path) -> list[dict]:
    cells = nbtools.parse_percent(src_path.read_text(encoding="utf-8"))
    for c in cells:
        if c["cell_type"] == "code":
            c["source"] = strip_solutions(c["source"])
    return cells


def main(argv: list[str]) -> int:
    check = "--check" in argv
    again = "--execute" in argv
    bad = []
    for src in sorted((nbtools.ROOT / "solutions" / "src").glob("*.py")):
        target = nbtools.ROOT / "exercises" / (src.stem + ".ipynb")
        cells = exercise_cells(src)
        old = nbtools.load(target) if target.exists() else None
        nb = nbtools.to_notebook(cells, old)
        rel = target.relative_to(nbtools.ROOT).as_posix()
        if check:
            if old is None or old["cells"] != nb["cells"] or any(
                    c["cell_type"] == "code" and c["execution_count"] is None for c in old["cells"]):
                bad.append(rel)
            continue
        if again or old != nb or any(c["cell_type"] == "code" and c["execution_count"] is None for c in nb["cells"]):
            target.parent.mkdir(exist_ok=True)
            nbtools.save(nb, target)
            nbtools.execute(target)
            print(f"generated and executed: {rel}")
    for b in bad:
        print(f"stale or unexecuted: {b} (run `make exercises`)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
