"""measure(): live on CUDA (recorded when asked), replayed and labelled without CUDA."""
import json
from pathlib import Path

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


# ---- issue 19: one validation path, per-experiment checks, one sentence with the fix --------------------------

REAL = record.repo_root() / "reports" / "gpu" / "data"


def _real_copy(datadir, name, *, as_recorded_now=True, source=None):
    """A copy of the committed recording ``source`` (default ``name``) saved as ``datadir/name.json``; with
    ``as_recorded_now`` it carries meta name and schema, as measure() writes them since issue 19."""
    stored = json.loads((REAL / f"{source or name}.json").read_text())
    if as_recorded_now:
        stored["meta"]["name"] = source or name
        stored["meta"]["schema"] = record.result_schema(stored["result"])
    else:  # as recorded before issue 19 (the committed files have both since the GPU run that followed it)
        stored["meta"].pop("name", None)
        stored["meta"].pop("schema", None)
    path = datadir / f"{name}.json"
    path.write_text(json.dumps(stored, indent=1))
    return path, stored


def _nan_in_peak(datadir):
    path, stored = _real_copy(datadir, "01_copy_loop_peak")
    path.write_text(path.read_text().replace(f'"best_GBps": {stored["result"]["best_GBps"]!r}', '"best_GBps": NaN'))
    return path, "holds NaN at ['result']['best_GBps']"


def _infinity_old_format(datadir):
    path, stored = _real_copy(datadir, "01_bandwidth", as_recorded_now=False)
    first = stored["result"][0]["h2d_pinned_ms"]
    path.write_text(path.read_text().replace(repr(first), "Infinity", 1))
    return path, "holds infinity at ['result'][0]['h2d_pinned_ms']"


def _huge(datadir):
    path, _ = _real_copy(datadir, "01_bandwidth")
    with open(path, "r+b") as fh:  # sparse: 600 MiB on paper, nothing on disk
        fh.truncate(600 * 2**20)
    return path, "is 600 MiB, over the 20 MiB"


def _missing_key(datadir):
    path, stored = _real_copy(datadir, "03_plain_race")
    del stored["result"]["steps"]
    path.write_text(json.dumps(stored))
    return path, "does not have the structure it was recorded with (result['steps'] is missing)"


def _type_changed(datadir):
    path, stored = _real_copy(datadir, "03_plain_race")
    stored["result"]["steps"] = "200"
    path.write_text(json.dumps(stored))
    return path, "result['steps'] is a string, recorded as a number"


def _row_dropped(datadir):
    path, stored = _real_copy(datadir, "01_bandwidth")
    stored["result"].pop()
    path.write_text(json.dumps(stored))
    return path, f"result has {len(stored['result'])} items, recorded with {len(stored['result']) + 1}"


def _other_experiment(datadir):
    # 00_tiny_copy has the same params ({}) as 01_copy_loop_peak: before issue 19, KeyError 'best_GBps'
    path, _ = _real_copy(datadir, "01_copy_loop_peak", source="00_tiny_copy")
    return path, "holds the result of another experiment ('00_tiny_copy', not '01_copy_loop_peak'"


def _binary(datadir):
    path, _ = _real_copy(datadir, "00_tiny_copy")
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff" + path.read_bytes()[:40])
    return path, "cannot be read (not UTF-8 text: binary garbage at byte 0)"


def _truncated(datadir):
    path, _ = _real_copy(datadir, "01_bandwidth")
    path.write_text(path.read_text()[:300])
    return path, "is not valid JSON (truncated or edited by hand? error at line"


def _emptied(datadir):
    path, _ = _real_copy(datadir, "02_d2h")
    path.write_text("\n")
    return path, "is empty"


def _no_result(datadir):
    path, stored = _real_copy(datadir, "02_d2h")
    del stored["result"]
    path.write_text(json.dumps(stored))
    return path, "has the wrong shape (no 'result' key)"


