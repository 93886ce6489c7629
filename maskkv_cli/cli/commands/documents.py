"""``maskkv ask`` and ``maskkv summarize``: documents in, answers out (``maskkv ingest`` is in ingest.py)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer

from maskkv_cli.cli.common import (
    cache_config,
    dream_options,
    fail,
    generation_config,
    guarded,
    live_display_on,
    note,
    one_line_stats,
)
from maskkv_cli.cli.model_choice import load_session, pull_first
from maskkv_cli.cli.options import (
    AlgOpt,
    BlockOpt,
    BudgetOpt,
    DeviceMapOpt,
    DeviceOpt,
    DtypeOpt,
    GenLengthOpt,
    JsonOpt,
    LayerBudgetsOpt,
    LongOpt,
    ModelOpt,
    PasswordOpt,
    PolicyOpt,
    QuietOpt,
    RatioOpt,
    SeedOpt,
    StepsOpt,
    TemperatureOpt,
    ThresholdOpt,
    TopKOpt,
    TopPOpt,
    YesOpt,
)
from maskkv_cli.defaults import DEFAULT_POLICY
from maskkv_cli.devices import resolve_device


def _consoles(quiet: bool, as_json: bool) -> tuple[Any, bool]:
    from rich.console import Console

    err = Console(stderr=True)
    return err, live_display_on(quiet, as_json)


def _warn(doc: Any, quiet: bool, as_json: bool) -> None:
    for w in doc.warnings:
        note(w, quiet, as_json)


def _questions(question: str | None, extra: list[str] | None, questions_file: Path | None) -> list[str]:
    qs = ([question] if question is not None else []) + list(extra or [])
    if questions_file is not None:
        try:
            text = questions_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise fail(f"cannot read --questions file {questions_file}: {exc}", 2) from None
        qs += [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if not qs:
        raise fail("no question given: pass QUESTION, -q QUESTION or --questions FILE", 2)
    for q in qs:
        if not q.strip():
            raise fail("a question is empty; write the question after the document", 2)
    return qs


@guarded
def ask(
    document: Annotated[Path, typer.Argument(help="PDF, text or Markdown file.", show_default=False)],
    question: Annotated[str | None, typer.Argument(help="The question.", show_default=False)] = None,
    more: Annotated[list[str] | None, typer.Option("--question", "-q", help="More questions (repeatable); the "
                                                   "document is parsed and the model loaded once.",
                                                   show_default=False)] = None,
    questions_file: Annotated[Path | None, typer.Option("--questions", help="A file with one question per line.",
                                                        show_default=False)] = None,
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
    long: LongOpt = "truncate",
    password: PasswordOpt = None,
    device: DeviceOpt = "auto",
    device_map: DeviceMapOpt = None,
    dtype: DtypeOpt = "auto",
    seed: SeedOpt = 0,
    yes: YesOpt = False,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Answer questions about a document with the KV cache compressed by MaskKV (or --policy).

    Examples:

        maskkv ask report.pdf "What does the report conclude?"

        maskkv ask report.pdf -q "Who wrote it?" -q "When?" --budget 128

        maskkv ask book.txt "Where is the treasure?" --long rope-scale --json
    """
    from maskkv_cli.documents.store import DocumentStore

    qs = _questions(question, more, questions_file)
    cache = cache_config(policy, budget, ratio, seed, layer_budgets)
    err, live_on = _consoles(quiet, as_json)
    pull_first(model, yes, quiet, as_json)
    from maskkv_cli.cli.render import LiveRun

    device = resolve_device(device)  # once: the panel reads the memory of the device the session runs on
    with LiveRun(err, live_on, device) as live:
        live.phase("parse", str(document))
        doc, _ = DocumentStore().ingest(document, password=password)
        _warn(doc, quiet, as_json)
        live.phase("load model")
        session = load_session(model, device, dtype, quiet, as_json, device_map, yes,
                               dream=dream_options(alg, top_p, top_k))
        gen = generation_config(session.generation_defaults, gen_length, steps, block_length,
                                temperature=temperature, threshold=threshold, seed=seed)
        results = []
        shown: set[str] = set()
        for i, q in enumerate(qs, 1):
            live.phase("tokenize", f"question {i}/{len(qs)}")
            answer = _ask(session, doc.text, q, gen, cache, long, live)
            for message in [answer.fitted.rule, *answer.notes]:
                if message and message not in shown:
                    shown.add(message)
                    note(message, quiet, as_json)
            results.append((q, answer, answer.fitted))
    from maskkv_cli.sampling.confidence import is_embedded_model

    embedded = is_embedded_model(session.model_path)
    if as_json:
        typer.echo(json.dumps({
            "document": {"source": str(document), "sha256": doc.sha256, "pages": len(doc.pages),
                         "chars": doc.n_chars},
            "model": session.model_path,
            "answers": [{"question": q, "answer": a.text, **confidence_fields(a, "answer", embedded),
                         "policy": cache.policy, "budget": a.budget,
                         "prompt_tokens": a.prompt_len, "dropped_tokens": f.dropped, "rope_factor": f.rope_factor,
                         "stats": a.result.stats.as_dict()} for q, a, f in results],
        }))
        return
    _print_answers(results, quiet, embedded)


