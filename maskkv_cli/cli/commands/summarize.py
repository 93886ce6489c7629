"""``maskkv summarize``: a document of any length summarized part by part, then the parts' summaries merged."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer

from maskkv_cli.cli.asking import ask_live, document_run, echo_answer
from maskkv_cli.cli.common import fail, guarded, note
from maskkv_cli.cli.options import PasswordOpt, length_option
from maskkv_cli.cli.run_options import CACHE, MODEL, OUTPUT, SAMPLER, RunOptions, run_options


@guarded
@run_options(*CACHE, *[n for n in SAMPLER if n != "gen_length"], *MODEL, *OUTPUT)
def summarize(
    document: Annotated[Path, typer.Argument(help="PDF, text or Markdown file.", show_default=False)],
    length: Annotated[int, length_option("Length of the summary in words: the final summary's token budget (about "
                                         "1.6 tokens a word) and its most words.")] = 150,
    password: PasswordOpt = None,
    *,
    opts: RunOptions,
) -> None:
    """Summarize a document of any length: summarize parts (whole pages), then the summaries.

    When the final pass only repeats the parts' summaries (a model that writes lead summaries, as the embedded one),
    the parts' summaries are shown, each with its pages.

    Examples:

        maskkv summarize report.pdf

        maskkv summarize book.txt --length 300 --budget 128 --json
    """
    from maskkv_cli.documents.reading import check_source

    check_source(document)  # a wrong path fails at once, before anything heavy is imported or loaded

    from maskkv_cli.app.pipeline import MIN_PART_ROOM, says_absent, used_every_token
    from maskkv_cli.prompting.parts import (
        adds_nothing,
        merge_instruction,
        part_instruction,
        split_parts,
        summary_tokens,
        trim_summary,
    )

    if length <= 0:
        raise fail(f"--length must be a positive number of words, got {length}", 2)
    cache = opts.cache()
    quiet, as_json = opts.quiet, opts.as_json
    gens: list[Any] = []  # each part's and the final summary's generation settings, made before the model loads

    def check(folder: Any) -> None:  # over the model's stored summary length (what its session reads too)
        from maskkv_cli.models.families import family

        stored = folder.defaults
        gens.extend(summary_generations(opts, length, stored.summary_length, stored.summary_block,
                                        family(folder.config.family).one_block))

    with document_run(document, password, opts, check) as run:
        live, doc, session = run.live, run.doc, run.session
        lead = bool(session.summary_length)
        gen, final_gen = gens
        gen_tokens, final_tokens = gen.gen_length, final_gen.gen_length
        room = _room(session, length, gen)
        least = min(room, _room(session, length, final_gen, merge=not lead))
        if least < MIN_PART_ROOM:  # refused before any part runs
            raise fail(_too_long(session, opts, length, least), 2)
        parts = split_parts(doc, session.count_tokens, room)
        summaries = []
        for i, part in enumerate(parts, 1):
            live.phase(f"part {i}/{len(parts)}", f"pages {part.first_page}-{part.last_page}")
            if not quiet and not as_json and not run.live_on:
                typer.echo(f"part {i}/{len(parts)} (pages {part.first_page}-{part.last_page}, {part.tokens} tokens)",
                           err=True)
            a = ask_live(session, part.text, part_instruction(length), gen, cache, "truncate", live)
            # a part the model says "not in the document" about has no summary (it is not one)
            text = "" if says_absent(a.text) else trim_summary(a.text, None, part.text, used_every_token(session, a))
            summaries.append({"pages": [part.first_page, part.last_page], "tokens": part.tokens, "summary": text,
                              "confidence": a.confidence.as_dict() if a.confidence else None})
        final, source = a, parts[-1].text
        written = [s["summary"] for s in summaries if s["summary"].strip()]
        if len(summaries) > 1 and written:  # parts that gave no summary add nothing to the merge
            live.phase("merge", f"{len(written)} summaries")
            # a lead-summary model is asked for the lead of the joined summaries (the document's first sentences),
            # the one summary format it was trained on
            merge = part_instruction(length) if lead else merge_instruction(length)
            source = "\n\n".join(written)
            final = ask_live(session, source, merge, final_gen, cache, "truncate", live)
        elif len(summaries) > 1:
            final = replace(a, text="", confidence=None)
        elif final_tokens != gen_tokens:  # one part: its summary is the summary, asked within the final budget
            again = ask_live(session, source, part_instruction(length), final_gen, cache, "truncate", live)
            # a model that answers "not in the document" within the shorter budget: its part's summary, cut
            final = a if says_absent(again.text) and not says_absent(a.text) and a.text.strip() else again
        absent = says_absent(final.text)  # never a summary: the parts' summaries are shown instead, or nothing
        final = replace(final, text="" if absent else trim_summary(final.text, length, source,
                                                                    used_every_token(session, final)))
    from maskkv_cli.app.pipeline import confidence_fields

    embedded = session.embedded
    show_parts = len(summaries) > 1 and (absent or adds_nothing(final.text, written))
    notes = _notes(length, lead, show_parts, final_tokens < summary_tokens(length, 8), embedded)
    stats = final.result.stats
    weights = {"quantization": stats.quantization, "weights_bytes": stats.weights_bytes}
    if as_json:
        typer.echo(json.dumps({"document": str(document), "pages": len(doc.pages), "summary": final.text,
                               **confidence_fields(final, "summary", embedded), "shown": "parts" if show_parts
                               else "summary", "length": {"words": length, "tokens": final_tokens},
                               "notes": notes, "parts": summaries, **weights}))
        return
    for message in notes:
        note(message, quiet, as_json)
    if stats.quantization != "none":  # (ask's run line names them; summarize prints no run line)
        from maskkv_cli.runtime.sizes import human_size

        note(f"{stats.quantization} weights {human_size(stats.weights_bytes, binary=True)}", quiet, as_json)
    if not show_parts:
        echo_answer(final.text, final.confidence, "summary", embedded, quiet)
        return
    from maskkv_cli.documents.model import pages_label

    low: list[int] = []
    for s in summaries:
        first, last = s["pages"]
        typer.echo(f"{pages_label(list(range(first, last + 1)))}: {s['summary'] or '(no summary)'}")
        if s["confidence"] and s["confidence"]["low"] and s["summary"]:
            low += range(first, last + 1)
    if low:  # part of the summaries: kept with --quiet
        conf = summaries[0]["confidence"] or next(s["confidence"] for s in summaries if s["confidence"])
        what = "the mean" if conf["statistic"] == "mean" else "a token"
        typer.echo(f"LOW CONFIDENCE in the summaries of {pages_label(low)} ({what} below {conf['threshold']:.2f}): "
                   "the model is probably guessing, check them in the document", err=True)


def _room(session: Any, length: int, gen: Any, merge: bool = False) -> int:
    """Tokens of text a prompt holds beside the instruction for a summary of ``length`` words and its ``gen``: a
    part's, or (``merge``) the final pass's over the parts' summaries."""
    from maskkv_cli.prompting.parts import merge_instruction, part_instruction

    instruction = merge_instruction(length) if merge else part_instruction(length)
    return session.window - session.prompt_overhead(instruction) - session.response_positions(gen.gen_length)


