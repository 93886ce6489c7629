"""Log-likelihood of a continuation under a masked diffusion model: the LLaDA paper's Monte Carlo estimate.

A diffusion LM has no left-to-right factorisation, so ``log p(continuation | context)`` is estimated with the
bound LLaDA evaluates (its paper's conditional likelihood): draw a number of masked tokens ``l`` uniformly from
``1..L`` (``L`` continuation tokens), mask ``l`` continuation positions chosen uniformly, run the bidirectional
forward over ``[context ; partly masked continuation]`` and take ``(L / l) * sum of log p(true token)`` over the
masked positions; the estimate is the mean over ``samples`` draws. It is a lower bound on the log-likelihood
in expectation, and its spread shrinks with more samples.

``is_greedy``: whether one forward with the whole continuation masked puts the highest probability on every
true token (a one-step greedy decode; the sampler's multi-step greedy decode may differ).

The cache policies do not enter: scoring runs the plain forward over the whole sequence.
"""

from __future__ import annotations

from typing import Any

import torch


def continuation_logprob(engine: Any, context: list[int], continuation: list[int], samples: int, batch: int,
                         seed: int) -> tuple[float, bool]:
    """(estimated log-likelihood, one-step greedy) of ``continuation`` after ``context`` (token ids)."""
    length = len(continuation)
    if length == 0:
        return 0.0, True
    room = engine.window - length
    if room <= 0:
        from maskkv_cli.errors import UsageError

        raise UsageError(f"a continuation of {length} tokens does not fit the model's {engine.window}-token window")
    context = context[-room:]  # keep the end of a context that is too long, as left-to-right harness models do
    start = len(context)
    base = torch.tensor(context + continuation, dtype=torch.long)
    target = torch.tensor(continuation, dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)

    whole = base.clone()
    whole[start:] = engine.mask_id
    logits = engine.logits(whole[None])[0, start:].float().cpu()
    greedy = bool((logits.argmax(-1) == target).all())

    total = 0.0
    done = 0
    while done < samples:
        count = min(batch, samples - done)
        rows = base.repeat(count, 1)
        masked_counts = torch.randint(1, length + 1, (count,), generator=gen)
        picks = torch.zeros(count, length, dtype=torch.bool)
        for r in range(count):
            picks[r, torch.randperm(length, generator=gen)[: int(masked_counts[r])]] = True
        rows[:, start:][picks] = engine.mask_id
        logprobs = torch.log_softmax(engine.logits(rows)[:, start:].float().cpu(), dim=-1)
        true = logprobs.gather(-1, target.expand(count, -1)[..., None])[..., 0]  # (count, L)
        per_row = (true * picks).sum(-1) * (length / masked_counts)
        total += float(per_row.sum())
        done += count
    return total / samples, greedy
