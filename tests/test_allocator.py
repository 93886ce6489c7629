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

# Run in a fresh interpreter: free a 1 MiB block (glibc's dynamic threshold would rise to 1 MiB), then allocate
# 512 KiB and report whether it was served by mmap (mallinfo2's hblkhd grows) or from the heap.
PROBE = r"""
import ctypes, json
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
libc.free(libc.malloc(1 << 20))
before = libc.mallinfo2().hblkhd
block = libc.malloc(512 << 10)
after = libc.mallinfo2().hblkhd
libc.free(block)
print(json.dumps({"mmapped": after - before, "state": allocator.state()}))
"""


def _probe(**env: str) -> dict[str, object]:
    full_env = {k: v for k, v in os.environ.items() if k != allocator.ENV and not k.startswith("MALLOC_")}
    full_env.update(env)
    out = subprocess.run([sys.executable, "-c", PROBE], env=full_env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not GLIBC, reason="the setting exists only with glibc on Linux")
def test_import_fixes_the_mmap_threshold() -> None:
    result = _probe()
    assert result["state"] == f"mmap threshold fixed at {allocator.MMAP_THRESHOLD} bytes"
    assert result["mmapped"] >= 512 << 10  # served by its own mapping despite the earlier 1 MiB free


@pytest.mark.skipif(not GLIBC, reason="the setting exists only with glibc on Linux")
def test_env_switch_leaves_glibc_dynamic_threshold() -> None:
    result = _probe(**{allocator.ENV: "default"})
    assert result["state"] == f"unchanged ({allocator.ENV}=default)"
    assert result["mmapped"] == 0  # the threshold rose to 1 MiB, so 512 KiB came from the heap


def test_nothing_on_other_platforms() -> None:
    assert allocator.configure({}, "darwin") == "unchanged (not Linux: darwin)"
    assert allocator.configure({allocator.ENV: "Default"}, "linux") == f"unchanged ({allocator.ENV}=default)"


def test_cli_entry_point_configures() -> None:
    """A fresh interpreter that imports only the command line has configured the allocator, as ``configure``
    decides for that environment (the switch set: left alone)."""
    code = ("import maskkv_cli.cli; from maskkv_cli.runtime import allocator; print(allocator.state())")
    env = {**os.environ, allocator.ENV: "default"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == f"unchanged ({allocator.ENV}=default)"
