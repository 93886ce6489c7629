"""What the prefill does with each layer's keys and values: the layer sinks.

The layer-streamed prefill (``engine/prefill.py``) hands every layer of a lane to that lane's sink: first for its
scores (the policy's, from the layer's keys and the queries computed on demand), then with its whole keys and values
before the layer's attention runs. ``OfflineSelection`` selects right away (the paper's offline layer budgets: only
one layer's full K/V is ever resident); ``OnlineSelection`` keeps every layer whole until the lane's layer
importance I(l) is known, then plans the layer budgets from it and selects layer by layer. Each writes one
``LayerCache`` per layer into the lane's ``PromptCache`` and one ``LayerRecord`` per layer for the reports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from maskkv_cli.kv.budgets import boundary_layer_budgets
from maskkv_cli.kv.cache import LayerCache, PromptCache, add_residual, dense_layer, select_layer
from maskkv_cli.kv.residual import attention_spread, diffuse_heads, kept_mask, residual_entries
from maskkv_cli.policies.base import LayerView, Policy


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


class LayerSink(Protocol):
    """A lane's layers as the prefill produces them (see the module doc)."""

    selects: bool  # whether it scores and selects layers; False: it keeps every entry (``keep``), and the prefill
    # makes no layer view for it

    def keep(self, layer: int, k: Tensor, v: Tensor) -> None: ...  # a layer kept whole (a sink that does not select)

    def scores(self, view: LayerView) -> Tensor | None: ...  # the policy's scores of the layer (None: none)

    def needs_mask_queries(self, scores: Tensor | None) -> bool: ...  # whether __call__ needs the mask queries

    def __call__(self, view: LayerView, q_mask: Tensor | None, scores: Tensor | None, k: Tensor,
                 v: Tensor) -> None: ...  # the layer's whole keys and values (the lane's own: the sink may keep
    # them; the prefill only reads them after), before its attention runs

    def finish(self, importance: list[float]) -> tuple[PromptCache, list[LayerRecord]]: ...  # after the last layer


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


def _record(i: int, budget: int, layer: LayerCache, pref: Tensor | None, importance: float | None) -> LayerRecord:
    return LayerRecord(i, budget, layer.lengths.cpu(), None if pref is None else pref.cpu(),
                       layer.positions.cpu() if layer.positions is not None else None, importance,
                       None if layer.residual is None else layer.residual.cpu())


def select(policy: Policy, view: LayerView, q_mask: Tensor | None, k: Tensor, v: Tensor, scores: Tensor,
           layer_budget: int, response_len: int) -> LayerCache:
    """Head budgets and selection for one layer; with ``policy.residual_spread`` > 0 the diffuse heads keep one
    entry fewer plus a residual entry (``kv/residual.py``; ``q_mask`` are the layer's mask queries)."""
    m = view.prompt_len
    group = view.q.shape[1] // k.shape[1]  # query heads per key/value head (the padding bias is per query head)
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


