"""The LLaDA denoising loop (the reference sampler) over either the plain forward or the compressed cache.

Sequence = ``[prompt ; gen_length masks]``. Blocks are decoded left to right; ``steps`` is split evenly over
blocks; in a block with m masked tokens and s steps, step j commits ``m // s`` tokens (the first ``m % s``
steps one more), chosen by confidence (``low_confidence``: probability of the chosen token; ``random``:
uniform noise). Temperature uses Gumbel noise in float64; classifier-free guidance runs a second sequence with
the prompt masked. With ``threshold`` set, every masked token of the block whose confidence exceeds it is
committed at once (always at least one). Progress goes to ``on_event`` as plain ``Event`` objects; the
sequence and the step meter are shared with Dream's loop (``common.py``), the forward passes with every cached
family (``forward.py``). Each committed token's probability under the model (after guidance, before noise) at the
step it was unmasked goes to ``GenerationResult.token_probs``; it takes no part in choosing tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import overload

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
    still_only,
)
from maskkv_cli.sampling.driver import Loop, drive
from maskkv_cli.sampling.forward import StepRequest
from maskkv_cli.sampling.picks import MaskedArgmax, Picked, suppress_mask

REMASKING = ("low_confidence", "random")


SEEDS = (-(2**63), 2**64 - 1)  # the seeds torch.Generator.manual_seed takes


def non_negative(value: float, flag: str) -> None:
    """Refuse a negative, infinite or NaN ``value`` of ``flag`` (NaN passes a plain ``value < 0`` test)."""
    if not (math.isfinite(value) and value >= 0):
        raise UsageError(f"{flag} must be >= 0, got {value}")


@dataclass(frozen=True)
class GenerationConfig:
    gen_length: int = 128
    steps: int = 128
    block_length: int = 32
    temperature: float = 0.0
    cfg_scale: float = 0.0
    remasking: str = "low_confidence"
    threshold: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.gen_length <= 0 or self.block_length <= 0 or self.steps <= 0:
            raise UsageError("--gen-length, --block-length and --steps must be positive")
        if self.gen_length % self.block_length:
            raise UsageError(f"--gen-length {self.gen_length} must be a multiple of --block-length "
                             f"{self.block_length}")
        if self.steps % self.n_blocks:
            raise UsageError(f"--steps {self.steps} must be a multiple of the number of blocks {self.n_blocks} "
                             f"(gen length / block length)")
        non_negative(self.temperature, "--temperature")
        non_negative(self.cfg_scale, "--cfg")
        if not SEEDS[0] <= self.seed <= SEEDS[1]:
            raise UsageError(f"--seed must be between {SEEDS[0]} and {SEEDS[1]} (a 64-bit number), got {self.seed}")
        if self.remasking not in REMASKING:
            raise UsageError(f"--remasking must be one of {', '.join(REMASKING)}")
        if self.threshold is not None and not 0.0 <= self.threshold < 1.0:
            raise UsageError(f"--threshold must be in [0, 1), got {self.threshold}")

    @property
    def n_blocks(self) -> int:
        return self.gen_length // self.block_length

    @property
    def steps_per_block(self) -> int:
        return self.steps // self.n_blocks


class TransferSchedule(Sequence[int]):
    """Tokens to commit at each of ``steps`` steps for ``masked`` masked tokens (reference rule: ``masked // steps``
    each, one more for the first ``masked % steps``), each computed when read: a list would hold one number per
    step, and ``--steps 1000000000`` asks for more steps than any block runs (a block ends once its masks are
    committed; the steps past them commit none)."""

    def __init__(self, masked: int, steps: int) -> None:
        self.steps = steps
        self.base, self.rem = divmod(masked, steps)

    def __len__(self) -> int:
        return self.steps

    @overload
    def __getitem__(self, j: int) -> int: ...

    @overload
    def __getitem__(self, j: slice) -> list[int]: ...

    def __getitem__(self, j: int | slice) -> int | list[int]:
        if isinstance(j, slice):
            return [self[i] for i in range(*j.indices(self.steps))]
        if j < 0:
            j += self.steps
        if not 0 <= j < self.steps:
            raise IndexError(j)
        return self.base + (1 if j < self.rem else 0)


def transfer_schedule(masked: int, steps: int) -> TransferSchedule:
    """Tokens to commit at each of ``steps`` steps for ``masked`` masked tokens (``TransferSchedule``)."""
    return TransferSchedule(masked, steps)


def add_gumbel_noise(logits: Tensor, temperature: float, rng: torch.Generator | None) -> Tensor:
    """Reference sampling trick: exp(logits) / (-log u)^T in float64; temperature 0 returns logits. At a temperature
    of about 20 and more (-log u)^T can underflow to 0, and a token that cannot be chosen (a logit of -inf, the mask
    token) gave 0 / 0 = nan, which argmax took: such a token stays at 0 (no nan arises below that temperature, so
    nothing else changes)."""
    if temperature == 0:
        return logits
    logits = logits.to(torch.float64)
    u = torch.rand(logits.shape, dtype=torch.float64, device=logits.device, generator=rng)
    noisy = logits.exp() / (-torch.log(u)) ** temperature
    return noisy.masked_fill(noisy.isnan(), 0.0)


def generate(
    model: DiffusionLM,
    prompt: Tensor,
    gen: GenerationConfig,
    policy: Policy,
    budget: int | None = None,
    on_event: Callable[[Event], None] | None = None,
    online_importance: bool = False,
    step_options: StepOptions | None = None,
) -> GenerationResult:
    """Denoise ``gen.gen_length`` tokens after ``prompt`` (B, M) with ``policy`` at ``budget`` (docs/api.md).

    ``online_importance``: layer budgets from the current input (the full cache is resident during the prefill).
    ``step_options``: run later steps compiled or as a CUDA graph (``engine/step_runner.py``).
    """
    plan = CachePlan.build(model, policy, budget, prompt.shape[-1], online=online_importance,
                           step_options=step_options)
    return denoise_llada(model, prompt, gen, plan, on_event)


@torch.no_grad()
def denoise_llada(model: DiffusionLM, prompt: Tensor, gen: GenerationConfig, plan: CachePlan,
                  on_event: Callable[[Event], None] | None = None) -> GenerationResult:
    """The LLaDA loop over ``prompt`` (B, M) with the prompt cache run as ``plan`` says."""
    run = llada_run(model, prompt, gen, plan, on_event)
    return drive(model, run, llada_loop(run, gen))


def llada_run(model: DiffusionLM, prompt: Tensor, gen: GenerationConfig, plan: CachePlan,
              on_event: Callable[[Event], None] | None = None) -> Denoising:
    """The generation state the LLaDA loop runs on."""
    return Denoising(model, prompt, gen.gen_length, gen.seed, plan, on_event, gen.block_length)


def llada_loop(run: Denoising, gen: GenerationConfig) -> Loop:
    """The LLaDA loop over ``run``: yields each step's ``StepRequest`` and is sent its logits."""
    x, m, mask_id, rng, device = run.x, run.m, run.mask_id, run.rng, run.device
    bsz = x.shape[0]
    # greedy without guidance: the driver picks each row's argmax and probability with the batch's other rows
    pick = MaskedArgmax(mask_id) if gen.temperature == 0 and gen.cfg_scale == 0 else None
    for blk in range(gen.n_blocks):
        lo, hi = blk * gen.block_length, (blk + 1) * gen.block_length
        block, positions = x[:, m + lo : m + hi], torch.arange(lo, hi, device=device)  # (B, block), its positions
        block_masked = block == mask_id
        schedules = [transfer_schedule(int(c), gen.steps_per_block) for c in block_masked.sum(1)]
        j = 0
        left: Tensor | None = None  # the positions still masked after the last commit, where it sent them
        while True:
            if gen.threshold is None and j >= gen.steps_per_block:
                break
            t0 = now(device)
            # the block's positions whose logits are needed, and which of them are still masks in each row
            rows, still = open_positions(block == mask_id, positions) if left is None else (left, None)
            if len(rows) == 0:  # the block is done (read with the rows: one device sync, not two)
                break
            xin = x
            if gen.cfg_scale > 0:
                un = x.clone()
                un[:, :m] = mask_id
                xin = torch.cat([x, un], 0)
            reply = yield StepRequest(xin, rows, lo, pick=pick)  # (B', n, V) logits, or the greedy picks
            if isinstance(reply, Picked):
                x0, chosen_prob = reply.tokens, reply.probs  # (B, n): the argmax and its probability, as below
            else:
                logits = reply
                if gen.cfg_scale > 0:
                    cond, unc = logits.chunk(2, 0)
                    logits = unc + (gen.cfg_scale + 1) * (cond - unc)
                logits = suppress_mask(logits, mask_id)
                x0 = add_gumbel_noise(logits, gen.temperature, rng).argmax(-1)  # (B, n)
                chosen_prob = run.scratch.chosen_probabilities(logits, x0)
            if gen.remasking == "low_confidence":
                conf = chosen_prob
            else:
                conf = torch.rand(x0.shape, dtype=torch.float64, device=device, generator=rng)
            conf = still_only(conf, still)
            if gen.threshold is None:
                counts = [schedules[b][j] for b in range(bsz)]
            else:  # parallel decoding: everything above the threshold, at least one per row
                counts = [max(1, int((conf[b] > gen.threshold).sum())) for b in range(bsz)]
            left = yield TopCommit(rows, conf, still, counts, x0, chosen_prob, t0, blk, gen.n_blocks)  # (commits.py)
            j += 1
