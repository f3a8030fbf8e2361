#!/usr/bin/env python3
"""`make lab`: JupyterLab on the course, explicit about who runs it and who can reach it.

    make lab                                  # http://localhost:8888, as you
    make lab LAB_PORT=8890                    # another port
    make lab LAB_IP=0.0.0.0 LAB_ARGS=--no-browser   # reachable from the network: read the warning it prints
    make lab ALLOW_ROOT=1                     # as root, only when asked (a container where you are root)
    make lab LAB_ARGS="--no-browser --ServerApp.base_url=/x/"   # more JupyterLab arguments, split like a shell

JupyterLab opens the learner's own copy of the course, never the committed notebooks (they are the recorded
reference run: a save there would replace the GPU outputs and break ``make test``). On first use it copies
``notebooks/``, ``exercises/`` and ``solutions/`` (their ``.ipynb`` files) into ``work/`` (git-ignored;
``--work``, ``make lab LAB_WORK=...``, names another folder), and later copies only what is missing there: a
notebook you changed is never overwritten. To start one over, delete it from ``work/`` and run ``make lab`` again;
to start everything over, delete ``work/``. ``work/jupytext.toml`` pairs nothing, so saving a copy writes that
copy only (``jupytext.toml`` at the top pairs the committed notebooks with their ``src/``, for authors).

Before it starts JupyterLab (``jupyter lab --ServerApp.root_dir=work work/notebooks/00_start_here.ipynb``) it

* refuses to run as root unless ``--allow-root`` (``ALLOW_ROOT=1``) is given: every kernel, and every
  terminal JupyterLab opens, would be a root shell;
* takes the token from ``JUPYTER_TOKEN`` or makes a random one, and hands it to JupyterLab through the
  environment (not the command line, which other users of the machine can read in ``ps``): in
  ``PINLAB_LAB_TOKEN``, which ``tools/lab_config/jupyter_server_config.py`` (first on ``JUPYTER_CONFIG_PATH``)
  takes out of the server's environment, so that kernels and terminals, which copy it, never hold the token;
* refuses what would turn authentication off or around (``auth_problem``, which reads the arguments as
  traitlets does: any class name, ``=`` or the next word, aliases): an empty ``JUPYTER_TOKEN``, a token or an
  empty password among the JupyterLab arguments in any spelling (``--IdentityProvider.token=``,
  ``--ServerApp.token ""``, ``-NotebookApp.token=''``...), the XSRF check turned off (``disable_check_xsrf``,
  or ``xsrf`` in the web application's settings: ``--ServerApp.tornado_settings=disable_check_xsrf=True``) and
  another config file (``--config``, ``--JupyterApp.config_file_name=...``);
* takes more JupyterLab arguments as one string (``--lab-args``, which ``make lab`` gives ``LAB_ARGS`` quoted,
  so that nothing in it reaches the shell) split like a shell's words (``shlex``), or after ``--``;
* prints the URL with the token, and, when the address is not a loopback one, a warning: JupyterLab serves
  plain HTTP, so anyone on the network who has the URL (or sees it pass) gets a shell on this machine;
* checks that the port is free (``port_retries=0``: the URL it printed is the one JupyterLab serves).

``--dry-run`` prints what it would do and the command, and starts nothing.
"""
from __future__ import annotations

import argparse
import ast
import ipaddress
import os
import re
import secrets
import shlex
import shutil
import socket
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIRST_NOTEBOOK = "notebooks/00_start_here.ipynb"
#: the learner's copy of the course (git-ignored), made from these folders of the repository
WORK = "work"
WORK_FOLDERS = ("notebooks", "exercises", "solutions")
#: written into the work copy: Jupytext pairs nothing there, so a save writes the copy only
WORK_JUPYTEXT = ("# Your copies of the course's notebooks, made by `make lab` (tools/lab.py). Nothing here is paired with a\n"
                 "# source: saving a notebook changes this copy only. To start a notebook over, delete it and run\n"
                 "# `make lab` again (it copies what is missing and never overwrites a copy).\n")
