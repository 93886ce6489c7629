"""A checkpoint resolved once: the folder a model name stands for, its config and its identity.

A command resolves ``--model`` (a folder, or an ``ORG/NAME`` in the local Hugging Face cache) at its edge into one
``ModelFolder`` and passes that value down: the session loads the weights and the tokenizer from ``path``, the
cache plan looks the calibration profile up by ``config_hash`` for every prompt, and the results folders key
their rows by ``fingerprint``, without any layer resolving the name or hashing ``config.json`` again. The
library's entry points that take a path string (``load_model``, ``Session``, ``plan_cache``, the calibration
store) still do, once per call; ``ModelFolder.of`` turns either into this value.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from maskkv_cli.errors import ModelLoadError
from maskkv_cli.models.config import NAMED_CONFIGS, ModelConfig, ModelDefaults, read_model_defaults
from maskkv_cli.models.fingerprint import folder_fingerprint
from maskkv_cli.models.prequantized import PreQuantized
from maskkv_cli.paths import resolve_model_path

__all__ = ["ModelFolder", "config_hash"]


def config_hash(folder: Path) -> str:
    """12 hex digits of the sha256 of ``folder/config.json``, the JSON re-serialized with sorted keys (so that
    whitespace and key order do not matter; the raw bytes when it is not JSON)."""
    raw = (folder / "config.json").read_bytes()
    try:
        canonical = json.dumps(json.loads(raw), sort_keys=True, separators=(",", ":")).encode()
    except ValueError:
        canonical = raw
    return hashlib.sha256(canonical).hexdigest()[:12]


@dataclass(frozen=True)
class ModelFolder:
    """One checkpoint as a command runs it (see the module doc)."""

    name: str  # what was given (a folder or ORG/NAME): what the outputs call the model and the hints repeat
    path: Path  # the folder it resolved to (for an id, its snapshot in the HF cache)
    config: ModelConfig  # config.json, read once
    config_hash: str  # ``config_hash(path)``: the calibration profile's key
    prequantized: PreQuantized | None = None  # the checkpoint's own quantization (config.json, the same read)

    @classmethod
    def of(cls, model: str | os.PathLike[str] | ModelFolder) -> ModelFolder:
        """``model`` itself when it is one already; else the name resolved (``paths.resolve_model_path``, which
        raises ``ModelNotDownloaded`` / ``ModelLoadError``), its config read and hashed, once."""
        if isinstance(model, ModelFolder):
            return model
        from maskkv_cli.models.loading import read_folder_config  # torch: only when a folder is actually read

        try:
            path = resolve_model_path(model)
        except ModelLoadError as exc:  # a named shape has no "/", so it is never an ORG/NAME not downloaded
            if str(model) in NAMED_CONFIGS:  # a random-weight shape given where a checkpoint is read
                raise ModelLoadError(f"{exc}; {str(model)!r} names a shape with random weights, for `maskkv plan "
                                     "--model` and `maskkv bench speed|memory|loading|reuse --config`: pass a "
                                     "checkpoint folder or ORG/NAME") from None
            raise
        config, pre = read_folder_config(path)
        return cls(str(model), path, config, config_hash(path), pre)

    @cached_property
    def fingerprint(self) -> str:
        """``models.fingerprint.model_fingerprint`` of the folder (its files hashed), on first use only: batch and
        bench quality key their rows by it, a calibration profile records it; a plain ``ask`` reads it only to check
        a profile that records one."""
        return folder_fingerprint(self.path)

    @cached_property
    def defaults(self) -> ModelDefaults:
        """The checkpoint's stored defaults (``generation_config.json``: ``models.config.read_model_defaults``), read
        on first use only: the command's checks before loading and its session read the same value."""
        return read_model_defaults(self.path)

    def __str__(self) -> str:
        return self.name
