"""One denoising step of several independent sequences in one forward.

Each sequence (a *lane*) has its own prompt length, its own compressed cache (its own per-head budgets and kept
entries) and its own rows whose logits its sampler needs. Everything that carries weights runs over all lanes'
rows at once: the embedding, the q/k/v and output projections, the MLP and the LM head, so each weight is read
once per step for the whole batch. Attention runs lane by lane over that lane's own cache, exactly as the lane
would run alone: no padding, so nothing of another sequence can reach it and its softmax reduces over the same
entries in the same order as alone. What a lane sees of the batch is only the number of rows in the matrix
products. On the CPU a product's rows do not depend on how many there are, except that a product of only a few
rows takes another kernel that rounds differently (oneDNN/MKL fp32 on this project's machines: 1-3 rows;
``small_rows`` asks the platform once per process; 11 with two threads on this project's AVX-512 machines); so
every product a lane would run alone with that few rows (its last rows of a block, a short chunk) runs on its own
here too, with exactly those rows. The LM head is the exception: ``head_logits`` never runs a product of so few
rows, alone or not, so every lane's rows share one head product, the costliest of a step (docs/performance.md,
"Many sequences in one forward").

``prefill_many`` is step 0 of many prompts of any lengths (``engine.forward.prefill``, offline layer budgets):
their tokens run back to back as one sequence through the weights, and each prompt's scoring, selection and
attention run over its own rows only. ``response_logits_many`` is a cached step (``engine.forward.response_logits``
for many caches); ``plain_logits_many`` the no-cache step over sequences of one length.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from maskkv_cli.engine.forward import (
    MLP_CHUNK,
    QUERY_CHUNK,
    LayerRecord,
    OfflineSelection,
    attend_in_chunks,
    head_logits,
    row_fn,
)
from maskkv_cli.kv.cache import PromptCache
from maskkv_cli.models.base import Rope, attention, dense_hidden, on_layer_device
from maskkv_cli.models.protocol import DiffusionLM
from maskkv_cli.models.rows import few_rows
from maskkv_cli.policies.base import LayerView, Policy


def row_spans(bounds: Sequence[tuple[int, int]], chunk: int, few: int) -> list[tuple[int, int]]:
    """The calls that compute rows [0, N) of lanes laid back to back (``bounds``) as each lane alone computes its
    own rows in chunks of ``chunk``: a lane's chunk of more than ``few`` rows may share a call (up to ``chunk``
    rows) with its neighbours', a shorter one is a call of its own."""
    pieces = [(a + c, min(b, a + c + chunk)) for a, b in bounds for c in range(0, b - a, chunk)]
    spans: list[tuple[int, int]] = []
    for start, stop in pieces:
        small = stop - start <= few
        last = spans[-1] if spans else None
        if (not small and last is not None and last[1] == start and last[1] - last[0] > few
                and stop - last[0] <= chunk):
            spans[-1] = (last[0], stop)
        else:
            spans.append((start, stop))
    return spans


def apart(fn: Callable[..., Tensor], pieces: Sequence[Tensor], *also: Sequence[Tensor],
          also_dim: int = 2) -> list[Tensor]:
    """``fn`` (row-wise: rows along dim 1 of its result) of every piece (1, r, ...) as it gives it alone, with the
    matching pieces of ``also`` (rows along ``also_dim``) as further arguments: the pieces of more than
    ``small_rows`` rows in one call, each shorter one in its own."""
    few = few_rows(pieces[0])
    big = [i for i, p in enumerate(pieces) if p.shape[1] > few]
    out: list[Tensor | None] = [None] * len(pieces)
    if big:
        joined = fn(torch.cat([pieces[i] for i in big], 1), *(torch.cat([extra[i] for i in big], also_dim)
                                                               for extra in also))
        start = 0
        for i in big:
            out[i] = joined[:, start : start + pieces[i].shape[1]]
            start += pieces[i].shape[1]
    for i, p in enumerate(pieces):
        if out[i] is None:
            out[i] = fn(p, *(extra[i] for extra in also))
    return out  # type: ignore[return-value]


@dataclass(frozen=True)
class CachedLane:
    """One sequence's step: its cache, its response-only input (b, L) and the rows (n,) whose logits it needs."""

    cache: PromptCache
    response: Tensor
    rows: Tensor


@dataclass(frozen=True)
class PrefillLane:
    """One prompt's step 0: its sequence ``[prompt ; masks]`` (1, T), the cached segment's length, its policy and
    layer budgets (None: keep every entry), and the positions (n,) whose logits it needs."""

    ids: Tensor
    prompt_len: int
    policy: Policy
    layer_budgets: list[int] | None
    rows: Tensor


