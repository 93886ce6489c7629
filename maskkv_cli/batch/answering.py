"""The one place a batch job becomes an answer: the same steps as ``maskkv ask``.

Every runner (in this process, local worker processes, Ray actors) calls ``answer_job``; nothing else in
``maskkv_cli.batch`` knows how a question is answered. It calls ``pipeline.ask``, the function ``maskkv ask``
calls (fit the document to the window, build the prompt, sample); ``tests/test_batch.py`` pins that its answers
equal ``maskkv ask``'s.
"""

from __future__ import annotations

from typing import Any

from maskkv_cli.batch.jobs import AnswerSettings


def open_session(model_path: str, device: str, dtype: str | None) -> Any:
    """Load the model and tokenizer once per worker."""
    from maskkv_cli.session import Session

    return Session(model_path, device=device, dtype=dtype)


def answer_job(session: Any, text: str, question: str, settings: AnswerSettings) -> dict[str, Any]:
    """Answer ``question`` about the document ``text``; ``settings`` carries a resolved generation triple.

    Returns the row fields that come from answering: answer, budget, prompt and dropped tokens, RoPE factor,
    run statistics and notes.
    """
    from maskkv_cli.pipeline import ask
    from maskkv_cli.policies.base import PolicyOptions
    from maskkv_cli.sampling import DreamOptions, GenerationConfig
    from maskkv_cli.session import CacheConfig, resolve_generation

    gen_length, steps, block = resolve_generation(session.generation_defaults, settings.gen_length,
                                                  settings.steps, settings.block_length)
    gen = GenerationConfig(gen_length=gen_length, steps=steps, block_length=block,
                           temperature=settings.temperature, threshold=settings.threshold, seed=settings.seed)
    cache = CacheConfig(policy=settings.policy, budget=settings.budget, ratio=settings.ratio,
                        options=PolicyOptions(seed=settings.seed), layer_budgets=settings.layer_budgets)
    session.dream = DreamOptions(alg=settings.alg, top_p=settings.top_p, top_k=settings.top_k)
    answer = ask(session, text, question, gen, cache, long=settings.long)
    fitted = answer.fitted
    notes = [m for m in (fitted.rule, *answer.notes) if m]
    fields = {"answer": answer.text, "confidence": answer.confidence.as_dict() if answer.confidence else None,
              "budget": answer.budget, "prompt_tokens": answer.prompt_len, "dropped_tokens": fitted.dropped,
              "rope_factor": fitted.rope_factor, "stats": answer.result.stats.as_dict(), "notes": notes}
    if not answer.text.strip():  # as ask --json: an empty answer comes with a note saying so
        from maskkv_cli.models.catalog import empty_note, is_embedded_model

        fields["note"] = empty_note("answer", is_embedded_model(session.model_path))
    return fields
