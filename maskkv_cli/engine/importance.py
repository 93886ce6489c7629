"""Layer importance ``I(l)`` for MaskKV's boundary-aware layer budgets, measured over calibration inputs.

``I(l) = 1 - mean cos(h_in, h_out)`` over every token of every calibration input, where ``h_in`` is the
hidden state entering layer l's attention sub-layer and ``h_out = h_in + attention output`` (before the
MLP), in fp32 (the paper's layer level; docs/policies.md, "Layer budgets of `maskkv`"). ``maskkv calibrate``
stores the result as a calibration profile (``maskkv_cli.models.calibration``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor

from maskkv_cli.engine.chunks import MLP_CHUNK
from maskkv_cli.engine.lanes import block_causal_visible
from maskkv_cli.engine.prefill import attention_shift
from maskkv_cli.errors import UsageError
from maskkv_cli.models.base import dense_hidden
from maskkv_cli.models.calibration import ImportanceResult
from maskkv_cli.models.protocol import DiffusionLM

__all__ = ["ImportanceResult", "layer_importance", "measure_importance"]


@torch.no_grad()
def measure_importance(
    model: DiffusionLM,
    batches: Iterable[Tensor],
    on_batch: Callable[[int, int], None] | None = None,
    mlp_chunk: int = MLP_CHUNK,
    block: int | None = None,
) -> ImportanceResult:
    """``I(l)`` over ``batches`` of token ids, each (B, T) or (T,); every token of every input weighs the same.

    The layers run through the model's one dense loop (``models.base.dense_hidden``), whose blocks compute
    q, k and v with the same hooks as the prefill, so the values match the online measurement of
    ``prefill(..., online_importance=True)`` on the same input in every dtype and under GQA.
    ``on_batch(inputs_done, tokens_done)`` is called after each batch (progress displays). ``block``: attention
    is block-causal with blocks of this length (a block-causal model, as it generates); None: bidirectional.
    """
    sums = torch.zeros(len(model.blocks), dtype=torch.float64, device=model.device)

    def add_shift(i: int, x: Tensor, attn: Tensor) -> None:
        sums[i] += attention_shift(x, attn).to(sums.device)

    inputs = tokens = 0
    for ids in batches:
        if ids.dim() == 1:
            ids = ids[None]
        ids = ids.to(model.device)
        b, t = ids.shape
        if t == 0:
            continue
        mask = None if block is None else block_causal_visible(0, t, t, block, ids.device)
        dense_hidden(model, ids, mlp_chunk=mlp_chunk, on_attention=add_shift, attn_mask=mask)
        inputs += b
        tokens += b * t
        if on_batch is not None:
            on_batch(inputs, tokens)
    if tokens == 0:
        raise UsageError("no calibration input: give at least one non-empty text")
    return ImportanceResult([float(s) / tokens for s in sums.tolist()], inputs, tokens)


def layer_importance(model: DiffusionLM, batches: Iterable[Tensor]) -> list[float]:
    """``I(l) = 1 - mean cos(h_in, h_out)`` per layer over all tokens of ``batches`` (see the module doc)."""
    return measure_importance(model, batches).importance
