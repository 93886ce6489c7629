"""How sure a quality figure is: a 95% interval per row, and paired comparisons of two policies on the same tasks.

Every policy of a ``bench quality`` run answers the same tasks, so two policies are best compared task by task:
the tasks where one scored higher and the other lower (ties say nothing about which is better) go into an exact
two-sided sign test, McNemar's test when the scores are 0 or 1. With 40 tasks one row's own interval is about
+-15 points wide, while a paired difference of a few tasks can still be told from noise or not.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

Z95 = 1.959964  # two-sided 95% normal quantile


def _percent(low: float, high: float) -> tuple[float, float]:
    """A proportion interval as percentages, clipped to 0-100 and rounded to 0.1."""
    return (round(100 * max(0.0, low), 1), round(100 * min(1.0, high), 1))


def wilson_interval(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a proportion, in percent (sound at 0% and 100%, unlike mean +- z sd)."""
    if n <= 0:
        return (0.0, 100.0)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return _percent(centre - half, centre + half)


def score_interval(scores: Sequence[float], z: float = Z95) -> tuple[float, float]:
    """95% interval of the mean score in percent: Wilson for 0/1 scores, else the normal one, clipped to 0-100."""
    n = len(scores)
    if n == 0:
        return (0.0, 100.0)
    if all(s in (0.0, 1.0) for s in scores):
        return wilson_interval(sum(scores), n, z)
    mean = sum(scores) / n
    sd = math.sqrt(sum((s - mean) ** 2 for s in scores) / (n - 1)) if n > 1 else 0.0
    half = z * sd / math.sqrt(n)
    return _percent(mean - half, mean + half)


def sign_test(wins: int, losses: int) -> float:
    """Exact two-sided sign test p-value for ``wins`` against ``losses`` (ties left out): McNemar on 0/1 scores."""
    n = wins + losses
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(wins, losses) + 1)) / 2**n
    return min(1.0, 2 * tail)


def add_intervals(rows: Sequence[dict[str, Any]], task_scores: Mapping[str, Mapping[str, float]]
                  ) -> list[dict[str, Any]]:
    """Copies of the rows with ``ci95`` = [low, high] from the per-task scores of their ``key`` (row key -> task
    id -> score; None for a row without scores)."""
    out = []
    for row in rows:
        values = list(task_scores.get(str(row.get("key")), {}).values())
        out.append({**row, "ci95": list(score_interval(values)) if values else None})
    return out


def paired_comparisons(rows: Sequence[dict[str, Any]], task_scores: Mapping[str, Mapping[str, float]],
                       reference: str = "maskkv") -> list[dict[str, Any]]:
    """``reference`` against every other policy at the same (task, length, budget), task by task.

    ``task_scores``: row key -> task id -> score. Each comparison: ``wins`` (tasks where ``reference`` scored
    higher), ``losses`` (lower), ``ties``, ``p`` (sign test) and both accuracies.
    """
    by_cell: dict[tuple[Any, Any, Any], dict[str, dict[str, Any]]] = {}
    for row in rows:
        if row.get("budget") is not None:
            by_cell.setdefault((row["task"], row.get("length"), row["budget"]), {})[row["policy"]] = row
    out: list[dict[str, Any]] = []
    for (task, length, budget), policies in by_cell.items():
        ref = policies.get(reference)
        ref_scores = task_scores.get(str(ref.get("key")), {}) if ref is not None else {}
        if not ref_scores:
            continue
        for policy, row in policies.items():
            other = task_scores.get(str(row.get("key")), {})
            if policy == reference or not other:
                continue
            shared = ref_scores.keys() & other.keys()
            wins = sum(1 for t in shared if ref_scores[t] > other[t])
            losses = sum(1 for t in shared if ref_scores[t] < other[t])
            out.append({"task": task, "length": length, "budget": budget, "policy": policy, "reference": reference,
                        "n": len(shared), "wins": wins, "losses": losses, "ties": len(shared) - wins - losses,
                        "p": float(f"{sign_test(wins, losses):.4g}"), "reference_accuracy": ref["accuracy"],
                        "accuracy": row["accuracy"]})
    return out


def paired_markdown(comparisons: Sequence[dict[str, Any]]) -> str:
    """The comparisons as a markdown section ('' when there are none)."""
    if not comparisons:
        return ""
    reference = comparisons[0]["reference"]
    lines = [
        f"## {reference} against each policy, task by task",
        "",
        f"Same tasks, same budget: `{reference} only` = tasks where {reference} scored higher, `other only` = "
        "where the other policy did; p = exact two-sided sign test on those (McNemar for exact match).",
        "",
        f"| task | length | budget | policy | {reference} acc | acc | {reference} only | other only | p |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in comparisons:
        length = "-" if c["length"] is None else c["length"]
        lines.append(f"| {c['task']} | {length} | {c['budget']} | {c['policy']} | {float(c['reference_accuracy']):.1f} "
                     f"| {float(c['accuracy']):.1f} | {c['wins']} | {c['losses']} | {c['p']:.2g} |")
    return "\n".join(lines) + "\n"
