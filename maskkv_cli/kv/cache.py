"""The prompt K/V cache as a list of per-layer objects; each layer kind keeps its prompt entries its own way.

Layout (per layer): one buffer ``(B, H_kv, K + L, D)`` for keys and one for values, where ``K`` is the layer's
prompt slots and ``L`` the response slot. Keys are stored after RoPE, so the kept keys keep their original
positions. The response slot ``[K:K+L]`` is rewritten in place at every step, so no step allocates or concatenates
cache tensors. Every kind answers the same small questions: its heads and head size (from its buffers), what a
step's rows write (``write_response``), which entries they see (``visible``), and its bytes.

- ``DenseLayer``: every prompt entry of every head (the full prefix cache, and any budget that covers the prompt).
- ``EvictedLayer``: each head keeps its own number of entries (a policy's selection); heads shorter than the
  longest are padded and masked with ``-inf`` in an additive bias (none when all heads keep the same count); a
  diffuse head may hold one residual entry (``kv/residual.py``).

A step's rows at response positions ``[offset, offset + n)`` see every prompt slot and the response slot before
``offset + n``: the whole slot for a bidirectional model (``offset`` 0, ``n`` = L), the blocks so far for a
block-causal one. The response slot starts as zeros (a dense layer built from a ``[prompt ; masks]`` prefill's own
keys and values holds the masks' entries there instead, which the first step, writing the whole slot, replaces),
so a block-causal step may also span the next response positions, masked (``visible``'s ``reach``): a finished
block's final pass attends as the windows after it do, whose attention runs over the later blocks' keys masked
(SDPA's rounding depends on how many keys it runs over, masked ones included; docs/models.md). The stored prefix
of a block-causal document is ``kv/prefix.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor


@dataclass
class LayerCache:
    """One layer's prompt entries and response slot (see the module doc); the base of the layer kinds."""

    k: Tensor  # (B, H_kv, K + L, D) post-RoPE keys; [:, :, :K] prompt, [:, :, K:] response slot
    v: Tensor  # (B, H_kv, K + L, D)
    prompt_slots: int  # K
    lengths: Tensor  # (B, H_kv) int64: kept prompt entries per key/value head (logical)
    positions: Tensor | None = None  # (B, H_kv, K) int64 original prompt positions; None = all positions kept
    bias: Tensor | None = None  # (B, H_q, 1, K + L) additive mask (0 / -inf) in the compute dtype; None = dense
    residual: Tensor | None = None  # (B, H_kv) bool: KV heads whose last prompt slot is a residual entry (residual.py)
    kind: ClassVar[str] = "dense"

    @property
    def heads(self) -> int:
        """Key/value heads."""
        return self.k.shape[1]

    @property
    def head_dim(self) -> int:
        return self.k.shape[3]

    def write_response(self, k: Tensor, v: Tensor, offset: int = 0) -> None:
        """Write k, v (B, H_kv, n, D) into the response slot from response position ``offset`` on."""
        start = self.prompt_slots + offset
        self.k[:, :, start : start + k.shape[2]].copy_(k)
        self.v[:, :, start : start + v.shape[2]].copy_(v)

    def visible(self, offset: int, n: int, reach: int = 0) -> tuple[Tensor, Tensor, Tensor | None]:
        """(keys, values, mask) that the rows at response positions [offset, offset + n) attend to.

        ``reach``: the attention also runs over the next ``reach`` response slots (as far as the slot goes), masked
        out (a bool mask, or ``-inf`` in the bias): they change no weight, only how SDPA groups its sums, so that
        these rows round as a longer block-causal window rounds them."""
        end = self.prompt_slots + offset + n
        span = min(end + reach, self.k.shape[2])
        keys, values = (self.k, self.v) if span >= self.k.shape[2] else (self.k[:, :, :span], self.v[:, :, :span])
        bias = None if self.bias is None else self.bias[..., :span]
        if span > end:  # the reached slots are masked (the others as the bias says)
            seen = torch.arange(span, device=self.k.device) < end
            if bias is None:
                return keys, values, seen[None, None, None]
            bias = bias.masked_fill(~seen, float("-inf"))
        return keys, values, bias

    @property
    def seq_len(self) -> int:
        return self.k.shape[2]

    def logical_entries(self) -> int:
        """Kept prompt (key, value) pairs over heads and batch (residual entries included)."""
        return int(self.lengths.sum()) + (0 if self.residual is None else int(self.residual.sum()))

    def nbytes(self) -> int:
        """Resident bytes of this layer (buffers, positions and bias)."""
        total = self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()
        for t in (self.positions, self.bias, self.lengths, self.residual):
            if t is not None:
                total += t.numel() * t.element_size()
        return total

    def prompt_nbytes(self) -> int:
        """Physical bytes of the prompt part of the K/V buffers (padding included)."""
        b, h, _, d = self.k.shape
        return 2 * b * h * self.prompt_slots * d * self.k.element_size()


