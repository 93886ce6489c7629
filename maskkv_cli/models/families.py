"""Model families by name: one table from a family to its module class and to the sampler loop it uses.

A new family is its model file (implementing ``models.protocol.DiffusionLM``) and one ``Family`` entry here
(plus its config reading in ``config.py``, and a sampler loop in ``sampling/`` only if none of the existing
ones fits).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from maskkv_cli.errors import UsageError
from maskkv_cli.models.config import ModelConfig
from maskkv_cli.models.dream import Dream
from maskkv_cli.models.llada import LLaDA
from maskkv_cli.models.protocol import DiffusionLM

__all__ = ["FAMILY_TABLE", "DiffusionLM", "Family", "build_model", "family", "parameter_shapes"]


@dataclass(frozen=True)
class Family:
    name: str  # ModelConfig.family
    model_class: type[nn.Module]
    sampler: str  # the denoising loop (``sampling.SAMPLERS``): "llada" (blocks) or "dream" (one block, its rules)


FAMILY_TABLE: dict[str, Family] = {
    "llada": Family("llada", LLaDA, sampler="llada"),
    "dream": Family("dream", Dream, sampler="dream"),
}


def family(name: str) -> Family:
    try:
        return FAMILY_TABLE[name]
    except KeyError:
        raise UsageError(f"unknown model family {name!r} (known: {', '.join(FAMILY_TABLE)})") from None


def build_model(cfg: ModelConfig) -> DiffusionLM:
    return family(cfg.family).model_class(cfg)  # type: ignore[return-value]


def parameter_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint key -> shape, computed from the config alone (no tensors are allocated)."""
    with torch.device("meta"):
        model = build_model(cfg)
    return {model.checkpoint_key(name): tuple(p.shape) for name, p in model.named_parameters()}
