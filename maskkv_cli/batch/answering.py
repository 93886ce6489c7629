"""The one place a batch job becomes an answer: the same steps as ``maskkv ask``.

Every runner (in this process, local worker processes, Ray actors) calls ``answer_job``; nothing else in
``maskkv_cli.batch`` knows how a question is answered. Today it performs the steps of ``ask``
(``commands/documents.answer_question``: fit the document to the window, build the prompt, ``Session.answer_ids``)
without importing the command layer; when the core pipeline function lands (issue #18) this module calls it
instead. ``tests/test_batch.py`` pins that its answers equal ``maskkv ask``'s.
"""

from __future__ import annotations

from typing import Any

from maskkv_cli.batch.jobs import AnswerSettings


def resolve_generation(defaults: dict[str, int], gen_length: int | None, steps: int | None,
                       block_length: int | None) -> tuple[int, int, int]:
    """(gen_length, steps, block_length) as ``ask`` resolves its options against the model's defaults."""
    gen = gen_length or defaults.get("gen_length", 128)
    block = block_length or defaults.get("block_length", min(32, gen))
    if block_length is None and gen % block:
        block = gen
    n_steps = steps or (defaults.get("steps", gen) if gen_length is None else gen)
    return gen, n_steps, block


def open_session(model_path: str, device: str, dtype: str | None) -> Any:
    """Load the model and tokenizer once per worker."""
    from maskkv_cli.session import Session

    return Session(model_path, device=device, dtype=dtype)


def answer_job(session: Any, text: str, question: str, settings: AnswerSettings) -> dict[str, Any]:
    """Answer ``question`` about the document ``text``; ``settings`` carries a resolved generation triple.

    Returns the row fields that come from answering: answer, budget, prompt and dropped tokens, RoPE factor,
    run statistics and notes.
    """
    from maskkv_cli.longctx import fit_context
    from maskkv_cli.policies.base import PolicyOptions
    from maskkv_cli.prompting import document_question
    from maskkv_cli.sampler import GenerationConfig
    from maskkv_cli.session import CacheConfig

    gen_length, steps, block = resolve_generation(session.generation_defaults, settings.gen_length,
                                                  settings.steps, settings.block_length)
    gen = GenerationConfig(gen_length=gen_length, steps=steps, block_length=block,
                           temperature=settings.temperature, threshold=settings.threshold, seed=settings.seed)
    cache = CacheConfig(policy=settings.policy, budget=settings.budget, ratio=settings.ratio,
                        options=PolicyOptions(seed=settings.seed), layer_budgets=settings.layer_budgets)
    session.dream_options = {"alg": settings.alg, "top_p": settings.top_p, "top_k": settings.top_k}
    cfg = session.model.config
    overhead = session.prompt_overhead(question)
    room = session.window - overhead - gen.gen_length
    total = overhead + session.count_tokens(text) + gen.gen_length
    fitted = fit_context(session.tokenizer, text, room, settings.long, cfg.head_dim, session.base_theta,
                         session.window, total)
    session.set_rope_factor(fitted.rope_factor)
    ids = session.prompt_ids(document_question(fitted.text, question))
    answer = session.answer_ids(ids, gen, cache)
    notes = [m for m in (fitted.rule, *answer.notes) if m]
    fields = {"answer": answer.text, "confidence": answer.confidence.as_dict() if answer.confidence else None,
              "budget": answer.budget, "prompt_tokens": answer.prompt_len, "dropped_tokens": fitted.dropped,
              "rope_factor": fitted.rope_factor, "stats": answer.result.stats.as_dict(), "notes": notes}
    if not answer.text.strip():  # as ask --json: an empty answer comes with a note saying so
        from maskkv_cli.confidence import empty_note, is_embedded_model

        fields["note"] = empty_note("answer", is_embedded_model(session.model_path))
    return fields
