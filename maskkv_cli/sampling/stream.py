"""Many generations at once: each sequence runs its own loop, their steps share one forward (``driver.py``).

A ``BatchJob`` is one prompt with its generation settings and cache plan. ``sample_stream`` keeps up to
``batch_size`` of them running: every running loop's request goes into the same round of the engine (the prefills
of the jobs that join, of any lengths, in joined runs of up to ``engine.prefill.join_rows`` rows, a longer prompt's
alone; every later step of the families with engine lanes in one shared step), each loop then commits its own
tokens by its own schedule (its own block, its own count per step, its own random generator; the jobs that joined
together write their commits in one pass, ``sampling/commits.py``); a finished job
leaves and the next waiting one takes its place. The greedy LLaDA jobs that join together with the same settings
step as one cohort (``sampling/cohort.py``: one loop, one request, pick and commit for all of them). One job alone is
the same driver with one generation (``sampling.sample``).

Every job's tokens are those it gets alone (tests/test_batched.py). Steps compiled or captured as CUDA graphs, and
every pass of DiffusionGemma (whose family has no engine lanes), run alone, in their turn.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from maskkv_cli.engine.plan import CachePlan
from maskkv_cli.models.protocol import DiffusionLM
from maskkv_cli.runtime.stats import model_devices, one_peak_reading, reset_cuda_peaks, shared_cuda_peak
from maskkv_cli.sampling import SamplerOptions, open_generation
from maskkv_cli.sampling.cohort import Cohort, cohort_key, cohort_loop, steps_alike
from maskkv_cli.sampling.commits import share_slab
from maskkv_cli.sampling.common import Event, GenerationResult
from maskkv_cli.sampling.driver import Generation, Loop, step_round
from maskkv_cli.sampling.llada import GenerationConfig
from maskkv_cli.sampling.picks import Scratch


@dataclass(frozen=True)
class BatchJob:
    """One generation: a prompt (M,) or (1, M), its settings and its cache plan (``engine.plan.plan_cache``)."""

    prompt: Tensor
    gen: GenerationConfig
    plan: CachePlan
    on_event: Callable[[Event], None] | None = None
    options: SamplerOptions | None = None  # its family's own sampler settings; None: the run's


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
    with shared_cuda_peak(model_devices(model)):  # each job's peak: the batch's since it began
        _stream(model, take, batch_size, finish, options if options is not None else SamplerOptions())


def _stream(model: DiffusionLM, take: Take, batch_size: int,
            finish: Callable[[int, GenerationResult | None, BaseException | None], None],
            opts: SamplerOptions) -> None:
    scratch = Scratch()  # the loops' float64 work, one step at a time: one for them all
    active: list[Generation] = []
    while True:
        running = sum(len(gen.run.runs) if isinstance(gen.run, Cohort) else 1 for gen in active)  # sequences
        new = take(batch_size - running, not active)
        if not new and not active:
            return
        if not active:  # none running (a server's stream waits between requests): a fresh peak for those that come
            reset_cuda_peaks(model_devices(model), shared=True)
        opened = []
        for index, job in new:
            prompt = job.prompt if job.prompt.dim() == 2 else job.prompt[None]
            try:
                opened.append((index, *open_generation(model, prompt, job.gen, job.plan, job.on_event,
                                                        job.options if job.options is not None else opts, scratch),
                               job.gen))
            except Exception as exc:  # noqa: BLE001
                finish(index, None, exc)
        share_slab([run for _, run, _, _ in opened])  # before the loops start: their commits can then run together
        active.extend(_generations(model, opened))
        with one_peak_reading():  # the jobs that end in this round report one reading of the peak
            step_round(model, active)
        still: list[Generation] = []
        for gen in active:
            if not gen.done:
                still.append(gen)
            elif isinstance(gen.run, Cohort):
                for index, result, error in gen.run.outcomes(gen.error):
                    finish(index, result, error)
            else:
                finish(gen.index, gen.result, gen.error)
        active = still


def _generations(model: DiffusionLM, opened: list[tuple[int, Any, Loop, GenerationConfig]]) -> list[Generation]:
    """The generations of the jobs that join together: those that step alike with the same settings
    (``cohort.steps_alike``) as one cohort each, where there are two or more; every other one its own loop."""
    together: dict[GenerationConfig, list[tuple[int, Any, Loop, GenerationConfig]]] = {}
    out: list[Generation] = []
    for item in opened:
        index, run, loop, gen = item
        if steps_alike(model, gen, run) and run.slab is not None:
            together.setdefault(cohort_key(gen), []).append(item)
        else:
            out.append(Generation(index, run, loop))
    for group in together.values():
        if len(group) == 1:
            index, run, loop, _ = group[0]
            out.append(Generation(index, run, loop))
            continue
        for _, _, loop, _ in group:
            loop.close()  # not started: each member's own loop is the cohort's now
        cohort = Cohort([index for index, _, _, _ in group], [run for _, run, _, _ in group])
        out.append(Generation(-1, cohort, cohort_loop(cohort, group[0][3])))  # type: ignore[arg-type]
    return out
