"""One denoising step of several independent sequences in one forward.

Each sequence (a *lane*) has its own prompt length, its own compressed cache (its own per-head budgets and kept
entries) and its own rows whose logits its sampler needs. Everything that carries weights runs over all lanes'
rows at once: the embedding, the q/k/v and output projections, the MLP and the LM head, so each weight is read
once per step for the whole batch. Attention runs lane by lane over that lane's own cache, exactly as the lane
would run alone: no padding, so nothing of another sequence can reach it and its softmax reduces over the same
entries in the same order as alone. What a lane sees of the batch is only the number of rows in the matrix
products (see docs/performance.md, "Many sequences in one forward", for which kernels keep that bit-exact).

``response_logits_many`` is the cached step (``engine.forward.response_logits`` for many caches);
``plain_logits_many`` the no-cache step over sequences of one length. The prefill (step 0) of each lane runs
alone (``sampling/batched.py``): its rows already fill the matrix products, and alone it needs no padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from maskkv_cli.kv.cache import PromptCache
from maskkv_cli.models.base import Rope, attention, dense_hidden, on_layer_device
from maskkv_cli.models.protocol import DiffusionLM


@dataclass(frozen=True)
class CachedLane:
    """One sequence's step: its cache, its response-only input (b, L) and the rows (n,) whose logits it needs."""

    cache: PromptCache
    response: Tensor
    rows: Tensor


def _bounds(sizes: Sequence[int]) -> list[tuple[int, int]]:
    out, start = [], 0
    for size in sizes:
        out.append((start, start + size))
        start += size
    return out


def _lane_rope(model: DiffusionLM, lanes: Sequence[CachedLane], length: int) -> Rope:
    """RoPE tables (B, 1, L, D) of every lane's rows at that lane's own positions. Each lane's tables are computed
    as its step alone computes them (same positions, same call), so its rotations are the same numbers."""
    cos, sin = [], []
    for lane in lanes:
        start = lane.cache.prompt_len
        rope = model.rope(torch.arange(start, start + length, device=lane.response.device))
        cos += [rope.cos] * lane.response.shape[0]
        sin += [rope.sin] * lane.response.shape[0]
    return Rope(torch.stack(cos)[:, None], torch.stack(sin)[:, None])


def _flat(t: Tensor) -> Tensor:
    """(b, n, ...) -> (1, b * n, ...): a lane's rows as one run of tokens (for row-wise layers)."""
    return t.reshape(1, t.shape[0] * t.shape[1], *t.shape[2:])


def _flat_heads(o: Tensor) -> Tensor:
    """(b, H, n, D) -> (1, H, b * n, D): a lane's attention output as one run of tokens."""
    b, h, n, d = o.shape
    return o.transpose(0, 1).reshape(1, h, b * n, d)


def response_logits_many(model: DiffusionLM, lanes: Sequence[CachedLane]) -> list[Tensor]:
    """One step over every lane's response (all of the same length L): each lane's logits (b, n, V) at its rows,
    as ``response_logits`` alone would give them. Each lane's response keys and values go into its own cache."""
    length = lanes[0].response.shape[1]
    if any(lane.response.shape[1] != length for lane in lanes):
        raise ValueError("lanes stepped together need responses of one length")
    bounds = _bounds([lane.response.shape[0] for lane in lanes])
    x = model.embed(torch.cat([lane.response for lane in lanes]))  # (B, L, d)
    rope = _lane_rope(model, lanes, length)
    last = len(model.blocks) - 1
    for i, block in enumerate(model.blocks):
        x, rope = on_layer_device(model, i, x, rope)
        q, k, v = block.qkv(x, rope)  # q (B, H, L, D); k, v (B, H_kv, L, D)
        outs = []
        for lane, (a, b) in zip(lanes, bounds, strict=True):
            layer = lane.cache.layers[i]
            layer.write_response(k[a:b], v[a:b])
            q_lane = q[a:b] if i != last else q[a:b][:, :, lane.rows.to(q.device)]
            outs.append(attention(q_lane, layer.k, layer.v, layer.bias))
        del q, k, v
        if i == last:  # only the rows the samplers need go on, every lane's as one run of tokens
            x = torch.cat([_flat(x[a:b][:, lane.rows.to(x.device)]) for lane, (a, b) in zip(lanes, bounds,
                                                                                          strict=True)], 1)
            o = torch.cat([_flat_heads(out) for out in outs], 2)
        else:
            o = torch.cat(outs)
        del outs
        x = x + block.attn_proj(o)
        x = x + block.mlp(x)
    return _split_rows(model.head(x)[0], [(lane.response.shape[0], len(lane.rows)) for lane in lanes])


def _split_rows(logits: Tensor, shapes: Sequence[tuple[int, int]]) -> list[Tensor]:
    """(N, V) logits of every lane's rows in a row -> each lane's (b, n, V)."""
    out, start = [], 0
    for b, n in shapes:
        out.append(logits[start : start + b * n].reshape(b, n, -1))
        start += b * n
    return out


def plain_logits_many(model: DiffusionLM, sequences: Sequence[Tensor], rows: Sequence[Tensor]) -> list[Tensor]:
    """The whole bidirectional forward of several sequences of one length (each (b, T)): each one's logits
    (b, n, V) at its own positions ``rows``."""
    x = dense_hidden(model, torch.cat(list(sequences)))
    bounds = _bounds([s.shape[0] for s in sequences])
    picked = [_flat(x[a:b][:, r.to(x.device)]) for r, (a, b) in zip(rows, bounds, strict=True)]
    return _split_rows(model.head(torch.cat(picked, 1))[0], [(s.shape[0], len(r)) for s, r in zip(sequences, rows,
                                                                                                    strict=True)])
