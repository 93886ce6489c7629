"""Bytes of a model's weights from its config alone, unquantized or as ``models/quantize.py`` would keep them.

The model is built on the meta device (no memory), so its structure is the family's own; each tensor is then
counted by what it would hold:

- a layer ``quantize.targets`` names (every ``models.rows.Linear`` inside the blocks), by ``quantized_matrix_bytes``:
  ``int8`` keeps one int8 per weight plus, per output row, an fp32 scale and an int8 zero point (torchao's
  ``Int8Tensor``); ``int4`` keeps two weights per byte plus, per group of ``g`` input columns and output row, a scale
  and a zero point in the model's dtype (``Int4OpaqueTensor``, ``g`` the largest of ``quantize.INT4_GROUPS`` that
  divides the input width; a layer no group divides stays unquantized, as ``quantize_weight_of`` leaves it). A bias
  stays in the model's dtype;
- every other parameter and buffer (embedding, norms, routers, the LM head) in the model's dtype.

DiffusionGemma (``models/diffusion_gemma.py``): the layers ``DiffusionGemma.quantization_targets`` names (every
``Linear`` of its layers except the router's projection, and the self-conditioning MLP's) and each expert's two
matrices (``gate_up_proj[e]`` of (2 I, d) and ``down_proj[e]`` of (d, I)) as 2-D weights, as ``quantize_model``
quantizes them (``Experts.quantize_experts``). The embedding (tied to the head), norms and routers stay in the
model's dtype.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from maskkv_cli.errors import UsageError
from maskkv_cli.models.meta import meta_device
from maskkv_cli.models.quantize import MODES, int4_group, targets

if TYPE_CHECKING:
    from maskkv_cli.models.config import ModelConfig
    from maskkv_cli.models.diffusion_gemma_config import DiffusionGemmaConfig

__all__ = ["INT8_ROW_BYTES", "WeightsEstimate", "quantized_matrix_bytes", "weights_estimate"]

INT8_ROW_BYTES = 5  # per output row of an int8 weight: an fp32 scale and an int8 zero point


def quantized_matrix_bytes(out_features: int, in_features: int, mode: str | None, element_bytes: int) -> int:
    """Bytes of one (out, in) weight matrix held as ``mode`` ("int8", "int4", or None: unquantized in
    ``element_bytes`` per value)."""
    if mode == "int8":
        return out_features * (in_features + INT8_ROW_BYTES)
    group = int4_group(in_features, out_features) if mode == "int4" else None  # as loading quantizes it
    if group is None:  # unquantized, or int4 where no group size divides the input width
        return out_features * in_features * element_bytes
    return out_features * in_features // 2 + (in_features // group) * out_features * 2 * element_bytes


@dataclass(frozen=True)
class WeightsEstimate:
    """Weight bytes of one model in one format, by part."""

    mode: str | None  # "int8", "int4" or None (unquantized)
    element_bytes: int  # of every tensor that is not quantized
    quantized_bytes: int  # the layers the format quantizes, as held (their biases excluded)
    quantized_params: int  # their weights' values
    other_bytes: int  # everything else: embedding, head, norms, routers, biases, buffers
    other_params: int
    implemented: bool  # False would mark a format maskkv cannot load the model in (the rules' estimate); none now

    @property
    def total_bytes(self) -> int:
        return self.quantized_bytes + self.other_bytes

    @property
    def params(self) -> int:
        return self.quantized_params + self.other_params


def _check(mode: str | None) -> str | None:
    if mode in (None, "none"):
        return None
    if mode not in MODES:
        raise UsageError(f"unknown quantization {mode!r}; choose one of none, {', '.join(MODES)}")
    return mode


Matrices = tuple[tuple[int, int, int], ...]  # (count, out, in) of the weights a format quantizes


def _split(model: nn.Module, matrices: list[tuple[str, int, int, int]]) -> tuple[Matrices, int]:
    """``matrices``: (tensor name, count, out, in), ``count`` matrices of one shape stored in one tensor (experts);
    returns them without names and the number of values of every other parameter and buffer."""
    named = {name: t for name, t in [*model.named_parameters(), *model.named_buffers()]}
    quantized = {name for name, *_ in matrices}
    rest = sum(t.numel() for name, t in named.items() if name not in quantized)
    return tuple(m[1:] for m in matrices), rest


@functools.lru_cache(maxsize=8)
def _linear_family(cfg: ModelConfig) -> tuple[Matrices, int]:
    from maskkv_cli.models.families import build_model

    with meta_device():
        model = build_model(cfg)
    matrices = []
    for name in targets(model):  # type: ignore[arg-type]
        layer = model.get_submodule(name)  # type: ignore[attr-defined]
        matrices.append((f"{name}.weight", 1, layer.out_features, layer.in_features))
    return _split(model, matrices)  # type: ignore[arg-type]


@functools.lru_cache(maxsize=8)
def _diffusion_gemma(cfg: DiffusionGemmaConfig) -> tuple[Matrices, int]:
    from maskkv_cli.models.diffusion_gemma import DiffusionGemma
    from maskkv_cli.models.rows import Linear

    with meta_device():
        model = DiffusionGemma(cfg)
    matrices = []
    for name in model.quantization_targets():
        m = model.get_submodule(name)
        assert isinstance(m, Linear)
        matrices.append((f"{name}.weight", 1, m.out_features, m.in_features))
    for i in range(cfg.n_layers):
        prefix = f"model.decoder.layers.{i}"
        experts, hidden, d = cfg.n_experts, cfg.moe_hidden_size, cfg.d_model
        matrices.append((f"{prefix}.experts.gate_up_proj", experts, 2 * hidden, d))
        matrices.append((f"{prefix}.experts.down_proj", experts, d, hidden))
    return _split(model, matrices)


def weights_estimate(cfg: ModelConfig | DiffusionGemmaConfig, mode: str | None,
                     element_bytes: int = 2) -> WeightsEstimate:
    """The weight bytes of ``cfg`` held as ``mode`` (None / "none": unquantized), ``element_bytes`` per value of
    every tensor not quantized (2: bf16)."""
    from maskkv_cli.models.config import ModelConfig
    from maskkv_cli.models.diffusion_gemma_config import DiffusionGemmaConfig

    mode = _check(mode)
    if isinstance(cfg, ModelConfig) and cfg.family_config is not None:
        cfg = cfg.family_config  # a DiffusionGemma's ModelConfig: its own config
    dgemma = isinstance(cfg, DiffusionGemmaConfig)
    matrices, rest = _diffusion_gemma(cfg) if dgemma else _linear_family(cfg)  # type: ignore[arg-type]
    q_bytes = sum(n * quantized_matrix_bytes(out, inp, mode, element_bytes) for n, out, inp in matrices)
    q_params = sum(n * out * inp for n, out, inp in matrices)
    return WeightsEstimate(mode, element_bytes, q_bytes, q_params, rest * element_bytes, rest, implemented=True)
