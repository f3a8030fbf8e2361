"""The figure on the README's first screen: lesson 03's race, as the latest GPU run drew it.

    python3 tools/readme_figure.py            # say whether docs/img/the_race.png is the notebook's figure
    python3 tools/readme_figure.py --write    # copy it out of notebooks/03_the_race.ipynb

The image is the output of the notebook cell that calls ``l03.plot_received`` (its title names the GPU and the
date of the run), copied byte for byte: a new GPU run of lesson 03 changes it, and ``tests/test_packaging.py``
fails until this tool copies it again. It imports neither torch nor pinlab.
"""
from __future__ import annotations

import base64
import sys
from pathlib import Path

import nbtools

NOTEBOOK = "notebooks/03_the_race.ipynb"
CALL = "l03.plot_received("  # the cell whose figure it is
FIGURE = "docs/img/the_race.png"


def figure(root: Path = nbtools.ROOT) -> bytes:
    """The PNG the committed notebook shows for :data:`CALL`'s cell (exactly one image there)."""
    nb = nbtools.load(root / NOTEBOOK)
    cells = [c for c in nb["cells"] if c["cell_type"] == "code" and CALL in "".join(c["source"])]
    images = [o["data"]["image/png"] for c in cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    if len(cells) != 1 or len(images) != 1:
        raise ValueError(f"{NOTEBOOK}: expected one cell calling {CALL}...) with one figure, found {len(cells)} "
                         f"cells and {len(images)} figures (the README's figure moved: update tools/readme_figure.py)")
    data = images[0]
    return base64.b64decode("".join(data) if isinstance(data, list) else data)


def main(argv: list[str]) -> int:
    root = nbtools.ROOT
    want, path = figure(root), root / FIGURE
    if "--write" in argv:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(want)
        print(f"wrote {FIGURE} ({len(want)} bytes) from {NOTEBOOK}")
        return 0
    same = path.exists() and path.read_bytes() == want
    print(f"{FIGURE} is {'the' if same else 'NOT the'} figure of {NOTEBOOK}" + ("" if same else
          ": run `python3 tools/readme_figure.py --write`"))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
