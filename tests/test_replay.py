"""measure(): live on CUDA (recorded when asked), replayed and labelled without CUDA."""
import json

import pytest

import pinlab
from pinlab import replay as record


@pytest.fixture
def datadir(tmp_path, monkeypatch):
    monkeypatch.setenv("PINLAB_DATA_DIR", str(tmp_path))
    return tmp_path


def _store(datadir, name, params, result, gpu="NVIDIA H200", date="2026-11-30"):
    (datadir / f"{name}.json").write_text(json.dumps(
        {"meta": {"gpu": gpu, "date": date}, "params": params, "result": result}))


def test_replay_returns_recorded_result_and_label(datadir, monkeypatch, capsys):
    monkeypatch.setenv("PINLAB_FORCE_CPU", "1")
    _store(datadir, "x1", {"n": 3}, {"v": [1, 2, 3]})
    called = []
    run = pinlab.measure("x1", lambda n: called.append(n), n=3)
    assert called == []  # never measured without CUDA
    assert run.result == {"v": [1, 2, 3]} and run["v"] == [1, 2, 3]
    assert run.live is False
    assert run.label == "recorded on NVIDIA H200, 2026-11-30 (replayed here: no CUDA on this machine)"
    assert capsys.readouterr().out == f"[measured] source: {run.label}\n"


def test_replay_missing_says_what_to_do(datadir, monkeypatch):
    monkeypatch.setenv("PINLAB_FORCE_CPU", "1")
    with pytest.raises(pinlab.ReplayMissingError, match="run the GPU suite"):
        pinlab.measure("absent", lambda: 1)


def test_replay_refuses_other_parameters(datadir, monkeypatch):
    monkeypatch.setenv("PINLAB_FORCE_CPU", "1")
    _store(datadir, "x2", {"n": 3}, 1)
    with pytest.raises(pinlab.ReplayMissingError, match="other parameters"):
        pinlab.measure("x2", lambda n: n, n=4)


def test_live_run_records_only_when_asked(datadir, monkeypatch):
    monkeypatch.setattr(record, "has_cuda", lambda: True)
    monkeypatch.setattr(record, "facts", lambda: {"gpu": "FakeGPU", "driver": None, "torch": "t",
                                                  "cuda_runtime": None, "flashinfer": None, "python": "3"})
    monkeypatch.delenv("PINLAB_RECORD", raising=False)
    run = pinlab.measure("x3", lambda n: {"n2": n * 2}, quiet=True, n=5)
    assert run.live and run.result == {"n2": 10} and run.label == "measured now on FakeGPU"
    assert not (datadir / "x3.json").exists()
    monkeypatch.setenv("PINLAB_RECORD", "1")
    pinlab.measure("x3", lambda n: {"n2": n * 2}, quiet=True, n=5)
    stored = json.loads((datadir / "x3.json").read_text())
    assert stored["params"] == {"n": 5} and stored["result"] == {"n2": 10} and stored["meta"]["gpu"] == "FakeGPU"


def test_results_are_made_jsonable(datadir, monkeypatch):
    monkeypatch.setattr(record, "has_cuda", lambda: True)
    monkeypatch.setattr(record, "facts", lambda: {"gpu": "G", "driver": None, "torch": "t",
                                                  "cuda_runtime": None, "flashinfer": None, "python": "3"})
    run = pinlab.measure("x4", lambda: {"s": pinlab.Stats.of([1.0]), "t": (1, 2)}, quiet=True)
    assert run.result == {"s": {"median": 1.0, "min": 1.0, "max": 1.0, "n": 1}, "t": [1, 2]}


@pytest.mark.parametrize("bad", ["", "../x", "a b", None])
def test_bad_names(bad):
    with pytest.raises(ValueError, match="name must be a short identifier"):
        pinlab.measure(bad, lambda: 1)


def test_fn_must_be_callable():
    with pytest.raises(TypeError, match="fn must be callable"):
        pinlab.measure("ok", 3)
