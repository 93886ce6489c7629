"""The core use case: a question about a text becomes an answer.

``ask`` fits the text to the model's window (cut its middle, or keep it and scale RoPE), builds the prompt (the
chat template around the text and the question) and runs the sampler with the chosen cache policy. ``ask``,
``summarize``, ``profile``, ``demo`` and ``bench quality`` all go through here; ``prepare`` is the first half
on its own, for callers that build a prompt once and answer it under several cache settings.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from maskkv_cli.engine.plan import CacheConfig
from maskkv_cli.prompting import document_question
from maskkv_cli.prompting.fit import FittedContext, fit_context
from maskkv_cli.sampling import Event, GenerationConfig
from maskkv_cli.session import Answer, Session

__all__ = ["Answer", "Prompt", "Session", "answer_row", "ask", "confidence_fields", "prepare"]


@dataclass(frozen=True)
class Prompt:
    """The prompt ids of one question about a text, and how the text was fitted to the window."""

    ids: list[int]
    fitted: FittedContext
    # leading ids that are the template's start and the document, whatever the question (computed for
    # block-causal models only, whose document prefix is then computed once: ``engine/prefix.py``); 0: unknown
    document_len: int = 0


def prepare(session: Session, context: str, question: str, gen_length: int, long: str = "truncate") -> Prompt:
    """Fit ``context`` into what the window leaves beside the question and ``gen_length`` response tokens, and
    build the chat prompt of document then question. ``long``: ``truncate`` or ``rope-scale``."""
    cfg = session.model.config
    overhead = session.prompt_overhead(question)
    room = session.window - overhead - gen_length
    doc_ids = session.document_ids(context)  # encoded once per document, whatever the number of questions
    # RoPE scaling sizes its factor for the whole sequence; a cut needs only the room.
    total = overhead + len(doc_ids) + gen_length if long == "rope-scale" else None
    fitted = fit_context(session.tokenizer, context, room, long, cfg.head_dim, session.base_theta, session.window,
                         total, doc_ids)
    ids = session.prompt_ids(document_question(fitted.text, question))
    document_len = session.document_prompt_len(fitted.text, ids) if cfg.block_causal else 0
    return Prompt(ids, fitted, document_len)


def ask(
    session: Session,
    context: str,
    question: str,
    gen: GenerationConfig,
    cache: CacheConfig,
    *,
    long: str = "truncate",
    on_event: Callable[[Event], None] | None = None,
    on_prompt: Callable[[Prompt], None] | None = None,
) -> Answer:
    """Answer ``question`` about ``context``: fit, prompt, sample. ``on_prompt`` sees the prompt before the
    prefill starts; ``on_event`` gets the sampler's progress. The answer carries the fitted context."""
    prompt = prepare(session, context, question, gen.gen_length, long)
    session.set_rope_factor(prompt.fitted.rope_factor)
    if on_prompt is not None:
        on_prompt(prompt)
    answer = session.answer_ids(prompt.ids, gen, cache, on_event, document_len=prompt.document_len)
    return replace(answer, fitted=prompt.fitted)


def confidence_fields(answer: Answer, what: str, embedded: bool) -> dict[str, Any]:
    """``confidence`` (mean/min token probability, or null for an empty answer) and, for an empty one, ``note``
    saying so (``what``: answer or summary; ``embedded``: the note names the embedded model's limits)."""
    from maskkv_cli.models.catalog import empty_note

    fields: dict[str, Any] = {"confidence": answer.confidence.as_dict() if answer.confidence else None}
    if not answer.text.strip():
        fields["note"] = empty_note(what, embedded)
    return fields


def answer_row(answer: Answer, embedded: bool) -> dict[str, Any]:
    """The fields of one answer that ``ask --json`` and a batch row share: its text and confidence, the budget,
    the prompt and dropped tokens, the RoPE factor and the run statistics."""
    fitted = answer.fitted
    return {"answer": answer.text, **confidence_fields(answer, "answer", embedded), "budget": answer.budget,
            "prompt_tokens": answer.prompt_len, "dropped_tokens": fitted.dropped if fitted else 0,
            "rope_factor": fitted.rope_factor if fitted else 1, "stats": answer.result.stats.as_dict()}
