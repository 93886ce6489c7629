"""MaskKV and its ablations: prompt entries ranked by the attention of queries at step 0."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from maskkv_cli.errors import UsageError
from maskkv_cli.kv.budgets import boundary_layer_budgets, preference_head_budgets, uniform_layer_budgets
from maskkv_cli.kv.votes import neighbour_scores, pool_scores
from maskkv_cli.policies.base import LayerView, Policy, register

# Spread threshold of ``maskkv-residual`` and ``maskkv-plus``: a head whose mask queries each spread their prompt
# attention over at least this share of the prompt (mean perplexity / M) gets a residual entry. How the value was
# chosen: docs/policies.md.
RESIDUAL_SPREAD = 0.75


@register
class MaskKV(Policy):
    name = "maskkv"
    summary = ("Mask-query voting: keep the prompt entries the response's mask queries attend to; layer budgets "
               "from a calibration profile (boundary-aware), head budgets by prompt preference (the paper's method).")
    uses_importance = True

    def layer_budgets(self, n_layers: int, budget: int, prompt_len: int) -> list[int]:
        imp = self.options.importance
        if imp is None:
            return uniform_layer_budgets(n_layers, budget)
        if len(imp) != n_layers:  # (a profile's length is checked against the model before it is used)
            raise UsageError(f"policy option importance has {len(imp)} values for a model of {n_layers} layers")
        return boundary_layer_budgets(list(imp), budget, self.options.beta, self.options.boundary,
                                      max_budget=prompt_len)

    def scores(self, view: LayerView, layer_budget: int) -> Tensor:
        return view.mask_mass()[..., : view.prompt_len]

    def head_budgets(self, view: LayerView, layer_budget: int, scores: Tensor) -> Tensor:
        return preference_head_budgets(layer_budget, view.prompt_preference(), self.options.alpha,
                                       max_len=view.prompt_len)

    def preference(self, view: LayerView) -> Tensor | None:
        return view.prompt_preference()


@register
class MaskKVResidual(MaskKV):
    name = "maskkv-residual"
    summary = ("MaskKV, and diffuse heads trade one entry for a residual entry standing in for what they evicted "
               "(ours, opt-in; docs/policies.md).")
    residual_default = RESIDUAL_SPREAD


# Kernel of the neighbour pooling of ``maskkv-pooled``: a voted entry lends its score to the entry on each side.
VOTE_POOL_KERNEL = 3


@register
class MaskKVPooled(MaskKV):
    name = "maskkv-pooled"
    summary = ("MaskKV with its votes max-pooled over 3 neighbouring tokens, so the entries beside a voted one "
               "stay too (ours, opt-in; docs/tiny-model.md).")

    def scores(self, view: LayerView, layer_budget: int) -> Tensor:
        return pool_scores(super().scores(view, layer_budget), VOTE_POOL_KERNEL, "max")

    def rule(self) -> dict[str, Any]:
        return {**super().rule(), "vote_pool": VOTE_POOL_KERNEL}


# Neighbour votes of ``maskkv-plus``: an entry scores at least ``NEIGHBOUR_WEIGHT`` times the best vote among
# itself and the entries within ``NEIGHBOUR_KERNEL // 2`` on each side (``kv.votes.neighbour_scores``). How the
# values were chosen: docs/policies.md.
NEIGHBOUR_KERNEL = 3
NEIGHBOUR_WEIGHT = 0.5


@register
class MaskKVPlus(MaskKV):
    name = "maskkv-plus"
    summary = ("MaskKV, and the entries beside a voted one score at least half its votes, and diffuse heads get a "
               "residual entry (ours, experimental: tuned on the tiny model; compare on your checkpoint with "
               "`maskkv bench quality --policies full,maskkv,maskkv-plus`).")
    residual_default = RESIDUAL_SPREAD

    def scores(self, view: LayerView, layer_budget: int) -> Tensor:
        return neighbour_scores(super().scores(view, layer_budget), NEIGHBOUR_KERNEL, NEIGHBOUR_WEIGHT)

    def rule(self) -> dict[str, Any]:
        return {**super().rule(), "neighbours": [NEIGHBOUR_KERNEL, NEIGHBOUR_WEIGHT]}


@register
class MaskVoteUniform(Policy):
    name = "mask-vote-uniform"
    summary = "Ablation: mask-query voting with the same budget for every layer and head."

    def scores(self, view: LayerView, layer_budget: int) -> Tensor:
        return view.mask_mass()[..., : view.prompt_len]


@register
class PromptVote(Policy):
    name = "prompt-vote"
    summary = "Ablation: votes cast by the prompt's own queries (all of them), uniform budgets."

    def scores(self, view: LayerView, layer_budget: int) -> Tensor:
        return view.query_mass(0, view.prompt_len)[..., : view.prompt_len]


@register
class AllVote(Policy):
    name = "all-vote"
    summary = "Ablation: votes cast by every query (prompt and masks), uniform budgets."

    def scores(self, view: LayerView, layer_budget: int) -> Tensor:
        return view.query_mass(0, view.q.shape[2])[..., : view.prompt_len]
