from __future__ import annotations

import platform
import subprocess
import sys

import pytest

# Allocates 256 MiB, touches it, frees it, and prints how much of it the process still holds.
_PROBE = """
import os, sys
import torch
from maskkv_cli.training.heap import keep_freed_memory
took = keep_freed_memory() if sys.argv[1] == "keep" else None
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
before = rss()
x = torch.ones(64 * 2**20)
del x
print(took, (rss() - before) / 2**20)
"""


def _held_mib(mode: str) -> tuple[str, float]:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True)
    took, held = out.stdout.split()
    return took, float(held)


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                    reason="glibc's mallopt on Linux")
def test_keep_freed_memory_keeps_a_freed_tensors_pages():
    took, held_default = _held_mib("default")
    assert held_default < 64  # glibc unmaps a freed 256 MiB block at once
    took, held_kept = _held_mib("keep")
    assert took == "True"
    assert held_kept > 200  # the block stays mapped for the next allocation


# Two AdamW steps of the embedded model on a small batch; prints the losses exactly.
_STEPS = """
import random, sys
import torch
from maskkv_cli.models.catalog import shipped_model
from maskkv_cli.models.loading import load_model
from maskkv_cli.prompting import load_tokenizer
from maskkv_cli.training.config import TrainConfig
from maskkv_cli.training.examples import Batcher
from maskkv_cli.training.heap import keep_freed_memory
from maskkv_cli.training.train import diffusion_loss
torch.set_num_threads(1)
if sys.argv[1] == "keep":
    assert keep_freed_memory()
path = shipped_model()
model = load_model(path).train()
opt = torch.optim.AdamW([p.requires_grad_(True) for p in model.parameters()], lr=1e-3)
cfg = TrainConfig(batch_size=4, min_len=64, max_len=64, curriculum_steps=1, mix={"niah_multikey": 1.0})
batcher, rng, gen = Batcher(cfg, load_tokenizer(path), model.config), random.Random(0), torch.Generator().manual_seed(0)
for step in (1, 2):
    b = batcher.batch(step, rng)
    loss = diffusion_loss(model, b.ids, b.keep, b.rows, gen, 0.5, None, 1.0)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(loss.item().hex())
"""


def test_training_steps_are_identical_with_freed_memory_kept():
    runs = [subprocess.run([sys.executable, "-c", _STEPS, mode], capture_output=True, text=True, check=True).stdout
            for mode in ("default", "keep")]
    assert len(runs[0].split()) == 2 and runs[0] == runs[1]
