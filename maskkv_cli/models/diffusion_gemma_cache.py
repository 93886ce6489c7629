"""DiffusionGemma's prompt cache: each layer's entries, and the room a full layer's entries grow in without copies.

``LayerKV`` is what one layer holds for the decoder: keys (post-norm, post-RoPE) and values (unit-RMS),
(B, H_kv, T_l, D_l), and, in a compressed layer, which slots of each head hold an entry (``kept``). ``PromptCache``
is every layer's ``LayerKV`` and ``length``, the next position (carried, so that an evicted cache keeps its
positions).

A full-attention layer keeps every position, so its cache is what grows with the prompt. Its entries live in a
``KVStore``: keys and values preallocated for ``capacity`` slots, of which the first ``filled`` hold entries; a
``LayerKV`` is a view of the store's first T_l slots. The encoder writes each chunk's entries into the next slots
(``KVStore.write``), so a prompt of any length is encoded without ever copying the cache it has written so far, and
a committed canvas appends in place where the store has room. A view may append in place only while it ends at
``filled`` (no other view has appended after it); any other view, or one without room, appends to a new store it
copies its entries into (``with_room``), so two continuations of one cache never write over each other.
The decoder's canvas entries go into the slots after the view (``canvas_room``) without moving ``filled``: they
are scratch, never part of the cache.

One generation uses a store at a time (the sampler's single thread); a view shared by several generations
(a document's cache, reused for each of its questions) is never appended in place: it is created without spare room.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass(eq=False)
class KVStore:
    """Room for one layer's entries: keys and values (B, H_kv, capacity, D) and, for a compressed layer, which
    slots of each head hold an entry (``kept`` (B, H_kv, capacity)); the first ``filled`` slots are written."""

    keys: Tensor
    values: Tensor
    kept: Tensor | None
    filled: int

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def write(self, start: int, keys: Tensor, values: Tensor) -> None:
        """Entries (B, H_kv, n, D) into slots ``start ..``, which become the last written ones."""
        stop = start + keys.shape[2]
        self.keys[:, :, start:stop] = keys
        self.values[:, :, start:stop] = values
        if self.kept is not None:
            self.kept[:, :, start:stop] = True
        self.filled = stop

    def view(self, length: int) -> LayerKV:
        """The layer's cache of the first ``length`` slots."""
        kept = None if self.kept is None else self.kept[:, :, :length]
        return LayerKV(self.keys[:, :, :length], self.values[:, :, :length], kept, self)


@dataclass(frozen=True)
class LayerKV:
    """One layer's cached prompt entries: keys post-norm and post-RoPE, values unit-RMS, (B, H_kv, T_l, D_l).

    ``kept`` (B, H_kv, T_l) bool, only in a compressed layer (``sampling/diffusion_gemma_kv.py``): which slots hold
    an entry of that head (each head keeps its own number, padded to the longest; False slots are never attended).
    None: every slot is an entry. ``store``: the room the entries are a view of (full layers), None for tensors of
    their own (sliding layers, a freshly compressed layer)."""

    keys: Tensor
    values: Tensor
    kept: Tensor | None = None
    store: KVStore | None = field(default=None, compare=False, repr=False)

    @property
    def length(self) -> int:
        return self.keys.shape[2]

    def appendable(self, extra: int) -> bool:
        """Whether ``extra`` entries can follow this view in its store, in place."""
        s = self.store
        return s is not None and s.filled == self.length and self.length + extra <= s.capacity


def with_room(kv: LayerKV, extra: int, spare: int = 0) -> KVStore:
    """A store holding ``kv``'s entries in its first slots with room for ``extra`` more: ``kv``'s own when it can
    append in place, else a new one of ``kv.length + extra + spare`` slots with the entries copied in."""
    if kv.appendable(extra):
        assert kv.store is not None
        return kv.store
    b, h, t, d = kv.keys.shape
    capacity = t + extra + spare
    keys = kv.keys.new_empty(b, h, capacity, d)
    values = kv.values.new_empty(b, h, capacity, kv.values.shape[3])
    keys[:, :, :t] = kv.keys
    values[:, :, :t] = kv.values
    kept = None
    if kv.kept is not None:
        kept = torch.ones(b, h, capacity, dtype=torch.bool, device=kv.kept.device)
        kept[:, :, :t] = kv.kept
    return KVStore(keys, values, kept, t)


def canvas_room(kv: LayerKV, keys: Tensor, values: Tensor) -> LayerKV:
    """``[kv ; the canvas's entries]`` for one decoder pass: written into the store's slots after ``kv`` when it has
    room (scratch: ``filled`` does not move, so the cache is unchanged), else concatenated (a copy)."""
    c = keys.shape[2]
    t = kv.length
    if kv.appendable(c):
        s = kv.store
        assert s is not None
        s.keys[:, :, t : t + c] = keys
        s.values[:, :, t : t + c] = values
        kept = None
        if s.kept is not None:
            s.kept[:, :, t : t + c] = True
            kept = s.kept[:, :, : t + c]
        return LayerKV(s.keys[:, :, : t + c], s.values[:, :, : t + c], kept)
    kept = None
    if kv.kept is not None:
        ones = torch.ones(*kv.kept.shape[:2], c, dtype=torch.bool, device=kv.kept.device)
        kept = torch.cat((kv.kept, ones), dim=-1)
    return LayerKV(torch.cat((kv.keys, keys), dim=2), torch.cat((kv.values, values), dim=2), kept)


@dataclass(frozen=True)
class PromptCache:
    """What the encoder wrote, per layer, and ``length``: how many positions have been encoded (the next token's
    position). Full layers hold all ``length`` entries, sliding layers the latest ``min(length, W - 1)``.
    ``length`` is carried, not derived from the tensors, so a cache whose entries were evicted keeps its
    positions."""

    layers: tuple[LayerKV, ...]
    length: int

    @property
    def batch_size(self) -> int:
        return self.layers[0].keys.shape[0]

    def __iter__(self) -> Iterator[LayerKV]:
        return iter(self.layers)


def resident_bytes(cache: PromptCache) -> int:
    """Bytes the cache's tensors hold, each store once with its spare room (a view counts its whole store)."""
    seen: set[int] = set()
    total = 0
    for kv in cache:
        tensors = [kv.keys, kv.values] + ([] if kv.kept is None else [kv.kept])
        if kv.store is not None:
            tensors = [kv.store.keys, kv.store.values] + ([] if kv.store.kept is None else [kv.store.kept])
        for t in tensors:
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


__all__ = ["KVStore", "LayerKV", "PromptCache", "canvas_room", "resident_bytes", "with_room"]
