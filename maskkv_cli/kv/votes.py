"""Attention statistics for eviction, computed in query chunks (never a T x T matrix at once)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

# Elements of one chunk of attention probabilities (fp32): 2**22 -> 16 MiB.
CHUNK_ELEMENTS = 1 << 22


def logit_chunks(q: Tensor, k: Tensor, scale: float, chunk_elements: int = CHUNK_ELEMENTS) -> Iterator[Tensor]:
    """fp32 logits ``q k^T * scale`` of the queries ``q`` (B, H, R, D) against the keys ``k`` (B, H_kv, T, D), a
    chunk of consecutive query rows at a time: (B, H_kv, g, rows, T) with H = g * H_kv (the query heads of a GQA
    group side by side), each chunk about ``chunk_elements`` elements."""
    b, h, r, d = q.shape
    hkv, t = k.shape[1], k.shape[2]
    g = h // hkv
    kt = k.float().transpose(-1, -2)  # (B, H_kv, D, T)
    qg = q.view(b, hkv, g, r, d)
    rows = max(1, chunk_elements // max(1, b * h * t))
    for start in range(0, r, rows):
        part = qg[:, :, :, start : start + rows].float()
        n = part.shape[3]
        # the group's query rows side by side against the keys once: a (B, H_kv, 1, D, T) operand broadcast over
        # the group would copy the keys g times per chunk (hundreds of MB per chunk at 32k tokens)
        yield torch.matmul(part.reshape(b, hkv, g * n, d), kt).view(b, hkv, g, n, t).mul_(scale)


def attention_mass(q: Tensor, k: Tensor, scale: float, chunk_elements: int = CHUNK_ELEMENTS,
                   visible: Tensor | None = None) -> Tensor:
    """Sum over the queries ``q`` (B, H, R, D) of softmax(q k^T * scale) over the keys k (B, H_kv, T, D).

    Returns (B, H_kv, T) fp32: how much attention each key receives from these queries. With GQA
    (H = g * H_kv) the sums are averaged over the g query heads that share a key/value head. ``visible``
    (R, T) bool limits each query to the keys it attends to in the model (a block-causal model's prompt rows);
    None: every key.
    """
    b, h = q.shape[:2]
    hkv, t = k.shape[1], k.shape[2]
    out = torch.zeros(b, hkv, h // hkv, t, dtype=torch.float32, device=q.device)
    start = 0
    for logits in logit_chunks(q, k, scale, chunk_elements):
        rows = logits.shape[3]
        if visible is not None:
            logits.masked_fill_(~visible[start : start + rows].to(logits.device), float("-inf"))
        out += logits.softmax(dim=-1).sum(dim=3)
        start += rows
    return out.mean(dim=2)


def pool_scores(scores: Tensor, kernel: int, mode: str = "max") -> Tensor:
    """1-D pooling along tokens with stride 1 and the same length (SnapKV's clustering step)."""
    if kernel <= 1:
        return scores
    b, h, n = scores.shape
    flat = scores.reshape(b * h, 1, n)
    if mode == "max":
        pooled = F.max_pool1d(flat, kernel, stride=1, padding=kernel // 2)
    else:
        pooled = F.avg_pool1d(flat, kernel, stride=1, padding=kernel // 2, count_include_pad=False)
    return pooled[..., :n].reshape(b, h, n)


def neighbour_scores(scores: Tensor, kernel: int, weight: float) -> Tensor:
    """Each entry's score, or ``weight`` times the best score within ``kernel // 2`` tokens of it if that is more.

    The entries beside a voted one then outrank every entry with less than ``weight`` of its votes, but not the
    other voted entries: a soft form of ``pool_scores`` (weight 1) that leaves the ranking of the voted entries
    alone (weight 0: the scores unchanged).
    """
    if kernel <= 1 or weight <= 0:
        return scores
    return torch.maximum(scores, pool_scores(scores, kernel, "max") * weight)
