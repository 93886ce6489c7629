"""Merge the harness's ``results_*.json`` files of several runs (policies x budgets) into one Markdown table.

``python -m maskkv_cli.evaluation.merge FOLDER [--metric score]``: every ``results_*.json`` under ``FOLDER``
is read; its ``config.model_args`` gives the policy and budget (the model args of ``--model maskkv``), its
``results`` the per-task scores. One row per task, one column per (policy, budget), 100 x the task's metric
(LongBench tasks report ``score``), and an ``average`` row over the tasks every column has. A later run of
the same (task, policy, budget) replaces an earlier one (files are read in name order, which is date order).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from maskkv_cli.defaults import DEFAULT_POLICY


def _args(config: dict[str, Any]) -> dict[str, Any]:
    raw = config.get("model_args") or {}
    if isinstance(raw, dict):
        return raw
    pairs = [part.split("=", 1) for part in str(raw).split(",") if "=" in part]
    return {key.strip(): value.strip() for key, value in pairs}


def column_of(config: dict[str, Any]) -> str:
    """``policy@budget`` of a run (``policy`` alone when no budget was given; ``@r0.1`` for a ratio)."""
    args = _args(config)
    policy = str(args.get("policy") or DEFAULT_POLICY)
    for key, prefix in (("budget", "@"), ("ratio", "@r")):
        value = args.get(key)
        if value not in (None, "", "None", "none"):
            return f"{policy}{prefix}{value}"
    return policy


def collect(folder: str | Path, metric: str = "score") -> dict[str, dict[str, float]]:
    """``{task: {column: 100 x metric}}`` over every results file under ``folder``."""
    table: dict[str, dict[str, float]] = {}
    for path in sorted(Path(folder).expanduser().rglob("results_*.json"), key=lambda p: p.name):
        data = json.loads(path.read_text(encoding="utf-8"))
        column = column_of(data.get("config") or {})
        for task, values in (data.get("results") or {}).items():
            key = next((k for k in values if k.split(",")[0] == metric), None)
            if key is not None and isinstance(values[key], int | float):
                table.setdefault(task, {})[column] = round(100 * float(values[key]), 2)
    return table


def markdown(table: dict[str, dict[str, float]]) -> str:
    columns: list[str] = []
    for row in table.values():
        columns.extend(c for c in row if c not in columns)
    lines = ["| task | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
    for task in sorted(table):
        lines.append(f"| {task} | " + " | ".join(f"{table[task][c]:.2f}" if c in table[task] else "-"
                                                 for c in columns) + " |")
    shared = [t for t in table if all(c in table[t] for c in columns)]
    if shared and columns:
        means = [sum(table[t][c] for t in shared) / len(shared) for c in columns]
        lines.append(f"| average ({len(shared)} tasks) | " + " | ".join(f"{m:.2f}" for m in means) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m maskkv_cli.evaluation.merge", description=__doc__.split("\n")[0])
    parser.add_argument("folder", help="a folder holding the harness's results_*.json files (searched recursively)")
    parser.add_argument("--metric", default="score", help="the metric to tabulate (LongBench: score)")
    args = parser.parse_args(argv)
    table = collect(args.folder, args.metric)
    if not table:
        raise SystemExit(f"error: no results_*.json with a {args.metric!r} metric under {args.folder}")
    print(markdown(table), end="")


if __name__ == "__main__":
    main()
