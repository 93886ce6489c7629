"""``maskkv bench quality``: accuracy and retention of every KV policy and budget on retrieval tasks; ``maskkv bench
tasks``: the tasks it generates, exported as LongBench JSONL.

Registered on ``maskkv bench`` in ``cli/app.py``. Heavy modules (torch, Rich) load inside the command, so
``maskkv --help`` stays light.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from maskkv_cli.bench.quality_plan import (
    DEFAULT_BUDGETS,
    DEFAULT_KINDS,
    DEFAULT_LENGTHS,
    DEFAULT_POLICIES,
    DEFAULT_SAMPLES,
    FALLBACK_GENERATION,
)
from maskkv_cli.cli.common import guarded, note, print_wide, report_console
from maskkv_cli.cli.model_choice import load_session
from maskkv_cli.cli.options import (
    CellBatchOpt,
    DeviceOpt,
    DevicesOpt,
    DtypeOpt,
    FreshOpt,
    HaystackOpt,
    JsonOpt,
    LayerBudgetsOpt,
    LengthsOpt,
    ModelOpt,
    OutOpt,
    PromptsOpt,
    QualityBlockOpt,
    QualityBudgetsOpt,
    QualityGenOpt,
    QualityPoliciesOpt,
    QualitySamplesOpt,
    QualitySeedOpt,
    QualityStepsOpt,
    QuantizeOpt,
    QuietOpt,
    RayOpt,
    TaskKindsOpt,
    TasksOpt,
    TasksSeedOpt,
    WorkersOpt,
    YesOpt,
    model_option,
    samples_option,
)
from maskkv_cli.cli.parsing import out_folder, parse_counts, parse_devices
from maskkv_cli.errors import UsageError

_FALLBACK = "/".join(str(FALLBACK_GENERATION[k]) for k in ("gen_length", "steps", "block_length"))


def parse_lengths(lengths: str | None) -> tuple[int, ...]:
    """``--lengths`` as distinct counts in the order given, or the default lengths."""
    return DEFAULT_LENGTHS if lengths is None else parse_counts(lengths, "--lengths", unique=True, example="1k,4k")


def _cell(row: dict[str, Any]) -> str:
    return row["task"] if row.get("length") is None else f"{row['task']}@{row['length']}"


def _line(event: Any) -> str:
    head = f"[{event.index}/{event.cases}] {event.case.label}"
    if event.reused:
        return f"{head}: reused"
    cells = ", ".join(f"{_cell(r)} {float(r['accuracy']):.1f}" for r in event.rows)
    return f"{head}: {cells} ({event.seconds:.1f} s)"


class _Display:
    """A Rich progress bar on stderr when it is a terminal, else one line per (policy, budget) unless quiet."""

    def __init__(self, quiet: bool, as_json: bool) -> None:
        from rich.console import Console

        self.console = Console(stderr=True)
        self.bar_on = self.console.is_terminal and not quiet and not as_json
        self.lines_on = not self.console.is_terminal and not quiet and not as_json
        self.progress: Any = None
        self.task: Any = None

    def __enter__(self) -> _Display:
        if self.bar_on:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), console=self.console, transient=True)
            self.progress.start()
            self.task = self.progress.add_task("preparing tasks", total=None)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None

    def __call__(self, event: Any) -> None:
        if self.progress is not None:
            self.progress.update(self.task, total=event.total, completed=event.done,
                                 description=f"[{event.index}/{event.cases}] {event.case.label}")
            if event.finished:
                self.progress.console.print(_line(event), highlight=False)
        elif self.lines_on and event.finished:
            sys.stderr.write(_line(event) + "\n")
            sys.stderr.flush()


def _print_table(rows: list[dict[str, Any]]) -> None:
    """One section per (task, length): its name, n and mean prompt tokens in the first column, then a row per
    policy/budget (compact enough for an 80-column terminal; summary.md and --json have every field)."""
    from rich import box
    from rich.table import Table

    from maskkv_cli.bench.quality_report import display_order

    table = Table(title="maskkv bench quality\nacc = accuracy %, ret = retention (acc / full acc), share = budget / "
                  "prompt tokens, s/ans = seconds per answer", title_justify="left", box=box.SIMPLE_HEAD)
    for name, justify in (("task", "left"), ("policy", "left"), ("budget", "right"), ("acc", "right"),
                          ("ret", "right"), ("share", "right"), ("s/ans", "right")):
        table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    ordered = display_order(rows)
    position = 0
    for i, row in enumerate(ordered):
        position = position + 1 if i and _cell(ordered[i - 1]) == _cell(row) else 0
        label = {0: _cell(row), 1: f"[dim]n={row['n']}, {float(row['mean_prompt_tokens']):.0f} tok[/dim]"}
        retention = row.get("retention")
        share = row.get("budget_share")
        table.add_row(label.get(position, ""), row["policy"], "-" if row.get("budget") is None else str(row["budget"]),
                      f"{float(row['accuracy']):.1f}", "-" if retention is None else f"{retention:.2f}",
                      "-" if share is None else f"{share:.1%}", f"{float(row.get('seconds_per_sample') or 0):.2f}",
                      end_section=i + 1 == len(ordered) or _cell(ordered[i + 1]) != _cell(row))
    print_wide(report_console(), table)


def _paired_line(paired: list[dict[str, Any]]) -> str:
    """One line on the task-by-task comparisons (the whole table is in summary.md)."""
    ahead = sum(1 for c in paired if c["wins"] > c["losses"])
    behind = [c for c in paired if c["wins"] < c["losses"]]
    line = (f"{paired[0]['reference']} task by task against the other policies at the same budget: ahead in "
            f"{ahead}, behind in {len(behind)} of {len(paired)} comparisons")
    clear = [c for c in behind if c["p"] < 0.05]
    if clear:
        cells = ", ".join(f"{c['policy']} on {c['task']} {c['length']} @{c['budget']}" for c in clear)
        return f"{line}; significantly behind (sign test p < 0.05): {cells}"
    return f"{line}; none of those significant (sign test p < 0.05)" if behind else line


@guarded
def quality(
    tasks: TasksOpt = ",".join(DEFAULT_KINDS),
    lengths: LengthsOpt = None,
    samples: QualitySamplesOpt = DEFAULT_SAMPLES,
    seed: QualitySeedOpt = 0,
    policies: QualityPoliciesOpt = ",".join(DEFAULT_POLICIES),
    budgets: QualityBudgetsOpt = ",".join(map(str, DEFAULT_BUDGETS)),
    gen_length: QualityGenOpt = None,
    steps: QualityStepsOpt = None,
    block_length: QualityBlockOpt = None,
    model: ModelOpt = None,
    layer_budgets: LayerBudgetsOpt = "auto",
    haystack: HaystackOpt = None,
    prompts: PromptsOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    quantize: QuantizeOpt = None,
    yes: YesOpt = False,
    out: OutOpt = None,
    fresh: FreshOpt = False,
    devices: DevicesOpt = None,
    workers: WorkersOpt = None,
    ray: RayOpt = None,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
    batch_size: CellBatchOpt = "auto",
) -> None:
    """Does eviction keep the answers? Accuracy of every policy and budget on retrieval tasks, and its
    retention (policy accuracy / full-cache accuracy), per task and context length.

    Tasks are generated once per (kind, length) with the model's tokenizer (or read from a LongBench JSONL
    file), then every policy/budget answers every task greedily. Writes a results folder (config.json,
    results.jsonl, predictions.jsonl, summary.md, quality.png); a re-run with identical settings reuses its rows.
    Each row has a 95% interval; summary.md (and --json's "paired") compares maskkv with every other policy at
    the same budget task by task (sign test on the tasks where they differ).

    Examples:

        maskkv bench quality

        maskkv bench quality -n 20 --lengths 256 --policies full,maskkv,snapkv --budgets 8,16,32

        maskkv bench quality --tasks ~/LongBench/data/hotpotqa.jsonl --model ~/models/LLaDA-8B-Instruct --json

        maskkv bench quality --tasks qasper.jsonl --prompts ~/LongBench/config/dataset2prompt.json

        maskkv bench quality --haystack report.pdf --tasks niah_single --lengths 1k

        maskkv bench quality --model ~/models/LLaDA-8B-Instruct --devices cuda:0,cuda:1 --out runs/q8b

        maskkv bench quality --model ~/models/LLaDA-8B-Instruct --ray auto --out runs/q8b

        maskkv bench quality --haystack stdlib-heldout --tasks niah_single,niah_none --lengths 512,1k

        maskkv bench quality --quantize int8 --policies full,maskkv --budgets 64,256
    """
    from maskkv_cli.app.run_settings import RunSettings
    from maskkv_cli.bench.quality import run_quality
    from maskkv_cli.bench.quality_plan import is_tasks_file, parse_kinds, plan_cases
    from maskkv_cli.bench.quality_sources import TaskSource, build_groups, read_haystack, read_tasks_file
    from maskkv_cli.cli.parsing import parse_policies
    from maskkv_cli.defaults import check_dtype, resolve_quantize
    from maskkv_cli.engine.batch_memory import parse_batch_size
    from maskkv_cli.engine.plan import check_layer_budgets
    from maskkv_cli.tasks.longbench import load_templates

    if samples <= 0:
        raise UsageError(f"--samples must be a positive integer, got {samples}")
    check_dtype(dtype)
    out_folder(out)
    weights = resolve_quantize(quantize)
    check_layer_budgets(layer_budgets)
    names = parse_policies(policies)
    budget_list = parse_counts(budgets, "--budgets", unique=True)
    from_file = is_tasks_file(tasks)
    file_groups = None
    paragraphs = None
    kinds: tuple[str, ...] = ()
    length_list: tuple[int, ...] = ()
    if from_file:
        if haystack is not None:
            raise UsageError("--haystack applies to generated tasks; it cannot be used with a --tasks file")
        if lengths is not None:
            note("--lengths is ignored for tasks read from a file (each record keeps its own context)", quiet,
                 as_json)
        file_groups, source = read_tasks_file(Path(tasks).expanduser(), samples)
        label = str(Path(tasks).expanduser())
    elif prompts is not None:
        raise UsageError("--prompts applies to a LongBench --tasks file (.jsonl), not to generated tasks")
    else:
        kinds = parse_kinds(tasks)
        length_list = parse_lengths(lengths)
        if haystack is not None:
            paragraphs, source = read_haystack(haystack)
        else:
            source = TaskSource("corpus", "", "")
        label = ",".join(kinds)
    templates = load_templates(prompts) if prompts is not None else None
    cell_runner = None
    worker_devices = parse_devices(devices, workers, ray)
    if worker_devices or ray:  # rows' cells run on worker processes or Ray actors; this process plans and writes
        from maskkv_cli.batch.cells import PlanningSession, pooled_cells
        from maskkv_cli.batch.run import Runner, make_pool
        from maskkv_cli.batch.worker import WorkerSpec
        from maskkv_cli.models.catalog import default_model

        path, message, known = default_model(model)
        note(message, quiet, as_json)
        pool, device_kind = make_pool(Runner(devices=worker_devices, ray=ray, workers=workers if ray else None,
                                             quiet=quiet or as_json),
                                      WorkerSpec(path, dtype=None if dtype == "auto" else dtype, quantize=weights))
        session = PlanningSession(known or path, None if dtype == "auto" else dtype, device_kind, weights)
        cell_runner = pooled_cells(pool)
    else:
        session = load_session(model, device, dtype, quiet, as_json, yes=yes, quantize=weights)
    stored = session.generation_defaults  # (a one-block family's holds its block length alone: no lengths)
    defaults = stored if set(stored) - {"block_length"} else {**FALLBACK_GENERATION, **stored}
    settings = RunSettings(gen_length=gen_length, steps=steps, block_length=block_length, seed=seed)
    settings.check_family(session.model.config.family)  # a --block-length its sampler has no use for (Dream's)
    gen = settings.generation(defaults)
    cases = plan_cases(names, budget_list)
    with _Display(quiet, as_json) as display:
        groups = build_groups(session, kinds=kinds, lengths=length_list, samples=samples, seed=seed,
                              gen_length=gen.gen_length, haystack=paragraphs, file_groups=file_groups,
                              templates=templates, task_lengths=gen_length is None)
        run = run_quality(session, groups, cases, gen, source=source, tasks_label=label, samples=samples, seed=seed,
                          out=out, fresh=fresh, layer_budgets=layer_budgets, on_progress=display,
                          cell_runner=cell_runner, batch_size=parse_batch_size(batch_size))
    for message in run.notes:
        note(message, quiet, as_json)
    if as_json:
        typer.echo(json.dumps({"results": run.rows, "paired": run.paired}))
        return
    _print_table(run.rows)
    if not quiet and run.paired:
        sys.stderr.write(_paired_line(run.paired) + "\n")
    if not quiet:
        reused = f", {run.reused} rows reused" if run.reused else ""
        quantized = f" ({weights} weights)" if weights != "none" else ""
        sys.stderr.write(f"results: {run.folder}{reused}{quantized}\n")


@guarded
def export_tasks(
    out: Annotated[Path, typer.Argument(help="The JSONL file to write (LongBench format).", show_default=False)],
    tasks: TaskKindsOpt = ",".join(DEFAULT_KINDS),
    lengths: LengthsOpt = None,
    samples: Annotated[int, samples_option("Tasks per (kind, length).", "-n")] = DEFAULT_SAMPLES,
    seed: TasksSeedOpt = 0,
    haystack: HaystackOpt = None,
    model: Annotated[str | None, model_option(
        "Count lengths in this model's tokens [default: the default model's tokenizer].", "-m",
        show_default=False)] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace the file if it exists.")] = False,
    quiet: QuietOpt = False,
) -> None:
    """Write the synthetic tasks `bench quality` generates as LongBench JSONL (context, input, answers, length,
    dataset, _id; needles and target length under "meta"), so other tools can run them and `bench quality
    --tasks FILE` gives the same cells.

    Examples:

        maskkv bench tasks needles.jsonl --lengths 256,1k -n 50

        maskkv bench tasks mine.jsonl --tasks niah_single,vt --haystack report.pdf --model ~/models/LLaDA-8B-Instruct
    """
    from maskkv_cli.bench.quality_plan import parse_kinds
    from maskkv_cli.bench.quality_sources import generate_cells, read_haystack
    from maskkv_cli.models.catalog import resolve_default_model
    from maskkv_cli.prompting import load_tokenizer
    from maskkv_cli.tasks.taskio import save_jsonl

    if samples <= 0:
        raise UsageError(f"--samples must be a positive integer, got {samples}")
    if out.exists() and not force:
        raise UsageError(f"{out} exists; pass --force to replace it or choose another file")
    if out.suffix.lower() != ".jsonl":
        raise UsageError(f"{out}: the tasks file must end in .jsonl (that is how --tasks recognises a file)")
    kinds = parse_kinds(tasks)
    length_list = parse_lengths(lengths)
    paragraphs = read_haystack(haystack)[0] if haystack is not None else None
    path, _ = resolve_default_model(model)
    tokenizer = load_tokenizer(path)

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    generated = [task for _, _, cell in generate_cells(kinds, length_list, samples, seed, paragraphs, count)
                 for task in cell]
    save_jsonl(generated, out)
    if not quiet:
        sys.stderr.write(f"wrote {len(generated)} tasks ({', '.join(kinds)} x {', '.join(map(str, length_list))} "
                         f"tokens of {Path(path).name}, {samples} each, seed {seed}) to {out}\n")
