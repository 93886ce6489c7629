from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from prompts import random_ids

from maskkv_cli.kv.cache import PromptCache, add_residual, select_layer
from maskkv_cli.kv.residual import attention_spread, diffuse_heads, residual_entries
from maskkv_cli.policies import LayerView, PolicyOptions, get_policy
from maskkv_cli.policies.base import Policy
from maskkv_cli.sampling.llada import GenerationConfig, generate

GEN = GenerationConfig(gen_length=16, steps=8, block_length=8)


def _equal_key_case(m=12, kept_n=3, hq=4, hkv=2, r=5, d=8, seed=0):
    """Prompt K/V whose evicted entries share one key (per head): the case where a residual entry is exact."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(1, hkv, m, d, generator=g)
    v = torch.randn(1, hkv, m, d, generator=g)
    kept = torch.zeros(1, hkv, m, dtype=torch.bool)
    kept[..., :kept_n] = True
    k[:, :, kept_n:] = torch.randn(1, hkv, 1, d, generator=g)  # every evicted entry has the same key
    q = torch.randn(1, hq, r, d, generator=g)
    return q, k, v, kept


def test_residual_entry_reproduces_full_attention_when_evicted_keys_are_equal():
    q, k, v, kept = _equal_key_case()
    scale = 1 / math.sqrt(q.shape[-1])
    k_r, v_r, offset = residual_entries(q, k, v, kept, scale)
    full = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
    n = int(kept[0, 0].sum())
    k_small = torch.cat([k[:, :, :n], k_r[:, :, None]], 2)
    v_small = torch.cat([v[:, :, :n], v_r[:, :, None]], 2)
    bias = torch.zeros(1, q.shape[1], 1, n + 1)
    bias[:, :, 0, n] = offset
    small = F.scaled_dot_product_attention(q, k_small, v_small, attn_mask=bias, scale=scale, enable_gqa=True)
    assert torch.allclose(small, full, atol=1e-5)
    without = F.scaled_dot_product_attention(q, k[:, :, :n], v[:, :, :n], scale=scale, enable_gqa=True)
    assert not torch.allclose(without, full, atol=1e-2)  # eviction alone does change the output
    assert torch.allclose(offset, torch.full_like(offset, math.log(k.shape[2] - n)), atol=1e-5)


def test_residual_through_the_cache_layout_with_gqa_and_ragged_heads():
    q, k, v, _ = _equal_key_case(m=12, kept_n=3)
    scale = 1 / math.sqrt(q.shape[-1])
    scores = torch.zeros(1, 2, 12)
    scores[..., :4] = torch.tensor([4.0, 3.0, 2.0, 1.0])  # head 0 keeps 3 (positions 0-2), head 1 keeps 4
    budgets = torch.tensor([[3, 4]])
    layer = select_layer(k, v, scores, budgets, 12, 0, group=2)
    kept = torch.zeros(1, 2, 12, dtype=torch.bool)
    kept[0, 0, :3] = kept[0, 1, :4] = True
    heads = torch.tensor([[True, False]])
    k_r, v_r, offset = residual_entries(q, k, v, kept, scale)
    layer = add_residual(layer, k_r, v_r, offset, heads)
    assert layer.prompt_slots == 5 and layer.k.shape[2] == 5 and layer.bias is not None
    assert layer.bias.shape == (1, 4, 1, 5)
    out = F.scaled_dot_product_attention(q, layer.k, layer.v, attn_mask=layer.bias, scale=scale, enable_gqa=True)
    full = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
    # head 0 (query heads 0, 1): evicted keys all equal, so its residual makes attention exact
    assert torch.allclose(out[:, :2], full[:, :2], atol=1e-5)
    # head 1 (query heads 2, 3): no residual, its slot is masked: plain attention over its 4 kept entries
    plain = F.scaled_dot_product_attention(q[:, 2:], k[:, 1:, :4], v[:, 1:, :4], scale=scale)
    assert torch.allclose(out[:, 2:], plain, atol=1e-5)
    cache = PromptCache(12, 0, [layer])
    assert cache.logical_entries() == 3 + 4 + 1


def test_nothing_evicted_gives_an_unused_residual():
    q, k, v, kept = _equal_key_case()
    kept[:, 1] = True
    _, _, offset = residual_entries(q, k, v, kept, 0.3)
    assert bool(torch.isinf(offset[:, 2:]).all()) and bool(torch.isfinite(offset[:, :2]).all())


def test_attention_spread_is_perplexity_over_prompt_length():
    m, d = 50, 8
    k = torch.randn(1, 2, m, d, generator=torch.Generator().manual_seed(0))
    q = torch.zeros(1, 4, 3, d)  # GQA, 2 query heads per key/value head
    q[:, 2:] = k[0, 1, 7] * 100  # key/value head 1: every query looks at entry 7 only
    spread = attention_spread(q, k, 1.0)
    assert spread.shape == (1, 2)
    assert abs(float(spread[0, 0]) - 1.0) < 1e-5  # zero queries: uniform over the prompt
    assert float(spread[0, 1]) < 1.5 / m


def test_only_diffuse_heads_that_evict_with_room_get_a_residual():
    spread = torch.tensor([[0.9, 0.2, 0.9, 0.9]])
    budgets = torch.tensor([[4, 4, 1, 40]])
    assert diffuse_heads(spread, budgets, 40, 0.5).tolist() == [[True, False, False, False]]
    assert diffuse_heads(spread, budgets, 41, 0.1).tolist() == [[True, True, False, True]]


# The random test model's heads are not diffuse, so the tests that need residual entries lower the threshold.
ON = get_policy("maskkv-residual", PolicyOptions(residual_spread=0.01))


PROMPT = 120  # tokens of the random prompts below


def test_residual_costs_no_extra_entries(tiny_model):
    ids, budget = random_ids(tiny_model, PROMPT), 6
    out = generate(tiny_model, ids, GEN, ON, budget)
    assert any(r.residual is not None and bool(r.residual.any()) for r in out.records)
    total = 0
    for rec in out.records:
        res = rec.residual.to(torch.int64) if rec.residual is not None else 0
        assert int((rec.head_budgets[0] + res).sum()) == tiny_model.config.n_heads * rec.layer_budget
        total += int((rec.head_budgets + res).sum())
    assert out.stats.kv_entries == total == tiny_model.config.n_layers * tiny_model.config.n_heads * budget


def test_residual_is_off_in_the_paper_rule_and_the_baselines(tiny_model):
    ids = random_ids(tiny_model, PROMPT)
    assert get_policy("maskkv-residual").residual_spread == 0.75
    assert get_policy("maskkv").residual_spread == get_policy("snapkv").residual_spread == 0.0
    paper = generate(tiny_model, ids, GEN, get_policy("maskkv"), 6)
    off = generate(tiny_model, ids, GEN, get_policy("maskkv-residual", PolicyOptions(residual_spread=0.0)), 6)
    assert all(r.residual is None for r in paper.records + off.records)
    assert torch.equal(paper.tokens, off.tokens)


@pytest.mark.parametrize("online", [False, True])
def test_residual_changes_the_steps_and_budget_at_prompt_is_still_exact(tiny_model, online):
    ids = random_ids(tiny_model, PROMPT)
    full = generate(tiny_model, ids, GEN, get_policy("full")).tokens
    assert torch.equal(generate(tiny_model, ids, GEN, ON, PROMPT, online_importance=online).tokens,
                       full)
    on = generate(tiny_model, ids, GEN, ON, 6, online_importance=online)
    assert any(r.residual is not None and bool(r.residual.any()) for r in on.records)
    paper = generate(tiny_model, ids, GEN, get_policy("maskkv"), 6, online_importance=online)
    # the same heads keep one entry fewer (a different cache), so the step-0 records differ
    assert any(not torch.equal(a.head_budgets, b.head_budgets) for a, b in zip(on.records, paper.records,
                                                                                 strict=True))


def test_profile_matrix_and_layer_importance_follow_the_policy_class(tiny_model):
    from maskkv_cli.policies.base import uses_importance
    from maskkv_cli.reports.profile_report import residual_matrix

    ids = random_ids(tiny_model, PROMPT)
    on = generate(tiny_model, ids, GEN, ON, 6)
    matrix = residual_matrix(on.records)
    assert matrix is not None and len(matrix) == tiny_model.config.n_layers
    assert sum(map(sum, matrix)) == sum(int(r.residual.sum()) for r in on.records if r.residual is not None) > 0
    assert residual_matrix(generate(tiny_model, ids, GEN, get_policy("maskkv"), 6).records) is None
    assert uses_importance("maskkv") and uses_importance("maskkv-residual")
    assert not uses_importance("snapkv") and not uses_importance("no-such-policy")


class _FixedHeadBudgets(Policy):
    """Head budgets [3, 6] whatever the scores; every head diffuse enough for a residual entry."""

    residual_default = 0.5

    def scores(self, view: LayerView, layer_budget: int) -> torch.Tensor:
        raise NotImplementedError  # the test passes its own scores

    def head_budgets(self, view: LayerView, layer_budget: int, scores: torch.Tensor) -> torch.Tensor:
        return torch.tensor([[3, 6]], device=scores.device)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_residual_covers_exactly_the_evicted_set_when_a_short_head_keeps_the_last_position(device):
    """Head 0 keeps {2, 9} (budget 3, one entry spent on the residual) and is shorter than head 1 (5 kept), so
    its padded slots repeat position M - 1 = 9, the one it keeps: 9 must still count as kept."""
    from maskkv_cli.engine.selection import select as _select

    m, d, r = 10, 4, 3
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 2, m, d, generator=g).to(device)
    v = torch.randn(1, 2, m, d, generator=g).to(device)
    q_mask = torch.zeros(1, 2, r, d, device=device)  # zero queries: every head attends uniformly (diffuse)
    scores = torch.zeros(1, 2, m, device=device)
    scores[0, 0, [2, 9]] = 1.0
    scores[0, 1, :5] = 1.0
    view = LayerView(0, 1, torch.cat([k, k], 2), torch.cat([k, k], 2)[:, :, : m + r], m, 0.5)
    layer = _select(_FixedHeadBudgets(), view, q_mask, k, v, scores, 4, 0)
    assert layer.residual is not None and layer.residual.tolist() == [[True, True]]
    assert layer.positions is not None and layer.lengths.tolist() == [[2, 5]]
    assert layer.positions[0, 0, :2].tolist() == [2, 9] and layer.positions[0, 1].tolist() == [0, 1, 2, 3, 4]
    slot = layer.prompt_slots - 1
    evicted = {0: [0, 1, 3, 4, 5, 6, 7, 8], 1: [5, 6, 7, 8, 9]}
    assert layer.bias is not None
    for head, positions in evicted.items():
        assert torch.allclose(layer.v[0, head, slot], v[0, head, positions].mean(0), atol=1e-6)
        assert torch.allclose(layer.k[0, head, slot], k[0, head, positions].mean(0), atol=1e-6)
        assert layer.bias[0, head, 0, slot].item() == pytest.approx(math.log(len(positions)), abs=1e-6)
