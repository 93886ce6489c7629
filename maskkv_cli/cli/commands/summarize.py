"""``maskkv summarize``: a document of any length summarized part by part, then the parts' summaries merged."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer

from maskkv_cli.cli.asking import ask_live, document_run, echo_answer
from maskkv_cli.cli.common import fail, guarded
from maskkv_cli.cli.options import PasswordOpt, length_option
from maskkv_cli.cli.run_options import CACHE, MODEL, OUTPUT, SAMPLER, RunOptions, run_options


@guarded
@run_options(*CACHE, *[n for n in SAMPLER if n != "gen_length"], *MODEL, *OUTPUT)
def summarize(
    document: Annotated[Path, typer.Argument(help="PDF, text or Markdown file.", show_default=False)],
    length: Annotated[int, length_option("Target length of the summary in words.")] = 150,
    password: PasswordOpt = None,
    *,
    opts: RunOptions,
) -> None:
    """Summarize a document of any length: summarize parts (whole pages), then the summaries.

    Examples:

        maskkv summarize report.pdf

        maskkv summarize book.txt --length 300 --budget 128 --json
    """
    from maskkv_cli.prompting.parts import merge_instruction, part_instruction, split_parts

    if length <= 0:
        raise fail(f"--length must be a positive number of words, got {length}", 2)
    cache = opts.cache()
    quiet, as_json = opts.quiet, opts.as_json
    with document_run(document, password, opts) as run:
        live, doc, session = run.live, run.doc, run.session
        if session.summary_length:
            # a model trained on lead summaries (the embedded one) writes them at the length it was trained on
            gen_tokens = session.summary_length
            block = opts.block_length or session.summary_block or gen_tokens
        else:
            block = opts.block_length or 32
            gen_tokens = max(block, -(-int(length * 1.6) // block) * block)
        gen = opts.with_(gen_length=gen_tokens, block_length=block).generation({})
        room = session.window - session.prompt_overhead(part_instruction(length)) - gen.gen_length
        if room < 64:
            raise fail(f"--length {length} leaves no room for the document in the {session.window}-token window", 2)
        parts = split_parts(doc, session.count_tokens, room)
        summaries = []
        for i, part in enumerate(parts, 1):
            live.phase(f"part {i}/{len(parts)}", f"pages {part.first_page}-{part.last_page}")
            if not quiet and not as_json and not run.live_on:
                typer.echo(f"part {i}/{len(parts)} (pages {part.first_page}-{part.last_page}, {part.tokens} tokens)",
                           err=True)
            a = ask_live(session, part.text, part_instruction(length), gen, cache, "truncate", live)
            summaries.append({"pages": [part.first_page, part.last_page], "tokens": part.tokens, "summary": a.text,
                              "confidence": a.confidence.as_dict() if a.confidence else None})
        final = parts_answer = a
        written = [s["summary"] for s in summaries if s["summary"].strip()]
        if len(summaries) > 1 and written:  # parts that gave no summary add nothing to the merge
            live.phase("merge", f"{len(written)} summaries")
            # a lead-summary model is asked for the lead of the joined summaries (the document's first sentences),
            # the one summary format it was trained on
            merge = part_instruction(length) if session.summary_length else merge_instruction(length)
            final = ask_live(session, "\n\n".join(written), merge, gen, cache, "truncate", live)
        elif len(summaries) > 1:
            final = replace(parts_answer, text="", confidence=None)
    from maskkv_cli.models.catalog import is_embedded_model
    from maskkv_cli.pipeline import confidence_fields

    embedded = is_embedded_model(session.model_path)
    if as_json:
        typer.echo(json.dumps({"document": str(document), "pages": len(doc.pages), "summary": final.text,
                               **confidence_fields(final, "summary", embedded), "parts": summaries}))
        return
    echo_answer(final.text, final.confidence, "summary", embedded, quiet)
