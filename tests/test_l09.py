"""Lesson 09 on the CPU: the trace matcher on synthetic traces, the deferred stop check (tokens, the
2-slot ring race-free and the 1-slot ring flagged on the emulated stream), and the GPU experiments'
one-sentence refusal without CUDA."""
import pytest
import torch

import pinlab
from pinlab.lessons import l09_real_code as l09

pytest.importorskip("transformers")


class _Ev:
    def __init__(self, where, kind="host sync (bool/int/float of a CUDA tensor)"):
        self.where, self.kind = where, kind


def _ann(name, ts, dur):
    return {"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": dur}


def _rt(name, ts):
    return {"ph": "X", "cat": "cuda_runtime", "name": name, "ts": ts, "dur": 1}


def test_match_counts_true_and_false_positives_and_missed_syncs():
    events = [_ann("region", 0, 1000), _ann("pinlab09:3", 10, 20), _ann("pinlab09:7", 100, 20),
              _ann("pinlab09:9", 200, 20),
              _rt("cudaMemcpyAsync", 12), _rt("cudaStreamSynchronize", 15),  # window 3: a sync
              _rt("cudaMemcpyAsync", 105),                                   # window 7: a copy, no sync
              _rt("cudaStreamSynchronize", 500),                             # outside every window: missed
              _rt("cudaStreamSynchronize", 2000)]                            # outside the region: ignored
    windows = {"pinlab09:3": 0, "pinlab09:7": 1, "pinlab09:9": 2}             # window 9: nothing in it
    m = l09.match(events, windows, [_Ev("a.py:1"), _Ev("b.py:2"), _Ev("c.py:3")], "region")
    assert (m["reported"], m["true_positives"], m["false_positives"]) == (3, 2, 1)
    assert (m["trace_syncs"], m["syncs_in_reported_windows"]) == (2, 1)
    assert dict(m["missed"]) == {"cudaStreamSynchronize": 1}
    assert [e["matched"] for e in m["per_event"]] == [True, True, False]
    with pytest.raises(ValueError, match="no annotation"):
        l09.match(events, windows, [], "elsewhere")


def test_short_where_and_code_at():
    assert l09.short_where("/x/site-packages/transformers/generation/utils.py:383") == \
        "transformers/generation/utils.py:383"
    code, func = l09.code_at(f"{__file__}:{_line_of_marker()}")
    assert "MARKER" in code and func == "_line_of_marker"


def _line_of_marker():
    import sys
    return sys._getframe().f_lineno  # MARKER


def test_the_deferred_stop_check_gives_the_default_tokens_on_the_emulated_stream():
    model = l09.tiny_llama("cpu")
    ids, mask = l09.prompt(2)
    default = l09.greedy(model, ids, mask, 6)
    assert default.shape == (2, ids.shape[1] + 6)
    with pinlab.LaggingStream() as s:
        deferred = l09.greedy(model, ids, mask, 6, deferred="course", stream=s)
    assert torch.equal(default, deferred)
    with pytest.raises(ValueError, match="use must be"):
        with l09.deferred_in_generate(None, use="nope"):
            pass


def test_the_two_slot_ring_is_race_free_and_one_slot_is_flagged():
    with pinlab.LaggingStream() as s:
        two = l09.race_ring(s, slots=2, steps=10)
        one = l09.race_ring(s, slots=1, steps=10)
    assert two["total"] == 0 and two["stopped_at"] == 6
    assert one["findings"].get(l09.D2H_READ, 0) == 9  # every step after the first reads a pending copy


def test_deferred_stop_reads_one_step_late_and_undoes_that_step():
    with pinlab.LaggingStream() as s:
        check = l09.DeferredStop(s, max_length=100)
        done = torch.zeros(1, dtype=torch.int64, device=s.device)
        assert check(done, None, 1) is False          # step 0: nothing to read yet
        assert check(done, None, 2) is True           # step 1 reads step 0's flag: all finished
        assert check.finish() == 1
        assert l09.DeferredStop(s, max_length=3)(torch.ones(1, device=s.device), None, 3) is True
    with pytest.raises((TypeError, ValueError), match="slots"):
        l09.DeferredStop(s, slots=0)


@pytest.mark.skipif(pinlab.has_cuda(), reason="checks the refusal without CUDA")
@pytest.mark.parametrize("fn", [l09.audit_generate, l09.stop_checks, l09.audit_dataloader, l09.audit_newer])
def test_gpu_experiments_refuse_without_cuda(fn):
    with pytest.raises(pinlab.CudaUnavailableError):
        fn()


