"""The sampler step shared by a batch: each row's chosen token and its probability, one pass over every row.

A greedy loop (temperature 0, no guidance) needs of a step's logits only the most likely token of each row and
that token's probability. It says so in its request (``StepRequest.pick``: one of the kinds below, which holds the
family's exact rule), and the driver (``sampling/driver.py``) answers with a ``Picked`` instead of the logits: for
every lane of a round whose loops ask the same kind it runs the rule once over the engine's joined logits (one
softmax, one argmax over all their rows), then hands each loop its rows. Each rule works row by row (a row's
softmax and argmax never read another row), so a loop gets the numbers it would compute from its own logits alone
(tested bitwise in tests/test_picks.py); the sharing saves the per-lane calls, not any arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

SCRATCH_BYTES = 4 << 20  # the float64 rows ``Scratch`` works on at once: 4 rows of a 126k-token vocabulary


class Scratch:
    """Memory the samplers reuse from step to step for their full-vocabulary float64 work.

    ``chosen_probabilities`` is the reference sampler's ``logits.to(torch.float64).softmax(-1)`` at the chosen
    tokens: a fresh float64 copy and softmax of every row, tens of MiB per step for a 126k-token vocabulary. Blocks
    that large come from their own mappings (``allocator.py``) and the kernel zeroes each page on first touch: on
    the CPU that costs more than the softmax itself (about 9 ms of a 16-row step). On the CPU the rows are worked
    through a few at a time in two reused buffers of ``SCRATCH_BYTES`` each (the softmax of a row does not depend on
    the rows beside it, so the numbers are the same); on other devices the plain expression runs. Loops stepping
    together (``stream.py``) share one scratch: each finishes its step before the next one starts."""

    def __init__(self) -> None:
        self._buffers: dict[str, Tensor] = {}

    def _buffer(self, name: str, rows: int, width: int, device: torch.device) -> Tensor:
        size = rows * width
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < size or buf.device != device:
            buf = torch.empty(size, dtype=torch.float64, device=device)
            self._buffers[name] = buf
        return buf[:size].view(rows, width)

    def chosen_probabilities(self, logits: Tensor, chosen: Tensor) -> Tensor:
        """``logits.to(torch.float64).softmax(-1).gather(-1, chosen[..., None]).squeeze(-1)``: the probability of
        token ``chosen`` (...) under logits (..., V), as float64."""
        if logits.device.type != "cpu":
            return logits.to(torch.float64).softmax(-1).gather(-1, chosen[..., None]).squeeze(-1)
        width = logits.shape[-1]
        flat, index = logits.reshape(-1, width), chosen.reshape(-1, 1)
        out = torch.empty(flat.shape[0], dtype=torch.float64)
        step = max(1, SCRATCH_BYTES // (8 * width))
        for start in range(0, flat.shape[0], step):
            stop = min(flat.shape[0], start + step)
            wide = self._buffer("wide", stop - start, width, flat.device)
            wide.copy_(flat[start:stop])
            probs = torch.softmax(wide, -1, out=self._buffer("probs", stop - start, width, flat.device))
            out[start:stop] = probs.gather(-1, index[start:stop]).squeeze(-1)
        return out.view(chosen.shape)


def suppress_mask(logits: Tensor, mask_id: int) -> Tensor:
    """Never "commit" the mask token itself (random or tiny models can predict it): its logit becomes -inf."""
    if mask_id < logits.shape[-1]:
        logits[..., mask_id] = float("-inf")
    return logits


class Picked(NamedTuple):
    """A step's picks for one loop: ``tokens`` (B, n) the chosen token of each row, ``probs`` (B, n) its
    probability (the family's dtype: float64 for LLaDA and Dream, float32 for LLaDA2), and, for a rule that has
    one, each row's ``confidence`` (B, n) (Dream's entropy or margin)."""

    tokens: Tensor
    probs: Tensor
    confidence: Tensor | None = None

    def rows(self, start: int, stop: int, shape: tuple[int, ...]) -> Picked:
        """Rows [start, stop) of flat picks, shaped ``shape`` (one lane's share of a joined pick)."""
        conf = None if self.confidence is None else self.confidence[start:stop].view(shape)
        return Picked(self.tokens[start:stop].view(shape), self.probs[start:stop].view(shape), conf)

    def to(self, device: torch.device) -> Picked:
        if self.tokens.device == device:
            return self
        return Picked(*(None if t is None else t.to(device) for t in self))


@dataclass(frozen=True)
class Pick:
    """A family's greedy rule over logits (N, V): its ``Picked`` (N,). Kinds that compare equal run together."""

    def __call__(self, logits: Tensor, scratch: Scratch) -> Picked:
        raise NotImplementedError


@dataclass(frozen=True)
class MaskedArgmax(Pick):
    """LLaDA's (and LLaDA-MoE's) greedy step: the mask token's logit -inf (``suppress_mask``), the argmax, and the
    chosen token's probability under the float64 softmax (``Scratch.chosen_probabilities``)."""

    mask_id: int

    def __call__(self, logits: Tensor, scratch: Scratch) -> Picked:
        logits = suppress_mask(logits, self.mask_id)
        tokens = logits.argmax(-1)
        return Picked(tokens, scratch.chosen_probabilities(logits, tokens))


def softmax_max(logits: Tensor) -> tuple[Tensor, Tensor]:
    """(tokens, probabilities) of logits (..., V): each row's most likely token under the float32 softmax and its
    probability (LLaDA2's greedy choice; the mask token is not suppressed)."""
    probs, tokens = logits.float().softmax(-1).max(-1)
    return tokens, probs


@dataclass(frozen=True)
class SoftmaxMax(Pick):
    """LLaDA2's greedy step (``softmax_max``) as a rule the batch shares."""

    def __call__(self, logits: Tensor, scratch: Scratch) -> Picked:
        return Picked(*softmax_max(logits))


def pick_lanes(pick: Pick, joined: Tensor, sizes: list[int], shapes: list[tuple[int, ...]],
               scratch: Scratch) -> list[Picked]:
    """``pick`` over the rows of several lanes at once: ``joined`` (..., V) holds their logits back to back,
    ``sizes`` rows each (in order), each lane's picks shaped ``shapes[i]``."""
    flat = pick(joined.reshape(-1, joined.shape[-1]), scratch)
    if all(len(shape) == 2 and shape[0] == 1 for shape in shapes):  # one-row lanes: each part a (1, n) split
        parts = [None if t is None else t.view(1, -1).split(sizes, 1) for t in flat]
        return [Picked(*(None if p is None else p[i] for p in parts)) for i in range(len(sizes))]
    out, start = [], 0
    for size, shape in zip(sizes, shapes, strict=True):
        out.append(flat.rows(start, start + size, shape))
        start += size
    return out


def pick_one(pick: Pick, logits: Tensor, scratch: Scratch) -> Picked:
    """``pick`` over one lane's logits (B, n, V)."""
    (one,) = pick_lanes(pick, logits, [logits.shape[0] * logits.shape[1]], [tuple(logits.shape[:-1])], scratch)
    return one


def joined_span(parts: list[Tensor]) -> Tensor | None:
    """The rows of every tensor of ``parts`` as one (N, V) view, when they lie back to back in one storage (the
    engine's joined logits split per lane, in order); None otherwise."""
    first = parts[0]
    width = first.shape[-1]
    storage, offset = first.untyped_storage().data_ptr(), first.storage_offset()
    for p in parts:
        if p.shape[-1] != width or not p.is_contiguous() or p.dtype != first.dtype or p.device != first.device \
                or p.untyped_storage().data_ptr() != storage or p.storage_offset() != offset:
            return None
        offset += p.numel()
    rows = (offset - first.storage_offset()) // width
    return first.as_strided((rows, width), (width, 1), first.storage_offset())
