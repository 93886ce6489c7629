"""``maskkv generate``: an answer to a plain prompt (no document), with the run statistics."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from maskkv_cli.cli.common import cache_config, dream_options, fail, generation_config, guarded, live_display_on, note
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
    from maskkv_cli.models.catalog import is_embedded_model

    embedded = is_embedded_model(session.model_path)
    if as_json:
        from maskkv_cli.pipeline import confidence_fields

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