@pytest.mark.skipif(pinlab.has_cuda(), reason="checks the missing-recording sentence without CUDA")
def test_a_missing_recording_gives_one_sentence(capsys):
    assert l09.measure_or_say("09_not_recorded_anywhere", lambda: {}) is None
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "no recorded GPU run yet" in out[0]


class _Pinnable:
    def __init__(self):
        self.pinned = False

    def pin_memory(self):
        out = _Pinnable()
        out.pinned = True
        return out


def test_the_witness_batch_says_which_thread_pinned_it():
    """DataLoader calls a custom batch's pin_memory() where it pins: the main thread without workers, its
    pin_memory thread with them. The witness records which (here: called from the main thread and from a
    thread of our own)."""
    import threading

    l09._PINNED_BY.clear()
    b = l09.PinWitness(_Pinnable(), _Pinnable()).pin_memory()
    assert b.x.pinned and b.y.pinned
    for name in ("pin-thread", "Thread-7 (_pin_memory_loop)"):
        t = threading.Thread(target=lambda: l09.PinWitness(_Pinnable(), _Pinnable()).pin_memory(), name=name)
        t.start()
        t.join()
    assert l09._PINNED_BY == ["main thread", "another thread", "DataLoader's pin_memory thread"]


def test_the_strided_collate_hands_out_a_view_that_is_not_dense():
    from pinlab.detector import host_layout_ok, is_dense

    samples = [(torch.randn(8), torch.tensor(i)) for i in range(4)]
    plain, strided = l09.collate_witness(samples), l09.collate_strided(samples)
    assert plain.x.is_contiguous() and plain.x.shape == (4, 8) and plain.y.tolist() == [0, 1, 2, 3]
    x = strided.x
    assert x.shape == (4, 4) and not is_dense(x.shape, x.stride()) and torch.equal(x, plain.x[:, ::2])
    assert host_layout_ok("Tensor.to", x.shape, x.stride(), x.is_contiguous()) is False, \
        "the detector takes its copy to go through a host temporary (as torch's Copy.cu does)"


def test_pageable_copies_adds_the_staged_ones():
    case = {"detector_pageable": 2, "detector_staged": 8, "memcpy": {l09.PAGEABLE_MEMCPY: 10, l09.PINNED_MEMCPY: 8}}
    assert l09.pageable_copies(case) == (10, 10)
    assert l09.pageable_copies({"detector_pageable": 16, "memcpy": {}}) == (16, 0)
    assert set(l09.LOADERS) >= {"pin_memory=False", "pin_memory=True", "pin_memory=True, 2 workers"}


def _audit(version, places, new_tokens=24):
    return {"transformers": version, "new_tokens": new_tokens,
            "places": [{"kind": k, "function": f, "code": c, "where": w, "n": n} for k, f, c, w, n in places]}


def test_two_audits_are_compared_by_function_and_code_not_line():
    stop = ("host sync (bool/int/float of a CUDA tensor)", "__call__", "return bool(unfinished_sequences.max() == 0)")
    mask = ("host sync (bool/int/float of a CUDA tensor)", "_ignore_causal_mask_sdpa", "if ... fast_all(padding_mask)")
    a = _audit("5.17.0", [(*stop, "utils.py:383", 24), (*mask, "masking_utils.py:269", 24)])
    same = _audit("5.24.0", [(*stop, "utils.py:396", 24), (*mask, "masking_utils.py:292", 24)])
    assert [(r["a"], r["b"]) for r in l09.compare_audits(a, same)] == [(24, 24), (24, 24)]
    assert l09.changes_text(a, same).startswith("transformers 5.24.0 makes the same calls as 5.17.0")
    assert l09.waits_per_token(a) == 2.0
    fewer = _audit("5.30.0", [(*stop, "utils.py:400", 24)])
    assert l09.changes_text(a, fewer) == "transformers 5.30.0 against 5.17.0: 1 place(s) of 5.17.0 gone"
    assert l09.waits_per_token(fewer) == 1.0


