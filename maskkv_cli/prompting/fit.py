"""Inputs longer than the model's window: read in parts (overlapping windows, each asked the question: the default
of ``ask``), middle truncation (LongBench's rule) or NTK-style RoPE scaling; and what of the text was read.

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
from maskkv_cli.prompting.chat import text_ids

LONG_MODES = ("parts", "truncate", "rope-scale")
DEFAULT_LONG = "parts"  # ``ask`` and ``batch`` read the whole document unless told to cut or scale it
# Tokens each part of a long document shares with the next (``--long parts``): a fact cut by one part's edge is
# whole in the next. Chosen on the embedded model (scripts/parts_reading.py, sample A; docs/evaluation.md).
PART_OVERLAP = 128


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


def unscaled_reach(head_dim: int, theta: float, train_len: int) -> int:
    """The sequence length up to which ``rope_scale_factor`` keeps the factor 1: where its new base reaches
    ``theta``."""
    return math.floor(2 * math.pi * theta ** (critical_dimension(head_dim, theta, train_len) / head_dim))


def part_windows(n: int, size: int, overlap: int) -> list[tuple[int, int]]:
    """Token windows ``[start, end)`` of ``size`` tokens over ``n`` tokens, each sharing ``overlap`` with the next;
    the last ends at ``n`` (it may share more with the one before). One window when ``n <= size``."""
    if size <= 0:
        raise UsageError("the question and answer leave no room for the document in the model's window")
    if n <= size:
        return [(0, n)]
    step = max(1, size - max(0, min(overlap, size - 1)))
    starts = list(range(0, n - size, step))
    return [(a, a + size) for a in starts] + [(n - size, n)]


Span = tuple[int, int]  # characters [start, end) of a context


@dataclass(frozen=True)
class FittedContext:
    """How a context went into the prompt, and what of it the model read."""

    text: str  # the context as it goes into the prompt
    tokens: int  # its length in tokens
    dropped: int  # tokens cut from the middle
    rope_factor: int  # RoPE base multiplier (1 = unchanged)
    rule: str  # one line for the user
    read: tuple[Span, ...] = ()  # the characters of the whole context the model read (all parts together)
    chars: int = 0  # characters of the whole context
    parts: int = 1  # prompts the context was read in (``parts``: more than one when it is longer than the window)
    source: tuple[Span, ...] = ()  # the characters the answer came from: the part(s) that gave it, else ``read``
    mode: str = "whole"  # whole (it fits), parts, truncate or rope-scale

    @property
    def complete(self) -> bool:
        """Whether every character of the context was read."""
        covered = 0
        for start, end in sorted(self.read):
            if start > covered:
                return False
            covered = max(covered, end)
        return covered >= self.chars


PARTS_HINT = "the default --long parts reads it all"  # how a truncated document's note names the whole reading
SEAM_TOKENS = 4  # tokens decoded on each side of a boundary to see that the text splits there (a character's bytes)
SEAM_SEARCH = 32  # tokens looked back from a position for a boundary where the text splits


def char_offset(tokenizer: Any, ids: Sequence[int], at: int, text: str) -> int:
    """Where token ``at`` of ``ids`` (the encoding of ``text``) starts in ``text``: the length of the decoded
    tokens before it (exact for byte-level tokenizers, whose decoding gives the text back), within the text."""
    return min(len(text), len(tokenizer.decode(list(ids[:at])))) if at > 0 else 0


def char_offsets(tokenizer: Any, ids: Sequence[int], positions: Sequence[int], text: str) -> list[int]:
    """``char_offset`` of each of ``positions`` (ascending), decoding each token about once instead of the whole
    prefix per position (quadratic in the document: minutes for a book's windows). The decoded length up to a
    position is that up to an anchor plus that of the tokens from the anchor on, an anchor being a boundary where
    the decoding splits: the tokens around it decoded together give its two sides' texts joined (no character's
    bytes, no space a decoder drops at a start, no spacing cleaned up across it). After each position the anchor
    moves to the nearest such boundary at or before it."""
    out: list[int] = []
    anchor, before = 0, 0  # the anchor, and the decoded length of the tokens before it
    for at in positions:
        if at < anchor:
            raise ValueError(f"positions must ascend: {at} after {anchor}")
        out.append(min(len(text), before + (len(tokenizer.decode(list(ids[anchor:at]))) if at > anchor else 0)))
        for split in range(at, max(anchor, at - SEAM_SEARCH), -1):
            if _splits_at(tokenizer, ids, split):
                before += len(tokenizer.decode(list(ids[anchor:split])))
                anchor = split
                break
    return out


def _splits_at(tokenizer: Any, ids: Sequence[int], at: int) -> bool:
    """Whether decoding ``ids`` splits at token ``at``: the tokens around it decoded together are their two sides
    decoded apart, joined."""
    left, right = list(ids[max(0, at - SEAM_TOKENS) : at]), list(ids[at : at + SEAM_TOKENS])
    return tokenizer.decode(left + right) == tokenizer.decode(left) + tokenizer.decode(right)


def check_long(mode: str) -> str:
    """``mode`` when it is one of ``LONG_MODES`` (what ``--long`` takes)."""
    if mode not in LONG_MODES:
        raise UsageError(f"--long must be one of {', '.join(LONG_MODES)}, got {mode!r}")
    return mode


def fit_context(tokenizer: Any, context: str, budget: int, mode: str, head_dim: int, theta: float,
                train_len: int, total_len: int | None = None, ids: list[int] | None = None) -> FittedContext:
    """Make ``context`` fit ``budget`` tokens: cut its middle (``truncate``) or keep it and scale RoPE.

    ``ids``: the context's token ids when the caller has them already (they are not encoded again)."""
    check_long(mode)
    if ids is None:
        ids = text_ids(tokenizer, context)
    n, chars = len(ids), len(context)
    whole = ((0, chars),)
    if n <= budget:
        return FittedContext(context, n, 0, 1, "", whole, chars, source=whole)
    if mode == "rope-scale":
        factor = rope_scale_factor(head_dim, theta, train_len, total_len or n)
        scaled = (f"RoPE base scaled x{factor} (NTK-style, LongLLaDA rule)" if factor > 1 else
                  f"kept whole with RoPE unscaled (LongLLaDA's rule scales it from about "
                  f"{unscaled_reach(head_dim, theta, train_len):,} positions on for this model)")
        return FittedContext(context, n, 0, factor,
                             f"document is {n} tokens, longer than the {train_len}-token window: {scaled}; quality "
                             "may drop far beyond the window", whole, chars, source=whole, mode=mode)
    if mode == "parts":
        raise ValueError("a context longer than the window is read in parts by pipeline.ask, not fitted")
    if budget <= 0:
        raise UsageError("the question and answer leave no room for the document in the model's window")
    head_ids, tail_ids = middle_halves(ids, budget)
    head, tail = len(head_ids), len(tail_ids)
    head_text, tail_text = tokenizer.decode(head_ids), tokenizer.decode(tail_ids)
    read = ((0, min(len(head_text), chars)), (max(0, chars - len(tail_text)), chars))
    return FittedContext(head_text + "\n...\n" + tail_text, budget, n - budget, 1,
                         f"document is {n} tokens, the window leaves {budget}: kept the first {head} and last "
                         f"{tail} tokens, dropped {n - budget} from the middle ({PARTS_HINT})", read, chars,
                         source=read, mode=mode)
