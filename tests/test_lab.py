"""JupyterLab as `make lab` starts it, driven through its REST API and a kernel's websocket.

The server is started the way the Makefile does (`make lab`: `python tools/lab.py ...`, which makes the learner's
copy of the course and runs `python -m jupyter lab --ServerApp.root_dir=work work/notebooks/00_start_here.ipynb`
in the repository), headless (LAB_ARGS=--no-browser), on a free port of 127.0.0.1 (LAB_IP, LAB_PORT), with a
token handed over in JUPYTER_TOKEN, its copy in a fresh folder under build/ (LAB_WORK; the default, work/, may
hold a learner's work). The test checks that the copies of the course's notebooks, exercises and solutions are
listed, that a notebook saved through JupyterLab's API changes that copy and no file git tracks (`git status`
the same before and after), that a kernel starts and runs `import pinlab; pinlab.header("x")`, then stops the
kernel and the server and checks that no process of theirs is left (every one of them names this test's runtime
folder on its command line). The work copy itself (made once, never overwritten, reset by deleting a notebook)
is checked without JupyterLab.
"""
from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 120   # JupyterLab's first start on a busy 2-core machine
KERNEL_TIMEOUT_S = 120  # kernel start + importing torch


sys.path.insert(0, str(ROOT / "tools"))
import lab as lab_tool  # noqa: E402  (tools/lab.py)


