"""What the engine and the samplers need from a model: the contract every family implements.

The engine runs the layers itself (layer-streamed prefill, response-only steps), so a model exposes its parts
rather than only ``forward``: the token embedding, the blocks, the RoPE tables and the output head, and where
its parts sit when it is spread over devices. ``logit_shift`` in the config says whether position i is
predicted from hidden state i (LLaDA) or i - 1 (Dream).

A family gets all of this by subclassing ``models.base.DiffusionModel`` and ``DiffusionBlock`` and supplying
their hooks (``docs/models.md``); these Protocols list what the engine actually calls, so a family written to
them runs in every path (plain forward, prefill, response steps, layer importance, the limit line).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from maskkv_cli.models.base import Rope
from maskkv_cli.models.config import ModelConfig


@runtime_checkable
class Block(Protocol):
    """One layer as the engine drives it. Shapes: x (B, T, d); q (B, H, T, D); k, v (B, H_kv, T, D). The layer
    states its own geometry (a family's layers may differ): the engine reads it here, never from the config."""

    n_heads: int  # H
    n_kv_heads: int  # H_kv
    head_dim: int  # D

    @property
    def attention_scale(self) -> float: ...  # the softmax scale of its attention logits

    @property
    def group_size(self) -> int: ...  # H // H_kv

    def queries(self, x: Tensor, rope: Rope) -> Tensor: ...  # rotated q of x's T rows (rope: their tables)

    def keys(self, x: Tensor, rope: Rope) -> Tensor: ...  # rotated k

    def values(self, x: Tensor) -> Tensor: ...  # v

    def qkv(self, x: Tensor, rope: Rope) -> tuple[Tensor, Tensor, Tensor]: ...  # the three, as above

    def attn_proj(self, o: Tensor) -> Tensor: ...  # attention output (B, H, T, D) -> (B, T, d)

    def mlp(self, x: Tensor, chunk: int | None = None) -> Tensor: ...  # MLP sub-layer (its norm included)

    def __call__(self, x: Tensor, rope: Rope, key_mask: Tensor | None = None, mlp_chunk: int | None = None,
                 on_attention: Callable[[Tensor, Tensor], None] | None = None) -> Tensor: ...  # a dense layer


@runtime_checkable
class DiffusionLM(Protocol):
    """A diffusion language model the engine can drive (every family of ``models/families.py``)."""

    config: ModelConfig
    layer_devices: list[torch.device] | None  # each layer's device under a device map, else None

    @property
    def blocks(self) -> nn.ModuleList: ...  # of ``Block``

    @property
    def device(self) -> torch.device: ...  # where the embedding (the input) lives

    @property
    def dtype(self) -> torch.dtype: ...

    def embed(self, ids: Tensor) -> Tensor: ...  # (B, T) -> (B, T, d)

    def head(self, x: Tensor) -> Tensor: ...  # final norm and output projection: (B, T, d) -> (B, T, V)

    def rope(self, positions: Tensor, factor: float = 1.0) -> Rope: ...  # cos, sin tables (RoPE base x factor)

    def rope_kind(self, layer: int) -> object: ...  # layers of one kind rotate with the same tables

    def layer_rope(self, layer: int, positions: Tensor, factor: float = 1.0) -> Rope: ...  # that layer's tables

    def place_ends(self, first: torch.device, last: torch.device) -> None: ...  # embedding; norm and head

    def __call__(self, ids: Tensor) -> Tensor: ...  # plain forward: logits (B, T, V), shifted when logit_shift

    def checkpoint_key(self, name: str) -> str: ...  # parameter name -> upstream checkpoint key

    def parameter_name(self, key: str) -> str: ...  # upstream checkpoint key -> parameter name
