"""``maskkv train-tiny``: train the small retrieval LLaDA that ships as the embedded default.

The options are the fields of ``training.config.TrainOptions``: the table below declares each one (in ``--help``
order), and the command gets them as one object, which ``TrainOptions.to_config`` checks and turns into the run's
``TrainConfig``.
"""

from __future__ import annotations

import inspect
import json
import sys
from typing import Annotated, Any

import typer

from maskkv_cli.cli.common import guarded, note
from maskkv_cli.cli.options import (
    batch_size_option,
    json_option,
    options_command,
    out_option,
    seed_option,
    steps_option,
    threads_option,
)
from maskkv_cli.cli.parsing import out_folder
from maskkv_cli.training.config import TrainOptions

# Each TrainOptions field's option, in the order of the fields.
OPTIONS: dict[str, Any] = {
    "out": out_option("Run folder (checkpoints, log); an existing run resumes."),
    "steps": steps_option("Optimizer steps in all."),
    "batch_size": batch_size_option("Examples per step."),
    "lr": typer.Option("--lr", help="Peak learning rate (AdamW, warm-up then cosine)."),
    "min_len": typer.Option("--min-len", help="Shortest context in tokens."),
    "max_len": typer.Option("--max-len", help="Longest context in tokens (curriculum end)."),
    "curriculum_steps": typer.Option("--curriculum-steps", help="Steps to reach --max-len."),
    "kinds": typer.Option(
        "--kinds", help="Task kinds, equally mixed; KIND:W weights one (niah_multikey:3,niah_single:1). "
        "absent_pair: a niah_multikey example and its absent-key twin (the same text asked about a key with no "
        "needle) side by side."),
    "distractors": typer.Option(
        "--distractors", help="Distractor needles per niah_multikey training example: N or LOW-HIGH, drawn per "
        "example (the in-run evaluation keeps the benchmark's 3)."),
    "answer_len": typer.Option("--answer-len", help="Answer region in tokens."),
    "sources": typer.Option(
        "--sources", help="Haystack sources, equally mixed; NAME:W weights one (stdlib-train:2,pdf-train,corpus). "
        "Names: see `maskkv bench quality --help` (--haystack)."),
    "summary_len": typer.Option("--summary-len", help="Answer region of lead_summary examples in tokens."),
    "eval_source": typer.Option("--eval-source", help="Haystack source of the in-run evaluation."),
    "eval_n": typer.Option(
        "--eval-n", help="Tasks per kind in the in-run evaluation (at --max-len); one task of 32 is 3 points, so "
        "compare runs with more."),
    "eval_every": typer.Option("--eval-every", help="Steps between in-run evaluations."),
    "full_mask": typer.Option(
        "--full-mask", help="Probability of masking an example's whole answer region (else k ~ U{1..R} tokens)."),
    "summary_full_mask": typer.Option(
        "--summary-full-mask", help="--full-mask for lead_summary batches [default: --full-mask].",
        show_default=False),
    "summary_lengths": typer.Option(
        "--summary-lengths", help="Context tokens of lead_summary batches, LOW-HIGH (e.g. 24-128: the model learns "
        "to copy where the text is near) [default: --min-len to --max-len, as the other batches].",
        show_default=False),
    "summary_block": typer.Option(
        "--summary-block", help="Train lead summaries for decoding in blocks of this many tokens (block diffusion: "
        "earlier blocks visible, later ones masked; one block's tokens in the loss per example, so less signal per "
        "step: on the tiny model it did not copy sooner, docs/tiny-model.md stage 21); summarize then decodes in "
        "such blocks [default: the whole summary is one block].", show_default=False),
    "identity_loss": typer.Option(
        "--identity-loss", help="Weight of an auxiliary loss that predicts every visible token as itself, which "
        "teaches the head to read back any token it is given (what copying text, e.g. a lead summary, needs) "
        "[default: 0, the plain masked objective]."),
    "hard_absent_every": typer.Option(
        "--hard-absent-every", help="With absent_pair in --kinds: every this many steps, measure which absent keys "
        "the model mistakes for the keys whose needles are present (every pair of key words, on short texts), and "
        "ask the twins about those keys more often (hard negatives) [default: 0, keys drawn uniformly]."),
    "position_window": typer.Option(
        "--position-window", help="Spread RoPE positions over this many tokens with random skips (PoSE), so the "
        "model meets longer distances than its contexts.", show_default=False),
    "init_from": typer.Option(
        "--init-from", help="Start from this model's weights and tokenizer (e.g. a first, short-context stage).",
        show_default=False),
    "grow_layers": typer.Option(
        "--grow-layers", help="With --init-from: add this many blocks, each a copy of the one before with zeroed "
        "output projections, so training starts from the same function (block expansion)."),
    "freeze_old": typer.Option(
        "--freeze-old", help="With --grow-layers: train only the new blocks, the final norm and the output head; "
        "the trained blocks keep what they know (LLaMA Pro)."),
    "rope_theta": typer.Option(
        "--rope-theta", help="RoPE base [default: 10000 for a new model; with --init-from, the model's own]. A "
        "larger base on a trained model (then trained on) helps it match text far away.", show_default=False),
    "stop_after": typer.Option(
        "--stop-after", help="End after this many steps; the learning-rate schedule still spans --steps.",
        show_default=False),
    "d_model": typer.Option("--d-model"),
    "n_layers": typer.Option("--layers"),
    "n_heads": typer.Option("--heads"),
    "threads": threads_option("torch threads (1 for a background run)."),
    "seed": seed_option(),
    "install": typer.Option(
        "--install", help="Copy the final model into the package as the embedded default "
        "(maskkv_cli/assets/tiny-llada)."),
    "window": typer.Option(
        "--window", help="With --install: the model's window (max_sequence_length) [default: twice --max-len].",
        show_default=False),
}


