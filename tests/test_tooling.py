"""Packaging and tools (issue 19): the wheel ships the recorded GPU run and replays it outside a checkout;
`make lab` is explicit about root and the network; tools/gpu-wheels.sh, tools/build_site.py --out and
tools/mutation_check.py are safe to run."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))


# ---- the wheel ----------------------------------------------------------------------------------------------

def test_pyproject_lists_every_package_and_maps_the_recordings():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {".".join(p.parent.relative_to(ROOT / "lib").parts) for p in (ROOT / "lib" / "pinlab").rglob("__init__.py")
             if "__pycache__" not in p.parts}
    assert set(tool["packages"]) == found | {"pinlab._recorded", "pinlab._recorded.data"}, (
        "a package under lib/pinlab is missing from [tool.setuptools] packages in pyproject.toml")
    assert tool["package-dir"] == {"": "lib", "pinlab._recorded": "reports/gpu",
                                   "pinlab._recorded.data": "reports/gpu/data"}
    assert tool["package-data"] == {"pinlab._recorded": ["latest.json"], "pinlab._recorded.data": ["*.json"]}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """A wheel built (no build isolation, so no network) from a copy of the sources the wheel needs."""
    pytest.importorskip("setuptools", reason="building the wheel needs setuptools in this environment")
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info", "*.pyc")
    shutil.copytree(ROOT / "lib", src / "lib", ignore=skip)
    shutil.copytree(ROOT / "reports" / "gpu", src / "reports" / "gpu")
    out = tmp_path_factory.mktemp("whl")
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                          "--no-index", "-w", str(out), str(src)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    (whl,) = out.glob("pinlab-*.whl")
    return whl


@pytest.mark.slow
def test_the_wheel_ships_the_recorded_run(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    want = {f"pinlab/_recorded/data/{p.name}" for p in (ROOT / "reports" / "gpu" / "data").glob("*.json")}
    assert want and want <= names
    assert "pinlab/_recorded/latest.json" in names and "pinlab/replay.py" in names
    assert not any(n.startswith(("reports/", "lib/")) for n in names)


_PROBE = """
import json, os, sys, pinlab
from pinlab import replay
out = {"pinlab": pinlab.__file__, "where": [str(p) for p in replay.data_location()]}
if sys.argv[1:] == ["where"]:
    print(json.dumps(out))
    sys.exit()
run = pinlab.measure("00_tiny_copy", lambda: 1, quiet=True)
out["replayed"] = (not run.live) and run.result["median"] > 0
rep = pinlab.doctor(verbose=False)
out["doctor"] = {c["check"]: c["ok"] for c in rep["checks"]}
os.environ["PINLAB_RECORD"] = "1"
try:
    replay.record_dir()
except replay.RecordingError as exc:
    out["record"] = str(exc)
