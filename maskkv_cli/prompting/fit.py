"""Inputs longer than the model's window: middle truncation (LongBench's rule) or NTK-style RoPE scaling.

RoPE scaling follows LongLLaDA (training-free): multiply the RoPE base by
``lambda = ceil(((T_target / 2pi) ** (d / d_c)) / theta)`` with the critical dimension
``d_c = 2 * ceil((d / 2) * log_theta(T_train / 2pi))`` ("Scaling Laws of RoPE-based Extrapolation").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from maskkv_cli.errors import UsageError

LONG_MODES = ("truncate", "rope-scale")


def middle_halves(ids: Sequence[int], limit: int) -> tuple[list[int], list[int]]:
    """LongBench's middle truncation: the first ``limit // 2`` and the last ``limit - limit // 2`` ids when there
    are more than ``limit``; else all of them and nothing."""
    if len(ids) <= limit:
        return list(ids), []
    head = limit // 2
    return list(ids[:head]), list(ids[len(ids) - (limit - head):])


def middle_cut(ids: Sequence[int], limit: int) -> list[int]:
    """``ids`` with their middle cut so that at most ``limit`` remain (``middle_halves`` joined)."""
    head, tail = middle_halves(ids, limit)
    return head + tail


def critical_dimension(head_dim: int, theta: float, train_len: int) -> int:
    return 2 * math.ceil((head_dim / 2) * math.log(train_len / (2 * math.pi), theta))


def rope_scale_factor(head_dim: int, theta: float, train_len: int, target_len: int) -> int:
    """LongLLaDA's lambda; 1 when the target fits the training window."""
    if target_len <= train_len:
        return 1
    d_c = critical_dimension(head_dim, theta, train_len)
    new_base = (target_len / (2 * math.pi)) ** (head_dim / d_c)
    return max(1, math.ceil(new_base / theta))


@dataclass(frozen=True)
class FittedContext:
    text: str  # the context as it goes into the prompt
    tokens: int  # its length in tokens
    dropped: int  # tokens cut from the middle
    rope_factor: int  # RoPE base multiplier (1 = unchanged)
    rule: str  # one line for the user


def fit_context(tokenizer: Any, context: str, budget: int, mode: str, head_dim: int, theta: float,
                train_len: int, total_len: int | None = None, ids: list[int] | None = None) -> FittedContext:
    """Make ``context`` fit ``budget`` tokens: cut its middle (``truncate``) or keep it and scale RoPE.

    ``ids``: the context's token ids when the caller has them already (they are not encoded again)."""
    if mode not in LONG_MODES:
        raise UsageError(f"--long must be one of {', '.join(LONG_MODES)}, got {mode!r}")
    if ids is None:
        ids = tokenizer.encode(context, add_special_tokens=False)
    n = len(ids)
    if n <= budget:
        return FittedContext(context, n, 0, 1, "")
    if mode == "rope-scale":
        factor = rope_scale_factor(head_dim, theta, train_len, total_len or n)
        return FittedContext(context, n, 0, factor,
                             f"document is {n} tokens, longer than the {train_len}-token window: RoPE base scaled "
                             f"x{factor} (NTK-style, LongLLaDA rule); quality may drop far beyond the window")
    if budget <= 0:
        raise UsageError("the question and answer leave no room for the document in the model's window")
    head_ids, tail_ids = middle_halves(ids, budget)
    head, tail = len(head_ids), len(tail_ids)
    text = tokenizer.decode(head_ids) + "\n...\n" + tokenizer.decode(tail_ids)
    return FittedContext(text, budget, n - budget, 1,
                         f"document is {n} tokens, the window leaves {budget}: kept the first {head} and last "
                         f"{tail} tokens, dropped {n - budget} from the middle (use --long rope-scale to keep all)")
