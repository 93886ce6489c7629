"""LLaDA: a bidirectional (no causal mask) Llama-style transformer predicting masked tokens.

Parameter names follow the upstream checkpoint under the prefix ``model.`` (see ``loading.py``):
``transformer.wte``, ``transformer.blocks.{i}.{attn_norm,q_proj,k_proj,v_proj,attn_out,ff_norm,ff_proj,
up_proj,ff_out}``, ``transformer.ln_f``, ``transformer.ff_out`` (LM head, not tied).
The block supplies the hooks of ``models.base.DiffusionBlock`` (norm, projections, fp32 RoPE, gated SiLU MLP);
the base builds on them what the engine calls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from maskkv_cli.models.base import DiffusionBlock, DiffusionModel, RMSNorm, Rope, apply_rope
from maskkv_cli.models.config import ModelConfig
from maskkv_cli.models.rows import Linear


class Block(DiffusionBlock):
    """LLaDA's layer: RMSNorm, q/k/v projections (as many key/value heads as query heads), RoPE in fp32, a gated
    SiLU MLP."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        d, h = cfg.d_model, cfg.mlp_hidden_size
        self.attn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.ff_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.q_proj = Linear(d, d, bias=False)
        self.k_proj = Linear(d, d, bias=False)
        self.v_proj = Linear(d, d, bias=False)
        self.attn_out = Linear(d, d, bias=False)
        self.ff_proj = Linear(d, h, bias=False)  # gate
        self.up_proj = Linear(d, h, bias=False)
        self.ff_out = Linear(h, d, bias=False)  # down

    def attention_input(self, x: Tensor) -> Tensor:
        return self.attn_norm(x)

    def q_heads(self, n: Tensor) -> Tensor:
        return self.heads(self.q_proj(n), self.n_heads)

    def k_heads(self, n: Tensor) -> Tensor:
        return self.heads(self.k_proj(n), self.n_kv_heads)

    def v_heads(self, n: Tensor) -> Tensor:
        return self.heads(self.v_proj(n), self.n_kv_heads)

    def rotate(self, t: Tensor, rope: Rope) -> Tensor:
        return apply_rope(t, rope)  # upstream LLaDA rotates in full precision in every dtype

    def attn_proj(self, o: Tensor) -> Tensor:
        return self.attn_out(self.merge_heads(o))

    def feed_forward(self, x: Tensor) -> Tensor:
        n = self.ff_norm(x)
        return self.ff_out(F.silu(self.ff_proj(n)) * self.up_proj(n))


class LLaDA(DiffusionModel):
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
                "ff_out": Linear(cfg.d_model, cfg.embedding_size, bias=False),
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
