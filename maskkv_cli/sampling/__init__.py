"""Denoising: the loops that turn ``[prompt ; masks]`` into a response, one per sampler family.

``forward.py`` turns a loop's steps into engine lanes (the forward passes over the compressed cache), ``driver.py``
runs them and ``stream.py`` many generations at once; ``common.py`` holds what the bidirectional loops share (their
sequence, the step meter, events and results), ``llada.py`` the LLaDA reference loop (blocks, transfer schedule,
Gumbel noise, threshold decoding), ``dream.py`` Dream's (one block, timestep schedule, confidence rules),
``llada2.py`` LLaDA2's block diffusion, ``diffusion_gemma.py`` DiffusionGemma's canvases over its encoder's cache.
``sample`` picks the loop a model's family names in ``models.families``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from maskkv_cli.engine.plan import CachePlan
from maskkv_cli.engine.step_runner import StepOptions
from maskkv_cli.models.families import family
from maskkv_cli.models.protocol import DiffusionLM
from maskkv_cli.policies.base import Policy
from maskkv_cli.sampling.common import Event, GenerationResult, StepMeter, check_vocabulary
from maskkv_cli.sampling.diffusion_gemma import DiffusionGemmaOptions, diffusion_gemma_loop, diffusion_gemma_run
from maskkv_cli.sampling.dream import (
    DreamGenerationConfig,
    DreamOptions,
    dream_config,
    dream_loop,
    dream_run,
    generate_dream,
)
from maskkv_cli.sampling.driver import Loop, Run, drive
from maskkv_cli.sampling.forward import CachedForward
from maskkv_cli.sampling.llada import GenerationConfig, llada_loop, llada_run
from maskkv_cli.sampling.llada2 import LLaDA2Options, llada2_loop, llada2_run
from maskkv_cli.sampling.picks import Scratch

__all__ = ["CachedForward", "DiffusionGemmaOptions", "DreamGenerationConfig", "DreamOptions", "Event",
           "GenerationConfig",
           "GenerationResult", "LLaDA2Options", "SAMPLERS", "SamplerOptions", "StepMeter", "generate",
           "generate_dream", "open_generation", "sample"]


@dataclass(frozen=True)
class SamplerOptions:
    """The families' own sampler settings beside the shared ``GenerationConfig``; each loop reads its own."""

    dream: DreamOptions = DreamOptions()
    llada2: LLaDA2Options = LLaDA2Options()
    diffusion_gemma: DiffusionGemmaOptions = DiffusionGemmaOptions()


Opener = Callable[[DiffusionLM, Tensor, GenerationConfig, CachePlan, Callable[[Event], None] | None, SamplerOptions],
                  tuple[Run, Loop]]


def _llada(model: DiffusionLM, prompt: Tensor, gen: GenerationConfig, plan: CachePlan,
           on_event: Callable[[Event], None] | None, opts: SamplerOptions) -> tuple[Run, Loop]:
    run = llada_run(model, prompt, gen, plan, on_event)
    return run, llada_loop(run, gen)


def _dream(model: DiffusionLM, prompt: Tensor, gen: GenerationConfig, plan: CachePlan,
           on_event: Callable[[Event], None] | None, opts: SamplerOptions) -> tuple[Run, Loop]:
    dream_gen = dream_config(gen, opts.dream)  # Dream's loop: its length, steps, temperature, seed; one block
    run = dream_run(model, prompt, dream_gen, plan, on_event)
    return run, dream_loop(run, dream_gen)


def _llada2(model: DiffusionLM, prompt: Tensor, gen: GenerationConfig, plan: CachePlan,
            on_event: Callable[[Event], None] | None, opts: SamplerOptions) -> tuple[Run, Loop]:
    run = llada2_run(model, prompt, gen, plan, on_event, opts.llada2)
    return run, llada2_loop(run)


def _diffusion_gemma(model: DiffusionLM, prompt: Tensor, gen: GenerationConfig, plan: CachePlan,
                     on_event: Callable[[Event], None] | None, opts: SamplerOptions) -> tuple[Run, Loop]:
    run = diffusion_gemma_run(model, prompt, gen, plan, on_event, opts.diffusion_gemma)
    return run, diffusion_gemma_loop(run)


# Sampler family (``models.families.Family.sampler``) -> the generation state and loop over the shared settings.
SAMPLERS: dict[str, Opener] = {"llada": _llada, "dream": _dream, "llada2": _llada2,
                               "diffusion_gemma": _diffusion_gemma}


def open_generation(model: DiffusionLM, prompt: Tensor, gen: GenerationConfig, plan: CachePlan,
                    on_event: Callable[[Event], None] | None = None, options: SamplerOptions | None = None,
                    scratch: Scratch | None = None) -> tuple[Run, Loop]:
    """The generation state and loop of the model's family for ``prompt``; ``scratch``: float64 work memory shared
    with the generations stepping beside it (``sampling/stream.py``)."""
    opener = SAMPLERS[family(model.config.family).sampler]
    run, loop = opener(model, prompt, gen, plan, on_event, options or SamplerOptions())
    if scratch is not None and hasattr(run, "scratch"):
        run.scratch = scratch
    return run, loop


@torch.no_grad()
def sample(model: DiffusionLM, prompt: Tensor, gen: GenerationConfig, plan: CachePlan,
           on_event: Callable[[Event], None] | None = None, dream: DreamOptions | None = None,
           llada2: LLaDA2Options | None = None,
           diffusion_gemma: DiffusionGemmaOptions | None = None) -> GenerationResult:
    """Denoise ``prompt`` with the loop of the model's family, the prompt cache run as ``plan`` says
    (``engine.plan.plan_cache``); ``dream`` / ``llada2`` / ``diffusion_gemma``: those families' own sampler options.
    The same driver as a batch of many (``sampling/stream.py``), with one generation."""
    options = SamplerOptions(dream or DreamOptions(), llada2 or LLaDA2Options(),
                             diffusion_gemma or DiffusionGemmaOptions())
    return drive(model, *open_generation(model, prompt, gen, plan, on_event, options))


def generate(model: DiffusionLM, prompt: Tensor, gen: GenerationConfig, policy: Policy | str,
             budget: int | None = None, on_event: Callable[[Event], None] | None = None,
             online_importance: bool = False, step_options: StepOptions | None = None,
             dream: DreamOptions | None = None, llada2: LLaDA2Options | None = None) -> GenerationResult:
    """Denoise ``gen.gen_length`` tokens after ``prompt`` (B, M) with ``policy`` (a ``Policy``, or its name) at
    ``budget``, with the loop of the model's family (docs/api.md; ``maskkv_cli.generate``): the cache plan built
    from the policy and budget. Ids outside the model's vocabulary are refused (torch said "index out of range")."""
    if isinstance(policy, str):  # (a name failed with "'str' object has no attribute 'uses_cache'")
        from maskkv_cli.policies.base import get_policy

        policy = get_policy(policy)
    if prompt.numel():
        check_vocabulary("generate", int(prompt.min()), int(prompt.max()), model.config.vocab_size)
    plan = CachePlan.build(model, policy, budget, prompt.shape[-1], online=online_importance,
                           step_options=step_options, block_length=gen.block_length)
    return sample(model, prompt, gen, plan, on_event, dream, llada2)
