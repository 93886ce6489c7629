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

from maskkv_cli.engine.step_runner import StepOptions
from maskkv_cli.errors import UsageError
from maskkv_cli.models.families import DiffusionLM
from maskkv_cli.policies.base import Policy
from maskkv_cli.sampler import Event, GenerationResult, StepLog, _Forward, masked_sequence, top_k_commit
from maskkv_cli.stats import RunStats, now

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
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise UsageError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k <= 0:
            raise UsageError(f"--top-k must be positive, got {self.top_k}")
        if self.temperature < 0:
            raise UsageError(f"--temperature must be >= 0, got {self.temperature}")

    @property
    def n_blocks(self) -> int:
        return 1


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
                  rng: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
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


@torch.no_grad()
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
    """Denoise ``gen.gen_length`` tokens after ``prompt`` (B, M) with Dream's sampler."""
    device = model.device
    x, m = masked_sequence(model, prompt, gen.gen_length)
    mask_id = model.config.mask_token_id
    rng = torch.Generator(device=device).manual_seed(gen.seed)
    forward = _Forward(model, policy, budget, m, online_importance, step_options)
    log = StepLog(model, RunStats(policy=policy.name, prompt_len=m, gen_length=gen.gen_length), on_event, m, forward)
    timesteps = torch.linspace(1, gen.eps, gen.steps + 1, dtype=torch.float64)
    token_probs = torch.full((x.shape[0], gen.gen_length), float("nan"), dtype=torch.float64, device=device)
    for i in range(gen.steps):
        masked = x[:, m:] == mask_id
        if not bool(masked.any()):
            break
        t0 = now(device)
        rows = torch.nonzero(masked.any(0)).flatten()
        logits = forward(x, rows)  # (B, n, V)
        if mask_id < logits.shape[-1]:
            logits[..., mask_id] = float("-inf")
        t, s = float(timesteps[i]), float(timesteps[i + 1])
        last = i == gen.steps - 1
        still = x[:, m + rows] == mask_id  # (B, n)
        conf, x0, chosen_prob = sample_tokens(logits, gen, rng)
        if gen.alg == "origin":
            p = 1.0 if last else 1 - s / t
            commit = still & (torch.rand(still.shape, generator=rng, device=device, dtype=torch.float64) < p)
        else:
            conf = torch.where(still, conf, float("-inf"))
            counts = [int(n) if last else int(int(n) * (1 - s / t)) for n in still.sum(1)]
            commit = top_k_commit(conf, still, counts)
        x[:, m + rows] = torch.where(commit, x0, x[:, m + rows])
        token_probs[:, rows] = torch.where(commit, chosen_prob, token_probs[:, rows])
        log.step(t0, x, commit, 0, 1)
    log.done()
    return GenerationResult(x[:, m:].clone(), log.stats, forward.records, forward.layer_budgets, token_probs)
