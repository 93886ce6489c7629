"""``maskkv bench speed``: no cache vs full cache vs MaskKV budgets over prompt lengths, in one run: the sweep.

Every case (``bench/speed_settings.py``) runs in a fresh process (``bench/speed_case.py``), round by round when it
repeats, into a results folder that a rerun reuses; the rows get their ratios (against ``none``, ``full`` and batch
size 1 of the same run) and the report (``bench/speed_report.py``).

A case that fails (its process crashed, ran out of memory or ran past ``case_timeout``) does not stop the sweep: it
leaves an error row (its one-line cause, the last lines of its stderr, the path of its whole stderr in
``logs/<key>.txt``), saved like any row, and the sweep goes on. Error rows get no ratios, are no one's reference and
are never reused: a rerun runs their cases again.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

from maskkv_cli.bench.cases import BenchError
from maskkv_cli.bench.results import ResultsFolder
from maskkv_cli.bench.speed_case import run_case, run_case_subprocess
from maskkv_cli.bench.speed_report import summary_markdown, write_plot
from maskkv_cli.bench.speed_settings import SpeedCase, SpeedSettings


def _ratio(reference: float | None, value: float | None) -> float | None:
    """``reference / value`` (a time ratio: above 1, ``value`` is faster), None when either is missing or 0."""
    return reference / value if reference and value else None


def _median_of(row: dict[str, Any], part: str) -> float | None:
    """The median of a row's ``part`` ("step", "prefill") seconds over its runs, else its own figure."""
    runs = row.get(f"{part}_s_runs")
    return statistics.median(runs) if runs else row.get(f"{part}_s")