LOOPBACK_NAMES = {"localhost", "ip6-localhost", "ip6-loopback"}
#: the config folder put first on JUPYTER_CONFIG_PATH: it moves the token out of the server's environment
LAB_CONFIG = ROOT / "tools" / "lab_config"
#: the variable that carries the token to that config (JUPYTER_TOKEN would stay in every kernel's environment)
TOKEN_VAR = "PINLAB_LAB_TOKEN"
#: an option as traitlets reads it: one or two dashes, then ``Class.trait`` (any class, nested ``A.B.trait`` too)
#: or an alias or flag (``config``, ``no-browser``); its value after ``=`` or in the next word. Wider than
#: traitlets' own pattern (``-`` inside a name is taken too): whatever it passes over, traitlets refuses.
_OPTION = re.compile(r"^--?([A-Za-z][\w-]*(?:\.[\w-]+)*)(?:=(.*))?$", re.S)
#: a word argparse takes as a value, not an option, although it starts with "-": a negative number
_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")
#: JupyterLab's aliases (jupyter_core, jupyter_server, jupyterlab) that set a trait refused here, as traitlets
#: expands them (``--config=x`` is ``--JupyterApp.config_file=x``); tests/test_lab.py checks this table against
#: the aliases and flags of the JupyterLab installed
ALIASES = {"config": "JupyterApp.config_file"}
#: traits that choose which config files the server reads: any of them would skip tools/lab_config
CONFIG_TRAITS = frozenset({"config_file", "config_file_name", "config_dir"})
_BOOL_FALSE = ("false", "0")


def is_loopback(ip: str) -> bool:
    """True for an address only this machine can reach (localhost, 127.0.0.0/8, ::1)."""
    if ip.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(ip.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to an outside interface
        return False


def url(ip: str, port: int, token: str) -> str:
    host = ip
    if ip in ("", "0.0.0.0", "::", "*"):
        host = socket.gethostname()
    elif ":" in ip and not ip.startswith("["):
        host = f"[{ip}]"
    return f"http://{host}:{port}/lab?token={token}"


def network_warning(ip: str, port: int) -> str:
    user = os.environ.get("USER") or os.environ.get("LOGNAME") or f"uid {os.geteuid()}"
    return (f"WARNING: JupyterLab will listen on {ip or 'every interface'}:{port} over plain HTTP (no TLS). Anyone "
            f"who can reach this machine and has the URL above, token included (read off the network, a shared "
            f"screen or a shell history), gets a shell on it as {user}. On a shared network prefer "
            f"`make lab` on localhost and an SSH tunnel: ssh -L {port}:localhost:{port} <this host>.")


def port_problem(ip: str, port: int) -> str | None:
    """None when ``ip:port`` can be bound now, else why not."""
    host = "" if ip in ("0.0.0.0", "*") else ip
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    if host in LOOPBACK_NAMES:
        host = "127.0.0.1"
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host.strip("[]"), port))
    except OSError as exc:
        return f"{ip}:{port} cannot be used ({exc.strerror or exc}): choose another, e.g. make lab LAB_PORT={port + 1}"
    return None


