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
import random
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from maskkv_cli.documents.corpus import load_corpus
from maskkv_cli.errors import MaskKVError, UsageError
from maskkv_cli.models.config import named_config
from maskkv_cli.models.llada import LLaDA
from maskkv_cli.models.loading import load_model, save_model
from maskkv_cli.models.tokenizer_build import build_bpe_tokenizer
from maskkv_cli.prompting import chat_prompt_ids, document_question, load_tokenizer
from maskkv_cli.runtime.fileio import atomic_file, atomic_write_text
from maskkv_cli.tasks.sources import load_source
from maskkv_cli.tasks.synthetic import UNANSWERABLE_KINDS, generate_tasks
from maskkv_cli.tasks.taskio import Task
from maskkv_cli.training.config import ABSENT_PAIR, TrainConfig, TrainEvent, learning_rate
from maskkv_cli.training.examples import Batcher, skipped_positions, tokenizer_texts
from maskkv_cli.training.growth import freeze_all_but_new, grow_depth
from maskkv_cli.training.hard_keys import absent_confusion, off_diagonal_mean
from maskkv_cli.training.heap import keep_freed_memory


def diffusion_loss(model: LLaDA, ids: torch.Tensor, keep: torch.Tensor, rows: torch.Tensor,
                   gen: torch.Generator, full_mask: float = 0.0, positions: torch.Tensor | None = None,
                   identity: float = 0.0, block: int | None = None) -> torch.Tensor:
    """Mask k ~ U{1..R} answer tokens per example; mean cross-entropy over the masked ones.

    ``full_mask`` is the probability that an example has its whole answer region masked instead (t = 1: the
    state every answer starts from at inference, where nothing but the prompt says which value to copy).

    ``identity`` > 0 adds that weight times the mean cross-entropy of predicting every visible token (prompt and
    unmasked answer tokens) as itself. The head is not tied to the embedding, and the masked objective never
    asks a position for its own token, so the map from a token's embedding back to its logit exists only for
    the tokens answers are made of (digits). Copying text, as a lead summary does, needs that map for every
    token; without it the model settles on frequent words ("the the the"). See docs/tiny-model.md, stage 20.
    """
    if block:
        return _block_loss(model, ids, keep, rows, gen, full_mask, positions, identity, block)
    b, r = rows.shape
    k = torch.randint(1, r + 1, (b, 1), generator=gen)
    if full_mask > 0:
        k = torch.where(torch.rand((b, 1), generator=gen) < full_mask, r, k)
    order = torch.rand((b, r), generator=gen).argsort(1)
    masked = order < k  # (B, R) exactly k True per row
    return _masked_loss(model, ids, keep, rows, masked, masked, positions, identity)


