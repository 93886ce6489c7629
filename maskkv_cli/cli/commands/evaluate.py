"""``maskkv eval``: run lm-evaluation-harness tasks (LongBench, GSM8K, ... or local task YAMLs) with maskkv."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from maskkv_cli.cli.common import fail, guarded, note
from maskkv_cli.cli.options import EvalBatchOpt, EvalModelOpt, HarnessTasksOpt
from maskkv_cli.cli.parsing import out_folder, split_list
from maskkv_cli.cli.run_options import CACHE, OUTPUT, SAMPLER, RunOptions, run_options

# every shared option but the answer length and the temperature, which each request sets; the model's but
# --device-map and --yes (each rank holds its model on one device; a model not on this machine is an error)
EVAL_SAMPLER = tuple(name for name in SAMPLER if name not in ("gen_length", "temperature"))
EVAL_MODEL = ("model", "device", "dtype", "quantize")


@guarded
@run_options(*CACHE, *EVAL_SAMPLER, *EVAL_MODEL, *OUTPUT, worded={"model": EvalModelOpt})
def evaluate(
    tasks: HarnessTasksOpt,
    include_path: Annotated[Path | None, typer.Option(
        "--include-path", help="A folder of task YAML files of your own (local data files allowed).",
        show_default=False)] = None,
    builtin_tasks: Annotated[bool, typer.Option(
        "--builtin-tasks/--no-builtin-tasks", help="Index the harness's own tasks too (off: only --include-path, "
        "which starts faster).")] = True,
    chat_template: Annotated[bool, typer.Option(
        "--chat-template/--no-chat-template", help="Wrap each prompt in the model's chat template (LongBench: on "
        "for QA and summaries, off for trec, triviaqa, samsum, lsht, lcc, repobench-p).")] = False,
    limit: Annotated[float | None, typer.Option(
        "--limit", help="Documents per task (a count, or a share when below 1).", show_default=False)] = None,
    output: Annotated[Path | None, typer.Option(
        "--output", "-o", help="Folder for the harness's results and samples and maskkv's per-request statistics.",
        show_default=False)] = None,
    mc_samples: Annotated[int, typer.Option(
        "--mc-samples", help="Monte Carlo samples per log-likelihood request (multiple-choice tasks).")] = 32,
    batch_size: EvalBatchOpt = "auto",
    *,
    opts: RunOptions,
) -> None:
    """Evaluate with EleutherAI's lm-evaluation-harness, maskkv as the model (needs `pip install 'maskkv[eval]'`).

    Generation tasks use the sampler (one token per step unless --steps) under the cache policy, each request's
    answer length and stop strings; multiple-choice tasks use the LLaDA Monte Carlo likelihood estimate.

    Examples:

        maskkv eval --model ~/LLaDA-8B-Instruct --tasks longbench_hotpotqa --chat-template --budget 256 -o runs/lb

        maskkv eval --tasks my_task --include-path ./tasks --no-builtin-tasks --policy full --batch-size 8

        maskkv eval --model ~/LLaDA2.1-mini --tasks longbench_trec --quantize int8 -o runs/lb-int8

        accelerate launch --multi_gpu --num_processes 8 -m maskkv_cli eval --tasks longbench_trec -o runs/lb
    """
    from maskkv_cli.evaluation import INSTALL_HINT, harness_available

    if not harness_available():
        raise fail(INSTALL_HINT)
    quiet, as_json = opts.quiet, opts.as_json
    opts.cache()  # as ask: a bad budget, ratio or mode stops here
    names = split_list(tasks)
    if not names:
        raise fail("--tasks is empty; give harness task names, e.g. --tasks longbench_hotpotqa", 2)
    if mc_samples < 1:
        raise fail(f"--mc-samples must be at least 1, got {mc_samples}", 2)
    if limit is not None and not limit > 0:
        raise fail(f"--limit must be a count of documents, or a share of them below 1; got {limit:g}", 2)
    from maskkv_cli.errors import UsageError
    from maskkv_cli.evaluation.engine_adapter import batch_size_arg

    try:
        batch_size_arg(batch_size)  # (the harness's model argument; named here as the option the user gave)
    except UsageError:
        raise fail(f"--batch-size must be a positive number or auto, got {batch_size!r}", 2) from None
    out_folder(output, "--output")  # a file in its place fails now, not after the whole evaluation
    _quiet_harness(quiet or as_json)
    from maskkv_cli.evaluation.runner import run_eval
    from maskkv_cli.models.catalog import resolve_default_model

    model, message = resolve_default_model(opts.model)
    note(message, quiet, as_json)

    model_args: dict[str, Any] = {"model": model, "device": opts.device, "dtype": opts.dtype,
                                  "quantize": opts.quantization, "mc_samples": mc_samples, "batch_size": batch_size,
                                  "progress": not (quiet or as_json), **harness_args(opts)}
    run = run_eval(names, model_args, include_path=None if include_path is None else str(include_path),
                   builtin_tasks=builtin_tasks, chat_template=chat_template, limit=limit, output=output)
    if run.results is None:
        return  # another rank prints
    if as_json:
        typer.echo(json.dumps({"results": run.results["results"], "maskkv": run.summary,
                               "output": None if run.folder is None else str(run.folder)}, ensure_ascii=False))
        return
    typer.echo(run.table)
    if run.folder is not None and not quiet:
        sys.stderr.write(f"results, samples and maskkv statistics: {run.folder}\n")


def _quiet_harness(quiet: bool) -> None:
    """The harness logs at INFO through its own handler; keep warnings only when the user wants quiet output."""
    import logging

    logging.getLogger("lm_eval").setLevel(logging.WARNING if quiet else logging.INFO)


def harness_args(opts: RunOptions) -> dict[str, Any]:
    """The shared options as the harness model's args (``evaluation.engine_adapter.harness_settings``): every run
    setting ``opts`` holds, less those left at None (the harness model's defaults then hold: blocks of 32)."""
    from dataclasses import fields

    from maskkv_cli.app.run_settings import RunSettings

    names = {f.name for f in fields(RunSettings)} & {f.name for f in fields(RunOptions)}
    return {name: getattr(opts, name) for name in sorted(names - {"gen_length", "temperature"})
            if getattr(opts, name) is not None}
