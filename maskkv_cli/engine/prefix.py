"""One document, many questions: a block-causal model's prompt prefix computed once (``kv/prefix.py``) and reused.

Asking one question alone uses the same split (the prompt's blocks of the document, then the rest), so answers do
not depend on whether the document was asked about before. The session keeps the last store
(``Session.prefix_store``).
"""

from __future__ import annotations

import torch

from maskkv_cli.engine.chunks import MLP_CHUNK, QUERY_CHUNK
from maskkv_cli.engine.lanes import Layout, PrefillLane
from maskkv_cli.engine.prefill import prefill_lanes
from maskkv_cli.kv.prefix import PrefixStore
from maskkv_cli.models.protocol import DiffusionLM


@torch.no_grad()
def compute_prefix(model: DiffusionLM, ids: list[int], block: int, mlp_chunk: int = MLP_CHUNK,
                   query_chunk: int = QUERY_CHUNK, rope_factor: float = 1.0) -> PrefixStore:
    """Run the prompt positions ``ids`` (a whole number of ``block``-long blocks) of a block-causal model once and
    keep what the rows after them need (see ``kv/prefix.py``)."""
    if not ids or len(ids) % block:
        raise ValueError(f"a prefix is a whole number of {block}-token blocks, got {len(ids)} tokens")
    store = PrefixStore(tuple(ids), block, rope_factor)
    tensor = torch.tensor([ids], dtype=torch.long, device=model.device)
    layout = Layout(block=block, mask_start=len(ids), response_slots=0)
    lane = PrefillLane(tensor, len(ids), torch.empty(0, dtype=torch.long), None, layout, capture=store, measure=True,
                       rope_factor=rope_factor)
    prefill_lanes(model, [lane], mlp_chunk, query_chunk)
    return store
