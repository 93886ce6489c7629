"""Fixed mmap and trim thresholds for glibc's malloc, set once at start-up (Linux with glibc only).

glibc serves a block of at least its mmap threshold with its own mapping, given back to the kernel on ``free``, and
smaller blocks from its heap, whose free top it returns to the kernel past the trim threshold. By default the mmap
threshold starts at 128 KiB and rises to the size of every mmap-backed block that is freed (up to 32 MiB, the trim
threshold following at twice that): after the first big activation of a prefill is freed, later ones come from the
heap, a process keeps up to hundreds of MiB it no longer uses, and its peak resident set depends on the order of
earlier allocations. Fixed thresholds (``mallopt``, which also turns that adjustment off) keep the peak the same
from run to run. The values trade the two costs:

- ``MMAP_THRESHOLD`` (4 MiB): a block this large or larger gets its own mapping, freed at once. Below it, blocks are
  reused from the heap: a mapped block costs the kernel a zero-filled page fault on every first touch, each time
  it is allocated, which is most of an elementwise operation's time on a block of a few hundred KiB (a tiny
  model's activations, a batch's steps). At 128 KiB that cost made the embedded model's joined prefills 1.6-2.0x
  slower (docs/performance.md, "The allocator"). A quantized load maps smaller blocks too while it runs
  (``small_blocks_mapped``).
- ``TRIM_THRESHOLD`` (64 MiB, the most glibc's own adjustment would raise it to): the heap keeps this much free
  memory at its top instead of giving it back and faulting it in again at the next request. A batch's caches and
  activations under 4 MiB a block are all freed when its requests end; at 8 MiB (twice the mmap threshold) the heap
  was trimmed after many groups of the embedded model's batch bench and faulted in again by the next, which cost
  1-4% of a group's time against its limit line (docs/performance.md, "The allocator").

``MASKKV_MALLOC=default`` leaves the allocator as it is; a ``MALLOC_MMAP_THRESHOLD_`` or ``MALLOC_TRIM_THRESHOLD_``
in the environment is the user's own setting, which glibc applied at start-up: that parameter is left alone.
Nothing is done on other platforms or C libraries.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

M_TRIM_THRESHOLD = -1  # mallopt parameter numbers in glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 4 * 1024 * 1024  # bytes
TRIM_THRESHOLD = 64 * 1024 * 1024  # bytes
LOAD_THRESHOLD = 128 * 1024  # bytes: the mmap threshold while quantized weights load (``small_blocks_mapped``)
ENV = "MASKKV_MALLOC"
# (glibc's environment variable, mallopt parameter, value), in the order they are set
SETTINGS = (("MALLOC_MMAP_THRESHOLD_", M_MMAP_THRESHOLD, MMAP_THRESHOLD),
            ("MALLOC_TRIM_THRESHOLD_", M_TRIM_THRESHOLD, TRIM_THRESHOLD))

_state: str | None = None
_mmap_fixed = False  # whether ``configure`` set the mmap threshold in this process


def glibc() -> ctypes.CDLL | None:
    """The running process's C library when it is glibc on Linux (its ``mallopt(int, int) -> int`` typed), else
    None."""
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]  # AttributeError when the symbol is missing
        libc.mallopt.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


def configure(env: Mapping[str, str] | None = None, system: str | None = None) -> str:
    """Set the fixed thresholds unless told not to; returns what was done, in words.

    ``env`` (default ``os.environ``) and ``system`` (default ``sys.platform``) are parameters so that tests can
    check each branch; the module-level call in ``maskkv_cli/__init__.py`` uses the defaults.
    """
    env = os.environ if env is None else env
    system = sys.platform if system is None else system
    if env.get(ENV, "").strip().lower() == "default":
        return f"unchanged ({ENV}=default)"
    if not system.startswith("linux"):
        return f"unchanged (not Linux: {system})"
    global _mmap_fixed
    libc = glibc()
    if libc is None:
        return "unchanged (the C library is not glibc)"
    done: list[str] = []
    for variable, param, value in SETTINGS:
        name = variable.removeprefix("MALLOC_").removesuffix("_").lower().replace("_", " ")
        if variable in env:
            done.append(f"{name} left to {variable}")
        elif libc.mallopt(param, value) != 1:
            done.append(f"{name} unchanged (mallopt refused it)")
        else:
            done.append(f"{name} fixed at {value} bytes")
            _mmap_fixed = _mmap_fixed or param == M_MMAP_THRESHOLD
    return "; ".join(done)


@contextmanager
def small_blocks_mapped(threshold: int = LOAD_THRESHOLD) -> Iterator[None]:
    """Inside the block, every block of ``threshold`` bytes or more gets its own mapping; after it, the start-up
    threshold again. For a quantized load (``models/loading.py``): each layer's full-precision copy is freed right
    after it is quantized, and from the heap, copies of layers under 4 MiB stayed as holes between the weights kept
    (a model of 56 MiB in fp32, layers of 0.25-1 MiB, peaked 81 MB above its start against 27 MB for its quantized
    weights and one shard); mapped, each goes back to the kernel when it is freed. Nothing changes where the
    start-up call did not fix the mmap threshold (another platform, ``MASKKV_MALLOC=default``, the user's own
    ``MALLOC_MMAP_THRESHOLD_``)."""
    libc = glibc() if _mmap_fixed else None
    if libc is None:
        yield
        return
    libc.mallopt(M_MMAP_THRESHOLD, threshold)
    try:
        yield
    finally:
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)


def release_free_memory() -> bool:
    """Give the heap's free memory back to the kernel now (glibc's ``malloc_trim(0)``), so that the resident set is
    the memory in use: a benchmark takes its baseline after it, since up to ``TRIM_THRESHOLD`` of freed blocks would
    otherwise sit in the baseline and be reused by the run it measures. Returns False where there is no glibc."""
    libc = glibc()
    if libc is None:
        return False
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.malloc_trim.restype = ctypes.c_int
    libc.malloc_trim(0)
    return True


def configure_once() -> str:
    """``configure()`` the first time it is called in this process; later calls return the first result."""
    global _state
    if _state is None:
        _state = configure()
    return _state


def state() -> str | None:
    """What ``configure_once`` did in this process (None when it has not run)."""
    return _state
