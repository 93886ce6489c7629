"""Lanes: what one sequence asks of a forward pass, so that one question and many run the same engine.

A lane is one generation's share of a step: its tokens, the rows whose logits it needs, where its positions
start, its RoPE scaling, and either its prompt cache (a later step) or what to do with each layer's keys and
values (step 0, the prefill). ``engine/prefill.py`` and ``engine/step.py`` take a list of lanes; one question is a
list of one. Every lane's rows run back to back through everything that carries weights (each weight read once per
step for the whole batch; ``models/rows.py`` keeps every product's rows the numbers they are alone), and attention,
votes and selection run lane by lane over that lane's own rows and cache, as the lane alone would run them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING
from weakref import WeakKeyDictionary

import torch
from torch import Tensor

from maskkv_cli.kv.cache import PromptCache
from maskkv_cli.kv.prefix import PrefixStore
from maskkv_cli.models.base import Rope
from maskkv_cli.models.protocol import DiffusionLM

if TYPE_CHECKING:
    from maskkv_cli.engine.selection import LayerSink


def block_causal_visible(start: int, stop: int, total: int, block: int, device: torch.device | str) -> Tensor:
    """Bool (stop - start, total): query position i sees key position j iff j's block is not after i's (blocks of
    ``block`` positions counted from 0: a block sees itself and every earlier block)."""
    queries = torch.arange(start, stop, device=device) // block
    keys = torch.arange(total, device=device) // block
    return keys[None, :] <= queries[:, None]


@dataclass(frozen=True)
class Layout:
    """A prefill sequence laid out otherwise than ``[prompt ; masks]`` over a bidirectional model: a block-causal
    model's first response block, whose start ``prompt_len`` (the end of the evictable prompt entries) may lie
    inside the prompt."""

    block: int  # attention is block-causal with blocks of this many positions from position 0
    mask_start: int  # the first mask position: the mask queries that vote are [mask_start, T)
    response_slots: int  # the cache's response slot: every block position from ``prompt_len`` on

    def visible(self, total: int, device: torch.device | str) -> Callable[[int, int], Tensor]:
        return lambda start, stop: block_causal_visible(start, stop, total, self.block, device)


@dataclass
class PrefillLane:
    """One sequence's step 0: the sequence ``ids`` (b, T) (``[prompt ; masks]``, or a block-causal model's window),
    the cached prompt segment ``prompt_len``, the positions ``rows`` whose logits it needs, and ``sink``: what
    happens to each layer's keys and values (``engine/selection.py``; None: nothing is kept)."""

    ids: Tensor
    prompt_len: int
    rows: Tensor
    sink: LayerSink | None
    layout: Layout | None = None  # None: bidirectional over [prompt ; masks]
    prefix: PrefixStore | None = None  # its first positions as computed before (they do not run again)
    capture: PrefixStore | None = None  # keep this pass's per-layer inputs, keys, values and shifts in it
    measure: bool = False  # measure each layer's attention shift (the layer importance I(l))
    rope_factor: float = 1.0

    @property
    def first(self) -> int:
        """The first position that runs (after a stored prefix)."""
        return 0 if self.prefix is None else self.prefix.length

    @property
    def mask_start(self) -> int:
        return self.prompt_len if self.layout is None else self.layout.mask_start


@dataclass
class StepLane:
    """One sequence's later step: its rows ``ids`` (b, n) at sequence positions [start, start + n), and the rows
    (r,) of those whose hidden states it needs (none: a block-causal model's finished block, whose keys and values
    are all it writes). With a ``cache`` the rows are response positions [offset, offset + n) of it: they write
    their keys and values there and attend to what the cache's layers show them. Without one the rows are a whole
    sequence attending to themselves (the plain forward: every row through every layer, ``visible`` (n, n) saying
    which rows each one sees, None: all). ``reach``: a cached lane's attention also runs over the next ``reach``
    response slots, masked (``LayerCache.visible``): a block-causal model's finished block, computed as the windows
    after it compute it."""

    ids: Tensor
    rows: Tensor
    start: int
    cache: PromptCache | None = None
    offset: int = 0
    visible: Tensor | None = None
    rope_factor: float = 1.0
    reach: int = 0
    tables: RopeMemo | None = None  # the generation's RoPE tables kept across its steps

    @property
    def rows_run(self) -> int:
        """Token rows this lane puts through the weights."""
        return self.ids.shape[0] * self.ids.shape[1]


def on_layer(model: DiffusionLM, layer: int, x: Tensor) -> Tensor:
    """``x`` on layer ``layer``'s device when the model is spread over several (``models/placement.py``)."""
    devices = model.layer_devices
    return x if not devices or x.device == devices[layer] else x.to(devices[layer])


def joined_heads(outs: Sequence[Tensor]) -> Tensor:
    """The lanes' attention outputs, (b, H, n, D) each, as one (1, H, N, D) of every lane's rows back to back (a
    lane's b sequences in turn), as the lanes' rows are laid out for the products they share. Laid out row by row
    in memory ((1, N, H, D), as SDPA returns each output), so that the output projection's ``merge_heads`` takes
    it as it is: one copy for the lanes together (none for one lane of one sequence)."""
    rows = [o.transpose(1, 2).reshape(1, -1, o.shape[1], o.shape[3]) for o in outs]  # (1, b n, H, D) each
    return (rows[0] if len(rows) == 1 else torch.cat(rows, 1)).transpose(1, 2)