print(json.dumps(out))
"""


@pytest.mark.slow
def test_an_installed_wheel_replays_outside_a_checkout_and_never_records_into_itself(wheel, tmp_path):
    site = tmp_path / "site"
    res = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                          str(site), str(wheel)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    away = tmp_path / "elsewhere"
    away.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PINLAB_DATA_DIR", "PINLAB_RECORD")}
    env.update(PYTHONPATH=str(site), PINLAB_FORCE_CPU="1", MPLBACKEND="Agg")
    res = subprocess.run([sys.executable, "-c", _PROBE], cwd=away, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["pinlab"].startswith(str(site))
    assert out["where"] == [str(site / "pinlab" / "_recorded" / "data"), "package"]
    assert out["replayed"] and out["doctor"]["recorded GPU run"] and out["doctor"]["GPU suite report"]
    assert "inside an installed package" in out["record"]
    # run from inside the course's checkout, the installed package replays the checkout's recordings
    res = subprocess.run([sys.executable, "-c", _PROBE, "where"], cwd=ROOT / "notebooks", env=env, capture_output=True,
                         text=True, timeout=300)
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["pinlab"].startswith(str(site)) and out["where"] == [str(ROOT / "reports" / "gpu" / "data"), "cwd"]


# ---- make lab (tools/lab.py) ------------------------------------------------------------------------------------

def _make_n_lab(*make_args, env=None):
    if not shutil.which("make"):
        pytest.skip("make is not installed")
    res = subprocess.run(["make", "-s", "-n", "lab", f"VPY={sys.executable}", *make_args], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, env=env)
    (line,) = [ln for ln in res.stdout.splitlines() if "tools/lab.py" in ln]
    return line


def _lab_argv(line: str) -> list[str]:
    """The arguments `make lab` hands tools/lab.py, as the shell splits its recipe line."""
    words = shlex.split(line)
    return words[words.index("tools/lab.py") + 1:]


def test_make_lab_passes_ip_port_args_and_allow_root_only_from_the_command_line():
    argv = _lab_argv(_make_n_lab())
    assert argv[argv.index("--ip") + 1:argv.index("--ip") + 4] == ["localhost", "--port", "8888"]
    assert "--allow-root" not in argv
    argv = _lab_argv(_make_n_lab("LAB_IP=0.0.0.0", "LAB_PORT=9001", "LAB_ARGS=--no-browser --ServerApp.base_url=/x/"))
    assert argv[argv.index("--ip") + 1:argv.index("--ip") + 4] == ["0.0.0.0", "--port", "9001"]
    assert argv[-1] == "--lab-args=--no-browser --ServerApp.base_url=/x/"
    assert "--allow-root" in _make_n_lab("ALLOW_ROOT=1")
    assert "--allow-root" not in _make_n_lab("ALLOW_ROOT=yes")
    assert "--allow-root" not in _make_n_lab(env=dict(os.environ, ALLOW_ROOT="1"))  # an exported variable: no
    recipe = (ROOT / "Makefile").read_text().split("\nlab: setup\n", 1)[1].split("\n\n", 1)[0]
    assert "id -u" not in recipe  # no silent --allow-root for uid 0


_ARGV_PY = """#!/usr/bin/env python3
# stands in for the venv's python: prints the arguments it was given, one JSON list a line
import json, sys
print("ARGV " + json.dumps(sys.argv[1:]))
"""


@pytest.mark.parametrize("var", ["LAB_ARGS", "LAB_IP", "LAB_PORT"])
def test_make_lab_runs_no_second_command_from_its_variables(tmp_path, var):
    """`make lab LAB_ARGS='; echo INJECTED'` (or LAB_IP, LAB_PORT): the text reaches tools/lab.py as it was given,
    and the shell runs nothing of it (make -o setup: the recipe alone, with a python that prints its argv)."""
    if not shutil.which("make"):
        pytest.skip("make is not installed")
    fake = tmp_path / "python"
    fake.write_text(_ARGV_PY)
    fake.chmod(0o755)
    planted = "--no-browser; echo INJECTED `echo TICKS` $(echo DOLLAR) 'q' \"d\" $$HOME && echo AND"
    res = subprocess.run(["make", "-s", "-o", "setup", "lab", f"VPY={fake}", f"{var}={planted}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    argv_lines = [ln for ln in res.stdout.splitlines() if ln.startswith("ARGV ")]
    assert len(argv_lines) == 1 and res.stdout.strip() == argv_lines[0], f"the shell ran more than lab.py:\n{out}"
    for word in ("INJECTED", "TICKS", "DOLLAR", "AND"):  # none of them echoed by a command of their own
        assert f"\n{word}" not in "\n" + out.replace(argv_lines[0], ""), out
    argv = json.loads(argv_lines[0][5:])
    given = {"LAB_ARGS": argv[-1].split("=", 1)[1] if argv[-1].startswith("--lab-args=") else None,
             "LAB_IP": argv[argv.index("--ip") + 1], "LAB_PORT": argv[argv.index("--port") + 1]}[var]
    assert given == planted, argv


@pytest.fixture
def lab_tool(monkeypatch):
    import lab

    monkeypatch.delenv("JUPYTER_TOKEN", raising=False)
    monkeypatch.setattr(lab.os, "execve", lambda *a: pytest.fail(f"exec'd {a[1]}"))
    return lab


def test_lab_refuses_root_unless_allowed(lab_tool, monkeypatch, capsys):
    monkeypatch.setattr(lab_tool.os, "geteuid", lambda: 0)
    assert lab_tool.main(["--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "refusing to start JupyterLab as root" in err and "make lab ALLOW_ROOT=1" in err
    assert lab_tool.main(["--dry-run", "--allow-root"]) == 0
    out = capsys.readouterr().out
    assert "--allow-root" in out and "running as root" in out


def test_lab_prints_the_url_with_its_token_and_warns_off_loopback(lab_tool, monkeypatch, capsys):
    monkeypatch.setattr(lab_tool.os, "geteuid", lambda: 1000)
    monkeypatch.setenv("JUPYTER_TOKEN", "tok123")
    assert lab_tool.main(["--dry-run", "--ip", "127.0.0.1", "--port", "8899"]) == 0
    cap = capsys.readouterr()
    assert "http://127.0.0.1:8899/lab?token=tok123" in cap.out and "plain HTTP" not in cap.err
    assert "tok123" not in cap.out.split("would run:", 1)[1]  # the token travels in the environment, not argv
    for ip in ("0.0.0.0", "192.168.1.20", "lab.example.org"):
        assert lab_tool.main(["--dry-run", "--ip", ip]) == 0
        cap = capsys.readouterr()
        assert "lab?token=tok123" in cap.out
        assert "WARNING" in cap.err and "plain HTTP" in cap.err and "gets a shell" in cap.err, cap.err
    monkeypatch.delenv("JUPYTER_TOKEN")
    lab_tool.main(["--dry-run"])
    token = capsys.readouterr().out.split("token=", 1)[1].split()[0]
    assert len(token) >= 32  # a random one
    assert [lab_tool.is_loopback(a) for a in ("localhost", "127.0.0.2", "::1", "0.0.0.0", "10.0.0.1")] == [
        True, True, True, False, False]


def test_lab_refuses_an_empty_token_and_a_busy_port(lab_tool, monkeypatch, capsys):
    import socket

    monkeypatch.setattr(lab_tool.os, "geteuid", lambda: 1000)
    monkeypatch.setenv("JUPYTER_TOKEN", "")
    assert lab_tool.main(["--dry-run"]) == 2 and "turns authentication off" in capsys.readouterr().err
    monkeypatch.setenv("JUPYTER_TOKEN", "t")
    assert lab_tool.main(["--dry-run", "--", "--IdentityProvider.token="]) == 2
    assert "turns authentication off" in capsys.readouterr().err
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert lab_tool.main(["--ip", "127.0.0.1", "--port", str(port)]) == 2
    assert f"127.0.0.1:{port} cannot be used" in capsys.readouterr().err


# every spelling traitlets reads as an empty token: `--Class.trait=value`, `--Class.trait value`, one dash, quotes
EMPTY_TOKENS = ["--ServerApp.token=", '--ServerApp.token ""', "--ServerApp.token ''", "--IdentityProvider.token ''",
                "--IdentityProvider.token=", "--NotebookApp.token=''", '--NotebookApp.token=\'""\'',
                "--PasswordIdentityProvider.token=", "-ServerApp.token=", "--ServerApp.token", "--ServerApp.token ' '",
                "--no-browser --IdentityProvider.token= --ServerApp.base_url=/x/"]
REFUSED = {**{t: "empty token turns authentication off" for t in EMPTY_TOKENS},
           "--ServerApp.password=''": "empty password", "--ServerApp.password ''": "empty password",
           "--PasswordIdentityProvider.hashed_password=": "empty password",
           "--IdentityProvider.token=abc123": "give the token in JUPYTER_TOKEN",   # argv: readable in ps
           "--ServerApp.token abc123": "give the token in JUPYTER_TOKEN",
           "--ServerApp.disable_check_xsrf=True": "XSRF", "--ServerApp.disable_check_xsrf": "XSRF",
           "--config=/tmp/x.py": "its own config folder", "--JupyterApp.config_file=/tmp/x.py": "its own config folder"}
# issue 48: the XSRF check turned off through the web application's settings (a dict trait, read as key=value or
# as a Python literal), in any class, case, dash count, `=` or the next word; the config file switched or skipped
XSRF_OFF = ["--ServerApp.tornado_settings=disable_check_xsrf=True", "--ServerApp.tornado_settings disable_check_xsrf=1",
            "--NotebookApp.tornado_settings=disable_check_xsrf=True", "-ServerApp.tornado_settings=xsrf_cookies=False",
            "--ServerApp.tornado_settings={'disable_check_xsrf': True}",
            "--ServerApp.tornado_settings \"{'disable_check_\\x78srf': True}\"",  # \x78 is x, once literal_eval'd
            "--ServerApp.tornado_settings headers={} --ServerApp.tornado_settings disable_check_xsrf=yes",
            "--LabApp.settings=disable_check_xsrf=True", "--ExtensionApp.settings disable_check_xsrf=1",
            "--ServerApp.disable_check_xsrf 1", "--NotebookApp.disable_check_xsrf=yes", "-ServerApp.disable_check_xsrf=True",
            "--serverapp.DISABLE_CHECK_XSRF=true", "--ServerApp.disable-check-xsrf=True",
            "--ServerApp.disable_check_xsrf='True'", "--ServerApp.disable_check_xsrf=' true '",
            "--JupyterApp.disable_check_xsrf=True", "--ServerApp.base_url=/x/ --ServerApp.disable_check_xsrf=True"]
CONFIG_SWITCHED = ["--JupyterApp.config_file_name=x", "--JupyterApp.config_file_name x", "--JupyterApp.config_file_name=",
                   "--ServerApp.config_file_name=my_config", "--ServerApp.config_file=/tmp/c.py", "--config /tmp/c.py",
                   "-JupyterApp.config_file=/tmp/c.py", "--Application.config_file=c.py", "--CONFIG=/tmp/c.py",
                   "--conf=/tmp/c.py", "--confi /tmp/c.py", "--LabApp.config_file_name=lab", "--JupyterApp.Config_File=x",
                   "--JupyterApp.config-file-name=x", "--JupyterApp.config_dir=/tmp", "--no-browser --config=/tmp/c.py"]
REFUSED.update({t: "XSRF check off" for t in XSRF_OFF})
REFUSED.update({t: "another config file" for t in CONFIG_SWITCHED})


@pytest.mark.parametrize("planted", sorted(REFUSED))
def test_lab_refuses_a_disabled_token_in_any_spelling(lab_tool, monkeypatch, capsys, planted):
    monkeypatch.setattr(lab_tool.os, "geteuid", lambda: 1000)
    assert lab_tool.main(["--dry-run", f"--lab-args={planted}"]) == 2   # as make lab gives LAB_ARGS
    err = capsys.readouterr().err
    assert err.startswith("make lab: refusing") and REFUSED[planted] in err, err
    assert lab_tool.main(["--dry-run", "--", *shlex.split(planted)]) == 2  # after --, as words
    assert REFUSED[planted] in capsys.readouterr().err


@pytest.mark.parametrize("planted", XSRF_OFF + CONFIG_SWITCHED)
def test_lab_names_the_refused_argument_and_what_to_do(lab_tool, monkeypatch, capsys, planted):
    """The refusal quotes the argument as given (the option and its value) and says what to do instead."""
    monkeypatch.setattr(lab_tool.os, "geteuid", lambda: 1000)
    assert lab_tool.main(["--dry-run", f"--lab-args={planted}"]) == 2
    err = capsys.readouterr().err
    words = shlex.split(planted)   # the argument as the learner gave it: the option word, with its value if apart
    shown = [w for i, w in enumerate(words) if w.startswith("-")] + [
        f"{w} {shlex.quote(words[i + 1])}" for i, w in enumerate(words[:-1]) if w.startswith("-")]
    assert any(err.startswith(f"make lab: refusing {a!r}: ") for a in shown), err
    assert "leave it out" in err and ("~/.jupyter/jupyter_server_config.py" in err or "XSRF" in err), err


def test_lab_passes_other_arguments_and_says_how_to_quote(lab_tool, monkeypatch, capsys):
    monkeypatch.setattr(lab_tool.os, "geteuid", lambda: 1000)
    fine = "--no-browser --ServerApp.base_url='/my lab/' --ServerApp.disable_check_xsrf=False " \
           "--ServerApp.password=argon2:abc"
    assert lab_tool.main(["--dry-run", f"--lab-args={fine}"]) == 0
    cmd = shlex.split(capsys.readouterr().out.split("would run: ", 1)[1])
    assert cmd[-5:] == ["--no-browser", "--ServerApp.base_url=/my lab/", "--ServerApp.disable_check_xsrf=False",
                        "--ServerApp.password=argon2:abc", "work/notebooks/00_start_here.ipynb"], cmd  # the work copy
    with pytest.raises(SystemExit):
        lab_tool.main(["--dry-run", "--lab-args=--ServerApp.base_url='/x"])
    assert "cannot be split into words" in capsys.readouterr().err


def test_lab_kernels_do_not_inherit_the_token(lab_tool, monkeypatch, tmp_path):
    """JupyterLab starts without JUPYTER_TOKEN (kernels and terminals copy the server's environment): the token
    travels in PINLAB_LAB_TOKEN to tools/lab_config/jupyter_server_config.py, which takes it out of the server's
    environment and gives it to the identity provider; that folder comes first on JUPYTER_CONFIG_PATH."""
    from traitlets.config import Config

    monkeypatch.setattr(lab_tool.os, "geteuid", lambda: 1000)
    monkeypatch.setenv("JUPYTER_TOKEN", "tok-abc")
    monkeypatch.setenv("JUPYTER_CONFIG_PATH", "/elsewhere")
    monkeypatch.chdir(tmp_path)  # main() goes to the repository before it execs
    seen = {}
    monkeypatch.setattr(lab_tool.os, "execve", lambda exe, cmd, env: seen.update(env=env))
    monkeypatch.setattr(lab_tool, "port_problem", lambda ip, port: None)
    lab_tool.main(["--ip", "127.0.0.1"])
    env = seen["env"]
    assert "JUPYTER_TOKEN" not in env and env["PINLAB_LAB_TOKEN"] == "tok-abc"
    assert env["JUPYTER_CONFIG_PATH"] == f"{ROOT / 'tools' / 'lab_config'}{os.pathsep}/elsewhere"
    config_file = ROOT / "tools" / "lab_config" / "jupyter_server_config.py"
    c = Config()
    monkeypatch.setattr(os, "environ", dict(env))
    exec(compile(config_file.read_text(), str(config_file), "exec"), {"get_config": lambda: c})
    assert "PINLAB_LAB_TOKEN" not in os.environ and "tok-abc" not in os.environ.values()
    assert c.IdentityProvider.token == "tok-abc" and c.PasswordIdentityProvider.token == "tok-abc"


# ---- tools/gpu-wheels.sh ----------------------------------------------------------------------------------------

_FAKE_PIP = """#!/usr/bin/env python3
# stands in for `python3 -m pip download ... -d DIR ...` (and logs its arguments to $FAKE_PIP_LOG). With `-r LOCK`
# (the pinned download) it writes the wheel of every pin, its bytes made from name and version (FAKE_PIP_TAMPER=NAME:
# other bytes for that one; FAKE_PIP_EXTRA=FILE: one more wheel); without (--relock) two wheels, one the image has.
import json, os, re, sys
from pathlib import Path
if os.environ.get("FAKE_PIP_LOG"):
    with open(os.environ["FAKE_PIP_LOG"], "a") as fh:
        fh.write(json.dumps(sys.argv[1:]) + "\\n")
d = Path(sys.argv[sys.argv.index("-d") + 1]); d.mkdir(parents=True, exist_ok=True)
if "-r" in sys.argv:
    for line in Path(sys.argv[sys.argv.index("-r") + 1]).read_text().splitlines():
        m = re.match(r"([a-z0-9-]+)==(\\S+)", line)
        if m:
            name, version = m.groups()
            data = b"tampered" if os.environ.get("FAKE_PIP_TAMPER") == name else f"{name}=={version}".encode() * 100
            (d / f"{name.replace('-', '_')}-{version}-py3-none-any.whl").write_bytes(data)
    if os.environ.get("FAKE_PIP_EXTRA"):
        (d / os.environ["FAKE_PIP_EXTRA"]).write_bytes(b"not pinned")
else:
    for name in ("nbval-0.11.0-py2.py3-none-any.whl", "numpy-2.2.0-cp312-cp312-manylinux_2_17_x86_64.whl"):
        (d / name).write_bytes(name.encode() * 100)
"""
#: what the pinned download of the test's lock writes
PINNED = ["jupyter_client-8.10.0-py3-none-any.whl", "nbval-0.11.0-py3-none-any.whl"]


def _pin(name: str, version: str) -> str:
    """A lock line for the wheel _FAKE_PIP writes for name==version."""
    return f"{name}=={version} --hash=sha256:{hashlib.sha256(f'{name}=={version}'.encode() * 100).hexdigest()}"


@pytest.fixture
def wheels_env(tmp_path):
    if not shutil.which("bash") or not shutil.which("sha256sum"):
        pytest.skip("needs bash and sha256sum")
    fake = tmp_path / "fakepy"
    fake.write_text(_FAKE_PIP)
    fake.chmod(0o755)
    lock = tmp_path / "pins.txt"
    lock.write_text("# pins\n" + _pin("jupyter-client", "8.10.0") + "\n" + _pin("nbval", "0.11.0") + "\n")
    return dict(os.environ, PYTHON=str(fake), LOCK=str(lock), FAKE_PIP_LOG=str(tmp_path / "pip.log"),
                NEWER_TRANSFORMERS="none")


def _wheels(dest, env, *options):
    return subprocess.run(["bash", str(ROOT / "tools" / "gpu-wheels.sh"), *options, str(dest)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def _printed_recipe(stdout: str) -> str:
    """The install line gpu-wheels.sh prints, its continuation lines joined."""
    text = stdout.split("into a fresh private folder, and put it on PYTHONPATH:", 1)[1]
    return re.sub(r"\\\n\s*", "", text).strip().splitlines()[0].strip()


def test_gpu_wheels_downloads_exactly_the_pinned_wheels_and_prints_a_private_install(tmp_path, wheels_env):
    dest = tmp_path / "whl"
    res = _wheels(dest, wheels_env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert sorted(p.name for p in dest.iterdir()) == ["SHA256SUMS", *PINNED]
    assert subprocess.run(["sha256sum", "--strict", "-c", "SHA256SUMS"], cwd=dest, capture_output=True).returncode == 0
    (call,) = [json.loads(line) for line in (tmp_path / "pip.log").read_text().splitlines()]
    assert call[:2] == ["-m", "pip"] and "download" in call and "--require-hashes" in call and "--no-deps" in call
    assert call[call.index("-r") + 1] == wheels_env["LOCK"]  # pip checks each file against the pins as it downloads
    assert "/tmp/site" not in res.stdout and 'SITE=$(mktemp -d)' in res.stdout
    assert "--require-hashes" in res.stdout and "-r tools/gpu-wheels.txt" in res.stdout
    assert _printed_recipe(res.stdout) == _recipe().replace("--find-links .whl", f"--find-links {dest}")
    # an earlier run's output is emptied first; anything else is refused and left alone
    (dest / "stale-1.0-py3-none-any.whl").write_bytes(b"old")
    res = _wheels(dest, wheels_env)
    assert res.returncode == 0 and "emptying" in res.stdout and not (dest / "stale-1.0-py3-none-any.whl").exists()
    (dest / "notes.txt").write_text("mine")
    res = _wheels(dest, wheels_env)
    assert res.returncode == 2 and "refusing to empty it" in res.stderr and (dest / "notes.txt").read_text() == "mine"
    assert _wheels(dest / "notes.txt", wheels_env).returncode == 2


@pytest.mark.parametrize("tamper", [None, "transformers", "huggingface-hub"])
def test_gpu_wheels_fetches_the_pinned_newer_transformers_apart(tmp_path, wheels_env, tamper):
    """Lesson 09's newer transformers is pinned apart (gpu-wheels-newer.txt beside the lock) with what it needs
    that the image lacks, and listed apart (SHA256SUMS.newer, not SHA256SUMS); where any of its wheels is not
    the pinned one, the whole newer set is left out, the file named (the lesson then replays its comparison)."""
    (tmp_path / "gpu-wheels-newer.txt").write_text(
        "# newer\n" + _pin("transformers", "5.25.0") + "\n" + _pin("huggingface-hub", "2.4.0") + "\n")
    env = {k: v for k, v in wheels_env.items() if k != "NEWER_TRANSFORMERS"}
    if tamper:
        env["FAKE_PIP_TAMPER"] = tamper
    dest = tmp_path / "whl"
    res = _wheels(dest, env)
    assert res.returncode == 0, res.stdout + res.stderr
    names = sorted(p.name for p in dest.iterdir())
    if tamper:
        assert names == ["SHA256SUMS", *PINNED] and "is not the wheel" in res.stderr
        assert tamper.replace("-", "_") + "-" in res.stderr and "left out" in res.stderr
        return
    newer = ["huggingface_hub-2.4.0-py3-none-any.whl", "transformers-5.25.0-py3-none-any.whl"]
    assert names == sorted(["SHA256SUMS", "SHA256SUMS.newer", *newer, *PINNED])
    assert "transformers" not in (dest / "SHA256SUMS").read_text()
    assert sorted(ln.split()[1] for ln in (dest / "SHA256SUMS.newer").read_text().splitlines()) == newer
    assert subprocess.run(["sha256sum", "--strict", "-c", "SHA256SUMS.newer"], cwd=dest).returncode == 0
    assert "-r tools/gpu-wheels-newer.txt" in res.stdout and "PINLAB_TRANSFORMERS_NEWER" in res.stdout


def test_the_committed_newer_pins_fit_one_device_call_with_the_suites_wheels():
    """tools/gpu-wheels-newer.txt: transformers and what it needs that the GPU image lacks, each pinned with its
    SHA-256, none also in tools/gpu-wheels.txt; the README's recipe installs both sets."""
    pins = {}
    for ln in (ROOT / "tools" / "gpu-wheels-newer.txt").read_text().splitlines():
        if ln.strip() and not ln.startswith("#"):
            m = re.fullmatch(r"([a-z0-9][a-z0-9-]*)==([0-9][0-9a-z.+]*) --hash=sha256:([0-9a-f]{64})", ln)
            assert m, f"tools/gpu-wheels-newer.txt: not a pinned line: {ln!r}"
            pins[m.group(1)] = m.group(2)
    assert "transformers" in pins and "huggingface-hub" in pins
    base = (ROOT / "tools" / "gpu-wheels.txt").read_text()
    assert not [n for n in pins if re.search(rf"^{n}==", base, re.M)], "pinned in both sets"
    script = (ROOT / "tools" / "gpu-wheels.sh").read_text()
    keep = script.split("NEWER_KEEP:-", 1)[1].split("}", 1)[0].split()
    assert sorted(keep) == sorted(pins), "--relock keeps what the committed newer pins hold"


@pytest.mark.parametrize("planted", ["tampered nbval", "an extra wheel", "a pin without its wheel"])
def test_gpu_wheels_refuses_a_download_that_is_not_what_the_lock_pins(tmp_path, wheels_env, planted):
    """Planted in what pip hands over: a wheel with other bytes than the pinned ones, a wheel the lock does not
    pin, a pin whose wheel is missing. The script refuses (exit 1), names the file, and copies nothing."""
    env = dict(wheels_env)
    if planted == "tampered nbval":
        env["FAKE_PIP_TAMPER"] = "nbval"
    elif planted == "an extra wheel":
        env["FAKE_PIP_EXTRA"] = "evil-1.0-py3-none-any.whl"
    else:
        Path(env["LOCK"]).write_text(Path(env["LOCK"]).read_text() + _pin("ghost", "1.0").replace(
            hashlib.sha256(b"ghost==1.0" * 100).hexdigest(), "0" * 64) + "\n")
    dest = tmp_path / "whl"
    res = _wheels(dest, env)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "refusing the download, nothing copied" in res.stderr, res.stderr
    if planted != "a pin without its wheel":
        assert ("nbval-0.11.0" if "tampered" in planted else "evil-1.0") in res.stderr
    assert not dest.exists() or not list(dest.iterdir())


def test_gpu_wheels_relock_writes_the_pins_of_the_wheels_it_keeps(tmp_path, wheels_env):
    """--relock resolves afresh (no -r, no --require-hashes), leaves out what the image has (numpy) and writes the
    lock: one pinned line per kept wheel, its version and the SHA-256 of the file, under a header saying so."""
    lock = tmp_path / "new-pins.txt"
    env = dict(wheels_env, LOCK=str(lock))
    dest = tmp_path / "whl"
    res = _wheels(dest, env, "--relock")
    assert res.returncode == 0, res.stdout + res.stderr
    wheel = dest / "nbval-0.11.0-py2.py3-none-any.whl"
    assert sorted(p.name for p in dest.iterdir()) == ["SHA256SUMS", wheel.name]
    lines = [ln for ln in lock.read_text().splitlines() if not ln.startswith("#")]
    assert lines == [f"nbval==0.11.0 --hash=sha256:{hashlib.sha256(wheel.read_bytes()).hexdigest()}"]
    assert "--require-hashes" in lock.read_text() and "numpy" not in lock.read_text()
    assert re.search(r"left out \(the GPU image has them.*debugpy\): numpy", res.stdout) and "review" in res.stdout
    calls = [json.loads(line) for line in (tmp_path / "pip.log").read_text().splitlines()]
    assert calls and not any("--require-hashes" in c or "-r" in c for c in calls)
    res = _wheels(tmp_path / "again", env)  # the pinned download of the new lock takes what it pins
    assert res.returncode == 1 and "nbval-0.11.0" in res.stderr  # (the fake writes other bytes when pinned)
    assert _wheels(tmp_path / "x", dict(wheels_env, LOCK=str(tmp_path / "missing.txt"))).returncode == 2


def test_gpu_wheels_refuses_a_dest_that_is_a_symlink(tmp_path, wheels_env):
    """DEST a symbolic link to a folder holding another wheel: the link is refused and nothing is written there
    (before, the "only an earlier run's wheels" check looked at the link, not the folder, and the other wheel
    ended up in SHA256SUMS); the folder itself gets the check (its wheels are an earlier run's: emptied)."""
    real = tmp_path / "real"
    real.mkdir()
    (real / "foreign-1.0-py3-none-any.whl").write_bytes(b"not from this script")
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    res = _wheels(link, wheels_env)
    assert res.returncode == 2 and "is a symbolic link" in res.stderr and str(real) in res.stderr, res.stderr
    assert sorted(p.name for p in real.iterdir()) == ["foreign-1.0-py3-none-any.whl"]
    res = _wheels(real, wheels_env)
    assert res.returncode == 0, res.stdout + res.stderr
    sums = (real / "SHA256SUMS").read_text()
    assert "foreign" not in sums and sorted(p.name for p in real.iterdir()) == ["SHA256SUMS", *PINNED]
    (real / "sneaky.whl").symlink_to(tmp_path / "elsewhere.whl")   # a link inside DEST: not an earlier run's file
    res = _wheels(real, wheels_env)
    assert res.returncode == 2 and "refusing to empty it" in res.stderr


def _recipe() -> str:
    text = (ROOT / "CONTRIBUTING.md").read_text()
    section = text.split("## Running the GPU suite", 1)[1].split("\n## ", 1)[0]
    (line,) = [ln for ln in section.splitlines() if ln.startswith("SITE=")]
    return line


def _dummy_wheel(folder: Path, name: str, version: str, body: str = "VALUE = 1\n") -> Path:
    """A real, installable pure-Python wheel (one module), made here: no network."""
    import base64
    import zipfile

    dist = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": body.encode(),
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
             f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{n},sha256={base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b'=').decode()},{len(d)}\n"
                     for n, d in files.items()) + f"{dist}/RECORD,,\n"
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for n, d in files.items():
            z.writestr(n, d)
        z.writestr(f"{dist}/RECORD", record)
    return path


