"""Denoising: the loops that turn ``[prompt ; masks]`` into a response, one per sampler family.

``common.py`` holds what both loops share (the forward passes over the compressed cache, the step meter,
events and results), ``llada.py`` the LLaDA reference loop (blocks, transfer schedule, Gumbel noise,
threshold decoding), ``dream.py`` Dream's (one block, timestep schedule, confidence rules). ``sample`` picks
the loop a model's family names in ``models.families``.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from maskkv_cli.engine.step_runner import StepOptions
from maskkv_cli.models.families import family
from maskkv_cli.models.protocol import DiffusionLM
from maskkv_cli.policies.base import Policy
from maskkv_cli.sampling.common import CachedForward, Event, GenerationResult, StepMeter
from maskkv_cli.sampling.dream import DreamGenerationConfig, DreamOptions, dream_config, generate_dream
from maskkv_cli.sampling.llada import GenerationConfig, generate

__all__ = ["CachedForward", "DreamGenerationConfig", "DreamOptions", "Event", "GenerationConfig",
           "GenerationResult", "SAMPLERS", "StepMeter", "generate", "generate_dream", "sample"]

Sampler = Callable[..., GenerationResult]


def _llada(model: DiffusionLM, prompt: Tensor, gen: GenerationConfig, dream: DreamOptions, policy: Policy,
           budget: int | None, on_event: Callable[[Event], None] | None, online_importance: bool,
           step_options: StepOptions | None) -> GenerationResult:
    return generate(model, prompt, gen, policy, budget, on_event, online_importance, step_options)


def _dream(model: DiffusionLM, prompt: Tensor, gen: GenerationConfig, dream: DreamOptions, policy: Policy,
           budget: int | None, on_event: Callable[[Event], None] | None, online_importance: bool,
           step_options: StepOptions | None) -> GenerationResult:
    return generate_dream(model, prompt, dream_config(gen, dream), policy, budget, on_event, online_importance,
                          step_options)


# Sampler family (``models.families.Family.sampler``) -> its loop, called with the shared settings.
SAMPLERS: dict[str, Sampler] = {"llada": _llada, "dream": _dream}


def sample(
    model: DiffusionLM,
    prompt: Tensor,
    gen: GenerationConfig,
    policy: Policy,
    budget: int | None = None,
    on_event: Callable[[Event], None] | None = None,
    online_importance: bool = False,
    step_options: StepOptions | None = None,
    dream: DreamOptions | None = None,
) -> GenerationResult:
    """Denoise with the loop of the model's family: LLaDA's reads ``gen`` whole, Dream's takes its length,
    steps, temperature and seed and its own ``dream`` options (the response is one block)."""
    loop = SAMPLERS[family(model.config.family).sampler]
    return loop(model, prompt, gen, dream or DreamOptions(), policy, budget, on_event, online_importance,
                step_options)
