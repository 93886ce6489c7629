"""Many generations at once: each sequence runs its own loop, their steps share one forward.

A ``BatchJob`` is one prompt with its generation settings and cache plan. ``sample_many`` keeps up to
``batch_size`` of them active. The jobs that join together run their step 0 (the prefill: each its own votes,
budgets and selection) as one shared prefill of prompts of any lengths; after that every loop's requests are
gathered with the other active loops' and run as one forward (``engine/batched.py``): cached steps of every lane
whose response has the same length, no-cache steps of sequences of the same length. Each loop then commits its own
tokens by its own schedule (its own block, its own count per step, its own random generator); a finished job
leaves and the next waiting one takes its place.

Every job's tokens are those it gets alone (tests/test_batched.py). Loops that cannot share a step run alone, in
their turn: LLaDA2's block-causal loop, and steps compiled or captured as CUDA graphs.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from maskkv_cli.engine.batched import CachedLane, plain_logits_many, prefill_many, response_logits_many
from maskkv_cli.engine.plan import CachePlan
from maskkv_cli.models.families import family
from maskkv_cli.models.protocol import DiffusionLM
from maskkv_cli.sampling.common import Denoising, Event, GenerationResult, Loop, StepRequest
from maskkv_cli.sampling.dream import dream_config, dream_loop, dream_run
from maskkv_cli.sampling.llada import GenerationConfig, llada_loop, llada_run

SHARED_LOOPS = ("llada", "dream")  # sampler families whose steps can share a forward


@dataclass(frozen=True)
class BatchJob:
    """One generation: a prompt (M,) or (1, M), its settings and its cache plan (``engine.plan.plan_cache``)."""

    prompt: Tensor
    gen: GenerationConfig
    plan: CachePlan
    on_event: Callable[[Event], None] | None = None


class Lane:
    """One active job: its generation state, its loop, and the loop's pending request."""

    def __init__(self, index: int, run: Denoising, loop: Loop) -> None:
        self.index, self.run, self.loop = index, run, loop
        self.request: StepRequest | None = None
        self.result: GenerationResult | None = None
        self.advance(None)

    def advance(self, logits: Tensor | None) -> None:
        """Send the loop its logits (None: start it); keep its next request, or its result when it ends."""
        try:
            self.request = next(self.loop) if logits is None else self.loop.send(logits)
        except StopIteration:
            self.request = None
            self.result = self.run.result()

    def step_alone(self) -> None:
        assert self.request is not None
        req = self.request
        self.advance(self.run.forward(req.x, req.rows, req.block_start))

    @property
    def done(self) -> bool:
        return self.request is None

    def group(self) -> tuple[str, int] | None:
        """Lanes with the same key share a forward; None: this step runs alone."""
        forward, req = self.run.forward, self.request
        assert req is not None
        if forward.steps_alone:
            return None
        if not forward.policy.uses_cache:
            return ("plain", req.x.shape[1])
        return ("cached", req.x.shape[1] - forward.split)


def _open(model: DiffusionLM, index: int, job: BatchJob, options: object) -> Lane | None:
    """A lane for a job whose loop can share steps; None for one that runs alone."""
    sampler = family(model.config.family).sampler
    if sampler not in SHARED_LOOPS or not job.plan.step_options.eager:
        return None
    if sampler == "llada":
        run = llada_run(model, job.prompt, job.gen, job.plan, job.on_event)
        return Lane(index, run, llada_loop(run, job.gen))
    dream_gen = dream_config(job.gen, options.dream)  # type: ignore[attr-defined]
    run = dream_run(model, job.prompt, dream_gen, job.plan, job.on_event)
    return Lane(index, run, dream_loop(run, dream_gen))


def _step_together(model: DiffusionLM, kind: str, lanes: list[Lane]) -> None:
    requests = [lane.request for lane in lanes]
    if kind == "cached":
        inputs = []
        for lane, req in zip(lanes, requests, strict=True):
            fwd = lane.run.forward
            assert req is not None and fwd.cache is not None
            inputs.append(CachedLane(fwd.cache, req.x[:, fwd.split :], fwd.response_rows(req.rows)))
        logits = response_logits_many(model, inputs)
    else:
        logits = plain_logits_many(model, [r.x for r in requests if r is not None],  # type: ignore[union-attr]
                                   [lane.run.forward.plain_rows(r.rows) for lane, r in zip(lanes, requests,
                                                                                          strict=True)
                                    if r is not None])
    for lane, out in zip(lanes, logits, strict=True):
        assert lane.request is not None
        lane.advance(out.to(lane.request.x.device))


def _prefill_together(model: DiffusionLM, lanes: list[Lane]) -> None:
    """Step 0 of the lanes that can share it, as one prefill (``engine.batched.prefill_many``)."""
    shared = []
    for lane in lanes:
        req = lane.request
        prefill = None if req is None else lane.run.forward.prefill_lane(req.x, req.rows)
        if prefill is not None:
            shared.append((lane, prefill))
    if len(shared) < 2:
        return
    for (lane, _), (logits, cache, records) in zip(shared, prefill_many(model, [p for _, p in shared]), strict=True):
        lane.run.forward.install(cache, records)
        assert lane.request is not None
        lane.advance(logits.to(lane.request.x.device))


@torch.no_grad()
def sample_many(model: DiffusionLM, jobs: Sequence[BatchJob], batch_size: int, options: object | None = None,
                on_result: Callable[[int, GenerationResult], None] | None = None) -> list[GenerationResult]:
    """Generate every job, up to ``batch_size`` of them stepping together; results in the jobs' order.

    ``options``: the families' own sampler settings (``sampling.SamplerOptions``); ``on_result(i, result)`` is
    called as each job finishes (in finishing order)."""
    from maskkv_cli.sampling import SamplerOptions, sample

    opts = options if options is not None else SamplerOptions()
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    results: list[GenerationResult | None] = [None] * len(jobs)

    def finish(index: int, result: GenerationResult) -> None:
        results[index] = result
        if on_result is not None:
            on_result(index, result)

    waiting = deque(range(len(jobs)))
    active: list[Lane] = []
    while waiting or active:
        joined: list[Lane] = []
        while waiting and len(active) + len(joined) < batch_size:
            index = waiting.popleft()
            job = jobs[index]
            lane = _open(model, index, job, opts)
            if lane is None:  # a loop that cannot share steps runs whole, alone
                finish(index, sample(model, job.prompt if job.prompt.dim() == 2 else job.prompt[None], job.gen,
                                     job.plan, job.on_event, opts.dream, opts.llada2))  # type: ignore[attr-defined]
            elif lane.done:
                finish(index, lane.result)  # type: ignore[arg-type]
            else:
                joined.append(lane)
        _prefill_together(model, joined)
        for lane in joined:
            while not lane.done and lane.group() is None:  # any other step that must run alone
                lane.step_alone()
            if lane.done:
                finish(lane.index, lane.result)  # type: ignore[arg-type]
            else:
                active.append(lane)
        groups: dict[tuple[str, int] | None, list[Lane]] = defaultdict(list)
        for lane in active:
            groups[lane.group()].append(lane)
        for key, lanes in groups.items():
            if key is None:
                for lane in lanes:
                    lane.step_alone()
            else:
                _step_together(model, key[0], lanes)
        still: list[Lane] = []
        for lane in active:
            if lane.done:
                assert lane.result is not None
                finish(lane.index, lane.result)
            else:
                still.append(lane)
        active = still
    return [r for r in results if r is not None]
