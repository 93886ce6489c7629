"""Hard negatives for absent-key twins: the absent keys a model mistakes for the keys whose needles are present.

The tiny model's wrong answers to absent keys are, as a rule, the number of one particular other key ("drum" read
as "flag", "planet" as "letter"): a confusion between two key words, the same whichever text and length they come
in. A twin with a uniformly drawn absent key meets a given pair of the 102 key words about once in a few hundred
steps, so those pairs are seldom trained. ``absent_confusion`` measures every ordered pair on short texts, and
``pick_absent_key`` draws the twin's key in proportion to how strongly the model confuses it with the keys that are
present (with a floor, so every key keeps being drawn).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import torch

from maskkv_cli.models.llada import LLaDA
from maskkv_cli.prompting import NO_ANSWER, chat_prompt_ids, document_question
from maskkv_cli.tasks.synthetic import KEY_WORDS, NEEDLE_TEMPLATE, NUMBER_DIGITS, QUESTION_SINGLE
from maskkv_cli.training.padding import left_padded

# Weight every candidate key gets besides its confusion (the mean over the present keys, 0-1): the off-diagonal
# mean of the stage-24 models was about 0.07, their strongest pairs near 1, so a confused key is drawn up to
# twenty times as often as a key the model already tells apart. Set once, not tuned.
HARD_FLOOR = 0.05
_WORDS = (10, 30)  # words of the filler paragraphs around the probe's needle (short: the probe runs 102 batches)


@torch.no_grad()
def absent_confusion(model: LLaDA, tok: Any, paragraphs: Sequence[str], rng: random.Random,
                     keys: Sequence[str] = KEY_WORDS, answer_len: int = 8) -> torch.Tensor:
    """(K, K): entry [a, b] is the probability that the first answer token is not NO_ANSWER's first token when the
    model, its whole answer masked, is asked for key ``a`` about a text of two short paragraphs around one needle,
    key ``b``'s. Off the diagonal the asked key is absent: the chance the model answers with something else (b's
    number, as a rule). On the diagonal it is present. One text per column, from ``paragraphs``."""
    short = [p for p in paragraphs if _WORDS[0] <= len(p.split()) <= _WORDS[1]] or list(paragraphs)
    first = tok.encode(NO_ANSWER, add_special_tokens=False)[0]
    cfg = model.config
    was_training = model.training
    model.eval()
    out = torch.zeros(len(keys), len(keys))
    for column, present in enumerate(keys):
        digits = rng.randint(*NUMBER_DIGITS)
        needle = NEEDLE_TEMPLATE.format(key=present, value=rng.randint(10 ** (digits - 1), 10**digits - 1))
        text = "\n\n".join((" ".join(rng.choice(short).split()[: _WORDS[1]]), needle,
                            " ".join(rng.choice(short).split()[: _WORDS[1]])))
        prompts = [chat_prompt_ids(tok, document_question(text, QUESTION_SINGLE.format(key=k))) for k in keys]
        ids, keep = left_padded([p + [cfg.mask_token_id] * answer_len for p in prompts], cfg.pad_token_id)
        width = ids.shape[1]
        logits = model(ids, key_mask=keep, rows=torch.full((len(keys), 1), width - answer_len))[:, 0]
        out[:, column] = 1.0 - logits.float().softmax(-1)[:, first]
    model.train(was_training)
    return out


def off_diagonal_mean(confusion: torch.Tensor) -> float:
    """The mean confusion over pairs of different keys: the chance of a wrong answer to an absent key on a probe
    text, averaged over every pair."""
    k = confusion.shape[0]
    return float((confusion.sum() - confusion.diagonal().sum()) / (k * k - k))


def pick_absent_key(present: Sequence[str], confusion: torch.Tensor, rng: random.Random,
                    keys: Sequence[str] = KEY_WORDS, floor: float = HARD_FLOOR) -> str:
    """A key with no needle among ``present``, drawn with weight ``floor`` + the mean of its confusion with the
    present keys (``absent_confusion``'s rows and columns follow ``keys``)."""
    index = {k: i for i, k in enumerate(keys)}
    columns = [index[k] for k in present]
    candidates = [k for k in keys if k not in set(present)]
    weights = [floor + float(confusion[index[k], columns].mean()) for k in candidates]
    return rng.choices(candidates, weights)[0]
