"""Time of one training step of the embedded model with glibc's default ``malloc`` and with freed memory kept in
the process (``maskkv_cli/training/heap.py``, what ``train-tiny`` does), each in a fresh process.

One step is ``diffusion_loss`` (identity loss on) on a batch of 16 multikey examples of ``--length`` context tokens,
its backward pass and an AdamW update. Each process runs ``--warmup`` steps, then ``--steps`` timed ones; the two
settings alternate over ``--rounds`` rounds. Reported: the median wall time of a step and the kernel (system) CPU
time per step of each setting, and their ratio.

    .venv/bin/python scripts/bench_train_step.py --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODEL = Path(__file__).resolve().parent.parent / "maskkv_cli" / "assets" / "tiny-llada"


def measure(keep: bool, threads: int, length: int, warmup: int, steps: int) -> dict[str, list[float]]:
    """Step times of one process (run as a child: malloc settings last for a process's life)."""
    import torch

    from maskkv_cli.models.loading import load_model
    from maskkv_cli.prompting import load_tokenizer
    from maskkv_cli.training.config import TrainConfig
    from maskkv_cli.training.examples import Batcher
    from maskkv_cli.training.heap import keep_freed_memory
    from maskkv_cli.training.train import diffusion_loss

    torch.set_num_threads(threads)
    if keep and not keep_freed_memory():
        raise SystemExit("glibc's mallopt is not available here")
    model = load_model(MODEL).train()
    for p in model.parameters():
        p.requires_grad_(True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    cfg = TrainConfig(batch_size=16, min_len=length, max_len=length, curriculum_steps=1, distractors=(3, 7),
                      mix={"niah_multikey": 1.0}, sources={"stdlib-train": 1.0})
    batch = Batcher(cfg, load_tokenizer(MODEL), model.config).batch(1, random.Random(0))
    gen = torch.Generator().manual_seed(0)
    wall, system = [], []
    for i in range(warmup + steps):
        t0, c0 = time.perf_counter(), os.times()
        opt.zero_grad()
        diffusion_loss(model, batch.ids, batch.keep, batch.rows, gen, 0.5, None, 1.0).backward()
        opt.step()
        if i >= warmup:
            wall.append(time.perf_counter() - t0)
            system.append(os.times().system - c0.system)
    return {"wall": wall, "system": system}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--length", type=int, default=384)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", choices=["default", "keep"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child == "keep", args.threads, args.length, args.warmup, args.steps)))
        return
    runs: dict[str, dict[str, list[float]]] = {s: {"wall": [], "system": []} for s in ("default", "keep")}
    for _ in range(args.rounds):
        for setting in runs:
            out = subprocess.run([sys.executable, __file__, "--child", setting, "--threads", str(args.threads),
                                  "--length", str(args.length), "--warmup", str(args.warmup),
                                  "--steps", str(args.steps)], capture_output=True, text=True, check=True)
            for key, values in json.loads(out.stdout).items():
                runs[setting][key].extend(values)
    rows = {s: {"median_step_s": round(statistics.median(r["wall"]), 3),
                "system_s_per_step": round(statistics.mean(r["system"]), 3), "steps": len(r["wall"])}
            for s, r in runs.items()}
    rows["ratio_default_over_keep"] = round(rows["default"]["median_step_s"] / rows["keep"]["median_step_s"], 2)
    print(json.dumps({"threads": args.threads, "length": args.length, **rows}, indent=2))


if __name__ == "__main__":
    main()
