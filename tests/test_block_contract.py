"""The block contract: every path that runs a layer (the plain forward, the cached prefill, the layer importance,
the limit line) computes it the same way, for both families, in fp32 and bf16, with and without grouped-query
attention (Dream-tiny has 4 query heads over 2 key/value heads)."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from maskkv_cli.bench.limit import measure_limit
from maskkv_cli.engine.importance import measure_importance
from maskkv_cli.engine.prefill import prefill
from maskkv_cli.engine.step import plain_logits
from maskkv_cli.models.config import named_config
from maskkv_cli.models.families import build_model
from maskkv_cli.models.loading import save_model
from maskkv_cli.policies import get_policy
from maskkv_cli.sampling.llada import GenerationConfig

CONFIGS = {"llada": "tiny", "dream": "dream-tiny"}
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
    the same rows: bit-identical in fp32; in bf16 the same tokens on every one of 12 prompts, and logits within
    bf16 rounding (before the block contract, Dream's prefill rotated in fp32 and its plain forward in bf16:
    0.19 apart, different tokens on 5 of 12 prompts)."""
    model = random_model(family, DTYPES[dtype])
    split = M - model.config.logit_shift  # the cached prompt segment (Dream's last prompt token runs with masks)
    rows = torch.arange(split, split + L)  # the hidden states that predict the L response positions
    worst = 0.0
    with torch.no_grad():
        for seed in range(12):
            x = sequence(model, seed)
            cached, _, _ = prefill(model, x, split, get_policy("full"), None, rows)
            plain = plain_logits(model, x, rows)
            if dtype == "fp32":
                assert torch.equal(cached, plain)
            assert torch.equal(cached.argmax(-1), plain.argmax(-1))
            worst = max(worst, float((cached.float() - plain.float()).abs().max()))
    assert worst <= (0.0 if dtype == "fp32" else 0.05)


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
    """The limit line's full forward and its bare steps (K/V buffers of H_kv heads) on both families."""
    model = random_model(family, torch.float32)
    gen = GenerationConfig(gen_length=L, steps=8, block_length=8)
    timing = measure_limit(model, sequence(model, 0)[:, :M], gen, keys=6)
    assert timing.prefill_s > 0 and len(timing.step_s) == 7 and timing.attention_keys == 6 + L


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
