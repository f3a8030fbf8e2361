"""environment.yml (conda) and pyproject.toml (pip) must ask for the same packages; CUDA-only packages
live in the "gpu" extra, so that a CPU machine's install stays light; JupyterLab and the notebook tools live in
the "lab" extra, so that a plain `pip install` of the course (the install cell, on Colab) adds only what the
library needs. The install cell at the top of every notebook (tools/install_cell.py) is checked here too: the
same in every source, from one template; what it does with and without pinlab; and, end to end, a fresh kernel
without pinlab running notebook 00 after its install cell installed the course from a local clone."""
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import install_cell  # noqa: E402
import make_exercises  # noqa: E402
import nbtools  # noqa: E402


def _norm(req: str) -> str:
    return re.sub(r"\s+", "", req.strip().strip('"').strip("'")).lower()


def _env_pip_requirements(text: str) -> list[str]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(r"^\s+-\s+pip:\s*$", line))
    out = []
    for line in lines[start + 1:]:
        m = re.match(r"^\s+-\s+(.*)$", line)
        if not m:
            break
        out.append(m.group(1))
    return out


def test_environment_and_pyproject_agree():
    py = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = py["project"]["optional-dependencies"]
    want = {_norm(r) for r in py["project"]["dependencies"] + extras["lab"] + extras["test"] + extras.get("site", [])}
    env_text = (ROOT / "environment.yml").read_text()
    got = [_norm(r) for r in _env_pip_requirements(env_text)]
    assert "-e." in got, "environment.yml must install the package itself (- -e .)"
    assert set(got) - {"-e."} == want
    assert re.search(r"^\s+-\s+python=3\.11\s*$", env_text, re.M), "environment.yml pins Python 3.11"


def test_torch_range_admits_gpu_host_and_cpu_machines():
    from packaging.specifiers import SpecifierSet

    py = tomllib.loads((ROOT / "pyproject.toml").read_text())
    spec = next(r for r in py["project"]["dependencies"] if r.startswith("torch"))
    s = SpecifierSet(spec[len("torch"):])
    assert "2.11.0" in s and "2.13.0" in s


def _name(req: str) -> str:
    return re.split(r"[<>=!~ \[;]", req.strip())[0].lower()


# packages that only work with CUDA: never in the default install
CUDA_ONLY = {"flashinfer-python", "flashinfer-cubin", "flashinfer-jit-cache", "apache-tvm-ffi", "nvidia-cutlass-dsl",
             "cupy-cuda12x", "cupy-cuda13x"}


def test_required_packages_are_declared():
    py = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = py["project"]["optional-dependencies"]
    names = {_name(r) for r in py["project"]["dependencies"] + extras["lab"] + extras["test"]}
    assert {"torch", "jupyterlab", "matplotlib", "nbval", "nbclient", "ipykernel"} <= names


def test_cuda_only_packages_are_the_gpu_extra():
    py = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = py["project"]["optional-dependencies"]
    default = {_name(r) for r in py["project"]["dependencies"] + extras["lab"] + extras["test"]}
    assert not default & CUDA_ONLY, f"CUDA-only packages in the default install: {sorted(default & CUDA_ONLY)}"
    assert [_name(r) for r in extras["gpu"]] == ["flashinfer-python"]
    gpu_req = _norm(extras["gpu"][0])
    env_text = (ROOT / "environment.yml").read_text()
    assert gpu_req not in {_norm(r) for r in _env_pip_requirements(env_text)}, "flashinfer belongs to the gpu extra only"
    comments = [_norm(line) for line in env_text.splitlines() if line.lstrip().startswith("#")]
    assert any('pipinstall-e".[gpu]"' in c for c in comments), "environment.yml must say how to add the gpu extra"
    assert any(gpu_req in c for c in comments), f"environment.yml must name the gpu extra's {extras['gpu'][0]}"


