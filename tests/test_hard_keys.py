"""Hard-negative absent keys (maskkv_cli/training/hard_keys.py) and the twins and training runs that use them."""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import replace

import pytest
import torch

from maskkv_cli.prompting import NO_ANSWER
from maskkv_cli.tasks.synthetic import absent_key_twin, generate_tasks, present_keys
from maskkv_cli.training.config import TrainConfig, parse_mix
from maskkv_cli.training.hard_keys import absent_confusion, off_diagonal_mean, pick_absent_key


class KeyReader:
    """A stand-in model that answers NO_ANSWER when the asked key has no needle in the prompt, except that it takes
    "apple"'s needle for "violin"'s: its confusion matrix must be the identity plus that one entry, at row "violin"
    (asked), column "apple" (present)."""

    def __init__(self, tok, config) -> None:
        self.tok, self.config, self.training = tok, config, True
        self.no_answer = tok.encode(NO_ANSWER, add_special_tokens=False)[0]
        self.digit = tok.encode("7", add_special_tokens=False)[0]

    def eval(self) -> KeyReader:
        self.training = False
        return self

    def train(self, mode: bool = True) -> KeyReader:
        self.training = mode
        return self

    def __call__(self, ids, key_mask=None, rows=None):
        assert not self.training and rows is not None and key_mask is not None
        logits = torch.zeros(ids.shape[0], rows.shape[1], self.config.vocab_size)
        for i, row in enumerate(ids):
            text = self.tok.decode(row[key_mask[i]].tolist())
            asked = text.rpartition("special magic number for ")[2].split("?")[0]
            present = f"number for {asked} is" in text or (asked == "violin" and "number for apple is" in text)
            logits[i, :, self.digit if present else self.no_answer] = 20.0
        return logits


def test_confusion_rows_are_the_asked_keys_and_columns_the_present_ones(tiny_tokenizer, tiny_config):
    keys = ("apple", "violin", "zebra", "candle")
    model = KeyReader(tiny_tokenizer, tiny_config)
    paragraphs = ["A short paragraph of plain words that says nothing about any number at all here."] * 3
    confusion = absent_confusion(model, tiny_tokenizer, paragraphs, random.Random(0), keys=keys)
    assert confusion.shape == (4, 4)
    expected = torch.eye(4)
    expected[1, 0] = 1.0
    assert torch.allclose(confusion, expected, atol=1e-6)
    assert off_diagonal_mean(confusion) == pytest.approx(1 / 12, abs=1e-6)
    assert model.training  # the model's mode is restored


def test_pick_absent_key_prefers_confused_keys_and_never_a_present_one():
    keys = ("a", "b", "c", "d")
    confusion = torch.zeros(4, 4)
    confusion[2, 0] = 1.0  # asked "c", the model answers with "a"'s number
    rng = random.Random(0)
    drawn = Counter(pick_absent_key(["a", "b"], confusion, rng, keys=keys) for _ in range(400))
    assert set(drawn) == {"c", "d"}  # the floor keeps "d" in the draw
    assert drawn["c"] > 300  # weights 0.05 + 0.5 against 0.05


def test_absent_key_twin_asks_the_key_it_is_given_and_refuses_a_present_one():
    task = generate_tasks("niah_multikey", 1, 120, seed=3)[0]
    absent = next(k for k in ("apple", "zebra", "violin") if k not in present_keys(task))
    twin = absent_key_twin(task, random.Random(0), absent)
    assert twin.meta["key"] == absent and twin.answers == (NO_ANSWER,)
    with pytest.raises(ValueError, match="has a needle"):
        absent_key_twin(task, random.Random(0), task.meta["distractor_keys"][0])


def test_training_with_hard_absent_keys_probes_the_model_and_asks_its_confused_keys(tmp_path, monkeypatch):
    import maskkv_cli.training.examples as examples
    import maskkv_cli.training.train as training
    from maskkv_cli.tasks.synthetic import KEY_WORDS

    probed: list[int] = []
    asked: list[str] = []
    real_twin = examples.absent_key_twin

    def fake_confusion(model, tok, paragraphs, rng, keys=KEY_WORDS, answer_len=8):
        probed.append(len(paragraphs))
        confusion = torch.zeros(len(keys), len(keys))
        confusion[keys.index("zebra")] = 1.0  # "zebra" is mistaken for every key
        return confusion

    def spy_twin(task, rng, key=None):
        twin = real_twin(task, rng, key)
        asked.append(twin.meta["key"])
        return twin

    monkeypatch.setattr(training, "absent_confusion", fake_confusion)
    monkeypatch.setattr(examples, "absent_key_twin", spy_twin)
    cfg = TrainConfig(out=str(tmp_path / "run"), steps=4, batch_size=8, vocab_size=300, d_model=32, n_layers=2,
                      n_heads=2, mlp_hidden_size=64, min_len=24, max_len=48, curriculum_steps=2, warmup=1,
                      ckpt_every=10, eval_every=1000, eval_n=1, mix=parse_mix("absent_pair"), hard_absent_every=2)
    final = training.train(cfg)
    assert len(probed) == 2 and probed[0] > 0  # steps 0 and 2, on the corpus's paragraphs
    # weight 1 + floor against the floor for each of ~97 other keys: about 1 in 6 (uniformly: 1 in 97)
    assert len(asked) >= 30 and Counter(asked)["zebra"] / len(asked) > 0.08
    history = json.loads((final / "training.json").read_text())["history"]
    assert any("absent_confusion" in row for row in history)
    uniform = replace(cfg, out=str(tmp_path / "uniform"), hard_absent_every=0)
    probed.clear()
    training.train(uniform)
    assert probed == []


def test_cli_passes_hard_absent_every_and_refuses_a_negative_one(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import maskkv_cli.training.train as training
    from maskkv_cli.cli import app

    seen: list[TrainConfig] = []
    monkeypatch.setattr(training, "train", lambda cfg, on_event=None: seen.append(cfg) or tmp_path / "final")
    base = ["train-tiny", "--out", str(tmp_path / "run"), "--kinds", "absent_pair"]
    result = CliRunner().invoke(app, [*base, "--hard-absent-every", "250"])
    assert result.exit_code == 0, result.output
    assert seen[0].hard_absent_every == 250
    result = CliRunner().invoke(app, [*base, "--hard-absent-every", "-1"])
    assert result.exit_code != 0 and "--hard-absent-every" in result.output and "Traceback" not in result.output
    assert len(seen) == 1
