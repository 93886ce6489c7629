"""DiffusionGemma's encoder memory against the prompt length, on the CPU (live tensor bytes, ``bench/live_bytes.py``).

A tiny random DiffusionGemma (3 sliding + 3 full layers, d 64, full layers of 2 KV heads of 32 dims, fp32; the model
of ``tests/test_diffusion_gemma_long.py``) encodes a random prompt of each length with room for one canvas, in the
encoder's chunks of 512 and, for comparison, in one pass (what ``encode`` did before it ran in chunks), then runs one
decoder pass over the cache. Printed per length: the encoder's live peak, the cache's bytes, the decoder pass's live
peak. Bytes, not time: runs anywhere.

    PYTHONPATH=. .venv/bin/python scripts/dgemma_encoder_memory.py --lengths 1k,2k,4k,8k --one-pass-up-to 4096
"""

from __future__ import annotations

import argparse

import torch

from maskkv_cli.bench.live_bytes import LiveBytes
from maskkv_cli.cli.parsing import parse_counts
from maskkv_cli.models.diffusion_gemma import DiffusionGemma
from maskkv_cli.models.diffusion_gemma_cache import resident_bytes
from maskkv_cli.models.diffusion_gemma_config import FULL, SLIDING, named_config
from maskkv_cli.models.rows import small_rows
from maskkv_cli.sampling.diffusion_gemma_steps import random_canvas


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="1k,2k,4k,8k")
    parser.add_argument("--one-pass-up-to", type=int, default=4096, help="the longest prompt also encoded in one pass")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = named_config("diffusiongemma-tiny").with_(n_layers=6, layer_types=(SLIDING, FULL) * 3, n_global_kv_heads=2,
                                                    max_position_embeddings=1 << 20)
    model = DiffusionGemma(cfg).eval().init_spread_weights(0)
    small_rows("cpu", torch.float32)  # the once-per-process probe of models/rows.py, outside the readings
    canvas = random_canvas(1, cfg.canvas_length, cfg.vocab_size, torch.Generator().manual_seed(0))
    print("| prompt | encode peak, chunks of 512 | of which the cache | encode peak, one pass | decoder pass peak |")
    print("|---|---|---|---|---|")
    for m in parse_counts(args.lengths, "--lengths"):
        ids = torch.randint(3, cfg.vocab_size, (1, m), generator=torch.Generator().manual_seed(m))
        peaks = []
        for chunk in (None, m):
            if chunk == m and m > args.one_pass_up_to:
                peaks.append(None)
                continue
            with torch.no_grad(), LiveBytes() as live:
                cache = model.encode(ids, spare=cfg.canvas_length, chunk=chunk).cache
            peaks.append(live.peak)
        with torch.no_grad(), LiveBytes() as step:
            model.decode(canvas, cache)
        one = "-" if peaks[1] is None else f"{peaks[1]:,}"
        print(f"| {m:,} | {peaks[0]:,} | {resident_bytes(cache):,} | {one} | {step.peak:,} |")


if __name__ == "__main__":
    main()
