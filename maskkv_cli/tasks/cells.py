"""A cell of a task benchmark: one group's prompts under one generation and cache setting (one row of
``bench quality``), and what answering them gives back.

The driver (``bench/quality.py``) plans the cells and scores their answers; whoever answers them (the driver
itself, worker processes or Ray actors, ``batch/``) only needs ``answer_prompt``. Sessions, generation and cache
settings are duck-typed here (``Any``), so this module imports no model code.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["CellAnswer", "CellRunner", "QualityCell", "answer_prompt"]


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


CellRunner = Callable[[list[QualityCell]], Iterable[tuple[QualityCell, list[CellAnswer]]]]


def answer_prompt(session: Any, ids: list[int], gen: Any, cache: Any) -> CellAnswer:
    """Answer one prompt greedily, timed."""
    t0 = time.perf_counter()
    answer = session.answer_ids(ids, gen, cache)
    seconds = time.perf_counter() - t0
    stats = getattr(getattr(answer, "result", None), "stats", None)
    conf = getattr(answer, "confidence", None)
    return CellAnswer(answer.text, seconds, None if stats is None else float(stats.prefill_s),
                      tuple(getattr(answer, "notes", None) or ()),
                      None if conf is None else (float(conf.mean), float(conf.min)))
