"""Lesson 05's exercise checkers accept the master solution and reject planted wrong answers,
each with the message that names what is wrong (run on the emulated lagging stream without a GPU)."""
import json

import pytest
import torch

from nbtools import solution_namespace
from pinlab.checks import l05 as checks05

STEM = "05_pinned_weight_restore"


@pytest.fixture(scope="module")
def sol():
    return solution_namespace(STEM)


@pytest.fixture(autouse=True)
def _fresh(monkeypatch, tmp_path):
    checks05.reset()
    monkeypatch.setenv("PINLAB_DATA_DIR", str(tmp_path))  # no recorded run unless a test writes one


# ---- restore_weight ----------------------------------------------------------------------------

def test_restore_weight_accepts_solution(sol, capsys):
    assert checks05.check_restore_weight.verdict(sol["restore_weight"]) is True
    assert "✅ restore_weight is correct" in capsys.readouterr().out


def test_restore_weight_says_not_implemented(capsys):
    def stub(w, pin=True):
        raise NotImplementedError

    assert checks05.check_restore_weight.verdict(stub) is False
    assert "⏳ restore_weight is not implemented yet" in capsys.readouterr().out


WRONG_RESTORES = {
    "pageable": (lambda w, pin=True: w.to("cpu"), "this returns pageable memory"),
    "cpu-pageable": (lambda w, pin=True: w.cpu(), "this returns pageable memory"),
    "to-cpu-then-pin": (lambda w, pin=True: w.to("cpu").pin_memory(), "two copies"),
    "pinned-from-a-pageable-copy": (
        lambda w, pin=True: torch.empty_like(w, device="cpu", pin_memory=pin).copy_(w.cpu()), "two copies"),
    "non-blocking-d2h": (lambda w, pin=True: w.to("cpu", non_blocking=True), "the data is not there yet"),
    "clone-on-gpu": (lambda w, pin=True: w.clone(), "still on the GPU"),
    "the-weight-itself": (lambda w, pin=True: w, "still on the GPU"),
    "ignores-the-switch": (
        lambda w, pin=True: torch.empty_like(w, device="cpu", pin_memory=True).copy_(w), "pin=False (the switch"),
    "converts-dtype": (
        lambda w, pin=True: torch.empty(w.shape, dtype=torch.float32, pin_memory=pin).copy_(w), "must not change"),
    "returns-a-list": (lambda w, pin=True: [w.to("cpu")], "not a tensor"),
    # issue "self-paced path", part 3: diagnoses that named the wrong cause
    "no-copy": (lambda w, pin=True: torch.empty_like(w, device="cpu", pin_memory=pin), "made no copy of the data"),
    # pageable where pinned was asked: on the emulated stream device="cpu" memory counts as the GPU's
    "empty-like-cpu-unpinned": (lambda w, pin=True: torch.empty_like(w, device="cpu").copy_(w), "pin_memory=True"),
    # issue 28: pinned memory asked for on the GPU (a *_like keeps w's device): CUDA refuses it, the
    # emulated stream handed out pinned host memory and the checker said ✅
    "pinned-empty-like-on-the-gpu": (lambda w, pin=True: torch.empty_like(w, pin_memory=pin).copy_(w),
                                     "asked for pinned memory on the GPU"),
    "pinned-new-empty-on-the-gpu": (lambda w, pin=True: w.new_empty(w.shape, pin_memory=pin).copy_(w),
                                    "asked for pinned memory on the GPU"),
    "pinned-zeros-on-the-weights-device": (
        lambda w, pin=True: torch.zeros(w.shape, dtype=w.dtype, device=w.device, pin_memory=pin).copy_(w),
        "asked for pinned memory on the GPU"),
    # pageable host memory named with a torch.device: host memory, as on a GPU (not "still on the GPU")
    "empty-like-cpu-device-object-unpinned": (
        lambda w, pin=True: torch.empty_like(w, device=torch.device("cpu")).copy_(w), "this returns pageable memory"),
}

#: the cause each planted answer was given before, wrongly
WRONG_CAUSES = {
    "no-copy": "non_blocking",
    "empty-like-cpu-unpinned": "returned a tensor that is still on the GPU",
    "pinned-empty-like-on-the-gpu": "raised",
    "empty-like-cpu-device-object-unpinned": "still on the GPU",
}


@pytest.mark.parametrize("case", list(WRONG_RESTORES))
def test_restore_weight_rejects_wrong(case, capsys):
    wrong, message = WRONG_RESTORES[case]
    assert checks05.check_restore_weight.verdict(wrong) is False
    out = capsys.readouterr().out
    assert "❌" in out and message in out, out
    assert "💡 Hint" not in out  # the hint comes from the second failure on
    if case in WRONG_CAUSES:
        assert WRONG_CAUSES[case] not in out, out


