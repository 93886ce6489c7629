"""How often a block-causal model's cached loop (``--policy full``) gives the no-cache loop's (``--policy none``)
answer, in bf16 (or fp32), on tiny random LLaDA2 models: the measurement behind docs/models.md's agreement table.

Usage: python scripts/block_cache_agreement.py [--shapes tiny,wide] [--measures tokens,logits] [--dtype bf16]
                                             [--threads 1] [--out FILE]

The no-cache loop recomputes the whole window of blocks at every step (what upstream's ``generate`` does); the
cached one computes the prompt's blocks once and each finished block once more. Both are exact in arithmetic, so
any difference is rounding: SDPA's CPU kernel rounds a query's sum by how many keys it runs over (masked ones
included), and every later window runs an earlier block's queries over more keys. Two measures per shape:

- tokens: ``generate`` with ``none`` and with ``full`` on every prompt length x seed x commit threshold, for
  LLaDA2.0's loop and LLaDA2.1's (editing threshold 0.5): how many runs give the same tokens;
- logits: one fixed random canvas per prompt length, every block decoded in one step under both policies
  (the cached one finishing each block before the next): how many blocks get bit-identical logits.

Shapes: ``tiny`` is the test suite's llada2-tiny (head dim 16, blocks of 8, 24 tokens generated; prompt lengths
around every block edge, the issue's 13, 16 and 37 among them); ``wide`` has the released LLaDA2 head shape (16
query heads, 4 key/value heads of 128), blocks of 32, 64 tokens, prompts of 95 to 513 tokens (around the 512-key
tiles of the CPU kernel too).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from maskkv_cli.engine.plan import CachePlan  # noqa: E402
from maskkv_cli.models.config import ModelConfig, named_config  # noqa: E402
from maskkv_cli.models.families import build_model  # noqa: E402
from maskkv_cli.models.protocol import DiffusionLM  # noqa: E402
from maskkv_cli.policies import get_policy  # noqa: E402
from maskkv_cli.sampling import GenerationConfig, LLaDA2Options, generate  # noqa: E402
from maskkv_cli.sampling.driver import Generation, Loop, step_round  # noqa: E402
from maskkv_cli.sampling.forward import BlockForward, StepRequest, finish_rows  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
THRESHOLDS = (0.95, 0.0005)  # the issue's: most steps commit one token / nearly every mask at once
SEEDS = (0, 1, 2)
LOOPS = {"2.0": None, "2.1": 0.5}  # LLaDA2.1: token editing above this threshold


def shapes() -> dict[str, tuple[ModelConfig, int, int, tuple[int, ...], tuple[int, ...]]]:
    """name -> (config, block, gen length, prompt lengths, model seeds)."""
    tiny = named_config("llada2-tiny")
    wide = tiny.with_(d_model=256, n_heads=16, n_kv_heads=4, head_dim_override=128)
    edges = (7, 8, 9, 13, 15, 16, 17, 23, 24, 25, 37)
    return {"tiny": (tiny, 8, 24, edges, (3, 4)),
            "wide": (wide, 32, 64, (95, 96, 97, 255, 257, 511, 513), (3,))}


def block_logits(model: DiffusionLM, policy: str, x: torch.Tensor, prompt_len: int, block: int) -> list[torch.Tensor]:
    """Every block of the canvas ``x`` (1, total) from the prompt's last block on, each decoded in one step (all its
    rows at once) under ``policy``; the cached loop finishes each block before the next, as LLaDA2's loop does."""
    total = x.shape[1]
    plan = CachePlan.build(model, get_policy(policy), None, prompt_len, block_length=block)
    forward = BlockForward(model, plan, block, total)
    out: list[torch.Tensor] = []

    class Run:  # the driver's view of a generation: its forward (no result is needed)
        def __init__(self) -> None:
            self.forward = forward

        def result(self) -> None:
            return None

    def loop() -> Loop:
        for blk in range(prompt_len // block, total // block):
            out.append((yield StepRequest(x, torch.arange(block), blk * block)))
            if forward.keeps_blocks and (blk + 1) * block < total:
                yield StepRequest(x, finish_rows(x.device), blk * block, finish=True)

    gen = Generation(0, Run(), loop())  # type: ignore[arg-type]
    while not gen.done:
        step_round(model, [gen])
    if gen.error is not None:
        raise gen.error
    return out


@torch.no_grad()
def measure(name: str, dtype: torch.dtype, measures: set[str]) -> dict[str, object]:
    cfg, block, gen_length, lengths, model_seeds = shapes()[name]
    seeds = SEEDS if name == "tiny" else SEEDS[:2]  # the wide shape's no-cache runs take a minute a prompt
    runs = same = blocks = exact = 0
    cells: dict[str, list[int]] = {}
    for model_seed in model_seeds:
        model = build_model(cfg).init_weights(seed=model_seed, std=0.25).eval().to(dtype)
        vocab = model.config.vocab_size
        grid = itertools.product(LOOPS, THRESHOLDS, lengths, seeds) if "tokens" in measures else ()
        for loop, threshold, n, seed in grid:
            gen = GenerationConfig(gen_length=gen_length, steps=gen_length, block_length=block, threshold=threshold)
            options = LLaDA2Options(editing_threshold=LOOPS[loop], max_post_steps=4)
            ids = torch.randint(6, vocab, (1, n), generator=torch.Generator().manual_seed(seed))
            plain = generate(model, ids, gen, get_policy("none"), llada2=options).tokens
            full = generate(model, ids, gen, get_policy("full"), llada2=options).tokens
            ok = bool(torch.equal(plain, full))
            runs, same = runs + 1, same + ok
            for name in (f"{loop} threshold {threshold}", f"prompt {n}"):  # by loop and threshold, by length
                cell = cells.setdefault(name, [0, 0])
                cell[0], cell[1] = cell[0] + ok, cell[1] + 1
        for n in lengths if "logits" in measures else ():
            total = -(-(n + gen_length) // block) * block
            x = torch.randint(6, vocab, (1, total), generator=torch.Generator().manual_seed(1000 + n))
            a, b = block_logits(model, "none", x, n, block), block_logits(model, "full", x, n, block)
            blocks += len(a)
            exact += sum(bool(torch.equal(p, q)) for p, q in zip(a, b, strict=True))
    return {"shape": name, "runs": runs, "same_tokens": same, "cells": cells, "blocks": blocks,
            "blocks_bit_identical": exact}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="tiny,wide")
    parser.add_argument("--measures", default="tokens,logits")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="also write the rows as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for name in args.shapes.split(","):
        t0 = time.perf_counter()
        row = measure(name, DTYPES[args.dtype], set(args.measures.split(",")))
        row.update(dtype=args.dtype, threads=args.threads, seconds=round(time.perf_counter() - t0, 1))
        rows.append(row)
        print(f"{name} {args.dtype} {args.threads} thread(s): same tokens {row['same_tokens']}/{row['runs']}, "
              f"blocks with bit-identical logits {row['blocks_bit_identical']}/{row['blocks']} "
              f"({row['seconds']} s)  {row['cells']}", flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
