"""The block contract: every path that runs a layer (the plain forward, the cached prefill, a cached step, the layer
importance, the limit line) computes it the same way, for all four families (LLaDA, Dream, LLaDA-MoE, LLaDA2), in
fp32 and bf16, with and without grouped-query attention (Dream-tiny and LLaDA2-tiny have 4 query heads over 2
key/value heads); LLaDA2's block-causal loop with its cache gives the no-cache loop's logits bit for bit around block
edges; where a cache changes the answer by design (the bidirectional families' later steps) bf16 changes it no more
than fp32 does."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from maskkv_cli.bench.limit import measure_limit
from maskkv_cli.engine.importance import measure_importance
from maskkv_cli.engine.plan import CachePlan
from maskkv_cli.engine.prefill import prefill
from maskkv_cli.engine.step import plain_logits, response_logits
from maskkv_cli.models.config import named_config
from maskkv_cli.models.families import build_model
from maskkv_cli.models.loading import save_model
from maskkv_cli.policies import get_policy
from maskkv_cli.sampling.driver import Generation, step_round
from maskkv_cli.sampling.forward import BlockForward, StepRequest, finish_rows
from maskkv_cli.sampling.llada import GenerationConfig

CONFIGS = {"llada": "tiny", "dream": "dream-tiny", "llada-moe": "llada-moe-tiny", "llada2": "llada2-tiny"}
BIDIRECTIONAL = ["llada", "dream", "llada-moe"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
M, L = 40, 16
runner = CliRunner()


def random_model(family: str, dtype: torch.dtype):
    """Weights large enough (std 0.2) that rounding differences between two paths would show in the logits."""
    return build_model(named_config(CONFIGS[family])).init_weights(seed=1, std=0.2).to(dtype).eval()


def sequence(model, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(10, model.config.vocab_size, (1, M), generator=g)
    return torch.cat([prompt, torch.full((1, L), model.config.mask_token_id)], 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", CONFIGS)
def test_cached_step0_equals_the_plain_forward(family, dtype):
    """Policy ``full``'s prefill (the cached path) and policy ``none``'s plain forward give the step-0 logits of
    the same rows bit for bit on 12 prompts, in fp32 and in bf16 (before the block contract, Dream's prefill rotated
    in fp32 and its plain forward in bf16: 0.19 apart, different tokens on 5 of 12 prompts; before the bf16 row
    floor, bf16 was only within rounding). Then a cached step over the same canvas (the response rows alone over
    the prompt's cached keys and values) gives them too: the one later step at which a bidirectional model's
    cache is exact in arithmetic."""
    model = random_model(family, DTYPES[dtype])
    split = M - model.config.logit_shift  # the cached prompt segment (Dream's last prompt token runs with masks)
    rows = torch.arange(split, split + L)  # the hidden states that predict the L response positions
    with torch.no_grad():
        for seed in range(12):
            x = sequence(model, seed)
            cached, cache, _ = prefill(model, x, split, get_policy("full"), None, rows)
            plain = plain_logits(model, x, rows)
            assert torch.equal(cached, plain), seed
            step = response_logits(model, cache, x[:, split:], rows - split)
            assert torch.equal(step, plain), seed


def block_logits(model, policy: str, x: torch.Tensor, prompt_len: int, block: int) -> list[torch.Tensor]:
    """Every block of the canvas ``x`` (1, total) from the one after the prompt's whole blocks on, decoded in one
    step (all its rows) under ``policy`` through LLaDA2's forward; the cached loop finishes each block first."""
    total = x.shape[1]
    plan = CachePlan.build(model, get_policy(policy), None, prompt_len, block_length=block)
    forward = BlockForward(model, plan, block, total)
    out: list[torch.Tensor] = []

    class Run:
        def __init__(self) -> None:
            self.forward = forward

        def result(self) -> None:
            return None

    def loop():  # type: ignore[no-untyped-def]
        for blk in range(prompt_len // block, total // block):
            out.append((yield StepRequest(x, torch.arange(block), blk * block)))
            if forward.keeps_blocks and (blk + 1) * block < total:
                yield StepRequest(x, finish_rows(x.device), blk * block, finish=True)

    gen = Generation(0, Run(), loop())  # type: ignore[arg-type]
    while not gen.done:
        step_round(model, [gen])
    assert gen.error is None
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_block_causal_cache_gives_the_no_cache_logits_around_block_edges(dtype):
    """LLaDA2's cached loop (the prompt's blocks once, each finished block once more) and its no-cache loop (the
    whole window at every step) give every block bit-identical logits, for prompts ending just before, at and just
    after a block edge (blocks of 8) and in bf16 as in fp32. Before a finished block's pass spanned the later
    blocks' slots masked, its keys and values were computed cut off at its end, which SDPA rounds otherwise than the
    later windows (masked keys change how it groups its sums): up to 3.3 apart in bf16 logits."""
    model = build_model(named_config("llada2-tiny")).init_weights(seed=3, std=0.25).to(DTYPES[dtype]).eval()
    with torch.no_grad():
        for prompt_len in (7, 8, 9, 15, 16, 17, 23, 24, 25):
            total = -(-(prompt_len + 24) // 8) * 8
            g = torch.Generator().manual_seed(prompt_len)
            x = torch.randint(6, model.config.vocab_size, (1, total), generator=g)
            plain, cached = (block_logits(model, p, x, prompt_len, 8) for p in ("none", "full"))
            assert len(plain) == len(cached) == total // 8 - prompt_len // 8
            for blk, (a, b) in enumerate(zip(plain, cached, strict=True)):
                assert torch.equal(a, b), (prompt_len, blk)


@pytest.mark.parametrize("family", BIDIRECTIONAL)
def test_bf16_moves_a_bidirectional_cache_no_further_than_fp32(family):
    """On LLaDA, Dream and LLaDA-MoE ``full`` is not ``none`` by design (the response's keys change at every step,
    the cached prompt's would too), in any dtype: the measured agreement of their tokens is the bound. Here (12
    prompts, 16 tokens each, greedy) bf16 agrees with its no-cache answer about as often as fp32 with its own:
    tokens 86 / 91 of 192 (LLaDA fp32 / bf16), 65 / 60 (Dream), 97 / 100 (LLaDA-MoE); asserted within 10% of
    the tokens."""
    from maskkv_cli.sampling import generate
    from maskkv_cli.sampling.dream import DreamGenerationConfig, generate_dream

    agree = {}
    for dtype, torch_dtype in DTYPES.items():
        model = random_model(family, torch_dtype)
        same = total = 0
        for n in (13, 16, 37):
            for seed in range(4):
                ids = torch.randint(10, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))
                if family == "dream":
                    dream = DreamGenerationConfig(gen_length=16, steps=16, alg="entropy")
                    a, b = (generate_dream(model, ids, dream, get_policy(p)).tokens for p in ("none", "full"))
                else:
                    gen = GenerationConfig(gen_length=16, steps=16, block_length=8)
                    a, b = (generate(model, ids, gen, get_policy(p)).tokens for p in ("none", "full"))
                same, total = same + int((a == b).sum()), total + a.numel()
        agree[dtype] = same
    assert agree["bf16"] >= agree["fp32"] - 0.1 * total, agree


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", CONFIGS)
def test_layer_importance_equals_the_online_prefill(family, dtype):
    """``maskkv calibrate``'s measurement and the online prefill see the same attention in every layer."""
    model = random_model(family, DTYPES[dtype])
    x = sequence(model, 0)
    budgets = [8] * model.config.n_layers
    with torch.no_grad():
        _, _, records = prefill(model, x, M, get_policy("maskkv"), budgets, torch.arange(M, M + L),
                                online_importance=True)
    measured = measure_importance(model, [x]).importance
    assert sorted(r.importance for r in records) == sorted(measured)  # records are in selection order
    assert [r.importance for r in sorted(records, key=lambda r: r.layer)] == measured


@pytest.mark.parametrize("family", CONFIGS)
def test_limit_line_runs_under_gqa(family):
    """The limit line's full forward and its bare steps (K/V buffers of H_kv heads) on every family (a
    block-causal one has one more pass: the finished first block's final tokens)."""
    model = random_model(family, torch.float32)
    gen = GenerationConfig(gen_length=L, steps=8, block_length=8)
    timing = measure_limit(model, sequence(model, 0)[:, :M], gen, keys=6)
    passes = 7 + model.config.block_causal
    assert timing.prefill_s > 0 and len(timing.step_s) == passes and timing.attention_keys == 6 + L


def test_calibrate_and_bench_speed_on_dream(tmp_path, tiny_tokenizer):
    """The two commands that crashed on every GQA model: ``calibrate`` and ``bench speed``'s limit line."""
    from maskkv_cli.cli import app

    cfg = named_config("dream-tiny").with_(vocab_size=len(tiny_tokenizer))
    folder = save_model(build_model(cfg).init_weights(seed=2), tmp_path / "dream", tiny_tokenizer)
    result = runner.invoke(app, ["calibrate", "--model", str(folder), "--samples", "2", "--max-tokens", "32",
                                 "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert len(data["importance"]) == cfg.n_layers and all(v > 0 for v in data["importance"])

    args = ["bench", "speed", "--config", "dream-tiny", "--prompt-lengths", "32", "--policies", "none,full,maskkv",
            "--budgets", "8", "--gen-length", "16", "--steps", "8", "--block-length", "8", "--none-steps", "2",
            "--in-process", "--out", str(tmp_path / "speed"), "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["results"]
    assert [r["method"] for r in rows] == ["none", "full", "maskkv@8"]
    assert all(r["limit_s"] > 0 for r in rows)
