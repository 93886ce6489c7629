"""A block-causal document's prompt prefix as computed once: per layer its input hidden states, keys and values.

In a block-causal model (LLaDA2) a position sees its own block and the blocks before it only, so the keys,
values and hidden states of the prompt's first whole blocks do not depend on what follows them. When several
questions are asked of one document, their prompts share the blocks that hold the chat template's start and the
document: ``engine.prefix.compute_prefix`` runs those blocks once and keeps one ``PrefixLayer`` per layer. A
question's prefill then runs only its own rows: its queries, keys and values are computed from its rows, the stored
ones stand in for the prefix, the mask queries vote over the whole prompt and each question evicts from the stored
prefix with its own votes (the store itself is never changed).

The store stays on the model's device(s): per token and layer ``d_model + 2 * n_kv_heads * head_dim`` values
(LLaDA2.0-mini in bf16: 3,072 values, 6 KiB per token and layer, 120 KiB per token over 20 layers; a 4k-token
document about 480 MiB).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

RowQueries = Callable[[Tensor, int, int], Tensor]  # (hidden rows (b, n, d), first position, stop) -> q (b, H, n, D)


@dataclass
class PrefixLayer:
    """One layer of the prefix: its input hidden states, rotated keys, values and summed attention shift."""

    inputs: Tensor  # (1, p, d)
    keys: Tensor  # (1, H_kv, p, D) rotated
    values: Tensor  # (1, H_kv, p, D)
    shift: Tensor  # 0-dim float64: the attention shift summed over the prefix's rows

    @property
    def length(self) -> int:
        return self.keys.shape[2]

    @staticmethod
    def _whole(stored: Tensor, own: Tensor) -> Tensor:
        prefix = stored.to(own.device)
        return torch.cat([prefix.expand(own.shape[0], -1, -1, -1), own], dim=2)

    def whole_keys(self, own: Tensor) -> Tensor:
        """The stored keys followed by ``own`` (B, H_kv, n, D) along the positions."""
        return self._whole(self.keys, own)

    def whole_values(self, own: Tensor) -> Tensor:
        return self._whole(self.values, own)

    def queries(self, queries: RowQueries, x: Tensor) -> Callable[[int, int], Tensor]:
        """``(start, stop) ->`` the rotated queries of positions [start, stop) of the whole prompt: from the stored
        inputs for prefix positions, from ``x`` (the rows after the prefix, (b, n, d)) for the others;
        ``queries(rows, first, stop)`` rotates rows as the positions [first, stop)."""
        p, stored = self.length, self.inputs.to(x.device)

        def rows(start: int, stop: int) -> Tensor:
            parts = []
            if start < p:
                end = min(stop, p)
                parts.append(queries(stored[:, start:end].expand(x.shape[0], -1, -1), start, end))
            if stop > p:
                first = max(start, p)
                parts.append(queries(x[:, first - p : stop - p], first, stop))
            return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)

        return rows

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.inputs, self.keys, self.values))


@dataclass
class PrefixStore:
    """The first ``length`` positions of a prompt, computed (see the module doc)."""

    ids: tuple[int, ...]
    block: int  # the block length the prefix was computed with (it is a whole number of blocks)
    rope_factor: float = 1.0  # the RoPE scaling it was computed under
    layers: list[PrefixLayer] = field(default_factory=list)

    @property
    def length(self) -> int:
        return len(self.ids)

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)
