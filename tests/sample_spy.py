"""A spy on ``sampling.sample`` for the bench's warm-up tests: which generations a case ran, and how far."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def counting_sample(real: Callable[..., Any], runs: list[tuple[int, int]]) -> Callable[..., Any]:
    """``real`` (``sampling.sample``) that appends, for every generation it runs, (the prompt's length, the
    ``prefill`` and ``step`` events it saw), also when the caller's callback stops it with an exception."""

    def sample(model: Any, prompt: Any, gen: Any, plan: Any, on_event: Callable[[Any], None] | None = None,
               **kwargs: Any) -> Any:
        seen = [0]

        def count(event: Any) -> None:
            seen[0] += event.kind in ("prefill", "step")
            if on_event is not None:
                on_event(event)

        try:
            return real(model, prompt, gen, plan, count, **kwargs)
        finally:
            runs.append((prompt.shape[1], seen[0]))

    return sample
