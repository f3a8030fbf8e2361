"""The install cell at the top of every notebook: one template here, written into every notebook source.

    python3 tools/install_cell.py            # say which sources' install cell is missing or out of date
    python3 tools/install_cell.py --write    # write it into every source (`make notebooks` does this first)
    python3 tools/install_cell.py --check    # exit 1 when one is missing or out of date

The cell is the second cell of each source in ``notebooks/src/`` and ``solutions/src/``, right after the title
cell, and so its first code cell (the exercises are generated from the solutions, so they have it too). It does nothing where
``import pinlab`` works (a checkout set up by ``make setup``/``make lab``, the GPU suite, nbval). Elsewhere (Colab,
or any Python without the course) it installs the course from the one address in pyproject.toml
(``[project.urls] Repository``): first the library's light requirements (pyproject.toml's ``dependencies`` without
torch; torch too only where none is installed), then the course itself with ``--no-deps``, so that the platform's
torch and Jupyter stay as they are and no JupyterLab is installed (the ``lab`` extra is not asked for). The wheel
carries the recorded GPU run (``pinlab._recorded``), so every lesson replays without a GPU there too.

While that address is the placeholder (``REPLACE-ME``), the cell installs nothing and stops the notebook with one
sentence (a ``ModuleNotFoundError``) saying what to do instead: clone the course and run ``make lab``.

Publishing (``make publish URL=https://github.com/OWNER/pinlab``, :func:`publish`) writes the address into
pyproject.toml and the install cell into every source, notebook and exercise: no output, no GPU evidence (the GPU
suite's hashes leave the install cell out: ``nbtools.evidence_source``) and no page of the site changes but that
cell. A local clone's address is ``file:///abs/path`` (pip's form; ``file://localhost/abs/path`` where a pip wants
a host).

It imports neither torch nor pinlab (the site build, in its light venv, reads the address through it).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import nbtools

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("notebooks/src", "solutions/src")
#: where the course lives when pyproject.toml names no [project.urls] Repository (it does: edit it there)
REPOSITORY_FALLBACK = "https://github.com/REPLACE-ME/pinlab"
#: the first line of the cell: how the tool (and the tests) find it again
MARK = nbtools.INSTALL_MARK
_CELL = re.compile(r"^# %%(?P<md> \[markdown\])?(?:\s+tags=\[.*\])?\s*$")


def _pyproject(root: Path) -> str:
    try:
        return (root / "pyproject.toml").read_text(encoding="utf-8")
    except OSError:
        return ""


def repository_url(root: Path = ROOT) -> str:
    """``[project.urls] Repository`` in pyproject.toml: the one place the course's address is written."""
    m = re.search(r"^\[project\.urls\]\s*$(.*?)(?=^\[|\Z)", _pyproject(root), re.M | re.S)
    url = m and re.search(r'^\s*Repository\s*=\s*"([^"]+)"', m.group(1), re.M)
    return url.group(1) if url else REPOSITORY_FALLBACK


def is_placeholder(repo: str) -> bool:
    """pyproject.toml's Repository is still the placeholder: nothing may point there."""
    return "REPLACE-ME" in repo


def requirements(root: Path = ROOT) -> list[str]:
    """pyproject.toml's ``[project] dependencies``: what the library needs at run time (no extra)."""
    text = _pyproject(root)
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the list, read as text
        m = re.search(r"^dependencies\s*=\s*\[(.*?)\]", text, re.M | re.S)
        return re.findall(r'"([^"]+)"', re.sub(r"#[^\n]*", "", m.group(1))) if m else []
    return list(tomllib.loads(text)["project"]["dependencies"])


def _name(req: str) -> str:
    return re.split(r"[<>=!~ \[;]", req.strip(), maxsplit=1)[0].lower()


def source(repo: str | None = None, root: Path = ROOT) -> str:
    """The cell's code for the course at ``repo`` (default: pyproject.toml's address)."""
    repo = repository_url(root) if repo is None else repo
    head = [MARK,
            "# Where `import pinlab` works (a clone set up with `make lab`), it does nothing.",
            "import importlib.util",
            "",
            'if importlib.util.find_spec("pinlab") is None:']
    if is_placeholder(repo):
        return "\n".join(head + [
            '    raise ModuleNotFoundError("pinlab is not installed here, and this copy of the course names no address "',
            '                              "to install it from: clone the course and run `make lab` in it (whoever "',
            '                              "publishes the course runs `make publish URL=<its address>`).")'])
    reqs = requirements(root)
    torch = [r for r in reqs if _name(r) == "torch"]
    light = [r for r in reqs if _name(r) != "torch"]
    return "\n".join(head + [
        "    import subprocess",
        "    import sys",
        "",
        "    # the library's requirements; torch only where none is installed (the platform's stays)",
        f"    needs = {json.dumps(light)}",
        '    if importlib.util.find_spec("torch") is None:',
        f"        needs += {json.dumps(torch)}",
        '    pip = [sys.executable, "-m", "pip", "install", "-q"]',
        "    subprocess.run(pip + needs, check=True)",
        "    # the course: its library and recorded GPU run (no JupyterLab; torch left alone)",
        f'    subprocess.run(pip + ["--no-deps", "pinlab @ git+{repo}"], check=True)',
        "    importlib.invalidate_caches()"])


def sources(root: Path = ROOT) -> list[Path]:
    return [p for d in SOURCE_DIRS for p in sorted((root / d).glob("*.py"))]


