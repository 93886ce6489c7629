"""The ``maskkv`` command line: the Typer app and where every command is registered (one module per command in
``cli/commands/``; errors become messages in ``cli/common.py`` ``guarded``)."""

from __future__ import annotations

from typing import Annotated

import typer

from maskkv_cli import __version__
from maskkv_cli.cli.common import State
from maskkv_cli.runtime.allocator import configure_once

app = typer.Typer(
    name="maskkv",
    help="Ask, summarize and profile long documents with diffusion LLMs (LLaDA, Dream, LLaDA2, DiffusionGemma) "
    "whose prompt KV cache is "
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


def _register() -> None:
    """Every command, in the order ``maskkv --help`` lists them: one module per command in ``cli/commands/``."""
    from maskkv_cli.cli.commands.ask import ask
    from maskkv_cli.cli.commands.batch import batch
    from maskkv_cli.cli.commands.bench import loading, memory, reuse, speed
    from maskkv_cli.cli.commands.bench_quality import export_tasks, quality
    from maskkv_cli.cli.commands.calibrate import calibrate
    from maskkv_cli.cli.commands.demo import demo
    from maskkv_cli.cli.commands.evaluate import evaluate
    from maskkv_cli.cli.commands.generate import generate
    from maskkv_cli.cli.commands.ingest import ingest
    from maskkv_cli.cli.commands.plan import plan
    from maskkv_cli.cli.commands.policies import policies
    from maskkv_cli.cli.commands.profile import profile
    from maskkv_cli.cli.commands.pull import models, pull
    from maskkv_cli.cli.commands.serve import serve
    from maskkv_cli.cli.commands.summarize import summarize
    from maskkv_cli.cli.commands.train import train_tiny

    for command in (generate, policies, calibrate, ingest, ask, summarize, profile, plan, pull, models, batch, serve):
        app.command()(command)
    app.command("train-tiny")(train_tiny)
    app.command()(demo)
    app.command("eval")(evaluate)

    bench_app = typer.Typer(
        help="Benchmarks: speed (no cache vs full cache vs MaskKV over prompt lengths), prefill peak memory, the peak "
        "memory of loading (quantized or not), a document's stored cache reused across questions, and answer "
        "quality under eviction (with its tasks exported as LongBench JSONL).",
        no_args_is_help=True,
    )
    bench_app.command()(speed)
    bench_app.command()(memory)
    bench_app.command()(loading)
    bench_app.command()(reuse)
    bench_app.command("quality")(quality)
    bench_app.command("tasks")(export_tasks)
    app.add_typer(bench_app, name="bench")


_register()


def main() -> None:
    configure_once()  # already done by ``import maskkv_cli``; repeated here so the entry point states it
    app()


if __name__ == "__main__":
    main()