class DenseLayer(LayerCache):
    """Every prompt entry of every head."""

    kind = "dense"

    def logical_entries(self) -> int:
        """Every head keeps every prompt slot (``lengths`` holds the slot count), with no residual entry."""
        return self.lengths.numel() * self.prompt_slots


class EvictedLayer(LayerCache):
    """Each head's own kept entries (``positions``), padded to the longest head under ``bias``."""

    kind = "evicted"


@dataclass
class PromptCache:
    prompt_len: int
    response_len: int
    layers: list[LayerCache] = field(default_factory=list)

    def logical_entries(self) -> int:
        """Kept prompt (key, value) pairs summed over layers, heads and batch (residual entries included)."""
        return sum(layer.logical_entries() for layer in self.layers)

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)

    def prompt_nbytes(self) -> int:
        return sum(layer.prompt_nbytes() for layer in self.layers)


def _buffers(k: Tensor, v: Tensor, slots: int, response_len: int) -> tuple[Tensor, Tensor]:
    """A layer's key and value buffers: ``slots`` prompt slots (the caller fills them) and the response slot, zeros
    until a step writes it (a masked key must be finite: a masked NaN or inf would still reach SDPA's sums)."""
    b, h, _, d = k.shape
    kb, vb = k.new_empty(b, h, slots + response_len, d), v.new_empty(b, h, slots + response_len, d)
    kb[:, :, slots:].zero_()
    vb[:, :, slots:].zero_()
    return kb, vb


def dense_layer(k: Tensor, v: Tensor, prompt_len: int, response_len: int, own: bool = False,
                lengths: Tensor | None = None) -> LayerCache:
    """Keep every prompt entry of every head (the full prefix cache). ``own``: k and v are the caller's to give
    (nothing else writes them); where they already have the buffers' shape (the prompt, then as many positions as
    the response slot: a ``[prompt ; masks]`` sequence's keys and values) they become the buffers, without a copy,
    and the response slot holds the masks' entries (finite) until the first step writes the whole slot.
    ``lengths``: the (B, H_kv) counts, all ``prompt_len``, where the caller has them (read only: layers share it)."""
    if lengths is None:
        lengths = torch.full(k.shape[:2], prompt_len, dtype=torch.int64, device=k.device)
    if own and k.shape[2] == v.shape[2] == prompt_len + response_len and k.is_contiguous() and v.is_contiguous():
        return DenseLayer(k, v, prompt_len, lengths)
    kb, vb = _buffers(k, v, prompt_len, response_len)
    kb[:, :, :prompt_len].copy_(k[:, :, :prompt_len])
    vb[:, :, :prompt_len].copy_(v[:, :, :prompt_len])
    return DenseLayer(kb, vb, prompt_len, lengths)


def _top_indices(scores: Tensor, budgets: Tensor, kmax: int) -> Tensor:
    """``scores.topk(kmax).indices`` (B, H, kmax), taken one batch row at a time with that row's own largest
    budget: topk's order among equal scores (pooled votes make exact ties common) depends on the tensor's shape
    and on k, so a row would otherwise keep other entries in a batch than alone. Slots past a row's own largest
    budget hold M (they lie past every head's budget of that row)."""
    if scores.shape[0] == 1:
        return scores.topk(kmax, dim=-1).indices
    out = torch.full((*scores.shape[:2], kmax), scores.shape[-1], dtype=torch.int64, device=scores.device)
    for i, k in enumerate(budgets.amax(dim=1).tolist()):
        out[i, :, :k] = scores[i : i + 1].topk(k, dim=-1).indices[0]
    return out