def test_the_newer_release_is_a_requirement_that_replays_when_absent(monkeypatch, tmp_path):
    from pinlab import probe

    monkeypatch.delenv(probe.NEWER_TRANSFORMERS_ENV, raising=False)
    assert any("no newer transformers" in r for r in probe.unmet({"newer_transformers": True}))
    monkeypatch.setenv(probe.NEWER_TRANSFORMERS_ENV, str(tmp_path))
    assert probe.newer_transformers_dir() is None, "a folder without transformers/ in it is not one"
    (tmp_path / "transformers").mkdir()
    (tmp_path / "transformers" / "__init__.py").write_text("")
    assert probe.newer_transformers_dir() == str(tmp_path) and probe.unmet({"newer_transformers": True}) == []
    with pytest.raises(TypeError, match="newer_transformers"):
        probe.unmet({"newer_transformers": "yes"})


def test_plan_staging_needs_cuda_and_its_rows_and_sentence_come_from_the_result():
    import pinlab
    from pinlab.lessons import l09_real_code as l09

    if not torch.cuda.is_available():
        with pytest.raises(pinlab.CudaUnavailableError):
            l09.plan_staging()
    r = {"back_to_back": {"outcome": "wrong output", "detail": "max error 3", "races": 2, "races_elsewhere": 1,
                          "seconds": 0.4},
         "two_wrappers": {"outcome": "correct", "detail": "ok", "races": 0, "races_elsewhere": 0, "seconds": 0.2},
         "event_wait": {"outcome": "correct", "detail": "ok", "races": 0, "races_elsewhere": 0, "seconds": 0.3}}
    rows = l09.staging_rows(r)
    assert [row["staging"] for row in rows] == [1, 0, 0] and rows[0]["elsewhere"] == 1
    text = l09.staging_text(r)
    assert "flagged the staging 1 time(s)" in text and "1 other finding(s)" in text and "wrong output" in text
    gone = {m: {"outcome": "unavailable", "detail": "no FlashInfer"} for m in l09.STAGING_MODES}
    assert l09.staging_text(gone) == "FlashInfer could not run the children here (no FlashInfer)."


def test_audit_flashinfer_needs_cuda_and_its_lines_come_from_the_result(capsys):
    import pinlab
    from pinlab.lessons import l09_real_code as l09

    if not torch.cuda.is_available():
        with pytest.raises(pinlab.CudaUnavailableError):
            l09.audit_flashinfer()
    f = {"places": [{"n": 16, "kind": "pageable non_blocking H2D", "where": "decode.py:1", "function": "plan",
                     "code": "x.to(d)"}], "reported": 16, "steps": 8, "trace_syncs": 0, "memcpy": {}}
    l09.show_flashinfer_audit(f)
    out = capsys.readouterr().out
    assert "16 x pageable non_blocking H2D" in out and "per decode step: 2.00" in out and "by kind: none" in out


def _stop_result(default_tps, deferred_tps, version="5.17.0"):
    run = {"tokens": [[1, 2, 3]], "wait_us_per_token": 0.0, "gpu_idle": None, "tokens_per_s": 0.0}
    return {"deferred_is": "transformers' DeferredStopCheck", "transformers": version, "gpu_ms": 0.0,
            "runs": {"default": dict(run, syncs={"cudaStreamSynchronize": 51}, wait_us_per_token=812.0,
                                     gpu_idle=0.61, tokens_per_s=default_tps),
                     "deferred": dict(run, syncs={"cudaStreamSynchronize": 27, "cudaEventSynchronize": 25},
                                      wait_us_per_token=230.0, tokens_per_s=deferred_tps)},
            "ratios": [0.98, 1.02]}


def test_stop_checks_text_is_computed_from_each_result(capsys):
    res = {"tiny model": _stop_result(441.0, 434.0), "+4 ms GPU per step, newer": _stop_result(150.0, 180.0, "5.24.0")}
    assert l09.speedup(res["tiny model"]) == pytest.approx(434 / 441)
    text = l09.stop_checks_text(res)
    assert "tiny model (transformers 5.17.0): 0.98x, the host waiting 812 -> 230 us per token" in text
    assert "+4 ms GPU per step, newer (transformers 5.24.0): 1.20x" in text
    assert "27 cudaStreamSynchronize left in the deferred run" in text
    assert "GPU idle" not in text  # a run without kernels in its trace names no idle share
    l09.show_stop_runs(res["tiny model"], 24)
    out = capsys.readouterr().out
    assert "default: host waiting per token, GPU idle share of the call: 812 us, 61%" in out
    assert "deferred: host waiting per token, GPU idle share of the call: 230 us, no kernel in the trace" in out
    assert "deferred speed-up per round: 0.98x, 1.02x" in out


