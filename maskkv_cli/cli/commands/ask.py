"""``maskkv ask``: questions about a document, answered with the prompt's KV cache compressed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from maskkv_cli.cli.asking import ask_live, document_run
from maskkv_cli.cli.common import fail, guarded, note, one_line_stats
from maskkv_cli.cli.options import LongOpt, PasswordOpt, QuestionsFileOpt
from maskkv_cli.cli.run_options import CACHE, MODEL, OUTPUT, SAMPLER, RunOptions, run_options


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
@run_options(*CACHE, *SAMPLER, *MODEL, *OUTPUT)
def ask(
    document: Annotated[Path, typer.Argument(help="PDF, text or Markdown file.", show_default=False)],
    question: Annotated[str | None, typer.Argument(help="The question.", show_default=False)] = None,
    more: Annotated[list[str] | None, typer.Option("--question", "-q", help="More questions (repeatable); the "
                                                   "document is parsed and the model loaded once.",
                                                   show_default=False)] = None,
    questions_file: QuestionsFileOpt = None,
    long: LongOpt = "truncate",
    password: PasswordOpt = None,
    *,
    opts: RunOptions,
) -> None:
    """Answer questions about a document with the KV cache compressed by MaskKV (or --policy).

    Examples:

        maskkv ask report.pdf "What does the report conclude?"

        maskkv ask report.pdf -q "Who wrote it?" -q "When?" --budget 128

        maskkv ask book.txt "Where is the treasure?" --long rope-scale --json
    """
    qs = _questions(question, more, questions_file)
    cache = opts.cache()
    quiet, as_json = opts.quiet, opts.as_json
    with document_run(document, password, opts) as run:
        live, doc, session = run.live, run.doc, run.session
        gen = opts.generation(session.generation_defaults)
        results = []
        shown: set[str] = set()
        for i, q in enumerate(qs, 1):
            live.phase("tokenize", f"question {i}/{len(qs)}")
            answer = ask_live(session, doc.text, q, gen, cache, long, live)
            for message in [answer.fitted.rule, *answer.notes]:
                if message and message not in shown:
                    shown.add(message)
                    note(message, quiet, as_json)
            results.append((q, answer, answer.fitted))
    from maskkv_cli.models.catalog import is_embedded_model
    from maskkv_cli.pipeline import answer_row

    embedded = is_embedded_model(session.model_path)
    if as_json:
        typer.echo(json.dumps({
            "document": {"source": str(document), "sha256": doc.sha256, "pages": len(doc.pages),
                         "chars": doc.n_chars},
            "model": session.model_path,
            "answers": [{"question": q, **answer_row(a, embedded), "policy": cache.policy} for q, a, _ in results],
        }))
        return
    _print_answers(results, quiet, embedded)


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
