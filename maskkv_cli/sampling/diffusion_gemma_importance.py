"""MaskKV's layer importance of a DiffusionGemma model over a calibration set (``maskkv calibrate``).

Per full-attention layer (the only layers whose prompt cache MaskKV's layer budgets split), I(l) =
1 - cos(h_in, h_out) of the attention sub-layer at the first denoising step (``diffusion_gemma_kv.
full_layer_importance``): the prompt encoded, then one decoder pass of a random initial canvas over its cache, as
a generation starts. The mean runs over every canvas token of every input, each input weighing the same (its
canvas has the model's canvas length). Each input's canvas is drawn from its own generator (``seed`` + its index),
so a profile is reproducible.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor

from maskkv_cli.models.calibration import ImportanceResult
from maskkv_cli.models.diffusion_gemma import DiffusionGemma
from maskkv_cli.sampling.diffusion_gemma_kv import full_layer_importance
from maskkv_cli.sampling.diffusion_gemma_steps import random_canvas


def measure_full_layer_importance(model: DiffusionGemma, prompts: Iterable[Tensor], seed: int = 0,
                                  on_input: Callable[[int, int], None] | None = None) -> ImportanceResult:
    """I(l) of each full layer, in order, over ``prompts`` (each (T,) or (1, T) token ids); ``on_input(inputs_done,
    tokens_done)`` after each (progress displays)."""
    gemma = model.gemma
    sums = [0.0] * len(gemma.full_layers)
    inputs = tokens = 0
    with torch.no_grad():
        for ids in prompts:
            ids = (ids if ids.dim() == 2 else ids[None]).to(model.device)
            if ids.shape[1] == 0:
                continue
            canvas = random_canvas(1, gemma.canvas_length, gemma.vocab_size,
                                   torch.Generator().manual_seed(seed + inputs)).to(model.device)
            for j, value in enumerate(full_layer_importance(model, model.encode(ids).cache, canvas)):
                sums[j] += value
            inputs += 1
            tokens += gemma.canvas_length
            if on_input is not None:
                on_input(inputs, tokens)
    if not inputs:
        raise ValueError("no calibration input with a token")
    return ImportanceResult([s / inputs for s in sums], inputs, tokens)
