"""The limit line: the bare work a cached generation cannot avoid, timed on the same model and device.

``limit = one plain forward over [prompt ; masks] + (steps - 1) forwards of the L response tokens over
keys + L keys per layer``, where ``keys`` is the budget (MaskKV), the prompt length (full cache). The prefill is
step 0 of the sampler, so a generation of ``steps`` steps runs one full forward and ``steps - 1`` response
forwards; the limit counts exactly that much work.

The bare passes call the model's blocks directly: SDPA, the MLP in row chunks, no scoring, no selection, no
sampler bookkeeping (no softmax over the vocabulary, no commits), and preallocated K/V buffers of exactly
``keys + L`` entries per head (no padding to the longest head). Like the engine, the last layer and the LM head
run only on the rows whose logits the sampler needs (the masked positions of the current block).

For ``none`` (no cache) every step is a full forward: the limit is ``steps`` times one timed full forward
(extrapolated).

A block-causal model (LLaDA2) runs block by block: the limit is one bare forward over ``[prompt ; first
block]`` (block-causal), then for every later step a bare forward of the current block over ``keys`` plus the
blocks so far, and for every finished block but the last one pass of its final tokens (the exact keys and
values the blocks after it need). Steps follow LLaDA2.0's quota with no token above the threshold.

A batch of B sequences (``measure_batch_limit``) is timed as the engine runs a batch of generations
(``engine/step.py``, one lane per sequence): one bare prefill of the B prompts together (of one length here: the
engine runs prompts of any lengths back to back), then every later step one bare forward of all B responses in
which the embedding, the projections, the MLP and the LM head take every sequence's rows at once
and attention runs sequence by sequence over that sequence's own ``keys + L`` entries. Without a cache every step
(step 0 included) is one bare full forward of the B sequences together, as the engine shares them. A batch of
block-causal sequences: each window of the prefill one bare forward of the B sequences, each later step (and each
finished block's pass) one bare step of B lanes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from maskkv_cli.engine.chunks import MLP_CHUNK
from maskkv_cli.engine.lanes import RopeMemo, StepLane, block_causal_visible
from maskkv_cli.engine.step import step_logits
from maskkv_cli.kv.cache import DenseLayer, PromptCache
from maskkv_cli.models.base import dense_hidden
from maskkv_cli.models.protocol import Block, DiffusionLM
from maskkv_cli.runtime.stats import now
from maskkv_cli.sampling.llada import GenerationConfig, transfer_schedule


def rows_schedule(gen: GenerationConfig, prompt_len: int | None = None) -> list[tuple[int, int]]:
    """(block, masked tokens of that block) at each step the sampler runs (step 0 first, no threshold).

    The count is the number of rows whose logits the step needs; steps after a block is finished are not run.
    With ``prompt_len`` the blocks are a block-causal model's (counted from position 0, the first one shared with
    the prompt's tail; block 0 is the first response block) and the steps per block are capped as LLaDA2.0 caps
    them."""
    out: list[tuple[int, int]] = []
    if prompt_len is not None:
        bl = gen.block_length
        first, total = prompt_len // bl, -(-(prompt_len + gen.gen_length) // bl)
        steps = min(gen.steps_per_block, gen.gen_length)
        for blk in range(total - first):
            left = (first + 1) * bl - prompt_len if blk == 0 else bl
            for k in transfer_schedule(bl, steps):
                if left <= 0:
                    break
                out.append((blk, left))
                left -= k
        return out
    for blk in range(gen.n_blocks):
        left = gen.block_length
        for k in transfer_schedule(gen.block_length, gen.steps_per_block):
            if left <= 0:
                break
            out.append((blk, left))
            left -= k
    return out


@torch.no_grad()
def bare_full_forward(model: DiffusionLM, ids: Tensor, rows: Tensor, mlp_chunk: int = MLP_CHUNK) -> Tensor:
    """One plain bidirectional forward over ids (B, T) (the model's dense loop); logits at positions ``rows``."""
    return model.head(dense_hidden(model, ids, mlp_chunk=mlp_chunk)[:, rows])


class BareSteps:
    """Preallocated K/V of ``keys + L`` entries per head and layer, and a bare response-only forward: the engine's
    own step (``engine.step``) over dense caches of random entries, with no policy and no sampler."""

    def __init__(self, model: DiffusionLM, prompt_len: int, keys: int, response_len: int, batch: int = 1,
                 seed: int = 0, per_sequence: bool = False) -> None:
        self.model = model
        self.keys = keys
        self.response_len = response_len
        self.prompt_len = prompt_len
        dev, dt = model.device, model.dtype
        gen = torch.Generator(device=dev).manual_seed(seed)

        def layer(block: Block, rows: int) -> DenseLayer:
            # Random prompt entries: the values do not change the time of the pass, only the shapes do.
            shape = (rows, block.n_kv_heads, keys + response_len, block.head_dim)
            k, v = (torch.randn(shape, generator=gen, device=dev, dtype=torch.float32).to(dt) for _ in range(2))
            return DenseLayer(k, v, keys, torch.full(shape[:2], keys, dtype=torch.int64, device=dev))

        def cache(rows: int) -> PromptCache:
            return PromptCache(prompt_len, response_len, [layer(block, rows) for block in model.blocks])

        self.per_sequence = per_sequence and batch > 1
        # Built here, before any step is timed: the engine's caches come from the prefill, not from the steps.
        self._caches = [cache(1) for _ in range(batch)] if self.per_sequence else [cache(batch)]
        self._tables = [RopeMemo() for _ in self._caches]  # each lane's RoPE tables, kept as generations keep them

    @property
    def attention_keys(self) -> int:
        """Keys each step's attention sees per head: the kept prompt entries plus the response."""
        return self.keys + self.response_len

    @torch.no_grad()
    def step(self, response: Tensor, rows: Tensor, offset: int = 0) -> Tensor:
        """One response-only forward of ``response`` (B, n): response positions [offset, offset + n) (all L when
        ``offset`` is 0 and n is L), over the keys before ``offset + n``; logits at its rows ``rows``.

        ``per_sequence`` (at construction): each sequence is its own lane (attention over its own entries, as a
        batch of generations runs); the layers with weights take every sequence's rows at once either way."""
        start = self.prompt_len + offset
        if self.per_sequence:
            lanes = [StepLane(response[b : b + 1], rows, start, cache, offset, tables=tables)
                     for b, (cache, tables) in enumerate(zip(self._caches, self._tables, strict=True))]
        else:
            lanes = [StepLane(response, rows, start, self._caches[0], offset, tables=self._tables[0])]
        return torch.cat(step_logits(self.model, lanes))


@dataclass
class LimitTiming:
    prefill_s: float  # one bare full forward over [prompt ; masks]
    step_s: list[float] = field(default_factory=list)  # bare response steps (empty for none)
    total_s: float = 0.0
    keys: int | None = None  # prompt entries per head in the step attention (None: no cache)
    attention_keys: int | None = None  # keys + L
    extrapolated: bool = False

    @property
    def median_step_s(self) -> float:
        if not self.step_s:
            return self.prefill_s if self.keys is None else 0.0
        s = sorted(self.step_s)
        mid = len(s) // 2
        return s[mid] if len(s) % 2 else 0.5 * (s[mid - 1] + s[mid])


def measure_limit(model: DiffusionLM, prompt: Tensor, gen: GenerationConfig, keys: int | None,
                  seed: int = 0) -> LimitTiming:
    """Time the limit for ``prompt`` (B, M): ``keys`` entries per head (budget or M), or None for no cache."""
    if model.config.block_causal:
        return _block_limit(model, prompt, gen, keys, seed)
    dev = model.device
    bsz, m = prompt.shape
    mask = torch.full((bsz, gen.gen_length), model.config.mask_token_id, dtype=prompt.dtype, device=dev)
    ids = torch.cat([prompt.to(dev), mask], 1)
    sched = rows_schedule(gen)
    t0 = now(dev)
    bare_full_forward(model, ids, torch.arange(m, m + sched[0][1], device=dev))
    prefill_s = now(dev) - t0
    if keys is None:
        return LimitTiming(prefill_s, [], prefill_s * len(sched), None, None, extrapolated=len(sched) > 1)
    steps = _timed_steps(BareSteps(model, m, min(keys, m), gen.gen_length, bsz, seed), mask, gen, sched[1:])
    return LimitTiming(prefill_s, steps, prefill_s + sum(steps), min(keys, m), min(keys, m) + gen.gen_length)


def measure_batch_limit(model: DiffusionLM, prompts: Tensor, gen: GenerationConfig, keys: int | None,
                        seed: int = 0) -> LimitTiming:
    """Time the limit of the B sequences ``prompts`` (B, M) generated together (see the module doc): ``keys``
    entries per head of each sequence (budget or M), or None for no cache. One sequence is ``measure_limit``."""
    bsz, m = prompts.shape
    if bsz == 1:
        return measure_limit(model, prompts, gen, keys, seed)
    if model.config.block_causal:
        return _block_limit(model, prompts, gen, keys, seed, per_sequence=True)
    if keys is None:  # no cache: every step one full forward of the whole batch, as the engine shares them
        return measure_limit(model, prompts, gen, None, seed)
    dev = model.device
    mask = torch.full((bsz, gen.gen_length), model.config.mask_token_id, dtype=prompts.dtype, device=dev)
    ids = torch.cat([prompts.to(dev), mask], 1)
    sched = rows_schedule(gen)
    first_rows = torch.arange(m, m + sched[0][1], device=dev)
    t0 = now(dev)
    bare_full_forward(model, ids, first_rows)  # the prefills, shared (the batch's prompts have one length here)
    prefill_s = now(dev) - t0
    kept = min(keys, m)
    steps = _timed_steps(BareSteps(model, m, kept, gen.gen_length, bsz, seed, per_sequence=True), mask, gen,
                         sched[1:])
    return LimitTiming(prefill_s, steps, prefill_s + sum(steps), kept, kept + gen.gen_length)


def _timed_steps(bare: BareSteps, mask: Tensor, gen: GenerationConfig, sched: list[tuple[int, int]]) -> list[float]:
    """The time of each of a bidirectional generation's later steps (``sched``: block and rows of each) as bare
    response-only forwards of ``mask`` (B, L)."""
    dev = bare.model.device
    steps: list[float] = []
    for blk, n in sched:
        lo = blk * gen.block_length
        rows = torch.arange(lo, lo + n, device=dev)
        t0 = now(dev)
        bare.step(mask, rows)
        steps.append(now(dev) - t0)
    return steps


@torch.no_grad()
def _block_limit(model: DiffusionLM, prompt: Tensor, gen: GenerationConfig, keys: int | None, seed: int,
                 per_sequence: bool = False) -> LimitTiming:
    """The limit of a block-causal model (see the module doc); ``per_sequence``: the rows of ``prompt`` are a batch
    of generations, each stepping over its own entries (the prefill windows run as one bare forward)."""
    dev, bl = model.device, gen.block_length
    bsz, m = prompt.shape
    split, total = m // bl * bl, -(-(m + gen.gen_length) // bl) * bl
    mask_id = model.config.mask_token_id
    ids = torch.cat([prompt.to(dev), torch.full((bsz, total - m), mask_id, dtype=prompt.dtype, device=dev)], 1)
    sched = rows_schedule(gen, m)

    def window(blk: int, n: int) -> float:
        """One bare block-causal forward over everything up to the end of block ``blk`` (its last n rows)."""
        end = split + (blk + 1) * bl
        t0 = now(dev)
        visible = block_causal_visible(0, end, end, bl, dev)
        hidden = dense_hidden(model, ids[:, :end], mlp_chunk=MLP_CHUNK, attn_mask=visible)
        model.head(hidden[:, end - n : end])
        return now(dev) - t0

    prefill_s = window(*sched[0])
    if keys is None:  # every step recomputes its window: one timed forward per block, times its steps
        per_block = {blk: window(blk, n) for blk, n in dict(sched).items()}
        total_s = sum(per_block[blk] for blk, _ in sched)
        return LimitTiming(prefill_s, [], total_s, None, None, extrapolated=len(sched) > 1)
    kept = min(keys, split)
    bare = BareSteps(model, split, kept, total - split, bsz, seed, per_sequence)
    steps: list[float] = []
    for i, (blk, n) in enumerate(sched):
        offset = blk * bl
        block = ids[:, split + offset : split + offset + bl]
        if i and blk != sched[i - 1][0]:  # the block before is finished: its final tokens pass once
            t0 = now(dev)
            bare.step(ids[:, split + offset - bl : split + offset], torch.arange(0, device=dev), offset - bl)
            steps.append(now(dev) - t0)
        if i:
            t0 = now(dev)
            bare.step(block, torch.arange(bl - n, bl, device=dev), offset)
            steps.append(now(dev) - t0)
    del bare
    return LimitTiming(prefill_s, steps, prefill_s + sum(steps), kept, kept + total - split)
