from __future__ import annotations

import json
import random

import pytest
import torch

from maskkv_cli.errors import UsageError
from maskkv_cli.models.loading import load_model
from maskkv_cli.training.config import TrainConfig, parse_mix, parse_range
from maskkv_cli.training.examples import Batcher, skipped_positions
from maskkv_cli.training.train import diffusion_loss, train


def small(tmp_path, steps):
    return TrainConfig(out=str(tmp_path / "run"), steps=steps, batch_size=2, vocab_size=300, d_model=32, n_layers=2,
                       n_heads=2, mlp_hidden_size=64, min_len=24, max_len=48, curriculum_steps=2, warmup=1,
                       ckpt_every=2, eval_every=1000, eval_n=2)


def test_batches_keep_prompt_and_pad_left(tiny_tokenizer, tiny_config):
    cfg = TrainConfig(batch_size=3, min_len=30, max_len=40, answer_len=16)
    ids, keep, rows, _, _ = Batcher(cfg, tiny_tokenizer, tiny_config).batch(0, random.Random(0))
    assert rows.shape == (3, 16) and bool((rows[:, -1] == ids.shape[1] - 1).all())
    assert bool(keep[:, -16:].all())
    for i in range(3):  # padding only on the left
        first = int(keep[i].float().argmax())
        assert bool(keep[i, first:].all()) and not bool(keep[i, :first].any())


def _spy_inputs(model, monkeypatch):
    """Record the ids of every forward call of ``model``'s class in ``seen["ids"]``; returns (seen, the real
    forward)."""
    seen = {}
    real = type(model).forward

    def spy(self, ids, key_mask=None, rows=None, positions=None):
        seen["ids"] = ids.clone()
        return real(self, ids, key_mask, rows, positions)

    monkeypatch.setattr(type(model), "forward", spy)
    return seen, real


def test_loss_masks_only_answer_tokens(tiny_model, monkeypatch):
    seen, _ = _spy_inputs(tiny_model, monkeypatch)
    ids = torch.randint(6, 100, (4, 20))
    rows = torch.arange(12, 20).expand(4, 8)
    loss = diffusion_loss(tiny_model, ids, torch.ones(4, 20, dtype=torch.bool), rows, torch.Generator().manual_seed(0))
    noisy = seen["ids"]
    mask = tiny_model.config.mask_token_id
    assert torch.equal(noisy[:, :12], ids[:, :12])  # the prompt is never masked
    per_row = (noisy[:, 12:] == mask).sum(1)
    assert bool((per_row >= 1).all()) and bool((per_row <= 8).all())
    assert torch.isfinite(loss) and float(loss.detach()) > 0


def test_identity_loss_adds_the_cross_entropy_of_visible_tokens(tiny_model):
    torch.manual_seed(0)
    ids = torch.randint(6, 100, (3, 20))
    keep = torch.ones(3, 20, dtype=torch.bool)
    keep[0, :4] = False  # left padding is not a visible token
    rows = torch.arange(12, 20).expand(3, 8)
    plain = diffusion_loss(tiny_model, ids, keep, rows, torch.Generator().manual_seed(1))
    both = diffusion_loss(tiny_model, ids, keep, rows, torch.Generator().manual_seed(1), identity=0.5)
    # the same masking (same generator), so the difference is the identity term alone: recompute it by hand
    gen = torch.Generator().manual_seed(1)
    k = torch.randint(1, 9, (3, 1), generator=gen)
    masked = torch.rand((3, 8), generator=gen).argsort(1) < k
    noisy = ids.clone()
    noisy[:, 12:] = torch.where(masked, tiny_model.config.mask_token_id, ids[:, 12:])
    with torch.no_grad():
        logits = tiny_model(noisy, key_mask=keep)
    visible = keep & (noisy != tiny_model.config.mask_token_id)
    expected = torch.nn.functional.cross_entropy(logits[visible], ids[visible])
    assert float((both - plain).detach()) == pytest.approx(0.5 * float(expected), rel=1e-4)
    assert int(visible.sum()) == 3 * 20 - 4 - int(masked.sum())