CORRUPTIONS = {f.__name__.lstrip("_"): f for f in (
    _nan_in_peak, _infinity_old_format, _huge, _missing_key, _type_changed, _row_dropped, _other_experiment,
    _binary, _truncated, _emptied, _no_result)}


def _assert_one_sentence(exc, path, what):
    msg = str(exc)
    assert isinstance(exc, record.ReplayFileError), msg
    assert msg.startswith(f"The recorded GPU run {path} "), msg
    assert what in msg, msg
    assert f"`git checkout -- {path}`" in msg and "make gpu-suite" in msg, msg
    assert "\n" not in msg and msg.endswith(".") and msg.count(": ") <= 2, msg
    assert exc.__cause__ is None and (exc.__context__ is None or exc.__suppress_context__)  # no chained noise


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_corrupted_copies_of_real_recordings_give_one_sentence(datadir, monkeypatch, kind):
    monkeypatch.setenv("PINLAB_FORCE_CPU", "1")
    path, what = CORRUPTIONS[kind](datadir)
    name = path.stem
    params = json.loads((REAL / f"{name}.json").read_text())["params"]
    with pytest.raises(record.ReplayFileError) as info:   # the notebook's path
        pinlab.measure(name, lambda **kw: pytest.fail("measured without CUDA"), **params)
    _assert_one_sentence(info.value, path, what)
    with pytest.raises(record.ReplayFileError) as info:   # every other reader's path, by name or by file
        record.load_recorded(name)
    _assert_one_sentence(info.value, path, what)
    good, broken = record.check_recorded(datadir)          # the doctor's
    assert good == [] and len(broken) == 1 and f"`git checkout -- {path}`" in broken[0]


def test_a_huge_file_is_refused_before_it_is_read(datadir, monkeypatch):
    path, _ = _huge(datadir)
    real_open = open

    def watching_open(file, *args, **kwargs):
        assert str(file) != str(path), "the 600 MiB file was opened"
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr("builtins.open", watching_open)
    with pytest.raises(record.ReplayFileError, match="600 MiB"):
        record.load_recorded(path)


def test_uncorrupted_copies_load_in_both_formats(datadir):
    for name in ("01_bandwidth", "03_plain_race", "00_tiny_copy"):
        _real_copy(datadir, name, as_recorded_now=True)
        assert record.load_recorded(name)["meta"]["name"] == name
        _real_copy(datadir, name, as_recorded_now=False)       # recorded before issue 19: no name, no schema
        assert "schema" not in record.load_recorded(name)["meta"]


def test_doctor_names_the_binary_file_and_the_checkout_fix(datadir, monkeypatch, capsys):
    """Binary garbage in 00_tiny_copy.json: the doctor's line says which file and `git checkout -- <file>`."""
    monkeypatch.setenv("PINLAB_FORCE_CPU", "1")
    path, _ = _binary(datadir)
    rep = pinlab.doctor()
    check = next(c for c in rep["checks"] if c["check"] == "recorded GPU run")
    assert check["ok"] is False and f"`git checkout -- {path}`" in check["note"]
    assert "make setup" not in capsys.readouterr().out


def test_solution_01_reads_the_recording_through_load_recorded(datadir, monkeypatch):
    """solutions/src/01 (and so exercises/01) reads 01_bandwidth.json with load_recorded: a truncated file is a
    ReplayFileError naming it, not a raw JSONDecodeError."""
    import nbtools

    cells = nbtools.parse_percent((record.repo_root() / "solutions" / "src" / "01_pinned_memory.py").read_text())
    cell = next(c["source"] for c in cells if c["cell_type"] == "code" and "01_bandwidth" in c["source"])
    assert "json.loads" not in cell and "load_recorded(" in cell
    path, what = _truncated(datadir)
    with pytest.raises(record.ReplayFileError) as info:
        exec(compile(cell, "solutions/src/01_pinned_memory.py", "exec"),
             {"ok_gbps": False, "ok_n_half": False, "pinlab": pinlab})
    _assert_one_sentence(info.value, path, what)


