"""The ``maskkv`` command line: thin commands over the core, and the one place errors become messages."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import typer

from maskkv_cli import __version__
from maskkv_cli.errors import MaskKVError
from maskkv_cli.options import (
    BlockOpt,
    BudgetOpt,
    CfgOpt,
    DeviceOpt,
    DtypeOpt,
    GenLengthOpt,
    JsonOpt,
    ModelOpt,
    PolicyOpt,
    QuietOpt,
    RatioOpt,
    RemaskOpt,
    SeedOpt,
    StepsOpt,
    TemperatureOpt,
    ThresholdOpt,
)

app = typer.Typer(
    name="maskkv",
    help="Ask, summarize and profile long documents with diffusion LLMs (LLaDA) whose prompt KV cache is "
    "compressed with MaskKV.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
)


class _State:
    debug: bool = False


F = TypeVar("F", bound=Callable[..., Any])


def fail(message: str, code: int = 1) -> typer.Exit:
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    return typer.Exit(code)


def guarded(fn: F) -> F:
    """Translate errors into one line on stderr and an exit code; tracebacks only with ``--debug``."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort):
            raise
        except MaskKVError as exc:
            if _State.debug:
                raise
            raise fail(str(exc), exc.exit_code) from None
        except KeyboardInterrupt:
            raise fail("interrupted", 130) from None
        except Exception as exc:
            if _State.debug:
                raise
            if type(exc).__name__ == "OutOfMemoryError":
                raise fail("the device ran out of memory; try a smaller --budget, --dtype bf16, a shorter "
                           "document, or --device cpu") from None
            first = str(exc).splitlines()[0] if str(exc) else ""
            raise fail(f"{type(exc).__name__}: {first} (run with --debug for the traceback)") from None

    return wrapper  # type: ignore[return-value]


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
    _State.debug = debug


def pick_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def note(message: str | None, quiet: bool, as_json: bool) -> None:
    if message and not quiet and not as_json:
        sys.stderr.write(f"note: {message}\n")


@app.command()
@guarded
def generate(
    prompt: Annotated[str, typer.Argument(help="The user message (plain prompt, no document).")],
    model: ModelOpt = None,
    policy: PolicyOpt = "maskkv",
    budget: BudgetOpt = None,
    ratio: RatioOpt = None,
    gen_length: GenLengthOpt = 32,
    steps: StepsOpt = 32,
    block_length: BlockOpt = 32,
    temperature: TemperatureOpt = 0.0,
    threshold: ThresholdOpt = None,
    cfg: CfgOpt = 0.0,
    remasking: RemaskOpt = "low_confidence",
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    seed: SeedOpt = 0,
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

    from maskkv_cli.defaults import resolve_default_model
    from maskkv_cli.policies.base import PolicyOptions
    from maskkv_cli.render import StepProgress, stats_table
    from maskkv_cli.sampler import GenerationConfig
    from maskkv_cli.session import CacheConfig, Session

    if not prompt.strip():
        raise fail("the prompt is empty; pass some text", 2)
    gen = GenerationConfig(gen_length=gen_length, steps=steps, block_length=block_length, temperature=temperature,
                           cfg_scale=cfg, remasking=remasking, threshold=threshold, seed=seed)
    cache = CacheConfig(policy=policy, budget=budget, ratio=ratio, options=PolicyOptions(seed=seed))
    if budget is not None and ratio is not None:
        raise fail("give either --budget or --ratio, not both", 2)
    path, msg = resolve_default_model(model)
    note(msg, quiet, as_json)
    session = Session(path, device=pick_device(device), dtype=None if dtype == "auto" else dtype)
    err = Console(stderr=True)
    live = err.is_terminal and not quiet and not as_json
    if live:
        with StepProgress(err, gen.steps) as progress:
            answer = session.answer(prompt, gen, cache, on_event=progress)
    else:
        answer = session.answer(prompt, gen, cache)
    stats = answer.result.stats
    if as_json:
        typer.echo(json.dumps({"answer": answer.text, "model": path, "budget": answer.budget,
                               "stats": stats.as_dict()}))
        return
    typer.echo(answer.text)
    if not quiet:
        Console(stderr=False).print(stats_table(stats))


@app.command()
def policies() -> None:
    """List the KV-cache policies with a two-line description each."""
    from maskkv_cli.policies.base import REGISTRY, policy_names

    for name in policy_names():
        typer.echo(f"{name:20s} {REGISTRY[name].summary}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