def with_cell(text: str, cell: str) -> str:
    """A percent source ``text`` whose second cell (right after the title cell) is the install cell ``cell``:
    the install cell there is replaced, or ``cell`` is put there; nothing else in the text changes."""
    lines = text.splitlines(keepends=True)
    markers = [i for i, ln in enumerate(lines) if _CELL.match(ln.rstrip("\n"))]
    if not markers or not _CELL.match(lines[markers[0]].rstrip("\n")).group("md"):
        raise ValueError("the source must start with its title cell (a '# %% [markdown]' line)")
    new = ["# %%\n", cell.rstrip("\n") + "\n", "\n"]
    if len(markers) < 2:
        return "".join(lines).rstrip("\n") + "\n\n" + "".join(new)
    second = markers[1]
    if lines[second + 1:second + 2] == [MARK + "\n"]:  # the install cell already: replace it
        end = markers[2] if len(markers) > 2 else len(lines)
        return "".join(lines[:second] + new + lines[end:])
    return "".join(lines[:second] + new + lines[second:])


def stale(root: Path = ROOT) -> list[Path]:
    """The sources whose install cell is missing or differs from :func:`source`."""
    cell = source(root=root)
    return [p for p in sources(root) if with_cell(p.read_text(encoding="utf-8"), cell) != p.read_text(encoding="utf-8")]


def write(root: Path = ROOT) -> list[Path]:
    """Write the install cell into every source that needs it; return those rewritten."""
    cell, out = source(root=root), []
    for p in sources(root):
        text = p.read_text(encoding="utf-8")
        new = with_cell(text, cell)
        if new != text:
            p.write_text(new, encoding="utf-8")
            out.append(p)
    return out


_URL = re.compile(r"^(https://[A-Za-z0-9.-]+(:[0-9]+)?/[^\s\"']+|file://(localhost)?/[^\s\"']+)$")


def check_url(url) -> str:
    """``url`` if it can be the course's address: ``https://HOST/PATH`` (pip installs ``git+`` of it) or a local
    clone's ``file:///abs/path`` / ``file://localhost/abs/path``; anything else (the placeholder, a bare path,
    ``http://``, ``ssh``, quotes or spaces) is refused with what to write instead."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError("URL must be the course's address, e.g. make publish URL=https://github.com/OWNER/pinlab")
    url = url.strip().rstrip("/")
    if is_placeholder(url):
        raise ValueError(f"URL is still the placeholder ({url}): give the course's real address, e.g. "
                         "https://github.com/OWNER/pinlab")
    if not _URL.match(url):
        raise ValueError(f"URL {url!r} is not an address pip can install the course from: write "
                         "https://HOST/OWNER/pinlab, or file:///abs/path/to/a/clone (file://localhost/abs/path "
                         "where your pip wants a host)")
    return url


def set_repository(url: str, root: Path = ROOT) -> None:
    """Write ``url`` as pyproject.toml's ``[project.urls] Repository`` (the one place the address is written)."""
    path = root / "pyproject.toml"
    text = path.read_text(encoding="utf-8")
    new, n = re.subn(r'(^\[project\.urls\]\s*$(?:(?!^\[).)*?^\s*Repository\s*=\s*)"[^"]*"', rf'\1"{url}"', text,
                     count=1, flags=re.M | re.S)
    if n != 1:
        raise ValueError("pyproject.toml has no [project.urls] Repository line to write the address into")
    path.write_text(new, encoding="utf-8")


def write_notebooks(root: Path = ROOT) -> list[Path]:
    """Write the install cell into every committed notebook (notebooks/, solutions/, exercises/) where it differs,
    in place: only that cell's source changes, every output and cell id stays. Returns those rewritten."""
    cell, out = source(root=root), []
    for path in nbtools.notebook_paths(nbtools.ALL_NOTEBOOK_DIRS, root):
        nb = nbtools.load(path)
        hits = [c for c in nb["cells"] if c["cell_type"] == "code" and nbtools.evidence_source(c) == MARK]
        if len(hits) != 1:
            raise ValueError(f"{path.relative_to(root)} has {len(hits)} install cells, not one: run `make notebooks`")
        lines = nbtools._lines(cell)
        if hits[0]["source"] != lines:
            hits[0]["source"] = lines
            nbtools.save(nb, path)
            out.append(path)
    return out


def publish(url: str, root: Path = ROOT) -> list[Path]:
    """The course at ``url``: the address in pyproject.toml, the install cell in every source and every committed
    notebook (outputs kept; the GPU evidence does not see that cell). Returns the files written."""
    url = check_url(url)
    set_repository(url, root)
    return [root / "pyproject.toml"] + write(root) + write_notebooks(root)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--write", action="store_true", help="write the install cell into every notebook source")
    ap.add_argument("--check", action="store_true", help="exit 1 when one is missing or out of date")
    ap.add_argument("--publish", metavar="URL", help="publish the course at URL: the address in pyproject.toml and "
                                                      "the install cell in every source and notebook, outputs kept")
    ap.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.publish is not None:
        try:
            written = publish(args.publish, args.root)
        except ValueError as exc:
            print(f"install_cell.py --publish: {exc}", file=sys.stderr)
            return 2
        for p in written:
            print("wrote", p.relative_to(args.root).as_posix())
        print(f"published at {repository_url(args.root)}: every notebook keeps its outputs and its GPU evidence; "
              "commit the files above (the site shows the Colab links after `make site`)")
        return 0
    found = write(args.root) if args.write else stale(args.root)
    verb = "wrote the install cell into" if args.write else "install cell missing or out of date:"
    for p in found:
        print(verb, p.relative_to(args.root).as_posix())
    return 1 if (args.check and found) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
