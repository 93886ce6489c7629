"""Dream's denoising loop (its reference sampler) over the same forward passes and compressed cache.

The whole response is one block. ``timesteps = linspace(1, eps, steps + 1)``; at step i (t -> s) the
``origin`` algorithm commits each masked position with probability ``1 - s/t``; the others commit the top
``int(#masked * (1 - s/t))`` positions (all of them at the last step) by confidence: ``maskgit_plus`` the
chosen token's probability, ``topk_margin`` top-1 minus top-2 probability, ``entropy`` the negative entropy.
Tokens are sampled with temperature, top-p and top-k (temperature 0 = argmax). The chosen token's probability
(after temperature and filtering) at the step it is committed goes to ``GenerationResult.token_probs``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from maskkv_cli.engine.plan import CachePlan
from maskkv_cli.engine.step_runner import StepOptions
from maskkv_cli.errors import UsageError
from maskkv_cli.models.protocol import DiffusionLM
from maskkv_cli.policies.base import Policy
from maskkv_cli.runtime.stats import now
from maskkv_cli.sampling.commits import TopCommit
from maskkv_cli.sampling.common import (
    Denoising,
    Event,
    GenerationResult,
    open_positions,
    still_counts,
    still_only,
)
from maskkv_cli.sampling.driver import Loop, drive
from maskkv_cli.sampling.forward import StepRequest
from maskkv_cli.sampling.llada import GenerationConfig, non_negative
from maskkv_cli.sampling.picks import Pick, Picked, Scratch, suppress_mask

DREAM_ALGS = ("origin", "maskgit_plus", "topk_margin", "entropy")


@dataclass(frozen=True)
class DreamGenerationConfig:
    gen_length: int = 128
    steps: int = 128
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    alg: str = "entropy"
    eps: float = 1e-3
    seed: int = 0

    def __post_init__(self) -> None:
        if self.gen_length <= 0 or self.steps <= 0:
            raise UsageError("--gen-length and --steps must be positive")
        if self.alg not in DREAM_ALGS:
            raise UsageError(f"--alg must be one of {', '.join(DREAM_ALGS)}")
        check_filters(self.top_p, self.top_k)
        non_negative(self.temperature, "--temperature")

    @property
    def n_blocks(self) -> int:
        return 1


def check_filters(top_p: float | None, top_k: int | None) -> None:
    """Refuse a ``--top-p`` outside (0, 1] or a ``--top-k`` below 1 (``filter_logits`` would fail on them)."""
    if top_p is not None and not 0 < top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1], got {top_p}")
    if top_k is not None and top_k <= 0:
        raise UsageError(f"--top-k must be positive, got {top_k}")


@dataclass(frozen=True)
class DreamOptions:
    """Dream's own sampler settings, beside the shared ``GenerationConfig``: the confidence rule and the token
    filters (``--alg``, ``--top-p``, ``--top-k``; the LLaDA loop has none of them)."""

    alg: str = "entropy"
    top_p: float | None = None
    top_k: int | None = None


def dream_config(gen: GenerationConfig, options: DreamOptions) -> DreamGenerationConfig:
    """Dream's loop settings from the shared ones (its whole response is one block) and its own options."""
    return DreamGenerationConfig(gen_length=gen.gen_length, steps=gen.steps, temperature=gen.temperature,
                                 seed=gen.seed, alg=options.alg, top_p=options.top_p, top_k=options.top_k)


def filter_logits(logits: Tensor, top_p: float | None, top_k: int | None) -> Tensor:
    """Keep the top-k tokens and the smallest set whose probability reaches top_p; the rest get -inf."""
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= top_p  # tokens after the nucleus is complete
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def sample_tokens(logits: Tensor, gen: DreamGenerationConfig,
                  rng: torch.Generator | None) -> tuple[Tensor, Tensor, Tensor]:
    """(confidence, tokens, probability of each chosen token) for logits (B, n, V) by Dream's rules."""
    if gen.temperature > 0:
        logits = logits / gen.temperature
    logits = filter_logits(logits, gen.top_p, gen.top_k)
    probs = logits.to(torch.float64).softmax(-1)
    if gen.temperature > 0:
        flat = probs.reshape(-1, probs.shape[-1])
        x0 = torch.multinomial(flat, 1, generator=rng).view(probs.shape[:-1])
        conf = probs.gather(-1, x0[..., None]).squeeze(-1)
    else:
        conf, x0 = probs.max(-1)
    chosen_prob = conf
    if gen.alg == "topk_margin":
        top2 = probs.topk(2, dim=-1).values
        conf = top2[..., 0] - top2[..., 1]
    elif gen.alg == "entropy":
        conf = (probs * torch.log(probs.clamp_min(1e-30))).sum(-1)
    return conf, x0, chosen_prob


