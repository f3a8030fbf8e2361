"""Lesson 08's experiments (issue 21) on the emulated stream: the race under graph replay and its fixes."""
import pytest
import torch

import pinlab
from pinlab.lessons import l08_cuda_graphs as l08


@pytest.mark.parametrize("variant", list(l08.VARIANTS))
def test_racy_variants_read_another_steps_data_and_the_fixes_never(variant):
    run = l08.graph_loop(variant, steps=50, n_ints=8, stream=pinlab.LaggingStream())
    assert run["emulated"] and len(run["received"]) == 50
    if variant in l08.RACY:
        assert run["corrupted"] >= 49, run["received"]   # every step but the last reads a later write
        assert run["received"][-1] == 49
    else:
        assert run["corrupted"] == 0 and run["received"] == list(range(50))


def test_a_ring_of_one_slot_per_graph_is_correct_at_any_depth():
    for depth in (1, 2, 5):
        run = l08.graph_loop("ring_graphs", steps=20, ring_depth=depth, stream=pinlab.LaggingStream())
        assert run["corrupted"] == 0


@pytest.mark.parametrize("variant", list(l08.VARIANTS))
def test_six_tensors_per_step_race_or_not_as_one(variant):
    run = l08.graph_loop(variant, steps=30, tensors=6, n_ints=4, stream=pinlab.LaggingStream())
    assert (run["corrupted"] >= 29) if variant in l08.RACY else (run["received"] == list(range(30)))


def test_every_variant_runs_the_same_loop():
    res = l08.every_variant(steps=10, stream=pinlab.LaggingStream())
    assert [r["variant"] for r in res["rows"]] == list(l08.VARIANTS)
    assert {r["variant"] for r in res["rows"] if r["corrupted"]} == set(l08.RACY)


@pytest.mark.parametrize("kwargs, match", [
    ({"variant": "graph"}, "variant must be one of"),
    ({"variant": "ring_graphs", "steps": 0}, "steps"),
    ({"variant": "ring_graphs", "ring_depth": 0}, "ring_depth"),
    ({"variant": "ring_graphs", "busy_ms": -1.0}, "busy_ms"),
])
def test_bad_arguments_name_themselves(kwargs, match):
    with pytest.raises((TypeError, ValueError), match=match):
        l08.graph_loop(stream=pinlab.LaggingStream(), **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_host_cost_and_staging_cost_need_cuda():
    with pytest.raises(pinlab.CudaUnavailableError, match="host_cost"):
        l08.host_cost()
    with pytest.raises(pinlab.CudaUnavailableError, match="staging_cost"):
        l08.staging_cost()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_the_race_under_replay_and_its_fixes():
    """On the GPU with a wide lead: the racy variants corrupt (nearly) every step, the fixes none."""
    for variant in l08.VARIANTS:
        l08.graph_loop(variant, steps=5)                                  # warm-up
        run = l08.graph_loop(variant, steps=200, tensors=6, busy_ms=0.5)
        if variant in l08.RACY:
            assert run["corrupted"] >= 190, (variant, run["corrupted"])
        else:
            assert run["corrupted"] == 0, (variant, run["received"][:20])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_staging_cost_rows():
    res = l08.staging_cost(rounds=2, steps=20)
    assert [r["variant"] for r in res["rows"]] == list(l08.VARIANTS)
    assert all(r["host_us"] > 0 and len(r["round_medians_us"]) == 2 for r in res["rows"])
