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


def cuda_layouts(monkeypatch: pytest.MonkeyPatch, fold: bool = True) -> None:
    """Attention as on CUDA, on the CPU: every SDPA output in the transposed layout CUDA's flash and
    memory-efficient kernels return it in ((B, H, R, D) laid out as (B, R, H, D)), and, with ``fold``, grouped heads
    folded into rows as ``attention`` does there."""
    import torch.nn.functional as F

    import maskkv_cli.models.base as base

    sdpa = F.scaled_dot_product_attention

    def strided(*args, **kwargs):  # type: ignore[no-untyped-def]
        return sdpa(*args, **kwargs).transpose(1, 2).contiguous().transpose(1, 2)

    monkeypatch.setattr(F, "scaled_dot_product_attention", strided)
    if fold:
        monkeypatch.setattr(base, "folds_groups", lambda q, k: q.shape[1] != k.shape[1])


def test_folded_heads_take_the_output_layout_of_cudas_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA's flash and memory-efficient kernels return (B, H, R, D) laid out as (B, R, H, D) (a transposed view):
    the folded output is unfolded from any layout, with the same numbers."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, n, t, D, generator=g) for n, t in ((H, R), (HKV, S), (HKV, S)))
    expected = attention(q, k, v, fold=True)
    cuda_layouts(monkeypatch, fold=False)  # (folded by the call's own argument)
    assert torch.equal(attention(q, k, v, fold=True), expected)


@pytest.mark.parametrize("family", ["llada", "dream", "llada2", "llada_moe"])
def test_generation_runs_on_cudas_attention_layouts(family: str, tiny_tokenizer, monkeypatch: pytest.MonkeyPatch
                                                    ) -> None:  # type: ignore[no-untyped-def]
    """A generation under MaskKV with attention as on CUDA (grouped heads folded, every SDPA output in the kernels'
    transposed layout) runs through the prefill, the votes and the steps, and gives the tokens of the CPU's."""
    from maskkv_cli.models.config import named_config
    from maskkv_cli.models.families import build_model
    from maskkv_cli.policies import get_policy
    from maskkv_cli.sampling import GenerationConfig, generate

    name = {"llada": "tiny", "dream": "dream-tiny", "llada2": "llada2-tiny", "llada_moe": "llada-moe-tiny"}[family]
    model = build_model(named_config(name).with_(vocab_size=len(tiny_tokenizer))).init_weights(seed=2, std=0.2)
    model = model.eval()
    prompt = torch.randint(0, len(tiny_tokenizer) - 2, (1, 40), generator=torch.Generator().manual_seed(1))
    gen = GenerationConfig(gen_length=8, steps=8, block_length=8)
    expected = generate(model, prompt, gen, get_policy("maskkv"), 12).tokens
    cuda_layouts(monkeypatch)
    if family in ("dream", "llada2"):  # grouped heads: folded
        assert model.config.n_kv_heads < model.config.n_heads
    assert torch.equal(generate(model, prompt, gen, get_policy("maskkv"), 12).tokens, expected)


def test_diffusion_gemma_runs_on_cudas_attention_layouts(monkeypatch: pytest.MonkeyPatch) -> None:
    """DiffusionGemma (2 KV heads for 4 query heads, sliding and full layers) compressed by MaskKV, two canvases,
    with attention as on CUDA (folded, transposed outputs): the tokens of the CPU's."""
    from maskkv_cli.models.diffusion_gemma import DiffusionGemma
    from maskkv_cli.models.diffusion_gemma_config import FULL, SLIDING, named_config
    from maskkv_cli.policies import get_policy
    from maskkv_cli.sampling.diffusion_gemma_forward import generate_compressed
    from maskkv_cli.sampling.diffusion_gemma_steps import DiffusionGemmaSampling

    cfg = named_config("diffusiongemma-tiny").with_(n_layers=4, layer_types=(SLIDING, FULL) * 2, n_global_kv_heads=2)
    torch.manual_seed(0)
    model = DiffusionGemma(cfg).eval().init_spread_weights(0)
    ids = torch.randint(3, cfg.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    settings = DiffusionGemmaSampling(max_new_tokens=16, t_min=0.0, t_max=1e-6, max_denoising_steps=4)

    def tokens() -> torch.Tensor:
        return generate_compressed(model, ids, get_policy("maskkv"), 12, settings, seed=3).sequences

    expected = tokens()
    cuda_layouts(monkeypatch)
    assert torch.equal(tokens(), expected)
