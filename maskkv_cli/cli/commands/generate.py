"""``maskkv generate``: an answer to a plain prompt (no document), with the run statistics."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from maskkv_cli.cli.asking import echo_answer
from maskkv_cli.cli.common import fail, guarded, live_display_on, note_once, print_wide
from maskkv_cli.cli.options import CfgOpt, RemaskOpt
from maskkv_cli.cli.run_options import CACHE, MODEL, OUTPUT, SAMPLER, RunOptions, run_options
from maskkv_cli.runtime.devices import resolve_device


@guarded
@run_options(*CACHE, *SAMPLER, *MODEL, *OUTPUT)
def generate(
    prompt: Annotated[str, typer.Argument(help="The user message (plain prompt, no document).")],
    cfg: CfgOpt = 0.0,
    remasking: RemaskOpt = "low_confidence",
    *,
    opts: RunOptions,
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
    cache = opts.cache()
    quiet, as_json = opts.quiet, opts.as_json
    session = opts.load_session(resolve_device(opts.device), generates={"cfg_scale": cfg, "remasking": remasking})
    gen = opts.generation(session.generation_defaults, cfg_scale=cfg, remasking=remasking)
    err = Console(stderr=True)
    if live_display_on(quiet, as_json):
        with StepProgress(err, gen.steps) as progress:
            answer = session.answer(prompt, gen, cache, on_event=progress)
    else:
        answer = session.answer(prompt, gen, cache)
    for message in answer.notes:
        note_once(message, quiet, as_json)
    stats = answer.result.stats
    embedded = session.embedded
    if as_json:
        from maskkv_cli.app.pipeline import confidence_fields

        typer.echo(json.dumps({"answer": answer.text, **confidence_fields(answer, "answer", embedded),
                               "model": session.model_path, "budget": answer.budget, "stats": stats.as_dict()}))
        return
    echo_answer(answer.text, answer.confidence, "answer", embedded, quiet, document=False)
    if not quiet:  # the run's figures on stderr, as ask's: `generate ... > answer.txt` keeps the answer alone
        from rich.console import Console

        print_wide(Console(stderr=True), stats_table(stats))
