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


def test_labels_and_tags_say_where_a_result_came_from():
    meta = {"gpu": "NVIDIA H200", "date": "2026-11-30"}
    replayed, live = record.Run("x", 1, meta, live=False), record.Run("x", 1, meta, live=True)
    assert replayed.label == "recorded on NVIDIA H200, 2026-11-30 (replayed here: no CUDA on this machine)"
    assert replayed.tag == "NVIDIA H200, recorded 2026-11-30"
    assert "measured now" not in replayed.label and "measured now" not in replayed.tag
    assert live.label == "measured now on NVIDIA H200"
    assert live.tag == "NVIDIA H200, 2026-11-30"   # a saved figure keeps its date, not "now"
    assert "recorded" in replayed.tag and "recorded" not in live.tag


def test_replayed_run_has_the_replay_tag(datadir, monkeypatch):
    monkeypatch.setenv("PINLAB_FORCE_CPU", "1")
    _store(datadir, "x5", {}, [1])
    run = pinlab.measure("x5", lambda: 0, quiet=True)
    assert run.tag == "NVIDIA H200, recorded 2026-11-30" and not run.live


BROKEN = {
    "truncated": '{"meta": {"gpu": "G", "date": "d"}, "params": {}, "result": [1, 2',
    "empty": "",
    "not_json": "hello",
    "a_list": "[1, 2, 3]",
    "no_result": '{"meta": {"gpu": "G", "date": "d"}, "params": {}}',
    "meta_not_object": '{"meta": 3, "params": {}, "result": 1}',
    "params_not_object": '{"meta": {"gpu": "G", "date": "d"}, "params": [], "result": 1}',
    "no_gpu": '{"meta": {"date": "d"}, "params": {}, "result": 1}',
}


@pytest.mark.parametrize("kind", sorted(BROKEN))
def test_broken_recorded_file_is_one_sentence_naming_the_file(datadir, monkeypatch, kind):
    monkeypatch.setenv("PINLAB_FORCE_CPU", "1")
    path = datadir / f"b_{kind}.json"
    path.write_text(BROKEN[kind])
    with pytest.raises(record.ReplayFileError) as info:
        pinlab.measure(f"b_{kind}", lambda: 1)
    msg = str(info.value)
    assert str(path) in msg and "make gpu-suite" in msg and "git checkout" in msg
    assert "\n" not in msg and msg.endswith(".")
    assert isinstance(info.value, pinlab.ReplayMissingError)  # notebooks that catch it keep working
    assert info.value.__cause__ is None or not isinstance(info.value.__cause__, KeyError)


def test_undecodable_recorded_file(datadir, monkeypatch):
    monkeypatch.setenv("PINLAB_FORCE_CPU", "1")
    (datadir / "bin.json").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(record.ReplayFileError, match="bin.json cannot be read"):
        pinlab.measure("bin", lambda: 1)


def test_load_recorded_accepts_a_good_file_and_names_a_missing_one(datadir):
    _store(datadir, "ok", {"n": 1}, {"v": 2})
    assert record.load_recorded(datadir / "ok.json")["result"] == {"v": 2}
    with pytest.raises(pinlab.ReplayMissingError, match="absent.json is missing"):
        record.load_recorded(datadir / "absent.json")


def test_every_committed_recording_is_valid():
    good, broken = record.check_recorded(record.repo_root() / "reports" / "gpu" / "data")
    assert broken == [] and good


def test_doctor_flags_a_broken_recording(datadir, monkeypatch, capsys):
    monkeypatch.setenv("PINLAB_FORCE_CPU", "1")
    _store(datadir, "fine", {}, 1)
    (datadir / "cut.json").write_text('{"meta": {"gpu"')
    rep = pinlab.doctor()
    out = capsys.readouterr().out
    check = next(c for c in rep["checks"] if c["check"] == "recorded GPU run")
    assert check["ok"] is False and "cut.json" in check["note"] and rep["ok"] is False
    assert "[ok  ] recorded GPU run" not in out and "[FAIL] recorded GPU run" in out


def test_doctor_says_ok_for_good_recordings(datadir, monkeypatch, capsys):
    monkeypatch.setenv("PINLAB_FORCE_CPU", "1")
    _store(datadir, "fine", {}, 1)
    rep = pinlab.doctor(verbose=False)
    check = next(c for c in rep["checks"] if c["check"] == "recorded GPU run")
    assert check["ok"] is True and rep["ok"] is True and capsys.readouterr().out == ""


def test_doctor_without_recordings_on_cpu(datadir, monkeypatch):
    monkeypatch.setenv("PINLAB_FORCE_CPU", "1")
    rep = pinlab.doctor(verbose=False)
    assert rep["ok"] is False
    with pytest.raises(TypeError, match="verbose must be True or False"):
        pinlab.doctor(verbose="yes")


def test_quiet_must_be_a_bool():
    with pytest.raises(TypeError, match="quiet must be True or False"):
        pinlab.measure("ok", lambda: 1, quiet="no")


def test_doctor_names_a_missing_suite_report(tmp_path, monkeypatch):
    monkeypatch.setenv("PINLAB_FORCE_CPU", "1")
    data = tmp_path / "gpu" / "data"
    data.mkdir(parents=True)
    monkeypatch.setenv("PINLAB_DATA_DIR", str(data))
    _store(data, "fine", {}, 1)
    rep = pinlab.doctor(verbose=False)
    check = next(c for c in rep["checks"] if c["check"] == "GPU suite report")
    assert check["ok"] is False and "latest.json is missing" in check["note"] and rep["ok"] is True
    (tmp_path / "gpu" / "latest.json").write_text('{"notebooks": [{"path": "notebooks/00.ipynb"}]}')
    check = next(c for c in pinlab.doctor(verbose=False)["checks"] if c["check"] == "GPU suite report")
    assert check["ok"] is True