def test_restore_weight_pin_on_gpu_names_what_to_do(capsys):
    wrong = WRONG_RESTORES["pinned-empty-like-on-the-gpu"][0]
    assert checks05.check_restore_weight.verdict(wrong) is False
    out = capsys.readouterr().out
    assert "Only dense CPU tensors can be pinned" in out and 'device="cpu", pin_memory=pin' in out, out


def test_restore_weight_cudas_pin_on_gpu_error_gets_the_same_diagnosis(capsys):
    """On a GPU torch itself raises the error (aten/src/ATen/cuda/EmptyTensor.cpp, empty_cuda): the same
    diagnosis as the emulated stream's refusal."""
    def refused(w, pin=True):
        raise RuntimeError("Only dense CPU tensors can be pinned")

    assert checks05.check_restore_weight.verdict(refused) is False
    assert "asked for pinned memory on the GPU" in capsys.readouterr().out


def _non_blocking_then_synchronize(w, pin=True):
    """The checker's own advice for a non_blocking copy: synchronize before returning."""
    out = torch.empty_like(w, device="cpu", pin_memory=pin)
    out.copy_(w, non_blocking=True)
    torch.cuda.synchronize()
    return out


def _pinned_zeros_on_the_host(w, pin=True):
    return torch.zeros(w.shape, dtype=w.dtype, device="cpu", pin_memory=pin).copy_(w)


@pytest.mark.parametrize("right", [_non_blocking_then_synchronize, _pinned_zeros_on_the_host],
                         ids=["non-blocking-then-synchronize", "pinned-zeros-on-the-host"])
def test_restore_weight_accepts_near_boundary_answers(right, capsys):
    assert checks05.check_restore_weight.verdict(right) is True, capsys.readouterr().out


def test_restore_weight_leaves_torch_cuda_synchronize_as_it_was():
    before = torch.cuda.synchronize
    checks05.check_restore_weight.verdict(_non_blocking_then_synchronize)
    assert torch.cuda.synchronize is before


def test_restore_weight_hints_on_the_second_failure(capsys):
    wrong = WRONG_RESTORES["to-cpu-then-pin"][0]
    assert checks05.check_restore_weight.verdict(wrong) is False
    assert checks05.check_restore_weight.verdict(wrong) is False
    out = capsys.readouterr().out
    assert out.count("❌") == 2 and out.count("💡 Hint") == 1
    assert "empty_like" in out.split("💡 Hint")[1]


def test_restore_weight_reports_an_exception(capsys):
    def broken(w, pin=True):
        raise ValueError("boom")

    assert checks05.check_restore_weight.verdict(broken) is False
    assert "raised ValueError: boom" in capsys.readouterr().out


# ---- pinned_footprint --------------------------------------------------------------------------

def test_pinned_footprint_accepts_solution(sol, capsys):
    assert checks05.check_pinned_footprint.verdict(sol["pinned_footprint"]) is True
    out = capsys.readouterr().out
    assert "✅ pinned_footprint is correct" in out and "No recorded GPU run yet" in out


@pytest.mark.parametrize("wrong, message", [
    (lambda sizes: sum(sizes), "that is the bytes requested"),
    (lambda sizes: 1 << (sum(sizes) - 1).bit_length() if sum(sizes) else 0, "expected"),
    (lambda sizes: sum(1 << (n - 1).bit_length() for n in sizes), "expected"),          # 0 bytes pins 2
    (lambda sizes: sum(1 << n.bit_length() for n in sizes if n), "expected"),           # doubles powers of two
    (lambda sizes: float(sum(1 << (n - 1).bit_length() for n in sizes if n)), "an int"),
], ids=["requested", "rounds-the-sum", "zero-pins", "doubles-powers-of-two", "float"])
def test_pinned_footprint_rejects_wrong(wrong, message, capsys):
    assert checks05.check_pinned_footprint.verdict(wrong) is False
    out = capsys.readouterr().out
    assert "❌ pinned_footprint" in out and message in out, out


def _record(tmp_path, took):
    w = 4096 * 11008 * 2
    data = {"meta": {"gpu": "NVIDIA H200", "date": "2026-11-30"}, "params": {},
            "result": {"param_bytes": [w] * 4, "methods": {"empty_pinned_copy": {"pinned_bytes_delta": took}}}}
    (tmp_path / "05_restore.json").write_text(json.dumps(data))


def test_pinned_footprint_is_applied_to_the_recorded_run(sol, tmp_path, capsys):
    _record(tmp_path, 4 * 128 * 2**20)
    assert checks05.check_pinned_footprint.verdict(sol["pinned_footprint"]) is True
    out = capsys.readouterr().out
    assert "applied to the recorded GPU run" in out and "[measured] recorded run: NVIDIA H200" in out


def test_pinned_footprint_disagreeing_with_the_recorded_run_is_reported(sol, tmp_path, capsys):
    _record(tmp_path, 4 * 86 * 2**20)
    assert checks05.check_pinned_footprint.verdict(sol["pinned_footprint"]) is False
    assert "the allocator took" in capsys.readouterr().out
