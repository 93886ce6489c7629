"""LLaDA2.x's denoising loop: block diffusion over a block-causal model, over the prompt's (compressed) cache.

The canvas is ``[prompt ; masks]`` rounded up to whole blocks counted from position 0, so the prompt's tail
shares the first response block with the first masks. Blocks are decoded left to right; a block attends to
itself and every earlier block (``models/base.py`` ``dense_hidden``'s ``attn_mask``; ``engine.forward.Layout``).

- LLaDA2.0 (``LLaDA2Options.editing_threshold`` None): each block gets ``steps_per_block`` steps (capped at
  ``gen_length // minimal_topk``). A step commits every masked position whose chosen token's probability exceeds
  ``threshold`` (0.95 unless set) when there are at least the step's quota of them, else the quota's most
  confident masked positions (the quota: the block split evenly over its steps). Masks left when the steps run
  out stay masks.
- LLaDA2.1 (``editing_threshold`` set): a block runs until it has no mask and a step changed nothing, at most
  ``max_post_steps`` steps after its last mask: each step commits masks as above with a quota of one, and
  re-writes every already-written response position of the block whose new choice differs and is more probable
  than ``editing_threshold`` (token editing). Upstream would loop forever when the model keeps choosing the
  mask token itself for a masked position; here a block gives up after ``max_post_steps`` such steps.

Decoding stops after the block in which every row has written an end-of-text token (the answer up to it does not
change after that). The mask token is not suppressed (as upstream). Greedy choices are the argmax of the fp32
softmax; with a temperature the logits are scaled, filtered (``top_k``, ``top_p``) and sampled.

With a cache (every policy but ``none``): the first step of the first block is the layer-streamed prefill over
``[prompt ; first block]`` (votes, per-head selection of the prompt's whole blocks); every later step runs the
current block only, over the kept prompt entries, the finished blocks and itself; when a block is finished its
final tokens run once more so that the blocks after it see their exact keys and values. With ``full`` the
tokens equal the no-cache loop's (tested).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from maskkv_cli.engine.forward import (
    LayerRecord,
    Layout,
    block_causal_visible,
    prefill,
    response_hidden,
    response_logits,
)
from maskkv_cli.engine.plan import CachePlan
from maskkv_cli.errors import UsageError
from maskkv_cli.kv.cache import PromptCache
from maskkv_cli.models.base import dense_hidden
from maskkv_cli.models.protocol import DiffusionLM
from maskkv_cli.sampling.common import Event, GenerationResult, StepMeter
from maskkv_cli.sampling.dream import filter_logits
from maskkv_cli.sampling.llada import GenerationConfig, transfer_schedule
from maskkv_cli.stats import RunStats, now

DEFAULT_THRESHOLD = 0.95  # LLaDA2.0's and 2.1's commit threshold when neither the user nor the model sets one
DEFAULT_MAX_POST_STEPS = 16


@dataclass(frozen=True)
class LLaDA2Options:
    """LLaDA2's own sampler settings beside ``GenerationConfig`` (``threshold`` there overrides ``threshold`` here,
    the model's stored default)."""

    threshold: float | None = None  # the model's default commit threshold (None: 0.95)
    editing_threshold: float | None = None  # LLaDA2.1's token editing; None: LLaDA2.0's loop
    max_post_steps: int = DEFAULT_MAX_POST_STEPS  # LLaDA2.1: steps a block may run after its last mask
    minimal_topk: int = 1  # caps the steps per block at gen_length // minimal_topk (LLaDA2.0)
    top_p: float | None = None
    top_k: int | None = None
    stop_at_eos: bool = True  # False: every block runs (benchmarks: the same work whatever the tokens)

    def __post_init__(self) -> None:
        for name in ("threshold", "editing_threshold"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value <= 1.0:
                raise UsageError(f"--{name.replace('_', '-')} must be in [0, 1], got {value}")
        if self.max_post_steps < 0 or self.minimal_topk < 1:
            raise UsageError("--max-post-steps must be >= 0 (and minimal_topk >= 1)")


def llada2_defaults(stored: dict[str, float]) -> LLaDA2Options:
    """The options a checkpoint's generation_config.json sets (``models.config.ModelDefaults.sampler``)."""
    post = stored.get("max_post_steps")
    return LLaDA2Options(threshold=stored.get("threshold"), editing_threshold=stored.get("editing_threshold"),
                         max_post_steps=DEFAULT_MAX_POST_STEPS if post is None else int(post))


class BlockForward:
    """A block's logits at one step, as the cache plan says (see the module doc); the attributes ``StepMeter``
    reads (``cache``, ``split``, ``batch``, ``setup_s``, ``step_options``) are those of ``common.CachedForward``."""

    def __init__(self, model: DiffusionLM, plan: CachePlan, block_length: int, total: int) -> None:
        if not plan.step_options.eager:
            raise UsageError("--compile and --cuda-graph are not available for block-causal models (LLaDA2) yet")
        self.model, self.plan, self.block, self.total = model, plan, block_length, total
        self.split, self.step_options = plan.split, plan.step_options
        self.cache: PromptCache | None = None
        self.records: list[LayerRecord] = []
        self.layer_budgets: list[int] | None = None if plan.layer_budgets is None else list(plan.layer_budgets)
        self.setup_s = 0.0
        self.batch = 1

    def __call__(self, x: Tensor, start: int, rows: Tensor) -> Tensor:
        """Logits (B, len(rows), V) of the rows ``rows`` (within the block) of the block at ``start``."""
        model, end = self.model, start + self.block
        self.batch = x.shape[0]
        if not self.plan.policy.uses_cache:  # the whole window again, block-causal
            mask = block_causal_visible(0, end, end, self.block, x.device)
            return model.head(dense_hidden(model, x[:, :end], attn_mask=mask)[:, start + rows.to(x.device)])
        if self.cache is None:  # the first block's first step: the prefill
            layout = Layout(block=self.block, mask_start=self.plan.prompt_len, response_slots=self.total - self.split)
            logits, self.cache, self.records = prefill(model, x[:, :end], self.split, self.plan.policy,
                                                       self.layer_budgets, start + rows, layout=layout,
                                                       online_importance=self.plan.online, prefix=self.plan.prefix)
            if self.plan.online and self.layer_budgets is not None:
                self.layer_budgets = [r.layer_budget for r in self.records]
            return logits
        return response_logits(model, self.cache, x[:, start:end], rows, offset=start - self.split)

    def finish_block(self, x: Tensor, start: int) -> None:
        """Write the finished block's exact keys and values (from its final tokens) for the blocks after it."""
        if self.cache is None:
            return
        end = start + self.block
        rope = self.model.rope(torch.arange(start, end, device=x.device))
        one = torch.zeros(1, dtype=torch.long, device=x.device)  # the last layer's output is not needed
        response_hidden(self.model, self.cache, x[:, start:end], rope, one, offset=start - self.split)


def pick_tokens(logits: Tensor, gen: GenerationConfig, options: LLaDA2Options,
                rng: torch.Generator) -> tuple[Tensor, Tensor]:
    """(tokens, their probabilities), both (B, n): the argmax of the fp32 softmax, or a sample with temperature."""
    logits = logits.float()
    if gen.temperature == 0:
        probs, tokens = logits.softmax(-1).max(-1)
        return tokens, probs
    probs = filter_logits(logits / gen.temperature, options.top_p, options.top_k).softmax(-1)
    tokens = torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=rng).view(probs.shape[:-1])
    return tokens, probs.gather(-1, tokens[..., None]).squeeze(-1)


