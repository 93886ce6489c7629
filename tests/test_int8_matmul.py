"""int8 weights in bf16 on the CPU run PyTorch's ``aten._weight_int8pack_mm`` (``models/int8_matmul.py``): where it
runs, that a row's numbers never depend on the rows beside it, and that it computes torchao's product."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

pytest.importorskip("torchao")

from maskkv_cli.bench.cases import random_model  # noqa: E402
from maskkv_cli.models import rows  # noqa: E402
from maskkv_cli.models.config import named_config  # noqa: E402
from maskkv_cli.models.int8_matmul import int8_linear, takes  # noqa: E402
from maskkv_cli.models.quantize import quantize_matrix, quantize_model  # noqa: E402

BF16 = torch.bfloat16


def int8_weight(n_out: int, n_in: int, dtype: torch.dtype = BF16, seed: int = 0) -> Tensor:
    w = torch.randn(n_out, n_in, generator=torch.Generator().manual_seed(seed)) * 0.02
    return quantize_matrix(w.to(dtype), "int8")


def test_the_kernel_takes_per_row_int8_weights_in_bf16_on_the_cpu_only() -> None:
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    x = torch.randn(4, 96, dtype=BF16)
    assert takes(x, int8_weight(64, 96))
    assert not takes(x.float(), int8_weight(64, 96, torch.float32))  # fp32: torchao's product
    assert not takes(torch.randn(4, 40, dtype=BF16), int8_weight(64, 40))  # a width the kernel cannot read
    assert not takes(x, torch.randn(64, 96, dtype=BF16))
    assert not takes(x, quantize_matrix(torch.randn(64, 128, dtype=BF16), "int4"))
    dynamic = rows.Linear(96, 64, bias=False).to(BF16)
    quantize_(dynamic, Int8DynamicActivationInt8WeightConfig(set_inductor_config=False))
    assert not takes(x, dynamic.weight)  # activations quantized too: another product
    with torch.enable_grad():
        assert not takes(x.clone().requires_grad_(), int8_weight(64, 96))  # the kernel has no backward


def midpoint_rows(q: Tensor, scale: float, n_rows: int, seed: int) -> Tensor:
    """bf16 rows x (n_rows, n_in) for int8 values q (n_out, n_in) whose last two columns are 64, dequantized with
    ``scale`` (a power of two: every product exact): x's last two entries put the exact value of output
    ``r % n_out`` of row r on a bf16 rounding midpoint (to about 2^-24 of it, as ``rows.probe_data`` does for plain
    weights), so a sum in another order rounds it to the other side about half the time."""
    g = torch.Generator().manual_seed(seed)
    n_out, n_in = q.shape
    x = torch.randn(n_rows, n_in, generator=g).to(BF16)
    w = q.double() * scale
    for r in range(n_rows):
        c = r % n_out
        partial = (x[r, :-2].double() * w[c, :-2]).sum()
        rounded = partial.to(BF16).double()
        half_ulp = torch.finfo(BF16).eps * 2.0 ** (torch.frexp(rounded).exponent.item() - 2)
        target = rounded + (half_ulp if partial >= rounded else -half_ulp)
        rest = (target - partial) / w[c, -1]  # carried by x[r, -2] + x[r, -1], each times w[c, -1]
        x[r, -2] = rest.to(BF16)
        x[r, -1] = (rest - x[r, -2].double()).to(BF16)
    return x


@pytest.mark.parametrize("n_out, n_in", [(64, 1024), (48, 512), (16, 2048), (40, 272)])
def test_a_rows_numbers_do_not_depend_on_the_other_rows(n_out: int, n_in: int, threads: int) -> None:
    """Bitwise, on data whose outputs sit on bf16 rounding midpoints: m = 1..64 rows alone equal the same rows of a
    256-row product, and 8-row slices of it equal themselves alone. The data is sensitive: the same products with
    the inputs permuted (the same exact values, summed in another order) give other bits on many outputs."""
    g = torch.Generator().manual_seed(n_in)
    qdata = torch.randint(-127, 128, (n_out, n_in), generator=g, dtype=torch.int8)
    qdata[:, -2:] = 64
    weight = int8_weight(n_out, n_in)
    weight.qdata.copy_(qdata)
    weight.scale.fill_(2.0**-7)
    x = midpoint_rows(qdata, 2.0**-7, 256, seed=n_out)
    whole = int8_linear(x, weight)
    for m in range(1, 65):
        assert torch.equal(int8_linear(x[:m].clone(), weight), whole[:m]), m
    for start in range(0, 256, 24):
        assert torch.equal(int8_linear(x[start : start + 8].clone(), weight), whole[start : start + 8]), start
    perm = torch.randperm(n_in - 2, generator=g)
    perm = torch.cat([perm, torch.arange(n_in - 2, n_in)])
    permuted = int8_weight(n_out, n_in)
    permuted.qdata.copy_(qdata[:, perm])
    permuted.scale.fill_(2.0**-7)
    other = int8_linear(x[:, perm].contiguous(), permuted)
    on_midpoint = whole[torch.arange(256), torch.arange(256) % n_out]
    moved = on_midpoint != other[torch.arange(256), torch.arange(256) % n_out]
    assert moved.float().mean() > 0.1


def test_it_computes_torchaos_product() -> None:
    """Within one bf16 step of the result (2^-8 relative; the kernel rounds the row scales to bf16 too, a change of
    at most 2^-9 each), against float64 of the same int8 values and scales; torchao's product (the int8 weight cast
    to bf16, the scales applied after) is as close."""
    weight = int8_weight(256, 1024)
    x = torch.randn(40, 1024, generator=torch.Generator().manual_seed(1), dtype=BF16)
    exact = x.double() @ (weight.qdata.double() * weight.scale.double().reshape(-1, 1)).t()
    ours, theirs = int8_linear(x, weight), F.linear(x, weight)
    ours_err = ((ours.double() - exact).norm() / exact.norm()).item()
    theirs_err = ((theirs.double() - exact).norm() / exact.norm()).item()
    assert ours_err < 2.0**-8 and theirs_err < 2.0**-8
    bias = torch.randn(256, dtype=BF16)
    assert torch.equal(int8_linear(x, weight, bias), int8_linear(x, weight) + bias)


def test_an_unaligned_or_strided_input_is_copied_first() -> None:
    """The kernel loads 16 activations with aligned loads: a view starting 16 bytes into its storage (or a strided
    one) is copied first and gives the same numbers as the aligned rows."""
    weight = int8_weight(32, 64)
    storage = torch.randn(8 + 10 * 64, dtype=BF16)
    shifted = storage[8:].view(10, 64)
    assert shifted.data_ptr() % 32 != 0
    assert torch.equal(int8_linear(shifted, weight), int8_linear(shifted.clone(), weight))
    wide = torch.randn(10, 128, dtype=BF16)
    assert torch.equal(int8_linear(wide[:, 64:], weight), int8_linear(wide[:, 64:].contiguous(), weight))
    three_d = torch.randn(2, 5, 64, dtype=BF16)
    assert int8_linear(three_d, weight).shape == (2, 5, 32)


def run_bf16_int8(config: str) -> nn.Module:
    """A bf16 model of ``config`` with int8 weights, run once on random ids (DiffusionGemma: its encoder, then its
    decoder over a canvas)."""
    g = torch.Generator().manual_seed(0)
    if config.startswith("diffusiongemma"):
        from maskkv_cli.models.diffusion_gemma import DiffusionGemma
        from maskkv_cli.models.diffusion_gemma_config import named_config as gemma_config

        model = quantize_model(DiffusionGemma(gemma_config(config)).eval().init_spread_weights(0).to(BF16), "int8")
        with torch.no_grad():
            model.decode(torch.randint(3, 512, (2, 8), generator=g), model.encode(torch.randint(3, 512, (2, 40),
                                                                                                  generator=g)).cache)
        return model
    model = quantize_model(random_model(named_config(config), dtype=BF16), "int8")
    with torch.no_grad():
        model(torch.randint(6, 400, (2, 48), generator=g))
    return model


@pytest.mark.parametrize("config", ["tiny", "llada2-tiny", "llada-moe-tiny", "diffusiongemma-tiny"])
def test_every_int8_product_of_a_bf16_model_runs_the_kernel(config: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Projections, LLaDA2's q/k/v parts, dense MLPs, every expert and the shared expert, DiffusionGemma's layers:
    each product with an int8 weight goes to the kernel (none falls back to torchao's cast)."""
    ran: set[int] = set()
    fallback: list[str] = []
    original = F.linear

    def counted(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        ran.add(id(weight))
        return int8_linear(x, weight, bias)

    def plain(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        if type(weight).__name__ == "Int8Tensor":
            fallback.append(str(weight.shape))
        return original(x, weight, bias)

    monkeypatch.setattr(rows, "int8_linear", counted)
    monkeypatch.setattr(rows.F, "linear", plain)
    model = run_bf16_int8(config)
    int8 = {id(p) for p in model.parameters() if type(p).__name__ == "Int8Tensor"}
    assert fallback == []
    assert ran and ran <= int8 and len(ran) >= 0.9 * len(int8)  # experts no token was routed to are not run
