"""CPU tests for pinlab.h2d: the staging logic, argument checks, and (marked gpu) the real copies."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from pinlab.args import CudaUnavailableError
from pinlab.h2d import (
    EMPTY_COPY,
    PIN_MEMORY,
    async_tensor_h2d,
    cuda_device,
    pin_snapshot,
    snapshot_method,
    stage_on_host,
)

# --- snapshot_method: the pin_memory() trap -----------------------------------------------------


@pytest.mark.parametrize("pinned,contiguous,expected", [
    (False, True, PIN_MEMORY),     # pageable, contiguous: pin_memory() makes a new pinned copy
    (True, True, EMPTY_COPY),      # pinned: pin_memory() would return the same storage
    (False, False, EMPTY_COPY),    # non-contiguous: pin_memory() would keep the strides
    (True, False, EMPTY_COPY),
])
def test_snapshot_method(pinned, contiguous, expected):
    assert snapshot_method(pinned, contiguous) == expected


def test_snapshot_method_bad_arguments():
    with pytest.raises(TypeError, match="is_pinned must be a bool"):
        snapshot_method(1, True)
    with pytest.raises(TypeError, match="is_contiguous must be a bool"):
        snapshot_method(False, None)


# --- stage_on_host, in pageable memory (the pinned path runs in the gpu tests) ---------------------


def test_stage_list_and_tuple():
    t = stage_on_host([[1, 2, 3], [4, 5, 6]], pin_memory=False)
    assert t.dtype == torch.int64 and t.shape == (2, 3) and t.is_contiguous()
    assert t.tolist() == [[1, 2, 3], [4, 5, 6]]
    t = stage_on_host((1, 2), torch.float16, pin_memory=False)
    assert t.dtype == torch.float16 and t.tolist() == [1.0, 2.0]
    assert stage_on_host([], pin_memory=False).shape == (0,)


def test_stage_numpy_is_a_fresh_copy():
    a = np.arange(6, dtype=np.int32).reshape(2, 3)
    t = stage_on_host(a, pin_memory=False)
    assert t.dtype == torch.int32 and t.tolist() == a.tolist()
    a[0, 0] = 99
    assert t[0, 0].item() == 0  # not a view of the array


def test_stage_numpy_odd_layouts():
    a = np.arange(12, dtype=np.float64).reshape(3, 4)
    rev = a[::-1, ::2]  # negative strides: torch.from_numpy alone refuses them
    t = stage_on_host(rev, torch.float32, pin_memory=False)
    assert t.dtype == torch.float32 and t.is_contiguous() and t.tolist() == rev.tolist()
    ro = np.arange(4, dtype=np.int64)
    ro.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "non-writable array" warning
        assert stage_on_host(ro, pin_memory=False).tolist() == [0, 1, 2, 3]
    with pytest.raises(TypeError, match="data: numpy dtype object"):
        stage_on_host(np.array([object()]), pin_memory=False)


def test_stage_tensor_fresh_contiguous_converted():
    x = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    t = stage_on_host(x, pin_memory=False)
    assert t.data_ptr() != x.data_ptr() and torch.equal(t, x)
    view = x.t()[:, ::2]
    t = stage_on_host(view, pin_memory=False)
    assert t.is_contiguous() and torch.equal(t, view)
    t = stage_on_host(x, torch.int32, pin_memory=False)
    assert t.dtype == torch.int32 and torch.equal(t, x.to(torch.int32))
    x[0, 0] = 42
    assert t[0, 0].item() == 0


def test_stage_bad_arguments():
    with pytest.raises(TypeError, match="data must be a Python list, a numpy array or a CPU torch.Tensor"):
        stage_on_host({"a": 1}, pin_memory=False)
    with pytest.raises(TypeError, match="data must be"):
        stage_on_host(3, pin_memory=False)
    with pytest.raises(ValueError, match="data is already on meta"):
        stage_on_host(torch.empty(2, device="meta"), pin_memory=False)
    with pytest.raises(TypeError, match="dtype must be None or a torch.dtype"):
        stage_on_host([1], "float32", pin_memory=False)
    with pytest.raises(TypeError, match="pin_memory must be a bool"):
        stage_on_host([1], pin_memory=1)


# --- cuda_device ------------------------------------------------------------------------------


@pytest.mark.parametrize("device,expected", [
    ("cuda", torch.device("cuda")),
    ("cuda:1", torch.device("cuda", 1)),
    (0, torch.device("cuda", 0)),
    (torch.device("cuda", 2), torch.device("cuda", 2)),
])
def test_cuda_device(device, expected):
    assert cuda_device(device) == expected


@pytest.mark.parametrize("device,error,match", [
    ("cpu", ValueError, "device must be a CUDA device"),
    ("meta", ValueError, "device must be a CUDA device"),
    (torch.device("cpu"), ValueError, "device must be a CUDA device"),
    ("banana", ValueError, "device must be a CUDA device"),
    (-1, ValueError, "device must be a CUDA device"),
    (True, TypeError, "device must be a CUDA device"),
    (1.0, TypeError, "device must be a CUDA device"),
    (None, TypeError, "device must be a CUDA device"),
])
def test_cuda_device_rejects(device, error, match):
    with pytest.raises(error, match=match):
        cuda_device(device)


# --- async_tensor_h2d / pin_snapshot: checks that run before CUDA is needed ----------------------


@pytest.mark.parametrize("kwargs,error,match", [
    ({"data": 5}, TypeError, "data must be a Python list"),
    ({"data": "abc"}, TypeError, "data must be a Python list"),
    ({"data": {1: 2}}, TypeError, "data must be a Python list"),
    ({"data": torch.empty(2, device="meta")}, ValueError, "data is already on meta"),
    ({"data": [1], "dtype": "int32"}, TypeError, "dtype must be None or a torch.dtype"),
    ({"data": [1], "device": "cpu"}, ValueError, "device must be a CUDA device"),
    ({"data": [1], "device": 1.5}, TypeError, "device must be a CUDA device"),
])
def test_async_tensor_h2d_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        async_tensor_h2d(**kwargs)


def test_async_tensor_h2d_without_cuda(monkeypatch):
    monkeypatch.setenv("PINLAB_FORCE_CPU", "1")
    with pytest.raises(CudaUnavailableError, match=r"^async_tensor_h2d needs a CUDA GPU"):
        async_tensor_h2d([1, 2, 3])
    with pytest.raises(CudaUnavailableError, match=r"^async_tensor_h2d needs a CUDA GPU"):
        async_tensor_h2d(np.ones(3), torch.float16, "cuda:0")


def test_pin_snapshot_bad_arguments(monkeypatch):
    with pytest.raises(TypeError, match="t must be a CPU torch.Tensor"):
        pin_snapshot([1, 2])
    with pytest.raises(ValueError, match="t must be a CPU tensor"):
        pin_snapshot(torch.empty(2, device="meta"))
    monkeypatch.setenv("PINLAB_FORCE_CPU", "1")
    with pytest.raises(CudaUnavailableError, match=r"^pin_snapshot needs a CUDA GPU"):
        pin_snapshot(torch.ones(2))


# --- on the emulated stream (CPU): pin_snapshot's pinned-input path, without a GPU -----------------


def test_pin_snapshot_of_pinned_memory_is_a_new_storage_on_the_emulated_stream():
    from pinlab.streams import LaggingStream

    with LaggingStream():
        pinned = torch.arange(16, dtype=torch.float32).pin_memory()
        assert pinned.pin_memory().data_ptr() == pinned.data_ptr()  # the trap, emulated as torch does it
        for src in (pinned, pinned[:4], pinned[4:]):
            snap = pin_snapshot(src)
            assert snap.is_pinned() and snap.is_contiguous()
            assert snap.untyped_storage().data_ptr() != pinned.untyped_storage().data_ptr()
            assert torch.equal(snap, src)
        snap = pin_snapshot(pinned[:4])
        pinned[0] = -1.0  # the host reuses its buffer: the snapshot must not change
        assert snap[0].item() == 0.0


def test_pin_snapshot_of_pageable_and_strided_on_the_emulated_stream():
    from pinlab.streams import LaggingStream

    with LaggingStream():
        pageable = torch.arange(16, dtype=torch.float32)
        snap = pin_snapshot(pageable)
        assert snap.is_pinned() and torch.equal(snap, pageable) and snap.data_ptr() != pageable.data_ptr()
        view = pageable.reshape(4, 4)[:, ::2]
        snap = pin_snapshot(view)
        assert snap.is_pinned() and snap.is_contiguous() and torch.equal(snap, view)


def test_async_tensor_h2d_on_the_emulated_stream():
    from pinlab.streams import LaggingStream

    with LaggingStream() as s:
        host = torch.arange(6, dtype=torch.int32)
        out = async_tensor_h2d(host, torch.int64)
        host.fill_(-1)  # staged into a private block: the copy still delivers the old values
        assert s.is_device(out) and out.dtype == torch.int64 and out.tolist() == list(range(6))


# --- on a real GPU -------------------------------------------------------------------------------


@pytest.mark.parametrize("data,dtype,expected", [
    ([1, 2, 3], None, torch.tensor([1, 2, 3])),
    ([1, 2, 3], torch.int32, torch.tensor([1, 2, 3], dtype=torch.int32)),
    (np.arange(4, dtype=np.float32), None, torch.arange(4, dtype=torch.float32)),
    (torch.arange(8).reshape(2, 4).t(), torch.float16, torch.arange(8).reshape(2, 4).t().half()),
])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_async_tensor_h2d(data, dtype, expected):
    out = async_tensor_h2d(data, dtype)
    torch.cuda.synchronize()
    assert out.device.type == "cuda" and out.dtype == expected.dtype
    assert torch.equal(out.cpu(), expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_async_tensor_h2d_causes_no_stall():
    from pinlab.detector import detect_stalls

    host = torch.arange(1024, dtype=torch.int32)
    with detect_stalls() as report:
        async_tensor_h2d(host)
        async_tensor_h2d(host.numpy())
        async_tensor_h2d(list(range(100)), torch.int64)
        async_tensor_h2d(host.pin_memory())
    torch.cuda.synchronize()
    assert report.total == 0, report.summary()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_stage_on_host_pins():
    x = torch.arange(6)
    t = stage_on_host(x)
    assert t.is_pinned() and t.data_ptr() != x.data_ptr()
    assert stage_on_host([1, 2]).is_pinned()
    pinned = torch.arange(6).pin_memory()
    assert stage_on_host(pinned) is pinned  # vLLM: a pinned contiguous tensor is used as is
    assert stage_on_host(pinned, torch.int32).data_ptr() != pinned.data_ptr()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_pin_snapshot_and_the_trap():
    pinned = torch.arange(16, dtype=torch.float32).pin_memory()
    # the trap: pin_memory() of pinned memory (or a view of it) is the same storage
    assert pinned.pin_memory().data_ptr() == pinned.data_ptr()
    assert pinned[:4].pin_memory().data_ptr() == pinned.data_ptr()
    snap = pin_snapshot(pinned[:4])
    assert snap.is_pinned() and snap.data_ptr() != pinned.data_ptr()
    pinned[0] = -1.0
    assert snap[0].item() == 0.0
    pageable = torch.arange(16, dtype=torch.float32)
    snap = pin_snapshot(pageable)
    assert snap.is_pinned() and torch.equal(snap, pageable) and snap.data_ptr() != pageable.data_ptr()
    view = pageable.reshape(4, 4)[:, ::2]
    snap = pin_snapshot(view)
    assert snap.is_pinned() and snap.is_contiguous() and torch.equal(snap, view)
    assert not view.pin_memory().is_contiguous()  # why pin_snapshot does not use pin_memory() here
