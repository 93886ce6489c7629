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
    """Measured 2026-12-04 (2 x 300 random ids): int8 agreement 0.998, relative logit error 0.009; int4 0.968, 0.118."""
    base, quant = load_model(EMBEDDED), load_model(EMBEDDED, quantize=mode)
    ids = torch.randint(6, 2000, (2, 300), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref, out = base(ids), quant(ids)
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= agree
    assert (out - ref).norm() / ref.norm() <= rel
