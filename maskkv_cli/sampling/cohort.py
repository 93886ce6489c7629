"""LLaDA's greedy loop over several sequences at once: the generations that join a stream together with the same
settings step in lockstep, so one loop runs them as one object.

Run one by one, each generation's loop (``llada.py``) costs Python per sequence and step: its request, its lane
handed out, its share of the shared pick, its commit object, two resumptions of its generator. A cohort makes one
request for all of them (``forward.ManyRequest``), is sent one pick over all their rows, commits all of them in one
write (``commits.commit_rows``) and keeps their open positions in one tensor. Each member keeps its own state
(``Denoising``: its sequence in the slab its cohort shares, its forward and cache, its random generator, its step
meter and events, its result), and every number is the one it gets alone: its engine lane is the one its forward
makes alone, the pick works row by row, and the joined top-k ranks each row as the row alone does (tested in
tests/test_batched.py and tests/test_cohort.py).

A cohort takes generations that step alike from start to end: LLaDA's loop (LLaDA, LLaDA-MoE) with one row each,
greedy (temperature 0, no guidance, low-confidence remasking), a fixed number of steps per block (no threshold), the
eager forward, equal lengths and steps, and a mask token the greedy rule can never pick (so that every step
commits as many positions in each member). A member whose own step fails (a progress listener that stops it) leaves
the cohort with its error; the others go on.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import replace

import torch

from maskkv_cli.models.protocol import DiffusionLM
from maskkv_cli.runtime.stats import now
from maskkv_cli.sampling import commits
from maskkv_cli.sampling.common import Denoising, GenerationResult
from maskkv_cli.sampling.forward import ManyRequest, StepRequest
from maskkv_cli.sampling.llada import GenerationConfig, transfer_schedule
from maskkv_cli.sampling.picks import MaskedArgmax, Picked


def steps_alike(model: DiffusionLM, gen: GenerationConfig, run: object) -> bool:
    """Whether the generation ``run`` with settings ``gen`` can step in a cohort (see the module doc)."""
    from maskkv_cli.models.families import family

    mask_id = model.config.mask_token_id
    greedy = gen.temperature == 0 and gen.cfg_scale == 0 and gen.remasking == "low_confidence"
    return (family(model.config.family).sampler == "llada" and isinstance(run, Denoising) and run.x.shape[0] == 1
            and run.x.dtype == torch.long and greedy and gen.threshold is None and run.forward.step_options.eager
            and 0 < mask_id < model.config.vocab_size)


def cohort_key(gen: GenerationConfig) -> GenerationConfig:
    """What the members of one cohort share: their settings but the seed (a greedy loop draws nothing)."""
    return replace(gen, seed=0)


class Cohort:
    """The members' states (one-row ``Denoising`` runs in one slab, ``stream.py`` puts them there), their places in
    the stream (``indices``) and, once the loop ends, each one's result or the error that ended it."""

    def __init__(self, indices: Sequence[int], runs: Sequence[Denoising]) -> None:
        slab = runs[0].slab
        if len(runs) < 2 or slab is None or any(run.slab is not slab for run in runs):
            raise ValueError("a cohort takes two or more one-row generations in one slab")
        self.indices, self.runs = list(indices), list(runs)
        self.scratch = runs[0].scratch  # the float64 work of the shared pick (the stream gives all its loops one)
        self.errors: list[BaseException | None] = [None] * len(runs)
        self.results: list[GenerationResult | None] = [None] * len(runs)

    def result(self) -> None:
        """Each member's result (those that did not fail), once the loop has ended."""
        for g, run in enumerate(self.runs):
            if self.errors[g] is None:
                try:
                    self.results[g] = run.result()
                except Exception as exc:  # noqa: BLE001 - its own failure (its listener's 'done' event)
                    self.errors[g] = exc

    def outcomes(self, error: BaseException | None) -> list[tuple[int, GenerationResult | None,
                                                                    BaseException | None]]:
        """(place in the stream, result, error) of every member; ``error``: the one that ended the whole cohort (a
        failed shared forward), for the members that had not failed on their own."""
        out: list[tuple[int, GenerationResult | None, BaseException | None]] = []
        for i, result, own in zip(self.indices, self.results, self.errors, strict=True):
            failed = own if own is not None else error
            out.append((i, None if failed is not None else result, failed))
        return out


def cohort_loop(cohort: Cohort, gen: GenerationConfig) -> Generator[ManyRequest, Picked, None]:
    """LLaDA's greedy loop (``llada.llada_loop``) over every member of ``cohort`` at once: yields each step's
    ``ManyRequest`` and is sent the step's picks (G, n) of the members still running."""
    runs = cohort.runs
    live = list(range(len(runs)))  # the members still running
    device = runs[0].device
    pick = MaskedArgmax(runs[0].mask_id)
    offsets = commits.slab_offsets(runs)  # (G, 1) each: where each member's response starts in the slab
    for blk in range(gen.n_blocks):
        lo, hi = blk * gen.block_length, (blk + 1) * gen.block_length
        # every member's block is all masks when it starts, so all follow one schedule and commit as many a step
        schedule = transfer_schedule(gen.block_length, gen.steps_per_block)
        rows = torch.arange(lo, hi, device=device).repeat(len(live), 1)  # (G, n) each member's open positions
        for k in schedule:
            if not live:
                return
            if rows.shape[1] == 0:  # the block is done (more steps than positions: the last steps commit none)
                break
            t0 = now(device)
            picked = yield ManyRequest(tuple(StepRequest(runs[g].x, rows[i], lo, pick=pick)
                                             for i, g in enumerate(live)),
                                       tuple(runs[g].forward for g in live), pick)
            k = min(k, rows.shape[1])
            if k:
                left = commits.commit_rows([runs[g] for g in live], rows, picked.probs, picked.tokens,
                                           picked.probs, k, offsets)
                assert left is not None  # the greedy rule never picks the mask token (``steps_alike``)
                rows = left
            t1 = now(device)  # the step's end, for every member
            still: list[int] = []
            for i, g in enumerate(live):
                try:
                    runs[g].meter.step(t0, runs[g].x, k, blk, gen.n_blocks, t1)
                except Exception as exc:  # noqa: BLE001 - the member's own failure: it leaves, the others go on
                    cohort.errors[g] = exc
                    continue
                still.append(i)
            if len(still) < len(live):
                live = [live[i] for i in still]
                rows, offsets = rows[still], (offsets[0][still], offsets[1][still])
