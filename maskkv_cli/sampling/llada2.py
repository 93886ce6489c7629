"""LLaDA2.x's denoising loop: block diffusion over a block-causal model, over the prompt's (compressed) cache.

The canvas is ``[prompt ; masks]`` rounded up to whole blocks counted from position 0, so the prompt's tail
shares the first response block with the first masks. Blocks are decoded left to right; a block attends to
itself and every earlier block (``models/base.py`` ``dense_hidden``'s ``attn_mask``; ``engine.lanes.Layout``).

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

from maskkv_cli.engine.plan import CachePlan
from maskkv_cli.errors import ModelLoadError, UsageError
from maskkv_cli.models.protocol import DiffusionLM
from maskkv_cli.runtime.stats import RunStats, now
from maskkv_cli.sampling.common import Event, GenerationResult, StepMeter
from maskkv_cli.sampling.dream import check_filters, filter_logits
from maskkv_cli.sampling.driver import Loop, drive
from maskkv_cli.sampling.forward import BlockForward, StepRequest, finish_rows
from maskkv_cli.sampling.llada import GenerationConfig, transfer_schedule
from maskkv_cli.sampling.picks import Picked, SoftmaxMax, softmax_max

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
        if self.max_post_steps < 0:
            raise UsageError(f"--max-post-steps must be >= 0, got {self.max_post_steps}")
        if self.minimal_topk < 1:
            raise UsageError(f"LLaDA2's minimal_topk must be at least 1, got {self.minimal_topk}")
        check_filters(self.top_p, self.top_k)


def llada2_defaults(stored: dict[str, float], source: str = "generation_config.json") -> LLaDA2Options:
    """The options a checkpoint's generation_config.json sets (``models.config.ModelDefaults.sampler``); a value
    they cannot take is refused naming the file (``source``) and its key, which no option of a run can fix."""
    for key in ("threshold", "editing_threshold"):
        value = stored.get(key)
        if value is not None and not 0.0 <= value <= 1.0:
            raise ModelLoadError(f"{source}: {key} must be in [0, 1], got {value}; fix or remove it")
    post = stored.get("max_post_steps")
    return LLaDA2Options(threshold=stored.get("threshold"), editing_threshold=stored.get("editing_threshold"),
                         max_post_steps=DEFAULT_MAX_POST_STEPS if post is None else int(post))


def pick_tokens(logits: Tensor, gen: GenerationConfig, options: LLaDA2Options,
                rng: torch.Generator) -> tuple[Tensor, Tensor]:
    """(tokens, their probabilities), both (B, n): the argmax of the fp32 softmax, or a sample with temperature."""
    if gen.temperature == 0:
        return softmax_max(logits)
    logits = logits.float()
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
        # greedy: the driver picks each row's token with the batch's other rows (``pick_tokens`` at temperature 0)
        self.pick = SoftmaxMax() if gen.temperature == 0 else None
        self.threshold = gen.threshold if gen.threshold is not None else (
            options.threshold if options.threshold is not None else DEFAULT_THRESHOLD)

    def write(self, start: int, rows: Tensor, change: Tensor, tokens: Tensor, probs: Tensor, t0: float,
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

    def result(self) -> GenerationResult:
        self.meter.done()
        g = self.gen.gen_length
        return GenerationResult(self.x[:, self.m : self.m + g].clone(), self.meter.stats, self.forward.records,
                                self.forward.layer_budgets, self.token_probs[:, :g], self.plan)


def _picked(reply: Tensor | Picked, run: BlockDenoising) -> tuple[Tensor, Tensor]:
    """(tokens, probabilities) of a step: the driver's greedy picks, or ``pick_tokens`` over the logits."""
    if isinstance(reply, Picked):
        return reply.tokens, reply.probs
    return pick_tokens(reply, run.gen, run.options, run.rng)


