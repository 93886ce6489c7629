"""bench speed when cases fail: each child's stderr kept in logs/, the failure's cause line, the per-case timeout,
error rows that do not stop the sweep and are run again by a rerun, the run order, the command's exit status."""

from __future__ import annotations

import importlib.util
import json
import os
import time
from dataclasses import asdict
from pathlib import Path

import pytest
from typer.testing import CliRunner

from maskkv_cli.bench.cases import TAIL_LINES, BenchError, failure_cause, run_in_fresh_process
from maskkv_cli.bench.results import read_jsonl
from maskkv_cli.bench.speed import run_sweep
from maskkv_cli.bench.speed_report import table_rows
from maskkv_cli.bench.speed_settings import SpeedCase, SpeedSettings
from maskkv_cli.runtime import devices

TINY = dict(gen_length=16, steps=8, block_length=8, config="tiny", none_steps=2, limit=False)

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


def _row(case: SpeedCase, total: float) -> dict:
    """A made-up row of ``case`` with the fields the ratios, the table and the plot read."""
    return {"key": case.key(), "method": case.method, **asdict(case), "prefill_s": total / 10, "step_s": 0.01,
            "total_s": total, "tokens_per_s": 16 / total, "peak_mem_bytes": 2**20, "kv_bytes": 0, "limit_s": None}


def _runner(calls: list[SpeedCase], fails: set[tuple[int, str]]):
    def runner(case: SpeedCase) -> dict:
        calls.append(case)
        if (case.prompt_len, case.method) in fails:
            raise BenchError(f"case {case.method} at prompt {case.prompt_len} failed (exit code 1): RuntimeError: x",
                             ["Traceback (most recent call last):", "RuntimeError: x"], Path("logs/k.txt"))
        return _row(case, {"none": 8.0, "full": 4.0}.get(case.method, 2.0))

    return runner


def test_a_failed_case_leaves_an_error_row_the_sweep_goes_on_and_a_rerun_runs_it_again(tmp_path):
    settings = SpeedSettings(prompt_lengths=(32, 48), budgets=(8,), **TINY)
    calls: list[SpeedCase] = []
    folder, rows = run_sweep(settings, out=tmp_path, runner=_runner(calls, {(32, "full")}))
    assert len(calls) == 6 and [r["method"] for r in rows] == ["none", "full", "maskkv@8"] * 2
    failed = rows[1]
    assert failed["error"].endswith("RuntimeError: x") and failed["prompt_len"] == 32
    assert failed["stderr_tail"] == ["Traceback (most recent call last):", "RuntimeError: x"]
    assert failed["log"] == "logs/k.txt" and failed["key"] == calls[1].key() and "total_s" not in failed
    on_disk = read_jsonl(tmp_path / "results.jsonl")  # saved like any row, in the planned order
    assert [bool(r.get("error")) for r in on_disk] == [False, True, False, False, False, False]
    # no ratio against the failed case; the others keep theirs
    assert rows[2]["speedup_vs_full"] is None and rows[2]["speedup_vs_none"] == pytest.approx(4.0)
    assert rows[5]["speedup_vs_full"] == pytest.approx(2.0)
    head, body = table_rows(rows)
    cells = dict(zip(head, body[1], strict=True))
    assert cells["prompt"] == "32" and cells["method"] == "full" and cells["total s"] == "-"
    assert cells["note"].startswith("failed: case full at prompt 32 failed")
    summary = (tmp_path / "summary.md").read_text()
    assert "1 case(s) failed" in summary and "| 32 | full | - |" in summary

    again, rows2 = run_sweep(settings, out=tmp_path, runner=_runner(calls, set()))  # error rows are not reused
    assert [c.method for c in calls[6:]] == ["full"] and calls[6].prompt_len == 32
    assert again.reused == 5 and not any(r.get("error") for r in rows2)
    assert rows2[2]["speedup_vs_full"] == pytest.approx(2.0)


