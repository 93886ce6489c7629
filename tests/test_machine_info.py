"""machine_info: what a results folder records about the machine; the CUDA fields only where CUDA is."""

from __future__ import annotations

import torch

from maskkv_cli.runtime import devices
from maskkv_cli.runtime.devices import machine_info

CPU_FIELDS = {"platform", "python", "torch", "cpu", "cpu_count", "torch_threads"}
CUDA_FIELDS = {"gpu", "cuda", "cudnn", "tf32_matmul", "tf32_cudnn"}


def test_without_cuda_only_the_cpu_fields(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    info = machine_info()
    assert set(info) == CPU_FIELDS
    assert info["torch"] == torch.__version__ and info["torch_threads"] == torch.get_num_threads()


def test_with_cuda_the_libraries_and_tf32_flags(monkeypatch):
    """The CUDA branch run on this CPU machine with the device name faked (no GPU here): it records the CUDA
    runtime and cuDNN versions (None on a CPU build) and the two TF32 flags as they are set."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "Fake GPU")
    # the TF32 flags are properties of torch's backend modules (monkeypatch cannot undo them): set and restore
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        for flags in ((True, False), (False, True)):
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags
            info = machine_info()
            assert set(info) == CPU_FIELDS | CUDA_FIELDS and info["gpu"] == "Fake GPU"
            assert info["cuda"] == torch.version.cuda and info["cudnn"] == torch.backends.cudnn.version()
            assert (info["tf32_matmul"], info["tf32_cudnn"]) == flags
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


def test_a_reading_that_fails_is_none_not_an_error(monkeypatch):
    def broken() -> int:
        raise RuntimeError("no cuDNN in this build")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "Fake GPU")
    monkeypatch.setattr(torch.backends.cudnn, "version", broken)
    info = devices.machine_info()
    assert info["cudnn"] is None and info["tf32_matmul"] in (True, False)
