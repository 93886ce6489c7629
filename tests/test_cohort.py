"""Cohorts (sampling/cohort.py): greedy LLaDA generations that join a stream together step as one object, and each
gets what it gets alone: its tokens, every probability, its steps and its events."""

from __future__ import annotations

import pytest
import torch

import maskkv_cli.sampling.driver as driver
import maskkv_cli.sampling.stream as stream
from maskkv_cli.bench.cases import random_model
from maskkv_cli.engine.plan import CacheConfig, plan_cache
from maskkv_cli.models.config import named_config
from maskkv_cli.sampling import sample
from maskkv_cli.sampling.common import Event
from maskkv_cli.sampling.llada import GenerationConfig
from maskkv_cli.sampling.stream import BatchJob, sample_many, sample_stream

GREEDY = GenerationConfig(gen_length=16, steps=16, block_length=8)


@pytest.fixture(scope="module")
def model():  # type: ignore[no-untyped-def]
    return random_model(named_config("tiny"))


@pytest.fixture
def cohorts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The size of every cohort the stream formed."""
    sizes: list[int] = []
    loop = stream.cohort_loop

    def record(cohort, gen):  # type: ignore[no-untyped-def]
        sizes.append(len(cohort.runs))
        return loop(cohort, gen)

    monkeypatch.setattr(stream, "cohort_loop", record)
    return sizes


def _jobs(model, gens: list[GenerationConfig], kinds: list[CacheConfig] | None = None,  # type: ignore[no-untyped-def]
          listeners: dict[int, object] | None = None) -> list[BatchJob]:
    g = torch.Generator().manual_seed(1)
    kinds = kinds or [CacheConfig("maskkv", 16), CacheConfig("full"), CacheConfig("none"),
                      CacheConfig("maskkv", 16, layer_budgets="online")]
    jobs = []
    for i, gen in enumerate(gens):
        prompt = torch.randint(6, model.config.vocab_size - 100, (1, 30 + 7 * i), generator=g)
        plan = plan_cache(model, kinds[i % len(kinds)], prompt.shape[1], block_length=gen.block_length)
        jobs.append(BatchJob(prompt, gen, plan, (listeners or {}).get(i)))  # type: ignore[arg-type]
    return jobs


def _same_as_alone(model, job: BatchJob, result) -> None:  # type: ignore[no-untyped-def]
    alone = sample(model, job.prompt, job.gen, job.plan)
    assert result.tokens.tolist() == alone.tokens.tolist()
    assert torch.equal(result.token_probs.nan_to_num(-1.0), alone.token_probs.nan_to_num(-1.0))
    assert result.stats.steps_run == alone.stats.steps_run
    assert result.layer_budgets == alone.layer_budgets


def test_greedy_jobs_that_join_together_step_as_one_cohort(model, cohorts: list[int]) -> None:  # type: ignore[no-untyped-def]
    jobs = _jobs(model, [GREEDY] * 8)
    for job, result in zip(jobs, sample_many(model, jobs, 8), strict=True):
        _same_as_alone(model, job, result)
    assert cohorts == [8]


def test_a_cohort_counts_its_sequences_in_the_batch(model, cohorts: list[int],  # type: ignore[no-untyped-def]
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    lanes: list[int] = []
    steps = driver.step_logits

    def count(model, given):  # type: ignore[no-untyped-def]
        lanes.append(len(given))
        return steps(model, given)

    monkeypatch.setattr(driver, "step_logits", count)
    jobs = _jobs(model, [GREEDY] * 7)
    for job, result in zip(jobs, sample_many(model, jobs, 3), strict=True):
        _same_as_alone(model, job, result)
    assert cohorts == [3, 3] and max(lanes) == 3  # the seventh job ran alone, never more than 3 sequences a step


def test_other_settings_run_their_own_loops_beside_a_cohort(model, cohorts: list[int]) -> None:  # type: ignore[no-untyped-def]
    gens = [GREEDY, GenerationConfig(gen_length=16, steps=16, block_length=8, threshold=0.2), GREEDY,
            GenerationConfig(gen_length=16, steps=16, block_length=8, temperature=0.7, seed=3), GREEDY,
            GenerationConfig(gen_length=16, steps=8, block_length=8), GenerationConfig(gen_length=16, steps=8,
                                                                                       block_length=8)]
    jobs = _jobs(model, gens)
    for job, result in zip(jobs, sample_many(model, jobs, 8), strict=True):
        _same_as_alone(model, job, result)
    assert sorted(cohorts) == [2, 3]  # the three of one setting, the two of another; the rest alone


def test_more_steps_than_positions_end_each_block_as_alone(model, cohorts: list[int]) -> None:  # type: ignore[no-untyped-def]
    gen = GenerationConfig(gen_length=8, steps=16, block_length=8)  # 8 steps commit one each; the rest none
    jobs = _jobs(model, [gen] * 3)
    for job, result in zip(jobs, sample_many(model, jobs, 3), strict=True):
        _same_as_alone(model, job, result)
    assert cohorts == [3]


def test_each_member_gets_its_events_and_one_that_fails_leaves_alone(model, cohorts: list[int]) -> None:  # type: ignore[no-untyped-def]
    class Gone(Exception):
        pass

    seen: dict[int, list[tuple[str, int, int, int]]] = {0: [], 2: []}

    def listen(i: int):  # type: ignore[no-untyped-def]
        return lambda e: seen[i].append((e.kind, e.step, e.committed, e.masked_left))

    def stop_at_third_step(event: Event) -> None:
        if event.step == 3:
            raise Gone()

    jobs = _jobs(model, [GREEDY] * 4, listeners={0: listen(0), 1: stop_at_third_step, 2: listen(2)})
    waiting = list(enumerate(jobs))
    outcomes: dict[int, object] = {}
    sample_stream(model, lambda room, wait: [waiting.pop(0) for _ in range(min(room, len(waiting)))], 4,
                  lambda i, result, error: outcomes.__setitem__(i, error if error is not None else result))
    assert cohorts == [4] and isinstance(outcomes[1], Gone)
    for i in (0, 2, 3):
        _same_as_alone(model, jobs[i], outcomes[i])
    for i in (0, 2):
        seen[-1] = []
        sample(model, jobs[i].prompt, GREEDY, jobs[i].plan, listen(-1))
        assert seen[i] == seen[-1] and seen[i][-1][0] == "done"


def test_dream_jobs_form_no_cohort(cohorts: list[int]) -> None:
    dream = random_model(named_config("dream-tiny"))
    jobs = _jobs(dream, [GenerationConfig(gen_length=16, steps=16, block_length=16)] * 3)
    for job, result in zip(jobs, sample_many(dream, jobs, 3), strict=True):
        _same_as_alone(dream, job, result)
    assert cohorts == []