def confidence_fields(answer: Any, what: str, embedded: bool) -> dict[str, Any]:
    """``confidence`` (mean/min token probability, or null for an empty answer) and, for an empty one, ``note``."""
    from maskkv_cli.sampling.confidence import empty_note

    fields: dict[str, Any] = {"confidence": answer.confidence.as_dict() if answer.confidence else None}
    if not answer.text.strip():
        fields["note"] = empty_note(what, embedded)
    return fields


def _print_answers(results: list[tuple[str, Any, Any]], quiet: bool, embedded: bool) -> None:
    """One answer: the text on stdout, its confidence on stderr. Several: Q/A/confidence blocks on stdout.
    An empty answer is never a blank line: a note says so (even with --quiet, since it stands for the answer)."""
    from maskkv_cli.cli.render import answer_lines

    empty_notes: list[str] = []
    for q, a, _ in results:
        out, line = answer_lines(a.text, a.confidence, "answer", embedded)
        if len(results) > 1:
            typer.echo(f"Q: {q}")
            typer.echo(f"A: {out if out is not None else '(no answer, see the note below)'}")
            if out is not None:
                typer.echo(f"   {line}")
            else:
                empty_notes.append(line)
            typer.echo("")
        elif out is not None:
            typer.echo(out)
            if not quiet:
                typer.echo(line, err=True)
        else:
            empty_notes.append(line)
        if not quiet:
            typer.echo(one_line_stats(a.result.stats), err=True)
    if empty_notes:
        typer.echo(empty_notes[0], err=True)


def _ask(session: Any, context: str, question: str, gen: Any, cache: Any, long: str, live: Any) -> Any:
    """``pipeline.ask`` with the live display following its prompt, steps and cache."""
    from maskkv_cli.pipeline import ask

    answer = ask(session, context, question, gen, cache, long=long, on_event=live, on_prompt=live.prompt_ready)
    live.answered(answer)
    return answer


