"""``maskkv serve`` on a tiny random DiffusionGemma (``tests/dgemma_folder.py``): its sampler denoises whole canvases
of 8 tokens, so an answer of ``max_tokens`` 3 is generated as 8; the API answers with the first 3, plain and
streamed, and counts 3."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette", reason="the serve extra is not installed: pip install -e '.[serve]'")
pytest.importorskip("transformers.models.diffusion_gemma", reason="this transformers has no DiffusionGemma")
openai = pytest.importorskip("openai", reason="the openai client is not installed: pip install -e '.[dev]'")

from dgemma_folder import CANVAS, build_folder  # noqa: E402

from maskkv_cli.server import BackgroundServer, ServerConfig, create_app  # noqa: E402

QUESTION = "the river runs"


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from maskkv_cli.app.session import Session

    root = tmp_path_factory.mktemp("dgemma-serve")
    folder = build_folder(root / "tiny-dgemma")
    with BackgroundServer(create_app(Session(str(folder)), ServerConfig(store_root=root / "store"))) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def _ask(client, max_tokens: int, **kwargs):
    return client.chat.completions.create(model="any", messages=[{"role": "user", "content": QUESTION}],
                                          max_tokens=max_tokens, seed=1, temperature=0.0, **kwargs)


@pytest.mark.parametrize("max_tokens", [3, CANVAS + 1])
def test_an_answer_keeps_to_max_tokens_where_the_sampler_fills_whole_canvases(client, max_tokens):
    whole = _ask(client, 2 * CANVAS)  # the same canvases, run to their end
    assert whole.usage.completion_tokens > max_tokens  # the random model writes no end-of-text that early
    plain = _ask(client, max_tokens)
    assert plain.usage.completion_tokens == max_tokens
    assert plain.choices[0].finish_reason == "length"
    text = plain.choices[0].message.content
    assert text and len(text) < len(whole.choices[0].message.content)
    pieces = [c.choices[0].delta.content for c in _ask(client, max_tokens, stream=True)
              if c.choices and c.choices[0].delta.content]
    assert "".join(pieces) == text