def _trait_value(text: str) -> str:
    """A trait's value as traitlets reads a Unicode from the command line: one pair of matching quotes around
    it is dropped (``--ServerApp.token=''`` is the empty token), then surrounding spaces (for this check)."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        text = text[1:-1]
    return text.strip()


def _norm(name: str) -> str:
    """A trait or alias name compared with the refused ones: any case, ``-`` as ``_`` (conservative: traitlets
    itself knows only the exact spelling, so this refuses more spellings than it honours, never fewer)."""
    return name.replace("-", "_").casefold()


def _mentions_xsrf(value: str) -> bool:
    """Whether a value names the XSRF protection: as written, or once traitlets has read it as a Python literal
    (``{'disable_check_\\x78srf': True}`` is ``{'disable_check_xsrf': True}`` to a dict trait)."""
    if "xsrf" in value.casefold():
        return True
    try:
        parsed = ast.literal_eval(value.strip())
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return False
    stack = [parsed]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend(item)
        elif isinstance(item, (str, bytes)):
            text = item.decode("latin-1") if isinstance(item, bytes) else item
            if "xsrf" in text.casefold():
                return True
    return False


def _takes_value(word: str) -> bool:
    """Whether argparse (traitlets' parser) gives ``word`` to the option before it as its value: not an option
    itself (a word starting with "-", but for "-" alone and a negative number)."""
    return not word.startswith("-") or word == "-" or bool(_NEGATIVE_NUMBER.match(word))


def _config_message(shown: str) -> str:
    return (f"refusing {shown!r}: it makes JupyterLab read another config file than the course's, and make lab "
            "hands JupyterLab its token through its own config folder (tools/lab_config), which that would skip; "
            "leave it out, and put your own settings in ~/.jupyter/jupyter_server_config.py instead")


def _xsrf_message(shown: str) -> str:
    return (f"refusing {shown!r}: it turns JupyterLab's XSRF check off, and then any web page this browser visits "
            "can run code in JupyterLab through its logged-in session; leave it out (nothing in the course needs it)")


def auth_problem(extra: list[str]) -> str | None:
    """Why the JupyterLab arguments ``extra`` would turn its authentication off or around, or None.

    The words are read the way traitlets reads them (``KVArgParseConfigLoader``): ``--Class.trait=value``,
    ``--Class.trait value`` and ``-Class.trait=value`` alike, for any class name and any nesting
    (``--ServerApp.IdentityProvider.token``: the trait is the last name), aliases expanded (:data:`ALIASES`:
    ``--config`` is ``--JupyterApp.config_file``), and nothing after ``--`` (traitlets passes that on as file
    names). Trait names are compared in any case and with ``-`` as ``_``, and an abbreviation of a refused alias
    is refused too (traitlets would read ``--conf`` as an unknown alias; another parser might not). Refused:

    * every ``.token`` (an empty one turns authentication off; any other would make the URL printed here a
      wrong one: give it in JUPYTER_TOKEN), an empty ``.password``/``.hashed_password``;
    * the XSRF check turned off (any web page the browser visits could run code through its logged-in session):
      ``disable_check_xsrf`` set to anything but false, and any other value that names ``xsrf``, as written or
      read as a Python literal: the web application's settings (``--ServerApp.tornado_settings=
      disable_check_xsrf=True``, ``--NotebookApp.tornado_settings={'xsrf_cookies': False}``, an extension's
      ``--LabApp.settings ...``) would override it;
    * another config file (:data:`CONFIG_TRAITS`, ``--config``): JupyterLab would skip the config that hands
      it the token."""
    i = 0
    while i < len(extra):
        arg = extra[i]
        if arg == "--":
            break
        m = _OPTION.match(arg)
        i += 1
        if not m:
            continue
        name, inline = m.group(1), m.group(2)
        if inline is not None:
            value, shown = inline, arg
        elif i < len(extra) and extra[i] != "--" and _takes_value(extra[i]):  # the value is the next word
            value, shown = extra[i], f"{arg} {shlex.quote(extra[i])}"
            i += 1
        else:
            value, shown = "", arg
        if "." not in name:  # an alias or a flag, or an abbreviation of one
            refused = [alias for alias in ALIASES if _norm(alias) == _norm(name)
                       or (len(name) >= 2 and _norm(alias).startswith(_norm(name)))]
            if not refused:
                if "xsrf" in _norm(name):  # no such flag today; tests/test_lab.py checks the installed ones
                    return _xsrf_message(shown)
                continue
            name = ALIASES[refused[0]]
        trait = _norm(name.rsplit(".", 1)[1])
        value = _trait_value(value)
        if trait == "token":
            if not value:
                return (f"refusing {shown!r}: an empty token turns authentication off (anyone who can reach the "
                        "port gets a shell); leave it out: make lab makes a random token, or set JUPYTER_TOKEN")
            return (f"refusing {shown!r}: give the token in JUPYTER_TOKEN instead (JUPYTER_TOKEN=... make lab): "
                    "the command line is readable by every user of this machine (ps), and the URL make lab "
                    "prints carries JUPYTER_TOKEN's")
        if trait in ("password", "hashed_password") and not value:
            return (f"refusing {shown!r}: an empty password turns authentication off where there is no token; "
                    "make lab authenticates with its token (JUPYTER_TOKEN, or a random one): leave it out")
        if trait in CONFIG_TRAITS:
            return _config_message(shown)
        if "xsrf" in trait:
            if value.casefold() not in _BOOL_FALSE:
                return _xsrf_message(shown)
        elif _mentions_xsrf(value):
            return _xsrf_message(shown)
    return None


def work_problem(work: Path, root: Path = ROOT, shown: str | None = None) -> str | None:
    """Why ``work`` cannot hold the learner's copies (None when it can): it must not be the repository, a folder
    holding it, or a folder of the repository other than ``work/`` or one under ``build/`` (both git-ignored),
    so that nothing a learner saves lands in a tracked file; and it must be a folder, if it exists."""
    real, root_real = Path(os.path.abspath(work)).resolve(), Path(root).resolve()
    work = shown or work  # as the learner wrote it
    if real == root_real or real in root_real.parents:
        return f"--work {work}: that is the repository or a folder holding it; give a folder of its own, e.g. work"
    if root_real in real.parents and not any(real == root_real / ok or root_real / ok in real.parents
                                             for ok in (WORK, "build")):
        return (f"--work {work}: a folder of the repository outside work/ and build/ could hold tracked files; "
                "use work (the default) or a folder outside the repository")
    if real.exists() and not real.is_dir():
        return f"--work {work} exists and is not a folder: move it away, or give another folder"
    return None


def make_work_copy(work: Path, root: Path = ROOT) -> tuple[list[str], int]:
    """Copy the course's notebooks into ``work`` (same folders) where a copy is missing; never overwrite one.
    Returns (the paths copied now, relative to ``work``; how many copies were there already)."""
    made, kept = [], 0
    work = Path(work)
    for folder in WORK_FOLDERS:
        for nb in sorted((Path(root) / folder).glob("*.ipynb")):
            dest = work / folder / nb.name
            if dest.exists() or dest.is_symlink():
                kept += 1
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(nb, dest)
            made.append(f"{folder}/{nb.name}")
    cfg = work / "jupytext.toml"
    if not cfg.exists():
        cfg.write_text(WORK_JUPYTEXT, encoding="utf-8")
    return made, kept


def work_message(work: str, made: list[str], kept: int) -> str:
    """What `make lab` says about the learner's copy: where it is, what it did now, how to start over."""
    where = work.rstrip("/") + "/"
    if made and not kept:
        did = f"made now ({len(made)} notebooks)"
    elif made:
        did = f"{len(made)} notebook(s) copied now ({', '.join(made[:3])}{', ...' if len(made) > 3 else ''}); " \
              f"your {kept} other copies kept as they are"
    else:
        did = f"your {kept} copies, kept as they are"
    return (f"Your copy of the course: {where} ({did}). JupyterLab shows it and saves there only; the course's own "
            f"notebooks stay as they are. To start a notebook over, delete it from {where} and run make lab again.")


