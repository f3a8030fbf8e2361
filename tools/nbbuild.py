"""Build notebooks/NN.ipynb and solutions/NN.ipynb from their sources in */src/NN.py.

First it writes the install cell (tools/install_cell.py: from pyproject.toml's repository address) into every
source that lacks it or has an old one. Outputs are kept while no code cell changed; otherwise the notebook is
left unexecuted until the GPU suite (make gpu-suite) runs it. ``--check`` fails when a notebook or a source's
install cell is out of date, and writes nothing.
"""
from __future__ import annotations

import sys

import install_cell
import nbtools


def main(argv: list[str]) -> int:
    check = "--check" in argv
    stale = []
    try:
        if check:
            stale += [f"{p.relative_to(nbtools.ROOT).as_posix()} (its install cell: run `make notebooks`)"
                      for p in install_cell.stale(nbtools.ROOT)]
        else:
            for p in install_cell.write(nbtools.ROOT):
                print(f"install cell written: {p.relative_to(nbtools.ROOT).as_posix()}")
    except ValueError as exc:  # a real address in pyproject.toml without the tag or commit to install
        print(f"nbbuild: {exc}", file=sys.stderr)
        return 2
    for d in nbtools.NOTEBOOK_DIRS:
        for src in sorted((nbtools.ROOT / d / "src").glob("*.py")):
            target = nbtools.ROOT / d / (src.stem + ".ipynb")
            old = nbtools.load(target) if target.exists() else None
            nb = nbtools.to_notebook(nbtools.parse_percent(src.read_text(encoding="utf-8")), old)
            if old != nb:
                stale.append(target.relative_to(nbtools.ROOT).as_posix())
                if not check:
                    nbtools.save(nb, target)
    verb = "out of date" if check else "rebuilt"
    for s in stale:
        print(f"{verb}: {s}")
    return 1 if (check and stale) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
