"""DiffusionGemma's attention over a cache of any length, in bounded memory.

``attend`` is SDPA with softmax scale 1 (QK-norm replaces 1 / sqrt(D)) and grouped KV heads: the engine's
``models.base.attention``, which on CUDA folds each KV head's query heads into its rows, so that no kernel repeats
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
from torch import Tensor

from maskkv_cli.models.base import attention, folds_groups
from maskkv_cli.models.diffusion_gemma_config import MASK_ELEMENTS


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, fold: bool | None = None) -> Tensor:
    """``models.base.attention`` with softmax scale 1: q (B, H, R, D) over k, v (B, H_kv, S, D), query head h
    reading KV head h // g; ``mask`` (True = may attend) (R, S) for every head, or (B, H or H_kv, R or 1, S);
    ``fold``: fold each KV head's query heads into its rows (default: on CUDA)."""
    return attention(q, k, v, mask, scale=1.0, fold=fold)


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


__all__ = ["MASK_ELEMENTS", "attend", "attend_causal", "entry_mask"]
