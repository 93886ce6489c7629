"""A cell of a task benchmark: one group's prompts under one generation and cache setting (one row of
``bench quality``), and what answering them gives back.

The driver (``bench/quality.py``) plans the cells and scores their answers; whoever answers them (the driver
itself, worker processes or Ray actors, ``batch/``) only needs ``answer_prompts``. Sessions, generation and cache
settings are duck-typed here (``Any``), so this module imports no model code.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["CellAnswer", "CellRunner", "QualityCell", "answer_prompt", "answer_prompts"]


@dataclass(frozen=True)
class CellAnswer:
    """One task's answer with its timings (what a worker sends back; scoring happens where the rows are written)."""

    text: str
    seconds: float
    prefill_s: float | None = None
    notes: tuple[str, ...] = ()
    confidence: tuple[float, float] | None = None  # mean and lowest probability of the answer's tokens


@dataclass(frozen=True)
class QualityCell:
    """One row's work, (task, length) x (policy, budget): its prompts, generation and cache settings."""

    key: str
    group: int
    case: int
    prompts: list[list[int]]
    gen: Any
    cache: Any
    batch_size: int | None = 1  # prompts denoised together (``answer_prompts``); None: as many as fit


CellRunner = Callable[[list[QualityCell]], Iterable[tuple[QualityCell, list[CellAnswer]]]]


def answer_prompt(session: Any, ids: list[int], gen: Any, cache: Any) -> CellAnswer:
    """Answer one prompt greedily, timed."""
    t0 = time.perf_counter()
    answer = session.answer_ids(ids, gen, cache)
    return _cell_answer(answer, time.perf_counter() - t0)


def answer_prompts(session: Any, prompts: list[list[int]], gen: Any, cache: Any,
                   batch_size: int | None = 1) -> list[CellAnswer]:
    """Answer a cell's prompts greedily: one at a time (``batch_size`` 1), else together (``Session.answer_many``,
    up to ``batch_size`` at a time; None: as many as fit by the memory model), each answer the one it gets alone
    and timed as the batch's time shared equally."""
    if batch_size == 1 or len(prompts) <= 1:
        return [answer_prompt(session, ids, gen, cache) for ids in prompts]
    t0 = time.perf_counter()
    lengths = [len(ids) for ids in prompts]
    size, _ = session.batch_size(batch_size, lengths, gen, cache, work_lens=lengths)
    answers = session.answer_many(prompts, gen, cache, size)
    each = (time.perf_counter() - t0) / len(prompts)
    return [_cell_answer(answer, each) for answer in answers]


def _cell_answer(answer: Any, seconds: float) -> CellAnswer:
    stats = getattr(getattr(answer, "result", None), "stats", None)
    conf = getattr(answer, "confidence", None)
    return CellAnswer(answer.text, seconds, None if stats is None else float(stats.prefill_s),
                      tuple(getattr(answer, "notes", None) or ()),
                      None if conf is None else (float(conf.mean), float(conf.min)))
