"""One document, many questions: a block-causal model's prompt prefix computed once and reused.

In a block-causal model (LLaDA2) a position sees its own block and the blocks before it only, so the keys,
values and hidden states of the prompt's first whole blocks do not depend on what follows them. When several
questions are asked of one document, their prompts share the blocks that hold the chat template's start and the
document: ``compute_prefix`` runs those blocks once, layer by layer, and keeps per layer the layer's input
hidden states, keys and values (``PrefixStore``). A question's prefill then runs only its own rows
(``engine.forward.prefill(..., prefix=store)``): its queries, keys and values are computed from its rows, the
stored ones stand in for the prefix, the mask queries vote over the whole prompt and each question evicts from
the stored prefix with its own votes (the store itself is never changed).

The store stays on the model's device(s): per token and layer ``d_model + 2 * n_kv_heads * head_dim`` values
(LLaDA2.0-mini in bf16: 3,072 values, 6 KiB per token and layer, 120 KiB per token over 20 layers; a 4k-token
document about 480 MiB). The session keeps the last one (``Session.prefix_store``). Asking one question alone
uses the same split (the prompt's blocks of the document, then the rest), so answers do not depend on whether
the document was asked about before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from maskkv_cli.engine.forward import MLP_CHUNK, QUERY_CHUNK, Layout, stream_layers
from maskkv_cli.models.base import Rope
from maskkv_cli.models.protocol import Block, DiffusionLM


@dataclass
class PrefixStore:
    """The first ``length`` positions of a prompt, computed: per layer its inputs, keys, values, attention shift."""

    ids: tuple[int, ...]
    block: int  # the block length the prefix was computed with (it is a whole number of blocks)
    inputs: list[Tensor] = field(default_factory=list)  # (1, p, d) each layer's input hidden states
    keys: list[Tensor] = field(default_factory=list)  # (1, H_kv, p, D) rotated
    values: list[Tensor] = field(default_factory=list)  # (1, H_kv, p, D)
    shifts: list[Tensor] = field(default_factory=list)  # 0-dim float64: the summed attention shift of its rows

    @property
    def length(self) -> int:
        return len(self.ids)

    def whole(self, stored: list[Tensor], layer: int, own: Tensor) -> Tensor:
        """The stored keys or values of ``layer`` followed by ``own`` (B, H_kv, n, D) along the positions."""
        prefix = stored[layer].to(own.device)
        return torch.cat([prefix.expand(own.shape[0], -1, -1, -1), own], dim=2)

    def queries(self, block: Block, layer: int, x: Tensor, rope: Rope) -> Callable[[int, int], Tensor]:
        """``(start, stop) -> `` the rotated queries of positions [start, stop) of the whole prompt: from the stored
        inputs for prefix positions, from ``x`` (the rows after the prefix) for the others; ``rope`` covers all."""
        p, stored = self.length, self.inputs[layer].to(x.device)

        def rows(start: int, stop: int) -> Tensor:
            parts = []
            if start < p:
                end = min(stop, p)
                parts.append(block.queries(stored[:, start:end].expand(x.shape[0], -1, -1), rope.rows(start, end)))
            if stop > p:
                first = max(start, p)
                parts.append(block.queries(x[:, first - p : stop - p], rope.rows(first, stop)))
            return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)

        return rows

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for group in (self.inputs, self.keys, self.values) for t in group)


@torch.no_grad()
def compute_prefix(model: DiffusionLM, ids: list[int], block: int, mlp_chunk: int = MLP_CHUNK,
                   query_chunk: int = QUERY_CHUNK) -> PrefixStore:
    """Run the prompt positions ``ids`` (a whole number of ``block``-long blocks) of a block-causal model once and
    keep what the rows after them need (see the module doc)."""
    if not ids or len(ids) % block:
        raise ValueError(f"a prefix is a whole number of {block}-token blocks, got {len(ids)} tokens")
    store = PrefixStore(tuple(ids), block)
    tensor = torch.tensor([ids], dtype=torch.long, device=model.device)
    layout = Layout(block=block, mask_start=len(ids), response_slots=0)
    stream_layers(model, tensor, len(ids), torch.empty(0, dtype=torch.long), None, None, lambda *args: None,
                   mlp_chunk, query_chunk, measure=True, layout=layout, capture=store)
    return store
