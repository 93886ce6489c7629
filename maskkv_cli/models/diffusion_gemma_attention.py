"""DiffusionGemma's attention over a cache of any length, in bounded memory.

``attend`` is SDPA with softmax scale 1 (QK-norm replaces 1 / sqrt(D)) and grouped KV heads. Where SDPA has a
kernel that takes grouped heads without copying them (the CPU's flash kernel), it is asked for grouped heads;
elsewhere (CUDA) each KV head's query heads are folded into its rows, (B, H_kv, g R, D), so that no kernel repeats
the keys and values g times (the math kernel would: 8 copies of a full layer's cache in the released model) and
the memory-efficient kernel, which takes masks and the full layers' 512-dim heads but not grouped heads, can run.

``attend_causal`` is the encoder's attention of a chunk of new rows over the slots before them and themselves: row
i sits at slot ``first + i`` and sees every slot up to its own (and, on a sliding layer, only the W - 1 before it),
and, in a compressed layer, only the slots that hold an entry of its head. Its boolean mask is built per block of
rows, each block at most ``MASK_ELEMENTS`` entries (rows x the keys it sees, x g where the groups are folded), so
the mask, and SDPA's additive copy of it, stay bounded whatever the cache's length; a block reads only the keys its
rows can see. No kernel it reaches forms the rows x keys scores (the CPU's flash kernel; CUDA's memory-efficient
one): a math kernel would, per head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from maskkv_cli.models.diffusion_gemma_config import MASK_ELEMENTS


def folds_groups(q: Tensor, k: Tensor) -> bool:
    """Whether ``attend`` folds the query heads of a KV head into its rows (CUDA, grouped heads)."""
    return q.device.type == "cuda" and q.shape[1] != k.shape[1]


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, fold: bool | None = None) -> Tensor:
    """SDPA of q (B, H, R, D) over k, v (B, H_kv, S, D) with softmax scale 1; query head h reads KV head h // g
    (g = H / H_kv). ``mask`` (True = may attend): (R, S) for every head, or (B, H or H_kv, R or 1, S) per query
    head or per KV head. ``fold``: fold each KV head's query heads into its rows (default: on CUDA)."""
    b, h, r, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    g = h // hkv
    if fold is None:
        fold = folds_groups(q, k)
    if g == 1 or not fold:
        if mask is not None and mask.dim() == 4 and mask.shape[1] != h:  # per KV head -> per query head
            mask = mask.repeat_interleave(g, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0, enable_gqa=g > 1)
    folded = q.reshape(b, hkv, g * r, d)  # row j r + i: query head hkv_index * g + j, row i
    if mask is not None:
        if mask.dim() == 2:  # (R, S) -> (g R, S)
            mask = mask.repeat(g, 1)
        elif mask.shape[1] == h:  # per query head (B, H, R or 1, S) -> (B, H_kv, g R, S)
            mask = mask.expand(b, h, r, s).reshape(b, hkv, g * r, s)
        elif mask.shape[2] != 1:  # per KV head, per row (B, H_kv, R, S) -> (B, H_kv, g R, S)
            mask = mask[:, :, None].expand(b, hkv, g, r, s).reshape(b, hkv, g * r, s)
    out = F.scaled_dot_product_attention(folded, k, v, attn_mask=mask, scale=1.0)
    return out.view(b, h, r, out.shape[-1])


def attend_causal(q: Tensor, k: Tensor, v: Tensor, first: int, window: int | None = None,
                  kept: Tensor | None = None, mask_elements: int | None = None) -> Tensor:
    """The attention of the rows q (B, H, R, D) at slots ``first ..`` over the slots k, v (B, H_kv, first + R, D)
    (the cache before them, then themselves): row i sees slots ``j <= first + i``, with ``window`` also
    ``j > first + i - window``, with ``kept`` (B, H_kv, first + R) only its head's True slots. Computed in blocks of
    rows whose masks hold at most ``mask_elements`` (default ``MASK_ELEMENTS``) entries, counted as ``attend``
    lays them out; (B, H, R, D)."""
    r, total = q.shape[2], k.shape[2]
    if total != first + r:
        raise ValueError(f"{r} rows at slot {first} over {total} slots: the rows must be the last slots")
    budget = MASK_ELEMENTS if mask_elements is None else mask_elements
    group = q.shape[1] // k.shape[1] if folds_groups(q, k) else 1  # a folded mask holds each row once per head
    rows = max(1, budget // max(1, total * group))
    out = []
    for i0 in range(0, r, rows):
        i1 = min(r, i0 + rows)
        hi = first + i1  # the last row's slot, plus one
        lo = 0 if window is None else max(0, first + i0 - window + 1)
        slot = torch.arange(lo, hi, device=q.device)[None, :]  # (1, S_block)
        at = torch.arange(first + i0, first + i1, device=q.device)[:, None]  # (R_block, 1)
        visible = slot <= at
        if window is not None:
            visible &= slot > at - window
        mask: Tensor = visible
        if kept is not None:
            mask = visible[None, None] & kept[:, :, None, lo:hi]  # (B, H_kv, R_block, S_block)
        out.append(attend(q[:, :, i0:i1], k[:, :, lo:hi], v[:, :, lo:hi], mask))
    return out[0] if len(out) == 1 else torch.cat(out, dim=2)


def entry_mask(kept: Tensor | None, new: int, n_heads: int) -> Tensor | None:
    """(B, H, 1, T_l + new) bool over [cached slots ; new entries] for a layer's ``kept`` slots, laid out per query
    head (query head h reads KV head h // (H / H_kv)); None when every slot is an entry."""
    if kept is None:
        return None
    b, h_kv, _ = kept.shape
    ones = torch.ones(b, h_kv, new, dtype=torch.bool, device=kept.device)
    return torch.cat((kept, ones), dim=-1).repeat_interleave(n_heads // h_kv, dim=1)[:, :, None, :]


__all__ = ["MASK_ELEMENTS", "attend", "attend_causal", "entry_mask", "folds_groups"]
