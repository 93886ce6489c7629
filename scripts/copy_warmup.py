"""Teach a trained checkpoint to copy: copy_probe.py's random-token copy task with the model's own vocabulary,
optionally with the identity loss (docs/tiny-model.md, stage 20).

Usage: python scripts/copy_warmup.py --model maskkv_cli/assets/tiny-llada [--identity 1.0] [--steps 1000]
       [--save DIR]

The embedded model's head is not tied to its embedding, and its training only ever asked masked answer
positions for digits, so it has no way to read a copied word back out. ``--identity W`` adds W times the
cross-entropy of predicting every visible token as itself. Reports masked-token accuracy on 128 fixed
sequences with half and with all of the copy masked, every 100 steps; ``--save`` writes the model (with the
checkpoint's tokenizer) for ``maskkv train-tiny --init-from``. One thread, AdamW lr 1e-3, batch 32, gradient
clip 1.0. ``--needles`` puts a batch of the shipped model's needle mix before every copy batch.
"""

from __future__ import annotations

import argparse
import json
import random
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
from maskkv_cli.training.config import TrainConfig  # noqa: E402
from maskkv_cli.training.examples import Batcher  # noqa: E402
from maskkv_cli.training.heap import keep_freed_memory  # noqa: E402
from maskkv_cli.training.train import diffusion_loss  # noqa: E402

FIRST_CONTENT = 100  # ids below are special tokens, bytes and the first merges
SEP = 3  # a special token the model never saw inside a text: the copy's separator


def needle_batches(path: Path, model: torch.nn.Module) -> tuple[Batcher, random.Random]:
    """The needle batches of ``--needles`` and the random stream they are drawn from."""
    cfg = TrainConfig(batch_size=16, min_len=128, max_len=512, curriculum_steps=1, distractors=(3, 7),
                      mix={"niah_multikey": 4.0, "niah_single": 1.0, "open_question": 1.0},
                      sources={"corpus": 2.0, "pydoc-topics": 1.0, "stdlib-train": 2.0, "pdf-train": 2.0})
    return Batcher(cfg, load_tokenizer(path), model.config), random.Random(1)


def update(model: torch.nn.Module, opt: torch.optim.Optimizer, loss: torch.Tensor) -> None:
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--identity", type=float, default=0.0)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", type=Path)
    parser.add_argument("--needles", action="store_true",
                        help="before every copy batch, a batch of stage 18's needle mix (multikey 4 : single 1 : open "
                             "question 1, 128-512 tokens, 16 examples) with the same identity loss, so the "
                             "needle skills are trained while copying is learnt")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    keep_freed_memory()
    model = load_model(args.model).train()
    for p in model.parameters():
        p.requires_grad_(True)
    cfg = model.config
    ids = Ids(bos=cfg.bos_token_id, sep=SEP, mask=cfg.mask_token_id, pad=cfg.pad_token_id, first=FIRST_CONTENT,
              vocab=cfg.vocab_size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    gen = torch.Generator().manual_seed(args.seed)
    needles = needle_batches(args.model, model) if args.needles else None
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        if needles is not None:
            batcher, rng = needles
            b = batcher.batch(step, rng)
            update(model, opt, diffusion_loss(model, b.ids, b.keep, b.rows, gen, 0.5, None, args.identity))
        target, inputs, where = batch(gen, 32, None, ids)
        logits = model(inputs, key_mask=target != ids.pad)
        loss = F.cross_entropy(logits[where], target[where])
        if args.identity:
            visible = ~where & (target != ids.pad)
            loss = loss + args.identity * F.cross_entropy(logits[visible], target[visible])
        update(model, opt, loss)
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
