"""Several devices for one model: contiguous runs of layers per device (pipeline placement).

``--device-map auto`` splits the layers evenly over the visible GPUs; ``--device-map cuda:0,cuda:1`` (or
``cpu,cpu`` in tests) names the devices. The embedding sits with the first layer and the final norm and LM head
with the last. Each layer's compressed cache is created by that layer's attention, so it lives on the layer's
device; the engine moves the hidden state to the next layer's device between layers (one copy of a
(B, T, d) activation per device boundary). No accelerate hooks are needed because the engine drives the
blocks itself.
"""

from __future__ import annotations

import torch
from torch import nn

from maskkv_cli.errors import UsageError
from maskkv_cli.runtime.devices import check_device


def split_layers(n_layers: int, devices: list[torch.device]) -> list[torch.device]:
    """Device of each layer: ``len(devices)`` contiguous, nearly equal runs."""
    if not devices:
        raise UsageError("--device-map names no device")
    per, extra = divmod(n_layers, len(devices))
    out: list[torch.device] = []
    for i, dev in enumerate(devices):
        out += [dev] * (per + (1 if i < extra else 0))
    return out


def parse_device_map(spec: str | None, n_layers: int) -> list[torch.device] | None:
    """``auto`` (every visible GPU; None when fewer than two), or a comma list of devices."""
    if not spec:
        return None
    if spec == "auto":
        count = torch.cuda.device_count()
        return split_layers(n_layers, [torch.device(f"cuda:{i}") for i in range(count)]) if count > 1 else None
    entries = [d.strip() for d in spec.split(",")]
    if any(entries) and not all(entries):  # a device left out: the layers would be split over one device fewer
        raise UsageError(f"--device-map {spec}: entry {entries.index('') + 1} is empty; give one device per entry, "
                         "separated by commas (e.g. cuda:0,cuda:1)")
    try:
        devices = [torch.device(check_device(d)) for d in entries if d]
    except UsageError as exc:
        raise UsageError(f"--device-map {spec}: {exc}") from None
    return split_layers(n_layers, devices)


def place_model(model: nn.Module, layer_devices: list[torch.device]) -> nn.Module:
    """Move each block to its device, the embedding to the first and the head to the last."""
    blocks = model.blocks  # type: ignore[attr-defined]
    if len(layer_devices) != len(blocks):
        raise UsageError(f"device map has {len(layer_devices)} entries for {len(blocks)} layers")
    for block, dev in zip(blocks, layer_devices, strict=True):
        block.to(dev)
    model.place_ends(layer_devices[0], layer_devices[-1])  # type: ignore[attr-defined]
    model.layer_devices = list(layer_devices)  # type: ignore[attr-defined]
    return model
