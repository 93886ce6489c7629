"""How a generation's steps become engine lanes, as its cache plan says: the one place a step is planned.

A denoising loop asks for the logits of some response positions of its sequence (``StepRequest``). Its forward
turns that into an engine lane (``engine/lanes.py``): the plain forward for policy ``none`` (the whole sequence
again), the prefill at the first request (step 0: exact attention, votes, per-layer selection), and a response-only
step over the compressed cache after it. The driver (``sampling/driver.py``) runs every active generation's lanes
together and hands each forward its output back (``take``). A forward that gives no lane runs its step alone: a
compiled or captured step runner (``engine/step_runner.py``, with its fixed shapes), and DiffusionGemma's forwards,
whose family has no engine lanes.

``CachedForward`` is the bidirectional models' ``[prompt ; masks]`` (LLaDA, Dream, LLaDA-MoE); ``BlockForward``
the block-causal one's window of blocks (LLaDA2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from maskkv_cli.engine.lanes import Layout, PrefillLane, RopeMemo, StepLane, block_causal_visible
from maskkv_cli.engine.plan import CachePlan
from maskkv_cli.engine.prefill import selection_sink
from maskkv_cli.engine.selection import LayerRecord
from maskkv_cli.engine.step_runner import StepRunner
from maskkv_cli.errors import UsageError
from maskkv_cli.kv.cache import PromptCache
from maskkv_cli.models.protocol import DiffusionLM
from maskkv_cli.sampling.picks import Pick

Lane = PrefillLane | StepLane


@dataclass(frozen=True)
class StepRequest:
    """What a denoising loop asks of the forward at one step: logits of the rows ``rows`` of the sequence ``x``
    (B, M + L) (response positions for ``CachedForward``, rows of the block for ``BlockForward``); ``block_start``:
    the first position of the block that holds them (``BlockForward``: the block's first sequence position);
    ``finish``: the block is finished, its final tokens run once more for their keys and values (``BlockForward``);
    ``pick``: the loop's greedy rule; it is then sent that rule's ``Picked``, not the logits (``sampling/picks.py``)."""

    x: Tensor
    rows: Tensor
    block_start: int | None = None
    finish: bool = False
    pick: Pick | None = None


@dataclass(frozen=True)
class ManyRequest:
    """What a loop that steps several sequences together (``sampling/cohort.py``) asks at one step: ``requests[g]``
    of sequence g, whose engine lane its forward ``forwards[g]`` makes (as it would for that sequence alone), each
    asking for as many rows; it is sent ``pick``'s ``Picked`` over all their rows at once, shaped (G, n)."""

    requests: tuple[StepRequest, ...]
    forwards: tuple[Forward, ...]
    pick: Pick


class Forward:
    """What both forwards share: the plan, the cache once built, the records of its layers, the budgets used."""

    def __init__(self, model: DiffusionLM, plan: CachePlan) -> None:
        self.model, self.plan, self.policy = model, plan, plan.policy
        self.prompt_len, self.split = plan.prompt_len, plan.split
        self.step_options = plan.step_options
        self.setup_s = 0.0  # time spent building a step runner (compilation / capture), not a step's work
        self.cache: PromptCache | None = None
        self.records: list[LayerRecord] = []
        # the per-layer budgets: the plan's, replaced by those actually used after an online prefill
        self.layer_budgets: list[int] | None = None if plan.layer_budgets is None else list(plan.layer_budgets)
        self.batch = 1
        self.tables = RopeMemo()  # the RoPE tables of the later steps' positions, computed once

    def lane(self, request: StepRequest) -> Lane | None:
        """The engine lane of this request; None when it runs alone (``alone``)."""
        raise NotImplementedError

    def alone(self, request: StepRequest) -> Tensor:
        raise NotImplementedError

    def _prefill_lane(self, ids: Tensor, rows: Tensor, response_slots: int, layout: Layout | None = None) -> Lane:
        sink, measure = selection_sink(self.policy, self.layer_budgets, self.split, response_slots,
                                       len(self.model.blocks), self.plan.online)
        return PrefillLane(ids, self.split, rows, sink, layout, self.plan.prefix, measure=measure,
                           rope_factor=self.plan.rope_factor)

    def take(self, lane: Lane, output: object) -> Tensor:
        """This forward's share of the engine's output for ``lane``: the logits its loop is sent."""
        if isinstance(lane, StepLane):
            assert isinstance(output, Tensor)
            return output
        logits, importance = output  # type: ignore[misc]
        assert lane.sink is not None
        self.cache, self.records = lane.sink.finish(importance)
        if self.plan.online and self.layer_budgets is not None:
            self.layer_budgets = [r.layer_budget for r in self.records]  # the plan actually used
        self.after_prefill(lane)
        return logits

    def after_prefill(self, lane: PrefillLane) -> None:
        """Anything a forward builds once its cache exists."""


class CachedForward(Forward):
    """Step 0 and later steps of ``[prompt ; masks]`` for one plan: plain recompute, or prefill + response-only
    steps.

    With a logit shift (Dream: position i is predicted from hidden state i - 1) the cached segment is the
    prompt minus its last token, which runs with the response at every step so that the first response
    position gets fresh logits.
    """

    def __init__(self, model: DiffusionLM, plan: CachePlan, row_window: int | None = None) -> None:
        super().__init__(model, plan)
        self.shift = model.config.logit_shift
        self.runner: StepRunner | None = None
        self.row_window = row_window  # the sampler's block: each later step's rows lie in one such window

    def lane(self, request: StepRequest) -> Lane | None:
        x, rows = request.x, request.rows
        self.batch = x.shape[0]
        if self.cache is not None:  # a later step: the response rows over the cache
            if self.runner is not None:
                return None
            return StepLane(x[:, self.split :], self.response_rows(rows), self.split, self.cache,
                            rope_factor=self.plan.rope_factor, tables=self.tables)
        hidden = self.plain_rows(rows)  # sequence index of the hidden state feeding each row
        if not self.policy.uses_cache:
            return StepLane(x, hidden, 0, rope_factor=self.plan.rope_factor, tables=self.tables)
        return self._prefill_lane(x, hidden, x.shape[1] - self.split)

    def after_prefill(self, lane: PrefillLane) -> None:
        if not self.step_options.eager:
            assert self.cache is not None
            self.runner = StepRunner(self.model, self.cache, lane.ids[:, self.split :], self.step_options,
                                     self.row_window, self.plan.rope_factor)
            self.setup_s = self.runner.setup_s

    def alone(self, request: StepRequest) -> Tensor:
        assert self.runner is not None
        return self.runner(request.x[:, self.split :], self.response_rows(request.rows), request.block_start)

    def response_rows(self, rows: Tensor) -> Tensor:
        """The rows of the response-only pass (``x[:, split:]``) that feed response positions ``rows`` (``rows``
        itself where they coincide: the cached segment is the whole prompt and there is no logit shift)."""
        offset = self.prompt_len - self.shift - self.split
        return rows if offset == 0 else rows + offset

    def plain_rows(self, rows: Tensor) -> Tensor:
        """The sequence positions whose hidden states feed response positions ``rows`` (the plain forward)."""
        return rows + (self.prompt_len - self.shift)


class BlockForward(Forward):
    """A block-causal model's block at one step, as the plan says: without a cache the whole window of blocks
    again (block-causal mask); with one, the prefill over ``[prompt ; first block]`` at the first step, then the
    current block only, over the kept prompt entries, the finished blocks and itself; a finished block's final
    tokens run once more (``request.finish``) so that the blocks after it see their exact keys and values.

    That pass attends as the windows of the no-cache loop after it compute the block: over every later slot of the
    canvas too, masked (``StepLane.reach``), not as the last block of its own window. SDPA rounds a row's sum by
    how many keys it runs over, masked ones included (CPU's kernel: by its tiles of up to 512 keys and the blocking
    of its products over them), so the block cut off at its end would get other keys and values than the windows
    after it use (bf16: other tokens). Spanning to the canvas's end, as the last window does, matched more later
    windows than spanning one block (94% against 68% of block-and-window pairs, head dim 128, blocks of 32, 1,100
    positions): where the later windows themselves round a block otherwise, no single copy matches them all."""

    def __init__(self, model: DiffusionLM, plan: CachePlan, block_length: int, total: int) -> None:
        if not plan.step_options.eager:
            raise UsageError("the compile and cuda-graph step modes are not available for block-causal models "
                             "(LLaDA2) yet")
        super().__init__(model, plan)
        self.block, self.total = block_length, total

    @property
    def keeps_blocks(self) -> bool:
        """Whether finished blocks must be written into a cache (``request.finish``)."""
        return self.policy.uses_cache

    def lane(self, request: StepRequest) -> Lane | None:
        x, rows = request.x, request.rows
        assert request.block_start is not None
        start = request.block_start
        end = start + self.block
        self.batch = x.shape[0]
        factor = self.plan.rope_factor
        if not self.policy.uses_cache:
            visible = block_causal_visible(0, end, end, self.block, x.device)
            return StepLane(x[:, :end], start + rows.to(x.device), 0, visible=visible, rope_factor=factor,
                            tables=self.tables)
        if self.cache is None:
            layout = Layout(block=self.block, mask_start=self.prompt_len, response_slots=self.total - self.split)
            return self._prefill_lane(x[:, :end], start + rows, self.total - self.split, layout)
        reach = self.total - end if request.finish else 0  # a finished block spans the rest of the canvas
        return StepLane(x[:, start:end], rows, start, self.cache, start - self.split, rope_factor=factor, reach=reach,
                        tables=self.tables)

    def alone(self, request: StepRequest) -> Tensor:
        raise AssertionError("a block-causal model's steps always share the engine")


def finish_rows(device: torch.device | str) -> Tensor:
    """The rows of a finished block's pass: none (only its keys and values are written)."""
    return torch.empty(0, dtype=torch.long, device=device)