def test_checker_05_reads_the_recording_through_load_recorded(datadir):
    from nbtools import solution_namespace
    from pinlab.checks import l05

    path, stored = _real_copy(datadir, "05_restore")
    path.write_text(path.read_text()[:-40])
    l05.reset()
    with pytest.raises(record.ReplayFileError) as info:
        l05.check_pinned_footprint.verdict(solution_namespace("05_pinned_weight_restore")["pinned_footprint"])
    _assert_one_sentence(info.value, path, "is not valid JSON")


def _fake_gpu(monkeypatch):
    monkeypatch.setattr(record, "has_cuda", lambda: True)
    monkeypatch.setattr(record, "facts", lambda: {"gpu": "FakeGPU", "driver": None, "torch": "t",
                                                  "cuda_runtime": None, "flashinfer": None, "python": "3"})


def test_a_recording_names_its_experiment_and_structure_and_replays(datadir, monkeypatch):
    _fake_gpu(monkeypatch)
    monkeypatch.setenv("PINLAB_RECORD", "1")
    result = {"steps": 3, "rows": [{"a": 1.5, "b": None}, {"a": 2.0, "b": None}], "ok": True}
    pinlab.measure("x9", lambda n: result, quiet=True, n=1)
    stored = json.loads((datadir / "x9.json").read_text())
    assert stored["meta"]["name"] == "x9"
    assert stored["meta"]["schema"] == {"steps": "num", "rows": [2, {"a": "num", "b": "null"}], "ok": "bool"}
    assert not list(datadir.glob(".*.tmp"))
    monkeypatch.setattr(record, "has_cuda", lambda: False)
    assert pinlab.measure("x9", lambda n: 0, quiet=True, n=1).result == result
    stored["result"]["rows"][1]["a"] = "2.0"
    (datadir / "x9.json").write_text(json.dumps(stored))
    with pytest.raises(record.ReplayFileError, match=r"result\['rows'\] has another structure|result\['rows'\]"):
        pinlab.measure("x9", lambda n: 0, quiet=True, n=1)


@pytest.mark.parametrize("bad, what", [(float("nan"), "NaN"), (float("inf"), "infinity"), (-float("inf"), "infinity")])
def test_recording_refuses_what_a_replay_would_refuse(datadir, monkeypatch, bad, what):
    _fake_gpu(monkeypatch)
    monkeypatch.setenv("PINLAB_RECORD", "1")
    with pytest.raises(record.RecordingError, match=f"returned {what} at result\\['rows'\\]\\[1\\]"):
        pinlab.measure("x9", lambda: {"rows": [1.0, bad]}, quiet=True)
    assert not (datadir / "x9.json").exists()
    monkeypatch.delenv("PINLAB_RECORD")
    assert pinlab.measure("x9", lambda: {"rows": [1.0, bad]}, quiet=True).live  # shown live, not recorded


def test_schema_fingerprint_and_difference():
    s = record.result_schema([{"a": 1, "b": [1, 2.5]}, {"a": 2, "b": []}, "x"])
    assert s == [3, {"a": "num", "b": [2, "num"]}, {"a": "num", "b": [0]}, "str"]
    assert record.schema_difference(s, s) is None
    assert record.schema_difference({"a": "num"}, {}) == "result['a'] is missing"
    assert record.schema_difference({}, {"z": "num"}) == "result['z'] was not recorded"
    assert record.schema_difference({"a": [2, "num"]}, {"a": [2, "str"]}) == "result['a'][*] is a string, recorded as a number"
    assert record.schema_difference([2, "num"], {"a": "num"}) == "result is an object, recorded as a list"
    assert "not a fingerprint" in record.schema_difference([], [0])
    with pytest.raises(TypeError, match="value must be JSON data"):
        record.result_schema({"a": object()})


