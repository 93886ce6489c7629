"""``bench quality``'s results as text and a picture: retention, the display order, summary.md and quality.png."""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from maskkv_cli.bench.paired import paired_markdown
from maskkv_cli.runtime.fileio import atomic_write_bytes, open_file_mode
from maskkv_cli.tasks.synthetic import UNANSWERABLE_KINDS

TABLE_HEADERS: tuple[str, ...] = ("task", "length", "policy", "budget", "n", "accuracy", "95% interval",
                                  "retention", "share", "prompt", "s/sample")


# ----- retention, table, summary ---------------------------------------------------------------------------


def add_retention(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copies of the rows with ``retention`` = accuracy / full accuracy of the same (task, length).

    None when there is no ``full`` row for that cell or its accuracy is 0.
    """
    full: dict[tuple[Any, Any], float] = {}
    for row in rows:
        if row.get("policy") == "full":
            full[(row.get("task"), row.get("length"))] = float(row["accuracy"])
    out: list[dict[str, Any]] = []
    for row in rows:
        reference = full.get((row.get("task"), row.get("length")))
        retention = None if not reference else round(float(row["accuracy"]) / reference, 4)
        out.append({**row, "retention": retention})
    return out


def display_order(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows by (task, length) cell in first-seen order, then budget (None first, ascending), then policy order."""
    cells: dict[tuple[Any, Any], int] = {}
    policies: dict[str, int] = {}
    for row in rows:
        cells.setdefault((row["task"], row["length"]), len(cells))
        policies.setdefault(row["policy"], len(policies))

    def order(row: dict[str, Any]) -> tuple[int, int, int, int]:
        budget = row.get("budget")
        return (cells[(row["task"], row["length"])], 0 if budget is None else 1, budget or 0,
                policies[row["policy"]])

    return sorted(rows, key=order)


def _fmt(value: float | None, pattern: str) -> str:
    return "-" if value is None else format(value, pattern)


def table_cells(row: dict[str, Any]) -> list[str]:
    """One row of the table as text, in the order of ``TABLE_HEADERS``."""
    return [
        str(row["task"]),
        _length(row),
        str(row["policy"]),
        "-" if row.get("budget") is None else str(row["budget"]),
        str(row["n"]),
        f"{float(row['accuracy']):.1f}",
        "-" if not row.get("ci95") else f"{row['ci95'][0]:.1f}-{row['ci95'][1]:.1f}",
        _fmt(row.get("retention"), ".2f"),
        _fmt(row.get("budget_share"), ".1%"),
        _fmt(row.get("mean_prompt_tokens"), ".0f"),
        _fmt(row.get("seconds_per_sample"), ".2f"),
    ]


def _own_lengths(rows: Sequence[dict[str, Any]], gen: dict[str, Any]) -> str:
    own = sorted({f"{r['task']} {r['gen_length']}" for r in rows if r.get("gen_length") not in (None,
                                                                                               gen.get("gen_length"))})
    return f" (LongBench answer lengths, one token per step: {', '.join(own)})" if own else ""


def weights_label(quantize: str) -> str:
    """How a report names quantized weights after the dtype ("" for none)."""
    return "" if quantize in ("none", None) else f", {quantize} weights"


def _length(row: dict[str, Any]) -> str:
    """A cell's context length as its tables show it: ``-`` for tasks of their own lengths (a LongBench file's)."""
    return "-" if row.get("length") is None else str(row["length"])


def _source(settings: dict[str, Any]) -> str:
    """Where the tasks came from: the kind, and the file it names (a haystack or a tasks file)."""
    source = settings.get("source", {})
    return f"{source.get('kind')} {source['name']}" if source.get("name") else str(source.get("kind"))


def _samples(rows: Sequence[dict[str, Any]], settings: dict[str, Any]) -> str:
    """The samples asked per cell, or where cells had fewer (a tasks file of fewer records) up to that many."""
    asked = settings.get("samples")
    counts = {int(row["n"]) for row in rows if row.get("n") is not None}
    if not counts or counts == {asked}:
        return str(asked)
    return f"up to {asked} (a cell's n is how many it had)"


def summary_markdown(rows: Sequence[dict[str, Any]], settings: dict[str, Any],
                     paired: Sequence[dict[str, Any]] = ()) -> str:
    gen = settings.get("generation", {})
    lines = [
        "# maskkv bench quality",
        "",
        f"- model: `{settings.get('model')}` ({settings.get('model_id')}, {settings.get('dtype')}"
        f"{weights_label(settings.get('quantize', 'none'))})",
        f"- tasks: {_source(settings)} {settings.get('tasks')}; samples per cell: {_samples(rows, settings)}; seed "
        f"{settings.get('seed')}",
        f"- generation: {gen.get('gen_length')} tokens, {gen.get('steps')} steps, blocks of "
        f"{gen.get('block_length')}, greedy" + _own_lengths(rows, gen),
        "- accuracy: 100 x mean score (exact match for the synthetic tasks, LongBench metric per dataset); "
        "95% interval: of the accuracy (Wilson for exact match); "
        "retention: accuracy / full-cache accuracy of the same task and length; share: budget / mean prompt "
        "tokens; prompt: mean prompt tokens (chat template included); s/sample: seconds per answer",
        "",
        "| " + " | ".join(TABLE_HEADERS) + " |",
        "|" + "|".join("---" if i in (0, 2) else "---:" for i in range(len(TABLE_HEADERS))) + "|",
    ]
    for row in display_order(rows):
        lines.append("| " + " | ".join(table_cells(row)) + " |")
    sections = [text for text in (paired_markdown(paired), distractor_markdown(rows), no_answer_markdown(rows))
                if text]
    return "\n".join(lines) + "\n" + "".join("\n" + text for text in sections)


def distractor_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """For tasks with distractor needles: of the wrong answers, how many were another needle's whole number (the
    wrong key matched, or eviction kept a distractor and lost the answer) and how many were something else
    (digits mixed from several needles, a wrong digit, cut short). Empty when no row counted them."""
    counted = [row for row in display_order(rows) if row.get("distractor_answers") is not None]
    if not counted:
        return ""
    lines = ["## Wrong answers: another needle's number or something else", "",
             "Wrong digits: places where a wrong answer differs from the right number; of them, a distractor's: "
             "the digit a distractor's number has at that place (about one in four by chance with three).", "",
             "| task | length | policy | budget | wrong | another needle's number | something else | wrong digits "
             "| of them a distractor's |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for row in counted:
        wrong = int(row["n"]) - round(float(row.get("score_sum", 0.0)))
        other = int(row["distractor_answers"])
        budget = "-" if row.get("budget") is None else str(row["budget"])
        digits = [row.get("wrong_digits"), row.get("distractor_digits")]
        lines.append(f"| {row['task']} | {_length(row)} | {row['policy']} | {budget} | {wrong} | {other} | "
                     f"{wrong - other} | " + " | ".join("-" if d is None else str(d) for d in digits) + " |")
    return "\n".join(lines) + "\n"


def no_answer_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """How often each cell answered "not in the document" to a question whose answer is in the context (a false
    no-answer), with the total per policy and budget. Shown when the run asked unanswerable questions too, or when
    some answerable question got that answer; empty otherwise."""
    counted = [row for row in display_order(rows)
               if row.get("no_answers") is not None and row["task"] not in UNANSWERABLE_KINDS]
    asked_none = any(row["task"] in UNANSWERABLE_KINDS for row in rows)
    if not counted or not (asked_none or any(row["no_answers"] for row in counted)):
        return ""
    lines = ['## "Not in the document" on answerable questions', "",
             "Answers that said the fact is not in the document although it is (the false no-answers of SQuAD 2.0).",
             "", "| task | length | policy | budget | n | not in the document |", "|---|---:|---|---:|---:|---:|"]
    totals: dict[tuple[str, str], list[int]] = {}
    for row in counted:
        budget = "-" if row.get("budget") is None else str(row["budget"])
        lines.append(f"| {row['task']} | {_length(row)} | {row['policy']} | {budget} | {row['n']} | "
                     f"{row['no_answers']} |")
        total = totals.setdefault((row["policy"], budget), [0, 0])
        total[0] += int(row["no_answers"])
        total[1] += int(row["n"])
    lines.append("")
    lines.append("In all: " + "; ".join(f"{policy}{'' if budget == '-' else '@' + budget} {said} of {n}"
                                        for (policy, budget), (said, n) in totals.items()) + ".")
    return "\n".join(lines) + "\n"


def plot_quality(rows: Sequence[dict[str, Any]], path: Path) -> bool:
    """Accuracy against budget, a line per evicting policy, one subplot per (task, length); full (and none)
    as horizontal lines. False when matplotlib is not installed or no row has a budget."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return False
    cells: list[tuple[Any, Any]] = []
    for row in rows:
        if (row["task"], row["length"]) not in cells:
            cells.append((row["task"], row["length"]))
    if not cells:
        return False
    columns = min(3, len(cells))
    lines = -(-len(cells) // columns)
    figure = Figure(figsize=(5.0 * columns, 3.6 * lines), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(lines, columns, squeeze=False)
    for index, (task, length) in enumerate(cells):
        ax = axes[index // columns][index % columns]
        cell_rows = [r for r in rows if (r["task"], r["length"]) == (task, length)]
        budgets = sorted({r["budget"] for r in cell_rows if r.get("budget") is not None})
        curves: dict[str, list[tuple[int, float]]] = {}
        for r in cell_rows:
            if r.get("budget") is not None:
                curves.setdefault(r["policy"], []).append((r["budget"], float(r["accuracy"])))
        for policy, points in curves.items():
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=policy)
        for r in cell_rows:
            if r.get("budget") is None:
                ax.axhline(float(r["accuracy"]), linestyle="--", color="black" if r["policy"] == "full" else "gray",
                           label=f"{r['policy']} ({float(r['accuracy']):.1f})")
        if budgets:
            ax.set_xscale("log", base=2)
            ax.set_xticks(budgets, [str(b) for b in budgets])
            ax.minorticks_off()
        ax.set_ylim(-2, 102)
        ax.set_xlabel("budget (K/V pairs per head)")
        ax.set_ylabel("accuracy")
        ax.set_title(task if length is None else f"{task}, {length} tokens")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    for index in range(len(cells), lines * columns):
        axes[index // columns][index % columns].set_visible(False)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110)
    atomic_write_bytes(path, buffer.getvalue(), mode=open_file_mode())
    return True
