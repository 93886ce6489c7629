"""The tiny model's training settings: ``TrainOptions`` (``maskkv train-tiny``'s options as given, built once from the
command line) and ``TrainConfig`` (the run's frozen config that ``TrainOptions.to_config`` checks and parses them
into); its progress events, option parsing, and the learning-rate and context-length schedules."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from maskkv_cli.errors import UsageError
from maskkv_cli.tasks.sources import SOURCES
from maskkv_cli.tasks.synthetic import KINDS, NUM_DISTRACTORS, max_distractors


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
    # training examples of the kinds with distractors draw their number of them from this range (the evaluation
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


@dataclass(frozen=True)
class TrainOptions:
    """``maskkv train-tiny``'s options as the user gives them (lists, weights and ranges still text), in the order
    ``--help`` shows them; ``to_config`` checks them and makes the run's ``TrainConfig``. ``install``/``window``:
    what to do with the final model."""

    out: Path = Path("runs/tiny")
    steps: int = 3000
    batch_size: int = 32
    lr: float = 2e-3
    min_len: int = 48
    max_len: int = 512
    curriculum_steps: int = 1500
    kinds: str = "niah_single,niah_multikey"  # KIND:W weights, as parse_mix reads them
    distractors: str = "3"  # N or LOW-HIGH
    answer_len: int = 8
    sources: str = "corpus"  # NAME:W weights, as parse_sources reads them
    summary_len: int = 64
    eval_source: str = "corpus"
    eval_n: int = 32
    eval_every: int = 250
    full_mask: float = 0.0
    summary_full_mask: float | None = None
    summary_lengths: str | None = None  # LOW-HIGH
    summary_block: int | None = None
    identity_loss: float = 0.0
    hard_absent_every: int = 0
    position_window: int | None = None
    init_from: Path | None = None
    grow_layers: int = 0
    freeze_old: bool = False
    rope_theta: float | None = None
    stop_after: int | None = None
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 8
    threads: int = 1
    seed: int = 0
    install: bool = False
    window: int | None = None

    def to_config(self) -> TrainConfig:
        """The run's config; a bad option raises ``UsageError`` naming it, before any training starts."""
        positive = {"--steps": self.steps, "--batch-size": self.batch_size, "--min-len": self.min_len,
                    "--max-len": self.max_len, "--answer-len": self.answer_len, "--d-model": self.d_model,
                    "--layers": self.n_layers, "--heads": self.n_heads, "--threads": self.threads,
                    "--stop-after": 1 if self.stop_after is None else self.stop_after}
        bad = [f"{flag} {value}" for flag, value in positive.items() if value < 1]
        if bad:
            raise UsageError(f"these must be positive integers: {', '.join(bad)}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise UsageError(f"--lr must be a positive number, got {self.lr}")
        if self.position_window is not None and self.position_window <= self.max_len:
            raise UsageError(f"--position-window must be longer than --max-len ({self.max_len}): positions are "
                             f"spread over it beyond the training contexts; got {self.position_window}")
        if self.window is not None and not self.install:
            raise UsageError("--window is the window of the model --install installs: give it with --install")
        if self.window is not None and self.window < self.max_len:
            raise UsageError(f"--window must be at least --max-len ({self.max_len}), the longest context the model "
                             f"is trained on; got {self.window}")
        if self.min_len > self.max_len or self.curriculum_steps < 0:
            raise UsageError(f"need --min-len <= --max-len and --curriculum-steps >= 0, got {self.min_len}, "
                             f"{self.max_len} and {self.curriculum_steps}")
        if self.d_model % (2 * self.n_heads):  # an even head size, as RoPE's half-split rotation takes
            raise UsageError(f"--d-model {self.d_model} must be a multiple of twice --heads ({2 * self.n_heads})")
        mix = parse_mix(self.kinds)
        source_mix = parse_sources(self.sources)
        if self.eval_source not in SOURCES:
            raise UsageError(f"--eval-source: unknown source {self.eval_source!r}; choose from {', '.join(SOURCES)}")
        if self.summary_len < 2:
            raise UsageError(f"--summary-len must be at least 2 tokens, got {self.summary_len}")
        distractor_range = parse_range(self.distractors, "--distractors")
        summary_range = parse_range(self.summary_lengths, "--summary-lengths") if self.summary_lengths else None
        if summary_range is not None and summary_range[0] < 1:
            raise UsageError(f"--summary-lengths: contexts must be at least 1 token, got {self.summary_lengths!r}")
        if distractor_range[1] > max_distractors():
            raise UsageError(f"--distractors: at most {max_distractors()} (one key word each), got "
                             f"{self.distractors!r}")
        if self.rope_theta is not None and self.rope_theta <= 1:
            raise UsageError(f"--rope-theta must be greater than 1, got {self.rope_theta}")
        if self.grow_layers and self.init_from is None:
            raise UsageError("--grow-layers adds blocks to a trained model: give it with --init-from")
        if self.freeze_old and not self.grow_layers:
            raise UsageError("--freeze-old keeps the trained blocks fixed while new ones learn: give --grow-layers "
                             "too")
        if not 0 <= self.grow_layers:
            raise UsageError(f"--grow-layers must be >= 0, got {self.grow_layers}")
        if self.eval_n < 1 or self.eval_every < 1:
            raise UsageError(f"--eval-n and --eval-every must be positive, got {self.eval_n} and {self.eval_every}")
        if not 0.0 <= self.full_mask <= 1.0:
            raise UsageError(f"--full-mask must be a probability between 0 and 1, got {self.full_mask}")
        if self.hard_absent_every < 0:
            raise UsageError(f"--hard-absent-every must be >= 0 (0: off), got {self.hard_absent_every}")
        if self.hard_absent_every and ABSENT_PAIR not in mix:
            raise UsageError(f"--hard-absent-every draws the {ABSENT_PAIR} tasks' keys: give --kinds with "
                             f"{ABSENT_PAIR} too")
        if self.identity_loss < 0:
            raise UsageError(f"--identity-loss must be >= 0, got {self.identity_loss}")
        if self.summary_block is not None and (self.summary_block < 1 or self.summary_len % self.summary_block):
            raise UsageError(f"--summary-block must be a positive divisor of --summary-len ({self.summary_len}), "
                             f"got {self.summary_block}")
        if self.summary_full_mask is not None and not 0.0 <= self.summary_full_mask <= 1.0:
            raise UsageError(f"--summary-full-mask must be a probability between 0 and 1, got "
                             f"{self.summary_full_mask}")
        return TrainConfig(
            out=str(self.out), steps=self.steps, batch_size=self.batch_size, lr=self.lr, min_len=self.min_len,
            max_len=self.max_len, curriculum_steps=self.curriculum_steps, d_model=self.d_model,
            n_layers=self.n_layers, n_heads=self.n_heads, mlp_hidden_size=3 * self.d_model, threads=self.threads,
            seed=self.seed, answer_len=self.answer_len, full_mask=self.full_mask,
            position_window=self.position_window, distractors=distractor_range, eval_n=self.eval_n,
            eval_every=self.eval_every, sources=source_mix, summary_len=self.summary_len,
            eval_source=self.eval_source, summary_full_mask=self.summary_full_mask, identity_loss=self.identity_loss,
            summary_block=self.summary_block, summary_lengths=summary_range, mix=mix,
            init_from=str(self.init_from) if self.init_from else None, grow_layers=self.grow_layers,
            freeze_old=self.freeze_old, rope_theta=self.rope_theta, stop_after=self.stop_after,
            hard_absent_every=self.hard_absent_every)
