"""Every prompt ``ask`` builds fits the model's window beside its answer: the joined prompt of a text and a question
can take a few tokens more than the two counted apart (tokens merge where they meet, a cut carries its marker, a
decoded cut re-encodes longer where it split a character), and ``prepare`` and ``part_prompts`` fit such a prompt
again (``app/pipeline.py``)."""

from __future__ import annotations

import pytest

from maskkv_cli.app.pipeline import part_prompts, prepare, room_for_text
from maskkv_cli.models.catalog import shipped_model

pytestmark = pytest.mark.skipif(shipped_model() is None, reason="the embedded model is not in this checkout")

QUESTIONS = ("What is the special magic number for apple?", "Where does the river run?", "Résumé ?")
PAGES = ("The river runs north past the mill. ", "Prices rose by 4% in März; the café closed. ",
         "Le cœur a ses raisons — que la raison ne connaît point. ", "数字是 4821。河流向北流。 ", "🙂 emoji, 👍🏽 ")


def texts() -> list[str]:
    return ["\f".join(f"Page {i}. " + PAGES[i % len(PAGES)] * (20 + 7 * i) for i in range(pages))
            for pages in (6, 16)]


@pytest.mark.parametrize("gen_length", [16, 40])
def test_a_cut_text_s_prompt_fits_the_window_beside_the_answer(session, gen_length: int) -> None:
    limit = session.window - session.response_positions(gen_length)
    for text in texts():
        for question in QUESTIONS:
            prompt = prepare(session, text, question, gen_length, "truncate")
            assert prompt.fitted.dropped > 0  # the text was cut
            assert len(prompt.ids) <= limit, (question, len(prompt.ids), limit)


@pytest.mark.parametrize("gen_length", [16, 40])
def test_every_part_s_prompt_fits_the_window_beside_the_answer(session, gen_length: int) -> None:
    limit = session.window - session.response_positions(gen_length)
    for text in texts():
        ids = session.document_ids(text)
        for question in QUESTIONS:
            room = room_for_text(session, question, gen_length)
            prompts, used = part_prompts(session, text, ids, room, question)
            assert len(prompts) > 1 and used <= room
            assert max(len(p.ids) for p in prompts) <= limit, (question, [len(p.ids) for p in prompts], limit)
            covered = 0  # the windows still cover the text, each starting within the one before
            for p in prompts:
                start, end = p.fitted.read[0]
                assert start <= covered < end
                covered = end
            assert covered == len(text)


def test_the_library_refuses_ids_past_the_window_unless_their_rope_is_scaled(session) -> None:
    from maskkv_cli.engine.plan import CacheConfig
    from maskkv_cli.errors import UsageError
    from maskkv_cli.sampling import GenerationConfig

    gen = GenerationConfig(gen_length=8, steps=8, block_length=8)
    ids = session.prompt_ids("x " * (session.window - 30))
    assert len(ids) + 8 > session.window
    cache = CacheConfig(policy="full")
    with pytest.raises(UsageError, match=f"{len(ids) + 8} of the model's {session.window}-token window"):
        session.answer_ids(ids, gen, cache)
    with pytest.raises(UsageError, match="-token window"):
        session.answer_many([ids[:50], ids], gen, cache, 2)
    fits = ids[: session.window - 8]
    assert session.answer_ids(fits, gen, cache).prompt_len == len(fits)
    assert session.answer_ids(ids, gen, cache, rope_factor=2.0).prompt_len == len(ids)  # scaled for it
