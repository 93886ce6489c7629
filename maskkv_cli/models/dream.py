"""Dream: a bidirectional Qwen2.5-style transformer (GQA, q/k/v biases) whose logits are shifted.

Parameter names follow the upstream checkpoint exactly: ``model.embed_tokens``, ``model.layers.{i}.self_attn.
{q,k,v,o}_proj``, ``model.layers.{i}.mlp.{gate,up,down}_proj``, ``model.layers.{i}.{input,post_attention}_layernorm``,
``model.norm``, ``lm_head``. The block supplies the hooks of ``models.base.DiffusionBlock`` like LLaDA's; keys and
values have ``n_kv_heads`` heads (never repeated in the cache).
Position i is predicted from hidden state i - 1 (``config.logit_shift == 1``); the first position keeps its own.
"""

from __future__ import annotations

from torch import Tensor, nn

from maskkv_cli.models.base import HFLayoutBlock, HFLayoutModel, RMSNorm, Rope, SwiGLU, rotate_in_dtype
from maskkv_cli.models.config import ModelConfig
from maskkv_cli.models.rows import Linear


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hd, kv = cfg.head_dim, cfg.n_kv_heads
        self.q_proj = Linear(cfg.d_model, cfg.n_heads * hd, bias=True)
        self.k_proj = Linear(cfg.d_model, kv * hd, bias=True)  # type: ignore[operator]
        self.v_proj = Linear(cfg.d_model, kv * hd, bias=True)  # type: ignore[operator]
        self.o_proj = Linear(cfg.n_heads * hd, cfg.d_model, bias=False)


class DreamBlock(HFLayoutBlock):
    """Dream's layer: RMSNorm, q/k/v projections with biases and ``n_kv_heads`` key/value heads, Qwen2's RoPE
    (``rotate``), a gated SiLU MLP."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.self_attn = Attention(cfg)
        self.mlp_layers = SwiGLU(cfg.d_model, cfg.mlp_hidden_size)
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.rms_norm_eps)

    def q_heads(self, n: Tensor) -> Tensor:
        return self.heads(self.self_attn.q_proj(n), self.n_heads)

    def k_heads(self, n: Tensor) -> Tensor:
        return self.heads(self.self_attn.k_proj(n), self.n_kv_heads)

    def v_heads(self, n: Tensor) -> Tensor:
        return self.heads(self.self_attn.v_proj(n), self.n_kv_heads)

    def rotate(self, t: Tensor, rope: Rope) -> Tensor:
        return rotate_in_dtype(t, rope)  # as upstream Dream (Qwen2): bf16/fp16 logits match Dream's own code

    def attn_proj(self, o: Tensor) -> Tensor:
        return self.self_attn.o_proj(self.merge_heads(o))


class Dream(HFLayoutModel):
    """``model(ids (B, T)) -> logits (B, T, vocab)``, already shifted (position i predicted from i - 1)."""

    @staticmethod
    def checkpoint_key(name: str) -> str:
        """Checkpoint key of a parameter: the names match upstream except ``mlp`` (a method here)."""
        return name.replace(".mlp_layers.", ".mlp.")

    @staticmethod
    def parameter_name(key: str) -> str:
        return key.replace(".mlp.", ".mlp_layers.")

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, (DreamBlock(cfg) for _ in range(cfg.n_layers)))