def _too_long(session: Any, opts: RunOptions, length: int, room: int) -> str:
    """Why ``--length`` leaves the parts (or the final pass over their summaries) too little room (``room``, the
    lesser of the two), with the longest
    ``--length`` that leaves both enough (a model that writes summaries of one trained length has none: its
    summaries take what they take)."""
    from maskkv_cli.app.pipeline import MIN_PART_ROOM

    why = (f"--length {length} leaves {max(room, 0)} tokens of the {session.window}-token window for the text "
           f"beside the summary (each part, and the final pass over the parts' summaries, need at least "
           f"{MIN_PART_ROOM})")
    if session.summary_length:
        return f"{why}: this model's summaries take {session.summary_length} tokens whatever --length"
    from maskkv_cli.errors import UsageError

    for words in range(length - 1, 0, -1):
        try:
            gen, final = summary_generations(opts, words, None, None)
        except UsageError:  # (a length the other options do not go with, e.g. --steps: not one to offer)
            continue
        if min(_room(session, words, gen), _room(session, words, final, merge=True)) >= MIN_PART_ROOM:
            return f"{why}: give at most --length {words}"
    return f"{why}: the model's window is too short to summarize in parts"


def summary_generations(opts: RunOptions, length: int, summary_length: int | None,
                        summary_block: int | None, one_block: bool = False) -> tuple[Any, Any]:
    """The generation settings of each part's summary and of the final one, for a summary of about ``length`` words
    by a model whose stored lead-summary length and block are ``summary_length`` and ``summary_block`` (None: it
    writes summaries of any length). A ``--block-length`` that does not divide the lead summary's tokens is a usage
    error that says so (the run has no --gen-length to blame). ``one_block``: the sampler has no blocks (Dream,
    DiffusionGemma): each summary is one block, so that any ``--steps`` fits it."""
    from maskkv_cli.prompting.parts import summary_tokens

    if summary_length:
        # a model trained on lead summaries (the embedded one) writes each part's at the length it was trained on
        if opts.block_length and summary_length % opts.block_length:
            raise fail(f"--block-length {opts.block_length}: this model writes its summaries in {summary_length} "
                       f"tokens, which a block length must divide (leave it out for the model's own, "
                       f"{summary_block or summary_length})", 2)
        block = opts.block_length or summary_block or summary_length
        final_tokens = min(summary_length, summary_tokens(length, opts.block_length or summary_block or 8))
        final_block = opts.block_length or summary_block or final_tokens
        gen = opts.with_(gen_length=summary_length, block_length=block).generation({})
        return gen, opts.with_(gen_length=final_tokens, block_length=final_block).generation({})
    block = opts.block_length or 32
    tokens = summary_tokens(length, block)
    gen = opts.with_(gen_length=tokens, block_length=tokens if one_block else block).generation({})
    return gen, gen


def _notes(length: int, lead: bool, show_parts: bool, capped: bool, embedded: bool) -> list[str]:
    """What the summary is and is not: the model's form (lead summaries), a --length beyond it, the parts shown."""
    from maskkv_cli.defaults import PULL_HINT, REAL_MODEL

    notes = []
    if lead:
        notes.append("this model writes lead summaries only (the first sentences of what it reads, copied: the form "
                     "it was trained on), not a summary of the whole document"
                     + (f"; for one: `{PULL_HINT}`, then --model {REAL_MODEL}" if embedded else ""))
    if capped:
        notes.append(f"--length {length}: this model writes at most its trained summary length, so the summary "
                     "is shorter")
    if show_parts:
        notes.append("the final pass only repeats the parts' summaries, so each part's summary is shown with its "
                     "pages (--json has the final one too)")
    return notes
