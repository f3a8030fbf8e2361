"""The CUDA tests of exercise 09's checker, run by tests/test_checks_l09.py in a process of their own
(``test_gpu_the_checker_gives_the_cpus_verdicts_on_cuda_in_a_process_of_its_own``): the checker judges races by
order, which turns on torch's GPU trace for good (docs/facts.md F22). Not collected on its own (the name does not
start with ``test_``); run it by path: ``python -m pytest tests/cuda_checks09_child.py``.

What they check on a GPU: the master solution passes on the CUDA stream, and each planted wrong answer of
tests/test_checks_l09.py (the racy ones included, whose race this GPU's timing may hide) is rejected with the
first of its words, as on the emulated stream (issue 48: the same verdict on a GPU as on a laptop).
"""
import pytest
import torch

import test_checks_l09 as t
from nbtools import solution_namespace
from pinlab.checks import l09 as checks09

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def sol():
    return solution_namespace(t.STEM)


@pytest.fixture(autouse=True)
def _fresh():
    checks09.reset()


@cuda
def test_gpu_the_solution_passes_on_the_cuda_stream(sol, capsys):
    assert checks09.check_decode.verdict(sol["fixed_decode"]) is True
    out = capsys.readouterr().out
    assert "✅ fixed_decode is correct" in out and "emulated" not in out, out


@cuda
@pytest.mark.parametrize("name", sorted(t.WRONG))
def test_gpu_a_planted_wrong_answer_is_rejected_as_on_the_cpu(sol, capsys, name):
    edits, words = t.WRONG[name]
    capsys.readouterr()
    assert checks09.check_decode.verdict(t._variant(sol, name, *edits)) is False
    out = capsys.readouterr().out
    assert words[0] in out, f"{name}: {words[0]!r} not in {out!r}"
