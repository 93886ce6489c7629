"""What this machine is and which device a run uses: a leaf (torch is imported only inside the functions, so
``maskkv --help`` stays light)."""

from __future__ import annotations

import os
import platform
from typing import Any

__all__ = ["machine_info", "resolve_device"]


def resolve_device(device: str) -> str:
    """``auto``: ``cuda`` when a GPU is available, else ``cpu``; any other name as given. Every part of a run (the
    session, the live panel's memory reading, the harness adapter, batch workers) takes its device from here, so
    they agree."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


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
