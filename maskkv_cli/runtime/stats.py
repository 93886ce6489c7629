"""Timers with device synchronisation, memory readings, and the run statistics as plain data."""

from __future__ import annotations

import gc
import os
import resource
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from maskkv_cli.runtime.allocator import release_free_memory


def sync(device: torch.device | str) -> None:
    """Wait for queued device work so that a clock read means something."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    elif dev.type == "mps":
        torch.mps.synchronize()


def now(device: torch.device | str) -> float:
    sync(device)
    return time.perf_counter()


def rss_bytes() -> int:
    """Current resident set size of this process (0 where it cannot be read)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def peak_rss_bytes() -> int:
    """Peak resident set size of this process: Linux's VmHWM, since the start or the last ``reset_peak``; elsewhere
    ``getrusage``'s, since the start. (On Linux ``getrusage`` also keeps the resident set a process had before its
    exec, which a reset does not clear: a fresh process started from a larger one would read its parent's size.)"""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _cuda_devices(device: torch.device | str | list[torch.device]) -> list[torch.device]:
    devices = [torch.device(d) for d in (device if isinstance(device, list) else [device])]
    return list(dict.fromkeys(d for d in devices if d.type == "cuda"))


def memory_now(device: torch.device | str | list[torch.device]) -> tuple[int, int, str]:
    """(current, peak, what) bytes: CUDA allocator figures on a GPU (summed over the CUDA devices of a list, e.g.
    a model's ``layer_devices``), process RSS otherwise."""
    return (current_memory(device), *peak_memory(device))


def current_memory(device: torch.device | str | list[torch.device]) -> int:
    """``memory_now``'s current figure alone."""
    cuda = _cuda_devices(device)
    return sum(torch.cuda.memory_allocated(d) for d in cuda) if cuda else rss_bytes()


_readings = threading.local()  # this thread's shared peak readings (``one_peak_reading``), where it holds some


@contextmanager
def one_peak_reading() -> Iterator[None]:
    """Within this block this thread's ``peak_memory`` of the same devices reads the peak once and gives that reading
    again: the generations that end in one round of a batch report the peak of that moment, read once instead of
    once each (reading Linux's VmHWM takes tens of microseconds). Nested blocks share the outermost one's."""
    outer = getattr(_readings, "held", None)
    if outer is None:
        _readings.held = {}
    try:
        yield
    finally:
        if outer is None:
            _readings.held = None


def peak_memory(device: torch.device | str | list[torch.device]) -> tuple[int, str]:
    """(peak, what): ``memory_now``'s peak alone, without reading the current figure."""
    held: dict[object, tuple[int, str]] | None = getattr(_readings, "held", None)
    key = tuple(device) if isinstance(device, list) else device
    if held is not None and key in held:
        return held[key]
    cuda = _cuda_devices(device)
    reading = (sum(torch.cuda.max_memory_allocated(d) for d in cuda), "cuda") if cuda else (peak_rss_bytes(), "rss")
    if held is not None:
        held[key] = reading
    return reading


def free_unreachable() -> None:
    """Free the memory that only unreachable reference cycles still hold, and give CUDA's cached blocks back to the
    device. A generation stopped or failed by an exception is such a cycle: the error's traceback holds the frames
    it passed through, their callers and their local variables (the generation, its prompt cache), and the
    generation holds the error; without a collection it stays until the cycle collector's next full run."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # does nothing where CUDA was never initialised


def settle_memory(device: torch.device | str) -> None:
    """Before a baseline reading, so that the current figure is the memory in use and the peak above it counts what
    the measured run adds: unreachable reference cycles are collected (a generation stopped by an exception, as the
    benchmarks' warm-ups stop theirs, leaves its frames, and the tensors they hold, in cycles with the traceback:
    on llada-small 42 MiB after a stopped 1k prefill, 157 MiB after 8), then, on the CPU, the heap's free memory goes
    back to the kernel (``allocator.release_free_memory``; the heap keeps up to 64 MiB of freed blocks otherwise)."""
    gc.collect()
    if torch.device(device).type == "cpu":
        release_free_memory()


def reset_peak(device: torch.device | str) -> bool:
    """Start a fresh peak: CUDA allocator stats, or the kernel's peak RSS (Linux ``clear_refs``).

    Returns False when the CPU peak could not be reset (it then counts from the process start).
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
        return True
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def read_current(device: torch.device | str) -> int:
    """Bytes in use now (``memory_now``'s first figure)."""
    return int(current_memory(device))