@dataclass(frozen=True)
class DreamGreedy(Pick):
    """Dream's step at temperature 0 as a shared rule: the mask token suppressed, ``sample_tokens``' argmax, its
    probability and the confidence its ``alg`` ranks by."""

    mask_id: int
    alg: str
    top_p: float | None
    top_k: int | None

    def __call__(self, logits: Tensor, scratch: Scratch) -> Picked:
        rule = DreamGenerationConfig(alg=self.alg, top_p=self.top_p, top_k=self.top_k)  # temperature 0
        conf, tokens, probs = sample_tokens(suppress_mask(logits, self.mask_id), rule, None)
        return Picked(tokens, probs, conf)


def generate_dream(
    model: DiffusionLM,
    prompt: Tensor,
    gen: DreamGenerationConfig,
    policy: Policy,
    budget: int | None = None,
    on_event: Callable[[Event], None] | None = None,
    online_importance: bool = False,
    step_options: StepOptions | None = None,
) -> GenerationResult:
    """Denoise ``gen.gen_length`` tokens after ``prompt`` (B, M) with Dream's sampler (docs/api.md)."""
    plan = CachePlan.build(model, policy, budget, prompt.shape[-1], online=online_importance,
                           step_options=step_options)
    return denoise_dream(model, prompt, gen, plan, on_event)


@torch.no_grad()
def denoise_dream(model: DiffusionLM, prompt: Tensor, gen: DreamGenerationConfig, plan: CachePlan,
                  on_event: Callable[[Event], None] | None = None) -> GenerationResult:
    """Dream's loop over ``prompt`` (B, M) with the prompt cache run as ``plan`` says."""
    run = dream_run(model, prompt, gen, plan, on_event)
    return drive(model, run, dream_loop(run, gen))


def dream_run(model: DiffusionLM, prompt: Tensor, gen: DreamGenerationConfig, plan: CachePlan,
              on_event: Callable[[Event], None] | None = None) -> Denoising:
    """The generation state Dream's loop runs on."""
    return Denoising(model, prompt, gen.gen_length, gen.seed, plan, on_event)


def dream_loop(run: Denoising, gen: DreamGenerationConfig) -> Loop:
    """Dream's loop over ``run``: yields each step's ``StepRequest`` and is sent its logits."""
    x, m, rng, device = run.x, run.m, run.rng, run.device
    timesteps = torch.linspace(1, gen.eps, gen.steps + 1, dtype=torch.float64)
    # greedy: the driver picks each row's token with the batch's other rows (``sample_tokens`` at temperature 0)
    pick = DreamGreedy(run.mask_id, gen.alg, gen.top_p, gen.top_k) if gen.temperature == 0 else None
    response, positions = x[:, m:], torch.arange(gen.gen_length, device=device)
    left: Tensor | None = None  # the positions still masked after the last top-k commit, where it sent them
    for i in range(gen.steps):
        t0 = now(device)
        # the positions still masked in some row, and in each row (as the last joined commit sent them, else searched)
        rows, still = open_positions(response == run.mask_id, positions) if left is None else (left, None)
        left = None
        if len(rows) == 0:  # every position committed (read with the rows: one device sync, not two)
            break
        reply = yield StepRequest(x, rows, pick=pick)  # (B, n, V) logits, or the greedy picks
        t, s = float(timesteps[i]), float(timesteps[i + 1])
        last = i == gen.steps - 1
        if isinstance(reply, Picked):
            x0, chosen_prob, conf = reply.tokens, reply.probs, reply.confidence
            assert conf is not None
        else:
            conf, x0, chosen_prob = sample_tokens(suppress_mask(reply, run.mask_id), gen, rng)
        if gen.alg == "origin":
            p = 1.0 if last else 1 - s / t
            commit = torch.rand(x0.shape, generator=rng, device=device, dtype=torch.float64) < p
            if still is not None:
                commit &= still
            run.commit(rows, commit, x0, chosen_prob, t0, 0, 1)
        else:
            conf = still_only(conf, still)
            counts = [n if last else int(n * (1 - s / t)) for n in still_counts(still, len(rows))]
            left = yield TopCommit(rows, conf, still, counts, x0, chosen_prob, t0, 0, 1)  # (commits.py)