# ---- where the recordings are found, and never written ------------------------------------------------------

def _installed_copy(tmp_path, with_data=True):
    """pinlab as a wheel installs it: site/pinlab (no pyproject.toml above it), the recordings in pinlab/_recorded."""
    import shutil

    pkg = tmp_path / "site" / "pinlab"
    pkg.mkdir(parents=True)
    if with_data:
        shutil.copytree(REAL.parent, pkg / "_recorded", ignore=shutil.ignore_patterns("traces", "*.log"))
    return pkg


def test_data_dir_order(tmp_path, monkeypatch):
    monkeypatch.delenv("PINLAB_DATA_DIR", raising=False)
    root = record.repo_root()
    assert record.data_location() == (root / "reports" / "gpu" / "data", "checkout")   # this checkout
    monkeypatch.setenv("PINLAB_DATA_DIR", str(tmp_path))
    assert record.data_location() == (tmp_path, "env")
    monkeypatch.delenv("PINLAB_DATA_DIR")
    pkg = _installed_copy(tmp_path)
    monkeypatch.setattr(record, "PACKAGE_DIR", pkg)                # a non-editable install
    monkeypatch.chdir(root / "notebooks")                   # run inside a checkout: its recordings
    assert record.data_location() == (root / "reports" / "gpu" / "data", "cwd")
    assert record.repo_root() == root
    monkeypatch.chdir(tmp_path)                             # anywhere else: the wheel's copy
    assert record.data_location() == (pkg / "_recorded" / "data", "package")
    assert record.repo_root() == tmp_path                   # traces go here, never into the package
    not_course = tmp_path / "other"
    (not_course / ".git").mkdir(parents=True)
    monkeypatch.chdir(not_course)                           # a git checkout of something else
    assert record.data_location()[1] == "package"


