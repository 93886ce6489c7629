"""Prefills joined or alone: the engine's step 0 of B prompts as one pass of lanes against B passes of one lane.

For the row cap of ``engine/chunks.py`` (``JOIN_ROWS``): which prompts gain from sharing a prefill. Each round
runs both ways on fresh lanes (random ids of one seeded draw, the policy's sink as a real run builds it), in
alternating order; reported: the median seconds of each way and joined / alone.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_join.py --model embedded --lengths 100,300,600,1400
    .venv/bin/python scripts/bench_join.py --model llada-small --threads 2 --lengths 32,128,512,1024
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from maskkv_cli.engine.lanes import PrefillLane
from maskkv_cli.engine.prefill import prefill_lanes, selection_sink
from maskkv_cli.models.catalog import resolve_default_model
from maskkv_cli.models.config import named_config
from maskkv_cli.models.families import build_model
from maskkv_cli.models.loading import load_model
from maskkv_cli.models.rows import prepare
from maskkv_cli.policies.base import get_policy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded", help="'embedded' or a named config (random weights)")
    parser.add_argument("--lengths", default="100,300,600,1400", help="prompt lengths, comma-separated")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--gen-length", type=int, default=32)
    parser.add_argument("--policy", default="maskkv")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.model == "embedded":
        model = load_model(resolve_default_model(None)[0])
    else:
        model = build_model(named_config(args.model))
        model.init_weights(0)  # type: ignore[attr-defined]
        prepare(model)
    model.eval()
    policy = get_policy(args.policy)
    g = args.gen_length

    def lanes(m: int) -> list[PrefillLane]:
        out = []
        for j in range(args.batch):
            ids = torch.randint(0, model.config.vocab_size, (1, m + g), generator=torch.Generator().manual_seed(j))
            sink, _ = selection_sink(policy, None, m, g, len(model.blocks), False)
            out.append(PrefillLane(ids, m, torch.arange(m, m + g), sink))
        return out

    with torch.no_grad():
        prefill_lanes(model, lanes(64)[:2])  # warm-up
        for m in (int(v) for v in args.lengths.split(",")):
            times: dict[str, list[float]] = {"alone": [], "joined": []}
            for r in range(args.rounds):
                for way in ("alone", "joined") if r % 2 == 0 else ("joined", "alone"):
                    batch = lanes(m)
                    t0 = time.perf_counter()
                    if way == "alone":
                        for lane in batch:
                            prefill_lanes(model, [lane])
                    else:
                        prefill_lanes(model, batch)
                    times[way].append(time.perf_counter() - t0)
            alone, joined = statistics.median(times["alone"]), statistics.median(times["joined"])
            row = {"model": args.model, "threads": args.threads, "prompt": m, "batch": args.batch,
                   "alone_s": round(alone, 4), "joined_s": round(joined, 4),
                   "joined_over_alone": round(joined / alone, 3)}
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
