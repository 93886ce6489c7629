"""Forward passes used by the sampler.

- ``plain_logits``: the whole sequence, every step (cache mode ``none``).
- ``prefill``: step 0 over ``[prompt ; masks]``, layer by layer: exact attention (SDPA), then the policy's
  selection for that layer, then only the kept prompt K/V are stored before the next layer runs. With
  ``online_importance`` the layer budgets are instead derived from this input's own layer importance, which
  needs every layer's full prompt K/V until the last layer has run (see ``prefill``).
- ``response_logits``: later steps, the response only, attending to ``[kept prompt K/V ; response K/V]``.
The LM head runs only on the rows the sampler asks for (masked positions of the current block).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from maskkv_cli.engine.chunks import MLP_CHUNK, QUERY_CHUNK
from maskkv_cli.kv.budgets import boundary_layer_budgets
from maskkv_cli.kv.cache import LayerCache, PromptCache, add_residual, dense_layer, select_layer
from maskkv_cli.kv.residual import attention_spread, diffuse_heads, kept_mask, residual_entries
from maskkv_cli.models.base import Rope, attention, dense_hidden, on_layer_device
from maskkv_cli.models.protocol import Block, DiffusionLM

if TYPE_CHECKING:
    from maskkv_cli.engine.prefix import PrefixStore
from maskkv_cli.policies.base import LayerView, Policy

SHIFT_ROWS = 4096  # tokens per slice when measuring the attention shift (bounds the fp32 temporaries)


@dataclass
class LayerRecord:
    """What the policy decided in one layer (CPU tensors), for reports and plots."""

    layer: int
    layer_budget: int
    head_budgets: Tensor  # (B, H_kv) kept prompt entries per key/value head
    preference: Tensor | None  # (B, H_kv) P_h when computed
    positions: Tensor | None  # (B, H_kv, K) kept prompt positions, M - 1 past each head's budget; None = all
    importance: float | None = None  # I(l) of this input when measured online
    residual: Tensor | None = None  # (B, H_kv) bool: heads that hold a residual entry besides ``head_budgets``


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


class StoredView(LayerView):
    """A layer's ``LayerView`` kept until the end of an online prefill, without its queries.

    ``q`` is a meta tensor (shape only), so ``response_len`` still works; the mask-query attention mass is
    kept when the policy computed it while scoring (so ``mask_mass`` and ``prompt_preference`` work); any
    new query attention is refused with a clear error instead of silently computing garbage.
    """

    def mask_mass(self) -> Tensor:
        if self._mask_mass is None:
            raise RuntimeError("online layer budgets: this policy needs the mask queries' attention in "
                               "head_budgets/preference but did not compute it in scores()")
        return self._mask_mass

    def query_mass(self, start: int, stop: int) -> Tensor:
        raise RuntimeError("online layer budgets: the queries are freed after scoring; compute query attention "
                           "in scores(), not in head_budgets()/preference()")


def _stored_view(view: LayerView) -> StoredView:
    q = torch.empty(view.q.shape, dtype=view.q.dtype, device="meta")
    return StoredView(view.layer, view.n_layers, q, view.k, view.prompt_len, view.scale, view._mask_mass,
                      mask_start=view.mask_start, visible=view.visible)


def block_causal_visible(start: int, stop: int, total: int, block: int, device: torch.device | str) -> Tensor:
    """Bool (stop - start, total): query position i sees key position j iff j's block is not after i's (blocks of
    ``block`` positions counted from 0: a block sees itself and every earlier block)."""
    queries = torch.arange(start, stop, device=device) // block
    keys = torch.arange(total, device=device) // block
    return keys[None, :] <= queries[:, None]


@dataclass(frozen=True)
class Layout:
    """A prefill sequence laid out otherwise than ``[prompt ; masks]`` over a bidirectional model: a block-causal
    model's first response block, whose start ``prompt_len`` (the end of the evictable prompt entries) may lie
    inside the prompt."""

    block: int  # attention is block-causal with blocks of this many positions from position 0
    mask_start: int  # the first mask position: the mask queries that vote are [mask_start, T)
    response_slots: int  # the cache's response slot: every block position from ``prompt_len`` on

    def visible(self, total: int, device: torch.device | str) -> Callable[[int, int], Tensor]:
        return lambda start, stop: block_causal_visible(start, stop, total, self.block, device)


def head_logits(model: DiffusionLM, x: Tensor) -> Tensor:
    """The LM head of hidden states x (B, n, d): logits (B, n, V). Its product keeps the row floor of every linear
    layer (``models.rows``), so the rows' logits are the same alone and beside other sequences' rows."""
    return model.head(x)  # (n may be 0: a prefill whose rows lie in a later block)


def plain_logits(model: DiffusionLM, ids: Tensor, rows: Tensor) -> Tensor:
    """Full bidirectional forward over ids (B, T); logits (B, len(rows), V) at sequence positions ``rows``."""
    x = dense_hidden(model, ids)
    return head_logits(model, x[:, rows.to(x.device)])


def chunked_rows(fn: Callable[[int, int], Tensor], t: int, chunk: int) -> Tensor:
    """``fn(start, stop)`` -> (B, heads, stop - start, D) over row chunks of [0, t), written into one preallocated
    (B, heads, t, D) buffer, so the temporaries behind each chunk exist one chunk at a time."""
    if t <= chunk:
        return fn(0, t)
    first = fn(0, chunk)
    out = first.new_empty(first.shape[0], first.shape[1], t, first.shape[3])
    out[:, :, :chunk] = first
    del first
    for start in range(chunk, t, chunk):
        out[:, :, start : start + chunk] = fn(start, min(t, start + chunk))
    return out


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


def _online_budget(layer_budgets: list[int], n_layers: int) -> int:
    """The per-head budget B of a uniform plan (the total ``D * B`` that online mode redistributes)."""
    if len(layer_budgets) != n_layers:
        raise ValueError(f"layer_budgets has {len(layer_budgets)} entries for a model with {n_layers} layers")
    total = sum(layer_budgets)
    if total % n_layers:
        raise ValueError(f"online layer budgets redistribute a total of D * B; {total} is not a multiple of "
                         f"{n_layers} layers")
    return total // n_layers


def _record(i: int, budget: int, layer: LayerCache, pref: Tensor | None, importance: float | None) -> LayerRecord:
    return LayerRecord(i, budget, layer.lengths.cpu(), None if pref is None else pref.cpu(),
                       layer.positions.cpu() if layer.positions is not None else None, importance,
                       None if layer.residual is None else layer.residual.cpu())


def _select(policy: Policy, view: LayerView, q_mask: Tensor | None, k: Tensor, v: Tensor, scores: Tensor,
            layer_budget: int, response_len: int, group: int) -> LayerCache:
    """Head budgets and selection for one layer; with ``policy.residual_spread`` > 0 the diffuse heads keep one
    entry fewer plus a residual entry (``kv/residual.py``; ``q_mask`` are the layer's mask queries)."""
    m = view.prompt_len
    heads = policy.head_budgets(view, layer_budget, scores)
    threshold = policy.residual_spread
    if threshold <= 0 or q_mask is None or not bool((heads < m).any()):
        return select_layer(k, v, scores, heads, m, response_len, group)
    k_prompt = k[:, :, :m].float()  # one fp32 copy for both passes (no copy when the model is fp32)
    diffuse = diffuse_heads(attention_spread(q_mask, k_prompt, view.scale), heads, m, threshold)
    if not bool(diffuse.any()):
        return select_layer(k, v, scores, heads, m, response_len, group)
    layer = select_layer(k, v, scores, heads - diffuse.to(heads.dtype), m, response_len, group)
    kept = kept_mask(layer.positions, layer.lengths, m)  # type: ignore[arg-type]
    k_r, v_r, offset = residual_entries(q_mask, k_prompt, v[:, :, :m], kept, view.scale)  # k_r cast on storing
    return add_residual(layer, k_r, v_r, offset, diffuse)


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
) -> tuple[Tensor, PromptCache, list[LayerRecord]]:
    """Step 0 with eviction. ``layer_budgets`` None keeps every prompt entry (the full prefix cache).
    ``layout``: a block-causal model's first block (see ``Layout``); None: ``[prompt ; masks]``, bidirectional.
    ``prefix``: the prompt's first positions as computed before (``engine/prefix.py``; block-causal models).

    Returns logits at sequence positions ``rows``, the compressed cache and one record per layer.

    Offline (default): layer ``i`` keeps ``layer_budgets[i]`` entries per head on average and evicts right
    after its own attention, so only one layer's full K/V is ever resident.

    ``online_importance=True``: the layer importance ``I(l)`` is measured on this input while it runs (the
    same statistic as ``maskkv_cli.engine.importance.layer_importance``, over every token of ``ids``) and the layer
    budgets become ``boundary_layer_budgets(I, B, beta, boundary)`` with ``B = sum(layer_budgets) / D`` (pass
    the uniform plan ``[B] * D``) and ``beta``/``boundary`` from ``policy.options``. Each layer is scored as it
    runs (``policy.scores(view, layer_budgets[i])``; MaskKV's scores do not depend on the budget); the queries
    are dropped at once, but the full K/V of the layer (``[prompt ; masks]``), its scores and the mask-query
    attention mass (B, H, T) are kept. After the last layer, head budgets and the selection run for every
    layer and the full K/V are freed layer by layer. **Memory**: the full cache of all layers,
    ``2 * D * B_batch * H * T * head_dim`` elements (as large as a full prefix cache: about 0.5 MiB per token
    for LLaDA-8B in bf16), is resident at the end of the prefill, on top of the compressed cache being built.
    With ``B >= prompt_len`` nothing is evicted (the result equals the full cache). The records carry each
    layer's ``importance`` and its actual ``layer_budget``. ``layer_budgets`` None ignores the flag except that
    the importance is still reported.
    """
    if online_importance and layer_budgets is not None:
        budget = _online_budget(layer_budgets, len(model.blocks))
        if budget < prompt_len:
            return _prefill_online(model, ids, prompt_len, policy, layer_budgets, budget, rows, mlp_chunk,
                                   query_chunk, layout, prefix)
        layer_budgets = None  # the whole prompt fits: no eviction, exactly the full cache
    keep = OfflineSelection(model, policy, layer_budgets, prompt_len, _response_slots(ids, prompt_len, layout))
    logits, importance = stream_layers(model, ids, prompt_len, rows, policy, layer_budgets, keep, mlp_chunk,
                                       query_chunk, measure=online_importance, layout=layout, prefix=prefix)
    for rec, value in zip(keep.records, importance, strict=False):
        rec.importance = value
    return logits, keep.cache, keep.records