def prefill_many(model: DiffusionLM, lanes: Sequence[PrefillLane], mlp_chunk: int = MLP_CHUNK,
                 query_chunk: int = QUERY_CHUNK) -> list[tuple[Tensor, PromptCache, list[LayerRecord]]]:
    """Step 0 of every lane as ``engine.forward.prefill`` gives it alone (offline layer budgets, bidirectional):
    each lane's logits (1, n, V) at its rows, its compressed cache and its records. The lanes' tokens run back to
    back as one sequence (1, N, d) through the norms, projections and MLP; keys and values of the layer are computed
    for all of them before any lane's attention updates its rows, then each lane is scored, selected and attended
    over its own keys (no padding, nothing of another lane)."""
    bounds = _bounds([lane.ids.shape[1] for lane in lanes])
    x = model.embed(torch.cat([lane.ids for lane in lanes], 1))  # (1, N, d)
    tables = [model.rope(torch.arange(b - a, device=lane.ids.device)) for lane, (a, b) in zip(lanes, bounds,
                                                                                            strict=True)]
    rope = Rope(torch.cat([t.cos for t in tables]), torch.cat([t.sin for t in tables]))
    sinks = [OfflineSelection(model, lane.policy, lane.layer_budgets, lane.prompt_len,
                              lane.ids.shape[1] - lane.prompt_len) for lane in lanes]
    cfg = model.config
    scale = 1.0 / math.sqrt(cfg.head_dim)
    n_layers = len(model.blocks)
    spans = row_spans(bounds, mlp_chunk, few_rows(x))
    for i, block in enumerate(model.blocks):
        x, rope = on_layer_device(model, i, x, rope)
        keys = [block.keys(x[:, a:b], rope.rows(a, b)) for a, b in spans]  # (1, H_kv, rows, D) per span
        values = [block.values(x[:, a:b]) for a, b in spans]
        for lane, (a, b), sink in zip(lanes, bounds, sinks, strict=True):
            own, x_lane = rope.rows(a, b), x[:, a:b]  # a view: attention writes the lane's rows of x in place
            k, v = _lane_rows(spans, keys, a, b), _lane_rows(spans, values, a, b)
            rows_q = row_fn(block.queries, x_lane, own)
            view = LayerView(i, n_layers, torch.empty((1, cfg.n_heads, b - a, cfg.head_dim), device="meta"), k,
                             lane.prompt_len, scale, compute_q=rows_q)
            scores = None if lane.layer_budgets is None else lane.policy.scores(view, lane.layer_budgets[i])
            needs_q = scores is not None and lane.policy.residual_spread > 0
            sink(view, rows_q(lane.prompt_len, b - a) if needs_q else None, scores, k, v)
            del view, scores
            attend_in_chunks(block, x_lane, k, v, own, query_chunk, False)
            del k, v, rows_q
        del keys, values
        for a, b in spans:  # the MLP as each lane alone runs it (in row chunks), added in place
            x[:, a:b] += block.mlp(x[:, a:b])
    logits = joined_head(model, [x[:, a + lane.rows.to(x.device)] for lane, (a, _) in zip(lanes, bounds, strict=True)])
    return [(out, sink.cache, sink.records) for out, sink in zip(logits, sinks, strict=True)]


def joined_head(model: DiffusionLM, pieces: Sequence[Tensor]) -> list[Tensor]:
    """The LM head of every piece (1, r, d) in one product (``head_logits`` never runs a product of a few rows, so
    each piece's logits are those it gets alone): logits (1, r, V) per piece."""
    logits = head_logits(model, torch.cat(list(pieces), 1))
    return list(logits.split([p.shape[1] for p in pieces], 1))


def _lane_rows(spans: Sequence[tuple[int, int]], pieces: Sequence[Tensor], a: int, b: int) -> Tensor:
    """Rows [a, b) of the span pieces (1, H, rows, D) laid back to back, contiguous: the piece itself when a span
    is exactly those rows (a long prompt's chunk), else a copy of the rows from the spans that hold them."""
    parts = [t[:, :, max(a, s) - s : min(b, e) - s] for (s, e), t in zip(spans, pieces, strict=True) if s < b and e > a]
    if len(parts) == 1 and parts[0].is_contiguous():
        return parts[0]
    return torch.cat(parts, 2)


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
        if i == last:  # only the rows the samplers need go on, each lane's as one run of tokens
            pieces = [_flat(x[a:b][:, lane.rows.to(x.device)]) for lane, (a, b) in zip(lanes, bounds, strict=True)]
            logits = _last_layer(model, block, pieces, [_flat_heads(out) for out in outs])
            return [out[0].reshape(lane.response.shape[0], len(lane.rows), -1) for out, lane in zip(logits, lanes,
                                                                                                    strict=True)]
        x = x + block.attn_proj(torch.cat(outs))
        del outs
        x = x + block.mlp(x)
    raise AssertionError("unreachable: the last layer returns")


def _last_layer(model: DiffusionLM, block: nn.Module, xs: list[Tensor], os: list[Tensor]) -> list[Tensor]:
    """The last layer's output projection and MLP over each lane's rows ``xs[j]`` (1, r, d) with its attention output
    ``os[j]`` (1, H, r, D), as alone (``small_rows``), then the LM head over every lane's rows at once: logits
    (1, r, V) per lane."""

    def run(x: Tensor, o: Tensor) -> Tensor:
        x = x + block.attn_proj(o)
        return x + block.mlp(x)

    return joined_head(model, apart(run, xs, os))


def plain_logits_many(model: DiffusionLM, sequences: Sequence[Tensor], rows: Sequence[Tensor]) -> list[Tensor]:
    """The whole bidirectional forward of several sequences of one length (each (b, T)): each one's logits
    (b, n, V) at its own positions ``rows``."""
    x = dense_hidden(model, torch.cat(list(sequences)))
    bounds = _bounds([s.shape[0] for s in sequences])
    picked = [_flat(x[a:b][:, r.to(x.device)]) for r, (a, b) in zip(rows, bounds, strict=True)]
    logits = joined_head(model, picked)
    return [out[0].reshape(s.shape[0], len(r), -1) for out, s, r in zip(logits, sequences, rows, strict=True)]