def test_makefile_installs_gpu_extra_only_where_nvidia_smi_exists():
    text = (ROOT / "Makefile").read_text()
    assert "command -v nvidia-smi" in text
    m = re.search(r"^EXTRAS := \$\(if \$\(HAS_GPU\),(?P<gpu>[^,]*),(?P<cpu>.*)\)$", text, re.M)
    assert m, "EXTRAS must pick the extras by HAS_GPU"
    gpu, cpu = (set(m.group(k).split("$(comma)")) for k in ("gpu", "cpu"))
    assert "gpu" in gpu and "gpu" not in cpu and gpu - {"gpu"} == cpu and {"lab", "test"} <= cpu
    assert re.search(r"^TORCH_SPEC \?= \$\(if \$\(HAS_GPU\),[^,]*,torch==2\.13\.0\)$", text, re.M), "CPU machines: torch 2.13.0"
    # the venv is rebuilt when the dependencies change, under a lock
    assert re.search(r"^\$\(STAMP\): pyproject\.toml", text, re.M)
    assert "fcntl.flock" in text


def test_the_env_parser_can_fail():
    text = "dependencies:\n  - python=3.11\n  - pip:\n      - torch\n      - -e .\n"
    assert _env_pip_requirements(text) == ["torch", "-e ."]


# ---------------------------------------------------------------------------------------------
# a plain `pip install` of the course: the library's needs only


#: what the library and the notebooks import at run time (lib/pinlab): nothing of Jupyter's
RUNTIME = {"torch", "numpy", "matplotlib", "tqdm"}
LAB_ONLY = {"jupyterlab", "nbconvert", "nbclient", "nbformat", "ipykernel"}


def test_a_plain_install_pulls_no_jupyterlab():
    """Colab has its own Jupyter (an older ipykernel among it): a plain install must not replace it, nor add
    JupyterLab. The notebook tools are the "lab" extra, which `make setup` and the image ask for."""
    py = tomllib.loads((ROOT / "pyproject.toml").read_text())
    deps = {_name(r) for r in py["project"]["dependencies"]}
    assert deps == RUNTIME, f"pyproject.toml's dependencies are {sorted(deps)}: keep Jupyter's in the lab extra"
    assert LAB_ONLY <= {_name(r) for r in py["project"]["optional-dependencies"]["lab"]}
    assert re.search(r'pip install\b.*-e "\.\[[^\]]*\blab\b[^\]]*\]"', (ROOT / "Dockerfile").read_text()), \
        "the image runs JupyterLab: it must install the lab extra"
    imports = set()
    for f in (ROOT / "lib").rglob("*.py"):
        imports |= set(re.findall(r"^\s*(?:import|from)\s+(\w+)", f.read_text(encoding="utf-8"), re.M))
    assert not imports & (LAB_ONLY - {"ipykernel"}), f"lib/ imports {sorted(imports & LAB_ONLY)}: not in a plain install"


