"""``maskkv ask``: questions about a document, answered with the prompt's KV cache compressed."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from maskkv_cli.cli.asking import ask_live, ask_together, document_run
from maskkv_cli.cli.common import fail, guarded, note, note_once, one_line_stats
from maskkv_cli.cli.options import AskBatchOpt, LongOpt, PasswordOpt, QuestionsFileOpt
from maskkv_cli.cli.run_options import CACHE, MODEL, OUTPUT, SAMPLER, RunOptions, run_options
from maskkv_cli.prompting.fit import DEFAULT_LONG, check_long


def _questions(question: str | None, extra: list[str] | None, questions_file: Path | None,
               on_note: Callable[[str], None] | None = None) -> list[str]:
    from maskkv_cli.batch.jobs import read_questions

    qs = ([question] if question is not None else []) + list(extra or [])
    if questions_file is not None:
        qs += read_questions(questions_file, on_note)  # as batch reads it: an empty file is refused
    if not qs:
        raise fail("no question given: pass QUESTION, -q QUESTION or --questions FILE", 2)
    for q in qs:
        if not q.strip():
            raise fail("a question is empty; write the question after the document", 2)
    return qs


@guarded
@run_options(*CACHE, *SAMPLER, *MODEL, *OUTPUT)
def ask(
    document: Annotated[Path, typer.Argument(help="PDF, text or Markdown file.", show_default=False)],
    question: Annotated[str | None, typer.Argument(help="The question.", show_default=False)] = None,
    more: Annotated[list[str] | None, typer.Option("--question", "-q", help="More questions (repeatable); the "
                                                   "document is parsed and the model loaded once.",
                                                   show_default=False)] = None,
    questions_file: QuestionsFileOpt = None,
    long: LongOpt = DEFAULT_LONG,
    password: PasswordOpt = None,
    batch_size: AskBatchOpt = "auto",
    *,
    opts: RunOptions,
) -> None:
    """Answer questions about a document with the KV cache compressed by MaskKV (or --policy).

    Examples:

        maskkv ask report.pdf "What does the report conclude?"

        maskkv ask report.pdf -q "Who wrote it?" -q "When?" --budget 128

        maskkv ask book.txt "Where is the treasure?" --long truncate --json

        maskkv ask report.pdf --questions questions.txt --batch-size 8
    """
    from maskkv_cli.documents.reading import check_source
    from maskkv_cli.engine.batch_memory import parse_batch_size

    check_source(document)  # a wrong path fails at once, before anything heavy is imported or loaded
    requested = parse_batch_size(batch_size)
    check_long(long)
    quiet, as_json = opts.quiet, opts.as_json
    qs = _questions(question, more, questions_file, lambda message: note(message, quiet, as_json))
    cache = opts.cache()
    def check(folder: Any) -> None:  # before the model loads
        from maskkv_cli.app.run_settings import check_long_family

        opts.check_generation(folder)
        check_long_family(long, folder.config.family)

    with document_run(document, password, opts, check) as run:
        live, doc, session = run.live, run.doc, run.session
        gen = opts.generation(session.generation_defaults)
        if len(qs) > 1 and requested != 1 and long != "rope-scale":
            answers = ask_together(session, doc.text, qs, gen, cache, long, requested, live, quiet, as_json)
        else:
            answers = []
            for i, q in enumerate(qs, 1):
                live.phase("tokenize", f"question {i}/{len(qs)}")
                answers.append(ask_live(session, doc.text, q, gen, cache, long, live))
        shown: set[str] = set()
        for answer in answers:
            for message in [answer.fitted.rule, *answer.notes]:
                if message and message not in shown:
                    shown.add(message)
                    note_once(message, quiet, as_json)
        results = list(zip(qs, answers, strict=True))
    from maskkv_cli.app.pipeline import answer_row

    embedded = session.embedded
    spans = doc.page_spans()
    rows = [{"question": q, **answer_row(a, embedded, q, spans), "policy": cache.policy} for q, a in results]
    if as_json:
        typer.echo(json.dumps({
            "document": {"source": str(document), "sha256": doc.sha256, "pages": len(doc.pages),
                         "chars": doc.n_chars},
            "model": session.model_path,
            "answers": rows,
        }))
        return
    _print_answers(rows, [a for _, a in results], quiet, embedded)


def _print_answers(rows: list[dict[str, Any]], answers: list[Any], quiet: bool, embedded: bool) -> None:
    """One answer: the line that stands for it on stdout (a cut says so on that line), its confidence and where it
    came from on stderr. Several: Q/A/confidence blocks on stdout. An answer that cannot be shown (none, or the
    embedded model's "not in the document" to a question it was not trained on) is never a blank line: a note
    says why; that note and a LOW CONFIDENCE mark are part of the answer and stay with --quiet."""
    from maskkv_cli.models.catalog import empty_note
    from maskkv_cli.reports.answers import NO_ANSWER_SHOWN, answer_line, context_line

    notes: list[str] = []
    for row, answer in zip(rows, answers, strict=True):
        out, line = answer_line(row), context_line(row, empty_note("answer", embedded))
        if len(rows) > 1:
            typer.echo(f"Q: {row['question']}")
            typer.echo(f"A: {out if out is not None else NO_ANSWER_SHOWN}")
            if out is not None:
                typer.echo(f"   {line}")
            else:
                notes.append(line)
            typer.echo("")
        elif out is not None:
            typer.echo(out)
            if not quiet or line.startswith("LOW CONFIDENCE"):
                typer.echo(line, err=True)
        else:
            notes.append(line)
        if not quiet:
            typer.echo(one_line_stats(answer.result.stats, answer.fitted.parts), err=True)
    for line in dict.fromkeys(notes):
        typer.echo(line, err=True)