def _run_recipe(work: Path, bin_dir: Path) -> tuple[subprocess.CompletedProcess, Path]:
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.pop("PYTHONPATH", None)
    script = _recipe() + '\nrc=$?; echo "SITE=$SITE"; stat -c %a "$SITE"; exit $rc'
    res = subprocess.run(["bash", "-c", script], cwd=work, env=env, capture_output=True, text=True, timeout=300)
    return res, Path(res.stdout.split("SITE=", 1)[1].split()[0])


def test_the_recipe_installs_only_wheels_whose_hashes_the_repository_pins(tmp_path):
    """CONTRIBUTING.md's install line, run by a real pip (this Python's, as python3) in a scratch project: its .whl/
    holds two wheels made here and its tools/gpu-wheels.txt pins them. They install into a fresh private folder.
    Planted: a wheel with other contents under the same file name (tampered), the pinned version swapped for
    another; each is refused (pip: the hashes do not match / no such version) and nothing is installed. A wheel
    in .whl/ that the file does not pin is never installed."""
    if not shutil.which("bash"):
        pytest.skip("needs bash")
    work = tmp_path / "project"
    (work / ".whl").mkdir(parents=True)
    (work / "tools").mkdir()
    a = _dummy_wheel(work / ".whl", "pinlab_dummy_a", "1.0")
    b = _dummy_wheel(work / ".whl", "pinlab_dummy_b", "2.0")
    _dummy_wheel(work / ".whl", "pinlab_dummy_extra", "1.0")   # in the transfer, not pinned
    (work / "tools" / "gpu-wheels.txt").write_text("# pins\n" + "".join(
        f"{w.name.split('-')[0].replace('_', '-')}=={w.name.split('-')[1]} "
        f"--hash=sha256:{hashlib.sha256(w.read_bytes()).hexdigest()}\n" for w in (a, b)))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    res, site = _run_recipe(work, bin_dir)
    assert res.returncode == 0, res.stdout + res.stderr
    assert site != Path("/tmp/site") and site.is_dir() and res.stdout.strip().endswith("700")
    installed = sorted(p.name for p in site.iterdir())
    assert "pinlab_dummy_a" in installed and "pinlab_dummy_b" in installed and "pinlab_dummy_extra" not in installed
    shutil.rmtree(site)

    good = a.read_bytes()
    _dummy_wheel(work / ".whl", "pinlab_dummy_a", "1.0", body="import os\nVALUE = 1\n")  # tampered: same name
    res, site = _run_recipe(work, bin_dir)
    assert res.returncode != 0 and "DO NOT MATCH THE HASHES" in res.stderr, res.stdout + res.stderr
    assert not list(site.iterdir()), "a tampered wheel: nothing may be installed"
    shutil.rmtree(site)
    a.write_bytes(good)

    b.unlink()
    _dummy_wheel(work / ".whl", "pinlab_dummy_b", "2.1")   # another version of it
    res, site = _run_recipe(work, bin_dir)
    assert res.returncode != 0 and "pinlab-dummy-b==2.0" in res.stderr.replace("_", "-"), res.stdout + res.stderr
    assert not list(site.iterdir())
    shutil.rmtree(site)