def _commit_masks(conf: Tensor, masked: Tensor, threshold: float, quota: int) -> Tensor:
    """Bool (B, n): every masked position above ``threshold`` when there are at least ``quota`` of them, else the
    ``quota`` most confident masked positions (fewer when fewer are masked)."""
    conf = torch.where(masked, conf, float("-inf"))
    commit = torch.zeros_like(masked)
    for b in range(masked.shape[0]):
        high = conf[b] > threshold
        if int(high.sum()) >= quota:
            commit[b] = high
        else:
            k = min(quota, int(masked[b].sum()))
            if k:
                commit[b, conf[b].topk(k).indices] = True
    return commit


class BlockDenoising:
    """One LLaDA2 generation: the canvas, the forward, the meter and the committed tokens' probabilities."""

    def __init__(self, model: DiffusionLM, prompt: Tensor, gen: GenerationConfig, plan: CachePlan,
                 on_event: Callable[[Event], None] | None, options: LLaDA2Options) -> None:
        if prompt.dim() == 1:
            prompt = prompt[None]
        self.device = model.device
        prompt = prompt.to(self.device)
        bsz, self.m = prompt.shape
        if self.m != plan.prompt_len:
            raise ValueError(f"the cache plan is for a {plan.prompt_len}-token prompt, the prompt has {self.m}")
        self.gen, self.options, self.plan = gen, options, plan
        self.block = gen.block_length
        self.n_blocks = math.ceil((self.m + gen.gen_length) / self.block)
        self.first = self.m // self.block
        total = self.n_blocks * self.block
        self.mask_id, self.eos_id = model.config.mask_token_id, model.config.eos_token_id
        self.x = torch.full((bsz, total), self.mask_id, dtype=prompt.dtype, device=self.device)
        self.x[:, : self.m] = prompt
        self.forward = BlockForward(model, plan, self.block, total)
        self.meter = StepMeter(model, RunStats(policy=plan.policy.name, prompt_len=self.m, gen_length=gen.gen_length),
                               on_event, self.m, self.forward)
        self.token_probs = torch.full((bsz, total - self.m), float("nan"), dtype=torch.float64, device=self.device)
        self.rng = torch.Generator(device=self.device).manual_seed(gen.seed)
        self.threshold = gen.threshold if gen.threshold is not None else (
            options.threshold if options.threshold is not None else DEFAULT_THRESHOLD)

    def _write(self, start: int, rows: Tensor, change: Tensor, tokens: Tensor, probs: Tensor, t0: float,
               blk: int) -> None:
        """Write ``tokens`` where ``change`` (B, n) is set at the block's rows ``rows``, and time the step."""
        where = start + rows
        self.x[:, where] = torch.where(change, tokens, self.x[:, where])
        answer = where - self.m  # the response index of each row (rows in the prompt's tail never change)
        keep = answer >= 0
        if bool(keep.any()):
            idx = answer[keep]
            self.token_probs[:, idx] = torch.where(change[:, keep], probs[:, keep].double(), self.token_probs[:, idx])
        self.meter.step(t0, self.x, change, blk - self.first, self.n_blocks - self.first)

    def run_block_20(self, blk: int) -> None:
        """LLaDA2.0: the block's steps, each committing above the threshold or the step's quota."""
        start = blk * self.block
        steps = min(self.gen.steps_per_block, self.gen.gen_length // self.options.minimal_topk)
        schedule = transfer_schedule(self.block, steps)
        for step in range(steps):
            masked = self.x[:, start : start + self.block] == self.mask_id
            if not bool(masked.any()):
                break
            t0 = now(self.device)
            rows = torch.nonzero(masked.any(0)).flatten()
            tokens, probs = pick_tokens(self.forward(self.x, start, rows), self.gen, self.options, self.rng)
            still = masked[:, rows]
            commit = _commit_masks(probs, still, self.threshold, schedule[step])
            self._write(start, rows, commit, tokens, probs, t0, blk)

    def run_block_21(self, blk: int) -> None:
        """LLaDA2.1: commit masks (quota one) and edit written tokens until the block is settled."""
        start, options = blk * self.block, self.options
        rows = torch.arange(self.block, device=self.device)
        prompt_rows = min(max(self.m - start, 0), self.block)
        editing = options.editing_threshold
        assert editing is not None
        post = stalls = 0
        while True:
            old = self.x[:, start : start + self.block].clone()
            masked = old == self.mask_id
            if not bool(masked.any()):
                post += 1
            if post > options.max_post_steps or stalls > options.max_post_steps:
                break
            t0 = now(self.device)
            tokens, probs = pick_tokens(self.forward(self.x, start, rows), self.gen, options, self.rng)
            commit = _commit_masks(probs, masked, self.threshold, 1)
            editable = ~masked
            editable[:, :prompt_rows] = False
            edits = editable & (probs > editing) & (tokens != old)
            self._write(start, rows, commit | edits, tokens, probs, t0, blk)
            if not bool(masked.any()) and not bool(edits.any()):
                break
            # a step that changed nothing (the model chose the mask token itself for every committed position)
            # would repeat forever at temperature 0: give up on the block after as many as the post steps
            stalls = stalls + 1 if torch.equal(old, self.x[:, start : start + self.block]) else 0

    def run(self) -> GenerationResult:
        for blk in range(self.first, self.n_blocks):
            if self.options.editing_threshold is None:
                self.run_block_20(blk)
            else:
                self.run_block_21(blk)
            end = (blk + 1) * self.block
            if self.options.stop_at_eos and bool((self.x[:, self.m : end] == self.eos_id).any(dim=1).all()):
                break  # every row has its end-of-text token: nothing after it changes the answer
            if blk + 1 < self.n_blocks:
                self.forward.finish_block(self.x, blk * self.block)
        self.meter.done()
        g = self.gen.gen_length
        return GenerationResult(self.x[:, self.m : self.m + g].clone(), self.meter.stats, self.forward.records,
                                self.forward.layer_budgets, self.token_probs[:, :g], self.plan)


@torch.no_grad()
def denoise_llada2(model: DiffusionLM, prompt: Tensor, gen: GenerationConfig, plan: CachePlan,
                   on_event: Callable[[Event], None] | None = None,
                   options: LLaDA2Options | None = None) -> GenerationResult:
    """LLaDA2's loop over ``prompt`` (B, M) with the prompt cache run as ``plan`` says (see the module doc).

    Returns ``gen.gen_length`` tokens per row (masks where decoding stopped before reaching them)."""
    return BlockDenoising(model, prompt, gen, plan, on_event, options or LLaDA2Options()).run()
