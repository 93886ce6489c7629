"""Grow a trained LLaDA deeper without changing what it computes (block expansion, Wu et al. 2024, LLaMA Pro).

Each new block is a copy of the block before it with its two output projections (``attn_out`` and ``ff_out``)
set to zero: the block then adds nothing to the hidden state, so the grown model gives exactly the logits of
the original, while its inner weights start from trained ones and receive gradients from the first step.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from maskkv_cli.models.llada import LLaDA


def growth_points(n_layers: int, extra: int) -> list[int]:
    """The layers (0-based) after which ``extra`` new blocks go: spread evenly, ending at the last layer.

    >>> growth_points(4, 2)
    [1, 3]
    """
    if extra < 0:
        raise ValueError(f"the number of layers to add must be >= 0, got {extra}")
    if extra > n_layers:
        raise ValueError(f"can add at most one block after each of the {n_layers} layers, got {extra}")
    return [n_layers - 1 - round(i * n_layers / extra) for i in reversed(range(extra))] if extra else []


def new_block_indices(n_layers: int, extra: int) -> list[int]:
    """Where the ``extra`` new blocks sit (0-based) in the model grown from ``n_layers`` blocks.

    >>> new_block_indices(4, 2)
    [2, 5]
    """
    return [point + 1 + i for i, point in enumerate(growth_points(n_layers, extra))]


def freeze_all_but_new(model: LLaDA, extra: int) -> None:
    """Train only the ``extra`` new blocks of a grown model, its final norm and its output head (LLaMA Pro trains
    the new blocks alone; the head also learns here, since a new skill may need tokens read back that the old
    head never produced)."""
    new = new_block_indices(model.config.n_layers - extra, extra)
    keep = tuple(f"transformer.blocks.{i}." for i in new) + ("transformer.ln_f.", "transformer.ff_out.")
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith(keep))


def grow_depth(model: LLaDA, extra: int) -> LLaDA:
    """A new model with ``extra`` more blocks (see the module note); the input model is left unchanged."""
    after = set(growth_points(model.config.n_layers, extra))
    blocks: list[nn.Module] = []
    for index, block in enumerate(model.blocks):
        blocks.append(copy.deepcopy(block))
        if index in after:
            new = copy.deepcopy(block)
            with torch.no_grad():
                new.attn_out.weight.zero_()
                new.ff_out.weight.zero_()
            blocks.append(new)
    grown = LLaDA(model.config.with_(n_layers=len(blocks)))
    grown.load_state_dict({k: v for k, v in model.state_dict().items() if ".blocks." not in k}, strict=False)
    grown.transformer["blocks"] = nn.ModuleList(blocks)
    return grown.to(model.dtype)
