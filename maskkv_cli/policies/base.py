"""What every eviction policy shares: the per-layer view it scores, its options, and the registry.

A policy answers three questions, each in a small method: how many prompt entries each layer keeps
(``layer_budgets``), how much each prompt entry of each head is worth (``scores``; ``+inf`` = always keep),
and how a layer's budget is split over its heads (``head_budgets``). Selection itself (top-k, gather,
padding) is shared and lives in ``maskkv_cli.kv.cache``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

from maskkv_cli.errors import UsageError
from maskkv_cli.kv.budgets import uniform_layer_budgets
from maskkv_cli.kv.votes import attention_mass

POOL_MODES = ("max", "avg")  # SnapKV's pooling of the window's scores (kv.votes.pool_scores)


@dataclass(frozen=True)
class PolicyOptions:
    alpha: float = 0.1  # MaskKV: share of a layer's budget spread uniformly over heads
    beta: float = 0.4  # MaskKV: share of the total budget spread uniformly over layers
    boundary: tuple[int, ...] | None = None  # MaskKV: boundary layers (default first and last)
    importance: tuple[float, ...] | None = None  # MaskKV: per-layer importance I(l) from calibration
    window: int = 32  # SnapKV family: observation window (last prompt tokens)
    pool_kernel: int = 7
    pool_mode: str = "max"
    sinks: int = 4  # StreamingLLM
    adakv_floor: float = 0.2
    pyramid_beta: float = 20.0
    seed: int = 0  # random policy
    residual_spread: float | None = None  # residual entries for heads at least this diffuse (None: the policy's)

    def __post_init__(self) -> None:
        """Values no policy can run with are refused here, not clamped or read as another setting later (a negative
        window ran as 0, a negative sink count pinned all but the last entry, an unknown pooling averaged)."""
        for name in ("window", "sinks", "pool_kernel"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "pool_kernel" else 0):
                raise UsageError(f"policy option {name} must be a whole number >= "
                                 f"{1 if name == 'pool_kernel' else 0}, got {value!r}")
        if self.pool_mode not in POOL_MODES:
            raise UsageError(f"policy option pool_mode must be one of {', '.join(POOL_MODES)}, got {self.pool_mode!r}")
        spread = self.residual_spread
        if spread is not None and (isinstance(spread, bool) or not isinstance(spread, int | float)
                                   or not 0.0 <= spread <= 1.0):  # (a share of the prompt; 0 turns it off)
            raise UsageError(f"policy option residual_spread must be a share of the prompt in [0, 1] (0: off), got "
                             f"{spread!r}")
        if self.importance is not None and not all(
                isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
                for v in self.importance):
            raise UsageError("policy option importance must hold finite numbers >= 0, one per layer")


QUERY_BLOCK = 2048  # query rows computed at once when the queries come from ``LayerView.compute_q``


@dataclass
class LayerView:
    """One layer of the prefill as a policy sees it: rotated q and k over ``[prompt ; masks]``.

    The prefill does not keep the whole q: it passes ``compute_q(start, stop)``, which returns the queries of
    positions [start, stop), and ``q`` is then a meta tensor that only carries the shape.
    """

    layer: int
    n_layers: int
    q: Tensor  # (B, H, T, D); shape only (device "meta") when ``compute_q`` is set
    k: Tensor  # (B, H_kv, T, D): key/value heads (H_kv < H under grouped-query attention)
    prompt_len: int
    scale: float
    _mask_mass: Tensor | None = field(default=None, repr=False)
    compute_q: Callable[[int, int], Tensor] | None = field(default=None, repr=False)
    # The first mask query (default ``prompt_len``; a block-causal model's first block also holds the prompt's
    # tail after the evictable entries), and which keys the queries of rows [start, stop) see (None: all).
    mask_start: int | None = None
    visible: Callable[[int, int], Tensor] | None = field(default=None, repr=False)

    @property
    def response_len(self) -> int:
        return self.q.shape[2] - self.prompt_len

    def queries(self, start: int, stop: int) -> Tensor:
        """(B, H, stop - start, D): the rotated queries at positions [start, stop)."""
        if self.compute_q is None:
            return self.q[:, :, start:stop]
        return self.compute_q(start, stop)

    def mask_mass(self) -> Tensor:
        """(B, H, T): attention each key receives from the mask (response) queries, softmax over all keys."""
        if self._mask_mass is None:
            first = self.prompt_len if self.mask_start is None else self.mask_start
            self._mask_mass = self.query_mass(first, self.q.shape[2])
        return self._mask_mass

    def query_mass(self, start: int, stop: int) -> Tensor:
        """(B, H, T): attention each key receives from the queries at positions [start, stop).

        Computed queries come ``QUERY_BLOCK`` rows at a time (the masses of disjoint query sets add up)."""
        if self.compute_q is None or stop - start <= QUERY_BLOCK:
            return self._mass(start, stop)
        total = self._mass(start, start + QUERY_BLOCK)
        for first in range(start + QUERY_BLOCK, stop, QUERY_BLOCK):
            total += self._mass(first, min(stop, first + QUERY_BLOCK))
        return total

    def _mass(self, start: int, stop: int) -> Tensor:
        visible = None if self.visible is None else self.visible(start, stop)
        return attention_mass(self.queries(start, stop), self.k, self.scale, visible=visible)

    def prompt_preference(self) -> Tensor:
        """(B, H) P_h: share of the mask queries' attention mass that lands on the prompt."""
        mass = self.mask_mass()
        to_prompt = mass[..., : self.prompt_len].sum(-1)
        return to_prompt / mass.sum(-1).clamp_min(1e-30)


