"""Checkpoints whose weights were quantized before they were saved (the ``quantization_config`` of ``config.json``).

Hugging Face's convention names the method in ``quantization_config.quant_method`` (``fp8``, ``gptq``, ``awq``,
``bitsandbytes``, ``compressed-tensors``, ``torchao``, ...); older GPTQ exports carry a ``quantize_config.json``
instead. What maskkv loads of them:

- ``torchao`` with int8 weight-only tensors (``Int8WeightOnlyConfig``: ``Int8Tensor``, per output row): the layout
  torchao documents for safetensors (``torchao.prototype.safetensors``): a quantized tensor ``<module>.weight`` is
  stored as ``<module>._weight_qdata``, ``<module>._weight_scale`` (and ``_weight_zero_point``), and each file's
  metadata holds, under the tensor's name, its class and attributes as JSON; torchao's
  ``unflatten_tensor_state_dict`` rebuilds it. Such a weight runs as ``--quantize int8`` does (the same class).
- Everything else is refused in one line, before any weight is read: FP8 and int4 formats (torchao's int4 tensors
  are packed for one GPU kernel; GPTQ, AWQ, bitsandbytes, compressed-tensors and others have kernels of their own
  libraries), which the project does not run. Their models' fp32 / bf16 / fp16 releases load, and ``--quantize
  int8|int4`` quantizes them as they are read.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from maskkv_cli.errors import ModelLoadError

__all__ = ["LOADABLE", "PreQuantized", "TorchaoShard", "check_request", "read_prequantized"]

LOADABLE = ("Int8Tensor",)  # torchao tensor classes a pre-quantized checkpoint may hold
SUPPORTED = ("maskkv loads torchao int8 weight-only checkpoints (quant_method torchao, Int8WeightOnlyConfig) and "
             "fp32 / bf16 / fp16 ones, which --quantize int8|int4 quantizes as they load")


@dataclass(frozen=True)
class PreQuantized:
    """A checkpoint's own quantization: ``method`` as ``quant_method`` names it, ``detail`` in words, and the
    mode maskkv runs it as ("int8"), or None when it cannot."""

    method: str
    detail: str
    mode: str | None


def _describe(config: Mapping[str, Any]) -> str:
    """The quantization config in a few words (its method and what it says of bits, format or blocks)."""
    method = str(config.get("quant_method") or "unknown")
    parts = [method]
    for key in ("bits", "w_bit", "fmt", "format", "weight_block_size", "quant_type"):
        value = config.get(key)
        if value is not None and key != "quant_type":
            parts.append(f"{key} {value}")
    if config.get("load_in_4bit") or config.get("load_in_8bit"):
        parts.append("4-bit" if config.get("load_in_4bit") else "8-bit")
    quant_type = config.get("quant_type")
    if isinstance(quant_type, Mapping):
        inner = quant_type.get("default", quant_type)
        if isinstance(inner, Mapping) and inner.get("_type"):
            parts.append(str(inner["_type"]))
    elif isinstance(quant_type, str):
        parts.append(quant_type)
    return ", ".join(parts)


def read_prequantized(folder: Path, config: Mapping[str, Any] | None = None) -> PreQuantized | None:
    """The checkpoint's own quantization from ``config.json`` (``config``: it already parsed), or from a GPTQ
    ``quantize_config.json``; None for a checkpoint of plain weights."""
    if config is None:
        try:
            config = json.loads((folder / "config.json").read_text())
        except (OSError, json.JSONDecodeError):
            return None
    qc = config.get("quantization_config") if isinstance(config, Mapping) else None
    if qc is None and (folder / "quantize_config.json").is_file():
        try:
            qc = {"quant_method": "gptq", **json.loads((folder / "quantize_config.json").read_text())}
        except (OSError, json.JSONDecodeError):
            qc = {"quant_method": "gptq"}
    if qc is None:
        return None
    if not isinstance(qc, Mapping):
        return PreQuantized("unknown", "unreadable quantization_config", None)
    method = str(qc.get("quant_method") or "unknown").lower()
    detail = _describe(qc)
    if method == "torchao":
        quant_type = qc.get("quant_type")
        inner = quant_type.get("default") if isinstance(quant_type, Mapping) else None
        if isinstance(inner, Mapping) and inner.get("_type") == "Int8WeightOnlyConfig":
            return PreQuantized(method, detail, "int8")
    return PreQuantized(method, detail, None)


def check_request(pre: PreQuantized | None, folder: Path, quantize: str | None) -> str | None:
    """The mode a load runs: the checkpoint's own when it has one maskkv runs (a ``--quantize`` that differs is
    refused), else ``quantize``; a one-line ``ModelLoadError`` for a pre-quantized checkpoint maskkv cannot run."""
    if pre is None:
        return quantize
    if pre.mode is None:
        raise ModelLoadError(f"{folder} holds pre-quantized weights ({pre.detail}); {SUPPORTED}: load the model's "
                             "bf16 release with --quantize int8 or int4")
    if quantize not in (None, "none", pre.mode):
        raise ModelLoadError(f"{folder} holds {pre.mode} weights already ({pre.detail}); leave --quantize out (or "
                             f"give {pre.mode}), or load the model's bf16 release with --quantize {quantize}")
    return pre.mode


class TorchaoShard:
    """The quantized tensors of one torchao safetensors file, rebuilt from their parts and the file's metadata
    (``torchao.prototype.safetensors``): ``names`` maps each quantized tensor's name to its data keys, ``build``
    rebuilds one from the tensors read."""

    def __init__(self, metadata: Mapping[str, str] | None) -> None:
        self.metadata = dict(metadata or {})
        self.names: dict[str, list[str]] = {}  # tensor name -> its keys in the file
        self.kinds: dict[str, str] = {}
        for name in json.loads(self.metadata.get("tensor_names", "[]")):
            info = json.loads(self.metadata.get(name, "{}"))
            kind = str(info.get("_type", ""))
            if kind == "Tensor":  # a plain tensor (``torch.Tensor.__name__``), stored under its own name
                continue
            owner, _, leaf = name.rpartition(".")
            self.names[name] = [f"{owner}._{leaf}_{part}" for part in info.get("_tensor_data_names", [])]
            self.kinds[name] = kind

    def check(self, where: Path) -> None:
        """A one-line error for a tensor class maskkv does not run (int4, FP8, ...)."""
        other = sorted({k for k in self.kinds.values() if k not in LOADABLE})
        if other:
            raise ModelLoadError(f"{where} holds torchao {', '.join(other)} weights; {SUPPORTED}: load the model's "
                                 "bf16 release with --quantize int8 or int4")

    def build(self, name: str, parts: Mapping[str, Any]) -> Any:
        """The tensor ``name`` rebuilt from ``parts`` (its data keys -> tensors) with torchao's
        ``unflatten_tensor_state_dict``."""
        from maskkv_cli.models.quantize import torchao_modules

        torchao_modules()  # a missing torchao is the one-line error naming the extra
        from torchao.prototype.safetensors.safetensors_support import unflatten_tensor_state_dict

        rebuilt, _ = unflatten_tensor_state_dict(dict(parts), {"tensor_names": json.dumps([name]),
                                                               name: self.metadata[name]})
        return rebuilt[name]