class OfflineSelection:
    """The offline prefill's layer sink: each layer is selected right after it is scored, before its attention
    (the kept K/V are copied out), into ``cache``, with one ``LayerRecord`` per layer in ``records``."""

    def __init__(self, model: DiffusionLM, policy: Policy, layer_budgets: list[int] | None, prompt_len: int,
                 response_slots: int) -> None:
        self.policy, self.layer_budgets, self.prompt_len = policy, layer_budgets, prompt_len
        self.group = model.config.group_size
        self.cache = PromptCache(prompt_len, response_slots)
        self.records: list[LayerRecord] = []

    def __call__(self, view: LayerView, q_mask: Tensor | None, scores: Tensor | None, k: Tensor, v: Tensor) -> None:
        response_len = self.cache.response_len
        if self.layer_budgets is None or scores is None:
            layer = dense_layer(k, v, self.prompt_len, response_len)
            self.records.append(LayerRecord(view.layer, self.prompt_len, layer.lengths.cpu(), None, None))
        else:
            lb = self.layer_budgets[view.layer]
            layer = _select(self.policy, view, q_mask, k, v, scores, lb, response_len, self.group)
            self.records.append(_record(view.layer, lb, layer, self.policy.preference(view), None))
        self.cache.layers.append(layer)


def _response_slots(ids: Tensor, prompt_len: int, layout: Layout | None) -> int:
    return ids.shape[1] - prompt_len if layout is None else layout.response_slots