def test_block_loss_masks_one_block_and_hides_the_rest(tiny_model, monkeypatch):
    """``block``: per example one block of the answer region holds every masked token of the loss (1..block of
    them), the blocks before it are visible and every token after it is masked in the input; the loss is the
    cross-entropy of the block's masked tokens alone."""
    seen, real = _spy_inputs(tiny_model, monkeypatch)
    torch.manual_seed(0)
    ids = torch.randint(6, 100, (64, 30))
    keep = torch.ones(64, 30, dtype=torch.bool)
    rows = torch.arange(14, 30).expand(64, 16)
    loss = diffusion_loss(tiny_model, ids, keep, rows, torch.Generator().manual_seed(3), block=4)
    noisy, mask = seen["ids"], tiny_model.config.mask_token_id
    assert torch.equal(noisy[:, :14], ids[:, :14])
    starts = set()
    expected = []
    with torch.no_grad():
        logits = real(tiny_model, noisy, keep, rows, None)
    for i in range(64):
        hidden = (noisy[i, 14:] == mask).nonzero().flatten()
        first = int(hidden[0])
        start = first - first % 4
        starts.add(start)
        inside = hidden[hidden < start + 4]
        assert 1 <= len(inside) <= 4
        assert torch.equal(hidden[len(inside):], torch.arange(start + 4, 16))  # everything after the block
        assert torch.equal(noisy[i, 14:14 + start], ids[i, 14:14 + start])  # blocks before it visible
        ce = torch.nn.functional.cross_entropy(logits[i, inside], ids[i, 14 + inside])
        expected.append(float(ce))
    assert starts == {0, 4, 8, 12}
    assert float(loss.detach()) == pytest.approx(sum(expected) / 64, rel=1e-4)
    with pytest.raises(ValueError, match="blocks of 5"):
        diffusion_loss(tiny_model, ids, keep, rows, torch.Generator().manual_seed(3), block=5)


def test_summary_batches_draw_their_own_context_lengths(tiny_tokenizer, tiny_config):
    """``summary_lengths``: lead_summary batches take their context length from that range, the others keep
    min_len..max_len."""
    cfg = TrainConfig(batch_size=1, min_len=300, max_len=400, curriculum_steps=1, summary_len=16,
                      mix={"niah_single": 1.0, "lead_summary": 1.0}, summary_lengths=(24, 40))
    batcher = Batcher(cfg, tiny_tokenizer, tiny_config)
    rng = random.Random(0)
    seen = {True: [], False: []}
    for step in range(24):
        b = batcher.batch(step, rng)
        seen[b.summary].append(b.length)
    assert seen[True] and seen[False]
    assert all(24 <= n <= 40 for n in seen[True]) and all(300 <= n <= 400 for n in seen[False])


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


def test_block_trained_summaries_are_recorded_for_summarize(tmp_path):
    """A run with lead summaries in blocks (``summary_block``) evaluates them decoded in those blocks, and a model
    laid out as embedded records the summary length and block that summarize then reads."""
    from dataclasses import replace

    from maskkv_cli.models.config import ModelDefaults, read_model_defaults
    from maskkv_cli.training.train import install_model

    cfg = replace(small(tmp_path, 2), mix={"niah_single": 1.0, "lead_summary": 1.0}, summary_len=8, summary_block=4)
    final = train(cfg)
    state = torch.load(tmp_path / "run" / "trainer_state.pt", weights_only=False)
    assert "lead_summary" in state["history"][-1]["eval"]
    target = install_model(final, summary_length=8, summary_block=4, target=tmp_path / "embedded")
    assert target == tmp_path / "embedded"
    expected = ModelDefaults({"gen_length": 8, "steps": 8, "block_length": 8}, summary_length=8, summary_block=4)
    assert read_model_defaults(target) == expected
    assert load_model(target).config.max_sequence_length == 2 * cfg.max_len


