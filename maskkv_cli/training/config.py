"""The tiny model's training settings (``maskkv train-tiny``'s options as one frozen config), its progress events,
option parsing, and the learning-rate and context-length schedules."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from maskkv_cli.errors import UsageError
from maskkv_cli.tasks.sources import SOURCES
from maskkv_cli.tasks.synthetic import KINDS, NUM_DISTRACTORS


@dataclass(frozen=True)
class TrainConfig:
    out: str = "runs/tiny"
    seed: int = 0
    vocab_size: int = 2048
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 8
    mlp_hidden_size: int = 384
    rope_theta: float | None = None  # RoPE base: 10,000 for a new model; with init_from, a new base (None keeps it)
    steps: int = 3000
    batch_size: int = 32
    lr: float = 2e-3
    warmup: int = 100
    min_lr_ratio: float = 0.1
    betas: tuple[float, float] = (0.9, 0.98)
    weight_decay: float = 0.01
    clip: float = 1.0
    min_len: int = 48
    max_len: int = 512
    curriculum_steps: int = 1500
    answer_len: int = 8
    full_mask: float = 0.0  # probability of masking the whole answer region of an example
    position_window: int | None = None  # PoSE-style skips: positions spread over this many (None = contiguous)
    mix: dict[str, float] = field(default_factory=lambda: {"niah_single": 0.5, "niah_multikey": 0.5})
    # niah_multikey training examples draw their number of distractor needles from this range (the evaluation
    # keeps the benchmark's NUM_DISTRACTORS)
    distractors: tuple[int, int] = (NUM_DISTRACTORS, NUM_DISTRACTORS)
    # haystack sources (``tasks/sources.py``) and their weights; the default, the package corpus alone, draws no
    # source at all, so earlier recipes replay the same random stream
    sources: dict[str, float] = field(default_factory=lambda: {"corpus": 1.0})
    summary_len: int = 64  # answer region of lead_summary examples (a lead summary is longer than a number)
    # context tokens of lead_summary batches (None: min_len..max_len, as the others); copying is learnt where the
    # text to copy is near (short contexts), while needle batches keep their long ones
    summary_lengths: tuple[int, int] | None = None
    # full_mask for lead_summary batches (None: the same as full_mask). A summary is copied token by token from
    # the text, which the model learns from the tokens around a masked one, not from a fully masked region.
    summary_full_mask: float | None = None
    # lead_summary batches trained for decoding in blocks of this many tokens (block diffusion: the blocks before
    # one visible, those after it masked); None: the whole region is one block, as for answers
    summary_block: int | None = None
    # weight of the auxiliary loss that asks every visible token for itself (0: the plain masked objective)
    identity_loss: float = 0.0
    # every this many steps, measure which absent keys the model mistakes for present ones and draw the absent_pair
    # twins' keys in proportion (``hard_keys.py``); 0: uniformly
    hard_absent_every: int = 0
    eval_source: str = "corpus"  # haystack of the in-training evaluation
    ckpt_every: int = 100
    eval_every: int = 250
    eval_n: int = 32
    threads: int = 1
    init_from: str | None = None  # start from these weights (and tokenizer) instead of random ones
    grow_layers: int = 0  # with init_from: add this many blocks that start as identities (see growth.py)
    freeze_old: bool = False  # with grow_layers: train only the new blocks, the final norm and the head
    stop_after: int | None = None  # end the run after this many steps (the schedule still spans ``steps``)


@dataclass(frozen=True)
class TrainEvent:
    step: int
    steps: int
    loss: float
    lr: float
    length: int
    elapsed_s: float
    eval: dict[str, float] | None = None
    absent_confusion: float | None = None  # off-diagonal mean of the hard-negative probe, when it ran


def parse_weights(spec: str, option: str, known: Sequence[str], what: str) -> dict[str, float]:
    """``"a:3,b"`` -> ``{"a": 3.0, "b": 1.0}`` for names in ``known`` (a repeated name adds up)."""
    out: dict[str, float] = {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        name, _, weight = part.partition(":")
        if name not in known:
            raise UsageError(f"{option}: unknown {what} {name!r}; choose from {', '.join(known)}")
        try:
            w = float(weight) if weight else 1.0
        except ValueError:
            w = -1.0
        if not w > 0:
            raise UsageError(f"{option}: weight of {name} must be a positive number, got {weight!r}")
        out[name] = out.get(name, 0.0) + w
    if not out:
        raise UsageError(f"{option}: empty list; choose from {', '.join(known)}")
    return out


# A training-only kind: a niah_multikey example and its absent-key twin (the same text asked about a key with no
# needle, answered NO_ANSWER) side by side in one batch (``tasks.synthetic.absent_key_twin``).
ABSENT_PAIR = "absent_pair"


def parse_mix(spec: str) -> dict[str, float]:
    """``"niah_multikey:3,niah_single"`` -> ``{"niah_multikey": 3.0, "niah_single": 1.0}``."""
    return parse_weights(spec, "--kinds", (*KINDS, ABSENT_PAIR), "task kind")


def parse_sources(spec: str) -> dict[str, float]:
    """``"stdlib-train:2,corpus"`` -> ``{"stdlib-train": 2.0, "corpus": 1.0}`` (names from ``tasks/sources.py``)."""
    return parse_weights(spec, "--sources", list(SOURCES), "source")


def parse_range(spec: str, option: str) -> tuple[int, int]:
    """``"3-7"`` -> ``(3, 7)``, ``"3"`` -> ``(3, 3)``; counts >= 0, low <= high."""
    low_text, dash, high_text = spec.strip().partition("-")
    try:
        low = int(low_text)
        high = int(high_text) if dash else low
    except ValueError:
        raise UsageError(f"{option}: expected N or LOW-HIGH (e.g. 3-7), got {spec!r}") from None
    if not 0 <= low <= high:
        raise UsageError(f"{option}: expected 0 <= LOW <= HIGH, got {spec!r}")
    return low, high


def learning_rate(cfg: TrainConfig, step: int) -> float:
    """The learning rate at ``step``: linear warm-up over ``warmup`` steps, then cosine down to ``min_lr_ratio``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def max_len_at(cfg: TrainConfig, step: int) -> int:
    """The curriculum: the longest context at ``step``, from ``min_len`` to ``max_len`` over ``curriculum_steps``."""
    frac = min(1.0, step / max(1, cfg.curriculum_steps))
    return int(cfg.min_len + frac * (cfg.max_len - cfg.min_len))
