"""Mixture of experts: the two routers on hand-checked cases, grouped experts against a token-by-token loop, and
the LLaDA2 / LLaDA-MoE checkpoints in the upstream layout."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from maskkv_cli.errors import ModelLoadError
from maskkv_cli.models.base import SwiGLU
from maskkv_cli.models.config import MoEConfig, named_config
from maskkv_cli.models.families import build_model, config_from_hf
from maskkv_cli.models.loading import load_model, save_model
from maskkv_cli.models.moe import route_sigmoid_groups, route_softmax, run_experts

SIG = MoEConfig(n_experts=8, top_k=2, expert_hidden=4, layers=(True,), n_group=4, topk_group=2, routed_scaling=2.5)


def sigmoid(v: float) -> float:
    return 1 / (1 + math.exp(-v))


def route(values: list[float], moe: MoEConfig = SIG, bias: list[float] | None = None):
    """The router on one token whose logits are ``values``: x = ones, W = diag(values)."""
    x = torch.ones(1, len(values))
    w = torch.diag(torch.tensor(values))
    b = None if bias is None else torch.tensor(bias)
    experts, weights = route_sigmoid_groups(x, w, b, moe)
    return experts[0].tolist(), weights[0].tolist()


def test_group_limited_selection_skips_the_best_expert_of_a_weak_group():
    # groups of two: g0 = (3, -3) holds the single best expert, but its two scores sum to 1.0 while g1 and g2
    # sum to more; only the two best groups compete, so expert 0 is never chosen
    values = [3.0, -3.0, 1.0, 0.8, 0.9, 0.7, -5.0, -5.0]
    experts, weights = route(values)
    assert sorted(experts) == [2, 4]
    s2, s4 = sigmoid(1.0), sigmoid(0.9)
    assert weights == pytest.approx([2.5 * s2 / (s2 + s4), 2.5 * s4 / (s2 + s4)])  # normalised, times 2.5
    assert sum(weights) == pytest.approx(2.5)


def test_expert_bias_selects_but_does_not_weigh():
    values = [3.0, -3.0, 1.0, 0.8, 0.9, 0.7, -5.0, -5.0]
    bias = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0]  # lifts group 3 (and expert 7) above the others
    experts, weights = route(values, bias=bias)
    assert experts[0] == 7 and experts[1] == 2  # expert 7 by its biased score, then the best of the next group
    s7, s2 = sigmoid(-5.0), sigmoid(1.0)
    assert weights == pytest.approx([2.5 * s7 / (s7 + s2), 2.5 * s2 / (s7 + s2)])  # the unbiased scores


def test_one_expert_per_token_is_not_normalised():
    moe = MoEConfig(n_experts=4, top_k=1, expert_hidden=4, layers=(True,), n_group=1, topk_group=1,
                    routed_scaling=2.5)
    experts, weights = route([0.1, 0.4, -1.0, 0.2], moe)
    assert experts == [1] and weights == pytest.approx([2.5 * sigmoid(0.4)])


def test_softmax_router_keeps_raw_probabilities_and_biases_them():
    x = torch.ones(1, 4)
    w = torch.diag(torch.tensor([1.0, 2.0, 0.5, 0.0]))
    p = torch.tensor([1.0, 2.0, 0.5, 0.0]).softmax(0)
    experts, weights = route_softmax(x, w, None, 2)
    assert experts[0].tolist() == [1, 0] and weights[0].tolist() == pytest.approx([p[1].item(), p[0].item()])
    experts, weights = route_softmax(x, w, torch.tensor([0.0, 0.0, 0.5, 0.0]), 2)
    assert experts[0].tolist() == [2, 1]  # the bias moves the choice and the weight
    assert weights[0].tolist() == pytest.approx([p[2].item() + 0.5, p[1].item()])


def test_grouped_experts_equal_a_token_by_token_loop():
    torch.manual_seed(0)
    modules = torch.nn.ModuleList(SwiGLU(6, 5) for _ in range(5))
    x = torch.randn(9, 6)
    experts = torch.randint(0, 5, (9, 3))
    weights = torch.rand(9, 3)
    grouped = run_experts(x, experts, weights, modules)
    naive = torch.stack([sum(weights[t, j] * modules[int(experts[t, j])](x[t]) for j in range(3)) for t in range(9)])
    assert torch.allclose(grouped, naive, atol=1e-6)


@pytest.mark.parametrize(("name", "keys"), [
    ("llada2-tiny", ["model.word_embeddings.weight", "model.layers.0.attention.query_key_value.weight",
                     "model.layers.0.attention.query_layernorm.weight", "model.layers.0.attention.dense.weight",
                     "model.layers.0.mlp.gate_proj.weight", "model.layers.1.mlp.gate.weight",
                     "model.layers.1.mlp.gate.expert_bias", "model.layers.1.mlp.experts.7.down_proj.weight",
                     "model.layers.1.mlp.shared_experts.up_proj.weight", "model.norm.weight", "lm_head.weight"]),
    ("llada-moe-tiny", ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                        "model.layers.0.self_attn.k_norm.weight", "model.layers.0.mlp.up_proj.weight",
                        "model.layers.1.mlp.gate.weight", "model.layers.1.mlp.expert_bias",
                        "model.layers.1.mlp.experts.3.gate_proj.weight",
                        "model.layers.1.shared_expert.down_proj.weight", "lm_head.weight"]),
])
def test_upstream_layout_round_trip(tmp_path, name, keys):
    model = build_model(named_config(name)).init_weights(seed=1, std=0.2).eval()
    folder = save_model(model, tmp_path / name)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        stored = set(f.keys())
    assert set(keys) <= stored
    loaded = load_model(folder)
    ids = torch.randint(6, 500, (1, 20))
    with torch.no_grad():  # the same weights (tensors loaded from the file may sit at other alignments)
        assert torch.allclose(loaded(ids), model(ids), atol=1e-5)
    assert config_from_hf(json.loads((folder / "config.json").read_text())) == model.config


def test_a_checkpoint_without_the_expert_bias_loads_it_as_zeros(tmp_path):
    folder = save_model(build_model(named_config("llada2-tiny")).init_weights(seed=1), tmp_path / "m")
    weights = load_file(str(folder / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if not k.endswith("expert_bias")}, str(folder / "model.safetensors"))
    loaded = load_model(folder)
    assert torch.equal(loaded.blocks[1].mlp_layers.gate.expert_bias, torch.zeros(8))
    save_file({k: v for k, v in weights.items() if not k.endswith("gate.weight")}, str(folder / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="missing keys"):
        load_model(folder)


def test_llada2_config_reads_the_released_fields():
    data = {"model_type": "llada2_moe", "hidden_size": 2048, "num_hidden_layers": 20, "num_attention_heads": 16,
            "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 5120, "moe_intermediate_size": 512,
            "num_experts": 256, "num_experts_per_tok": 8, "num_shared_experts": 1, "n_group": 8, "topk_group": 4,
            "routed_scaling_factor": 2.5, "first_k_dense_replace": 1, "rms_norm_eps": 1e-6, "rope_theta": 600000,
            "partial_rotary_factor": 0.5, "vocab_size": 157184, "max_position_embeddings": 32768,
            "pad_token_id": 156892}
    cfg = config_from_hf(data)
    assert cfg == named_config("llada2-mini")
    assert (cfg.mask_token_id, cfg.eos_token_id, cfg.rotary_dim, cfg.block_causal) == (156895, 156892, 64, True)
    with pytest.raises(ModelLoadError, match="use_qkv_bias"):
        config_from_hf({**data, "use_qkv_bias": True})


def test_model_type_llada_with_experts_is_llada_moe():
    base = {"model_type": "llada", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "vocab_size": 512, "expert_intermediate_size": 32, "num_experts_per_tok": 2,
            "shared_expert_intermediate_size": None, "qk_layernorm": True, "rope_theta": 10000}
    assert config_from_hf({**base, "num_experts": 8}).family == "llada_moe"
    assert config_from_hf({"model_type": "llada", "d_model": 64, "n_layers": 2, "n_heads": 4,
                           "vocab_size": 512}).family == "llada"
