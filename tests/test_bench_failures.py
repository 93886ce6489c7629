"""bench cases in fresh processes when they fail: each child's stderr kept in a log, the failure's cause line, the
timeout that kills a hung case."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from maskkv_cli.bench.cases import TAIL_LINES, BenchError, failure_cause, run_in_fresh_process

CUDA_TAIL = [
    "Traceback (most recent call last):",
    '  File "x.py", line 1, in <module>',
    "RuntimeError: CUDA error: an illegal memory access was encountered",
    "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be "
    "incorrect.",
    "For debugging consider passing CUDA_LAUNCH_BLOCKING=1",
    "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.",
    "",
]


def test_failure_cause_is_the_exception_line_not_the_hints_below_it():
    assert failure_cause(CUDA_TAIL) == "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert failure_cause(["loading", "torch.OutOfMemoryError: CUDA out of memory.", "hint"]).startswith(
        "torch.OutOfMemoryError")
    assert failure_cause(["something odd", "last words", " "]) == "last words"  # no exception line: the last one
    assert failure_cause([]) == "no output"


def _child_module(folder: Path, monkeypatch: pytest.MonkeyPatch, name: str, body: str) -> str:
    """A module ``name`` in ``folder`` that the fresh process can run with ``-m`` (``folder`` on its path)."""
    (folder / f"{name}.py").write_text(body)
    monkeypatch.setenv("PYTHONPATH", str(folder))
    return name


def test_a_crashing_child_leaves_its_stderr_in_the_log_and_its_cause_in_the_error(tmp_path, monkeypatch):
    body = ("import sys\n"
            "for i in range(40):\n"
            "    print(f'progress {i}', file=sys.stderr)\n"
            f"print({chr(10).join(CUDA_TAIL)!r}, file=sys.stderr)\n"
            "sys.exit(1)\n")
    module = _child_module(tmp_path, monkeypatch, "crashing_case", body)
    log = tmp_path / "logs" / "k.txt"
    with pytest.raises(BenchError) as info:
        run_in_fresh_process(module, "{}", 1, "case full at prompt 32", log=log)
    exc = info.value
    message = str(exc)
    assert "\n" not in message and message.startswith("case full at prompt 32 failed (exit code 1): ")
    assert "RuntimeError: CUDA error: an illegal memory access was encountered" in message
    assert message.endswith(f"stderr in {log}") and exc.log == log
    text = log.read_text()
    assert "progress 0" in text and "progress 39" in text and "TORCH_USE_CUDA_DSA" in text  # the whole stderr
    assert len(exc.tail) == TAIL_LINES and exc.tail[-1].startswith("Compile with")  # the last lines, the cause in
    assert "RuntimeError: CUDA error: an illegal memory access was encountered" in exc.tail


def test_a_child_past_its_timeout_is_killed_and_says_so(tmp_path, monkeypatch):
    pid_file = tmp_path / "pid"
    body = ("import os, sys, time\n"
            f"open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
            "print('started, now hanging', file=sys.stderr, flush=True)\n"
            "time.sleep(120)\n")
    module = _child_module(tmp_path, monkeypatch, "hanging_case", body)
    log = tmp_path / "hang.txt"
    t0 = time.monotonic()
    with pytest.raises(BenchError, match=r"^case x timed out after 3 s and was killed; stderr in ") as info:
        run_in_fresh_process(module, "{}", 1, "case x", timeout=3, log=log)
    assert time.monotonic() - t0 < 60
    assert info.value.tail == ["started, now hanging"] and "now hanging" in log.read_text()
    with pytest.raises(ProcessLookupError):  # killed and reaped: no such process any more
        os.kill(int(pid_file.read_text()), 0)
