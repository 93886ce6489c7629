"""The prefill's query chunks (attention, output projection, residual) and row chunks (k, v, MLP) change no result."""

from __future__ import annotations

import functools

import pytest
import torch
from prompts import random_ids

import maskkv_cli.policies.base as policy_base
import maskkv_cli.sampling.driver as driver
from maskkv_cli.bench.live_bytes import LiveBytes
from maskkv_cli.engine.prefill import prefill, prefill_lanes
from maskkv_cli.engine.step import plain_logits
from maskkv_cli.models.config import named_config
from maskkv_cli.models.dream import Dream
from maskkv_cli.policies import PolicyOptions, get_policy
from maskkv_cli.sampling.dream import DreamGenerationConfig, generate_dream
from maskkv_cli.sampling.llada import GenerationConfig, generate

M, L = 60, 16
# (policy, options): the paper's mask-query votes, SnapKV's observation window, maskkv-plus with residual entries
# forced on (random weights are not diffuse enough for the default threshold), votes of every prompt query.
POLICIES = [
    ("full", None),
    ("maskkv", None),
    ("snapkv", PolicyOptions(window=8)),
    ("maskkv-plus", PolicyOptions(residual_spread=0.01)),
    ("prompt-vote", None),
]


@pytest.fixture(scope="module")
def dream(tiny_tokenizer):
    cfg = named_config("dream-tiny").with_(vocab_size=len(tiny_tokenizer))
    return Dream(cfg).init_weights(seed=2, std=0.2).eval()


@pytest.fixture(params=["llada", "dream"])
def model(request, tiny_model, dream):
    return tiny_model if request.param == "llada" else dream


def _ids(model):
    return torch.cat([random_ids(model, M), torch.full((1, L), model.config.mask_token_id)], 1)


@pytest.mark.parametrize("online", [False, True])
@pytest.mark.parametrize(("name", "options"), POLICIES)
def test_chunked_prefill_equals_whole_length(model, name, options, online, monkeypatch):
    monkeypatch.setattr(policy_base, "QUERY_BLOCK", 16)  # prompt-vote's queries also come in blocks
    ids = _ids(model)
    t = ids.shape[1]
    rows = torch.arange(M, t)
    policy = get_policy(name, options)
    budgets = None if name == "full" else [8] * model.config.n_layers
    with torch.no_grad():
        whole = prefill(model, ids, M, policy, budgets, rows, mlp_chunk=t, query_chunk=t, online_importance=online)
        parts = prefill(model, ids, M, policy, budgets, rows, mlp_chunk=5, query_chunk=7, online_importance=online)
    torch.testing.assert_close(parts[0], whole[0], rtol=1e-5, atol=1e-5)
    used_residual = False
    for a, b, ra, rb in zip(whole[1].layers, parts[1].layers, whole[2], parts[2], strict=True):
        assert ra.layer_budget == rb.layer_budget and torch.equal(ra.head_budgets, rb.head_budgets)
        assert (ra.positions is None) == (rb.positions is None)
        if ra.positions is not None:
            assert torch.equal(ra.positions, rb.positions)
        n = a.prompt_slots  # the response slot behind it is written by the later steps
        assert b.prompt_slots == n
        torch.testing.assert_close(b.k[:, :, :n], a.k[:, :, :n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(b.v[:, :, :n], a.v[:, :, :n], rtol=1e-5, atol=1e-5)
        assert (a.bias is None) == (b.bias is None)
        if a.bias is not None:
            torch.testing.assert_close(b.bias, a.bias, rtol=1e-4, atol=1e-4)
        if a.residual is not None:
            assert torch.equal(a.residual, b.residual)
            used_residual |= bool(a.residual.any())
        if online:
            assert ra.importance == pytest.approx(rb.importance, rel=1e-6)
    if name == "maskkv-plus":
        assert used_residual  # the residual path really ran


def test_full_prefill_equals_the_plain_forward(model):
    ids = _ids(model)
    rows = torch.arange(M, ids.shape[1])
    with torch.no_grad():
        logits, _, _ = prefill(model, ids, M, get_policy("full"), None, rows, mlp_chunk=5, query_chunk=7)
        plain = plain_logits(model, ids, rows)
    torch.testing.assert_close(logits, plain, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("name", "options"), POLICIES[1:4])
def test_chunked_prefill_gives_the_same_tokens(model, name, options, monkeypatch):
    def run(query_chunk: int, mlp_chunk: int) -> torch.Tensor:
        monkeypatch.setattr(driver, "prefill_lanes", functools.partial(prefill_lanes, query_chunk=query_chunk,
                                                                        mlp_chunk=mlp_chunk))
        prompt = random_ids(model, M)
        policy = get_policy(name, options)
        if isinstance(model, Dream):
            return generate_dream(model, prompt, DreamGenerationConfig(gen_length=16, steps=16), policy, 8).tokens
        return generate(model, prompt, GenerationConfig(gen_length=16, steps=16, block_length=8), policy, 8).tokens

    assert torch.equal(run(7, 5), run(4096, 4096))


def test_query_chunks_bound_the_live_peak(tiny_model):
    """With small query chunks the layer's whole-length tensors are x, k and v only: the peak drops by about
    one q, one attention output and one output projection (each (T, d) fp32) against whole-length attention."""
    t = 512
    ids = torch.cat([random_ids(tiny_model, t - L), torch.full((1, L), tiny_model.config.mask_token_id)], 1)
    rows = torch.arange(t - L, t)
    peaks = {}
    for chunk in (t, 32):
        with torch.no_grad(), LiveBytes() as live:
            prefill(tiny_model, ids, t - L, get_policy("maskkv"), [8] * tiny_model.config.n_layers, rows,
                    mlp_chunk=32, query_chunk=chunk)
        peaks[chunk] = live.peak
    td = t * tiny_model.config.d_model * 4
    assert peaks[t] - peaks[32] >= 2 * td
