"""pinlab.cuda_rules.CudaRules: on the emulated stream a learner's code meets CUDA's rules (issue 28)."""
import pytest
import torch

import pinlab
from pinlab.cuda_rules import PIN_ON_GPU_ERROR, CudaRules


def test_pinned_memory_on_the_gpu_is_refused_with_torchs_error():
    with pinlab.LaggingStream() as s, CudaRules(s):
        w = torch.ones(4, device=s.device)
        for make in (lambda: torch.empty_like(w, pin_memory=True), lambda: torch.zeros_like(w, pin_memory=True),
                     lambda: w.new_empty(4, pin_memory=True), lambda: torch.zeros(4, device=s.device, pin_memory=True),
                     lambda: torch.empty(4, device=w.device, pin_memory=True),
                     lambda: torch.ones(4, device="cuda", pin_memory=True)):
            with pytest.raises(RuntimeError, match=PIN_ON_GPU_ERROR):
                make()
        pinned = torch.empty_like(w, device="cpu", pin_memory=True)  # on the host: fine
        assert s.is_pinned(pinned) and not s.is_device(pinned)


def test_device_cpu_is_the_host_and_s_device_the_gpu():
    with pinlab.LaggingStream() as s, CudaRules(s):
        w = torch.arange(4, device=s.device)
        for host in (torch.empty_like(w, device="cpu"), torch.zeros(3, device=torch.device("cpu")),
                     torch.tensor([1, 2], device="cpu"), w.new_zeros(2, device="cpu")):
            assert not s.is_device(host) and not s.is_pinned(host)
        for dev in (torch.zeros(3, device=s.device), torch.empty_like(w), torch.arange(3, device=w.device)):
            assert s.is_device(dev)
        w.add_(1)                                       # queued on the emulated GPU
        read = torch.as_tensor(w, device="cpu")         # reads device data on the host: after the queue ran
        assert s.pending() == 0 and not s.is_device(read) and read.tolist() == [1, 2, 3, 4]


def test_torch_cuda_synchronize_waits_for_the_emulated_gpu_and_is_put_back():
    before = torch.cuda.synchronize
    with pinlab.LaggingStream() as s, CudaRules(s):
        d = torch.zeros(4, device=s.device)
        d.add_(1)
        assert s.pending() == 1
        torch.cuda.synchronize()
        assert s.pending() == 0
    assert torch.cuda.synchronize is before


def test_bad_stream_is_named():
    with pytest.raises(TypeError, match="stream must be a pinlab stream"):
        CudaRules(None)
    with pytest.raises(TypeError, match="stream must be a pinlab stream"):
        CudaRules("cuda")
