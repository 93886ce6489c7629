from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from maskkv_cli.errors import UsageError
from maskkv_cli.models.loading import load_model
from maskkv_cli.training.growth import grow_depth, growth_points, new_block_indices
from maskkv_cli.training.train import train
from tests.test_training import small


def test_growth_points_spread_and_end_at_the_last_layer():
    assert growth_points(4, 0) == []
    assert growth_points(4, 1) == [3]
    assert growth_points(4, 2) == [1, 3]
    assert growth_points(4, 4) == [0, 1, 2, 3]
    with pytest.raises(ValueError):
        growth_points(4, 5)
    with pytest.raises(ValueError):
        growth_points(4, -1)


def test_grown_model_computes_the_same_logits(tiny_model):
    grown = grow_depth(tiny_model, 2).eval()
    assert grown.config.n_layers == tiny_model.config.n_layers + 2
    assert tiny_model.config.n_layers == len(tiny_model.blocks)  # the input model is left as it was
    ids = torch.randint(6, 300, (2, 40))
    torch.testing.assert_close(grown(ids), tiny_model(ids), rtol=0, atol=0)
    # Two layers grow to four: a new block after each, a trained copy apart from its zeroed output projections.
    for index in (0, 1):
        new = grown.blocks[2 * index + 1]
        assert torch.equal(new.q_proj.weight, tiny_model.blocks[index].q_proj.weight)
        assert not new.attn_out.weight.any() and not new.ff_out.weight.any()
        assert torch.equal(grown.blocks[2 * index].attn_out.weight, tiny_model.blocks[index].attn_out.weight)


def test_grown_blocks_learn_from_the_first_step(tiny_model):
    grown = grow_depth(tiny_model, 1).train()
    ids = torch.randint(6, 300, (2, 20))
    grown(ids).logsumexp(-1).mean().backward()
    assert grown.blocks[-1].attn_out.weight.grad.abs().sum() > 0
    assert grown.blocks[-1].ff_out.weight.grad.abs().sum() > 0


def test_train_grows_a_model_given_with_init_from(tmp_path):
    first = train(small(tmp_path / "a", 2))
    final = train(replace(small(tmp_path / "b", 2), init_from=str(first), grow_layers=1))
    assert load_model(final).config.n_layers == 3
    with pytest.raises(UsageError, match="--grow-layers"):
        train(replace(small(tmp_path / "c", 2), init_from=str(first), grow_layers=5))


def test_cli_grow_layers_needs_a_model_to_grow(tmp_path):
    from typer.testing import CliRunner

    from maskkv_cli.cli import app

    result = CliRunner().invoke(app, ["train-tiny", "--out", str(tmp_path / "run"), "--grow-layers", "1"])
    assert result.exit_code != 0
    assert "--init-from" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "run").exists()


def test_new_block_indices_are_the_zeroed_blocks(tiny_model):
    grown = grow_depth(tiny_model, 2)
    zeroed = [i for i, b in enumerate(grown.blocks) if not b.attn_out.weight.any()]
    assert new_block_indices(tiny_model.config.n_layers, 2) == zeroed


def test_freeze_old_trains_only_the_new_blocks_and_the_head(tmp_path):
    first = train(small(tmp_path / "a", 2))
    before = load_model(first)
    final = train(replace(small(tmp_path / "b", 4), init_from=str(first), grow_layers=1, freeze_old=True, warmup=1))
    after = load_model(final)
    new = new_block_indices(before.config.n_layers, 1)
    old_blocks = [b for i, b in enumerate(after.blocks) if i not in new]
    for was, now in zip(before.blocks, old_blocks, strict=True):
        for (name, p), q in zip(was.named_parameters(), now.parameters(), strict=True):
            assert torch.equal(p, q), name  # the trained blocks are unchanged
    assert torch.equal(before.transformer["wte"].weight, after.transformer["wte"].weight)
    assert not torch.equal(before.transformer["ff_out"].weight, after.transformer["ff_out"].weight)
    assert after.blocks[new[0]].attn_out.weight.any()  # the new block learnt
    # resumed from its checkpoint, the run keeps the same blocks frozen
    final = train(replace(small(tmp_path / "b", 6), init_from=str(first), grow_layers=1, freeze_old=True, warmup=1))
    resumed = load_model(final)
    for was, now in zip(before.blocks, [b for i, b in enumerate(resumed.blocks) if i not in new], strict=True):
        assert all(torch.equal(p, q) for p, q in zip(was.parameters(), now.parameters(), strict=True))


def test_cli_freeze_old_needs_grow_layers(tmp_path):
    from typer.testing import CliRunner

    from maskkv_cli.cli import app

    result = CliRunner().invoke(app, ["train-tiny", "--out", str(tmp_path / "run"), "--freeze-old"])
    assert result.exit_code != 0
    assert "--grow-layers" in result.output and "Traceback" not in result.output
