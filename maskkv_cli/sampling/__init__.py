"""Denoising: the loops that turn ``[prompt ; masks]`` into a response, one per sampler family.

``common.py`` holds what both loops share (the forward passes over the compressed cache, the step meter,
events and results), ``llada.py`` the LLaDA reference loop (blocks, transfer schedule, Gumbel noise,
threshold decoding), ``dream.py`` Dream's (one block, timestep schedule, confidence rules). ``sample`` picks
the loop a model's family names in ``models.families``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from maskkv_cli.engine.plan import CachePlan
from maskkv_cli.engine.step_runner import StepOptions
from maskkv_cli.models.families import family
from maskkv_cli.models.protocol import DiffusionLM
from maskkv_cli.policies.base import Policy
from maskkv_cli.sampling.common import CachedForward, Event, GenerationResult, StepMeter
from maskkv_cli.sampling.dream import (
    DreamGenerationConfig,
    DreamOptions,
    denoise_dream,
    dream_config,
    generate_dream,
)
from maskkv_cli.sampling.llada import GenerationConfig, denoise_llada
from maskkv_cli.sampling.llada2 import LLaDA2Options, denoise_llada2

__all__ = ["CachedForward", "DreamGenerationConfig", "DreamOptions", "Event", "GenerationConfig",
           "GenerationResult", "LLaDA2Options", "SAMPLERS", "SamplerOptions", "StepMeter", "generate",
           "generate_dream", "sample"]

Loop = Callable[..., GenerationResult]  # (model, prompt, gen, plan, on_event, options) -> result


@dataclass(frozen=True)
class SamplerOptions:
    """The families' own sampler settings beside the shared ``GenerationConfig``; each loop reads its own."""

    dream: DreamOptions = DreamOptions()
    llada2: LLaDA2Options = LLaDA2Options()


# Sampler family (``models.families.Family.sampler``) -> its loop over the shared settings: LLaDA's reads
# ``gen`` whole; Dream's takes its length, steps, temperature and seed and its own options (one block);
# LLaDA2's reads ``gen`` (steps per block: gen.steps_per_block) and its own options.
SAMPLERS: dict[str, Loop] = {
    "llada": lambda model, prompt, gen, plan, on_event, opts: denoise_llada(model, prompt, gen, plan, on_event),
    "dream": lambda model, prompt, gen, plan, on_event, opts: denoise_dream(
        model, prompt, dream_config(gen, opts.dream), plan, on_event),
    "llada2": lambda model, prompt, gen, plan, on_event, opts: denoise_llada2(
        model, prompt, gen, plan, on_event, opts.llada2),
}


def sample(model: DiffusionLM, prompt: Tensor, gen: GenerationConfig, plan: CachePlan,
           on_event: Callable[[Event], None] | None = None, dream: DreamOptions | None = None,
           llada2: LLaDA2Options | None = None) -> GenerationResult:
    """Denoise ``prompt`` with the loop of the model's family, the prompt cache run as ``plan`` says
    (``engine.plan.plan_cache``); ``dream`` / ``llada2``: those families' own sampler options."""
    loop = SAMPLERS[family(model.config.family).sampler]
    return loop(model, prompt, gen, plan, on_event, SamplerOptions(dream or DreamOptions(), llada2 or LLaDA2Options()))


def generate(model: DiffusionLM, prompt: Tensor, gen: GenerationConfig, policy: Policy, budget: int | None = None,
             on_event: Callable[[Event], None] | None = None, online_importance: bool = False,
             step_options: StepOptions | None = None, dream: DreamOptions | None = None,
             llada2: LLaDA2Options | None = None) -> GenerationResult:
    """Denoise ``gen.gen_length`` tokens after ``prompt`` (B, M) with ``policy`` at ``budget``, with the loop of
    the model's family (docs/api.md; ``maskkv_cli.generate``): the cache plan built from the policy and budget."""
    plan = CachePlan.build(model, policy, budget, prompt.shape[-1], online=online_importance,
                           step_options=step_options, block_length=gen.block_length)
    return sample(model, prompt, gen, plan, on_event, dream, llada2)
