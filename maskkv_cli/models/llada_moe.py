"""LLaDA-MoE (``model_type: llada`` with experts, e.g. LLaDA-MoE-7B-A1B): a bidirectional mixture-of-experts model.

OLMoE-style layers: separate q/k/v projections (biases and the output projection's bias when
``attention_bias``), RMSNorm over each head of q and k before RoPE, q/k/v optionally clamped (``clip_qkv``),
RoPE on the first ``partial_rotary_factor`` of each head's dims, attention over the whole sequence (as
LLaDA-8B: the same engine path), a dense SwiGLU or a mixture of experts per layer (``moe_layer_freq``; softmax
router, ``models/moe.py``) and, on the MoE layers, an unweighted shared expert. Logits are not shifted.

Parameter names follow the upstream checkpoint (``model.embed_tokens``, ``model.layers.{i}.self_attn.{q,k,v,o}
_proj``, ``.q_norm``, ``.k_norm``, ``model.layers.{i}.mlp.{gate,experts.{e},expert_bias}``,
``model.layers.{i}.shared_expert``, ``model.norm``, ``lm_head``); here a layer's MLP, its router's bias and its
shared expert all live in ``mlp_layers`` (``checkpoint_key`` maps the names).
"""

from __future__ import annotations

from torch import Tensor, nn

from maskkv_cli.models.base import HFLayoutBlock, HFLayoutModel, RMSNorm, Rope, rotate_in_dtype
from maskkv_cli.models.config import ModelConfig
from maskkv_cli.models.moe import feed_forward_module
from maskkv_cli.models.rows import Linear

# (our parameter name part, the checkpoint's), applied in this order
_RENAMES = ((".mlp_layers.gate.expert_bias", ".mlp.expert_bias"), (".mlp_layers.shared_experts.", ".shared_expert."),
            (".mlp_layers.", ".mlp."))


class MoEAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hd, kv, bias = cfg.head_dim, cfg.n_kv_heads, cfg.attention_bias
        self.q_proj = Linear(cfg.d_model, cfg.n_heads * hd, bias=bias)
        self.k_proj = Linear(cfg.d_model, kv * hd, bias=bias)  # type: ignore[operator]
        self.v_proj = Linear(cfg.d_model, kv * hd, bias=bias)  # type: ignore[operator]
        self.o_proj = Linear(cfg.n_heads * hd, cfg.d_model, bias=bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)


class LLaDAMoEBlock(HFLayoutBlock):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__(cfg)
        self.rotary_dim, self.qk_norm, self.clip = cfg.rotary_dim, cfg.qk_norm, cfg.clip_qkv
        self.self_attn = MoEAttention(cfg)
        self.mlp_layers = feed_forward_module(cfg, layer)
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.rms_norm_eps)

    def _clip(self, t: Tensor) -> Tensor:
        return t if self.clip is None else t.clamp(-self.clip, self.clip)

    def q_heads(self, n: Tensor) -> Tensor:
        q = self.heads(self.self_attn.q_proj(n), self.n_heads)
        return self._clip(self.self_attn.q_norm(q) if self.qk_norm else q)

    def k_heads(self, n: Tensor) -> Tensor:
        k = self.heads(self.self_attn.k_proj(n), self.n_kv_heads)
        return self._clip(self.self_attn.k_norm(k) if self.qk_norm else k)

    def v_heads(self, n: Tensor) -> Tensor:
        return self._clip(self.heads(self.self_attn.v_proj(n), self.n_kv_heads))

    def rotate(self, t: Tensor, rope: Rope) -> Tensor:
        return rotate_in_dtype(t, rope, self.rotary_dim)

    def attn_proj(self, o: Tensor) -> Tensor:
        return self.self_attn.o_proj(self.merge_heads(o))


class LLaDAMoE(HFLayoutModel):
    """``model(ids (B, T)) -> logits (B, T, vocab)``; position i predicts token i."""

    @staticmethod
    def checkpoint_key(name: str) -> str:
        for ours, theirs in _RENAMES:
            name = name.replace(ours, theirs)
        return name

    @staticmethod
    def parameter_name(key: str) -> str:
        for ours, theirs in _RENAMES:
            key = key.replace(theirs, ours)
        return key

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, (LLaDAMoEBlock(cfg, i) for i in range(cfg.n_layers)))
