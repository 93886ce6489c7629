"""Keep freed memory inside the process during CPU training.

PyTorch's CPU tensors come from ``malloc``. glibc serves requests above its mmap threshold (128 KiB, rising to at
most 32 MiB) with ``mmap`` and unmaps them when they are freed, so every training step gets its activations as fresh
pages and the kernel zero-fills each one again on first touch. On the 2-core machines this project trains on, that
kernel work was a third of a step (docs/tiny-model.md, "Training speed"). Serving every request from the heap and
never trimming it keeps those pages mapped from one step to the next; the process then holds its peak footprint
until it exits.
"""

from __future__ import annotations

import ctypes
import sys

# mallopt parameters from glibc's malloc.h
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to serve every allocation from its heap and never return freed memory to the kernel.

    Returns whether both settings took; False off Linux or off glibc, where nothing is changed.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1)) and bool(mallopt(M_MMAP_MAX, 0))
