"""The Dockerfile and the dev container, checked without docker (CI has none): the Dockerfile parses into
known instructions, FROM comes first (after ARGs), it installs the course with its gpu and test extras,
builds FlashInfer's kernel, exposes 8888 and starts JupyterLab there; hadolint lints it where installed.
tools/warm_flashinfer.py (its RUN step) exits 0 on a machine without a GPU or FlashInfer."""
from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KNOWN = {"FROM", "RUN", "CMD", "LABEL", "MAINTAINER", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME",
         "USER", "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL"}


def parse_dockerfile(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction: comments dropped, backslash continuations joined."""
    out, buf = [], ""
    for line in text.splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if buf and line.lstrip().startswith("#"):
            continue  # a comment inside a continued instruction
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        if word.upper() not in KNOWN:
            raise ValueError(f"unknown instruction {word!r} in {buf.strip()[:80]!r}")
        buf = ""
    if buf:
        raise ValueError(f"the Dockerfile ends inside a continued instruction: {buf[:80]!r}")
    return out


@pytest.fixture(scope="module")
def instructions():
    return parse_dockerfile((ROOT / "Dockerfile").read_text(encoding="utf-8"))


def test_dockerfile_parses_and_starts_from_an_image(instructions):
    names = [n for n, _ in instructions]
    first = next(i for i, n in enumerate(names) if n != "ARG")
    assert names[first] == "FROM", names
    assert names.count("FROM") == 1


def test_dockerfile_installs_the_course_and_builds_flashinfers_kernel(instructions):
    runs = [a for n, a in instructions if n == "RUN"]
    assert any(re.search(r"pip install\b.*-e \"?\.\[gpu,lab,test\]\"?", r) for r in runs), runs  # lab: JupyterLab
    warm = [i for i, (n, a) in enumerate(instructions) if n == "RUN" and "tools/warm_flashinfer.py" in a]
    install = [i for i, (n, a) in enumerate(instructions) if n == "RUN" and "pip install" in a]
    assert warm and install and warm[0] > install[0], "the kernel is built after the course is installed"
    env = " ".join(a for n, a in instructions if n in ("ENV", "ARG"))
    assert "FLASHINFER_WORKSPACE_BASE=" in env and "FLASHINFER_CUDA_ARCH_LIST" in env
    assert re.search(r"devel", next(a for n, a in instructions if n == "ARG" and "BASE_IMAGE" in a)), \
        "a -devel image: FlashInfer's JIT needs nvcc"


def test_dockerfile_pins_its_base_image_by_digest(instructions):
    """A tag can be pushed again; the base image is named by tag and digest (name:tag@sha256:<64 hex>)."""
    arg = next(a for n, a in instructions if n == "ARG" and a.startswith("BASE_IMAGE="))
    assert re.fullmatch(r"BASE_IMAGE=[\w./-]+:[\w.-]+@sha256:[0-9a-f]{64}", arg), arg
    assert any(n == "FROM" and a == "${BASE_IMAGE}" for n, a in instructions)


def test_dockerfile_serves_jupyterlab_on_8888(instructions):
    assert any(n == "EXPOSE" and "8888" in a.split() for n, a in instructions)
    cmd = [a for n, a in instructions if n in ("CMD", "ENTRYPOINT")][-1]
    argv = json.loads(cmd) if cmd.startswith("[") else shlex.split(cmd)
    assert argv[:2] == ["jupyter", "lab"] and "--port=8888" in argv and "--ip=0.0.0.0" in argv
    assert any(n == "USER" and a != "root" for n, a in instructions), "JupyterLab runs as a learner, not root"


def test_the_parser_can_fail():
    with pytest.raises(ValueError, match="unknown instruction"):
        parse_dockerfile("FROM x\nRUNN echo\n")
    with pytest.raises(ValueError, match="ends inside"):
        parse_dockerfile("FROM x\nRUN echo \\\n")


def test_hadolint_if_installed():
    hadolint = shutil.which("hadolint")
    if not hadolint:
        pytest.skip("hadolint is not on PATH")
    res = subprocess.run([hadolint, "--failure-threshold", "warning", str(ROOT / "Dockerfile")],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_devcontainer_builds_the_dockerfile_with_an_optional_gpu_and_port_8888():
    dc = json.loads((ROOT / ".devcontainer" / "devcontainer.json").read_text(encoding="utf-8"))
    assert (ROOT / ".devcontainer" / dc["build"]["dockerfile"]).resolve() == ROOT / "Dockerfile"
    assert (ROOT / ".devcontainer" / dc["build"]["context"]).resolve() == ROOT
    # a GPU where the host has one, none needed (the course's main path needs none): no --gpus in runArgs
    assert dc["hostRequirements"]["gpu"] == "optional" and "--gpus" not in dc.get("runArgs", [])
    assert 8888 in dc["forwardPorts"]


def test_readme_and_makefile_say_how_to_build_and_run_it():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "make docker" in readme and re.search(r"docker run [^\n]*--gpus all [^\n]*-p [^\n]*8888:8888", readme)
    assert re.search(r"^docker:", (ROOT / "Makefile").read_text(encoding="utf-8"), re.M)


@pytest.mark.slow
def test_warm_flashinfer_never_fails_the_image_build():
    pytest.importorskip("torch")
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "warm_flashinfer.py")], capture_output=True,
                         text=True, timeout=300, env={**__import__("os").environ, "PYTHONPATH": str(ROOT / "lib")})
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.startswith("warm_flashinfer: FlashInfer's decode kernel"), res.stdout
