"""Weight-only int8 / int4 quantization (models/quantize.py): which layers, bytes, error, loading."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

pytest.importorskip("torchao")

from maskkv_cli.bench.cases import random_model  # noqa: E402
from maskkv_cli.models.config import named_config  # noqa: E402
from maskkv_cli.models.loading import load_model  # noqa: E402
from maskkv_cli.models.quantize import quantize_model, quantized_layers, tensor_bytes  # noqa: E402
from maskkv_cli.models.rows import Linear  # noqa: E402

EMBEDDED = "maskkv_cli/assets/tiny-llada"


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("config", ["tiny", "llada2-tiny", "llada-moe-tiny"])
def test_every_linear_in_the_blocks_is_quantized_and_the_head_is_not(config: str, mode: str) -> None:
    model = quantize_model(random_model(named_config(config)), mode)
    done, kept = quantized_layers(model)
    assert done and kept in (["transformer.ff_out"], ["lm_head"])
    with torch.no_grad():
        assert torch.isfinite(model(torch.randint(6, 400, (1, 40)))).all()


def test_int4_bytes_of_an_moe_shape_are_under_three_tenths_of_bf16() -> None:
    tiny = named_config("llada2-tiny")
    cfg = tiny.with_(d_model=256, moe=dataclasses.replace(tiny.moe, expert_hidden=128, shared_hidden=128))
    base = random_model(cfg, dtype=torch.bfloat16)
    before = sum(tensor_bytes(m.weight) for m in base.blocks.modules() if isinstance(m, Linear))
    quant = quantize_model(copy.deepcopy(base), "int4")
    after = sum(tensor_bytes(m.weight) for m in quant.blocks.modules() if isinstance(m, Linear))
    assert not quantized_layers(quant)[1] == [] and after <= 0.3 * before


@pytest.mark.parametrize("mode, agree, rel", [("int8", 0.99, 0.02), ("int4", 0.95, 0.2)])
def test_quantized_while_loading_matches_the_embedded_model(mode: str, agree: float, rel: float) -> None:
    """Measured (2 x 300 random ids, against the fp32 model): int8 (fp32) agreement 0.998, relative logit error
    0.009; int4 loads in bf16 on the CPU (``loading.parse_dtype``): 0.960, 0.106 (in fp32: 0.968, 0.118)."""
    base, quant = load_model(EMBEDDED), load_model(EMBEDDED, quantize=mode)
    ids = torch.randint(6, 2000, (2, 300), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref, out = base(ids), quant(ids)
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= agree
    assert (out - ref).norm() / ref.norm() <= rel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("config", ["tiny", "llada2-tiny"])
def test_quantized_sequences_get_the_same_floats_alone_and_in_a_batch(config: str, mode: str,
                                                                      dtype: torch.dtype) -> None:
    """The row floor still holds with quantized products: tokens and probabilities alone equal those in a batch
    (int8 in bf16 runs PyTorch's int8 kernel, ``models/int8_matmul.py``)."""
    from maskkv_cli.engine.plan import CacheConfig, plan_cache
    from maskkv_cli.sampling import GenerationConfig, sample
    from maskkv_cli.sampling.stream import BatchJob, sample_many

    model = quantize_model(random_model(named_config(config), dtype=dtype), mode)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(6, 400, (1, n), generator=g) for n in (40, 57, 33, 48)]
    gen = GenerationConfig(gen_length=16, steps=16, block_length=8)
    kinds = [CacheConfig("maskkv", 16), CacheConfig("full"), CacheConfig("none")]
    jobs = [BatchJob(p, gen, plan_cache(model, kinds[i % len(kinds)], p.shape[1], block_length=gen.block_length))
            for i, p in enumerate(prompts)]
    for job, together in zip(jobs, sample_many(model, jobs, 4), strict=True):
        alone = sample(model, job.prompt, gen, job.plan)
        assert together.tokens.tolist() == alone.tokens.tolist()
        assert torch.equal(together.token_probs.nan_to_num(-1.0), alone.token_probs.nan_to_num(-1.0))


def test_auto_dtype_is_bf16_for_int4_on_the_cpu() -> None:
    """PyTorch's CPU int4 kernel takes fp32 activations on a slow path; ``auto`` picks bf16 for int4 weights."""
    from maskkv_cli.batch.run import resolve_dtype
    from maskkv_cli.models.loading import parse_dtype

    assert parse_dtype(None, "cpu", "int4") == parse_dtype("auto", "cpu", "int4") == torch.bfloat16
    assert parse_dtype(None, "cpu", "int8") == parse_dtype(None, "cpu") == torch.float32
    assert parse_dtype("fp32", "cpu", "int4") == torch.float32  # asked for: as asked
    assert load_model(EMBEDDED, quantize="int4").dtype == torch.bfloat16
    assert resolve_dtype("auto", "cpu", "int4") == "bf16" and resolve_dtype("auto", "cpu") == "fp32"
