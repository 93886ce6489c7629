"""The row floor (``models/rows.py``): every product of a model runs with more rows than the few-rows kernel takes,
so a row's numbers do not depend on how many rows share its product (at one and at two threads)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from maskkv_cli.models.config import named_config
from maskkv_cli.models.families import build_model
from maskkv_cli.models.rows import PROBE_SHAPES, Linear, at_least_rows, linear, probe_data, small_rows

FAMILIES = ["tiny", "dream-tiny", "llada-moe-tiny", "llada2-tiny"]


def test_few_rows_are_computed_as_inside_a_larger_product(threads) -> None:
    assert 0 <= small_rows() <= 32
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(256, 96, generator=g), torch.randn(64, 96, generator=g)
    whole = torch.nn.functional.linear(x, w)
    for m in range(1, small_rows() + 3):
        assert torch.equal(at_least_rows(lambda t: torch.nn.functional.linear(t, w), x[:m]), whole[:m])
        assert torch.equal(linear(x[:m], w), whole[:m])
        assert torch.equal(linear(x[None, 5 : 5 + m], w)[0], whole[5 : 5 + m])  # any leading shape


@pytest.mark.parametrize("config", FAMILIES)
def test_every_linear_layer_of_every_family_keeps_the_floor(config: str) -> None:
    """A family that built a plain ``nn.Linear`` would give a sequence's last few rows other numbers alone than in
    a batch."""
    with torch.device("meta"):
        model = build_model(named_config(config))
    plain = [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and not isinstance(m, Linear)]
    assert plain == []


@pytest.mark.parametrize("config", ["tiny", "llada-moe-tiny"])
def test_a_few_rows_through_a_whole_layer_equal_those_rows_beside_others(config: str, threads) -> None:
    """A layer's output rows (projections, attention over fixed keys, MLP or experts, head) alone equal the same rows
    computed in one forward with many others; the bare product of one row rounds otherwise where the platform has a
    few-rows kernel (so the floor is what makes it hold)."""
    model = build_model(named_config(config)).init_weights(seed=2, std=0.2).eval()
    d = model.config.d_model
    x = torch.randn(1, 40, d, generator=torch.Generator().manual_seed(1))
    block = model.blocks[0]

    def run(h: torch.Tensor) -> torch.Tensor:
        h = h + block.attn_proj(block.values(h))  # each row through projections that carry weights
        return model.head(h + block.mlp(h))

    with torch.no_grad():
        together = run(x)
        for m in range(1, small_rows() + 3):
            assert torch.equal(run(x[:, 3 : 3 + m]), together[:, 3 : 3 + m]), m
    if small_rows() > 0:  # the probe's own shape: some count of at most small_rows rows rounds otherwise bare
        g = torch.Generator().manual_seed(0)
        w, h = torch.randn(384, 128, generator=g), torch.randn(128, 128, generator=g)
        whole = torch.nn.functional.linear(h, w)
        assert any(not torch.equal(torch.nn.functional.linear(h[:m], w), whole[:m]) for m in range(1, small_rows() + 1))


def test_the_bf16_floor_keeps_rows_on_rounding_midpoints(threads) -> None:
    """bf16 rounds a product's fp32 sum once more, so random data hides a few-rows kernel; on the probe's data
    (outputs on bf16 rounding midpoints) a few rows through ``linear`` equal those rows inside a larger product,
    for every probed shape, and where this platform has bf16 few-rows kernels the bare product shows them."""
    bf16 = torch.bfloat16
    few = small_rows("cpu", bf16)
    assert 0 <= few <= 32
    g = torch.Generator().manual_seed(0)
    bare_differs = False
    for n_in, n_out in PROBE_SHAPES:
        w, x = probe_data(n_in, n_out, bf16, g)
        assert w.dtype == bf16 and x.dtype == bf16
        whole = torch.nn.functional.linear(x, w)
        for m in range(1, few + 3):
            assert torch.equal(linear(x[:m], w), whole[:m]), (n_in, n_out, m)
        bare_differs |= any(not torch.equal(torch.nn.functional.linear(x[:m], w), whole[:m])
                            for m in range(1, few + 1))
    assert bare_differs == (few > 0)


def test_fp32_probe_data_is_plain_random_data() -> None:
    """The fp32 probe draws what it always drew (so fp32's counts, and every fp32 result, stay as they were)."""
    g, h = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    for n_in, n_out in PROBE_SHAPES[:2]:
        w, x = probe_data(n_in, n_out, torch.float32, g)
        assert torch.equal(w, torch.randn(n_out, n_in, generator=h))
        assert torch.equal(x, torch.randn(4 * 32, n_in, generator=h))


@pytest.mark.parametrize("config", FAMILIES)
def test_a_few_rows_queries_keys_and_values_equal_those_rows_beside_others(config: str, threads) -> None:
    """Every family's q/k/v products keep the floor too (LLaDA2 slices its fused projection's weight by hand): a
    block-causal model's current block runs its few rows through them alone at a cached step, the same rows run
    inside the whole window without a cache."""
    model = build_model(named_config(config)).init_weights(seed=2, std=0.2).eval()
    x = torch.randn(1, 40, model.config.d_model, generator=torch.Generator().manual_seed(1))
    rope = model.rope(torch.arange(40))
    block = model.blocks[0]
    with torch.no_grad():
        together = block.qkv(x, rope)
        for m in range(1, small_rows() + 3):
            alone = block.qkv(x[:, 3 : 3 + m], rope.rows(3, 3 + m))
            for a, t in zip(alone, together, strict=True):
                assert torch.equal(a, t[:, :, 3 : 3 + m]), m