def _block_20(run: BlockDenoising, blk: int) -> Loop:
    """LLaDA2.0: the block's steps, each committing above the threshold or the step's quota."""
    start, gen, options = blk * run.block, run.gen, run.options
    steps = min(gen.steps_per_block, gen.gen_length // options.minimal_topk)
    schedule = transfer_schedule(run.block, steps)
    for step in range(steps):
        t0 = now(run.device)
        masked = run.x[:, start : start + run.block] == run.mask_id
        rows = torch.nonzero(masked.any(0)).flatten()
        if len(rows) == 0:  # the block is done (read with the rows: one device sync, not two)
            break
        tokens, probs = _picked((yield StepRequest(run.x, rows, start, pick=run.pick)), run)
        commit = _commit_masks(probs, masked[:, rows], run.threshold, schedule[step])
        run.write(start, rows, commit, tokens, probs, t0, blk)


def _block_21(run: BlockDenoising, blk: int) -> Loop:
    """LLaDA2.1: commit masks (quota one) and edit written tokens until the block is settled."""
    start, options = blk * run.block, run.options
    rows = torch.arange(run.block, device=run.device)
    prompt_rows = min(max(run.m - start, 0), run.block)
    editing = options.editing_threshold
    assert editing is not None
    post = stalls = 0
    while True:
        old = run.x[:, start : start + run.block].clone()
        masked = old == run.mask_id
        if not bool(masked.any()):
            post += 1
        if post > options.max_post_steps or stalls > options.max_post_steps:
            break
        t0 = now(run.device)
        tokens, probs = _picked((yield StepRequest(run.x, rows, start, pick=run.pick)), run)
        commit = _commit_masks(probs, masked, run.threshold, 1)
        editable = ~masked
        editable[:, :prompt_rows] = False
        edits = editable & (probs > editing) & (tokens != old)
        run.write(start, rows, commit | edits, tokens, probs, t0, blk)
        if not bool(masked.any()) and not bool(edits.any()):
            break
        # a step that changed nothing (the model chose the mask token itself for every committed position)
        # would repeat forever at temperature 0: give up on the block after as many as the post steps
        stalls = stalls + 1 if torch.equal(old, run.x[:, start : start + run.block]) else 0


def llada2_loop(run: BlockDenoising) -> Loop:
    """LLaDA2's loop over ``run``, block after block: yields each step's ``StepRequest`` (and, with a cache, one for
    each finished block's final tokens, whose logits it does not need) and is sent its logits."""
    for blk in range(run.first, run.n_blocks):
        yield from (_block_20 if run.options.editing_threshold is None else _block_21)(run, blk)
        end = (blk + 1) * run.block
        if run.options.stop_at_eos and bool((run.x[:, run.m : end] == run.eos_id).any(dim=1).all()):
            break  # every row has its end-of-text token: nothing after it changes the answer
        if blk + 1 < run.n_blocks and run.forward.keeps_blocks:
            yield StepRequest(run.x, finish_rows(run.device), blk * run.block, finish=True)  # its keys, values


def llada2_run(model: DiffusionLM, prompt: Tensor, gen: GenerationConfig, plan: CachePlan,
               on_event: Callable[[Event], None] | None = None,
               options: LLaDA2Options | None = None) -> BlockDenoising:
    """The generation state LLaDA2's loop runs on."""
    return BlockDenoising(model, prompt, gen, plan, on_event, options or LLaDA2Options())


@torch.no_grad()
def denoise_llada2(model: DiffusionLM, prompt: Tensor, gen: GenerationConfig, plan: CachePlan,
                   on_event: Callable[[Event], None] | None = None,
                   options: LLaDA2Options | None = None) -> GenerationResult:
    """LLaDA2's loop over ``prompt`` (B, M) with the prompt cache run as ``plan`` says (see the module doc).

    Returns ``gen.gen_length`` tokens per row (masks where decoding stopped before reaching them)."""
    run = llada2_run(model, prompt, gen, plan, on_event, options)
    return drive(model, run, llada2_loop(run))
