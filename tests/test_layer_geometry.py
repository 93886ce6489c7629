"""Layers of different geometry go through the one engine unchanged: every layer's heads, key/value heads and head
size are read from its block, and its RoPE tables from the model's ``rope_kind`` / ``layer_rope``.

The model is a tiny random Dream whose odd layers have twice the head size, one key/value head instead of two and
another RoPE base: a test-only model (no released family of ``[prompt ; masks]`` denoisers has such layers), built
from Dream's own block with another config, and one override of the two RoPE hooks. Nothing else is written for it.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from maskkv_cli.engine.batch_memory import model_geometry
from maskkv_cli.engine.plan import CacheConfig, plan_cache
from maskkv_cli.engine.prefill import prefill
from maskkv_cli.engine.step import plain_logits, response_logits
from maskkv_cli.models.base import Rope, rope_tables
from maskkv_cli.models.config import ModelConfig, named_config
from maskkv_cli.models.dream import Dream, DreamBlock
from maskkv_cli.policies import get_policy
from maskkv_cli.sampling import GenerationConfig, sample
from maskkv_cli.sampling.stream import BatchJob, sample_many

GEN = GenerationConfig(gen_length=16, steps=16, block_length=16)


class MixedDream(Dream):
    """Dream with its odd layers built from ``odd``: another head size, key/value heads and RoPE base."""

    def __init__(self, cfg: ModelConfig, odd: ModelConfig) -> None:
        super().__init__(cfg)
        self.odd = odd
        for i in range(1, cfg.n_layers, 2):
            self.blocks[i] = DreamBlock(odd)

    def rope_kind(self, layer: int) -> object:
        return layer % 2

    def layer_rope(self, layer: int, positions: torch.Tensor, factor: float = 1.0) -> Rope:
        cfg = self.odd if layer % 2 else self.config
        return rope_tables(positions, cfg.rotary_dim, cfg.rope_theta * factor)


def mixed_model() -> MixedDream:
    cfg = replace(named_config("dream-tiny"), n_layers=4)
    # twice the head size, not half: at a head size of 8 the CPU's SDPA rounds a row by how many query rows run
    # with it (measured: 17 rows alone vs. among 40-55 differ in 12 of 16 lengths; exact at 16 and 32)
    odd = replace(cfg, n_kv_heads=1, head_dim_override=cfg.head_dim * 2, rope_theta=10_000.0)
    return MixedDream(cfg, odd).init_weights(seed=0, std=0.2).eval()


def prompt(model: MixedDream, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, model.config.vocab_size, (1, n), generator=g)


def test_the_layers_differ_and_each_rotates_with_its_own_tables() -> None:
    """The model really is mixed (else the tests below would prove nothing), and its plain forward (``model(ids)``,
    training's and the harness's) gives the engine's logits, which one RoPE for every layer would not."""
    model = mixed_model()
    geometry = [(b.n_heads, b.n_kv_heads, b.head_dim) for b in model.blocks]
    assert geometry == [(4, 2, 16), (4, 1, 32), (4, 2, 16), (4, 1, 32)]
    x = torch.cat([prompt(model, 30, 0), torch.full((1, 16), model.config.mask_token_id)], 1)
    rows = torch.arange(29, 45)  # Dream: position i is predicted from hidden state i - 1
    with torch.no_grad():
        engine = plain_logits(model, x, rows)
        dense = model(x)[:, 30:46]
        torch.testing.assert_close(dense, engine, rtol=1e-5, atol=1e-5)
        model.rope_kind = lambda layer: None  # type: ignore[method-assign]  # the even layers' tables for all
        with pytest.raises(RuntimeError):  # the odd layers' head size does not fit them
            plain_logits(model, x, rows)
        with pytest.raises(RuntimeError):
            model(x)


def test_cached_step0_and_a_cached_step_equal_the_plain_forward() -> None:
    """The prefill (policy ``full``) writes each layer's cache in its own heads and head size; step 0 and a cached
    step over the same canvas give the plain forward's logits bit for bit."""
    model = mixed_model()
    with torch.no_grad():
        for seed in range(4):
            x = torch.cat([prompt(model, 30 + seed, seed), torch.full((1, 16), model.config.mask_token_id)], 1)
            split = x.shape[1] - 16 - 1  # Dream's last prompt token runs with the masks
            rows = torch.arange(split, split + 16)
            cached, cache, _ = prefill(model, x, split, get_policy("full"), None, rows)
            assert [(layer.heads, layer.head_dim) for layer in cache.layers] == [(2, 16), (1, 32), (2, 16), (1, 32)]
            plain = plain_logits(model, x, rows)
            assert torch.equal(cached, plain), seed
            assert torch.equal(response_logits(model, cache, x[:, split:], rows - split), plain), seed


def test_maskkv_evicts_per_layer_and_a_budget_covering_the_prompt_gives_full() -> None:
    """MaskKV votes and keeps entries in each layer's own key/value heads (the kept counts per head sum to the
    layer's budget times its heads), and a budget of at least the prompt gives the full cache's tokens."""
    model = mixed_model()
    ids = prompt(model, 48, 1)
    full = sample(model, ids, GEN, plan_cache(model, CacheConfig("full"), 48)).tokens
    assert torch.equal(sample(model, ids, GEN, plan_cache(model, CacheConfig("maskkv", 48), 48)).tokens, full)
    squeezed = sample(model, ids, GEN, plan_cache(model, CacheConfig("maskkv", 8), 48))
    assert squeezed.layer_budgets is not None
    for block, record in zip(model.blocks, squeezed.records, strict=True):
        heads = record.head_budgets[0]
        assert heads.shape[-1] == block.n_kv_heads
        assert int(heads.sum()) == block.n_kv_heads * record.layer_budget


def test_prompts_of_other_lengths_step_together_as_each_alone(threads: int) -> None:
    """Six prompts, every kind of cache plan, in one batch: each one's tokens and probabilities are its own."""
    model = mixed_model()
    kinds = [CacheConfig("maskkv", 8), CacheConfig("full"), CacheConfig("none")]
    prompts = [prompt(model, n, n) for n in (20, 33, 41, 27, 50, 36)]
    jobs = [BatchJob(p, GEN, plan_cache(model, kinds[i % 3], p.shape[1])) for i, p in enumerate(prompts)]
    for job, together in zip(jobs, sample_many(model, jobs, 6), strict=True):
        alone = sample(model, job.prompt, GEN, job.plan)
        assert together.tokens.tolist() == alone.tokens.tolist()
        assert torch.equal(together.token_probs.nan_to_num(-1.0), alone.token_probs.nan_to_num(-1.0))


def test_the_memory_model_counts_each_layers_cache() -> None:
    model = mixed_model()
    geometry = model_geometry(model)
    assert geometry.kv_per_token == 2 * (2 * 2 * 16 + 2 * 1 * 32)  # keys and values of each layer, summed
