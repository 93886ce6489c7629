"""Cache budgets: how many prompt K/V pairs each layer and each head keeps.

Pure functions over ints and tensors (the rules of docs/policies.md):

- ``resolve_budget``: the per-head budget B from ``--budget`` or ``--ratio``.
- ``uniform_layer_budgets`` / ``boundary_layer_budgets`` / ``pyramid_layer_budgets``: one budget per layer.
- ``preference_head_budgets`` (MaskKV) / ``adakv_head_budgets`` (AdaKV): one budget per head of a layer.
- ``distribute_exact``: the shared rule that makes a set of integer budgets hit an exact total.

Option values that come from the user (budget, ratio, alpha, beta, floor, window, boundary layers) raise
``UsageError``; malformed data (tensor shapes, non-finite values, impossible totals) raises ``ValueError``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

import torch

from maskkv_cli.errors import UsageError

__all__ = [
    "adakv_head_budgets",
    "boundary_layer_budgets",
    "distribute_exact",
    "preference_head_budgets",
    "pyramid_layer_budgets",
    "resolve_budget",
    "uniform_layer_budgets",
]

# Slack for floor() of float products (alpha * k etc.); far above float64 error at these magnitudes and far
# below any real fractional part we care about.
_FLOOR_EPS = 1e-7


def _decimal(x: float) -> Fraction:
    """The float as the user wrote it (0.3 -> 3/10), so that floor/ceil of products is not off by one."""
    return Fraction(repr(float(x)))


def check_budget(budget: int, name: str = "--budget") -> None:
    if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
        raise UsageError(f"{name} must be a positive integer, got {budget!r}")


def check_ratio(ratio: float) -> None:
    """``--ratio``: a share of the prompt in (0, 1]."""
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not (0.0 < ratio <= 1.0):
        raise UsageError(f"--ratio must be a number in (0, 1], got {ratio!r}")


def _check_unit(value: float, name: str) -> None:
    if not (0.0 <= value <= 1.0):
        raise UsageError(f"{name} must be between 0 and 1, got {value!r}")


def _check_window(window: int) -> None:
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise UsageError(f"--window must be a non-negative integer, got {window!r}")


def resolve_budget(budget: int | None, ratio: float | None, prompt_len: int) -> int:
    """Per-head prompt budget B from exactly one of ``--budget`` and ``--ratio``.

    ``ratio`` is a share of the prompt: ``max(1, ceil(ratio * prompt_len))``, with the ratio taken as written
    (0.1 of 30 tokens is 3, not 4). The result is not capped at the prompt length: a budget that covers the
    whole prompt means "no eviction" further on.
    """
    if prompt_len < 0:
        raise ValueError(f"prompt_len must be >= 0, got {prompt_len}")
    if (budget is None) == (ratio is None):
        raise UsageError("give exactly one of --budget and --ratio")
    if budget is not None:
        check_budget(budget)
        return budget
    assert ratio is not None
    check_ratio(ratio)
    return max(1, math.ceil(_decimal(ratio) * prompt_len))


def uniform_layer_budgets(n_layers: int, budget: int) -> list[int]:
    """The same budget B for every layer (SnapKV, AdaKV, MaskKV without the boundary-aware split)."""
    if n_layers < 0:
        raise ValueError(f"n_layers must be >= 0, got {n_layers}")
    check_budget(budget)
    return [budget] * n_layers


def _round_robin(room: torch.Tensor | None, amount: int, width: int) -> torch.Tensor:
    """Increments handing out ``amount`` units one at a time, cycling over ``width`` slots in their order.

    ``room`` (int64, per slot, same order) is how many units each slot can still take (None: unbounded). A
    full slot is skipped. Closed form instead of a loop: r complete rounds, then the first few slots that
    still have room get one more.
    """
    if room is None:
        rounds, rest = divmod(amount, width)
        inc = torch.full((width,), rounds, dtype=torch.int64)
        inc[:rest] += 1
        return inc
    if amount > int(room.sum()):
        raise ValueError(f"cannot place {amount} more units in slots with room {room.tolist()}")
    lo, hi = 0, int(room.max()) if width else 0
    while lo < hi:  # largest r with sum(min(room, r)) <= amount
        mid = (lo + hi + 1) // 2
        if int(room.clamp(max=mid).sum()) <= amount:
            lo = mid
        else:
            hi = mid - 1
    inc = room.clamp(max=lo)
    rest = amount - int(inc.sum())
    open_slots = torch.nonzero(room > lo).flatten()[:rest]
    inc[open_slots] += 1
    return inc


def distribute_exact(
    values: torch.Tensor,
    target: int,
    priority: torch.Tensor,
    lower: int = 1,
    upper: int | None = None,
) -> torch.Tensor:
    """Clamp integer budgets to ``[lower, upper]``, then make every row sum to ``target`` exactly.

    Our leftover rule (docs/policies.md, "Budget convention"): missing units go one at a time to the slots with
    the highest ``priority`` that are below ``upper`` (ties: lower index first), cycling round-robin when there are more
    units than slots; surplus units are taken one at a time from the slots with the lowest ``priority`` that
    are above ``lower`` (ties: higher index first), also round-robin.

    ``values`` and ``priority`` are ``(H,)`` or ``(B, H)``; returns int64 of the same shape.
    Raises ``ValueError`` when ``target`` is outside ``[H * lower, H * upper]``.
    """
    if values.shape != priority.shape:
        raise ValueError(f"values {tuple(values.shape)} and priority {tuple(priority.shape)} differ in shape")
    if values.dim() not in (1, 2):
        raise ValueError(f"values must be 1-D or 2-D, got shape {tuple(values.shape)}")
    if upper is not None and upper < lower:
        raise ValueError(f"upper ({upper}) is below lower ({lower})")
    rows = values.reshape(-1, values.shape[-1]).to(torch.int64)
    prio = priority.reshape(rows.shape).to(torch.float64)
    width = rows.shape[1]
    if width == 0:
        if target != 0:
            raise ValueError(f"cannot reach a total of {target} with no slots")
        return rows.reshape(values.shape).clone()
    if target < width * lower or (upper is not None and target > width * upper):
        raise ValueError(f"a total of {target} is impossible for {width} slots within [{lower}, {upper}]")
    out = rows.clamp(min=lower) if upper is None else rows.clamp(min=lower, max=upper)
    out = out.clone()
    for r in range(out.shape[0]):
        diff = target - int(out[r].sum())
        if diff == 0:
            continue
        # Highest priority first, ties by lower index; reversed, it is lowest first with ties by higher index.
        order = torch.sort(prio[r], descending=True, stable=True).indices
        if diff > 0:
            room = None if upper is None else upper - out[r, order]
            out[r, order] += _round_robin(room, diff, width)
        else:
            order = order.flip(0)
            room = out[r, order] - lower
            out[r, order] -= _round_robin(room, -diff, width)
    return out.reshape(values.shape)


def _boundary_indexes(boundary: Sequence[int] | None, n_layers: int) -> list[int]:
    """Normalized, validated boundary layer indexes (default: first and last layer)."""
    if boundary is None:
        return sorted({0, n_layers - 1})
    result: list[int] = []
    for raw in boundary:
        if isinstance(raw, bool) or not isinstance(raw, int) or not (-n_layers <= raw < n_layers):
            raise UsageError(f"boundary layer {raw!r} is not a layer index of a model with {n_layers} layers")
        idx = raw % n_layers
        if idx in result:
            raise UsageError(f"boundary layer {raw} is given twice (as layer {idx})")
        result.append(idx)
    return sorted(result)


def boundary_layer_budgets(
    importance: Sequence[float],
    budget: int,
    beta: float = 0.4,
    boundary: Sequence[int] | None = None,
    max_budget: int | None = None,
) -> list[int]:
    """Boundary-aware layer budgets of MaskKV (docs/policies.md, "Layer budgets of `maskkv`"; the paper's layer level).

    ``k_p = D * B``; ``k_base = floor(beta * k_p / D)``; ``k_imp = k_p - D * k_base`` is split between the
    boundary group (default: first and last layer) and the middle group in proportion to their summed
    importance (by group size if both sums are 0); each layer gets ``k_base`` plus the floor of an equal share
    of its group. The rounding leftovers go one at a time to the most important layers (ties: lower index), so
    the total is exactly ``D * B``; every layer keeps at least 1. Negative importance counts as 0. When no
    layer is left in one group (``boundary=()`` or every layer a boundary layer) all layers form one group.

    ``max_budget`` (the prompt length M: a layer's heads hold at most ``H * M`` entries) caps every layer; what a
    capped layer cannot hold moves to the layers with room, spread evenly over them (the most important first
    for the last units), so the total is ``min(D * B, D * M)`` and each layer's budget grows with B.
    """
    n_layers = len(importance)
    if n_layers < 1:
        raise ValueError("importance must have one value per layer, got none")
    check_budget(budget)
    _check_unit(beta, "beta")
    if max_budget is not None and max_budget < 1:
        raise ValueError(f"max_budget must be >= 1, got {max_budget}")
    values = [float(x) for x in importance]
    if not all(math.isfinite(x) for x in values):
        raise ValueError(f"layer importance must be finite, got {values}")
    imp = [Fraction(max(0.0, x)) for x in values]
    bound = _boundary_indexes(boundary, n_layers)
    bound_set = set(bound)
    middle = [i for i in range(n_layers) if i not in bound_set]

    total = n_layers * budget  # k_p
    k_base = math.floor(_decimal(beta) * total / n_layers)
    k_imp = total - n_layers * k_base
    shares = [Fraction(0)] * n_layers
    groups = [g for g in (bound, middle) if g]
    if len(groups) == 1:
        group_budgets = [Fraction(k_imp)]
    else:
        imp_b = sum((imp[i] for i in bound), Fraction(0))
        imp_m = sum((imp[i] for i in middle), Fraction(0))
        if imp_b + imp_m > 0:
            k_group_b = k_imp * imp_b / (imp_b + imp_m)
        else:
            k_group_b = Fraction(k_imp * len(bound), n_layers)
        group_budgets = [k_group_b, k_imp - k_group_b]
    for group, k_group in zip(groups, group_budgets, strict=True):
        for i in group:
            shares[i] = k_group / len(group)
    per_layer = torch.tensor([k_base + math.floor(s) for s in shares], dtype=torch.int64)
    priority = torch.tensor([float(x) for x in imp], dtype=torch.float64)
    target = total if max_budget is None else min(total, n_layers * max_budget)
    return distribute_exact(per_layer, target, priority, lower=1, upper=max_budget).tolist()


def pyramid_layer_budgets(
    n_layers: int,
    budget: int,
    window: int,
    prompt_len: int,
    beta: float = 20.0,
) -> list[int]:
    """PyramidKV layer budgets, window included (docs/policies.md, "The policies").

    With ``b = B - W``: ``min = b / beta``, ``max = 2b - min`` (capped at ``prompt_len - W``, then
    ``min = 2b - max``), layer l targets ``max - l * (max - min) / (L - 1)`` prefix tokens. The float targets
    sum to ``L * b``; largest-remainder rounding (ties: lower layer) keeps that total exact and the budgets
    non-increasing with depth. Falls back to uniform when ``L == 1``, ``B <= W`` or the whole prompt fits
    (``prompt_len <= B``). With ``W == 0`` every layer still keeps at least 1 token.
    """
    if n_layers < 1:
        raise ValueError(f"n_layers must be >= 1, got {n_layers}")
    check_budget(budget)
    _check_window(window)
    if prompt_len < 0:
        raise ValueError(f"prompt_len must be >= 0, got {prompt_len}")
    if not (math.isfinite(beta) and beta >= 1.0):
        raise UsageError(f"PyramidKV beta must be a number >= 1, got {beta!r}")
    if n_layers == 1 or budget <= window or prompt_len <= budget:
        return [budget] * n_layers

    b = budget - window
    low = Fraction(b) / _decimal(beta)
    high = 2 * b - low
    if high > prompt_len - window:
        high = Fraction(prompt_len - window)
        low = 2 * b - high
    step = (high - low) / (n_layers - 1)
    targets = [high - layer * step for layer in range(n_layers)]
    floors = [math.floor(t) for t in targets]
    leftovers = n_layers * b - sum(floors)  # == sum of fractional parts, an integer < n_layers
    by_remainder = sorted(range(n_layers), key=lambda i: (-(targets[i] - floors[i]), i))
    prefix = floors[:]
    for i in by_remainder[:leftovers]:
        prefix[i] += 1
    if window == 0:
        # Keep >= 1 per layer; take the surplus from the largest layers, deepest first (stays non-increasing).
        surplus = sum(1 for p in prefix if p < 1)
        prefix = [max(p, 1) for p in prefix]
        for _ in range(surplus):
            top = max(prefix)
            deepest_top = max(i for i, p in enumerate(prefix) if p == top)
            prefix[deepest_top] -= 1
    return [p + window for p in prefix]


def preference_head_budgets(
    layer_budget: int,
    pref: torch.Tensor,
    alpha: float = 0.1,
    max_len: int | None = None,
) -> torch.Tensor:
    """Prompt-preference head budgets of MaskKV (docs/policies.md, "The policies"; the paper's head level).

    ``pref`` is ``(B, H)``: P_h per batch element and head. ``Phat = P / sum_h P`` (uniform if the sum is 0),
    ``k_h = floor(alpha * k_l + (1 - alpha) * H * k_l * Phat_h)``, clamped to ``[1, max_len]``; then the row
    total is made exactly ``H * k_l`` (or ``H * max_len`` if smaller) with ``distribute_exact``, by P.
    Negative P counts as 0. Returns int64 ``(B, H)``.
    """
    check_budget(layer_budget, "layer budget")
    _check_unit(alpha, "alpha")
    if pref.dim() != 2 or pref.shape[1] < 1:
        raise ValueError(f"pref must have shape (batch, heads), got {tuple(pref.shape)}")
    if max_len is not None and max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    p = pref.detach().to(device="cpu", dtype=torch.float64)
    if not bool(torch.isfinite(p).all()):
        raise ValueError("prompt preference contains non-finite values")
    p = p.clamp(min=0.0)
    n_heads = p.shape[1]
    sums = p.sum(dim=1, keepdim=True)
    p_hat = torch.where(sums > 0, p / sums.clamp(min=torch.finfo(torch.float64).tiny), 1.0 / n_heads)
    raw = alpha * layer_budget + (1.0 - alpha) * n_heads * layer_budget * p_hat
    heads = torch.floor(raw + _FLOOR_EPS).to(torch.int64)
    cap = layer_budget if max_len is None else min(layer_budget, max_len)
    out = distribute_exact(heads, n_heads * cap, p, lower=1, upper=max_len)
    return out.to(pref.device)


def adakv_head_budgets(
    scores: torch.Tensor,
    layer_budget: int,
    window: int,
    floor: float = 0.2,
) -> torch.Tensor:
    """AdaKV head budgets, window included (docs/policies.md, "The policies").

    ``scores`` is ``(B, H, n)``: SnapKV scores of the prefix (window excluded). With ``b = k_l - W``, the
    global top ``H * b`` scores of a batch element give ``c_h`` winners per head; head h gets
    ``round((1 - floor) * c_h + floor(floor * b))`` (half up), clamped to ``[0, n]``, and the total is made
    exactly ``H * b`` with ``distribute_exact`` by ``c_h`` (never taking a head under ``floor(floor * b)``);
    then ``+ W``. If ``k_l <= W`` every head gets ``k_l``; if ``b >= n`` every head keeps its whole prefix,
    so the total is then ``H * (n + W)``. Returns int64 ``(B, H)``.
    """
    check_budget(layer_budget, "layer budget")
    _check_window(window)
    _check_unit(floor, "AdaKV floor")
    if scores.dim() != 3:
        raise ValueError(f"scores must have shape (batch, heads, tokens), got {tuple(scores.shape)}")
    batch, n_heads, n_prefix = scores.shape
    if layer_budget <= window:
        return torch.full((batch, n_heads), layer_budget, dtype=torch.int64, device=scores.device)
    b = layer_budget - window
    per_head = min(b, n_prefix)
    if per_head == 0 or n_heads == 0:
        return torch.full((batch, n_heads), window + per_head, dtype=torch.int64, device=scores.device)

    flat = scores.detach().reshape(batch, n_heads * n_prefix)
    winners = torch.topk(flat, n_heads * per_head, dim=1, sorted=False).indices // n_prefix
    counts = torch.zeros(batch, n_heads, dtype=torch.int64, device=scores.device)
    counts.scatter_add_(1, winners, torch.ones_like(winners))
    counts = counts.cpu()

    base = math.floor(_decimal(floor) * b)
    mixed = (1.0 - floor) * counts.to(torch.float64) + base
    heads = torch.floor(mixed + 0.5).to(torch.int64)
    # a head keeps at least one entry: with no window (a budget of 1) a head the floor and the top-k leave empty
    # would be lifted to one by the policy, over the layer's total
    lower = max(min(base, n_prefix), 1 if window == 0 else 0)
    out = distribute_exact(heads, n_heads * per_head, counts, lower=lower, upper=n_prefix)
    return (out + window).to(scores.device)