class Policy:
    """Base class; subclasses override what differs. The defaults are uniform budgets."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    uses_cache: ClassVar[bool] = True  # False: recompute the whole sequence at every step (``none``)
    evicts: ClassVar[bool] = True  # False: keep the whole prompt (``full``)
    residual_default: ClassVar[float] = 0.0  # see ``residual_spread``; 0 = no residual entries
    uses_importance: ClassVar[bool] = False  # True: layer budgets come from the layer importance I(l)

    @property
    def residual_spread(self) -> float:
        """Heads whose mask queries spread their prompt attention over at least this share of the prompt
        (perplexity / M) trade one entry for a residual entry (``maskkv_cli.kv.residual``); 0 turns it off."""
        value = self.options.residual_spread
        return self.residual_default if value is None else value

    def __init__(self, options: PolicyOptions | None = None) -> None:
        self.options = options or PolicyOptions()

    def rule(self) -> dict[str, Any]:
        """Settings of the policy's rule added after results were first stored (empty for the original rules):
        benchmarks put them in their row keys, so rows stored under another rule are never reused."""
        spread = self.residual_spread
        return {"residual_spread": spread} if spread > 0 else {}

    def for_run(self, budget: int, prompt_len: int) -> Policy:
        """The policy as one run at ``budget`` over ``prompt_len`` cached entries uses it (``CachePlan.build``): the
        policy itself, or, for a rule that depends on the run (PyramidKV's one window), a copy holding it, so that
        plans built from one policy object each keep their own."""
        return self

    def layer_budgets(self, n_layers: int, budget: int, prompt_len: int) -> list[int]:
        return uniform_layer_budgets(n_layers, budget)

    def scores(self, view: LayerView, layer_budget: int) -> Tensor:
        raise NotImplementedError

    def head_budgets(self, view: LayerView, layer_budget: int, scores: Tensor) -> Tensor:
        b, h = scores.shape[:2]
        return torch.full((b, h), min(layer_budget, view.prompt_len), dtype=torch.int64, device=scores.device)

    def preference(self, view: LayerView) -> Tensor | None:
        """Per-head P_h when the policy computes it (reported in the run result)."""
        return None


REGISTRY: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    if not cls.name or cls.name in REGISTRY:
        raise ValueError(f"policy name {cls.name!r} is empty or already registered")
    REGISTRY[cls.name] = cls
    return cls


def get_policy(name: str, options: PolicyOptions | None = None) -> Policy:
    return REGISTRY[check_policy(name)](options)


def check_policy(name: str, where: str = "") -> str:
    """``name`` when a policy is registered under it; else a ``UsageError`` listing them (``where``: a prefix naming
    where the name was given, e.g. a jobs file's line)."""
    names = policy_names()
    if name not in names:
        raise UsageError(f"{where}unknown policy {name!r}; choose one of: {', '.join(names)}")
    return name


def uses_importance(name: str) -> bool:
    """Whether the policy called ``name`` takes its layer budgets from I(l) (False for unknown names)."""
    import maskkv_cli.policies  # noqa: F401

    cls = REGISTRY.get(name)
    return bool(cls and cls.uses_importance)


def policy_names() -> list[str]:
    import maskkv_cli.policies  # noqa: F401

    return list(REGISTRY)
