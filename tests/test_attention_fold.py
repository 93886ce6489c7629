"""``models.base.attention``'s folded grouped heads (its CUDA path, run here on the CPU with ``fold=True``): the same
attention as SDPA's grouped heads, for every mask layout the engine and DiffusionGemma pass."""

from __future__ import annotations

import pytest
import torch

from maskkv_cli.models.base import attention

B, H, HKV, R, S, D = 2, 8, 2, 5, 13, 16


def masks() -> dict[str, torch.Tensor | None]:
    g = torch.Generator().manual_seed(1)
    keep = torch.rand(B, HKV, R, S, generator=g) > 0.3
    keep[..., 0] = True  # no row sees nothing
    bias = torch.zeros(B, H, 1, S).masked_fill(torch.rand(B, H, 1, S, generator=g) > 0.7, float("-inf"))
    bias[..., 0] = 0.0
    return {
        "none": None,
        "rows x keys, every head (2-D)": keep[0, 0],
        "rows x keys, every head (4-D)": keep[:1, :1],
        "per KV head and row": keep,
        "per query head bias, one row": bias,
        "every head, one row": keep[:1, :1, :1],
        "per query head and row": keep.repeat_interleave(H // HKV, dim=1),
    }


@pytest.mark.parametrize("name", list(masks()))
@pytest.mark.parametrize("scale", [None, 1.0])
def test_folded_heads_attend_as_grouped_heads(name: str, scale: float | None) -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, n, t, D, generator=g) for n, t in ((H, R), (HKV, S), (HKV, S)))
    mask = masks()[name]
    grouped = attention(q, k, v, mask, scale=scale, fold=False)
    folded = attention(q, k, v, mask, scale=scale, fold=True)
    assert folded.shape == grouped.shape == (B, H, R, D)
    torch.testing.assert_close(folded, grouped, rtol=1e-5, atol=1e-6)
    # and against the plain definition: each query head h over KV head h // g
    kk, vv = (t.repeat_interleave(H // HKV, dim=1) for t in (k, v))
    full = mask if mask is None or mask.dim() == 2 or mask.shape[1] in (1, H) else mask.repeat_interleave(4, dim=1)
    expected = torch.nn.functional.scaled_dot_product_attention(q, kk, vv, attn_mask=full, scale=scale)
    torch.testing.assert_close(grouped, expected, rtol=1e-5, atol=1e-6)


def test_one_query_head_per_key_head_never_folds() -> None:
    q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 4, 6, 8), torch.randn(1, 4, 6, 8)
    assert torch.equal(attention(q, k, v, fold=True), attention(q, k, v, fold=False))
