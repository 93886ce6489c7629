"""LLaDA2.x (``model_type: llada2_moe``): block diffusion with a mixture of experts.

A Ling-style transformer: fused q/k/v projection (rows: the query heads, then the key heads, then the value
heads), RMSNorm over each head of q and k before RoPE, RoPE on the first half of each head's dims (half-split,
``partial_rotary_factor``), grouped-query attention, the first ``first_k_dense_replace`` layers with a dense
SwiGLU MLP and the others with a mixture of experts (``models/moe.py``: sigmoid router with group-limited
top-k, a shared expert). Attention is block-causal when generating (a block sees itself and every earlier
block; ``ModelConfig.attention``); the plain ``forward`` without a mask is bidirectional, as upstream.
Logits are not shifted.

Parameter names follow the upstream checkpoint (``model.word_embeddings``, ``model.layers.{i}.attention.
{query_key_value,query_layernorm,key_layernorm,dense}``, ``model.layers.{i}.mlp.{gate,experts.{e},
shared_experts}``, ``model.norm``, ``lm_head``) except that each layer's MLP module is ``mlp_layers`` here
(``mlp`` is the method the engine calls); ``checkpoint_key`` maps the names.
"""

from __future__ import annotations

from torch import Tensor, nn

from maskkv_cli.models.base import HFLayoutBlock, HFLayoutModel, RMSNorm, Rope, rotate_in_dtype
from maskkv_cli.models.config import ModelConfig
from maskkv_cli.models.moe import feed_forward_module
from maskkv_cli.models.rows import Linear


class LLaDA2Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hd, heads = cfg.head_dim, cfg.n_heads + 2 * cfg.n_kv_heads  # type: ignore[operator]
        self.query_key_value = Linear(cfg.d_model, heads * hd, bias=False)
        self.query_key_value.splits = (cfg.n_heads * hd, (cfg.n_heads + cfg.n_kv_heads) * hd)  # type: ignore[operator]
        if cfg.qk_norm:
            self.query_layernorm = RMSNorm(hd, cfg.rms_norm_eps)
            self.key_layernorm = RMSNorm(hd, cfg.rms_norm_eps)
        self.dense = Linear(cfg.n_heads * hd, cfg.d_model, bias=False)


class LLaDA2Block(HFLayoutBlock):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__(cfg)
        self.rotary_dim = cfg.rotary_dim
        self.qk_norm = cfg.qk_norm
        self.attention = LLaDA2Attention(cfg)
        self.mlp_layers = feed_forward_module(cfg, layer)
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.rms_norm_eps)

    def _rows(self, n: Tensor, first: int, count: int) -> Tensor:
        """Heads ``first .. first + count`` of the fused projection (only those rows of its weight are used), as a
        product that keeps the row floor (``Linear.output_rows``)."""
        projection = self.attention.query_key_value
        return self.heads(projection.output_rows(n, first * self.head_dim, (first + count) * self.head_dim), count)

    def q_heads(self, n: Tensor) -> Tensor:
        q = self._rows(n, 0, self.n_heads)
        return self.attention.query_layernorm(q) if self.qk_norm else q

    def k_heads(self, n: Tensor) -> Tensor:
        k = self._rows(n, self.n_heads, self.n_kv_heads)
        return self.attention.key_layernorm(k) if self.qk_norm else k

    def v_heads(self, n: Tensor) -> Tensor:
        return self._rows(n, self.n_heads + self.n_kv_heads, self.n_kv_heads)

    def rotate(self, t: Tensor, rope: Rope) -> Tensor:
        return rotate_in_dtype(t, rope, self.rotary_dim)

    def attn_proj(self, o: Tensor) -> Tensor:
        return self.attention.dense(self.merge_heads(o))


class LLaDA2(HFLayoutModel):
    """``model(ids (B, T)) -> logits (B, T, vocab)``; position i predicts token i."""

    embedding_name = "word_embeddings"
    optional_keys = (".mlp.gate.expert_bias",)  # zeros when a checkpoint leaves the router's bias out

    @staticmethod
    def checkpoint_key(name: str) -> str:
        return name.replace(".mlp_layers.", ".mlp.")

    @staticmethod
    def parameter_name(key: str) -> str:
        return key.replace(".mlp.", ".mlp_layers.")

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, (LLaDA2Block(cfg, i) for i in range(cfg.n_layers)))

    def head(self, x: Tensor) -> Tensor:
        """Final norm and LM head, logits in fp32 (as upstream returns them)."""
        return super().head(x).float()
