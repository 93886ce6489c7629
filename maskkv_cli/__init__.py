"""maskkv: long documents with diffusion LLMs whose prompt KV cache is compressed with MaskKV.

The public Python API is documented in ``docs/api.md``. Heavy modules (torch, transformers) load lazily so
that ``import maskkv_cli`` and ``maskkv --help`` stay fast.
"""

from __future__ import annotations

from typing import Any

from maskkv_cli.runtime.allocator import configure_once

__version__ = "0.1.0"

# Importing the package fixes glibc's mmap and trim thresholds (``allocator.py``; ``MASKKV_MALLOC=default`` turns it
# off), before torch allocates anything, so the peak does not depend on what ran before.
configure_once()

_LAZY = {
    "load_model": "maskkv_cli.models.loading",
    "save_model": "maskkv_cli.models.loading",
    "load_tokenizer": "maskkv_cli.prompting",
    "generate": "maskkv_cli.sampling",
    "GenerationConfig": "maskkv_cli.sampling",
    "DreamOptions": "maskkv_cli.sampling",
    "generate_dream": "maskkv_cli.sampling",
    "sample": "maskkv_cli.sampling",
    "ask": "maskkv_cli.app.pipeline",
    "ModelConfig": "maskkv_cli.models.config",
    "named_config": "maskkv_cli.models.config",
    "LLaDA": "maskkv_cli.models.llada",
    "get_policy": "maskkv_cli.policies.base",
    "PolicyOptions": "maskkv_cli.policies.base",
    "Session": "maskkv_cli.app.session",
    "CacheConfig": "maskkv_cli.engine.plan",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'maskkv_cli' has no attribute {name!r}")
