"""The nbval sanitizer masks machine-dependent lines, and nothing else."""
import re
from pathlib import Path

CFG = Path(__file__).with_name("nbval_sanitize.cfg")


def sanitize(text: str) -> str:
    """Apply the config the way nbval does (regex/replace pairs, re.sub, in order)."""
    pairs = re.findall(r"^regex: (.*)$\n^replace: (.*)$", CFG.read_text(), flags=re.M)
    assert pairs, "no regex/replace pairs found"
    for regex, replace in pairs:
        text = re.sub(regex, replace, text)
    return text


def test_values_of_measured_and_timing_lines_are_masked():
    a = "[measured] source: measured now on NVIDIA H200\nfact: True\n[timing] copy: 4.0 µs\n"
    b = "[measured] source: recorded on NVIDIA H200, 2026-11-30\nfact: True\n[timing] copy: 9.1 µs\n"
    assert sanitize(a) == sanitize(b)


def test_a_live_run_may_print_more_machine_dependent_lines_than_a_replay():
    live = "[measured] source: measured now\n[measured] this run's trace: build/x.json\nthe fact: True\n"
    replay = "[measured] source: recorded on H200\nthe fact: True\n"
    assert sanitize(live) == sanitize(replay)


def test_facts_are_still_compared():
    assert sanitize("[measured] x: 1\nthe fact: True\n") != sanitize("[measured] x: 1\nthe fact: False\n")
    assert sanitize("corrupted steps: 0\n") != sanitize("corrupted steps: 1\n")
    assert sanitize("a\n[timing] t: 1 ms\nb\n") != sanitize("a\nb\n")  # a masked block is still a line


def test_last_line_without_newline():
    assert sanitize("fact: True\n[measured] x: 3") == sanitize("fact: True\n[measured] x: 4\n[timing] y: 5")