def _block_loss(model: LLaDA, ids: torch.Tensor, keep: torch.Tensor, rows: torch.Tensor, gen: torch.Generator,
                full_mask: float, positions: torch.Tensor | None, identity: float, block: int) -> torch.Tensor:
    """The states semi-autoregressive decoding meets with blocks of ``block`` tokens (block diffusion, Arriola et
    al. 2025): one block per example, drawn uniformly; the blocks before it visible, k ~ U{1..block} of its
    tokens masked (all of them with probability ``full_mask``), every token after it masked. The loss is over
    the masked tokens of the block: those after it are masked in the input only, as they are at inference."""
    b, r = rows.shape
    if r % block:
        raise ValueError(f"an answer region of {r} tokens does not split into blocks of {block}")
    start = torch.randint(0, r // block, (b, 1), generator=gen) * block
    k = torch.randint(1, block + 1, (b, 1), generator=gen)
    if full_mask > 0:
        k = torch.where(torch.rand((b, 1), generator=gen) < full_mask, block, k)
    pos = torch.arange(r)[None]
    inside = (pos >= start) & (pos < start + block)
    order = torch.where(inside, torch.rand((b, r), generator=gen), 2.0).argsort(1).argsort(1)
    masked = order < k  # (B, R) exactly k True per row, all inside the block
    return _masked_loss(model, ids, keep, rows, masked, masked | (pos >= start + block), positions, identity)


def _masked_loss(model: LLaDA, ids: torch.Tensor, keep: torch.Tensor, rows: torch.Tensor, masked: torch.Tensor,
                 hidden: torch.Tensor, positions: torch.Tensor | None, identity: float) -> torch.Tensor:
    """Mean cross-entropy over the ``masked`` answer tokens with every ``hidden`` one (a superset) replaced by the
    mask token; plus ``identity`` times the identity term (see ``diffusion_loss``)."""
    target = torch.gather(ids, 1, rows)
    noisy = ids.clone()
    noisy.scatter_(1, rows, torch.where(hidden, model.config.mask_token_id, target))
    every = None
    if identity <= 0:
        logits = model(noisy, key_mask=keep, rows=rows, positions=positions)  # (B, R, V)
    else:
        every = model(noisy, key_mask=keep, positions=positions)  # (B, T, V): the identity term needs them all
        logits = torch.gather(every, 1, rows[..., None].expand(-1, -1, every.shape[-1]))
    ce = F.cross_entropy(logits.transpose(1, 2), target, reduction="none")  # (B, R)
    loss = ((ce * masked).sum(1) / masked.sum(1)).mean()
    if every is None:
        return loss
    visible = keep & (noisy != model.config.mask_token_id)
    return loss + identity * F.cross_entropy(every[visible], ids[visible])


@torch.no_grad()
def evaluate(model: LLaDA, tok: Any, tasks: list[Task], answer_len: int, block: int | None = None) -> float:
    """Exact match (ROUGE-L for lead summaries) of greedy answers with the full cache (the quality reference),
    decoded one token per step in blocks of ``block`` tokens (default: the whole answer as one block)."""
    from maskkv_cli.engine.plan import CachePlan
    from maskkv_cli.policies.base import get_policy
    from maskkv_cli.prompting import decode_answer, stop_ids
    from maskkv_cli.sampling import GenerationConfig, sample
    from maskkv_cli.tasks.metrics import score

    model.eval()
    gen = GenerationConfig(gen_length=answer_len, steps=answer_len, block_length=block or answer_len)
    stops = stop_ids(tok, model.config)
    total = 0.0
    for t in tasks:
        ids = torch.tensor([chat_prompt_ids(tok, document_question(t.context, t.input))])
        out = sample(model, ids, gen, CachePlan.build(model, get_policy("full"), None, ids.shape[1]))
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


# the options that decide the model a run trains (its shape, its start, its data's seed): a resumed run must keep them
MODEL_OPTIONS = ("seed", "vocab_size", "d_model", "n_layers", "n_heads", "mlp_hidden_size", "rope_theta", "init_from",
                 "grow_layers")


DERIVED = {"vocab_size": "a vocabulary of", "mlp_hidden_size": "an MLP width of"}  # no options of their own


def check_resume(cfg: TrainConfig, saved: dict[str, Any], out: Path) -> None:
    """Refuse to resume the run saved in ``out`` (its options ``saved``) with options that decide another model: the
    checkpoint would go on as the old model while training.json recorded the new options."""
    changed = [f"{DERIVED.get(name, '--' + name.replace('_', '-'))} {saved[name]} (now {getattr(cfg, name)})"
               for name in MODEL_OPTIONS if name in saved and saved[name] != getattr(cfg, name)
               and not (name == "mlp_hidden_size" and saved.get("d_model") != cfg.d_model)]  # (it follows --d-model)
    if changed:
        raise UsageError(f"{out} holds a run of another model: it was started with {', '.join(changed)}; resume it "
                         "with the same model options, or choose another --out")


def diverged(step: int, what: str, ckpt: Path) -> MaskKVError:
    """The error of a run whose training diverged at ``step``: nothing of it is saved (no final model, the last
    checkpoint stays as it was), since a model of NaN weights would load and answer nothing."""
    kept = f"the last checkpoint, {ckpt}, is kept" if (ckpt / "config.json").is_file() else "no checkpoint was saved"
    return MaskKVError(f"training diverged at step {step} ({what}); nothing of it was saved ({kept}): try a smaller "
                       "--lr")


def train(cfg: TrainConfig, on_event: Callable[[TrainEvent], None] | None = None) -> Path:
    """Run (or resume) training; returns the folder of the final model."""
    torch.set_num_threads(cfg.threads)
    keep_freed_memory()
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
        check_resume(cfg, state.get("config") or {}, out)
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
    if cfg.freeze_old:
        freeze_all_but_new(model, cfg.grow_layers)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and p.requires_grad]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 and p.requires_grad]
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
    asked = {*cfg.mix, *(["niah_none"] if ABSENT_PAIR in cfg.mix else [])}
    eval_kinds = ["niah_single", "niah_multikey"] + [k for k in (*UNANSWERABLE_KINDS, "lead_summary") if k in asked]
    eval_sets = {kind: generate_tasks(kind, cfg.eval_n, cfg.max_len, seed=eval_rng.randrange(1 << 30),
                                      count_tokens=batcher.count, haystack=eval_haystack) for kind in eval_kinds}
    hard_every = cfg.hard_absent_every if ABSENT_PAIR in cfg.mix else 0
    probe_text = (eval_haystack or load_corpus()) if hard_every else []
    confusion: float | None = None  # the last off-diagonal mean, logged with the next row
    t0 = time.perf_counter()
    losses: list[float] = []
    end = cfg.steps if cfg.stop_after is None else min(cfg.steps, max(start, cfg.stop_after))
    for step in range(start, end):  # a run already at --stop-after trains no further step
        for group in opt.param_groups:
            group["lr"] = learning_rate(cfg, step)
        if hard_every and (step == start or step % hard_every == 0):
            # its own random stream, so the batches' draws do not depend on when it runs
            batcher.confusion = absent_confusion(model, tok, probe_text, random.Random(f"{cfg.seed}:{step}"),
                                                 answer_len=cfg.answer_len)
            confusion = off_diagonal_mean(batcher.confusion)
        ids, keep, rows, length, summary = batcher.batch(step, rng)
        positions = skipped_positions(ids.shape[1], cfg.position_window, rng)
        full_mask = cfg.full_mask
        if summary and cfg.summary_full_mask is not None:
            full_mask = cfg.summary_full_mask
        loss = diffusion_loss(model, ids, keep, rows, gen, full_mask, positions, cfg.identity_loss,
                              cfg.summary_block if summary else None)
        losses.append(float(loss.detach()))
        if not math.isfinite(losses[-1]):
            raise diverged(step + 1, f"the loss is {losses[-1]}", ckpt)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)  # frozen parameters have no grad: skipped
        opt.step()
        done = step + 1
        ev = None
        if done % cfg.eval_every == 0 or done == cfg.steps:
            ev = {kind: evaluate(model, tok, tasks, cfg.summary_len, cfg.summary_block) if kind == "lead_summary"
                  else evaluate(model, tok, tasks, cfg.answer_len) for kind, tasks in eval_sets.items()}
        elapsed = elapsed0 + time.perf_counter() - t0
        if ev is not None or done % 10 == 0:
            row = {"step": done, "loss": sum(losses) / len(losses), "lr": learning_rate(cfg, step), "length": length,
                   "elapsed_s": elapsed, **({"eval": ev} if ev else {}),
                   **({"absent_confusion": confusion} if confusion is not None else {})}
            history.append(row)
            losses.clear()
            if on_event:
                on_event(TrainEvent(done, cfg.steps, row["loss"], row["lr"], length, elapsed, ev, confusion))
            confusion = None
        stop = done == cfg.steps or (cfg.stop_after is not None and done >= cfg.stop_after)
        if done % cfg.ckpt_every == 0 or stop:
            if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):  # never saved over a good one
                raise diverged(done, "a weight is no longer a finite number", ckpt)
            save_model(model, ckpt, tok)
            with atomic_file(state_file) as handle:
                torch.save({"step": done, "optimizer": opt.state_dict(), "rng": rng.getstate(),
                            "gen": gen.get_state(), "history": history, "elapsed_s": elapsed,
                            "config": asdict(cfg)}, handle)
        if stop:
            break
    final = out / "final"
    info = {"recipe": asdict(cfg), "seed": cfg.seed, "git": _git_hash(), "history": history[-20:],
            "elapsed_s": elapsed0 + time.perf_counter() - t0, "parameters": sum(p.numel() for p in model.parameters())}
    save_model(model, final, tok, extra_files={"training.json": json.dumps(info, indent=2)})
    return final


def install_model(folder: Path, gen_length: int | None = None, window: int | None = None,
                  summary_length: int | None = None, summary_block: int | None = None,
                  target: Path | None = None) -> Path:
    """Copy a trained model into the package as the embedded default, with its generation defaults
    (``gen_length`` defaults to the answer region the model was trained with) and its window
    (``max_sequence_length``; default twice the longest training context where ``training.json`` says it, else the
    model's own). ``summary_length``: the answer region
    of its lead summaries, which ``summarize`` then generates (recorded as ``summary_length``), decoded in blocks
    of ``summary_block`` tokens when it was trained so (``summary_block_length``). ``target``: another folder
    to lay the model out in, exactly as it would be embedded (to evaluate a candidate before installing it)."""
    target = target or Path(__file__).parent.parent / "assets" / "tiny-llada"
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
        if summary_block:
            gen_cfg["maskkv"]["summary_block_length"] = summary_block
    atomic_write_text(target / "generation_config.json", json.dumps(gen_cfg, indent=2))
    return target
