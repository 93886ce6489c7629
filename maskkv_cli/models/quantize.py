"""Weight-only int8 / int4 quantization of a model's linear layers and experts, with torchao (the ``quant`` extra).

What is quantized: every ``models.rows.Linear`` inside the model's blocks (attention projections, dense MLPs, each
expert of a mixture and the shared expert: the experts of ``models/moe.py`` are one ``SwiGLU`` of three 2-D
``Linear`` each, so every expert is quantized as its own three matrices). What stays in the model's dtype: the
token embedding, the norms, the routers (``moe.Router`` is not a ``Linear``: its scores choose the experts) and the
LM head, all outside the blocks or not linear layers.

The formats (torchao's tensor subclasses; each product still goes through ``rows.linear``, so the row floor holds):

- ``int8``: ``Int8WeightOnlyConfig`` (per output row, symmetric): ``Int8Tensor``; its product casts the int8 weight
  to the activation dtype and runs the dtype's own matrix product, so it rounds by rows as the unquantized one (bf16
  activations on the CPU go to PyTorch's own int8 kernel instead, ``models/int8_matmul.py``).
- ``int4`` on the CPU: ``PrototypeInt4WeightOnlyConfig`` (groups of the first of ``INT4_GROUPS`` input columns that
  divides a layer's input width, asymmetric,
  tinygemm's parameters): ``Int4OpaqueTensor``, whose product is PyTorch's own CPU kernel
  ``aten._weight_int4pack_mm_for_cpu``. torchao's non-prototype ``Int4WeightOnlyConfig`` packs only for CUDA kernels
  (its formats plain, preshuffled, plain_int32 and tile_packed_to_4d all need mslk / tinygemm on a GPU), and
  ``IntxWeightOnlyConfig`` keeps int4 in one byte per value (``unpacked_to_int8``) or needs torchao's C++ CPU
  kernels; so the CPU's packed int4 weight-only path is the prototype config. A layer whose input width no group
  size divides, or whose output width is no multiple of 16, stays unquantized (and is named by
  ``quantized_layers``).
- ``int4`` on CUDA: ``Int4WeightOnlyConfig`` with the ``tile_packed_to_4d`` format (``Int4TilePackedTo4dTensor``,
  PyTorch's own tinygemm kernel ``aten._weight_int4pack_mm``): bf16 only, compute capability 8.0 or newer
  (``check_supported`` says so before loading). Not run on a GPU by this project's tests.

A layer the family reads in parts (``Linear.splits``: LLaDA2's fused q/k/v projection) is stored as one quantized
``Linear`` per part (``SplitLinear``): a packed int4 weight cannot be sliced by rows.

``quantize_model`` quantizes a model in memory; ``loading_quantizer`` quantizes each layer as ``load_model`` fills
it, so the full-precision model is never resident (``models/loading.py``).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import weakref
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import torch
from torch import Tensor, nn

from maskkv_cli.defaults import QUANTIZE_CHOICES, check_quantize
from maskkv_cli.errors import MaskKVError
from maskkv_cli.models.rows import Linear

__all__ = ["MODES", "QuantizeError", "SplitLinear", "check_mode", "check_supported", "loading_quantizer",
           "mark_prequantized", "quantization_of", "quantize_model", "quantized_layers", "tensor_bytes",
           "unquantized_targets", "weights_bytes"]

MODES = tuple(m for m in QUANTIZE_CHOICES if m != "none")  # ("int8", "int4")
INSTALL = "pip install -e '.[quant]'"
INT4_ROWS = 16  # the int4 kernels pack output rows by sixteens ("expect N to be dividable by 16" otherwise)
INT4_GROUPS = (128, 64, 32)  # the group sizes the CPU int4 kernel takes, largest (fewest scale bytes) first


class QuantizeError(MaskKVError):
    """Quantization that cannot run here (torchao missing, a mode that does not exist)."""


def check_mode(mode: str | None) -> str | None:
    """``mode`` as given when it is a quantization maskkv knows (None and "none": no quantization)."""
    if mode in (None, "none"):
        return None
    return check_quantize(mode)


def check_supported(mode: str | None, device: torch.device | str, dtype: torch.dtype) -> None:
    """A one-line error when torchao cannot run ``mode`` on ``device`` in ``dtype`` (before any weight is read):
    int8 runs on the CPU and CUDA in fp32, bf16 and fp16; int4 on the CPU in those three (PyTorch's int4pack kernel)
    and on CUDA in bf16 only, on a GPU of compute capability 8.0 or newer (PyTorch's tinygemm kernel)."""
    mode = check_mode(mode)
    if mode is None:
        return
    device = torch.device(device)
    name = str(dtype).removeprefix("torch.")
    if device.type not in ("cpu", "cuda"):
        raise QuantizeError(f"--quantize {mode} runs on the CPU and on CUDA, not on {device.type}; use --device cpu or "
                            "cuda, or leave --quantize out")
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise QuantizeError(f"--quantize {mode} takes fp32, bf16 or fp16 weights, not {name}")
    if mode == "int4" and device.type == "cuda":
        if dtype != torch.bfloat16:
            raise QuantizeError(f"--quantize int4 on CUDA runs PyTorch's tinygemm kernel, which takes bf16 only, not "
                                f"{name}: use --dtype bf16 (the GPU default), or --quantize int8")
        if torch.cuda.get_device_capability(device)[0] < 8:
            raise QuantizeError("--quantize int4 on CUDA needs a GPU of compute capability 8.0 or newer (tinygemm); "
                                "use --quantize int8 on this one")


@contextlib.contextmanager
def _quiet_loggers(*names: str) -> Iterator[None]:
    """torchao's import logs a warning for each optional kernel library it cannot load (CUDA-only ones on a CPU
    build); a user asking for int8 on a CPU needs none of them."""
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def torchao_modules() -> tuple[ModuleType, ModuleType]:
    """(``torchao.quantization``, ``torchao.prototype.quantization.int4``), imported once; a one-line error naming
    the extra when torchao is not installed."""
    try:
        with _quiet_loggers("torchao", "torch.utils._pytree"):
            quantization = importlib.import_module("torchao.quantization")
            int4 = importlib.import_module("torchao.prototype.quantization.int4")
    except ImportError as exc:
        raise QuantizeError(f"quantized weights need torchao ({exc}); install it with `{INSTALL}`") from None
    return quantization, int4


def int4_group(in_features: int, out_features: int | None = None) -> int | None:
    """The int4 group size for a layer of ``in_features`` inputs and ``out_features`` outputs (None: the layer stays
    unquantized: no group size divides its input width, or its output width is no multiple of ``INT4_ROWS``)."""
    if out_features is not None and out_features % INT4_ROWS:
        return None
    return next((g for g in INT4_GROUPS if in_features % g == 0), None)


def quantize_weight_of(layer: nn.Linear, mode: str) -> bool:
    """Replace ``layer.weight`` by its ``mode`` form in place (torchao's ``quantize_`` on this one layer); False
    when the layer stays as it is (int4 and a width its kernels cannot pack: ``int4_group``)."""
    quantization, int4 = torchao_modules()
    config: Any
    if mode == "int8":
        config = quantization.Int8WeightOnlyConfig(set_inductor_config=False)
    else:
        group = int4_group(layer.in_features, layer.out_features)
        if group is None:
            return False
        if layer.weight.device.type == "cuda":  # tinygemm's layout, PyTorch's ``_weight_int4pack_mm`` (bf16)
            config = quantization.Int4WeightOnlyConfig(group_size=group, int4_packing_format="tile_packed_to_4d",
                                                       set_inductor_config=False)
        else:
            config = int4.PrototypeInt4WeightOnlyConfig(group_size=group, set_inductor_config=False)
    with torch.no_grad():
        quantization.quantize_(layer, config, filter_fn=lambda m, _: m is layer)
    return is_quantized(layer.weight)


class SplitLinear(nn.Module):
    """A ``Linear`` stored as parts of its output rows (``Linear.splits``), each its own (quantized) ``Linear``:
    ``forward`` is the whole layer, ``output_rows`` one part (or a run of whole parts)."""

    def __init__(self, parts: list[Linear], bounds: list[int]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.bounds = bounds  # [0, split_1, ..., out_features]
        self.in_features, self.out_features = parts[0].in_features, bounds[-1]

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)

    def output_rows(self, x: Tensor, start: int, stop: int) -> Tensor:
        if start not in self.bounds or stop not in self.bounds:
            raise ValueError(f"rows {start}..{stop} do not fall on this layer's parts {self.bounds}")
        first, last = self.bounds.index(start), self.bounds.index(stop)
        outs = [self.parts[i](x) for i in range(first, last)]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    @property
    def weight(self) -> Tensor:
        return self.parts[0].weight  # its dtype and device (``model.dtype`` reads a layer's weight)


def split_layer(layer: Linear) -> SplitLinear:
    """``layer`` as one ``Linear`` per part of its output rows (the parts share its bias, split alike)."""
    bounds = [0, *layer.splits, layer.out_features]
    parts = []
    for start, stop in zip(bounds, bounds[1:], strict=False):
        part = Linear(layer.in_features, stop - start, bias=layer.bias is not None, device="meta")
        part.weight = nn.Parameter(layer.weight.detach()[start:stop].clone(), requires_grad=False)
        if layer.bias is not None:
            part.bias = nn.Parameter(layer.bias.detach()[start:stop].clone(), requires_grad=False)
        parts.append(part)
    return SplitLinear(parts, bounds)


def quantize_layer(layer: Linear, mode: str) -> nn.Module:
    """``layer`` with quantized weights: the same module (its weight replaced), or a ``SplitLinear`` of quantized
    parts when the family reads it in parts."""
    if not layer.splits:
        quantize_weight_of(layer, mode)
        return layer
    split = split_layer(layer)
    for part in split.parts:
        quantize_weight_of(part, mode)  # type: ignore[arg-type]
    return split


def targets(model: nn.Module) -> list[str]:
    """Names of the layers ``quantize_model`` quantizes: every ``Linear`` inside the blocks, or those a model names
    itself (``quantization_targets``: DiffusionGemma's)."""
    own = getattr(model, "quantization_targets", None)
    if own is not None:
        return list(own())
    blocks = model.blocks  # type: ignore[attr-defined]
    prefix = next(name for name, m in model.named_modules() if m is blocks)
    return [f"{prefix}.{name}" for name, m in blocks.named_modules() if isinstance(m, Linear)]


def quantize_matrix(weight: Tensor, mode: str) -> Tensor:
    """One weight matrix (out, in) in ``mode`` (through a ``Linear`` of that shape, as every layer is quantized);
    the matrix as it is when int4 has no group size for its input width."""
    layer = Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    layer.weight = nn.Parameter(weight.detach(), requires_grad=False)
    quantize_weight_of(layer, mode)
    return layer.weight.detach()


def quantize_expert_tensors(model: nn.Module, mode: str, owner: str | None = None) -> None:
    """The experts held as 3-D tensors (a module with ``quantize_experts``: DiffusionGemma's), each expert's
    matrices quantized on their own; ``owner``: only that module (while loading)."""
    for name, m in model.named_modules():
        if hasattr(m, "quantize_experts") and (owner is None or name == owner):
            m.quantize_experts(lambda w: quantize_matrix(w, mode))


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    owner, _, leaf = name.rpartition(".")
    parent = model.get_submodule(owner)
    if parent._modules[leaf] is not new:
        parent._modules[leaf] = new


def _mark(model: nn.Module, mode: str) -> None:
    model.quantization = mode  # type: ignore[assignment]  # read by quantization_of


def quantize_model(model: nn.Module, mode: str | None) -> nn.Module:
    """Quantize ``model``'s linear layers (see the module doc) in place to ``mode``; returns the model."""
    mode = check_mode(mode)
    if mode is None:
        return model
    first = next(model.parameters())
    check_supported(mode, first.device, first.dtype)
    torchao_modules()
    for name in targets(model):
        layer = model.get_submodule(name)
        _replace(model, name, quantize_layer(layer, mode))  # type: ignore[arg-type]
    quantize_expert_tensors(model, mode)
    _mark(model, mode)
    return model


def mark_prequantized(model: nn.Module, mode: str) -> None:
    """A model whose weights came quantized from its checkpoint (``models/prequantized.py``): its mode recorded,
    and each layer the family reads in parts (``Linear.splits``) with a quantized weight stored as a
    ``SplitLinear`` of its rows' parts, as ``quantize_model`` stores it."""
    for name in targets(model):
        layer = model.get_submodule(name)
        if isinstance(layer, Linear) and layer.splits and is_quantized(layer.weight):
            _replace(model, name, split_layer(layer))
    _mark(model, mode)


def loading_quantizer(model: nn.Module, mode: str | None, device: torch.device | str = "cpu",
                      dtype: torch.dtype = torch.float32) -> Callable[[str], None] | None:
    """For ``load_model``: a callback taking the module name each loaded tensor went to; once a target layer
    holds all its tensors it is quantized at once, so its full-precision weight lives only until the next one
    is read. None when ``mode`` is None. Called before any weight is read, so that torchao missing or a
    ``device`` / ``dtype`` it cannot run (``check_supported``) is a one-line error before the load."""
    mode = check_mode(mode)
    if mode is None:
        return None
    check_supported(mode, device, dtype)
    torchao_modules()
    pending = set(targets(model))
    _mark(model, mode)

    experts = {name for name, m in model.named_modules() if hasattr(m, "quantize_experts")}

    def loaded(owner: str) -> None:
        if owner in experts:  # a 3-D expert tensor, quantized expert by expert as soon as it is read
            quantize_expert_tensors(model, mode, owner)
            return
        if owner not in pending:
            return
        layer = model.get_submodule(owner)
        if any(p.is_meta for p in layer.parameters(recurse=False)):
            return  # its bias is still to come
        pending.discard(owner)
        _replace(model, owner, quantize_layer(layer, mode))  # type: ignore[arg-type]

    return loaded


# ----- what a model holds ------------------------------------------------------------------------------------------

def is_quantized(t: Tensor) -> bool:
    """A torchao tensor subclass (its data in other tensors), not a plain tensor."""
    return type(t) not in (Tensor, nn.Parameter) and hasattr(t, "__tensor_flatten__")


def tensor_bytes(t: Tensor) -> int:
    """Bytes a tensor holds: a plain tensor's elements, or the sum over a quantized tensor's inner tensors (packed
    values, scales, zero points)."""
    if is_quantized(t):
        names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
        return sum(tensor_bytes(getattr(t, n)) for n in names if getattr(t, n, None) is not None)
    return t.numel() * t.element_size()


def weights_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer of ``model`` as held (quantized ones by their inner tensors)."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(tensor_bytes(t) for t in tensors.values())


_HELD: weakref.WeakKeyDictionary[nn.Module, dict[tuple[object, ...], int]] = weakref.WeakKeyDictionary()


def held_bytes(model: nn.Module, block: int | None = None) -> int:
    """``weights_bytes`` of ``model`` (or of its block ``block``), remembered for the model while its dtype and
    quantization stay the same: every finished generation and every round of prefills asks, and walking a model's
    parameters costs about a millisecond (a step of the embedded model takes a few)."""
    key = (getattr(model, "dtype", None), quantization_of(model), block)
    held = _HELD.setdefault(model, {})
    if key not in held:
        held[key] = weights_bytes(model if block is None else model.blocks[block])  # type: ignore[index]
    return held[key]


def quantization_of(model: nn.Module) -> str:
    """The model's weight quantization: "int8", "int4" or "none"."""
    return str(getattr(model, "quantization", None) or "none")


def unquantized_targets(model: nn.Module) -> list[str]:
    """The layers ``quantize_model`` was to quantize that hold an unquantized weight (int4 and a width its kernels
    cannot pack: ``int4_group``), by name; none where the model is not quantized."""
    if quantization_of(model) == "none":
        return []
    left = []
    for name in targets(model):
        layer = model.get_submodule(name)
        parts = layer.parts if isinstance(layer, SplitLinear) else [layer]
        if not all(is_quantized(part.weight) for part in parts):
            left.append(name)
    return left


def quantized_layers(model: nn.Module) -> tuple[list[str], list[str]]:
    """(names of the ``Linear`` layers whose weight is quantized, names of those that are not)."""
    done, kept = [], []
    for name, m in model.named_modules():
        if isinstance(m, Linear):
            (done if is_quantized(m.weight) else kept).append(name)
    return done, kept

