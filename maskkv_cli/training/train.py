"""Train a tiny LLaDA on synthetic retrieval tasks with the masked-diffusion objective.

Objective: the prompt is never masked; in the answer region (the answer, ``<|eot_id|>``, then EOS padding to
``answer_len`` tokens) k tokens are masked with k uniform in 1..R, and the loss is the mean cross-entropy over
the masked tokens. Its expectation equals the 1/t-weighted ELBO of LLaDA (t = k / R), and it trains far more
stably than 1/t weights on short answers. Lengths follow a curriculum from ``min_len`` to ``max_len`` tokens.
Checkpoints (model in the real LLaDA format + optimizer state) are written atomically every ``ckpt_every``
steps, and a run resumes from the last one.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from maskkv_cli.bench.sources import SOURCES, load_source
from maskkv_cli.bench.tasks import KINDS, NUM_DISTRACTORS, Task, generate_tasks
from maskkv_cli.documents.corpus import load_corpus
from maskkv_cli.errors import UsageError
from maskkv_cli.models.config import ModelConfig, named_config
from maskkv_cli.models.llada import LLaDA
from maskkv_cli.models.loading import load_model, save_model
from maskkv_cli.models.tokenizer_build import build_bpe_tokenizer
from maskkv_cli.prompting import chat_prompt_ids, document_question, load_tokenizer
from maskkv_cli.prompting.parts import LEAD_SENTENCES, lead_sentences
from maskkv_cli.training.growth import grow_depth


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
    # haystack sources (``bench/sources.py``) and their weights; the default, the package corpus alone, draws no
    # source at all, so earlier recipes replay the same random stream
    sources: dict[str, float] = field(default_factory=lambda: {"corpus": 1.0})
    summary_len: int = 64  # answer region of lead_summary examples (a lead summary is longer than a number)
    eval_source: str = "corpus"  # haystack of the in-training evaluation
    ckpt_every: int = 100
    eval_every: int = 250
    eval_n: int = 32
    threads: int = 1
    init_from: str | None = None  # start from these weights (and tokenizer) instead of random ones
    grow_layers: int = 0  # with init_from: add this many blocks that start as identities (see growth.py)
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


def parse_mix(spec: str) -> dict[str, float]:
    """``"niah_multikey:3,niah_single"`` -> ``{"niah_multikey": 3.0, "niah_single": 1.0}``."""
    mix: dict[str, float] = {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        name, _, weight = part.partition(":")
        if name not in KINDS:
            raise UsageError(f"--kinds: unknown task kind {name!r}; choose from {', '.join(KINDS)}")
        try:
            w = float(weight) if weight else 1.0
        except ValueError:
            w = -1.0
        if not w > 0:
            raise UsageError(f"--kinds: weight of {name} must be a positive number, got {weight!r}")
        mix[name] = mix.get(name, 0.0) + w
    if not mix:
        raise UsageError(f"--kinds: empty list; choose from {', '.join(KINDS)}")
    return mix


def parse_sources(spec: str) -> dict[str, float]:
    """``"stdlib-train:2,corpus"`` -> ``{"stdlib-train": 2.0, "corpus": 1.0}`` (names from ``bench/sources.py``)."""
    out: dict[str, float] = {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        name, _, weight = part.partition(":")
        if name not in SOURCES:
            raise UsageError(f"--sources: unknown source {name!r}; choose from {', '.join(SOURCES)}")
        try:
            w = float(weight) if weight else 1.0
        except ValueError:
            w = -1.0
        if not w > 0:
            raise UsageError(f"--sources: weight of {name} must be a positive number, got {weight!r}")
        out[name] = out.get(name, 0.0) + w
    if not out:
        raise UsageError(f"--sources: empty list; choose from {', '.join(SOURCES)}")
    return out


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


def _lr(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def _max_len_at(cfg: TrainConfig, step: int) -> int:
    frac = min(1.0, step / max(1, cfg.curriculum_steps))
    return int(cfg.min_len + frac * (cfg.max_len - cfg.min_len))


def tokenizer_texts(seed: int) -> list[str]:
    """Corpus paragraphs plus needle-like sentences, so digits and task phrasing get merges."""
    rng = random.Random(seed)
    texts = load_corpus()
    for kind in KINDS:
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
            task = generate_tasks(kind, 1, length, seed=rng.randrange(1 << 31), count_tokens=self.count,
                                  distractors=distractors, haystack=haystack)[0]
            region = self.cfg.summary_len if summary else self.cfg.answer_len
            ex = encode_example(self.tok, self.mcfg, task, region)
            if ex is not None:
                out.append(ex)
        return out

    def batch(self, step: int, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """ids (B, T) left-padded, key mask (B, T), answer rows (B, R), context length used."""
        length = rng.randint(self.cfg.min_len, _max_len_at(self.cfg, step))
        summary = self.summary_share > 0 and (not self.kinds or rng.random() < self.summary_share)
        exs = self.examples(step, self.cfg.batch_size, length, rng, summary)
        r = self.cfg.summary_len if summary else self.cfg.answer_len
        t = max(len(p) for p, _ in exs) + r
        ids = torch.full((len(exs), t), self.mcfg.pad_token_id, dtype=torch.long)
        keep = torch.zeros((len(exs), t), dtype=torch.bool)
        for i, (p, a) in enumerate(exs):
            seq = p + a
            ids[i, t - len(seq):] = torch.tensor(seq)
            keep[i, t - len(seq):] = True
        rows = torch.arange(t - r, t).expand(len(exs), r)
        return ids, keep, rows, length


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


def diffusion_loss(model: LLaDA, ids: torch.Tensor, keep: torch.Tensor, rows: torch.Tensor,
                   gen: torch.Generator, full_mask: float = 0.0, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Mask k ~ U{1..R} answer tokens per example; mean cross-entropy over the masked ones.

    ``full_mask`` is the probability that an example has its whole answer region masked instead (t = 1: the
    state every answer starts from at inference, where nothing but the prompt says which value to copy).
    """
    b, r = rows.shape
    k = torch.randint(1, r + 1, (b, 1), generator=gen)
    if full_mask > 0:
        k = torch.where(torch.rand((b, 1), generator=gen) < full_mask, r, k)
    order = torch.rand((b, r), generator=gen).argsort(1)
    masked = order < k  # (B, R) exactly k True per row
    target = torch.gather(ids, 1, rows)
    noisy = ids.clone()
    noisy.scatter_(1, rows, torch.where(masked, model.config.mask_token_id, target))
    logits = model(noisy, key_mask=keep, rows=rows, positions=positions)  # (B, R, V)
    ce = F.cross_entropy(logits.transpose(1, 2), target, reduction="none")  # (B, R)
    return ((ce * masked).sum(1) / masked.sum(1)).mean()


