"""What the commands that answer share: the stderr console and its live panel, the start of a run over a document
(``document_run``: the document read, its warnings as notes, the model loaded, under the live panel),
``pipeline.ask`` with the live panel following it, and one answer printed with its confidence."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer

from maskkv_cli.cli.common import live_display_on, note, note_once
from maskkv_cli.cli.model_choice import pull_first
from maskkv_cli.cli.run_options import RunOptions
from maskkv_cli.runtime.devices import resolve_device

__all__ = ["DocumentRun", "ask_live", "consoles", "document_run", "echo_answer", "warn_document"]


def consoles(quiet: bool, as_json: bool) -> tuple[Any, bool]:
    """The stderr console, and whether the live panel shows on it (``live_display_on``)."""
    from rich.console import Console

    err = Console(stderr=True)
    return err, live_display_on(quiet, as_json)


def warn_document(doc: Any, quiet: bool, as_json: bool) -> None:
    """A document's reading problems (blank pages, a legacy encoding, ...) as notes."""
    for w in doc.warnings:
        note(w, quiet, as_json)


def ask_live(session: Any, context: str, question: str, gen: Any, cache: Any, long: str, live: Any) -> Any:
    """``pipeline.ask`` with the live display following its prompt, steps and cache."""
    from maskkv_cli.app.pipeline import ask

    answer = ask(session, context, question, gen, cache, long=long, on_event=live, on_prompt=live.prompt_ready,
                 on_part=live.part)
    live.answered(answer)
    return answer


def ask_together(session: Any, context: str, questions: list[str], gen: Any, cache: Any, long: str,
                 requested: int | None, live: Any, quiet: bool, as_json: bool) -> list[Any]:
    """``pipeline.ask_many``: every question (each part of a long document) denoised up to the batch size together,
    the live display counting answers; ``requested`` None: the batch size by the memory model, said in a note."""
    from maskkv_cli.app.pipeline import ask_many, batch_size_for

    items = [(context, q) for q in questions]
    size, why = batch_size_for(session, items, gen, cache, long, requested)
    if why:
        note_once(why, quiet, as_json)
    done = 0
    live.phase("answer", f"{len(questions)} questions, {size} prompts at a time")

    def answered(i: int, answer: Any) -> None:
        nonlocal done
        done += 1
        live.phase("answer", f"{done}/{len(questions)} answered, {size} prompts at a time")
        live.answered(answer)

    return ask_many(session, items, gen, cache, long=long, batch_size=size, on_answer=answered)


@dataclass
class DocumentRun:
    live: Any  # the live panel (``cli.render.LiveRun``); phases and the sampler's events go to it
    live_on: bool  # whether the panel shows (else progress lines may go to stderr)
    doc: Any  # the ``Document`` read
    session: Any  # the loaded ``Session``


@contextmanager
def document_run(document: Path, password: str | None, opts: RunOptions,
                 check: Callable[[Any], None] | None = None) -> Iterator[DocumentRun]:
    """Offer to pull a model not on disk (resolving ``--model`` once, into the ``ModelFolder`` loaded below), then,
    under the live panel, read the document (its warnings become notes) and load the model on the device the panel
    measures (resolved once from ``auto``). ``check(folder)`` runs first, before the document is read or the weights
    load: the command's settings checked against the model's stored defaults (``RunOptions.check_generation``)."""
    from maskkv_cli.cli.render import LiveRun
    from maskkv_cli.documents.store import DocumentStore

    err, live_on = consoles(opts.quiet, opts.as_json)
    folder, message = pull_first(opts.model, opts.yes, opts.quiet, opts.as_json)  # the run's one resolution
    if check is not None:
        check(folder)
    device = resolve_device(opts.device)
    with LiveRun(err, live_on, device) as live:
        live.phase("parse", str(document))
        doc, _ = DocumentStore().ingest(document, password=password)
        warn_document(doc, opts.quiet, opts.as_json)
        live.phase("load model")
        note(message, opts.quiet, opts.as_json)
        yield DocumentRun(live, live_on, doc, opts.load_session(device, folder))


def echo_answer(text: str, confidence: Any, what: str, embedded: bool, quiet: bool, document: bool = True) -> None:
    """One answer on stdout and its confidence line on stderr; an empty answer is a note on stderr instead. That note
    and a LOW CONFIDENCE line are part of the answer and stay with --quiet (as ``ask`` keeps them).
    ``document``: whether the answer was about a document."""
    from maskkv_cli.cli.render import answer_lines

    out, line = answer_lines(text, confidence, what, embedded, document)
    if out is not None:
        typer.echo(out)
    if out is None or not quiet or line.startswith("LOW CONFIDENCE"):
        typer.echo(line, err=True)