class OfflineSelection:
    """Each layer selected right after it is scored, before its attention (the kept K/V are copied out), with the
    plan's ``layer_budgets`` (None keeps every prompt entry: the full prefix cache, the prefill's own keys and values
    where they already have the cache's shape, ``kv.cache.dense_layer``)."""

    def __init__(self, policy: Policy, layer_budgets: list[int] | None, prompt_len: int, response_slots: int) -> None:
        self.policy, self.layer_budgets, self.prompt_len = policy, layer_budgets, prompt_len
        self.cache = PromptCache(prompt_len, response_slots)
        self.records: list[LayerRecord] = []
        self._counts: dict[tuple[torch.Size, torch.device], tuple[Tensor, Tensor]] = {}  # dense layers' lengths

    def scores(self, view: LayerView) -> Tensor | None:
        return None if self.layer_budgets is None else self.policy.scores(view, self.layer_budgets[view.layer])

    def _dense_counts(self, k: Tensor) -> tuple[Tensor, Tensor]:
        """The kept-entry counts of a dense layer whose keys are ``k`` (every head keeps the whole prompt), on k's
        device and on the CPU for its record: made once per shape and device, shared by the layers (read only)."""
        key = (k.shape[:2], k.device)
        counts = self._counts.get(key)
        if counts is None:
            lengths = torch.full(k.shape[:2], self.prompt_len, dtype=torch.int64, device=k.device)
            counts = self._counts[key] = (lengths, lengths.cpu())
        return counts

    @property
    def selects(self) -> bool:
        return self.layer_budgets is not None

    def needs_mask_queries(self, scores: Tensor | None) -> bool:
        return scores is not None and self.policy.residual_spread > 0

    def keep(self, layer: int, k: Tensor, v: Tensor) -> None:
        """Layer ``layer`` whole: the prefill's own keys and values become its buffers (``kv.cache.dense_layer``)."""
        lengths, on_cpu = self._dense_counts(k)
        self.cache.layers.append(dense_layer(k, v, self.prompt_len, self.cache.response_len, own=True,
                                             lengths=lengths))
        self.records.append(LayerRecord(layer, self.prompt_len, on_cpu, None, None))

    def __call__(self, view: LayerView, q_mask: Tensor | None, scores: Tensor | None, k: Tensor, v: Tensor) -> None:
        if self.layer_budgets is None or scores is None:
            self.keep(view.layer, k, v)
            return
        lb = self.layer_budgets[view.layer]
        layer = select(self.policy, view, q_mask, k, v, scores, lb, self.cache.response_len)
        self.records.append(_record(view.layer, lb, layer, self.policy.preference(view), None))
        self.cache.layers.append(layer)

    def finish(self, importance: list[float]) -> tuple[PromptCache, list[LayerRecord]]:
        for rec, value in zip(self.records, importance, strict=False):
            rec.importance = value
        return self.cache, self.records


class OnlineSelection:
    """Online layer budgets: every layer is scored as it runs and kept whole (K/V, scores, mask-query mass); after
    the last layer the budgets come from this input's I(l) (``boundary_layer_budgets`` over the total ``D * budget``
    of the uniform plan ``uniform``) and each layer is selected, freeing its full K/V as it goes (layer 0 first).
    **Memory**: the full cache of all layers is resident at the end of the prefill, on top of the compressed cache
    being built."""

    def __init__(self, policy: Policy, uniform: list[int], budget: int, prompt_len: int, response_slots: int) -> None:
        self.policy, self.uniform, self.budget, self.prompt_len = policy, uniform, budget, prompt_len
        self.response_slots = response_slots
        self.pending: list[tuple[StoredView, Tensor | None, Tensor, Tensor, Tensor]] = []  # view, mask q, scores, k, v

    selects = True

    def keep(self, layer: int, k: Tensor, v: Tensor) -> None:
        raise AssertionError("online layer budgets score every layer")

    def scores(self, view: LayerView) -> Tensor | None:
        return self.policy.scores(view, self.uniform[view.layer])

    def needs_mask_queries(self, scores: Tensor | None) -> bool:
        return scores is not None and self.policy.residual_spread > 0

    def __call__(self, view: LayerView, q_mask: Tensor | None, scores: Tensor | None, k: Tensor, v: Tensor) -> None:
        assert scores is not None
        self.pending.append((_stored_view(view), q_mask, scores, k, v))

    def finish(self, importance: list[float]) -> tuple[PromptCache, list[LayerRecord]]:
        cache = PromptCache(self.prompt_len, self.response_slots)
        records: list[LayerRecord] = []
        options = self.policy.options
        budgets = boundary_layer_budgets(importance, self.budget, options.beta, options.boundary,
                                         max_budget=self.prompt_len)
        pending = self.pending
        pending.reverse()  # pop() from the end frees layer 0 first
        while pending:
            view, q_mask, scores, k, v = pending.pop()
            lb = budgets[view.layer]
            layer = select(self.policy, view, q_mask, k, v, scores, lb, cache.response_len)
            records.append(_record(view.layer, lb, layer, self.policy.preference(view), importance[view.layer]))
            cache.layers.append(layer)
            del view, q_mask, scores, k, v
        return cache, records


def online_budget(layer_budgets: list[int], n_layers: int) -> int:
    """The per-head budget B of a uniform plan (the total ``D * B`` that online mode redistributes)."""
    if len(layer_budgets) != n_layers:
        raise ValueError(f"layer_budgets has {len(layer_budgets)} entries for a model with {n_layers} layers")
    total = sum(layer_budgets)
    if total % n_layers:
        raise ValueError(f"online layer budgets redistribute a total of D * B; {total} is not a multiple of "
                         f"{n_layers} layers")
    return total // n_layers