def add_ratios(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Speedups over ``none`` and ``full`` at the same prompt length, batch size and weight quantization, tokens/s
    over batch size 1's of the same method and prompt length, the quantized rows' speedups over the unquantized
    run of the same case (end to end, the median step, the prefill; all in the same run), and measured / limit."""
    by_len: dict[tuple[int, int, str], dict[str, dict[str, Any]]] = {}
    for row in rows:
        if row.get("error"):  # a failed case has no times: it is no one's reference
            continue
        by_len.setdefault((row["prompt_len"], row.get("batch_size", 1), row.get("quantize", "none")),
                          {})[row["method"]] = row
    out = []
    for row in rows:
        row = dict(row)
        if row.get("error"):
            out.append(row)
            continue
        quantize = row.get("quantize", "none")
        peers = by_len[(row["prompt_len"], row.get("batch_size", 1), quantize)]
        for ref in ("none", "full"):
            other = peers.get(ref)
            row[f"speedup_vs_{ref}"] = (other["total_s"] / row["total_s"]
                                        if other and row["total_s"] > 0 else None)
        if quantize != "none":
            plain = by_len.get((row["prompt_len"], row.get("batch_size", 1), "none"), {}).get(row["method"], {})
            row["speedup_vs_unquantized"] = _ratio(plain.get("total_s"), row["total_s"])
            for part in ("step", "prefill"):  # each the median over its runs (a repeated case's), then the ratio
                row[f"{part}_speedup_vs_unquantized"] = _ratio(_median_of(plain, part), _median_of(row, part))
                ours, theirs = row.get(f"{part}_s_runs"), plain.get(f"{part}_s_runs")
                if ours and theirs and len(ours) == len(theirs):  # round by round: the runs side by side in time
                    row[f"{part}_speedup_vs_unquantized_runs"] = [a / b for a, b in zip(theirs, ours, strict=True)]
        single = by_len.get((row["prompt_len"], 1, quantize), {}).get(row["method"])
        row["speedup_vs_batch1"] = (row["tokens_per_s"] / single["tokens_per_s"]
                                    if single and single["tokens_per_s"] > 0 else None)
        runs, single_runs = row.get("tokens_per_s_runs"), (single or {}).get("tokens_per_s_runs")
        if runs and single_runs and len(runs) == len(single_runs) and row.get("batch_size", 1) > 1:
            row["speedup_vs_batch1_runs"] = [b / a for a, b in zip(single_runs, runs, strict=True)]
        lim = row.get("limit_s")
        row["measured_over_limit"] = row["total_s"] / lim if lim else None
        out.append(row)
    return out


def median_row(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Of several runs of one case, the run with the median end-to-end time (the lower middle of an even count:
    every figure of a row comes from one run), with every run's total time and tokens/s in run order."""
    order = sorted(range(len(runs)), key=lambda i: runs[i]["total_s"])
    row = dict(runs[order[(len(runs) - 1) // 2]])
    row["repeats"] = len(runs)
    row["total_s_runs"] = [r["total_s"] for r in runs]
    row["tokens_per_s_runs"] = [r["tokens_per_s"] for r in runs]
    row["step_s_runs"] = [r["step_s"] for r in runs]
    row["prefill_s_runs"] = [r["prefill_s"] for r in runs]
    return row


def error_row(case: SpeedCase, exc: BenchError) -> dict[str, Any]:
    """The row a failed case leaves: its settings, the one-line cause, the last lines of its stderr and the file
    holding all of it (None when the runner kept none)."""
    return {"key": case.key(), "method": case.method, **asdict(case), "error": str(exc), "stderr_tail": exc.tail,
            "log": None if exc.log is None else str(exc.log), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def keep_going(run: Callable[[SpeedCase], dict[str, Any]]) -> Callable[[SpeedCase], dict[str, Any]]:
    """``run``, except that a case failing with ``BenchError`` returns its ``error_row`` instead of raising, so
    that one case cannot stop the sweep."""

    def run_or_error(case: SpeedCase) -> dict[str, Any]:
        try:
            return run(case)
        except BenchError as exc:
            return error_row(case, exc)

    return run_or_error


def in_this_process(run: Callable[[SpeedCase], dict[str, Any]]) -> Callable[[SpeedCase], dict[str, Any]]:
    """``run`` in this process (``--in-process``), a case's failure (out of memory, a step mode its model refuses,
    any error) turned into the ``BenchError`` its own process would have ended with, and the memory it held given
    back (``runtime.stats.free_unreachable``), so that one case cannot stop the sweep here either."""

    def run_or_raise(case: SpeedCase) -> dict[str, Any]:
        try:
            return run(case)
        except BenchError:
            raise
        except Exception as exc:  # noqa: BLE001 - a case's own failure, kept as its row
            from maskkv_cli.runtime.stats import free_unreachable

            cause = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            free_unreachable()
            raise BenchError(f"case {case.method} at prompt {case.prompt_len} failed: {type(exc).__name__}"
                             + (f": {cause}" if cause else "")) from exc

    return run_or_raise


def run_rounds(cases: Sequence[SpeedCase], run: Callable[[SpeedCase], dict[str, Any]], repeats: int,
               on_case: Callable[[int, int, SpeedCase, dict[str, Any] | None], None] | None = None,
               ) -> dict[str, dict[str, Any]]:
    """Every case ``repeats`` times, round by round (each round runs every case once, in order), so that the runs
    of the cases a ratio compares are spread over the same stretch of the machine's time; each case's median run
    (``median_row``) by key. A run that returns an error row makes it the case's row: the case is not run again
    in later rounds (its runs so far would not make a median of ``repeats``). ``on_case(i, n, case, row)`` as in
    ``run_sweep``, over all n runs."""
    tell = on_case or (lambda *a: None)
    runs: dict[str, list[dict[str, Any]]] = {case.key(): [] for case in cases}
    failed: dict[str, dict[str, Any]] = {}
    total = len(cases) * repeats
    for r in range(repeats):
        for j, case in enumerate(cases):
            if case.key() in failed:
                continue
            i = r * len(cases) + j
            tell(i, total, case, None)
            row = run(case)
            tell(i, total, case, row)
            if row.get("error"):
                failed[case.key()] = {**row, "error": f"{row['error']} (run {r + 1} of {repeats})"}
            else:
                runs[case.key()].append(row)
    return {key: failed[key] if key in failed else median_row(rows) for key, rows in runs.items()}


def run_order(cases: Sequence[SpeedCase], longest_first: bool) -> list[SpeedCase]:
    """The order the cases run in: as planned, or the longest prompt length's cases first (each length's cases in
    their planned order), so that a short window measures the long prompts before it closes."""
    return sorted(cases, key=lambda c: -c.prompt_len) if longest_first else list(cases)


def run_sweep(
    settings: SpeedSettings,
    out: Path | None = None,
    fresh: bool = False,
    isolate: bool = True,
    on_case: Callable[[int, int, SpeedCase, dict[str, Any] | None], None] | None = None,
    runner: Callable[[SpeedCase], dict[str, Any]] | None = None,
    case_timeout: float | None = None,
    longest_first: bool = False,
) -> tuple[ResultsFolder, list[dict[str, Any]]]:
    """Run (or reuse) every case, write the results folder, return it with the rows (ratios added; a failed
    case's error row among them, see the module doc).

    ``on_case(i, n, case, row)`` is called before a case runs (row None) and after it (its row, with
    ``reused`` true when it came from the folder). ``case_timeout``: seconds after which a case's process is
    killed (fresh processes only). ``longest_first``: run order (``run_order``); the rows keep the planned order.
    """
    settings.check()
    cases = settings.cases()
    folder = ResultsFolder.open("speed", settings.as_dict(), [c.key() for c in cases], out, fresh)
    if runner is None:
        runner = (partial(run_case_subprocess, timeout=case_timeout, log_dir=folder.path / "logs") if isolate
                  else in_this_process(run_case))
    run = keep_going(runner)
    order = run_order(cases, longest_first)
    if settings.repeats > 1:  # the missing cases' runs, round by round, then their median rows into the folder
        medians = run_rounds([c for c in order if folder.get(c.key()) is None], run, settings.repeats, on_case)

        def tell_reused(i: int, n: int, case: SpeedCase, row: dict[str, Any] | None) -> None:
            if on_case is not None and row is not None and row.get("reused"):  # run_rounds told of the others
                on_case(i, n, case, row)

        reused = folder.run_cases(order, lambda case: medians[case.key()], tell_reused)
    else:
        reused = folder.run_cases(order, run, on_case)
    rows = add_ratios(folder.ordered())
    folder.update(rows)
    rows = [{**r, "reused": r["key"] in reused} for r in rows]
    folder.write_text("summary.md", summary_markdown(settings, rows, folder))
    note = write_plot(rows, folder.path / "speed.png")
    if note:
        folder.write_text("summary.md", summary_markdown(settings, rows, folder, note))
    return folder, rows


# ----- child process entry point ------------------------------------------------------------------------------
