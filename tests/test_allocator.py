"""The start-up allocator setting (``runtime/allocator.py``): applied on import, off with MASKKV_MALLOC=default."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from maskkv_cli.runtime import allocator

GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"

# What both probes start with, in a fresh interpreter: maskkv imported, and glibc's malloc, free and mallinfo2
# (hblkhd: the bytes in mmap-backed blocks).
HEADER = r"""
import ctypes, json, sys
import maskkv_cli
from maskkv_cli.runtime import allocator

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = MallInfo2


def mapped(size):
    before = libc.mallinfo2().hblkhd
    block = libc.malloc(size)
    grown = libc.mallinfo2().hblkhd - before
    libc.free(block)
    return grown
"""
# Free a block of argv[1] bytes (glibc's dynamic threshold would rise to its size), then allocate one of argv[2]
# bytes and report how much of it was served by mmap (0: the heap).
PROBE = HEADER + r"""
freed, asked = int(sys.argv[1]), int(sys.argv[2])
libc.free(libc.malloc(freed))
print(json.dumps({"mmapped": mapped(asked), "state": allocator.state()}))
"""


MIB = 1 << 20
FIXED = (f"mmap threshold fixed at {allocator.MMAP_THRESHOLD} bytes; "
         f"trim threshold fixed at {allocator.TRIM_THRESHOLD} bytes")


def _run(script: str, *args: str, **env: str) -> dict[str, object]:
    """``script`` in a fresh interpreter with ``args``, with none of the allocator variables set but ``env``; the JSON
    object it prints last."""
    full_env = {k: v for k, v in os.environ.items() if k != allocator.ENV and not k.startswith("MALLOC_")}
    full_env.update(env)
    out = subprocess.run([sys.executable, "-c", script, *args], env=full_env, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _probe(freed: int, asked: int, **env: str) -> dict[str, object]:
    return _run(PROBE, str(freed), str(asked), **env)


@pytest.mark.skipif(not GLIBC, reason="the setting exists only with glibc on Linux")
def test_import_fixes_the_mmap_threshold() -> None:
    assert allocator.MMAP_THRESHOLD == 4 * MIB
    big = _probe(16 * MIB, 6 * MIB)
    assert big["state"] == FIXED
    assert big["mmapped"] >= 6 * MIB  # its own mapping despite the earlier 16 MiB free: the threshold did not rise
    small = _probe(16 * MIB, 1 * MIB)
    assert small["mmapped"] == 0  # below the threshold: from the heap (no fresh pages to fault in)


@pytest.mark.skipif(not GLIBC, reason="the setting exists only with glibc on Linux")
def test_env_switch_leaves_glibc_dynamic_threshold() -> None:
    result = _probe(16 * MIB, 6 * MIB, **{allocator.ENV: "default"})
    assert result["state"] == f"unchanged ({allocator.ENV}=default)"
    assert result["mmapped"] == 0  # the threshold rose to 16 MiB, so 6 MiB came from the heap


@pytest.mark.skipif(not GLIBC, reason="the setting exists only with glibc on Linux")
def test_glibc_variables_are_the_users_choice() -> None:
    """A threshold set through glibc's own variable stays as the user set it; the other one is still fixed."""
    result = _probe(MIB, 512 << 10, MALLOC_MMAP_THRESHOLD_=str(256 << 10))
    assert result["state"] == (f"mmap threshold left to MALLOC_MMAP_THRESHOLD_; "
                               f"trim threshold fixed at {allocator.TRIM_THRESHOLD} bytes")
    assert result["mmapped"] >= 512 << 10  # the user's 256 KiB threshold, not ours