@torch.no_grad()
def evaluate(model: LLaDA, tok: Any, tasks: list[Task], answer_len: int) -> float:
    """Exact match of greedy answers with the full cache (the quality reference)."""
    from maskkv_cli.bench.metrics import score
    from maskkv_cli.policies.base import get_policy
    from maskkv_cli.prompting import decode_answer, stop_ids
    from maskkv_cli.sampling import GenerationConfig, sample

    model.eval()
    gen = GenerationConfig(gen_length=answer_len, steps=answer_len, block_length=answer_len)
    stops = stop_ids(tok, model.config)
    total = 0.0
    for t in tasks:
        ids = torch.tensor([chat_prompt_ids(tok, document_question(t.context, t.input))])
        out = sample(model, ids, gen, get_policy("full"))
        pred = decode_answer(tok, out.tokens[0].tolist(), stops, model.config.mask_token_id)
        total += score(t.dataset, pred, list(t.answers))
    model.train()
    return total / max(1, len(tasks))


def _git_hash() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _atomic_torch_save(obj: Any, path: Path) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def train(cfg: TrainConfig, on_event: Callable[[TrainEvent], None] | None = None) -> Path:
    """Run (or resume) training; returns the folder of the final model."""
    torch.set_num_threads(cfg.threads)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt, state_file = out / "checkpoint", out / "trainer_state.pt"
    torch.manual_seed(cfg.seed)
    if (ckpt / "config.json").is_file() and state_file.is_file():
        tok = load_tokenizer(ckpt)
        model = load_model(ckpt).train()
        for p in model.parameters():
            p.requires_grad_(True)
        state = torch.load(state_file, weights_only=False)
        start = state["step"]
    elif cfg.init_from:
        tok = load_tokenizer(cfg.init_from)
        model = load_model(cfg.init_from)
        if cfg.grow_layers:
            try:
                model = grow_depth(model, cfg.grow_layers)
            except ValueError as exc:
                raise UsageError(f"--grow-layers: {exc}") from None
        if cfg.rope_theta:
            # A larger base leaves more dimensions slow enough to match content far away; training adapts to it
            # (adjusted base frequency, as in long-context fine-tuning).
            model.config = model.config.with_(rope_theta=cfg.rope_theta)
        model.train()
        for p in model.parameters():
            p.requires_grad_(True)
        state = None
        start = 0
    else:
        tok = build_bpe_tokenizer(tokenizer_texts(cfg.seed), vocab_size=cfg.vocab_size)
        mcfg = named_config("tiny").with_(
            d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads, n_kv_heads=cfg.n_heads,
            mlp_hidden_size=cfg.mlp_hidden_size, vocab_size=len(tok), embedding_size=len(tok),
            rope_theta=cfg.rope_theta or 10000.0, max_sequence_length=4 * cfg.max_len)
        model = LLaDA(mcfg).init_weights(cfg.seed).train()
        state = None
        start = 0
    mcfg = model.config
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=cfg.betas)
    rng = random.Random(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    history: list[dict[str, Any]] = []
    elapsed0 = 0.0
    if state is not None:
        opt.load_state_dict(state["optimizer"])
        rng.setstate(state["rng"])
        gen.set_state(state["gen"])
        history = state["history"]
        elapsed0 = state["elapsed_s"]
    batcher = Batcher(cfg, tok, mcfg)
    eval_rng = random.Random(cfg.seed + 1)
    eval_haystack = None if cfg.eval_source == "corpus" else load_source(cfg.eval_source)
    eval_kinds = ["niah_single", "niah_multikey"] + (["niah_none"] if "niah_none" in cfg.mix else [])
    eval_sets = {kind: generate_tasks(kind, cfg.eval_n, cfg.max_len, seed=eval_rng.randrange(1 << 30),
                                      count_tokens=batcher.count, haystack=eval_haystack) for kind in eval_kinds}
    t0 = time.perf_counter()
    losses: list[float] = []
    for step in range(start, cfg.steps):
        for group in opt.param_groups:
            group["lr"] = _lr(cfg, step)
        ids, keep, rows, length = batcher.batch(step, rng)
        positions = skipped_positions(ids.shape[1], cfg.position_window, rng)
        loss = diffusion_loss(model, ids, keep, rows, gen, cfg.full_mask, positions)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        opt.step()
        losses.append(float(loss.detach()))
        done = step + 1
        ev = None
        if done % cfg.eval_every == 0 or done == cfg.steps:
            ev = {kind: evaluate(model, tok, tasks, cfg.answer_len) for kind, tasks in eval_sets.items()}
        elapsed = elapsed0 + time.perf_counter() - t0
        if ev is not None or done % 10 == 0:
            row = {"step": done, "loss": sum(losses) / len(losses), "lr": _lr(cfg, step), "length": length,
                   "elapsed_s": elapsed, **({"eval": ev} if ev else {})}
            history.append(row)
            losses.clear()
            if on_event:
                on_event(TrainEvent(done, cfg.steps, row["loss"], row["lr"], length, elapsed, ev))
        stop = done == cfg.steps or (cfg.stop_after is not None and done >= cfg.stop_after)
        if done % cfg.ckpt_every == 0 or stop:
            save_model(model, ckpt, tok)
            _atomic_torch_save({"step": done, "optimizer": opt.state_dict(), "rng": rng.getstate(),
                                "gen": gen.get_state(), "history": history, "elapsed_s": elapsed,
                                "config": asdict(cfg)}, state_file)
        if stop:
            break
    final = out / "final"
    info = {"recipe": asdict(cfg), "seed": cfg.seed, "git": _git_hash(), "history": history[-20:],
            "elapsed_s": elapsed0 + time.perf_counter() - t0, "parameters": sum(p.numel() for p in model.parameters())}
    save_model(model, final, tok, extra_files={"training.json": json.dumps(info, indent=2)})
    return final


def install_model(folder: Path, gen_length: int | None = None, window: int | None = None,
                  summary_length: int | None = None) -> Path:
    """Copy a trained model into the package as the embedded default, with its generation defaults
    (``gen_length`` defaults to the answer region the model was trained with) and its window
    (``max_sequence_length``; default twice the longest training context). ``summary_length``: the answer region
    of its lead summaries, which ``summarize`` then generates (recorded as ``summary_length``)."""
    target = Path(__file__).parent.parent / "assets" / "tiny-llada"
    model = load_model(folder)
    if window:
        model.config = model.config.with_(max_sequence_length=window)
    tok = load_tokenizer(folder)
    extra = {}
    info = folder / "training.json"
    if info.is_file():
        extra["training.json"] = info.read_text()
        recipe = json.loads(extra["training.json"])["recipe"]
        gen_length = gen_length or recipe["answer_len"]
        if not window:
            model.config = model.config.with_(max_sequence_length=2 * recipe["max_len"])
    gen_length = gen_length or TrainConfig.answer_len
    save_model(model, target, tok, extra_files=extra)
    gen_cfg = json.loads((target / "generation_config.json").read_text())
    gen_cfg["maskkv"] = {"gen_length": gen_length, "steps": gen_length, "block_length": gen_length}
    if summary_length:
        gen_cfg["maskkv"]["summary_length"] = summary_length
    (target / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2))
    return target