def test_the_committed_pins_are_wheels_of_the_suite_with_their_sha256():
    """tools/gpu-wheels.txt: one `name==version --hash=sha256:<64 hex>` line per wheel, names unique, none that
    the GPU image has (gpu-wheels.sh's list), and the ones the suite needs among them."""
    text = (ROOT / "tools" / "gpu-wheels.txt").read_text()
    script = (ROOT / "tools" / "gpu-wheels.sh").read_text()
    image = set(script.split('image="', 1)[1].split('"', 1)[0].split())
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    pins = {}
    for ln in lines:
        m = re.fullmatch(r"([a-z0-9][a-z0-9-]*)==([0-9][0-9a-z.+]*) --hash=sha256:([0-9a-f]{64})", ln)
        assert m, f"tools/gpu-wheels.txt: not a pinned line: {ln!r}"
        assert m.group(1) not in pins, f"{m.group(1)} pinned twice"
        pins[m.group(1)] = m.group(2)
    assert not set(pins) & image, f"pinned, yet the GPU image has them: {sorted(set(pins) & image)}"
    assert pins["flashinfer-python"] == "0.6.18.post1" and {"apache-tvm-ffi", "nbval", "nbclient", "ipykernel"} <= set(pins)
    assert len({ln.rsplit(':', 1)[1] for ln in lines}) == len(lines), "two pins with one hash"


