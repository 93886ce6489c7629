"""Dream: a bidirectional Qwen2.5-style transformer (GQA, q/k/v biases) whose logits are shifted.

Parameter names follow the upstream checkpoint exactly: ``model.embed_tokens``, ``model.layers.{i}.self_attn.
{q,k,v,o}_proj``, ``model.layers.{i}.mlp.{gate,up,down}_proj``, ``model.layers.{i}.{input,post_attention}_layernorm``,
``model.norm``, ``lm_head``. Blocks expose the same parts as LLaDA's (``qkv``, ``attn_proj``, ``mlp``) so the cache
engine drives both families; keys and values have ``n_kv_heads`` heads (never repeated in the cache).
Position i is predicted from hidden state i - 1 (``config.logit_shift == 1``); the first position keeps its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from maskkv_cli.models.config import ModelConfig
from maskkv_cli.models.llada import RMSNorm, apply_rope, init_parameters, rope_tables


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE as upstream Dream (Qwen2) applies it: in fp32 (``apply_rope``) for fp32 activations; in half
    precision the fp32 cos/sin tables are cast to the activation dtype and the rotation runs in that dtype, so
    bf16/fp16 logits match what Dream's own code gives."""
    if x.dtype == torch.float32:
        return apply_rope(x, cos, sin)
    c, s = cos.to(x.dtype), sin.to(x.dtype)
    half = x.shape[-1] // 2
    return x * c + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * s


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hd, kv = cfg.head_dim, cfg.n_kv_heads
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * hd, bias=True)
        self.k_proj = nn.Linear(cfg.d_model, kv * hd, bias=True)  # type: ignore[operator]
        self.v_proj = nn.Linear(cfg.d_model, kv * hd, bias=True)  # type: ignore[operator]
        self.o_proj = nn.Linear(cfg.n_heads * hd, cfg.d_model, bias=False)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.mlp_hidden_size, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.mlp_hidden_size, bias=False)
        self.down_proj = nn.Linear(cfg.mlp_hidden_size, cfg.d_model, bias=False)


class DreamBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.self_attn = Attention(cfg)
        self.mlp_layers = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.rms_norm_eps)

    # Upstream calls the MLP module ``mlp``; here ``mlp`` is the method the engine calls, so the module is
    # ``mlp_layers`` and ``Dream.checkpoint_key`` maps the names.
    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q (B, H, T, D) and k, v (B, H_kv, T, D), q and k rotated."""
        b, t, _ = x.shape
        n = self.input_layernorm(x)
        a = self.self_attn
        q = a.q_proj(n).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = a.k_proj(n).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = a.v_proj(n).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    # Separate q, k and v for the prefill (see LLaDA's ``Block.queries``): the same per-row computation as ``qkv``.
    def queries(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, t, _ = x.shape
        q = self.self_attn.q_proj(self.input_layernorm(x)).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin)

    def keys(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, t, _ = x.shape
        k = self.self_attn.k_proj(self.input_layernorm(x)).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin)

    def values(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        return self.self_attn.v_proj(self.input_layernorm(x)).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)

    def attn_proj(self, o: Tensor) -> Tensor:
        b, _, t, _ = o.shape
        return self.self_attn.o_proj(o.transpose(1, 2).reshape(b, t, -1))

    def mlp(self, x: Tensor, chunk: int | None = None) -> Tensor:
        if chunk is None or x.shape[1] <= chunk:
            n = self.post_attention_layernorm(x)
            m = self.mlp_layers
            return m.down_proj(F.silu(m.gate_proj(n)) * m.up_proj(n))
        return torch.cat([self.mlp(x[:, i : i + chunk]) for i in range(0, x.shape[1], chunk)], dim=1)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, key_mask: Tensor | None = None) -> Tensor:
        q, k, v = self.qkv(x, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, enable_gqa=self.n_heads != self.n_kv_heads)
        h = x + self.attn_proj(o)
        return h + self.mlp(h)


class Dream(nn.Module):
    """``model(ids (B, T)) -> logits (B, T, vocab)``, already shifted (position i predicted from i - 1)."""

    @staticmethod
    def checkpoint_key(name: str) -> str:
        """Checkpoint key of a parameter: the names match upstream except ``mlp`` (a method here)."""
        return name.replace(".mlp_layers.", ".mlp.")

    @staticmethod
    def parameter_name(key: str) -> str:
        return key.replace(".mlp.", ".mlp_layers.")

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = nn.ModuleDict({
            "embed_tokens": nn.Embedding(cfg.vocab_size, cfg.d_model),
            "layers": nn.ModuleList(DreamBlock(cfg) for _ in range(cfg.n_layers)),
            "norm": RMSNorm(cfg.d_model, cfg.rms_norm_eps),
        })
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    @property
    def blocks(self) -> nn.ModuleList:
        return self.model["layers"]  # type: ignore[return-value]

    def embed(self, ids: Tensor) -> Tensor:
        return self.model["embed_tokens"](ids)

    def head(self, x: Tensor) -> Tensor:
        """Norm and LM head of hidden states (no shift: callers pick hidden state i - 1 for position i)."""
        return self.lm_head(self.model["norm"](x))

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        return rope_tables(positions, self.config.head_dim, self.config.rope_theta)

    def place_ends(self, first: torch.device, last: torch.device) -> None:
        self.model["embed_tokens"].to(first)
        self.model["norm"].to(last)
        self.lm_head.to(last)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def forward(self, ids: Tensor, key_mask: Tensor | None = None, rows: Tensor | None = None) -> Tensor:
        """Shifted logits (B, T, V); with ``rows`` (B, R) only at those positions."""
        x = self.embed(ids)
        cos, sin = self.rope(torch.arange(ids.shape[1], device=ids.device))
        mask = None if key_mask is None else key_mask[:, None, None, :]
        for block in self.blocks:
            x = block(x, cos, sin, mask)
        src = (torch.arange(ids.shape[1], device=ids.device) - 1).clamp(min=0)  # hidden state feeding position i
        if rows is not None:
            idx = src[rows]
            return self.head(torch.gather(x, 1, idx[..., None].expand(-1, -1, x.shape[-1])))
        return self.head(x[:, src])

    def init_weights(self, seed: int = 0, std: float = 0.02) -> Dream:
        init_parameters(self, seed, std)
        return self