def _train_tiny(options: TrainOptions, as_json: bool = False) -> None:
    """Train the tiny LLaDA on synthetic needle tasks (masked-diffusion objective), resumable.

    Examples:

        maskkv train-tiny --out runs/tiny --steps 3000

        OMP_NUM_THREADS=1 nohup maskkv train-tiny --out runs/tiny --json > train.log &
    """
    from maskkv_cli.training.config import TrainEvent
    from maskkv_cli.training.train import install_model, train

    out_folder(options.out)
    cfg = options.to_config()  # every option checked here, before any training starts

    def show(e: TrainEvent) -> None:
        row = {"step": e.step, "loss": round(e.loss, 4), "lr": e.lr, "len": e.length, "t": round(e.elapsed_s)}
        if e.eval:
            row["eval"] = e.eval
        if e.absent_confusion is not None:
            row["absent_confusion"] = round(e.absent_confusion, 4)
        if as_json:
            typer.echo(json.dumps(row))
        else:
            evals = "  " + ", ".join(f"{k} {v:.2f}" for k, v in e.eval.items()) if e.eval else ""
            if e.absent_confusion is not None:
                evals += f"  absent-key confusion {e.absent_confusion:.3f}"
            sys.stderr.write(f"step {e.step}/{e.steps}  loss {e.loss:.4f}  len {e.length}  {e.elapsed_s:.0f}s{evals}\n")

    final = train(cfg, show)
    note(f"final model saved to {final}", False, as_json)
    if options.install:
        summaries = "lead_summary" in cfg.mix
        target = install_model(final, window=options.window,
                               summary_length=cfg.summary_len if summaries else None,
                               summary_block=cfg.summary_block if summaries else None)
        note(f"installed as the embedded default: {target}", False, as_json)


train_tiny = guarded(options_command(TrainOptions, OPTIONS, _train_tiny, extra=[
    inspect.Parameter("as_json", inspect.Parameter.KEYWORD_ONLY, default=False,
                      annotation=Annotated[bool, json_option("One JSON line per logged step.")]),
]))
