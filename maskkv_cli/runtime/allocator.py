"""A fixed mmap threshold for glibc's malloc, set once at start-up (Linux with glibc only).

By default glibc raises its mmap threshold each time a large mmap-backed block is freed (up to 32 MiB on 64-bit).
After the first big activation of a prefill is freed, later activations below the new threshold come from the
heap, and freed heap memory mostly stays resident: a process keeps hundreds of MiB it no longer uses and its
peak resident set depends on the order of earlier allocations. A fixed threshold (``mallopt(M_MMAP_THRESHOLD,
...)``, which also turns the dynamic adjustment off) serves every block of at least ``MMAP_THRESHOLD`` bytes
with its own mapping, returned to the kernel as soon as it is freed. See docs/performance.md for the effect.

``MASKKV_MALLOC=default`` leaves the allocator as it is. Nothing is done on other platforms or C libraries.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
from collections.abc import Mapping

M_MMAP_THRESHOLD = -3  # mallopt parameter number in glibc's malloc.h
MMAP_THRESHOLD = 128 * 1024  # bytes: glibc's own starting value, kept fixed from now on
ENV = "MASKKV_MALLOC"

_state: str | None = None


def _glibc() -> ctypes.CDLL | None:
    """The running process's C library when it is glibc, else None."""
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt  # noqa: B018  (raises AttributeError when the symbol is missing)
    except (OSError, AttributeError):
        return None
    return libc


def configure(env: Mapping[str, str] | None = None, system: str | None = None) -> str:
    """Set the fixed mmap threshold unless told not to; returns what was done, in words.

    ``env`` (default ``os.environ``) and ``system`` (default ``sys.platform``) are parameters so that tests can
    check each branch; the module-level call in ``maskkv_cli/__init__.py`` uses the defaults.
    """
    env = os.environ if env is None else env
    system = sys.platform if system is None else system
    if env.get(ENV, "").strip().lower() == "default":
        return f"unchanged ({ENV}=default)"
    if not system.startswith("linux"):
        return f"unchanged (not Linux: {system})"
    libc = _glibc()
    if libc is None:
        return "unchanged (the C library is not glibc)"
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    if libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1:
        return "unchanged (mallopt refused the setting)"
    return f"mmap threshold fixed at {MMAP_THRESHOLD} bytes"


def configure_once() -> str:
    """``configure()`` the first time it is called in this process; later calls return the first result."""
    global _state
    if _state is None:
        _state = configure()
    return _state


def state() -> str | None:
    """What ``configure_once`` did in this process (None when it has not run)."""
    return _state
