"""Step 0, the prefill: every lane's ``[prompt ; masks]`` layer by layer, each layer's prompt cache selected before
the layer's attention runs, so that only one layer's full keys and values are ever resident.

Per layer: the keys of every lane's rows (in row chunks, all lanes' rows in each product), then each lane's scores
(its sink asks its policy; queries are computed on demand from the lane's rows), then the values, then each lane's
sink gets its whole keys and values (select, or hold until the last layer: ``engine/selection.py``) and the lane's
attention runs over its own keys in query chunks (updating its rows of the hidden state in place), then the MLP over
every row in row chunks. Only x, k, v (and the votes' fp32 keys) are whole-length. A lane alone is the memory-bounded
prefill of one question; lanes together share the products of every layer and nothing else: short lanes (each
within one query chunk, ``joins_queries``) also their queries and the attention's output projection, each lane's
attention running over its own keys, and their queries, keys and values come from one normalisation of each row
(``chunked_qkv``: the same numbers, one pass over the rows instead of three).

``prefill`` is one sequence's step 0 with its cache plan's selection (offline or online layer budgets, a
block-causal layout, a stored document prefix).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from maskkv_cli.engine.chunks import JOIN_ROWS, MLP_CHUNK, QUERY_CHUNK
from maskkv_cli.engine.lanes import Layout, PrefillLane, RowTables, joined_heads, on_layer, prefill_memo, spans
from maskkv_cli.engine.selection import LayerRecord, LayerSink, OfflineSelection, OnlineSelection, online_budget
from maskkv_cli.kv.cache import PromptCache
from maskkv_cli.kv.prefix import PrefixLayer, PrefixStore
from maskkv_cli.models.base import Rope, attention
from maskkv_cli.models.protocol import Block, DiffusionLM
from maskkv_cli.models.quantize import held_bytes
from maskkv_cli.policies.base import LayerView, Policy

SHIFT_ROWS = 4096  # tokens per slice when measuring the attention shift (bounds the fp32 temporaries)


def attention_shift(x: Tensor, attn: Tensor, rows: int = SHIFT_ROWS) -> Tensor:
    """Sum over the tokens of ``1 - cos(h_in, h_out)``, ``h_in = x``, ``h_out = x + attn`` (both (B, T, d)).

    This is the per-layer statistic behind the layer importance ``I(l)`` (``engine/importance.py``): how far the
    attention sub-layer turns the hidden state. Computed in fp32 as ``|u - w|^2 / 2`` with ``u``, ``w`` the
    unit vectors of ``h_in`` and ``h_out`` (the same value as ``1 - cos`` without the cancellation near
    cos = 1), so an attention output of exactly zero gives exactly 0; each token contributes a value in
    [0, 2]. Returns a 0-dim float64 tensor on ``x``'s device (no host sync).
    """
    d = x.shape[-1]
    h = x.detach().reshape(-1, d)
    a = attn.detach().reshape(-1, d)
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    tiny = torch.finfo(torch.float32).tiny
    for start in range(0, h.shape[0], rows):
        h_in = h[start : start + rows].float()
        h_out = h_in + a[start : start + rows].float()
        u = h_in / h_in.norm(dim=-1, keepdim=True).clamp_min(tiny)
        w = h_out / h_out.norm(dim=-1, keepdim=True).clamp_min(tiny)
        total += (u - w).pow(2).sum(-1).mul(0.5).clamp(0.0, 2.0).sum(dtype=torch.float64)
    return total


def chunked_parts(fn: Callable[[int, int], tuple[Tensor, ...]], t: int, chunk: int) -> tuple[Tensor, ...]:
    """``fn(start, stop)`` -> tensors (B, heads, stop - start, D) over row chunks of [0, t), each written into one
    preallocated (B, heads, t, D) buffer, so the temporaries behind each chunk exist one chunk at a time."""
    if t <= chunk:
        return fn(0, t)
    first = fn(0, chunk)
    outs = tuple(f.new_empty(f.shape[0], f.shape[1], t, f.shape[3]) for f in first)
    for out, part in zip(outs, first, strict=True):
        out[:, :, :chunk] = part
    del first
    for start in range(chunk, t, chunk):
        for out, part in zip(outs, fn(start, min(t, start + chunk)), strict=True):
            out[:, :, start : start + chunk] = part
    return outs


def chunked_rows(fn: Callable[[int, int], Tensor], t: int, chunk: int) -> Tensor:
    """``chunked_parts`` of one tensor: ``fn(start, stop)`` -> (B, heads, stop - start, D)."""
    (out,) = chunked_parts(lambda start, stop: (fn(start, stop),), t, chunk)
    return out


def chunked_qkv(block: Block, x: Tensor, rope: Rope, t: int, chunk: int) -> tuple[Tensor, Tensor, Tensor]:
    """``block.qkv`` of x's rows [0, t) (queries, keys and values from one normalisation of each row) in row chunks
    (``chunked_parts``)."""
    q, k, v = chunked_parts(lambda start, stop: block.qkv(x[:, start:stop], rope.rows(start, stop)), t, chunk)
    return q, k, v


def row_fn(fn: Callable[..., Tensor], x: Tensor, rope: Rope | None = None) -> Callable[[int, int], Tensor]:
    """``(start, stop) -> fn(x[:, start:stop], rope.rows(start, stop))`` (without the tables when ``rope`` is
    None): a block's ``queries``, ``keys`` or ``values`` of any run of positions."""
    if rope is None:
        return lambda start, stop: fn(x[:, start:stop])
    return lambda start, stop: fn(x[:, start:stop], rope.rows(start, stop))


