"""Models built on the meta device without their random initialisation (``models/meta.py``)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from maskkv_cli.models.config import named_config
from maskkv_cli.models.diffusion_gemma import DiffusionGemma
from maskkv_cli.models.diffusion_gemma_config import named_config as gemma_config
from maskkv_cli.models.families import build_model
from maskkv_cli.models.meta import meta_device

FAMILIES = ["tiny", "dream-tiny", "llada2-tiny", "llada-moe-tiny"]


def _layout(model: torch.nn.Module) -> list[tuple[str, tuple[int, ...], torch.dtype, str]]:
    return [(name, tuple(t.shape), t.dtype, t.device.type)
            for name, t in [*model.named_parameters(), *model.named_buffers()]]


@pytest.mark.parametrize("name", [*FAMILIES, "diffusiongemma-tiny"])
def test_meta_device_builds_the_same_parameters_as_the_plain_meta_device(name):
    build = (lambda: DiffusionGemma(gemma_config(name))) if name.startswith("diffusiongemma") \
        else (lambda: build_model(named_config(name)))
    with torch.device("meta"):
        plain = build()
    with meta_device():
        skipped = build()
    assert _layout(skipped) == _layout(plain)
    assert all(device == "meta" for *_, device in _layout(skipped))


def test_meta_device_still_fills_tensors_that_hold_values():
    """Only meta tensors skip their fills: a real tensor made inside is filled as anywhere else."""
    gen = torch.Generator().manual_seed(0)
    with meta_device():
        real = torch.empty(64, device="cpu")
        torch.nn.init.normal_(real, generator=gen)
        lin = torch.nn.Linear(4, 4, device="cpu")
    expected = torch.empty(64).normal_(generator=torch.Generator().manual_seed(0))
    assert torch.equal(real, expected)
    assert lin.weight.abs().sum() > 0


def test_building_every_family_on_the_meta_device_does_not_import_dynamo():
    """The random fills of meta tensors run through a Python decomposition that imports torch._dynamo (about a
    second of every command's start): a fresh process building every family (as loading does) never imports it."""
    code = (
        "import sys\n"
        "from maskkv_cli.models.meta import meta_device\n"
        "from maskkv_cli.models.families import build_model, parameter_shapes\n"
        "from maskkv_cli.models.config import named_config\n"
        "from maskkv_cli.models.diffusion_gemma import checkpoint_shapes\n"
        "from maskkv_cli.models.diffusion_gemma_config import named_config as gemma_config\n"
        f"for name in {FAMILIES!r}:\n"
        "    parameter_shapes(named_config(name))\n"
        "    with meta_device():\n"
        "        build_model(named_config(name))\n"
        "checkpoint_shapes(gemma_config('diffusiongemma-tiny'))\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
