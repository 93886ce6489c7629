from __future__ import annotations

import json
import random

import torch

from maskkv_cli.models.loading import load_model
from maskkv_cli.training import Batcher, TrainConfig, diffusion_loss, train


def small(tmp_path, steps):
    return TrainConfig(out=str(tmp_path / "run"), steps=steps, batch_size=2, vocab_size=300, d_model=32, n_layers=2,
                       n_heads=2, mlp_hidden_size=64, min_len=24, max_len=48, curriculum_steps=2, warmup=1,
                       ckpt_every=2, eval_every=1000, eval_n=2)


def test_batches_keep_prompt_and_pad_left(tiny_tokenizer, tiny_config):
    cfg = TrainConfig(batch_size=3, min_len=30, max_len=40, answer_len=16)
    ids, keep, rows, _ = Batcher(cfg, tiny_tokenizer, tiny_config).batch(0, random.Random(0))
    assert rows.shape == (3, 16) and bool((rows[:, -1] == ids.shape[1] - 1).all())
    assert bool(keep[:, -16:].all())
    for i in range(3):  # padding only on the left
        first = int(keep[i].float().argmax())
        assert bool(keep[i, first:].all()) and not bool(keep[i, :first].any())


def test_loss_masks_only_answer_tokens(tiny_model, monkeypatch):
    seen = {}
    real = type(tiny_model).forward

    def spy(self, ids, key_mask=None, rows=None):
        seen["ids"] = ids.clone()
        return real(self, ids, key_mask, rows)

    monkeypatch.setattr(type(tiny_model), "forward", spy)
    ids = torch.randint(6, 100, (4, 20))
    rows = torch.arange(12, 20).expand(4, 8)
    loss = diffusion_loss(tiny_model, ids, torch.ones(4, 20, dtype=torch.bool), rows, torch.Generator().manual_seed(0))
    noisy = seen["ids"]
    mask = tiny_model.config.mask_token_id
    assert torch.equal(noisy[:, :12], ids[:, :12])  # the prompt is never masked
    per_row = (noisy[:, 12:] == mask).sum(1)
    assert bool((per_row >= 1).all()) and bool((per_row <= 8).all())
    assert torch.isfinite(loss) and float(loss) > 0


def test_train_resumes_from_checkpoint(tmp_path):
    final = train(small(tmp_path, 2))
    state = torch.load(tmp_path / "run" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 2
    final = train(small(tmp_path, 4))
    state = torch.load(tmp_path / "run" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 4 and [r["step"] for r in state["history"] if "eval" in r] == [2, 4]
    model = load_model(final)
    assert model.config.d_model == 32
    info = json.loads((final / "training.json").read_text())
    assert info["seed"] == 0 and info["recipe"]["steps"] == 4


def test_stop_after_ends_early_with_the_full_schedule(tmp_path):
    from dataclasses import replace

    final = train(replace(small(tmp_path, 6), stop_after=2))
    state = torch.load(tmp_path / "run" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 2 and state["config"]["steps"] == 6
    assert (final / "config.json").is_file()