def attend_in_chunks(block: Block, x: Tensor, k: Tensor, v: Tensor, rope: Rope, chunk: int,
                     shift: bool, visible: Callable[[int, int], Tensor] | None = None,
                     offset: int = 0) -> Tensor | None:
    """``x += attn_proj(SDPA(q, k, v))`` in place, ``chunk`` query rows at a time.

    Each chunk's queries are computed from x's rows before those rows are updated (k and v were computed from the
    whole x before this call), so the result equals one whole-length attention; only k, v and x are whole-length.
    With ``shift`` the attention shift of every row (``attention_shift``) is summed and returned. ``offset``: x's
    rows are sequence positions [offset, offset + T) (rows after a stored prefix); ``rope`` covers those.
    """
    t = x.shape[1]
    total = torch.zeros((), dtype=torch.float64, device=x.device) if shift else None
    for start in range(0, t, chunk):
        stop = min(t, start + chunk)
        q = block.queries(x[:, start:stop], rope.rows(start, stop))
        o = attention(q, k, v, None if visible is None else visible(offset + start, offset + stop)[None, None])
        del q
        attn = block.attn_proj(o)
        del o
        if total is not None:
            total += attention_shift(x[:, start:stop], attn)
        x[:, start:stop] += attn
        del attn
    return total


def _lane_heads(t: Tensor, a: int, b: int, batch: int, whole: bool) -> Tensor:
    """A lane's rows [a, b) of keys or values (1, H, N, D) of every lane's rows, as (batch, H, n, D) contiguous (the
    tensor itself when it is the lane's alone)."""
    if batch == 1:
        return t if whole else t[:, :, a:b].contiguous()
    part = t[0, :, a:b]  # (H, batch * n, D)
    return part.reshape(part.shape[0], batch, -1, part.shape[-1]).transpose(0, 1).contiguous()


def joins_queries(lanes: Sequence[PrefillLane], query_chunk: int) -> bool:
    """Whether a prefill of these lanes computes every lane's queries and attention output projection as one
    product each (as it does the keys and values), instead of lane by lane: for two or more lanes whose rows all run
    (no stored prefix, nothing captured) and each fit one query chunk, where a lane alone would also have run its
    queries, its attention and its projection in one piece. Each row's numbers are the same either way (the row
    floor, ``models/rows.py``); joined, the products are larger (they share the weights' reads, and threads)."""
    return len(lanes) > 1 and all(lane.prefix is None and lane.capture is None
                                  and lane.ids.shape[0] * lane.ids.shape[1] <= query_chunk for lane in lanes)


