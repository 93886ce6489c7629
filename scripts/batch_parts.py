"""Where a batch's time goes: each group of jobs timed in parts, against the batch's limit line timed right after.

A group of ``scripts/bench_batch.py``'s jobs (the embedded model, short documents, a new question per job) is answered
as a batch worker answers it (``batch.answering.answer_jobs``), with the driver's and the pipeline's calls wrapped in
timers: the engine's prefills and steps, the picks (every greedy rule's pass over the logits, shared or a loop's
own), the writes of the commits made together (a cohort's, ``sampling/cohort.py``, or a round's joined commit), the
rest of the rounds (the loops, their lanes, events and timings, the commits of loops alone), and what runs around the
rounds (the chat prompts, the plans, each generation's start, the results). Right after each group the limit line of
its size is timed (``bench.limit.measure_batch_limit``: its bare prefill and steps). Reported: the median of each
part over the groups, in ms per group, and the median of engine / limit. The timers cost about a microsecond a call
(a few hundred calls per group).

    OMP_NUM_THREADS=2 .venv/bin/python scripts/batch_parts.py --groups 150
    OMP_NUM_THREADS=1 .venv/bin/python scripts/batch_parts.py --groups 150 --out runs/parts-t1.json

Run one at a time: anything else on the two cores changes both timings (docs/scale.md, Throughput).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SCRIPTS = Path(__file__).resolve().parent

# (module, attribute, part): the calls timed. The driver and the stream name what they import, so the timers replace
# those names where they are called from; a method is wrapped on its class.
TIMED = (
    ("maskkv_cli.sampling.driver", "prefill_lanes", "prefill"),
    ("maskkv_cli.sampling.driver", "step_logits", "steps"),
    ("maskkv_cli.sampling.driver", "pick_lanes", "picks"),
    ("maskkv_cli.sampling.picks", "pick_lanes", "picks"),  # a loop's own picks (``pick_one``)
    ("maskkv_cli.sampling.commits", "commit_rows", "commits"),
    ("maskkv_cli.sampling.stream", "step_round", "rounds"),
    ("maskkv_cli.app.pipeline", "prepare", "chat prompts"),
)


def wrap(owner: Any, name: str, part: str, spent: dict[str, float]) -> None:
    """Replace ``owner.name`` by the same call adding its time to ``spent[part]``."""
    original: Callable[..., Any] = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[part] = spent.get(part, 0.0) + time.perf_counter() - started

    setattr(owner, name, timed)


def main() -> None:
    sys.path.insert(0, str(SCRIPTS))
    from bench_batch import group_bench, group_parser, print_report

    args = group_parser(__doc__).parse_args()

    import importlib

    import torch

    from maskkv_cli.batch.answering import answer_jobs
    from maskkv_cli.bench.limit import measure_batch_limit

    texts, groups, limits = group_bench(Path(tempfile.mkdtemp(prefix="batch-parts-")), args.size)
    name = f"batch {args.size}"
    session = limits.session
    spent: dict[str, float] = {}
    for module, attribute, part in TIMED:
        wrap(importlib.import_module(module), attribute, part, spent)
    rows: list[dict[str, float]] = []
    for i in range(args.groups + 3):
        spent.clear()
        started = time.perf_counter()
        answer_jobs(session, texts, groups[i % len(groups)], args.size)
        engine = time.perf_counter() - started
        with torch.no_grad():
            limit = measure_batch_limit(session.model, limits.prompts[name], limits.gen, limits.budget)
        if i < 3:
            continue
        inside = sum(spent.get(part, 0.0) for part in ("prefill", "steps", "picks", "commits"))
        rows.append({"engine": engine, "limit": limit.total_s, "limit prefill": limit.prefill_s,
                     "limit steps": sum(limit.step_s), "prefill": spent["prefill"], "steps": spent["steps"],
                     "picks": spent.get("picks", 0.0), "commits": spent.get("commits", 0.0),
                     "rest of the rounds": spent["rounds"] - inside, "around the rounds": engine - spent["rounds"],
                     "chat prompts": spent.get("chat prompts", 0.0), "engine / limit": engine / limit.total_s})
    report: dict[str, object] = {"groups": args.groups, "size": args.size, "threads": torch.get_num_threads()}
    for key in rows[0]:
        median = statistics.median(row[key] for row in rows)
        if key == "engine / limit":
            report[key] = round(median, 3)
        else:
            report[f"{key} ms"] = round(median * 1e3, 2)
    print_report(report, args.out)


if __name__ == "__main__":
    main()
