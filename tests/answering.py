"""Test helper: answers that tests replace one prompt at a time, also when the code under test batches."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest

from maskkv_cli.app.session import Session


def replace_answers(monkeypatch: pytest.MonkeyPatch, answer_ids: Callable[..., Any]) -> None:
    """``Session.answer_ids`` becomes ``answer_ids``, and ``Session.answer_many`` calls it prompt by prompt (a
    batched run's answers are by contract the ones each prompt gets alone: tests/test_batched.py)."""

    def answer_many(self: Session, prompts: Sequence[list[int]], gen: Any, cache: Any, batch_size: int,
                    on_answer: Callable[[int, Any], None] | None = None) -> list[Any]:
        answers = []
        for i, ids in enumerate(prompts):
            answers.append(answer_ids(self, list(ids), gen, cache))
            if on_answer is not None:
                on_answer(i, answers[-1])
        return answers

    monkeypatch.setattr(Session, "answer_ids", answer_ids)
    monkeypatch.setattr(Session, "answer_many", answer_many)
