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


def test_a_text_kept_whole_under_rope_scaling_runs_past_the_window_by_design(session) -> None:
    """Up to a few times the window LongLLaDA's rule scales by 1: such a prompt is past the window on purpose, and
    was fitted again and again until no room was left ("... take 33 of the model's 2128-token window, leaving no
    room for the document")."""
    text = ""
    while len(session.document_ids(text)) < 1.6 * session.window:
        text += PAGES[0] + PAGES[3]
    prompt = prepare(session, text, QUESTIONS[0], 8, "rope-scale")
    assert prompt.fitted.mode == "rope-scale" and prompt.fitted.rope_factor == 1 and prompt.fitted.dropped == 0
    assert session.window < len(prompt.ids) + 8 < 5000
    from maskkv_cli.prompting.fit import unscaled_reach

    reach = unscaled_reach(session.model.config.head_dim, session.base_theta, session.window)
    assert f"kept whole with RoPE unscaled (LongLLaDA's rule scales it from about {reach:,} positions on for this " \
        "model)" in prompt.fitted.rule  # it said "RoPE base scaled x1"
    from maskkv_cli.engine.plan import CacheConfig
    from maskkv_cli.sampling import GenerationConfig

    gen = GenerationConfig(gen_length=8, steps=8, block_length=8)
    answer = session.answer_ids(prompt.ids, gen, CacheConfig(policy="maskkv", budget=64), rope_factor=1)
    assert answer.prompt_len == len(prompt.ids)


def test_the_library_refuses_ids_past_what_their_rope_factor_reaches(session) -> None:
    from maskkv_cli.engine.plan import CacheConfig
    from maskkv_cli.errors import UsageError
    from maskkv_cli.prompting.fit import rope_scale_factor
    from maskkv_cli.sampling import GenerationConfig

    gen = GenerationConfig(gen_length=8, steps=8, block_length=8)
    ids = [5] * 6000  # the rule scales 6000 positions of the embedded model by 2
    cfg = session.model.config
    assert rope_scale_factor(cfg.head_dim, session.base_theta, session.window, len(ids) + 8) == 2
    cache = CacheConfig(policy="maskkv", budget=64)
    with pytest.raises(UsageError, match=f"{len(ids) + 8} of the model's {session.window}-token window"):
        session.answer_ids(ids, gen, cache)  # 5000 ids on the 2128-token model answered junk without a word
    with pytest.raises(UsageError, match="-token window"):
        session.answer_many([ids[:50], ids], gen, cache, 2)
    assert session.answer_ids(ids, gen, cache, rope_factor=2).prompt_len == len(ids)  # scaled for it
    with pytest.raises(UsageError, match="-token window: shorten the prompt"):  # a plain prompt is never scaled
        session.answer("x " * session.window, gen, cache)


def test_a_text_whose_joined_prompt_runs_past_the_window_is_read_in_parts_not_cut(session) -> None:
    """A text counted to fit (its tokens within the room) whose prompt, joined to the question, takes a token or
    two more: --long parts reads it whole in parts instead of cutting its middle."""
    from maskkv_cli.app.pipeline import one_prompt, room_needed

    question, gen = QUESTIONS[0], 16
    room = room_needed(session, question, gen)
    text = ""
    while len(session.document_ids(text + PAGES[0])) <= room:
        text += PAGES[0]
    while len(session.document_ids(text + "x")) <= room:
        text += "x"
    assert len(session.document_ids(text)) <= room  # it fits by its count
    cut = prepare(session, text, question, gen, "truncate")
    if not cut.fitted.dropped:
        pytest.skip("this tokenizer joins this text and question within the room")
    assert one_prompt(session, text, question, gen, "parts") is None  # read in parts, not cut
    assert one_prompt(session, text, question, gen, "truncate") == cut
    from maskkv_cli.app.pipeline import ask
    from maskkv_cli.engine.plan import CacheConfig
    from maskkv_cli.sampling import GenerationConfig

    answer = ask(session, text, question, GenerationConfig(gen_length=gen, steps=gen, block_length=gen),
                 CacheConfig(policy="maskkv", budget=64))
    assert answer.fitted.parts >= 2 and answer.fitted.complete and answer.fitted.dropped == 0
    assert all(len(part.result.tokens) and part.prompt_len + gen <= session.window
               for part in answer.parts)  # type: ignore[attr-defined]


def test_a_long_answer_that_leaves_parts_of_a_few_tokens_is_refused(session) -> None:
    """An answer of 200 tokens on a 256-token window read a 1,120-token text in 66 parts of a few tokens each."""
    from maskkv_cli.app.pipeline import MIN_PART_ROOM, one_prompt
    from maskkv_cli.errors import UsageError

    question = QUESTIONS[0]
    gen = session.window - session.prompt_overhead(question) - (MIN_PART_ROOM - 1)
    text = texts()[0]
    with pytest.raises(UsageError, match=rf"leave {MIN_PART_ROOM - 1} tokens of the model's {session.window}-token "
                                         rf"window for each part of the document, too few to read it in parts "
                                         rf"\(at least {MIN_PART_ROOM}\): ask for at most {gen - 1} new tokens, or "
                                         "give --long truncate"):
        one_prompt(session, text, question, gen, "parts")
    assert one_prompt(session, text, question, gen - 1, "parts") is None  # read in parts of 64 tokens
    assert one_prompt(session, text, question, gen, "truncate").fitted.dropped > 0  # a cut needs no parts
