"""The ``maskkv`` command line: thin commands over the core, and the one place errors become messages."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from maskkv_cli import __version__
from maskkv_cli.allocator import configure_once
from maskkv_cli.cli.commands.calibrate import calibrate
from maskkv_cli.cli.common import (
    State,
    cache_config,
    dream_options,
    fail,
    generation_config,
    guarded,
    live_display_on,
    note,
)
from maskkv_cli.cli.model_choice import load_session
from maskkv_cli.cli.options import (
    AlgOpt,
    BlockOpt,
    BudgetOpt,
    CfgOpt,
    DeviceMapOpt,
    DeviceOpt,
    DtypeOpt,
    GenLengthOpt,
    JsonOpt,
    LayerBudgetsOpt,
    ModelOpt,
    PolicyOpt,
    QuietOpt,
    RatioOpt,
    RemaskOpt,
    SeedOpt,
    StepsOpt,
    TemperatureOpt,
    ThresholdOpt,
    TopKOpt,
    TopPOpt,
    YesOpt,
)
from maskkv_cli.defaults import DEFAULT_POLICY

app = typer.Typer(
    name="maskkv",
    help="Ask, summarize and profile long documents with diffusion LLMs (LLaDA) whose prompt KV cache is "
    "compressed with MaskKV.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"maskkv {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show full tracebacks on errors.")] = False,
) -> None:
    """maskkv: long documents, diffusion LLMs, a compressed KV cache."""
    State.debug = debug


@app.command()
@guarded
def generate(
    prompt: Annotated[str, typer.Argument(help="The user message (plain prompt, no document).")],
    model: ModelOpt = None,
    policy: PolicyOpt = DEFAULT_POLICY,
    layer_budgets: LayerBudgetsOpt = "auto",
    budget: BudgetOpt = None,
    ratio: RatioOpt = None,
    gen_length: GenLengthOpt = None,
    steps: StepsOpt = None,
    block_length: BlockOpt = None,
    temperature: TemperatureOpt = 0.0,
    threshold: ThresholdOpt = None,
    alg: AlgOpt = "entropy",
    top_p: TopPOpt = None,
    top_k: TopKOpt = None,
    cfg: CfgOpt = 0.0,
    remasking: RemaskOpt = "low_confidence",
    device: DeviceOpt = "auto",
    device_map: DeviceMapOpt = None,
    dtype: DtypeOpt = "auto",
    seed: SeedOpt = 0,
    yes: YesOpt = False,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Generate an answer to a plain prompt and show run statistics.

    Examples:

        maskkv generate "Write a haiku about rivers."

        maskkv generate --model ~/models/LLaDA-8B-Instruct -n 64 --steps 64 "What is MaskKV?"

        maskkv generate --policy full --json "Hello"
    """
    from rich.console import Console

    from maskkv_cli.cli.render import StepProgress, stats_table

    if not prompt.strip():
        raise fail("the prompt is empty; pass some text", 2)
    cache = cache_config(policy, budget, ratio, seed, layer_budgets)
    session = load_session(model, device, dtype, quiet, as_json, device_map, yes,
                           dream=dream_options(alg, top_p, top_k))
    gen = generation_config(session.generation_defaults, gen_length, steps, block_length, temperature=temperature,
                            cfg_scale=cfg, remasking=remasking, threshold=threshold, seed=seed)
    err = Console(stderr=True)
    if live_display_on(quiet, as_json):
        with StepProgress(err, gen.steps) as progress:
            answer = session.answer(prompt, gen, cache, on_event=progress)
    else:
        answer = session.answer(prompt, gen, cache)
    for message in answer.notes:
        note(message, quiet, as_json)
    stats = answer.result.stats
    from maskkv_cli.cli.render import answer_lines
    from maskkv_cli.sampling.confidence import is_embedded_model

    embedded = is_embedded_model(session.model_path)
    if as_json:
        from maskkv_cli.cli.commands.documents import confidence_fields

        typer.echo(json.dumps({"answer": answer.text, **confidence_fields(answer, "answer", embedded),
                               "model": session.model_path, "budget": answer.budget, "stats": stats.as_dict()}))
        return
    out, line = answer_lines(answer.text, answer.confidence, "answer", embedded)
    if out is not None:
        typer.echo(out)
    if out is None or not quiet:
        typer.echo(line, err=True)
    if not quiet:
        Console(stderr=False).print(stats_table(stats))


@app.command()
def policies() -> None:
    """List the KV-cache policies with a two-line description each."""
    from maskkv_cli.policies.base import REGISTRY, policy_names

    for name in policy_names():
        summary = REGISTRY[name].summary + (" [default]" if name == DEFAULT_POLICY else "")
        typer.echo(f"{name:20s} {summary}")


app.command()(calibrate)


def _register() -> None:
    from maskkv_cli.cli.commands.documents import ask, summarize
    from maskkv_cli.cli.commands.ingest import ingest
    from maskkv_cli.cli.commands.profile import profile

    app.command()(ingest)
    app.command()(ask)
    app.command()(summarize)
    app.command()(profile)
    from maskkv_cli.cli.commands.pull import models, pull

    app.command()(pull)
    app.command()(models)
    from maskkv_cli.cli.commands.batch import batch

    app.command()(batch)
    from maskkv_cli.cli.commands.train import train_tiny

    app.command("train-tiny")(train_tiny)
    from maskkv_cli.cli.commands.demo import demo

    app.command()(demo)
    from maskkv_cli.cli.commands.evaluate import evaluate

    app.command("eval")(evaluate)
    from maskkv_cli.cli.commands.bench import memory, speed
    from maskkv_cli.cli.commands.bench_quality import export_tasks, quality

    bench_app = typer.Typer(
        help="Benchmarks: speed (no cache vs full cache vs MaskKV over prompt lengths), prefill peak memory, and "
        "answer quality under eviction (with its tasks exported as LongBench JSONL).",
        no_args_is_help=True,
    )
    bench_app.command()(speed)
    bench_app.command()(memory)
    bench_app.command("quality")(quality)
    bench_app.command("tasks")(export_tasks)
    app.add_typer(bench_app, name="bench")


_register()


def main() -> None:
    configure_once()  # already done by ``import maskkv_cli``; repeated here so the entry point states it
    app()


if __name__ == "__main__":
    main()
