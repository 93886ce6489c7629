"""Models built on the meta device: every parameter's shape and dtype, no memory, no initialisation.

A checkpoint's loader, the shape checks and the memory model build a model on the meta device and only read its
parameters' shapes (the loader then puts the checkpoint's tensors in their places). Under ``torch.device("meta")``
alone, the modules' constructors still run their random initialisation on the meta tensors; PyTorch serves
``normal_`` on the meta device by a Python decomposition whose first use imports ``torch._dynamo``, about a second
of every command's start. ``meta_device`` skips those fills: they have no values to fill.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

# The random initialisers modules call (a mode sees ``nn.init``'s own functions, the tensor passed by keyword) and
# the tensor methods they end in.
RANDOM_FILLS: frozenset[Callable[..., Any]] = frozenset({
    nn.init.normal_, nn.init.uniform_, nn.init.trunc_normal_, nn.init.kaiming_uniform_, nn.init.kaiming_normal_,
    nn.init.xavier_uniform_, nn.init.xavier_normal_, Tensor.normal_, Tensor.uniform_})


class _NoRandomFill(TorchFunctionMode):
    """A random fill of a meta tensor returns the tensor as it is; every other call runs as it would."""

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func in RANDOM_FILLS:
            tensor = args[0] if args else kwargs.get("tensor")
            if isinstance(tensor, Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


@contextmanager
def meta_device() -> Iterator[None]:
    """Modules built inside are on the meta device, without their random initialisation."""
    with torch.device("meta"), _NoRandomFill():
        yield
