"""Mixture-of-experts MLPs (LLaDA2.x, LLaDA-MoE): the two routers, experts run grouped, the shared expert.

Routers (``MoEConfig.router``), as the upstream models compute them:

- ``sigmoid_groups`` (LLaDA2): ``s = sigmoid(x W^T)`` in fp32; the expert bias is added for *selection only*;
  the experts form ``n_group`` groups of consecutive experts, each scored by the sum of its two best biased
  scores; the ``topk_group`` best groups stay and the ``top_k`` best biased scores among their experts are the
  token's experts; their weights are the unbiased ``s`` normalised to sum 1 (when ``top_k > 1``) times
  ``routed_scaling``.
- ``softmax`` (LLaDA-MoE): ``p = softmax(x W^T)`` in fp32, plus the expert bias when there is one (which then
  moves both the selection and the weights); the ``top_k`` largest are the experts and their weights as they
  are (no normalisation, no scaling), cast to the activation dtype.

Experts run grouped: the (token, expert) pairs are sorted by expert and each active expert runs one matrix
product over all of its tokens (a Python loop over the active experts, never over tokens). The weighted outputs
of a token's experts are summed in the weights' dtype, then cast back; the shared expert (unweighted) is added.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from maskkv_cli.models.base import SwiGLU
from maskkv_cli.models.config import ModelConfig, MoEConfig
from maskkv_cli.models.rows import linear


class Router(nn.Module):
    """The gate: a bias-free projection to one score per expert, and (when the model has one) the expert bias.

    The bias is a parameter that is never trained here (upstream it is a buffer updated outside the gradient);
    a checkpoint without it loads with zeros."""

    def __init__(self, cfg: ModelConfig, moe: MoEConfig) -> None:
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.n_experts, cfg.d_model))
        self.expert_bias = nn.Parameter(torch.zeros(moe.n_experts), requires_grad=False) if moe.expert_bias else None

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(experts (N, top_k) int64, weights (N, top_k)) for the tokens x (N, d)."""
        if self.moe.router == "sigmoid_groups":
            return route_sigmoid_groups(x, self.weight, self.expert_bias, self.moe)
        return route_softmax(x, self.weight, self.expert_bias, self.moe.top_k)


def route_sigmoid_groups(x: Tensor, weight: Tensor, bias: Tensor | None, moe: MoEConfig) -> tuple[Tensor, Tensor]:
    """LLaDA2's router (see the module doc); weights in fp32."""
    scores = torch.sigmoid(linear(x.float(), weight.float()))  # (N, E)
    biased = scores if bias is None else scores + bias.float()
    n = scores.shape[0]
    if moe.n_group > 1 and moe.topk_group < moe.n_group:
        grouped = biased.view(n, moe.n_group, -1)
        group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)  # (N, groups)
        kept = group_score.topk(moe.topk_group, dim=-1).indices
        keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, kept, True)
        biased = biased.masked_fill(~keep[..., None].expand_as(grouped).reshape(n, -1), float("-inf"))
    experts = biased.topk(moe.top_k, dim=-1).indices
    weights = scores.gather(1, experts)
    if moe.top_k > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return experts, weights * moe.routed_scaling


def route_softmax(x: Tensor, weight: Tensor, bias: Tensor | None, top_k: int) -> tuple[Tensor, Tensor]:
    """LLaDA-MoE's router (see the module doc); weights in x's dtype."""
    probs = linear(x, weight).softmax(dim=-1, dtype=torch.float32)
    if bias is not None:
        probs = probs + bias.float()
    weights, experts = probs.topk(top_k, dim=-1)
    return experts, weights.to(x.dtype)


def run_experts(x: Tensor, experts: Tensor, weights: Tensor, modules: nn.ModuleList) -> Tensor:
    """``sum_j weights[:, j] * modules[experts[:, j]](x)`` for x (N, d): one product per active expert."""
    n, k = experts.shape
    flat = experts.reshape(-1)
    order = flat.argsort(stable=True)  # the (token, slot) pairs grouped by expert, in token order within one
    counts = torch.bincount(flat, minlength=len(modules)).tolist()
    routed = x[order // k]
    out = torch.empty_like(routed)
    start = 0
    for e, count in enumerate(counts):
        if count:  # its products keep the row floor: the same floats whatever else was routed (models/rows.py)
            out[start : start + count] = modules[e](routed[start : start + count])
            start += count
    per_slot = torch.empty_like(out)
    per_slot[order] = out  # back to (token, slot) order
    summed = (per_slot.view(n, k, -1).to(weights.dtype) * weights[..., None]).sum(dim=1)
    return summed.to(x.dtype)


class MoE(nn.Module):
    """Router, experts and (optionally) the shared expert of one layer; ``forward`` maps (B, T, d) to (B, T, d)."""

    def __init__(self, cfg: ModelConfig, moe: MoEConfig) -> None:
        super().__init__()
        self.gate = Router(cfg, moe)
        self.experts = nn.ModuleList(SwiGLU(cfg.d_model, moe.expert_hidden) for _ in range(moe.n_experts))
        self.shared_experts = None if moe.shared_hidden is None else SwiGLU(cfg.d_model, moe.shared_hidden)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        experts, weights = self.gate(flat)
        y = run_experts(flat, experts, weights, self.experts).view(shape)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y


def feed_forward_module(cfg: ModelConfig, layer: int) -> nn.Module:
    """Layer ``layer``'s MLP: a ``MoE`` where the config says so, else the dense SwiGLU of ``mlp_hidden_size``."""
    if cfg.moe is not None and cfg.moe.layers[layer]:
        return MoE(cfg, cfg.moe)
    return SwiGLU(cfg.d_model, cfg.mlp_hidden_size)
