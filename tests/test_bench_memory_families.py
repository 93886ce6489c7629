"""``maskkv bench memory`` on every family: the profiler hooks what the engine calls (each block's projections,
attention output and MLP, the model's head), not LLaDA's parameter names, and a block-causal model's step 0 is
planned and laid out in blocks, as its sampler runs it (with and without --profile)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.nn.functional as F
from typer.testing import CliRunner

import maskkv_cli.bench.memory as memory
from maskkv_cli.cli import app
from maskkv_cli.models.config import named_config

runner = CliRunner()
FAMILIES = ["tiny", "dream-tiny", "llada-moe-tiny", "llada2-tiny"]  # LLaDA, Dream, LLaDA-MoE, LLaDA2
PHASES = {"k projection + RoPE", "v projection", "q projection + RoPE", "attention (SDPA)",
          "attention output projection + residual", "MLP", "LM head"}


@pytest.mark.parametrize("profile", [True, False], ids=["profile", "no-profile"])
@pytest.mark.parametrize("config", FAMILIES)
def test_bench_memory_runs_on_every_family(config: str, profile: bool, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # each case in this process (the fresh process runs the same ``run_memory_case``; it only costs the start-up)
    monkeypatch.setattr(memory, "run_memory_subprocess", lambda case, timeout=None: memory.run_memory_case(case))
    args = ["bench", "memory", "--config", config, "--prompt-length", "60", "--budget", "8", "--gen-length", "16",
            "--block-length", "8", "--policies", "full,maskkv", "--out", str(tmp_path), "--json"]
    result = runner.invoke(app, [*args, "--profile" if profile else "--no-profile"])
    assert result.exit_code == 0, result.output
    full, kept = json.loads(result.stdout)["results"]
    assert (full["method"], kept["method"]) == ("full", "maskkv@8")
    assert kept["kv_bytes"] < full["kv_bytes"] == full["kv_full_bytes"]  # the full cache: every cached entry
    cfg = named_config(config)
    cached = 56 if cfg.block_causal else 60 - cfg.logit_shift  # LLaDA2: the prompt's whole blocks of 8
    per_token = sum(2 * cfg.n_kv_heads * cfg.head_dim for _ in range(cfg.n_layers)) * 4  # fp32 on the CPU
    assert full["kv_full_bytes"] == per_token * cached
    for row in (full, kept):
        assert row["live_peak_above_weights_bytes"] >= row["kv_resident_bytes"] > 0
        assert ("phases" in row) is profile
    if profile:
        for row in (full, kept):
            assert {p["phase"] for p in row["phases"]} >= PHASES
            assert {p["layer"] for p in row["phases"]} == {-1, *range(cfg.n_layers + 1)}  # start, layers, head
            assert max(p["live_above_weights_bytes"] for p in row["phases"]) == row["live_peak_above_weights_bytes"]
        assert "scoring (policy votes)" in {p["phase"] for p in kept["phases"]}
    assert F.scaled_dot_product_attention.__module__ != "maskkv_cli.bench.memory"  # patches undone


def test_the_profiler_leaves_the_model_as_it_was() -> None:
    import torch

    from maskkv_cli.bench.cases import random_model

    model = random_model(named_config("llada-moe-tiny"))
    before = [set(vars(block)) for block in model.blocks], set(vars(model))
    with memory.PhasePeaks(model, torch.device("cpu")):
        assert "mlp" in vars(model.blocks[0]) and "head" in vars(model)  # wrapped on the instances
    assert ([set(vars(block)) for block in model.blocks], set(vars(model))) == before
