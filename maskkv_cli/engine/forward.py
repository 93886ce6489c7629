"""Forward passes used by the sampler.

- ``plain_logits``: the whole sequence, every step (cache mode ``none``).
- ``prefill``: step 0 over ``[prompt ; masks]``, layer by layer: exact attention (SDPA), then the policy's
  selection for that layer, then only the kept prompt K/V are stored before the next layer runs.
- ``response_logits``: later steps, the response only, attending to ``[kept prompt K/V ; response K/V]``.
The LM head runs only on the rows the sampler asks for (masked positions of the current block).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from maskkv_cli.engine.cache import LayerCache, PromptCache, dense_layer, select_layer
from maskkv_cli.models.llada import LLaDA
from maskkv_cli.policies.base import LayerView, Policy

MLP_CHUNK = 2048  # rows of the MLP computed at once in the prefill


@dataclass
class LayerRecord:
    """What the policy decided in one layer (CPU tensors), for reports and plots."""

    layer: int
    layer_budget: int
    head_budgets: Tensor  # (B, H) kept prompt entries per head
    preference: Tensor | None  # (B, H) P_h when computed
    positions: Tensor | None  # (B, H, K) kept prompt positions, padded with the last kept one; None = all


def plain_logits(model: LLaDA, ids: Tensor, rows: Tensor) -> Tensor:
    """Full bidirectional forward over ids (B, T); logits (B, len(rows), V) at sequence positions ``rows``."""
    x = model.embed(ids)
    cos, sin = model.rope(torch.arange(ids.shape[1], device=ids.device))
    for block in model.blocks:
        x = block(x, cos, sin)
    return model.head(x[:, rows])


def prefill(
    model: LLaDA,
    ids: Tensor,
    prompt_len: int,
    policy: Policy,
    layer_budgets: list[int] | None,
    rows: Tensor,
    mlp_chunk: int = MLP_CHUNK,
) -> tuple[Tensor, PromptCache, list[LayerRecord]]:
    """Step 0 with eviction. ``layer_budgets`` None keeps every prompt entry (the full prefix cache).

    Returns logits at sequence positions ``rows``, the compressed cache and one record per layer.
    """
    t = ids.shape[1]
    response_len = t - prompt_len
    cache = PromptCache(prompt_len, response_len)
    records: list[LayerRecord] = []
    x = model.embed(ids)  # (B, T, d)
    cos, sin = model.rope(torch.arange(t, device=ids.device))
    scale = 1.0 / math.sqrt(model.config.head_dim)
    n_layers = len(model.blocks)
    for i, block in enumerate(model.blocks):
        q, k, v = block.qkv(x, cos, sin)  # (B, H, T, D) each
        o = F.scaled_dot_product_attention(q, k, v)
        if layer_budgets is None:
            layer = dense_layer(k, v, prompt_len, response_len)
            records.append(LayerRecord(i, prompt_len, layer.lengths.cpu(), None, None))
        else:
            view = LayerView(i, n_layers, q, k, prompt_len, scale)
            budget = layer_budgets[i]
            scores = policy.scores(view, budget)  # (B, H, M)
            heads = policy.head_budgets(view, budget, scores)  # (B, H)
            layer = select_layer(k, v, scores, heads, prompt_len, response_len)
            pref = policy.preference(view)
            records.append(LayerRecord(i, budget, layer.lengths.cpu(), None if pref is None else pref.cpu(),
                                       layer.positions.cpu() if layer.positions is not None else None))
            del view, scores
        cache.layers.append(layer)
        del q, k, v
        x = x + block.attn_proj(o)
        del o
        x = x + block.mlp(x, mlp_chunk)
    return model.head(x[:, rows]), cache, records


def response_logits(model: LLaDA, cache: PromptCache, response: Tensor, rows: Tensor) -> Tensor:
    """One denoising step over the response only (B, L); logits (B, len(rows), V) at response rows."""
    m = cache.prompt_len
    x = model.embed(response)  # (B, L, d)
    cos, sin = model.rope(torch.arange(m, m + response.shape[1], device=response.device))
    last = len(model.blocks) - 1
    for i, block in enumerate(model.blocks):
        layer: LayerCache = cache.layers[i]
        q, k, v = block.qkv(x, cos, sin)  # (B, H, L, D)
        layer.write_response(k, v)
        if i == last:  # only the rows whose logits are needed go on
            q, x = q[:, :, rows], x[:, rows]
        o = F.scaled_dot_product_attention(q, layer.k, layer.v, attn_mask=layer.bias)
        x = x + block.attn_proj(o)
        x = x + block.mlp(x)
    return model.head(x)
