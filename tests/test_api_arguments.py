"""The library's entry points refuse what they cannot take with an error naming the argument (``app/arguments.py``),
not one from inside the tokenizer or torch."""

from __future__ import annotations

import pytest
import torch

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
    for bad in (("text", "Q?", "more"), "text", ("text",)):  # was "too many values to unpack" and the like
        with pytest.raises(TypeError, match="^ask_many: each item must be a \\(context, question\\) pair, got "):
            ask_many(session, [bad], GEN, CACHE)


def test_a_batch_size_below_one_is_refused_not_taken_as_one(session) -> None:
    for size in (0, -1):
        with pytest.raises(UsageError, match=f"^ask_many: batch_size must be at least 1, got {size}$"):
            ask_many(session, [("text", "Q?")], GEN, CACHE, batch_size=size)
        with pytest.raises(UsageError, match=f"^Session.answer_many: batch_size must be at least 1, got {size}$"):
            session.answer_many([[5, 6, 7]], GEN, CACHE, size)
    assert len(session.answer_many([[5, 6, 7]], GEN, CACHE)) == 1  # 1 by default, as ask_many's
    with pytest.raises(UsageError, match="^Session.answer_many: 2 prompts take as many document_lens and "
                                         "rope_factors, got 1 and 2$"):
        session.answer_many([[5, 6], [7, 8]], GEN, CACHE, document_lens=[0])


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


def test_a_session_takes_device_auto_as_the_commands_do() -> None:
    """Session(path, device="auto") and load_model(device="auto") said "unknown device 'auto'; use auto, ..."."""
    from maskkv_cli.app.session import Session
    from maskkv_cli.models.loading import load_model

    path = str(shipped_model())
    assert Session(path, device="auto").device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert load_model(path, device="auto") is not None


def test_session_answer_checks_its_question_and_a_rope_factor(session) -> None:
    """Session.answer answered None, b"hi", ["hi"], 42 and "" (the prompts "", "<bytes>", "['hi']", "42"); a
    rope_factor of 0, -1 or nan gave an empty answer or an internal "non-finite values"."""
    for bad in (None, b"hi", ["hi"], 42):
        with pytest.raises(TypeError, match=f"^Session.answer: question must be a str, got {type(bad).__name__}$"):
            session.answer(bad, GEN, CACHE)
    with pytest.raises(UsageError, match="^Session.answer: the question is empty$"):
        session.answer("  ", GEN, CACHE)
    with pytest.raises(TypeError, match="^Session.answer: gen must be a GenerationConfig, got dict$"):
        session.answer("Q?", {"gen_length": 8}, CACHE)
    for bad in (0, -1.0, float("nan"), 0.5):
        with pytest.raises(UsageError, match="rope_factor must be a finite number of at least 1"):
            session.answer_ids([5, 6, 7], GEN, CACHE, rope_factor=bad)


def test_cache_and_policy_options_of_the_wrong_kind_are_refused_when_made() -> None:
    """CacheConfig(options=None) failed at the first prompt ("'NoneType' object has no attribute 'importance'"); a
    residual_spread of -1, nan or 2 was ignored and "a" failed in a comparison."""
    from maskkv_cli.policies.base import PolicyOptions

    for bad in (None, {"alpha": 0.2}):
        with pytest.raises(TypeError, match="^CacheConfig: options must be a PolicyOptions"):
            CacheConfig(options=bad)  # type: ignore[arg-type]
    for bad in (-1, float("nan"), 2.0, "a", True):
        with pytest.raises(UsageError, match="residual_spread must be a share of the prompt in \\[0, 1\\]"):
            PolicyOptions(residual_spread=bad)  # type: ignore[arg-type]
    assert PolicyOptions(residual_spread=0.5).residual_spread == 0.5


def test_the_library_does_not_fail_over_the_command_line_s_config_file(session, tmp_path, monkeypatch) -> None:
    """A config file the commands refuse (an unknown key) failed a library ask, through a calibration hint."""
    config = tmp_path / "config.toml"
    config.write_text('modle = "x"\n')
    monkeypatch.setenv("MASKKV_CONFIG", str(config))
    text = "Intro. The special magic number for pear is 1937. End."
    assert ask(session, text, "What is the special magic number for pear?", GEN,
               CacheConfig(policy="maskkv", budget=8)).text is not None


def test_a_huge_temperature_never_commits_the_mask_token() -> None:
    """At a temperature of 1000 (-log u)^T underflows, a token of logit -inf gave 0/0 = nan and argmax took it: the
    mask token was committed."""
    from maskkv_cli.sampling.llada import add_gumbel_noise

    logits = torch.zeros(1, 4, 50)
    logits[..., 5] = float("-inf")
    for temperature in (30.0, 1000.0, 1e10):
        for seed in range(20):
            noisy = add_gumbel_noise(logits, temperature, torch.Generator().manual_seed(seed))
            assert not noisy.isnan().any() and not (noisy.argmax(-1) == 5).any()
    plain = add_gumbel_noise(logits, 1.0, torch.Generator().manual_seed(0))
    u = torch.rand(logits.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert torch.equal(plain, logits.double().exp() / (-torch.log(u)))  # the reference trick, as it was


def test_generate_takes_a_policy_by_name_and_refuses_ids_outside_the_vocabulary(session) -> None:
    """generate(..., "maskkv") said "'str' object has no attribute 'uses_cache'"; an id past the vocabulary gave
    torch's "index out of range in self"."""
    from maskkv_cli.policies.base import get_policy
    from maskkv_cli.sampling import generate

    prompt = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    by_name = generate(session.model, prompt, GEN, "snapkv", 4)
    by_object = generate(session.model, prompt, GEN, get_policy("snapkv"), 4)
    assert torch.equal(by_name.tokens, by_object.tokens)
    vocab = session.model.config.vocab_size
    with pytest.raises(UsageError, match=f"^generate: token id {vocab} is not in the model's vocabulary"):
        generate(session.model, torch.tensor([[5, vocab]]), GEN, "full")


def test_a_dtype_the_model_does_not_run_in_is_named() -> None:
    """load_model(dtype=torch.int8) failed in torch.finfo with a TypeError."""
    from maskkv_cli.errors import ModelLoadError
    from maskkv_cli.models.loading import load_model, parse_dtype

    assert parse_dtype(torch.bfloat16) == torch.bfloat16
    with pytest.raises(ModelLoadError, match="^dtype torch.int8 is not one the model runs in: choose one of "
                                             "torch.float32, torch.bfloat16, torch.float16"):
        load_model(str(shipped_model()), dtype=torch.int8)
