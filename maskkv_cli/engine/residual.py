"""Residual entries: one synthetic prompt (key, value) per diffuse head, standing in for what the head evicted.

Ours, not in the paper: used by the opt-in policies ``maskkv-residual`` and ``maskkv-plus`` (docs/policies.md
has the motivation and the measurements). A head that spreads its attention over the whole prompt cannot be
summarized by a few kept entries; the residual entry carries the evicted entries' attention-weighted average.

What: a head whose mask queries each spread their attention over at least a threshold share of the prompt
(perplexity / M) spends one of its budgeted entries on a residual entry built from the evicted set ``E`` at
step 0:

- weights ``w_j`` (j in E): the mask queries' softmax restricted to E, averaged over the queries (and over the
  query heads of a GQA group);
- value ``v_r = sum_j w_j v_j`` and key ``k_r = sum_j w_j k_j`` (post-RoPE keys, as stored);
- a logit offset per query head, ``mean_i (logsumexp_{j in E} s_ij - q_i . k_r * scale)``, added through the
  cache's attention bias, so that a query like the step-0 mask queries gives the residual about the attention
  mass the whole evicted set had and receives their weighted mean value.

For a head that attends uniformly to the evicted entries with equal keys the result is exact; for a head whose
queries each look at a few entries it would blur what each query wants (and inject evicted needles' values),
which is why only diffuse heads get one. Everything is computed once in the prefill in query chunks (never an
M x M matrix).
"""

from __future__ import annotations

import torch
from torch import Tensor

from maskkv_cli.engine.votes import CHUNK_ELEMENTS, logit_chunks


def attention_spread(q: Tensor, k: Tensor, scale: float, chunk_elements: int = CHUNK_ELEMENTS) -> Tensor:
    """(B, H_kv) fp32: how widely each head's queries spread their attention over the keys ``k``.

    The perplexity ``exp(entropy)`` of each query's softmax over ``k`` (B, H_kv, M, D), divided by M and
    averaged over the queries ``q`` (B, H_q, R, D) and the query heads of a GQA group: about 1 for a head whose
    queries each look at the whole prompt alike, about k / M for one whose queries each look at k entries.
    """
    b, hq, r = q.shape[:3]
    hkv, m = k.shape[1], k.shape[2]
    total = torch.zeros(b, hkv, device=q.device)
    for logits in logit_chunks(q, k, scale, chunk_elements):
        logp = logits.log_softmax(dim=-1)
        entropy = -(logp.exp() * logp).sum(-1)  # (B, H_kv, g, rows)
        total += entropy.exp().sum(dim=(2, 3))
    return total / (hq // hkv * r * m)  # the mean over the g = H_q / H_kv query heads of a group and the queries


def diffuse_heads(spread: Tensor, budgets: Tensor, prompt_len: int, threshold: float) -> Tensor:
    """Bool (B, H): heads that get a residual entry. A head qualifies when its queries spread their prompt
    attention over at least ``threshold`` of the prompt (``spread`` from ``attention_spread``), it evicts
    something (budget below ``prompt_len``) and its budget is at least 2 (the residual takes one entry)."""
    budgets = budgets.to(spread.device)
    return (spread >= threshold) & (budgets >= 2) & (budgets < prompt_len)


def kept_mask(positions: Tensor, lengths: Tensor, prompt_len: int) -> Tensor:
    """Bool (B, H, M): the prompt positions each head keeps, from a layer's ``positions`` (B, H, K) and ``lengths``
    (B, H). A position counts as kept iff a valid slot (index below the head's length) holds it: padded slots
    repeat a real position (M - 1) that the head may or may not keep, so they must not write at all. Invalid
    slots write into an extra column M that is dropped, and every write is ``True`` (the result does not depend
    on the order of the writes, which CUDA leaves undefined)."""
    valid = torch.arange(positions.shape[-1], device=positions.device) < lengths.to(positions.device)[..., None]
    target = torch.where(valid, positions, prompt_len)
    kept = torch.zeros(*positions.shape[:-1], prompt_len + 1, dtype=torch.bool, device=positions.device)
    kept.scatter_(-1, target, True)
    return kept[..., :prompt_len]


def residual_entries(q: Tensor, k: Tensor, v: Tensor, kept: Tensor, scale: float,
                     chunk_elements: int = CHUNK_ELEMENTS) -> tuple[Tensor, Tensor, Tensor]:
    """The residual key, value and logit offset of every head for the evicted entries ``~kept``.

    q: (B, H_q, R, D) mask queries (post-RoPE); k, v: (B, H_kv, M, D) prompt keys (post-RoPE) and values;
    kept: (B, H_kv, M) bool. Returns ``k_r``, ``v_r`` (B, H_kv, D) in k's and v's dtype and the offset
    (B, H_q) fp32; a head that evicts nothing gets zeros and an offset of ``-inf``.
    """
    b, hq, r, d = q.shape
    hkv, m = k.shape[1], k.shape[2]
    g = hq // hkv
    kf, qf = k.float(), q.float()  # each converted once (no copy when already fp32)
    qg = qf.view(b, hkv, g, r, d)
    evicted_bias = torch.zeros(b, hkv, 1, 1, m, device=q.device).masked_fill_(kept[:, :, None, None], float("-inf"))
    weights = torch.zeros(b, hkv, m, device=q.device)
    lse_parts: list[Tensor] = []
    floor = torch.finfo(torch.float32).min
    for logits in logit_chunks(qf, kf, scale, chunk_elements):
        logits.add_(evicted_bias)
        lse = torch.logsumexp(logits, dim=-1)  # (B, H_kv, g, rows); -inf where nothing was evicted
        lse_parts.append(lse)
        weights += logits.sub_(lse.clamp_min(floor)[..., None]).exp_().sum(dim=(2, 3))
    weights /= g * r
    k_r = torch.matmul(weights[:, :, None], kf).squeeze(2)  # (B, H_kv, D)
    v_r = torch.matmul(weights[:, :, None].to(v.dtype), v).squeeze(2).float()  # v stays in its own dtype
    lse_all = torch.cat(lse_parts, dim=3)  # (B, H_kv, g, R)
    own = torch.einsum("bhgrd,bhd->bhgr", qg, k_r) * scale
    offset = (lse_all - own).mean(-1).reshape(b, hq)  # -inf stays -inf for heads with nothing evicted
    return k_r.to(k.dtype), v_r.to(v.dtype), offset