@pytest.mark.skipif(pinlab.has_cuda(), reason="checks the refusal without CUDA")
def test_stop_checks_newer_refuses_without_cuda():
    with pytest.raises(pinlab.CudaUnavailableError):
        l09.stop_checks_newer(gpu_ms=4.0)


def test_a_broken_recording_is_named_broken_in_lesson_09(tmp_path, monkeypatch, capsys):
    from pinlab.lessons import l09_real_code as l09
    from pinlab.replay import ReplayFileError

    if torch.cuda.is_available():
        pytest.skip("replays only where there is no CUDA")
    (tmp_path / "09_broken.json").write_text("{ not json")
    monkeypatch.setenv("PINLAB_DATA_DIR", str(tmp_path))
    with pytest.raises(ReplayFileError, match="09_broken"):
        l09.measure_or_say("09_broken", lambda: {"x": 1})


def test_flashinfer_is_a_requirement_that_replays_when_absent(monkeypatch):
    """Issue 47: without FlashInfer, lesson 09's FlashInfer sections replay the recorded run, labelled, as a missing
    GPU trace does; `requires={"flashinfer": True}` names the reason (device.flashinfer_status, cached per process)."""
    from pinlab import device, probe

    monkeypatch.setattr(device, "flashinfer_status", lambda: (None, "FlashInfer taken as absent "
                        "($PINLAB_NO_FLASHINFER is set): the torch reference runs instead"))
    assert probe.unmet({"flashinfer": True}) == ["FlashInfer taken as absent ($PINLAB_NO_FLASHINFER is set)"]
    assert probe.unmet({"flashinfer": False}) == []
    monkeypatch.setattr(device, "flashinfer_status", lambda: (None, "FlashInfer is not importable (ImportError: x); "
                        "install flashinfer-python"))
    assert probe.unmet({"flashinfer": True}) == ["FlashInfer is not importable (ImportError: x)"]
    monkeypatch.setattr(device, "flashinfer_status", lambda: ("0.6.18", "FlashInfer 0.6.18 imports"))
    assert probe.unmet({"flashinfer": True}) == []
    with pytest.raises(TypeError, match="flashinfer"):
        probe.unmet({"flashinfer": "yes"})


# --- padding, #43089's setup, the batch-size sweep (the GPU experiments' CPU parts) -----------------------------


def test_prompt_left_pads_the_first_prompt_and_refuses_a_pad_as_long_as_the_prompt():
    ids, mask = l09.prompt(2, length=8, left_pad=3)
    assert mask[0].tolist() == [0, 0, 0, 1, 1, 1, 1, 1] and mask[1].tolist() == [1] * 8
    assert ids[0, :3].tolist() == [0, 0, 0] and (ids[0, 3:] >= 3).all() and (ids[1] >= 3).all()
    plain_ids, plain_mask = l09.prompt(2, length=8)
    assert torch.equal(plain_ids[:, 3:], ids[:, 3:]) and bool(plain_mask.all())
    with pytest.raises(ValueError, match="left_pad must be below the prompt's length"):
        l09.prompt(2, length=8, left_pad=8)
    with pytest.raises((TypeError, ValueError), match="left_pad"):
        l09.prompt(2, left_pad=-1)


def test_a_left_padded_batch_and_43089s_criterion_and_processor_decode_as_greedy_does():
    model = l09.tiny_llama()
    ids, mask = l09.prompt(2, left_pad=3)
    out = l09.greedy(model, ids, mask, 6)
    assert tuple(out.shape) == (2, 8 + 6)
    plain_ids, plain_mask = l09.prompt(2)
    plain = l09.greedy(model, plain_ids, plain_mask, 6)
    # the log of a softmax keeps every argmax; a criterion that never stops changes nothing
    assert torch.equal(l09.greedy(model, plain_ids, plain_mask, 6, **l09.issue_43089_kwargs()), plain)


def _stop_result_for_sweep(b, ms, ratios, same=True, idle=0.5):
    run = lambda tokens: {"tokens": tokens, "syncs": {"cudaStreamSynchronize": 24}, "wait_us_per_token": 10.0 + ms,
                          "gpu_idle": idle, "tokens_per_s": 100.0 * b}
    return {"deferred_is": "x", "transformers": "5.17.0", "gpu_ms": ms, "ratios": ratios,
            "runs": {"default": run([[1, 2]]), "deferred": run([[1, 2]] if same else [[1, 3]])}}


