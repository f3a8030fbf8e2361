"""pinlab.lead.claim (issue 45, adverse (f)): a claim that needs the host ahead of the GPU asserts where the host
can lead and only observes under CUDA_LAUNCH_BLOCKING=1, where no race, stale read or pending copy can show.
Every line it prints is a [measured] line, so that strict nbval compares a run with the variable set against the
recorded quiet run (the sanitizer masks both) and the claim still fails a run without it."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
from test_claims import _gpu_facts

import pinlab
from pinlab import lead, probe

ROOT = Path(__file__).resolve().parents[1]
WHY = "the race needs the GPU behind the host; a host slower than the GPU lets it keep up"


@pytest.fixture
def blocking(monkeypatch):
    """A CUDA GPU with CUDA_LAUNCH_BLOCKING=1 set (or not: ``blocking(False)``)."""
    monkeypatch.setattr(probe, "platform_facts", lambda: _gpu_facts())

    def set_(on: bool = True):
        monkeypatch.setattr(probe, "has_cuda", lambda: True)
        monkeypatch.setenv("CUDA_LAUNCH_BLOCKING", "1" if on else "0")

    return set_


def test_an_effect_that_showed_prints_a_measured_line_and_passes(capsys):
    lead.claim("the race showed", True, value="37 of 200", why=WHY)
    assert capsys.readouterr().out.strip() == "[measured] the race showed: yes (37 of 200)"


def test_an_effect_that_did_not_show_fails_naming_the_claim_the_value_and_the_reason(capsys):
    with pytest.raises(pinlab.ClaimError) as err:
        lead.claim("the race showed", False, value="0 of 200", why=WHY)
    msg = str(err.value)
    assert msg.startswith("Claim did not hold in this run: the race showed.")
    assert "This run's value: 0 of 200." in msg and "a host slower than the GPU" in msg
    assert "not in this run (0 of 200)" in capsys.readouterr().out


def test_on_a_gpu_without_the_variable_it_fails_as_a_claim_does(blocking):
    blocking(False)
    with pytest.raises(pinlab.ClaimError, match="Why it may not hold here: the race needs"):
        lead.claim("the race showed", False, value=0, why=WHY)


def test_under_cuda_launch_blocking_it_observes_and_names_the_variable_not_the_cpu(blocking, capsys):
    blocking(True)
    lead.claim("the race showed", False, value="0 of 200", why=WHY)
    out = capsys.readouterr().out
    assert out.startswith("[measured] the race showed: not in this run (0 of 200); CUDA_LAUNCH_BLOCKING=1 is set")
    assert "a host slower" not in out
    lead.claim("the race showed", True, value="3 of 200", why=WHY)
    assert capsys.readouterr().out.strip() == "[measured] the race showed: yes (3 of 200)"


def test_its_lines_are_masked_as_the_quiet_run_s_are(blocking, capsys):
    """What strict nbval compares under (f): the sanitized output of the recorded run (the effect shown) and of a
    run under CUDA_LAUNCH_BLOCKING=1 (not shown) are the same."""
    import configparser
    import re

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "tests" / "nbval_sanitize.cfg", encoding="utf-8")
    sec = cfg["pinlab-machine-dependent-lines"]

    def sanitized(text):
        return re.sub(sec["regex"], sec["replace"].replace("\\n", "\n"), text)

    lead.claim("the race showed", True, value="37 of 200", why=WHY)
    quiet = capsys.readouterr().out
    blocking(True)
    lead.claim("the race showed", False, value="0 of 200", why=WHY)
    blocked = capsys.readouterr().out
    assert quiet != blocked and sanitized(quiet) == sanitized(blocked)


@pytest.mark.parametrize("args, error, match", [
    (("", True), TypeError, "text must be a non-empty str"),
    (("x", 1), TypeError, "holds must be a bool"),
    (("x", None), TypeError, "holds must be a bool"),
    (("x", float("nan")), TypeError, "holds must be a bool"),
])
def test_bad_input_is_refused_by_name(args, error, match):
    with pytest.raises(error, match=match):
        lead.claim(*args, why=WHY)


def test_a_reason_must_be_words():
    with pytest.raises(TypeError, match="why must be a non-empty str"):
        lead.claim("x", True, why=3)


def _lead_claims(path: Path) -> list:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func) == "lead.claim"]


def _sources():
    return sorted((ROOT / "notebooks" / "src").glob("*.py")) + sorted((ROOT / "solutions" / "src").glob("*.py"))


@pytest.mark.parametrize("src", _sources(), ids=lambda p: f"{p.parent.parent.name}/{p.stem}")
def test_every_lead_claim_gives_a_reason_and_asserts_no_exact_count(src):
    """A lead claim is a bool (an effect shown) with the lesson's reason; an exact count (0 corrupted steps, the
    order verdict's count) holds whatever the timing and stays a pinlab.claim. A lesson that (f) requires
    (evidence.EXTRA_CONDITIONS) makes its race claims lead claims: they are what failed under the variable."""
    import evidence

    found = _lead_claims(src)
    for node in found:
        kw = {k.arg for k in node.keywords}
        assert "why" in kw and "expect" not in kw, ast.unparse(node)[:120]
    notebook = f"notebooks/{src.stem}.ipynb"
    if src.parent.parent.name == "notebooks" and notebook in evidence.EXTRA_CONDITIONS["f"]["required_for"]:
        assert found, f"{notebook} must pass (f) and makes no lead.claim: its race claims fail under the variable"