def test_gpu_wheels_needs_nothing_from_shared():
    for path in (ROOT / "tools" / "gpu-wheels.sh", ROOT / "tools" / "gpu_suite.py"):
        assert "../shared" not in path.read_text() and "/tmp/site" not in path.read_text().replace(
            "such as /tmp/site", "")


# ---- tools/build_site.py --out ------------------------------------------------------------------------------

def test_build_site_refuses_to_empty_a_folder_outside_build(tmp_path, monkeypatch):
    import build_site

    monkeypatch.chdir(ROOT)

    victim = tmp_path / "precious"
    victim.mkdir()
    (victim / "thesis.tex").write_text("years of work")
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "build_site.py"), "--out", str(victim)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "outside" in res.stderr and "--force" in res.stderr
    assert (victim / "thesis.tex").read_text() == "years of work"
    assert build_site.out_problem(ROOT / "build" / "site") is None
    assert build_site.out_problem(Path("build/site")) is None                # as make site gives it
    assert build_site.out_problem(ROOT / "build") is not None            # build/ itself: not a site folder
    assert build_site.out_problem(ROOT / "build" / ".." / "lib") is not None
    for never in (ROOT, ROOT.parent, Path("/"), Path.home()):
        assert "refused" in build_site.out_problem(never, force=True)


