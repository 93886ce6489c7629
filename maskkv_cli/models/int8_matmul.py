"""Products with an int8 weight (``--quantize int8``: torchao's ``Int8Tensor``, one scale per output row) in bf16
on the CPU, run by PyTorch's own weight-only kernel ``aten._weight_int8pack_mm``.

torchao's product for that weight casts the whole int8 matrix to the activation dtype and then runs the dtype's
matrix product: every product writes and reads a bf16 copy of the weight besides reading the int8 one. PyTorch's
kernel reads the int8 weight itself: each 16 inputs of a weight row are widened to fp32 and scaled in registers,
multiplied into 16 fp32 accumulators per (row, output) and summed at the end; the output is rounded to bf16 once.
Measured faster on the denoising steps' few rows (``scripts/bench_int8_kernels.py``, docs/performance.md).

**Rows stay independent.** The kernel splits its work into blocks of 4 rows x 4 outputs and never along the
inputs: every output is the same sequence of operations whatever the number of rows (and of threads), so a row's
numbers do not depend on the rows beside it (the row floor's invariant, ``models/rows.py``; tested bitwise at 1-64
rows against larger products, and through the sampler alone and in a batch).

**Where it runs** (``takes``: a property of the layer, the dtype and the device, never of the number of rows, so a
sequence takes the same kernel alone and in a batch): bf16 activations on the CPU with an input width that is a
multiple of 16, and a weight quantized per output row (``Int8WeightOnlyConfig``, loaded or pre-quantized), not
needing gradients. The kernel's vector code exists for bf16 only (fp32 and fp16 run a scalar loop), reads 16
inputs at a time with aligned loads (another width reads past the row), and takes its scales in the activation
dtype: each row's fp32 scale is rounded to bf16 (a relative change of at most 2^-9, within bf16's own rounding of
the result). Everything else keeps torchao's product.
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor, nn

__all__ = ["int8_linear", "takes"]

WIDTH = 16  # inputs the kernel reads at a time (one AVX-512 register of fp32)
X_ALIGN = 32  # bytes: the kernel loads 16 bf16 activations with an aligned 256-bit load
W_ALIGN = 16  # bytes: and 16 int8 weights with an aligned 128-bit load


def int8_class() -> type | None:
    """torchao's ``Int8Tensor`` when torchao is imported (a weight can only be one then), else None."""
    module = sys.modules.get("torchao.quantization")
    return getattr(module, "Int8Tensor", None) if module is not None else None


def takes(x: Tensor, weight: Tensor) -> bool:
    """Whether ``x @ weight.T`` runs PyTorch's int8 kernel (see the module doc)."""
    cls = type(weight)
    if cls is Tensor or cls is nn.Parameter or cls is not int8_class():
        return False
    n_out, n_in = weight.shape
    qdata = weight.qdata  # type: ignore[attr-defined]
    return (x.dtype == torch.bfloat16 and x.device.type == "cpu" and n_in % WIDTH == 0
            and weight.act_quant_kwargs is None and weight.act_pre_scale is None  # type: ignore[attr-defined]
            and weight.scale.numel() == n_out  # type: ignore[attr-defined]  # one scale per output row
            and qdata.is_contiguous() and qdata.data_ptr() % W_ALIGN == 0
            and not (x.requires_grad and torch.is_grad_enabled()))  # the kernel has no backward


def int8_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)`` for x (..., n_in) in bf16 and an int8 weight that ``takes`` accepts."""
    flat = x.reshape(-1, x.shape[-1])
    if not flat.is_contiguous() or flat.data_ptr() % X_ALIGN:
        flat = flat.clone(memory_format=torch.contiguous_format)  # a fresh allocation is aligned
    scale = weight.scale.reshape(-1).to(x.dtype)  # type: ignore[attr-defined]
    out = torch.ops.aten._weight_int8pack_mm(flat, weight.qdata, scale)  # type: ignore[attr-defined]
    if bias is not None:
        out += bias
    return out.reshape(*x.shape[:-1], out.shape[-1])