def test_installed_copy_replays_and_refuses_to_record(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("PINLAB_DATA_DIR", raising=False)
    monkeypatch.setenv("PINLAB_FORCE_CPU", "1")
    pkg = _installed_copy(tmp_path)
    monkeypatch.setattr(record, "PACKAGE_DIR", pkg)
    monkeypatch.chdir(tmp_path)
    run = pinlab.measure("00_tiny_copy", lambda: 1, quiet=True)
    assert not run.live and run.result["median"] > 0
    rep = pinlab.doctor(verbose=False)
    check = next(c for c in rep["checks"] if c["check"] == "recorded GPU run")
    assert check["ok"] and rep["ok"]
    assert next(c for c in rep["checks"] if c["check"] == "GPU suite report")["ok"]
    (pkg / "_recorded" / "data" / "00_tiny_copy.json").write_text("{")
    with pytest.raises(record.ReplayFileError, match="reinstall pinlab"):
        pinlab.measure("00_tiny_copy", lambda: 1, quiet=True)
    # recording: never into the installed package
    _fake_gpu(monkeypatch)
    monkeypatch.setenv("PINLAB_RECORD", "1")
    before = sorted(p.name for p in (pkg / "_recorded" / "data").iterdir())
    with pytest.raises(record.RecordingError, match="inside an installed package"):
        pinlab.measure("x9", lambda: 1, quiet=True)
    assert sorted(p.name for p in (pkg / "_recorded" / "data").iterdir()) == before
    monkeypatch.setenv("PINLAB_DATA_DIR", str(tmp_path / "mine"))   # unless told where
    pinlab.measure("x9", lambda: 1, quiet=True)
    assert (tmp_path / "mine" / "x9.json").is_file()


def test_installed_copy_without_data_says_where_to_get_it(tmp_path, monkeypatch):
    monkeypatch.delenv("PINLAB_DATA_DIR", raising=False)
    monkeypatch.setenv("PINLAB_FORCE_CPU", "1")
    monkeypatch.setattr(record, "PACKAGE_DIR", _installed_copy(tmp_path, with_data=False))
    monkeypatch.chdir(tmp_path)
    assert record.data_location()[1] == "none"
    with pytest.raises(pinlab.ReplayMissingError, match="ships no recorded run: run the course from a git checkout"):
        pinlab.measure("00_tiny_copy", lambda: 1, quiet=True)


def test_recording_into_site_packages_is_refused(tmp_path, monkeypatch):
    import sysconfig

    monkeypatch.setenv("PINLAB_DATA_DIR", str(Path(sysconfig.get_paths()["purelib"]) / "reports"))
    with pytest.raises(record.RecordingError, match="inside an installed package"):
        record.record_dir()


@pytest.mark.parametrize("bad", [3, None, b"01_bandwidth", ["01_bandwidth"]])
def test_load_recorded_names_a_wrong_argument(bad):
    with pytest.raises(TypeError, match="path_or_name must be an experiment name or a path"):
        record.load_recorded(bad)


# ----------------------------------------------------------------- symbolic links and restore hints (issue 34)

def test_recording_does_not_write_through_a_symlink_planted_at_its_temporary_name(datadir, tmp_path_factory,
                                                                                    monkeypatch):
    """replay._record wrote to the fixed name `.<file>.tmp` and followed a symbolic link planted there, out of
    the data folder. It writes a fresh temporary file of its own (O_EXCL) and renames it over the recording."""
    monkeypatch.setattr(record, "has_cuda", lambda: True)
    monkeypatch.setattr(record, "facts", lambda: {"gpu": "G", "driver": None, "torch": "t",
                                                  "cuda_runtime": None, "flashinfer": None, "python": "3"})
    monkeypatch.setenv("PINLAB_RECORD", "1")
    outside = tmp_path_factory.mktemp("elsewhere") / "victim.txt"
    outside.write_text("not yours\n")
    (datadir / ".x7.json.tmp").symlink_to(outside)           # the name the old _record wrote to
    link_target = outside.with_name("linked.json")
    link_target.write_text("also not yours\n")
    (datadir / "x8.json").symlink_to(link_target)             # a link at the recording's own name
    pinlab.measure("x7", lambda: {"v": 1}, quiet=True)
    pinlab.measure("x8", lambda: {"v": 2}, quiet=True)
    assert outside.read_text() == "not yours\n" and link_target.read_text() == "also not yours\n"
    assert record.load_recorded(datadir / "x7.json")["result"] == {"v": 1}
    assert not (datadir / "x8.json").is_symlink() and record.load_recorded("x8")["result"] == {"v": 2}
    assert sorted(p.name for p in datadir.iterdir()) == [".x7.json.tmp", "x7.json", "x8.json"]  # no temporary left


def test_a_symlink_loop_in_the_data_folder_is_one_replay_file_error(datadir, monkeypatch):
    """A symbolic link loop under reports/gpu/data gave a raw RuntimeError ("Symlink loop from ...") from
    load_recorded, check_recorded and pinlab.doctor(): it is one ReplayFileError sentence naming the file."""
    monkeypatch.setenv("PINLAB_FORCE_CPU", "1")
    _store(datadir, "fine", {}, 1)
    (datadir / "a.json").symlink_to(datadir / "b.json")
    (datadir / "b.json").symlink_to(datadir / "a.json")
    (datadir / "self.json").symlink_to(datadir / "self.json")
    for name in ("a", "self"):
        with pytest.raises(record.ReplayFileError) as info:
            record.load_recorded(name)
        _assert_one_sentence(info.value, datadir / f"{name}.json", "is a symbolic link that loops")
    with pytest.raises(record.ReplayFileError, match="a symbolic link that loops"):
        pinlab.measure("a", lambda: 1)
    good, broken = record.check_recorded()
    assert good == ["fine"] and len(broken) == 3 and all("symbolic link that loops" in b for b in broken)
    rep = pinlab.doctor(verbose=False)
    check = next(c for c in rep["checks"] if c["check"] == "recorded GPU run")
    assert check["ok"] is False and "self.json is a symbolic link that loops" in check["note"]


@pytest.mark.parametrize("bad", ["", "  "])
def test_load_recorded_of_an_empty_name_suggests_no_checkout_of_everything(bad):
    """load_recorded('') said "restore it with `git checkout -- .`", which discards every change in the
    checkout: an empty name is a ValueError naming the argument."""
    with pytest.raises(ValueError, match="path_or_name must be an experiment name") as info:
        record.load_recorded(bad)
    assert "checkout" not in str(info.value)


def test_load_recorded_of_a_folder_suggests_no_checkout_of_it(tmp_path):
    with pytest.raises(record.ReplayFileError, match="is a folder, not a recording") as info:
        record.load_recorded(tmp_path)
    assert "checkout" not in str(info.value) and "an experiment's name" in str(info.value)


def test_a_deleted_recording_names_the_git_checkout_fix_and_the_gpu_suite(monkeypatch):
    """A deleted recording was told only "run the GPU suite"; it is also told the git command that restores it,
    the file named from the checkout's root (reports/gpu/data/<file>)."""
    monkeypatch.delenv("PINLAB_DATA_DIR", raising=False)
    monkeypatch.setenv("PINLAB_FORCE_CPU", "1")
    root = record.repo_root()
    assert (root / "reports" / "gpu" / "data").is_dir()
    fix = "`git checkout -- reports/gpu/data/99_deleted_recording.json`"
    with pytest.raises(pinlab.ReplayMissingError) as info:
        pinlab.measure("99_deleted_recording", lambda: 1)
    assert fix in str(info.value) and "make gpu-suite" in str(info.value), str(info.value)
    with pytest.raises(pinlab.ReplayMissingError) as info:
        record.load_recorded("99_deleted_recording")
    assert fix in str(info.value) and "make gpu-suite" in str(info.value), str(info.value)
    assert record.restore_command(root / "reports/gpu/data/x.json") == (
        f"`git checkout -- reports/gpu/data/x.json` (in {root})")


# ---- measure_if_recorded: a new experiment before its first GPU run (issue 33) ---------------------------

def test_measure_if_recorded_says_one_sentence_where_the_recording_is_missing(datadir, monkeypatch, capsys):
    monkeypatch.setenv("PINLAB_FORCE_CPU", "1")
    assert record.measure_if_recorded("absent_new", lambda: 1) is None
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith("[measured] source: no CUDA here, and 'absent_new' has no "
                                                    "recorded GPU run yet")
    _store(datadir, "x_par", {"n": 3}, 1)
    assert record.measure_if_recorded("x_par", lambda n: n, n=4) is None
    assert "'x_par' was recorded with other parameters" in capsys.readouterr().out


def test_measure_if_recorded_replays_what_exists_and_still_refuses_a_broken_file(datadir, monkeypatch, capsys):
    monkeypatch.setenv("PINLAB_FORCE_CPU", "1")
    _store(datadir, "x_ok", {"n": 3}, {"v": 1})
    run = record.measure_if_recorded("x_ok", lambda n: None, n=3)
    assert run is not None and run.result == {"v": 1} and not run.live
    (datadir / "x_bad.json").write_text("{not json")
    with pytest.raises(record.ReplayFileError, match="not valid JSON"):
        record.measure_if_recorded("x_bad", lambda: 1)


def test_measure_if_recorded_measures_live_on_cuda(datadir, monkeypatch):
    monkeypatch.setattr(record, "has_cuda", lambda: True)
    monkeypatch.setattr(record, "facts", lambda: {"gpu": "FakeGPU", "driver": None, "torch": "t",
                                                  "cuda_runtime": None, "flashinfer": None, "python": "3"})
    monkeypatch.delenv("PINLAB_RECORD", raising=False)
    run = record.measure_if_recorded("x_live", lambda n: {"n": n}, quiet=True, n=2)
    assert run.live and run.result == {"n": 2}
