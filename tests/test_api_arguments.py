"""The library's entry points refuse what they cannot take with an error naming the argument (``app/arguments.py``),
not one from inside the tokenizer or torch."""

from __future__ import annotations

import pytest

from maskkv_cli.app.pipeline import ask, ask_many
from maskkv_cli.engine.plan import CacheConfig
from maskkv_cli.errors import UsageError
from maskkv_cli.models.catalog import shipped_model
from maskkv_cli.sampling import GenerationConfig

pytestmark = pytest.mark.skipif(shipped_model() is None, reason="the embedded model is not in this checkout")

GEN = GenerationConfig(gen_length=8, steps=8, block_length=8)
CACHE = CacheConfig(policy="maskkv", budget=16)


def test_ask_names_the_argument_of_the_wrong_type(session) -> None:
    with pytest.raises(TypeError, match=r"^ask: context must be a str \(the document's text\), got NoneType$"):
        ask(session, None, "Q?", GEN, CACHE)  # was tokenizers' "TextEncodeInput must be Union[...]"
    with pytest.raises(TypeError, match="^ask: context must be a str .*got bytes$"):
        ask(session, b"text", "Q?", GEN, CACHE)
    with pytest.raises(TypeError, match="^ask: question must be a str, got NoneType$"):
        ask(session, "text", None, GEN, CACHE)  # was "'NoneType' object has no attribute 'strip'"
    with pytest.raises(TypeError, match=r"^ask: cache must be a CacheConfig \(e.g. CacheConfig"):
        ask(session, "text", "Q?", GEN, "maskkv")
    with pytest.raises(TypeError, match="^ask: gen must be a GenerationConfig, got int$"):
        ask(session, "text", "Q?", 16, CACHE)
    with pytest.raises(TypeError, match="^ask_many: question must be a str, got int$"):
        ask_many(session, [("text", "Q?"), ("text", 3)], GEN, CACHE)


def test_a_batch_size_below_one_is_refused_not_taken_as_one(session) -> None:
    for size in (0, -1):
        with pytest.raises(UsageError, match=f"^ask_many: batch_size must be at least 1, got {size}$"):
            ask_many(session, [("text", "Q?")], GEN, CACHE, batch_size=size)
        with pytest.raises(UsageError, match=f"^Session.answer_many: batch_size must be at least 1, got {size}$"):
            session.answer_many([[5, 6, 7]], GEN, CACHE, size)
    assert len(session.answer_many([[5, 6, 7]], GEN, CACHE)) == 1  # 1 by default, as ask_many's


def test_ids_must_be_tokens_of_the_model(session) -> None:
    vocab = session.model.config.vocab_size
    for bad in (vocab, 10**6, -3):
        with pytest.raises(UsageError, match=f"^Session.answer_ids: token id {bad} is not in the model's vocabulary "
                                             rf"\(0 to {vocab - 1}\)$"):
            session.answer_ids([5, bad, 6], GEN, CACHE)  # was torch's "index out of range in self"
    with pytest.raises(TypeError, match="^Session.answer_ids: ids must be a list of token ids, got str$"):
        session.answer_ids("hello", GEN, CACHE)
    with pytest.raises(TypeError, match="^Session.answer_ids: ids must be ints, got float 5.0$"):
        session.answer_ids([4, 5.0], GEN, CACHE)
    with pytest.raises(TypeError, match="^Session.answer_many: cache must be a CacheConfig, got str$"):
        session.answer_many([[5, 6]], GEN, "full")
    assert session.answer_ids((5, 6, vocab - 1), GEN, CACHE).prompt_len == 3  # any sequence of ids
