"""``maskkv train-tiny``: train the small retrieval LLaDA that ships as the embedded default."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from maskkv_cli.cli.common import guarded, note
from maskkv_cli.cli.options import TrainOutOpt, TrainSeedOpt, json_option, steps_option, threads_option
from maskkv_cli.errors import UsageError


@guarded
def train_tiny(
    out: TrainOutOpt = Path("runs/tiny"),
    steps: Annotated[int, steps_option("Optimizer steps in all.")] = 3000,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Examples per step.")] = 32,
    lr: Annotated[float, typer.Option("--lr", help="Peak learning rate (AdamW, warm-up then cosine).")] = 2e-3,
    min_len: Annotated[int, typer.Option("--min-len", help="Shortest context in tokens.")] = 48,
    max_len: Annotated[int, typer.Option("--max-len", help="Longest context in tokens (curriculum end).")] = 512,
    curriculum_steps: Annotated[int, typer.Option("--curriculum-steps", help="Steps to reach --max-len.")] = 1500,
    kinds: Annotated[str, typer.Option("--kinds", help="Task kinds, equally mixed; KIND:W weights one "
                                       "(niah_multikey:3,niah_single:1). absent_pair: a niah_multikey example and "
                                       "its absent-key twin (the same text asked about a key with no needle) side "
                                       "by side.")] = "niah_single,niah_multikey",
    distractors: Annotated[str, typer.Option("--distractors", help="Distractor needles per niah_multikey training "
                                             "example: N or LOW-HIGH, drawn per example (the in-run evaluation "
                                             "keeps the benchmark's 3).")] = "3",
    answer_len: Annotated[int, typer.Option("--answer-len", help="Answer region in tokens.")] = 8,
    sources: Annotated[str, typer.Option("--sources", help="Haystack sources, equally mixed; NAME:W weights one "
                                         "(stdlib-train:2,pdf-train,corpus). Names: see `maskkv bench quality "
                                         "--help` (--haystack).")] = "corpus",
    summary_len: Annotated[int, typer.Option("--summary-len", help="Answer region of lead_summary examples in "
                                             "tokens.")] = 64,
    eval_source: Annotated[str, typer.Option("--eval-source", help="Haystack source of the in-run evaluation.")
                           ] = "corpus",
    eval_n: Annotated[int, typer.Option("--eval-n", help="Tasks per kind in the in-run evaluation (at --max-len); "
                                        "one task of 32 is 3 points, so compare runs with more.")] = 32,
    eval_every: Annotated[int, typer.Option("--eval-every", help="Steps between in-run evaluations.")] = 250,
    full_mask: Annotated[float, typer.Option("--full-mask", help="Probability of masking an example's whole "
                                             "answer region (else k ~ U{1..R} tokens).")] = 0.0,
    summary_full_mask: Annotated[float | None, typer.Option(
        "--summary-full-mask", help="--full-mask for lead_summary batches [default: --full-mask].",
        show_default=False)] = None,
    summary_lengths: Annotated[str | None, typer.Option(
        "--summary-lengths", help="Context tokens of lead_summary batches, LOW-HIGH (e.g. 24-128: the model learns "
        "to copy where the text is near) [default: --min-len to --max-len, as the other batches].",
        show_default=False)] = None,
    summary_block: Annotated[int | None, typer.Option(
        "--summary-block", help="Train lead summaries for decoding in blocks of this many tokens (block diffusion: "
        "earlier blocks visible, later ones masked; one block's tokens in the loss per example, so less signal per "
        "step: on the tiny model it did not copy sooner, docs/tiny-model.md stage 21); summarize then decodes in "
        "such blocks [default: the whole summary is one block].",
        show_default=False)] = None,
    identity_loss: Annotated[float, typer.Option(
        "--identity-loss", help="Weight of an auxiliary loss that predicts every visible token as itself, which "
        "teaches the head to read back any token it is given (what copying text, e.g. a lead summary, needs) "
        "[default: 0, the plain masked objective].")] = 0.0,
    hard_absent_every: Annotated[int, typer.Option(
        "--hard-absent-every", help="With absent_pair in --kinds: every this many steps, measure which absent keys "
        "the model mistakes for the keys whose needles are present (every pair of key words, on short texts), and "
        "ask the twins about those keys more often (hard negatives) [default: 0, keys drawn uniformly].")] = 0,
    position_window: Annotated[int | None, typer.Option(
        "--position-window", help="Spread RoPE positions over this many tokens with random skips (PoSE), so the "
        "model meets longer distances than its contexts.", show_default=False)] = None,
    init_from: Annotated[Path | None, typer.Option("--init-from", help="Start from this model's weights and "
                                                   "tokenizer (e.g. a first, short-context stage).",
                                                   show_default=False)] = None,
    grow_layers: Annotated[int, typer.Option("--grow-layers", help="With --init-from: add this many blocks, "
                                             "each a copy of the one before with zeroed output projections, so "
                                             "training starts from the same function (block expansion).")] = 0,
    freeze_old: Annotated[bool, typer.Option("--freeze-old", help="With --grow-layers: train only the new blocks, "
                                             "the final norm and the output head; the trained blocks keep what "
                                             "they know (LLaMA Pro).")] = False,
    rope_theta: Annotated[float | None, typer.Option(
        "--rope-theta", help="RoPE base [default: 10000 for a new model; with --init-from, the model's own]. A larger "
        "base on a trained model (then trained on) helps it match text far away.", show_default=False)] = None,
    stop_after: Annotated[int | None, typer.Option("--stop-after", help="End after this many steps; the learning-"
                                                   "rate schedule still spans --steps.", show_default=False)] = None,
    d_model: Annotated[int, typer.Option("--d-model")] = 128,
    n_layers: Annotated[int, typer.Option("--layers")] = 4,
    n_heads: Annotated[int, typer.Option("--heads")] = 8,
    threads: Annotated[int, threads_option("torch threads (1 for a background run).")] = 1,
    seed: TrainSeedOpt = 0,
    install: Annotated[bool, typer.Option("--install", help="Copy the final model into the package as the "
                                          "embedded default (maskkv_cli/assets/tiny-llada).")] = False,
    window: Annotated[int | None, typer.Option(
        "--window", help="With --install: the model's window (max_sequence_length) [default: twice --max-len].",
        show_default=False)] = None,
    as_json: Annotated[bool, json_option("One JSON line per logged step.")] = False,
) -> None:
    """Train the tiny LLaDA on synthetic needle tasks (masked-diffusion objective), resumable.

    Examples:

        maskkv train-tiny --out runs/tiny --steps 3000

        OMP_NUM_THREADS=1 nohup maskkv train-tiny --out runs/tiny --json > train.log &
    """
    from maskkv_cli.tasks.sources import SOURCES
    from maskkv_cli.tasks.synthetic import max_distractors
    from maskkv_cli.training.config import TrainConfig, TrainEvent, parse_mix, parse_range, parse_sources
    from maskkv_cli.training.train import install_model, train

    mix = parse_mix(kinds)
    source_mix = parse_sources(sources)
    if eval_source not in SOURCES:
        raise UsageError(f"--eval-source: unknown source {eval_source!r}; choose from {', '.join(SOURCES)}")
    if summary_len < 2:
        raise UsageError(f"--summary-len must be at least 2 tokens, got {summary_len}")
    distractor_range = parse_range(distractors, "--distractors")
    summary_range = parse_range(summary_lengths, "--summary-lengths") if summary_lengths else None
    if summary_range is not None and summary_range[0] < 1:
        raise UsageError(f"--summary-lengths: contexts must be at least 1 token, got {summary_lengths!r}")
    if distractor_range[1] > max_distractors():  # checked here, before any training starts
        raise UsageError(f"--distractors: at most {max_distractors()} (one key word each), got {distractors!r}")
    if rope_theta is not None and rope_theta <= 1:
        raise UsageError(f"--rope-theta must be greater than 1, got {rope_theta}")
    if grow_layers and init_from is None:
        raise UsageError("--grow-layers adds blocks to a trained model: give it with --init-from")
    if freeze_old and not grow_layers:
        raise UsageError("--freeze-old keeps the trained blocks fixed while new ones learn: give --grow-layers too")
    if not 0 <= grow_layers:
        raise UsageError(f"--grow-layers must be >= 0, got {grow_layers}")
    if eval_n < 1 or eval_every < 1:
        raise UsageError(f"--eval-n and --eval-every must be positive, got {eval_n} and {eval_every}")
    if not 0.0 <= full_mask <= 1.0:
        raise UsageError(f"--full-mask must be a probability between 0 and 1, got {full_mask}")
    if hard_absent_every < 0:
        raise UsageError(f"--hard-absent-every must be >= 0 (0: off), got {hard_absent_every}")
    if identity_loss < 0:
        raise UsageError(f"--identity-loss must be >= 0, got {identity_loss}")
    if summary_block is not None and (summary_block < 1 or summary_len % summary_block):
        raise UsageError(f"--summary-block must be a positive divisor of --summary-len ({summary_len}), "
                         f"got {summary_block}")
    if summary_full_mask is not None and not 0.0 <= summary_full_mask <= 1.0:
        raise UsageError(f"--summary-full-mask must be a probability between 0 and 1, got {summary_full_mask}")
    cfg = TrainConfig(out=str(out), steps=steps, batch_size=batch_size, lr=lr, min_len=min_len, max_len=max_len,
                      curriculum_steps=curriculum_steps, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
                      mlp_hidden_size=3 * d_model, threads=threads, seed=seed, answer_len=answer_len,
                      full_mask=full_mask, position_window=position_window, distractors=distractor_range,
                      eval_n=eval_n, eval_every=eval_every, sources=source_mix, summary_len=summary_len,
                      eval_source=eval_source, summary_full_mask=summary_full_mask, identity_loss=identity_loss,
                      summary_block=summary_block, summary_lengths=summary_range, mix=mix,
                      init_from=str(init_from) if init_from else None,
                      grow_layers=grow_layers, freeze_old=freeze_old, rope_theta=rope_theta,
                      stop_after=stop_after, hard_absent_every=hard_absent_every)

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
    if install:
        target = install_model(final, window=window,
                               summary_length=summary_len if "lead_summary" in mix else None,
                               summary_block=summary_block if "lead_summary" in mix else None)
        note(f"installed as the embedded default: {target}", False, as_json)