def test_build_site_deletes_nothing_outside_build_even_with_force(tmp_path, monkeypatch):
    """--force allows a new or empty folder outside build/ (nothing there is deleted), never one holding files:
    not /usr, not /etc, not a folder of someone's work."""
    import build_site

    monkeypatch.chdir(ROOT)
    for system in (Path("/usr"), Path("/etc")):
        assert "deletes nothing outside build/" in build_site.out_problem(system, force=True)
    victim = tmp_path / "precious"
    victim.mkdir()
    (victim / "thesis.tex").write_text("years of work")
    assert "even with --force" in build_site.out_problem(victim, force=True)
    assert "is not a folder" in build_site.out_problem(victim / "thesis.tex", force=True)
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "build_site.py"), "--out", str(victim), "--force"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "even with --force" in res.stderr, res.stderr
    with pytest.raises(ValueError, match="even with --force"):       # build() itself checks, for make run
        build_site.build(victim)
    assert (victim / "thesis.tex").read_text() == "years of work"
    (tmp_path / "empty").mkdir()
    assert build_site.out_problem(tmp_path / "empty", force=True) is None
    assert build_site.out_problem(tmp_path / "new" / "site", force=True) is None
    assert "--force for a new or empty folder" in build_site.out_problem(tmp_path / "empty")


