"""Baselines beside MaskKV: no cache, full cache, SnapKV, PyramidKV, AdaKV, StreamingLLM, random."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor

from maskkv_cli.kv.budgets import adakv_head_budgets, pyramid_layer_budgets
from maskkv_cli.kv.votes import pool_scores
from maskkv_cli.policies.base import LayerView, Policy, register


@register
class NoCache(Policy):
    name = "none"
    summary = "Vanilla sampler: the whole sequence is recomputed at every step (reference quality, slowest)."
    uses_cache = False
    evicts = False


@register
class FullCache(Policy):
    name = "full"
    summary = "Prefix cache of the whole prompt, computed at step 0 and reused; nothing evicted."
    evicts = False


def snap_window(layer_budget: int, window: int, prompt_len: int) -> int:
    """The observation window actually used: at most half the budget and less than the prompt."""
    return max(0, min(window, layer_budget // 2, prompt_len - 1))


def snap_prefix_scores(view: LayerView, window: int, kernel: int, mode: str) -> Tensor:
    """(B, H, M - W) pooled attention of the last W prompt queries onto the prompt prefix."""
    m = view.prompt_len
    mass = view.query_mass(m - window, m)[..., : m - window]
    return pool_scores(mass, kernel, mode)


def with_window(prefix: Tensor, window: int) -> Tensor:
    b, h, _ = prefix.shape
    forced = torch.full((b, h, window), float("inf"), dtype=prefix.dtype, device=prefix.device)
    return torch.cat((prefix, forced), dim=-1)


@register
class SnapKV(Policy):
    name = "snapkv"
    summary = ("Votes of the last 32 prompt queries (the observation window), max-pooled (kernel 7); keeps the "
               "top B - W prefix entries plus the window.")

    def window(self, layer_budget: int, prompt_len: int) -> int:
        """The observation window W of a layer with this budget."""
        return snap_window(layer_budget, self.options.window, prompt_len)

    def scores(self, view: LayerView, layer_budget: int) -> Tensor:
        w = self.window(layer_budget, view.prompt_len)
        if w == 0:
            return view.query_mass(0, view.prompt_len)[..., : view.prompt_len]
        prefix = snap_prefix_scores(view, w, self.options.pool_kernel, self.options.pool_mode)
        return with_window(prefix, w)


@register
class PyramidKV(SnapKV):
    name = "pyramidkv"
    summary = "SnapKV scores with a pyramid of layer budgets: more in the bottom layers, fewer on top (beta 20)."

    run_window: int | None = None  # W of the run, set by ``for_run`` on the run's copy and by ``layer_budgets``

    def for_run(self, budget: int, prompt_len: int) -> PyramidKV:
        bound = copy.copy(self)
        bound.run_window = snap_window(budget, self.options.window, prompt_len)
        return bound

    def layer_budgets(self, n_layers: int, budget: int, prompt_len: int) -> list[int]:
        self.run_window = snap_window(budget, self.options.window, prompt_len)
        return pyramid_layer_budgets(n_layers, budget, self.run_window, prompt_len, self.options.pyramid_beta)

    def window(self, layer_budget: int, prompt_len: int) -> int:
        """One W for the whole run: the W the layer budgets were computed with (every layer keeps the same last
        W prompt tokens plus its own share of the prefix). Without a plan from ``layer_budgets`` (a hand-made
        uniform plan), SnapKV's rule for the layer's budget."""
        if self.run_window is None:
            return super().window(layer_budget, prompt_len)
        return min(self.run_window, prompt_len - 1)

    def rule(self) -> dict[str, Any]:
        return {**super().rule(), "window": "per run"}  # rows stored when each layer picked its own W are stale


@register
class AdaKV(SnapKV):
    name = "adakv"
    summary = ("SnapKV scores; a layer's budget goes to heads by a layer-wide top-k of scores, with a 20% "
               "uniform floor per head.")

    def head_budgets(self, view: LayerView, layer_budget: int, scores: Tensor) -> Tensor:
        w = snap_window(layer_budget, self.options.window, view.prompt_len)
        prefix = scores[..., : view.prompt_len - w]
        return adakv_head_budgets(prefix, layer_budget, w, self.options.adakv_floor).clamp(1, view.prompt_len)


@register
class StreamingLLM(Policy):
    name = "streamingllm"
    summary = "Attention sinks (the first 4 prompt tokens) plus the most recent B - 4 prompt tokens."

    def scores(self, view: LayerView, layer_budget: int) -> Tensor:
        m = view.prompt_len
        b, h = view.k.shape[:2]
        recency = torch.arange(m, dtype=torch.float32, device=view.k.device).expand(b, h, m).clone()
        recency[..., : self.options.sinks] = float("inf")
        return recency


@register
class RandomPolicy(Policy):
    name = "random"
    summary = "Uniformly random prompt entries per head (a floor for the others)."

    def scores(self, view: LayerView, layer_budget: int) -> Tensor:
        gen = torch.Generator(device="cpu").manual_seed(self.options.seed * 1000003 + view.layer)
        b, h = view.k.shape[:2]
        # every sequence of a batch draws what it draws alone (one draw per layer, the same for each row)
        return torch.rand((1, h, view.prompt_len), generator=gen).to(view.k.device).expand(b, h, view.prompt_len)