def lab_env(environ, token: str) -> dict[str, str]:
    """The environment JupyterLab starts with: the token in :data:`TOKEN_VAR` (its config takes it out of the
    server's environment, so kernels and terminals never see it), no JUPYTER_TOKEN, :data:`LAB_CONFIG` first
    on JUPYTER_CONFIG_PATH."""
    env = {k: v for k, v in environ.items() if k != "JUPYTER_TOKEN"}
    env[TOKEN_VAR] = token
    env["JUPYTER_CONFIG_PATH"] = os.pathsep.join([str(LAB_CONFIG), *filter(None, [environ.get("JUPYTER_CONFIG_PATH")])])
    return env


def command(python: str, ip: str, port: int, allow_root: bool, extra: list[str], work: str = WORK) -> list[str]:
    cmd = [python, "-m", "jupyter", "lab", f"--ServerApp.root_dir={work}", f"--ServerApp.ip={ip}",
           f"--ServerApp.port={port}", "--ServerApp.port_retries=0"]
    if allow_root:
        cmd.append("--allow-root")
    return cmd + list(extra) + [os.path.join(work, FIRST_NOTEBOOK)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ip", default="localhost", help="address to listen on (make lab LAB_IP=...; default localhost)")
    ap.add_argument("--port", type=int, default=8888, help="port (make lab LAB_PORT=...; default 8888)")
    ap.add_argument("--allow-root", action="store_true", help="run even as root (make lab ALLOW_ROOT=1)")
    ap.add_argument("--python", default=sys.executable, help="the Python whose JupyterLab runs (the venv's)")
    ap.add_argument("--dry-run", action="store_true", help="print what would run, start nothing (copies nothing)")
    ap.add_argument("--work", default=WORK,
                    help="the folder of your copies, relative to the repository (make lab LAB_WORK=...; default work)")
    ap.add_argument("--lab-args", default="",
                    help="more JupyterLab arguments in one string, split like a shell's words (make lab LAB_ARGS=...)")
    ap.add_argument("extra", nargs="*", help="more JupyterLab arguments, after --")
    args = ap.parse_args(argv)
    try:
        extra = shlex.split(args.lab_args) + list(args.extra)
    except ValueError as exc:
        ap.error(f"LAB_ARGS (--lab-args) cannot be split into words ({exc}): {args.lab_args!r}; "
                 "quote as in a shell, e.g. LAB_ARGS=\"--ServerApp.base_url='/my lab/'\"")

    if not 0 < args.port < 65536:
        ap.error(f"--port must be between 1 and 65535, got {args.port}")
    if os.geteuid() == 0 and not args.allow_root:
        print("make lab: refusing to start JupyterLab as root: every notebook kernel and terminal would be a root "
              "shell. Run it as a normal user, or say so explicitly: make lab ALLOW_ROOT=1", file=sys.stderr)
        return 2
    problem = auth_problem(extra)
    if problem:
        print(f"make lab: {problem}", file=sys.stderr)
        return 2
    token = os.environ.get("JUPYTER_TOKEN")
    if token is not None and not token.strip():
        print("make lab: JUPYTER_TOKEN is set but empty, which turns authentication off: unset it "
              "(a random token is made) or give one", file=sys.stderr)
        return 2
    token = token or secrets.token_urlsafe(32)

    work = args.work if os.path.isabs(args.work) else os.path.normpath(args.work)
    problem = work_problem(ROOT / work, shown=args.work)
    if problem:
        print(f"make lab: {problem}", file=sys.stderr)
        return 2
    cmd = command(os.path.abspath(args.python), args.ip, args.port, args.allow_root, extra, work)
    print(f"JupyterLab on the course: {url(args.ip, args.port, token)}", flush=True)
    if os.geteuid() == 0:
        print("note: running as root (ALLOW_ROOT=1): kernels and terminals are root shells", flush=True)
    if not is_loopback(args.ip):
        print(network_warning(args.ip, args.port), file=sys.stderr, flush=True)
    if args.dry_run:
        print(f"would make or complete your copy of the course in {work}/; would run: " + shlex.join(cmd))
        return 0
    problem = port_problem(args.ip, args.port)
    if problem:
        print(f"make lab: {problem}", file=sys.stderr)
        return 2
    made, kept = make_work_copy(ROOT / work)
    print(work_message(work, made, kept), flush=True)
    env = lab_env(os.environ, token)
    os.chdir(ROOT)
    os.execve(cmd[0], cmd, env)  # JupyterLab replaces this process (Ctrl-C and signals reach it directly)
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
