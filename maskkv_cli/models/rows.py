"""How a matrix product rounds by its number of rows, on this platform, and the floor every product of a model keeps.

A product's rows are the same numbers whether it has 12 rows or 12,000 (the blocked kernels reduce each row the
same way), but a product of only a few rows takes another kernel that rounds differently (oneDNN/MKL fp32 on this
project's machines: 1-3 rows with one thread, up to 11 with two). So every linear layer of a model runs its product
with at least ``small_rows + 1`` rows (``Linear``, ``linear``: a few rows get zero rows after them, dropped from the
result). A row's numbers then do not depend on how many other rows share its product: a sequence's last rows of a
block give the same floats alone as beside other sequences' rows (``engine/step.py`` joins every sequence of a batch
in each product), and an expert gives the same floats whatever else the router sent it (``models/moe.py``).

The row count is probed once per process for each device, dtype and (on the CPU) thread count; ``prepare`` runs the
probe when a model is loaded, so that it never runs inside a measured step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

PROBE_ROWS = 32  # small_rows looks at products of up to this many rows


@functools.lru_cache(maxsize=16)
def _probe(device: str, dtype: torch.dtype, threads: int) -> int:
    g = torch.Generator().manual_seed(0)
    worst = 0
    for n_in, n_out in ((128, 384), (512, 1024)):
        w = torch.randn(n_out, n_in, generator=g).to(device=device, dtype=dtype)
        x = torch.randn(4 * PROBE_ROWS, n_in, generator=g).to(device=device, dtype=dtype)
        whole = F.linear(x, w)
        for m in range(1, PROBE_ROWS + 1):
            if not torch.equal(F.linear(x[:m], w), whole[:m]):
                worst = max(worst, m)
    return worst


def small_rows(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> int:
    """The most rows a matrix product may have and still round differently from the same rows inside a larger
    product, on this platform (0: never): probed once per process (per device, dtype and CPU thread count) on fixed
    data of two shapes, each product compared row for row with a 4 x ``PROBE_ROWS``-row one."""
    device = torch.device(device)
    threads = torch.get_num_threads() if device.type == "cpu" else 0
    return _probe(str(device), dtype, threads)


_FLOORS: dict[tuple[torch.device, torch.dtype, int], int] = {}


def few_rows(t: Tensor) -> int:
    """``small_rows`` for ``t``'s device and dtype (a dictionary lookup after the first call)."""
    threads = torch.get_num_threads() if t.device.type == "cpu" else 0
    key = (t.device, t.dtype, threads)
    few = _FLOORS.get(key)
    if few is None:
        few = _FLOORS[key] = small_rows(t.device, t.dtype)
    return few


def at_least_rows(fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """``fn`` (row-wise over x's first dimension) of x (r, ...) with at least ``small_rows + 1`` rows in every
    product: a few rows are computed with zero rows after them, dropped from the result. The rows are then the
    numbers they are inside any larger product."""
    few = few_rows(x)
    if x.shape[0] == 0 or x.shape[0] > few:
        return fn(x)
    padded = torch.cat([x, x.new_zeros(few + 1 - x.shape[0], *x.shape[1:])])
    return fn(padded)[: x.shape[0]]


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)`` over x (..., n_in) as a product of never fewer than ``small_rows + 1`` rows."""
    width = x.shape[-1]
    rows = x.numel() // width if width else 0
    if rows == 0 or rows > PROBE_ROWS or rows > few_rows(x):  # no probe finds more than PROBE_ROWS
        return F.linear(x, weight, bias)
    out = at_least_rows(lambda flat: F.linear(flat, weight, bias), x.reshape(rows, width))
    return out.reshape(*x.shape[:-1], out.shape[-1])


class Linear(nn.Linear):
    """``nn.Linear`` whose product never has only a few rows (``linear``); the same parameters and checkpoint keys.
    Every family builds its projections, MLPs, experts and LM head from it (``tests/test_rows.py`` checks that no
    plain ``nn.Linear`` is left in a model)."""

    # Output-row boundaries at which the family takes parts of this layer (a fused projection's q, k and v rows):
    # a quantized layer stores each part on its own (``models/quantize.py``), as a packed weight cannot be sliced
    splits: tuple[int, ...] = ()

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)

    def output_rows(self, x: Tensor, start: int, stop: int) -> Tensor:
        """Outputs ``start .. stop`` of this layer of x (only those rows of its weight are used; no bias)."""
        return F.linear(x, self.weight[start:stop])


def prepare(model: nn.Module) -> None:
    """Probe the row count for the devices and dtype of ``model``'s parameters now (at load), not in a step."""
    for key in {(p.device, p.dtype) for p in model.parameters()}:
        small_rows(*key)
