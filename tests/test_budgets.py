"""Tests for maskkv_cli.budgets: layer and head budgets of MaskKV, PyramidKV and AdaKV."""

from __future__ import annotations

import math
import random

import pytest
import torch

from maskkv_cli.budgets import (
    adakv_head_budgets,
    boundary_layer_budgets,
    distribute_exact,
    preference_head_budgets,
    pyramid_layer_budgets,
    resolve_budget,
    uniform_layer_budgets,
)
from maskkv_cli.errors import UsageError

SEEDS = list(range(12))


# --------------------------------------------------------------------------------------------- resolve_budget


@pytest.mark.parametrize(
    ("budget", "ratio", "prompt_len", "expected"),
    [
        (128, None, 4000, 128),
        (128, None, 10, 128),  # not capped at the prompt
        (None, 0.1, 30, 3),
        (None, 0.07, 100, 7),  # the ratio as written: 0.07 * 100 is 7, not ceil(7.000000000000001) == 8
        (None, 0.55, 100, 55),
        (None, 0.05, 1001, 51),
        (None, 1.0, 77, 77),
        (None, 0.001, 10, 1),  # at least one token
        (None, 0.5, 0, 1),
    ],
)
def test_resolve_budget_values(
    budget: int | None, ratio: float | None, prompt_len: int, expected: int
) -> None:
    assert resolve_budget(budget, ratio, prompt_len) == expected


@pytest.mark.parametrize(
    ("budget", "ratio", "message"),
    [
        (0, None, "--budget must be a positive integer, got 0"),
        (-5, None, "--budget must be a positive integer, got -5"),
        (None, 0.0, "--ratio"),
        (None, -0.1, "--ratio"),
        (None, 1.5, "--ratio"),
        (None, float("nan"), "--ratio"),
        (None, None, "exactly one"),
        (16, 0.5, "exactly one"),
    ],
)
def test_resolve_budget_errors(budget: int | None, ratio: float | None, message: str) -> None:
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace("]", r"\]")):
        resolve_budget(budget, ratio, 100)


def test_uniform_layer_budgets() -> None:
    assert uniform_layer_budgets(4, 64) == [64, 64, 64, 64]
    assert uniform_layer_budgets(0, 64) == []
    with pytest.raises(UsageError):
        uniform_layer_budgets(4, 0)


# ------------------------------------------------------------------------------------------ distribute_exact


def test_distribute_exact_adds_by_priority_round_robin() -> None:
    values = torch.tensor([1, 1, 1])
    priority = torch.tensor([0.2, 0.9, 0.5])
    # 7 extra units over 3 slots: two full rounds, then the highest priority slot gets the 7th.
    assert distribute_exact(values, 10, priority).tolist() == [3, 4, 3]
    # One extra unit goes to the highest priority.
    assert distribute_exact(values, 4, priority).tolist() == [1, 2, 1]


def test_distribute_exact_respects_upper_and_ties() -> None:
    values = torch.tensor([5, 1, 1, 1])
    priority = torch.tensor([1.0, 0.5, 0.5, 0.1])
    # Slot 0 is full; ties between slots 1 and 2 go to the lower index first.
    assert distribute_exact(values, 10, priority, upper=5).tolist() == [5, 2, 2, 1]
    assert distribute_exact(values, 9, priority, upper=5).tolist() == [5, 2, 1, 1]


def test_distribute_exact_removes_from_lowest_priority_above_lower() -> None:
    values = torch.tensor([6, 1, 6, 6])
    priority = torch.tensor([0.9, 0.0, 0.1, 0.5])
    # Slot 1 is at the lower bound; surplus 4 comes round-robin from slots 2, 3, 0, then 2 again.
    assert distribute_exact(values, 15, priority).tolist() == [5, 1, 4, 5]


def test_distribute_exact_clamps_first_and_rejects_impossible() -> None:
    values = torch.tensor([[0, 9, -3]])
    priority = torch.tensor([[1.0, 2.0, 3.0]])
    out = distribute_exact(values, 9, priority, lower=1, upper=5)
    assert out.dtype == torch.int64
    assert out.sum().item() == 9
    assert int(out.min()) >= 1 and int(out.max()) <= 5
    with pytest.raises(ValueError):
        distribute_exact(values, 16, priority, lower=1, upper=5)
    with pytest.raises(ValueError):
        distribute_exact(values, 2, priority, lower=1)


