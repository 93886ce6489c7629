"""``maskkv demo``: hide a fact in a real text, ask for it with MaskKV, and compare with the full cache."""

from __future__ import annotations

import json
import time
from typing import Annotated

import typer

from maskkv_cli.cli.common import fail, guarded, one_line_stats
from maskkv_cli.cli.model_choice import load_session
from maskkv_cli.cli.options import (
    DeviceOpt,
    JsonOpt,
    ModelOpt,
    QuantizeOpt,
    QuietOpt,
    SeedOpt,
    YesOpt,
    budget_option,
    length_option,
)
from maskkv_cli.defaults import DEFAULT_POLICY
from maskkv_cli.runtime.fileio import atomic_write_text


@guarded
def demo(
    model: ModelOpt = None,
    budget: Annotated[int, budget_option(
        "Prompt K/V pairs kept per head per layer in the MaskKV run [default: 16].", "-b", show_default=False)] = 16,
    length: Annotated[int, length_option("Document length in tokens.")] = 250,
    seed: SeedOpt = 0,
    device: DeviceOpt = "auto",
    quantize: QuantizeOpt = None,
    yes: YesOpt = False,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Write a short document (a text from the package with one hidden fact), ask for the fact with MaskKV at a
    small budget and with the full cache, and show both answers with their memory and speed.

    Both runs are timed after a warm-up run of each (one-time costs: thread pools, the allocator, kernels chosen
    for these shapes); the model's load and the warm-up are shown apart.

    Examples:

        maskkv demo

        maskkv demo --budget 8 --length 500

        maskkv demo --quantize int8
    """
    from maskkv_cli.app.pipeline import ask
    from maskkv_cli.app.run_settings import RunSettings
    from maskkv_cli.defaults import resolve_quantize
    from maskkv_cli.paths import maskkv_home
    from maskkv_cli.tasks.metrics import score
    from maskkv_cli.tasks.synthetic import generate_tasks

    if length < 1:
        raise fail(f"--length must be a positive number of tokens, got {length}", 2)
    weights = resolve_quantize(quantize)
    from maskkv_cli.cli.parsing import writable_folder

    demo_folder = writable_folder(maskkv_home() / "demo", "the demo's document", "set MASKKV_HOME to a folder you "
                                  "can write")
    started = time.perf_counter()
    session = load_session(model, device, "auto", quiet, as_json, yes=yes, quantize=weights)
    load_s = time.perf_counter() - started
    task = generate_tasks("niah_single", 1, length, seed=seed, count_tokens=session.count_tokens)[0]
    doc = atomic_write_text(demo_folder / "demo.txt", task.context)
    gen = RunSettings(seed=seed).generation(session.generation_defaults)
    caches = [(policy, RunSettings(policy=policy, budget=b, seed=seed).cache())
              for policy, b in ((DEFAULT_POLICY, budget), ("full", None))]
    started = time.perf_counter()
    for _, cache in caches:  # warm-up: each run once, untimed, so that neither pays the first run's costs
        ask(session, task.context, task.input, gen, cache)
    warmup_s = time.perf_counter() - started
    runs = []
    for policy, cache in caches:
        answer = ask(session, task.context, task.input, gen, cache)
        runs.append((policy, answer, score(task.dataset, answer.text, list(task.answers))))
    if as_json:
        typer.echo(json.dumps({"document": str(doc), "question": task.input, "expected": task.answers[0],
                               "load_s": round(load_s, 4), "warmup_s": round(warmup_s, 4),
                               "runs": [{"policy": p, "budget": a.budget, "answer": a.text, "correct": bool(s),
                                         "confidence": a.confidence.as_dict() if a.confidence else None,
                                         "stats": a.result.stats.as_dict()} for p, a, s in runs]}))
        return
    parts = runs[0][1].fitted.parts
    size = (f"{len(session.document_ids(task.context))} tokens, read in {parts} parts" if parts > 1 else
            f"{runs[0][1].prompt_len} prompt tokens")  # (the parts' prompts overlap: their sum is no size)
    typer.echo(f"document: {doc} ({size}, a text from the package with one fact hidden in it)")
    typer.echo(f"question: {task.input}")
    typer.echo(f"expected: {task.answers[0]}")
    labels = [f"{policy} (budget {answer.budget})" if answer.budget else policy for policy, answer, _ in runs]
    width = max(20, *map(len, labels))
    for label, (_, answer, correct) in zip(labels, runs, strict=True):
        conf = answer.confidence
        sure = (f", confidence {conf.mean:.2f} mean, {conf.min:.2f} min" + (" (LOW)" if conf.low else "")
                if conf else ", no answer")
        typer.echo(f"{label:>{width}}: {answer.text!r} {'correct' if correct else 'wrong'}{sure}")
        if not quiet:
            typer.echo(f"{'':>{width}}  {one_line_stats(answer.result.stats, answer.fitted.parts)}")
    if not quiet:
        typer.echo(f"timed after a warm-up run of each ({warmup_s:.2f} s for both: one-time costs, not counted); "
                   f"model load {load_s:.2f} s")
