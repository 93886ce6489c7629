"""LLaDA: a bidirectional (no causal mask) Llama-style transformer predicting masked tokens.

Parameter names follow the upstream checkpoint under the prefix ``model.`` (see ``loading.py``):
``transformer.wte``, ``transformer.blocks.{i}.{attn_norm,q_proj,k_proj,v_proj,attn_out,ff_norm,ff_proj,
up_proj,ff_out}``, ``transformer.ln_f``, ``transformer.ff_out`` (LM head, not tied).
The blocks expose their parts (``qkv``, ``mlp``) so the cache engine can run a layer piece by piece.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from maskkv_cli.models.config import ModelConfig


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, cast back to the input dtype, then scaled."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.to(x.dtype) * self.weight


def rope_tables(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """fp32 cos/sin tables (T, head_dim) in the half-split layout for integer ``positions`` (T,)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # (T, D/2)
    angles = torch.cat((freqs, freqs), dim=-1)  # (T, D)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` (B, H, T, D) in fp32 with the ``rotate_half`` convention; returns x's dtype."""
    x32 = x.float()
    half = x32.shape[-1] // 2
    rotated = torch.cat((-x32[..., half:], x32[..., :half]), dim=-1)
    return (x32 * cos + rotated * sin).to(x.dtype)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, h = cfg.d_model, cfg.mlp_hidden_size
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.head_dim
        self.attn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.ff_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.attn_out = nn.Linear(d, d, bias=False)
        self.ff_proj = nn.Linear(d, h, bias=False)  # gate
        self.up_proj = nn.Linear(d, h, bias=False)
        self.ff_out = nn.Linear(h, d, bias=False)  # down

    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Rotated q, k and plain v, each (B, H, T, D), from the hidden state x (B, T, d)."""
        b, t, _ = x.shape
        n = self.attn_norm(x)
        q = self.q_proj(n).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(n).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(n).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    # The prefill computes q, k and v separately (and q a chunk of rows at a time) to bound its memory; each is
    # the same per-row computation as in ``qkv``.
    def queries(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Rotated q (B, H, T, D) of x (B, T, d)."""
        b, t, _ = x.shape
        return apply_rope(self.q_proj(self.attn_norm(x)).view(b, t, self.n_heads, self.head_dim).transpose(1, 2),
                          cos, sin)

    def keys(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Rotated k (B, H, T, D) of x (B, T, d)."""
        b, t, _ = x.shape
        return apply_rope(self.k_proj(self.attn_norm(x)).view(b, t, self.n_heads, self.head_dim).transpose(1, 2),
                          cos, sin)

    def values(self, x: Tensor) -> Tensor:
        """v (B, H, T, D) of x (B, T, d)."""
        b, t, _ = x.shape
        return self.v_proj(self.attn_norm(x)).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)

    def attn_proj(self, o: Tensor) -> Tensor:
        """Output projection of attention o (B, H, T, D) -> (B, T, d)."""
        b, _, t, _ = o.shape
        return self.attn_out(o.transpose(1, 2).reshape(b, t, -1))

    def mlp(self, x: Tensor, chunk: int | None = None) -> Tensor:
        """Gated SiLU MLP of ff_norm(x); with ``chunk`` the sequence is processed in slices of that length."""
        if chunk is None or x.shape[1] <= chunk:
            n = self.ff_norm(x)
            return self.ff_out(F.silu(self.ff_proj(n)) * self.up_proj(n))
        return torch.cat([self.mlp(x[:, i : i + chunk]) for i in range(0, x.shape[1], chunk)], dim=1)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, key_mask: Tensor | None = None) -> Tensor:
        """``key_mask`` (B, 1, 1, T) bool, True = may be attended (padding in training batches)."""
        q, k, v = self.qkv(x, cos, sin)
        h = x + self.attn_proj(F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask))
        return h + self.mlp(h)


class LLaDA(nn.Module):
    """The model: ``model(ids (B, T)) -> logits (B, T, vocab)``; position i predicts token i."""

    @staticmethod
    def checkpoint_key(name: str) -> str:
        """Upstream keys are ``model.`` + our parameter names."""
        return "model." + name

    @staticmethod
    def parameter_name(key: str) -> str:
        return key.removeprefix("model.")

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(cfg.embedding_size, cfg.d_model),
                "blocks": nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers)),
                "ln_f": RMSNorm(cfg.d_model, cfg.rms_norm_eps),
                "ff_out": nn.Linear(cfg.d_model, cfg.embedding_size, bias=False),
            }
        )

    # Small accessors keep call sites readable and typed.
    @property
    def blocks(self) -> nn.ModuleList:
        return self.transformer["blocks"]  # type: ignore[return-value]

    def embed(self, ids: Tensor) -> Tensor:
        return self.transformer["wte"](ids)

    def head(self, x: Tensor) -> Tensor:
        """Final norm and LM head; logits are cut to ``vocab_size`` (the embedding may be padded)."""
        logits = self.transformer["ff_out"](self.transformer["ln_f"](x))
        return logits[..., : self.config.vocab_size]

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        return rope_tables(positions, self.config.head_dim, self.config.rope_theta)

    def place_ends(self, first: torch.device, last: torch.device) -> None:
        """Embedding on ``first``, final norm and LM head on ``last`` (see ``models/placement.py``)."""
        self.transformer["wte"].to(first)
        self.transformer["ln_f"].to(last)
        self.transformer["ff_out"].to(last)

    @property
    def device(self) -> torch.device:
        return self.transformer["wte"].weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer["wte"].weight.dtype

    def forward(self, ids: Tensor, key_mask: Tensor | None = None, rows: Tensor | None = None,
                positions: Tensor | None = None) -> Tensor:
        """Logits (B, T, V); with ``rows`` (B, R) only at those positions; ``key_mask`` (B, T) marks real tokens;
        ``positions`` (T,) are the RoPE positions (default 0..T-1; training may skip some, see ``training.py``)."""
        x = self.embed(ids)  # (B, T, d)
        cos, sin = self.rope(torch.arange(ids.shape[1], device=ids.device) if positions is None else positions)
        mask = None if key_mask is None else key_mask[:, None, None, :]
        for block in self.blocks:
            x = block(x, cos, sin, mask)
        if rows is not None:
            x = torch.gather(x, 1, rows[..., None].expand(-1, -1, x.shape[-1]))
        return self.head(x)  # (B, T or R, V)

    def init_weights(self, seed: int = 0, std: float = 0.02) -> LLaDA:
        init_parameters(self, seed, std)
        return self


def init_parameters(model: nn.Module, seed: int, std: float) -> None:
    """Random normal weights (norm weights at one, biases at zero), reproducible from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("ln_f.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype) * std)