def test_the_sweep_keeps_whether_the_tokens_matched_instead_of_the_tokens(monkeypatch):
    calls = []

    def fake(new_tokens, batch, rounds, seed, gpu_ms):
        calls.append((batch, gpu_ms))
        return _stop_result_for_sweep(batch, gpu_ms, [1.0] * rounds, same=batch != 8)

    monkeypatch.setattr(l09, "stop_checks", fake)
    monkeypatch.setattr(l09, "require_cuda", lambda what: None)
    sw = l09.stop_check_sweep(rounds=5)
    assert calls == [(1, 0.0), (8, 0.0), (64, 0.0), (1, 4.0), (8, 4.0), (64, 4.0)]
    assert list(sw["results"]) == ["0", "4"] and list(sw["results"]["4"]) == ["1", "8", "64"]
    assert [r["same_tokens"] for r in sw["results"]["0"].values()] == [True, False, True]
    assert all("tokens" not in run for per in sw["results"].values() for r in per.values()
               for run in r["runs"].values())
    for bad in ([], "1,8", [0], [1.5]):
        with pytest.raises((TypeError, ValueError), match="batches"):
            l09.stop_check_sweep(batches=bad)
    with pytest.raises((TypeError, ValueError), match="gpu_ms"):
        l09.stop_check_sweep(gpu_ms=[-1.0])


def test_the_sweeps_rows_sentence_and_figure_are_computed_from_it():
    sw = {"results": {"0": {"1": _stop_result_for_sweep(1, 0.0, [0.9, 0.95, 0.97, 0.92, 0.99], idle=0.96),
                            "64": _stop_result_for_sweep(64, 0.0, [0.9, 1.1, 1.0, 1.0, 1.0], idle=0.4)},
                      "4": {"1": _stop_result_for_sweep(1, 4.0, [1.02, 1.05, 1.04, 1.01, 1.03], idle=None),
                            "64": _stop_result_for_sweep(64, 4.0, [1.1] * 5, idle=0.1)}}}
    rows = l09.sweep_rows(sw)
    assert [(r["workload"], r["batch"]) for r in rows] == [("tiny model", 1), ("tiny model", 64),
                                                           ("+4 ms GPU per step", 1), ("+4 ms GPU per step", 64)]
    assert rows[0]["ratio"] == "1.00x (0.90-0.99)" and rows[2]["idle"] == "no kernel in the trace -> no kernel in the trace"
    text = l09.sweep_text(sw)
    assert text == ("tiny model: GPU idle share of the call (default check) 96% at batch 1, 40% at 64; deferred: no "
                    "batch size where every round was faster; every round slower at batch 1; +4 ms GPU per step: GPU "
                    "idle share of the call (default check) no kernel in the trace at batch 1, 10% at 64; deferred: "
                    "every round faster at batch 1, 64")
    import matplotlib

    matplotlib.use("Agg")
    a1, a2 = l09.plot_sweep(sw, title="sweep")
    assert len(a1.lines) == 4 and [t.get_text() for t in a2.get_xticklabels()] == ["1", "64"]
    # a None idle share is left out of the bottom panel, not drawn as 0
    assert sorted(len(line.get_xdata()) for line in a2.lines) == [1, 1, 2, 2]


def test_show_comparison_names_its_columns(capsys):
    a = {"transformers": "5.17.0", "new_tokens": 24,
         "places": [{"kind": l09.WAITING_KINDS[0], "function": "f", "code": "x", "n": 24, "where": "a.py:1"}]}
    b = dict(a, places=[dict(a["places"][0], n=48)])
    l09.show_comparison(a, b, labels=("plain", "#43089's"))
    out = capsys.readouterr().out
    assert "plain" in out and "#43089's" in out and "1.00 / 2.00" in out and "what changed" not in out



def test_importing_the_lesson_hides_tqdm_s_ipywidgets_warning():
    """Issue 49: notebook 09's import cell showed tqdm.auto's "IProgress not found" warning with the machine's
    absolute path to tqdm (the lesson shows no widget). Run in a fresh interpreter: pytest resets the warning
    filters around each test."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import warnings\nimport pinlab.lessons.l09_real_code\n"
            "warnings.warn('IProgress not found. Please update jupyter and ipywidgets.', UserWarning)\n"
            "warnings.warn('another warning', UserWarning)\n")
    lib = Path(__file__).resolve().parents[1] / "lib"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**__import__("os").environ, "PYTHONPATH": str(lib)})
    assert r.returncode == 0, r.stderr
    assert "IProgress" not in r.stderr and "another warning" in r.stderr, r.stderr