def _lab_command(port: int, work: str = "work") -> list[str]:
    """The command `make lab` runs (read with `make -n`, this Python in place of the venv's), headless on
    127.0.0.1:``port``, the copies in ``work``; as root (CI) with ALLOW_ROOT=1, which `make lab` needs there."""
    make_vars = [f"VPY={sys.executable}", "LAB_IP=127.0.0.1", f"LAB_PORT={port}", "LAB_ARGS=--no-browser",
                 f"LAB_WORK={work}"]
    if os.geteuid() == 0:
        make_vars.append("ALLOW_ROOT=1")
    if shutil.which("make"):
        res = subprocess.run(["make", "-s", "-n", "lab", *make_vars], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
        lines = [ln for ln in res.stdout.splitlines() if "tools/lab.py" in ln]
        assert lines, f"`make -n lab` shows no `tools/lab.py` command:\n{res.stdout}{res.stderr}"
        return shlex.split(lines[-1])
    # the Makefile's, without make
    return [sys.executable, "tools/lab.py", "--python", sys.executable, "--ip", "127.0.0.1", "--port", str(port),
            *(["--allow-root"] if os.geteuid() == 0 else []), "--work", work, "--", "--no-browser"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _procs_naming(text: str) -> list[str]:
    """Live processes whose command line contains ``text`` (pid and command line)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmd and state != "Z":
            out.append(f"{d.name}: {cmd.strip()}")
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Lab:
    def __init__(self, port: int, token: str, proc: subprocess.Popen, log: Path, work: Path):
        self.base, self.token, self.proc, self.log = f"http://127.0.0.1:{port}", token, proc, log
        self.work = work  # the learner's copy this server shows

    def api(self, method: str, path: str, body: dict | None = None, timeout: float = 30):
        req = urllib.request.Request(self.base + path, method=method,
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Authorization": f"token {self.token}",
                                              "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            data = resp.read()
            return resp.status, (json.loads(data) if data else None)

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""


@pytest.fixture
def lab(tmp_path):
    pytest.importorskip("jupyterlab", reason="JupyterLab is not installed (make setup installs it)")
    runtime = tmp_path / "jupyter-runtime"
    port, token = _free_port(), secrets.token_hex(24)
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(runtime), PYTHONUNBUFFERED="1", JUPYTER_TOKEN=token)
    work = ROOT / "build" / f"test-lab-work-{secrets.token_hex(4)}"  # git-ignored, inside the checkout as work/ is
    cmd = _lab_command(port, work.relative_to(ROOT).as_posix())  # the Makefile's `lab` command, headless, private
    log = tmp_path / "lab.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    server = Lab(port, token, proc, log, work)
    try:
        _wait_until_up(proc, lambda: server.api("GET", "/api/status", timeout=5)[0] == 200, server.log_tail)
        head = log.read_text(errors="replace")[:3000]
        assert f"JupyterLab on the course: http://127.0.0.1:{port}/lab?token={token}" in head, head
        assert "plain HTTP" not in head and token not in " ".join(cmd)  # loopback: no warning; token not in argv
        assert f"Your copy of the course: {work.relative_to(ROOT).as_posix()}/ (made now" in head, head
        assert "To start a notebook over, delete it from" in head and "run make lab again" in head, head
        yield server
    finally:
        _end_server(proc, runtime)  # the test failed before its own shutdown, or left processes behind
        shutil.rmtree(work, ignore_errors=True)


def _answers(url: str) -> bool:
    """Does a server answer ``url`` at all (any status: a server with another token answers 403)?"""
    try:
        urllib.request.urlopen(url, timeout=5)
    except urllib.error.HTTPError:
        pass
    return True


def _wait_until_up(proc, answers, log_tail, what: str = "jupyter lab") -> None:
    """Poll ``answers()`` (True once the server is up; a connection error: not yet) until it is; fail with the
    log's tail when the process exits first or START_TIMEOUT_S passes."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            pytest.fail(f"{what} exited with {proc.returncode} before answering:\n{log_tail()}")
        try:
            if answers():
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not answer within {START_TIMEOUT_S} s:\n{log_tail()}")
        time.sleep(0.3)


def _end_server(proc, runtime: Path) -> None:
    """End a server's process group if it still runs, then whatever it left naming its runtime folder."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    for line in _procs_naming(str(runtime)):
        os.kill(int(line.split(":", 1)[0]), signal.SIGKILL)


def _execute(ws, session: str, code: str, timeout: float) -> str:
    """Run ``code`` in the kernel over its websocket (Jupyter messaging, JSON frames); return stdout."""
    msg_id = uuid.uuid4().hex
    ws.send(json.dumps({
        "header": {"msg_id": msg_id, "username": "test", "session": session, "msg_type": "execute_request",
                   "version": "5.3", "date": dt.datetime.now(dt.timezone.utc).isoformat()},
        "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
        "content": {"code": code, "silent": False, "store_history": False, "user_expressions": {},
                    "allow_stdin": False, "stop_on_error": True}}))
    out, reply, idle = [], None, False
    deadline = time.monotonic() + timeout
    while reply is None or not idle:
        ws.settimeout(max(0.1, deadline - time.monotonic()))
        if time.monotonic() > deadline:
            raise TimeoutError(f"no answer to {code!r} within {timeout} s; stdout so far: {''.join(out)!r}")
        msg = json.loads(ws.recv())
        if msg.get("parent_header", {}).get("msg_id") != msg_id:
            continue
        kind, content = msg["header"]["msg_type"], msg["content"]
        if kind == "stream":
            out.append(content["text"])
        elif kind == "error":
            raise AssertionError(f"{code!r} failed in the kernel:\n" + "\n".join(content["traceback"]))
        elif kind == "execute_reply":
            reply = content
        elif kind == "status" and content["execution_state"] == "idle":
            idle = True
    assert reply["status"] == "ok", reply
    return "".join(out)


def _git_status() -> str:
    res = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stdout


def _save_changes_only_the_copy(lab) -> None:
    """Run-and-save as a learner does it: the lesson with a new cell and new outputs, written back through
    JupyterLab's contents API (Jupytext's contents manager included, where installed)."""
    rel = "notebooks/03_the_race.ipynb"
    tracked = {p: (ROOT / p).read_bytes() for p in (rel, "notebooks/src/03_the_race.py")}
    before = _git_status() if shutil.which("git") and (ROOT / ".git").exists() else None
    status, model = lab.api("GET", f"/api/contents/{rel}")
    assert status == 200 and model["type"] == "notebook", model
    nb = model["content"]
    nb["cells"].append({"cell_type": "markdown", "metadata": {}, "source": "my notes on the race"})
    for c in nb["cells"]:
        if c["cell_type"] == "code":
            c["outputs"] = [{"output_type": "stream", "name": "stdout", "text": "a CPU run's output\n"}]
            c["execution_count"] = 1
            break
    status, saved = lab.api("PUT", f"/api/contents/{rel}", {"type": "notebook", "format": "json", "content": nb})
    assert status == 200, saved
    copy = json.loads((lab.work / rel).read_text(encoding="utf-8"))
    assert "my notes on the race" in json.dumps(copy), "the save did not reach the learner's copy"
    for p, data in tracked.items():
        assert (ROOT / p).read_bytes() == data, f"saving {rel} in JupyterLab changed the tracked {p}"
    assert not list(lab.work.rglob("src")), "Jupytext paired the learner's copy with a source file"
    if before is not None:
        assert _git_status() == before, "saving in JupyterLab changed what git sees in the checkout"


@pytest.mark.slow
def test_jupyter_lab_lists_the_course_and_runs_pinlab(lab, tmp_path):
    websocket = pytest.importorskip("websocket", reason="websocket-client is not installed")
    # the learner's copy of the course is there, with every folder of notebooks, and nothing else of the repository
    top = {item["name"] for item in lab.api("GET", "/api/contents")[1]["content"]}
    assert {"notebooks", "exercises", "solutions"} <= top and "lib" not in top, (
        f"JupyterLab's file browser shows {sorted(top)}: `make lab` must serve the learner's copy "
        "(`jupyter lab --ServerApp.root_dir=work work/notebooks/00_start_here.ipynb`)")
    _save_changes_only_the_copy(lab)
    for folder in ("notebooks", "exercises", "solutions"):
        want = {p.name for p in (ROOT / folder).glob("*.ipynb")}
        status, listing = lab.api("GET", f"/api/contents/{folder}")
        got = {i["name"] for i in listing["content"] if i["type"] == "notebook"}
        assert want and want <= got, f"{folder}: JupyterLab lists {sorted(got)}, the course has {sorted(want)}"
    status, nb = lab.api("GET", "/api/contents/notebooks/00_start_here.ipynb")
    assert status == 200 and nb["type"] == "notebook" and nb["content"]["cells"]
    status, lab_page = 0, b""
    with urllib.request.urlopen(f"{lab.base}/lab?token={lab.token}", timeout=30) as resp:
        status, lab_page = resp.status, resp.read()
    assert status == 200 and b"JupyterLab" in lab_page
    # without the token (or with another one) the API refuses: authentication is on
    for headers in ({}, {"Authorization": "token not-the-token"}):
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(f"{lab.base}/api/contents", headers=headers), timeout=30)
        assert refused.value.code == 403, refused.value.code
    assert "All authentication is disabled" not in lab.log_tail()

    # a kernel starts and runs the course's first line
    status, kernel = lab.api("POST", "/api/kernels", {"name": "python3"})
    assert status == 201, kernel
    session = uuid.uuid4().hex
    ws = websocket.create_connection(
        f"ws://127.0.0.1:{lab.base.rsplit(':', 1)[1]}/api/kernels/{kernel['id']}/channels?session_id={session}",
        header=[f"Authorization: token {lab.token}"], timeout=KERNEL_TIMEOUT_S)
    try:
        out = _execute(ws, session, 'import pinlab; pinlab.header("x")', KERNEL_TIMEOUT_S)
        assert out.startswith("pinlab | x\n") and "mode: " in out, out
        pid = int(_execute(ws, session, "import os; print(os.getpid())", 30))
        # the kernel's environment holds no token: not JUPYTER_TOKEN, not the variable that carried it to the server
        env = json.loads(_execute(ws, session, "import json, os; print(json.dumps(dict(os.environ)))", 30))
        assert "JUPYTER_TOKEN" not in env and "PINLAB_LAB_TOKEN" not in env, sorted(env)
        assert not [k for k, v in env.items() if lab.token in v], "the kernel's environment holds the token"
    finally:
        ws.close()
    assert lab.api("DELETE", f"/api/kernels/{kernel['id']}")[0] == 204
    assert kernel["id"] not in {k["id"] for k in lab.api("GET", "/api/kernels")[1]}

    # stop the server; nothing of it is left
    lab.api("POST", "/api/shutdown")
    lab.proc.wait(timeout=60)
    deadline = time.monotonic() + 10
    while _procs_naming(str(tmp_path / "jupyter-runtime")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _procs_naming(str(tmp_path / "jupyter-runtime")), "processes left after the server stopped"
    assert not _alive(pid), f"the kernel (pid {pid}) is still running"


# ---------------------------------------------------------------------------------------------
# the work copy, without JupyterLab


def _course(tmp_path: Path) -> Path:
    root = tmp_path / "course"
    for folder, names in (("notebooks", ["00_a.ipynb", "01_b.ipynb"]), ("exercises", ["01_b.ipynb"]),
                          ("solutions", ["01_b.ipynb"])):
        (root / folder / "src").mkdir(parents=True)
        (root / folder / "src" / "01_b.py").write_text("# %%\n")  # sources are not copied
        for n in names:
            (root / folder / n).write_text(json.dumps({"cells": [], "name": f"{folder}/{n}"}))
    return root


def test_the_work_copy_is_made_once_and_never_overwritten(tmp_path):
    root = _course(tmp_path)
    work = root / "work"
    made, kept = lab_tool.make_work_copy(work, root)
    assert sorted(made) == ["exercises/01_b.ipynb", "notebooks/00_a.ipynb", "notebooks/01_b.ipynb",
                            "solutions/01_b.ipynb"] and kept == 0
    assert not list(work.rglob("*.py")) and (work / "jupytext.toml").read_text() == lab_tool.WORK_JUPYTEXT
    assert (work / "notebooks" / "01_b.ipynb").read_bytes() == (root / "notebooks" / "01_b.ipynb").read_bytes()
    # a learner's work is kept, even when the course's notebook changes
    (work / "notebooks" / "01_b.ipynb").write_text("my work")
    (root / "notebooks" / "01_b.ipynb").write_text(json.dumps({"cells": [], "name": "a newer version"}))
    assert lab_tool.make_work_copy(work, root) == ([], 4)
    assert (work / "notebooks" / "01_b.ipynb").read_text() == "my work"
    # starting one over: delete it, run make lab again
    (work / "notebooks" / "01_b.ipynb").unlink()
    assert lab_tool.make_work_copy(work, root) == (["notebooks/01_b.ipynb"], 3)
    assert "a newer version" in (work / "notebooks" / "01_b.ipynb").read_text()
    # a notebook added to the course later is copied, the rest kept
    (root / "exercises" / "02_c.ipynb").write_text("{}")
    assert lab_tool.make_work_copy(work, root) == (["exercises/02_c.ipynb"], 4)
    msg = lab_tool.work_message("work", ["exercises/02_c.ipynb"], 4)
    assert "work/" in msg and "kept" in msg and "delete it from work/ and run make lab again" in msg
    assert "made now (4 notebooks)" in lab_tool.work_message("work", made, 0)


def test_the_work_copy_pairs_nothing():
    """work/jupytext.toml is the nearest Jupytext config for every copy, and it pairs nothing (no formats): a save
    writes the copy only (the repository's jupytext.toml pairs notebooks/ and solutions/ with their src/)."""
    tomllib = pytest.importorskip("tomllib")
    assert "formats" not in tomllib.loads(lab_tool.WORK_JUPYTEXT)
    assert "formats" in tomllib.loads((ROOT / "jupytext.toml").read_text(encoding="utf-8"))


def test_the_work_folder_must_hold_no_tracked_file(tmp_path):
    for bad in (ROOT, ROOT / "notebooks", ROOT / "lib" / "x", ROOT.parent):
        assert lab_tool.work_problem(bad) is not None, bad
    for ok in (ROOT / "work", ROOT / "build" / "w", tmp_path / "mine"):
        assert lab_tool.work_problem(ok) is None, ok
    (tmp_path / "a-file").write_text("x")
    assert "not a folder" in lab_tool.work_problem(tmp_path / "a-file")
    res = subprocess.run([sys.executable, "tools/lab.py", "--dry-run", "--allow-root", "--work", "notebooks"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "--work notebooks" in res.stderr, res.stderr


def test_make_lab_opens_the_work_copy():
    had_work = (ROOT / "work").exists()
    res = subprocess.run([sys.executable, "tools/lab.py", "--dry-run", "--python", sys.executable, "--allow-root"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60, env=dict(os.environ, JUPYTER_TOKEN="t"))
    assert res.returncode == 0, res.stderr
    assert "--ServerApp.root_dir=work" in res.stdout and "work/notebooks/00_start_here.ipynb" in res.stdout, res.stdout
    assert (ROOT / "work").exists() == had_work, "--dry-run copies nothing"
    text = (ROOT / ".gitignore").read_text(encoding="utf-8")
    assert "/work/" in text.splitlines(), "work/ must be git-ignored"


# ---------------------------------------------------------------------------------------------
# issue 48: the XSRF check and the course's config file, against JupyterLab's own command-line parser and a real
# server


def _jupyterlab_parser():
    """A parser of `jupyter lab`'s command line as JupyterLab builds it (ExtensionApp.initialize_server: a
    ServerApp with LabApp's aliases added; flags and aliases flattened as traitlets does before parsing):
    ``parse(argv)`` is the config that argv gives, or None where JupyterLab would refuse to start."""
    pytest.importorskip("jupyterlab", reason="JupyterLab is not installed (make setup installs it)")
    import contextlib
    import io

    from jupyter_server.serverapp import ServerApp
    from jupyterlab.labapp import LabApp

    app = ServerApp()
    app.aliases = {**app.aliases, **LabApp.aliases}
    flags, aliases = app.flatten_flags()
    classes = list(app._classes_with_config_traits())

    def parse(argv):
        try:
            with contextlib.redirect_stderr(io.StringIO()), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # traitlets' DeprecationWarning for a dict given as {...}
                return app._create_loader(list(argv), aliases, flags, classes=classes).load_config()
        except (SystemExit, Exception):  # argparse's error, or a value traitlets cannot read: no server starts
            return None

    return parse, flags, aliases


#: dict traits whose items become the web application's settings (``settings.update(...)``), read as they are
_SETTINGS = ("tornado_settings", "settings")


def _leaves(config, depth=0):
    """(trait, value) of every setting of a traitlets Config, at any nesting (``ServerApp.IdentityProvider.token``);
    a top-level name (``--conf=x``: an unknown alias, which JupyterLab ignores) sets nothing."""
    for key, value in config.items():
        if isinstance(value, dict) and key not in _SETTINGS:
            yield from _leaves(value, depth + 1)
        elif depth:
            yield key, value


def _dangerous(config) -> list[str]:
    """What in ``config`` (the server's command-line config) turns the XSRF check off, switches the config file
    or sets the token or an empty password: traitlets' own reading of each value (Bool, Dict, Unicode)."""
    from traitlets import Bool, Dict
    from traitlets.config.loader import DeferredConfigList

    found = []
    for key, value in _leaves(config or {}):
        raw = list(value) if isinstance(value, (DeferredConfigList, list)) else value
        if key == "disable_check_xsrf":
            try:
                on = Bool().from_string(str(raw)) if isinstance(raw, str) else bool(raw)
            except Exception:
                on = False  # traitlets cannot read it: the server does not start
            if on:
                found.append(key)
        elif key in _SETTINGS:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    parsed = raw if isinstance(raw, dict) else Dict().from_string_list(
                        raw if isinstance(raw, list) else [raw])
            except Exception:
                parsed = {}
            if parsed.get("disable_check_xsrf"):  # as the handlers read it: any true value ("False" too)
                found.append(f"{key}: disable_check_xsrf")
        elif key in ("config_file", "config_file_name"):
            found.append(key)
        elif key == "token" or key in ("password", "hashed_password") and not str(raw).strip("'\" "):
            found.append(key)
    return found


_CLASSES = ["ServerApp", "NotebookApp", "JupyterApp", "Application", "LabApp", "ExtensionApp", "IdentityProvider",
            "ServerApp.IdentityProvider", "serverapp"]
_TRAITS = ["disable_check_xsrf", "tornado_settings", "settings", "config_file", "config_file_name", "token",
           "password", "base_url", "DISABLE_CHECK_XSRF", "Config_File_Name"]
_VALUES = ["True", "1", "true", "yes", "False", "0", "", "x.py", "disable_check_xsrf=True", "disable_check_xsrf=False",
           "xsrf_cookies=False", "{'disable_check_xsrf': True}", "{'disable_check_\\x78srf': 1}",
           "{'headers': {'X-Frame-Options': 'DENY'}}", "headers={}"]


def _spellings(flags, aliases):
    """Command lines for JupyterLab: every refused trait (and a harmless one) in many spellings: class names,
    case, one or two dashes, `=` or the next word, values; every alias and flag JupyterLab has and every
    abbreviation of one (argparse takes an unambiguous prefix of a name with a dash in it)."""
    names = [f"{c}.{t}" for c in _CLASSES for t in _TRAITS] + ["config", "conf", "Config"]
    for name in names:
        for value in _VALUES:
            for dash in ("--", "-"):
                yield [f"{dash}{name}={value}"]
            yield [f"--{name}", value]
        yield ["--no-browser", f"--{name}=True", "--ServerApp.base_url=/x/"]
    for name in sorted(set(flags) | set(aliases)):
        for end in range(2, len(name) + 1):
            yield [f"--{name[:end]}"]
            yield [f"--{name[:end]}=/tmp/c.py"]
            yield [f"--{name[:end]}", "x=True"]


@pytest.mark.slow  # about 5,000 command lines through JupyterLab's parser: 10 s
def test_lab_refuses_every_command_line_jupyterlab_reads_as_xsrf_off_or_another_config():
    """Planted: about 5,000 command lines (the refused traits in every spelling traitlets accepts, and every alias
    and flag of the JupyterLab installed, abbreviated too). JupyterLab's own parser reads each; wherever the
    config it gets turns the XSRF check off, switches the config file or sets a token or an empty password,
    tools/lab.py refuses that command line (its rule may refuse more, never less)."""
    parse, flags, aliases = _jupyterlab_parser()
    dangerous, missed = 0, []
    for argv in _spellings(flags, aliases):
        found = _dangerous(parse(argv))
        if found:
            dangerous += 1
            if lab_tool.auth_problem(argv) is None:
                missed.append((argv, found))
    assert not missed, f"tools/lab.py lets through what JupyterLab reads as dangerous: {missed[:10]}"
    assert dangerous > 1000, dangerous  # the parser does read these as dangerous: the check checks something
    for argv in (["--ServerApp.tornado_settings=disable_check_xsrf=True"], ["--JupyterApp.config_file_name=x"],
                 ["--config", "/tmp/c.py"], ["-NotebookApp.disable_check_xsrf=1"]):
        assert _dangerous(parse(argv)) and lab_tool.auth_problem(argv), argv
    for argv in (["--ServerApp.disable_check_xsrf=False"], ["--ServerApp.tornado_settings=headers={}"],
                 ["--no-browser", "--ServerApp.base_url=/x/"], ["--conf=/tmp/c.py"]):  # --conf: an unknown alias
        assert not _dangerous(parse(argv)), argv
    for argv in (["--ServerApp.disable_check_xsrf=False"], ["--ServerApp.tornado_settings=headers={}"],
                 ["--no-browser", "--ServerApp.base_url=/x/"]):
        assert lab_tool.auth_problem(argv) is None, argv  # what is harmless passes


def test_lab_knows_every_alias_and_flag_of_jupyterlab_that_would_be_refused():
    """Planted: each alias and flag of the JupyterLab installed. One that sets a refused trait (today `--config`,
    JupyterApp.config_file) must be in tools/lab.py's ALIASES, or be refused by its name; a JupyterLab that adds
    such an alias or flag fails this test instead of slipping past make lab."""
    parse, flags, aliases = _jupyterlab_parser()
    refused_traits = lab_tool.CONFIG_TRAITS | {"token", "password", "hashed_password", "disable_check_xsrf"}
    for alias, target in aliases.items():
        if target.rsplit(".", 1)[1] in refused_traits:
            assert alias in lab_tool.ALIASES and lab_tool.ALIASES[alias].rsplit(".", 1)[1] == target.rsplit(".", 1)[1]
            assert lab_tool.auth_problem([f"--{alias}=x"]) and lab_tool.auth_problem([f"--{alias}", "x"])
    for flag in flags:
        if _dangerous(parse([f"--{flag}"])):
            assert lab_tool.auth_problem([f"--{flag}"]), flag
    assert set(lab_tool.ALIASES) <= set(aliases), "ALIASES names an alias this JupyterLab does not have"


def _cookie_session(base: str, token: str):
    """A browser's session: it opened the URL make lab printed (``/lab?token=...``), which logged it in (the
    login cookie) and gave it the ``_xsrf`` cookie; it sends no token of its own afterwards."""
    import http.cookiejar

    jar = http.cookiejar.CookieJar()
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    with opener.open(f"{base}/lab?token={token}", timeout=60) as resp:
        assert resp.status == 200
    cookies = {c.name: c.value for c in jar}
    assert "_xsrf" in cookies and any(n.startswith("username-") for n in cookies), sorted(cookies)

    def post(path: str, body: dict, xsrf: bool) -> int:
        headers = {"Content-Type": "application/json", **({"X-XSRFToken": cookies["_xsrf"]} if xsrf else {})}
        req = urllib.request.Request(base + path, method="POST", data=json.dumps(body).encode(), headers=headers)
        try:
            with opener.open(req, timeout=60) as resp:
                return resp.status
        except urllib.error.HTTPError as exc:
            return exc.code

    return post


@pytest.mark.slow
def test_a_logged_in_browser_cannot_change_a_file_without_the_xsrf_token(lab):
    """Planted: a POST that creates a file (what a page on another site could make the learner's browser send),
    carrying the login cookie only. `make lab`'s JupyterLab refuses it (403); the same POST with the XSRF token
    (what JupyterLab's own page sends) creates the file."""
    post = _cookie_session(lab.base, lab.token)
    before = {p.name for p in lab.work.iterdir()}
    assert post("/api/contents", {"type": "file", "ext": ".txt"}, xsrf=False) == 403
    assert {p.name for p in lab.work.iterdir()} == before, "a POST without the XSRF token made a file"
    assert "'_xsrf' argument missing from POST" in lab.log_tail()
    assert post("/api/contents", {"type": "file", "ext": ".txt"}, xsrf=True) == 201
    assert len({p.name for p in lab.work.iterdir()} - before) == 1


@contextlib.contextmanager
def _server_with(extra: list[str], tmp_path: Path):
    """JupyterLab started the way tools/lab.py execs it (its command, environment and token, headless on a free
    port of 127.0.0.1, the copy in a folder under tmp_path) with ``extra`` among its arguments, which lab.py
    itself would refuse: what that argument does. Yields (base URL, token, log); ends every process of it."""
    pytest.importorskip("jupyterlab", reason="JupyterLab is not installed (make setup installs it)")
    port, token = _free_port(), secrets.token_hex(24)
    runtime, work, log = tmp_path / "runtime", tmp_path / "work", tmp_path / "lab.log"
    work.mkdir()
    cmd = lab_tool.command(sys.executable, "127.0.0.1", port, os.geteuid() == 0, ["--no-browser", *extra], str(work))
    env = lab_tool.lab_env(dict(os.environ, JUPYTER_RUNTIME_DIR=str(runtime), PYTHONUNBUFFERED="1"), token)
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd[:-1], cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_until_up(proc, lambda: _answers(f"{base}/api/status"), lambda: log.read_text()[-3000:],
                       f"jupyter lab {extra}")
        yield base, token, log
    finally:
        _end_server(proc, runtime)


@pytest.mark.slow
@pytest.mark.parametrize("planted", ["--ServerApp.tornado_settings=disable_check_xsrf=True",
                                     "--JupyterApp.config_file_name=x"])
def test_what_make_lab_refuses_really_opens_jupyterlab(planted, tmp_path, monkeypatch, capsys):
    """Planted, one at a time, in the command tools/lab.py execs (past its refusal): the tornado_settings spelling
    of the XSRF switch turns the check off (the cookie-only POST that `make lab`'s server refuses creates a
    file), and another config file name skips tools/lab_config (the token make lab printed no longer logs in).
    make lab refuses both, naming the argument."""
    with _server_with([planted], tmp_path) as (base, token, log):
        if "xsrf" in planted:
            post = _cookie_session(base, token)
            assert post("/api/contents", {"type": "file", "ext": ".txt"}, xsrf=False) == 201
        else:
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=30)
            assert refused.value.code == 403
    monkeypatch.setattr(lab_tool.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(lab_tool.os, "execve", lambda *a: pytest.fail(f"exec'd {a[1]}"))
    assert lab_tool.main(["--dry-run", f"--lab-args={planted}"]) == 2
    assert capsys.readouterr().err.startswith(f"make lab: refusing {planted!r}: ")