def _prefill_online(model: DiffusionLM, ids: Tensor, prompt_len: int, policy: Policy, uniform: list[int],
                    budget: int, rows: Tensor, mlp_chunk: int, query_chunk: int, layout: Layout | None,
                    prefix: PrefixStore | None) -> tuple[Tensor, PromptCache, list[LayerRecord]]:
    """Online layer budgets: every layer is scored as it runs and kept whole (K/V, scores, mask-query mass);
    after the last layer the budgets come from this input's I(l) and each layer is selected, freeing its full
    K/V as it goes (layer 0 first)."""
    pending: list[tuple[StoredView, Tensor | None, Tensor, Tensor, Tensor]] = []  # view, mask q, scores, k, v

    def hold(view: LayerView, q_mask: Tensor | None, scores: Tensor | None, k: Tensor, v: Tensor) -> None:
        assert scores is not None
        pending.append((_stored_view(view), q_mask, scores, k, v))

    logits, importance = stream_layers(model, ids, prompt_len, rows, policy, uniform, hold, mlp_chunk, query_chunk,
                                       measure=True, layout=layout, prefix=prefix)
    cache = PromptCache(prompt_len, _response_slots(ids, prompt_len, layout))
    records: list[LayerRecord] = []
    budgets = boundary_layer_budgets(importance, budget, policy.options.beta, policy.options.boundary,
                                     max_budget=prompt_len)
    group = model.config.group_size
    pending.reverse()  # pop() from the end frees layer 0 first
    while pending:
        view, q_mask, scores, k, v = pending.pop()
        lb = budgets[view.layer]
        layer = _select(policy, view, q_mask, k, v, scores, lb, cache.response_len, group)
        records.append(_record(view.layer, lb, layer, policy.preference(view), importance[view.layer]))
        cache.layers.append(layer)
        del view, q_mask, scores, k, v
    return logits, cache, records