@guarded
def summarize(
    document: Annotated[Path, typer.Argument(help="PDF, text or Markdown file.", show_default=False)],
    length: Annotated[int, typer.Option("--length", help="Target length of the summary in words.")] = 150,
    model: ModelOpt = None,
    policy: PolicyOpt = DEFAULT_POLICY,
    layer_budgets: LayerBudgetsOpt = "auto",
    budget: BudgetOpt = None,
    ratio: RatioOpt = None,
    steps: StepsOpt = None,
    block_length: BlockOpt = None,
    temperature: TemperatureOpt = 0.0,
    threshold: ThresholdOpt = None,
    alg: AlgOpt = "entropy",
    top_p: TopPOpt = None,
    top_k: TopKOpt = None,
    password: PasswordOpt = None,
    device: DeviceOpt = "auto",
    device_map: DeviceMapOpt = None,
    dtype: DtypeOpt = "auto",
    seed: SeedOpt = 0,
    yes: YesOpt = False,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Summarize a document of any length: summarize parts (whole pages), then the summaries.

    Examples:

        maskkv summarize report.pdf

        maskkv summarize book.txt --length 300 --budget 128 --json
    """
    from maskkv_cli.cli.render import LiveRun
    from maskkv_cli.documents.store import DocumentStore
    from maskkv_cli.prompting.parts import merge_instruction, part_instruction, split_parts

    if length <= 0:
        raise fail(f"--length must be a positive number of words, got {length}", 2)
    cache = cache_config(policy, budget, ratio, seed, layer_budgets)
    err, live_on = _consoles(quiet, as_json)
    pull_first(model, yes, quiet, as_json)
    device = resolve_device(device)  # once: the panel reads the memory of the device the session runs on
    with LiveRun(err, live_on, device) as live:
        live.phase("parse", str(document))
        doc, _ = DocumentStore().ingest(document, password=password)
        _warn(doc, quiet, as_json)
        live.phase("load model")
        session = load_session(model, device, dtype, quiet, as_json, device_map, yes,
                               dream=dream_options(alg, top_p, top_k))
        if session.summary_length:
            # a model trained on lead summaries (the embedded one) writes them at the length it was trained on
            gen_tokens = session.summary_length
            block = block_length or session.summary_block or gen_tokens
        else:
            block = block_length or 32
            gen_tokens = max(block, -(-int(length * 1.6) // block) * block)
        gen = generation_config({}, gen_tokens, steps, block, temperature=temperature, threshold=threshold,
                                seed=seed)
        room = session.window - session.prompt_overhead(part_instruction(length)) - gen.gen_length
        if room < 64:
            raise fail(f"--length {length} leaves no room for the document in the {session.window}-token window", 2)
        parts = split_parts(doc, session.count_tokens, room)
        summaries = []
        for i, part in enumerate(parts, 1):
            live.phase(f"part {i}/{len(parts)}", f"pages {part.first_page}-{part.last_page}")
            if not quiet and not as_json and not live_on:
                typer.echo(f"part {i}/{len(parts)} (pages {part.first_page}-{part.last_page}, {part.tokens} tokens)",
                           err=True)
            a = _ask(session, part.text, part_instruction(length), gen, cache, "truncate", live)
            summaries.append({"pages": [part.first_page, part.last_page], "tokens": part.tokens, "summary": a.text,
                              "confidence": a.confidence.as_dict() if a.confidence else None})
        final = parts_answer = a
        written = [s["summary"] for s in summaries if s["summary"].strip()]
        if len(summaries) > 1 and written:  # parts that gave no summary add nothing to the merge
            live.phase("merge", f"{len(written)} summaries")
            # a lead-summary model is asked for the lead of the joined summaries (the document's first sentences),
            # the one summary format it was trained on
            merge = part_instruction(length) if session.summary_length else merge_instruction(length)
            final = _ask(session, "\n\n".join(written), merge, gen, cache, "truncate", live)
        elif len(summaries) > 1:
            final = replace(parts_answer, text="", confidence=None)
    from maskkv_cli.sampling.confidence import is_embedded_model

    embedded = is_embedded_model(session.model_path)
    if as_json:
        typer.echo(json.dumps({"document": str(document), "pages": len(doc.pages), "summary": final.text,
                               **confidence_fields(final, "summary", embedded), "parts": summaries}))
        return
    from maskkv_cli.cli.render import answer_lines

    out, line = answer_lines(final.text, final.confidence, "summary", embedded)
    if out is not None:
        typer.echo(out)
    if out is None or not quiet:
        typer.echo(line, err=True)
