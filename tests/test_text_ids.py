"""``prompting.chat.text_ids``: the ids ``tokenizer.encode(text, add_special_tokens=False)`` gives, by the backend's
offset-free encode where that gives the same, through ``encode`` where it might not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from prompts import TEXTS

from maskkv_cli.models.catalog import resolve_default_model
from maskkv_cli.prompting.chat import chat_prompt_ids, text_ids, tokenizer_from_folder
from maskkv_cli.prompting.fit import fit_context

SAMPLES = [
    "",
    " ",
    "a",
    "The secret number is 4366.\n\nWhat is the secret number?",
    "  leading and trailing spaces  \n\n\n\ttabs\r\nand CRLF  ",
    "digits 0123456789 and 3.14159e-10, 1,000,000",
    "unicode: naïve café, 東京, Ελληνικά, emoji 🙂👍🏽, zero-width\u200bjoiner",
    "<|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
    "a special token inside a word: abc<|eot_id|>def and a broken one <|eot_id",
    "\x00\x01 control characters \x7f",
]


@pytest.fixture(scope="module")
def embedded_tokenizer() -> Any:
    return tokenizer_from_folder(Path(resolve_default_model(None)[0]))


class Recorder:
    """A backend stand-in that counts the offset-free encodes and otherwise is the real backend."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.fast_calls = 0

    def encode_batch_fast(self, *args: Any, **kwargs: Any) -> Any:
        self.fast_calls += 1
        return self.backend.encode_batch_fast(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)


@pytest.mark.parametrize("which", ["embedded", "tiny"])
def test_text_ids_are_encodes_ids_on_every_sample(which: str, embedded_tokenizer: Any, tiny_tokenizer: Any) -> None:
    tok = embedded_tokenizer if which == "embedded" else tiny_tokenizer
    texts = SAMPLES + list(TEXTS) + ["\n\n".join(TEXTS)]
    for text in texts:
        assert text_ids(tok, text) == list(tok.encode(text, add_special_tokens=False)), repr(text)
    rendered = tok.apply_chat_template([{"role": "user", "content": TEXTS[0]}], add_generation_prompt=True,
                                       tokenize=False) if getattr(tok, "chat_template", None) else SAMPLES[7]
    assert text_ids(tok, rendered) == list(tok.encode(rendered, add_special_tokens=False))


def test_the_offset_free_encode_is_the_one_used(embedded_tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    recorder = Recorder(embedded_tokenizer._tokenizer)
    monkeypatch.setattr(embedded_tokenizer, "_tokenizer", recorder)
    ids = chat_prompt_ids(embedded_tokenizer, "The secret number is 4366. What is it?")
    fitted = fit_context(embedded_tokenizer, TEXTS[0], 10_000, "truncate", 16, 10_000.0, 2048)
    assert recorder.fast_calls == 2
    assert ids and fitted.text == TEXTS[0]


def test_backend_truncation_is_not_applied(embedded_tokenizer: Any) -> None:
    """``encode`` turns off a truncation left set on the backend; the offset-free call would apply it, so it is not
    taken then."""
    backend = embedded_tokenizer._tokenizer
    text = TEXTS[0]
    whole = list(embedded_tokenizer.encode(text, add_special_tokens=False))
    backend.enable_truncation(5)
    try:
        assert text_ids(embedded_tokenizer, text) == whole
        assert len(whole) > 5
    finally:
        backend.no_truncation()


def test_split_special_tokens_is_honoured(embedded_tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tokenizer asked to split special tokens (``split_special_tokens``) has ``encode`` set that on its backend
    first; before that, the backend would still match them whole, so the offset-free call is not taken."""
    text = "before<|eot_id|>after"
    whole = text_ids(embedded_tokenizer, text)
    monkeypatch.setattr(embedded_tokenizer, "split_special_tokens", True)
    try:
        split = text_ids(embedded_tokenizer, text)
        assert split == list(embedded_tokenizer.encode(text, add_special_tokens=False))
        assert split != whole
        assert text_ids(embedded_tokenizer, text) == split  # now set on the backend: the fast call agrees
    finally:
        embedded_tokenizer._tokenizer.encode_special_tokens = False
