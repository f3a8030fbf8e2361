"""CPU tests for lesson 03's experiments (pinlab.lessons.l03_the_race): CUDA is required unless a
stream is given, arguments are checked first, the experiments run on the emulated lagging stream,
and the plots draw from their results."""
from __future__ import annotations

import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

import pinlab  # noqa: E402
from pinlab import CudaUnavailableError  # noqa: E402
from pinlab.lessons import l03_the_race as l03  # noqa: E402

SMALL_DECODE = dict(steps=16, max_batch=6, page_size=8, max_seq_len=64, num_qo_heads=4, num_kv_heads=2,
                    head_dim=16, seed=2)


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setenv("PINLAB_FORCE_CPU", "1")


@pytest.mark.parametrize("name,call", [
    ("plain_race()", lambda: l03.plain_race()),
    ("pageable_cost()", lambda: l03.pageable_cost()),
    ("decode_race()", lambda: l03.decode_race()),
], ids=["plain_race", "pageable_cost", "decode_race"])
def test_experiments_need_cuda_without_a_stream(no_cuda, name, call):
    with pytest.raises(CudaUnavailableError, match=name.replace("(", r"\(").replace(")", r"\)")):
        call()


def test_arguments_are_checked_before_cuda(no_cuda):
    with pytest.raises(ValueError, match="strategies"):
        l03.plain_race(strategies=["nope"])
    with pytest.raises(ValueError, match="multiple of 4"):
        l03.plain_race(nbytes=10)
    with pytest.raises(ValueError, match="busy_ms"):
        l03.plain_race(busy_ms=0)
    with pytest.raises(TypeError, match="steps"):
        l03.plain_race(steps=1.5)
    with pytest.raises(ValueError, match="ahead"):
        l03.plain_race(ahead=0)
    with pytest.raises(ValueError, match="repeat"):
        l03.plain_race(strategies=["pageable", "pageable"])
    with pytest.raises(TypeError, match="strategies"):
        l03.plain_race(strategies="pageable")
    with pytest.raises(ValueError, match="ring"):
        l03.decode_race(ring=2, ahead=3)
    with pytest.raises(ValueError, match="backend"):
        l03.decode_race(backend="triton")
    with pytest.raises(ValueError, match="multiple"):
        l03.decode_race(num_qo_heads=6, num_kv_heads=4)
    with pytest.raises(ValueError, match="no_copy"):
        l03.decode_race(strategies=["no_copy"])
    with pytest.raises(ValueError, match="sizes"):
        l03.pageable_cost(sizes=[])
    with pytest.raises(TypeError, match="sizes"):
        l03.pageable_cost(sizes=4096)
    with pytest.raises(TypeError, match="pinlab stream"):
        l03.plain_race(stream="cuda")


def test_plain_race_on_the_lagging_stream():
    res = l03.plain_race(strategies=["reused_pinned", "pageable"], steps=40, nbytes=256, busy_ms=0.5,
                         stream=pinlab.LaggingStream())
    pinned, pageable = res["runs"]["reused_pinned"], res["runs"]["pageable"]
    # the emulated GPU runs nothing until the end: every copy reads what the host wrote last
    assert pinned["received"] == [39] * 40 and pinned["corrupted"] == 39 and pinned["first_corrupted"] == 0
    assert pageable["corrupted"] == 0 and pageable["received"] == list(range(40))
    assert set(res) == {"steps", "nbytes", "busy_ms", "ahead", "runs"}
    json.dumps(res)


def test_pageable_cost_on_the_lagging_stream():
    pc = l03.pageable_cost(sizes=[1024, 4096], steps=10, busy_ms=0.5, stream=pinlab.LaggingStream())
    assert pc["sizes"] == [1024, 4096] and [r["nbytes"] for r in pc["runs"]] == [1024, 4096]
    assert all(r["corrupted"] == 0 and len(r["host_us"]) == 10 and "received" not in r for r in pc["runs"])
    json.dumps(pc)


def test_decode_race_on_the_lagging_stream():
    res = l03.decode_race(strategies=["reused_pinned", "pageable"], stream=pinlab.LaggingStream(), **SMALL_DECODE)
    assert res["backend"] == "torch" and "emulated" in res["fallback_reason"] and res["jit_s"] is None
    bad, good = res["runs"]["reused_pinned"], res["runs"]["pageable"]
    assert bad["copies_wrong"] >= 1 and bad["wrong_input_steps"] >= 1
    assert good["copies_wrong"] == 0 and good["wrong_input_steps"] == 0 and good["max_err_right_inputs"] <= res["tol"]
    json.dumps(res)


def test_plots_draw_from_results():
    s = pinlab.LaggingStream()
    runs = l03.plain_race(strategies=["reused_pinned", "pageable"], steps=12, nbytes=16, stream=s)["runs"]
    l03.plot_received(runs, title="t")
    l03.plot_errors(l03.decode_race(strategies=["reused_pinned"], stream=s, **SMALL_DECODE), "reused_pinned", title="t")
    l03.plot_host_cumulative(l03.pageable_cost(sizes=[1024], steps=5, stream=s), title="t")
    plt.close("all")
    with pytest.raises(TypeError):
        l03.plot_received({}, title="t")
