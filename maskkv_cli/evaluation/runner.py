"""``maskkv eval``'s core: one harness run through its Python API (``simple_evaluate``), results saved the way the
harness's own command line saves them, and the per-request statistics beside its samples log."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class EvalRun:
    """What one run produced (on rank 0; other ranks get ``results`` None)."""

    results: dict[str, Any] | None
    summary: dict[str, dict[str, Any]]
    folder: Path | None  # where the results, the samples and the maskkv statistics went
    table: str = ""


def run_eval(tasks: list[str], model_args: dict[str, Any], *, include_path: str | None = None,
             builtin_tasks: bool = True, chat_template: bool = False, limit: float | None = None,
             output: str | Path | None = None, gen_kwargs: dict[str, Any] | None = None) -> EvalRun:
    """Evaluate ``tasks`` with ``--model maskkv`` and ``model_args`` (see ``harness_model``).

    ``output``: a folder; the harness writes ``<output>/<model>/results_*.json`` and ``samples_<task>_*.jsonl``
    and the model writes ``maskkv_requests_*.jsonl`` and ``maskkv_summary_*.json`` beside them.
    """
    from maskkv_cli.evaluation import register

    register()
    from lm_eval import simple_evaluate
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import handle_non_serializable, make_table, sanitize_model_name

    from maskkv_cli.errors import UsageError
    from maskkv_cli.evaluation.harness_model import MaskKVLM, finish_distributed
    from maskkv_cli.models.catalog import resolve_default_model

    if include_path is not None and not Path(include_path).expanduser().is_dir():
        raise UsageError(f"--include-path {include_path} is not a folder of task YAML files")
    manager = TaskManager(include_path=None if include_path is None else str(Path(include_path).expanduser()),
                          include_defaults=builtin_tasks)
    unknown = [t for t in tasks if not manager.match_tasks([t])]
    if unknown:  # before the model loads (minutes for a real checkpoint)
        searched = ([] if not builtin_tasks else ["among the harness's tasks"]) + (
            [] if include_path is None else [f"in {include_path}"])
        hint = ("`python -m maskkv_cli.evaluation ls tasks` lists them" if builtin_tasks else
                "--no-builtin-tasks left the harness's own tasks out")
        raise UsageError(f"unknown task(s) {', '.join(unknown)}: not {' or '.join(searched)} ({hint})")
    path, _ = resolve_default_model(model_args.get("model"))
    args = {**model_args, "model": path}
    folder = None if output is None else Path(output).expanduser() / sanitize_model_name(str(path))
    lm = MaskKVLM(**args, stats_dir=None if folder is None else str(folder))
    tracker = EvaluationTracker(output_path=str(output)) if output is not None else None
    results = simple_evaluate(model=lm, model_args=args, tasks=tasks, task_manager=manager,
                              apply_chat_template=chat_template, log_samples=output is not None, limit=limit,
                              evaluation_tracker=tracker, gen_kwargs=gen_kwargs)
    finish_distributed()  # under accelerate launch: every rank is past the last gather
    if results is None:  # not rank 0 under accelerate launch
        return EvalRun(None, {}, folder)
    if tracker is not None:
        samples = results.pop("samples", {})
        tracker.save_results_aggregated(results=results, samples=samples)
        for task_name in results.get("configs", {}):
            tracker.save_results_samples(task_name=task_name, samples=samples[task_name])
    table = make_table(results)
    if results.get("groups"):
        table += "\n" + make_table(results, "groups")
    plain = json.loads(json.dumps(results.get("results", {}), default=handle_non_serializable))
    return EvalRun({"results": plain, "rank_count": int(os.environ.get("WORLD_SIZE", "1"))}, lm.last_summary,
                   folder, table)