def spans(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """Back-to-back [start, stop) of runs of these sizes."""
    out, start = [], 0
    for size in sizes:
        out.append((start, start + size))
        start += size
    return out


class RopeMemo:
    """RoPE tables kept from call to call: each (layer kind, positions, factor, device) is computed once, by the call
    that would compute it afresh (the same numbers), then taken from here. A generation keeps one for its later steps,
    which rotate the same positions each time (the whole response, or the current block until the next one): at most
    ``kept`` sets (a block-causal generation moves on block by block). The prefills of a model share one
    (``prefill_memo``), bounded by bytes: prompts of the lengths seen before take their tables from it."""

    KEPT = 4

    def __init__(self, kept: int = KEPT, max_bytes: int | None = None) -> None:
        self._tables: dict[tuple[object, int, int, float, torch.device], Rope] = {}
        self.kept, self.max_bytes = kept, max_bytes
        self._bytes = 0

    def get(self, model: DiffusionLM, layer: int, start: int, stop: int, factor: float, device: torch.device) -> Rope:
        """Layer ``layer``'s tables of positions [start, stop) computed on ``device``."""
        key = (model.rope_kind(layer), start, stop, factor, device)
        rope = self._tables.get(key)
        if rope is None:
            rope = model.layer_rope(layer, torch.arange(start, stop, device=device), factor)
            size = 2 * rope.cos.numel() * rope.cos.element_size()
            if self.max_bytes is not None and size > self.max_bytes:
                return rope  # larger than the whole memo: not kept
            if len(self._tables) >= self.kept or (self.max_bytes is not None and self._bytes + size > self.max_bytes):
                self._tables.clear()
                self._bytes = 0
            self._tables[key] = rope
            self._bytes += size
        return rope


PREFILL_TABLES = 256  # sets of RoPE tables a model's prefills keep (``prefill_memo``)
PREFILL_TABLE_BYTES = 4 << 20  # and their bytes at most

_prefill_memos: WeakKeyDictionary[DiffusionLM, RopeMemo] = WeakKeyDictionary()


def prefill_memo(model: DiffusionLM) -> RopeMemo:
    """The RoPE tables a model's prefills share (``RopeMemo``): a lane's tables of its whole sequence, taken by every
    later prompt of its length (a batch's prompts are many, of few distinct lengths)."""
    memo = _prefill_memos.get(model)
    if memo is None:
        memo = _prefill_memos[model] = RopeMemo(PREFILL_TABLES, PREFILL_TABLE_BYTES)
    return memo


class RowTables:
    """The RoPE tables of every lane's rows, layer by layer: lane ``j`` has positions ``bounds[j]`` = [start, stop)
    (its whole sequence), of which rows from ``first[j]`` on run, ``repeat[j]`` times (its batch rows); ``lane(i, j,
    device)`` are lane j's tables of layer i, ``rows(i, device)`` the tables of every running row back to back.
    Each lane's tables are computed as that lane alone computes them (same positions, same call), once per kind of
    layer (``rope_kind``), or taken from the lane's ``memos[j]`` (``RopeMemo``) where it has one."""

    def __init__(self, model: DiffusionLM, bounds: Sequence[tuple[int, int]], first: Sequence[int],
                 repeat: Sequence[int], factors: Sequence[float], device: torch.device,
                 memos: Sequence[RopeMemo | None] | None = None) -> None:
        self.model, self.bounds, self.first, self.repeat, self.factors = model, bounds, first, repeat, factors
        self.device = device
        self.memos = memos if memos is not None else [None] * len(bounds)
        self._lanes: dict[object, list[Rope]] = {}
        self._rows: dict[object, Rope] = {}

    def _tables(self, layer: int) -> tuple[object, list[Rope]]:
        kind = self.model.rope_kind(layer)
        if kind not in self._lanes:
            self._lanes[kind] = [
                self.model.layer_rope(layer, torch.arange(start, stop, device=self.device), f) if memo is None
                else memo.get(self.model, layer, start, stop, f, self.device)
                for (start, stop), f, memo in zip(self.bounds, self.factors, self.memos, strict=True)]
        return kind, self._lanes[kind]

    def lane(self, layer: int, j: int, device: torch.device) -> Rope:
        return self._tables(layer)[1][j].to(device)

    def rows(self, layer: int, device: torch.device) -> Rope:
        kind, tables = self._tables(layer)
        if kind not in self._rows:
            own = [t.rows(first, len(t.cos)) for t, first in zip(tables, self.first, strict=True)]
            if len(own) == 1 and self.repeat[0] == 1:
                self._rows[kind] = own[0]
            else:
                cos = [t.cos for t, r in zip(own, self.repeat, strict=True) for _ in range(r)]
                sin = [t.sin for t, r in zip(own, self.repeat, strict=True) for _ in range(r)]
                self._rows[kind] = Rope(torch.cat(cos), torch.cat(sin))
        self._rows[kind] = self._rows[kind].to(device)
        return self._rows[kind]
