"""What this machine is and which device a run uses: a leaf (torch is imported only inside the functions, so
``maskkv --help`` stays light)."""

from __future__ import annotations

import os
import platform
from typing import Any

from maskkv_cli.errors import UsageError

__all__ = ["check_device", "machine_info", "resolve_device"]


def resolve_device(device: str) -> str:
    """``auto``: ``cuda`` when a GPU is available, else ``cpu``; any other name as given, once ``check_device``
    has found it on this machine. Every part of a run (the session, the live panel's memory reading, the harness
    adapter, batch workers) takes its device from here, so they agree."""
    import torch

    if device != "auto":
        return check_device(device)
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(device: str) -> str:
    """``device`` as given when this PyTorch can run on it; else a ``UsageError`` saying why in one line (a name
    torch does not know, CUDA or MPS absent, a GPU index past the last), before anything is loaded onto it."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise UsageError(f"unknown device {device!r}; use auto, cpu, cuda, cuda:N or mps") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
            raise UsageError(f"device {device}: PyTorch {torch.__version__} ({build}) finds no CUDA GPU on this "
                             "machine; use cpu or auto")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise UsageError(f"device {device}: this machine has {count} CUDA GPU{'s' if count != 1 else ''} "
                             f"(cuda:0 to cuda:{count - 1})")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise UsageError(f"device {device}: MPS (Apple's GPU) is not available here; use cpu or auto")
    elif dev.type not in ("cpu", "cuda", "mps"):
        raise UsageError(f"device {device}: maskkv runs on cpu, cuda or mps")
    return device


def machine_info() -> dict[str, Any]:
    """Where the numbers come from: CPU, threads, torch version, and with a GPU its name and the CUDA libraries'
    settings that change GPU timings (``_cuda_info``). A machine without CUDA gets exactly the CPU fields."""
    import torch

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info.update(_cuda_info())
    return info


def _cuda_info() -> dict[str, Any]:
    """The CUDA runtime torch was built with, the cuDNN version, and whether TF32 may replace fp32 in matrix
    products and in cuDNN (fp32 timings differ several-fold with it). Each reading that fails is None: describing
    the machine must never stop a run."""
    import torch

    readings = {
        "cuda": lambda: torch.version.cuda,
        "cudnn": torch.backends.cudnn.version,
        "tf32_matmul": lambda: bool(torch.backends.cuda.matmul.allow_tf32),
        "tf32_cudnn": lambda: bool(torch.backends.cudnn.allow_tf32),
    }
    info: dict[str, Any] = {}
    for name, read in readings.items():
        try:
            info[name] = read()
        except Exception:  # a build without the library, or an API that moved: unknown, not fatal
            info[name] = None
    return info


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
