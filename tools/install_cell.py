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

Publishing (``make publish URL=https://github.com/OWNER/pinlab [REF=v1.0]``, :func:`publish`) writes the address
and the tag or commit to install into pyproject.toml (``[project.urls] Repository``, ``[tool.pinlab] install-ref``)
and the install cell into every source, notebook and exercise: no output, no GPU evidence (the GPU suite's hashes
leave the install cell out: ``nbtools.evidence_source``) and no page of the site changes but that cell. The cell
installs ``pinlab @ git+ADDRESS@REF``: one tag or 40-hex commit, never a branch's head, so that what a notebook
installs cannot change under it after it was published (REF defaults to ``git rev-parse HEAD``; a branch name, an
abbreviated commit or a name that is no tag here is refused, :func:`check_ref`). A local clone's address is
``file:///abs/path`` (pip's form; ``file://localhost/abs/path`` where a pip wants a host).

It imports neither torch nor pinlab (the site build, in its light venv, reads the address through it).
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
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


def install_ref(root: Path = ROOT) -> str | None:
    """``[tool.pinlab] install-ref`` in pyproject.toml: the tag or commit the install cell installs (written by
    ``make publish``), or None."""
    m = re.search(r"^\[tool\.pinlab\]\s*$(.*?)(?=^\[|\Z)", _pyproject(root), re.M | re.S)
    ref = m and re.search(r'^\s*install-ref\s*=\s*"([^"]*)"', m.group(1), re.M)
    return ref.group(1) if ref and ref.group(1) else None


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


def source(repo: str | None = None, root: Path = ROOT, ref: str | None = None) -> str:
    """The cell's code for the course at ``repo`` (default: pyproject.toml's address), installing its tag or
    commit ``ref`` (default: pyproject.toml's ``[tool.pinlab] install-ref``). A real address without a ref is
    refused (ValueError): the cell never installs a branch's head."""
    repo = repository_url(root) if repo is None else repo
    head = [MARK,
            "# Where `import pinlab` works (a clone set up with `make lab`), it does nothing.",
            "import importlib.util",
            "",
            'if importlib.util.find_spec("pinlab") is None:']
    if is_placeholder(repo):
        return "\n".join(head + [
            "    raise ModuleNotFoundError(",
            '        "pinlab is not installed here, and this copy of the course names no address "',
            '        "to install it from: clone the course and run `make lab` in it (whoever "',
            '        "publishes the course runs `make publish URL=<its address>`)."',
            "    )"])
    ref = install_ref(root) if ref is None else ref
    if not ref:
        raise ValueError(f"the course's address is {repo} but pyproject.toml names no tag or commit to install "
                         "([tool.pinlab] install-ref): run make publish URL=<its address> REF=<tag or 40-hex commit>")
    if not (_HEX40.match(ref) or _TAG_NAME.match(ref)):
        raise ValueError(f"install-ref {ref!r} in pyproject.toml is not a tag name or a 40-hex commit: run "
                         "make publish URL=<its address> REF=<tag or 40-hex commit>")
    reqs = requirements(root)
    torch = [r for r in reqs if _name(r) == "torch"]
    light = [r for r in reqs if _name(r) != "torch"]
    return "\n".join(head + [
        "    import subprocess",
        "    import sys",
        "",
        "    # the library's requirements; torch only where none is installed",
        "    # (the platform's stays)",
        f"    needs = {json.dumps(light)}",
        '    if importlib.util.find_spec("torch") is None:',
        f"        needs += {json.dumps(torch)}",
        '    pip = [sys.executable, "-m", "pip", "install", "-q"]',
        "    subprocess.run(pip + needs, check=True)",
        "    # the course at one tag or commit (never a branch's head): its library and",
        "    # recorded GPU run (no JupyterLab; torch left alone)",
        f"    url = {json.dumps('git+' + repo)}",
        f"    ref = {json.dumps(ref)}",
        '    subprocess.run(pip + ["--no-deps", f"pinlab @ {url}@{ref}"], check=True)',
        "    importlib.invalidate_caches()"])


def installed_spec(cell: str) -> str | None:
    """What an install cell (:func:`source`) installs, ``pinlab @ git+ADDRESS@REF``, read from its ``url = ...`` and
    ``ref = ...`` lines (the cell keeps them apart so that no line is over 88 columns); None for the placeholder's
    cell, which installs nothing."""
    url = re.search(r'^\s*url = "([^"]+)"$', cell, re.M)
    ref = re.search(r'^\s*ref = "([^"]+)"$', cell, re.M)
    return f"pinlab @ {url.group(1)}@{ref.group(1)}" if url and ref else None


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


_HEX40 = re.compile(r"^[0-9a-f]{40}$")
#: a tag name pip can put after ``@`` in a ``git+`` address and git accepts (no "@", "#", space, "..", "~^:?*[\\")
_TAG_NAME = re.compile(r"^(?!.*\.\.)(?!.*\.lock$)[A-Za-z0-9][A-Za-z0-9._+/-]*(?<![./])$")


def _git(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=60)


def _git_ok(root: Path, *args: str) -> bool:
    try:
        return _git(root, *args).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def head_commit(root: Path = ROOT) -> str:
    """``git rev-parse HEAD`` of ``root``: the commit publishing pins when no REF is given."""
    try:
        res = _git(root, "rev-parse", "--verify", "--quiet", "HEAD^{commit}")
    except (OSError, subprocess.SubprocessError) as exc:
        raise ValueError(f"REF not given, and git cannot tell this checkout's commit ({exc}): give "
                         "REF=<tag or 40-hex commit>") from None
    sha = res.stdout.strip()
    if res.returncode != 0 or not _HEX40.match(sha):
        raise ValueError(f"REF not given, and {root} has no commit checked out (git rev-parse HEAD failed): "
                         "commit first, or give REF=<tag or 40-hex commit>")
    return sha


def check_ref(ref, root: Path = ROOT) -> str:
    """``ref`` if the install cell may install it: a tag of this repository or a full 40-hex commit in it;
    empty or None: HEAD's commit (:func:`head_commit`). Refused (ValueError naming REF and what to write): a
    branch (it moves, so a published notebook would install whatever it points at later), a name that is both a
    tag and a branch, an abbreviated commit, a commit or tag this repository does not have, and anything pip or
    git could not take after ``@`` (quotes, spaces, "@", "#", "..")."""
    if ref is None or (isinstance(ref, str) and not ref.strip()):
        return head_commit(root)
    if not isinstance(ref, str):
        raise ValueError(f"REF must be a tag or a 40-hex commit, got {ref!r}")
    ref = ref.strip()
    how = (f"give a tag (git tag v1.0 && git push origin v1.0, then REF=v1.0) or a full commit "
           f"(REF=$(git rev-parse {ref if _TAG_NAME.match(ref) else 'HEAD'}))")
    if _HEX40.match(ref.lower()):
        ref = ref.lower()
        if not _git_ok(root, "cat-file", "-e", f"{ref}^{{commit}}"):
            raise ValueError(f"REF {ref} is no commit of this repository (git cat-file -e {ref} fails): fetch it, "
                             "or give a tag or commit that is here")
        return ref
    if not _TAG_NAME.match(ref):
        raise ValueError(f"REF {ref!r} is not a tag name or a 40-hex commit (letters, digits and ._+/- only, "
                         f"no '..'): {how}")
    is_tag = _git_ok(root, "show-ref", "--verify", "--quiet", f"refs/tags/{ref}")
    branches = _git(root, "for-each-ref", "--format=%(refname)", f"refs/heads/{ref}",
                    f"refs/remotes/*/{ref}").stdout.split() if _git_ok(root, "rev-parse", "--git-dir") else []
    if is_tag and branches:
        raise ValueError(f"REF {ref} is both a tag and a branch ({', '.join(branches)}): git could check out "
                         f"either; {how}")
    if is_tag:
        return ref
    if branches or ref == "HEAD" or ref.endswith("HEAD"):
        raise ValueError(f"REF {ref} is a branch or HEAD, not a tag or commit: it moves, and a published notebook "
                         f"would install whatever it points at later; {how}")
    if re.fullmatch(r"[0-9a-fA-F]{4,39}", ref):
        raise ValueError(f"REF {ref} looks like an abbreviated commit: write all 40 hex digits "
                         f"(REF=$(git rev-parse {ref})), or give a tag")
    raise ValueError(f"REF {ref} is no tag of this repository (git show-ref refs/tags/{ref} finds none): {how}")


def set_install_ref(ref: str, root: Path = ROOT) -> None:
    """Write ``ref`` as pyproject.toml's ``[tool.pinlab] install-ref`` (the table is added when missing)."""
    path = root / "pyproject.toml"
    text = path.read_text(encoding="utf-8")
    line = f'install-ref = "{ref}"'
    if re.search(r"^\[tool\.pinlab\]\s*$", text, re.M):
        new, n = re.subn(r'(^\[tool\.pinlab\]\s*$(?:(?!^\[).)*?^)\s*install-ref\s*=\s*"[^"]*"[^\n]*', rf"\g<1>{line}",
                         text, count=1, flags=re.M | re.S)
        if n != 1:
            new = re.sub(r"^\[tool\.pinlab\]\s*$", f"[tool.pinlab]\n{line}", text, count=1, flags=re.M)
    else:
        new = (text.rstrip("\n") + "\n\n# the tag or commit the notebooks' install cell installs (make publish REF=...; "
               "tools/install_cell.py)\n[tool.pinlab]\n" + line + "\n")
    path.write_text(new, encoding="utf-8")


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


def publish(url: str, root: Path = ROOT, ref: str | None = None) -> list[Path]:
    """The course at ``url``, installed at ``ref`` (a tag or 40-hex commit; default HEAD's commit): both in
    pyproject.toml, the install cell in every source and every committed notebook (outputs kept; the GPU evidence
    does not see that cell). Both are checked before anything is written. Returns the files written."""
    url = check_url(url)
    ref = check_ref(ref, root)
    set_repository(url, root)
    set_install_ref(ref, root)
    return [root / "pyproject.toml"] + write(root) + write_notebooks(root)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--write", action="store_true", help="write the install cell into every notebook source")
    ap.add_argument("--check", action="store_true", help="exit 1 when one is missing or out of date")
    ap.add_argument("--publish", metavar="URL", help="publish the course at URL: the address in pyproject.toml and "
                                                      "the install cell in every source and notebook, outputs kept")
    ap.add_argument("--ref", metavar="REF", help="with --publish: the tag or 40-hex commit the install cell installs "
                                                 "(make publish REF=...; default: git rev-parse HEAD)")
    ap.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.publish is not None:
        try:
            written = publish(args.publish, args.root, args.ref)
        except ValueError as exc:
            print(f"install_cell.py --publish: {exc}", file=sys.stderr)
            return 2
        for p in written:
            print("wrote", p.relative_to(args.root).as_posix())
        ref = install_ref(args.root)
        push = "the commit" if _HEX40.match(ref) else f"the tag (git push origin {ref})"
        print(f"published at {repository_url(args.root)}, installing {ref}: every notebook keeps its outputs and its "
              f"GPU evidence; commit the files above and push them, and {push}, before anyone runs an install "
              "cell (the site shows the Colab links after `make site`)")
        return 0
    if args.ref is not None:
        ap.error("--ref goes with --publish URL")
    try:
        found = write(args.root) if args.write else stale(args.root)
    except ValueError as exc:
        print(f"install_cell.py: {exc}", file=sys.stderr)
        return 2
    verb = "wrote the install cell into" if args.write else "install cell missing or out of date:"
    for p in found:
        print(verb, p.relative_to(args.root).as_posix())
    return 1 if (args.check and found) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
