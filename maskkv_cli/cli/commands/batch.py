"""``maskkv batch``: many documents and questions, resumable, on this process, local workers or Ray."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from maskkv_cli.cli.common import fail, guarded, live_display_on, note
from maskkv_cli.cli.options import (
    BatchJobsOpt,
    BatchOutOpt,
    BatchQuestionsOpt,
    DevicesOpt,
    LongOpt,
    PasswordOpt,
    RayOpt,
    WorkersOpt,
)
from maskkv_cli.cli.parsing import out_folder, parse_devices
from maskkv_cli.cli.run_options import CACHE, OUTPUT, SAMPLER, RunOptions, run_options
from maskkv_cli.prompting.fit import DEFAULT_LONG, check_long

# the shared options batch takes: the cache and the sampler's, all of them (LLaDA2's included), and the model's
# but --device-map (each worker holds its model on one device)
BATCH_MODEL = ("model", "device", "dtype", "quantize", "yes")


class _Progress:
    """A Rich bar on stderr when both streams are terminals (done / failed / left, jobs per minute, ETA)."""

    def __init__(self, on: bool) -> None:
        self.on = on
        self.bar: Any = None
        self.task: Any = None

    def __enter__(self) -> _Progress:
        if self.on:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), TextColumn("{task.fields[rate]}"),
                                console=Console(stderr=True), transient=True)
            self.bar.start()
            self.task = self.bar.add_task("reading documents", total=None, rate="")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()

    def __call__(self, event: Any) -> None:
        if self.bar is None:
            return
        if event.phase == "parse":
            self.bar.update(self.task, description="reading documents", advance=0)
            return
        eta = "" if event.eta_s is None else f", ETA {_duration(event.eta_s)}"
        rate = f"{event.jobs_per_minute:.1f} jobs/min{eta}" if event.jobs_per_minute else ""
        self.bar.update(self.task, total=event.total, completed=event.done, rate=rate,
                        description=f"done {event.done - event.failed} / failed {event.failed} / left {event.left}")


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s"


@guarded
@run_options(*CACHE, *SAMPLER, *BATCH_MODEL, *OUTPUT)
def batch(
    jobs: Annotated[Path | None, typer.Argument(help="A .jsonl or .csv file of jobs: document, question (optional "
                                                "id, policy, budget, gen_length).", show_default=False)] = None,
    out: BatchOutOpt = None,
    docs: Annotated[list[str] | None, typer.Option("--docs", help="Documents (a glob like 'reports/*.pdf'; "
                                                   "repeatable); every one gets every --questions line.",
                                                   show_default=False)] = None,
    questions: BatchQuestionsOpt = None,
    devices: DevicesOpt = None,
    workers: WorkersOpt = None,
    ray: RayOpt = None,
    long: LongOpt = DEFAULT_LONG,
    password: PasswordOpt = None,
    batch_size: BatchJobsOpt = "auto",
    *,
    opts: RunOptions,
) -> None:
    """Answer many questions about many documents; resumable, on several devices or a Ray cluster.

    Each job's answer is what `maskkv ask` gives for the same document, question and settings. Rows are
    appended to DIR/answers.jsonl as they finish; a rerun with the same --out skips finished jobs (a job's key
    hashes the document's content, the question, the model and every setting that changes the answer) and runs
    failed ones again. Exit code 1 when any job failed (its row holds the one-line error), else 0.

    Examples:

        maskkv batch jobs.jsonl --out runs/reports

        maskkv batch --docs 'reports/*.pdf' --questions questions.txt --out runs/reports --budget 128

        maskkv batch jobs.csv --out runs/r1 --devices cuda:0,cuda:1 --model ~/models/LLaDA-8B-Instruct

        maskkv batch jobs.jsonl --out runs/r1 --ray auto --json

        maskkv batch jobs.jsonl --out runs/r1 --batch-size 8

        maskkv batch jobs.jsonl --out runs/r1-int8 --quantize int8 --workers 2
    """
    from maskkv_cli.batch.jobs import cross_product, read_jobs_file, read_questions
    from maskkv_cli.batch.run import Runner, run_batch
    from maskkv_cli.cli.model_choice import choose_model
    from maskkv_cli.engine.batch_memory import parse_batch_size

    quiet, as_json = opts.quiet, opts.as_json
    if out is None:
        raise fail("give a results folder with --out DIR (a rerun into it skips finished jobs)", 2)
    out_folder(out)
    if (jobs is None) == (docs is None):
        raise fail("give a jobs file (.jsonl or .csv) or --docs PATTERN with --questions FILE, not both", 2)
    if docs is not None and questions is None:
        raise fail("--docs needs --questions FILE (one question per line)", 2)
    if jobs is not None and questions is not None:  # a jobs file holds its questions: --questions was ignored
        raise fail("--questions goes with --docs; a jobs file names each job's question itself", 2)
    check_long(long)
    opts.cache()  # as ask: a bad budget, ratio or mode stops here
    size = parse_batch_size(batch_size)
    names = parse_devices(devices, workers, ray)
    if ray:
        from maskkv_cli.batch.ray_pool import import_ray, ray_address

        ray_address(ray)  # a malformed address: said before anything is read
        import_ray()  # without the extra: say so before reading any document

    def told(message: str) -> None:
        note(message, quiet, as_json)

    specs = read_jobs_file(jobs, told) if jobs is not None else cross_product(
        list(docs or []), read_questions(questions, told))  # type: ignore[arg-type]
    folder = choose_model(opts.model, opts.yes, quiet, as_json)  # as ask: an ORG/NAME not here is pulled or named
    from maskkv_cli.app.run_settings import check_long_family

    check_long_family(long, folder.config.family)
    settings = answer_settings(opts, long)
    runner = Runner(devices=names, ray=ray, workers=workers if ray else None, device=opts.device, batch_size=size,
                    quiet=quiet or as_json)
    with _Progress(live_display_on(quiet, as_json)) as progress:
        result = run_batch(specs, settings, folder, out, runner=runner, dtype=opts.dtype, password=password,
                           on_progress=progress, quantize=opts.quantization)
    if as_json:
        typer.echo(json.dumps(result.as_dict()))
    elif not quiet:
        if result.batch_note:  # (the first group's line: the others chose by the same rule, for their prompts)
            first = "the first group: " if len(result.batch_sizes) > 1 else ""
            sys.stderr.write(f"note: {first}{result.batch_note}\n")
        sizes = ",".join(str(n) for n in result.batch_sizes)
        rate = (f" at {result.jobs_per_minute:.1f} jobs/min" + (f" (batch size {sizes})" if sizes else "")
                if result.answered else "")
        flags = "".join([f", {result.low} LOW CONFIDENCE" if result.low else "",
                         f", {result.untrained} not of the embedded model's question form" if result.untrained else ""])
        sys.stderr.write(f"{result.ok} answered ({result.reused} from earlier runs{flags}), {result.failed} failed, "
                         f"{result.answered} run now{rate}; results: {out}\n")
        for row in result.failures[:10]:
            sys.stderr.write(f"  failed {row['id']}: {row['error']}\n")
        if len(result.failures) > 10:
            sys.stderr.write(f"  ... {len(result.failures) - 10} more in {out / 'summary.md'}\n")
    if result.failed:
        raise typer.Exit(1)


def answer_settings(opts: RunOptions, long: str) -> Any:
    """The jobs' ``batch.jobs.AnswerSettings``: every shared option a job's answer depends on, as ``opts`` holds it
    (the fields both have; the model's and the output's are the run's, not a job's)."""
    from dataclasses import fields

    from maskkv_cli.batch.jobs import AnswerSettings

    names = {f.name for f in fields(AnswerSettings)} & {f.name for f in fields(RunOptions)}
    return AnswerSettings(**{name: getattr(opts, name) for name in names}, long=long)
