"""tools/chain_slice.sh: between two chained device calls, the call's res.tgz becomes one evidence commit and the next
pending slice is applied, in one command (the machine stays warm 30 s after a reply). Tried on a scratch repository
with a stand-in gpu_suite.py."""
from __future__ import annotations

import os
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "chain_slice.sh"


def git(repo, *args):
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout


@pytest.fixture
def repo(tmp_path):
    r = tmp_path / "course"
    for rel, text in {"reports/gpu/latest.json": "{}\n", "notebooks/03.ipynb": "old\n", "notebooks/src/03.py": "a\n",
                      "tools/gpu_suite.py": "print('plan: 0 call(s), 0.0 device-minutes')\n"}.items():
        (r / rel).parent.mkdir(parents=True, exist_ok=True)
        (r / rel).write_text(text)
    git(r, "init", "-q", "-b", "main")
    git(r, "-c", "user.name=t", "-c", "user.email=t@t", "add", "-A")
    git(r, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "start")
    git(r, "config", "user.name", "t")
    git(r, "config", "user.email", "t@t")
    return r


def _res(tmp_path, files: dict) -> Path:
    out = tmp_path / "files_at"
    out.mkdir(exist_ok=True)
    src = tmp_path / "from_device"
    for rel, text in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(text)
    with tarfile.open(out / "res.tgz", "w:gz") as tar:
        for rel in files:
            tar.add(src / rel, arcname=rel)
    return out / "res.tgz"


def _slice(repo, tmp_path) -> Path:
    """A one-commit series that edits the notebook source, as a pending/*.mbox committed on main."""
    git(repo, "checkout", "-q", "-b", "slice")
    (repo / "notebooks" / "src" / "03.py").write_text("b\n")
    git(repo, "commit", "-qam", "Slice: 03")
    mbox = git(repo, "format-patch", "--stdout", "main..slice")
    git(repo, "checkout", "-q", "main")
    (repo / "pending").mkdir(exist_ok=True)
    (repo / "pending" / "s.mbox").write_text(mbox)
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "pending: s")
    return repo / "pending" / "s.mbox"


def run(repo, *args):
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], cwd=repo, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHON": "python3"})


def test_it_commits_the_evidence_applies_the_next_slice_and_prints_the_plan(repo, tmp_path):
    mbox = _slice(repo, tmp_path)
    res = _res(tmp_path, {"reports/gpu/latest.json": '{"new": 1}\n', "notebooks/03.ipynb": "executed\n"})
    r = run(repo, res, "pending/s.mbox")
    assert r.returncode == 0, r.stderr
    log = git(repo, "log", "--format=%s").splitlines()
    assert log[:3] == ["pending: s.mbox applied", "Slice: 03", "GPU evidence from files_at/res.tgz"], log
    assert (repo / "reports" / "gpu" / "latest.json").read_text() == '{"new": 1}\n'
    assert (repo / "notebooks" / "src" / "03.py").read_text() == "b\n" and not mbox.exists()
    assert r.stdout.strip().endswith("plan: 0 call(s), 0.0 device-minutes")
    assert git(repo, "status", "--porcelain") == ""


def test_without_a_next_slice_it_commits_the_evidence_only(repo, tmp_path):
    r = run(repo, _res(tmp_path, {"notebooks/03.ipynb": "executed\n"}))
    assert r.returncode == 0, r.stderr
    assert git(repo, "log", "-1", "--format=%s").strip() == "GPU evidence from files_at/res.tgz"


def test_it_refuses_uncommitted_changes_a_missing_file_and_a_slice_that_does_not_apply(repo, tmp_path):
    res = _res(tmp_path, {"notebooks/03.ipynb": "executed\n"})
    (repo / "notebooks" / "src" / "03.py").write_text("dirty\n")
    r = run(repo, res)
    assert r.returncode == 2 and "uncommitted changes" in r.stderr
    git(repo, "checkout", "--", ".")
    assert run(repo, tmp_path / "nope.tgz").returncode == 2
    r = run(repo, res, "pending/none.mbox")
    assert r.returncode == 2 and "no slice pending/none.mbox" in r.stderr
    mbox = _slice(repo, tmp_path)
    (repo / "notebooks" / "src" / "03.py").write_text("conflict\n")
    git(repo, "commit", "-qam", "a conflicting change")
    r = run(repo, res, mbox)
    assert r.returncode == 1 and "does not apply" in r.stderr
    assert git(repo, "log", "-1", "--format=%s").strip() == "GPU evidence from files_at/res.tgz"
    assert mbox.exists() and not (repo / ".git" / "rebase-apply").exists()
    assert run(repo).returncode == 2