def test_a_case_failing_in_a_later_round_is_an_error_row_and_runs_no_more(tmp_path):
    settings = SpeedSettings(prompt_lengths=(32,), policies=("full", "maskkv"), budgets=(8,), repeats=3, **TINY)
    calls: list[SpeedCase] = []
    runs = iter([True, True, False])  # full: rounds 1 and 2 run, round 3 fails

    def runner(case: SpeedCase) -> dict:
        if case.method == "full" and not next(runs):
            calls.append(case)
            raise BenchError("case full at prompt 32 failed (exit code 1): RuntimeError: y")
        return _runner(calls, set())(case)

    _, rows = run_sweep(settings, out=tmp_path, runner=runner)
    assert [c.method for c in calls] == ["full", "maskkv@8"] * 3
    assert rows[0]["error"].endswith("RuntimeError: y (run 3 of 3)") and rows[0]["log"] is None
    assert rows[1]["repeats"] == 3 and rows[1]["speedup_vs_full"] is None

    settings = SpeedSettings(prompt_lengths=(48,), policies=("full", "maskkv"), budgets=(8,), repeats=3, **TINY)
    calls.clear()
    _, rows = run_sweep(settings, out=tmp_path / "first", runner=_runner(calls, {(48, "full")}))
    assert [c.method for c in calls] == ["full", "maskkv@8", "maskkv@8", "maskkv@8"]  # full not run again
    assert rows[0]["error"].endswith("(run 1 of 3)")


def test_longest_first_runs_the_longest_prompts_first_and_keeps_the_rows_ascending(tmp_path):
    settings = SpeedSettings(prompt_lengths=(32, 64, 48), budgets=(8,), **TINY)
    calls: list[SpeedCase] = []
    _, rows = run_sweep(settings, out=tmp_path / "a", runner=_runner(calls, set()), longest_first=True)
    assert [(c.prompt_len, c.method) for c in calls] == [
        (n, m) for n in (64, 48, 32) for m in ("none", "full", "maskkv@8")]
    assert [r["prompt_len"] for r in rows] == [32] * 3 + [48] * 3 + [64] * 3
    calls.clear()
    run_sweep(settings, out=tmp_path / "b", runner=_runner(calls, set()))  # the default: ascending
    assert [c.prompt_len for c in calls] == [32] * 3 + [48] * 3 + [64] * 3


def test_the_case_timeout_reaches_the_fresh_process_and_its_log(tmp_path):
    """A timeout shorter than importing torch: the real case process is killed, the row says so, the log is kept."""
    settings = SpeedSettings(prompt_lengths=(32,), policies=("full",), **TINY)
    folder, rows = run_sweep(settings, out=tmp_path, case_timeout=0.2)
    (row,) = rows
    assert "timed out after 0.2 s and was killed" in row["error"]
    assert row["log"] == str(tmp_path / "logs" / f"{row['key']}.txt") and Path(row["log"]).is_file()
    if importlib.util.find_spec("matplotlib") is not None:  # no finished case: no empty plot, a note says so
        assert not (folder.path / "speed.png").exists()
        assert "no case finished, so speed.png was not drawn" in (folder.path / "summary.md").read_text()


runner = CliRunner()
ARGS = ["bench", "speed", "--config", "tiny", "--prompt-lengths", "32", "--policies", "none,full,maskkv",
        "--budgets", "8", "--gen-length", "16", "--steps", "8", "--block-length", "8", "--none-steps", "2",
        "--no-limit", "--in-process"]


def test_cli_shows_the_finished_rows_then_exits_1_with_one_line(tmp_path, monkeypatch):
    from maskkv_cli.bench import speed
    from maskkv_cli.cli import app

    real = speed.run_case

    def run_case(case: SpeedCase) -> dict:
        if case.method == "full":
            raise BenchError("case full at prompt 32 failed (exit code 1): RuntimeError: z", [], tmp_path / "k.txt")
        return real(case)

    monkeypatch.setattr(speed, "run_case", run_case)
    result = runner.invoke(app, [*ARGS, "--out", str(tmp_path / "r")])
    assert result.exit_code == 1
    assert "maskkv@8" in result.stdout and "failed: case full" in result.stdout  # the table, with the failure
    last = result.stderr.strip().splitlines()[-1]
    assert last == (f"error: 1 of 3 cases failed; their stderr is in {tmp_path / 'r' / 'logs'}; rerun the same "
                    "command to run them again")
    assert "FAILED: case full at prompt 32" in result.stderr  # the progress line of the case
    result = runner.invoke(app, [*ARGS, "--out", str(tmp_path / "j"), "--json"])
    assert result.exit_code == 1
    data = json.loads(result.stdout)
    assert [bool(r.get("error")) for r in data["results"]] == [False, True, False]