def _checkout_with_build_link(tmp_path, target):
    root = tmp_path / "checkout"
    root.mkdir()
    (root / "build").symlink_to(target, target_is_directory=True)
    return root


def test_build_site_resolves_symlinks_and_refuses_a_build_folder_that_is_a_link(tmp_path, monkeypatch):
    """build/ a symbolic link to a folder outside the checkout: the site would be deleted and written there;
    refused, and nothing there is deleted (plain run and build() alike). A link inside build/ to elsewhere is
    judged by where it leads."""
    import build_site

    outside = tmp_path / "outside"
    (outside / "site").mkdir(parents=True)
    (outside / "site" / "keep.txt").write_text("not the site's")
    root = _checkout_with_build_link(tmp_path, outside)
    for force in (False, True):
        problem = build_site.out_problem(root / "build" / "site", force=force, root=root)
        assert problem and "is a symbolic link to" in problem and "rm " in problem, problem
    monkeypatch.setattr(build_site, "ROOT", root)
    with pytest.raises(ValueError, match="symbolic link"):
        build_site.build(root / "build" / "site")
    assert (outside / "site" / "keep.txt").read_text() == "not the site's"

    real = tmp_path / "real"   # build/ a real folder, build/site a link out of it
    (real / "build").mkdir(parents=True)
    (real / "build" / "site").symlink_to(outside / "site", target_is_directory=True)
    for force in (False, True):
        problem = build_site.out_problem(real / "build" / "site", force=force, root=real)
        assert problem and "leads through a symbolic link" in problem, problem
    (real / "build" / "inner").mkdir()
    (real / "build" / "alias").symlink_to(real / "build" / "inner", target_is_directory=True)
    assert build_site.out_problem(real / "build" / "alias", root=real) is None  # a link that stays inside build/
    loop = real / "build" / "loop"
    loop.symlink_to(loop)
    assert build_site.out_problem(loop, force=True, root=real) is not None
    assert (outside / "site" / "keep.txt").read_text() == "not the site's"


# ---- tools/mutation_check.py: only behaviour tests catch a mutant ----------------------------------------------

