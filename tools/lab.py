#!/usr/bin/env python3
"""`make lab`: JupyterLab on the course, explicit about who runs it and who can reach it.

    make lab                                  # http://localhost:8888, as you
    make lab LAB_PORT=8890                    # another port
    make lab LAB_IP=0.0.0.0 LAB_ARGS=--no-browser   # reachable from the network: read the warning it prints
    make lab ALLOW_ROOT=1                     # as root, only when asked (a container where you are root)

Before it starts JupyterLab (``jupyter lab --ServerApp.root_dir=. notebooks/00_start_here.ipynb``) it

* refuses to run as root unless ``--allow-root`` (``ALLOW_ROOT=1``) is given: every kernel, and every
  terminal JupyterLab opens, would be a root shell;
* takes the token from ``JUPYTER_TOKEN`` or makes a random one, and hands it to JupyterLab through the
  environment (not the command line, which other users of the machine can read in ``ps``); an empty token
  (authentication off) is refused;
* prints the URL with the token, and, when the address is not a loopback one, a warning: JupyterLab serves
  plain HTTP, so anyone on the network who has the URL (or sees it pass) gets a shell on this machine;
* checks that the port is free (``port_retries=0``: the URL it printed is the one JupyterLab serves).

``--dry-run`` prints what it would do and the command, and starts nothing.
"""
from __future__ import annotations

import argparse
import ipaddress
import os
import secrets
import socket
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIRST_NOTEBOOK = "notebooks/00_start_here.ipynb"
LOOPBACK_NAMES = {"localhost", "ip6-localhost", "ip6-loopback"}


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


def command(python: str, ip: str, port: int, allow_root: bool, extra: list[str]) -> list[str]:
    cmd = [python, "-m", "jupyter", "lab", "--ServerApp.root_dir=.", f"--ServerApp.ip={ip}",
           f"--ServerApp.port={port}", "--ServerApp.port_retries=0"]
    if allow_root:
        cmd.append("--allow-root")
    return cmd + list(extra) + [FIRST_NOTEBOOK]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ip", default="localhost", help="address to listen on (make lab LAB_IP=...; default localhost)")
    ap.add_argument("--port", type=int, default=8888, help="port (make lab LAB_PORT=...; default 8888)")
    ap.add_argument("--allow-root", action="store_true", help="run even as root (make lab ALLOW_ROOT=1)")
    ap.add_argument("--python", default=sys.executable, help="the Python whose JupyterLab runs (the venv's)")
    ap.add_argument("--dry-run", action="store_true", help="print what would run, start nothing")
    ap.add_argument("extra", nargs="*", help="more JupyterLab arguments (make lab LAB_ARGS=...), after --")
    args = ap.parse_args(argv)

    if not 0 < args.port < 65536:
        ap.error(f"--port must be between 1 and 65535, got {args.port}")
    if os.geteuid() == 0 and not args.allow_root:
        print("make lab: refusing to start JupyterLab as root: every notebook kernel and terminal would be a root "
              "shell. Run it as a normal user, or say so explicitly: make lab ALLOW_ROOT=1", file=sys.stderr)
        return 2
    for a in args.extra:
        if a.split("=", 1)[0].lower().endswith(("token", ".password")) and a.endswith("="):
            print(f"make lab: refusing {a!r}: an empty token or password turns authentication off", file=sys.stderr)
            return 2
    token = os.environ.get("JUPYTER_TOKEN")
    if token is not None and not token.strip():
        print("make lab: JUPYTER_TOKEN is set but empty, which turns authentication off: unset it "
              "(a random token is made) or give one", file=sys.stderr)
        return 2
    token = token or secrets.token_urlsafe(32)

    cmd = command(os.path.abspath(args.python), args.ip, args.port, args.allow_root, args.extra)
    print(f"JupyterLab on the course: {url(args.ip, args.port, token)}", flush=True)
    if os.geteuid() == 0:
        print("note: running as root (ALLOW_ROOT=1): kernels and terminals are root shells", flush=True)
    if not is_loopback(args.ip):
        print(network_warning(args.ip, args.port), file=sys.stderr, flush=True)
    if args.dry_run:
        print("would run: " + " ".join(cmd))
        return 0
    problem = port_problem(args.ip, args.port)
    if problem:
        print(f"make lab: {problem}", file=sys.stderr)
        return 2
    env = dict(os.environ, JUPYTER_TOKEN=token)
    os.chdir(ROOT)
    os.execve(cmd[0], cmd, env)  # JupyterLab replaces this process (Ctrl-C and signals reach it directly)
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