@pytest.mark.parametrize("seed", SEEDS)
def test_distribute_exact_random(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    width = int(torch.randint(1, 20, (1,), generator=gen))
    upper = int(torch.randint(1, 50, (1,), generator=gen))
    values = torch.randint(-5, 60, (3, width), generator=gen)
    priority = torch.rand(3, width, generator=gen)
    target = int(torch.randint(width, width * upper + 1, (1,), generator=gen))
    out = distribute_exact(values, target, priority, lower=1, upper=upper)
    assert out.sum(dim=1).tolist() == [target] * 3
    assert int(out.min()) >= 1 and int(out.max()) <= upper


# ------------------------------------------------------------------------------------ boundary_layer_budgets


def test_boundary_worked_example() -> None:
    # k_p = 50, k_base = 4, k_imp = 30; boundary gets 30 * 1.1 / 1.4 = 23.57 -> 11 each,
    # middle 6.43 -> 2 each; 2 leftovers go to the most important layers (4, then 0).
    assert boundary_layer_budgets([0.5, 0.1, 0.1, 0.1, 0.6], 10) == [16, 6, 6, 6, 16]


@pytest.mark.parametrize("seed", SEEDS)
def test_boundary_exact_total_and_positive(seed: int) -> None:
    rng = random.Random(seed)
    n_layers = rng.randint(1, 40)
    budget = rng.choice([1, 2, 3, 16, 64, 128, 257])
    beta = rng.choice([0.0, 0.1, 0.4, 0.75, 1.0])
    importance = [rng.random() ** 3 for _ in range(n_layers)]
    out = boundary_layer_budgets(importance, budget, beta=beta)
    assert len(out) == n_layers
    assert sum(out) == n_layers * budget
    assert min(out) >= 1
    assert min(out) >= min(budget, math.floor(beta * budget))  # the base share is never taken away


def test_boundary_layers_get_more_when_more_important() -> None:
    importance = [0.8, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.9]
    out = boundary_layer_budgets(importance, 64)
    assert out[0] > out[1] and out[-1] > out[1]
    assert sum(out) == 8 * 64
    # And less when the middle matters more.
    low = boundary_layer_budgets([0.01, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.01], 64)
    assert low[0] < low[1] and low[-1] < low[1]


def test_boundary_beta_one_is_uniform() -> None:
    assert boundary_layer_budgets([0.9, 0.1, 0.3, 0.0, 0.7], 32, beta=1.0) == [32] * 5


def test_boundary_beta_zero_is_all_importance() -> None:
    out = boundary_layer_budgets([1.0, 0.0, 0.0, 1.0], 10, beta=0.0)
    assert out == [19, 1, 1, 19]  # middle layers have no importance but keep 1


def test_boundary_zero_importance_splits_by_group_size() -> None:
    out = boundary_layer_budgets([0.0] * 6, 10)
    assert out == [10] * 6


def test_boundary_negative_importance_counts_as_zero() -> None:
    clipped = boundary_layer_budgets([0.0, 0.0, 0.0, 1.0], 10)
    assert boundary_layer_budgets([-3.0, 0.0, 0.0, 1.0], 10) == clipped


SKEWED = [5.0, 0.1, 0.1, 0.1, 0.1, 5.0]  # boundary layers want far more than a short prompt holds


def test_boundary_budgets_above_the_prompt_move_to_layers_with_room() -> None:
    m = 541
    assert boundary_layer_budgets(SKEWED, 540)[0] > m  # uncapped, the boundary layers ask for more than M
    previous: list[int] | None = None
    for budget in range(300, m + 3):
        out = boundary_layer_budgets(SKEWED, budget, max_budget=m)
        assert sum(out) == len(SKEWED) * min(budget, m)
        assert 1 <= min(out) and max(out) <= m
        if previous is not None:  # grows smoothly: no layer ever loses entries when B grows
            assert all(a >= b for a, b in zip(out, previous, strict=True)) and sum(out) - sum(previous) <= 6
        previous = out
    assert boundary_layer_budgets(SKEWED, 540, max_budget=m) == [541, 540, 540, 539, 539, 541]


def test_boundary_cap_changes_nothing_when_every_layer_fits() -> None:
    for budget in (8, 16, 64):
        assert boundary_layer_budgets(SKEWED, budget, max_budget=10_000) == boundary_layer_budgets(SKEWED, budget)


def test_maskkv_policy_keeps_d_times_b_with_a_skewed_profile_on_a_short_prompt() -> None:
    from maskkv_cli.policies import PolicyOptions, get_policy

    policy = get_policy("maskkv", PolicyOptions(importance=tuple(SKEWED)))
    out = policy.layer_budgets(6, 540, 541)
    assert sum(out) == 6 * 540 and max(out) <= 541


def test_boundary_custom_and_negative_indexes() -> None:
    importance = [0.1, 0.9, 0.1, 0.1, 0.9, 0.1]
    assert boundary_layer_budgets(importance, 20, boundary=[1, -2]) == boundary_layer_budgets(
        importance, 20, boundary=[4, 1]
    )
    out = boundary_layer_budgets(importance, 20, boundary=[1, -2])
    assert out[1] == out[4] > out[0]
    assert sum(out) == 120


@pytest.mark.parametrize("n_layers", [1, 2])
def test_boundary_all_layers_boundary(n_layers: int) -> None:
    out = boundary_layer_budgets([0.3] * n_layers, 16)
    assert out == [16] * n_layers


def test_boundary_single_group_is_uniform() -> None:
    # With one group, k_imp = D * (B - k_base) splits evenly: importance cannot matter.
    assert boundary_layer_budgets([0.1, 0.5, 0.9], 5, boundary=[0, 1, 2]) == [5, 5, 5]
    assert boundary_layer_budgets([0.1, 0.5, 0.5, 0.2], 3, beta=0.4, boundary=[]) == [3, 3, 3, 3]


def test_boundary_leftovers_go_to_important_layers_first() -> None:
    # D = 4, B = 3, beta = 0: k_imp = 12. Boundary 12 * 2/6 = 4 -> 2 each; middle 8 -> 4 each: no leftovers.
    out = boundary_layer_budgets([1.0, 1.0, 3.0, 1.0], 3, beta=0.0)
    assert out == [2, 4, 4, 2]
    out = boundary_layer_budgets([1.0, 1.0, 2.0, 1.0], 3, beta=0.0)
    # boundary 12 * 2/5 = 4.8 -> 2 each; middle 7.2 -> 3 each; 2 leftovers: layer 2 (2.0), then layer 0.
    assert out == [3, 3, 4, 2]


@pytest.mark.parametrize(
    ("importance", "kwargs", "error"),
    [
        ([], {}, ValueError),
        ([0.1, float("nan")], {}, ValueError),
        ([0.1, float("inf")], {}, ValueError),
        ([0.1, 0.2, 0.3], {"beta": 1.5}, UsageError),
        ([0.1, 0.2, 0.3], {"beta": -0.1}, UsageError),
        ([0.1, 0.2, 0.3], {"boundary": [0, 3]}, UsageError),
        ([0.1, 0.2, 0.3], {"boundary": [0, -4]}, UsageError),
        ([0.1, 0.2, 0.3], {"boundary": [2, -1]}, UsageError),
        ([0.1, 0.2, 0.3], {"budget": 0}, UsageError),
    ],
)
def test_boundary_validation(
    importance: list[float], kwargs: dict[str, object], error: type[Exception]
) -> None:
    args: dict[str, object] = {"budget": 8, **kwargs}
    with pytest.raises(error):
        boundary_layer_budgets(importance, **args)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------- pyramid_layer_budgets


@pytest.mark.parametrize("seed", SEEDS)
def test_pyramid_exact_and_non_increasing(seed: int) -> None:
    rng = random.Random(seed)
    n_layers = rng.randint(2, 40)
    window = rng.choice([0, 1, 8, 32])
    budget = window + rng.randint(1, 600)
    prompt_len = rng.randint(budget + 1, 20 * budget)
    out = pyramid_layer_budgets(n_layers, budget, window, prompt_len)
    assert sum(out) == n_layers * budget
    assert all(a >= b for a, b in zip(out, out[1:], strict=False))
    assert min(out) >= max(window, 1)
    assert max(out) <= prompt_len


def test_pyramid_shape_matches_formula() -> None:
    # b = 96, min = 4.8, max = 187.2, step over 31 layers; the ends are close to max + W and min + W.
    out = pyramid_layer_budgets(32, 128, 32, 100_000)
    assert out[0] in (219, 220) and out[-1] in (36, 37)
    assert out[0] > out[-1] + 150
    assert sum(out) == 32 * 128


def test_pyramid_cap_at_prompt_minus_window() -> None:
    # b = 96: max would be 187.2 but n - W = 168, so max = 168 and min = 24.
    out = pyramid_layer_budgets(8, 128, 32, 200)
    assert out[0] == 200  # 168 + W: capped at the prompt length
    assert out[-1] == 24 + 32
    assert sum(out) == 8 * 128
    uncapped = pyramid_layer_budgets(8, 128, 32, 10_000)
    assert uncapped[0] > 200


@pytest.mark.parametrize(
    ("n_layers", "budget", "window", "prompt_len"),
    [(1, 64, 32, 1000), (6, 32, 32, 1000), (6, 16, 32, 1000), (6, 64, 8, 64), (6, 64, 8, 10)],
)
def test_pyramid_uniform_fallbacks(n_layers: int, budget: int, window: int, prompt_len: int) -> None:
    assert pyramid_layer_budgets(n_layers, budget, window, prompt_len) == [budget] * n_layers


@pytest.mark.parametrize(("n_layers", "budget"), [(32, 1), (32, 2), (40, 3), (7, 1)])
def test_pyramid_without_window_keeps_one_per_layer(n_layers: int, budget: int) -> None:
    out = pyramid_layer_budgets(n_layers, budget, 0, 1000)
    assert sum(out) == n_layers * budget
    assert min(out) >= 1
    assert all(a >= b for a, b in zip(out, out[1:], strict=False))
    if budget == 1:
        assert out == [1] * n_layers


def test_pyramid_remainder_ties_go_to_lower_layers() -> None:
    # b = 10, max = min(19.5, 13) = 13, min = 7, step = 1.5: targets 13, 11.5, 10, 8.5, 7 (floors sum 49);
    # the one leftover goes to layer 1 rather than layer 3.
    assert pyramid_layer_budgets(5, 10, 0, 13) == [13, 12, 10, 8, 7]


def test_pyramid_beta_changes_slope() -> None:
    steep = pyramid_layer_budgets(10, 100, 10, 10_000, beta=20.0)
    flat = pyramid_layer_budgets(10, 100, 10, 10_000, beta=1.0)
    assert flat == [100] * 10
    assert steep[0] - steep[-1] > 100


def test_pyramid_validation() -> None:
    with pytest.raises(UsageError):
        pyramid_layer_budgets(4, 64, -1, 1000)
    with pytest.raises(UsageError):
        pyramid_layer_budgets(4, 64, 8, 1000, beta=0.5)
    with pytest.raises(UsageError):
        pyramid_layer_budgets(4, 0, 8, 1000)
    with pytest.raises(ValueError):
        pyramid_layer_budgets(0, 64, 8, 1000)


# ----------------------------------------------------------------------------------- preference_head_budgets


def test_preference_worked_example() -> None:
    pref = torch.tensor([[0.9, 0.1, 0.5, 0.5]])
    # Phat = .45 .05 .25 .25; 1 + 36 * Phat = 17.2 2.8 10 10 -> 17 2 10 10; one leftover to head 0.
    out = preference_head_budgets(10, pref)
    assert out.dtype == torch.int64
    assert out.tolist() == [[18, 2, 10, 10]]


@pytest.mark.parametrize("seed", SEEDS)
def test_preference_exact_total_and_order(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    batch = 1 + seed % 2
    n_heads = int(torch.randint(1, 33, (1,), generator=gen))
    layer_budget = int(torch.randint(1, 300, (1,), generator=gen))
    alpha = [0.0, 0.1, 0.5, 0.9][seed % 4]
    pref = torch.rand(batch, n_heads, generator=gen) ** 2
    out = preference_head_budgets(layer_budget, pref, alpha=alpha)
    assert out.shape == (batch, n_heads)
    assert out.sum(dim=1).tolist() == [n_heads * layer_budget] * batch
    assert int(out.min()) >= 1
    for row in range(batch):
        order = torch.argsort(pref[row], descending=True)
        ranked = out[row, order]
        assert bool((ranked[:-1] >= ranked[1:]).all()), (pref[row], out[row])


@pytest.mark.parametrize("seed", SEEDS)
def test_preference_max_len_clamp(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    n_heads = int(torch.randint(2, 17, (1,), generator=gen))
    layer_budget = int(torch.randint(2, 200, (1,), generator=gen))
    max_len = int(torch.randint(1, 2 * layer_budget, (1,), generator=gen))
    pref = torch.rand(2, n_heads, generator=gen)
    pref[:, 0] = 5.0  # one head wants nearly everything
    out = preference_head_budgets(layer_budget, pref, alpha=0.1, max_len=max_len)
    assert int(out.max()) <= max_len and int(out.min()) >= 1
    assert out.sum(dim=1).tolist() == [n_heads * min(layer_budget, max_len)] * 2


def test_preference_whole_prompt_kept_when_short() -> None:
    pref = torch.tensor([[0.9, 0.1, 0.3]])
    assert preference_head_budgets(64, pref, max_len=20).tolist() == [[20, 20, 20]]


def test_preference_alpha_one_and_zero_pref_are_uniform() -> None:
    pref = torch.tensor([[0.9, 0.1, 0.3, 0.7], [0.0, 0.0, 0.0, 0.0]])
    assert preference_head_budgets(37, pref, alpha=1.0).tolist() == [[37] * 4, [37] * 4]
    assert preference_head_budgets(37, pref, alpha=0.1)[1].tolist() == [37] * 4


def test_preference_heads_get_at_least_one() -> None:
    pref = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    out = preference_head_budgets(4, pref, alpha=0.0)
    assert out.tolist() == [[13, 1, 1, 1]]


def test_preference_leftovers_round_robin_under_cap() -> None:
    pref = torch.tensor([[0.9, 0.1, 0.5, 0.5]])
    # Raw 17 2 10 10 clamped to 12 -> 12 2 10 10 (34); 6 more: head 0 is full, heads 2, 3 reach 12, then 1.
    assert preference_head_budgets(10, pref, max_len=12).tolist() == [[12, 4, 12, 12]]


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"alpha": 1.5}, UsageError),
        ({"alpha": -0.5}, UsageError),
        ({"layer_budget": 0}, UsageError),
        ({"max_len": 0}, ValueError),
        ({"pref": torch.tensor([0.5, 0.5])}, ValueError),
        ({"pref": torch.tensor([[0.5, float("nan")]])}, ValueError),
    ],
)
def test_preference_validation(kwargs: dict[str, object], error: type[Exception]) -> None:
    args: dict[str, object] = {"layer_budget": 8, "pref": torch.tensor([[0.5, 0.5]]), **kwargs}
    with pytest.raises(error):
        preference_head_budgets(**args)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------- adakv_head_budgets