_BEHAVIOUR = "from pinlab.x import f\n\n\ndef test_f():\n    assert f() == 1\n"
_HASH = """import hashlib
from pathlib import Path

SHA = {sha!r}


def test_source_unchanged():  # a staleness check: fails for any edit of lib/
    assert hashlib.sha256((Path(__file__).parents[1] / "lib/pinlab/x.py").read_bytes()).hexdigest() == SHA
"""


@pytest.mark.slow
def test_mutation_check_counts_only_behaviour_tests(tmp_path, monkeypatch, capsys):
    import hashlib

    import mutation_check as mc

    repo = tmp_path / "repo"
    (repo / "lib" / "pinlab").mkdir(parents=True)
    (repo / "tests").mkdir()
    (repo / "lib" / "pinlab" / "__init__.py").write_text("")
    src = "def f():\n    one = 1\n    return one\n"
    (repo / "lib" / "pinlab" / "x.py").write_text(src)
    sha = hashlib.sha256(src.encode()).hexdigest()
    (repo / "tests" / "test_behaviour.py").write_text(_BEHAVIOUR)
    (repo / "tests" / "test_evidence.py").write_text(_HASH.format(sha=sha))   # listed in STALENESS_TESTS
    (repo / "tests" / "test_pinned_hash.py").write_text(_HASH.format(sha=sha))  # found by the control run
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    tests = ["tests/test_behaviour.py", "tests/test_evidence.py", "tests/test_pinned_hash.py"]
    monkeypatch.setattr(mc, "ROOT", repo)
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # these tiny tests need no plugin: faster starts
    monkeypatch.setattr(mc, "MUTATIONS", [
        mc.Mutation("x.wrong", "lib/pinlab/x.py", "    return one\n", "    return one + 1\n", tests, "f() is 2"),
        mc.Mutation("x.renamed", "lib/pinlab/x.py", "    one = 1\n    return one\n",
                    "    uno = 1\n    return uno\n", tests, "a rename: no behaviour changes"),
        mc.Mutation("x.only_hashes", "lib/pinlab/x.py", "    return one\n", "    return one + 1\n",
                    ["tests/test_evidence.py"], "listed with a staleness check only"),
    ])
    assert mc.main(["--timeout", "120"]) == 1   # the rename survives: only hash checks fail on it
    out = capsys.readouterr().out
    rows = {ln.split()[0]: ln for ln in out.splitlines() if ln.startswith("x.")}
    assert "caught" in rows["x.wrong"] and "1 tests: test_behaviour.py::test_f" in rows["x.wrong"]
    assert "SURVIVED" in rows["x.renamed"]
    assert "STALE" in rows["x.only_hashes"] and "no behaviour test listed" in rows["x.only_hashes"]
    assert "test_pinned_hash.py::test_source_unchanged" in out.split("control", 1)[1].splitlines()[0]
    assert mc.caught_by({"test_evidence.py::t", "test_notebooks.py::t", "test_l01.py::t"}, set(), set()) == [
        "test_l01.py::t"]


def test_suites_started_at_once_add_their_stability_runs_under_one_lock(tmp_path):
    """gpu_suite.stability_lock: three writers doing read-merge-write lose no update."""
    import json
    import threading

    import gpu_suite

    path = tmp_path / "stability.json"
    path.write_text("[]")

    def add(i):
        for _ in range(40):
            with gpu_suite.stability_lock(path):
                runs = json.loads(path.read_text())
                runs.append(i)
                path.write_text(json.dumps(runs))

    threads = [threading.Thread(target=add, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(json.loads(path.read_text())) == sorted([0, 1, 2] * 40)


def test_the_gpu_unit_tests_run_on_several_workers_only_without_a_notebook(monkeypatch):
    """Issue 44: a core change renews the quiet pass of all 20 notebooks (459 s) and the gpu unit tests (110-117 s
    one after another, stops 57-58): two calls, where one of at most 9 minutes is asked. The unit tests run on
    pytest-xdist workers when no notebook shares their pytest run; a notebook in it (--nbval) keeps it serial, since
    each notebook must be alone on the GPU; where pytest-xdist is missing, serial, said."""
    import importlib.util

    import gpu_suite

    files = ["tests/test_a.py", "tests/test_b.py", "tests/test_c.py"]
    assert gpu_suite.unit_test_workers([], files) == 3  # at most one worker per file
    assert gpu_suite.unit_test_workers([], files + ["tests/test_d.py", "tests/test_e.py"]) == gpu_suite.UNIT_TEST_WORKERS
    assert gpu_suite.unit_test_workers(["notebooks/01_x.ipynb"], files) == 1
    assert gpu_suite.unit_test_workers([], files, asked=1) == 1
    assert gpu_suite.unit_test_workers([], []) == 1
    with pytest.raises(ValueError, match="--unit-test-workers must be at least 1"):
        gpu_suite.unit_test_workers([], files, asked=0)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "xdist" else real(name, *a))
    assert gpu_suite.unit_test_workers([], files) == 1
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_suite.py"), "--unit-test-workers", "0"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "--unit-test-workers must be at least 1" in r.stderr


@pytest.mark.slow
def test_a_pytest_pass_on_workers_counts_each_test_once(tmp_path):
    """The pytest log ($PINLAB_PYTEST_LOG) gets each report from the worker that ran it and again from the controller
    that received it: the unit test counts of a pass on two workers equal those of the same pass run serially."""
    import argparse

    import gpu_suite

    files = ["tests/test_h2d.py", "tests/test_streams_cuda.py"]
    counts = {}
    for workers in (1, 2):
        args = argparse.Namespace(cell_timeout=60, unit_test_workers=workers)
        _, unit, _, _ = gpu_suite.pytest_pass([], files, args, tmp_path / f"nbval{workers}.log", require_gpu=False)
        counts[workers] = {k: unit[k] for k in ("passed", "failed", "skipped")}
        assert unit["workers"] == workers and ("-n 2" in unit["command"]) == (workers == 2)
    assert counts[1] == counts[2] and sum(counts[1].values()) > 0, counts