def test_cli_case_timeout_defaults_and_checks(monkeypatch):
    from maskkv_cli.bench import speed
    from maskkv_cli.cli import app

    seen: list[dict] = []

    def fake_sweep(settings, out, fresh, **kwargs):
        seen.append(kwargs)
        return type("Folder", (), {"path": Path("x")})(), []

    monkeypatch.setattr(speed, "run_sweep", fake_sweep)
    monkeypatch.setattr(devices, "check_device", lambda name: name)  # no GPU here: --device cuda is taken as given
    base = ARGS[:-1]  # fresh processes
    for extra, want in (([], None), (["--device", "cuda"], 300.0), (["--device", "cuda", "--case-timeout", "0"], None),
                        (["--case-timeout", "12.5"], 12.5)):
        result = runner.invoke(app, [*base, *extra, "--json"])
        assert result.exit_code == 0, result.output
        assert seen[-1]["case_timeout"] == want and seen[-1]["longest_first"] is False
    runner.invoke(app, [*base, "--longest-first", "--json"])
    assert seen[-1]["longest_first"] is True
    result = runner.invoke(app, [*ARGS, "--case-timeout", "10"])
    assert result.exit_code == 2 and "--case-timeout needs fresh processes" in result.output
    result = runner.invoke(app, [*base, "--case-timeout", "-1"])
    assert result.exit_code == 2 and "--case-timeout must be 0" in result.output


def test_in_process_a_failing_case_is_an_error_row_too(tmp_path, monkeypatch):
    """``--in-process``: a case raising (here a made-up out-of-memory error) leaves its error row, with the
    exception's first line, and the sweep goes on, as a case's own process failing does."""
    import maskkv_cli.bench.speed as speed

    calls: list[SpeedCase] = []

    def run_case(case: SpeedCase) -> dict:
        calls.append(case)
        if case.method == "full":
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\nsee the docs")
        return _row(case, 2.0)

    monkeypatch.setattr(speed, "run_case", run_case)
    settings = SpeedSettings(prompt_lengths=(32,), budgets=(8,), **TINY)
    _, rows = run_sweep(settings, out=tmp_path, isolate=False)
    assert [r["method"] for r in rows] == ["none", "full", "maskkv@8"] and len(calls) == 3
    assert rows[1]["error"] == ("case full at prompt 32 failed: RuntimeError: CUDA out of memory. Tried to allocate "
                                "2.00 GiB")
    assert not rows[0].get("error") and not rows[2].get("error")


@pytest.mark.parametrize("args", [
    ["bench", "memory", "--config", "tiny", "--threads", "0"],
    ["bench", "memory", "--config", "tiny", "--block-length", "0"],
    ["bench", "memory", "--config", "tiny", "--block-length", "3", "-n", "8"],
    ["bench", "loading", "--config", "tiny", "--threads", "0"],
    ["bench", "reuse", "--config", "llada2-small", "--threads", "0"],
    ["bench", "speed", "--config", "tiny", "--prompt-lengths", ""],
    ["bench", "quality", "--lengths", ""],
    ["demo", "--length", "0"],
])
def test_bad_bench_and_demo_numbers_are_one_line_usage_errors(tmp_path, args) -> None:
    """Each gave a raw error (set_num_threads' RuntimeError, the task builder's ValueError), was accepted (a block
    length of 0 or one that does not divide the length) or ran the default sweep (an empty list); bench memory also
    left an empty results folder behind."""
    from typer.testing import CliRunner

    from maskkv_cli.cli import app

    out = tmp_path / "out"
    extra = ["--out", str(out)] if args[0] == "bench" and args[1] != "reuse" else []
    result = CliRunner().invoke(app, [*args, *extra])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and "Error" not in lines[-1] and "Traceback" not in result.output
    assert not out.exists()
