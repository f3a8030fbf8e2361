"""What a notebook asserts and what it observes (pinlab.claims), and the platform probe's answers (pinlab.probe):
behaviour tests that catch the planted bugs of issue 28 (``tools/mutation_check.py``: ``claims.*``, ``probe.*``).

The probe's answers on a GPU machine are imitated by replacing ``probe.platform_facts`` and
``probe.profiler_records_gpu`` (what the machine reports), never the functions under test."""
import pytest

import pinlab
from pinlab import probe


@pytest.fixture(autouse=True)
def _cpu_only(monkeypatch):
    monkeypatch.setenv("PINLAB_FORCE_CPU", "1")
    monkeypatch.delenv("PINLAB_SIMULATE_NO_GPU_TRACE", raising=False)


# ----------------------------------------------------------------- claims: every entry is judged

@pytest.mark.parametrize("bad", [0, 1, 2])
def test_claims_fails_on_whichever_entry_does_not_hold(bad, capsys):
    texts = ["first fact", "second fact", "third fact"]
    mapping = {t: i != bad for i, t in enumerate(texts)}
    with pytest.raises(pinlab.ClaimError) as err:
        pinlab.claims(mapping, why={texts[bad]: "the reason for this one"})
    msg = str(err.value)
    assert f"Claim did not hold in this run: {texts[bad]}." in msg and "the reason for this one" in msg
    assert capsys.readouterr().out == "".join(f"{t}: {i != bad}\n" for i, t in enumerate(texts))


@pytest.mark.parametrize("count, holds", [(0, True), (1, False), (-1, False)])
def test_claims_compares_a_later_count_with_its_exact_expected_value(count, holds):
    mapping = {"the race showed": True, "corrupted steps": count}
    if holds:
        assert pinlab.claims(mapping, expect={"corrupted steps": 0}) is None
    else:
        with pytest.raises(pinlab.ClaimError, match=r"corrupted steps.*expected exactly 0"):
            pinlab.claims(mapping, expect={"corrupted steps": 0})


def test_claims_that_all_hold_return_true(capsys):
    assert pinlab.claims({"a": True, "b": True, "c": 3}, expect={"c": 3}) is None
    assert capsys.readouterr().out == "a: True\nb: True\nc: 3\n"



# ----------------------------------------------------------------- claim: shown=False prints nothing

@pytest.mark.parametrize("holds", [True, False])
def test_claim_shown_false_prints_nothing_and_still_judges(holds, capsys):
    """claims.shown_false_prints: shown=False (a claim the cell already printed) prints nothing, holding or not;
    shown=True prints ``text: True``."""
    if holds:
        assert pinlab.claim("the same storage", True, shown=False) is None  # (claim returns nothing: no stray Out)
    else:
        with pytest.raises(pinlab.ClaimError, match="Claim did not hold in this run: the same storage"):
            pinlab.claim("the same storage", False, value=2, shown=False)
    assert capsys.readouterr().out == ""
    assert pinlab.claim("the same storage", True) is None
    assert capsys.readouterr().out == "the same storage: True\n"

# ----------------------------------------------------------------- observe: says what happened, never fails

@pytest.mark.parametrize("holds", [True, False])
def test_observe_returns_whether_it_held_and_says_so(holds, capsys):
    assert pinlab.observe("the ring cost less", holds, value="0.8x", why="a shared GPU") is holds
    out = capsys.readouterr().out
    assert out.startswith("[measured] the ring cost less: ")
    assert ("yes (0.8x)" in out) is holds
    assert ("not in this run (0.8x); a shared GPU" in out) is (not holds)


# ----------------------------------------------------------------- probe.unmet: what this machine lacks

@pytest.mark.parametrize("records", [True, False])
def test_unmet_names_a_profiler_that_records_nothing_and_only_then(records, monkeypatch):
    monkeypatch.setattr(probe, "profiler_records_gpu", lambda: records)
    reasons = probe.unmet({"gpu_trace": True})
    if records:
        assert reasons == []
    else:
        assert len(reasons) == 1 and "the profiler records no GPU activity" in reasons[0]
    assert probe.unmet({"gpu_trace": False}) == [] and probe.unmet(None) == [] and probe.unmet({}) == []


def test_unmet_on_this_cpu_machine_names_the_missing_trace():
    """Without CUDA the profiler records no GPU activity: an experiment that needs it is unmet here."""
    assert pinlab.has_cuda() is False
    assert any("profiler records no GPU activity" in r for r in probe.unmet({"gpu_trace": True}))


def test_unmet_says_why_the_trace_is_missing_when_it_is_simulated(monkeypatch):
    monkeypatch.setenv("PINLAB_SIMULATE_NO_GPU_TRACE", "1")
    assert probe.profiler_records_gpu.__wrapped__() is False
    monkeypatch.setattr(probe, "profiler_records_gpu", lambda: False)
    assert "PINLAB_SIMULATE_NO_GPU_TRACE is set" in probe.unmet({"gpu_trace": True})[0]


def _gpu_facts(**changes):
    facts = {"backend": "cuda", "gpu_usable": True, "wsl": False, "cpu_cores_usable": 16, "gpu": "NVIDIA H200",
             "integrated": False, "pageable_memory_access": False, "ats": False, "copy_engines": 3,
             "vram_total_gib": 139.8, "vram_free_gib": 120.0, "pcie_gen": 5, "pcie_width": 16,
             "driver_cuda": "13.0", "wheel_cuda": "13.0", "other_gpu_processes": 0, "pinned_limit_gib": None,
             "host_ram_available_gib": 100.0}
    facts.update(changes)
    return facts


