"""One int8 weight product on the CPU, kernel by kernel (issue #48): which of PyTorch's and torchao's int8 paths is
fastest for the products of llada2-small and llada-small, and which of them keep a row's numbers whatever the
number of rows (the row floor, ``models/rows.py``).

Candidates (each a product ``x (rows, in) @ W^T`` of one weight matrix W (out, in); "int8" weights are W rounded
per output row, symmetric, as ``--quantize int8`` holds them):

- ``none``: ``F.linear`` with W in the activation dtype (the unquantized model's product; the reference time);
- ``torchao``: ``F.linear`` with torchao's ``Int8Tensor`` of ``Int8WeightOnlyConfig`` (casts the int8 weight to
  the activation dtype, runs the dtype's product, multiplies by the row scales);
- ``cast-mm``: the same three operations called directly (what torchao's tensor subclass dispatch costs);
- ``cast-mm-tiled``: the same, the weight cast and multiplied in tiles of output rows small enough to stay in the
  core's cache, the tiles' results concatenated;
- ``int8pack``: PyTorch's CPU kernel ``aten._weight_int8pack_mm`` (int8 weight, row scales in the activation
  dtype; its AVX-512 code is bf16 only, and needs inputs a multiple of 16 wide);
- ``maskkv``: ``models.rows.product`` with torchao's ``Int8Tensor``, as the model runs it (``int8pack`` where
  ``models/int8_matmul.py`` takes the product, with its checks and the scales' cast; torchao's product elsewhere);
- ``torchao-dyn``: torchao's ``Int8DynamicActivationInt8WeightConfig`` (activations rounded to int8 per row at
  every product, ``torch._int_mm``; other numbers than weight-only);
- ``int-mm``: the same arithmetic with the weight's column sums computed once instead of at every product.

Timing: every call reads another copy of W from a pool of ``--pool-mb`` MiB (the model's products read their
weights from memory, not from a cache a repeated product would keep warm); per (shape, rows, threads, dtype) the
candidates alternate in rounds (the first dropped), each round timing a run of calls; the median of the rounds'
per-call times. ``--check`` compares, per candidate, each product of m = 1..32 rows with the same rows of a
128-row product and 8-row slices of a 1,024-row product (bitwise; the rows' numbers must not depend on the
others).

    OMP_NUM_THREADS=2 python scripts/bench_int8_kernels.py --threads 1,2 --out runs/int8-kernels.jsonl
    python scripts/bench_int8_kernels.py --check --threads 1,2
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from maskkv_cli.models.quantize import torchao_modules
from maskkv_cli.models.rows import product

# (out, in) of the products: llada2-small (d 1024; q, k/v parts of the fused projection, the dense MLP of layer 0,
# each expert's and the shared expert's gate/up and down) and llada-small (d 1024, MLP 3072)
SHAPES = {
    "llada2-small": [(1024, 1024), (256, 1024), (2816, 1024), (1024, 2816), (512, 1024), (1024, 512)],
    "llada-small": [(1024, 1024), (3072, 1024), (1024, 3072)],
}
TILE_BYTES = 512 * 1024  # cast-mm-tiled: the bytes of one tile of the weight in the activation dtype
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class Weight:
    """One copy of W in every form the candidates read."""

    def __init__(self, w: Tensor) -> None:
        quantization, _ = torchao_modules()
        workflows = sys.modules["torchao.quantization.quantize_.workflows.int8.int8_tensor"]
        self.dense = w
        self.int8 = workflows.Int8Tensor.from_hp(w, quantization.PerRow())
        self.qdata, self.scale = self.int8.qdata, self.int8.scale.flatten()  # (out, in) int8, (out,) fp32
        self.scale_dtype = self.scale.to(w.dtype)
        kwargs = workflows.QuantizeTensorToInt8Kwargs(granularity=quantization.PerRow())
        self.dyn = workflows.Int8Tensor(self.qdata, self.int8.scale, self.int8.block_size, w.dtype,
                                        act_quant_kwargs=kwargs)
        self.comp = self.qdata.sum(dim=1, dtype=torch.int32) * 128  # u8 activations: x + 128, so subtract 128 sum W


def cast_mm(x: Tensor, w: Weight) -> Tensor:
    return torch.mm(x, w.qdata.t().to(x.dtype)) * w.scale.to(x.dtype)


def cast_mm_tiled(x: Tensor, w: Weight) -> Tensor:
    n_out, n_in = w.qdata.shape
    tile = max(16, TILE_BYTES // (n_in * x.element_size()))
    scale = w.scale.to(x.dtype)
    parts = [torch.mm(x, w.qdata[i : i + tile].t().to(x.dtype)) * scale[i : i + tile] for i in range(0, n_out, tile)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def int8pack(x: Tensor, w: Weight) -> Tensor:
    return torch.ops.aten._weight_int8pack_mm(x, w.qdata, w.scale_dtype)


def int_mm(x: Tensor, w: Weight) -> Tensor:
    xf = x.float()
    sx = xf.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127  # per row
    xq = (torch.round(xf / sx).clamp_(-127, 127) + 128).to(torch.uint8)
    acc = torch._int_mm(xq, w.qdata.t())
    acc.sub_(w.comp)
    return (acc.float() * sx * w.scale).to(x.dtype)


CANDIDATES: dict[str, Callable[[Tensor, Weight], Tensor]] = {
    "none": lambda x, w: F.linear(x, w.dense),
    "torchao": lambda x, w: F.linear(x, w.int8),
    "cast-mm": cast_mm,
    "cast-mm-tiled": cast_mm_tiled,
    "int8pack": int8pack,
    "maskkv": lambda x, w: product(x, w.int8),
    "torchao-dyn": lambda x, w: F.linear(x, w.dyn),
    "int-mm": int_mm,
}


def runs_here(name: str, dtype: torch.dtype, n_in: int) -> bool:
    """int8pack's AVX-512 code reads 16 bf16 inputs at a time (other widths crash it); fp32 / fp16 take a scalar
    loop (timed too, with ``--dtypes fp32``)."""
    return name != "int8pack" or dtype != torch.bfloat16 or n_in % 16 == 0


def pool(shape: tuple[int, int], dtype: torch.dtype, mib: float, g: torch.Generator) -> list[Weight]:
    n_out, n_in = shape
    copies = max(1, math.ceil(mib * 2**20 / (n_out * n_in * torch.finfo(dtype).bits / 8)))
    return [Weight((torch.randn(n_out, n_in, generator=g) * 0.02).to(dtype)) for _ in range(copies)]


def time_case(names: list[str], weights: list[Weight], x: Tensor, rounds: int, seconds: float) -> dict[str, float]:
    """Median per-call seconds of each candidate over ``rounds`` rounds (after one warm-up round)."""
    calls: dict[str, int] = {}
    per_call: dict[str, list[float]] = {n: [] for n in names}
    with torch.no_grad():
        for r in range(rounds + 1):
            order = names[r % len(names):] + names[: r % len(names)]  # rotate who goes first
            for name in order:
                fn = CANDIDATES[name]
                k = calls.get(name, min(len(weights), 3))
                t0 = time.perf_counter()
                for i in range(k):
                    fn(x, weights[i % len(weights)])
                dt = (time.perf_counter() - t0) / k
                if r == 0:  # warm-up: size the runs to about ``seconds`` each
                    calls[name] = max(3, min(4 * len(weights), math.ceil(seconds / max(dt, 1e-7))))
                else:
                    per_call[name].append(dt)
    return {n: statistics.median(v) for n, v in per_call.items()}


def check(names: list[str], dtype: torch.dtype, g: torch.Generator) -> list[dict[str, Any]]:
    """Per candidate and shape, the row counts whose rows differ from the same rows inside a larger product."""
    out = []
    for n_out, n_in in ((1024, 1024), (512, 1024), (1024, 512), (64, 32), (64, 2048)):
        w = Weight((torch.randn(n_out, n_in, generator=g) * 0.02).to(dtype))
        x = torch.randn(1024, n_in, generator=g).to(dtype)
        for name in names:
            if not runs_here(name, dtype, n_in):
                continue
            fn = CANDIDATES[name]
            with torch.no_grad():
                whole = fn(x[:128], w)
                few = [m for m in range(1, 33) if not torch.equal(fn(x[:m].clone(), w), whole[:m])]
                big = fn(x, w)
                slices = [s for s in range(0, 1024, 136)
                          if not torch.equal(fn(x[s : s + 8].clone(), w), big[s : s + 8])]
            out.append({"candidate": name, "shape": [n_out, n_in], "dtype": str(dtype).removeprefix("torch."),
                        "threads": torch.get_num_threads(), "differing_rows": few, "differing_slices_of_1024": slices})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="llada2-small,llada-small", help="shapes of: " + ", ".join(SHAPES))
    ap.add_argument("--rows", default="8,32,256,1024")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--dtypes", default="bf16")
    ap.add_argument("--candidates", default=",".join(CANDIDATES))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--seconds", type=float, default=0.1, help="about how long one candidate's run of calls takes")
    ap.add_argument("--pool-mb", type=float, default=128.0, help="MiB of weights (in the dtype) the calls cycle over")
    ap.add_argument("--check", action="store_true", help="row invariance of each candidate instead of timings")
    ap.add_argument("--out", help="append the JSON rows to this file")
    args = ap.parse_args()
    names = args.candidates.split(",")
    if "none" not in names:
        names.insert(0, "none")
    g = torch.Generator().manual_seed(0)
    rows_out: list[dict[str, Any]] = []
    for threads in map(int, args.threads.split(",")):
        torch.set_num_threads(threads)
        for dname in args.dtypes.split(","):
            dtype = DTYPES[dname]
            if args.check:
                for row in check(names, dtype, g):
                    print(json.dumps(row), flush=True)
                    rows_out.append(row)
                continue
            shapes = list(dict.fromkeys(s for c in args.configs.split(",") for s in SHAPES[c]))
            for shape in shapes:
                weights = pool(shape, dtype, args.pool_mb, g)
                here = [n for n in names if runs_here(n, dtype, shape[1])]
                for rows in map(int, args.rows.split(",")):
                    x = torch.randn(rows, shape[1], generator=g).to(dtype)
                    t = time_case(here, weights, x, args.rounds, args.seconds)
                    row = {"shape": list(shape), "rows": rows, "threads": threads, "dtype": dname,
                           "copies": len(weights), "us": {n: round(v * 1e6, 1) for n, v in t.items()},
                           "vs_none": {n: round(t["none"] / v, 3) for n, v in t.items()}}
                    print(json.dumps(row), flush=True)
                    rows_out.append(row)
                del weights
    if args.out:
        with Path(args.out).open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows_out)
    if not args.check:
        table(rows_out, names)


def table(rows: list[dict[str, Any]], names: list[str]) -> None:
    """Markdown: the unquantized product's time and each candidate's speed against it (above 1: faster)."""
    print("\n| shape (out x in) | rows | threads | dtype | none us | " + " | ".join(n for n in names if n != "none")
          + " |")
    print("|---|---:|---:|---|---:|" + "---:|" * (len(names) - 1))
    for r in rows:
        cells = [f"{r['vs_none'][n]:.2f}x" if n in r["vs_none"] else "-" for n in names if n != "none"]
        print(f"| {r['shape'][0]}x{r['shape'][1]} | {r['rows']} | {r['threads']} | {r['dtype']} | "
              f"{r['us']['none']:.0f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
