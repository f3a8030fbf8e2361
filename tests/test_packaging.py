"""environment.yml (conda) and pyproject.toml (pip) must ask for the same packages; CUDA-only packages
live in the "gpu" extra, so that a CPU machine's install stays light."""
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
    extras = py["project"]["optional-dependencies"]
    want = {_norm(r) for r in py["project"]["dependencies"] + extras["test"] + extras.get("site", [])}
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
    names = {_name(r) for r in py["project"]["dependencies"] + py["project"]["optional-dependencies"]["test"]}
    assert {"torch", "jupyterlab", "matplotlib", "nbval", "nbclient", "ipykernel"} <= names


def test_cuda_only_packages_are_the_gpu_extra():
    py = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = py["project"]["optional-dependencies"]
    default = {_name(r) for r in py["project"]["dependencies"] + extras["test"]}
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
    assert "gpu" in gpu and "gpu" not in cpu and gpu - {"gpu"} == cpu and "test" in cpu
    assert re.search(r"^TORCH_SPEC \?= \$\(if \$\(HAS_GPU\),[^,]*,torch==2\.13\.0\)$", text, re.M), "CPU machines: torch 2.13.0"
    # the venv is rebuilt when the dependencies change, under a lock
    assert re.search(r"^\$\(STAMP\): pyproject\.toml", text, re.M)
    assert "fcntl.flock" in text


def test_the_env_parser_can_fail():
    text = "dependencies:\n  - python=3.11\n  - pip:\n      - torch\n      - -e .\n"
    assert _env_pip_requirements(text) == ["torch", "-e ."]