@pytest.mark.parametrize("need, free, lacks", [(6.5, 4.0, True), (6.5, 6.5, False), (1, 120.0, False)])
def test_unmet_compares_the_vram_needed_with_what_is_free(need, free, lacks, monkeypatch):
    monkeypatch.setattr(probe, "platform_facts", lambda: _gpu_facts(vram_free_gib=free))
    reasons = probe.unmet({"vram_gib": need})
    assert bool(reasons) is lacks
    assert not lacks or f"{need} GiB of free VRAM" in reasons[0]


# ----------------------------------------------------------------- machine_summary: what may explain a result

@pytest.mark.parametrize("others", [0, 1, 3])
def test_machine_summary_says_when_the_gpu_is_shared(others, monkeypatch):
    monkeypatch.setattr(probe, "platform_facts", lambda: _gpu_facts(other_gpu_processes=others))
    summary = probe.machine_summary()
    assert summary.startswith("NVIDIA H200 (PCIe Gen5 x16, 120.0 of 139.8 GiB VRAM free)")
    assert ("shared GPU" in summary) is (others > 0)
    assert not others or f"{others} other process(es) on the GPU" in summary


def test_machine_summary_names_wsl_ats_and_a_driver_mismatch(monkeypatch):
    monkeypatch.setattr(probe, "platform_facts", lambda: _gpu_facts(wsl=True, ats=True, driver_cuda="12.8"))
    summary = probe.machine_summary()
    assert "WSL2" in summary and "page tables" in summary and "driver CUDA 12.8 vs torch's 13.0" in summary


def test_a_failed_claim_carries_the_summary_of_a_shared_gpu(monkeypatch):
    monkeypatch.setattr(probe, "platform_facts", lambda: _gpu_facts(other_gpu_processes=2))
    with pytest.raises(pinlab.ClaimError, match="2 other process"):
        pinlab.claim("a fact", False)


@pytest.mark.parametrize("value, on", [("1", True), (" 1 ", True), ("0", False), ("", False)])
def test_launch_blocking_is_named_as_the_cause_not_the_cpu(value, on, monkeypatch, capsys):
    """Issue 45: under CUDA_LAUNCH_BLOCKING=1 a race lesson's failures blamed a slow or shared CPU. The machine line
    names the variable, a failed claim names it as the likely cause before the lesson's reasons, and an
    observation that did not hold gives it as the reason."""
    monkeypatch.setattr(probe, "platform_facts", lambda: _gpu_facts())
    monkeypatch.setattr(probe, "has_cuda", lambda: True)
    monkeypatch.setenv("CUDA_LAUNCH_BLOCKING", value)
    assert ("CUDA_LAUNCH_BLOCKING=1" in probe.machine_summary()) is on
    with pytest.raises(pinlab.ClaimError) as err:
        pinlab.claim("the race showed", False, why="a host slower than the GPU (a CPU shared by many processes)")
    msg = str(err.value)
    assert ("The likely cause: CUDA_LAUNCH_BLOCKING=1 is set" in msg) is on
    assert msg.index("a CPU shared") > (msg.index("likely cause") if on else -1)
    assert ("Other reasons it may not hold" in msg) is on and ("Why it may not hold here" in msg) is not on
    capsys.readouterr()
    pinlab.observe("the GPU ran behind", False, why="a host slower than the GPU")
    out = capsys.readouterr().out
    assert ("CUDA_LAUNCH_BLOCKING=1" in out) is on and ("host slower" in out) is not on


def test_launch_blocking_without_cuda_changes_nothing(monkeypatch):
    monkeypatch.setattr(probe, "has_cuda", lambda: False)
    monkeypatch.setenv("CUDA_LAUNCH_BLOCKING", "1")
    assert not probe.launch_blocking()


# --- one line per fact (issue 31): a count with its exact expected value, and a lesson's table of reasons


@pytest.mark.parametrize("count, holds", [(0, True), (1, False), (0.0, True)])
def test_claim_compares_a_count_with_expect_and_prints_the_count(count, holds, capsys):
    if holds:
        pinlab.claim("corrupted steps", count, expect=0, why="a bug")
        assert capsys.readouterr().out.strip() == f"corrupted steps: {count}"
    else:
        with pytest.raises(pinlab.ClaimError, match=r"1 \(expected exactly 0\).*a bug"):
            pinlab.claim("corrupted steps", count, expect=0, why="a bug")


@pytest.mark.parametrize("bad", [True, None, "0", float("nan"), [0]])
def test_claim_with_expect_refuses_what_is_not_a_count(bad):
    with pytest.raises((TypeError, ValueError), match="holds"):
        pinlab.claim("corrupted steps", bad if bad is not True else object(), expect=0)


def test_a_reasons_table_gives_its_sentences_and_names_what_it_lacks():
    why = pinlab.Reasons(torch_bug="a bug in torch", gpu_behind="the GPU must be behind")
    assert why.torch_bug == "a bug in torch"
    with pytest.raises(AttributeError, match="no reason 'torch_bgu'.*gpu_behind, torch_bug"):
        _ = why.torch_bgu
    with pytest.raises(TypeError, match="reason 'empty'"):
        pinlab.Reasons(empty="  ")
    with pytest.raises(TypeError):
        pinlab.Reasons()
