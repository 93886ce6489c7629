"""Training examples for the tiny model: the tokenizer's texts, a task as (prompt ids, answer ids), batches of
examples padded into one tensor, and PoSE-style position skips."""

from __future__ import annotations

import random
from typing import Any, NamedTuple

import torch

from maskkv_cli.documents.corpus import load_corpus
from maskkv_cli.models.config import ModelConfig
from maskkv_cli.prompting import chat_prompt_ids, document_question
from maskkv_cli.prompting.parts import LEAD_SENTENCES, lead_sentences
from maskkv_cli.tasks.sources import load_source
from maskkv_cli.tasks.synthetic import absent_key_twin, generate_tasks, present_keys
from maskkv_cli.tasks.taskio import Task
from maskkv_cli.training.config import ABSENT_PAIR, TrainConfig, max_len_at
from maskkv_cli.training.hard_keys import pick_absent_key
from maskkv_cli.training.padding import left_padded

# The task kinds whose texts the tokenizer was trained on (stage 1 of the shipped model); kinds added later are
# left out so that replaying the recipe builds the same tokenizer.
TOKENIZER_KINDS: tuple[str, ...] = ("niah_single", "niah_multikey", "niah_multivalue", "vt")


def tokenizer_texts(seed: int) -> list[str]:
    """Corpus paragraphs plus needle-like sentences, so digits and task phrasing get merges."""
    rng = random.Random(seed)
    texts = load_corpus()
    for kind in TOKENIZER_KINDS:
        for t in generate_tasks(kind, 20, 200, seed=rng.randrange(1 << 30)):
            texts.append(t.input + " " + " ".join(t.answers))
    return texts


def summary_target(tok: Any, context: str, room: int) -> list[int]:
    """Ids of the lead summary that fits in ``room`` tokens: as many of the first ``LEAD_SENTENCES`` sentences as
    fit whole, or the first sentence cut to ``room`` when even it does not."""
    sentences = lead_sentences(context, LEAD_SENTENCES)
    best: list[int] = []
    for i in range(1, len(sentences) + 1):
        ids = list(tok.encode(" ".join(sentences[:i]), add_special_tokens=False))
        if len(ids) > room:
            return best or ids[:room]
        best = ids
    return best


def encode_example(tok: Any, cfg: ModelConfig, task: Task, answer_len: int) -> tuple[list[int], list[int]] | None:
    """(prompt ids, answer region ids) or None when the answer does not fit."""
    prompt = chat_prompt_ids(tok, document_question(task.context, task.input))
    if task.dataset == "lead_summary":
        answer = summary_target(tok, task.context, answer_len - 1)
    else:
        answer = list(tok.encode(task.answers[0], add_special_tokens=False))
    if len(answer) + 1 > answer_len:
        return None
    region = answer + [cfg.eot_token_id] + [cfg.eos_token_id] * (answer_len - len(answer) - 1)
    return prompt, region


class TrainBatch(NamedTuple):
    """ids (B, T) left-padded, key mask (B, T), answer rows (B, R), the context length drawn, and whether the
    batch holds lead summaries (their own masking rate, ``--summary-full-mask``)."""

    ids: torch.Tensor
    keep: torch.Tensor
    rows: torch.Tensor
    length: int
    summary: bool


class Batcher:
    def __init__(self, cfg: TrainConfig, tok: Any, mcfg: ModelConfig) -> None:
        self.cfg, self.tok, self.mcfg = cfg, tok, mcfg
        # lead_summary examples have a longer answer region, so they come in batches of their own
        self.summary_share = cfg.mix.get("lead_summary", 0.0) / sum(cfg.mix.values())
        self.kinds = [k for k in cfg.mix if k != "lead_summary"]
        self.weights = [cfg.mix[k] for k in self.kinds]
        self.count = lambda text: len(tok.encode(text, add_special_tokens=False))
        self.source_names = list(cfg.sources)
        self.source_weights = [cfg.sources[k] for k in self.source_names]
        self.haystacks = {name: None if name == "corpus" else load_source(name) for name in self.source_names}
        # absent_confusion of the model being trained: set, the twins' absent keys are hard negatives
        self.confusion: torch.Tensor | None = None

    def _haystack(self, rng: random.Random) -> list[str] | None:
        if len(self.source_names) == 1:
            return self.haystacks[self.source_names[0]]
        return self.haystacks[rng.choices(self.source_names, self.source_weights)[0]]

    def examples(self, step: int, n: int, length: int, rng: random.Random,
                 summary: bool = False) -> list[tuple[list[int], list[int]]]:
        out: list[tuple[list[int], list[int]]] = []
        while len(out) < n:
            kind = "lead_summary" if summary else rng.choices(self.kinds, self.weights)[0]
            low, high = self.cfg.distractors
            # A fixed count draws nothing, so runs from before the option see the same random stream.
            distractors = low if low == high else rng.randint(low, high)
            haystack = self._haystack(rng)
            task = generate_tasks("niah_multikey" if kind == ABSENT_PAIR else kind, 1, length,
                                  seed=rng.randrange(1 << 31), count_tokens=self.count, distractors=distractors,
                                  haystack=haystack)[0]
            tasks = [task]
            if kind == ABSENT_PAIR:
                hard = None if self.confusion is None else pick_absent_key(present_keys(task), self.confusion, rng)
                tasks.append(absent_key_twin(task, rng, hard))
            region = self.cfg.summary_len if summary else self.cfg.answer_len
            for task in tasks[: n - len(out)]:
                ex = encode_example(self.tok, self.mcfg, task, region)
                if ex is not None:
                    out.append(ex)
        return out

    def batch(self, step: int, rng: random.Random) -> TrainBatch:
        """One batch of examples of one context length (and one answer region: needles or lead summaries)."""
        length = rng.randint(self.cfg.min_len, max_len_at(self.cfg, step))
        summary = self.summary_share > 0 and (not self.kinds or rng.random() < self.summary_share)
        if summary and self.cfg.summary_lengths:
            length = rng.randint(*self.cfg.summary_lengths)
        exs = self.examples(step, self.cfg.batch_size, length, rng, summary)
        r = self.cfg.summary_len if summary else self.cfg.answer_len
        ids, keep = left_padded([p + a for p, a in exs], self.mcfg.pad_token_id)
        t = ids.shape[1]
        rows = torch.arange(t - r, t).expand(len(exs), r)
        return TrainBatch(ids, keep, rows, length, summary)


def skipped_positions(length: int, window: int | None, rng: random.Random) -> torch.Tensor | None:
    """RoPE positions for a training sequence of ``length`` tokens that reach up to ``window`` (PoSE, Zhu et
    al. 2023): half the batches keep 0..T-1; the others split the sequence at a random point and shift the part
    after it by a random skip, so relative distances up to ``window`` are seen on short inputs while nearby
    tokens keep their usual spacing. None when no skip applies."""
    if window is None or window <= length or rng.random() < 0.5:
        return None
    split = rng.randint(1, length - 1)
    positions = torch.arange(length)
    positions[split:] += rng.randint(0, window - length)
    return positions