def test_readme_says_how_pip_gets_the_cpu_torch():
    """PyPI's Linux torch is the CUDA build (about 3 GB of CUDA libraries): the README's pip route names the
    CPU index, and installs the lab extra for JupyterLab."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    quick = re.search(r"^## Quickstart\s*$(.*?)(?=^## )", text, re.M | re.S).group(1)
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in quick
    assert re.search(r"""pip install (-e )?["']\.\[lab\]["']""", quick), "the pip route installs the lab extra"


# ---------------------------------------------------------------------------------------------
# the install cell


#: a commit the install cell pins (any 40 hex digits: the cell's text does not check it)
SHA = "0123456789abcdef0123456789abcdef01234567"


def _sources():
    return install_cell.sources()


def test_every_notebook_starts_with_the_same_install_cell():
    """The second cell of every notebook source (right after its title) is the install cell, identical in every
    notebook and built from one template and pyproject.toml's address (tools/install_cell.py)."""
    want = install_cell.source()
    assert len(_sources()) >= 10
    for src in _sources():
        cells = nbtools.parse_percent(src.read_text(encoding="utf-8"))
        assert cells[0]["cell_type"] == "markdown" and cells[0]["source"].startswith("# "), src
        code = [c for c in cells if c["cell_type"] == "code"]
        assert cells[1]["cell_type"] == "code" and cells[1]["source"] == want and code[0] is cells[1], (
            f"{src.relative_to(ROOT)}: no install cell, or an old one, after the title: run `make notebooks`")
        assert sum(c["source"] == want for c in cells) == 1
    for src in sorted((ROOT / "solutions" / "src").glob("*.py")):  # the exercises are generated with it
        assert make_exercises.exercise_cells(src)[1]["source"] == want
    assert install_cell.stale() == []


def test_the_install_cell_writer_replaces_only_its_cell(tmp_path):
    text = "# %% [markdown]\n# # 01 · T\n#\n# text\n\n# %% tags=[\"x\"]\nimport pinlab\n\n# %%\nprint(1)\n"
    a = install_cell.MARK + "\na()"
    once = install_cell.with_cell(text, a)
    assert once.startswith(f"# %% [markdown]\n# # 01 · T\n#\n# text\n\n# %%\n{a}\n\n# %% tags=")
    assert install_cell.with_cell(once, a) == once
    new = install_cell.MARK + "\nnew()"
    twice = install_cell.with_cell(install_cell.with_cell(text, install_cell.MARK + "\nold()"), new)
    assert twice == install_cell.with_cell(text, new) and "old()" not in twice
    assert twice.endswith("# %% tags=[\"x\"]\nimport pinlab\n\n# %%\nprint(1)\n")
    with pytest.raises(ValueError, match="title cell"):
        install_cell.with_cell("# %%\nprint(1)\n", a)
    # the tool's --check finds a source without the cell; --write puts it there
    for d in install_cell.SOURCE_DIRS:
        (tmp_path / d).mkdir(parents=True)
    shutil.copyfile(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "notebooks/src/01_t.py").write_text(text)
    assert install_cell.main(["--check", "--root", str(tmp_path)]) == 1
    assert install_cell.main(["--write", "--root", str(tmp_path)]) == 0
    assert install_cell.main(["--check", "--root", str(tmp_path)]) == 0


def test_the_address_is_read_once_from_pyproject(tmp_path):
    assert install_cell.repository_url() == tomllib.loads((ROOT / "pyproject.toml").read_text())[
        "project"]["urls"]["Repository"]
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text().replace(
        install_cell.repository_url(), "https://github.com/someone/pinlab"))
    with pytest.raises(ValueError, match="no tag or commit to install.*make publish URL=<its address> REF="):
        install_cell.source(root=tmp_path)  # an address without a tag or commit: never a branch's head
    install_cell.set_install_ref("v1.2.0", tmp_path)
    assert install_cell.install_ref(tmp_path) == "v1.2.0" and tomllib.loads((tmp_path / "pyproject.toml").read_text())[
        "tool"]["pinlab"]["install-ref"] == "v1.2.0"
    cell = install_cell.source(root=tmp_path)
    assert install_cell.installed_spec(cell) == "pinlab @ git+https://github.com/someone/pinlab@v1.2.0"
    assert install_cell.installed_spec(install_cell.source(install_cell.REPOSITORY_FALLBACK)) is None  # installs nothing
    assert "--no-deps" in cell
    install_cell.set_install_ref(SHA, tmp_path)  # written again: replaced, one table, one line
    text = (tmp_path / "pyproject.toml").read_text()
    assert text.count("[tool.pinlab]") == 1 and text.count("install-ref") == 1 and install_cell.install_ref(tmp_path) == SHA
    assert install_cell.is_placeholder(install_cell.REPOSITORY_FALLBACK)
    assert "git+" not in install_cell.source(install_cell.REPOSITORY_FALLBACK)
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert install_cell.requirements() == deps
    assert json.dumps([d for d in deps if not d.startswith("torch")]) in cell  # the light ones, from pyproject


