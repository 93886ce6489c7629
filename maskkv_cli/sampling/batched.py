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
from maskkv_cli.models.rows import small_rows
from maskkv_cli.sampling import SamplerOptions, sample
from maskkv_cli.sampling.common import Denoising, Event, GenerationResult, Loop, Scratch, StepRequest
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
    options: SamplerOptions | None = None  # its family's own sampler settings; None: the run's


class Lane:
    """One active job: its generation state, its loop, and the loop's pending request. An error raised by the
    loop (a progress callback that stops its generation, say) ends this lane only: ``error`` holds it."""

    def __init__(self, index: int, run: Denoising, loop: Loop) -> None:
        self.index, self.run, self.loop = index, run, loop
        self.request: StepRequest | None = None
        self.result: GenerationResult | None = None
        self.error: BaseException | None = None
        self.advance(None)

    def advance(self, logits: Tensor | None) -> None:
        """Send the loop its logits (None: start it); keep its next request, or its result when it ends."""
        try:
            self.request = next(self.loop) if logits is None else self.loop.send(logits)
        except StopIteration:
            self.request = None
            self.result = self.run.result()
        except Exception as exc:  # noqa: BLE001 - the lane's own failure, handed to whoever waits for it
            self.fail(exc)

    def fail(self, exc: BaseException) -> None:
        self.request, self.error = None, exc
        self.loop.close()

    def step_alone(self) -> None:
        assert self.request is not None
        req = self.request
        try:
            logits = self.run.forward(req.x, req.rows, req.block_start)
        except Exception as exc:  # noqa: BLE001
            self.fail(exc)
            return
        self.advance(logits)

    @property
    def done(self) -> bool:
        return self.request is None

    def group(self) -> tuple[str, int] | None:
        """Lanes with the same key share a forward; None: this step runs alone."""
        forward, req = self.run.forward, self.request
        assert req is not None
        if forward.steps_alone:
            return None
        length = req.x.shape[1] if not forward.policy.uses_cache else req.x.shape[1] - forward.split
        if req.x.shape[0] * length <= small_rows(str(req.x.device), forward.model.dtype):  # the few-rows kernel
            return None
        return ("plain" if not forward.policy.uses_cache else "cached", length)


def _open(model: DiffusionLM, index: int, job: BatchJob, options: SamplerOptions, scratch: Scratch) -> Lane | None:
    """A lane for a job whose loop can share steps (and the stream's ``scratch``); None for one that runs alone."""
    sampler = family(model.config.family).sampler
    if sampler not in SHARED_LOOPS or not job.plan.step_options.eager:
        return None
    if sampler == "llada":
        run = llada_run(model, job.prompt, job.gen, job.plan, job.on_event)
        run.scratch = scratch
        return Lane(index, run, llada_loop(run, job.gen))
    dream_gen = dream_config(job.gen, options.dream)
    run = dream_run(model, job.prompt, dream_gen, job.plan, job.on_event)
    return Lane(index, run, dream_loop(run, dream_gen))


def _step_together(model: DiffusionLM, kind: str, lanes: list[Lane]) -> None:
    try:
        logits = _shared_step(model, kind, lanes)
    except Exception as exc:  # noqa: BLE001 - a failed shared forward (out of memory, ...) ends its lanes
        for lane in lanes:
            lane.fail(exc)
        return
    for lane, out in zip(lanes, logits, strict=True):
        assert lane.request is not None
        lane.advance(out.to(lane.request.x.device))


def _shared_step(model: DiffusionLM, kind: str, lanes: list[Lane]) -> list[Tensor]:
    requests = [lane.request for lane in lanes if lane.request is not None]
    forwards = [lane.run.forward for lane in lanes]
    if kind == "plain":
        return plain_logits_many(model, [r.x for r in requests],
                                 [fwd.plain_rows(r.rows) for fwd, r in zip(forwards, requests, strict=True)])
    inputs = []
    for fwd, req in zip(forwards, requests, strict=True):
        assert fwd.cache is not None
        inputs.append(CachedLane(fwd.cache, req.x[:, fwd.split :], fwd.response_rows(req.rows)))
    return response_logits_many(model, inputs)


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
    try:
        outs = prefill_many(model, [p for _, p in shared])
    except Exception as exc:  # noqa: BLE001
        for lane, _ in shared:
            lane.fail(exc)
        return
    for (lane, _), (logits, cache, records) in zip(shared, outs, strict=True):
        lane.run.forward.install(cache, records)
        assert lane.request is not None
        lane.advance(logits.to(lane.request.x.device))


Take = Callable[[int, bool], list[tuple[int, BatchJob]]]  # (room, wait) -> up to room new (id, job) pairs


@torch.no_grad()
def sample_many(model: DiffusionLM, jobs: Sequence[BatchJob], batch_size: int, options: SamplerOptions | None = None,
                on_result: Callable[[int, GenerationResult], None] | None = None) -> list[GenerationResult]:
    """Generate every job, up to ``batch_size`` of them stepping together; results in the jobs' order.

    ``options``: the families' own sampler settings; ``on_result(i, result)`` is
    called as each job finishes (in finishing order). The first job that fails raises its error (after the jobs
    stepping with it have finished)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    results: list[GenerationResult | None] = [None] * len(jobs)
    errors: list[BaseException] = []
    waiting = deque(enumerate(jobs))

    def take(room: int, wait: bool) -> list[tuple[int, BatchJob]]:
        return [waiting.popleft() for _ in range(min(room, len(waiting)))] if not errors else []

    def finish(index: int, result: GenerationResult | None, error: BaseException | None) -> None:
        if error is not None:
            errors.append(error)
            return
        results[index] = result
        if on_result is not None and result is not None:
            on_result(index, result)

    sample_stream(model, take, batch_size, finish, options)
    if errors:
        raise errors[0]
    return [r for r in results if r is not None]


@torch.no_grad()
def sample_stream(model: DiffusionLM, take: Take, batch_size: int,
                  finish: Callable[[int, GenerationResult | None, BaseException | None], None],
                  options: SamplerOptions | None = None) -> None:
    """Continuous batching: jobs come from ``take(room, wait)`` (up to ``room`` new ones; ``wait``: nothing is
    running, so it may block until there is work; an empty list then ends the stream), join the running ones as
    they come and leave when done; ``finish(id, result, error)`` is called once per job, with its result or the
    error that ended it (only that job's: the others go on)."""
    opts = options if options is not None else SamplerOptions()
    scratch = Scratch()  # the loops' float64 work, one step at a time: one for them all
    active: list[Lane] = []
    while True:
        new = take(batch_size - len(active), not active)
        if not new and not active:
            return
        joined: list[Lane] = []
        for index, job in new:
            own = job.options if job.options is not None else opts
            try:
                lane = _open(model, index, job, own, scratch)
                if lane is None:  # a loop that cannot share steps runs whole, alone
                    prompt = job.prompt if job.prompt.dim() == 2 else job.prompt[None]
                    finish(index, sample(model, prompt, job.gen, job.plan, job.on_event, own.dream, own.llada2), None)
                    continue
            except Exception as exc:  # noqa: BLE001
                finish(index, None, exc)
                continue
            joined.append(lane)
        _prefill_together(model, [lane for lane in joined if not lane.done])
        for lane in joined:
            while not lane.done and lane.group() is None:  # any other step that must run alone
                lane.step_alone()
            active.append(lane)
        groups: dict[tuple[str, int] | None, list[Lane]] = defaultdict(list)
        for lane in active:
            if not lane.done:
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
                finish(lane.index, lane.result, lane.error)
            else:
                still.append(lane)
        active = still
