"""Teach a trained checkpoint to copy: copy_probe.py's random-token copy task with the model's own vocabulary,
optionally with the identity loss (docs/tiny-model.md, stage 20).

Usage: python scripts/copy_warmup.py --model maskkv_cli/assets/tiny-llada [--identity 1.0] [--steps 1000]
       [--save DIR]

The embedded model's head is not tied to its embedding, and its training only ever asked masked answer
positions for digits, so it has no way to read a copied word back out. ``--identity W`` adds W times the
cross-entropy of predicting every visible token as itself. Reports masked-token accuracy on 128 fixed
sequences with half and with all of the copy masked, every 100 steps; ``--save`` writes the model (with the
checkpoint's tokenizer) for ``maskkv train-tiny --init-from``. One thread, AdamW lr 1e-3, batch 32, gradient
clip 1.0.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from copy_probe import Ids, accuracy, batch  # noqa: E402

from maskkv_cli.models.loading import load_model, save_model  # noqa: E402
from maskkv_cli.prompting import load_tokenizer  # noqa: E402

FIRST_CONTENT = 100  # ids below are special tokens, bytes and the first merges
SEP = 3  # a special token the model never saw inside a text: the copy's separator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--identity", type=float, default=0.0)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = load_model(args.model).train()
    for p in model.parameters():
        p.requires_grad_(True)
    cfg = model.config
    ids = Ids(bos=cfg.bos_token_id, sep=SEP, mask=cfg.mask_token_id, pad=cfg.pad_token_id, first=FIRST_CONTENT,
              vocab=cfg.vocab_size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    gen = torch.Generator().manual_seed(args.seed)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        target, inputs, where = batch(gen, 32, None, ids)
        logits = model(inputs, key_mask=target != ids.pad)
        loss = F.cross_entropy(logits[where], target[where])
        if args.identity:
            visible = ~where & (target != ids.pad)
            loss = loss + args.identity * F.cross_entropy(logits[visible], target[visible])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0:
            row = {"step": step, "loss": round(loss.item(), 3), "half": round(accuracy(model, 0, 0.5, 128, ids), 3),
                   "all": round(accuracy(model, 0, 1.0, 128, ids), 3), "s": round(time.perf_counter() - start)}
            print(json.dumps(row), flush=True)
    if args.save:
        save_model(model, args.save, load_tokenizer(args.model))
        shutil.copy(args.model / "generation_config.json", args.save / "generation_config.json")
        print(f"saved {args.save}")


if __name__ == "__main__":
    main()
