"""Weights-only quantization speed on the CPU (issue 48), a quick proxy: one process, the modes alternating round by
round, all in ``--dtype`` (bf16 by default: PyTorch's CPU int4 kernel is far slower with fp32 activations).

A denoising step is proxied by the plain forward over ``--step-rows`` rows (a LLaDA2 block), the prefill by the
forward over ``--prompt`` rows. Prints one JSON row per mode: median seconds, step tokens/s, ratio to unquantized.
The measurement of the sampler's own steps and prefill, with the cache policies, is ``maskkv bench speed --quantize
none,int8,int4 --repeats 5 --in-process`` (docs/performance.md).

    OMP_NUM_THREADS=2 python scripts/bench_quant.py --config llada2-small --rounds 5
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch

from maskkv_cli.bench.cases import random_model, random_prompt
from maskkv_cli.models.config import named_config
from maskkv_cli.models.loading import parse_dtype
from maskkv_cli.models.quantize import quantize_model, weights_bytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="llada2-small")
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--step-rows", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", default="bf16")
    args = ap.parse_args()
    cfg = named_config(args.config)
    base = random_model(cfg, dtype=parse_dtype(args.dtype))
    models = {"none": base, **{m: quantize_model(copy.deepcopy(base), m) for m in ("int8", "int4")}}
    prompt = random_prompt(cfg, args.prompt, 0, torch.device("cpu"))
    step = prompt[:, : args.step_rows]
    times: dict[str, dict[str, list[float]]] = {m: {"prefill": [], "step": []} for m in models}
    with torch.no_grad():
        for _ in range(args.rounds + 1):  # the first round warms up and is dropped
            for mode, model in models.items():
                for kind, ids in (("step", step), ("prefill", prompt)):
                    t0 = time.perf_counter()
                    model(ids)
                    times[mode][kind].append(time.perf_counter() - t0)
    ref = statistics.median(times["none"]["step"][1:])
    for mode, model in models.items():
        s, p = statistics.median(times[mode]["step"][1:]), statistics.median(times[mode]["prefill"][1:])
        print(json.dumps({"config": args.config, "mode": mode, "weights_bytes": weights_bytes(model),
                          "dtype": args.dtype, "step_s": s, "step_tokens_per_s": args.step_rows / s,
                          "step_ratio": ref / s, "prefill_s": p, "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