LayerSink = Callable[[LayerView, Tensor | None, Tensor | None, Tensor, Tensor], None]  # view, mask q, scores, k, v


def stream_layers(model: DiffusionLM, ids: Tensor, prompt_len: int, rows: Tensor, policy: Policy | None,
                   layer_budgets: list[int] | None, sink: LayerSink, mlp_chunk: int, query_chunk: int,
                   measure: bool, layout: Layout | None = None, prefix: PrefixStore | None = None,
                   capture: PrefixStore | None = None) -> tuple[Tensor, list[float]]:
    """The layer-streamed pass both modes share; logits at sequence positions ``rows`` and, with ``measure``,
    each layer's I(l) over every token of ``ids``.

    Per layer only x, k, v (and the votes' fp32 keys) are whole-length: k first, then the policy's scores (they
    need k and some queries, computed on demand; none without ``layer_budgets``), then v, then
    ``sink(view, mask queries, scores, k, v)`` (select, or hold until the last layer), then attention, the output
    projection and the residual in query chunks, and the MLP in row chunks.

    ``prefix``: the first ``prefix.length`` positions of ``ids`` were computed before (a block-causal model's
    document, ``engine/prefix.py``): their keys, values and layer inputs come from the store and only the rows
    after them run. ``capture``: store this pass's layer inputs, keys, values and attention shifts in it."""
    t = ids.shape[1]
    p = 0 if prefix is None else prefix.length
    x = model.embed(ids[:, p:])  # (B, T - p, d)
    rope = model.rope(torch.arange(t, device=ids.device))
    scale = 1.0 / math.sqrt(model.config.head_dim)
    n_layers = len(model.blocks)
    shifts: list[Tensor] = []
    visible = None if layout is None else layout.visible(t, ids.device)
    mask_start = prompt_len if layout is None else layout.mask_start
    for i, block in enumerate(model.blocks):
        x, rope = on_layer_device(model, i, x, rope)
        own = rope if p == 0 else rope.rows(p, t)  # the tables of x's rows
        if capture is not None:
            capture.inputs.append(x.clone())
        rows_q = row_fn(block.queries, x, own) if prefix is None else prefix.queries(block, i, x, rope)
        k = chunked_rows(row_fn(block.keys, x, own), t - p, mlp_chunk)  # (B, H_kv, T - p, D)
        if prefix is not None:
            k = prefix.whole(prefix.keys, i, k)
        shape = (x.shape[0], model.config.n_heads, t, model.config.head_dim)
        view = LayerView(i, n_layers, torch.empty(shape, device="meta"), k, prompt_len, scale, compute_q=rows_q,
                         mask_start=mask_start, visible=visible)
        scores = None if layer_budgets is None or policy is None else policy.scores(view, layer_budgets[i])
        v = chunked_rows(row_fn(block.values, x), t - p, mlp_chunk)
        if prefix is not None:
            v = prefix.whole(prefix.values, i, v)
        if capture is not None:
            capture.keys.append(k.clone())
            capture.values.append(v.clone())
        needs_q = scores is not None and policy is not None and policy.residual_spread > 0
        q_mask = rows_q(mask_start, t) if needs_q else None
        sink(view, q_mask, scores, k, v)
        del view, scores, q_mask
        shift = attend_in_chunks(block, x, k, v, own, query_chunk, measure, visible, offset=p)
        if shift is not None:
            if capture is not None:
                capture.shifts.append(shift.clone())
            shifts.append(shift if prefix is None else shift + prefix.shifts[i].to(shift.device) * x.shape[0])
        del k, v, rows_q
        for start in range(0, t - p, mlp_chunk):  # the MLP in row chunks, added in place
            x[:, start : start + mlp_chunk] += block.mlp(x[:, start : start + mlp_chunk])
    logits = head_logits(model, x[:, (rows.to(x.device) - p)])
    del x
    tokens = ids.shape[0] * t
    return logits, [float(s) / tokens for s in shifts]


