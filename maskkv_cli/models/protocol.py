"""What the engine and the samplers need from a model: the contract every family implements.

The engine runs the layers itself (layer-streamed prefill, response-only steps), so a model exposes its parts
rather than only ``forward``: the token embedding, the blocks (each with ``qkv``, ``attn_proj`` and ``mlp``),
the RoPE tables and the output head. ``logit_shift`` in the config says whether position i is predicted from
hidden state i (LLaDA) or i - 1 (Dream).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from maskkv_cli.models.config import ModelConfig


@runtime_checkable
class DiffusionLM(Protocol):
    """A masked-diffusion language model the engine can drive (``LLaDA``, ``Dream``)."""

    config: ModelConfig

    @property
    def blocks(self) -> nn.ModuleList: ...  # each: qkv(x, cos, sin), attn_proj(o), mlp(x), forward(x, cos, sin)

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def embed(self, ids: Tensor) -> Tensor: ...  # (B, T) -> (B, T, D)

    def head(self, x: Tensor) -> Tensor: ...  # final norm and output projection: (B, T, D) -> (B, T, V)

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]: ...  # cos, sin for these positions

    def __call__(self, ids: Tensor) -> Tensor: ...  # plain forward: logits (B, T, V), shifted when logit_shift

    def checkpoint_key(self, name: str) -> str: ...  # parameter name -> upstream checkpoint key
