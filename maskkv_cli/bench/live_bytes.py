"""Live tensor bytes: what torch has allocated and not yet freed, counted exactly and independently of the allocator.

``LiveBytes`` is a ``TorchDispatchMode``: every operator that runs inside it reports its outputs; an output whose
storage is new (not one of the operator's inputs' storages and not already counted) adds the storage's size, and
a ``weakref.finalize`` on that storage subtracts it when torch frees it. Storages created before the mode was
entered (the weights, the inputs) are never counted, so ``peak`` is the peak above what existed at entry.

What it cannot see: buffers a kernel allocates and frees inside one operator (e.g. oneDNN or SDPA scratch), and
tensors created outside the mode. The resident set (``stats.rss_bytes``) sees everything, but it also depends on
how the C allocator keeps freed memory, which is why benchmarks report both.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    if t.device.type == "meta" or t.layout != torch.strided:
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


class LiveBytes(TorchDispatchMode):
    """Count the bytes of the tensor storages allocated inside the mode that are still alive.

    ``live``: bytes now; ``peak``: the most at any moment since entry; ``take_window_peak()`` the most since its
    previous call (for peaks per phase); ``count``: storages counted so far.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.count = 0
        self._window = 0
        self._alive: set[int] = set()

    def _free(self, key: int, nbytes: int) -> None:
        self._alive.discard(key)
        self.live -= nbytes

    def _add(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        if key in self._alive:
            return
        nbytes = storage.nbytes()
        self._alive.add(key)
        self.count += 1
        self.live += nbytes
        if self.live > self.peak:
            self.peak = self.live
        if self.live > self._window:
            self._window = self.live
        weakref.finalize(storage, self._free, key, nbytes)

    def take_window_peak(self) -> int:
        """The most live bytes since the previous call (or entry); the next window starts at the current level."""
        value, self._window = self._window, self.live
        return value

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = None
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            st = _storage(t)
            if st is None or st._cdata in self._alive:
                continue
            if inputs is None:  # an output sharing an input's storage (a view, an in-place op) is not new
                inputs = {s._cdata for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)
                          for s in [_storage(a)] if s is not None}
            if st._cdata not in inputs:
                self._add(st)
        return out