def response_hidden(model: DiffusionLM, cache: PromptCache, response: Tensor, rope: Rope,
                    rows: Tensor | None = None, offset: int = 0) -> Tensor:
    """One denoising step over the response only (B, L): every row's keys/values go into the cache's response
    slot; the last layer runs on response rows ``rows`` only (all L when None). Hidden states (B, len(rows), d).

    ``offset``: the rows are response positions [offset, offset + L) of a longer response slot (a block-causal
    model's current block): they attend to the kept prompt entries and response positions before
    ``offset + L`` only (the blocks before and their own)."""
    x = model.embed(response)  # (B, L, d)
    last = len(model.blocks) - 1
    for i, block in enumerate(model.blocks):
        layer: LayerCache = cache.layers[i]
        x, rope = on_layer_device(model, i, x, rope)
        q, k, v = block.qkv(x, rope)  # q (B, H, L, D); k, v (B, H_kv, L, D)
        layer.write_response(k, v, offset)
        if i == last and rows is not None:  # only the rows whose logits are needed go on
            rows = rows.to(x.device)
            q, x = q[:, :, rows], x[:, rows]
        keys, values, bias = layer.k, layer.v, layer.bias
        end = layer.prompt_slots + offset + response.shape[1]
        if end < keys.shape[2]:  # later blocks are not visible yet
            keys, values = keys[:, :, :end], values[:, :, :end]
            bias = None if bias is None else bias[..., :end]
        o = attention(q, keys, values, bias)
        x = x + block.attn_proj(o)
        x = x + block.mlp(x)
    return x


def response_logits(model: DiffusionLM, cache: PromptCache, response: Tensor, rows: Tensor,
                    offset: int = 0) -> Tensor:
    """One denoising step over the response only (B, L); logits (B, len(rows), V) from the hidden states at
    response rows ``rows`` (the sampler accounts for a model's logit shift). ``offset``: see ``response_hidden``."""
    start = cache.prompt_len + offset
    rope = model.rope(torch.arange(start, start + response.shape[1], device=response.device))
    return head_logits(model, response_hidden(model, cache, response, rope, rows, offset))
