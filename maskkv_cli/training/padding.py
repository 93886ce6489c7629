"""Left padding of token sequences into one batch, so every answer region ends at the same column."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def left_padded(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, keep), both (B, T) with T the longest sequence: each sequence right-aligned after ``pad_id``s, and
    ``keep`` True on its own tokens (the key mask that hides the padding from attention)."""
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    keep = torch.zeros((len(seqs), width), dtype=torch.bool)
    for row, seq in enumerate(seqs):
        ids[row, width - len(seq):] = torch.tensor(seq, dtype=torch.long)
        keep[row, width - len(seq):] = True
    return ids, keep
