"""environment.yml (conda) and pyproject.toml (pip) must ask for the same packages."""
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
    want = {_norm(r) for r in py["project"]["dependencies"] + py["project"]["optional-dependencies"]["test"]}
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


def test_required_packages_are_declared():
    py = tomllib.loads((ROOT / "pyproject.toml").read_text())
    names = {re.split(r"[<>=!~ ]", r)[0] for r in py["project"]["dependencies"] + py["project"]["optional-dependencies"]["test"]}
    assert {"torch", "jupyterlab", "matplotlib", "flashinfer-python", "nbval"} <= names


def test_the_env_parser_can_fail():
    text = "dependencies:\n  - python=3.11\n  - pip:\n      - torch\n      - -e .\n"
    assert _env_pip_requirements(text) == ["torch", "-e ."]
