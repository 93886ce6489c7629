"""Model families by name: the module class for a config, and the checkpoint key/shape table."""

from __future__ import annotations

import torch
from torch import nn

from maskkv_cli.models.config import ModelConfig
from maskkv_cli.models.dream import Dream
from maskkv_cli.models.llada import LLaDA

FAMILY_CLASSES: dict[str, type[nn.Module]] = {"llada": LLaDA, "dream": Dream}

# Any model the engine drives: LLaDA or Dream (same methods: embed, blocks, head, rope, config).
DiffusionLM = LLaDA | Dream


def build_model(cfg: ModelConfig) -> LLaDA | Dream:
    return FAMILY_CLASSES[cfg.family](cfg)  # type: ignore[return-value]


def parameter_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint key -> shape, computed from the config alone (no tensors are allocated)."""
    with torch.device("meta"):
        model = build_model(cfg)
    return {model.checkpoint_key(name): tuple(p.shape) for name, p in model.named_parameters()}
