"""How a matrix product rounds by its number of rows, on this platform, and the floor every product of a model keeps.

A product's rows are the same numbers whether it has 12 rows or 12,000 (the blocked kernels reduce each row the
same way), but a product of only a few rows takes another kernel that rounds differently (oneDNN/MKL fp32 on this
project's machines: 1-3 rows with one thread, up to 11 with two; bf16: 1-2 rows of a small product, a single row of
a long reduction, at one thread and two). So every linear layer of a model runs its product
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

from maskkv_cli.models.int8_matmul import int8_linear, takes

PROBE_ROWS = 32  # small_rows looks at products of up to this many rows
# (inputs, outputs) of the probed products: two mid-sized ones, then a small one (bf16 products below some size take
# another kernel for a few rows) and a long reduction (a single bf16 row takes another kernel there)
PROBE_SHAPES = ((128, 384), (512, 1024), (64, 32), (2048, 64))


def probe_data(n_in: int, n_out: int, dtype: torch.dtype, g: torch.Generator) -> tuple[Tensor, Tensor]:
    """w (n_out, n_in) and x (4 * ``PROBE_ROWS``, n_in) on which two kernels that sum in another order give other
    results. In fp32 random numbers do: a product's result is its fp32 accumulator itself. A narrower dtype rounds
    that accumulator once more, which hides a difference unless the exact value lies on one of its rounding
    midpoints (random data hid bf16's few-rows kernels so: 0 rows were probed). So there every row of x is one
    random row ending in two ones, and w's last two columns put each output's exact value on a midpoint of
    ``dtype``'s rounding (to within about twice the narrow precision, far inside fp32's): a kernel whose sum
    differs in its last fp32 bits rounds it to the other side."""
    if torch.finfo(dtype).eps <= torch.finfo(torch.float32).eps:
        w = torch.randn(n_out, n_in, generator=g).to(dtype)
        return w, torch.randn(4 * PROBE_ROWS, n_in, generator=g).to(dtype)
    w = torch.randn(n_out, n_in, generator=g).to(dtype)
    x = torch.randn(n_in, generator=g).to(dtype)
    x[-2:] = 1
    exact = w[:, :-2].double() @ x[:-2].double()  # each product of two narrow floats is exact in float64
    rounded = exact.to(dtype).double()
    half_ulp = torch.finfo(dtype).eps * torch.pow(2.0, torch.frexp(rounded).exponent.double() - 2)
    rest = rounded + torch.where(exact >= rounded, half_ulp, -half_ulp) - exact  # to the nearest midpoint
    w[:, -2] = rest.to(dtype)  # rest in two narrow parts: their sum carries about twice the narrow precision
    w[:, -1] = (rest - w[:, -2].double()).to(dtype)
    return w, x.expand(4 * PROBE_ROWS, -1).contiguous()


@functools.lru_cache(maxsize=16)
def _probe(device: str, dtype: torch.dtype, threads: int) -> int:
    g = torch.Generator().manual_seed(0)
    worst = 0
    for n_in, n_out in PROBE_SHAPES:
        w, x = (t.to(device) for t in probe_data(n_in, n_out, dtype, g))
        whole = F.linear(x, w)
        for m in range(1, PROBE_ROWS + 1):
            if not torch.equal(F.linear(x[:m], w), whole[:m]):
                worst = max(worst, m)
    return worst


def small_rows(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> int:
    """The most rows a matrix product may have and still round differently from the same rows inside a larger
    product, on this platform (0: never): probed once per process (per device, dtype and CPU thread count) on fixed
    data (``probe_data``) of the shapes ``PROBE_SHAPES``, each product compared row for row with a 4 x
    ``PROBE_ROWS``-row one."""
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


def product(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)``; an int8 weight in bf16 on the CPU runs PyTorch's int8 kernel
    (``models/int8_matmul.py``), whose rows never depend on each other."""
    if takes(x, weight):
        return int8_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)`` over x (..., n_in) as a product of never fewer than ``small_rows + 1`` rows."""
    width = x.shape[-1]
    rows = x.numel() // width if width else 0
    if rows == 0 or rows > PROBE_ROWS or rows > few_rows(x):  # no probe finds more than PROBE_ROWS
        return product(x, weight, bias)
    out = at_least_rows(lambda flat: product(flat, weight, bias), x.reshape(rows, width))
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
        """Outputs ``start .. stop`` of this layer of x (only those rows of its weight are used; no bias), with the
        row floor of ``linear``."""
        return linear(x, self.weight[start:stop])


def prepare(model: nn.Module) -> None:
    """Probe the row count for the devices and dtype of ``model``'s parameters now (at load), not in a step."""
    for key in {(p.device, p.dtype) for p in model.parameters()}:
        small_rows(*key)