def test_adakv_worked_example() -> None:
    scores = torch.rand(1, 4, 100, generator=torch.Generator().manual_seed(0))
    scores[:, 0] += 1.0  # head 0 wins all 40 slots
    # b = 10, c = 40 0 0 0, floor(0.2 * 10) = 2: 0.8 * c + 2 = 34 2 2 2 (sum 40), + W.
    assert adakv_head_budgets(scores, 42, 32).tolist() == [[66, 34, 34, 34]]


@pytest.mark.parametrize("seed", SEEDS)
def test_adakv_exact_total_and_floor(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    batch = 1 + seed % 2
    n_heads = int(torch.randint(1, 17, (1,), generator=gen))
    window = [0, 4, 32][seed % 3]
    n_prefix = int(torch.randint(1, 400, (1,), generator=gen))
    b = int(torch.randint(1, n_prefix + 1, (1,), generator=gen))
    skew = 1 + 3 * torch.rand(n_heads, 1, generator=gen)  # heads with different score spreads
    scores = torch.rand(batch, n_heads, n_prefix, generator=gen) ** skew
    out = adakv_head_budgets(scores, b + window, window)
    assert out.dtype == torch.int64 and out.shape == (batch, n_heads)
    assert out.sum(dim=1).tolist() == [n_heads * (b + window)] * batch
    assert int(out.min()) >= math.floor(0.2 * b) + window
    assert int(out.max()) <= n_prefix + window


def _scores_with_winners(counts: list[int], n_prefix: int, seed: int = 0) -> torch.Tensor:
    """Scores (1, H, n) whose global top sum(counts) has exactly counts[h] entries in head h."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(1, len(counts), n_prefix, generator=gen)
    for head, count in enumerate(counts):
        scores[0, head, :count] += 10.0
    return scores


@pytest.mark.parametrize(
    ("counts", "expected_prefix"),
    [
        # b = 10, floor(0.2 * 10) = 2: 0.8 * c + 2 = 26, 6.8, 5.2, 2 -> 26 7 5 2 (sum 40).
        ([30, 6, 4, 0], [26, 7, 5, 2]),
        # 3.6 3.6 30.8 2 -> 4 4 31 2 (sum 41): the surplus comes from the lowest c above the floor (head 1).
        ([2, 2, 36, 0], [4, 3, 31, 2]),
    ],
)
def test_adakv_formula_and_surplus(counts: list[int], expected_prefix: list[int]) -> None:
    scores = _scores_with_winners(counts, 50)
    out = adakv_head_budgets(scores, 10 + 32, 32)
    assert out.tolist() == [[p + 32 for p in expected_prefix]]


def test_adakv_follows_winner_counts() -> None:
    gen = torch.Generator().manual_seed(3)
    scores = torch.rand(2, 6, 300, generator=gen)
    scores = scores * torch.tensor([3.0, 1.0, 2.0, 0.5, 1.5, 0.1]).view(1, 6, 1)
    out = adakv_head_budgets(scores, 64 + 8, 8)
    for row in range(2):
        ranked = out[row, torch.tensor([0, 2, 4, 1, 3, 5])]
        assert bool((ranked[:-1] >= ranked[1:]).all()), out[row]
    assert out[0, 0] > out[0, 5]


def test_adakv_floor_one_is_uniform() -> None:
    scores = torch.rand(1, 4, 100, generator=torch.Generator().manual_seed(1))
    scores[:, 0] += 1.0
    assert adakv_head_budgets(scores, 42, 32, floor=1.0).tolist() == [[42] * 4]


def test_adakv_budget_within_window_and_whole_prefix() -> None:
    scores = torch.rand(2, 3, 50)
    assert adakv_head_budgets(scores, 20, 32).tolist() == [[20] * 3] * 2
    assert adakv_head_budgets(scores, 32, 32).tolist() == [[32] * 3] * 2
    # b = 68 > n = 50: every head keeps its whole prefix plus the window.
    assert adakv_head_budgets(scores, 100, 32).tolist() == [[82] * 3] * 2
    assert adakv_head_budgets(torch.rand(1, 3, 0), 40, 32).tolist() == [[32] * 3]


def test_adakv_validation() -> None:
    scores = torch.rand(1, 2, 10)
    with pytest.raises(ValueError):
        adakv_head_budgets(torch.rand(2, 10), 8, 2)
    with pytest.raises(UsageError):
        adakv_head_budgets(scores, 8, -1)
    with pytest.raises(UsageError):
        adakv_head_budgets(scores, 8, 2, floor=1.2)
    with pytest.raises(UsageError):
        adakv_head_budgets(scores, 0, 2)
