"""What ``maskkv ask`` and ``maskkv summarize`` share: the stderr console and its live panel, a document's warnings
as notes, and ``pipeline.ask`` with the live panel following it."""

from __future__ import annotations

from typing import Any

from maskkv_cli.cli.common import live_display_on, note

__all__ = ["ask_live", "consoles", "warn_document"]


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
    from maskkv_cli.pipeline import ask

    answer = ask(session, context, question, gen, cache, long=long, on_event=live, on_prompt=live.prompt_ready)
    live.answered(answer)
    return answer