def read_peak(device: torch.device | str) -> int:
    """Peak bytes since the last ``reset_peak`` (``memory_now``'s second figure)."""
    return int(peak_memory(device)[0])


def reset_cuda_peaks(devices: list[torch.device], shared: bool = False) -> None:
    """Start the CUDA peak over again on these devices (a generation reports its own peak, not the process's);
    nothing for other devices (the CPU figure is the process's peak resident set), and nothing inside
    ``shared_cuda_peak``, whose generations overlap, unless ``shared`` (the batch's own restart)."""
    if getattr(_readings, "shared", False) and not shared:
        return
    for d in dict.fromkeys(torch.device(d) for d in devices):
        if d.type == "cuda":
            torch.cuda.reset_peak_memory_stats(d)


@contextmanager
def shared_cuda_peak(devices: list[torch.device]) -> Iterator[None]:
    """Generations that run together (a batch, ``sampling/stream.py``): the CUDA peak starts over here (and where
    the batch restarts it, ``reset_cuda_peaks(..., shared=True)``, when none is running), and no generation that
    starts inside restarts it, so each reports the peak of the generations running with it since the batch (re)began
    (one starting later would otherwise wipe out the peak of those already running)."""
    if getattr(_readings, "shared", False):
        yield
        return
    reset_cuda_peaks(devices)
    _readings.shared = True
    try:
        yield
    finally:
        _readings.shared = False


def model_devices(model: Any) -> list[torch.device]:
    """Every device the model's layers sit on (``layer_devices`` under a device map), else its one device."""
    return list(getattr(model, "layer_devices", None) or [model.device])


@dataclass
class RunStats:
    policy: str
    prompt_len: int
    gen_length: int
    steps_run: int = 0
    prefill_s: float = 0.0
    step_s: list[float] = field(default_factory=list)
    total_s: float = 0.0
    peak_mem_bytes: int = 0
    mem_kind: str = "rss"
    kv_entries: int = 0  # logical prompt (key, value) pairs kept, over layers, heads and batch
    kv_bytes: int = 0  # physical resident bytes of the prompt part of the cache
    kv_full_bytes: int = 0  # what the full prompt cache would take
    setup_s: float = 0.0  # one-time step compilation / CUDA-graph capture, kept out of prefill_s and total_s
    step_mode: str = "eager"
    weights_bytes: int = 0  # the loaded model's parameters and buffers as held (quantized ones packed)
    quantization: str = "none"  # its weights' quantization: none, int8, int4 (models/quantize.py)

    @property
    def median_step_s(self) -> float:
        if not self.step_s:
            return 0.0
        s = sorted(self.step_s)
        mid = len(s) // 2
        return s[mid] if len(s) % 2 else 0.5 * (s[mid - 1] + s[mid])

    @property
    def tokens_per_s(self) -> float:
        return self.gen_length / self.total_s if self.total_s > 0 else 0.0

    @property
    def compression(self) -> float:
        return self.kv_full_bytes / self.kv_bytes if self.kv_bytes else 1.0

    def as_dict(self) -> dict[str, Any]:
        """Every field (``dataclasses.asdict``'s dict: plain values, the step times a copy) and the figures derived
        from them, built field by field (asdict walks every step time through its recursive copy)."""
        d = {name: getattr(self, name) for name in _RUN_STATS_FIELDS}
        d["step_s"] = list(self.step_s)
        d["median_step_s"] = self.median_step_s
        d["tokens_per_s"] = self.tokens_per_s
        d["compression"] = self.compression
        return d


_RUN_STATS_FIELDS = tuple(f.name for f in fields(RunStats))
