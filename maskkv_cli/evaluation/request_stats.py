"""Per-request statistics of a harness run: one JSON line per generated answer, and a summary per task.

A line holds the task, the document id, the rank that ran it, the prompt length, the K/V bytes kept and what the
full prompt cache would take, the prefill time, the median step time and the whole answer's time. The summary of
a task: requests, mean compression (mean over requests of full bytes / kept bytes), tokens/s (generated tokens
over generation seconds, summed over requests), mean prefill seconds.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from maskkv_cli.runtime.fileio import atomic_write_text, open_file_mode

REQUESTS_FILE = "maskkv_requests_{stamp}.jsonl"
SUMMARY_FILE = "maskkv_summary_{stamp}.json"


def unique_lines(lines: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Lines without repeats of the same request (the harness pads short ranks with copies of their last
    request), ordered by task, document and request index."""
    seen: dict[tuple[Any, ...], dict[str, Any]] = {}
    for line in lines:
        seen.setdefault((line.get("task"), line.get("doc_id"), line.get("idx")), line)
    return sorted(seen.values(), key=lambda x: (str(x.get("task")), x.get("doc_id") or 0, x.get("idx") or 0))


def summarize(lines: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per task: requests, mean compression, tokens/s, mean prefill seconds, mean kept and full K/V bytes."""
    tasks: dict[str, list[dict[str, Any]]] = {}
    for line in lines:
        tasks.setdefault(str(line.get("task")), []).append(line)
    out: dict[str, dict[str, Any]] = {}
    for task, group in tasks.items():
        n = len(group)
        seconds = sum(float(x["total_s"]) for x in group)
        tokens = sum(int(x["gen_tokens"]) for x in group)
        out[task] = {
            "requests": n,
            "policy": group[0].get("policy"),
            "budget": group[0].get("budget"),
            "mean_compression": round(sum(float(x["compression"]) for x in group) / n, 4),
            "tokens_per_s": round(tokens / seconds, 4) if seconds > 0 else 0.0,
            "mean_prefill_s": round(sum(float(x["prefill_s"]) for x in group) / n, 6),
            "mean_kv_bytes": round(sum(int(x["kv_bytes"]) for x in group) / n, 1),
            "mean_kv_full_bytes": round(sum(int(x["kv_full_bytes"]) for x in group) / n, 1),
            "truncated": sum(bool(x.get("truncated")) for x in group),
        }
    return out


def summary_line(task: str, row: dict[str, Any]) -> str:
    budget = "" if row.get("budget") is None else f"@{row['budget']}"
    return (f"maskkv {task}: {row['requests']} requests, {row['policy']}{budget}, mean compression "
            f"{row['mean_compression']:.2f}x, {row['tokens_per_s']:.1f} tokens/s, mean prefill "
            f"{row['mean_prefill_s']:.3f} s")


def write_stats(folder: str | Path, stamp: str, lines: Sequence[dict[str, Any]],
                summary: dict[str, dict[str, Any]]) -> tuple[Path, Path]:
    """``maskkv_requests_<stamp>.jsonl`` and ``maskkv_summary_<stamp>.json`` in ``folder``, each written whole."""
    base = Path(folder).expanduser()
    requests = base / REQUESTS_FILE.format(stamp=stamp)
    totals = base / SUMMARY_FILE.format(stamp=stamp)
    atomic_write_text(requests, "".join(json.dumps(line, sort_keys=True) + "\n" for line in lines),
                      mode=open_file_mode())
    atomic_write_text(totals, json.dumps(summary, indent=2, sort_keys=True) + "\n", mode=open_file_mode())
    return requests, totals
