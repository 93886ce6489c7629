"""``maskkv bench speed``: no cache vs full cache vs MaskKV budgets over prompt lengths, in one run: the sweep.

Every case (``bench/speed_settings.py``) runs in a fresh process (``bench/speed_case.py``), round by round when it
repeats, into a results folder that a rerun reuses; the rows get their ratios (against ``none``, ``full`` and batch
size 1 of the same run) and the report (``bench/speed_report.py``).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

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
        by_len.setdefault((row["prompt_len"], row.get("batch_size", 1), row.get("quantize", "none")),
                          {})[row["method"]] = row
    out = []
    for row in rows:
        row = dict(row)
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


def run_rounds(cases: Sequence[SpeedCase], run: Callable[[SpeedCase], dict[str, Any]], repeats: int,
               on_case: Callable[[int, int, SpeedCase, dict[str, Any] | None], None] | None = None,
               ) -> dict[str, dict[str, Any]]:
    """Every case ``repeats`` times, round by round (each round runs every case once, in order), so that the runs
    of the cases a ratio compares are spread over the same stretch of the machine's time; each case's median run
    (``median_row``) by key. ``on_case(i, n, case, row)`` as in ``run_sweep``, over all n runs."""
    tell = on_case or (lambda *a: None)
    runs: dict[str, list[dict[str, Any]]] = {case.key(): [] for case in cases}
    total = len(cases) * repeats
    for r in range(repeats):
        for j, case in enumerate(cases):
            i = r * len(cases) + j
            tell(i, total, case, None)
            row = run(case)
            runs[case.key()].append(row)
            tell(i, total, case, row)
    return {key: median_row(rows) for key, rows in runs.items()}


def run_sweep(
    settings: SpeedSettings,
    out: Path | None = None,
    fresh: bool = False,
    isolate: bool = True,
    on_case: Callable[[int, int, SpeedCase, dict[str, Any] | None], None] | None = None,
    runner: Callable[[SpeedCase], dict[str, Any]] | None = None,
) -> tuple[ResultsFolder, list[dict[str, Any]]]:
    """Run (or reuse) every case, write the results folder, return it with the rows (ratios added).

    ``on_case(i, n, case, row)`` is called before a case runs (row None) and after it (its row, with
    ``reused`` true when it came from the folder).
    """
    settings.check()
    cases = settings.cases()
    folder = ResultsFolder.open("speed", settings.as_dict(), [c.key() for c in cases], out, fresh)
    run = runner or (run_case_subprocess if isolate else run_case)
    if settings.repeats > 1:  # the missing cases' runs, round by round, then their median rows into the folder
        medians = run_rounds([c for c in cases if folder.get(c.key()) is None], run, settings.repeats, on_case)

        def tell_reused(i: int, n: int, case: SpeedCase, row: dict[str, Any] | None) -> None:
            if on_case is not None and row is not None and row.get("reused"):  # run_rounds told of the others
                on_case(i, n, case, row)

        reused = folder.run_cases(cases, lambda case: medians[case.key()], tell_reused)
    else:
        reused = folder.run_cases(cases, run, on_case)
    rows = add_ratios(folder.ordered())
    folder.update(rows)
    rows = [{**r, "reused": r["key"] in reused} for r in rows]
    folder.write_text("summary.md", summary_markdown(settings, rows, folder))
    note = write_plot(rows, folder.path / "speed.png")
    if note:
        folder.write_text("summary.md", summary_markdown(settings, rows, folder, note))
    return folder, rows


# ----- child process entry point ------------------------------------------------------------------------------