_RUN_CELL = r"""
import builtins, importlib.util, json, subprocess, sys
hide = set(json.loads(sys.argv[2]))
find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: None if name in hide else find_spec(name, *a)
calls = []
subprocess.run = lambda cmd, **kw: calls.append([c for c in cmd if c != sys.executable]) or subprocess.CompletedProcess(cmd, 0)
exec(compile(open(sys.argv[1]).read(), "install cell", "exec"), {})
print("CALLS " + json.dumps(calls))
"""


def _run_cell(tmp_path, cell: str, hide: list[str]) -> tuple[str, list]:
    (tmp_path / "cell.py").write_text(cell)
    (tmp_path / "run.py").write_text(_RUN_CELL)
    res = subprocess.run([sys.executable, str(tmp_path / "run.py"), str(tmp_path / "cell.py"), json.dumps(hide)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    out, calls = res.stdout.rsplit("CALLS ", 1)
    return out, json.loads(calls)


def test_the_install_cell_does_nothing_where_pinlab_imports(tmp_path):
    for repo in (install_cell.REPOSITORY_FALLBACK, "https://github.com/someone/pinlab"):
        assert _run_cell(tmp_path, install_cell.source(repo, ref=SHA), []) == ("", [])


def test_the_install_cell_keeps_the_platforms_torch(tmp_path):
    cell = install_cell.source("https://github.com/someone/pinlab", ref=SHA)
    light = [r for r in install_cell.requirements() if not r.startswith("torch")]
    torch = [r for r in install_cell.requirements() if r.startswith("torch")]
    out, calls = _run_cell(tmp_path, cell, ["pinlab"])  # Colab: torch there, pinlab not
    assert out == "" and calls == [["-m", "pip", "install", "-q", *light],
                                   ["-m", "pip", "install", "-q", "--no-deps",
                                    f"pinlab @ git+https://github.com/someone/pinlab@{SHA}"]]  # one commit, pinned
    _, calls = _run_cell(tmp_path, cell, ["pinlab", "torch"])  # a bare Python: torch too
    assert calls[0] == ["-m", "pip", "install", "-q", *light, *torch] and "--no-deps" in calls[1]
    assert not any("jupyterlab" in " ".join(c) or "[" in " ".join(c) for c in calls), "no JupyterLab, no extra"


def test_the_placeholder_install_cell_stops_the_notebook_with_what_to_do(tmp_path):
    """With the placeholder address the cell raises (the next cell would fail on `import pinlab` otherwise), one
    sentence naming what to do; where pinlab imports it does nothing (above)."""
    (tmp_path / "cell.py").write_text(install_cell.source(install_cell.REPOSITORY_FALLBACK))
    (tmp_path / "run.py").write_text(_RUN_CELL)
    res = subprocess.run([sys.executable, str(tmp_path / "run.py"), str(tmp_path / "cell.py"), json.dumps(["pinlab"])],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "CALLS" not in res.stdout, res.stdout
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError: pinlab is not installed here") and "make lab" in last
    assert "make publish URL=" in last and "REPLACE-ME" not in last


@pytest.mark.parametrize("url, ok", [
    ("https://github.com/someone/pinlab", True), ("https://gitlab.example.org:8443/a/b/pinlab/", True),
    ("file:///home/me/pinlab", True), ("file://localhost/home/me/pinlab", True),
    (install_cell.REPOSITORY_FALLBACK, False), ("", False), ("/home/me/pinlab", False), ("http://x.org/p", False),
    ("https://github.com/a/b c", False), ('https://github.com/a/b"; rm -rf /', False), ("git@github.com:a/b", False)])
def test_publish_takes_an_address_pip_can_install_and_names_what_to_write_instead(url, ok):
    if ok:
        assert install_cell.check_url(url) == url.rstrip("/")
    else:
        with pytest.raises(ValueError, match="URL"):
            install_cell.check_url(url)


@pytest.mark.slow
def test_publishing_keeps_every_output_the_evidence_and_the_site(tmp_path):
    """The publish step in a scratch clone with a real-looking address: pyproject.toml and every install cell
    carry it (sources, notebooks, exercises); no output changes, every GPU-evidence test and the notebook and
    exercise checks still pass, and the site's pages still say their outputs are the GPU suite's."""
    clone = tmp_path / "clone"
    _local_clone(clone)
    before = {p.relative_to(clone): [c.get("outputs") for c in nbtools.load(p)["cells"]]
              for p in nbtools.notebook_paths(nbtools.ALL_NOTEBOOK_DIRS, clone)}
    url = "https://github.com/someone/pinlab"
    head = _git_head(clone)
    branch = subprocess.run(["git", "branch", "--show-current"], cwd=clone, capture_output=True, text=True).stdout.strip()
    res = subprocess.run([sys.executable, "tools/install_cell.py", "--publish", url, f"--ref={branch}"], cwd=clone,
                         capture_output=True, text=True, timeout=300)  # a branch: refused, nothing written
    assert res.returncode == 2 and f"REF {branch} is a branch" in res.stderr, res.stderr
    assert subprocess.run(["git", "status", "--porcelain"], cwd=clone, capture_output=True, text=True).stdout == ""
    res = subprocess.run([sys.executable, "tools/install_cell.py", "--publish", url], cwd=clone, capture_output=True,
                         text=True, timeout=300)  # no REF: the commit checked out
    assert res.returncode == 0, res.stdout + res.stderr
    assert f'Repository = "{url}"' in (clone / "pyproject.toml").read_text()
    assert install_cell.install_ref(clone) == head and f"installing {head}" in res.stdout
    for p in nbtools.notebook_paths(nbtools.ALL_NOTEBOOK_DIRS, clone):
        nb = nbtools.load(p)
        assert [c.get("outputs") for c in nb["cells"]] == before[p.relative_to(clone)], p
        assert sum(install_cell.installed_spec("".join(c["source"])) == f"pinlab @ git+{url}@{head}"
                   for c in nb["cells"]) == 1, p
    env = {k: v for k, v in os.environ.items() if not k.startswith("PINLAB_")}
    for cmd in (["tools/install_cell.py", "--check"], ["tools/nbbuild.py", "--check"],
                ["tools/make_exercises.py", "--check"]):
        r = subprocess.run([sys.executable, *cmd], cwd=clone, capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, (cmd, r.stdout[-2000:], r.stderr[-2000:])
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                        "tests/test_evidence.py", "tests/test_adverse.py", "tests/test_scope.py", "-k",
                        "covers_notebook or committed_outputs or adverse_evidence or latest_json_records or carried"],
                       cwd=clone, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:]
    sys.path.insert(0, str(clone / "tools"))
    try:
        import build_site
        report = build_site.gpu_report(clone)
        for p in nbtools.notebook_paths(nbtools.NOTEBOOK_DIRS, clone):
            kind, sentence = build_site.provenance(p.relative_to(clone).as_posix(), nbtools.load(p), report)
            assert kind == "gpu" and "edited since" not in sentence, (p, sentence)
        assert build_site.colab_url(url, "notebooks/01_pinned_memory.ipynb")
    finally:
        sys.path.remove(str(clone / "tools"))


def _git_head(repo: Path) -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True,
                          check=True).stdout.strip()


def _git_repo(root: Path) -> dict[str, str]:
    """A git repository at ``root`` (made if needed) with two commits: the first tagged v1.0 and v1.0-rc, the
    second on the branch checked out, plus a branch `feature`, a remote-tracking `origin/dev`, and `both`, a
    name that is a tag and a branch. Returns the names of its commits and refs."""
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false", "-c", "tag.gpgsign=false"]
    root.mkdir(parents=True, exist_ok=True)
    run = lambda *a: subprocess.run(git + list(a), cwd=root, check=True, capture_output=True, text=True).stdout.strip()
    run("init", "-q")
    (root / "a.txt").write_text("1")
    run("add", "-A")
    run("commit", "-q", "-m", "one")
    first = _git_head(root)
    run("tag", "v1.0")
    run("tag", "-a", "-m", "annotated", "v1.0-rc")
    run("branch", "both")
    run("tag", "both")
    (root / "a.txt").write_text("2")
    run("commit", "-q", "-am", "two")
    run("branch", "feature")
    run("update-ref", "refs/remotes/origin/dev", "HEAD")
    return {"first": first, "head": _git_head(root), "branch": run("branch", "--show-current")}


def _local_clone(dest: Path) -> str:
    """The working tree's tracked files, committed in a fresh repository at ``dest``: the course as pip would
    clone it from its address (``git+file://``), this checkout's edits included."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    for f in filter(None, files):
        src = ROOT / f.decode()
        if src.is_file():
            (dest / f.decode()).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dest / f.decode())
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "course"]):
        subprocess.run(git + cmd, cwd=dest, check=True, capture_output=True)
    return f"file://{dest}"


@pytest.mark.slow
def test_notebook_00_runs_in_a_fresh_kernel_after_its_install_cell(tmp_path):
    """Colab, imitated: a Python that has torch, numpy, matplotlib, tqdm and a Jupyter kernel but not pinlab
    (a fresh venv that sees this venv's packages through PYTHONPATH, where pinlab's editable install is not
    active). Notebook 00, its install cell pointing at a local clone, runs top to bottom in a fresh kernel of it:
    the cell installs the course (the library and its recorded GPU run) and the lessons replay from it."""
    if not shutil.which("git") or not (ROOT / ".git").exists():
        pytest.skip("needs git and a git checkout")
    nbclient = pytest.importorskip("nbclient")
    nbformat = pytest.importorskip("nbformat")
    import sysconfig

    clone = tmp_path / "clone"
    url = _local_clone(clone)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PINLAB", "JUPYTER", "VIRTUAL_ENV"))}
    env["PYTHONPATH"] = sysconfig.get_paths()["purelib"]  # this venv's packages, without its .pth files
    probe = subprocess.run([str(py), "-c", "import importlib.util as u; print(u.find_spec('pinlab'), "
                            "u.find_spec('torch') is not None)"], env=env, capture_output=True, text=True, timeout=120)
    assert probe.stdout.split() == ["None", "True"], probe.stdout + probe.stderr
    kernels = tmp_path / "jupyter" / "kernels" / "fresh"
    kernels.mkdir(parents=True)
    (kernels / "kernel.json").write_text(json.dumps({
        "argv": [str(py), "-m", "ipykernel_launcher", "-f", "{connection_file}"], "display_name": "fresh",
        "language": "python", "env": env}))
    cells = nbtools.parse_percent((ROOT / "notebooks/src/00_start_here.py").read_text(encoding="utf-8"))
    cells[1]["source"] = install_cell.source(url, ref=_git_head(clone))  # pip installs that one commit
    nb = nbformat.reads(json.dumps(nbtools.to_notebook(cells)), as_version=4)
    run_dir = tmp_path / "elsewhere"  # no checkout around: the recorded run must come from the installed wheel
    run_dir.mkdir()
    os.environ["JUPYTER_PATH"] = str(tmp_path / "jupyter")
    try:
        client = nbclient.NotebookClient(nb, kernel_name="fresh", timeout=900,
                                         resources={"metadata": {"path": str(run_dir)}})
        try:
            client.execute()
        except nbclient.exceptions.CellExecutionError as exc:
            if "Could not find a version that satisfies" in str(exc) or "No matching distribution" in str(exc):
                pytest.skip(f"pip could not reach an index to build the course's wheel: {str(exc)[-300:]}")
            raise
    finally:
        os.environ.pop("JUPYTER_PATH", None)
    text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "everything the course needs is installed: True" in text, text[-3000:]
    where = subprocess.run([str(py), "-c", "import pinlab, pinlab.replay as r; print(pinlab.__file__); "
                            "print(r.data_location()[1])"], cwd=run_dir, env=env, capture_output=True, text=True)
    path, location = where.stdout.split()
    assert path.startswith(str(venv)) and location == "package", where.stdout + where.stderr


def test_the_readme_first_screen_says_who_it_is_for_and_shows_the_latest_runs_figure():
    """Issue 49: a learner-first README: who the course is for and a figure, before the commands; the figure is
    lesson 03's as the committed notebook shows it (tools/readme_figure.py copies it after a new GPU run)."""
    import readme_figure

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    first = text.split("## Quickstart", 1)[0]
    assert "**For engineers who" in first and f"]({readme_figure.FIGURE})" in first
    assert (ROOT / readme_figure.FIGURE).read_bytes() == readme_figure.figure(), (
        "docs/img/the_race.png is not the figure of notebooks/03_the_race.ipynb: run "
        "`python3 tools/readme_figure.py --write`")
    assert "## Running the GPU suite" not in text and "## Running the GPU suite" in (
        ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8"), "maintainer material lives in CONTRIBUTING.md"


# ---------------------------------------------------------------------------------------------
# issue 48: the install cell installs one tag or commit, never a branch's head


def test_publish_pins_a_tag_or_a_full_commit_and_refuses_the_rest(tmp_path):
    """Planted REFs in a git repository: a tag (lightweight, annotated), a full commit (any case), nothing (HEAD's
    commit) are taken; a branch (local or remote-tracking), HEAD, a name both tag and branch, an abbreviated
    commit, a commit or tag the repository lacks and text pip or git cannot take after "@" are refused, each
    with a ValueError naming REF and what to write instead."""
    if not shutil.which("git"):
        pytest.skip("needs git")
    repo = tmp_path / "repo"
    refs = _git_repo(repo)
    ok = {None: refs["head"], "": refs["head"], "  ": refs["head"], "v1.0": "v1.0", "v1.0-rc": "v1.0-rc",
          refs["first"]: refs["first"], refs["first"].upper(): refs["first"], f" {refs['head']} ": refs["head"]}
    for ref, want in ok.items():
        assert install_cell.check_ref(ref, repo) == want, ref
    refused = {refs["branch"]: "is a branch", "feature": "is a branch", "dev": "is a branch", "HEAD": "is a branch or HEAD",
               "both": "both a tag and a branch", refs["first"][:7]: "abbreviated commit", refs["head"][:12]: "abbreviated",
               "v9.9": "no tag of this repository", "f" * 40: "no commit of this repository",
               "v1.0 x": "not a tag name", "v1@x": "not a tag name", "v1#x": "not a tag name", "'v1.0'": "not a tag name",
               "a..b": "not a tag name", "-v1": "not a tag name", "v1/": "not a tag name", "HEAD~1": "not a tag name",
               "v1.0\nx": "not a tag name", "٣": "not a tag name"}
    for ref, message in refused.items():
        with pytest.raises(ValueError) as err:
            install_cell.check_ref(ref, repo)
        assert str(err.value).startswith("REF ") and message in str(err.value), (ref, str(err.value))
        assert "tag" in str(err.value) and ("commit" in str(err.value) or "40 hex" in str(err.value)), str(err.value)
    (tmp_path / "no-git").mkdir()
    with pytest.raises(ValueError, match="REF not given, and .* has no commit checked out"):
        install_cell.check_ref(None, tmp_path / "no-git")


def _small_published_course(tmp_path: Path) -> Path:
    """A repository holding pyproject.toml and one notebook source with the placeholder install cell."""
    root = tmp_path / "course"
    refs = _git_repo(root)
    shutil.copyfile(ROOT / "pyproject.toml", root / "pyproject.toml")
    (root / "notebooks" / "src").mkdir(parents=True)
    (root / "notebooks" / "src" / "01_t.py").write_text(install_cell.with_cell(
        "# %% [markdown]\n# # 01 · T\n\n# %%\nprint(1)\n", install_cell.source(install_cell.REPOSITORY_FALLBACK)))
    subprocess.run(["git", "add", "-A"], cwd=root, check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false", "commit", "-q",
                    "-m", "course"], cwd=root, check=True)
    return root


@pytest.mark.parametrize("ref", [None, "v1.0", "first"])
def test_publish_writes_the_pinned_ref_into_pyproject_and_every_install_cell(tmp_path, capsys, ref):
    """make publish URL=... [REF=...] in a small course: the cell installs `pinlab @ git+URL@REF` (no REF: HEAD's
    commit), pyproject.toml keeps the ref for make notebooks (--check passes afterwards)."""
    if not shutil.which("git"):
        pytest.skip("needs git")
    root = _small_published_course(tmp_path)
    if ref == "first":
        ref = subprocess.run(["git", "rev-list", "--max-parents=0", "HEAD"], cwd=root, capture_output=True,
                             text=True, check=True).stdout.strip()
    want = ref or _git_head(root)
    url = "https://github.com/someone/pinlab"
    argv = ["--publish", url, "--root", str(root)] + ([f"--ref={ref}"] if ref else [])
    assert install_cell.main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert f"installing {want}" in out and "push" in out, out
    text = (root / "notebooks" / "src" / "01_t.py").read_text()
    assert install_cell.installed_spec(text) == f"pinlab @ git+{url}@{want}"  # one tag or commit, never a branch
    assert install_cell.install_ref(root) == want
    assert install_cell.main(["--check", "--root", str(root)]) == 0


@pytest.mark.parametrize("ref, message", [("feature", "is a branch"), ("v1", "no tag of this repository"),
                                          ("abc1234", "abbreviated commit"), ("x y", "not a tag name")])
def test_publish_refuses_a_bad_ref_before_writing_anything(tmp_path, capsys, ref, message):
    """Planted: a REF that is a branch, no tag, abbreviated or malformed. --publish exits 2 naming REF; neither
    pyproject.toml nor any source changes (the URL is fine: the REF alone stops it)."""
    if not shutil.which("git"):
        pytest.skip("needs git")
    root = _small_published_course(tmp_path)
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file() and ".git" not in p.parts}
    assert install_cell.main(["--publish", "https://github.com/someone/pinlab", f"--ref={ref}", "--root", str(root)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("install_cell.py --publish: REF ") and message in err, err
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file() and ".git" not in p.parts} == before


def test_make_publish_hands_ref_over_quoted():
    """`make publish URL=... REF=...` gives the tool both words single-quoted and unexpanded; no REF: an empty one
    (the tool then pins HEAD's commit)."""
    if not shutil.which("make"):
        pytest.skip("needs make")
    for extra, want in ((["REF=v1.0"], "--ref='v1.0'"), ([], "--ref=''"), (["REF=$(touch x)"], "--ref='$(touch x)'")):
        res = subprocess.run(["make", "-s", "-n", "publish", "URL=https://github.com/a/b", *extra], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 0 and "tools/install_cell.py --publish 'https://github.com/a/b' " + want in res.stdout, (
            res.stdout + res.stderr)


def test_the_committed_notebooks_keep_the_placeholder_install_cell():
    """Nothing of this pins the committed course: pyproject.toml names no install-ref, the address is the
    placeholder, and every committed notebook's install cell is the placeholder's (make publish writes the pin)."""
    assert install_cell.install_ref() is None and install_cell.is_placeholder(install_cell.repository_url())
    want = nbtools._lines(install_cell.source())
    for path in nbtools.notebook_paths(nbtools.ALL_NOTEBOOK_DIRS):
        cells = [c for c in nbtools.load(path)["cells"] if nbtools.evidence_source(c) == install_cell.MARK]
        assert len(cells) == 1 and cells[0]["source"] == want, path
