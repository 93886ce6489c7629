"""Every step after the prefill, for any number of lanes: one forward in which every lane's rows share the weights.

A cached lane (``StepLane.cache``) runs its response rows only: each layer writes their keys and values into the
lane's cache and they attend to what the cache's layer shows them (the kept prompt entries and the response slot
before the rows' end; ``kv/cache.py``); the last layer runs only the rows whose logits the lane needs. A plain lane
(no cache: policy ``none``, every step the whole sequence again) attends to its own rows and runs every row through
every layer, as the model's dense forward does. Lanes of both kinds, any lengths and any offsets step together:
their rows run back to back through the embedding, projections, MLP and head (one product each), and attention runs
lane by lane. One sequence alone is a list of one lane.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from maskkv_cli.engine.lanes import RowTables, StepLane, joined_heads, on_layer, spans
from maskkv_cli.kv.cache import PromptCache
from maskkv_cli.models.base import attention
from maskkv_cli.models.protocol import DiffusionLM


def _heads(t: Tensor, a: int, b: int, batch: int) -> Tensor:
    """Rows [a, b) of every lane's heads (1, H, N, D) as the lane's (batch, H, n, D) (a view)."""
    if batch == 1:
        return t[:, :, a:b]
    part = t[0, :, a:b]
    return part.reshape(part.shape[0], batch, -1, part.shape[-1]).transpose(0, 1)


def step_hidden(model: DiffusionLM, lanes: Sequence[StepLane]) -> list[Tensor]:
    """One step of every lane (see the module doc): each lane's final hidden states (b, len(rows), d) at its rows."""
    heights = [lane.ids.shape[0] for lane in lanes]
    lengths = [lane.ids.shape[1] for lane in lanes]
    bounds = spans([lane.rows_run for lane in lanes])
    ids = torch.cat([lane.ids.reshape(1, -1) for lane in lanes], 1) if len(lanes) > 1 else lanes[0].ids.reshape(1, -1)
    x = model.embed(ids)  # (1, N, d): every lane's rows back to back
    tables = RowTables(model, [(lane.start, lane.start + n) for lane, n in zip(lanes, lengths, strict=True)],
                       [0] * len(lanes), heights, [lane.rope_factor for lane in lanes], ids.device,
                       [lane.tables for lane in lanes])
    rows = [lane.rows.to(ids.device) for lane in lanes]
    last = len(model.blocks) - 1
    for i, block in enumerate(model.blocks):
        moved = on_layer(model, i, x)
        if moved is not x:
            x, rows = moved, [r.to(moved.device) for r in rows]
        q, k, v = block.qkv(x, tables.rows(i, x.device))  # q (1, H, N, D); k, v (1, H_kv, N, D)
        outs, kept = [], []
        for lane, (a, b), h, r in zip(lanes, bounds, heights, rows, strict=True):
            q_lane, k_lane, v_lane = _heads(q, a, b, h), _heads(k, a, b, h), _heads(v, a, b, h)
            x_lane = x[:, a:b]
            if lane.cache is None:  # the plain forward: the rows attend to themselves, every row goes on
                mask = None if lane.visible is None else lane.visible.to(x.device)[None, None]
                outs.append(attention(q_lane, k_lane, v_lane, mask))
                kept.append(x_lane)
                continue
            layer = lane.cache.layers[i]
            layer.write_response(k_lane, v_lane, lane.offset)
            if i == last:  # only the rows whose logits are needed go on
                if len(r) == 0:
                    continue
                q_lane = q_lane[:, :, r]
                x_lane = x_lane.view(h, -1, x.shape[-1])[:, r].reshape(1, -1, x.shape[-1])
            keys, values, bias = layer.visible(lane.offset, lane.ids.shape[1], lane.reach)
            outs.append(attention(q_lane, keys, values, bias))
            kept.append(x_lane)
        del q, k, v
        if not outs:  # no lane needs a row of the last layer (finished blocks: their keys and values are written)
            return [x.new_empty(h, 0, x.shape[-1]) for h in heights]
        if i == last:
            x = torch.cat(kept, 1) if len(kept) != 1 else kept[0]
        o = joined_heads(outs)
        del outs, kept
        x = x + block.attn_proj(o)
        del o
        x = x + block.mlp(x)
    out, start = [], 0
    for lane, h, r in zip(lanes, heights, rows, strict=True):
        if lane.cache is None:  # every row went through: pick its rows now
            n = lane.ids.shape[1]
            out.append(x[:, start : start + h * n].view(h, n, x.shape[-1])[:, r])
            start += h * n
        else:
            out.append(x[:, start : start + h * len(r)].view(h, len(r), x.shape[-1]))
            start += h * len(r)
    return out


def step_logits(model: DiffusionLM, lanes: Sequence[StepLane]) -> list[Tensor]:
    """``step_hidden`` and the LM head over every lane's rows in one product: each lane's logits (b, len(rows), V)."""
    hidden = step_hidden(model, lanes)
    flat = [h.reshape(1, -1, h.shape[-1]) for h in hidden]
    joined = torch.cat(flat, 1) if len(flat) > 1 else flat[0]
    logits = model.head(joined)
    parts = logits.split([h.shape[0] * h.shape[1] for h in hidden], 1)
    return [p.reshape(h.shape[0], h.shape[1], logits.shape[-1]) for p, h in zip(parts, hidden, strict=True)]


def plain_logits(model: DiffusionLM, ids: Tensor, rows: Tensor, visible: Tensor | None = None,
                 rope_factor: float = 1.0) -> Tensor:
    """The dense forward over ids (B, T) (policy ``none``); logits (B, len(rows), V) at sequence positions ``rows``.
    ``visible`` (T, T) bool: which positions each position sees (a block-causal window; None: all)."""
    (logits,) = step_logits(model, [StepLane(ids, rows, 0, visible=visible, rope_factor=rope_factor)])
    return logits


def response_logits(model: DiffusionLM, cache: PromptCache, response: Tensor, rows: Tensor, offset: int = 0,
                    rope_factor: float = 1.0) -> Tensor:
    """One cached step of one sequence: the response rows ``response`` (B, L) at response positions
    [offset, offset + L) of ``cache``; logits (B, len(rows), V) at its rows ``rows``."""
    lane = StepLane(response, rows, cache.prompt_len + offset, cache, offset, rope_factor=rope_factor)
    (logits,) = step_logits(model, [lane])
    return logits
