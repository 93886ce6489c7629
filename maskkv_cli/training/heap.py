"""Keep freed memory inside the process during CPU training.

PyTorch's CPU tensors come from ``malloc``. glibc serves requests above its mmap threshold (fixed at 4 MiB when
maskkv is imported, ``runtime/allocator.py``) with ``mmap`` and unmaps them when they are freed, so every training
step gets its large activations as fresh pages and the kernel zero-fills each one again on first touch. On the
2-core machines this project trains on, that kernel work was a third of a step (docs/tiny-model.md, "Training
speed"). Serving every request from the heap and never trimming it keeps those pages mapped from one step to the
next; the process then holds its peak footprint until it exits.
"""

from __future__ import annotations

from maskkv_cli.runtime.allocator import M_TRIM_THRESHOLD, glibc

M_MMAP_MAX = -4  # mallopt parameter number in glibc's malloc.h


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to serve every allocation from its heap and never return freed memory to the kernel.

    Returns whether both settings took; False off Linux or off glibc, where nothing is changed.
    """
    libc = glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1)) and bool(libc.mallopt(M_MMAP_MAX, 0))