def select_layer(
    k: Tensor, v: Tensor, scores: Tensor, budgets: Tensor, prompt_len: int, response_len: int, group: int = 1
) -> LayerCache:
    """Keep, per (key/value) head, the ``budgets[b, h]`` prompt entries with the highest ``scores``.

    k, v: (B, H, T, D) with the prompt first (H = key/value heads); scores: (B, H, M) float, ``+inf`` for
    entries that must stay; budgets: (B, H) int64 in [1, M]. Kept entries are stored in position order. With
    GQA (``group`` query heads per key/value head) the padding bias is laid out per query head so that SDPA
    can broadcast it; the K/V themselves are stored once per key/value head.
    """
    b, h, _, d = k.shape
    m = prompt_len
    budgets = budgets.to(device=k.device, dtype=torch.int64).clamp(1, m)
    kmax = int(budgets.max())
    top = _top_indices(scores, budgets, kmax)  # (B, H, kmax), best first
    valid = torch.arange(kmax, device=k.device)[None, None, :] < budgets[..., None]
    order, _ = torch.where(valid, top, m).sort(dim=-1)  # kept positions ascending, padding (= m) last
    kept = order < m
    idx = order.clamp(max=m - 1)  # (B, H, kmax)
    gather = idx[..., None].expand(b, h, kmax, d)
    kb, vb = _buffers(k, v, kmax, response_len)
    kb[:, :, :kmax] = torch.gather(k[:, :, :m], 2, gather)
    vb[:, :, :kmax] = torch.gather(v[:, :, :m], 2, gather)
    bias = None
    if not bool(kept.all()):
        bias = torch.zeros(b, h, 1, kmax + response_len, dtype=k.dtype, device=k.device)
        bias[:, :, 0, :kmax].masked_fill_(~kept, float("-inf"))
        if group > 1:
            bias = bias.repeat_interleave(group, dim=1)
    return EvictedLayer(kb, vb, kmax, budgets, idx, bias)


def add_residual(layer: LayerCache, k_r: Tensor, v_r: Tensor, offset: Tensor, heads: Tensor) -> LayerCache:
    """The layer with one more prompt slot holding each selected head's residual entry.

    k_r, v_r: (B, H_kv, D); offset: (B, H_q) logit offset; heads: (B, H_kv) bool, the heads that use their
    residual (the slot is masked with ``-inf`` in the others). The kept entries and ``lengths`` are unchanged;
    the new slot sits between the kept prompt entries and the response slot.
    """
    b, h, slots, d = layer.k.shape
    k_slots = layer.prompt_slots
    hq = offset.shape[1]
    kb = layer.k.new_empty(b, h, slots + 1, d)
    vb = layer.v.new_empty(b, h, slots + 1, d)
    kb[:, :, :k_slots] = layer.k[:, :, :k_slots]
    vb[:, :, :k_slots] = layer.v[:, :, :k_slots]
    kb[:, :, k_slots] = k_r
    vb[:, :, k_slots] = v_r
    kb[:, :, k_slots + 1 :] = layer.k[:, :, k_slots:]  # the response slot as it was (zeros where unwritten)
    vb[:, :, k_slots + 1 :] = layer.v[:, :, k_slots:]
    bias = torch.zeros(b, hq, 1, slots + 1, dtype=layer.k.dtype, device=layer.k.device)
    if layer.bias is not None:
        bias[..., :k_slots] = layer.bias[..., :k_slots]
    use = heads.to(offset.device).repeat_interleave(hq // h, dim=1)
    bias[:, :, 0, k_slots] = torch.where(use, offset, float("-inf")).to(bias.dtype)
    return EvictedLayer(kb, vb, k_slots + 1, layer.lengths, layer.positions, bias, heads.clone())
