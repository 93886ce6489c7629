"""Denoising: the loops that turn ``[prompt ; masks]`` into a response, one per sampler family.

``common.py`` holds what both loops share (the forward passes over the compressed cache, the step meter,
events and results), ``llada.py`` the LLaDA reference loop (blocks, transfer schedule, Gumbel noise,
threshold decoding), ``dream.py`` Dream's (one block, timestep schedule, confidence rules). ``sample`` picks
the loop a model's family names in ``models.families``.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from maskkv_cli.engine.plan import CachePlan
from maskkv_cli.models.families import family
from maskkv_cli.models.protocol import DiffusionLM
from maskkv_cli.sampling.common import CachedForward, Event, GenerationResult, StepMeter
from maskkv_cli.sampling.dream import (
    DreamGenerationConfig,
    DreamOptions,
    denoise_dream,
    dream_config,
    generate_dream,
)
from maskkv_cli.sampling.llada import GenerationConfig, denoise_llada, generate

__all__ = ["CachedForward", "DreamGenerationConfig", "DreamOptions", "Event", "GenerationConfig",
           "GenerationResult", "SAMPLERS", "StepMeter", "generate", "generate_dream", "sample"]

Loop = Callable[..., GenerationResult]  # (model, prompt, gen, plan, on_event, dream options) -> result

# Sampler family (``models.families.Family.sampler``) -> its loop over the shared settings: LLaDA's reads
# ``gen`` whole; Dream's takes its length, steps, temperature and seed and its own options (one block).
SAMPLERS: dict[str, Loop] = {
    "llada": lambda model, prompt, gen, plan, on_event, dream: denoise_llada(model, prompt, gen, plan, on_event),
    "dream": lambda model, prompt, gen, plan, on_event, dream: denoise_dream(model, prompt, dream_config(gen, dream),
                                                                             plan, on_event),
}


def sample(model: DiffusionLM, prompt: Tensor, gen: GenerationConfig, plan: CachePlan,
           on_event: Callable[[Event], None] | None = None, dream: DreamOptions | None = None) -> GenerationResult:
    """Denoise ``prompt`` with the loop of the model's family, the prompt cache run as ``plan`` says
    (``engine.plan.plan_cache``); ``dream``: Dream's own sampler options."""
    loop = SAMPLERS[family(model.config.family).sampler]
    return loop(model, prompt, gen, plan, on_event, dream or DreamOptions())