def _row_slices(q: Tensor) -> Callable[[int, int], Tensor]:
    """``(start, stop) -> q[:, :, start:stop]``: a lane's queries of any run of its positions, already computed."""
    return lambda start, stop: q[:, :, start:stop]


def join_rows(model: DiffusionLM) -> int:
    """How many rows of prefills go through the weights as one pass (``sampling/driver.py`` joins prompts up to it):
    as many rows as make one layer's activations (each row's hidden state and MLP width) weigh what the layer's
    weights weigh, and at least ``JOIN_ROWS``. Joined rows share each weight's read, which pays while the weights
    outweigh the rows; past that a joined pass only holds more activations, which costs where the weights are small.
    Where a layer is small, a joined pass also makes fewer, larger calls, which the floor is for. Measured
    (``scripts/bench_join.py``, 8 prompts joined against one at a time, docs/performance.md): llada-small (54 MB a
    layer, 3,328 rows by this rule) 0.60-0.83x the time alone for prompts of 32-512 tokens at 2 threads, 1.00x at 1k;
    the embedded model (0.85 MB a layer, 416 rows by the rule, so the floor): 8 prompts of 60-500 tokens in runs of
    up to 1,024 rows took 0.83-1.01x the time of runs of up to 512 (1 and 2 threads), while all 8 of 300 tokens
    (2,464 rows) in one run took 1.06x the time alone at 1 thread."""
    cfg = model.config
    per_row = (cfg.d_model + cfg.mlp_hidden_size) * (torch.finfo(model.dtype).bits // 8)
    return max(JOIN_ROWS, held_bytes(model, 0) // per_row)


def prefill_lanes(model: DiffusionLM, lanes: Sequence[PrefillLane], mlp_chunk: int = MLP_CHUNK,
                  query_chunk: int = QUERY_CHUNK) -> list[tuple[Tensor, list[float]]]:
    """Step 0 of every lane (see the module doc): per lane its logits (b, len(rows), V) at its positions ``rows``
    and, when it measures, each layer's I(l) over every token of its sequence. Each lane's sink has received every
    layer (call its ``finish`` for the cache); a lane's ``capture`` store is filled."""
    heights = [lane.ids.shape[0] for lane in lanes]
    own = [lane.ids.shape[1] - lane.first for lane in lanes]  # each lane's rows that run (after its prefix)
    bounds = spans([h * n for h, n in zip(heights, own, strict=True)])
    total = bounds[-1][1]
    whole = len(lanes) == 1
    ids = torch.cat([lane.ids[:, lane.first :].reshape(1, -1) for lane in lanes], 1)
    x = model.embed(ids)  # (1, N, d): every lane's rows back to back
    memo = prefill_memo(model)
    tables = RowTables(model, [(0, lane.ids.shape[1]) for lane in lanes], [lane.first for lane in lanes], heights,
                       [lane.rope_factor for lane in lanes], ids.device, [memo] * len(lanes))
    n_layers = len(model.blocks)
    shifts: list[list[Tensor]] = [[] for _ in lanes]
    joined = joins_queries(lanes, query_chunk)
    shapes: dict[tuple[int, ...], Tensor] = {}  # the layer views' queries' shapes (meta tensors), one per shape
    for i, block in enumerate(model.blocks):
        x = on_layer(model, i, x)
        dev = x.device
        rows_rope = tables.rows(i, dev)

        def rows_of(j: int, x: Tensor = x) -> Tensor:
            """Lane j's rows of this layer's input as (b, n, d): a view, made only where it is used."""
            return x[:, bounds[j][0] : bounds[j][1]].view(heights[j], own[j], x.shape[-1])

        inputs = [rows_of(j).clone() if lane.capture is not None else None for j, lane in enumerate(lanes)]
        values: Tensor | None = None
        if joined:  # short lanes: every row's queries, keys and values from one normalisation
            queries, keys, values = chunked_qkv(block, x, rows_rope, total, mlp_chunk)  # (1, H or H_kv, N, D)
        else:  # long ones: the values only once the scores are taken (one whole-length tensor less meanwhile)
            keys, queries = chunked_rows(row_fn(block.keys, x, rows_rope), total, mlp_chunk), None
        pending = []
        for j, (lane, (a, b)) in enumerate(zip(lanes, bounds, strict=True)):
            t, p = lane.ids.shape[1], lane.first
            prefix = None if lane.prefix is None else lane.prefix.layers[i]
            lane_rope: Rope | None = None  # the tables of the lane's running rows, where its queries run lane by lane
            if queries is not None:  # the lane's rows of every row's queries: a view where the lane is one row
                one = heights[j] == 1
                rows_q = _row_slices(queries[:, :, a:b] if one else _lane_heads(queries, a, b, heights[j], whole))
            else:
                rope, xv = tables.lane(i, j, dev), rows_of(j)
                lane_rope = rope if p == 0 else rope.rows(p, t)
                if prefix is None:
                    rows_q = row_fn(block.queries, xv, lane_rope)
                else:
                    rows_q = prefix.queries(
                        lambda h, first, stop, r=rope, blk=block: blk.queries(h, r.rows(first, stop)), xv)
            k = _lane_heads(keys, a, b, heights[j], whole)
            if prefix is not None:
                k = prefix.whole_keys(k)
            visible = None if lane.layout is None else lane.layout.visible(t, dev)
            if lane.sink is None or not lane.sink.selects:  # every entry kept: no view, no scores
                pending.append((None, rows_q, k, None, lane_rope, visible, prefix))
                continue
            shape = (heights[j], block.n_heads, t, block.head_dim)
            meta = shapes.get(shape)
            if meta is None:
                meta = shapes[shape] = torch.empty(shape, device="meta")
            view = LayerView(i, n_layers, meta, k, lane.prompt_len, block.attention_scale, compute_q=rows_q,
                             mask_start=lane.mask_start, visible=visible)
            scores = lane.sink.scores(view)
            pending.append((view, rows_q, k, scores, lane_rope, visible, prefix))
        del keys, queries
        if values is None:
            values = chunked_rows(row_fn(block.values, x), total, mlp_chunk)
        pending.reverse()  # popped in lane order: each lane's view and keys are freed after its attention
        outputs: list[Tensor] = []  # joined: each lane's attention, projected once for every lane's rows
        for j, (lane, (a, b)) in enumerate(zip(lanes, bounds, strict=True)):
            view, rows_q, k, scores, lane_rope, visible, prefix = pending.pop()
            v = _lane_heads(values, a, b, heights[j], whole)
            if prefix is not None:
                v = prefix.whole_values(v)
            sink: LayerSink | None = lane.sink
            if sink is not None and view is None:
                sink.keep(i, k, v)
            elif sink is not None:
                t = lane.ids.shape[1]
                q_mask = rows_q(lane.mask_start, t) if sink.needs_mask_queries(scores) else None
                sink(view, q_mask, scores, k, v)
                del q_mask
            del view, scores
            if joined:
                mask = None if visible is None else visible(0, lane.ids.shape[1])[None, None]
                outputs.append(attention(rows_q(0, lane.ids.shape[1]), k, v, mask))
                del k, v, rows_q
                continue
            assert lane_rope is not None  # a lane not joined computes its queries itself
            shift = attend_in_chunks(block, rows_of(j), k, v, lane_rope, query_chunk, lane.measure, visible,
                                     offset=lane.first)
            if lane.capture is not None:
                assert shift is not None and inputs[j] is not None
                lane.capture.layers.append(PrefixLayer(inputs[j], k.clone(), v.clone(), shift.clone()))  # type: ignore[arg-type]
            if shift is not None:
                if prefix is not None:
                    shift = shift + prefix.shift.to(shift.device) * heights[j]
                shifts[j].append(shift)
            del k, v, rows_q
        del values, pending, inputs
        if outputs:
            attn = block.attn_proj(joined_heads(outputs))  # (1, N, d): every lane's rows in one product
            del outputs
            for j, (lane, (a, b)) in enumerate(zip(lanes, bounds, strict=True)):
                if lane.measure:
                    xv = rows_of(j)
                    shifts[j].append(attention_shift(xv, attn[:, a:b].view(xv.shape)))
            x += attn
            del attn
        for start in range(0, total, mlp_chunk):  # the MLP in row chunks, added in place
            x[:, start : start + mlp_chunk] += block.mlp(x[:, start : start + mlp_chunk])
    picked = []
    for lane, (a, b), h, n in zip(lanes, bounds, heights, own, strict=True):
        rows = lane.rows.to(x.device) - lane.first
        picked.append(x[:, a:b].view(h, n, x.shape[-1])[:, rows].reshape(1, h * len(rows), x.shape[-1]))
    logits = model.head(torch.cat(picked, 1))  # one head product for every lane's rows
    del x
    out = []
    for lane, part, h, lane_shifts in zip(lanes, logits.split([p.shape[1] for p in picked], 1), heights, shifts,
                                          strict=True):
        tokens = h * lane.ids.shape[1]
        out.append((part.reshape(h, len(lane.rows), logits.shape[-1]), [float(s) / tokens for s in lane_shifts]))
    return out


def selection_sink(policy: Policy, layer_budgets: list[int] | None, prompt_len: int, response_slots: int,
                   n_layers: int, online: bool) -> tuple[LayerSink, bool]:
    """The sink of a lane's prefill under its cache plan, and whether the lane measures its layer importance.

    ``layer_budgets`` None keeps every prompt entry (the full prefix cache). ``online``: the layer importance I(l)
    is measured on this input while it runs and the layer budgets become ``boundary_layer_budgets(I, B, beta,
    boundary)`` with ``B = sum(layer_budgets) / D`` (pass the uniform plan ``[B] * D``); with ``B >= prompt_len``
    nothing is evicted (the full cache, the importance still measured and reported)."""
    if online and layer_budgets is not None:
        budget = online_budget(layer_budgets, n_layers)
        if budget < prompt_len:
            return OnlineSelection(policy, layer_budgets, budget, prompt_len, response_slots), True
        layer_budgets = None  # the whole prompt fits: no eviction, exactly the full cache
    return OfflineSelection(policy, layer_budgets, prompt_len, response_slots), online


def prefill(
    model: DiffusionLM,
    ids: Tensor,
    prompt_len: int,
    policy: Policy,
    layer_budgets: list[int] | None,
    rows: Tensor,
    mlp_chunk: int = MLP_CHUNK,
    online_importance: bool = False,
    query_chunk: int = QUERY_CHUNK,
    layout: Layout | None = None,
    prefix: PrefixStore | None = None,
    rope_factor: float = 1.0,
) -> tuple[Tensor, PromptCache, list[LayerRecord]]:
    """Step 0 of one sequence ``ids`` (B, T) with eviction (``selection_sink``): logits at sequence positions
    ``rows``, the compressed cache and one record per layer. ``layout``: a block-causal model's first block (see
    ``Layout``); None: ``[prompt ; masks]``, bidirectional. ``prefix``: the prompt's first positions as computed
    before (``kv/prefix.py``; block-causal models)."""
    slots = ids.shape[1] - prompt_len if layout is None else layout.response_slots
    sink, measure = selection_sink(policy, layer_budgets, prompt_len, slots, len(model.blocks), online_importance)
    lane = PrefillLane(ids, prompt_len, rows, sink, layout, prefix, measure=measure, rope_factor=rope_factor)
    ((logits, importance),) = prefill_lanes(model, [lane], mlp_chunk, query_chunk)
    cache, records = sink.finish(importance)
    return logits, cache, records