# Allocate argv[1] bytes in 1 MiB blocks (each from the heap), free them all, and report the heap's size at the start,
# before the frees and after them (arena: the bytes the heap holds from the kernel; a trim gives its free top back).
HELD = HEADER + r"""
total = int(sys.argv[1])
start = libc.mallinfo2().arena
blocks = [libc.malloc(1 << 20) for _ in range(total >> 20)]
before = libc.mallinfo2().arena
for block in blocks:
    libc.free(block)
print(json.dumps({"start": start, "before": before, "after": libc.mallinfo2().arena}))
"""


@pytest.mark.skipif(not GLIBC, reason="the setting exists only with glibc on Linux")
def test_the_heap_keeps_a_freed_batch_of_small_blocks() -> None:
    """A batch's small blocks (caches, activations under the mmap threshold), 40 MiB of them freed at once as its
    requests end, stay with the heap for the next batch instead of being trimmed and faulted in again; with a trim
    threshold of 8 MiB (twice the mmap threshold) they go back to the kernel."""
    assert allocator.TRIM_THRESHOLD == 64 * MIB
    kept = _run(HELD, str(40 * MIB))
    assert kept["before"] >= kept["start"] + 32 * MIB  # the heap grew by most of the 40 MiB (it had some free)
    assert kept["after"] >= kept["start"] + 32 * MIB
    trimmed = _run(HELD, str(40 * MIB), MALLOC_TRIM_THRESHOLD_=str(8 * MIB))
    assert trimmed["after"] < trimmed["start"] + 8 * MIB


RELEASED = HELD.replace("print(", """released = allocator.release_free_memory()
print(""").replace('"after": libc.mallinfo2().arena', '"after": libc.mallinfo2().arena, "released": released')


@pytest.mark.skipif(not GLIBC, reason="the setting exists only with glibc on Linux")
def test_release_free_memory_gives_the_held_blocks_back() -> None:
    """What a benchmark calls before its baseline reading (``runtime.stats.settle_memory``): the heap's free memory
    goes back to the kernel, so the baseline is the memory in use."""
    got = _run(RELEASED, str(40 * MIB))
    assert got["released"] is True
    assert got["before"] >= got["start"] + 32 * MIB
    assert got["after"] < got["start"] + 8 * MIB


def test_settle_memory_collects_unreachable_cycles(no_cycle_collector: None) -> None:
    """A tensor kept only by a reference cycle (the frames of a generation stopped by an exception) is freed before
    a baseline reading, not at the collector's next run."""
    import weakref

    import torch

    from maskkv_cli.runtime.stats import settle_memory

    class Holder:
        pass

    held = Holder()
    held.cycle = held  # type: ignore[attr-defined]
    held.tensor = torch.zeros(4)  # type: ignore[attr-defined]
    ref = weakref.ref(held)
    del held
    assert ref() is not None  # unreachable, but only the cycle collector frees it
    settle_memory("cpu")
    assert ref() is None


MAPPED_INSIDE = HEADER + r"""
with allocator.small_blocks_mapped():
    inside = mapped(512 << 10)
print(json.dumps({"inside": inside, "after": mapped(512 << 10)}))
"""


@pytest.mark.skipif(not GLIBC, reason="the setting exists only with glibc on Linux")
def test_small_blocks_are_mapped_inside_the_block_only() -> None:
    result = _run(MAPPED_INSIDE)
    assert result["inside"] >= 512 << 10 and result["after"] == 0


def test_nothing_on_other_platforms() -> None:
    assert allocator.configure({}, "darwin") == "unchanged (not Linux: darwin)"
    assert allocator.configure({allocator.ENV: "Default"}, "linux") == f"unchanged ({allocator.ENV}=default)"


def test_importing_the_command_line_configures() -> None:
    """A fresh interpreter that imports only the command line (as the ``maskkv`` entry point does, before ``main``
    runs) has configured the allocator, as ``configure`` decides for that environment (the switch set: left
    alone)."""
    code = ("import maskkv_cli.cli; from maskkv_cli.runtime import allocator; print(allocator.state())")
    env = {**os.environ, allocator.ENV: "default"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == f"unchanged ({allocator.ENV}=default)"
