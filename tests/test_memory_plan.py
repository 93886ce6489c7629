"""The memory model's terms against what real models hold, and ``maskkv plan`` (issues #47 item 4, #48 item 3).

Weights: ``models/weights_estimate.py`` against ``weights_bytes`` of models loaded with ``load_model(...,
quantize=...)`` (exact: the estimate counts each tensor as torchao stores it). Cache: ``engine/batch_memory.py``'s
cache term against the bytes of real caches (the engine's prefill; DiffusionGemma's encoder and its compressed cache).
Activations: the terms that can be measured on the CPU (live tensor bytes) within stated bounds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from maskkv_cli.bench.cases import random_model
from maskkv_cli.cli import app
from maskkv_cli.engine.batch_memory import batch_memory, config_geometry, model_geometry, moe_chunk_bytes
from maskkv_cli.models.config import named_config
from maskkv_cli.models.diffusion_gemma import DiffusionGemma, parameter_count
from maskkv_cli.models.diffusion_gemma_config import FULL, SLIDING
from maskkv_cli.models.diffusion_gemma_config import named_config as dgemma_config
from maskkv_cli.models.loading import load_model, save_model
from maskkv_cli.models.quantize import int4_group, weights_bytes
from maskkv_cli.models.weights_estimate import quantized_matrix_bytes, weights_estimate

FAMILIES = ("tiny", "llada2-tiny", "llada-moe-tiny", "dream-tiny")
DG = dgemma_config("diffusiongemma-tiny")  # 2 sliding + 2 full layers, window 8, canvas 8


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("plan-models")
    return {name: save_model(random_model(named_config(name), dtype=torch.bfloat16), root / name) for name in FAMILIES}


# ----- weights ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", [None, "int8", "int4"])
@pytest.mark.parametrize("name", FAMILIES)
def test_weights_estimate_is_the_loaded_models_bytes(saved: dict[str, Path], name: str, mode: str | None) -> None:
    if mode is not None:
        pytest.importorskip("torchao")
    for dtype, element in ((torch.bfloat16, 2), (torch.float32, 4)):
        model = load_model(saved[name], dtype=dtype, quantize=mode)
        estimate = weights_estimate(named_config(name), mode, element)
        assert estimate.total_bytes == weights_bytes(model)
        if mode is None:
            assert estimate.params == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("out_in", [(96, 64), (256, 2048), (2816, 704), (64, 96), (32, 48)])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_one_matrix_as_torchao_stores_it(out_in: tuple[int, int], mode: str) -> None:
    """The rule for one (out, in) weight in bf16 equals the bytes torchao's tensor holds (int4: groups of 128 for 2048
    inputs, 64 for 704, 32 for 96; 48 inputs take no group and stay bf16)."""
    pytest.importorskip("torchao")
    from maskkv_cli.models.quantize import quantize_weight_of, tensor_bytes
    from maskkv_cli.models.rows import Linear

    out, inp = out_in
    layer = Linear(inp, out, bias=False).to(torch.bfloat16)
    quantize_weight_of(layer, mode)
    assert quantized_matrix_bytes(out, inp, mode, 2) == tensor_bytes(layer.weight)
    assert (int4_group(inp) is None) == (inp == 48)


def test_diffusion_gemma_weights() -> None:
    """Unquantized: the bytes of a real (tiny) model and the parameter count of the released shape. int8 / int4: the
    bytes of the tiny model quantized by maskkv (``quantize_model``: its projections, the self-conditioning MLP's and
    each expert's two matrices; the rest stays bf16)."""
    model = DiffusionGemma(DG).to(torch.bfloat16)
    assert weights_estimate(DG, None, 2).total_bytes == weights_bytes(model)
    big = dgemma_config("diffusiongemma-26b-a4b")
    assert weights_estimate(big, None).params == parameter_count(big) + 2 * big.n_layers  # and the layer scalars
    assert weights_estimate(big, "int8").implemented and weights_estimate(DG, None).implemented
    pytest.importorskip("torchao")
    import copy

    from maskkv_cli.models.quantize import quantize_model
    from maskkv_cli.models.quantize import weights_bytes as held_bytes

    for mode in ("int8", "int4"):
        assert weights_estimate(DG, mode, 2).total_bytes == held_bytes(quantize_model(copy.deepcopy(model), mode))


# ----- the cache --------------------------------------------------------------------------------------------------

def _dg_model() -> DiffusionGemma:
    torch.manual_seed(0)
    return DiffusionGemma(DG).eval().init_spread_weights(0)


def _bytes(layers: object) -> int:
    return sum(kv.keys.nbytes + kv.values.nbytes for kv in layers)  # type: ignore[attr-defined]


def test_diffusion_gemma_full_cache_is_the_encoders_and_sliding_layers_are_capped() -> None:
    model = _dg_model()
    g = config_geometry(DG)
    assert model_geometry(model) == g
    w = DG.sliding_window
    for m in (5, w - 1, 40):
        ids = torch.randint(3, DG.vocab_size, (1, m), generator=torch.Generator().manual_seed(m))
        with torch.no_grad():
            cache = model.encode(ids).cache
        sliding = [cache.layers[i] for i in range(DG.n_layers) if DG.layer_types[i] == SLIDING]
        assert all(kv.keys.shape[2] == min(m, w - 1) for kv in sliding)
        memory = batch_memory(g, m, DG.canvas_length, m, 4)
        assert memory.cache_per_sequence == _bytes(cache.layers)
        assert memory.terms["cache: capped layers"] == _bytes(sliding)
    # the sliding layers' bytes stop growing at W - 1 entries; the full layers' grow with the prompt
    assert batch_memory(g, 400, 8, 400, 2).terms["cache: capped layers"] == \
        batch_memory(g, 40, 8, 40, 2).terms["cache: capped layers"]


def test_diffusion_gemma_compressed_cache() -> None:
    """A compressed cache at budget B: SnapKV (every head keeps B on every full layer: no padding) holds exactly the
    estimate; MaskKV's heads keep their own numbers, whose entries add up to the estimate (the tensors pad each
    layer to its longest head). A committed canvas joins every layer, sliding ones still capped."""
    from maskkv_cli.policies import get_policy
    from maskkv_cli.sampling.diffusion_gemma_kv import compress, encode_prompt, first_step
    from maskkv_cli.sampling.diffusion_gemma_steps import random_canvas

    model, m, budget = _dg_model(), 40, 6
    ids = torch.randint(3, DG.vocab_size, (1, m), generator=torch.Generator().manual_seed(1))
    prompt = encode_prompt(model, ids)
    canvas = random_canvas(1, DG.canvas_length, DG.vocab_size, torch.Generator().manual_seed(2))
    _, votes = first_step(model, prompt.cache, canvas)
    g = config_geometry(DG)
    estimate = batch_memory(g, m, DG.canvas_length, budget, 4).cache_per_sequence
    snap = compress(model, prompt, votes, get_policy("snapkv"), budget).cache
    assert _bytes(snap.layers) == estimate
    mask = compress(model, prompt, votes, get_policy("maskkv"), budget).cache
    entry = {i: 2 * DG.layer(i).head_dim * 4 for i in range(DG.n_layers)}  # one head's key and value, fp32
    logical = sum((int(kv.kept.sum()) if kv.kept is not None else kv.keys.shape[1] * kv.keys.shape[2]) * entry[i]
                  for i, kv in enumerate(mask.layers))
    assert logical == estimate <= _bytes(mask.layers)
    with torch.no_grad():
        committed = model.commit(snap, canvas)
    assert _bytes(committed.layers) == batch_memory(g, m, 2 * DG.canvas_length, budget, 4).cache_per_sequence


@pytest.mark.parametrize("policy, budget", [("full", None), ("snapkv", 16), ("maskkv", 16)])
def test_engine_cache_is_the_estimate(policy: str, budget: int | None) -> None:
    """LLaDA's prefill: the K/V buffers (prompt slots and the response slot) are the estimate's cache; MaskKV's
    kept entries add up to it (its buffers pad each layer to its longest head)."""
    from maskkv_cli.bench.memory import prefill_input
    from maskkv_cli.engine.plan import CachePlan
    from maskkv_cli.engine.prefill import prefill
    from maskkv_cli.policies import get_policy

    cfg = named_config("tiny")
    model = random_model(cfg)
    m, n = 100, 16
    pol = get_policy(policy)
    plan = CachePlan.build(model, pol, budget, m, block_length=8)
    prompt = torch.randint(6, 400, (1, m), generator=torch.Generator().manual_seed(0))
    ids, rows, layout = prefill_input(model, plan, prompt, n, 8)
    with torch.no_grad():
        _, cache, _ = prefill(model, ids, plan.split, pol, None if plan.layer_budgets is None
                              else list(plan.layer_budgets), rows, layout=layout)
    estimate = batch_memory(config_geometry(cfg), m, n, m if budget is None else budget, 4).cache_per_sequence
    buffers = sum(layer.k.nbytes + layer.v.nbytes for layer in cache.layers)
    per_entry = 2 * cfg.head_dim * 4  # one head's key and value, fp32
    logical = (cache.logical_entries() + n * cfg.n_kv_heads * cfg.n_layers) * per_entry  # type: ignore[operator]
    assert logical == estimate
    assert (buffers == estimate) if policy != "maskkv" else (buffers >= estimate)


# ----- activations (CPU, live tensor bytes) -------------------------------------------------------------------------

def test_moe_chunk_term_against_live_bytes() -> None:
    """The routed copies of a chunk through LLaDA2's experts in bf16: the term is within 2% of the live peak (the
    rest: each expert's own SwiGLU temporaries, which the term leaves out)."""
    import dataclasses

    from maskkv_cli.bench.live_bytes import LiveBytes
    from maskkv_cli.models.moe import MoE, run_experts

    tiny = named_config("llada2-tiny")
    cfg = tiny.with_(d_model=256, moe=dataclasses.replace(tiny.moe, expert_hidden=64, shared_hidden=64))
    model = random_model(cfg, dtype=torch.bfloat16)
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    x = torch.randn(1024, 256, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch.no_grad():
        experts, weights = moe.gate(x)
        with LiveBytes() as live:
            run_experts(x, experts, weights, moe.experts)
    term = moe_chunk_bytes(config_geometry(cfg), 1024, 2)
    assert abs(live.peak - term) <= 0.02 * term


def test_diffusion_gemma_step_and_encoder_chunk_against_live_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A DiffusionGemma of d 256 (5 sliding layers, window 64; 1 full layer), prompts of 2,048 and 4,096 tokens
    encoded (in 512-token chunks) with room for a canvas, bf16 on the CPU, where attention forms no score matrix,
    each KV head's query heads folded into its rows as on CUDA (the mask layout the model counts): the encoder's
    peak is below the cache, its room and the encoder term (which adds phases that do not coincide) and above 60% of
    it; from 2,048 to 4,096 tokens it grows by the cache's growth plus the mask block's, within 10%. A decoder step
    peaks below the step term (which counts three vocabulary-wide fp32 logits, as the sampler keeps them, where
    ``decode`` alone holds one) and above half of it, the same at both lengths (the canvas's entries go into the full
    layer's room: no copy of its cache)."""
    import maskkv_cli.models.base as base
    import maskkv_cli.models.diffusion_gemma_attention as attention
    from maskkv_cli.bench.live_bytes import LiveBytes
    from maskkv_cli.models.rows import small_rows

    def folds(q: torch.Tensor, k: torch.Tensor) -> bool:
        return q.shape[1] != k.shape[1]

    monkeypatch.setattr(base, "folds_groups", folds)  # what attention decides by default
    monkeypatch.setattr(attention, "folds_groups", folds)  # what attend_causal sizes its mask blocks by
    cfg = DG.with_(d_model=256, mlp_hidden_size=192, n_layers=6, n_heads=8, n_kv_heads=4, head_dim=32,
                   layer_types=(SLIDING,) * 5 + (FULL,), n_experts=8, top_k_experts=4, moe_hidden_size=64,
                   global_head_dim=64, n_global_kv_heads=2, sliding_window=64, vocab_size=4096, canvas_length=32,
                   max_position_embeddings=4096)
    model = DiffusionGemma(cfg).to(torch.bfloat16).eval().init_weights(0)
    small_rows("cpu", torch.bfloat16)  # the once-per-process probe of models/rows.py
    readings = []
    for m in (2048, 4096):
        ids = torch.randint(3, cfg.vocab_size, (1, m), generator=torch.Generator().manual_seed(0))
        canvas = torch.randint(3, cfg.vocab_size, (1, cfg.canvas_length), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            with LiveBytes() as encoder:
                cache = model.encode(ids, spare=cfg.canvas_length).cache
            with LiveBytes() as step:
                model.decode(canvas, cache)
        memory = batch_memory(config_geometry(cfg), m, cfg.canvas_length, m, 2)
        expected = memory.cache_per_sequence + memory.terms["step canvas room"] + memory.terms["encoder chunk"]
        assert 0.6 * expected <= encoder.peak <= expected
        assert memory.step_per_sequence / 2 <= step.peak <= memory.step_per_sequence
        readings.append((encoder.peak, step.peak, memory))
    (p2, s2, m2), (p4, s4, m4) = readings
    growth = (m4.cache_per_sequence - m2.cache_per_sequence
              + m4.terms["encoder mask block"] - m2.terms["encoder mask block"])
    assert abs((p4 - p2) - growth) <= 0.1 * growth
    assert s2 == s4


# ----- maskkv plan ----------------------------------------------------------------------------------------------------

def _plan(*args: str) -> object:
    return CliRunner().invoke(app, ["plan", *args])


def test_plan_json_rows() -> None:
    result = _plan("--model", "diffusiongemma-26b-a4b", "--context", "8k,256k", "--budgets", "64,256", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    rows = data["rows"]
    assert data["estimate"] is True and data["family"] == "diffusion_gemma"
    # the kept cache is the budget per head on average; the buffers pad to each layer's longest head (they showed
    # 1.5x the plan's figure on the embedded model without a word)
    assert any("pads each layer's cache to its longest head" in note for note in data["notes"])
    assert [(r["format"], r["context"], r["budget"]) for r in rows][:3] == [("bf16", 8192, None), ("bf16", 8192, 64),
                                                                          ("bf16", 8192, 256)]
    assert len(rows) == 3 * 2 * 3  # formats x contexts x (full + 2 budgets)
    for r in rows:
        assert r["total"] == r["weights"] + r["cache_peak"] + r["activations"]
        assert r["fits"]["80"] == (r["total"] + (1 << 30) <= 80 << 30)
        assert r["weights_implemented"]  # maskkv quantizes DiffusionGemma too
        assert r["prompt"] == r["context"] - 256 and not r["over_window"]
    full, kept = (next(r for r in rows if r["format"] == "bf16" and r["context"] == 262144 and r["budget"] == b)
                  for b in (None, 256))
    assert kept["cache_kept"] < full["cache_kept"] == full["cache_peak"]
    # MaskKV's cache is encoded layer by layer, each full layer cut before the next: at the peak the kept entries
    # and the rest of one whole full layer (2 KV heads of 512 dims, K and V in bf16: the prompt and the canvas's
    # room, less its 256 kept entries)
    prompt, canvas, held = 262144 - 256, 256, 256
    one_layer = 2 * 2 * 512 * 2 * (prompt + canvas - held)
    assert kept["cache_peak"] == kept["cache_kept"] + one_layer
    int4 = next(r for r in rows if r["format"] == "int4" and r["context"] == 8192 and r["budget"] is None)
    assert int4["weights"] < 0.3 * full["weights"]


def test_plan_table_folder_and_errors(tiny_dir: Path) -> None:
    shown = _plan("--model", "llada2-mini", "--context", "8k,40k", "--quantize", "bf16,int4")
    assert shown.exit_code == 0, shown.output
    assert "maskkv@256" in shown.output and "80 GiB" in shown.output and "40,960!" in shown.output
    folder = _plan("--model", str(tiny_dir), "--context", "256", "--gen-length", "32", "--json")
    assert folder.exit_code == 0, folder.output
    assert json.loads(folder.output)["source"] == str(tiny_dir)
    for args, words in ((["--model", "no-such-model"], "named config"),
                        (["--model", "tiny", "--quantize", "int3"], "int3"),
                        (["--model", "tiny", "--quantize", "none"], "named by their dtype, e.g. bf16"),
                        (["--model", "tiny", "--context", "100", "--gen-length", "128"], "no prompt"),
                        (["--context", "1k"], "needs --model"),
                        (["--model", "tiny", "--gpu-sizes", ""], "--gpu-sizes is empty; give e.g. --gpu-sizes 24,80"),
                        (["--model", "tiny", "--context", ""], "--context is empty; give e.g. --context 8k,32k")):
        bad = _plan(*args)
        assert bad.exit_code != 0 and words in bad.output and "Traceback" not in bad.output


def test_plan_names_where_a_default_model_it_cannot_read_was_set(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """It said "model folder ... does not exist" without a word of MASKKV_MODEL or the config file's line."""
    config = tmp_path / "config.toml"
    config.write_text(f'model = "{tmp_path / "gone"}"\n')
    monkeypatch.setenv("MASKKV_CONFIG", str(config))
    bad = _plan()
    assert bad.exit_code == 2 and f'`model = "{tmp_path / "gone"}"` in {config} names no model plan can read' \
        in bad.output
    monkeypatch.setenv("MASKKV_MODEL", "/nowhere")
    bad = _plan()
    assert bad.exit_code == 2 and "MASKKV_MODEL=/nowhere names no model plan can read" in bad.output
    assert "named config" in _plan("--model", "/nowhere").output and "MASKKV_MODEL" not in _plan(
        "--model", "/nowhere").output  # a --model given is named as itself


def test_committed_canvases_join_the_cache() -> None:
    """A response of three canvases holds two committed canvases in the cache at its last one."""
    g = config_geometry(DG)
    one, three = (batch_memory(g, 40, n, 6, 2) for n in (DG.canvas_length, 3 * DG.canvas_length))
    growing = g.kv_per_token * 2
    assert three.terms["cache: growing layers"] - one.terms["cache: growing layers"] == growing * 2 * DG.canvas_length
    assert three.terms["cache: capped layers"] == one.terms["cache: capped layers"]


def test_plan_s_table_is_never_cut_off_a_terminal() -> None:
    """With COLUMNS=100 (docs/guide.md's setting) the table's cells were cut ("cont…", "maskkv@…")."""
    for env in ({"COLUMNS": "100"}, {"COLUMNS": None}):
        shown = CliRunner().invoke(app, ["plan", "--model", "llada2-mini", "--context", "8k,32k"], env=env)
        assert shown.exit_code == 0 and "…" not in shown.output and "maskkv@256" in shown.output, shown.output
