"""The one place a batch job becomes an answer: the same steps as ``maskkv ask``.

Every runner (in this process, local worker processes, Ray actors) calls ``answer_job``; nothing else in
``maskkv_cli.batch`` knows how a question is answered. It calls ``pipeline.ask``, the function ``maskkv ask``
calls (fit the document to the window, build the prompt, sample); ``tests/test_batch.py`` pins that its answers
equal ``maskkv ask``'s.
"""

from __future__ import annotations

from dataclasses import asdict, fields
from typing import TYPE_CHECKING, Any

from maskkv_cli.batch.jobs import AnswerSettings

if TYPE_CHECKING:
    from maskkv_cli.app.run_settings import RunSettings


def use_settings(session: Any, run: RunSettings) -> None:
    """The sampler options of a job's settings on the worker's session: Dream's, and LLaDA2's over the model's
    stored defaults (as ``maskkv ask`` sets them from its options)."""
    session.dream = run.dream()
    session.llada2 = run.llada2(session.stored_llada2)


def open_session(model_path: str, device: str, dtype: str | None, quantize: str = "none") -> Any:
    """Load the model (its weights quantized as ``quantize`` says) and tokenizer once per worker."""
    from maskkv_cli.app.session import Session

    return Session(model_path, device=device, dtype=dtype, quantize=quantize)


def run_settings(settings: AnswerSettings) -> RunSettings:
    """A job's settings as the one builder of generation and cache settings takes them (the same for ``ask``)."""
    from maskkv_cli.app.run_settings import RunSettings

    shared = {f.name for f in fields(RunSettings)}
    return RunSettings(**{name: value for name, value in asdict(settings).items() if name in shared})


def answer_job(session: Any, text: str, question: str, settings: AnswerSettings) -> dict[str, Any]:
    """Answer ``question`` about the document ``text``; ``settings`` carries a resolved generation triple.

    Returns the row fields that come from answering: answer, budget, prompt and dropped tokens, RoPE factor,
    run statistics and notes.
    """
    from maskkv_cli.app.pipeline import answer_row, ask

    run = run_settings(settings)
    gen, cache = run.generation(session.generation_defaults), run.cache()
    use_settings(session, run)
    answer = ask(session, text, question, gen, cache, long=settings.long)
    notes = [m for m in (answer.fitted.rule, *answer.notes) if m]
    return {**answer_row(answer, session.embedded, question), "notes": notes}


def answer_jobs(session: Any, texts: dict[str, str], messages: list[dict[str, Any]],
                batch_size: int | None) -> list[dict[str, Any]]:
    """Answer a group of jobs with equal settings together (``pipeline.ask_many``: every prompt of every job, parts
    included, denoised up to the batch size at a time; None: the most that fit by the memory model); each job's
    fields are those ``answer_job`` gives it alone, plus the batch size used."""
    from maskkv_cli.app.pipeline import answer_row, ask_many, batch_size_for

    settings = AnswerSettings(**messages[0]["settings"])
    run = run_settings(settings)
    gen, cache = run.generation(session.generation_defaults), run.cache()
    use_settings(session, run)
    items = [(texts[m["document_sha"]], m["question"]) for m in messages]
    size, why = batch_size_for(session, items, gen, cache, settings.long, batch_size)
    answers = ask_many(session, items, gen, cache, long=settings.long, batch_size=size)
    embedded = session.embedded
    rows = []
    for (_, question), answer in zip(items, answers, strict=True):
        notes = [m for m in (answer.fitted.rule, *answer.notes) if m]
        rows.append({**answer_row(answer, embedded, question), "notes": notes, "batch_size": size,
                     "batch_note": why})
    return rows