def test_stop_after_ends_early_with_the_full_schedule(tmp_path):
    from dataclasses import replace

    final = train(replace(small(tmp_path, 6), stop_after=2))
    state = torch.load(tmp_path / "run" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 2 and state["config"]["steps"] == 6
    assert (final / "config.json").is_file()
    train(replace(small(tmp_path, 6), stop_after=2))  # run again: already at --stop-after, it trains no step
    state = torch.load(tmp_path / "run" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 2  # it was 3, then 4: one more step each time


def test_a_run_is_not_resumed_as_another_model(tmp_path):
    """Resuming with another --d-model (or heads, layers, seed, ...) went on training the old model while
    training.json recorded the new options; now refused in one line."""
    from dataclasses import replace

    from maskkv_cli.errors import UsageError

    train(replace(small(tmp_path, 4), stop_after=1))
    with pytest.raises(UsageError, match=r"holds a run of another model: it was started with --d-model 32 \(now 64\);"):
        train(replace(small(tmp_path, 4), d_model=64))  # (not "--mlp-hidden-size 96": no such option)
    state = torch.load(tmp_path / "run" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 1


def test_a_run_that_diverges_stops_and_saves_nothing(tmp_path):
    """A learning rate of 1e30 made every weight NaN: the run went on printing "loss": NaN (no JSON), exit 0, and
    saved the NaN model as the final one."""
    from dataclasses import replace

    from maskkv_cli.errors import MaskKVError

    with pytest.raises(MaskKVError, match=r"training diverged at step \d+ \(.*\); nothing of it was saved .*smaller"):
        train(replace(small(tmp_path, 4), lr=1e30))
    assert not (tmp_path / "run" / "final").exists()


def _masked_counts(model, full_mask, seed=0):
    seen = {}
    real = type(model).forward

    def spy(self, ids, key_mask=None, rows=None, positions=None):
        seen["ids"] = ids.clone()
        return real(self, ids, key_mask, rows, positions)

    ids = torch.randint(6, 100, (256, 12))
    rows = torch.arange(4, 12).expand(256, 8)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(model), "forward", spy)
        diffusion_loss(model, ids, torch.ones(256, 12, dtype=torch.bool), rows, torch.Generator().manual_seed(seed),
                       full_mask)
    return (seen["ids"][:, 4:] == model.config.mask_token_id).sum(1)


def test_full_mask_masks_whole_answers_more_often(tiny_model):
    plain = _masked_counts(tiny_model, 0.0)
    heavy = _masked_counts(tiny_model, 0.75)
    always = _masked_counts(tiny_model, 1.0)
    assert bool((always == 8).all())
    # k ~ U{1..8} gives all 8 masked about 1/8 of the time; with 0.75 it is about 0.75 + 0.25/8
    assert float((plain == 8).float().mean()) < 0.25 < 0.6 < float((heavy == 8).float().mean())


def test_skipped_positions_keep_order_and_reach_the_window():
    rng = random.Random(0)
    seen_skip = seen_plain = False
    longest = 0
    for _ in range(200):
        pos = skipped_positions(50, 400, rng)
        if pos is None:
            seen_plain = True
            continue
        diffs = pos[1:] - pos[:-1]
        assert pos.shape == (50,) and int(pos[0]) == 0 and bool((diffs >= 1).all())
        assert int((diffs > 1).sum()) <= 1 and int(pos[-1]) < 400  # one skip, inside the window
        seen_skip = seen_skip or bool((diffs > 1).any())
        longest = max(longest, int(pos[-1]))
    assert seen_skip and seen_plain and longest > 300
    assert skipped_positions(50, None, rng) is None and skipped_positions(50, 50, rng) is None


def test_positions_change_the_logits_only_through_rope(tiny_model):
    ids = torch.randint(6, 100, (1, 16))
    default = tiny_model(ids)
    same = tiny_model(ids, positions=torch.arange(16))
    shifted = tiny_model(ids, positions=torch.arange(16) + 100)  # RoPE is relative: a common shift changes nothing
    torch.testing.assert_close(same, default)
    torch.testing.assert_close(shifted, default, atol=1e-4, rtol=1e-4)
    skipped = tiny_model(ids, positions=torch.cat([torch.arange(8), torch.arange(8) + 200]))
    assert not torch.allclose(skipped, default, atol=1e-3)


def test_parse_mix():
    assert parse_mix("niah_multikey:3,niah_single") == {"niah_multikey": 3.0, "niah_single": 1.0}
    for bad, msg in (("nope", "unknown"), ("niah_single:x", "positive"), ("niah_single:0", "positive"),
                     (" , ", "empty")):
        with pytest.raises(UsageError, match=msg):
            parse_mix(bad)


def test_parse_range():
    assert parse_range("3-7", "--x") == (3, 7) and parse_range(" 4 ", "--x") == (4, 4)
    for bad in ("", "a", "3-", "7-3", "-1"):
        with pytest.raises(UsageError, match="--x"):
            parse_range(bad, "--x")


def test_batches_draw_distractor_counts_from_the_range(tiny_tokenizer, tiny_config, monkeypatch):
    import maskkv_cli.training.examples as training

    seen: list[int] = []
    real = training.generate_tasks

    def spy(*args, **kwargs):
        seen.append(kwargs["distractors"])
        return real(*args, **kwargs)

    monkeypatch.setattr(training, "generate_tasks", spy)
    cfg = TrainConfig(batch_size=40, min_len=60, max_len=60, mix={"niah_multikey": 1.0}, distractors=(2, 5))
    Batcher(cfg, tiny_tokenizer, tiny_config).batch(0, random.Random(0))
    assert set(seen) == {2, 3, 4, 5}
    # A fixed count draws nothing more from the random stream: the batch is the one of runs before the option.
    fixed = TrainConfig(batch_size=4, min_len=60, max_len=60, mix={"niah_multikey": 1.0}, answer_len=16)
    batcher = Batcher(fixed, tiny_tokenizer, tiny_config)
    ids = batcher.batch(0, random.Random(1))[0]
    rng = random.Random(1)
    length = rng.randint(60, 60)
    expected = []
    for _ in range(4):
        rng.choices(["niah_multikey"], [1.0])
        task = real("niah_multikey", 1, length, seed=rng.randrange(1 << 31), count_tokens=batcher.count)[0]
        expected.append(task.context)
    for row, context in zip(ids, expected, strict=True):
        assert tiny_tokenizer.decode(row.tolist()).count(context[-40:]) == 1


def test_rope_theta_sets_a_new_base_on_a_trained_model(tmp_path):
    from dataclasses import replace

    first = train(small(tmp_path / "a", 2))
    assert load_model(first).config.rope_theta == 10000.0
    moved = train(replace(small(tmp_path / "b", 2), init_from=str(first), rope_theta=500000.0))
    assert load_model(moved).config.rope_theta == 500000.0
    kept = train(replace(small(tmp_path / "c", 2), init_from=str(first)))
    assert load_model(kept).config.rope_theta == 10000.0


def test_cli_passes_training_options_and_refuses_bad_ones(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import maskkv_cli.training.train as training
    from maskkv_cli.cli import app

    seen: list[TrainConfig] = []

    def fake_train(cfg, on_event=None):
        seen.append(cfg)
        return tmp_path / "final"

    monkeypatch.setattr(training, "train", fake_train)
    base = ["train-tiny", "--out", str(tmp_path / "run")]
    result = CliRunner().invoke(app, [*base, "--distractors", "3-7", "--eval-n", "80", "--eval-every", "100",
                                      "--full-mask", "0.5", "--summary-full-mask", "0", "--summary-block", "4",
                                      "--summary-lengths", "24-128"])
    assert result.exit_code == 0, result.output
    assert (seen[0].distractors, seen[0].eval_n, seen[0].eval_every) == ((3, 7), 80, 100)
    assert (seen[0].full_mask, seen[0].summary_full_mask, seen[0].summary_block) == (0.5, 0.0, 4)
    assert seen[0].summary_lengths == (24, 128)
    for bad, message in ((["--eval-n", "0"], "--eval-n"), (["--distractors", "2-200"], "at most"),
                         (["--summary-full-mask", "2"], "--summary-full-mask"),
                         (["--summary-block", "5"], "divisor of --summary-len"),
                         (["--summary-lengths", "0-9"], "--summary-lengths"),
                         (["--distractors", "x"], "--distractors"),
                         (["--steps", "0"], "positive integers: --steps 0"),
                         (["--stop-after", "0"], "--stop-after 0"), (["--lr", "0"], "--lr must be a positive"),
                         (["--lr", "inf"], "--lr must be a positive number, got inf"),
                         (["--position-window", "10"], "--position-window must be longer than --max-len"),
                         (["--window", "4096"], "--window is the window of the model --install installs"),
                         (["--install", "--window", "10"], "--window must be at least --max-len"),
                         (["--install", "--window", "-1"], "--window must be at least --max-len"),
                         (["--hard-absent-every", "5"], "give --kinds with absent_pair too"),
                         (["--min-len", "600"], "--min-len <= --max-len"),
                         (["--d-model", "136"], "multiple of twice --heads")):
        result = CliRunner().invoke(app, [*base, *bad])
        assert result.exit_code != 0 and message in result.output and "Traceback" not in result.output
    assert len(seen) == 1


def test_absent_pairs_put_a_multikey_example_beside_its_unanswerable_twin(tiny_tokenizer, tiny_config):
    from maskkv_cli.prompting import NO_ANSWER

    cfg = TrainConfig(batch_size=5, min_len=60, max_len=60, mix=parse_mix("absent_pair"), answer_len=32,
                      distractors=(0, 3))
    ids, keep, _, _, _ = Batcher(cfg, tiny_tokenizer, tiny_config).batch(0, random.Random(0))
    texts = [tiny_tokenizer.decode(row[k].tolist()) for row, k in zip(ids, keep, strict=True)]
    no_answer = tiny_tokenizer.decode(tiny_tokenizer.encode(NO_ANSWER, add_special_tokens=False))
    for first, second in zip(texts[0:4:2], texts[1:4:2], strict=True):
        head, _, asked = first.rpartition("special magic number for ")
        twin_head, _, twin_asked = second.rpartition("special magic number for ")
        assert head == twin_head  # the same document and template up to the question's key
        key, twin_key = asked.split("?")[0], twin_asked.split("?")[0]
        assert f"number for {key} is" in head and f"number for {twin_key} is" not in head
        assert no_answer not in asked and no_answer in twin_asked
    assert no_answer not in texts[4].rpartition("?")[2]  # an odd batch ends with the first of a pair


def test_absent_pairs_are_evaluated_as_absent_keys(tmp_path, monkeypatch):
    from dataclasses import replace

    import maskkv_cli.training.train as training

    kinds: list[str] = []
    real = training.generate_tasks

    def spy(kind, *args, **kwargs):
        kinds.append(kind)
        return real(kind, *args, **kwargs)

    monkeypatch.setattr(training, "generate_tasks", spy)
    train(replace(small(tmp_path, 1), mix=parse_mix("niah_single,absent_pair")))
    assert kinds == ["niah_single", "niah_multikey", "niah_none"]


def test_train_tiny_options_are_one_object(tmp_path, monkeypatch):
    """train-tiny's options are TrainOptions' fields (plus --json, how it prints), given to the run as one object
    that makes the run's TrainConfig."""
    import dataclasses
    import inspect

    from typer.testing import CliRunner

    from maskkv_cli.cli import app
    from maskkv_cli.cli.commands.train import train_tiny
    from maskkv_cli.training.config import TrainOptions

    fields = [f.name for f in dataclasses.fields(TrainOptions)]
    assert list(inspect.signature(train_tiny).parameters) == [*fields, "as_json"]
    seen: list[TrainOptions] = []
    to_config = TrainOptions.to_config

    def stop(options: TrainOptions) -> TrainConfig:
        seen.append(options)
        raise UsageError("stop")

    monkeypatch.setattr(TrainOptions, "to_config", stop)
    result = CliRunner().invoke(app, ["train-tiny", "--out", str(tmp_path), "--layers", "3", "--kinds", "vt:2",
                                      "--init-from", str(tmp_path), "--freeze-old"])
    assert result.exit_code == 2 and "stop" in result.output
    assert seen == [TrainOptions(out=tmp_path, n_layers=3, kinds="vt:2", init_from=tmp_path, freeze_old=True)]
    cfg = to_config(TrainOptions(kinds="niah_multikey:3,vt", distractors="2-4", d_model=64, out=tmp_path))
    assert (cfg.mix, cfg.distractors, cfg.mlp_hidden_size, cfg.out) == ({"niah_multikey": 3.0, "vt": 1.0}, (2, 4),
                                                                        192, str(tmp_path))
