"""How a matrix product rounds by its number of rows, on this platform.

A product's rows are the same numbers whether it has 4 rows or 4,000 (the blocked kernels reduce each row the same
way), but a product of only a few rows takes another kernel that rounds differently (oneDNN/MKL fp32 on this
project's machines: 1-3 rows). Whoever computes rows that would have run in a product of their own needs to know
that number to give the same floats (``engine/batched.py``: sequences stepping together; ``models/moe.py``: an
expert's product, whose row count depends on how many tokens were routed to it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

PROBE_ROWS = 32  # small_rows looks at products of up to this many rows


@functools.lru_cache(maxsize=8)
def small_rows(device: str = "cpu", dtype: torch.dtype = torch.float32) -> int:
    """The most rows a matrix product may have and still round differently from the same rows inside a larger
    product, on this platform (0: never): probed once per process on fixed data of two shapes, each product
    compared row for row with a 4 x ``PROBE_ROWS``-row one."""
    g = torch.Generator().manual_seed(0)
    worst = 0
    for n_in, n_out in ((128, 384), (512, 1024)):
        w = torch.randn(n_out, n_in, generator=g).to(device=device, dtype=dtype)
        x = torch.randn(4 * PROBE_ROWS, n_in, generator=g).to(device=device, dtype=dtype)
        whole = torch.nn.functional.linear(x, w)
        for m in range(1, PROBE_ROWS + 1):
            if not torch.equal(torch.nn.functional.linear(x[:m], w), whole[:m]):
                worst = max(worst, m)
    return worst


def few_rows(t: Tensor) -> int:
    """``small_rows`` for ``t``'s device and dtype."""
    return small_rows(str(t.device), t.dtype)


def at_least_rows(fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """``fn`` (row-wise over x's first dimension) of x (r, ...) with at least ``small_rows + 1`` rows in every
    product: a few rows are computed with zero rows after them, dropped from the result. The rows are then the
    numbers they are inside any larger product."""
    few = few_rows(x)
    if x.shape[0] == 0 or x.shape[0] > few:
        return fn(x)
    padded = torch.cat([x, x.new_zeros(few + 1 - x.shape[0], *x.shape[1:])])
    return fn(padded)[: x.shape[0]]
